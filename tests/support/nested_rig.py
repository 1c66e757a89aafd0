"""An L4 Worker over nested LOCAL L3 children, for the nested tests (engine/test_local_l3.py)
and the cancel and child-fault tests that build the same tree::

    this process: Worker(level=4)  --mailbox-->  L3 child (inner Worker)  --mailbox-->  SUB / chip

``closing(w4)`` closes the tree and then checks that every pid collected while it ran
(``subtree``) is gone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from simpler_daemon import CallConfig, Tag, TaskArgs
from simpler_daemon.callables import CallableHandle
from simpler_daemon.engine.worker import Worker, WorkerState
from simpler_daemon.testing import alive, child_pids, poll_for

HEAP = 1 << 20


def forward(handle: CallableHandle) -> Callable[[Any, Any, Any], None]:
    """An L3 orchestration: one SUB task with the parent's tensors (INOUT) and scalars."""

    def orch(o: Any, a: Any, c: Any) -> None:
        t = TaskArgs()
        for x in a.tensors:
            t.add_tensor(x, Tag.INOUT)
        for s in a.scalars:
            t.add_scalar(s)
        o.submit_sub(handle, t)

    return orch


def l4_call(
    orch: CallableHandle, worker: int, tensors: list[Any], scalars: tuple[int, ...] | list[int] = ()
) -> Callable[[Any, Any, Any], None]:
    """An L4 orchestration: one NEXT_LEVEL task on ``worker`` with tensors (INOUT), scalars."""

    def run(o: Any, a: Any, c: Any) -> None:
        t = TaskArgs()
        for x in tensors:
            t.add_tensor(x, Tag.INOUT)
        for s in scalars:
            t.add_scalar(s)
        o.submit_next_level(orch, t, CallConfig(), worker=worker)

    return run


def subtree(w4: Worker) -> set[int]:
    """Every process below ``w4``'s L3 children: the children, their SUB / chip children and
    their inner fork servers (the /proc children of each L3 child)."""
    pids: set[int] = set()
    for row in w4.list_workers():
        if row["kind"] == "l3" and row["pid"]:
            pids.add(row["pid"])
            pids |= child_pids(row["pid"])
            pids |= {r["pid"] for r in row["children"] if r.get("pid")}
    return pids


def assert_gone(pids: set[int], timeout: float = 10.0) -> None:
    poll_for(
        lambda: not [p for p in pids if alive(p)],
        timeout=timeout,
        message=f"processes outlived the tree: {[p for p in pids if alive(p)]}",
    )


@contextlib.contextmanager
def closing(w4: Worker) -> Iterator[set[int]]:
    """Close ``w4`` at the end; then every pid the yielded set collected must be gone."""
    seen: set[int] = set()
    try:
        yield seen
    finally:
        with contextlib.suppress(Exception):
            if w4.state is WorkerState.READY:
                seen |= subtree(w4)
        w4.close(timeout=5.0)
        assert_gone(seen)


def l3_worker(num_sub_workers: int = 1, **kw: Any) -> Worker:
    kw.setdefault("startup_timeout", 20.0)
    return Worker(level=3, num_sub_workers=num_sub_workers, heap_bytes=HEAP, **kw)


def l4_worker(**kw: Any) -> Worker:
    kw.setdefault("startup_timeout", 20.0)
    return Worker(level=4, heap_bytes=HEAP, **kw)
