"""Lanes (``WorkerThread``) and the ``WorkerManager`` that owns their pools.

A lane is one object per endpoint. It owns no OS thread: the Scheduler's
single progress owner calls ``dispatch``, ``activate_prepared`` and
``progress`` on it. A lane has an *active* capacity (``idle()``) and, on a
two-frame endpoint, a *staged* capacity (``can_stage()``) for the first task
of the prepared successor run. A SUB lane with a queue frame uses ``staged`` for the
task the SUB pump queued behind its running one (not ``prepare_only``): it becomes the
active dispatch when the running one completes.

A rejected dispatch never raises into the Scheduler: it yields exactly one
ENDPOINT_FAILURE completion and one acceptance callback. Completions are
queued before the lane's in-flight count drops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from simpler_daemon.endpoints.base import (
    EndpointCaps,
    EndpointEvent,
    EventKind,
    Outcome,
    WorkerDispatch,
    WorkerEndpoint,
)
from simpler_daemon.errors import EndpointError


class WorkerType(Enum):
    NEXT_LEVEL = "next_level"
    SUB = "sub"


@dataclass(slots=True)
class WorkerCompletion:
    dispatch: WorkerDispatch
    worker_id: int
    worker_type: WorkerType
    outcome: Outcome
    error: int = 0
    message: str = ""


OnComplete = Callable[[WorkerCompletion], None]
OnAccept = Callable[[WorkerDispatch], None]
OnStaged = Callable[[WorkerDispatch, int], None]


class WorkerThread:
    """One endpoint lane: identity, capacity and event forwarding."""

    __slots__ = (
        "_events",
        "_next_dispatch_id",
        "active",
        "deliveries",
        "endpoint",
        "gone",
        "inflight",
        "missing",
        "on_accept",
        "on_complete",
        "on_staged",
        "staged",
        "stopping",
        "worker_id",
        "worker_type",
    )

    def __init__(self, worker_id: int, worker_type: WorkerType, endpoint: WorkerEndpoint) -> None:
        self.worker_id = worker_id
        self.worker_type = worker_type
        self.endpoint = endpoint
        self.active: WorkerDispatch | None = None
        self.staged: WorkerDispatch | None = None
        self.inflight = 0
        self.stopping = False
        #: Why this lane will never run again (set by its owner when it gives up on a dead
        #: endpoint); the Scheduler then fails what is queued for it instead of waiting.
        self.gone: str | None = None
        #: Registration controls queued or in flight for this child (``engine/delivery.py``):
        #: while any is, the lane takes no task, so a control queued behind the running
        #: task reaches the child before the next one.
        self.deliveries = 0
        #: Digests of callables registered but not installed in this child (a queued
        #: install that failed): the Scheduler sends this lane no task of them.
        self.missing: set[bytes] = set()
        self._next_dispatch_id = 1
        self._events: list[EndpointEvent] = []
        self.on_complete: OnComplete = _unstarted
        self.on_accept: OnAccept = _unstarted
        self.on_staged: OnStaged | None = None

    def start(
        self, on_complete: OnComplete, on_accept: OnAccept, on_staged: OnStaged | None = None
    ) -> None:
        self.on_complete = on_complete
        self.on_accept = on_accept
        self.on_staged = on_staged

    def current_task(self) -> str:
        """What this lane runs now, for a person (``list_workers``, the dashboard):
        ``"add (run 7, task 3)"``, "" while it runs nothing."""
        d = self.active
        if d is None:
            return ""
        slot = d.task_slot
        return f"{slot.handle.name} (run {slot.run_id}, task {slot.index})"

    # -- capacity ---------------------------------------------------------------------

    def idle(self) -> bool:
        """Active capacity free (a staged successor does not count) and no registration
        control waiting to reach the child."""
        return (
            self.active is None
            and not self.deliveries
            and not self.stopping
            and not self.endpoint.poisoned
        )

    def lacks(self, digest: bytes) -> bool:
        """Whether the callable ``digest`` is registered but not installed here."""
        return bool(self.missing) and digest in self.missing

    def can_stage(self) -> bool:
        return (
            self.staged is None
            and self.endpoint.caps.supports_frame_staging
            and not self.deliveries
            and not self.stopping
            and not self.endpoint.poisoned
        )

    def busy(self) -> bool:
        return self.inflight > 0

    def caps(self) -> EndpointCaps:
        return self.endpoint.caps

    # -- dispatch ---------------------------------------------------------------------

    def dispatch(self, d: WorkerDispatch) -> None:
        """Submit on the active lane; a refusal becomes one ENDPOINT_FAILURE."""
        d.dispatch_id = self._next_dispatch_id
        self._next_dispatch_id += 1
        d.prepare_only = False
        if self.active is not None:
            self._reject(
                d,
                f"worker {self.worker_id} active lane is occupied by dispatch {self.active.dispatch_id}",
            )
            return
        self._submit(d, staged=False)

    def dispatch_prepared(self, d: WorkerDispatch) -> None:
        """Submit on the staged lane (``prepare_only``)."""
        d.dispatch_id = self._next_dispatch_id
        self._next_dispatch_id += 1
        d.prepare_only = True
        if not self.can_stage():
            self._reject(
                d, f"worker {self.worker_id} cannot stage (lane occupied, single frame or stopping)"
            )
            return
        self._submit(d, staged=True)

    def _submit(self, d: WorkerDispatch, staged: bool) -> None:
        if self.stopping:
            self._reject(d, f"worker {self.worker_id} is stopping")
            return
        if self.inflight >= self.endpoint.caps.capacity:
            self._reject(d, f"worker {self.worker_id} is over capacity")
            return
        try:
            self.endpoint.submit_progress(d)
        except EndpointError as exc:
            self._reject(d, str(exc))
            return
        except Exception as exc:  # an endpoint bug must not unwind the Scheduler
            self._reject(d, f"endpoint raised {type(exc).__name__}: {exc}")
            return
        if staged:
            self.staged = d
        else:
            self.active = d
        self.inflight += 1

    def _reject(self, d: WorkerDispatch, reason: str) -> None:
        self.on_accept(d)
        self.on_complete(
            WorkerCompletion(
                d, self.worker_id, self.worker_type, Outcome.ENDPOINT_FAILURE, -1, reason
            )
        )

    def activate_prepared(self, run_id: int) -> bool:
        """Promote the staged dispatch of ``run_id`` to the active lane."""
        d = self.staged
        if d is None or d.task_slot.run_id != run_id or self.active is not None:
            return False
        self.staged = None
        self.active = d
        self.endpoint.activate_progress(d.dispatch_id)
        return True

    # -- progress --------------------------------------------------------------------------

    def progress(self) -> None:
        """Poll the endpoint and forward its events (Scheduler thread only)."""
        if not self.inflight:
            return
        events = self._events
        self.endpoint.poll_progress(events)
        if events:
            self.forward(events)

    def forward(self, events: list[EndpointEvent]) -> None:
        """Hand the endpoint's ``events`` to the Scheduler's callbacks, then clear them."""
        for ev in events:
            d = ev.dispatch
            if ev.kind is EventKind.COMPLETED:
                # Completion queued first, then capacity released.
                self.on_complete(
                    WorkerCompletion(
                        d, self.worker_id, self.worker_type, ev.outcome, ev.error, ev.message
                    )
                )
                if self.active is d:
                    st = self.staged
                    if st is not None and not st.prepare_only:
                        # A SUB lane's queued task (its queue frame): the child runs it now.
                        self.active, self.staged = st, None
                    else:
                        self.active = None
                elif self.staged is d:
                    self.staged = None
                self.inflight -= 1
            elif ev.kind is EventKind.ACCEPTED:
                self.on_accept(d)
            elif ev.kind is EventKind.FRAME_STAGED and self.on_staged is not None:
                self.on_staged(d, ev.disposition)
        events.clear()

    def stop(self) -> None:
        self.stopping = True
        self.endpoint.request_stop()


def _unstarted(_: Any) -> None:
    raise EndpointError("lane used before WorkerManager.start()")


class WorkerManager:
    """Two pools of lanes: NEXT_LEVEL (by stable worker id) and SUB."""

    def __init__(self) -> None:
        self._next_level_entries: list[tuple[int, WorkerEndpoint]] = []
        self._sub_entries: list[WorkerEndpoint] = []
        self.next_level: dict[int, WorkerThread] = {}
        self.sub: list[WorkerThread] = []
        self.lanes: list[WorkerThread] = []
        self.started = False

    # -- registration (before start) ------------------------------------------------------

    def add_next_level_endpoint(
        self, endpoint: WorkerEndpoint, worker_id: int | None = None
    ) -> int:
        self._check_not_started()
        wid = worker_id if worker_id is not None else len(self._next_level_entries)
        self._next_level_entries.append((wid, endpoint))
        return wid

    def add_next_level_at(self, worker_id: int, endpoint: WorkerEndpoint) -> int:
        return self.add_next_level_endpoint(endpoint, worker_id)

    def add_sub(self, endpoint: WorkerEndpoint) -> int:
        self._check_not_started()
        self._sub_entries.append(endpoint)
        return len(self._sub_entries) - 1

    def _check_not_started(self) -> None:
        if self.started:
            raise EndpointError("cannot add a worker: WorkerManager already started")

    # -- lifecycle ----------------------------------------------------------------------------

    def start(
        self, on_complete: OnComplete, on_accept: OnAccept, on_staged: OnStaged | None = None
    ) -> None:
        """Create every lane. ``ValueError`` on a negative or duplicate worker id."""
        seen: set[int] = set()
        for wid, _ in self._next_level_entries:
            if wid < 0:
                raise ValueError(f"cannot start WorkerManager: worker id {wid} is negative")
            if wid in seen:
                raise ValueError(f"cannot start WorkerManager: duplicate worker id {wid}")
            seen.add(wid)
        for wid, ep in self._next_level_entries:
            lane = WorkerThread(wid, WorkerType.NEXT_LEVEL, ep)
            lane.start(on_complete, on_accept, on_staged)
            self.next_level[wid] = lane
        for i, ep in enumerate(self._sub_entries):
            lane = WorkerThread(i, WorkerType.SUB, ep)
            lane.start(on_complete, on_accept, on_staged)
            self.sub.append(lane)
        self.lanes = [*self.next_level.values(), *self.sub]
        self.started = True

    def add_live(
        self,
        worker_id: int,
        endpoint: WorkerEndpoint,
        on_complete: OnComplete,
        on_accept: OnAccept,
        on_staged: OnStaged | None = None,
    ) -> WorkerThread:
        """Add a NEXT_LEVEL lane after ``start`` (a remote worker attached at run time)."""
        if worker_id < 0 or worker_id in self.next_level:
            raise ValueError(f"cannot add worker {worker_id}: the id is negative or taken")
        lane = WorkerThread(worker_id, WorkerType.NEXT_LEVEL, endpoint)
        lane.start(on_complete, on_accept, on_staged)
        self.next_level[worker_id] = lane
        self.lanes.insert(len(self.next_level) - 1, lane)
        return lane

    def stop_workers(self) -> None:
        """Mark every lane stopping; pool entries stay until ``stop``."""
        for lane in self.lanes:
            lane.stop()

    def stop(self) -> None:
        self.next_level.clear()
        self.sub.clear()
        self.lanes = []

    # -- scheduler API ------------------------------------------------------------------------

    def progress(self) -> None:
        for lane in self.lanes:
            if lane.inflight:
                lane.progress()

    def get_worker_by_id(self, worker_type: WorkerType, worker_id: int) -> WorkerThread | None:
        if worker_type is WorkerType.NEXT_LEVEL:
            return self.next_level.get(worker_id)
        if 0 <= worker_id < len(self.sub):
            return self.sub[worker_id]
        return None

    def next_level_worker_ids(self) -> list[int]:
        return sorted(self.next_level)

    def pick_idle_sub_excluding(
        self, exclude: list[WorkerThread] | tuple[WorkerThread, ...] = ()
    ) -> WorkerThread | None:
        for lane in self.sub:
            if lane.active is None and lane not in exclude and lane.idle():
                return lane
        return None

    def busy(self) -> bool:
        return any(lane.inflight for lane in self.lanes)
