"""A frame-aware chaos TCP proxy for tests and benchmarks of the remote lanes.

::

    client (parent) --"up"-->  ChaosProxy  --"up"-->  target (runner / worker)
                    <-"down"--  (thread)   <-"down"--

Every accepted connection gets its own connection to the target. Each direction
is cut into frames by reading the 40-byte header (magic and ``payload_bytes``
only; no payload is decoded), so faults land on frame boundaries:

* pass-through (the default, and :meth:`ChaosProxy.pass_through` to reset);
* :meth:`~ChaosProxy.truncate_after` -- forward ``n`` frames, then half of the
  next one, then close both sides;
* :meth:`~ChaosProxy.corrupt_frame` -- flip a byte of the magic or the payload
  of frame ``index``;
* :meth:`~ChaosProxy.delay` -- hold every frame for ``seconds`` (order kept);
* :meth:`~ChaosProxy.replay_frame` -- send frame ``index`` twice;
* :meth:`~ChaosProxy.cut` -- close every open connection now.

Frame indices count from 0 per connection and direction, after an optional
``preamble`` of raw bytes (the 40-byte attach record a parent sends first on a
runner lane). A stream whose header is not a frame header (a handshake, or a
sender that is itself broken) is passed through raw from that point on.

The proxy runs in one thread with a selector. Start it only in a process that
will not fork afterwards (the package forks only while single-threaded): in
tests, start it after the Worker's children exist or use it against processes
started with ``subprocess``. Loopback addresses only.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Final, Literal, TypeAlias

from simpler_daemon.remote.wire import HEADER, HEADER_SIZE, MAGIC, MAX_PAYLOAD

__all__ = ["ChaosProxy", "Direction"]

Direction: TypeAlias = Literal["up", "down", "both"]
"""``up``: client -> target (parent -> runner); ``down``: target -> client."""

_READ_SIZE: Final = 256 << 10
_HIGH_WATER: Final = 8 << 20  # stop reading a source while this much waits for its sink
_CONNECT_TIMEOUT: Final = 5.0
_LINGER_RESET: Final = struct.pack("ii", 1, 0)


def bind_listener(host: str, backlog: int, *, timeout: float | None) -> socket.socket:
    """A TCP listener on an ephemeral port of ``host`` (``timeout=0.0``: non-blocking);
    closed again if any step fails."""
    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind((host, 0))
        lst.listen(backlog)
        lst.settimeout(timeout)
    except OSError:
        lst.close()
        raise
    return lst


@dataclass(frozen=True)
class _Faults:
    truncate_after: int | None = None
    corrupt: dict[int, Literal["magic", "payload"]] = field(default_factory=dict)
    replay: frozenset[int] = frozenset()
    delay: float = 0.0


class _Pipe:
    """One direction of one proxied connection."""

    __slots__ = (
        "direction",
        "dst",
        "index",
        "kill_after_flush",
        "last_due",
        "out",
        "parse",
        "preamble_left",
        "raw",
        "src",
        "src_eof",
        "timed",
        "wr_shut",
    )

    def __init__(
        self, direction: Literal["up", "down"], src: socket.socket, dst: socket.socket, pre: int
    ) -> None:
        self.direction = direction
        self.src = src
        self.dst = dst
        self.parse = bytearray()
        self.out = bytearray()
        self.timed: deque[tuple[float, bytes]] = deque()
        self.last_due = 0.0
        self.preamble_left = pre
        self.raw = False
        self.index = 0
        self.src_eof = False
        self.wr_shut = False
        self.kill_after_flush = False

    def idle(self) -> bool:
        return not self.out and not self.timed


class _Conn:
    __slots__ = ("client", "closed", "down", "up", "upstream")

    def __init__(self, client: socket.socket, upstream: socket.socket, pre: tuple[int, int]):
        self.client = client
        self.upstream = upstream
        self.up = _Pipe("up", client, upstream, pre[0])
        self.down = _Pipe("down", upstream, client, pre[1])
        self.closed = False


class ChaosProxy:
    """Forward TCP connections to ``target_host:target_port``, injecting faults per frame.

    ``preamble`` is the number of raw bytes to pass through before the first
    frame header, per direction (``(40, 0)`` in front of a runner lane).
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        listen_host: str = "127.0.0.1",
        *,
        preamble: tuple[int, int] = (0, 0),
    ) -> None:
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        self.preamble = preamble
        self._faults: dict[str, _Faults] = {"up": _Faults(), "down": _Faults()}
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = False
        self._cut_requests: list[tuple[bool, threading.Event]] = []
        self._conns: list[_Conn] = []
        self._sel: selectors.BaseSelector | None = None  # owned by the thread
        self._masks: dict[socket.socket, int] = {}  # registered interest per socket
        self.address: tuple[str, int] | None = None
        self.connections = 0  # accepted so far
        self.frames = {"up": 0, "down": 0}  # frames seen (before faults), all connections
        self.errors: list[str] = []  # connect failures and socket errors, for test messages

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> tuple[str, int]:
        """Bind an ephemeral port on ``listen_host``, start the thread, return the address."""
        if self._thread is not None:
            raise RuntimeError("cannot start chaos proxy: already started")
        lst = self._listener = bind_listener(self.listen_host, 64, timeout=0.0)
        host, port = lst.getsockname()[:2]
        self.address = (host, port)
        self._thread = threading.Thread(target=self._run, name="chaos-proxy", daemon=True)
        self._thread.start()
        return self.address

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and close every socket. Idempotent."""
        self._stop = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(
                    f"cannot close chaos proxy: thread still running after {timeout} s"
                )
        for conn in self._conns:
            self._close_conn(conn, reset=False)
        self._conns.clear()
        if self._listener is not None:
            self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> ChaosProxy:
        if self._thread is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- faults (callable from any thread, at any time) ---------------------------------------

    def pass_through(self, direction: Direction = "both") -> None:
        """Remove every fault in ``direction``."""
        self._set(direction, lambda f: _Faults())

    def truncate_after(self, n_frames: int, direction: Direction = "up") -> None:
        """Forward ``n_frames`` whole frames, then half of the next one, then close both sides."""
        self._set(direction, lambda f: replace(f, truncate_after=n_frames))

    def corrupt_frame(
        self, index: int, direction: Direction = "up", where: Literal["magic", "payload"] = "magic"
    ) -> None:
        """Flip a byte of frame ``index``: its magic, or the middle of its payload (a frame
        without a payload gets its flags word flipped instead, which is just as fatal)."""
        self._set(direction, lambda f: replace(f, corrupt={**f.corrupt, index: where}))

    def delay(self, seconds: float, direction: Direction = "both") -> None:
        """Hold every frame for ``seconds`` before forwarding it (order is kept)."""
        self._set(direction, lambda f: replace(f, delay=seconds))

    def replay_frame(self, index: int, direction: Direction = "up") -> None:
        """Send frame ``index`` twice in a row."""
        self._set(direction, lambda f: replace(f, replay=f.replay | {index}))

    def cut(self, *, reset: bool = False, timeout: float = 5.0) -> None:
        """Close both sides of every open connection now (RST with ``reset``); new
        connections are still accepted. Returns once the sockets are closed."""
        if self._thread is None or not self._thread.is_alive():
            return
        done = threading.Event()
        with self._lock:
            self._cut_requests.append((reset, done))
        self._wake()
        if not done.wait(timeout):
            raise TimeoutError(f"cannot cut chaos proxy connections within {timeout} s")

    @property
    def active_connections(self) -> int:
        return sum(1 for c in self._conns if not c.closed)

    def _set(self, direction: Direction, change: Callable[[_Faults], _Faults]) -> None:
        dirs = ("up", "down") if direction == "both" else (direction,)
        with self._lock:
            for d in dirs:
                self._faults[d] = change(self._faults[d])
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        assert self._listener is not None
        sel = self._sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            self._loop(sel)
        except Exception as exc:  # never die silently: tests would wait for their timeout
            self.errors.append(f"chaos proxy thread failed: {exc!r}")
            for conn in self._conns:
                self._close_conn(conn, reset=True)
            raise
        finally:
            self._sel = None
            sel.close()

    def _loop(self, sel: selectors.BaseSelector) -> None:
        while not self._stop:
            self._service_cuts()
            now = time.monotonic()
            self._release_due(now)
            self._update_interest(sel)
            for key, mask in sel.select(self._next_timeout(now)):
                sock = key.fileobj
                if sock is self._listener:
                    self._accept(sel)
                elif sock is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                else:
                    conn: _Conn = key.data
                    if conn.closed:
                        continue
                    assert isinstance(sock, socket.socket)
                    self._on_event(conn, sock, mask)
            self._reap()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        assert self._listener is not None
        try:
            client, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:  # EMFILE and friends: keep serving the open connections
            self.errors.append(f"cannot accept: {exc}")
            return
        self.connections += 1
        try:
            upstream = socket.create_connection(self.target, timeout=_CONNECT_TIMEOUT)
        except OSError as exc:
            self.errors.append(f"cannot connect to {self.target[0]}:{self.target[1]}: {exc}")
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            client.close()
            return
        for s in (client, upstream):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(client, upstream, self.preamble)
        self._conns.append(conn)
        for s in (client, upstream):
            sel.register(s, selectors.EVENT_READ, conn)
            self._masks[s] = selectors.EVENT_READ

    def _on_event(self, conn: _Conn, sock: socket.socket, mask: int) -> None:
        inbound = conn.up if sock is conn.client else conn.down
        outbound = conn.down if sock is conn.client else conn.up
        try:
            if mask & selectors.EVENT_WRITE and outbound.out:
                sent = sock.send(outbound.out)
                del outbound.out[:sent]
            if mask & selectors.EVENT_READ and not inbound.src_eof:
                data = sock.recv(_READ_SIZE)
                if data:
                    self._ingest(inbound, data, time.monotonic())
                    if inbound.out:
                        # Write through at once rather than after another select round.
                        try:
                            sent = inbound.dst.send(inbound.out)
                            del inbound.out[:sent]
                        except (BlockingIOError, InterruptedError):
                            pass
                else:
                    inbound.src_eof = True
                    if inbound.parse:  # a sender's partial frame travels on as it is
                        self._emit(inbound, bytes(inbound.parse), time.monotonic())
                        inbound.parse.clear()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            # A reset on one side is passed on as a reset on the other.
            self.errors.append(f"connection {conn.client.fileno()}: {exc}")
            self._close_conn(conn, reset=True)

    def _ingest(self, pipe: _Pipe, data: bytes, now: float) -> None:
        if pipe.kill_after_flush:
            return  # truncating: nothing after the half frame is forwarded
        if pipe.preamble_left:
            take = min(pipe.preamble_left, len(data))
            pipe.preamble_left -= take
            self._emit(pipe, data[:take], now)
            data = data[take:]
        if pipe.raw:
            self._emit(pipe, data, now)
            return
        buf = pipe.parse
        buf += data
        while len(buf) >= HEADER_SIZE and not pipe.kill_after_flush:
            magic, *_, plen, _flags = HEADER.unpack_from(buf, 0)
            if magic != MAGIC or plen > MAX_PAYLOAD:
                pipe.raw = True  # not a frame stream (any more): stop counting frames
                self._emit(pipe, bytes(buf), now)
                buf.clear()
                return
            total = HEADER_SIZE + plen
            if len(buf) < total:
                return
            frame = bytes(buf[:total])
            del buf[:total]
            self._on_frame(pipe, frame, now)

    def _on_frame(self, pipe: _Pipe, frame: bytes, now: float) -> None:
        index = pipe.index
        pipe.index += 1
        self.frames[pipe.direction] += 1
        faults = self._faults[pipe.direction]
        if faults.truncate_after is not None and index >= faults.truncate_after:
            self._emit(pipe, frame[: max(1, len(frame) // 2)], now)
            pipe.kill_after_flush = True
            pipe.parse.clear()
            return
        where = faults.corrupt.get(index)
        if where is not None:
            data = bytearray(frame)
            if where == "magic":
                data[0] ^= 0xFF
            elif len(data) > HEADER_SIZE:
                data[HEADER_SIZE + (len(data) - HEADER_SIZE) // 2] ^= 0xFF
            else:
                data[HEADER_SIZE - 1] ^= 0x80  # flags word: an undefined bit
            frame = bytes(data)
        self._emit(pipe, frame, now)
        if index in faults.replay:
            self._emit(pipe, frame, now)

    def _emit(self, pipe: _Pipe, chunk: bytes, now: float) -> None:
        if not chunk:
            return
        delay = self._faults[pipe.direction].delay
        if delay > 0 or pipe.timed:
            # Later chunks never overtake earlier delayed ones.
            due = max(now + delay, pipe.last_due)
            pipe.last_due = due
            pipe.timed.append((due, chunk))
        else:
            pipe.out += chunk

    def _release_due(self, now: float) -> None:
        for conn in self._conns:
            for pipe in (conn.up, conn.down):
                while pipe.timed and pipe.timed[0][0] <= now:
                    pipe.out += pipe.timed.popleft()[1]

    def _next_timeout(self, now: float) -> float | None:
        dues = [p.timed[0][0] for c in self._conns for p in (c.up, c.down) if p.timed]
        return max(0.0, min(dues) - now) if dues else None

    def _update_interest(self, sel: selectors.BaseSelector) -> None:
        masks = self._masks
        for conn in self._conns:
            if conn.closed:
                continue
            for sock, inbound, outbound in (
                (conn.client, conn.up, conn.down),
                (conn.upstream, conn.down, conn.up),
            ):
                mask = 0
                if not inbound.src_eof and len(inbound.out) < _HIGH_WATER:
                    mask |= selectors.EVENT_READ
                if outbound.out:
                    mask |= selectors.EVENT_WRITE
                if masks.get(sock) != mask:
                    if mask:
                        if masks.get(sock):
                            sel.modify(sock, mask, conn)
                        else:
                            sel.register(sock, mask, conn)
                    elif masks.get(sock):
                        sel.unregister(sock)
                    masks[sock] = mask

    def _reap(self) -> None:
        for conn in self._conns:
            if conn.closed:
                continue
            for pipe in (conn.up, conn.down):
                if pipe.kill_after_flush and pipe.idle():
                    self._close_conn(conn, reset=False)
                    break
                if pipe.src_eof and pipe.idle() and not pipe.wr_shut:
                    pipe.wr_shut = True
                    with contextlib.suppress(OSError):
                        pipe.dst.shutdown(socket.SHUT_WR)
            if not conn.closed and conn.up.wr_shut and conn.down.wr_shut:
                self._close_conn(conn, reset=False)
        self._conns = [c for c in self._conns if not c.closed]

    def _service_cuts(self) -> None:
        with self._lock:
            requests, self._cut_requests = self._cut_requests, []
        if not requests:
            return
        reset = any(r for r, _ in requests)
        for conn in self._conns:
            self._close_conn(conn, reset=reset)
        self._conns.clear()
        for _, done in requests:
            done.set()

    def _close_conn(self, conn: _Conn, *, reset: bool) -> None:
        if conn.closed:
            return
        conn.closed = True
        for s in (conn.client, conn.upstream):
            # Unregister before closing: the fd number may be reused by the next accept.
            if self._masks.pop(s, 0) and self._sel is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.unregister(s)
            if reset:
                with contextlib.suppress(OSError):
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            s.close()
