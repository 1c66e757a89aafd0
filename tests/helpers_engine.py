"""Module-level callables for the endpoint, lane and child-loop tests.

They run inside SUB children, inherited through fork (``spec_for_object``) or
imported by path (``tests.helpers_engine:<name>``). A task that must stay
"mid-task" waits on a heap word with a deadline, so a broken engine fails the
task instead of hanging the suite.
"""

from __future__ import annotations

import os
import time
from typing import Any

#: How long a gated task waits for its release before failing (seconds).
GATE_WAIT_S = 20.0


def noop(args: Any) -> None:
    """Do nothing."""


def store_scalar(args: Any) -> None:
    """tensors[0][scalars[1]] = scalars[0] (tensors[0] is a uint64 vector)."""
    args.tensors[0][args.scalars[1]] = args.scalars[0]


def double(args: Any) -> None:
    """tensors[0] *= 2, in place."""
    args.tensors[0] *= 2


def add_one(args: Any) -> None:
    """tensors[0] += 1, in place."""
    args.tensors[0] += 1


def record_pid(args: Any) -> None:
    """tensors[0][0] = os.getpid()."""
    args.tensors[0][0] = os.getpid()


def raise_value_error(args: Any) -> None:
    raise ValueError(f"bad value {args.scalars[0]}")


def sleep_long(args: Any) -> None:
    """Sleep far longer than any test deadline (stopped by CallConfig.deadline_ms)."""
    time.sleep(30.0)


def gate(args: Any) -> None:
    """Mark started (word 0), wait for release (word 1), then mark finished (word 2).

    ``tensors[0]`` is a uint64 vector of at least 3 words on the shared heap.
    """
    words = args.tensors[0]
    words[0] = 1
    deadline = time.monotonic() + GATE_WAIT_S
    while words[1] == 0:
        if time.monotonic() > deadline:
            raise TimeoutError("gate was never released")
        time.sleep(0.0002)
    words[2] = 1


NOT_A_CALLABLE = 42
