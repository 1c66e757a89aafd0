"""The parent's doorbell: how a child wakes a parked Scheduler.

An eventfd plus a shared page, both created before fork::

    page + 0  parked     i32  1 while the Scheduler sleeps on the eventfd
    page + 8  completed  i32  bumped by every child after it publishes a terminal state

    parent (Scheduler)                         child
    spin: wait for `completed` to move         store terminal state (seq_cst)
      (one word, in C, GIL released)           completed += 1
    parked = 1  (seq_cst store)                if parked: eventfd_write(1)
    re-poll every lane  --- nothing? --->
    await eventfd readable; parked = 0

Because both sides store before they load (Dekker), either the Scheduler's
re-poll sees the state or the child sees ``parked`` and rings: no lost wake-up,
and no syscall on the hot path while the Scheduler is spinning. The
``completed`` word lets a spinning Scheduler watch every lane at once instead
of re-polling each mailbox.
"""

from __future__ import annotations

import functools
import mmap
import os
from collections.abc import Callable

from simpler_daemon.mailbox import _mailbox as _mb

OFF_PARKED = 0
OFF_COMPLETED = 8
# ``_mailbox.child_done`` bumps the count and reads the flag at the same offsets.
assert (OFF_PARKED, OFF_COMPLETED) == (_mb.DOORBELL_OFF_PARKED, _mb.DOORBELL_OFF_COMPLETED)
assert mmap.PAGESIZE >= _mb.DOORBELL_SIZE


class Doorbell:
    __slots__ = ("buf", "closed", "completed", "fd")

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.buf = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_SHARED)
        self.closed = False
        #: ``completed()``: how many terminal publications children have announced
        #: (wraps). A C partial, not a method: the Scheduler reads it several times per
        #: task, and a Python frame per read cost more than the load.
        self.completed: Callable[[], int] = functools.partial(_mb.load32, self.buf, OFF_COMPLETED)

    # parent side
    def park(self) -> None:
        _mb.store32(self.buf, OFF_PARKED, 1)

    def unpark(self) -> None:
        _mb.store32(self.buf, OFF_PARKED, 0)

    def spin(self, seen: int, spins: int) -> bool:
        """Spin in C (GIL released) until ``completed`` moves past ``seen``; False on budget."""
        return _mb.spin_wait(self.buf, (OFF_COMPLETED,), (seen,), spins) >= 0

    def drain(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def ring(self) -> None:
        """Wake the Scheduler unconditionally (submissions from other threads)."""
        os.eventfd_write(self.fd, 1)

    # child side
    def ring_if_parked(self) -> None:
        """Announce a terminal publication; wake the Scheduler only if it sleeps."""
        _mb.fetch_add32(self.buf, OFF_COMPLETED, 1)
        if _mb.load32(self.buf, OFF_PARKED):
            self.ring_parked()

    def ring_parked(self) -> None:
        """The wake-up of ``ring_if_parked`` once ``parked`` was seen set (a child that
        bumps ``completed`` itself calls this)."""
        try:
            os.eventfd_write(self.fd, 1)
        except OSError:  # parent gone or fd closed: nothing to wake
            pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)
            self.buf.close()
