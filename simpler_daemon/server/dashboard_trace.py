"""A run's task stream as a Chrome trace, recorded from its events while a page asks.

The dashboard's run view draws a Gantt chart per lane. The run record keeps no task
history of its own (it costs nothing when nobody watches: run_record.py), so this
module watches a run the way ``WatchRun`` does, from the first time its trace is asked
for, and turns the events into Chrome-trace spans::

    GET /api/runs/7/trace --> RunTraces.trace(rec) --first time--> task: rec.events()
         TASK_DISPATCHED (task 3, member 0, t0) ... TASK_COMPLETED (worker 1, t1)
         --> {"ph": "X", "name": "add", "ts": t0, "dur": t1 - t0, "tid": <sub 1>}

What it costs is bounded: spans per run (:data:`MAX_SPANS`), runs kept
(:data:`MAX_TRACES`, the least recently asked for dropped first), and a recorder
nobody asked for in :data:`IDLE_STOP_S` stops. A run that ran while no page looked
has no spans (the trace says so in ``otherData.note``). Load the JSON into
``chrome://tracing`` or Perfetto.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Final

from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

__all__ = ["IDLE_STOP_S", "MAX_SPANS", "MAX_TRACES", "RunTraces"]

#: Spans kept per run; later tasks are counted, not kept.
MAX_SPANS: Final = 5000
#: Runs whose recordings are kept.
MAX_TRACES: Final = 16
#: Seconds a recorder goes on without anybody asking for its trace.
IDLE_STOP_S: Final = 30.0
_MAX_MESSAGE: Final = 512


@dataclass
class _Recording:
    run_id: int
    started_us: float
    asked: float
    spans: list[dict[str, Any]] = field(default_factory=list)
    lanes: dict[str, int] = field(default_factory=dict)
    #: Dispatched, not finished: (start us, callable name, task kind, since recording).
    open: dict[tuple[int, int], tuple[float, str, str, bool]] = field(default_factory=dict)
    dropped: int = 0
    lagged: bool = False
    done: bool = False
    task: asyncio.Task[None] | None = None


def _us(stamp: Any) -> float:
    return float(stamp.seconds * 1e6 + stamp.nanos / 1e3)


class RunTraces:
    """The recordings of the runs the dashboard was asked about (all on the loop)."""

    def __init__(self) -> None:
        self._runs: OrderedDict[int, _Recording] = OrderedDict()

    def trace(self, rec: Any) -> dict[str, Any]:
        """The Chrome trace of run ``rec`` (a RunRecord) so far; starts recording it if
        it is still running."""
        now = time.monotonic()
        got = self._runs.get(rec.run_id)
        if got is None:
            got = _Recording(rec.run_id, time.time() * 1e6, now)
            self._runs[rec.run_id] = got
            if rec.terminal:
                got.done = True
            else:
                got.task = asyncio.get_running_loop().create_task(
                    self._record(rec, got), name=f"dashboard-trace-{rec.run_id}"
                )
            while len(self._runs) > MAX_TRACES:
                _, old = self._runs.popitem(last=False)
                if old.task is not None:
                    old.task.cancel()
        self._runs.move_to_end(rec.run_id)
        got.asked = now
        return self._render(rec, got)

    async def close(self) -> None:
        """Stop every recorder (the daemon stops)."""
        tasks = [r.task for r in self._runs.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._runs.clear()

    async def _record(self, rec: Any, got: _Recording) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def check_idle() -> None:  # nobody asked for a while: the page was closed
            if got.done:
                return
            if time.monotonic() - got.asked > IDLE_STOP_S:
                task.cancel()
            else:
                timer[0] = loop.call_later(IDLE_STOP_S / 3, check_idle)

        timer = [loop.call_later(IDLE_STOP_S / 3, check_idle)]
        events = rec.events()
        try:
            async for event in events:
                self._add(rec, got, event)
        finally:
            timer[0].cancel()
            await events.aclose()
            got.done = True
            got.task = None

    @staticmethod
    def _task(rec: Any, task_index: int) -> tuple[str, str]:
        """(callable name, task kind) of a task while the run holds its slots (read at
        dispatch: a finished run lets go of them before its last events are read)."""
        run = rec.run
        if run is not None and 0 <= task_index < len(run.slots):
            slot = run.slots[task_index]
            return str(slot.handle.name), slot.kind.name.lower()
        return f"task {task_index}", "task"

    def _add(self, rec: Any, got: _Recording, event: Any) -> None:
        etype = event.type
        if etype == pb.RUN_EVENT_TYPE_SNAPSHOT:
            if got.open or got.spans:  # a second snapshot: the watcher lagged
                got.lagged = True
            return
        key = (event.task_index, event.member_index)
        if etype == pb.RUN_EVENT_TYPE_TASK_DISPATCHED:
            got.open[key] = (_us(event.time), *self._task(rec, event.task_index), False)
            return
        if etype not in (pb.RUN_EVENT_TYPE_TASK_COMPLETED, pb.RUN_EVENT_TYPE_TASK_FAILED):
            return
        start = got.open.pop(key, None)
        if start is None:
            if etype == pb.RUN_EVENT_TYPE_TASK_FAILED and not event.worker_id:
                return  # never dispatched (skipped behind a failure): nothing ran
            # Running when the recording began: drawn from then (args.since_recording).
            start = (got.started_us, *self._task(rec, event.task_index), True)
        if len(got.spans) >= MAX_SPANS:
            got.dropped += 1
            return
        lane = f"{start[2]} worker {event.worker_id}"
        tid = got.lanes.setdefault(lane, len(got.lanes) + 1)
        end = _us(event.time)
        got.spans.append(
            {
                "name": start[1],
                "cat": "task",
                "ph": "X",
                "ts": round(start[0], 1),
                "dur": round(max(end - start[0], 0.0), 1),
                "pid": 1,
                "tid": tid,
                "args": {
                    "task_index": event.task_index,
                    "member_index": event.member_index,
                    "outcome": event.outcome or "SUCCESS",
                    "message": event.message[:_MAX_MESSAGE],
                    "since_recording": start[3],
                },
            }
        )

    def _render(self, rec: Any, got: _Recording) -> dict[str, Any]:
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": f"run {rec.run_id}"}}
        ]
        for lane, tid in got.lanes.items():
            events.append(
                {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": lane}}
            )
        events += got.spans
        notes = []
        if not got.spans and got.done:
            notes.append(
                "no tasks recorded: the dashboard records a run's task stream from its "
                "events only while the run's page is open"
            )
        elif rec.submit_ns / 1e3 < got.started_us - 1e6 and not rec.terminal:
            notes.append("recorded since the run's page was first opened")
        if got.lagged:
            notes.append("some events were missed (the recorder lagged behind)")
        if got.dropped:
            notes.append(f"{got.dropped} tasks past the first {MAX_SPANS} not drawn")
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "run_id": rec.run_id,
                "recording": not got.done,
                "note": "; ".join(notes),
            },
        }
