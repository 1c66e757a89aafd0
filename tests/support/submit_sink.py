"""What an Orchestrator submits to, without a Scheduler: ``Sink`` records every slot it is
given (the orchestrator and remote-tensor tests), and ``SUB``/``CHIP`` are handles of
``tests.support.sub_tasks`` to submit."""

from __future__ import annotations

from typing import Any

from simpler_daemon.callables import CallableHandle, spec_for_chip, spec_for_import
from simpler_daemon.engine.orchestrator import (
    SlotState,
    SubmitSink,
    TaskSlot,
)
from simpler_daemon.heap import Heap

SUB = spec_for_import("tests.support.sub_tasks:fill").handle


CHIP = spec_for_chip("tests.support.sub_tasks:kernel").handle


class Sink(SubmitSink):
    """The narrow SubmitSink an Orchestrator talks to, recording what it is given."""

    def __init__(self, heap: Heap, workers: tuple[int, ...] = (0, 1, 2)) -> None:
        self.heap = heap
        self.workers = set(workers)
        self.added: list[TaskSlot] = []
        self.failed_at_submit: list[tuple[TaskSlot, TaskSlot]] = []
        self._ids = 0

    def validate_handle(self, handle: Any, role: str, api: str) -> CallableHandle:
        if not isinstance(handle, CallableHandle):
            raise TypeError(f"cannot {api}: expected a CallableHandle")
        return handle

    def validate_targets(self, targets: list[int], api: str) -> None:
        for w in targets:
            if w not in self.workers:
                raise ValueError(f"cannot {api}: worker={w} is not a registered NEXT_LEVEL worker")

    def add_slot(self, slot: TaskSlot) -> None:
        if slot.deps == 0:
            slot.state = SlotState.READY
        self.added.append(slot)

    def next_slot_id(self) -> int:
        self._ids += 1
        return self._ids

    def fail_at_submit(self, slot: TaskSlot, producer: TaskSlot) -> None:
        slot.state = SlotState.FAILED
        slot.run.remaining -= 1
        self.failed_at_submit.append((slot, producer))
