"""Type stub for the ``simpler_daemon.mailbox._mailbox`` C extension.

Every ``buf`` is a writable buffer (``mmap.mmap``, ``bytearray`` or a writable
``memoryview``); every ``off`` is a byte offset into it.  Out-of-range offsets
raise ``IndexError``, misaligned ones ``ValueError``, out-of-range values
``OverflowError``.
"""

from collections import deque
from collections.abc import Sequence
from typing import Any, Final

from _typeshed import ReadableBuffer, WriteableBuffer

ABI_VERSION: Final = 1

MAILBOX_FRAME_SIZE: Final = 65536
MAILBOX_NUM_FRAMES: Final = 3
MAILBOX_SIZE: Final = 196608

OFF_STATE: Final = 0
OFF_ERROR: Final = 4
OFF_RESERVED: Final = 8
OFF_CONFIG: Final = 16
CONFIG_SIZE: Final = 1056
OFF_LEASE: Final = 1072
OFF_DIGEST: Final = 1088
DIGEST_SIZE: Final = 32
OFF_ARGS: Final = 1120
MAILBOX_ARGS_CAPACITY: Final = 64080
OFF_WAKE_SEQ: Final = 65200
OFF_CHILD_PARKED: Final = 65208
OFF_SHUTDOWN: Final = 65216
OFF_TRAILER: Final = 65224
TRAILER_SIZE: Final = 40
OFF_ACCEPTED: Final = 65264
OFF_DISPOSITION: Final = 65272
OFF_ERRMSG: Final = 65280
ERRMSG_SIZE: Final = 256

TENSOR_DESC_SIZE: Final = 168

SUBPUMP_FIELDS: Final = 9
DOORBELL_OFF_PARKED: Final = 0
DOORBELL_OFF_COMPLETED: Final = 8
DOORBELL_SIZE: Final = 16
SUBPUMP_MAX_LANES: Final = 256
SUBPUMP_MAX_RESULT: Final = 32768
VALUES_MAGIC: Final = 0x31564453
VALUES_SECTION_SIZE: Final = 32

STATE_IDLE: Final = 0
STATE_TASK_READY: Final = 1
STATE_TASK_DONE: Final = 2
STATE_SHUTDOWN: Final = 3
STATE_CONTROL_REQUEST: Final = 4
STATE_CONTROL_DONE: Final = 5
STATE_INIT_READY: Final = 6
STATE_INIT_FAILED: Final = 7
STATE_FRAME_STAGED: Final = 8
STATE_TASK_LAUNCHED: Final = 9
STATE_TASK_FAILED: Final = 10
STATE_ACTIVATE: Final = 11
STATE_PREPARE_READY: Final = 12

STATES: Final[dict[str, int]]

# --- atomics -------------------------------------------------------------

def load32(buf: WriteableBuffer, off: int, /) -> int:
    """Acquire load of a signed 32-bit word."""

def load64(buf: WriteableBuffer, off: int, /) -> int:
    """Acquire load of an unsigned 64-bit word."""

def store32(buf: WriteableBuffer, off: int, value: int, /) -> None:
    """Seq_cst store; ``value`` in ``-2**31 .. 2**32-1`` (stored as a bit pattern)."""

def store64(buf: WriteableBuffer, off: int, value: int, /) -> None:
    """Seq_cst store; ``value`` in ``-2**63 .. 2**64-1`` (stored as a bit pattern)."""

def cas32(buf: WriteableBuffer, off: int, expected: int, desired: int, /) -> bool: ...
def cas64(buf: WriteableBuffer, off: int, expected: int, desired: int, /) -> bool: ...
def fetch_add32(buf: WriteableBuffer, off: int, delta: int, /) -> int:
    """Returns the old value as a signed 32-bit int."""

def fetch_add64(buf: WriteableBuffer, off: int, delta: int, /) -> int:
    """Returns the old value as an unsigned 64-bit int."""

def fence() -> None: ...

# --- futex ---------------------------------------------------------------

def futex_wait(buf: WriteableBuffer, off: int, expected: int, timeout: float | None = None) -> int:
    """0 woken, 1 timed out, 2 word != expected, 3 interrupted (EINTR)."""

def futex_wake(buf: WriteableBuffer, off: int, n: int, /) -> int: ...

# --- spin / park ---------------------------------------------------------

def spin_wait(
    buf: WriteableBuffer, offsets: Sequence[int], expected: Sequence[int], spins: int, /
) -> int:
    """Index of the first word != its expected value, or -1 after ``spins`` polls."""

def child_wait(
    buf: WriteableBuffer,
    offsets: Sequence[int],
    expected: Sequence[int],
    spin_ns: int,
    timeout: float | None,
) -> int:
    """Spin for ``spin_ns`` then park on the wake futex; changed index or -1."""

def wake_child(buf: WriteableBuffer, /) -> bool:
    """Wake the mailbox's child if it is parked; True if it was."""

# --- bulk helpers --------------------------------------------------------

def publish_task(
    buf: WriteableBuffer,
    frame_off: int,
    state: int,
    config: ReadableBuffer,
    slot_id: int,
    generation: int,
    digest: ReadableBuffer,
    blob: ReadableBuffer,
    protocol: int,
    run_id: int,
    trailer_slot_id: int,
    trailer_generation: int,
    dispatch_id: int,
) -> None: ...
def read_task(
    buf: WriteableBuffer, frame_off: int
) -> tuple[bytes, int, int, bytes, bytes, int, int, int, int, int]:
    """(config, slot_id, generation, digest, blob, protocol, run_id,
    trailer_slot_id, trailer_generation, dispatch_id)"""

def read_trailer(buf: WriteableBuffer, frame_off: int) -> tuple[int, int, int, int, int]:
    """(protocol, run_id, slot_id, generation, dispatch_id)"""

def write_result(
    buf: WriteableBuffer, frame_off: int, state: int, error: int, message: str | ReadableBuffer
) -> None: ...
def read_result(
    buf: WriteableBuffer, frame_off: int
) -> tuple[int, int, str, int, int, int, int, int, int, int]:
    """(state, error, message, accepted, disposition, protocol, run_id,
    slot_id, generation, dispatch_id)"""

def read_bytes(buf: WriteableBuffer, off: int, n: int) -> bytes: ...
def write_bytes(buf: WriteableBuffer, off: int, data: ReadableBuffer) -> None: ...
def set_pdeathsig(signum: int, /) -> None: ...
def fork_sibling() -> int: ...

# --- the cyclic collector ----------------------------------------------------

def gc_untrack(obj: object, /) -> None:
    """Take ``obj`` off the cyclic collector's lists (no-op when it is not on them)."""

def gc_track_all(objs: list[Any], /) -> None:
    """Put every collector object of ``objs`` that is off its lists back on them."""

# --- SUB fast loop ---------------------------------------------------------

def child_take(buf: WriteableBuffer, frame_off: int, /) -> tuple[int, bytes, bytes]:
    """A SUB child's read of the task it claimed: stores the frame's pick-up word
    (OFF_ACCEPTED = 1) first, then returns (deadline_ms, digest, blob) as ``read_task``
    reads them (the deadline is the config's first little-endian word). ValueError for
    a malformed blob (the word is stored) or the base frame."""

def child_done(buf: WriteableBuffer, frame_off: int, doorbell: WriteableBuffer, /) -> bool:
    """A SUB task's plain end: ``write_result(buf, frame_off, TASK_DONE, 0, "")``, then the
    doorbell's completion count + 1. True when the parent is parked on the doorbell (the
    caller rings its eventfd). ValueError for a doorbell under DOORBELL_SIZE bytes."""

def child_claim(buf: WriteableBuffer, hold: int, /) -> int:
    """A SUB child's pick over its two task frames (a queue frame): -1 while the frame at
    offset ``hold`` (0: none) still says TASK_DONE; else the TASK_READY frame with the
    lower dispatch id, claimed by compare-exchange TASK_READY -> TASK_LAUNCHED (its
    offset), or 0 when none is ready."""

def sub_pump(
    lanes: list[list[Any]],
    queue: deque[Any],
    ready: object,
    published: list[Any],
    spin_ns: int,
    max_publish: int,
    queue_frames: bool = True,
    /,
) -> int:
    """The per-task loop of SUB lanes over one ready queue.

    Each lane is ``[buf, frame_off, slot, dispatch_id, next_dispatch_id, published_ns,
    stop, done, peer]`` (``SUBPUMP_FIELDS`` items): one task frame of a child; ``peer``
    is the index of the same child's other frame (a queue frame) or -1, and the two share
    the child's dispatch counter. Free children (both frames IDLE) get a task first; with
    ``queue_frames`` a busy child's free frame then gets the next one queued. Updated in
    place: poll the frame of a lane whose ``slot`` is in flight (TASK_READY or
    TASK_LAUNCHED); a plain completion (TASK_DONE, error 0, trailer ``{PROTOCOL, slot.run_id, slot.slot_id, slot.lease_generation, dispatch_id}``,
    result length <= ``SUBPUMP_MAX_RESULT``) stores IDLE and appends ``slot`` (or
    ``(slot, bytes)`` for a value) to ``done``; anything else sets ``stop`` to 1 and
    leaves the frame alone. An idle lane takes ``queue[0]`` if ``slot.state is ready``,
    ``slot.group_size == 1`` and it fits the frame (else the queue is closed for this
    call), publishes it like ``publish_task`` with dispatch id ``next_dispatch_id``
    (``stop`` = 2 when the frame is not IDLE), pops it and appends it to ``published``.
    Returns after ``max_publish`` publications, when nothing is in flight, or when no
    lane progressed for ``spin_ns`` (0: after one pass over the lanes, so a task it
    published is never completed by the same call); the number of slots published.
    The GIL is held.
    """
