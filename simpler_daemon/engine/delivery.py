"""Delivering a registration control to every child without waiting for a busy one.

::

    deliver(targets, step)
      idle child (no task in flight, nothing queued for it)   -> step now, awaited
      busy child (a task in flight, or controls queued ahead) -> step queued on its lane,
                                                                 run when its turn comes
      no idle child at all                                    -> also await the first busy
                                                                 one to answer

While a child's lane has a control queued or in flight (``WorkerThread.deliveries``)
the Scheduler dispatches nothing to it (``idle()`` is False), so a control queued behind
a task reaches the child when that task ends and before the next dispatch. Controls of
one lane run in the order they were queued (a chain of futures per lane), so a register
queued before an unregister of the same callable reaches the child first.

The control is published at once all the same (the child answers it between tasks);
its deadline runs only while the child has no task in flight, so an idle child that
misses it is still killed and replaced (``LocalMailboxEndpoint._control_expired``).

A target with no ``lane`` is always idle (awaited): a remote worker, a replacement's
replay, and every target of a call made on a loop whose tasks stop with the call
(``ChildPool.registration_targets``, ``Driver.keeps_tasks``). The blocking API's
auxiliary loop keeps them: a control queued there after ``drive`` returned is
stepped by every Scheduler round of whoever drives (a waiting caller, the
background driver thread, which drives while such a task is left).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("simpler_daemon.registration")

#: id(lane) -> the future of the last control queued on it (removed once it ends).
_TAILS: dict[int, asyncio.Future[None]] = {}
#: Deliveries nobody awaits, kept referenced until they end.
_PENDING: set[asyncio.Task[Any]] = set()


def lane_of(target: Any) -> Any:
    """The Scheduler lane of a local target (None for a remote worker)."""
    return getattr(target, "lane", None)


def busy(target: Any) -> bool:
    """Whether a control for ``target`` would wait: a task in flight on its lane or
    controls queued ahead of it."""
    lane = lane_of(target)
    if lane is None:
        return False
    return bool(lane.inflight or lane.deliveries or id(lane) in _TAILS)


def running(target: Any, digest: bytes) -> bool:
    """Whether ``target``'s lane runs (or has staged) a task of the callable ``digest``."""
    lane = lane_of(target)
    if lane is None:
        return False
    return any(d is not None and d.task_slot.digest == digest for d in (lane.active, lane.staged))


def on_lane(target: Any, step: Callable[[Any], Awaitable[object]]) -> asyncio.Task[Any]:
    """Queue ``step(target)`` on ``target``'s lane (behind what is queued there) and
    hold the lane from dispatch until it ended; returns its task."""
    loop = asyncio.get_running_loop()
    lane = lane_of(target)
    if lane is None:
        task = loop.create_task(_run(step, target))
        _keep(task)
        return task
    key = id(lane)
    before = _TAILS.get(key)
    mine: asyncio.Future[None] = loop.create_future()
    _TAILS[key] = mine
    lane.deliveries += 1

    async def queued() -> object:
        try:
            if before is not None:
                await asyncio.wait([before])
            return await step(target)
        finally:
            lane.deliveries -= 1
            mine.set_result(None)
            if _TAILS.get(key) is mine:
                del _TAILS[key]
            wake = getattr(target, "wake", None)
            if wake is not None and not lane.deliveries:
                wake()

    task = loop.create_task(queued())
    _keep(task)
    return task


async def _run(step: Callable[[Any], Awaitable[object]], target: Any) -> object:
    return await step(target)


def _keep(task: asyncio.Task[Any]) -> None:
    _PENDING.add(task)
    task.add_done_callback(_ended)


def _ended(task: asyncio.Task[Any]) -> None:
    _PENDING.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: whoever cares looked at it (``deliver``, ``then``)


@dataclass(slots=True)
class Delivery:
    """What ``deliver`` reached by the time it returned."""

    #: Targets that completed the step.
    done: list[Any] = field(default_factory=list)
    #: worker id -> why the step failed there.
    failures: dict[int, str] = field(default_factory=dict)
    #: (target, task) of the steps still queued behind busy children.
    later: list[tuple[Any, asyncio.Task[Any]]] = field(default_factory=list)


async def deliver(
    targets: Sequence[Any],
    step: Callable[[Any], Awaitable[object]],
    errors: tuple[type[Exception], ...],
    *,
    awaited: Callable[[Any], bool] = lambda t: False,
    first: bool = True,
) -> Delivery:
    """Run ``step`` on every target: idle ones now, busy ones when their turn comes.

    Waits for the idle ones, for the busy ones ``awaited`` names, and (``first``) when
    no target is idle for the first busy one to answer. A step raising one of ``errors``
    is a failure (``Delivery.failures``); anything else propagates once the awaited
    steps ended.
    """
    out = Delivery()
    wait: list[tuple[Any, asyncio.Task[Any]]] = []
    for target in targets:
        queued = busy(target)
        task = on_lane(target, step)
        if queued and not awaited(target):
            out.later.append((target, task))
        else:
            wait.append((target, task))
    if not wait and out.later and first:
        await asyncio.wait([t for _, t in out.later], return_when=asyncio.FIRST_COMPLETED)
        wait = [(tg, t) for tg, t in out.later if t.done()]
        out.later = [(tg, t) for tg, t in out.later if not t.done()]
    if wait:
        await asyncio.wait([t for _, t in wait])
    unexpected: BaseException | None = None
    for target, task in wait:
        exc = task.exception() if not task.cancelled() else asyncio.CancelledError()
        if exc is None:
            out.done.append(target)
        elif isinstance(exc, errors):
            out.failures[target.worker_id] = str(exc) or type(exc).__name__
        elif unexpected is None:
            unexpected = exc
    if unexpected is not None:
        raise unexpected
    return out


def then(task: asyncio.Task[Any], callback: Callable[[BaseException | None], None]) -> None:
    """Call ``callback(exception or None)`` once the queued ``task`` ended."""

    def ended(t: asyncio.Task[Any]) -> None:
        if t.cancelled():
            return
        exc = t.exception()
        try:
            callback(exc)
        except Exception:  # a bookkeeping bug must not vanish in a callback
            log.exception("a queued registration control's follow-up failed")

    task.add_done_callback(ended)
