"""The ``simpler.daemon.v1.Daemon`` gRPC servicer: validation, run records, events, limits.

Everything runs on the daemon's one event loop, beside the Scheduler coroutine::

    client --gRPC--> DaemonService.<Rpc> --validated plan--> Worker.submit_async(orch)
                         |                                     | Scheduler callbacks
                         |  RunRecord per run  <---------------+ (on_task_event, Run listeners,
                         |  (counts, state, watchers)             done callbacks)
                         v
                     STATUS_TABLE: exception type -> gRPC status code

A request is validated completely before anything is submitted, so a bad field
is an ``INVALID_ARGUMENT`` naming it (``tasks[3].members[0].tensors[1].dtype``)
and never a half-built run. Tensors are views of heap buffers built from the
``TensorRef`` numbers; the engine maps each view back to its buffer and byte
range for dependency inference.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import socket
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Final, NoReturn, TypeVar

import grpc
import numpy as np
from google.protobuf.timestamp_pb2 import Timestamp

from simpler_daemon import __version__
from simpler_daemon.args import MAX_NDIM, MAX_OUTPUT_PREFIX, CallConfig, Tag, TaskArgs, dtype_code
from simpler_daemon.callables import (
    CallableHandle,
    digest_of,
    parse_import_path,
    resolve_import,
)
from simpler_daemon.endpoints.base import Outcome
from simpler_daemon.errors import RegistrationError, SimplerError, WorkerClosedError
from simpler_daemon.heap import Buffer
from simpler_daemon.orchestrator import FailureInfo, Run, RunState, SlotState, TaskSlot
from simpler_daemon.server._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server._proto.simpler.daemon.v1 import daemon_pb2_grpc as pb_grpc
from simpler_daemon.server.config import DaemonConfig
from simpler_daemon.server.metrics import Metrics
from simpler_daemon.worker import RunHandle, Worker, WorkerState

__all__ = [
    "STATUS_TABLE",
    "DaemonService",
    "InvalidArgument",
    "LimitExceeded",
    "NotFound",
    "PermissionDenied",
    "Precondition",
    "RequestError",
    "RunRecord",
    "Unimplemented",
    "status_of",
]

log = logging.getLogger("simpler_daemon.service")

Code = grpc.StatusCode

#: Events a watcher may fall behind by before it is sent a fresh snapshot instead.
WATCH_QUEUE_LIMIT: Final = 65_536
#: Default ReadBuffer chunk; never more than the message limit allows.
READ_CHUNK: Final = 1 << 20
#: Room for the protobuf framing around a chunk.
_CHUNK_OVERHEAD: Final = 1024
_MAX_LABEL: Final = 256
_MAX_KEY: Final = 256
_MAX_DTYPE_NAME: Final = 32
_U63: Final = 1 << 63
_CLIENT_ID_KEY: Final = "x-simpler-client"


# --------------------------------------------------------------------------- errors


def _timeout_field(request: Any, name: str) -> float:
    """A seconds field that must be finite and >= 0 (INVALID_ARGUMENT otherwise)."""
    value = float(getattr(request, name))
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(name, f"must be >= 0, got {value}")
    return value


class RequestError(SimplerError):
    """A request the daemon refuses; the subclass picks the status (see STATUS_TABLE).

    ``field`` is the offending field path (``tasks[3].members[0].tensors[1].buffer_id``)
    or "" when the request as a whole is refused.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class InvalidArgument(RequestError):
    """A malformed field."""


class NotFound(RequestError):
    """An unknown run, buffer, hashid or worker."""


class PermissionDenied(RequestError):
    """An import path outside ``callables.allowed_modules``."""


class LimitExceeded(RequestError):
    """A configured size or count limit."""


class Precondition(RequestError):
    """The daemon's state forbids the request (draining, stopping, wrong callable role...)."""


class Unimplemented(RequestError):
    """A feature this build does not have."""


#: The one table from exception type to status code; the first matching row wins.
STATUS_TABLE: Final[tuple[tuple[type[BaseException], grpc.StatusCode], ...]] = (
    (InvalidArgument, Code.INVALID_ARGUMENT),
    (NotFound, Code.NOT_FOUND),
    (PermissionDenied, Code.PERMISSION_DENIED),
    (LimitExceeded, Code.RESOURCE_EXHAUSTED),
    (Precondition, Code.FAILED_PRECONDITION),
    (Unimplemented, Code.UNIMPLEMENTED),
    (RegistrationError, Code.INVALID_ARGUMENT),  # refined by code below
    (WorkerClosedError, Code.FAILED_PRECONDITION),
    (MemoryError, Code.RESOURCE_EXHAUSTED),  # the shared heap is full
    (KeyError, Code.NOT_FOUND),  # heap lookups
    (LookupError, Code.NOT_FOUND),
    (PermissionError, Code.PERMISSION_DENIED),
    (TimeoutError, Code.DEADLINE_EXCEEDED),
    (NotImplementedError, Code.UNIMPLEMENTED),
    (ValueError, Code.INVALID_ARGUMENT),
    (TypeError, Code.INVALID_ARGUMENT),
)

#: RegistrationError codes (ARCHITECTURE section 9) that are not INVALID_ARGUMENT.
REGISTRATION_STATUS: Final[dict[str, grpc.StatusCode]] = {
    "HASHID_FORMAT_INVALID": Code.INVALID_ARGUMENT,
    "HASHID_DESCRIPTOR_MISMATCH": Code.FAILED_PRECONDITION,
    "NOT_REGISTERED": Code.NOT_FOUND,
    "LOCAL_SLOT_EXHAUSTED": Code.RESOURCE_EXHAUSTED,
    # Every target child failed to load it: the import path does not resolve there.
    "REGISTER_PARTIAL_FAILURE": Code.INVALID_ARGUMENT,
    "REGISTER_CLEANUP_UNCERTAIN": Code.INTERNAL,
    "REGISTER_TOMBSTONE_ACTIVE": Code.FAILED_PRECONDITION,
    "UNREGISTER_TOMBSTONE_ACTIVE": Code.FAILED_PRECONDITION,
    "CONTROL_FAILED": Code.INTERNAL,
}


class _AtField(RequestError):
    """An engine exception re-expressed with the request field it concerns; keeps the
    status STATUS_TABLE gave the original."""

    def __init__(self, field: str, exc: BaseException) -> None:
        super().__init__(field, _text(exc))
        self.code = status_of(exc)


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The status code for an exception (``INTERNAL`` when no row of STATUS_TABLE matches)."""
    if isinstance(exc, _AtField):
        return exc.code
    if isinstance(exc, RegistrationError):
        return REGISTRATION_STATUS.get(exc.code, Code.INVALID_ARGUMENT)
    for exc_type, code in STATUS_TABLE:
        if isinstance(exc, exc_type):
            return code
    return Code.INTERNAL


def _text(exc: BaseException) -> str:
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc) or type(exc).__name__


def _at(field: str, exc: BaseException) -> RequestError:
    """Re-express an engine exception as a RequestError naming ``field`` (same status)."""
    if isinstance(exc, RequestError):
        return exc
    err = _AtField(field, exc)
    err.__cause__ = exc
    return err


# --------------------------------------------------------------------------- enums

_TAGS: Final[dict[int, Tag]] = {
    pb.TAG_INPUT: Tag.INPUT,
    pb.TAG_OUTPUT: Tag.OUTPUT,
    pb.TAG_INOUT: Tag.INOUT,
    pb.TAG_OUTPUT_EXISTING: Tag.OUTPUT_EXISTING,
    pb.TAG_NO_DEP: Tag.NO_DEP,
}
_REGISTER_KINDS: Final[dict[int, str]] = {
    pb.CALLABLE_KIND_SUB: "sub",
    pb.CALLABLE_KIND_ORCHESTRATION: "orchestration",
    pb.CALLABLE_KIND_CHIP: "chip",
}
_ROLE_KINDS: Final[dict[str, int]] = {role: kind for kind, role in _REGISTER_KINDS.items()}
_WORKER_KINDS: Final[dict[str, int]] = {
    "sub": pb.WORKER_KIND_SUB,
    "chip": pb.WORKER_KIND_CHIP,
    "nested": pb.WORKER_KIND_NESTED_L3,
    "nested_l3": pb.WORKER_KIND_NESTED_L3,
    "remote": pb.WORKER_KIND_REMOTE_L3,
    "remote_l3": pb.WORKER_KIND_REMOTE_L3,
}
_TASK_KIND_NAMES: Final[dict[int, str]] = {
    pb.TASK_KIND_SUB: "SUB",
    pb.TASK_KIND_SUB_GROUP: "SUB_GROUP",
    pb.TASK_KIND_NEXT_LEVEL: "NEXT_LEVEL",
    pb.TASK_KIND_NEXT_LEVEL_GROUP: "NEXT_LEVEL_GROUP",
}
_TERMINAL: Final = frozenset({pb.RUN_STATE_COMPLETED, pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED})


def _now_ts(ns: int | None = None) -> Timestamp:
    out = Timestamp()
    out.FromNanoseconds(time.time_ns() if ns is None else ns)
    return out


# --------------------------------------------------------------------------- runs


class _Watcher:
    """One WatchRun stream's queue; a watcher that falls too far behind gets a snapshot."""

    __slots__ = ("lagged", "queue", "wake")

    def __init__(self) -> None:
        self.queue: deque[Any] = deque()
        self.wake = asyncio.Event()
        self.lagged = False

    def push(self, event: Any, *, force: bool = False) -> None:
        if not force and len(self.queue) >= WATCH_QUEUE_LIMIT:
            self.queue.clear()
            self.lagged = True
        else:
            self.queue.append(event)
        self.wake.set()


class RunRecord:
    """What the daemon knows about one run: identity, counts, state, watchers.

    Counts are per task *call* (a group counts one per member), driven by the
    Scheduler's events: ``dispatched`` (+running), ``completed`` (-running,
    +done or +failed), and a slot that fails without being dispatched
    (+failed per member).
    """

    def __init__(
        self,
        *,
        label: str,
        client: str,
        key: str,
        total: int | None,
        metrics: Metrics | None,
    ) -> None:
        self.run_id = 0
        self.run: Run | None = None
        self.handle: RunHandle | None = None
        self.label = label
        self.client = client
        self.key = key
        self._static_total = total is not None
        self.total = total or 0
        self._slots_seen = 0
        self.done = 0
        self.failed = 0
        self.running = 0
        self.seq = 0
        self.state: pb.RunState = pb.RUN_STATE_QUEUED
        self.watchers: set[_Watcher] = set()
        self.submit_ns = time.time_ns()
        self.finish_ns = 0
        self.cancel_requested = False
        self.cancel_reason = ""
        self.error_before_cancel = False
        self.error_task_index: int | None = None
        self.terminal_event: Any = None
        self.finished = asyncio.Event()
        self.on_finished: Callable[[RunRecord], None] | None = None
        self.on_bind: Callable[[RunRecord], None] | None = None
        self._metrics = metrics
        self._t0: dict[tuple[int, int], int] = {}

    # -- binding ---------------------------------------------------------------------

    def bind(self, run: Run) -> None:
        """Attach to the engine's Run (idempotent); called from the orchestration
        function, before any task of the run can be dispatched."""
        if self.run is not None:
            return
        self.run = run
        self.run_id = run.run_id
        if self.on_bind is not None:
            self.on_bind(self)
        run.listeners.append(self._guarded(self._on_slot))
        run.add_done_callback(self._guarded(self._on_done))

    @staticmethod
    def _guarded(fn: Callable[..., None]) -> Callable[..., None]:
        """Never let a bookkeeping bug escape into the Scheduler (it would fail every run)."""

        def call(*args: Any) -> None:
            try:
                fn(*args)
            except Exception:
                log.exception("run bookkeeping failed in %s", fn.__name__)

        return call

    @property
    def terminal(self) -> bool:
        return self.terminal_event is not None

    # -- state -----------------------------------------------------------------------

    def proto_state(self) -> pb.RunState:
        run = self.run
        if self.terminal_event is not None:
            final: pb.RunState = self.terminal_event.state
            return final
        if run is None or not run.admitted:
            return pb.RUN_STATE_QUEUED
        state = run.state
        if state is RunState.BUILDING:
            return pb.RUN_STATE_BUILDING
        if state is RunState.PREPARED:
            return pb.RUN_STATE_PREPARED
        if state is RunState.EXECUTING:
            return pb.RUN_STATE_EXECUTING
        if state is RunState.COMPLETED:
            return pb.RUN_STATE_COMPLETED
        return pb.RUN_STATE_CANCELLED if self._cancelled() else pb.RUN_STATE_FAILED

    def _cancelled(self) -> bool:
        run = self.run
        if self.cancel_requested and not self.error_before_cancel:
            return True
        err = run.error if run is not None else None
        return (
            run is not None
            and run.cancelled
            and err is not None
            and err.outcome == Outcome.SKIPPED.name
            and err.remote_text.startswith("run cancelled")
        )

    def _sync_total(self) -> None:
        if self._static_total or self.run is None:
            return
        slots = self.run.slots
        for slot in slots[self._slots_seen :]:
            self.total += slot.group_size
        self._slots_seen = len(slots)

    def counts(self) -> Any:
        self._sync_total()
        return pb.RunCounts(
            total=max(self.total, 0),
            done=max(self.done, 0),
            failed=max(self.failed, 0),
            running=max(self.running, 0),
        )

    def error_proto(self) -> Any:
        run = self.run
        err = run.error if run is not None else None
        if err is None:
            return None
        cancelled = self.proto_state() == pb.RUN_STATE_CANCELLED
        out = pb.RunError(
            message=str(err),
            hashid=err.hashid or "",
            dispatch_id=err.dispatch_id or 0,
            outcome="CANCELLED" if cancelled else err.outcome,
            remote_text=err.remote_text,
        )
        if err.worker_id is not None:
            out.worker_id = err.worker_id
        if self.error_task_index is not None:
            out.task_index = self.error_task_index
        return out

    def status(self) -> Any:
        out = pb.RunStatus(
            run_id=self.run_id,
            state=self.proto_state(),
            counts=self.counts(),
            label=self.label,
            submit_time=_now_ts(self.submit_ns),
        )
        if out.state in (pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED):
            err = self.error_proto()
            if err is not None:
                out.error.CopyFrom(err)
        if self.finish_ns:
            out.finish_time.CopyFrom(_now_ts(self.finish_ns))
        return out

    def snapshot(self) -> Any:
        self.state = self.proto_state()
        return pb.RunEvent(
            run_id=self.run_id,
            sequence=self.seq,
            type=pb.RUN_EVENT_TYPE_SNAPSHOT,
            counts=self.counts(),
            state=self.state,
            time=_now_ts(),
        )

    # -- events from the Scheduler (all on the loop) -----------------------------------

    def _event(self, etype: pb.RunEventType, **fields: Any) -> Any:
        self.seq += 1
        return pb.RunEvent(
            run_id=self.run_id,
            sequence=self.seq,
            type=etype,
            counts=self.counts(),
            state=self.state,
            time=_now_ts(),
            **fields,
        )

    def _publish(self, event: Any, *, force: bool = False) -> None:
        for w in self.watchers:
            w.push(event, force=force)

    def _state_changed(self) -> None:
        state = self.proto_state()
        if state != self.state and state not in _TERMINAL:
            self.state = state
            self._publish(self._event(pb.RUN_EVENT_TYPE_RUN_STATE))

    def on_task_event(self, slot: TaskSlot, event: str, completion: Any) -> None:
        metrics = self._metrics
        if event == "dispatched":
            self.running += 1
            member = max(slot.members_started - 1, 0)
            if metrics is not None:
                kind = slot.kind.name.lower()
                metrics.task_dispatched(kind)
                self._t0[(slot.slot_id, member)] = time.perf_counter_ns()
            if self.watchers:
                self._state_changed()
                self._publish(
                    self._event(
                        pb.RUN_EVENT_TYPE_TASK_DISPATCHED,
                        task_index=slot.index,
                        member_index=member,
                    )
                )
            else:
                self.seq += 1
        elif event == "completed" and completion is not None:
            self.running -= 1
            ok = completion.outcome is Outcome.SUCCESS
            if ok:
                self.done += 1
            else:
                self.failed += 1
            member = completion.dispatch.group_index
            if metrics is not None:
                t0 = self._t0.pop((slot.slot_id, member), None)
                latency = None if t0 is None else (time.perf_counter_ns() - t0) / 1e9
                metrics.task_completed(slot.kind.name.lower(), completion.outcome.name, latency)
            if self.watchers:
                self._state_changed()
                fields: dict[str, Any] = {
                    "task_index": slot.index,
                    "member_index": member,
                    "worker_id": completion.worker_id,
                    "dispatch_id": completion.dispatch.dispatch_id,
                    "outcome": completion.outcome.name,
                }
                if not ok:
                    fields["message"] = completion.message
                etype = pb.RUN_EVENT_TYPE_TASK_COMPLETED if ok else pb.RUN_EVENT_TYPE_TASK_FAILED
                self._publish(self._event(etype, **fields))
            else:
                self.seq += 1

    def _on_slot(self, run: Run, event: str, slot: TaskSlot | None) -> None:
        """Run listener: a slot became terminal (``task``) or the run did (``run``)."""
        if event != "task" or slot is None or slot.state != SlotState.FAILED:
            return
        failure = slot.failure
        if (
            self.error_task_index is None
            and failure is not None
            and failure.outcome is not Outcome.SKIPPED
        ):
            self.error_task_index = slot.index
        unstarted = slot.group_size - slot.members_started
        if unstarted <= 0:
            return  # its members were dispatched: their completions were counted
        self.failed += unstarted
        if self.watchers:
            self._state_changed()
            self._publish(
                self._event(
                    pb.RUN_EVENT_TYPE_TASK_FAILED,
                    task_index=slot.index,
                    outcome=failure.outcome.name if failure is not None else "SKIPPED",
                    message=failure.message if failure is not None else "",
                )
            )
        else:
            self.seq += 1

    def _on_done(self, run: Run) -> None:
        if self.terminal_event is not None:
            return
        self._sync_total()
        # Tasks that never got to run (the orchestration stopped early, or the
        # daemon stopped while they were in flight) count as failed.
        self.failed += self.running + max(0, self.total - self.done - self.failed - self.running)
        self.running = 0
        self.finish_ns = time.time_ns()
        if run.state is RunState.COMPLETED:
            state = pb.RUN_STATE_COMPLETED
        else:
            state = pb.RUN_STATE_CANCELLED if self._cancelled() else pb.RUN_STATE_FAILED
        self.state = state
        message = ""
        if run.error is not None:
            message = str(run.error)
            if self.cancel_requested and self.cancel_reason and state == pb.RUN_STATE_CANCELLED:
                message = f"run {self.run_id} cancelled: {self.cancel_reason}"
        event = self._event(pb.RUN_EVENT_TYPE_RUN_STATE, message=message)
        self.terminal_event = event
        self._publish(event, force=True)
        self._t0.clear()
        self.finished.set()
        if self._metrics is not None:
            self._metrics.run_finished(pb.RunState.Name(state).removeprefix("RUN_STATE_").lower())
        if self.on_finished is not None:
            self.on_finished(self)


class _Planned:
    """One validated task of a SubmitRun: ready to hand to the Orchestrator."""

    __slots__ = ("config", "handle", "kind", "members", "targets")

    def __init__(
        self,
        kind: int,
        handle: CallableHandle,
        members: list[TaskArgs],
        config: CallConfig | None,
        targets: list[int],
    ) -> None:
        self.kind = kind
        self.handle = handle
        self.members = members
        self.config = config
        self.targets = targets


# --------------------------------------------------------------------------- decorators

F = TypeVar("F", bound=Callable[..., Any])


def _unary(fn: F) -> F:
    """Map exceptions of a unary-response handler to a status via STATUS_TABLE."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: DaemonService, request: Any, context: Any) -> Any:
        try:
            response = await fn(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await self._abort(context, name, exc)
        self._count(name, Code.OK)
        return response

    return wrapper  # type: ignore[return-value]


def _server_stream(fn: F) -> F:
    """The same for server-streaming handlers (async generators)."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: DaemonService, request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            async for item in fn(self, request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await self._abort(context, name, exc)
        self._count(name, Code.OK)

    return wrapper  # type: ignore[return-value]


# --------------------------------------------------------------------------- the service


class DaemonService(pb_grpc.DaemonServicer):
    """Every RPC of ``simpler.daemon.v1.Daemon`` over one started ``Worker``.

    ``request_shutdown(reason)`` is called by ``Drain(shutdown=true)``; the
    daemon owns what happens next. ``on_draining()`` is awaited when the daemon
    stops admitting runs (the health service turns NOT_SERVING). Call :meth:`start` once the Worker is bound
    to the running loop.
    """

    def __init__(
        self,
        worker: Worker,
        config: DaemonConfig,
        *,
        metrics: Metrics | None = None,
        request_shutdown: Callable[[str], None] | None = None,
        on_draining: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._worker = worker
        self._on_draining = on_draining
        self._config = config
        self._limits = config.limits
        self._metrics = metrics
        self._request_shutdown = request_shutdown
        self.serving_state: pb.ServingState = pb.SERVING_STATE_SERVING
        self.start_ns = time.time_ns()
        self._runs: dict[int, RunRecord] = {}
        self._active: dict[int, RunRecord] = {}
        self._live: dict[int, RunRecord] = {}  # bound to an engine Run, not yet finished
        self._finished: OrderedDict[int, None] = OrderedDict()
        self._keys: dict[str, int] = {}
        self._client_runs: Counter[str] = Counter()
        self._streams: Counter[str] = Counter()
        self._labels: dict[int, str] = {}
        self._orch_fns: dict[str, Callable[..., Any]] = {}
        self._dtypes: dict[str, np.dtype[Any]] = {}
        self._hostname = socket.gethostname()
        self._drain_lock = asyncio.Lock()

    def start(self) -> None:
        """Hook the Scheduler's task events (call after ``Worker.start_async``)."""
        sched = self._worker.scheduler
        if sched is None:
            raise WorkerClosedError("cannot start the gRPC service: the Worker is not initialised")
        sched.on_task_event = self._on_task_event
        self.start_ns = time.time_ns()

    @property
    def active_runs(self) -> int:
        return len(self._active)

    def begin_stopping(self) -> None:
        """No new runs from now on (SIGTERM)."""
        self.serving_state = pb.SERVING_STATE_STOPPING

    # -- plumbing -----------------------------------------------------------------------

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        if self._metrics is not None:
            self._metrics.grpc_request(method, code.name)

    async def _abort(self, context: Any, method: str, exc: Exception) -> NoReturn:
        code = status_of(exc)
        if code is Code.INTERNAL:
            log.error("%s failed: %s: %s", method, type(exc).__name__, exc, exc_info=exc)
            details = (
                str(exc)
                if isinstance(exc, RequestError)
                else f"internal error in {method}: {type(exc).__name__}: {exc}"
            )
        else:
            details = _text(exc)
            log.debug("%s refused with %s: %s", method, code.name, details)
        self._count(method, code)
        await context.abort(code, details)
        raise AssertionError("unreachable: context.abort returned")  # pragma: no cover

    @staticmethod
    def _client(context: Any) -> str:
        """Client identity for the per-client limits: the peer, plus the client's own id."""
        peer = str(context.peer() or "")
        for key, value in context.invocation_metadata() or ():
            if key == _CLIENT_ID_KEY:
                return f"{peer}#{str(value)[:64]}"
        return peer

    def _check_usable(self, what: str) -> None:
        if self._worker.state is not WorkerState.READY:
            raise Precondition("", f"cannot {what}: the daemon is stopping")

    def _check_admitting(self, what: str) -> None:
        if self.serving_state == pb.SERVING_STATE_DRAINING:
            raise Precondition("", f"cannot {what}: the daemon is draining and takes no new runs")
        if self.serving_state == pb.SERVING_STATE_STOPPING:
            raise Precondition("", f"cannot {what}: the daemon is shutting down")
        self._check_usable(what)

    @contextlib.contextmanager
    def _stream_slot(self, client: str) -> Iterator[None]:
        limit = self._limits.max_streams_per_client
        if self._streams[client] >= limit:
            raise LimitExceeded(
                "",
                f"cannot open another stream: this client has {self._streams[client]} open "
                f"(limits.max_streams_per_client = {limit})",
            )
        self._streams[client] += 1
        try:
            yield
        finally:
            self._streams[client] -= 1
            if self._streams[client] <= 0:
                del self._streams[client]

    def _record(self, run_id: int, field: str = "run_id") -> RunRecord:
        if run_id == 0:
            raise InvalidArgument(field, "required (run ids start at 1)")
        rec = self._runs.get(run_id)
        if rec is None:
            raise NotFound(
                field,
                f"run {run_id} is unknown (never submitted, or forgotten after "
                f"limits.max_finished_runs_kept = {self._limits.max_finished_runs_kept} "
                "later runs)",
            )
        return rec

    def _on_task_event(self, slot: TaskSlot, event: str, completion: Any) -> None:
        rec = self._live.get(slot.run_id)
        if rec is None:
            return
        try:
            rec.on_task_event(slot, event, completion)
        except Exception:  # never into the Scheduler: it would fail every run
            log.exception("run %d: event bookkeeping failed", slot.run_id)

    def _bound(self, rec: RunRecord) -> None:
        self._live[rec.run_id] = rec

    def _run_finished(self, rec: RunRecord) -> None:
        self._active.pop(rec.run_id, None)
        self._live.pop(rec.run_id, None)
        n = self._client_runs[rec.client] - 1
        if n > 0:
            self._client_runs[rec.client] = n
        else:
            self._client_runs.pop(rec.client, None)
        self._remember_finished(rec)

    def _remember_finished(self, rec: RunRecord) -> None:
        self._live.pop(rec.run_id, None)
        self._finished[rec.run_id] = None
        while len(self._finished) > self._limits.max_finished_runs_kept:
            old, _ = self._finished.popitem(last=False)
            gone = self._runs.pop(old, None)
            if gone is not None and gone.key and self._keys.get(gone.key) == old:
                del self._keys[gone.key]

    # -- validation helpers ---------------------------------------------------------------

    def _dtype(self, name: str, field: str) -> np.dtype[Any]:
        dt = self._dtypes.get(name)
        if dt is not None:
            return dt
        if not name:
            raise InvalidArgument(field, "required (a NumPy dtype name such as 'float32')")
        if len(name) > _MAX_DTYPE_NAME:
            raise InvalidArgument(field, f"dtype name of {len(name)} characters is too long")
        try:
            dt = np.dtype(name)
            dtype_code(dt)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(field, f"unknown or unsupported dtype {name!r}") from exc
        self._dtypes[name] = dt
        return dt

    def _buffer(self, buffer_id: int, generation: int, field: str) -> Buffer:
        if buffer_id == 0:
            raise InvalidArgument(f"{field}.buffer_id" if field else "buffer_id", "required")
        try:
            buf = self._worker.heap.get(buffer_id)
        except KeyError as exc:
            where = f"{field}.buffer_id" if field else "buffer_id"
            raise NotFound(where, f"buffer {buffer_id} is not allocated") from exc
        if generation and generation != buf.generation:
            where = f"{field}.generation" if field else "generation"
            raise NotFound(
                where,
                f"buffer {buffer_id} generation {generation} is gone "
                f"(the current generation is {buf.generation})",
            )
        return buf

    def _handle(self, hashid: str, field: str) -> CallableHandle:
        if not hashid:
            raise InvalidArgument(field, "required ('sha256:' followed by 64 lowercase hex digits)")
        try:
            digest_of(hashid)
        except RegistrationError as exc:
            raise InvalidArgument(field, exc.args[0].partition(": ")[2] or str(exc)) from exc
        entry = self._worker.registry.lookup(hashid)
        if entry is None or entry.state != "active":
            raise NotFound(field, f"callable {hashid} is not registered")
        return entry.spec.handle

    def _call_config(self, msg: Any, field: str) -> CallConfig:
        if msg.deadline_ms >= _U63:
            raise InvalidArgument(f"{field}.deadline_ms", f"{msg.deadline_ms} is too large")
        if msg.threads >= 1 << 31:
            raise InvalidArgument(f"{field}.threads", f"{msg.threads} is too large")
        prefix_len = len(msg.output_prefix.encode())
        if prefix_len > MAX_OUTPUT_PREFIX:
            raise InvalidArgument(
                f"{field}.output_prefix",
                f"{prefix_len} bytes, the limit is {MAX_OUTPUT_PREFIX}",
            )
        try:
            return CallConfig(
                deadline_ms=msg.deadline_ms,
                threads=msg.threads,
                enable_profile=msg.enable_profile,
                enable_dump_args=msg.enable_dump_args,
                output_prefix=msg.output_prefix,
            )
        except ValueError as exc:
            raise InvalidArgument(field, str(exc)) from exc

    def _task_args(self, msg: Any, field: str) -> TaskArgs:
        """TaskArgs of heap views from an ``Args`` message, every number checked."""
        out = TaskArgs()
        tensors = msg.tensors
        scalars = msg.scalars
        limits = self._limits
        if len(tensors) > limits.max_tensors_per_task:
            raise LimitExceeded(
                f"{field}.tensors",
                f"{len(tensors)} tensors, limits.max_tensors_per_task = "
                f"{limits.max_tensors_per_task}",
            )
        if len(scalars) > limits.max_scalars_per_task:
            raise LimitExceeded(
                f"{field}.scalars",
                f"{len(scalars)} scalars, limits.max_scalars_per_task = "
                f"{limits.max_scalars_per_task}",
            )
        if scalars:
            out.scalars = list(scalars)
        if not tensors:
            return out
        heap = self._worker.heap
        for t, ref in enumerate(tensors):
            where = f"{field}.tensors[{t}]"
            tag = _TAGS.get(ref.tag)
            if tag is None:
                raise InvalidArgument(
                    f"{where}.tag",
                    "required" if ref.tag == pb.TAG_UNSPECIFIED else f"unknown tag {ref.tag}",
                )
            buf = self._buffer(ref.buffer_id, ref.generation, where)
            dt = self._dtype(ref.dtype, f"{where}.dtype")
            shape = tuple(ref.shape)
            if len(shape) > MAX_NDIM:
                raise InvalidArgument(
                    f"{where}.shape", f"{len(shape)} dimensions, at most {MAX_NDIM}"
                )
            strides: tuple[int, ...] | None = tuple(ref.strides) or None
            if strides is not None and len(strides) != len(shape):
                raise InvalidArgument(
                    f"{where}.strides",
                    f"{len(strides)} strides for {len(shape)} dimensions",
                )
            try:
                desc = heap.describe_buffer(
                    buf.buffer_id,
                    byte_offset=ref.byte_offset,
                    shape=shape,
                    dtype=dt,
                    strides=strides,
                )
                view: np.ndarray[Any, Any] = np.ndarray(
                    shape,
                    dtype=dt,
                    buffer=heap.mmap,
                    offset=buf.offset + ref.byte_offset,
                    strides=desc.strides,
                )
            except (ValueError, TypeError, OverflowError) as exc:
                raise InvalidArgument(where, _text(exc)) from exc
            out.tensors.append(view)
            out.tags.append(tag)
        return out

    def _next_level_ids(self) -> set[int]:
        manager = self._worker.manager
        return set(manager.next_level) if manager is not None else set()

    def _plan(self, request: Any) -> tuple[list[_Planned], int]:
        """Validate every task of a SubmitRun; returns the plan and the call count."""
        tasks = request.tasks
        limits = self._limits
        if not tasks:
            raise InvalidArgument("tasks", "a run needs at least one task")
        if len(tasks) > limits.max_tasks_per_run:
            raise LimitExceeded(
                "tasks",
                f"{len(tasks)} tasks, limits.max_tasks_per_run = {limits.max_tasks_per_run}",
            )
        level = self._worker.level
        handles: dict[str, CallableHandle] = {}
        next_level: set[int] | None = None
        plan: list[_Planned] = []
        total = 0
        empty = TaskArgs()
        for i, task in enumerate(tasks):
            where = f"tasks[{i}]"
            kind = task.kind
            kind_name = _TASK_KIND_NAMES.get(kind)
            if kind_name is None:
                raise InvalidArgument(
                    f"{where}.kind",
                    "required" if kind == pb.TASK_KIND_UNSPECIFIED else f"unknown task kind {kind}",
                )
            handle = handles.get(task.hashid)
            if handle is None:
                handle = self._handle(task.hashid, f"{where}.hashid")
                handles[task.hashid] = handle
            sub = kind in (pb.TASK_KIND_SUB, pb.TASK_KIND_SUB_GROUP)
            if sub and handle.role != "sub":
                raise InvalidArgument(
                    f"{where}.hashid",
                    f"{handle.name} is registered as {handle.role}; a {kind_name} task needs "
                    "a SUB callable",
                )
            if not sub and (handle.role == "sub" or (level == 3 and handle.role != "chip")):
                raise InvalidArgument(
                    f"{where}.hashid",
                    f"{handle.name} is registered as {handle.role}; a {kind_name} task needs "
                    + (
                        "a CHIP kernel" if level == 3 else "a chip kernel or orchestration function"
                    ),
                )
            members = task.members
            group = kind in (pb.TASK_KIND_SUB_GROUP, pb.TASK_KIND_NEXT_LEVEL_GROUP)
            if not members:
                raise InvalidArgument(f"{where}.members", "at least one member is required")
            if not group and len(members) != 1:
                raise InvalidArgument(
                    f"{where}.members",
                    f"a {kind_name} task has exactly one member, got {len(members)}",
                )
            workers = list(task.workers)
            if sub and workers:
                raise InvalidArgument(f"{where}.workers", f"must be empty for a {kind_name} task")
            if not sub:
                want = len(members) if group else 1
                if len(workers) != want:
                    raise InvalidArgument(
                        f"{where}.workers",
                        f"a {kind_name} task needs {want} target worker(s), got {len(workers)}",
                    )
                if len(set(workers)) != len(workers):
                    raise InvalidArgument(f"{where}.workers", f"targets {workers} are not distinct")
                if next_level is None:
                    next_level = self._next_level_ids()
                for j, wid in enumerate(workers):
                    if wid not in next_level:
                        raise NotFound(
                            f"{where}.workers[{j}]",
                            f"worker {wid} is not a NEXT_LEVEL worker of this daemon "
                            f"(known: {sorted(next_level)})",
                        )
            config = (
                self._call_config(task.config, f"{where}.config")
                if task.HasField("config")
                else None
            )
            args_list: list[TaskArgs] = []
            for m, member in enumerate(members):
                if not member.tensors and not member.scalars:
                    args_list.append(empty)
                else:
                    args_list.append(self._task_args(member, f"{where}.members[{m}]"))
            total += len(args_list)
            plan.append(_Planned(kind, handle, args_list, config, workers))
        return plan, total

    def _admission_checks(self, client: str, what: str) -> None:
        self._check_admitting(what)
        limit = self._limits.max_concurrent_runs
        if len(self._active) >= limit:
            raise LimitExceeded(
                "",
                f"cannot {what}: {len(self._active)} runs are active "
                f"(limits.max_concurrent_runs = {limit})",
            )
        if self._client_runs[client] >= limit:
            raise LimitExceeded(
                "",
                f"cannot {what}: this client has {self._client_runs[client]} active runs "
                f"(limits.max_concurrent_runs = {limit})",
            )

    def _dedup(self, key: str) -> int | None:
        if not key:
            return None
        if len(key) > _MAX_KEY:
            raise InvalidArgument("idempotency_key", f"{len(key)} characters, at most {_MAX_KEY}")
        run_id = self._keys.get(key)
        return run_id if run_id is not None and run_id in self._runs else None

    def _check_label(self, label: str) -> None:
        if len(label) > _MAX_LABEL:
            raise InvalidArgument("label", f"{len(label)} characters, at most {_MAX_LABEL}")

    async def _launch(
        self,
        rec: RunRecord,
        orch: Callable[..., Any],
        args: Any = None,
        config: CallConfig | None = None,
    ) -> int:
        rec.on_bind = self._bound
        try:
            # Never suspends: the run is queued (and, when admitted, built) right here.
            handle = await self._worker.submit_async(orch, args, config)
        except WorkerClosedError as exc:
            raise Precondition("", str(exc)) from exc
        rec.handle = handle
        rec.bind(handle.run)
        run_id = rec.run_id
        self._runs[run_id] = rec
        if rec.terminal:  # finished while it was submitted (its orchestration failed at once)
            self._remember_finished(rec)
        else:
            self._active[run_id] = rec
            self._client_runs[rec.client] += 1
            rec.on_finished = self._run_finished
        if rec.key:
            self._keys[rec.key] = run_id
        log.debug("run %d submitted by %s (%s)", run_id, rec.client, rec.label or "no label")
        return run_id

    def _cancel(self, rec: RunRecord, reason: str) -> bool:
        """Cancel a run that is not terminal; False when it already was."""
        run = rec.run
        if rec.terminal or run is None or run.terminal:
            return False
        if not rec.cancel_requested:
            rec.cancel_requested = True
            rec.cancel_reason = reason
            rec.error_before_cancel = run.error is not None
            if run.error is None:
                text = f"run cancelled: {reason}" if reason else "run cancelled"
                run.record_error(None, FailureInfo(Outcome.SKIPPED, text))
        self._worker.cancel(run)
        return True

    # ====================================================================== RPCs: info

    @_unary
    async def GetInfo(self, request: Any, context: Any) -> Any:
        w = self._worker
        heap = w.heap
        lim = self._limits
        used = 0 if heap.closed else heap.size - heap.free_bytes()
        return pb.GetInfoResponse(
            version=__version__,
            level=w.level,
            hostname=self._hostname,
            pid=os.getpid(),
            start_time=_now_ts(self.start_ns),
            serving_state=self.serving_state,
            heap=pb.HeapInfo(name=heap.name or "", size_bytes=heap.size, used_bytes=used),
            limits=pb.Limits(
                max_message_bytes=lim.max_message_bytes,
                max_tasks_per_run=lim.max_tasks_per_run,
                max_tensors_per_task=lim.max_tensors_per_task,
                max_scalars_per_task=lim.max_scalars_per_task,
                max_buffer_bytes=lim.max_buffer_bytes,
                max_concurrent_runs=lim.max_concurrent_runs,
                max_streams_per_client=lim.max_streams_per_client,
            ),
            num_sub_workers=w.num_sub_workers,
            num_next_level_workers=len(self._next_level_ids()),
            active_runs=len(self._active),
        )

    @_unary
    async def ListWorkers(self, request: Any, context: Any) -> Any:
        stopping = self._worker.state is not WorkerState.READY
        out = pb.ListWorkersResponse()
        for info in self._worker.list_workers():
            poisoned = info.get("poisoned")
            alive = info.get("alive", True)
            if poisoned or not alive:
                state = pb.WORKER_STATE_FAILED
            elif stopping:
                state = pb.WORKER_STATE_STOPPING
            elif info.get("busy"):
                state = pb.WORKER_STATE_BUSY
            else:
                state = pb.WORKER_STATE_IDLE
            out.workers.add(
                worker_id=int(info.get("worker_id", 0)),
                kind=_WORKER_KINDS.get(str(info.get("kind", "")), pb.WORKER_KIND_UNSPECIFIED),
                state=state,
                pid=int(info.get("pid") or 0),
                endpoint=str(info.get("endpoint") or ""),
                tasks_completed=int(info.get("tasks_completed") or 0),
                restarts=int(info.get("restarts") or 0),
                message=str(poisoned or ("" if alive else "the child process exited")),
            )
        return out

    # ====================================================================== callables

    @_unary
    async def RegisterCallable(self, request: Any, context: Any) -> Any:
        path = request.import_path
        if not path:
            raise InvalidArgument("import_path", "required ('module:qualname')")
        try:
            module, qualname = parse_import_path(path)
        except RegistrationError as exc:
            raise InvalidArgument("import_path", exc.args[0].partition(": ")[2]) from exc
        allowed = self._config.callables
        if not allowed.allows(module):
            raise PermissionDenied(
                "import_path",
                f"module {module!r} is not under callables.allowed_modules "
                f"({', '.join(allowed.allowed_modules) or 'nothing'})",
            )
        kind = _REGISTER_KINDS.get(request.kind)
        if kind is None:
            raise InvalidArgument(
                "kind",
                "required"
                if request.kind == pb.CALLABLE_KIND_UNSPECIFIED
                else f"unknown callable kind {request.kind}",
            )
        if request.workers and self._worker.level == 3:
            raise InvalidArgument("workers", "only a level-4 daemon takes an explicit worker list")
        self._check_usable("register a callable")
        target = f"{module}:{qualname}"
        fn: Callable[..., Any] | None = None
        if kind == "orchestration":
            # Orchestration functions run in the daemon itself: import them here (off
            # the loop, so a slow import does not stall the Scheduler).
            try:
                fn = await asyncio.to_thread(resolve_import, module, qualname)
            except Exception as exc:
                raise InvalidArgument(
                    "import_path", f"cannot import {target}: {type(exc).__name__}: {exc}"
                ) from exc
        try:
            handle = await self._worker.register_async(target, kind=kind)  # type: ignore[arg-type]
        except Exception as exc:
            raise _at("import_path", exc) from exc
        if fn is not None:
            self._orch_fns[handle.hashid] = fn
        entry = self._worker.registry.lookup(handle.hashid)
        refcount = entry.refcount if entry is not None else 1
        log.info("registered %s as %s (%s, refcount %d)", target, kind, handle.hashid, refcount)
        return pb.RegisterCallableResponse(hashid=handle.hashid, refcount=refcount)

    @_unary
    async def UnregisterCallable(self, request: Any, context: Any) -> Any:
        handle = self._handle(request.hashid, "hashid")
        self._check_usable("unregister a callable")
        try:
            await self._worker.unregister_async(handle)
        except Exception as exc:
            raise _at("hashid", exc) from exc
        entry = self._worker.registry.lookup(handle.hashid)
        refcount = entry.refcount if entry is not None and entry.state == "active" else 0
        if refcount == 0:
            self._orch_fns.pop(handle.hashid, None)
        return pb.UnregisterCallableResponse(refcount=refcount)

    @_unary
    async def ListCallables(self, request: Any, context: Any) -> Any:
        out = pb.ListCallablesResponse()
        for entry in self._worker.registry.active():
            h = entry.spec.handle
            out.callables.add(
                hashid=h.hashid,
                import_path=entry.spec.import_path or h.name,
                kind=_ROLE_KINDS.get(h.role, pb.CALLABLE_KIND_UNSPECIFIED),
                refcount=entry.refcount,
            )
        return out

    # ====================================================================== buffers

    def _buffer_info(self, buf: Buffer) -> Any:
        return pb.BufferInfo(
            buffer_id=buf.buffer_id,
            generation=buf.generation,
            nbytes=buf.nbytes,
            shape=list(buf.shape),
            dtype=np.dtype(buf.dtype).name,
            heap_name=self._worker.heap.name or "",
            heap_offset=buf.offset,
            label=self._labels.get(buf.buffer_id, ""),
            references=buf.pins,
        )

    @_unary
    async def AllocBuffer(self, request: Any, context: Any) -> Any:
        dt = self._dtype(request.dtype, "dtype")
        shape = tuple(request.shape)
        if len(shape) > MAX_NDIM:
            raise InvalidArgument("shape", f"{len(shape)} dimensions, at most {MAX_NDIM}")
        self._check_label(request.label)
        nbytes = math.prod(shape) * dt.itemsize
        limit = self._limits.max_buffer_bytes
        if nbytes > limit:
            raise LimitExceeded("shape", f"{nbytes} bytes, limits.max_buffer_bytes = {limit}")
        self._check_usable("allocate a buffer")
        heap = self._worker.heap
        try:
            buf = heap.alloc_buffer(shape, dt)
        except MemoryError as exc:
            raise LimitExceeded("shape", str(exc)) from exc
        if request.label:
            self._labels[buf.buffer_id] = request.label
        return pb.AllocBufferResponse(
            buffer_id=buf.buffer_id,
            generation=buf.generation,
            nbytes=buf.nbytes,
            heap_name=heap.name or "",
            heap_offset=buf.offset,
        )

    @_unary
    async def WriteBuffer(self, request_iterator: Any, context: Any) -> Any:
        with self._stream_slot(self._client(context)):
            heap = self._worker.heap
            buf: Buffer | None = None
            pos = written = 0
            async for msg in request_iterator:
                which = msg.WhichOneof("chunk")
                if buf is None:
                    if which != "target":
                        raise InvalidArgument(
                            "target", "the first WriteBuffer message must carry the target"
                        )
                    t = msg.target
                    self._check_usable("write a buffer")
                    buf = self._buffer(t.buffer_id, t.generation, "target")
                    if t.offset > buf.nbytes:
                        raise InvalidArgument(
                            "target.offset",
                            f"offset {t.offset} is past the end of buffer {buf.buffer_id} "
                            f"({buf.nbytes} bytes)",
                        )
                    pos = t.offset
                    continue
                if which != "data":
                    raise InvalidArgument(
                        "target", "only the first WriteBuffer message may carry a target"
                    )
                data = msg.data
                # The buffer may have been freed while the stream was open.
                self._check_usable("write a buffer")
                self._buffer(buf.buffer_id, buf.generation, "target")
                end = pos + len(data)
                if end > buf.nbytes:
                    raise InvalidArgument(
                        "data",
                        f"writing {len(data)} bytes at offset {pos} overruns buffer "
                        f"{buf.buffer_id} of {buf.nbytes} bytes",
                    )
                heap.mmap[buf.offset + pos : buf.offset + end] = data
                pos = end
                written += len(data)
            if buf is None:
                raise InvalidArgument(
                    "target", "empty stream: the first message must carry the target"
                )
            return pb.WriteBufferResponse(buffer_id=buf.buffer_id, bytes_written=written)

    @_server_stream
    async def ReadBuffer(self, request: Any, context: Any) -> AsyncIterator[Any]:
        with self._stream_slot(self._client(context)):
            self._check_usable("read a buffer")
            buf = self._buffer(request.buffer_id, request.generation, "")
            start = request.offset
            if start > buf.nbytes:
                raise InvalidArgument(
                    "offset",
                    f"offset {start} is past the end of buffer {buf.buffer_id} "
                    f"({buf.nbytes} bytes)",
                )
            length = request.length or buf.nbytes - start
            if start + length > buf.nbytes:
                raise InvalidArgument(
                    "length",
                    f"[{start}, {start + length}) overruns buffer {buf.buffer_id} of "
                    f"{buf.nbytes} bytes",
                )
            limit = max(1, self._limits.max_message_bytes - _CHUNK_OVERHEAD)
            chunk = min(request.chunk_bytes or READ_CHUNK, limit)
            heap = self._worker.heap
            pos, end = start, start + length
            while pos < end:
                self._check_usable("read a buffer")
                self._buffer(buf.buffer_id, buf.generation, "")
                stop = min(end, pos + chunk)
                yield pb.ReadBufferResponse(
                    offset=pos, data=heap.mmap[buf.offset + pos : buf.offset + stop]
                )
                pos = stop

    @_unary
    async def FreeBuffer(self, request: Any, context: Any) -> Any:
        self._check_usable("free a buffer")
        buf = self._buffer(request.buffer_id, request.generation, "")
        deferred = buf.pins > 0
        self._worker.heap.free(buf.buffer_id)
        self._labels.pop(buf.buffer_id, None)
        return pb.FreeBufferResponse(deferred=deferred)

    @_unary
    async def ListBuffers(self, request: Any, context: Any) -> Any:
        heap = self._worker.heap
        out = pb.ListBuffersResponse()
        if heap.closed:
            return out
        for buf in heap.buffers():
            out.buffers.append(self._buffer_info(buf))
        out.heap.CopyFrom(
            pb.HeapInfo(
                name=heap.name or "", size_bytes=heap.size, used_bytes=heap.size - heap.free_bytes()
            )
        )
        return out

    # ====================================================================== runs

    @_unary
    async def SubmitRun(self, request: Any, context: Any) -> Any:
        wait = _timeout_field(request, "wait_seconds") if request.HasField("wait_seconds") else None
        run_id = self._dedup(request.idempotency_key)
        if run_id is not None:
            response = pb.SubmitRunResponse(run_id=run_id, deduplicated=True)
            if wait is not None:
                response.status.CopyFrom(await self._wait(self._record(run_id), wait))
            return response
        self._check_label(request.label)
        client = self._client(context)
        self._admission_checks(client, "submit a run")
        plan, total = self._plan(request)
        rec = RunRecord(
            label=request.label,
            client=client,
            key=request.idempotency_key,
            total=total,
            metrics=self._metrics,
        )
        run_id = await self._launch(rec, _declarative(rec, plan))
        response = pb.SubmitRunResponse(run_id=run_id)
        if wait is not None:
            response.status.CopyFrom(await self._wait(rec, wait))
        return response

    @_unary
    async def RunOrchestration(self, request: Any, context: Any) -> Any:
        run_id = self._dedup(request.idempotency_key)
        if run_id is not None:
            return pb.RunOrchestrationResponse(run_id=run_id, deduplicated=True)
        self._check_label(request.label)
        handle = self._handle(request.hashid, "hashid")
        if handle.role != "orchestration":
            raise InvalidArgument(
                "hashid",
                f"{handle.name} is registered as {handle.role}, not as an orchestration function",
            )
        fn = self._orch_fns.get(handle.hashid)
        if fn is None:
            module, qualname = parse_import_path(handle.name)
            try:
                fn = await asyncio.to_thread(resolve_import, module, qualname)
            except Exception as exc:
                raise Precondition(
                    "hashid", f"cannot import {handle.name}: {type(exc).__name__}: {exc}"
                ) from exc
            self._orch_fns[handle.hashid] = fn
        client = self._client(context)
        self._admission_checks(client, "run an orchestration")
        args = self._task_args(request.args, "args")
        config = self._call_config(request.config, "config")
        rec = RunRecord(
            label=request.label or handle.name,
            client=client,
            key=request.idempotency_key,
            total=None,
            metrics=self._metrics,
        )
        target = fn

        def orch(o: Any, a: Any, c: Any) -> Any:
            rec.bind(o.run)
            return target(o, a, c)

        run_id = await self._launch(rec, orch, args, config)
        return pb.RunOrchestrationResponse(run_id=run_id)

    @_server_stream
    async def WatchRun(self, request: Any, context: Any) -> AsyncIterator[Any]:
        rec = self._record(request.run_id)
        after = request.after_sequence
        with self._stream_slot(self._client(context)):
            watcher = _Watcher()
            rec.watchers.add(watcher)
            try:
                yield rec.snapshot()
                if rec.terminal_event is not None:
                    yield rec.terminal_event
                    return
                while True:
                    await watcher.wake.wait()
                    watcher.wake.clear()
                    if watcher.lagged:
                        watcher.lagged = False
                        yield rec.snapshot()
                    while watcher.queue:
                        event = watcher.queue.popleft()
                        if event.sequence <= after:
                            continue
                        yield event
                        if event is rec.terminal_event:
                            return
                    if rec.terminal_event is not None and not watcher.queue:
                        yield rec.terminal_event  # lost in a lag: the stream still ends with it
                        return
            finally:
                rec.watchers.discard(watcher)

    @_unary
    async def WaitRun(self, request: Any, context: Any) -> Any:
        rec = self._record(request.run_id)
        timeout = (
            _timeout_field(request, "timeout_seconds")
            if request.HasField("timeout_seconds")
            else None
        )
        return await self._wait(rec, timeout)

    async def _wait(self, rec: RunRecord, timeout: float | None) -> Any:
        """The run's status once terminal or after ``timeout`` seconds."""
        if not rec.terminal and timeout != 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await rec.finished.wait()
        return rec.status()

    @_unary
    async def CancelRun(self, request: Any, context: Any) -> Any:
        rec = self._record(request.run_id)
        if len(request.reason) > _MAX_LABEL:
            raise InvalidArgument(
                "reason", f"{len(request.reason)} characters, at most {_MAX_LABEL}"
            )
        cancelled = self._cancel(rec, request.reason)
        return pb.CancelRunResponse(state=rec.proto_state(), already_finished=not cancelled)

    # ====================================================================== operations

    @_unary
    async def AddRemoteWorker(self, request: Any, context: Any) -> Any:
        raise Unimplemented(
            "",
            "cannot add a remote worker: remote L3 workers are not available in this build "
            "(no remote layer is included yet)",
        )

    @_unary
    async def Drain(self, request: Any, context: Any) -> Any:
        if request.HasField("grace_seconds"):
            grace = request.grace_seconds
            if not math.isfinite(grace) or grace < 0:
                raise InvalidArgument("grace_seconds", f"must be >= 0, got {grace}")
        else:
            grace = self._config.daemon.shutdown_grace
        finished, cancelled = await self.drain(grace, reason="drain requested")
        if request.shutdown and self._request_shutdown is not None:
            self._request_shutdown("Drain(shutdown=true)")
        return pb.DrainResponse(runs_finished=finished, runs_cancelled=cancelled)

    async def drain(self, grace: float, *, reason: str) -> tuple[int, int]:
        """Stop admitting runs, give the active ones ``grace`` seconds, cancel the rest.

        Returns ``(finished, cancelled)``. The cancelled runs become terminal once
        their running tasks finish; watchers see them CANCELLED.
        """
        if self.serving_state == pb.SERVING_STATE_SERVING:
            self.serving_state = pb.SERVING_STATE_DRAINING
            if self._on_draining is not None:
                await self._on_draining()
        async with self._drain_lock:
            active = list(self._active.values())
            if active:
                log.info("draining: %d active runs get %.1fs to finish", len(active), grace)
                waits = [asyncio.ensure_future(r.finished.wait()) for r in active]
                try:
                    await asyncio.wait(waits, timeout=grace)
                finally:
                    for t in waits:
                        t.cancel()
                    await asyncio.gather(*waits, return_exceptions=True)
            cancelled = 0
            for rec in active:
                if not rec.terminal and self._cancel(rec, reason):
                    cancelled += 1
            if cancelled:
                log.warning(
                    "drain: cancelled %d runs that did not finish in %.1fs", cancelled, grace
                )
            return len(active) - cancelled, cancelled

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no run is active; False when ``timeout`` passed first."""
        records = list(self._active.values())
        if not records:
            return True
        waits = [asyncio.ensure_future(r.finished.wait()) for r in records]
        try:
            _, pending = await asyncio.wait(waits, timeout=timeout)
        finally:
            for t in waits:
                t.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        return not pending


def _declarative(rec: RunRecord, plan: list[_Planned]) -> Callable[..., None]:
    """The orchestration function of a SubmitRun: submit the validated plan in order."""

    def orch(o: Any, _args: Any, _config: Any) -> None:
        rec.bind(o.run)
        try:
            for p in plan:
                kind = p.kind
                if kind == pb.TASK_KIND_SUB:
                    o.submit_sub(p.handle, p.members[0], p.config)
                elif kind == pb.TASK_KIND_SUB_GROUP:
                    o.submit_sub_group(p.handle, p.members, p.config)
                elif kind == pb.TASK_KIND_NEXT_LEVEL:
                    o.submit_next_level(p.handle, p.members[0], p.config, worker=p.targets[0])
                else:
                    o.submit_next_level_group(p.handle, p.members, p.config, workers=p.targets)
        except SimplerError:
            # The run already failed (a task failed while later ones were being
            # submitted) or the daemon is closing: the run carries that error.
            if o.run.error is None:
                raise
        finally:
            plan.clear()  # drop the heap views: the slots hold descriptors now

    return orch
