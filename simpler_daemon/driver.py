"""Who runs the Scheduler's rounds: the caller's thread, or one event loop.

::

    unbound (blocking API only)             bound (run_async, start_async, the daemon)
    drive_until(done, timeout):             bind(loop): Scheduler.attach(loop), its
      deferred calls / tasks                  coroutine parks on the doorbell reader
      round(); spin on the doorbell word    watched fds -> loop.add_reader
      park in poll(2): doorbell + watched   deferred calls -> loop.call_soon
      fds (a readable fd runs its callback) deferred tasks -> loop.create_task
    drive(aw): rare coroutines (controls)   drive(aw) from another thread:
      on a private auxiliary loop             run_coroutine_threadsafe on the loop

One owner calls lane progress at a time: the driving thread under ``lock``, or
the bound loop. ``watch(fd, callback)`` / ``unwatch(fd)`` add a readable fd to
whichever wait is active, so a caller (child pidfds, remote sockets) never needs
to know the mode; after a callback the Scheduler takes a round.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import select
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from simpler_daemon.doorbell import Doorbell
from simpler_daemon.scheduler import Scheduler


class Driver:
    """Drives one Scheduler from blocking code, or binds it to one event loop."""

    def __init__(self) -> None:
        #: Held by whoever runs rounds on a thread (and by the facade around submissions).
        self.lock = threading.RLock()
        #: The bound event loop; None while the blocking API drives.
        self.loop: asyncio.AbstractEventLoop | None = None
        self._scheduler: Scheduler | None = None
        self._doorbell: Doorbell | None = None
        self._aux_loop: asyncio.AbstractEventLoop | None = None
        # poll(2) keeps no kernel state: the set is only the fds passed to each call.
        self._poll = select.poll()
        self._watches: dict[int, Callable[[], None]] = {}
        self._soon: list[Callable[[], None]] = []
        self._tasks: list[Callable[[], Awaitable[Any]]] = []
        # Calls handed over by other threads (a session reopened in the background).
        self._foreign: list[Callable[[], None]] = []
        self._foreign_lock = threading.Lock()
        self._stopped = False

    def start(self, scheduler: Scheduler, doorbell: Doorbell) -> None:
        """Drive ``scheduler``; ``doorbell`` is what parked rounds wait on."""
        self._scheduler = scheduler
        self._doorbell = doorbell
        self._poll.register(doorbell.fd, select.POLLIN)

    def stop(self) -> None:
        """Forget every fd (they are about to be closed): nothing is driven any more."""
        self._poll = select.poll()
        self._watches.clear()
        with self._foreign_lock:  # the doorbell's fd is about to be closed (and reused)
            self._stopped = True
            self._foreign.clear()

    def close_aux(self) -> None:
        if self._aux_loop is not None:
            # Join the loop's executor threads too: a thread left behind would make the
            # next fork in this process (a new Worker's init) refuse to run.
            self._aux_loop.run_until_complete(self._aux_loop.shutdown_default_executor())
            self._aux_loop.close()
            self._aux_loop = None

    # -- fd sources ------------------------------------------------------------------------------

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever ``fd`` is readable, then let the Scheduler take a round.

        Level-triggered, like ``loop.add_reader``: the callback must consume the
        readiness or ``unwatch`` the fd. Watching a watched fd replaces its callback.
        Call it (and ``unwatch``) on the driving thread or on the bound loop's thread,
        where the callback runs too: ``loop.add_reader`` is not thread-safe.
        """
        self._watches[fd] = callback
        self._poll.register(fd, select.POLLIN)
        if self.loop is not None:
            self.loop.add_reader(fd, self._fire, fd)

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd`` (a no-op when it is not watched); call before closing it."""
        if self._watches.pop(fd, None) is None:
            return
        with contextlib.suppress(KeyError):
            self._poll.unregister(fd)
        if self.loop is not None:
            self.loop.remove_reader(fd)

    def _fire(self, fd: int) -> None:
        callback = self._watches.get(fd)
        if callback is not None:
            callback()
        if self._scheduler is not None:
            self._scheduler.wake()

    def poll_now(self) -> None:
        """Handle whatever is readable right now, without waiting."""
        if self._foreign:
            self._run_foreign()
        self._handle_poll_events(self._poll.poll(0))

    def _handle_poll_events(self, events: list[tuple[int, int]]) -> None:
        doorbell = self._doorbell
        assert doorbell is not None
        for fd, _ in events:
            if fd == doorbell.fd:
                doorbell.drain()
                continue
            # A callback may unwatch other fds of this batch: look each one up afresh.
            callback = self._watches.get(fd)
            if callback is not None:
                callback()

    # -- deferred work ---------------------------------------------------------------------------

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the bound loop, or before the next unbound round."""
        loop = self.loop
        if loop is not None:
            loop.call_soon(fn)
        else:
            self._soon.append(fn)

    def call_threadsafe(self, fn: Callable[[], None]) -> bool:
        """From any thread: run ``fn`` on the bound loop, or before the next unbound round
        (a parked round is woken through the doorbell). False once the driver stopped:
        ``fn`` will never run."""
        with self._foreign_lock:
            if self._stopped:
                return False
            loop = self.loop
            if loop is None:
                self._foreign.append(fn)
                if self._doorbell is not None:
                    self._doorbell.ring()
                return True
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop closed meanwhile
            return False
        return True

    def _run_foreign(self) -> None:
        with self._foreign_lock:
            calls, self._foreign = self._foreign, []
        for fn in calls:
            fn()

    def start_soon(self, make: Callable[[], Awaitable[Any]]) -> None:
        """Run ``make()`` as a task on the bound loop; unbound, to completion before the
        next round (or ``run_tasks``) on the driving thread."""
        loop = self.loop
        if loop is not None:
            loop.create_task(_as_coro(make()))
        else:
            self._tasks.append(make)

    def run_tasks(self) -> None:
        """Unbound: run every deferred task to completion now."""
        tasks, self._tasks = self._tasks, []
        for make in tasks:
            self.drive(make())

    def _run_soon(self) -> None:
        soon, self._soon = self._soon, []
        for fn in soon:
            fn()

    # -- binding to an event loop ------------------------------------------------------------------

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the Scheduler coroutine on ``loop`` from now on (one loop per Driver)."""
        if self.loop is loop:
            return
        if self.loop is not None:
            raise RuntimeError(
                "cannot use this Worker from another event loop: its Scheduler already runs on "
                "a different one"
            )
        assert self._scheduler is not None
        with self.lock, self._foreign_lock:
            self.loop = loop
            foreign, self._foreign = self._foreign, []
            self._scheduler.attach(loop)
            # After attach: a watched fd the Scheduler also reads (a child pidfd) gets this
            # callback, which does what the Scheduler's would and more.
            for fd in self._watches:
                loop.add_reader(fd, self._fire, fd)
            soon, self._soon = self._soon, []
            tasks, self._tasks = self._tasks, []
        for fn in [*foreign, *soon]:
            loop.call_soon(fn)
        for make in tasks:
            loop.create_task(_as_coro(make()))

    async def unbind(self) -> None:
        """On the bound loop: stop the Scheduler coroutine and release the loop."""
        loop = self.loop
        sched = self._scheduler
        if loop is None or sched is None:
            return
        sched.stop()
        with contextlib.suppress(Exception):
            await sched.wait_stopped()
        sched.detach()
        for fd in self._watches:
            loop.remove_reader(fd)
        self.loop = None

    def bound_elsewhere(self) -> asyncio.AbstractEventLoop | None:
        """The bound loop when called from outside it; raises when called from inside it."""
        loop = self.loop
        if loop is None:
            return None
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError(
                "cannot call a blocking Worker method from its own event loop; use the *_async form"
            )
        if not loop.is_running():
            raise RuntimeError("cannot block on this Worker: its event loop is not running")
        return loop

    # -- blocking ----------------------------------------------------------------------------------

    def drive(self, aw: Awaitable[Any]) -> Any:
        """Run a rare coroutine (controls, close) to completion from blocking code."""
        try:
            loop = self.bound_elsewhere()
        except RuntimeError:
            if inspect.iscoroutine(aw):
                aw.close()
            raise
        if loop is not None:
            return asyncio.run_coroutine_threadsafe(_as_coro(aw), loop).result()
        with self.lock:
            if self._aux_loop is None:
                self._aux_loop = asyncio.new_event_loop()
            return self._aux_loop.run_until_complete(aw)

    def drive_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """Unbound mode: run Scheduler rounds on this thread until ``done()`` or the timeout."""
        sched = self._scheduler
        doorbell = self._doorbell
        assert sched is not None and doorbell is not None
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_s = sched.spin_budget()
        spin_until = now + spin_s
        with self.lock:
            while True:
                if self._foreign:
                    self._run_foreign()
                if self._soon:
                    self._run_soon()
                if self._tasks:
                    self.run_tasks()
                seen = doorbell.completed()
                progressed = sched.round()
                if done():
                    return True
                now = time.monotonic()
                if progressed:
                    spin_s = sched.spin_budget()
                    spin_until = now + spin_s
                # A round dispatches all it can and drains every completion that was
                # published before `seen` was read: until the word moves again, another
                # round would find nothing.
                if doorbell.completed() != seen:
                    continue
                if deadline is not None and now >= deadline:
                    return False
                if now < spin_until:
                    if sched.socket_busy():
                        # A remote reply shows on a socket, not on the word: look without
                        # sleeping (poll(2) with no timeout releases the GIL), so its
                        # arrival costs no wake-up of a parked thread.
                        events = self._poll.poll(0)
                        if events:
                            self._handle_poll_events(events)
                        continue
                    # Watch the one word every child bumps, in C, not each mailbox.
                    doorbell.spin(seen, 2048)
                    continue
                doorbell.park()
                # Dekker: a child that finished after `seen` either bumped the word
                # before we parked (seen here) or sees `parked` and rings the eventfd.
                if doorbell.completed() != seen:
                    doorbell.unpark()
                    continue
                wait_s = 0.01 if sched.busy() else 0.25
                if deadline is not None:
                    wait_s = max(0.0, min(wait_s, deadline - now))
                sched.stats["parks"] += 1
                events = self._poll.poll(int(wait_s * 1000) + 1)
                doorbell.unpark()
                self._handle_poll_events(events)
                spin_until = time.monotonic() + spin_s


async def _as_coro(aw: Awaitable[Any]) -> Any:
    return await aw
