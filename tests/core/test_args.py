"""Args blob, tensor descriptors, TaskArgs and CallConfig: pure, no fork."""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from simpler_daemon.args import (
    MAX_DEADLINE_MS,
    MAX_NDIM,
    MAX_OUTPUT_PREFIX,
    MAX_TENSORS,
    CallConfig,
    Tag,
    TaskArgs,
    TensorDesc,
    decode_args,
    decode_descs,
    dtype_code,
    dtype_of,
    encode_args,
)
from simpler_daemon.heap import Heap
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.layout import (
    CONFIG_SIZE,
    MAILBOX_ARGS_CAPACITY,
    TASK_FRAMES,
    TENSOR_DESC_SIZE,
)

U64 = (1 << 64) - 1
DTYPES = (
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


@pytest.fixture
def heap() -> Iterator[Heap]:
    hp = Heap(4 << 20)
    try:
        yield hp
    finally:
        hp.close()


def fill(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Distinct, dtype-appropriate contents."""
    n = a.size
    if a.dtype == np.bool_:
        a[...] = (np.arange(n) % 3 == 0).reshape(a.shape)
    elif a.dtype.kind == "c":
        a[...] = (np.arange(n) + 1j * np.arange(n)[::-1]).reshape(a.shape)
    else:
        a[...] = (np.arange(n) % 100).astype(a.dtype).reshape(a.shape)
    return a


def roundtrip(
    heap: Heap, views: list[np.ndarray[Any, Any]], scalars: list[int], tags: list[Tag] | None = None
) -> TaskArgs:
    tags = tags or [Tag.INPUT] * len(views)
    descs = [heap.describe(v).with_tag(t) for v, t in zip(views, tags, strict=True)]
    blob = encode_args(descs, scalars)
    back, sc = decode_descs(blob)
    assert back == descs
    assert sc == scalars
    return decode_args(blob, heap.view)


# -- tensors -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_every_dtype(heap: Heap, dtype: str) -> None:
    a = fill(heap.alloc((3, 5), dtype))
    args = roundtrip(heap, [a, a[1:, ::2]], [7])
    for orig, got in zip([a, a[1:, ::2]], args.tensors, strict=True):
        assert got.dtype == np.dtype(dtype)
        assert got.shape == orig.shape and got.strides == orig.strides
        np.testing.assert_array_equal(got, orig)
        assert np.shares_memory(got, a)  # zero-copy view of the same heap bytes
    assert dtype_of(dtype_code(dtype)) == np.dtype(dtype)


@pytest.mark.parametrize("ndim", range(MAX_NDIM + 1))
def test_roundtrip_ndim_up_to_8(heap: Heap, ndim: int) -> None:
    shape = tuple([2] * ndim)
    a = fill(heap.alloc(shape, "int32"))
    views = [a]
    if ndim:
        views.append(a[(slice(None, None, -1),) * ndim])  # every stride negative
        views.append(a.transpose())  # non-contiguous for ndim >= 2
    args = roundtrip(heap, views, [])
    for orig, got in zip(views, args.tensors, strict=True):
        assert got.shape == orig.shape and got.strides == orig.strides
        np.testing.assert_array_equal(got, orig)


def test_roundtrip_negative_strides_and_non_contiguous_views(heap: Heap) -> None:
    a = fill(heap.alloc((6, 8), "float64"))
    views = [
        a[::-1],
        a[:, ::-1],
        a[::-2, 1::3],
        a[4:1:-1, 7:0:-2],
        a.T,
        a[2],  # a row in the middle: byte_offset > 0
        a[:, 3],  # a column: stride 64
        a[5:5],  # empty
        a[3, 4, ...],  # 0-d view of one element
    ]
    tags = [
        Tag.INPUT,
        Tag.OUTPUT,
        Tag.INOUT,
        Tag.NO_DEP,
        Tag.OUTPUT_EXISTING,
        Tag.INPUT,
        Tag.INPUT,
        Tag.INPUT,
        Tag.INPUT,
    ]
    args = roundtrip(heap, views, [1, 2, 3], tags)
    assert args.tags == tags
    for orig, got in zip(views, args.tensors, strict=True):
        assert got.shape == orig.shape and got.strides == orig.strides
        np.testing.assert_array_equal(got, orig)
    # Writes through a decoded view land in the original buffer.
    args.tensors[0][0, 0] = -1.5
    assert a[5, 0] == -1.5


def test_descriptor_byte_range(heap: Heap) -> None:
    a = heap.alloc((4, 4), "int16")  # 32 bytes, row stride 8
    d = heap.describe(a[::-1, ::-1])
    assert d.byte_offset == 30 and d.strides == (-8, -2)
    assert d.byte_range() == (0, 32)
    assert heap.describe(a[1:3, 1:3]).byte_range() == (10, 22)
    lo, hi = heap.describe(a[2:2]).byte_range()
    assert lo == hi  # an empty view touches nothing
    assert d.with_tag(Tag.OUTPUT).tag is Tag.OUTPUT and d.tag is Tag.INPUT


# -- scalars -------------------------------------------------------------------------------


def test_scalars_u64_and_explicit_int64(heap: Heap) -> None:
    ta = TaskArgs()
    for v in (0, 1, U64, np.uint64(U64), np.int32(2)):
        ta.add_scalar(v)  # type: ignore[arg-type]
    for v in (-1, -(1 << 63), (1 << 63) - 1, np.int32(-2)):
        ta.add_scalar(v, dtype="int64")  # type: ignore[arg-type]
    expected = [0, 1, U64, U64, 2, U64, 1 << 63, (1 << 63) - 1, U64 - 1]
    assert ta.scalars == expected
    args = roundtrip(heap, [], ta.scalars)
    assert args.scalars == expected and args.tensors == []
    # The child reads an int64 back by viewing the word as signed.
    assert int(np.uint64(args.scalars[5]).view(np.int64)) == -1


@pytest.mark.parametrize("count", [1, 3, 64, 65, 200])
def test_a_scalars_only_blob_is_the_general_layout_and_decodes_back(count: int) -> None:
    """Scalars and nothing else take a shorter path both ways (one pack, one unpack);
    the bytes are the general layout's (header, then the words), whatever the count."""
    scalars = [(i * 0x9E3779B97F4A7C15) & U64 for i in range(count)]
    blob = encode_args((), scalars)
    assert blob == struct.pack(f"<ii{count}Q", 0, count, *scalars)
    assert decode_args(blob, lambda d: np.zeros(1)).scalars == scalars
    assert decode_descs(blob) == ([], scalars)


@pytest.mark.parametrize(
    ("blob", "words"),
    [
        (struct.pack("<ii", 0, 2) + bytes(8), r"T=0 S=2 needs 24 bytes, got 16"),
        (struct.pack("<ii", 0, -1), r"T=0 S=-1"),
        (bytes(7), r"7 bytes is shorter than its header"),
    ],
)
def test_a_malformed_scalars_blob_is_refused(blob: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        decode_args(blob, lambda d: np.zeros(1))


def test_too_many_scalars_are_refused_naming_the_capacity() -> None:
    n = MAILBOX_ARGS_CAPACITY // 8
    with pytest.raises(ValueError, match=rf"0 tensors and {n} scalars need {8 + 8 * n} bytes"):
        encode_args((), [1] * n)


@pytest.mark.parametrize(
    ("bad", "dtype", "words"),
    [
        (-1, "uint64", r"scalars\[1\] = -1 is out of range for uint64 .*dtype=\"int64\""),
        (1 << 64, "uint64", r"scalars\[1\] = 18446744073709551616 is out of range for uint64"),
        (1 << 63, "int64", r"scalars\[1\] = 9223372036854775808 is out of range for int64"),
        (-(1 << 63) - 1, "int64", r"out of range for int64"),
    ],
)
def test_scalar_out_of_range_names_position(bad: int, dtype: str, words: str) -> None:
    ta = TaskArgs().add_scalar(5)
    with pytest.raises(ValueError, match=words):
        ta.add_scalar(bad, dtype=dtype)
    assert ta.scalars == [5]  # a refused scalar leaves the args unchanged


@pytest.mark.parametrize("bad", [True, np.bool_(True), 1.0, 1.5, "7", None, np.float32(1)])
def test_scalar_type_errors_never_convert(bad: Any) -> None:
    ta = TaskArgs().add_scalar(1).add_scalar(2)
    with pytest.raises(TypeError, match=r"scalars\[2\] must be an int or a NumPy integer"):
        ta.add_scalar(bad)
    assert ta.scalars == [1, 2]


def test_scalar_unknown_dtype() -> None:
    with pytest.raises(ValueError, match=r"scalars\[0\]: dtype 'float64' is not one of"):
        TaskArgs().add_scalar(1, dtype="float64")


def test_add_tensor_type_errors(heap: Heap) -> None:
    ta = TaskArgs()
    with pytest.raises(
        TypeError, match=r"NumPy array from Worker\.alloc or a RemoteTensorRef .*, got list"
    ):
        ta.add_tensor([1, 2, 3])
    with pytest.raises(ValueError):
        ta.add_tensor(heap.alloc(2), tag=99)  # type: ignore[arg-type]
    assert ta.tensors == [] and ta.tags == []
    a = heap.alloc(2)
    assert ta.add_tensor(a, Tag.OUTPUT).add_scalar(3) is ta
    assert ta.tags == [Tag.OUTPUT] and ta.tensors[0] is a and ta.scalars == [3]


def test_add_tensor_limit() -> None:
    ta = TaskArgs()
    a = np.zeros(1)
    for _ in range(MAX_TENSORS):
        ta.add_tensor(a)
    with pytest.raises(ValueError, match=f"at most {MAX_TENSORS} tensors"):
        ta.add_tensor(a)


def test_unsupported_dtype() -> None:
    with pytest.raises(ValueError, match=r"dtype .* is not supported \(supported: bool, int8"):
        dtype_code("U4")
    with pytest.raises(ValueError, match="not supported"):
        dtype_code(object)


# -- capacity ------------------------------------------------------------------------------


def test_256_tensors_and_128_scalars_fit(heap: Heap) -> None:
    assert MAX_TENSORS >= 256
    a = heap.alloc((16, 16), "float32")
    descs = [heap.describe(a[i % 16 :, ::-1]).with_tag(Tag(i % 5)) for i in range(256)]
    scalars = [(i * 0x9E3779B97F4A7C15) & U64 for i in range(128)]
    blob = encode_args(descs, scalars)
    assert len(blob) == 8 + 256 * TENSOR_DESC_SIZE + 128 * 8 <= MAILBOX_ARGS_CAPACITY
    # ... and it crosses a real task frame intact.
    box = mmap.mmap(-1, _mb.MAILBOX_SIZE)
    try:
        _mb.publish_task(box, TASK_FRAMES[0], 1, b"", 0, 0, bytes(32), blob, 1, 1, 1, 0, 1)
        got = _mb.read_task(box, TASK_FRAMES[0])[4]
    finally:
        box.close()
    assert got == blob
    back, sc = decode_descs(got)
    assert back == descs and sc == scalars


def test_blob_over_capacity_names_both_sizes(heap: Heap) -> None:
    d = heap.describe(heap.alloc(4))
    n = MAX_TENSORS + 1
    need = 8 + n * TENSOR_DESC_SIZE
    with pytest.raises(ValueError) as ei:
        encode_args([d] * n, [])
    msg = str(ei.value)
    assert f"need {need} bytes" in msg and f"capacity is {MAILBOX_ARGS_CAPACITY} bytes" in msg
    # Scalars count too: fill the capacity exactly, then one more.
    s_fit = (MAILBOX_ARGS_CAPACITY - 8) // 8
    assert len(encode_args([], [1] * s_fit)) == 8 + 8 * s_fit
    with pytest.raises(ValueError, match=f"need {8 + 8 * (s_fit + 1)} bytes"):
        encode_args([], [1] * (s_fit + 1))


# -- malformed blobs -----------------------------------------------------------------------


def _one_desc_blob(**override: int) -> bytearray:
    d = TensorDesc(1, 1, 0, 0, 16, dtype_code("int32"), (4,), (4,))
    blob = bytearray(encode_args([d], [5]))
    fields = {"dtype": 12, "tag": 13, "ndim": 14}
    for name, value in override.items():
        blob[fields[name]] = value
    return blob


@pytest.mark.parametrize(
    ("blob", "match"),
    [
        (b"", "shorter than its header"),
        (b"\x01\x00\x00", "shorter than its header"),
        (struct.pack("<ii", -1, 0), "T=-1"),
        (struct.pack("<ii", 0, -5), "S=-5"),
        (struct.pack("<ii", 1, 0), "needs 176 bytes, got 8"),
        (struct.pack("<ii", 0, 2) + b"\0" * 8, "needs 24 bytes, got 16"),
        (bytes(_one_desc_blob(ndim=9)), "ndim=9"),
        (bytes(_one_desc_blob(dtype=14)), "dtype=14"),
        (bytes(_one_desc_blob(dtype=255)), "dtype=255"),
        (bytes(_one_desc_blob(tag=5)), "tag=5"),
    ],
)
def test_malformed_blobs_raise_value_error(blob: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_descs(blob)
    with pytest.raises(ValueError, match=match):
        decode_args(blob, lambda d: np.zeros(1))


def test_well_formed_override_baseline() -> None:
    descs, scalars = decode_descs(bytes(_one_desc_blob()))
    assert descs[0].shape == (4,) and scalars == [5]


def test_empty_blob() -> None:
    blob = encode_args([], [])
    assert blob == struct.pack("<ii", 0, 0)
    assert decode_descs(blob) == ([], [])
    args = decode_args(blob, lambda d: pytest.fail("no tensors to view"))
    assert args.tensors == [] and args.scalars == []


# -- CallConfig ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        CallConfig(),
        CallConfig(deadline_ms=1500, threads=8),
        CallConfig(enable_profile=True),
        CallConfig(enable_dump_args=True, output_prefix="/tmp/out/ü"),
        CallConfig(MAX_DEADLINE_MS, (1 << 31) - 1, True, True, "x" * MAX_OUTPUT_PREFIX),
    ],
)
def test_call_config_roundtrip(cfg: CallConfig) -> None:
    data = cfg.encode()
    assert len(data) <= CONFIG_SIZE
    assert CallConfig.decode(data) == cfg
    # The frame copy is zero-padded to CONFIG_SIZE; decoding that is the same.
    assert CallConfig.decode(data.ljust(CONFIG_SIZE, b"\0")) == cfg
    assert cfg.diagnostic == (cfg.enable_profile or cfg.enable_dump_args)


def test_call_config_diagnostic_flags() -> None:
    assert not CallConfig().diagnostic
    assert CallConfig(enable_profile=True).diagnostic
    assert CallConfig(enable_dump_args=True).diagnostic


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"deadline_ms": -1}, "deadline_ms=-1"),
        ({"deadline_ms": 1 << 63}, "deadline_ms="),
        ({"threads": -1}, "threads=-1 out of range"),
        ({"threads": 1 << 31}, "threads=2147483648 out of range"),
        (
            {"output_prefix": "x" * (MAX_OUTPUT_PREFIX + 1)},
            "output_prefix is 1025 bytes, the limit is 1024",
        ),
        # The limit is in bytes: 513 two-byte characters do not fit.
        ({"output_prefix": "é" * 513}, "output_prefix is 1026 bytes"),
    ],
)
def test_call_config_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CallConfig(**kwargs)
