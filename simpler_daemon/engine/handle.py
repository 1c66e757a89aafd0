"""``RunHandle``: a submitted run, used like a ``concurrent.futures.Future``.

::

    h = w.submit(orch)          the run progresses on its own (driver.py: a caller that
                                waits drives it; else the background driver thread, or
                                the bound event loop)
    h.done() / h.running() / h.cancelled()
    h.result(timeout)  -> run.task_results()   raises the run's error, TimeoutError
    h.exception(timeout) -> the run's error or None
    h.add_done_callback(fn)     fn(h) on whoever finishes the run (at once when done)
    h.trace()                   the task attempts as a Chrome trace (Worker(trace=True))
    h.cancel(terminate=False)   False when the run had finished already
    await h                     on the bound loop or any other loop: the results

A blocking wait drives the Scheduler itself (unbound Worker) or waits on the bound
loop; ``await`` only waits: the run is driven by the loop it is bound to or by the
background thread, and its end is carried to the awaiting loop thread-safely. A thread
that waits never blocks another one: a submit or cancel from another thread gets the
Scheduler between two rounds (``Driver.drive_until``). A done callback runs on the
thread that drives, inside a round: it may submit, but waiting there for a run of the
same Worker (``w.run``, ``result()``) raises ``RuntimeError`` instead of hanging.

**Cancel**, the same under ``fifo`` and ``fair`` admission: once ``cancel()`` returned,
the run is cancelled for good (its error, a ``RunCancelled`` with outcome CANCELLED,
is recorded; nothing of it starts any more; it left admission, so later runs proceed).
It is ``done()`` and ``cancelled()`` as soon as none of its tasks runs: at once when
none had started (a run waiting for admission, or whose tasks wait for a worker),
else when its running tasks end; ``cancel(terminate=True)`` ends them now (their
workers are killed and replaced). A running task holds only its own worker meanwhile.
Whether a task of a run had started when it was cancelled is what differs between
the policies (``fifo`` starts a run only at the head of admission), not cancel.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from simpler_daemon.engine.lifecycle import check_timeout
from simpler_daemon.engine.orchestrator import Run, RunState
from simpler_daemon.engine.runs import wait_run
from simpler_daemon.futures import BridgedFuture

if TYPE_CHECKING:
    from simpler_daemon.engine.worker import Worker

log = logging.getLogger("simpler_daemon.handle")


def call_when_done(run: Run, fn: Callable[[], None]) -> None:
    """Call ``fn()`` exactly once when ``run`` is terminal, from any thread.

    ``Run.add_done_callback`` belongs to the thread that drives: registered from another
    one, it can race with the run's end (the callbacks already taken). Looking at the
    state again after registering closes that gap; the lock makes the two calls one.
    """
    once = threading.Lock()

    def call(_: Run) -> None:
        if once.acquire(blocking=False):
            fn()

    run.add_done_callback(call)
    if run.terminal:
        call(run)


class RunHandle(BridgedFuture):
    """A submitted run: a future of its task results (see the module docstring), and a
    ``concurrent.futures.Future`` (``wait``, ``as_completed``, ``asyncio.wrap_future``)."""

    def __init__(self, worker: Worker, run: Run) -> None:
        self._worker = worker
        self.run = run

    def _bridge_outcome(self) -> tuple[str, BaseException | None] | None:
        run = self.run
        if not run.terminal:
            return None
        if run.cancelled:
            return ("cancelled", None)
        error = run.orch_exception if run.orch_exception is not None else run.error
        return ("result", None) if error is None else ("exception", error)

    def _bridge_subscribe(self, fn: Callable[[], None]) -> None:
        call_when_done(self.run, fn)

    @property
    def run_id(self) -> int:
        return self.run.run_id

    @property
    def state(self) -> RunState:
        return self.run.state

    # -- state ------------------------------------------------------------------------------

    def done(self) -> bool:
        """True once the run is terminal (completed, failed or cancelled)."""
        return self.run.terminal

    def running(self) -> bool:
        """True while the run is admitted (its orchestration ran or runs, its tasks
        dispatch) and not finished."""
        run = self.run
        return run.admitted and not run.terminal

    def cancelled(self) -> bool:
        """True once the run ended because it was cancelled (so ``done()`` too: a
        cancelled run with tasks still running turns terminal when they end; see the
        module docstring)."""
        run = self.run
        return run.terminal and run.cancelled

    # -- waiting ------------------------------------------------------------------------------

    def settle(self) -> bool:
        """On the Worker's bound event loop, before waiting for the run: wait for its
        tasks in this call when they are quick and the run is alone (``Scheduler.settle``:
        a one-task run then ends without a turn of the loop). True when the run is
        terminal. Anywhere else it only says whether the run is terminal."""
        run = self.run
        if run.terminal:
            return True
        loop = self._worker._driver.loop
        sched = self._worker.scheduler
        if loop is None or sched is None or asyncio._get_running_loop() is not loop:
            return False
        return sched.settle(run)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the run is terminal; raise its error.

        Raises ``TimeoutError`` when ``timeout`` expires first, ``TaskError`` when it failed;
        ``timeout`` None or ``inf`` waits forever, NaN or negative is a ``ValueError``.
        """
        self._wait(timeout, what="wait")
        self._raise()

    def result(self, timeout: float | None = None) -> list[Any]:
        """Wait for the run (as ``wait``) and return its task results: one entry per task
        slot in submission order (a single task's value or None, a group's list).

        Raises the run's error (``TaskError``, ``RunCancelled``, or the orchestration
        function's own exception) and ``TimeoutError`` when ``timeout`` expires first; on
        the Worker's own event loop, ``asyncio.InvalidStateError`` while it runs (await it).
        """
        self._wait(timeout)
        self._raise()
        return self.run.task_results()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the run (as ``wait``) and return its error, or None when it completed."""
        self._wait(timeout)
        run = self.run
        return run.orch_exception if run.orch_exception is not None else run.error

    async def wait_async(self, timeout: float | None = None) -> None:
        """``wait`` without blocking the running loop (the bound one or any other)."""
        seconds = check_timeout(timeout, f"wait for run {self.run_id}")
        loop = asyncio.get_running_loop()
        if self._worker._driver.loop is loop:
            if not self.settle():  # a one-task run ends here, without a loop turn
                await wait_run(self.run, seconds)  # callbacks fire on this loop
        else:
            await self._wait_foreign(loop, seconds)
        self._raise()

    def __await__(self) -> Generator[Any, None, list[Any]]:
        return self._result_async().__await__()

    async def _result_async(self) -> list[Any]:
        await self.wait_async()
        return self.run.task_results()

    async def _wait_foreign(self, loop: asyncio.AbstractEventLoop, timeout: float | None) -> None:
        """Await the run's end on ``loop`` while another thread (the background driver, a
        blocking caller, the bound loop) finishes it."""
        run = self.run
        if run.terminal:
            return
        fut: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        def ended() -> None:
            try:
                loop.call_soon_threadsafe(wake)
            except RuntimeError:  # the awaiting loop closed meanwhile: nobody waits
                pass

        call_when_done(run, ended)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise TimeoutError(
                f"run {run.run_id} not finished within {timeout}s (state {run.state.name})"
            ) from None

    def _wait(self, timeout: float | None, what: str = "result") -> None:
        run = self.run
        if run.terminal:
            return
        seconds = check_timeout(timeout, f"wait for run {self.run_id}")
        loop = self._worker._driver.loop
        if what == "result" and loop is not None and asyncio._get_running_loop() is loop:
            # As asyncio.Future: blocking here would stop the loop that finishes the run.
            raise asyncio.InvalidStateError(
                f"run {run.run_id} is {run.state.name}: await the handle on its event loop"
            )
        self._worker._wait_run(run, seconds)

    def _raise(self) -> None:
        run = self.run
        if run.orch_exception is not None:
            raise run.orch_exception
        run.raise_if_failed()

    def trace(self) -> dict[str, Any]:
        """The run's task stream in Chrome Trace Event format (``{"traceEvents": [...]}``:
        one ``ph: "X"`` event per task attempt, the run's queueing and execution;
        ``scheduler/trace.py`` says what the fields hold), as far as the run has got:
        ``json.dump`` it to a file and open it in Perfetto or ``chrome://tracing``.

        Raises ``ValueError`` when the Worker does not trace (``Worker(trace=True)``).
        """
        run = self.run
        if run.trace is None:
            raise ValueError(
                f"cannot trace run {run.run_id}: its Worker does not record traces "
                "(create it with Worker(..., trace=True))"
            )
        return run.trace.chrome(
            run.run_id,
            state="CANCELLED" if run.terminal and run.cancelled else run.state.name,
            worker=f"Worker level {self._worker.level} (pid {self._worker._pid})",
        )

    # -- callbacks and cancel --------------------------------------------------------------

    def add_done_callback(self, fn: Callable[[RunHandle], object]) -> None:
        """Call ``fn(handle)`` once the run is terminal: at once (on this thread) when it
        is, else on the thread that finishes it (the bound loop, the background driver,
        a waiting caller). Keep it short: the Scheduler waits for it. What it raises is
        logged, never raised into the Scheduler."""

        def call() -> None:
            try:
                fn(self)
            except Exception:
                log.exception("run %d: done callback %r raised", self.run_id, fn)

        call_when_done(self.run, call)

    def cancel(self, terminate: bool = False) -> bool:
        """Cancel the run (``Worker.cancel``); False when it had finished already.

        Unlike ``concurrent.futures.Future.cancel``, a run that has started can be
        cancelled (True), and it may still be running when this returns: ``done()`` and
        ``cancelled()`` turn True once none of its tasks runs. ``result()`` of a
        cancelled run raises ``RunCancelled``, not ``concurrent.futures.CancelledError``.

        Unstarted tasks fail at once; running ones finish, or with ``terminate=True``
        their workers are killed (and replaced) and their outcome is CANCELLED. The run
        is ``done()`` once none of its tasks runs (the module docstring says when).
        """
        if self.run.terminal:
            return False
        self._worker.cancel(self, terminate=terminate)
        return True

    def __repr__(self) -> str:
        return f"RunHandle(run_id={self.run_id}, state={self.run.state.name})"
