"""The asyncio end of the daemon's local fast path (frames: :mod:`simpler_daemon.protocol.fastwire`).

:class:`AsyncFastTransport` is what an ``AsyncClient`` calls over when it uses the
fast path (see :mod:`simpler_daemon.client.fastpath` for how a client picks it and
for the blocking :class:`~simpler_daemon.client.fastpath.FastTransport`). It answers
exactly what gRPC would: the same protobuf messages, and a refusal is the same
:class:`~simpler_daemon.client.errors.DaemonError` subclass with the same ``.field``.

* One connection per transport, opened by the first call on the running event loop
  (so the transport may be made outside of it) and shared by every call: each call
  has its own id, its reply or stream items are routed to it by a
  :class:`_Connection` (an ``asyncio.Protocol``) as they arrive.
* It offers protocol version 2 in its Hello, as the blocking transport does: once
  the daemon's Welcome arrived (it comes before the first reply), SubmitRun and
  WaitRun go out as the msgspec ``Submit`` and ``Wait`` frames (same replies; a big
  submit stays a ``Call``), every other call as a ``Call``.
* A deadline is enforced here and by the daemon (the frame carries it); a call that
  times out or whose awaiting task is cancelled sends ``Cancel`` for its handler, as
  does a stream left before its end.
* The connection going away (the daemon stopped or restarted) fails the calls in
  flight on it with ``Unavailable``; the next call opens a new connection. ``close``
  fails the calls still in flight with ``Unavailable`` too.
* Backpressure: a call waits while the socket's write buffer is above its high-water
  mark (a daemon that stopped reading, a large client stream), and reading pauses
  while the stream items received and not yet consumed exceed ``_READ_HIGH`` bytes
  (so a slow ``watch`` consumer holds the daemon back instead of filling memory).
  The pause is per connection: replies to other calls wait behind it too.
* A forked child (where the parent's connection and event loop are the parent's)
  and a later event loop (``asyncio.run`` again) get a connection of their own; the
  inherited one is only closed in the child, never shut down, so the parent's calls
  go on; that of an earlier loop stays open until ``close`` (the client's session,
  hence its registrations, may be held on it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import socket
from collections.abc import AsyncIterator, Iterable
from typing import Any, Final

# First: grpc core reads its process-wide settings at its import (system/grpcsetup.py);
# the package imports this module before client/base.py.
import simpler_daemon.system.grpcsetup  # noqa: F401

# isort: split

import grpc

from simpler_daemon.client.errors import DaemonError, Unavailable
from simpler_daemon.client.fastpath import (
    _MAX_FRAME,
    _deadline_error,
    _method,
    connect_failed,
    native_frame,
    status_error,
)
from simpler_daemon.errors import ProtocolError
from simpler_daemon.protocol.fastwire import (
    CLIENT_FRAMES,
    MAX_LABEL,
    NATIVE_VERSION,
    PROTOCOL_VERSION,
    Call,
    Cancel,
    End,
    FrameDecoder,
    Hello,
    Item,
    Reply,
    Welcome,
    encode,
)

__all__ = ["AsyncFastTransport"]

#: Stream item bytes received and not yet consumed before the connection stops reading,
#: and the level at which it reads again.
_READ_HIGH: Final = 16 << 20
_READ_LOW: Final = 4 << 20


class _Stream:
    """The frames of one streaming call not yet consumed, and the task waiting for them."""

    __slots__ = ("error", "items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque[Any] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.error: DaemonError | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def expire(self, conn: _Connection) -> None:
        """The call's deadline passed: the consumer's next read raises DeadlineExceeded
        (frames not yet read are dropped, as gRPC ends such a call)."""
        if self.error is None:
            self.error = _deadline_error()
        for frame in self.items:
            conn.consumed(frame)
        self.items.clear()
        self.wake()

    async def next(self, conn: _Connection) -> Any:
        """The next frame (raising the call's end: its deadline, the connection's loss)."""
        while not self.items:
            if self.error is not None:
                raise self.error
            self.waiter = conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        frame = self.items.popleft()
        conn.consumed(frame)
        return frame


class _Connection(asyncio.Protocol):
    """One connection to the daemon's fast socket and the calls in flight on it.

    ``version``: the protocol version the daemon welcomed it to (1 until a Welcome
    arrives). ``sock``: the connected socket, kept to close it alone after a fork."""

    def __init__(self, owner: AsyncFastTransport, sock: socket.socket) -> None:
        self.owner = owner
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.transport: Any = None
        self.version = PROTOCOL_VERSION
        self.replies: dict[int, asyncio.Future[Any]] = {}
        self.streams: dict[int, _Stream] = {}
        self.closed: DaemonError | None = None  # why it ended (None: open)
        self._decoder = FrameDecoder(CLIENT_FRAMES, _MAX_FRAME)
        self._writable: asyncio.Future[None] | None = None  # set while writing is paused
        self._buffered = 0  # stream item bytes received, not yet consumed
        self._reading = True
        self._lost = False  # connection_lost ran: the transport is closed

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._decoder.feed(data)
        except ProtocolError as exc:
            self.fail(exc)
            self.transport.abort()
            return
        replies = self.replies
        for frame in frames:
            if type(frame) is Reply:
                waiter = replies.pop(frame.id, None)
                if waiter is not None:
                    if not waiter.done():
                        waiter.set_result(frame)
                    continue
            elif type(frame) is Welcome:  # the daemon's first frame, once
                self.version = min(frame.version, NATIVE_VERSION)
                continue
            stream = self.streams.get(frame.id)
            if stream is None:
                continue  # a late frame of a call given up on
            stream.items.append(frame)
            stream.wake()
            if type(frame) is Item:
                self._buffered += len(frame.data)
                if self._reading and self._buffered > _READ_HIGH:
                    self._reading = False
                    self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self.fail(exc)

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = self.loop.create_future()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    # -- for the calls

    def write(self, data: bytes) -> None:
        if self.closed is not None:
            raise self.closed
        self.transport.write(data)

    async def drain(self, until: asyncio.Future[Any] | None = None) -> None:
        """Wait while the socket's write buffer is above its high-water mark, or until
        ``until`` (a call's reply, or its deadline) is done."""
        while self._writable is not None:
            if until is None:
                await asyncio.shield(self._writable)
            else:
                await asyncio.wait((self._writable, until), return_when=asyncio.FIRST_COMPLETED)
                if until.done():
                    return
            if self.closed is not None:
                raise self.closed

    def consumed(self, frame: Any) -> None:
        """A stream's consumer took ``frame``: read again once below the low mark."""
        if type(frame) is Item:
            self._buffered -= len(frame.data)
            if not self._reading and self._buffered <= _READ_LOW and self.closed is None:
                self._reading = True
                self.transport.resume_reading()

    def forget(self, call_id: int, *, cancel: bool) -> None:
        """Call ``call_id`` is over here (``cancel``: ask the daemon to stop it too)."""
        self.replies.pop(call_id, None)
        stream = self.streams.pop(call_id, None)
        if stream is not None:
            for frame in stream.items:
                self.consumed(frame)
            stream.items.clear()
        if cancel and self.closed is None and not self.transport.is_closing():
            self.transport.write(encode(Cancel(call_id)))

    def fail(self, exc: BaseException | None, error: DaemonError | None = None) -> None:
        """The connection ended (``exc``: why, None: the daemon closed it): every call in
        flight on it fails with ``error`` (default: UNAVAILABLE naming the cause)."""
        if self.closed is not None:
            return
        if error is None:
            why = "the daemon closed the connection" if exc is None else str(exc)
            error = Unavailable(
                grpc.StatusCode.UNAVAILABLE, f"cannot call the daemon on {self.owner.path}: {why}"
            )
        self.closed = error
        self.owner.lost(self)
        replies, self.replies = self.replies, {}
        for waiter in replies.values():
            if not waiter.done():
                waiter.set_exception(error)
                waiter.exception()  # retrieved: a call that gave up meanwhile never reads it
        for stream in self.streams.values():
            stream.error = error
            stream.wake()
        self.resume_writing()  # wakes the calls waiting to write: they see ``closed``

    def close(self, error: DaemonError) -> None:
        """Close this connection from this process (calls in flight fail with ``error``)."""
        self.fail(None, error)
        if self._lost:
            return
        if self.loop.is_closed():
            # Nothing runs that loop any more (``asyncio.run`` returned): finish the
            # transport's close here, as the loop would have (closes the socket).
            with contextlib.suppress(RuntimeError):
                self.transport.abort()  # marks it closing; scheduling its end fails
            finish = getattr(self.transport, "_call_connection_lost", None)  # asyncio's own
            if finish is not None:
                finish(None)
            else:  # another loop implementation (uvloop): its socket at least
                self.sock.close()
            return
        # Unsent bytes (a daemon that stopped reading) would keep a closing transport
        # open: drop them (its calls failed; the daemon cancels what they started).
        end = (
            self.transport.abort if self.transport.get_write_buffer_size() else self.transport.close
        )
        if self.loop is _running_loop():
            end()
        else:  # another thread's loop, or a loop run again later
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(end)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class AsyncFastTransport:
    """Calls multiplexed on one connection to the fast socket at ``path``; ``label``
    is the client's display label (the gRPC ``x-simpler-client`` header)."""

    def __init__(self, path: str, label: str) -> None:
        self.path = path
        self.label = label
        self._conn: _Connection | None = None
        #: Connections of event loops used before (see _connection), closed by close().
        self._retired: list[_Connection] = []
        self._opening: asyncio.Task[_Connection] | None = None
        self._ids = itertools.count(1)
        self._closed = False
        self._pid = os.getpid()

    # -- the connection

    async def _connection(self) -> _Connection:
        """The open connection of this process and event loop (opened if need be)."""
        conn = self._conn
        if (
            conn is not None
            and conn.loop is asyncio.get_running_loop()
            and self._pid == os.getpid()
        ):
            return conn
        if self._pid != os.getpid():
            self._forked()
        if self._closed:
            raise Unavailable(grpc.StatusCode.UNAVAILABLE, "cannot call: the client is closed")
        loop = asyncio.get_running_loop()
        conn = self._conn
        if conn is not None:
            # Made on another event loop (``asyncio.run`` again): this loop cannot read
            # it. It is kept open, not closed, until close(): the client's session (its
            # registrations) may be held on it, and must outlive the loop change.
            self._conn = None
            self._retired.append(conn)
        opening = self._opening
        if opening is None or opening.done() or opening.get_loop() is not loop:
            opening = self._opening = loop.create_task(self._open())
            opening.add_done_callback(_retrieve)
        # Shielded: a caller cancelled meanwhile leaves the connection to the others.
        return await asyncio.shield(opening)

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, self.path)
            _, conn = await loop.create_unix_connection(lambda: _Connection(self, sock), sock=sock)
        except OSError as exc:
            sock.close()
            raise connect_failed(self.path, exc) from exc
        except BaseException:
            sock.close()
            raise
        conn.write(encode(Hello(PROTOCOL_VERSION, self.label[:MAX_LABEL], NATIVE_VERSION)))
        if self._closed:  # closed while connecting
            conn.close(_closed())
            raise _closed()
        self._conn = conn
        return conn

    def _forked(self) -> None:
        """In a child forked from the process that opened the connection: it, its calls
        and its event loop are the parent's. Close the inherited descriptor here only
        (no shutdown(), which would cut the parent's connection, and no call on the
        parent's event loop, whose epoll instance the child shares) and start afresh."""
        conns = [*self._retired, self._conn] if self._conn is not None else self._retired
        self._conn, self._retired, self._opening = None, [], None
        self._pid = os.getpid()
        for conn in conns:
            conn.sock.close()

    def lost(self, conn: _Connection) -> None:
        """``conn`` ended: the next call opens a new connection."""
        if self._conn is conn:
            self._conn = None

    # -- calls

    async def _ready(self) -> _Connection:
        conn = self._conn
        if conn is None or conn.loop is not asyncio.get_running_loop() or self._pid != os.getpid():
            conn = await self._connection()
        return conn

    async def unary(self, name: str, request: Any, timeout: float | None) -> Any:
        """One unary call (``request`` a message) or client-streaming call (``request``
        an iterable of messages); the response message."""
        method = _method(name)
        conn = await self._ready()
        call_id = next(self._ids)
        loop = conn.loop
        waiter: asyncio.Future[Any] = loop.create_future()
        conn.replies[call_id] = waiter
        # The deadline fails the waiter (cheaper than asyncio.timeout's cancellation).
        timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
        try:
            if method.client_stream:
                await self._send_stream(conn, call_id, name, request, timeout, waiter)
            else:
                data = None
                if conn.version >= NATIVE_VERSION:
                    data = native_frame(call_id, name, request, timeout)
                if data is None:
                    data = encode(Call(call_id, name, request.SerializeToString(), timeout))
                conn.write(data)
                await conn.drain(waiter)
            frame = await waiter
        except BaseException:
            conn.forget(call_id, cancel=True)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if frame.code:
            raise status_error(frame.code, frame.details, frame.field)
        return method.response.FromString(frame.data)

    @staticmethod
    async def _send_stream(
        conn: _Connection,
        call_id: int,
        name: str,
        request: Iterable[Any],
        timeout: float | None,
        waiter: asyncio.Future[Any],
    ) -> None:
        """A client stream's frames; each waits for room in the socket's write buffer,
        so an upload holds about one chunk in memory beyond what the caller holds. A
        reply before the end (the daemon refused the call) stops the sending."""
        conn.write(encode(Call(call_id, name, b"", timeout, True)))
        for message in request:
            await conn.drain(waiter)
            if waiter.done():
                return
            conn.write(encode(Item(call_id, message.SerializeToString())))
        conn.write(encode(End(call_id)))
        await conn.drain(waiter)

    async def stream(self, name: str, request: Any, timeout: float | None) -> AsyncIterator[Any]:
        """A server-streaming call: its response messages. Left before its end (or
        failing), a Cancel frame stops its handler."""
        method = _method(name)
        conn = await self._ready()
        call_id = next(self._ids)
        stream = conn.streams[call_id] = _Stream()
        # The deadline is the stream's, not the task's: it may be consumed from any
        # task, and the consumer may do other work between items.
        timer = None if timeout is None else conn.loop.call_later(timeout, stream.expire, conn)
        done = False
        try:
            # One frame, buffered by the transport: no wait for room (the daemon's
            # per-client stream quota bounds how many such calls are open).
            conn.write(encode(Call(call_id, name, request.SerializeToString(), timeout)))
            while True:
                frame = await stream.next(conn)
                if type(frame) is Item:
                    yield method.response.FromString(frame.data)
                    continue
                done = True
                if frame.code:
                    raise status_error(frame.code, frame.details, frame.field)
                return
        finally:
            if timer is not None:
                timer.cancel()
            conn.forget(call_id, cancel=not done)

    async def hold(self, name: str, request: Any, timeout: float | None) -> tuple[Any, Any]:
        """Open a long-lived bidirectional call (KeepSession) with ``request`` as its
        first message: ``(its first response, release)``. It lasts until ``release()``
        (a Cancel frame), the connection ends, or this process dies."""
        method = _method(name)
        conn = await self._ready()
        call_id = next(self._ids)
        stream = conn.streams[call_id] = _Stream()
        timer = None if timeout is None else conn.loop.call_later(timeout, stream.expire, conn)
        try:
            conn.write(encode(Call(call_id, name, b"", None, True)))
            conn.write(encode(Item(call_id, request.SerializeToString())))
            frame = await stream.next(conn)
        except BaseException:
            conn.forget(call_id, cancel=True)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        # Later frames of the call (its End when the daemon ends it) are dropped.
        conn.forget(call_id, cancel=type(frame) is not Item)
        if type(frame) is not Item:
            raise status_error(frame.code, frame.details, frame.field)
        pid = os.getpid()

        def release() -> None:
            if os.getpid() != pid or conn.closed is not None:
                return  # a child's is the parent's; a closed one ended with its connection
            if conn.loop is _running_loop():
                conn.forget(call_id, cancel=True)
            else:
                with contextlib.suppress(RuntimeError):  # that loop is closed: so is the call
                    conn.loop.call_soon_threadsafe(lambda: conn.forget(call_id, cancel=True))

        return method.response.FromString(frame.data), release

    async def close(self) -> None:
        """Close the connection; calls still in flight fail with ``Unavailable``."""
        if self._pid != os.getpid():
            self._forked()
        self._closed = True
        conns = [*self._retired, self._conn] if self._conn is not None else self._retired
        self._conn, self._retired = None, []
        opening, self._opening = self._opening, None
        if opening is not None and not opening.done() and opening.get_loop() is _running_loop():
            opening.cancel()
        for conn in conns:
            conn.close(_closed())
        if conns:
            with contextlib.suppress(Exception):
                await asyncio.sleep(0)  # let the transport's close run


def _closed() -> Unavailable:
    return Unavailable(grpc.StatusCode.UNAVAILABLE, "cannot call: the client is closed")


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(_deadline_error())


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a connection attempt's failure as seen (every waiter may have given up)."""
    if not task.cancelled():
        task.exception()
