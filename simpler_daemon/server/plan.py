"""Request validation: a SubmitRun / RunOrchestration / RegisterCallable request -> a plan.

::

    SubmitRun.tasks[i] --Planner.plan_run--> [Planned(kind, handle, members, config, targets)]
                                               |  (every field checked; heap views built)
                                               v
                                  declarative(plan, bind) -> the run's orchestration function
                                  (declarative.py)

A request is validated completely before anything is submitted, so a bad field
is an ``INVALID_ARGUMENT`` naming it (``tasks[3].members[0].tensors[1].dtype``)
and never a half-built run. Tensors are views of heap buffers built from the
``TensorRef`` numbers; the engine maps each view back to its buffer and byte
range for dependency inference. Nothing here submits, records or answers: the
servicer (``service.py``) does that with what this module returns.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from typing import Any, Final

import numpy as np
from google.protobuf.message import DecodeError

from simpler_daemon.args import (
    MAX_NDIM,
    MAX_OUTPUT_PREFIX,
    MAX_PRIORITY,
    CallConfig,
    Tag,
    TaskArgs,
    ViewError,
    c_strides,
    check_view,
    dtype_code,
)
from simpler_daemon.callables import CallableHandle, digest_of, parse_import_path
from simpler_daemon.engine.worker import Worker
from simpler_daemon.errors import (
    AccessDenied,
    InvalidField,
    LimitExceeded,
    RegistrationError,
    UnknownObject,
)
from simpler_daemon.heap import Buffer
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol.fastwire import NativeTask
from simpler_daemon.remote.spec import RemoteWorkerSpec, parse_endpoint
from simpler_daemon.server.config import CallablesConfig, LimitsConfig
from simpler_daemon.server.retry_config import check_retry_safe, retry_fields
from simpler_daemon.server.status import error_text
from simpler_daemon.taskvalues import checked_received

__all__ = [
    "MAX_KEY",
    "MAX_LABEL",
    "REGISTER_KINDS",
    "SLICE_EVERY",
    "SLICE_S",
    "Planned",
    "Planner",
    "check_label",
    "check_reason",
    "run_priority",
    "timeout_field",
]

MAX_LABEL: Final = 256
MAX_KEY: Final = 256
#: Longest stretch (seconds) the planner and a declarative run's build hold the event loop
#: before yielding: a 100,000-task SubmitRun must not stall every other client.
SLICE_S: Final = 0.002
#: A loop over a request's tasks looks at the clock once per SLICE_EVERY + 1 tasks (a
#: look per task was two calls per task of a big run; 64 plain tasks take ~0.1 ms).
SLICE_EVERY: Final = 63
#: Well-formed hashids a Planner remembers (then it starts over).
_WELL_FORMED_KEPT: Final = 4096
#: Plain tasks whose plan is kept for later requests (one per callable; cleared when full).
_PLANNED_KEPT: Final = 256
#: Longest wait (seconds) a request may ask for; more means "until it ends" (as the client
#: library's MAX_WAIT_S): an event loop deadline further out overflows.
MAX_WAIT_S: Final = 1e8
_MAX_DTYPE_NAME: Final = 32
_U63: Final = 1 << 63

_TAGS: Final[dict[int, Tag]] = {
    pb.TAG_INPUT: Tag.INPUT,
    pb.TAG_OUTPUT: Tag.OUTPUT,
    pb.TAG_INOUT: Tag.INOUT,
    pb.TAG_OUTPUT_EXISTING: Tag.OUTPUT_EXISTING,
    pb.TAG_NO_DEP: Tag.NO_DEP,
}
#: CallableKind -> the engine's callable role.
REGISTER_KINDS: Final[dict[int, str]] = {
    pb.CALLABLE_KIND_SUB: "sub",
    pb.CALLABLE_KIND_ORCHESTRATION: "orchestration",
    pb.CALLABLE_KIND_CHIP: "chip",
}
_TASK_KIND_NAMES: Final[dict[int, str]] = {
    pb.TASK_KIND_SUB: "SUB",
    pb.TASK_KIND_SUB_GROUP: "SUB_GROUP",
    pb.TASK_KIND_NEXT_LEVEL: "NEXT_LEVEL",
    pb.TASK_KIND_NEXT_LEVEL_GROUP: "NEXT_LEVEL_GROUP",
}


# --------------------------------------------------------------------------- small fields


def timeout_field(request: Any, name: str) -> float:
    """A seconds field that must be finite and >= 0 (INVALID_ARGUMENT otherwise)."""
    value = float(getattr(request, name))
    if math.isnan(value) or value < 0:
        raise InvalidField(name, f"must be >= 0, got {value}")
    return min(value, MAX_WAIT_S)


_ONE_EMPTY: Final = (b"",)


def _parse(kind: Any, data: bytes, field: str) -> Any:
    """``kind.FromString(data)``; ``InvalidField`` naming ``field`` when it does not parse."""
    try:
        return kind.FromString(data)
    except (DecodeError, ValueError, TypeError) as exc:
        raise InvalidField(
            field,
            f"cannot parse {len(data)} bytes as {kind.DESCRIPTOR.full_name} "
            f"({str(exc) or type(exc).__name__})",
        ) from exc


class Slicer:
    """Yields to the event loop once ``SLICE_S`` has passed since the last yield, so a
    long loop over a request lets other clients' calls and the Scheduler run."""

    __slots__ = ("_since", "paused")

    def __init__(self) -> None:
        self._since = time.perf_counter()
        #: Whether it yielded at least once (the loop ran other calls meanwhile).
        self.paused = False

    def due(self) -> bool:
        return time.perf_counter() - self._since > SLICE_S

    async def pause(self) -> None:
        self.paused = True
        await asyncio.sleep(0)
        self._since = time.perf_counter()


def check_label(label: str, field: str = "label") -> None:
    if len(label) > MAX_LABEL:
        raise InvalidField(field, f"{len(label)} characters, at most {MAX_LABEL}")


def check_reason(reason: str) -> None:
    check_label(reason, "reason")


def run_priority(value: int, field: str = "priority") -> int:
    """A request's run priority: 0 (unset) is 1; above MAX_PRIORITY is refused."""
    if value > MAX_PRIORITY:
        raise InvalidField(field, f"priority {value} is out of range (1 to {MAX_PRIORITY})")
    return value or 1


# --------------------------------------------------------------------------- planning


class Planned:
    """One validated task of a SubmitRun: ready to hand to the Orchestrator."""

    __slots__ = ("config", "handle", "kind", "members", "targets")

    def __init__(
        self,
        kind: int,
        handle: CallableHandle,
        members: list[TaskArgs],
        config: CallConfig | None,
        targets: list[int],
    ) -> None:
        self.kind = kind
        self.handle = handle
        self.members = members
        self.config = config
        self.targets = targets


class Planner:
    """Checks requests against one started ``Worker`` (its heap, registry, workers) and
    the configured limits; every refusal is a ``RequestError`` naming the field."""

    def __init__(
        self,
        worker: Worker,
        limits: LimitsConfig,
        callables: CallablesConfig,
        *,
        credentials_dir: str = "",
    ) -> None:
        self._worker = worker
        self._limits = limits
        self._callables = callables
        self._credentials_dir = credentials_dir
        self._dtypes: dict[str, np.dtype[Any]] = {}
        self._default_config: CallConfig | None = None
        # Hashids already found well-formed (a pure check of the string, a regex costing
        # microseconds on every submitted run); bounded by _WELL_FORMED_KEPT.
        self._well_formed: set[str] = set()
        # Plain tasks planned before (one SUB call without arguments or config, the usual
        # small run), by hashid: (the task, its registration, the limits, the Planned).
        # Reused while the registration is the same one and still active and the limits
        # are unchanged (see _known); bounded by _PLANNED_KEPT.
        self._planned: dict[str, tuple[Any, Any, LimitsConfig, Planned]] = {}
        # The Task message standing for a Submit frame's plain task, and its encoding,
        # by hashid.
        self._plain_tasks: dict[str, tuple[Any, bytes]] = {}

    def reconfigure(self, limits: LimitsConfig, callables: CallablesConfig) -> None:
        """New limits and allow-list (SIGHUP) for requests planned from now on."""
        self._limits = limits
        self._callables = callables
        self._default_config = None  # it may carry the old limits.max_task_seconds
        self._planned.clear()

    def native_tasks(self, tasks: list[NativeTask]) -> tuple[list[Any], list[bytes]]:
        """A Submit frame's tasks as the Task messages a SubmitRun carries (checked then
        by :meth:`plan_run` as any), and each one's deterministic encoding (for the
        key's fingerprint, see ``keys.native_fingerprint``). A plain task (one call
        without arguments or config) is one shared message per callable, which
        :meth:`_known` recognises at once; ``InvalidField`` naming the field whose
        bytes or number is not valid."""
        out: list[Any] = []
        encoded: list[bytes] = []
        plain = self._plain_tasks
        for i, task in enumerate(tasks):
            if (
                task.kind == pb.TASK_KIND_SUB
                and task.members == _ONE_EMPTY
                and not task.workers
                and task.config is None
            ):
                known = plain.get(task.hashid)
                if known is None:
                    if len(plain) >= _PLANNED_KEPT:
                        plain.clear()
                    made = pb.Task(kind=pb.TASK_KIND_SUB, hashid=task.hashid, members=[pb.Args()])
                    known = plain[task.hashid] = (made, made.SerializeToString(deterministic=True))
                out.append(known[0])
                encoded.append(known[1])
                continue
            where = f"tasks[{i}]"
            try:
                msg = pb.Task(kind=task.kind, hashid=task.hashid)  # type: ignore[arg-type]
            except (ValueError, TypeError) as exc:
                raise InvalidField(f"{where}.kind", f"{task.kind} is not a task kind") from exc
            for j, member in enumerate(task.members):
                msg.members.append(_parse(pb.Args, member, f"{where}.members[{j}]"))
            for j, worker in enumerate(task.workers):
                if not -(1 << 31) <= worker < 1 << 31:
                    raise InvalidField(f"{where}.workers[{j}]", f"{worker} is not a worker id")
                msg.workers.append(worker)
            if task.config is not None:
                msg.config.CopyFrom(_parse(pb.CallConfig, task.config, f"{where}.config"))
            out.append(msg)
            encoded.append(msg.SerializeToString(deterministic=True))
        return out, encoded

    def _known(self, task: Any) -> Planned | None:
        """The Planned of a plain task planned before, if it still holds: the same task,
        its callable's registration the same one and active (an unregister, a reload or
        the end of the registering session tombstones or replaces it), the same limits.
        A plain task pins nothing, so its plan depends on nothing else."""
        cached = self._planned.get(task.hashid)
        if cached is None:
            return None
        known, entry, limits, planned = cached
        if (
            limits is not self._limits
            or entry.state != "active"
            or entry.spec.handle is not planned.handle
            or self._worker.registry.lookup(task.hashid) is not entry
            or task != known
        ):
            del self._planned[task.hashid]
            return None
        return planned

    def _remember(self, task: Any, planned: Planned) -> None:
        entry = self._worker.registry.lookup(task.hashid)
        if entry is None or entry.spec.handle is not planned.handle:
            return
        if len(self._planned) >= _PLANNED_KEPT:
            self._planned.clear()
        known = pb.Task()
        known.CopyFrom(task)
        self._planned[task.hashid] = (known, entry, self._limits, planned)

    # -- single fields -------------------------------------------------------------------

    def dtype(self, name: str, field: str) -> np.dtype[Any]:
        dt = self._dtypes.get(name)
        if dt is not None:
            return dt
        if not name:
            raise InvalidField(field, "required (a NumPy dtype name such as 'float32')")
        if len(name) > _MAX_DTYPE_NAME:
            raise InvalidField(field, f"dtype name of {len(name)} characters is too long")
        try:
            dt = np.dtype(name)
            dtype_code(dt)
        except (TypeError, ValueError) as exc:
            raise InvalidField(field, f"unknown or unsupported dtype {name!r}") from exc
        self._dtypes[name] = dt
        return dt

    def buffer(self, buffer_id: int, generation: int, field: str) -> Buffer:
        if buffer_id == 0:
            raise InvalidField(f"{field}.buffer_id" if field else "buffer_id", "required")
        try:
            buf = self._worker.heap.get(buffer_id)
        except KeyError as exc:
            where = f"{field}.buffer_id" if field else "buffer_id"
            raise UnknownObject(where, f"buffer {buffer_id} is not allocated") from exc
        if generation and generation != buf.generation:
            where = f"{field}.generation" if field else "generation"
            raise UnknownObject(
                where,
                f"buffer {buffer_id} generation {generation} is gone "
                f"(the current generation is {buf.generation})",
            )
        return buf

    def handle(self, hashid: str, field: str) -> CallableHandle:
        if not hashid:
            raise InvalidField(field, "required ('sha256:' followed by 64 lowercase hex digits)")
        if hashid not in self._well_formed:
            try:
                digest_of(hashid)
            except RegistrationError as exc:
                raise InvalidField(field, exc.args[0].partition(": ")[2] or str(exc)) from exc
            if len(self._well_formed) >= _WELL_FORMED_KEPT:
                self._well_formed.clear()
            self._well_formed.add(hashid)
        entry = self._worker.registry.lookup(hashid)
        if entry is None or entry.state != "active":
            raise UnknownObject(field, f"callable {hashid} is not registered")
        return entry.spec.handle

    def orchestration_handle(self, hashid: str, field: str) -> CallableHandle:
        handle = self.handle(hashid, field)
        if handle.role != "orchestration":
            raise InvalidField(
                field,
                f"{handle.name} is registered as {handle.role}, not as an orchestration function",
            )
        return handle

    def task_deadline_ms(self, deadline_ms: int) -> int:
        """``deadline_ms`` under ``limits.max_task_seconds``: min(deadline_ms, the ceiling),
        the ceiling when there is no deadline (0). The parent enforces it (it kills the
        child), here and on a remote worker the config travels to."""
        ceiling = self._limits.max_task_seconds
        if ceiling <= 0:
            return deadline_ms
        ceiling_ms = max(1, math.ceil(ceiling * 1000))
        return ceiling_ms if deadline_ms == 0 else min(deadline_ms, ceiling_ms)

    def default_config(self) -> CallConfig | None:
        """The config of a task that sends none: ``None`` (the engine's default) unless
        ``limits.max_task_seconds`` gives it a deadline."""
        if self._limits.max_task_seconds <= 0:
            return None
        if self._default_config is None:
            self._default_config = CallConfig(deadline_ms=self.task_deadline_ms(0))
        return self._default_config

    def call_config(self, msg: Any, field: str) -> CallConfig:
        if msg.deadline_ms >= _U63:
            raise InvalidField(f"{field}.deadline_ms", f"{msg.deadline_ms} is too large")
        if msg.threads >= 1 << 31:
            raise InvalidField(f"{field}.threads", f"{msg.threads} is too large")
        prefix_len = len(msg.output_prefix.encode())
        if prefix_len > MAX_OUTPUT_PREFIX:
            raise InvalidField(
                f"{field}.output_prefix",
                f"{prefix_len} bytes, the limit is {MAX_OUTPUT_PREFIX}",
            )
        retry = retry_fields(msg, field)
        try:
            return CallConfig(
                deadline_ms=self.task_deadline_ms(msg.deadline_ms),
                threads=msg.threads,
                enable_profile=msg.enable_profile,
                enable_dump_args=msg.enable_dump_args,
                output_prefix=msg.output_prefix,
                **retry,
            )
        except (TypeError, ValueError) as exc:
            raise InvalidField(field, str(exc)) from exc

    def task_args(self, msg: Any, field: str, pins: set[int]) -> TaskArgs:
        """TaskArgs of heap views from an ``Args`` message, every number checked.

        Every buffer referenced is pinned once (its id added to ``pins``): a FreeBuffer
        from now on is deferred until the caller unpins it (when the run has ended), so
        the memory cannot go to a new buffer that this run would then write into."""
        out = TaskArgs()
        tensors = msg.tensors
        scalars = msg.scalars
        limits = self._limits
        if len(tensors) > limits.max_tensors_per_task:
            raise LimitExceeded(
                f"{field}.tensors",
                f"{len(tensors)} tensors, limits.max_tensors_per_task = "
                f"{limits.max_tensors_per_task}",
            )
        if len(scalars) > limits.max_scalars_per_task:
            raise LimitExceeded(
                f"{field}.scalars",
                f"{len(scalars)} scalars, limits.max_scalars_per_task = "
                f"{limits.max_scalars_per_task}",
            )
        if scalars:
            out.scalars = list(scalars)
        if msg.values or msg.kwargs:
            size = len(msg.values) + len(msg.kwargs)
            if size > limits.max_value_bytes:
                raise LimitExceeded(
                    f"{field}.values",
                    f"values and kwargs of {size} bytes, limits.max_value_bytes = "
                    f"{limits.max_value_bytes}",
                )
            try:
                out._values = checked_received(msg.values, msg.kwargs, field)
            except ValueError as exc:
                text = str(exc)
                name = "kwargs" if text.startswith(f"{field}.kwargs") else "values"
                raise InvalidField(f"{field}.{name}", text.split(": ", 1)[-1]) from None
        if not tensors:
            return out
        heap = self._worker.heap
        for t, ref in enumerate(tensors):
            where = f"{field}.tensors[{t}]"
            tag = _TAGS.get(ref.tag)
            if tag is None:
                raise InvalidField(
                    f"{where}.tag",
                    "required" if ref.tag == pb.TAG_UNSPECIFIED else f"unknown tag {ref.tag}",
                )
            buf = self.buffer(ref.buffer_id, ref.generation, where)
            if buf.buffer_id not in pins:
                heap.pin(buf.buffer_id)
                pins.add(buf.buffer_id)
            dt = self.dtype(ref.dtype, f"{where}.dtype")
            shape = tuple(ref.shape)
            if len(shape) > MAX_NDIM:
                raise InvalidField(f"{where}.shape", f"{len(shape)} dimensions, at most {MAX_NDIM}")
            strides: tuple[int, ...] | None = tuple(ref.strides) or None
            if strides is not None and len(strides) != len(shape):
                raise InvalidField(
                    f"{where}.strides",
                    f"{len(strides)} strides for {len(shape)} dimensions",
                )
            # Every byte the view reaches lies in its buffer, and the view presents at
            # most as many bytes as the largest buffer: a stride-0 view over one byte
            # would otherwise claim any shape (2**40 elements pin a worker for days).
            try:
                check_view(
                    shape,
                    strides if strides is not None else c_strides(shape, dt.itemsize),
                    dt.itemsize,
                    ref.byte_offset,
                    buf.nbytes,
                    max_view_bytes=limits.max_buffer_bytes,
                    strides_given=strides is not None,
                    what=f"buffer {buf.buffer_id}",
                )
            except ViewError as exc:
                raise InvalidField(f"{where}.{exc.field}", str(exc)) from exc
            try:
                desc = heap.describe_buffer(
                    buf.buffer_id,
                    byte_offset=ref.byte_offset,
                    shape=shape,
                    dtype=dt,
                    strides=strides,
                )
                view: np.ndarray[Any, Any] = np.ndarray(
                    shape,
                    dtype=dt,
                    buffer=heap.mmap,
                    offset=buf.offset + ref.byte_offset,
                    strides=desc.strides,
                )
            except (ValueError, TypeError, OverflowError) as exc:
                raise InvalidField(where, error_text(exc)) from exc
            out.tensors.append(view)
            out.tags.append(tag)
        return out

    def next_level_ids(self) -> set[int]:
        manager = self._worker.manager
        return set(manager.next_level) if manager is not None else set()

    # -- whole requests --------------------------------------------------------------------

    def register_target(self, request: Any) -> tuple[str, str, str]:
        """``(module, qualname, role)`` of a RegisterCallableRequest.

        Raises ``InvalidField`` (``import_path``, ``kind``, ``workers``) or
        ``AccessDenied`` (a module outside ``callables.allowed_modules``).
        """
        path = request.import_path
        if not path:
            raise InvalidField("import_path", "required ('module:qualname')")
        try:
            module, qualname = parse_import_path(path)
        except RegistrationError as exc:
            raise InvalidField("import_path", exc.args[0].partition(": ")[2]) from exc
        allowed = self._callables
        if not allowed.allows(module):
            raise AccessDenied(
                "import_path",
                f"module {module!r} is not under callables.allowed_modules "
                f"({', '.join(allowed.allowed_modules) or 'nothing'})",
            )
        kind = REGISTER_KINDS.get(request.kind)
        if kind is None:
            raise InvalidField(
                "kind",
                "required"
                if request.kind == pb.CALLABLE_KIND_UNSPECIFIED
                else f"unknown callable kind {request.kind}",
            )
        if request.workers:
            if self._worker.level == 3:
                raise InvalidField("workers", "only a level-4 daemon takes an explicit worker list")
            known = self.next_level_ids()
            for j, wid in enumerate(request.workers):
                if wid not in known:
                    raise UnknownObject(
                        f"workers[{j}]",
                        f"worker {wid} is not a NEXT_LEVEL worker of this daemon "
                        f"(known: {sorted(known)})",
                    )
        return module, qualname, kind

    def remote_spec(self, request: Any) -> RemoteWorkerSpec:
        """The ``RemoteWorkerSpec`` an ``AddRemoteWorkerRequest`` asks for.

        Unset fields take the ``RemoteWorkerSpec`` defaults. Raises
        ``InvalidField`` naming the field (``endpoint``, ``num_chips``, ...) or
        ``AccessDenied`` for a credential file outside
        ``workers.remote_credentials_dir``.
        """
        if not request.endpoint:
            raise InvalidField("endpoint", "required ('IP:PORT' of a simpler-remote-worker)")
        try:
            parse_endpoint(request.endpoint, "endpoint")
        except ValueError as exc:
            raise InvalidField("endpoint", str(exc)) from exc
        kwargs: dict[str, Any] = {"endpoint": request.endpoint, "num_chips": request.num_chips}
        # 0 SUB workers is meaningful only beside chips; with neither, the default (1).
        if request.num_sub_workers or request.num_chips:
            kwargs["num_sub_workers"] = request.num_sub_workers
        if request.HasField("session_timeout_s"):
            value = request.session_timeout_s
            if not (math.isfinite(value) and value > 0):
                raise InvalidField("session_timeout_s", f"must be > 0, got {value}")
            kwargs["session_timeout_s"] = value
        if request.heap_bytes:
            kwargs["heap_bytes"] = request.heap_bytes
        if request.chip_pipeline_depth:
            if request.chip_pipeline_depth not in (1, 2):
                raise InvalidField(
                    "chip_pipeline_depth", f"must be 1 or 2, got {request.chip_pipeline_depth}"
                )
            kwargs["chip_pipeline_depth"] = request.chip_pipeline_depth
        for name in ("token_file", "tls_ca_file", "tls_cert_file", "tls_key_file"):
            path = getattr(request, name)
            if path:
                kwargs[name] = self._credential_file(name, path)
        if request.tls_server_name:
            if "tls_ca_file" not in kwargs:
                raise InvalidField("tls_server_name", "requires tls_ca_file (TLS)")
            kwargs["tls_server_name"] = request.tls_server_name
        if ("tls_cert_file" in kwargs) != ("tls_key_file" in kwargs):
            missing = "tls_key_file" if "tls_cert_file" in kwargs else "tls_cert_file"
            raise InvalidField(missing, "tls_cert_file and tls_key_file go together")
        if "tls_cert_file" in kwargs and "tls_ca_file" not in kwargs:
            raise InvalidField("tls_ca_file", "a client certificate needs tls_ca_file (TLS)")
        try:
            return RemoteWorkerSpec(**kwargs)
        except ValueError as exc:  # a rule of the spec the checks above do not repeat
            raise InvalidField("", str(exc)) from exc

    def _credential_file(self, field: str, path: str) -> str:
        """A client-named credential file, allowed only inside the configured directory:
        the daemon would otherwise send any file it can read to any endpoint."""
        base = self._credentials_dir
        if not base:
            raise AccessDenied(
                field,
                "cannot use a credential file named by a client: "
                "workers.remote_credentials_dir is not set",
            )
        if not os.path.isabs(path) or "\0" in path:
            raise InvalidField(field, f"{path!r} must be an absolute path")
        real, root = os.path.realpath(path), os.path.realpath(base)
        if os.path.commonpath([real, root]) != root:
            raise AccessDenied(
                field, f"{path!r} is outside workers.remote_credentials_dir ({base})"
            )
        return real

    async def plan_run(
        self, request: Any, pins: set[int], slicer: Slicer | None = None
    ) -> tuple[list[Planned], int]:
        """Validate every task of a SubmitRun; returns the plan and the call count.

        Yields to the loop every ``SLICE_S`` (see :class:`Slicer`; ``slicer.paused``
        then tells the caller that the loop ran meanwhile). Buffers are pinned
        as they are checked (``pins``, see :meth:`task_args`); the caller unpins them
        when the run ends or when planning raises.

        A task equal to the one before it (``[sub_task(f)] * n``, the usual big run) is
        not validated again: it gets the same :class:`Planned` (its args are encoded
        per slot at submit), so such a run costs one validation and one comparison per
        task. Equal tasks pass or fail alike, and the first one names its index. A
        plain task (one SUB call without arguments or config) planned by an earlier
        request is not validated again either while its callable's registration and
        the limits are unchanged (see :meth:`_known`)."""
        tasks = request.tasks
        limits = self._limits
        if not tasks:
            raise InvalidField("tasks", "a run needs at least one task")
        if len(tasks) > limits.max_tasks_per_run:
            raise LimitExceeded(
                "tasks",
                f"{len(tasks)} tasks, limits.max_tasks_per_run = {limits.max_tasks_per_run}",
            )
        level = self._worker.level
        handles: dict[str, CallableHandle] = {}
        next_level: set[int] | None = None
        plan: list[Planned] = []
        total = 0
        empty = TaskArgs()
        if slicer is None:
            slicer = Slicer()
        prev: Any = None
        prev_planned: Planned | None = None
        for i, task in enumerate(tasks):
            if not i & SLICE_EVERY and slicer.due():
                await slicer.pause()
            if prev_planned is not None and task == prev:
                plan.append(prev_planned)
                total += len(prev_planned.members)
                continue
            known = self._known(task)
            if known is not None:
                prev, prev_planned = task, known
                plan.append(known)
                total += 1
                continue
            where = f"tasks[{i}]"
            kind = task.kind
            kind_name = _TASK_KIND_NAMES.get(kind)
            if kind_name is None:
                raise InvalidField(
                    f"{where}.kind",
                    "required" if kind == pb.TASK_KIND_UNSPECIFIED else f"unknown task kind {kind}",
                )
            handle = handles.get(task.hashid)
            if handle is None:
                handle = self.handle(task.hashid, f"{where}.hashid")
                handles[task.hashid] = handle
            sub = kind in (pb.TASK_KIND_SUB, pb.TASK_KIND_SUB_GROUP)
            if sub and handle.role != "sub":
                raise InvalidField(
                    f"{where}.hashid",
                    f"{handle.name} is registered as {handle.role}; a {kind_name} task needs "
                    "a SUB callable",
                )
            if not sub and (handle.role == "sub" or (level == 3 and handle.role != "chip")):
                raise InvalidField(
                    f"{where}.hashid",
                    f"{handle.name} is registered as {handle.role}; a {kind_name} task needs "
                    + (
                        "a CHIP kernel" if level == 3 else "a chip kernel or orchestration function"
                    ),
                )
            members = task.members
            group = kind in (pb.TASK_KIND_SUB_GROUP, pb.TASK_KIND_NEXT_LEVEL_GROUP)
            if not members:
                raise InvalidField(f"{where}.members", "at least one member is required")
            if not group and len(members) != 1:
                raise InvalidField(
                    f"{where}.members",
                    f"a {kind_name} task has exactly one member, got {len(members)}",
                )
            if len(members) > limits.max_group_members:
                raise LimitExceeded(
                    f"{where}.members",
                    f"{len(members)} members, limits.max_group_members = "
                    f"{limits.max_group_members}",
                )
            workers = list(task.workers)
            if sub and workers:
                raise InvalidField(f"{where}.workers", f"must be empty for a {kind_name} task")
            if not sub:
                want = len(members) if group else 1
                if len(workers) != want:
                    raise InvalidField(
                        f"{where}.workers",
                        f"a {kind_name} task needs {want} target worker(s), got {len(workers)}",
                    )
                if len(set(workers)) != len(workers):
                    raise InvalidField(f"{where}.workers", f"targets {workers} are not distinct")
                if next_level is None:
                    next_level = self.next_level_ids()
                for j, wid in enumerate(workers):
                    if wid not in next_level:
                        raise UnknownObject(
                            f"{where}.workers[{j}]",
                            f"worker {wid} is not a NEXT_LEVEL worker of this daemon "
                            f"(known: {sorted(next_level)})",
                        )
            config = (
                self.call_config(task.config, f"{where}.config")
                if task.HasField("config")
                else self.default_config()
            )
            args_list: list[TaskArgs] = []
            plain = kind == pb.TASK_KIND_SUB and not task.HasField("config")
            for m, member in enumerate(members):
                if slicer.due():
                    await slicer.pause()
                if not (member.tensors or member.scalars or member.values or member.kwargs):
                    args_list.append(empty)
                else:
                    plain = False
                    args_list.append(self.task_args(member, f"{where}.members[{m}]", pins))
            if config is not None and config.max_retries and not config.idempotent:
                check_retry_safe(args_list, config, where)
            total += len(args_list)
            prev, prev_planned = task, Planned(kind, handle, args_list, config, workers)
            plan.append(prev_planned)
            if plain:
                self._remember(task, prev_planned)
        return plan, total
