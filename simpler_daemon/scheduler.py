"""The Scheduler: the single owner of endpoint progress, as one coroutine.

Each round::

    progress every busy lane  ->  drain completions  ->  dispatch
                                   (release consumers,    (promote staged of the head run,
                                    poison on failure,     stage one single of the successor,
                                    retire runs)           group head all-or-nothing,
                                                           singles on their exact target,
                                                           SUB tasks on idle SUB workers)

Wake-ups: while lanes are busy the coroutine polls and yields to the loop
(``sleep(0)``); after ``spin_s`` without progress it parks on the doorbell
eventfd, which children ring after a terminal state (only while parked) and
submitters ring from other threads. Nothing sleeps on the dispatch path and
nothing burns a core while idle.

Only the partition of the run at the head of admission is dispatched; a
late enqueue for a terminal run is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from simpler_daemon.callables import CallableHandle, CallableRegistry
from simpler_daemon.endpoints.base import Outcome, WorkerDispatch
from simpler_daemon.manager import WorkerCompletion, WorkerManager, WorkerThread, WorkerType
from simpler_daemon.orchestrator import (
    RETIRED_RUN,
    Admission,
    FailureInfo,
    Run,
    RunState,
    SlotState,
    SubmitSink,
    TaskKind,
    TaskSlot,
)

if TYPE_CHECKING:
    from simpler_daemon.doorbell import Doorbell
    from simpler_daemon.heap import Heap

log = logging.getLogger("simpler_daemon.scheduler")

#: A group head blocked this long while a reserved target idles with queued singles warns.
STALL_WARNING_S = 5.0


class Scheduler(SubmitSink):
    """Queues, dispatch rules, completion handling and the progress coroutine."""

    def __init__(
        self,
        manager: WorkerManager,
        registry: CallableRegistry,
        heap: Heap,
        doorbell: Doorbell,
        *,
        pipeline_depth: int = 2,
        spin_s: float = 0.0002,
    ) -> None:
        self.manager = manager
        #: At level 4 a NEXT_LEVEL task is an L3 orchestration function run by the child.
        self.next_level_orchestrations = False
        self.registry = registry
        self.heap = heap
        self.doorbell = doorbell
        self.admission = Admission(pipeline_depth)
        self.spin_s = spin_s
        # Queues, partitioned by run id.
        self.singles: dict[int, dict[int, deque[TaskSlot]]] = {}
        self.groups: dict[int, deque[TaskSlot]] = {}
        self.subs: dict[int, deque[TaskSlot]] = {}
        self.completions: list[WorkerCompletion] = []
        self._slot_ids = 0
        self._stopped = False
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stall_since: float | None = None
        self._stall_warned = False
        self._in_round = False
        self._poked = False
        self.latency_ewma = 0.0
        self._suspect: set[WorkerThread] = set()
        #: Called once for a lane whose child died and whose frames are all terminal.
        self.on_lane_dead: Callable[[WorkerThread], None] | None = None
        #: Dead SUB lanes come back (a fork server replaces them): queued SUB tasks wait.
        self.replaces_dead_subs = False
        self.on_admit: Callable[[Run], None] | None = None
        self.on_task_event: Callable[[TaskSlot, str, WorkerCompletion | None], None] | None = None
        self.stats = {"dispatched": 0, "completed": 0, "failed": 0, "rounds": 0, "parks": 0}
        manager.start(self._on_complete, self._on_accept, self._on_staged)
        self._lanes = manager.lanes
        #: Lanes whose completions do not bump the doorbell word (remote sessions).
        self._quiet_lanes = [ln for ln in self._lanes if not ln.endpoint.caps.signals_doorbell]

    # -- SubmitSink ------------------------------------------------------------------------------

    def next_slot_id(self) -> int:
        self._slot_ids += 1
        return self._slot_ids

    def validate_handle(self, handle: Any, role: str, api: str) -> CallableHandle:
        if not isinstance(handle, CallableHandle):
            raise TypeError(
                f"cannot {api}: expected a CallableHandle returned by Worker.register, "
                f"got {type(handle).__name__} {handle!r}"
            )
        entry = self.registry.lookup(handle.hashid)
        if entry is None or entry.state != "active":
            raise ValueError(
                f"cannot {api}: callable {handle.name} ({handle.hashid}) is not registered"
            )
        if role == "sub" and handle.role != "sub":
            raise ValueError(
                f"cannot {api}: {handle.name} is registered as {handle.role}, not as a SUB callable"
            )
        if role == "chip" and handle.role == "orchestration" and not self.next_level_orchestrations:
            raise ValueError(f"cannot {api}: {handle.name} is an orchestration function")
        return handle

    def validate_targets(self, targets: list[int], api: str) -> None:
        for w in targets:
            if w not in self.manager.next_level:
                known = self.manager.next_level_worker_ids()
                raise ValueError(
                    f"cannot {api}: worker={w} is not a registered NEXT_LEVEL worker (known: {known})"
                )

    def add_slot(self, slot: TaskSlot) -> None:
        if slot.deps == 0:
            slot.state = SlotState.READY
            self.enqueue_ready(slot)
            # Dispatch right away when the slot's run is the head: the child starts
            # while the orchestration function is still submitting.
            if not self._in_round and slot.run is self.admission.head:
                self.round()
        self.wake()

    def fail_at_submit(self, slot: TaskSlot, producer: TaskSlot) -> None:
        failure = FailureInfo(
            Outcome.SKIPPED,
            f"producer task {producer.index} ({producer.handle.name}) failed before submit",
        )
        self._fail_slot(slot, failure, record=False)
        self._maybe_finish_run(slot.run)

    # -- runs --------------------------------------------------------------------------------------

    def submit_run(self, run: Run) -> list[Run]:
        """Queue a run for admission; returns the runs admitted now."""
        admitted = self.admission.enqueue(run)
        self._promoted(admitted)
        return admitted

    def finish_building(self, run: Run) -> None:
        """The orchestration function returned: the run can complete once its slots retire."""
        run.building = False
        if run.state == RunState.BUILDING:
            run.state = RunState.PREPARED
        self._maybe_finish_run(run)
        self.wake()

    def fail_building(self, run: Run, exc: BaseException) -> None:
        run.record_error(
            None,
            FailureInfo(Outcome.TASK_FAILURE, f"orchestration raised {type(exc).__name__}: {exc}"),
        )
        self.cancel(run, record=False)
        self.finish_building(run)

    def cancel(self, run: Run, *, record: bool = True) -> None:
        """Claim every unstarted slot FAILED; running tasks finish."""
        if run.terminal:
            return
        run.cancelled = True
        if record:
            run.record_error(None, FailureInfo(Outcome.SKIPPED, "run cancelled"))
        for slot in run.slots:
            if slot.state in (SlotState.PENDING, SlotState.READY) and slot.members_started == 0:
                self._fail_slot(slot, FailureInfo(Outcome.SKIPPED, "run cancelled"), record=False)
        self._drop_partitions(run.run_id)
        self._maybe_finish_run(run)
        self.wake()

    def _maybe_finish_run(self, run: Run) -> None:
        if run.remaining or run.building or run.terminal:
            return
        run.state = RunState.FAILED if run.error is not None else RunState.COMPLETED
        self._drop_partitions(run.run_id)
        self._promoted(self.admission.release(run))
        run.emit("run")
        run.fire_done()
        # Break the run <-> slot cycle so a finished run is freed by reference
        # counting: cyclic garbage per run would trigger the cyclic GC every few
        # dozen runs, and its pauses dominate the latency tail.
        for slot in run.slots:
            slot.run = RETIRED_RUN

    def _promoted(self, admitted: list[Run]) -> None:
        if self.on_admit is not None:
            for run in admitted:
                self.on_admit(run)

    def _drop_partitions(self, run_id: int) -> None:
        for per_worker in self.singles.values():
            per_worker.pop(run_id, None)
        self.groups.pop(run_id, None)
        self.subs.pop(run_id, None)

    # -- queues ------------------------------------------------------------------------------------

    def enqueue_ready(self, slot: TaskSlot) -> None:
        """The one router for fresh submits, dependency releases and requeues."""
        run = slot.run
        if run.terminal:
            return
        kind = slot.kind
        if kind is TaskKind.SUB or kind is TaskKind.SUB_GROUP:
            q = self.subs.get(run.run_id)
            if q is None:
                q = self.subs[run.run_id] = deque()
            q.append(slot)
        elif kind is TaskKind.NEXT_LEVEL:
            per = self.singles.setdefault(slot.targets[0], {})
            per.setdefault(run.run_id, deque()).append(slot)
        else:
            self.groups.setdefault(run.run_id, deque()).append(slot)

    def queued(self) -> int:
        n = sum(len(q) for q in self.subs.values()) + sum(len(q) for q in self.groups.values())
        return n + sum(len(q) for per in self.singles.values() for q in per.values())

    # -- lane callbacks -----------------------------------------------------------------------------

    def add_next_level(self, worker_id: int, endpoint: Any) -> WorkerThread:
        """A NEXT_LEVEL lane joining after start (a remote worker attached at run time)."""
        lane = self.manager.add_live(
            worker_id, endpoint, self._on_complete, self._on_accept, self._on_staged
        )
        self._lanes = self.manager.lanes
        if not endpoint.caps.signals_doorbell:
            self._quiet_lanes.append(lane)
        return lane

    def _on_complete(self, c: WorkerCompletion) -> None:
        self.completions.append(c)

    def _on_accept(self, d: WorkerDispatch) -> None:
        pass

    def _on_staged(self, d: WorkerDispatch, disposition: int) -> None:
        slot = d.task_slot
        # An active dispatch passes through FRAME_STAGED too; only a successor is "staged".
        if self.on_task_event is not None and d.prepare_only:
            self.on_task_event(slot, "staged", None)

    # -- one round -----------------------------------------------------------------------------------

    def round(self) -> bool:
        """Progress, drain, dispatch. True when anything happened."""
        if self._in_round:
            return False
        self._in_round = True
        try:
            return self._round()
        finally:
            self._in_round = False

    def _round(self) -> bool:
        self.stats["rounds"] += 1
        for lane in self._lanes:
            if lane.inflight:
                lane.progress()
        progressed = False
        if self.completions:
            progressed = True
            comps, self.completions = self.completions, []
            for c in comps:
                self._handle_completion(c)
        head = self.admission.head
        if head is not None and self._dispatch(head):
            progressed = True
        if self._suspect:
            self._check_dead_lanes()
        return progressed

    def _claim(self, slot: TaskSlot) -> bool:
        if slot.state != SlotState.READY:
            return False
        slot.state = SlotState.RUNNING
        slot.run.counts["running"] += 1
        return True

    def _dispatch(self, head: Run) -> bool:
        did = False
        rid = head.run_id
        manager = self.manager
        # 1. promote staged lanes of the head run (only NEXT_LEVEL lanes can stage)
        for lane in manager.next_level.values():
            st = lane.staged
            if st is not None and st.task_slot.run_id == rid:
                lane.activate_prepared(rid)
                did = True
        # 2. stage at most one single of the prepared successor
        succ = self.admission.successor
        if succ is not None and not succ.staged_one:
            did |= self._stage_successor(succ)
        # 3. group FIFO head: all-or-nothing
        reserved: set[int] = set()
        gq = self.groups.get(rid)
        while gq:
            g = gq[0]
            if g.state != SlotState.READY:
                gq.popleft()
                continue
            lanes = [manager.next_level.get(w) for w in g.targets]
            ready = [m for m in lanes if m is not None and m.idle()]
            if len(ready) == len(lanes):
                gq.popleft()
                self._claim(g)
                self._stall_since = None
                self._stall_warned = False
                for i, member in enumerate(ready):
                    g.members_started += 1
                    self._send(member, WorkerDispatch(g, i))
                did = True
                continue
            gone = [m for m in lanes if m is not None and m.gone is not None]
            if gone:
                gq.popleft()
                self._fail_slot(
                    g,
                    FailureInfo(
                        Outcome.ENDPOINT_FAILURE,
                        f"worker {gone[0].worker_id} is gone: {gone[0].gone}",
                        worker_id=gone[0].worker_id,
                    ),
                )
                self._maybe_finish_run(g.run)
                did = True
                continue
            for m in lanes:
                if m is not None:
                    self._notice_dead(m)
            reserved = set(g.targets)
            self._check_stall(g, lanes)
            break
        # 4. singles, only on their exact target
        for wid, per in self.singles.items():
            if wid in reserved:
                continue
            q = per.get(rid)
            if not q:
                continue
            target = manager.next_level.get(wid)
            if target is None or not target.idle():
                if target is not None:
                    if target.gone is not None:
                        did |= self._fail_queue(q, wid, target.gone)
                    else:
                        self._notice_dead(target)
                continue
            while q:
                slot = q.popleft()
                if self._claim(slot):
                    slot.members_started = 1
                    self._send(target, WorkerDispatch(slot, 0))
                    did = True
                    break
        # 5. SUB tasks on idle SUB workers
        sq = self.subs.get(rid)
        if sq:
            subs = manager.sub
            while sq:
                slot = sq[0]
                if slot.state != SlotState.READY:
                    sq.popleft()
                    continue
                n = slot.group_size
                if n == 1:
                    lane2 = None
                    for cand in subs:
                        if cand.active is None and cand.idle():
                            lane2 = cand
                            break
                    if lane2 is None:
                        if self._sub_capacity() == 0:
                            sq.popleft()
                            self._fail_slot(
                                slot,
                                FailureInfo(
                                    Outcome.ENDPOINT_FAILURE,
                                    "no live SUB worker is left and none is being replaced",
                                ),
                            )
                            self._maybe_finish_run(slot.run)
                            did = True
                            continue
                        break
                    sq.popleft()
                    self._claim(slot)
                    slot.members_started = 1
                    self._send(lane2, WorkerDispatch(slot, 0))
                    did = True
                    continue
                idle = [cand for cand in subs if cand.idle()]
                capacity = self._sub_capacity()
                if capacity < n:
                    sq.popleft()
                    self._fail_slot(
                        slot,
                        FailureInfo(
                            Outcome.SKIPPED,
                            f"SUB group of {n} members needs {n} distinct SUB workers, "
                            f"the pool has {capacity} that can run",
                        ),
                    )
                    self._maybe_finish_run(slot.run)
                    continue
                if len(idle) < n:
                    break
                sq.popleft()
                self._claim(slot)
                for i in range(n):
                    slot.members_started += 1
                    self._send(idle[i], WorkerDispatch(slot, i))
                did = True
        return did

    def _notice_dead(self, lane: WorkerThread) -> None:
        """Work waits for a lane whose endpoint failed with nothing in flight (no completion
        reported it: a remote session that failed in a control or between runs)."""
        if lane.endpoint.poisoned and not lane.inflight and lane not in self._suspect:
            self._suspect.add(lane)

    def _fail_queue(self, q: deque[TaskSlot], wid: int, reason: str) -> bool:
        """Fail every single queued for a lane that will never run again."""
        did = False
        while q:
            slot = q.popleft()
            if slot.state == SlotState.READY:
                self._fail_slot(
                    slot,
                    FailureInfo(
                        Outcome.ENDPOINT_FAILURE, f"worker {wid} is gone: {reason}", worker_id=wid
                    ),
                )
                self._maybe_finish_run(slot.run)
                did = True
        return did

    def _sub_capacity(self) -> int:
        """SUB workers that can still run a task: live ones, or all of them while dead
        ones are being replaced."""
        subs = self.manager.sub
        if self.replaces_dead_subs:
            return len(subs)
        return sum(1 for lane in subs if not lane.endpoint.poisoned and not lane.stopping)

    def _stage_successor(self, succ: Run) -> bool:
        rid = succ.run_id
        for wid, per in self.singles.items():
            q = per.get(rid)
            if not q:
                continue
            slot = q[0]
            if slot.state != SlotState.READY or slot.config.diagnostic:
                continue
            # A group queued ahead in the successor keeps FIFO order: never stage around it.
            if self.groups.get(rid):
                return False
            stager = self.manager.next_level.get(wid)
            if stager is None or not stager.can_stage():
                continue
            q.popleft()
            self._claim(slot)
            slot.members_started = 1
            succ.staged_one = True
            self.stats["dispatched"] += 1
            stager.dispatch_prepared(WorkerDispatch(slot, 0))
            if self.on_task_event is not None:
                self.on_task_event(slot, "dispatched", None)
            return True
        return False

    def _send(self, lane: WorkerThread, d: WorkerDispatch) -> None:
        self.stats["dispatched"] += 1
        d.issued_at = time.monotonic()
        lane.dispatch(d)
        if self.on_task_event is not None:
            self.on_task_event(d.task_slot, "dispatched", None)

    def _check_stall(self, g: TaskSlot, lanes: list[WorkerThread | None]) -> None:
        now = time.monotonic()
        blocking = any(
            lane is not None and lane.idle() and self.singles.get(lane.worker_id, {}).get(g.run_id)
            for lane in lanes
        )
        if not blocking:
            self._stall_since = None
            return
        if self._stall_since is None:
            self._stall_since = now
            self._stall_warned = False
        elif not self._stall_warned and now - self._stall_since > STALL_WARNING_S:
            self._stall_warned = True
            log.warning(
                "group task %d of run %d on workers %s blocked for %.1fs while a reserved "
                "target idles with queued singles",
                g.index,
                g.run_id,
                g.targets,
                now - self._stall_since,
            )

    # -- completions ------------------------------------------------------------------------------------

    def _handle_completion(self, c: WorkerCompletion) -> None:
        slot: TaskSlot = c.dispatch.task_slot
        run = slot.run
        if run is RETIRED_RUN:
            return  # a run force-finished by close(); nothing is waiting for this slot
        if c.dispatch.issued_at:
            # Smoothed dispatch-to-completion latency: decides whether spinning pays.
            self.latency_ewma += 0.125 * (
                time.monotonic() - c.dispatch.issued_at - self.latency_ewma
            )
        if c.outcome is Outcome.SUCCESS:
            self.stats["completed"] += 1
        else:
            self.stats["failed"] += 1
            if c.outcome is Outcome.ENDPOINT_FAILURE:
                lane = self._lane_of(c)
                if lane is not None:
                    self._suspect.add(lane)
            if slot.failure is None:
                ep = getattr(self._lane_of(c), "endpoint", None)
                child = getattr(ep, "child", None)
                label = "sub worker" if c.worker_type is WorkerType.SUB else "worker"
                slot.failure = FailureInfo(
                    c.outcome,
                    c.message,
                    c.worker_id,
                    c.dispatch.dispatch_id,
                    getattr(child, "pid", None),
                    f"{label} {c.worker_id}",
                )
        if self.on_task_event is not None:
            self.on_task_event(slot, "completed", c)
        if slot.is_group:
            slot.members_done += 1
            if slot.members_done < slot.members_started:
                return
        run.counts["running"] -= 1
        if slot.failure is None:
            self._complete_slot(slot)
        else:
            failure = slot.failure
            slot.failure = None
            self._fail_slot(slot, failure, running=True)
        self._maybe_finish_run(run)

    def _lane_of(self, c: WorkerCompletion) -> WorkerThread | None:
        return self.manager.get_worker_by_id(c.worker_type, c.worker_id)

    def _complete_slot(self, slot: TaskSlot) -> None:
        slot.state = SlotState.COMPLETED
        run = slot.run
        run.remaining -= 1
        run.counts["done"] += 1
        self._unpin(slot)
        for consumer in slot.consumers:
            consumer.deps -= 1
            if consumer.deps == 0 and consumer.state == SlotState.PENDING:
                consumer.state = SlotState.READY
                self.enqueue_ready(consumer)
        slot.consumers = []
        run.emit("task", slot)

    def _fail_slot(
        self, slot: TaskSlot, failure: FailureInfo, *, record: bool = True, running: bool = False
    ) -> None:
        """Fail a slot and, recursively, every consumer that has not started."""
        stack = [(slot, failure)]
        first = True
        while stack:
            s, f = stack.pop()
            if s.state in (SlotState.COMPLETED, SlotState.FAILED):
                continue
            if (not running or not first) and s.state == SlotState.RUNNING:
                continue
            s.state = SlotState.FAILED
            s.failure = f
            run = s.run
            run.remaining -= 1
            run.counts["failed" if first else "skipped"] += 1
            if first and record:
                run.record_error(s, f)
            self._unpin(s)
            run.emit("task", s)
            for consumer in s.consumers:
                if consumer.state in (SlotState.PENDING, SlotState.READY):
                    stack.append(
                        (
                            consumer,
                            FailureInfo(
                                Outcome.SKIPPED, f"producer task {s.index} ({s.handle.name}) failed"
                            ),
                        )
                    )
            s.consumers = []
            first = False

    def _unpin(self, slot: TaskSlot) -> None:
        if slot.pins:
            for b in slot.pins:
                if isinstance(b, int):
                    self.heap.unpin(b)
                elif self.remote is not None:  # (owner, buffer id, generation)
                    self.remote.unpin(b)
            slot.pins = []

    # -- the coroutine ------------------------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self.completions) or any(lane.inflight for lane in self._lanes)

    def spin_budget(self) -> float:
        """How long to spin before parking: ``spin_s`` while tasks finish quickly, 0 when
        they typically run longer than that (spinning would only steal a core from them)."""
        return self.spin_s if self.latency_ewma < self.spin_s else 0.0

    def socket_busy(self) -> bool:
        """A lane whose completion arrives on a socket (not the doorbell word) is busy."""
        return any(lane.inflight for lane in self._quiet_lanes)

    def has_dispatchable(self) -> bool:
        head = self.admission.head
        if head is None:
            return False
        rid = head.run_id
        if self.subs.get(rid) or self.groups.get(rid):
            return True
        return any(per.get(rid) for per in self.singles.values())

    def wake(self) -> None:
        """Wake a parked or spinning coroutine (same thread)."""
        self._poked = True
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the coroutine on ``loop`` and watch the doorbell and every child pidfd."""
        self._loop = loop
        loop.add_reader(self.doorbell.fd, self._on_doorbell)
        for lane in self._lanes:
            child = getattr(lane.endpoint, "child", None)
            if child is not None and child.pidfd is not None:
                loop.add_reader(child.pidfd, self._on_child_exit, child)
        self._task = loop.create_task(self.run(), name="simpler-scheduler")

    def detach(self) -> None:
        loop = self._loop
        if loop is None:
            return
        loop.remove_reader(self.doorbell.fd)
        for lane in self._lanes:
            child = getattr(lane.endpoint, "child", None)
            if child is not None and child.pidfd is not None:
                loop.remove_reader(child.pidfd)
        self._loop = None

    def _on_doorbell(self) -> None:
        self.doorbell.drain()
        self.wake()

    def _on_child_exit(self, child: Any) -> None:
        if self._loop is not None and child.pidfd is not None:
            self._loop.remove_reader(child.pidfd)
        self.child_exited(child)
        self.wake()

    def watch_child(self, child: Any) -> None:
        """Observe a (replacement) child's exit through its pidfd on the bound loop."""
        if self._loop is not None and child.pidfd is not None:
            self._loop.add_reader(child.pidfd, self._on_child_exit, child)

    def child_exited(self, child: Any) -> None:
        """A child died: poison its endpoint now, so an idle dead lane is never dispatched to."""
        child.poll()
        reason = f"child {child.describe()}"
        for lane in self._lanes:
            ep = lane.endpoint
            if getattr(ep, "child", None) is child:
                if not ep.poisoned and hasattr(ep, "poison"):
                    ep.poison(reason)
                self._suspect.add(lane)
        if not self._in_round:
            self._check_dead_lanes()

    def _check_dead_lanes(self) -> None:
        """Report a lane whose endpoint is poisoned, drained and whose child has exited."""
        for lane in list(self._suspect):
            ep = lane.endpoint
            child = getattr(ep, "child", None)
            if not ep.poisoned:
                self._suspect.discard(lane)
            elif lane.inflight == 0 and (child is None or child.poll()):
                self._suspect.discard(lane)
                if self.on_lane_dead is not None and not self._stopped:
                    self.on_lane_dead(lane)

    async def run(self) -> None:
        """Progress rounds until stopped; spin briefly, then park on the doorbell."""
        loop = asyncio.get_running_loop()
        doorbell = self.doorbell
        last_progress = time.monotonic()
        try:
            while not self._stopped:
                seen = doorbell.completed()
                self._poked = False
                if self.round():
                    last_progress = time.monotonic()
                    if doorbell.completed() != seen or self._poked:
                        await asyncio.sleep(0)
                        continue
                spin_s = self.spin_budget()
                if self.busy() and time.monotonic() - last_progress < spin_s:
                    # Yield to the loop until a child announces a completion or a
                    # submitter pokes us; no mailbox is re-polled meanwhile. This is the
                    # bounded spin of the spin-then-park design, so an Event would be wrong.
                    while (  # noqa: ASYNC110
                        doorbell.completed() == seen
                        and not self._poked
                        and time.monotonic() - last_progress < spin_s
                    ):
                        await asyncio.sleep(0)
                    continue
                # Park: flag first, then one more round (Dekker), then sleep.
                self._wake = loop.create_future()
                doorbell.park()
                # Dekker: a completion after `seen` either moved the word (seen here) or
                # finds `parked` set and rings the eventfd.
                if doorbell.completed() != seen or self._poked or self._stopped:
                    doorbell.unpark()
                    self._wake = None
                    continue
                self.stats["parks"] += 1
                timeout = 0.01 if self.busy() else None
                try:
                    if timeout is None:
                        await self._wake
                    else:
                        await asyncio.wait_for(asyncio.shield(self._wake), timeout)
                except TimeoutError:
                    pass
                finally:
                    doorbell.unpark()
                    self._wake = None
                last_progress = time.monotonic()
        except asyncio.CancelledError:
            raise
        except BaseException:
            log.exception("scheduler crashed; failing every run")
            self._fail_all("scheduler crashed")
            raise

    def _fail_all(self, reason: str) -> None:
        for run in self.admission.runs():
            run.record_error(None, FailureInfo(Outcome.ENDPOINT_FAILURE, reason))
            run.building = False
            self.cancel(run, record=False)

    def stop(self) -> None:
        self._stopped = True
        self.wake()

    async def wait_stopped(self) -> None:
        if self._task is not None:
            try:
                await self._task
            finally:
                self._task = None
