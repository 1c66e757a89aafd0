"""Whether the daemon can still do work: its worker pools' capacity, and what follows.

A *pool* is one kind of lane of the Worker: its SUB workers, and its next-level
workers (chips at level 3; the local nested and remote L3 workers at level 4). A
pool is *down* when it has lanes and every one of them has ``lane.gone`` set: dead
with no replacement coming (the fork servers are exhausted, a remote session's
reconnect was given up), or a remote worker waiting for its next reconnect attempt.
A local lane whose replacement is under way counts as capacity. A pool configured
with no worker at all is not down. The daemon is *healthy* while no pool is down.
The watchdog pings stop only for a pool down with nothing coming back: a level-4
daemon whose L3 workers all reconnect reports NOT_SERVING but keeps pinging (a
restart of it would not bring the remote hosts back sooner)::

    every CHECK_PERIOD on the event loop:  pools_down(manager, level) -> HealthState.observe
      healthy -> unhealthy     "unhealthy" (log WARNING once; health NOT_SERVING,
                               GetInfo SERVING_STATE_UNHEALTHY + reason, metric, STATUS=)
      a pool down, nothing     "pings_stopped" (log ERROR once; no WATCHDOG=1 from now on:
      coming back, for         systemd's WatchdogSec= restarts the daemon); 0 = never
      health.unhealthy_exit_s
      capacity back            "healthy" (log WARNING; SERVING, pings resume)

``HealthState`` is the pure state machine (tested with a fake clock); ``HealthWatch``
reads the lanes on the loop, feeds it and acts on its transitions through what the
daemon module hands it (``publish`` sets the gRPC health status and GetInfo's state).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

from simpler_daemon.system.notify import SystemdNotifier

__all__ = ["CHECK_PERIOD", "HealthState", "HealthWatch", "PoolDown", "pools_down"]

log = logging.getLogger("simpler_daemon.daemon")

#: Seconds between two capacity checks (a walk over the lanes: cheap).
CHECK_PERIOD: Final = 1.0


@dataclass(frozen=True)
class PoolDown:
    """One pool without capacity: ``pool`` is its metric label ("sub", "chip", "l3").
    ``recovering``: some of its lanes are remote workers that reconnect (the daemon
    cannot serve that pool now, but a restart of it would not bring them back sooner:
    the watchdog pings go on)."""

    pool: str
    reason: str
    recovering: bool = False


def _pool_name(pool: str) -> str:
    return {"sub": "SUB", "chip": "chip", "l3": "L3"}.get(pool, pool)


def pools_down(manager: Any, level: int) -> list[PoolDown]:
    """The pools of ``manager`` (a started ``WorkerManager``; None: none) whose every lane
    is given up, each with the first lane's reason."""
    if manager is None or not getattr(manager, "started", False):
        return []
    pools: list[tuple[str, Iterable[Any]]] = [
        ("sub", manager.sub),
        ("l3" if level >= 4 else "chip", manager.next_level.values()),
    ]
    out = []
    for pool, lanes in pools:
        # A remote worker retired on purpose (its address left DNS) is no capacity lost.
        lanes = [lane for lane in lanes if not getattr(lane.gone, "retired", False)]
        if not lanes or any(lane.gone is None for lane in lanes):
            continue
        name = _pool_name(pool)
        count = (
            f"all {len(lanes)} {name} workers are" if len(lanes) > 1 else f"the {name} worker is"
        )
        # A remote worker between reconnect attempts fails its work at once (its ``gone``
        # says so): no capacity now, but one is coming back.
        coming = [lane for lane in lanes if getattr(lane.gone, "reconnecting", False)]
        if coming:
            reason = (
                f"no {name} worker can take work: {count} down, {len(coming)} of them "
                f"reconnecting ({coming[0].gone})"
            )
        else:
            reason = (
                f"no {name} worker left: {count} down and none is being replaced ({lanes[0].gone})"
            )
        out.append(PoolDown(pool, reason, recovering=bool(coming)))
    return out


class HealthState:
    """The health verdict over time; ``observe`` returns what changed.

    ``exit_after`` (``health.unhealthy_exit_s``): seconds unhealthy before the watchdog
    pings stop; 0 = never.
    """

    def __init__(self, exit_after: float) -> None:
        self.exit_after = exit_after
        #: Why the daemon is unhealthy ("" = healthy).
        self.reason = ""
        #: The pools down now (their metric labels).
        self.down: frozenset[str] = frozenset()
        #: True once unhealthy for ``exit_after``: the daemon sends no WATCHDOG=1.
        self.pings_stopped = False
        self._since = 0.0
        #: Since when a pool is down with nothing coming back (None: none is); the
        #: pings stop ``exit_after`` after that, not while remote workers reconnect.
        self._stuck_since: float | None = None

    @property
    def healthy(self) -> bool:
        return not self.reason

    def observe(self, down: list[PoolDown], now: float) -> list[str]:
        """Take a capacity check at monotonic time ``now``; the transitions it caused, in
        order: "unhealthy", "changed" (another set of pools is down), "pings_stopped",
        "healthy"."""
        out: list[str] = []
        reason = "; ".join(d.reason for d in down)
        pools = frozenset(d.pool for d in down)
        if reason and not self.reason:
            self._since = now
            out.append("unhealthy")
        elif not reason and self.reason:
            self.pings_stopped = False
            out.append("healthy")
        elif pools != self.down:
            out.append("changed")
        self.reason, self.down = reason, pools
        stuck = any(not d.recovering for d in down)
        if not stuck:
            self._stuck_since = None
        elif self._stuck_since is None:
            self._stuck_since = now
        if (
            self._stuck_since is not None
            and not self.pings_stopped
            and self.exit_after > 0
            and now - self._stuck_since >= self.exit_after
        ):
            self.pings_stopped = True
            out.append("pings_stopped")
        return out


class HealthWatch:
    """Checks the capacity of ``worker``'s pools every :data:`CHECK_PERIOD` and acts on
    the transitions of ``state``: logs, ``publish()`` (gRPC health, GetInfo), the
    ``metrics`` pool gauges, ``STATUS=``; ``watchdog``: whether WATCHDOG=1 pings are
    being sent (a daemon without them says so when it would have stopped them)."""

    def __init__(
        self,
        worker: Any,
        state: HealthState,
        *,
        publish: Callable[[], Awaitable[None]],
        notifier: SystemdNotifier,
        watchdog: bool,
        metrics: Any = None,
    ) -> None:
        self._worker = worker
        self.state = state
        self._publish = publish
        self._notifier = notifier
        self._watchdog = watchdog
        self._metrics = metrics
        self._pools = ("sub", "l3" if worker.level >= 4 else "chip")
        if metrics is not None:  # the gauges exist from the start, at 0
            for pool in self._pools:
                metrics.set_pool_down(pool, False)

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(CHECK_PERIOD)

    async def check(self) -> None:
        """One capacity check; acts on what changed."""
        state = self.state
        down = pools_down(getattr(self._worker, "manager", None), self._worker.level)
        events = state.observe(down, time.monotonic())
        if not events:
            return
        for event in events:
            self._log(event)
        if self._metrics is not None:
            for pool in self._pools:
                self._metrics.set_pool_down(pool, pool in state.down)
        await self._publish()
        if state.healthy:
            self._notifier.status("serving: every worker pool has capacity again")
            if self._watchdog:
                self._notifier.watchdog()  # at once: the pings may have been stopped
        elif state.pings_stopped and self._watchdog:
            self._notifier.status(f"unhealthy, watchdog pings stopped: {state.reason}")
        else:
            self._notifier.status(f"unhealthy: {state.reason}")

    def _log(self, event: str) -> None:
        state = self.state
        exit_after = state.exit_after
        if event == "unhealthy":
            if not exit_after:
                then = "health.unhealthy_exit_s = 0: the watchdog pings go on"
            elif self._watchdog:
                then = f"the watchdog pings stop in {exit_after:g} s (health.unhealthy_exit_s)"
            else:
                then = "no systemd watchdog is pinged: nothing will restart the daemon"
            log.warning("unhealthy, gRPC health NOT_SERVING: %s; %s", state.reason, then)
        elif event == "changed":
            log.warning("still unhealthy: %s", state.reason)
        elif event == "pings_stopped":
            if self._watchdog:
                log.error(
                    "unhealthy for %g s (health.unhealthy_exit_s): watchdog pings stopped, "
                    "systemd restarts the daemon (WatchdogSec=)",
                    exit_after,
                )
            else:
                log.error(
                    "unhealthy for %g s (health.unhealthy_exit_s), but no systemd watchdog is "
                    "pinged (daemon.watchdog = false or no WatchdogSec=): restart the daemon "
                    "to get its workers back",
                    exit_after,
                )
        else:
            log.warning("healthy again: every worker pool has capacity; gRPC health SERVING")
