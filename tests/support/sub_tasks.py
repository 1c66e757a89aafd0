"""SUB callables the in-process engine tests run: one module for every test that forks
SUB children from this process (Worker and Scheduler, lanes and endpoints, child loops,
nested local L3s, run futures and task results).

They run inside SUB children, inherited through fork (registered as objects) or
imported by path (``tests.support.sub_tasks:<name>``). Order and concurrency are
proven by what they record in heap tensors (pids, monotonic marks, flags), never by
timing: a task that waits for something waits on a shared heap word with a deadline
that fails the task, so a broken engine shows up as a clear ``TaskError`` instead of
a hang. ``targs`` (the last function) runs in the parent: it builds their arguments.
"""

from __future__ import annotations

import os
import time
from typing import Any

from simpler_daemon import Tag, TaskArgs

# -- the Worker and Scheduler tests ------------------------------------------------------------

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


def sleep_then_fail(args: Any) -> None:
    """Sleep scalars[0] ms, then raise."""
    time.sleep(args.scalars[0] / 1000.0)
    raise RuntimeError("failed after its sleep, on purpose")


def chain_step(args: Any) -> None:
    """The counter in tensors[0][0] must equal scalars[0]; then increment it."""
    c = args.tensors[0]
    if c[0] != args.scalars[0]:
        raise AssertionError(f"chain out of order: counter {c[0]}, task {args.scalars[0]}")
    c[0] += 1


def noop(args: Any) -> None:
    """Do nothing."""
    return None


def add_one(args: Any) -> None:
    """tensors[0] += 1, in place."""
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


# -- the endpoint, lane and child-loop tests (one child behind a hand-built endpoint) ------


#: How long a gated task waits for its release before failing (seconds).
GATE_WAIT_S = 20.0


def store_scalar(args: Any) -> None:
    """tensors[0][scalars[1]] = scalars[0] (tensors[0] is a uint64 vector)."""
    args.tensors[0][args.scalars[1]] = args.scalars[0]


def double(args: Any) -> None:
    """tensors[0] *= 2, in place."""
    args.tensors[0] *= 2


def record_pid_first(args: Any) -> None:
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


# -- run futures: tasks that return a value ----------------------------------------------------


def double_scalar(args: Any) -> int:
    """Return 2 * scalars[0]."""
    return int(args.scalars[0]) * 2


def gated_double(args: Any) -> int:
    """Wait until tensors[0][0] != 0 (30 s at most), then return 2 * scalars[0]."""
    flags = args.tensors[0]
    deadline = time.monotonic() + 30
    while flags[0] == 0:
        if time.monotonic() > deadline:
            raise TimeoutError("the gate never opened")
        time.sleep(0.0005)
    return int(args.scalars[0]) * 2


# -- nested local L3s: the SUB grandchildren of an L3 child ------------------------------------


def sub_fill(args: Any) -> None:
    """tensors[0][:] = scalars[0]; tensors[1] (int64) = [pid, parent pid, address of tensors[0]]."""
    args.tensors[0][:] = args.scalars[0]
    if len(args.tensors) > 1:
        rec = args.tensors[1]
        rec[0] = os.getpid()
        rec[1] = os.getppid()
        rec[2] = args.tensors[0].__array_interface__["data"][0]


def sub_scale(args: Any) -> None:
    """tensors[1] = tensors[0] * scalars[0] + scalars[2]; tensors[2] (uint64) = scalars."""
    time.sleep(0.05)  # a dependency that is not honored shows up as a race
    args.tensors[1][:] = args.tensors[0] * args.scalars[0] + args.scalars[2]
    args.tensors[2][: len(args.scalars)] = args.scalars


def sub_add(args: Any) -> None:
    """tensors[1] = tensors[0] + 1 (reads what the previous SUB task wrote)."""
    args.tensors[1][:] = args.tensors[0] + 1


def sub_double(args: Any) -> None:
    args.tensors[0][:] *= 2


def sub_fail(args: Any) -> None:
    raise ValueError(f"bottom boom {args.scalars[0]}")


def sub_gate(args: Any) -> None:
    """flag[0] = 1 (started), then wait (20 s at most) until flag[1] is set."""
    flag = args.tensors[0]
    flag[0] = 1
    deadline = time.monotonic() + 20.0
    while flag[1] == 0:
        if time.monotonic() > deadline:
            raise TimeoutError("gate never opened")
        time.sleep(0.001)


# -- the parent's side -------------------------------------------------------------------------


def targs(*tensors: tuple[Any, Tag], scalars: tuple[int, ...] = ()) -> TaskArgs:
    """Test helper (runs in the parent): TaskArgs from (array, tag) pairs and scalars."""
    a = TaskArgs()
    for t, tag in tensors:
        a.add_tensor(t, tag)
    for s in scalars:
        a.add_scalar(s)
    return a
