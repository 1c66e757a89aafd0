"""A level-4 Worker's local L3 children, as the parent sees them (the child side is
``children/nested.py``; forking and replacing them is ``pool.ChildPool``'s job).

::

    w4.add_worker(l3)          -> LocalL3Set.add: l3 frozen, its heap linked to the L4 heap
    w4.init()                  -> ChildPool forks one nested child per entry (after SUB, chips)
    w4.register(fn)            -> every L4 callable reaches every local L3 child (NestedTarget,
                                  scope T): an L3 orchestration there, cascaded into its inner
                                  Worker (SUB / chip grandchildren)
    register(f, kind, workers=[i])
        before init            -> on the inner Worker object (its children inherit it)
        after init             -> a control into child i (scope I), all targets or none
    a replacement child        -> replay(): what was registered or dropped since the fork

The same worker id space as the remote workers: ids come from the facade.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from simpler_daemon.callables import CallableRegistry, CallableSpec
from simpler_daemon.children.nested import (
    SCOPE_INNER,
    SCOPE_TABLE,
    control_text,
    encode_control,
)
from simpler_daemon.endpoints.local import CONTROL_TIMEOUT_S
from simpler_daemon.engine.registration import install_all, spec_for, uninstall_all
from simpler_daemon.errors import ControlError, WorkerStateError
from simpler_daemon.mailbox.layout import ControlOp
from simpler_daemon.remote.spec import RemoteCallable

if TYPE_CHECKING:
    from simpler_daemon.endpoints.local import LocalMailboxEndpoint
    from simpler_daemon.engine.worker import Worker
    from simpler_daemon.heap import Heap

#: Roles of the L4 registry that every local L3 child receives.
L3_ROLES = ("sub", "orchestration")


class NestedTarget:
    """A local L3 child as a registration target (controls on its mailbox)."""

    def __init__(self, endpoint: LocalMailboxEndpoint, scope: bytes = SCOPE_TABLE) -> None:
        self.endpoint = endpoint
        self.scope = scope
        #: The child's Scheduler lane and wake-up, as for a ``LocalTarget``.
        self.lane: Any = None
        self.wake: Callable[[], None] | None = None

    @property
    def worker_id(self) -> int:
        return self.endpoint.worker_id

    @property
    def gone(self) -> bool:
        return self.endpoint.poisoned

    async def install(self, spec: CallableSpec) -> None:
        role = spec.handle.role
        if role == "chip" or spec.import_path is not None:
            assert spec.import_path is not None
            op = ControlOp.REGISTER_CHIP if role == "chip" else ControlOp.REGISTER_IMPORT
            body = spec.import_path.encode()
        else:
            assert spec.payload is not None
            op, body = ControlOp.REGISTER_SERIALIZED, spec.payload
        await self._control(op, spec, encode_control(self.scope, role, body))

    async def uninstall(self, spec: CallableSpec) -> None:
        role = spec.handle.role
        op = ControlOp.UNREGISTER_CHIP if role == "chip" else ControlOp.UNREGISTER
        await self._control(op, spec, encode_control(self.scope, role))

    async def _control(self, op: ControlOp, spec: CallableSpec, payload: bytes) -> None:
        try:
            # The child broadcasts it to its own children, each with CONTROL_TIMEOUT_S:
            # its answer may take up to that long on top of its own work.
            await self.endpoint.control(
                op, spec.handle.digest, payload, timeout=2 * CONTROL_TIMEOUT_S
            )
        except ControlError as exc:
            # The child's text already names the path (child_worker W: sub_worker S: ...).
            raise ControlError(control_text(exc)) from exc


@dataclass(slots=True)
class _Install:
    """A callable installed into some local L3 children's inner Workers."""

    spec: CallableSpec
    workers: set[int] = field(default_factory=set)
    refcount: int = 1


class LocalL3Set:
    """The local L3 children of one L4 Worker (see the module docstring)."""

    def __init__(self, endpoints: list[LocalMailboxEndpoint]) -> None:
        #: The pool's endpoints of the running children (replacements swap in place).
        self.endpoints = endpoints
        #: worker id -> the inner Worker (NEW in this process; it runs in the child).
        self.workers: dict[int, Worker] = {}
        self.installs: dict[str, _Install] = {}
        #: hashid -> the workers it was installed on when the children were forked.
        self._forked: dict[str, set[int]] = {}
        #: True for an L4 orchestration that runs on remote workers only (RemoteCallable).
        self.remote_only: Callable[[str], bool] = lambda hashid: False

    # -- membership -------------------------------------------------------------------

    def check_new(self, parent: Worker, worker: Any) -> None:
        """``add_worker``'s rules: ``WorkerStateError`` for a call in the wrong state (of
        this Worker or the child), ``ValueError`` / ``TypeError`` for a bad child."""
        from simpler_daemon.engine.worker import WorkerState

        what = "cannot add a worker"
        if parent.level < 4:
            raise WorkerStateError(
                f"{what}: only a level-4 Worker holds L3 workers (this is level {parent.level})"
            )
        if parent.state is not WorkerState.NEW:
            raise WorkerStateError(
                f"{what}: only before init() (this Worker is {parent.state.name})"
            )
        if not isinstance(worker, type(parent)):
            raise TypeError(f"{what}: expected a Worker(level=3), got {type(worker).__name__}")
        if worker is parent:
            raise ValueError(f"{what}: a Worker cannot be its own child")
        if worker.level != 3:
            raise ValueError(f"{what}: its level is {worker.level}; L3 workers only")
        if worker._attached or worker.state is not WorkerState.NEW:
            raise WorkerStateError(
                f"{what}: it must be a NEW worker, not attached elsewhere "
                f"({worker._attached or worker.state.name})"
            )

    def add(self, worker_id: int, inner: Worker, parent_heap: Heap) -> None:
        inner.heap.parent = parent_heap
        self.workers[worker_id] = inner

    def split(
        self, workers: Iterable[int], is_remote: Callable[[int], bool], what: str
    ) -> tuple[list[int], list[int]]:
        """``(remote ids, local ids)`` of a ``workers=`` list; ``ValueError`` for an unknown id."""
        remote: list[int] = []
        local: list[int] = []
        for w in workers:
            if isinstance(w, bool) or not isinstance(w, int):
                raise TypeError(f"cannot {what}: workers= must be a list of worker ids, got {w!r}")
            if w in self.workers:
                local.append(w)
            elif is_remote(w):
                remote.append(w)
            else:
                raise ValueError(
                    f"cannot {what}: worker {w} is not an L3 worker of this Worker (local: "
                    f"{sorted(self.workers)})"
                )
        return sorted(set(remote)), sorted(set(local))

    # -- what the children receive ------------------------------------------------------

    def fork_specs(self, registry: CallableRegistry) -> list[CallableSpec]:
        """The L4 callables every child starts with; records the installs it inherits."""
        self._forked = {h: set(e.workers) for h, e in self.installs.items()}
        return [
            e.spec
            for e in registry.active()
            if e.spec.handle.role in L3_ROLES and not self.remote_only(e.spec.handle.hashid)
        ]

    def targets(self, role: str) -> list[NestedTarget]:
        """Where an L4 registration of ``role`` goes among the children."""
        if role not in L3_ROLES:
            return []
        return [NestedTarget(ep) for ep in self.endpoints if not ep.poisoned]

    def endpoint(self, worker_id: int) -> LocalMailboxEndpoint | None:
        return next((ep for ep in self.endpoints if ep.worker_id == worker_id), None)

    # -- register(..., workers=[local ids]) ----------------------------------------------

    def install(self, spec: CallableSpec, workers: list[int]) -> None:
        """Before init: into the inner Workers' registries (their children inherit them)."""
        entry = self.installs.get(spec.handle.hashid)
        for w in workers:
            if entry is None or w not in entry.workers:
                registry = self.workers[w].registry
                if registry.begin_register(spec, frozenset()):
                    registry.commit_register(spec.handle.hashid)
        self._record(spec, workers)

    async def install_live(self, spec: CallableSpec, workers: list[int]) -> None:
        """After init: a control into each child, all or none.

        Raises ``RegistrationError(REGISTER_PARTIAL_FAILURE)`` naming each path that
        failed (``worker 1: child_worker 1: sub_worker 0: ...``), nothing stays installed;
        ``REGISTER_CLEANUP_UNCERTAIN`` when the rollback failed too.
        """
        entry = self.installs.get(spec.handle.hashid)
        todo = [w for w in workers if entry is None or w not in entry.workers]
        # A child being replaced is skipped: its replacement replays what is installed.
        targets = (
            NestedTarget(ep, SCOPE_INNER)
            for ep in map(self.endpoint, todo)
            if ep is not None and not ep.poisoned
        )
        await install_all(
            spec, targets, f"cannot register {spec.handle.name} into local L3 workers"
        )
        self._record(spec, workers)

    def _record(self, spec: CallableSpec, workers: list[int]) -> None:
        entry = self.installs.get(spec.handle.hashid)
        if entry is None:
            self.installs[spec.handle.hashid] = _Install(spec, set(workers))
        else:
            entry.workers |= set(workers)
            entry.refcount += 1

    def uninstall(self, hashid: str) -> _Install | None:
        """Drop one reference; the entry to remove everywhere when it was the last one."""
        entry = self.installs.get(hashid)
        if entry is None:
            return None
        entry.refcount -= 1
        if entry.refcount > 0:
            return _Install(entry.spec, set(), 0)
        del self.installs[hashid]
        return entry

    def uninstall_now(self, entry: _Install) -> None:
        """Before init: out of the inner Workers' registries."""
        for w in entry.workers:
            registry = self.workers[w].registry
            if registry.begin_unregister(entry.spec.handle.hashid) is not None:
                registry.finish_unregister(entry.spec.handle.hashid)

    async def uninstall_live(self, entry: _Install) -> None:
        # A child being replaced is skipped: its replacement replays only what is installed.
        targets = (
            NestedTarget(ep, SCOPE_INNER)
            for ep in map(self.endpoint, sorted(entry.workers))
            if ep is not None and not ep.poisoned
        )
        name = entry.spec.handle.name
        await uninstall_all(entry.spec, targets, f"cannot unregister {name} from local L3 workers")

    async def drop(self, hashid: str, workers: list[int]) -> None:
        """Undo an ``install_live`` on ``workers`` (the remote half of the same call failed)."""
        entry = self.uninstall(hashid) if workers else None
        if entry is not None and entry.workers:
            await self.uninstall_live(entry)

    # -- a replacement child -----------------------------------------------------------------

    async def replay(
        self,
        endpoint: LocalMailboxEndpoint,
        inherited: list[CallableSpec],
        registry: CallableRegistry,
    ) -> None:
        """Bring a fresh child (forked from the init-time snapshot) up to date.

        Raises ``ControlError`` / ``EndpointError`` when a control fails.
        """
        wid = endpoint.worker_id
        table = NestedTarget(endpoint, SCOPE_TABLE)
        inner = NestedTarget(endpoint, SCOPE_INNER)
        had = {s.handle.hashid for s in inherited}
        replayed: set[str] = set()
        while True:  # until nothing new appears (a registration may land meanwhile)
            todo = [
                e.spec
                for e in registry.active()
                if e.spec.handle.role in L3_ROLES
                and not self.remote_only(e.spec.handle.hashid)
                and e.spec.handle.hashid not in had | replayed
            ]
            if not todo:
                break
            for spec in todo:
                await table.install(spec)
                replayed.add(spec.handle.hashid)
        active = {e.spec.handle.hashid for e in registry.active()}
        for spec in inherited:
            if spec.handle.hashid not in active:
                await table.uninstall(spec)
        for hashid, current in list(self.installs.items()):
            if wid in current.workers and wid not in self._forked.get(hashid, set()):
                await inner.install(current.spec)
        for hashid, forked in self._forked.items():
            entry = self.installs.get(hashid)
            if wid in forked and (entry is None or wid not in entry.workers):
                # The inner Worker object here still holds what it was forked with.
                held = self.workers[wid].registry.lookup(hashid)
                gone = entry.spec if entry is not None else held.spec if held else None
                if gone is not None:
                    await inner.uninstall(gone)

    # -- teardown -------------------------------------------------------------------------

    def forget(self) -> None:
        """The L4 Worker closed: keep no installed callable alive."""
        self.installs.clear()
        self._forked.clear()

    def close(self) -> None:
        """Release the inner Workers' memory in this process (they never ran here)."""
        for inner in self.workers.values():
            inner._attached = None
            inner.close()


def installs_into_l3(w: Worker, fn: Any, kind: str, workers: list[int] | None) -> bool:
    """Whether ``w.register(fn, kind, workers)`` installs into L3 workers (``plan_install``)
    rather than into ``w``'s own children: ``workers=``, a ``RemoteCallable``, or a chip
    kernel on a level-4 Worker (whose chips are its L3 workers')."""
    return (
        isinstance(fn, RemoteCallable) or workers is not None or (kind == "chip" and w.level >= 4)
    )


def plan_install(
    w4: Worker, fn: Any, kind: str, workers: list[int] | None
) -> tuple[CallableSpec, str, list[int], list[int]]:
    """What ``w4.register(..., workers=)``, a ``RemoteCallable`` or a level-4 chip kernel
    installs: the spec, its kind, and the remote and the local L3 workers it goes to.

    A chip kernel without ``workers=`` goes to every L3 worker with chips. A
    ``RemoteCallable`` needs ``workers=[remote ids]``: ``RuntimeError`` when this Worker
    has no remote worker, ``ValueError`` without the list."""
    fleet, l3 = w4._fleet, w4._pool.l3
    if w4.level < 4:
        raise ValueError(
            "cannot register into NEXT_LEVEL workers: a level-3 Worker has no L3 children "
            "(workers= and RemoteCallable need Worker(level=4))"
        )
    if isinstance(fn, RemoteCallable):
        spec, kind = spec_for(fn.target, "orchestration"), "orchestration"
    else:
        spec = spec_for(fn, kind)  # type: ignore[arg-type]
    what = f"register {spec.handle.name}"
    local: list[int] = []
    if isinstance(fn, RemoteCallable) and not workers:
        # As the origin: a remote orchestration goes where the caller says, never to
        # "every remote worker" by default.
        if not fleet.specs:
            raise RuntimeError(
                f"cannot {what}: a RemoteCallable runs on remote workers and this Worker has "
                "none: add at least one remote worker (add_remote_worker) first"
            )
        raise ValueError(
            f"cannot {what}: a RemoteCallable needs an explicit non-empty list of remote "
            f"worker ids (workers=[...]; remote workers: {sorted(fleet.specs)})"
        )
    if workers is None:
        # A chip kernel without workers=: every L3 worker that has chips, local and remote.
        local = sorted(w for w, inner in l3.workers.items() if inner.num_chips > 0)
        remote = sorted(w for w, rs in fleet.specs.items() if rs.num_chips > 0)
        if not local and not remote:
            raise ValueError(
                f"cannot {what}: a level-4 Worker installs a chip kernel into its L3 workers "
                "that have chips, and none has (add_worker(Worker(level=3, num_chips=N)) or "
                "a remote worker with num_chips > 0)"
            )
    elif not isinstance(workers, (list, tuple)):
        raise TypeError(f"cannot {what}: workers= must be a list of worker ids")
    else:
        remote, local = l3.split(workers, fleet.is_remote, what)
    if local and kind == "orchestration":
        raise ValueError(
            f"cannot {what} into local L3 workers {local}: every L4 callable reaches every "
            "local L3 child; register the function itself (w4.register(fn)), and use "
            "workers= for the SUB / chip callables of their inner Workers"
        )
    if remote and not isinstance(fn, (str, RemoteCallable)):
        raise TypeError(
            "cannot register into remote workers: pass an import path 'pkg.mod:fn' (a "
            f"local {type(fn).__name__} cannot cross hosts)"
        )
    if not remote and not local:
        raise ValueError(
            f"cannot register {spec.handle.name} into NEXT_LEVEL workers: none was added "
            "(add_worker / add_remote_worker first)"
        )
    return spec, kind, remote, local


def worker_row(
    worker_id: int, endpoint: Any, lane: Any, restarts: int, children: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """The ``list_workers`` row of one local L3 child, its subtree under ``children``."""
    child = endpoint.child
    alive = child is not None and not child.exited
    return {
        "kind": "l3",
        "worker_id": worker_id,
        "pid": child.pid if child is not None else None,
        "alive": alive,
        "state": "failed" if endpoint.poisoned else ("ready" if alive else "exited"),
        "poisoned": endpoint.poison_reason,
        "pipeline_depth": 1,
        "task_frames": 1,
        "active": lane is not None and lane.active is not None,
        "staged": False,
        "busy": bool(lane.inflight) if lane is not None else False,
        "tasks_completed": endpoint.tasks_completed,
        "restarts": restarts,
        "children": children or [],
    }
