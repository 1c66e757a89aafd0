"""The ``fair`` admission policy, the engine's side (the daemon's is in
tests/server/test_daemon_fair.py).

Two layers:

* real SUB children under a ``Worker``: a one-task run submitted behind a
  200 x 20 ms run finishes while the big run still has most of its tasks left
  (``fair``) or only after it (``fifo``); two runs of priority 1 and 3 share one
  worker 1 : 3, counted in dispatches;
* the Scheduler's NEXT_LEVEL rules under ``fair`` on the in-memory lanes of
  ``tests/support/scheduler_rig.py`` (round-robin on one chip, staging into the free
  frame only, the admission bound, cancel releasing admission at once).

The Worker tests use ``Worker(admission=...)`` and ``Worker.submit(..., priority=)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import tests.support.chip_worker_rig as tc
import tests.support.scheduler_rig as ts
from simpler_daemon import CallableHandle, Tag, TaskArgs, Worker
from simpler_daemon.args import MAX_PRIORITY, check_priority
from simpler_daemon.endpoints.base import WorkerDispatch
from simpler_daemon.engine.orchestrator import Orchestrator, Run, RunState
from simpler_daemon.engine.worker import RunHandle
from simpler_daemon.scheduler.dispatch import Scheduler
from simpler_daemon.scheduler.fair import FairAdmission
from simpler_daemon.scheduler.subpump import SubPump
from tests.support.sub_tasks import targs
from tests.support.worker_pool import Pool

BIG_TASKS = 200
BIG_TASK_MS = 20


# -- real children ------------------------------------------------------------------------------


#: What ``make_pool`` (tests/conftest.py) registers.
POOL_TASKS = ("sleep_ms", "noop")


def _tasks(handle: CallableHandle, n: int, ms: int) -> Callable[[Orchestrator, Any, Any], None]:
    def orch(o: Orchestrator, _args: Any, _config: Any) -> None:
        for _ in range(n):
            o.submit_sub(handle, targs(scalars=(ms,)))

    return orch


def _small_behind_big(pool: Pool) -> tuple[int, RunHandle, RunHandle]:
    """Submit the big run, then the one-task run; return the big run's remaining task
    count at the moment the small run ended."""
    big = pool.submit(_tasks(pool.h["sleep_ms"], BIG_TASKS, BIG_TASK_MS))
    small = pool.submit(_tasks(pool.h["noop"], 1, 0))
    seen: list[int] = []
    small.run.add_done_callback(lambda _r: seen.append(big.run.remaining))
    small.wait(timeout=60)
    big.wait(timeout=60)
    assert len(seen) == 1
    return seen[0], big, small


@pytest.mark.timeout(120)
def test_fair_one_task_run_finishes_long_before_the_big_run(make_pool: Any) -> None:
    pool = make_pool(2, admission="fair")
    left, big, small = _small_behind_big(pool)
    assert left > BIG_TASKS // 2, f"the small run ended when the big one had {left} tasks left"
    assert small.state is RunState.COMPLETED and big.state is RunState.COMPLETED


@pytest.mark.timeout(120)
def test_fifo_one_task_run_waits_for_the_big_run(make_pool: Any) -> None:
    pool = make_pool(2, admission="fifo")
    left, big, small = _small_behind_big(pool)
    assert left == 0  # whole-run FIFO: B's partition dispatches only once A is done
    assert small.state is RunState.COMPLETED and big.state is RunState.COMPLETED


@pytest.mark.timeout(120)
def test_fair_priorities_share_the_workers_in_proportion(make_pool: Any) -> None:
    pool = make_pool(1, admission="fair")
    n = 60

    def dispatched(run: Run) -> int:
        c = run.counts
        return int(c["done"] + c["running"] + c["failed"])

    # Counted from the moment the high run's orchestration returns: until then the low
    # run may be alone (before it starts, or while a loaded machine holds up its
    # submits), and the worker is never idle while there is work.
    built: list[tuple[int, int]] = []
    build_high = _tasks(pool.h["sleep_ms"], n, 2)

    def high_orch(o: Orchestrator, args: Any, config: Any) -> None:
        build_high(o, args, config)
        built.append((dispatched(low.run), dispatched(o.run)))

    low = pool.submit(_tasks(pool.h["sleep_ms"], n, 2), priority=1)
    high = pool.submit(high_orch, priority=3)
    at_end: list[int] = []
    high.run.add_done_callback(lambda _r: at_end.append(dispatched(low.run)))
    high.wait(timeout=60)
    low.wait(timeout=60)
    assert len(built) == 1 and len(at_end) == 1
    (low_before, high_before) = built[0]
    # While both had work, the low run got one dispatch per three of the high run's.
    low_during, high_during = at_end[0] - low_before, n - high_before
    assert high_during >= 30, f"the high run dispatched {high_before} while it was built"
    expected = high_during / 3
    assert expected - 5 <= low_during <= expected + 5, (
        f"the low run had {low_during} dispatches while the high run made {high_during}"
        f" ({low_before} before, {at_end[0]} at the high run's end)"
    )


@pytest.mark.timeout(120)
def test_a_run_whose_last_task_the_python_path_completed_ends_before_the_pump_goes_on(
    make_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While two runs have SUB work, ``fair`` dispatches in Python; once the high run's
    queue is empty the low run's queue goes through the pump. The round that sees the
    high run's last completion on the Python path handles it before that pump call
    (which, on a loaded machine, can go on for a hundred tasks): the high run ends
    then, not after the low run's batch. Checked on every pump call, not by timing."""
    pool = make_pool(1, admission="fair")
    sched = pool.w.scheduler
    assert sched is not None
    drive = SubPump.drive
    pending: list[int] = []

    def watched(pump: SubPump, *args: Any, **kwargs: Any) -> bool:
        pending.append(len(sched.completions))
        return drive(pump, *args, **kwargs)

    monkeypatch.setattr(SubPump, "drive", watched)
    low = pool.submit(_tasks(pool.h["sleep_ms"], 30, 2), priority=1)
    high = pool.submit(_tasks(pool.h["sleep_ms"], 30, 2), priority=3)
    high.wait(timeout=60)
    low.wait(timeout=60)
    assert pending, "the pump was never driven: the scenario did not reach it"
    assert not any(pending), f"pump calls with completions not yet handled: {pending}"


@pytest.mark.timeout(120)
def test_fair_chip_runs_take_turns_and_keep_the_two_frame_pipeline(tmp_path: Path) -> None:
    w = Worker(
        admission="fair",
        num_sub_workers=0,
        num_chips=1,
        chip_pipeline_depth=2,
        chip_trace_dir=str(tmp_path),
        heap_bytes=4 << 20,
    )
    handles = {
        k: w.register(f"tests.support.chip_kernels:{k}", kind="chip") for k in ("add_one", "gate")
    }
    w.init()
    c = tc.Chips(w, tmp_path, handles)
    try:
        g = c.gate()
        xs = [w.alloc(4, "int64") for _ in range(3)]

        def orch_for(i: int) -> Callable[[Orchestrator, Any, Any], None]:
            def orch(o: Orchestrator, _a: Any, _c: Any) -> None:
                if i == 0:  # holds the chip until run 1 has staged behind it
                    o.submit_next_level(c.k["gate"], g.args(), worker=0)
                for _ in range(4):
                    o.submit_next_level(
                        c.k["add_one"], TaskArgs().add_tensor(xs[i], Tag.NO_DEP), worker=0
                    )

            return orch

        runs = [w.submit(orch_for(i)) for i in range(3)]
        c.release_when(g, lambda: bool(c.successors()))
        tc.wait_all(*runs, timeout=60)
        assert [x.tolist() for x in xs] == [[4] * 4] * 3
        # run 1's first task was staged behind run 0's gate (in the other frame); a run
        # stages at most once ...
        staged = [(e["run"], e["index"]) for e in c.successors()]
        assert staged[0] == (runs[1].run_id, 0), staged
        assert c.successors()[0]["frame"] != runs[0].run.lease_slot & 1
        # (A run that already ran tasks may stage a later one once, behind another run's
        # task, when its turn comes while the chip is busy: which one depends on timing.)
        assert len({r for r, _ in staged}) == len(staged), staged
        # ... and the runs took turns on the chip: run 0 had not finished when the
        # others started.
        done = [(e["run"], e["index"]) for e in c.of("completed")]
        last_of_0 = done.index((runs[0].run_id, 4))
        assert done.index((runs[1].run_id, 0)) < last_of_0
        assert done.index((runs[2].run_id, 0)) < last_of_0
    finally:
        c.close()


# -- the Scheduler's rules on in-memory lanes ---------------------------------------------------


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., ts.Harness]]:
    made: list[ts.Harness] = []

    def factory(max_active_runs: int = 64, **kw: Any) -> ts.Harness:
        monkeypatch.setattr(
            ts,
            "Scheduler",
            functools.partial(Scheduler, admission="fair", max_active_runs=max_active_runs),
        )
        h = ts.Harness(**kw)
        made.append(h)
        return h

    yield factory
    try:
        for h in made:
            h.validate()
            _check_frames(h)
    finally:
        for h in made:
            h.close()


def _check_frames(h: ts.Harness) -> None:
    """No two live dispatches on one two-frame lane use the same task frame."""
    for lane in h.sched.manager.next_level.values():
        live: list[WorkerDispatch] = list(lane.endpoint.live.values())  # type: ignore[attr-defined]
        if lane.endpoint.caps.supports_frame_staging:
            frames = [d.task_slot.lease_slot & 1 for d in live]
            assert len(frames) == len(set(frames)), f"lane {lane.worker_id}: frames {frames}"


def test_fair_every_admitted_run_dispatches_on_an_idle_worker(make: Any) -> None:
    h = make()
    a = h.run()
    b = h.run()
    c = h.run()
    assert h.admitted == [a.run, b.run, c.run]
    assert all(r.state is RunState.EXECUTING for r in h.admitted)
    h.nl(a, "a0", 0)
    h.nl(b, "b0", 1)  # under fifo b0 waits for A (test_only_the_head_run_partition_dispatches)
    h.nl(c, "c0", 0)
    for o in (a, b, c):
        h.done_building(o)
    assert h.take() == {"nl0": ["a0"], "nl1": ["b0"]}
    h.play([(["b0"], {}), (["a0"], {"nl0": ["c0"]}), (["c0"], {})])
    assert [r.state for r in h.runs] == [RunState.COMPLETED] * 3


def test_fair_singles_of_runs_alternate_on_one_worker_in_run_order(make: Any) -> None:
    h = make(next_level=(0,))
    a = h.run()
    b = h.run()
    for i in range(3):
        h.nl(a, f"a{i}", 0)
    for i in range(2):
        h.nl(b, f"b{i}", 0)
    h.done_building(a)
    h.done_building(b)
    assert h.take() == {"nl0": ["a0"]}
    h.play(
        [
            (["a0"], {"nl0": ["b0"]}),
            (["b0"], {"nl0": ["a1"]}),
            (["a1"], {"nl0": ["b1"]}),
            (["b1"], {"nl0": ["a2"]}),
            (["a2"], {}),
        ]
    )


def test_fair_priority_weights_the_turns_on_one_worker(make: Any) -> None:
    h = make(next_level=(0,))
    a = h.run()
    b = h.run()
    b.run.priority = 2
    for i in range(4):
        h.nl(a, f"a{i}", 0)
        h.nl(b, f"b{i}", 0)
    h.done_building(a)
    h.done_building(b)
    order = [h.take()["nl0"][0]]
    while len(order) < 8:
        h.release(order[-1])
        h.sched.round()
        order.extend(h.take().get("nl0", []))
    h.release(order[-1])
    h.sched.round()
    # a0 went first; from then on b gets two turns per turn of a
    assert order == ["a0", "b0", "b1", "a1", "b2", "b3", "a2", "a3"]


def test_fair_stages_behind_another_run_in_the_other_frame_only(make: Any) -> None:
    h = make(frames=2)
    a = h.run()
    b = h.run()
    c = h.run()
    assert [o.run.lease_slot for o in (a, b, c)] == [1, 0, 1]
    h.nl(a, "a0", 0)
    h.nl(a, "a1", 0)
    h.nl(b, "b0", 0)
    h.nl(b, "b1", 0)
    h.nl(c, "c0", 0)  # same frame as a0: never staged behind it
    for o in (a, b, c):
        h.done_building(o)
    # a0 active; b0 staged into the other frame (one per run); c0 and the rest wait
    assert h.take() == {"nl0": ["a0", "b0+staged"]}
    b0 = h.find("b0+staged")[1]
    # a0 ends: the staged b0 is promoted at once (no new publication); c0 stages behind
    # it (frame 1, free now), a1 waits for the lane
    h.play([(["a0"], {"nl0": ["c0+staged"]})])
    assert h.eps["nl0"].activated == [b0.dispatch_id]
    h.play(
        [
            (["b0+staged"], {}),  # c0 promoted
            (["c0+staged"], {"nl0": ["a1"]}),  # A has the least pass
            (["a1"], {"nl0": ["b1"]}),
            (["b1"], {}),
        ]
    )
    assert [r.state for r in h.runs] == [RunState.COMPLETED] * 3


def test_fair_group_reserves_its_targets_against_other_runs_singles(make: Any) -> None:
    h = make()
    a = h.run()
    b = h.run()
    h.nl(a, "a0", 0)
    h.group(b, "g", [0, 1])
    h.nl(a, "a1", 1)  # worker 1 idles, but the blocked group holds it
    h.done_building(a)
    h.done_building(b)
    assert h.take() == {"nl0": ["a0"]}
    h.play([(["a0"], {"nl0": ["g[0]"], "nl1": ["g[1]"]}), (["g[0]", "g[1]"], {"nl1": ["a1"]})])
    h.play([(["a1"], {})])


def test_fair_never_stages_on_a_chip_a_blocked_group_holds(make: Any) -> None:
    h = make(frames=2)
    a, b, _c, d = (h.run() for _ in range(4))
    assert (a.run.lease_slot, d.run.lease_slot) == (1, 0)
    h.nl(a, "a0", 0)
    h.group(b, "g", [0, 1])
    h.nl(d, "d0", 0)  # the other frame is free, but the group waits for worker 0
    for o in h.runs:
        h.sched.finish_building(o)
    assert h.take() == {"nl0": ["a0"]}
    h.play([(["a0"], {"nl0": ["g[0]"], "nl1": ["g[1]"]}), (["g[0]", "g[1]"], {"nl0": ["d0"]})])
    h.play([(["d0"], {})])


def test_fair_admits_at_most_max_active_runs(make: Any) -> None:
    h = make(max_active_runs=2, subs=1)
    a = h.run()
    b = h.run()
    c = h.run()
    assert h.admitted == [a.run, b.run] and not c.run.admitted
    h.sub(a, "a0")
    h.sub(b, "b0")
    h.done_building(a)
    h.done_building(b)
    assert h.take() == {"sub0": ["a0"]}
    h.play([(["a0"], {"sub0": ["b0"]})])
    assert h.admitted == [a.run, b.run, c.run]  # A ended: C is admitted
    h.sub(c, "c0")
    h.done_building(c)
    h.play([(["b0"], {"sub0": ["c0"]}), (["c0"], {})])


def test_fair_cancelled_run_releases_admission_at_once(make: Any) -> None:
    h = make(max_active_runs=1, subs=2)
    a = h.run()
    b = h.run()
    h.sub(a, "a0")
    h.sub(a, "a1")
    h.sub(a, "a2")
    h.done_building(a)
    assert h.take() == {"sub0": ["a0"], "sub1": ["a1"]}
    assert not b.run.admitted
    h.sched.cancel(a.run)  # a0 and a1 keep running; a2 never runs
    assert b.run.admitted and a.run.detached and not a.run.terminal
    h.sub(b, "b0")
    h.done_building(b)
    h.play([(["a1"], {"sub1": ["b0"]}), (["a0", "b0"], {})])
    assert a.run.state is RunState.FAILED and b.run.state is RunState.COMPLETED


def test_fair_sub_group_waits_for_enough_idle_workers_and_holds_them(make: Any) -> None:
    h = make(subs=2, next_level=())
    a = h.run()
    b = h.run()
    h.sub(a, "a0")
    h.sub_group(b, "g", 2)
    h.sub(a, "a1")
    h.done_building(a)
    h.done_building(b)
    # a0 on sub0; B (least pass now) needs two idle workers: sub1 is held for it
    assert h.take() == {"sub0": ["a0"]}
    h.play(
        [
            (["a0"], {"sub0": ["g[0]"], "sub1": ["g[1]"]}),
            (["g[0]", "g[1]"], {"sub0": ["a1"]}),
            (["a1"], {}),
        ]
    )


def _client_run(h: ts.Harness, client: str, priority: int = 1) -> Orchestrator:
    run = Run()
    run.client = client
    run.priority = priority
    h.runs.append(run)
    h.sched.submit_run(run)
    return Orchestrator(h.sched, run)


def test_fair_clients_share_first_then_their_runs(make: Any) -> None:
    h = make(subs=1, next_level=())
    a1, a2, a3 = (_client_run(h, "A") for _ in range(3))
    b = _client_run(h, "B")
    for o, name in ((a1, "x"), (a2, "y"), (a3, "z"), (b, "b")):
        for i in range(3):
            h.sub(o, f"{name}{i}")
        h.done_building(o)
    order = [h.take()["sub0"][0]]
    while len(order) < 12:
        h.release(order[-1])
        h.sched.round()
        order.extend(h.take().get("sub0", []))
    h.release(order[-1])
    h.sched.round()
    # B's one run gets every other worker; client A's three runs share the rest in turn
    assert order[:8] == ["x0", "b0", "y0", "b1", "z0", "b2", "x1", "y1"], order
    assert all(o.run.state is RunState.COMPLETED for o in (a1, a2, a3, b))


def test_fair_admission_gives_a_freed_place_to_the_client_with_fewest_runs(make: Any) -> None:
    h = make(max_active_runs=2, subs=1, next_level=())
    a1, a2, a3 = (_client_run(h, "A") for _ in range(3))
    b = _client_run(h, "B")
    assert h.admitted == [a1.run, a2.run]
    h.done_building(a1)  # an empty run: its place goes to B, not to A's third run
    assert h.admitted == [a1.run, a2.run, b.run] and not a3.run.admitted
    h.done_building(a2)
    assert h.admitted[-1] is a3.run
    h.done_building(b)
    h.done_building(a3)
    assert all(o.run.state is RunState.COMPLETED for o in (a1, a2, a3, b))


# -- settings -----------------------------------------------------------------------------------


def test_priority_and_admission_settings_are_validated() -> None:
    assert check_priority(1) == 1 and check_priority(MAX_PRIORITY) == MAX_PRIORITY
    with pytest.raises(ValueError, match=r"cannot submit a run: priority 0 is out of range"):
        check_priority(0)
    with pytest.raises(ValueError, match="out of range"):
        check_priority(MAX_PRIORITY + 1)
    with pytest.raises(TypeError, match="priority must be an integer"):
        check_priority(True)
    with pytest.raises(TypeError, match="priority must be an integer"):
        check_priority(1.5)
    with pytest.raises(ValueError, match="max_active_runs 0"):
        FairAdmission(2, 0)
    h = ts.Harness()
    try:
        with pytest.raises(ValueError, match=r"admission 'lifo' is not one of fifo, fair"):
            Scheduler(h.sched.manager, h.registry, h.heap, h.doorbell, admission="lifo")
    finally:
        h.close()


@pytest.mark.timeout(60)
def test_worker_submit_rejects_a_bad_priority(make_pool: Any) -> None:
    pool = make_pool(1, admission="fair")
    with pytest.raises(ValueError, match="priority 0 is out of range"):
        pool.submit(_tasks(pool.h["noop"], 1, 0), priority=0)
    pool.submit(_tasks(pool.h["noop"], 1, 0), priority=MAX_PRIORITY).wait(timeout=30)
