"""Run records: what the daemon knows about each run, its events, watchers and retention.

::

    RunTable.launch(rec, orch) --Worker.submit_async--> engine Run
         |                                                 | Scheduler callbacks (on the loop)
         |  RunRecord per run  <---------------------------+ on_task_event, Run listeners,
         |  (counts, state, watchers, terminal event)         done callbacks
         v
    runs / active / live / finished (bounded by limits.max_finished_runs_kept),
    idempotency keys (scoped per owner) -> run ids, per-owner active counts

Everything here runs on the daemon's one event loop, beside the Scheduler
coroutine. A bookkeeping bug is logged and never propagates into the Scheduler
(it would fail every run). The servicer (``service.py``) calls down into this
module; nothing here knows about gRPC handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Final

from google.protobuf.timestamp_pb2 import Timestamp

from simpler_daemon.args import CallConfig
from simpler_daemon.endpoints.base import Outcome
from simpler_daemon.errors import WorkerClosedError
from simpler_daemon.orchestrator import FailureInfo, Run, RunState, SlotState, TaskSlot
from simpler_daemon.server._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server.config import LimitsConfig
from simpler_daemon.server.metrics import Metrics
from simpler_daemon.server.plan import MAX_KEY
from simpler_daemon.server.status import InvalidArgument, LimitExceeded, NotFound, Precondition
from simpler_daemon.worker import RunHandle, Worker

__all__ = ["WATCH_QUEUE_LIMIT", "RunRecord", "RunTable", "Watcher", "fingerprint", "now_ts"]

log = logging.getLogger("simpler_daemon.service")

#: Events a watcher may fall behind by before it is sent a fresh snapshot instead.
WATCH_QUEUE_LIMIT: Final = 65_536
_TERMINAL: Final = frozenset({pb.RUN_STATE_COMPLETED, pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED})
#: Requests larger than this are fingerprinted on a thread (hashing megabytes stalls the loop).
_BIG_REQUEST: Final = 1 << 16


async def fingerprint(method: str, request: Any) -> bytes:
    """What an idempotency key stands for: a digest of the method and the request
    (the caller clears fields that only say how to answer, such as ``wait_seconds``)."""

    def digest() -> bytes:
        h = hashlib.sha256(method.encode())
        h.update(request.SerializeToString(deterministic=True))
        return h.digest()

    if request.ByteSize() > _BIG_REQUEST:
        return await asyncio.to_thread(digest)
    return digest()


def now_ts(ns: int | None = None) -> Timestamp:
    out = Timestamp()
    out.FromNanoseconds(time.time_ns() if ns is None else ns)
    return out


class Watcher:
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
        self.key_print = b""
        self._static_total = total is not None
        self.total = total or 0
        self._slots_seen = 0
        self.done = 0
        self.failed = 0
        self.running = 0
        self.seq = 0
        self.state: pb.RunState = pb.RUN_STATE_QUEUED
        self.watchers: set[Watcher] = set()
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
            submit_time=now_ts(self.submit_ns),
        )
        if out.state in (pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED):
            err = self.error_proto()
            if err is not None:
                out.error.CopyFrom(err)
        if self.finish_ns:
            out.finish_time.CopyFrom(now_ts(self.finish_ns))
        return out

    def snapshot(self) -> Any:
        self.state = self.proto_state()
        return pb.RunEvent(
            run_id=self.run_id,
            sequence=self.seq,
            type=pb.RUN_EVENT_TYPE_SNAPSHOT,
            counts=self.counts(),
            state=self.state,
            time=now_ts(),
        )

    async def events(self, after: int = 0) -> AsyncGenerator[Any, None]:
        """A WatchRun stream: a snapshot, then every event with a sequence above
        ``after``, ending with the terminal event (a lagging watcher gets a fresh
        snapshot instead of the events it missed)."""
        watcher = Watcher()
        self.watchers.add(watcher)
        try:
            yield self.snapshot()
            if self.terminal_event is not None:
                yield self.terminal_event
                return
            while True:
                await watcher.wake.wait()
                watcher.wake.clear()
                if watcher.lagged:
                    watcher.lagged = False
                    yield self.snapshot()
                while watcher.queue:
                    event = watcher.queue.popleft()
                    if event.sequence <= after:
                        continue
                    yield event
                    if event is self.terminal_event:
                        return
                if self.terminal_event is not None and not watcher.queue:
                    yield self.terminal_event  # lost in a lag: the stream still ends with it
                    return
        finally:
            self.watchers.discard(watcher)

    # -- events from the Scheduler (all on the loop) -----------------------------------

    def _event(self, etype: pb.RunEventType, **fields: Any) -> Any:
        self.seq += 1
        return pb.RunEvent(
            run_id=self.run_id,
            sequence=self.seq,
            type=etype,
            counts=self.counts(),
            state=self.state,
            time=now_ts(),
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


class RunTable:
    """Every run the daemon knows: active ones, live ones (bound to an engine Run and
    not finished) and the last ``limits.max_finished_runs_kept`` finished ones."""

    def __init__(self, worker: Worker, limits: LimitsConfig, metrics: Metrics | None) -> None:
        self._worker = worker
        self._limits = limits
        self._metrics = metrics
        self._runs: dict[int, RunRecord] = {}
        self._active: dict[int, RunRecord] = {}
        self._live: dict[int, RunRecord] = {}  # bound to an engine Run, not yet finished
        self._finished: OrderedDict[int, None] = OrderedDict()
        self._keys: dict[str, int] = {}
        self._key_prints: dict[str, bytes] = {}
        # Keys whose request is being planned / launched: a retry waits for it.
        self._pending_keys: dict[str, tuple[bytes, asyncio.Future[None]]] = {}
        self._client_runs: Counter[str] = Counter()
        self._drain_lock = asyncio.Lock()

    @property
    def active_count(self) -> int:
        return len(self._active)

    def new_record(self, *, label: str, client: str, key: str, total: int | None) -> RunRecord:
        return RunRecord(label=label, client=client, key=key, total=total, metrics=self._metrics)

    def record(self, run_id: int, field: str = "run_id") -> RunRecord:
        """The run's record; ``InvalidArgument`` for 0, ``NotFound`` for an unknown id."""
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

    @staticmethod
    def check_key(key: str) -> None:
        if len(key) > MAX_KEY:
            raise InvalidArgument("idempotency_key", f"{len(key)} characters, at most {MAX_KEY}")

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

    def check_capacity(self, client: str, what: str) -> None:
        """``LimitExceeded`` when the daemon is at limits.max_concurrent_runs or the
        client (``Identity.owner``) at its quota limits.per_client_runs."""
        limit = self._limits.max_concurrent_runs
        if len(self._active) >= limit:
            raise LimitExceeded(
                "",
                f"cannot {what}: {len(self._active)} runs are active "
                f"(limits.max_concurrent_runs = {limit})",
            )
        quota = self._limits.per_client_runs
        if self._client_runs[client] >= quota:
            raise LimitExceeded(
                "",
                f"cannot {what}: quota limits.per_client_runs ({quota}) reached: "
                f"{client} has {self._client_runs[client]} active runs",
            )

    # -- scheduler events ------------------------------------------------------------------

    def on_task_event(self, slot: TaskSlot, event: str, completion: Any) -> None:
        """The Scheduler's ``on_task_event`` hook: route to the run's record."""
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
            scoped = self._scoped(gone.client, gone.key) if gone is not None else ""
            if gone is not None and gone.key and self._keys.get(scoped) == old:
                del self._keys[scoped]
                self._key_prints.pop(scoped, None)

    # -- lifecycle -------------------------------------------------------------------------

    async def launch(
        self,
        rec: RunRecord,
        orch: Callable[..., Any],
        args: Any = None,
        config: CallConfig | None = None,
    ) -> int:
        """Submit ``orch`` as a run tracked by ``rec``; returns the run id.

        Raises ``Precondition`` when the Worker is closing.
        """
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
            scoped = self._scoped(rec.client, rec.key)
            self._keys[scoped] = run_id
            self._key_prints[scoped] = rec.key_print
        log.debug("run %d submitted by %s (%s)", run_id, rec.client, rec.label or "no label")
        return run_id

    def cancel(self, rec: RunRecord, reason: str) -> bool:
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

    @staticmethod
    async def wait(rec: RunRecord, timeout: float | None) -> Any:
        """The run's status once terminal or after ``timeout`` seconds."""
        if not rec.terminal and timeout != 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await rec.finished.wait()
        return rec.status()

    async def drain(self, grace: float, *, reason: str) -> tuple[int, int]:
        """Give the active runs ``grace`` seconds, cancel the rest; ``(finished, cancelled)``.

        The caller has already stopped admitting runs. The cancelled runs become
        terminal once their running tasks finish; watchers see them CANCELLED.
        """
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
                if not rec.terminal and self.cancel(rec, reason):
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
