"""A SUB task's return value past the task frame: written by the child, read by the parent.

A return value of at most ``MAX_RESULT_BYTES`` encoded travels in the frame's args area
(``reserved`` holds its length). A larger one, up to the Worker's ``max_result_bytes``,
goes into a sealed memfd of the child: the args area carries the descriptor's number
and ``reserved`` the length with ``LARGE_RESULT`` set (so the C SUB pump, which only
completes results of at most ``MAX_RESULT_BYTES``, leaves it to the Python path). The
parent opens the memfd through ``/proc/<child>/fd/<n>``, copies the bytes and closes
it; the child closes its descriptor once the frame left TASK_DONE (the parent has read
it), or when it exits. The kernel frees a memfd with its last descriptor, so a child
SIGKILLed while holding a large result leaks nothing: no ``/dev/shm`` file, no heap
range, no buffer a run would have to free.

The memfd, not the shared heap: the heap's allocator lives in the parent, and a child
that had to ask it for room would hold its lane for a round trip per result.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
from typing import Any, Final

from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.layout import OFF_ARGS

#: Set in ``reserved`` at completion: the result is in a memfd, the low bits its length.
LARGE_RESULT: Final = 1 << 62
_FD = struct.Struct("<Q")
_SEALS: Final = (
    getattr(fcntl, "F_SEAL_WRITE", 8)
    | getattr(fcntl, "F_SEAL_GROW", 4)
    | getattr(fcntl, "F_SEAL_SHRINK", 2)
    | getattr(fcntl, "F_SEAL_SEAL", 1)
)
_ADD_SEALS: Final = getattr(fcntl, "F_ADD_SEALS", 1033)


def write_large(data: bytes) -> int:
    """A sealed memfd holding ``data``; the caller keeps the descriptor until the parent
    read it. ``OSError`` when the kernel refuses (no memory, no memfd)."""
    fd = os.memfd_create("simpler-result", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        fcntl.fcntl(fd, _ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def pack_fd(fd: int) -> bytes:
    return _FD.pack(fd)


def read_large(endpoint: Any, frame_off: int, word: int) -> bytes:
    """The large result a completed frame of ``endpoint`` (a ``LocalMailboxEndpoint``)
    announces: ``word`` is its ``reserved`` word (``LARGE_RESULT`` set). ``OSError``
    when the memfd is gone, ``ValueError`` when the child named something else."""
    child = endpoint.child
    if child is None:
        raise OSError("the child is gone")
    size = word & ~LARGE_RESULT
    if size > endpoint.max_result_bytes:
        raise ValueError(
            f"the child announced {size} bytes, more than max_result_bytes "
            f"({endpoint.max_result_bytes})"
        )
    fd = int(_FD.unpack(_mb.read_bytes(endpoint.buf, frame_off + OFF_ARGS, _FD.size))[0])
    return read_memfd(child.pid, fd, size)


def large_result_error(slot: Any, d: Any, word: int, endpoint: Any, exc: BaseException) -> str:
    """The TASK_FAILURE text of a large result the parent could not read."""
    member = f" member {d.group_index}" if slot.group_size > 1 else ""
    return (
        f"cannot return the result of task {slot.index}{member} ({slot.handle.name}): its "
        f"{word & ~LARGE_RESULT} bytes could not be read from {endpoint.who()}: {exc}"
    )


def read_memfd(pid: int, fd: int, size: int) -> bytes:
    """The ``size`` bytes of memfd ``fd`` of process ``pid``. ``OSError`` when it is
    gone, ``ValueError`` when it is not a regular file of at least ``size`` bytes (a
    child naming some other descriptor)."""
    own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(own)
        if not stat.S_ISREG(st.st_mode) or st.st_size < size:
            raise ValueError(
                f"descriptor {fd} of pid {pid} is not a result memfd of {size} bytes "
                f"(mode {st.st_mode:o}, {st.st_size} bytes)"
            )
        data = os.pread(own, size, 0)  # one read for a memfd; a short one is continued
        if len(data) < size:
            parts = [data]
            got = len(data)
            while got < size:
                more = os.pread(own, size - got, got)
                if not more:
                    raise ValueError(f"result memfd of pid {pid} ended at {got} of {size} bytes")
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        return data
    finally:
        os.close(own)
