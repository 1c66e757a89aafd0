"""Completion handling for the Scheduler: what happens when a task or a run ends.

A completion releases the slot's consumers (or fails them, recursively, when
the slot failed), unpins the buffers the slot captured, and retires the run
once nothing of it is left::

    completion  ->  COMPLETED: consumers' deps -1 (ready ones are routed)
                    FAILED:    consumers SKIPPED, first failure recorded
                ->  run has nothing left and its orchestration returned
                    ->  COMPLETED | FAILED, lease released, done callbacks

A cancelled run whose tasks are still running leaves admission at once
(``detached``): later runs are admitted and dispatched on idle workers while the
running tasks keep only their own workers; the run turns terminal when they end.

The state these methods work on is ``state.py``'s; ``progress.py`` adds the
coroutine, ``dispatch.py`` the dispatch rules.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Final

from simpler_daemon.endpoints.base import Outcome, WorkerDispatch
from simpler_daemon.endpoints.local import NOT_PICKED_UP, LocalMailboxEndpoint
from simpler_daemon.errors import RunCancelled
from simpler_daemon.scheduler.lanes import WorkerCompletion, WorkerThread, WorkerType
from simpler_daemon.scheduler.retries import attempt_text, retry_cause
from simpler_daemon.scheduler.runmodel import (
    RETIRED_RUN,
    FailureInfo,
    Run,
    RunState,
    SlotState,
    TaskKind,
    TaskSlot,
)
from simpler_daemon.scheduler.sink import SubmitSink
from simpler_daemon.scheduler.state import SchedulerState

#: The longest error text an orchestration failure keeps (a run's status carries it to
#: clients, and the daemon keeps it with the finished run).
MAX_ORCH_ERROR_CHARS: Final = 65536
#: How many times one SUB task goes back to its queue because the child it was handed
#: to died before picking it up; the next such death fails it (children that keep dying
#: at once must not keep a task circling).
MAX_PICKUP_REQUEUES: Final = 3

__all__ = [
    "MAX_ORCH_ERROR_CHARS",
    "MAX_PICKUP_REQUEUES",
    "RunCompletion",
    "pumped_completion",
]


def pumped_completion(slot: TaskSlot, worker_id: int) -> WorkerCompletion:
    """The completion of a task the C pump ran to SUCCESS on SUB lane ``worker_id``
    (the pump keeps none: made for a listener that reads one)."""
    return WorkerCompletion(WorkerDispatch(slot, 0), worker_id, WorkerType.SUB, Outcome.SUCCESS)


class RunCompletion(SchedulerState, SubmitSink):
    """What happens when tasks and runs end, over the Scheduler's state."""

    @property
    def submit_sink(self) -> SubmitSink:
        """The Scheduler itself is what an Orchestrator submits into (``sink.RunControl``)."""
        return self

    def fail_at_submit(self, slot: TaskSlot, producer: TaskSlot) -> None:
        failure = FailureInfo(
            Outcome.SKIPPED,
            f"producer task {producer.index} ({producer.handle.name}) failed before submit",
        )
        self._fail_slot(slot, failure, record=False)
        self.finish_if_done(slot.run)

    # -- runs --------------------------------------------------------------------------------------

    def finish_building(self, run: Run) -> None:
        """The orchestration function returned: the run can complete once its slots retire."""
        run.building = False
        if run.state is RunState.BUILDING:
            run.state = RunState.PREPARED
        if not run.remaining:
            self.finish_if_done(run)
            if run.terminal and not self._suspect and self.quiet():
                # Its tasks ended inside its build (``dispatch.SINGLE_RUNS``): what its
                # submits poked the progress coroutine for is done, and it parks again
                # without a round.
                self._poked = False
                return
        self.wake()

    def fail_building(self, run: Run, exc: BaseException) -> None:
        text = f"orchestration raised {type(exc).__name__}: {exc}"
        if len(text) > MAX_ORCH_ERROR_CHARS:  # as a SUB task's error text is bounded
            cut = len(text) - MAX_ORCH_ERROR_CHARS
            text = f"{text[:MAX_ORCH_ERROR_CHARS]}... ({cut} more characters cut)"
        run.record_error(None, FailureInfo(Outcome.TASK_FAILURE, text))
        self.cancel(run, record=False)
        self.finish_building(run)

    def cancel(self, run: Run, *, record: bool = True) -> None:
        """Claim every unstarted slot FAILED; running tasks finish.

        A run left with running tasks leaves admission at once (``Admission.detach``):
        later runs proceed on the idle workers, its tasks keep only their own workers,
        and it turns terminal when they end (their results change nothing: the run has
        failed already). Its error is recorded first, so nothing more can be submitted.
        """
        if run.terminal:
            return
        run.cancelled = True
        if record:
            run.record_error(None, FailureInfo(Outcome.SKIPPED, "run cancelled"))
        for slot in run.slots:
            if slot.state in (SlotState.PENDING, SlotState.READY) and slot.members_started == 0:
                self._fail_slot(slot, FailureInfo(Outcome.SKIPPED, "run cancelled"), record=False)
        if self.member_retries:
            self._drop_member_retries(run, "run cancelled before the retry of this member")
        self._drop_partitions(run.run_id)
        self.finish_if_done(run)
        if not run.terminal:
            self._promoted(self.admission.detach(run))
        self.wake()

    def terminate(self, run: Run, reason: str = "") -> int:
        """Stop the tasks of cancelled ``run`` that are running on local children (SUB,
        chip, nested L3): each child's process group is SIGKILLed now, the replacement path
        forks a new one, and the task ends CANCELLED (``run N cancelled (terminate): task
        stopped on sub worker 0 (pid P)``). Returns how many tasks were stopped.

        Call it after ``cancel(run)`` (nothing new starts then). Tasks on remote lanes run
        to their end: the remote worker is not ours to kill. A task of ``run`` only staged
        behind another run's task on a chip is not stopped (its kill would stop the other
        run's task); it runs when that one ends, as after a plain cancel. A task of another
        run staged behind a stopped one on the same chip never started: it is queued
        again and runs on the replacement."""
        if run.terminal:
            return 0
        if not run.cancelled:
            raise ValueError(f"cannot terminate run {run.run_id}: cancel it first")
        why = f"run {run.run_id} cancelled (terminate)" + (f": {reason}" if reason else "")
        stopped = 0
        first: tuple[WorkerThread, WorkerDispatch, str] | None = None
        for lane in self._lanes:
            ep = lane.endpoint
            if not isinstance(ep, LocalMailboxEndpoint):
                continue  # a remote lane: its tasks run to their end
            active, staged = lane.active, lane.staged
            killed = False
            for d in (active, staged):
                if d is None or d.task_slot.run is not run:
                    continue
                if d is staged and active is not None and active.task_slot.run is not run:
                    continue  # staged behind another run's running task: leave that alone
                text = f"run {run.run_id} cancelled (terminate): task stopped on {ep.who()}"
                if ep.terminate(d, text, why):
                    stopped += 1
                    killed = True
                    if first is None:
                        first = (lane, d, text)
            if (
                killed
                and staged is not None
                and staged.prepare_only
                and staged.task_slot.run is not run
            ):
                # A chip's staged frame of another run goes back to its queue. A SUB
                # lane's queued task never began: the dead child's frame says so
                # (NOT_PICKED_UP), and it is queued again like any unstarted SUB task.
                self._withdrawn[id(staged)] = staged
        if first is not None:
            self._name_stopped_task(run, *first)
        if stopped:
            self.wake()
        return stopped

    @staticmethod
    def _name_stopped_task(run: Run, lane: WorkerThread, d: WorkerDispatch, text: str) -> None:
        """The run's error (the cancel's, ``runs.cancelled_error``: no task named yet)
        names the first task ``terminate`` stopped: where it ran and how it ended, as a
        failed task's error does."""
        err = run.error
        if not isinstance(err, RunCancelled) or err.worker_id is not None:
            return  # a task failure came first, or a task is named already
        if err.outcome != Outcome.CANCELLED.name:
            return  # not a cancel's error (e.g. the daemon's own text): left as it is
        slot = d.task_slot
        ep = lane.endpoint
        child = getattr(ep, "child", None)
        where = ep.who() if isinstance(ep, LocalMailboxEndpoint) else f"worker {lane.worker_id}"
        run.error = RunCancelled(
            f"{err}; task {slot.index} ({slot.kind.name} {slot.handle.name}, hashid "
            f"{slot.hashid}) stopped on {where}, dispatch {d.dispatch_id}: "
            f"{Outcome.CANCELLED.name}: {text}",
            run_id=run.run_id,
            worker_id=lane.worker_id,
            hashid=slot.hashid,
            dispatch_id=d.dispatch_id,
            outcome=Outcome.CANCELLED.name,
            remote_text=f"{err.remote_text}; {text}",
            pid=getattr(child, "pid", None),
        )

    def finish_if_done(self, run: Run) -> None:
        if run.remaining or run.building or run.terminal:
            return
        run.end(RunState.FAILED if run.error is not None else RunState.COMPLETED)
        slots = run.slots  # a run of one SUB task extends the streak (dispatch.SINGLE_RUNS)
        one = len(slots) == 1 and slots[0].kind is TaskKind.SUB
        self.single_runs = self.single_runs + 1 if one else 0
        if run.trace is not None:
            run.trace.end()
        self._drop_partitions(run.run_id)
        admitted = self.admission.release(run)
        if admitted:
            self._promoted(admitted)
        if run.pins or run.scopes != [[]]:
            self.release_run_memory(run)
        else:
            run.orch = None  # what release_run_memory does for a run that held nothing
        if run.listeners:
            run.emit("run")
        if self._pickup_requeues:
            for slot in run.slots:
                self._pickup_requeues.pop(slot.slot_id, None)
        run.fire_done()
        # Break the run <-> slot cycle so a finished run is freed by reference
        # counting: cyclic garbage per run would trigger the cyclic GC every few
        # dozen runs, and its pauses dominate the latency tail.
        for slot in run.slots:
            slot.run = RETIRED_RUN

    def drop_unadmitted(self, run: Run) -> None:
        """A run cancelled before admission: it never ran and is FAILED now."""
        self.admission.release(run)
        run.building = False
        run.end(RunState.FAILED)
        if run.trace is not None:
            run.trace.end()
        self.release_run_memory(run)
        run.fire_done()

    def release_run_memory(self, run: Run) -> None:
        """A terminal run lets go of what it held: the buffers its args referenced
        (pinned at submit), the buffers it allocated (``Orchestrator.alloc``; each is
        reused once the tasks that captured it retired), and its orchestration function
        and args (a handle kept by the caller must not keep them alive)."""
        run.orch = None
        scopes, run.scopes = run.scopes, [[]]
        for scope in scopes:
            for buffer_id in scope:
                self.heap.free_owned(buffer_id)
        pins, run.pins = run.pins, []
        for key in pins:
            self._unpin_key(key)

    # -- completions ------------------------------------------------------------------------------------

    def _complete_all(self) -> bool:
        """Handle the completions the lanes' Python path gathered (True: the round did
        something)."""
        comps, self.completions = self.completions, []
        for c in comps:
            self._handle_completion(c)
        return True

    def _handle_completion(self, c: WorkerCompletion) -> None:
        slot: TaskSlot = c.dispatch.task_slot
        run = slot.run
        if run is RETIRED_RUN:
            return  # a run force-finished by close(); nothing is waiting for this slot
        if (
            self._withdrawn
            and self._withdrawn.pop(id(c.dispatch), None) is c.dispatch
            and not run.cancelled
            and slot.state == SlotState.RUNNING
        ):
            self._requeue_staged(slot, c)
            return
        if c.error == NOT_PICKED_UP:
            c = self._unstarted_sub(slot, c)
            if c.error == NOT_PICKED_UP:
                return  # queued again
        if c.dispatch.issued_at:
            # Dispatch-to-completion latency: decides whether spinning pays (spingate.py).
            self.spin_gate.observe(c.dispatch.issued_at, time.monotonic())
        if c.outcome is not Outcome.SUCCESS and slot.config.max_retries and self._retry(slot, c):
            return  # it runs again: its consumers wait for the next attempt
        if c.outcome is Outcome.SUCCESS:
            self.stats["completed"] += 1
        else:
            self.stats["failed"] += 1
            if c.outcome is Outcome.ENDPOINT_FAILURE or c.outcome is Outcome.CANCELLED:
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
                if slot.config.max_retries:
                    self._note_attempts(slot, c, slot.failure)
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
        self.finish_if_done(run)

    # -- the SUB fast loop's bulk bookkeeping (subpump.py) ------------------------------------

    def claim_published(self, published: list[TaskSlot]) -> None:
        """What ``_send`` does per dispatch, for the slots the pump published (one run)."""
        run = published[0].run
        running = SlotState.RUNNING
        if self.on_pumped is None and self.on_task_event is None:
            for slot in published:  # nobody traces: no dispatch time to stamp
                slot.state = running
                slot.members_started = 1
        else:
            now = time.perf_counter_ns()
            for slot in published:
                slot.state = running
                slot.members_started = 1
                slot.dispatched_ns = now
        k = len(published)
        run.counts["running"] += k
        self.stats["dispatched"] += k
        if self.fair is not None:
            self.fair.charge(run, k)  # k single charges in a row add up to this one
        if self.on_pumped is not None:
            self.on_pumped(published, "dispatched", -1)
        elif self.on_task_event is not None:
            event = self.on_task_event
            for slot in published:
                event(slot, "dispatched", None)
        published.clear()

    def complete_pumped(self, lane: WorkerThread, done: list[Any]) -> None:
        """``_handle_completion`` of a SUCCESS, for the tasks the pump completed on
        ``lane`` (a slot, or (slot, msgpack bytes) when it returned a value)."""
        if self.on_pumped is not None or self.on_task_event is not None:
            done = self._announce_pumped(lane, done)
        completed = SlotState.COMPLETED
        self.stats["completed"] += len(done)
        for item in done:
            if type(item) is tuple:
                slot, data = item
                slot.set_result(0, data)
            else:
                slot = item
            run = slot.run
            if run is RETIRED_RUN:
                self.stats["completed"] -= 1
                continue  # force-finished by close(); nothing waits for it
            run.counts["running"] -= 1
            failure = slot.failure
            if failure is not None:
                # The listener failed it (the daemon's limits.max_run_result_bytes):
                # what _handle_completion does with a failure it set.
                slot.failure = None
                self._fail_slot(slot, failure, running=True)
                self.finish_if_done(run)
                continue
            if slot.pins or slot.consumers:
                self._complete_slot(slot)
            else:  # _complete_slot of a slot that holds nothing, inline (W2: per task)
                slot.state = completed
                run.remaining -= 1
                run.counts["done"] += 1
            if not run.remaining:
                self.finish_if_done(run)

    def _announce_pumped(self, lane: WorkerThread, done: list[Any]) -> list[TaskSlot]:
        """The task events of ``complete_pumped``'s completions, before any is counted
        (a listener may fail one: ``slot.failure``): their results set, the slots of
        retired runs left out. One ``on_pumped`` call for the batch when it is set."""
        slots: list[TaskSlot] = []
        for item in done:
            if type(item) is tuple:
                slot, data = item
                slot.set_result(0, data)
            else:
                slot = item
            if slot.run is not RETIRED_RUN:
                slots.append(slot)
        if not slots:
            return slots
        if self.on_pumped is not None:
            self.on_pumped(slots, "completed", lane.worker_id)
        else:
            event = self.on_task_event
            assert event is not None
            for slot in slots:
                event(slot, "completed", pumped_completion(slot, lane.worker_id))
        return slots

    # -- retries (CallConfig.max_retries; scheduler/retries.py) ---------------------------------

    def _retry(self, slot: TaskSlot, c: WorkerCompletion) -> bool:
        """Run failed attempt ``c`` of ``slot`` again when its config says so and attempts
        are left: a single goes back to the head of its queue (READY), a group member
        waits in ``member_retries``. False: the attempt fails the task as before."""
        run = slot.run
        if run.cancelled or run.terminal or slot.state != SlotState.RUNNING:
            return False
        cause = retry_cause(c, slot.config)
        if cause is None:
            return False
        member = c.dispatch.group_index
        used = slot.retries.get(member, 0) if slot.retries is not None else 0
        if used >= slot.config.max_retries:
            return False
        if slot.retries is None:
            slot.retries = {}
            slot.causes = []
        slot.retries[member] = used + 1
        assert slot.causes is not None
        slot.causes.append(
            attempt_text(used + 1, member if slot.is_group else None, c, self._where(c))
        )
        self.stats["retried"] += 1
        if c.outcome is Outcome.ENDPOINT_FAILURE:
            lane = self._lane_of(c)
            if lane is not None:
                self._suspect.add(lane)  # replaced by the usual path before it is used
        if self.on_task_event is not None:
            self.on_task_event(slot, "retried", c)
        if slot.is_group:
            self.member_retries.append((slot, member))
        else:
            slot.state = SlotState.READY
            slot.members_started = 0
            run.counts["running"] -= 1
            if slot.kind is TaskKind.SUB:
                q = self.subs.get(run.run_id)
                if q is None:
                    q = self.subs[run.run_id] = deque()
                q.appendleft(slot)
            else:
                per = self.singles.setdefault(slot.targets[0], {})
                per.setdefault(run.run_id, deque()).appendleft(slot)
        self.wake()
        return True

    def _where(self, c: WorkerCompletion) -> str:
        """``sub worker 0 (pid 123)``: where attempt ``c`` ran."""
        label = "sub worker" if c.worker_type is WorkerType.SUB else "worker"
        pid = getattr(
            getattr(getattr(self._lane_of(c), "endpoint", None), "child", None), "pid", None
        )
        return f"{label} {c.worker_id}" + (f" (pid {pid})" if pid is not None else "")

    def _note_attempts(self, slot: TaskSlot, c: WorkerCompletion, failure: FailureInfo) -> None:
        """The last attempt of a task that may retry failed: its error counts them all."""
        member = c.dispatch.group_index
        used = slot.retries.get(member, 0) if slot.retries is not None else 0
        last = attempt_text(used + 1, member if slot.is_group else None, c, self._where(c))
        failure.attempts = used + 1
        failure.causes = (*(slot.causes or ()), last)

    def dispatch_member_retries(self) -> bool:
        """Send each group member waiting for its retry to a lane: an idle SUB lane for a
        SUB group, its own NEXT_LEVEL target otherwise (once that is idle again: a dead
        one is replaced first). A member whose lane will never come back fails."""
        did = False
        waiting: list[tuple[TaskSlot, int]] = []
        manager = self.manager
        for slot, member in self.member_retries:
            if slot.run.terminal or slot.state != SlotState.RUNNING:
                continue
            lane: WorkerThread | None
            if slot.kind is TaskKind.SUB_GROUP:
                lane = next(
                    (
                        m
                        for m in manager.sub
                        if m.active is None and m.idle() and not m.lacks(slot.digest)
                    ),
                    None,
                )
                gone = all(m.gone is not None for m in manager.sub)
                why = "no SUB worker is left"
            else:
                lane = manager.next_level.get(slot.targets[member])
                gone = lane is None or lane.gone is not None
                why = f"worker {slot.targets[member]} is gone"
                if lane is not None and not lane.idle():
                    lane = None
            if gone:
                self._member_failed(slot, member, f"cannot retry member {member}: {why}")
                did = True
                continue
            if lane is None:
                waiting.append((slot, member))
                continue
            d = WorkerDispatch(slot, member)
            self.stats["dispatched"] += 1
            d.issued_at = time.monotonic()
            lane.dispatch(d)
            if self.on_task_event is not None:
                done = WorkerCompletion(d, lane.worker_id, lane.worker_type, Outcome.SUCCESS)
                self.on_task_event(slot, "redispatched", done)
            did = True
        self.member_retries = waiting
        return did

    def _drop_member_retries(self, run: Run, why: str) -> None:
        """The members of ``run`` waiting for a retry will not get one."""
        keep: list[tuple[TaskSlot, int]] = []
        for slot, member in self.member_retries:
            if slot.run is run:
                self._member_failed(slot, member, why)
            else:
                keep.append((slot, member))
        self.member_retries = keep

    def _member_failed(self, slot: TaskSlot, member: int, why: str) -> None:
        """A member that would have been retried ends failed: what the completion of a
        failed member does (the group fails once its last member is done)."""
        if slot.failure is None:
            slot.failure = FailureInfo(
                Outcome.ENDPOINT_FAILURE,
                why,
                attempts=(slot.retries or {}).get(member, 0) + 1,
                causes=tuple(slot.causes or ()),
            )
        slot.members_done += 1
        if slot.members_done < slot.members_started:
            return
        run = slot.run
        run.counts["running"] -= 1
        failure, slot.failure = slot.failure, None
        self._fail_slot(slot, failure, running=True)
        self.finish_if_done(run)

    def _requeue_staged(self, slot: TaskSlot, c: WorkerCompletion) -> None:
        """A staged single that never started goes back to the head of its run's queue
        for its chip (it was the first there), to run on the replacement child."""
        run = slot.run
        slot.state = SlotState.READY
        slot.members_started = 0
        run.counts["running"] -= 1
        run.staged_one = False
        if self.on_task_event is not None:
            self.on_task_event(slot, "requeued", c)
        per = self.singles.setdefault(slot.targets[0], {})
        per.setdefault(run.run_id, deque()).appendleft(slot)
        self.wake()

    def _unstarted_sub(self, slot: TaskSlot, c: WorkerCompletion) -> WorkerCompletion:
        """A SUB task whose child died before picking it up (``NOT_PICKED_UP``) never
        ran: it goes back to the head of its run's SUB queue, to run on another or the
        replacement worker (a "requeued" task event; ``c`` is returned unchanged). Not
        so for a cancelled run, a group member, or a task requeued
        ``MAX_PICKUP_REQUEUES`` times already: the completion returned instead fails it
        as any lost child does, with the reason added."""
        run = slot.run
        lane = self._lane_of(c)
        if lane is not None:
            self._suspect.add(lane)  # the dead child's lane: replaced by the usual path
        n = self._pickup_requeues.get(slot.slot_id, 0)
        if run.cancelled or slot.is_group or slot.state != SlotState.RUNNING:
            return WorkerCompletion(
                c.dispatch, c.worker_id, c.worker_type, c.outcome, -1, c.message
            )
        if n >= MAX_PICKUP_REQUEUES:
            self._pickup_requeues.pop(slot.slot_id, None)
            return WorkerCompletion(
                c.dispatch,
                c.worker_id,
                c.worker_type,
                c.outcome,
                -1,
                f"{c.message}; task {slot.index} ({slot.handle.name}) was handed to "
                f"{n + 1} SUB children that each died before picking it up: not queued "
                f"again (at most {MAX_PICKUP_REQUEUES} requeues)",
            )
        self._pickup_requeues[slot.slot_id] = n + 1
        self._unclaim_sub(slot)
        self._requeue_sub(slot, c)
        self.wake()
        return c

    def _unclaim_sub(self, slot: TaskSlot) -> None:
        """A SUB slot claimed RUNNING that never started is READY and unstarted again, and
        its fair charge is taken back (its next dispatch charges it)."""
        slot.state = SlotState.READY
        slot.members_started = 0
        slot.run.counts["running"] -= 1
        if self.fair is not None:
            self.fair.refund(slot.run, 1)

    def _requeue_sub(self, slot: TaskSlot, c: WorkerCompletion) -> None:
        """Put an unclaimed SUB slot back at the head of its run's SUB queue (a
        "requeued" task event carrying ``c``)."""
        if self.on_task_event is not None:
            self.on_task_event(slot, "requeued", c)
        run_id = slot.run.run_id
        q = self.subs.get(run_id)
        if q is None:
            q = self.subs[run_id] = deque()
        q.appendleft(slot)

    def requeue_withdrawn(
        self, slot: TaskSlot, lane: WorkerThread, why: str, *, requeue: bool = True
    ) -> None:
        """A task the SUB pump queued behind ``lane``'s running one and took back before
        the child claimed it (another lane is free, a reload): it never ran, so it goes
        back to the head of its run's SUB queue (a "requeued" task event naming ``why``).
        Without ``requeue`` (its run is being cancelled) it is only left READY."""
        self._unclaim_sub(slot)
        self.stats["dispatched"] -= 1
        if requeue:
            c = WorkerCompletion(
                WorkerDispatch(slot, 0),
                lane.worker_id,
                WorkerType.SUB,
                Outcome.ENDPOINT_FAILURE,
                NOT_PICKED_UP,
                why,
            )
            self._requeue_sub(slot, c)

    def _complete_slot(self, slot: TaskSlot) -> None:
        slot.state = SlotState.COMPLETED
        run = slot.run
        run.remaining -= 1
        run.counts["done"] += 1
        if slot.pins:
            self._unpin(slot)
        consumers = slot.consumers
        if consumers:
            for consumer in consumers:
                consumer.deps -= 1
                if consumer.deps == 0 and consumer.state == SlotState.PENDING:
                    consumer.state = SlotState.READY
                    self.enqueue_ready(consumer)
            slot.consumers = ()

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
            s.consumers = ()
            first = False

    def _unpin(self, slot: TaskSlot) -> None:
        if slot.pins:
            for b in slot.pins:
                self._unpin_key(b)
            slot.pins = ()

    def _unpin_key(self, key: Any) -> None:
        if isinstance(key, int):
            self.heap.unpin(key)
        elif self.remote is not None:  # (owner, buffer id, generation)
            self.remote.unpin(key)
