"""``remote_worker.tasks.resume``: the rest of a coroutine whose first step the session
runner ran inline (it submits a TASK's inner run from the read callback that brought
the frame, stepping ``TaskRunner.submit`` once). A submission that does wait must still
end as it would have as an asyncio Task: with its result, the exception of what it
awaited, or a cancellation delivered where it waits."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from simpler_daemon.remote_worker.tasks import resume

pytestmark = pytest.mark.timeout(30)


def _first_step(coro: Coroutine[Any, Any, Any]) -> Any:
    """What the session does: one ``send(None)``; the value it yielded when it waits."""
    try:
        return coro.send(None)
    except StopIteration:
        pytest.fail("the coroutine finished in its first step; this test needs one that waits")


def test_resume_finishes_a_coroutine_waiting_on_a_future_and_a_bare_yield() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        steps: list[str] = []

        async def submit() -> int:
            steps.append("first")
            value = await fut
            steps.append("after future")
            await asyncio.sleep(0)  # a bare yield
            steps.append("after bare yield")
            return value * 2

        coro = submit()
        yielded = _first_step(coro)
        assert yielded is fut and steps == ["first"]
        task = loop.create_task(resume(coro, yielded))
        await asyncio.sleep(0)
        assert not task.done()  # still waiting for the future
        fut.set_result(21)
        assert await asyncio.wait_for(task, 10) == 42
        assert steps == ["first", "after future", "after bare yield"]

    asyncio.run(main())


def test_resume_raises_the_awaited_futures_exception_inside_the_coroutine() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        seen: list[BaseException] = []

        async def submit() -> int:
            try:
                return await fut
            except ValueError as exc:
                seen.append(exc)
                raise RuntimeError("submission failed") from exc

        coro = submit()
        task = loop.create_task(resume(coro, _first_step(coro)))
        fut.set_exception(ValueError("no such callable"))
        with pytest.raises(RuntimeError, match="submission failed"):
            await asyncio.wait_for(task, 10)
        assert [str(e) for e in seen] == ["no such callable"]

    asyncio.run(main())


def test_cancelling_resume_cancels_the_coroutine_where_it_waits() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        cleaned: list[str] = []

        async def submit() -> int:
            try:
                return await fut
            finally:
                cleaned.append("finally ran")

        coro = submit()
        task = loop.create_task(resume(coro, _first_step(coro)))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cleaned == ["finally ran"]
        assert fut.cancelled()  # what it waited for is cancelled, as a Task would do

    asyncio.run(main())
