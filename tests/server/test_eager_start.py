"""``server.eager.start_eagerly``: a fast-path handler starts in the turn that read its
frame, and a task takes over only when it waits.

Each test checks one promise of a task that the eager start must keep: the work done
before the first wait happens at once; what follows a wait runs in a task that is the
current task, can be cancelled where it waits, sees the context the first step set;
an error of the first step reaches the caller. Order is shown by marks, never by time.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Any

import pytest

from simpler_daemon.server.eager import start_eagerly

pytestmark = [pytest.mark.timeout(30), pytest.mark.asyncio]

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


async def turns_until(predicate: Callable[[], bool], turns: int = 100) -> None:
    """Let the loop turn until ``predicate()`` holds (a few turns suffice; no clock)."""
    for _ in range(turns):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not reached within {turns} turns of the loop")


async def test_a_coroutine_that_never_waits_runs_to_its_end_in_the_call() -> None:
    marks: list[str] = []

    async def handler() -> None:
        marks.append("ran")

    assert start_eagerly(asyncio.get_running_loop(), handler()) is None
    assert marks == ["ran"]


async def test_after_a_wait_a_task_runs_the_rest_and_is_the_current_task() -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[str] = loop.create_future()
    marks: list[Any] = []

    async def handler() -> None:
        marks.append(("before", asyncio.current_task()))
        marks.append(("got", await gate))
        marks.append(("after", asyncio.current_task()))
        async with asyncio.timeout(10):  # needs a current task
            await asyncio.sleep(0)
        marks.append("end")

    started: asyncio.Future[asyncio.Task[None] | None] = loop.create_future()
    # From a plain callback, as the fast path's protocol calls it: no current task there.
    loop.call_soon(lambda: started.set_result(start_eagerly(loop, handler())))
    task = await started
    assert task is not None
    assert marks == [("before", None)]  # the first step ran in that call, without a task
    gate.set_result("value")
    await task
    assert marks[1:] == [("got", "value"), ("after", task), "end"]


async def test_a_bare_yield_to_the_loop_is_resumed_by_the_task() -> None:
    marks: list[int] = []

    async def handler() -> None:
        for i in range(3):
            marks.append(i)
            await asyncio.sleep(0)

    task = start_eagerly(asyncio.get_running_loop(), handler())
    assert task is not None and marks == [0]
    await task
    assert marks == [0, 1, 2]


async def test_cancelling_the_task_raises_where_the_coroutine_waits() -> None:
    loop = asyncio.get_running_loop()
    never: asyncio.Future[None] = loop.create_future()
    marks: list[str] = []

    async def handler() -> None:
        try:
            await never
        except asyncio.CancelledError:
            marks.append("cancelled at the wait")
            raise
        finally:
            marks.append("cleaned up")

    task = start_eagerly(loop, handler())
    assert task is not None
    await asyncio.sleep(0)  # the task has taken over the wait
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert marks == ["cancelled at the wait", "cleaned up"]
    assert never.cancelled()  # as a task's own wait would be


async def test_a_cancellation_before_the_tasks_first_step_still_reaches_the_wait() -> None:
    """The fast path cancels a call's task on a Cancel frame, a disconnect or its
    deadline: that may come in the very turn the handler first waited."""
    loop = asyncio.get_running_loop()
    never: asyncio.Future[None] = loop.create_future()
    cleanup: asyncio.Future[None] = loop.create_future()
    marks: list[str] = []

    async def handler() -> None:
        try:
            await never
        except asyncio.CancelledError:
            marks.append("cancelled at the wait")
            await cleanup  # waits again: another task takes over
            marks.append("cleaned up")
            raise

    tasks: list[asyncio.Task[None] | None] = []

    def protocol_callback() -> None:
        task = start_eagerly(loop, handler())
        assert task is not None
        task.cancel()  # before the task's first step
        tasks.append(task)

    loop.call_soon(protocol_callback)
    await turns_until(lambda: bool(marks))
    assert marks == ["cancelled at the wait"] and never.cancelled()
    cleanup.set_result(None)
    await turns_until(lambda: len(marks) == 2)
    assert marks == ["cancelled at the wait", "cleaned up"]
    assert tasks[0] is not None and tasks[0].cancelled()


async def test_a_coroutine_can_catch_the_cancellation_and_return() -> None:
    loop = asyncio.get_running_loop()
    never: asyncio.Future[None] = loop.create_future()

    async def handler() -> None:
        try:
            await never
        except asyncio.CancelledError:
            return

    task = start_eagerly(loop, handler())
    assert task is not None
    await asyncio.sleep(0)
    task.cancel()
    await task  # no CancelledError: the coroutine swallowed it
    assert task.done() and not task.cancelled()


async def test_an_error_of_the_first_step_reaches_the_caller() -> None:
    async def handler() -> None:
        raise LookupError("no such run")

    with pytest.raises(LookupError, match="no such run"):
        start_eagerly(asyncio.get_running_loop(), handler())


async def test_an_error_after_the_wait_is_the_tasks() -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()

    async def handler() -> None:
        await gate
        raise LookupError("late")

    task = start_eagerly(loop, handler())
    assert task is not None
    gate.set_result(None)
    with pytest.raises(LookupError, match="late"):
        await task


async def test_the_first_steps_context_is_its_own_and_carries_into_the_task() -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()
    seen: list[str] = []

    async def handler() -> None:
        VAR.set("handler")
        await gate
        seen.append(VAR.get())

    task = start_eagerly(loop, handler())
    assert VAR.get() == "unset"  # the caller's context is untouched, as with a task
    assert task is not None
    gate.set_result(None)
    await task
    assert seen == ["handler"]
