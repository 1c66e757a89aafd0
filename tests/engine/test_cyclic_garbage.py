"""A plain run leaves no reference-cycle garbage behind.

Objects freed only by the cyclic garbage collector cost its passes on every later
allocation burst: a Scheduler whose one-task run left a few dozen of them (closures
referring to each other, timer handles, futures) spent a sixth of its loop's CPU in
the collector. These tests run plain one-task runs (blocking, and awaited under
uvloop and under asyncio) with ``gc.DEBUG_SAVEALL``, which keeps every object the
collector frees in ``gc.garbage`` instead: a cycle created by any run fails them.
"""

from __future__ import annotations

import asyncio
import collections
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvloop

from simpler_daemon import CallableHandle, Tag, TaskArgs, Worker
from tests.support import sub_tasks
from tests.support.sub_tasks import targs

#: Runs observed per test, after as many warm-up runs (first-use caches, lazy imports).
RUNS = 50


@contextmanager
def saved_garbage() -> Iterator[list[Any]]:
    """Collect first, then keep what the collector frees until the block ends (every
    automatic pass inside the block included); the list is filled at the end."""
    found: list[Any] = []
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def assert_no_garbage(garbage: list[Any], what: str) -> None:
    counts = collections.Counter(type(o).__qualname__ for o in garbage)
    kinds = ", ".join(f"{n} {name}" for name, n in counts.most_common(8))
    assert len(garbage) == 0, f"{what} left {len(garbage)} objects in cycles: {kinds}"


@pytest.fixture
def started() -> Iterator[tuple[Worker, CallableHandle]]:
    w = Worker(num_sub_workers=2)
    h = w.register(sub_tasks.noop)
    w.init()
    try:
        yield w, h
    finally:
        w.close()


def one_task(h: CallableHandle) -> Callable[..., None]:
    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(h, TaskArgs())

    return orch


def test_blocking_run_leaves_no_cyclic_garbage(started: tuple[Worker, CallableHandle]) -> None:
    w, h = started
    orch = one_task(h)
    for _ in range(RUNS):
        w.run(orch)
    with saved_garbage() as garbage:
        for _ in range(RUNS):
            w.run(orch)
    assert_no_garbage(garbage, f"{RUNS} runs")


def test_many_task_runs_leave_no_cyclic_garbage(started: tuple[Worker, CallableHandle]) -> None:
    """Per task: a run of 2,000 independent tasks, and a chain of 500 tasks each
    depending on the previous one through an INOUT tensor."""
    w, h = started
    chain = w.register(sub_tasks.chain_step)
    counter = w.alloc((1,), "float64")

    def wide(o: Any, args: Any, config: Any) -> None:
        for _ in range(2000):
            o.submit_sub(h, TaskArgs())

    def linked(o: Any, args: Any, config: Any) -> None:
        counter[0] = 0.0
        for i in range(500):
            o.submit_sub(chain, targs((counter, Tag.INOUT), scalars=(i,)))

    w.run(wide)
    w.run(linked)
    with saved_garbage() as garbage:
        w.run(wide)
        w.run(linked)
    assert counter[0] == 500
    assert_no_garbage(garbage, "a 2,000-task run and a 500-task chain")


def test_submit_and_wait_leaves_no_cyclic_garbage(
    started: tuple[Worker, CallableHandle],
) -> None:
    w, h = started
    orch = one_task(h)
    for _ in range(RUNS):
        w.submit(orch).wait()
    with saved_garbage() as garbage:
        for _ in range(RUNS):
            w.submit(orch).wait()
    assert_no_garbage(garbage, f"{RUNS} runs")


@pytest.mark.parametrize("loop_factory", [uvloop.new_event_loop, asyncio.new_event_loop])
def test_awaited_run_leaves_no_cyclic_garbage(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    w = Worker(num_sub_workers=2)
    h = w.register(sub_tasks.noop)
    w.init()
    orch = one_task(h)

    async def runs() -> None:
        for _ in range(RUNS):
            await w.run_async(orch)

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        try:
            runner.run(runs())
            with saved_garbage() as garbage:
                runner.run(runs())
        finally:
            runner.run(w.close_async())
    assert_no_garbage(garbage, f"{RUNS} runs")
