"""LocalMailboxEndpoint against a real forked SUB child: the single-frame task path,
controls, the stop sequence and poisoning (docs/mailbox.md).

Each test builds heap, doorbell, mailbox, child and endpoint by hand (``Rig``),
without the Scheduler, and tears them down in ``Rig.close``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import cloudpickle
import numpy as np
import pytest

from simpler_daemon.args import CallConfig
from simpler_daemon.callables import spec_for_import, spec_for_object
from simpler_daemon.endpoints.base import EndpointEvent, EventKind, Outcome, WorkerDispatch
from simpler_daemon.endpoints.local import LocalMailboxEndpoint
from simpler_daemon.errors import ControlError, EndpointError
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.layout import (
    BASE_FRAME,
    ERR_NOT_REGISTERED,
    ERR_TASK,
    MAILBOX_ARGS_CAPACITY,
    OFF_TRAILER,
    PROTOCOL,
    TASK_FRAMES,
    ControlOp,
    MailboxState,
)
from simpler_daemon.testing import poll_for
from tests.support import sub_tasks as H
from tests.support.endpoint_rig import EMPTY_BLOB, Gate, Rig, blob_for, completed, settle

pytestmark = pytest.mark.timeout(30)

SPECS = {
    name: spec_for_object(getattr(H, name))
    for name in ("noop", "store_scalar", "raise_value_error", "gate", "record_pid_first", "add_one")
}


def digest(name: str) -> bytes:
    return SPECS[name].handle.digest


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig(list(SPECS.values()))
    try:
        yield r
    finally:
        r.close()


# -- task path ---------------------------------------------------------------------------------


def test_task_in_task_frame_0_completes_with_success(rig: Rig) -> None:
    ep = rig.endpoint
    assert ep.caps.task_frame_count == 1 and not ep.caps.supports_frame_staging
    pid = rig.heap.alloc(1, "int64")
    d = rig.submit(
        digest("record_pid_first"), blob_for(rig.heap, [pid]), run_id=7, lease_generation=3
    )
    assert ep.owned() == 1
    # Published into task frame 0 (region frame 1); the base frame never carries a task.
    assert _mb.read_trailer(rig.mailbox.buf, TASK_FRAMES[0]) == (
        PROTOCOL,
        7,
        d.task_slot.slot_id,
        3,
        d.dispatch_id,
    )
    assert _mb.read_task(rig.mailbox.buf, TASK_FRAMES[0])[3] == digest("record_pid_first")
    assert rig.mailbox.state(BASE_FRAME) == MailboxState.IDLE
    assert rig.mailbox.state(TASK_FRAMES[1]) == MailboxState.IDLE
    events: list[EndpointEvent] = []
    ev = rig.wait_completed(events=events)
    assert [e.kind for e in events] == [
        EventKind.ACCEPTED,
        EventKind.COMPLETED,
    ]  # accepted once, before
    assert ev.dispatch is d and ev.outcome is Outcome.SUCCESS and ev.error == 0 and ev.message == ""
    assert pid[0] == rig.child.pid  # type: ignore[union-attr]
    assert rig.mailbox.state(TASK_FRAMES[0]) == MailboxState.IDLE  # parent returned the frame
    assert ep.owned() == 0 and ep.tasks_completed == 1 and not ep.poisoned
    assert rig.mailbox.state(TASK_FRAMES[1]) == MailboxState.IDLE


@pytest.mark.timeout(60)
def test_2000_tasks_payload_visible_before_state(rig: Rig) -> None:
    """Each task writes a distinct scalar into a heap tensor; at the moment the parent
    observes completion the child's write (and the parent's payload) must be visible."""
    ep = rig.endpoint
    cells = rig.heap.alloc(2000, "uint64")
    cell = rig.heap.alloc(1, "uint64")
    d_store = digest("store_scalar")
    events: list[EndpointEvent] = []
    deadline = time.monotonic() + 50.0
    for i in range(2000):
        value = (0x9E3779B97F4A7C15 * (i + 1)) & ((1 << 64) - 1)
        target, index = (cells, i) if i % 2 else (cell, 0)
        d = rig.submit(d_store, blob_for(rig.heap, [target], [value, index]))
        while True:
            ep.poll_progress(events)
            if events and events[-1].kind is EventKind.COMPLETED:
                break
            assert time.monotonic() < deadline, f"task {i} did not complete"
            os.sched_yield()  # on a loaded machine, let the child have the core
        ev = events[-1]
        assert ev.dispatch is d and ev.outcome is Outcome.SUCCESS, (i, ev.message)
        assert int(target[index]) == value, (
            f"task {i}: wrote {value:#x}, parent sees {int(target[index]):#x}"
        )
        events.clear()
    assert ep.tasks_completed == 2000 and not ep.poisoned
    odd = np.arange(1, 2000, 2, dtype=np.uint64)
    np.testing.assert_array_equal(cells[1::2], (odd + 1) * np.uint64(0x9E3779B97F4A7C15))


def test_raising_callable_is_task_failure_and_endpoint_keeps_serving(rig: Rig) -> None:
    ev = rig.run(digest("raise_value_error"), blob_for(rig.heap, [], [7]))
    assert ev.outcome is Outcome.TASK_FAILURE and ev.error == ERR_TASK
    assert ev.message.startswith("sub_worker: ValueError: bad value 7\n")
    assert "Traceback (most recent call last)" in ev.message
    assert "in raise_value_error" in ev.message  # the traceback names the callable's frame
    assert len(ev.message) > 256  # the full text, not just the 256-byte field
    assert not rig.endpoint.poisoned
    # ... and the endpoint keeps serving.
    x = rig.heap.alloc(3, "int32")
    for _ in range(3):
        assert rig.run(digest("add_one"), blob_for(rig.heap, [x])).outcome is Outcome.SUCCESS
    np.testing.assert_array_equal(x, [3, 3, 3])


def test_unknown_digest_fails_the_task(rig: Rig) -> None:
    unknown = bytes.fromhex("5a" * 32)
    ev = rig.run(unknown)
    assert ev.outcome is Outcome.TASK_FAILURE and ev.error == ERR_NOT_REGISTERED
    assert ev.message == f"callable hash sha256:{'5a' * 32} not registered"
    assert rig.run(digest("noop")).outcome is Outcome.SUCCESS


def test_submit_refusals(rig: Rig) -> None:
    ep = rig.endpoint
    gate = Gate(rig.heap)
    d1 = rig.submit(digest("gate"), gate.blob)
    with pytest.raises(
        EndpointError,
        match=rf"sub worker 0 \(pid \d+\): task frame 0 is owned by dispatch {d1.dispatch_id}",
    ):
        rig.submit(digest("noop"))
    with pytest.raises(EndpointError, match="single task frame"):
        ep.submit_progress(
            WorkerDispatch(rig.dispatch(digest("noop")).task_slot, 0, 99, prepare_only=True)
        )
    assert ep.owned() == 1 and not ep.poisoned
    gate.release()
    assert rig.wait_completed().outcome is Outcome.SUCCESS


def test_args_blob_over_capacity_is_refused_with_both_sizes(rig: Rig) -> None:
    big = b"\0" * (MAILBOX_ARGS_CAPACITY + 8)
    with pytest.raises(EndpointError) as ei:
        rig.submit(digest("noop"), big)
    msg = str(ei.value)
    assert "sub worker 0" in msg
    assert f"{MAILBOX_ARGS_CAPACITY + 8} bytes" in msg and f"{MAILBOX_ARGS_CAPACITY} bytes" in msg
    assert rig.endpoint.owned() == 0 and not rig.endpoint.poisoned
    assert rig.mailbox.state(TASK_FRAMES[0]) == MailboxState.IDLE
    assert rig.run(digest("noop")).outcome is Outcome.SUCCESS


# -- poisoning ---------------------------------------------------------------------------------


@pytest.mark.chaos
def test_sigkill_mid_task_gives_one_endpoint_failure_after_exit(rig: Rig) -> None:
    ep, child = rig.endpoint, rig.child
    assert child is not None
    gate = Gate(rig.heap)
    d = rig.submit(digest("gate"), gate.blob)
    poll_for(gate.started, 10.0)
    os.kill(child.pid, signal.SIGKILL)

    seen_exit: list[bool] = []

    def at_event(events: list[EndpointEvent]) -> None:
        if completed(events) and not seen_exit:
            seen_exit.append(child.exited)  # sampled at the moment the event appeared

    events: list[EndpointEvent] = []
    ev = rig.wait_completed(events=events, on_poll=at_event)
    assert seen_exit == [True]
    assert (
        child.status is not None
        and os.WIFSIGNALED(child.status)
        and os.WTERMSIG(child.status) == signal.SIGKILL
    )
    with pytest.raises(ChildProcessError):
        os.waitpid(child.pid, os.WNOHANG)  # already reaped
    assert ev.dispatch is d and ev.outcome is Outcome.ENDPOINT_FAILURE
    assert "killed by SIGKILL" in ev.message and "sub worker 0" in ev.message
    settle(ep, events)
    assert len(completed(events)) == 1  # exactly one
    assert ep.poisoned and ep.owned() == 0
    with pytest.raises(
        EndpointError,
        match=rf"cannot submit to sub worker 0 \(pid {child.pid}\): endpoint poisoned",
    ):
        rig.submit(digest("noop"))
    with pytest.raises(EndpointError, match=r"sub worker 0.*poisoned"):
        ep.begin_control(ControlOp.PING)


@pytest.mark.chaos
@pytest.mark.parametrize("field", ["protocol", "run_id", "slot_id", "generation", "dispatch_id"])
def test_stale_trailer_poisons_and_fails_after_exit(rig: Rig, field: str) -> None:
    ep, child = rig.endpoint, rig.child
    assert child is not None
    gate = Gate(rig.heap)
    d = rig.submit(digest("gate"), gate.blob)
    poll_for(gate.started, 10.0)
    index = ["protocol", "run_id", "slot_id", "generation", "dispatch_id"].index(field)
    off = TASK_FRAMES[0] + OFF_TRAILER + 8 * index
    _mb.store64(rig.mailbox.buf, off, _mb.load64(rig.mailbox.buf, off) + 1000)
    gate.release()  # the child completes the task under a changed identity

    poisoned_before_event: list[bool] = []
    seen_exit: list[bool] = []

    def at_poll(events: list[EndpointEvent]) -> None:
        if ep.poisoned and not poisoned_before_event:
            poisoned_before_event.append(not completed(events))
        if completed(events) and not seen_exit:
            seen_exit.append(child.exited)

    events: list[EndpointEvent] = []
    ev = rig.wait_completed(events=events, on_poll=at_poll)
    assert gate.finished()
    assert seen_exit == [True]  # withheld until the child exited
    assert ev.dispatch is d and ev.outcome is Outcome.ENDPOINT_FAILURE
    assert "stale identity in task frame 0" in ev.message
    assert ep.poison_reason is not None and "stale identity" in ep.poison_reason
    assert rig.mailbox.shutdown_requested()
    settle(ep, events)
    assert len(completed(events)) == 1
    assert [e.outcome for e in completed(events)] == [Outcome.ENDPOINT_FAILURE]
    with pytest.raises(EndpointError, match=r"sub worker 0.*poisoned.*stale identity"):
        rig.submit(digest("noop"))


def test_invalid_frame_state_poisons(rig: Rig) -> None:
    gate = Gate(rig.heap)
    d = rig.submit(digest("gate"), gate.blob)
    poll_for(gate.started, 10.0)
    rig.mailbox.set_state(TASK_FRAMES[0], MailboxState.CONTROL_DONE)  # nonsense for a task frame
    # Observe the nonsense before the child can overwrite it with TASK_DONE.
    early: list[Any] = []
    rig.endpoint.poll_progress(early)
    assert rig.endpoint.poisoned and not early  # withheld until the child has exited
    gate.release()
    ev = rig.wait_completed()
    assert ev.dispatch is d and ev.outcome is Outcome.ENDPOINT_FAILURE
    assert "invalid state 5 in task frame 0" in ev.message
    assert rig.child is not None and rig.child.exited


def test_publication_into_non_idle_frame_poisons(rig: Rig) -> None:
    rig.mailbox.set_state(TASK_FRAMES[0], MailboxState.TASK_DONE)  # someone else's leftovers
    with pytest.raises(EndpointError, match="not idle"):
        rig.submit(digest("noop"))
    assert rig.endpoint.poisoned and "non-idle" in (rig.endpoint.poison_reason or "")
    assert rig.mailbox.shutdown_requested()


def test_poisoned_endpoint_kills_a_child_that_does_not_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A poisoned endpoint waits for the exit; a child that never exits is killed."""
    import simpler_daemon.endpoints.local as local

    monkeypatch.setattr(local, "POISON_KILL_AFTER", 0.1)
    with Rig([SPECS["gate"]]) as rig:
        gate = Gate(rig.heap)
        d = rig.submit(digest("gate"), gate.blob)
        poll_for(gate.started, 10.0)
        rig.endpoint.poison("injected by the test")  # the child sits in a task that never ends
        ev = rig.wait_completed()
        assert ev.dispatch is d and ev.outcome is Outcome.ENDPOINT_FAILURE
        assert "injected by the test" in ev.message
        assert rig.child is not None and os.WTERMSIG(rig.child.status or 0) == signal.SIGKILL


# -- controls ----------------------------------------------------------------------------------


def test_ping_and_stats(rig: Rig) -> None:
    ep = rig.endpoint
    res = ep.control_sync(ControlOp.PING, timeout=5.0)
    assert res.result0 == rig.child.pid and res.result1 == 0  # type: ignore[union-attr]
    rig.run(digest("noop"))
    rig.run(digest("noop"))
    assert ep.control_sync(ControlOp.PING).result1 == 2
    stats = ep.control_sync(ControlOp.STATS)
    assert (stats.result0, stats.result1) == (2, len(SPECS))
    assert rig.mailbox.state(BASE_FRAME) == MailboxState.IDLE and not ep.control_busy


def test_control_is_single_flight(rig: Rig) -> None:
    ep = rig.endpoint
    ep.begin_control(ControlOp.PING)
    with pytest.raises(EndpointError, match="PING in flight"):
        ep.begin_control(ControlOp.STATS)
    res = poll_for(ep.poll_control, 5.0)
    assert res.result0 == rig.child.pid  # type: ignore[union-attr]
    with pytest.raises(EndpointError, match="no control in flight"):
        ep.poll_control()


def test_register_by_import_path_then_run() -> None:
    with Rig() as rig:  # nothing inherited: every callable arrives by control
        ep = rig.endpoint
        spec = spec_for_import("tests.support.sub_tasks:double")
        x = rig.heap.alloc(4, "float32")
        x[:] = [1, 2, 3, 4]
        before = rig.run(spec.handle.digest, blob_for(rig.heap, [x]))
        assert before.outcome is Outcome.TASK_FAILURE and "not registered" in before.message
        assert (
            ep.control_sync(
                ControlOp.REGISTER_IMPORT, spec.handle.digest, spec.import_path.encode()
            ).result0
            == 0
        )  # type: ignore[union-attr]
        assert rig.run(spec.handle.digest, blob_for(rig.heap, [x])).outcome is Outcome.SUCCESS
        np.testing.assert_array_equal(x, [2, 4, 6, 8])
        # Unregister: the digest no longer resolves; a second unregister is a ControlError.
        ep.control_sync(ControlOp.UNREGISTER, spec.handle.digest)
        after = rig.run(spec.handle.digest, blob_for(rig.heap, [x]))
        assert after.outcome is Outcome.TASK_FAILURE
        assert after.message == f"callable hash {spec.handle.hashid} not registered"
        with pytest.raises(
            ControlError,
            match=rf"unregister failed on child sub worker 0 .*{spec.handle.hashid} not registered",
        ):
            ep.control_sync(ControlOp.UNREGISTER, spec.handle.digest)
        assert not ep.poisoned


def test_register_serialized_payload_then_run() -> None:
    scale = 5

    def local_scale(args: Any) -> None:  # not importable: must travel serialized
        args.tensors[0] *= scale

    spec = spec_for_object(local_scale)
    assert spec.import_path is None and spec.payload is not None
    with Rig() as rig:
        ep = rig.endpoint
        ep.control_sync(ControlOp.REGISTER_SERIALIZED, spec.handle.digest, spec.payload)
        x = rig.heap.alloc(3, "int64")
        x[:] = [1, -2, 3]
        assert rig.run(spec.handle.digest, blob_for(rig.heap, [x])).outcome is Outcome.SUCCESS
        np.testing.assert_array_equal(x, [5, -10, 15])
        assert ep.control_sync(ControlOp.STATS).result1 == 1


@pytest.mark.parametrize(
    ("op", "payload", "match"),
    [
        (
            ControlOp.REGISTER_IMPORT,
            b"tests.helpers_missing:fn",
            "ModuleNotFoundError: No module named 'tests.helpers_missing'",
        ),
        (ControlOp.REGISTER_IMPORT, b"tests.support.sub_tasks:missing", "AttributeError"),
        (ControlOp.REGISTER_IMPORT, b"tests.support.sub_tasks:NOT_A_CALLABLE", "TypeError"),
        (ControlOp.REGISTER_IMPORT, b"os.path", "HASHID_FORMAT_INVALID"),
        (ControlOp.REGISTER_SERIALIZED, b"not a pickle", "UnpicklingError|Error"),
        (ControlOp.REGISTER_SERIALIZED, cloudpickle.dumps(7), "not a callable"),
    ],
)
def test_failing_register_raises_control_error_and_endpoint_stays_healthy(
    rig: Rig, op: ControlOp, payload: bytes, match: str
) -> None:
    ep = rig.endpoint
    with pytest.raises(ControlError, match=match) as ei:
        ep.control_sync(op, b"\x01" * 32, payload, timeout=10.0)
    assert f"{op.name.lower()} failed on child sub worker 0" in str(ei.value)
    assert not ep.poisoned and not ep.control_busy
    assert rig.mailbox.state(BASE_FRAME) == MailboxState.IDLE
    # A following task still runs.
    x = rig.heap.alloc(1, "int64")
    assert rig.run(digest("add_one"), blob_for(rig.heap, [x])).outcome is Outcome.SUCCESS
    assert x[0] == 1
    assert ep.control_sync(ControlOp.PING).result0 == rig.child.pid  # type: ignore[union-attr]


def test_control_payload_over_capacity_is_refused(rig: Rig) -> None:
    with pytest.raises(
        EndpointError,
        match=rf"payload of {MAILBOX_ARGS_CAPACITY + 1} bytes exceeds the control capacity of {MAILBOX_ARGS_CAPACITY} bytes",
    ):
        rig.endpoint.begin_control(
            ControlOp.REGISTER_SERIALIZED, b"", b"x" * (MAILBOX_ARGS_CAPACITY + 1)
        )
    assert not rig.endpoint.control_busy and rig.endpoint.control_sync(ControlOp.PING).result0


def test_control_while_task_active(rig: Rig) -> None:
    """Ordinary controls may run while a task is active; both complete."""
    ep = rig.endpoint
    gate = Gate(rig.heap)
    d = rig.submit(digest("gate"), gate.blob)
    poll_for(gate.started, 10.0)
    ep.begin_control(ControlOp.PING)
    gate.release()
    res = poll_for(ep.poll_control, 10.0)
    assert res.result0 == rig.child.pid  # type: ignore[union-attr]
    ev = rig.wait_completed()
    assert ev.dispatch is d and ev.outcome is Outcome.SUCCESS


def _slow_import_rig(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, sleep: str = "1.0"
) -> tuple[Rig, str]:
    marker = os.path.join(tmp_path, "importing")
    monkeypatch.setenv("SIMPLER_TEST_IMPORT_MARKER", marker)
    monkeypatch.setenv("SIMPLER_TEST_IMPORT_SLEEP", sleep)
    return Rig(), marker


def _begin_slow_register(rig: Rig, marker: str) -> None:
    import sys

    assert "tests.support.slow_import" not in sys.modules  # the parent must never import it
    spec = spec_for_import("tests.support.slow_import:fn")
    rig.endpoint.begin_control(
        ControlOp.REGISTER_IMPORT, spec.handle.digest, spec.import_path.encode()
    )  # type: ignore[union-attr]
    poll_for(lambda: os.path.exists(marker), 10.0, message="child never started the import")


@pytest.mark.chaos
def test_child_stuck_in_control_still_exits_on_shutdown(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig, marker = _slow_import_rig(tmp_path, monkeypatch)
    with rig:
        ep, child = rig.endpoint, rig.child
        assert child is not None
        _begin_slow_register(rig, marker)
        assert ep.poll_control() is None  # still inside the import
        t0 = time.monotonic()
        rig.mailbox.request_shutdown()
        with pytest.raises(
            EndpointError,
            match=r"cannot complete REGISTER_IMPORT: sub worker 0 \(pid \d+\) is shutting down",
        ):
            poll_for(ep.poll_control, 10.0)
        assert not ep.control_busy
        assert child.wait(10.0), "child did not exit after SHUTDOWN"
        assert time.monotonic() - t0 < 5.0
        assert os.WIFEXITED(child.status or 0) and os.WEXITSTATUS(child.status or 0) == 0
        # The CONTROL_DONE the child published late did not overwrite SHUTDOWN.
        assert rig.mailbox.state(BASE_FRAME) == MailboxState.SHUTDOWN


@pytest.mark.chaos
def test_child_death_during_control_poisons(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rig, marker = _slow_import_rig(tmp_path, monkeypatch, sleep="20")
    with rig:
        ep, child = rig.endpoint, rig.child
        assert child is not None
        _begin_slow_register(rig, marker)
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(
            EndpointError,
            match=r"cannot complete REGISTER_IMPORT: child sub worker 0 \(pid \d+\) killed by SIGKILL",
        ):
            poll_for(ep.poll_control, 10.0)
        assert child.exited
        assert ep.poisoned and "during REGISTER_IMPORT" in (ep.poison_reason or "")
        with pytest.raises(EndpointError, match="poisoned"):
            rig.submit(digest("noop"))
        with pytest.raises(EndpointError, match="poisoned"):
            ep.begin_control(ControlOp.PING)


@pytest.mark.chaos
def test_control_timeout_poisons(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rig, _marker = _slow_import_rig(tmp_path, monkeypatch, sleep="20")
    with rig:
        ep = rig.endpoint
        spec = spec_for_import("tests.support.slow_import:fn")
        with pytest.raises(EndpointError, match=r"REGISTER_IMPORT on sub worker 0 .* timed out"):
            ep.control_sync(
                ControlOp.REGISTER_IMPORT,
                spec.handle.digest,
                spec.import_path.encode(),
                timeout=0.2,
            )  # type: ignore[union-attr]
        assert ep.poisoned and "completion uncertain" in (ep.poison_reason or "")
        assert rig.mailbox.shutdown_requested()
        assert rig.child is not None
        rig.child.signal_group(signal.SIGKILL)  # still inside its 20 s import


@pytest.mark.asyncio
async def test_async_control_does_not_block_the_loop(rig: Rig) -> None:
    """While the child is busy, an awaited control leaves the loop free: another
    coroutine keeps running and is the one that finally lets the child answer."""
    import asyncio

    gate = Gate(rig.heap)
    d = rig.submit(digest("gate"), gate.blob)
    poll_for(gate.started, 10.0)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while ticks < 50:
            ticks += 1
            await asyncio.sleep(0.001)
        gate.release()

    t = asyncio.get_running_loop().create_task(ticker())
    res = await rig.endpoint.control(ControlOp.PING, timeout=10.0)
    await t
    assert res.result0 == rig.child.pid  # type: ignore[union-attr]
    assert ticks == 50
    ev = rig.wait_completed()
    assert ev.dispatch is d and ev.outcome is Outcome.SUCCESS


# -- stop --------------------------------------------------------------------------------------


def test_request_stop_refuses_new_work_and_lets_the_running_task_finish(rig: Rig) -> None:
    ep, child = rig.endpoint, rig.child
    assert child is not None
    gate = Gate(rig.heap)
    d = rig.submit(digest("gate"), gate.blob)
    poll_for(gate.started, 10.0)
    ep.request_stop()
    assert rig.mailbox.shutdown_requested()
    with pytest.raises(EndpointError, match=r"sub worker 0 \(pid \d+\): endpoint is stopping"):
        rig.submit(digest("noop"))
    with pytest.raises(EndpointError, match=r"PING to sub worker 0.*stopping"):
        ep.begin_control(ControlOp.PING)
    gate.release()
    ev = rig.wait_completed()
    assert ev.dispatch is d and ev.outcome is Outcome.SUCCESS
    assert child.wait(10.0) and os.WEXITSTATUS(child.status or 0) == 0


class _ExitsWhileSampled:
    """Stands in for the endpoint's ChildProcess: the first ``sample`` lets the child
    finish its task and exit before the liveness check returns (the race in which a
    stopping child completes its last task and leaves between two looks)."""

    def __init__(self, real: Any, release: Any) -> None:
        self.real = real
        self.release = release

    def sample(self, now: float) -> bool:
        if self.release is not None:
            self.release()
            self.release = None
            assert self.real.wait(10.0)
        return bool(self.real.poll())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_task_finished_just_before_a_clean_exit_is_not_lost(rig: Rig) -> None:
    ep = rig.endpoint
    gate = Gate(rig.heap)
    d = rig.submit(digest("gate"), gate.blob)
    poll_for(gate.started, 10.0)
    ep.request_stop()  # the child leaves right after this task
    ep.child = _ExitsWhileSampled(rig.child, gate.release)  # type: ignore[assignment]
    events: list[EndpointEvent] = []
    ev = rig.wait_completed(events=events)
    assert gate.finished()
    assert ev.dispatch is d and ev.outcome is Outcome.SUCCESS, ev.message
    settle(ep, events)
    assert len(completed(events)) == 1
    # The child is gone: nothing more may be published to it.
    with pytest.raises(EndpointError):
        rig.submit(digest("noop"))


def test_task_pending_at_shutdown_is_endpoint_failure(rig: Rig) -> None:
    """A TASK_READY frame the child never started is marked TASK_FAILED on its way out."""
    child = rig.child
    assert child is not None
    gate = Gate(rig.heap)
    rig.submit(digest("gate"), gate.blob)
    poll_for(gate.started, 10.0)
    gate.release()
    rig.wait_completed()
    # Freeze the parked child so the next publication and the shutdown land together:
    # when it resumes, its first look is the shutdown check.
    with rig.frozen_while_parked():
        d = rig.submit(digest("noop"))
        rig.mailbox.request_shutdown()
    ev = rig.wait_completed()
    assert ev.dispatch is d and ev.outcome is Outcome.ENDPOINT_FAILURE
    assert "shut down before running the task" in ev.message
    assert child.wait(10.0)


def test_endpoint_validation() -> None:
    from simpler_daemon.mailbox.layout import Mailbox

    mb = Mailbox()
    try:
        with pytest.raises(ValueError, match="task_frame_count=3"):
            LocalMailboxEndpoint(0, mb, None, task_frame_count=3)
        ep = LocalMailboxEndpoint(4, mb, None)
        assert ep.label == "worker 4" and ep.who() == "worker 4"
        two = LocalMailboxEndpoint(5, mb, None, task_frame_count=2)
        assert two.caps.supports_frame_staging and two.caps.capacity == 2
    finally:
        mb.close()


def test_deadline_config_reaches_the_child(rig: Rig) -> None:
    ev = rig.run(digest("gate"), Gate(rig.heap).blob, config=CallConfig(deadline_ms=100))
    assert ev.outcome is Outcome.TASK_FAILURE
    assert "deadline exceeded (100 ms)" in ev.message
    assert rig.run(digest("noop"), EMPTY_BLOB).outcome is Outcome.SUCCESS
