"""The per-task SUB path in C (``scheduler/subpump.py`` over ``_mailbox.sub_pump``).

The Scheduler hands one run's SUB queue to ``_mailbox.sub_pump``, which polls, completes
and publishes for every SUB lane in one call; the Python Scheduler keeps the policy.
Real SUB children, under ``fifo`` and ``fair`` admission: many tasks, failures and a
child crash in the middle of a batch, a cancel (and a terminate) in the middle of one,
return values, a reload hold; and no Scheduler round per submitted task.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from simpler_daemon import RunCancelled, Tag, TaskArgs, TaskError, Worker
from simpler_daemon.engine.orchestrator import Orchestrator
from simpler_daemon.mailbox import _mailbox
from simpler_daemon.scheduler.dispatch import SUBMIT_BATCH, Scheduler
from simpler_daemon.scheduler.runmodel import SlotState
from simpler_daemon.testing import child_pids
from tests.support.sub_tasks import targs

pytestmark = pytest.mark.timeout(120)


# -- SUB callables (module level: the children inherit them) ------------------------------------


def index_of(args: Any) -> int:
    return int(args.scalars[0])


def fail_some(args: Any) -> None:
    if int(args.scalars[0]) % 7 == 3:
        raise ValueError(f"task {int(args.scalars[0])} failed on purpose")


def crash_at(args: Any) -> None:
    """Exit the child at the task whose scalars[0] == scalars[1] (the first time only:
    tensors[0][0] remembers), once the orchestration has submitted every task
    (tensors[0][1] set; 30 s at most)."""
    flag = args.tensors[0]
    if int(args.scalars[0]) == int(args.scalars[1]) and flag[0] == 0:
        deadline = time.monotonic() + 30.0
        while flag[1] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        flag[0] = 1
        os._exit(3)


def nap(args: Any) -> None:
    time.sleep(int(args.scalars[0]) / 1e6)


def burn(args: Any) -> None:
    """Burn scalars[0] µs of this thread's CPU (a CPU-bound task, W3's kind)."""
    end = time.thread_time_ns() + int(args.scalars[0]) * 1000
    while time.thread_time_ns() < end:
        pass


def empty(args: Any) -> None:
    return None


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(params=["fifo", "fair"])
def worker(request: pytest.FixtureRequest) -> Iterator[Worker]:
    w = Worker(num_sub_workers=2, admission=request.param)
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def pumped(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many slots ``sub_pump`` published (the C path), call by call."""
    counts: list[int] = []
    real = _mailbox.sub_pump

    def spy(*a: Any) -> int:
        n: int = real(*a)
        counts.append(n)
        return n

    monkeypatch.setattr(_mailbox, "sub_pump", spy)
    return counts


def sched(w: Worker) -> Scheduler:
    assert w.scheduler is not None
    return w.scheduler


def orch_of(h: Any, n: int) -> Any:
    """An orchestration submitting ``n`` tasks of ``h`` (scalars[0] = the index)."""

    def orch(o: Orchestrator, args: Any = None, config: Any = None) -> None:
        submit_n(o, h, n)

    return orch


def submit_n(o: Orchestrator, h: Any, n: int, *extra: int) -> None:
    for i in range(n):
        a = TaskArgs()
        a.add_scalar(i)
        for x in extra:
            a.add_scalar(x)
        o.submit_sub(h, a)


# -- tests ----------------------------------------------------------------------------------------


def test_many_tasks_go_through_the_c_loop(worker: Worker, pumped: list[int]) -> None:
    h = worker.register(index_of)
    worker.init()
    n = 3000

    def orch(o: Orchestrator, args: Any = None, config: Any = None) -> None:
        submit_n(o, h, n)

    handle = worker.submit(orch)
    assert handle.result(timeout=60) == list(range(n))
    run = handle.run
    assert run.counts == {"done": n, "failed": 0, "running": 0, "skipped": 0}
    assert all(s.state == SlotState.COMPLETED for s in run.slots)
    # Most publications came from C (the Python path takes only what the pump left).
    assert sum(pumped) >= n // 2, f"{sum(pumped)} of {n} published by sub_pump"
    assert sched(worker).stats["dispatched"] >= n


def test_no_scheduler_round_per_submitted_task(worker: Worker) -> None:
    h = worker.register(empty)
    worker.init()
    n = 2000
    seen: list[int] = []

    def orch(o: Orchestrator, args: Any = None, config: Any = None) -> None:
        seen.append(sched(worker).stats["rounds"])
        for _ in range(n):
            o.submit_sub(h, TaskArgs())
        seen.append(sched(worker).stats["rounds"])

    worker.run(orch)
    rounds = seen[1] - seen[0]
    # A round per SUBMIT_BATCH submits, plus one per submit that found a SUB worker idle
    # (a child that finished everything dispatched so far): far from one per submit.
    assert SUBMIT_BATCH > 4
    assert rounds <= n // 4, f"{rounds} rounds for {n} submits"


def test_failures_mid_batch(worker: Worker, pumped: list[int]) -> None:
    h = worker.register(fail_some)
    worker.init()
    n = 300

    def orch(o: Orchestrator, args: Any = None, config: Any = None) -> None:
        submit_n(o, h, n)

    handle = worker.submit(orch)
    with pytest.raises(TaskError, match=r"task (\d+) failed on purpose") as info:
        handle.wait(timeout=60)
    assert info.value.outcome == "TASK_FAILURE"
    run = handle.run
    # The first failure to come back fails the run: task 3's, or that of a later failing
    # task when task 3's child was slower to report (two children, a loaded machine).
    # The orchestration's next submit raises, so the tasks not started by then are
    # skipped; every task that ran ended as it should.
    m = re.search(r"task (\d+) failed on purpose", str(info.value))
    assert m is not None
    first = int(m.group(1))
    assert first % 7 == 3
    assert run.slots[first].state == SlotState.FAILED
    assert run.slots[3].state == SlotState.FAILED  # dispatched before any failure
    assert run.counts["running"] == 0
    assert sum(run.counts.values()) == len(run.slots)
    for slot in run.slots:
        assert slot.state in (SlotState.COMPLETED, SlotState.FAILED)
        if slot.state == SlotState.COMPLETED:
            assert slot.index % 7 != 3
    assert run.counts["done"] >= 3
    # The workers keep serving; the C loop runs the next run.
    h2 = worker.register(index_of)
    before = sum(pumped)
    assert worker.submit(orch_of(h2, 200)).result(60) == list(range(200))
    assert sum(pumped) > before


def test_a_child_crash_mid_batch(worker: Worker) -> None:
    h = worker.register(crash_at)
    worker.init()
    flag = worker.alloc((2,), "int64")
    n = 400

    def orch(o: Orchestrator, args: Any = None, config: Any = None) -> None:
        # The crash waits for the last submit: a crash while the orchestration still
        # submits fails the run first, and its later submits then raise (run alone, this
        # test's orchestration was slower than 150 tasks and failed 41 of them).
        for i in range(n):
            o.submit_sub(h, targs((flag, Tag.NO_DEP), scalars=(i, 150)))
        flag[1] = 1

    handle = worker.submit(orch)
    with pytest.raises(TaskError, match="endpoint failure on sub worker") as info:
        handle.wait(timeout=60)
    assert info.value.outcome == "ENDPOINT_FAILURE"
    run = handle.run
    assert run.counts["running"] == 0
    assert run.counts["failed"] == 1 and run.counts["done"] == n - 1
    assert run.slots[150].state == SlotState.FAILED
    # The next run drives the replacement (rounds replace a dead lane) and uses both
    # workers again.
    h2 = worker.register(index_of)
    assert worker.submit(orch_of(h2, 100)).result(60) == list(range(100))
    assert worker.restarts["sub"] >= 1


@pytest.mark.parametrize("terminate", [False, True])
def test_cancel_mid_batch(worker: Worker, terminate: bool) -> None:
    h = worker.register(nap)
    worker.init()
    n = 2000

    def orch(o: Orchestrator, args: Any = None, config: Any = None) -> None:
        for _ in range(n):
            a = TaskArgs()
            a.add_scalar(2000)  # 2 ms each
            o.submit_sub(h, a)

    handle = worker.submit(orch)
    run = handle.run
    deadline = time.monotonic() + 60
    while run.counts["done"] < 10:
        assert time.monotonic() < deadline, run.counts
        time.sleep(0.002)
    assert handle.cancel(terminate=terminate)
    with pytest.raises(RunCancelled):
        handle.wait(timeout=60)
    counts = dict(run.counts)
    assert counts["running"] == 0
    assert counts["done"] + counts["failed"] + counts["skipped"] == n
    assert counts["done"] < n - 100, counts
    states = {s.state for s in run.slots}
    assert states <= {SlotState.COMPLETED, SlotState.FAILED}
    # Nothing of the cancelled run is left on the lanes, and the next run works.
    h2 = worker.register(index_of)
    assert worker.submit(orch_of(h2, 50)).result(60) == list(range(50))


def test_results_through_the_c_loop(worker: Worker, pumped: list[int]) -> None:
    h = worker.register(index_of)
    worker.init()
    refs: list[Any] = []

    def orch(o: Orchestrator, args: Any = None, config: Any = None) -> None:
        for i in range(500):
            a = TaskArgs()
            a.add_scalar(i)
            refs.append(o.submit_sub(h, a))

    handle = worker.submit(orch)
    handle.wait(timeout=60)
    assert [r.result() for r in refs] == list(range(500))
    assert handle.run.encoded_results()[7] == (7, None, b"\x07")
    assert sum(pumped) > 0


def test_a_reload_hold_stops_the_c_loop(worker: Worker, pumped: list[int]) -> None:
    h = worker.register(index_of)
    worker.init()
    s = sched(worker)
    flag = np.zeros(1)
    with worker._driver.lock, s.holding(h.digest):

        def orch(o: Orchestrator, args: Any = None, config: Any = None) -> None:
            flag[0] = 1
            submit_n(o, h, 300)

        handle = worker.submit(orch)
        run = handle.run
        for _ in range(200):
            s.round()
        assert flag[0] == 1
        assert run.counts["running"] == 0 and run.counts["done"] == 0
        assert sum(pumped) == 0
    assert handle.result(timeout=60) == list(range(300))
    assert sum(pumped) > 0


@pytest.fixture(params=["fifo", "fair"])
def wide_gate_worker(request: pytest.FixtureRequest) -> Iterator[Worker]:
    """A Worker whose spin gate counts a completion within 2 ms as a hit (the default is
    200 µs): an empty task comes back within it even on an overloaded machine."""
    w = Worker(num_sub_workers=2, admission=request.param, scheduler_spin_s=0.002)
    try:
        yield w
    finally:
        w.close()


def test_a_spin_that_yields_its_core_to_busy_children_goes_on_spinning() -> None:
    """The pump judges a spinning call by the CPU it took per completion it caught, not
    by its wall time. Pinned with both children to one CPU, the parent's spin hands that
    core to a child at every yield: a call that waits for 500 µs tasks takes little
    CPU per task, so spinning stays on (the wall-time rule turned it off, and each task then
    cost a park, a wake-up and a Python round of the parent's CPU, taken from the
    children)."""
    cpu = min(os.sched_getaffinity(0))
    me = os.getpid()
    tids = [int(t) for t in os.listdir(f"/proc/{me}/task")]
    before = {tid: os.sched_getaffinity(tid) for tid in tids}
    others = child_pids(me)
    w = Worker(num_sub_workers=2)
    try:
        h = w.register(burn)
        w.init()
        pids = sorted(child_pids(me) - others)  # the worker's children
        assert pids, "the worker forked no children"
        threads = [int(t) for t in os.listdir(f"/proc/{me}/task")]
        for pid in [*threads, *pids]:
            os.sched_setaffinity(pid, {cpu})

        def orch(o: Orchestrator, args: Any = None, config: Any = None) -> None:
            for _ in range(1000):
                o.submit_sub(h, targs(scalars=(500,)))

        w.run(orch)
        pump = sched(w)._pump
        assert pump.hit_rate >= 0.5, f"the pump stopped spinning: hit rate {pump.hit_rate}"
    finally:
        w.close()
        for tid, mask in before.items():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, mask)


def test_pumped_tasks_feed_the_schedulers_spin_gate(
    wide_gate_worker: Worker, pumped: list[int]
) -> None:
    """The tasks the C loop completes are samples of the Scheduler's
    spin-or-park gate too (spingate.py): long ones turn spinning off, short ones back on."""
    worker = wide_gate_worker
    h_nap, h_empty = worker.register(nap), worker.register(empty)
    worker.init()
    gate = sched(worker).spin_gate
    assert not gate.parking_mode
    slow_us = 20 * int(worker.scheduler_spin_s * 1e6)

    def fast(o: Orchestrator, args: Any = None, config: Any = None) -> None:
        submit_n(o, h_empty, 500)

    def slow(o: Orchestrator, args: Any = None, config: Any = None) -> None:
        for _ in range(40):
            a = TaskArgs()
            a.add_scalar(slow_us)
            o.submit_sub(h_nap, a)

    worker.run(slow)
    assert sum(pumped) > 0
    assert gate.parking_mode, f"hit rate {gate.hit_rate} after 40 pumped {slow_us} µs tasks"
    for _ in range(40):
        worker.run(fast)
        if not gate.parking_mode:
            break
    assert not gate.parking_mode, f"still parking after fast pumped runs: {gate.hit_rate}"


def test_a_task_event_listener_that_fails_a_pumped_task_fails_it(
    worker: Worker, pumped: list[int]
) -> None:
    """The daemon's result limit (``limits.max_run_result_bytes``) fails a task from the
    Scheduler's task-event listener: a task the C loop completed must honour that
    exactly like one the Python path completed (it was counted a success before)."""
    from simpler_daemon.endpoints.base import Outcome
    from simpler_daemon.scheduler.runmodel import FailureInfo

    h = worker.register(index_of)
    worker.init()
    n = 400
    refused = 137

    def listener(slot: Any, what: str, c: Any) -> None:
        if what == "completed" and slot.index == refused and c is not None:
            c.outcome = Outcome.TASK_FAILURE
            if slot.failure is None:
                slot.failure = FailureInfo(Outcome.TASK_FAILURE, "refused by the listener")

    sched(worker).on_task_event = listener

    def orch(o: Orchestrator, args: Any = None, config: Any = None) -> None:
        submit_n(o, h, n)

    handle = worker.submit(orch)
    with pytest.raises(TaskError, match="refused by the listener"):
        handle.result(timeout=60)
    assert sum(pumped) > 0
    assert handle.run.counts["failed"] >= 1


def test_a_slow_orchestration_keeps_the_workers_busy(worker: Worker) -> None:
    """Without a round per submit, a worker that finished must still get the next task
    at the next submit (it is busy until a round sees the completion): an orchestration
    that works between its submits overlaps with its tasks."""
    h = worker.register(nap)
    worker.init()
    n = 20
    dispatched: list[int] = []

    def orch(o: Orchestrator, args: Any = None, config: Any = None) -> None:
        before = sched(worker).stats["dispatched"]
        for _ in range(n):
            a = TaskArgs()
            a.add_scalar(2000)  # a 2 ms task
            o.submit_sub(h, a)
            end = time.perf_counter() + 0.002  # the orchestration's own work (CPU)
            while time.perf_counter() < end:
                pass
        dispatched.append(sched(worker).stats["dispatched"] - before)

    worker.run(orch)
    # Before: a finished worker looked busy until the 32nd submit (3 of 20 dispatched).
    assert dispatched[0] >= n // 2, f"{dispatched[0]} of {n} dispatched during the orchestration"
