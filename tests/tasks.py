"""Module-level task functions for the Worker / Scheduler tests.

They run inside SUB children (inherited through fork, or imported by path as
``tests.tasks:<name>``). Order and concurrency are proven by what they record
in heap tensors (pids, monotonic marks, flags), never by timing: a task that
waits for something waits on a shared heap word with a deadline that fails the
task, so a broken engine shows up as a clear ``TaskError`` instead of a hang.
"""

from __future__ import annotations

import os
import time
from typing import Any

from simpler_daemon import Tag, TaskArgs

#: Default spin deadline for tasks that wait on a heap flag (milliseconds).
WAIT_MS = 20_000


def _spin_until(pred: Any, deadline_ms: int, what: str) -> None:
    deadline = time.monotonic() + deadline_ms / 1000.0
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not seen within {deadline_ms} ms")
        time.sleep(0.0002)


def fill(args: Any) -> None:
    """tensors[0][:] = scalars[0]"""
    args.tensors[0][:] = args.scalars[0]


def consume(args: Any) -> None:
    """tensors[1][:] = tensors[0] + scalars[0] (reads an INPUT, writes an OUTPUT)."""
    args.tensors[1][:] = args.tensors[0] + args.scalars[0]


def marked_fill(args: Any) -> None:
    """Fill tensors[0] with scalars[0]; record (pid, start_ns, end_ns) in row scalars[1] of tensors[1]."""
    marks = args.tensors[1]
    row = args.scalars[1]
    start = time.monotonic_ns()
    args.tensors[0][:] = args.scalars[0]
    marks[row, 0] = os.getpid()
    marks[row, 1] = start
    marks[row, 2] = time.monotonic_ns()


def marked_consume(args: Any) -> None:
    """tensors[1][:] = tensors[0] + 1; record (pid, start_ns, end_ns) in row scalars[0] of tensors[2]."""
    marks = args.tensors[2]
    row = args.scalars[0]
    start = time.monotonic_ns()
    args.tensors[1][:] = args.tensors[0] + 1
    marks[row, 0] = os.getpid()
    marks[row, 1] = start
    marks[row, 2] = time.monotonic_ns()


def rendezvous(args: Any) -> None:
    """Meet a peer: set flags[me], then wait until flags[peer] is set.

    tensors[0]: int64 flags (NO_DEP, shared by both writers); tensors[1]: this
    writer's own output range, filled with ``me + 1``. scalars: me, peer,
    deadline_ms. Only possible when both writers run at the same time.
    """
    flags = args.tensors[0]
    me, peer, deadline_ms = args.scalars[0], args.scalars[1], args.scalars[2]
    flags[me] = os.getpid()
    _spin_until(lambda: flags[peer] != 0, deadline_ms, f"rendezvous peer {peer}")
    args.tensors[1][:] = me + 1


def record_pid(args: Any) -> None:
    """tensors[0][scalars[0]] = os.getpid()"""
    args.tensors[0][args.scalars[0]] = os.getpid()


def record_pid_rendezvous(args: Any) -> None:
    """Group member: record the pid at index scalars[0], then wait for every member."""
    pids = args.tensors[0]
    pids[args.scalars[0]] = os.getpid()
    n = args.scalars[1]
    _spin_until(lambda: all(pids[i] != 0 for i in range(n)), WAIT_MS, "every group member")


def fail(args: Any) -> None:
    """Record the pid in tensors[0][0] (when given), wait for the gate tensors[1][0] != 0
    (when given; the orchestration opens it once every task is submitted), then raise."""
    if args.tensors:
        args.tensors[0][0] = os.getpid()
    if len(args.tensors) > 1:
        gate = args.tensors[1]
        _spin_until(lambda: gate[0] != 0, WAIT_MS, "the gate")
    raise ValueError(f"producer exploded on purpose ({args.scalars[0] if args.scalars else 0})")


def wait_flag(args: Any) -> None:
    """Record the pid in tensors[1][scalars[1]] (when given), then wait until tensors[0][scalars[0]] != 0.

    scalars: flag index, pid index, deadline_ms (default WAIT_MS).
    """
    flags = args.tensors[0]
    idx = args.scalars[0]
    if len(args.tensors) > 1:
        args.tensors[1][args.scalars[1]] = os.getpid()
    deadline_ms = args.scalars[2] if len(args.scalars) > 2 else WAIT_MS
    _spin_until(lambda: flags[idx] != 0, deadline_ms, f"flag {idx}")


def set_flag(args: Any) -> None:
    """tensors[0][scalars[0]] = 1"""
    args.tensors[0][args.scalars[0]] = 1


def sleep_ms(args: Any) -> None:
    time.sleep(args.scalars[0] / 1000.0)


def chain_step(args: Any) -> None:
    """The counter in tensors[0][0] must equal scalars[0]; then increment it."""
    c = args.tensors[0]
    if c[0] != args.scalars[0]:
        raise AssertionError(f"chain out of order: counter {c[0]}, task {args.scalars[0]}")
    c[0] += 1


def noop(args: Any) -> None:
    return None


def add_one(args: Any) -> None:
    args.tensors[0][:] += 1


def kernel(args: Any, config: Any) -> None:
    """A chip kernel (registered by path for scheduler tables; never run there)."""
    return None


def die(args: Any) -> None:
    """Record the pid in tensors[0][0], then die the way scalars[0] says.

    0: SIGKILL itself, 1: ``os._exit(3)``, 2: segfault (NULL read).
    """
    import signal

    args.tensors[0][0] = os.getpid()
    mode = args.scalars[0]
    if mode == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == 1:
        os._exit(3)
    else:
        import ctypes
        import faulthandler

        faulthandler.disable()  # keep the test output quiet
        ctypes.string_at(0)
    raise AssertionError("still alive")


def targs(*tensors: tuple[Any, Tag], scalars: tuple[int, ...] = ()) -> TaskArgs:
    """Test helper (runs in the parent): TaskArgs from (array, tag) pairs and scalars."""
    a = TaskArgs()
    for t, tag in tensors:
        a.add_tensor(t, tag)
    for s in scalars:
        a.add_scalar(s)
    return a
