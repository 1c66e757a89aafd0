"""Registration under faults and concurrency: controls on every child at once, each with
a deadline; a child dying during an unregister; concurrent identical registrations; callables
with nowhere to run; a register whose caller is cancelled.

Concurrency is proven by what the children record (a rendezvous inside the import of
the registered module), never by timing; a dead child is a real SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from simpler_daemon import (
    CallableHandle,
    RegistrationError,
    StartupError,
    Tag,
    Worker,
)
from simpler_daemon.engine import registration as registration_mod
from simpler_daemon.errors import EndpointError, RunCancelled
from simpler_daemon.testing import alive, poll_for
from tests.support import sub_tasks as tasks
from tests.support.sub_tasks import targs

RENDEZVOUS = "tests.support.rendezvous_import:fn"
SLOW = "tests.support.slow_import:fn"


@pytest.fixture
def w2() -> Iterator[Worker]:
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20)
    w.init()
    try:
        yield w
    finally:
        w.close()


def _run_on_both(w: Worker, h: CallableHandle) -> list[int]:
    """Run ``h`` (tasks.record_pid-like: writes its pid) as a SUB group of 2: one member
    on each child; returns the pids."""
    pids = w.alloc((2,), "int64")
    w.run(
        lambda o, a, c: o.submit_sub_group(
            h, [targs((pids, Tag.NO_DEP), scalars=(i,)) for i in range(2)]
        )
    )
    return [int(p) for p in pids]


# -- controls run on every child at once, each with a deadline -------------------------------------


@pytest.mark.timeout(90)
def test_register_runs_the_import_on_every_child_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each child's import waits until the other child has started its own: only a
    register that sends the control to both at once can succeed (sent one after the
    other, the first import gives up after 20 s and the register fails)."""
    meet = tmp_path / "meet"
    meet.mkdir()
    monkeypatch.setenv("SIMPLER_TEST_RENDEZVOUS_DIR", str(meet))
    monkeypatch.setenv("SIMPLER_TEST_RENDEZVOUS_N", "2")
    monkeypatch.setenv("SIMPLER_TEST_IMPORT_SLEEP", "2.0")
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20)
    w.init()
    try:
        h = w.register(RENDEZVOUS)
        assert h.hashid in w.registry
        pids = {int(p) for p in os.listdir(meet)}
        assert pids == {row["pid"] for row in w.list_workers()}  # both imported it
        w.unregister(h)
        assert h.hashid not in w.registry
    finally:
        w.close()


@pytest.mark.timeout(90)
def test_a_register_control_that_misses_its_deadline_fails_the_register(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child stuck in a 30 s import does not hold register() for 30 s: past the control
    deadline the register fails naming the worker and the timeout, and the callable is
    not registered."""
    monkeypatch.setenv("SIMPLER_TEST_IMPORT_MARKER", str(tmp_path / "importing"))
    monkeypatch.setenv("SIMPLER_TEST_IMPORT_SLEEP", "30")
    monkeypatch.setattr(registration_mod, "CONTROL_TIMEOUT_S", 1.0, raising=False)
    w = Worker(num_sub_workers=1, heap_bytes=4 << 20, restart_children=False)
    w.init()
    try:
        with pytest.raises(RegistrationError, match=r"worker 0: .*timed out") as ei:
            w.register(SLOW)
        assert ei.value.code == "REGISTER_FAILED"  # its only worker: "failed on every worker"
        assert (tmp_path / "importing").exists()  # the child was inside the control
        assert not w.registry.active()
    finally:
        w.close(timeout=2.0)


# -- a child dying during an unregister ------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_child_dying_during_an_unregister_leaves_the_callable_usable(w2: Worker) -> None:
    """The dead child can never run the callable again and its replacement starts clean:
    the unregister completes, and once the child is replaced the same callable registers,
    runs on both children and unregisters again."""
    h = w2.register(tasks.record_pid)
    victim = w2.list_workers()[1]["pid"]
    os.kill(victim, signal.SIGKILL)
    # Dead: a zombie, or already reaped by the Worker (its exit watch).
    poll_for(lambda: not alive(victim), 10.0, message="victim never died")
    w2.unregister(h)  # the control reaches a dead child: it must not stay uncertain
    assert w2.registry.lookup(h.hashid) is None

    def replaced() -> bool:
        w2.poll()
        return w2.restarts["sub"] == 1 and all(r["alive"] for r in w2.list_workers())

    poll_for(replaced, 30.0, message="the dead child was never replaced")
    again = w2.register(tasks.record_pid)
    assert again == h
    pids = _run_on_both(w2, again)
    assert set(pids) == {r["pid"] for r in w2.list_workers()} and victim not in pids
    w2.unregister(again)
    assert w2.registry.lookup(h.hashid) is None


@pytest.mark.timeout(60)
def test_an_uncertain_unregister_can_be_retried_or_registered_over(
    w2: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child that is alive but whose unregister could not be confirmed leaves
    REGISTER_CLEANUP_UNCERTAIN; that is not forever: registering the callable again
    reinstalls it everywhere (certain again), and unregistering it again retries."""
    real = registration_mod.LocalTarget.uninstall
    failing = {"left": 1}

    async def flaky(self: Any, spec: Any) -> None:
        if self.worker_id == 1 and failing["left"]:
            failing["left"] -= 1
            raise EndpointError("injected: base frame busy")  # endpoint stays healthy
        await real(self, spec)

    monkeypatch.setattr(registration_mod.LocalTarget, "uninstall", flaky)
    h = w2.register(tasks.record_pid)
    with pytest.raises(RegistrationError) as ei:
        w2.unregister(h)
    assert ei.value.code == "REGISTER_CLEANUP_UNCERTAIN" and 1 in ei.value.failures
    again = w2.register(tasks.record_pid)  # registering over the uncertain state
    assert again == h and h.hashid in w2.registry
    assert len(set(_run_on_both(w2, again))) == 2
    failing["left"] = 1
    with pytest.raises(RegistrationError, match="REGISTER_CLEANUP_UNCERTAIN"):
        w2.unregister(again)
    w2.unregister(again)  # a retry: this time every child confirms
    assert w2.registry.lookup(h.hashid) is None
    with pytest.raises(RegistrationError, match="NOT_REGISTERED"):
        w2.unregister(again)


# -- concurrent identical registrations join the one in progress -----------------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_eight_tasks_registering_the_same_callable_join_one() -> None:
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20)
    async with w:
        handles = await asyncio.gather(
            *(w.register_async("tests.support.sub_tasks:noop") for _ in range(8))
        )
        assert len(set(handles)) == 1
        h = handles[0]
        assert w.registry.get(h.hashid).refcount == 8
        for left in range(7, -1, -1):
            await w.unregister_async(h)
            entry = w.registry.lookup(h.hashid)
            assert (entry.refcount if entry is not None else 0) == left
        # A registration that fails fails every caller that joined it, with its own error.
        results = await asyncio.gather(
            *(w.register_async("tests.support.sub_tasks:no_such_function") for _ in range(8)),
            return_exceptions=True,
        )
        codes = {getattr(r, "code", type(r).__name__) for r in results}
        assert codes == {"REGISTER_FAILED"}, results
        assert not w.registry.active()


@pytest.mark.timeout(90)
def test_eight_threads_registering_the_same_callable_join_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's shape: a Worker bound to an event loop, eight client threads calling
    register() at the same moment while the first one's 1 s import is in progress."""
    monkeypatch.setenv("SIMPLER_TEST_IMPORT_MARKER", str(tmp_path / "importing"))
    monkeypatch.setenv("SIMPLER_TEST_IMPORT_SLEEP", "1.0")
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20, restart_children=False)
    w.init()
    bound = threading.Event()
    loop = asyncio.new_event_loop()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(w.start_async())
        bound.set()
        loop.run_forever()

    loop_thread = threading.Thread(target=serve, name="loop")
    loop_thread.start()
    try:
        assert bound.wait(30.0)
        start = threading.Barrier(8)
        results: list[Any] = [None] * 8

        def client(i: int) -> None:
            start.wait(30.0)
            try:
                results[i] = w.register(SLOW)
            except BaseException as exc:
                results[i] = exc

        clients = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(60.0)
        assert all(isinstance(r, CallableHandle) for r in results), results
        assert len(set(results)) == 1
        assert w.registry.get(results[0].hashid).refcount == 8
    finally:
        if bound.is_set():
            w.close()
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(30.0)
        loop.close()
        if not bound.is_set():
            w.close()


# -- callables with nowhere to run -----------------------------------------------------------------


def test_a_sub_callable_on_a_worker_without_sub_workers_is_refused() -> None:
    w = Worker(num_sub_workers=0, num_chips=1, heap_bytes=4 << 20)
    try:
        with pytest.raises(ValueError, match=r"cannot register: .*noop.*no SUB workers"):
            w.register(tasks.noop)
        with pytest.raises(ValueError, match="no SUB workers"):
            w.register("tests.support.sub_tasks:noop")
        orch = w.register(lambda o, a, c: None, kind="orchestration")  # runs in the parent
        kernel = w.register("tests.support.chip_kernels:add_one", kind="chip")
        w.init()
        with pytest.raises(ValueError, match=r"cannot register: .*noop.*no SUB workers"):
            w.register(tasks.noop)
        assert {e.spec.handle for e in w.registry.active()} == {orch, kernel}
    finally:
        w.close()


def test_a_chip_kernel_on_a_worker_without_chips_is_refused() -> None:
    w = Worker(num_sub_workers=1, heap_bytes=4 << 20)
    try:
        with pytest.raises(ValueError, match=r"cannot register: .*add_one.*no chips"):
            w.register("tests.support.chip_kernels:add_one", kind="chip")
        w.init()
        with pytest.raises(ValueError, match=r"cannot register: .*add_one.*no chips"):
            w.register("tests.support.chip_kernels:add_one", kind="chip")
        assert not w.registry.active()
    finally:
        w.close()


def test_a_level4_worker_with_nowhere_to_run_a_sub_callable_fails_init() -> None:
    """Level 4 learns its L3 children only by init (add_worker after register is fine):
    a SUB callable with no SUB worker and no local L3 child fails init, naming it."""
    w4 = Worker(level=4, heap_bytes=4 << 20)
    w4.register(tasks.noop)
    with pytest.raises(StartupError, match=r"cannot init: .*noop.*no SUB workers"):
        w4.init()
    w4.close()


# -- a register whose caller is cancelled ----------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_cancelled_register_ends_its_broadcast_and_drops_its_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that gives up (a client's deadline) while the children import: the
    controls still end, the reference the caller took is dropped, and registration keeps
    working for everyone."""
    marker = tmp_path / "importing"
    monkeypatch.setenv("SIMPLER_TEST_IMPORT_MARKER", str(marker))
    monkeypatch.setenv("SIMPLER_TEST_IMPORT_SLEEP", "0.5")
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20)
    async with w:
        slow = asyncio.ensure_future(w.register_async("tests.support.slow_import:fn"))
        deadline = asyncio.get_running_loop().time() + 20
        while not marker.exists():
            assert asyncio.get_running_loop().time() < deadline, "no child started the import"
            await asyncio.sleep(0.005)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        hashid = registration_mod.spec_for("tests.support.slow_import:fn", "sub").handle.hashid
        while w.registry.lookup(hashid) is not None:
            assert asyncio.get_running_loop().time() < deadline, "the abandoned reference stayed"
            await asyncio.sleep(0.01)
        # Every endpoint is free for the next control, and a new register works everywhere.
        h = await w.register_async(tasks.noop)
        await w.run_async(lambda o, a, c: [o.submit_sub(h, targs()) for _ in range(4)])
        h2 = await w.register_async("tests.support.slow_import:fn")
        assert w.registry.get(h2.hashid).refcount == 1
        await w.unregister_async(h2)
        assert w.registry.lookup(h2.hashid) is None


# -- a control waits for a busy child; an idle child that does not answer is replaced -------------

#: The control deadline these tests use (the engine's is 30 s): every task below runs until
#: the test releases it, well past this.
SHORT_CONTROL_S = 2.0


async def _until(pred: Any, timeout: float, message: str) -> None:
    """Poll ``pred`` on the running loop until it holds; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, message
        await asyncio.sleep(0.02)


async def _past_the_control_deadline(pending: asyncio.Future[Any], w: Worker) -> None:
    """Wait three control deadlines (or until ``pending`` ended or one more child was
    replaced: what the deadline must not do to a busy child)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 3 * SHORT_CONTROL_S
    restarts = w.restarts["sub"]
    await _until(
        lambda: pending.done() or w.restarts["sub"] > restarts or loop.time() >= end,
        60.0,
        "the loop stalled",
    )


def _hold_until_flag(h: CallableHandle, flag: Any, pids: Any, i: int) -> Any:
    """One task of ``tasks.wait_flag``: records its pid in pids[i], runs until flag[0]."""
    return lambda o, a, c: o.submit_sub(
        h, targs((flag, Tag.NO_DEP), (pids, Tag.NO_DEP), scalars=(0, i, 120_000))
    )


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_register_control_waits_for_busy_children_instead_of_killing_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every SUB child runs a task longer than the control deadline (one of them for a run
    cancelled without terminate): the register of a new callable waits for the tasks,
    then completes; the tasks end as they would have, and no child is replaced."""
    monkeypatch.setattr(registration_mod, "CONTROL_TIMEOUT_S", SHORT_CONTROL_S)
    # Fair admission: every admitted run dispatches (fifo dispatches the head run only).
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20, admission="fair")
    async with w:
        h = await w.register_async(tasks.wait_flag)
        before = sorted(r["pid"] for r in w.list_workers())
        flag = w.alloc((1,), "int64")
        pids = w.alloc((2,), "int64")
        try:
            runs = [await w.submit_async(_hold_until_flag(h, flag, pids, i)) for i in range(2)]
            await _until(lambda: all(pids), 60.0, "the tasks never started")
            assert sorted(int(p) for p in pids) == before  # one task on each child
            w.cancel(runs[0])  # without terminate: its running task runs to its end
            register = asyncio.ensure_future(w.register_async("tests.support.sub_tasks:noop"))
            await _past_the_control_deadline(register, w)
            assert w.restarts["sub"] == 0, "a busy child was killed for a control"
            assert not register.done(), register  # busy children: nobody could answer yet
        finally:
            flag[0] = 1
        noop = await asyncio.wait_for(register, 60)
        await asyncio.wait_for(runs[1].wait_async(), 60)  # the unrelated run succeeded
        with pytest.raises(RunCancelled):
            await asyncio.wait_for(runs[0].wait_async(), 60)
        assert w.restarts["sub"] == 0
        assert sorted(r["pid"] for r in w.list_workers()) == before
        assert noop.hashid in w.registry
        await w.run_async(lambda o, a, c: [o.submit_sub(noop, targs()) for _ in range(4)])


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_an_idle_child_missing_a_control_deadline_is_replaced_a_busy_one_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Child 0 runs a task longer than the control deadline; child 1 is idle and stopped
    (SIGSTOP). A register kills and replaces the stopped child at the deadline and fails
    naming only the stopped child's worker, without waiting for the busy child: its
    install and the undo are queued behind its task (which succeeds, on the same child,
    which is never killed for the control)."""
    monkeypatch.setattr(registration_mod, "CONTROL_TIMEOUT_S", SHORT_CONTROL_S)
    # Fair admission: every admitted run dispatches (fifo dispatches the head run only).
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20, admission="fair")
    async with w:
        h = await w.register_async(tasks.wait_flag)
        rows = w.list_workers()
        flag = w.alloc((1,), "int64")
        pids = w.alloc((2,), "int64")
        try:
            run = await w.submit_async(_hold_until_flag(h, flag, pids, 0))
            await _until(lambda: bool(pids[0]), 60.0, "the task never started")
            busy = int(pids[0])
            (idle,) = [r["pid"] for r in rows if r["pid"] != busy]
            (idle_id,) = [r["worker_id"] for r in rows if r["pid"] == idle]
            os.kill(idle, signal.SIGSTOP)
            try:
                register = asyncio.ensure_future(w.register_async("tests.support.sub_tasks:noop"))
                await _until(
                    lambda: w.restarts["sub"] >= 1 or register.done(),
                    60.0,
                    "the stopped idle child was never replaced",
                )
            finally:
                with contextlib.suppress(ProcessLookupError):  # killed and reaped: gone
                    os.kill(idle, signal.SIGCONT)
            await _until(lambda: not alive(idle), 30.0, "the stopped child lives")
            with pytest.raises(RegistrationError, match="timed out") as ei:
                await asyncio.wait_for(register, 60)  # the busy child is not waited for
            assert set(ei.value.failures) == {idle_id}, ei.value
            assert not run.done()
            await _past_the_control_deadline(run, w)
            assert w.restarts["sub"] == 1, "the busy child was killed for a control"
            assert not run.done()
        finally:
            flag[0] = 1
        await asyncio.wait_for(run.wait_async(), 60)
        assert w.restarts["sub"] == 1
        now = {r["pid"] for r in w.list_workers()}
        assert busy in now and idle not in now
