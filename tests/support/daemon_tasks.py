"""Callables the daemon, client and ops tests register by import path in a real
``simpler-daemon`` (``tests.support.daemon_tasks:<name>``): its SUB children import
this module, so the daemon's ``callables.allowed_modules`` must admit it."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from typing import Any

# -- tasks that return values (the client API) -------------------------------------------------


def echo(args: Any) -> dict[str, Any]:
    """Return the scalars and the child's pid (a result that differs per task)."""
    return {"scalars": [int(s) for s in args.scalars], "pid": os.getpid()}


def nothing(args: Any) -> None:
    """Return None: no result travels back."""


def blob(args: Any) -> bytes:
    """Return ``scalars[0]`` zero bytes (a result of a chosen size)."""
    return bytes(int(args.scalars[0]))


def sleep_ms(args: Any) -> None:
    """``time.sleep(scalars[0] / 1000)``: a task stuck in a system call."""
    time.sleep(args.scalars[0] / 1000.0)


# -- tasks that print, crash with a fault or leave without a word (the ops tests) -------------


def shout(args: Any) -> None:
    """Write to stdout and stderr the way careless task code does."""
    print("hello from a task")
    print("a warning from a task", file=sys.stderr)


def segfault(args: Any) -> None:
    """Crash on a NULL read with faulthandler on (as every child has it)."""
    print("about to crash")
    ctypes.string_at(0)


def vanish(args: Any) -> None:
    """Leave at once: no exception, no traceback, exit status 3."""
    os._exit(3)


# -- tasks that read values and kwargs (tests/server/test_task_values.py) --------------------


def echo_values(args: Any) -> dict[str, Any]:
    """Return the values and kwargs the task received."""
    return {"values": args.values, "kwargs": args.kwargs}


def value_sizes(args: Any) -> list[int]:
    """The length of each bytes value."""
    return [len(v) for v in args.values]


def sized(args: Any) -> bytes:
    """``values[0]`` bytes: a result of a chosen size."""
    return b"r" * int(args.values[0])
