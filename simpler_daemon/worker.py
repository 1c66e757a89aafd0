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
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import numpy as np

from simpler_daemon import _mailbox as _mb
from simpler_daemon.args import CallConfig, TaskArgs
from simpler_daemon.callables import (
    CallableHandle,
    CallableRegistry,
    CallableSpec,
    spec_for_chip,
    spec_for_import,
    spec_for_object,
)
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
from simpler_daemon.manager import WorkerManager
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


def _new_loop() -> asyncio.AbstractEventLoop:
    if os.environ.get("SIMPLER_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop

            return uvloop.new_event_loop()  # type: ignore[no-any-return]
        except ImportError:  # pragma: no cover - uvloop is a dependency
            pass
    return asyncio.new_event_loop()


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
    shared heap, mapped now so arrays allocated before ``init`` are shared too.
    """

    def __init__(
        self,
        level: int = 3,
        num_sub_workers: int | None = None,
        num_chips: int = 0,
        *,
        heap_bytes: int = 64 << 20,
        startup_timeout: float = 30.0,
        close_timeout: float = 10.0,
        child_spin_ns: int = 50_000,
        scheduler_spin_s: float = 0.0002,
        pipeline_depth: int | None = None,
    ) -> None:
        if level not in (3, 4):
            raise ValueError(f"cannot create Worker: level={level!r} must be 3 (node) or 4 (pod)")
        if num_sub_workers is None:
            num_sub_workers = os.cpu_count() or 1
        if isinstance(num_sub_workers, bool) or not isinstance(num_sub_workers, int) or num_sub_workers < 0:
            raise ValueError(f"cannot create Worker: num_sub_workers={num_sub_workers!r} must be an int >= 0")
        if isinstance(num_chips, bool) or not isinstance(num_chips, int) or num_chips < 0:
            raise ValueError(f"cannot create Worker: num_chips={num_chips!r} must be an int >= 0")
        if num_chips:
            raise ValueError(
                "cannot create Worker: num_chips > 0 needs the simulated chip backend, which this "
                "build does not include yet"
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
        self.pipeline_depth = pipeline_depth or 2
        self.state = WorkerState.NEW
        self.heap = Heap(heap_bytes)
        self.registry = CallableRegistry()
        self.children: list[ChildProcess] = []
        self.mailboxes: list[Mailbox] = []
        self.endpoints: list[LocalMailboxEndpoint] = []
        self.doorbell: Doorbell | None = None
        self.manager: WorkerManager | None = None
        self.scheduler: Scheduler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_owned = False
        self._drive_lock = threading.RLock()
        self._pid = os.getpid()
        #: Test hooks: per-SUB-index callables run in the child before INIT_READY.
        self._init_hooks: dict[int, Callable[[], None]] = {}

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

    async def register_async(self, fn: Callable[..., Any] | str, kind: Kind = "sub") -> CallableHandle:
        """``register`` after ``init`` without blocking the event loop."""
        self._check_ready("register")
        spec = self._spec(fn, kind)
        targets = self._targets_for(spec)
        if not self.registry.begin_register(spec, frozenset(range(len(targets)))):
            return spec.handle
        if spec.import_path is not None:
            op, payload = ControlOp.REGISTER_IMPORT, spec.import_path.encode()
        else:
            assert spec.payload is not None
            op, payload = ControlOp.REGISTER_SERIALIZED, spec.payload
        done: list[LocalMailboxEndpoint] = []
        failures: dict[int, str] = {}
        for ep in targets:
            try:
                await ep.control(op, spec.handle.digest, payload)
                done.append(ep)
            except (ControlError, EndpointError) as exc:
                failures[ep.worker_id] = str(exc)
        if failures:
            cleanup: dict[int, str] = {}
            for ep in done:
                try:
                    await ep.control(ControlOp.UNREGISTER, spec.handle.digest)
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
                "REGISTER_PARTIAL_FAILURE", f"cannot register {spec.handle.name}: {detail}", failures
            )
        self.registry.commit_register(spec.handle.hashid)
        return spec.handle

    def unregister(self, handle: CallableHandle) -> None:
        """Drop one reference; the last one removes the callable from every child."""
        self._check_usable("unregister")
        if not isinstance(handle, CallableHandle):
            raise TypeError(f"cannot unregister: expected a CallableHandle, got {type(handle).__name__}")
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
        for ep in self._targets_for(entry.spec):
            try:
                await ep.control(ControlOp.UNREGISTER, handle.digest)
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
            raise ValueError(f"cannot register: kind={kind!r} must be 'sub', 'chip' or 'orchestration'")
        if kind == "chip":
            if not isinstance(fn, str):
                raise TypeError("cannot register a chip kernel: pass its import path 'pkg.mod:kernel'")
            return spec_for_chip(fn)
        if isinstance(fn, str):
            return spec_for_import(fn, kind)
        return spec_for_object(fn, kind)

    def _targets_for(self, spec: CallableSpec) -> list[LocalMailboxEndpoint]:
        if spec.handle.role == "sub":
            return list(self.endpoints)
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
        for ep in self.endpoints:
            manager.add_sub(ep)
        assert self.doorbell is not None
        self.manager = manager
        self.scheduler = Scheduler(
            manager,
            self.registry,
            self.heap,
            self.doorbell,
            pipeline_depth=self.pipeline_depth,
            spin_s=self.scheduler_spin_s,
        )
        self.scheduler.on_admit = self._on_admit
        self.state = WorkerState.READY

    def _start_children(self) -> None:
        self.doorbell = Doorbell()
        sub_specs = [e.spec for e in self.registry.active() if e.spec.handle.role == "sub"]
        deadline = time.monotonic() + self.startup_timeout
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
                    specs=sub_specs,
                    parent_pid=self._pid,
                    spin_ns=self.child_spin_ns,
                    init_hook=self._init_hooks.get(i),
                )
                child = fork_child(lambda ctx=ctx: run_child(ctx), ctx.label)  # type: ignore[misc]
                self.children.append(child)
                self.endpoints.append(LocalMailboxEndpoint(i, mb, child, label=ctx.label))
            self._startup_barrier(deadline)
        except BaseException as exc:
            self._rollback_children()
            if isinstance(exc, StartupError):
                raise
            raise StartupError(f"cannot start worker: {type(exc).__name__}: {exc}") from exc

    def _startup_barrier(self, deadline: float) -> None:
        pending = dict(enumerate(self.endpoints))
        delay = 0.0002
        while pending:
            for i, ep in list(pending.items()):
                st = ep.mailbox.state(BASE_FRAME)
                if st == MailboxState.INIT_READY:
                    ep.mailbox.cas_state(BASE_FRAME, MailboxState.INIT_READY, MailboxState.IDLE)
                    _mb.wake_child(ep.mailbox.buf)
                    del pending[i]
                elif st == MailboxState.INIT_FAILED:
                    raise StartupError(
                        f"cannot start worker: {ep.who()} failed to initialize: "
                        f"{ep.mailbox.error_text(BASE_FRAME)}"
                    )
                elif ep.child is not None and ep.child.poll():
                    raise StartupError(f"cannot start worker: {ep.child.describe()} during init")
            if not pending:
                break
            if time.monotonic() > deadline:
                names = ", ".join(ep.who() for ep in pending.values())
                raise StartupError(
                    f"cannot start worker: {names} not ready within {self.startup_timeout:.1f}s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _rollback_children(self) -> None:
        import signal

        for ep in self.endpoints:
            if ep.child is not None and not ep.child.poll():
                if ep.mailbox.state(BASE_FRAME) in (MailboxState.IDLE, MailboxState.INIT_READY):
                    ep.mailbox.request_shutdown()
                else:
                    ep.child.signal_group(signal.SIGTERM)
                    ep.mailbox.request_shutdown()
        reap_all(self.children, 2.0)
        for c in self.children:
            c.close()
        self.children.clear()
        self.endpoints.clear()
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

    # -- event loop binding ----------------------------------------------------------------------------

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is loop:
            return
        if self._loop is not None:
            raise RuntimeError(
                "cannot use this Worker from another event loop: its Scheduler already runs on "
                "a different one (use either the blocking or the async API per Worker)"
            )
        assert self.scheduler is not None
        self._loop = loop
        self.scheduler.attach(loop)

    def _private_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = _new_loop()
            self._loop_owned = True
            self._bind(loop)
        assert self._loop is not None
        return self._loop

    def _drive(self, aw: Awaitable[Any]) -> Any:
        """Run ``aw`` to completion from blocking code."""
        loop = self._loop
        if loop is not None and not self._loop_owned:
            if loop.is_running():
                try:
                    running = asyncio.get_running_loop()
                except RuntimeError:
                    running = None
                if running is loop:
                    if inspect.iscoroutine(aw):
                        aw.close()
                    raise RuntimeError(
                        "cannot call a blocking Worker method from its own event loop; "
                        "use the *_async form"
                    )
                return asyncio.run_coroutine_threadsafe(_as_coro(aw), loop).result()
            if inspect.iscoroutine(aw):
                aw.close()
            raise RuntimeError("cannot block on this Worker: its event loop is not running")
        loop = self._private_loop()
        with self._drive_lock:
            return loop.run_until_complete(aw)

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
        run.orch = (orch, args, config or CallConfig())  # type: ignore[attr-defined]
        run.build_started = False  # type: ignore[attr-defined]
        run.orch_exception = None  # type: ignore[attr-defined]
        self.scheduler.submit_run(run)
        return run

    def _on_admit(self, run: Run) -> None:
        loop = self._loop
        if loop is not None:
            loop.call_soon(self._build, run)

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
            assert self._loop is not None
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
        with self._drive_lock:
            loop = self._loop if self._loop is not None else self._private_loop()
            if not self._loop_owned and loop.is_running():
                return self._drive(self.submit_async(orch, args, config))  # type: ignore[no-any-return]
            run = self._new_run(orch, args, config)
            if run.admitted:
                self._build(run)
            return RunHandle(self, run)

    def run(self, orch: Orch, args: Any = None, config: CallConfig | None = None) -> None:
        """Run an orchestration to completion; raises ``TaskError`` when the run failed."""
        self.submit(orch, args, config).wait()

    async def submit_async(self, orch: Orch, args: Any = None, config: CallConfig | None = None) -> RunHandle:
        self._check_ready("submit a run")
        self._bind(asyncio.get_running_loop())
        run = self._new_run(orch, args, config)
        if run.admitted:
            self._build(run)
        return RunHandle(self, run)

    async def run_async(self, orch: Orch, args: Any = None, config: CallConfig | None = None) -> None:
        """Event-loop native ``run``: awaits completion, raises ``TaskError`` on failure."""
        handle = await self.submit_async(orch, args, config)
        await handle.wait_async()

    def cancel(self, handle: RunHandle | Run) -> None:
        """Cancel a run: unstarted tasks fail, running ones finish."""
        run = handle.run if isinstance(handle, RunHandle) else handle
        assert self.scheduler is not None
        if self._loop is not None and not self._loop_owned and self._loop.is_running():
            self._loop.call_soon_threadsafe(self.scheduler.cancel, run)
            return
        self.scheduler.cancel(run)
        if not run.admitted or not run.terminal:
            run.building = False if not getattr(run, "build_started", False) else run.building
            self.scheduler.finish_building(run) if not run.building else None

    def _wait_run(self, run: Run, timeout: float | None) -> None:
        if run.terminal:
            return
        self._drive(self._wait_run_async(run, timeout))

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
            raise TimeoutError(f"run {run.run_id} not finished within {timeout}s (state {run.state.name})") from None

    # -- introspection ------------------------------------------------------------------------------------

    def list_workers(self) -> list[dict[str, Any]]:
        out = []
        lanes = self.manager.sub if self.manager is not None else []
        for ep, lane in zip(self.endpoints, lanes or [None] * len(self.endpoints), strict=True):
            out.append(
                {
                    "kind": "sub",
                    "worker_id": ep.worker_id,
                    "pid": ep.child.pid if ep.child else None,
                    "alive": ep.child is not None and not ep.child.exited,
                    "poisoned": ep.poison_reason,
                    "busy": bool(lane.inflight) if lane is not None else False,
                    "tasks_completed": ep.tasks_completed,
                }
            )
        return out

    def ping(self, worker_index: int, timeout: float | None = 5.0) -> int:
        """Round-trip a PING control to one SUB worker; returns its pid."""
        self._check_ready("ping")
        ep = self.endpoints[worker_index]

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
        loop = self._loop
        if loop is not None and not self._loop_owned and loop.is_running():
            self._drive(self.close_async(budget))
            return
        loop = self._private_loop()
        with self._drive_lock:
            loop.run_until_complete(self.close_async(budget))
            self._close_private_loop()

    async def close_async(self, timeout: float | None = None) -> None:
        """The stop sequence, on the bound loop."""
        if self.state is WorkerState.CLOSED:
            return
        budget = self.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        sched = self.scheduler
        assert sched is not None and self.manager is not None
        if self._loop is None:
            self._bind(asyncio.get_running_loop())
        self.state = WorkerState.CLOSED
        sched.admission.closed = True
        # 1. let admitted runs finish within half the budget, then cancel the rest.
        runs = sched.admission.runs()
        drain_deadline = time.monotonic() + budget / 2
        while any(not r.terminal for r in runs) and time.monotonic() < drain_deadline:
            await asyncio.sleep(0.002)
        for r in sched.admission.runs():
            if not r.terminal:
                r.cancelled = True
                r.record_error(None, _cancel_failure())
                sched.cancel(r, record=False)
                if not getattr(r, "build_started", True):
                    sched.finish_building(r)
        # 2. stop lanes; keep progressing until every frame is terminal.
        self.manager.stop_workers()
        while sched.busy() and time.monotonic() < deadline:
            for mb in self.mailboxes:
                mb.request_shutdown()
            sched.wake()
            await asyncio.sleep(0.002)
        sched.stop()
        with contextlib.suppress(Exception):
            await sched.wait_stopped()
        sched.detach()
        # 3. reap every child under one shared deadline.
        for mb in self.mailboxes:
            mb.request_shutdown()
        killed = reap_all(self.children, max(0.5, deadline - time.monotonic()))
        for msg in killed:
            log.warning("close: %s", msg)
        for r in sched.admission.runs():
            if not r.terminal:
                r.record_error(None, _cancel_failure())
                r.building = False
                r.remaining = 0
                sched._maybe_finish_run(r)
        self.manager.stop()
        for c in self.children:
            c.close()
        for mb in self.mailboxes:
            mb.close()
        if self.doorbell is not None:
            self.doorbell.close()
        self._release_memory()

    def _close_private_loop(self) -> None:
        if self._loop is not None and self._loop_owned:
            loop = self._loop
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
        self._loop = None

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
        if getattr(self, "state", None) is WorkerState.READY and os.getpid() == getattr(self, "_pid", -1):
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
