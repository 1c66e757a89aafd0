"""Runs, task slots, dependency inference and whole-run admission.

Pure bookkeeping: no loop, no mailbox. The Scheduler owns one instance of
:class:`Admission` and calls into it; the :class:`Orchestrator` facade is what
an orchestration function receives.

Dependencies come from tensor tags, keyed by backing buffer and byte range::

    INPUT            depends on the last writer of every overlapping range
    OUTPUT(_EXISTING) becomes the writer of its range, depends on nothing
    INOUT            both
    NO_DEP           neither

A remote buffer (an L4's ``RemoteTensorRef``) is keyed by (owner worker, buffer
id, generation), so a freed and reused remote buffer never aliases its past.

Run lifecycle: BUILDING -> PREPARED -> EXECUTING -> COMPLETED | FAILED.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

import numpy as np

from simpler_daemon.args import DEFAULT_CONFIG, CallConfig, Tag, TaskArgs, encode_args
from simpler_daemon.callables import CallableHandle
from simpler_daemon.endpoints.base import Outcome
from simpler_daemon.errors import RunCancelled, TaskError, WorkerClosedError

if TYPE_CHECKING:
    from simpler_daemon.args import TensorDesc
    from simpler_daemon.fair import Share
    from simpler_daemon.heap import Heap


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


@dataclass(slots=True)
class FailureInfo:
    """The first failure of a slot or run."""

    outcome: Outcome
    message: str
    worker_id: int | None = None
    dispatch_id: int | None = None
    pid: int | None = None
    worker_label: str | None = None


class TaskSlot:
    """Parent-side record of one task (or one group) inside a run."""

    __slots__ = (
        "blobs",
        "config",
        "config_bytes",
        "consumers",
        "deps",
        "digest",
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
        blobs: list[bytes],
        targets: list[int],
        pins: list[int],
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
        self.config_bytes = config.encode()
        self.blobs = blobs
        self.targets = targets
        self.group_size = len(blobs)
        self.pins = pins
        self.state = SlotState.PENDING
        self.deps = 0
        self.consumers: list[TaskSlot] = []
        self.lease_slot = run.lease_slot
        self.lease_generation = run.lease_generation
        self.members_started = 0
        self.members_done = 0
        self.failure: FailureInfo | None = None

    @property
    def is_group(self) -> bool:
        return self.kind in (TaskKind.SUB_GROUP, TaskKind.NEXT_LEVEL_GROUP)

    def __repr__(self) -> str:
        return (
            f"TaskSlot(run={self.run_id}, index={self.index}, {self.kind.name}, {self.state.name})"
        )


class TensorMap:
    """Last writer per (buffer, byte range) inside one run."""

    __slots__ = ("_writers",)

    def __init__(self) -> None:
        # Keyed by a local buffer id, or (owner, buffer id, generation) for a remote buffer.
        self._writers: dict[Any, list[tuple[int, int, TaskSlot]]] = {}

    def producers(self, buffer_id: Any, lo: int, hi: int) -> list[TaskSlot]:
        out = []
        for wlo, whi, slot in self._writers.get(buffer_id, ()):
            if wlo < hi and lo < whi:
                out.append(slot)
        return out

    def write(self, buffer_id: Any, lo: int, hi: int, slot: TaskSlot) -> None:
        if lo >= hi:
            return
        segs = self._writers.setdefault(buffer_id, [])
        kept: list[tuple[int, int, TaskSlot]] = []
        for wlo, whi, s in segs:
            if whi <= lo or hi <= wlo:
                kept.append((wlo, whi, s))
                continue
            if wlo < lo:
                kept.append((wlo, lo, s))
            if hi < whi:
                kept.append((hi, whi, s))
        kept.append((lo, hi, slot))
        segs[:] = kept


class Run:
    """One submitted graph."""

    _ids = itertools.count(1)

    def __init__(self, on_done: Callable[[Run], None] | None = None) -> None:
        self.run_id = next(Run._ids)
        #: COMPLETED or FAILED; kept in step by the ``state`` setter (read on every task).
        self.terminal = False
        self.state = RunState.BUILDING
        self.admitted = False
        self.building = True
        self.slots: list[TaskSlot] = []
        self.remaining = 0
        self.tensor_map = TensorMap()
        self.error: TaskError | None = None
        self.lease_slot = 0
        self.lease_generation = 0
        self.cancelled = False
        self.staged_one = False
        #: Weight under ``fair`` admission (``fair.check_priority``); ``fifo`` ignores it.
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

    @property
    def state(self) -> RunState:
        return self._state

    @state.setter
    def state(self, value: RunState) -> None:
        self._state = value
        self.terminal = value in (RunState.COMPLETED, RunState.FAILED)

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
        where = failure.worker_label or (
            f"worker {failure.worker_id}" if failure.worker_id is not None else "no worker"
        )
        if failure.pid is not None:
            where += f" (pid {failure.pid})"
        dispatch = f", dispatch {failure.dispatch_id}" if failure.dispatch_id is not None else ""
        msg = (
            f"run {self.run_id} failed: task {slot.index} ({slot.kind.name} "
            f"{slot.handle.name}, hashid {slot.hashid}) on {where}{dispatch}: "
            f"{failure.outcome.name}: {failure.message}"
        )
        cls = RunCancelled if self.cancelled else TaskError
        self.error = cls(
            msg,
            run_id=self.run_id,
            worker_id=failure.worker_id,
            hashid=slot.hashid,
            dispatch_id=failure.dispatch_id,
            outcome=failure.outcome.name,
            remote_text=failure.message,
            pid=failure.pid,
        )

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def __repr__(self) -> str:
        return f"Run({self.run_id}, {self.state.name}, slots={len(self.slots)}, remaining={self.remaining})"


#: What a slot's ``run`` points at once its run retired (see Scheduler._maybe_finish_run).
RETIRED_RUN = Run()
RETIRED_RUN.state = RunState.COMPLETED
RETIRED_RUN.building = False


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

    @property
    def head(self) -> Run | None:
        return self.active[0] if self.active else None

    @property
    def successor(self) -> Run | None:
        return self.active[1] if len(self.active) > 1 else None

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
        if self.active and self.active[0].state in (RunState.BUILDING, RunState.PREPARED):
            self.active[0].state = RunState.EXECUTING
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


class RemoteTensors(Protocol):
    """The L4 side of remote buffers, as the Orchestrator sees it (``None`` below L4)."""

    def is_remote(self, worker_id: int) -> bool: ...

    def describe(self, ref: Any, target: int, where: str) -> TensorDesc:
        """Descriptor of ``ref`` for a task on remote worker ``target``; ``ValueError``
        naming ``where`` when the buffer is freed, stale, or not readable there."""
        ...

    def pin(self, key: tuple[int, int, int]) -> None: ...

    def unpin(self, key: tuple[int, int, int]) -> None: ...

    def check_installed(self, handle: CallableHandle, targets: list[int], api: str) -> None:
        """``ValueError`` when a remote target does not have ``handle`` installed."""
        ...


class SubmitSink:
    """What the Orchestrator needs from the Scheduler (kept narrow for tests)."""

    heap: Heap
    #: Remote buffers of an L4 worker with remote children; ``None`` otherwise.
    remote: RemoteTensors | None = None

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


_API: Final = {
    TaskKind.SUB: "submit_sub",
    TaskKind.SUB_GROUP: "submit_sub_group",
    TaskKind.NEXT_LEVEL: "submit_next_level",
    TaskKind.NEXT_LEVEL_GROUP: "submit_next_level_group",
}


class Orchestrator:
    """The facade an orchestration function receives: ``orch(o, args, config)``."""

    __slots__ = ("_sink", "run")

    def __init__(self, sink: SubmitSink, run: Run) -> None:
        self._sink = sink
        self.run = run

    @property
    def run_id(self) -> int:
        return self.run.run_id

    def submit_sub(
        self, handle: CallableHandle, args: TaskArgs | None = None, config: CallConfig | None = None
    ) -> int:
        """Submit one SUB task; returns its index in the run."""
        h = self._sink.validate_handle(handle, "sub", "submit_sub")
        return self._submit(TaskKind.SUB, h, [args or TaskArgs()], config, [])

    def submit_sub_group(
        self, handle: CallableHandle, args_list: list[TaskArgs], config: CallConfig | None = None
    ) -> int:
        """Submit a SUB group: one member per args, each on a distinct SUB worker."""
        h = self._sink.validate_handle(handle, "sub", "submit_sub_group")
        if not isinstance(args_list, (list, tuple)) or not args_list:
            raise ValueError(
                "cannot submit_sub_group: args_list must be a non-empty list of TaskArgs"
            )
        return self._submit(TaskKind.SUB_GROUP, h, list(args_list), config, [])

    def submit_next_level(
        self,
        handle: CallableHandle,
        args: TaskArgs | None = None,
        config: CallConfig | None = None,
        *,
        worker: int,
    ) -> int:
        """Submit one NEXT_LEVEL task that runs only on ``worker``."""
        h = self._sink.validate_handle(handle, "chip", "submit_next_level")
        if isinstance(worker, bool) or not isinstance(worker, int):
            raise TypeError(
                f"cannot submit_next_level: worker= must be an int, got {type(worker).__name__}"
            )
        self._sink.validate_targets([worker], "submit_next_level")
        if self._sink.remote is not None:
            self._sink.remote.check_installed(h, [worker], "submit_next_level")
        return self._submit(TaskKind.NEXT_LEVEL, h, [args or TaskArgs()], config, [worker])

    def submit_next_level_group(
        self,
        handle: CallableHandle,
        args_list: list[TaskArgs],
        config: CallConfig | None = None,
        *,
        workers: list[int],
    ) -> int:
        """Submit a NEXT_LEVEL group: member i runs on ``workers[i]``, all launched together."""
        h = self._sink.validate_handle(handle, "chip", "submit_next_level_group")
        if not isinstance(args_list, (list, tuple)) or not args_list:
            raise ValueError("cannot submit_next_level_group: args_list must be a non-empty list")
        targets = list(workers)
        if any(isinstance(w, bool) or not isinstance(w, int) for w in targets):
            raise TypeError("cannot submit_next_level_group: workers= must be a list of ints")
        if len(set(targets)) != len(targets):
            raise ValueError(f"cannot submit_next_level_group: workers {targets} are not distinct")
        if len(targets) != len(args_list):
            raise ValueError(
                f"cannot submit_next_level_group: {len(targets)} workers for {len(args_list)} args"
            )
        self._sink.validate_targets(targets, "submit_next_level_group")
        if self._sink.remote is not None:
            self._sink.remote.check_installed(h, targets, "submit_next_level_group")
        return self._submit(TaskKind.NEXT_LEVEL_GROUP, h, list(args_list), config, targets)

    def _submit(
        self,
        kind: TaskKind,
        handle: CallableHandle,
        args_list: list[TaskArgs],
        config: CallConfig | None,
        targets: list[int],
    ) -> int:
        run = self.run
        if run.terminal or run.error is not None:
            if run.error is not None:
                raise run.error
            raise WorkerClosedError(f"cannot submit into run {run.run_id}: it is {run.state.name}")
        if not run.building:
            raise WorkerClosedError(
                f"cannot submit into run {run.run_id}: its orchestration returned"
            )
        cfg = DEFAULT_CONFIG if config is None else config
        if not isinstance(cfg, CallConfig):
            raise TypeError(f"cannot submit: config must be a CallConfig, got {type(cfg).__name__}")
        heap = self._sink.heap
        blobs: list[bytes] = []
        member_descs: list[list[TensorDesc]] = []
        for i, a in enumerate(args_list):
            if not isinstance(a, TaskArgs):
                raise TypeError(
                    f"cannot submit: args[{i}] must be TaskArgs, got {type(a).__name__}"
                )
            if not a.tensors:
                blobs.append(encode_args((), a.scalars))
                continue
            target = targets[i] if targets else None
            remote = self._sink.remote
            if remote is not None and (
                (target is not None and remote.is_remote(target))
                or any(not isinstance(t, np.ndarray) for t in a.tensors)
            ):
                descs = self._describe_remote(remote, a, i, kind, target)
            else:
                # A buffer the run's args held since submit stays usable after a free.
                descs = [
                    heap.describe(t, held=run.pins).with_tag(tag)
                    for t, tag in zip(a.tensors, a.tags, strict=True)
                ]
            blobs.append(encode_args(descs, a.scalars))
            member_descs.append(descs)
        if member_descs:
            _check_written_overlap(args_list, member_descs, _API[kind], handle, len(run.slots))
        if not member_descs:
            # No tensors: no pins, no dependencies (the common case for pure SUB work).
            slot = TaskSlot(
                self._sink.next_slot_id(),
                run,
                len(run.slots),
                kind,
                handle,
                cfg,
                blobs,
                targets,
                [],
            )
            run.slots.append(slot)
            run.remaining += 1
            self._sink.add_slot(slot)
            return slot.index

        pins: list[Any] = list({d.key: None for descs in member_descs for d in descs})
        slot = TaskSlot(
            self._sink.next_slot_id(), run, len(run.slots), kind, handle, cfg, blobs, targets, pins
        )
        for b in pins:
            if type(b) is int:
                heap.pin(b)
            else:
                assert self._sink.remote is not None
                self._sink.remote.pin(b)
        # Dependencies: producers first (INPUT/INOUT), then become the writer.
        producers: dict[int, TaskSlot] = {}
        tmap = run.tensor_map
        for descs in member_descs:
            for d in descs:
                if d.tag in (Tag.INPUT, Tag.INOUT):
                    lo, hi = d.byte_range()
                    for p in tmap.producers(d.key, lo, hi):
                        producers[id(p)] = p
        for descs in member_descs:
            for d in descs:
                if d.tag in (Tag.OUTPUT, Tag.OUTPUT_EXISTING, Tag.INOUT):
                    lo, hi = d.byte_range()
                    tmap.write(d.key, lo, hi, slot)
        run.slots.append(slot)
        run.remaining += 1
        failed_producer = None
        for p in producers.values():
            if p is slot:
                continue
            if p.state == SlotState.FAILED:
                failed_producer = p
            elif p.state != SlotState.COMPLETED:
                slot.deps += 1
                p.consumers.append(slot)
        if failed_producer is not None:
            self._sink.fail_at_submit(slot, failed_producer)
        else:
            self._sink.add_slot(slot)
        return slot.index

    # -- run-owned buffers ------------------------------------------------------------------

    def alloc(self, shape: tuple[int, ...] | int, dtype: Any = "float32") -> np.ndarray[Any, Any]:
        """A zero-filled intermediate array on the shared heap, owned by this run.

        It is freed when the innermost open scope ends (``scope()``), or when the run
        ends if no scope is open; like ``Worker.free``, its memory is reused only once
        every task that captured it has retired, so readers submitted before the scope
        ended still see it. Once its scope ended it is a freed array: do not use it.
        """
        run = self.run
        self._check_building("alloc")
        heap = self._sink.heap
        buf = heap.alloc_buffer(shape, dtype)
        run.scopes[-1].append(buf.buffer_id)
        return heap.array(buf)

    def scope_begin(self) -> None:
        """Open a nested scope: buffers ``alloc`` returns until the matching
        ``scope_end`` are freed by it. Prefer the ``scope()`` context manager."""
        self._check_building("begin a scope")
        self.run.scopes.append([])

    def scope_end(self) -> None:
        """Close the innermost scope: free its buffers (each once its tasks retired)."""
        run = self.run
        if run.terminal:
            return  # the run's end freed every scope's buffers (a cancelled ``with`` block)
        if len(run.scopes) < 2:
            raise RuntimeError(
                f"cannot end a scope in run {run.run_id}: no scope is open (scope_end "
                "without a matching scope_begin)"
            )
        heap = self._sink.heap
        for buffer_id in run.scopes.pop():
            heap.free_owned(buffer_id)

    @contextlib.contextmanager
    def scope(self) -> Iterator[Orchestrator]:
        """``with o.scope():`` -- ``scope_begin`` on entry, ``scope_end`` on exit."""
        self.scope_begin()
        try:
            yield self
        finally:
            self.scope_end()

    def _check_building(self, what: str) -> None:
        run = self.run
        if run.error is not None:
            raise run.error
        if run.terminal or not run.building:
            raise WorkerClosedError(
                f"cannot {what} in run {run.run_id}: its orchestration returned"
            )

    def _describe_remote(
        self,
        remote: RemoteTensors,
        a: TaskArgs,
        member: int,
        kind: TaskKind,
        target: int | None,
    ) -> list[TensorDesc]:
        """Descriptors for a task whose target or tensors are remote, refusing mixes."""
        heap = self._sink.heap
        api = _API[kind]
        on_remote = target is not None and remote.is_remote(target)
        descs: list[TensorDesc] = []
        for j, (t, tag) in enumerate(zip(a.tensors, a.tags, strict=True)):
            where = f"args[{member}].tensors[{j}]"
            if isinstance(t, np.ndarray):
                if on_remote:
                    raise ValueError(
                        f"cannot {api}: {where} is a host array, but remote worker {target} "
                        "reads only its own heap; allocate it with Worker.alloc_remote and "
                        "fill it with Worker.copy_to_remote"
                    )
                descs.append(heap.describe(t, held=self.run.pins).with_tag(tag))
            elif not on_remote:
                dest = "a SUB worker" if target is None else f"local worker {target}"
                raise ValueError(
                    f"cannot {api}: {where} is {t!r}, which lives on remote worker "
                    f"{getattr(t, 'owner', '?')}; {dest} reads only this host's shared heap"
                )
            else:
                assert target is not None
                owner = getattr(t, "owner", target)
                if owner != target and tag in (Tag.OUTPUT, Tag.INOUT, Tag.OUTPUT_EXISTING):
                    raise ValueError(
                        f"cannot {api}: {where} is tagged {tag.name}, but remote worker "
                        f"{target} holds only a read-only snapshot of {t!r} (imported); "
                        f"write it on its owner, worker {owner}"
                    )
                descs.append(remote.describe(t, target, f"{api}: {where}").with_tag(tag))
        return descs


def _check_written_overlap(
    args_list: list[TaskArgs],
    member_descs: list[list[TensorDesc]],
    api: str,
    handle: CallableHandle,
    index: int,
) -> None:
    """Refuse a task (or group) two of whose written tensors share memory: the children
    would race on it. Byte ranges find candidates; two local arrays whose ranges meet
    but whose elements never do (interleaved strided views) are accepted."""
    written: dict[Any, list[tuple[int, int, str, Any]]] = {}
    for m, descs in enumerate(member_descs):
        for j, d in enumerate(descs):
            if d.tag not in (Tag.OUTPUT, Tag.OUTPUT_EXISTING, Tag.INOUT):
                continue
            lo, hi = d.byte_range()
            if lo >= hi:
                continue
            where = f"args[{m}].tensors[{j}] ({d.tag.name})"
            tensor = args_list[m].tensors[j]
            for olo, ohi, other, otensor in written.setdefault(d.key, []):
                if olo < hi and lo < ohi and _shares(tensor, otensor):
                    raise ValueError(
                        f"cannot {api}: task {index} ({handle.name}) writes overlapping "
                        f"memory through {other} and {where} (buffer {d.buffer_id}, bytes "
                        f"[{olo}, {ohi}) and [{lo}, {hi})); two written arguments of one task "
                        "would race"
                    )
            written[d.key].append((lo, hi, where, tensor))


def _shares(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        try:
            # The stubs admit only -1 and 0, but NumPy takes any bound on the work.
            return bool(np.shares_memory(a, b, max_work=10_000))  # type: ignore[arg-type]
        except np.exceptions.TooHardError:
            return True  # cannot tell cheaply: refuse, a race is worse than a refusal
    return True
