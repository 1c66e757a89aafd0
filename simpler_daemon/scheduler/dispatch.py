"""The Scheduler: the single owner of endpoint progress, as one coroutine.

Each round (the SUB lanes of the run that may dispatch go through the C fast loop of
``subpump.py``: poll, complete and publish in one call, then bulk bookkeeping)::

    progress every busy lane  ->  drain completions  ->  dispatch
                                   (release consumers,    (promote staged of the head run,
                                    poison on failure,     stage one single of the successor,
                                    retire runs)           group head all-or-nothing,
                                                           singles on their exact target,
                                                           SUB tasks on idle SUB workers)

The parts (the package docstring has the map): ``state.py`` (queues, admission,
counters), ``completion.py`` (what happens when tasks and runs end), ``progress.py``
(the coroutine, wake-ups, dead lanes) and this module (dispatch rules, one round).

Under ``fifo`` admission only the partition of the run at the head of admission
is dispatched; under ``fair`` every admitted run's partition is, each idle
worker going to the run with the least stride pass (``fair.py``). A late
enqueue for a terminal run is dropped.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import time
from collections import Counter, deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from simpler_daemon.callables import CallableRegistry
from simpler_daemon.endpoints.base import Outcome, WorkerDispatch
from simpler_daemon.scheduler.fair import DEFAULT_MAX_ACTIVE_RUNS, NO_PASS, run_pass
from simpler_daemon.scheduler.lanes import WorkerCompletion, WorkerManager, WorkerThread
from simpler_daemon.scheduler.progress import ProgressLoop
from simpler_daemon.scheduler.runmodel import FailureInfo, Run, SlotState, TaskKind, TaskSlot
from simpler_daemon.scheduler.subpump import SubPump

if TYPE_CHECKING:
    from simpler_daemon.heap import Heap
    from simpler_daemon.mailbox.doorbell import Doorbell
    from simpler_daemon.scheduler.fair import FairAdmission

__all__ = ["STALL_WARNING_S", "SUBMIT_BATCH", "Scheduler"]

log = logging.getLogger("simpler_daemon.scheduler")

#: A group head blocked this long while a reserved target idles with queued singles warns.
STALL_WARNING_S = 5.0
#: While an orchestration submits SUB tasks and no SUB worker is idle, a round runs once
#: per this many submits (a one-task run still starts at once; the rest goes in bulk).
SUBMIT_BATCH = 32
#: A SUB submit that sees a finished child runs a round only this long after the last
#: one: a slow orchestration keeps its workers busy, a fast one is not slowed.
ROUND_GAP_S = 0.0002
#: Children that keep up with fast submits (the round of a submit freed a lane, and the
#: next submit came within LOCKSTEP_GAP_S of it) get the next tasks this many at a time:
#: else a round per submit, each freeing the lane the next submit finds idle (two lanes
#: in turn), costs more than the tasks. A slower orchestration keeps its round a submit.
LOCKSTEP_SUBMITS = 8
LOCKSTEP_GAP_S = 0.00002
#: After this many runs in a row of one SUB task each, a run's first submit spins (W1).
SINGLE_RUNS = 4


class Scheduler(ProgressLoop):
    """Dispatch rules over the queues of :class:`RunCompletion`, driven by
    :class:`ProgressLoop`."""

    def __init__(
        self,
        manager: WorkerManager,
        registry: CallableRegistry,
        heap: Heap,
        doorbell: Doorbell,
        *,
        pipeline_depth: int = 2,
        spin_s: float = 0.0002,
        admission: str = "fifo",
        max_active_runs: int = DEFAULT_MAX_ACTIVE_RUNS,
    ) -> None:
        super().__init__(
            manager,
            registry,
            heap,
            doorbell,
            pipeline_depth=pipeline_depth,
            spin_s=spin_s,
            admission=admission,
            max_active_runs=max_active_runs,
        )
        manager.start(self._on_complete, self._on_accept, self._on_staged)
        self._lanes = manager.lanes
        #: Lanes whose completions do not bump the doorbell word (remote sessions).
        self._quiet_lanes = [ln for ln in self._lanes if not ln.endpoint.caps.signals_doorbell]
        #: Digests of SUB callables being reloaded (count of reloads in progress): their
        #: tasks stay queued until every child runs the new code (``holding``).
        self._held: Counter[bytes] = Counter()
        #: The SUB fast loop (``subpump.py``): the per-task path of SUB lanes, in C.
        self._pump = SubPump()
        #: SUB submits since the last round (``SUBMIT_BATCH``).
        self._unrounded = 0
        #: The last round was a submit's and completed tasks (``LOCKSTEP_SUBMITS``).
        self._freed_inline = False
        self._round_seen = -1  # the doorbell's completion word when the last round began
        self._round_at = 0.0  # and when (time.monotonic())
        #: Whether this round's pump may wait for children (not inside a submit, but for
        #: SINGLE_RUNS: the orchestration goes on submitting meanwhile).
        self._pump_spin = True

    @contextlib.contextmanager
    def holding(self, digest: bytes) -> Iterator[None]:
        """Inside this block no SUB task of the callable with ``digest`` is dispatched: a
        reload runs on every child, and a task dispatched meanwhile could run the old code
        on one child and the new on another. Queued tasks keep their place (a run's SUB
        queue waits behind its held head) and dispatch once the block ends; a task queued
        behind a busy child's running one and not yet started is taken back to its queue."""
        self._held[digest] += 1
        self._pump.withdraw_digest(self, digest)
        try:
            yield
        finally:
            self._held[digest] -= 1
            if self._held[digest] <= 0:
                del self._held[digest]
            self.wake()

    def cancel(self, run: Run, *, record: bool = True) -> None:
        """``RunCompletion.cancel``, after taking back the run's tasks queued behind a busy
        child's running one that it has not claimed: they have not started, so they fail
        SKIPPED with the run's other unstarted tasks instead of running."""
        if not run.terminal:
            self._pump.withdraw_run(self, run)
        super().cancel(run, record=record)

    # -- SubmitSink ------------------------------------------------------------------------------

    def add_slot(self, slot: TaskSlot) -> None:
        # ``wake()``, inline (once per submit), before anything is published: a child
        # that ends this task finds the doorbell's ``parked`` flag down and does not ring.
        self._poked = True
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)
            self.doorbell.unpark()
        if slot.deps == 0:
            slot.state = SlotState.READY
            run = slot.run
            if slot.kind is TaskKind.SUB and not run.terminal:
                # ``enqueue_ready`` of a SUB single, inline (once per submit).
                q = self.subs.get(run.run_id)
                if q is None:
                    q = self.subs[run.run_id] = deque()
                q.append(slot)
            else:
                self.enqueue_ready(slot)
            # Dispatch right away when the slot's run may dispatch (the head; under fair,
            # any run): the child starts while the orchestration function still submits.
            # SUB tasks: while a SUB worker is idle, else once per SUBMIT_BATCH submits (a
            # round per submit cost more than the task); the rest goes once the orch yields.
            if not self.in_round and (slot.run is self.admission.head or self.fair is not None):
                go = slot.kind is not TaskKind.SUB or self._unrounded >= SUBMIT_BATCH
                if not go:
                    # A SUB worker is idle (``lane.idle()``, inline: this runs per submit).
                    for lane in self.manager.sub:
                        if (
                            lane.active is None
                            and not lane.deliveries
                            and not lane.stopping
                            and not lane.endpoint.poisoned
                        ):
                            # A plan submitted back to back: every other submit, so
                            # the round gives the worker a task and queues the next.
                            go = (not run.bulk_submits or self._unrounded >= 2) and (
                                not self._freed_inline
                                or self._unrounded >= LOCKSTEP_SUBMITS
                                or time.monotonic() - self._round_at > LOCKSTEP_GAP_S
                            )
                            break
                    else:
                        # a child finished since the last round (its lane is free for the
                        # next task only once a round has seen that), and the last round
                        # is not so recent that fast submits would pay one round each
                        go = (
                            self.doorbell.completed() != self._round_seen
                            and time.monotonic() - self._round_at > ROUND_GAP_S
                        )
                # After SINGLE_RUNS one-task runs, the pump waits for the first task of a
                # run alone in admission (its hit rate permitting): the run ends with its
                # build, no round later, and no other run's work waits behind the spin.
                first = (
                    self.single_runs >= SINGLE_RUNS
                    and slot.index == 0
                    and self.admission.successor is None
                    and self.spins_first_submit
                )
                if go or first:
                    self._pump_spin = first
                    completed = self.stats["completed"]
                    try:
                        self.round()
                    finally:
                        self._pump_spin = True
                    self._freed_inline = self.stats["completed"] != completed
                self._unrounded += 1

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
        """Progress, drain, dispatch. True when anything happened.

        The SUB lanes go through the pump (``subpump.py``) whenever one SUB queue may
        dispatch (``_pump_queue``, possibly empty): it also completes what it published,
        so a plain SUB task never takes the Python path (``lane.progress``)."""
        if self.in_round:
            return False
        self.in_round = True
        try:
            self.stats["rounds"] += 1
            self._unrounded = 0
            self._freed_inline = False
            self._round_seen = self.doorbell.completed()
            self._round_at = time.monotonic()
            pump = self._pump
            if self._held:
                q = None
            elif self.fair is None:  # ``_pump_queue`` under fifo, inline (per round)
                head = self.admission.head
                q = None if head is None else self.subs.get(head.run_id)
                if q is None:
                    q = _NO_QUEUE
            else:
                q = self._pump_queue()
            pumping = q is not None and bool(self.manager.sub)
            # Under fair another run's queue may get work meanwhile: one call only.
            chain = self.fair is None
            progressed = False
            for lane in self._lanes:
                if lane.inflight and not (pumping and pump.owns(lane)):
                    lane.progress()
            if pumping and self.completions:
                # Before the pump's call, which may go on for many tasks: a run these
                # finish ends now, and what they made ready competes (fair.py) first.
                progressed = self._complete_all()
                q = None if self._held else self._pump_queue()
                if q is None:  # several fair queues now: the Python path dispatches
                    pumping = False
                    for lane in self._lanes:
                        if lane.inflight:
                            lane.progress()
            if pumping:
                assert q is not None
                if pump.drive(self, q, self.manager.sub, self._pump_spin, chain=chain):
                    progressed = True
            if self.completions:
                progressed = self._complete_all()
                # What they made ready goes through the pump too: a chain one of whose
                # tasks took the Python path (a completion left to Python) gets back.
                q = self._pump_queue() if pumping and not self._held else None
                if q:
                    pump.drive(self, q, self.manager.sub, self._pump_spin, chain=chain)
            if self.member_retries and self.dispatch_member_retries():
                progressed = True
            if self.fair is not None:
                if self._dispatch_fair(self.fair):
                    progressed = True
            else:
                head = self.admission.head
                if head is not None and self._dispatch(head):
                    progressed = True
            if self._suspect:
                self._check_dead_lanes()
            return progressed
        finally:
            self.in_round = False

    # -- the SUB fast loop (subpump.py) ------------------------------------------------------

    def _pump_queue(self) -> deque[TaskSlot] | None:
        """The one SUB queue that may dispatch now: the fifo head's; under fair, that of
        the only run with SUB work (several compete in fair.py's order, in Python).
        ``_NO_QUEUE`` (empty) when no queue has work but the pump may still have tasks
        in flight; None when the Python path dispatches (several fair queues)."""
        subs = self.subs
        if self.fair is None:
            head = self.admission.head
            q = None if head is None else subs.get(head.run_id)
            return _NO_QUEUE if q is None else q
        found = None
        for q in subs.values():
            if q:
                if found is not None:
                    return None
                found = q
        return _NO_QUEUE if found is None else found

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
            elif st is not None and st.task_slot.run.detached:
                # A cancelled run's staged task runs as soon as the lane is free (there is
                # no withdrawing a published frame); its lane is taken until it ends.
                did |= lane.activate_prepared(st.task_slot.run_id)
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
                self._launch_group(gq, g, ready)
                self._stall_since = None
                self._stall_warned = False
                did = True
                continue
            if self._fail_if_gone(gq, g, lanes):
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
            if target.lacks(q[0].digest):
                continue  # a queued install of it failed there (``WorkerThread.missing``)
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
                if self._held and slot.digest in self._held:
                    break  # being reloaded (``holding``)
                n = slot.group_size
                if n == 1:
                    lane2 = None
                    for cand in subs:
                        # Only a child that has the callable installed (``missing``).
                        if cand.active is None and cand.idle() and not cand.lacks(slot.digest):
                            lane2 = cand
                            break
                    if lane2 is None:
                        if self._no_sub_capacity():
                            sq.popleft()
                            self._fail_slot(
                                slot,
                                FailureInfo(Outcome.ENDPOINT_FAILURE, self._no_sub_left()),
                            )
                            self.finish_if_done(slot.run)
                            did = True
                            continue
                        break
                    sq.popleft()
                    self._claim(slot)
                    slot.members_started = 1
                    self._send(lane2, WorkerDispatch(slot, 0))
                    did = True
                    continue
                idle = [cand for cand in subs if cand.idle() and not cand.lacks(slot.digest)]
                capacity = self._sub_capacity()
                if capacity < n:
                    sq.popleft()
                    self._fail_slot(slot, self._group_too_big(n, capacity))
                    self.finish_if_done(slot.run)
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

    # -- fair admission: every active run dispatches ------------------------------------------

    def _dispatch_fair(self, fair: FairAdmission) -> bool:
        """One dispatch pass over every active run (see fair.py and docs/architecture.md).

        The per-run rules are those of ``_dispatch``: groups all-or-nothing in FIFO
        order, singles on their exact target in order, a SUB group on distinct idle
        SUB workers. Across runs, each idle worker goes to the run with the least pass.

        Chip frames: a staged dispatch is promoted as soon as its lane's active frame is
        free, whatever its run, and staging only ever fills the frame that the lane's
        active task does not use. So every dispatch below lands on a lane with both
        frames free (``idle()`` lanes have nothing staged), and no frame is shared.
        """
        did = False
        manager = self.manager
        # 1. promote staged dispatches on lanes whose active frame is free
        for lane in manager.next_level.values():
            st = lane.staged
            if st is not None and lane.active is None:
                did |= lane.activate_prepared(st.task_slot.run_id)
        # 2. group heads, least pass first; the first one blocked reserves its targets
        reserved: set[int] = set()
        if self.groups:
            did |= self._groups_fair(fair, reserved)
        # 3. stage one single per run behind another run's active task (not on a chip a
        #    blocked group holds: the staged task would run first and delay the group)
        if self.singles:
            did |= self._stage_fair(fair, reserved)
        # 4. singles, only on their exact target, least pass first per target
        if self.singles:
            did |= self._singles_fair(fair, reserved)
        # 5. SUB tasks on idle SUB workers, least pass first (when a queue holds one: a
        #    run's queue stays, empty, until the run ends; W1's rounds find it so)
        for q in self.subs.values():
            if q:
                did |= self._subs_fair(fair)
                break
        return did

    def _stage_fair(self, fair: FairAdmission, reserved: set[int]) -> bool:
        did = False
        for wid, per in self.singles.items():
            if not per or wid in reserved:
                continue
            stager = self.manager.next_level.get(wid)
            if stager is None or stager.active is None or not stager.can_stage():
                continue  # an idle lane gets a plain dispatch below
            frame = stager.active.task_slot.lease_slot & 1
            best: deque[TaskSlot] | None = None
            best_key = NO_PASS
            for rid, q in per.items():
                if not q:
                    continue
                slot = q[0]
                if (
                    slot.run.staged_one
                    or slot.state != SlotState.READY
                    or slot.config.diagnostic
                    or slot.lease_slot & 1 == frame
                    or self.groups.get(rid)  # a group queued ahead keeps FIFO order
                ):
                    continue
                key = run_pass(slot.run)
                if best is None or key < best_key:
                    best, best_key = q, key
            if best is None:
                continue
            slot = best.popleft()
            self._claim(slot)
            slot.members_started = 1
            slot.run.staged_one = True
            fair.charge(slot.run, 1)
            self.stats["dispatched"] += 1
            stager.dispatch_prepared(WorkerDispatch(slot, 0))
            if self.on_task_event is not None:
                self.on_task_event(slot, "dispatched", None)
            did = True
        return did

    def _groups_fair(self, fair: FairAdmission, reserved: set[int]) -> bool:
        did = False
        manager = self.manager
        heads = sorted(
            (run_pass(gq[0].run), i, gq) for i, gq in enumerate(self.groups.values()) if gq
        )
        blocked = False
        for _, _, gq in heads:
            while gq:
                g = gq[0]
                if g.state != SlotState.READY:
                    gq.popleft()
                    continue
                lanes = [manager.next_level.get(w) for w in g.targets]
                ready = [
                    m for m in lanes if m is not None and m.idle() and m.worker_id not in reserved
                ]
                if len(ready) == len(lanes):
                    self._launch_group(gq, g, ready)
                    if not blocked:
                        self._stall_since = None
                        self._stall_warned = False
                    fair.charge(g.run, len(ready))
                    did = True
                    continue
                if self._fail_if_gone(gq, g, lanes):
                    did = True
                    continue
                for m in lanes:
                    if m is not None:
                        self._notice_dead(m)
                if not blocked:
                    # The least-pass blocked group holds its targets against everything
                    # else this pass (later blocked groups reserve nothing), so it is not
                    # starved by a stream of singles.
                    blocked = True
                    reserved.update(g.targets)
                    self._check_stall(g, lanes)
                break
        return did

    def _singles_fair(self, fair: FairAdmission, reserved: set[int]) -> bool:
        did = False
        manager = self.manager
        for wid, per in self.singles.items():
            if wid in reserved or not per:
                continue
            target = manager.next_level.get(wid)
            if target is None:
                continue
            if not target.idle():
                if target.gone is not None:
                    for q in list(per.values()):
                        did |= self._fail_queue(q, wid, target.gone)
                else:
                    self._notice_dead(target)
                continue
            best: deque[TaskSlot] | None = None
            best_key = NO_PASS
            for q in per.values():
                while q and q[0].state != SlotState.READY:
                    q.popleft()
                if q and not target.lacks(q[0].digest):
                    key = run_pass(q[0].run)
                    if best is None or key < best_key:
                        best, best_key = q, key
            if best is None:
                continue
            slot = best.popleft()
            self._claim(slot)
            slot.members_started = 1
            fair.charge(slot.run, 1)
            self._send(target, WorkerDispatch(slot, 0))
            did = True
        return did

    def _subs_fair(self, fair: FairAdmission) -> bool:
        did = False
        idle = [lane for lane in self.manager.sub if lane.active is None and lane.idle()]
        if not idle:
            if self._no_sub_capacity():
                for q in list(self.subs.values()):
                    did |= self._fail_subs(q)
            return did
        heap = [(run_pass(q[0].run), i, q) for i, q in enumerate(self.subs.values()) if q]
        heapq.heapify(heap)
        while heap and idle:
            key, i, q = heapq.heappop(heap)
            if not q:
                continue  # emptied meanwhile (its run failed and was retired)
            slot = q[0]
            now = run_pass(slot.run)
            if now != key:
                # Charging a run also moves its client's pass: re-file a stale entry
                # (passes only grow, so the entry on top with a current key is the least).
                heapq.heappush(heap, (now, i, q))
                continue
            if slot.state != SlotState.READY:
                q.popleft()
            elif self._held and slot.digest in self._held:
                continue  # being reloaded (``holding``): this run waits this pass
            else:
                n = slot.group_size
                if n > 1:
                    capacity = self._sub_capacity()
                    if capacity < n:
                        q.popleft()
                        self._fail_slot(slot, self._group_too_big(n, capacity))
                        self.finish_if_done(slot.run)
                    elif len(members := [ln for ln in idle if not ln.lacks(slot.digest)]) < n:
                        # The least-pass run waits for n idle workers: hold the idle ones
                        # for it (no one else dispatches this pass), else it would starve.
                        break
                    else:
                        q.popleft()
                        self._claim(slot)
                        fair.charge(slot.run, n)
                        for k in range(n):
                            slot.members_started += 1
                            self._send(members[k], WorkerDispatch(slot, k))
                            idle.remove(members[k])
                        did = True
                else:
                    # The first idle child that has the callable installed (``missing``).
                    k = next((j for j, ln in enumerate(idle) if not ln.lacks(slot.digest)), -1)
                    if k < 0:
                        continue  # none has it yet: this run waits this pass
                    q.popleft()
                    self._claim(slot)
                    slot.members_started = 1
                    fair.charge(slot.run, 1)
                    self._send(idle.pop(k), WorkerDispatch(slot, 0))
                    did = True
            if q:
                heapq.heappush(heap, (run_pass(q[0].run), i, q))
        return did

    def _fail_subs(self, q: deque[TaskSlot]) -> bool:
        """No SUB worker can run a task any more: fail what ``q`` holds."""
        did = False
        while q:
            slot = q.popleft()
            if slot.state == SlotState.READY:
                self._fail_slot(slot, FailureInfo(Outcome.ENDPOINT_FAILURE, self._no_sub_left()))
                self.finish_if_done(slot.run)
                did = True
        return did

    @staticmethod
    def _group_too_big(n: int, capacity: int) -> FailureInfo:
        return FailureInfo(
            Outcome.SKIPPED,
            f"SUB group of {n} members needs {n} distinct SUB workers, "
            f"the pool has {capacity} that can run",
        )

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
                self.finish_if_done(slot.run)
                did = True
        return did

    def _launch_group(self, gq: deque[TaskSlot], g: TaskSlot, members: list[WorkerThread]) -> None:
        """Pop group ``g``, the head of ``gq``, and send member ``i`` to ``members[i]``."""
        gq.popleft()
        self._claim(g)
        for i, member in enumerate(members):
            g.members_started += 1
            self._send(member, WorkerDispatch(g, i))

    def _fail_if_gone(
        self, gq: deque[TaskSlot], g: TaskSlot, lanes: list[WorkerThread | None]
    ) -> bool:
        """Pop and fail group ``g``, the head of ``gq``, when one of its targets will never
        return."""
        gone = next((m for m in lanes if m is not None and m.gone is not None), None)
        if gone is None:
            return False
        gq.popleft()
        self._fail_slot(
            g,
            FailureInfo(
                Outcome.ENDPOINT_FAILURE,
                f"worker {gone.worker_id} is gone: {gone.gone}",
                worker_id=gone.worker_id,
            ),
        )
        self.finish_if_done(g.run)
        return True

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
            active = stager.active
            if active is not None and active.task_slot.run.detached:
                # A detached run gave its lease (and so its task frame) to a later run,
                # but its task still occupies that frame here: stage elsewhere.
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


#: The queue the pump is given when no SUB queue may dispatch: it stays empty (the pump
#: only pops), so the call polls and completes what is in flight and publishes nothing.
_NO_QUEUE: deque[TaskSlot] = deque()
