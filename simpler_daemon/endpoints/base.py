"""The WorkerEndpoint contract every transport implements.

An endpoint is progress-driven: the Scheduler's single thread submits work,
forwards activations, and polls for events; nothing blocks inside a round.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol


class Outcome(IntEnum):
    """Terminal result of one dispatch. There is no implicit success."""

    SUCCESS = 0
    TASK_FAILURE = 1
    ENDPOINT_FAILURE = 2
    SKIPPED = 3
    #: Stopped on purpose: its run was cancelled with ``terminate`` and its child killed.
    CANCELLED = 4


class EventKind(IntEnum):
    FRAME_STAGED = 1
    ACCEPTED = 2
    COMPLETED = 3


class SlotView(Protocol):
    """What an endpoint reads from a task slot to publish one dispatch."""

    slot_id: int
    run_id: int
    lease_slot: int
    lease_generation: int
    digest: bytes
    config_bytes: bytes
    blobs: list[bytes]
    hashid: str


@dataclass(slots=True)
class WorkerDispatch:
    """One publication: a slot (and group member) onto one lane."""

    task_slot: Any  # SlotView
    group_index: int = 0
    dispatch_id: int = 0
    prepare_only: bool = False
    #: ``time.monotonic()`` when the Scheduler issued it (dispatch-to-completion latency).
    issued_at: float = 0.0


@dataclass(slots=True)
class EndpointEvent:
    kind: EventKind
    dispatch: WorkerDispatch
    outcome: Outcome = Outcome.SUCCESS
    error: int = 0
    message: str = ""
    disposition: int = 0


@dataclass(frozen=True, slots=True)
class EndpointCaps:
    task_frame_count: int = 1
    supports_frame_staging: bool = False
    capacity: int = 1
    #: Completions bump the doorbell word (mailbox children). A socket endpoint's do not:
    #: its readiness reaches a parked poll(2) or the loop's readers, so never spin for it.
    signals_doorbell: bool = True


class WorkerEndpoint(Protocol):
    caps: EndpointCaps
    label: str

    @property
    def poisoned(self) -> bool: ...

    def submit_progress(self, d: WorkerDispatch) -> None:
        """Publish ``d``; raises ``EndpointError`` when the endpoint refuses."""

    def activate_progress(self, dispatch_id: int) -> bool: ...

    def poll_progress(self, out: list[EndpointEvent]) -> None: ...

    def owned(self) -> int: ...

    def request_stop(self) -> None: ...
