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
    "HEALTH_CANDIDATE_S",
    "HEALTH_INTERVAL_S",
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
#: How long one health-lane candidate may take to present its attach bytes: the
#: lane is accepted one connection at a time, so a silent peer must not hold it.
HEALTH_CANDIDATE_S = 2.0
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
    candidates: set[CommandProtocol]
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
        r = self.runner
        while not self.stop_event.is_set():
            remaining = r.deadline - time.monotonic()
            if remaining <= 0 or r.parent_gone():
                return None
            self.listener.settimeout(min(HEALTH_INTERVAL_S, remaining))
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return None
            budget = min(HEALTH_CANDIDATE_S, max(0.0, r.deadline - time.monotonic()))
            sock = self._check(conn, time.monotonic() + budget)
            if sock is not None:
                return sock
        return None

    def _check(self, conn: socket.socket, until: float) -> socket.socket | None:
        """The candidate's attach bytes, or None (closed) when they are wrong or late."""
        r = self.runner
        sock: socket.socket = conn
        try:
            tune_socket(conn, r.manifest.session_timeout_s)
            conn.settimeout(max(0.001, until - time.monotonic()))
            if r.tls is not None:
                sock = r.tls.wrap_socket(conn, server_side=True)
            data = b""
            while len(data) < ATTACH_BYTES:
                sock.settimeout(max(0.001, until - time.monotonic()))
                chunk = sock.recv(ATTACH_BYTES - len(data))
                if not chunk:
                    break
                data += chunk
            if r.attach_ok(data):
                return sock
            log.warning("health lane: rejected a connection with a wrong attach key")
        except (OSError, ssl.SSLError) as exc:
            log.warning("health lane: dropped a candidate connection: %s", exc)
        with contextlib.suppress(OSError):
            sock.close()
        return None


# -- command lane ----------------------------------------------------------------------------------


class CommandProtocol(asyncio.Protocol):
    """One candidate command connection: attach bytes first, then frames."""

    def __init__(self, runner: LaneHost) -> None:
        self.runner = runner
        self.transport: asyncio.Transport | None = None
        self.attached = False
        self._pre = b""
        self.decoder = FrameDecoder(
            session_id=runner.session_id, worker_id=runner.worker_id, allowed=_COMMAND_TYPES
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, so no isinstance check.
        self.transport = cast(asyncio.Transport, transport)
        self.runner.candidates.add(self)

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
        self.runner.candidates.discard(self)
        if self.attached:
            why = f": {exc}" if exc is not None else ""
            self.runner.stop(1 if exc is not None else 0, f"command connection lost{why}")
