"""One chip child behind one real two-frame ``LocalMailboxEndpoint`` (``ChipRig``), for the
chip-loop tests (children/test_chip_loop.py) and the child-fault tests that reuse it.

The kernels are ``tests.support.chip_kernels``, registered by path (``SPECS``); the
simulated backend writes a JSON-lines trace per child that ``ChipRig.trace`` reads.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from simpler_daemon.args import DEFAULT_CONFIG, CallConfig
from simpler_daemon.callables import CallableSpec, spec_for_chip
from simpler_daemon.children.chip import ChipContext, run_chip_child
from simpler_daemon.children.process import ChildProcess, fork_child, reap_all
from simpler_daemon.endpoints.base import EndpointEvent, EventKind, WorkerDispatch
from simpler_daemon.endpoints.local import LocalMailboxEndpoint
from simpler_daemon.heap import Heap
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.doorbell import Doorbell
from simpler_daemon.mailbox.layout import (
    BASE_FRAME,
    OFF_ACCEPTED,
    TASK_FRAMES,
    Mailbox,
    MailboxState,
)
from simpler_daemon.testing import poll_for
from tests.support import chip_kernels
from tests.support.endpoint_rig import EMPTY_BLOB, Gate, Slot

KERNELS = ("noop", "gate", "fail_prepare", "fail_launch", "fail_poll", "boom", "frame_state")


SPECS = {name: spec_for_chip(f"tests.support.chip_kernels:{name}") for name in KERNELS}


def digest(name: str) -> bytes:
    return SPECS[name].handle.digest


class ChipRig:
    """One chip child behind one real two-frame ``LocalMailboxEndpoint``."""

    def __init__(self, trace: Path, specs: list[CallableSpec], *, depth: int = 2) -> None:
        self.heap = Heap(1 << 20)
        self.doorbell = Doorbell()
        self.mailbox = Mailbox()
        self.trace_path = trace
        self.ctx = ChipContext(
            worker_id=0,
            label="chip 0",
            mailbox=self.mailbox,
            heap=self.heap,
            doorbell=self.doorbell,
            specs=specs,
            parent_pid=os.getpid(),
            error_prefix="chip_worker",
            pipeline_depth=depth,
            trace_path=str(trace),
        )
        self.child: ChildProcess | None = None
        self.endpoint: LocalMailboxEndpoint | None = None
        self.events: list[EndpointEvent] = []
        self.gates: list[Gate] = []

    def start(self) -> ChipRig:
        ctx = self.ctx
        chip_kernels.OBSERVED_MAILBOX = self.mailbox  # inherited by the child (frame_state)
        self.child = fork_child(lambda: run_chip_child(ctx), "chip 0")
        child = self.child

        def ready() -> bool:
            st = self.mailbox.state(BASE_FRAME)
            assert st != MailboxState.INIT_FAILED, self.mailbox.error_text(BASE_FRAME)
            assert not child.poll(), child.describe()
            return st == MailboxState.INIT_READY

        poll_for(ready, 10.0, message="chip child never reached INIT_READY")
        self.mailbox.set_state(BASE_FRAME, MailboxState.IDLE)
        _mb.wake_child(self.mailbox.buf)
        frames = 2 if self.mailbox.pipeline_depth() >= 2 else 1
        self.endpoint = LocalMailboxEndpoint(
            0, self.mailbox, child, task_frame_count=frames, label="chip 0"
        )
        return self

    def close(self) -> None:
        for g in self.gates:  # a wedged device thread would delay the child's exit
            g.release()
        chip_kernels.OBSERVED_MAILBOX = None
        with contextlib.suppress(Exception):
            self.mailbox.request_shutdown()
        if self.child is not None:
            reap_all([self.child], 5.0)
            self.child.close()
        self.mailbox.close()
        self.doorbell.close()
        self.heap.close()

    # -- task path ---------------------------------------------------------------------

    @property
    def ep(self) -> LocalMailboxEndpoint:
        assert self.endpoint is not None
        return self.endpoint

    def gate(self) -> Gate:
        g = Gate(self.heap)
        self.gates.append(g)
        return g

    def publish(
        self,
        name: str,
        dispatch_id: int,
        *,
        frame: int,
        blob: bytes = EMPTY_BLOB,
        prepare_only: bool = False,
        config: CallConfig = DEFAULT_CONFIG,
    ) -> WorkerDispatch:
        slot = Slot(
            digest(name),
            [blob],
            slot_id=dispatch_id,
            run_id=10 + frame,
            lease_slot=frame,
            lease_generation=frame + 1,
            config_bytes=config.encode(),
        )
        d = WorkerDispatch(slot, 0, dispatch_id=dispatch_id, prepare_only=prepare_only)
        self.ep.submit_progress(d)
        return d

    def poll(self) -> list[EndpointEvent]:
        self.ep.poll_progress(self.events)
        return self.events

    def wait_event(
        self, kind: EventKind, d: WorkerDispatch, timeout: float = 10.0
    ) -> EndpointEvent:
        def find() -> EndpointEvent | None:
            return next((e for e in self.poll() if e.kind is kind and e.dispatch is d), None)

        found = poll_for(
            find, timeout, interval=0.001, message=f"no {kind.name} for dispatch {d.dispatch_id}"
        )
        assert found is not None
        return found

    def kinds(self, d: WorkerDispatch) -> list[EventKind]:
        return [e.kind for e in self.events if e.dispatch is d]

    def state(self, frame: int) -> int:
        return _mb.load32(self.mailbox.buf, TASK_FRAMES[frame])

    def accepted(self, frame: int) -> int:
        return _mb.load32(self.mailbox.buf, TASK_FRAMES[frame] + OFF_ACCEPTED)

    # -- trace ---------------------------------------------------------------------------

    def trace(self) -> list[tuple[str, int]]:
        return [(r["event"], r["dispatch_id"]) for r in self.records()]

    def records(self) -> list[dict[str, Any]]:
        if not self.trace_path.exists():
            return []
        lines = self.trace_path.read_text().splitlines(keepends=True)
        return [json.loads(line) for line in lines if line.endswith("\n")]

    def at(self, event: str, dispatch_id: int) -> int:
        """Index of the first ``event`` of ``dispatch_id`` in the trace (asserts it exists)."""
        trace = self.trace()
        assert (event, dispatch_id) in trace, f"no {event} of dispatch {dispatch_id} in {trace}"
        return trace.index((event, dispatch_id))

    def count(self, event: str, dispatch_id: int) -> int:
        return self.trace().count((event, dispatch_id))
