"""The Worker's lifecycle rules across threads, and the checks of its timeouts.

::

    init() on thread T                    close() / register() on another thread U
      InitGate.begin                        state INITIALIZING:
      fork, startup barrier --------------    close: cancel() -> True on T itself (a signal
        (gate.check(): raise once a close      handler: it cannot wait; init rolls back and
         was requested)                        raises), else wait() for the rollback
      READY, or roll back and raise            register: wait() -> READY: go on;
      InitGate.end(error)                                failed: raise init's own failure

A cancelled init leaves nothing (no child, no mapping) and raises
``WorkerClosedError``. ``check_timeout`` is how every public timeout is validated:
NaN and negative values are refused, ``None`` and ``inf`` mean "no limit";
``check_budget`` is for configured budgets (``startup_timeout``: finite and > 0).

``Lifecycle`` is the part of ``Worker`` that owns its state: ``init`` (the pool's
start, remote sessions, the Scheduler and its driver; any failure rolls back what
started) and ``close`` / ``close_async`` (drain, cancel, stop, reap, release, and drop
every registered callable so a closed Worker keeps none alive).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import math
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from simpler_daemon.engine.registration import nowhere_to_run
from simpler_daemon.engine.runs import RunBuilder, wait_run
from simpler_daemon.errors import StartupError, WorkerClosedError, WorkerStateError
from simpler_daemon.scheduler.dispatch import Scheduler
from simpler_daemon.scheduler.lanes import WorkerManager
from simpler_daemon.scheduler.trace import traced, traced_pumped

if TYPE_CHECKING:
    from simpler_daemon.callables import CallableRegistry
    from simpler_daemon.engine.pool import ChildPool
    from simpler_daemon.engine.remote_l3 import RemoteFleet
    from simpler_daemon.scheduler.driver import Driver
    from simpler_daemon.scheduler.lanes import WorkerThread


class WorkerState(enum.Enum):
    NEW = "NEW"
    INITIALIZING = "INITIALIZING"
    READY = "READY"
    FAILED = "FAILED"
    CLOSED = "CLOSED"


#: What a cancelled init raises (and what the startup barrier reports).
CLOSED_DURING_INIT: Final = "close() was called during init"


def check_timeout(value: object, what: str, name: str = "timeout") -> float | None:
    """A wait's timeout: ``None`` (or ``inf``) waits forever, ``0`` only looks.

    Raises ``TypeError`` for a non-number and ``ValueError`` for NaN or a negative value,
    as ``"cannot <what>: <name>=<value> ..."``.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"cannot {what}: {name}={value!r} must be a number of seconds or None, "
            f"not {type(value).__name__}"
        )
    seconds = float(value)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(
            f"cannot {what}: {name}={value!r} must be >= 0 seconds (None or inf: no limit)"
        )
    return None if math.isinf(seconds) else seconds


def check_budget(value: object, what: str, name: str, *, positive: bool) -> float:
    """A configured time budget: a finite number of seconds, > 0 when ``positive``
    (a startup with no time at all, or forever, is a mistake) else >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"cannot {what}: {name}={value!r} must be a number of seconds, "
            f"not {type(value).__name__}"
        )
    seconds = float(value)
    bound = "> 0" if positive else ">= 0"
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        raise ValueError(f"cannot {what}: {name}={value!r} must be a finite number {bound}")
    return seconds


def _closed_why(budget: float, started: float) -> str:
    """Why ``close`` ended a run: how long it let the run go on."""
    return (
        f"close(timeout={budget:g}) let it run {time.monotonic() - started:.2f} s "
        "(half of the timeout; the rest stops the children), then cancelled it"
    )


class InitGate:
    """What other threads (and signal handlers) see of an ``init`` in progress."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._done.set()
        self._thread: int | None = None
        self.close_requested = False
        #: Why the last init failed (None when it succeeded or none ran).
        self.error: BaseException | None = None

    def begin(self) -> None:
        """Called by ``init`` before the worker shows INITIALIZING."""
        self.close_requested = False
        self.error = None
        self._thread = threading.get_ident()
        self._done.clear()

    def end(self, error: BaseException | None) -> None:
        """Called by ``init`` once the worker is READY, FAILED or CLOSED."""
        self.error = error
        self._thread = None
        self._done.set()

    def on_init_thread(self) -> bool:
        return self._thread == threading.get_ident()

    def cancel(self) -> bool:
        """Ask the running init to roll back. True when called on the init thread itself
        (from a signal handler), which must not wait for it."""
        self.close_requested = True
        return self.on_init_thread()

    def check(self) -> None:
        """Raise ``StartupError`` once a close was requested (the startup barrier, between
        the steps of init)."""
        if self.close_requested:
            raise StartupError(f"cannot start worker: {CLOSED_DURING_INIT}")

    def wait(self, what: str) -> None:
        """Block until the init in progress has ended; raises when called on its own
        thread (a signal handler there would wait for itself)."""
        if self.on_init_thread():
            raise WorkerStateError(
                f"cannot {what}: worker is INITIALIZING (called on the thread running init)"
            )
        self._done.wait()

    def failure(self, what: str) -> BaseException:
        """What a caller that waited for a failed init raises: init's own error."""
        error = self.error
        if isinstance(error, Exception):
            return error
        return StartupError(
            f"cannot {what}: init failed"
            + (f" ({type(error).__name__})" if error is not None else "")
        )


class Lifecycle:
    """``init`` and ``close`` of the Worker, and its state (mixed into Worker)."""

    level: int
    num_sub_workers: int
    num_chips: int
    startup_timeout: float
    close_timeout: float
    scheduler_spin_s: float
    admission: str
    max_active_runs: int
    trace: bool
    max_value_bytes: int
    pipeline_depth: int | None
    registry: CallableRegistry
    manager: WorkerManager | None
    scheduler: Scheduler | None
    _pool: ChildPool
    _fleet: RemoteFleet
    _driver: Driver
    _init_gate: InitGate
    _runs: RunBuilder
    _attached: str | None
    _pid: int
    _state: WorkerState
    _init_called_at: float
    _startup_deadline: float | None
    _after_attach: Callable[[], None] | None
    #: CLOSED, but the children not stopped yet: a close whose loop ended under it.
    _stop_pending: bool = False
    _local_lane_dead: Callable[[WorkerThread], None] | None

    # Provided by Worker.
    def _check_usable(self, what: str) -> None:
        raise NotImplementedError

    def _on_lane_dead(self, lane: WorkerThread) -> None:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    @property
    def state(self) -> WorkerState:
        return self._state

    @state.setter
    def state(self, state: WorkerState) -> None:
        self._state = state
        # Dead children and failed sessions come back only while serving.
        self._pool.serving = self._fleet.serving = state is WorkerState.READY

    def _check_registry(self) -> None:
        """Before forking a level-4 tree: every callable registered so far can run
        somewhere (``register`` could not tell before the L3 workers were added). A
        level-3 Worker checked each at ``register``; what ``register_spec`` added came
        from its level-4 parent, which runs its SUB callables as L3 orchestrations."""
        if self.level < 4:
            return
        for entry in self.registry.active():
            why = nowhere_to_run(
                entry.spec,
                sub_workers=self.num_sub_workers,
                chips=self.num_chips,
                l3_workers=len(self._pool.l3.workers),
            )
            if why:
                raise StartupError(f"cannot init: {why}; unregister it first")

    def _await_init(self, what: str) -> None:
        """An init running on another thread: wait for it, then go on when it succeeded
        and raise its own failure when it did not."""
        if self.state is not WorkerState.INITIALIZING:
            return
        self._init_gate.wait(what)
        if not self._ready():  # init ran on another thread meanwhile
            if self._init_gate.error is not None:
                raise self._init_gate.failure(what)
            self._check_usable(what)

    # -- lifecycle -------------------------------------------------------------------------------------

    def init(self) -> None:
        """Fork every child and wait until all are ready, or roll back and raise ``StartupError``.

        ``close()`` meanwhile (another thread, or a signal handler on this one) cancels it:
        everything is rolled back and ``WorkerClosedError`` raised. Ctrl-C rolls back too,
        then propagates as ``KeyboardInterrupt``. ``WorkerStateError`` (naming the state)
        unless the worker is NEW and not an attached L3 worker.
        """
        if self._attached:
            raise WorkerStateError(f"cannot init: {self._attached} (its parent inits it)")
        if self.state is not WorkerState.NEW:
            cls = WorkerClosedError if self.state is WorkerState.CLOSED else WorkerStateError
            raise cls(f"cannot init: worker is {self.state.name} (init() runs once)")
        self._check_registry()
        gate = self._init_gate
        gate.begin()
        self.state = WorkerState.INITIALIZING
        error: BaseException | None = None
        try:
            self._start_tree()
            if gate.close_requested:  # asked after the last check: close what just started
                self._close_started(self.close_timeout)
                raise WorkerClosedError(f"cannot init: {CLOSED_DURING_INIT}; it was closed")
        except BaseException as exc:
            error = exc
            if gate.close_requested and isinstance(exc, Exception):
                self.state = WorkerState.CLOSED
                self._drop_callables()
                if not isinstance(exc, WorkerClosedError):
                    error = WorkerClosedError(
                        f"cannot init: {CLOSED_DURING_INIT}; every child was stopped"
                    )
                    raise error from exc
            raise
        finally:
            gate.end(error)

    def _start_tree(self) -> None:
        """``init``'s steps: on any failure (or a close requested meanwhile) what was
        started is stopped and the worker is FAILED."""
        gate = self._init_gate
        # One deadline for the whole tree, startup_timeout after the call of init() (the
        # root's, in a forked L3 child).
        called = self._init_called_at or time.monotonic()
        deadline = self._startup_deadline or called + self.startup_timeout
        pool = self._pool
        try:
            pool.start(gate.check, deadline)
        except BaseException:
            self.state = WorkerState.FAILED
            pool.release_memory()
            raise
        started = False
        try:
            gate.check()
            # Remote sessions only after the last local fork, within the same deadline.
            try:
                self._fleet.open_all(deadline)
            except StartupError as exc:  # say how long init waited in all, not one session
                waited = time.monotonic() - (deadline - self.startup_timeout)
                raise StartupError(
                    f"{exc} (init() waited {waited:.2f} s, startup_timeout="
                    f"{self.startup_timeout:g} s)"
                ) from exc
            if self._after_attach is not None:
                self._after_attach()
            gate.check()
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
                admission=self.admission,
                max_active_runs=self.max_active_runs,
            )
            self._runs = RunBuilder(self.scheduler, self._driver, trace=self.trace)
            if self.trace:
                self.scheduler.on_task_event = traced(self.scheduler.on_task_event)
                self.scheduler.on_pumped = traced_pumped()
            self.scheduler.max_value_bytes = self.max_value_bytes
            if self.level >= 4:
                self.scheduler.remote = self._fleet
                self.scheduler.next_level_orchestrations = True
            started = True
            self._driver.start(self.scheduler, pool.doorbell)
            pool.serve(self.scheduler)
            self._fleet.serve(self.scheduler, self._driver)
            self._local_lane_dead = self.scheduler.on_lane_dead
            self.scheduler.replaces_dead_subs = self._local_lane_dead is not None
            self.scheduler.on_lane_dead = self._on_lane_dead
            # Once more before READY (as the origin): a tree that came up in time but
            # whose init thread was held up afterwards is late all the same.
            now = time.monotonic()
            if now > deadline:
                raise StartupError(
                    "cannot start worker: every child started, but init() reached READY "
                    f"{now - (deadline - self.startup_timeout):.2f} s after it was called, "
                    f"past startup_timeout={self.startup_timeout:g} s; everything was stopped"
                )
        except BaseException:
            self.state = WorkerState.FAILED
            with contextlib.suppress(Exception):
                self._fleet.shutdown(0.5)
            if started:
                self._driver.stop()
            pool.abort()
            raise
        self.state = WorkerState.READY

    # -- close ---------------------------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Drain admitted runs within ``timeout`` (default ``close_timeout``), cancel the
        rest, stop every child and release all memory. A second call is a no-op.

        During ``init`` it cancels the init (from another thread it returns once that
        rolled back). Inside an orchestration function of this worker it raises
        ``WorkerClosedError`` at once: the run would wait for itself.
        """
        if self._attached:
            return  # an attached L3 worker is closed by its level-4 parent
        if os.getpid() != self._pid:  # a forked child must never tear down its parent's pool
            return
        if self.state is WorkerState.CLOSED:
            if self._stop_pending:  # the loop of an earlier close ended under it
                self._finish_stop(self._close_budget(timeout))
            return
        self._check_not_within_run()
        budget = self._close_budget(timeout)
        if self.state is WorkerState.INITIALIZING:
            if self._init_gate.cancel():
                return  # a signal handler on the init thread: init rolls back and raises
            self._init_gate.wait("close")
            self.close(budget)  # READY (init had finished), or already rolled back
            return
        if self.state is not WorkerState.READY:
            self.state = WorkerState.CLOSED
            self._pool.release_memory()
            self._drop_callables()
            return
        self._close_started(budget)

    def _close_started(self, budget: float) -> None:
        driver = self._driver
        sched = self.scheduler
        assert sched is not None
        started = time.monotonic()
        loop = driver.bound_elsewhere()  # raises on the bound loop itself: nothing changed
        # Admission stops at once, before the lock is waited for: a submit on another
        # thread fails now (WorkerClosedError) rather than after the drain.
        sched.admission.closed = True
        if loop is not None:
            self._close_on_loop(budget, loop)
            return
        # A thread driving its own run hands the lock over between two rounds; from now
        # on this thread drives every run in flight, and theirs wait for them to end.
        with driver.lock:
            deadline = started + budget
            self.state = WorkerState.CLOSED
            self._stop_pending = True
            runs = [r for r in sched.admission.runs() if not r.terminal]
            driver.drive_until(lambda: all(r.terminal for r in runs), budget / 2)
            why = _closed_why(budget, started)
            self._runs.cancel_all(why)
            self._stop_sync(deadline, why)
            driver.close_aux()

    def _close_on_loop(self, budget: float, loop: asyncio.AbstractEventLoop) -> None:
        """``close`` from another thread of a Worker bound to a running loop: the stop
        sequence runs there; when that loop ends first (``asyncio.run`` returned and
        cancelled it), it is finished here (``_finish_stop``)."""
        fut = asyncio.run_coroutine_threadsafe(self.close_async(budget), loop)
        while True:
            try:
                fut.result(0.05)
                return
            except concurrent.futures.TimeoutError:
                if loop.is_running():
                    continue
            except concurrent.futures.CancelledError:
                pass  # the loop's owner cancelled every task on its way out
            break
        self._finish_stop(budget)

    def _finish_stop(self, budget: float) -> None:
        """Stop the children of a close whose event loop ended before it did, with the
        blocking driver, once that loop let go (``Driver.fall_back``)."""
        driver = self._driver
        patience = time.monotonic() + 5.0  # asyncio.run cancels its tasks, then closes
        while not driver.fall_back():
            if time.monotonic() > patience:
                raise WorkerStateError(
                    "cannot close the worker: the event loop it is bound to stopped during "
                    "the close with its Scheduler coroutine still pending; run that loop "
                    "again (the close goes on there) or close it, then call close() again"
                )
            time.sleep(0.01)
        started = time.monotonic()
        with driver.lock:
            if not self._stop_pending:
                return  # the loop finished the close after all
            why = _closed_why(budget, started)
            self._runs.cancel_all(why)
            self._stop_sync(started + budget, why)
            driver.close_aux()

    async def close_async(self, timeout: float | None = None) -> None:
        """The stop sequence from the bound loop: drain, cancel, stop, reap, release."""
        if self.state is WorkerState.CLOSED:
            if self._stop_pending and self._driver.loop is not asyncio.get_running_loop():
                self._finish_stop(self._close_budget(timeout))  # the earlier loop ended
            return
        self._check_not_within_run()
        budget = self._close_budget(timeout)
        if self.state is not WorkerState.READY:
            if self.state is WorkerState.INITIALIZING:
                raise WorkerStateError(
                    "cannot close_async: worker is INITIALIZING (init runs on another "
                    "thread); call close() there, which cancels the init"
                )
            self.state = WorkerState.CLOSED
            self._pool.release_memory()
            self._drop_callables()
            return
        started = time.monotonic()
        deadline = started + budget
        sched = self.scheduler
        assert sched is not None
        self.state = WorkerState.CLOSED
        self._stop_pending = True
        sched.admission.closed = True
        pending = [r for r in sched.admission.runs() if not r.terminal]
        if pending and self._driver.loop is not None:
            waits = [asyncio.ensure_future(wait_run(r, None)) for r in pending]
            _, not_done = await asyncio.wait(waits, timeout=budget / 2)
            for t in not_done:
                t.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        why = _closed_why(budget, started)
        self._runs.cancel_all(why)
        await self._driver.unbind()
        self._stop_sync(deadline, why)

    def _close_budget(self, timeout: float | None) -> float:
        if timeout is None:
            return self.close_timeout
        return check_budget(timeout, "close the worker", "timeout", positive=False)

    def _check_not_within_run(self) -> None:
        runs: RunBuilder | None = getattr(self, "_runs", None)
        if self.state is WorkerState.READY and runs is not None and runs.inside_orchestration():
            raise WorkerClosedError(
                "cannot close the worker within a run: this orchestration function belongs "
                "to it, and close() would wait for the run that is calling it; close it "
                "after the run returns"
            )

    def _drop_callables(self) -> None:
        """A closed worker keeps no registered callable alive (nor its payload)."""
        self.registry.clear()
        self._pool.forget_callables()
        if self.scheduler is not None:
            self.scheduler.valid_sub = None  # it holds a registry entry (SubmitSink)

    def _stop_sync(self, deadline: float, why: str = "") -> None:
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
        self._runs.abandon_unfinished(why)
        manager.stop()
        self._driver.stop()
        self._pool.release()
        self._drop_callables()
        self._stop_pending = False
