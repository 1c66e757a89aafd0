"""Start a coroutine at once, in the caller's turn: a task only if it has to wait.

A fast-path call's handler usually finishes without waiting for anything: a one-task
``SubmitRun`` plans, launches and hands back a deferred answer in one go. Wrapping it
in a task costs a task object, a ``call_soon`` and one more event-loop turn before it
even starts (Python 3.12's ``eager_task_factory`` exists for this; the daemon runs on
3.11). :func:`start_eagerly` runs the coroutine's first step now, in a copy of the
current context as a task would, and only when that step suspends (it awaits a future
that is not done yet, or yields to the loop) does a task take over the rest.

The task drives the same coroutine through :func:`_resume`, which hands the future the
first step stopped on to the task exactly as the coroutine would have (so the task
waits for it, and a cancellation is thrown into the coroutine where it waits, even one
that comes before the task's first step). From
then on the coroutine runs as any task's: ``asyncio.current_task()`` is that task and
``asyncio.timeout`` works. Code that runs before the first suspension sees the caller's
current task: none in a protocol callback, where the fast path calls this (its run
handlers never ask for one before they wait).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import types
from collections.abc import Coroutine, Generator
from typing import Any

__all__ = ["start_eagerly"]


def start_eagerly(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]
) -> asyncio.Task[None] | None:
    """Run ``coro`` until it first suspends; None when it finished within that step,
    else the task that runs the rest. An exception the step raises (other than the
    coroutine returning) propagates to the caller, as it would from a task's step to
    the loop; the coroutine is closed then."""
    context = contextvars.copy_context()
    try:
        yielded = context.run(coro.send, None)
    except StopIteration:
        return None
    return _hand_over(loop, coro, yielded, context)


def _hand_over(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, None],
    yielded: Any,
    context: contextvars.Context,
) -> asyncio.Task[None]:
    task = loop.create_task(_rest(coro, yielded), context=context)
    task.add_done_callback(functools.partial(_cancelled_unstarted, loop, coro, yielded, context))
    return task


def _cancelled_unstarted(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, None],
    yielded: Any,
    context: contextvars.Context,
    task: asyncio.Task[None],
) -> None:
    """A task cancelled before its first step never resumed ``coro`` (a cancellation
    thrown into a coroutine that has not started runs none of it): do what its step
    would have done. The future ``coro`` waits on is cancelled and the cancellation is
    raised where ``coro`` waits; if it waits again, another task takes over."""
    if not task.cancelled() or inspect.getcoroutinestate(coro) != inspect.CORO_SUSPENDED:
        return  # the task ran ``coro`` to its end
    if isinstance(yielded, asyncio.Future):
        yielded.cancel()
    try:
        again = context.run(coro.throw, asyncio.CancelledError())
    except (StopIteration, asyncio.CancelledError):
        return
    except Exception as exc:  # nobody awaits the task: say so, as a task's loop would
        loop.call_exception_handler(
            {"message": "a coroutine failed after its cancellation", "exception": exc}
        )
        return
    _hand_over(loop, coro, again, context)


async def _rest(coro: Coroutine[Any, Any, None], yielded: Any) -> None:
    await _resume(coro, yielded)


@types.coroutine
def _resume(coro: Coroutine[Any, Any, None], yielded: Any) -> Generator[Any, Any, None]:
    """Go on with ``coro``, which suspended on ``yielded``: pass that up to the task that
    drives this generator, then what the task sends (or throws) down, until it returns."""
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # a cancellation where the coroutine waits
            try:
                yielded = coro.throw(exc)
            except StopIteration:
                return
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration:
                return
