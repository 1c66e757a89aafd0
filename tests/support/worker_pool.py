"""The one ``Pool``: a started Worker over real SUB children with a handle per helper task.

The Worker, background-progress, run-future, fair-admission, chaos and run-fault tests
all use it, through the ``make_pool`` and ``pool`` fixtures of ``tests/conftest.py`` or
directly. The helpers are functions of ``tests.support.sub_tasks``, registered by object
(the children inherit them through fork) before ``init``; ``h[name]`` is the handle of
one. A test module names the helpers it needs (``POOL_TASKS``): a helper registered by
the Pool is one the test can no longer register "for the first time" after init.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from simpler_daemon import CallableHandle, RunHandle, Tag, Worker
from simpler_daemon.errors import TaskError
from tests.support import sub_tasks
from tests.support.sub_tasks import targs

#: The helpers a Pool registers unless told otherwise.
TASKS = (
    "fill",
    "consume",
    "marked_fill",
    "marked_consume",
    "rendezvous",
    "record_pid",
    "record_pid_rendezvous",
    "fail",
    "wait_flag",
    "sleep_ms",
    "chain_step",
    "noop",
    "add_one",
)


class Pool:
    """A started Worker of ``n`` SUB children whose Scheduler uses ``admission``, plus a
    handle per helper in ``tasks`` (registered before init)."""

    def __init__(
        self, n: int = 2, *, admission: str = "fifo", tasks: Sequence[str] = TASKS
    ) -> None:
        self.w = Worker(num_sub_workers=n, admission=admission)
        self.h: dict[str, CallableHandle] = {
            name: self.w.register(getattr(sub_tasks, name)) for name in tasks
        }
        self.w.init()
        assert self.w.scheduler is not None
        assert self.w.scheduler.admission_policy == admission

    # -- the children ------------------------------------------------------------------------

    def pids(self) -> set[int]:
        return {info["pid"] for info in self.w.list_workers()}

    def sub_info(self) -> list[dict[str, Any]]:
        return [i for i in self.w.list_workers() if i["kind"] == "sub"]

    def worker_of(self, pid: int) -> int:
        return next(i["worker_id"] for i in self.sub_info() if i["pid"] == pid)

    def live_pids(self) -> set[int]:
        return {i["pid"] for i in self.sub_info() if i["alive"] and i["poisoned"] is None}

    # -- runs --------------------------------------------------------------------------------

    def submit(self, orch: Callable[..., None], priority: int = 1) -> RunHandle:
        return self.w.submit(orch, priority=priority)

    def one(self, handle: CallableHandle, *scalars: int) -> Any:
        """An orchestration of one task of ``handle`` with ``scalars``."""

        def orch(o: Any, args: Any, config: Any) -> None:
            o.submit_sub(handle, targs(scalars=scalars))

        return orch

    def waiting_on(self, flags: Any, index: int = 0) -> Any:
        """An orchestration of one ``wait_flag`` task that waits until ``flags[index]`` is set."""
        h = self.h["wait_flag"]

        def orch(o: Any, args: Any, config: Any) -> None:
            o.submit_sub(h, targs((flags, Tag.NO_DEP), scalars=(index, 0, 30_000)))

        return orch

    def gated_double(self, flags: Any, value: int = 7) -> Any:
        """An orchestration of one ``gated_double`` task: it returns ``2 * value`` once
        ``flags[0]`` is set."""
        h = self.h["gated_double"]

        def orch(o: Any, args: Any, config: Any) -> None:
            o.submit_sub(h, targs((flags, Tag.NO_DEP), scalars=(value,)))

        return orch

    def chain(self, counter: Any, n: int) -> Any:
        """An orchestration of ``n`` INOUT-ordered ``chain_step`` tasks on ``counter``."""
        h = self.h["chain_step"]

        def orch(o: Any, args: Any, config: Any) -> None:
            for i in range(n):
                o.submit_sub(h, targs((counter, Tag.INOUT), scalars=(i,)))

        return orch

    def stuck(self) -> tuple[RunHandle, Any]:
        """A run whose one task records its pid, then waits 60 s for a flag nobody sets."""
        flags = self.w.alloc((1,), "int64")
        started = self.w.alloc((1,), "int64")
        h = self.h["wait_flag"]

        def orch(o: Any, args: Any, config: Any) -> None:
            o.submit_sub(
                h, targs((flags, Tag.NO_DEP), (started, Tag.NO_DEP), scalars=(0, 0, 60_000))
            )

        return self.w.submit(orch), started


def run_to_end(w: Worker, orch: Any) -> Any:
    """Submit the orchestration ``orch`` and wait until its run is terminal, failed or
    not (a ``TaskError`` is the run's outcome, not the test's): the engine's Run."""
    h = w.submit(orch)
    try:
        h.wait(60)
    except TaskError:
        pass
    assert h.run.terminal
    return h.run
