"""The local fast path's frame codec: bytes in, frames out, no sockets (shared by both ends).

A local client (``simpler_daemon.client`` with ``transport="fast"``) and the daemon's
fast listener (``server/fastpath.py``) exchange frames over their own Unix socket
(``<dir>/<stem>.fast.sock`` beside the gRPC socket). Every frame is a 4-byte
big-endian length, then that many bytes of msgpack: one of the structs below,
encoded as an array whose first element is the frame's tag::

    +----------------+--------------------------------------------------+
    | length u32 BE  | msgpack array [tag, field, field, ...]           |
    +----------------+--------------------------------------------------+

    client                                            daemon
      | -- Hello(version, label, upto) ------------->   |  once, first
      | <- Welcome(2) ------------------------------   |  only when upto >= 2 (see below)
      | -- Call(id, "SubmitRun", request pb bytes) ->   |  a unary call ...
      | <- Reply(id, code 0, "", "", response bytes) -  |  ... its answer (or a status)
      | -- Call(id, "WatchRun", request) ----------->   |  a server stream ...
      | <- Item(id, event bytes) ... End(id, code) --   |  ... its items, then its status
      | -- Call(id, "WriteBuffer", b"", stream) ---->   |  a client stream ...
      | -- Item(id, chunk) ... End(id, 0) ---------->   |  ... its items, then the end
      | <- Reply(id, code, ...) ---------------------   |
      | -- Cancel(id) ------------------------------>   |  the client gave up on a call

The payloads are the protobuf messages of the gRPC API (``simpler.daemon.v1``),
carried as bytes: both transports run the same handlers on the same messages, so
their semantics cannot drift. Status codes are ``grpc.StatusCode`` numbers;
``field`` is what gRPC carries in the ``x-simpler-field`` trailer.

Version 2 (negotiated; nothing changes for a version-1 peer): a client that speaks it
says so in its Hello (``upto = 2``; a version-1 daemon ignores the extra element) and
a daemon that speaks it answers ``Welcome(2)`` before anything else. From then on the
client may send the run path's two calls as msgspec frames of their own instead of
protobuf bytes inside a Call: ``Submit`` (a SubmitRun: its fields by name, each task a
:class:`NativeTask` whose arguments stay ``Args`` bytes, ``b""`` for none) and
``Wait`` (a WaitRun). The daemon answers them with the same Reply frames (the response
message's bytes) as the Calls they stand for, so both forms share the handler's
semantics, errors and metrics; a version-1 connection that sends one is closed, as
is one sending a Submit longer than the decoder's ``max_frame`` (it carries no call
bytes to skip: the client sends a big submit as a Call)::

      | -- Submit(id, tasks, key, ..., wait_seconds) ->  |  a SubmitRun without protobuf
      | <- Reply(id, code, ..., SubmitRunResponse) ----  |
      | -- Wait(id, run_id, timeout_seconds, ...) ---->  |  a WaitRun
      | <- Reply(id, code, ..., RunStatus) ------------  |

Every bound is checked before bytes are buffered: a frame longer than the decoder's
``max_frame`` is never buffered. When the first bytes of its body name a call (a
``Call``, ``Item`` or ``Reply``: ``[tag, id, ...]``), the decoder skips the body as
it streams in and yields :class:`Oversize` for that call instead, so the daemon
answers RESOURCE_EXHAUSTED as gRPC does and keeps the connection; any other
oversize frame is a protocol error as soon as its head arrives. Any defect raises
:class:`~simpler_daemon.errors.ProtocolError` and the decoder stays failed: a byte
stream is never resynchronised, the connection is closed.
"""

from __future__ import annotations

import struct
import typing
from typing import Annotated, Any, Final, NamedTuple, TypeAlias

import msgspec

from simpler_daemon.errors import ProtocolError
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol.framestream import StreamDecoder

__all__ = [
    "CLIENT_FRAMES",
    "LENGTH",
    "MAX_DETAILS",
    "MAX_LABEL",
    "METHODS",
    "NATIVE_VERSION",
    "PROTOCOL_VERSION",
    "SERVER_FRAMES",
    "Call",
    "Cancel",
    "End",
    "FrameDecoder",
    "Hello",
    "Item",
    "Method",
    "NativeTask",
    "Oversize",
    "Reply",
    "Submit",
    "Wait",
    "Welcome",
    "encode",
    "frame_limit",
]

#: The version a Hello names: every daemon serves it.
PROTOCOL_VERSION: Final = 1
#: The version with the Welcome, Submit and Wait frames, negotiated (``Hello.upto``).
NATIVE_VERSION: Final = 2
#: The length prefix: u32, big-endian (network order).
LENGTH: Final = struct.Struct(">I")
#: Room for the envelope around a protobuf message of ``limits.max_message_bytes``.
ENVELOPE: Final = 4096
MAX_METHOD: Final = 64
MAX_LABEL: Final = 256
MAX_DETAILS: Final = 64 * 1024
_U32_MAX: Final = (1 << 32) - 1

CallId: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Code: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=16)]


class Hello(msgspec.Struct, array_like=True, tag=0, frozen=True):
    """Client -> daemon, first: the protocol version, the client's display label and
    the highest version the client speaks (a version-1 daemon ignores ``upto``: msgspec
    drops an array's trailing elements beyond a struct's fields)."""

    version: Annotated[int, msgspec.Meta(ge=0, le=_U32_MAX)]
    label: Annotated[str, msgspec.Meta(max_length=MAX_LABEL)] = ""
    upto: Annotated[int, msgspec.Meta(ge=0, le=_U32_MAX)] = PROTOCOL_VERSION


class Call(msgspec.Struct, array_like=True, tag=1, frozen=True):
    """Client -> daemon: start call ``id`` of ``method``. ``timeout``: seconds (None =
    no deadline). ``stream``: the request messages follow as Items and an End."""

    id: CallId
    method: Annotated[str, msgspec.Meta(max_length=MAX_METHOD)]
    data: bytes = b""
    timeout: Annotated[float, msgspec.Meta(ge=0)] | None = None
    stream: bool = False


class Reply(msgspec.Struct, array_like=True, tag=2, frozen=True):
    """Daemon -> client: the answer of a unary-response call (code 0: ``data`` holds the
    response message) or the status of any failed call."""

    id: CallId
    code: Code
    details: Annotated[str, msgspec.Meta(max_length=MAX_DETAILS)] = ""
    field: Annotated[str, msgspec.Meta(max_length=MAX_DETAILS)] = ""
    data: bytes = b""


class Item(msgspec.Struct, array_like=True, tag=3, frozen=True):
    """One message of a stream (daemon -> client: a response; client -> daemon: a request)."""

    id: CallId
    data: bytes


class End(msgspec.Struct, array_like=True, tag=4, frozen=True):
    """The end of a stream: daemon -> client with the call's status, client -> daemon
    (code 0) after the last request message."""

    id: CallId
    code: Code = 0
    details: Annotated[str, msgspec.Meta(max_length=MAX_DETAILS)] = ""
    field: Annotated[str, msgspec.Meta(max_length=MAX_DETAILS)] = ""


class Cancel(msgspec.Struct, array_like=True, tag=5, frozen=True):
    """Client -> daemon: the client gave up on call ``id``; its handler is cancelled."""

    id: CallId


class Welcome(msgspec.Struct, array_like=True, tag=6, frozen=True):
    """Daemon -> client, first, only to a Hello with ``upto >= 2``: the version both
    speak from now on (the client may send Submit and Wait frames)."""

    version: Annotated[int, msgspec.Meta(ge=0, le=_U32_MAX)]


class NativeTask(msgspec.Struct, array_like=True, frozen=True):
    """One task of a Submit: ``simpler.daemon.v1.Task``'s fields. ``members``: each
    call's ``Args`` message bytes (``b""``: no arguments; the default is one call
    without arguments, a plain task); ``config``: ``CallConfig`` bytes (None: unset).
    Numbers are range-checked by the daemon, which names the field as for a Task."""

    kind: int
    hashid: str
    members: tuple[bytes, ...] = (b"",)
    workers: tuple[int, ...] = ()
    config: bytes | None = None


class Submit(msgspec.Struct, array_like=True, tag=7, frozen=True):
    """Client -> daemon (version 2): call ``id``, a SubmitRun with
    ``SubmitRunRequest``'s fields (``wait_seconds`` None: unset); ``timeout`` as a Call's.
    Answered by a Reply carrying a ``SubmitRunResponse``."""

    id: CallId
    tasks: list[NativeTask]
    idempotency_key: str = ""
    label: str = ""
    wait_seconds: float | None = None
    priority: int = 0
    include_results: bool = False
    timeout: Annotated[float, msgspec.Meta(ge=0)] | None = None


class Wait(msgspec.Struct, array_like=True, tag=8, frozen=True):
    """Client -> daemon (version 2): call ``id``, a WaitRun with ``WaitRunRequest``'s
    fields (``timeout_seconds`` None: unset). Answered by a Reply carrying a ``RunStatus``."""

    id: CallId
    run_id: int
    timeout_seconds: float | None = None
    include_results: bool = False
    timeout: Annotated[float, msgspec.Meta(ge=0)] | None = None


class Oversize(NamedTuple):
    """Not a frame: what the decoder yields for a frame of call ``id`` whose length
    exceeds its ``max_frame`` (``tag``: the frame's kind; ``size``: the length of its
    message, or of the whole body when the head does not show it). The body is skipped."""

    tag: int
    id: int
    size: int


#: What the daemon accepts, and what the client accepts.
SERVER_FRAMES: Final = Hello | Call | Item | End | Cancel | Submit | Wait
CLIENT_FRAMES: Final = Reply | Item | End | Welcome

_ENCODER: Final = msgspec.msgpack.Encoder()


def encode(frame: msgspec.Struct) -> bytes:
    """One frame: its length prefix and its msgpack body."""
    body = _ENCODER.encode(frame)
    return LENGTH.pack(len(body)) + body


def frame_limit(max_message_bytes: int) -> int:
    """The largest frame carrying one message of ``max_message_bytes`` (the daemon's
    ``limits.max_message_bytes``)."""
    return min(_U32_MAX, max_message_bytes + ENVELOPE)


#: Body bytes read of an oversize frame to find its call id and message length:
#: array header (5) + tag (1) + id (9) + method (2 + MAX_METHOD) + bin header (5).
OVERSIZE_HEAD: Final = 96


def _uint(head: memoryview, pos: int) -> tuple[int, int] | None:
    """The msgpack unsigned integer at ``pos`` and the position after it (None: not one,
    or cut off by the end of ``head``)."""
    if pos >= len(head):
        return None
    b = head[pos]
    if b <= 0x7F:
        return b, pos + 1
    width = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}.get(b)
    if width is None or pos + 1 + width > len(head):
        return None
    return int.from_bytes(head[pos + 1 : pos + 1 + width], "big"), pos + 1 + width


def _oversize(head: memoryview, tags: frozenset[int], body: int) -> Oversize | None:
    """The call an oversize frame's ``head`` (its first body bytes) belongs to: a
    msgpack array ``[tag, id, ...]`` of a frame kind in ``tags``. The message length
    is that of the first ``bin`` after the id, skipping strings (a Call's method)."""
    if not head:
        return None
    b = head[0]
    pos = 1 if 0x90 <= b <= 0x9F else 3 if b == 0xDC else 5 if b == 0xDD else 0
    if not pos:
        return None
    tag = _uint(head, pos)
    if tag is None or tag[0] not in tags:
        return None
    call_id = _uint(head, tag[1])
    if call_id is None or call_id[0] > (1 << 63) - 1:
        return None
    pos = call_id[1]
    while pos < len(head):
        b = head[pos]
        sizes = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
        if 0xA0 <= b <= 0xBF:  # fixstr
            pos += 1 + (b & 0x1F)
            continue
        width = sizes.get(b)
        if width is None or pos + 1 + width > len(head):
            break
        length = int.from_bytes(head[pos + 1 : pos + 1 + width], "big")
        if b in (0xC4, 0xC5, 0xC6):
            return Oversize(tag[0], call_id[0], length)
        pos += 1 + width + length  # a str: a Call's method
    return Oversize(tag[0], call_id[0], body)


def _call_tags(frames: Any) -> frozenset[int]:
    """The tags of the accepted frame kinds that carry a call id and a message."""
    kinds = typing.get_args(frames) or (frames,)
    return frozenset(
        k.__struct_config__.tag
        for k in kinds
        if "id" in k.__struct_fields__ and "data" in k.__struct_fields__
    )


class FrameDecoder(StreamDecoder[Any]):
    """Sans-IO decoder of one connection's byte stream; fed arbitrary splits.

    ``frames``: the union of frame structs this end accepts (:data:`SERVER_FRAMES` or
    :data:`CLIENT_FRAMES`); ``max_frame``: the largest body length accepted, checked
    when the length prefix arrives. The first defect raises ``ProtocolError`` and
    every later :meth:`feed` or :meth:`eof` re-raises it.
    """

    __slots__ = ("_dec", "_skip", "_tags", "max_frame")

    def __init__(self, frames: Any, max_frame: int) -> None:
        super().__init__()
        self._dec: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(frames)
        self._tags = _call_tags(frames)
        self._skip = 0  # bytes of an oversize frame's body still to discard
        self.max_frame = max_frame

    @property
    def incomplete(self) -> bool:
        """Whether part of a frame arrived and the rest has not (buffered or skipped)."""
        return bool(self._buf) or self._skip > 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[Any]:
        """Add ``data`` and return every frame it completes, in order."""
        if self._failed is not None:
            raise self._failed
        if not self._buf and not self._skip and len(data) > 4:
            # The common case, one whole frame per read with nothing buffered: decode it
            # without the general loop (any defect falls through to it and is named there).
            (size,) = LENGTH.unpack_from(data)
            if size + 4 == len(data) and size <= self.max_frame:
                try:
                    frame = self._dec.decode(memoryview(data)[4:])
                except msgspec.MsgspecError:
                    pass
                else:
                    self._frames += 1
                    self._consumed += size + 4
                    return [frame]
        return self._guarded(data)

    def _feed(self, data: bytes | bytearray | memoryview) -> list[Any]:
        frames: list[Any] = []
        if self._skip:
            n = min(self._skip, len(data))
            self._skip -= n
            self._consumed += n
            if n == len(data):
                return frames
            data = memoryview(data)[n:]
        buf = self._buf
        # With nothing buffered, decode straight out of the caller's chunk and copy
        # only an incomplete tail (one reply per read is the common case).
        src: bytes | bytearray | memoryview
        if buf:
            buf += data
            src = buf
        else:
            src = data
        pos = 0
        limit = self.max_frame
        decode = self._dec.decode
        with memoryview(src) as view:
            end = view.nbytes
            while end - pos >= 4:
                (size,) = LENGTH.unpack_from(view, pos)
                stop = pos + 4 + size
                if size > limit:
                    head = min(size, OVERSIZE_HEAD)
                    if end - pos - 4 < head:
                        break  # wait for the head (a few bytes buffered at most)
                    found = _oversize(view[pos + 4 : pos + 4 + head], self._tags, size)
                    if found is None:
                        raise ProtocolError(
                            f"cannot decode frame {self._where()}: {size} bytes exceed the "
                            f"limit of {limit} (limits.max_message_bytes + {ENVELOPE})"
                        )
                    frames.append(found)
                    self._frames += 1
                    if stop > end:  # discard the rest of the body as it arrives
                        self._skip = stop - end
                        stop = end
                    self._consumed += stop - pos
                    pos = stop
                    continue
                if stop > end:
                    break
                try:
                    frames.append(decode(view[pos + 4 : stop]))
                except msgspec.MsgspecError as exc:
                    raise ProtocolError(f"cannot decode frame {self._where()}: {exc}") from exc
                self._frames += 1
                self._consumed += stop - pos
                pos = stop
            if src is not buf and pos < end:
                buf += view[pos:]
        if src is buf and pos:
            del buf[:pos]  # after the view is released: a bytearray with exports can't resize
        return frames


# --------------------------------------------------------------------------- methods


class Method(NamedTuple):
    """One RPC of ``simpler.daemon.v1.Daemon``: its message classes and its kind."""

    name: str
    request: Any
    response: Any
    client_stream: bool
    server_stream: bool


def _methods() -> dict[str, Method]:
    service = pb.DESCRIPTOR.services_by_name["Daemon"]
    return {
        m.name: Method(
            m.name,
            getattr(pb, m.input_type.name),
            getattr(pb, m.output_type.name),
            m.client_streaming,
            m.server_streaming,
        )
        for m in service.methods
    }


#: Every RPC of the Daemon service by name (the same table on both ends).
METHODS: Final[dict[str, Method]] = _methods()
