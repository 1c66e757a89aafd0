"""The messages of the daemon's API, built and read without a channel.

``tensor`` / ``make_args`` / ``task`` / ``sub_task`` / ``call_config`` are the
public builders of a run (re-exported by :mod:`simpler_daemon.client`); the
``*_request`` functions build one RPC's request each, shared by ``Client`` and
``AsyncClient`` so the two cannot drift; :func:`raise_for_status` turns a
terminal ``RunStatus`` into the result or the ``TaskError`` it carries. Pure
functions over protobuf messages: no channel, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

import numpy as np

from simpler_daemon.args import CallConfig, Tag, check_priority, scalar_word
from simpler_daemon.errors import RunCancelled, TaskError
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol.pbwire import varint
from simpler_daemon.retrypolicy import DEFAULT_RETRY_ON, qualified_name
from simpler_daemon.taskvalues import array_header, encode_kwargs, encode_value

__all__ = [
    "MAX_WAIT_S",
    "TERMINAL_STATES",
    "WRITE_CHUNK",
    "add_remote_request",
    "alloc_request",
    "array_bytes",
    "call_config",
    "call_deadline",
    "cancel_request",
    "check_wait",
    "drain_request",
    "list_runs_request",
    "make_args",
    "orchestration_request",
    "raise_for_status",
    "read_request",
    "register_request",
    "sub_task",
    "submit_request",
    "task",
    "tensor",
    "wait_request",
    "write_chunk",
    "write_requests",
]

#: Longest wait in seconds a client asks for; longer ones (``inf`` too) mean "no limit".
#: gRPC turns a deadline beyond about 1e9 s into an immediate DEADLINE_EXCEEDED.
MAX_WAIT_S: Final = 1e8
#: Bytes per WriteBuffer message unless the caller asks for less.
WRITE_CHUNK: Final = 1 << 20
TERMINAL_STATES: Final = frozenset(
    {pb.RUN_STATE_COMPLETED, pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED, pb.RUN_STATE_LOST}
)

#: The run states a ListRuns filter may name.
_STATE_NAMES: Final = tuple(n for n, _ in pb.RunState.items() if n != "RUN_STATE_UNSPECIFIED")
_TAGS: Final[dict[str, int]] = {
    "input": pb.TAG_INPUT,
    "output": pb.TAG_OUTPUT,
    "inout": pb.TAG_INOUT,
    "output_existing": pb.TAG_OUTPUT_EXISTING,
    "no_dep": pb.TAG_NO_DEP,
}
_ENGINE_TAGS: Final[dict[Tag, int]] = {
    Tag.INPUT: pb.TAG_INPUT,
    Tag.OUTPUT: pb.TAG_OUTPUT,
    Tag.INOUT: pb.TAG_INOUT,
    Tag.OUTPUT_EXISTING: pb.TAG_OUTPUT_EXISTING,
    Tag.NO_DEP: pb.TAG_NO_DEP,
}
_TASK_KINDS: Final[dict[str, int]] = {
    "sub": pb.TASK_KIND_SUB,
    "sub_group": pb.TASK_KIND_SUB_GROUP,
    "next_level": pb.TASK_KIND_NEXT_LEVEL,
    "next_level_group": pb.TASK_KIND_NEXT_LEVEL_GROUP,
}
_CALLABLE_KINDS: Final[dict[str, pb.CallableKind]] = {
    "sub": pb.CALLABLE_KIND_SUB,
    "orchestration": pb.CALLABLE_KIND_ORCHESTRATION,
    "chip": pb.CALLABLE_KIND_CHIP,
}


def _tag(tag: str | int | Tag) -> int:
    if isinstance(tag, Tag):
        return _ENGINE_TAGS[tag]
    if isinstance(tag, str):
        key = tag.strip().lower().removeprefix("tag_")
        if key not in _TAGS:
            raise ValueError(f"unknown tag {tag!r} (choose one of {', '.join(_TAGS)})")
        return _TAGS[key]
    return int(tag)


def tensor(
    buffer_id: int,
    tag: str | int | Tag,
    shape: Sequence[int],
    dtype: str | np.dtype[Any] | type,
    *,
    byte_offset: int = 0,
    strides: Sequence[int] | None = None,
    generation: int = 0,
) -> pb.TensorRef:
    """A ``TensorRef``: a view of ``shape``/``dtype`` at ``byte_offset`` in a buffer.

    ``tag`` is ``"input"``, ``"output"``, ``"inout"``, ``"output_existing"``,
    ``"no_dep"`` (or a ``simpler_daemon.Tag``).
    """
    return pb.TensorRef(
        buffer_id=buffer_id,
        generation=generation,
        byte_offset=byte_offset,
        shape=[int(d) for d in shape],
        dtype=np.dtype(dtype).name,
        strides=[int(s) for s in strides or ()],
        tag=_tag(tag),  # type: ignore[arg-type]
    )


def make_args(
    tensors: Iterable[pb.TensorRef] = (),
    scalars: Iterable[int] = (),
    *,
    values: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> pb.Args:
    """The arguments of one call: tensors and u64 scalars, in order, and the Python
    ``values`` / ``kwargs`` the callable reads as ``args.values`` / ``args.kwargs``.

    ``TypeError`` for a scalar that is not an integer (bool, float, str: nothing is
    converted silently), ``ValueError`` for one outside 0 to 2**64 - 1, both naming
    ``scalars[k]``; ``TypeError`` for a value that is not plain data (None, bool, int,
    float, str, bytes, list, tuple, dict with str keys; a NumPy array goes in a tensor)
    naming ``values[k]`` / ``kwargs['key']``. Built before any call, so the index of
    the task in its run is not known here: the traceback shows it."""
    words = [scalar_word(s, k, what="build task arguments") for k, s in enumerate(scalars)]
    out = pb.Args(tensors=list(tensors), scalars=words)
    if values:
        if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
            raise TypeError(
                "cannot build task arguments: values= must be a list or tuple of values, "
                f"got {type(values).__name__}"
            )
        parts = [
            encode_value(v, f"values[{k}]", "build task arguments") for k, v in enumerate(values)
        ]
        out.values = array_header(len(parts)) + b"".join(parts)
    if kwargs:
        if not isinstance(kwargs, Mapping):
            raise TypeError(
                "cannot build task arguments: kwargs= must be a dict of str to values, "
                f"got {type(kwargs).__name__}"
            )
        out.kwargs = encode_kwargs(kwargs, "build task arguments")
    return out


def call_config(
    *,
    deadline_ms: int = 0,
    threads: int = 0,
    enable_profile: bool = False,
    enable_dump_args: bool = False,
    output_prefix: str = "",
    max_retries: int = 0,
    retry_on: Iterable[str] = (),
    retry_exceptions: Iterable[type[BaseException] | str] = (),
    idempotent: bool = False,
) -> pb.CallConfig:
    """A task's ``CallConfig`` message. Retries as in-process (``CallConfig``):
    ``retry_on`` ``"crash"`` (the default), ``"deadline"``, ``"exception"``;
    ``retry_exceptions`` classes or qualified names, sent as names. The same checks as
    the engine's, before anything is sent (``ValueError``/``TypeError``)."""
    if max_retries or retry_on or retry_exceptions or idempotent:
        # The engine's own checks (one message for the same mistake in both APIs).
        CallConfig(
            max_retries=max_retries,
            retry_on=tuple(retry_on) or DEFAULT_RETRY_ON,
            retry_exceptions=tuple(retry_exceptions),
            idempotent=idempotent,
        )
    return pb.CallConfig(
        deadline_ms=deadline_ms,
        threads=threads,
        enable_profile=enable_profile,
        enable_dump_args=enable_dump_args,
        output_prefix=output_prefix,
        max_retries=max_retries,
        retry_on=list(retry_on),
        retry_exceptions=[e if isinstance(e, str) else qualified_name(e) for e in retry_exceptions],
        idempotent=idempotent,
    )


def task(
    kind: str | int,
    hashid: str,
    members: Sequence[pb.Args],
    *,
    workers: Sequence[int] = (),
    config: pb.CallConfig | None = None,
) -> pb.Task:
    """A ``Task``: ``kind`` is ``"sub"``, ``"sub_group"``, ``"next_level"`` or
    ``"next_level_group"``; one ``Args`` per member; NEXT_LEVEL targets in ``workers``."""
    if isinstance(kind, str):
        if kind.lower() not in _TASK_KINDS:
            raise ValueError(f"unknown task kind {kind!r} (choose one of {', '.join(_TASK_KINDS)})")
        kind = _TASK_KINDS[kind.lower()]
    out = pb.Task(kind=kind, hashid=hashid, members=list(members), workers=list(workers))  # type: ignore[arg-type]
    if config is not None:
        out.config.CopyFrom(config)
    return out


def sub_task(
    hashid: str,
    tensors: Iterable[pb.TensorRef] = (),
    scalars: Iterable[int] = (),
    config: pb.CallConfig | None = None,
    *,
    values: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> pb.Task:
    """One SUB call of ``hashid``; ``values`` and ``kwargs`` as :func:`make_args` takes
    them (the callable reads ``args.values`` and ``args.kwargs``)."""
    return task(
        "sub", hashid, [make_args(tensors, scalars, values=values, kwargs=kwargs)], config=config
    )


def raise_for_status(status: pb.RunStatus) -> pb.RunStatus:
    """Return a COMPLETED status; raise ``TaskError`` / ``RunCancelled`` for a failed one."""
    if status.state == pb.RUN_STATE_COMPLETED:
        return status
    if status.state not in TERMINAL_STATES:
        raise TimeoutError(
            f"run {status.run_id} is still {pb.RunState.Name(status.state).removeprefix('RUN_STATE_')}"
        )
    err = status.error
    cls = RunCancelled if status.state == pb.RUN_STATE_CANCELLED else TaskError
    raise cls(
        err.message or f"run {status.run_id} {pb.RunState.Name(status.state)}",
        run_id=status.run_id,
        worker_id=err.worker_id if err.HasField("worker_id") else None,
        hashid=err.hashid or None,
        dispatch_id=err.dispatch_id or None,
        outcome=err.outcome or "TASK_FAILURE",
        remote_text=err.remote_text,
        attempts=err.attempts or 1,
        attempt_causes=tuple(err.attempt_causes),
    )


def submit_request(
    tasks: Sequence[pb.Task],
    key: str,
    label: str,
    wait_seconds: float | None,
    priority: int = 1,
    include_results: bool = False,
) -> pb.SubmitRunRequest:
    """``priority``: 1 to 1000 (``ValueError`` / ``TypeError`` otherwise, before any call)."""
    if not isinstance(tasks, (list, tuple)):
        tasks = list(tasks)
    many = len(tasks) > _COPIED_TASKS and _all_tasks(tasks)
    request = pb.SubmitRunRequest(
        tasks=() if many else list(tasks),
        idempotency_key=key,
        label=label,
        priority=check_priority(priority),
        include_results=include_results,
    )
    if many:
        request.MergeFromString(_encoded_tasks(tasks))
    if wait_seconds is not None:
        request.wait_seconds = wait_seconds
    return request


#: A SubmitRun of more tasks than this gets them from their encodings, each distinct
#: Task object encoded once, rather than by copying every message into the request:
#: ``[task] * 20_000`` took 4.8 ms that way, 1.9 ms this way.
_COPIED_TASKS: Final = 64
#: The key byte of SubmitRunRequest.tasks (field 2, length-delimited).
_TASKS_TAG: Final = b"\x12"


def _all_tasks(tasks: Sequence[Any]) -> bool:
    """Whether every element is a Task message (else the constructor's error stands)."""
    for task in tasks:  # noqa: SIM110 - no generator frame per element
        if type(task) is not pb.Task:
            return False
    return True


def _encoded_tasks(tasks: Sequence[pb.Task]) -> bytes:
    """The ``tasks`` field of a SubmitRunRequest as protobuf writes it, from each
    distinct Task object's encoding (a run of one task repeated encodes it once)."""
    done: dict[int, bytes] = {}
    parts: list[bytes] = []
    for task in tasks:
        part = done.get(id(task))
        if part is None:
            data = task.SerializeToString()
            part = done[id(task)] = _TASKS_TAG + varint(len(data)) + data
        parts.append(part)
    return b"".join(parts)


def orchestration_request(
    hashid: str,
    args: pb.Args | None,
    config: pb.CallConfig | None,
    key: str,
    label: str,
    priority: int = 1,
) -> pb.RunOrchestrationRequest:
    request = pb.RunOrchestrationRequest(
        hashid=hashid,
        idempotency_key=key,
        label=label,
        priority=check_priority(priority, "run an orchestration"),
    )
    if args is not None:
        request.args.CopyFrom(args)
    if config is not None:
        request.config.CopyFrom(config)
    return request


def register_request(
    import_path: str, kind: str, workers: Sequence[int], reload: bool = False
) -> pb.RegisterCallableRequest:
    """``kind``: ``"sub"``, ``"orchestration"`` or ``"chip"`` (else UNSPECIFIED, refused by
    the daemon with a message naming the field). ``reload``: re-import edited code."""
    return pb.RegisterCallableRequest(
        import_path=import_path,
        kind=_CALLABLE_KINDS.get(kind, pb.CALLABLE_KIND_UNSPECIFIED),
        workers=list(workers),
        reload=reload,
    )


def alloc_request(shape: Sequence[int], dtype: Any, label: str) -> pb.AllocBufferRequest:
    return pb.AllocBufferRequest(
        shape=[int(d) for d in shape], dtype=np.dtype(dtype).name, label=label
    )


def read_request(
    buffer_id: int, offset: int, length: int, generation: int, chunk_bytes: int
) -> pb.ReadBufferRequest:
    return pb.ReadBufferRequest(
        buffer_id=buffer_id,
        generation=generation,
        offset=offset,
        length=length,
        chunk_bytes=chunk_bytes,
    )


def write_requests(
    buffer_id: int, data: Any, offset: int, generation: int, chunk: int
) -> Iterator[pb.WriteBufferRequest]:
    """The WriteBuffer stream: the target first, then ``data`` in ``chunk``-byte pieces."""
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    # total_bytes: the daemon refuses an overrun before the data is sent.
    target = pb.WriteBufferTarget(
        buffer_id=buffer_id, generation=generation, offset=offset, total_bytes=len(view)
    )
    yield pb.WriteBufferRequest(target=target)
    for start in range(0, len(view), chunk):
        yield pb.WriteBufferRequest(data=bytes(view[start : start + chunk]))


def write_chunk(max_message: int, chunk: int | None) -> int:
    """Bytes per WriteBuffer message: ``chunk`` (default ``WRITE_CHUNK``) below the daemon's
    ``max_message_bytes`` less room for the envelope."""
    limit = max(1, max_message - 1024)
    return min(chunk or WRITE_CHUNK, limit)


def array_bytes(array: np.ndarray[Any, Any]) -> memoryview:
    """The bytes of ``array`` in C order (copied only when it is not contiguous)."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)


def check_wait(value: float | None, name: str) -> float | None:
    """A wait in seconds: None stays None (no limit), ``inf`` and anything above
    :data:`MAX_WAIT_S` become ``MAX_WAIT_S``; NaN, negative or non-numbers raise
    ``ValueError`` naming ``name`` (they would become an immediate DEADLINE_EXCEEDED)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot wait: {name} must be a number of seconds, got {value!r}") from exc
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"cannot wait: {name} must be >= 0 seconds, got {value!r}")
    return min(seconds, MAX_WAIT_S)


def call_deadline(wait: float | None, margin: float) -> float | None:
    """The gRPC deadline of a call that waits ``wait`` seconds (checked by
    :func:`check_wait`) on the daemon: ``wait + margin``, None for no limit."""
    if wait is None or not wait < MAX_WAIT_S:  # NaN too: the daemon refuses it, in time
        return None
    return max(wait, 0.0) + margin


def wait_request(
    run_id: int, timeout: float | None, include_results: bool = False
) -> pb.WaitRunRequest:
    """``timeout``: seconds (checked by :func:`check_wait`); None or MAX_WAIT_S waits
    until the run ends."""
    request = pb.WaitRunRequest(run_id=int(run_id), include_results=include_results)
    if timeout is not None and timeout < MAX_WAIT_S:
        request.timeout_seconds = timeout
    return request


def cancel_request(run_id: int, reason: str, terminate: bool) -> pb.CancelRunRequest:
    return pb.CancelRunRequest(run_id=int(run_id), reason=reason, terminate=terminate)


def trace_request(run_id: int) -> pb.GetRunTraceRequest:
    """``run_id``: an int >= 1 (``ValueError`` otherwise, before anything is sent)."""
    if isinstance(run_id, bool) or not isinstance(run_id, int) or not 1 <= run_id < 1 << 64:
        raise ValueError(f"cannot read the trace of run {run_id!r}: a run id is an int >= 1")
    return pb.GetRunTraceRequest(run_id=run_id)


def list_runs_request(states: Iterable[int | str], limit: int) -> pb.ListRunsRequest:
    """``states``: ``RunPhase`` / ``pb.RunState`` values or names (``"failed"``,
    ``"RUN_STATE_FAILED"``); ``limit`` 0 = the daemon's default (100)."""
    values: list[int] = []
    for state in states:
        if isinstance(state, str):
            name = state.strip().upper()
            name = name if name.startswith("RUN_STATE_") else f"RUN_STATE_{name}"
            if name not in _STATE_NAMES:
                known = ", ".join(n.removeprefix("RUN_STATE_").lower() for n in _STATE_NAMES)
                raise ValueError(f"cannot list runs: unknown state {state!r} (one of {known})")
            values.append(pb.RunState.Value(name))
        else:
            values.append(int(state))
    if limit < 0:
        raise ValueError(f"cannot list runs: limit must be >= 0, got {limit}")
    return pb.ListRunsRequest(states=values, limit=limit)  # type: ignore[arg-type]


def drain_request(grace: float | None, shutdown: bool) -> pb.DrainRequest:
    """``grace``: seconds, clamped to :data:`MAX_WAIT_S` (a negative or NaN one is sent
    as it is: the daemon refuses it naming the field)."""
    request = pb.DrainRequest(shutdown=shutdown)
    if grace is not None:
        request.grace_seconds = min(grace, MAX_WAIT_S)
    return request


def add_remote_request(
    endpoint: str, num_sub_workers: int, num_chips: int, options: dict[str, Any]
) -> pb.AddRemoteWorkerRequest:
    """``options``: the other ``AddRemoteWorkerRequest`` fields (``session_timeout_s``...)."""
    return pb.AddRemoteWorkerRequest(
        endpoint=endpoint, num_sub_workers=num_sub_workers, num_chips=num_chips, **options
    )
