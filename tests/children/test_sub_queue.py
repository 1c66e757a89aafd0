"""The SUB child's loop over two task frames (``MailboxLoop.run`` with a queue frame;
docs/mailbox.md): frames run in dispatch order whatever their index, each is claimed
(TASK_READY -> TASK_LAUNCHED) before it runs, a frame the parent took back is never run,
after a task that did not end plainly the other frame waits until the parent has read
that one, and a stop fails every unclaimed frame with ERR_SHUTDOWN.

The parent side is written by hand here (``publish_task`` with chosen dispatch ids), with
the child frozen while parked so that it sees both frames at once.
"""

from __future__ import annotations

import time

import msgspec
import pytest

from simpler_daemon.args import CallConfig
from simpler_daemon.callables import spec_for_object
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.layout import (
    ERR_SHUTDOWN,
    ERR_TASK,
    OFF_ACCEPTED,
    OFF_ARGS,
    OFF_ERROR,
    OFF_RESERVED,
    OFF_STATE,
    PROTOCOL,
    TASK_FRAMES,
    MailboxState,
)
from simpler_daemon.testing import poll_for
from tests.support.endpoint_rig import EMPTY_BLOB, Rig

pytestmark = pytest.mark.timeout(30)

F0, F1 = TASK_FRAMES[0], TASK_FRAMES[1]
READY = int(MailboxState.TASK_READY)
DONE = int(MailboxState.TASK_DONE)
IDLE = int(MailboxState.IDLE)


def stamp(args: object) -> int:
    """When it ran (the child's monotonic clock)."""
    return time.monotonic_ns()


def explode(args: object) -> None:
    raise ValueError("on purpose")


def nothing(args: object) -> None:
    return None


SPECS = [spec_for_object(f) for f in (stamp, explode, nothing)]
STAMP, EXPLODE, NOTHING = (s.handle.digest for s in SPECS)
CONFIG = CallConfig().encode()


def publish(rig: Rig, frame: int, digest: bytes, did: int) -> None:
    _mb.publish_task(
        rig.mailbox.buf, frame, READY, CONFIG, 0, 1, digest, EMPTY_BLOB, PROTOCOL, 1, did, 1, did
    )


def state(rig: Rig, frame: int) -> int:
    return int(_mb.load32(rig.mailbox.buf, frame + OFF_STATE))


def stamped(rig: Rig, frame: int) -> int:
    buf = rig.mailbox.buf
    poll_for(lambda: state(rig, frame) == DONE, 10.0, message=f"frame {frame} never finished")
    assert _mb.load32(buf, frame + OFF_ERROR) == 0
    n = _mb.load64(buf, frame + OFF_RESERVED)
    return int(msgspec.msgpack.decode(_mb.read_bytes(buf, frame + OFF_ARGS, n)))


@pytest.fixture
def rig() -> Rig:
    with Rig(SPECS, task_frames=2) as r:
        yield r


def test_frames_run_in_dispatch_order_whatever_their_index(rig: Rig) -> None:
    with rig.frozen_while_parked():
        publish(rig, F0, STAMP, did=8)
        publish(rig, F1, STAMP, did=7)  # the older one, in frame 1
    first, second = stamped(rig, F1), stamped(rig, F0)
    assert first < second
    assert _mb.load32(rig.mailbox.buf, F1 + OFF_ACCEPTED) == 1


def test_a_frame_taken_back_before_the_claim_is_not_run(rig: Rig) -> None:
    buf = rig.mailbox.buf
    with rig.frozen_while_parked():
        publish(rig, F0, STAMP, did=1)
        publish(rig, F1, STAMP, did=2)
        assert _mb.cas32(buf, F1 + OFF_STATE, READY, IDLE)  # the parent withdraws it
    stamped(rig, F0)
    _mb.store32(buf, F0 + OFF_STATE, IDLE)
    _mb.wake_child(buf)
    publish(rig, F0, STAMP, did=3)  # the child keeps serving
    stamped(rig, F0)
    assert state(rig, F1) == IDLE and _mb.load32(buf, F1 + OFF_ACCEPTED) == 0


def test_after_a_failure_the_next_frame_waits_until_the_parent_read_it(rig: Rig) -> None:
    buf = rig.mailbox.buf
    with rig.frozen_while_parked():
        publish(rig, F0, EXPLODE, did=1)
        publish(rig, F1, STAMP, did=2)
    poll_for(lambda: state(rig, F0) == DONE, 10.0, message="the failing task never ended")
    assert _mb.load32(buf, F0 + OFF_ERROR) == ERR_TASK
    # Frame 0 still says TASK_DONE (unread): frame 1 is not claimed meanwhile.
    until = time.monotonic() + 0.3
    while time.monotonic() < until:
        assert state(rig, F1) == READY, "the child ran a task before the failure was read"
        time.sleep(0.01)
    _mb.store32(buf, F0 + OFF_STATE, IDLE)  # read: what the endpoint's _complete does
    _mb.wake_child(buf)
    stamped(rig, F1)


def test_a_stop_fails_every_unclaimed_frame(rig: Rig) -> None:
    buf = rig.mailbox.buf
    with rig.frozen_while_parked():
        publish(rig, F0, STAMP, did=1)
        publish(rig, F1, STAMP, did=2)
        rig.mailbox.request_shutdown()
    failed = int(MailboxState.TASK_FAILED)
    for frame in (F0, F1):
        poll_for(lambda f=frame: state(rig, f) == failed, 10.0, message="frame not failed")
        assert _mb.load32(buf, frame + OFF_ERROR) == ERR_SHUTDOWN
        assert _mb.load32(buf, frame + OFF_ACCEPTED) == 0


def _slow_empty_claim() -> None:
    """Init hook (in the child): a claim that finds nothing waits 0.2 s before the child
    goes on to wait, as if it were preempted right there."""
    real = _mb.child_claim

    def claim(buf: object, hold: int) -> int:
        got = real(buf, hold)
        if got == 0:
            time.sleep(0.2)
        return got

    _mb.child_claim = claim  # type: ignore[assignment]


def test_a_task_published_right_after_an_empty_claim_is_not_slept_through() -> None:
    """The child's wait compares against the frame states it read before its claim
    looked: a task published after that changes a word, and the wait returns at once.
    (Read after the claim, the new TASK_READY was the expected value: the child parked on
    it until ``park_timeout``.)"""
    with Rig(SPECS, task_frames=2, park_timeout=30.0, init_hook=_slow_empty_claim) as rig:
        rig.run(NOTHING)  # the child now sits in the window after an empty claim
        start = time.monotonic()
        rig.run(NOTHING, timeout=20.0)
        assert time.monotonic() - start < 10.0, "the child slept through a published task"
