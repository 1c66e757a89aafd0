"""Task arguments, the call config, and the args blob that crosses the mailbox.

Tensor data never travels through a mailbox: a tensor is a descriptor naming a
range of the shared heap, and the child rebuilds a zero-copy NumPy view::

    blob = [i32 T][i32 S][TensorDesc x T][u64 x S]          (little-endian)
    TensorDesc (168 B) = u32 buffer_id, u8 dtype, u8 tag, u8 ndim, u8 location,
                         u64 generation, u64 buffer_offset (in the heap),
                         u64 byte_offset (element 0, from the buffer start),
                         u64 buffer_nbytes, i64 shape[8], i64 strides[8]

    location 0: this Worker's own shared heap
             1: a remote worker's heap (buffer_offset holds the owner worker id)
             2: the parent Worker's heap (a nested L3 forwards its L4's tensor down)

A task with Python values or keyword arguments (``add_value``, ``set_kwargs``) has a
values section after the scalars; a task without them has none (its blob is unchanged)::

    values section = [u32 magic "SDV1"][u32 where][u64 V][u64 K][u64 heap_offset]
                     then, when where == 0, V bytes of values and K bytes of kwargs

    values: one msgpack array (V == 0: no values), kwargs: one msgpack map (K == 0: none)
    where 0: inline, in the frame          1: on the shared heap at heap_offset
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from simpler_daemon.retrypolicy import (
    DEFAULT_RETRY_ON,
    MAX_RETRIES,
    check_retry_exceptions,
    check_retry_on,
)
from simpler_daemon.taskvalues import TaskValues, encode_kwargs, encode_value, read_section

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

MAX_NDIM: Final = 8
#: The bytes of a mailbox frame that carry the args blob, and a descriptor's size. The
#: frame geometry is the C extension's (``mailbox/_mailbox.h``); these copies let the
#: vocabulary load without it, and ``mailbox/layout.py`` refuses to load when the
#: extension disagrees with them.
MAILBOX_ARGS_CAPACITY: Final = 64080
TENSOR_DESC_SIZE: Final = 168
MAX_TENSORS: Final = (MAILBOX_ARGS_CAPACITY - 8) // TENSOR_DESC_SIZE
MAX_OUTPUT_PREFIX: Final = 1024
U64_MASK: Final = (1 << 64) - 1
#: Upper bound of ``CallConfig.deadline_ms`` (one week): anything larger is a unit
#: mistake, and would overflow the timers that enforce it.
MAX_DEADLINE_MS: Final = 7 * 24 * 3600 * 1000
#: Run priorities are 1 (the default) to MAX_PRIORITY: a run's share of the workers
#: under ``fair`` admission is proportional to it; larger weights would only starve
#: everything else.
MAX_PRIORITY: Final = 1000
#: The descriptor's location byte (see the module docstring).
LOCATION_LOCAL: Final = 0
LOCATION_REMOTE: Final = 1
LOCATION_PARENT: Final = 2


def check_priority(priority: object, what: str = "submit a run") -> int:
    """``priority`` as an int in ``[1, MAX_PRIORITY]``; a clear error otherwise."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(
            f"cannot {what}: priority must be an integer from 1 to {MAX_PRIORITY}, "
            f"got {type(priority).__name__} {priority!r}"
        )
    if not 1 <= priority <= MAX_PRIORITY:
        raise ValueError(
            f"cannot {what}: priority {priority} is out of range (1 to {MAX_PRIORITY})"
        )
    return priority


class TensorRef:
    """A tensor that is not an array of this process: the engine resolves it when the
    task is submitted (``RemoteTensorRef``, a buffer in a remote worker's heap)."""

    __slots__ = ()


class Tag(IntEnum):
    """How a task uses a tensor; drives dependency inference."""

    NO_DEP = 0
    INPUT = 1
    OUTPUT = 2
    INOUT = 3
    OUTPUT_EXISTING = 4


_DTYPES: Final[tuple[str, ...]] = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
_DTYPE_CODE: Final = {np.dtype(name): code for code, name in enumerate(_DTYPES)}
_CODE_DTYPE: Final = tuple(np.dtype(name) for name in _DTYPES)

_HEADER = struct.Struct("<ii")
_DESC = struct.Struct("<IBBBBQQQQ8q8q")
assert _DESC.size == TENSOR_DESC_SIZE
_EMPTY_BLOB: Final = _HEADER.pack(0, 0)
#: The whole blob of a task with scalars and nothing else, by scalar count (filled as
#: counts are met; counts above the cap use a format built per call).
_SCALAR_BLOBS: dict[int, struct.Struct] = {}
_SCALAR_BLOBS_CAP: Final = 64
#: A remote descriptor's ``buffer_offset`` field: owner in the low half, session above.
_U32: Final = 0xFFFFFFFF


def dtype_code(dtype: Any) -> int:
    """Return the wire code of a NumPy dtype; ``ValueError`` when unsupported."""
    try:
        return _DTYPE_CODE[np.dtype(dtype)]
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"cannot describe tensor: dtype {dtype!r} is not supported "
            f"(supported: {', '.join(_DTYPES)})"
        ) from exc


@dataclass(frozen=True, slots=True)
class TensorDesc:
    """Where a tensor lives on the shared heap and how it is laid out."""

    buffer_id: int
    generation: int
    buffer_offset: int
    byte_offset: int
    buffer_nbytes: int
    dtype: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    tag: Tag = Tag.INPUT
    #: In a remote worker's heap: ``buffer_offset`` holds the owner worker id.
    remote: bool = False
    #: On the parent Worker's heap (inherited mapping): a nested L3 child forwarding a
    #: tensor of its L4's task; ``buffer_offset`` is the offset in that heap.
    parent: bool = False
    #: Remote only: the owner's session generation the buffer belongs to (a new session
    #: numbers its buffers afresh). In the blob it shares ``buffer_offset``'s 64 bits
    #: with the owner: ``owner | session << 32``.
    session: int = 0

    def byte_range(self) -> tuple[int, int]:
        """Half-open byte range ``[lo, hi)`` the view touches, relative to its buffer."""
        itemsize = _CODE_DTYPE[self.dtype].itemsize
        lo = hi = self.byte_offset
        for dim, stride in zip(self.shape, self.strides, strict=True):
            if dim == 0:
                return (self.byte_offset, self.byte_offset)
            span = (dim - 1) * stride
            if span < 0:
                lo += span
            else:
                hi += span
        return (lo, hi + itemsize)

    def with_tag(self, tag: Tag) -> TensorDesc:
        return TensorDesc(
            self.buffer_id,
            self.generation,
            self.buffer_offset,
            self.byte_offset,
            self.buffer_nbytes,
            self.dtype,
            self.shape,
            self.strides,
            tag,
            self.remote,
            self.parent,
            self.session,
        )

    @property
    def key(self) -> int | tuple[Any, ...]:
        """Dependency key of the buffer: its id, (owner, id, generation, session) when
        remote, ("parent", id) on the parent's heap (never equal to an own buffer's key)."""
        if self.remote:
            return (self.buffer_offset, self.buffer_id, self.generation, self.session)
        if self.parent:
            return ("parent", self.buffer_id)
        return self.buffer_id


class ViewError(ValueError):
    """A tensor view that does not fit its buffer; ``field`` is the part to blame
    (``shape``, ``strides`` or ``byte_offset``)."""

    def __init__(self, field: str, text: str) -> None:
        super().__init__(text)
        self.field = field


_I64_MAX: Final = (1 << 63) - 1


def c_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """The strides of a C-contiguous view of ``shape``."""
    out: list[int] = []
    acc = itemsize
    for dim in reversed(shape):
        out.append(acc)
        acc *= dim
    return tuple(reversed(out))


def check_view(
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    byte_offset: int,
    nbytes: int,
    *,
    max_view_bytes: int,
    strides_given: bool = True,
    what: str = "the buffer",
) -> tuple[int, int]:
    """Check a view described by numbers against its buffer of ``nbytes`` bytes and
    return the half-open byte range ``[lo, hi)`` it touches.

    Every byte reachable must lie in the buffer: ``byte_offset`` plus the sum of
    ``(dim - 1) * stride`` over the negative strides is at least 0, and with the
    positive ones plus ``itemsize`` at most ``nbytes``. A zero-size view touches
    nothing. The view's logical size (elements x itemsize) is bounded by
    ``max_view_bytes`` as well: a stride-0 view over one byte is inside its buffer
    whatever its shape, and 2**40 elements would keep a task busy for days.

    Raises :class:`ViewError` naming the field to blame (an overrun is blamed on
    ``strides`` when they were given, else on ``shape``: C-contiguous strides follow it).
    """
    if len(shape) > MAX_NDIM:
        raise ViewError("shape", f"{len(shape)} dimensions, at most {MAX_NDIM}")
    if len(strides) != len(shape):
        raise ViewError("strides", f"{len(strides)} strides for {len(shape)} dimensions")
    for i, dim in enumerate(shape):
        if not 0 <= dim <= _I64_MAX:
            raise ViewError("shape", f"dimension {i} is {dim}, outside 0..{_I64_MAX}")
    for i, stride in enumerate(strides):
        if not -_I64_MAX <= stride <= _I64_MAX:
            raise ViewError("strides", f"stride {i} is {stride}, outside +-{_I64_MAX}")
    if not 0 <= byte_offset <= nbytes:
        raise ViewError("byte_offset", f"{byte_offset} is outside {what} of {nbytes} bytes")
    elements = 1
    for dim in shape:
        elements *= dim
    if elements == 0:
        return (byte_offset, byte_offset)
    if elements * itemsize > max_view_bytes:
        raise ViewError(
            "shape",
            f"{'x'.join(map(str, shape))} is {elements} elements of {itemsize} bytes, "
            f"more than the {max_view_bytes} bytes a view may present",
        )
    lo = hi = byte_offset
    for dim, stride in zip(shape, strides, strict=True):
        span = (dim - 1) * stride
        if span < 0:
            lo += span
        else:
            hi += span
    hi += itemsize
    if lo < 0 or hi > nbytes:
        blame = "byte_offset" if byte_offset + itemsize > nbytes else None
        raise ViewError(
            blame or ("strides" if strides_given else "shape"),
            f"the view reaches bytes [{lo}, {hi}): it overruns {what} of {nbytes} bytes",
        )
    return (lo, hi)


#: The dtypes a scalar may be given as; both travel as one unsigned 64-bit word.
SCALAR_DTYPES: Final = ("uint64", "int64")


def scalar_word(
    value: object, position: int, dtype: str = "uint64", what: str = "add scalar"
) -> int:
    """``value`` as the unsigned 64-bit word a task scalar travels as.

    No silent conversion: bool, float, str and other non-integers are ``TypeError``,
    a value outside the dtype's range is ``ValueError``; the message names the
    position (``scalars[k]``). The one rule for ``TaskArgs.add_scalar``, the daemon
    client and the run-spec loader.
    """
    if dtype not in SCALAR_DTYPES:
        raise ValueError(
            f"cannot {what}: scalars[{position}]: dtype {dtype!r} is not one of "
            f"{', '.join(SCALAR_DTYPES)}"
        )
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"cannot {what}: scalars[{position}] must be an int or a NumPy integer, "
            f"got {type(value).__name__} {value!r} (no silent conversion: convert it yourself)"
        )
    v = int(value)
    if dtype == "int64":
        if not -(1 << 63) <= v < (1 << 63):
            raise ValueError(
                f"cannot {what}: scalars[{position}] = {v} is out of range for int64 "
                "(-2**63 to 2**63 - 1)"
            )
        return v & U64_MASK
    if not 0 <= v <= U64_MASK:
        hint = ' (a negative value needs dtype="int64")' if v < 0 else ""
        raise ValueError(
            f"cannot {what}: scalars[{position}] = {v} is out of range for uint64 "
            f"(0 to 2**64 - 1){hint}"
        )
    return v


class TaskArgs:
    """Tensors (with tags) and u64 scalars passed to one task.

    In the parent, ``tensors`` holds the arrays given to :meth:`add_tensor`
    (they must live on the shared heap, see ``Worker.alloc``). Inside a child,
    ``tensors`` holds zero-copy NumPy views of the same memory and ``scalars``
    the decoded integers.
    """

    __slots__ = ("_values", "scalars", "tags", "tensors")

    def __init__(self) -> None:
        self.tensors: list[Any] = []  # arrays, or RemoteTensorRef at L4
        self.tags: list[Tag] = []
        self.scalars: list[int] = []
        #: Values and kwargs (``add_value`` / ``set_kwargs``); None: the task has none.
        self._values: TaskValues | None = None

    @property
    def values(self) -> list[Any]:
        """The task's positional values, in ``add_value`` order (in a child: decoded on
        first access). Add to it with :meth:`add_value`, which checks and encodes."""
        v = self._values
        return [] if v is None else v.get_values()

    @property
    def kwargs(self) -> dict[str, Any]:
        """The task's keyword arguments (:meth:`set_kwargs`; in a child: decoded on
        first access)."""
        v = self._values
        return {} if v is None else v.get_kwargs()

    def add_value(self, value: Any) -> TaskArgs:
        """Append a Python value the callable reads from ``args.values``.

        Any value msgpack carries: None, bool, int, float, str, bytes, and lists,
        tuples and dicts with str keys of them, nested (a tuple comes back as a list).
        It is encoded here, once; a value msgpack cannot carry (a NumPy array, a set,
        an arbitrary object) is a ``TypeError`` naming ``values[k]`` and its type.
        """
        v = self._values
        if v is None:
            v = self._values = TaskValues()
        position = len(v.items)
        data = encode_value(value, f"values[{position}]", "add value")
        v.items.append(value)
        v.parts.append(data)
        return self

    def set_kwargs(self, **kwargs: Any) -> TaskArgs:
        """Set the keyword arguments the callable reads from ``args.kwargs`` (replacing
        any set before; ``set_kwargs()`` clears them). The values follow the rules of
        :meth:`add_value`; a ``TypeError`` names ``kwargs['key']`` and the type."""
        data = encode_kwargs(kwargs, "set kwargs")
        v = self._values
        if v is None:
            v = self._values = TaskValues()
        v.kwargs = dict(kwargs)
        v.kw = data
        return self

    def add_tensor(self, array: Any, tag: Tag = Tag.INPUT) -> TaskArgs:
        """Add an array from ``Worker.alloc`` or a ``RemoteTensorRef`` from ``alloc_remote``."""
        if not isinstance(array, (np.ndarray, TensorRef)):
            raise TypeError(
                "cannot add tensor: expected a NumPy array from Worker.alloc or a "
                f"RemoteTensorRef from Worker.alloc_remote, got {type(array).__name__}"
            )
        if len(self.tensors) >= MAX_TENSORS:
            raise ValueError(f"cannot add tensor: a task takes at most {MAX_TENSORS} tensors")
        t = Tag(tag)  # validate before appending: a failed add leaves the args unchanged
        self.tensors.append(array)
        self.tags.append(t)
        return self

    def add_scalar(self, value: int, dtype: str = "uint64") -> TaskArgs:
        """Add a 64-bit scalar: an int or NumPy integer in ``[0, 2**64)``, or with
        ``dtype="int64"`` one in ``[-2**63, 2**63)`` (sent as its two's complement,
        ``np.uint64(v).view(np.int64)`` in the child gives it back).

        ``TypeError`` for bool, float, str or anything else that is not an integer,
        ``ValueError`` for a value out of the dtype's range: both name the position
        (``scalars[k]``) the value would have taken.
        """
        self.scalars.append(scalar_word(value, len(self.scalars), dtype, "add scalar"))
        return self

    def __repr__(self) -> str:
        extra = ""
        if self._values is not None:
            extra = f", values={len(self.values)}, kwargs={sorted(self.kwargs)!r}"
        return f"TaskArgs(tensors={len(self.tensors)}, scalars={self.scalars!r}{extra})"


_CONFIG = struct.Struct("<QIIII")


@dataclass(frozen=True, slots=True)
class CallConfig:
    """Per-task settings copied by value into the task frame.

    ``enable_profile`` and ``enable_dump_args`` are the diagnostic flags: a task
    with either set is never staged ahead of its run.

    Retries (``retrypolicy.py``; the parent's policy, not in the frame): a failed
    attempt whose cause is in ``retry_on`` (``"crash"``, ``"deadline"``,
    ``"exception"``; default all three) runs again, up to ``max_retries`` times
    (default 0: never). ``retry_exceptions`` (classes or qualified names) narrows
    ``"exception"`` to those classes and their subclasses. A task that writes a
    tensor in place (INOUT, OUTPUT_EXISTING) is retried only with ``idempotent=True``.
    """

    deadline_ms: int = 0
    threads: int = 0
    enable_profile: bool = False
    enable_dump_args: bool = False
    output_prefix: str = ""
    max_retries: int = 0
    retry_on: tuple[str, ...] = DEFAULT_RETRY_ON
    retry_exceptions: tuple[type[BaseException] | str, ...] = ()
    idempotent: bool = False
    #: The frame bytes, packed once (a config is immutable and shared by many tasks).
    encoded: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("deadline_ms", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(
                    f"cannot build CallConfig: {name} must be an int, got "
                    f"{type(value).__name__} {value!r}"
                )
            object.__setattr__(self, name, int(value))
        if not 0 <= self.deadline_ms <= MAX_DEADLINE_MS:
            raise ValueError(
                f"cannot build CallConfig: deadline_ms={self.deadline_ms} must be between 0 "
                f"(no deadline) and {MAX_DEADLINE_MS} (one week)"
            )
        if not 0 <= self.threads < (1 << 31):
            raise ValueError(f"cannot build CallConfig: threads={self.threads} out of range")
        if len(self.output_prefix.encode()) > MAX_OUTPUT_PREFIX:
            raise ValueError(
                f"cannot build CallConfig: output_prefix is {len(self.output_prefix.encode())} "
                f"bytes, the limit is {MAX_OUTPUT_PREFIX}"
            )
        if (
            self.max_retries != 0
            or self.retry_on is not DEFAULT_RETRY_ON
            or self.retry_exceptions != ()
            or self.idempotent is not False
        ):
            self._check_retries()
        prefix = self.output_prefix.encode()
        flags = int(self.enable_profile) | (int(self.enable_dump_args) << 1)
        packed = _CONFIG.pack(self.deadline_ms, self.threads, flags, len(prefix), 0) + prefix
        object.__setattr__(self, "encoded", packed)

    def _check_retries(self) -> None:
        n = self.max_retries
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(
                f"cannot build CallConfig: max_retries must be an int, got {type(n).__name__} {n!r}"
            )
        if not 0 <= n <= MAX_RETRIES:
            raise ValueError(
                f"cannot build CallConfig: max_retries={n} must be between 0 (no retry) and "
                f"{MAX_RETRIES}"
            )
        object.__setattr__(self, "max_retries", int(n))
        object.__setattr__(self, "retry_on", check_retry_on(self.retry_on))
        object.__setattr__(self, "retry_exceptions", check_retry_exceptions(self.retry_exceptions))
        if self.retry_exceptions and "exception" not in self.retry_on:
            raise ValueError(
                "cannot build CallConfig: retry_exceptions narrows retry_on='exception', "
                f"which retry_on={self.retry_on!r} does not have"
            )
        if not isinstance(self.idempotent, bool):
            raise TypeError(
                f"cannot build CallConfig: idempotent must be True or False, got "
                f"{self.idempotent!r}"
            )

    @property
    def diagnostic(self) -> bool:
        return self.enable_profile or self.enable_dump_args

    def encode(self) -> bytes:
        return self.encoded

    @classmethod
    def decode(cls, data: bytes) -> CallConfig:
        deadline, threads, flags, plen, _ = _CONFIG.unpack_from(data, 0)
        prefix = bytes(data[_CONFIG.size : _CONFIG.size + min(plen, MAX_OUTPUT_PREFIX)])
        return cls(deadline, threads, bool(flags & 1), bool(flags & 2), prefix.decode())


#: What a CallConfig takes of the frame's config field (``mailbox/layout.py`` checks it fits).
CONFIG_BYTES: Final = _CONFIG.size + MAX_OUTPUT_PREFIX


DEFAULT_CONFIG: Final = CallConfig()


def _scalar_blob(s: int) -> struct.Struct:
    """The layout of a blob holding ``s`` scalars and nothing else: header, then words."""
    layout = _SCALAR_BLOBS.get(s)
    if layout is None:
        layout = struct.Struct(f"<ii{s}Q")
        if s <= _SCALAR_BLOBS_CAP:
            _SCALAR_BLOBS[s] = layout
    return layout


def encode_args(descs: Sequence[TensorDesc], scalars: Sequence[int]) -> bytes:
    """Encode descriptors and scalars; ``ValueError`` naming both sizes when too big."""
    if not descs and not scalars:
        return _EMPTY_BLOB
    need = _HEADER.size + len(descs) * TENSOR_DESC_SIZE + 8 * len(scalars)
    if need > MAILBOX_ARGS_CAPACITY:
        raise ValueError(
            f"cannot encode task args: {len(descs)} tensors and {len(scalars)} scalars need "
            f"{need} bytes, the mailbox args capacity is {MAILBOX_ARGS_CAPACITY} bytes"
        )
    if not descs:  # scalars only (W3's tasks): one pack, no buffer to fill
        return _scalar_blob(len(scalars)).pack(0, len(scalars), *scalars)
    out = bytearray(need)
    _HEADER.pack_into(out, 0, len(descs), len(scalars))
    off = _HEADER.size
    for d in descs:
        nd = len(d.shape)
        shape = d.shape + (0,) * (MAX_NDIM - nd)
        strides = d.strides + (0,) * (MAX_NDIM - nd)
        _DESC.pack_into(
            out,
            off,
            d.buffer_id,
            d.dtype,
            int(d.tag),
            nd,
            LOCATION_PARENT if d.parent else int(d.remote),
            d.generation,
            (d.buffer_offset & _U32) | d.session << 32 if d.remote else d.buffer_offset,
            d.byte_offset,
            d.buffer_nbytes,
            *shape,
            *strides,
        )
        off += TENSOR_DESC_SIZE
    struct.pack_into(f"<{len(scalars)}Q", out, off, *scalars)
    return bytes(out)


def args_end(blob: bytes) -> int:
    """Where the descriptors and scalars of ``blob`` end (a values section may follow)."""
    t, s = _HEADER.unpack_from(blob, 0)
    return int(_HEADER.size + t * TENSOR_DESC_SIZE + 8 * s)


def decode_descs(blob: bytes) -> tuple[list[TensorDesc], list[int]]:
    """Decode a blob into descriptors and scalars; ``ValueError`` when malformed."""
    if len(blob) < _HEADER.size:
        raise ValueError(f"malformed args blob: {len(blob)} bytes is shorter than its header")
    t, s = _HEADER.unpack_from(blob, 0)
    need = _HEADER.size + t * TENSOR_DESC_SIZE + 8 * s
    if t < 0 or s < 0 or need > len(blob):
        raise ValueError(f"malformed args blob: T={t} S={s} needs {need} bytes, got {len(blob)}")
    descs: list[TensorDesc] = []
    off = _HEADER.size
    for _ in range(t):
        f = _DESC.unpack_from(blob, off)
        buffer_id, dtype, tag, nd, location = f[0], f[1], f[2], f[3], f[4]
        if (
            nd > MAX_NDIM
            or dtype >= len(_CODE_DTYPE)
            or tag > Tag.OUTPUT_EXISTING
            or location > LOCATION_PARENT
        ):
            raise ValueError(
                f"malformed tensor descriptor {len(descs)}: ndim={nd} dtype={dtype} tag={tag} "
                f"location={location}"
            )
        remote = location == LOCATION_REMOTE
        descs.append(
            TensorDesc(
                buffer_id,
                f[5],
                f[6] & _U32 if remote else f[6],
                f[7],
                f[8],
                dtype,
                tuple(f[9 : 9 + nd]),
                tuple(f[17 : 17 + nd]),
                Tag(tag),
                remote,
                location == LOCATION_PARENT,
                f[6] >> 32 if remote else 0,
            )
        )
        off += TENSOR_DESC_SIZE
    scalars = list(struct.unpack_from(f"<{s}Q", blob, off)) if s else []
    return descs, scalars


def decode_args(
    blob: bytes, view: Callable[[TensorDesc], np.ndarray[Any, Any]], heap: Any = None
) -> TaskArgs:
    """Rebuild a child-side :class:`TaskArgs`; ``view`` maps a descriptor to an array,
    ``heap`` is the mapping a heap-backed values section is read from (``Heap.mmap``)."""
    args = TaskArgs()
    if blob == _EMPTY_BLOB:
        return args
    n = len(blob)
    if n >= _HEADER.size:
        t, s = _HEADER.unpack_from(blob, 0)
        if t == 0 and s > 0 and n == _HEADER.size + 8 * s:
            # Scalars and nothing else (W3's tasks): one unpack, no descriptor loop.
            args.scalars = list(_scalar_blob(s).unpack(blob)[2:])
            return args
    descs, scalars = decode_descs(blob)
    for d in descs:
        args.tensors.append(view(d))
        args.tags.append(d.tag)
    args.scalars = scalars
    if len(blob) > (end := args_end(blob)):
        args._values = read_section(blob, end, heap)
    return args


def dtype_of(code: int) -> np.dtype[Any]:
    return _CODE_DTYPE[code]
