"""The SUB child loop (start-up, the single-frame task path, stop; docs/mailbox.md) and
the child process plumbing under it (fork, reap, the fork rule; docs/architecture.md)."""

from __future__ import annotations

import os
import re
import signal
import struct
import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from simpler_daemon.args import CallConfig, TensorDesc, encode_args
from simpler_daemon.callables import spec_for_import, spec_for_object
from simpler_daemon.children.process import describe_status, fork_child, reap_all
from simpler_daemon.children.sub import format_exception
from simpler_daemon.endpoints.base import Outcome
from simpler_daemon.endpoints.local import LocalMailboxEndpoint
from simpler_daemon.errors import StartupError, WorkerStateError
from simpler_daemon.heap import Heap
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.layout import (
    BASE_FRAME,
    CTRL_OFF_ARG_LEN,
    ERR_BAD_ARGS,
    ERR_CONTROL,
    ERR_DEADLINE,
    ERR_INIT,
    ERR_SHUTDOWN,
    MAILBOX_ARGS_CAPACITY,
    OFF_RESERVED,
    TASK_FRAMES,
    ControlOp,
    MailboxState,
)
from simpler_daemon.testing import child_pids, leaked_shm, poll_for, shm_files
from tests.support import sub_tasks as H
from tests.support.endpoint_rig import Gate, Rig, blob_for, proc_state

pytestmark = pytest.mark.timeout(30)

SPECS = [spec_for_object(f) for f in (H.noop, H.add_one, H.gate, H.raise_value_error)]
NOOP, ADD_ONE, GATE, RAISE = (s.handle.digest for s in SPECS)


def exit_code(rig: Rig) -> int:
    assert rig.child is not None and rig.child.wait(10.0), "child did not exit"
    status = rig.child.status or 0
    assert os.WIFEXITED(status), rig.child.describe()
    return os.WEXITSTATUS(status)


# -- init ----------------------------------------------------------------------------------------


def test_init_ready_resolves_the_snapshot() -> None:
    with Rig(SPECS) as rig:
        assert rig.endpoint.control_sync(ControlOp.STATS).result1 == len(SPECS)
        assert rig.mailbox.error_text(BASE_FRAME) == ""


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        (
            {"specs": [spec_for_import("tests.helpers_missing:fn")]},
            "sub worker 0 init: ModuleNotFoundError: No module named 'tests.helpers_missing'",
        ),
        (
            {"specs": [spec_for_import("tests.support.sub_tasks:NOT_A_CALLABLE")]},
            "sub worker 0 init: TypeError: tests.support.sub_tasks:NOT_A_CALLABLE is a int, not a callable",
        ),
        (
            {"init_hook": lambda: (_ for _ in ()).throw(RuntimeError("boom"))},
            "sub worker 0 init: RuntimeError: boom",
        ),
    ],
)
def test_init_failure_is_reported_and_the_child_exits(kwargs: dict[str, Any], text: str) -> None:
    specs = kwargs.pop("specs", [])
    with Rig(specs, start=False, **kwargs) as rig:
        rig.fork()
        assert rig.wait_init() == MailboxState.INIT_FAILED
        _state, error, message, *_ = _mb.read_result(rig.mailbox.buf, BASE_FRAME)
        assert error == ERR_INIT and message == text
        assert exit_code(rig) == 1


def test_exit_during_init_leaves_base_frame_idle() -> None:
    with Rig(start=False, init_hook=lambda: os._exit(3)) as rig:
        rig.fork()
        assert rig.wait_init() == -1
        assert rig.mailbox.state(BASE_FRAME) == MailboxState.IDLE
        assert exit_code(rig) == 3
        assert rig.child is not None and "exited with code 3" in rig.child.describe()


def test_shutdown_requested_during_init_survives_init_ready() -> None:
    """INIT_READY overwrites the base state; the sticky shutdown word does not lose the
    request, and a task published meanwhile is failed, never run."""
    with Rig(SPECS, start=False) as rig:
        hook = rig.heap.alloc(2, "int64")  # [0] child in hook, [1] parent releases it

        def hold_init() -> None:
            hook[0] = 1
            deadline = time.monotonic() + 10
            while hook[1] == 0 and time.monotonic() < deadline:
                time.sleep(0.0005)

        rig.ctx.init_hook = hold_init
        rig.fork()
        poll_for(lambda: hook[0] == 1, 10.0)
        rig._endpoint = LocalMailboxEndpoint(0, rig.mailbox, rig.child, label=rig.label)
        x = rig.heap.alloc(1, "int64")
        d = rig.submit(ADD_ONE, blob_for(rig.heap, [x]))
        rig.mailbox.request_shutdown()
        hook[1] = 1
        ev = rig.wait_completed()
        assert (
            ev.dispatch is d and ev.outcome is Outcome.ENDPOINT_FAILURE and ev.error == ERR_SHUTDOWN
        )
        assert ev.message == "sub worker 0 shut down before running the task"
        assert x[0] == 0  # never ran
        assert rig.mailbox.state(BASE_FRAME) == MailboxState.INIT_READY  # the state was lost ...
        assert exit_code(rig) == 0  # ... the request was not


# -- loop order ----------------------------------------------------------------------------------


def test_task_frame_is_served_before_a_control_request() -> None:
    with Rig(SPECS) as rig:
        x = rig.heap.alloc(1, "int64")
        with rig.frozen_while_parked():
            d = rig.submit(ADD_ONE, blob_for(rig.heap, [x]))
            rig.endpoint.begin_control(ControlOp.PING)
        res = poll_for(rig.endpoint.poll_control, 10.0)
        assert res.result1 == 1  # tasks_done when the control ran: the task went first
        ev = rig.wait_completed()
        assert ev.dispatch is d and ev.outcome is Outcome.SUCCESS and x[0] == 1


def test_shutdown_is_checked_before_a_control_request() -> None:
    with Rig(SPECS) as rig:
        with rig.frozen_while_parked():
            rig.endpoint.begin_control(ControlOp.PING)
            rig.mailbox.request_shutdown()
        assert exit_code(rig) == 0
        assert rig.mailbox.state(BASE_FRAME) == MailboxState.SHUTDOWN  # never CONTROL_DONE


def test_child_exits_on_its_own_when_the_parent_is_gone() -> None:
    """The idle path checks the parent pid after a timed-out park (here: a parent pid
    that is not ours stands for a dead parent)."""
    with Rig(SPECS, parent_pid=1, park_timeout=0.01) as rig:
        assert exit_code(rig) == 0
    with Rig(SPECS, park_timeout=0.01) as rig:  # the real parent: stays
        time.sleep(0.1)  # ten park timeouts
        assert rig.child is not None and not rig.child.poll()
        assert rig.endpoint.control_sync(ControlOp.PING).result0 == rig.child.pid


# -- task failures -------------------------------------------------------------------------------


def test_deadline_stops_the_task_and_is_disarmed_afterwards() -> None:
    with Rig(SPECS) as rig:
        ev = rig.run(GATE, Gate(rig.heap).blob, config=CallConfig(deadline_ms=50))
        assert ev.outcome is Outcome.TASK_FAILURE and ev.error == ERR_DEADLINE
        assert ev.message.startswith("sub_worker: deadline exceeded (50 ms)\n")
        assert "DeadlineExceeded" in ev.message
        # A task with a deadline that finishes in time leaves no timer armed ...
        assert rig.run(NOOP, config=CallConfig(deadline_ms=100)).outcome is Outcome.SUCCESS
        # ... so a later task without a deadline may run past it.
        gate = Gate(rig.heap)
        d = rig.submit(GATE, gate.blob)
        poll_for(gate.started, 10.0)
        t0 = time.monotonic()
        poll_for(lambda: time.monotonic() - t0 > 0.2, 1.0)
        gate.release()
        ev = rig.wait_completed()
        assert ev.dispatch is d and ev.outcome is Outcome.SUCCESS, ev.message


def _desc_blob(hp: Heap, **changes: Any) -> bytes:
    a = hp.alloc(4, "int32")
    d: TensorDesc = replace(hp.describe(a), **changes)
    return encode_args([d], [])


@pytest.mark.parametrize(
    ("make_blob", "match"),
    [
        (lambda hp: _desc_blob(hp, buffer_offset=1 << 40), "overruns the heap"),
        (lambda hp: _desc_blob(hp, shape=(1 << 20,), strides=(4,)), "overruns the heap"),
        (lambda hp: _desc_blob(hp, dtype=200), "malformed tensor descriptor 0"),
        (lambda hp: struct.pack("<ii", -1, 0), "malformed args blob"),
        (lambda hp: struct.pack("<ii", 0, 1 << 20), "malformed args blob"),
    ],
)
def test_bad_args_fail_the_task_and_the_child_keeps_serving(make_blob: Any, match: str) -> None:
    with Rig(SPECS) as rig:
        ev = rig.run(NOOP, make_blob(rig.heap))
        assert ev.outcome is Outcome.TASK_FAILURE and ev.error == ERR_BAD_ARGS, ev.message
        assert ev.message.startswith("sub_worker: bad args: ")
        assert match in ev.message
        assert rig.child is not None and not rig.child.poll()
        assert rig.run(NOOP).outcome is Outcome.SUCCESS


def test_long_error_text_is_truncated_in_the_field_but_complete_in_the_args_area() -> None:
    with Rig(SPECS) as rig:
        ev = rig.run(RAISE, blob_for(rig.heap, [], [7]))
        head = rig.mailbox.error_text(TASK_FRAMES[0])
        assert len(head.encode()) <= 255 and ev.message.startswith(head)
        assert len(ev.message) > len(head)


def test_format_exception() -> None:
    try:
        raise KeyError("k")
    except KeyError as exc:
        text = format_exception("sub_worker", exc)
    # The class and its bases on the second line: what retry_exceptions matches.
    assert text.startswith(
        "sub_worker: KeyError: 'k'\n"
        "[exception classes: KeyError < LookupError < Exception < BaseException]\n"
        "Traceback (most recent call last)"
    )


# -- raw controls --------------------------------------------------------------------------------


def _raw_control(rig: Rig, op: int, length: int) -> tuple[int, str]:
    buf = rig.mailbox.buf
    _mb.store64(buf, CTRL_OFF_ARG_LEN, length)
    _mb.store64(buf, OFF_RESERVED, op)
    assert _mb.cas32(buf, BASE_FRAME, MailboxState.IDLE, MailboxState.CONTROL_REQUEST)
    _mb.wake_child(buf)
    poll_for(lambda: rig.mailbox.state(BASE_FRAME) == MailboxState.CONTROL_DONE, 10.0)
    _state, error, message, *_ = _mb.read_result(buf, BASE_FRAME)
    rig.mailbox.set_state(BASE_FRAME, MailboxState.IDLE)
    return error, message


def test_unknown_control_op_and_oversized_payload_fail_cleanly() -> None:
    with Rig(SPECS) as rig:
        assert _raw_control(rig, 99, 0) == (ERR_CONTROL, "ValueError: unknown control op 99")
        error, message = _raw_control(rig, ControlOp.REGISTER_IMPORT, MAILBOX_ARGS_CAPACITY + 1)
        assert (
            error == ERR_CONTROL
            and f"control payload length {MAILBOX_ARGS_CAPACITY + 1} exceeds" in message
        )
        assert rig.endpoint.control_sync(ControlOp.PING).result0 == rig.child.pid  # type: ignore[union-attr]


# -- child processes -----------------------------------------------------------------------------


def test_fork_refuses_while_threads_run() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="bystander")
    t.start()
    try:
        with pytest.raises(
            StartupError,
            match=r"cannot fork sub worker 9: the process runs 2 threads \(.*bystander",
        ):
            fork_child(lambda: 0, "sub worker 9")
    finally:
        stop.set()
        t.join()
    assert not child_pids()


def test_child_exit_codes_and_exceptions() -> None:
    ok = fork_child(lambda: 0, "ok")
    code = fork_child(lambda: 7, "seven")

    def raises() -> int:
        raise RuntimeError("child blew up")

    bad = fork_child(raises, "raiser")
    assert reap_all([ok, code, bad], 10.0) == []
    assert [describe_status(c.status or 0) for c in (ok, code, bad)] == [
        "exited with code 0",
        "exited with code 7",
        "exited with code 1",
    ]
    for c in (ok, code, bad):
        c.close()


def test_child_runs_in_its_own_process_group() -> None:
    hp = Heap(4096)
    out = hp.alloc(2, "int64")

    def report() -> int:
        out[0], out[1] = os.getpid(), os.getpgrp()
        return 0

    c = fork_child(report, "pgrp")
    try:
        assert c.wait(10.0)
        assert out[0] == c.pid and out[1] == c.pid
    finally:
        c.close()
        hp.close()


def test_reap_all_kills_a_wedged_child_under_one_deadline() -> None:
    quick = fork_child(lambda: 0, "quick")
    wedged = fork_child(lambda: time.sleep(60) or 0, "wedged")  # type: ignore[func-returns-value]
    t0 = time.monotonic()
    killed = reap_all([quick, wedged], 0.3)
    assert time.monotonic() - t0 < 5.0
    assert killed == [f"wedged (pid {wedged.pid}) did not exit in time and was killed"]
    assert describe_status(wedged.status or 0) == "killed by SIGKILL"
    assert describe_status(quick.status or 0) == "exited with code 0"
    for c in (quick, wedged):
        c.close()


def test_child_dies_with_its_parent() -> None:
    """PR_SET_PDEATHSIG: a grandchild dies when the child that forked it dies."""
    hp = Heap(4096)
    pid_word = hp.alloc(1, "int64")

    def middle() -> int:
        grandchild = fork_child(lambda: time.sleep(60) or 0, "grandchild")  # type: ignore[func-returns-value]
        pid_word[0] = grandchild.pid
        time.sleep(60)
        return 0

    c = fork_child(middle, "middle")
    try:
        poll_for(lambda: pid_word[0] != 0, 10.0)
        gc_pid = int(pid_word[0])
        assert proc_state(gc_pid) in "RS"
        os.kill(c.pid, signal.SIGKILL)
        assert c.wait(10.0)

        def gone() -> bool:
            try:
                return proc_state(gc_pid) in ("Z", "X")
            except (FileNotFoundError, ProcessLookupError):
                return True

        poll_for(gone, 10.0, message="grandchild outlived its parent")
    finally:
        c.signal_group(signal.SIGKILL)
        c.wait(5.0)
        c.close()
        hp.close()


def test_describe_status() -> None:
    assert describe_status(0) == "exited with code 0"
    assert describe_status(3 << 8) == "exited with code 3"
    assert describe_status(signal.SIGSEGV) == "killed by SIGSEGV"
    assert (
        describe_status(0x7F | (signal.SIGSTOP << 8))
        == f"wait status {0x7F | (signal.SIGSTOP << 8)}"
    )


# -- pool startup (Worker.init barrier and rollback) ---------------------------------------------


def _assert_rolled_back(w: Any, shm_before: set[str]) -> None:
    from simpler_daemon.engine.worker import WorkerState

    assert w.state is WorkerState.FAILED
    assert w.children == [] and w.endpoints == [] and w.mailboxes == [] and w.doorbell is None
    assert w.heap.closed
    assert not child_pids(), "a child outlived the failed init"
    # Nothing of ours in /dev/shm (a heap of another test process running beside this one
    # is not ours: leaked_shm leaves it out).
    assert not leaked_shm(shm_before)


def test_worker_init_failed_names_the_worker_and_rolls_back() -> None:
    from simpler_daemon.engine.worker import Worker

    shm_before = shm_files()
    w = Worker(num_sub_workers=2, heap_bytes=1 << 20, startup_timeout=20.0)
    w.register("tests.helpers_missing:fn")
    with pytest.raises(StartupError) as ei:
        w.init()
    msg = str(ei.value)
    assert re.search(
        r"sub worker [01] \(pid \d+\) failed to initialize: sub worker [01] init: ", msg
    ), msg
    assert "ModuleNotFoundError: No module named 'tests.helpers_missing'" in msg
    _assert_rolled_back(w, shm_before)
    with pytest.raises(WorkerStateError, match="worker is FAILED"):
        w.init()
    w.close()


def test_worker_child_exit_during_init_names_the_worker_and_status() -> None:
    from simpler_daemon.engine.worker import Worker

    shm_before = shm_files()
    w = Worker(num_sub_workers=2, heap_bytes=1 << 20, startup_timeout=20.0)
    w._init_hooks[1] = lambda: os._exit(3)
    with pytest.raises(StartupError) as ei:
        w.init()
    msg = str(ei.value)
    assert re.search(r"sub worker 1 \(pid \d+\) exited with code 3 during init", msg), msg
    _assert_rolled_back(w, shm_before)
    w.close()


def test_worker_init_deadline_terminates_the_starting_child(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rollback: the ready child gets SHUTDOWN (exits 0), the one still starting SIGTERM."""
    import simpler_daemon.engine.pool as pool_mod
    import simpler_daemon.engine.worker as worker_mod

    reaped: dict[str, str] = {}
    real_reap_all = pool_mod.reap_all

    def spy(children: list[Any], timeout: float) -> list[str]:
        killed = real_reap_all(children, timeout)
        reaped.update({c.label: describe_status(c.status or 0) for c in children})
        return killed

    monkeypatch.setattr(pool_mod, "reap_all", spy)
    w = worker_mod.Worker(num_sub_workers=2, heap_bytes=1 << 20, startup_timeout=0.5)
    w._init_hooks[0] = lambda: time.sleep(30)
    with pytest.raises(
        StartupError, match=r"sub worker 0 \(pid \d+\) not ready within startup_timeout=0\.5 s"
    ):
        w.init()
    assert reaped == {"sub worker 0": "killed by SIGTERM", "sub worker 1": "exited with code 0"}
    assert not child_pids()
    w.close()
