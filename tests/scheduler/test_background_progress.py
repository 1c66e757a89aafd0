"""Runs progress on their own in the blocking API.

After ``h = w.submit(orch)`` the run finishes with no further call into the Worker: a
background driver thread takes over while runs are unfinished and no caller drives,
hands the lock back to a caller that waits, and exits once no run is left, so a later
Worker's init (a fork) in the same process still works. Real SUB children, under
``fifo`` and ``fair`` admission. Progress is observed by polling ``done()`` and heap
words with a deadline, never by timing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from simpler_daemon import (
    RunState,
    StartupError,
    Worker,
    WorkerState,
)
from simpler_daemon.testing import poll_for
from tests.support import sub_tasks as tasks
from tests.support.sub_tasks import targs
from tests.support.worker_pool import Pool

pytestmark = pytest.mark.timeout(120)

DRIVER = "simpler-driver"


def driver_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == DRIVER]


def only_main_thread() -> bool:
    return threading.active_count() == 1


#: What the ``pool`` fixture (tests/conftest.py) registers; each test that uses it runs
#: under both admission policies.
POOL_TASKS = ("wait_flag", "chain_step", "noop", "set_flag")
POOL_ADMISSIONS = ("fifo", "fair")


@pytest.fixture(autouse=True)
def no_thread_outlives_the_pool() -> Iterator[None]:
    """Runs after the pool's teardown: close joins the background thread, so a fork right
    after it would be allowed."""
    yield
    assert only_main_thread(), f"threads outlived close: {threading.enumerate()}"


def test_a_run_submitted_and_never_waited_on_completes(pool: Pool) -> None:
    w = pool.w
    counter = w.alloc((1,), "int64")
    handle = w.submit(pool.chain(counter, 50))
    # No call into the Worker from here on: only the handle's state and heap words.
    poll_for(handle.done, timeout=60, message="the submitted run never finished on its own")
    assert handle.state is RunState.COMPLETED
    assert counter[0] == 50
    # No run left: the background thread exits by itself (no close, no other call).
    poll_for(only_main_thread, timeout=30, message=f"driver thread stayed: {driver_threads()}")
    for _ in range(20):
        # Worker.run drives its run to the end itself: it leaves nothing to a thread.
        counter[0] = 0
        w.run(pool.chain(counter, 2))
        assert not driver_threads()


def test_several_submitted_runs_all_complete_on_their_own(pool: Pool) -> None:
    w = pool.w
    counters = [w.alloc((1,), "int64") for _ in range(6)]
    handles = [w.submit(pool.chain(c, 10)) for c in counters]
    poll_for(lambda: all(h.done() for h in handles), timeout=60)
    assert [int(c[0]) for c in counters] == [10] * 6
    assert all(h.state is RunState.COMPLETED for h in handles)


def test_a_caller_that_waits_takes_over_and_hands_back(pool: Pool) -> None:
    w = pool.w
    flags = w.alloc((2,), "int64")
    slow = w.submit(pool.waiting_on(flags, 0))
    # The background thread drives the gated run...
    poll_for(driver_threads, timeout=30, message="no background driver for an unfinished run")
    # ...a caller that waits takes the rounds over, and hands them back when it leaves.
    with pytest.raises(TimeoutError):
        slow.wait(timeout=0.05)
    assert not slow.done()
    if w.admission == "fair":
        # Other runs share the idle worker: a caller drives its own runs meanwhile.
        counter = w.alloc((1,), "int64")
        w.run(pool.chain(counter, 20))
        assert counter[0] == 20
        assert not slow.done()
    # The caller left with the gated run unfinished: it completes without anyone waiting.
    flags[0] = 1
    poll_for(slow.done, timeout=60, message="the gated run never finished after the handover")
    assert slow.state is RunState.COMPLETED
    poll_for(only_main_thread, timeout=30)
    # A caller waiting while the background thread drives finishes its run itself.
    second = w.submit(pool.waiting_on(flags, 1))
    poll_for(driver_threads, timeout=30)
    flags[1] = 1
    second.wait(timeout=60)
    assert second.state is RunState.COMPLETED


def test_wait_with_a_timeout_leaves_the_run_to_the_background(pool: Pool) -> None:
    w = pool.w
    flags = w.alloc((1,), "int64")
    handle = w.submit(pool.waiting_on(flags))
    with pytest.raises(TimeoutError, match=f"run {handle.run_id} not finished"):
        handle.wait(timeout=0.05)
    flags[0] = 1
    poll_for(handle.done, timeout=60)
    handle.wait()


def test_close_with_a_run_in_flight_joins_the_background_thread(pool: Pool) -> None:
    w = pool.w
    flags = w.alloc((1,), "int64")
    handle = w.submit(pool.waiting_on(flags))
    poll_for(driver_threads, timeout=30)
    w.close(timeout=1.0)
    assert handle.done()
    assert only_main_thread(), f"close left threads: {threading.enumerate()}"


@pytest.mark.parametrize("admission", ["fifo", "fair"])
def test_a_later_worker_init_forks_after_the_background_thread_exited(admission: str) -> None:
    first = Pool(admission=admission, tasks=POOL_TASKS)
    second: Worker | None = None
    third: Worker | None = None
    try:
        counter = first.w.alloc((1,), "int64")
        handle = first.w.submit(first.chain(counter, 10))
        poll_for(handle.done, timeout=60)
        # The first Worker is still open; its idle thread must not block this fork.
        second = Worker(num_sub_workers=1, admission=admission)
        h2 = second.register(tasks.noop)
        second.init()
        second.run(lambda o, a, c: o.submit_sub(h2, targs()))

        # While the first Worker's runs are in flight on its thread, a fork is refused
        # with a clear reason and the new Worker stays NEW (it can init later).
        flags = first.w.alloc((1,), "int64")
        gated = first.w.submit(first.waiting_on(flags))
        poll_for(driver_threads, timeout=30)
        third = Worker(num_sub_workers=1, admission=admission)
        with pytest.raises(StartupError, match=r"cannot init: another Worker .* unfinished run"):
            third.init()
        assert third.state is WorkerState.NEW
        flags[0] = 1
        poll_for(gated.done, timeout=60)
        third.init()
        assert third.ping(0) > 0  # READY: its child answers
    finally:
        for w in (third, second, first.w):
            if w is not None:
                w.close()
    assert only_main_thread()
