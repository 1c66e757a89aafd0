"""The Worker bound to a running event loop (uvloop, or asyncio with SIMPLER_LOOP=asyncio).

``run_async`` / ``submit_async`` / ``wait_async`` / ``close_async``, async
orchestration functions, and the guard rails between the blocking and the
event-loop API. Order is proven by marks the tasks record, never by timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from simpler_daemon import (
    CallableHandle,
    RunCancelled,
    RunState,
    Tag,
    TaskError,
    Worker,
    WorkerClosedError,
    WorkerState,
)
from simpler_daemon.testing import child_pids
from tests.support import sub_tasks as tasks
from tests.support.sub_tasks import targs

TASKS = ("fill", "consume", "marked_fill", "wait_flag", "fail", "record_pid", "noop", "chain_step")


@contextlib.asynccontextmanager
async def started(n: int = 2) -> AsyncIterator[tuple[Worker, dict[str, CallableHandle]]]:
    w = Worker(num_sub_workers=n)
    h = {name: w.register(getattr(tasks, name)) for name in TASKS}
    w.init()
    try:
        await w.start_async()
        yield w, h
    finally:
        await w.close_async()


async def apoll(predicate: Callable[[], Any], timeout: float = 30.0, message: str = "") -> None:
    """Await until ``predicate()`` is truthy, yielding to the loop; TimeoutError past the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError(message or f"condition not met within {timeout}s")
        await asyncio.sleep(0.001)


@pytest.mark.asyncio
async def test_run_async_under_the_running_loop() -> None:
    loop = asyncio.get_running_loop()
    expect_uvloop = os.environ.get("SIMPLER_LOOP", "uvloop") != "asyncio"
    assert type(loop).__module__.startswith("uvloop") is expect_uvloop
    async with started() as (w, h):
        x = w.alloc((16,), "float64")
        y = w.alloc((16,), "float64")

        def orch(o: Any, args: Any, config: Any) -> None:
            o.submit_sub(h["fill"], targs((x, Tag.OUTPUT), scalars=(args,)))
            o.submit_sub(h["consume"], targs((x, Tag.INPUT), (y, Tag.OUTPUT), scalars=(1,)))

        await w.run_async(orch, 7)
        assert (x == 7).all() and (y == 8).all()
        await w.run_async(orch, 9)
        assert (y == 10).all()


@pytest.mark.asyncio
async def test_submit_async_wait_async_done_and_result() -> None:
    async with started() as (w, h):
        flags = w.alloc((1,), "int64")
        begun = w.alloc((1,), "int64")
        handle = await w.submit_async(
            lambda o, a, c: o.submit_sub(
                h["wait_flag"],
                targs((flags, Tag.NO_DEP), (begun, Tag.NO_DEP), scalars=(0, 0, 30_000)),
            )
        )
        assert not handle.done()
        with pytest.raises(asyncio.InvalidStateError):
            handle.result()
        await apoll(lambda: begun[0] != 0)
        with pytest.raises(TimeoutError, match="not finished"):
            await handle.wait_async(timeout=0.01)  # blocked on a flag nobody has set yet
        assert not handle.done()
        flags[0] = 1
        await handle.wait_async(timeout=60)
        assert handle.done() and handle.state is RunState.COMPLETED and handle.result() == [None]


@pytest.mark.asyncio
async def test_concurrent_runs_are_admitted_fifo_and_only_the_head_dispatches() -> None:
    async with started() as (w, h):
        nruns, per_run = 5, 2
        marks = w.alloc((nruns * per_run, 3), "int64")
        outs = [w.alloc((8,), "float64") for _ in range(nruns * per_run)]

        def orch(o: Any, k: int, config: Any) -> None:
            for j in range(per_run):  # independent tasks: both workers run them at once
                row = k * per_run + j
                o.submit_sub(
                    h["marked_fill"],
                    targs((outs[row], Tag.OUTPUT), (marks, Tag.NO_DEP), scalars=(row + 1, row)),
                )

        await asyncio.gather(*(w.run_async(orch, k) for k in range(nruns)))
        for row, out in enumerate(outs):
            assert (out == row + 1).all()
        for k in range(nruns - 1):
            this_run = marks[k * per_run : (k + 1) * per_run]
            next_run = marks[(k + 1) * per_run : (k + 2) * per_run]
            # every task of run k+1 started after every task of run k ended
            assert next_run[:, 1].min() >= this_run[:, 2].max() > 0


@pytest.mark.asyncio
async def test_many_runs_in_flight_at_once_all_complete() -> None:
    async with started() as (w, h):
        out = w.alloc((64,), "int64")

        def orch(o: Any, i: int, config: Any) -> None:
            o.submit_sub(h["fill"], targs((out[i : i + 1], Tag.OUTPUT), scalars=(i + 100,)))

        handles = [await w.submit_async(orch, i) for i in range(64)]
        await asyncio.gather(*(hd.wait_async(timeout=60) for hd in handles))
        assert out.tolist() == [i + 100 for i in range(64)]
        assert all(hd.state is RunState.COMPLETED for hd in handles)


@pytest.mark.asyncio
async def test_an_async_orchestration_function_can_await_between_submits() -> None:
    async with started() as (w, h):
        counter = w.alloc((1,), "int64")

        async def orch(o: Any, args: Any, config: Any) -> None:
            for i in range(10):
                o.submit_sub(h["chain_step"], targs((counter, Tag.INOUT), scalars=(i,)))
                await asyncio.sleep(0)

        await w.run_async(orch)
        assert counter[0] == 10


@pytest.mark.asyncio
async def test_submitting_into_a_failed_run_reraises_and_run_async_raises_it() -> None:
    async with started() as (w, h):
        seen: list[BaseException] = []
        marker = w.alloc((1,), "float64")

        async def orch(o: Any, args: Any, config: Any) -> None:
            o.submit_sub(h["fail"], targs(scalars=(3,)))
            await apoll(
                lambda: o.run.error is not None, message="the failure never reached the run"
            )
            try:
                o.submit_sub(h["fill"], targs((marker, Tag.OUTPUT), scalars=(1,)))
            except TaskError as exc:
                seen.append(exc)
                raise

        with pytest.raises(TaskError) as info:
            await w.run_async(orch)
        assert seen == [info.value]
        err = info.value
        assert err.outcome == "TASK_FAILURE" and err.hashid == h["fail"].hashid
        assert (
            "producer exploded on purpose (3)" in err.remote_text and "Traceback" in err.remote_text
        )
        assert err.worker_id in (0, 1) and err.pid is not None and err.dispatch_id is not None
        assert marker[0] == 0
        await w.run_async(lambda o, a, c: o.submit_sub(h["noop"]))  # the worker is fine


@pytest.mark.asyncio
async def test_an_orchestration_exception_propagates_from_run_async() -> None:
    async with started() as (w, _h):

        class Boom(Exception):
            pass

        async def orch(o: Any, args: Any, config: Any) -> None:
            await asyncio.sleep(0)
            raise Boom("late")

        with pytest.raises(Boom, match="late"):
            await w.run_async(orch)
        await w.run_async(lambda o, a, c: None)


@pytest.mark.asyncio
async def test_cancel_from_the_loop_fails_unstarted_tasks() -> None:
    async with started() as (w, h):
        flags = w.alloc((1,), "int64")
        begun = w.alloc((1,), "int64")
        x = w.alloc((4,), "float64")
        markers = [w.alloc((4,), "float64") for _ in range(2)]

        def orch(o: Any, args: Any, config: Any) -> None:
            o.submit_sub(
                h["wait_flag"],
                targs(
                    (flags, Tag.NO_DEP),
                    (begun, Tag.NO_DEP),
                    (x, Tag.OUTPUT),
                    scalars=(0, 0, 30_000),
                ),
            )
            for m in markers:
                o.submit_sub(h["consume"], targs((x, Tag.INPUT), (m, Tag.OUTPUT), scalars=(1,)))

        handle = await w.submit_async(orch)
        await apoll(lambda: begun[0] != 0)
        handle.cancel()
        flags[0] = 1
        with pytest.raises(RunCancelled):
            await handle.wait_async(timeout=60)
        assert handle.state is RunState.FAILED
        assert all((m == 0).all() for m in markers)
        await w.run_async(lambda o, a, c: o.submit_sub(h["noop"]))


@pytest.mark.asyncio
async def test_blocking_calls_from_the_bound_loop_raise() -> None:
    async with started() as (w, h):
        with pytest.raises(RuntimeError, match="own event loop"):
            w.run(lambda o, a, c: None)
        with pytest.raises(RuntimeError, match="own event loop"):
            w.submit(lambda o, a, c: None)
        with pytest.raises(RuntimeError, match="own event loop"):
            w.register(tasks.add_one)
        with pytest.raises(RuntimeError, match="own event loop"):
            w.close()
        assert w.state is WorkerState.READY
        await w.run_async(lambda o, a, c: o.submit_sub(h["noop"]))


@pytest.mark.asyncio
async def test_the_blocking_api_works_from_another_thread_while_bound() -> None:
    async with started() as (w, h):
        x = w.alloc((4,), "float64")
        result: list[BaseException | None] = []

        def worker_thread() -> None:
            try:
                w.run(lambda o, a, c: o.submit_sub(h["fill"], targs((x, Tag.OUTPUT), scalars=(5,))))
                result.append(None)
            except BaseException as exc:  # surfaced below
                result.append(exc)

        t = threading.Thread(target=worker_thread)
        t.start()
        try:
            await apoll(
                lambda: not t.is_alive(), timeout=60, message="the blocking run never returned"
            )
        finally:
            t.join(timeout=60)
        assert result == [None]
        assert (x == 5).all()


@pytest.mark.asyncio
async def test_register_and_unregister_async_after_start() -> None:
    async with started() as (w, _h):
        add_one = await w.register_async(tasks.add_one)
        by_path = await w.register_async("tests.support.sub_tasks:set_flag")
        x = w.alloc((4,), "float64")
        flags = w.alloc((2,), "int64")
        await w.run_async(
            lambda o, a, c: (
                o.submit_sub(add_one, targs((x, Tag.INOUT))),
                o.submit_sub(by_path, targs((flags, Tag.OUTPUT), scalars=(0,))),
            )
        )
        assert (x == 1).all() and flags[0] == 1
        await w.unregister_async(add_one)
        with pytest.raises(ValueError, match="is not registered"):
            await w.run_async(lambda o, a, c: o.submit_sub(add_one, targs((x, Tag.INOUT))))
        assert (x == 1).all()


@pytest.mark.asyncio
async def test_async_context_manager_starts_and_closes() -> None:
    w = Worker(num_sub_workers=1)
    h = w.register(tasks.record_pid)
    async with w:
        assert w.state is WorkerState.READY
        pids = w.alloc((1,), "int64")
        await w.run_async(lambda o, a, c: o.submit_sub(h, targs((pids, Tag.NO_DEP), scalars=(0,))))
    assert w.state is WorkerState.CLOSED
    assert pids[0] != 0 and not child_pids()
    with pytest.raises(WorkerClosedError):
        await w.run_async(lambda o, a, c: None)
    await w.close_async()  # a second close is a no-op


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_close_async_with_a_wedged_run_cancels_it_and_leaves_no_process() -> None:
    w = Worker(num_sub_workers=2)
    h = {name: w.register(getattr(tasks, name)) for name in TASKS}
    w.init()
    flags = w.alloc((1,), "int64")
    begun = w.alloc((1,), "int64")
    handle = await w.submit_async(
        lambda o, a, c: o.submit_sub(
            h["wait_flag"], targs((flags, Tag.NO_DEP), (begun, Tag.NO_DEP), scalars=(0, 0, 60_000))
        )
    )
    second = await w.submit_async(lambda o, a, c: o.submit_sub(h["noop"]))
    await apoll(lambda: begun[0] != 0)
    await w.close_async(timeout=1.0)
    assert w.state is WorkerState.CLOSED
    assert not child_pids()
    for hd in (handle, second):
        assert hd.done()
        with pytest.raises(RunCancelled):
            await hd.wait_async()
