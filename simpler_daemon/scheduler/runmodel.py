"""The run model: runs, task slots, their states, dependency bookkeeping and admission.

Pure bookkeeping: no loop, no mailbox. The Scheduler owns one :class:`Admission`
(``fifo``; :mod:`simpler_daemon.scheduler.fair` is the other policy) and calls into it; the
:class:`~simpler_daemon.engine.orchestrator.Orchestrator` facade fills a :class:`Run`'s slots.

Dependencies come from tensor tags, keyed by backing buffer and the memory a view
touches (``tensormap.TensorMap``: byte ranges, per axis for 2-D blocks)::

    INPUT            depends on the last writer of every overlapping range
    OUTPUT(_EXISTING) becomes the writer of its range, depends on nothing
    INOUT            both
    NO_DEP           neither

A remote buffer (an L4's ``RemoteTensorRef``) is keyed by (owner worker, buffer
id, generation), so a freed and reused remote buffer never aliases its past.

Run lifecycle: BUILDING -> PREPARED -> EXECUTING -> COMPLETED | FAILED.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import msgspec

from simpler_daemon.args import CallConfig
from simpler_daemon.callables import CallableHandle
from simpler_daemon.endpoints.base import Outcome
from simpler_daemon.errors import RunCancelled, TaskError, WorkerClosedError
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.scheduler.tensormap import TensorMap

if TYPE_CHECKING:
    from simpler_daemon.scheduler.fair import Share
    from simpler_daemon.scheduler.trace import RunTrace


class RunState(enum.Enum):
    BUILDING = "BUILDING"
    PREPARED = "PREPARED"
    EXECUTING = "EXECUTING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"


class SlotState(enum.IntEnum):
    PENDING = 0
    READY = 1
    RUNNING = 2
    COMPLETED = 3
    FAILED = 4


class TaskKind(enum.Enum):
    SUB = "SUB"
    SUB_GROUP = "SUB_GROUP"
    NEXT_LEVEL = "NEXT_LEVEL"
    NEXT_LEVEL_GROUP = "NEXT_LEVEL_GROUP"


#: A tuple, not a set: membership by identity, no ``Enum.__hash__`` call (per task).
_GROUP_KINDS: Final = (TaskKind.SUB_GROUP, TaskKind.NEXT_LEVEL_GROUP)


@dataclass(slots=True)
class FailureInfo:
    """The first failure of a slot or run."""

    outcome: Outcome
    message: str
    worker_id: int | None = None
    dispatch_id: int | None = None
    pid: int | None = None
    worker_label: str | None = None
    #: How many attempts the task (this member) had, and one line per failed attempt,
    #: the last one's included (``scheduler/retries.py``); 1 and () without retries.
    attempts: int = 1
    causes: tuple[str, ...] = ()


#: The TaskSlot fields the C SUB pump reads to publish a slot (``mailbox/_mailbox_pump.c``
#: lists the same names in ``mb_pump_init``; a test holds the two lists together):
#: ``state`` (only a READY slot is taken), ``group_size`` (only 1), ``blobs`` (one args
#: blob, bytes), ``config_bytes`` and ``digest`` (bytes, copied into the frame),
#: ``run_id``, ``slot_id``, ``lease_slot`` and ``lease_generation`` (the frame's lease
#: and trailer identity). Change a field's name or type at both ends.
PUMP_SLOT_FIELDS: Final = (
    "state",
    "group_size",
    "blobs",
    "config_bytes",
    "digest",
    "run_id",
    "slot_id",
    "lease_slot",
    "lease_generation",
)


#: Take a slot of a run in flight off the cyclic collector's lists (``Run.end`` puts it
#: back). Its run holds it until then, so the collector would only walk it: every 700
#: slots a pass, and a 20,000-task run's slots all promoted to the oldest generation,
#: whose full pass walks the whole heap (16 ms of a W2 run's 100 on a 2-vCPU VM).
untrack_slot: Final = _mb.gc_untrack


class TaskSlot:
    """Parent-side record of one task (or one group) inside a run (the fields the C SUB
    pump reads are :data:`PUMP_SLOT_FIELDS`)."""

    #: When the C pump last published it (``time.perf_counter_ns`` of the batch; set by
    #: ``claim_published``, unset before: read with a default): a traced attempt's start.
    dispatched_ns: int

    __slots__ = (
        "blobs",
        "causes",
        "config",
        "config_bytes",
        "consumers",
        "deps",
        "digest",
        "dispatched_ns",
        "failure",
        "group_size",
        "handle",
        "hashid",
        "index",
        "kind",
        "lease_generation",
        "lease_slot",
        "members_done",
        "members_started",
        "pins",
        "result",
        "retries",
        "run",
        "run_id",
        "slot_id",
        "state",
        "targets",
    )

    def __init__(
        self,
        slot_id: int,
        run: Run,
        index: int,
        kind: TaskKind,
        handle: CallableHandle,
        config: CallConfig,
        blobs: Sequence[bytes],
        targets: Sequence[int],
        pins: Sequence[Any],
    ) -> None:
        self.slot_id = slot_id
        self.run = run
        self.run_id = run.run_id
        self.index = index
        self.kind = kind
        self.handle = handle
        self.hashid = handle.hashid
        self.digest = handle.digest
        self.config = config
        self.config_bytes = config.encoded
        self.blobs = blobs
        self.targets = targets
        self.group_size = len(blobs)
        self.pins = pins
        self.state = SlotState.PENDING
        self.deps = 0
        #: The slots waiting for this one (a list once it has any): ``()`` until then, so a
        #: slot of plain SUB work allocates no container of its own (the cyclic collector
        #: runs about once per 700 of those while a 20,000-task run is alive).
        self.consumers: list[TaskSlot] | tuple[()] = ()
        self.lease_slot = run.lease_slot
        self.lease_generation = run.lease_generation
        self.members_started = 0
        self.members_done = 0
        self.failure: FailureInfo | None = None
        #: Retries used so far, per member (None until the first): ``CallConfig.max_retries``.
        self.retries: dict[int, int] | None = None
        #: One line per failed attempt that was retried (``retries.attempt_text``).
        self.causes: list[str] | None = None
        #: What the task returned, msgpack-encoded: ``None`` (nothing, the usual case),
        #: its bytes, or for a group a list with one entry (bytes or None) per member.
        self.result: bytes | list[bytes | None] | None = None

    @property
    def is_group(self) -> bool:
        return self.kind in _GROUP_KINDS

    def set_result(self, member: int, data: bytes) -> None:
        """Keep the encoded return value of the task (``member`` of a group)."""
        if not self.is_group:
            self.result = data
            return
        values = self.result
        if not isinstance(values, list):
            values = self.result = [None] * self.group_size
        values[member] = data

    def decoded_result(self) -> Any:
        """The task's value (None when it returned nothing); a group's: one per member."""
        data = self.result
        if isinstance(data, bytes):
            return _decode(data)
        if self.is_group:
            if data is None:
                return [None] * self.group_size
            return [None if b is None else _decode(b) for b in data]
        return None

    def __repr__(self) -> str:
        return (
            f"TaskSlot(run={self.run_id}, index={self.index}, {self.kind.name}, {self.state.name})"
        )


class Run:
    """One submitted graph."""

    _ids: Iterator[int] = itertools.count(1)

    @classmethod
    def continue_ids(cls, ids: Iterator[int]) -> None:
        """Number runs from ``ids`` from now on, process-wide (the daemon's run history
        hands them out so that they never repeat across its restarts)."""
        cls._ids = ids

    def __init__(
        self, on_done: Callable[[Run], None] | None = None, run_id: int | None = None
    ) -> None:
        #: ``run_id``: one taken earlier with :meth:`reserve_id` (a daemon's queued run).
        self.run_id = next(Run._ids) if run_id is None else run_id
        #: COMPLETED or FAILED (read on every task). ``state`` and ``terminal`` are plain
        #: attributes (read several times per task): a terminal state is set with
        #: :meth:`end`, which sets both; the other states are assigned directly.
        self.terminal = False
        self.state = RunState.BUILDING
        self.admitted = False
        self.building = True
        self.slots: list[TaskSlot] = []
        self.remaining = 0
        #: The run's dependency map, created by the first task with tensors (None until
        #: then: most SUB-only runs never need one).
        self.tensor_map: TensorMap | None = None
        self.error: TaskError | None = None
        self.lease_slot = 0
        self.lease_generation = 0
        self.cancelled = False
        self.staged_one = False
        #: Weight under ``fair`` admission (``args.check_priority``); ``fifo`` ignores it.
        self.priority = 1
        #: Stride-scheduling pass under ``fair`` (see fair.py): the least is served first.
        self.vpass = 0.0
        #: Who submitted it (the daemon's client identity): under ``fair`` the workers are
        #: shared between clients first. ``None``: the one in-process client.
        self.client: object = None
        #: The client's share under ``fair``, set at admission.
        self.share: Share | None = None
        self.counts = {"done": 0, "failed": 0, "running": 0, "skipped": 0}
        self._callbacks: list[Callable[[Run], None]] = []
        if on_done is not None:
            self._callbacks.append(on_done)
        #: Called ``(run, "task", slot)`` when a slot fails (a failed, skipped or refused
        #: task), ``(run, "run", None)`` when the run ends; never for a slot that
        #: succeeded (twice per task in a 20,000-task run otherwise).
        self.listeners: list[Callable[[Run, str, TaskSlot | None], None]] = []
        #: (orchestration function, args, config) until the run is terminal; then ``None``
        #: so a handle kept by the caller does not keep them alive.
        self.orch: tuple[Any, Any, CallConfig] | None = None
        #: False only between RunBuilder.new_run and the call of the orchestration function.
        self.build_started = True
        self.orch_exception: BaseException | None = None
        #: Buffers the run's args referenced at submit (heap ids, or remote keys): held
        #: from submit to the end of the run, so a free while the run is queued waits.
        self.pins: list[Any] = []
        #: Cancelled with tasks still running: out of admission, not yet terminal.
        self.detached = False
        #: Heap buffers from ``Orchestrator.alloc``, one list per open scope; index 0 is
        #: the run itself (buffers allocated outside any scope live until the run ends).
        self.scopes: list[list[int]] = [[]]
        #: Index of the task whose failure is ``error`` (None: a run-level error).
        self.error_index: int | None = None
        #: Set by :meth:`release`: ``slots`` is empty, ``kept_slots`` holds what is read.
        self.released = False
        #: After :meth:`release`: how many slots the run had, and the ones still read
        #: (not COMPLETED, a group, or holding a result), stripped of their args.
        self.task_count = 0
        self.kept_slots: dict[int, TaskSlot] = {}
        #: The run's task attempts when its Worker traces (``scheduler/trace.py``).
        self.trace: RunTrace | None = None
        #: Its orchestration submits a known plan back to back (the daemon's SubmitRun
        #: of more than a few tasks): a submit at an idle SUB worker dispatches every
        #: other time only, so each of those rounds hands it two (see ``add_slot``).
        self.bulk_submits = False

    def end(self, state: RunState) -> None:
        """Make the run terminal: ``state`` is COMPLETED or FAILED.

        The slots the collector was not tracking (``untrack_slot``) go back on its
        lists: once the run is dropped, its cycles through them are found."""
        self.state = state
        self.terminal = True
        if self.slots:
            _mb.gc_track_all(self.slots)

    def add_done_callback(self, fn: Callable[[Run], None]) -> None:
        if self.terminal:
            fn(self)
        else:
            self._callbacks.append(fn)

    def fire_done(self) -> None:
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def emit(self, event: str, slot: TaskSlot | None = None) -> None:
        for fn in self.listeners:
            fn(self, event, slot)

    def record_error(self, slot: TaskSlot | None, failure: FailureInfo) -> None:
        if self.error is not None:
            return
        if slot is None:
            run_cls = RunCancelled if self.cancelled else TaskError
            self.error = run_cls(
                f"run {self.run_id} failed: {failure.message}",
                run_id=self.run_id,
                outcome=failure.outcome.name,
                remote_text=failure.message,
            )
            return
        self.error = self._task_error(slot, failure)
        self.error_index = slot.index

    def _task_error(self, slot: TaskSlot, failure: FailureInfo) -> TaskError:
        """The error of ``slot``'s failure, naming the task, where it ran and why."""
        where = failure.worker_label or (
            f"worker {failure.worker_id}" if failure.worker_id is not None else "no worker"
        )
        if failure.pid is not None:
            where += f" (pid {failure.pid})"
        dispatch = f", dispatch {failure.dispatch_id}" if failure.dispatch_id is not None else ""
        tries = ""
        if failure.attempts > 1:
            tries = f" after {failure.attempts} attempts ({'; '.join(failure.causes[:-1])})"
        msg = (
            f"run {self.run_id} failed: task {slot.index} ({slot.kind.name} "
            f"{slot.handle.name}, hashid {slot.hashid}) on {where}{dispatch}{tries}: "
            f"{failure.outcome.name}: {failure.message}"
        )
        cls = RunCancelled if self.cancelled else TaskError
        return cls(
            msg,
            run_id=self.run_id,
            worker_id=failure.worker_id,
            hashid=slot.hashid,
            dispatch_id=failure.dispatch_id,
            outcome=failure.outcome.name,
            remote_text=failure.message,
            pid=failure.pid,
            attempts=failure.attempts,
            attempt_causes=failure.causes,
        )

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def release(self) -> None:
        """Let go of a terminal run's task slots, args and dependency map, keeping what
        ``task_results``, ``encoded_results``, ``slot`` and ``task_error`` read.

        A long-lived holder of many finished runs (the daemon) calls it: a run of 20,000
        tasks otherwise keeps about 100,000 objects until it is forgotten. Only the slots
        that say more than "completed, returned nothing" stay, without their args, their
        consumers or their run (the retired sentinel). No-op before the run is terminal.
        """
        if not self.terminal or self.released:
            return
        kept: dict[int, TaskSlot] = {}
        for slot in self.slots:
            slot.run = RETIRED_RUN
            if (
                slot.state is SlotState.COMPLETED
                and slot.result is None
                and slot.kind not in _GROUP_KINDS  # ``is_group``, inline (per task)
            ):
                continue
            slot.blobs = ()
            slot.consumers = ()
            slot.pins = ()
            kept[slot.index] = slot
        self.task_count = len(self.slots)
        self.kept_slots = kept
        self.slots = []
        self.tensor_map = None
        self.listeners = []
        self.orch = None
        self.released = True

    def slot(self, index: int) -> TaskSlot | None:
        """The slot of task ``index``; after :meth:`release` None for a task that
        completed and returned nothing (its slot is gone)."""
        if self.released:
            if not 0 <= index < self.task_count:
                raise IndexError(f"run {self.run_id} has no task {index}")
            return self.kept_slots.get(index)
        return self.slots[index]

    def task_results(self) -> list[Any]:
        """What the tasks returned, one entry per task in submission order: a task's
        decoded value, a group's list of member values. None for a task that returned
        nothing, failed or has not finished; chip kernels, nested L3 and remote
        NEXT_LEVEL tasks always give None (only SUB callables send a value back)."""
        if self.released:
            out: list[Any] = [None] * self.task_count
            for index, slot in self.kept_slots.items():
                out[index] = slot.decoded_result()
            return out
        return [slot.decoded_result() for slot in self.slots]

    def encoded_results(self) -> list[tuple[int, int | None, bytes]]:
        """The non-None values as sent by the children: (task index, member index or
        None for a single task, msgpack bytes), in submission order (no decoding)."""
        out: list[tuple[int, int | None, bytes]] = []
        for slot in self.kept_slots.values() if self.released else self.slots:
            data = slot.result
            if data is None:
                continue
            if isinstance(data, bytes):
                out.append((slot.index, None, data))
            else:
                out.extend((slot.index, m, b) for m, b in enumerate(data) if b is not None)
        return out

    def task_error(self, slot: TaskSlot) -> TaskError | None:
        """The error of a failed task: the run's own error when it was the first to fail."""
        if slot.state != SlotState.FAILED:
            return None
        if self.error_index == slot.index or slot.failure is None:
            return self.error
        return self._task_error(slot, slot.failure)

    @staticmethod
    def reserve_id() -> int:
        """Take the next run id now for a run created later (``Run(run_id=...)``): the
        daemon names a run it queues before the engine sees it."""
        return next(Run._ids)

    def __repr__(self) -> str:
        return f"Run({self.run_id}, {self.state.name}, slots={len(self.slots)}, remaining={self.remaining})"


#: What a slot's ``run`` points at once its run retired (see Scheduler.finish_if_done).
RETIRED_RUN = Run()
RETIRED_RUN.end(RunState.COMPLETED)
RETIRED_RUN.building = False
# The sentinel is run 0 and takes no id: the first real run of a process is run 1.
RETIRED_RUN.run_id = 0
Run._ids = itertools.count(1)


_decode = msgspec.msgpack.Decoder().decode


class TaskRef(int):
    """What ``submit_*`` returns: the task's index in its run (an ``int`` equal to the
    index returned before, so code using it as one keeps working) and, once the run is
    terminal, ``result()``: the value the task returned.

    A SUB callable's return value comes back msgpack-encoded (at most
    ``MAX_RESULT_BYTES``); chip kernels, nested L3 and remote NEXT_LEVEL tasks give None.
    """

    #: The submit path gives every ref of a run the same attribute dict
    #: (``Orchestrator._refs``): a ref carries ``run`` and nothing else.
    run: Run

    def __new__(cls, index: int, run: Run) -> TaskRef:
        ref = super().__new__(cls, index)
        ref.run = run
        return ref

    @property
    def index(self) -> int:
        return int(self)

    def result(self) -> Any:
        """The task's value (None if it returned nothing); a group's: a list, one value per
        member. Raises ``asyncio.InvalidStateError`` while the run is not terminal, and the
        task's own ``TaskError`` (``RunCancelled`` in a cancelled run) when it failed or
        never ran."""
        run = self.run
        if not run.terminal:
            raise asyncio.InvalidStateError(
                f"cannot read the result of task {int(self)} of run {run.run_id}: "
                f"the run is {run.state.name}"
            )
        slot = run.slot(self)
        if slot is None:  # released: it completed and returned nothing
            return None
        if slot.state == SlotState.COMPLETED:
            return slot.decoded_result()
        error = run.task_error(slot) or run.error
        if error is None:  # pragma: no cover - a terminal run ends every task or fails
            raise asyncio.InvalidStateError(f"task {int(self)} of run {run.run_id} did not end")
        raise error

    def __reduce__(self) -> tuple[type[int], tuple[int]]:
        # A pickled ref is its index: the run does not travel.
        return (int, (int(self),))


class Admission:
    """Whole-run FIFO admission with ``depth`` generation-safe pipeline leases."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"pipeline depth {depth} must be at least 1")
        self.depth = depth
        self.active: deque[Run] = deque()  # leased runs, FIFO; active[0] is the head
        self.waiting: deque[Run] = deque()
        #: Cancelled runs whose running tasks have not finished (see ``detach``).
        self.detached: list[Run] = []
        self._free_leases = list(range(depth - 1, -1, -1))
        self._generation = 0
        self.closed = False
        #: ``active[0]`` and ``active[1]`` (None when there is none): plain attributes,
        #: read several times per task, kept in step by ``_admit``, which every change
        #: of ``active`` ends with.
        self.head: Run | None = None
        self.successor: Run | None = None

    def _top(self) -> None:
        active = self.active
        n = len(active)
        self.head = active[0] if n else None
        self.successor = active[1] if n > 1 else None

    def enqueue(self, run: Run) -> list[Run]:
        """Queue a run; returns the runs that became admitted (lease granted)."""
        if self.closed:
            raise WorkerClosedError(f"cannot submit run {run.run_id}: the worker is closing")
        self.waiting.append(run)
        return self._admit()

    def _admit(self) -> list[Run]:
        admitted = []
        while self.waiting and self._free_leases:
            run = self.waiting.popleft()
            self._generation += 1
            run.lease_slot = self._free_leases.pop()
            run.lease_generation = self._generation
            run.admitted = True
            self.active.append(run)
            admitted.append(run)
        # ``_top``, inline (twice per run).
        active = self.active
        n = len(active)
        head = self.head = active[0] if n else None
        self.successor = active[1] if n > 1 else None
        if head is not None and head.state in (RunState.BUILDING, RunState.PREPARED):
            head.state = RunState.EXECUTING
        return admitted

    def release(self, run: Run) -> list[Run]:
        """A terminal run gives back its lease exactly once; promote the next."""
        try:
            self.active.remove(run)
        except ValueError:
            if run in self.detached:
                self.detached.remove(run)
                return []
            try:
                self.waiting.remove(run)
            except ValueError:
                pass
            return []
        self._free_leases.append(run.lease_slot)
        return self._admit()

    def detach(self, run: Run) -> list[Run]:
        """A cancelled run with tasks still running leaves admission now: its lease goes
        to the next run, so one stuck task does not hold back every later run. The run
        stays listed (``runs()``) until it is terminal; ``release`` then only forgets it.
        """
        if run.detached or run not in self.active:
            return []
        self.active.remove(run)
        run.detached = True
        self.detached.append(run)
        self._free_leases.append(run.lease_slot)
        return self._admit()

    def lease_valid(self, lease_slot: int, generation: int) -> bool:
        return any(
            r.lease_slot == lease_slot and r.lease_generation == generation for r in self.active
        )

    def runs(self) -> list[Run]:
        return [*self.active, *self.detached, *self.waiting]


def by_run(slots: list[TaskSlot]) -> list[list[TaskSlot]]:
    """``slots`` cut where the run changes: the runs of an ``on_pumped`` batch, in
    order (one run, the usual case: ``[slots]`` itself)."""
    run = slots[0].run
    groups: list[list[TaskSlot]] | None = None
    start = 0
    for j, slot in enumerate(slots):
        if slot.run is not run:
            if groups is None:
                groups = []
            groups.append(slots[start:j])
            start, run = j, slot.run
    if groups is None:
        return [slots]
    groups.append(slots[start:])
    return groups
