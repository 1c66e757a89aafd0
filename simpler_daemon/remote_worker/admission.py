"""What ``simpler-remote-worker`` allows a connection before it has authenticated.

::

    accept ──► Admission.admit(host, peer)      counted from here on, before TLS
                 per source  > sessions.max_connections_per_source ─┐ close that source's
                 in all      > sessions.max_connections ────────────┤ oldest handshake not
                                                                     ┘ yet authenticated
                 (every handshake in the way authenticated: the new one is refused)
    TLS + token + manifest within sessions.handshake_timeout  (the service bounds it)
    wrong token ──► FailurePacing.failed(host) -> seconds to wait before answering

A parent sends its token right after connecting, so the oldest unauthenticated
handshakes are the idle or slow ones: a flood of them, even from the parent's own
address, never keeps a prompt parent out. Failed authentications are slowed, never
the source: a correct token is always compared and accepted at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from dataclasses import dataclass, field
from typing import Final

from simpler_daemon.remote.manifest import HandshakeReply, encode_lp_json
from simpler_daemon.system.authguard import FailedAuthLimiter

__all__ = [
    "ERROR_TEXT_LIMIT",
    "FAILED_AUTH_DELAY_S",
    "Admission",
    "FailurePacing",
    "Pending",
    "abort",
    "listen_socket",
    "refuse",
]

#: A wrong token from a source with too many failures is answered after this long.
FAILED_AUTH_DELAY_S: Final = 1.0
#: Closing connections to make room is logged at warning once per source per this long.
_EVICT_LOG_EVERY_S: Final = 60.0
_MAX_LOGGED_HOSTS: Final = 4096
#: Longest error text a reply carries.
ERROR_TEXT_LIMIT: Final = 4096
# After refusing a connection: how long unread input is drained so that closing
# does not reset the connection before the peer has read the reply.
_LINGER: Final = 1.0
# Unread input drained at most after a refusal: a whole manifest.
_MAX_DRAIN: Final = 16 << 20
_LISTEN_BACKLOG: Final = 128

log = logging.getLogger("simpler_daemon.remote.worker")


@dataclass(slots=True, eq=False)
class Pending:
    """One connection in its handshake (TLS, token, manifest), from accept on."""

    host: str
    peer: str
    since: float = field(default_factory=time.monotonic)
    #: Its token was right: it is a parent's, and is never closed to make room.
    authenticated: bool = False
    #: Closed to make room for a newer connection (see :meth:`Admission.admit`).
    evicted: bool = False
    task: asyncio.Task[None] | None = None


def _unauthenticated(handshakes: dict[int, Pending]) -> int:
    return sum(1 for hs in handshakes.values() if not hs.authenticated and not hs.evicted)


class Admission:
    """Connections in their handshake, by source address (oldest first), and the limits."""

    def __init__(self, max_connections: int, max_per_source: int) -> None:
        self.max_connections = max_connections
        self.max_per_source = max_per_source
        self._pending: dict[str, dict[int, Pending]] = {}
        self._evict_logged: dict[str, float] = {}

    def count(self) -> int:
        return sum(len(v) for v in self._pending.values())

    def admit(self, host: str, peer: str) -> tuple[Pending, str]:
        """Count a new connection, making room by closing (cancelling the task of) the
        oldest unauthenticated handshake when a limit is full. Returns its record and
        "" or, when nothing could make room, the refusal text (it is then not counted)."""
        if len(self._pending.get(host, ())) >= self.max_per_source:
            self._evict(host, "sessions.max_connections_per_source")
        if self.count() >= self.max_connections:
            victim = max(self._pending, key=lambda h: _unauthenticated(self._pending[h]))
            self._evict(victim, "sessions.max_connections")
        mine = self._pending.get(host, {})
        hs = Pending(host, peer)
        if len(mine) >= self.max_per_source:
            return hs, (
                f"cannot open session: {len(mine)} connections from {host} are already "
                "in their handshake (limit sessions.max_connections_per_source)"
            )
        if self.count() >= self.max_connections:
            return hs, (
                f"cannot open session: {self.count()} connections are already in their "
                "handshake (limit sessions.max_connections)"
            )
        self._pending.setdefault(host, {})[id(hs)] = hs
        return hs, ""

    def forget(self, hs: Pending) -> None:
        """``hs`` left its handshake (a session, a refusal, a close); idempotent."""
        mine = self._pending.get(hs.host)
        if mine is not None and mine.pop(id(hs), None) is not None and not mine:
            del self._pending[hs.host]
            if len(self._evict_logged) > _MAX_LOGGED_HOSTS:
                self._evict_logged.clear()

    def _evict(self, host: str, limit: str) -> None:
        """Close the oldest unauthenticated handshake of ``host`` (if it has one)."""
        victim = next(
            (
                hs
                for hs in self._pending.get(host, {}).values()
                if not hs.authenticated and not hs.evicted
            ),
            None,
        )
        if victim is None:
            return
        victim.evicted = True
        self.forget(victim)
        if victim.task is not None:
            victim.task.cancel()
        now = time.monotonic()
        if now - self._evict_logged.get(host, -math.inf) >= _EVICT_LOG_EVERY_S:
            self._evict_logged[host] = now
            log.warning(
                "closed an unauthenticated connection from %s (open %.1f s) to make room "
                "(%s); more are logged at debug for %.0f s",
                victim.peer, now - victim.since, limit, _EVICT_LOG_EVERY_S,
            )  # fmt: skip
        else:
            log.debug("closed an unauthenticated connection from %s (%s)", victim.peer, limit)


class FailurePacing:
    """Wrong tokens per source (``FailedAuthLimiter``): a source over the limit gets its
    wrong tokens answered ``FAILED_AUTH_DELAY_S`` late. Nothing here refuses a source."""

    def __init__(self, limiter: FailedAuthLimiter | None = None) -> None:
        self.limiter = limiter or FailedAuthLimiter()

    def failed(self, host: str, peer: str, error: str) -> float:
        """Record a wrong token from ``host``; returns the seconds to wait before the
        refusal is sent (0.0 while the source is under the limit)."""
        limiter = self.limiter
        failures = limiter.failed(host)
        if failures >= limiter.max_failures:
            log.warning(
                "%d failed authentications from %s within %.0f s: for %.0f s its wrong "
                "tokens are answered after %.0f s (a correct token is still accepted)",
                failures, host, limiter.window_s, limiter.block_s, FAILED_AUTH_DELAY_S,
            )  # fmt: skip
        else:
            log.warning("refused %s: %s", peer, error)
        return FAILED_AUTH_DELAY_S if limiter.blocked_for(host) else 0.0


# --------------------------------------------------------------------------- sockets


async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, error: str) -> None:
    """Send ``{"ok": false, "error"}``, then drain unread input briefly before the close,
    so the peer reads the reply instead of a connection reset."""
    try:
        async with asyncio.timeout(_LINGER):
            writer.write(encode_lp_json(HandshakeReply(ok=False, error=error[:ERROR_TEXT_LIMIT])))
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
            budget = _MAX_DRAIN
            while budget > 0:
                chunk = await reader.read(min(budget, 1 << 16))
                if not chunk:
                    break
                budget -= len(chunk)
    except (TimeoutError, ConnectionError, OSError):
        pass


def listen_socket(host: str, port: int) -> socket.socket:
    """The non-blocking listening socket (SO_REUSEADDR, as asyncio.start_server sets it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server(
        (host, port), family=family, backlog=_LISTEN_BACKLOG, dualstack_ipv6=False
    )
    sock.setblocking(False)
    return sock


def abort(writer: asyncio.StreamWriter) -> None:
    transport = writer.transport
    if not transport.is_closing():
        transport.abort()
