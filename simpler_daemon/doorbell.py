"""The parent's doorbell: how a child wakes a parked Scheduler.

An eventfd plus one shared word, both created before fork::

    parent (Scheduler)                         child
    parked = 1  (seq_cst store)                store terminal state (seq_cst)
    re-poll every lane  --- nothing? --->      if parked: eventfd_write(1)
    await eventfd readable; parked = 0

Because both sides store before they load (Dekker), either the Scheduler's
re-poll sees the state or the child sees ``parked`` and rings: no lost wake-up,
and no syscall on the hot path while the Scheduler is spinning.
"""

from __future__ import annotations

import mmap
import os

from simpler_daemon import _mailbox as _mb


class Doorbell:
    __slots__ = ("buf", "closed", "fd")

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.buf = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_SHARED)
        self.closed = False

    # parent side
    def park(self) -> None:
        _mb.store32(self.buf, 0, 1)

    def unpark(self) -> None:
        _mb.store32(self.buf, 0, 0)

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
        if _mb.load32(self.buf, 0):
            try:
                os.eventfd_write(self.fd, 1)
            except OSError:  # parent gone or fd closed: nothing to wake
                pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)
            self.buf.close()
