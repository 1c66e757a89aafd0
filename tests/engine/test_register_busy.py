"""Registration never waits for a busy child.

Two SUB children, one held busy by a task that waits on a heap flag (released by the
test, never by a timer): a register, an unregister or a reload completes on the idle
child at once, the busy child's control is queued on its lane and reaches it when its
task ends, before its next task. The Scheduler sends a task of a callable only to a
child that has it installed. An unregister waits for the tasks of its own callable
only. A register racing the final unregister of the same callable ends in a defined
state in both orders (the refusal is the origin's ``REGISTER_TOMBSTONE_ACTIVE``).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpler_daemon import Tag, Worker
from simpler_daemon.callables import spec_for_import
from simpler_daemon.client import sub_task, tensor
from simpler_daemon.errors import RegistrationError
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.testing import poll_for
from tests.support import sub_tasks
from tests.support.daemon_harness import EXAMPLES, running_daemon
from tests.support.sub_tasks import targs

pytestmark = pytest.mark.timeout(120)

#: How long a test waits for something that must happen at once (a loaded machine is
#: slow, but nothing here takes long unless the engine waits for the held task).
SOON_S = 30.0
#: A held task's own deadline (ms): longer than any wait of the test.
HOLD_MS = 90_000

PID = "tests.support.sub_tasks:record_pid"
WAIT = "tests.support.sub_tasks:wait_flag"


async def until(pred: Callable[[], object], message: str, timeout: float = SOON_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, message
        await asyncio.sleep(0.005)


class Rig:
    """A started fair-admission Worker of two SUB children; ``hold`` occupies one."""

    def __init__(self, w: Worker) -> None:
        self.w = w
        self.flags = w.alloc((8,), np.int64)
        self.pids = w.alloc((8,), np.int64)
        self.slot = 0
        self.held: list[tuple[Any, int, int]] = []

    def sub_lanes(self) -> list[Any]:
        assert self.w.scheduler is not None
        return list(self.w.scheduler.manager.sub)

    def lane_of(self, pid: int) -> Any:
        return next(ln for ln in self.sub_lanes() if ln.endpoint.child.pid == pid)

    def child_pids(self) -> set[int]:
        return {r["pid"] for r in self.w.list_workers() if r["kind"] == "sub"}

    async def hold(self, handle: Any) -> tuple[Any, int, int]:
        """Start a task of ``handle`` (wait_flag) on one child; return (run, flag index,
        the child's pid) once it runs."""
        i = self.slot
        self.slot += 1
        args = targs((self.flags, Tag.NO_DEP), (self.pids, Tag.NO_DEP), scalars=(i, i, HOLD_MS))
        run = await self.w.submit_async(lambda o, a, c: o.submit_sub(handle, args))
        await until(lambda: self.pids[i] != 0, "the held task never started")
        return run, i, int(self.pids[i])

    def release(self, i: int) -> None:
        self.flags[i] = 1

    async def only_idle(self, handle: Any, pid: int) -> None:
        """Hold every child, then let the one of ``pid`` go: it is the only idle one."""
        self.held = [await self.hold(handle) for _ in range(2)]
        run, i, _ = next(h for h in self.held if h[2] == pid)
        self.release(i)
        await asyncio.wait_for(run.wait_async(), SOON_S)

    async def release_all(self) -> None:
        for run, i, _ in self.held:
            self.release(i)
            await asyncio.wait_for(run.wait_async(), SOON_S)

    async def pid_of(self, handle: Any) -> int:
        """Run one task of ``handle`` (record_pid) and return the pid of its child."""
        out = self.w.alloc((1,), np.int64)
        await self.w.run_async(
            lambda o, a, c: o.submit_sub(handle, targs((out, Tag.OUTPUT), scalars=(0,)))
        )
        return int(out[0])


def rig() -> Rig:
    w = Worker(num_sub_workers=2, admission="fair", heap_bytes=4 << 20)
    w.register(sub_tasks.wait_flag)
    return Rig(w)


@pytest.mark.asyncio
async def test_register_returns_while_another_task_holds_a_child() -> None:
    r = rig()
    async with r.w:
        hw = r.w.registry.active()[0].spec.handle
        run, i, busy_pid = await r.hold(hw)
        try:
            (idle_pid,) = r.child_pids() - {busy_pid}
            reg = asyncio.ensure_future(r.w.register_async(PID))
            await until(reg.done, "register waited for the busy child")
            h = reg.result()
            assert not run.done()  # the held task still runs: nothing waited for it
            busy = r.lane_of(busy_pid)
            assert busy.deliveries == 1  # its install is queued behind the task
            # A task of the new callable runs at once, on the child that has it.
            assert await r.pid_of(h) == idle_pid
            assert not run.done()
        finally:
            r.release(i)
        await asyncio.wait_for(run.wait_async(), SOON_S)
        await until(lambda: busy.deliveries == 0, "the queued install never reached the child")
        assert not busy.missing
        # The other child held now: the formerly busy one runs the new callable.
        await r.only_idle(hw, busy_pid)
        try:
            assert await r.pid_of(h) == busy_pid
        finally:
            await r.release_all()
        assert r.w.restarts["sub"] == 0


@pytest.mark.asyncio
async def test_unregister_waits_for_its_own_tasks_only() -> None:
    r = rig()
    async with r.w:
        hw = r.w.registry.active()[0].spec.handle
        h = await r.w.register_async(PID)
        # Another callable's task holds a child: the unregister does not wait for it.
        run, i, busy_pid = await r.hold(hw)
        try:
            unreg = asyncio.ensure_future(r.w.unregister_async(h))
            await until(unreg.done, "unregister waited for another callable's task")
            unreg.result()
            assert h.hashid not in r.w.registry
            assert not run.done()
        finally:
            r.release(i)
        await asyncio.wait_for(run.wait_async(), SOON_S)
        await until(lambda: all(ln.deliveries == 0 for ln in r.sub_lanes()), "queued uninstall")

        # A task of the callable itself in flight: its final unregister waits for it.
        mine = await r.w.register_async(WAIT)  # by path: not the Rig's own wait_flag
        assert mine != hw
        run, i, busy_pid = await r.hold(mine)
        try:
            (idle_pid,) = r.child_pids() - {busy_pid}
            unreg = asyncio.ensure_future(r.w.unregister_async(mine))
            idle, busy = r.lane_of(idle_pid), r.lane_of(busy_pid)
            await until(lambda: busy.deliveries == 1, "the unregister never started")
            await until(lambda: idle.deliveries == 0, "the idle child's uninstall")
            await asyncio.sleep(0)  # the unregister sees that its idle child answered
            assert not unreg.done()  # still waiting for the task of its callable
            # Meanwhile the same callable cannot be registered again (the unregister wins).
            with pytest.raises(RegistrationError) as refused:
                await r.w.register_async(WAIT)
            assert refused.value.code == "REGISTER_TOMBSTONE_ACTIVE"
        finally:
            r.release(i)
        await asyncio.wait_for(unreg, SOON_S)
        await asyncio.wait_for(run.wait_async(), SOON_S)  # it ran to its end
        assert mine.hashid not in r.w.registry
        assert all(ln.deliveries == 0 and not ln.missing for ln in r.sub_lanes())
        # The end state is defined: registered afresh, it runs on both children.
        again = await r.w.register_async(WAIT)
        assert again == mine
        assert r.w.restarts["sub"] == 0


@pytest.mark.asyncio
async def test_register_then_final_unregister_while_a_child_is_busy() -> None:
    """The install queued on the busy child and the uninstall queued after it reach the
    child in that order; registering again afterwards installs it everywhere."""
    r = rig()
    async with r.w:
        hw = r.w.registry.active()[0].spec.handle
        run, i, busy_pid = await r.hold(hw)
        busy = r.lane_of(busy_pid)
        try:
            h = await r.w.register_async(PID)
            await r.w.unregister_async(h)  # final: the install is still queued
            assert busy.deliveries == 2
            assert h.hashid not in r.w.registry
            h2 = await r.w.register_async(PID)  # a third control, queued after both
            assert h2 == h and busy.deliveries == 3
        finally:
            r.release(i)
        await asyncio.wait_for(run.wait_async(), SOON_S)
        await until(lambda: busy.deliveries == 0, "the queued controls never reached the child")
        await r.only_idle(hw, busy_pid)
        try:
            assert await r.pid_of(h) == busy_pid  # installed there, in the end
        finally:
            await r.release_all()


@pytest.mark.asyncio
async def test_register_while_every_child_is_busy_waits_for_the_first() -> None:
    """No idle child: the register answers once the first busy child installed it (so a
    callable that cannot be imported is refused, not left unrunnable); an unregister of
    it meanwhile finds nothing registered yet."""
    r = rig()
    async with r.w:
        hw = r.w.registry.active()[0].spec.handle
        run_a, a, _ = await r.hold(hw)
        run_b, b, _ = await r.hold(hw)
        try:
            reg = asyncio.ensure_future(r.w.register_async(PID))
            await until(lambda: all(ln.deliveries for ln in r.sub_lanes()), "queued installs")
            assert not reg.done()
            pending = spec_for_import(PID, "sub").handle
            with pytest.raises(RegistrationError) as early:
                await r.w.unregister_async(pending)
            assert early.value.code == "NOT_REGISTERED"
            r.release(a)
            h = await asyncio.wait_for(reg, SOON_S)
            assert h == pending
        finally:
            r.release(a)
            r.release(b)
        for run in (run_a, run_b):
            await asyncio.wait_for(run.wait_async(), SOON_S)
        await until(lambda: all(ln.deliveries == 0 for ln in r.sub_lanes()), "queued installs")
        assert await r.pid_of(h) in r.child_pids()


@pytest.mark.asyncio
async def test_a_failed_import_on_the_idle_child_is_rolled_back_behind_the_busy_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The idle child refuses the import: the register fails at once (the busy child is
    not waited for) and the uninstall is queued behind its queued install."""
    name = f"busy_import_{uuid.uuid4().hex[:10]}"
    monkeypatch.syspath_prepend(str(tmp_path))
    r = rig()
    async with r.w:
        hw = r.w.registry.active()[0].spec.handle
        run, i, busy_pid = await r.hold(hw)
        busy = r.lane_of(busy_pid)
        try:
            # Written after the children started: none can import it but a fresh one.
            (tmp_path / f"{name}.py").write_text("raise ImportError('refused on purpose')\n")
            with pytest.raises(RegistrationError) as failed:
                await asyncio.wait_for(r.w.register_async(f"{name}:fn"), SOON_S)
            assert "refused on purpose" in str(failed.value)
            assert busy.deliveries == 2  # install, then its undo, queued
            assert not run.done()
        finally:
            r.release(i)
        await asyncio.wait_for(run.wait_async(), SOON_S)
        await until(lambda: busy.deliveries == 0, "the queued controls")
        assert f"{name}:fn" not in {e.spec.handle.name for e in r.w.registry.active()}
        sys.modules.pop(name, None)
        assert r.w.restarts["sub"] == 0


# -- the daemon: one client's long task, another client's RegisterCallable -------------------


@pytest.mark.timeout(180)
def test_daemon_register_while_another_clients_task_holds_a_worker(tmp_path: Path) -> None:
    """Client A's task holds one of the two SUB workers until A writes its flag; client
    B's RegisterCallable (a 5 s deadline) answers meanwhile, and B's run of the new
    callable completes on the idle worker while A's task is still held."""
    with (
        running_daemon(tmp_path / "d") as d,
        d.client(client_id="a") as a,
        d.client(client_id="b", timeout=5.0) as b,
    ):
        wait_h = a.register(f"{EXAMPLES}:wait_for_flag")
        flag = a.alloc_buffer((2,), "uint8").buffer_id
        held = a.submit([sub_task(wait_h, [tensor(flag, "inout", (2,), "uint8")], [60_000])])
        poll_for(
            lambda: any(w.state == pb.WORKER_STATE_BUSY for w in a.list_workers()),
            30,
            message="A's task never started",
        )
        try:
            fill = b.register(f"{EXAMPLES}:fill")  # DEADLINE_EXCEEDED when it waits
            out = b.alloc_buffer((4,), "int32").buffer_id
            done = b.submit([sub_task(fill, [tensor(out, "output", (4,), "int32")], [7])])
            done.result(timeout=60)
            assert np.frombuffer(b.read_buffer(out), np.int32).tolist() == [7] * 4
            assert a.read_buffer(flag)[1] == 0  # A's task is still held
        finally:
            a.write_buffer(flag, b"\x01")
        held.result(timeout=60)


@pytest.mark.asyncio
async def test_a_queued_install_that_fails_leaves_that_child_out_of_its_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The busy child refuses the import once its task ended (after the register
    returned): a WARNING names it, and every task of the callable goes to the child that
    has it, also while the other one idles."""
    name = f"busy_import_{uuid.uuid4().hex[:10]}"
    monkeypatch.syspath_prepend(str(tmp_path))  # before init: the children inherit it
    r = rig()
    async with r.w:
        hw = r.w.registry.active()[0].spec.handle
        run, i, busy_pid = await r.hold(hw)
        busy = r.lane_of(busy_pid)
        (idle_pid,) = r.child_pids() - {busy_pid}
        (tmp_path / f"{name}.py").write_text(
            "import os\n"
            f"if os.getpid() == {busy_pid}:\n"
            "    raise ImportError('the busy child refuses it')\n"
            "def record_pid(args):\n"
            "    args.tensors[0][args.scalars[0]] = os.getpid()\n"
        )
        try:
            h = await asyncio.wait_for(r.w.register_async(f"{name}:record_pid"), SOON_S)
        finally:
            r.release(i)
        await asyncio.wait_for(run.wait_async(), SOON_S)
        warning = f"cannot register {name}:record_pid on worker {busy.worker_id}"
        with caplog.at_level("WARNING", logger="simpler_daemon.registration"):
            await until(lambda: busy.deliveries == 0, "the queued install")
            # The WARNING comes from the failed control's callback, which may run after
            # the lane's delivery count dropped: wait for it, do not race it.
            await until(lambda: warning in caplog.text, "no WARNING named the refused install")
        assert busy.missing == {h.digest}
        assert "the busy child refuses it" in caplog.text
        # The child that has it held: a task of it waits for that child, never the other.
        await r.only_idle(hw, busy_pid)
        out = r.w.alloc((1,), np.int64)
        try:
            task = targs((out, Tag.OUTPUT), scalars=(0,))
            queued = await r.w.submit_async(lambda o, a, c: o.submit_sub(h, task))
        finally:
            await r.release_all()
        await asyncio.wait_for(queued.wait_async(), SOON_S)  # the other child: "not registered"
        assert int(out[0]) == idle_pid
        await r.w.unregister_async(h)
        assert not busy.missing  # that child answered "not registered": nothing left
        sys.modules.pop(name, None)


RELOADED = """import os


def stamp(args):
    args.tensors[0][0] = {value}
    args.tensors[0][1] = os.getpid()
"""


@pytest.mark.asyncio
async def test_a_reload_does_not_wait_for_a_child_busy_with_another_callable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"busy_reload_{uuid.uuid4().hex[:10]}"
    src = tmp_path / f"{name}.py"
    src.write_text(RELOADED.format(value=1))
    monkeypatch.syspath_prepend(str(tmp_path))
    r = rig()
    async with r.w:
        hw = r.w.registry.active()[0].spec.handle
        h = await r.w.register_async(f"{name}:stamp")
        out = r.w.alloc((2,), np.int64)

        async def stamp() -> tuple[int, int]:
            await r.w.run_async(lambda o, a, c: o.submit_sub(h, targs((out, Tag.OUTPUT))))
            return int(out[0]), int(out[1])

        run, i, busy_pid = await r.hold(hw)
        busy = r.lane_of(busy_pid)
        (idle_pid,) = r.child_pids() - {busy_pid}
        try:
            src.write_text(RELOADED.format(value=2))
            assert (
                await asyncio.wait_for(r.w.register_async(f"{name}:stamp", reload=True), SOON_S)
                == h
            )
            assert busy.deliveries == 1  # its reload waits for its task
            assert await stamp() == (2, idle_pid)
        finally:
            r.release(i)
        await asyncio.wait_for(run.wait_async(), SOON_S)
        await until(lambda: busy.deliveries == 0, "the queued reload")
        await r.only_idle(hw, busy_pid)
        try:
            assert await stamp() == (2, busy_pid)  # the new code there too
        finally:
            await r.release_all()
        sys.modules.pop(name, None)


# -- the blocking API: no event loop of the user's ---------------------------------------------
#
# The queued control progresses on whoever drives the Scheduler: a blocking call that
# waits for a run (``w.run`` on another thread), or the background driver thread when
# nobody waits at all.


class BlockingRig(Rig):
    """``Rig`` driven through the blocking API only."""

    def hold_sync(self, handle: Any) -> tuple[Any, int, int]:
        """Submit a task of ``handle`` (wait_flag) and return (handle of the run, flag
        index, the child's pid) once it runs; nobody waits for the run."""
        i = self.slot
        self.slot += 1
        args = targs((self.flags, Tag.NO_DEP), (self.pids, Tag.NO_DEP), scalars=(i, i, HOLD_MS))
        run = self.w.submit(lambda o, a, c: o.submit_sub(handle, args))
        poll_for(lambda: self.pids[i] != 0, SOON_S, message="the held task never started")
        return run, i, int(self.pids[i])

    def only_idle_sync(self, handle: Any, pid: int) -> None:
        """Hold every child, then let the one of ``pid`` go: it is the only idle one."""
        self.held = [self.hold_sync(handle) for _ in range(2)]
        run, i, _ = next(h for h in self.held if h[2] == pid)
        self.release(i)
        run.result(SOON_S)

    def release_all_sync(self) -> None:
        for run, i, _ in self.held:
            self.release(i)
            run.result(SOON_S)

    def pid_of_sync(self, handle: Any) -> int:
        out = self.w.alloc((1,), np.int64)
        self.w.run(lambda o, a, c: o.submit_sub(handle, targs((out, Tag.OUTPUT), scalars=(0,))))
        return int(out[0])


def blocking_rig() -> BlockingRig:
    w = Worker(num_sub_workers=2, admission="fair", heap_bytes=4 << 20)
    w.register(sub_tasks.wait_flag)
    return BlockingRig(w)


def before_release(call: Callable[[], Any], release: Callable[[], None]) -> Any:
    """Run the blocking ``call`` on a thread and return its result; assert it returned
    before ``release`` (which ends the held task) was called: within SOON_S, else the
    held task is released so that the call can end and the test fails."""
    done = threading.Event()
    out: list[Any] = []

    def go() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # handed to the test's thread
            out.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=go, name="blocking-register")
    t.start()
    returned = done.wait(SOON_S)
    release_now = not returned
    try:
        if release_now:
            release()
    finally:
        t.join(SOON_S)
    assert returned, "the blocking call waited for the busy child's task"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def test_blocking_register_returns_while_a_waiting_caller_drives() -> None:
    """Thread A waits in ``w.run`` for the held task (it drives the Scheduler); a
    blocking register from another thread returns meanwhile, and the busy child gets
    the callable once the task ended."""
    r = blocking_rig()
    with r.w:
        hw = r.w.registry.active()[0].spec.handle
        i = r.slot
        r.slot += 1
        args = targs((r.flags, Tag.NO_DEP), (r.pids, Tag.NO_DEP), scalars=(i, i, HOLD_MS))
        waiter_out: list[Any] = []

        def wait_in_run() -> None:
            try:
                waiter_out.append(r.w.run(lambda o, a, c: o.submit_sub(hw, args)))
            except BaseException as exc:
                waiter_out.append(exc)

        waiter = threading.Thread(target=wait_in_run, name="waiter")
        waiter.start()
        try:
            poll_for(lambda: r.pids[i] != 0, SOON_S, message="the held task never started")
            busy_pid = int(r.pids[i])
            (idle_pid,) = r.child_pids() - {busy_pid}
            busy = r.lane_of(busy_pid)
            h = before_release(lambda: r.w.register(PID), lambda: r.release(i))
            assert waiter.is_alive()  # the held task still runs: nothing waited for it
            assert busy.deliveries == 1  # its install is queued behind the task
            # A task of the new callable runs at once, on the child that has it.
            assert before_release(lambda: r.pid_of_sync(h), lambda: r.release(i)) == idle_pid
            assert waiter.is_alive()
        finally:
            r.release(i)
            waiter.join(SOON_S)
        assert not waiter.is_alive() and not isinstance(waiter_out[0], BaseException)
        poll_for(lambda: busy.deliveries == 0, SOON_S, message="the queued install never ran")
        assert not busy.missing
        r.only_idle_sync(hw, busy_pid)
        try:
            assert r.pid_of_sync(h) == busy_pid
        finally:
            r.release_all_sync()
        assert r.w.restarts["sub"] == 0


def test_blocking_register_with_nobody_waiting_is_delivered_by_the_background_driver() -> None:
    """Submitted and not waited for: the background driver thread drives the held task;
    the register on the main thread returns while it is held, and its control queued on
    the busy child reaches it after the release with nobody calling the Worker."""
    r = blocking_rig()
    with r.w:
        hw = r.w.registry.active()[0].spec.handle
        run, i, busy_pid = r.hold_sync(hw)
        busy = r.lane_of(busy_pid)
        (idle_pid,) = r.child_pids() - {busy_pid}
        try:
            h = before_release(lambda: r.w.register(PID), lambda: r.release(i))
            assert not run.done()
            assert busy.deliveries == 1
            assert before_release(lambda: r.pid_of_sync(h), lambda: r.release(i)) == idle_pid
            assert not run.done()
        finally:
            r.release(i)
        # Nobody waits for the run nor calls the Worker: the background driver ends the
        # task and delivers the queued install.
        poll_for(lambda: busy.deliveries == 0, SOON_S, message="the queued install never ran")
        assert run.done() and not busy.missing
        run.result(0)
        r.only_idle_sync(hw, busy_pid)
        try:
            assert r.pid_of_sync(h) == busy_pid
        finally:
            r.release_all_sync()
        assert r.w.restarts["sub"] == 0


def test_blocking_unregister_waits_for_its_own_tasks_only() -> None:
    r = blocking_rig()
    with r.w:
        hw = r.w.registry.active()[0].spec.handle
        h = r.w.register(PID)
        run, i, busy_pid = r.hold_sync(hw)
        busy = r.lane_of(busy_pid)
        try:
            before_release(lambda: r.w.unregister(h), lambda: r.release(i))
            assert h.hashid not in r.w.registry
            assert not run.done() and busy.deliveries == 1
        finally:
            r.release(i)
        poll_for(lambda: busy.deliveries == 0, SOON_S, message="the queued uninstall never ran")
        run.result(SOON_S)
        # Registered afresh, it runs on the formerly busy child too.
        h = r.w.register(PID)
        r.only_idle_sync(hw, busy_pid)
        try:
            assert r.pid_of_sync(h) == busy_pid
        finally:
            r.release_all_sync()
        assert r.w.restarts["sub"] == 0


def test_blocking_reload_does_not_wait_for_a_busy_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"busy_reload_{uuid.uuid4().hex[:10]}"
    src = tmp_path / f"{name}.py"
    src.write_text(RELOADED.format(value=1))
    monkeypatch.syspath_prepend(str(tmp_path))
    r = blocking_rig()
    with r.w:
        hw = r.w.registry.active()[0].spec.handle
        h = r.w.register(f"{name}:stamp")
        out = r.w.alloc((2,), np.int64)

        def stamp() -> tuple[int, int]:
            r.w.run(lambda o, a, c: o.submit_sub(h, targs((out, Tag.OUTPUT))))
            return int(out[0]), int(out[1])

        run, i, busy_pid = r.hold_sync(hw)
        busy = r.lane_of(busy_pid)
        (idle_pid,) = r.child_pids() - {busy_pid}
        try:
            src.write_text(RELOADED.format(value=2))
            again = before_release(
                lambda: r.w.register(f"{name}:stamp", reload=True), lambda: r.release(i)
            )
            assert again == h and busy.deliveries == 1
            assert stamp() == (2, idle_pid)
        finally:
            r.release(i)
        poll_for(lambda: busy.deliveries == 0, SOON_S, message="the queued reload never ran")
        run.result(SOON_S)
        r.only_idle_sync(hw, busy_pid)
        try:
            assert stamp() == (2, busy_pid)
        finally:
            r.release_all_sync()
        sys.modules.pop(name, None)


def test_a_control_queued_by_the_blocking_api_survives_binding_an_event_loop() -> None:
    """A blocking register queued its control behind a held task; then an event loop
    binds the Worker (``run_async`` on another thread): the queued control still
    reaches the child (``bind`` finishes it first), and the bound loop runs the
    callable on both children."""
    r = blocking_rig()
    with r.w:
        hw = r.w.registry.active()[0].spec.handle
        run, i, busy_pid = r.hold_sync(hw)
        busy = r.lane_of(busy_pid)
        try:
            h = before_release(lambda: r.w.register(PID), lambda: r.release(i))
            assert busy.deliveries == 1
            seen: list[Any] = []

            async def on_loop() -> None:
                seen.append(await r.pid_of(h))
                await asyncio.wait_for(run.wait_async(), SOON_S)
                await r.only_idle(hw, busy_pid)
                try:
                    seen.append(await r.pid_of(h))
                finally:
                    await r.release_all()

            def go() -> None:
                try:
                    asyncio.run(on_loop())
                except BaseException as exc:
                    seen.append(exc)

            bound = threading.Thread(target=go, name="bound-loop")
            bound.start()
        finally:
            r.release(i)
        bound.join(SOON_S * 2)
        assert not bound.is_alive()
        assert len(seen) == 2 and not isinstance(seen[-1], BaseException), seen
        assert seen[1] == busy_pid  # installed there, in the end
        assert busy.deliveries == 0 and not busy.missing
        assert r.w.restarts["sub"] == 0
