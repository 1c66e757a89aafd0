"""simplerctl run specs: a JSON/TOML file -> :class:`RunSpec` -> buffers in the daemon -> Tasks.

::

    load_spec(path) --msgspec.convert (unknown keys refused, "did you mean")--> RunSpec
    SpecBuilder(client, spec).allocate()  AllocBuffer + WriteBuffer per [buffers.X]
                             .adopt(ids)     or: the buffers of an earlier submit (a retry)
                             .tasks()        RegisterCallable per import path not yet
                                             registered (ListCallables) -> list[pb.Task]

Every problem is a :class:`SpecError` naming the dotted key
(``tasks[2].members[0].tensors[1].buffer``); an RPC that fails while building is a
:class:`SpecRpcError` carrying the key it was made for.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
import sys
import tomllib
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal, get_args

import grpc
import msgspec
import numpy as np

from simpler_daemon.client import Client, call_config, make_args, task, tensor
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.retrypolicy import MAX_RETRIES

__all__ = [
    "SPEC_FORMAT",
    "BufferSpec",
    "CreatedBuffer",
    "MemberSpec",
    "RunSpec",
    "SpecBuilder",
    "SpecError",
    "SpecLimitError",
    "SpecRpcError",
    "TaskSpec",
    "TensorSpec",
    "buffer_label",
    "decode_spec",
    "load_spec",
]

#: The run spec format, shown by ``simplerctl submit --help`` and in the README.
SPEC_FORMAT: Final = """\
run spec (TOML when FILE ends in .toml, else JSON; '-' reads JSON from stdin):

  label = "demo"                  # optional, shown in events, logs and `simplerctl runs`
  idempotency_key = ""            # optional, as --idempotency-key
  priority = 1                    # optional, 1..1000, as --priority

  [buffers.a]                     # buffers created for the run (freed after --wait/--watch
  shape = [8]                     #   printed them, unless --keep); shape is required,
  dtype = "float32"               #   [] for a scalar; dtype defaults to float32
  data = [0, 1, 2, 3, 4, 5, 6, 7] # initial contents: data = [...] or fill = 2 (else zeros)
  [buffers.out]
  shape = [8]

  [[tasks]]                       # in submission order: the tags order the tasks
  callable = "simpler_daemon.examples.tasks:scale"  # import path (registered if it is
                                  #   not yet) or a registered hashid "sha256:..."
  kind = "sub"                    # sub | sub_group | next_level | next_level_group
  scalars = [3]                   # one call: scalars/tensors/values/kwargs inline; a
  tensors = [{ buffer = "a", tag = "inout" }]  # group: one [[tasks.members]] table each
  values = [1, "two", [3]]        # Python values the callable reads as args.values
  kwargs = { mode = "fast" }      #   and keyword arguments as args.kwargs (plain data)
  workers = []                    # NEXT_LEVEL targets (worker ids)
  config = { deadline_ms = 1000 } # also threads, enable_profile, enable_dump_args,
                                  #   output_prefix, and retries: max_retries = 2,
                                  #   retry_on = ["crash", "deadline", "exception"],
                                  #   retry_exceptions = ["ValueError"], idempotent

  a tensor: buffer = a name under [buffers] or the id of an existing buffer;
  tag = input | output | inout | output_existing | no_dep (required);
  optional shape, dtype (default: the buffer's), offset (bytes), strides, generation.
  Scalars are unsigned 64-bit integers (0 .. 2**64-1). Unknown keys are errors.
"""

_U64_MAX: Final = (1 << 64) - 1
# The upper bound 2**64-1 is checked in _check: msgspec bounds stop at int64.
U64 = Annotated[int, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Tag = Literal["input", "output", "inout", "output_existing", "no_dep"]
Kind = Literal["sub", "sub_group", "next_level", "next_level_group"]
_SUB_KINDS: Final = ("sub", "sub_group")
_U64_HINT: Final = " (scalars are unsigned 64-bit integers: 0 .. 2**64-1)"
#: Whole-array contents shown after a run at most this many elements long.
MAX_SHOWN: Final = 64


class SpecError(ValueError):
    """A run spec that cannot be turned into a SubmitRun; ``key`` is the dotted key."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class SpecLimitError(SpecError):
    """A spec asking for more than the daemon allows (a buffer above
    ``limits.max_buffer_bytes``): exit status "out of room", like the daemon's
    RESOURCE_EXHAUSTED for the same request."""


class _Overflow:
    """A number literal of the spec file beyond a 64-bit float (``1e400``): kept apart from
    an explicit ``inf`` so that :func:`decode_spec` can refuse it, naming its key."""

    def __init__(self, text: str) -> None:
        self.text = text


def _parse_float(text: str) -> float | _Overflow:
    value = float(text)
    if math.isinf(value) and "inf" not in text.lower():
        return _Overflow(text)
    return value


def _find_overflow(data: Any, path: str = "") -> tuple[str, str] | None:
    """``(dotted key, literal)`` of the first :class:`_Overflow` in parsed spec data."""
    items: Any = ()
    if isinstance(data, _Overflow):
        return path, data.text
    if isinstance(data, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in data.items())
    elif isinstance(data, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(data))
    for key, value in items:
        found = _find_overflow(value, key)
        if found is not None:
            return found
    return None


class SpecRpcError(Exception):
    """An RPC made while building the run failed; ``where`` is the spec key it was for."""

    def __init__(self, where: str, exc: grpc.RpcError) -> None:
        super().__init__(where)
        self.where = where
        self.rpc = exc


class TensorSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    buffer: str | U64
    tag: Tag
    shape: list[Count] | None = None
    dtype: str | None = None
    offset: Count = 0
    strides: list[int] | None = None
    generation: Count = 0


class MemberSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tensors: list[TensorSpec] = []
    scalars: list[U64] = []
    values: list[Any] = []
    kwargs: dict[str, Any] = {}


class ConfigSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    deadline_ms: U64 = 0
    threads: Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)] = 0
    enable_profile: bool = False
    enable_dump_args: bool = False
    output_prefix: str = ""
    max_retries: Annotated[int, msgspec.Meta(ge=0, le=MAX_RETRIES)] = 0
    retry_on: list[Literal["crash", "deadline", "exception"]] = []
    retry_exceptions: list[str] = []
    idempotent: bool = False


class TaskSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    callable: str
    kind: Kind = "sub"
    tensors: list[TensorSpec] | None = None
    scalars: list[U64] | None = None
    values: list[Any] | None = None
    kwargs: dict[str, Any] | None = None
    members: list[MemberSpec] | None = None
    workers: list[Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]] = []
    config: ConfigSpec | None = None


class BufferSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Required: a forgotten or misspelt shape must not become a 0-d buffer.
    shape: list[Count]
    dtype: str = "float32"
    data: Any = None
    fill: int | float | bool | None = None


class RunSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tasks: list[TaskSpec]
    buffers: dict[str, BufferSpec] = {}
    label: str = ""
    idempotency_key: str = ""
    priority: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 1


_STRUCTS: Final[dict[str, type[msgspec.Struct]]] = {
    "": RunSpec,
    "tasks": TaskSpec,
    "members": MemberSpec,
    "tensors": TensorSpec,
    "config": ConfigSpec,
    "buffers": BufferSpec,
}


def _read(path: str) -> Any:
    try:
        if path == "-":
            return json.load(sys.stdin, parse_float=_parse_float)
        if path.endswith(".toml"):
            with open(path, "rb") as fh:
                return tomllib.load(fh, parse_float=_parse_float)
        with open(path, encoding="utf-8") as fh:
            return json.load(fh, parse_float=_parse_float)
    except OSError as exc:
        raise SpecError(f"cannot read run spec {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise SpecError(f"cannot parse run spec {path}: not UTF-8: {exc}") from exc
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SpecError(f"cannot parse run spec {path}: {exc}") from exc


def load_spec(path: str) -> RunSpec:
    """Read and decode a run spec (TOML when the name ends in .toml, else JSON;
    ``-`` = JSON on stdin); ``SpecError`` naming the key for any problem."""
    return decode_spec(_read(path), path)


def decode_spec(data: Any, where: str = "run spec") -> RunSpec:
    """``data`` (parsed JSON/TOML) as a :class:`RunSpec`, checked."""
    prefix = f"cannot load run spec {where}: "
    if not isinstance(data, dict):
        raise SpecError(f"{prefix}expected a table/object with 'tasks'")
    overflow = _find_overflow(data)
    if overflow is not None:
        key, text = overflow
        raise SpecError(
            f"{prefix}{key}: {text} is out of range of a 64-bit float (write inf for infinity)",
            key,
        )
    buffers = data.get("buffers", {})
    if not isinstance(buffers, dict):
        raise SpecError(f"{prefix}buffers: expected a table of buffers", "buffers")
    decoded: dict[str, BufferSpec] = {}
    # Each buffer on its own: msgspec names a dict entry "[...]", we name it buffers.<name>.
    for name, table in buffers.items():
        decoded[name] = _convert(table, BufferSpec, f"buffers.{name}", prefix)
    spec: RunSpec = _convert({**data, "buffers": {}}, RunSpec, "", prefix)
    spec.buffers = decoded
    _check(spec, prefix)
    return spec


def _convert(raw: Any, kind: type[Any], base: str, prefix: str) -> Any:
    try:
        return msgspec.convert(raw, type=kind)
    except msgspec.ValidationError as exc:
        key, problem = _explain(exc, kind, base)
        raise SpecError(f"{prefix}{key}{problem}", key) from None


def _explain(exc: msgspec.ValidationError, kind: type[Any], base: str) -> tuple[str, str]:
    """``Object contains unknown field `tensor` - at `$.tasks[0]``` -> the dotted key and
    the problem, with "did you mean" for a misspelt key."""
    problem, sep, at = str(exc).partition(" - at `$")
    path = at.rstrip("`").lstrip(".") if sep else ""
    path = ".".join(p for p in (base, path) if p)
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", problem)
    if unknown:
        owner = _struct_at(path, kind)
        fields = [f.encode_name for f in msgspec.structs.fields(owner)] if owner else []
        close = difflib.get_close_matches(unknown[1], fields, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        choices = f"; known keys: {', '.join(fields)}" if fields and not close else ""
        key = f"{path}.{unknown[1]}" if path else unknown[1]
        return key, f": unknown key{hint}{choices}"
    missing = re.fullmatch(r"Object missing required field `(.*)`", problem)
    if missing:
        key = f"{path}.{missing[1]}" if path else missing[1]
        return key, ": required"
    problem = problem.replace("`object`", "table").replace("`array`", "list").replace("`", "")
    if problem.startswith("Invalid enum value"):
        leaf = re.sub(r"\[\d+\]", "", path.rpartition(".")[2])
        owner = _struct_at(path.rpartition(".")[0], kind)
        field = _field_type(owner, leaf)
        if field is not None:
            problem += f" (choose one of {', '.join(repr(c) for c in get_args(field))})"
    if re.search(r"scalars\[\d+\]$", path) and "Expected int" in problem:
        problem += _U64_HINT
    return path or "spec", f": {problem}"


def _struct_at(path: str, root: type[Any]) -> type[msgspec.Struct] | None:
    """The struct a dotted spec path lands in (``tasks[0].members[1]`` -> MemberSpec)."""
    if not path:
        return root if root is RunSpec else None
    parts = path.split(".")
    last = re.sub(r"\[\d+\]$", "", parts[-1])
    if parts[0] == "buffers":
        return BufferSpec if len(parts) == 2 else None
    return _STRUCTS.get(last) if last in _STRUCTS and last != "buffers" else None


def _field_type(owner: type[msgspec.Struct] | None, name: str) -> Any:
    if owner is None:
        return None
    for f in msgspec.structs.fields(owner):
        if f.encode_name == name:
            return f.type
    return None


def _check(spec: RunSpec, prefix: str) -> None:
    """What the types cannot say: a non-empty task list, one call shape per task."""
    if not spec.tasks:
        raise SpecError(f"{prefix}tasks: the run spec needs at least one task", "tasks")
    for i, t in enumerate(spec.tasks):
        inline = (t.tensors, t.scalars, t.values, t.kwargs)
        if t.members is not None and any(x is not None for x in inline):
            raise SpecError(
                f"{prefix}tasks[{i}]: give either members or tensors/scalars/values/kwargs, "
                "not both",
                f"tasks[{i}]",
            )
        calls = [("", t.scalars or [])] if t.members is None else []
        calls += [(f".members[{m}]", x.scalars) for m, x in enumerate(t.members or [])]
        for at, scalars in calls:
            for j, v in enumerate(scalars):
                if v > _U64_MAX:
                    key = f"tasks[{i}]{at}.scalars[{j}]"
                    raise SpecError(f"{prefix}{key}: {v} is out of range{_U64_HINT}", key)
        if not t.callable:
            raise SpecError(
                f"{prefix}tasks[{i}].callable: required (an import path or a hashid)",
                f"tasks[{i}].callable",
            )
    for name, b in spec.buffers.items():
        try:
            np.dtype(b.dtype)
        except TypeError:
            raise SpecError(
                f"{prefix}buffers.{name}.dtype: unknown dtype {b.dtype!r}",
                f"buffers.{name}.dtype",
            ) from None
        if b.data is not None and b.fill is not None:
            raise SpecError(
                f"{prefix}buffers.{name}: give either data or fill, not both", f"buffers.{name}"
            )


def _check_range(values: np.ndarray[Any, Any], dt: np.dtype[Any], key: str) -> None:
    """Refuse a value the dtype cannot hold instead of storing inf or a wrapped integer:
    an integer out of an int dtype's range, a finite number that overflows a float dtype
    (``1e39`` as float32), a non-finite or out-of-range float for an int dtype."""
    if values.dtype.kind not in "biuf" or dt.kind not in "iuf":
        return  # bool targets, or strings numpy itself refuses
    if dt.kind == "f":
        with np.errstate(over="ignore", invalid="ignore"):
            cast = values.astype(dt)
        bad = np.isfinite(values) & ~np.isfinite(cast)
    else:
        info = np.iinfo(dt)
        if values.dtype.kind == "f":
            bad = ~np.isfinite(values) | (values < info.min) | (values > info.max)
        else:
            as_int = values.astype(object)
            bad = (as_int < info.min) | (as_int > info.max)
    if np.any(bad):
        first = np.asarray(values)[np.asarray(bad)].flat[0]
        first = first.item() if isinstance(first, np.generic) else first
        limits = (
            f"{np.finfo(dt).min:g} .. {np.finfo(dt).max:g}"
            if dt.kind == "f"
            else f"{np.iinfo(dt).min} .. {np.iinfo(dt).max}"
        )
        raise SpecError(
            f"cannot fill {key}: {first!r} is out of range of {dt.name} ({limits})", key
        )


def buffer_label(name: str, key: str) -> str:
    """The daemon-side label of the buffer ``name`` a submit creates: with an idempotency
    key, a digest of it, so a retry finds the buffers of the submit it repeats."""
    if not key:
        return name
    return f"{name} [key {hashlib.sha256(key.encode()).hexdigest()[:16]}]"


@dataclass(frozen=True, slots=True)
class CreatedBuffer:
    """A buffer a submit made (or adopted from the submit it repeats)."""

    buffer_id: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def shown(self) -> bool:
        """Small enough to print whole after the run."""
        return math.prod(self.shape) <= MAX_SHOWN


class SpecBuilder:
    """Turns a :class:`RunSpec` into Tasks: its buffers, its callables' hashids."""

    def __init__(self, client: Client, spec: RunSpec, key: str = "") -> None:
        self.client = client
        self.spec = spec
        self.key = key
        #: name -> buffer, in spec order: what the submit must free (unless --keep).
        self.created: dict[str, CreatedBuffer] = {}
        self._registered: dict[tuple[str, str], str] = {}  # (path, role) -> hashid
        self._listed: dict[int, pb.BufferInfo] | None = None

    # -- buffers ------------------------------------------------------------------------

    def _check_sizes(self) -> None:
        """Refuse a buffer above the daemon's ``limits.max_buffer_bytes`` before building
        its contents here: ``shape = [100000000000]`` must not allocate 400 GB locally."""
        if not self.spec.buffers:
            return
        try:
            info = self.client.get_info()
        except grpc.RpcError as exc:
            raise SpecRpcError("buffers", exc) from exc
        limit = int(info.limits.max_buffer_bytes)
        for name, b in self.spec.buffers.items():
            dt = np.dtype(b.dtype)
            nbytes = math.prod(b.shape) * dt.itemsize  # Python ints: no overflow
            # A limit of 0 would be "none": then numpy's own bound (intp) still applies.
            bound = limit if limit > 0 else np.iinfo(np.intp).max
            if nbytes > bound:
                key = f"buffers.{name}.shape"
                raise SpecLimitError(
                    f"cannot create {key}: {list(b.shape)} x {dt.name} is {nbytes} bytes, "
                    f"more than the daemon's limits.max_buffer_bytes ({limit} bytes)",
                    key,
                )

    def _initial(self, name: str, b: BufferSpec) -> np.ndarray[Any, Any]:
        dt = np.dtype(b.dtype)
        arr = np.zeros(tuple(b.shape), dtype=dt)
        field = "data" if b.data is not None else "fill"
        key = f"buffers.{name}.{field}"
        source: Any = b.data if b.data is not None else b.fill
        if source is None:
            return arr
        try:
            values = np.asarray(source)
        except (ValueError, TypeError, OverflowError) as exc:
            raise SpecError(f"cannot fill {key}: {exc}", key) from exc
        _check_range(values, dt, key)
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                if b.data is not None:
                    arr[...] = values.astype(dt).reshape(arr.shape)
                else:
                    arr[...] = values.astype(dt)
        except (ValueError, TypeError, OverflowError) as exc:
            raise SpecError(f"cannot fill {key}: {exc}", key) from exc
        return arr

    def allocate(self) -> None:
        """Create (and fill) every ``[buffers.X]``; on any failure the ones made so far
        stay in :attr:`created` for the caller to free."""
        self._check_sizes()
        arrays = {name: self._initial(name, b) for name, b in self.spec.buffers.items()}
        for name, arr in arrays.items():
            try:
                label = buffer_label(name, self.key)
                buffer_id = int(self.client.alloc_buffer(arr.shape, arr.dtype, label).buffer_id)
            except grpc.RpcError as exc:
                raise SpecRpcError(f"buffers.{name}", exc) from exc
            self.created[name] = CreatedBuffer(buffer_id, tuple(arr.shape), arr.dtype.name)
            try:
                if arr.nbytes:
                    self.client.write_buffer(buffer_id, arr)
            except grpc.RpcError as exc:
                raise SpecRpcError(f"buffers.{name}", exc) from exc

    def earlier_buffers(self) -> dict[str, CreatedBuffer] | None:
        """The buffers an earlier submit with this key created (found by their label,
        :func:`buffer_label`), excluding this builder's own; None unless every
        ``[buffers.X]`` is there with its shape and dtype."""
        if not self.key:
            return None
        mine = {c.buffer_id for c in self.created.values()}
        by_label = {
            b.label: b for b in self.client.list_buffers().buffers if b.buffer_id not in mine
        }
        found: dict[str, CreatedBuffer] = {}
        for name, b in self.spec.buffers.items():
            info = by_label.get(buffer_label(name, self.key))
            dt = np.dtype(b.dtype).name
            if info is None or tuple(info.shape) != tuple(b.shape) or info.dtype != dt:
                return None
            found[name] = CreatedBuffer(int(info.buffer_id), tuple(b.shape), dt)
        return found

    def adopt(self, buffers: dict[str, CreatedBuffer]) -> None:
        """Use ``buffers`` (:meth:`earlier_buffers`) instead of fresh ones, unwritten."""
        self.created = dict(buffers)

    def _buffer_info(self, buffer_id: int, where: str) -> pb.BufferInfo:
        if self._listed is None:
            self._listed = {b.buffer_id: b for b in self.client.list_buffers().buffers}
        info = self._listed.get(buffer_id)
        if info is None:
            raise SpecError(
                f"cannot use {where}.buffer: buffer {buffer_id} does not exist",
                f"{where}.buffer",
            )
        return info

    # -- tasks --------------------------------------------------------------------------

    def _tensor(self, t: TensorSpec, where: str) -> pb.TensorRef:
        if isinstance(t.buffer, str):
            if t.buffer not in self.created:
                raise SpecError(
                    f"cannot use {where}.buffer: no buffer named {t.buffer!r} in [buffers]",
                    f"{where}.buffer",
                )
            made = self.created[t.buffer]
            buffer_id, bshape, bdtype = made.buffer_id, made.shape, made.dtype
        else:
            buffer_id = t.buffer
            if t.shape is None or t.dtype is None:
                info = self._buffer_info(buffer_id, where)
                bshape, bdtype = tuple(int(d) for d in info.shape), info.dtype
            else:
                bshape, bdtype = (), ""
        dtype = t.dtype or bdtype
        try:
            itemsize = np.dtype(dtype).itemsize
        except TypeError:
            raise SpecError(
                f"cannot use {where}.dtype: unknown dtype {dtype!r}", f"{where}.dtype"
            ) from None
        shape: tuple[int, ...]
        if t.shape is not None:
            shape = tuple(t.shape)
        elif dtype == bdtype and t.offset == 0:
            shape = bshape
        else:
            nbytes = math.prod(bshape) * np.dtype(bdtype).itemsize
            shape = (max(nbytes - t.offset, 0) // itemsize,)
        try:
            return tensor(
                buffer_id,
                t.tag,
                shape,
                dtype,
                byte_offset=t.offset,
                strides=t.strides,
                generation=t.generation,
            )
        except (ValueError, TypeError) as exc:
            raise SpecError(f"cannot use {where}: {exc}", where) from exc

    def _members(self, t: TaskSpec, where: str) -> list[pb.Args]:
        if t.members is None:
            one = MemberSpec(
                tensors=t.tensors or [],
                scalars=t.scalars or [],
                values=t.values or [],
                kwargs=t.kwargs or {},
            )
            calls = [(where, one)]
        else:
            calls = [(f"{where}.members[{m}]", member) for m, member in enumerate(t.members)]
        out = []
        for mw, member in calls:
            refs = [self._tensor(x, f"{mw}.tensors[{i}]") for i, x in enumerate(member.tensors)]
            try:
                out.append(
                    make_args(refs, member.scalars, values=member.values, kwargs=member.kwargs)
                )
            except (TypeError, ValueError) as exc:
                raise SpecError(f"{mw}: {exc}", mw) from exc
        return out

    def _hashid(self, target: str, kind: str, where: str) -> str:
        """A hashid as is; an import path: registered in this client's session, once per
        path and kind. Never a registration found in the daemon's list: another session
        may hold it alone and release it before this run is submitted (a simplerctl
        that has just exited, say). The session's reference goes when this process
        exits, so submits do not pile up references."""
        if target.startswith("sha256:"):
            return target
        role = "sub" if kind in _SUB_KINDS else "chip"
        key = (target, role)
        try:
            if key not in self._registered:
                self._registered[key] = self.client.register(target, role)
        except grpc.RpcError as exc:
            raise SpecRpcError(f"{where}.callable", exc) from exc
        return self._registered[key]

    def tasks(self) -> list[pb.Task]:
        out = []
        for i, t in enumerate(self.spec.tasks):
            where = f"tasks[{i}]"
            members = self._members(t, where)
            config = None
            if t.config is not None:
                try:
                    config = call_config(**msgspec.structs.asdict(t.config))
                except (TypeError, ValueError) as exc:
                    raise SpecError(f"{where}.config: {exc}", f"{where}.config") from None
            hashid = self._hashid(t.callable, t.kind, where)
            out.append(task(t.kind, hashid, members, workers=t.workers, config=config))
        return out
