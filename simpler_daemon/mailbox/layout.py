"""Mailbox layout: the one place frame offsets and states live.

A mailbox is ``MAILBOX_SIZE`` bytes of ``MAP_SHARED`` memory mapped by the
parent before it forks the child that consumes it, so both processes see the
same bytes at the same address::

    mailbox (3 x 64 KiB)
    +-----------------+-----------------+-----------------+
    | frame 0: base   | frame 1: task 0 | frame 2: task 1 |
    | startup/control | lease slot 0    | lease slot 1    |
    +-----------------+-----------------+-----------------+

    every frame (offsets relative to the frame start)
         0  state        i32   MailboxState, stored last (release), loaded first (acquire)
         4  error        i32   0 ok, else a failure code
         8  reserved     u64   task: 0 at publish; at completion the length of the full
                               error text, or of the encoded return value (error 0)
                               base: control sub-command
        16  config       1056  CallConfig (task) / control arguments (base)
      1072  lease        16    {u32 slot_id, u32 0, u64 generation}; base: chip pipeline depth
      1088  digest       32    raw sha256 of the callable descriptor
      1120  args blob    <=64080  [i32 T][i32 S][Tensor x T][u64 x S][values section];
                               at completion the full error text, the msgpack-encoded
                               return value, or the memfd number of a large one
     65200  wake seq     i32   base only: futex word the parked child sleeps on
     65208  child parked i32   base only: 1 while the child sleeps (Dekker flag)
     65216  shutdown     i32   base only: sticky 0 -> 1, written by a terminating parent
     65224  trailer      5xu64 {protocol, run_id, slot_id, generation, dispatch_id}
     65264  accepted     i32   sticky launch-acceptance word
     65272  disposition  i32   0 none, 1 validated only, 2 natively prepared
     65280  error text   256   NUL-terminated UTF-8, truncated by the writer

The parent writes payload, then the state (``publish_task`` does both in one
call and wakes a parked child); the child loads the state, then the payload.
``ACTIVATE`` is only ever written by compare-exchange from ``FRAME_STAGED``.

The C extension owns the numbers; this module names them, checks at import
that both sides agree, and wraps a mapping in a small :class:`Mailbox`.
"""

from __future__ import annotations

import mmap
import struct
from enum import IntEnum
from typing import Final

from simpler_daemon import args as _args
from simpler_daemon import taskvalues as _values
from simpler_daemon.mailbox import _mailbox as _mb

ABI_VERSION: Final = 1
if _mb.ABI_VERSION != ABI_VERSION:  # pragma: no cover - build mismatch
    raise ImportError(
        f"cannot load simpler_daemon.mailbox._mailbox: ABI {_mb.ABI_VERSION}, "
        f"expected {ABI_VERSION}; rebuild the extension"
    )
# The args codec (args.py) declares the sizes it packs to; the frame must agree.
if (
    _mb.MAILBOX_ARGS_CAPACITY != _args.MAILBOX_ARGS_CAPACITY
    or _mb.TENSOR_DESC_SIZE != _args.TENSOR_DESC_SIZE
    or _args.CONFIG_BYTES > _mb.CONFIG_SIZE
):  # pragma: no cover - build mismatch
    raise ImportError(
        "cannot load simpler_daemon.mailbox._mailbox: its args capacity "
        f"{_mb.MAILBOX_ARGS_CAPACITY}, descriptor size {_mb.TENSOR_DESC_SIZE} or config size "
        f"{_mb.CONFIG_SIZE} does not match args.py ({_args.MAILBOX_ARGS_CAPACITY}, "
        f"{_args.TENSOR_DESC_SIZE}, {_args.CONFIG_BYTES}); rebuild the extension"
    )

# The values section behind the scalars (taskvalues.py) is found by the C read_task.
if (
    _mb.VALUES_MAGIC != _values.MAGIC or _values.SECTION.size != _mb.VALUES_SECTION_SIZE
):  # pragma: no cover - build mismatch
    raise ImportError(
        "cannot load simpler_daemon.mailbox._mailbox: its values section "
        f"({_mb.VALUES_MAGIC:#x}, {_mb.VALUES_SECTION_SIZE} bytes) does not match taskvalues.py; "
        "rebuild the extension"
    )

MAILBOX_FRAME_SIZE: Final = _mb.MAILBOX_FRAME_SIZE
MAILBOX_NUM_FRAMES: Final = _mb.MAILBOX_NUM_FRAMES
MAILBOX_SIZE: Final = _mb.MAILBOX_SIZE
MAILBOX_ARGS_CAPACITY: Final = _mb.MAILBOX_ARGS_CAPACITY
OFF_STATE: Final = _mb.OFF_STATE
OFF_ERROR: Final = _mb.OFF_ERROR
OFF_RESERVED: Final = _mb.OFF_RESERVED
OFF_CONFIG: Final = _mb.OFF_CONFIG
CONFIG_SIZE: Final = _mb.CONFIG_SIZE
OFF_LEASE: Final = _mb.OFF_LEASE
OFF_DIGEST: Final = _mb.OFF_DIGEST
DIGEST_SIZE: Final = _mb.DIGEST_SIZE
OFF_ARGS: Final = _mb.OFF_ARGS
OFF_WAKE_SEQ: Final = _mb.OFF_WAKE_SEQ
OFF_CHILD_PARKED: Final = _mb.OFF_CHILD_PARKED
OFF_SHUTDOWN: Final = _mb.OFF_SHUTDOWN
OFF_TRAILER: Final = _mb.OFF_TRAILER
OFF_ACCEPTED: Final = _mb.OFF_ACCEPTED
OFF_DISPOSITION: Final = _mb.OFF_DISPOSITION
OFF_ERRMSG: Final = _mb.OFF_ERRMSG
ERRMSG_SIZE: Final = _mb.ERRMSG_SIZE
TENSOR_DESC_SIZE: Final = _mb.TENSOR_DESC_SIZE

#: Trailer protocol identifier; a frame carrying another value is stale or foreign.
PROTOCOL: Final = 0x534C5231  # "SLR1"

#: Frame offsets inside a mailbox.
BASE_FRAME: Final = 0
TASK_FRAMES: Final = (MAILBOX_FRAME_SIZE, 2 * MAILBOX_FRAME_SIZE)


class MailboxState(IntEnum):
    """The state word of a frame (shared memory; values are the wire contract)."""

    IDLE = 0
    TASK_READY = 1
    TASK_DONE = 2
    SHUTDOWN = 3
    CONTROL_REQUEST = 4
    CONTROL_DONE = 5
    INIT_READY = 6
    INIT_FAILED = 7
    FRAME_STAGED = 8
    TASK_LAUNCHED = 9
    TASK_FAILED = 10
    ACTIVATE = 11
    PREPARE_READY = 12


if {s.name: s.value for s in MailboxState} != dict(_mb.STATES):  # pragma: no cover
    raise ImportError(
        "cannot load simpler_daemon.mailbox.layout: MailboxState does not match the C extension "
        f"({dict(_mb.STATES)}); rebuild the extension"
    )


class Disposition(IntEnum):
    """How far the child got with a staged frame."""

    NONE = 0
    VALIDATED = 1
    PREPARED = 2


class ControlOp(IntEnum):
    """Base-frame control sub-commands (the reserved u64 of the base frame)."""

    PING = 1
    REGISTER_IMPORT = 2
    REGISTER_SERIALIZED = 3
    UNREGISTER = 4
    REGISTER_CHIP = 5
    UNREGISTER_CHIP = 6
    STATS = 7
    #: Re-execute the module of an import path already in the child's table and point
    #: the digest at the new function (``register(..., reload=True)``).
    RELOAD_IMPORT = 8


#: Controls that mutate a child's callable table: deferred while native state is owned.
CONTROL_REQUEST_OPS_MUTATING: Final = frozenset(
    {
        ControlOp.REGISTER_IMPORT,
        ControlOp.REGISTER_SERIALIZED,
        ControlOp.UNREGISTER,
        ControlOp.REGISTER_CHIP,
        ControlOp.UNREGISTER_CHIP,
        ControlOp.RELOAD_IMPORT,
    }
)

# Control argument words inside the base frame's config area.
CTRL_OFF_ARG_LEN: Final = OFF_CONFIG  # u64 payload length (payload lives in the args area)
CTRL_OFF_RESULT0: Final = OFF_CONFIG + 8  # u64 result word 0
CTRL_OFF_RESULT1: Final = OFF_CONFIG + 16  # u64 result word 1
CTRL_PAYLOAD_CAPACITY: Final = MAILBOX_ARGS_CAPACITY

# The lease area of the base frame carries the child's published pipeline depth.
OFF_PIPELINE_DEPTH: Final = OFF_LEASE

# Error codes written into a frame's error word.
ERR_NONE: Final = 0
ERR_TASK: Final = 1  # the callable raised
ERR_NOT_REGISTERED: Final = 2  # unknown digest
ERR_BAD_ARGS: Final = 3  # args blob could not be decoded
ERR_CONTROL: Final = 4  # a control request failed
ERR_SHUTDOWN: Final = 5  # frame abandoned because the child shut down
ERR_STALE: Final = 6  # identity changed under the child
ERR_DEADLINE: Final = 7  # the task ran past its deadline
ERR_INIT: Final = 8
ERR_RESULT: Final = 9  # the callable's return value could not be sent back
ERR_CANCELLED: Final = 10  # parent side: the child was killed to stop the task (terminate)

#: The most a SUB callable's return value takes in the frame, msgpack-encoded (it travels
#: back in the task frame's args area); a larger one goes through a memfd, up to the
#: Worker's ``max_result_bytes`` (``mailbox/results.py``).
MAX_RESULT_BYTES: Final = 32768
assert MAX_RESULT_BYTES <= MAILBOX_ARGS_CAPACITY

_LEASE = struct.Struct("<IIQ")


class Mailbox:
    """One anonymous ``MAP_SHARED`` mailbox region.

    Anonymous mappings never appear in ``/dev/shm``, so nothing can leak there;
    the child inherits the mapping through ``fork``.
    """

    __slots__ = ("buf", "closed")

    def __init__(self) -> None:
        self.buf = mmap.mmap(-1, MAILBOX_SIZE, flags=mmap.MAP_SHARED)
        self.closed = False

    def state(self, frame: int) -> int:
        return _mb.load32(self.buf, frame + OFF_STATE)

    def set_state(self, frame: int, state: int) -> None:
        _mb.store32(self.buf, frame + OFF_STATE, state)

    def cas_state(self, frame: int, expected: int, desired: int) -> bool:
        return _mb.cas32(self.buf, frame + OFF_STATE, expected, desired)

    def request_shutdown(self) -> None:
        """Sticky word first, then the state, then wake the child if it sleeps."""
        _mb.store32(self.buf, OFF_SHUTDOWN, 1)
        _mb.store32(self.buf, OFF_STATE, MailboxState.SHUTDOWN)
        _mb.wake_child(self.buf)

    def shutdown_requested(self) -> bool:
        return (
            _mb.load32(self.buf, OFF_SHUTDOWN) != 0
            or _mb.load32(self.buf, OFF_STATE) == MailboxState.SHUTDOWN
        )

    def pipeline_depth(self) -> int:
        return _mb.load32(self.buf, OFF_PIPELINE_DEPTH)

    def error_text(self, frame: int) -> str:
        return _mb.read_result(self.buf, frame)[2]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.buf.close()
            except BufferError:  # pragma: no cover - a view still exported
                pass


def pack_lease(slot_id: int, generation: int) -> bytes:
    return _LEASE.pack(slot_id, 0, generation)
