"""Replacing dead children through the fork server (chaos: SIGKILL idle and busy workers)."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from simpler_daemon import TaskArgs, TaskError, Worker
from simpler_daemon.args import Tag
from simpler_daemon.testing import poll_for

pytestmark = pytest.mark.timeout(60)


def record_pid(args: Any) -> None:
    args.tensors[0][args.scalars[0]] = os.getpid()


def wait_forever(args: Any) -> None:
    import time

    if args.tensors:  # say it runs (its pid), so the test kills it only once it has
        args.tensors[0][0] = os.getpid()
    while True:
        time.sleep(0.05)


def _pids(w: Worker, kind: str = "sub") -> list[int]:
    return [info["pid"] for info in w.list_workers() if info["kind"] == kind]


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _replaced(w: Worker, kind: str, count: int) -> bool:
    w.run(lambda o, a, c: None)  # drive the Scheduler: it notices deaths and replaces
    return w.restarts[kind] >= count


def test_idle_worker_killed_is_replaced_and_never_dispatched_to() -> None:
    with Worker(num_sub_workers=2) as w:
        h = w.register(record_pid)
        out = w.alloc((64,), "int64")
        old = _pids(w)
        _kill(old[0])
        poll_for(lambda: _replaced(w, "sub", 1), timeout=20, message="worker 0 not replaced")
        new = _pids(w)
        assert new[0] != old[0] and new[1] == old[1]
        assert w.list_workers()[0]["restarts"] == 1

        def orch(o: Any, args: Any, config: Any) -> None:
            for i in range(64):
                o.submit_sub(h, TaskArgs().add_tensor(out[i : i + 1], Tag.OUTPUT).add_scalar(0))

        w.run(orch)
        assert set(out.tolist()) <= set(new) and old[0] not in out.tolist()


def test_worker_killed_mid_task_fails_that_run_then_comes_back_with_late_registrations() -> None:
    with Worker(num_sub_workers=2) as w:
        hang = w.register(wait_forever)  # after init, like `late`: both are broadcast
        late = w.register(record_pid)  # and must be replayed into the replacement
        out = w.alloc((2,), "int64")
        running = w.alloc((1,), "int64")
        running[0] = 0
        handle = w.submit(
            lambda o, a, c: o.submit_sub(hang, TaskArgs().add_tensor(running, Tag.OUTPUT))
        )
        # Killed once it runs: a child killed before it picked the task up would not fail
        # it (the task runs on the other child instead, tests/faults/test_pickup_requeue.py).
        poll_for(lambda: running[0] != 0, timeout=20, message="the task never started")
        busy = [int(running[0])]
        _kill(busy[0])
        with pytest.raises(TaskError) as info:
            handle.wait(20)
        assert info.value.outcome == "ENDPOINT_FAILURE" and str(busy[0]) in str(info.value)
        poll_for(lambda: _replaced(w, "sub", 1), timeout=20, message="busy worker not replaced")

        def group(o: Any, args: Any, config: Any) -> None:
            o.submit_sub_group(
                late,
                [TaskArgs().add_tensor(out, Tag.NO_DEP).add_scalar(i) for i in range(2)],
            )

        w.run(group)  # both workers, including the replacement, know `late`
        assert sorted(out.tolist()) == sorted(_pids(w)) and busy[0] not in out.tolist()


def test_without_restart_sub_tasks_fail_once_no_worker_is_left() -> None:
    with Worker(num_sub_workers=1, restart_children=False) as w:
        h = w.register(record_pid)
        out = w.alloc((1,), "int64")
        (pid,) = _pids(w)
        _kill(pid)
        poll_for(
            lambda: w.run(lambda o, a, c: None) or not w.list_workers()[0]["alive"], timeout=10
        )
        with pytest.raises(TaskError, match="no live SUB worker"):
            w.run(
                lambda o, a, c: o.submit_sub(
                    h, TaskArgs().add_tensor(out, Tag.OUTPUT).add_scalar(0)
                )
            )
        assert w.restarts == {"sub": 0, "chip": 0}


def test_chip_child_is_replaced_and_runs_kernels_again() -> None:
    with Worker(num_sub_workers=1, num_chips=1) as w:
        k = w.register("tests.support.chip_kernels:record_pid", kind="chip")
        out = w.alloc((1,), "int64")
        (old,) = _pids(w, "chip")
        _kill(old)
        poll_for(lambda: _replaced(w, "chip", 1), timeout=20, message="chip not replaced")
        w.run(
            lambda o, a, c: o.submit_next_level(k, TaskArgs().add_tensor(out, Tag.OUTPUT), worker=0)
        )
        (new,) = _pids(w, "chip")
        assert new != old and out[0] == new
