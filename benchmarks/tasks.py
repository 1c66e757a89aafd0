"""Task functions every system runs, importable by path (``benchmarks.tasks:empty``).

Peers pickle these by reference (module + qualname), so they must stay
module-level. Peers call them with plain arguments; the engine calls a SUB
callable with one decoded ``TaskArgs`` (``args.tensors[i]`` a NumPy view on the
shared heap, ``args.scalars[i]`` an int) and ignores the return value, hence
the ``*_task`` twins below.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def empty(*_args: Any) -> None:
    """Do nothing: the empty task of W1 (one per run), W2 (20,000 in one run) and the
    warm-ups (works for peers and for the engine)."""
    return None


#: The value W1v and W2v pass to each task (a small record, as a real task's input).
VALUE: dict[str, Any] = {"id": 7, "name": "item-7", "xs": [1.5, 2.5, 3.5], "ok": True}


def take_value(value: Any) -> None:
    """Read the one value it is given (the peers' task of W1v and W2v)."""
    value["id"]


def take_value_task(args: Any) -> None:
    """The engine's twin of :func:`take_value`: ``args.values[0]`` (decoded here)."""
    args.values[0]["id"]


def spin(us: int) -> None:
    """Burn ``us`` microseconds of this thread's CPU time (not wall time).

    Counting CPU time means a preempted task still does its full share of
    work, so lost cores show up as lost efficiency in W3 (CPU efficiency of 500 µs
    tasks).
    """
    deadline = time.thread_time_ns() + int(us) * 1000
    while time.thread_time_ns() < deadline:
        pass


def spin_task(args: Any) -> None:
    """Engine form of :func:`spin`: ``args.scalars[0]`` microseconds."""
    spin(int(args.scalars[0]))


def sleep_task(args: Any) -> None:
    """Engine only: sleep ``args.scalars[0]`` microseconds (the long run of W9, which
    measures a small run's latency behind it: it holds the worker without taking a core
    from the client and the daemon)."""
    time.sleep(int(args.scalars[0]) / 1e6)


def incr(prev: int) -> int:
    """One link of W4's chain of 2,000 dependent tasks, for peers that pass results along
    (Ray, Dask)."""
    return int(prev) + 1


def incr_task(args: Any) -> None:
    """Engine form of :func:`incr`: bump a counter held in an INOUT heap tensor."""
    counter = args.tensors[0]
    counter[0] += 1


def sum_array(arr: np.ndarray, expected: float | None = None) -> float:
    """Read the whole array (W5: a task reading an 8 MiB array). Raises if the sum is not
    ``expected``."""
    total = float(arr.sum())
    if expected is not None and total != expected:
        raise ValueError(f"cannot verify W5 array: sum {total} != {expected}")
    return total


def sum_task(args: Any) -> None:
    """Engine form of :func:`sum_array`: ``args.tensors[0]``, ``args.scalars[0]`` expected."""
    expected = float(args.scalars[0]) if len(args.scalars) else None
    sum_array(args.tensors[0], expected)


# -- chip kernels for benchmarks/staging.py ------------------------------------------------------


def staging_kernel(args: Any, config: Any) -> None:
    """Chip kernel (``kernel(args, config)``): sleep ``args.scalars[0]`` microseconds.

    Its preparation time on the simulated chip backend is the function attribute
    ``sim_prepare_s``; ``benchmarks.staging`` sets it before forking the chip
    children, which inherit the module as imported by the parent.
    """
    time.sleep(int(args.scalars[0]) / 1e6)


staging_kernel.sim_prepare_s = 0.005  # type: ignore[attr-defined]
