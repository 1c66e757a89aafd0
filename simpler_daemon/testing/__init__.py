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
from typing import TypeVar

from simpler_daemon.endpoints.local import proc_state

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


def foreign_heap(name: str) -> bool:
    """A named heap (``simpler-heap-<pid>-...``) of a live process outside this process's
    tree: another test session's on a shared machine, not a leak of ours. A heap whose
    creator is dead, or is this process or one of its descendants, is ours."""
    m = re.match(r"simpler-heap-(\d+)-", name)
    if m is None:
        return False
    pid, me = int(m.group(1)), os.getpid()
    return pid != me and alive(pid) and me not in _ancestors(pid)


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
