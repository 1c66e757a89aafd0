"""The chip child loop (``ChipLoop``) driven through a raw two-frame endpoint.

No Scheduler and no Worker: one forked chip child, one ``LocalMailboxEndpoint``
with ``task_frame_count=2``, dispatches built by hand (``endpoint_rig.Slot``).
The lease slot of a dispatch selects its task frame (``lease_slot & 1``), so a
test chooses which frame carries which dispatch id. Ordering is read from the
simulated backend's JSON-lines trace, never from durations.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from simpler_daemon.args import CallConfig
from simpler_daemon.callables import spec_for_chip
from simpler_daemon.endpoints.base import EventKind, Outcome, WorkerDispatch
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.layout import (
    BASE_FRAME,
    ERR_STALE,
    OFF_DISPOSITION,
    OFF_TRAILER,
    TASK_FRAMES,
    ControlOp,
    Disposition,
    MailboxState,
)
from simpler_daemon.testing import poll_for
from tests.support.chip_endpoint_rig import SPECS, ChipRig
from tests.support.endpoint_rig import Slot, blob_for


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[ChipRig]:
    r = ChipRig(tmp_path / "chip-0.jsonl", list(SPECS.values()))
    try:
        yield r.start()
    finally:
        r.close()


# -- launch order and state sequence ----------------------------------------------------------


@pytest.mark.parametrize("frame_of_2", [1, 0], ids=["d2-in-frame-1", "d2-in-frame-0"])
def test_activated_frames_launch_lowest_dispatch_id_first(rig: ChipRig, frame_of_2: int) -> None:
    """Dispatch 2 is published (and staged) before dispatch 1; both are activated
    while the child is stopped, so it sees both ACTIVATEs in one iteration and must
    pick by dispatch id, not by frame index or publication order."""
    d2 = rig.publish("noop", 2, frame=frame_of_2, prepare_only=True)
    d1 = rig.publish("noop", 1, frame=1 - frame_of_2, prepare_only=True)
    staged2 = rig.wait_event(EventKind.FRAME_STAGED, d2)
    staged1 = rig.wait_event(EventKind.FRAME_STAGED, d1)
    # Nothing owned the device: both frames were only validated, nothing launched.
    assert staged1.disposition == staged2.disposition == Disposition.VALIDATED
    assert rig.trace() == []
    assert rig.accepted(0) == rig.accepted(1) == 0
    assert rig.child is not None
    os.kill(rig.child.pid, signal.SIGSTOP)
    try:
        assert rig.ep.activate_progress(2)
        assert rig.ep.activate_progress(1)
        assert rig.state(0) == rig.state(1) == MailboxState.ACTIVATE
    finally:
        os.kill(rig.child.pid, signal.SIGCONT)
    for d in (d1, d2):
        assert rig.wait_event(EventKind.COMPLETED, d).outcome is Outcome.SUCCESS
    assert rig.at("launch", 1) < rig.at("complete", 1) < rig.at("finalize", 1) < rig.at("launch", 2)
    assert rig.count("launch", 1) == rig.count("launch", 2) == 1
    # Acceptance is reported once per dispatch, before its completion.
    for d in (d1, d2):
        assert rig.kinds(d) == [EventKind.FRAME_STAGED, EventKind.ACCEPTED, EventKind.COMPLETED]


@pytest.mark.parametrize("path", ["active", "successor"])
def test_an_immediately_completing_task_still_publishes_task_launched(
    rig: ChipRig, path: str
) -> None:
    """``frame_state`` runs past the launch boundary and copies its own frame's state:
    the child published TASK_LAUNCHED before launching, however short the task."""
    seen = rig.heap.alloc(1, "int64")
    blob = blob_for(rig.heap, [seen], [0])
    if path == "active":
        d = rig.publish("frame_state", 1, frame=0, blob=blob)
    else:
        d = rig.publish("frame_state", 1, frame=0, blob=blob, prepare_only=True)
        rig.wait_event(EventKind.FRAME_STAGED, d)
        assert rig.state(0) == MailboxState.FRAME_STAGED and rig.accepted(0) == 0
        assert rig.ep.activate_progress(1)
    done = rig.wait_event(EventKind.COMPLETED, d)
    assert done.outcome is Outcome.SUCCESS, done.message
    assert int(seen[0]) == MailboxState.TASK_LAUNCHED
    assert (
        rig.at("prepare", 1) < rig.at("launch", 1) < rig.at("complete", 1) < rig.at("finalize", 1)
    )
    assert rig.accepted(0) == 1  # the backend crossed the launch boundary
    kinds = rig.kinds(d)
    assert kinds.index(EventKind.ACCEPTED) < kinds.index(EventKind.COMPLETED)
    assert kinds.count(EventKind.ACCEPTED) == 1


def test_the_child_never_launches_a_successor_before_the_predecessor_finalized(
    rig: ChipRig,
) -> None:
    """A successor activated early (while the predecessor runs) waits for its finalize."""
    g = rig.gate()
    d1 = rig.publish("gate", 1, frame=0, blob=g.blob)
    poll_for(g.started, 10.0, message="gate kernel never started")
    d2 = rig.publish("noop", 2, frame=1, prepare_only=True)
    staged = rig.wait_event(EventKind.FRAME_STAGED, d2)
    poll_for(
        lambda: (
            _mb.load32(rig.mailbox.buf, TASK_FRAMES[1] + OFF_DISPOSITION) == Disposition.PREPARED
        ),
        10.0,
        message="successor never natively prepared",
    )
    assert staged.disposition in (Disposition.VALIDATED, Disposition.PREPARED)
    assert rig.ep.activate_progress(2)  # sticky: published by CAS as soon as it is staged
    poll_for(lambda: rig.state(1) == MailboxState.ACTIVATE, 5.0)
    rig.poll()
    assert rig.accepted(1) == 0 and ("launch", 2) not in rig.trace()
    assert not g.finished()
    g.release()
    for d in (d1, d2):
        assert rig.wait_event(EventKind.COMPLETED, d).outcome is Outcome.SUCCESS
    assert rig.at("prepare", 2) < rig.at("complete", 1)  # natively prepared during run 1
    assert rig.at("finalize", 1) < rig.at("launch", 2)
    assert rig.accepted(1) == 1


# -- failures before launch ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kernel", "text"),
    [
        ("fail_prepare", "injected prepare failure"),
        ("fail_launch", "injected launch failure"),
    ],
)
def test_prepare_or_launch_failure_is_task_failed_unaccepted_and_finalized_once(
    rig: ChipRig, kernel: str, text: str
) -> None:
    d = rig.publish(kernel, 1, frame=0)
    poll_for(
        lambda: rig.state(0) == MailboxState.TASK_FAILED, 10.0, message="frame never TASK_FAILED"
    )
    assert rig.accepted(0) == 0
    done = rig.wait_event(EventKind.COMPLETED, d)
    assert done.outcome is Outcome.TASK_FAILURE
    assert text in done.message
    assert rig.accepted(0) == 0  # the completion-time acceptance fallback never sets the word
    assert rig.count("finalize", 1) == 1
    assert rig.count("launch", 1) == 0
    assert not rig.ep.poisoned
    # The endpoint and the child stay usable.
    d2 = rig.publish("noop", 2, frame=0)
    assert rig.wait_event(EventKind.COMPLETED, d2).outcome is Outcome.SUCCESS


def test_a_kernel_failure_after_launch_is_accepted_and_finalized_once(rig: ChipRig) -> None:
    d = rig.publish("boom", 1, frame=1)
    done = rig.wait_event(EventKind.COMPLETED, d)
    assert done.outcome is Outcome.TASK_FAILURE and "kernel exploded" in done.message
    assert rig.accepted(1) == 1
    assert rig.count("launch", 1) == 1 and rig.count("finalize", 1) == 1


def test_an_injected_poll_failure_finalizes_the_launched_token_once(rig: ChipRig) -> None:
    d = rig.publish("fail_poll", 1, frame=0)
    done = rig.wait_event(EventKind.COMPLETED, d)
    assert done.outcome is Outcome.TASK_FAILURE and "injected poll failure" in done.message
    assert rig.count("launch", 1) == 1 and rig.count("finalize", 1) == 1


def test_a_staged_successor_whose_prepare_fails_never_launches_and_the_active_task_succeeds(
    rig: ChipRig,
) -> None:
    g = rig.gate()
    d1 = rig.publish("gate", 1, frame=0, blob=g.blob)
    poll_for(g.started, 10.0, message="gate kernel never started")
    d2 = rig.publish("fail_prepare", 2, frame=1, prepare_only=True)
    done2 = rig.wait_event(EventKind.COMPLETED, d2)
    assert done2.outcome is Outcome.TASK_FAILURE and "injected prepare failure" in done2.message
    assert rig.accepted(1) == 0
    assert not g.finished()  # failed while the predecessor still ran
    g.release()
    assert rig.wait_event(EventKind.COMPLETED, d1).outcome is Outcome.SUCCESS
    assert rig.count("prepare", 2) == rig.count("finalize", 2) == 1
    assert rig.count("launch", 2) == 0


# -- stale activation ----------------------------------------------------------------------------


def test_stale_activation_fails_only_the_successor(rig: ChipRig) -> None:
    """The staged frame's trailer changes before ACTIVATE: the child re-validates it,
    fails the successor ("stale activation identity", finalized, never launched),
    and the active task still succeeds. The parent's record is changed the same way
    so that its own completion-time identity check agrees (no poisoning)."""
    g = rig.gate()
    d1 = rig.publish("gate", 1, frame=0, blob=g.blob)
    poll_for(g.started, 10.0, message="gate kernel never started")
    d2 = rig.publish("noop", 2, frame=1, prepare_only=True)
    rig.wait_event(EventKind.FRAME_STAGED, d2)
    poll_for(lambda: rig.count("prepare", 2) == 1, 10.0)
    gen_off = (
        TASK_FRAMES[1] + OFF_TRAILER + 3 * 8
    )  # trailer: protocol, run, slot, generation, dispatch
    assert _mb.load64(rig.mailbox.buf, gen_off) == d2.task_slot.lease_generation
    _mb.store64(rig.mailbox.buf, gen_off, 99)
    d2.task_slot.lease_generation = 99
    assert rig.ep.activate_progress(2)
    done2 = rig.wait_event(EventKind.COMPLETED, d2)
    assert done2.outcome is Outcome.TASK_FAILURE
    assert done2.error == ERR_STALE
    assert "stale activation identity" in done2.message
    assert not rig.ep.poisoned
    assert not g.finished()
    g.release()
    assert rig.wait_event(EventKind.COMPLETED, d1).outcome is Outcome.SUCCESS
    assert rig.count("launch", 2) == 0
    assert rig.count("finalize", 2) == 1
    assert rig.count("launch", 1) == rig.count("finalize", 1) == 1


# -- shutdown --------------------------------------------------------------------------------------


def test_shutdown_finalizes_the_active_run_and_fails_the_staged_one_unlaunched(
    rig: ChipRig,
) -> None:
    g = rig.gate()
    d1 = rig.publish("gate", 1, frame=0, blob=g.blob)
    poll_for(g.started, 10.0, message="gate kernel never started")
    d2 = rig.publish("noop", 2, frame=1, prepare_only=True)
    rig.wait_event(EventKind.FRAME_STAGED, d2)
    poll_for(lambda: rig.count("prepare", 2) == 1, 10.0)
    rig.ep.request_stop()
    # Both frames terminalize while the kernel is still held.
    poll_for(
        lambda: rig.state(0) == rig.state(1) == MailboxState.TASK_FAILED,
        10.0,
        message="frames not failed on shutdown",
    )
    assert rig.accepted(1) == 0
    assert not g.finished()
    done = {d.dispatch_id: rig.wait_event(EventKind.COMPLETED, d) for d in (d1, d2)}
    g.release()
    for ev in done.values():
        assert ev.outcome is Outcome.ENDPOINT_FAILURE
        assert "shut down" in ev.message
    assert rig.count("finalize", 1) == 1 and rig.count("finalize", 2) == 1
    assert rig.count("launch", 2) == 0
    fin = {r["dispatch_id"]: r for r in rig.records() if r["event"] == "finalize"}
    assert fin[1]["launched"] is True and fin[2]["launched"] is False
    assert rig.child is not None and rig.child.wait(10.0)


# -- controls --------------------------------------------------------------------------------------


def test_a_registry_control_waits_for_native_state_while_ping_answers_at_once(rig: ChipRig) -> None:
    g = rig.gate()
    d1 = rig.publish("gate", 1, frame=0, blob=g.blob)
    poll_for(g.started, 10.0, message="gate kernel never started")
    res = rig.ep.control_sync(ControlOp.PING, timeout=10.0)
    assert rig.child is not None and res.result0 == rig.child.pid
    assert not g.finished()
    spec = spec_for_chip("tests.support.chip_kernels:add_one")
    rig.ep.begin_control(
        ControlOp.REGISTER_CHIP, spec.handle.digest, (spec.import_path or "").encode()
    )
    end = time.monotonic() + 0.1
    while time.monotonic() < end:  # deferred: the gate still owns the device
        assert rig.ep.poll_control() is None
        rig.poll()
        time.sleep(0.002)
    assert _mb.load32(rig.mailbox.buf, BASE_FRAME) == MailboxState.CONTROL_REQUEST
    g.release()
    poll_for(rig.ep.poll_control, 10.0, message="REGISTER_CHIP never completed")
    assert rig.wait_event(EventKind.COMPLETED, d1).outcome is Outcome.SUCCESS
    # The registration is live: the new kernel runs.
    x = rig.heap.alloc(4, "float32")
    slot = Slot(
        spec.handle.digest, [blob_for(rig.heap, [x])], slot_id=2, lease_slot=1, lease_generation=2
    )
    d2 = WorkerDispatch(slot, 0, dispatch_id=2)
    rig.ep.submit_progress(d2)
    assert rig.wait_event(EventKind.COMPLETED, d2).outcome is Outcome.SUCCESS
    assert x.tolist() == [1.0] * 4


def test_diagnostic_config_is_decoded_by_the_child_and_disables_native_prepare(
    rig: ChipRig,
) -> None:
    """A diagnostic successor next to an active task is staged validation-only and
    prepared only at its launch, after the predecessor's finalize."""
    g = rig.gate()
    d1 = rig.publish("gate", 1, frame=0, blob=g.blob)
    poll_for(g.started, 10.0, message="gate kernel never started")
    d2 = rig.publish(
        "noop", 2, frame=1, prepare_only=True, config=CallConfig(enable_dump_args=True)
    )
    assert rig.wait_event(EventKind.FRAME_STAGED, d2).disposition == Disposition.VALIDATED
    rig.ep.activate_progress(2)
    g.release()
    for d in (d1, d2):
        assert rig.wait_event(EventKind.COMPLETED, d).outcome is Outcome.SUCCESS
    assert rig.at("finalize", 1) < rig.at("prepare", 2) < rig.at("launch", 2)
