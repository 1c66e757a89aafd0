"""One run as the daemon knows it: identity, counts, state, events and watchers.

A :class:`RunRecord` is bound to the engine's ``Run`` and driven by the Scheduler's
callbacks, all on the daemon's event loop; it answers RunStatus, RunSummary and
WatchRun streams. :mod:`simpler_daemon.server.runs` keeps the table of records.

Once the run is terminal the record keeps a small status only (state, counts, error,
times, the encoded task results while they are kept) and lets go of the engine's
``Run`` (``Run.release``: its task slots, args and dependency map), so a finished run
costs the daemon about :data:`STATUS_BYTES` whatever its size.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any, Final

from simpler_daemon.endpoints.base import Outcome
from simpler_daemon.engine.orchestrator import FailureInfo, Run, RunState, SlotState, TaskSlot
from simpler_daemon.engine.worker import RunHandle
from simpler_daemon.errors import LimitExceeded, Precondition, TaskError
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.scheduler.trace import RunTrace
from simpler_daemon.server.history import StoredRun
from simpler_daemon.server.keys import fingerprint
from simpler_daemon.server.metrics import Metrics
from simpler_daemon.server.run_events import TERMINAL_STATES, RunEvents, now_ts

__all__ = [
    "RESULT_FRAMING",
    "STATUS_BYTES",
    "WATCH_QUEUE_LIMIT",
    "RunRecord",
    "Watcher",
    "fingerprint",
    "now_ts",
]

log = logging.getLogger("simpler_daemon.service")

#: Events a watcher may fall behind by before it is sent a fresh snapshot instead.
WATCH_QUEUE_LIMIT: Final = 65_536
#: States whose RunStatus carries the run's error.
_WITH_ERROR: Final = frozenset({pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED, pb.RUN_STATE_LOST})
#: Room in a response for what surrounds the results (the RunStatus itself).
_STATUS_OVERHEAD: Final = 4096
#: Bytes one TaskResult adds to a reply beside its value (indexes, tags, lengths).
RESULT_FRAMING: Final = 16
#: Bytes one result kept by a finished run costs in memory beside its value and its
#: RESULT_FRAMING: the (task, member, bytes) tuple, the bytes and int objects, the list
#: slot (sys.getsizeof: 64 + 33 + 28 + 8), for limits.max_finished_result_bytes.
RESULT_KEPT_OVERHEAD: Final = 120
#: What a finished run's record holds beside its strings (the record, its event, its
#: terminal RunEvent, timestamps), measured with tracemalloc (tests/server/test_daemon_memory.py):
#: the unit of limits.max_finished_run_bytes.
STATUS_BYTES: Final = 2048


def _time_up(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


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


class RunRecord(RunEvents):
    """What the daemon knows about one run: identity, counts, state, watchers.

    Counts are per task *call* (a group counts one per member), driven by the
    Scheduler's events (``run_events.py``): ``dispatched`` (+running), ``completed``
    (-running, +done or +failed), ``retried`` (-running, +retried), and a slot that
    fails without being dispatched (+failed per member).
    """

    # Slotted: the daemon keeps up to limits.max_finished_runs_kept of them.
    __slots__ = (
        "_error",
        "_error_pb",
        "_finished",
        "_metrics",
        "_on_end",
        "_results",
        "_slots_seen",
        "_static_total",
        "_terminal_event",
        "_terminal_message",
        "_waiters",
        "_was_cancelled",
        "cancel_reason",
        "cancel_requested",
        "client",
        "error_before_cancel",
        "error_task_index",
        "finish_ns",
        "handle",
        "key",
        "key_print",
        "label",
        "on_bind",
        "on_finished",
        "priority",
        "result_bytes",
        "results_dropped",
        "run",
        "run_id",
        "status_bytes",
        "submit_ns",
        "terminal",
        "total",
        "trace",
        "watchers",
    )

    def __init__(
        self,
        *,
        label: str,
        client: str,
        key: str,
        total: int | None,
        metrics: Metrics | None,
        priority: int = 1,
    ) -> None:
        self.run_id = 0
        self.run: Run | None = None
        self.handle: RunHandle | None = None
        #: The run's task attempts (``scheduler/trace.py``), kept after the Run is let go.
        self.trace: RunTrace | None = None
        self.label = label
        self.client = client
        self.priority = priority
        self.key = key
        self.key_print = b""
        self._static_total = total is not None
        self.total = total or 0
        self._slots_seen = 0
        super().__init__()  # the counts, seq and state (run_events.py)
        self.watchers: set[Watcher] = set()
        self.submit_ns = time.time_ns()
        self.finish_ns = 0
        self.cancel_requested = False
        self.cancel_reason = ""
        self.error_before_cancel = False
        self.error_task_index: int | None = None
        #: Whether the run ended (a plain attribute: read several times per run); the
        #: terminal RunEvent is built on first use (terminal_event): most runs are
        #: never watched.
        self.terminal = False
        self._terminal_event: Any = None
        self._terminal_message = ""
        #: Set at terminal; made when first asked for (``finished``): a drain waits on
        #: it, nothing on a run's own path does.
        self._finished: asyncio.Event | None = None
        # Futures of wait_finished() calls (None while nobody waits): resolved at terminal.
        self._waiters: list[asyncio.Future[None]] | None = None
        # Callbacks of when_finished() (None while there are none): called at terminal,
        # after the table's own bookkeeping (on_finished).
        self._on_end: list[Callable[[], None]] | None = None
        self.on_finished: Callable[[RunRecord], None] | None = None
        self.on_bind: Callable[[RunRecord], None] | None = None
        self._metrics = metrics
        #: Bytes of task results this run keeps (each counted as in one WaitRun reply).
        self.result_bytes = 0
        #: Why the results were dropped (limits.max_finished_result_bytes), "" while kept.
        self.results_dropped = ""
        # Kept from the run when it turns terminal (the engine's Run is released then).
        self._error: TaskError | None = None
        # The error as recorded in the run history (a run from before a restart).
        self._error_pb: Any = None
        self._was_cancelled = False
        self._results: list[tuple[int, int | None, bytes]] = []
        #: Bytes this finished run's status is counted for (limits.max_finished_run_bytes).
        self.status_bytes = 0

    # -- the run history (server/history.py) -------------------------------------------

    @classmethod
    def restored(cls, row: StoredRun, metrics: Metrics | None) -> RunRecord:
        """A finished run of an earlier daemon process, from the run history (a run that
        was active when that daemon stopped comes back LOST)."""
        rec = cls(
            label=row.label,
            client=row.client,
            key=row.key,
            total=row.total,
            metrics=metrics,
            priority=row.priority,
        )
        rec.run_id = row.run_id
        rec.key_print = row.key_print
        rec.done = row.done
        rec.failed = row.failed
        rec.running = 0
        rec.seq = row.seq
        rec.state = row.state  # type: ignore[assignment]
        rec.submit_ns = row.submit_ns
        rec.finish_ns = row.finish_ns
        rec._terminal_message = row.message
        rec.terminal = True
        rec._was_cancelled = row.state == pb.RUN_STATE_CANCELLED
        text = 0
        if row.error is not None:
            rec._error_pb = pb.RunError.FromString(row.error)
            text = len(rec._error_pb.message) + len(rec._error_pb.remote_text)
            if rec._error_pb.HasField("task_index"):
                rec.error_task_index = rec._error_pb.task_index
        if row.results:
            rec._results = [(t, m, bytes(v)) for t, m, v in row.results]
            rec.result_bytes = sum(
                len(v) + RESULT_FRAMING + RESULT_KEPT_OVERHEAD for _, _, v in rec._results
            )
        rec.results_dropped = row.results_dropped
        rec.status_bytes = (
            STATUS_BYTES + len(rec.label) + len(rec.key) + len(rec.client) + len(row.message) + text
        )
        return rec

    def history_row(self, pid: int) -> tuple[Any, ...]:
        """What the run history records of this run now (a ``StoredRun``'s fields, the
        results still a list, then the time and the daemon's ``pid``); on the loop."""
        final = self.terminal
        state = self.state if final else self.proto_state()
        err = self.error_proto() if final else None
        self._sync_total()  # the counts as counts() has them, without building a message
        return (
            self.run_id,
            self.client,
            self.label,
            self.key,
            self.key_print,
            self.priority,
            int(state),
            max(self.total, 0),
            max(self.done, 0),
            max(self.failed, 0),
            max(self.running, 0),
            self.submit_ns,
            self.finish_ns,
            self.seq,
            self._terminal_message,
            None if err is None else err.SerializeToString(),
            self._results if final and self._results else None,
            self.results_dropped,
            time.time_ns(),
            pid,
        )

    # -- binding ---------------------------------------------------------------------

    def bind(self, run: Run) -> None:
        """Attach to the engine's Run (idempotent); called from the orchestration
        function, before any task of the run can be dispatched."""
        if self.run is not None or self.terminal:
            return
        self.run = run
        self.run_id = run.run_id
        self.trace = run.trace
        if self.on_bind is not None:
            self.on_bind(self)
        run.listeners.append(self._on_slot)  # guards itself: it runs once per failed task
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
    def terminal_event(self) -> Any:
        """The run's terminal RUN_STATE event (its final state, counts and message; None
        while the run is not terminal), built on first use."""
        event = self._terminal_event
        if event is None and self.terminal:
            event = self._terminal_event = pb.RunEvent(
                run_id=self.run_id,
                sequence=self.seq,  # the terminal event is the run's last
                type=pb.RUN_EVENT_TYPE_RUN_STATE,
                counts=self.counts(),
                state=self.state,
                time=now_ts(self.finish_ns),
                message=self._terminal_message,
            )
        return event

    def settle(self) -> bool:
        """Before a wait for the run's end: a run alone in the engine with quick tasks
        ends in this call (``RunHandle.settle``). True when this record is terminal
        (its run's end recorded, its answers owed written)."""
        if not self.terminal and self.handle is not None:
            self.handle.settle()
        return self.terminal

    async def wait_finished(self, timeout: float | None) -> None:
        """Return once the run is terminal or ``timeout`` seconds (None: no limit) passed.

        What ``asyncio.timeout`` around ``finished.wait()`` does, at a third of the cost
        (one future and one timer handle, no Timeout object or task bookkeeping): it is
        on the path of every SubmitRun that waits."""
        if self.terminal or self.settle():
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        timer = None if timeout is None else loop.call_later(timeout, _time_up, waiter)
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            waiters = self._waiters
            if waiters is not None:  # timed out or cancelled before the run ended
                waiters.remove(waiter)

    @property
    def finished(self) -> asyncio.Event:
        """An Event set once the run is terminal (set already when it is)."""
        event = self._finished
        if event is None:
            event = self._finished = asyncio.Event()
            if self.terminal:
                event.set()
        return event

    def when_finished(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` once the run is terminal (after the run table's own
        bookkeeping: a reply with results sees what the finished run keeps), from the
        loop's turn that ends the run: the fast path writes a waiting call's reply from
        there, without waking a handler. The run must not be terminal yet. Returns what
        removes the callback (a call cancelled or expired)."""
        assert not self.terminal, "when_finished on a terminal run"
        if self._on_end is None:
            self._on_end = []
        callbacks = self._on_end
        callbacks.append(callback)

        def remove() -> None:
            try:  # not contextlib.suppress: three Python calls, on every answered run
                callbacks.remove(callback)
            except ValueError:
                pass

        return remove

    # -- state -----------------------------------------------------------------------

    def proto_state(self) -> pb.RunState:
        run = self.run
        if self.terminal:
            return self.state  # the final state, set when the run ended
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
        if run is None and self.terminal:
            return self._was_cancelled
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
            retried=self.retried,
        )

    def error_proto(self) -> Any:
        if self._error_pb is not None:
            return self._error_pb
        run = self.run
        err = run.error if run is not None else self._error
        if err is None:
            return None
        cancelled = self.proto_state() == pb.RUN_STATE_CANCELLED
        out = pb.RunError(
            message=str(err),
            hashid=err.hashid or "",
            dispatch_id=err.dispatch_id or 0,
            outcome="CANCELLED" if cancelled else err.outcome,
            remote_text=err.remote_text,
            attempts=err.attempts,
            attempt_causes=err.attempt_causes,
        )
        if err.worker_id is not None:
            out.worker_id = err.worker_id
        if self.error_task_index is not None:
            out.task_index = self.error_task_index
        return out

    def status(self, include_results: bool = False, max_bytes: int = 0, out: Any = None) -> Any:
        """The RunStatus (filled into ``out``, an empty RunStatus such as a response's
        field, when given); with ``include_results`` and a terminal run, the SUB tasks'
        return values too (``LimitExceeded`` naming ``include_results`` when they would
        not fit in ``max_bytes``, the daemon's message limit).

        Set field by field: on every answered run's path, where building it from
        messages (a RunCounts and Timestamps, each copied in) cost several times more."""
        if out is None:
            out = pb.RunStatus()
        state = self.proto_state()
        out.run_id = self.run_id
        out.state = state
        self._sync_total()
        counts = out.counts
        counts.SetInParent()
        counts.total = max(self.total, 0)
        counts.done = max(self.done, 0)
        counts.failed = max(self.failed, 0)
        counts.running = max(self.running, 0)
        if self.retried:
            counts.retried = self.retried
        out.label = self.label
        stamp = out.submit_time
        stamp.seconds, stamp.nanos = divmod(self.submit_ns, 1_000_000_000)
        out.client = self.client
        out.priority = self.priority
        if state in _WITH_ERROR:
            err = self.error_proto()
            if err is not None:
                out.error.CopyFrom(err)
        if self.finish_ns:
            stamp = out.finish_time
            stamp.seconds, stamp.nanos = divmod(self.finish_ns, 1_000_000_000)
        if include_results and state in TERMINAL_STATES:
            self._add_results(out, max_bytes)
        return out

    def keep_result(self, slot: TaskSlot, completion: Any, limit: int) -> None:
        """Account the result a task just sent back (before the Scheduler reads the
        completion): past ``limit`` (limits.max_run_result_bytes) the value is dropped and
        the task fails with TASK_FAILURE naming the limit, so that a finished run's results
        always fit one WaitRun reply and a run cannot fill the daemon's memory."""
        if completion.outcome is not Outcome.SUCCESS:
            return
        member = completion.dispatch.group_index
        data = slot.result
        if isinstance(data, list):
            value = data[member] if 0 <= member < len(data) else None
        else:
            value = data
        if value is None:
            return
        size = len(value) + RESULT_FRAMING
        if self.result_bytes + size <= limit:
            self.result_bytes += size
            return
        if isinstance(data, list):
            data[member] = None
        else:
            slot.result = None
        where = f" member {member}" if slot.group_size > 1 else ""
        message = (
            f"cannot keep the result of task {slot.index}{where} ({slot.handle.name}): "
            f"{len(value)} bytes would take run {self.run_id}'s results to "
            f"{self.result_bytes + size} bytes, past limits.max_run_result_bytes = {limit}"
        )
        completion.outcome = Outcome.TASK_FAILURE
        completion.message = message
        if slot.failure is None:
            slot.failure = FailureInfo(
                Outcome.TASK_FAILURE,
                message,
                completion.worker_id,
                completion.dispatch.dispatch_id,
                None,
                f"sub worker {completion.worker_id}",
            )

    def drop_results(self, why: str) -> int:
        """Forget this finished run's results (``why`` names the limit); the bytes freed."""
        freed, self.result_bytes = self.result_bytes, 0
        self.results_dropped = why
        self._results = []
        return freed

    def _add_results(self, out: Any, max_bytes: int) -> None:
        """Copy the run's encoded results (msgpack bytes; never decoded here) into ``out``."""
        if self.results_dropped:
            raise Precondition(
                "include_results",
                f"cannot return the results of run {self.run_id}: they were dropped "
                f"({self.results_dropped}); its status is still kept (wait without "
                "include_results)",
            )
        results = self._results
        size = sum(len(value) + RESULT_FRAMING for _, _, value in results)
        if max_bytes and size + _STATUS_OVERHEAD > max_bytes:
            raise LimitExceeded(
                "include_results",
                f"cannot return the results of run {self.run_id}: {len(results)} results of "
                f"{size} bytes do not fit in one response (limits.max_message_bytes = "
                f"{max_bytes}); wait without include_results",
            )
        for task_index, member_index, value in results:
            item = out.results.add(task_index=task_index, value=value)
            if member_index is not None:
                item.member_index = member_index

    def summary(self, now_ns: int) -> Any:
        """This run's ListRuns row."""
        out = pb.RunSummary(
            run_id=self.run_id,
            state=self.proto_state(),
            client=self.client,
            label=self.label,
            counts=self.counts(),
            submit_time=now_ts(self.submit_ns),
            age_seconds=max(0.0, (now_ns - self.submit_ns) / 1e9),
            priority=self.priority,
        )
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

    def _keep_status(self, run: Run, cancelled: bool, message: str) -> None:
        """The run is terminal: keep what its status needs and let go of the Run and of
        the handle (``_on_done`` releases its slots, args and dependency map once the
        answers owed are written: ``Run.release`` walks every slot)."""
        self._error = run.error
        self._was_cancelled = cancelled
        if self.result_bytes:
            self._results = run.encoded_results()
            # From now on it counts what it costs in memory, not what it adds to a reply.
            self.result_bytes += len(self._results) * RESULT_KEPT_OVERHEAD
        self.run = None
        self.handle = None
        err = self._error
        text = 0 if err is None else len(str(err)) + len(err.remote_text)
        self.status_bytes = (
            STATUS_BYTES + len(self.label) + len(self.key) + len(self.client) + len(message) + text
        )
        if self.trace is not None:  # kept with the status: limits.max_finished_run_bytes
            self.status_bytes += self.trace.nbytes()

    # -- events from the Scheduler (all on the loop; the task events: run_events.py) ----

    def _on_slot(self, run: Run, event: str, slot: TaskSlot | None) -> None:
        """Run listener: a slot failed (``task``) or the run ended (``run``)."""
        if event != "task" or slot is None or slot.state != SlotState.FAILED:
            return
        try:
            self._slot_failed(slot)
        except Exception:  # never into the Scheduler (as ``_guarded``)
            log.exception("run bookkeeping failed in _on_slot")

    def _slot_failed(self, slot: TaskSlot) -> None:
        """A slot failed: the run's first error names it; members never started count."""
        failure = slot.failure
        if (
            self.error_task_index is None
            and failure is not None
            # Not a task the cancel stopped: the run's error is the cancel's.
            and failure.outcome not in (Outcome.SKIPPED, Outcome.CANCELLED)
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

    def end_unstarted(self, error: TaskError, *, cancelled: bool) -> None:
        """End a run that never reached the engine (a queued run, see runs.py):
        CANCELLED (``cancelled``) or FAILED with ``error``; its tasks count as failed."""
        if self.terminal or self.run is not None:
            return
        self.failed = max(self.total, 0)
        self.finish_ns = time.time_ns()
        self.state = pb.RUN_STATE_CANCELLED if cancelled else pb.RUN_STATE_FAILED
        self._error = error
        self._was_cancelled = cancelled
        message = str(error)
        self.status_bytes = (
            STATUS_BYTES + len(self.label) + len(self.key) + len(self.client) + 2 * len(message)
        )
        self._end(message)

    def _end(self, message: str) -> None:
        """The run is terminal in ``self.state``: tell watchers, waiters and the table."""
        self.seq += 1
        self._terminal_message = message
        self.terminal = True
        if self.watchers:  # else built when first asked for (terminal_event)
            self._publish(self.terminal_event, force=True)
        if self._finished is not None:
            self._finished.set()
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)
        if self._metrics is not None:
            name = pb.RunState.Name(self.state).removeprefix("RUN_STATE_").lower()
            self._metrics.run_finished(name)
        if self.on_finished is not None:
            self.on_finished(self)
        callbacks, self._on_end = self._on_end, None
        # A copy: a callback removes itself from the list (the fast path's answer does),
        # which during the iteration over the list itself skipped the next one.
        for callback in tuple(callbacks or ()):
            try:
                callback()
            except Exception:  # one waiter's bug must not stop the others' replies
                log.exception("run %d: a finish callback failed", self.run_id)

    def _on_done(self, run: Run) -> None:
        if self.terminal:
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
        self._t0.clear()
        # Before _end: a watcher's terminal event is built from the kept status.
        self._keep_status(run, state == pb.RUN_STATE_CANCELLED, message)
        try:
            self._end(message)
        finally:
            if self.trace is not None:
                self.trace.settle()  # its pending batches hold the slots released now
            run.release()
