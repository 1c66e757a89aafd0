"""A streak of one-task runs: each run ends inside its own submit (``dispatch.SINGLE_RUNS``).

After ``SINGLE_RUNS`` runs in a row of one SUB task each, the round of a run's first
submit has the SUB pump wait for that task, so the run ends as its orchestration
returns: a blocking ``run()`` takes one round instead of two, and on the bound loop the
handle is done when ``submit_async`` returns and the progress coroutine runs no round
for it. A run of more tasks ends the streak. The pump's hit rate still gates the wait:
tasks too long for its spin stop it.

Where a test needs the spin to catch the task, the spin is made long (``PUMP_SPIN_NS``)
and the hit rate threshold zero, so the machine's load cannot decide the outcome.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from simpler_daemon import CallableHandle, TaskArgs
from simpler_daemon.scheduler import subpump
from simpler_daemon.scheduler.dispatch import SINGLE_RUNS
from tests.support.pump_rig import CATCH_S, Rig, new_worker
from tests.support.pump_rig import spins_catch as catch_every_spin
from tests.support.sub_tasks import targs

pytestmark = pytest.mark.timeout(60)

RUNS = 20


@pytest.fixture
def rig() -> Iterator[Rig]:
    w, quick, slow = new_worker()
    try:
        assert w.scheduler is not None
        yield Rig(w, w.scheduler, quick, slow)
    finally:
        w.close()


@pytest.fixture
def spins_catch(monkeypatch: pytest.MonkeyPatch) -> None:
    catch_every_spin(monkeypatch)


def tasks_of(h: CallableHandle, n: int, args: TaskArgs | None = None) -> Any:
    def orch(o: Any, _args: Any = None, _config: Any = None) -> None:
        for _ in range(n):
            o.submit_sub(h, args if args is not None else TaskArgs())

    return orch


def rounds_per_run(rig: Rig, orch: Any, runs: int) -> list[int]:
    out = []
    for _ in range(runs):
        before = rig.sched.stats["rounds"]
        rig.w.run(orch)
        out.append(rig.sched.stats["rounds"] - before)
    return out


def test_a_streak_of_one_task_runs_takes_one_round_a_run(rig: Rig, spins_catch: None) -> None:
    one = tasks_of(rig.quick, 1)
    rounds_per_run(rig, one, SINGLE_RUNS)
    assert rig.sched.single_runs == SINGLE_RUNS
    # Each run: its submit's round publishes the task and waits for it; the run ends with
    # its build, and run() drives no round of its own (two a run before the streak).
    assert rounds_per_run(rig, one, RUNS) == [1] * RUNS
    assert rig.sched.single_runs == SINGLE_RUNS + RUNS


def test_a_run_of_more_tasks_ends_the_streak(rig: Rig, spins_catch: None) -> None:
    one = tasks_of(rig.quick, 1)
    rounds_per_run(rig, one, SINGLE_RUNS + 2)
    rig.w.run(tasks_of(rig.quick, 2))
    assert rig.sched.single_runs == 0
    # Until the streak is long again the submit does not wait, and run() drives the
    # round that sees the task end.
    assert all(n >= 2 for n in rounds_per_run(rig, one, SINGLE_RUNS)), "the streak went on"
    assert rig.sched.single_runs == SINGLE_RUNS
    assert rounds_per_run(rig, one, 1) == [1]


def test_a_scheduler_told_not_to_spin_on_submit_keeps_its_two_rounds(
    rig: Rig, spins_catch: None
) -> None:
    """The daemon's setting (server/rpc_base.py): its handler settles the run later."""
    rig.sched.spins_first_submit = False
    one = tasks_of(rig.quick, 1)
    rounds_per_run(rig, one, SINGLE_RUNS)
    assert rig.sched.single_runs == SINGLE_RUNS  # the streak is counted all the same
    assert all(n >= 2 for n in rounds_per_run(rig, one, RUNS))


def test_tasks_too_long_for_the_spin_stop_it(rig: Rig) -> None:
    """20 ms tasks cannot end within the pump's 50 µs spin: each spin misses, and the hit
    rate falls below the threshold (the submit's round then waits only on probes)."""
    slow = tasks_of(rig.slow, 1, targs(scalars=(20,)))
    for _ in range(SINGLE_RUNS + 8):
        rig.w.run(slow)
    assert rig.sched.single_runs == SINGLE_RUNS + 8
    assert rig.sched._pump.hit_rate < subpump.PUMP_MIN_HIT_RATE


@pytest.mark.asyncio
async def test_on_the_loop_the_handle_is_done_when_the_submit_returns(spins_catch: None) -> None:
    w, quick, _ = new_worker()
    try:
        await w.start_async()
        sched = w.scheduler
        assert sched is not None
        one = tasks_of(quick, 1)
        for _ in range(SINGLE_RUNS):
            await w.run_async(one)
        for i in range(RUNS):
            handle = await w.submit_async(one)
            assert handle.done(), f"run {i} was not over when submit_async returned"
            assert handle.run.error is None
            # Nothing is left for the progress coroutine: it was not poked again.
            assert not sched._poked
            await handle.wait_async(timeout=CATCH_S)
    finally:
        await w.close_async()
