"""The Scheduler's interfaces to the engine above it, each kept narrow.

* :class:`SubmitSink` is what an ``Orchestrator`` submits into (the Scheduler
  implements it; tests give it a small fake).
* :class:`RemoteTensors` is what the Orchestrator and the Scheduler need of a
  level-4 Worker's remote buffers (``engine/remote_l3.py`` implements it).
* :class:`RunControl` is what the engine's run builder (``engine/runs.py``) may call
  to move a run through its life.

Nothing else of the Scheduler is called from outside ``scheduler/`` but
``Scheduler.round`` and the lane registration the pool does at start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from simpler_daemon.taskvalues import DEFAULT_MAX_VALUE_BYTES

if TYPE_CHECKING:
    from collections.abc import Callable

    from simpler_daemon.args import TensorDesc
    from simpler_daemon.callables import CallableHandle
    from simpler_daemon.heap import Heap
    from simpler_daemon.scheduler.runmodel import Admission, Run, TaskSlot

__all__ = ["RemoteTensors", "RunControl", "SubmitSink"]


class RemoteTensors(Protocol):
    """The L4 side of remote buffers, as the Orchestrator sees it (``None`` below L4)."""

    def is_remote(self, worker_id: int) -> bool: ...

    def describe(self, ref: Any, target: int, where: str) -> TensorDesc:
        """Descriptor of ``ref`` for a task on remote worker ``target``; ``ValueError``
        naming ``where`` when the buffer is freed, stale, or not readable there."""
        ...

    def pin(self, key: tuple[int, ...]) -> None: ...

    def unpin(self, key: tuple[int, ...]) -> None: ...

    def check_installed(self, handle: CallableHandle, targets: list[int], api: str) -> None:
        """``ValueError`` when a remote target does not have ``handle`` installed."""
        ...


class SubmitSink:
    """What the Orchestrator needs from the Scheduler (kept narrow for tests)."""

    heap: Heap
    #: The most one task's values and kwargs may take encoded (``Worker(max_value_bytes=)``).
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    #: Remote buffers of an L4 worker with remote children; ``None`` otherwise.
    remote: RemoteTensors | None = None
    #: The last handle ``validate_handle`` accepted for ``submit_sub`` and its registry
    #: entry (``callables.Registration``): while that entry is active, the same handle
    #: needs no new validation (an active entry is never dropped or replaced without
    #: leaving the active state first). ``None``: validate every submit.
    valid_sub: tuple[CallableHandle, Any] | None = None

    def validate_handle(
        self, handle: Any, role: str, api: str
    ) -> CallableHandle:  # pragma: no cover
        raise NotImplementedError

    def validate_targets(self, targets: list[int], api: str) -> None:  # pragma: no cover
        raise NotImplementedError

    def add_slot(self, slot: TaskSlot) -> None:  # pragma: no cover
        raise NotImplementedError

    def next_slot_id(self) -> int:  # pragma: no cover
        raise NotImplementedError

    def fail_at_submit(self, slot: TaskSlot, producer: TaskSlot) -> None:  # pragma: no cover
        raise NotImplementedError


class RunControl(Protocol):
    """What the run builder calls to move a run from submit to its end."""

    heap: Heap
    remote: RemoteTensors | None
    admission: Admission
    on_admit: Callable[[Run], None] | None

    @property
    def submit_sink(self) -> SubmitSink:
        """What the run's ``Orchestrator`` submits into."""
        ...

    def submit_run(self, run: Run) -> list[Run]:
        """Queue ``run`` for admission; returns the runs admitted now."""
        ...

    def finish_building(self, run: Run) -> None:
        """The orchestration function returned: the run ends once its slots retire."""
        ...

    def fail_building(self, run: Run, exc: BaseException) -> None:
        """The orchestration function raised ``exc``: the run fails with its text."""
        ...

    def cancel(self, run: Run, *, record: bool = True) -> None:
        """Fail every unstarted slot of ``run``; running tasks finish."""
        ...

    def drop_unadmitted(self, run: Run) -> None:
        """``run`` was cancelled before it was admitted: it is FAILED now."""
        ...

    def release_run_memory(self, run: Run) -> None:
        """A terminal ``run`` lets go of its buffers, pins and orchestration."""
        ...

    def finish_if_done(self, run: Run) -> None:
        """``run`` turns terminal now if nothing of it is left to run or build."""
        ...
