"""The shared core of the ``simpler.daemon.v1.Daemon`` servicer: state and plumbing.

The servicer is split by concept: this module holds what every handler uses
(the status-mapping decorators, who the caller is, pins, admission checks,
stream quotas); callables_rpc.py, buffers_rpc.py and runs_rpc.py hold the
handlers of one concept each; service.py combines them with the info and
operations RPCs into :class:`~simpler_daemon.server.service.DaemonService`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc

from simpler_daemon.engine.worker import Worker, WorkerState
from simpler_daemon.errors import (
    InvalidField,
    LimitExceeded,
    Precondition,
    RequestError,
    WorkerClosedError,
)
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol.metadata import FIELD_METADATA, RETRY_AFTER_METADATA
from simpler_daemon.server.access import Owners, read_admin_token
from simpler_daemon.server.config import DaemonConfig
from simpler_daemon.server.decoding import BadRequest
from simpler_daemon.server.fastcontext import Deferred, FastContext
from simpler_daemon.server.history import History
from simpler_daemon.server.metrics import Metrics
from simpler_daemon.server.owed import OwedOutputs
from simpler_daemon.server.peers import AdminPolicy, Identity, UnixRelay, identify
from simpler_daemon.server.plan import Planner
from simpler_daemon.server.runs import RunTable
from simpler_daemon.server.sessions import Sessions
from simpler_daemon.server.status import bound_text, error_text, status_of

__all__ = ["ServiceBase", "server_stream", "unary", "unary_as"]

log = logging.getLogger("simpler_daemon.service")

Code = grpc.StatusCode

# --------------------------------------------------------------------------- decorators

F = TypeVar("F", bound=Callable[..., Any])


def unary(fn: F) -> F:
    """Map exceptions of a unary-response handler to a status via STATUS_TABLE."""
    return _unary(fn, fn.__name__)


def unary_as(name: str) -> Callable[[F], F]:
    """:func:`unary` for a handler that answers RPC ``name`` in another form (the fast
    path's version-2 frames): its metrics and log lines name that RPC."""
    return lambda fn: _unary(fn, name)


def _unary(fn: F, name: str) -> F:

    @functools.wraps(fn)
    async def wrapper(self: ServiceBase, request: Any, context: Any) -> Any:
        try:
            if isinstance(request, BadRequest):
                raise InvalidField("", request.describe())
            response = await fn(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await self._abort(context, name, exc)
        if type(response) is not Deferred:  # a Deferred counts its outcome when answered
            self._count(name, Code.OK)
        return response

    return wrapper  # type: ignore[return-value]


def server_stream(fn: F) -> F:
    """The same for server-streaming handlers (async generators)."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: ServiceBase, request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            if isinstance(request, BadRequest):
                raise InvalidField("", request.describe())
            async for item in fn(self, request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await self._abort(context, name, exc)
        self._count(name, Code.OK)

    return wrapper  # type: ignore[return-value]


# --------------------------------------------------------------------------- the core


class ServiceBase:
    """What every RPC handler of the servicer shares (see :class:`DaemonService`).

    ``request_shutdown(reason)`` is called by ``Drain(shutdown=true)``; the
    daemon owns what happens next. ``on_draining()`` is awaited when the daemon
    stops admitting runs (the health service turns NOT_SERVING), ``on_resumed()``
    when a Resume undoes that (SERVING again). Call
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
        on_resumed: Callable[[], Awaitable[None]] | None = None,
        relay: UnixRelay | None = None,
        history: History | None = None,
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
        self._sessions = Sessions()  # client sessions and their registrations
        self._releasing: set[asyncio.Task[None]] = set()  # ended sessions' releases
        self._on_draining = on_draining
        self._on_resumed = on_resumed
        self._shutdown_requested = False
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
        if history is not None:  # the runs of earlier daemon processes (server/history.py)
            self._runs.restore(history)
        self.serving_state: pb.ServingState = pb.SERVING_STATE_SERVING
        #: Why a worker pool has no capacity ("" = every pool has; set by the daemon, see
        #: server/health.py): GetInfo then reports SERVING_STATE_UNHEALTHY.
        self.health_reason = ""
        #: What a drain owes the clients: the outputs of the runs it let finish.
        self._owed = OwedOutputs(worker.heap)
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
        # The run table's hook also records the attempts of traced runs: the daemon's
        # Worker traces every run (topology.new_worker), for GetRunTrace.
        sched.on_task_event = self._runs.on_task_event
        sched.on_pumped = self._runs.on_pumped
        # A one-task run's submit does not wait for its task here: the handler records
        # the run first and then settles it, so the child's wake-up overlaps that work
        # (a waiting submit measured 110 against 122 µs per W6 fast-path run).
        sched.spins_first_submit = False
        if self._metrics is not None:  # gauges read at scrape time: heap, runs by state...
            self._metrics.watch_daemon(self._worker, self._runs.state_counts)
        self.start_ns = time.time_ns()

    def apply_config(self, config: DaemonConfig) -> None:
        """A reloaded configuration (SIGHUP, server/reload.py): limits and
        callables.allowed_modules apply to requests from now on; what was admitted,
        allocated or registered stays."""
        self._config = config
        self._limits = config.limits
        self._owners.reconfigure(config.limits)
        self._runs.reconfigure(config.limits)
        self._plan.reconfigure(config.limits, config.callables)

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
        code, details, trailer = self._refusal(method, exc)
        await context.abort(code, details, trailing_metadata=trailer)
        raise AssertionError("unreachable: context.abort returned")  # pragma: no cover

    def _refusal(
        self, method: str, exc: Exception
    ) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
        """How ``method`` refuses ``exc`` (counted, logged): its status code, details and
        trailing metadata (the field named, a retry-after hint)."""
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
        field = exc.field if isinstance(exc, RequestError) else ""
        # The field also travels on its own, so a client need not parse the details.
        shown = field and field.isascii() and field.isprintable()
        trailer: tuple[tuple[str, str], ...] = ((FIELD_METADATA, field),) if shown else ()
        retry_after = getattr(exc, "retry_after_ms", 0)  # runs.Backpressure: a limit for now
        if retry_after:
            trailer += ((RETRY_AFTER_METADATA, str(retry_after)),)
        return code, details, trailer

    def _defer(
        self, rec: Any, timeout: float | None, method: str, answer: Callable[[], Any]
    ) -> Deferred:
        """A fast-path call's answer owed when ``rec``'s run ends or after ``timeout``
        seconds: ``answer()`` builds the response then (server/fastpath.py writes it from
        the run's completion instead of waking a waiting handler). Counted as the
        decorators count a handler's outcome."""

        def finish() -> Any:
            response = answer()
            self._count(method, Code.OK)
            return response

        def refuse(exc: Exception) -> tuple[grpc.StatusCode, str, str]:
            code, details, trailer = self._refusal(method, exc)
            return code, details, dict(trailer).get(FIELD_METADATA, "")

        return Deferred(rec, timeout, finish, refuse)

    def _who(self, context: Any) -> Identity:
        """Who the call comes from, for ownership and quotas: what the kernel or the
        transport says (peer credentials, TLS identity, admin token), never a header."""
        if type(context) is FastContext:
            # Named once per connection: its credentials are the kernel's snapshot at
            # connect, so the answer only changes with the admin policy.
            cached = context.identity
            if cached is not None and cached[0] is self._admins:
                who: Identity = cached[1]
                return who
            who = identify(context, self._relay, self._admins)
            context.identity = (self._admins, who)
            return who
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

    def _took_status(self, rec: Any) -> None:
        """``rec``'s owner was just answered with its status (WaitRun, WatchRun): a
        finished run's final status is no longer owed to it (server/owed.py)."""
        if rec.terminal:
            self._owed.collected(rec.run_id)

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
