"""Faults of local children.

* deadlines: the parent enforces ``CallConfig.deadline_ms`` (a task that ignores it is
  killed and its child replaced), for SUB, chip and nested L3 children;
* the fork server: fork servers are restarted (bounded), the children they forked
  outlive them, and work that needs a replacement fails naming the fork server once
  none is left;
* stopped children: a SIGSTOPped child with a task in flight is killed and replaced; a
  control that times out kills and replaces its child;
* the death of a replaced child reports its real wait status;
* grandchildren: a grandchild a task forked dies with its worker;
* a malformed chip frame fails the task, not the chip child.

Tasks announce themselves in heap tensors; nothing depends on timing except the
deadlines under test, which are far shorter than the tasks that ignore them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import time
from pathlib import Path
from typing import Any

import pytest

import simpler_daemon.children.forkserver as forkserver_mod
from simpler_daemon import CallConfig, Tag, TaskArgs, TaskError, Worker
from simpler_daemon.endpoints.base import EventKind, Outcome
from simpler_daemon.endpoints.local import LocalMailboxEndpoint
from simpler_daemon.errors import EndpointError
from simpler_daemon.mailbox.layout import ControlOp
from simpler_daemon.testing import alive, poll_for
from tests.support.chip_endpoint_rig import SPECS as CHIP_SPECS
from tests.support.chip_endpoint_rig import ChipRig
from tests.support.nested_rig import closing, l3_worker, l4_worker, subtree

pytestmark = pytest.mark.timeout(90)


# -- tasks (module level: inherited through fork, replayed into replacements) ---------------------


def record_pid(args: Any) -> None:
    args.tensors[0][0] = os.getpid()


def catch_the_alarm(args: Any) -> None:
    """Record the pid, then run for 20 s, swallowing the deadline exception."""
    args.tensors[0][0] = os.getpid()
    end = time.monotonic() + 20.0
    while time.monotonic() < end:
        try:
            time.sleep(0.01)
        except BaseException:  # ignoring the deadline on purpose
            pass


def sleep_with_the_alarm_blocked(args: Any) -> None:
    """Record the pid, then sleep 20 s in C with SIGALRM blocked."""
    args.tensors[0][0] = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        time.sleep(20.0)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})


def sleep_ms(args: Any) -> None:
    time.sleep(args.scalars[0] / 1000.0)


def wait_forever(args: Any) -> None:
    """Record the pid, then wait (60 s at most) for a flag nobody sets."""
    args.tensors[0][0] = os.getpid()
    end = time.monotonic() + 60.0
    while args.tensors[0][1] == 0 and time.monotonic() < end:
        time.sleep(0.005)


def fork_a_grandchild(args: Any) -> None:
    """Fork a grandchild that sleeps for a minute; record its pid and ours."""
    pid = os.fork()
    if pid == 0:  # the grandchild: no Python cleanup, just wait to be killed
        time.sleep(60.0)
        os._exit(0)
    args.tensors[0][0] = os.getpid()
    args.tensors[0][1] = pid


def l3_stuck(o: Any, a: Any, c: Any) -> None:
    """An L3 orchestration that blocks the L3 child's loop for 30 s (it never builds)."""
    time.sleep(30.0)


# -- helpers ----------------------------------------------------------------------------------------


def _rows(w: Worker, kind: str) -> list[dict[str, Any]]:
    return [r for r in w.list_workers() if r["kind"] == kind]


def _pids(w: Worker, kind: str = "sub") -> list[int]:
    return [r["pid"] for r in _rows(w, kind)]


def _drive(w: Worker) -> bool:
    """One empty run: the Scheduler notices deaths and replaces; False (for ``or``)."""
    w.run(lambda o, a, c: None)
    return False


def _replaced(w: Worker, kind: str, count: int) -> bool:
    _drive(w)
    return w.restarts[kind] >= count


def _one(w: Worker, handle: Any, tensor: Any, config: CallConfig) -> Any:
    return w.submit(
        lambda o, a, c: o.submit_sub(handle, TaskArgs().add_tensor(tensor, Tag.NO_DEP), config)
    )


def _servers(w: Worker) -> list[int]:
    fs = w.forkserver
    assert fs is not None
    return [p.pid for p in fs.processes if not p.peek()]


# -- deadlines the parent enforces -----------------------------------------------------------------


@pytest.mark.parametrize("task", [catch_the_alarm, sleep_with_the_alarm_blocked])
def test_a_sub_task_ignoring_its_deadline_is_killed_and_replaced(task: Any) -> None:
    with Worker(num_sub_workers=1) as w:
        h = w.register(task)
        probe = w.register(record_pid)
        t = w.alloc((2,), "int64")
        t0 = time.monotonic()
        handle = _one(w, h, t, CallConfig(deadline_ms=200))
        with pytest.raises(TaskError) as info:
            handle.wait(30)
        assert time.monotonic() - t0 < 15.0  # not the task's 20 s
        victim = int(t[0])
        err = info.value
        assert "deadline exceeded (200 ms)" in str(err)
        assert "sub worker 0" in str(err) and err.worker_id == 0
        poll_for(lambda: _replaced(w, "sub", 1), timeout=30, message="not replaced")
        assert not alive(victim)
        out = w.alloc((2,), "int64")
        _one(w, probe, out, CallConfig()).wait(30)
        assert out[0] not in (0, victim)


def test_a_cooperative_deadline_uses_the_same_words_and_keeps_the_child() -> None:
    with Worker(num_sub_workers=1) as w:
        h = w.register(sleep_ms)
        (pid,) = _pids(w)
        with pytest.raises(TaskError, match=r"deadline exceeded \(50 ms\)"):
            w.run(
                lambda o, a, c: o.submit_sub(
                    h, TaskArgs().add_scalar(5000), CallConfig(deadline_ms=50)
                )
            )
        assert _pids(w) == [pid] and w.restarts["sub"] == 0


def test_a_chip_kernel_ignoring_its_deadline_is_killed_and_replaced() -> None:
    with Worker(num_sub_workers=1, num_chips=1) as w:
        k = w.register("tests.support.chip_kernels:sleep_ms", kind="chip")
        probe = w.register("tests.support.chip_kernels:record_pid", kind="chip")
        (old,) = _pids(w, "chip")
        t0 = time.monotonic()
        with pytest.raises(TaskError) as info:
            w.run(
                lambda o, a, c: o.submit_next_level(
                    k, TaskArgs().add_scalar(20_000), CallConfig(deadline_ms=200), worker=0
                )
            )
        assert time.monotonic() - t0 < 15.0
        assert "deadline exceeded (200 ms)" in str(info.value) and "chip 0" in str(info.value)
        poll_for(lambda: _replaced(w, "chip", 1), timeout=30, message="chip not replaced")
        out = w.alloc((1,), "int64")
        w.run(
            lambda o, a, c: o.submit_next_level(
                probe, TaskArgs().add_tensor(out, Tag.OUTPUT), worker=0
            )
        )
        assert out[0] not in (0, old)


def test_a_nested_l3_child_ignoring_its_deadline_is_killed_and_replaced() -> None:
    l3 = l3_worker()
    w4 = l4_worker()
    i = w4.add_worker(l3)
    stuck = w4.register(l3_stuck)
    w4.init()
    with closing(w4) as seen:
        seen |= subtree(w4)
        (old,) = _pids(w4, "l3")
        t0 = time.monotonic()
        with pytest.raises(TaskError) as info:
            w4.run(
                lambda o, a, c: o.submit_next_level(
                    stuck, TaskArgs(), CallConfig(deadline_ms=300), worker=i
                )
            )
        assert time.monotonic() - t0 < 20.0  # not the orchestration's 30 s
        assert "deadline exceeded (300 ms)" in str(info.value)
        poll_for(lambda: _replaced(w4, "l3", 1), timeout=60, message="L3 child not replaced")
        assert not alive(old)
        seen |= subtree(w4)


@pytest.mark.asyncio
async def test_the_bound_event_loop_enforces_deadlines_and_replaces_the_child() -> None:
    """The same on the Scheduler bound to an event loop (the daemon's mode)."""
    w = Worker(num_sub_workers=1)
    h = w.register(sleep_with_the_alarm_blocked)
    probe = w.register(record_pid)
    w.init()
    try:
        await w.start_async()
        t = w.alloc((2,), "int64")
        with pytest.raises(TaskError, match=r"deadline exceeded \(200 ms\)"):
            await w.run_async(
                lambda o, a, c: o.submit_sub(
                    h, TaskArgs().add_tensor(t, Tag.NO_DEP), CallConfig(deadline_ms=200)
                )
            )
        victim = int(t[0])
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while w.restarts["sub"] < 1:
            assert loop.time() < end, "not replaced"
            await asyncio.sleep(0.01)
        out = w.alloc((2,), "int64")
        await w.run_async(
            lambda o, a, c: o.submit_sub(probe, TaskArgs().add_tensor(out, Tag.NO_DEP))
        )
        assert out[0] not in (0, victim)
    finally:
        await w.close_async()


# -- the fork server -------------------------------------------------------------------------------


def test_a_dead_fork_server_is_restarted_and_replacements_keep_working() -> None:
    with Worker(num_sub_workers=1) as w:
        probe = w.register(record_pid)
        first = _servers(w)
        assert len(first) == 2
        os.kill(first[0], signal.SIGKILL)
        poll_for(lambda: _drive(w) or w.restarts["forkserver"] >= 1, timeout=30)
        now = _servers(w)
        assert len(now) == 2 and first[0] not in now
        (victim,) = _pids(w)
        os.kill(victim, signal.SIGKILL)
        poll_for(lambda: _replaced(w, "sub", 1), timeout=30, message="sub not replaced")
        out = w.alloc((2,), "int64")
        _one(w, probe, out, CallConfig()).wait(30)
        assert out[0] not in (0, victim)


def test_children_a_fork_server_started_outlive_it() -> None:
    with Worker(num_sub_workers=1) as w:
        probe = w.register(record_pid)
        (victim,) = _pids(w)
        os.kill(victim, signal.SIGKILL)
        poll_for(lambda: _replaced(w, "sub", 1), timeout=30, message="sub not replaced")
        (replacement,) = _pids(w)
        assert os.getppid() != replacement and replacement in _own_children()
        _kill_every_server(w)
        assert alive(replacement)
        out = w.alloc((2,), "int64")
        _one(w, probe, out, CallConfig()).wait(30)
        assert out[0] == replacement


def _kill_every_server(w: Worker) -> None:
    """Kill fork servers one by one (each death may start a successor) until none is left."""

    def gone() -> bool:
        _drive(w)
        live = _servers(w)
        if live:
            os.kill(live[0], signal.SIGKILL)
            poll_for(lambda: not alive(live[0]), timeout=10)
        return not live

    poll_for(gone, timeout=60, message="fork servers kept coming back")


def _own_children() -> set[int]:
    from simpler_daemon.testing import child_pids

    return child_pids()


def test_a_fork_server_crash_loop_is_bounded_then_work_fails_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(forkserver_mod, "FORKSERVER_RESTARTS", 2)
    with Worker(num_sub_workers=1, num_chips=1) as w:
        h = w.register(record_pid)
        k = w.register("tests.support.chip_kernels:record_pid", kind="chip")
        _kill_every_server(w)
        assert 0 < w.restarts["forkserver"] <= 2
        for pid in [*_pids(w), *_pids(w, "chip")]:
            os.kill(pid, signal.SIGKILL)
        poll_for(
            lambda: _drive(w) or not any(r["alive"] for r in w.list_workers()),
            timeout=30,
            message="the deaths were not noticed",
        )
        out = w.alloc((1,), "int64")
        chip_run = w.submit(
            lambda o, a, c: o.submit_next_level(k, TaskArgs().add_tensor(out, Tag.OUTPUT), worker=0)
        )
        with pytest.raises(TaskError, match="fork server"):
            chip_run.wait(30)
        sub_run = w.submit(lambda o, a, c: o.submit_sub(h, TaskArgs().add_tensor(out, Tag.OUTPUT)))
        with pytest.raises(TaskError, match="no fork server is left"):  # no waiting
            sub_run.wait(30)


# -- stopped children and controls that time out ---------------------------------------------------


def test_a_stopped_child_with_a_task_in_flight_is_killed_and_replaced() -> None:
    with Worker(num_sub_workers=1) as w:
        h = w.register(wait_forever)
        t = w.alloc((2,), "int64")
        handle = _one(w, h, t, CallConfig())
        poll_for(lambda: t[0] != 0, timeout=30, message="the task never started")
        victim = int(t[0])
        os.kill(victim, signal.SIGSTOP)
        with pytest.raises(TaskError, match="stopped") as info:
            handle.wait(30)
        assert f"pid {victim}" in str(info.value)
        poll_for(lambda: _replaced(w, "sub", 1), timeout=30, message="not replaced")
        assert not alive(victim)


def test_a_control_that_times_out_kills_and_replaces_its_child() -> None:
    with Worker(num_sub_workers=1) as w:
        (victim,) = _pids(w)
        ep = w._pool.sub_endpoints[0]
        assert isinstance(ep, LocalMailboxEndpoint)
        os.kill(victim, signal.SIGSTOP)
        with pytest.raises(EndpointError, match="timed out"):
            asyncio.run(ep.control(ControlOp.PING, timeout=0.3))
        poll_for(lambda: _replaced(w, "sub", 1), timeout=30, message="not replaced")
        assert not alive(victim) and _pids(w) != [victim]


# -- the death of a replaced child names its status ------------------------------------------------


def test_a_replaced_child_dying_reports_its_signal() -> None:
    with Worker(num_sub_workers=1) as w:
        h = w.register(wait_forever)
        (first,) = _pids(w)
        os.kill(first, signal.SIGKILL)
        poll_for(lambda: _replaced(w, "sub", 1), timeout=30, message="not replaced")
        t = w.alloc((2,), "int64")
        handle = _one(w, h, t, CallConfig())
        poll_for(lambda: t[0] != 0, timeout=30, message="the task never started")
        os.kill(int(t[0]), signal.SIGKILL)
        with pytest.raises(TaskError) as info:
            handle.wait(30)
        assert "killed by SIGKILL" in info.value.remote_text


# -- grandchildren ---------------------------------------------------------------------------------


def test_a_grandchild_forked_inside_a_task_dies_at_close() -> None:
    w = Worker(num_sub_workers=1)
    w.init()
    try:
        h = w.register(fork_a_grandchild)
        t = w.alloc((2,), "int64")
        w.run(lambda o, a, c: o.submit_sub(h, TaskArgs().add_tensor(t, Tag.OUTPUT)))
        grandchild = int(t[1])
        assert grandchild and alive(grandchild)
        fd = os.pidfd_open(grandchild)
    finally:
        w.close()
    try:
        poll_for(lambda: _exited(fd), timeout=10, message="the grandchild outlived close()")
    finally:
        os.close(fd)


def test_a_grandchild_dies_with_its_worker_when_the_worker_is_replaced() -> None:
    with Worker(num_sub_workers=1) as w:
        h = w.register(fork_a_grandchild)
        t = w.alloc((2,), "int64")
        w.run(lambda o, a, c: o.submit_sub(h, TaskArgs().add_tensor(t, Tag.OUTPUT)))
        fd = os.pidfd_open(int(t[1]))
        try:
            os.kill(int(t[0]), signal.SIGKILL)
            poll_for(lambda: _replaced(w, "sub", 1), timeout=30, message="not replaced")
            poll_for(lambda: _exited(fd), timeout=10, message="the grandchild outlived its worker")
        finally:
            os.close(fd)


def _exited(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])


# -- malformed chip frames -------------------------------------------------------------------------


def test_a_malformed_chip_frame_fails_the_task_not_the_child(tmp_path: Path) -> None:
    rig = ChipRig(tmp_path / "trace.jsonl", list(CHIP_SPECS.values()), depth=1).start()
    try:
        d = rig.publish("noop", 1, frame=0, blob=struct.pack("<ii", -1, 0))
        ev = rig.wait_event(EventKind.COMPLETED, d)
        assert ev.outcome is Outcome.TASK_FAILURE, ev.message
        assert "malformed args blob" in ev.message
        assert rig.child is not None and not rig.child.poll()
        rig.events.clear()
        d2 = rig.publish("noop", 2, frame=0)
        assert rig.wait_event(EventKind.COMPLETED, d2).outcome is Outcome.SUCCESS
    finally:
        rig.close()


def test_the_shared_constants_are_the_contracts() -> None:
    from simpler_daemon.endpoints import local

    assert local.DEADLINE_GRACE_S == 0.25 and local.STOPPED_GRACE_S == 2.0
    assert local.CONTROL_TIMEOUT_S == 30.0
    assert forkserver_mod.FORKSERVER_RESTARTS == 5 and forkserver_mod.FORKSERVER_WINDOW_S == 60


# -- a child reaped before its exit watch fired ---------------------------------------------------


def _fd_target(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def test_a_child_reaped_before_its_watch_fires_keeps_its_pidfd_until_reported() -> None:
    """A dead child reaped outside its exit watch (a control, a progress sample) keeps
    its pidfd open while the driver still watches that fd: its number cannot go to a
    socket or to another child's pidfd, whose readiness the stale watch would take for
    this death (and whose loop reader its unwatch would drop). The watch then reports
    the exit, closes the fd, and the child is replaced."""
    with Worker(num_sub_workers=1) as w:
        probe = w.register(record_pid)
        assert w.manager is not None
        ep = w.manager.sub[0].endpoint
        assert isinstance(ep, LocalMailboxEndpoint) and ep.child is not None
        child = ep.child
        fd = child.pidfd
        assert fd is not None and child.watched
        os.kill(child.pid, signal.SIGKILL)
        poll_for(child.peek, timeout=10, message="the child never died")
        assert child.poll()  # reaped here, not by the watch
        assert child.pidfd == fd and _fd_target(fd) == "anon_inode:[pidfd]"
        poll_for(lambda: _replaced(w, "sub", 1), timeout=30, message="not replaced")
        assert child.pidfd is None and not child.watched
        out = w.alloc((2,), "int64")
        _one(w, probe, out, CallConfig()).wait(30)
        assert out[0] not in (0, child.pid)
