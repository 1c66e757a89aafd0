"""Chip kernels the tests register by path (``tests.support.chip_kernels:<name>``):
``kernel(args, config)`` over heap views, run on a chip child's device thread."""

from __future__ import annotations

import os
import time
from typing import Any


def add_one(args: Any, config: Any) -> None:
    args.tensors[0][...] += 1


def write_scalar(args: Any, config: Any) -> None:
    args.tensors[0][args.scalars[0]] = args.scalars[1]


def sleep_ms(args: Any, config: Any) -> None:
    time.sleep(args.scalars[0] / 1000.0)


def boom(args: Any, config: Any) -> None:
    raise RuntimeError("kernel exploded")


def fail_prepare(args: Any, config: Any) -> None:
    pass


fail_prepare.sim_fail = "prepare"  # type: ignore[attr-defined]


def fail_launch(args: Any, config: Any) -> None:
    pass


fail_launch.sim_fail = "launch"  # type: ignore[attr-defined]


def slow_prepare(args: Any, config: Any) -> None:
    time.sleep(args.scalars[0] / 1000.0 if args.scalars else 0.0)


slow_prepare.sim_prepare_s = 0.005  # type: ignore[attr-defined]


# -- kernels of the chip child tests (children/test_chip.py, children/test_chip_loop.py) ---------

#: How long a gated kernel waits for its release before failing (seconds).
GATE_WAIT_S = 20.0

#: Set by a test before it forks a chip child: the mailbox whose task-frame state
#: ``frame_state`` copies (module globals are inherited through fork).
OBSERVED_MAILBOX: Any = None


def noop(args: Any, config: Any) -> None:
    """Complete at once."""


def gate(args: Any, config: Any) -> None:
    """Mark started (word 0), wait for release (word 1), then mark finished (word 2).

    ``tensors[0]`` is a uint64 vector of at least 3 words on the shared heap. The
    wait has a deadline, so a broken engine fails the task instead of hanging.
    """
    words = args.tensors[0]
    words[0] = 1
    deadline = time.monotonic() + GATE_WAIT_S
    while words[1] == 0:
        if time.monotonic() > deadline:
            raise TimeoutError("gate was never released")
        time.sleep(0.0002)
    words[2] = 1


def record_pid(args: Any, config: Any) -> None:
    """tensors[0][0] = the pid of the chip child running this kernel."""
    args.tensors[0][0] = os.getpid()


def frame_state(args: Any, config: Any) -> None:
    """tensors[0][0] = the state word of task frame ``scalars[0]`` of ``OBSERVED_MAILBOX``.

    Runs on the device thread, i.e. after the launch boundary: what it sees is
    the state the chip child published before launching.
    """
    from simpler_daemon.mailbox import _mailbox as _mb
    from simpler_daemon.mailbox.layout import TASK_FRAMES

    args.tensors[0][0] = _mb.load32(OBSERVED_MAILBOX.buf, TASK_FRAMES[args.scalars[0]])


def fail_poll(args: Any, config: Any) -> None:
    pass


fail_poll.sim_fail = "poll"  # type: ignore[attr-defined]
