"""Cancel that stops running tasks (the engine's side; the daemon's is in
tests/client/test_client_api.py).

``Scheduler.terminate(run, reason)`` (after the run's cancel) SIGKILLs the process
group of every local child running a task of ``run``; the existing replacement path
forks a new child, the tasks end CANCELLED with ``run N cancelled (terminate): task
stopped on <worker> (pid P)``, and the rest of the pool keeps serving: tasks of other
runs on other workers are untouched, and the next run succeeds on the replacement.
The replacement is logged as exactly one WARNING line ``<worker> (pid P) replaced: ...``.

Real SUB and chip children. A task stuck in ``time.sleep(60)`` is stopped; the test polls
for its end with a deadline rather than timing it.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from simpler_daemon import CallConfig, RunCancelled, Tag, TaskError, Worker
from simpler_daemon.endpoints.base import Outcome
from simpler_daemon.engine.orchestrator import Orchestrator, RunState
from simpler_daemon.testing import alive, poll_for
from tests.support import sub_tasks as tasks
from tests.support.sub_tasks import targs

pytestmark = pytest.mark.timeout(120)

#: Long enough that only a kill ends it within the test.
STUCK_S = 60.0


def stuck(args: Any) -> None:
    """tensors[0][scalars[0]] = pid, then time.sleep(60)."""
    args.tensors[0][args.scalars[0]] = os.getpid()
    time.sleep(STUCK_S)


def stuck_kernel(args: Any, config: Any) -> None:
    """A chip kernel: tensors[0][scalars[0]] = pid, then time.sleep(60)."""
    args.tensors[0][args.scalars[0]] = os.getpid()
    time.sleep(STUCK_S)


def deaf_to_alarms(args: Any) -> None:
    """tensors[0][0] = pid, then sleep with SIGALRM blocked: only the parent's deadline
    kill ends it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    args.tensors[0][0] = os.getpid()
    time.sleep(STUCK_S)


def pid_of(args: Any) -> int:
    """Return the child's pid (a SUB task with a value)."""
    return os.getpid()


def terminate(w: Worker, handle: Any, reason: str = "") -> None:
    """``Worker.cancel(terminate=True)``: the run's cancel, then ``Scheduler.terminate``."""
    w.cancel(handle, terminate=True, reason=reason)


def terminate_counted(w: Worker, handle: Any) -> int:
    """What ``Worker.cancel(terminate=True)`` does, returning ``Scheduler.terminate``'s
    count of stopped tasks."""
    sched = w.scheduler
    assert sched is not None
    with w._driver.lock:
        w._runs.cancel_now(handle.run)
        return sched.terminate(handle.run, "")


def drive_until(w: Worker, cond: Any, timeout: float = 30.0, message: str = "") -> None:
    """Let the Worker make progress until ``cond()`` (blocking API: the caller drives)."""
    if not w._drive_until(cond, timeout):
        raise TimeoutError(message or f"condition not met within {timeout}s")


@pytest.fixture(params=["fifo", "fair"])
def admission(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def worker(admission: str) -> Iterator[Worker]:
    w = Worker(num_sub_workers=2, admission=admission)
    try:
        yield w
    finally:
        w.close()


def _replaced_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_terminate_stops_a_stuck_sub_task_and_the_pool_keeps_serving(
    worker: Worker, admission: str, caplog: pytest.LogCaptureFixture
) -> None:
    w = worker
    hang = w.register(stuck)
    gate = w.register(tasks.wait_flag)
    value = w.register(pid_of)
    w.init()
    caplog.set_level(logging.INFO, logger="simpler_daemon")
    pids = w.alloc(4, "int64")
    flags = w.alloc(1, "int64")
    pids[:] = 0
    flags[0] = 0

    # Under fair both runs dispatch at once; under fifo the other run waits behind the
    # stuck one and is admitted when the terminated run leaves admission.
    stuck_run = w.submit(
        lambda o, a, c: o.submit_sub(hang, targs((pids, Tag.NO_DEP), scalars=(0,)))
    )
    drive_until(w, lambda: pids[0] != 0, message="the stuck task never started")
    other = w.submit(
        lambda o, a, c: o.submit_sub(
            gate, targs((flags, Tag.NO_DEP), (pids, Tag.NO_DEP), scalars=(0, 1, 60_000))
        )
    )
    if admission == "fair":
        drive_until(w, lambda: pids[1] != 0, message="the other run's task never started")
    victim = int(pids[0])
    assert alive(victim)

    terminate(w, stuck_run, "test says stop")
    # SIGKILL of its process group: gone at once (polled, with a generous deadline).
    poll_for(lambda: not alive(victim), timeout=5.0, message=f"pid {victim} still running")
    with pytest.raises(RunCancelled):
        stuck_run.wait(30)
    assert stuck_run.run.state is RunState.FAILED and stuck_run.run.cancelled
    slot = stuck_run.run.slots[0]
    assert slot.failure is not None and slot.failure.outcome is Outcome.CANCELLED
    text = slot.failure.message
    assert re.fullmatch(
        rf"run {stuck_run.run_id} cancelled \(terminate\): task stopped on sub worker \d "
        rf"\(pid {victim}\)",
        text,
    ), text

    # The worker is replaced; the next run succeeds (on the replacement or the other one).
    drive_until(w, lambda: w.restarts.get("sub", 0) == 1, message="the worker was not replaced")
    assert victim not in [c.pid for c in w.children if alive(c.pid)]
    refs: list[Any] = []
    flags[0] = 1  # the other run's task ends now, on its own worker
    other.wait(30)
    if admission == "fair":
        assert int(pids[1]) != victim and alive(int(pids[1]))  # untouched: same child
    for _ in range(2):
        w.run(lambda o, a, c: refs.append(o.submit_sub(value)))
    assert victim not in [r.result() for r in refs]
    assert w.restarts.get("sub", 0) == 1

    lines = _replaced_lines(caplog)
    replaced = [ln for ln in lines if re.match(rf"sub worker \d \(pid {victim}\) replaced: ", ln)]
    assert len(replaced) == 1, lines
    assert "run" in replaced[0] and "cancelled (terminate)" in replaced[0]
    assert "test says stop" in replaced[0]
    assert [ln for ln in lines if str(victim) in ln] == replaced, lines
    w.free(pids)
    w.free(flags)


def test_terminate_a_sub_group_and_task_refs_say_cancelled() -> None:
    w = Worker(num_sub_workers=2, admission="fair")
    try:
        hang = w.register(stuck)
        w.init()
        pids = w.alloc(2, "int64")
        pids[:] = 0
        refs: list[Any] = []

        def orch(o: Orchestrator, _a: Any, _c: Any) -> None:
            refs.append(
                o.submit_sub_group(hang, [targs((pids, Tag.NO_DEP), scalars=(i,)) for i in (0, 1)])
            )

        h = w.submit(orch)
        drive_until(w, lambda: pids[0] != 0 and pids[1] != 0, message="group never started")
        victims = [int(p) for p in pids]
        assert terminate_counted(w, h) == 2
        poll_for(lambda: not any(alive(p) for p in victims), timeout=5.0, message=f"{victims} run")
        with pytest.raises(RunCancelled):
            h.wait(30)
        with pytest.raises(TaskError) as ei:
            refs[0].result()
        assert ei.value.outcome == "CANCELLED"
        assert "cancelled (terminate): task stopped on sub worker" in str(ei.value)
        drive_until(w, lambda: w.restarts.get("sub", 0) == 2, message="not both replaced")
        w.run(lambda o, a, c: o.submit_sub_group(w.register(tasks.noop), [targs(), targs()]))
        w.free(pids)
    finally:
        w.close()


def test_terminate_without_running_tasks_stops_nothing() -> None:
    """A run whose tasks all finished (or never started) has nothing to stop: no kill."""
    w = Worker(num_sub_workers=1)
    try:
        noop = w.register(tasks.noop)
        w.init()
        pid = w.children[0].pid
        h = w.submit(lambda o, a, c: o.submit_sub(noop))
        h.wait(30)
        assert terminate_counted(w, h) == 0
        w.run(lambda o, a, c: o.submit_sub(noop))
        assert w.children[0].pid == pid and w.restarts.get("sub", 0) == 0
    finally:
        w.close()


def test_terminate_stops_a_stuck_chip_kernel(admission: str) -> None:
    """The chip child running the kernel is killed and replaced; another run's task
    staged behind it on the same chip never started: it runs on the replacement."""
    w = Worker(num_sub_workers=1, num_chips=1, heap_bytes=4 << 20, admission=admission)
    try:
        hang = w.register(f"{__name__}:stuck_kernel", kind="chip")
        write = w.register("tests.support.chip_kernels:write_scalar", kind="chip")
        w.init()
        assert w.scheduler is not None
        lane = w.scheduler.manager.next_level[0]
        pids = w.alloc(1, "int64")
        out = w.alloc(1, "int64")
        pids[0] = out[0] = 0
        h = w.submit(
            lambda o, a, c: o.submit_next_level(
                hang, targs((pids, Tag.NO_DEP), scalars=(0,)), worker=0
            )
        )
        drive_until(w, lambda: pids[0] != 0, message="the chip kernel never started")
        other = w.submit(
            lambda o, a, c: o.submit_next_level(
                write, targs((out, Tag.OUTPUT_EXISTING), scalars=(0, 7)), worker=0
            )
        )
        drive_until(w, lambda: lane.staged is not None, message="nothing staged behind")
        victim = int(pids[0])
        assert terminate_counted(w, h) == 1
        poll_for(lambda: not alive(victim), timeout=5.0, message=f"chip pid {victim} runs")
        with pytest.raises(RunCancelled):
            h.wait(30)
        slot = h.run.slots[0]
        assert slot.failure is not None and slot.failure.outcome is Outcome.CANCELLED
        assert f"task stopped on chip 0 (pid {victim})" in slot.failure.message
        other.wait(30)  # staged, never started: run again on the replacement
        assert int(out[0]) == 7
        assert w.restarts.get("chip", 0) == 1
        w.free(pids)
        w.free(out)
    finally:
        w.close()


def test_a_deadline_kill_logs_one_replaced_warning(caplog: pytest.LogCaptureFixture) -> None:
    w = Worker(num_sub_workers=1)
    try:
        deaf = w.register(deaf_to_alarms)
        noop = w.register(tasks.noop)
        w.init()
        caplog.set_level(logging.INFO, logger="simpler_daemon")
        pids = w.alloc(1, "int64")
        pids[0] = 0
        config = CallConfig(deadline_ms=100)
        h = w.submit(lambda o, a, c: o.submit_sub(deaf, targs((pids, Tag.NO_DEP)), config))
        with pytest.raises(TaskError, match="deadline exceeded"):
            h.wait(30)
        victim = int(pids[0])
        drive_until(w, lambda: w.restarts.get("sub", 0) == 1, message="not replaced")
        w.run(lambda o, a, c: o.submit_sub(noop))
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert [ln for ln in lines if str(victim) in ln] == [
            f"sub worker 0 (pid {victim}) replaced: deadline exceeded (100 ms); new pid "
            f"{w.children[-1].pid}"
        ], lines
        w.free(pids)
    finally:
        w.close()


def test_terminate_stops_a_nested_l3_task() -> None:
    """A NEXT_LEVEL task on a local L3 child: the L3 child is killed (its SUB grandchild
    with it) and replaced with its subtree; the next run works."""
    from tests.support.nested_rig import forward, l3_worker, l4_worker
    from tests.support.sub_tasks import sub_fill

    l3 = l3_worker()
    hang = l3.register(stuck)
    fill = l3.register(sub_fill)
    w4 = l4_worker()
    try:
        i = w4.add_worker(l3)
        orch_hang = w4.register(forward(hang))
        orch_fill = w4.register(forward(fill))
        w4.init()
        pids = w4.alloc(1, "int64")
        pids[0] = 0

        def hang_run(o: Orchestrator, _a: Any, _c: Any) -> None:
            o.submit_next_level(orch_hang, targs((pids, Tag.INOUT), scalars=(0,)), worker=i)

        h = w4.submit(hang_run)
        drive_until(w4, lambda: pids[0] != 0, message="the grandchild task never started")
        grandchild = int(pids[0])
        l3_pid = next(r["pid"] for r in w4.list_workers() if r["kind"] == "l3")
        assert terminate_counted(w4, h) == 1
        poll_for(
            lambda: not alive(grandchild) and not alive(l3_pid),
            timeout=10.0,
            message="the L3 child or its SUB grandchild still runs",
        )
        with pytest.raises(RunCancelled):
            h.wait(30)
        slot = h.run.slots[0]
        assert slot.failure is not None and slot.failure.outcome is Outcome.CANCELLED
        assert f"(pid {l3_pid})" in slot.failure.message
        out = w4.alloc(4, "float32")
        w4.run(
            lambda o, a, c: o.submit_next_level(
                orch_fill, targs((out, Tag.INOUT), scalars=(3,)), worker=i
            )
        )
        assert out.tolist() == [3.0] * 4
        assert w4.restarts.get("l3", 0) == 1
    finally:
        w4.close(timeout=5.0)


def test_the_run_error_of_a_terminate_says_cancelled_with_the_reason_and_the_task(
    worker: Worker,
) -> None:
    w = worker
    hang = w.register(stuck)
    value = w.register(pid_of)
    w.init()
    pids = w.alloc(2, "int64")
    pids[:] = 0
    h = w.submit(lambda o, a, c: o.submit_sub(hang, targs((pids, Tag.NO_DEP), scalars=(0,))))
    drive_until(w, lambda: pids[0] != 0, message="the stuck task never started")
    victim = int(pids[0])
    w.cancel(h, terminate=True, reason="stop it")
    with pytest.raises(RunCancelled) as info:
        h.result(timeout=30)
    err = info.value
    assert err.outcome == Outcome.CANCELLED.name, err.outcome
    assert err.pid == victim and err.worker_id is not None and err.hashid == hang.hashid
    text = str(err)
    assert text.startswith(f"run {h.run_id} cancelled: stop it"), text
    assert re.search(
        rf"run {h.run_id} cancelled \(terminate\): task stopped on sub worker \d "
        rf"\(pid {victim}\)",
        text,
    ), text
    assert "stop it" in err.remote_text and "(terminate)" in err.remote_text, err.remote_text
    # A plain cancel says CANCELLED and its reason too.
    plain = w.submit(lambda o, a, c: o.submit_sub(hang, targs((pids, Tag.NO_DEP), scalars=(1,))))
    drive_until(w, lambda: pids[1] != 0, message="the second task never started")
    w.cancel(plain, reason="no longer needed")
    w.cancel(plain, terminate=True)  # a second cancel: stops the task, keeps the reason
    with pytest.raises(RunCancelled) as info:
        plain.result(timeout=30)
    assert info.value.outcome == Outcome.CANCELLED.name
    assert str(info.value).startswith(f"run {plain.run_id} cancelled: no longer needed")
    assert w.submit(lambda o, a, c: o.submit_sub(value)).result(timeout=30)[0] > 0
    w.free(pids)
