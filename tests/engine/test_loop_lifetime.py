"""A Worker outlives the event loop it was bound to: once the loop ``run_async`` bound
it to has ended (``asyncio.run`` returned), the blocking API drives it again, the next
loop that calls it binds it anew, and ``close()`` always works and stops every child."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from simpler_daemon import RunHandle, Tag, Worker
from simpler_daemon.testing import child_pids
from tests.support import sub_tasks
from tests.support.sub_tasks import targs

pytestmark = pytest.mark.timeout(90)


def started() -> tuple[Worker, Any, Any]:
    w = Worker(num_sub_workers=2, heap_bytes=1 << 20)
    double = w.register(sub_tasks.double_scalar)
    gated = w.register(sub_tasks.gated_double)
    w.init()
    return w, double, gated


def one(h: Any, value: int) -> Any:
    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(h, targs(scalars=(value,)))

    return orch


def test_the_blocking_api_works_after_asyncio_run_and_close_stops_the_children() -> None:
    w, double, _ = started()
    try:
        pids = child_pids()
        assert len(pids) >= 2
        asyncio.run(w.run_async(one(double, 1)))
        # The loop is closed: the blocking driver takes over.
        w.run(one(double, 2))
        assert w.submit(one(double, 3)).result(30) == [6]
        assert w.ping(0) in pids
    finally:
        w.close()
    assert not child_pids()


def test_close_right_after_asyncio_run_stops_the_children() -> None:
    w, double, _ = started()
    pids = child_pids()
    assert asyncio.run(one_async(w, double, 4)) == [8]
    w.close()
    assert not child_pids(), pids


async def one_async(w: Worker, h: Any, value: int) -> list[Any]:
    return await await_handle(await w.submit_async(one(h, value)))


async def await_handle(handle: RunHandle) -> list[Any]:
    return await handle


def test_a_run_left_unfinished_by_the_loop_finishes_on_the_blocking_driver() -> None:
    w, _, gated = started()
    try:
        flags = w.alloc((1,), "int64")

        def orch(o: Any, args: Any, config: Any) -> None:
            o.submit_sub(gated, targs((flags, Tag.NO_DEP), scalars=(21,)))

        async def submit_only() -> RunHandle:
            return await w.submit_async(orch)

        handle = asyncio.run(submit_only())  # the loop ends with the run in flight
        assert not handle.done()
        flags[0] = 1
        assert handle.result(30) == [42]
    finally:
        w.close()
    assert not child_pids()


def test_the_next_loop_that_calls_it_binds_it() -> None:
    w, double, _ = started()
    try:
        assert asyncio.run(one_async(w, double, 5)) == [10]
        assert asyncio.run(one_async(w, double, 6)) == [12]  # a second asyncio.run

        async def both() -> list[Any]:
            first = await one_async(w, double, 7)
            await w.close_async()
            return first

        assert asyncio.run(both()) == [14]
    finally:
        w.close()
    assert not child_pids()
