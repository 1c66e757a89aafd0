"""The dependency map of one run: which task last wrote which memory of which buffer.

Which memory a tensor view touches: its byte range, refined per axis where that is exact.

A dependency between two tasks exists when a view one writes and a view the other
reads or writes share memory. Byte ranges alone over-connect 2-D work: the column
blocks ``a[:, :4]`` and ``a[:, 4:]`` of a row-major ``a`` have crossing byte ranges
but no element in common. So, where both views are boxes of one canonical row-major
layout, the test is per axis::

    view                                    box?   layout key (itemsize, strides)
    a[1:3, :]   rows of a (R, C) buffer     yes    (s, (C*s, s))
    a[:, 2:5]   columns of it               yes    (s, (C*s, s))   same layout: per axis
    a[::2, :]   stepped rows                no     (byte range)
    a.T         transposed                  no     (byte range)
    a.reshape(-1)[...]  another rank        yes, another layout: byte range

    row block x column block    cross (both axes meet)
    two row blocks / two column blocks   disjoint when their ranges on one axis are

Anything that is not a box of the same layout falls back to the byte range test,
which may over-connect but never misses a shared byte. :func:`covers` says whether a
write replaces every byte of an earlier one (the earlier writer then stops being a
producer); ``Region.dense`` whether a view fills its byte range (then the byte pieces
of an earlier dense writer that stay outside it can be kept exactly).

One comparison serves both the dependency map (:class:`TensorMap`) and the
submit-time refusal of two written arguments of one task that share memory.

:class:`TensorMap` keeps, per buffer key, the regions their last writers wrote::

    producers(key, r)    the writers an access of r depends on (regions that overlap)
    write(key, r, slot)  slot becomes the writer of r: writers r covers are dropped;
                         a dense writer r partly covers keeps the bytes outside r; any
                         other partly covered writer stays whole (it still produced
                         some of the bytes, and over-connecting is safe)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from simpler_daemon.args import TensorDesc, dtype_of

if TYPE_CHECKING:
    from simpler_daemon.scheduler.runmodel import TaskSlot

__all__ = ["Region", "TensorMap", "covers", "overlaps", "region"]

_ITEMSIZE: Final[dict[int, int]] = {}


def _itemsize(code: int) -> int:
    size = _ITEMSIZE.get(code)
    if size is None:
        size = _ITEMSIZE[code] = dtype_of(code).itemsize
    return size


class Region:
    """The memory of one view: its byte range ``[lo, hi)`` and, when it is a box of a
    row-major layout, that layout's key and the box's start and stop per axis."""

    __slots__ = ("dense", "hi", "layout", "lo", "starts", "stops")

    def __init__(
        self,
        lo: int,
        hi: int,
        layout: tuple[int, tuple[int, ...]] | None = None,
        starts: tuple[int, ...] = (),
        stops: tuple[int, ...] = (),
        dense: bool = False,
    ) -> None:
        self.lo = lo
        self.hi = hi
        self.layout = layout
        self.starts = starts
        self.stops = stops
        self.dense = dense

    def __repr__(self) -> str:
        box = f", box {list(zip(self.starts, self.stops, strict=True))}" if self.layout else ""
        return f"Region([{self.lo}, {self.hi}){box})"


def region(desc: TensorDesc) -> Region:
    """The region of ``desc`` (see the module docstring for when it is a box)."""
    shape, strides = desc.shape, desc.strides
    itemsize = _ITEMSIZE.get(desc.dtype) or _itemsize(desc.dtype)
    if len(shape) == 1 and strides[0] == itemsize:
        # The common case on the submit path: a contiguous 1-D view.
        lo, n = desc.byte_offset, shape[0]
        if n == 0:
            return Region(lo, lo)
        hi = lo + n * itemsize
        if lo % itemsize:
            return Region(lo, hi, dense=True)
        start = lo // itemsize
        return Region(lo, hi, (itemsize, strides), (start,), (start + n,), True)
    lo, hi = desc.byte_range()
    count = 1
    for dim in shape:
        count *= dim
    dense = count * itemsize == hi - lo and all(
        s > 0 for s, d in zip(strides, shape, strict=True) if d > 1
    )
    if (
        lo >= hi
        or not shape
        or strides[-1] != itemsize
        or desc.byte_offset % itemsize
        or any(s <= 0 for s in strides)
    ):
        return Region(lo, hi, dense=dense)
    # Row-major: each stride a whole multiple of the next, the inner dims fitting in it.
    for k in range(len(shape) - 1):
        outer, inner = strides[k], strides[k + 1]
        if outer % inner or outer // inner < shape[k + 1]:
            return Region(lo, hi, dense=dense)
    starts: list[int] = []
    rem = desc.byte_offset
    for k, stride in enumerate(strides):
        start, rem = divmod(rem, stride)
        if k and start + shape[k] > strides[k - 1] // stride:
            return Region(lo, hi, dense=dense)  # the view wraps into the next row
        starts.append(start)
    stops = tuple(s + d for s, d in zip(starts, shape, strict=True))
    return Region(lo, hi, (itemsize, strides), tuple(starts), stops, dense)


def overlaps(a: Region, b: Region) -> bool:
    """Whether two regions may share a byte (exact for boxes of one layout)."""
    if not (a.lo < b.hi and b.lo < a.hi):
        return False
    if a.layout is not None and a.layout == b.layout:
        for s1, e1, s2, e2 in zip(a.starts, a.stops, b.starts, b.stops, strict=True):
            if not (s1 < e2 and s2 < e1):
                return False
    return True


def covers(a: Region, b: Region) -> bool:
    """Whether a write of ``a`` replaces every byte of ``b``."""
    if b.lo >= b.hi:
        return True
    if a.layout is not None and a.layout == b.layout:
        return all(
            s1 <= s2 and e2 <= e1
            for s1, e1, s2, e2 in zip(a.starts, a.stops, b.starts, b.stops, strict=True)
        )
    return a.dense and a.lo <= b.lo and b.hi <= a.hi


class TensorMap:
    """Last writers per buffer inside one run (see the module docstring)."""

    __slots__ = ("_writers",)

    def __init__(self) -> None:
        # Keyed by a local buffer id, or (owner, buffer id, generation, session) for a
        # remote buffer.
        self._writers: dict[Any, list[tuple[Region, TaskSlot]]] = {}

    def producers(self, key: Any, r: Region) -> list[TaskSlot]:
        lo, hi = r.lo, r.hi
        return [
            slot
            for w, slot in self._writers.get(key, ())
            if w.lo < hi and lo < w.hi and overlaps(r, w)
        ]

    def write(self, key: Any, r: Region, slot: TaskSlot) -> None:
        if r.lo >= r.hi:
            return
        segs = self._writers.setdefault(key, [])
        kept: list[tuple[Region, TaskSlot]] = []
        for w, s in segs:
            if not (w.lo < r.hi and r.lo < w.hi) or not overlaps(r, w):
                kept.append((w, s))
            elif covers(r, w):
                continue  # superseded: every byte it wrote is written again
            elif r.dense and w.dense:
                if w.lo < r.lo:
                    kept.append((Region(w.lo, r.lo, dense=True), s))
                if r.hi < w.hi:
                    kept.append((Region(r.hi, w.hi, dense=True), s))
            else:
                kept.append((w, s))  # partly covered: still the producer of its own bytes
        kept.append((r, slot))
        segs[:] = kept
