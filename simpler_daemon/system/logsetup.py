"""Logging of the daemon processes: text, journald-aware text, or one JSON object per line.

::

    configure_logging(fmt, level)     root handler on stderr
      log_format = "text"             2026-11-30 16:20:01,123 WARNING simpler_daemon.ops: ...
        under journald                <4>simpler_daemon.ops: ...        (no timestamp: the
                                      journal has one; <N> is the syslog priority, so
                                      journalctl -p warning works)
      log_format = "json"             {"time": ..., "level": "warning", "logger": ..., ...}
                                      and sys.stdout / sys.stderr become line-to-record
                                      streams, so a print() anywhere (a task, a child's
                                      traceback) is a JSON record too: the stream stays pure

journald is detected the way systemd documents it: ``$JOURNAL_STREAM`` holds
``<device>:<inode>`` of the stream connected to the journal, and it is used only when
it names the stream we write to (a child of a service that redirected its stderr
inherits the variable but not the journal).

Forked children inherit all of it (the handler, the wrapped streams, the level).
"""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, Final, Literal, TextIO

__all__ = [
    "JournalFormatter",
    "JsonFormatter",
    "LogLineStream",
    "TextFormatter",
    "announcer",
    "configure_logging",
    "journal_stream",
    "set_level",
    "syslog_priority",
]

LogFormat = Literal["text", "json"]

_STANDARD_ATTRS: Final = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys()
    | {"message", "asctime", "taskName"}
)

#: syslog priorities (RFC 5424) by logging level, for journald's ``<N>`` prefix.
_PRIORITIES: Final = (
    (logging.CRITICAL, 2),
    (logging.ERROR, 3),
    (logging.WARNING, 4),
    (logging.INFO, 6),
)


def syslog_priority(levelno: int) -> int:
    """2 crit, 3 err, 4 warning, 6 info, 7 debug."""
    for threshold, priority in _PRIORITIES:
        if levelno >= threshold:
            return priority
    return 7


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD_ATTRS}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, pid, extras, exception."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        out.update(_extras(record))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message key=value...``; an operator record (it has an
    ``event``, see server/oplog.py) already says everything in its message."""

    def __init__(self, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s") -> None:
        super().__init__(fmt)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extras = _extras(record)
        if extras and "event" not in extras:
            text += " " + " ".join(f"{k}={v!r}" for k, v in extras.items())
        return text


class JournalFormatter(TextFormatter):
    """Text for journald: no timestamp (the journal stamps each entry) and every line
    prefixed with ``<priority>`` (journald splits a traceback into one entry per line;
    each keeps the record's level)."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


def journal_stream(stream: TextIO, env: dict[str, str] | None = None) -> bool:
    """True when ``$JOURNAL_STREAM`` names ``stream`` (systemd connected it to journald)."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    if not (device.isdigit() and inode.isdigit()):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        return False
    return (st.st_dev, st.st_ino) == (int(device), int(inode))


class LogLineStream(io.TextIOBase):
    """A text stream whose every line becomes one log record (``print()`` -> JSON).

    Partial lines wait for their newline (or a flush); a line is cut at 64 KiB so a
    runaway writer cannot grow the buffer without bound.
    """

    _MAX_LINE: Final = 1 << 16

    def __init__(self, logger: logging.Logger, level: int, fileno: int) -> None:
        super().__init__()
        self._logger = logger
        self._level = level
        self._fileno = fileno
        self._pending = ""
        self._lock = threading.Lock()
        # A handler that fails writes its complaint to sys.stderr, i.e. here: drop
        # that instead of recursing.
        self._busy = threading.local()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        # faulthandler and subprocess ask for a descriptor: the real stream's.
        return self._fileno

    def write(self, text: str) -> int:
        lines: list[str] = []
        with self._lock:  # threads print too (orchestration functions in the daemon)
            self._pending += text
            while "\n" in self._pending:
                line, _, self._pending = self._pending.partition("\n")
                lines.append(line)
            while len(self._pending) > self._MAX_LINE:
                lines.append(self._pending[: self._MAX_LINE])
                self._pending = self._pending[self._MAX_LINE :]
        for line in lines:  # outside the lock: a failing handler writes back here
            self._emit(line)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            line, self._pending = self._pending, ""
        if line:
            self._emit(line)

    def _emit(self, line: str) -> None:
        if not line.strip() or getattr(self._busy, "on", False):
            return
        self._busy.on = True
        try:
            self._logger.log(self._level, "%s", line.rstrip("\r"))
        finally:
            self._busy.on = False


#: The real stdout/stderr once configure_logging() wrapped them (JSON mode).
_real_streams: tuple[TextIO, TextIO] | None = None


def configure_logging(log_format: str, log_level: str, stream: TextIO | None = None) -> None:
    """Root logging for a daemon process: ``log_format`` (``"text"`` or ``"json"``) and
    ``log_level`` (a level name) come from ``[daemon]`` or the remote worker's
    ``[worker]``; one handler on ``stream`` (default stderr), no thread.

    JSON: ``sys.stdout`` and ``sys.stderr`` become :class:`LogLineStream` s (INFO and
    WARNING records of ``simpler_daemon.stdout`` / ``simpler_daemon.stderr``), so code
    that prints, here or in a forked child, still writes JSON.
    """
    global _real_streams
    if _real_streams is not None:  # configured before: undo the wrapping first
        sys.stdout, sys.stderr = _real_streams
        _real_streams = None
    target = stream or sys.stderr
    handler = logging.StreamHandler(target)
    formatter: logging.Formatter
    if log_format == "json":
        formatter = JsonFormatter()
    elif journal_stream(target):
        formatter = JournalFormatter()
    else:
        formatter = TextFormatter()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(log_level.upper())
    if log_format == "json" and stream is None:
        out, err = sys.stdout, sys.stderr
        for s in (out, err):
            s.flush()
        _real_streams = (out, err)
        sys.stdout = LogLineStream(
            logging.getLogger("simpler_daemon.stdout"), logging.INFO, _fd(out, 1)
        )
        sys.stderr = LogLineStream(
            logging.getLogger("simpler_daemon.stderr"), logging.WARNING, _fd(err, 2)
        )


def _fd(stream: TextIO, default: int) -> int:
    try:
        return stream.fileno()
    except (OSError, ValueError, io.UnsupportedOperation):
        return default


def set_level(level: str) -> None:
    """Change the root level at run time (SIGHUP reload)."""
    logging.getLogger().setLevel(level.upper())


def announcer(log_format: LogFormat, prefix: str = "") -> Callable[[str], None]:
    """Where start-up lines go (``listening on unix:...``): stdout as ``<prefix>: line``
    (or the bare line) in text, one JSON object (logger ``simpler_daemon.main``) in JSON."""
    formatter = JsonFormatter()

    def announce(line: str) -> None:
        out = _real_streams[0] if _real_streams is not None else sys.stdout
        if log_format == "json":
            record = logging.LogRecord(
                "simpler_daemon.main", logging.INFO, __file__, 0, "%s", (line,), None
            )
            out.write(formatter.format(record) + "\n")
        else:
            out.write(f"{prefix}: {line}\n" if prefix else line + "\n")
        out.flush()

    return announce
