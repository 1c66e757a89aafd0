"""The shared heap: allocation, descriptors, pins, named heaps, child views."""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from simpler_daemon.args import Tag, dtype_code
from simpler_daemon.children.process import fork_child
from simpler_daemon.heap import ALIGN, SHM_DIR, Heap, heap_name, sweep_stale_heaps
from simpler_daemon.testing import shm_files


@pytest.fixture
def heap() -> Iterator[Heap]:
    hp = Heap(64 * 1024)
    try:
        yield hp
    finally:
        hp.close()


def free_blocks(hp: Heap) -> list[tuple[int, int]]:
    return list(hp._free)


# -- allocation ----------------------------------------------------------------------------


def test_size_rounds_up_to_pages_and_rejects_nonpositive() -> None:
    hp = Heap(1)
    try:
        assert hp.size == mmap.PAGESIZE and hp.free_bytes() == hp.size
    finally:
        hp.close()
    for bad in (0, -4096):
        with pytest.raises(ValueError, match="must be positive"):
            Heap(bad)


def test_alloc_shapes_dtypes_and_alignment(heap: Heap) -> None:
    a = heap.alloc((3, 4), "int16")
    b = heap.alloc(5, "float64")
    c = heap.alloc((), "uint8")
    z = heap.alloc((0, 7), "float32")
    assert a.shape == (3, 4) and a.dtype == np.int16 and a.flags.c_contiguous
    assert b.shape == (5,) and c.shape == () and z.size == 0
    for arr in (a, b, c, z):
        assert (arr.__array_interface__["data"][0] - heap.address) % ALIGN == 0
        assert not arr.any()  # fresh memory is zero
    ids = [heap.describe(x).buffer_id for x in (a, b, c)]
    assert len(set(ids)) == 3
    assert sorted(x.buffer_id for x in heap.buffers()) == sorted([*ids, heap.describe(z).buffer_id])


@pytest.mark.parametrize(
    ("shape", "dtype", "exc", "match"),
    [
        ((1,) * 9, "float32", ValueError, "at most 8"),
        ((2, -1), "float32", ValueError, "non-negative"),
        (4, "U3", ValueError, "not supported"),
    ],
)
def test_alloc_rejects_bad_requests(
    heap: Heap, shape: object, dtype: str, exc: type, match: str
) -> None:
    with pytest.raises(exc, match=match):
        heap.alloc(shape, dtype)  # type: ignore[arg-type]
    assert heap.free_bytes() == heap.size  # nothing leaked by a refused request


def test_free_and_coalescing(heap: Heap) -> None:
    a, b, c, d = (heap.alloc(100, "uint8") for _ in range(4))  # 128 bytes each
    offs = [heap.describe(x).buffer_offset for x in (a, b, c, d)]
    assert offs == [0, 128, 256, 384]
    heap.free(a)
    heap.free(c)
    assert free_blocks(heap) == [(0, 128), (256, 128), (512, heap.size - 512)]
    heap.free(b)  # joins both neighbours
    assert free_blocks(heap) == [(0, 384), (512, heap.size - 512)]
    heap.free(d)  # joins the tail
    assert free_blocks(heap) == [(0, heap.size)]
    assert heap.free_bytes() == heap.largest_free() == heap.size
    assert heap.buffers() == []


def test_first_fit_reuses_freed_space_with_new_identity(heap: Heap) -> None:
    a = heap.alloc(64, "uint8")
    da = heap.describe(a)
    heap.free(a)
    b = heap.alloc(16, "uint8")
    db = heap.describe(b)
    assert db.buffer_offset == da.buffer_offset
    assert db.buffer_id != da.buffer_id and db.generation > da.generation


def test_reused_memory_is_zero_filled(heap: Heap) -> None:
    """``Worker.alloc`` promises zero-filled arrays; reuse must not leak old contents."""
    a = heap.alloc(256, "uint8")
    a[:] = 0xAB
    heap.free(a)
    b = heap.alloc(256, "uint8")
    assert heap.describe(b).buffer_offset == 0
    assert not b.any()


def test_free_errors(heap: Heap) -> None:
    a = heap.alloc(8)
    bid = heap.describe(a).buffer_id
    heap.free(bid)
    with pytest.raises(KeyError, match=f"buffer {bid}"):
        heap.free(bid)
    with pytest.raises(KeyError, match="not allocated"):
        heap.free(12345)
    with pytest.raises(ValueError, match="no live buffer"):
        heap.free(a)  # the array outlives its buffer
    with pytest.raises(KeyError, match=f"buffer {bid} is not allocated"):
        heap.get(bid)


def test_exhaustion_raises_memory_error_naming_sizes() -> None:
    hp = Heap(4096)
    try:
        hp.alloc(1024, "uint8")
        with pytest.raises(MemoryError) as ei:
            hp.alloc(8192, "uint8")
        msg = str(ei.value)
        assert "cannot allocate 8192 bytes" in msg
        assert "3072 of 4096 bytes free" in msg and "largest block 3072" in msg
        # Fragmentation: enough bytes in total, no block large enough.
        hp2 = hp
        x = hp2.alloc(1024, "uint8")
        hp2.alloc(1024, "uint8")
        hp2.free(x)
        with pytest.raises(MemoryError, match="2048 of 4096 bytes free, largest block 1024"):
            hp2.alloc(2048, "uint8")
    finally:
        hp.close()


# -- pins ----------------------------------------------------------------------------------


def test_pin_defers_reuse_until_unpinned(heap: Heap) -> None:
    a = heap.alloc(64, "uint8")
    d = heap.describe(a)
    heap.pin(d.buffer_id)
    heap.pin(d.buffer_id)  # two slots captured it
    heap.free(a)
    assert heap.free_bytes() == heap.size - 64  # still held
    with pytest.raises(KeyError, match="already freed"):
        heap.free(d.buffer_id)
    with pytest.raises(ValueError, match="no live buffer"):
        heap.describe(a)  # freed: no new task may capture it
    b = heap.alloc(64, "uint8")
    assert heap.describe(b).buffer_offset != d.buffer_offset  # not reused while pinned
    heap.unpin(d.buffer_id)
    assert heap.free_bytes() == heap.size - 128
    heap.unpin(d.buffer_id)  # last slot retired: released
    assert heap.free_bytes() == heap.size - 64
    c = heap.alloc(64, "uint8")
    dc = heap.describe(c)
    assert dc.buffer_offset == d.buffer_offset and dc.generation > d.generation
    heap.unpin(d.buffer_id)  # a late unpin of a released buffer is harmless


def test_unpin_without_free_keeps_buffer(heap: Heap) -> None:
    a = heap.alloc(8)
    bid = heap.describe(a).buffer_id
    heap.pin(bid)
    heap.unpin(bid)
    assert heap.get(bid).pins == 0 and not heap.get(bid).freed
    assert heap.describe(a).buffer_id == bid


# -- describe ------------------------------------------------------------------------------


def test_describe_views_and_slices(heap: Heap) -> None:
    heap.alloc(10, "uint8")  # so the buffer under test does not start at heap offset 0
    a = heap.alloc((4, 6), "float32")  # row stride 24
    base = heap.describe(a)
    assert (base.byte_offset, base.shape, base.strides) == (0, (4, 6), (24, 4))
    assert base.buffer_offset == 64 and base.buffer_nbytes == 96 and base.tag is Tag.INPUT
    assert base.dtype == dtype_code("float32")

    cases = {
        "slice": (a[1:3, ::2], 24, (2, 3), (24, 8)),
        "reversed": (a[::-1], 72, (4, 6), (-24, 4)),
        "both reversed": (a[::-1, ::-1], 92, (4, 6), (-24, -4)),
        "transpose": (a.T, 0, (6, 4), (4, 24)),
        "column": (a[:, 5], 20, (4,), (24,)),
        "element": (a[3, 5, ...], 92, (), ()),
        "reshaped": (a.reshape(2, 12), 0, (2, 12), (48, 4)),
        "dtype view": (a.view(np.int32)[2:], 48, (2, 6), (24, 4)),
    }
    for name, (view, off, shape, strides) in cases.items():
        d = heap.describe(view)
        assert (d.byte_offset, d.shape, d.strides) == (off, shape, strides), name
        assert d.buffer_id == base.buffer_id and d.generation == base.generation, name
        back = heap.view(d)
        np.testing.assert_array_equal(back, view)
        assert np.shares_memory(back, a), name


def test_describe_non_heap_array_names_worker_alloc(heap: Heap) -> None:
    with pytest.raises(ValueError, match=r"not on the shared heap; allocate it with Worker\.alloc"):
        heap.describe(np.zeros(4, np.float32))
    other = Heap(4096)
    try:
        with pytest.raises(ValueError, match=r"Worker\.alloc"):
            heap.describe(other.alloc(4))
    finally:
        other.close()


def test_describe_rejects_unallocated_and_overrunning_views(heap: Heap) -> None:
    a = heap.alloc(4, "float32")
    # Bytes of the heap no buffer holds (past the first allocation's padding).
    stray = np.ndarray((4,), np.float32, buffer=heap.mmap, offset=1024)
    with pytest.raises(ValueError, match="no live buffer holds it"):
        heap.describe(stray)
    # A hand-made view that starts inside ``a`` but runs past its end.
    over = np.ndarray((8,), np.float32, buffer=heap.mmap, offset=heap.describe(a).buffer_offset)
    with pytest.raises(ValueError, match=r"overruns buffer \d+ of 16 bytes"):
        heap.describe(over)
    with pytest.raises(ValueError, match="not supported"):
        heap.describe(a.view("V4"))


def test_describe_buffer_by_numbers(heap: Heap) -> None:
    a = heap.alloc((3, 4), "int32")
    a[...] = np.arange(12).reshape(3, 4)
    bid = heap.describe(a).buffer_id
    d = heap.describe_buffer(bid, byte_offset=16, shape=(2, 4), dtype="int32")
    assert d.strides == (16, 4)
    np.testing.assert_array_equal(heap.view(d), a[1:])
    with pytest.raises(ValueError, match=r"view \[16, 64\) overruns buffer"):
        heap.describe_buffer(bid, byte_offset=16, shape=(3, 4), dtype="int32")
    with pytest.raises(ValueError, match="overruns"):
        heap.describe_buffer(bid, byte_offset=-4, shape=(1,), dtype="int32")


def test_view_bounds_checks_descriptor(heap: Heap) -> None:
    a = heap.alloc(4, "float32")
    d = heap.describe(a)
    from dataclasses import replace

    with pytest.raises(ValueError, match="overruns the heap"):
        heap.view(replace(d, shape=(5,)))
    with pytest.raises(ValueError, match="overruns the heap"):
        heap.view(replace(d, buffer_offset=heap.size - 8))


# -- lifecycle -----------------------------------------------------------------------------


def test_closed_heap_refuses_alloc() -> None:
    hp = Heap(4096)
    hp.close()
    hp.close()  # idempotent
    with pytest.raises(RuntimeError, match="heap: it is closed"):
        hp.alloc(4)


def test_named_heap_is_unlinked_at_close() -> None:
    name = heap_name()
    assert name.startswith(f"simpler-heap-{os.getpid()}-")
    hp = Heap(8192, name=name)
    path = os.path.join(SHM_DIR, name)
    try:
        assert os.path.exists(path) and name in shm_files()
        a = hp.alloc(16, "uint8")
        a[:] = 7
        with open(path, "rb") as f:  # a local client mapping by name sees the bytes
            f.seek(hp.describe(a).buffer_offset)
            assert f.read(16) == b"\x07" * 16
        del a
    finally:
        hp.close()
    assert not os.path.exists(path)
    with pytest.raises(FileExistsError):  # names are exclusive while they exist
        h1 = Heap(4096, name=name)
        try:
            Heap(4096, name=name)
        finally:
            h1.close()


def _dead_pid() -> int:
    child = fork_child(lambda: 0, "dead pid donor")
    assert child.wait(5.0)
    child.close()
    return child.pid


def test_sweep_stale_heaps_removes_file_of_dead_pid(tmp_path: os.PathLike[str]) -> None:
    dead = _dead_pid()
    stale = f"simpler-heap-{dead}-deadbeef"
    live = f"simpler-heap-{os.getpid()}-0123abcd"
    unrelated = ["simpler-heap-notapid-00", f"other-heap-{dead}-00", f"simpler-heap-{dead}-XYZ"]
    for n in [stale, live, *unrelated]:
        open(os.path.join(tmp_path, n), "wb").close()
    assert sweep_stale_heaps(str(tmp_path)) == [stale]
    assert sorted(os.listdir(tmp_path)) == sorted([live, *unrelated])
    assert sweep_stale_heaps(str(tmp_path / "missing")) == []  # type: ignore[operator]


def test_sweep_stale_heaps_in_dev_shm() -> None:
    dead = _dead_pid()
    name = f"simpler-heap-{dead}-{os.urandom(4).hex()}"
    path = os.path.join(SHM_DIR, name)
    open(path, "wb").close()
    try:
        assert name in sweep_stale_heaps()
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


# -- children ------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_child_view_of_descriptor_shares_memory_with_parent(heap: Heap) -> None:
    """A forked child rebuilds views from descriptors and sees the parent's later writes;
    the parent sees the child's writes. Nothing is copied."""
    data = heap.alloc((4, 8), "float64")
    flags = heap.alloc(2, "int64")  # [0] parent -> child "go", [1] child -> parent "done"
    d_data = heap.describe(data[::-1, 1::2])  # a strided, reversed view
    d_flags = heap.describe(flags)

    def child_main() -> int:
        f = heap.view(d_flags)
        v = heap.view(d_data)
        deadline = time.monotonic() + 10
        while f[0] == 0:  # wait for data written by the parent *after* the fork
            if time.monotonic() > deadline:
                return 3
            time.sleep(0.0005)
        if not np.array_equal(v, np.arange(32, dtype=np.float64).reshape(4, 8)[::-1, 1::2]):
            return 4
        v *= -1  # write back through the descriptor's view
        f[1] = 1
        return 0

    child = fork_child(child_main, "heap view child")
    try:
        data[...] = np.arange(32, dtype=np.float64).reshape(4, 8)
        flags[0] = 1
        assert child.wait(10.0)
        assert os.WIFEXITED(child.status or 0) and os.WEXITSTATUS(child.status or 0) == 0, (
            child.describe()
        )
        assert flags[1] == 1
        expected = np.arange(32, dtype=np.float64).reshape(4, 8)
        expected[:, 1::2] *= -1
        np.testing.assert_array_equal(data, expected)
    finally:
        if not child.poll():
            child.signal_group(9)
            child.wait(5.0)
        child.close()
