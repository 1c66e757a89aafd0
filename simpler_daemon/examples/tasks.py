"""Example SUB callables and an orchestration function.

A SUB callable receives the decoded ``TaskArgs``: ``args.tensors[i]`` is a
zero-copy NumPy view on the daemon's shared heap and ``args.scalars[i]`` an int
(u64). Register them by import path, e.g. ``simpler_daemon.examples.tasks:add``::

    simplerctl register simpler_daemon.examples.tasks:fill
    simplerctl register simpler_daemon.examples.tasks:add

Tags drive the dependencies: a task that reads a tensor (``INPUT``) runs after
the last earlier task that wrote that byte range (``OUTPUT``/``INOUT``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from simpler_daemon.args import Tag, TaskArgs
from simpler_daemon.callables import CallableHandle, spec_for_import

__all__ = ["add", "add_scaled", "empty", "fail", "fill", "scale", "wait_for_flag"]

#: Longest a ``wait_for_flag`` task waits, whatever its scalar says (milliseconds).
MAX_WAIT_MS = 60_000


def empty(args: Any) -> None:
    """Do nothing (latency and throughput measurements)."""


def fill(args: Any) -> None:
    """``tensors[0][...] = scalars[0]`` (OUTPUT)."""
    args.tensors[0][...] = args.scalars[0]


def add(args: Any) -> None:
    """``tensors[2] = tensors[0] + tensors[1]`` (INPUT, INPUT, OUTPUT)."""
    np.add(args.tensors[0], args.tensors[1], out=args.tensors[2])


def scale(args: Any) -> None:
    """``tensors[0] *= scalars[0]`` in place (INOUT)."""
    out = args.tensors[0]
    np.multiply(out, args.scalars[0], out=out, casting="unsafe")


def fail(args: Any) -> None:
    """Always raise ``ValueError`` (shows how a failed run is reported)."""
    detail = args.scalars[0] if args.scalars else None
    raise ValueError(f"example failure (scalar {detail})")


def wait_for_flag(args: Any) -> None:
    """Wait until ``tensors[0][0] != 0`` (a uint8/int flag), then set ``tensors[0][1] = 1``.

    A client releases it by writing the flag with ``WriteBuffer``; it gives up
    with ``TimeoutError`` after ``scalars[0]`` milliseconds (at most
    :data:`MAX_WAIT_MS`). Used to hold a SUB worker busy on purpose.
    """
    flag = args.tensors[0]
    limit_ms = min(int(args.scalars[0]) if args.scalars else MAX_WAIT_MS, MAX_WAIT_MS)
    deadline = time.monotonic() + limit_ms / 1000.0
    while flag[0] == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"flag not set within {limit_ms} ms")
        time.sleep(0.001)
    flag[1] = 1


def _handle(name: str) -> CallableHandle:
    """The handle of an example SUB callable; it must have been registered."""
    return spec_for_import(f"{__name__}:{name}", "sub").handle


def add_scaled(o: Any, args: Any, config: Any) -> None:
    """Orchestration: ``out = (a + b) * factor`` as two parallel half adds, then a scale.

    ``args.tensors = [a, b, out]`` (1-D, same length), ``args.scalars = [factor]``.
    ``add`` and ``scale`` must be registered (``simplerctl register ...``). The
    scale reads and writes all of ``out`` (INOUT), so it depends on both halves.
    """
    a, b, out = args.tensors[0], args.tensors[1], args.tensors[2]
    factor = int(args.scalars[0]) if args.scalars else 1
    add_h, scale_h = _handle("add"), _handle("scale")
    half = out.shape[0] // 2
    for part in (slice(0, half), slice(half, None)):
        t = TaskArgs()
        t.add_tensor(a[part], Tag.INPUT)
        t.add_tensor(b[part], Tag.INPUT)
        t.add_tensor(out[part], Tag.OUTPUT)
        o.submit_sub(add_h, t, config)
    t = TaskArgs()
    t.add_tensor(out, Tag.INOUT)
    t.add_scalar(factor)
    o.submit_sub(scale_h, t, config)


def scale_kernel(args: Any, config: Any) -> None:
    """Chip kernel: ``tensors[0] *= scalars[0]`` (``kernel(args, config)``)."""
    args.tensors[0][...] *= args.scalars[0]
