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
    tasks left on the auxiliary loop: every
      round steps it (``_step_aux``)

One owner calls lane progress at a time: the driving thread under ``lock``, or
the bound loop.

**Tasks a blocking call leaves behind** (a registration control queued behind a busy
child's task, ``engine/delivery.py``) stay on the auxiliary loop after ``drive``
returned: while any is left (``aux_pending``), every round of whoever drives (a
waiting caller, the background thread) first runs the loop's ready callbacks once,
without blocking, and a parked round wakes at least every ``AUX_POLL_S`` for their
timers; such tasks count as work for the background thread like an unfinished run,
so they progress when nobody calls the Worker. ``keeps_tasks(loop)`` tells a
coroutine whether its loop goes on after it returned. ``bind`` first finishes them
(the bound loop cannot step another loop); ``close_aux`` cancels what is left (the
auxiliary loop's part of the Driver is ``auxloop.py``).

``watch(fd, callback)`` / ``unwatch(fd)`` add a readable fd to whichever wait is
active, so a caller (child pidfds, remote sockets) never needs to know the mode;
after a callback the Scheduler takes a round.

**The background driver** (unbound only): runs progress with nobody waiting on them.
``lock`` is a ``DriverLock``: every thread that takes it (a blocking Worker call) is a
*caller*, and the background thread only drives while no caller holds or wants it::

    last caller lets go, a run unfinished -> start the thread (or let it know)
    thread: TAKEOVER_S without a caller -> take the lock, rounds until a caller
            comes (it rings the doorbell: a parked round wakes) or no run is left
    no run for LINGER_S, close, bind, retire_background_threads -> the thread exits

A caller that submits and then waits at once never meets the thread on its hot path,
and ``Worker.run`` holds the lock from its submit to its end, so it starts nothing.

**Waiting callers share** (``drive_until``, ``Worker.run``): a caller that waits for a
run drives while nobody else needs the lock. A thread that wants it (a submit, a cancel,
another waiter) joins ``DriverLock._wanting`` and rings the doorbell as for the
background thread; the waiter lets go between two rounds (``hand_over``), stays a
caller, and sleeps until its run ends or the lock is free (``_sleep_while_driven``).
One thread alone never takes that path: its acquire finds the lock free. A wait from
inside a round (a done callback) raises instead of hanging (``check_may_wait``).
Forks need one thread: ``retire_background_threads`` (each Worker's ``init``) ends
the idle threads of every Driver in the process and refuses while one still drives
another Worker's runs; ``stop`` (close) joins this Driver's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import select
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Final

from simpler_daemon.errors import StartupError, WorkerClosedError, WorkerStateError
from simpler_daemon.mailbox.doorbell import Doorbell
from simpler_daemon.scheduler.auxloop import AuxLoop
from simpler_daemon.scheduler.dispatch import Scheduler
from simpler_daemon.scheduler.driverlock import DriverLock

log = logging.getLogger("simpler_daemon.driver")

#: A run waits this long with nobody driving before the background thread takes it
#: over, so a caller that submits and then waits at once never races with the thread.
TAKEOVER_S: Final = 0.002
#: An idle background thread stays this long for the next run, then exits: starting a
#: thread costs more than a whole run, and submit-then-wait loops would pay it each time.
LINGER_S: Final = 0.05
#: The longest the background thread naps while a caller drives (it doubles from
#: TAKEOVER_S while no caller comes or goes; a caller leaving work behind wakes it).
MAX_NAP_S: Final = 0.1

#: Pause instructions per look at the doorbell word while spinning (a few µs), between
#: two ``sched_yield`` calls.
SPIN_CHUNK: Final = 64

#: A blocking submit polls the watched fds at most this often (``before_submit``).
SUBMIT_POLL_S: Final = 0.001

#: A waiter that handed the lock over looks again at least this often (its run's end
#: and a released lock also wake it at once): a lost wake-up costs this much, no more.
SLEEPER_CHECK_S: Final = 0.05

#: While tasks are left on the auxiliary loop, a parked round waits at most this long,
#: so their timers (a control's poll, at most 5 ms apart) fire about on time.
AUX_POLL_S: Final = 0.005

#: The Drivers that started a background thread (``retire_background_threads``).
_DRIVERS: weakref.WeakSet[Driver] = weakref.WeakSet()


def retire_background_threads(what: str) -> None:
    """Before forking: end the idle background driver threads of this process.

    Raises ``StartupError`` when one still drives a Worker's unfinished runs: a fork
    with a second thread running is refused, and those runs may take any time.
    """
    busy = [d for d in list(_DRIVERS) if not d.retire_background()]
    if busy:
        runs = sum(d.unfinished_runs for d in busy)
        raise StartupError(
            f"cannot {what}: another Worker of this process has {runs} unfinished run(s) "
            "progressing on its background driver thread (or registration controls queued "
            "behind a busy child), and children are forked only while the process runs "
            "one thread; wait for those runs (or close that Worker) first"
        )


class Driver(AuxLoop):
    """Drives one Scheduler from blocking code, or binds it to one event loop (the
    auxiliary loop of the blocking API's coroutines: ``auxloop.py``)."""

    def __init__(self) -> None:
        super().__init__()
        #: Held by whoever runs rounds on a thread (and by the facade around submissions).
        self.lock = DriverLock(self)
        #: How many runs are not terminal (kept by the RunBuilder): the background
        #: thread drives while this is not 0.
        self.unfinished_runs = 0
        # The background thread's state, all under _cond: callers counted by DriverLock,
        # when the last one left and how often one did (activity keeps naps short).
        self._cond = threading.Condition(threading.Lock())
        #: One entry per caller thread holding or waiting for ``lock`` (list append and
        #: pop are atomic, so counting costs the hot path no lock).
        self._callers: list[None] = []
        self._left_at = 0.0
        self._epoch = 0
        self._thread: threading.Thread | None = None
        self._exited: list[threading.Thread] = []
        self._napping_long = False
        self._bg_driving = False
        #: A caller drives rounds while it waits for a run: a thread that wants the lock
        #: rings the doorbell, and the waiter hands the lock over (``drive_until``).
        self._waiter_driving = False
        #: Waiters that handed the lock over and sleep on ``_sleep`` until their run
        #: ends or the lock is free again.
        self._sleepers = 0
        self._sleep = threading.Condition(threading.Lock())
        self._retire = False
        #: The bound event loop; None while the blocking API drives.
        self.loop: asyncio.AbstractEventLoop | None = None
        self._scheduler: Scheduler | None = None
        self._doorbell: Doorbell | None = None
        # poll(2) keeps no kernel state: the set is only the fds passed to each call.
        self._poll = select.poll()
        self._watches: dict[int, Callable[[], None]] = {}
        self._soon: list[Callable[[], None]] = []
        self._poll_due = 0.0  # when ``before_submit`` polls next (``time.monotonic()``)
        self._tasks: list[Callable[[], Awaitable[Any]]] = []
        # Calls handed over by other threads (a session reopened in the background).
        self._foreign: list[Callable[[], None]] = []
        self._foreign_lock = threading.Lock()
        self._stopped = False
        #: Called (holding ``lock``) once ``fall_back`` let a dead loop go (RunBuilder).
        self.on_fall_back: Callable[[], None] | None = None

    def start(self, scheduler: Scheduler, doorbell: Doorbell) -> None:
        """Drive ``scheduler``; ``doorbell`` is what parked rounds wait on."""
        self._scheduler = scheduler
        self._doorbell = doorbell
        self._poll.register(doorbell.fd, select.POLLIN)

    def stop(self) -> None:
        """Forget every fd (they are about to be closed): nothing is driven any more.
        The background thread, if any, exits and is joined."""
        self._poll = select.poll()
        self._watches.clear()
        with self._foreign_lock:  # the doorbell's fd is about to be closed (and reused)
            self._stopped = True
            self._foreign.clear()
        self._join_background()

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

    def before_submit(self) -> None:
        """A blocking submit: the deferred tasks, then ``poll_now`` (a child that died while
        idle) at most every ``SUBMIT_POLL_S``: the rounds of a run watch the same fds."""
        if self._tasks:
            self.run_tasks()
        now = time.monotonic()
        if now >= self._poll_due or self._foreign:
            self._poll_due = now + SUBMIT_POLL_S
            self.poll_now()

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
        """Run the Scheduler coroutine on ``loop`` from now on (one loop at a time: a
        loop that ended for good is let go first, see ``fall_back``)."""
        if self.loop is loop:
            return
        if self.loop is not None and not self.fall_back():
            raise WorkerStateError(
                "cannot use this Worker from another event loop: its Scheduler already runs on "
                "a different one"
            )
        assert self._scheduler is not None
        with self.lock:
            self._finish_aux()
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
        self._join_background()  # the loop drives from now on

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
            if self.fall_back():
                return None  # that loop ended: the blocking driver drives from now on
            raise WorkerStateError(
                "cannot block on this Worker: its event loop is stopped, its Scheduler "
                "coroutine still pending there; run the loop again or close it"
            )
        return loop

    def fall_back(self) -> bool:
        """From outside the bound loop: when it ended for good (closed, or stopped with
        the Scheduler's coroutine done, as ``asyncio.run`` leaves it), let it go and
        drive with the blocking driver again (``on_fall_back`` re-defers its builds);
        True then, or when nothing is bound."""
        sched = self._scheduler
        if self.loop is None:
            return True
        if sched is None or not sched.loop_gone():
            return False
        with self.lock:
            if self.loop is None:
                return True
            sched.forget_loop()
            with self._foreign_lock:
                self.loop = None
            if self.on_fall_back is not None:
                self.on_fall_back()
        log.info("the event loop this Worker was bound to ended; blocking driver from now on")
        return True

    # -- the background thread ---------------------------------------------------------------------

    def _has_work(self) -> bool:
        """Runs are unfinished or tasks are left on the auxiliary loop."""
        return bool(self.unfinished_runs) or self.aux_pending

    def _may_drive(self) -> bool:
        return (
            not self._stopped
            and not self._retire
            and self.loop is None
            and self._scheduler is not None
        )

    def _wake_background(self) -> None:
        """A caller wants the lock: wake the background thread's parked round, so it
        sees the caller and lets go."""
        doorbell = self._doorbell
        if doorbell is not None and not doorbell.closed:
            with contextlib.suppress(OSError):  # closed meanwhile: nothing to wake
                doorbell.ring()

    def _caller_leaves(self) -> None:
        callers = self._callers
        callers.pop()
        if self._thread is not None:
            # Plain stores: the thread only needs to see that callers come and go.
            self._left_at = time.monotonic()
            self._epoch += 1
        if callers or not (self.unfinished_runs or self.aux_pending):
            return  # Worker.run's path: its run is over, nothing to hand on
        with self._cond:
            self._left_at = time.monotonic()
            if self._callers or not self._may_drive():
                return
            if self._thread is None:
                self._start_background()
            elif self._napping_long:
                self._cond.notify()

    def _start_background(self) -> None:
        """Under ``_cond``: start the background thread (its first step waits for it)."""
        self._exited = [t for t in self._exited if t.is_alive()]
        # A daemon thread: a run nobody waits for must not hold the interpreter's exit
        # (the Worker's children die with the process).
        thread = threading.Thread(target=self._background, name="simpler-driver", daemon=True)
        self._thread = thread
        _DRIVERS.add(self)
        thread.start()

    def _background(self) -> None:
        """The background thread: take over while runs are unfinished and no caller drives."""
        me = threading.current_thread()
        lock = self.lock
        try:
            while self._wait_for_turn():
                if not lock.take_background():
                    continue  # a caller took it meanwhile: it is counted, wait for it
                self._bg_driving = True
                try:
                    if not self._callers and self._has_work():
                        self.rounds(self._background_done, None)
                except BaseException:
                    # A round failed with nobody to raise it to: fail the runs (still
                    # holding the lock), as the bound loop's coroutine does, rather than
                    # leave them waiting forever.
                    log.exception("background driver crashed; failing every unfinished run")
                    if self._scheduler is not None:
                        with contextlib.suppress(Exception):
                            self._scheduler.fail_all("scheduler crashed on the background driver")
                    return
                finally:
                    self._bg_driving = False
                    lock.release_background()
        finally:
            with self._cond:
                if self._thread is me:
                    self._thread = None
                self._exited.append(me)

    def _background_done(self) -> bool:
        return bool(self._callers) or not self._has_work() or not self._may_drive()

    def _wait_for_turn(self) -> bool:
        """Nap until the thread should drive (True) or exit (False).

        It drives once no caller came or left for TAKEOVER_S while runs are unfinished;
        it exits once no run was left for LINGER_S, or the Driver stops or binds.
        """
        cond = self._cond
        nap = TAKEOVER_S
        epoch = -1
        with cond:
            while True:
                if not self._may_drive():
                    return False
                work = self._has_work()
                quiet = time.monotonic() - self._left_at
                if not self._callers:
                    if work and quiet >= TAKEOVER_S:
                        return True
                    if not work and quiet >= LINGER_S:
                        return False
                if epoch != self._epoch:  # callers come and go: stay close
                    epoch = self._epoch
                    nap = TAKEOVER_S
                else:
                    nap = min(nap * 2, MAX_NAP_S)
                if not self._callers:
                    wait_s = TAKEOVER_S if work else min(nap, LINGER_S - quiet)
                else:
                    wait_s = nap
                self._napping_long = wait_s > TAKEOVER_S
                cond.wait(wait_s)
                self._napping_long = False

    def retire_background(self) -> bool:
        """End the background thread unless it has runs to drive (False then)."""
        with self._cond:
            thread = self._thread
            if thread is not None and thread.is_alive() and self._has_work():
                return False
            self._retire = True
            self._cond.notify_all()
        try:
            self._join_background()
        finally:
            with self._cond:
                self._retire = False
        return True

    def _join_background(self) -> None:
        """Wake the background thread to see that it must exit, and join it (it never
        needs ``lock`` to exit, so a caller holding it may join)."""
        me = threading.current_thread()
        with self._cond:
            self._cond.notify_all()
            threads = [t for t in (self._thread, *self._exited) if t is not None]
        if self._bg_driving and self._doorbell is not None and not self._doorbell.closed:
            with contextlib.suppress(OSError):
                self._doorbell.ring()  # a parked round of the thread: wake it to see it
        for thread in threads:
            if thread is not me:
                thread.join()
        with self._cond:
            self._exited = [t for t in self._exited if t.is_alive()]

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
            if self._stopped:  # closed while this thread waited for the lock
                if inspect.iscoroutine(aw):
                    aw.close()
                raise WorkerClosedError("cannot finish the call: the worker closed meanwhile")
            if self._aux_loop is None:
                self._aux_loop = asyncio.new_event_loop()
            loop = self._aux_loop
            try:
                return loop.run_until_complete(aw)
            finally:
                self.aux_pending = bool(asyncio.all_tasks(loop))

    def drive_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """Unbound mode: wait until ``done()`` or the timeout, running Scheduler rounds on
        this thread while nobody else needs the lock.

        Waiting never blocks another thread: one that wants the lock (a submit, a
        cancel, another waiter) gets it between two rounds, and this one sleeps until
        ``done()`` or until the lock is free again, then drives on."""
        deadline = None if timeout is None else time.monotonic() + timeout
        lock = self.lock
        if lock.held_here():  # nested in a call that holds it: it cannot be handed over
            with lock:
                return bool(self.rounds(done, deadline))
        lock.acquire()
        holding = True
        try:
            while True:
                finished = self.rounds(done, deadline, handover=True)
                if finished is not None:
                    return finished
                lock.hand_over()
                holding = False
                finished = self._sleep_while_driven(done, deadline)
                if finished is not None:
                    return finished
                holding = True
        finally:
            if holding:
                lock.release()
            else:
                self._caller_leaves()  # still counted as a caller: leave that too
                if self._sleepers:
                    self._wake_sleepers()

    def _sleep_while_driven(self, done: Callable[[], bool], deadline: float | None) -> bool | None:
        """After ``hand_over``: sleep until ``done()`` (True), the deadline (False), or the
        lock is free again (None: taken back, drive on)."""
        cond = self._sleep
        lock = self.lock
        with cond:
            self._sleepers += 1
            try:
                while True:
                    if done():
                        return True
                    # Bound meanwhile (``bind`` took the lock): the loop drives, just wait.
                    if self.loop is None and lock.try_take():
                        return None
                    wait_s = SLEEPER_CHECK_S
                    if deadline is not None:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return False
                        wait_s = min(wait_s, left)
                    cond.wait(wait_s)
            finally:
                self._sleepers -= 1

    def _wake_sleepers(self) -> None:
        with self._sleep:
            self._sleep.notify_all()

    def rounds(
        self, done: Callable[[], bool], deadline: float | None = None, *, handover: bool = False
    ) -> bool | None:
        """Rounds until ``done()`` (True) or the deadline (False, a ``time.monotonic()``
        value); the caller holds ``lock``. With ``handover`` (a caller waiting for its
        run, holding ``lock`` once), None as soon as another thread wants ``lock``: the
        caller hands it over.

        Raises ``RuntimeError`` when called from inside a round (a done callback that
        waits for a run): the round that would finish that run is the one it stopped."""
        sched = self._scheduler
        doorbell = self._doorbell
        assert sched is not None and doorbell is not None
        if self._stopped:  # closed by another thread meanwhile: the heap is gone
            if done():
                return True  # its runs ended in that close (drained, or RunClosedError)
            raise WorkerClosedError("cannot wait: the worker was closed meanwhile")
        if sched.in_round:  # ``check_may_wait``'s first test, inline (once per run)
            self.check_may_wait()
        if not handover:
            return self._rounds(sched, doorbell, done, deadline, None)
        lock = self.lock
        if lock._depth != 1:
            return self._rounds(sched, doorbell, done, deadline, None)
        was, self._waiter_driving = self._waiter_driving, True
        try:
            return self._rounds(sched, doorbell, done, deadline, lock._wanting)
        finally:
            self._waiter_driving = was

    def check_may_wait(self) -> None:
        """Raise ``RuntimeError`` when this thread is inside a Scheduler round (a done
        callback, a task-event listener): a wait there could never end, because the run
        it waits for finishes only in a later round, after the callback returned."""
        sched = self._scheduler
        if sched is not None and sched.in_round and self.lock.held_here():
            raise RuntimeError(
                "cannot wait for a run inside a done callback of this Worker (or other code "
                "its Scheduler calls during a round): it runs on the thread that drives the "
                "Worker, so the run could only finish after the callback returned; submit "
                "instead and use add_done_callback"
            )

    def _rounds(
        self,
        sched: Scheduler,
        doorbell: Doorbell,
        done: Callable[[], bool],
        deadline: float | None,
        wanting: list[None] | None,
    ) -> bool | None:
        now = time.monotonic()
        gate = sched.spin_gate  # ``sched.spin_budget()``, without its frame
        spin_s = gate.budget(now)
        spin_until = now + spin_s
        while True:
            # Dekker with DriverLock.acquire: it joins ``wanting`` and then looks at
            # ``_waiter_driving`` (set before this loop); one of the two sees the other.
            if wanting:
                return None
            if self._foreign:
                self._run_foreign()
            if self._soon:
                self._run_soon()
            if self._tasks:
                self.run_tasks()
            if self.aux_pending:
                self._step_aux()
            seen = doorbell.completed()
            progressed = sched.round()
            if progressed and self._sleepers:
                self._wake_sleepers()  # a run of a waiter that handed over may be done
            if done():
                return True
            now = time.monotonic()
            if progressed:
                spin_s = gate.budget(now)
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
                # Watch the one word every child bumps, in C, not each mailbox, in short
                # spins with a yield between them: a child woken onto this core (it was
                # parked, e.g. after an idle gap) runs at once instead of after the
                # whole spin, which it otherwise waited out (measured: 200+ µs per run).
                while not doorbell.spin(seen, SPIN_CHUNK):
                    os.sched_yield()
                    if wanting or self._foreign or time.monotonic() >= spin_until:
                        break
                continue
            doorbell.park()
            # Dekker: a child that finished after `seen` either bumped the word
            # before we parked (seen here) or sees `parked` and rings the eventfd.
            if doorbell.completed() != seen:
                doorbell.unpark()
                continue
            wait_s = 0.01 if sched.busy() else 0.25
            if self.aux_pending:
                wait_s = min(wait_s, AUX_POLL_S)
            if deadline is not None:
                wait_s = max(0.0, min(wait_s, deadline - now))
            sched.note_park()
            events = self._poll.poll(int(wait_s * 1000) + 1)
            doorbell.unpark()
            self._handle_poll_events(events)
            spin_until = time.monotonic() + spin_s


async def _as_coro(aw: Awaitable[Any]) -> Any:
    return await aw
