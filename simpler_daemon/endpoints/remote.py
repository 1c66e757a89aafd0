"""RemoteL3Endpoint: drives one remote L3 session over its command and health lanes.

One ordered command lane carries every request; only its head is on the wire::

    submit_progress / control        command lane (TCP)              runner
      queue: [TASK s] [CONTROL s+1]  -- TASK s -------------------->  run
      ACCEPTED once TASK s is sent   <-- COMPLETION s -------------   reply, in order
      COMPLETED, then the next head  -- CONTROL s+1 --------------->  ...
                                     health lane (second TCP)
      last_health = now              <-- HEALTH every 0.2 s -------   own thread

Nothing blocks on the Scheduler's path: the sockets are non-blocking, a partial
write is kept and resumed by the next ``submit_progress`` / ``poll_progress`` /
``on_readable``, a partial read stays in the lane's ``FrameDecoder``. The
Scheduler watches :meth:`wake_fds` and calls :meth:`on_readable`; the endpoint
owns no thread. Turning a dispatch into frame bytes is
:class:`~simpler_daemon.endpoints.taskcodec.TaskCodec`'s job; this module only
queues, moves and matches them.

A failure is sticky (``poisoned``): health silence past ``session_timeout_s``
while a request is outstanding, a closed lane, a protocol error, or a TASK past
its own ``deadline_ms`` plus a grace (the runner stops a task at its deadline and
answers within a fraction of the grace: no answer by then means the runner is
stuck). The owned dispatch then completes once with ENDPOINT_FAILURE
"remote worker W (HOST:PORT) failed: <reason>", pending controls raise
``EndpointError``, both sockets are unwatched and shut down (the runner
sees EOF and exits). A task failure reported by the runner is TASK_FAILURE and
leaves the session usable.
"""

from __future__ import annotations

import asyncio
import logging
import math
import select
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from simpler_daemon.endpoints.base import (
    EndpointCaps,
    EndpointEvent,
    EventKind,
    Outcome,
    WorkerDispatch,
)
from simpler_daemon.endpoints.taskcodec import TaskCodec
from simpler_daemon.errors import ControlError, EndpointError, ProtocolError
from simpler_daemon.remote.manifest import format_host_port
from simpler_daemon.remote.wire import (
    E_OK,
    Completion,
    Control,
    ControlReply,
    Frame,
    FrameDecoder,
    FrameType,
)

if TYPE_CHECKING:
    from simpler_daemon.remote.attach import Session
    from simpler_daemon.remote.spec import RemoteWorkerSpec

log = logging.getLogger("simpler_daemon.endpoints")

#: Added to a TASK's ``deadline_ms``: the runner's own deadline handling (it answers at
#: most ``session.DEADLINE_STOP_S`` = 0.5 s after the deadline) and one round trip, with
#: room for a loaded host. A reply within it fails the task alone; none ends the session.
TASK_DEADLINE_GRACE_S: Final = 2.0
#: Bytes read per ``recv_into`` (a copy_from reply of 8 MiB takes a few rounds).
RECV_CHUNK: Final = 256 << 10

_TASK: Final = 0
_CONTROL: Final = 1
_WOULD_BLOCK: Final = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
_TYPE_TASK: Final = int(FrameType.TASK)
_TYPE_CONTROL: Final = int(FrameType.CONTROL)
_COMMAND_TYPES: Final = frozenset({FrameType.COMPLETION, FrameType.CONTROL_REPLY})
_HEALTH_TYPES: Final = frozenset({FrameType.HEALTH})


class _Request:
    """One TASK or CONTROL on the command lane, from enqueue to reply."""

    __slots__ = (
        "accepted",
        "deadline",
        "deadline_ms",
        "dispatch",
        "done",
        "error",
        "frame",
        "future",
        "kind",
        "loop",
        "name",
        "result",
        "sent_at",
        "sequence",
        "started_at",
        "timeout",
    )

    def __init__(self, kind: int, sequence: int, frame: bytearray) -> None:
        self.kind = kind
        self.sequence = sequence
        self.frame = frame
        self.dispatch: WorkerDispatch | None = None
        self.name = "task"
        self.deadline_ms = 0
        self.timeout = 0.0
        self.started_at = 0.0  # first byte handed to the socket (health silence counts from it)
        self.sent_at = 0.0  # last byte handed to the socket (round trip, deadlines)
        self.deadline = math.inf
        self.accepted = False
        self.done = False
        self.result = b""
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.future: asyncio.Future[None] | None = None


def _set_future(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class RemoteL3Endpoint:
    """One lane's transport to one remote L3 session (capacity 1, no staging)."""

    def __init__(
        self,
        worker_id: int,
        spec: RemoteWorkerSpec,
        session: Session,
        *,
        label: str | None = None,
        live_sessions: Mapping[int, int] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.spec = spec
        self.session = session
        #: The parent's number for this session of the worker (``session_generation``).
        self.generation = session.generation
        self.where = format_host_port(session.host, session.port)
        self.label = label or f"remote worker {worker_id} ({self.where})"
        self.caps = EndpointCaps(
            task_frame_count=1, supports_frame_staging=False, capacity=1, signals_doorbell=False
        )
        self.session_timeout_s = float(spec.session_timeout_s)
        self._cmd = session.command
        self._health = session.health
        self._cmd.setblocking(False)
        self._health.setblocking(False)
        # SSL keeps decrypted bytes of its own that poll(2) cannot see: drain them too.
        self._cmd_ssl = isinstance(self._cmd, ssl.SSLSocket)
        self._health_ssl = isinstance(self._health, ssl.SSLSocket)
        self._cmd_fd = self._cmd.fileno()
        self._health_fd = self._health.fileno()
        self._watched: list[int] = [self._cmd_fd, self._health_fd]
        self._unwatch: Callable[[int], object] | None = None
        #: True once a watcher reads the sockets for us (see ``set_fd_watcher``).
        self._watcher_reads = False
        self._lock = threading.RLock()
        sid, wid = session.session_id, worker_id
        self._cmd_dec = FrameDecoder(session_id=sid, worker_id=wid, allowed=_COMMAND_TYPES)
        self._health_dec = FrameDecoder(session_id=sid, worker_id=wid, allowed=_HEALTH_TYPES)
        self._queue: deque[_Request] = deque()
        self._task: _Request | None = None
        self._owned = 0
        self._out: memoryview | None = None
        self._out_pos = 0
        self._events: list[EndpointEvent] = []
        self._next_seq = 1
        self._rbuf = bytearray(RECV_CHUNK)
        self._rview = memoryview(self._rbuf)
        # ``live_sessions``: worker id -> live session generation (the fleet's table):
        # a TASK naming a buffer of an ended session is refused before it is sent.
        self._codec = TaskCodec(sid, wid, self.label, live_sessions)
        #: Why the endpoint failed (sticky); None while healthy.
        self.failure: str | None = None
        self.stopping = False
        self.closed = False
        self.last_health = time.monotonic()
        self.health_frames = 0
        self.tasks = 0
        self.task_failures = 0
        self.controls = 0
        self.control_failures = 0
        self.failures = 0
        self.round_trip_us = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0

    # -- state --------------------------------------------------------------------------

    @property
    def poisoned(self) -> bool:
        return self.failure is not None

    def owned(self) -> int:
        return self._owned

    def who(self) -> str:
        return self.label

    def health_age(self) -> float:
        """Seconds since the last HEALTH frame was read."""
        return time.monotonic() - self.last_health

    def stats(self) -> dict[str, Any]:
        return {
            "tasks": self.tasks,
            "task_failures": self.task_failures,
            "controls": self.controls,
            "control_failures": self.control_failures,
            "failures": self.failures,
            "round_trip_us": self.round_trip_us,
            "health_age_s": self.health_age(),
            "health_frames": self.health_frames,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "queued": len(self._queue),
            "state": "failed" if self.failure is not None else "ready",
            "reason": self.failure,
        }

    def poison(self, reason: str) -> None:
        """Fail the endpoint stickily (the Scheduler's hook for an external verdict)."""
        with self._lock:
            self._fail(reason)

    # -- fds ------------------------------------------------------------------------------

    def wake_fds(self) -> list[int]:
        """The sockets still being read (command, health); empty once failed or closed."""
        return list(self._watched)

    def set_fd_watcher(self, unwatch: Callable[[int], object]) -> None:
        """``unwatch(fd)`` is called before the endpoint stops reading ``fd``.

        From now on the watcher calls :meth:`on_readable` whenever a socket is
        readable, so ``submit_progress`` and ``poll_progress`` no longer read the
        sockets themselves (four ``recv`` calls that would block, per task); with TLS
        they still do, as decrypted bytes may wait where ``poll(2)`` cannot see them.
        """
        self._unwatch = unwatch
        self._watcher_reads = not (self._cmd_ssl or self._health_ssl)

    def on_readable(self, fd: int | None = None) -> None:
        """Drain the socket ``fd`` (both when None) without blocking; never raises (the
        loop's reader callback: naming the fd that is readable spares a ``recv`` of the
        other lane that would block, once per task)."""
        with self._lock:
            if fd is None or self.failure is not None or self.closed:
                self._safe_pump()
                return
            try:
                if self._out is not None:
                    self._flush()
                if self.failure is None:
                    if fd == self._cmd_fd:
                        self._read_command()
                    elif fd == self._health_fd:
                        self._read_health()
                    else:
                        self._pump()  # not one of ours: read both, as without a name
                        return
                if self.failure is None and self._queue:
                    self._check_clocks(time.monotonic())
            except Exception as exc:
                log.exception("%s: progress failed", self.label)
                self._fail(f"internal error: {type(exc).__name__}: {exc}")

    def _safe_pump(self, read: bool = True) -> None:
        """``_pump`` when healthy; a bug in it fails this endpoint instead of its caller.

        ``read=False``: only the pending write and the clocks, when the watcher reads."""
        if self.failure is not None or self.closed:
            return
        try:
            self._pump(read or not self._watcher_reads)
        except Exception as exc:
            log.exception("%s: progress failed", self.label)
            self._fail(f"internal error: {type(exc).__name__}: {exc}")

    # -- task path ------------------------------------------------------------------------

    def submit_progress(self, d: WorkerDispatch) -> None:
        """Queue ``d`` as a TASK and start writing it; ``EndpointError`` on refusal."""
        with self._lock:
            # Drain first: an idle endpoint judges a closed health lane only now (unless
            # the watcher reads: then it already did, on the poll before this dispatch).
            self._safe_pump(read=False)
            if self.failure is not None:
                raise EndpointError(
                    f"cannot submit to {self.label}: endpoint failed ({self.failure})"
                )
            if self.stopping or self.closed:
                raise EndpointError(f"cannot submit to {self.label}: endpoint is stopping")
            if d.prepare_only:
                raise EndpointError(f"cannot stage on {self.label}: it has a single task frame")
            if self._owned:
                held = self._task.dispatch if self._task is not None else None
                raise EndpointError(
                    f"cannot submit to {self.label}: dispatch "
                    f"{held.dispatch_id if held is not None else '?'} is still in flight"
                )
            task, deadline_ms = self._codec.task(d)
            seq = self._next_seq
            frame = self._codec.frame(_TYPE_TASK, seq, task, "TASK")
            self._next_seq = seq + 1
            req = _Request(_TASK, seq, frame)
            req.dispatch = d
            req.deadline_ms = deadline_ms
            self._task = req
            self._owned = 1
            self._queue.append(req)
            if len(self._queue) == 1:
                self._start_head()

    def activate_progress(self, dispatch_id: int) -> bool:
        return False  # nothing is ever staged on a remote lane

    def poll_progress(self, out: list[EndpointEvent]) -> None:
        """Append ACCEPTED / COMPLETED events; never blocks."""
        with self._lock:
            self._safe_pump(read=False)
            events = self._events
            if events:
                for ev in events:
                    if ev.kind is EventKind.COMPLETED:
                        self._owned -= 1
                out.extend(events)
                events.clear()

    # -- the lane ---------------------------------------------------------------------------

    def _start_head(self) -> None:
        head = self._queue[0]
        head.started_at = time.monotonic()
        self._out = memoryview(head.frame)
        self._out_pos = 0
        self._flush()

    def _flush(self) -> None:
        out = self._out
        cmd = self._cmd
        while out is not None:
            try:
                n = cmd.send(out[self._out_pos :] if self._out_pos else out)
            except _WOULD_BLOCK:
                return
            except OSError as exc:
                self._fail(f"command connection failed: {_os_reason(exc)}")
                return
            self._out_pos += n
            self.bytes_sent += n
            if self._out_pos < len(out):
                continue
            self._out = None
            out.release()
            out = None
            head = self._queue[0]
            now = time.monotonic()
            head.sent_at = now
            head.frame = bytearray()  # the bytes are on the wire; drop them early
            if head.kind == _TASK:
                head.accepted = True
                assert head.dispatch is not None
                self._events.append(EndpointEvent(EventKind.ACCEPTED, head.dispatch))
                if head.deadline_ms:
                    head.deadline = now + head.deadline_ms / 1000.0 + TASK_DEADLINE_GRACE_S
            else:
                head.deadline = now + head.timeout

    def _pump(self, read: bool = True) -> None:
        """Write what is pending, read both lanes (``read``), check the clocks (lock held,
        healthy)."""
        if self._out is not None:
            self._flush()
        if read and self.failure is None:
            self._read_command()
        if read and self.failure is None:
            self._read_health()
        if self.failure is None and self._queue:
            self._check_clocks(time.monotonic())

    def _chunks(self, sock: socket.socket, is_ssl: bool, lane: str) -> Iterator[memoryview]:
        """What ``sock`` holds now, one ``recv`` at a time (an empty chunk at EOF).

        Ends when the socket would block, or after failing the endpoint on an error; a
        caller that fails the endpoint itself stops iterating.
        """
        rbuf, rview = self._rbuf, self._rview
        while True:
            try:
                n = sock.recv_into(rbuf)
            except _WOULD_BLOCK:
                return
            except OSError as exc:
                self._fail(f"{lane} failed: {_os_reason(exc)}")
                return
            yield rview[:n]
            if n < RECV_CHUNK and not (is_ssl and sock.pending()):  # type: ignore[attr-defined]
                return

    def _read_command(self) -> None:
        dec = self._cmd_dec
        for chunk in self._chunks(self._cmd, self._cmd_ssl, "command connection"):
            if not chunk:
                try:
                    dec.eof()
                except ProtocolError as exc:
                    self._fail(f"protocol error: {exc}")
                    return
                self._fail("command connection closed")
                return
            self.bytes_received += len(chunk)
            try:
                frames = dec.feed(chunk)
            except ProtocolError as exc:
                self._fail(f"protocol error: {exc}")
                return
            for f in frames:
                self._on_reply(f)
                if self.failure is not None:
                    return

    def _read_health(self) -> None:
        for chunk in self._chunks(self._health, self._health_ssl, "health lane"):
            if not chunk:
                # A session that ends closes both lanes: what is already on the command
                # lane (its last replies, or the EOF or protocol error that ended the
                # session) is read first, so the failure names the cause, not the effect.
                self._read_command()
                if self.failure is None:
                    self._fail("health lane closed")
                return
            try:
                frames = self._health_dec.feed(chunk)
            except ProtocolError as exc:
                self._fail(f"protocol error on the health lane: {exc}")
                return
            if frames:
                self.last_health = time.monotonic()
                self.health_frames += len(frames)

    def _check_clocks(self, now: float) -> None:
        head = self._queue[0]
        if not head.started_at:
            return
        # Silence counts from the later of the last beat and the request's start: an idle
        # endpoint nobody drained is judged on the request, not on its idle past.
        silent = now - max(self.last_health, head.started_at)
        if silent > self.session_timeout_s:
            self._fail(
                f"health lane silent for {silent:.1f} s "
                f"(session_timeout_s={self.session_timeout_s:g})"
            )
            return
        if now > head.deadline:
            if head.kind == _TASK:
                self._fail(
                    f"task sequence {head.sequence} exceeded its deadline of {head.deadline_ms} ms"
                )
            else:
                head.error = TimeoutError(
                    f"cannot complete {head.name} on {self.label}: no reply within "
                    f"{head.timeout:g} s (sequence {head.sequence}); the endpoint is poisoned"
                )
                self._resolve(head)
                self._fail(
                    f"control {head.name} sequence {head.sequence} got no reply within "
                    f"{head.timeout:g} s"
                )

    def _on_reply(self, f: Frame) -> None:
        queue = self._queue
        head = queue[0] if queue else None
        if head is None or not head.sent_at:
            state = "no request is in flight" if head is None else "its request is not sent yet"
            self._fail(f"protocol error: unexpected {f.type.name} sequence {f.sequence}: {state}")
            return
        if f.sequence != head.sequence:
            self._fail(
                f"protocol error: {f.type.name} carries sequence {f.sequence}, the request in "
                f"flight is {'TASK' if head.kind == _TASK else 'CONTROL'} sequence "
                f"{head.sequence}"
            )
            return
        now = time.monotonic()
        if head.kind == _TASK:
            c = f.payload
            if not isinstance(c, Completion):
                self._fail(
                    f"protocol error: TASK sequence {head.sequence} answered by {f.type.name}"
                )
                return
            queue.popleft()
            self._task = None
            self.tasks += 1
            self.round_trip_us = (now - head.sent_at) * 1e6
            d = head.dispatch
            assert d is not None
            if c.error_code == E_OK:
                self._events.append(EndpointEvent(EventKind.COMPLETED, d))
            else:
                self.task_failures += 1
                text = c.error_text + "\n" + c.traceback if c.traceback else c.error_text
                self._events.append(
                    EndpointEvent(
                        EventKind.COMPLETED, d, Outcome.TASK_FAILURE, int(c.error_code), text
                    )
                )
        else:
            r = f.payload
            if not isinstance(r, ControlReply) or r.name != head.name:
                got = r.name if isinstance(r, ControlReply) else f.type.name
                self._fail(
                    f"protocol error: CONTROL {head.name} sequence {head.sequence} answered "
                    f"by {got}"
                )
                return
            queue.popleft()
            self.controls += 1
            self.round_trip_us = (now - head.sent_at) * 1e6
            if r.error_code == E_OK:
                head.result = r.result
            else:
                self.control_failures += 1
                head.error = ControlError(
                    f"{head.name} failed on {self.label}: {r.error_text} "
                    f"(error code {r.error_code})"
                )
            self._resolve(head)
        if queue:
            self._start_head()

    def _resolve(self, req: _Request) -> None:
        req.done = True
        fut, loop = req.future, req.loop
        if fut is None or loop is None or fut.done():
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fut.set_result(None)
        else:
            try:
                loop.call_soon_threadsafe(_set_future, fut)
            except RuntimeError:  # the waiter's loop is closed: nobody is waiting any more
                pass

    # -- failure ------------------------------------------------------------------------------

    def _fail(self, reason: str, *, deliberate: bool = False, keep_open: bool = False) -> None:
        """Sticky failure: fail every request, stop reading, shut the sockets down."""
        if self.failure is not None:
            return
        self.failure = reason
        if not deliberate:
            self.failures += 1
            log.warning("%s failed: %s", self.label, reason)
        message = f"{self.label} failed: {reason}"
        for req in self._queue:
            if req.kind == _TASK:
                assert req.dispatch is not None
                self._events.append(
                    EndpointEvent(
                        EventKind.COMPLETED, req.dispatch, Outcome.ENDPOINT_FAILURE, -1, message
                    )
                )
            elif not req.done:
                req.error = EndpointError(f"cannot complete {req.name} on {self.label}: {reason}")
                self._resolve(req)
        self._queue.clear()
        self._task = None
        if self._out is not None:
            self._out.release()
            self._out = None
        self._stop_reading()
        if not keep_open:
            for sock in (self._cmd, self._health):
                try:
                    # The runner sees EOF and exits; the fds stay valid until close().
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _stop_reading(self) -> None:
        watched, self._watched = self._watched, []
        unwatch = self._unwatch
        if unwatch is None:
            return
        for fd in watched:
            try:
                unwatch(fd)
            except Exception:
                log.exception("%s: unwatch(%d) failed", self.label, fd)

    # -- controls ------------------------------------------------------------------------------

    def _enqueue_control(
        self, name: str, body: bytes, timeout: float | None, loop: asyncio.AbstractEventLoop | None
    ) -> _Request:
        t = self.session_timeout_s if timeout is None else float(timeout)
        if not (math.isfinite(t) and t > 0):
            raise ValueError(f"cannot send {name} to {self.label}: timeout={timeout!r} must be > 0")
        with self._lock:
            if self.failure is not None:
                raise EndpointError(
                    f"cannot send {name} to {self.label}: endpoint failed ({self.failure})"
                )
            if self.closed:
                raise EndpointError(f"cannot send {name} to {self.label}: endpoint is closed")
            seq = self._next_seq
            frame = self._codec.frame(_TYPE_CONTROL, seq, Control(name, 1, body), name)
            self._next_seq = seq + 1
            req = _Request(_CONTROL, seq, frame)
            req.name = name
            req.timeout = t
            if loop is not None:
                req.loop = loop
                req.future = loop.create_future()
            self._queue.append(req)
            if len(self._queue) == 1:
                self._start_head()
            return req

    def control(self, name: str, body: bytes, timeout: float | None = None) -> bytes:
        """Send control ``name`` and wait for its reply, pumping the sockets (blocking).

        The control waits behind the request in flight (a TASK's completion is
        kept for the next ``poll_progress``); ``timeout`` (default
        ``session_timeout_s``) counts from when the control is written.
        ``ControlError`` on a non-zero reply, ``EndpointError`` when the endpoint
        failed, ``TimeoutError`` (and the endpoint poisoned) without a reply.
        """
        req = self._enqueue_control(name, body, timeout, None)
        poller = select.poll()
        registered = 0
        while True:
            step = self._pump_for(req)
            if step is None:
                return self._outcome(req)
            writing, wait = step
            want = select.POLLIN | (select.POLLOUT if writing else 0)
            if self._unwatch is not None:
                # The loop thread may read our reply first; poll(2) would not wake us.
                wait = min(wait, 0.005)
            if want != registered:
                for fd in (self._cmd_fd, self._health_fd):
                    poller.register(fd, want if fd == self._cmd_fd else select.POLLIN)
                registered = want
            poller.poll(max(1, math.ceil(wait * 1000)))

    async def control_async(self, name: str, body: bytes, timeout: float | None = None) -> bytes:
        """Awaitable :meth:`control`: the reply is delivered by ``on_readable`` /
        ``poll_progress`` (the Scheduler's loop readers); the coroutine pumps the
        sockets itself between bounded waits, so it also works with no Scheduler."""
        loop = asyncio.get_running_loop()
        req = self._enqueue_control(name, body, timeout, loop)
        fut = req.future
        assert fut is not None
        delay = 0.0005
        while True:
            step = self._pump_for(req)
            if step is None:
                return self._outcome(req)
            writing, wait = step
            if self._unwatch is None:
                # Nobody else reads the sockets: poll them on a short backoff.
                wait = min(wait, delay)
                delay = min(delay * 2, 0.01)
            if writing:
                await self._writable(loop, fut, wait)
            else:
                await asyncio.wait((fut,), timeout=wait)

    async def _writable(
        self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None], wait: float
    ) -> None:
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_writer(self._cmd_fd, _set_future, ready)
        try:
            await asyncio.wait((fut, ready), timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        finally:
            loop.remove_writer(self._cmd_fd)
            ready.cancel()

    def _pump_for(self, req: _Request) -> tuple[bool, float] | None:
        """Pump once for a control's waiter: None once ``req`` is done, else whether a
        write is pending and how long the waiter may sleep (``_wait_slice``)."""
        with self._lock:
            if not req.done:
                self._safe_pump()
            if req.done:
                return None
            return self._out is not None, self._wait_slice(req)

    def _wait_slice(self, req: _Request) -> float:
        """How long a control waiter may sleep before it must pump or check a clock.

        With loop readers (a watcher is set) the reply arrives through
        ``on_readable``; the waiter only wakes for the next clock (the head's
        deadline, health silence), which nobody else checks while the Scheduler
        is parked with no task in flight.
        """
        now = time.monotonic()
        wait = 0.05 if self._unwatch is None else 1.0
        head = self._queue[0] if self._queue else None
        if head is not None and head.started_at:
            wait = min(wait, head.deadline - now)
            silent_until = max(self.last_health, head.started_at) + self.session_timeout_s
            wait = min(wait, silent_until - now)
        return max(wait, 0.0005) + 0.0005

    def _outcome(self, req: _Request) -> bytes:
        if req.error is not None:
            raise req.error
        return req.result

    # -- stop ---------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """No submission after this returns; the request in flight goes on."""
        self.stopping = True

    def shutdown(self, timeout: float) -> None:
        """Send SHUTDOWN (best effort, within ``timeout``), then close the sockets.

        The owned dispatch (if any) completes with ENDPOINT_FAILURE and pending
        controls raise ``EndpointError``.
        """
        deadline = time.monotonic() + max(0.0, timeout)
        with self._lock:
            if self.closed:
                return
            self.stopping = True
            healthy = self.failure is None
            pending = bytes(self._out[self._out_pos :]) if self._out is not None else b""
            seq = self._next_seq
            self._next_seq = seq + 1
            self._fail("endpoint shut down", deliberate=True, keep_open=True)
        if healthy:
            self._send_shutdown(pending, seq, deadline)
        self.close()

    def _send_shutdown(self, pending: bytes, seq: int, deadline: float) -> None:
        """Finish the partial frame, send SHUTDOWN, wait for the runner's EOF (blocking)."""
        sock = self._cmd
        try:
            data = pending + bytes(
                self._codec.frame(int(FrameType.SHUTDOWN), seq, None, "SHUTDOWN")
            )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            sock.settimeout(remaining)
            sock.sendall(data)
            while (remaining := deadline - time.monotonic()) > 0:
                sock.settimeout(remaining)
                if not sock.recv(RECV_CHUNK):
                    return  # the runner closed the lane: it is on its way out
        except (OSError, EndpointError) as exc:
            log.debug("%s: SHUTDOWN not delivered: %s", self.label, exc)

    def close(self) -> None:
        """Close both sockets (the runner sees EOF and exits); idempotent."""
        with self._lock:
            if self.closed:
                return
            self.stopping = True
            self._fail("endpoint closed", deliberate=True, keep_open=True)
            self._stop_reading()
            self.closed = True
            for sock in (self._cmd, self._health):
                try:
                    sock.close()
                except OSError:
                    pass


def _os_reason(exc: OSError) -> str:
    if isinstance(exc, ConnectionResetError):
        return "connection reset by peer"
    return exc.strerror or str(exc) or type(exc).__name__
