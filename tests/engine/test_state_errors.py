"""Errors by who is at fault: a call the Worker's state does not allow raises
``WorkerStateError`` (a ``RuntimeError`` and a ``SimplerError``, as the origin raises
``RuntimeError`` for a call in the wrong state) naming the state; a bad argument stays a
``ValueError`` / ``TypeError``. ``WorkerClosedError`` is the state error of a closed
Worker, so one ``except WorkerStateError`` covers both."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from simpler_daemon import (
    RemoteWorkerSpec,
    SimplerError,
    Worker,
    WorkerClosedError,
    WorkerStateError,
)
from simpler_daemon.errors import StartupError
from tests.support import sub_tasks as tasks

pytestmark = pytest.mark.timeout(60)


def state_error(call: Callable[[], Any], *words: str) -> WorkerStateError:
    """``call()`` raises a ``WorkerStateError`` whose message holds every one of ``words``."""
    with pytest.raises(WorkerStateError) as info:
        call()
    err = info.value
    assert isinstance(err, RuntimeError) and isinstance(err, SimplerError)
    assert not isinstance(err, (ValueError, TypeError)), type(err).__mro__
    for word in words:
        assert word in str(err), str(err)
    return err


def noop_orch(o: Any, args: Any, config: Any) -> None:
    return None


def test_the_class_is_public_and_a_runtime_error() -> None:
    assert issubclass(WorkerStateError, RuntimeError)
    assert issubclass(WorkerStateError, SimplerError)
    assert issubclass(WorkerClosedError, WorkerStateError)
    assert not issubclass(WorkerStateError, ValueError)
    assert not issubclass(StartupError, WorkerStateError)


def test_calls_before_init_name_the_state_new() -> None:
    w = Worker(num_sub_workers=1)
    try:
        for call in (
            lambda: w.submit(noop_orch),
            lambda: w.run(noop_orch),
            lambda: w.ping(0),
            lambda: w.register("tests.support.sub_tasks:noop", reload=True),
        ):
            err = state_error(call, "worker is NEW", "call init() first")
            assert not isinstance(err, WorkerClosedError)
    finally:
        w.close()


@pytest.mark.asyncio
async def test_async_calls_before_init_name_the_state_new() -> None:
    w = Worker(num_sub_workers=1)
    try:
        with pytest.raises(WorkerStateError, match=r"worker is NEW \(call init\(\) first\)"):
            await w.submit_async(noop_orch)
        with pytest.raises(WorkerStateError, match="worker is NEW"):
            await w.start_async()
    finally:
        w.close()


def test_init_twice_and_after_close_name_the_state() -> None:
    w = Worker(num_sub_workers=1)
    w.register(tasks.noop)
    w.init()
    try:
        err = state_error(w.init, "cannot init", "worker is READY")
        assert not isinstance(err, (WorkerClosedError, StartupError))
    finally:
        w.close()
    err = state_error(w.init, "cannot init", "worker is CLOSED")
    assert isinstance(err, WorkerClosedError)
    state_error(lambda: w.submit(noop_orch), "worker is CLOSED")


def test_add_worker_in_the_wrong_state() -> None:
    l4 = Worker(level=4, heap_bytes=1 << 20)
    l3 = Worker(num_sub_workers=1, heap_bytes=1 << 20)
    other = Worker(level=4, heap_bytes=1 << 20)
    closed = Worker(num_sub_workers=1, heap_bytes=1 << 20)
    closed.close()
    try:
        # On a level-3 Worker: it holds no L3 workers.
        state_error(
            lambda: Worker(num_sub_workers=0).add_worker(Worker(num_sub_workers=1)),
            "only a level-4 Worker holds L3 workers",
            "level 3",
        )
        state_error(
            lambda: l3.add_remote_worker(RemoteWorkerSpec(endpoint="127.0.0.1:1")),
            "only a level-4 Worker",
            "level 3",
        )
        # A child that is not NEW, or already attached to another level-4 Worker.
        state_error(lambda: l4.add_worker(closed), "must be a NEW worker", "CLOSED")
        l4.add_worker(l3)
        state_error(lambda: other.add_worker(l3), "not attached elsewhere", "L3 worker 0")
        # The attached child itself: every call goes through its parent.
        state_error(lambda: l3.register(tasks.noop), "L3 worker 0 of a level-4 Worker")
        state_error(l3.init, "L3 worker 0 of a level-4 Worker")
    finally:
        for w in (other, l4):
            w.close()


def test_add_worker_after_init_names_the_state() -> None:
    l4 = Worker(level=4, num_sub_workers=1, heap_bytes=1 << 20)
    l4.register(tasks.noop)
    l4.init()
    try:
        state_error(lambda: l4.add_worker(Worker(num_sub_workers=1)), "only before init()", "READY")
    finally:
        l4.close()
    state_error(lambda: l4.add_worker(Worker(num_sub_workers=1)), "CLOSED")


def test_bad_arguments_stay_value_and_type_errors() -> None:
    l4 = Worker(level=4, heap_bytes=1 << 20)
    try:
        with pytest.raises(TypeError, match="expected a Worker"):
            l4.add_worker("l3")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="its own child"):
            l4.add_worker(l4)
        with pytest.raises(ValueError, match="its level is 4"):
            l4.add_worker(Worker(level=4, heap_bytes=1 << 20))
        with pytest.raises(TypeError, match="expected a RemoteWorkerSpec"):
            l4.add_remote_worker("127.0.0.1:1")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="level=5"):
            Worker(level=5)
    finally:
        l4.close()
    w = Worker(num_sub_workers=1)
    w.register(tasks.noop)
    w.init()
    try:
        with pytest.raises(TypeError, match="not callable"):
            w.submit(42)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timeout"):
            w.ping(0, timeout=-1)
        with pytest.raises(TypeError, match="CallableHandle"):
            w.unregister("noop")  # type: ignore[arg-type]
    finally:
        w.close()


def test_a_second_live_event_loop_is_a_state_error() -> None:
    w = Worker(num_sub_workers=1, heap_bytes=1 << 20)
    w.register(tasks.noop)
    w.init()
    loop = asyncio.new_event_loop()
    looper = threading.Thread(target=loop.run_forever, name="test-loop")
    looper.start()
    try:
        asyncio.run_coroutine_threadsafe(w.run_async(noop_orch), loop).result(30)

        async def from_another_loop() -> None:
            await w.submit_async(noop_orch)

        state_error(lambda: asyncio.run(from_another_loop()), "another event loop")
        w.close()  # on the bound loop, while it runs
    finally:
        loop.call_soon_threadsafe(loop.stop)
        looper.join(30)
        loop.close()
        w.close()
