"""A run record's events: building and publishing RunEvents, and the Scheduler's task
events (dispatched, completed, retried, requeued) that move its counts.

:class:`RunEvents` is the part of :class:`~simpler_daemon.server.run_record.RunRecord`
that the Scheduler drives on every task (``on_task_event``, all on the daemon's loop);
it holds no state of its own (the record's slots).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final

from google.protobuf.timestamp_pb2 import Timestamp

from simpler_daemon.endpoints.base import Outcome
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.scheduler.completion import pumped_completion

if TYPE_CHECKING:
    from simpler_daemon.engine.orchestrator import TaskSlot
    from simpler_daemon.server.metrics import Metrics
    from simpler_daemon.server.run_record import Watcher

__all__ = ["TERMINAL_STATES", "RunEvents", "now_ts"]

TERMINAL_STATES: Final = frozenset(
    {pb.RUN_STATE_COMPLETED, pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED, pb.RUN_STATE_LOST}
)


def now_ts(ns: int | None = None) -> Timestamp:
    """A Timestamp of ``ns`` (None: now); not ``FromNanoseconds``, Python code that
    costs several times more."""
    seconds, nanos = divmod(time.time_ns() if ns is None else ns, 1_000_000_000)
    return Timestamp(seconds=seconds, nanos=nanos)


def _attempt(slot: TaskSlot, member: int) -> int:
    """The number of the attempt of ``slot`` (``member``) that runs or ran last."""
    retries = slot.retries
    return 1 if retries is None else retries.get(member, 0) + 1


class RunEvents:
    """RunEvent building and the task-event counts of a run record (a mixin: its slots
    are the counts it moves; the record sets them up and owns the rest)."""

    __slots__ = ("_t0", "done", "failed", "retried", "running", "seq", "state")

    run_id: int
    watchers: set[Watcher]
    _metrics: Metrics | None

    def __init__(self) -> None:
        self.seq = 0
        self.done = 0
        self.failed = 0
        self.running = 0
        #: Failed attempts that ran again (CallConfig.max_retries).
        self.retried = 0
        self.state: pb.RunState = pb.RUN_STATE_QUEUED
        #: (slot id, member) -> dispatch time (perf_counter_ns), for the latency metric.
        self._t0: dict[tuple[int, int], int] = {}

    if TYPE_CHECKING:

        def counts(self) -> Any: ...

        def proto_state(self) -> pb.RunState: ...

    def _event(self, etype: pb.RunEventType, **fields: Any) -> Any:
        self.seq += 1
        return pb.RunEvent(
            run_id=self.run_id,
            sequence=self.seq,
            type=etype,
            counts=self.counts(),
            state=self.state,
            time=now_ts(),
            **fields,
        )

    def _publish(self, event: Any, *, force: bool = False) -> None:
        for w in self.watchers:
            w.push(event, force=force)

    def _state_changed(self) -> None:
        state = self.proto_state()
        if state != self.state and state not in TERMINAL_STATES:
            self.state = state
            self._publish(self._event(pb.RUN_EVENT_TYPE_RUN_STATE))

    def on_pumped(self, slots: list[TaskSlot], event: str, worker_id: int) -> None:
        """``on_task_event`` for a batch of the C pump's ("dispatched", or "completed":
        each a SUCCESS on SUB lane ``worker_id``): the counts at once when nobody reads
        the events one by one (no metrics, no watcher), else one event a slot."""
        if self._metrics is None and not self.watchers:
            k = len(slots)
            if event == "dispatched":
                self.running += k
            else:
                self.running -= k
                self.done += k
            self.seq += k
            return
        for slot in slots:
            c = None if event == "dispatched" else pumped_completion(slot, worker_id)
            self.on_task_event(slot, event, c)

    def on_task_event(self, slot: TaskSlot, event: str, completion: Any) -> None:
        metrics = self._metrics
        if event == "dispatched" or event == "redispatched":
            self.running += 1
            if metrics is None and not self.watchers:
                self.seq += 1  # nobody reads the member: not worked out (twice per task)
                return
            member = (
                max(slot.members_started - 1, 0)
                if completion is None
                else completion.dispatch.group_index
            )
            if metrics is not None:
                # ``_name_``: the enum members' plain attribute (``.name`` is
                # a Python-level property, read twice per task).
                metrics.task_dispatched(slot.kind._name_.lower())
                self._t0[(slot.slot_id, member)] = time.perf_counter_ns()
            if self.watchers:
                self._state_changed()
                self._publish(
                    self._event(
                        pb.RUN_EVENT_TYPE_TASK_DISPATCHED,
                        task_index=slot.index,
                        member_index=member,
                        attempt=_attempt(slot, member),
                    )
                )
            else:
                self.seq += 1
        elif event == "completed" and completion is not None:
            self.running -= 1
            ok = completion.outcome is Outcome.SUCCESS
            if ok:
                self.done += 1
            else:
                self.failed += 1
            member = completion.dispatch.group_index
            if metrics is not None:
                t0 = self._t0.pop((slot.slot_id, member), None)
                latency = None if t0 is None else (time.perf_counter_ns() - t0) / 1e9
                metrics.task_completed(slot.kind._name_.lower(), completion.outcome._name_, latency)
            if self.watchers:
                self._state_changed()
                fields: dict[str, Any] = {
                    "task_index": slot.index,
                    "member_index": member,
                    "worker_id": completion.worker_id,
                    "dispatch_id": completion.dispatch.dispatch_id,
                    "outcome": completion.outcome.name,
                    "attempt": _attempt(slot, member),
                }
                if not ok:
                    fields["message"] = completion.message
                etype = pb.RUN_EVENT_TYPE_TASK_COMPLETED if ok else pb.RUN_EVENT_TYPE_TASK_FAILED
                self._publish(self._event(etype, **fields))
            else:
                self.seq += 1
        elif event == "retried":
            # A failed attempt that runs again: neither done nor failed.
            self.running -= 1
            self.retried += 1
            member = completion.dispatch.group_index
            self._t0.pop((slot.slot_id, member), None)
            if self.watchers:
                self._publish(
                    self._event(
                        pb.RUN_EVENT_TYPE_TASK_RETRYING,
                        task_index=slot.index,
                        member_index=member,
                        worker_id=completion.worker_id,
                        dispatch_id=completion.dispatch.dispatch_id,
                        outcome=completion.outcome.name,
                        message=completion.message,
                        attempt=_attempt(slot, member) - 1,
                    )
                )
            else:
                self.seq += 1
        elif event == "requeued":
            # A chip task only staged behind a terminated one never started: it goes
            # back to its queue and is dispatched (and counted) again later.
            self.running -= 1
            self._t0.pop((slot.slot_id, max(slot.members_started - 1, 0)), None)
