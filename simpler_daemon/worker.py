"""The public ``Worker``: a pool of pre-forked children and the Scheduler that feeds them.

::

    Worker(level=3, num_sub_workers=N)
      register(fn) ----------------------> parent registry (snapshot children inherit)
      init():  map heap + mailboxes, fork every child (single-threaded), startup barrier
      run(orch): Run -> admission -> orch(o, args, config) -> slots -> Scheduler coroutine
                                                              |  (mailboxes, one per child)
                                                              v
                                                     SUB children: fn(args)

The Scheduler is one coroutine. Used synchronously (``run``/``submit``/``wait``),
the Worker drives a private event loop on the calling thread; used from a
running loop (``run_async``) it binds to that loop. One Worker uses one style.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import logging
import os
import select
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import numpy as np

from simpler_daemon import _mailbox as _mb
from simpler_daemon.args import DEFAULT_CONFIG, CallConfig, TaskArgs
from simpler_daemon.callables import (
    CallableHandle,
    CallableRegistry,
    CallableSpec,
    spec_for_chip,
    spec_for_import,
    spec_for_object,
)
from simpler_daemon.children.chip import ChipContext, run_chip_child
from simpler_daemon.children.forkserver import ForkServer
from simpler_daemon.children.loop import ChildContext, run_child
from simpler_daemon.children.process import ChildProcess, fork_child, reap_all
from simpler_daemon.doorbell import Doorbell
from simpler_daemon.endpoints.local import LocalMailboxEndpoint
from simpler_daemon.errors import (
    ControlError,
    EndpointError,
    RegistrationError,
    RunCancelled,
    StartupError,
    WorkerClosedError,
)
from simpler_daemon.heap import Heap
from simpler_daemon.mailbox import BASE_FRAME, ControlOp, Mailbox, MailboxState
from simpler_daemon.manager import WorkerManager, WorkerThread, WorkerType
from simpler_daemon.orchestrator import Orchestrator, Run, RunState
from simpler_daemon.scheduler import Scheduler

log = logging.getLogger("simpler_daemon.worker")

Orch = Callable[[Orchestrator, Any, CallConfig], Any]
Kind = Literal["sub", "chip", "orchestration"]


class WorkerState(enum.Enum):
    NEW = "NEW"
    INITIALIZING = "INITIALIZING"
    READY = "READY"
    FAILED = "FAILED"
    CLOSED = "CLOSED"


class RunHandle:
    """A submitted run: ``done()``, ``wait(timeout)``, ``result()``, ``cancel()``."""

    def __init__(self, worker: Worker, run: Run) -> None:
        self._worker = worker
        self.run = run

    @property
    def run_id(self) -> int:
        return self.run.run_id

    @property
    def state(self) -> RunState:
        return self.run.state

    def done(self) -> bool:
        return self.run.terminal

    def wait(self, timeout: float | None = None) -> None:
        """Block until the run is terminal; raise its error.

        Raises ``TimeoutError`` when ``timeout`` expires first, ``TaskError`` when it failed.
        """
        self._worker._wait_run(self.run, timeout)
        self.result()

    def result(self) -> None:
        """``None`` for a completed run; raises its error; ``InvalidStateError`` while running."""
        run = self.run
        if not run.terminal:
            raise asyncio.InvalidStateError(f"run {run.run_id} is {run.state.name}")
        orch_exc = getattr(run, "orch_exception", None)
        if orch_exc is not None:
            raise orch_exc
        run.raise_if_failed()

    async def wait_async(self, timeout: float | None = None) -> None:
        await self._worker._wait_run_async(self.run, timeout)
        self.result()

    def cancel(self) -> None:
        self._worker.cancel(self)

    def __repr__(self) -> str:
        return f"RunHandle(run_id={self.run_id}, state={self.run.state.name})"


class Worker:
    """A level-3 node: SUB workers (Python callables) under one Scheduler.

    ``num_sub_workers`` defaults to the CPU count. ``heap_bytes`` sizes the
    shared heap, mapped now so arrays allocated before ``init`` are shared too;
    ``heap_name`` makes it a ``/dev/shm`` file other local processes may map
    (unlinked at close).
    """

    def __init__(
        self,
        level: int = 3,
        num_sub_workers: int | None = None,
        num_chips: int = 0,
        *,
        heap_bytes: int = 64 << 20,
        heap_name: str | None = None,
        startup_timeout: float = 30.0,
        close_timeout: float = 10.0,
        child_spin_ns: int = 50_000,
        scheduler_spin_s: float = 0.0002,
        pipeline_depth: int | None = None,
        chip_pipeline_depth: int = 2,
        chip_trace_dir: str | None = None,
        restart_children: bool = True,
    ) -> None:
        if level not in (3, 4):
            raise ValueError(f"cannot create Worker: level={level!r} must be 3 (node) or 4 (pod)")
        if num_sub_workers is None:
            num_sub_workers = os.cpu_count() or 1
        if (
            isinstance(num_sub_workers, bool)
            or not isinstance(num_sub_workers, int)
            or num_sub_workers < 0
        ):
            raise ValueError(
                f"cannot create Worker: num_sub_workers={num_sub_workers!r} must be an int >= 0"
            )
        if isinstance(num_chips, bool) or not isinstance(num_chips, int) or num_chips < 0:
            raise ValueError(f"cannot create Worker: num_chips={num_chips!r} must be an int >= 0")
        if chip_pipeline_depth not in (1, 2):
            raise ValueError(
                f"cannot create Worker: chip_pipeline_depth={chip_pipeline_depth!r} must be 1 or 2"
            )
        if num_sub_workers == 0 and num_chips == 0:
            raise ValueError("cannot create Worker: it needs at least one SUB worker or chip")
        self.level = level
        self.num_sub_workers = num_sub_workers
        self.num_chips = num_chips
        self.startup_timeout = startup_timeout
        self.close_timeout = close_timeout
        self.child_spin_ns = child_spin_ns
        self.scheduler_spin_s = scheduler_spin_s
        self.pipeline_depth = pipeline_depth
        self.chip_pipeline_depth = chip_pipeline_depth
        self.chip_trace_dir = chip_trace_dir
        self.restart_children = restart_children
        self.forkserver: ForkServer | None = None
        self._child_specs: dict[tuple[str, int], tuple[Any, Callable[[Any], int]]] = {}
        self._dead_lanes: list[tuple[WorkerThread, Any]] = []
        self._replacing: set[int] = set()
        #: Replacement children started, by kind ("sub" / "chip").
        self.restarts: dict[str, int] = {"sub": 0, "chip": 0}
        self._worker_restarts: dict[tuple[str, int], int] = {}
        self.state = WorkerState.NEW
        self.heap = Heap(heap_bytes, name=heap_name)
        self.registry = CallableRegistry()
        self.children: list[ChildProcess] = []
        self.mailboxes: list[Mailbox] = []
        self.sub_endpoints: list[LocalMailboxEndpoint] = []
        self.chip_endpoints: list[LocalMailboxEndpoint] = []
        self.doorbell: Doorbell | None = None
        self.manager: WorkerManager | None = None
        self.scheduler: Scheduler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aux_loop: asyncio.AbstractEventLoop | None = None
        self._drive_lock = threading.RLock()
        self._pending_builds: list[Run] = []
        self._poll: select.poll | None = None
        self._pidfd_child: dict[int, ChildProcess] = {}
        self._pid = os.getpid()
        #: Test hooks: per-SUB-index callables run in the child before INIT_READY.
        self._init_hooks: dict[int, Callable[[], None]] = {}

    @property
    def endpoints(self) -> list[LocalMailboxEndpoint]:
        """Every local endpoint: chips first, then SUB workers."""
        return [*self.chip_endpoints, *self.sub_endpoints]

    # -- registration ------------------------------------------------------------------------------

    def register(
        self, fn: Callable[..., Any] | str, kind: Kind = "sub", workers: list[int] | None = None
    ) -> CallableHandle:
        """Register a callable (object or ``"pkg.mod:fn"``) and return its handle.

        ``kind``: ``"sub"`` (runs on SUB workers), ``"chip"`` (a chip kernel),
        ``"orchestration"`` (runs in the parent). Before ``init`` the callable
        enters the snapshot children inherit; after, it is broadcast to every
        target child, and a partial failure is rolled back
        (``RegistrationError(REGISTER_PARTIAL_FAILURE)``).
        """
        self._check_usable("register")
        spec = self._spec(fn, kind)
        if self.state is WorkerState.NEW:
            if self.registry.begin_register(spec, frozenset()):
                self.registry.commit_register(spec.handle.hashid)
            return spec.handle
        return self._drive(self.register_async(fn, kind))  # type: ignore[no-any-return]

    async def register_async(
        self, fn: Callable[..., Any] | str, kind: Kind = "sub"
    ) -> CallableHandle:
        """``register`` after ``init`` without blocking the event loop."""
        self._check_ready("register")
        spec = self._spec(fn, kind)
        targets = self._targets_for(spec)
        if not self.registry.begin_register(spec, frozenset(range(len(targets)))):
            return spec.handle
        done: list[LocalMailboxEndpoint] = []
        failures: dict[int, str] = {}
        for ep in targets:
            try:
                await self._register_on(ep, spec)
                done.append(ep)
            except (ControlError, EndpointError) as exc:
                failures[ep.worker_id] = str(exc)
        if failures:
            cleanup: dict[int, str] = {}
            undo = ControlOp.UNREGISTER_CHIP if spec.handle.role == "chip" else ControlOp.UNREGISTER
            for ep in done:
                try:
                    await ep.control(undo, spec.handle.digest)
                except (ControlError, EndpointError) as exc:
                    cleanup[ep.worker_id] = str(exc)
            self.registry.abort_register(spec.handle.hashid)
            detail = "; ".join(f"worker {w}: {m}" for w, m in failures.items())
            if cleanup:
                raise RegistrationError(
                    "REGISTER_CLEANUP_UNCERTAIN",
                    f"cannot register {spec.handle.name}: {detail}; rollback also failed on "
                    + "; ".join(f"worker {w}: {m}" for w, m in cleanup.items()),
                    {**failures, **cleanup},
                )
            raise RegistrationError(
                "REGISTER_PARTIAL_FAILURE",
                f"cannot register {spec.handle.name}: {detail}",
                failures,
            )
        self.registry.commit_register(spec.handle.hashid)
        return spec.handle

    def unregister(self, handle: CallableHandle) -> None:
        """Drop one reference; the last one removes the callable from every child."""
        self._check_usable("unregister")
        if not isinstance(handle, CallableHandle):
            raise TypeError(
                f"cannot unregister: expected a CallableHandle, got {type(handle).__name__}"
            )
        if self.state is WorkerState.NEW:
            if self.registry.begin_unregister(handle.hashid) is not None:
                self.registry.finish_unregister(handle.hashid)
            return
        self._drive(self.unregister_async(handle))

    async def unregister_async(self, handle: CallableHandle) -> None:
        self._check_ready("unregister")
        entry = self.registry.begin_unregister(handle.hashid)
        if entry is None:
            return
        failures: dict[int, str] = {}
        op = ControlOp.UNREGISTER_CHIP if entry.spec.handle.role == "chip" else ControlOp.UNREGISTER
        for ep in self._targets_for(entry.spec):
            try:
                await ep.control(op, handle.digest)
            except (ControlError, EndpointError) as exc:
                failures[ep.worker_id] = str(exc)
        if failures:
            raise RegistrationError(
                "REGISTER_CLEANUP_UNCERTAIN",
                f"cannot unregister {handle.name}: "
                + "; ".join(f"worker {w}: {m}" for w, m in failures.items())
                + "; the hashid stays tombstoned",
                failures,
            )
        self.registry.finish_unregister(handle.hashid)

    def _spec(self, fn: Callable[..., Any] | str, kind: Kind) -> CallableSpec:
        if kind not in ("sub", "chip", "orchestration"):
            raise ValueError(
                f"cannot register: kind={kind!r} must be 'sub', 'chip' or 'orchestration'"
            )
        if kind == "chip":
            if not isinstance(fn, str):
                raise TypeError(
                    "cannot register a chip kernel: pass its import path 'pkg.mod:kernel'"
                )
            return spec_for_chip(fn)
        if isinstance(fn, str):
            return spec_for_import(fn, kind)
        return spec_for_object(fn, kind)

    def _targets_for(self, spec: CallableSpec) -> list[LocalMailboxEndpoint]:
        """Live endpoints of the spec's role (a dead one's replacement replays registrations)."""
        if spec.handle.role == "sub":
            return [ep for ep in self.sub_endpoints if not ep.poisoned]
        if spec.handle.role == "chip":
            return [ep for ep in self.chip_endpoints if not ep.poisoned]
        return []

    # -- lifecycle -------------------------------------------------------------------------------------

    def init(self) -> None:
        """Fork every child and wait until all are ready, or roll back and raise ``StartupError``."""
        if self.state is not WorkerState.NEW:
            raise StartupError(f"cannot init: worker is {self.state.name}")
        self.state = WorkerState.INITIALIZING
        try:
            self._start_children()
        except BaseException:
            self.state = WorkerState.FAILED
            self._release_memory()
            raise
        manager = WorkerManager()
        for ep in self.chip_endpoints:
            manager.add_next_level_at(ep.worker_id, ep)
        for ep in self.sub_endpoints:
            manager.add_sub(ep)
        assert self.doorbell is not None
        depths = [ep.mailbox.pipeline_depth() for ep in self.chip_endpoints]
        # Whole-run admission depth: the minimum the chip children published; 2 for SUB-only.
        depth = self.pipeline_depth or (min(depths) if depths else 2)
        self.manager = manager
        self.scheduler = Scheduler(
            manager,
            self.registry,
            self.heap,
            self.doorbell,
            pipeline_depth=max(1, depth),
            spin_s=self.scheduler_spin_s,
        )
        self.scheduler.on_admit = self._on_admit
        if self.forkserver is not None:
            self.scheduler.on_lane_dead = self._on_lane_dead
        self.state = WorkerState.READY

    def _start_children(self) -> None:
        """Fork SUB children first, then chips; one startup deadline for all of them."""
        self.doorbell = Doorbell()
        specs = {
            role: [e.spec for e in self.registry.active() if e.spec.handle.role == role]
            for role in ("sub", "chip")
        }
        deadline = time.monotonic() + self.startup_timeout
        starting: list[tuple[str, int, Mailbox, ChildProcess]] = []
        self._ready_pids: set[int] = set()  # passed the barrier; the rest are still starting
        try:
            for i in range(self.num_sub_workers):
                mb = Mailbox()
                self.mailboxes.append(mb)
                ctx = ChildContext(
                    worker_id=i,
                    label=f"sub worker {i}",
                    mailbox=mb,
                    heap=self.heap,
                    doorbell=self.doorbell,
                    specs=specs["sub"],
                    parent_pid=self._pid,
                    spin_ns=self.child_spin_ns,
                    init_hook=self._init_hooks.get(i),
                )
                child = fork_child(lambda ctx=ctx: run_child(ctx), ctx.label)  # type: ignore[misc]
                self.children.append(child)
                starting.append(("sub", i, mb, child))
                self._child_specs[("sub", i)] = (ctx, run_child)
            for j in range(self.num_chips):
                mb = Mailbox()
                self.mailboxes.append(mb)
                trace = (
                    os.path.join(self.chip_trace_dir, f"chip-{j}.jsonl")
                    if self.chip_trace_dir
                    else None
                )
                chip_ctx = ChipContext(
                    worker_id=j,
                    label=f"chip {j}",
                    mailbox=mb,
                    heap=self.heap,
                    doorbell=self.doorbell,
                    specs=specs["chip"],
                    parent_pid=self._pid,
                    spin_ns=self.child_spin_ns,
                    error_prefix="chip_worker",
                    pipeline_depth=self.chip_pipeline_depth,
                    trace_path=trace,
                )
                child = fork_child(lambda c=chip_ctx: run_chip_child(c), chip_ctx.label)  # type: ignore[misc]
                self.children.append(child)
                starting.append(("chip", j, mb, child))
                self._child_specs[("chip", j)] = (chip_ctx, run_chip_child)
            self._startup_barrier(starting, deadline)
            if self.restart_children:
                # Last fork of init: later replacements come from this single-threaded server.
                self.forkserver = ForkServer(self._child_specs)
                self.forkserver.start()
        except BaseException as exc:
            self._rollback_children(starting)
            if isinstance(exc, StartupError):
                raise
            raise StartupError(f"cannot start worker: {type(exc).__name__}: {exc}") from exc
        for kind, index, mb, child in starting:
            if kind == "sub":
                self.sub_endpoints.append(LocalMailboxEndpoint(index, mb, child, label=child.label))
            else:
                frames = 2 if mb.pipeline_depth() >= 2 else 1
                self.chip_endpoints.append(
                    LocalMailboxEndpoint(
                        index, mb, child, task_frame_count=frames, label=child.label
                    )
                )

    def _startup_barrier(
        self, starting: list[tuple[str, int, Mailbox, ChildProcess]], deadline: float
    ) -> None:
        pending = list(starting)
        delay = 0.0002
        while pending:
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
            if time.monotonic() > deadline:
                names = ", ".join(f"{c.label} (pid {c.pid})" for _, _, _, c in pending)
                raise StartupError(
                    f"cannot start worker: {names} not ready within {self.startup_timeout:.1f}s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _rollback_children(self, starting: list[tuple[str, int, Mailbox, ChildProcess]]) -> None:
        """SHUTDOWN to ready children, SIGTERM to starting ones, SIGKILL survivors."""
        import signal

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
        for mb in self.mailboxes:
            mb.close()
        self.mailboxes.clear()
        if self.doorbell is not None:
            self.doorbell.close()
            self.doorbell = None

    def _release_memory(self) -> None:
        self.heap.close()

    def _check_usable(self, what: str) -> None:
        if self.state in (WorkerState.CLOSED, WorkerState.FAILED):
            raise WorkerClosedError(f"cannot {what}: worker is {self.state.name}")

    def _check_ready(self, what: str) -> None:
        if self.state is not WorkerState.READY:
            raise WorkerClosedError(
                f"cannot {what}: worker is {self.state.name}"
                + (" (call init() first)" if self.state is WorkerState.NEW else "")
            )

    # -- memory ----------------------------------------------------------------------------------------

    def alloc(self, shape: tuple[int, ...] | int, dtype: Any = "float32") -> np.ndarray[Any, Any]:
        """A zero-filled NumPy array on the shared heap (children see the same bytes)."""
        self._check_usable("alloc")
        return self.heap.alloc(shape, dtype)

    def free(self, array: np.ndarray[Any, Any] | int) -> None:
        """Free a heap buffer; reused only once no task that captured it is live."""
        self._check_usable("free")
        self.heap.free(array)

    # -- driving the Scheduler ---------------------------------------------------------------------
    #
    # Bound mode: the Scheduler coroutine runs on an event loop (``run_async``,
    # ``start_async``, the daemon). Unbound mode (blocking API only): the
    # calling thread drives the same rounds directly — spin while work is in
    # flight, then park in poll(2) on the doorbell and the child pidfds. Either
    # way one owner calls lane progress at a time.

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is loop:
            return
        if self._loop is not None:
            raise RuntimeError(
                "cannot use this Worker from another event loop: its Scheduler already runs on "
                "a different one"
            )
        assert self.scheduler is not None
        with self._drive_lock:
            self._loop = loop
            self.scheduler.attach(loop)
            pending, self._pending_builds = self._pending_builds, []
        for run in pending:
            loop.call_soon(self._build, run)

    def _bound_elsewhere(self) -> asyncio.AbstractEventLoop | None:
        """The bound loop when called from outside it; raises when called from inside it."""
        loop = self._loop
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

    def _drive(self, aw: Awaitable[Any]) -> Any:
        """Run a rare coroutine (controls, close) to completion from blocking code."""
        try:
            loop = self._bound_elsewhere()
        except RuntimeError:
            if inspect.iscoroutine(aw):
                aw.close()
            raise
        if loop is not None:
            return asyncio.run_coroutine_threadsafe(_as_coro(aw), loop).result()
        with self._drive_lock:
            if self._aux_loop is None:
                self._aux_loop = asyncio.new_event_loop()
            return self._aux_loop.run_until_complete(aw)

    def _drive_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """Unbound mode: run Scheduler rounds on this thread until ``done()`` or the timeout."""
        sched = self.scheduler
        doorbell = self.doorbell
        assert sched is not None and doorbell is not None
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_s = sched.spin_budget()
        spin_until = now + spin_s
        poller = self._poller()
        with self._drive_lock:
            while True:
                if self._pending_builds:
                    self._run_pending_builds()
                if self._dead_lanes:
                    self._replace_dead_lanes_sync()
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
                events = poller.poll(int(wait_s * 1000) + 1)
                doorbell.unpark()
                self._handle_poll_events(events)
                spin_until = time.monotonic() + spin_s

    def _handle_poll_events(self, events: list[tuple[int, int]]) -> None:
        assert self.scheduler is not None and self.doorbell is not None
        for fd, _ in events:
            if fd == self.doorbell.fd:
                self.doorbell.drain()
            else:
                assert self._poll is not None
                self._poll.unregister(fd)
                child = self._pidfd_child.pop(fd, None)
                if child is not None:
                    self.scheduler.child_exited(child)

    def _poller(self) -> select.poll:
        if self._poll is None:
            assert self.doorbell is not None
            poller = select.poll()
            poller.register(self.doorbell.fd, select.POLLIN)
            for child in self.children:
                if child.pidfd is not None:
                    poller.register(child.pidfd, select.POLLIN)
                    self._pidfd_child[child.pidfd] = child
            self._poll = poller
        return self._poll

    async def start_async(self) -> None:
        """Bind the Scheduler to the running loop (the daemon calls this once)."""
        self._check_ready("start")
        self._bind(asyncio.get_running_loop())

    # -- runs --------------------------------------------------------------------------------------------

    def _new_run(self, orch: Orch, args: Any, config: CallConfig | None) -> Run:
        self._check_ready("submit a run")
        if not callable(orch):
            raise TypeError(f"cannot submit a run: orchestration function {orch!r} is not callable")
        assert self.scheduler is not None
        run = Run()
        run.orch = (orch, args, config or DEFAULT_CONFIG)  # type: ignore[attr-defined]
        run.build_started = False  # type: ignore[attr-defined]
        run.orch_exception = None  # type: ignore[attr-defined]
        self.scheduler.submit_run(run)
        return run

    def _on_admit(self, run: Run) -> None:
        loop = self._loop
        if loop is not None:
            loop.call_soon(self._build, run)
        else:
            self._pending_builds.append(run)

    def _run_pending_builds(self) -> None:
        pending, self._pending_builds = self._pending_builds, []
        for run in pending:
            self._build(run)

    def _build(self, run: Run) -> None:
        if run.build_started or run.terminal:  # type: ignore[attr-defined]
            return
        run.build_started = True  # type: ignore[attr-defined]
        assert self.scheduler is not None
        orch, args, config = run.orch  # type: ignore[attr-defined]
        o = Orchestrator(self.scheduler, run)
        try:
            res = orch(o, args, config)
        except BaseException as exc:
            self._orch_failed(run, exc)
            return
        if inspect.isawaitable(res):
            if self._loop is None:
                if inspect.iscoroutine(res):
                    res.close()
                self._orch_failed(
                    run,
                    TypeError(
                        "cannot run an async orchestration function through the blocking API; "
                        "use run_async"
                    ),
                )
                return
            self._loop.create_task(self._build_async(run, res))
            return
        self.scheduler.finish_building(run)

    async def _build_async(self, run: Run, aw: Awaitable[Any]) -> None:
        assert self.scheduler is not None
        try:
            await aw
        except BaseException as exc:
            self._orch_failed(run, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self.scheduler.finish_building(run)

    def _orch_failed(self, run: Run, exc: BaseException) -> None:
        assert self.scheduler is not None
        if exc is not run.error:
            run.orch_exception = exc  # type: ignore[attr-defined]
        self.scheduler.fail_building(run, exc)

    def submit(self, orch: Orch, args: Any = None, config: CallConfig | None = None) -> RunHandle:
        """Queue a run and return its handle at once (the orchestration runs when admitted)."""
        loop = self._bound_elsewhere()
        if loop is not None:
            return asyncio.run_coroutine_threadsafe(
                self.submit_async(orch, args, config), loop
            ).result()
        with self._drive_lock:
            if self.state is WorkerState.READY:
                # Notice children that died while idle before dispatching to them.
                self._handle_poll_events(self._poller().poll(0))
            if self._dead_lanes:
                self._replace_dead_lanes_sync()
            run = self._new_run(orch, args, config)
            if run.admitted:
                self._pending_builds = [r for r in self._pending_builds if r is not run]
                self._build(run)
            return RunHandle(self, run)

    def run(self, orch: Orch, args: Any = None, config: CallConfig | None = None) -> None:
        """Run an orchestration to completion; raises ``TaskError`` when the run failed."""
        self.submit(orch, args, config).wait()

    async def submit_async(
        self, orch: Orch, args: Any = None, config: CallConfig | None = None
    ) -> RunHandle:
        self._check_ready("submit a run")
        self._bind(asyncio.get_running_loop())
        run = self._new_run(orch, args, config)
        if run.admitted:
            self._build(run)
        return RunHandle(self, run)

    async def run_async(
        self, orch: Orch, args: Any = None, config: CallConfig | None = None
    ) -> None:
        """Event-loop native ``run``: awaits completion, raises ``TaskError`` on failure."""
        handle = await self.submit_async(orch, args, config)
        await handle.wait_async()

    def cancel(self, handle: RunHandle | Run) -> None:
        """Cancel a run: unstarted tasks fail, running ones finish."""
        run = handle.run if isinstance(handle, RunHandle) else handle
        sched = self.scheduler
        assert sched is not None
        if self._loop is not None and asyncio._get_running_loop() is self._loop:
            self._cancel_now(run)  # on the bound loop: cancelling never blocks
            return
        loop = self._bound_elsewhere()
        if loop is not None:
            loop.call_soon_threadsafe(self._cancel_now, run)
            return
        with self._drive_lock:
            self._cancel_now(run)

    def _cancel_now(self, run: Run) -> None:
        sched = self.scheduler
        assert sched is not None
        sched.cancel(run)
        if not getattr(run, "build_started", True):
            # Never admitted or not yet built: nothing will call finish_building.
            run.build_started = True  # type: ignore[attr-defined]
            self._pending_builds = [r for r in self._pending_builds if r is not run]
            if not run.admitted:
                sched.admission.release(run)
                run.building = False
                run.state = RunState.FAILED
                run.fire_done()
            else:
                sched.finish_building(run)

    def _wait_run(self, run: Run, timeout: float | None) -> None:
        if run.terminal:
            return
        loop = self._bound_elsewhere()
        if loop is not None:
            asyncio.run_coroutine_threadsafe(self._wait_run_async(run, timeout), loop).result()
            return
        if not self._drive_until(lambda: run.terminal, timeout):
            raise TimeoutError(
                f"run {run.run_id} not finished within {timeout}s (state {run.state.name})"
            )

    async def _wait_run_async(self, run: Run, timeout: float | None) -> None:
        if run.terminal:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def done(_: Run) -> None:
            if not fut.done():
                fut.set_result(None)

        run.add_done_callback(done)
        if timeout is None:
            await fut
            return
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise TimeoutError(
                f"run {run.run_id} not finished within {timeout}s (state {run.state.name})"
            ) from None

    # -- replacing dead children ------------------------------------------------------------------

    def _on_lane_dead(self, lane: WorkerThread) -> None:
        # A lane can be reported more than once for the same death (pidfd and the
        # endpoint failure of its last task): replace each dead endpoint once.
        ep = lane.endpoint
        if self.state is not WorkerState.READY or id(ep) in self._replacing:
            return
        self._replacing.add(id(ep))
        if self._loop is not None:
            self._loop.create_task(self._replace_async(lane, ep))
        else:
            self._dead_lanes.append((lane, ep))

    def _replace_dead_lanes_sync(self) -> None:
        pending, self._dead_lanes = self._dead_lanes, []
        for lane, ep in pending:
            self._drive(self._replace_async(lane, ep))

    async def _replace_async(self, lane: WorkerThread, old: Any) -> None:
        """Fork a replacement through the fork server, replay registrations, re-enable the lane."""
        try:
            await self._replace(lane, old)
        finally:
            self._replacing.discard(id(old))

    async def _replace(self, lane: WorkerThread, old: Any) -> None:
        assert self.forkserver is not None and self.scheduler is not None
        if lane.endpoint is not old or not old.poisoned:
            return  # already replaced
        kind = "chip" if lane.worker_type is WorkerType.NEXT_LEVEL else "sub"
        assert isinstance(old, LocalMailboxEndpoint)
        mb = old.mailbox
        ctx, _ = self._child_specs[(kind, lane.worker_id)]
        for attempt in range(1, 4):
            if self.state is not WorkerState.READY:
                return
            _mb.write_bytes(mb.buf, 0, bytes(len(mb.buf)))  # every frame IDLE, shutdown word 0
            try:
                pid = self.forkserver.spawn(kind, lane.worker_id)
            except StartupError as exc:
                log.error("%s stays down: %s", old.label, exc)
                return
            child = ChildProcess(pid, old.label, foreign=True)
            self.children.append(child)
            error = await self._await_init(mb, child, time.monotonic() + self.startup_timeout)
            if error is None:
                break
            log.warning("replacement %d of %s failed: %s", attempt, old.label, error)
            child.signal_group(9)
        else:
            log.error("%s stays down after 3 failed replacements", old.label)
            return
        ep = LocalMailboxEndpoint(
            lane.worker_id, mb, child, task_frame_count=old.caps.task_frame_count, label=old.label
        )
        role = "chip" if kind == "chip" else "sub"
        inherited = {s.handle.hashid for s in ctx.specs}
        replayed: set[str] = set()
        try:
            while True:
                todo = [
                    e.spec
                    for e in self.registry.active()
                    if e.spec.handle.role == role
                    and e.spec.handle.hashid not in inherited | replayed
                ]
                if not todo:
                    break
                for spec in todo:
                    await self._register_on(ep, spec)
                    replayed.add(spec.handle.hashid)
            active = {e.spec.handle.hashid for e in self.registry.active()}
            op = ControlOp.UNREGISTER_CHIP if kind == "chip" else ControlOp.UNREGISTER
            for spec in ctx.specs:
                if spec.handle.hashid not in active:
                    await ep.control(op, spec.handle.digest)
        except (ControlError, EndpointError) as exc:
            log.error("%s replacement could not replay registrations: %s", old.label, exc)
            ep.request_stop()
            return
        # Swap: the lane becomes schedulable again only now.
        lane.endpoint = ep
        lane.active = lane.staged = None
        lane.inflight = 0
        eps = self.chip_endpoints if kind == "chip" else self.sub_endpoints
        eps[eps.index(old)] = ep
        self.restarts[kind] += 1
        key = (kind, lane.worker_id)
        self._worker_restarts[key] = self._worker_restarts.get(key, 0) + 1
        if self._loop is not None:
            self.scheduler.watch_child(child)
        elif self._poll is not None and child.pidfd is not None:
            self._poll.register(child.pidfd, select.POLLIN)
            self._pidfd_child[child.pidfd] = child
        log.warning("%s replaced: %s -> pid %d", old.label, old.poison_reason, child.pid)
        self.scheduler.wake()

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

    async def _register_on(self, ep: LocalMailboxEndpoint, spec: CallableSpec) -> None:
        if spec.handle.role == "chip":
            assert spec.import_path is not None
            await ep.control(ControlOp.REGISTER_CHIP, spec.handle.digest, spec.import_path.encode())
        elif spec.import_path is not None:
            await ep.control(
                ControlOp.REGISTER_IMPORT, spec.handle.digest, spec.import_path.encode()
            )
        else:
            assert spec.payload is not None
            await ep.control(ControlOp.REGISTER_SERIALIZED, spec.handle.digest, spec.payload)

    # -- introspection ------------------------------------------------------------------------------------

    def list_workers(self) -> list[dict[str, Any]]:
        """One entry per child: kind, id, pid, liveness, pipeline depth and lane state."""
        out = []
        manager = self.manager
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
                    }
                )
        return out

    def ping(self, worker_index: int, timeout: float | None = 5.0) -> int:
        """Round-trip a PING control to one SUB worker; returns its pid."""
        self._check_ready("ping")
        ep = self.sub_endpoints[worker_index]

        async def go() -> int:
            return (await ep.control(ControlOp.PING, timeout=timeout)).result0

        return self._drive(go())  # type: ignore[no-any-return]

    # -- close ---------------------------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Drain admitted runs within ``timeout`` (default ``close_timeout``), cancel the
        rest, stop every child and release all memory. A second call is a no-op."""
        if self.state is WorkerState.CLOSED:
            return
        if os.getpid() != self._pid:  # a forked child must never tear down its parent's pool
            return
        budget = self.close_timeout if timeout is None else timeout
        if self.state is not WorkerState.READY:
            self.state = WorkerState.CLOSED
            self._release_memory()
            return
        loop = self._bound_elsewhere()
        if loop is not None:
            asyncio.run_coroutine_threadsafe(self.close_async(budget), loop).result()
            return
        with self._drive_lock:
            deadline = time.monotonic() + budget
            sched = self.scheduler
            assert sched is not None
            self.state = WorkerState.CLOSED
            sched.admission.closed = True
            runs = [r for r in sched.admission.runs() if not r.terminal]
            self._drive_until(lambda: all(r.terminal for r in runs), budget / 2)
            self._cancel_all()
            self._stop_sync(deadline)
            if self._aux_loop is not None:
                self._aux_loop.close()
                self._aux_loop = None

    async def close_async(self, timeout: float | None = None) -> None:
        """The stop sequence from the bound loop: drain, cancel, stop, reap, release."""
        if self.state is WorkerState.CLOSED:
            return
        if self.state is not WorkerState.READY:
            self.state = WorkerState.CLOSED
            self._release_memory()
            return
        budget = self.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        sched = self.scheduler
        assert sched is not None
        self.state = WorkerState.CLOSED
        sched.admission.closed = True
        pending = [r for r in sched.admission.runs() if not r.terminal]
        if pending and self._loop is not None:
            waits = [asyncio.ensure_future(self._wait_run_async(r, None)) for r in pending]
            _, not_done = await asyncio.wait(waits, timeout=budget / 2)
            for t in not_done:
                t.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        self._cancel_all()
        if self._loop is not None:
            sched.stop()
            with contextlib.suppress(Exception):
                await sched.wait_stopped()
            sched.detach()
            self._loop = None
        self._stop_sync(deadline)

    def _cancel_all(self) -> None:
        sched = self.scheduler
        assert sched is not None
        for r in sched.admission.runs():
            if not r.terminal:
                r.cancelled = True  # so its error is a RunCancelled, as for handle.cancel()
                r.record_error(None, _cancel_failure())
                self._cancel_now(r)

    def _stop_sync(self, deadline: float) -> None:
        """Stop lanes, progress until every frame is terminal, reap, release memory."""
        sched = self.scheduler
        manager = self.manager
        assert sched is not None and manager is not None
        self._loop = None
        manager.stop_workers()
        while sched.busy() and time.monotonic() < deadline:
            for mb in self.mailboxes:
                mb.request_shutdown()
            self._drive_until(
                lambda: not sched.busy(), min(0.05, max(0.0, deadline - time.monotonic()))
            )
        for mb in self.mailboxes:
            mb.request_shutdown()
        server = self.forkserver.process if self.forkserver is not None else None
        workers = [c for c in self.children if c is not server]
        for msg in reap_all(workers, max(0.5, deadline - time.monotonic())):
            log.warning("close: %s", msg)
        if self.forkserver is not None and server is not None:
            self.forkserver.close()
            reap_all([server], max(0.5, deadline - time.monotonic()))
            server.close()
        sched.round()  # poisoned endpoints release their withheld completions now
        for r in sched.admission.runs():
            if not r.terminal:
                r.record_error(None, _cancel_failure())
                r.building = False
                r.remaining = 0
                sched._maybe_finish_run(r)
        manager.stop()
        for c in self.children:
            c.close()
        self._poll = None
        self._pidfd_child.clear()
        for mb in self.mailboxes:
            mb.close()
        if self.doorbell is not None:
            self.doorbell.close()
        self._release_memory()

    def __enter__(self) -> Worker:
        if self.state is WorkerState.NEW:
            self.init()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Worker:
        if self.state is WorkerState.NEW:
            self.init()
        await self.start_async()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close_async()

    def __del__(self) -> None:
        if getattr(self, "state", None) is WorkerState.READY and os.getpid() == getattr(
            self, "_pid", -1
        ):
            # Last resort: never leave children behind.
            for mb in getattr(self, "mailboxes", []):
                with contextlib.suppress(Exception):
                    mb.request_shutdown()


def _cancel_failure() -> Any:
    from simpler_daemon.endpoints.base import Outcome
    from simpler_daemon.orchestrator import FailureInfo

    return FailureInfo(Outcome.SKIPPED, "run cancelled: worker closing")


async def _as_coro(aw: Awaitable[Any]) -> Any:
    return await aw


__all__ = ["RunCancelled", "RunHandle", "TaskArgs", "Worker", "WorkerState"]
