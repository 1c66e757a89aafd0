"""A run's task stream: one record per task attempt, exported as a Chrome trace.

Recording is opt-in per Worker (``Worker(trace=True)``; the daemon's Worker always
traces): a traced run carries a :class:`RunTrace` and the Scheduler's
``on_task_event`` hook is wrapped by :func:`traced`, which notes the dispatch and the
completion of each attempt. An untraced Worker installs no hook, so its SUB tasks stay
on the C pump's path and pay nothing. The timestamps are the ones the Scheduler sees:
an attempt starts when the task is handed to its lane and ends when its completion is
drained (tasks the C pump completes in a batch end at the batch's drain)::

    dispatched, redispatched (a group member's retry)
                -> open[(slot, member)] = (t, attempt)
    completed, retried (a failed attempt that runs again)
                -> attempts += (index, member, attempt, t0, t1, lane, outcome, name)
    requeued    -> the open attempt is dropped (the child never picked it up)

A task the C SUB pump publishes notes no dispatch: its slot's ``dispatched_ns`` (set by
``claim_published``) is the attempt's start, read when it completes (in a batch,
``on_pumped``, or on the Python path).

:meth:`RunTrace.chrome` gives the Chrome Trace Event format (``{"traceEvents": [...]}``)
that Perfetto and ``chrome://tracing`` load: one complete event (``ph: "X"``) per
attempt, ``ts``/``dur`` in microseconds from the run's submission, ``pid`` 1 = the
Worker, ``tid`` = the lane (0 is the run itself: its queueing and its execution), with
``process_name``/``thread_name`` metadata events naming them.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from itertools import repeat
from typing import TYPE_CHECKING, Any, Final

from simpler_daemon.scheduler.runmodel import by_run

if TYPE_CHECKING:
    from simpler_daemon.scheduler.lanes import WorkerCompletion
    from simpler_daemon.scheduler.runmodel import TaskSlot

__all__ = ["MAX_TRACE_ATTEMPTS", "RunTrace", "traced", "traced_pumped"]

#: Attempts one run's trace keeps; later ones are counted in ``dropped`` (a run of up to
#: the daemon's default limits.max_tasks_per_run tasks, each run once, fits).
MAX_TRACE_ATTEMPTS: Final = 100_000
#: ``tid`` of the run's own events, and the first ``tid`` of the NEXT_LEVEL lanes (SUB
#: lane ``i`` is ``tid`` 1 + i, NEXT_LEVEL lane ``i`` is NEXT_LEVEL_TID + i).
RUN_TID: Final = 0
NEXT_LEVEL_TID: Final = 100_001
#: Integers kept per attempt (``RunTrace.ints``).
FIELDS: Final = 7
#: Bytes one kept attempt costs in memory (its integers and its name's reference, with
#: the containers' spare room), for the daemon's accounting of finished runs.
ATTEMPT_BYTES: Final = 72
#: Outcome names by code, for every trace of the process (a handful of enum names).
_OUTCOME_NAMES: list[str] = []
_OUTCOME_CODES: dict[str, int] = {}


def _outcome_code(name: str) -> int:
    """The code of outcome ``name`` in every trace of the process (given on first use)."""
    code = _OUTCOME_CODES.get(name)
    if code is None:
        code = _OUTCOME_CODES[name] = len(_OUTCOME_NAMES)
        _OUTCOME_NAMES.append(name)
    return code


_SUCCESS_CODE: Final = _outcome_code("SUCCESS")

#: A pending batch of the C pump's completions (``RunTrace._batches``).
_Batch = tuple[int, int, list["TaskSlot"], "list[int] | None"]

TaskEvent = Callable[["TaskSlot", str, "WorkerCompletion | None"], None]


class RunTrace:
    """The task attempts of one run, and when it was submitted, admitted and ended
    (``time.perf_counter_ns``; ``wall_ns``: ``time.time_ns`` at submission).

    A finished run keeps its trace as long as its status (``limits.max_finished_run_bytes``
    counts it), so an attempt is stored compactly: :data:`FIELDS` integers in one
    ``array`` and a reference to its callable's (shared) name; the bookkeeping of the
    attempts under way is dropped when the run ends (:meth:`end`)."""

    __slots__ = (
        "_batches",
        "_pending",
        "admitted_ns",
        "dropped",
        "ended_ns",
        "ints",
        "names",
        "open",
        "submitted_ns",
        "tries",
        "wall_ns",
    )

    def __init__(self) -> None:
        self.submitted_ns = time.perf_counter_ns()
        self.wall_ns = time.time_ns()
        self.admitted_ns = 0
        self.ended_ns = 0
        #: FIELDS integers per attempt: task index, member, attempt number, start and end
        #: (ns after submission), lane (SUB lane i: i; NEXT_LEVEL lane i: -1 - i), outcome
        #: (an index into the module's outcome names).
        self.ints = array("q")
        #: The callable's name per attempt (the handle's own string: shared, not copied).
        self.names: list[str] = []
        #: (slot id, member) -> (start ns, attempt number) of the attempt running now.
        self.open: dict[tuple[int, int], tuple[int, int]] = {}
        #: (slot id, member) -> attempts made so far of a task that was retried (until its
        #: last attempt ends): the next one's number is one more.
        self.tries: dict[tuple[int, int], int] = {}
        self.dropped = 0
        #: Batches of the C pump's completions not written into ``ints`` yet: (end ns,
        #: lane, slots, their attempt numbers; None: all first ones), each a success
        #: (:meth:`settle`).
        self._batches: list[_Batch] = []
        self._pending = 0  # attempts in them

    def __len__(self) -> int:
        """Attempts kept."""
        return len(self.names) + self._pending

    def on_event(self, slot: TaskSlot, event: str, c: WorkerCompletion | None) -> None:
        """The Scheduler's task event for a slot of this run (twice per task: written for
        that, so the enums' plain ``_name_`` and ``_value_``, and ``tries`` only for a task
        that was retried)."""
        if event == "dispatched" or (event == "redispatched" and c is not None):
            if c is None:
                member = slot.members_started - 1
                if member < 0:
                    member = 0
            else:
                member = c.dispatch.group_index
            key = (slot.slot_id, member)
            tries = self.tries
            self.open[key] = (time.perf_counter_ns(), tries.get(key, 0) + 1 if tries else 1)
        elif (event == "completed" or event == "retried") and c is not None:
            key = (slot.slot_id, c.dispatch.group_index)
            started = self.open.pop(key, None)
            now = time.perf_counter_ns()
            if started is not None:
                t0, n = started
            elif key[1] == 0 and hasattr(slot, "dispatched_ns"):
                # Published by the C pump (``on_pumped`` notes no dispatch), ended here.
                t0 = slot.dispatched_ns
                n = self.tries.get(key, 0) + 1 if self.tries else 1
            else:
                t0, n = now, 1
            if event == "retried":
                self.tries[key] = n  # the next attempt is number n + 1
            elif self.tries:  # its last attempt: no number to give any more
                self.tries.pop(key, None)
            if len(self.names) + self._pending >= MAX_TRACE_ATTEMPTS:
                self.dropped += 1
                return
            code = _outcome_code(c.outcome._name_)
            lane = c.worker_id if c.worker_type._value_ == "sub" else -1 - c.worker_id
            base = self.submitted_ns
            self.ints.extend((slot.index, key[1], n, t0 - base, now - base, lane, code))
            self.names.append(slot.handle.name)
        elif event == "requeued":
            # Never picked up: not an attempt (its number is given again).
            self.open.pop((slot.slot_id, max(slot.members_started - 1, 0)), None)

    def on_pumped(self, slots: list[TaskSlot], worker_id: int) -> None:
        """``on_event`` of "completed" for a batch of the C pump's (each a SUCCESS on
        SUB lane ``worker_id``, at the batch's timestamp; its start the slot's
        ``dispatched_ns``: a pumped dispatch has nothing to note). Kept as the batch,
        written out by :meth:`settle`, so the run's own path pays one append a batch."""
        now = time.perf_counter_ns()
        tries = self.tries
        # A retried task's earlier attempts: this one is the next, and its last.
        attempts = [tries.pop((s.slot_id, 0), 0) + 1 for s in slots] if tries else None
        k = len(slots)
        room = MAX_TRACE_ATTEMPTS - len(self.names) - self._pending
        if k > room:
            self.dropped += k - max(room, 0)
            if room <= 0:
                return
            slots, k = slots[:room], room
        self._batches.append((now, worker_id, slots[:], attempts))
        self._pending += k

    def settle(self) -> None:
        """Write the pending batches of the C pump's completions into ``ints`` and
        ``names`` and let go of their slots (the daemon calls it on its loop once a
        run's answer is written; an engine run's trace keeps them while its run does)."""
        batches = self._batches
        if not batches:
            return
        self._batches = []
        self._pending = 0
        self._write(batches, self.ints, self.names)

    def _write(self, batches: list[_Batch], ints: array[int], names: list[str]) -> None:
        base = self.submitted_ns
        code = _SUCCESS_CODE
        for t1, lane, slots, attempts in batches:
            end = t1 - base
            # attempts may be longer (a batch cut at MAX_TRACE_ATTEMPTS), repeat() endless
            for slot, n in zip(slots, attempts or repeat(1), strict=False):
                ints.extend((slot.index, 0, n, slot.dispatched_ns - base, end, lane, code))
                names.append(slot.handle.name)

    def end(self) -> None:
        """The run ended: note when, and drop the bookkeeping of attempts under way."""
        self.ended_ns = time.perf_counter_ns()
        self.open = {}
        self.tries = {}

    def nbytes(self) -> int:
        """About what the kept trace costs in memory (the pending batches as written)."""
        return 512 + ATTEMPT_BYTES * (len(self.names) + self._pending)

    def chrome(self, run_id: int, *, state: str = "", worker: str = "Worker") -> dict[str, Any]:
        """The trace in Chrome Trace Event format (see the module docstring); ``state``
        the run's state for the run's own event, ``worker`` the process's name.

        Reads without writing (any thread may ask while the run runs): the pending
        batches are rendered from a copy, and stay pending."""
        base = self.submitted_ns
        lanes: dict[int, str] = {}
        events: list[dict[str, Any]] = []
        ints, names = self.ints, self.names
        if self._batches:
            ints, names = array("q", ints), names[:]
            self._write(self._batches[:], ints, names)
        for k, name in enumerate(names):
            index, member, attempt, t0, t1, lane, code = ints[k * FIELDS : (k + 1) * FIELDS]
            sub = lane >= 0
            lane_id = lane if sub else -1 - lane
            tid = (1 + lane_id) if sub else (NEXT_LEVEL_TID + lane_id)
            lanes.setdefault(tid, f"sub worker {lane_id}" if sub else f"worker {lane_id}")
            outcome = _OUTCOME_NAMES[code]
            args: dict[str, Any] = {"task": index, "attempt": attempt, "outcome": outcome}
            if member:
                args["member"] = member
            events.append(
                {
                    "name": name,
                    "cat": "task",
                    "ph": "X",
                    "ts": t0 / 1000,
                    "dur": max(t1 - t0, 0) / 1000,
                    "pid": 1,
                    "tid": tid,
                    "args": args,
                }
            )
        run_args: dict[str, Any] = {"run_id": run_id}
        if state:
            run_args["state"] = state
        admitted = self.admitted_ns or self.ended_ns
        if admitted:
            events.append(_run_event("queued", 0, admitted - base, run_args))
        if self.admitted_ns:
            end = self.ended_ns or time.perf_counter_ns()
            events.append(
                _run_event(
                    f"run {run_id}", self.admitted_ns - base, end - self.admitted_ns, run_args
                )
            )
        meta = [
            _meta("process_name", 1, RUN_TID, worker),
            _meta("thread_name", 1, RUN_TID, "run"),
            *(_meta("thread_name", 1, tid, label) for tid, label in sorted(lanes.items())),
        ]
        other: dict[str, Any] = {
            "run_id": run_id,
            "submitted_unix_ns": self.wall_ns,
            "attempts": len(names),
        }
        if self.dropped:
            other["attempts_dropped"] = self.dropped
        return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other}


def _run_event(name: str, t0: int, dur: int, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "cat": "run",
        "ph": "X",
        "ts": t0 / 1000,
        "dur": max(dur, 0) / 1000,
        "pid": 1,
        "tid": RUN_TID,
        "args": dict(args),
    }


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def traced_pumped() -> Callable[[list[TaskSlot], str, int], None]:
    """The Scheduler's ``on_pumped`` hook of a tracing Worker: each run of the batch
    into its trace at once (the daemon's run table does this itself)."""

    def record(slots: list[TaskSlot], event: str, worker_id: int) -> None:
        if event != "completed":
            return  # the slots carry their dispatch time (``dispatched_ns``)
        for group in by_run(slots):
            trace = group[0].run.trace
            if trace is not None:
                trace.on_pumped(group, worker_id)

    return record


def traced(inner: TaskEvent | None) -> TaskEvent:
    """The Scheduler's ``on_task_event`` hook that records the attempts of traced runs
    and then calls ``inner`` (the daemon's bookkeeping; None: nothing more)."""
    if inner is None:

        def record(slot: TaskSlot, event: str, c: WorkerCompletion | None) -> None:
            trace = slot.run.trace
            if trace is not None:
                trace.on_event(slot, event, c)

        return record

    def record_then(slot: TaskSlot, event: str, c: WorkerCompletion | None) -> None:
        trace = slot.run.trace
        if trace is not None:
            trace.on_event(slot, event, c)
        inner(slot, event, c)

    return record_then
