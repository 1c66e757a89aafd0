"""The loop-bound Scheduler's rounds and park, around the daemon's common runs.

Around a one-task run:

* A submit on the loop that wakes the parked coroutine clears the doorbell's
  ``parked`` flag in the same call, before the child can end the task it published:
  the child then has no eventfd to ring (a system call on both sides and one more
  round of the coroutine, per run).
* The round that ends the last run is followed by the park, not by one more round
  (nothing is in flight and no run is admitted: nothing can have moved since, but for
  a child's late bump of the doorbell word, see the test).

And a plan submitted back to back (``Run.bulk_submits``, the daemon's SubmitRun of
more than a few tasks) dispatches at every other submit that finds a worker idle.

Real SUB children on the running loop; the order is shown by the Scheduler's own
state and counters, read between steps of the loop, never by timing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from simpler_daemon import CallableHandle, Worker
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.doorbell import OFF_PARKED
from simpler_daemon.scheduler.dispatch import Scheduler
from simpler_daemon.scheduler.runmodel import SlotState
from tests.support import sub_tasks as tasks
from tests.support.sub_tasks import targs

pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio]

RUNS = 20


@asynccontextmanager
async def started() -> AsyncIterator[tuple[Worker, Scheduler, CallableHandle]]:
    w = Worker(num_sub_workers=2)
    noop = w.register(tasks.noop)
    w.init()
    try:
        await w.start_async()
        assert w.scheduler is not None
        yield w, w.scheduler, noop
    finally:
        await w.close_async()


def one_task(noop: CallableHandle) -> Callable[..., None]:
    def orch(o: Any, _a: Any = None, _c: Any = None) -> None:
        o.submit_sub(noop, targs())

    return orch


def parked(sched: Scheduler) -> bool:
    """The coroutine sleeps on the doorbell: its future is set and the flag is up."""
    return sched._wake is not None and _mb.load32(sched.doorbell.buf, OFF_PARKED) == 1


async def until_parked(sched: Scheduler, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not parked(sched):
        if loop.time() > deadline:
            raise TimeoutError(f"the Scheduler did not park within {timeout} s")
        await asyncio.sleep(0.001)


async def test_a_submit_on_the_loop_lowers_the_parked_flag_before_its_task_can_end() -> None:
    async with started() as (w, sched, noop):
        orch = one_task(noop)
        for i in range(RUNS):
            await until_parked(sched)
            handle = await w.submit_async(orch)  # no wait inside: the coroutine has not run
            assert _mb.load32(sched.doorbell.buf, OFF_PARKED) == 0, (
                f"run {i}: the doorbell still says parked after the submit that woke the "
                "Scheduler; the child would ring the eventfd when the task ends"
            )
            assert sched._wake is not None and sched._wake.done()
            await handle.wait_async()


async def test_the_round_that_ends_the_last_run_is_followed_by_the_park() -> None:
    """One exception, which load can cause but not multiply: a child preempted between
    storing the task's terminal state and bumping the doorbell word moves the word after
    the round consumed the completion, and the park then looks once more. So the runs
    followed by a round are counted, and at most a quarter may be (before this change
    nearly every run was)."""
    async with started() as (w, sched, noop):
        orch = one_task(noop)
        extra: list[int] = []
        for i in range(RUNS):
            await until_parked(sched)
            handle = await w.submit_async(orch)
            at_end: list[int] = []
            handle.run.add_done_callback(
                lambda _r, marks=at_end: marks.append(sched.stats["rounds"])  # type: ignore[misc]
            )
            await handle.wait_async()
            await until_parked(sched)
            assert at_end, f"run {i} ended without its done callback"
            extra.append(sched.stats["rounds"] - at_end[0])
        assert max(extra) <= 1, f"rounds between a run's end and the park, per run: {extra}"
        assert sum(extra) <= RUNS // 4, (
            f"{sum(extra)} of {RUNS} runs were followed by a round before the park: {extra}"
        )


async def _submit_rounds(
    w: Worker, sched: Scheduler, noop: CallableHandle, bulk: bool
) -> list[int]:
    """A run whose async orchestration submits RUNS tasks, each once the last one ended
    (so every submit finds the SUB workers idle); per submit, the rounds it ran itself."""
    per_submit: list[int] = []

    async def orch(o: Any, _a: Any = None, _c: Any = None) -> None:
        o.run.bulk_submits = bulk
        for _ in range(RUNS):
            before = sched.stats["rounds"]
            ref = o.submit_sub(noop, targs())
            per_submit.append(sched.stats["rounds"] - before)
            for _ in range(100_000):  # turns of the loop until the task ended
                slot = o.run.slot(ref)
                if slot is None or slot.state is SlotState.COMPLETED:
                    break
                await asyncio.sleep(0)
            else:
                raise AssertionError(f"task {int(ref)} did not end")

    await w.run_async(orch)
    return per_submit


async def test_a_plan_submitted_back_to_back_dispatches_at_every_other_submit() -> None:
    """The daemon's SubmitRun of more than a few tasks marks its run ``bulk_submits``:
    a submit that finds a SUB worker idle dispatches at once only every other time (the
    round then hands that worker a task and queues the next one behind it), where a
    plain orchestration's submit dispatches every time."""
    async with started() as (w, sched, noop):
        plain = await _submit_rounds(w, sched, noop, bulk=False)
        assert plain == [1] * RUNS, f"rounds per submit of a plain orchestration: {plain}"
        bulk = await _submit_rounds(w, sched, noop, bulk=True)
        assert sum(bulk) <= RUNS // 2, f"rounds per submit of a bulk plan: {bulk}"
