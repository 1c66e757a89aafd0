"""The public ``Worker``: a pool of pre-forked children and the Scheduler that feeds them.

::

    Worker(level=3, num_sub_workers=N)
      register(fn) ----------------------> parent registry (snapshot children inherit)
      init():  ChildPool.start (map mailboxes, fork every child, startup barrier)
               -> WorkerManager lanes -> Scheduler -> Driver
      run(orch): Run -> admission -> orch(o, args, config) -> slots -> Scheduler rounds
                                                              |  (mailboxes, one per child)
                                                              v
                                                     SUB children: fn(args)

This module is the facade only; the pieces are:

* ``pool.ChildPool``: forking, the startup barrier, rollback, replacing dead
  children, reaping them at close;
* ``driver.Driver``: who runs the Scheduler's rounds. Used synchronously
  (``run``/``submit``/``wait``), the calling thread drives them and parks in
  poll(2); used from a running loop (``run_async``) the Scheduler binds to that
  loop. One Worker uses one style;
* ``registration``: the register/unregister broadcast with rollback;
* ``remote.fleet.RemoteFleet``: a level-4 Worker's remote L3 workers (sessions,
  callables installed into them, their buffers);
* ``local_l3.LocalL3Set`` (held by the pool): its local L3 children (``add_worker``),
  forked by the pool, run by ``children/nested.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from simpler_daemon.args import CallConfig, TaskArgs
from simpler_daemon.callables import CallableHandle, CallableRegistry, CallableSpec
from simpler_daemon.children.forkserver import ForkServer
from simpler_daemon.children.process import ChildProcess
from simpler_daemon.doorbell import Doorbell
from simpler_daemon.driver import Driver
from simpler_daemon.endpoints.local import LocalMailboxEndpoint
from simpler_daemon.errors import RunCancelled, StartupError, WorkerClosedError
from simpler_daemon.heap import Heap
from simpler_daemon.local_l3 import plan_install
from simpler_daemon.mailbox import ControlOp, Mailbox
from simpler_daemon.manager import WorkerManager, WorkerThread, WorkerType
from simpler_daemon.orchestrator import Orchestrator, Run, RunState
from simpler_daemon.pool import ChildPool
from simpler_daemon.registration import (
    RegistrationTarget,
    register_on_all,
    spec_for,
    unregister_on_all,
)
from simpler_daemon.remote.fleet import RemoteFleet
from simpler_daemon.remote.methods import RemoteMethods
from simpler_daemon.remote.spec import RemoteCallable, RemoteTensorRef
from simpler_daemon.runs import RunBuilder, wait_run
from simpler_daemon.scheduler import Scheduler

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
        await wait_run(self.run, timeout)
        self.result()

    def cancel(self) -> None:
        self._worker.cancel(self)

    def __repr__(self) -> str:
        return f"RunHandle(run_id={self.run_id}, state={self.run.state.name})"


class Worker(RemoteMethods):
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
            # A pod parent schedules onto its L3 children; SUB workers of its own are optional.
            num_sub_workers = 0 if level == 4 else (os.cpu_count() or 1)
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
        if level == 4 and num_chips:
            raise ValueError(
                f"cannot create Worker: num_chips={num_chips} at level 4; a pod parent holds L3 "
                "workers (add_worker / add_remote_worker), and chips belong to those"
            )
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
        self.registry = CallableRegistry()
        self._driver = Driver()
        self._pool = ChildPool(
            Heap(heap_bytes, name=heap_name),
            self.registry,
            self._driver,
            num_sub_workers=num_sub_workers,
            num_chips=num_chips,
            startup_timeout=startup_timeout,
            child_spin_ns=child_spin_ns,
            chip_pipeline_depth=chip_pipeline_depth,
            chip_trace_dir=chip_trace_dir,
            restart_children=restart_children,
        )
        self._fleet = RemoteFleet(startup_timeout=startup_timeout, reconnect=restart_children)
        # A RemoteCallable's orchestration never goes to the local L3 children.
        self._pool.l3.remote_only = self._fleet.installs.__contains__
        #: Set while this Worker is a local L3 child of a level-4 Worker (frozen here).
        self._attached: str | None = None
        #: NEXT_LEVEL ids: chips 0..num_chips-1 at level 3, L3 children in the order added.
        self._next_worker_id = num_chips
        self.state = WorkerState.NEW
        self.manager: WorkerManager | None = None
        self.scheduler: Scheduler | None = None
        self._pid = os.getpid()

    # -- the pieces, as the daemon, the CLI and tests see them ----------------------------------------

    @property
    def state(self) -> WorkerState:
        return self._state

    @state.setter
    def state(self, state: WorkerState) -> None:
        self._state = state
        # Dead children and failed sessions come back only while serving.
        self._pool.serving = self._fleet.serving = state is WorkerState.READY

    @property
    def heap(self) -> Heap:
        return self._pool.heap

    @property
    def doorbell(self) -> Doorbell | None:
        return self._pool.doorbell

    @property
    def children(self) -> list[ChildProcess]:
        return self._pool.children

    @property
    def mailboxes(self) -> list[Mailbox]:
        return self._pool.mailboxes

    @property
    def sub_endpoints(self) -> list[LocalMailboxEndpoint]:
        return self._pool.sub_endpoints

    @property
    def chip_endpoints(self) -> list[LocalMailboxEndpoint]:
        return self._pool.chip_endpoints

    @property
    def forkserver(self) -> ForkServer | None:
        return self._pool.forkserver

    @property
    def restarts(self) -> dict[str, int]:
        """Replacement children started, by kind ("sub" / "chip")."""
        return self._pool.restarts

    @property
    def _init_hooks(self) -> dict[int, Callable[[], None]]:
        """Test hooks: per-SUB-index callables run in the child before INIT_READY."""
        return self._pool.init_hooks

    @property
    def endpoints(self) -> list[LocalMailboxEndpoint]:
        """Every local endpoint: chips first, then SUB workers."""
        return [*self.chip_endpoints, *self.sub_endpoints]

    # -- registration ------------------------------------------------------------------------------

    def register(
        self,
        fn: Callable[..., Any] | str | RemoteCallable,
        kind: Kind = "sub",
        workers: list[int] | None = None,
    ) -> CallableHandle:
        """Register a callable (object or ``"pkg.mod:fn"``) and return its handle.

        ``kind``: ``"sub"`` (runs on SUB workers), ``"chip"`` (a chip kernel),
        ``"orchestration"`` (runs in the parent). Before ``init`` the callable
        enters the snapshot children inherit; after, it is broadcast to every
        target child, and a partial failure is rolled back
        (``RegistrationError(REGISTER_PARTIAL_FAILURE)``).

        At level 4, ``workers=[ids]`` installs ``"pkg.mod:fn"`` of ``kind`` into
        those L3 workers' own registries, and ``RemoteCallable("pkg.mod:fn")``
        registers an L3 orchestration function that ``submit_next_level`` runs
        there (on every remote worker when ``workers`` is None).
        """
        self._check_usable("register")
        if self.state is WorkerState.NEW:
            if isinstance(fn, RemoteCallable) or workers is not None:
                spec, kind2, remote, local = plan_install(self, fn, kind, workers)
                if remote:
                    self._fleet.install(spec, kind2, remote)
                if local:
                    self._pool.l3.install(spec, local)
                if kind2 == "orchestration" and self.registry.begin_register(
                    spec, frozenset(remote)
                ):
                    self.registry.commit_register(spec.handle.hashid)
                return spec.handle
            return self.register_spec(spec_for(fn, kind))
        return self._driver.drive(self.register_async(fn, kind, workers))  # type: ignore[no-any-return]

    async def register_async(
        self,
        fn: Callable[..., Any] | str | RemoteCallable,
        kind: Kind = "sub",
        workers: list[int] | None = None,
    ) -> CallableHandle:
        """``register`` after ``init`` without blocking the event loop."""
        self._check_ready("register")
        if isinstance(fn, RemoteCallable) or workers is not None:
            spec, kind2, remote, local = plan_install(self, fn, kind, workers)
            if local:
                await self._pool.l3.install_live(spec, local)
            if remote:
                try:
                    await self._fleet.install_live(spec, kind2, remote)
                except BaseException:
                    await self._pool.l3.drop(spec.handle.hashid, local)
                    raise
            if kind2 == "orchestration":
                return await register_on_all(self.registry, spec, [])
            return spec.handle
        spec = spec_for(fn, kind)
        return await register_on_all(self.registry, spec, self._targets_for(spec))

    def register_spec(self, spec: CallableSpec) -> CallableHandle:
        """Register an identified callable (a nested L3 keeps its parent's hashid)."""
        if self.state is WorkerState.NEW:
            if self.registry.begin_register(spec, frozenset()):
                self.registry.commit_register(spec.handle.hashid)
            return spec.handle
        coro = register_on_all(self.registry, spec, self._targets_for(spec))
        return self._driver.drive(coro)  # type: ignore[no-any-return]

    def unregister(self, handle: CallableHandle) -> None:
        """Drop one reference; the last one removes the callable from every child."""
        self._check_usable("unregister")
        if not isinstance(handle, CallableHandle):
            raise TypeError(
                f"cannot unregister: expected a CallableHandle, got {type(handle).__name__}"
            )
        if self.state is WorkerState.NEW:
            workers = self._fleet.uninstall(handle.hashid)
            local = self._pool.l3.uninstall(handle.hashid)
            if local is not None:
                self._pool.l3.uninstall_now(local)
            mine = (workers is None and local is None) or handle.hashid in self.registry
            if mine and self.registry.begin_unregister(handle.hashid) is not None:
                self.registry.finish_unregister(handle.hashid)
            return
        self._driver.drive(self.unregister_async(handle))

    async def unregister_async(self, handle: CallableHandle) -> None:
        self._check_ready("unregister")
        remote_only = self._pool.l3.remote_only(handle.hashid)  # before the fleet forgets it
        workers = self._fleet.uninstall(handle.hashid)
        local = self._pool.l3.uninstall(handle.hashid)
        if workers:
            await self._fleet.uninstall_live(handle.hashid, handle.name, workers)
        if local is not None and local.workers:
            await self._pool.l3.uninstall_live(local)
        if (workers is None and local is None) or handle.hashid in self.registry:

            def targets(spec: CallableSpec) -> list[RegistrationTarget]:
                return self._pool.registration_targets(spec.handle.role, nested=not remote_only)

            await unregister_on_all(self.registry, handle, targets)

    def _targets_for(self, spec: CallableSpec) -> list[RegistrationTarget]:
        """Where a spec must be installed: the live children of its role."""
        nested = not self._pool.l3.remote_only(spec.handle.hashid)
        return self._pool.registration_targets(spec.handle.role, nested=nested)

    # -- lifecycle -------------------------------------------------------------------------------------

    def init(self) -> None:
        """Fork every child and wait until all are ready, or roll back and raise ``StartupError``."""
        if self.state is not WorkerState.NEW or self._attached:
            raise StartupError(f"cannot init: worker is {self._attached or self.state.name}")
        self.state = WorkerState.INITIALIZING
        deadline = time.monotonic() + self.startup_timeout  # one for the whole tree
        pool = self._pool
        try:
            pool.start()
        except BaseException:
            self.state = WorkerState.FAILED
            pool.release_memory()
            raise
        try:
            # Remote sessions only after the last local fork, within the same deadline.
            self._fleet.open_all(deadline)
        except BaseException:
            self.state = WorkerState.FAILED
            pool.abort()
            raise
        manager = WorkerManager()
        for ep in sorted(
            [*self._fleet.endpoints.values(), *pool.chip_endpoints, *pool.l3_endpoints],
            key=lambda e: e.worker_id,
        ):
            manager.add_next_level_at(ep.worker_id, ep)
        for ep in pool.sub_endpoints:
            manager.add_sub(ep)
        assert pool.doorbell is not None
        depths = [ep.mailbox.pipeline_depth() for ep in pool.chip_endpoints]
        # Whole-run admission depth: the minimum the chip children published; 2 for SUB-only.
        depth = self.pipeline_depth or (min(depths) if depths else 2)
        self.manager = manager
        self.scheduler = Scheduler(
            manager,
            self.registry,
            pool.heap,
            pool.doorbell,
            pipeline_depth=max(1, depth),
            spin_s=self.scheduler_spin_s,
        )
        self._runs = RunBuilder(self.scheduler, self._driver)
        if self.level >= 4:
            self.scheduler.remote = self._fleet
            self.scheduler.next_level_orchestrations = True
        self._driver.start(self.scheduler, pool.doorbell)
        pool.serve(self.scheduler)
        self._fleet.serve(self.scheduler, self._driver)
        self._local_lane_dead = self.scheduler.on_lane_dead
        self.scheduler.replaces_dead_subs = self._local_lane_dead is not None
        self.scheduler.on_lane_dead = self._on_lane_dead
        self.state = WorkerState.READY

    def _on_lane_dead(self, lane: WorkerThread) -> None:
        if lane.worker_type is WorkerType.NEXT_LEVEL and self._fleet.is_remote(lane.worker_id):
            self._fleet.lane_dead(lane)
        elif self._local_lane_dead is not None:
            self._local_lane_dead(lane)

    # -- L3 workers (level 4) ------------------------------------------------------------------------

    def add_worker(self, worker: Worker) -> int:
        """Add a local L3 child (a NEW ``Worker(level=3)``, forked with its subtree at
        ``init``; frozen from now on: reach it through ``register(..., workers=[id])``) and
        return its stable worker id. Raises ``ValueError`` / ``TypeError`` naming why."""
        self._check_usable("add a worker")
        self._pool.l3.check_new(self, worker)
        wid = self._take_worker_id()
        worker._attached = f"this worker is L3 worker {wid} of a level-4 Worker"
        self._pool.l3.add(wid, worker, self.heap)
        return wid

    def _adopt_in_child(self, startup_timeout: float) -> None:
        """Inside the forked L3 child: this process now owns the worker (its parent only
        held it), within what is left of the root startup budget."""
        self._attached = None
        self._pid = self._pool._pid = os.getpid()
        self.startup_timeout = self._pool.startup_timeout = startup_timeout

    def _is_new(self) -> bool:
        return self.state is WorkerState.NEW

    def _ready(self) -> bool:
        return self.state is WorkerState.READY

    def _take_worker_id(self) -> int:
        wid = self._next_worker_id
        self._next_worker_id += 1
        return wid

    def _check_usable(self, what: str) -> None:
        if self._attached:
            raise WorkerClosedError(f"cannot {what}: {self._attached} (go through it)")
        if self.state in (WorkerState.CLOSED, WorkerState.FAILED):
            raise WorkerClosedError(f"cannot {what}: worker is {self.state.name}")

    def _check_ready(self, what: str) -> None:
        if self.state is not WorkerState.READY:
            raise WorkerClosedError(
                f"cannot {what}: worker is {self.state.name}"
                + (" (call init() first)" if self.state is WorkerState.NEW else "")
            )

    async def start_async(self) -> None:
        """Bind the Scheduler to the running loop (the daemon calls this once)."""
        self._check_ready("start")
        self._driver.bind(asyncio.get_running_loop())

    # -- memory ----------------------------------------------------------------------------------------

    def alloc(self, shape: tuple[int, ...] | int, dtype: Any = "float32") -> np.ndarray[Any, Any]:
        """A zero-filled NumPy array on the shared heap (children see the same bytes)."""
        self._check_usable("alloc")
        return self.heap.alloc(shape, dtype)

    def free(self, array: np.ndarray[Any, Any] | int | RemoteTensorRef) -> None:
        """Free a heap buffer (or a remote one); reused only once no task that captured it
        is live."""
        self._check_usable("free")
        if isinstance(array, RemoteTensorRef):
            self._check_ready("free a remote buffer")
            self._driver.drive(self._fleet.free(array))
            return
        self.heap.free(array)

    # -- runs --------------------------------------------------------------------------------------------

    def submit(self, orch: Orch, args: Any = None, config: CallConfig | None = None) -> RunHandle:
        """Queue a run and return its handle at once (the orchestration runs when admitted)."""
        driver = self._driver
        loop = driver.bound_elsewhere()
        if loop is not None:
            return asyncio.run_coroutine_threadsafe(
                self.submit_async(orch, args, config), loop
            ).result()
        with driver.lock:
            if self.state is WorkerState.READY:
                # Notice children that died while idle before dispatching to them.
                driver.poll_now()
            driver.run_tasks()
            self._check_ready("submit a run")
            run = self._runs.new_run(orch, args, config)
            if run.admitted:
                self._runs.build(run)
            return RunHandle(self, run)

    def run(self, orch: Orch, args: Any = None, config: CallConfig | None = None) -> None:
        """Run an orchestration to completion; raises ``TaskError`` when the run failed."""
        self.submit(orch, args, config).wait()

    async def submit_async(
        self, orch: Orch, args: Any = None, config: CallConfig | None = None
    ) -> RunHandle:
        self._check_ready("submit a run")
        self._driver.bind(asyncio.get_running_loop())
        run = self._runs.new_run(orch, args, config)
        if run.admitted:
            self._runs.build(run)
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
        assert self.scheduler is not None
        driver = self._driver
        if driver.loop is not None and asyncio._get_running_loop() is driver.loop:
            self._runs.cancel_now(run)  # on the bound loop: cancelling never blocks
            return
        loop = driver.bound_elsewhere()
        if loop is not None:
            loop.call_soon_threadsafe(self._runs.cancel_now, run)
            return
        with driver.lock:
            self._runs.cancel_now(run)

    def _wait_run(self, run: Run, timeout: float | None) -> None:
        if run.terminal:
            return
        loop = self._driver.bound_elsewhere()
        if loop is not None:
            asyncio.run_coroutine_threadsafe(wait_run(run, timeout), loop).result()
            return
        if not self._driver.drive_until(lambda: run.terminal, timeout):
            raise TimeoutError(
                f"run {run.run_id} not finished within {timeout}s (state {run.state.name})"
            )

    def poll(self) -> None:
        """Blocking API, between calls: notice children that died meanwhile and start
        their replacements now (a bound Worker's loop does this on its own)."""
        driver = self._driver
        if self.state is not WorkerState.READY or driver.loop is not None:
            return
        with driver.lock:
            driver.poll_now()
            driver.run_tasks()

    def _drive_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """Unbound mode: run Scheduler rounds on this thread until ``done()`` or the timeout."""
        return self._driver.drive_until(done, timeout)

    # -- introspection ------------------------------------------------------------------------------------

    def list_workers(self) -> list[dict[str, Any]]:
        """One entry per child: kind, id, pid, liveness, pipeline depth and lane state."""
        rows = self._pool.list_workers(self.manager)
        for row in self._fleet.rows():
            lane = self.manager.next_level.get(row["worker_id"]) if self.manager else None
            row["busy"] = bool(lane.inflight) if lane is not None else False
            rows.append(row)
        return rows

    def ping(self, worker_index: int, timeout: float | None = 5.0) -> int:
        """Round-trip a PING control to one SUB worker; returns its pid."""
        self._check_ready("ping")
        ep = self.sub_endpoints[worker_index]

        async def go() -> int:
            return (await ep.control(ControlOp.PING, timeout=timeout)).result0

        return self._driver.drive(go())  # type: ignore[no-any-return]

    # -- close ---------------------------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Drain admitted runs within ``timeout`` (default ``close_timeout``), cancel the
        rest, stop every child and release all memory. A second call is a no-op."""
        if self.state is WorkerState.CLOSED or self._attached:
            return  # an attached L3 worker is closed by its level-4 parent
        if os.getpid() != self._pid:  # a forked child must never tear down its parent's pool
            return
        budget = self.close_timeout if timeout is None else timeout
        if self.state is not WorkerState.READY:
            self.state = WorkerState.CLOSED
            self._pool.release_memory()
            return
        driver = self._driver
        loop = driver.bound_elsewhere()
        if loop is not None:
            asyncio.run_coroutine_threadsafe(self.close_async(budget), loop).result()
            return
        with driver.lock:
            deadline = time.monotonic() + budget
            sched = self.scheduler
            assert sched is not None
            self.state = WorkerState.CLOSED
            sched.admission.closed = True
            runs = [r for r in sched.admission.runs() if not r.terminal]
            driver.drive_until(lambda: all(r.terminal for r in runs), budget / 2)
            self._runs.cancel_all()
            self._stop_sync(deadline)
            driver.close_aux()

    async def close_async(self, timeout: float | None = None) -> None:
        """The stop sequence from the bound loop: drain, cancel, stop, reap, release."""
        if self.state is WorkerState.CLOSED:
            return
        if self.state is not WorkerState.READY:
            self.state = WorkerState.CLOSED
            self._pool.release_memory()
            return
        budget = self.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        sched = self.scheduler
        assert sched is not None
        self.state = WorkerState.CLOSED
        sched.admission.closed = True
        pending = [r for r in sched.admission.runs() if not r.terminal]
        if pending and self._driver.loop is not None:
            waits = [asyncio.ensure_future(wait_run(r, None)) for r in pending]
            _, not_done = await asyncio.wait(waits, timeout=budget / 2)
            for t in not_done:
                t.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        self._runs.cancel_all()
        await self._driver.unbind()
        self._stop_sync(deadline)

    def _stop_sync(self, deadline: float) -> None:
        """Stop lanes, progress until every frame is terminal, reap, release memory."""
        sched = self.scheduler
        manager = self.manager
        assert sched is not None and manager is not None
        manager.stop_workers()
        # Remote sessions first: SHUTDOWN fails their task in flight at once (a remote
        # task cannot be stopped any other way), so draining local frames never waits on it.
        self._fleet.shutdown(max(0.1, deadline - time.monotonic()))
        self._pool.stop(deadline)
        sched.round()  # poisoned endpoints release their withheld completions now
        self._runs.abandon_unfinished()
        manager.stop()
        self._driver.stop()
        self._pool.release()

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


__all__ = ["RunCancelled", "RunHandle", "TaskArgs", "Worker", "WorkerState"]
