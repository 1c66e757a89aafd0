"""Parent side of a remote L3 session: handshake, attach both lanes, wait for HELLO.

::

    parent                                   simpler-remote-worker (HOST:PORT)
      connect (TLS when tls_ca_file) ----->  AUTH + manifest
      <-- {"ok": true, "command": "H:P", "health": "H:P", "pid": N} ---  spawns the runner
      connect command lane, send 40-byte attach (session id + attach key)
      connect health lane,  send 40-byte attach
      <-- HELLO(ready=True, session, worker) on the command lane        runner is serving

Everything is blocking with socket timeouts cut from one ``time.monotonic()``
deadline (the root startup budget, never multiplied). Endpoints are numeric
addresses or ``localhost``: nothing is resolved. Every failure closes every
socket opened so far and raises ``StartupError("cannot start remote worker W
(HOST:PORT): <reason>")``.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
import ssl
import struct
import time
from dataclasses import dataclass
from typing import Final

from simpler_daemon.errors import ProtocolError, StartupError
from simpler_daemon.remote.manifest import (
    MAX_REPLY_BYTES,
    MAX_TOKEN_BYTES,
    Manifest,
    ManifestCallable,
    decode_reply,
    encode_auth,
    encode_lp_json,
    format_host_port,
    read_lp_sock,
)
from simpler_daemon.remote.spec import RemoteWorkerSpec, parse_endpoint
from simpler_daemon.remote.wire import (
    HEADER,
    HEADER_SIZE,
    PROTOCOL_VERSION,
    FrameDecoder,
    FrameType,
    Hello,
)

__all__ = ["PARENT_LEVEL", "REMOTE_LEVEL", "Session", "open_session"]

PARENT_LEVEL: Final = 4
REMOTE_LEVEL: Final = 3
_U64: Final = struct.Struct("<Q")
_WILDCARDS: Final = frozenset({"0.0.0.0", "::", ""})
#: Keepalive probes start after this idle time (s); TCP_USER_TIMEOUT bounds the rest.
_KEEPIDLE_MAX: Final = 10


@dataclass
class Session:
    """One attached session: both lanes connected, HELLO(ready) received."""

    worker_id: int
    session_id: int
    host: str
    port: int
    pid: int
    """The runner's pid on the remote host (diagnostics only)."""
    command: socket.socket
    health: socket.socket
    hello: Hello
    generation: int = 0
    """The parent's number for this session of the worker (``session_generation``)."""

    def close(self) -> None:
        for sock in (self.command, self.health):
            try:
                sock.close()
            except OSError:
                pass


class _Fail(Exception):
    """Internal: a step failed with a reason for the StartupError."""


def open_session(
    spec: RemoteWorkerSpec,
    worker_id: int,
    callables: list[ManifestCallable],
    deadline: float,
    opened: list[socket.socket] | None = None,
    generation: int = 0,
) -> Session:
    """Open a session on ``spec.endpoint`` before ``deadline`` (``time.monotonic()``).

    ``generation`` is the parent's number for this session of the worker (the
    manifest's ``session_generation``).

    Every socket is appended to ``opened`` as it is created, so another thread can
    abort the attempt by shutting them down. Raises ``ValueError`` for a hostname
    endpoint (no DNS) and ``StartupError`` naming the worker id, the endpoint and
    the reason for anything else.
    """
    host, port = spec.host_port()
    where = format_host_port(host, port)
    prefix = f"cannot start remote worker {worker_id} ({where})"
    token = _read_token(spec, prefix)
    context = _tls_context(spec, prefix)
    server_name = spec.tls_server_name or host
    session_id = 0
    while session_id == 0:
        session_id = secrets.randbits(64)
    attach_key = secrets.token_hex(32)
    attach = _U64.pack(session_id) + bytes.fromhex(attach_key)
    if opened is None:
        opened = []
    budget = max(0.0, deadline - time.monotonic())

    def connect(addr: tuple[str, int], what: str) -> socket.socket:
        sock = _connect(addr, what, deadline, budget, spec.session_timeout_s)
        opened.append(sock)
        if context is None:
            return sock
        try:
            sock.settimeout(_remaining(deadline, budget, f"TLS handshake with {what}"))
            tls = context.wrap_socket(sock, server_hostname=server_name)
        except TimeoutError:
            raise _Fail(f"no answer within {budget:.1f} s (TLS handshake with {what})") from None
        except ssl.SSLError as exc:
            raise _Fail(f"TLS handshake with {what} failed: {exc.reason or exc}") from None
        except OSError as exc:
            raise _Fail(f"TLS handshake with {what} failed: {_reason(exc)}") from None
        opened[-1] = tls
        return tls

    try:
        try:
            control = connect((host, port), where)
            manifest = Manifest(
                session_id=session_id,
                attach_key=attach_key,
                worker_id=worker_id,
                parent_level=PARENT_LEVEL,
                remote_level=REMOTE_LEVEL,
                num_sub_workers=spec.num_sub_workers,
                num_chips=spec.num_chips,
                chip_pipeline_depth=spec.chip_pipeline_depth,
                heap_bytes=spec.heap_bytes,
                callables=list(callables),
                session_timeout_s=float(spec.session_timeout_s),
                startup_budget_s=_remaining(deadline, budget, "sending the manifest"),
                session_generation=generation,
            )
            _send(control, encode_auth(token) + encode_lp_json(manifest), deadline, budget, where)
            try:
                raw = read_lp_sock(control, MAX_REPLY_BYTES, deadline)
                reply = decode_reply(raw)
            except TimeoutError:
                raise _Fail(
                    f"no answer within {budget:.1f} s (waiting for the handshake reply)"
                ) from None
            except ProtocolError as exc:
                raise _Fail(f"bad handshake reply: {exc}") from None
            except OSError as exc:
                raise _Fail(f"handshake with {where} failed: {_reason(exc)}") from None
            if not reply.ok:
                raise _Fail(reply.error)
            cmd_addr = _lane_address(reply.command, host, "command")
            health_addr = _lane_address(reply.health, host, "health")
            command = connect(cmd_addr, f"command lane {format_host_port(*cmd_addr)}")
            _send(command, attach, deadline, budget, "command lane")
            health = connect(health_addr, f"health lane {format_host_port(*health_addr)}")
            _send(health, attach, deadline, budget, "health lane")
            hello = _read_hello(command, session_id, worker_id, deadline, budget)
        except _Fail as exc:
            raise StartupError(f"{prefix}: {exc}") from None
    except BaseException:
        for sock in opened:
            try:
                sock.close()
            except OSError:
                pass
        raise
    control.close()  # the worker keeps nothing of the handshake connection
    command.setblocking(False)
    health.setblocking(False)
    return Session(worker_id, session_id, host, port, reply.pid, command, health, hello, generation)


def _read_token(spec: RemoteWorkerSpec, prefix: str) -> bytes:
    path = spec.token_file
    if path is None:
        return b""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TOKEN_BYTES * 2 + 1)
    except OSError as exc:
        raise StartupError(
            f"{prefix}: cannot read token_file {path!r}: {exc.strerror or exc}"
        ) from None
    token = data.strip()
    if not token:
        raise StartupError(f"{prefix}: token_file {path!r} is empty")
    if len(token) > MAX_TOKEN_BYTES:
        raise StartupError(f"{prefix}: token_file {path!r} holds more than {MAX_TOKEN_BYTES} bytes")
    return token


def _tls_context(spec: RemoteWorkerSpec, prefix: str) -> ssl.SSLContext | None:
    if spec.tls_ca_file is None:
        return None
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=spec.tls_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(
            f"{prefix}: cannot load tls_ca_file {spec.tls_ca_file!r}: {exc}"
        ) from None
    if spec.tls_cert_file is not None and spec.tls_key_file is not None:
        try:
            ctx.load_cert_chain(spec.tls_cert_file, spec.tls_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise StartupError(
                f"{prefix}: cannot load tls_cert_file {spec.tls_cert_file!r} / tls_key_file "
                f"{spec.tls_key_file!r}: {exc}"
            ) from None
    return ctx


def _remaining(deadline: float, budget: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Fail(f"no answer within {budget:.1f} s ({what})")
    return left


def _reason(exc: OSError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError):
        return "connection reset by peer"
    return exc.strerror or str(exc) or type(exc).__name__


def _connect(
    addr: tuple[str, int], what: str, deadline: float, budget: float, session_timeout_s: float
) -> socket.socket:
    family = socket.AF_INET6 if ipaddress.ip_address(addr[0]).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        _tune(sock, session_timeout_s)
        sock.settimeout(_remaining(deadline, budget, f"connecting to {what}"))
        sock.connect(addr)
    except _Fail:
        sock.close()
        raise
    except TimeoutError:
        sock.close()
        raise _Fail(f"no answer within {budget:.1f} s (connecting to {what})") from None
    except OSError as exc:
        sock.close()
        raise _Fail(f"cannot connect to {what}: {_reason(exc)}") from None
    return sock


def _tune(sock: socket.socket, session_timeout_s: float) -> None:
    """TCP_NODELAY (frames are small and latency-bound); keepalive and a user timeout of
    ``session_timeout_s`` so a vanished peer errors the socket instead of hanging it."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, min(_KEEPIDLE_MAX, int(session_timeout_s / 3)))
    for name, value in (
        ("TCP_KEEPIDLE", idle),
        ("TCP_KEEPINTVL", idle),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", max(1000, int(session_timeout_s * 1000))),
    ):
        opt = getattr(socket, name, None)
        if opt is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            except OSError:
                pass  # not every kernel has every knob; the health lane still bounds silence


def _send(sock: socket.socket, data: bytes, deadline: float, budget: float, what: str) -> None:
    try:
        sock.settimeout(_remaining(deadline, budget, f"sending to {what}"))
        sock.sendall(data)
    except TimeoutError:
        raise _Fail(f"no answer within {budget:.1f} s (sending to {what})") from None
    except OSError as exc:
        raise _Fail(f"cannot send to {what}: {_reason(exc)}") from None


def _lane_address(text: str, host: str, lane: str) -> tuple[str, int]:
    """The runner's listener; a wildcard host means "where the worker was reached"."""
    h, _, p = text.rpartition(":")
    if h.strip("[]") in _WILDCARDS:
        text = f"{format_host_port(host, 0).rpartition(':')[0]}:{p}"
    try:
        return parse_endpoint(text, f"reply.{lane}")
    except ValueError as exc:
        raise _Fail(f"bad handshake reply: {exc}") from None


def _read_hello(
    sock: socket.socket, session_id: int, worker_id: int, deadline: float, budget: float
) -> Hello:
    """Read exactly one frame (the HELLO) so no later byte is consumed here."""
    decoder = FrameDecoder(
        session_id=session_id, worker_id=worker_id, allowed=frozenset({FrameType.HELLO})
    )
    header = _recv_exactly(sock, HEADER_SIZE, deadline, budget)
    try:
        frames = decoder.feed(header)
        if not frames:
            plen = HEADER.unpack(header)[6]
            frames = decoder.feed(_recv_exactly(sock, plen, deadline, budget))
    except ProtocolError as exc:
        raise _Fail(f"bad HELLO: {exc}") from None
    if len(frames) != 1:
        raise _Fail("bad HELLO: expected one frame")
    hello = frames[0].payload
    if not isinstance(hello, Hello):  # excluded by the decoder; kept for the type checker
        raise _Fail("bad HELLO: the first frame is not a HELLO")
    if hello.protocol_version != PROTOCOL_VERSION:
        raise _Fail(
            f"bad HELLO: protocol version {hello.protocol_version}, expected {PROTOCOL_VERSION}"
        )
    if hello.session_id != session_id or hello.worker_id != worker_id:
        raise _Fail(
            f"bad HELLO: it names session {hello.session_id} worker {hello.worker_id}, "
            f"expected session {session_id} worker {worker_id}"
        )
    if not hello.ready:
        raise _Fail(f"runner on {hello.host} (pid {hello.pid}) reported not ready")
    return hello


def _recv_exactly(sock: socket.socket, n: int, deadline: float, budget: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            sock.settimeout(_remaining(deadline, budget, "waiting for HELLO"))
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise _Fail(f"no answer within {budget:.1f} s (waiting for HELLO)") from None
        except OSError as exc:
            raise _Fail(f"command lane failed while waiting for HELLO: {_reason(exc)}") from None
        if not chunk:
            raise _Fail(
                f"command lane closed while waiting for HELLO (after {len(buf)} of {n} bytes)"
            )
        buf += chunk
    return bytes(buf)
