"""A SUB lane's queue frame (``Worker(sub_queue_depth=2)``, the default).

While every SUB child runs a task, the SUB pump publishes the next one into the free
task frame of a busy child running a task of the same run: the child claims it
(TASK_READY -> TASK_LAUNCHED) as soon as its task ends, without waiting for this process. The queued task is the lane's
``staged`` dispatch until then. It is taken back unstarted when another lane frees up
first (the tail of a run, a long task ahead of it) or when a reload of its callable
begins; a child that dies leaves it unstarted, so it is queued again and runs elsewhere;
its deadline runs from its start, not from its publication; a cancel of its run takes
it back and skips it.

Real SUB children held by tasks that wait on a heap flag (released by the test, never
by a timer); every wait polls with a deadline.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from simpler_daemon import CallConfig, RunCancelled, Tag, Worker
from simpler_daemon.endpoints.local import LocalMailboxEndpoint
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.layout import OFF_STATE, MailboxState
from simpler_daemon.scheduler.runmodel import SlotState
from simpler_daemon.scheduler.subpump import SubPump
from simpler_daemon.testing import poll_for
from tests.support import sub_tasks
from tests.support.sub_tasks import targs

pytestmark = pytest.mark.timeout(120)

#: How long a wait for something that must happen at once may take on a loaded machine.
SOON_S = 30.0
#: A held task's own deadline (ms): longer than any wait of the test.
HOLD_MS = 90_000


class Rig:
    """A started Worker of two SUB children; ``hold`` starts a task that waits on flag i."""

    def __init__(self, w: Worker) -> None:
        self.w = w
        self.flags = w.alloc((8,), np.int64)
        self.pids = w.alloc((8,), np.int64)
        self.h = w.registry.active()[0].spec.handle
        self.runs: dict[int, Any] = {}

    def submit(self, *tasks: int, configs: dict[int, CallConfig] | None = None) -> Any:
        """One run of wait_flag tasks (flag and pid index i each, in this order)."""
        per = configs or {}
        todo = [
            (
                targs((self.flags, Tag.NO_DEP), (self.pids, Tag.NO_DEP), scalars=(i, i, HOLD_MS)),
                per.get(i),
            )
            for i in tasks
        ]
        h = self.h

        def orch(o: Any, a: Any = None, c: Any = None) -> None:
            for args, config in todo:
                o.submit_sub(h, args, config)

        run = self.w.submit(orch)
        for i in tasks:
            self.runs[i] = run
        return run

    def hold(self, i: int) -> int:
        """Submit task i and wait until it runs; its child's pid."""
        self.submit(i)
        return int(poll_for(lambda: int(self.pids[i]), SOON_S, message=f"task {i} never started"))

    def lanes(self) -> list[Any]:
        assert self.w.scheduler is not None
        return list(self.w.scheduler.manager.sub)

    def lane_of(self, pid: int) -> Any:
        return next(ln for ln in self.lanes() if ln.endpoint.child.pid == pid)

    def queued_lane(self) -> Any:
        """The lane whose queue frame holds a task (waits for one)."""
        return poll_for(
            lambda: next((ln for ln in self.lanes() if ln.staged is not None), None),
            SOON_S,
            message="no task was queued behind a busy child",
        )

    def release(self, i: int) -> None:
        self.flags[i] = 1

    def finish(self) -> None:
        """Release every flag and wait for every run."""
        self.flags[:] = 1
        for run in self.runs.values():
            poll_for(run.done, SOON_S, message="a run never ended")


@pytest.fixture
def rig() -> Iterator[Rig]:
    # ``fair``: a run's tasks start while an earlier run still runs (under ``fifo`` only
    # the head run's do), so each held task can be its own run.
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20, admission="fair")
    w.register(sub_tasks.wait_flag)
    w.init()
    r = Rig(w)
    try:
        yield r
    finally:
        r.flags[:] = 1
        w.close()


def both_held_and_one_queued(
    r: Rig, configs: dict[int, CallConfig] | None = None
) -> tuple[Any, Any]:
    """Task 1 (a run of its own) holds one child; a run of tasks 0 and 2 holds the other
    with task 0, and task 2 waits in that child's queue frame (behind a task of its own
    run). Returns (the lane with task 2 queued, the other lane)."""
    pid1 = r.hold(1)
    r.submit(0, 2, configs=configs)
    pid0 = int(poll_for(lambda: int(r.pids[0]), SOON_S, message="task 0 never started"))
    assert pid0 != pid1
    queued = r.queued_lane()
    other = next(ln for ln in r.lanes() if ln is not queued)
    assert queued.staged.task_slot.run is r.runs[2].run is r.runs[0].run
    ep = queued.endpoint
    assert isinstance(ep, LocalMailboxEndpoint) and ep.queue_frame
    frame = next(fr for fr in ep._frames if fr.dispatch is queued.staged)
    assert _mb.load32(ep.buf, frame.off + OFF_STATE) == int(MailboxState.TASK_READY)
    assert r.pids[2] == 0  # not started: its child still runs the held task
    return queued, other


def held_index(r: Rig, lane: Any) -> int:
    """The flag index of the task ``lane``'s child runs."""
    pid = lane.endpoint.child.pid
    return next(i for i in (0, 1) if int(r.pids[i]) == pid)


def test_the_queued_task_runs_next_on_the_same_child(rig: Rig) -> None:
    queued, _ = both_held_and_one_queued(rig)
    pid = queued.endpoint.child.pid
    rig.release(held_index(rig, queued))
    assert poll_for(lambda: int(rig.pids[2]), SOON_S, message="the queued task never ran") == pid
    rig.finish()
    for run in rig.runs.values():
        run.result(timeout=SOON_S)


def test_a_free_lane_takes_the_queued_task_back_unstarted(rig: Rig) -> None:
    """The other child frees up while the queued task's child is still busy (a long task
    ahead of it): the task runs there, without waiting for the busy child's."""
    queued, other = both_held_and_one_queued(rig)
    run = rig.runs[2].run
    charged = (run.vpass, run.share.vpass)  # tasks 0 and 2, one fair charge each
    rig.release(held_index(rig, other))
    got = poll_for(lambda: int(rig.pids[2]), SOON_S, message="the queued task never moved")
    assert got == other.endpoint.child.pid
    assert rig.flags[0] == 0 and not rig.runs[0].done()  # task 0 still held
    assert queued.staged is None
    # Taken back, its charge was refunded; its second dispatch charged it: once in all.
    assert (run.vpass, run.share.vpass) == charged
    rig.finish()
    rig.runs[2].result(timeout=SOON_S)


def test_a_queued_task_of_a_child_that_dies_runs_elsewhere(rig: Rig) -> None:
    """The held task's child is killed: the task queued behind it never started, so it
    is queued again and runs on another child; the held task is retried (a crash)."""
    queued, _ = both_held_and_one_queued(rig, {0: CallConfig(max_retries=1, retry_on=("crash",))})
    victim = queued.endpoint.child.pid
    assert held_index(rig, queued) == 0
    rig.pids[0] = 0
    os.kill(victim, signal.SIGKILL)
    got = poll_for(lambda: int(rig.pids[2]), SOON_S, message="the queued task was lost")
    assert got != victim
    rig.release(2)  # the retry of task 0 may wait behind it
    retried = poll_for(lambda: int(rig.pids[0]), SOON_S, message="task 0 was not retried")
    assert retried != victim
    rig.finish()
    rig.runs[0].result(timeout=SOON_S)  # both tasks of the run succeeded
    rig.runs[1].result(timeout=SOON_S)


def test_a_terminated_runs_queued_task_never_runs(rig: Rig) -> None:
    queued, _ = both_held_and_one_queued(rig)
    victim = queued.endpoint.child.pid
    rig.runs[0].cancel(terminate=True)
    with pytest.raises(RunCancelled):
        rig.runs[0].result(timeout=SOON_S)
    assert rig.pids[2] == 0  # the queued task never started
    poll_for(
        lambda: all(ln.endpoint.child.pid != victim for ln in rig.lanes()),
        SOON_S,
        message="the killed child was not replaced",
    )
    rig.finish()
    rig.runs[1].result(timeout=SOON_S)
    assert rig.pids[2] == 0


def test_a_queued_tasks_deadline_runs_from_its_start(rig: Rig) -> None:
    queued, _ = both_held_and_one_queued(rig, {2: CallConfig(deadline_ms=HOLD_MS)})
    pid0, pid1 = int(rig.pids[0]), int(rig.pids[1])
    ep = queued.endpoint
    d = queued.staged
    frame = next(fr for fr in ep._frames if fr.dispatch is d)
    assert frame.deadline_ms == HOLD_MS and frame.deadline_at == 0.0  # not started
    rig.release(held_index(rig, queued))
    poll_for(lambda: int(rig.pids[2]), SOON_S, message="the queued task never ran")
    poll_for(
        lambda: queued.active is d and frame.deadline_at > 0.0,
        SOON_S,
        message="the queued task's deadline never started",
    )
    rig.finish()
    assert {pid0, pid1} == {ln.endpoint.child.pid for ln in rig.lanes()}


def test_sub_queue_depth_1_queues_nothing() -> None:
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20, admission="fair", sub_queue_depth=1)
    w.register(sub_tasks.wait_flag)
    w.init()
    r = Rig(w)
    try:
        r.hold(1)
        r.submit(0, 2)
        poll_for(lambda: int(r.pids[0]), SOON_S, message="task 0 never started")
        assert all(ln.staged is None for ln in r.lanes())
        assert all(not ln.endpoint.queue_frame for ln in r.lanes())
        assert r.pids[2] == 0
        r.release(0)
        assert poll_for(lambda: int(r.pids[2]), SOON_S) == int(r.pids[0])
        r.finish()
    finally:
        r.flags[:] = 1
        w.close()


@pytest.mark.parametrize("bad", [0, 3, True, "2", None])
def test_a_bad_sub_queue_depth_is_refused_naming_it(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"sub_queue_depth=.* must be 1 or 2"):
        Worker(num_sub_workers=1, sub_queue_depth=bad)


def test_a_reload_takes_back_a_queued_task_of_its_callable() -> None:
    """A task queued behind a busy child has not started: a reload of its callable
    takes it back to its run's queue, so it runs the code the reload installs."""
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20, admission="fair")
    w.register("tests.support.sub_tasks:wait_flag")
    w.init()
    r = Rig(w)
    reloader: threading.Thread | None = None
    try:
        queued, _ = both_held_and_one_queued(r)
        reloaded: list[Any] = []
        reloader = threading.Thread(
            target=lambda: reloaded.append(
                w.register("tests.support.sub_tasks:wait_flag", reload=True)
            )
        )
        reloader.start()
        # The reload waits for the busy children; the queued task is back in its queue.
        poll_for(lambda: queued.staged is None, SOON_S, message="the queued task stayed queued")
        assert r.pids[2] == 0 and not reloaded
        r.finish()
        reloader.join(SOON_S)
        assert reloaded and reloaded[0].hashid == r.h.hashid
        r.runs[2].result(timeout=SOON_S)
        assert r.pids[2] != 0
    finally:
        r.flags[:] = 1
        if reloader is not None:
            reloader.join(SOON_S)
        w.close()


def test_a_cancelled_runs_queued_task_never_runs(rig: Rig) -> None:
    """A plain cancel (no terminate): the task ahead runs to its end, the one queued
    behind it has not started, so it is taken back and skipped with the run."""
    queued, _ = both_held_and_one_queued(rig)
    run = rig.runs[0]
    assert run.cancel()
    assert queued.staged is None  # taken back at once
    rig.release(0)  # task 0 runs to its end
    with pytest.raises(RunCancelled):
        run.result(timeout=SOON_S)
    assert rig.pids[2] == 0 and run.run.counts["skipped"] + run.run.counts["failed"] >= 1
    rig.finish()
    rig.runs[1].result(timeout=SOON_S)
    assert rig.pids[2] == 0


def test_a_round_that_leaves_every_frame_busy_makes_one_pump_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under fifo a driver round chains pump calls while the queue's head is ready, so a
    dependency chain's next task goes out in the same round. When the call left every
    frame busy and calls do not spin (long tasks), a second call could only poll the
    frames: the round makes one (500 µs tasks paid ~20 µs of parent CPU each for it).

    Counted for the drive call that published task 4 (the refill of the queue frame
    task 0's child took task 2 from), with the counting in place before the run starts:
    patched later, a drive call already under way when task 0 ended could publish it
    unseen (a flaky test: CI of 2026-12-03)."""
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20)
    w.register(sub_tasks.wait_flag)
    w.init()
    r = Rig(w)
    refills: list[int] = []  # round calls of the drive call that published task 4
    calls = [0]
    slots: list[Any] = []
    real_round, real_drive = SubPump.round, SubPump.drive

    def counted_round(self: SubPump, *a: Any, **k: Any) -> bool:
        calls[0] += 1
        return real_round(self, *a, **k)

    def counted_drive(self: SubPump, *a: Any, **k: Any) -> bool:
        calls[0] = 0
        self.hit_rate = 0.0  # long tasks: the pump does not spin
        waiting = len(slots) > 4 and slots[4].state is SlotState.READY
        did = real_drive(self, *a, **k)
        if waiting and slots[4].state is not SlotState.READY:
            refills.append(calls[0])
        return did

    monkeypatch.setattr(SubPump, "round", counted_round)
    monkeypatch.setattr(SubPump, "drive", counted_drive)
    try:
        run = r.submit(*range(7))  # two run, two wait queued, three wait in the queue
        slots[:] = run.run.slots
        poll_for(lambda: int(r.pids[0]) and int(r.pids[1]), SOON_S, message="never started")
        poll_for(lambda: all(ln.staged is not None for ln in r.lanes()), SOON_S, message="no queue")
        assert len(slots) == 7 and slots[4].state is SlotState.READY
        r.release(0)  # its child starts a queued task; the round refills the frame
        poll_for(lambda: slots[4].state is not SlotState.READY, SOON_S, message="no round refilled")
        assert refills == [1], f"task 4 was published by {refills} (round calls per drive)"
        monkeypatch.undo()
        r.flags[:] = 1
        run.result(timeout=SOON_S)
    finally:
        r.flags[:] = 1
        w.close()
