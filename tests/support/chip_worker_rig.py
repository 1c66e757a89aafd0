"""A Worker with chip children (``Chips``): their traces and a recorder of Scheduler
events, for the chip tests (children/test_chip.py) and the fair-admission tests on chips.

A "long" run is a ``gate`` kernel (``tests.support.chip_kernels:gate``) that waits on
heap words a ``Gate`` holds; ``Chips.release_when`` releases it from a helper thread once
a condition holds (or after a deadline, so a broken engine fails the test instead of
hanging it).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simpler_daemon.args import Tag, TaskArgs
from simpler_daemon.callables import CallableHandle
from simpler_daemon.endpoints.base import WorkerDispatch
from simpler_daemon.engine.orchestrator import TaskSlot
from simpler_daemon.engine.worker import RunHandle, Worker
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.layout import (
    OFF_ACCEPTED,
    OFF_DISPOSITION,
    TASK_FRAMES,
)
from simpler_daemon.scheduler.lanes import WorkerCompletion


class Gate:
    """Three heap words driving ``chip_kernels.gate``: started, release, finished."""

    def __init__(self, w: Worker) -> None:
        self.words = w.alloc(3, "uint64")

    def args(self) -> TaskArgs:
        return TaskArgs().add_tensor(self.words, Tag.NO_DEP)

    def started(self) -> bool:
        return bool(self.words[0])

    def release(self) -> None:
        self.words[1] = 1

    def finished(self) -> bool:
        return bool(self.words[2])


class Chips:
    """A Worker with chip children, their traces and a recorder of Scheduler events."""

    def __init__(self, w: Worker, trace_dir: Path, handles: dict[str, CallableHandle]) -> None:
        self.w = w
        self.trace_dir = trace_dir
        self.k = handles
        self.gates: list[Gate] = []
        self.events: list[dict[str, Any]] = []
        self.threads: list[threading.Thread] = []
        self.closed = False
        assert w.scheduler is not None and w.manager is not None
        w.scheduler.on_task_event = self._on_task_event
        for lane in w.manager.next_level.values():
            lane.on_accept = self._accept_hook(lane.worker_id, lane.on_accept)

    # -- recording -----------------------------------------------------------------------

    def _on_task_event(self, slot: TaskSlot, kind: str, c: WorkerCompletion | None) -> None:
        rec: dict[str, Any] = {
            "kind": kind,
            "run": slot.run_id,
            "index": slot.index,
            "t": time.monotonic(),
        }
        if c is not None:
            rec.update(
                worker=c.worker_id,
                dispatch=c.dispatch.dispatch_id,
                outcome=c.outcome,
                message=c.message,
            )
            ep = self.endpoint(c.worker_id)
            rec["child_exited"] = ep.child is not None and ep.child.exited
        if kind == "staged":
            # FRAME_STAGED is also a transient state of an ordinary active dispatch
            # (TASK_READY -> FRAME_STAGED -> TASK_LAUNCHED); ``successor`` tells a
            # staged successor (published prepare_only, held in the lane's staged
            # capacity) from such an observation.
            assert self.w.manager is not None
            rec["successor"] = False
            for lane in self.w.manager.next_level.values():
                d = lane.staged
                if d is not None and d.task_slot is slot:
                    off = lane.endpoint.frame_for(d).off  # type: ignore[attr-defined]
                    buf = lane.endpoint.buf  # type: ignore[attr-defined]
                    rec.update(
                        successor=True,
                        worker=lane.worker_id,
                        dispatch=d.dispatch_id,
                        frame=TASK_FRAMES.index(off),
                        state=_mb.load32(buf, off),
                        accepted=_mb.load32(buf, off + OFF_ACCEPTED),
                        disposition=_mb.load32(buf, off + OFF_DISPOSITION),
                        trace=self.trace(lane.worker_id),
                    )
        self.events.append(rec)

    def _accept_hook(
        self, wid: int, inner: Callable[[WorkerDispatch], None]
    ) -> Callable[[WorkerDispatch], None]:
        def on_accept(d: WorkerDispatch) -> None:
            self.events.append(
                {
                    "kind": "accepted",
                    "run": d.task_slot.run_id,
                    "index": d.task_slot.index,
                    "worker": wid,
                    "dispatch": d.dispatch_id,
                    "t": time.monotonic(),
                }
            )
            inner(d)

        return on_accept

    def of(
        self, kind: str, run: int | None = None, index: int | None = None
    ) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events
            if e["kind"] == kind and run in (None, e["run"]) and index in (None, e["index"])
        ]

    def successors(self, run: int | None = None) -> list[dict[str, Any]]:
        """ "staged" events of successors staged ahead of their run (not transient active ones)."""
        return [e for e in self.of("staged", run) if e["successor"]]

    def staged_before(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """Every "staged" observation (of any kind) recorded before ``event``."""
        return [e for e in self.events[: self.events.index(event)] if e["kind"] == "staged"]

    def one(self, kind: str, run: int, index: int = 0) -> dict[str, Any]:
        found = self.of(kind, run, index)
        assert len(found) == 1, (
            f"expected one {kind} event of run {run} task {index}: {self.events}"
        )
        return found[0]

    def pos(self, kind: str, run: int, index: int = 0) -> int:
        return self.events.index(self.one(kind, run, index))

    # -- traces ------------------------------------------------------------------------------

    def records(self, chip: int) -> list[dict[str, Any]]:
        path = self.trace_dir / f"chip-{chip}.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines(keepends=True)
        return [json.loads(line) for line in lines if line.endswith("\n")]

    def trace(self, chip: int) -> list[tuple[str, int]]:
        return [(r["event"], r["dispatch_id"]) for r in self.records(chip)]

    def at(self, chip: int, event: str, dispatch_id: int) -> int:
        trace = self.trace(chip)
        assert (event, dispatch_id) in trace, (
            f"no {event} of dispatch {dispatch_id} on chip {chip}: {trace}"
        )
        return trace.index((event, dispatch_id))

    def t(self, chip: int, event: str, dispatch_id: int) -> float:
        rec = next(
            (
                r
                for r in self.records(chip)
                if (r["event"], r["dispatch_id"]) == (event, dispatch_id)
            ),
            None,
        )
        assert rec is not None, f"no {event} of dispatch {dispatch_id} on chip {chip}"
        return float(rec["t"])

    def count(self, chip: int, event: str, dispatch_id: int) -> int:
        return self.trace(chip).count((event, dispatch_id))

    # -- helpers ---------------------------------------------------------------------------------

    def endpoint(self, wid: int) -> Any:
        return self.w.chip_endpoints[wid]

    def gate(self) -> Gate:
        g = Gate(self.w)
        self.gates.append(g)
        return g

    def release_when(self, g: Gate, cond: Callable[[], bool], timeout: float = 10.0) -> None:
        """Release ``g`` from a helper thread once ``cond()`` holds (or after ``timeout``)."""

        def run() -> None:
            deadline = time.monotonic() + timeout
            while not self.closed and time.monotonic() < deadline:
                try:
                    if cond():
                        break
                except Exception:
                    pass
                time.sleep(0.002)
            if not self.closed:
                g.release()

        t = threading.Thread(target=run, name="gate-releaser", daemon=True)
        self.threads.append(t)
        t.start()

    def quiet_rounds(self, n: int = 10, seconds: float = 0.05) -> Callable[[], bool]:
        """A condition that holds once the Scheduler ran ``n`` more rounds and ``seconds`` passed."""
        assert self.w.scheduler is not None
        stats = self.w.scheduler.stats
        start: list[tuple[int, float]] = []

        def cond() -> bool:
            if not start:
                start.append((stats["rounds"], time.monotonic()))
                return False
            r0, t0 = start[0]
            return stats["rounds"] - r0 >= n and time.monotonic() - t0 >= seconds

        return cond

    def close(self) -> None:
        self.closed = True  # releaser threads stop waiting
        for g in self.gates:  # a held kernel would delay the child's exit
            g.release()
        for t in self.threads:
            t.join(15.0)
        self.w.close(timeout=10.0)


def wait_all(*handles: RunHandle, timeout: float = 20.0) -> None:
    for h in handles:
        h.wait(timeout)
