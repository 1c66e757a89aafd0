"""The ``simpler.daemon.v1.Daemon`` gRPC servicer: one thin handler per RPC.

Everything runs on the daemon's one event loop, beside the Scheduler coroutine::

    client --gRPC--> DaemonService.<Rpc>
                         |-- Planner (plan.py): request -> validated plan, or a RequestError
                         |-- RunTable (runs.py): run records, events, watchers, retention
                         |-- worker_info (workers.py): ListWorkers rows, remote sessions
                         |-- Worker: register / alloc / submit_async / add_remote_worker_async
                         v
                     status_of (status.py): exception -> gRPC status code

Data flows down: handlers call the planner and the run table; neither of them
knows this module.

The loop must stay responsive for every client: a big SubmitRun is planned and
built in slices (plan.py), a RunOrchestration function runs on a worker thread
(offloop.py), garbage request bytes never reach a handler as a message
(wire.py), and a client is who the kernel or the transport says (peers.py).

Every run, buffer and registration has an owner (``Identity.owner``); only the owner
or an admin acts on it, admin calls need an admin, and each owner has quotas
(access.py).
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
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Final, NoReturn, TypeVar

import grpc
import numpy as np

from simpler_daemon import __version__
from simpler_daemon.args import MAX_NDIM
from simpler_daemon.callables import parse_import_path, resolve_import
from simpler_daemon.errors import StartupError, WorkerClosedError
from simpler_daemon.heap import Buffer
from simpler_daemon.server._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server._proto.simpler.daemon.v1 import daemon_pb2_grpc as pb_grpc
from simpler_daemon.server.access import Owners, read_admin_token, require_admin
from simpler_daemon.server.config import DaemonConfig
from simpler_daemon.server.metrics import Metrics
from simpler_daemon.server.offloop import run_off_loop
from simpler_daemon.server.peers import (
    AdminPolicy,
    Identity,
    UnixRelay,
    client_label,
    identify,
)
from simpler_daemon.server.plan import (
    REGISTER_KINDS,
    Planner,
    check_label,
    check_reason,
    declarative,
    timeout_field,
)
from simpler_daemon.server.runs import RunTable, fingerprint, now_ts
from simpler_daemon.server.status import (
    InvalidArgument,
    LimitExceeded,
    PermissionDenied,
    Precondition,
    RequestError,
    Unavailable,
    at_field,
    bound_text,
    error_text,
    status_of,
)
from simpler_daemon.server.wire import BadRequest
from simpler_daemon.server.workers import worker_info
from simpler_daemon.worker import Worker, WorkerState

__all__ = ["READ_CHUNK", "DaemonService"]

log = logging.getLogger("simpler_daemon.service")

Code = grpc.StatusCode

#: Default ReadBuffer chunk; never more than the message limit allows.
READ_CHUNK: Final = 1 << 20
#: Room for the protobuf framing around a chunk.
_CHUNK_OVERHEAD: Final = 1024

_ROLE_KINDS: Final[dict[str, int]] = {role: kind for kind, role in REGISTER_KINDS.items()}


# --------------------------------------------------------------------------- decorators

F = TypeVar("F", bound=Callable[..., Any])


def _unary(fn: F) -> F:
    """Map exceptions of a unary-response handler to a status via STATUS_TABLE."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: DaemonService, request: Any, context: Any) -> Any:
        try:
            if isinstance(request, BadRequest):
                raise InvalidArgument("", request.describe())
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
            if isinstance(request, BadRequest):
                raise InvalidArgument("", request.describe())
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
    stops admitting runs (the health service turns NOT_SERVING). Call
    :meth:`start` once the Worker is bound to the running loop.
    """

    def __init__(
        self,
        worker: Worker,
        config: DaemonConfig,
        *,
        metrics: Metrics | None = None,
        request_shutdown: Callable[[str], None] | None = None,
        on_draining: Callable[[], Awaitable[None]] | None = None,
        relay: UnixRelay | None = None,
    ) -> None:
        self._worker = worker
        self._relay = relay
        sec = config.security
        self._admins = AdminPolicy(
            admin_uids=sec.admin_uids,
            admin_groups=sec.admin_groups,
            admin_token=read_admin_token(sec.admin_token_file),
        )
        self._owners = Owners(config.limits)
        self._on_draining = on_draining
        self._config = config
        self._limits = config.limits
        self._metrics = metrics
        self._request_shutdown = request_shutdown
        self._plan = Planner(
            worker,
            config.limits,
            config.callables,
            credentials_dir=config.workers.remote_credentials_dir,
        )
        self._runs = RunTable(worker, config.limits, metrics)
        self.serving_state: pb.ServingState = pb.SERVING_STATE_SERVING
        self.start_ns = time.time_ns()
        self._streams: Counter[str] = Counter()
        self._labels: dict[int, str] = {}
        self._orch_fns: dict[str, Callable[..., Any]] = {}
        self._hostname = socket.gethostname()

    def start(self) -> None:
        """Hook the Scheduler's task events (call after ``Worker.start_async``)."""
        sched = self._worker.scheduler
        if sched is None:
            raise WorkerClosedError("cannot start the gRPC service: the Worker is not initialised")
        sched.on_task_event = self._runs.on_task_event
        self.start_ns = time.time_ns()

    @property
    def active_runs(self) -> int:
        return self._runs.active_count

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
            details = bound_text(
                str(exc)
                if isinstance(exc, RequestError)
                # Its text may hold anything, another client's data included: the
                # operator reads it in the log, the client gets where and what kind.
                else f"internal error in {method} ({type(exc).__name__}); see the daemon log"
            )
        else:
            details = error_text(exc)
            log.debug("%s refused with %s: %s", method, code.name, details)
        self._count(method, code)
        await context.abort(code, details)
        raise AssertionError("unreachable: context.abort returned")  # pragma: no cover

    def _who(self, context: Any) -> Identity:
        """Who the call comes from, for ownership and quotas: what the kernel or the
        transport says (peer credentials, TLS identity, admin token), never a header."""
        return identify(context, self._relay, self._admins)

    def _check_pins(self, who: Identity, pins: set[int], what: str) -> None:
        """A run may use only its submitter's buffers (an admin's: anyone's)."""
        heap = self._worker.heap
        for buffer_id in sorted(pins):
            try:
                generation = heap.get(buffer_id).generation
            except KeyError:
                continue  # the planner checked it; a free meanwhile is deferred by the pin
            self._owners.check_buffer(who, buffer_id, generation, what)

    def _unpin(self, pins: set[int]) -> None:
        """Give back the pins a run took at submit; a freed buffer is released now."""
        heap = self._worker.heap
        if heap.closed:
            return
        for buffer_id in pins:
            heap.unpin(buffer_id)
        pins.clear()

    def _hold_until_done(self, rec: Any, pins: set[int]) -> None:
        """Keep ``pins`` until the run is terminal (every task finished or failed).

        They join the engine's own submit-time pins of the run (``Run.pins``): the
        engine then still describes those buffers after a FreeBuffer, and unpins
        them when the run ends."""
        run = rec.run
        if run is None or run.terminal:
            self._unpin(pins)
            return
        held = getattr(run, "pins", None)
        if isinstance(held, list):
            held.extend(pins)
            pins.clear()
        else:  # an engine without submit-time pins: let go when the run is done
            run.add_done_callback(lambda _run: self._unpin(pins))

    def _check_usable(self, what: str) -> None:
        if self._worker.state is not WorkerState.READY:
            raise Precondition("", f"cannot {what}: the daemon is stopping")

    def _admission_checks(self, client: str, what: str) -> None:
        if self.serving_state == pb.SERVING_STATE_DRAINING:
            raise Precondition("", f"cannot {what}: the daemon is draining and takes no new runs")
        if self.serving_state == pb.SERVING_STATE_STOPPING:
            raise Precondition("", f"cannot {what}: the daemon is shutting down")
        self._check_usable(what)
        self._runs.check_capacity(client, what)

    @contextlib.contextmanager
    def _stream_slot(self, client: str) -> Iterator[None]:
        limit = self._limits.max_streams_per_client
        if self._streams[client] >= limit:
            raise LimitExceeded(
                "",
                f"cannot open another stream: quota reached: {client} has "
                f"{self._streams[client]} open (limits.max_streams_per_client = {limit})",
            )
        self._streams[client] += 1
        try:
            yield
        finally:
            self._streams[client] -= 1
            if self._streams[client] <= 0:
                del self._streams[client]

    # ====================================================================== RPCs: info

    @_unary
    async def GetInfo(self, request: Any, context: Any) -> Any:
        who = self._who(context)
        w = self._worker
        heap = w.heap
        lim = self._limits
        used = 0 if heap.closed else heap.size - heap.free_bytes()
        return pb.GetInfoResponse(
            version=__version__,
            level=w.level,
            hostname=self._hostname,
            pid=os.getpid(),
            start_time=now_ts(self.start_ns),
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
                per_client_runs=lim.per_client_runs,
                per_client_heap_bytes=lim.per_client_heap_bytes,
                per_client_registrations=lim.per_client_registrations,
            ),
            num_sub_workers=w.num_sub_workers,
            num_next_level_workers=len(self._plan.next_level_ids()),
            active_runs=self._runs.active_count,
            caller=who.owner,
            caller_is_admin=who.admin,
        )

    @_unary
    async def ListWorkers(self, request: Any, context: Any) -> Any:
        stopping = self._worker.state is not WorkerState.READY
        out = pb.ListWorkersResponse()
        for info in self._worker.list_workers():
            out.workers.append(worker_info(info, stopping=stopping))
        return out

    # ====================================================================== callables

    @_unary
    async def RegisterCallable(self, request: Any, context: Any) -> Any:
        who = self._who(context)
        limit = self._limits.max_import_path_chars
        if len(request.import_path) > limit:  # before anything parses or echoes it
            raise LimitExceeded(
                "import_path",
                f"{len(request.import_path)} characters, limits.max_import_path_chars = {limit}",
            )
        with self._owners.registering(who) as commit:
            module, qualname, kind = self._plan.register_target(request)
            self._check_usable("register a callable")
            target = f"{module}:{qualname}"
            fn: Callable[..., Any] | None = None
            if kind == "orchestration":
                # Orchestration functions run in the daemon itself: import them here (off
                # the loop, so a slow import does not stall the Scheduler).
                try:
                    fn = await asyncio.to_thread(resolve_import, module, qualname)
                except PermissionError as exc:  # outside the allow-list (callables.py)
                    raise PermissionDenied("import_path", str(exc)) from exc
                except Exception as exc:
                    raise InvalidArgument(
                        "import_path", f"cannot import {target}: {type(exc).__name__}: {exc}"
                    ) from exc
            try:
                if request.workers:  # level 4 only (checked by the planner)
                    handle = await self._worker.register_async(
                        target,
                        kind=kind,  # type: ignore[arg-type]
                        workers=list(request.workers),
                    )
                else:
                    handle = await self._worker.register_async(target, kind=kind)  # type: ignore[arg-type]
            except Exception as exc:
                raise at_field("import_path", exc) from exc
            if fn is not None:
                self._orch_fns[handle.hashid] = fn
            commit(handle.hashid)
        entry = self._worker.registry.lookup(handle.hashid)
        refcount = entry.refcount if entry is not None else 1
        log.info(
            "registered %s as %s (%s, refcount %d) for %s",
            target,
            kind,
            handle.hashid,
            refcount,
            who,
        )
        return pb.RegisterCallableResponse(hashid=handle.hashid, refcount=refcount)

    @_unary
    async def UnregisterCallable(self, request: Any, context: Any) -> Any:
        handle = self._plan.handle(request.hashid, "hashid")
        owner = self._owners.registration_owner(self._who(context), handle.hashid)
        self._check_usable("unregister a callable")
        try:
            await self._worker.unregister_async(handle)
        except Exception as exc:
            raise at_field("hashid", exc) from exc
        self._owners.drop_registration(owner, handle.hashid)
        entry = self._worker.registry.lookup(handle.hashid)
        refcount = entry.refcount if entry is not None and entry.state == "active" else 0
        if refcount == 0:
            self._orch_fns.pop(handle.hashid, None)
            self._owners.forget_registration(handle.hashid)
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
        dt = self._plan.dtype(request.dtype, "dtype")
        shape = tuple(request.shape)
        if len(shape) > MAX_NDIM:
            raise InvalidArgument("shape", f"{len(shape)} dimensions, at most {MAX_NDIM}")
        check_label(request.label)
        nbytes = math.prod(shape) * dt.itemsize
        limit = self._limits.max_buffer_bytes
        if nbytes > limit:
            raise LimitExceeded("shape", f"{nbytes} bytes, limits.max_buffer_bytes = {limit}")
        who = self._who(context)
        self._owners.check_alloc(who, nbytes)
        self._check_usable("allocate a buffer")
        heap = self._worker.heap
        try:
            buf = heap.alloc_buffer(shape, dt)
        except MemoryError as exc:
            raise LimitExceeded("shape", str(exc)) from exc
        self._owners.add_buffer(who, buf.buffer_id, buf.generation, buf.nbytes)
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
        who = self._who(context)
        with self._stream_slot(who.owner):
            heap = self._worker.heap
            buf: Buffer | None = None
            pos = written = 0
            async for msg in request_iterator:
                if isinstance(msg, BadRequest):
                    raise InvalidArgument("", msg.describe())
                which = msg.WhichOneof("chunk")
                if buf is None:
                    if which != "target":
                        raise InvalidArgument(
                            "target", "the first WriteBuffer message must carry the target"
                        )
                    t = msg.target
                    self._check_usable("write a buffer")
                    buf = self._plan.buffer(t.buffer_id, t.generation, "target")
                    self._owners.check_buffer(
                        who, buf.buffer_id, buf.generation, "write", "target.buffer_id"
                    )
                    if t.offset > buf.nbytes:
                        raise InvalidArgument(
                            "target.offset",
                            f"offset {t.offset} is past the end of buffer {buf.buffer_id} "
                            f"({buf.nbytes} bytes)",
                        )
                    if t.offset + t.total_bytes > buf.nbytes:  # refused before any data
                        raise InvalidArgument(
                            "target.total_bytes",
                            f"writing {t.total_bytes} bytes at offset {t.offset} overruns "
                            f"buffer {buf.buffer_id} of {buf.nbytes} bytes",
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
                self._plan.buffer(buf.buffer_id, buf.generation, "target")
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
        who = self._who(context)
        with self._stream_slot(who.owner):
            self._check_usable("read a buffer")
            buf = self._plan.buffer(request.buffer_id, request.generation, "")
            self._owners.check_buffer(who, buf.buffer_id, buf.generation, "read", "buffer_id")
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
                self._plan.buffer(buf.buffer_id, buf.generation, "")
                stop = min(end, pos + chunk)
                yield pb.ReadBufferResponse(
                    offset=pos, data=heap.mmap[buf.offset + pos : buf.offset + stop]
                )
                pos = stop

    @_unary
    async def FreeBuffer(self, request: Any, context: Any) -> Any:
        self._check_usable("free a buffer")
        buf = self._plan.buffer(request.buffer_id, request.generation, "")
        self._owners.check_buffer(
            self._who(context), buf.buffer_id, buf.generation, "free", "buffer_id"
        )
        deferred = buf.pins > 0
        self._worker.heap.free(buf.buffer_id)
        self._labels.pop(buf.buffer_id, None)
        self._owners.drop_buffer(buf.buffer_id)
        return pb.FreeBufferResponse(deferred=deferred)

    @_unary
    async def ListBuffers(self, request: Any, context: Any) -> Any:
        heap = self._worker.heap
        out = pb.ListBuffersResponse()
        if heap.closed:
            return out
        who = self._who(context)
        for buf in heap.buffers():  # a client sees its own buffers; an admin every one
            if self._owners.may_use_buffer(who, buf.buffer_id, buf.generation):
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
        runs = self._runs
        wait = timeout_field(request, "wait_seconds") if request.HasField("wait_seconds") else None
        key = request.idempotency_key
        key_print = b""
        if key:
            runs.check_key(key)
            request.ClearField("wait_seconds")  # how to answer, not what to run
            key_print = await fingerprint("SubmitRun", request)
        who = self._who(context)
        async with runs.claim_key(who.owner, key, key_print) as run_id:
            if run_id is not None:
                response = pb.SubmitRunResponse(run_id=run_id, deduplicated=True)
                if wait is not None:
                    response.status.CopyFrom(await runs.wait(runs.record(run_id), wait))
                return response
            rec = await self._submit_run(request, who, key_print)
            log.debug("run %d is from client %r", rec.run_id, client_label(context))
        response = pb.SubmitRunResponse(run_id=rec.run_id)
        if wait is not None:
            response.status.CopyFrom(await runs.wait(rec, wait))
        return response

    async def _submit_run(self, request: Any, who: Identity, key_print: bytes) -> Any:
        """Plan (in slices: the loop keeps serving) and launch a SubmitRun; its record.

        Every buffer the tasks reference is pinned from the moment it is checked until
        the run is terminal: a FreeBuffer meanwhile is deferred (``deferred = true``)."""
        runs = self._runs
        check_label(request.label)
        client = who.owner
        self._admission_checks(client, "submit a run")
        pins: set[int] = set()
        try:
            plan, total = await self._plan.plan_run(request, pins)
            self._check_pins(who, pins, "submit a run with")
            # Planning yielded to the loop: the daemon may have begun stopping meanwhile.
            self._admission_checks(client, "submit a run")
            rec = runs.new_record(
                label=request.label, client=client, key=request.idempotency_key, total=total
            )
            rec.key_print = key_print
            await runs.launch(rec, declarative(plan, rec.bind))
        except BaseException:
            self._unpin(pins)
            raise
        self._hold_until_done(rec, pins)
        return rec

    @_unary
    async def RunOrchestration(self, request: Any, context: Any) -> Any:
        key = request.idempotency_key
        key_print = b""
        if key:
            self._runs.check_key(key)
            key_print = await fingerprint("RunOrchestration", request)
        who = self._who(context)
        async with self._runs.claim_key(who.owner, key, key_print) as run_id:
            if run_id is not None:
                return pb.RunOrchestrationResponse(run_id=run_id, deduplicated=True)
            run_id = await self._run_orchestration(request, who, key_print)
            log.debug("run %d is from client %r", run_id, client_label(context))
        return pb.RunOrchestrationResponse(run_id=run_id)

    async def _run_orchestration(self, request: Any, who: Identity, key_print: bytes) -> int:
        """Launch a RunOrchestration; the function runs on a worker thread (see
        :func:`run_off_loop`) and its argument buffers stay pinned until the run ends."""
        check_label(request.label)
        handle = self._plan.orchestration_handle(request.hashid, "hashid")
        fn = self._orch_fns.get(handle.hashid)
        if fn is None:
            module, qualname = parse_import_path(handle.name)
            try:
                fn = await asyncio.to_thread(resolve_import, module, qualname)
            except PermissionError as exc:
                raise PermissionDenied("hashid", str(exc)) from exc
            except Exception as exc:
                raise Precondition(
                    "hashid", f"cannot import {handle.name}: {type(exc).__name__}: {exc}"
                ) from exc
            self._orch_fns[handle.hashid] = fn
        client = who.owner
        self._admission_checks(client, "run an orchestration")
        pins: set[int] = set()
        try:
            args = self._plan.task_args(request.args, "args", pins)
            self._check_pins(who, pins, "run an orchestration with")
            config = self._plan.call_config(request.config, "config")
            rec = self._runs.new_record(
                label=request.label or handle.name,
                client=client,
                key=request.idempotency_key,
                total=None,
            )
            rec.key_print = key_print
            target = fn

            async def orch(o: Any, a: Any, c: Any) -> Any:
                rec.bind(o.run)
                return await run_off_loop(target, o, a, c)

            run_id = await self._runs.launch(rec, orch, args, config)
        except BaseException:
            self._unpin(pins)
            raise
        self._hold_until_done(rec, pins)
        return run_id

    @_server_stream
    async def WatchRun(self, request: Any, context: Any) -> AsyncIterator[Any]:
        rec = self._runs.record(request.run_id)
        who = self._who(context)
        self._owners.check_run(who, rec.client, rec.run_id, "watch")
        with self._stream_slot(who.owner):
            async with contextlib.aclosing(rec.events(request.after_sequence)) as events:
                async for event in events:
                    yield event

    @_unary
    async def WaitRun(self, request: Any, context: Any) -> Any:
        rec = self._runs.record(request.run_id)
        self._owners.check_run(self._who(context), rec.client, rec.run_id, "wait for")
        timeout = (
            timeout_field(request, "timeout_seconds")
            if request.HasField("timeout_seconds")
            else None
        )
        return await self._runs.wait(rec, timeout)

    @_unary
    async def CancelRun(self, request: Any, context: Any) -> Any:
        rec = self._runs.record(request.run_id)
        self._owners.check_run(self._who(context), rec.client, rec.run_id, "cancel")
        check_reason(request.reason)
        cancelled = self._runs.cancel(rec, request.reason)
        return pb.CancelRunResponse(state=rec.proto_state(), already_finished=not cancelled)

    # ====================================================================== operations

    @_unary
    async def AddRemoteWorker(self, request: Any, context: Any) -> Any:
        level = self._worker.level
        if level != 4:
            raise Precondition(
                "",
                f"cannot add a remote worker: this daemon is level {level}; remote L3 workers "
                "need daemon.level = 4",
            )
        require_admin(self._who(context), "add a remote worker")
        spec = self._plan.remote_spec(request)
        self._check_usable("add a remote worker")
        try:
            worker_id = await self._worker.add_remote_worker_async(spec)
        except StartupError as exc:
            raise Unavailable("", str(exc)) from exc
        except ValueError as exc:  # the Worker's own checks of the spec
            raise InvalidArgument("endpoint", str(exc)) from exc
        log.info("remote worker %d added: %s", worker_id, spec.endpoint)
        return pb.AddRemoteWorkerResponse(worker_id=worker_id)

    @_unary
    async def Drain(self, request: Any, context: Any) -> Any:
        require_admin(self._who(context), "shut down" if request.shutdown else "drain")
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
        return await self._runs.drain(grace, reason=reason)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no run is active; False when ``timeout`` passed first."""
        return await self._runs.wait_idle(timeout)
