"""The shared heap: one ``MAP_SHARED`` region mapped before any fork.

Every child inherits the mapping at the same address, so a tensor crosses a
mailbox as a descriptor and the child rebuilds a zero-copy NumPy view of the
same bytes. The parent owns allocation; children only build views.

A heap is anonymous by default (nothing in ``/dev/shm`` can leak). A named
heap (for local clients that map it by name) is a ``/dev/shm`` file that is
unlinked at close and swept at start when its creator is gone; it is reserved
in full at creation (``posix_fallocate``), so a full ``/dev/shm`` is a start-up
error rather than a SIGBUS on some later first write.

Freed buffers are reused only after every task slot that captured them has
retired: slots ``pin`` buffers at submit and ``unpin`` them when they retire.

A nested L3 Worker's heap also knows its **parent** heap (the L4's, mapped
before either was forked, so the L3 child and its SUB/chip grandchildren see it
at the same address). While the L3 child runs one of its parent's tasks, the
buffers of that task are **granted**: an array on one of them describes as a
parent-heap descriptor (location 2), which a grandchild views through the same
inherited mapping. The L4 pins those buffers for the whole task; the L3 never
pins them.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import math
import mmap
import operator
import os
import re
from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from simpler_daemon.args import MAX_NDIM, TensorDesc, dtype_code, dtype_of
from simpler_daemon.errors import StartupError

ALIGN: Final = 64
SHM_DIR: Final = "/dev/shm"
_NAME_RE: Final = re.compile(r"^simpler-heap-(\d+)-[0-9a-f]+$")


@dataclass(slots=True)
class Buffer:
    """One allocation on the heap."""

    buffer_id: int
    generation: int
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    pins: int = 0
    freed: bool = False


class Heap:
    """Allocator over one shared mapping.

    ``size`` is fixed at construction (the mapping must exist before fork).
    Raises ``MemoryError`` naming the request when the heap is exhausted.
    """

    def __init__(self, size: int, *, name: str | None = None) -> None:
        if size <= 0:
            raise ValueError(f"cannot create heap: size {size} must be positive")
        self.size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self.name = name
        self.path: str | None = None
        if name is None:
            self.mmap = mmap.mmap(-1, self.size, flags=mmap.MAP_SHARED)
        else:
            directory = SHM_DIR  # read at call time: tests point it at a small tmpfs
            self.path = os.path.join(directory, name)
            fd = os.open(
                self.path,
                os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
            try:
                _reserve(fd, self.size, directory)
                self.mmap = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
            except BaseException:
                os.unlink(self.path)
                raise
            finally:
                os.close(fd)
        self._base = np.frombuffer(self.mmap, dtype=np.uint8)
        self.address: int = self._base.__array_interface__["data"][0]
        self._free: list[tuple[int, int]] = [(0, self.size)]  # sorted (offset, length)
        self._buffers: dict[int, Buffer] = {}
        self._starts: list[int] = []  # sorted offsets of live buffers
        self._by_start: dict[int, Buffer] = {}
        self._ids: Iterator[int] = itertools.count(1)
        self._generation = 0
        self._touched = (
            0  # end of the highest range ever allocated; beyond it pages are fresh zeros
        )
        self.closed = False
        self.owner_pid = os.getpid()
        #: The heap of the Worker this one is a nested L3 child of (set by ``add_worker``).
        self.parent: Heap | None = None
        #: Parent buffers of the running parent task: sorted (offset, nbytes, id, generation).
        self._grants: list[tuple[int, int, int, int]] = []

    # -- allocation -----------------------------------------------------------------

    def alloc(self, shape: tuple[int, ...] | int, dtype: Any = "float32") -> np.ndarray[Any, Any]:
        """Allocate a C-contiguous array on the heap and return a view of it."""
        buf = self.alloc_buffer(shape, dtype)
        return self.array(buf)

    def continue_ids(self, ids: Iterator[int]) -> None:
        """Take buffer ids from ``ids`` from now on (the daemon's run history hands them
        out so that they never repeat across its restarts)."""
        self._ids = ids

    def alloc_buffer(self, shape: tuple[int, ...] | int, dtype: Any = "float32") -> Buffer:
        self._check_open()
        shp = check_shape(shape)
        dt = np.dtype(dtype)
        dtype_code(dt)  # refuses unsupported dtypes
        # Exact integers: a dimension of 2**64-1 must not wrap, and a zero dimension must
        # not hide one the descriptor (i64 shape and strides) or the heap cannot hold.
        nbytes = math.prod(shp) * dt.itemsize
        span = dt.itemsize
        for d in shp:
            span *= max(d, 1)
        if nbytes == 0 and span > self.size:
            raise ValueError(
                f"cannot allocate buffer: shape {shp} of {dt.name} is empty but its other "
                f"dimensions span {span} bytes, more than the whole heap ({self.size} bytes)"
            )
        length = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        for i, (off, free_len) in enumerate(self._free):
            if free_len >= length:
                if free_len == length:
                    del self._free[i]
                else:
                    self._free[i] = (off + length, free_len - length)
                break
        else:
            raise MemoryError(
                f"cannot allocate {nbytes} bytes on the shared heap: {self.free_bytes()} of "
                f"{self.size} bytes free, largest block {self.largest_free()}"
            )
        if off < self._touched:  # reused memory: never hand out a previous buffer's bytes
            self._base[off : min(off + nbytes, self._touched)] = 0
        self._touched = max(self._touched, off + length)
        self._generation += 1
        buf = Buffer(next(self._ids), self._generation, off, nbytes, shp, dt.str)
        self._buffers[buf.buffer_id] = buf
        bisect.insort(self._starts, off)
        self._by_start[off] = buf
        return buf

    def array(self, buf: Buffer) -> np.ndarray[Any, Any]:
        dt = np.dtype(buf.dtype)
        # View through ``_base`` (which holds a buffer export on the mmap), not the mmap itself:
        # numpy keeps no export for ``buffer=mmap``, so ``close()`` would unmap under a live
        # array and reading it afterwards would segfault.
        return np.ndarray(buf.shape, dtype=dt, buffer=self._base, offset=buf.offset)

    def free(self, target: int | np.ndarray[Any, Any] | Buffer) -> None:
        """Free a buffer; its memory returns to the pool once no slot pins it.

        Raises ``KeyError`` naming the buffer id when it is unknown or already freed.
        """
        buf = self._resolve(target)
        if buf.freed:
            raise KeyError(f"cannot free buffer {buf.buffer_id}: already freed")
        buf.freed = True
        if buf.pins == 0:
            self._release(buf)

    def free_owned(self, buffer_id: int) -> None:
        """Free a buffer a run allocated (``Orchestrator.alloc``) at its scope's end,
        unless it was freed already; like ``free``, reuse waits for its pins."""
        buf = self._buffers.get(buffer_id)
        if buf is not None and not buf.freed:
            self.free(buf)

    def get(self, buffer_id: int) -> Buffer:
        buf = self._buffers.get(buffer_id)
        if buf is None or buf.freed:
            raise KeyError(f"buffer {buffer_id} is not allocated")
        return buf

    def buffers(self) -> list[Buffer]:
        return [b for b in self._buffers.values() if not b.freed]

    def pin(self, buffer_id: int) -> None:
        self._buffers[buffer_id].pins += 1

    def unpin(self, buffer_id: int) -> None:
        buf = self._buffers.get(buffer_id)
        if buf is None:
            return
        buf.pins -= 1
        if buf.pins == 0 and buf.freed:
            self._release(buf)

    def _release(self, buf: Buffer) -> None:
        del self._buffers[buf.buffer_id]
        i = bisect.bisect_left(self._starts, buf.offset)
        del self._starts[i]
        del self._by_start[buf.offset]
        length = max(ALIGN, (buf.nbytes + ALIGN - 1) // ALIGN * ALIGN)
        j = bisect.bisect_left(self._free, (buf.offset, 0))
        self._free.insert(j, (buf.offset, length))
        # Coalesce with neighbours.
        if j + 1 < len(self._free) and self._free[j][0] + self._free[j][1] == self._free[j + 1][0]:
            self._free[j] = (self._free[j][0], self._free[j][1] + self._free[j + 1][1])
            del self._free[j + 1]
        if j > 0 and self._free[j - 1][0] + self._free[j - 1][1] == self._free[j][0]:
            self._free[j - 1] = (self._free[j - 1][0], self._free[j - 1][1] + self._free[j][1])
            del self._free[j]

    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)

    def largest_free(self) -> int:
        return max((length for _, length in self._free), default=0)

    # -- descriptors --------------------------------------------------------------

    def describe(self, array: np.ndarray[Any, Any], *, held: Container[int] = ()) -> TensorDesc:
        """Descriptor of an array that views heap memory.

        Raises ``ValueError`` when the array is not on this heap or its buffer was freed,
        unless the buffer id is in ``held``: a run may still use the buffers its args
        pinned at submit after the caller freed them (their memory waits for the run).
        """
        addr = array.__array_interface__["data"][0]
        ptr = addr - self.address
        if not 0 <= ptr < self.size:
            parent = self.parent
            if parent is not None and 0 <= addr - parent.address < parent.size:
                return self._describe_granted(array, addr - parent.address)
            raise ValueError(
                "cannot describe tensor: the array is not on the shared heap; "
                "allocate it with Worker.alloc"
            )
        i = bisect.bisect_right(self._starts, ptr) - 1
        buf = self._by_start.get(self._starts[i]) if i >= 0 else None
        if (
            buf is None
            or (buf.freed and buf.buffer_id not in held)
            or ptr > buf.offset + buf.nbytes
        ):
            raise ValueError(
                f"cannot describe tensor at heap offset {ptr}: no live buffer holds it "
                "(freed, or not allocated with Worker.alloc)"
            )
        desc = TensorDesc(
            buf.buffer_id,
            buf.generation,
            buf.offset,
            ptr - buf.offset,
            buf.nbytes,
            dtype_code(array.dtype),
            tuple(int(d) for d in array.shape),
            tuple(int(s) for s in array.strides),
        )
        lo, hi = desc.byte_range()
        if lo < 0 or hi > buf.nbytes:
            raise ValueError(
                f"cannot describe tensor: its view [{lo}, {hi}) overruns buffer "
                f"{buf.buffer_id} of {buf.nbytes} bytes"
            )
        return desc

    # -- the parent heap (nested L3) ---------------------------------------------

    def grant(self, descs: list[TensorDesc]) -> None:
        """The parent buffers of the task now running (its own-heap descriptors)."""
        self._grants = sorted(
            {
                (d.buffer_offset, d.buffer_nbytes, d.buffer_id, d.generation)
                for d in descs
                if not d.remote and not d.parent
            }
        )

    def revoke(self) -> None:
        """The parent task finished: its buffers may be freed and reused by the parent."""
        self._grants = []

    def _describe_granted(self, array: np.ndarray[Any, Any], ptr: int) -> TensorDesc:
        for offset, nbytes, buffer_id, generation in self._grants:
            if offset <= ptr <= offset + nbytes:
                desc = TensorDesc(
                    buffer_id,
                    generation,
                    offset,
                    ptr - offset,
                    nbytes,
                    dtype_code(array.dtype),
                    tuple(int(d) for d in array.shape),
                    tuple(int(s) for s in array.strides),
                    parent=True,
                )
                lo, hi = desc.byte_range()
                if lo >= 0 and hi <= nbytes:
                    return desc
        raise ValueError(
            f"cannot describe tensor at parent heap offset {ptr}: it is on the parent "
            "Worker's heap but in no buffer of the running task (an L3 orchestration may "
            "forward only the tensors its parent passed to it)"
        )

    def describe_buffer(
        self,
        buffer_id: int,
        *,
        byte_offset: int,
        shape: tuple[int, ...],
        dtype: Any,
        strides: tuple[int, ...] | None = None,
    ) -> TensorDesc:
        """Descriptor for a view given by numbers (the gRPC path); ``ValueError`` if it overruns."""
        buf = self.get(buffer_id)
        dt = np.dtype(dtype)
        if strides is None:
            strides_l = []
            acc = dt.itemsize
            for d in reversed(shape):
                strides_l.append(acc)
                acc *= d
            strides = tuple(reversed(strides_l))
        desc = TensorDesc(
            buf.buffer_id,
            buf.generation,
            buf.offset,
            byte_offset,
            buf.nbytes,
            dtype_code(dt),
            tuple(shape),
            tuple(strides),
        )
        lo, hi = desc.byte_range()
        if byte_offset < 0 or lo < 0 or hi > buf.nbytes:
            raise ValueError(
                f"cannot describe tensor: view [{lo}, {hi}) overruns buffer {buffer_id} "
                f"of {buf.nbytes} bytes"
            )
        return desc

    def view(self, desc: TensorDesc) -> np.ndarray[Any, Any]:
        """Child side: a zero-copy view for a descriptor, bounds-checked against the heap."""
        if desc.remote:
            raise ValueError(
                f"cannot view tensor: buffer {desc.buffer_id} lives on remote worker "
                f"{desc.buffer_offset}, not on this host's shared heap"
            )
        if desc.parent:
            if self.parent is None:
                raise ValueError(
                    f"cannot view tensor: buffer {desc.buffer_id} is on a parent heap, and "
                    "this Worker is not a nested child"
                )
            return self.parent._view_own(desc)
        return self._view_own(desc)

    def _view_own(self, desc: TensorDesc) -> np.ndarray[Any, Any]:
        lo, hi = desc.byte_range()
        start = desc.buffer_offset
        if lo < 0 or hi > desc.buffer_nbytes or start + desc.buffer_nbytes > self.size:
            raise ValueError(
                f"tensor descriptor for buffer {desc.buffer_id} overruns the heap "
                f"([{start + lo}, {start + hi}) of {self.size})"
            )
        return np.ndarray(
            desc.shape,
            dtype=dtype_of(desc.dtype),
            buffer=self.mmap,
            offset=start + desc.byte_offset,
            strides=desc.strides,
        )

    # -- lifecycle ----------------------------------------------------------------

    def _resolve(self, target: int | np.ndarray[Any, Any] | Buffer) -> Buffer:
        if isinstance(target, Buffer):
            return target
        if isinstance(target, np.ndarray):
            return self.get(self.describe(target).buffer_id)
        buf = self._buffers.get(int(target))
        if buf is None:
            raise KeyError(f"cannot free buffer {target}: not allocated")
        return buf

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("cannot use the shared heap: it is closed")

    def close(self) -> None:
        """Unlink a named heap and drop the mapping (views keep it alive until released)."""
        if self.closed:
            return
        self.closed = True
        if self.path is not None and os.getpid() == self.owner_pid:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        del self._base
        try:
            self.mmap.close()
        except BufferError:
            # Arrays handed to the user still view the mapping; it is released
            # when the last of them is collected.
            pass


def _reserve(fd: int, size: int, directory: str) -> None:
    """Back every page of a named heap now: a sparse file would SIGBUS the first process
    that touches a page the file system cannot provide (a full ``/dev/shm``).
    ``StartupError`` saying how much space there is when it cannot."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise StartupError(
                f"cannot create the heap: reserving {size} bytes in {directory} failed: "
                f"{exc.strerror or exc}"
            ) from exc
        try:
            vfs = os.statvfs(directory)
            free = f"{vfs.f_bavail * vfs.f_frsize} bytes free"
        except OSError:
            free = "too little space"
        raise StartupError(
            f"cannot create the heap: {directory} has {free}, the heap needs {size} bytes "
            "(free space there, or lower workers.heap_bytes)"
        ) from exc


def check_shape(shape: Any) -> tuple[int, ...]:
    """A buffer shape as a tuple of ints: at most ``MAX_NDIM`` integer dimensions, each
    non-negative and within the descriptor's i64; ``ValueError``/``TypeError`` naming it."""
    dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
    try:
        shp = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise TypeError(
            f"cannot allocate buffer: shape {shape!r} must be an int or a sequence of ints"
        ) from None
    if len(shp) > MAX_NDIM:
        raise ValueError(
            f"cannot allocate buffer: shape {shp} has {len(shp)} dimensions, "
            f"at most {MAX_NDIM} are allowed"
        )
    for i, d in enumerate(shp):
        if not 0 <= d < 1 << 63:
            raise ValueError(
                f"cannot allocate buffer: shape {shp} dimension {i} is {d}, "
                "it must be non-negative and below 2**63"
            )
    return shp


def sweep_stale_heaps(directory: str = SHM_DIR) -> list[str]:
    """Remove named heaps whose creating process no longer exists."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        m = _NAME_RE.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def heap_name() -> str:
    return f"simpler-heap-{os.getpid()}-{os.urandom(4).hex()}"
