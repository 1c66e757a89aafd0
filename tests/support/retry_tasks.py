"""SUB callables that fail on their first attempts and succeed later, for the retry
tests (tests/engine/test_retries.py, tests/server/test_daemon_retries.py), and the one
the map tests run per item (``square``).

State shared across attempts lives in a NO_DEP heap tensor the test allocates
(``tensors[0]``): ``[0]`` counts the attempts started, ``[1 + k]`` holds attempt k's pid.
Module level: the children inherit them through fork or import them by path.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

#: How long an attempt waiting to be killed waits before it gives up (far past any test).
HANG_S = 60.0


class FlakyError(ValueError):
    """A subclass of ValueError: ``retry_exceptions=(ValueError,)`` retries it."""


def _start(args: Any) -> int:
    state = args.tensors[0]
    n = int(state[0])
    state[0] = n + 1
    state[1 + n] = os.getpid()
    return n


def hang_first(args: Any) -> int:
    """Attempt 0 records its pid and waits to be killed (SIGKILL from the test); a later
    attempt returns 42 + scalars[0] (0 when none)."""
    if _start(args) == 0:
        end = time.monotonic() + HANG_S
        while time.monotonic() < end:
            time.sleep(0.001)
        raise TimeoutError("nobody killed the first attempt")
    return 42 + (int(args.scalars[0]) if args.scalars else 0)


def kill_self_first(args: Any) -> int:
    """Attempt 0 SIGKILLs its own process; later ones return 7."""
    if _start(args) == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return 7


def raise_first(args: Any) -> str:
    """Attempts before scalars[0] raise FlakyError (a ValueError); then return "ok"."""
    n = _start(args)
    if n < int(args.scalars[0]):
        raise FlakyError(f"flaky attempt {n}")
    return "ok"


def raise_key_error(args: Any) -> None:
    """Always a KeyError (not a ValueError)."""
    _start(args)
    raise KeyError("not retried")


def slow_first(args: Any) -> int:
    """Attempt 0 sleeps scalars[0] ms (past its deadline); later ones return 5."""
    if _start(args) == 0:
        time.sleep(int(args.scalars[0]) / 1000)
    return 5


def member_dies_first(args: Any) -> int:
    """A group member: scalars[0] is the member; member 1's first attempt SIGKILLs its
    process, every other attempt returns 10 * member. tensors[0] counts member 1's
    attempts, tensors[1][member] counts each member's."""
    member = int(args.scalars[0])
    args.tensors[1][member] += 1
    if member == 1 and _start(args) == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return 10 * member


def write_then_hang(args: Any) -> None:
    """tensors[1][:] = scalars[0]; the first attempt then waits to be killed."""
    args.tensors[1][:] = int(args.scalars[0])
    if _start(args) == 0:
        end = time.monotonic() + HANG_S
        while time.monotonic() < end:
            time.sleep(0.001)


def read_sum(args: Any) -> float:
    """The sum of tensors[0] (an INPUT)."""
    return float(args.tensors[0].sum())


def square(args: Any) -> Any:
    """The square of the task's single value; None for None; raises for a negative one."""
    x = args.values[0]
    if x is None:
        return None
    if x < 0:
        raise ValueError(f"negative item {x}")
    return x * x
