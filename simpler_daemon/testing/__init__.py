"""Test harness shipped with the package, so tests, benchmarks and users share it.

``poll_for`` waits with a deadline instead of sleeping and hoping;
``child_pids``, ``shm_files`` and ``leaked_shm`` are what the leak guards compare;
``self_signed_cert`` makes a throwaway certificate for TLS tests. The remote test
tools are the modules beside this one: ``chaos_proxy.ChaosProxy`` and
``session_proxy.SessionProxy`` (fault injection on frames), ``netns.TestHosts``
(test hosts in network namespaces).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from simpler_daemon.endpoints.taskwatch import proc_state

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
    except (FileNotFoundError, ProcessLookupError):
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


def _ancestors(pid: int) -> Iterator[int]:
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            return
        yield pid


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    return proc_state(pid) not in ("", "Z")


def stopped(pid: int) -> bool:
    """True while ``pid`` is stopped (SIGSTOP, or traced)."""
    return proc_state(pid) in ("T", "t")


def descendants(pid: int | None = None) -> set[int]:
    """Every live process below ``pid`` (default: this one), recursively."""
    out: set[int] = set()
    todo = list(child_pids(pid))
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(child_pids(p))
    return out


_spawned: set[int] = set()
_tracking = False


def track_spawned_processes() -> None:
    """From now on, remember the pid of every ``subprocess.Popen`` this process starts.

    A heap's name carries its creator's pid, and once the creator has exited nothing in
    /proc says whose child it was. Without tracking, a heap of a dead creator counts as
    ours; with it, only when the creator is one this process started (or saw among its
    descendants, :func:`note_descendants`), so a daemon that another test process beside
    this one has just killed is not taken for a leak of ours. The test suite's conftest
    turns it on; idempotent."""
    global _tracking
    if _tracking:
        return
    _tracking = True
    start: Any = subprocess.Popen.__init__

    def __init__(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
        start(self, *args, **kwargs)
        _spawned.add(self.pid)

    setattr(subprocess.Popen, "__init__", __init__)  # noqa: B010 (mypy refuses the assignment)


def note_descendants() -> None:
    """Remember every live descendant as one of ours (a daemon that ``make run`` started
    is a grandchild: Popen never saw its pid)."""
    _spawned.update(descendants())


def foreign_heap(name: str) -> bool:
    """A named heap (``simpler-heap-<pid>-...``) that is not a leak of ours: its creator is
    a live process outside this process's tree (another test session's on a shared
    machine), or, while :func:`track_spawned_processes` is on, a dead process this one
    never started. A heap of this process or of a descendant is ours."""
    m = re.match(r"simpler-heap-(\d+)-", name)
    if m is None:
        return False
    pid, me = int(m.group(1)), os.getpid()
    if pid == me or pid in _spawned:
        return False
    if alive(pid):
        return me not in _ancestors(pid)
    return _tracking


def leaked_shm(before: set[str]) -> set[str]:
    """Files of ours that appeared in /dev/shm since ``before`` was taken."""
    return {n for n in shm_files() - before if not foreign_heap(n)}


def settled_shm_leaks(before: set[str], timeout: float = 5.0) -> set[str]:
    """``leaked_shm`` once it stops shrinking, at most ``timeout`` seconds: a heap whose
    creator just exited while it is being removed (another test process's daemon
    stopping beside this one) looks like ours for a moment; a real leak stays."""
    deadline = time.monotonic() + timeout
    leaked = leaked_shm(before)
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = leaked_shm(before)
    return leaked


def self_signed_cert(directory: Path, name: str = "cert") -> tuple[Path, Path] | None:
    """A one-day self-signed EC certificate for ``localhost`` and ``127.0.0.1`` and its
    key, as ``(directory/name.crt, directory/name.key)``; None without the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )  # fmt: skip
    return cert, key
