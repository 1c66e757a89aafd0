"""The Scheduler's state: its queues, admission, counters and lanes.

One object holds it, built once per Worker; the other modules of the Scheduler add
behaviour on top of it, each a class over the one before::

    SchedulerState (here)       queues partitioned by run, admission (fifo or fair),
                                stats, the spin gate, the lanes, the loop's wake-up
    RunCompletion (completion)  what happens when a task or a run ends
    ProgressLoop (progress)     the coroutine: spin or park, wake-ups, dead lanes
    Scheduler (dispatch)        the dispatch rules and one round

Every ready slot goes through :meth:`SchedulerState.enqueue_ready`, the one router
into the queues.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from simpler_daemon.callables import CallableHandle
from simpler_daemon.endpoints.base import WorkerDispatch
from simpler_daemon.scheduler.fair import ADMISSION_POLICIES, DEFAULT_MAX_ACTIVE_RUNS, FairAdmission
from simpler_daemon.scheduler.lanes import WorkerCompletion, WorkerManager, WorkerThread
from simpler_daemon.scheduler.runmodel import Admission, Run, TaskKind, TaskSlot
from simpler_daemon.scheduler.spingate import SpinGate

if TYPE_CHECKING:
    from simpler_daemon.callables import CallableRegistry
    from simpler_daemon.heap import Heap
    from simpler_daemon.mailbox.doorbell import Doorbell

__all__ = ["SchedulerState"]


class SchedulerState:
    """The Scheduler's queues, admission and counters (no behaviour but routing)."""

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
        if admission not in ADMISSION_POLICIES:
            raise ValueError(
                f"cannot create the scheduler: admission {admission!r} is not one of "
                f"{', '.join(ADMISSION_POLICIES)}"
            )
        self.manager = manager
        #: At level 4 a NEXT_LEVEL task is an L3 orchestration function run by the child.
        self.next_level_orchestrations = False
        self.registry = registry
        self.heap = heap
        self.doorbell = doorbell
        #: The admission policy, ``"fifo"`` or ``"fair"`` (see fair.py).
        self.admission_policy = admission
        #: The fair admission (``None`` under fifo): every active run dispatches.
        self.fair: FairAdmission | None = None
        if admission == "fair":
            self.fair = FairAdmission(pipeline_depth, max_active_runs)
            self.admission: Admission = self.fair
        else:
            self.admission = Admission(pipeline_depth)
        self.spin_s = spin_s
        # Queues, partitioned by run id.
        self.singles: dict[int, dict[int, deque[TaskSlot]]] = {}
        self.groups: dict[int, deque[TaskSlot]] = {}
        self.subs: dict[int, deque[TaskSlot]] = {}
        self.completions: list[WorkerCompletion] = []
        #: ``SubmitSink.next_slot_id``: a C callable, not a method (one call per submit,
        #: where a Python frame cost more than the count).
        self.next_slot_id: Callable[[], int] = itertools.count(1).__next__
        #: ``SubmitSink.valid_sub``: the last SUB handle validated, and its registry entry.
        self.valid_sub: tuple[CallableHandle, Any] | None = None
        self._stopped = False
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stall_since: float | None = None
        self._stall_warned = False
        self.in_round = False
        self._poked = False
        #: Runs in a row that ended with one task each (``dispatch.SINGLE_RUNS``).
        self.single_runs = 0
        #: Whether a streak of them has a run's first submit wait for its task. The
        #: daemon says no: its handler has a run's bookkeeping to do after the submit,
        #: and its ``settle`` spins after that, while the child wakes up meanwhile.
        self.spins_first_submit = True
        #: Spin or park while tasks are in flight (spingate.py): fed by every completion.
        self.spin_gate = SpinGate(spin_s)
        self._suspect: set[WorkerThread] = set()
        #: Dispatches of other runs staged on a chip whose child ``terminate`` killed: they
        #: never started, so they go back to their queue (by ``id``) instead of failing.
        self._withdrawn: dict[int, WorkerDispatch] = {}
        #: How often each SUB task (by slot id) went back to its queue because its child
        #: died before picking it up (``completion.MAX_PICKUP_REQUEUES`` bounds it).
        self._pickup_requeues: dict[int, int] = {}
        #: Called once for a lane whose child died and whose frames are all terminal.
        self.on_lane_dead: Callable[[WorkerThread], None] | None = None
        #: Dead SUB lanes come back (a fork server replaces them): queued SUB tasks wait.
        self.replaces_dead_subs = False
        self.on_admit: Callable[[Run], None] | None = None
        self.on_task_event: Callable[[TaskSlot, str, WorkerCompletion | None], None] | None = None
        #: ``on_task_event`` for a batch of the C pump's (``(slots, event, worker_id)``):
        #: "dispatched" (first members published, ``worker_id`` -1) or "completed" (each
        #: a SUCCESS on SUB lane ``worker_id``); the list is only lent. None: one
        #: ``on_task_event`` a slot.
        self.on_pumped: Callable[[list[TaskSlot], str, int], None] | None = None
        self.stats = {
            "dispatched": 0,
            "completed": 0,
            "failed": 0,
            "retried": 0,
            "rounds": 0,
            "parks": 0,
            #: Runs that ended inside ``settle`` (their waiter's own call).
            "settled": 0,
        }
        #: Group members whose failed attempt runs again (completion.py), waiting for a lane.
        self.member_retries: list[tuple[TaskSlot, int]] = []
        #: Every lane, and those whose completions do not bump the doorbell word (remote
        #: sessions); the Scheduler fills both once the manager started.
        self._lanes: list[WorkerThread] = []
        self._quiet_lanes: list[WorkerThread] = []

    def wake(self) -> None:
        """Wake a parked or spinning coroutine (same thread)."""
        self._poked = True
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)
            # Awake from now on: a child that ends a task meanwhile need not ring the
            # eventfd (the coroutine's next round sees it; a ring would cost both sides a
            # system call and this loop one more round).
            self.doorbell.unpark()

    def busy(self) -> bool:
        if self.completions:
            return True
        # A loop, not any() over a generator (a frame per lane): ~3 times a run.
        for lane in self._lanes:  # noqa: SIM110
            if lane.inflight:
                return True
        return False

    def quiet(self) -> bool:
        """Nothing to look at again: no task in flight on any lane and no run admitted
        or waiting (a one-task run the round just ended). Not ``busy`` alone: a run
        still admitted may have a task made ready that this round left queued."""
        if self.busy():  # every lane, those whose completions come on a socket too
            return False
        admission = self.admission
        return not (admission.active or admission.waiting or admission.detached)

    # -- SubmitSink ------------------------------------------------------------------------------

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
        if role == "sub":
            self.valid_sub = (handle, entry)
        return handle

    def validate_targets(self, targets: list[int], api: str) -> None:
        for w in targets:
            if w not in self.manager.next_level:
                known = self.manager.next_level_worker_ids()
                raise ValueError(
                    f"cannot {api}: worker={w} is not a registered NEXT_LEVEL worker (known: {known})"
                )

    # -- runs --------------------------------------------------------------------------------------

    def submit_run(self, run: Run) -> list[Run]:
        """Queue a run for admission; returns the runs admitted now."""
        admitted = self.admission.enqueue(run)
        self._promoted(admitted)
        return admitted

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

    def _lane_of(self, c: WorkerCompletion) -> WorkerThread | None:
        return self.manager.get_worker_by_id(c.worker_type, c.worker_id)
