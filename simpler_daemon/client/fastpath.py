"""The client end of the daemon's local fast path (frames: :mod:`simpler_daemon.protocol.fastwire`).

``simpler_daemon.client`` uses these transports when the daemon's fast socket
(``<dir>/<stem>.fast.sock`` beside the gRPC socket) exists, or when told to
(``transport="fast"``). They carry the gRPC API's protobuf messages, so a call
answers exactly what gRPC would; a refusal is the same
:class:`~simpler_daemon.client.errors.DaemonError` subclass with the same ``.field``.

* :class:`FastTransport` (blocking): a small pool of connections. A call takes an
  idle connection or opens one, so threads (a client's ``DoneWatcher`` thread, the
  caller's own) never share a connection mid-call; a call that times out, or a
  stream left before its end, closes its connection (its handler is then cancelled
  by the daemon).
  A forked child that uses its parent's transport gets a pool of its own.
  It offers protocol version 2 in its Hello: once the daemon's Welcome arrived on a
  connection (before the first reply), SubmitRun and WaitRun go out on it as the
  msgspec ``Submit`` and ``Wait`` frames (no protobuf request to build, encode or
  parse), answered with the same Reply; a daemon of version 1 never welcomes, and
  every call stays a ``Call``. A submit of more than ``_NATIVE_TASKS`` tasks or
  ``_NATIVE_BYTES`` bytes also stays a ``Call`` (whose oversize reply the daemon
  answers per call, as gRPC does).
* ``AsyncFastTransport`` (asyncio, :mod:`simpler_daemon.client.asyncfast`): one
  connection multiplexed by call id, with the same protocol version 2 frames.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any, Final

import grpc

from simpler_daemon.client.errors import DaemonError, DeadlineExceeded, Unavailable, daemon_error
from simpler_daemon.errors import ProtocolError
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol.fastwire import (
    CLIENT_FRAMES,
    MAX_LABEL,
    METHODS,
    NATIVE_VERSION,
    PROTOCOL_VERSION,
    Call,
    End,
    FrameDecoder,
    Hello,
    Item,
    NativeTask,
    Reply,
    Submit,
    Wait,
    Welcome,
    encode,
)
from simpler_daemon.protocol.metadata import FIELD_METADATA
from simpler_daemon.system.localtrust import check_socket_path
from simpler_daemon.system.runtimedir import fast_socket_path

__all__ = [
    "ENV_TRANSPORT",
    "TRANSPORTS",
    "FastTransport",
    "pick_fast_socket",
    "status_error",
]

#: Overrides ``transport="auto"``: ``fast`` or ``grpc``.
ENV_TRANSPORT: Final = "SIMPLER_DAEMON_TRANSPORT"
TRANSPORTS: Final = ("auto", "fast", "grpc")

_BY_NUMBER: Final[dict[int, grpc.StatusCode]] = {c.value[0]: c for c in grpc.StatusCode}
#: Replies are bounded by the daemon's own limit; the client trusts its daemon.
_MAX_FRAME: Final = (1 << 32) - 1
_READ: Final = 1 << 18
#: Idle connections a blocking transport keeps (more threads open more, then close them).
_POOL: Final = 4
#: Seconds a pooled connection may idle before it is checked for a closed daemon.
_STALE_CHECK: Final = 0.05
#: struct timeval (SO_RCVTIMEO / SO_SNDTIMEO).
_TIMEVAL: Final = struct.Struct("@ll")
#: Share of the time left a kernel timeout is set to: the next calls with the same
#: timeout reuse it (a wake-up before the deadline re-arms with the exact time left).
_EARLY: Final = 0.9
#: How long a blocking call looks for its reply without sleeping (µs), by default: a
#: reply sent while the caller sleeps in the kernel waits for that core's wake-up, tens
#: of µs on a virtual machine (the daemon's write pays it too); one-task runs and reads
#: answer within this. The core is yielded between looks. ``Client(spin_us=...)``.
DEFAULT_SPIN_US: Final = 500
#: The longest spin a client may ask for (µs).
MAX_SPIN_US: Final = 10_000
#: The largest submit sent as a Submit frame (tasks, encoded bytes); a bigger one is a
#: Call, so the daemon's per-call RESOURCE_EXHAUSTED applies to it as over gRPC.
_NATIVE_TASKS: Final = 64
_NATIVE_BYTES: Final = 64 << 10


class _Aborted(grpc.RpcError):  # type: ignore[misc]  # grpc is untyped
    """A status as ``daemon_error`` reads it from a gRPC call."""

    def __init__(self, code: grpc.StatusCode, details: str, field: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details
        self._trailing = ((FIELD_METADATA, field),) if field else ()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


def status_error(code: int, details: str, field: str) -> DaemonError:
    """The :class:`DaemonError` a gRPC call with this status would raise."""
    status = _BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    return daemon_error(_Aborted(status, details, field))


def _deadline_error() -> DaemonError:
    return DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def _method(name: str) -> Any:
    method = METHODS.get(name)
    if method is None:
        raise ValueError(f"cannot call {name!r}: simpler.daemon.v1.Daemon has no such method")
    return method


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - _now()
    if left <= 0:
        raise _deadline_error()
    return left


_now = time.monotonic


def pick_fast_socket(choice: str, unix_path: str | None, address: str) -> str | None:
    """The fast socket a client of ``address`` uses under transport ``choice`` (None:
    gRPC). ``unix_path``: the target's socket path (None: not a Unix socket).

    ``auto`` (or ``$SIMPLER_DAEMON_TRANSPORT``): the fast socket beside a Unix target
    when it exists and accepts a connection (probed once); ``fast``: it must exist
    (``Unavailable`` naming it otherwise, or at the first call when nobody listens)."""
    if choice == "auto":
        choice = os.environ.get(ENV_TRANSPORT, "") or "auto"
    if choice not in TRANSPORTS:
        raise ValueError(f"cannot use transport {choice!r}: choose one of {', '.join(TRANSPORTS)}")
    if choice == "grpc":
        return None
    path = fast_socket_path(unix_path) if unix_path is not None else None
    if path is not None and os.path.exists(path):
        check_socket_path(path)  # the same trust rule as the gRPC socket
        # A socket file a killed (or since reconfigured) daemon left behind must not
        # make every auto client fail while gRPC serves: probe it once.
        if choice == "fast" or _listening(path):
            return path
        return None
    if choice == "fast":
        where = path or f"{address} (the fast transport needs a local Unix socket target)"
        raise Unavailable(
            grpc.StatusCode.UNAVAILABLE, f"cannot use the fast transport: no fast socket at {where}"
        )
    return None


def _listening(path: str) -> bool:
    """Whether something accepts connections on the Unix socket ``path`` (refused,
    missing or reset: a stale socket file)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


# --------------------------------------------------------------------------- blocking


#: NativeTask by the bytes of its Task message (a client submits the same few tasks
#: again and again: one serialization and a lookup instead of reading the message).
_NATIVE: dict[bytes, NativeTask] = {}
_NATIVE_KEPT: Final = 256
#: Tasks longer than this (values, many tensors) are converted afresh, never kept.
_NATIVE_KEY_BYTES: Final = 4096


def _native_task(task: Any) -> NativeTask:
    key = task.SerializeToString()
    native = _NATIVE.get(key)
    if native is not None:
        return native
    members = task.members
    config = task.HasField("config")
    if (
        task.kind == pb.TASK_KIND_SUB
        and len(members) == 1
        and not task.workers
        and not config
        and not members[0].ByteSize()
    ):
        native = NativeTask(task.kind, task.hashid)  # a plain task
    else:
        native = NativeTask(
            task.kind,
            task.hashid,
            tuple(m.SerializeToString() for m in members),
            tuple(task.workers),
            task.config.SerializeToString() if config else None,
        )
    if len(key) > _NATIVE_KEY_BYTES:
        return native  # a task with large values: not worth keeping
    if len(_NATIVE) >= _NATIVE_KEPT:
        _NATIVE.clear()
    _NATIVE[key] = native
    return native


def connect_failed(path: str, exc: OSError) -> Unavailable:
    """The error of a connection to the fast socket at ``path`` that failed with ``exc``
    (both transports, blocking and asyncio, say it alike)."""
    return Unavailable(
        grpc.StatusCode.UNAVAILABLE,
        f"cannot connect to the daemon's fast socket {path}: {exc.strerror or exc}",
    )


def native_frame(
    call_id: int, name: str, request: Any, timeout: float | None, tasks: Any = None
) -> bytes | None:
    """Call ``call_id`` of ``name`` as an encoded version-2 frame (None: ``name`` has
    none, or the request is too big for one, see ``_NATIVE_TASKS``). ``tasks``: the
    Task messages ``request`` was built from, if the caller has them (read faster than
    the request's repeated field)."""
    if name == "WaitRun":
        wait = request.timeout_seconds if request.HasField("timeout_seconds") else None
        return encode(Wait(call_id, request.run_id, wait, request.include_results, timeout))
    if name != "SubmitRun":
        return None
    if tasks is None:
        tasks = request.tasks
    if len(tasks) > _NATIVE_TASKS:
        return None
    native = [_native_task(task) for task in tasks]
    frame = encode(
        Submit(
            call_id,
            native,
            request.idempotency_key,
            request.label,
            request.wait_seconds if request.HasField("wait_seconds") else None,
            request.priority,
            request.include_results,
            timeout,
        )
    )
    return frame if len(frame) <= _NATIVE_BYTES else None


class _Conn:
    """One blocking connection; used by one call at a time. ``version``: the protocol
    version the daemon welcomed it to (1 until a Welcome arrives)."""

    __slots__ = (
        "_buf",
        "_decoder",
        "_frames",
        "_ids",
        "_timeout",
        "_view",
        "idle_since",
        "path",
        "sock",
        "version",
    )

    def __init__(self, path: str, label: str) -> None:
        self.path = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            sock.sendall(encode(Hello(PROTOCOL_VERSION, label[:MAX_LABEL], NATIVE_VERSION)))
        except OSError as exc:
            sock.close()
            raise connect_failed(path, exc) from exc
        self.sock = sock
        self.version = PROTOCOL_VERSION
        self._decoder = FrameDecoder(CLIENT_FRAMES, _MAX_FRAME)
        self._frames: list[Any] = []
        self._ids = itertools.count(1)
        # Read into one buffer: ``sock.recv(n)`` allocates n bytes per call, and at
        # 256 KiB that is an mmap and page faults per reply (~50 µs measured).
        self._buf = bytearray(_READ)
        self._view = memoryview(self._buf)
        # The socket stays in blocking mode: a Python socket timeout would add a poll()
        # before every send and receive (and an ioctl per change of mode). The deadline
        # is enforced with SO_RCVTIMEO / SO_SNDTIMEO instead, set lazily (see arm()).
        self._timeout: float | None = None  # what SO_RCVTIMEO/SO_SNDTIMEO hold (None: none)
        self.idle_since = 0.0

    def next_id(self) -> int:
        return next(self._ids)

    def _set_timeout(self, timeout: float | None) -> None:
        """One system call per option: the kernel's send and receive timeouts."""
        # A zero timeval means "no timeout": never round a short wait down to it.
        us = 0 if timeout is None else max(1, int(timeout * 1e6))
        value = _TIMEVAL.pack(us // 1_000_000, us % 1_000_000)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        self._timeout = timeout

    def arm(self, deadline: float | None) -> None:
        """Make sure a blocked send or receive wakes up by ``deadline`` (at the latest).

        The kernel timeout set may be shorter than the time left: a wake-up before the
        deadline (:meth:`_woken`) re-arms with the exact time left. So the options are
        set only when the timeout held is longer than the time left or much shorter
        (back-to-back calls with the same timeout make no system call), and never for
        calls without a deadline."""
        timeout = _remaining(deadline)
        held = self._timeout
        if timeout is None or (held is not None and timeout * 0.5 <= held <= timeout):
            return
        self._set_timeout(timeout * _EARLY)

    def _woken(self, deadline: float | None) -> None:
        """A send or receive timed out in the kernel: DeadlineExceeded when the deadline
        passed, else wait again for exactly the time left (None: without a timeout)."""
        self._set_timeout(_remaining(deadline))

    def _look(self, spin_s: float, deadline: float | None) -> int:
        """Read what has arrived without blocking, again and again for up to ``spin_s``
        (never past ``deadline``), yielding the core between looks: the bytes read, or
        -1 when nothing came."""
        end = _now() + spin_s
        if deadline is not None and deadline < end:
            end = deadline
        sock, buf = self.sock, self._buf
        while True:
            try:
                return sock.recv_into(buf, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if _now() >= end:
                    return -1
                os.sched_yield()

    def send(self, data: bytes, deadline: float | None = None) -> None:
        """Send ``data`` within ``deadline`` (the caller armed it)."""
        view = memoryview(data)
        sock = self.sock
        try:
            while view:
                try:
                    sent = sock.send(view)
                except BlockingIOError:  # SO_SNDTIMEO expired: deadline, or arm again
                    self._woken(deadline)
                    continue
                view = view[sent:]
        except OSError as exc:
            raise self._lost(exc) from exc

    def frame(self, deadline: float | None, *, armed: bool = False, spin_s: float = 0.0) -> Any:
        """The next frame from the daemon (blocking until ``deadline``); ``armed``: the
        caller just called :meth:`arm` (the first read needs no new timeout); ``spin_s``:
        look for it without sleeping for up to so long first (``DEFAULT_SPIN_US``)."""
        frames = self._frames
        while not frames:
            if not armed:
                self.arm(deadline)
            armed = False
            try:
                size = -1
                if spin_s:
                    size = self._look(spin_s, deadline)
                    spin_s = 0.0
                if size < 0:
                    size = self.sock.recv_into(self._buf)
            except BlockingIOError:  # SO_RCVTIMEO expired: deadline, or wait again
                self._woken(deadline)
                armed = True
                continue
            except OSError as exc:
                raise self._lost(exc) from exc
            if not size:
                raise self._lost(None)
            try:  # the decoder copies what it keeps: the buffer is reused
                frames.extend(self._decoder.feed(self._view[:size]))
            except ProtocolError as exc:
                raise self._lost(exc) from exc
            if frames and type(frames[0]) is Welcome:  # the daemon's first frame, once
                self.version = min(frames.pop(0).version, NATIVE_VERSION)
        return frames.pop(0)

    def _lost(self, exc: BaseException | None) -> DaemonError:
        why = "the daemon closed the connection" if exc is None else str(exc)
        return Unavailable(
            grpc.StatusCode.UNAVAILABLE, f"cannot call the daemon on {self.path}: {why}"
        )

    def stale(self) -> bool:
        """Whether the daemon closed this idle connection (it restarted, or stopped):
        a pooled connection is checked before reuse, as a gRPC channel reconnects."""
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes a thread blocked in recv on it
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class FastTransport:
    """Blocking calls over the fast socket at ``path``; ``label`` is the client's
    display label (the gRPC ``x-simpler-client`` header)."""

    def __init__(self, path: str, label: str, spin_us: int = DEFAULT_SPIN_US) -> None:
        self.path = path
        self.label = label
        #: How long a unary call looks for its reply before it sleeps (s).
        self._spin_s = spin_us / 1e6
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()  # closed by close() too, as a channel's calls are
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()

    def _forked(self) -> None:
        """In a child forked from the process that made this transport: the pooled
        sockets (and their call ids) are the parent's, and so may be the lock's state.
        Start afresh: close the inherited descriptors here only (no shutdown(), which
        would cut the parent's connections too)."""
        inherited = [*self._idle, *self._busy]
        self._idle, self._busy = [], set()
        self._lock = threading.Lock()
        self._pid = os.getpid()
        for conn in inherited:
            conn.sock.close()

    def _take(self) -> _Conn:
        if self._pid != os.getpid():
            self._forked()
        with self._lock:
            if self._closed:
                raise Unavailable(grpc.StatusCode.UNAVAILABLE, "cannot call: the client is closed")
            while self._idle:
                conn = self._idle.pop()
                # A daemon that stopped or restarted closed its idle connections; a
                # system call to check is worth it only after a pause (back-to-back
                # calls skip it: no daemon restarts in under _STALE_CHECK seconds).
                if _now() - conn.idle_since > _STALE_CHECK and conn.stale():
                    conn.close()
                    continue
                self._busy.add(conn)
                return conn
        conn = _Conn(self.path, self.label)
        with self._lock:
            self._busy.add(conn)
        return conn

    def _give(self, conn: _Conn) -> None:
        with self._lock:
            self._busy.discard(conn)
            if not self._closed and len(self._idle) < _POOL:
                conn.idle_since = _now()
                self._idle.append(conn)
                return
        conn.close()

    def _drop(self, conn: _Conn) -> None:
        with self._lock:
            self._busy.discard(conn)
        conn.close()

    def close(self) -> None:
        """Close every connection, also those of calls and streams still open (they
        fail with UNAVAILABLE; the daemon cancels their handlers)."""
        if self._pid != os.getpid():
            self._forked()
        with self._lock:
            self._closed = True
            conns = [*self._idle, *self._busy]
            self._idle, self._busy = [], set()
        for conn in conns:
            conn.close()

    def unary(self, name: str, request: Any, timeout: float | None, tasks: Any = None) -> Any:
        """One unary call (``request`` a message) or client-streaming call (``request``
        an iterable of messages); the response message. ``tasks``: a SubmitRun's Task
        messages as the caller passed them (see :func:`native_frame`)."""
        method = _method(name)
        deadline = None if timeout is None else _now() + timeout
        conn = self._take()
        try:
            call_id = conn.next_id()
            conn.arm(deadline)
            if method.client_stream:
                conn.send(encode(Call(call_id, name, b"", timeout, True)), deadline)
                for message in request:
                    conn.arm(deadline)  # each send waits at most the time left
                    conn.send(encode(Item(call_id, message.SerializeToString())), deadline)
                conn.send(encode(End(call_id)), deadline)
            else:
                data = None
                if conn.version >= NATIVE_VERSION:
                    data = native_frame(call_id, name, request, timeout, tasks)
                if data is None:
                    data = encode(Call(call_id, name, request.SerializeToString(), timeout))
                conn.send(data, deadline)
            frame = conn.frame(deadline, armed=not method.client_stream, spin_s=self._spin_s)
            while type(frame) is not Reply or frame.id != call_id:
                frame = conn.frame(deadline)  # a late frame of an abandoned call
        except BaseException:
            self._drop(conn)  # its state is unknown: the daemon cancels what it still runs
            raise
        self._give(conn)
        if frame.code:
            raise status_error(frame.code, frame.details, frame.field)
        return method.response.FromString(frame.data)

    def stream(self, name: str, request: Any, timeout: float | None) -> Iterator[Any]:
        """A server-streaming call: its response messages. Left before its end (or
        failing), the connection is closed and the daemon cancels the handler."""
        method = _method(name)
        deadline = None if timeout is None else _now() + timeout
        conn = self._take()
        done = False
        try:
            call_id = conn.next_id()
            conn.arm(deadline)
            conn.send(encode(Call(call_id, name, request.SerializeToString(), timeout)), deadline)
            while True:
                frame = conn.frame(deadline)
                if frame.id != call_id:
                    continue
                kind = type(frame)
                if kind is Item:
                    yield method.response.FromString(frame.data)
                elif kind is End or kind is Reply:
                    done = True
                    if frame.code:
                        raise status_error(frame.code, frame.details, frame.field)
                    return
        finally:
            if done:
                self._give(conn)
            else:
                self._drop(conn)

    def hold(self, name: str, request: Any, timeout: float | None) -> tuple[Any, Any]:
        """Open a long-lived bidirectional call (KeepSession) on a connection of its own
        and send ``request`` as its first message: ``(its first response, release)``.
        The call lasts until ``release()`` or this transport's close (the connection
        closes; the daemon cancels the handler), or until this process dies."""
        method = _method(name)
        deadline = None if timeout is None else _now() + timeout
        if self._pid != os.getpid():
            self._forked()
        conn = _Conn(self.path, self.label)
        with self._lock:
            if self._closed:
                conn.close()
                raise Unavailable(grpc.StatusCode.UNAVAILABLE, "cannot call: the client is closed")
            self._busy.add(conn)  # closed by close(), never pooled
        try:
            call_id = conn.next_id()
            conn.arm(deadline)
            conn.send(encode(Call(call_id, name, b"", None, True)), deadline)
            conn.send(encode(Item(call_id, request.SerializeToString())), deadline)
            frame = conn.frame(deadline, armed=True)
            while frame.id != call_id:
                frame = conn.frame(deadline)
        except BaseException:
            self._drop(conn)
            raise
        if type(frame) is not Item:
            self._drop(conn)
            raise status_error(frame.code, frame.details, frame.field)
        return method.response.FromString(frame.data), lambda: self._drop(conn)
