"""Chaos: children killed or wedged on purpose, and close() with work in flight.

Each case checks the error names the worker and pid, and that the Worker is
still healthy afterwards (the next run with SUB tasks completes, avoiding the
dead worker). Nothing here depends on timing: a task announces itself in a
heap tensor before it is killed, and a wedged task waits on a flag nobody sets.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from simpler_daemon import (
    RunCancelled,
    RunState,
    Tag,
    TaskError,
    WorkerClosedError,
)
from simpler_daemon.testing import child_pids, leaked_shm, poll_for, shm_files
from tests.support.sub_tasks import targs
from tests.support.worker_pool import Pool

#: What the ``pool`` fixture (tests/conftest.py) and the Pools made here register.
POOL_TASKS = ("fill", "consume", "wait_flag", "record_pid", "die", "chain_step", "noop")


def assert_healthy_without(pool: Pool, dead_pid: int, n: int = 6) -> None:
    """A run of ``n`` SUB tasks completes, none of them on the dead worker."""
    w, h = pool.w, pool.h
    pids = w.alloc((n,), "int64")
    w.run(
        lambda o, a, c: [
            o.submit_sub(h["record_pid"], targs((pids, Tag.NO_DEP), scalars=(i,))) for i in range(n)
        ]
    )
    ran_on = {int(p) for p in pids}
    assert 0 not in ran_on and dead_pid not in ran_on
    assert ran_on <= pool.live_pids()


@pytest.mark.timeout(60)
def test_sigkill_of_a_worker_during_a_run_fails_it_with_an_endpoint_failure(pool: Pool) -> None:
    w, h = pool.w, pool.h
    flags = w.alloc((1,), "int64")
    started = w.alloc((1,), "int64")
    x = w.alloc((4,), "float64")
    marker = w.alloc((4,), "float64")
    ind = [w.alloc((4,), "float64") for _ in range(3)]

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(
            h["wait_flag"],
            targs(
                (flags, Tag.NO_DEP), (started, Tag.NO_DEP), (x, Tag.OUTPUT), scalars=(0, 0, 60_000)
            ),
        )
        o.submit_sub(h["consume"], targs((x, Tag.INPUT), (marker, Tag.OUTPUT), scalars=(1,)))
        for i, t in enumerate(ind):
            o.submit_sub(h["fill"], targs((t, Tag.OUTPUT), scalars=(i + 1,)))

    handle = w.submit(orch)
    poll_for(lambda: started[0] != 0, timeout=30, message="the victim task never started")
    victim = int(started[0])
    wid = pool.worker_of(victim)
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(TaskError) as info:
        handle.wait(timeout=60)
    err = info.value
    assert not isinstance(err, RunCancelled)
    assert err.outcome == "ENDPOINT_FAILURE"
    assert err.run_id == handle.run_id and handle.state is RunState.FAILED
    assert err.worker_id == wid and err.pid == victim
    assert err.hashid == h["wait_flag"].hashid
    assert f"sub worker {wid} (pid {victim})" in str(err)
    assert "killed by SIGKILL" in err.remote_text
    assert (marker == 0).all()  # the consumer of the lost task never ran
    assert [float(t[0]) for t in ind] == [1.0, 2.0, 3.0]  # independent tasks still completed
    assert victim not in pool.live_pids()  # dead (or already replaced): never used again
    assert_healthy_without(pool, victim)
    assert_healthy_without(pool, victim)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mode", "death"),
    [(0, "killed by SIGKILL"), (1, "exited with code 3"), (2, "killed by SIGSEGV")],
    ids=["sigkill-self", "os-exit", "segfault"],
)
def test_a_child_dying_inside_a_task_is_an_endpoint_failure_naming_it(
    pool: Pool, mode: int, death: str
) -> None:
    w, h = pool.w, pool.h
    who = w.alloc((1,), "int64")
    ids = {
        i["pid"]: i["worker_id"] for i in pool.sub_info()
    }  # before the death (and any replacement)
    with pytest.raises(TaskError) as info:
        w.run(lambda o, a, c: o.submit_sub(h["die"], targs((who, Tag.OUTPUT), scalars=(mode,))))
    err = info.value
    victim = int(who[0])
    assert err.outcome == "ENDPOINT_FAILURE"
    assert err.pid == victim and err.worker_id == ids[victim]
    assert death in err.remote_text and f"pid {victim}" in str(err)
    assert_healthy_without(pool, victim)


@pytest.mark.timeout(60)
def test_close_with_a_run_in_flight_drains_it_within_the_budget() -> None:
    pool = Pool(2, tasks=POOL_TASKS)
    w, h = pool.w, pool.h
    counter = w.alloc((1,), "int64")
    n = 50

    def orch(o: Any, args: Any, config: Any) -> None:
        for i in range(n):
            o.submit_sub(h["chain_step"], targs((counter, Tag.INOUT), scalars=(i,)))

    shm_before = shm_files()
    handle = w.submit(orch)
    assert not handle.done()
    w.close(timeout=20.0)
    assert handle.done() and handle.state is RunState.COMPLETED
    handle.wait()
    assert counter[0] == n
    assert not child_pids()
    assert not leaked_shm(shm_before)  # heaps of test processes beside this one are theirs
    w.close()  # a second close is a no-op


@pytest.mark.timeout(60)
def test_close_cancels_a_wedged_run_and_the_runs_behind_it_and_leaves_nothing() -> None:
    pool = Pool(2, tasks=POOL_TASKS)
    w, h = pool.w, pool.h
    flags = w.alloc((1,), "int64")
    started = w.alloc((1,), "int64")
    x = w.alloc((4,), "float64")
    markers = [w.alloc((4,), "float64") for _ in range(3)]
    built: list[int] = []

    def wedged(o: Any, args: Any, config: Any) -> None:
        # waits for a flag nobody sets (its own deadline is far beyond the close budget)
        o.submit_sub(
            h["wait_flag"],
            targs(
                (flags, Tag.NO_DEP), (started, Tag.NO_DEP), (x, Tag.OUTPUT), scalars=(0, 0, 60_000)
            ),
        )
        o.submit_sub(h["consume"], targs((x, Tag.INPUT), (markers[0], Tag.OUTPUT), scalars=(1,)))

    def behind(o: Any, args: Any, config: Any) -> None:
        built.append(o.run_id)
        o.submit_sub(h["fill"], targs((markers[len(built)], Tag.OUTPUT), scalars=(5,)))

    shm_before = shm_files()
    h1 = w.submit(wedged)
    h2 = w.submit(behind)  # admitted successor, built, waiting for the head
    h3 = w.submit(behind)  # waiting in admission
    poll_for(lambda: started[0] != 0, timeout=30)
    w.close(timeout=1.0)
    assert not child_pids()
    assert not leaked_shm(shm_before)  # heaps of test processes beside this one are theirs
    for handle in (h1, h2, h3):
        assert handle.done() and handle.state is RunState.FAILED
        with pytest.raises(RunCancelled, match="cancelled"):
            handle.wait()
    assert built == [h2.run_id]  # the run still waiting in admission was never built
    assert all((m == 0).all() for m in markers)
    with pytest.raises(WorkerClosedError):
        w.submit(behind)


@pytest.mark.timeout(60)
def test_close_right_after_a_kill_reaps_everything() -> None:
    pool = Pool(2, tasks=POOL_TASKS)
    w, h = pool.w, pool.h
    flags = w.alloc((1,), "int64")
    started = w.alloc((1,), "int64")
    handle = w.submit(
        lambda o, a, c: o.submit_sub(
            h["wait_flag"],
            targs((flags, Tag.NO_DEP), (started, Tag.NO_DEP), scalars=(0, 0, 60_000)),
        )
    )
    poll_for(lambda: started[0] != 0, timeout=30)
    os.kill(int(started[0]), signal.SIGKILL)
    w.close(timeout=5.0)
    assert handle.done() and handle.state is RunState.FAILED
    with pytest.raises(TaskError):
        handle.result()
    assert not child_pids()
