"""A SUB task handed to a child that dies before picking it up is queued again.

The SUB child stores the frame's ``accepted`` word before it runs anything of a task
(docs/mailbox.md, *Launch acceptance*). A task whose child died with the frame still
``TASK_READY`` and the word 0 never started: it goes back to its run's queue and runs
on the replacement, counted once. A task the child picked up still fails when the child
dies; a cancelled run's unstarted task is not queued again; and a task whose children
keep dying before pick-up fails after ``MAX_PICKUP_REQUEUES`` requeues.

The window is made deterministic with SIGSTOP (the child cannot pick the task up) or a
hook that kills each child the moment it sees a task; nothing waits on time.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from simpler_daemon import Tag, TaskArgs, TaskError, Worker
from simpler_daemon.children.sub import MailboxLoop
from simpler_daemon.endpoints.local import LocalMailboxEndpoint
from simpler_daemon.errors import RunCancelled
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.layout import OFF_ACCEPTED, TASK_FRAMES, MailboxState
from simpler_daemon.scheduler.completion import MAX_PICKUP_REQUEUES
from simpler_daemon.scheduler.dispatch import Scheduler
from simpler_daemon.testing import alive, poll_for

pytestmark = pytest.mark.timeout(90)

_FRAME = TASK_FRAMES[0]


def count_and_record(args: Any) -> None:
    """t[0] = the pid that ran the task, t[1] += 1 (how often it ran)."""
    t = args.tensors[0]
    t[0] = os.getpid()
    t[1] += 1


def count_then_die(args: Any) -> None:
    """Runs (t[1] += 1), then its child dies: a task that was picked up."""
    args.tensors[0][1] += 1
    os.kill(os.getpid(), signal.SIGKILL)


def _die_at_pickup() -> None:
    """Init hook (in the child): the child SIGKILLs itself when it sees a task, before
    it picks it up."""

    def die(self: MailboxLoop) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    MailboxLoop.run_task = die  # type: ignore[method-assign]


def _sched(w: Worker) -> Scheduler:
    assert w.scheduler is not None
    return w.scheduler


def _endpoint(w: Worker) -> LocalMailboxEndpoint:
    ep = _sched(w).manager.sub[0].endpoint
    assert isinstance(ep, LocalMailboxEndpoint) and ep.child is not None
    return ep


def _replaced(w: Worker) -> bool:
    """One empty run (the Scheduler notices the death and replaces), then: replaced?"""
    w.run(lambda o, a, c: None)
    return w.restarts["sub"] >= 1


def _one(w: Worker, h: Any, t: Any) -> Any:
    return w.submit(lambda o, a, c: o.submit_sub(h, TaskArgs().add_tensor(t, Tag.INOUT)))


def _published_to_stopped_child(w: Worker, h: Any, t: Any) -> tuple[Any, int]:
    """Stop the only SUB child, submit one task and wait until it sits in the child's
    frame, unpicked; returns the run's handle and the stopped child's pid."""
    ep = _endpoint(w)
    assert ep.child is not None
    victim = ep.child.pid
    os.kill(victim, signal.SIGSTOP)
    handle = _one(w, h, t)
    poll_for(
        lambda: _mb.load32(ep.buf, _FRAME) == int(MailboxState.TASK_READY),
        timeout=30,
        message="the task was never published",
    )
    assert _mb.load32(ep.buf, _FRAME + OFF_ACCEPTED) == 0  # stopped: not picked up
    return handle, victim


def test_a_task_the_dead_child_never_picked_up_runs_on_the_replacement() -> None:
    with Worker(num_sub_workers=1) as w:
        h = w.register(count_and_record)
        t = w.alloc((2,), "int64")
        stats = dict(_sched(w).stats)
        handle, victim = _published_to_stopped_child(w, h, t)
        os.kill(victim, signal.SIGKILL)
        handle.wait(60)
        assert handle.exception() is None
        assert int(t[1]) == 1  # ran once
        assert int(t[0]) not in (0, victim)  # on the replacement
        assert w.restarts["sub"] == 1
        after = _sched(w).stats
        assert after["completed"] - stats["completed"] == 1
        assert after["failed"] == stats["failed"]
        assert not alive(victim)


def test_a_task_whose_child_dies_after_pickup_fails_and_runs_once() -> None:
    with Worker(num_sub_workers=1) as w:
        h = w.register(count_then_die)
        t = w.alloc((2,), "int64")
        with pytest.raises(TaskError, match="killed by SIGKILL") as info:
            w.run(lambda o, a, c: o.submit_sub(h, TaskArgs().add_tensor(t, Tag.INOUT)))
        assert "ENDPOINT_FAILURE" in str(info.value)
        assert "never picked" not in str(info.value)
        poll_for(lambda: _replaced(w), timeout=30, message="not replaced")
        assert int(t[1]) == 1  # never run a second time


def test_a_cancelled_runs_unstarted_task_is_not_queued_again() -> None:
    with Worker(num_sub_workers=1) as w:
        h = w.register(count_and_record)
        t = w.alloc((2,), "int64")
        handle, victim = _published_to_stopped_child(w, h, t)
        handle.cancel()
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(RunCancelled):
            handle.result(60)
        poll_for(lambda: _replaced(w), timeout=30, message="not replaced")
        assert int(t[1]) == 0  # it never ran


def test_a_task_whose_children_keep_dying_before_pickup_fails_after_the_bound() -> None:
    w = Worker(num_sub_workers=1)
    w._init_hooks[0] = _die_at_pickup
    w.init()
    try:
        h = w.register(count_and_record)
        t = w.alloc((2,), "int64")
        with pytest.raises(TaskError, match="died before picking it up") as info:
            _one(w, h, t).result(60)
        text = str(info.value)
        assert f"handed to {MAX_PICKUP_REQUEUES + 1} SUB children" in text
        assert "ENDPOINT_FAILURE" in text
        assert int(t[1]) == 0
        assert w.restarts["sub"] >= MAX_PICKUP_REQUEUES
    finally:
        w.close()
