"""Example L3 orchestration functions for remote workers (``RemoteCallable`` targets).

Each runs inside a remote session against that host's inner ``Worker(level=3)``,
with the same ``(o, args, config)`` signature as any orchestration. The SUB
callables they submit are named by import path: an L4 parent installs them with
``w4.register("simpler_daemon.examples.tasks:fill", kind="sub", workers=[r])``,
and ``CallableHandle.for_import`` gives the same hashid on every host.
"""

from __future__ import annotations

import time
from typing import Any

from simpler_daemon.args import Tag, TaskArgs
from simpler_daemon.callables import CallableHandle

EMPTY = CallableHandle.for_import("simpler_daemon.examples.tasks:empty")
FILL = CallableHandle.for_import("simpler_daemon.examples.tasks:fill")
FAIL = CallableHandle.for_import("simpler_daemon.examples.tasks:fail")


def fill_all(o: Any, args: Any, config: Any) -> None:
    """Fill ``args.tensors[0]`` with ``args.scalars[0]`` in one SUB task."""
    o.submit_sub(
        FILL, TaskArgs().add_tensor(args.tensors[0], Tag.OUTPUT).add_scalar(args.scalars[0])
    )


def one_empty(o: Any, args: Any, config: Any) -> None:
    """One empty SUB task: the remote round trip the benchmarks time (``benchmarks/w7.py``)."""
    o.submit_sub(EMPTY)


def nothing(o: Any, args: Any, config: Any) -> None:
    """Submit nothing: the session's own round trip, without the inner Scheduler."""


def fail_inside(o: Any, args: Any, config: Any) -> None:
    """A SUB task that raises: its traceback travels up to the L4 run's TaskError."""
    o.submit_sub(FAIL, TaskArgs().add_scalar(args.scalars[0] if args.scalars else 7))


def sleep_for(o: Any, args: Any, config: Any) -> None:
    """Block the session's loop for ``args.scalars[0]`` ms (health must keep beating)."""
    time.sleep(args.scalars[0] / 1000)
