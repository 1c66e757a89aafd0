"""A session-aware chaos proxy in front of ``simpler-remote-worker``, for fault tests.

A remote session uses three TCP connections: the handshake with the worker, then
the command and health lanes straight to the runner's ephemeral ports named in
the worker's reply. A plain :class:`~simpler_daemon.testing.chaos_proxy.ChaosProxy` in
front of the worker would only see the handshake. :class:`SessionProxy` relays
the handshake and, when the reply is ``ok``, starts one ``ChaosProxy`` per lane
toward the runner and rewrites the reply's ``command`` / ``health`` to them::

    parent --handshake--> SessionProxy --handshake--> simpler-remote-worker
           <-- reply {"command": proxy C, "health": proxy H} <-- reply {runner C, H}
    parent --command lane--> ChaosProxy C --> runner command listener
    parent --health lane---> ChaosProxy H --> runner health listener

The parent just connects to :attr:`SessionProxy.endpoint`; no production code
knows about it. Tests inject faults per lane and direction on
:attr:`SessionProxy.command` / :attr:`SessionProxy.health` (the latest session)
or on any entry of :attr:`SessionProxy.sessions` (one per ok reply, in order).

Handshake bytes are relayed unchanged in both directions except the one reply
that is rewritten; the manifest is decoded on the side (not altered) so a test
knows the session id and attach key (for stale-attach probes). Anything that
does not parse (a refused handshake, garbage) is passed through as it is.

Threads: one acceptor plus one per handshake connection, and each lane proxy's
own thread. Start it only in a process that will not fork afterwards (see
``chaos_proxy.py``): in tests, after ``Worker.init()``. Loopback addresses only.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

import msgspec

from simpler_daemon.remote.manifest import (
    AUTH_MAGIC,
    MAX_MANIFEST_BYTES,
    MAX_REPLY_BYTES,
    MAX_TOKEN_BYTES,
    encode_lp_json,
    format_host_port,
)
from simpler_daemon.testing.chaos_proxy import ChaosProxy, bind_listener

__all__ = ["ProxiedSession", "SessionProxy"]

_AUTH_HEADER: Final = struct.Struct("<4sII")
_LENGTH: Final = struct.Struct("<I")
_READ_SIZE: Final = 64 << 10
_POLL_S: Final = 0.1
_ATTACH_PREAMBLE: Final = (40, 0)  # u64 session id + 32-byte key, parent -> runner only
_WILDCARDS: Final = frozenset({"0.0.0.0", "::", ""})


@dataclass
class ProxiedSession:
    """One session whose handshake reply was ok, with its two lane proxies."""

    index: int
    """0 for the first ok handshake through this proxy, then 1, 2, ..."""
    manifest: dict[str, Any] | None
    """The manifest the parent sent (decoded JSON), None if it did not decode."""
    reply: dict[str, Any]
    """The worker's reply as received (before the rewrite)."""
    runner_command: tuple[str, int]
    runner_health: tuple[str, int]
    command: ChaosProxy
    health: ChaosProxy

    @property
    def session_id(self) -> int | None:
        v = (self.manifest or {}).get("session_id")
        return v if isinstance(v, int) else None

    @property
    def attach_key(self) -> str | None:
        v = (self.manifest or {}).get("attach_key")
        return v if isinstance(v, str) else None

    @property
    def pid(self) -> int:
        """The runner's pid as the worker reported it."""
        v = self.reply.get("pid")
        return v if isinstance(v, int) else 0


@dataclass
class _Relay:
    """State of one handshake connection (owned by its thread)."""

    client: socket.socket
    upstream: socket.socket | None = None
    up: bytearray = field(default_factory=bytearray)  # parent bytes kept for parsing
    up_parse: bool = True
    manifest: dict[str, Any] | None = None
    down: bytearray = field(default_factory=bytearray)  # worker bytes not yet forwarded
    down_done: bool = False  # the reply went out: the rest is raw


class SessionProxy:
    """Relay handshakes to ``target_host:target_port`` and put a ChaosProxy on each lane.

    ``on_session(session)`` runs in the handshake thread after the lane proxies
    started and BEFORE the rewritten reply reaches the parent: faults set there
    apply from the lanes' first byte (the HELLO), and the runner's real ports can
    be probed while it still waits for its parent. An exception in it is recorded
    in :attr:`errors` and the reply is forwarded anyway.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        listen_host: str = "127.0.0.1",
        *,
        on_session: Callable[[ProxiedSession], None] | None = None,
        handshake_timeout: float = 60.0,
    ) -> None:
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        self.on_session = on_session
        self.handshake_timeout = handshake_timeout
        self.address: tuple[str, int] | None = None
        #: Ok sessions in handshake order.
        self.sessions: list[ProxiedSession] = []
        #: ``error`` of every ``ok: false`` reply relayed.
        self.refused: list[str] = []
        #: Handshake connections accepted so far.
        self.handshakes = 0
        #: Relay problems (connect failures, hook exceptions), for test messages.
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._threads: list[threading.Thread] = []
        self._open: set[socket.socket] = set()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> tuple[str, int]:
        """Bind an ephemeral port on ``listen_host`` and start accepting; returns the address."""
        if self._acceptor is not None:
            raise RuntimeError("cannot start session proxy: already started")
        lst = self._listener = bind_listener(self.listen_host, 16, timeout=_POLL_S)
        host, port = lst.getsockname()[:2]
        self.address = (host, port)
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="session-proxy", daemon=True
        )
        self._acceptor.start()
        return self.address

    @property
    def endpoint(self) -> str:
        """``"HOST:PORT"`` to put in ``RemoteWorkerSpec.endpoint``."""
        if self.address is None:
            raise RuntimeError("cannot name the session proxy endpoint: not started")
        return format_host_port(*self.address)

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, end every handshake relay and close every lane proxy. Idempotent."""
        self._stop.set()
        if self._acceptor is not None:
            self._acceptor.join(timeout)
        with self._lock:
            threads = list(self._threads)
            socks = list(self._open)
        for s in socks:  # wake relays blocked in a send
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(timeout)
        if self._listener is not None:
            self._listener.close()
        for session in self.sessions:
            session.command.close(timeout)
            session.health.close(timeout)
        alive = [t.name for t in [self._acceptor, *threads] if t is not None and t.is_alive()]
        if alive:
            raise TimeoutError(f"cannot close session proxy: threads still running: {alive}")

    def __enter__(self) -> SessionProxy:
        if self._acceptor is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- what tests use -----------------------------------------------------------------------

    @property
    def latest(self) -> ProxiedSession:
        with self._lock:
            if not self.sessions:
                raise LookupError("no session went through the session proxy yet")
            return self.sessions[-1]

    @property
    def command(self) -> ChaosProxy:
        """The command-lane proxy of the latest session."""
        return self.latest.command

    @property
    def health(self) -> ChaosProxy:
        """The health-lane proxy of the latest session."""
        return self.latest.health

    def wait_sessions(self, n: int, timeout: float = 30.0) -> ProxiedSession:
        """Block until ``n`` sessions went through; returns the ``n``-th. ``TimeoutError``."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self.sessions) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"cannot wait for session {n} through the session proxy: "
                        f"{len(self.sessions)} within {timeout} s (errors: {self.errors})"
                    )
                self._changed.wait(left)
            return self.sessions[n - 1]

    # -- threads ------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        lst = self._listener
        assert lst is not None
        while not self._stop.is_set():
            try:
                client, _ = lst.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if not self._stop.is_set():
                    self.errors.append(f"cannot accept: {exc}")
                return
            t = threading.Thread(
                target=self._relay, args=(client,), name="session-proxy-handshake", daemon=True
            )
            with self._lock:
                self.handshakes += 1
                self._open.add(client)
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _relay(self, client: socket.socket) -> None:
        r = _Relay(client)
        try:
            try:
                r.upstream = socket.create_connection(self.target, timeout=5.0)
            except OSError as exc:
                self.errors.append(f"cannot connect to {format_host_port(*self.target)}: {exc}")
                # A reset tells the parent at once, like an unreachable worker would.
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            with self._lock:
                self._open.add(r.upstream)
            self._pump(r)
        except Exception as exc:  # never die silently: the test would only see a timeout
            self.errors.append(f"handshake relay failed: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                for s in (client, r.upstream):
                    if s is not None:
                        self._open.discard(s)
            for s in (client, r.upstream):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()

    def _pump(self, r: _Relay) -> None:
        """Relay both directions until both ended (or stop / the handshake timeout)."""
        up = r.upstream
        assert up is not None
        for s in (r.client, up):
            s.settimeout(5.0)  # bounds a sendall to a peer that stopped reading
        deadline = time.monotonic() + self.handshake_timeout
        with selectors.DefaultSelector() as sel:
            sel.register(r.client, selectors.EVENT_READ)
            sel.register(up, selectors.EVENT_READ)
            while sel.get_map() and not self._stop.is_set() and time.monotonic() < deadline:
                for key, _ in sel.select(_POLL_S):
                    src = key.fileobj
                    assert isinstance(src, socket.socket)
                    try:
                        data = src.recv(_READ_SIZE)
                    except OSError:
                        data = b""
                    if src is r.client:
                        if data:
                            self._parse_up(r, data)
                            up.sendall(data)
                        else:
                            sel.unregister(src)
                            with contextlib.suppress(OSError):
                                up.shutdown(socket.SHUT_WR)
                    elif data:
                        self._down(r, data)
                    else:
                        sel.unregister(src)
                        if r.down:  # a reply cut short travels on as it is
                            r.client.sendall(bytes(r.down))
                            r.down.clear()
                        with contextlib.suppress(OSError):
                            r.client.shutdown(socket.SHUT_WR)

    def _parse_up(self, r: _Relay, data: bytes) -> None:
        """Keep the parent's bytes until the manifest decoded (never altered)."""
        if not r.up_parse:
            return
        r.up += data
        buf = r.up
        if len(buf) < _AUTH_HEADER.size:
            return
        magic, _version, tlen = _AUTH_HEADER.unpack_from(buf, 0)
        if magic != AUTH_MAGIC or tlen > MAX_TOKEN_BYTES:
            r.up_parse = False
            return
        off = _AUTH_HEADER.size + tlen
        if len(buf) < off + _LENGTH.size:
            return
        (mlen,) = _LENGTH.unpack_from(buf, off)
        if mlen > MAX_MANIFEST_BYTES:
            r.up_parse = False
            return
        if len(buf) < off + _LENGTH.size + mlen:
            return
        r.up_parse = False
        try:
            m = msgspec.json.decode(bytes(buf[off + _LENGTH.size : off + _LENGTH.size + mlen]))
        except msgspec.DecodeError:
            m = None
        r.manifest = m if isinstance(m, dict) else None
        r.up.clear()

    def _down(self, r: _Relay, data: bytes) -> None:
        """Forward the worker's bytes; the one length-prefixed reply is rewritten when ok."""
        if r.down_done:
            r.client.sendall(data)
            return
        r.down += data
        if len(r.down) < _LENGTH.size:
            return
        (n,) = _LENGTH.unpack_from(r.down, 0)
        if n > MAX_REPLY_BYTES:
            r.down_done = True  # not a reply we understand: pass it on untouched
            r.client.sendall(bytes(r.down))
            r.down.clear()
            return
        if len(r.down) < _LENGTH.size + n:
            return
        body = bytes(r.down[_LENGTH.size : _LENGTH.size + n])
        rest = bytes(r.down[_LENGTH.size + n :])
        r.down.clear()
        r.down_done = True
        r.client.sendall(self._rewrite(r, body) + rest)

    def _rewrite(self, r: _Relay, body: bytes) -> bytes:
        """The reply to hand the parent: lanes pointed at fresh ChaosProxies when ok."""
        original = _LENGTH.pack(len(body)) + body
        try:
            reply = msgspec.json.decode(body)
        except msgspec.DecodeError:
            return original
        if not isinstance(reply, dict):
            return original
        if reply.get("ok") is not True:
            err = reply.get("error")
            with self._lock:
                self.refused.append(err if isinstance(err, str) else repr(reply))
            return original
        try:
            cmd = self._lane_target(reply.get("command"))
            health = self._lane_target(reply.get("health"))
        except ValueError as exc:
            self.errors.append(f"cannot proxy the lanes of reply {reply!r}: {exc}")
            return original
        cmd_proxy = ChaosProxy(*cmd, self.listen_host, preamble=_ATTACH_PREAMBLE)
        health_proxy = ChaosProxy(*health, self.listen_host, preamble=_ATTACH_PREAMBLE)
        cmd_addr = cmd_proxy.start()
        health_addr = health_proxy.start()
        with self._changed:
            session = ProxiedSession(
                index=len(self.sessions),
                manifest=r.manifest,
                reply=dict(reply),
                runner_command=cmd,
                runner_health=health,
                command=cmd_proxy,
                health=health_proxy,
            )
            self.sessions.append(session)
            self._changed.notify_all()
        if self.on_session is not None:
            try:
                self.on_session(session)
            except Exception as exc:
                self.errors.append(f"on_session hook failed: {type(exc).__name__}: {exc}")
        reply["command"] = format_host_port(*cmd_addr)
        reply["health"] = format_host_port(*health_addr)
        return encode_lp_json(reply)

    def _lane_target(self, text: object) -> tuple[str, int]:
        """``"H:P"`` of a runner lane; a wildcard host means the worker's own host."""
        if not isinstance(text, str):
            raise ValueError(f"lane address {text!r} is not a string")
        host, sep, port = text.rpartition(":")
        host = host.strip("[]")
        if not sep or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"lane address {text!r} is not host:port")
        if host in _WILDCARDS:
            host = self.target[0]
        return host, int(port)
