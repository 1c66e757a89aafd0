"""The loop inside a nested L3 child: an L4's local NEXT_LEVEL worker.

::

    L4 parent                         L3 child (this loop)                     grandchildren
    fork (after SUB, chips) -------->  init: L4 callables -> own table and inner registry
                                             inner.init()  (forks SUB / chips, waits) --> ready
                                             INIT_READY only now: the subtree is ready
    TASK_READY (digest, args) ------>  resolve digest -> L3 orchestration fn
                                       views on the L4 heap, granted to the inner heap
                                       inner.submit(fn, args, config), wait  ------------> fn(args)
                                       TASK_DONE  (a failure: "child_worker W: <inner chain>")
    CONTROL_REQUEST register ------->  own table (scope T) + inner.register (cascade) -> SUB / chip
    SHUTDOWN ----------------------->  inner.close(): the subtree is reaped, then exit

A control payload starts with a header (``encode_control``): the scope (``T``:
an L4 callable, run here as an L3 orchestration *and* installed into the inner
Worker; ``I``: installed into the inner Worker only, ``register(...,
workers=[i])``) and the inner role. A failed cascade names its path
(``child_worker 1: sub_worker 0: <reason>``).

The child publishes its inner ``list_workers`` rows on a small shared
:class:`StatusPage`, so the L4 lists the subtree without a round trip.
"""

from __future__ import annotations

import json
import mmap
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, cast

from simpler_daemon.args import CallConfig, TaskArgs, args_end, decode_descs
from simpler_daemon.callables import (
    CallableHandle,
    CallableKind,
    CallableSpec,
    Role,
    hashid_of_digest,
    load_spec,
    not_registered_message,
)
from simpler_daemon.children.sub import (
    TASK_DONE,
    ChildContext,
    MailboxLoop,
    format_exception,
    write_failure,
)
from simpler_daemon.errors import RegistrationError, StartupError, TaskError
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.layout import (
    BASE_FRAME,
    ERR_BAD_ARGS,
    ERR_DEADLINE,
    ERR_INIT,
    ERR_NOT_REGISTERED,
    ERR_SHUTDOWN,
    ERR_TASK,
    OFF_SHUTDOWN,
    ControlOp,
    MailboxState,
)
from simpler_daemon.taskvalues import read_section

if TYPE_CHECKING:
    from simpler_daemon.engine.worker import Worker

#: How often a running L3 task looks at its shutdown word and deadline.
_WAIT_SLICE_S: Final = 0.05
#: Minimum spacing of status page refreshes after tasks (controls always refresh).
_STATUS_EVERY_S: Final = 0.05

SCOPE_TABLE: Final = b"T"
SCOPE_INNER: Final = b"I"
_ROLES: Final[tuple[Role, ...]] = ("sub", "chip", "orchestration")
_CONTROL_PREFIX = re.compile(r"^\w+ failed on child .*? \(pid \d+\): ", re.DOTALL)


def encode_control(scope: bytes, role: str, body: bytes = b"") -> bytes:
    """``scope role NUL body``: what a nested child's register/unregister control carries."""
    return scope + role.encode() + b"\0" + body


def decode_control(payload: bytes) -> tuple[bytes, Role, bytes]:
    head, sep, body = payload.partition(b"\0")
    scope, role = head[:1], cast("Role", head[1:].decode(errors="replace"))
    if not sep or scope not in (SCOPE_TABLE, SCOPE_INNER) or role not in _ROLES:
        raise ValueError(f"malformed nested control header {head[:32]!r}")
    return scope, role, body


def control_text(exc: BaseException | str) -> str:
    """A child's own text inside a ``ControlError`` (without the endpoint's prefix)."""
    return _CONTROL_PREFIX.sub("", str(exc), count=1)


class StatusPage:
    """64 KiB of anonymous shared memory: the child writes JSON rows, the parent reads.

    A sequence word makes reads consistent: odd while a write is in progress, and a
    reader retries when it changed under it.
    """

    SIZE: Final = 64 << 10
    _HEAD: Final = 16  # u64 sequence, u64 length

    def __init__(self) -> None:
        self.buf = mmap.mmap(-1, self.SIZE, flags=mmap.MAP_SHARED)

    def write(self, rows: list[dict[str, Any]]) -> None:
        data = json.dumps(rows, default=str).encode()
        if len(data) > self.SIZE - self._HEAD:
            data = b"[]"  # a subtree that large is not worth truncating into invalid JSON
        seq = _mb.load64(self.buf, 0)
        _mb.store64(self.buf, 0, seq + 1)
        self.buf[self._HEAD : self._HEAD + len(data)] = data
        _mb.store64(self.buf, 8, len(data))
        _mb.store64(self.buf, 0, seq + 2)

    def read(self) -> list[dict[str, Any]] | None:
        """The last rows written; ``None`` before the first write (or when torn 10 times)."""
        for _ in range(10):
            seq = _mb.load64(self.buf, 0)
            if seq == 0:
                return None
            if seq & 1:
                continue
            n = _mb.load64(self.buf, 8)
            data = bytes(self.buf[self._HEAD : self._HEAD + min(n, self.SIZE - self._HEAD)])
            if _mb.load64(self.buf, 0) == seq:
                rows: list[dict[str, Any]] = json.loads(data)
                return rows
        return None

    def clear(self) -> None:
        _mb.store64(self.buf, 0, 0)

    def close(self) -> None:
        self.buf.close()


class ParentPins:
    """The inner Scheduler's pins for parent-heap tensors: none (the L4 pins them for
    the whole task), and no remote worker below an L3."""

    def is_remote(self, worker_id: int) -> bool:
        return False

    def describe(self, ref: Any, target: int, where: str) -> Any:
        raise ValueError(f"cannot {where}: a nested L3 worker has no remote workers")

    def pin(self, key: Any) -> None:
        pass

    def unpin(self, key: Any) -> None:
        pass

    def check_installed(self, handle: Any, targets: list[int], api: str) -> None:
        pass  # no remote target below an L3


@dataclass
class NestedContext(ChildContext):
    """A ChildContext plus the inner Worker (inherited through fork, still NEW)."""

    inner: Worker | None = None
    #: The root startup deadline (CLOCK_MONOTONIC, the same in every process); 0 for a
    #: replacement, which gets a fresh ``startup_timeout``.
    deadline: float = 0.0
    startup_timeout: float = 30.0
    status: StatusPage | None = None
    error_prefix: str = "child_worker"


class NestedLoop(MailboxLoop):
    """The mailbox loop of a nested L3 child (see the module docstring)."""

    ctx: NestedContext

    def __init__(self, ctx: NestedContext) -> None:
        super().__init__(ctx)
        assert ctx.inner is not None
        self.inner: Worker = ctx.inner
        self.prefix = f"child_worker {ctx.worker_id}"
        self._status_at = 0.0

    # -- startup ----------------------------------------------------------------------

    def init(self) -> bool:
        ctx = self.ctx
        inner = self.inner
        # The root's deadline, not a share of what is left of it: startup_timeout counts
        # from the root's init() at every level (the root waits a moment past it for
        # this report, naming the grandchild that was late: pool.NESTED_REPORT_S).
        deadline = ctx.deadline or time.monotonic() + ctx.startup_timeout
        try:
            inner._adopt_in_child(ctx.startup_timeout, deadline)
            for spec in ctx.specs:
                fn = spec.obj if spec.obj is not None else load_spec(spec.import_path, spec.payload)
                self.table.add(spec.handle.digest, fn)
                inner.register_spec(spec)  # enters the snapshot the grandchildren inherit
            if ctx.init_hook is not None:
                ctx.init_hook()
            inner.init()
            assert inner.scheduler is not None
            if inner.scheduler.remote is None:
                inner.scheduler.remote = ParentPins()
        except BaseException as exc:
            text = (
                f"{self.prefix}: {exc}"
                if isinstance(exc, StartupError)
                else f"{self.prefix}: init: {type(exc).__name__}: {exc}"
            )
            _mb.write_result(self.buf, BASE_FRAME, int(MailboxState.INIT_FAILED), ERR_INIT, text)
            return False
        self.publish_status(force=True)
        _mb.write_result(self.buf, BASE_FRAME, int(MailboxState.INIT_READY), 0, "")
        return True

    # -- tasks --------------------------------------------------------------------------

    def run_task(self) -> None:
        buf = self.buf
        frame = self.frame
        error, text = 0, ""
        try:
            (cfg_bytes, _ls, _lg, digest, blob, *_trailer) = _mb.read_task(buf, frame)
            fn = self.table.resolve(digest)
            if fn is None:
                error, text = ERR_NOT_REGISTERED, f"{self.prefix}: {not_registered_message(digest)}"
            else:
                descs, scalars = decode_descs(blob)
                args = TaskArgs()
                for d in descs:
                    args.tensors.append(self.ctx.heap.view(d))
                    args.tags.append(d.tag)
                args.scalars = scalars
                if len(blob) > (end := args_end(blob)):
                    args._values = read_section(blob, end, self.ctx.heap.mmap)
                error, text = self.run_inner(fn, args, CallConfig.decode(cfg_bytes), descs)
        except Exception as exc:  # malformed blob or descriptor: the task fails, not the child
            error, text = ERR_BAD_ARGS, format_exception(f"{self.prefix}: bad args", exc)
        if error:
            write_failure(buf, frame, TASK_DONE, error, text)
        else:
            _mb.write_result(buf, frame, TASK_DONE, 0, "")
        self.tasks_done += 1
        self.ctx.doorbell.ring_if_parked()
        self.publish_status()

    def run_inner(
        self, fn: Any, args: TaskArgs, config: CallConfig, descs: list[Any]
    ) -> tuple[int, str]:
        """``inner.run(fn, args, config)``, watching the shutdown word and the deadline."""
        inner = self.inner
        heap = inner.heap
        heap.grant(descs)
        cancelled: str | None = None
        try:
            handle = inner.submit(fn, args, config)
            limit = time.monotonic() + config.deadline_ms / 1000 if config.deadline_ms else None
            while not handle.done():
                try:
                    handle.wait(_WAIT_SLICE_S)
                except TimeoutError:
                    if handle.done():
                        raise  # the orchestration itself raised TimeoutError
                if handle.done() or cancelled is not None:
                    continue
                if _mb.load32(self.buf, BASE_FRAME) == int(MailboxState.SHUTDOWN) or _mb.load32(
                    self.buf, OFF_SHUTDOWN
                ):
                    cancelled = "shutdown"
                    inner.cancel(handle)
                elif limit is not None and time.monotonic() > limit:
                    cancelled = "deadline"
                    inner.cancel(handle)
            handle.wait(0)  # raises the run's error; no result list is built
        except TaskError as exc:
            if cancelled == "shutdown":
                return ERR_SHUTDOWN, f"{self.prefix}: shut down while running the task: {exc}"
            if cancelled == "deadline":
                return (
                    ERR_DEADLINE,
                    f"{self.prefix}: deadline exceeded ({config.deadline_ms} ms): {exc}",
                )
            return ERR_TASK, f"{self.prefix}: {exc}"
        except BaseException as exc:
            return ERR_TASK, format_exception(self.prefix, exc)
        finally:
            heap.revoke()
        return 0, ""

    def on_idle(self) -> None:
        # Between tasks nothing drives the inner Worker: notice grandchildren that died
        # (their replacement starts now, not at the next task) and refresh the rows.
        try:
            self.inner.poll()
        except Exception:  # housekeeping must never take the L3 child down
            pass
        self.publish_status(force=True)

    def publish_status(self, *, force: bool = False) -> None:
        page = self.ctx.status
        now = time.monotonic()
        if page is None or (not force and now - self._status_at < _STATUS_EVERY_S):
            return
        self._status_at = now
        try:
            page.write(self.inner.list_workers())
        except Exception:  # a status snapshot must never fail a task or a control
            pass

    # -- controls -----------------------------------------------------------------------

    def control(self, op: int, digest: bytes, payload: bytes) -> tuple[int, int]:
        if op in (ControlOp.PING, ControlOp.STATS):
            return super().control(op, digest, payload)
        scope, role, body = decode_control(payload)
        try:
            if op in (
                ControlOp.REGISTER_IMPORT,
                ControlOp.REGISTER_SERIALIZED,
                ControlOp.REGISTER_CHIP,
            ):
                self.register(op, scope, role, digest, body)
            elif op in (ControlOp.UNREGISTER, ControlOp.UNREGISTER_CHIP):
                self.unregister(scope, role, digest)
            else:
                raise ValueError(f"unknown control op {op}")
        finally:
            self.publish_status(force=True)
        return 0, 0

    def register(self, op: int, scope: bytes, role: Role, digest: bytes, body: bytes) -> None:
        hashid = hashid_of_digest(digest)
        if op == ControlOp.REGISTER_SERIALIZED:
            kind, path, payload = CallableKind.PYTHON_SERIALIZED, None, body
        else:
            path, payload = body.decode(), None
            kind = CallableKind.CHIP_CALLABLE if role == "chip" else CallableKind.PYTHON_IMPORT
        spec = CallableSpec(CallableHandle(hashid, kind, path or hashid, role), path, payload)
        added = False
        if scope == SCOPE_TABLE:
            if self.table.resolve(digest) is None:
                added = True
            self.table.add(digest, load_spec(path, payload))
        try:
            self.inner.register_spec(spec)
        except RegistrationError as exc:
            if added:
                self.table.remove(digest)
            raise _PathError(self.cascade_text(exc, role)) from exc
        except BaseException:
            if added:
                self.table.remove(digest)
            raise

    def unregister(self, scope: bytes, role: Role, digest: bytes) -> None:
        hashid = hashid_of_digest(digest)
        if scope == SCOPE_TABLE:
            self.table.remove(digest)
        kind = CallableKind.CHIP_CALLABLE if role == "chip" else CallableKind.PYTHON_IMPORT
        try:
            self.inner.unregister(CallableHandle(hashid, kind, hashid, role))
        except RegistrationError as exc:
            if exc.code == "NOT_REGISTERED":
                raise _PathError(f"{self.prefix}: {not_registered_message(digest)}") from exc
            raise _PathError(self.cascade_text(exc, role)) from exc

    def cascade_text(self, exc: RegistrationError, role: str) -> str:
        """``child_worker W: sub_worker S: <reason>`` for each grandchild that failed."""
        if not exc.failures:
            return f"{self.prefix}: {exc}"
        label = "chip_worker" if role == "chip" else "sub_worker"
        return "; ".join(
            f"{self.prefix}: {label} {w}: {control_text(m)}"
            for w, m in sorted(exc.failures.items())
        )

    def control_error_text(self, exc: BaseException) -> str:
        if isinstance(exc, _PathError):
            return str(exc)
        return f"{self.prefix}: {type(exc).__name__}: {exc}"

    # -- shutdown -----------------------------------------------------------------------

    def shutdown(self) -> None:
        super().shutdown()
        # The subtree goes first; this child exits only once its children are reaped.
        self.inner.close()


class _PathError(Exception):
    """A control failure whose text already names its path."""


def run_nested_child(ctx: NestedContext) -> int:
    return NestedLoop(ctx).run()


__all__ = [
    "SCOPE_INNER",
    "SCOPE_TABLE",
    "NestedContext",
    "StatusPage",
    "control_text",
    "decode_control",
    "encode_control",
    "run_nested_child",
]
