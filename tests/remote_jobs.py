"""L3 orchestration functions the remote session tests run inside a runner.

Each has the ordinary ``(o, args, config)`` signature and submits SUB tasks of
``tests.tasks`` by import path (the session manifest installs them), so it cannot
tell a remote call from a local one.
"""

from __future__ import annotations

import time
from typing import Any

from simpler_daemon import Tag, TaskArgs
from simpler_daemon.callables import spec_for_import


def _sub(name: str) -> Any:
    return spec_for_import(f"tests.tasks:{name}", "sub").handle


def fill_remote(o: Any, args: Any, config: Any) -> None:
    """SUB ``tests.tasks:fill``: tensors[0][:] = scalars[0]."""
    o.submit_sub(
        _sub("fill"), TaskArgs().add_tensor(args.tensors[0], Tag.OUTPUT).add_scalar(args.scalars[0])
    )


def consume_remote(o: Any, args: Any, config: Any) -> None:
    """SUB ``tests.tasks:consume``: tensors[1][:] = tensors[0] + scalars[0]."""
    sub_args = (
        TaskArgs()
        .add_tensor(args.tensors[0], Tag.INPUT)
        .add_tensor(args.tensors[1], Tag.OUTPUT)
        .add_scalar(args.scalars[0])
    )
    o.submit_sub(_sub("consume"), sub_args)


def fail_remote(o: Any, args: Any, config: Any) -> None:
    """SUB ``tests.tasks:fail`` raises ValueError("producer exploded on purpose (N)")."""
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
    """One SUB ``tests.tasks:noop`` (round trip through an inner child)."""
    o.submit_sub(_sub("noop"))


def sleep_sub_remote(o: Any, args: Any, config: Any) -> None:
    """One SUB ``tests.tasks:sleep_ms`` of scalars[0] ms (holds the run open)."""
    o.submit_sub(_sub("sleep_ms"), TaskArgs().add_scalar(args.scalars[0]))
