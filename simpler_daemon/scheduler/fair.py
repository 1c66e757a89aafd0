"""The ``fair`` admission policy: many runs execute at once and share the workers.

``fifo`` (the original rule, :class:`~simpler_daemon.scheduler.runmodel.Admission`) lets
only the run at the head of admission dispatch; the next one may build and
stage one chip task. ``fair`` admits up to ``max_active_runs`` runs at once and
every one of them dispatches. The workers are shared in two levels, by
stride scheduling: first between *clients* (``Run.client``: the daemon's peer
identity or token; ``None`` for the in-process API, one client), then between
the runs of the client served. Each idle worker goes to the least pass::

    dispatch of n workers for run r of client c (step = n / r.priority):
        c.vpass = max(c.vpass, vtime) + step      vtime   = pass of the client served last
        r.vpass = max(r.vpass, c.vtime) + step    c.vtime = pass of c's run served last
    a new client starts at vtime, a newly admitted run at its client's vtime

so a run of priority 3 gets three dispatches for every one of a run of priority 1
while both have work, a small run submitted behind a big one is served at the
next idle worker instead of after the big run, and a client with a thousand runs
gets the same share as a client with one. A pass that fell behind (the run sat
waiting for its dependencies) is caught up when it dispatches again: no burst
for the time it did not compete. Admission itself is per client too: a freed
place goes to the oldest waiting run of the client with the fewest active runs.

Pipeline leases stay ``{slot, generation}``, but in ``fair`` they are not
exclusive: a run's lease slot only picks the task frame of a two-frame chip
(``slot & 1``), and consecutive admissions alternate it, so a run that stages its
first chip task behind another run's active one usually finds the other frame
free. The Scheduler, not the lease, keeps frames apart (see dispatch.py).
"""

from __future__ import annotations

from typing import Final

from simpler_daemon.scheduler.runmodel import Admission, Run, RunState

__all__ = [
    "ADMISSION_POLICIES",
    "DEFAULT_MAX_ACTIVE_RUNS",
    "NO_PASS",
    "FairAdmission",
    "Share",
    "run_pass",
]

#: The admission policies a Scheduler accepts.
ADMISSION_POLICIES: Final = ("fifo", "fair")
#: Runs executing at once under ``fair`` unless told otherwise (the daemon passes
#: ``limits.max_concurrent_runs``).
DEFAULT_MAX_ACTIVE_RUNS: Final = 64
#: Sorts after every pass (``run_pass``).
NO_PASS: Final = (float("inf"), float("inf"))


def run_pass(run: Run) -> tuple[float, float]:
    """A run's place under fair admission: its client's pass, then its own (the least is
    served first)."""
    share = run.share
    return (share.vpass if share is not None else 0.0, run.vpass)


class Share:
    """The runs of one client (``Run.client``): the unit the workers are shared between
    first. Its pass orders clients; ``vtime`` is the pass of its run served last."""

    __slots__ = ("active", "client", "vpass", "vtime")

    def __init__(self, client: object, vpass: float) -> None:
        self.client = client
        self.vpass = vpass
        self.vtime = 0.0
        #: Active (admitted, not detached) runs of this client.
        self.active = 0


class FairAdmission(Admission):
    """Up to ``max_active`` runs execute at once; the rest wait.

    A freed place goes to the oldest waiting run of the client with the fewest active
    runs, so one client that submitted a thousand runs does not keep a second one out.
    ``head`` and ``successor`` keep their meaning (the two oldest active runs) for
    callers that inspect them, but the Scheduler dispatches every active run.
    """

    def __init__(self, depth: int, max_active: int = DEFAULT_MAX_ACTIVE_RUNS) -> None:
        super().__init__(depth)
        if isinstance(max_active, bool) or not isinstance(max_active, int) or max_active < 1:
            raise ValueError(
                f"cannot create fair admission: max_active_runs {max_active!r} must be an "
                "integer of at least 1"
            )
        self.max_active = max_active
        #: Virtual time of clients: the pass of the client served last (never decreases).
        self.vtime = 0.0
        self.shares: dict[object, Share] = {}

    def _admit(self) -> list[Run]:
        admitted = []
        active = self.active
        waiting = self.waiting
        shares = self.shares
        while waiting and len(active) < self.max_active:
            run = self._next_waiting()
            self._generation += 1
            # Alternate the frame of consecutive runs: a run that stages behind the one
            # admitted just before it then finds the other frame free.
            run.lease_slot = self._generation % self.depth
            run.lease_generation = self._generation
            run.admitted = True
            share = shares.get(run.client)
            if share is None:
                share = shares[run.client] = Share(run.client, self.vtime)
            share.active += 1
            run.share = share
            run.vpass = share.vtime
            # Every admitted run executes, even while its orchestration still submits.
            if run.state in (RunState.BUILDING, RunState.PREPARED):
                run.state = RunState.EXECUTING
            active.append(run)
            admitted.append(run)
        self._top()
        return admitted

    def _next_waiting(self) -> Run:
        """Take the oldest waiting run of the client with the fewest active runs."""
        waiting = self.waiting
        shares = self.shares
        best_i, best_n = 0, -1
        for i, run in enumerate(waiting):
            share = shares.get(run.client)
            n = share.active if share is not None else 0
            if best_n < 0 or n < best_n:
                best_i, best_n = i, n
                if n == 0:
                    break
        if best_i == 0:
            return waiting.popleft()
        run = waiting[best_i]
        del waiting[best_i]
        return run

    def _leave(self, run: Run) -> None:
        share = run.share
        if share is not None:
            share.active -= 1
            if share.active == 0 and self.shares.get(share.client) is share:
                # A client that comes back starts at the current virtual time.
                del self.shares[share.client]

    def release(self, run: Run) -> list[Run]:
        """A terminal run leaves; the next waiting run is admitted."""
        try:
            self.active.remove(run)
        except ValueError:
            if run in self.detached:
                self.detached.remove(run)
            else:
                try:
                    self.waiting.remove(run)
                except ValueError:
                    pass
            return []
        self._leave(run)
        return self._admit()

    def detach(self, run: Run) -> list[Run]:
        """A cancelled run with tasks still running leaves admission now (its place goes
        to the next waiting run); ``release`` forgets it once it is terminal."""
        if run.detached or run not in self.active:
            return []
        self.active.remove(run)
        run.detached = True
        self.detached.append(run)
        self._leave(run)
        return self._admit()

    def refund(self, run: Run, workers: int) -> None:
        """Take back a ``charge(run, workers)`` whose workers never ran its task (it went
        back to its queue unstarted): the task is charged again when it is dispatched
        again, so it counts once. The catch-up to the virtual time stays."""
        step = workers / run.priority
        run.vpass -= step
        if run.share is not None:
            run.share.vpass -= step

    def charge(self, run: Run, workers: int) -> None:
        """``run`` was given ``workers`` workers: advance its client's pass and its own by
        their stride. A pass that fell behind (it did not compete meanwhile) is caught up
        first: no credit for idle time."""
        step = workers / run.priority
        share = run.share
        if share is not None:
            vp = share.vpass
            if vp < self.vtime:
                vp = self.vtime
            else:
                self.vtime = vp
            share.vpass = vp + step
            vp = run.vpass
            if vp < share.vtime:
                vp = share.vtime
            else:
                share.vtime = vp
            run.vpass = vp + step
