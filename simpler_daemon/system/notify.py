"""A small sd_notify client: readiness, status, watchdog and stopping messages to systemd.

systemd (``Type=notify``) passes ``NOTIFY_SOCKET`` (a path, or ``@name`` for an
abstract socket) and, with ``WatchdogSec=``, ``WATCHDOG_USEC`` and
``WATCHDOG_PID``. Each message is one datagram of ``KEY=value`` lines::

    daemon --(AF_UNIX, SOCK_DGRAM)--> $NOTIFY_SOCKET     "READY=1\\nSTATUS=serving"

A reload (SIGHUP) is ``RELOADING=1`` + ``MONOTONIC_USEC=<now>``, then ``READY=1``.

Sending never raises: a daemon that runs without systemd, or whose manager went
away, keeps working; the first failure is logged at debug level.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Final

__all__ = ["SystemdNotifier"]

# The logger keeps the name it had when this module lived in server/ (operators filter on it).
logger = logging.getLogger("simpler_daemon.server.notify")

_ENV_NAMES: Final = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

# The notify socket is local and drained promptly by systemd; bound the rare
# case of a full queue so a wedged manager cannot stall the event loop for long.
_SEND_TIMEOUT: Final = 1.0


class SystemdNotifier:
    """Sends ``sd_notify`` messages; every method is a no-op when not under systemd.

    Build it with :meth:`from_env`. The socket is opened on the first send and
    closed by :meth:`close` (also a context manager).
    """

    def __init__(
        self,
        address: str | None,
        *,
        watchdog_usec: int | None = None,
        watchdog_pid: int | None = None,
    ) -> None:
        """``address`` is ``NOTIFY_SOCKET`` as systemd gives it (``/path`` or ``@abstract``);
        ``None``, ``""`` or an unsupported form disable the notifier."""
        self._address: str | None = None
        if address and address[0] in "/@":
            # Abstract names are spelled with a leading NUL on the wire.
            self._address = "\0" + address[1:] if address[0] == "@" else address
        elif address:
            logger.debug("NOTIFY_SOCKET %r is not a path or @name; not notifying", address)
        self._watchdog_usec = watchdog_usec
        self._watchdog_pid = watchdog_pid
        self._sock: socket.socket | None = None
        self._closed = False
        self._logged_failure = False

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, unset: bool = False
    ) -> SystemdNotifier:
        """Read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID``.

        ``unset=True`` removes them from ``os.environ`` (only when ``env`` is
        ``None``) so processes started later do not inherit them.
        """
        source = os.environ if env is None else env
        usec = _parse_int(source.get("WATCHDOG_USEC"))
        pid = _parse_int(source.get("WATCHDOG_PID"))
        notifier = cls(source.get("NOTIFY_SOCKET"), watchdog_usec=usec, watchdog_pid=pid)
        if unset and env is None:
            for name in _ENV_NAMES:
                os.environ.pop(name, None)
        return notifier

    @property
    def enabled(self) -> bool:
        """True when a notify socket was given and :meth:`close` was not called."""
        return self._address is not None and not self._closed

    @property
    def closed(self) -> bool:
        return self._closed

    def notify(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines (``notify(READY=1, STATUS="up")``); True when sent.

        Newlines in values are replaced by spaces: a value cannot span lines.
        """
        if not self.enabled or not fields:
            return False
        text = "\n".join(f"{key}={_format(value)}" for key, value in fields.items())
        return self._send(text.encode("utf-8", "replace"))

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: start-up finished (every child ready, sockets bound)."""
        if status is None:
            return self.notify(READY=1)
        return self.notify(READY=1, STATUS=status)

    def reloading(self, status: str | None = None) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC`` (the clock reading systemd's
        ``Type=notify-reload`` requires, so it can tell this reload from an older one);
        send :meth:`ready` once the reload is done."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        if status is None:
            return self.notify(RELOADING=1, MONOTONIC_USEC=usec)
        return self.notify(RELOADING=1, MONOTONIC_USEC=usec, STATUS=status)

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: shutdown began."""
        if status is None:
            return self.notify(STOPPING=1)
        return self.notify(STOPPING=1, STATUS=status)

    def status(self, text: str) -> bool:
        """``STATUS=...``: the one-line state shown by ``systemctl status``."""
        return self.notify(STATUS=text)

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the event loop is alive."""
        return self.notify(WATCHDOG=1)

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC``: ask for more start-up or shutdown time."""
        return self.notify(EXTEND_TIMEOUT_USEC=max(0, int(seconds * 1_000_000)))

    def watchdog_interval(self) -> float | None:
        """The watchdog timeout in seconds that systemd enforces, or None when off.

        None too when ``WATCHDOG_PID`` names another process (the variables
        were inherited, not meant for us). Ping every half of this value
        (:meth:`ping_period`).
        """
        if not self._watchdog_usec or self._watchdog_usec <= 0:
            return None
        if self._watchdog_pid is not None and self._watchdog_pid != os.getpid():
            return None
        return self._watchdog_usec / 1_000_000

    def ping_period(self) -> float | None:
        """Half the watchdog timeout: how often to call :meth:`watchdog`."""
        interval = self.watchdog_interval()
        return None if interval is None else interval / 2

    def close(self) -> None:
        """Close the socket; later sends are no-ops. Idempotent."""
        self._closed = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> SystemdNotifier:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        shown = None if self._address is None else self._address.replace("\0", "@", 1)
        return f"<SystemdNotifier address={shown!r} closed={self._closed}>"

    def _send(self, data: bytes) -> bool:
        assert self._address is not None
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.settimeout(_SEND_TIMEOUT)
                self._sock = sock
            self._sock.sendto(data, self._address)
        except OSError as exc:
            if not self._logged_failure:
                self._logged_failure = True
                logger.debug("cannot notify systemd at %r: %s", self._address, exc)
            return False
        return True


def _format(value: str | int) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value).replace("\n", " ")


def _parse_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None
