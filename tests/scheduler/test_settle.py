"""``Scheduler.settle``: a waiter on the bound loop waits for its run in its own call.

A run alone in the Scheduler, whose orchestration returned and whose every task is in
flight on the SUB pump, gets the round that waits for those tasks in the waiter's call
(``RunHandle.settle``, ``RunHandle.wait_async``, the daemon's waiting SubmitRun) instead
of on the progress coroutine's next turn. Anything else is left to the coroutine, and
``settle`` then runs no round at all: a run that is not alone, a run whose tasks the
pump's spins do not catch, a call from another thread.

The Worker runs on this test's loop. Where a test needs the spin to catch the task, the
spin is made long (``PUMP_SPIN_NS``) and the hit rate threshold zero, so the machine's
load cannot decide the outcome; the refusals are checked on the Scheduler's round count.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from simpler_daemon import CallableHandle, RunHandle, TaskArgs
from tests.support.pump_rig import CATCH_S, Rig, new_worker
from tests.support.pump_rig import spins_catch as catch_every_spin
from tests.support.sub_tasks import targs

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio]

WAIT_S = CATCH_S
RUNS = 20


@pytest_asyncio.fixture
async def worker() -> AsyncIterator[Rig]:
    w, quick, slow = new_worker()
    try:
        await w.start_async()
        assert w.scheduler is not None
        # As in the daemon: a streak of one-task runs would otherwise end each run inside
        # its own submit (tests/scheduler/test_single_runs.py), and no run would reach
        # settle with its task in flight.
        w.scheduler.spins_first_submit = False
        yield Rig(w, w.scheduler, quick, slow)
    finally:
        await w.close_async()


@pytest.fixture
def spins_catch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pump's spin waits as long as a child takes, whatever the load, and counts."""
    catch_every_spin(monkeypatch)


def one_task(h: CallableHandle, args: TaskArgs | None = None) -> Any:
    def orch(o: Any, _args: Any = None, _config: Any = None) -> None:
        o.submit_sub(h, args if args is not None else TaskArgs())

    return orch


async def slow_run(rig: Rig, ms: int) -> RunHandle:
    """A run of one task sleeping ``ms`` ms, just submitted."""
    return await rig.w.submit_async(one_task(rig.slow, targs(scalars=(ms,))))


async def test_a_lone_one_task_run_ends_inside_the_waiters_call(
    worker: Rig, spins_catch: None
) -> None:
    w, sched, quick, _ = worker
    for i in range(RUNS):
        handle = await w.submit_async(one_task(quick))
        assert not handle.done()  # published by the submit, still in flight
        before = sched.stats["settled"]
        assert handle.settle(), f"run {i} did not end in settle"
        assert handle.done() and handle.run.error is None
        assert sched.stats["settled"] == before + 1
        await handle.wait_async(timeout=WAIT_S)  # already over: returns at once


async def test_wait_async_settles_the_run_it_waits_for(worker: Rig, spins_catch: None) -> None:
    w, sched, quick, _ = worker
    before = sched.stats["settled"]
    for _ in range(RUNS):
        await w.run_async(one_task(quick))
    assert sched.stats["settled"] == before + RUNS


async def test_a_run_that_is_not_alone_is_left_to_the_progress_coroutine(
    worker: Rig, spins_catch: None
) -> None:
    sched = worker.sched
    first = await slow_run(worker, 300)
    second = await worker.w.submit_async(one_task(worker.quick))
    rounds = sched.stats["rounds"]
    assert not second.settle()  # another run is admitted: no round, no spin
    assert sched.stats["rounds"] == rounds
    await second.wait_async(timeout=WAIT_S)
    await first.wait_async(timeout=WAIT_S)
    assert first.run.error is None and second.run.error is None


async def test_a_run_whose_tasks_outlast_the_spins_is_left_to_the_coroutine(
    worker: Rig,
) -> None:
    sched = worker.sched
    handle = await slow_run(worker, 50)
    sched._pump.hit_rate = 0.0  # as after spins that caught no task
    rounds = sched.stats["rounds"]
    assert not handle.settle()
    assert sched.stats["rounds"] == rounds
    await handle.wait_async(timeout=WAIT_S)
    assert handle.run.error is None and sched.stats["settled"] == 0


async def test_settle_off_the_bound_loop_only_says_whether_the_run_ended(
    worker: Rig, spins_catch: None
) -> None:
    sched = worker.sched
    handle = await slow_run(worker, 50)
    # From another thread, while this loop's coroutine runs its rounds: a round there
    # would race them (and, with this spin, wait for the task and end the run).
    assert not await asyncio.get_running_loop().run_in_executor(None, handle.settle)
    assert sched.stats["settled"] == 0
    await handle.wait_async(timeout=WAIT_S)
    assert await asyncio.get_running_loop().run_in_executor(None, handle.settle)


async def test_a_round_that_fails_in_settle_leaves_the_run_to_the_coroutine(
    worker: Rig, spins_catch: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in a round must not reach the waiter (a daemon handler about to reply): the
    failure is logged, ``settle`` says the run goes on, and the coroutine's own rounds
    end it."""
    w, sched, quick, _ = worker
    handle = await w.submit_async(one_task(quick))
    real = sched.round

    def broken() -> bool:
        monkeypatch.setattr(sched, "round", real)  # only this one round fails
        raise RuntimeError("a bug in a round")

    monkeypatch.setattr(sched, "round", broken)
    assert not handle.settle()
    await handle.wait_async(timeout=WAIT_S)
    assert handle.run.error is None
