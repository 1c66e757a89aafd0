"""simplerctl output: exit codes, daemon answers as JSON data, tables and status lines.

Every command formats through :class:`Out`, which prints human text or JSON
on stdout and errors on stderr; the helpers below only turn daemon answers
(protobuf messages such as ``RunEvent`` and ``WorkerInfo``, or the client's
``RunResult`` / ``RunSummaryInfo``) into strings or plain data and never talk
to the daemon.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Final, TextIO

from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

__all__ = [
    "EXIT_EXHAUSTED",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_PIPE",
    "EXIT_REFUSED",
    "EXIT_TIMEOUT",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "CliExit",
    "Out",
    "error_message",
    "event_line",
    "human_bytes",
    "human_seconds",
    "plain",
    "print_status",
    "progress_fields",
    "progress_line",
    "remote_header",
    "remote_row",
    "result_lines",
    "short_name",
    "state_name",
    "status_dict",
    "to_dict",
    "worker_header",
    "worker_rows",
]

# Exit statuses of simplerctl (documented in cli.py, the README and `simplerctl --help`).
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_UNREACHABLE: Final = 3
EXIT_NOT_FOUND: Final = 4
EXIT_TIMEOUT: Final = 5
EXIT_EXHAUSTED: Final = 6
EXIT_REFUSED: Final = 7
EXIT_INTERRUPTED: Final = 130
EXIT_PIPE: Final = 141


class CliExit(Exception):
    """Stop the command with exit status ``code`` (the message is already printed)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def to_dict(msg: Any) -> dict[str, Any]:
    """A message as plain JSON data: enum names without their type's prefix (``CANCELLED``,
    as the text output spells them), ints as numbers, RFC 3339 timestamps."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        name = field.name
        if field.has_presence and not msg.HasField(name):
            continue
        value = getattr(msg, name)
        if field.is_repeated:
            out[name] = [_value(field, v) for v in value]
        else:
            out[name] = _value(field, value)
    return out


def _value(field: Any, value: Any) -> Any:
    if field.type == field.TYPE_MESSAGE:
        if field.message_type.full_name == "google.protobuf.Timestamp":
            return value.ToJsonString() if (value.seconds or value.nanos) else None
        return to_dict(value)
    if field.type == field.TYPE_ENUM:
        ev = field.enum_type.values_by_number.get(value)
        return short_name(ev.name) if ev is not None else value
    if field.type == field.TYPE_BYTES:
        return value.hex()
    return value


#: The prefix of every value of a proto enum (``RUN_STATE_`` of ``RunState``), by its name.
_ENUM_PREFIXES: Final = tuple(
    re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper() + "_" for name in pb.DESCRIPTOR.enum_types_by_name
)


def short_name(enum_name: str) -> str:
    """A proto enum value's name without its type's prefix: ``RUN_STATE_CANCELLED`` ->
    ``CANCELLED``. The one spelling of states and kinds, in text and in ``--json``."""
    for prefix in _ENUM_PREFIXES:
        if enum_name.startswith(prefix):
            return enum_name[len(prefix) :]
    return enum_name


class Out:
    """Human text or JSON on stdout; errors on stderr."""

    def __init__(self, as_json: bool, stream: TextIO | None = None) -> None:
        self.json = as_json
        self.stream = stream or sys.stdout
        #: With ``--json`` a command prints exactly one document: set once it did.
        self.printed = False

    def data(self, obj: Any) -> None:
        self.printed = True
        print(
            json.dumps(obj, indent=None if isinstance(obj, list) else 2, default=str),
            file=self.stream,
            flush=True,
        )

    def record(self, obj: Any) -> None:
        """One JSON object on one line (a stream of them: ``--json watch``)."""
        print(json.dumps(obj, default=str), file=self.stream, flush=True)

    def note(self, text: str) -> None:
        """A remark for the human at the terminal, on stderr (never mixed into data)."""
        print(f"simplerctl: {text}", file=sys.stderr, flush=True)

    def line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def table(self, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        cells = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        for r in cells:
            self.line("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())

    def error(self, code: str, message: str, *, document: bool = True) -> None:
        """The error on stderr; with ``--json`` also as the command's one document on
        stdout, unless ``document`` is False (the error of one item, which the
        command's own document lists) or a document was printed already."""
        if self.json and document and not self.printed:
            self.printed = True
            print(json.dumps({"error": {"code": code, "message": message}}), file=self.stream)
        print(
            f"simplerctl: {code}: {message}" if code else f"simplerctl: {message}",
            file=sys.stderr,
            flush=True,
        )


def state_name(state: int) -> str:
    state = int(state)
    return short_name(pb.RunState.Name(state)) if state in pb.RunState.values() else str(state)


def plain(obj: Any) -> Any:
    """The client's result types (dataclasses) as JSON data, spelt like :func:`to_dict`
    spells the proto message they mirror: enum names without their prefix
    (``COMPLETED``), RFC 3339 times, None for an absent message."""
    if hasattr(obj, "DESCRIPTOR"):
        return to_dict(obj)
    if isinstance(obj, enum.IntEnum) and type(obj).__name__ == "RunPhase":
        return state_name(int(obj)) if int(obj) in pb.RunState.values() else int(obj)
    if isinstance(obj, datetime):
        return obj.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, bytes):
        return obj.hex()
    return obj


def status_dict(status: Any) -> dict[str, Any]:
    """A run's status (``pb.RunStatus`` or the client's ``RunResult``) as JSON data."""
    out = plain(status)
    if isinstance(out, dict):
        out.pop("terminal", None)
        if not out.get("error") or not out["error"].get("message"):
            out["error"] = None
    return out  # type: ignore[no-any-return]


def error_message(status: Any) -> str:
    """The run's error message, "" when it has none (proto or client type)."""
    err = getattr(status, "error", None)
    return str(err.message) if err is not None and err.message else ""


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB`` (binary units, as the heap is sized)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_seconds(seconds: float) -> str:
    """``75.3`` -> ``1m15s``; under a minute with one decimal."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def print_status(out: Out, status: Any) -> None:
    if out.json:
        out.data(status_dict(status))
        return
    c = status.counts
    out.line(
        f"run {status.run_id}: {state_name(status.state)} "
        f"(done {c.done}/{c.total}, failed {c.failed}, running {c.running})"
    )
    message = error_message(status)
    if status.state in (pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED, pb.RUN_STATE_LOST) and message:
        out.line(f"  error: {message}")


def result_lines(status: Any) -> list[str]:
    """``  task 0 returned 42``: the tasks' return values of a finished run (``wait`` and
    ``submit --wait|--watch`` print the same lines)."""
    lines = []
    for r in getattr(status, "results", ()):
        member = "" if r.member_index is None else f" member {r.member_index}"
        lines.append(f"  task {r.task_index}{member} returned {shown_value(r.value)}")
    return lines


#: Characters of a return value's repr a line shows.
SHOWN_CHARS: Final = 200


def shown_value(value: Any) -> str:
    """``repr(value)``, cut at ``SHOWN_CHARS`` with the size of the whole (a result may
    be megabytes: the terminal gets its head and size)."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    size = f"{len(value)} bytes" if isinstance(value, (bytes, str)) else f"{len(text)} chars"
    return f"{text[:SHOWN_CHARS]}... ({type(value).__name__} of {size})"


def worker_header() -> list[str]:
    """The columns of :func:`worker_rows`."""
    return ["ID", "KIND", "STATE", "PID", "TASKS", "RESTARTS", "MESSAGE"]


def worker_rows(workers: Sequence[pb.WorkerInfo], depth: int = 0) -> list[list[Any]]:
    """``simplerctl workers``: one row per worker, a local L3 worker's own SUB and chip
    children right below it, their ids indented (the tree L4 -> L3 -> children)."""
    rows: list[list[Any]] = []
    for w in workers:
        rows.append(
            [
                "  " * depth + str(w.worker_id),
                short_name(pb.WorkerKind.Name(w.kind)),
                short_name(pb.WorkerState.Name(w.state)),
                w.pid,
                w.tasks_completed,
                w.restarts,
                w.message or w.endpoint,
            ]
        )
        rows += worker_rows(w.children, depth + 1)
    return rows


def remote_header() -> list[str]:
    """The columns of :func:`remote_row`."""
    return [
        "ID",
        "KIND",
        "ENDPOINT",
        "SESSION",
        "RUNNER_PID",
        "STATE",
        "HEALTH_AGE_S",
        "RTT_US",
        "FAILURES",
        "RECONNECTS",
        "ATTEMPTS",
        "NEXT_TRY_S",
    ]


def remote_row(w: pb.WorkerInfo) -> list[Any]:
    """One remote L3 session of ``simplerctl workers``."""
    r = w.remote
    host = f"[{r.host}]" if ":" in r.host else r.host
    return [
        w.worker_id,
        "remote",
        f"{host}:{r.port}",
        r.session_id,
        r.runner_pid,
        pb.RemoteSessionState.Name(r.state).removeprefix("REMOTE_SESSION_STATE_").lower(),
        f"{r.health_age_seconds:.3f}",
        f"{r.round_trip_us:.0f}",
        r.failures,
        r.reconnects,
        r.reconnect_attempts,  # of the outage under way (0 while ready)
        f"{r.next_try_seconds:.1f}" if r.HasField("next_try_seconds") else "-",
    ]


def progress_fields(ev: pb.RunEvent, elapsed: float) -> dict[str, Any]:
    """What the progress bar shows besides the event: elapsed seconds, tasks finished per
    second, the estimated seconds left (None until a task has finished)."""
    c = ev.counts
    finished = c.done + c.failed
    rate = finished / elapsed if elapsed > 0 else 0.0
    eta: float | None = None
    if ev.state in (
        pb.RUN_STATE_COMPLETED,
        pb.RUN_STATE_FAILED,
        pb.RUN_STATE_CANCELLED,
        pb.RUN_STATE_LOST,
    ):
        eta = 0.0
    elif rate > 0:
        eta = (c.total - finished) / rate
    return {
        "elapsed_seconds": round(elapsed, 3),
        "rate_per_second": round(rate, 3),
        "eta_seconds": None if eta is None else round(eta, 3),
    }


def progress_line(ev: pb.RunEvent, elapsed: float = 0.0, width: int = 30) -> str:
    c = ev.counts
    total = max(c.total, 1)
    finished = c.done + c.failed
    filled = min(width, round(width * finished / total))
    bar = "#" * filled + "-" * (width - filled)
    f = progress_fields(ev, elapsed)
    eta = "?" if f["eta_seconds"] is None else human_seconds(f["eta_seconds"])
    return (
        f"run {ev.run_id} [{bar}] {finished}/{c.total} {100 * finished // total}%  "
        f"done {c.done}  failed {c.failed}  running {c.running}  "
        + (f"retried {c.retried}  " if c.retried else "")
        + f"{human_seconds(elapsed)} elapsed  {f['rate_per_second']:.1f} tasks/s  ETA {eta}  "
        f"{state_name(ev.state)}"
    )


def event_line(ev: pb.RunEvent) -> str:
    parts = [f"run {ev.run_id}", f"#{ev.sequence}", short_name(pb.RunEventType.Name(ev.type))]
    if ev.HasField("task_index"):
        parts.append(f"task {ev.task_index}")
    if ev.HasField("member_index"):
        parts.append(f"member {ev.member_index}")
    if ev.HasField("worker_id"):
        parts.append(f"worker {ev.worker_id}")
    if ev.attempt > 1 or ev.type == pb.RUN_EVENT_TYPE_TASK_RETRYING:
        parts.append(f"attempt {ev.attempt}")
    if ev.outcome:
        parts.append(ev.outcome)
    c = ev.counts
    retried = f", retried {c.retried}" if c.retried else ""
    parts.append(f"(done {c.done}/{c.total}, failed {c.failed}, running {c.running}{retried})")
    parts.append(state_name(ev.state))
    if ev.message:
        parts.append("- " + ev.message.splitlines()[0])
    return " ".join(parts)
