"""Runs under faults and misuse: buffers held by queued runs, cancel releasing admission,
overlapping written arguments, bounds on deadlines and shapes, finished runs letting go
of their orchestration, run-owned buffers and scopes, and ``inside_orchestration``.

Order and concurrency are proven by heap words the tasks set, never by timing; a task
that waits does so on a heap flag with a deadline that fails it.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from simpler_daemon import CallableHandle, CallConfig, RunCancelled, RunState, Tag, Worker
from simpler_daemon.args import MAX_DEADLINE_MS
from simpler_daemon.heap import Heap
from simpler_daemon.testing import poll_for
from tests.support.sub_tasks import targs
from tests.support.worker_pool import Pool

pytestmark = pytest.mark.timeout(120)


def address(a: np.ndarray[Any, Any]) -> int:
    return int(a.__array_interface__["data"][0])


def overlaps(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    return address(a) < address(b) + b.nbytes and address(b) < address(a) + a.nbytes


def blocker(pool: Pool) -> tuple[Any, np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """An orchestration whose one SUB task runs until ``flags[0]`` is set; ``started[0]``
    holds its pid once it runs."""
    flags = pool.w.alloc((1,), "int64")
    started = pool.w.alloc((1,), "int64")
    h = pool.h["wait_flag"]

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(h, targs((flags, Tag.NO_DEP), (started, Tag.NO_DEP), scalars=(0, 0, 60_000)))

    return orch, flags, started


# -- a queued run holds the buffers its args reference ---------------------------------------------


def test_free_of_a_buffer_a_queued_run_holds_waits_for_the_run(pool: Pool) -> None:
    w, h = pool.w, pool.h
    slow, flags, _ = blocker(pool)
    a = w.alloc((64,), "float64")

    def writes_args(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(h["fill"], args)

    head = w.submit(slow)
    successor = w.submit(lambda o, a_, c: o.submit_sub(h["noop"]))
    queued = w.submit(writes_args, targs((a, Tag.OUTPUT), scalars=(7,)))
    try:
        assert not queued.run.admitted  # waits in admission behind two leased runs
        w.free(a)
        b = w.alloc((64,), "float64")
        assert not overlaps(a, b), "a buffer held by a queued run was handed to a new alloc"
    finally:
        flags[0] = 1
    head.wait(timeout=60)
    successor.wait(timeout=60)
    queued.wait(timeout=60)
    assert (a == 7).all()  # the queued run wrote the memory it was given
    assert (b == 0).all()  # and nothing else
    c = w.alloc((64,), "float64")
    assert overlaps(a, c), "the run ended, but the freed buffer's memory was not reused"


def test_a_cancelled_queued_run_lets_go_of_its_buffers(pool: Pool) -> None:
    w, h = pool.w, pool.h
    slow, flags, _ = blocker(pool)
    a = w.alloc((64,), "float64")
    head = w.submit(slow)
    w.submit(lambda o, a_, c: o.submit_sub(h["noop"]))
    queued = w.submit(lambda o, args, c: o.submit_sub(h["fill"], args), targs((a, Tag.OUTPUT)))
    w.free(a)
    queued.cancel()
    assert queued.done()
    b = w.alloc((64,), "float64")
    assert overlaps(a, b)  # the cancelled run never runs: its buffers are free at once
    flags[0] = 1
    head.wait(timeout=60)


# -- cancel releases admission at once -------------------------------------------------------------


def test_cancelling_a_run_with_a_running_task_lets_later_runs_proceed(pool: Pool) -> None:
    w, h = pool.w, pool.h
    slow, flags, started = blocker(pool)
    x = w.alloc((8,), "float64")
    y = w.alloc((8,), "float64")
    stuck = w.submit(slow)
    try:
        poll_for(lambda: started[0] != 0, timeout=30, message="the blocking task never started")
        queued = w.submit(
            lambda o, a, c: o.submit_sub(h["fill"], targs((x, Tag.OUTPUT), scalars=(3,)))
        )
        stuck.cancel()
        assert stuck.run.cancelled and not stuck.done()  # its task still runs
        later = w.submit(
            lambda o, a, c: o.submit_sub(h["fill"], targs((y, Tag.OUTPUT), scalars=(4,)))
        )
        queued.wait(timeout=30)
        later.wait(timeout=30)
        assert (x == 3).all() and (y == 4).all()
        assert not stuck.done()  # the cancelled task keeps its own worker until it ends
    finally:
        flags[0] = 1
    with pytest.raises(RunCancelled):
        stuck.wait(timeout=60)
    assert stuck.state is RunState.FAILED and stuck.run.counts["done"] == 1
    assert w.scheduler is not None and w.scheduler.admission.runs() == []
    w.run(lambda o, a, c: o.submit_sub(h["noop"]))


def test_a_failing_orchestration_with_a_running_task_releases_admission(pool: Pool) -> None:
    w, h = pool.w, pool.h
    flags = w.alloc((1,), "int64")
    started = w.alloc((1,), "int64")
    x = w.alloc((8,), "float64")

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(
            h["wait_flag"],
            targs((flags, Tag.NO_DEP), (started, Tag.NO_DEP), scalars=(0, 0, 60_000)),
        )
        raise KeyError("orchestration bug")

    failed = w.submit(orch)
    try:
        nxt = w.submit(
            lambda o, a, c: o.submit_sub(h["fill"], targs((x, Tag.OUTPUT), scalars=(5,)))
        )
        nxt.wait(timeout=30)
        assert (x == 5).all() and not failed.done()
    finally:
        flags[0] = 1
    with pytest.raises(KeyError, match="orchestration bug"):
        failed.wait(timeout=60)


# -- overlapping written arguments -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("tags", "views"),
    [
        ((Tag.OUTPUT, Tag.OUTPUT), (slice(0, 8), slice(4, 12))),
        ((Tag.OUTPUT, Tag.INOUT), (slice(0, 16), slice(0, 16))),
        ((Tag.INOUT, Tag.OUTPUT_EXISTING), (slice(2, 3), slice(0, 16))),
    ],
)
def test_two_written_arguments_that_overlap_are_refused(
    pool: Pool, tags: tuple[Tag, Tag], views: tuple[slice, slice]
) -> None:
    w, h = pool.w, pool.h
    buf = w.alloc((16,), "float64")

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(h["add_one"], targs((buf[views[0]], tags[0]), (buf[views[1]], tags[1])))

    with pytest.raises(
        ValueError,
        match=r"cannot submit_sub: task 0 \(tests\.support\.sub_tasks:add_one\) writes overlapping",
    ) as info:
        w.run(orch)
    assert "args[0].tensors[0]" in str(info.value) and "args[0].tensors[1]" in str(info.value)
    assert (buf == 0).all()


def test_overlapping_written_members_of_a_group_are_accepted(pool: Pool) -> None:
    """One group is one writer, as in the origin: its members may write memory that
    overlaps (each usually writes its part of one shared output)."""
    w, h = pool.w, pool.h
    buf = w.alloc((16,), "float64")

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(h["noop"])
        o.submit_sub_group(h["noop"], [targs((buf[:10], Tag.INOUT)), targs((buf[6:], Tag.OUTPUT))])
        o.submit_sub(h["add_one"], targs((buf, Tag.INOUT)))

    w.run(orch)
    assert (buf == 1).all()


def test_disjoint_or_read_only_views_of_one_buffer_are_accepted(pool: Pool) -> None:
    w, h = pool.w, pool.h
    buf = w.alloc((16,), "float64")

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(h["add_one"], targs((buf[:8], Tag.OUTPUT), (buf[8:], Tag.INOUT)))
        o.submit_sub(h["add_one"], targs((buf[::2], Tag.INOUT), (buf[1::2], Tag.INOUT)))
        o.submit_sub(h["add_one"], targs((buf, Tag.INPUT), (buf[:4], Tag.INOUT)))

    w.run(orch)


# -- deadline_ms and buffer shapes -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "exc"),
    [
        (MAX_DEADLINE_MS + 1, ValueError),
        (10**13, ValueError),
        (-1, ValueError),
        (1.5, TypeError),
        (float("nan"), TypeError),
        (True, TypeError),
        ("100", TypeError),
    ],
)
def test_deadline_ms_out_of_bounds_is_refused_naming_the_field(value: Any, exc: type) -> None:
    with pytest.raises(exc, match="deadline_ms"):
        CallConfig(deadline_ms=value)


def test_deadline_ms_up_to_one_week_is_accepted() -> None:
    assert MAX_DEADLINE_MS == 7 * 24 * 3600 * 1000
    assert CallConfig(deadline_ms=MAX_DEADLINE_MS).deadline_ms == MAX_DEADLINE_MS
    assert CallConfig(deadline_ms=np.int64(200)).deadline_ms == 200


@pytest.mark.parametrize(
    ("shape", "exc", "match"),
    [
        ((0, 2**64 - 1), ValueError, "dimension 1 is 18446744073709551615"),
        ((0, 2**40), ValueError, "is empty but its other dimensions span"),
        ((2**62, 8), MemoryError, "cannot allocate"),
        ((-3,), ValueError, "dimension 0 is -3"),
        ((2.5,), TypeError, "must be an int or a sequence of ints"),
    ],
)
def test_a_buffer_shape_that_overflows_or_exceeds_the_heap_is_refused(
    shape: Any, exc: type, match: str
) -> None:
    heap = Heap(1 << 16)
    try:
        with pytest.raises(exc, match=match):
            heap.alloc(shape, "float32")
        assert heap.free_bytes() == heap.size
    finally:
        heap.close()


# -- a finished run lets go of its orchestration and args ------------------------------------------


class Orch:
    """A weak-referenceable orchestration function."""

    def __init__(self, h: CallableHandle) -> None:
        self.h = h

    def __call__(self, o: Any, args: Any, config: Any) -> None:
        o.submit_sub(self.h)


class Payload:
    """Weak-referenceable args."""


def test_a_finished_run_does_not_keep_its_orchestration_and_args(pool: Pool) -> None:
    w, h = pool.w, pool.h
    orch, args = Orch(h["noop"]), Payload()
    refs = [weakref.ref(orch), weakref.ref(args)]
    handle = w.submit(orch, args)
    handle.wait(timeout=60)
    del orch, args
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert handle.state is RunState.COMPLETED


def test_a_cancelled_queued_run_does_not_keep_its_orchestration_and_args(pool: Pool) -> None:
    w, h = pool.w, pool.h
    slow, flags, _ = blocker(pool)
    head = w.submit(slow)
    w.submit(Orch(h["noop"]))
    orch, args = Orch(h["noop"]), Payload()
    refs = [weakref.ref(orch), weakref.ref(args)]
    queued = w.submit(orch, args)
    queued.cancel()
    del orch, args
    gc.collect()
    assert [r() for r in refs] == [None, None] and queued.done()
    flags[0] = 1
    head.wait(timeout=60)


# -- run-owned buffers and scopes ------------------------------------------------------------------


def test_a_scope_frees_its_buffers_once_their_readers_are_done(pool: Pool) -> None:
    w, h = pool.w, pool.h
    flags = w.alloc((1,), "int64")
    started = w.alloc((1,), "int64")
    out = w.alloc((32,), "float64")
    seen: list[np.ndarray[Any, Any]] = []
    heap = w.heap
    free_before = heap.free_bytes()

    def orch(o: Any, args: Any, config: Any) -> None:
        with o.scope():
            tmp = o.alloc((32,), "float64")
            seen.append(tmp)
            # The reader waits for the gate: the scope ends while it still needs tmp.
            o.submit_sub(
                h["wait_flag"],
                targs(
                    (flags, Tag.NO_DEP),
                    (started, Tag.NO_DEP),
                    (tmp, Tag.INPUT),
                    scalars=(0, 0, 60_000),
                ),
            )
            o.submit_sub(h["add_one"], targs((tmp, Tag.INOUT)))
            o.submit_sub(h["consume"], targs((tmp, Tag.INPUT), (out, Tag.OUTPUT), scalars=(5,)))
        with pytest.raises(ValueError, match="freed"):
            o.submit_sub(h["add_one"], targs((tmp, Tag.INOUT)))  # its scope ended

    handle = w.submit(orch, None)
    try:
        poll_for(lambda: started[0] != 0, timeout=30, message="the reader never started")
        other = w.alloc((32,), "float64")
        assert not overlaps(seen[0], other), "a scope buffer was reused under its readers"
    finally:
        flags[0] = 1
    handle.wait(timeout=60)
    assert (out == 6).all()  # tmp (0) + 1 by its writer, + 5 by its last reader
    w.free(other)
    assert heap.free_bytes() == free_before  # the scope's buffer went back to the heap


def test_buffers_allocated_outside_a_scope_belong_to_the_run(pool: Pool) -> None:
    w, h = pool.w, pool.h
    out = w.alloc((8,), "float64")
    heap = w.heap
    free_before = heap.free_bytes()
    live: list[int] = []

    def orch(o: Any, args: Any, config: Any) -> None:
        a = o.alloc((8,), "float64")
        o.scope_begin()
        b = o.alloc((8,), "float64")
        o.submit_sub(h["fill"], targs((a, Tag.OUTPUT), scalars=(2,)))
        o.submit_sub(h["consume"], targs((a, Tag.INPUT), (b, Tag.OUTPUT), scalars=(1,)))
        o.scope_end()
        o.submit_sub(h["consume"], targs((a, Tag.INPUT), (out, Tag.OUTPUT), scalars=(5,)))
        live.append(len(heap.buffers()))
        # A scope left open is closed by the run's end.
        o.scope_begin()
        o.alloc((1024,), "uint8")

    before = len(heap.buffers())
    w.run(orch)
    assert (out == 7).all()
    assert live == [before + 1]  # a (the run's) is live, b (the scope's) was freed
    assert heap.free_bytes() == free_before and len(heap.buffers()) == before


def test_scope_misuse_is_refused(pool: Pool) -> None:
    w = pool.w
    kept: list[Any] = []

    def unbalanced(o: Any, args: Any, config: Any) -> None:
        o.scope_end()

    with pytest.raises(RuntimeError, match=r"cannot end a scope in run \d+: no scope is open"):
        w.run(unbalanced)
    w.run(lambda o, a, c: kept.append(o))
    with pytest.raises(Exception, match=r"cannot alloc in run \d+: its orchestration returned"):
        kept[0].alloc((4,), "float32")


# -- inside_orchestration (the run side of close() inside an orchestration) ------------------------


def test_inside_orchestration_is_true_only_on_the_orchestration_thread(pool: Pool) -> None:
    w = pool.w
    runs = w._runs
    seen: dict[str, bool] = {}

    def orch(o: Any, args: Any, config: Any) -> None:
        seen["inside"] = runs.inside_orchestration()
        other: list[bool] = []
        t = threading.Thread(target=lambda: other.append(runs.inside_orchestration()))
        t.start()
        t.join()
        seen["other thread"] = other[0]

    assert not runs.inside_orchestration()
    w.run(orch)
    assert seen == {"inside": True, "other thread": False}
    assert not runs.inside_orchestration()


@pytest.mark.asyncio
async def test_inside_orchestration_in_an_async_orchestration() -> None:
    w = Worker(num_sub_workers=1)
    w.init()
    try:
        runs = w._runs
        seen: list[bool] = []

        async def orch(o: Any, args: Any, config: Any) -> None:
            await asyncio.sleep(0)
            seen.append(runs.inside_orchestration())

        async def bystander() -> None:
            seen.append(runs.inside_orchestration())

        await asyncio.gather(w.run_async(orch), bystander())
        assert sorted(seen) == [False, True]
    finally:
        await w.close_async()


# -- cancel on two-frame lanes: a detached run's task keeps its frame ------------------------------


@pytest.fixture
def harness() -> Iterator[Any]:
    from tests.support.scheduler_rig import Harness

    made: list[Any] = []

    def factory(**kw: Any) -> Any:
        made.append(Harness(**kw))
        return made[-1]

    yield factory
    try:
        for h in made:
            h.validate()
    finally:
        for h in made:
            h.close()


def test_a_cancelled_head_leaves_admission_but_keeps_its_lane(harness: Any) -> None:
    h = harness(next_level=(0, 1), frames=2)
    o1 = h.run()
    h.nl(o1, "a", 0)
    h.done_building(o1)
    o2 = h.run()
    h.nl(o2, "b", 1)
    h.done_building(o2)
    h.play([([], {"nl0": ["a"], "nl1": ["b+staged"]})])
    h.sched.cancel(o1.run)
    assert o1.run.detached and not o1.run.terminal
    o3 = h.run()  # takes the cancelled run's lease (and so its task frame)
    h.nl(o3, "c", 0)
    h.done_building(o3)
    # b runs at once; c is not staged on worker 0, whose frame a still occupies.
    h.play([([], {})])
    assert h.sched.admission.head is o2.run and h.sched.manager.next_level[1].active is not None
    h.play([(["a"], {"nl0": ["c+staged"]}), (["b+staged"], {}), (["c+staged"], {})])
    assert o1.run.state is RunState.FAILED and isinstance(o1.run.error, RunCancelled)
    assert o2.run.state is RunState.COMPLETED and o3.run.state is RunState.COMPLETED


def test_a_cancelled_successors_staged_task_runs_when_its_lane_frees(harness: Any) -> None:
    h = harness(next_level=(0,), frames=2)
    o1 = h.run()
    h.nl(o1, "a", 0)
    h.done_building(o1)
    o2 = h.run()
    h.nl(o2, "b", 0)
    h.nl(o2, "b2", 0)
    h.done_building(o2)
    h.play([([], {"nl0": ["a", "b+staged"]})])
    h.sched.cancel(o2.run)  # b is published: it cannot be withdrawn, b2 never runs
    assert o2.run.detached
    o3 = h.run()
    h.nl(o3, "c", 0)
    h.done_building(o3)
    h.play([(["a"], {}), (["b+staged"], {"nl0": ["c"]}), (["c"], {})])
    assert o2.run.state is RunState.FAILED and o2.run.counts["done"] == 1
    assert o3.run.state is RunState.COMPLETED
