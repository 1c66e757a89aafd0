"""The loop that runs inside a SUB child, on the far side of its mailbox.

Each iteration, in this order::

    1. shutdown?      base state == SHUTDOWN or the sticky shutdown word set -> leave
    2. task frame 0   TASK_READY -> mark it picked up (the ``accepted`` word),
                      decode args, resolve digest, fn(args),
                      write error + text (or a non-None return value, msgpack-encoded,
                      into the args area), store TASK_DONE, ring the parent if parked
    3. base frame     CONTROL_REQUEST -> register / reload / unregister / ping / stats,
                      CONTROL_DONE by compare-exchange (never over SHUTDOWN)
    4. idle           spin on the state words (GIL released; only while spins catch
                      tasks, ``_SpinGap``), then park on the futex; after a
                      timed-out park check that the parent lives

With a queue frame (``ChildContext.task_frames == 2``) step 2 looks at
both task frames: the TASK_READY one with the lower dispatch id is claimed
(TASK_READY -> TASK_LAUNCHED) and run, so the parent can queue the next task while one
runs (docs/mailbox.md, *Queue frame*).

On the way out every frame the child still owns is marked TASK_FAILED.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Final

import msgspec

from simpler_daemon.args import TaskArgs, decode_args, encode_args
from simpler_daemon.callables import (
    CallableSpec,
    SlotTable,
    decode_import_control,
    load_spec,
    not_registered_message,
    parse_import_path,
    reload_import,
    resolve_import,
)
from simpler_daemon.heap import Heap
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.doorbell import Doorbell
from simpler_daemon.mailbox.layout import (
    BASE_FRAME,
    CTRL_OFF_ARG_LEN,
    CTRL_OFF_RESULT0,
    CTRL_OFF_RESULT1,
    DIGEST_SIZE,
    ERR_BAD_ARGS,
    ERR_CONTROL,
    ERR_DEADLINE,
    ERR_INIT,
    ERR_NOT_REGISTERED,
    ERR_RESULT,
    ERR_SHUTDOWN,
    ERR_TASK,
    ERRMSG_SIZE,
    MAILBOX_ARGS_CAPACITY,
    MAX_RESULT_BYTES,
    OFF_ARGS,
    OFF_DIGEST,
    OFF_ERRMSG,
    OFF_ERROR,
    OFF_RESERVED,
    OFF_SHUTDOWN,
    OFF_STATE,
    TASK_FRAMES,
    ControlOp,
    Mailbox,
    MailboxState,
)
from simpler_daemon.mailbox.results import LARGE_RESULT, pack_fd, write_large
from simpler_daemon.retrypolicy import classes_line, qualified_name
from simpler_daemon.taskvalues import DEFAULT_MAX_RESULT_BYTES, read_section

TASK_READY = int(MailboxState.TASK_READY)
TASK_DONE = int(MailboxState.TASK_DONE)
TASK_FAILED = int(MailboxState.TASK_FAILED)
#: A queue frame's state once the child claimed it (``MailboxLoop.run``).
TASK_LAUNCHED = int(MailboxState.TASK_LAUNCHED)
SHUTDOWN = int(MailboxState.SHUTDOWN)
CONTROL_REQUEST = int(MailboxState.CONTROL_REQUEST)
CONTROL_DONE = int(MailboxState.CONTROL_DONE)
#: The args blob of a task without tensors or scalars (the common SUB case).
_EMPTY_BLOB = encode_args((), ())
_ARGS_END = len(_EMPTY_BLOB)


class DeadlineExceeded(Exception):
    """Raised inside a task that ran past its ``CallConfig.deadline_ms``."""


@dataclass
class ChildContext:
    """Everything a child needs, inherited through fork."""

    worker_id: int
    label: str
    mailbox: Mailbox
    heap: Heap
    doorbell: Doorbell
    specs: list[CallableSpec] = field(default_factory=list)
    parent_pid: int = 0
    spin_ns: int = 50_000
    park_timeout: float = 0.5
    error_prefix: str = "sub_worker"
    #: Test hook: runs after the snapshot is resolved, before INIT_READY.
    init_hook: Callable[[], None] | None = None
    #: The most a return value may take encoded (``Worker(max_result_bytes=)``).
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    #: 2: the parent may queue the next task in the other task frame while one runs
    #: (a queue frame, see ``MailboxLoop.run``); 1: task frame 0 only.
    task_frames: int = 1


_monotonic_ns = time.monotonic_ns

#: A child spins for its next task while at least this share of its recent spins got
#: one (within ``spin_ns`` of running out of work; smoothed by ``SPIN_GAP_ALPHA``). When
#: tasks come further apart (a daemon's client that makes one run at a time) the spin
#: catches none and only takes turns at a core with the processes the answer goes
#: through; a child whose spins catch a task now and then (a parent that publishes in
#: rounds) keeps them, each catch saving the parent a wake-up.
SPIN_MIN_HIT_RATE: Final = 0.1
SPIN_GAP_ALPHA: Final = 0.0625
#: While it does not spin, one wait in this many spins anyway (a probe): spinning comes
#: back when tasks come close together again. A parked child cannot judge by itself:
#: the time it waited includes its own wake-up.
SPIN_PROBE_EVERY: Final = 16


class _SpinGap:
    """Whether the child spins while it waits for its next task: the share of its recent
    spinning waits that got a task within ``spin_ns`` of running out of work (a wait
    that parked first says nothing; a probe spins now and then)."""

    __slots__ = ("hit_rate", "idle_since", "spin_ns", "spun", "waits")

    def __init__(self, spin_ns: int) -> None:
        self.spin_ns = spin_ns
        self.hit_rate = 1.0
        #: When the child last ran out of work (monotonic ns; 0: it has work).
        self.idle_since = 0
        #: Whether this wait spins (and so is judged).
        self.spun = False
        self.waits = 0

    def went_idle(self) -> int:
        """The child ran out of work: how long it spins for the next task (ns)."""
        self.idle_since = _monotonic_ns()
        self.waits += 1
        self.spun = self.hit_rate >= SPIN_MIN_HIT_RATE or self.waits % SPIN_PROBE_EVERY == 0
        return self.spin_ns if self.spun else 0

    def task_came(self) -> None:
        if self.spun:
            self._judge(_monotonic_ns() - self.idle_since <= self.spin_ns)
        self.idle_since = 0

    def timed_out(self) -> None:
        """A park ran out (``park_timeout``) with no task: a spin before it missed."""
        if self.spun:
            self._judge(False)
            self.spun = False

    def _judge(self, hit: bool) -> None:
        self.hit_rate += SPIN_GAP_ALPHA * ((1.0 if hit else 0.0) - self.hit_rate)


def write_failure(buf: Any, frame: int, state: int, error: int, text: str) -> None:
    """Full text into the (now free) args area, its head into the 256-byte field."""
    data = text.encode(errors="replace")[:MAILBOX_ARGS_CAPACITY]
    _mb.write_bytes(buf, frame + OFF_ARGS, data)
    _mb.store64(buf, frame + OFF_RESERVED, len(data))
    _mb.write_result(buf, frame, state, error, text)


_encode = msgspec.msgpack.Encoder().encode


def write_value(buf: Any, frame: int, value: Any, limit: int = MAX_RESULT_BYTES) -> int:
    """A task's non-None return value, msgpack-encoded, into the (now free) args area,
    its length into ``reserved``; TASK_DONE. Past ``MAX_RESULT_BYTES`` (and up to
    ``limit``) the bytes go into a memfd (``mailbox/results.py``) whose descriptor is
    returned, for the caller to close once the parent read it; -1 otherwise. A value
    msgspec cannot encode, or one over ``limit`` encoded, fails the task instead (the
    parent names the task)."""
    try:
        data = _encode(value)
    except Exception as exc:
        kind = type(value)
        name = kind.__qualname__
        if kind.__module__ != "builtins":
            name = f"{kind.__module__}.{name}"
        write_failure(
            buf,
            frame,
            TASK_DONE,
            ERR_RESULT,
            f"msgspec cannot encode a {name} ({type(exc).__name__}: {exc}); return None or "
            "plain data (bool, int, float, str, bytes, list, tuple, dict, ...)",
        )
        return -1
    n = len(data)
    if n > limit:
        write_failure(
            buf,
            frame,
            TASK_DONE,
            ERR_RESULT,
            f"the return value is {n} bytes encoded, more than max_result_bytes ({limit})",
        )
        return -1
    if n <= MAX_RESULT_BYTES:
        _mb.write_bytes(buf, frame + OFF_ARGS, data)
        _mb.store64(buf, frame + OFF_RESERVED, n)
        _mb.write_result(buf, frame, TASK_DONE, 0, "")
        return -1
    try:
        fd = write_large(data)
    except OSError as exc:
        write_failure(
            buf,
            frame,
            TASK_DONE,
            ERR_RESULT,
            f"the return value of {n} bytes could not be stored for the parent: {exc}",
        )
        return -1
    _mb.write_bytes(buf, frame + OFF_ARGS, pack_fd(fd))
    _mb.store64(buf, frame + OFF_RESERVED, LARGE_RESULT | n)
    _mb.write_result(buf, frame, TASK_DONE, 0, "")
    return fd


def format_exception(prefix: str, exc: BaseException) -> str:
    """``<prefix>: <qualified class name>: <message>``, the class and its bases
    (``retrypolicy.classes_line``: what ``retry_exceptions`` matches, in the parent that
    may not have the class), then the traceback."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"{prefix}: {qualified_name(type(exc))}: {exc}\n{classes_line(type(exc))}\n{tb}"


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise DeadlineExceeded("task ran past its deadline")


class MailboxLoop:
    """The SUB child's loop over its mailbox."""

    def __init__(self, ctx: ChildContext) -> None:
        self.ctx = ctx
        self.buf = ctx.mailbox.buf
        self.table = SlotTable()
        self.tasks_done = 0
        self.frame = TASK_FRAMES[0]
        #: The memfd of the last large result, open until the parent read it.
        self.result_fd = -1
        #: With a queue frame: the frame of a task that did not end plainly, while the parent
        #: has not read it (0: none); no other frame is taken meanwhile.
        self.hold = 0
        #: Whether the last task ended plainly: error 0, any value in the frame.
        self.plain = False

    def init(self) -> bool:
        buf = self.buf
        try:
            for spec in self.ctx.specs:
                fn = spec.obj if spec.obj is not None else load_spec(spec.import_path, spec.payload)
                self.table.add(spec.handle.digest, fn)
            if self.ctx.init_hook is not None:
                self.ctx.init_hook()
            signal.signal(signal.SIGALRM, _on_alarm)
        except BaseException as exc:
            _mb.write_result(
                buf,
                BASE_FRAME,
                int(MailboxState.INIT_FAILED),
                ERR_INIT,
                f"{self.ctx.label} init: {type(exc).__name__}: {exc}",
            )
            return False
        _mb.write_result(buf, BASE_FRAME, int(MailboxState.INIT_READY), 0, "")
        return True

    def run(self) -> int:
        """The child's loop. With a queue frame (``task_frames == 2``) the parent publishes
        a task into whichever task frame is IDLE, so the next one can wait while this one
        runs: the child takes the READY frame with the lower dispatch id and claims it
        (compare-exchange TASK_READY -> TASK_LAUNCHED: a frame the parent took back first
        is not run). After a task that did not end plainly (an error, or a value in a
        memfd) it takes no other frame until the parent has read that one (it left
        TASK_DONE): the parent sees a failure before a later task of the lane starts, and
        a large result's memfd stays open until it was read."""
        if not self.init():
            return 1
        buf = self.buf
        queued = self.ctx.task_frames == 2
        f0, f1 = TASK_FRAMES[0], TASK_FRAMES[1]
        frame = self.frame
        if queued:
            watch: tuple[int, ...] = (
                BASE_FRAME + OFF_STATE,
                f0 + OFF_STATE,
                f1 + OFF_STATE,
                OFF_SHUTDOWN,
            )
        else:
            watch = (BASE_FRAME + OFF_STATE, frame + OFF_STATE, OFF_SHUTDOWN)
        spin = 0
        park = self.ctx.park_timeout
        parent = self.ctx.parent_pid
        load32 = _mb.load32
        claim = _mb.child_claim
        gate = _SpinGap(self.ctx.spin_ns)
        while True:
            bst = load32(buf, BASE_FRAME)
            if bst == SHUTDOWN or load32(buf, OFF_SHUTDOWN):
                break
            if queued:
                # The states the wait below compares against, read *before* the claim
                # looks: a task published after this read changes a word, so the wait
                # returns at once. Read after the claim, it could equal the new
                # TASK_READY, and the child would park on a task the parent already woke
                # it for (until park_timeout).
                s0 = load32(buf, f0)
                s1 = load32(buf, f1)
                got = claim(buf, self.hold)  # pick and claim, in C: once per task
                if got > 0:
                    if gate.idle_since:
                        gate.task_came()
                    self.frame = got
                    self.plain = False
                    self.run_task()
                    self.hold = 0 if self.plain else got
                    continue
                if got == 0:
                    self.hold = 0
                expected: tuple[int, ...] = (bst, s0, s1, 0)
            else:
                st = load32(buf, frame)
                if st == TASK_READY:
                    if gate.idle_since:
                        gate.task_came()
                    self.run_task()
                    continue
                expected = (bst, st, 0)
            if bst == CONTROL_REQUEST:
                self.handle_control()
                continue
            if not gate.idle_since:
                spin = gate.went_idle()  # out of work: spin for the next task, or not
            idle = _mb.child_wait(buf, watch, expected, spin, park) < 0
            if idle:
                # Spin only right after work: an idle child that re-parks after a
                # timed-out park must not spin again (with child_spin_us at its maximum
                # that was 10 ms of spinning every park_timeout, ~1.6 % of a core).
                spin = 0
                gate.timed_out()
                if parent and os.getppid() != parent:
                    return 0
                self.on_idle()
        self.shutdown()
        return 0

    def on_idle(self) -> None:
        """Called after each idle park (``park_timeout``) with no work; a hook."""
        if self.result_fd >= 0 and _mb.load32(self.buf, self.frame) != TASK_DONE:
            self.close_result()

    def close_result(self) -> None:
        """Close the memfd of the last large result: the parent read it (the frame left
        TASK_DONE), so its memory goes back to the kernel now."""
        os.close(self.result_fd)
        self.result_fd = -1

    def run_task(self) -> None:
        buf = self.buf
        frame = self.frame
        try:
            # Picked up: ``child_take`` stores the pick-up word before it reads anything of
            # the task, and before anything of it runs. A child that dies before that
            # leaves the task unstarted, and the parent queues it again (docs/mailbox.md).
            deadline_ms, digest, blob = _mb.child_take(buf, frame)
        except ValueError as exc:  # a malformed blob header fails the task, not the child
            if self.result_fd >= 0:
                self.close_result()
            write_failure(
                buf,
                frame,
                TASK_DONE,
                ERR_BAD_ARGS,
                format_exception(f"{self.ctx.error_prefix}: bad args", exc),
            )
            self.tasks_done += 1
            self.ctx.doorbell.ring_if_parked()
            return
        if self.result_fd >= 0:
            self.close_result()
        fn = self.table.resolve(digest)
        if fn is None:
            write_failure(buf, frame, TASK_DONE, ERR_NOT_REGISTERED, not_registered_message(digest))
        else:
            try:
                # An empty blob: decode_args's result, without its call (once per task).
                if blob == _EMPTY_BLOB:
                    args = TaskArgs()
                elif blob.startswith(_EMPTY_BLOB):  # values alone (no tensors, no scalars)
                    args = TaskArgs()
                    args._values = read_section(blob, _ARGS_END, self.ctx.heap.mmap)
                else:
                    args = decode_args(blob, self.ctx.heap.view, self.ctx.heap.mmap)
            except Exception as exc:
                write_failure(
                    buf,
                    frame,
                    TASK_DONE,
                    ERR_BAD_ARGS,
                    format_exception(f"{self.ctx.error_prefix}: bad args", exc),
                )
            else:
                try:
                    if deadline_ms:
                        signal.setitimer(signal.ITIMER_REAL, deadline_ms / 1000.0)
                    try:
                        value = fn(args)
                    finally:
                        if deadline_ms:
                            signal.setitimer(signal.ITIMER_REAL, 0)
                except DeadlineExceeded as exc:
                    write_failure(
                        buf,
                        frame,
                        TASK_DONE,
                        ERR_DEADLINE,
                        f"{self.ctx.error_prefix}: deadline exceeded ({deadline_ms} ms)\n"
                        + format_exception(self.ctx.error_prefix, exc),
                    )
                except BaseException as exc:
                    write_failure(
                        buf,
                        frame,
                        TASK_DONE,
                        ERR_TASK,
                        format_exception(self.ctx.error_prefix, exc),
                    )
                else:
                    if value is None:  # the common case writes nothing more
                        self.plain = True
                        self.tasks_done += 1
                        # TASK_DONE, then ``doorbell.ring_if_parked()``, in one C call.
                        bell = self.ctx.doorbell
                        if _mb.child_done(buf, frame, bell.buf):
                            bell.ring_parked()
                        return
                    self.result_fd = fd = write_value(buf, frame, value, self.ctx.max_result_bytes)
                    # Plain: the value is in the frame (fd -1), and it was encoded.
                    self.plain = fd < 0 and not _mb.load32(buf, frame + OFF_ERROR)
        self.tasks_done += 1
        self.ctx.doorbell.ring_if_parked()

    def handle_control(self) -> None:
        buf = self.buf
        op = _mb.load64(buf, OFF_RESERVED)
        n = _mb.load64(buf, CTRL_OFF_ARG_LEN)
        digest = _mb.read_bytes(buf, OFF_DIGEST, DIGEST_SIZE)
        r0 = r1 = 0
        error = 0
        message = ""
        try:
            if n > MAILBOX_ARGS_CAPACITY:
                raise ValueError(f"control payload length {n} exceeds {MAILBOX_ARGS_CAPACITY}")
            payload = _mb.read_bytes(buf, OFF_ARGS, n)
            r0, r1 = self.control(op, digest, payload)
        except BaseException as exc:
            error = ERR_CONTROL
            message = self.control_error_text(exc)
        _mb.store64(buf, CTRL_OFF_RESULT0, r0)
        _mb.store64(buf, CTRL_OFF_RESULT1, r1)
        _mb.store32(buf, OFF_ERROR, error)
        data = message.encode(errors="replace")[: ERRMSG_SIZE - 1] + b"\0"
        _mb.write_bytes(buf, OFF_ERRMSG, data)
        # Never overwrite a SHUTDOWN that arrived meanwhile.
        _mb.cas32(buf, OFF_STATE, CONTROL_REQUEST, CONTROL_DONE)
        self.ctx.doorbell.ring_if_parked()

    def control_error_text(self, exc: BaseException) -> str:
        """The text a failed control reports to the parent (at most 255 bytes arrive)."""
        return f"{type(exc).__name__}: {exc}"

    def control(self, op: int, digest: bytes, payload: bytes) -> tuple[int, int]:
        if op == ControlOp.PING:
            return os.getpid(), self.tasks_done
        if op == ControlOp.STATS:
            return self.tasks_done, len(self.table)
        if op == ControlOp.REGISTER_IMPORT:
            path, policy = decode_import_control(payload)
            return self.table.add(digest, resolve_import(*parse_import_path(path), policy)), 0
        if op == ControlOp.REGISTER_CHIP:
            return self.table.add(digest, load_spec(payload.decode(), None)), 0
        if op == ControlOp.RELOAD_IMPORT:
            # Only what this child holds is reloaded: a digest it does not know would
            # otherwise be registered here behind the parent registry's back.
            if self.table.resolve(digest) is None:
                raise KeyError(not_registered_message(digest))
            path, policy = decode_import_control(payload)
            return self.table.add(digest, reload_import(*parse_import_path(path), policy)), 0
        if op == ControlOp.REGISTER_SERIALIZED:
            return self.table.add(digest, load_spec(None, payload)), 0
        if op in (ControlOp.UNREGISTER, ControlOp.UNREGISTER_CHIP):
            if not self.table.remove(digest):
                raise KeyError(not_registered_message(digest))
            return 0, 0
        raise ValueError(f"unknown control op {op}")

    def shutdown(self) -> None:
        buf = self.buf
        frames = TASK_FRAMES[:2] if self.ctx.task_frames == 2 else (self.frame,)
        for frame in frames:
            # Two frames: claim it first (the parent may withdraw a queued task).
            if (
                _mb.cas32(buf, frame + OFF_STATE, TASK_READY, TASK_LAUNCHED)
                if len(frames) == 2
                else _mb.load32(buf, frame) == TASK_READY
            ):
                write_failure(
                    buf,
                    frame,
                    TASK_FAILED,
                    ERR_SHUTDOWN,
                    f"{self.ctx.label} shut down before running the task",
                )
                self.ctx.doorbell.ring_if_parked()


def run_child(ctx: ChildContext) -> int:
    return MailboxLoop(ctx).run()
