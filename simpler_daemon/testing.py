"""Test harness shipped with the package, so tests, benchmarks and users share it.

``poll_for`` waits with a deadline instead of sleeping and hoping;
``child_pids`` and ``shm_files`` are what the leak guards compare.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll_for(
    predicate: Callable[[], T], timeout: float = 5.0, interval: float = 0.002, message: str = ""
) -> T:
    """Return the first truthy value of ``predicate()``; ``TimeoutError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = min(interval, 0.0005)
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(message or f"condition not met within {timeout}s")
        time.sleep(delay)
        delay = min(delay * 2, interval if interval > delay else delay, 0.05)


def child_pids(pid: int | None = None) -> set[int]:
    """Live (non-zombie reaped or not) children of ``pid`` (default: this process)."""
    parent = os.getpid() if pid is None else pid
    out: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{parent}/task")
    except FileNotFoundError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{parent}/task/{tid}/children") as f:
                out.update(int(p) for p in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def shm_files() -> set[str]:
    """Our files in /dev/shm (anything named simpler*)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.lower().startswith("simpler")}
    except FileNotFoundError:
        return set()
