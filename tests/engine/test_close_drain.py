"""``close(timeout)`` while runs are in flight on other threads or on the bound loop: it
stops admission at once, lets those runs finish within the timeout, then fails what is
left with a ``RunClosedError`` (a ``WorkerClosedError`` and a ``RunCancelled``) naming
the run. The origin drains the in-flight run first as well; nothing ever sees the
torn-down heap (a raw ``ValueError: mmap closed or invalid``).

A "long run" is one ``wait_flag`` task: it records its pid, then waits for a heap flag
the test sets (or never sets)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from simpler_daemon import RunCancelled, Tag, Worker, WorkerClosedError, WorkerStateError
from simpler_daemon.errors import RunClosedError
from simpler_daemon.testing import child_pids, poll_for
from tests.support import sub_tasks
from tests.support.sub_tasks import targs

pytestmark = pytest.mark.timeout(90)


class Held:
    """A started Worker of two SUB children and a run whose one task waits for ``flag``."""

    def __init__(self, wait_ms: int = 60_000) -> None:
        self.w = Worker(num_sub_workers=2, heap_bytes=1 << 20)
        self.h = self.w.register(sub_tasks.wait_flag)
        self.noop = self.w.register(sub_tasks.noop)
        self.w.init()
        self.flags = self.w.alloc((1,), "int64")
        self.started = self.w.alloc((1,), "int64")
        self.wait_ms = wait_ms

    def orch(self, o: Any, args: Any, config: Any) -> None:
        o.submit_sub(
            self.h,
            targs(
                (self.flags, Tag.NO_DEP), (self.started, Tag.NO_DEP), scalars=(0, 0, self.wait_ms)
            ),
        )

    def noop_orch(self, o: Any, args: Any, config: Any) -> None:
        o.submit_sub(self.noop, targs())

    def on_thread(self, fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
        """Run ``fn`` on a new thread; the dict gets ``result`` or ``error``."""
        out: dict[str, Any] = {}

        def go() -> None:
            try:
                out["result"] = fn()
            except BaseException as exc:
                out["error"] = exc

        t = threading.Thread(target=go, name="test-caller")
        t.start()
        return t, out

    def closing(self) -> bool:
        assert self.w.scheduler is not None
        return self.w.scheduler.admission.closed


def test_close_lets_a_run_on_another_thread_finish_and_refuses_new_ones_at_once() -> None:
    held = Held()
    w = held.w
    runner, ran = held.on_thread(lambda: w.run(held.orch))
    poll_for(lambda: held.started[0] != 0, timeout=30, message="the task never started")
    closer, closed = held.on_thread(lambda: w.close(60.0))
    poll_for(held.closing, timeout=30, message="close() never stopped admission")
    try:
        # The run is still held (nobody set the flag): a submit now must not wait for
        # the drain, whether the close has taken the driver's lock yet or not.
        with pytest.raises(WorkerClosedError, match="closing"):
            w.submit(held.noop_orch)
        with pytest.raises(WorkerStateError):
            w.run(held.noop_orch)
        assert runner.is_alive() and closer.is_alive()
    finally:
        held.flags[0] = 1  # the run may finish now, within close's timeout (also on failure)
    runner.join(60)
    closer.join(60)
    assert ran == {"result": None}, ran
    assert closed == {"result": None}, closed
    assert not child_pids()


def test_a_run_past_the_timeout_fails_with_worker_closed_error_naming_it() -> None:
    held = Held()
    w = held.w
    handle = w.submit(held.orch)
    waiter, waited = held.on_thread(lambda: handle.result())
    runner, ran = held.on_thread(lambda: w.run(held.orch))
    poll_for(lambda: held.started[0] != 0, timeout=30, message="the task never started")
    sched = w.scheduler
    assert sched is not None
    poll_for(lambda: len(sched.admission.runs()) == 2, timeout=30, message="run() not submitted")
    w.close(1.0)  # the flag is never set: both runs outlive the timeout
    waiter.join(60)
    runner.join(60)
    assert not child_pids()
    errors = [waited.get("error"), ran.get("error")]
    ids = [handle.run_id, None]
    for err, run_id in zip(errors, ids, strict=True):
        assert isinstance(err, RunClosedError), repr(err)
        assert isinstance(err, WorkerClosedError) and isinstance(err, RunCancelled)
        assert "did not finish before the worker closed" in str(err)
        assert "close(timeout=1)" in str(err)
        if run_id is not None:
            assert f"run {run_id} " in str(err)
            assert err.run_id == run_id
    assert handle.done() and handle.cancelled()
    assert isinstance(handle.exception(), WorkerClosedError)


def test_close_from_another_thread_drains_a_run_on_the_bound_loop() -> None:
    held = Held()
    w = held.w
    loop = asyncio.new_event_loop()
    looper = threading.Thread(target=loop.run_forever, name="test-loop")
    looper.start()
    try:
        fut = asyncio.run_coroutine_threadsafe(w.run_async(held.orch), loop)
        poll_for(lambda: held.started[0] != 0, timeout=30, message="the task never started")
        closer, closed = held.on_thread(lambda: w.close(60.0))
        poll_for(held.closing, timeout=30, message="close() never stopped admission")
        with pytest.raises(WorkerClosedError, match="closing"):
            w.submit(held.noop_orch)
        assert not fut.done()
        held.flags[0] = 1
        assert fut.result(60) is None  # finished normally, within close's timeout
        closer.join(60)
    finally:
        held.flags[0] = 1
        loop.call_soon_threadsafe(loop.stop)
        looper.join(60)
        loop.close()
        w.close()
    assert closed == {"result": None}, closed
    assert not child_pids()


def test_close_whose_loop_ends_under_it_still_stops_every_child() -> None:
    # The loop's owner returns from asyncio.run once its run is done, cancelling every
    # task left on it (the close that another thread runs there too): the close is
    # finished on the closing thread.
    held = Held()
    w = held.w
    ran: dict[str, Any] = {}

    def own_loop() -> None:
        try:
            asyncio.run(w.run_async(held.orch))
            ran["result"] = None
        except BaseException as exc:
            ran["error"] = exc

    looper = threading.Thread(target=own_loop, name="test-loop")
    looper.start()
    try:
        poll_for(lambda: held.started[0] != 0, timeout=30, message="the task never started")
        closer, closed = held.on_thread(lambda: w.close(60.0))
        poll_for(held.closing, timeout=30, message="close() never stopped admission")
        held.flags[0] = 1
        looper.join(60)
        closer.join(60)
    finally:
        held.flags[0] = 1
        looper.join(60)
        w.close()
    assert ran == {"result": None}, ran
    assert closed == {"result": None}, closed
    assert not child_pids()


def test_close_inside_a_run_is_still_refused() -> None:
    held = Held()
    w = held.w
    seen: list[BaseException] = []

    def orch(o: Any, args: Any, config: Any) -> None:
        try:
            w.close()
        except WorkerClosedError as exc:
            seen.append(exc)

    try:
        w.run(orch)
    finally:
        w.close()
    assert len(seen) == 1 and "within a run" in str(seen[0])


@pytest.mark.parametrize("first", ["older", "newer"])
def test_two_workers_of_one_process_each_close_cleanly(
    first: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A second Worker's children (forked while the first Worker runs) hold none of the
    first Worker's fork-server channels: closing either Worker first, its fork servers see
    the channel close and exit at once. With those copies held, the older Worker's close
    waited out its whole timeout and then SIGKILLed its fork servers."""
    workers = []
    try:
        for _ in range(2):
            w = Worker(num_sub_workers=1, heap_bytes=1 << 20)
            h = w.register(sub_tasks.noop)
            w.init()
            workers.append(w)
            w.run(lambda o, a, c, h=h: o.submit_sub(h, targs()))
        if first == "newer":
            workers.reverse()
        with caplog.at_level("WARNING", logger="simpler_daemon"):
            for w in workers:
                w.close()
        killed = [r.getMessage() for r in caplog.records if "did not exit" in r.getMessage()]
        assert killed == [], killed
    finally:
        for w in workers:
            w.close()
    poll_for(lambda: not child_pids(), timeout=10.0, message="children outlived both Workers")
