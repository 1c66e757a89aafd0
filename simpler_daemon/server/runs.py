"""The run table: every run the daemon knows, its keys, queues, listing and counts.

::

    RunTable.launch(rec, orch) --Worker.submit_async--> engine Run
         |                                                 | Scheduler callbacks (on the loop)
         |  RunRecord per run  <---------------------------+ on_task_event, Run listeners,
         |  (counts, state, watchers, terminal event)         done callbacks
         v
    RunTable.launch past limits.per_client_runs: the run waits QUEUED in its client's
         queue (bounded by limits.per_client_queued_runs; its id reserved, its request
         validated and its buffers pinned already); _admit starts the oldest queued run
         of a client as one of its active runs ends (Cancel removes it, a drain cancels it)

    runs / active / live / finished (the finished runs kept within the retention
    limits are retention.py's FinishedRuns), task result bytes (limits.
    max_run_result_bytes per run), idempotency keys (scoped per owner) -> run ids,
    per-owner active counts, listing (ListRuns: newest first) and per-state counts
    (metrics)

Everything here runs on the daemon's one event loop, beside the Scheduler
coroutine. A bookkeeping bug is logged and never propagates into the Scheduler
(it would fail every run). The servicer (``service.py``) calls down into this
module; nothing here knows about gRPC handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Final

from simpler_daemon.args import CallConfig
from simpler_daemon.endpoints.base import Outcome
from simpler_daemon.engine.orchestrator import FailureInfo, Run, TaskSlot
from simpler_daemon.engine.runs import cancelled_error
from simpler_daemon.engine.worker import Worker
from simpler_daemon.errors import (
    InvalidField,
    LimitExceeded,
    Precondition,
    TaskError,
    UnknownObject,
    WorkerClosedError,
)
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.scheduler.completion import pumped_completion
from simpler_daemon.scheduler.runmodel import by_run
from simpler_daemon.server import oplog
from simpler_daemon.server.config import LimitsConfig, run_result_limit
from simpler_daemon.server.history import History
from simpler_daemon.server.metrics import Metrics
from simpler_daemon.server.plan import MAX_KEY
from simpler_daemon.server.retention import FinishedRuns
from simpler_daemon.server.run_record import (
    WATCH_QUEUE_LIMIT,
    RunRecord,
    Watcher,
    fingerprint,
    now_ts,
)

__all__ = [
    "LIST_RUNS_DEFAULT",
    "RETRY_AFTER_DEFAULT",
    "STATE_KEYS",
    "WATCH_QUEUE_LIMIT",
    "Backpressure",
    "RunRecord",
    "RunTable",
    "Watcher",
    "fingerprint",
    "now_ts",
]

log = logging.getLogger("simpler_daemon.service")

#: ListRuns answers at most this many runs when the request says 0.
LIST_RUNS_DEFAULT: Final = 100
#: The keys of :meth:`RunTable.state_counts` (metrics read them).
STATE_KEYS: Final = ("queued", "active", "completed", "failed", "cancelled", "lost")
#: The retry-after hint (seconds) of a refusal before any run has finished, and its bounds:
#: the hint is the recent mean run time, the time a slot typically takes to free up.
RETRY_AFTER_DEFAULT: Final = 0.5
_RETRY_AFTER_MIN: Final = 0.05
_RETRY_AFTER_MAX: Final = 10.0
_STATE_KEY: Final[dict[int, str]] = {
    pb.RUN_STATE_QUEUED: "queued",
    pb.RUN_STATE_BUILDING: "active",
    pb.RUN_STATE_PREPARED: "active",
    pb.RUN_STATE_EXECUTING: "active",
    pb.RUN_STATE_COMPLETED: "completed",
    pb.RUN_STATE_FAILED: "failed",
    pb.RUN_STATE_CANCELLED: "cancelled",
    pb.RUN_STATE_LOST: "lost",  # from the run history: active when its daemon stopped
}


def _any_result(slots: list[TaskSlot]) -> bool:
    """Whether a task of ``slots`` sent a value back (a loop: no generator frame)."""
    for slot in slots:  # noqa: SIM110
        if slot.result is not None:
            return True
    return False


class Backpressure(LimitExceeded):
    """A run limit reached for now (limits.per_client_queued_runs, max_concurrent_runs):
    RESOURCE_EXHAUSTED with ``retry_after`` (seconds), the daemon's hint of when a retry
    may succeed; the text ends with it too (``retry after 500 ms``), for either transport."""

    def __init__(self, message: str, retry_after: float) -> None:
        ms = max(1, round(retry_after * 1000))
        super().__init__("", f"{message}; retry after {ms} ms")
        self.retry_after_ms = ms


@dataclass(slots=True)
class _Queued:
    """A run waiting in its client's queue: what :meth:`RunTable.launch` submits when its
    turn comes, and ``on_start`` (called once it started or ended, e.g. to hand over pins)."""

    rec: RunRecord
    orch: Callable[..., Any]
    args: Any
    config: CallConfig | None
    on_start: Callable[[RunRecord], None] | None = None


class RunTable:
    """Every run the daemon knows: active ones, live ones (bound to an engine Run and
    not finished) and the last ``limits.max_finished_runs_kept`` finished ones."""

    def __init__(self, worker: Worker, limits: LimitsConfig, metrics: Metrics | None) -> None:
        self._worker = worker
        self._limits = limits
        self._metrics = metrics
        #: The run history (server/history.py; None: daemon.state_dir = ":memory:", or
        #: not restored yet): told of every run known, changed, finished and forgotten.
        self._history: History | None = None
        self._runs: dict[int, RunRecord] = {}
        self._active: dict[int, RunRecord] = {}
        self._live: dict[int, RunRecord] = {}  # bound to an engine Run, not yet finished
        # The finished runs kept (age, count, byte and result-byte limits), and evictions.
        self._retention = FinishedRuns(self._runs, limits, self._forget_key)
        self._highest_id = 0
        # Set by Resume: a drain in its grace period then cancels nothing.
        self._drain_aborted: asyncio.Event | None = None
        self._keys: dict[str, int] = {}
        self._key_prints: dict[str, bytes] = {}
        # Keys whose request is being planned / launched: a retry waits for it.
        self._pending_keys: dict[str, tuple[bytes, asyncio.Future[None]]] = {}
        self._client_runs: Counter[str] = Counter()
        # Runs waiting for one of their client's limits.per_client_runs slots, oldest
        # first, per client (a client has an entry while its queue is not empty).
        self._queues: dict[str, OrderedDict[int, _Queued]] = {}
        self._admitting: asyncio.Task[None] | None = None
        # Mean time of recent runs from start to end (seconds): the retry-after hint.
        self._run_seconds = RETRY_AFTER_DEFAULT
        self._started_ns: dict[int, int] = {}
        self._drain_lock = asyncio.Lock()

    def reconfigure(self, limits: LimitsConfig) -> None:
        """New run limits (SIGHUP) for runs submitted from now on; runs already
        admitted stay. limits.max_concurrent_runs is the daemon's gate here; the
        engine's fair admission keeps the bound it started with (runs beyond it wait
        QUEUED). Finished runs past the new retention limits are forgotten now; a
        higher limits.per_client_runs starts queued runs now."""
        self._limits = limits
        self._retention.reconfigure(limits)
        if self._queues:
            self._schedule_admission()

    @property
    def active_count(self) -> int:
        return len(self._active)

    @property
    def queued_count(self) -> int:
        """Runs waiting in the clients' queues (past limits.per_client_runs)."""
        return sum(len(q) for q in self._queues.values())

    def queued_of(self, client: str) -> list[int]:
        """``client``'s queued run ids, in the order they will start."""
        return list(self._queues.get(client, ()))

    def new_record(
        self, *, label: str, client: str, key: str, total: int | None, priority: int = 1
    ) -> RunRecord:
        return RunRecord(
            label=label,
            client=client,
            key=key,
            total=total,
            metrics=self._metrics,
            priority=priority,
        )

    def list_runs(
        self, owner: str | None, states: set[int], limit: int, before: int = 0
    ) -> list[RunRecord]:
        """Runs newest first: ``owner``'s (None: every client's), in ``states`` (empty:
        any), at most ``limit`` (0: LIST_RUNS_DEFAULT), with ids below ``before`` (0: any;
        the dashboard's next page). Finished runs past limits.max_finished_runs_kept are
        already forgotten."""
        limit = limit or LIST_RUNS_DEFAULT
        self._retention.expire()
        out: list[RunRecord] = []
        # Run ids grow with submission: the dict's reverse order is newest first.
        for rec in reversed(self._runs.values()):
            if before and rec.run_id >= before:
                continue
            if owner is not None and rec.client != owner:
                continue
            if states and rec.proto_state() not in states:
                continue
            out.append(rec)
            if len(out) >= limit:
                break
        return out

    def state_counts(self) -> dict[str, int]:
        """How many known runs are in each state: keys :data:`STATE_KEYS` ("active" =
        building, prepared or executing; finished runs as far as they are kept)."""
        counts = dict.fromkeys(STATE_KEYS, 0)
        for rec in self._runs.values():
            counts[_STATE_KEY.get(rec.proto_state(), "queued")] += 1
        return counts

    def restore(self, history: History) -> None:
        """Record into ``history`` from now on; know the runs it kept (finished or LOST)
        within today's retention limits (the rest it forgets too). Before any launch."""
        stored, history.stored = history.stored, []
        history.metrics = self._metrics
        history.start()
        for row in stored:  # self._history is still None: restoring rewrites nothing
            rec = RunRecord.restored(row, self._metrics)
            self._add(rec)
            self._remember_finished(rec)
        self._history = self._retention.history = history
        for row in stored:
            if row.run_id not in self._runs:
                history.forget(row.run_id)
        # Every id below the history's next one may have been given out before.
        self._highest_id = max(self._highest_id, history.run_ids.next_id - 1)
        history.restored(len(self._runs))

    def record(self, run_id: int, field: str = "run_id") -> RunRecord:
        """The run's record; ``InvalidField`` for 0, ``UnknownObject`` for an unknown id
        (evicted: an id up to the highest given out; ``UnrecordedRun``: handed out by a
        killed daemon that never recorded it)."""
        if run_id == 0:
            raise InvalidField(field, "required (run ids start at 1)")
        self._retention.expire()
        rec = self._runs.get(run_id)
        if rec is None:
            lost = self._history.unrecorded(run_id, field) if self._history else None
            if lost is not None:
                raise lost
            if 0 < run_id <= self._highest_id:
                why = self._retention.eviction_reason(run_id)
                raise UnknownObject(
                    field, f"run {run_id} finished and was evicted ({why}): its status is gone"
                )
            raise UnknownObject(field, f"run {run_id} is unknown (never submitted)")
        return rec

    @staticmethod
    def check_key(key: str) -> None:
        if len(key) > MAX_KEY:
            raise InvalidField("idempotency_key", f"{len(key)} characters, at most {MAX_KEY}")

    def _reused(self, key: str, what: str) -> Precondition:
        return Precondition(
            "idempotency_key",
            f"cannot reuse idempotency key {key!r}: it already names {what} with a "
            "different request (a key stands for one request; use a new key)",
        )

    @staticmethod
    def _scoped(owner: str, key: str) -> str:
        """Keys are scoped per owner: another client's key never names this one's run."""
        return f"{owner}\n{key}"

    @contextlib.asynccontextmanager
    async def claim_key(self, owner: str, key: str, key_print: bytes) -> AsyncIterator[int | None]:
        """Yields the run ``owner``'s ``key`` already started (a retry: answer with it) or
        None (the caller starts the run; :meth:`launch` records the key with ``key_print``).

        While a caller holds a new key, a retry with it waits for that run to be
        launched instead of starting a second one. ``Precondition`` naming the key
        when it already stands for a different request (``key_print`` differs).
        """
        if not key:
            yield None
            return
        self.check_key(key)
        shown, key = key, self._scoped(owner, key)
        while (pending := self._pending_keys.get(key)) is not None:
            if pending[0] != key_print:
                raise self._reused(shown, "a run being submitted")
            await asyncio.shield(pending[1])
        run_id = self._keys.get(key)
        if run_id is not None and run_id in self._runs:
            if self._key_prints.get(key) != key_print:
                raise self._reused(shown, f"run {run_id}")
            yield run_id
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending_keys[key] = (key_print, done)
        try:
            yield None
        finally:
            del self._pending_keys[key]
            done.set_result(None)

    def claim_now(self, owner: str, key: str, key_print: bytes) -> int | Callable[[], None] | None:
        """:meth:`claim_key` without a context manager or a wait (the caller has
        checked the key with :meth:`check_key`).

        Returns the run ``owner``'s ``key`` already names (a retry: answer with it), or
        what releases the claim of a new key (the caller starts the run, then calls it
        whatever happened), or None when another request holds the key now (the caller
        then waits in :meth:`claim_key`). ``Precondition`` as :meth:`claim_key`.
        """
        shown, scoped = key, self._scoped(owner, key)
        if scoped in self._pending_keys:
            return None
        run_id = self._keys.get(scoped)
        if run_id is not None and run_id in self._runs:
            if self._key_prints.get(scoped) != key_print:
                raise self._reused(shown, f"run {run_id}")
            return run_id
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        pending = self._pending_keys
        pending[scoped] = (key_print, done)

        def release() -> None:
            del pending[scoped]
            done.set_result(None)

        return release

    def _must_queue(self, client: str) -> bool:
        """Whether a new run of ``client`` waits: it is at limits.per_client_runs or has
        runs waiting already (a new run never overtakes them)."""
        return (
            client in self._queues
            or self._client_runs.get(client, 0) >= self._limits.per_client_runs
        )

    def _retry_after(self) -> float:
        return min(max(self._run_seconds, _RETRY_AFTER_MIN), _RETRY_AFTER_MAX)

    def check_capacity(self, client: str, what: str) -> None:
        """``Backpressure`` (RESOURCE_EXHAUSTED with a retry-after hint) when the client
        (``Identity.owner``) must queue the run and its queue holds
        limits.per_client_queued_runs already, or the run would start now and the daemon
        is at limits.max_concurrent_runs."""
        if self._must_queue(client):
            limit = self._limits.per_client_queued_runs
            queued = len(self._queues.get(client, ()))
            if queued >= limit:
                raise Backpressure(
                    f"cannot {what}: queue full (limits.per_client_queued_runs = {limit}): "
                    f"{client} has {self._client_runs[client]} active runs (limits."
                    f"per_client_runs = {self._limits.per_client_runs}) and {queued} queued",
                    self._retry_after(),
                )
            return
        limit = self._limits.max_concurrent_runs
        if len(self._active) >= limit:
            raise Backpressure(
                f"cannot {what}: {len(self._active)} runs are active "
                f"(limits.max_concurrent_runs = {limit})",
                self._retry_after(),
            )

    # -- scheduler events ------------------------------------------------------------------

    def on_task_event(self, slot: TaskSlot, event: str, completion: Any) -> None:
        """The Scheduler's ``on_task_event`` hook: a returned value accounted against the
        run's limit (a task past it fails), then the attempt into the run's trace (what
        ``scheduler.trace.traced`` does, without a call around this one: it runs twice
        per task), then to the run's record."""
        rec = self._live.get(slot.run_id)
        try:
            if (
                rec is not None
                and event == "completed"
                and completion is not None
                and slot.result is not None
            ):
                # First: past the run's limit the task fails, and its trace says so.
                rec.keep_result(slot, completion, run_result_limit(self._limits))
        except Exception:  # never into the Scheduler: it would fail every run
            log.exception("run %d: event bookkeeping failed", slot.run_id)
        trace = slot.run.trace
        if trace is not None:
            trace.on_event(slot, event, completion)
        if rec is None:
            return
        try:
            rec.on_task_event(slot, event, completion)
            if (
                event == "completed"
                and completion is not None
                and completion.outcome in (Outcome.TASK_FAILURE, Outcome.ENDPOINT_FAILURE)
            ):
                self._log_task_failure(rec, slot, completion)
        except Exception:  # never into the Scheduler: it would fail every run
            log.exception("run %d: event bookkeeping failed", slot.run_id)

    def on_pumped(self, slots: list[TaskSlot], event: str, worker_id: int) -> None:
        """The Scheduler's ``on_pumped`` hook: ``on_task_event`` for a batch of the C
        pump's (published, or completed with SUCCESS on SUB lane ``worker_id``), one call
        per run of the batch for its trace and for its record. A completed batch with a
        result among it takes the per-task path (the result's size is accounted)."""
        live = self._live
        for group in by_run(slots):
            if event == "completed" and _any_result(group):
                for slot in group:
                    self.on_task_event(slot, event, pumped_completion(slot, worker_id))
                continue
            run = group[0].run
            trace = run.trace
            if trace is not None and event == "completed":  # a dispatch: nothing to note
                trace.on_pumped(group, worker_id)
            rec = live.get(run.run_id)
            if rec is not None:
                try:
                    rec.on_pumped(group, event, worker_id)
                except Exception:  # never into the Scheduler: it would fail every run
                    log.exception("run %d: event bookkeeping failed", run.run_id)

    def _log_task_failure(self, rec: RunRecord, slot: TaskSlot, completion: Any) -> None:
        kind = completion.worker_type.value  # "sub" / "next_level"
        worker = f"{kind.replace('_', '-')} worker {completion.worker_id}"
        pid: int | None = None
        if completion.outcome is Outcome.TASK_FAILURE:
            # The child raised and lives on: its pid is still the one that ran the task
            # (after an ENDPOINT_FAILURE it was replaced; the message names the old one).
            for row in self._worker.list_workers():
                if row.get("worker_id") == completion.worker_id and kind in str(
                    row.get("kind", "")
                ):
                    pid = row.get("pid") or None
                    break
        lines = (completion.message or "").strip().splitlines()
        oplog.task_failed(
            rec.run_id,
            slot.index,
            worker,
            pid,
            slot.hashid or "",
            lines[-1] if lines else "",  # a traceback's last line says what was raised
            completion.outcome,
        )

    @staticmethod
    def _log_finished(rec: RunRecord) -> None:
        if rec.state == pb.RUN_STATE_COMPLETED and not oplog.log.isEnabledFor(logging.DEBUG):
            return  # oplog logs a completed run at DEBUG: skip building the line
        event = rec.terminal_event
        oplog.run_finished(
            rec.run_id,
            rec.client,
            rec.label,
            pb.RunState.Name(rec.state),
            event.message if event is not None else "",
        )

    def _bound(self, rec: RunRecord) -> None:
        self._live[rec.run_id] = rec
        if self._history is not None:
            self._history.submitted(rec)

    def _run_finished(self, rec: RunRecord) -> None:
        self._log_finished(rec)
        self._active.pop(rec.run_id, None)
        self._live.pop(rec.run_id, None)
        n = self._client_runs[rec.client] - 1
        if n > 0:
            self._client_runs[rec.client] = n
        else:
            self._client_runs.pop(rec.client, None)
        started = self._started_ns.pop(rec.run_id, None)
        if started is not None and rec.finish_ns > started:
            seconds = (rec.finish_ns - started) / 1e9
            self._run_seconds += (seconds - self._run_seconds) / 8  # the recent runs' mean
        self._remember_finished(rec)
        if self._queues:
            self._schedule_admission()

    def _unstarted_finished(self, rec: RunRecord) -> None:
        """A queued run ended before it started (cancelled, or refused at its turn)."""
        self._log_finished(rec)
        self._remember_finished(rec)

    def _remember_finished(self, rec: RunRecord) -> None:
        self._live.pop(rec.run_id, None)
        self._retention.remember(rec)

    def _forget_key(self, gone: RunRecord) -> None:
        """An evicted run's idempotency key names no run any more."""
        scoped = self._scoped(gone.client, gone.key)
        if gone.key and self._keys.get(scoped) == gone.run_id:
            del self._keys[scoped]
            self._key_prints.pop(scoped, None)

    # -- lifecycle -------------------------------------------------------------------------

    async def launch(
        self,
        rec: RunRecord,
        orch: Callable[..., Any],
        args: Any = None,
        config: CallConfig | None = None,
        on_start: Callable[[RunRecord], None] | None = None,
    ) -> int:
        """Submit ``orch`` as a run tracked by ``rec``; returns the run id.

        Past the client's limits.per_client_runs the run waits QUEUED in its client's
        queue instead (its id taken now); ``on_start`` is called once it started or
        ended without starting (at once for a run that starts now). The caller checked
        :meth:`check_capacity`. Raises ``Precondition`` when the Worker is closing.
        """
        if self._must_queue(rec.client):
            return self._enqueue(_Queued(rec, orch, args, config, on_start))
        run_id = await self._start(rec, orch, args, config)
        if on_start is not None:
            on_start(rec)
        return run_id

    def _enqueue(self, item: _Queued) -> int:
        rec = item.rec
        rec.run_id = Run.reserve_id()
        rec.on_finished = self._unstarted_finished
        queue = self._queues.setdefault(rec.client, OrderedDict())
        queue[rec.run_id] = item
        self._add(rec)
        if self._metrics is not None:
            self._metrics.set_runs_queued(rec.client, len(queue))
        log.debug(
            "run %d of %s queued: %d active runs (limits.per_client_runs = %d), %d queued",
            rec.run_id,
            rec.client,
            self._client_runs[rec.client],
            self._limits.per_client_runs,
            len(queue),
        )
        return rec.run_id

    def _add(self, rec: RunRecord) -> None:
        """Know ``rec`` (and its idempotency key) from now on."""
        run_id = rec.run_id
        self._runs[run_id] = rec
        self._highest_id = max(self._highest_id, run_id)
        if rec.key:
            scoped = self._scoped(rec.client, rec.key)
            self._keys[scoped] = run_id
            self._key_prints[scoped] = rec.key_print
        # A queued run is recorded QUEUED from now on (a started one was, when bound).
        if self._history is not None and rec.run is None:
            self._history.submitted(rec)

    async def _start(
        self,
        rec: RunRecord,
        orch: Callable[..., Any],
        args: Any,
        config: CallConfig | None,
        run_id: int | None = None,
    ) -> int:
        """Hand the run to the Worker (``run_id``: the one a queued run reserved)."""
        rec.on_bind = self._bound
        try:
            # Never suspends: the run is queued (and, when admitted, built) right here.
            handle = await self._worker.submit_async(
                orch, args, config, priority=rec.priority, client=rec.client, run_id=run_id
            )
        except WorkerClosedError as exc:
            raise Precondition("", str(exc)) from exc
        if not handle.run.terminal:  # a terminal run's record keeps a status, not the run
            rec.handle = handle
        rec.bind(handle.run)
        run_id = rec.run_id
        if run_id not in self._runs:  # a queued run is known already
            self._add(rec)
        if rec.terminal:  # finished while it was submitted (its orchestration failed at once)
            self._log_finished(rec)
            self._remember_finished(rec)
        else:
            self._active[run_id] = rec
            runs = self._client_runs  # ``+= 1`` of a new key: Counter.__missing__, Python
            runs[rec.client] = runs.get(rec.client, 0) + 1
            self._started_ns[run_id] = time.time_ns()
            rec.on_finished = self._run_finished
        if log.isEnabledFor(logging.DEBUG):  # one call per run, not Logger.debug's two
            log.debug("run %d started for %s (%s)", run_id, rec.client, rec.label or "no label")
        return run_id

    # -- the clients' queues ---------------------------------------------------------------

    def _schedule_admission(self) -> None:
        """Start queued runs soon (on the loop, outside the Scheduler's callbacks)."""
        if self._admitting is None or self._admitting.done():
            self._admitting = asyncio.get_running_loop().create_task(self._admit())

    async def _admit(self) -> None:
        """Start the oldest queued runs of every client that has a free
        limits.per_client_runs slot (and the daemon one of limits.max_concurrent_runs)."""
        for client in list(self._queues):
            queue = self._queues.get(client)
            if queue is None:
                continue
            while (
                queue
                and self._client_runs.get(client, 0) < self._limits.per_client_runs
                and len(self._active) < self._limits.max_concurrent_runs
            ):
                _, item = queue.popitem(last=False)
                await self._start_queued(item)
            if not queue:
                del self._queues[client]
            if self._metrics is not None:
                self._metrics.set_runs_queued(client, len(queue))

    async def _start_queued(self, item: _Queued) -> None:
        rec = item.rec
        rec.on_finished = None  # _start sets the started run's own
        try:
            await self._start(rec, item.orch, item.args, item.config, rec.run_id)
        except Exception as exc:  # the daemon is closing: the run ends, it never started
            why = str(exc)
            rec.on_finished = self._unstarted_finished
            error = TaskError(
                f"run {rec.run_id} could not start after waiting in its queue: {why}",
                run_id=rec.run_id,
                outcome="SKIPPED",
                remote_text=str(why),
            )
            rec.end_unstarted(error, cancelled=False)
        log.debug("run %d of %s left its queue", rec.run_id, rec.client)
        if item.on_start is not None:
            try:
                item.on_start(rec)
            except Exception:  # a task of its own: nobody would see it raise
                log.exception("run %d: handing over its pins failed", rec.run_id)

    def _dequeue(self, rec: RunRecord) -> _Queued | None:
        queue = self._queues.get(rec.client)
        item = None if queue is None else queue.pop(rec.run_id, None)
        if queue is not None and not queue:
            del self._queues[rec.client]
        if item is not None and self._metrics is not None:
            self._metrics.set_runs_queued(rec.client, len(queue or ()))
        return item

    def _cancel_queued(self, rec: RunRecord, reason: str, by: str) -> bool:
        """Cancel a run still waiting in its queue: it ends CANCELLED without starting."""
        item = self._dequeue(rec)
        if item is None:
            return False
        rec.cancel_requested = True
        rec.cancel_reason = reason
        rec.end_unstarted(cancelled_error(rec.run_id, reason), cancelled=True)
        oplog.run_cancelled(rec.run_id, by, reason, False)
        if item.on_start is not None:
            item.on_start(rec)
        return True

    def cancel(
        self, rec: RunRecord, reason: str, *, terminate: bool = False, by: str = "daemon"
    ) -> bool:
        """Cancel a run that is not terminal; False when it already was. ``terminate``
        also stops its running tasks (their workers are killed and replaced); ``by``:
        who asked (the operator log names them). A queued run leaves its queue and ends
        CANCELLED at once."""
        run = rec.run
        if run is None and not rec.terminal:
            return self._cancel_queued(rec, reason, by)
        if rec.terminal or run is None or run.terminal:
            return False
        if not rec.cancel_requested:
            rec.cancel_requested = True
            rec.cancel_reason = reason
            rec.error_before_cancel = run.error is not None
            if run.error is None:
                text = f"run cancelled: {reason}" if reason else "run cancelled"
                run.record_error(None, FailureInfo(Outcome.SKIPPED, text))
        self._worker.cancel(run, terminate=terminate, reason=reason)
        oplog.run_cancelled(rec.run_id, by, reason, terminate)
        return True

    async def wait(
        self, rec: RunRecord, timeout: float | None, *, include_results: bool = False
    ) -> Any:
        """The run's status once terminal or after ``timeout`` seconds (with the task
        results when asked for and the run is terminal)."""
        if not rec.terminal and timeout != 0:
            await rec.wait_finished(timeout)
        return self.status(rec, include_results)

    def status(self, rec: RunRecord, include_results: bool = False, out: Any = None) -> Any:
        """The run's status now (with the task results when asked for and the run is
        terminal; ``LimitExceeded`` when they would not fit in limits.max_message_bytes),
        filled into ``out`` when given (see ``RunRecord.status``)."""
        return rec.status(include_results, self._limits.max_message_bytes, out)

    def abort_drain(self) -> bool:
        """Resume: a drain still in its grace period cancels nothing at its end (the
        daemon serves again). True when there was one."""
        aborted = self._drain_aborted
        if aborted is None or aborted.is_set():
            return False
        aborted.set()
        return True

    async def drain(self, grace: float, *, reason: str) -> tuple[int, int]:
        """Give the active runs ``grace`` seconds, cancel the rest; ``(finished, cancelled)``.

        The caller has already stopped admitting runs. The cancelled runs become
        terminal once their running tasks finish; watchers see them CANCELLED. A
        :meth:`abort_drain` (Resume) during the grace ends it at once, cancelling
        nothing: ``finished`` then counts the runs that had finished by then. Runs
        still waiting in a client's queue are cancelled at once (counted in
        ``cancelled``): they never started, and the drain admits no run.
        """
        async with self._drain_lock:
            queued = [item.rec for queue in self._queues.values() for item in queue.values()]
            for rec in queued:
                self._cancel_queued(rec, f"{reason}: the run was still queued", "drain")
            if queued:
                log.warning("drain: cancelled %d queued runs that never started", len(queued))
            active = list(self._active.values())
            aborted = self._drain_aborted = asyncio.Event()
            if active:
                log.info("draining: %d active runs get %.1fs to finish", len(active), grace)
                waits = [asyncio.ensure_future(r.finished.wait()) for r in active]
                every: asyncio.Future[Any] = asyncio.gather(*waits)
                resumed: asyncio.Future[Any] = asyncio.ensure_future(aborted.wait())
                try:
                    await asyncio.wait(
                        [every, resumed], timeout=grace, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    for t in (*waits, resumed):
                        t.cancel()
                    await asyncio.gather(every, resumed, return_exceptions=True)
            self._drain_aborted = None
            if aborted.is_set():
                finished = sum(1 for rec in active if rec.terminal)
                log.info(
                    "drain: resumed during the grace period; %d runs left running",
                    len(active) - finished,
                )
                return finished, len(queued)
            cancelled = 0
            for rec in active:
                if not rec.terminal and self.cancel(rec, reason, by="drain"):
                    cancelled += 1
            if cancelled:
                log.warning(
                    "drain: cancelled %d runs that did not finish in %.1fs", cancelled, grace
                )
            return len(active) - cancelled, cancelled + len(queued)

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
