"""Tests for the ``simpler_daemon.mailbox._mailbox`` C extension (offsets, atomics, futex, bulk helpers)."""

from __future__ import annotations

import mmap
import os
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from simpler_daemon.mailbox import _mailbox as mb

FRAME = mb.MAILBOX_FRAME_SIZE
DIGEST = bytes(range(32))


@pytest.fixture
def box() -> Iterator[mmap.mmap]:
    m = mmap.mmap(-1, mb.MAILBOX_SIZE)
    try:
        yield m
    finally:
        m.close()


def make_blob(t: int, s: int, fill: int = 0xAB) -> bytes:
    return (
        struct.pack("<ii", t, s)
        + bytes([fill]) * (t * mb.TENSOR_DESC_SIZE)
        + struct.pack(f"<{s}Q", *range(s))
    )


def publish(
    buf: mmap.mmap | bytearray,
    frame_off: int = 0,
    *,
    state: int = mb.STATE_TASK_READY,
    config: bytes | bytearray | memoryview = b"cfg",
    slot_id: int = 7,
    generation: int = 2**40 + 3,
    digest: bytes | bytearray | memoryview = DIGEST,
    blob: bytes | bytearray | memoryview | None = None,
    dispatch_id: int = 2**64 - 1,
) -> None:
    mb.publish_task(
        buf,
        frame_off,
        state,
        config,
        slot_id,
        generation,
        digest,
        make_blob(2, 3) if blob is None else blob,
        1,  # protocol
        99,  # run_id
        7,  # trailer_slot_id
        2**40 + 3,  # trailer_generation
        dispatch_id,
    )


# --------------------------------------------------------------------------- constants


def test_constants() -> None:
    assert mb.ABI_VERSION == 1
    assert mb.MAILBOX_SIZE == mb.MAILBOX_FRAME_SIZE * mb.MAILBOX_NUM_FRAMES == 196608
    layout = {
        "OFF_STATE": 0,
        "OFF_ERROR": 4,
        "OFF_RESERVED": 8,
        "OFF_CONFIG": 16,
        "CONFIG_SIZE": 1056,
        "OFF_LEASE": 1072,
        "OFF_DIGEST": 1088,
        "DIGEST_SIZE": 32,
        "OFF_ARGS": 1120,
        "MAILBOX_ARGS_CAPACITY": 64080,
        "OFF_WAKE_SEQ": 65200,
        "OFF_CHILD_PARKED": 65208,
        "OFF_SHUTDOWN": 65216,
        "OFF_TRAILER": 65224,
        "TRAILER_SIZE": 40,
        "OFF_ACCEPTED": 65264,
        "OFF_DISPOSITION": 65272,
        "OFF_ERRMSG": 65280,
        "ERRMSG_SIZE": 256,
        "TENSOR_DESC_SIZE": 168,
    }
    for name, value in layout.items():
        assert getattr(mb, name) == value, name
    assert mb.OFF_ERRMSG + mb.ERRMSG_SIZE == mb.MAILBOX_FRAME_SIZE
    names = [
        "IDLE",
        "TASK_READY",
        "TASK_DONE",
        "SHUTDOWN",
        "CONTROL_REQUEST",
        "CONTROL_DONE",
        "INIT_READY",
        "INIT_FAILED",
        "FRAME_STAGED",
        "TASK_LAUNCHED",
        "TASK_FAILED",
        "ACTIVATE",
        "PREPARE_READY",
    ]
    assert {n: i for i, n in enumerate(names)} == mb.STATES
    for n, v in mb.STATES.items():
        assert getattr(mb, "STATE_" + n) == v


# --------------------------------------------------------------------------- atomics


@pytest.mark.parametrize("kind", ["mmap", "bytearray", "memoryview"])
def test_atomics_on_every_buffer_kind(kind: str) -> None:
    raw = bytearray(64)
    buf: mmap.mmap | bytearray | memoryview
    if kind == "mmap":
        buf = mmap.mmap(-1, 64)
    elif kind == "bytearray":
        buf = raw
    else:
        buf = memoryview(raw)
    mb.store32(buf, 8, 0x1234)
    assert mb.load32(buf, 8) == 0x1234
    mb.store64(buf, 16, 2**63 + 5)
    assert mb.load64(buf, 16) == 2**63 + 5
    if kind != "mmap":
        assert raw[8:12] == struct.pack("<i", 0x1234)
        assert raw[16:24] == struct.pack("<Q", 2**63 + 5)
    if isinstance(buf, memoryview):
        buf.release()
    elif isinstance(buf, mmap.mmap):
        buf.close()


def test_load_store32_signed_and_bit_patterns(box: mmap.mmap) -> None:
    mb.store32(box, 4, -1)
    assert mb.load32(box, 4) == -1
    mb.store32(box, 4, 2**32 - 1)
    assert mb.load32(box, 4) == -1
    mb.store32(box, 4, 2**31)
    assert mb.load32(box, 4) == -(2**31)
    mb.store32(box, 4, -(2**31))
    assert mb.load32(box, 4) == -(2**31)
    mb.store32(box, 4, 2**31 - 1)
    assert mb.load32(box, 4) == 2**31 - 1
    for bad in (2**32, -(2**31) - 1, 2**40):
        with pytest.raises(OverflowError):
            mb.store32(box, 4, bad)
    with pytest.raises(TypeError):
        mb.store32(box, 4, 1.5)  # type: ignore[arg-type]


def test_load_store64_unsigned(box: mmap.mmap) -> None:
    mb.store64(box, 8, 2**64 - 1)
    assert mb.load64(box, 8) == 2**64 - 1
    mb.store64(box, 8, -1)
    assert mb.load64(box, 8) == 2**64 - 1
    mb.store64(box, 8, 0)
    assert mb.load64(box, 8) == 0
    for bad in (2**64, -(2**63) - 1):
        with pytest.raises(OverflowError):
            mb.store64(box, 8, bad)


def test_cas32(box: mmap.mmap) -> None:
    mb.store32(box, 0, 5)
    assert mb.cas32(box, 0, 5, 6) is True
    assert mb.load32(box, 0) == 6
    assert mb.cas32(box, 0, 5, 7) is False
    assert mb.load32(box, 0) == 6
    mb.store32(box, 0, -1)
    assert mb.cas32(box, 0, 2**32 - 1, 0) is True  # bit-pattern equal
    assert mb.load32(box, 0) == 0
    with pytest.raises(OverflowError):
        mb.cas32(box, 0, 0, 2**33)


def test_cas64(box: mmap.mmap) -> None:
    mb.store64(box, 8, 2**60)
    assert mb.cas64(box, 8, 2**60, 2**64 - 2) is True
    assert mb.load64(box, 8) == 2**64 - 2
    assert mb.cas64(box, 8, 2**60, 1) is False
    assert mb.load64(box, 8) == 2**64 - 2


def test_fetch_add(box: mmap.mmap) -> None:
    mb.store32(box, 0, 10)
    assert mb.fetch_add32(box, 0, 5) == 10
    assert mb.fetch_add32(box, 0, -20) == 15
    assert mb.load32(box, 0) == -5
    mb.store32(box, 0, 2**31 - 1)
    assert mb.fetch_add32(box, 0, 1) == 2**31 - 1
    assert mb.load32(box, 0) == -(2**31)  # wraps

    mb.store64(box, 8, 2**64 - 1)
    assert mb.fetch_add64(box, 8, 1) == 2**64 - 1
    assert mb.load64(box, 8) == 0
    assert mb.fetch_add64(box, 8, -1) == 0
    assert mb.load64(box, 8) == 2**64 - 1


def test_fence() -> None:
    mb.fence()
    mb.fence()


ATOMIC_CALLS: list[tuple[str, int, Callable[[mmap.mmap, int], object]]] = [
    ("load32", 4, lambda b, o: mb.load32(b, o)),
    ("store32", 4, lambda b, o: mb.store32(b, o, 1)),
    ("cas32", 4, lambda b, o: mb.cas32(b, o, 0, 1)),
    ("fetch_add32", 4, lambda b, o: mb.fetch_add32(b, o, 1)),
    ("futex_wake", 4, lambda b, o: mb.futex_wake(b, o, 1)),
    ("futex_wait", 4, lambda b, o: mb.futex_wait(b, o, 12345, 0.0)),
    ("spin_wait", 4, lambda b, o: mb.spin_wait(b, [o], [0], 1)),
    ("load64", 8, lambda b, o: mb.load64(b, o)),
    ("store64", 8, lambda b, o: mb.store64(b, o, 1)),
    ("cas64", 8, lambda b, o: mb.cas64(b, o, 0, 1)),
    ("fetch_add64", 8, lambda b, o: mb.fetch_add64(b, o, 1)),
]


@pytest.mark.parametrize(("name", "width", "call"), ATOMIC_CALLS, ids=[c[0] for c in ATOMIC_CALLS])
def test_atomic_bounds_and_alignment(
    name: str, width: int, call: Callable[[mmap.mmap, int], object]
) -> None:
    m = mmap.mmap(-1, 64)
    try:
        call(m, 64 - width)  # last word is fine
        with pytest.raises(
            IndexError,
            match=rf"^offset 64 out of range for {width}-byte word in buffer of 64 bytes$",
        ):
            call(m, 64)
        with pytest.raises(IndexError, match=r"offset -4 out of range"):
            call(m, -4)
        with pytest.raises(IndexError):
            call(m, 61)
        with pytest.raises(IndexError):
            call(m, 2**70)
        with pytest.raises(ValueError, match=rf"^offset 2 is not {width}-byte aligned$"):
            call(m, 2)
        if width == 8:
            with pytest.raises(ValueError, match=r"^offset 4 is not 8-byte aligned$"):
                call(m, 4)
    finally:
        m.close()


def test_misaligned_memoryview_base() -> None:
    raw = bytearray(64)
    view = memoryview(raw)[1:]  # base address is raw+1
    with pytest.raises(ValueError, match=r"^offset 0 is not 4-byte aligned$"):
        mb.load32(view, 0)
    with pytest.raises(ValueError, match=r"^offset 4 is not 4-byte aligned$"):
        mb.load32(view, 4)
    mb.store32(view, 3, 9)  # address raw+4 is aligned
    assert struct.unpack_from("<i", raw, 4)[0] == 9
    view.release()


def test_non_writable_buffers_rejected() -> None:
    with pytest.raises((TypeError, BufferError)):
        mb.load32(bytes(8), 0)
    with pytest.raises((TypeError, BufferError)):
        mb.store32(memoryview(bytearray(8)).toreadonly(), 0, 1)
    with pytest.raises(TypeError):
        mb.load32("abcd", 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        mb.load32(bytearray(8), 1.0)  # type: ignore[arg-type]


def test_buffer_released_after_errors() -> None:
    raw = bytearray(16)
    for call in (
        lambda: mb.load32(raw, 100),
        lambda: mb.load64(raw, 4),
        lambda: mb.store32(raw, 0, 2**40),
        lambda: mb.spin_wait(raw, [100], [0], 1),
        lambda: mb.read_task(raw, 0),
        lambda: mb.read_bytes(raw, 10, 10),
    ):
        with pytest.raises((IndexError, ValueError, OverflowError)):
            call()
    raw.extend(b"x")  # would raise BufferError if an export leaked
    assert len(raw) == 17


# --------------------------------------------------------------------------- futex


def test_futex_wait_value_mismatch(box: mmap.mmap) -> None:
    mb.store32(box, 0, 3)
    assert mb.futex_wait(box, 0, 4, 1.0) == 2


def test_futex_wait_timeout(box: mmap.mmap) -> None:
    t0 = time.monotonic()
    assert mb.futex_wait(box, 0, 0, 0.05) == 1
    assert 0.04 <= time.monotonic() - t0 < 1.0
    assert mb.futex_wait(box, 0, 0, 0) == 1


def test_futex_wait_bad_timeout(box: mmap.mmap) -> None:
    with pytest.raises(ValueError):
        mb.futex_wait(box, 0, 0, -1.0)
    with pytest.raises(ValueError):
        mb.futex_wait(box, 0, 0, float("nan"))
    with pytest.raises(TypeError):
        mb.futex_wait(box, 0, 0, "1")  # type: ignore[arg-type]


def test_futex_wake_nobody(box: mmap.mmap) -> None:
    assert mb.futex_wake(box, 0, 1) == 0
    with pytest.raises(ValueError):
        mb.futex_wake(box, 0, -1)


def test_futex_wait_woken_by_thread(box: mmap.mmap) -> None:
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(mb.futex_wait(box, 0, 0, timeout=5.0)))
    t.start()
    woken = 0
    deadline = time.monotonic() + 2.0
    while woken == 0 and time.monotonic() < deadline:
        woken = mb.futex_wake(box, 0, 1)
        if woken == 0:
            time.sleep(0.001)
    t.join(2.0)
    assert woken == 1
    assert result == [0]


def _interrupt_main_after(delay: float) -> threading.Timer:
    main = threading.main_thread().ident
    assert main is not None and main == threading.get_ident()
    timer = threading.Timer(delay, signal.pthread_kill, (main, signal.SIGUSR1))
    timer.start()
    return timer


def test_futex_wait_eintr_propagates_signal_exception(box: mmap.mmap) -> None:
    class Boom(Exception):
        pass

    def handler(signum: int, frame: object) -> None:
        raise Boom

    old = signal.signal(signal.SIGUSR1, handler)
    timer = _interrupt_main_after(0.05)
    try:
        with pytest.raises(Boom):
            mb.futex_wait(box, 0, 0, 2.0)
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, old)


def test_futex_wait_eintr_returns_3(box: mmap.mmap) -> None:
    hits: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: hits.append(signum))
    timer = _interrupt_main_after(0.05)
    try:
        assert mb.futex_wait(box, 0, 0, 2.0) == 3
        assert hits == [signal.SIGUSR1]
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, old)


def test_child_wait_eintr_propagates_signal_exception(box: mmap.mmap) -> None:
    class Boom(Exception):
        pass

    def handler(signum: int, frame: object) -> None:
        raise Boom

    old = signal.signal(signal.SIGUSR1, handler)
    timer = _interrupt_main_after(0.05)
    try:
        with pytest.raises(Boom):
            mb.child_wait(box, [0], [0], 0, 2.0)
        assert mb.load32(box, mb.OFF_CHILD_PARKED) == 0
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, old)


# --------------------------------------------------------------------------- spin_wait


def test_spin_wait_immediate_and_budget(box: mmap.mmap) -> None:
    mb.store32(box, 8, 1)
    assert mb.spin_wait(box, [0, 4, 8], [0, 0, 0], 10) == 2
    assert mb.spin_wait(box, [0, 4, 8], [0, 0, 1], 1000) == -1
    assert mb.spin_wait(box, [0], [0], 0) == -1
    assert mb.spin_wait(box, [8], [0], 0) == 0
    assert mb.spin_wait(box, (0, 8), (0, 2**32 - 1), 5) == 1


def test_spin_wait_argument_errors(box: mmap.mmap) -> None:
    with pytest.raises(ValueError):
        mb.spin_wait(box, [], [], 1)
    with pytest.raises(ValueError):
        mb.spin_wait(box, list(range(0, 36, 4)), [0] * 9, 1)
    with pytest.raises(ValueError):
        mb.spin_wait(box, [0, 4], [0], 1)
    with pytest.raises(ValueError):
        mb.spin_wait(box, [0], [0], -1)
    with pytest.raises(IndexError):
        mb.spin_wait(box, [0, mb.MAILBOX_SIZE], [0, 0], 1)
    with pytest.raises(ValueError, match="not 4-byte aligned"):
        mb.spin_wait(box, [0, 6], [0, 0], 1)
    with pytest.raises(TypeError):
        mb.spin_wait(box, 0, [0], 1)  # type: ignore[arg-type]


def test_spin_wait_sees_change_from_thread(box: mmap.mmap) -> None:
    def writer() -> None:
        time.sleep(0.02)
        mb.store32(box, 12, 42)

    t = threading.Thread(target=writer)
    t.start()
    try:
        r = -1
        deadline = time.monotonic() + 2.0
        while r < 0 and time.monotonic() < deadline:
            r = mb.spin_wait(box, [0, 12], [0, 0], 1_000_000)
        assert r == 1
    finally:
        t.join(2.0)


# --------------------------------------------------------------------------- child_wait / wake_child (same process)


def test_child_wait_returns_changed_index_without_parking(box: mmap.mmap) -> None:
    mb.store32(box, FRAME, 1)
    assert mb.child_wait(box, [0, FRAME], [0, 0], 1000, 1.0) == 1
    assert mb.load32(box, mb.OFF_CHILD_PARKED) == 0


def test_child_wait_times_out(box: mmap.mmap) -> None:
    seq = mb.load32(box, mb.OFF_WAKE_SEQ)
    t0 = time.monotonic()
    assert mb.child_wait(box, [0], [0], 10_000, 0.05) == -1
    assert time.monotonic() - t0 < 1.0
    assert mb.load32(box, mb.OFF_CHILD_PARKED) == 0
    assert mb.load32(box, mb.OFF_WAKE_SEQ) == seq


def test_child_wait_argument_errors(box: mmap.mmap) -> None:
    with pytest.raises(ValueError):
        mb.child_wait(box, [0], [0], 0, -1.0)
    with pytest.raises(ValueError):
        mb.child_wait(box, [0], [0], -1, 1.0)
    with pytest.raises(IndexError):
        mb.child_wait(bytearray(1024), [0], [0], 0, 0.0)


def test_wake_child_not_parked(box: mmap.mmap) -> None:
    assert mb.wake_child(box) is False
    assert mb.load32(box, mb.OFF_WAKE_SEQ) == 0
    with pytest.raises(IndexError):
        mb.wake_child(bytearray(100))


def test_child_wait_woken_by_thread(box: mmap.mmap) -> None:
    result: list[int] = []
    t = threading.Thread(
        target=lambda: result.append(mb.child_wait(box, [0, FRAME], [0, 0], 0, 5.0))
    )
    t.start()
    try:
        deadline = time.monotonic() + 2.0
        while mb.load32(box, mb.OFF_CHILD_PARKED) == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert mb.load32(box, mb.OFF_CHILD_PARKED) == 1
        mb.store32(box, FRAME, mb.STATE_TASK_READY)
        assert mb.wake_child(box) is True
    finally:
        t.join(2.0)
    assert result == [1]
    assert mb.load32(box, mb.OFF_CHILD_PARKED) == 0
    assert mb.load32(box, mb.OFF_WAKE_SEQ) == 1


# --------------------------------------------------------------------------- bulk helpers


@pytest.mark.parametrize("frame_off", [0, FRAME, 2 * FRAME])
def test_publish_read_task_round_trip(box: mmap.mmap, frame_off: int) -> None:
    blob = make_blob(3, 4)
    publish(box, frame_off, blob=blob + b"trailing garbage", config=b"\x01" * 10)
    assert mb.load32(box, frame_off + mb.OFF_STATE) == mb.STATE_TASK_READY
    task = mb.read_task(box, frame_off)
    config, slot_id, gen, digest, got_blob, protocol, run_id, t_slot, t_gen, dispatch = task
    assert config == b"\x01" * 10 + bytes(mb.CONFIG_SIZE - 10)
    assert (slot_id, gen) == (7, 2**40 + 3)
    assert digest == DIGEST
    assert got_blob == blob
    assert (protocol, run_id, t_slot, t_gen, dispatch) == (1, 99, 7, 2**40 + 3, 2**64 - 1)
    assert mb.read_trailer(box, frame_off) == (1, 99, 7, 2**40 + 3, 2**64 - 1)
    assert mb.load32(box, frame_off + mb.OFF_LEASE + 4) == 0

    res = mb.read_result(box, frame_off)
    assert res == (mb.STATE_TASK_READY, 0, "", 0, 0, 1, 99, 7, 2**40 + 3, 2**64 - 1)

    mb.store32(box, frame_off + mb.OFF_ACCEPTED, 1)
    mb.store32(box, frame_off + mb.OFF_DISPOSITION, -3)
    mb.write_result(box, frame_off, mb.STATE_TASK_FAILED, -22, "bad thing")
    res = mb.read_result(box, frame_off)
    assert res[:5] == (mb.STATE_TASK_FAILED, -22, "bad thing", 1, -3)

    # The child returns the frame to IDLE; the next publication clears results.
    mb.store32(box, frame_off + mb.OFF_STATE, mb.STATE_IDLE)
    publish(box, frame_off, blob=make_blob(0, 0), config=b"", dispatch_id=5)
    res = mb.read_result(box, frame_off)
    assert res == (mb.STATE_TASK_READY, 0, "", 0, 0, 1, 99, 7, 2**40 + 3, 5)
    assert mb.read_task(box, frame_off)[4] == make_blob(0, 0)
    assert mb.read_task(box, frame_off)[0] == bytes(mb.CONFIG_SIZE)


def test_publish_full_capacity_blob(box: mmap.mmap) -> None:
    # 8 + T*168 + S*8 == 64080 exactly: 8 + 381*168 = 64016, + 8*8 = 64080
    blob = make_blob(381, 8)
    assert len(blob) == mb.MAILBOX_ARGS_CAPACITY
    publish(box, FRAME, blob=blob, config=b"c" * mb.CONFIG_SIZE)
    got = mb.read_task(box, FRAME)
    assert got[4] == blob
    assert got[0] == b"c" * mb.CONFIG_SIZE


def test_publish_size_errors(box: mmap.mmap) -> None:
    with pytest.raises(
        ValueError, match=r"^args blob of 64081 bytes exceeds mailbox capacity of 64080 bytes$"
    ):
        publish(box, blob=bytes(mb.MAILBOX_ARGS_CAPACITY + 1))
    with pytest.raises(ValueError, match="config"):
        publish(box, config=bytes(mb.CONFIG_SIZE + 1))
    with pytest.raises(ValueError, match="digest"):
        publish(box, digest=bytes(31))
    with pytest.raises(ValueError, match="digest"):
        publish(box, digest=bytes(33))
    with pytest.raises(OverflowError):
        publish(box, slot_id=2**32)
    with pytest.raises(OverflowError):
        publish(box, generation=-1)
    with pytest.raises(OverflowError):
        publish(box, dispatch_id=2**64)
    with pytest.raises(TypeError):
        publish(box, blob="not bytes")  # type: ignore[arg-type]
    # Nothing was written by any refused call.
    assert mb.load32(box, 0) == mb.STATE_IDLE
    assert mb.read_bytes(box, 0, mb.MAILBOX_FRAME_SIZE) == bytes(mb.MAILBOX_FRAME_SIZE)


def test_publish_accepts_any_bytes_like(box: mmap.mmap) -> None:
    publish(
        box,
        config=bytearray(b"xy"),
        digest=memoryview(DIGEST),
        blob=memoryview(bytearray(make_blob(1, 1))),
    )
    got = mb.read_task(box, 0)
    assert got[0][:2] == b"xy"
    assert got[3] == DIGEST
    assert got[4] == make_blob(1, 1)


def test_publish_refuses_non_idle_frame(box: mmap.mmap) -> None:
    publish(box, FRAME)
    before = mb.read_bytes(box, FRAME, FRAME)
    with pytest.raises(ValueError, match=r"^frame is not idle \(state 1\)$"):
        publish(box, FRAME, dispatch_id=1234)
    assert mb.read_bytes(box, FRAME, FRAME) == before
    mb.store32(box, FRAME, mb.STATE_TASK_DONE)
    with pytest.raises(ValueError, match=r"frame is not idle \(state 2\)"):
        publish(box, FRAME)


def test_frame_offset_errors(box: mmap.mmap) -> None:
    for fn in (mb.read_task, mb.read_trailer, mb.read_result):
        with pytest.raises(ValueError):
            fn(box, 100)
        with pytest.raises(IndexError):
            fn(box, 3 * FRAME)
        with pytest.raises(IndexError):
            fn(box, -FRAME)
        with pytest.raises(IndexError):
            fn(bytearray(1000), 0)
    with pytest.raises(ValueError):
        publish(box, 8)
    with pytest.raises(IndexError):
        publish(box, 3 * FRAME)
    with pytest.raises(ValueError):
        mb.write_result(box, 4, 2, 0, "")
    with pytest.raises(IndexError):
        mb.write_result(box, 3 * FRAME, 2, 0, "")
    # A single-frame buffer is a valid mailbox for frame 0 only.
    one = bytearray(FRAME)
    publish(one, 0)
    assert mb.read_trailer(one, 0)[4] == 2**64 - 1
    with pytest.raises(IndexError):
        mb.read_trailer(one, FRAME)


@pytest.mark.parametrize(
    ("t", "s"),
    [(-1, 0), (0, -1), (381, 9), (382, 0), (0, 8010), (2**31 - 1, 2**31 - 1)],
)
def test_read_task_malformed_header(box: mmap.mmap, t: int, s: int) -> None:
    mb.write_bytes(box, mb.OFF_ARGS, struct.pack("<ii", t, s))
    need = 8 + t * 168 + s * 8
    with pytest.raises(
        ValueError,
        match=rf"^malformed args blob: T={t} S={s} needs {need} bytes, capacity 64080$",
    ):
        mb.read_task(box, 0)


def test_publish_short_blob_clears_header(box: mmap.mmap) -> None:
    mb.write_bytes(box, mb.OFF_ARGS, struct.pack("<ii", 5, 5))
    publish(box, blob=b"")
    assert mb.read_task(box, 0)[4] == make_blob(0, 0)


def _utf8_prefix(s: str, limit: int) -> str:
    out = ""
    for c in s:
        if len((out + c).encode()) > limit:
            break
        out += c
    return out


def test_write_result_utf8_truncation(box: mmap.mmap) -> None:
    # 254 ASCII bytes + a 2-byte char: the char would straddle byte 255 -> dropped.
    msg = "a" * 254 + "é" + "tail"
    mb.write_result(box, 0, mb.STATE_TASK_FAILED, 1, msg)
    state, error, text, *_ = mb.read_result(box, 0)
    assert (state, error) == (mb.STATE_TASK_FAILED, 1)
    assert text == "a" * 254
    assert mb.read_bytes(box, mb.OFF_ERRMSG + 254, 1) == b"\0"

    # 3-byte and 4-byte sequences straddling the boundary.
    for prefix_len, ch in ((253, "€"), (254, "€"), (252, "😀"), (253, "😀"), (254, "😀")):
        msg = "b" * prefix_len + ch * 3
        mb.write_result(box, 0, mb.STATE_TASK_FAILED, 1, msg)
        assert mb.read_result(box, 0)[2] == _utf8_prefix(msg, 255)
        assert mb.read_result(box, 0)[2] == "b" * prefix_len + ch * (
            (255 - prefix_len) // len(ch.encode())
        )

    # A character that ends exactly at byte 255 is kept.
    msg = "c" * 253 + "é" + "more"
    mb.write_result(box, 0, 2, 0, msg)
    assert mb.read_result(box, 0)[2] == "c" * 253 + "é"

    # Exactly 255 ASCII bytes fit; short messages are untouched.
    mb.write_result(box, 0, 2, 0, "z" * 300)
    assert mb.read_result(box, 0)[2] == "z" * 255
    mb.write_result(box, 0, 2, 0, "ok ✓")
    assert mb.read_result(box, 0)[2] == "ok ✓"


def test_write_result_bytes_and_odd_input(box: mmap.mmap) -> None:
    mb.write_result(box, FRAME, mb.STATE_TASK_DONE, 0, b"raw \xff bytes")
    assert mb.read_result(box, FRAME)[2] == "raw \ufffd bytes"
    mb.write_result(box, FRAME, mb.STATE_TASK_DONE, 0, "lone \udcff surrogate")
    assert mb.read_result(box, FRAME)[2] == "lone \\udcff surrogate"
    mb.write_result(box, FRAME, mb.STATE_TASK_DONE, 0, "")
    assert mb.read_result(box, FRAME)[2] == ""
    with pytest.raises(TypeError):
        mb.write_result(box, FRAME, mb.STATE_TASK_DONE, 0, 12)  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        mb.write_result(box, FRAME, 2**32, 0, "")


def test_read_result_unterminated_message(box: mmap.mmap) -> None:
    mb.write_bytes(box, mb.OFF_ERRMSG, b"x" * mb.ERRMSG_SIZE)
    assert mb.read_result(box, 0)[2] == "x" * mb.ERRMSG_SIZE


def test_read_write_bytes(box: mmap.mmap) -> None:
    mb.write_bytes(box, 3, b"hello")
    assert mb.read_bytes(box, 3, 5) == b"hello"
    assert mb.read_bytes(box, 0, 0) == b""
    mb.write_bytes(box, mb.MAILBOX_SIZE - 2, bytearray(b"zz"))
    assert mb.read_bytes(box, mb.MAILBOX_SIZE - 2, 2) == b"zz"
    with pytest.raises(IndexError):
        mb.read_bytes(box, mb.MAILBOX_SIZE - 1, 2)
    with pytest.raises(IndexError):
        mb.read_bytes(box, -1, 1)
    with pytest.raises(ValueError):
        mb.read_bytes(box, 0, -1)
    with pytest.raises(IndexError):
        mb.write_bytes(box, mb.MAILBOX_SIZE - 1, b"ab")
    with pytest.raises((TypeError, BufferError)):
        mb.write_bytes(b"immutable", 0, b"x")


def test_set_pdeathsig() -> None:
    # Harmless in the test process: restore "no signal" right away.
    mb.set_pdeathsig(0)
    with pytest.raises(OSError):
        mb.set_pdeathsig(10_000)
    with pytest.raises(OSError):
        mb.set_pdeathsig(-1)


# --------------------------------------------------------------------------- cross-process


def _run_child(body: Callable[[], int]) -> int:
    """Fork; run body() in the child and _exit with its code. Returns the pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 99
        try:
            code = body()
        except BaseException:
            code = 98
        finally:
            os._exit(code)
    return pid


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # pragma: no cover - already gone
        pass


def _reap(pid: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            _kill(pid)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.001)


def _spin_until(buf: mmap.mmap, off: int, old: int, deadline: float) -> int:
    """Wait (spin_wait, yielding between budgets) until the word at off != old."""
    while mb.spin_wait(buf, [off], [old], 256) < 0:
        if time.monotonic() > deadline:
            raise TimeoutError(off)
        os.sched_yield()
    return mb.load32(buf, off)


def _payload(i: int) -> int:
    return (i * 0x9E3779B97F4A7C15) & (2**64 - 1)


@pytest.mark.timeout(30)
def test_cross_process_payload_visibility() -> None:
    iterations = 20_000
    seq_off = mb.OFF_STATE
    ack_off = mb.OFF_ACCEPTED
    payload_off = mb.OFF_TRAILER
    ok_off = mb.OFF_DISPOSITION
    buf = mmap.mmap(-1, mb.MAILBOX_SIZE)

    def child() -> int:
        deadline = time.monotonic() + 20.0
        seen = 0
        for i in range(1, iterations + 1):
            cur = _spin_until(buf, seq_off, i - 1, deadline)
            if cur != i:
                return 3
            if mb.load64(buf, payload_off) == _payload(i):
                seen += 1
            mb.store32(buf, ok_off, seen)
            mb.store32(buf, ack_off, i)
        return 0 if seen == iterations else 1

    pid = _run_child(child)
    code = -1
    try:
        deadline = time.monotonic() + 20.0
        for i in range(1, iterations + 1):
            mb.store64(buf, payload_off, _payload(i))
            mb.store32(buf, seq_off, i)
            _spin_until(buf, ack_off, i - 1, deadline)
            assert mb.load32(buf, ok_off) == i, f"iteration {i} missed the payload"
        assert mb.load32(buf, ack_off) == iterations
    except BaseException:
        _kill(pid)
        raise
    finally:
        code = _reap(pid)
        buf.close()
    assert code == 0


@pytest.mark.timeout(30)
def test_cross_process_child_wait_woken_by_wake_child() -> None:
    buf = mmap.mmap(-1, mb.MAILBOX_SIZE)
    result_off = mb.OFF_RESERVED  # child reports child_wait's return value here

    def child() -> int:
        r = mb.child_wait(buf, [mb.OFF_SHUTDOWN, FRAME + mb.OFF_STATE], [0, 0], 0, 10.0)
        mb.store64(buf, result_off, r + 100)
        return 0

    pid = _run_child(child)
    code = -1
    try:
        deadline = time.monotonic() + 5.0
        while mb.load32(buf, mb.OFF_CHILD_PARKED) == 0:
            assert time.monotonic() < deadline, "child never parked"
            time.sleep(0.001)
        time.sleep(0.02)  # let it reach FUTEX_WAIT
        mb.store32(buf, FRAME + mb.OFF_STATE, mb.STATE_TASK_READY)
        assert mb.wake_child(buf) is True
    except BaseException:
        _kill(pid)
        raise
    finally:
        code = _reap(pid)
    try:
        assert code == 0
        assert mb.load64(buf, result_off) == 101
        assert mb.load32(buf, mb.OFF_CHILD_PARKED) == 0
        assert mb.load32(buf, mb.OFF_WAKE_SEQ) == 1
    finally:
        buf.close()


@pytest.mark.timeout(30)
def test_cross_process_publish_task_wakes_parked_child() -> None:
    buf = mmap.mmap(-1, mb.MAILBOX_SIZE)
    frame_off = 2 * FRAME
    blob = make_blob(2, 5, fill=0x5A)

    def child() -> int:
        r = mb.child_wait(buf, [frame_off + mb.OFF_STATE], [mb.STATE_IDLE], 0, 10.0)
        if r != 0:
            return 10
        task = mb.read_task(buf, frame_off)
        if task[4] != blob or task[3] != DIGEST or task[9] != 77:
            mb.write_result(buf, frame_off, mb.STATE_TASK_FAILED, 1, "mismatch")
            return 0
        mb.store32(buf, frame_off + mb.OFF_ACCEPTED, 1)
        mb.write_result(buf, frame_off, mb.STATE_TASK_DONE, 0, f"done {len(task[4])} ✓")
        return 0

    pid = _run_child(child)
    code = -1
    try:
        deadline = time.monotonic() + 5.0
        while mb.load32(buf, mb.OFF_CHILD_PARKED) == 0:
            assert time.monotonic() < deadline, "child never parked"
            time.sleep(0.001)
        publish(buf, frame_off, blob=blob, dispatch_id=77)
        state = _spin_until(buf, frame_off + mb.OFF_STATE, mb.STATE_TASK_READY, deadline)
        assert state == mb.STATE_TASK_DONE
        res = mb.read_result(buf, frame_off)
        assert res[:5] == (mb.STATE_TASK_DONE, 0, f"done {len(blob)} ✓", 1, 0)
        assert res[9] == 77
    except BaseException:
        _kill(pid)
        raise
    finally:
        code = _reap(pid)
        buf.close()
    assert code == 0


# -- sub_pump: the SUB fast loop (every SUB lane polled and published in one C call) ---------------

READY = object()
TASK0 = FRAME  # task frame 0
TASK1 = 2 * FRAME  # task frame 1: a SUB child's queue frame


class FakeSlot:
    """The attributes sub_pump reads from a TaskSlot."""

    __slots__ = (
        "blobs",
        "config_bytes",
        "digest",
        "group_size",
        "lease_generation",
        "lease_slot",
        "run_id",
        "slot_id",
        "state",
    )

    def __init__(self, slot_id: int, *, state: object = READY, group_size: int = 1) -> None:
        self.slot_id = slot_id
        self.run_id = 5
        self.lease_slot = 1
        self.lease_generation = 9
        self.digest = DIGEST
        self.config_bytes = b"cfg"
        self.blobs = [make_blob(0, 1)]
        self.group_size = group_size
        self.state = state


def lane(buf: mmap.mmap, next_did: int = 1, frame: int = TASK0, peer: int = -1) -> list[Any]:
    return [buf, frame, None, 0, next_did, 0, 0, [], peer]


def child_done(
    buf: mmap.mmap,
    *,
    error: int = 0,
    result: bytes = b"",
    reserved: int | None = None,
    dispatch_id: int | None = None,
) -> None:
    """What a SUB child does at the end of a task (``dispatch_id``: a stale trailer)."""
    if dispatch_id is not None:
        mb.store64(buf, TASK0 + mb.OFF_TRAILER + 32, dispatch_id)
    mb.store32(buf, TASK0 + mb.OFF_ERROR, error)
    if result:
        mb.write_bytes(buf, TASK0 + mb.OFF_ARGS, result)
    mb.store64(buf, TASK0 + mb.OFF_RESERVED, len(result) if reserved is None else reserved)
    mb.store32(buf, TASK0 + mb.OFF_STATE, mb.STATE_TASK_DONE)


@pytest.fixture
def boxes() -> Iterator[list[mmap.mmap]]:
    ms = [mmap.mmap(-1, mb.MAILBOX_SIZE) for _ in range(2)]
    try:
        yield ms
    finally:
        for m in ms:
            m.close()


def test_sub_pump_publishes_one_task_per_idle_lane(boxes: list[mmap.mmap]) -> None:
    from collections import deque

    slots = [FakeSlot(i) for i in range(1, 4)]
    q: deque[FakeSlot] = deque(slots)
    lanes = [lane(boxes[0], 10), lane(boxes[1], 20)]
    published: list[object] = []
    assert mb.sub_pump(lanes, q, READY, published, 0, 100) == 2
    assert published == slots[:2] and list(q) == [slots[2]]
    for box, ln, slot, did in (
        (boxes[0], lanes[0], slots[0], 10),
        (boxes[1], lanes[1], slots[1], 20),
    ):
        assert ln[2] is slot and ln[3] == did and ln[4] == did + 1 and ln[5] > 0 and ln[6] == 0
        assert mb.load32(box, TASK0) == mb.STATE_TASK_READY
        assert mb.read_trailer(box, TASK0) == (0x534C5231, 5, slot.slot_id, 9, did)
        task = mb.read_task(box, TASK0)
        assert task[0][:3] == b"cfg" and task[1] == 1 and task[2] == 9 and task[3] == DIGEST
        assert task[4] == slot.blobs[0]


def test_sub_pump_completes_and_publishes_the_next(boxes: list[mmap.mmap]) -> None:
    from collections import deque

    slots = [FakeSlot(i) for i in range(1, 4)]
    q: deque[FakeSlot] = deque(slots)
    lanes = [lane(boxes[0])]
    published: list[object] = []
    mb.sub_pump(lanes, q, READY, published, 0, 100)
    child_done(boxes[0])
    assert mb.sub_pump(lanes, q, READY, published, 0, 100) == 1
    assert lanes[0][7] == [slots[0]] and lanes[0][2] is slots[1] and lanes[0][3] == 2
    assert mb.read_trailer(boxes[0], TASK0)[4] == 2
    # A value: (slot, bytes) in completion order.
    child_done(boxes[0], result=b"\x93\x01\x02\x03")
    mb.sub_pump(lanes, q, READY, published, 0, 100)
    assert lanes[0][7][1] == (slots[1], b"\x93\x01\x02\x03")
    child_done(boxes[0])
    assert mb.sub_pump(lanes, q, READY, published, 0, 100) == 0
    assert lanes[0][2] is None and mb.load32(boxes[0], TASK0) == mb.STATE_IDLE
    assert published == slots and len(lanes[0][7]) == 3


@pytest.mark.parametrize(
    "finish",
    [
        lambda b: child_done(b, error=1),
        lambda b: child_done(b, reserved=mb.SUBPUMP_MAX_RESULT + 1),
        lambda b: child_done(b, dispatch_id=99),
        lambda b: mb.store32(b, TASK0 + mb.OFF_STATE, mb.STATE_TASK_FAILED),
    ],
    ids=["error", "oversized-result", "stale-trailer", "task-failed"],
)
def test_sub_pump_leaves_an_unusual_completion_to_python(
    boxes: list[mmap.mmap], finish: Callable[[mmap.mmap], object]
) -> None:
    from collections import deque

    slots = [FakeSlot(1), FakeSlot(2)]
    q: deque[FakeSlot] = deque(slots)
    lanes = [lane(boxes[0])]
    mb.sub_pump(lanes, q, READY, [], 0, 100)
    finish(boxes[0])
    state = mb.load32(boxes[0], TASK0)
    assert mb.sub_pump(lanes, q, READY, [], 0, 100) == 0
    assert lanes[0][6] == 1 and lanes[0][2] is slots[0] and lanes[0][7] == []
    assert mb.load32(boxes[0], TASK0) == state  # untouched: the Python path reads it
    assert list(q) == [slots[1]]


def test_sub_pump_publishes_nothing_after_a_completion_it_leaves_to_python(
    boxes: list[mmap.mmap],
) -> None:
    """A failure must reach the run before later tasks start: once a lane's completion
    needs the Python path, the call publishes nothing more, not even on a lane that
    freed up in the same pass."""
    from collections import deque

    slots = [FakeSlot(i) for i in range(1, 5)]
    q: deque[FakeSlot] = deque(slots)
    lanes = [lane(boxes[0]), lane(boxes[1])]
    published: list[object] = []
    assert mb.sub_pump(lanes, q, READY, published, 0, 100) == 2
    child_done(boxes[0], error=1)
    child_done(boxes[1])
    assert mb.sub_pump(lanes, q, READY, published, 10**9, 100) == 0
    assert lanes[0][6] == 1 and lanes[0][2] is slots[0]
    assert lanes[1][7] == [slots[1]] and lanes[1][2] is None and lanes[1][6] == 0
    assert list(q) == slots[2:] and mb.load32(boxes[1], TASK0) == mb.STATE_IDLE


def test_sub_pump_stops_at_a_head_it_does_not_take(boxes: list[mmap.mmap]) -> None:
    from collections import deque

    for head in (FakeSlot(1, state=object()), FakeSlot(1, group_size=2)):
        q: deque[FakeSlot] = deque([head, FakeSlot(2)])
        lanes = [lane(boxes[0]), lane(boxes[1])]
        assert mb.sub_pump(lanes, q, READY, [], 0, 100) == 0
        assert len(q) == 2 and lanes[0][2] is None and lanes[1][2] is None
    big = FakeSlot(1)
    big.blobs = [b"\0" * (mb.MAILBOX_ARGS_CAPACITY + 1)]
    q = deque([big])
    assert mb.sub_pump([lane(boxes[0])], q, READY, [], 0, 100) == 0 and len(q) == 1


def test_sub_pump_refuses_a_frame_that_is_not_idle(boxes: list[mmap.mmap]) -> None:
    from collections import deque

    mb.store32(boxes[0], TASK0, mb.STATE_TASK_DONE)
    q: deque[FakeSlot] = deque([FakeSlot(1)])
    lanes = [lane(boxes[0])]
    assert mb.sub_pump(lanes, q, READY, [], 0, 100) == 0
    assert lanes[0][6] == 2 and len(q) == 1 and lanes[0][2] is None


def test_sub_pump_max_publish_and_refcounts(boxes: list[mmap.mmap]) -> None:
    import sys
    from collections import deque

    slot = FakeSlot(1)
    base = sys.getrefcount(slot)
    for _ in range(200):
        q: deque[FakeSlot] = deque([slot, slot, slot])
        lanes = [lane(boxes[0]), lane(boxes[1])]
        published: list[object] = []
        assert mb.sub_pump(lanes, q, READY, published, 0, 1) == 1
        child_done(boxes[0], result=b"\xc0")
        mb.sub_pump(lanes, q, READY, published, 0, 0)
        assert lanes[0][7] == [(slot, b"\xc0")]
        del q, lanes, published
    assert sys.getrefcount(slot) == base


def pair(buf: mmap.mmap, first: int, next_did: int) -> list[list[Any]]:
    """The two task frames of one SUB child with a queue frame, at ``first`` in the list."""
    return [
        lane(buf, next_did, TASK0, peer=first + 1),
        lane(buf, next_did, TASK1, peer=first),
    ]


def test_sub_pump_fills_free_children_before_queueing_behind_busy_ones(
    boxes: list[mmap.mmap],
) -> None:
    """One pass: each free child gets a task in a frame, then a busy child's other frame
    gets the next one queued; a child's two frames share its dispatch counter."""
    from collections import deque

    slots = [FakeSlot(i) for i in range(1, 6)]
    q: deque[FakeSlot] = deque(slots)
    lanes = pair(boxes[0], 0, 10) + pair(boxes[1], 2, 20)
    published: list[object] = []
    assert mb.sub_pump(lanes, q, READY, published, 0, 100) == 4
    assert published == slots[:4] and list(q) == [slots[4]]
    a0, a1, b0, b1 = lanes
    assert (a0[2], a0[3], b0[2], b0[3]) == (slots[0], 10, slots[1], 20)
    assert (a1[2], a1[3], b1[2], b1[3]) == (slots[2], 11, slots[3], 21)  # queued
    assert a0[4] == a1[4] == 12 and b0[4] == b1[4] == 22
    assert mb.read_trailer(boxes[0], TASK1)[4] == 11
    assert mb.load32(boxes[0], TASK1) == mb.STATE_TASK_READY


def test_sub_pump_gives_a_free_child_the_task_before_a_queue_frame(
    boxes: list[mmap.mmap],
) -> None:
    from collections import deque

    busy, free = FakeSlot(1), FakeSlot(2)
    q: deque[FakeSlot] = deque([busy])
    lanes = pair(boxes[0], 0, 1) + pair(boxes[1], 2, 1)
    mb.sub_pump(lanes[:2], q, READY, [], 0, 100)  # child A runs `busy`
    q.append(free)
    assert mb.sub_pump(lanes, q, READY, [], 0, 100) == 1
    assert lanes[1][2] is None and lanes[2][2] is free  # child B, not A's queue frame


def test_sub_pump_queues_a_task_only_behind_one_of_its_own_run(boxes: list[mmap.mmap]) -> None:
    from collections import deque

    a, b = FakeSlot(1), FakeSlot(2)
    b.run_id = 6
    lanes = pair(boxes[0], 0, 1) + pair(boxes[1], 2, 1)
    mb.sub_pump(lanes, deque([a, b]), READY, [], 0, 100)  # A runs run 5's, B run 6's
    c = FakeSlot(3)
    c.run_id = 6
    q: deque[FakeSlot] = deque([c])
    assert mb.sub_pump(lanes, q, READY, [], 0, 100) == 1
    assert lanes[1][2] is None and lanes[3][2] is c  # behind B's task (run 6), not A's
    d = FakeSlot(4)
    d.run_id = 7
    q.append(d)
    assert mb.sub_pump(lanes, q, READY, [], 0, 100) == 0
    assert list(q) == [d] and lanes[1][2] is None  # no run 7 task to wait behind


def test_sub_pump_returns_after_a_pass_that_completed_another_runs_task(
    boxes: list[mmap.mmap],
) -> None:
    """A task of another run than the queue's, in flight when the call starts, may
    finish that run: the pass that completes it is the call's last, however long the
    call could go on (a child that ends every task at once, a spin of 2 s)."""
    import threading
    from collections import deque

    other, mine = FakeSlot(1), FakeSlot(2)
    other.run_id = 7
    lanes = [lane(boxes[0]), lane(boxes[1])]
    mb.sub_pump(lanes, deque([other, mine]), READY, [], 0, 100)  # lane 0: run 7, lane 1: 5
    child_done(boxes[0])
    stop = threading.Event()

    def child() -> None:  # lane 0's child: ends each task as soon as it is published
        while not stop.is_set():
            if mb.load32(boxes[0], TASK0) == mb.STATE_TASK_READY:
                child_done(boxes[0])

    helper = threading.Thread(target=child, daemon=True)
    helper.start()
    try:
        q: deque[FakeSlot] = deque(FakeSlot(i) for i in range(3, 8))
        published: list[object] = []
        assert mb.sub_pump(lanes, q, READY, published, 2 * 10**9, 100) == 1
    finally:
        stop.set()
        helper.join()
    assert lanes[0][7] == [other] and published == [lanes[0][2]] and len(q) == 4
    assert lanes[1][2] is mine and lanes[1][7] == []  # still in flight


def test_sub_pump_waits_for_a_claimed_frame_and_completes_both_in_order(
    boxes: list[mmap.mmap],
) -> None:
    """TASK_LAUNCHED (the child claimed its queue frame) is in flight, not an unusual
    state; the frames complete as the child ends them, and the freed frame is refilled."""
    from collections import deque

    box = boxes[0]
    slots = [FakeSlot(i) for i in range(1, 5)]
    q: deque[FakeSlot] = deque(slots)
    lanes = pair(box, 0, 1)
    mb.sub_pump(lanes, q, READY, [], 0, 100)
    assert mb.cas32(box, TASK0 + mb.OFF_STATE, mb.STATE_TASK_READY, mb.STATE_TASK_LAUNCHED)
    assert mb.sub_pump(lanes, q, READY, [], 0, 100) == 0
    assert lanes[0][6] == 0 and lanes[0][2] is slots[0] and lanes[1][2] is slots[1]
    child_done(box)  # frame 0 ends; the child claims frame 1
    assert mb.cas32(box, TASK1 + mb.OFF_STATE, mb.STATE_TASK_READY, mb.STATE_TASK_LAUNCHED)
    assert mb.sub_pump(lanes, q, READY, [], 0, 100) == 1
    assert lanes[0][7] == [slots[0]] and lanes[0][2] is slots[2] and lanes[0][3] == 3
    assert lanes[1][2] is slots[1] and lanes[1][6] == 0


def test_sub_pump_queues_nothing_behind_a_frame_it_leaves_to_python(
    boxes: list[mmap.mmap],
) -> None:
    from collections import deque

    box = boxes[0]
    slots = [FakeSlot(i) for i in range(1, 4)]
    q: deque[FakeSlot] = deque(slots[:1])
    lanes = pair(box, 0, 1)
    mb.sub_pump(lanes, q, READY, [], 0, 100)
    child_done(box, error=1)
    q.extend(slots[1:])
    assert mb.sub_pump(lanes, q, READY, [], 0, 100) == 0
    assert lanes[0][6] == 1 and lanes[1][2] is None and list(q) == slots[1:]


def test_sub_pump_rejects_malformed_lanes(boxes: list[mmap.mmap]) -> None:
    from collections import deque

    q: deque[FakeSlot] = deque([FakeSlot(1)])
    with pytest.raises(TypeError, match="lanes and published must be lists"):
        mb.sub_pump((lane(boxes[0]),), q, READY, [], 0, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lane 0 must be a list of 9 items"):
        mb.sub_pump([lane(boxes[0])[:8]], q, READY, [], 0, 1)
    with pytest.raises(ValueError, match="base frame carries no task"):
        mb.sub_pump([[boxes[0], 0, None, 0, 1, 0, 0, [], -1]], q, READY, [], 0, 1)
    with pytest.raises(IndexError):
        mb.sub_pump([[bytearray(100), TASK0, None, 0, 1, 0, 0, [], -1]], q, READY, [], 0, 1)
    with pytest.raises(TypeError, match="done must be a list"):
        mb.sub_pump([[boxes[0], TASK0, None, 0, 1, 0, 0, (), -1]], q, READY, [], 0, 1)
    # A peer must be the other frame of the same child, and name this one back.
    for lanes in (
        [lane(boxes[0], peer=0)],  # itself
        [lane(boxes[0], peer=1)],  # out of range
        [lane(boxes[0], peer=1), lane(boxes[0], frame=TASK1, peer=-1)],  # one-sided
        [lane(boxes[0], peer=1), lane(boxes[1], frame=TASK1, peer=0)],  # another child
    ):
        with pytest.raises(ValueError, match="not the other frame of its child"):
            mb.sub_pump(lanes, q, READY, [], 0, 1)
    with pytest.raises(ValueError, match="count must be >= 0"):
        mb.sub_pump([lane(boxes[0])], q, READY, [], -1, 1)
    with pytest.raises(AttributeError):
        mb.sub_pump([lane(boxes[0])], deque([object()]), READY, [], 0, 1)
    assert len(q) == 1 and mb.load32(boxes[0], TASK0) == mb.STATE_IDLE


def test_sub_pump_spins_through_a_real_child(boxes: list[mmap.mmap]) -> None:
    """A forked child serves tasks while the pump spins: one call runs them all."""
    from collections import deque

    box = boxes[0]
    n = 50
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            served = 0
            deadline = time.monotonic() + 20
            while served < n and time.monotonic() < deadline:
                if mb.load32(box, TASK0) == mb.STATE_TASK_READY:
                    child_done(box)
                    served += 1
        finally:
            os._exit(0)
    try:
        slots = [FakeSlot(i) for i in range(1, n + 1)]
        q: deque[FakeSlot] = deque(slots)
        lanes = [lane(box)]
        published: list[object] = []
        deadline = time.monotonic() + 20
        while (q or lanes[0][2] is not None) and time.monotonic() < deadline:
            mb.sub_pump(lanes, q, READY, published, 50_000_000, 1000)
        assert published == slots and lanes[0][7] == slots and lanes[0][6] == 0
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_sub_pump_waits_for_a_completion_without_the_gil(boxes: list[mmap.mmap]) -> None:
    """With nothing left to publish, a spinning call waits for the task in flight with
    the GIL released: a Python thread of this process can end the task meanwhile, and
    the same call completes it (holding the GIL, it would spin its whole budget)."""
    import threading
    from collections import deque

    slot = FakeSlot(1)
    q: deque[FakeSlot] = deque([slot])
    lanes = [lane(boxes[0])]
    published: list[object] = []
    assert mb.sub_pump(lanes, q, READY, published, 0, 100) == 1
    r, w = os.pipe()

    def finish() -> None:
        os.read(r, 1)  # blocks without the GIL; to go on it needs the GIL back
        child_done(boxes[0])

    t = threading.Thread(target=finish)
    t.start()
    try:
        os.write(w, b"x")
        # Empty queue, 60 s budget: only the thread's completion can end the call early.
        assert mb.sub_pump(lanes, q, READY, published, 60 * 10**9, 100) == 0
    finally:
        os.write(w, b"x")  # the thread never blocks for good, whatever failed
        t.join(10)
        os.close(r)
        os.close(w)
    assert lanes[0][7] == [slot] and lanes[0][2] is None and lanes[0][6] == 0
    assert mb.load32(boxes[0], TASK0) == mb.STATE_IDLE


def test_the_pumps_slot_fields_are_listed_at_both_ends() -> None:
    """The C pump reads TaskSlot attributes by name: the names in ``mb_pump_init``
    (``_mailbox_pump.c``) are ``runmodel.PUMP_SLOT_FIELDS``, and a real slot has each."""
    import re
    from pathlib import Path

    import simpler_daemon.mailbox as mailbox_pkg
    from simpler_daemon.scheduler.runmodel import PUMP_SLOT_FIELDS, TaskSlot

    source = (Path(mailbox_pkg.__file__).parent / "_mailbox_pump.c").read_text()
    table = source[source.index("mb_pump_init(void)") :]
    names = re.findall(r'\{&str_\w+, "(\w+)"\}', table)
    assert [n for n in names if n != "popleft"] == list(PUMP_SLOT_FIELDS)
    assert set(PUMP_SLOT_FIELDS) <= set(TaskSlot.__slots__)


def test_child_claim_takes_the_older_ready_frame_and_honours_hold(boxes: list[mmap.mmap]) -> None:
    """A SUB child's pick over its two task frames (a queue frame)."""
    box = boxes[0]
    assert mb.child_claim(box, 0) == 0  # nothing ready
    for frame, did in ((TASK0, 8), (TASK1, 7)):
        mb.store64(box, frame + mb.OFF_TRAILER + 32, did)
        mb.store32(box, frame + mb.OFF_STATE, mb.STATE_TASK_READY)
    assert mb.child_claim(box, 0) == TASK1  # the lower dispatch id, whatever its index
    assert mb.load32(box, TASK1) == mb.STATE_TASK_LAUNCHED
    mb.store32(box, TASK1 + mb.OFF_STATE, mb.STATE_TASK_DONE)
    assert mb.child_claim(box, TASK1) == -1  # held: frame 1's end is unread
    assert mb.load32(box, TASK0) == mb.STATE_TASK_READY
    mb.store32(box, TASK1 + mb.OFF_STATE, mb.STATE_IDLE)
    assert mb.child_claim(box, TASK1) == TASK0
    with pytest.raises(ValueError, match="hold 12 is not a task frame"):
        mb.child_claim(box, 12)


def test_child_take_stores_the_pickup_word_then_reads_what_read_task_reads(box: mmap.mmap) -> None:
    """A SUB child's read of its claimed task in one call: the pick-up word first, then
    the deadline (the config's first word), the digest and the blob read_task gives."""
    blob = b"\x00\x00\x00\x00\x02\x00\x00\x00" + (5).to_bytes(8, "little") + bytes(8)
    config = (1234).to_bytes(8, "little") + b"x" * 8
    digest = bytes(range(32))
    mb.publish_task(box, TASK1, 1, config, 0, 0, digest, blob, 1, 1, 1, 0, 1)
    assert mb.load32(box, TASK1 + mb.OFF_ACCEPTED) == 0
    got = mb.child_take(box, TASK1)
    assert got == (1234, digest, blob)
    assert got[2] == mb.read_task(box, TASK1)[4] and got[1] == mb.read_task(box, TASK1)[3]
    assert mb.load32(box, TASK1 + mb.OFF_ACCEPTED) == 1
    # A malformed header: ValueError, and the task counts as picked up (the child fails it).
    mb.store32(box, TASK0 + mb.OFF_ARGS + 4, 1 << 20)
    with pytest.raises(ValueError, match="malformed args blob: T=0 S=1048576"):
        mb.child_take(box, TASK0)
    assert mb.load32(box, TASK0 + mb.OFF_ACCEPTED) == 1
    with pytest.raises(ValueError, match="the base frame carries no task"):
        mb.child_take(box, 0)
    with pytest.raises(ValueError, match="not a multiple"):
        mb.child_take(box, 12)


def test_child_done_ends_the_task_plainly_and_counts_it_on_the_doorbell(box: mmap.mmap) -> None:
    bell = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        mb.publish_task(box, TASK0, 1, b"", 0, 0, bytes(32), b"\x00" * 8, 1, 1, 1, 0, 1)
        mb.write_bytes(box, TASK0 + mb.OFF_ERRMSG, b"stale")
        assert mb.child_done(box, TASK0, bell) is False  # the parent is not parked
        state, error, message = mb.read_result(box, TASK0)[:3]
        assert (state, error, message) == (mb.STATE_TASK_DONE, 0, "")
        assert mb.load32(bell, mb.DOORBELL_OFF_COMPLETED) == 1
        mb.store32(bell, mb.DOORBELL_OFF_PARKED, 1)
        assert mb.child_done(box, TASK0, bell) is True  # parked: the caller rings
        assert mb.load32(bell, mb.DOORBELL_OFF_COMPLETED) == 2
        with pytest.raises(ValueError, match="the doorbell must be 16 bytes"):
            mb.child_done(box, TASK0, bytearray(8))
        with pytest.raises(ValueError, match="the base frame carries no task"):
            mb.child_done(box, 0, bell)
    finally:
        bell.close()
