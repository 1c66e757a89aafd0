"""The daemon's local fast path: the gRPC API's handlers behind a framed msgspec socket.

gRPC costs local clients hundreds of microseconds per call whatever the channel
options; most of it is grpcio's own machinery, not the daemon. Local clients
(``simpler_daemon.client``, hence simplerctl) therefore call the same servicer over
a second Unix socket speaking the frames of :mod:`simpler_daemon.protocol.fastwire`::

    client --unix--> <dir>/daemon.fast.sock (grpc.socket_mode, grpc.socket_group)
                        |  FastServer: SO_PEERCRED at accept -> FastContext
                        v  Call(id, "SubmitRun", request bytes)
                     DaemonService.SubmitRun(request, FastContext)   <- the gRPC handler
                        |  response message | context.abort(code, details, field)
                        v
                     Reply(id, code, details, field, response bytes)

Identical semantics by construction: a call runs the very handler gRPC runs (same
decorators, so the same status mapping and request metrics), with the same
protobuf messages; the caller is identified from its peer credentials exactly as
through the gRPC socket's relay (``peers.identify``), so ownership, admin rights
and quotas are shared between the transports. TCP is never served here.

One task per call: a client disconnecting cancels its calls' handlers, a
``Cancel`` frame cancels one, a call's deadline (``Call.timeout``) answers
DEADLINE_EXCEEDED. A malformed frame closes its connection with a logged reason.
Backpressure is per connection: a server stream waits while the socket's write
buffer is full, and reading pauses while that buffer is above its high-water mark,
while a client stream's unread chunks pile up, or while MAX_CALLS calls are in
flight (later Calls are held until one finishes). At most ``[fast] max_connections``
connections are served; one holding a partly received frame for longer than
``[fast] frame_timeout`` is dropped. A request message above
``limits.max_message_bytes`` fails RESOURCE_EXHAUSTED with gRPC's words.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import grpc

from simpler_daemon.errors import ProtocolError
from simpler_daemon.protocol.fastwire import (
    METHODS,
    NATIVE_VERSION,
    PROTOCOL_VERSION,
    SERVER_FRAMES,
    Call,
    Cancel,
    End,
    FrameDecoder,
    Hello,
    Item,
    Oversize,
    Reply,
    Submit,
    Wait,
    Welcome,
    encode,
    frame_limit,
)
from simpler_daemon.server.decoding import tolerant
from simpler_daemon.server.eager import start_eagerly
from simpler_daemon.server.fastcontext import CODE_NUMBER as _CODE_NUMBER
from simpler_daemon.server.fastcontext import Deferred, FastAbort, FastContext
from simpler_daemon.server.fastowed import owe
from simpler_daemon.server.peers import peer_credentials
from simpler_daemon.system.localtrust import bind_private_listener

__all__ = ["Deferred", "FastAbort", "FastContext", "FastServer"]

log = logging.getLogger("simpler_daemon.daemon")

Code = grpc.StatusCode
#: Bytes the socket's write buffer holds before a server stream waits.
_HIGH_WATER: Final = 4 << 20
#: Unread client-stream bytes of one connection before it stops reading.
_READ_HIGH: Final = 8 << 20
#: Calls in flight on one connection: later Calls are held (and reading paused) until
#: one finishes, so a client that pipelines without reading cannot pile up handlers.
MAX_CALLS: Final = 256
#: Seconds between checks of the calls' deadlines.
DEADLINE_TICK: Final = 0.05
#: The frames that start a call (version 2 adds Submit and Wait).
_STARTS: Final = (Call, Submit, Wait)
#: The servicer's handlers of the version-2 frames, and the RPC each stands for.
_NATIVE: Final = {Submit: ("FastSubmitRun", "SubmitRun"), Wait: ("FastWaitRun", "WaitRun")}


def _too_large_details(size: int, limit: int) -> str:
    """gRPC's own words for a request message above its receive limit (so both
    transports refuse it alike)."""
    return f"SERVER: Received message larger than max ({size} vs. {limit})"


class _Call:
    """One call in flight on a connection (``task``: its handler's task, or the future
    standing for a :class:`Deferred` answer: cancelling either stops the call)."""

    __slots__ = ("deadline", "expired", "id", "inbound", "rejected", "task")

    def __init__(self, call_id: int) -> None:
        self.id = call_id
        self.task: asyncio.Future[None] | None = None
        self.deadline: float | None = None  # loop.time() past which the call is expired
        self.expired = False
        #: Cancelled for an oversize request message: answered when the task is done.
        self.rejected = False
        self.inbound: _Inbound | None = None

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()


class _Inbound:
    """The request messages of a client stream, as the handler's async iterator."""

    __slots__ = ("_conn", "_items", "_parse", "_waiter", "ended")

    def __init__(self, conn: _Connection, parse: Callable[[bytes], Any]) -> None:
        self._conn = conn
        self._parse = parse
        self._items: collections.deque[bytes] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self.ended = False

    def put(self, data: bytes) -> None:
        self._items.append(data)
        self._conn.unread(len(data))
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def discard(self) -> None:
        """The call is over: what it did not read no longer counts against the connection."""
        while self._items:
            self._conn.unread(-len(self._items.popleft()))

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            if self._items:
                data = self._items.popleft()
                self._conn.unread(-len(data))
                yield self._parse(data)
            elif self.ended:
                return
            else:
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
                self._waiter = None


class _Connection(asyncio.Protocol):
    """One client connection: decodes its frames, runs one task per call."""

    def __init__(self, server: FastServer) -> None:
        self._server = server
        self._transport: Any = None  # uvloop's transports are not asyncio.Transport
        self._loop: asyncio.AbstractEventLoop = asyncio.get_running_loop()
        self._decoder = FrameDecoder(SERVER_FRAMES, server.max_frame)
        self._ctx: FastContext | None = None
        self._calls: dict[int, _Call] = {}
        self._closed = False
        self._writable: asyncio.Future[None] | None = None
        self._unread = 0
        #: Why reading is paused ("unread": client-stream chunks pile up, "write": the
        #: write buffer is above its high-water mark, "calls": MAX_CALLS in flight):
        #: reading resumes when no reason is left.
        self._paused_for: set[str] = set()
        self._transport_paused = False
        #: Frames read past MAX_CALLS calls in flight (a held Call and what follows
        #: it for held calls), started in order as calls finish.
        self._held: collections.deque[Any] = collections.deque()
        self._releasing = False
        #: loop.time() since which a partly received frame is held (None: none).
        self.partial_since: float | None = None
        #: Whether the client negotiated version 2 (its Hello's ``upto``; Welcome sent).
        self._native = False

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        try:
            creds = peer_credentials(transport.get_extra_info("socket"))
        except OSError as exc:
            log.warning(
                "refused a fast-path client on %s: no peer credentials: %s", self._server.path, exc
            )
            self._closed = True
            transport.close()
            return
        if not self._server.admit():
            self._closed = True
            transport.close()
            return
        self._ctx = FastContext(creds)
        transport.set_write_buffer_limits(high=_HIGH_WATER)  # type: ignore[attr-defined]
        self._server.connections.add(self)
        log.debug("fast path: a client connected (%s)", creds)

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        try:
            frames = self._decoder.feed(data)
        except ProtocolError as exc:
            self.drop(str(exc))
            return
        if not self._decoder.incomplete:
            self.partial_since = None
        elif frames or self.partial_since is None:  # a new frame began: its clock starts
            self.partial_since = self._loop.time()
            self._server.watch_deadlines()
        held = self._held
        for frame in frames:
            if (held or (type(frame) in _STARTS and self._full())) and not self._now(frame):
                held.append(frame)
                continue
            self._handle(frame)
            if self._closed:
                return
        self._check_held()

    def _full(self) -> bool:
        """Whether a Call read now waits: MAX_CALLS calls are in flight, or the replies
        already written wait for the client to read them (it pipelines, never reads)."""
        return len(self._calls) >= MAX_CALLS or "write" in self._paused_for

    def _now(self, frame: Any) -> bool:
        """Whether ``frame``, read while Calls are held, is handled now rather than
        after them: frames of calls in flight (their handlers may be waiting for them)."""
        kind = type(frame)
        return kind is Hello or (kind not in _STARTS and frame.id in self._calls)

    def _handle(self, frame: Any) -> None:
        kind = type(frame)
        if kind is Call:
            self._start(frame)
        elif kind is Submit or kind is Wait:
            self._start_native(frame)
        elif kind is Item:
            call = self._calls.get(frame.id)
            if call is not None and call.inbound is not None and not call.inbound.ended:
                if len(frame.data) > self._server.max_message_bytes:
                    self._too_large(frame.id, len(frame.data), True)
                else:
                    call.inbound.put(frame.data)
        elif kind is End:
            call = self._calls.get(frame.id)
            if call is not None and call.inbound is not None:
                call.inbound.end()
        elif kind is Oversize:
            self._too_large(frame.id, frame.size, frame.tag == Item.__struct_config__.tag)
        elif kind is Cancel:
            call = self._calls.get(frame.id)
            if call is not None:
                call.cancel()
        elif kind is Hello:
            if frame.version != PROTOCOL_VERSION:
                self.drop(
                    f"cannot serve protocol version {frame.version} (this daemon speaks "
                    f"{PROTOCOL_VERSION})"
                )
            elif self._ctx is not None:
                self._ctx.set_label(frame.label)
                if frame.upto >= NATIVE_VERSION and self._server.native:
                    self._native = True
                    self._send(encode(Welcome(NATIVE_VERSION)))

    def _check_held(self) -> None:
        """Pause reading while Calls are held, unless a call in flight still waits for
        its client stream's messages (they may be behind): then only when the held
        frames themselves pile up."""
        held = self._held
        if not held:
            if "calls" in self._paused_for:
                self._pause("calls", False)
            return
        waiting = any(c.inbound is not None and not c.inbound.ended for c in self._calls.values())
        self._pause("calls", len(held) > MAX_CALLS or not waiting)

    def _release(self) -> None:
        """Calls finished: start held frames while below MAX_CALLS."""
        self._releasing = False
        held = self._held
        while held and not self._closed:
            if type(held[0]) in _STARTS and self._full():
                break
            self._handle(held.popleft())
        if not self._closed:
            self._check_held()

    def eof_received(self) -> bool | None:
        return None  # close: a client that stops sending has given up on its calls

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._server.connections.discard(self)
        if self._calls:
            log.debug(
                "fast path: a client went away (%s): cancelling %d calls",
                self._ctx and self._ctx.peer_credentials,
                len(self._calls),
            )
        for call in list(self._calls.values()):
            call.cancel()
        self._wake_writer()

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()
        # Replies pile up unread: read no more calls until the client catches up.
        self._pause("write", True)

    def resume_writing(self) -> None:
        self._wake_writer()
        self._pause("write", False)
        self._schedule_release()

    # -- plumbing -------------------------------------------------------------------------

    def drop(self, reason: str) -> None:
        """Close the connection for a protocol violation, saying why in the log."""
        if self._closed:
            return
        self._closed = True
        log.warning(
            "closed a fast-path connection (%s): %s",
            self._ctx and self._ctx.peer_credentials,
            reason,
        )
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()  # flushes what is buffered first

    def has_deadlines(self) -> bool:
        return any(call.deadline is not None for call in self._calls.values())

    def calls(self) -> list[asyncio.Future[None]]:
        return [c.task for c in self._calls.values() if c.task is not None]

    def _wake_writer(self) -> None:
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def unread(self, delta: int) -> None:
        """Client-stream bytes received but not yet read by a handler: past the high
        water mark the connection stops reading until the handlers catch up."""
        self._unread += delta
        if self._unread > _READ_HIGH:
            self._pause("unread", True)
        elif self._unread <= _READ_HIGH // 2:
            self._pause("unread", False)

    def _pause(self, reason: str, on: bool) -> None:
        """Set or clear one reason to pause reading; the transport reads while none is set."""
        if on:
            self._paused_for.add(reason)
        else:
            self._paused_for.discard(reason)
        transport = self._transport
        if transport is None or self._closed:
            return
        want = bool(self._paused_for)
        if want != self._transport_paused:
            self._transport_paused = want
            if want:
                transport.pause_reading()
            else:
                transport.resume_reading()

    def _send(self, data: bytes) -> None:
        if not self._closed:
            self._transport.write(data)

    def _too_large(self, call_id: int, size: int, item: bool) -> None:
        """A request message of call ``call_id`` exceeds limits.max_message_bytes: the
        call fails RESOURCE_EXHAUSTED with gRPC's words, the connection lives on. A
        client stream's call (``item``) already running is cancelled and answered
        when its handler has stopped."""
        details = _too_large_details(size, self._server.max_message_bytes)
        reply = encode(Reply(call_id, _CODE_NUMBER[Code.RESOURCE_EXHAUSTED], details))
        call = self._calls.get(call_id)
        if call is None:
            if not item:  # an oversize Call: never started
                self._send(reply)
            return  # an Item of a call already over: nobody to answer
        if call.inbound is not None:
            call.inbound.end()
        call.expired = False
        task = call.task
        if task is None or task.done():
            self._finish(call)
            self._send(reply)
            return

        def answer(_: asyncio.Future[None]) -> None:
            self._finish(call)
            self._send(reply)

        call.rejected = True
        task.add_done_callback(answer)
        task.cancel()

    def _start(self, frame: Call) -> None:
        call_id = frame.id
        if call_id in self._calls:
            self.drop(f"call id {call_id} reused while that call is in flight")
            return
        server = self._server
        if len(frame.data) > server.max_message_bytes:
            self._too_large(call_id, len(frame.data), False)
            return
        entry = server.table.get(frame.method)
        if entry is None:
            self._send(
                encode(
                    Reply(
                        call_id,
                        _CODE_NUMBER[Code.UNIMPLEMENTED],
                        f"cannot call {frame.method!r}: simpler.daemon.v1.Daemon has no such method",
                    )
                )
            )
            return
        method, handler, parse = entry
        if frame.stream != method.client_stream:
            kind = "a client-streaming" if method.client_stream else "not a client-streaming"
            self._send(
                encode(
                    Reply(
                        call_id,
                        _CODE_NUMBER[Code.INVALID_ARGUMENT],
                        f"cannot call {frame.method}: it is {kind} method",
                    )
                )
            )
            return
        call = _Call(call_id)
        request: Any
        if method.client_stream:
            call.inbound = _Inbound(self, parse)
            request = call.inbound
        else:
            request = parse(frame.data)
        if method.server_stream:
            coro = self._run_stream(call, handler, request)
        else:
            coro = self._run_unary(call, frame.method, handler, request)
        self._launch(call, coro, frame.timeout)

    def _start_native(self, frame: Submit | Wait) -> None:
        """A version-2 frame: the SubmitRun or WaitRun it stands for, answered as one."""
        kind = type(frame).__name__
        if not self._native:
            self.drop(
                f"a {kind} frame on a connection that did not negotiate protocol version "
                f"{NATIVE_VERSION} (Hello.upto)"
            )
            return
        if frame.id in self._calls:
            self.drop(f"call id {frame.id} reused while that call is in flight")
            return
        name, handler = self._server.native[type(frame)]
        call = _Call(frame.id)
        self._launch(call, self._run_unary(call, name, handler, frame), frame.timeout, True)

    def _launch(self, call: _Call, coro: Any, timeout: float | None, eager: bool = False) -> None:
        """Run ``call``'s handler in a task; ``eager`` (a run's Submit or Wait frame): it
        starts in this turn and gets a task only once it waits (server/eager.py); a
        deferred answer has set ``call.task`` by then (the future standing for it)."""
        self._calls[call.id] = call
        loop = self._loop
        if timeout is not None:
            call.deadline = loop.time() + timeout
            self._server.watch_deadlines()
        task = start_eagerly(loop, coro) if eager else loop.create_task(coro)
        if task is not None:
            call.task = task

    def expire(self, now: float) -> None:
        """Cancel the calls whose deadline passed: they answer DEADLINE_EXCEEDED. Drop
        the connection when it held a partly received frame past ``frame_timeout``."""
        since = self.partial_since
        timeout = self._server.frame_timeout
        if since is not None and now - since > timeout:
            self.partial_since = None
            self.drop(
                f"an incomplete frame was held for more than fast.frame_timeout = {timeout} s"
            )
            return
        for call in list(self._calls.values()):
            if (
                call.deadline is not None
                and call.deadline <= now
                and call.task is not None
                and not call.rejected
            ):
                call.expired = True
                call.task.cancel()

    def _finish(self, call: _Call) -> None:
        self._calls.pop(call.id, None)
        if call.inbound is not None:
            call.inbound.discard()
        self._schedule_release()

    def _schedule_release(self) -> None:
        if self._held and not self._releasing and not self._closed:
            self._releasing = True  # not from inside a handler's task: on the loop
            self._loop.call_soon(self._release)

    async def _run_unary(self, call: _Call, name: str, handler: Any, request: Any) -> None:
        deferred = False
        try:
            response = await handler(request, self._ctx)
            if type(response) is Deferred:
                deferred = True
                self._defer(call, name, response)
                return
        except FastAbort as exc:
            reply = Reply(call.id, _CODE_NUMBER[exc.code], exc.details, exc.field)
        except asyncio.CancelledError:
            if not call.expired:
                return  # the client cancelled the call or went away: nobody to answer
            reply = Reply(call.id, _CODE_NUMBER[Code.DEADLINE_EXCEEDED], "Deadline Exceeded")
        except Exception as exc:  # the decorators map every error: this is a bug
            log.error("fast path: %s failed: %s", name, exc, exc_info=exc)
            reply = Reply(
                call.id,
                _CODE_NUMBER[Code.INTERNAL],
                f"internal error in {name} ({type(exc).__name__}); see the daemon log",
            )
        else:
            reply = self._answer(call.id, name, response)
        finally:
            if not deferred:
                self._finish(call)
        self._send(encode(reply))

    def _answer(self, call_id: int, name: str, response: Any) -> Reply:
        """The Reply carrying ``response`` (RESOURCE_EXHAUSTED when it is too large)."""
        data = response.SerializeToString()
        limit = self._server.max_message_bytes
        if len(data) > limit:
            return Reply(
                call_id,
                _CODE_NUMBER[Code.RESOURCE_EXHAUSTED],
                f"cannot send the {name} response: {len(data)} bytes exceed "
                f"limits.max_message_bytes = {limit}",
            )
        return Reply(call_id, 0, "", "", data)

    def _defer(self, call: _Call, name: str, deferred: Deferred) -> None:
        """Answer ``call`` when ``deferred``'s run ends or its wait expires, from that
        turn (server/fastowed.py)."""
        owe(self, call, name, deferred)

    async def _run_stream(self, call: _Call, handler: Any, request: Any) -> None:
        end = End(call.id)
        try:
            async for item in handler(request, self._ctx):
                if self._closed:
                    return
                self._send(encode(Item(call.id, item.SerializeToString())))
                if self._writable is not None:  # the client reads slower than we write
                    await self._writable
        except FastAbort as exc:
            end = End(call.id, _CODE_NUMBER[exc.code], exc.details, exc.field)
        except asyncio.CancelledError:
            if not call.expired:
                return
            end = End(call.id, _CODE_NUMBER[Code.DEADLINE_EXCEEDED], "Deadline Exceeded")
        except Exception as exc:
            log.error("fast path: a stream failed: %s", exc, exc_info=exc)
            end = End(
                call.id,
                _CODE_NUMBER[Code.INTERNAL],
                f"internal error in a stream ({type(exc).__name__}); see the daemon log",
            )
        finally:
            self._finish(call)
        self._send(encode(end))


class FastServer:
    """The fast-path listener over ``service`` (a :class:`DaemonService`) at ``path``.

    ``start()`` binds ``path`` (mode 0600 until the caller publishes it with the
    socket's mode and group) and serves; ``close(grace)`` stops accepting, gives the
    calls in flight ``grace`` seconds, cancels the rest and closes every connection.
    The caller removes the socket file (the daemon renames it into place)."""

    def __init__(
        self,
        service: Any,
        path: str,
        max_message_bytes: int,
        *,
        max_connections: int = 1024,
        frame_timeout: float = 30.0,
    ) -> None:
        self.path = path
        self.max_message_bytes = max_message_bytes
        #: ``[fast] max_connections``: past it a new connection is closed at once.
        self.max_connections = max_connections
        #: ``[fast] frame_timeout``: seconds a partly received frame is waited for.
        self.frame_timeout = frame_timeout
        self._refusing = False  # warned about max_connections; again once below it
        self.max_frame = frame_limit(max_message_bytes)
        #: Every served method: its description, the servicer's handler, its parser
        #: (one lookup per call).
        self.table: dict[str, tuple[Any, Any, Callable[[bytes], Any]]] = {}
        for name, method in METHODS.items():
            handler = getattr(service, name, None)
            if handler is not None:
                parse = tolerant(method.request.FromString)
                assert parse is not None
                self.table[name] = (method, handler, parse)
        #: The version-2 frames' handlers (none: the service has not both, and no
        #: client is welcomed to version 2): frame type -> (RPC name, handler).
        self.native: dict[type, tuple[str, Any]] = {}
        for kind, (attr, name) in _NATIVE.items():
            handler = getattr(service, attr, None)
            if handler is not None:
                self.native[kind] = (name, handler)
        if len(self.native) != len(_NATIVE):
            self.native.clear()
        self.connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    def admit(self) -> bool:
        """Whether one more connection may be served (``[fast] max_connections``); the
        first refusal of a burst is logged, not each (a flood would flood the log)."""
        if len(self.connections) < self.max_connections:
            self._refusing = False
            return True
        if not self._refusing:
            self._refusing = True
            log.warning(
                "refusing fast-path clients on %s: %d connections reached "
                "fast.max_connections (further refusals are not logged until below it)",
                self.path,
                self.max_connections,
            )
        return False

    def watch_deadlines(self) -> None:
        """Check calls' deadlines, and connections holding a partly received frame
        (``frame_timeout``), every DEADLINE_TICK seconds while there are some: one
        timer for the server rather than one per call or connection (the client
        enforces its deadline to the microsecond itself; this only stops the handler)."""
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(DEADLINE_TICK, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        now = asyncio.get_running_loop().time()
        for conn in list(self.connections):
            conn.expire(now)
        if any(conn.has_deadlines() or conn.partial_since is not None for conn in self.connections):
            self.watch_deadlines()

    async def start(self) -> None:
        sock = bind_private_listener(self.path)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), sock=sock)

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def close(self, grace: float) -> None:
        self.stop_accepting()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        tasks = [t for conn in self.connections for t in conn.calls()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
        self.connections.clear()
