"""The orchestration function of a SubmitRun: its validated plan submitted in order.

The Planner (plan.py) turns a request's tasks into a list of :class:`Planned`;
``declarative`` makes the function the engine runs as the run's orchestration.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Final

from simpler_daemon.engine.orchestrator import Run
from simpler_daemon.errors import SimplerError
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server.plan import SLICE_EVERY, Planned, Slicer

__all__ = ["SYNC_PLAN_TASKS", "declarative"]

#: A SubmitRun of at most this many tasks is submitted inside its call, without a
#: slice: well under plan.SLICE_S of plain submits.
SYNC_PLAN_TASKS: Final = 64


def declarative(
    plan: list[Planned], bind: Callable[[Run], None]
) -> Callable[..., Coroutine[Any, Any, None] | None]:
    """The orchestration function of a SubmitRun: submit the validated plan in order.

    ``bind`` is called with the engine's Run before the first task is submitted. A
    plan of at most ``SYNC_PLAN_TASKS`` tasks is submitted by a plain function, inside
    the submit itself: its first task is dispatched before the handler returns, so the
    child runs while the daemon finishes the call's bookkeeping (a coroutine function
    would start on a later turn of the loop, after everything else queued there). A
    bigger plan is a coroutine function yielding every ``SLICE_S``, so that building
    it does not stall the event loop; tasks submitted so far are dispatched meanwhile.
    """
    if len(plan) <= SYNC_PLAN_TASKS:

        def orch_now(o: Any, _args: Any, _config: Any) -> None:
            bind(o.run)
            try:
                for p in plan:
                    _submit_planned(o, p)
            except SimplerError:
                if o.run.error is None:  # else: the run already failed, as below
                    raise
            finally:
                plan.clear()

        return orch_now

    async def orch(o: Any, _args: Any, _config: Any) -> None:
        bind(o.run)
        o.run.bulk_submits = True  # the Scheduler may dispatch them two at a time
        slicer = Slicer()
        try:
            for i, p in enumerate(plan):
                if not i & SLICE_EVERY and slicer.due():
                    await slicer.pause()
                _submit_planned(o, p)
        except SimplerError:
            # The run already failed (a task failed while later ones were being
            # submitted) or the daemon is closing: the run carries that error.
            if o.run.error is None:
                raise
        finally:
            plan.clear()  # drop the heap views: the slots hold descriptors now

    return orch


def _submit_planned(o: Any, p: Planned) -> None:
    """Submit one planned task through the run's Orchestrator ``o``."""
    kind = p.kind
    if kind == pb.TASK_KIND_SUB:
        o.submit_sub(p.handle, p.members[0], p.config)
    elif kind == pb.TASK_KIND_SUB_GROUP:
        o.submit_sub_group(p.handle, p.members, p.config)
    elif kind == pb.TASK_KIND_NEXT_LEVEL:
        o.submit_next_level(p.handle, p.members[0], p.config, worker=p.targets[0])
    else:
        o.submit_next_level_group(p.handle, p.members, p.config, workers=p.targets)
