"""The remote L3 children of one L4 ``Worker``: sessions, installed callables, rows.

::

    Worker(level=4).add_remote_worker(spec) -> worker id (shared with local L3 children)
      init():  local forks ... then RemoteFleet.open_all(deadline)    (one root deadline,
                 attach.open_session per remote, in parallel threads   never multiplied)
               -> one RemoteL3Endpoint per remote under a WorkerThread lane
      register(..., workers=[r]) -> manifest before init / two-phase control after init
      alloc_remote / copy_to_remote / copy_from_remote / free / import / release
               -> controls on that remote's ordered command lane (the buffer table:
                  remote_buffers.py, mixed into the fleet)
      a session fails -> reconnect (remote_reconnect.py) or give the worker up
      list_workers() -> rows(): one row per remote worker, its session and outage

The fleet owns no thread and no loop. Its controls are coroutines: when the
Scheduler is bound to a loop, that loop watches the endpoints' sockets and the
control awaits the reply it delivers; otherwise the endpoint pumps its own
sockets.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from simpler_daemon.callables import CallableSpec
from simpler_daemon.engine.registration import cleanup_uncertain, fan_out, register_failed

# CHUNK and _Buffer belong to the buffer table (remote_buffers.py); named here as before.
from simpler_daemon.engine.remote_buffers import CHUNK, RemoteBuffers, _Buffer  # noqa: F401
from simpler_daemon.engine.remote_reconnect import Outage, Reconnecting, Reconnector, Retired
from simpler_daemon.errors import ControlError, EndpointError, RegistrationError, StartupError
from simpler_daemon.remote import wire
from simpler_daemon.remote.spec import ReconnectPolicy, RemoteWorkerSpec

if TYPE_CHECKING:
    from simpler_daemon.scheduler.dispatch import Scheduler
    from simpler_daemon.scheduler.driver import Driver
    from simpler_daemon.scheduler.lanes import WorkerThread

log = logging.getLogger("simpler_daemon.remote")

#: What a control that failed on one remote worker raises (the others still get theirs).
_CONTROL_ERRORS: tuple[type[Exception], ...] = (ControlError, EndpointError, TimeoutError)
#: ``register_prepare`` also fails on a target the worker cannot import (``ValueError``).
_PREPARE_ERRORS = (*_CONTROL_ERRORS, ValueError)


@dataclass(slots=True)
class _Install:
    """A callable installed into some remote workers' inner L3 registries."""

    spec: CallableSpec
    kind: str
    workers: set[int]
    refcount: int = 1


class RemoteFleet(RemoteBuffers):
    """Every remote L3 worker of one L4 Worker (see the module docstring)."""

    def __init__(
        self, *, startup_timeout: float = 30.0, reconnect: bool | ReconnectPolicy = True
    ) -> None:
        self.startup_timeout = startup_timeout
        #: Open a new session when one fails (its buffers are lost; registrations
        #: replayed), with this backoff between failed attempts; None: never.
        self.policy: ReconnectPolicy | None = (
            reconnect
            if isinstance(reconnect, ReconnectPolicy)
            else ReconnectPolicy()
            if reconnect
            else None
        )
        self.reconnector = Reconnector(self, self.policy or ReconnectPolicy())
        self.specs: dict[int, RemoteWorkerSpec] = {}
        self.endpoints: dict[int, Any] = {}  # worker id -> RemoteL3Endpoint
        self.installs: dict[str, _Install] = {}
        #: hashid -> the workers whose unregister of it could not be confirmed (their
        #: session was dead): a later unregister retries there, a later register
        #: installs it afresh.
        self.uncertain: dict[str, set[int]] = {}
        self._init_buffers()  # buffers, deferred frees and releases (remote_buffers.py)
        #: Worker id -> generation of its live session (1 for the first, +1 per
        #: reconnect); absent while it has none. Every buffer ref names the generation it
        #: belongs to: one of any other generation is refused (its data is lost). The
        #: endpoints read this table at each dispatch.
        self.live: dict[int, int] = {}
        #: Worker id -> generation of its latest session (the next one gets + 1).
        self.generations: dict[int, int] = {}
        self.reconnects: dict[int, int] = {}
        #: Why a worker was given up (its session failed and no new one could be opened).
        self.gone: dict[int, str] = {}
        #: Workers retired on purpose (``retire``) and why; ``revive`` undoes it.
        self.retired: dict[int, str] = {}
        #: Worker ids taken for an address whose first session has not opened yet.
        self.reserved: set[int] = set()
        #: Only while the Worker serves are failed sessions replaced.
        self.serving = False
        self._scheduler: Scheduler | None = None
        self._driver: Driver | None = None
        #: ids of the failed endpoints whose session is being reopened.
        self._replacing: set[int] = set()

    # -- membership ---------------------------------------------------------------------

    def add(self, worker_id: int, spec: RemoteWorkerSpec) -> None:
        if not isinstance(spec, RemoteWorkerSpec):
            raise TypeError(
                f"cannot add a remote worker: expected a RemoteWorkerSpec, got {type(spec).__name__}"
            )
        self.specs[worker_id] = spec
        self.reconnects.setdefault(worker_id, 0)

    def is_remote(self, worker_id: int) -> bool:
        return worker_id in self.specs

    def endpoint(self, worker_id: int, what: str) -> Any:
        ep = self.endpoints.get(worker_id)
        outage = self.reconnector.outages.get(worker_id)
        if outage is not None and ep is not None and ep.poisoned:
            raise EndpointError(f"cannot {what}: {outage.describe(self.reconnector.clock())}")
        if ep is None:
            if worker_id in self.specs:
                raise EndpointError(f"cannot {what}: remote worker {worker_id} has no session")
            known = sorted(self.specs)
            raise ValueError(
                f"cannot {what}: worker={worker_id!r} is not a remote worker (remote: {known})"
            )
        return ep

    def check_workers(self, workers: list[int] | None, what: str) -> list[int]:
        """The target list of a registration: every remote worker when ``None``."""
        if workers is None:
            return sorted(self.specs)
        if not isinstance(workers, (list, tuple)) or any(
            isinstance(w, bool) or not isinstance(w, int) for w in workers
        ):
            raise TypeError(f"cannot {what}: workers= must be a list of worker ids")
        for w in workers:
            if w not in self.specs:
                raise ValueError(
                    f"cannot {what}: worker {w} is not a remote worker (remote: {sorted(self.specs)})"
                )
        return sorted(set(workers))

    # -- callables --------------------------------------------------------------------------

    def manifest_callables(self, worker_id: int) -> list[Any]:
        from simpler_daemon.remote.manifest import ManifestCallable

        # list() first: a reconnect thread reads this while the driving side registers.
        return [
            ManifestCallable(hashid=i.spec.handle.hashid, kind=i.kind, target=_target(i.spec))  # type: ignore[arg-type]
            for i in list(self.installs.values())
            if worker_id in i.workers
        ]

    def install(self, spec: CallableSpec, kind: str, workers: list[int]) -> None:
        """Before init: record; the manifests carry it to each session."""
        _target(spec)
        entry = self.installs.get(spec.handle.hashid)
        if entry is None:
            self.installs[spec.handle.hashid] = _Install(spec, kind, set(workers))
        else:
            _check_same_kind(entry, kind)
            entry.workers |= set(workers)
            entry.refcount += 1

    async def install_live(self, spec: CallableSpec, kind: str, workers: list[int]) -> None:
        """After init: prepare on every target, then commit on all, or abort on all.

        Raises ``RegistrationError(REGISTER_PARTIAL_FAILURE)`` naming each worker that
        failed (nothing stays installed), or ``REGISTER_CLEANUP_UNCERTAIN`` naming the
        workers whose abort or commit could not be confirmed (not used for it).
        """
        hashid = spec.handle.hashid
        entry = self.installs.get(hashid)
        if entry is not None:
            _check_same_kind(entry, kind)
        todo = [w for w in workers if entry is None or w not in entry.workers]
        prepare = wire.encode_payload(
            wire.RegisterPrepare(hashid=hashid, kind=kind, target=_target(spec))  # type: ignore[arg-type]
        )
        body = wire.encode_payload(wire.HashidBody(hashid=hashid))
        what = f"cannot register {spec.handle.name} on remote workers"
        prepared, failures = await self._control_each(
            todo, "register_prepare", prepare, errors=_PREPARE_ERRORS
        )
        if failures:
            _, uncertain = await self._control_each(
                prepared, "register_abort", body, label="abort failed: "
            )
            if uncertain:
                raise cleanup_uncertain(what, {**failures, **uncertain})
            raise register_failed(what, failures, {})
        committed, uncertain = await self._control_each(
            prepared, "register_commit", body, label="commit failed: "
        )
        if uncertain:
            _, undone = await self._control_each(
                committed, "unregister", body, label="rollback failed: "
            )
            raise cleanup_uncertain(
                what, {**uncertain, **undone}, " (those workers are not used for it)"
            )
        if entry is None:
            self.installs[hashid] = _Install(spec, kind, set(workers))
        else:
            entry.workers |= set(workers)
            entry.refcount += 1
        left = self.uncertain.get(hashid)
        if left is not None:  # installed afresh there: no longer uncertain
            left -= set(workers)
            if not left:
                del self.uncertain[hashid]

    def uninstall(self, hashid: str) -> list[int] | None:
        """Drop one reference; the workers to remove it from when it was the last one."""
        entry = self.installs.get(hashid)
        if entry is None:
            left = self.uncertain.pop(hashid, None)  # a retry of an unconfirmed unregister
            return sorted(left) if left else None
        entry.refcount -= 1
        if entry.refcount > 0:
            return []
        del self.installs[hashid]
        return sorted(entry.workers)

    async def uninstall_live(self, hashid: str, name: str, workers: list[int]) -> None:
        """Unregister ``hashid`` on ``workers``. A worker whose session is dead cannot
        confirm it: a WARNING, the hashid stays uncertain there (``uncertain``) and the
        unregister returns, as for a dead local child (a new session starts from the
        manifest, which no longer names it). A live worker's refusal raises
        ``REGISTER_CLEANUP_UNCERTAIN``; one that answers "not registered" holds nothing."""
        body = wire.encode_payload(wire.HashidBody(hashid=hashid))
        # A worker that has no session now (closing) is skipped.
        live = (w for w in workers if w in self.endpoints)
        _, failures = await self._control_each(live, "unregister", body)
        dead = {w: why for w, why in failures.items() if self._dead(w)}
        if dead:
            self.uncertain.setdefault(hashid, set()).update(dead)
            log.warning(
                "cannot confirm the unregister of %s on remote worker(s) %s (%s): the hashid "
                "stays uncertain there until it is registered or unregistered again",
                name,
                ", ".join(map(str, sorted(dead))),
                "; ".join(dead.values()),
            )
        rest = {
            w: why for w, why in failures.items() if w not in dead and "not registered" not in why
        }
        if rest:
            raise cleanup_uncertain(f"cannot unregister {name} from remote workers", rest)

    def _dead(self, worker_id: int) -> bool:
        """Whether worker ``worker_id``'s session is dead (failed, or given up)."""
        ep = self.endpoints.get(worker_id)
        return ep is None or ep.poisoned or worker_id in self.gone

    async def _control_each(
        self,
        workers: Iterable[int],
        name: str,
        body: bytes,
        *,
        errors: tuple[type[Exception], ...] = _CONTROL_ERRORS,
        label: str = "",
    ) -> tuple[list[int], dict[int, str]]:
        """Send control ``name`` to every worker at once: (those that confirmed it,
        ``{worker: label + why}`` for the others)."""
        return await fan_out(
            workers, lambda w: self.control(w, name, body), _same, errors=errors, label=label
        )

    # -- sessions ---------------------------------------------------------------------------

    def open_all(self, deadline: float) -> dict[int, Any]:
        """Open every session in parallel under ``deadline``; all or none (``StartupError``)."""
        todo = [w for w in sorted(self.specs) if w not in self.endpoints]
        if not todo:
            return {}
        opened: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        with ThreadPoolExecutor(max_workers=min(16, len(todo)), thread_name_prefix="attach") as ex:
            futures = {w: ex.submit(self.open_one, w, deadline) for w in todo}
            for w, fut in futures.items():
                try:
                    opened[w] = fut.result()
                except BaseException as exc:
                    errors[w] = exc
        if errors:
            for ep in opened.values():
                ep.shutdown(0.5)
            first = errors[min(errors)]
            msg = "; ".join(str(e) for _, e in sorted(errors.items()))
            raise StartupError(f"cannot start remote workers: {msg}") from first
        for w, ep in opened.items():
            self._adopt(w, ep)
        return opened

    def _adopt(self, worker_id: int, ep: Any) -> None:
        """``ep`` is worker ``worker_id``'s session from now on (on the driving side)."""
        self.endpoints[worker_id] = ep
        self.live[worker_id] = ep.generation
        self.generations[worker_id] = max(self.generations.get(worker_id, 0), ep.generation)

    def open_one(
        self,
        worker_id: int,
        deadline: float,
        callables: list[Any] | None = None,
        opened: list[socket.socket] | None = None,
    ) -> Any:
        """Open one session (blocking). ``opened`` collects its sockets as they are made,
        so ``shutdown`` can abort an attempt running on another thread."""
        from simpler_daemon.endpoints.remote import RemoteL3Endpoint
        from simpler_daemon.remote.attach import open_session

        spec = self.specs[worker_id]
        if callables is None:
            callables = self.manifest_callables(worker_id)
        # A failed attempt attached nothing: the next one may reuse its number.
        generation = self.generations.get(worker_id, 0) + 1
        session = open_session(spec, worker_id, callables, deadline, opened, generation)
        return RemoteL3Endpoint(worker_id, spec, session, live_sessions=self.live)

    # -- serving (after init) -----------------------------------------------------------------

    def serve(self, scheduler: Scheduler, driver: Driver) -> None:
        """Watch every session's sockets with ``driver``; lanes exist in ``scheduler`` now."""
        self._scheduler = scheduler
        self._driver = driver
        for ep in self.endpoints.values():
            self._watch(ep)

    def _watch(self, ep: Any) -> None:
        driver = self._driver
        assert driver is not None

        def readable(fd: int) -> Callable[[], None]:
            def read() -> None:
                ep.on_readable(fd)  # that lane only: the other one has nothing to read
                if ep.poisoned:
                    self._failed_idle(ep)

            return read

        ep.set_fd_watcher(driver.unwatch)
        for fd in ep.wake_fds():
            driver.watch(fd, readable(fd))

    def _unwatch(self, ep: Any) -> None:
        if self._driver is not None:
            for fd in ep.wake_fds():
                self._driver.unwatch(fd)

    def attach_live(self, worker_id: int, ep: Any) -> None:
        """A session opened after init joins the Scheduler as a new lane."""
        assert self._scheduler is not None
        self._adopt(worker_id, ep)
        self._scheduler.add_next_level(worker_id, ep)
        self._watch(ep)
        self._scheduler.wake()

    def _failed_idle(self, ep: Any) -> None:
        """A session failed while its lane had nothing in flight (no completion will say so)."""
        sched = self._scheduler
        if sched is None:
            return
        lane = sched.manager.next_level.get(ep.worker_id)
        if lane is not None and lane.endpoint is ep and not lane.inflight:
            self.lane_dead(lane)

    def lane_dead(self, lane: WorkerThread) -> None:
        """The Scheduler's verdict on a drained failed lane: reconnect, or give it up."""
        ep = lane.endpoint
        if lane.worker_id in self.retired:
            self._close_retired(lane)
            return
        if id(ep) in self._replacing or self._scheduler is None:
            return
        if lane.gone is not None and lane.worker_id not in self.reconnector.outages:
            return  # given up for good
        wid = lane.worker_id
        reason = f"{getattr(ep, 'label', wid)} failed: {getattr(ep, 'failure', '?')}"
        self._unwatch(ep)
        ep.close()  # type: ignore[attr-defined]  # a remote lane's endpoint
        self.forget_session(wid)
        if self.policy is None or not self.serving or self._driver is None:
            self._give_up(lane, reason)
            return
        # The new endpoint joins the lane on the driving side (``reopened``).
        self._replacing.add(id(ep))
        self.reconnector.start(lane, ep, reason)

    # -- retiring and reviving (server/discovery.py) -------------------------------------

    def retire(self, worker_id: int, reason: str) -> None:
        """On the driving side: worker ``worker_id`` leaves for good unless revived.

        Its running task fails with ENDPOINT_FAILURE naming ``reason`` (which names the
        host), work queued for it and new work naming it are refused (``lane.gone``),
        a reconnect under way stops, and its session ends (the runner sees EOF)."""
        if worker_id not in self.specs:
            raise ValueError(f"cannot retire worker {worker_id}: it is not a remote worker")
        self.retired[worker_id] = reason
        self.gone[worker_id] = reason
        self.reconnector.outages.pop(worker_id, None)
        log.warning("remote worker %d retired: %s", worker_id, reason)
        sched = self._scheduler
        lane = sched.manager.next_level.get(worker_id) if sched is not None else None
        if lane is None:
            return
        lane.gone = Retired(reason)
        ep = lane.endpoint
        if not ep.poisoned:
            ep.poison(f"retired: {reason}")  # type: ignore[attr-defined]  # a remote lane
        if not lane.inflight:
            self._close_retired(lane)
        assert sched is not None
        sched.wake()

    def _close_retired(self, lane: WorkerThread) -> None:
        """A retired lane is drained: close its session (idempotent)."""
        ep = lane.endpoint
        self._replacing.discard(id(ep))
        self._unwatch(ep)
        ep.close()  # type: ignore[attr-defined]  # a remote lane's endpoint
        self.forget_session(lane.worker_id)

    def revive(self, worker_id: int, ep: Any) -> None:
        """On the driving side: retired worker ``worker_id`` serves again with the new
        session ``ep`` (its address is back), under the same id and lane."""
        self.retired.pop(worker_id, None)
        self.gone.pop(worker_id, None)
        assert self._scheduler is not None
        lane = self._scheduler.manager.next_level[worker_id]
        self._adopt(worker_id, ep)
        lane.endpoint = ep
        lane.active = lane.staged = None
        lane.inflight = 0
        lane.gone = None
        self._watch(ep)
        log.warning("remote worker %d is back (session %d)", worker_id, ep.generation)
        self._scheduler.wake()

    def _give_up(self, lane: WorkerThread, reason: str) -> None:
        if lane.worker_id in self.retired:
            return  # retired meanwhile: its reason stands
        lane.gone = reason
        self.gone[lane.worker_id] = reason
        log.error("remote worker %d stays down: %s", lane.worker_id, reason)
        assert self._scheduler is not None
        self._scheduler.wake()

    # The reconnect thread's reports, run on the driving side (``Reconnector``).

    def backing_off(self, lane: WorkerThread, old: Any, outage: Outage) -> None:
        """An attempt failed: until the next one succeeds, work for the worker fails at
        once, naming its state (no run waits on a host that is down)."""
        if lane.worker_id in self.retired:
            return
        if lane.endpoint is old and self.reconnector.outages.get(lane.worker_id) is outage:
            lane.gone = Reconnecting(outage.describe(self.reconnector.clock()))
            assert self._scheduler is not None
            self._scheduler.wake()

    def give_up_outage(self, lane: WorkerThread, old: Any, reason: str) -> None:
        self._replacing.discard(id(old))
        self.reconnector.outages.pop(lane.worker_id, None)
        self._give_up(lane, reason)

    def reopened(self, lane: WorkerThread, old: Any, ep: Any) -> None:
        """A new session replaces the failed one under the same worker id."""
        self._replacing.discard(id(old))
        wid = lane.worker_id
        outage = self.reconnector.outages.pop(wid, None)
        if not self.serving:
            ep.shutdown(0.5)
            return
        if wid in self.retired:  # retired while the attempt ran: the runner must go
            ep.close()
            return
        self._adopt(wid, ep)
        lane.endpoint = ep
        lane.active = lane.staged = None
        lane.inflight = 0
        lane.gone = None
        self.reconnects[wid] = self.reconnects.get(wid, 0) + 1
        self._watch(ep)
        attempts = outage.attempts if outage is not None else 1
        log.warning(
            "remote worker %d reconnected (session %d, attempt %d) after: %s",
            wid,
            ep.generation,
            attempts,
            outage.reason if outage is not None else "?",
        )
        assert self._scheduler is not None
        self._scheduler.wake()

    def forget_session(self, worker_id: int) -> None:
        """A session ended: its buffers went with it (refs to them fail clearly).

        The failed endpoint stays in ``endpoints`` until a new session replaces it, so
        its row keeps the failure and controls fail with its reason."""
        self.live.pop(worker_id, None)
        self._drop_buffers_of(worker_id)

    def shutdown(self, timeout: float) -> None:
        """SHUTDOWN every session and close its sockets (runners then exit on their own)."""
        deadline = time.monotonic() + max(0.0, timeout)
        self.serving = False
        for ep in self.endpoints.values():
            self._unwatch(ep)
            try:
                ep.shutdown(min(2.0, max(0.05, deadline - time.monotonic())))
            except Exception:  # closing must go on for the others
                log.exception("remote worker %s: shutdown failed", ep.worker_id)
        # A session being reopened must not outlive us.
        self.reconnector.close(deadline)
        self.endpoints.clear()
        self.buffers.clear()

    # -- controls ---------------------------------------------------------------------------

    def catch_up(self) -> None:
        """Blocking API: apply what the reconnect threads handed over (a new session)
        now, so a control sees it without waiting for a Scheduler round."""
        driver = self._driver
        if driver is not None and driver.loop is None and driver.lock.held_here():
            driver.poll_now()

    async def control(self, worker_id: int, name: str, body: bytes) -> bytes:
        self.catch_up()
        ep = self.endpoint(worker_id, name)
        if self._deferred:
            await self._flush_deferred()
        try:
            return await self._send(ep, name, body)
        except (EndpointError, TimeoutError):
            if ep.poisoned:
                self._failed_idle(ep)  # no task completion will report it: reconnect now
            raise

    async def _send(self, ep: Any, name: str, body: bytes) -> bytes:
        # Bound: the loop that runs this coroutine reads the sockets and delivers the reply.
        # Unbound: nothing else reads them, so the endpoint pumps its own sockets.
        if self._driver is not None and self._driver.loop is not None:
            result: bytes = await ep.control_async(name, body)
        else:
            result = ep.control(name, body)
        return result

    # -- RemoteTensors (what the Orchestrator asks at submit) ----------------------------------

    def check_installed(self, handle: Any, targets: list[int], api: str) -> None:
        """A NEXT_LEVEL task for a remote worker must name an L3 orchestration installed
        there: refuse it at submit instead of failing it on the remote host."""
        entry = self.installs.get(handle.hashid)
        for w in targets:
            if w in self.specs and (entry is None or w not in entry.workers):
                where = sorted(entry.workers) if entry is not None else []
                raise ValueError(
                    f"cannot {api}: {handle.name} is not installed on remote worker {w} "
                    f"(installed on remote workers {where}); register "
                    f"RemoteCallable('pkg.mod:fn') with workers=[{w}]"
                )

    # -- introspection ------------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        driver = self._driver
        if driver is not None and driver.loop is None and driver.lock.acquire(blocking=False):
            # Blocking API between calls: nobody reads the sockets, so a session that died
            # while idle would still look ready. Read them now (without waiting).
            try:
                driver.poll_now()
            finally:
                driver.lock.release()
        rows: list[dict[str, Any]] = []
        now = self.reconnector.clock()
        for wid, spec in sorted(self.specs.items()):
            ep = self.endpoints.get(wid)
            stats: dict[str, Any] = ep.stats() if ep is not None else {}
            session = getattr(ep, "session", None)
            outage = self.reconnector.outages.get(wid)
            state = _state(ep, wid in self.gone, self.serving)
            reason = self.gone.get(wid) or getattr(ep, "failure", None)
            if wid in self.retired:
                state = "retired"
            if outage is not None and state == "failed":
                reason = outage.describe(now)
                if outage.backing_off:
                    state = "reconnecting"
            rows.append(
                {
                    "kind": "remote",
                    "worker_id": wid,
                    "endpoint": spec.endpoint,
                    "session_id": getattr(session, "session_id", 0),
                    "pid": getattr(session, "pid", 0),
                    "state": state,
                    "session_generation": getattr(ep, "generation", 0),
                    "health_age_s": ep.health_age() if ep is not None else None,
                    "round_trip_us": stats.get("round_trip_us"),
                    "failures": stats.get("failures", 0),
                    "tasks_completed": stats.get("tasks", 0),
                    "queued": stats.get("queued", 0),
                    "reconnects": self.reconnects.get(wid, 0),
                    "restarts": self.reconnects.get(wid, 0),
                    # The outage under way: attempts started, seconds to the next one.
                    "attempts": outage.attempts if outage is not None else 0,
                    "next_try_s": outage.next_try_s(now) if outage is not None else None,
                    "reason": reason,
                }
            )
        return rows


def _same(worker_id: int) -> int:
    return worker_id


def _target(spec: CallableSpec) -> str:
    if spec.import_path is None:
        raise TypeError(
            f"cannot install {spec.handle.name} into a remote worker: only import paths "
            "('pkg.mod:fn') can cross hosts, not a local function or lambda"
        )
    return spec.import_path


def _check_same_kind(entry: _Install, kind: str) -> None:
    if entry.kind != kind:
        raise RegistrationError(
            "HASHID_DESCRIPTOR_MISMATCH",
            f"cannot register {entry.spec.handle.name} as {kind}: it is registered on remote "
            f"workers as {entry.kind}",
        )


def _state(ep: Any, gone: bool, serving: bool) -> str:
    """ready / failed (the session failed: a first attempt to reopen it may be under
    way, or it was given up) / closed; ``rows`` says "reconnecting" once an attempt
    failed and the next one waits."""
    if ep is not None:
        return "failed" if ep.poisoned else "ready"
    return "failed" if gone or serving else "closed"
