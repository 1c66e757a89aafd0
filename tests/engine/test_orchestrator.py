"""Pure bookkeeping: TensorMap, dependency inference on slots, the Orchestrator facade's
validation, Run errors and whole-run Admission. No loop, no children."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from simpler_daemon.args import Tag, TaskArgs
from simpler_daemon.endpoints.base import Outcome
from simpler_daemon.engine.orchestrator import (
    Admission,
    FailureInfo,
    Orchestrator,
    Run,
    RunState,
    SlotState,
    TaskKind,
    TaskSlot,
    TensorMap,
)
from simpler_daemon.errors import RunCancelled, TaskError, WorkerClosedError
from simpler_daemon.heap import Heap
from simpler_daemon.scheduler.tensormap import Region
from tests.support.submit_sink import CHIP, SUB, Sink


@pytest.fixture
def heap() -> Iterator[Heap]:
    h = Heap(1 << 20)
    yield h
    h.close()


@pytest.fixture
def sink(heap: Heap) -> Sink:
    return Sink(heap)


def orch(sink: Sink, run: Run | None = None) -> Orchestrator:
    return Orchestrator(sink, run or Run())


def args(*tensors: tuple[Any, Tag]) -> TaskArgs:
    a = TaskArgs()
    for t, tag in tensors:
        a.add_tensor(t, tag)
    return a


def slot_of(o: Orchestrator, index: int) -> TaskSlot:
    return o.run.slots[index]


def deps_of(o: Orchestrator, index: int) -> set[int]:
    """Indices of the producers task ``index`` waits on."""
    me = slot_of(o, index)
    return {s.index for s in o.run.slots if me in s.consumers}


# -- TensorMap ---------------------------------------------------------------------------------


class _S:
    """A stand-in slot: TensorMap only stores and returns it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def R(lo: int, hi: int) -> Region:
    """The region of a dense 1-D view of bytes [lo, hi)."""
    return Region(lo, hi, dense=True)


def names(slots: list[Any]) -> set[str]:
    return {s.name for s in slots}


def test_tensor_map_overlapping_ranges_conflict_disjoint_ones_do_not() -> None:
    tm = TensorMap()
    a = _S("a")
    tm.write(1, R(0, 64), a)  # type: ignore[arg-type]
    assert names(tm.producers(1, R(0, 64))) == {"a"}
    assert names(tm.producers(1, R(63, 64))) == {"a"}  # one shared byte is an overlap
    assert names(tm.producers(1, R(32, 96))) == {"a"}
    assert tm.producers(1, R(64, 128)) == []  # touching at the boundary is disjoint
    assert tm.producers(2, R(0, 64)) == []  # another buffer never conflicts


def test_tensor_map_partial_overwrite_splits_the_older_writer() -> None:
    tm = TensorMap()
    a, b = _S("a"), _S("b")
    tm.write(1, R(0, 100), a)  # type: ignore[arg-type]
    tm.write(1, R(40, 60), b)  # type: ignore[arg-type]
    assert names(tm.producers(1, R(0, 40))) == {"a"}
    assert names(tm.producers(1, R(40, 60))) == {"b"}
    assert names(tm.producers(1, R(60, 100))) == {"a"}
    assert names(tm.producers(1, R(30, 70))) == {"a", "b"}


def test_tensor_map_full_overwrite_replaces_the_writer_and_empty_ranges_are_ignored() -> None:
    tm = TensorMap()
    a, b, c = _S("a"), _S("b"), _S("c")
    tm.write(1, R(0, 100), a)  # type: ignore[arg-type]
    tm.write(1, R(0, 100), b)  # type: ignore[arg-type]
    assert names(tm.producers(1, R(0, 100))) == {"b"}
    tm.write(1, R(50, 50), c)  # type: ignore[arg-type]
    assert names(tm.producers(1, R(0, 100))) == {"b"}
    tm.write(1, R(0, 200), c)  # type: ignore[arg-type]  (covers and extends)
    assert names(tm.producers(1, R(10, 20))) == {"c"}


# -- dependencies on slots ------------------------------------------------------------------------


def test_input_after_output_on_the_same_buffer_depends_on_the_writer(
    sink: Sink, heap: Heap
) -> None:
    x = heap.alloc((16,), "float64")
    o = orch(sink)
    o.submit_sub(SUB, args((x, Tag.OUTPUT)))
    o.submit_sub(SUB, args((x, Tag.INPUT)))
    assert slot_of(o, 0).deps == 0 and slot_of(o, 0).state is SlotState.READY
    assert slot_of(o, 1).deps == 1 and slot_of(o, 1).state is SlotState.PENDING
    assert deps_of(o, 1) == {0}


@pytest.mark.parametrize(
    ("write", "read", "dependent"),
    [
        (slice(0, 8), slice(8, 16), False),  # disjoint halves
        (slice(8, 16), slice(0, 8), False),
        (slice(0, 8), slice(4, 12), True),  # overlapping views
        (slice(4, 12), slice(0, 5), True),
        (slice(0, 16), slice(15, 16), True),
        (slice(3, 4), slice(3, 4), True),
        (slice(0, 16, 2), slice(1, 16, 2), True),  # interleaved: byte ranges overlap (conservative)
    ],
)
def test_views_conflict_by_byte_range(
    sink: Sink, heap: Heap, write: slice, read: slice, dependent: bool
) -> None:
    x = heap.alloc((16,), "float64")
    o = orch(sink)
    o.submit_sub(SUB, args((x[write], Tag.OUTPUT)))
    o.submit_sub(SUB, args((x[read], Tag.INPUT)))
    assert (slot_of(o, 1).deps == 1) is dependent
    assert deps_of(o, 1) == ({0} if dependent else set())


def test_disjoint_rows_of_a_2d_buffer_do_not_conflict(sink: Sink, heap: Heap) -> None:
    y = heap.alloc((4, 8), "float32")
    o = orch(sink)
    o.submit_sub(SUB, args((y[:2], Tag.OUTPUT)))
    o.submit_sub(SUB, args((y[2:], Tag.OUTPUT)))
    o.submit_sub(SUB, args((y[2:], Tag.INPUT)))
    o.submit_sub(SUB, args((y[1:3], Tag.INPUT)))
    assert deps_of(o, 2) == {1}
    assert deps_of(o, 3) == {0, 1}


def test_disjoint_column_blocks_do_not_conflict_and_cross_row_blocks(
    sink: Sink, heap: Heap
) -> None:
    """Per axis for boxes of one row-major layout (the origin's view-aware map)."""
    y = heap.alloc((4, 8), "float32")
    o = orch(sink)
    o.submit_sub(SUB, args((y[:, :4], Tag.OUTPUT)))  # 0
    o.submit_sub(SUB, args((y[:, 4:], Tag.OUTPUT)))  # 1
    o.submit_sub(SUB, args((y[:, 4:], Tag.INPUT)))  # 2: the right block only
    o.submit_sub(SUB, args((y[1:2, :], Tag.INPUT)))  # 3: a row crosses both blocks
    o.submit_sub(SUB, args((y[:, ::2], Tag.INPUT)))  # 4: stepped: by byte range
    assert deps_of(o, 2) == {1}
    assert deps_of(o, 3) == {0, 1}
    assert deps_of(o, 4) == {0, 1}


def test_overlapping_members_of_a_group_write_as_one_slot(sink: Sink, heap: Heap) -> None:
    """One group is one writer: its members may overlap (the origin accepts it); within
    one task's own arguments the refusal stays."""
    x = heap.alloc((16,), "float64")
    o = orch(sink)
    g = o.submit_sub_group(SUB, [args((x[:10], Tag.OUTPUT)), args((x[6:], Tag.OUTPUT))])
    o.submit_sub(SUB, args((x[8:], Tag.INPUT)))
    assert deps_of(o, 1) == {g}
    with pytest.raises(ValueError, match="writes overlapping memory"):
        o.submit_sub(SUB, args((x[:10], Tag.OUTPUT), (x[6:], Tag.OUTPUT)))


def test_different_buffers_never_conflict(sink: Sink, heap: Heap) -> None:
    x = heap.alloc((16,), "float64")
    y = heap.alloc((16,), "float64")
    o = orch(sink)
    o.submit_sub(SUB, args((x, Tag.OUTPUT)))
    o.submit_sub(SUB, args((y, Tag.INPUT)))
    assert slot_of(o, 1).deps == 0


def test_no_dep_neither_depends_nor_becomes_the_writer(sink: Sink, heap: Heap) -> None:
    x = heap.alloc((16,), "float64")
    o = orch(sink)
    o.submit_sub(SUB, args((x, Tag.OUTPUT)))  # 0
    o.submit_sub(SUB, args((x, Tag.NO_DEP)))  # 1: no dep on 0, not a writer
    o.submit_sub(SUB, args((x, Tag.INPUT)))  # 2: depends on 0 only
    assert slot_of(o, 1).deps == 0
    assert deps_of(o, 2) == {0}


def test_inout_depends_and_becomes_the_writer(sink: Sink, heap: Heap) -> None:
    x = heap.alloc((16,), "float64")
    o = orch(sink)
    o.submit_sub(SUB, args((x, Tag.OUTPUT)))  # 0
    o.submit_sub(SUB, args((x, Tag.INOUT)))  # 1 <- 0
    o.submit_sub(SUB, args((x, Tag.INPUT)))  # 2 <- 1 only
    assert deps_of(o, 1) == {0}
    assert deps_of(o, 2) == {1}


def test_output_and_output_existing_become_writers_without_depending(
    sink: Sink, heap: Heap
) -> None:
    x = heap.alloc((16,), "float64")
    o = orch(sink)
    o.submit_sub(SUB, args((x, Tag.OUTPUT)))  # 0
    o.submit_sub(SUB, args((x, Tag.OUTPUT_EXISTING)))  # 1: no dep
    o.submit_sub(SUB, args((x, Tag.INPUT)))  # 2 <- 1
    assert slot_of(o, 1).deps == 0
    assert deps_of(o, 2) == {1}


def test_a_reader_of_two_disjoint_writers_waits_for_both_and_counts_each_once(
    sink: Sink, heap: Heap
) -> None:
    x = heap.alloc((16,), "float64")
    o = orch(sink)
    o.submit_sub(SUB, args((x[:8], Tag.OUTPUT)))  # 0
    o.submit_sub(SUB, args((x[8:], Tag.OUTPUT)))  # 1
    o.submit_sub(SUB, args((x, Tag.INPUT), (x[:4], Tag.INPUT), (x[4:8], Tag.INPUT)))  # 2
    assert slot_of(o, 2).deps == 2
    assert deps_of(o, 2) == {0, 1}
    assert slot_of(o, 0).consumers.count(slot_of(o, 2)) == 1


def test_a_task_reading_and_writing_its_own_range_does_not_depend_on_itself(
    sink: Sink, heap: Heap
) -> None:
    x = heap.alloc((16,), "float64")
    o = orch(sink)
    o.submit_sub(SUB, args((x, Tag.OUTPUT), (x, Tag.INPUT)))
    assert slot_of(o, 0).deps == 0
    assert not slot_of(o, 0).consumers


def test_dependencies_never_cross_runs(sink: Sink, heap: Heap) -> None:
    x = heap.alloc((16,), "float64")
    o1, o2 = orch(sink), orch(sink)
    o1.submit_sub(SUB, args((x, Tag.OUTPUT)))
    o2.submit_sub(SUB, args((x, Tag.INPUT)))
    assert slot_of(o2, 0).deps == 0
    assert not slot_of(o1, 0).consumers


def test_a_completed_producer_adds_no_dependency(sink: Sink, heap: Heap) -> None:
    x = heap.alloc((16,), "float64")
    o = orch(sink)
    o.submit_sub(SUB, args((x, Tag.OUTPUT)))
    slot_of(o, 0).state = SlotState.COMPLETED
    o.submit_sub(SUB, args((x, Tag.INPUT)))
    assert slot_of(o, 1).deps == 0


def test_a_task_whose_producer_already_failed_is_failed_at_submit(sink: Sink, heap: Heap) -> None:
    x = heap.alloc((16,), "float64")
    o = orch(sink)
    o.submit_sub(SUB, args((x, Tag.OUTPUT)))
    slot_of(o, 0).state = SlotState.FAILED
    o.submit_sub(SUB, args((x, Tag.INPUT)))
    assert sink.failed_at_submit == [(slot_of(o, 1), slot_of(o, 0))]
    assert slot_of(o, 1) not in sink.added


def test_group_members_union_their_dependencies_and_write_as_one_slot(
    sink: Sink, heap: Heap
) -> None:
    x = heap.alloc((16,), "float64")
    y = heap.alloc((16,), "float64")
    o = orch(sink)
    o.submit_sub(SUB, args((x, Tag.OUTPUT)))  # 0
    o.submit_sub(SUB, args((y, Tag.OUTPUT)))  # 1
    g = o.submit_sub_group(
        SUB, [args((x, Tag.INPUT), (y[:8], Tag.OUTPUT)), args((y[:8], Tag.INPUT))]
    )
    o.submit_sub(SUB, args((y, Tag.INPUT)))  # 3 <- group (first half) and 1 (second half)
    gs = slot_of(o, g)
    assert gs.kind is TaskKind.SUB_GROUP and gs.group_size == 2 and len(gs.blobs) == 2
    assert deps_of(o, g) == {0, 1}
    assert deps_of(o, 3) == {g, 1}


def test_slots_pin_every_buffer_they_capture(sink: Sink, heap: Heap) -> None:
    x = heap.alloc((16,), "float64")
    y = heap.alloc((4,), "int64")
    o = orch(sink)
    o.submit_sub(SUB, args((x[:4], Tag.INPUT), (x[4:], Tag.OUTPUT), (y, Tag.NO_DEP)))
    s = slot_of(o, 0)
    ids = sorted({heap.describe(x).buffer_id, heap.describe(y).buffer_id})
    assert s.pins == ids
    assert [heap.get(b).pins for b in ids] == [1, 1]


def test_slot_records_kind_targets_index_and_run(sink: Sink, heap: Heap) -> None:
    o = orch(sink)
    assert o.submit_sub(SUB) == 0
    assert o.submit_next_level(CHIP, TaskArgs(), worker=2) == 1
    assert o.submit_next_level_group(CHIP, [TaskArgs(), TaskArgs()], workers=[1, 0]) == 2
    assert o.submit_sub_group(SUB, [TaskArgs()] * 3) == 3
    kinds = [(s.kind, list(s.targets), s.group_size) for s in o.run.slots]
    assert kinds == [
        (TaskKind.SUB, [], 1),
        (TaskKind.NEXT_LEVEL, [2], 1),
        (TaskKind.NEXT_LEVEL_GROUP, [1, 0], 2),
        (TaskKind.SUB_GROUP, [], 3),
    ]
    assert o.run.remaining == 4
    assert all(s.run is o.run and s.run_id == o.run_id for s in o.run.slots)
    assert len({s.slot_id for s in o.run.slots}) == 4


# -- facade validation -------------------------------------------------------------------------


def test_next_level_group_workers_must_be_distinct_and_match_the_args(sink: Sink) -> None:
    o = orch(sink)
    with pytest.raises(ValueError, match=r"workers \[0, 0\] are not distinct"):
        o.submit_next_level_group(CHIP, [TaskArgs(), TaskArgs()], workers=[0, 0])
    with pytest.raises(ValueError, match="2 workers for 3 args"):
        o.submit_next_level_group(CHIP, [TaskArgs()] * 3, workers=[0, 1])
    with pytest.raises(ValueError, match="non-empty"):
        o.submit_next_level_group(CHIP, [], workers=[])
    with pytest.raises(TypeError, match="list of ints"):
        o.submit_next_level_group(CHIP, [TaskArgs()], workers=[True])
    with pytest.raises(ValueError, match="worker=7"):
        o.submit_next_level_group(CHIP, [TaskArgs(), TaskArgs()], workers=[0, 7])
    assert o.run.slots == []


def test_next_level_worker_must_be_an_int(sink: Sink) -> None:
    o = orch(sink)
    with pytest.raises(TypeError, match="worker= must be an int"):
        o.submit_next_level(CHIP, TaskArgs(), worker="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="worker= must be an int"):
        o.submit_next_level(CHIP, TaskArgs(), worker=False)
    with pytest.raises(TypeError):
        o.submit_next_level(CHIP, TaskArgs())  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="worker=99"):
        o.submit_next_level(CHIP, TaskArgs(), worker=99)


def test_sub_takes_no_worker_selection(sink: Sink) -> None:
    o = orch(sink)
    with pytest.raises(TypeError, match="worker"):
        o.submit_sub(SUB, TaskArgs(), worker=0)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="non-empty"):
        o.submit_sub_group(SUB, [])


def test_args_and_config_types_are_checked(sink: Sink, heap: Heap) -> None:
    o = orch(sink)
    with pytest.raises(TypeError, match="CallConfig"):
        o.submit_sub(SUB, TaskArgs(), config={"deadline_ms": 5})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"args\[1\] must be TaskArgs"):
        o.submit_sub_group(SUB, [TaskArgs(), object()])  # type: ignore[list-item]
    import numpy as np

    with pytest.raises(ValueError, match="not on the shared heap"):
        o.submit_sub(SUB, TaskArgs().add_tensor(np.zeros(4), Tag.INPUT))
    assert o.run.slots == [] and o.run.remaining == 0


def test_submitting_after_the_orchestration_returned_is_refused(sink: Sink) -> None:
    o = orch(sink)
    o.run.building = False
    with pytest.raises(WorkerClosedError, match="orchestration returned"):
        o.submit_sub(SUB)


def test_submitting_into_a_failed_run_reraises_its_error(sink: Sink) -> None:
    o = orch(sink)
    o.submit_sub(SUB)
    o.run.record_error(slot_of(o, 0), FailureInfo(Outcome.TASK_FAILURE, "boom", 1, 3, 4242))
    err = o.run.error
    assert err is not None
    with pytest.raises(TaskError) as info:
        o.submit_sub(SUB)
    assert info.value is err
    assert len(o.run.slots) == 1


# -- Run -----------------------------------------------------------------------------------------


def test_run_first_error_wins_and_names_the_task(sink: Sink) -> None:
    o = orch(sink)
    o.submit_sub(SUB)
    o.submit_sub(SUB)
    run = o.run
    run.record_error(
        slot_of(o, 1), FailureInfo(Outcome.TASK_FAILURE, "first\ntraceback", 1, 5, 777)
    )
    run.record_error(slot_of(o, 0), FailureInfo(Outcome.ENDPOINT_FAILURE, "second", 0, 1, 888))
    err = run.error
    assert isinstance(err, TaskError) and not isinstance(err, RunCancelled)
    assert (err.run_id, err.worker_id, err.dispatch_id, err.pid) == (run.run_id, 1, 5, 777)
    assert err.hashid == SUB.hashid and err.outcome == "TASK_FAILURE"
    assert err.remote_text == "first\ntraceback"
    assert "task 1" in str(err) and "worker 1 (pid 777)" in str(err) and "dispatch 5" in str(err)


def test_run_done_callbacks_fire_once_and_immediately_when_terminal() -> None:
    run = Run()
    seen: list[int] = []
    run.add_done_callback(lambda r: seen.append(1))
    run.end(RunState.COMPLETED)
    run.fire_done()
    run.fire_done()
    run.add_done_callback(lambda r: seen.append(2))
    assert seen == [1, 2]


def test_run_ids_are_unique_and_increasing() -> None:
    a, b = Run(), Run()
    assert b.run_id > a.run_id


# -- Admission -------------------------------------------------------------------------------------


def test_admission_depth_two_head_executes_successor_waits_prepared_third_waits() -> None:
    adm = Admission(2)
    r1, r2, r3 = Run(), Run(), Run()
    assert adm.enqueue(r1) == [r1]
    assert adm.head is r1 and r1.state is RunState.EXECUTING and r1.admitted
    assert adm.enqueue(r2) == [r2]
    r2.state = RunState.PREPARED  # its orchestration returned
    assert adm.enqueue(r3) == []
    assert adm.head is r1 and adm.successor is r2
    assert r2.state is RunState.PREPARED
    assert list(adm.waiting) == [r3] and not r3.admitted and r3.state is RunState.BUILDING
    assert adm.runs() == [r1, r2, r3]
    assert {r1.lease_slot, r2.lease_slot} == {0, 1}

    r1.end(RunState.COMPLETED)
    assert adm.release(r1) == [r3]  # release promotes
    assert adm.head is r2 and r2.state is RunState.EXECUTING
    assert adm.successor is r3 and r3.admitted and not adm.waiting
    assert r3.lease_slot == r1.lease_slot and r3.lease_generation > r2.lease_generation


def test_admission_leases_are_generation_safe() -> None:
    adm = Admission(2)
    r1, r2, r3 = Run(), Run(), Run()
    adm.enqueue(r1)
    adm.enqueue(r2)
    adm.enqueue(r3)
    old = (r1.lease_slot, r1.lease_generation)
    assert adm.lease_valid(*old)
    adm.release(r1)
    assert r3.lease_slot == old[0]
    assert not adm.lease_valid(*old)  # the superseded generation of the same slot
    assert adm.lease_valid(r3.lease_slot, r3.lease_generation)
    assert adm.lease_valid(r2.lease_slot, r2.lease_generation)
    assert not adm.lease_valid(r2.lease_slot, r3.lease_generation)


def test_admission_releases_a_lease_exactly_once() -> None:
    adm = Admission(2)
    r1, r2, r3, r4 = Run(), Run(), Run(), Run()
    for r in (r1, r2, r3, r4):
        adm.enqueue(r)
    assert adm.release(r1) == [r3]
    assert adm.release(r1) == []  # a second release frees nothing
    assert list(adm.waiting) == [r4] and not r4.admitted
    assert adm.active[0] is r2 and adm.active[1] is r3
    assert r2.lease_slot != r3.lease_slot
    assert adm.release(r2) == [r4]  # the lease r1 gave back was not handed out twice
    assert r4.lease_slot == r2.lease_slot


def test_admission_release_of_a_waiting_run_takes_it_out_of_the_queue() -> None:
    adm = Admission(1)
    r1, r2, r3 = Run(), Run(), Run()
    adm.enqueue(r1)
    adm.enqueue(r2)
    adm.enqueue(r3)
    assert adm.release(r2) == []
    assert list(adm.waiting) == [r3] and adm.head is r1
    assert adm.release(r1) == [r3]
    assert adm.head is r3 and r3.state is RunState.EXECUTING


def test_admission_depth_one_admits_only_the_head() -> None:
    adm = Admission(1)
    r1, r2 = Run(), Run()
    adm.enqueue(r1)
    assert adm.enqueue(r2) == []
    assert adm.successor is None


def test_admission_rejects_bad_depth_and_closed_submission() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Admission(0)
    adm = Admission(2)
    adm.closed = True
    with pytest.raises(WorkerClosedError, match="closing"):
        adm.enqueue(Run())


def test_a_queued_plain_sub_task_keeps_nothing_the_collector_walks(sink: Sink) -> None:
    """A queued plain SUB task keeps no object the cyclic collector tracks: its TaskSlot
    is off the collector's lists until its run ends (``runmodel.untrack_slot``), and it
    has no list of its own for blobs, targets, pins or consumers. A 20,000-task run kept
    five tracked objects per task, and the collector's passes over them took a seventh
    of W2's time; with one per task, its passes still took 4-6 ms of a 100 ms run."""
    o = orch(sink)
    o.submit_sub(SUB)  # first-use caches
    n = 2_000
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(n):
        o.submit_sub(SUB)
    gc.collect()
    kept = len(gc.get_objects()) - before
    assert kept <= 50, f"{kept} tracked objects kept for {n} queued plain tasks"
    assert not gc.is_tracked(slot_of(o, 1))
    assert not slot_of(o, 1).consumers and not slot_of(o, 1).pins
    # A task with a scalar: the same (its tuple of one blob holds bytes only, so the
    # collector stops tracking it too).
    first = len(o.run.slots)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(n):
        a = TaskArgs()
        a.add_scalar(i)
        o.submit_sub(SUB, a)
    gc.collect()
    kept = len(gc.get_objects()) - before
    assert kept <= 50, f"{kept} tracked objects kept for {n} queued tasks with a scalar"
    assert slot_of(o, first).blobs[0] != slot_of(o, first + 1).blobs[0]
    # A dependency still makes the producer's consumer list.
    heap = sink.heap
    x = heap.alloc((4,), "float64")
    o.submit_sub(SUB, args((x, Tag.OUTPUT)))
    o.submit_sub(SUB, args((x, Tag.INPUT)))
    assert slot_of(o, 2 * n + 1).consumers == [slot_of(o, 2 * n + 2)]
