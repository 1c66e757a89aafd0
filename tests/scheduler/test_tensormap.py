"""The dependency map is view-aware, in the shape of the origin's tensormap tests
(its change #1902): disjoint ranges are independent producers, touching ranges do not
overlap, a covering write supersedes, a partially covered producer survives, a row
block and a column block cross, mismatched layouts fall back to the conservative
byte-range test. Then the same rules end to end: disjoint column blocks of one buffer
run side by side on real SUB children, and a group may write one shared output."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from simpler_daemon import Tag
from simpler_daemon.heap import Heap
from simpler_daemon.scheduler.tensormap import TensorMap, covers, overlaps, region
from simpler_daemon.testing import poll_for
from tests.support.sub_tasks import targs
from tests.support.worker_pool import Pool

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def heap() -> Iterator[Heap]:
    hp = Heap(1 << 20)
    try:
        yield hp
    finally:
        hp.close()


def _r(heap: Heap, view: np.ndarray[Any, Any]) -> Any:
    return region(heap.describe(view))


class _Slot:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _producers(tmap: TensorMap, heap: Heap, view: np.ndarray[Any, Any]) -> set[str]:
    d = heap.describe(view)
    return {s.name for s in tmap.producers(d.key, region(d))}


def _write(tmap: TensorMap, heap: Heap, view: np.ndarray[Any, Any], name: str) -> None:
    d = heap.describe(view)
    tmap.write(d.key, region(d), _Slot(name))  # type: ignore[arg-type]


def test_disjoint_ranges_are_independent_producers(heap: Heap) -> None:
    a = heap.alloc((64,), "float32")
    tmap = TensorMap()
    _write(tmap, heap, a[:32], "low")
    _write(tmap, heap, a[32:], "high")
    assert _producers(tmap, heap, a[:32]) == {"low"}
    assert _producers(tmap, heap, a[32:]) == {"high"}
    assert _producers(tmap, heap, a[30:34]) == {"low", "high"}


def test_touching_ranges_do_not_overlap(heap: Heap) -> None:
    a = heap.alloc((8, 8), "int32")
    assert not overlaps(_r(heap, a[:4]), _r(heap, a[4:]))
    assert not overlaps(_r(heap, a[:, :4]), _r(heap, a[:, 4:]))
    assert overlaps(_r(heap, a[:, :5]), _r(heap, a[:, 4:]))


def test_a_covering_write_supersedes_earlier_writers(heap: Heap) -> None:
    a = heap.alloc((8, 8), "int32")
    tmap = TensorMap()
    _write(tmap, heap, a[:2, :4], "corner")
    _write(tmap, heap, a[:, 4:], "right")
    _write(tmap, heap, a[:4, :], "top")  # covers the corner, not all of the right half
    assert _producers(tmap, heap, a[:2, :4]) == {"top"}
    assert _producers(tmap, heap, a[6:, 4:]) == {"right"}
    _write(tmap, heap, a, "all")
    assert _producers(tmap, heap, a[5:, 5:]) == {"all"}


def test_a_partially_covered_producer_survives(heap: Heap) -> None:
    a = heap.alloc((8, 8), "int32")
    tmap = TensorMap()
    _write(tmap, heap, a[:, :4], "left")
    _write(tmap, heap, a[:4, :], "top")  # covers the upper half of the left block only
    assert _producers(tmap, heap, a[6:, :2]) == {"left"}  # bytes only left wrote
    assert "top" in _producers(tmap, heap, a[:2, :2])
    # 1-D: the bytes outside a dense write stay exactly the earlier writer's.
    b = heap.alloc((64,), "uint8")
    _write(tmap, heap, b, "whole")
    _write(tmap, heap, b[16:32], "middle")
    assert _producers(tmap, heap, b[:16]) == {"whole"}
    assert _producers(tmap, heap, b[16:32]) == {"middle"}
    assert _producers(tmap, heap, b[40:]) == {"whole"}


def test_row_block_and_column_block_cross(heap: Heap) -> None:
    a = heap.alloc((8, 8), "float64")
    rows, cols = _r(heap, a[2:4, :]), _r(heap, a[:, 6:])
    assert overlaps(rows, cols) and overlaps(cols, rows)
    assert not overlaps(_r(heap, a[2:4, :]), _r(heap, a[4:6, :]))  # two row blocks
    assert not overlaps(_r(heap, a[:, :3]), _r(heap, a[:, 3:6]))  # two column blocks
    assert not overlaps(_r(heap, a[:4, :4]), _r(heap, a[4:, 4:]))  # diagonal blocks


def test_mismatched_layouts_fall_back_to_the_byte_range(heap: Heap) -> None:
    a = heap.alloc((8, 8), "int16")
    col = _r(heap, a[:, :4])
    flat = _r(heap, a.reshape(-1)[4:8])  # another rank: bytes 8..16 of row 0's right half
    assert overlaps(col, flat)  # the byte ranges meet: conservative, though disjoint
    stepped = _r(heap, a[:, ::2])
    assert stepped.layout is None and overlaps(stepped, _r(heap, a[:, 1::2]))
    transposed = _r(heap, a.T[:4, :])  # columns 0..3 of a, seen transposed
    assert transposed.layout is None and overlaps(transposed, _r(heap, a[4:, 4:]))
    assert not covers(_r(heap, a[:, ::2]), _r(heap, a[:, 2:3]))  # a stepped write covers nothing
    assert covers(_r(heap, a), _r(heap, a.T))  # a dense write covers every byte in its range


# -- end to end ------------------------------------------------------------------------------


POOL_TASKS = ("wait_flag", "noop")
POOL_ADMISSIONS = ("fair",)


def test_disjoint_column_blocks_of_one_buffer_do_not_serialize(pool: Pool) -> None:
    """A reader of the left half does not wait for a writer of the right half, which
    waits on a flag: it completes while that writer is held."""
    data = pool.w.alloc((4, 8), "int32")
    flags = pool.w.alloc((1,), "int64")
    h = pool.h

    def orch(o: Any, args: Any, config: Any) -> None:
        held = targs((flags, Tag.NO_DEP), (data[:, 4:], Tag.OUTPUT), scalars=(0, 0))
        o.submit_sub(h["wait_flag"], held)
        o.submit_sub(h["noop"], targs((data[:, :4], Tag.INPUT)))

    handle = pool.w.submit(orch)
    run = handle.run
    poll_for(lambda: run.slots[1].state.name == "COMPLETED", timeout=60)
    assert not handle.done()  # the column writer is still held by its flag
    flags[0] = 1
    handle.result(timeout=60)


def test_group_members_may_write_one_shared_output(pool: Pool) -> None:
    """Each member of a group writes its own row of one output: accepted (one group is
    one writer); two written arguments of one task that overlap are still refused."""
    out = pool.w.alloc((2, 4), "int32")
    h = pool.h

    def orch(o: Any, args: Any, config: Any) -> None:
        o.submit_sub_group(h["noop"], [targs((out, Tag.OUTPUT)), targs((out, Tag.OUTPUT))])

    pool.w.submit(orch).result(timeout=60)

    def racing(o: Any, args: Any, config: Any) -> None:
        o.submit_sub(h["noop"], targs((out, Tag.OUTPUT), (out[1:], Tag.INOUT)))

    with pytest.raises(ValueError, match="writes overlapping memory"):
        pool.w.submit(racing).result(timeout=60)
