"""The chip child loop: one loop over the base frame and both task frames.

::

    active:    IDLE -> TASK_READY    -> FRAME_STAGED -> TASK_LAUNCHED -> TASK_DONE | TASK_FAILED
    successor: IDLE -> PREPARE_READY -> FRAME_STAGED -> ACTIVATE -> TASK_LAUNCHED -> ...

Each iteration: shutdown -> stage every newly visible frame (validate the
trailer, lease slot = frame index, registered digest, args; natively prepare a
successor only while a non-diagnostic predecessor owns the device and the
backend can prepare concurrently) -> observe ACTIVATE (re-validate the trailer)
-> poll the active token, finalize it, publish the result -> launch the
activated frame with the lowest dispatch id (TASK_LAUNCHED before the first
poll) -> controls (registry-mutating ones deferred while native state is
owned) -> idle (spin, then park; the device thread bumps the wake word).

A successor is never launched before its predecessor was polled complete and
finalized. Every prepared token is finalized exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simpler_daemon.args import CallConfig, decode_args
from simpler_daemon.callables import load_spec, not_registered_message
from simpler_daemon.children.backends.base import BackendError
from simpler_daemon.children.backends.sim_chip import SimChipBackend, SimToken
from simpler_daemon.children.sub import (
    CONTROL_REQUEST,
    SHUTDOWN,
    TASK_DONE,
    TASK_FAILED,
    TASK_READY,
    ChildContext,
    MailboxLoop,
    format_exception,
    write_failure,
)
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.layout import (
    BASE_FRAME,
    CONTROL_REQUEST_OPS_MUTATING,
    DIGEST_SIZE,
    ERR_BAD_ARGS,
    ERR_INIT,
    ERR_NOT_REGISTERED,
    ERR_SHUTDOWN,
    ERR_STALE,
    ERR_TASK,
    OFF_ACCEPTED,
    OFF_DIGEST,
    OFF_DISPOSITION,
    OFF_PIPELINE_DEPTH,
    OFF_RESERVED,
    OFF_SHUTDOWN,
    OFF_STATE,
    OFF_WAKE_SEQ,
    PROTOCOL,
    TASK_FRAMES,
    ControlOp,
    Disposition,
    MailboxState,
)

PREPARE_READY = int(MailboxState.PREPARE_READY)
FRAME_STAGED = int(MailboxState.FRAME_STAGED)
ACTIVATE = int(MailboxState.ACTIVATE)
TASK_LAUNCHED = int(MailboxState.TASK_LAUNCHED)


@dataclass
class ChipContext(ChildContext):
    pipeline_depth: int = 2
    trace_path: str | None = None


class _Frame:
    __slots__ = (
        "activated",
        "args",
        "config",
        "digest",
        "dispatch_id",
        "index",
        "kernel",
        "off",
        "token",
        "trailer",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.off = TASK_FRAMES[index]
        self.clear()

    def clear(self) -> None:
        self.trailer: tuple[int, ...] | None = None
        self.dispatch_id = 0
        self.kernel: Any = None
        self.args: Any = None
        self.config: CallConfig | None = None
        self.digest = b""
        self.activated = False
        self.token: SimToken | None = None

    @property
    def live(self) -> bool:
        return self.trailer is not None


class ChipLoop(MailboxLoop):
    """A chip child: NEXT_LEVEL tasks run on a simulated device through the backend."""

    def __init__(self, ctx: ChipContext) -> None:
        super().__init__(ctx)
        self.chip = ctx
        depth = ctx.pipeline_depth
        self.frames = [_Frame(i) for i in range(2 if depth >= 2 else 1)]
        self.active: _Frame | None = None
        self.backend: SimChipBackend | None = None

    def init(self) -> bool:
        buf = self.buf
        try:
            self.backend = SimChipBackend(
                self.ctx.worker_id,
                pipeline_depth=self.chip.pipeline_depth,
                trace_path=self.chip.trace_path,
                on_complete=self._device_done,
            )
            _mb.store32(buf, OFF_PIPELINE_DEPTH, self.backend.pipeline_depth)
        except BaseException as exc:
            _mb.write_result(
                buf,
                BASE_FRAME,
                int(MailboxState.INIT_FAILED),
                ERR_INIT,
                f"{self.ctx.label} init: {type(exc).__name__}: {exc}",
            )
            return False
        return super().init()

    def _device_done(self) -> None:
        _mb.fetch_add32(self.buf, OFF_WAKE_SEQ, 1)
        _mb.futex_wake(self.buf, OFF_WAKE_SEQ, 1)

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        if not self.init():
            return 1
        buf = self.buf
        frames = self.frames
        watch = (
            BASE_FRAME + OFF_STATE,
            OFF_SHUTDOWN,
            OFF_WAKE_SEQ,
            *(f.off + OFF_STATE for f in frames),
        )
        parent = self.ctx.parent_pid
        spin = self.ctx.spin_ns
        import os

        try:
            while True:
                bst = _mb.load32(buf, BASE_FRAME)
                if bst == SHUTDOWN or _mb.load32(buf, OFF_SHUTDOWN):
                    break
                seq = _mb.load32(buf, OFF_WAKE_SEQ)
                did = False
                for fr in frames:
                    did |= self.observe(fr)
                if self.active is not None:
                    did |= self.poll_active()
                if self.active is None:
                    did |= self.try_launch()
                did |= self.prepare_successor()
                if bst == CONTROL_REQUEST and self.control_allowed():
                    self.handle_control()
                    did = True
                if did:
                    continue
                states = tuple(_mb.load32(buf, f.off) for f in frames)
                timeout = 0.002 if self.active is not None else self.ctx.park_timeout
                changed = _mb.child_wait(buf, watch, (bst, 0, seq, *states), spin, timeout)
                # Spin only after something happened: an idle chip child re-parking
                # after a timed-out park spins no more (as the SUB child, sub.py).
                spin = 0 if changed < 0 and self.active is None else self.ctx.spin_ns
                if changed < 0 and parent and os.getppid() != parent:
                    return 0
        finally:
            self.shutdown()
        return 0

    # -- staging -------------------------------------------------------------------------------

    def observe(self, fr: _Frame) -> bool:
        buf = self.buf
        st = _mb.load32(buf, fr.off)
        if fr.live:
            if st == ACTIVATE and not fr.activated:
                trailer = _mb.read_trailer(buf, fr.off)
                if trailer != fr.trailer:
                    self.fail_frame(fr, ERR_STALE, "stale activation identity")
                    return True
                fr.activated = True
                return True
            return False
        if st not in (TASK_READY, PREPARE_READY):
            return False
        try:
            (cfg, lslot, _lgen, digest, blob, proto, run_id, slot_id, gen, did) = _mb.read_task(
                buf, fr.off
            )
        except ValueError as exc:  # a malformed blob header fails the task, not the child
            fr.trailer = _mb.read_trailer(buf, fr.off)
            self.fail_frame(fr, ERR_BAD_ARGS, format_exception("chip_worker: bad args", exc))
            return True
        fr.trailer = (proto, run_id, slot_id, gen, did)
        fr.dispatch_id = did
        fr.digest = digest
        if proto != PROTOCOL:
            self.fail_frame(fr, ERR_STALE, f"frame protocol {proto:#x} is not {PROTOCOL:#x}")
            return True
        if len(self.frames) == 2 and lslot != fr.index:
            self.fail_frame(
                fr, ERR_STALE, f"lease slot {lslot} published into task frame {fr.index}"
            )
            return True
        kernel = self.table.resolve(digest)
        if kernel is None:
            self.fail_frame(fr, ERR_NOT_REGISTERED, not_registered_message(digest))
            return True
        try:
            fr.args = decode_args(blob, self.ctx.heap.view, self.ctx.heap.mmap)
            fr.config = CallConfig.decode(cfg)
        except Exception as exc:
            self.fail_frame(fr, ERR_BAD_ARGS, format_exception("chip_worker: bad args", exc))
            return True
        fr.kernel = kernel
        fr.activated = st == TASK_READY
        disposition = Disposition.VALIDATED
        if not fr.activated and self.may_prepare(fr):
            if not self.native_prepare(fr):
                return True
            disposition = Disposition.PREPARED
        _mb.store32(buf, fr.off + OFF_DISPOSITION, int(disposition))
        _mb.store32(buf, fr.off, FRAME_STAGED)
        if not fr.activated:
            # The parent may already hold a sticky activation for this frame.
            self.ctx.doorbell.ring_if_parked()
        return True

    def may_prepare(self, fr: _Frame) -> bool:
        """Concurrent native prepare: capable backend, an active claim, no diagnostics."""
        backend = self.backend
        active = self.active
        return (
            backend is not None
            and backend.supports_concurrent_prepare
            and active is not None
            and active is not fr
            and fr.config is not None
            and not fr.config.diagnostic
            and active.config is not None
            and not active.config.diagnostic
        )

    def native_prepare(self, fr: _Frame) -> bool:
        assert self.backend is not None
        try:
            fr.token = self.backend.prepare(fr.kernel, fr.args, fr.config, fr.index, fr.dispatch_id)
        except BackendError as exc:
            if exc.token is not None:
                fr.token = exc.token
            self.fail_frame(fr, ERR_TASK, f"chip_worker: prepare failed: {exc}")
            return False
        except Exception as exc:
            self.fail_frame(fr, ERR_TASK, format_exception("chip_worker: prepare failed", exc))
            return False
        return True

    def prepare_successor(self) -> bool:
        for fr in self.frames:
            if fr.live and fr.token is None and not fr.activated and self.may_prepare(fr):
                if self.native_prepare(fr):
                    _mb.store32(self.buf, fr.off + OFF_DISPOSITION, int(Disposition.PREPARED))
                return True
        return False

    # -- launch and completion --------------------------------------------------------------------

    def try_launch(self) -> bool:
        ready = [f for f in self.frames if f.live and f.activated]
        if not ready:
            return False
        fr = min(ready, key=lambda f: f.dispatch_id)
        if _mb.load32(self.buf, fr.off) not in (FRAME_STAGED, ACTIVATE, TASK_READY):
            return False
        if fr.token is None and not self.native_prepare(fr):
            return True
        assert self.backend is not None and fr.token is not None
        buf = self.buf
        _mb.store32(buf, fr.off, TASK_LAUNCHED)
        accepted_off = fr.off + OFF_ACCEPTED

        def on_launch() -> None:
            _mb.store32(buf, accepted_off, 1)

        try:
            self.backend.launch(fr.token, on_launch)
        except BackendError as exc:
            self.fail_frame(fr, ERR_TASK, f"chip_worker: launch failed: {exc}")
            return True
        self.active = fr
        return True

    def poll_active(self) -> bool:
        fr = self.active
        assert fr is not None and fr.token is not None and self.backend is not None
        try:
            if not self.backend.poll(fr.token):
                return False
        except BackendError as exc:
            self.active = None
            self.fail_frame(
                fr,
                ERR_TASK,
                str(exc) if str(exc).startswith("chip_worker") else f"chip_worker: {exc}",
            )
            return True
        self.active = None
        token, fr.token = fr.token, None
        try:
            self.backend.finalize(token)
        except BackendError as exc:
            self.publish(fr, TASK_FAILED, ERR_TASK, f"chip_worker: finalize failed: {exc}")
            return True
        self.publish(fr, TASK_DONE, 0, "")
        return True

    def fail_frame(self, fr: _Frame, code: int, message: str) -> None:
        """Terminal failure of a frame; its token (if any) is finalized exactly once."""
        if self.active is fr:
            self.active = None
        token, fr.token = fr.token, None
        if token is not None and self.backend is not None:
            try:
                self.backend.finalize(token)
            except BackendError as exc:
                message += f"; finalize also failed: {exc}"
        self.publish(fr, TASK_FAILED, code, message)

    def publish(self, fr: _Frame, state: int, error: int, message: str) -> None:
        if len(self.frames) == 1:
            state = TASK_DONE  # single-frame path: failure is error != 0, never TASK_FAILED
        if error:
            write_failure(self.buf, fr.off, state, error, message)
        else:
            _mb.write_result(self.buf, fr.off, state, 0, "")
        fr.clear()
        self.tasks_done += 1
        self.ctx.doorbell.ring_if_parked()

    # -- controls --------------------------------------------------------------------------------

    def control_allowed(self) -> bool:
        op = _mb.load64(self.buf, OFF_RESERVED)
        if op not in CONTROL_REQUEST_OPS_MUTATING:
            return True
        if self.active is not None or any(f.token is not None for f in self.frames):
            return False  # a native run owns state
        if op in (ControlOp.UNREGISTER, ControlOp.UNREGISTER_CHIP):
            digest = _mb.read_bytes(self.buf, OFF_DIGEST, DIGEST_SIZE)
            return not any(f.live and f.digest == digest for f in self.frames)
        return True

    def control(self, op: int, digest: bytes, payload: bytes) -> tuple[int, int]:
        if op == ControlOp.STATS:
            return self.tasks_done, self.chip.pipeline_depth
        if op == ControlOp.REGISTER_CHIP:
            return self.table.add(digest, load_spec(payload.decode(), None)), 0
        return super().control(op, digest, payload)

    # -- shutdown -----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        for fr in self.frames:
            if fr.live:
                self.fail_frame(
                    fr, ERR_SHUTDOWN, f"{self.ctx.label} shut down before the task finished"
                )
            elif _mb.load32(self.buf, fr.off) in (TASK_READY, PREPARE_READY):
                write_failure(
                    self.buf,
                    fr.off,
                    TASK_FAILED,
                    ERR_SHUTDOWN,
                    f"{self.ctx.label} shut down before running the task",
                )
        self.ctx.doorbell.ring_if_parked()
        if self.backend is not None:
            self.backend.close()


def run_chip_child(ctx: ChipContext) -> int:
    return ChipLoop(ctx).run()
