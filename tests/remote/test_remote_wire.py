"""The remote frame codec: round trips, every split of a stream, every malformed variant."""

from __future__ import annotations

import random
import re
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simpler_daemon.errors import ProtocolError
from simpler_daemon.remote import wire
from simpler_daemon.remote.wire import (
    CONTROL_BODIES,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_CONTROL_DATA,
    MAX_INLINE,
    MAX_PAYLOAD,
    PROTOCOL_VERSION,
    AllocBody,
    AllocResult,
    BufferKey,
    Completion,
    Control,
    ControlReply,
    CopyFrom,
    CopyTo,
    Frame,
    FrameDecoder,
    FrameType,
    HashidBody,
    Hello,
    ImportBody,
    InlineTensor,
    Payload,
    RegisterPrepare,
    RemoteTensor,
    Task,
    WireConfig,
    clip_text,
    decode_control_body,
    decode_payload,
    encode_frame,
    encode_payload,
)

pytestmark = pytest.mark.timeout(60)

SID = 0xDEADBEEF12345678
WID = 3

TASK = Task(
    digest=bytes(range(32)),
    config=WireConfig(deadline_ms=250, threads=2, enable_profile=True, output_prefix="out/x"),
    tensors=[
        RemoteTensor(
            owner=3,
            buffer_id=7,
            generation=2**64 - 1,
            byte_offset=16,
            nbytes=64,
            dtype="float32",
            shape=[4, 4],
            strides=[16, 4],
            tag=1,
        ),
        InlineTensor(data=b"\x01\x00\x00\x00", dtype="int32", shape=[1], tag=2),
    ],
    scalars=[0, 1, 2**64 - 1],
)
FRAMES: list[tuple[FrameType, int, Payload | None]] = [
    (
        FrameType.HELLO,
        0,
        Hello(
            session_id=SID,
            worker_id=WID,
            protocol_version=1,
            features=0,
            ready=True,
            host="10.77.0.2",
            pid=4242,
        ),
    ),
    (FrameType.TASK, 1, TASK),
    (FrameType.COMPLETION, 1, Completion(error_code=0, error_text="")),
    (
        FrameType.COMPLETION,
        2,
        Completion(error_code=wire.E_TASK_FAILED, error_text="boom ü", traceback="Traceback..."),
    ),
    (FrameType.CONTROL, 3, Control(name="alloc", body=encode_payload(AllocBody([8], "uint8")))),
    (
        FrameType.CONTROL_REPLY,
        3,
        ControlReply(
            name="alloc",
            version=1,
            error_code=0,
            error_text="",
            result=encode_payload(AllocResult(1, 1, 8)),
        ),
    ),
    (FrameType.HEALTH, 17, None),
    (FrameType.SHUTDOWN, 4, None),
]


def _encoded() -> list[bytes]:
    return [encode_frame(t, SID, WID, seq, p) for t, seq, p in FRAMES]


def _expected() -> list[Frame]:
    return [Frame(t, SID, WID, seq, p) for t, seq, p in FRAMES]


def raw_frame(
    ftype: int,
    payload: bytes = b"",
    *,
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
    session_id: int = SID,
    worker_id: int = WID,
    sequence: int = 1,
    payload_bytes: int | None = None,
    flags: int = 0,
) -> bytes:
    n = len(payload) if payload_bytes is None else payload_bytes
    return HEADER.pack(magic, version, ftype, session_id, worker_id, sequence, n, flags) + payload


def _task_dict(**changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = msgspec.to_builtins(TASK, builtin_types=(bytes,))
    d.update(changes)
    return d


def _pack(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def _decode_all(stream: bytes, chunks: list[int], **kw: Any) -> list[Frame]:
    dec = FrameDecoder(**kw)
    out: list[Frame] = []
    pos = 0
    for size in chunks:
        out += dec.feed(stream[pos : pos + size])
        pos += size
    out += dec.feed(stream[pos:])
    dec.eof()
    return out


# --- round trips and splits -------------------------------------------------------------------


@pytest.mark.parametrize("index", range(len(FRAMES)))
def test_round_trip_every_frame_type(index: int) -> None:
    ftype, seq, payload = FRAMES[index]
    data = encode_frame(ftype, SID, WID, seq, payload)
    assert data[:4] == MAGIC and len(data) >= HEADER_SIZE
    dec = FrameDecoder(session_id=SID, worker_id=WID)
    assert dec.feed(data) == [Frame(ftype, SID, WID, seq, payload)]
    dec.eof()
    assert dec.failed is None and dec.buffered == 0


def test_whole_stream_byte_by_byte() -> None:
    stream = b"".join(_encoded())
    dec = FrameDecoder(session_id=SID, worker_id=WID)
    out: list[Frame] = []
    for i in range(len(stream)):
        out += dec.feed(stream[i : i + 1])
    dec.eof()
    assert out == _expected()


def test_every_two_way_split() -> None:
    stream = b"".join(_encoded())
    expected = _expected()
    for cut in range(len(stream) + 1):
        assert _decode_all(stream, [cut]) == expected, cut


def test_random_chunks_and_input_types() -> None:
    stream = b"".join(_encoded())
    rng = random.Random(1234)
    for _ in range(300):
        dec = FrameDecoder()
        out: list[Frame] = []
        pos = 0
        while pos < len(stream):
            size = rng.randint(1, 200)
            chunk = stream[pos : pos + size]
            kind = rng.randrange(3)
            out += dec.feed(
                chunk if kind == 0 else bytearray(chunk) if kind == 1 else memoryview(chunk)
            )
            pos += size
        dec.eof()
        assert out == _expected()


def test_feeding_does_not_keep_references_to_caller_buffers() -> None:
    data = bytearray(b"".join(_encoded()))
    dec = FrameDecoder()
    first = dec.feed(memoryview(data)[:100])
    data[:] = b"\x00" * len(data)  # a reused receive buffer
    rest = dec.feed(bytes(b"".join(_encoded())[100:]))
    assert first + rest == _expected()
    data.extend(b"x")  # no export of the caller's bytearray is left behind


def test_control_bodies_round_trip() -> None:
    bodies = {
        "register_prepare": RegisterPrepare(hashid="h" * 64, kind="orchestration", target="a.b:c"),
        "register_commit": HashidBody("abc"),
        "register_abort": HashidBody("abc"),
        "unregister": HashidBody("abc"),
        "alloc": AllocBody(shape=[2, 3], dtype="float64"),
        "free": BufferKey(owner=1, buffer_id=2, generation=3),
        "copy_to": CopyTo(buffer_id=2, generation=3, offset=8, data=b"abc"),
        "copy_from": CopyFrom(buffer_id=2, generation=3, offset=0, nbytes=MAX_CONTROL_DATA),
        "import": ImportBody(
            owner=0,
            buffer_id=1,
            generation=1,
            dtype="bool",
            shape=[],
            offset=0,
            data=b"\x01",
            final=True,
        ),
        "release": BufferKey(owner=1, buffer_id=2, generation=3),
    }
    assert set(bodies) | {"stats"} == set(CONTROL_BODIES)
    for name, body in bodies.items():
        assert decode_control_body(name, encode_payload(body)) == body
    assert decode_control_body("stats", b"") is None
    assert decode_payload(AllocResult, encode_payload(AllocResult(1, 2, 3))) == AllocResult(1, 2, 3)


# --- malformed streams ------------------------------------------------------------------------

GOOD_TASK = _pack(_task_dict())
BAD_STREAMS: dict[str, tuple[bytes, dict[str, Any]]] = {
    "bad magic": (raw_frame(2, GOOD_TASK, magic=b"SLR4"), {}),
    "bad version": (raw_frame(2, GOOD_TASK, version=2), {}),
    "type zero": (raw_frame(0), {}),
    "unknown type": (raw_frame(8), {}),
    "flag bit": (raw_frame(2, GOOD_TASK, flags=1), {}),
    "high flag bit": (raw_frame(6, flags=1 << 31), {}),
    "oversize header only": (raw_frame(2, payload_bytes=MAX_PAYLOAD + 1), {}),
    "max u32 length": (raw_frame(2, payload_bytes=2**32 - 1), {}),
    "health with payload": (raw_frame(6, b"\xc0"), {}),
    "shutdown with payload": (raw_frame(7, b"\x80"), {}),
    "wrong session": (raw_frame(6, session_id=SID + 1), {"session_id": SID}),
    "wrong worker": (raw_frame(6, worker_id=WID + 1), {"worker_id": WID}),
    "disallowed type": (raw_frame(2, GOOD_TASK), {"allowed": frozenset({FrameType.HEALTH})}),
    "trailing bytes": (raw_frame(2, GOOD_TASK + b"\x00"), {}),
    "empty payload for task": (raw_frame(2), {}),
    "not msgpack": (raw_frame(5, b"\xc1"), {}),
    "payload is a list": (raw_frame(5, _pack([0, ""])), {}),
    "unknown field": (raw_frame(5, _pack({"error_code": 0, "error_text": "", "x": 1})), {}),
    "missing field": (raw_frame(5, _pack({"error_code": 0})), {}),
    "wrong type": (raw_frame(5, _pack({"error_code": "0", "error_text": ""})), {}),
    "negative code": (raw_frame(5, _pack({"error_code": -1, "error_text": ""})), {}),
    "negative scalar": (raw_frame(2, _pack(_task_dict(scalars=[-1]))), {}),
    "float scalar": (raw_frame(2, _pack(_task_dict(scalars=[1.0]))), {}),
    "too many scalars": (raw_frame(2, _pack(_task_dict(scalars=[0] * 4097))), {}),
    "too many tensors": (
        raw_frame(2, _pack(_task_dict(tensors=[_task_dict()["tensors"][1]] * 4097))),
        {},
    ),
    "short digest": (raw_frame(2, _pack(_task_dict(digest=b"x" * 31))), {}),
    "long digest": (raw_frame(2, _pack(_task_dict(digest=b"x" * 33))), {}),
    "oversize error text": (raw_frame(5, _pack({"error_code": 1, "error_text": "e" * 4097})), {}),
    "oversize traceback": (
        raw_frame(5, _pack({"error_code": 1, "error_text": "", "traceback": "t" * 4097})),
        {},
    ),
    "oversize control name": (raw_frame(3, _pack({"name": "n" * 1025})), {}),
    "oversize host": (
        raw_frame(
            1,
            _pack(
                {
                    "session_id": SID,
                    "worker_id": WID,
                    "protocol_version": 1,
                    "features": 0,
                    "ready": True,
                    "host": "h" * 1025,
                    "pid": 1,
                }
            ),
        ),
        {},
    ),
    "hello ids differ from header": (
        raw_frame(
            1,
            _pack(
                {
                    "session_id": SID,
                    "worker_id": WID + 1,
                    "protocol_version": 1,
                    "features": 0,
                    "ready": True,
                    "host": "h",
                    "pid": 1,
                }
            ),
        ),
        {},
    ),
    "hello worker id beyond i32": (
        raw_frame(
            1,
            _pack(
                {
                    "session_id": SID,
                    "worker_id": 2**31,
                    "protocol_version": 1,
                    "features": 0,
                    "ready": True,
                    "host": "h",
                    "pid": 1,
                }
            ),
        ),
        {},
    ),
}


def _tensor_variant(**changes: Any) -> bytes:
    tensors = _task_dict()["tensors"]
    tensors[0].update(changes)
    return raw_frame(2, _pack(_task_dict(tensors=tensors)))


def _inline_variant(**changes: Any) -> bytes:
    tensors = _task_dict()["tensors"]
    tensors[1].update(changes)
    return raw_frame(2, _pack(_task_dict(tensors=tensors)))


BAD_STREAMS.update(
    {
        "tag 5": (_tensor_variant(tag=5), {}),
        "negative tag": (_tensor_variant(tag=-1), {}),
        "unknown dtype": (_tensor_variant(dtype="bfloat16"), {}),
        "unknown inline dtype": (_inline_variant(dtype="object"), {}),
        "long dtype": (_tensor_variant(dtype="f" * 17), {}),
        "nine dims": (_tensor_variant(shape=[1] * 9), {}),
        "nine strides": (_tensor_variant(strides=[1] * 9), {}),
        "negative dim": (_tensor_variant(shape=[-1]), {}),
        "owner beyond i32": (_tensor_variant(owner=2**31), {}),
        "unknown tensor kind": (_tensor_variant(kind="x"), {}),
        "tensor unknown field": (_tensor_variant(extra=1), {}),
        "oversize inline": (_inline_variant(data=b"\x00" * (MAX_INLINE + 1)), {}),
        "inline data as str": (_inline_variant(data="abcd"), {}),
        "config unknown field": (
            raw_frame(2, _pack(_task_dict(config={"deadline_ms": 1, "nope": 2}))),
            {},
        ),
        "oversize output prefix": (
            raw_frame(2, _pack(_task_dict(config={"output_prefix": "p" * 1025}))),
            {},
        ),
    }
)


# What each variant's error must say (the reason, not just any decode failure).
REASONS: dict[str, str] = {
    "bad magic": "bad magic",
    "bad version": "unsupported protocol version 2",
    "type zero": "unknown frame type 0",
    "unknown type": "unknown frame type 8",
    "flag bit": "unknown flag bits 0x1",
    "high flag bit": "unknown flag bits 0x80000000",
    "oversize header only": "exceeds MAX_PAYLOAD",
    "max u32 length": "exceeds MAX_PAYLOAD",
    "health with payload": "HEALTH .*carries no payload",
    "shutdown with payload": "SHUTDOWN .*carries no payload",
    "wrong session": "does not match this connection's session",
    "wrong worker": "belongs to worker 3",
    "disallowed type": "TASK is not allowed on this lane",
    "trailing bytes": "trailing characters",
    "empty payload for task": "truncated",
    "not msgpack": "malformed",
    "payload is a list": "Expected `object`, got `array`",
    "unknown field": "unknown field `x`",
    "missing field": "missing required field `error_text`",
    "wrong type": r"Expected `int`, got `str` - at `\$.error_code`",
    "negative code": r">= 0 - at `\$.error_code`",
    "negative scalar": r"scalars\[0\]",
    "float scalar": r"scalars\[0\]",
    "too many scalars": r"length <= 4096 - at `\$.scalars`",
    "too many tensors": r"length <= 4096 - at `\$.tensors`",
    "short digest": r"length >= 32 - at `\$.digest`",
    "long digest": r"length <= 32 - at `\$.digest`",
    "oversize error text": r"length <= 4096 - at `\$.error_text`",
    "oversize traceback": r"length <= 4096 - at `\$.traceback`",
    "oversize control name": r"length <= 1024 - at `\$.name`",
    "oversize host": r"length <= 1024 - at `\$.host`",
    "hello ids differ from header": "payload names session",
    "hello worker id beyond i32": r"<= 2147483647 - at `\$.worker_id`",
    "tag 5": r"<= 4 - at `\$.tensors\[0\].tag`",
    "negative tag": r">= 0 - at `\$.tensors\[0\].tag`",
    "unknown dtype": r"unsupported dtype .bfloat16. - at `\$.tensors\[0\].dtype`",
    "unknown inline dtype": r"unsupported dtype .object. - at `\$.tensors\[1\].dtype`",
    "long dtype": r"length <= 16 - at `\$.tensors\[0\].dtype`",
    "nine dims": r"length <= 8 - at `\$.tensors\[0\].shape`",
    "nine strides": r"length <= 8 - at `\$.tensors\[0\].strides`",
    "negative dim": r">= 0 - at `\$.tensors\[0\].shape\[0\]`",
    "owner beyond i32": r"at `\$.tensors\[0\].owner`",
    "unknown tensor kind": r"'x' - at `\$.tensors\[0\].kind`",
    "tensor unknown field": r"unknown field `extra` - at `\$.tensors\[0\]`",
    "oversize inline": r"length <= 1048576 - at `\$.tensors\[1\].data`",
    "inline data as str": r"Expected `bytes`, got `str` - at `\$.tensors\[1\].data`",
    "config unknown field": r"unknown field `nope` - at `\$.config`",
    "oversize output prefix": r"length <= 1024 - at `\$.config.output_prefix`",
}


def test_every_malformed_variant_has_a_reason() -> None:
    assert set(REASONS) == set(BAD_STREAMS)


@pytest.mark.parametrize("name", sorted(BAD_STREAMS))
def test_malformed_stream_raises_protocol_error(name: str) -> None:
    data, kw = BAD_STREAMS[name]
    good = encode_frame(FrameType.HEALTH, SID, WID, 1)
    for chunks in ([len(good) + len(data)], [1] * (len(good) + len(data))):
        dec = FrameDecoder(**kw)
        with pytest.raises(ProtocolError, match="cannot decode") as info:
            pos = 0
            stream = good + data
            for size in chunks:
                dec.feed(stream[pos : pos + size])
                pos += size
            dec.eof()
        assert re.search(REASONS.get(name, "^$"), str(info.value)), str(info.value)
        # The failure is sticky: a byte stream is never resynchronised.
        assert isinstance(dec.failed, ProtocolError)
        with pytest.raises(ProtocolError):
            dec.feed(good)
        with pytest.raises(ProtocolError):
            dec.eof()
        if len(data) > 100_000:
            break  # byte-by-byte feeding of a megabyte is slow and proves nothing new


def test_oversize_is_rejected_from_the_header_alone() -> None:
    dec = FrameDecoder()
    with pytest.raises(ProtocolError, match="exceeds MAX_PAYLOAD"):
        dec.feed(raw_frame(2, payload_bytes=MAX_PAYLOAD + 1))
    # A bad header is detected as soon as its 40 bytes are in, not when the payload is.
    dec = FrameDecoder(session_id=SID)
    with pytest.raises(ProtocolError, match="does not match"):
        dec.feed(raw_frame(2, session_id=1, payload_bytes=1000))


@pytest.mark.parametrize("cut", [1, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 5])
def test_truncated_at_eof(cut: int) -> None:
    data = encode_frame(FrameType.TASK, SID, WID, 1, TASK)
    dec = FrameDecoder()
    assert dec.feed(data[:cut]) == []
    with pytest.raises(ProtocolError, match="truncated frame at EOF"):
        dec.eof()
    assert dec.failed is not None


def test_frames_before_a_bad_one_are_dropped_with_the_connection() -> None:
    dec = FrameDecoder()
    with pytest.raises(ProtocolError, match="bad magic"):
        dec.feed(encode_frame(FrameType.HEALTH, SID, WID, 1) + b"XXXX" + bytes(36))


def test_error_names_worker_and_offset() -> None:
    dec = FrameDecoder(worker_id=WID)
    good = encode_frame(FrameType.HEALTH, SID, WID, 1)
    with pytest.raises(ProtocolError, match=rf"frame 1 from worker {WID} \(stream offset 40\)"):
        dec.feed(good + raw_frame(6, flags=4))


def test_control_body_errors() -> None:
    with pytest.raises(ProtocolError, match="unknown control 'nope'"):
        decode_control_body("nope", b"")
    with pytest.raises(ProtocolError, match="expected no body"):
        decode_control_body("stats", b"\x80")
    with pytest.raises(ProtocolError, match="'copy_to'"):
        decode_control_body(
            "copy_to",
            _pack(
                {
                    "buffer_id": 1,
                    "generation": 1,
                    "offset": 0,
                    "data": b"x" * (MAX_CONTROL_DATA + 1),
                }
            ),
        )
    with pytest.raises(ProtocolError, match="copy_from"):
        decode_control_body(
            "copy_from",
            _pack({"buffer_id": 1, "generation": 1, "offset": 0, "nbytes": MAX_CONTROL_DATA + 1}),
        )
    with pytest.raises(ProtocolError, match="kind"):
        decode_control_body("register_prepare", _pack({"hashid": "h", "kind": "x", "target": "t"}))
    with pytest.raises(ProtocolError, match="alloc"):
        decode_control_body("alloc", _pack({"shape": [1], "dtype": "float32"}) + b"\x00")
    with pytest.raises(ProtocolError, match=r"'alloc' body: unsupported dtype 'float8'"):
        decode_control_body("alloc", _pack({"shape": [1], "dtype": "float8"}))
    with pytest.raises(ProtocolError, match=r"AllocBody: unsupported dtype 'str'"):
        decode_payload(AllocBody, _pack({"shape": [1], "dtype": "str"}))
    bad_import = msgspec.to_builtins(
        ImportBody(0, 1, 1, "int8", [1], 0, b"x", True), builtin_types=(bytes,)
    )
    bad_import["dtype"] = "int128"
    with pytest.raises(ProtocolError, match=r"'import' body: unsupported dtype 'int128'"):
        decode_control_body("import", _pack(bad_import))
    with pytest.raises(ProtocolError, match="AllocResult"):
        decode_payload(AllocResult, _pack({"buffer_id": -1, "generation": 0, "nbytes": 0}))


def test_encode_refuses_what_the_decoder_would_refuse() -> None:
    with pytest.raises(ProtocolError, match="must be Task"):
        encode_frame(FrameType.TASK, SID, WID, 1, Completion(0, ""))
    with pytest.raises(ProtocolError, match="carries no payload"):
        encode_frame(FrameType.HEALTH, SID, WID, 1, Completion(0, ""))
    with pytest.raises(ProtocolError, match="out of range"):
        encode_frame(FrameType.HEALTH, SID, 2**31, 1)
    with pytest.raises(ProtocolError, match="out of range"):
        encode_frame(FrameType.HEALTH, -1, WID, 1)
    huge = Control(name="copy_to", body=b"x" * MAX_PAYLOAD)
    with pytest.raises(ProtocolError, match="exceeds MAX_PAYLOAD"):
        encode_frame(FrameType.CONTROL, SID, WID, 1, huge)


def test_largest_legal_frame_round_trips() -> None:
    body = encode_payload(CopyTo(1, 1, 0, b"\xab" * MAX_CONTROL_DATA))
    data = encode_frame(FrameType.CONTROL, SID, WID, 9, Control(name="copy_to", body=body))
    out = _decode_all(data, [HEADER_SIZE + 3, 1 << 20])
    assert len(out) == 1
    ctl = out[0].payload
    assert isinstance(ctl, Control)
    assert decode_control_body("copy_to", ctl.body) == CopyTo(1, 1, 0, b"\xab" * MAX_CONTROL_DATA)


def test_clip_text_keeps_head_and_tail() -> None:
    assert clip_text("short") == "short"
    text = "HEAD" + "x" * 10_000 + "TAIL"
    clipped = clip_text(text)
    assert len(clipped) == wire.MAX_ERROR_TEXT
    assert clipped.startswith("HEAD") and clipped.endswith("TAIL") and "[clipped]" in clipped
    assert clip_text("abcdef", 3) == "abc"
    # A clipped text is always accepted by the decoder.
    frame = encode_frame(FrameType.COMPLETION, SID, WID, 1, Completion(1, clipped, clipped))
    assert FrameDecoder().feed(frame)[0].payload == Completion(1, clipped, clipped)


# --- property tests ---------------------------------------------------------------------------

_PROPS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


def _feed_in_chunks(dec: FrameDecoder, stream: bytes, cuts: list[int]) -> list[Frame]:
    out: list[Frame] = []
    pos = 0
    for cut in sorted(c % (len(stream) + 1) for c in cuts):
        out += dec.feed(stream[pos:cut])
        pos = max(pos, cut)
    out += dec.feed(stream[pos:])
    dec.eof()
    return out


@_PROPS
@given(st.binary(max_size=400), st.lists(st.integers(min_value=0), max_size=8))
def test_random_bytes_end_in_frames_or_protocol_error(data: bytes, cuts: list[int]) -> None:
    try:
        frames = _feed_in_chunks(FrameDecoder(), data, cuts)
    except ProtocolError:
        return
    assert all(isinstance(f, Frame) for f in frames)


@_PROPS
@given(st.binary(max_size=300), st.sampled_from(list(FrameType)), st.integers(0, 300))
def test_valid_header_random_payload(payload: bytes, ftype: FrameType, extra: int) -> None:
    # A plausible header in front of garbage reaches the msgpack decoder.
    stream = raw_frame(ftype, payload) + payload[:extra]
    try:
        _feed_in_chunks(FrameDecoder(), stream, [extra])
    except ProtocolError:
        pass


_frame_index = st.integers(0, len(FRAMES) - 1)


@_PROPS
@given(
    st.lists(_frame_index, min_size=1, max_size=12),
    st.lists(st.integers(min_value=0), max_size=20),
)
def test_random_splits_of_valid_streams(indices: list[int], cuts: list[int]) -> None:
    encoded = _encoded()
    expected = _expected()
    stream = b"".join(encoded[i] for i in indices)
    assert _feed_in_chunks(FrameDecoder(), stream, cuts) == [expected[i] for i in indices]


@_PROPS
@given(
    st.lists(_frame_index, min_size=1, max_size=6),
    st.integers(min_value=0),
    st.integers(1, 255),
    st.lists(st.integers(min_value=0), max_size=6),
)
def test_corrupted_valid_streams(indices: list[int], where: int, xor: int, cuts: list[int]) -> None:
    encoded = _encoded()
    stream = bytearray(b"".join(encoded[i] for i in indices))
    stream[where % len(stream)] ^= xor
    try:
        frames = _feed_in_chunks(FrameDecoder(), bytes(stream), cuts)
    except ProtocolError:
        return
    assert all(isinstance(f, Frame) for f in frames)
