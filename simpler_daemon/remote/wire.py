"""The remote L3 frame codec: bytes in, frames out, no sockets (REMOTE.md section 4).

Both lanes between a parent and a ``simpler-remote-l3-session`` runner carry a
stream of frames. Every frame is a fixed 40-byte little-endian header followed by
``payload_bytes`` of strict msgspec msgpack::

     0       4        8      12             20        24            32        36      40
    +-------+--------+------+--------------+---------+-------------+---------+-------+
    | magic | version| type | session_id   |worker_id| sequence    | payload | flags |
    | SLR3  |  u32   | u32  | u64          |  i32    | u64         |bytes u32|  u32  |
    +-------+--------+------+--------------+---------+-------------+---------+-------+
    | payload: msgpack map of the struct for ``type`` (none for HEALTH/SHUTDOWN)  ...

    parent                                  runner
      | --- TASK / CONTROL / SHUTDOWN ---->   |   command lane, sequence 1, 2, ...
      | <-- HELLO(0) / COMPLETION / REPLY --  |   replies carry the request's sequence
      | <-- HEALTH (every 0.2 s) ----------   |   health lane, own sequence

Every bound is checked before anything is allocated: the header is validated
(magic, version, type, flag bits, ``payload_bytes <= MAX_PAYLOAD``, session,
worker, allowed type) as soon as its 40 bytes arrive, so a hostile length never
makes the decoder buffer 4 GiB. Payload fields carry msgspec ``Meta`` bounds
(string and list lengths, integer ranges, dtype names) that msgspec checks while
decoding, and msgspec never preallocates from a length prefix. Unknown fields,
wrong types and trailing bytes are decode errors. Any failure raises
:class:`~simpler_daemon.errors.ProtocolError` and the decoder stays failed: a
byte stream is never resynchronised.

String limits count characters (msgspec ``max_length``), not UTF-8 bytes; the
payload bound caps the bytes either way.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Annotated, Any, Final, Literal, TypeAlias, TypeVar

import msgspec

from simpler_daemon.args import _DTYPES
from simpler_daemon.errors import ProtocolError
from simpler_daemon.protocol.framestream import StreamDecoder

__all__ = [
    "CONTROL_BODIES",
    "CONTROL_RESULTS",
    "DTYPE_NAMES",
    "E_BAD_ARGS",
    "E_CONTROL_FAILED",
    "E_DEADLINE",
    "E_OK",
    "E_SHUTTING_DOWN",
    "E_TASK_FAILED",
    "E_UNKNOWN_CALLABLE",
    "E_UNKNOWN_CONTROL",
    "HEADER",
    "HEADER_SIZE",
    "KNOWN_FLAGS",
    "MAGIC",
    "MAX_CONTROL_DATA",
    "MAX_DIMS",
    "MAX_ERROR_TEXT",
    "MAX_INLINE",
    "MAX_PAYLOAD",
    "MAX_SCALARS",
    "MAX_STR",
    "MAX_TENSORS",
    "PAYLOAD_TYPES",
    "PROTOCOL_VERSION",
    "AllocBody",
    "AllocResult",
    "BufferKey",
    "Completion",
    "Control",
    "ControlReply",
    "CopyFrom",
    "CopyTo",
    "DType",
    "Frame",
    "FrameDecoder",
    "FrameType",
    "HashidBody",
    "Hello",
    "ImportBody",
    "InlineTensor",
    "Payload",
    "RegisterPrepare",
    "RemoteTensor",
    "Task",
    "WireConfig",
    "clip_text",
    "decode_control_body",
    "decode_payload",
    "encode_frame",
    "encode_payload",
]

MAGIC: Final = b"SLR3"
PROTOCOL_VERSION: Final = 1
HEADER: Final = struct.Struct("<4sIIQiQII")
HEADER_SIZE: Final = 40
assert HEADER.size == HEADER_SIZE

KNOWN_FLAGS: Final = 0  # no flag bit is defined yet: any set bit is a protocol error
MAX_PAYLOAD: Final = 16 << 20
MAX_STR: Final = 1024
MAX_ERROR_TEXT: Final = 4096
MAX_TENSORS: Final = 4096
MAX_SCALARS: Final = 4096
MAX_INLINE: Final = 1 << 20
MAX_CONTROL_DATA: Final = 8 << 20
MAX_DIMS: Final = 8

# Error codes carried in Completion.error_code / ControlReply.error_code.
E_OK: Final = 0
E_TASK_FAILED: Final = 1
E_UNKNOWN_CALLABLE: Final = 2
E_BAD_ARGS: Final = 3
E_CONTROL_FAILED: Final = 4
E_UNKNOWN_CONTROL: Final = 5
E_DEADLINE: Final = 6
E_SHUTTING_DOWN: Final = 7


class FrameType(IntEnum):
    HELLO = 1
    TASK = 2
    CONTROL = 3
    CONTROL_REPLY = 4
    COMPLETION = 5
    HEALTH = 6
    SHUTDOWN = 7


# ---------------------------------------------------------------------------
# Field types with their bounds (checked by msgspec while decoding)

_I32_MIN: Final = -(1 << 31)
_I32_MAX: Final = (1 << 31) - 1
_I64_MIN: Final = -(1 << 63)
_I64_MAX: Final = (1 << 63) - 1

# msgpack cannot carry an integer above 2**64 - 1, so ge=0 is the whole u64 check
# (msgspec rejects an upper bound that does not fit in an int64).
U64: TypeAlias = Annotated[int, msgspec.Meta(ge=0)]
U32: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]
I32: TypeAlias = Annotated[int, msgspec.Meta(ge=_I32_MIN, le=_I32_MAX)]
Str: TypeAlias = Annotated[str, msgspec.Meta(max_length=MAX_STR)]
ErrorText: TypeAlias = Annotated[str, msgspec.Meta(max_length=MAX_ERROR_TEXT)]
Shape: TypeAlias = Annotated[
    list[Annotated[int, msgspec.Meta(ge=0, le=_I64_MAX)]], msgspec.Meta(max_length=MAX_DIMS)
]
Strides: TypeAlias = Annotated[
    list[Annotated[int, msgspec.Meta(ge=_I64_MIN, le=_I64_MAX)]], msgspec.Meta(max_length=MAX_DIMS)
]
TensorTag: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=4)]  # simpler_daemon.args.Tag
Digest: TypeAlias = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
InlineData: TypeAlias = Annotated[bytes, msgspec.Meta(max_length=MAX_INLINE)]
ControlData: TypeAlias = Annotated[bytes, msgspec.Meta(max_length=MAX_CONTROL_DATA)]

# A dtype name of simpler_daemon.args. Typed ``str`` so callers need no cast; the
# decoders check membership in DTYPE_NAMES right after msgspec (a set lookup per
# tensor, where a msgspec ``pattern`` would cost a regex match per tensor).
DTYPE_NAMES: Final[frozenset[str]] = frozenset(_DTYPES)
DType: TypeAlias = Annotated[str, msgspec.Meta(max_length=16)]


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    session_id: U64
    worker_id: I32
    protocol_version: U32
    features: U64
    ready: bool
    host: Str
    pid: Annotated[int, msgspec.Meta(ge=0, le=_I32_MAX)]


class WireConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    deadline_ms: U64 = 0
    threads: U32 = 0
    enable_profile: bool = False
    enable_dump_args: bool = False
    output_prefix: Str = ""


# ``tag`` is a data field (the dependency Tag), so the union is tagged by ``kind``.
class RemoteTensor(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind", tag="r"
):
    owner: I32
    buffer_id: U64
    generation: U64
    byte_offset: U64
    nbytes: U64
    dtype: DType
    shape: Shape
    strides: Strides
    tag: TensorTag
    #: The owner's session generation: a runner refuses a tensor of another session.
    session: U32 = 0


class InlineTensor(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind", tag="i"
):
    data: InlineData
    dtype: DType
    shape: Shape
    tag: TensorTag


class Task(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    digest: Digest
    config: WireConfig
    tensors: Annotated[list[RemoteTensor | InlineTensor], msgspec.Meta(max_length=MAX_TENSORS)]
    scalars: Annotated[list[U64], msgspec.Meta(max_length=MAX_SCALARS)]
    #: The task's values (one msgpack array) and kwargs (one msgpack map), as the args
    #: blob's values section carries them (``taskvalues.py``); empty, and not sent, for
    #: a task without them.
    values: bytes = b""
    kwargs: bytes = b""


class Completion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    error_code: U32
    error_text: ErrorText
    traceback: ErrorText = ""


class Control(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: Str
    version: U32 = 1
    body: bytes = b""  # bounded by MAX_PAYLOAD; each control body has its own bounds


class ControlReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: Str
    version: U32
    error_code: U32
    error_text: ErrorText
    result: bytes = b""


Payload: TypeAlias = Hello | Task | Completion | Control | ControlReply

PAYLOAD_TYPES: Final[dict[FrameType, type[Payload] | None]] = {
    FrameType.HELLO: Hello,
    FrameType.TASK: Task,
    FrameType.CONTROL: Control,
    FrameType.CONTROL_REPLY: ControlReply,
    FrameType.COMPLETION: Completion,
    FrameType.HEALTH: None,
    FrameType.SHUTDOWN: None,
}


# ---------------------------------------------------------------------------
# Control bodies (Control.body / ControlReply.result)


class RegisterPrepare(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    hashid: Str
    kind: Literal["sub", "chip", "orchestration"]
    target: Str


class HashidBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    hashid: Str


class AllocBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    shape: Shape
    dtype: DType


class AllocResult(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    buffer_id: U64
    generation: U64
    nbytes: U64


class BufferKey(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    owner: I32
    buffer_id: U64
    generation: U64
    #: The owner's session generation (every body naming a buffer carries it).
    session: U32 = 0


class CopyTo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    buffer_id: U64
    generation: U64
    offset: U64
    data: ControlData
    session: U32 = 0


class CopyFrom(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    buffer_id: U64
    generation: U64
    offset: U64
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_CONTROL_DATA)]
    session: U32 = 0


class ImportBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    owner: I32
    buffer_id: U64
    generation: U64
    dtype: DType
    shape: Shape
    offset: U64
    data: ControlData
    final: bool
    #: The owner's session generation (part of the snapshot's key on the importer).
    session: U32 = 0


# name -> body struct; None means the body must be empty.
CONTROL_BODIES: Final[dict[str, type[msgspec.Struct] | None]] = {
    "register_prepare": RegisterPrepare,
    "register_commit": HashidBody,
    "register_abort": HashidBody,
    "unregister": HashidBody,
    "alloc": AllocBody,
    "free": BufferKey,
    "copy_to": CopyTo,
    "copy_from": CopyFrom,
    "import": ImportBody,
    "release": BufferKey,
    "stats": None,
}
# name -> result struct for the controls whose result is a struct ("copy_from" returns
# raw bytes, "stats" a plain msgpack dict, the rest an empty result).
CONTROL_RESULTS: Final[dict[str, type[msgspec.Struct]]] = {"alloc": AllocResult}


# ---------------------------------------------------------------------------
# Encoding / decoding helpers shared by the runner and the endpoint

_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODERS: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {}
_S = TypeVar("_S", bound=msgspec.Struct)


def _decoder(cls: type[_S]) -> msgspec.msgpack.Decoder[_S]:
    dec = _DECODERS.get(cls)
    if dec is None:
        dec = _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
    return dec


for _cls in (*filter(None, PAYLOAD_TYPES.values()), *filter(None, CONTROL_BODIES.values())):
    _decoder(_cls)
for _cls in CONTROL_RESULTS.values():
    _decoder(_cls)


def encode_payload(obj: msgspec.Struct) -> bytes:
    """Encode a payload or control struct as msgpack (no bound checks: the peer does them)."""
    return _ENCODER.encode(obj)


def _bad_dtype(obj: object) -> str | None:
    """Name the first dtype field of ``obj`` outside DTYPE_NAMES, msgspec style."""
    if isinstance(obj, Task):
        tensors = obj.tensors
        if tensors and not DTYPE_NAMES.issuperset([t.dtype for t in tensors]):
            for i, t in enumerate(tensors):
                if t.dtype not in DTYPE_NAMES:
                    return f"unsupported dtype {t.dtype!r} - at `$.tensors[{i}].dtype`"
    elif isinstance(obj, (AllocBody, ImportBody)) and obj.dtype not in DTYPE_NAMES:
        return f"unsupported dtype {obj.dtype!r} - at `$.dtype`"
    return None


def decode_payload(cls: type[_S], data: bytes | bytearray | memoryview) -> _S:
    """Decode msgpack ``data`` as ``cls``; ``ProtocolError`` naming the field on any defect."""
    try:
        obj = _decoder(cls).decode(data)
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"cannot decode {cls.__name__}: {exc}") from exc
    defect = _bad_dtype(obj)
    if defect is not None:
        raise ProtocolError(f"cannot decode {cls.__name__}: {defect}")
    return obj


def decode_control_body(name: str, data: bytes | bytearray | memoryview) -> msgspec.Struct | None:
    """Decode the body of control ``name`` with the struct of :data:`CONTROL_BODIES`.

    Returns None for a control without a body. Raises ``ProtocolError`` for an
    unknown name, a non-empty body where none is expected, or a malformed body.
    """
    try:
        cls = CONTROL_BODIES[name]
    except KeyError:
        raise ProtocolError(f"cannot decode control body: unknown control {name!r}") from None
    if cls is None:
        if len(data):
            raise ProtocolError(
                f"cannot decode control {name!r} body: expected no body, got {len(data)} bytes"
            )
        return None
    try:
        body = _decoder(cls).decode(data)
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"cannot decode control {name!r} body: {exc}") from exc
    defect = _bad_dtype(body)
    if defect is not None:
        raise ProtocolError(f"cannot decode control {name!r} body: {defect}")
    return body


def clip_text(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """Shorten ``text`` to ``limit`` characters, keeping the head and the tail.

    Error texts and tracebacks are bounded on the wire; a sender clips them
    rather than poisoning its own connection. The tail of a traceback is the
    part that names the failure, so both ends are kept.
    """
    if len(text) <= limit:
        return text
    marker = "\n...[clipped]...\n"
    if limit <= len(marker):
        return text[:limit]
    head = (limit - len(marker)) // 2
    tail = limit - len(marker) - head
    return text[:head] + marker + text[len(text) - tail :]


class Frame(msgspec.Struct, frozen=True):
    """One decoded frame. A frozen msgspec struct rather than a frozen dataclass:
    it is built once per frame on the hot path, at a tenth of the cost."""

    type: FrameType
    session_id: int
    worker_id: int
    sequence: int
    payload: Payload | None


def encode_frame(
    type: FrameType,
    session_id: int,
    worker_id: int,
    sequence: int,
    payload: Payload | None = None,
) -> bytes:
    """Return the bytes of one frame.

    Raises ``ProtocolError`` when ``payload`` is not the struct of ``type`` (or
    is given for HEALTH/SHUTDOWN), when it encodes to more than ``MAX_PAYLOAD``
    bytes, or when a header field is out of range. Field bounds inside the
    payload are left to the receiver (see :func:`clip_text` for error texts).
    """
    try:
        expected = PAYLOAD_TYPES[type]
    except KeyError:
        raise ProtocolError(f"cannot encode frame: unknown frame type {type!r}") from None
    if expected is None:
        if payload is not None:
            raise ProtocolError(
                f"cannot encode {type.name} frame: it carries no payload, "
                f"got {payload.__class__.__name__}"
            )
        body = b""
    else:
        if payload.__class__ is not expected:
            raise ProtocolError(
                f"cannot encode {type.name} frame: payload must be {expected.__name__}, "
                f"got {payload.__class__.__name__}"
            )
        body = _ENCODER.encode(payload)
        if len(body) > MAX_PAYLOAD:
            raise ProtocolError(
                f"cannot encode {type.name} frame: payload of {len(body)} bytes exceeds "
                f"MAX_PAYLOAD ({MAX_PAYLOAD})"
            )
    try:
        header = HEADER.pack(
            MAGIC, PROTOCOL_VERSION, type, session_id, worker_id, sequence, len(body), 0
        )
    except struct.error as exc:
        raise ProtocolError(
            f"cannot encode {type.name} frame: header field out of range "
            f"(session_id={session_id}, worker_id={worker_id}, sequence={sequence}): {exc}"
        ) from exc
    return header + body


_TYPE_BY_VALUE: Final = {t.value: t for t in FrameType}
_PAYLOAD_DECODERS: Final = {
    t: (None if cls is None else _decoder(cls)) for t, cls in PAYLOAD_TYPES.items()
}


class FrameDecoder(StreamDecoder[Frame]):
    """Sans-IO decoder of one connection's byte stream; fed arbitrary splits.

    ``session_id`` / ``worker_id`` (when given) are the only ids a frame may
    carry; ``allowed`` (when given) the only frame types. The first defect
    raises ``ProtocolError`` and every later :meth:`feed` or :meth:`eof`
    re-raises it: frames decoded earlier in the failing chunk are dropped with
    the connection.
    """

    __slots__ = ("_accept", "_allowed", "_session_id", "_worker_id")

    def __init__(
        self,
        *,
        session_id: int | None = None,
        worker_id: int | None = None,
        allowed: frozenset[FrameType] | None = None,
    ) -> None:
        super().__init__()
        self._session_id = session_id
        self._worker_id = worker_id
        self._allowed = allowed
        # frame type value -> (type, payload decoder) for every type this lane accepts
        self._accept: dict[int, tuple[FrameType, msgspec.msgpack.Decoder[Any] | None]] = {
            t.value: (t, _PAYLOAD_DECODERS[t]) for t in FrameType if allowed is None or t in allowed
        }

    def _who(self) -> str:
        return "" if self._worker_id is None else f" from worker {self._worker_id}"

    def _feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        frames: list[Frame] = []
        buf = self._buf
        # Fast path: with nothing buffered, decode straight out of the caller's
        # chunk and copy only an incomplete tail.
        src: bytes | bytearray | memoryview
        if buf:
            buf += data
            src = buf
        else:
            src = data
        pos = 0
        accept = self._accept
        want_sid = self._session_id
        want_wid = self._worker_id
        with memoryview(src) as view:
            end = view.nbytes
            while end - pos >= HEADER_SIZE:
                magic, version, tv, sid, wid, seq, plen, flags = HEADER.unpack_from(view, pos)
                entry = accept.get(tv)
                # One combined test on the hot path; _check_header names the defect.
                if (
                    entry is None
                    or magic != MAGIC
                    or version != PROTOCOL_VERSION
                    or flags
                    or plen > MAX_PAYLOAD
                    or (want_sid is not None and sid != want_sid)
                    or (want_wid is not None and wid != want_wid)
                    or (plen and entry[1] is None)
                ):
                    checked = self._check_header(magic, version, tv, sid, wid, plen, flags)
                    entry = (checked, _PAYLOAD_DECODERS[checked])
                ftype, dec = entry
                stop = pos + HEADER_SIZE + plen
                if stop > end:
                    break
                payload: Payload | None = None
                if dec is not None:
                    try:
                        payload = dec.decode(view[pos + HEADER_SIZE : stop])
                    except msgspec.MsgspecError as exc:
                        raise ProtocolError(
                            f"cannot decode {ftype.name} frame {self._where()}: {exc}"
                        ) from exc
                    if ftype is FrameType.TASK:
                        defect = _bad_dtype(payload)
                        if defect is not None:
                            raise ProtocolError(
                                f"cannot decode TASK frame {self._where()}: {defect}"
                            )
                    elif isinstance(payload, Hello):
                        self._check_hello(payload, sid, wid)
                frames.append(Frame(ftype, sid, wid, seq, payload))
                self._frames += 1
                self._consumed += stop - pos
                pos = stop
            if src is not buf and pos < end:
                buf += view[pos:]
        if src is buf and pos:
            del buf[:pos]  # after the view is released: a bytearray with exports can't resize
        return frames

    def _check_header(
        self, magic: bytes, version: int, tv: int, sid: int, wid: int, plen: int, flags: int
    ) -> FrameType:
        if magic != MAGIC:
            raise ProtocolError(
                f"cannot decode frame {self._where()}: bad magic {magic!r} (expected {MAGIC!r})"
            )
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"cannot decode frame {self._where()}: unsupported protocol version {version} "
                f"(expected {PROTOCOL_VERSION})"
            )
        ftype = _TYPE_BY_VALUE.get(tv)
        if ftype is None:
            raise ProtocolError(f"cannot decode frame {self._where()}: unknown frame type {tv}")
        if flags & ~KNOWN_FLAGS:
            raise ProtocolError(
                f"cannot decode {ftype.name} frame {self._where()}: unknown flag bits {flags:#x}"
            )
        if plen > MAX_PAYLOAD:
            raise ProtocolError(
                f"cannot decode {ftype.name} frame {self._where()}: payload of {plen} bytes "
                f"exceeds MAX_PAYLOAD ({MAX_PAYLOAD})"
            )
        if plen and _PAYLOAD_DECODERS[ftype] is None:
            raise ProtocolError(
                f"cannot decode {ftype.name} frame {self._where()}: it carries no payload, "
                f"got {plen} bytes"
            )
        if self._session_id is not None and sid != self._session_id:
            raise ProtocolError(
                f"cannot decode {ftype.name} frame {self._where()}: session id {sid} does not "
                f"match this connection's session {self._session_id}"
            )
        if self._worker_id is not None and wid != self._worker_id:
            raise ProtocolError(
                f"cannot decode {ftype.name} frame {self._where()}: it names worker {wid}, "
                f"this connection belongs to worker {self._worker_id}"
            )
        if self._allowed is not None and ftype not in self._allowed:
            raise ProtocolError(
                f"cannot decode {ftype.name} frame {self._where()}: {ftype.name} is not allowed "
                "on this lane"
            )
        return ftype

    def _check_hello(self, hello: Hello, sid: int, wid: int) -> None:
        if hello.session_id != sid or hello.worker_id != wid:
            raise ProtocolError(
                f"cannot decode HELLO frame {self._where()}: payload names session "
                f"{hello.session_id} worker {hello.worker_id}, header session {sid} worker {wid}"
            )
