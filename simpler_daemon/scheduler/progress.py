"""The Scheduler's progress coroutine, its wake-ups, and dead-lane detection.

Wake-ups: while lanes are busy the coroutine watches the doorbell word in C,
without the GIL, in slices of ``ASYNC_SPIN_SLICE_S`` with one loop turn
(``sleep(0)``) between them, so a submitter on the loop gets in without the
spin going through a loop turn per look; after ``spin_s`` without progress it
parks on the doorbell eventfd, which children ring after a terminal state (only
while parked) and submitters ring from other threads. Nothing sleeps on the
dispatch path and nothing burns a core while idle.

A child's exit is observed through its pidfd: its endpoint is poisoned at once
(an idle dead lane is never dispatched to) and the lane is reported dead once
its frames are all terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Final

from simpler_daemon.endpoints.base import Outcome
from simpler_daemon.scheduler.completion import RunCompletion
from simpler_daemon.scheduler.runmodel import FailureInfo
from simpler_daemon.scheduler.subpump import PUMP_MIN_HIT_RATE

if TYPE_CHECKING:
    from simpler_daemon.scheduler.runmodel import Run
    from simpler_daemon.scheduler.subpump import SubPump

log = logging.getLogger("simpler_daemon.scheduler")

#: While lanes are busy, the coroutine watches the doorbell word in C for at most this
#: long between two turns of its event loop (what else runs on the loop waits so long).
ASYNC_SPIN_SLICE_S: Final = 0.00005
#: Pause instructions per look at the doorbell word (a few µs), between two
#: ``sched_yield`` calls (as the blocking driver's ``SPIN_CHUNK``).
ASYNC_SPIN_CHUNK: Final = 64
#: A parked coroutine with tasks in flight runs a round after this long (s) even
#: without a wake-up: what rings no doorbell (a task deadline that passes, a lane
#: that is polled) is seen within it.
BUSY_PARK_S: Final = 0.01


def _resolve(wake: asyncio.Future[None]) -> None:
    """The park's timer: wake the coroutine unless something did already."""
    if not wake.done():
        wake.set_result(None)


class ProgressLoop(RunCompletion):
    """Runs Scheduler rounds on a bound loop: spin briefly, then park on the doorbell."""

    _pump: SubPump

    def round(self) -> bool:  # pragma: no cover - the Scheduler defines it
        """Progress, drain, dispatch. True when anything happened."""
        raise NotImplementedError

    def settle(self, run: Run) -> bool:
        """A caller on the bound loop is about to wait for ``run``: run the round that
        waits for its tasks now, in the caller's turn, instead of on the progress
        coroutine's next one. True when the run is terminal after it.

        Only for a run alone in the Scheduler (no other run admitted, waiting or
        detached: the round's spin holds up no other run's work) whose orchestration
        returned, with nothing queued and every task in flight on the pump's lanes,
        while the pump's spins catch their tasks (``PUMP_MIN_HIT_RATE``: a run of long
        tasks is left to the coroutine, which parks). A one-task run then ends inside
        the call that submitted it: its answer needs no future, no loop turn, no park
        and wake-up (the daemon's waiting SubmitRun, ``RunHandle.wait_async``)."""
        if run.terminal:
            return True
        admission = self.admission
        if (
            self.in_round
            or run.building
            or admission.head is not run
            or admission.successor is not None
            or admission.waiting
            or admission.detached
            or self._pump.hit_rate < PUMP_MIN_HIT_RATE
            or self.subs.get(run.run_id)
        ):
            return False
        pump = self._pump
        inflight = False
        for lane in self._lanes:
            if lane.inflight:
                if not pump.owns(lane):
                    return False
                inflight = True
        if not inflight:
            return False
        try:
            self.round()
        except Exception:  # into the waiter's call (a handler's reply): leave it to run()
            log.exception("a round for a waiter (settle) failed; the progress loop goes on")
            return False
        if not run.terminal:
            return False
        self.stats["settled"] += 1
        if not self._suspect and self.quiet():
            # What the submit poked the coroutine for is done: when it wakes, it parks
            # again without a round (``run``).
            self._poked = False
        return True

    def spin_budget(self) -> float:
        """How long to spin before parking: ``spin_s`` while tasks finish quickly, 0 when
        they typically run longer than that (spinning would only steal a core from them),
        except for an occasional probe that finds out when they are quick again
        (spingate.py)."""
        return self.spin_gate.budget(time.monotonic())

    def note_park(self) -> None:
        """The driving loop is about to sleep on the doorbell (counted in ``stats``)."""
        self.stats["parks"] += 1
        self.spin_gate.parked(time.monotonic(), self.busy())

    def socket_busy(self) -> bool:
        """A lane whose completion arrives on a socket (not the doorbell word) is busy."""
        return any(lane.inflight for lane in self._quiet_lanes)

    def has_dispatchable(self) -> bool:
        if self.fair is not None:  # every active run dispatches
            return bool(self.queued())
        head = self.admission.head
        if head is None:
            return False
        rid = head.run_id
        if self.subs.get(rid) or self.groups.get(rid):
            return True
        return any(per.get(rid) for per in self.singles.values())

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the coroutine on ``loop`` and watch the doorbell and every child pidfd."""
        self._loop = loop
        loop.add_reader(self.doorbell.fd, self._on_doorbell)
        for lane in self._lanes:
            child = getattr(lane.endpoint, "child", None)
            if child is not None and child.pidfd is not None:
                loop.add_reader(child.pidfd, self._on_child_exit, child)
        self._task = loop.create_task(self.run(), name="simpler-scheduler")

    def detach(self) -> None:
        loop = self._loop
        if loop is None:
            return
        loop.remove_reader(self.doorbell.fd)
        for lane in self._lanes:
            child = getattr(lane.endpoint, "child", None)
            if child is not None and child.pidfd is not None:
                loop.remove_reader(child.pidfd)
        self._loop = None

    def loop_gone(self) -> bool:
        """The bound loop ended for good: it is closed, or stopped with this coroutine
        finished (``asyncio.run`` cancels every task before it closes its loop)."""
        loop = self._loop
        if loop is None:
            return False
        if loop.is_closed():
            return True
        if loop.is_running():
            return False
        return self._task is None or self._task.done()

    def forget_loop(self) -> None:
        """After ``loop_gone``: drop every reference to that loop (its readers, the
        parked coroutine's future), so blocking rounds or another loop take over."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(Exception):
                self.detach()
        self._loop = None
        self._task = None
        if self._wake is not None:  # a coroutine destroyed while parked
            self._wake = None
            self.doorbell.unpark()

    def _on_doorbell(self) -> None:
        self.doorbell.drain()
        self.wake()

    def _on_child_exit(self, child: Any) -> None:
        if self._loop is not None and child.pidfd is not None:
            self._loop.remove_reader(child.pidfd)
        self.child_exited(child)
        self.wake()

    def watch_child(self, child: Any) -> None:
        """Observe a (replacement) child's exit through its pidfd on the bound loop."""
        if self._loop is not None and child.pidfd is not None:
            self._loop.add_reader(child.pidfd, self._on_child_exit, child)

    def child_exited(self, child: Any) -> None:
        """A child died: poison its endpoint now, so an idle dead lane is never dispatched to."""
        child.poll()
        reason = f"child {child.describe()}"
        for lane in self._lanes:
            ep = lane.endpoint
            if getattr(ep, "child", None) is child:
                if not ep.poisoned and hasattr(ep, "poison"):
                    ep.poison(reason)
                self._suspect.add(lane)
        if not self.in_round:
            self._check_dead_lanes()

    def _check_dead_lanes(self) -> None:
        """Report a lane whose endpoint is poisoned, drained and whose child has exited."""
        for lane in list(self._suspect):
            ep = lane.endpoint
            child = getattr(ep, "child", None)
            if not ep.poisoned:
                self._suspect.discard(lane)
            elif lane.inflight == 0 and (child is None or child.poll()):
                self._suspect.discard(lane)
                if self.on_lane_dead is not None and not self._stopped:
                    self.on_lane_dead(lane)

    def _sub_capacity(self) -> int:
        """SUB workers that can still run a task: live ones, or all of them while dead
        ones are being replaced."""
        subs = self.manager.sub
        if self.replaces_dead_subs:
            # A lane the pool gave up on (``gone``) will never come back.
            return sum(1 for lane in subs if lane.gone is None)
        return sum(1 for lane in subs if not lane.endpoint.poisoned and not lane.stopping)

    def _no_sub_capacity(self) -> bool:
        """``_sub_capacity() == 0``, answered at the first lane that can run (every round
        with busy SUB workers asks: loops, not ``all`` over a generator)."""
        if self.replaces_dead_subs:
            for lane in self.manager.sub:  # noqa: SIM110 - no generator frame
                if lane.gone is None:
                    return False
            return True
        for lane in self.manager.sub:
            if not lane.stopping and not lane.endpoint.poisoned:
                return False
        return True

    def _no_sub_left(self) -> str:
        """Why no SUB worker can run a task, naming what made the pool give up."""
        why = next((lane.gone for lane in self.manager.sub if lane.gone is not None), None)
        base = "no live SUB worker is left and none is being replaced"
        return f"{base}: {why}" if why else base

    async def run(self) -> None:
        """Progress rounds until stopped; spin briefly, then park on the doorbell."""
        loop = asyncio.get_running_loop()
        doorbell = self.doorbell
        last_progress = time.monotonic()
        try:
            while not self._stopped:
                seen = doorbell.completed()
                # Woken for what a waiter's ``settle`` did meanwhile (nothing poked since,
                # nothing in flight or admitted): park again without a round.
                idle = not self._poked and not self._suspect and self.quiet()
                self._poked = False
                if not idle and self.round():
                    last_progress = time.monotonic()
                    if self._poked:
                        await asyncio.sleep(0)
                        continue
                    if doorbell.completed() != seen:
                        if not self.quiet():
                            await asyncio.sleep(0)
                            continue
                        # The round ended the last run and nothing is in flight: the word
                        # moved for what it completed, and no child can move it again
                        # before a new task is published (and a submit pokes).
                        seen = doorbell.completed()
                spin_s = self.spin_budget()
                if self.busy() and time.monotonic() - last_progress < spin_s:
                    # Watch the one word every child bumps until a child announces a
                    # completion or a submitter pokes us; no mailbox is re-polled
                    # meanwhile. This is the bounded spin of the spin-then-park design, so
                    # an Event would be wrong. In C without the GIL, in slices with one
                    # loop turn between them (a submitter on this loop); the core is
                    # yielded between looks: a child woken onto it runs at once instead
                    # of after the spin (see Driver._rounds).
                    while not self._poked:
                        now = time.monotonic()
                        end = last_progress + spin_s
                        if now >= end:
                            break
                        until = min(end, now + ASYNC_SPIN_SLICE_S)
                        moved = doorbell.spin(seen, ASYNC_SPIN_CHUNK)
                        while not moved and time.monotonic() < until:
                            os.sched_yield()
                            moved = doorbell.spin(seen, ASYNC_SPIN_CHUNK)
                        if moved:
                            break
                        await asyncio.sleep(0)
                    continue
                # Park: flag first, then one more round (Dekker), then sleep.
                self._wake = loop.create_future()
                doorbell.park()
                # Dekker: a completion after `seen` either moved the word (seen here) or
                # finds `parked` set and rings the eventfd.
                if doorbell.completed() != seen or self._poked or self._stopped:
                    doorbell.unpark()
                    self._wake = None
                    continue
                self.note_park()
                # While tasks are in flight, look again after BUSY_PARK_S even without a
                # wake-up: a timer that resolves the future, not wait_for (a task of
                # its own, a shield and ~15 Python calls per park; ~1.7 parks per run).
                wake = self._wake
                timer = loop.call_later(BUSY_PARK_S, _resolve, wake) if self.busy() else None
                try:
                    await wake
                finally:
                    if timer is not None:
                        timer.cancel()
                    doorbell.unpark()
                    self._wake = None
                last_progress = time.monotonic()
        except asyncio.CancelledError:
            raise
        except BaseException:
            log.exception("scheduler crashed; failing every run")
            self.fail_all("scheduler crashed")
            raise

    def fail_all(self, reason: str) -> None:
        for run in self.admission.runs():
            run.record_error(None, FailureInfo(Outcome.ENDPOINT_FAILURE, reason))
            run.building = False
            self.cancel(run, record=False)

    def stop(self) -> None:
        self._stopped = True
        self.wake()

    async def wait_stopped(self) -> None:
        if self._task is not None:
            try:
                await self._task
            finally:
                self._task = None
