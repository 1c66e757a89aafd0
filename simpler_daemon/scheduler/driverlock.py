"""``DriverLock``: the lock a Worker's callers and its background driver thread share.

Every thread that takes it through ``acquire`` / ``with`` is a *caller* (a blocking
call of the Worker), counted before it waits so the background thread stays away; a
caller waiting for its run hands it over to a thread that wants it between two rounds
(``driver.py`` draws the whole protocol). Split from ``driver.py``, which drives.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from simpler_daemon.scheduler.driver import Driver


class DriverLock:
    """``Driver.lock``: re-entrant, held by whoever runs rounds on a thread.

    Every thread that takes it through ``acquire`` / ``with`` is a *caller* (a blocking
    call of the Worker): counted before it waits, so the background thread stays away,
    and a background thread in its rounds is woken (doorbell) to let go. The background
    thread itself takes it with ``take_background``, uncounted.
    """

    __slots__ = ("_depth", "_driver", "_lock", "_owner", "_wanting")

    def __init__(self, driver: Driver) -> None:
        self._driver = driver
        self._lock = threading.RLock()
        self._owner: int | None = None
        self._depth = 0
        #: One entry per thread blocked in ``acquire`` (the lock was taken): a caller
        #: that drives while waiting for a run hands the lock over to it between rounds.
        self._wanting: list[None] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        if self._owner == me:
            self._lock.acquire()
            self._depth += 1
            return True
        driver = self._driver
        driver._callers.append(None)  # atomic: no lock on the hot path
        try:
            # Uncontended (one thread): the lock is free and nobody is told anything.
            got = self._lock.acquire(blocking=False)
            if not got and blocking:
                wanting = self._wanting
                wanting.append(None)  # before the look at who drives (see Driver.rounds)
                try:
                    if driver._bg_driving or driver._waiter_driving:
                        # Wake the parked round of whoever drives: it lets go.
                        driver._wake_background()
                    got = self._lock.acquire(True, timeout)
                finally:
                    wanting.pop()
        except BaseException:  # Ctrl-C while waiting: not a caller any more
            driver._caller_leaves()
            raise
        if not got:
            driver._caller_leaves()
            return False
        self._owner = me
        self._depth = 1
        return True

    def held_here(self) -> bool:
        """True when this thread holds the lock (a nested call)."""
        return self._owner == threading.get_ident()

    def hand_over(self) -> None:
        """The owner at depth 1 lets go for a thread that wants the lock, and stays a
        caller (the background thread keeps away): ``try_take`` takes it back."""
        self._depth = 0
        self._owner = None
        self._lock.release()

    def try_take(self) -> bool:
        """After ``hand_over``: take the lock back when it is free right now."""
        if not self._lock.acquire(blocking=False):
            return False
        self._owner = threading.get_ident()
        self._depth = 1
        return True

    __enter__ = acquire

    def release(self, *_: object) -> None:
        depth = self._depth - 1
        self._depth = depth
        if depth:
            self._lock.release()
            return
        self._owner = None  # before the release: the next owner sets its own
        self._lock.release()
        driver = self._driver
        driver._caller_leaves()
        if driver._sleepers:
            driver._wake_sleepers()  # a waiter that handed the lock over drives again

    __exit__ = release

    def take_background(self) -> bool:
        """The background thread: take the lock only when it is free right now."""
        if not self._lock.acquire(blocking=False):
            return False
        self._owner = threading.get_ident()
        self._depth = 1
        return True

    def release_background(self) -> None:
        self._depth = 0
        self._owner = None
        self._lock.release()
        if self._driver._sleepers:
            self._driver._wake_sleepers()
