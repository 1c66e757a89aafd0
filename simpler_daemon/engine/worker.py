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

* ``lifecycle.Lifecycle`` (a mixin): the state, ``init`` and ``close``, an init that
  ``close()`` cancels and that ``register()`` on another thread waits for;
* ``pool.ChildPool``: forking, the startup barrier, rollback, replacing dead
  children, reaping them at close;
* ``scheduler.driver.Driver``: who runs the Scheduler's rounds. Used synchronously
  (``run``/``submit``/``wait``), the calling thread drives them and parks in
  poll(2), and a background thread takes over while runs are unfinished and no
  caller drives; used from a running loop (``run_async``) the Scheduler binds to
  that loop. One Worker uses one style;
* ``handle.RunHandle``: a submitted run, used like a ``concurrent.futures.Future``;
* ``registration``: the register/unregister broadcast (to every child at once, each
  control with a deadline) with rollback;
* ``remote_l3.RemoteFleet``: a level-4 Worker's remote L3 workers (sessions,
  callables installed into them, their buffers);
* ``local_l3.LocalL3Set`` (held by the pool): its local L3 children (``add_worker``),
  forked by the pool, run by ``children/nested.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import numpy as np

from simpler_daemon.args import CallConfig, TaskArgs
from simpler_daemon.callables import CallableHandle, CallableRegistry, CallableSpec
from simpler_daemon.children.forkserver import ForkServer
from simpler_daemon.children.process import ChildProcess
from simpler_daemon.endpoints.local import LocalMailboxEndpoint
from simpler_daemon.engine.handle import RunHandle
from simpler_daemon.engine.lifecycle import (
    InitGate,
    Lifecycle,
    WorkerState,
    check_budget,
    check_timeout,
)
from simpler_daemon.engine.local_l3 import installs_into_l3, plan_install
from simpler_daemon.engine.mapping import map_tasks
from simpler_daemon.engine.orchestrator import Orchestrator, Run
from simpler_daemon.engine.pool import ChildPool
from simpler_daemon.engine.registration import (
    RegistrationTarget,
    nowhere_to_run,
    register_on_all,
    reload_on_all,
    spec_for,
    unregister_on_all,
)
from simpler_daemon.engine.remote_api import RemoteMethods
from simpler_daemon.engine.remote_l3 import RemoteFleet
from simpler_daemon.engine.runs import wait_run
from simpler_daemon.errors import RunCancelled, WorkerClosedError, WorkerStateError
from simpler_daemon.heap import Heap
from simpler_daemon.mailbox.doorbell import Doorbell
from simpler_daemon.mailbox.layout import ControlOp, Mailbox
from simpler_daemon.mapcommon import DEFAULT_CHUNKSIZE
from simpler_daemon.remote.spec import ReconnectPolicy, RemoteCallable, RemoteTensorRef
from simpler_daemon.scheduler.dispatch import Scheduler
from simpler_daemon.scheduler.driver import Driver, retire_background_threads
from simpler_daemon.scheduler.fair import ADMISSION_POLICIES, DEFAULT_MAX_ACTIVE_RUNS
from simpler_daemon.scheduler.lanes import WorkerManager, WorkerThread, WorkerType
from simpler_daemon.taskvalues import DEFAULT_MAX_RESULT_BYTES, DEFAULT_MAX_VALUE_BYTES

Orch = Callable[[Orchestrator, Any, CallConfig], Any]
Kind = Literal["sub", "chip", "orchestration"]


class Worker(Lifecycle, RemoteMethods):
    """A level-3 node: SUB workers (Python callables) under one Scheduler.

    ``num_sub_workers`` defaults to the CPU count. ``heap_bytes`` sizes the
    shared heap, mapped now so arrays allocated before ``init`` are shared too;
    ``heap_name`` makes it a ``/dev/shm`` file other local processes may map
    (unlinked at close). ``reconnect`` (level 4) says how a failed remote session
    is reopened: a ``ReconnectPolicy`` (backoff, ``max_elapsed_s``), ``True`` for the
    default one (forever), ``False`` for never; ``None`` follows ``restart_children``.
    ``trace=True`` records every run's task attempts for ``RunHandle.trace()`` (off by
    default: untraced SUB tasks complete in C without a Python call each).
    ``max_value_bytes`` bounds one task's values and kwargs (``TaskArgs.add_value``,
    ``set_kwargs``) encoded, ``max_result_bytes`` a SUB callable's return value encoded
    (64 MiB each by default): a larger value is refused at submit, a larger result fails
    its task.
    ``sub_queue_depth=2`` (the default) lets a SUB lane hold its next task in a second
    mailbox frame while it runs one, so the child starts it without waiting for this
    process; 1 hands each SUB task over only once its lane is free (a long task then
    never holds a short one back behind it).
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
        admission: str = "fifo",
        max_active_runs: int = DEFAULT_MAX_ACTIVE_RUNS,
        reconnect: bool | ReconnectPolicy | None = None,
        trace: bool = False,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        sub_queue_depth: int = 2,
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
        if admission not in ADMISSION_POLICIES:
            raise ValueError(
                f"cannot create Worker: admission={admission!r} is not one of "
                f"{', '.join(ADMISSION_POLICIES)}"
            )
        if (
            isinstance(max_active_runs, bool)
            or not isinstance(max_active_runs, int)
            or max_active_runs < 1
        ):
            raise ValueError(
                f"cannot create Worker: max_active_runs={max_active_runs!r} must be an int >= 1"
            )
        for name, limit in (
            ("max_value_bytes", max_value_bytes),
            ("max_result_bytes", max_result_bytes),
        ):
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(
                    f"cannot create Worker: {name}={limit!r} must be an int >= 0 (bytes)"
                )
        if isinstance(sub_queue_depth, bool) or sub_queue_depth not in (1, 2):
            raise ValueError(
                f"cannot create Worker: sub_queue_depth={sub_queue_depth!r} must be 1 or 2 "
                "(tasks a SUB lane holds: the running one, and one queued behind it)"
            )
        # A startup without a finite budget lets one hung child hold init() forever.
        startup_timeout = check_budget(
            startup_timeout, "create Worker", "startup_timeout", positive=True
        )
        close_timeout = check_budget(
            close_timeout, "create Worker", "close_timeout", positive=False
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
        self.admission = admission
        self.max_active_runs = max_active_runs
        if not isinstance(trace, bool):
            raise TypeError(f"cannot create Worker: trace={trace!r} must be True or False")
        self.trace = trace
        self.max_value_bytes = max_value_bytes
        self.max_result_bytes = max_result_bytes
        self.sub_queue_depth = sub_queue_depth
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
            max_result_bytes=max_result_bytes,
            sub_queue_depth=sub_queue_depth,
        )
        if reconnect is None:
            reconnect = restart_children
        elif not isinstance(reconnect, (bool, ReconnectPolicy)):
            raise TypeError(
                "cannot create Worker: reconnect= must be a ReconnectPolicy, True or False, "
                f"got {type(reconnect).__name__}"
            )
        self._fleet = RemoteFleet(startup_timeout=startup_timeout, reconnect=reconnect)
        # A RemoteCallable's orchestration never goes to the local L3 children.
        self._pool.l3.remote_only = self._fleet.installs.__contains__
        #: Set while this Worker is a local L3 child of a level-4 Worker (frozen here).
        self._attached: str | None = None
        #: NEXT_LEVEL ids: chips 0..num_chips-1 at level 3, L3 children in the order added.
        self._next_worker_id = num_chips
        self._init_gate = InitGate()
        self._init_called_at = 0.0
        #: The root's startup deadline, in a forked L3 child (``_adopt_in_child``).
        self._startup_deadline: float | None = None
        #: Test hook: runs on the init thread once remote sessions are attached.
        self._after_attach: Callable[[], None] | None = None
        self.state = WorkerState.NEW
        self.manager: WorkerManager | None = None
        self.scheduler: Scheduler | None = None
        self._pid = os.getpid()

    def init(self) -> None:
        """Fork every child and wait until all are ready (``Lifecycle.init``).

        Forks need a process with one thread: the idle background driver threads of
        other Workers end first, and while one still drives unfinished runs this raises
        ``StartupError`` (a Worker cannot be initialised while another Worker's runs are
        in flight in the same process; wait for them or close it)."""
        self._init_called_at = time.monotonic()  # startup_timeout counts from here
        if self.state is WorkerState.NEW and not self._attached:
            retire_background_threads("init")
        super().init()

    # -- the pieces, as the daemon, the CLI and tests see them ----------------------------------------

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
        *,
        reload: bool = False,
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
        there (``workers=[remote ids]`` required). A chip kernel without ``workers=``
        goes into every L3 worker that has chips (``local_l3.plan_install``).

        Called while ``init`` runs on another thread, it waits for init, then registers
        (or raises init's failure). A callable that could never run here (a SUB callable
        without SUB workers, a chip kernel without chips) is refused: ``ValueError``.

        ``reload=True`` (after ``init``, an import path already registered): re-import
        its module from the current source in every SUB child (in this process for an
        orchestration function), no task of it being dispatched meanwhile; the hashid and
        the reference count stay (``registration.reload_on_all``).
        """
        self._check_usable("register")
        self._await_init("register")
        if reload:
            self._check_ready("reload a callable")
            return self._driver.drive(  # type: ignore[no-any-return]
                self.register_async(fn, kind, workers, reload=True)
            )
        if self.state is WorkerState.NEW:
            if isinstance(fn, RemoteCallable) or installs_into_l3(self, fn, kind, workers):
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
            spec = spec_for(fn, kind)
            self._check_runnable(spec)
            return self.register_spec(spec)
        return self._driver.drive(self.register_async(fn, kind, workers))  # type: ignore[no-any-return]

    async def register_async(
        self,
        fn: Callable[..., Any] | str | RemoteCallable,
        kind: Kind = "sub",
        workers: list[int] | None = None,
        *,
        reload: bool = False,
    ) -> CallableHandle:
        """``register`` after ``init`` without blocking the event loop."""
        self._check_ready("register")
        if reload:
            if not isinstance(fn, str) or workers is not None:
                raise TypeError(
                    f"cannot reload {fn!r}: pass the import path 'pkg.mod:fn' it was registered "
                    "with (and no workers=; a reload reaches this Worker's own SUB workers)"
                )
            spec = spec_for(fn, kind)
            assert self.scheduler is not None  # READY
            targets = self._targets_for(spec)
            return await reload_on_all(self.registry, spec, targets, self.scheduler.holding)
        if isinstance(fn, RemoteCallable) or installs_into_l3(self, fn, kind, workers):
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
        self._check_runnable(spec)
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
        self._await_init("unregister")
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

            if self.scheduler is not None:
                # The Scheduler's cached SUB validation holds a registry entry: not one
                # being dropped (a callable unregistered is not kept alive by it).
                self.scheduler.valid_sub = None
            await unregister_on_all(self.registry, handle, targets)

    def _check_runnable(self, spec: CallableSpec) -> None:
        """Refuse a callable that could never run here. A level-4 Worker learns its local
        L3 workers until init, so before init only ``init`` can tell (``_check_registry``)."""
        if self.level >= 4 and self.state is WorkerState.NEW and spec.handle.role == "sub":
            return
        why = nowhere_to_run(
            spec,
            sub_workers=self.num_sub_workers,
            chips=self.num_chips,
            l3_workers=len(self._pool.l3.workers),
        )
        if why:
            raise ValueError(f"cannot register: {why}")

    def _targets_for(self, spec: CallableSpec) -> list[RegistrationTarget]:
        """Where a spec must be installed: the live children of its role."""
        nested = not self._pool.l3.remote_only(spec.handle.hashid)
        return self._pool.registration_targets(spec.handle.role, nested=nested)

    def _on_lane_dead(self, lane: WorkerThread) -> None:
        if lane.worker_type is WorkerType.NEXT_LEVEL and self._fleet.is_remote(lane.worker_id):
            self._fleet.lane_dead(lane)
        elif self._local_lane_dead is not None:
            self._local_lane_dead(lane)

    # -- L3 workers (level 4) ------------------------------------------------------------------------

    def add_worker(self, worker: Worker) -> int:
        """Add a local L3 child (a NEW ``Worker(level=3)``, forked with its subtree at
        ``init``; frozen from now on: reach it through ``register(..., workers=[id])``) and
        return its stable worker id. Raises ``WorkerStateError`` when this Worker or the
        child is in the wrong state for it (not level 4, after ``init``, a child that is
        not NEW or already attached) and ``ValueError`` / ``TypeError`` for a bad child."""
        self._check_usable("add a worker")
        self._pool.l3.check_new(self, worker)
        wid = self._take_worker_id()
        worker._attached = f"this worker is L3 worker {wid} of a level-4 Worker"
        self._pool.l3.add(wid, worker, self.heap)
        return wid

    def _adopt_in_child(self, startup_timeout: float, deadline: float) -> None:
        """Inside the forked L3 child: this process now owns the worker (its parent only
        held it), under the root's startup deadline (``startup_timeout`` after the
        root's ``init()``)."""
        self._attached = None
        self._pid = self._pool._pid = os.getpid()
        self.startup_timeout = self._pool.startup_timeout = startup_timeout
        self._startup_deadline = deadline

    def _is_new(self) -> bool:
        return self.state is WorkerState.NEW

    def _ready(self) -> bool:
        return self.state is WorkerState.READY

    def _take_worker_id(self) -> int:
        wid = self._next_worker_id
        self._next_worker_id += 1
        return wid

    def _check_usable(self, what: str) -> None:
        """``WorkerStateError`` for an attached L3 worker, ``WorkerClosedError`` (a
        ``WorkerStateError`` too) once CLOSED or FAILED."""
        if self._attached:
            raise WorkerStateError(f"cannot {what}: {self._attached} (go through it)")
        if self.state in (WorkerState.CLOSED, WorkerState.FAILED):
            raise WorkerClosedError(f"cannot {what}: worker is {self.state.name}")

    def _check_ready(self, what: str) -> None:
        """``WorkerStateError`` naming the state unless READY (``WorkerClosedError`` once
        CLOSED or FAILED)."""
        state = self.state
        if state is WorkerState.READY:
            return
        if state in (WorkerState.CLOSED, WorkerState.FAILED):
            raise WorkerClosedError(f"cannot {what}: worker is {state.name}")
        raise WorkerStateError(
            f"cannot {what}: worker is {state.name}"
            + (" (call init() first)" if state is WorkerState.NEW else " (init() is running)")
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

    def submit(
        self,
        orch: Orch,
        args: Any = None,
        config: CallConfig | None = None,
        *,
        priority: int = 1,
        client: object = None,
    ) -> RunHandle:
        """Queue a run and return its handle at once (the orchestration runs when admitted).

        The run progresses on its own: while nobody waits on this Worker, its background
        driver thread runs the Scheduler (a bound Worker's loop does). Under
        ``admission="fair"``, ``priority`` (1 to 1000) weighs the run's share of the
        workers and runs with the same ``client`` share one client's part."""
        self._check_admitting()
        driver = self._driver
        loop = driver.bound_elsewhere()
        if loop is not None:
            return asyncio.run_coroutine_threadsafe(
                self.submit_async(orch, args, config, priority=priority, client=client), loop
            ).result()
        with driver.lock:
            return RunHandle(self, self._new_run(orch, args, config, priority, client))

    def _check_admitting(self) -> None:
        """Before waiting for the driver's lock: a close in progress on another thread
        (which holds it while it drains) refuses a new run at once."""
        sched = self.scheduler
        if sched is not None and sched.admission.closed:
            if not self._stop_pending:  # the close has not reached its drain, or is done
                self._check_ready("submit a run")  # CLOSED already
            raise WorkerClosedError("cannot submit a run: the worker is closing")

    def _new_run(
        self, orch: Orch, args: Any, config: CallConfig | None, priority: int, client: object
    ) -> Run:
        """``submit``'s work, under ``driver.lock``: create the run, build it if admitted."""
        driver = self._driver
        # ``_state``, not the ``state`` property: this runs on every submit.
        if self._state is not WorkerState.READY:
            driver.run_tasks()
            self._check_ready("submit a run")
        else:
            # Notice children that died while idle before dispatching to them (at most
            # once per ``SUBMIT_POLL_S``: back-to-back runs are watched by their rounds).
            driver.before_submit()
        run = self._runs.new_run(orch, args, config, priority, client)
        if run.admitted:
            self._runs.build(run)
        return run

    def run(
        self,
        orch: Orch,
        args: Any = None,
        config: CallConfig | None = None,
        *,
        priority: int = 1,
        client: object = None,
    ) -> None:
        """Run an orchestration to completion; raises ``TaskError`` when the run failed."""
        self._check_admitting()
        driver = self._driver
        if driver.loop is not None:
            self.submit(orch, args, config, priority=priority, client=client).wait()
            return
        # One caller from the submit to the run's end: the background thread never
        # starts for a run whose caller is about to drive it. Refused before the run is
        # created when called from inside a round (a done callback): it could not end.
        driver.check_may_wait()
        with driver.lock:
            run = self._new_run(orch, args, config, priority, client)
            if run.terminal or driver.rounds(lambda: run.terminal, handover=True) is not None:
                # No RunHandle on this path: what ``handle.wait()`` raises, without it.
                if run.orch_exception is not None:
                    raise run.orch_exception
                if run.error is not None:
                    raise run.error
                return
        # Another thread wants the lock (a submit, a cancel): it gets it, this thread
        # waits as any other (``drive_until`` drives again once the lock is free).
        RunHandle(self, run).wait()

    async def submit_async(
        self,
        orch: Orch,
        args: Any = None,
        config: CallConfig | None = None,
        *,
        priority: int = 1,
        client: object = None,
        run_id: int | None = None,
    ) -> RunHandle:
        """Event-loop native ``submit``; ``run_id``: one taken with ``Run.reserve_id``
        (the daemon names a run it queued itself before submitting it)."""
        self._check_ready("submit a run")
        self._driver.bind(asyncio.get_running_loop())
        run = self._runs.new_run(orch, args, config, priority, client, run_id)
        if run.admitted:
            self._runs.build(run)
        return RunHandle(self, run)

    async def run_async(
        self,
        orch: Orch,
        args: Any = None,
        config: CallConfig | None = None,
        *,
        priority: int = 1,
        client: object = None,
    ) -> None:
        """Event-loop native ``run``: awaits completion, raises ``TaskError`` on failure."""
        handle = await self.submit_async(orch, args, config, priority=priority, client=client)
        await handle.wait_async()

    def cancel(self, handle: RunHandle | Run, terminate: bool = False, reason: str = "") -> None:
        """Cancel a run: unstarted tasks fail, running ones finish; with ``terminate``
        the local workers running its tasks are killed (and replaced) and those tasks'
        outcome is CANCELLED (remote tasks run to their end).

        The run's error is a ``RunCancelled`` with outcome CANCELLED: ``run N cancelled:
        <reason>``, and with ``terminate`` the first task stopped, where it ran (worker,
        pid) and its message. The run is terminal once none of its tasks runs any more
        (see ``RunHandle.cancel``)."""
        run = handle.run if isinstance(handle, RunHandle) else handle
        assert self.scheduler is not None
        sched = self.scheduler

        def cancel_now() -> None:
            self._runs.cancel_now(run, reason)
            if terminate:
                sched.terminate(run, reason)

        driver = self._driver
        if driver.loop is not None and asyncio._get_running_loop() is driver.loop:
            cancel_now()  # on the bound loop: cancelling never blocks
            return
        loop = driver.bound_elsewhere()
        if loop is not None:
            loop.call_soon_threadsafe(cancel_now)
            return
        with driver.lock:
            cancel_now()

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

    def map(
        self,
        handle: CallableHandle,
        iterable: Iterable[Any],
        *,
        chunksize: int = DEFAULT_CHUNKSIZE,
        config: CallConfig | None = None,
        timeout: float | None = None,
    ) -> Iterator[Any]:
        """Run SUB callable ``handle`` once per item (the item as its single value,
        ``args.values[0]``) and yield the results in order: runs of ``chunksize`` tasks,
        two in flight ahead of the results taken (``engine/mapping.py``). A failed task
        raises its ``TaskError`` there; ``timeout`` bounds each run's wait."""
        return map_tasks(
            self, handle, iterable, chunksize=chunksize, config=config, timeout=timeout
        )

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
            row["current_task"] = lane.current_task() if lane is not None else ""
            rows.append(row)
        return rows

    def ping(self, worker_index: int, timeout: float | None = 5.0) -> int:
        """Round-trip a PING control to one SUB worker; returns its pid.

        ``timeout`` None or ``inf`` waits forever; NaN or negative is a ``ValueError``."""
        self._check_ready("ping")
        ep = self.sub_endpoints[worker_index]
        timeout = check_timeout(timeout, f"ping {ep.label}")

        async def go() -> int:
            return (await ep.control(ControlOp.PING, timeout=timeout)).result0

        return self._driver.drive(go())  # type: ignore[no-any-return]

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
