"""A run handle (``RunHandle``) behaves like a future.

``result(timeout)`` blocks and returns the task results (``Run.task_results()``),
``exception``, ``done``/``running``/``cancelled``, ``cancel(terminate=False) -> bool``,
``add_done_callback`` (fires on its own, at once when done, a raising callback is
logged), ``await handle`` on the bound loop and from a foreign loop, and
``Worker.cancel(handle, terminate=True, reason=...)``. Real SUB children, under
``fifo`` and ``fair`` admission; waits poll with a deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

import pytest

from simpler_daemon import (
    RunCancelled,
    RunHandle,
    RunState,
    Tag,
    TaskError,
    Worker,
)
from simpler_daemon.engine import worker as worker_module
from simpler_daemon.testing import poll_for
from tests.support import sub_tasks as tasks
from tests.support.sub_tasks import targs
from tests.support.worker_pool import Pool

pytestmark = pytest.mark.timeout(120)


#: What the ``pool`` fixture (tests/conftest.py) registers; each test that uses it runs
#: under both admission policies.
POOL_TASKS = ("double_scalar", "gated_double", "fail", "noop", "wait_flag")
POOL_ADMISSIONS = ("fifo", "fair")


def test_run_handle_lives_in_its_own_module_and_is_re_exported() -> None:
    from simpler_daemon.engine.handle import RunHandle as FromHandle

    assert RunHandle is FromHandle is worker_module.RunHandle


def test_result_blocks_and_returns_the_task_results_in_order(pool: Pool) -> None:
    p = pool

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(p.h["double_scalar"], targs(scalars=(1,)))
        o.submit_sub_group(p.h["double_scalar"], [targs(scalars=(2,)), targs(scalars=(3,))])
        o.submit_sub(p.h["noop"], targs())

    handle = p.w.submit(orch)
    assert handle.result(timeout=60) == [2, [4, 6], None]
    assert handle.done() and not handle.running() and not handle.cancelled()
    assert handle.exception() is None
    assert handle.result() == [2, [4, 6], None]  # again, at once


def test_result_with_a_timeout_raises_timeout_error_on_a_slow_run(pool: Pool) -> None:
    flags = pool.w.alloc((1,), "int64")
    handle = pool.w.submit(pool.gated_double(flags, 7))
    with pytest.raises(TimeoutError, match=f"run {handle.run_id} not finished"):
        handle.result(timeout=0.05)
    with pytest.raises(TimeoutError):
        handle.exception(timeout=0.01)
    assert not handle.done() and handle.running() and not handle.cancelled()
    with pytest.raises(ValueError, match="timeout"):
        handle.result(timeout=-1)
    flags[0] = 1
    assert handle.result(timeout=60) == [14]
    assert handle.state is RunState.COMPLETED


def test_add_done_callback_fires_on_its_own_and_at_once_when_done(
    pool: Pool, caplog: pytest.LogCaptureFixture
) -> None:
    flags = pool.w.alloc((1,), "int64")
    handle = pool.w.submit(pool.gated_double(flags))
    seen: list[tuple[RunHandle, str]] = []
    fired = threading.Event()

    def record(h: RunHandle) -> None:
        seen.append((h, threading.current_thread().name))
        fired.set()

    def explode(h: RunHandle) -> None:
        raise RuntimeError("callback exploded on purpose")

    handle.add_done_callback(explode)  # logged, and the next callback still runs
    handle.add_done_callback(record)
    assert not seen
    flags[0] = 1
    # Nobody calls into the Worker: the run ends on the background driver thread.
    assert fired.wait(60), "the done callback never fired"
    assert seen == [(handle, "simpler-driver")]
    assert handle.done() and handle.result() == [14]
    assert any(
        "done callback" in r.getMessage()
        and r.exc_info is not None
        and "exploded on purpose" in str(r.exc_info[1])
        for r in caplog.records
    ), caplog.records
    # Already done: called at once, on this thread.
    handle.add_done_callback(record)
    assert seen[-1] == (handle, threading.current_thread().name)
    # The scheduler carried on: the worker serves the next run.
    again = pool.w.submit(pool.one(pool.h["double_scalar"], 5))
    assert again.result(timeout=60) == [10]


def test_cancel_returns_true_then_false_and_the_handle_reports_it(pool: Pool) -> None:
    flags = pool.w.alloc((1,), "int64")
    handle = pool.w.submit(pool.gated_double(flags))
    assert handle.running()
    assert handle.cancel() is True
    flags[0] = 1  # the running task finishes; the run ends cancelled
    poll_for(handle.done, timeout=60)
    assert handle.cancelled() and not handle.running()
    assert isinstance(handle.exception(), RunCancelled)
    with pytest.raises(RunCancelled):
        handle.result()
    assert handle.cancel() is False


def test_a_failed_run_raises_from_result_and_is_returned_by_exception(pool: Pool) -> None:
    handle = pool.w.submit(pool.one(pool.h["fail"], 3))
    error = handle.exception(timeout=60)
    assert isinstance(error, TaskError) and "exploded on purpose (3)" in str(error.remote_text)
    with pytest.raises(TaskError):
        handle.result(timeout=60)
    assert not handle.cancelled()


def test_an_orchestration_exception_is_the_result_error(pool: Pool) -> None:
    def orch(o: Any, args: Any, config: Any) -> None:
        raise KeyError("orchestration exploded")

    handle = pool.w.submit(orch)
    assert isinstance(handle.exception(timeout=60), KeyError)
    with pytest.raises(KeyError, match="orchestration exploded"):
        handle.result()


def test_await_from_a_foreign_loop_while_the_background_thread_drives(pool: Pool) -> None:
    flags = pool.w.alloc((1,), "int64")
    handle = pool.w.submit(pool.gated_double(flags, 4))

    async def main() -> list[Any]:
        asyncio.get_running_loop().call_later(0.05, flags.__setitem__, 0, 1)
        with pytest.raises(TimeoutError):
            await handle.wait_async(timeout=0.001)
        return await handle

    assert asyncio.run(main()) == [8]


def test_worker_cancel_with_terminate_stops_a_running_task(pool: Pool) -> None:
    before = {row["pid"] for row in pool.w.list_workers()}
    handle, started = pool.stuck()
    poll_for(lambda: started[0] != 0, timeout=30, message="the stuck task never started")
    pool.w.cancel(handle, terminate=True, reason="test: stop it")
    poll_for(handle.done, timeout=30, message="terminate did not stop the sleeping task")
    assert handle.cancelled()
    with pytest.raises(RunCancelled):
        handle.result()
    # The killed worker was replaced and the pool serves on.
    assert pool.w.submit(pool.one(pool.h["double_scalar"], 21)).result(timeout=60) == [42]
    after = {row["pid"] for row in pool.w.list_workers()}
    assert len(after) == len(before) and after != before


def test_handle_cancel_with_terminate(pool: Pool) -> None:
    handle, started = pool.stuck()
    poll_for(lambda: started[0] != 0, timeout=30, message="the stuck task never started")
    assert handle.cancel(terminate=True) is True
    poll_for(handle.done, timeout=30, message="terminate did not stop the sleeping task")
    assert isinstance(handle.exception(), RunCancelled)


@pytest.mark.asyncio
async def test_await_on_the_bound_loop() -> None:
    w = Worker(num_sub_workers=1, admission="fair")
    h = w.register(tasks.double_scalar)
    async with w:
        handle = await w.submit_async(lambda o, a, c: o.submit_sub(h, targs(scalars=(11,))))
        assert await handle == [22]
        assert handle.result() == [22]  # done: no blocking call on the loop
        fired: list[RunHandle] = []
        second = await w.submit_async(lambda o, a, c: o.submit_sub(h, targs(scalars=(1,))))
        second.add_done_callback(fired.append)
        assert await second == [2]
        assert fired == [second]


def test_await_from_a_foreign_loop_of_a_bound_worker() -> None:
    w = Worker(num_sub_workers=1, admission="fifo")
    h = w.register(tasks.double_scalar)
    w.init()
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, name="bound-loop")
    runner.start()
    try:
        asyncio.run_coroutine_threadsafe(w.start_async(), loop).result(30)
        handle = w.submit(lambda o, a, c: o.submit_sub(h, targs(scalars=(5,))))

        async def main() -> list[Any]:
            return await handle  # the bound loop finishes it on its own thread

        assert asyncio.run(main()) == [10]
        assert handle.result(timeout=30) == [10]
    finally:
        w.close()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(30)
        loop.close()


# -- waiting never blocks other threads; a done callback cannot wait -------------------------------


def test_waiting_in_one_thread_never_blocks_submit_or_cancel_in_another() -> None:
    """Thread A blocks in ``result()`` of a 20 s task; the main thread submits a small run
    (its result comes while A still waits: the big run is not done) and then terminates
    A's run (A's ``result()`` raises ``RunCancelled``: the task did not end on its own).
    Before the fix both calls waited for the big run to complete."""
    w = Worker(num_sub_workers=2, admission="fair")
    sleep = w.register(tasks.sleep_ms)
    dbl = w.register(tasks.double_scalar)
    w.init()
    try:
        big = w.submit(lambda o, a, c: o.submit_sub(sleep, targs(scalars=(20_000,))))
        outcome: list[BaseException | list[Any]] = []
        entered = threading.Event()

        def wait_big() -> None:
            entered.set()
            try:
                outcome.append(big.result(timeout=60))
            except BaseException as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait_big, name="waiter-a")
        waiter.start()
        try:
            assert entered.wait(30)
            poll_for(lambda: w._driver.lock._owner == waiter.ident, timeout=30)
            small = w.submit(lambda o, a, c: o.submit_sub(dbl, targs(scalars=(21,))))
            assert small.result(timeout=30) == [42]
            assert not big.done(), "the small run had to wait for the big one"
            assert big.cancel(terminate=True) is True
            waiter.join(30)
            assert not waiter.is_alive()
            assert len(outcome) == 1 and isinstance(outcome[0], RunCancelled), outcome
        finally:
            waiter.join(60)
    finally:
        w.close()


def test_a_done_callback_that_waits_on_its_worker_gets_a_clear_error(
    pool: Pool, caplog: pytest.LogCaptureFixture
) -> None:
    p = pool
    errors: list[BaseException] = []
    submitted: list[RunHandle] = []
    fired = threading.Event()

    def waits(h: RunHandle) -> None:
        try:
            try:
                p.w.run(p.one(p.h["double_scalar"], 1))
            except RuntimeError as exc:
                errors.append(exc)
            try:
                p.w.submit(p.one(p.h["double_scalar"], 2)).result()
            except RuntimeError as exc:
                errors.append(exc)
            # Submitting (without waiting) keeps working.
            submitted.append(p.w.submit(p.one(p.h["double_scalar"], 3)))
        finally:
            fired.set()

    def raises(h: RunHandle) -> None:
        p.w.run(p.one(p.h["double_scalar"], 4))

    handle = p.w.submit(p.one(p.h["double_scalar"], 5))
    handle.add_done_callback(waits)
    handle.add_done_callback(raises)
    assert fired.wait(60), "the done callback never ran (or hangs)"
    assert handle.result(timeout=60) == [10]
    assert len(errors) == 2, errors
    for exc in errors:
        assert "cannot wait for a run inside a done callback" in str(exc)
        assert "add_done_callback" in str(exc)
    poll_for(lambda: any("done callback" in r.getMessage() for r in caplog.records), timeout=30)
    assert submitted and submitted[0].result(timeout=60) == [6]
    # The worker keeps working.
    assert p.w.submit(p.one(p.h["double_scalar"], 8)).result(timeout=60) == [16]


def test_cancel_has_one_meaning_under_both_policies(pool: Pool) -> None:
    """Once ``cancel()`` returned, a run with no task running is done and cancelled at
    once; a run with a task running is done (and cancelled) when that task ends, under
    ``fifo`` as under ``fair`` (what differs is only whether admission let a run start)."""
    p = pool
    busy = p.w.alloc((1,), "int64")
    gate = p.w.alloc((1,), "int64")
    h = p.h["gated_double"]

    def two(o: Any, args: Any, config: Any) -> None:
        for v in (1, 2):
            o.submit_sub(h, targs((busy, Tag.NO_DEP), scalars=(v,)))

    running = p.w.submit(two)  # holds both workers until busy[0] is set
    poll_for(lambda: running.run.counts["running"] == 2, timeout=30)
    waiting = p.w.submit(p.gated_double(gate))  # no worker is free: none of its tasks runs
    assert waiting.cancel() is True
    assert waiting.done() and waiting.cancelled()
    with pytest.raises(RunCancelled, match=f"run {waiting.run_id} cancelled"):
        waiting.result()
    assert running.cancel() is True
    assert running.run.cancelled and not running.done() and not running.cancelled()
    busy[0] = 1
    poll_for(running.done, timeout=60)
    assert running.cancelled() and isinstance(running.exception(), RunCancelled)


def test_a_thread_in_worker_run_lets_another_thread_submit_and_wait() -> None:
    """``w.run`` drives from its submit to its end: it hands the Scheduler over too."""
    w = Worker(num_sub_workers=2, admission="fair")
    gate = w.register(tasks.gated_double)
    dbl = w.register(tasks.double_scalar)
    w.init()
    try:
        flags = w.alloc((1,), "int64")
        done = threading.Event()

        def run_big() -> None:
            try:
                w.run(lambda o, a, c: o.submit_sub(gate, targs((flags, Tag.NO_DEP), scalars=(1,))))
            finally:
                done.set()

        runner = threading.Thread(target=run_big, name="runner-a")
        runner.start()
        try:
            poll_for(lambda: w._driver.lock._owner == runner.ident, timeout=30)
            small = w.submit(lambda o, a, c: o.submit_sub(dbl, targs(scalars=(4,))))
            assert small.result(timeout=30) == [8]
            assert not done.is_set(), "the small run waited for the big one"
        finally:
            flags[0] = 1
            runner.join(60)
        assert done.is_set()
    finally:
        w.close()


# -- the standard library's futures functions ---------------------------------------------


def test_concurrent_futures_wait_and_as_completed_take_run_handles(pool: Pool) -> None:
    """``wait`` and ``as_completed`` read Future internals (``_condition``, ``_state``,
    ``_waiters``): a RunHandle used to raise AttributeError there."""
    flags = pool.w.alloc((1,), "int64")
    fast = pool.w.submit(pool.one(pool.h["double_scalar"], 2))
    assert isinstance(fast, concurrent.futures.Future)
    assert fast.result(timeout=60) == [4]
    slow = pool.w.submit(pool.gated_double(flags, 5))
    done, pending = concurrent.futures.wait([fast, slow], timeout=0.05)
    assert done == {fast} and pending == {slow}  # the gate holds slow: no timing involved
    done, pending = concurrent.futures.wait([fast, slow], return_when="FIRST_COMPLETED")
    assert done == {fast} and pending == {slow}
    order: list[RunHandle] = []
    threading.Timer(0.05, flags.__setitem__, (0, 1)).start()
    for f in concurrent.futures.as_completed([slow, fast], timeout=60):
        order.append(f)
    assert order == [fast, slow] and slow.result() == [10]


def test_wait_first_exception_and_cancelled_runs(pool: Pool) -> None:
    flags = pool.w.alloc((1,), "int64")
    # Failing first: under fifo a run starts at the head of admission only.
    failing = pool.w.submit(pool.one(pool.h["fail"], 3))
    held = pool.w.submit(pool.gated_double(flags, 1))
    done, pending = concurrent.futures.wait(
        [held, failing], timeout=60, return_when=concurrent.futures.FIRST_EXCEPTION
    )
    assert done == {failing} and pending == {held}
    assert held.cancel() is True
    flags[0] = 1  # the running task ends; the run ends cancelled
    done, pending = concurrent.futures.wait([held], timeout=60)
    assert done == {held} and not pending and held.cancelled()


def test_asyncio_wrap_future_and_gather_of_run_handles(pool: Pool) -> None:
    from simpler_daemon.futures import gather

    async def main() -> tuple[list[Any], BaseException | None]:
        ok = asyncio.wrap_future(pool.w.submit(pool.one(pool.h["double_scalar"], 21)))
        bad = asyncio.wrap_future(pool.w.submit(pool.one(pool.h["fail"], 4)))
        values = await asyncio.wait_for(ok, 60)
        try:
            await asyncio.wait_for(bad, 60)
        except TaskError as exc:
            return values, exc
        return values, None

    values, error = asyncio.run(main())
    assert values == [42] and isinstance(error, TaskError)

    runs = [pool.w.submit(pool.one(pool.h["double_scalar"], n)) for n in range(4)]
    assert gather(runs, timeout=60) == [[0], [2], [4], [6]]
    mixed = [runs[0], pool.w.submit(pool.one(pool.h["fail"], 5))]
    with pytest.raises(TaskError):
        gather(mixed, timeout=60)
    out = gather(mixed, timeout=60, return_exceptions=True)
    assert out[0] == [0] and isinstance(out[1], TaskError)


def test_a_run_handle_is_settled_by_its_run_not_by_its_holder(pool: Pool) -> None:
    handle = pool.w.submit(pool.one(pool.h["noop"]))
    for call in (
        lambda: handle.set_result(1),
        lambda: handle.set_exception(ValueError()),
        handle.set_running_or_notify_cancel,
    ):
        with pytest.raises(RuntimeError, match="settled by its run"):
            call()
    assert handle.result(timeout=60) == [None]
