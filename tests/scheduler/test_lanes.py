"""Lanes (``WorkerThread``) and ``WorkerManager`` (``scheduler/lanes.py``).

Most tests use a scripted in-process endpoint; the ones about real behaviour
(poisoned endpoint, completion order, two-step stop) drive a forked child.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from simpler_daemon.callables import spec_for_object
from simpler_daemon.endpoints.base import (
    EndpointCaps,
    EndpointEvent,
    EventKind,
    Outcome,
    WorkerDispatch,
)
from simpler_daemon.errors import EndpointError
from simpler_daemon.scheduler.lanes import WorkerCompletion, WorkerManager, WorkerThread, WorkerType
from simpler_daemon.testing import poll_for
from tests.support import sub_tasks as H
from tests.support.endpoint_rig import Gate, Rig, Slot, blob_for

NOOP = spec_for_object(H.noop)
GATE = spec_for_object(H.gate)
ADD_ONE = spec_for_object(H.add_one)


class FakeEndpoint:
    """A scripted endpoint: accepts (or refuses) submissions, completes on demand."""

    def __init__(self, label: str = "fake", caps: EndpointCaps | None = None) -> None:
        self.caps = caps or EndpointCaps()
        self.label = label
        self.is_poisoned = False
        self.refuse: BaseException | None = None
        self.submitted: list[WorkerDispatch] = []
        self.activated: list[int] = []
        self.pending: list[EndpointEvent] = []
        self.stop_requested = False

    @property
    def poisoned(self) -> bool:
        return self.is_poisoned

    def submit_progress(self, d: WorkerDispatch) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.submitted.append(d)

    def activate_progress(self, dispatch_id: int) -> bool:
        self.activated.append(dispatch_id)
        return True

    def poll_progress(self, out: list[EndpointEvent]) -> None:
        out.extend(self.pending)
        self.pending.clear()

    def owned(self) -> int:
        return len(self.submitted)

    def request_stop(self) -> None:
        self.stop_requested = True

    # test driver
    def finish(
        self, d: WorkerDispatch, outcome: Outcome = Outcome.SUCCESS, accepted: bool = True
    ) -> None:
        if accepted:
            self.pending.append(EndpointEvent(EventKind.ACCEPTED, d))
        self.pending.append(
            EndpointEvent(
                EventKind.COMPLETED, d, outcome, 0 if outcome is Outcome.SUCCESS else 1, "m"
            )
        )


@dataclass
class Recorder:
    """Callbacks in order: ("accept", d) / ("complete", WorkerCompletion) / ("staged", d)."""

    calls: list[tuple[str, Any]] = field(default_factory=list)
    lane: WorkerThread | None = None
    inflight_at_complete: list[int] = field(default_factory=list)

    def on_complete(self, c: WorkerCompletion) -> None:
        self.calls.append(("complete", c))
        if self.lane is not None:
            self.inflight_at_complete.append(self.lane.inflight)

    def on_accept(self, d: WorkerDispatch) -> None:
        self.calls.append(("accept", d))

    def on_staged(self, d: WorkerDispatch, disposition: int) -> None:
        self.calls.append(("staged", d))

    def completions(self) -> list[WorkerCompletion]:
        return [c for k, c in self.calls if k == "complete"]

    def accepts(self) -> list[WorkerDispatch]:
        return [d for k, d in self.calls if k == "accept"]


def new_dispatch(run_id: int = 1) -> WorkerDispatch:
    return WorkerDispatch(Slot(bytes(32), [b""], run_id=run_id))


def lane_with(
    ep: Any, worker_type: WorkerType = WorkerType.SUB, worker_id: int = 0
) -> tuple[WorkerThread, Recorder]:
    rec = Recorder()
    lane = WorkerThread(worker_id, worker_type, ep)
    rec.lane = lane
    lane.start(rec.on_complete, rec.on_accept, rec.on_staged)
    return lane, rec


def assert_one_rejection(rec: Recorder, d: WorkerDispatch, reason: str) -> WorkerCompletion:
    assert [k for k, _ in rec.calls] == ["accept", "complete"]  # one accept, then one completion
    assert rec.accepts() == [d]
    (c,) = rec.completions()
    assert c.dispatch is d and c.outcome is Outcome.ENDPOINT_FAILURE and c.error == -1
    assert reason in c.message, c.message
    return c


# -- lanes: dispatch and rejection ---------------------------------------------------------------


def test_dispatch_assigns_monotonic_ids_and_tracks_capacity() -> None:
    ep = FakeEndpoint()
    lane, rec = lane_with(ep)
    assert lane.idle() and not lane.busy() and lane.caps() is ep.caps
    d1 = new_dispatch()
    lane.dispatch(d1)
    assert d1.dispatch_id == 1 and not d1.prepare_only
    assert lane.active is d1 and lane.inflight == 1 and lane.busy() and not lane.idle()
    assert ep.submitted == [d1] and rec.calls == []
    ep.finish(d1)
    lane.progress()
    assert [k for k, _ in rec.calls] == ["accept", "complete"]
    assert rec.completions()[0].outcome is Outcome.SUCCESS
    assert (
        rec.completions()[0].worker_id == 0 and rec.completions()[0].worker_type is WorkerType.SUB
    )
    assert lane.active is None and lane.inflight == 0 and lane.idle()
    d2 = new_dispatch()
    lane.dispatch(d2)
    assert d2.dispatch_id == 2


def test_rejection_occupied_lane() -> None:
    ep = FakeEndpoint()
    lane, rec = lane_with(ep, WorkerType.NEXT_LEVEL, 5)
    first = new_dispatch()
    lane.dispatch(first)
    second = new_dispatch()
    lane.dispatch(second)  # never raises
    c = assert_one_rejection(rec, second, "worker 5 active lane is occupied by dispatch 1")
    assert c.worker_id == 5 and c.worker_type is WorkerType.NEXT_LEVEL
    assert second.dispatch_id == 2 and ep.submitted == [first]
    assert lane.active is first and lane.inflight == 1  # the running dispatch is untouched


def test_rejection_stopping_lane() -> None:
    ep = FakeEndpoint()
    lane, rec = lane_with(ep)
    lane.stop()
    assert ep.stop_requested and lane.stopping and not lane.idle() and not lane.can_stage()
    d = new_dispatch()
    lane.dispatch(d)
    assert_one_rejection(rec, d, "worker 0 is stopping")
    assert ep.submitted == [] and lane.inflight == 0 and lane.active is None


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (
            EndpointError("cannot submit to fake: endpoint poisoned (x)"),
            "cannot submit to fake: endpoint poisoned (x)",
        ),
        (RuntimeError("endpoint bug"), "endpoint raised RuntimeError: endpoint bug"),
        (KeyError("k"), "endpoint raised KeyError"),
    ],
)
def test_rejection_endpoint_refused(exc: BaseException, reason: str) -> None:
    ep = FakeEndpoint()
    ep.refuse = exc
    lane, rec = lane_with(ep)
    d = new_dispatch()
    lane.dispatch(d)
    assert_one_rejection(rec, d, reason)
    assert lane.inflight == 0 and lane.active is None and lane.idle()


def test_rejection_over_capacity_and_staging_on_single_frame() -> None:
    ep = FakeEndpoint(caps=EndpointCaps(1, False, 1))
    lane, rec = lane_with(ep)
    d = new_dispatch()
    lane.dispatch_prepared(d)  # a single-frame lane cannot stage
    assert d.prepare_only and d.dispatch_id == 1
    assert_one_rejection(rec, d, "worker 0 cannot stage")
    assert lane.staged is None and lane.inflight == 0

    two = FakeEndpoint(caps=EndpointCaps(2, True, 1))  # staging supported, capacity 1
    lane2, rec2 = lane_with(two)
    lane2.dispatch(new_dispatch())
    staged = new_dispatch()
    lane2.dispatch_prepared(staged)
    assert_one_rejection(rec2, staged, "worker 0 is over capacity")


def test_staging_and_activation() -> None:
    ep = FakeEndpoint(caps=EndpointCaps(2, True, 2))
    lane, rec = lane_with(ep, WorkerType.NEXT_LEVEL, 3)
    assert lane.can_stage()
    s = new_dispatch(run_id=2)
    lane.dispatch_prepared(s)
    assert lane.staged is s and s.prepare_only and lane.inflight == 1 and not lane.can_stage()
    assert lane.idle()  # a staged successor does not take the active capacity
    ep.pending.append(EndpointEvent(EventKind.FRAME_STAGED, s, disposition=1))
    lane.progress()
    assert rec.calls == [("staged", s)]
    assert lane.activate_prepared(run_id=1) is False  # another run's staged task stays put
    assert lane.activate_prepared(run_id=2) is True
    assert lane.active is s and lane.staged is None and ep.activated == [s.dispatch_id]
    ep.finish(s)
    lane.progress()
    assert lane.active is None and lane.inflight == 0


def test_completions_are_delivered_before_inflight_drops() -> None:
    ep = FakeEndpoint(caps=EndpointCaps(2, True, 2))
    lane, rec = lane_with(ep)
    a, s = new_dispatch(1), new_dispatch(2)
    lane.dispatch(a)
    lane.dispatch_prepared(s)
    ep.finish(a)
    ep.finish(s, Outcome.TASK_FAILURE)
    lane.progress()
    assert rec.inflight_at_complete == [2, 1]  # each completion seen while still counted
    assert [c.outcome for c in rec.completions()] == [Outcome.SUCCESS, Outcome.TASK_FAILURE]
    assert lane.inflight == 0 and lane.active is None and lane.staged is None


def test_unstarted_lane_refuses_loudly() -> None:
    lane = WorkerThread(0, WorkerType.SUB, FakeEndpoint())
    lane.stop()
    with pytest.raises(EndpointError, match=r"before WorkerManager\.start"):
        lane.dispatch(new_dispatch())  # a rejection with nowhere to report it


# -- lanes over a real child ---------------------------------------------------------------------


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig([NOOP, GATE, ADD_ONE])
    try:
        yield r
    finally:
        r.close()


@pytest.mark.timeout(30)
def test_real_lane_completion_before_inflight_drops(rig: Rig) -> None:
    lane, rec = lane_with(rig.endpoint)
    x = rig.heap.alloc(1, "int64")
    for i in range(1, 4):
        d = rig.dispatch(ADD_ONE.handle.digest, blob_for(rig.heap, [x]))
        lane.dispatch(d)
        assert d.dispatch_id == i  # the lane, not the caller, numbers publications
        poll_for(lambda: (lane.progress(), not lane.busy())[1], 10.0)
        assert x[0] == i
    assert rec.inflight_at_complete == [1, 1, 1]
    assert [k for k, _ in rec.calls] == ["accept", "complete"] * 3
    assert all(c.outcome is Outcome.SUCCESS for c in rec.completions())


@pytest.mark.timeout(30)
def test_real_lane_rejects_on_poisoned_endpoint(rig: Rig) -> None:
    lane, rec = lane_with(rig.endpoint)
    rig.endpoint.poison("injected by the test")
    assert not lane.idle() and not lane.can_stage()
    d = rig.dispatch(NOOP.handle.digest)
    lane.dispatch(d)  # never raises
    assert_one_rejection(rec, d, "sub worker 0")
    assert "endpoint poisoned (injected by the test)" in rec.completions()[0].message
    assert lane.inflight == 0


@pytest.mark.timeout(30)
def test_real_lane_rejects_second_dispatch_while_occupied(rig: Rig) -> None:
    lane, rec = lane_with(rig.endpoint)
    gate = Gate(rig.heap)
    first = rig.dispatch(GATE.handle.digest, gate.blob)
    lane.dispatch(first)
    poll_for(gate.started, 10.0)
    second = rig.dispatch(NOOP.handle.digest)
    lane.dispatch(second)
    assert_one_rejection(rec, second, "occupied by dispatch 1")
    gate.release()
    poll_for(lambda: (lane.progress(), not lane.busy())[1], 10.0)
    assert [c.outcome for c in rec.completions()] == [Outcome.ENDPOINT_FAILURE, Outcome.SUCCESS]
    assert rec.completions()[1].dispatch is first


# -- manager -------------------------------------------------------------------------------------


def started_manager(
    next_level: dict[int, FakeEndpoint], subs: int = 0
) -> tuple[WorkerManager, Recorder, list[FakeEndpoint]]:
    m = WorkerManager()
    for wid, ep in next_level.items():
        assert m.add_next_level_at(wid, ep) == wid
    sub_eps = [FakeEndpoint(f"sub {i}") for i in range(subs)]
    for i, ep in enumerate(sub_eps):
        assert m.add_sub(ep) == i
    rec = Recorder()
    m.start(rec.on_complete, rec.on_accept, rec.on_staged)
    return m, rec, sub_eps


def test_start_rejects_duplicate_worker_ids() -> None:
    m = WorkerManager()
    m.add_next_level_at(3, FakeEndpoint())
    m.add_next_level_endpoint(FakeEndpoint(), 3)
    with pytest.raises(ValueError, match="duplicate worker id 3"):
        m.start(Recorder().on_complete, Recorder().on_accept)
    assert not m.started and m.lanes == []


def test_start_rejects_negative_worker_ids() -> None:
    m = WorkerManager()
    m.add_next_level_at(-1, FakeEndpoint())
    with pytest.raises(ValueError, match="worker id -1 is negative"):
        m.start(Recorder().on_complete, Recorder().on_accept)
    assert not m.started and m.lanes == []


def test_default_ids_and_exact_lookup() -> None:
    m = WorkerManager()
    assert m.add_next_level_endpoint(FakeEndpoint()) == 0
    assert m.add_next_level_at(7, FakeEndpoint()) == 7
    assert m.add_sub(FakeEndpoint()) == 0
    m.start(Recorder().on_complete, Recorder().on_accept)
    assert m.next_level_worker_ids() == [0, 7]
    assert m.get_worker_by_id(WorkerType.NEXT_LEVEL, 7) is m.next_level[7]
    assert m.get_worker_by_id(WorkerType.NEXT_LEVEL, 1) is None  # exact: no nearest match
    assert m.get_worker_by_id(WorkerType.SUB, 0) is m.sub[0]
    assert m.get_worker_by_id(WorkerType.SUB, 1) is None
    assert m.get_worker_by_id(WorkerType.SUB, -1) is None
    assert len(m.lanes) == 3
    with pytest.raises(EndpointError, match="already started"):
        m.add_sub(FakeEndpoint())
    with pytest.raises(EndpointError, match="already started"):
        m.add_next_level_at(9, FakeEndpoint())


def test_pick_idle_sub_excluding() -> None:
    m, _rec, eps = started_manager({}, subs=4)
    s0, s1, s2, s3 = m.sub
    assert m.pick_idle_sub_excluding() is s0
    assert m.pick_idle_sub_excluding([s0]) is s1
    assert m.pick_idle_sub_excluding((s0, s1)) is s2
    s2.dispatch(new_dispatch())  # busy
    eps[3].is_poisoned = True  # unusable
    assert m.pick_idle_sub_excluding([s0, s1]) is None
    s1.stop()  # stopping
    assert m.pick_idle_sub_excluding([s0]) is None
    assert m.pick_idle_sub_excluding() is s0
    eps[2].finish(s2.active)  # type: ignore[arg-type]
    m.progress()
    assert m.pick_idle_sub_excluding([s0]) is s2
    assert s3.idle() is False


def test_manager_progress_and_busy() -> None:
    nl = {4: FakeEndpoint("nl 4")}
    m, rec, eps = started_manager(nl, subs=1)
    assert not m.busy()
    a, b = new_dispatch(), new_dispatch()
    m.next_level[4].dispatch(a)
    m.sub[0].dispatch(b)
    assert m.busy()
    m.progress()
    assert rec.calls == []
    nl[4].finish(a)
    eps[0].finish(b, Outcome.TASK_FAILURE)
    m.progress()
    assert [(c.worker_type, c.worker_id, c.outcome) for c in rec.completions()] == [
        (WorkerType.NEXT_LEVEL, 4, Outcome.SUCCESS),
        (WorkerType.SUB, 0, Outcome.TASK_FAILURE),
    ]
    assert not m.busy()


def test_two_step_stop_with_fakes() -> None:
    m, rec, eps = started_manager({2: FakeEndpoint()}, subs=2)
    d = new_dispatch()
    m.sub[0].dispatch(d)
    m.stop_workers()
    # Step 1: every lane is stopping, every endpoint was asked to stop; lanes still exist
    # and keep progressing what is in flight.
    assert all(lane.stopping for lane in m.lanes) and len(m.lanes) == 3
    assert all(ep.stop_requested for ep in [*eps, m.next_level[2].endpoint])  # type: ignore[attr-defined]
    late = new_dispatch()
    m.sub[1].dispatch(late)
    assert (
        rec.completions()[0].dispatch is late
        and rec.completions()[0].outcome is Outcome.ENDPOINT_FAILURE
    )
    assert m.busy()
    eps[0].finish(d)
    m.progress()
    assert rec.completions()[-1].dispatch is d and rec.completions()[-1].outcome is Outcome.SUCCESS
    assert not m.busy()
    # Step 2: lanes dropped.
    m.stop()
    assert m.lanes == [] and m.sub == [] and m.next_level == {}
    assert m.get_worker_by_id(WorkerType.NEXT_LEVEL, 2) is None
    assert m.pick_idle_sub_excluding() is None
    m.progress()  # nothing left to progress


@pytest.mark.timeout(30)
def test_two_step_stop_with_a_real_child(rig: Rig) -> None:
    m = WorkerManager()
    m.add_sub(rig.endpoint)
    rec = Recorder()
    m.start(rec.on_complete, rec.on_accept)
    lane = m.sub[0]
    rec.lane = lane
    gate = Gate(rig.heap)
    d = rig.dispatch(GATE.handle.digest, gate.blob)
    lane.dispatch(d)
    poll_for(gate.started, 10.0)
    m.stop_workers()  # no publication after this returns
    assert rig.endpoint.stopping and rig.mailbox.shutdown_requested()
    late = rig.dispatch(NOOP.handle.digest)
    lane.dispatch(late)
    assert rec.completions()[0].dispatch is late
    assert rec.completions()[0].outcome is Outcome.ENDPOINT_FAILURE
    with pytest.raises(EndpointError, match="endpoint is stopping"):
        rig.endpoint.submit_progress(rig.dispatch(NOOP.handle.digest))
    gate.release()  # the running task finishes; then the child leaves
    poll_for(lambda: (m.progress(), not m.busy())[1], 10.0)
    last = rec.completions()[-1]
    assert last.dispatch is d and last.outcome is Outcome.SUCCESS, last.message
    assert rec.inflight_at_complete[-1] == 1
    assert rig.child is not None and rig.child.wait(10.0)
    m.stop()
    assert m.lanes == []
