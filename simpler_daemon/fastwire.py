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
      | -- Hello(version, label) ------------------->   |  once, first
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

Every bound is checked before bytes are buffered: a length above the decoder's
``max_frame`` fails as soon as its 4 bytes arrive (a hostile length never makes
the daemon buffer 4 GiB). Any defect raises
:class:`~simpler_daemon.errors.ProtocolError` and the decoder stays failed: a byte
stream is never resynchronised, the connection is closed.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Final, NamedTuple, TypeAlias

import msgspec

from simpler_daemon.errors import ProtocolError
from simpler_daemon.framestream import StreamDecoder
from simpler_daemon.server._proto.simpler.daemon.v1 import daemon_pb2 as pb

__all__ = [
    "CLIENT_FRAMES",
    "LENGTH",
    "MAX_DETAILS",
    "MAX_LABEL",
    "METHODS",
    "PROTOCOL_VERSION",
    "SERVER_FRAMES",
    "Call",
    "Cancel",
    "End",
    "FrameDecoder",
    "Hello",
    "Item",
    "Method",
    "Reply",
    "encode",
    "frame_limit",
]

PROTOCOL_VERSION: Final = 1
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
    """Client -> daemon, first: the protocol version and the client's display label."""

    version: Annotated[int, msgspec.Meta(ge=0, le=_U32_MAX)]
    label: Annotated[str, msgspec.Meta(max_length=MAX_LABEL)] = ""


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


#: What the daemon accepts, and what the client accepts.
SERVER_FRAMES: Final = Hello | Call | Item | End | Cancel
CLIENT_FRAMES: Final = Reply | Item | End

_ENCODER: Final = msgspec.msgpack.Encoder()


def encode(frame: msgspec.Struct) -> bytes:
    """One frame: its length prefix and its msgpack body."""
    body = _ENCODER.encode(frame)
    return LENGTH.pack(len(body)) + body


def frame_limit(max_message_bytes: int) -> int:
    """The largest frame carrying one message of ``max_message_bytes`` (the daemon's
    ``limits.max_message_bytes``)."""
    return min(_U32_MAX, max_message_bytes + ENVELOPE)


class FrameDecoder(StreamDecoder[Any]):
    """Sans-IO decoder of one connection's byte stream; fed arbitrary splits.

    ``frames``: the union of frame structs this end accepts (:data:`SERVER_FRAMES` or
    :data:`CLIENT_FRAMES`); ``max_frame``: the largest body length accepted, checked
    when the length prefix arrives. The first defect raises ``ProtocolError`` and
    every later :meth:`feed` or :meth:`eof` re-raises it.
    """

    __slots__ = ("_dec", "max_frame")

    def __init__(self, frames: Any, max_frame: int) -> None:
        super().__init__()
        self._dec: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(frames)
        self.max_frame = max_frame

    def feed(self, data: bytes | bytearray | memoryview) -> list[Any]:
        """Add ``data`` and return every frame it completes, in order."""
        if self._failed is not None:
            raise self._failed
        if not self._buf and len(data) > 4:
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
                if size > limit:
                    raise ProtocolError(
                        f"cannot decode frame {self._where()}: {size} bytes exceed the "
                        f"limit of {limit} (limits.max_message_bytes + {ENVELOPE})"
                    )
                stop = pos + 4 + size
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
