"""The child pool: every local child process of one Worker, from fork to reap.

::

    ChildPool(heap, registry, driver)        owns heap, doorbell, mailboxes, children, endpoints
      start()    doorbell + one mailbox per child; fork SUB children, then chips, then the
                 nested L3 children of a level-4 Worker (each inits its own subtree inside)
                 (single-threaded) -> startup barrier (one deadline for all) -> fork server
                 any failure -> rollback: SHUTDOWN to ready children, SIGTERM to starting
                 ones, reap, unmap; StartupError names the child and why
      serve(s)   watch each child's pidfd on the driver (-> Scheduler.child_exited);
                 the Scheduler reports a drained dead lane -> on_lane_dead
      replace    fork server spawns a child on the same mailbox -> INIT_READY -> replay the
                 registrations made since init -> swap the lane's endpoint (3 attempts)
      stop(deadline) / release()   drain, SHUTDOWN, reap; close children, mailboxes, heap

Nothing here knows about runs; the Worker facade composes the pool with the
Scheduler and the driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Final, TypeVar

from simpler_daemon.callables import CallableRegistry, CallableSpec
from simpler_daemon.children.chip import ChipContext, run_chip_child
from simpler_daemon.children.forkserver import ForkServer
from simpler_daemon.children.nested import NestedContext, StatusPage, run_nested_child
from simpler_daemon.children.process import ChildProcess, fork_child, reap_all
from simpler_daemon.children.sub import ChildContext, run_child
from simpler_daemon.endpoints.local import LocalMailboxEndpoint
from simpler_daemon.engine.local_l3 import LocalL3Set, worker_row
from simpler_daemon.engine.registration import LocalTarget
from simpler_daemon.errors import ControlError, EndpointError, StartupError
from simpler_daemon.heap import Heap
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.doorbell import Doorbell
from simpler_daemon.mailbox.layout import BASE_FRAME, Mailbox, MailboxState
from simpler_daemon.scheduler.dispatch import Scheduler
from simpler_daemon.scheduler.driver import Driver
from simpler_daemon.scheduler.lanes import WorkerManager, WorkerThread, WorkerType
from simpler_daemon.taskvalues import DEFAULT_MAX_RESULT_BYTES

# The logger of the Worker these children belong to (their messages predate this module).
log = logging.getLogger("simpler_daemon.worker")

#: (kind "sub" / "chip" / "l3", index, mailbox, process) of a child forked by ``start``.
_Starting = tuple[str, int, Mailbox, ChildProcess]
_Ctx = TypeVar("_Ctx", bound=ChildContext)

#: Past the startup deadline, how long the barrier still waits for an L3 child's own
#: report (it gives up at the same deadline and names the grandchild that was late).
NESTED_REPORT_S: Final = 2.0


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold SIGINT (Ctrl-C) until the block is done, then deliver it: on the main thread,
    where Python runs signal handlers; elsewhere the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hits: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: hits.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old if old is not None else signal.SIG_DFL)
        if hits and callable(old):
            old(signal.SIGINT, None)


class ChildPool:
    """The SUB, chip and nested L3 children under one Worker, their mailboxes and the
    fork server."""

    def __init__(
        self,
        heap: Heap,
        registry: CallableRegistry,
        driver: Driver,
        *,
        num_sub_workers: int,
        num_chips: int,
        startup_timeout: float,
        child_spin_ns: int,
        chip_pipeline_depth: int,
        chip_trace_dir: str | None,
        restart_children: bool,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        sub_queue_depth: int = 2,
    ) -> None:
        self.heap = heap
        self.max_result_bytes = max_result_bytes
        #: 2: SUB children use a queue frame (``MailboxLoop.run``), and so do their endpoints.
        self.sub_queue_depth = sub_queue_depth
        self.registry = registry
        self._driver = driver
        self.num_sub_workers = num_sub_workers
        self.num_chips = num_chips
        self.startup_timeout = startup_timeout
        self.child_spin_ns = child_spin_ns
        self.chip_pipeline_depth = chip_pipeline_depth
        self.chip_trace_dir = chip_trace_dir
        self.restart_children = restart_children
        #: Test hooks: per-SUB-index callables run in the child before INIT_READY.
        self.init_hooks: dict[int, Callable[[], None]] = {}
        self.doorbell: Doorbell | None = None
        self.children: list[ChildProcess] = []
        self.mailboxes: list[Mailbox] = []
        self.sub_endpoints: list[LocalMailboxEndpoint] = []
        self.chip_endpoints: list[LocalMailboxEndpoint] = []
        #: Level 4: the local L3 children (added before init) and their endpoints.
        self.l3_endpoints: list[LocalMailboxEndpoint] = []
        self.l3 = LocalL3Set(self.l3_endpoints)
        self._l3_status: dict[int, StatusPage] = {}
        self.forkserver: ForkServer | None = None
        #: Replacement children started, by kind ("sub" / "chip", and "l3" at level 4).
        self.restarts: dict[str, int] = {"sub": 0, "chip": 0}
        #: Replace dead children only while the Worker serves (the facade keeps it in step).
        self.serving = False
        self._scheduler: Scheduler | None = None
        self._child_specs: dict[tuple[str, int], tuple[Any, Callable[[Any], int]]] = {}
        self._ready_pids: set[int] = set()  # passed the barrier; the rest are still starting
        self._replacing: set[int] = set()
        self._worker_restarts: dict[tuple[str, int], int] = {}
        #: Why each replaced child died last (its endpoint's poison reason), by (kind, id).
        self._restart_causes: dict[tuple[str, int], str] = {}
        self._pid = os.getpid()

    # -- startup ---------------------------------------------------------------------------------

    def start(self, check: Callable[[], None] | None = None, deadline: float | None = None) -> None:
        """Fork SUB children first, then chips, then nested L3 children; one startup
        deadline for all of them (an L3 child inits its subtree within it): ``deadline``
        (``time.monotonic()``), ``startup_timeout`` after the call of ``init()``.

        On any failure every child is stopped and reaped, and ``StartupError`` raised;
        an interruption (``KeyboardInterrupt``) propagates as itself once that is done.
        ``check()`` runs while waiting for the children; what it raises (a close
        requested meanwhile) fails the start.
        """
        self.doorbell = Doorbell()
        specs = {
            role: [e.spec for e in self.registry.active() if e.spec.handle.role == role]
            for role in ("sub", "chip")
        }
        l3_specs = self.l3.fork_specs(self.registry)
        if self.l3.workers:
            self.restarts.setdefault("l3", 0)
        if deadline is None:
            deadline = time.monotonic() + self.startup_timeout
        starting: list[_Starting] = []
        self._ready_pids = set()
        try:
            # A Ctrl-C between a fork and its bookkeeping would lose that child: it is
            # held until every child is forked and known (then rolled back).
            with _sigint_deferred():
                for i in range(self.num_sub_workers):
                    ctx = self._context(
                        ChildContext,
                        i,
                        f"sub worker {i}",
                        specs["sub"],
                        init_hook=self.init_hooks.get(i),
                        task_frames=self.sub_queue_depth,
                    )
                    self._fork(starting, "sub", ctx, run_child)
                for j in range(self.num_chips):
                    trace = (
                        os.path.join(self.chip_trace_dir, f"chip-{j}.jsonl")
                        if self.chip_trace_dir
                        else None
                    )
                    chip_ctx = self._context(
                        ChipContext,
                        j,
                        f"chip {j}",
                        specs["chip"],
                        error_prefix="chip_worker",
                        pipeline_depth=self.chip_pipeline_depth,
                        trace_path=trace,
                    )
                    self._fork(starting, "chip", chip_ctx, run_chip_child)
                for wid, inner in sorted(self.l3.workers.items()):
                    page = self._l3_status[wid] = StatusPage()
                    nctx = self._context(
                        NestedContext,
                        wid,
                        f"child worker {wid}",
                        l3_specs,
                        inner=inner,
                        deadline=deadline,
                        startup_timeout=self.startup_timeout,
                        status=page,
                    )
                    # A replacement gets a fresh budget, not what is left of init's deadline.
                    respawn = dataclasses.replace(nctx, deadline=0.0)
                    self._fork(starting, "l3", nctx, run_nested_child, respawn)
            self._startup_barrier(starting, deadline, check)
            if self.restart_children:
                # Last fork of init: later replacements come from this single-threaded server.
                with _sigint_deferred():
                    self.forkserver = ForkServer(self._child_specs)
                    self.forkserver.start()
        except BaseException as exc:
            with _sigint_deferred():  # a second Ctrl-C must not leave children behind
                if self.forkserver is not None:
                    self.forkserver.close(2.0)
                    self.forkserver = None
                self._rollback_children(starting)
            # Ctrl-C stays a KeyboardInterrupt (an `except Exception` must not swallow it).
            if isinstance(exc, StartupError) or not isinstance(exc, Exception):
                raise
            raise StartupError(f"cannot start worker: {type(exc).__name__}: {exc}") from exc
        for kind, index, mb, child in starting:
            if kind == "sub":
                sub_ep = LocalMailboxEndpoint(
                    index,
                    mb,
                    child,
                    label=child.label,
                    marks_pickup=True,
                    queue_frame=self.sub_queue_depth == 2,
                )
                sub_ep.max_result_bytes = self.max_result_bytes
                self.sub_endpoints.append(sub_ep)
            elif kind == "l3":
                self.l3_endpoints.append(LocalMailboxEndpoint(index, mb, child, label=child.label))
            else:
                frames = 2 if mb.pipeline_depth() >= 2 else 1
                self.chip_endpoints.append(
                    LocalMailboxEndpoint(
                        index, mb, child, task_frame_count=frames, label=child.label
                    )
                )

    def _context(
        self, cls: type[_Ctx], index: int, label: str, specs: list[CallableSpec], **extra: Any
    ) -> _Ctx:
        """A context of ``cls`` on a new mailbox: what every child gets, plus ``extra``."""
        assert self.doorbell is not None
        mb = Mailbox()
        self.mailboxes.append(mb)
        return cls(
            worker_id=index,
            label=label,
            mailbox=mb,
            heap=self.heap,
            doorbell=self.doorbell,
            specs=specs,
            parent_pid=self._pid,
            spin_ns=self.child_spin_ns,
            max_result_bytes=self.max_result_bytes,
            **extra,
        )

    def _fork(
        self,
        starting: list[_Starting],
        kind: str,
        ctx: ChildContext,
        run: Callable[[Any], int],
        respawn: ChildContext | None = None,
    ) -> None:
        """Fork the child that runs ``run(ctx)``; the fork server replaces it with
        ``run(respawn or ctx)``."""
        child = fork_child(lambda: run(ctx), ctx.label)
        self.children.append(child)
        starting.append((kind, ctx.worker_id, ctx.mailbox, child))
        self._child_specs[(kind, ctx.worker_id)] = (respawn if respawn is not None else ctx, run)

    def forget_callables(self) -> None:
        """The Worker closed: drop the callables the children were forked with (their
        contexts) and the local L3 installs, so nothing here keeps them alive."""
        self._child_specs.clear()
        self.l3.forget()

    def _startup_barrier(
        self,
        starting: list[_Starting],
        deadline: float,
        check: Callable[[], None] | None = None,
    ) -> None:
        pending = list(starting)
        delay = 0.0002
        # An L3 child inits its subtree under the same deadline and reports which
        # grandchild was late: past the deadline its report is waited for a moment.
        report_by = deadline + (NESTED_REPORT_S if any(e[0] == "l3" for e in starting) else 0.0)
        while pending:
            if check is not None:
                check()
            for entry in list(pending):
                _, _, mb, child = entry
                # Sample the exit first: a child that published INIT_FAILED and then
                # exited must be reported with its reason, not as a bare exit.
                exited = child.poll()
                st = mb.state(BASE_FRAME)
                if st == MailboxState.INIT_READY:
                    mb.cas_state(BASE_FRAME, MailboxState.INIT_READY, MailboxState.IDLE)
                    _mb.wake_child(mb.buf)
                    pending.remove(entry)
                    self._ready_pids.add(child.pid)
                elif st == MailboxState.INIT_FAILED:
                    raise StartupError(
                        f"cannot start worker: {child.label} (pid {child.pid}) failed to "
                        f"initialize: {mb.error_text(BASE_FRAME)}"
                    )
                elif exited:
                    raise StartupError(f"cannot start worker: {child.describe()} during init")
            if not pending:
                break
            now = time.monotonic()
            if now > deadline and (now > report_by or all(e[0] != "l3" for e in pending)):
                names = ", ".join(f"{c.label} (pid {c.pid})" for _, _, _, c in pending)
                raise StartupError(
                    f"cannot start worker: {names} not ready within startup_timeout="
                    f"{self.startup_timeout:g} s: waited "
                    f"{now - (deadline - self.startup_timeout):.2f} s since init() was called"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _rollback_children(self, starting: list[_Starting]) -> None:
        """SHUTDOWN to ready children, SIGTERM to starting ones, SIGKILL survivors."""
        for _, _, mb, child in starting:
            if child.poll():
                continue
            # A starting child's base frame is IDLE too (before INIT_READY): only the
            # barrier knows which children are ready.
            if (
                child.pid not in self._ready_pids
                and mb.state(BASE_FRAME) != MailboxState.INIT_READY
            ):
                child.signal_group(signal.SIGTERM)
            mb.request_shutdown()
        reap_all(self.children, 2.0)
        for c in self.children:
            c.close()
        self.children.clear()
        self.sub_endpoints.clear()
        self.chip_endpoints.clear()
        self.l3_endpoints.clear()
        for mb in self.mailboxes:
            mb.close()
        self.mailboxes.clear()
        self._close_status()
        if self.doorbell is not None:
            self.doorbell.close()
            self.doorbell = None

    def serve(self, scheduler: Scheduler) -> None:
        """Feed ``scheduler``: report child exits to it and replace its dead lanes; restart
        a fork server that dies (see children/forkserver.py)."""
        self._scheduler = scheduler
        for child in self.children:
            self._watch_exit(child)
        if self.forkserver is not None:
            self.restarts.setdefault("forkserver", 0)
            for proc in self.forkserver.processes:
                self._watch_forkserver(proc)
            scheduler.on_lane_dead = self._on_lane_dead

    def _watch_exit(self, child: ChildProcess) -> None:
        """Tell the Scheduler the moment ``child`` exits (its pidfd becomes readable)."""
        fd = child.pidfd
        sched = self._scheduler
        if fd is None or sched is None:
            return

        def exited() -> None:
            self._driver.unwatch(fd)  # a pidfd stays readable: report the exit once
            child.unwatched()  # closes a reaped child's pidfd: no watch names it now
            sched.child_exited(child)

        self._driver.watch(fd, exited)
        child.watched = True  # a reap elsewhere leaves the fd open until ``exited``

    # -- the fork servers ----------------------------------------------------------------------------

    #: Why no child can be replaced any more (every fork server is gone); None while one runs.
    _forkserver_down: str | None = None

    def _watch_forkserver(self, proc: ChildProcess) -> None:
        fd = proc.pidfd
        if fd is None:
            return

        def died() -> None:
            self._driver.unwatch(fd)
            proc.unwatched()
            self._forkserver_died(proc)

        self._driver.watch(fd, died)
        proc.watched = True

    def _forkserver_died(self, proc: ChildProcess) -> None:
        """A fork server died: have the survivor fork a successor (bounded by
        FORKSERVER_RESTARTS in FORKSERVER_WINDOW_S); once none is left, fail what
        needs a replacement instead of waiting for one."""
        proc.poll()  # reap: the message names the real status
        fs = self.forkserver
        if fs is None or not self.serving:
            return
        log.warning("%s", proc.describe())
        try:
            new = fs.replenish()
        except StartupError as exc:
            if fs.process is None:
                self._forkserver_lost(f"{proc.describe()}; {exc}")
            else:  # the survivor still serves replacements
                log.error("%s", exc)
            return
        if new is not None:
            self.restarts["forkserver"] = self.restarts.get("forkserver", 0) + 1
            self._watch_forkserver(new)
            log.warning("fork server restarted: pid %d replaces pid %d", new.pid, proc.pid)

    def _forkserver_lost(self, reason: str) -> None:
        """No fork server is left: dead lanes stay down, and work for them fails."""
        text = f"no fork server is left to replace it ({reason})"
        self._forkserver_down = text
        log.error("children can no longer be replaced: %s", text)
        sched = self._scheduler
        if sched is None:
            return
        # A lane marked gone no longer counts as coming back: the Scheduler fails the work
        # that waits for it with this reason (later deaths get it in ``_replace``).
        for lane in sched.manager.lanes:
            ep = lane.endpoint
            if isinstance(ep, LocalMailboxEndpoint) and ep.poisoned and lane.gone is None:
                lane.gone = f"cannot replace {ep.label}: {text}"
        sched.wake()

    # -- replacing dead children ------------------------------------------------------------------

    def _on_lane_dead(self, lane: WorkerThread) -> None:
        # A lane can be reported more than once for the same death (pidfd and the
        # endpoint failure of its last task): replace each dead endpoint once.
        ep = lane.endpoint
        if not self.serving or id(ep) in self._replacing:
            return
        self._replacing.add(id(ep))
        self._driver.start_soon(lambda: self._replace_async(lane, ep))

    async def _replace_async(self, lane: WorkerThread, old: Any) -> None:
        """Fork a replacement through the fork server, replay registrations, re-enable the lane."""
        try:
            await self._replace(lane, old)
        finally:
            self._replacing.discard(id(old))

    async def _replace(self, lane: WorkerThread, old: Any) -> None:
        assert self.forkserver is not None and self._scheduler is not None
        if lane.endpoint is not old or not old.poisoned:
            return  # already replaced
        if any(ep is old for ep in self.l3_endpoints):
            kind = "l3"
        else:
            kind = "chip" if lane.worker_type is WorkerType.NEXT_LEVEL else "sub"
        assert isinstance(old, LocalMailboxEndpoint)
        mb = old.mailbox
        ctx, _ = self._child_specs[(kind, lane.worker_id)]
        if self._forkserver_down is not None:
            self._give_up(lane, f"cannot replace {old.label}: {self._forkserver_down}")
            return
        error: str | None = None
        for attempt in range(1, 4):
            if not self.serving:
                return
            _mb.write_bytes(mb.buf, 0, bytes(len(mb.buf)))  # every frame IDLE, shutdown word 0
            try:
                pid = self.forkserver.spawn(kind, lane.worker_id)
            except StartupError as exc:
                if self.forkserver.process is None:
                    self._forkserver_lost(str(exc))
                self._give_up(lane, str(exc))
                return
            # The fork server forks it as our own child (CLONE_PARENT): we reap it.
            child = ChildProcess(pid, old.label)
            self.children.append(child)
            error = await self._await_init(mb, child, time.monotonic() + self.startup_timeout)
            if error is None:
                break
            log.warning("replacement %d of %s failed: %s", attempt, old.label, error)
            child.signal_group(signal.SIGKILL)
        else:
            self._give_up(lane, f"{old.label} stays down after 3 failed replacements: {error}")
            return
        ep = LocalMailboxEndpoint(
            lane.worker_id,
            mb,
            child,
            task_frame_count=old.caps.task_frame_count,
            label=old.label,
            marks_pickup=old.marks_pickup,
            queue_frame=old.queue_frame,
        )
        ep.max_result_bytes = old.max_result_bytes
        try:
            if kind == "l3":
                await self.l3.replay(ep, ctx.specs, self.registry)
            else:
                await self._replay(ep, "chip" if kind == "chip" else "sub", ctx.specs)
        except (ControlError, EndpointError) as exc:
            log.error("%s replacement could not replay registrations: %s", old.label, exc)
            ep.request_stop()
            return
        # Swap: the lane becomes schedulable again only now.
        lane.endpoint = ep
        lane.active = lane.staged = None
        lane.inflight = 0
        lane.missing.clear()  # the replay installed everything registered
        by_kind = {"chip": self.chip_endpoints, "sub": self.sub_endpoints, "l3": self.l3_endpoints}
        eps = by_kind[kind]
        eps[eps.index(old)] = ep
        self.restarts[kind] += 1
        key = (kind, lane.worker_id)
        self._worker_restarts[key] = self._worker_restarts.get(key, 0) + 1
        self._restart_causes[key] = str(old.poison_reason or "")
        self._watch_exit(child)
        old.replaced(child.pid)  # the one WARNING line of a replacement
        self._scheduler.wake()

    def _give_up(self, lane: WorkerThread, reason: str) -> None:
        """``lane`` will not come back: the Scheduler fails what waits for it."""
        log.error("%s", reason)
        lane.gone = reason
        if self._scheduler is not None:
            self._scheduler.wake()

    async def _replay(self, ep: LocalMailboxEndpoint, role: str, inherited: list[Any]) -> None:
        """The child inherited the callables of init time: install what was registered
        since (until nothing new appears), then drop what was unregistered since."""
        target = LocalTarget(ep)
        had = {s.handle.hashid for s in inherited}
        replayed: set[str] = set()
        while True:
            todo = [
                e.spec
                for e in self.registry.active()
                if e.spec.handle.role == role and e.spec.handle.hashid not in had | replayed
            ]
            if not todo:
                break
            for spec in todo:
                await target.install(spec)
                replayed.add(spec.handle.hashid)
        active = {e.spec.handle.hashid for e in self.registry.active()}
        for spec in inherited:
            if spec.handle.hashid not in active:
                await target.uninstall(spec)

    async def _await_init(self, mb: Mailbox, child: ChildProcess, deadline: float) -> str | None:
        delay = 0.0005
        while True:
            exited = child.poll()
            st = mb.state(BASE_FRAME)
            if st == MailboxState.INIT_READY:
                mb.cas_state(BASE_FRAME, MailboxState.INIT_READY, MailboxState.IDLE)
                _mb.wake_child(mb.buf)
                return None
            if st == MailboxState.INIT_FAILED:
                return mb.error_text(BASE_FRAME)
            if exited:
                return f"{child.describe()} during init"
            if time.monotonic() > deadline:
                return f"not ready within {self.startup_timeout:.1f}s"
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.01)

    # -- introspection ------------------------------------------------------------------------------

    def registration_targets(self, role: str, *, nested: bool = True) -> list[Any]:
        """Live children of ``role`` (a dead one's replacement replays registrations);
        at level 4 every local L3 child receives the SUB and orchestration callables
        (``nested=False``: not a RemoteCallable's)."""
        l3 = self.l3.targets(role) if nested else []
        if role == "sub":
            out: list[Any] = [LocalTarget(ep) for ep in self.sub_endpoints if not ep.poisoned]
            out += l3
        elif role == "chip":
            out = [LocalTarget(ep) for ep in self.chip_endpoints if not ep.poisoned]
        else:
            out = l3
        # Each control goes through the child's lane: queued behind a busy child's task
        # (``delivery.py``), the lane taking no task until it was delivered. Only on a
        # loop whose tasks go on after the caller returned (``Driver.keeps_tasks``): the
        # bound one, or the blocking API's auxiliary loop, whose leftover tasks whoever
        # drives the Scheduler steps (a waiting caller, the background driver thread).
        sched = self._scheduler
        if sched is not None and self._keeps_tasks():
            lanes = {id(lane.endpoint): lane for lane in sched.manager.lanes}
            for target in out:
                target.lane = lanes.get(id(target.endpoint))
                target.wake = sched.wake
        return out

    def _keeps_tasks(self) -> bool:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        return self._driver.keeps_tasks(loop)

    def list_workers(self, manager: WorkerManager | None) -> list[dict[str, Any]]:
        """One row per child: kind, id, pid, liveness, pipeline depth and lane state."""
        out = []
        for kind, eps in (("chip", self.chip_endpoints), ("sub", self.sub_endpoints)):
            for ep in eps:
                lane = None
                if manager is not None:
                    lane = (
                        manager.next_level.get(ep.worker_id)
                        if kind == "chip"
                        else manager.get_worker_by_id(WorkerType.SUB, ep.worker_id)
                    )
                out.append(
                    {
                        "kind": kind,
                        "worker_id": ep.worker_id,
                        "pid": ep.child.pid if ep.child else None,
                        "alive": ep.child is not None and not ep.child.exited,
                        "poisoned": ep.poison_reason,
                        "pipeline_depth": ep.mailbox.pipeline_depth() if kind == "chip" else 1,
                        "task_frames": ep.caps.task_frame_count,
                        "active": lane is not None and lane.active is not None,
                        "staged": lane is not None and lane.staged is not None,
                        "busy": bool(lane.inflight) if lane is not None else False,
                        "tasks_completed": ep.tasks_completed,
                        "restarts": self._worker_restarts.get((kind, ep.worker_id), 0),
                        "last_restart_cause": self._restart_causes.get((kind, ep.worker_id), ""),
                        "current_task": lane.current_task() if lane is not None else "",
                    }
                )
        for ep in self.l3_endpoints:
            page = self._l3_status.get(ep.worker_id)
            lane = manager.next_level.get(ep.worker_id) if manager is not None else None
            row = worker_row(
                ep.worker_id,
                ep,
                lane,
                self._worker_restarts.get(("l3", ep.worker_id), 0),
                page.read() if page is not None else None,
            )
            row["last_restart_cause"] = self._restart_causes.get(("l3", ep.worker_id), "")
            row["current_task"] = lane.current_task() if lane is not None else ""
            out.append(row)
        return out

    # -- stop ---------------------------------------------------------------------------------------

    def request_shutdown(self) -> None:
        for mb in self.mailboxes:
            mb.request_shutdown()

    def stop(self, deadline: float) -> None:
        """Progress until every frame is terminal (lanes already stopped), then SHUTDOWN
        every child and reap them and the fork server."""
        sched = self._scheduler
        assert sched is not None
        while sched.busy() and time.monotonic() < deadline:
            self.request_shutdown()
            self._driver.drive_until(
                lambda: not sched.busy(), min(0.05, max(0.0, deadline - time.monotonic()))
            )
        self._shutdown_and_reap(deadline, "close")

    def _shutdown_and_reap(self, deadline: float, what: str) -> None:
        """SHUTDOWN to every child, reap them (each reap also SIGKILLs what is left in
        the child's process group: a grandchild a task forked), then the fork servers."""
        self.request_shutdown()
        for msg in reap_all(self.children, max(0.5, deadline - time.monotonic())):
            log.warning("%s: %s", what, msg)
        if self.forkserver is not None:
            for proc in self.forkserver.processes:
                if proc.watched and proc.pidfd is not None:
                    self._driver.unwatch(proc.pidfd)  # before close frees its number
                    proc.unwatched()
            for msg in self.forkserver.close(max(0.5, deadline - time.monotonic())):
                log.warning("%s: %s", what, msg)

    def abort(self) -> None:
        """Undo a successful ``start`` (a later step of init failed): stop, reap, release."""
        self._shutdown_and_reap(time.monotonic() + 2.0, "init rollback")
        self.release()

    def release(self) -> None:
        """Close every child handle, mailbox, the doorbell and the heap."""
        for c in self.children:
            c.close()
        for mb in self.mailboxes:
            mb.close()
        if self.doorbell is not None:
            self.doorbell.close()
        self.release_memory()

    def release_memory(self) -> None:
        """Unmap the heap (no child was started, or ``start`` already rolled back), the
        status pages and the nested L3 Workers' own heaps in this process."""
        self._close_status()
        self.l3.close()
        self.heap.close()

    def _close_status(self) -> None:
        for page in self._l3_status.values():
            page.close()
        self._l3_status.clear()
