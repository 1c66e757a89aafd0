"""Run a client's orchestration function off the daemon's event loop.

A ``RunOrchestration`` function is arbitrary Python: one that computes or sleeps
for 2 s on the loop stalls every client and the Scheduler for 2 s. It runs on a
worker thread instead, and every call it makes on its Orchestrator is carried
back to the loop (the engine is single-threaded by design)::

    loop:   orch(o, a, c) --await a daemon thread--> fn(LoopOrchestrator(o), a, c)
                 ^                                       | o.submit_sub(...)
                 +---- call_soon_threadsafe(call) <------+  (waits for the result)

A coroutine function, or a plain function that returns an awaitable, is awaited
on the loop as before (it yields on its own).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["LoopOrchestrator", "run_off_loop"]


class LoopOrchestrator:
    """An Orchestrator for a function on another thread: each method call runs on the
    loop and returns (or raises) there; plain attributes are read directly. A context
    manager returned by a call (``o.scope()``) is wrapped the same way."""

    __slots__ = ("_loop", "_loop_thread", "_target")

    def __init__(self, target: Any, loop: asyncio.AbstractEventLoop, loop_thread: int) -> None:
        self._target = target
        self._loop = loop
        self._loop_thread = loop_thread

    def _on_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == self._loop_thread:
            return fn(*args, **kwargs)  # awaited on the loop: blocking here would deadlock
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def call() -> None:
            if not done.set_running_or_notify_cancel():
                return
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # carried to the caller's thread
                done.set_exception(exc)

        self._loop.call_soon_threadsafe(call)
        result = done.result()
        if hasattr(result, "__enter__") and hasattr(result, "__exit__"):
            return LoopOrchestrator(result, self._loop, self._loop_thread)
        return result

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value):
            return value

        def method(*args: Any, **kwargs: Any) -> Any:
            return self._on_loop(value, *args, **kwargs)

        method.__name__ = name
        return method

    def __enter__(self) -> Any:
        return self._on_loop(self._target.__enter__)

    def __exit__(self, *exc: object) -> Any:
        return self._on_loop(self._target.__exit__, *exc)

    def __repr__(self) -> str:
        return f"LoopOrchestrator({self._target!r})"


async def run_off_loop(fn: Callable[..., Any], o: Any, args: Any, config: Any) -> Any:
    """``fn(o, args, config)`` on a worker thread with ``o`` wrapped in a
    :class:`LoopOrchestrator`; a coroutine function runs on the loop itself."""
    if inspect.iscoroutinefunction(fn):
        return await fn(o, args, config)
    loop = asyncio.get_running_loop()
    proxy = LoopOrchestrator(o, loop, threading.get_ident())
    done: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not done.done():
            if ok:
                done.set_result(value)
            else:
                done.set_exception(value)

    def call() -> None:
        try:
            outcome: tuple[bool, Any] = (True, fn(proxy, args, config))
        except BaseException as exc:  # carried to the loop
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass  # the loop is closed: the daemon has stopped, nobody awaits this run

    # A daemon thread, not the loop's default executor: a function that never returns
    # must not hold the daemon's exit (asyncio.run waits for its executor's threads).
    threading.Thread(
        target=call, name=f"orchestration {getattr(fn, '__name__', fn)!s:.40}", daemon=True
    ).start()
    result = await done
    if inspect.isawaitable(result):
        return await result
    return result
