"""The public Worker over real SUB children (blocking API).

Order and concurrency are proven by what the tasks record in heap tensors
(pids, monotonic marks, flags) — never by timing.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import numpy as np
import pytest

from simpler_daemon import (
    CallableHandle,
    CallConfig,
    RunCancelled,
    RunState,
    Tag,
    TaskArgs,
    TaskError,
    Worker,
    WorkerClosedError,
    WorkerState,
    WorkerStateError,
)
from simpler_daemon.testing import poll_for
from tests.support import sub_tasks as tasks
from tests.support.sub_tasks import targs
from tests.support.worker_pool import Pool


def test_quick_usage_fills_a_heap_tensor(pool: Pool) -> None:
    w, h = pool.w, pool.h
    x = w.alloc((16,), "float64")

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(h["fill"], targs((x, Tag.OUTPUT), scalars=(7,)))

    w.run(orch)
    assert (x == 7).all()


def test_arrays_allocated_before_init_are_shared_with_children() -> None:
    w = Worker(num_sub_workers=1)
    x = w.alloc((8,), "int32")
    h = w.register(tasks.fill)
    w.init()
    try:
        w.run(lambda o, a, c: o.submit_sub(h, targs((x, Tag.OUTPUT), scalars=(3,))))
        assert (x == 3).all()
    finally:
        w.close()


def test_producer_and_consumer_are_ordered_by_tags(pool: Pool) -> None:
    w, h = pool.w, pool.h
    pairs = 8
    xs = [w.alloc((32,), "float64") for _ in range(pairs)]
    ys = [w.alloc((32,), "float64") for _ in range(pairs)]
    marks = w.alloc((2 * pairs, 3), "int64")

    def orch(o: Any, args: Any, config: Any) -> None:
        for i in range(pairs):
            # the consumer is submitted right behind its producer; with two idle workers it
            # would start at once unless it waited for the producer
            o.submit_sub(
                h["marked_fill"],
                targs((xs[i], Tag.OUTPUT), (marks, Tag.NO_DEP), scalars=(10 + i, 2 * i)),
            )
            o.submit_sub(
                h["marked_consume"],
                targs(
                    (xs[i], Tag.INPUT),
                    (ys[i], Tag.OUTPUT),
                    (marks, Tag.NO_DEP),
                    scalars=(2 * i + 1,),
                ),
            )

    w.run(orch)
    for i in range(pairs):
        assert (ys[i] == 11 + i).all()
        producer_end, consumer_start = marks[2 * i, 2], marks[2 * i + 1, 1]
        assert consumer_start >= producer_end > 0
    assert set(marks[:, 0]) <= pool.pids()


def test_two_disjoint_writers_run_concurrently(pool: Pool) -> None:
    w, h = pool.w, pool.h
    flags = w.alloc((2,), "int64")
    out = w.alloc((16,), "float64")

    def orch(o: Any, args: Any, config: Any) -> None:
        # each writer waits (with a deadline that fails it) until the other has arrived:
        # only possible when both run at once
        o.submit_sub(
            h["rendezvous"],
            targs((flags, Tag.NO_DEP), (out[:8], Tag.OUTPUT), scalars=(0, 1, 20_000)),
        )
        o.submit_sub(
            h["rendezvous"],
            targs((flags, Tag.NO_DEP), (out[8:], Tag.OUTPUT), scalars=(1, 0, 20_000)),
        )

    w.run(orch)
    assert (out[:8] == 1).all() and (out[8:] == 2).all()
    assert set(flags) == pool.pids()  # the two writers ran in the two distinct children


def test_a_sub_group_of_two_runs_on_two_distinct_workers(pool: Pool) -> None:
    w, h = pool.w, pool.h
    pids = w.alloc((2,), "int64")

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub_group(
            h["record_pid_rendezvous"],
            [targs((pids, Tag.NO_DEP), scalars=(i, 2)) for i in range(2)],
        )

    w.run(orch)
    assert len(set(pids)) == 2 and set(pids) == pool.pids()


def test_a_sub_group_larger_than_the_pool_fails_clearly(pool: Pool) -> None:
    w, h = pool.w, pool.h

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub_group(h["noop"], [TaskArgs() for _ in range(3)])

    with pytest.raises(TaskError, match="needs 3 distinct SUB workers, the pool has 2"):
        w.run(orch)
    w.run(orch_noop(h["noop"]))


def orch_noop(handle: CallableHandle, n: int = 1) -> Any:
    def orch(o: Any, args: Any, config: Any) -> None:
        for _ in range(n):
            o.submit_sub(handle)

    return orch


def test_a_failing_producer_poisons_its_consumers_but_independent_tasks_complete(
    pool: Pool,
) -> None:
    w, h = pool.w, pool.h
    who = w.alloc((1,), "int64")
    gate = w.alloc((1,), "int64")
    x = w.alloc((4,), "float64")
    marker = w.alloc((4,), "float64")
    marker2 = w.alloc((4,), "float64")
    ind = [w.alloc((4,), "float64") for _ in range(4)]

    def orch(o: Any, args: Any, config: Any) -> None:
        # the producer fails only once the gate opens, i.e. after every task is submitted
        # (a submit into an already-failed run would re-raise instead)
        o.submit_sub(
            h["fail"], targs((who, Tag.OUTPUT), (gate, Tag.NO_DEP), (x, Tag.OUTPUT), scalars=(42,))
        )
        o.submit_sub(h["consume"], targs((x, Tag.INPUT), (marker, Tag.OUTPUT), scalars=(5,)))
        o.submit_sub(h["consume"], targs((marker, Tag.INPUT), (marker2, Tag.OUTPUT), scalars=(9,)))
        for i, t in enumerate(ind):
            o.submit_sub(h["fill"], targs((t, Tag.OUTPUT), scalars=(i + 1,)))
        gate[0] = 1

    handle = w.submit(orch)
    with pytest.raises(TaskError) as info:
        handle.wait(timeout=60)
    err = info.value
    assert not isinstance(err, RunCancelled)
    assert handle.done() and handle.state is RunState.FAILED
    assert err.run_id == handle.run_id
    assert err.outcome == "TASK_FAILURE"
    assert err.hashid == h["fail"].hashid
    assert err.pid == int(who[0]) and err.worker_id == pool.worker_of(int(who[0]))
    assert err.dispatch_id is not None and err.dispatch_id >= 1
    assert "ValueError: producer exploded on purpose (42)" in err.remote_text
    assert "Traceback (most recent call last)" in err.remote_text and "tasks.py" in err.remote_text
    assert "ValueError: producer exploded on purpose (42)" in str(err)
    assert f"worker {err.worker_id} (pid {err.pid})" in str(err)
    # the consumers never ran; every independent task did
    assert (marker == 0).all() and (marker2 == 0).all()
    assert [float(t[0]) for t in ind] == [1.0, 2.0, 3.0, 4.0]
    assert handle.run.counts == {"done": 4, "failed": 1, "running": 0, "skipped": 2}
    # a failed run never poisons the worker
    y = w.alloc((4,), "float64")
    w.run(lambda o, a, c: o.submit_sub(h["fill"], targs((y, Tag.OUTPUT), scalars=(8,))))
    assert (y == 8).all()


def test_submitting_into_a_run_that_already_failed_reraises(pool: Pool) -> None:
    w, h = pool.w, pool.h
    seen: list[TaskError] = []

    def submit_once_more(o: Any) -> bool:
        try:
            o.submit_sub(h["noop"])
        except TaskError as exc:
            seen.append(exc)
            return True
        return False

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(h["fail"], targs(scalars=(7,)))
        # keep submitting until the failure has reached the run: then a submit re-raises
        poll_for(lambda: submit_once_more(o), timeout=30, message="submit never re-raised")
        submit_once_more(o)

    with pytest.raises(TaskError) as info:
        w.run(orch)
    assert len(seen) == 2 and seen[0] is seen[1] is info.value
    assert (
        info.value.outcome == "TASK_FAILURE"
        and "producer exploded on purpose (7)" in info.value.remote_text
    )
    w.run(orch_noop(h["noop"]))


def test_cancel_fails_unstarted_tasks_and_running_ones_finish(pool: Pool) -> None:
    w, h = pool.w, pool.h
    flags = w.alloc((1,), "int64")
    started = w.alloc((1,), "int64")
    x = w.alloc((4,), "float64")
    markers = [w.alloc((4,), "float64") for _ in range(3)]

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(
            h["wait_flag"],
            targs(
                (flags, Tag.NO_DEP), (started, Tag.NO_DEP), (x, Tag.OUTPUT), scalars=(0, 0, 30_000)
            ),
        )
        for m in markers:
            o.submit_sub(h["consume"], targs((x, Tag.INPUT), (m, Tag.OUTPUT), scalars=(3,)))

    handle = w.submit(orch)
    poll_for(lambda: started[0] != 0, timeout=30, message="the blocking task never started")
    handle.cancel()
    assert handle.run.cancelled
    flags[0] = 1  # let the running task finish
    with pytest.raises(RunCancelled) as info:
        handle.wait(timeout=60)
    assert handle.done() and handle.state is RunState.FAILED
    assert info.value.run_id == handle.run_id
    assert all((m == 0).all() for m in markers)
    assert handle.run.counts["done"] == 1  # the running task finished
    w.run(orch_noop(h["noop"]))


def test_cancel_of_queued_runs_never_runs_them(pool: Pool) -> None:
    w, h = pool.w, pool.h
    flags = w.alloc((1,), "int64")
    started = w.alloc((1,), "int64")
    marker = w.alloc((4,), "float64")
    built: list[int] = []

    def head(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(
            h["wait_flag"],
            targs((flags, Tag.NO_DEP), (started, Tag.NO_DEP), scalars=(0, 0, 30_000)),
        )

    def queued(o: Any, args: Any, config: Any) -> None:
        built.append(o.run_id)
        o.submit_sub(h["fill"], targs((marker, Tag.OUTPUT), scalars=(1,)))

    h1 = w.submit(head)
    h2 = w.submit(queued)  # the prepared successor (built, waiting)
    h3 = w.submit(queued)  # waits in admission, not built
    assert built == [h2.run_id]
    poll_for(lambda: started[0] != 0, timeout=30)
    h3.cancel()
    h2.cancel()
    assert h2.done() and h3.done()
    with pytest.raises(RunCancelled):
        h2.result()
    with pytest.raises(RunCancelled):
        h3.wait()
    flags[0] = 1
    h1.wait(timeout=60)
    w.run(orch_noop(h["noop"]))
    assert built == [h2.run_id]  # the cancelled run's orchestration never ran
    assert (marker == 0).all()


def test_submit_wait_done_and_result(pool: Pool) -> None:
    w, h = pool.w, pool.h
    flags = w.alloc((1,), "int64")
    started = w.alloc((1,), "int64")

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(
            h["wait_flag"],
            targs((flags, Tag.NO_DEP), (started, Tag.NO_DEP), scalars=(0, 0, 30_000)),
        )

    handle = w.submit(orch)
    assert not handle.done()
    assert handle.run_id > 0 and repr(handle).startswith("RunHandle(")
    with pytest.raises(TimeoutError):
        handle.result(timeout=0)
    poll_for(lambda: started[0] != 0, timeout=30)
    with pytest.raises(TimeoutError, match=f"run {handle.run_id} not finished"):
        handle.wait(timeout=0.01)  # the task is blocked on a flag nobody has set yet
    assert not handle.done()
    flags[0] = 1
    handle.wait(timeout=60)
    assert handle.done() and handle.state is RunState.COMPLETED
    assert handle.result() == [None]
    handle.wait()  # waiting again on a finished run returns at once


def test_orchestration_receives_args_and_config(pool: Pool) -> None:
    w = pool.w
    got: list[Any] = []
    cfg = CallConfig(deadline_ms=123)
    payload = object()
    w.run(lambda o, a, c: got.append((a, c)), payload, cfg)
    w.run(lambda o, a, c: got.append((a, c)))
    assert got[0] == (payload, cfg)
    assert got[1][0] is None and got[1][1] == CallConfig()


def test_a_run_with_zero_tasks_completes(pool: Pool) -> None:
    handle = pool.w.submit(lambda o, a, c: None)
    handle.wait(timeout=30)
    assert handle.state is RunState.COMPLETED


def test_an_orchestration_exception_propagates_from_run(pool: Pool) -> None:
    w, h = pool.w, pool.h

    class Boom(Exception):
        pass

    boom = Boom("orchestration broke")
    marker = w.alloc((4,), "float64")

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(h["fill"], targs((marker, Tag.OUTPUT), scalars=(1,)))
        raise boom

    with pytest.raises(Boom) as info:
        w.run(orch)
    assert info.value is boom
    w.run(orch_noop(h["noop"]))


def test_a_2000_task_inout_chain_completes_in_order(pool: Pool) -> None:
    w, h = pool.w, pool.h
    counter = w.alloc((1,), "int64")
    n = 2000

    def orch(o: Any, args: Any, config: Any) -> None:
        for i in range(n):
            o.submit_sub(h["chain_step"], targs((counter, Tag.INOUT), scalars=(i,)))

    handle = w.submit(orch)
    handle.wait(timeout=100)
    assert counter[0] == n
    assert handle.run.counts["done"] == n


def test_deadline_fails_the_task_with_a_deadline_message(pool: Pool) -> None:
    w, h = pool.w, pool.h

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(h["sleep_ms"], targs(scalars=(5000,)), CallConfig(deadline_ms=50))

    with pytest.raises(TaskError, match=r"deadline exceeded \(50 ms\)") as info:
        w.run(orch)
    assert info.value.outcome == "TASK_FAILURE"
    assert "deadline" in info.value.remote_text
    w.run(orch_noop(h["noop"]))  # the child survived


# -- registration after init --------------------------------------------------------------------


def test_register_after_init_by_object_by_path_and_by_value(pool: Pool) -> None:
    w = pool.w
    by_object = w.register(tasks.add_one)  # importable: shipped by its path
    by_path = w.register("tests.support.sub_tasks:set_flag")
    offset = 40

    def closure(args: Any) -> None:  # not importable: shipped serialized
        args.tensors[0][:] += offset

    by_value = w.register(closure)
    assert by_path.name == "tests.support.sub_tasks:set_flag"
    xs = [w.alloc((4,), "float64") for _ in range(2)]
    flags = [w.alloc((2,), "int64") for _ in range(2)]

    def orch(o: Any, args: Any, config: Any) -> None:
        # SUB groups of 2 run one member on each child: both children know every callable
        o.submit_sub_group(by_object, [targs((x, Tag.INOUT)) for x in xs])
        o.submit_sub_group(by_value, [targs((x, Tag.INOUT)) for x in xs])
        o.submit_sub_group(by_path, [targs((f, Tag.OUTPUT), scalars=(1,)) for f in flags])

    w.run(orch)
    assert all((x == 41).all() for x in xs)
    assert [f.tolist() for f in flags] == [[0, 1], [0, 1]]


def test_register_twice_returns_the_same_handle_and_unregister_is_refcounted(pool: Pool) -> None:
    w = pool.w
    h1 = w.register("tests.support.sub_tasks:noop")
    h2 = w.register("tests.support.sub_tasks:noop")
    assert h1 == h2
    w.unregister(h1)
    w.run(lambda o, a, c: o.submit_sub(h2))  # one reference left
    w.unregister(h2)
    with pytest.raises(ValueError, match="is not registered"):
        w.run(lambda o, a, c: o.submit_sub(h2))


def test_unregister_then_submitting_it_fails_clearly(pool: Pool) -> None:
    w, h = pool.w, pool.h
    w.unregister(h["add_one"])
    with pytest.raises(
        ValueError,
        match=r"cannot submit_sub: callable tests\.support\.sub_tasks:add_one \(sha256:[0-9a-f]{64}\) is not registered",
    ):
        w.run(lambda o, a, c: o.submit_sub(h["add_one"]))
    with pytest.raises(TypeError, match="expected a CallableHandle"):
        w.unregister("tests.support.sub_tasks:add_one")  # type: ignore[arg-type]
    w.run(orch_noop(h["noop"]))  # the worker still works
    again = w.register(tasks.add_one)  # and the callable can come back
    x = w.alloc((2,), "float64")
    w.run(lambda o, a, c: o.submit_sub(again, targs((x, Tag.INOUT))))
    assert (x == 1).all()


# -- argument validation ------------------------------------------------------------------------


def test_argument_validation(pool: Pool) -> None:
    w, h = pool.w, pool.h
    with pytest.raises(ValueError, match="chip kernel, but this worker has no chips"):
        w.register("tests.support.sub_tasks:kernel", kind="chip")

    with pytest.raises(TypeError, match=r"Worker\.register"):
        w.run(lambda o, a, c: o.submit_sub(17))
    with pytest.raises(TypeError, match="worker"):
        w.run(lambda o, a, c: o.submit_sub(h["noop"], TaskArgs(), worker=0))
    with pytest.raises(TypeError, match="CallConfig"):
        w.run(lambda o, a, c: o.submit_sub(h["noop"], TaskArgs(), 5))
    with pytest.raises(TypeError, match="not callable"):
        w.submit(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kind="):
        w.register(tasks.noop, kind="gpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="import path"):
        w.register(tasks.kernel, kind="chip")
    with pytest.raises(ValueError, match="not on the shared heap"):
        w.run(
            lambda o, a, c: o.submit_sub(h["noop"], TaskArgs().add_tensor(np.zeros(3), Tag.INPUT))
        )
    w.run(orch_noop(h["noop"], 3))  # none of that hurt the worker


def test_chip_argument_validation() -> None:
    w = Worker(num_sub_workers=1, num_chips=1, startup_timeout=30)
    k = w.register("tests.support.sub_tasks:kernel", kind="chip")
    with w:
        with pytest.raises(ValueError, match="not as a SUB callable"):
            w.run(lambda o, a, c: o.submit_sub(k))
        with pytest.raises(ValueError, match=r"worker=99 is not a registered NEXT_LEVEL worker"):
            w.run(lambda o, a, c: o.submit_next_level(k, TaskArgs(), worker=99))
        with pytest.raises(ValueError, match="not distinct"):
            w.run(
                lambda o, a, c: o.submit_next_level_group(
                    k, [TaskArgs(), TaskArgs()], workers=[0, 0]
                )
            )
        with pytest.raises(ValueError, match="2 workers for 1 args"):
            w.run(lambda o, a, c: o.submit_next_level_group(k, [TaskArgs()], workers=[0, 1]))


def test_worker_constructor_validation() -> None:
    with pytest.raises(ValueError, match="level=5"):
        Worker(level=5, num_sub_workers=1)
    with pytest.raises(ValueError, match="num_sub_workers=-1"):
        Worker(num_sub_workers=-1)
    with pytest.raises(ValueError, match="num_chips=2 at level 4"):
        Worker(level=4, num_chips=2)
    # An empty L3 and an L4 without SUB workers of its own are valid (level 4 defaults to 0).
    assert Worker(num_sub_workers=0).num_sub_workers == 0
    assert Worker(level=4).num_sub_workers == 0


def test_an_empty_worker_starts_runs_an_empty_orchestration_and_closes() -> None:
    w = Worker(num_sub_workers=0, heap_bytes=1 << 20)
    w.init()
    w.run(lambda o, a, c: None)
    assert w.list_workers() == []
    w.close()


# -- lifecycle -------------------------------------------------------------------------------------


def test_using_a_worker_before_init_or_after_close_raises() -> None:
    w = Worker(num_sub_workers=1)
    h = w.register(tasks.noop)
    with pytest.raises(WorkerStateError, match=r"NEW \(call init\(\) first\)"):
        w.run(orch_noop(h))
    w.init()
    with pytest.raises(WorkerStateError, match="READY"):
        w.init()
    w.run(orch_noop(h))
    w.close()
    assert w.state is WorkerState.CLOSED
    w.close()  # a second close is a no-op
    assert w.state is WorkerState.CLOSED
    for call in (
        lambda: w.run(orch_noop(h)),
        lambda: w.submit(orch_noop(h)),
        lambda: w.register(tasks.fill),
        lambda: w.unregister(h),
        lambda: w.alloc((4,), "float32"),
        lambda: w.ping(0),
    ):
        with pytest.raises(WorkerClosedError, match="CLOSED"):
            call()


def test_close_of_a_never_started_worker_releases_it() -> None:
    w = Worker(num_sub_workers=1)
    w.alloc((4,), "float32")
    w.close()
    w.close()
    assert w.state is WorkerState.CLOSED
    with pytest.raises(WorkerClosedError):
        w.alloc((4,), "float32")


def test_context_manager_starts_and_closes() -> None:
    w = Worker(num_sub_workers=2)
    h = w.register(tasks.record_pid)
    with w as started:
        assert started is w and w.state is WorkerState.READY
        pids = w.alloc((2,), "int64")
        w.run(
            lambda o, a, c: [
                o.submit_sub(h, targs((pids, Tag.NO_DEP), scalars=(i,))) for i in range(2)
            ]
        )
        assert all(pids != 0)
    assert w.state is WorkerState.CLOSED
    # results stay readable after close: the mapping lives as long as the arrays do
    assert len(set(pids.tolist())) >= 1 and all(pids != 0)


def test_list_workers_and_ping_name_the_children(pool: Pool) -> None:
    w = pool.w
    infos = w.list_workers()
    assert [i["worker_id"] for i in infos] == [0, 1]
    assert all(i["kind"] == "sub" and i["alive"] and i["poisoned"] is None for i in infos)
    assert [w.ping(i) for i in range(2)] == [i["pid"] for i in infos]
    w.run(orch_noop(pool.h["noop"], 4))
    assert sum(i["tasks_completed"] for i in w.list_workers()) == 4


# -- leaks -------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(60)
def test_a_thousand_runs_leak_no_memory_and_no_fds(pool: Pool) -> None:
    w, h = pool.w, pool.h
    x = w.alloc((64,), "float64")
    y = w.alloc((64,), "float64")

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(h["fill"], targs((x, Tag.OUTPUT), scalars=(args,)))
        o.submit_sub(h["consume"], targs((x, Tag.INPUT), (y, Tag.OUTPUT), scalars=(1,)))

    def batch(start: int, n: int) -> None:
        for i in range(start, start + n):
            w.run(orch, i)
        assert y[0] == start + n  # the last run's consumer saw the last run's producer

    batch(0, 200)  # warm-up
    gc.collect()
    rss0, fds0 = _rss_bytes(), _fds()
    free0 = w.heap.free_bytes()
    batch(200, 1000)
    gc.collect()
    rss1, fds1 = _rss_bytes(), _fds()
    assert fds1 == fds0
    assert rss1 - rss0 < 8 << 20, f"RSS grew by {(rss1 - rss0) >> 10} KiB over 1000 runs"
    assert w.heap.free_bytes() == free0
    sched = w.scheduler
    assert sched is not None
    assert sched.admission.runs() == [] and sched.queued() == 0
    assert not sched.subs and not sched.groups


@pytest.mark.timeout(60)
def test_run_listeners_hear_failed_slots_and_the_end_only() -> None:
    """``Run.listeners`` (the daemon's run record listens for failures) are called for a
    failed or skipped slot and once when the run ends, never for a slot that succeeded:
    a successful task keeps the completion's inline path."""
    heard: list[tuple[str, int | None, str | None]] = []

    def listen(run: Any, event: str, slot: Any) -> None:
        heard.append((event, None if slot is None else slot.index, slot and slot.state.name))

    with Worker(num_sub_workers=2) as w:
        ok, bad = w.register(tasks.noop), w.register(tasks.fail)
        consume = w.register(tasks.consume)
        who = w.alloc((1,), "int64")
        gate = w.alloc((1,), "int64")
        x = w.alloc((4,), "float64")
        y = w.alloc((4,), "float64")

        def orch(o: Any, args: Any, config: Any) -> None:
            o.run.listeners.append(listen)
            for _ in range(20):
                o.submit_sub(ok, targs())
            # It fails once the gate opens, after every submit (a submit into a run that
            # failed already would raise instead).
            o.submit_sub(bad, targs((who, Tag.OUTPUT), (gate, Tag.NO_DEP), (x, Tag.OUTPUT)))
            o.submit_sub(consume, targs((x, Tag.INPUT), (y, Tag.OUTPUT), scalars=(1,)))
            gate[0] = 1

        with pytest.raises(TaskError):
            w.run(orch)
    assert heard == [("task", 20, "FAILED"), ("task", 21, "FAILED"), ("run", None, None)]
