"""The session runner's two lanes and their sockets: HealthLane and CommandProtocol.

Both lanes accept candidates on their own listener; a candidate is kept only
once its first 40 bytes (u64 LE session_id + the 32-byte attach key) match::

    parent                        runner
      |-- connect, attach bytes -->| CommandProtocol (event loop)  -> LaneHost.frames_received
      |<-- HELLO/COMPLETION/REPLY -|   (written by the runner)
      |-- connect, attach bytes -->| HealthLane (own thread, blocking socket)
      |<-- HEALTH every 0.2 s -----|   reports only "attached" and "failed" to the loop

The lanes know sockets, TLS and attach bytes, not sessions: they talk to the
runner through :class:`LaneHost` (implemented by ``session.SessionRunner``), so
data flows down from the runner into this module and never back by import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from typing import Any, Protocol, cast

from simpler_daemon.errors import ProtocolError
from simpler_daemon.remote.manifest import Manifest, RunnerSpec
from simpler_daemon.remote.wire import Frame, FrameDecoder, FrameType, encode_frame

__all__ = [
    "ATTACH_BYTES",
    "CANDIDATE_S",
    "HEALTH_CANDIDATE_S",
    "HEALTH_INTERVAL_S",
    "MAX_CANDIDATES",
    "CommandProtocol",
    "HealthLane",
    "LaneHost",
    "listen",
    "server_tls",
    "tune_socket",
]

# The runner's one logger: its stderr lines read the same whichever module logs.
log = logging.getLogger("simpler_daemon.remote.session")

ATTACH_BYTES = 40  # u64 LE session_id + 32 raw bytes of the attach key
HEALTH_INTERVAL_S = 0.2
#: How long one candidate connection (either lane) may take to present its attach
#: bytes, its TLS handshake included. Candidates are checked side by side, so a silent
#: one holds up nobody; this only bounds what it costs.
CANDIDATE_S = 2.0
HEALTH_CANDIDATE_S = CANDIDATE_S
#: Candidates checked at once per lane; a newer one drops the oldest.
MAX_CANDIDATES = 64
#: How long the health thread waits for a blocked loop to take a stop request.
STOP_ACK_S = 1.0
_COMMAND_TYPES = frozenset({FrameType.TASK, FrameType.CONTROL, FrameType.SHUTDOWN})


class LaneHost(Protocol):
    """What the lanes need from the session runner (``session.SessionRunner``)."""

    session_id: int
    worker_id: int
    parent_pid: int
    deadline: float  # time.monotonic() based: both lanes attach before it
    tls: ssl.SSLContext | None
    manifest: Manifest
    #: Command-lane candidates that have not attached yet, oldest first.
    candidates: dict[CommandProtocol, None]
    #: Set by ``stop`` on the loop: the loop is responsive and is ending the session.
    stop_seen: threading.Event

    def parent_gone(self) -> bool: ...

    def attach_ok(self, data: bytes) -> bool: ...

    def close_budget(self) -> float: ...

    def call_threadsafe(self, fn: Any, *args: Any) -> None: ...

    def stop_threadsafe(self, code: int, reason: str) -> None: ...

    def stop(self, code: int, reason: str) -> None: ...

    def health_attached(self) -> None: ...

    def command_attached(self, proto: CommandProtocol, data: bytes) -> bool: ...

    def frames_received(self, frames: list[Frame]) -> None: ...


# -- sockets --------------------------------------------------------------------------------------


def tune_socket(sock: socket.socket, session_timeout_s: float) -> None:
    """TCP_NODELAY, keepalive and TCP_USER_TIMEOUT so a vanished peer is noticed in time."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(session_timeout_s / 3))
    interval = max(1, int(session_timeout_s / 6))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(session_timeout_s * 1000))


def server_tls(spec: RunnerSpec) -> ssl.SSLContext | None:
    """The TLS context of both listeners (None: plain TCP); ``OSError`` / ``ssl.SSLError``
    when a certificate or key file cannot be loaded."""
    if spec.tls is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(spec.tls.cert_file, spec.tls.key_file)
    if spec.tls.client_ca_file:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(spec.tls.client_ca_file)
    return ctx


def listen(host: str) -> socket.socket:
    """A listener on ``host`` at a kernel-chosen port; ``OSError`` when it cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(16)
    except BaseException:
        sock.close()
        raise
    return sock


# -- health lane ------------------------------------------------------------------------------------


class HealthLane(threading.Thread):
    """Accepts the health connection, then sends HEALTH every 0.2 s.

    A plain thread with a blocking socket: an orchestration function that
    blocks the event loop for seconds never delays a beat. It reports to the
    loop only twice: attached, and failed (send error, parent death, deadline).
    """

    def __init__(self, runner: LaneHost, listener: socket.socket) -> None:
        super().__init__(name="health-lane", daemon=True)
        self.runner = runner
        self.listener = listener
        self.sock: socket.socket | None = None
        self.stop_event = threading.Event()
        self.beat_event = threading.Event()
        self.beats = 0

    def run(self) -> None:
        try:
            reason = self._run()
        except Exception as exc:  # a bug here must still end the session, loudly
            reason = f"health lane failed: {type(exc).__name__}: {exc}"
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
        if reason is not None and not self.stop_event.is_set():
            self.runner.stop_threadsafe(1, reason)
            # The loop may be held by an orchestration that never returns: when it does
            # not even take the stop request within a second, nobody is left to serve,
            # so leave now (inner children die by their PDEATHSIG); a responsive loop
            # gets its close budget to stop the inner worker cleanly.
            if self.runner.stop_seen.wait(STOP_ACK_S):
                grace = self.runner.close_budget() + 10.0
            else:
                grace = 0.0
            if not self.stop_event.wait(grace):
                log.error("session did not end %.0f s after: %s; exiting now", grace, reason)
                logging.shutdown()
                os._exit(1)

    def _run(self) -> str | None:
        r = self.runner
        sock = self._accept()
        if sock is None:
            # A missed deadline is reported by the loop, which knows both lanes.
            return f"parent process {r.parent_pid} is gone" if r.parent_gone() else None
        self.sock = sock
        r.call_threadsafe(r.health_attached)
        while not self.beat_event.wait(HEALTH_INTERVAL_S):
            if self.stop_event.is_set():
                return None
            if r.parent_gone():
                return f"parent process {r.parent_pid} is gone"
        sock.settimeout(max(1.0, r.manifest.session_timeout_s))
        seq = 1
        while not self.stop_event.is_set():
            frame = encode_frame(FrameType.HEALTH, r.session_id, r.worker_id, seq)
            try:
                sock.sendall(frame)
            except OSError as exc:
                return f"health send failed: {exc}"
            self.beats = seq
            seq += 1
            if r.parent_gone():
                return f"parent process {r.parent_pid} is gone"
            self.stop_event.wait(HEALTH_INTERVAL_S)
        return None

    def _accept(self) -> socket.socket | None:
        """The first candidate that presents the right attach bytes, or None.

        Candidates are checked side by side (non-blocking, one selector), each within
        ``CANDIDATE_S``: a silent or slow connection, with or without TLS, never
        holds up the parent's, however many there are (past ``MAX_CANDIDATES``
        the oldest is dropped).
        """
        r = self.runner
        sel = selectors.DefaultSelector()
        pending: dict[int, _Candidate] = {}  # fd -> candidate, oldest first
        self.listener.setblocking(False)
        sel.register(self.listener, selectors.EVENT_READ)
        try:
            while not self.stop_event.is_set():
                now = time.monotonic()
                if now >= r.deadline or r.parent_gone():
                    return None
                for fd, old in list(pending.items()):
                    if now >= old.until:
                        log.warning("health lane: dropped a candidate: no attach bytes in time")
                        self._drop(sel, pending, fd)
                wake = min([r.deadline, *(c.until for c in pending.values())])
                for key, _ in sel.select(max(0.0, min(HEALTH_INTERVAL_S, wake - now))):
                    if key.fileobj is self.listener:
                        self._take(sel, pending)
                        continue
                    fd = key.fd
                    found = pending.get(fd)
                    if found is None:
                        continue
                    cand = found
                    try:
                        state = cand.step(r)
                    except (OSError, ssl.SSLError) as exc:
                        log.warning("health lane: dropped a candidate connection: %s", exc)
                        state = _REJECTED
                    if state == _ATTACHED:
                        sel.unregister(cand.sock)
                        del pending[fd]
                        cand.sock.setblocking(True)
                        return cand.sock
                    if state == _REJECTED:
                        self._drop(sel, pending, fd)
                    else:
                        sel.modify(cand.sock, state)
            return None
        finally:
            for fd in list(pending):
                self._drop(sel, pending, fd)
            sel.close()

    def _take(self, sel: selectors.BaseSelector, pending: dict[int, _Candidate]) -> None:
        """Accept what the listener holds; each becomes a candidate."""
        r = self.runner
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the candidates time out
                log.warning("health lane: cannot accept a connection: %s", exc)
                return
            try:
                tune_socket(conn, r.manifest.session_timeout_s)
                conn.setblocking(False)
                sock: socket.socket = conn
                if r.tls is not None:
                    sock = r.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            except (OSError, ssl.SSLError) as exc:
                log.warning("health lane: dropped a candidate connection: %s", exc)
                conn.close()
                continue
            if len(pending) >= MAX_CANDIDATES:
                log.warning("health lane: dropped the oldest of %d candidates", len(pending))
                self._drop(sel, pending, next(iter(pending)))
            budget = min(CANDIDATE_S, max(0.0, r.deadline - time.monotonic()))
            cand = _Candidate(sock, time.monotonic() + budget, r.tls is not None)
            pending[sock.fileno()] = cand
            sel.register(sock, selectors.EVENT_READ)

    @staticmethod
    def _drop(sel: selectors.BaseSelector, pending: dict[int, _Candidate], fd: int) -> None:
        cand = pending.pop(fd)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(cand.sock)
        with contextlib.suppress(OSError):
            cand.sock.close()


_ATTACHED = 0
_REJECTED = -1


class _Candidate:
    """One health-lane connection that has not shown its attach bytes yet."""

    __slots__ = ("data", "handshaking", "sock", "until")

    def __init__(self, sock: socket.socket, until: float, tls: bool) -> None:
        self.sock = sock
        self.until = until
        self.handshaking = tls
        self.data = b""

    def step(self, r: LaneHost) -> int:
        """Advance on readiness: ``_ATTACHED``, ``_REJECTED``, or the selector events
        to wait for next. ``OSError`` / ``ssl.SSLError`` when the connection failed."""
        sock = self.sock
        if self.handshaking:
            assert isinstance(sock, ssl.SSLSocket)
            try:
                sock.do_handshake()
            except ssl.SSLWantReadError:
                return selectors.EVENT_READ
            except ssl.SSLWantWriteError:
                return selectors.EVENT_WRITE
            self.handshaking = False
        while len(self.data) < ATTACH_BYTES:
            try:
                chunk = sock.recv(ATTACH_BYTES - len(self.data))
            except (BlockingIOError, ssl.SSLWantReadError):
                return selectors.EVENT_READ
            except ssl.SSLWantWriteError:
                return selectors.EVENT_WRITE
            if not chunk:
                return _REJECTED
            self.data += chunk
        if r.attach_ok(self.data):
            return _ATTACHED
        log.warning("health lane: rejected a connection with a wrong attach key")
        return _REJECTED


# -- command lane ----------------------------------------------------------------------------------


class CommandProtocol(asyncio.Protocol):
    """One candidate command connection: attach bytes first, then frames."""

    def __init__(self, runner: LaneHost) -> None:
        self.runner = runner
        self.transport: asyncio.Transport | None = None
        self.attached = False
        self._expiry: asyncio.TimerHandle | None = None
        self._pre = b""
        self.decoder = FrameDecoder(
            session_id=runner.session_id, worker_id=runner.worker_id, allowed=_COMMAND_TYPES
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, so no isinstance check.
        self.transport = cast(asyncio.Transport, transport)
        waiting = self.runner.candidates
        if len(waiting) >= MAX_CANDIDATES:
            log.warning("command lane: dropped the oldest of %d candidates", len(waiting))
            next(iter(waiting)).drop()
        waiting[self] = None
        # A candidate that has not attached within CANDIDATE_S holds a slot no longer.
        self._expiry = asyncio.get_running_loop().call_later(CANDIDATE_S, self._expire)

    def _expire(self) -> None:
        if not self.attached:
            log.warning("command lane: dropped a candidate: no attach bytes in time")
            self.drop()

    def drop(self) -> None:
        """Close an unattached candidate."""
        self.runner.candidates.pop(self, None)
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if not self.attached:
            self._pre += data
            if len(self._pre) < ATTACH_BYTES:
                return
            head, rest = self._pre[:ATTACH_BYTES], self._pre[ATTACH_BYTES:]
            self._pre = b""
            if not self.runner.command_attached(self, head):
                log.warning("command lane: rejected a connection with a wrong attach key")
                assert self.transport is not None
                self.transport.abort()
                return
            self.attached = True
            self.runner.candidates.pop(self, None)
            if self._expiry is not None:
                self._expiry.cancel()
            if not rest:
                return
            data = rest
        try:
            frames = self.decoder.feed(data)
        except ProtocolError as exc:
            self.runner.stop(1, f"protocol error on the command lane: {exc}")
            return
        self.runner.frames_received(frames)

    def eof_received(self) -> bool | None:
        if self.attached:
            try:
                self.decoder.eof()
            except ProtocolError as exc:
                self.runner.stop(1, f"protocol error on the command lane: {exc}")
                return None
            self.runner.stop(0, "command connection closed by the parent")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.runner.candidates.pop(self, None)
        if self._expiry is not None:
            self._expiry.cancel()
        if self.attached:
            why = f": {exc}" if exc is not None else ""
            self.runner.stop(1 if exc is not None else 0, f"command connection lost{why}")
