"""The Worker's lifecycle under interruption: close() during init() and inside an
orchestration, Ctrl-C during start-up, timeouts validated, close() dropping the
registered callables, register() while init runs.

Init is held inside its startup barrier by a SUB child's init hook: the hook signals
the parent (SIGUSR1, or SIGINT for a Ctrl-C) and then waits for a file. The parent's
signal handler runs on the init thread, inside ``init()``; a thread it starts runs
after every fork of init (the Worker forks only while it has one thread).
"""

from __future__ import annotations

import gc
import math
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from simpler_daemon import (
    StartupError,
    Tag,
    Worker,
    WorkerClosedError,
    WorkerState,
)
from simpler_daemon.testing import child_pids, poll_for
from tests.support import sub_tasks as tasks


def _hold_init(release: Path, sig: int = signal.SIGUSR1) -> Callable[[], None]:
    """An init hook (runs in the child): tell the parent we are inside init, then wait
    (at most 30 s) for ``release`` to exist."""

    def hook() -> None:
        os.kill(os.getppid(), sig)
        deadline = time.monotonic() + 30.0
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.1)

    return hook


@pytest.fixture
def on_sigusr1() -> Iterator[list[Callable[[], None]]]:
    """Install a SIGUSR1 handler that runs the callables the test appends."""
    calls: list[Callable[[], None]] = []

    def handler(signum: int, frame: Any) -> None:
        for call in calls:
            call()

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        yield calls
    finally:
        signal.signal(signal.SIGUSR1, old)


def _state(w: Worker) -> WorkerState:
    """Read afresh (mypy would keep the state narrowed by an earlier assert)."""
    return w.state


def _assert_no_children(pids: set[int]) -> None:
    poll_for(lambda: not child_pids(), 10.0, message="children outlived the rolled-back init")
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"child {pid} is still there"


# -- close() during init() -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_close_from_a_signal_handler_during_init_cancels_the_init(
    tmp_path: Path, on_sigusr1: list[Callable[[], None]]
) -> None:
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20)
    w._init_hooks[0] = _hold_init(tmp_path / "never")
    seen: list[set[int]] = []
    on_sigusr1.append(lambda: seen.append(child_pids()))
    on_sigusr1.append(w.close)  # on the init thread: cannot wait for init, cancels it
    with pytest.raises(WorkerClosedError, match=r"cannot init: close\(\) was called"):
        w.init()
    assert seen and seen[0]  # the children existed when close() was called
    assert _state(w) is WorkerState.CLOSED
    _assert_no_children(seen[0])
    with pytest.raises(WorkerClosedError):
        w.run(lambda o, a, c: None)
    w.close()  # still a no-op


@pytest.mark.timeout(60)
def test_close_from_another_thread_during_init_waits_for_the_rollback(
    tmp_path: Path, on_sigusr1: list[Callable[[], None]]
) -> None:
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20, restart_children=False)
    w._init_hooks[1] = _hold_init(tmp_path / "never")
    pids: list[set[int]] = []
    after_close: list[object] = []

    def close_in_thread() -> None:
        w.close()
        # close() returned: the init it interrupted has rolled back entirely.
        after_close.append((w.state, child_pids()))

    closer = threading.Thread(target=close_in_thread, name="closer")
    on_sigusr1.append(lambda: pids.append(child_pids()))
    on_sigusr1.append(closer.start)
    with pytest.raises(WorkerClosedError, match=r"cannot init: close\(\) was called"):
        w.init()
    closer.join(30.0)
    assert not closer.is_alive()
    assert after_close == [(WorkerState.CLOSED, set())]
    _assert_no_children(pids[0])


# -- close() inside an orchestration function ------------------------------------------------------


@pytest.mark.timeout(60)
def test_close_inside_an_orchestration_function_is_refused_at_once() -> None:
    w = Worker(num_sub_workers=1, heap_bytes=4 << 20)
    h = w.register(tasks.noop)
    w.init()
    try:
        errors: list[BaseException] = []

        def orch(o: Any, a: Any, c: Any) -> None:
            try:
                w.close()
            except WorkerClosedError as exc:
                errors.append(exc)
            o.submit_sub(h)

        w.run(orch)  # the run itself was not cancelled
        assert len(errors) == 1
        assert "cannot close the worker within a run" in str(errors[0])
        assert w.state is WorkerState.READY
    finally:
        w.close()
    assert _state(w) is WorkerState.CLOSED


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_close_async_inside_an_async_orchestration_is_refused_at_once() -> None:
    w = Worker(num_sub_workers=1, heap_bytes=4 << 20)
    h = w.register(tasks.noop)
    async with w:
        errors: list[BaseException] = []

        async def orch(o: Any, a: Any, c: Any) -> None:
            try:
                await w.close_async()
            except WorkerClosedError as exc:
                errors.append(exc)
            o.submit_sub(h)

        await w.run_async(orch)
        assert len(errors) == 1 and "within a run" in str(errors[0])
        assert w.state is WorkerState.READY
    assert _state(w) is WorkerState.CLOSED


# -- Ctrl-C during startup -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_ctrl_c_during_startup_rolls_back_and_raises_keyboard_interrupt(tmp_path: Path) -> None:
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20)
    w._init_hooks[0] = _hold_init(tmp_path / "never", signal.SIGINT)
    before = set(child_pids())
    with pytest.raises(KeyboardInterrupt):
        w.init()
    assert w.state is WorkerState.FAILED
    _assert_no_children(set(child_pids()) - before)
    w.close()
    assert _state(w) is WorkerState.CLOSED


# -- timeouts are validated ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, 0.0, -1, -0.5, math.inf, math.nan, True, "5"])
def test_startup_timeout_must_be_a_positive_finite_number(bad: Any) -> None:
    with pytest.raises((ValueError, TypeError), match=r"cannot create Worker: startup_timeout="):
        Worker(num_sub_workers=1, startup_timeout=bad)


@pytest.mark.parametrize("bad", [-1, math.inf, math.nan])
def test_close_timeout_must_be_finite_and_not_negative(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"cannot create Worker: close_timeout="):
        Worker(num_sub_workers=1, close_timeout=bad)


@pytest.mark.timeout(60)
def test_wait_and_ping_timeouts_are_validated() -> None:
    w = Worker(num_sub_workers=1, heap_bytes=4 << 20)
    h = w.register(tasks.sleep_ms)
    w.init()
    try:
        handle = w.submit(lambda o, a, c: o.submit_sub(h, tasks.targs(scalars=(300,))))
        for bad in (math.nan, -1.0):
            with pytest.raises(ValueError, match=r"cannot wait for run \d+: timeout="):
                handle.wait(bad)
            with pytest.raises(ValueError, match=r"cannot ping sub worker 0: timeout="):
                w.ping(0, timeout=bad)
        with pytest.raises(TimeoutError):
            handle.wait(0.0)  # zero: just look
        handle.wait(math.inf)  # forever: until it completes
        assert handle.done()
        assert w.ping(0, timeout=math.inf) == w.list_workers()[0]["pid"]
    finally:
        w.close()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_wait_async_timeouts_are_validated() -> None:
    w = Worker(num_sub_workers=1, heap_bytes=4 << 20)
    h = w.register(tasks.noop)
    async with w:
        handle = await w.submit_async(lambda o, a, c: o.submit_sub(h))
        with pytest.raises(ValueError, match="timeout=nan"):
            await handle.wait_async(math.nan)
        with pytest.raises(ValueError, match="timeout=-2"):
            await handle.wait_async(-2)
        await handle.wait_async(math.inf)


# -- close() drops the registered callables --------------------------------------------------------


def _make_closure(tag: int) -> Callable[[Any], None]:
    marker = [tag]  # a distinct payload, hence a distinct hashid, per tag

    def closure(args: Any) -> None:  # not importable: shipped serialized, kept by object
        marker[0] += 1

    return closure


@pytest.mark.timeout(60)
def test_close_drops_every_registered_callable() -> None:
    w = Worker(num_sub_workers=1, heap_bytes=4 << 20)
    before, after = _make_closure(1), _make_closure(2)
    orch_fn = _make_closure(3)
    refs = [weakref.ref(before), weakref.ref(after), weakref.ref(orch_fn)]
    h1 = w.register(before)
    w.register(orch_fn, kind="orchestration")
    w.init()
    h2 = w.register(after)
    w.run(lambda o, a, c: (o.submit_sub(h1), o.submit_sub(h2)))
    w.close()
    del before, after, orch_fn
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_close_of_a_never_started_worker_drops_its_callables() -> None:
    w = Worker(num_sub_workers=1, heap_bytes=4 << 20)
    fn = _make_closure(4)
    ref = weakref.ref(fn)
    w.register(fn)
    w.close()
    del fn
    gc.collect()
    assert ref() is None


# -- register() while init runs --------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_register_during_init_waits_for_init_then_succeeds(
    tmp_path: Path, on_sigusr1: list[Callable[[], None]]
) -> None:
    release = tmp_path / "release"
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20, restart_children=False)
    # The last child signals: by then the parent has forked every child, so the
    # registrar thread the signal starts never shares the process with a fork.
    w._init_hooks[1] = _hold_init(release)
    outcome: list[tuple[WorkerState, Any]] = []

    def register_in_thread() -> None:
        state = w.state
        release.touch()  # init can finish only after this; register() follows at once
        try:
            outcome.append((state, w.register(tasks.add_one)))
        except BaseException as exc:
            outcome.append((state, exc))

    registrar = threading.Thread(target=register_in_thread, name="registrar")
    on_sigusr1.append(registrar.start)
    w.init()
    try:
        registrar.join(30.0)
        assert len(outcome) == 1
        state, handle = outcome[0]
        assert state is WorkerState.INITIALIZING
        assert not isinstance(handle, BaseException), handle
        assert handle.hashid in w.registry
        x = w.alloc((2,), "float64")
        w.run(lambda o, a, c: o.submit_sub(handle, tasks.targs((x, Tag.INOUT))))
        assert x.tolist() == [1.0, 1.0]
    finally:
        w.close()


@pytest.mark.timeout(60)
def test_register_during_a_failing_init_raises_the_init_failure(
    tmp_path: Path, on_sigusr1: list[Callable[[], None]]
) -> None:
    w = Worker(num_sub_workers=1, heap_bytes=4 << 20, startup_timeout=3.0)
    w._init_hooks[0] = _hold_init(tmp_path / "never")  # never ready: init times out
    outcome: list[BaseException | None] = []

    def register_in_thread() -> None:
        try:
            w.register(tasks.add_one)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    registrar = threading.Thread(target=register_in_thread, name="registrar")
    on_sigusr1.append(registrar.start)
    with pytest.raises(StartupError, match="not ready within") as init_error:
        w.init()
    registrar.join(30.0)
    assert len(outcome) == 1 and isinstance(outcome[0], StartupError), outcome
    assert str(outcome[0]) == str(init_error.value)
    w.close()
