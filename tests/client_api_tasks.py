"""SUB callables that return values, for the client API tests (imported by path in
the daemon's children: ``tests.client_api_tasks:<name>``)."""

from __future__ import annotations

import os
import time
from typing import Any


def echo(args: Any) -> dict[str, Any]:
    """Return the scalars and the child's pid (a result that differs per task)."""
    return {"scalars": [int(s) for s in args.scalars], "pid": os.getpid()}


def nothing(args: Any) -> None:
    """Return None: no result travels back."""


def sleep_ms(args: Any) -> None:
    """``time.sleep(scalars[0] / 1000)``: a task stuck in a system call."""
    time.sleep(args.scalars[0] / 1000.0)
