"""A Scheduler over in-memory lanes, for the scheduler-table tests (scheduler/test_scheduler_tables.py)
and the fair-admission and run-fault tests that reuse its tables.

The lanes sit on a small in-memory endpoint (``MemEndpoint``) that implements the
WorkerEndpoint protocol of ``endpoints/base.py``: it records every publication and emits a
COMPLETED event only when the test releases that dispatch. The Scheduler is built directly
(no loop, no coroutine) and driven one ``round()`` at a time (``Harness.play`` a table).
"""

from __future__ import annotations

from simpler_daemon.args import CallConfig, TaskArgs
from simpler_daemon.callables import CallableRegistry, spec_for_chip, spec_for_import
from simpler_daemon.endpoints.base import (
    EndpointCaps,
    EndpointEvent,
    EventKind,
    Outcome,
    WorkerDispatch,
)
from simpler_daemon.engine.orchestrator import Orchestrator, Run, RunState, SlotState, TaskSlot
from simpler_daemon.errors import EndpointError
from simpler_daemon.heap import Heap
from simpler_daemon.mailbox.doorbell import Doorbell
from simpler_daemon.scheduler.dispatch import Scheduler
from simpler_daemon.scheduler.lanes import WorkerManager

Row = tuple[list[str], dict[str, list[str]]]


class MemEndpoint:
    """In-memory WorkerEndpoint: records publications; completes what the test releases."""

    def __init__(self, label: str, *, frames: int = 1) -> None:
        self.caps = EndpointCaps(frames, frames == 2, frames)
        self.label = label
        self.poison_reason: str | None = None
        self.refuse: str | None = None
        self.stopping = False
        self.attempts: list[tuple[WorkerDispatch, bool]] = []  # (dispatch, accepted)
        self.live: dict[int, WorkerDispatch] = {}
        self.activated: list[int] = []
        self._events: list[EndpointEvent] = []

    @property
    def poisoned(self) -> bool:
        return self.poison_reason is not None

    def submit_progress(self, d: WorkerDispatch) -> None:
        if self.refuse is not None:
            self.attempts.append((d, False))
            raise EndpointError(f"cannot submit to {self.label}: {self.refuse}")
        assert d.dispatch_id not in self.live
        self.attempts.append((d, True))
        self.live[d.dispatch_id] = d

    def activate_progress(self, dispatch_id: int) -> bool:
        self.activated.append(dispatch_id)
        return dispatch_id in self.live

    def poll_progress(self, out: list[EndpointEvent]) -> None:
        out.extend(self._events)
        self._events.clear()

    def owned(self) -> int:
        return len(self.live)

    def request_stop(self) -> None:
        self.stopping = True

    # test side
    def complete(
        self, d: WorkerDispatch, outcome: Outcome = Outcome.SUCCESS, message: str = ""
    ) -> None:
        del self.live[d.dispatch_id]
        error = 0 if outcome is Outcome.SUCCESS else 1
        self._events.append(EndpointEvent(EventKind.COMPLETED, d, outcome, error, message))


class Harness:
    """A Scheduler over in-memory lanes, with naming helpers for tables."""

    def __init__(
        self, next_level: tuple[int, ...] = (0, 1), subs: int = 0, frames: int = 1
    ) -> None:
        self.heap = Heap(1 << 20)
        self.doorbell = Doorbell()
        self.registry = CallableRegistry()
        chip = spec_for_chip("tests.support.sub_tasks:kernel")
        sub = spec_for_import("tests.support.sub_tasks:fill")
        for spec in (chip, sub):
            assert self.registry.begin_register(spec, frozenset())
            self.registry.commit_register(spec.handle.hashid)
        self.chip = chip.handle
        self.subh = sub.handle
        self.eps: dict[str, MemEndpoint] = {}
        manager = WorkerManager()
        for wid in next_level:
            ep = self.eps[f"nl{wid}"] = MemEndpoint(f"chip {wid}", frames=frames)
            manager.add_next_level_at(wid, ep)
        for i in range(subs):
            ep = self.eps[f"sub{i}"] = MemEndpoint(f"sub {i}")
            manager.add_sub(ep)
        self.sched = Scheduler(manager, self.registry, self.heap, self.doorbell)
        self.admitted: list[Run] = []
        self.sched.on_admit = self.admitted.append
        self.runs: list[Run] = []
        self.names: dict[int, str] = {}  # slot_id -> name
        self._seen = {key: 0 for key in self.eps}

    def close(self) -> None:
        self.doorbell.close()
        self.heap.close()

    # -- building runs ---------------------------------------------------------------------
    def run(self) -> Orchestrator:
        run = Run()
        self.runs.append(run)
        self.sched.submit_run(run)
        return Orchestrator(self.sched, run)

    def _name(self, o: Orchestrator, index: int, name: str) -> TaskSlot:
        slot = o.run.slots[index]
        self.names[slot.slot_id] = name
        return slot

    def nl(
        self,
        o: Orchestrator,
        name: str,
        worker: int,
        a: TaskArgs | None = None,
        config: CallConfig | None = None,
    ) -> TaskSlot:
        return self._name(
            o, o.submit_next_level(self.chip, a or TaskArgs(), config, worker=worker), name
        )

    def group(
        self, o: Orchestrator, name: str, workers: list[int], members: list[TaskArgs] | None = None
    ) -> TaskSlot:
        members = members or [TaskArgs() for _ in workers]
        return self._name(o, o.submit_next_level_group(self.chip, members, workers=workers), name)

    def sub(self, o: Orchestrator, name: str, a: TaskArgs | None = None) -> TaskSlot:
        return self._name(o, o.submit_sub(self.subh, a or TaskArgs()), name)

    def sub_group(self, o: Orchestrator, name: str, n: int) -> TaskSlot:
        return self._name(o, o.submit_sub_group(self.subh, [TaskArgs() for _ in range(n)]), name)

    def done_building(self, o: Orchestrator) -> None:
        self.sched.finish_building(o.run)

    # -- table driving ---------------------------------------------------------------------
    def label(self, d: WorkerDispatch) -> str:
        slot = d.task_slot
        name = self.names.get(slot.slot_id, f"?{slot.index}")
        if slot.is_group:
            name += f"[{d.group_index}]"
        if d.prepare_only:
            name += "+staged"
        return name

    def take(self) -> dict[str, list[str]]:
        """Publications made since the last call, per worker (empty workers omitted)."""
        out: dict[str, list[str]] = {}
        for key, ep in self.eps.items():
            new = ep.attempts[self._seen[key] :]
            self._seen[key] = len(ep.attempts)
            if new:
                out[key] = [self.label(d) + ("" if ok else "(refused)") for d, ok in new]
        return out

    def find(self, label: str) -> tuple[MemEndpoint, WorkerDispatch]:
        for ep in self.eps.values():
            for d in ep.live.values():
                if self.label(d) == label:
                    return ep, d
        raise AssertionError(f"no live dispatch {label!r}; live: {self.live()}")

    def live(self) -> dict[str, list[str]]:
        return {
            k: [self.label(d) for d in ep.live.values()] for k, ep in self.eps.items() if ep.live
        }

    def release(self, *events: str) -> None:
        for ev in events:
            label, bang, message = ev.partition("!")
            ep, d = self.find(label)
            ep.complete(d, Outcome.TASK_FAILURE if bang else Outcome.SUCCESS, message)

    def play(self, table: list[Row]) -> None:
        for i, (released, expected) in enumerate(table):
            self.release(*released)
            self.sched.round()
            got = self.take()
            assert got == expected, f"row {i} {released}: dispatched {got}, expected {expected}"

    # -- invariants ------------------------------------------------------------------------
    def validate(self) -> None:
        sched = self.sched
        live_slots: set[int] = set()
        for lane in sched.manager.lanes:
            ep = lane.endpoint
            assert isinstance(ep, MemEndpoint)
            assert lane.inflight == ep.owned(), (
                f"{ep.label}: lane inflight {lane.inflight} != owned {ep.owned()}"
            )
            ids = {d.dispatch_id for d in (lane.active, lane.staged) if d is not None}
            assert ids == set(ep.live), (
                f"{ep.label}: lane holds {ids}, endpoint owns {set(ep.live)}"
            )
            live_slots.update(id(d.task_slot) for d in ep.live.values())
        pending_completion = {id(c.dispatch.task_slot) for c in sched.completions}
        queued: set[int] = set()
        for q in sched.subs.values():
            queued.update(id(s) for s in q)
        for q in sched.groups.values():
            queued.update(id(s) for s in q)
        for per in sched.singles.values():
            for q in per.values():
                queued.update(id(s) for s in q)
        every_slot = {id(s) for run in self.runs for s in run.slots}
        assert queued <= every_slot
        for run in self.runs:
            open_slots = [
                s for s in run.slots if s.state not in (SlotState.COMPLETED, SlotState.FAILED)
            ]
            assert run.remaining == len(open_slots), f"{run}: remaining != open slots {open_slots}"
            running = [s for s in run.slots if s.state is SlotState.RUNNING]
            assert run.counts["running"] == len(running), f"{run}: counts {run.counts}"
            if run.terminal:
                assert not open_slots, f"terminal {run} has open slots {open_slots}"
                assert run not in sched.admission.runs()
                assert not any(id(s) in queued for s in run.slots)
                assert run.state is (
                    RunState.FAILED if run.error is not None else RunState.COMPLETED
                )
            for s in open_slots:
                if s.state is SlotState.RUNNING:
                    assert id(s) in live_slots or id(s) in pending_completion, (
                        f"{s} running nowhere"
                    )
                elif s.state is SlotState.READY:
                    assert id(s) in queued, f"{s} READY but in no queue"
                else:
                    producers = [p for p in run.slots if s in p.consumers]
                    assert s.deps == len(producers) > 0, f"{s} PENDING on {producers}"
                    assert all(
                        p.state not in (SlotState.COMPLETED, SlotState.FAILED) for p in producers
                    )
