"""A run's life on the parent side, between the Worker facade and the Scheduler::

    Worker.submit(orch) -> RunBuilder.new_run -> Scheduler.submit_run (admission: fifo | fair)
       admitted  -> on_admit -> driver.call_soon(build) -> orch(o, args, config)
                    (an awaitable orchestration continues as a task on the bound loop)
       returned  -> Scheduler.finish_building      raised -> Scheduler.fail_building
    cancel(run)  -> Scheduler.cancel; a run never built is finished here
    close        -> cancel_all, then abandon whatever is still not terminal (RunClosedError)

Who calls the orchestration function is the driver's business (the bound loop,
or the blocking caller's thread before its next round); this module only knows
the order of the steps.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from simpler_daemon.args import DEFAULT_CONFIG, CallConfig, TaskArgs, check_priority
from simpler_daemon.endpoints.base import Outcome
from simpler_daemon.engine.orchestrator import Orchestrator, Run
from simpler_daemon.errors import RunCancelled, RunClosedError
from simpler_daemon.remote.spec import RemoteTensorRef
from simpler_daemon.scheduler.trace import RunTrace

if TYPE_CHECKING:
    from simpler_daemon.scheduler.driver import Driver
    from simpler_daemon.scheduler.sink import RunControl

#: How deep ``args`` is searched for buffers to hold (lists, tuples, dicts, TaskArgs)...
ARGS_SEARCH_DEPTH: Final = 4
#: ...and how many objects at most: a huge scalar list must not make submit slow.
ARGS_SEARCH_LIMIT: Final = 100_000


class RunBuilder:
    """Creates, builds, cancels and abandons the runs of one Scheduler (through the
    narrow ``RunControl`` interface, never its internals)."""

    def __init__(self, scheduler: RunControl, driver: Driver, *, trace: bool = False) -> None:
        self.scheduler = scheduler
        #: Every new run records its task attempts (``Worker(trace=True)``).
        self.trace = trace
        self._driver = driver
        scheduler.on_admit = self.on_admit
        driver.on_fall_back = self._build_again
        # Where an orchestration function is running now: threads (a count each, for a
        # run submitted and built from inside another) and the tasks of async ones.
        self._orch_threads: dict[int, int] = {}
        self._orch_tasks: set[asyncio.Task[None]] = set()
        #: The run ``new_run`` is queueing (None otherwise).
        self._creating: Run | None = None
        #: What an Orchestrator submits into (a property of the scheduler; read once).
        self._sink = scheduler.submit_sink

    def new_run(
        self,
        orch: Any,
        args: Any,
        config: CallConfig | None,
        priority: int = 1,
        client: object = None,
        run_id: int | None = None,
    ) -> Run:
        """Create a run and queue it for admission. Under ``fair`` admission ``priority``
        (1 to ``MAX_PRIORITY``) weighs its share of the workers and ``client`` (hashable:
        the daemon's client identity) groups the runs that share one client's part;
        ``fifo`` ignores both. ``run_id``: an id taken with ``Run.reserve_id`` (None: the
        next one)."""
        if not callable(orch):
            raise TypeError(f"cannot submit a run: orchestration function {orch!r} is not callable")
        try:
            hash(client)
        except TypeError:
            raise TypeError(
                f"cannot submit a run: client {client!r} is not hashable ({type(client).__name__})"
            ) from None
        run = Run(run_id=run_id)
        if self.trace:
            run.trace = RunTrace()
        # The default priority (a plain int 1) needs no check: this runs on every submit.
        if priority.__class__ is not int or priority != 1:
            run.priority = check_priority(priority)
        run.client = client
        run.orch = (orch, args, config or DEFAULT_CONFIG)
        run.build_started = False
        run.orch_exception = None
        # Held from now, not from admission: a buffer freed while the run waits in
        # admission must not be handed to a new allocation the run would then write.
        if args is not None:
            self._hold_args(run, args)
        # Admitted at once: the caller builds it (``on_admit`` defers no second build).
        self._creating = run
        try:
            self.scheduler.submit_run(run)
        except BaseException:
            self.scheduler.release_run_memory(run)
            raise
        finally:
            self._creating = None
        # Runs not terminal yet: the driver's background thread works while any is.
        self._driver.unfinished_runs += 1
        run.add_done_callback(self._run_ended)
        return run

    def _run_ended(self, run: Run) -> None:
        self._driver.unfinished_runs -= 1

    def _hold_args(self, run: Run, args: Any) -> None:
        """Pin every heap buffer (and remote buffer) that ``args`` references."""
        sched = self.scheduler
        heap, remote = sched.heap, sched.remote
        keys: dict[Any, None] = {}
        stack: list[tuple[Any, int]] = [(args, 0)]
        budget = ARGS_SEARCH_LIMIT
        while stack and budget > 0:
            obj, depth = stack.pop()
            budget -= 1
            if isinstance(obj, np.ndarray):
                try:
                    key = heap.describe(obj).key
                except ValueError:
                    continue  # not on this heap (or freed already): nothing to hold
                if isinstance(key, int):
                    keys[key] = None
            elif isinstance(obj, RemoteTensorRef):
                if remote is not None:
                    keys[obj.key] = None
            elif depth < ARGS_SEARCH_DEPTH:
                if isinstance(obj, TaskArgs):
                    stack.extend((t, depth + 1) for t in obj.tensors)
                elif isinstance(obj, (list, tuple)):
                    stack.extend((x, depth + 1) for x in obj)
                elif isinstance(obj, dict):
                    stack.extend((x, depth + 1) for x in obj.values())
        for key in keys:
            if isinstance(key, int):
                heap.pin(key)
            else:
                assert remote is not None
                try:
                    remote.pin(key)
                except KeyError:
                    continue  # freed and gone: the run fails when it uses it
            run.pins.append(key)

    def inside_orchestration(self) -> bool:
        """True when called from inside an orchestration function of this Worker: on the
        thread that runs a synchronous one, or in the task of an async one."""
        if self._orch_threads.get(threading.get_ident()):
            return True
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return False
        return task is not None and task in self._orch_tasks

    def on_admit(self, run: Run) -> None:
        if run.trace is not None:
            run.trace.admitted_ns = time.perf_counter_ns()
        # The orchestration function runs on whoever drives: the bound loop or the
        # blocking caller's thread before its next round; a run admitted inside its own
        # ``new_run`` is built by that caller right after.
        if run is self._creating:
            return
        self._driver.call_soon(lambda: self.build(run))

    def _build_again(self) -> None:
        """The bound loop ended before it built every admitted run: build them on
        whoever drives now (``build`` of a run already built does nothing)."""
        for run in self.scheduler.admission.runs():
            if run.admitted and not run.build_started and not run.terminal:
                self._driver.call_soon(lambda r=run: self.build(r))  # type: ignore[misc]

    def build(self, run: Run) -> None:
        if run.build_started or run.terminal or run.orch is None:
            return  # built already (submit builds an admitted run at once) or cancelled
        run.build_started = True
        orch, args, config = run.orch
        o = Orchestrator(self._sink, run)
        tid = threading.get_ident()
        self._orch_threads[tid] = self._orch_threads.get(tid, 0) + 1
        try:
            res = orch(o, args, config)
        except BaseException as exc:
            # This frame stays reachable from the exception's traceback: let go of the
            # function and its args (the run's handle keeps the exception).
            del orch, args
            self.orch_failed(run, exc)
            return
        finally:
            n = self._orch_threads[tid] - 1
            if n:
                self._orch_threads[tid] = n
            else:
                del self._orch_threads[tid]
        if res is not None and inspect.isawaitable(res):
            loop = self._driver.loop
            if loop is None:
                if inspect.iscoroutine(res):
                    res.close()
                self.orch_failed(
                    run,
                    TypeError(
                        "cannot run an async orchestration function through the blocking API; "
                        "use run_async"
                    ),
                )
                return
            task = loop.create_task(self._build_async(run, res))
            self._orch_tasks.add(task)
            task.add_done_callback(self._orch_tasks.discard)
            return
        self.scheduler.finish_building(run)

    async def _build_async(self, run: Run, aw: Awaitable[Any]) -> None:
        try:
            await aw
        except BaseException as exc:
            self.orch_failed(run, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self.scheduler.finish_building(run)

    def orch_failed(self, run: Run, exc: BaseException) -> None:
        if exc is not run.error:
            run.orch_exception = exc
        else:
            # A submit after the run failed raised the run's own error into the
            # orchestration: kept as the run's (and a daemon record's) error, its
            # traceback would hold the orchestration's frames, hence the Orchestrator
            # and the Run, for as long as the error is kept.
            exc.__traceback__ = None
        self.scheduler.fail_building(run, exc)

    def cancel_now(self, run: Run, reason: str = "") -> None:
        """Cancel ``run`` (``Worker.cancel``): its error, recorded first, is a
        ``RunCancelled`` with outcome CANCELLED and ``reason`` (``cancelled_error``)."""
        sched = self.scheduler
        if run.error is None and not run.terminal:
            run.cancelled = True
            run.error = cancelled_error(run.run_id, reason)
        sched.cancel(run)
        if not run.build_started:
            # Never admitted or not yet built: nothing will call finish_building (a build
            # still queued on the driver finds build_started and does nothing).
            run.build_started = True
            if not run.admitted:
                sched.drop_unadmitted(run)
            else:
                sched.finish_building(run)

    def cancel_all(self, why: str = "") -> None:
        """Cancel every unfinished run (the Worker is closing): its error, unless it had
        one, is a ``RunClosedError`` naming it and ``why`` (``closed_error``)."""
        for r in self.scheduler.admission.runs():
            if not r.terminal:
                r.cancelled = True  # so its error is a RunCancelled, as for handle.cancel()
                if r.error is None:
                    r.error = closed_error(r.run_id, why)
                self.cancel_now(r)

    def abandon_unfinished(self, why: str = "") -> None:
        """After the lanes stopped: finish every run that is still not terminal."""
        sched = self.scheduler
        for r in sched.admission.runs():
            if not r.terminal:
                if r.error is None:
                    r.cancelled = True
                    r.error = closed_error(r.run_id, why)
                r.building = False
                r.remaining = 0
                sched.finish_if_done(r)


async def wait_run(run: Run, timeout: float | None) -> None:
    """Await a run's end on the running loop; ``TimeoutError`` naming it when late."""
    if run.terminal:
        return
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

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


def cancelled_error(run_id: int, reason: str) -> RunCancelled:
    """The error of a run cancelled by its owner: ``run N cancelled: <reason>``, outcome
    CANCELLED (as the daemon reports it). ``Scheduler.terminate`` then names the first
    task it stopped."""
    text = f"run cancelled: {reason}" if reason else "run cancelled"
    return RunCancelled(
        f"run {run_id} cancelled" + (f": {reason}" if reason else ""),
        run_id=run_id,
        outcome=Outcome.CANCELLED.name,
        remote_text=text,
    )


def closed_error(run_id: int, why: str) -> RunClosedError:
    """The error of a run ``close()`` ended: ``run N did not finish before the worker
    closed: <why>`` (a ``WorkerClosedError`` and a ``RunCancelled``). Outcome SKIPPED and
    ``remote_text`` "run cancelled: worker closing", as before: the daemon's run records
    report such a run CANCELLED (``server/run_record.py``)."""
    text = f"run {run_id} did not finish before the worker closed" + (f": {why}" if why else "")
    return RunClosedError(
        text,
        run_id=run_id,
        outcome=Outcome.SKIPPED.name,
        remote_text="run cancelled: worker closing",
    )
