"""LocalMailboxEndpoint: drives one forked child through its shared-memory mailbox.

Parent side of the task path (single frame)::

    submit_progress          child                         poll_progress
    publish_task ----------> TASK_READY: run fn(args)
      (payload, trailer,     write error + text
       then state; wakes     store TASK_DONE  ---------->  check trailer identity
       a parked child)       ring doorbell if parked       ACCEPTED, COMPLETED; store IDLE

A SUB endpoint with a queue frame (``queue_frame``) owns both task frames: a dispatch
goes into a free one, the child runs them in dispatch order, and a task queued behind
the other frame's gets its deadline when that one ends (docs/mailbox.md, *Queue frame*).

Two-frame bookkeeping (chip children): a frame published ``prepare_only`` is
stored as PREPARE_READY; FRAME_STAGED is reported once; an activation is
sticky and is published by compare-exchange FRAME_STAGED -> ACTIVATE; the
accepted word is reported once, only when the child set it.

Any stale identity, invalid state, refused publication, dead child or expired
control timeout poisons the endpoint: SHUTDOWN is requested, completions are
withheld until the child has exited, then every owned frame completes with
ENDPOINT_FAILURE (a SUB task the child never picked up with error ``NOT_PICKED_UP``:
the Scheduler queues it again). Later submissions fail.

The parent does not trust the child to stop on its own. While a task is in
flight, each progress round checks (one time comparison; more only when due):

* the task's ``deadline_ms`` (capped by :func:`set_max_task_seconds`, the daemon's
  ``limits.max_task_seconds``): past it plus ``DEADLINE_GRACE_S`` since the frame
  was published (a staged chip frame: since its activation), the child's process
  group is SIGKILLed and the task fails with ``deadline exceeded (N ms)``;
* every ``STOPPED_POLL_S``, the child's ``/proc`` state: stopped (SIGSTOP) for
  ``STOPPED_GRACE_S`` means it is killed and the task fails naming it ``stopped``.

A control that misses its timeout kills the child too (it cannot be trusted to
answer later); its clock runs only while the lane has no task in flight (a child
serves controls between tasks, so a busy child is not a hung one), and so does ``terminate`` (a run cancelled with ``terminate=True``):
its task completes CANCELLED. Either way the dead child is replaced by the normal
path, which logs one WARNING line (``replaced``): ``sub worker 0 (pid N) replaced: <why>``.

A successful SUB task may send a value back: its msgpack bytes in the args area,
their length in ``reserved`` (``publish_task`` zeroes it, so a None return, a chip
kernel or a nested L3 task reads as nothing); the bytes are kept on the task slot.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from simpler_daemon.endpoints.base import (
    EndpointCaps,
    EndpointEvent,
    EventKind,
    Outcome,
    WorkerDispatch,
)
from simpler_daemon.endpoints.taskwatch import (
    DEADLINE_GRACE_S,
    STOPPED_GRACE_S,
    STOPPED_POLL_S,
    deadline_ms_of,
    proc_state,
)
from simpler_daemon.errors import ControlError, EndpointError
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.layout import (
    BASE_FRAME,
    CTRL_OFF_ARG_LEN,
    CTRL_OFF_RESULT0,
    CTRL_OFF_RESULT1,
    CTRL_PAYLOAD_CAPACITY,
    ERR_CANCELLED,
    ERR_DEADLINE,
    ERR_RESULT,
    ERR_SHUTDOWN,
    MAX_RESULT_BYTES,
    OFF_ACCEPTED,
    OFF_ARGS,
    OFF_DIGEST,
    OFF_DISPOSITION,
    OFF_ERRMSG,
    OFF_ERROR,
    OFF_RESERVED,
    OFF_STATE,
    PROTOCOL,
    TASK_FRAMES,
    ControlOp,
    Mailbox,
    MailboxState,
)
from simpler_daemon.mailbox.results import LARGE_RESULT, large_result_error, read_large
from simpler_daemon.taskvalues import DEFAULT_MAX_RESULT_BYTES

if TYPE_CHECKING:
    from simpler_daemon.children.process import ChildProcess

log = logging.getLogger("simpler_daemon.endpoints")

_IDLE: Final = int(MailboxState.IDLE)
_TASK_READY: Final = int(MailboxState.TASK_READY)
_TASK_DONE: Final = int(MailboxState.TASK_DONE)
_TASK_FAILED: Final = int(MailboxState.TASK_FAILED)
_PREPARE_READY: Final = int(MailboxState.PREPARE_READY)
_FRAME_STAGED: Final = int(MailboxState.FRAME_STAGED)
_ACTIVATE: Final = int(MailboxState.ACTIVATE)
_TASK_LAUNCHED: Final = int(MailboxState.TASK_LAUNCHED)
_IN_FLIGHT: Final = frozenset(
    {_TASK_READY, _PREPARE_READY, _FRAME_STAGED, _ACTIVATE, _TASK_LAUNCHED}
)

#: The ``error`` of an ENDPOINT_FAILURE completion whose task the dead SUB child never
#: picked up (see ``LocalMailboxEndpoint.marks_pickup``): it never ran, so the Scheduler
#: queues it again instead of failing it. Not a mailbox code (those are >= 0).
NOT_PICKED_UP: Final = -2
#: How long a poisoned endpoint waits for its child to exit before killing it.
POISON_KILL_AFTER: Final = 2.0
#: The timeout of register / unregister controls (the registration layer passes it).
CONTROL_TIMEOUT_S: Final = 30.0


@dataclass(slots=True)
class ControlResult:
    result0: int
    result1: int


class _Frame:
    __slots__ = (
        "accepted",
        "activate",
        "deadline_at",
        "deadline_ms",
        "dispatch",
        "index",
        "off",
        "staged",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.off = TASK_FRAMES[index]
        self.dispatch: WorkerDispatch | None = None
        self.staged = False
        self.accepted = False
        self.activate = False
        self.deadline_ms = 0
        #: ``time.monotonic()`` past which the task is killed; 0.0: no deadline (yet).
        self.deadline_at = 0.0


class LocalMailboxEndpoint:
    """One lane's transport to one local child (SUB, chip or nested Worker)."""

    #: The largest return value read back (``Worker(max_result_bytes=)``); more: refused.
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES

    def __init__(
        self,
        worker_id: int,
        mailbox: Mailbox,
        child: ChildProcess | None,
        *,
        task_frame_count: int = 1,
        label: str | None = None,
        marks_pickup: bool = False,
        queue_frame: bool = False,
    ) -> None:
        if task_frame_count not in (1, 2):
            raise ValueError(f"cannot create endpoint: task_frame_count={task_frame_count}")
        if queue_frame and task_frame_count != 1:
            raise ValueError("cannot create endpoint: a queue frame is for single-frame SUB lanes")
        self.worker_id = worker_id
        self.mailbox = mailbox
        self.buf = mailbox.buf
        self.child = child
        self.label = label or f"worker {worker_id}"
        self.caps = EndpointCaps(task_frame_count, task_frame_count == 2, task_frame_count)
        #: The child sets a task frame's ``accepted`` word when it picks the task up (a
        #: SUB child, ``children/sub.py``): a task the dead child never picked up completes
        #: with error ``NOT_PICKED_UP``, and the Scheduler queues it again.
        self.marks_pickup = marks_pickup
        #: A SUB child with a queue frame (``MailboxLoop.run``): one task frame holds the
        #: lane's next task (published by the SUB pump) while the other's runs. The lane's
        #: capacity stays 1: the queued task is the lane's ``staged`` dispatch.
        self.queue_frame = queue_frame
        self._frames = [_Frame(i) for i in range(2 if queue_frame else task_frame_count)]
        self._owned = 0
        self._lock = threading.Lock()
        self.poison_reason: str | None = None
        self._poisoned_at = 0.0
        self.stopping = False
        self._control_op: ControlOp | None = None
        #: The control's timeout (None: none). Its clock runs only while no task is in
        #: flight on this lane (see ``_control_expired``).
        self._control_timeout: float | None = None
        #: ``time.monotonic()`` past which the control has timed out; None while the clock
        #: is paused (a task in flight) or there is no timeout.
        self._control_deadline: float | None = None
        #: ``tasks_completed`` when the control's clock last (re)started.
        self._control_tasks_seen = 0
        self.tasks_completed = 0
        #: Next ``time.monotonic()`` at which a round looks at deadlines and the child's
        #: state (only while a task is in flight).
        self._watch_at = 0.0
        self._stopped_since: float | None = None
        #: (outcome, error, message) of a task the endpoint ended itself (its deadline
        #: passed, or ``terminate`` stopped it), by frame index.
        self._failure: dict[int, tuple[Outcome, int, str]] = {}
        self._config = b""
        self._config_deadline_ms = 0

    # -- state --------------------------------------------------------------------------

    @property
    def poisoned(self) -> bool:
        return self.poison_reason is not None

    def owned(self) -> int:
        return self._owned

    def who(self) -> str:
        pid = f" (pid {self.child.pid})" if self.child is not None else ""
        return f"{self.label}{pid}"

    def poison(self, reason: str) -> None:
        """Mark the endpoint unusable; completions wait until the child has exited."""
        if self.poison_reason is None:
            self.poison_reason = reason
            self._poisoned_at = time.monotonic()
            # INFO: what follows says how it ends, at WARNING (``replaced``) or ERROR (the
            # pool gives the lane up).
            log.info("endpoint %s poisoned: %s", self.who(), reason)
        self.mailbox.request_shutdown()

    # -- task path --------------------------------------------------------------------------

    def frame_for(self, d: WorkerDispatch) -> _Frame:
        if len(self._frames) == 1:
            return self._frames[0]
        if self.queue_frame:  # any free frame: the child runs them in dispatch order
            f0 = self._frames[0]
            return f0 if f0.dispatch is None else self._frames[1]
        index: int = d.task_slot.lease_slot & 1
        return self._frames[index]

    def submit_progress(self, d: WorkerDispatch) -> None:
        """Publish one dispatch. Raises ``EndpointError`` naming the reason on refusal."""
        if self.poison_reason is not None:
            raise EndpointError(
                f"cannot submit to {self.who()}: endpoint poisoned ({self.poison_reason})"
            )
        if self.stopping:
            raise EndpointError(f"cannot submit to {self.who()}: endpoint is stopping")
        if d.prepare_only and not self.caps.supports_frame_staging:
            raise EndpointError(f"cannot stage on {self.who()}: it has a single task frame")
        fr = self.frame_for(d)
        if fr.dispatch is not None:
            raise EndpointError(
                f"cannot submit to {self.who()}: task frame {fr.index} is owned by dispatch "
                f"{fr.dispatch.dispatch_id}"
            )
        slot = d.task_slot
        state = _PREPARE_READY if d.prepare_only else _TASK_READY
        try:
            with self._lock:
                _mb.publish_task(
                    self.buf,
                    fr.off,
                    state,
                    slot.config_bytes,
                    slot.lease_slot,
                    slot.lease_generation,
                    slot.digest,
                    slot.blobs[d.group_index],
                    PROTOCOL,
                    slot.run_id,
                    slot.slot_id,
                    slot.lease_generation,
                    d.dispatch_id,
                )
        except ValueError as exc:
            if "not idle" in str(exc):
                self.poison(f"publication into a non-idle task frame {fr.index}: {exc}")
                raise EndpointError(f"cannot submit to {self.who()}: {exc}") from exc
            raise EndpointError(f"cannot submit to {self.who()}: {exc}") from exc
        fr.dispatch = d
        fr.staged = False
        fr.accepted = False
        # Activation is implied by TASK_READY; only a staged successor needs ACTIVATE.
        fr.activate = False
        config = slot.config_bytes
        if config is not self._config:  # configs are shared by many tasks: parse once
            self._config = config
            self._config_deadline_ms = deadline_ms_of(config)
        ms = fr.deadline_ms = self._config_deadline_ms
        now = time.monotonic()
        if not self._owned:
            self._watch_at = now + STOPPED_POLL_S
            self._stopped_since = None
        # A staged frame's deadline starts at its activation: the kernel has not begun.
        fr.deadline_at = 0.0
        if ms and not d.prepare_only and not (self._owned and self.queue_frame):
            self._arm(fr, now)
        self._owned += 1

    def fast_adopt(self, d: WorkerDispatch, published_at: float, index: int = 0) -> None:
        """A task the SUB pump published into task frame ``index`` at ``published_at`` (a
        ``time.monotonic()`` value; ``subpump.py``) and that is still in flight: from now
        on it is the frame's dispatch, with its deadline and child watch, exactly as
        ``submit_progress`` leaves one. A task queued behind the other frame's (a queue
        frame) gets its deadline when that one ends (``_started``): it has not begun."""
        fr = self._frames[index]
        fr.dispatch = d
        fr.staged = False
        fr.accepted = False
        fr.activate = False
        config = d.task_slot.config_bytes
        if config is not self._config:
            self._config = config
            self._config_deadline_ms = deadline_ms_of(config)
        ms = fr.deadline_ms = self._config_deadline_ms
        if not self._owned:
            self._watch_at = published_at + STOPPED_POLL_S
            self._stopped_since = None
        fr.deadline_at = 0.0
        if ms and not (self._owned and self.queue_frame):
            self._arm(fr, published_at)
        self._owned += 1

    def fast_release(self, d: WorkerDispatch) -> None:
        """The SUB pump completed ``d`` (adopted before) and left its frame IDLE."""
        for fr in self._frames:
            if fr.dispatch is d:
                fr.dispatch = None
                self._owned -= 1
                if self._owned:
                    self._started(time.monotonic())
                return

    def _started(self, now: float) -> None:
        """A queue frame's task starts now (the other frame's ended): its deadline runs."""
        for fr in self._frames:
            if fr.dispatch is not None and fr.deadline_ms and not fr.deadline_at:
                self._arm(fr, now)

    def _arm(self, fr: _Frame, now: float) -> None:
        fr.deadline_at = now + fr.deadline_ms / 1000.0 + DEADLINE_GRACE_S
        self._watch_at = min(self._watch_at, fr.deadline_at)

    def activate_progress(self, dispatch_id: int) -> bool:
        """Record permission to launch a staged frame; published once it is FRAME_STAGED."""
        for fr in self._frames:
            if fr.dispatch is not None and fr.dispatch.dispatch_id == dispatch_id:
                fr.activate = True
                if fr.deadline_ms and not fr.deadline_at:
                    self._arm(fr, time.monotonic())
                if self.poison_reason is None:
                    _mb.cas32(
                        self.buf, fr.off + OFF_STATE, _FRAME_STAGED, _ACTIVATE
                    ) and _mb.wake_child(self.buf)
                return True
        return False

    def poll_progress(self, out: list[EndpointEvent]) -> None:
        """Append FRAME_STAGED / ACCEPTED / COMPLETED events; never blocks."""
        if not self._owned:
            return
        if self.poison_reason is not None:
            self._drain_poisoned(out)
            return
        buf = self.buf
        for fr in self._frames:
            d = fr.dispatch
            if d is None:
                continue
            st = _mb.load32(buf, fr.off)
            if st in (_TASK_DONE, _TASK_FAILED):
                self._complete(fr, d, out)
            elif st in _IN_FLIGHT:
                if st == _FRAME_STAGED:
                    if not fr.staged:
                        fr.staged = True
                        disp = _mb.load32(buf, fr.off + OFF_DISPOSITION)
                        out.append(EndpointEvent(EventKind.FRAME_STAGED, d, disposition=disp))
                    if fr.activate and _mb.cas32(buf, fr.off, _FRAME_STAGED, _ACTIVATE):
                        _mb.wake_child(buf)
                elif (
                    st == _TASK_LAUNCHED
                    and not fr.accepted
                    and _mb.load32(buf, fr.off + OFF_ACCEPTED)
                ):
                    fr.accepted = True
                    out.append(EndpointEvent(EventKind.ACCEPTED, d))
            else:
                self.poison(
                    f"invalid state {st} in task frame {fr.index} for dispatch {d.dispatch_id}"
                )
        self.watch_progress(out)

    def watch_progress(self, out: list[EndpointEvent]) -> None:
        """The child's side of ``poll_progress`` (never blocks): while a task is in flight,
        sample the child's exit, its deadline and its SIGSTOP state; drain a poisoned
        endpoint. The SUB pump calls it for a lane whose frames it polled itself."""
        buf = self.buf
        child = self.child
        if self._owned and self.poison_reason is None and child is not None:
            now = time.monotonic()
            # ``child.sample(now)``, called only when it would look (once per round).
            if (child.status is not None or now >= child.next_sample) and child.sample(now):
                # A frame the child finished before it exited is a result, not a casualty.
                for fr in self._frames:
                    d = fr.dispatch
                    if (
                        d is not None
                        and self.poison_reason is None
                        and _mb.load32(buf, fr.off) in (_TASK_DONE, _TASK_FAILED)
                    ):
                        self._complete(fr, d, out)
                self.poison(f"child {child.describe()}")
            elif now >= self._watch_at:
                self._watch(child, now)
        if self.poison_reason is not None:
            self._drain_poisoned(out)

    def _watch(self, child: ChildProcess, now: float) -> None:
        """Kill the child of a task past its deadline, or stopped for too long."""
        for fr in self._frames:
            if fr.dispatch is not None and fr.deadline_at and now >= fr.deadline_at:
                text = (
                    f"{self.who()}: deadline exceeded ({fr.deadline_ms} ms); "
                    "the child was killed and replaced"
                )
                self._failure[fr.index] = (Outcome.ENDPOINT_FAILURE, ERR_DEADLINE, text)
                self._kill(child, f"deadline exceeded ({fr.deadline_ms} ms)")
                return
        if proc_state(child.pid) == "T":
            if self._stopped_since is None:
                self._stopped_since = now
            elif now - self._stopped_since >= STOPPED_GRACE_S:
                self._kill(
                    child,
                    f"child {self.who()} was stopped (SIGSTOP) for "
                    f"{now - self._stopped_since:.1f} s with a task in flight; it was killed",
                )
                return
        else:
            self._stopped_since = None
        self._watch_at = now + STOPPED_POLL_S
        for fr in self._frames:
            if fr.dispatch is not None and fr.deadline_at:
                self._watch_at = min(self._watch_at, fr.deadline_at)

    def terminate(self, d: WorkerDispatch, text: str, why: str) -> bool:
        """Stop dispatch ``d`` now: SIGKILL the child's process group (the Scheduler
        replaces the child once it is reaped); ``d`` completes CANCELLED with ``text``, and
        the endpoint is poisoned with ``why``. False (nothing done) when ``d`` is not in
        flight here or already finished: its completion is a result, not a casualty."""
        child = self.child
        fr = next((f for f in self._frames if f.dispatch is d), None)
        if fr is None or child is None:
            return False
        if self.poison_reason is None and _mb.load32(self.buf, fr.off) in (
            _TASK_DONE,
            _TASK_FAILED,
        ):
            return False
        self._failure[fr.index] = (Outcome.CANCELLED, ERR_CANCELLED, text)
        self._kill(child, why)
        return True

    def replaced(self, new_pid: int) -> None:
        """The one WARNING line of a replacement (deadline kill, crash, terminate, ...):
        ``sub worker 0 (pid N) replaced: <why>``, N the pid of the child that is gone."""
        log.warning(
            "%s replaced: %s; new pid %d", self.who(), self.poison_reason or "exited", new_pid
        )

    def _kill(self, child: ChildProcess, reason: str) -> None:
        """SIGKILL the child's process group now (the Scheduler replaces it once it is
        reaped) and poison the endpoint."""
        child.signal_group(signal.SIGKILL)
        self.poison(reason)

    def _complete(self, fr: _Frame, d: WorkerDispatch, out: list[EndpointEvent]) -> None:
        (state, error, message, _accepted, disposition, proto, run_id, slot_id, gen, did) = (
            _mb.read_result(self.buf, fr.off)
        )
        slot = d.task_slot
        if (
            proto != PROTOCOL
            or did != d.dispatch_id
            or run_id != slot.run_id
            or slot_id != slot.slot_id
            or gen != slot.lease_generation
        ):
            self.poison(
                f"stale identity in task frame {fr.index}: found run {run_id} slot {slot_id} "
                f"generation {gen} dispatch {did}, expected run {slot.run_id} slot "
                f"{slot.slot_id} generation {slot.lease_generation} dispatch {d.dispatch_id}"
            )
            return
        if error:
            full_len = _mb.load64(self.buf, fr.off + OFF_RESERVED)
            if 0 < full_len <= CTRL_PAYLOAD_CAPACITY:
                message = _mb.read_bytes(self.buf, fr.off + OFF_ARGS, full_len).decode(
                    errors="replace"
                )
            if error == ERR_RESULT:
                member = f" member {d.group_index}" if slot.group_size > 1 else ""
                message = (
                    f"cannot return the result of task {slot.index}{member} "
                    f"({slot.handle.name}): {message}"
                )
        elif state == _TASK_DONE:
            # A SUB callable's return value (publish_task zeroed the word: a None return,
            # a chip kernel and a nested L3 task leave it 0).
            n = _mb.load64(self.buf, fr.off + OFF_RESERVED)
            if n:
                if n & LARGE_RESULT:  # past the frame: in the child's memfd
                    try:
                        slot.set_result(d.group_index, read_large(self, fr.off, n))
                    except (OSError, ValueError) as exc:
                        error, message = ERR_RESULT, large_result_error(slot, d, n, self, exc)
                elif n > MAX_RESULT_BYTES:
                    self.poison(
                        f"result length {n} in task frame {fr.index} exceeds "
                        f"MAX_RESULT_BYTES ({MAX_RESULT_BYTES})"
                    )
                    return
                else:
                    slot.set_result(d.group_index, _mb.read_bytes(self.buf, fr.off + OFF_ARGS, n))
        if not fr.accepted:
            fr.accepted = True
            out.append(EndpointEvent(EventKind.ACCEPTED, d))
        if state == _TASK_DONE and error == 0:
            outcome = Outcome.SUCCESS
        elif error == ERR_SHUTDOWN:
            outcome = Outcome.ENDPOINT_FAILURE
        else:
            outcome = Outcome.TASK_FAILURE
        _mb.store32(self.buf, fr.off, _IDLE)
        fr.dispatch = None
        self._owned -= 1
        self.tasks_completed += 1
        if self._owned and self.queue_frame:
            # The queued task starts now; a child that held it back behind this frame
            # (a failure or a large value: ``MailboxLoop.run``) may be parked: wake it.
            self._started(time.monotonic())
            _mb.wake_child(self.buf)
        out.append(EndpointEvent(EventKind.COMPLETED, d, outcome, error, message, disposition))

    def _drain_poisoned(self, out: list[EndpointEvent]) -> None:
        child = self.child
        if child is not None and not child.poll():
            if time.monotonic() - self._poisoned_at > POISON_KILL_AFTER:
                child.signal_group(signal.SIGKILL)
            return
        reason = self.poison_reason or "endpoint failure"
        for fr in self._frames:
            d = fr.dispatch
            if d is None:
                continue
            fr.dispatch = None
            self._owned -= 1
            # ENDPOINT_FAILURE even for a deadline: the lane lost its child either way; a
            # task stopped by ``terminate`` is CANCELLED.
            failure = self._failure.pop(fr.index, None)
            if failure is None:
                text = f"endpoint failure on {self.who()}: {reason}"
                if self.marks_pickup and self._never_picked_up(fr):
                    failure = (
                        Outcome.ENDPOINT_FAILURE,
                        NOT_PICKED_UP,
                        f"{text}; the child never picked the task up",
                    )
                else:
                    failure = (Outcome.ENDPOINT_FAILURE, -1, text)
            outcome, error, text = failure
            out.append(EndpointEvent(EventKind.COMPLETED, d, outcome, error, text))

    def _never_picked_up(self, fr: _Frame) -> bool:
        """The child (exited now: nothing writes the frame any more) left the task of
        ``fr`` unstarted: still ``TASK_READY`` (or claimed, ``TASK_LAUNCHED``, in a queue
        frame: the claim comes before the pick-up) with the ``accepted`` word 0, or failed
        by the child's way out (``ERR_SHUTDOWN``) before it picked the task up."""
        buf = self.buf
        if _mb.load32(buf, fr.off + OFF_ACCEPTED):
            return False
        st = _mb.load32(buf, fr.off)
        return (
            st == _TASK_READY
            or (st == _TASK_LAUNCHED and self.queue_frame)
            or (st == _TASK_FAILED and _mb.load32(buf, fr.off + OFF_ERROR) == ERR_SHUTDOWN)
        )

    # -- controls ------------------------------------------------------------------------------

    @property
    def control_busy(self) -> bool:
        return self._control_op is not None

    def begin_control(
        self, op: ControlOp, digest: bytes = b"", payload: bytes = b"", timeout: float | None = None
    ) -> None:
        """Publish a control request on the base frame (single-flight).

        Raises ``EndpointError`` when poisoned, stopping or another control is in flight.
        """
        if self.poison_reason is not None:
            raise EndpointError(
                f"cannot send {op.name} to {self.who()}: endpoint poisoned ({self.poison_reason})"
            )
        if self.stopping:
            raise EndpointError(f"cannot send {op.name} to {self.who()}: endpoint is stopping")
        if self._control_op is not None:
            raise EndpointError(
                f"cannot send {op.name} to {self.who()}: {self._control_op.name} in flight"
            )
        if len(payload) > CTRL_PAYLOAD_CAPACITY:
            raise EndpointError(
                f"cannot send {op.name} to {self.who()}: payload of {len(payload)} bytes exceeds "
                f"the control capacity of {CTRL_PAYLOAD_CAPACITY} bytes"
            )
        buf = self.buf
        with self._lock:
            if _mb.load32(buf, BASE_FRAME + OFF_STATE) != _IDLE:
                raise EndpointError(
                    f"cannot send {op.name} to {self.who()}: base frame is in state "
                    f"{MailboxState(_mb.load32(buf, OFF_STATE)).name}"
                )
            _mb.write_bytes(buf, OFF_ARGS, payload)
            _mb.write_bytes(buf, OFF_DIGEST, digest.ljust(32, b"\0"))
            _mb.store64(buf, CTRL_OFF_ARG_LEN, len(payload))
            _mb.store64(buf, CTRL_OFF_RESULT0, 0)
            _mb.store64(buf, CTRL_OFF_RESULT1, 0)
            _mb.store32(buf, OFF_ERROR, 0)
            _mb.write_bytes(buf, OFF_ERRMSG, b"\0")
            _mb.store64(buf, OFF_RESERVED, int(op))
            if not _mb.cas32(buf, OFF_STATE, _IDLE, int(MailboxState.CONTROL_REQUEST)):
                raise EndpointError(f"cannot send {op.name} to {self.who()}: base frame changed")
        _mb.wake_child(buf)
        self._control_op = op
        self._control_timeout = timeout
        self._control_deadline = None
        self._control_tasks_seen = self.tasks_completed
        self._control_expired()  # starts the clock unless a task is in flight

    def poll_control(self) -> ControlResult | None:
        """None while pending; the result once done.

        Raises ``ControlError`` when the child reports failure (endpoint stays
        healthy) and ``EndpointError`` when the child died or the timeout
        expired (endpoint poisoned).
        """
        op = self._control_op
        if op is None:
            raise EndpointError(f"no control in flight on {self.who()}")
        buf = self.buf
        # Sample the exit before the state: a child may publish CONTROL_DONE, then exit.
        exited = self.child is not None and self.child.poll()
        st = _mb.load32(buf, OFF_STATE)
        if st == MailboxState.CONTROL_DONE:
            error = _mb.load32(buf, OFF_ERROR)
            res = ControlResult(
                _mb.load64(buf, CTRL_OFF_RESULT0), _mb.load64(buf, CTRL_OFF_RESULT1)
            )
            message = _mb.read_result(buf, BASE_FRAME)[2]
            _mb.cas32(buf, OFF_STATE, int(MailboxState.CONTROL_DONE), _IDLE)
            self._control_op = None
            if error:
                raise ControlError(f"{op.name.lower()} failed on child {self.who()}: {message}")
            return res
        if st != MailboxState.CONTROL_REQUEST:
            self._control_op = None
            if st == MailboxState.SHUTDOWN:
                raise EndpointError(f"cannot complete {op.name}: {self.who()} is shutting down")
            self.poison(f"invalid base state {st} during {op.name}")
            raise EndpointError(f"cannot complete {op.name} on {self.who()}: invalid state {st}")
        if exited and self.child is not None:
            self._control_op = None
            self.poison(f"child {self.child.describe()} during {op.name}")
            raise EndpointError(f"cannot complete {op.name}: child {self.child.describe()}")
        if self._control_expired():
            self._control_op = None
            # A child that does not answer cannot be trusted to answer later: kill it, so
            # its lane is replaced (a replacement replays the registrations).
            if self.child is not None:
                self._kill(self.child, f"{op.name} timed out; completion uncertain")
            else:
                self.poison(f"{op.name} timed out; completion uncertain")
            raise EndpointError(f"cannot complete {op.name} on {self.who()}: timed out")
        return None

    def _control_expired(self) -> bool:
        """Whether the control in flight has missed its timeout. The clock runs only while
        no task is in flight on this lane: a child serves controls only between tasks (a
        chip child defers registry-changing ones while a frame is live), so a child busy
        with a legitimate task is not hung, and killing it would fail that task and every
        other on the lane. A task in flight is watched by its own deadline and the
        SIGSTOP check; once it completes, the control gets the whole timeout again."""
        timeout = self._control_timeout
        if timeout is None:
            return False
        # A task that started and ended between two polls restarts the clock as well.
        if self._owned or self._control_tasks_seen != self.tasks_completed:
            self._control_tasks_seen = self.tasks_completed
            self._control_deadline = None  # paused; restarts when the lane is idle
            if self._owned:
                return False
        now = time.monotonic()
        if self._control_deadline is None:
            self._control_deadline = now + timeout
            return False
        return now > self._control_deadline

    def control_sync(
        self, op: ControlOp, digest: bytes = b"", payload: bytes = b"", timeout: float | None = None
    ) -> ControlResult:
        """Blocking control (for callers outside the event loop)."""
        self._wait_free_sync(op)
        self.begin_control(op, digest, payload, timeout)
        delay = 0.00002
        while True:
            res = self.poll_control()
            if res is not None:
                return res
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    async def control(
        self, op: ControlOp, digest: bytes = b"", payload: bytes = b"", timeout: float | None = None
    ) -> ControlResult:
        """Awaitable control; never blocks the event loop.

        Cancelling the caller does not cancel the control: once published, it is
        polled to its end by a task of its own (the child is working on it, and the
        base frame is busy until it answers), and the next control waits for that.
        Abandoning it instead would leave the control-in-flight flag set for good,
        and every later control (registration for every client) would wait forever.
        """
        delay = 0.0002
        while self._control_op is not None:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.005)
        self.begin_control(op, digest, payload, timeout)
        task = asyncio.ensure_future(self._finish_control(op))
        task.add_done_callback(self._control_settled)
        return await asyncio.shield(task)

    async def _finish_control(self, op: ControlOp) -> ControlResult:
        """Poll the published control ``op`` until it completes, fails or times out."""
        delay = 0.00005
        try:
            while True:
                res = self.poll_control()
                if res is not None:
                    return res
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.005)
        except asyncio.CancelledError:
            # Only the loop's own teardown cancels this task: whether the child applied
            # the control is unknown, so the child cannot be trusted any more.
            if self._control_op is op:
                self._control_op = None
                # After close the mailbox is unmapped and the child gone: nothing to tell
                # (a control queued behind a busy child may still be polled then).
                if not self.mailbox.closed:
                    self.poison(f"{op.name} abandoned; completion uncertain")
            raise

    def _control_settled(self, task: asyncio.Future[ControlResult]) -> None:
        """Retrieve the outcome of a control whose caller may have been cancelled."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.debug("control on %s ended with %s: %s", self.who(), type(exc).__name__, exc)

    def _wait_free_sync(self, op: ControlOp) -> None:
        delay = 0.0002
        while self._control_op is not None:
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    # -- stop -----------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """No publication after this returns; the child is asked to shut down."""
        self.stopping = True
        self.mailbox.request_shutdown()
