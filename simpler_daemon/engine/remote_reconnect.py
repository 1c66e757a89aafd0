"""Reopening the session of a remote L3 worker that failed: capped exponential backoff.

::

    driving side                          reconnect thread (one per worker that is down)
    lane_dead(lane) ── start(lane, old) ──► attempt 1 at once: open_one(...)
                                            ok ──► hand over: RemoteFleet.reopened
                                            fails ─► wait ReconnectPolicy.delay(n)
    RemoteFleet.backing_off  ◄── hand over ─┤        (rows show "reconnecting",
       (queued work fails at once,          │         attempts and the next try)
        naming the next attempt)            └─► attempt n+1 ... until one succeeds, or
    RemoteFleet.give_up_outage ◄───────────────  ``max_elapsed_s`` is reached, or close

An attempt blocks for up to the Worker's startup timeout (a frozen host), so it runs
on a thread of its own and the other workers' runs go on meanwhile. Everything the
thread learns is handed to the driving side (``Driver.call_threadsafe``), where the
lanes and the fleet's tables change; the thread itself only writes its
:class:`Outage` (read by ``list_workers`` from any thread).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from simpler_daemon.remote.spec import ReconnectPolicy

if TYPE_CHECKING:
    from simpler_daemon.engine.remote_l3 import RemoteFleet
    from simpler_daemon.scheduler.lanes import WorkerThread

log = logging.getLogger("simpler_daemon.remote")


class Retired(str):
    """``lane.gone`` of a remote worker retired on purpose (its address left DNS,
    server/discovery.py): its work is refused like a gone worker's, but the lane is no
    capacity lost, so the daemon's health does not count it (``retired`` is True)."""

    __slots__ = ()
    retired = True


class Reconnecting(str):
    """``lane.gone`` while a remote worker waits for its next reconnect attempt: the
    Scheduler fails its work at once (it reads ``gone``), yet a new session is coming,
    so the daemon's health counts the lane as capacity (``reconnecting`` is True)."""

    __slots__ = ()
    reconnecting = True


@dataclass(slots=True)
class Outage:
    """One failed session of a worker, from its failure until a new session replaces it."""

    #: Why the session failed ("remote worker 1 (HOST:PORT) failed: ...").
    reason: str
    #: ``time.monotonic()`` of the failure (``max_elapsed_s`` counts from it).
    started: float
    #: Attempts started so far (the one under way included).
    attempts: int = 0
    #: When the next attempt starts (``time.monotonic()``); None while one is under way.
    next_at: float | None = None
    #: Why the last attempt failed.
    last_error: str | None = None

    @property
    def backing_off(self) -> bool:
        """An attempt failed and the next one waits: the worker is really down."""
        return self.next_at is not None

    def next_try_s(self, now: float) -> float | None:
        return None if self.next_at is None else max(0.0, self.next_at - now)

    def describe(self, now: float) -> str:
        """The reason, the last attempt's error and the next try, in one line."""
        text = f"{self.reason}; reconnecting"
        if self.last_error is not None:
            n = self.attempts
            text += f": attempt {n} failed ({self.last_error})"
        wait = self.next_try_s(now)
        if wait is not None:
            text += f"; next attempt in {wait:.1f} s"
        else:
            text += f"; attempt {self.attempts} under way"
        return text


class Reconnector:
    """The reconnect threads of one fleet and what they report (see the module docstring).

    ``clock`` and ``rand`` are ``time.monotonic`` and ``random.random`` (the tests
    inject their own).
    """

    def __init__(
        self,
        fleet: RemoteFleet,
        policy: ReconnectPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.fleet = fleet
        self.policy = policy
        self.clock = clock
        self.rand = rand
        #: Worker id -> its outage, while a reconnect thread works for it.
        self.outages: dict[int, Outage] = {}
        self._threads: set[threading.Thread] = set()
        #: The sockets of the attempt each thread has under way (shut down at close).
        self._opening: dict[threading.Thread, list[socket.socket]] = {}
        self._closing = threading.Event()

    def start(self, lane: WorkerThread, old: Any, reason: str) -> None:
        """On the driving side: reopen ``lane``'s session (its endpoint ``old`` failed)."""
        wid = lane.worker_id
        outage = self.outages[wid] = Outage(reason, self.clock())
        thread = threading.Thread(
            target=self._run, args=(lane, old, outage), name=f"reconnect-{wid}", daemon=True
        )
        self._threads.add(thread)
        thread.start()

    def _run(self, lane: WorkerThread, old: Any, outage: Outage) -> None:
        me = threading.current_thread()
        try:
            self._attempts(lane, old, outage, me)
        finally:
            self._opening.pop(me, None)
            self._threads.discard(me)

    def _attempts(self, lane: WorkerThread, old: Any, outage: Outage, me: threading.Thread) -> None:
        fleet, policy, wid = self.fleet, self.policy, lane.worker_id
        while not self._closing.is_set():
            if wid in fleet.retired:  # retired meanwhile: nothing to reopen
                return
            opened: list[socket.socket] = []
            self._opening[me] = opened
            outage.attempts += 1
            outage.next_at = None
            try:
                deadline = self.clock() + fleet.startup_timeout
                ep: Any = fleet.open_one(wid, deadline, None, opened)
            except Exception as exc:  # StartupError, or anything opening raised
                outage.last_error = str(exc)
                ep = None
            finally:
                self._opening.pop(me, None)
            if ep is not None:
                if not self._hand(functools.partial(fleet.reopened, lane, old, ep)):
                    ep.shutdown(0.5)  # closed meanwhile: the runner must not outlive us
                return
            now = self.clock()
            delay = policy.delay(outage.attempts, self.rand())
            elapsed = now - outage.started
            if policy.max_elapsed_s and elapsed + delay > policy.max_elapsed_s:
                why = (
                    f"{outage.reason}; gave up reconnecting after {outage.attempts} attempts "
                    f"in {elapsed:.1f} s (reconnect.max_elapsed_s={policy.max_elapsed_s:g}); "
                    f"the last one failed: {outage.last_error}"
                )
                self._hand(functools.partial(fleet.give_up_outage, lane, old, why))
                return
            outage.next_at = now + delay
            log.warning(
                "remote worker %d: reconnect attempt %d failed (%s); next in %.1f s",
                wid,
                outage.attempts,
                outage.last_error,
                delay,
            )
            self._hand(functools.partial(fleet.backing_off, lane, old, outage))
            if self._closing.wait(delay):
                return

    def _hand(self, fn: Callable[[], None]) -> bool:
        driver = self.fleet._driver
        return driver is not None and self.fleet.serving and driver.call_threadsafe(fn)

    def close(self, deadline: float) -> None:
        """No new attempt; let one under way finish within ``deadline`` (a thread that
        gets through shuts its new session down itself, seeing the fleet stopped
        serving; aborting it halfway would leave the runner the worker already started
        waiting for its attach), then abort what is still stuck (a host that does not
        answer): its sockets fail at once."""
        self._closing.set()
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        for opened in list(self._opening.values()):
            for sock in list(opened):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for thread in list(self._threads):
            thread.join(1.0)
