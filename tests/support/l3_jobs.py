"""L3 orchestration functions an L3 runs by import path (``tests.support.l3_jobs:<name>``):
a remote session runner (the remote session, API and e2e tests) or a local L3 child (the
nested tests).

Each has the ordinary ``(o, args, config)`` signature and submits SUB tasks of
``tests.support.sub_tasks`` by import path (the session manifest installs them), so it
cannot tell a remote call from a local one.
"""

from __future__ import annotations

import time
from typing import Any

from simpler_daemon import Tag, TaskArgs
from simpler_daemon.callables import CallableHandle, spec_for_import


def _sub(name: str) -> Any:
    return spec_for_import(f"tests.support.sub_tasks:{name}", "sub").handle


def fill_remote(o: Any, args: Any, config: Any) -> None:
    """SUB ``tests.support.sub_tasks:fill``: tensors[0][:] = scalars[0]."""
    o.submit_sub(
        _sub("fill"), TaskArgs().add_tensor(args.tensors[0], Tag.OUTPUT).add_scalar(args.scalars[0])
    )


def consume_remote(o: Any, args: Any, config: Any) -> None:
    """SUB ``tests.support.sub_tasks:consume``: tensors[1][:] = tensors[0] + scalars[0]."""
    sub_args = (
        TaskArgs()
        .add_tensor(args.tensors[0], Tag.INPUT)
        .add_tensor(args.tensors[1], Tag.OUTPUT)
        .add_scalar(args.scalars[0])
    )
    o.submit_sub(_sub("consume"), sub_args)


def fail_remote(o: Any, args: Any, config: Any) -> None:
    """SUB ``tests.support.sub_tasks:fail`` raises ValueError("producer exploded on purpose (N)")."""
    o.submit_sub(_sub("fail"), TaskArgs().add_scalar(args.scalars[0]))


def raise_remote(o: Any, args: Any, config: Any) -> None:
    """The orchestration itself raises."""
    raise RuntimeError("orchestration refused on purpose")


def block_remote(o: Any, args: Any, config: Any) -> None:
    """Block the runner's event loop for scalars[0] ms (health must keep beating)."""
    time.sleep(args.scalars[0] / 1000.0)


def noop_remote(o: Any, args: Any, config: Any) -> None:
    """Submit nothing (round-trip latency of the session itself)."""


def empty_sub_remote(o: Any, args: Any, config: Any) -> None:
    """One SUB ``tests.support.sub_tasks:noop`` (round trip through an inner child)."""
    o.submit_sub(_sub("noop"))


def sleep_sub_remote(o: Any, args: Any, config: Any) -> None:
    """One SUB ``tests.support.sub_tasks:sleep_ms`` of scalars[0] ms (holds the run open)."""
    o.submit_sub(_sub("sleep_ms"), TaskArgs().add_scalar(args.scalars[0]))


def record_pid_remote(o: Any, args: Any, config: Any) -> None:
    """SUB ``tests.support.sub_tasks:record_pid``: tensors[0][scalars[0]] = the SUB child's pid."""
    o.submit_sub(
        _sub("record_pid"),
        TaskArgs().add_tensor(args.tensors[0], Tag.OUTPUT).add_scalar(args.scalars[0]),
    )


# -- a local L3 child (the nested tests) --------------------------------------------------------

DOUBLE = CallableHandle.for_import("tests.support.sub_tasks:sub_double")


def orch_double(o: Any, a: Any, c: Any) -> None:
    """L3 orchestration that names its SUB callable by import path (installed after init)."""
    o.submit_sub(DOUBLE, TaskArgs().add_tensor(a.tensors[0], Tag.INOUT))


def fill_from_values(o: Any, args: Any, config: Any) -> None:
    """SUB ``tests.support.sub_tasks:fill`` of tensors[0] with values[0] + kwargs["add"]
    (the TASK's values and kwargs reached the remote orchestration)."""
    n = int(args.values[0]) + int(args.kwargs["add"])
    o.submit_sub(_sub("fill"), TaskArgs().add_tensor(args.tensors[0], Tag.OUTPUT).add_scalar(n))
