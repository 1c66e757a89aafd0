"""A run's life on the parent side, between the Worker facade and the Scheduler::

    Worker.submit(orch) -> RunBuilder.new_run -> Scheduler.submit_run (admission FIFO)
       admitted  -> on_admit -> driver.call_soon(build) -> orch(o, args, config)
                    (an awaitable orchestration continues as a task on the bound loop)
       returned  -> Scheduler.finish_building      raised -> Scheduler.fail_building
    cancel(run)  -> Scheduler.cancel; a run never built is finished here
    close        -> cancel_all, then abandon whatever is still not terminal

Who calls the orchestration function is the driver's business (the bound loop,
or the blocking caller's thread before its next round); this module only knows
the order of the steps.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from simpler_daemon.args import DEFAULT_CONFIG, CallConfig
from simpler_daemon.endpoints.base import Outcome
from simpler_daemon.orchestrator import FailureInfo, Orchestrator, Run, RunState

if TYPE_CHECKING:
    from simpler_daemon.driver import Driver
    from simpler_daemon.scheduler import Scheduler


class RunBuilder:
    """Creates, builds, cancels and abandons the runs of one Scheduler."""

    def __init__(self, scheduler: Scheduler, driver: Driver) -> None:
        self.scheduler = scheduler
        self._driver = driver
        scheduler.on_admit = self.on_admit

    def new_run(self, orch: Any, args: Any, config: CallConfig | None) -> Run:
        if not callable(orch):
            raise TypeError(f"cannot submit a run: orchestration function {orch!r} is not callable")
        run = Run()
        run.orch = (orch, args, config or DEFAULT_CONFIG)  # type: ignore[attr-defined]
        run.build_started = False  # type: ignore[attr-defined]
        run.orch_exception = None  # type: ignore[attr-defined]
        self.scheduler.submit_run(run)
        return run

    def on_admit(self, run: Run) -> None:
        # The orchestration function runs on whoever drives: the bound loop or the
        # blocking caller's thread before its next round.
        self._driver.call_soon(lambda: self.build(run))

    def build(self, run: Run) -> None:
        if run.build_started or run.terminal:  # type: ignore[attr-defined]
            return  # built already (submit builds an admitted run at once) or cancelled
        run.build_started = True  # type: ignore[attr-defined]
        orch, args, config = run.orch  # type: ignore[attr-defined]
        o = Orchestrator(self.scheduler, run)
        try:
            res = orch(o, args, config)
        except BaseException as exc:
            self.orch_failed(run, exc)
            return
        if inspect.isawaitable(res):
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
            loop.create_task(self._build_async(run, res))
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
            run.orch_exception = exc  # type: ignore[attr-defined]
        self.scheduler.fail_building(run, exc)

    def cancel_now(self, run: Run) -> None:
        sched = self.scheduler
        sched.cancel(run)
        if not getattr(run, "build_started", True):
            # Never admitted or not yet built: nothing will call finish_building (a build
            # still queued on the driver finds build_started and does nothing).
            run.build_started = True  # type: ignore[attr-defined]
            if not run.admitted:
                sched.admission.release(run)
                run.building = False
                run.state = RunState.FAILED
                run.fire_done()
            else:
                sched.finish_building(run)

    def cancel_all(self) -> None:
        """Cancel every unfinished run (the Worker is closing)."""
        for r in self.scheduler.admission.runs():
            if not r.terminal:
                r.cancelled = True  # so its error is a RunCancelled, as for handle.cancel()
                r.record_error(None, closing_failure())
                self.cancel_now(r)

    def abandon_unfinished(self) -> None:
        """After the lanes stopped: finish every run that is still not terminal."""
        sched = self.scheduler
        for r in sched.admission.runs():
            if not r.terminal:
                r.record_error(None, closing_failure())
                r.building = False
                r.remaining = 0
                sched._maybe_finish_run(r)


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


def closing_failure() -> FailureInfo:
    return FailureInfo(Outcome.SKIPPED, "run cancelled: worker closing")
