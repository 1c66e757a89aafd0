"""SUB callables the ops tests run in a real daemon (tests/test_ops_*.py): tasks that
print, crash with a fault or leave without a word."""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any


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
