"""The Orchestrator facade an orchestration function receives, and its submit checks.

``orch(o, args, config)`` calls ``o.submit_sub`` / ``submit_sub_group`` /
``submit_next_level`` / ``submit_next_level_group``: each builds a
:class:`~simpler_daemon.scheduler.runmodel.TaskSlot`, infers its dependencies from the
tensor tags and hands it to the Scheduler (:class:`SubmitSink`). The run model
itself (runs, slots, states, admission) is :mod:`simpler_daemon.scheduler.runmodel`; its
names are re-exported here, where most callers import them from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from simpler_daemon.args import (
    DEFAULT_CONFIG,
    MAILBOX_ARGS_CAPACITY,
    CallConfig,
    Tag,
    TaskArgs,
    encode_args,
)
from simpler_daemon.callables import CallableHandle
from simpler_daemon.errors import WorkerClosedError
from simpler_daemon.scheduler.runmodel import (
    RETIRED_RUN,
    Admission,
    FailureInfo,
    Run,
    RunState,
    SlotState,
    TaskKind,
    TaskRef,
    TaskSlot,
    untrack_slot,
)
from simpler_daemon.scheduler.sink import RemoteTensors, SubmitSink
from simpler_daemon.scheduler.tensormap import TensorMap, overlaps, region
from simpler_daemon.taskvalues import SECTION as VALUES_SECTION
from simpler_daemon.taskvalues import section as values_section

if TYPE_CHECKING:
    from simpler_daemon.args import TensorDesc

__all__ = [
    "RETIRED_RUN",
    "Admission",
    "FailureInfo",
    "Orchestrator",
    "RemoteTensors",
    "Run",
    "RunState",
    "SlotState",
    "SubmitSink",
    "TaskKind",
    "TaskRef",
    "TaskSlot",
    "TensorMap",
]

_new_int = int.__new__
#: The args blob of a task without tensors or scalars (shared by every such task).
_EMPTY_BLOB: Final = encode_args((), ())
#: A plain task's blobs (``TaskSlot.blobs``): one shared tuple, nothing allocated per task.
_EMPTY_BLOBS: Final = (_EMPTY_BLOB,)


#: The most values and kwargs bytes a task without tensors or scalars carries in its frame.
_INLINE_VALUES: Final = MAILBOX_ARGS_CAPACITY - len(_EMPTY_BLOB) - VALUES_SECTION.size
_GROUPS: Final = (TaskKind.SUB_GROUP, TaskKind.NEXT_LEVEL_GROUP)
_API: Final = {
    TaskKind.SUB: "submit_sub",
    TaskKind.SUB_GROUP: "submit_sub_group",
    TaskKind.NEXT_LEVEL: "submit_next_level",
    TaskKind.NEXT_LEVEL_GROUP: "submit_next_level_group",
}


class Orchestrator:
    """The facade an orchestration function receives: ``orch(o, args, config)``."""

    __slots__ = ("_refs", "_sink", "run")

    def __init__(self, sink: SubmitSink, run: Run) -> None:
        self._sink = sink
        self.run = run
        #: The attribute dict every ``TaskRef`` of this run shares (``{"run": run}``):
        #: assigning it costs less than a dict per ref. Held here, not on the run, so no
        #: run <-> dict cycle keeps a finished run from being freed by refcounting.
        self._refs = {"run": run}

    @property
    def run_id(self) -> int:
        return self.run.run_id

    def submit_sub(
        self, handle: CallableHandle, args: TaskArgs | None = None, config: CallConfig | None = None
    ) -> TaskRef:
        """Submit one SUB task; returns its ``TaskRef`` (its index in the run, and the
        value the callable returns once the run is terminal)."""
        sink = self._sink
        valid = sink.valid_sub
        if valid is not None and valid[0] is handle and valid[1].state == "active":
            h = handle  # validated before, and still registered (``SubmitSink.valid_sub``)
        else:
            h = sink.validate_handle(handle, "sub", "submit_sub")
        run = self.run
        if (
            config is None
            and (args is None or (type(args) is TaskArgs and not args.tensors))
            and run.building
            and run.error is None
            and not run.terminal
        ):
            # A plain task (no tensors, the default config; W1, W2, W3): what ``_submit``
            # does for it, inline: no pins, no dependencies, the shared blob (or one of
            # scalars); with values that fit the frame (W1v, W2v), the blob with its
            # values section.
            if args is not None and args.scalars:
                if args._values is not None:
                    return self._submit(TaskKind.SUB, h, [args], config, [])
                blob = encode_args((), args.scalars)
            elif args is None or args._values is None:
                blob = _EMPTY_BLOB
            else:
                values, kwargs = args._values.encoded()
                n = len(values) + len(kwargs)
                if n > _INLINE_VALUES or n > sink.max_value_bytes:
                    return self._submit(TaskKind.SUB, h, [args], config, [])
                blob = _EMPTY_BLOB + values_section(values, kwargs, None)
            slot = TaskSlot(
                sink.next_slot_id(),
                run,
                len(run.slots),
                TaskKind.SUB,
                h,
                DEFAULT_CONFIG,
                _EMPTY_BLOBS if blob is _EMPTY_BLOB else (blob,),
                (),
                (),
            )
            run.slots.append(slot)
            untrack_slot(slot)  # until the run ends (Run.end)
            run.remaining += 1
            sink.add_slot(slot)
            ref = _new_int(TaskRef, slot.index)
            ref.__dict__ = self._refs
            return ref
        return self._submit(TaskKind.SUB, h, [args or TaskArgs()], config, [])

    def submit_sub_group(
        self, handle: CallableHandle, args_list: list[TaskArgs], config: CallConfig | None = None
    ) -> TaskRef:
        """Submit a SUB group: one member per args, each on a distinct SUB worker. The
        ``TaskRef``'s ``result()`` is a list: the members' values in args order."""
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
    ) -> TaskRef:
        """Submit one NEXT_LEVEL task that runs only on ``worker``. Its ``TaskRef``'s
        ``result()`` is None: chip kernels, nested L3 and remote tasks return nothing."""
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
    ) -> TaskRef:
        """Submit a NEXT_LEVEL group: member i runs on ``workers[i]``, all launched together.
        Its ``TaskRef``'s ``result()`` is a list of None (NEXT_LEVEL tasks return nothing)."""
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
    ) -> TaskRef:
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
        #: Heap buffers holding values sections: pinned by the slot, freed already.
        value_pins: list[int] = []
        try:
            for i, a in enumerate(args_list):
                if not isinstance(a, TaskArgs):
                    raise TypeError(
                        f"cannot submit: args[{i}] must be TaskArgs, got {type(a).__name__}"
                    )
                if not a.tensors:
                    blob = encode_args((), a.scalars)
                else:
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
                    blob = encode_args(descs, a.scalars)
                    member_descs.append(descs)
                if a._values is not None:
                    blob += self._values_section(len(blob), kind, handle, a, i, targets, value_pins)
                blobs.append(blob)
            if member_descs:
                _check_written_overlap(args_list, member_descs, _API[kind], handle, len(run.slots))
                if cfg.max_retries and not cfg.idempotent:
                    _check_retry_safe(args_list, cfg, _API[kind], handle, len(run.slots))
        except BaseException:
            for b in value_pins:  # nothing of a refused task stays on the heap
                heap.unpin(b)
            raise
        if not member_descs:
            # No tensors: no pins, no dependencies (the common case for pure SUB work). No
            # list kept per slot either (``TaskSlot.consumers``): a tuple of blobs, and the
            # empty tuple for no targets or no values buffers.
            slot = TaskSlot(
                self._sink.next_slot_id(),
                run,
                len(run.slots),
                kind,
                handle,
                cfg,
                tuple(blobs),
                targets or (),
                value_pins or (),
            )
            run.slots.append(slot)
            run.remaining += 1
            self._sink.add_slot(slot)
            # int.__new__ directly, without TaskRef.__new__, and the run's shared attribute
            # dict instead of a new one: a TaskRef costs about a quarter less.
            ref = _new_int(TaskRef, slot.index)
            ref.__dict__ = self._refs
            return ref

        pins: list[Any] = list({d.key: None for descs in member_descs for d in descs})
        slot = TaskSlot(
            self._sink.next_slot_id(),
            run,
            len(run.slots),
            kind,
            handle,
            cfg,
            blobs,
            targets,
            pins + value_pins,  # the values buffers are pinned already
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
        if tmap is None:
            tmap = run.tensor_map = TensorMap()
        written = []
        for descs in member_descs:
            for d in descs:
                tag = d.tag
                if tag is Tag.NO_DEP:
                    continue
                r = region(d)
                if tag in (Tag.INPUT, Tag.INOUT):
                    for p in tmap.producers(d.key, r):
                        producers[id(p)] = p
                if tag is not Tag.INPUT:
                    written.append((d.key, r))
        for key, r in written:
            tmap.write(key, r, slot)
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
                consumers = p.consumers
                if isinstance(consumers, list):
                    consumers.append(slot)
                else:
                    p.consumers = [slot]
        if failed_producer is not None:
            self._sink.fail_at_submit(slot, failed_producer)
        else:
            self._sink.add_slot(slot)
        ref = _new_int(TaskRef, slot.index)
        ref.__dict__ = self._refs
        return ref

    def _values_section(
        self,
        used: int,
        kind: TaskKind,
        handle: CallableHandle,
        a: TaskArgs,
        member: int,
        targets: list[int],
        pins: list[int],
    ) -> bytes:
        """The values section of member ``member``: inline when the frame has room after
        ``used`` bytes, else a run-owned heap buffer (pinned by the slot, freed now: it is
        released when the task retires, whatever its outcome). ``ValueError`` naming the
        task past ``max_value_bytes``, or for heap-backed values to a remote worker."""
        assert a._values is not None
        values, kwargs = a._values.encoded()
        n = len(values) + len(kwargs)
        sink = self._sink
        index = len(self.run.slots)
        who = f"task {index}{f' member {member}' if len(targets) > 1 or kind in _GROUPS else ''}"
        limit = sink.max_value_bytes
        if n > limit:
            raise ValueError(
                f"cannot {_API[kind]} {who} ({handle.name}): its values and kwargs are {n} "
                f"bytes encoded, more than max_value_bytes ({limit})"
            )
        if used + VALUES_SECTION.size + n <= MAILBOX_ARGS_CAPACITY:
            return values_section(values, kwargs, None)
        target = targets[member] if targets else None
        if sink.remote is not None and target is not None and sink.remote.is_remote(target):
            raise ValueError(
                f"cannot {_API[kind]} {who} ({handle.name}) to remote worker {target}: its "
                f"values and kwargs are {n} bytes encoded; a remote task carries at most "
                f"{MAILBOX_ARGS_CAPACITY - used - VALUES_SECTION.size} in its frame (put "
                "large data in a remote tensor, Worker.alloc_remote)"
            )
        heap = sink.heap
        try:
            buf = heap.alloc_buffer(n, "uint8")
        except MemoryError as exc:
            raise MemoryError(
                f"cannot {_API[kind]} {who} ({handle.name}): its values and kwargs need {n} "
                f"bytes of the shared heap: {exc}"
            ) from None
        view = heap.array(buf)
        view[: len(values)] = np.frombuffer(values, np.uint8)
        view[len(values) :] = np.frombuffer(kwargs, np.uint8)
        heap.pin(buf.buffer_id)
        heap.free(buf)
        pins.append(buf.buffer_id)
        return values_section(values, kwargs, buf.offset)

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
                # Only INPUT reads: NO_DEP needs read-write access as the origin requires
                # (the task may write it, and writes to a snapshot would be lost).
                if owner != target and tag is not Tag.INPUT:
                    raise ValueError(
                        f"cannot {api}: {where} is tagged {tag.name}, but remote worker "
                        f"{target} holds only a read-only snapshot of {t!r} (imported; "
                        f"access read-only, {tag.name} needs read-write); tag it INPUT, or "
                        f"write it on its owner, worker {owner}"
                    )
                descs.append(remote.describe(t, target, f"{api}: {where}").with_tag(tag))
        return descs


#: The tags whose tensors a task writes.
_WRITTEN: Final = frozenset((Tag.OUTPUT, Tag.OUTPUT_EXISTING, Tag.INOUT))


def _check_retry_safe(
    args_list: list[TaskArgs], cfg: CallConfig, api: str, handle: CallableHandle, index: int
) -> None:
    """A task that writes a tensor in place may not be retried unless it says it is
    idempotent: a failed attempt's partial write would be read by the next one."""
    for m, a in enumerate(args_list):
        for k, tag in enumerate(a.tags):
            if tag in (Tag.INOUT, Tag.OUTPUT_EXISTING):
                where = f"args_list[{m}].tensors[{k}]" if len(args_list) > 1 else f"tensors[{k}]"
                raise ValueError(
                    f"cannot {api}: task {index} ({handle.name}) has max_retries="
                    f"{cfg.max_retries} and writes {where} in place ({tag.name}): a failed "
                    "attempt's partial write would be read by the next attempt; pass "
                    "CallConfig(idempotent=True) if running it again is safe"
                )


def _check_written_overlap(
    args_list: list[TaskArgs],
    member_descs: list[list[TensorDesc]],
    api: str,
    handle: CallableHandle,
    index: int,
) -> None:
    """Refuse a task two of whose written tensors share memory: the child would race with
    itself on it. Members of a group may write overlapping memory (one group is one
    writer, as in the origin: each member usually writes its own part of a shared output).
    The memory test is the dependency map's (``tensormap.overlaps``: per axis for 2-D
    blocks); two local arrays that pass it but whose elements never meet (interleaved
    strided views) are accepted."""
    for m, descs in enumerate(member_descs):
        if sum(d.tag in _WRITTEN for d in descs) < 2:
            continue  # nothing to compare (the common case)
        written: dict[Any, list[tuple[Any, str, Any]]] = {}
        for j, d in enumerate(descs):
            if d.tag not in _WRITTEN:
                continue
            r = region(d)
            if r.lo >= r.hi:
                continue
            where = f"args[{m}].tensors[{j}] ({d.tag.name})"
            tensor = args_list[m].tensors[j]
            for other_r, other, otensor in written.setdefault(d.key, []):
                if overlaps(r, other_r) and _shares(tensor, otensor):
                    raise ValueError(
                        f"cannot {api}: task {index} ({handle.name}) writes overlapping "
                        f"memory through {other} and {where} (buffer {d.buffer_id}, bytes "
                        f"[{other_r.lo}, {other_r.hi}) and [{r.lo}, {r.hi})); two written "
                        "arguments of one task would race"
                    )
            written[d.key].append((r, where, tensor))


def _shares(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        try:
            # The stubs admit only -1 and 0, but NumPy takes any bound on the work.
            return bool(np.shares_memory(a, b, max_work=10_000))  # type: ignore[arg-type]
        except np.exceptions.TooHardError:
            return True  # cannot tell cheaply: refuse, a race is worse than a refusal
    return True
