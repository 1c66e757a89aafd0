"""A task's Python values and keyword arguments: checked and encoded once, in the parent.

``TaskArgs.add_value`` / ``set_kwargs`` (``args.py``) encode each value with msgpack
when it is added, so a bad value is refused where it is given, not at submit or in the
child. At submit the parts become one values section behind the args blob's scalars
(the layout is in ``args.py``'s docstring): inline in the frame when it fits, else in a
run-owned buffer of the shared heap that is freed when the task retires. The child
keeps the section's bytes and decodes them on the first access of ``args.values`` or
``args.kwargs``: a callable that never looks pays one slice.

msgpack alone would accept more than it gives back (a set comes back as a list, an
int-keyed dict as a dict the daemon's clients cannot send): what a value may be is
the plain data below, the same in-process, through the daemon and in a run spec.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, Final

import msgspec

#: The default bound of one task's encoded values and kwargs together (``max_value_bytes``
#: of the Worker and of the daemon's ``[limits]``).
DEFAULT_MAX_VALUE_BYTES: Final = 64 << 20
#: The default bound of a SUB callable's encoded return value (``max_result_bytes``).
DEFAULT_MAX_RESULT_BYTES: Final = 64 << 20
#: The values section header: magic, where, len(values), len(kwargs), heap offset.
SECTION: Final = struct.Struct("<IIQQQ")
MAGIC: Final = 0x31564453  # "SDV1" little-endian
WHERE_INLINE: Final = 0
WHERE_HEAP: Final = 1
PLAIN_TYPES: Final = "None, bool, int, float, str, bytes, list, tuple, dict with str keys"

_encode = msgspec.msgpack.Encoder().encode
_decode_list = msgspec.msgpack.Decoder(list).decode
_decode_dict = msgspec.msgpack.Decoder(dict[str, Any]).decode
_LEAF: Final = (type(None), bool, int, float, str, bytes)
_LEAF_SET: Final = frozenset(_LEAF)


def _type_name(obj: object) -> str:
    kind = type(obj)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def _refuse(what: str, where: str, obj: object, why: str = "") -> TypeError:
    detail = f" ({why})" if why else ""
    return TypeError(
        f"cannot {what}: {where} is a {_type_name(obj)}, which a task value cannot be"
        f"{detail}; put arrays in tensors (Worker.alloc + TaskArgs.add_tensor) and pass "
        f"plain data as values: {PLAIN_TYPES}"
    )


#: How deep ``check_plain`` looks (msgpack itself refuses deeper nesting, or a cycle).
_MAX_DEPTH: Final = 512


def _is_plain(o: Any, depth: int) -> bool:
    """Whether ``o`` is plain data, without naming anything (the fast first pass)."""
    t = type(o)
    if t is list or t is tuple:
        if depth > _MAX_DEPTH:
            return True
        for x in o:  # noqa: SIM110 - a loop: about twice as fast as all() over a generator
            if type(x) not in _LEAF_SET and not _is_plain(x, depth + 1):
                return False
        return True
    if t is dict:
        if depth > _MAX_DEPTH:
            return True
        for k, x in o.items():
            if type(k) is not str or (type(x) not in _LEAF_SET and not _is_plain(x, depth + 1)):
                return False
        return True
    return t in _LEAF_SET or isinstance(o, _LEAF)


def check_plain(obj: Any, where: str, what: str) -> None:
    """``TypeError`` naming the part of ``obj`` (``values[0]['k'][2]``) that is not plain
    data. Parts nested deeper than ``_MAX_DEPTH`` are not looked at (a cycle)."""
    if type(obj) in _LEAF_SET or _is_plain(obj, 0):
        return
    stack: list[tuple[Any, str, int]] = [(obj, where, 0)]
    while stack:
        o, w, depth = stack.pop()
        t = type(o)
        if t in _LEAF_SET or depth > _MAX_DEPTH:
            continue
        if t is list or t is tuple:
            for i, x in enumerate(o):
                if type(x) not in _LEAF_SET:
                    stack.append((x, f"{w}[{i}]", depth + 1))
        elif t is dict:
            for k, x in o.items():
                if type(k) is not str:
                    raise TypeError(
                        f"cannot {what}: {w} has the key {k!r} of type {_type_name(k)}: the "
                        "keys of a dict in a task value must be str"
                    )
                if type(x) not in _LEAF_SET:
                    stack.append((x, f"{w}[{k!r}]", depth + 1))
        elif isinstance(o, _LEAF):  # a subclass (an IntEnum, a str subclass): as its base
            continue
        else:
            raise _refuse(what, w, o)


def encode_value(value: Any, where: str, what: str) -> bytes:
    """``value`` msgpack-encoded; ``TypeError`` naming ``where`` when it is not plain data."""
    try:
        data = _encode(value)
    except (TypeError, OverflowError, RecursionError, ValueError) as exc:
        check_plain(value, where, what)  # names the part to blame when it can
        raise _refuse(what, where, value, f"{type(exc).__name__}: {exc}") from None
    check_plain(value, where, what)
    return data


def encode_kwargs(kwargs: Mapping[Any, Any], what: str) -> bytes:
    """A kwargs mapping msgpack-encoded (as a map); ``TypeError`` for a non-str key or a
    value that is not plain data, naming ``kwargs['key']``."""
    for key, value in kwargs.items():
        if type(key) is not str:
            raise TypeError(
                f"cannot {what}: kwargs has the key {key!r} of type {_type_name(key)}: "
                "keyword argument names must be str"
            )
        if not key.isidentifier():
            raise ValueError(
                f"cannot {what}: kwargs key {key!r} is not a Python identifier, so no "
                "callable could take it as a keyword argument"
            )
        if type(value) not in _LEAF_SET:
            encode_value(value, f"kwargs[{key!r}]", what)
    if not kwargs:
        return b""
    try:
        return _encode(dict(kwargs))
    except (TypeError, OverflowError, ValueError) as exc:
        raise TypeError(f"cannot {what}: kwargs: {type(exc).__name__}: {exc}") from None


def array_header(n: int) -> bytes:
    """The msgpack header of an array of ``n`` items (the items follow, encoded)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


class TaskValues:
    """A TaskArgs' values and kwargs: in the parent the objects and their encodings, in
    a child the encoded bytes until first read."""

    __slots__ = ("items", "kw", "kwargs", "parts", "raw_kwargs", "raw_values")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.parts: list[bytes] = []
        self.kwargs: dict[str, Any] | None = {}
        #: The encoded kwargs (None: decoded in a child, encoded again when sent on).
        self.kw: bytes | None = b""
        #: A child's undecoded bytes (``None``: decoded, or a parent's values).
        self.raw_values: bytes | None = None
        self.raw_kwargs: bytes | None = None

    @classmethod
    def received(cls, values: bytes, kwargs: bytes) -> TaskValues:
        """The values of a task as a child receives them, decoded on first access."""
        v = cls()
        v.raw_values = values
        v.raw_kwargs = kwargs
        v.kwargs = None
        return v

    def get_values(self) -> list[Any]:
        raw = self.raw_values
        if raw is not None:
            self.raw_values = None
            self.items = _decode_list(raw) if raw else []
            self.parts = []  # re-encoded from the items if they are sent on
        return self.items

    def get_kwargs(self) -> dict[str, Any]:
        raw = self.raw_kwargs
        if raw is not None:
            self.raw_kwargs = None
            self.kwargs = _decode_dict(raw) if raw else {}
            self.kw = None
        assert self.kwargs is not None
        return self.kwargs

    def encoded(self) -> tuple[bytes, bytes]:
        """The values (one msgpack array, ``b""`` for none) and the kwargs (a map or
        ``b""``), as a values section carries them: bytes never decoded go on as they
        are, decoded ones (a child or remote orchestration forwarding its args) again."""
        values = self.raw_values
        if values is None:
            parts = self.parts
            if len(parts) != len(self.items):  # decoded, or appended to directly
                parts[:] = [
                    encode_value(x, f"values[{i}]", "submit") for i, x in enumerate(self.items)
                ]
            values = array_header(len(parts)) + b"".join(parts) if parts else b""
        kw = self.raw_kwargs
        if kw is None:
            kw = self.kw
            if kw is None:
                kw = self.kw = encode_kwargs(self.kwargs or {}, "submit")
        return values, kw


def section(values: bytes, kwargs: bytes, heap_offset: int | None) -> bytes:
    """The values section: inline (``heap_offset`` None) or naming a heap range that
    holds ``values + kwargs``."""
    if heap_offset is None:
        return SECTION.pack(MAGIC, WHERE_INLINE, len(values), len(kwargs), 0) + values + kwargs
    return SECTION.pack(MAGIC, WHERE_HEAP, len(values), len(kwargs), heap_offset)


def read_section(blob: bytes, off: int, heap: Any) -> TaskValues | None:
    """The values section at ``off`` of ``blob`` (None when the blob ends there);
    ``heap`` is the mapping a heap-backed section lives in (``Heap.mmap``).
    ``ValueError`` when the section is malformed."""
    if len(blob) <= off:
        return None
    if len(blob) < off + SECTION.size:
        raise ValueError(f"malformed values section: {len(blob) - off} bytes, no header")
    magic, where, nv, nk, heap_offset = SECTION.unpack_from(blob, off)
    if magic != MAGIC or where not in (WHERE_INLINE, WHERE_HEAP):
        raise ValueError(f"malformed values section: magic {magic:#x} where {where}")
    start = off + SECTION.size
    if where == WHERE_INLINE:
        if start + nv + nk != len(blob):
            raise ValueError(
                f"malformed values section: {nv} + {nk} bytes announced, "
                f"{len(blob) - start} present"
            )
        return TaskValues.received(blob[start : start + nv], blob[start + nv : start + nv + nk])
    if heap is None or heap_offset + nv + nk > len(heap):
        raise ValueError(
            f"malformed values section: heap range [{heap_offset}, {heap_offset + nv + nk}) "
            "is not on this process's heap"
        )
    # Copied out now: the run frees the heap buffer once the task is done, and a callable
    # may keep its args (or decode them) after returning.
    return TaskValues.received(
        heap[heap_offset : heap_offset + nv], heap[heap_offset + nv : heap_offset + nv + nk]
    )


def checked_received(values: bytes, kwargs: bytes, where: str) -> TaskValues:
    """Values and kwargs that arrived as msgpack bytes (the daemon's ``Args``, a remote
    TASK), decoded once to check them and kept as bytes for the child. ``ValueError``
    naming ``where.values`` / ``where.kwargs`` and what is wrong."""
    for name, data, decode in (
        ("values", values, _decode_list),
        ("kwargs", kwargs, _decode_dict),
    ):
        if not data:
            continue
        try:
            decoded = decode(data)
        except msgspec.DecodeError as exc:
            want = "one msgpack array" if name == "values" else "one msgpack map with str keys"
            raise ValueError(f"{where}.{name}: not {want} ({exc})") from None
        try:
            check_plain(decoded, name, "accept the task")
        except TypeError as exc:
            raise ValueError(f"{where}.{name}: {exc}") from None
        if name == "kwargs":
            for key in decoded:
                if not key.isidentifier():
                    raise ValueError(f"{where}.kwargs: key {key!r} is not a Python identifier")
    # Kept as the bytes that came: the child decodes them (lazily) itself.
    return TaskValues.received(values, kwargs)
