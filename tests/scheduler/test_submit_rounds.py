"""When a SUB submit runs a Scheduler round of its own (``Scheduler.add_slot``).

A submit that finds a SUB worker idle runs a round at once, so the child starts while
the orchestration still submits. When the children keep up with the submits, each such
round frees the lane the next submit finds idle (the two lanes in turn): a round per
task, costlier than the tasks. Then the next submits go ``LOCKSTEP_SUBMITS`` at a
time, unless they are slower than ``LOCKSTEP_GAP_S`` (an orchestration that works
between its submits keeps a round per submit).

The Worker runs on this test's event loop: no other thread runs a round while the
orchestration function submits, and the orchestration waits, between two submits, for
every published task to end (the doorbell's completion word), so that the children
keep up whatever the machine's load. The time bounds are set beyond any submit
interval, or to zero, so no timing decides the outcome.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from simpler_daemon import CallableHandle, TaskArgs, Worker
from simpler_daemon.examples.tasks import empty
from simpler_daemon.scheduler import dispatch

SUBMITS = 200
WAIT_S = 30.0


@pytest_asyncio.fixture
async def worker() -> AsyncIterator[tuple[Worker, CallableHandle]]:
    w = Worker(num_sub_workers=2, admission="fifo")
    h = w.register(empty)
    w.init()
    try:
        await w.start_async()
        yield w, h
    finally:
        await w.close_async()


async def rounds_while_children_keep_up(worker: tuple[Worker, CallableHandle]) -> int:
    """Scheduler rounds during an orchestration whose every submit comes after the
    children ended all that was published so far."""
    w, h = worker
    sched = w.scheduler
    assert sched is not None
    seen: list[int] = []

    def orch(o: Any, _args: Any = None, _config: Any = None) -> None:
        base = sched.doorbell.completed()
        first = sched.stats["rounds"]
        for _ in range(SUBMITS):
            o.submit_sub(h, TaskArgs())
            deadline = time.monotonic() + WAIT_S
            while sched.doorbell.completed() - base < sched.stats["dispatched"]:
                if time.monotonic() > deadline:
                    raise TimeoutError("the children did not end their tasks")
        seen.append(sched.stats["rounds"] - first)

    handle = await w.submit_async(orch)
    await handle.wait_async(timeout=WAIT_S)
    return seen[0]


@pytest.mark.asyncio
async def test_children_that_keep_up_with_fast_submits_get_them_in_batches(
    worker: tuple[Worker, CallableHandle], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dispatch, "LOCKSTEP_GAP_S", 3600.0)  # every submit counts as fast
    # No round for a child seen to finish while no worker is idle either (a preempted
    # child could make the wait outlast ROUND_GAP_S on a loaded machine).
    monkeypatch.setattr(dispatch, "ROUND_GAP_S", 3600.0)
    rounds = await rounds_while_children_keep_up(worker)
    # A round per LOCKSTEP_SUBMITS submits at most (once idle children were seen to
    # keep up), never the round per submit of two lanes freed in turn.
    assert rounds <= SUBMITS // dispatch.LOCKSTEP_SUBMITS + 2, f"{rounds} rounds"


@pytest.mark.asyncio
async def test_slow_submits_keep_a_round_each_while_a_worker_is_idle(
    worker: tuple[Worker, CallableHandle], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dispatch, "LOCKSTEP_GAP_S", 0.0)  # every submit counts as slow
    rounds = await rounds_while_children_keep_up(worker)
    # Each submit found the lane its predecessor's round freed: a round each, so no
    # task waits in a queue while a worker idles.
    assert rounds >= SUBMITS - 2, f"{rounds} rounds"
