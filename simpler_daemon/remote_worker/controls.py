"""The session runner's state: callables, buffers, imports, and the CONTROL handlers.

No sockets and no loop of its own: :class:`SessionControls` holds the inner
``Worker(level=3)`` and the tables a remote session keeps, and turns one
decoded control (or one TASK's tensors) into side effects on them::

    CONTROL name, body --> SessionControls.handle() --> result bytes | ControlFailure
    TASK tensors       --> SessionControls.task_args() --> TaskArgs (NumPy views on the
                                                           inner heap) | BadTaskArgs
    TASK digest        --> SessionControls.resolve()   --> orchestration fn | None

Tables:

* ``orchestrations``: digest -> orchestration function (the dispatcher registry;
  only committed entries resolve).
* ``installed``: hashid -> :class:`Installed` (kind, target, refcount, the inner
  handle for sub/chip callables); ``pending``: prepared, not yet committed.
* ``own``: buffer id -> heap ``Buffer`` allocated by ``alloc`` (owner = this worker).
* ``imports``: (owner, buffer id, generation, owner's session generation) ->
  :class:`ImportEntry`, a local snapshot of another worker's buffer (a heap buffer of
  its own).

Every tensor and buffer control names the session generation of the buffer's owner;
this session's own buffers answer only to ``session_generation`` (the manifest's): a
reference from before the parent reconnected is refused, never taken for a buffer
this session numbered the same way.

A task runs one at a time (the command lane has one request in flight), so a
``free`` never races a task; buffers still go through the heap's pin counts, so
memory a retiring inner slot holds is released only when that slot retires.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import numpy as np

from simpler_daemon.args import MAX_NDIM, Tag, TaskArgs, TensorDesc, dtype_code
from simpler_daemon.callables import (
    CallableHandle,
    parse_import_path,
    resolve_import,
    spec_for_chip,
    spec_for_import,
)
from simpler_daemon.engine.worker import Worker
from simpler_daemon.errors import ProtocolError
from simpler_daemon.heap import Buffer
from simpler_daemon.remote.manifest import module_allowed
from simpler_daemon.remote.wire import (
    CONTROL_BODIES,
    E_CONTROL_FAILED,
    E_UNKNOWN_CONTROL,
    AllocBody,
    AllocResult,
    BufferKey,
    CopyFrom,
    CopyTo,
    HashidBody,
    ImportBody,
    InlineTensor,
    RegisterPrepare,
    RemoteTensor,
    decode_control_body,
    encode_payload,
)

Kind = Literal["sub", "chip", "orchestration"]
#: (owner, buffer id, generation, the owner's session generation).
ImportKey = tuple[int, int, int, int]

#: Control versions this runner understands.
CONTROL_VERSION = 1

_OPS: dict[str, str] = {
    "register_prepare": "prepare registration",
    "register_commit": "commit registration",
    "register_abort": "abort registration",
    "unregister": "unregister",
    "alloc": "alloc",
    "free": "free",
    "copy_to": "copy_to",
    "copy_from": "copy_from",
    "import": "import",
    "release": "release",
    "stats": "stats",
}


#: Controls that never wait for the inner children: answered without a coroutine.
IMMEDIATE_CONTROLS = frozenset(
    {"alloc", "free", "copy_to", "copy_from", "import", "release", "stats"}
)


class ControlFailure(Exception):
    """A control could not be applied; ``code`` and ``text`` go into the CONTROL_REPLY."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code
        self.text = text


class BadTaskArgs(Exception):
    """A TASK's tensors or scalars do not name valid memory (becomes ``E_BAD_ARGS``)."""


class InstallError(Exception):
    """A callable target is not allowed, does not import, or its hashid differs."""


@dataclass(slots=True)
class Installed:
    """One callable this session knows: from the manifest or a committed registration."""

    hashid: str
    kind: Kind
    target: str
    fn: Callable[..., Any] | None  # the orchestration function (None for sub / chip)
    handle: CallableHandle | None  # the inner Worker's handle (sub / chip)
    refcount: int = 1


@dataclass(slots=True)
class ImportEntry:
    """A local snapshot of another worker's buffer, filled chunk by chunk."""

    buffer: Buffer
    received: int = 0
    complete: bool = False


@dataclass(slots=True)
class Counters:
    tasks: int = 0
    tasks_failed: int = 0
    controls: int = 0
    controls_failed: int = 0
    extra: dict[str, int] = field(default_factory=dict)


def check_target(target: str, kind: Kind, hashid: str, allowed_modules: tuple[str, ...]) -> Any:
    """Allow-list, import and hashid check of one callable target.

    Returns the imported object. Raises :class:`InstallError` with the reason:
    a module outside ``allowed_modules`` (prefixes; empty = nothing allowed), a
    malformed path, an import failure, or a hashid that is not the one
    recomputed from the target.
    """
    try:
        module, qualname = parse_import_path(target)
    except Exception as exc:
        raise InstallError(f"target {target!r} is malformed: {exc}") from exc
    if not module_allowed(module, allowed_modules):
        allowed = ", ".join(repr(p) for p in allowed_modules) or "none"
        raise InstallError(
            f"target {target!r}: module {module!r} is not allowed (allowed prefixes: {allowed})"
        )
    try:
        spec = spec_for_chip(target) if kind == "chip" else spec_for_import(target, kind)
    except Exception as exc:
        raise InstallError(f"target {target!r} is malformed: {exc}") from exc
    if spec.handle.hashid != hashid:
        raise InstallError(
            f"hashid {hashid} does not match target {target!r} (expected {spec.handle.hashid})"
        )
    try:
        return resolve_import(module, qualname, allowed_modules)
    except Exception as exc:
        raise InstallError(
            f"target {target!r} cannot be imported: {type(exc).__name__}: {exc}"
        ) from exc


def _c_strides(shape: list[int], itemsize: int) -> tuple[int, ...]:
    out: list[int] = []
    acc = itemsize
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


class SessionControls:
    """The inner Worker plus the runner's tables; see the module docstring.

    ``inner`` must be initialised (``init()`` done) before any async handler
    runs; :meth:`install` may run before ``init`` (manifest callables).
    """

    def __init__(
        self,
        inner: Worker,
        *,
        worker_id: int,
        host: str,
        allowed_modules: tuple[str, ...],
        session_generation: int = 0,
    ) -> None:
        self.inner = inner
        self.worker_id = worker_id
        self.session_generation = session_generation
        self.host = host
        self.allowed_modules = allowed_modules
        self.orchestrations: dict[bytes, Callable[..., Any]] = {}
        self.installed: dict[str, Installed] = {}
        self.pending: dict[str, Installed] = {}
        self.own: dict[int, Buffer] = {}
        self.imports: dict[ImportKey, ImportEntry] = {}
        self.counters = Counters()
        #: Inline-tensor buffers of the task in flight, freed by :meth:`task_done`.
        self._task_temps: list[Buffer] = []

    @property
    def where(self) -> str:
        return f"worker {self.worker_id} (host {self.host})"

    # -- callables ------------------------------------------------------------------------------

    def install(self, hashid: str, kind: Kind, target: str) -> None:
        """Install a manifest callable before ``inner.init()`` (sub/chip go to the children).

        Raises :class:`InstallError`.
        """
        obj = check_target(target, kind, hashid, self.allowed_modules)
        handle = None
        if kind == "orchestration":
            fn: Callable[..., Any] | None = obj
        else:
            fn = None
            handle = self.inner.register(target, kind=kind)
        self._add_installed(Installed(hashid, kind, target, fn, handle))

    def _add_installed(self, entry: Installed) -> None:
        old = self.installed.get(entry.hashid)
        if old is not None:
            old.refcount += 1
            return
        self.installed[entry.hashid] = entry
        if entry.kind == "orchestration":
            assert entry.fn is not None
            self.orchestrations[bytes.fromhex(entry.hashid.removeprefix("sha256:"))] = entry.fn

    def resolve(self, digest: bytes) -> Callable[..., Any] | None:
        """The committed orchestration function for a TASK digest, or None."""
        return self.orchestrations.get(digest)

    # -- controls -------------------------------------------------------------------------------

    async def handle(self, name: str, version: int, body: bytes) -> bytes:
        """Apply one control and return its result bytes.

        Raises :class:`ControlFailure`: ``E_UNKNOWN_CONTROL`` for a name this
        runner does not know, ``E_CONTROL_FAILED`` ("cannot <op>: <reason>")
        for a bad version, a malformed body or a failed operation.
        """
        if name in IMMEDIATE_CONTROLS:
            return self.handle_now(name, version, body)
        self.counters.controls += 1
        try:
            op, msg = self._decode(name, version, body)
            try:
                return await self._apply_registration(name, msg)
            except ControlFailure:
                raise
            except Exception as exc:
                raise self._failed(op, exc) from exc
        except ControlFailure:
            self.counters.controls_failed += 1
            raise

    def handle_now(self, name: str, version: int, body: bytes) -> bytes:
        """:meth:`handle` for a control of :data:`IMMEDIATE_CONTROLS` (or an unknown name),
        without a coroutine: the runner answers these straight from the read callback."""
        self.counters.controls += 1
        try:
            op, msg = self._decode(name, version, body)
            try:
                return self._apply_now(name, msg)
            except ControlFailure:
                raise
            except Exception as exc:
                raise self._failed(op, exc) from exc
        except ControlFailure:
            self.counters.controls_failed += 1
            raise

    def _failed(self, op: str, exc: Exception) -> ControlFailure:
        return ControlFailure(
            E_CONTROL_FAILED, f"cannot {op} on {self.where}: {type(exc).__name__}: {exc}"
        )

    def _decode(self, name: str, version: int, body: bytes) -> tuple[str, msgspec.Struct | None]:
        if name not in CONTROL_BODIES or name not in _OPS:
            raise ControlFailure(
                E_UNKNOWN_CONTROL, f"cannot apply control {name!r}: unknown on {self.where}"
            )
        op = _OPS[name]
        if version != CONTROL_VERSION:
            raise ControlFailure(
                E_CONTROL_FAILED,
                f"cannot {op}: control version {version} is not supported on {self.where} "
                f"(supported: {CONTROL_VERSION})",
            )
        try:
            return op, decode_control_body(name, body)
        except ProtocolError as exc:
            raise ControlFailure(E_CONTROL_FAILED, f"cannot {op}: malformed body: {exc}") from exc

    async def _apply_registration(self, name: str, msg: msgspec.Struct | None) -> bytes:
        if isinstance(msg, RegisterPrepare):
            await self.register_prepare(msg)
        elif isinstance(msg, HashidBody):
            if name == "register_commit":
                self.register_commit(msg.hashid)
            elif name == "register_abort":
                await self.register_abort(msg.hashid)
            else:
                await self.unregister(msg.hashid)
        return b""

    def _apply_now(self, name: str, msg: msgspec.Struct | None) -> bytes:
        if isinstance(msg, AllocBody):
            return encode_payload(self.alloc(msg))
        if isinstance(msg, BufferKey):
            if name == "free":
                self.free(msg)
            else:
                self.release(msg)
        elif isinstance(msg, CopyTo):
            self.copy_to(msg)
        elif isinstance(msg, CopyFrom):
            return self.copy_from(msg)
        elif isinstance(msg, ImportBody):
            self.import_chunk(msg)
        elif name == "stats":
            return msgspec.msgpack.encode(self.stats())
        return b""

    async def register_prepare(self, msg: RegisterPrepare) -> None:
        """Check and import the target; sub/chip are registered on the inner children now."""
        what = f"cannot prepare registration of {msg.hashid} ({msg.kind} {msg.target!r})"
        if msg.hashid in self.pending:
            raise ControlFailure(E_CONTROL_FAILED, f"{what}: already prepared on {self.where}")
        old = self.installed.get(msg.hashid)
        if old is not None and old.kind != msg.kind:
            raise ControlFailure(
                E_CONTROL_FAILED,
                f"{what}: already installed as {old.kind} on {self.where}",
            )
        try:
            obj = check_target(msg.target, msg.kind, msg.hashid, self.allowed_modules)
        except InstallError as exc:
            raise ControlFailure(E_CONTROL_FAILED, f"{what}: {exc}") from exc
        handle = None
        fn: Callable[..., Any] | None = None
        if msg.kind == "orchestration":
            fn = obj
        else:
            try:
                handle = await self.inner.register_async(msg.target, kind=msg.kind)
            except Exception as exc:
                raise ControlFailure(E_CONTROL_FAILED, f"{what}: {exc}") from exc
        self.pending[msg.hashid] = Installed(msg.hashid, msg.kind, msg.target, fn, handle)

    def register_commit(self, hashid: str) -> None:
        entry = self.pending.pop(hashid, None)
        if entry is None:
            raise ControlFailure(
                E_CONTROL_FAILED,
                f"cannot commit registration of {hashid}: not prepared on {self.where}",
            )
        self._add_installed(entry)

    async def register_abort(self, hashid: str) -> None:
        """Undo a prepare; aborting an unknown hashid is a no-op (abort is idempotent)."""
        entry = self.pending.pop(hashid, None)
        if entry is not None and entry.handle is not None:
            try:
                await self.inner.unregister_async(entry.handle)
            except Exception as exc:
                raise ControlFailure(
                    E_CONTROL_FAILED,
                    f"cannot abort registration of {hashid} on {self.where}: {exc}",
                ) from exc

    async def unregister(self, hashid: str) -> None:
        entry = self.installed.get(hashid)
        if entry is None:
            raise ControlFailure(
                E_CONTROL_FAILED, f"cannot unregister {hashid}: not registered on {self.where}"
            )
        if entry.handle is not None:
            # The inner registry counts references too: one unregister per registration.
            try:
                await self.inner.unregister_async(entry.handle)
            except Exception as exc:
                raise ControlFailure(
                    E_CONTROL_FAILED, f"cannot unregister {hashid} on {self.where}: {exc}"
                ) from exc
        entry.refcount -= 1
        if entry.refcount == 0:
            del self.installed[hashid]
            if entry.kind == "orchestration":
                self.orchestrations.pop(bytes.fromhex(hashid.removeprefix("sha256:")), None)

    # -- buffers --------------------------------------------------------------------------------

    def alloc(self, msg: AllocBody) -> AllocResult:
        try:
            buf = self.inner.heap.alloc_buffer(tuple(msg.shape), msg.dtype)
        except (MemoryError, ValueError) as exc:
            raise ControlFailure(
                E_CONTROL_FAILED,
                f"cannot alloc {msg.dtype}{list(msg.shape)} on {self.where}: {exc}",
            ) from exc
        self.own[buf.buffer_id] = buf
        return AllocResult(buffer_id=buf.buffer_id, generation=buf.generation, nbytes=buf.nbytes)

    def _lost(self, owner: int, buffer_id: int, session: int) -> str:
        return (
            f"buffer {buffer_id} of session {session} of remote worker {owner}, which ended: "
            f"its data is lost ({self.where} is session {self.session_generation})"
        )

    def _own(self, op: str, buffer_id: int, generation: int, session: int) -> Buffer:
        if session != self.session_generation:
            raise ControlFailure(
                E_CONTROL_FAILED, f"cannot {op} {self._lost(self.worker_id, buffer_id, session)}"
            )
        buf = self.own.get(buffer_id)
        if buf is None:
            raise ControlFailure(
                E_CONTROL_FAILED,
                f"cannot {op} buffer {buffer_id} (generation {generation}): "
                f"not allocated on {self.where}",
            )
        if buf.generation != generation:
            raise ControlFailure(
                E_CONTROL_FAILED,
                f"cannot {op} buffer {buffer_id}: generation {generation} is stale "
                f"(current {buf.generation}) on {self.where}",
            )
        return buf

    def free(self, msg: BufferKey) -> None:
        if msg.owner != self.worker_id:
            raise ControlFailure(
                E_CONTROL_FAILED,
                f"cannot free buffer {msg.buffer_id}: it is owned by worker {msg.owner}, "
                f"not {self.where} (release an import instead)",
            )
        buf = self._own("free", msg.buffer_id, msg.generation, msg.session)
        del self.own[msg.buffer_id]
        # The heap defers the release while an inner task slot still pins the buffer.
        self.inner.heap.free(buf)

    def _raw(self, buf: Buffer) -> np.ndarray[Any, Any]:
        """The buffer's bytes as a flat uint8 view."""
        return self.inner.heap.array(buf).reshape(-1).view(np.uint8)[: buf.nbytes]

    def copy_to(self, msg: CopyTo) -> None:
        buf = self._own("copy_to", msg.buffer_id, msg.generation, msg.session)
        end = msg.offset + len(msg.data)
        if end > buf.nbytes:
            raise ControlFailure(
                E_CONTROL_FAILED,
                f"cannot copy_to buffer {msg.buffer_id}: bytes [{msg.offset}, {end}) overrun "
                f"its {buf.nbytes} bytes on {self.where}",
            )
        self._raw(buf)[msg.offset : end] = np.frombuffer(msg.data, dtype=np.uint8)

    def copy_from(self, msg: CopyFrom) -> bytes:
        buf = self._own("copy_from", msg.buffer_id, msg.generation, msg.session)
        end = msg.offset + msg.nbytes
        if end > buf.nbytes:
            raise ControlFailure(
                E_CONTROL_FAILED,
                f"cannot copy_from buffer {msg.buffer_id}: bytes [{msg.offset}, {end}) overrun "
                f"its {buf.nbytes} bytes on {self.where}",
            )
        return self._raw(buf)[msg.offset : end].tobytes()

    def import_chunk(self, msg: ImportBody) -> None:
        """One chunk of a snapshot of another worker's buffer; the first creates the copy."""
        key = (msg.owner, msg.buffer_id, msg.generation, msg.session)
        what = (
            f"cannot import buffer {msg.buffer_id} (generation {msg.generation}) of worker "
            f"{msg.owner} into {self.where}"
        )
        if msg.owner == self.worker_id:
            raise ControlFailure(E_CONTROL_FAILED, f"{what}: this worker owns it")
        entry = self.imports.get(key)
        if entry is None:
            try:
                buf = self.inner.heap.alloc_buffer(tuple(msg.shape), msg.dtype)
            except (MemoryError, ValueError) as exc:
                raise ControlFailure(E_CONTROL_FAILED, f"{what}: {exc}") from exc
            entry = self.imports[key] = ImportEntry(buf)
        elif entry.complete:
            raise ControlFailure(E_CONTROL_FAILED, f"{what}: already imported (release it first)")
        buf = entry.buffer
        if tuple(msg.shape) != buf.shape or np.dtype(msg.dtype).str != buf.dtype:
            raise ControlFailure(
                E_CONTROL_FAILED,
                f"{what}: chunk says {msg.dtype}{list(msg.shape)}, the first chunk said "
                f"{np.dtype(buf.dtype).name}{list(buf.shape)}",
            )
        end = msg.offset + len(msg.data)
        if end > buf.nbytes:
            raise ControlFailure(
                E_CONTROL_FAILED,
                f"{what}: bytes [{msg.offset}, {end}) overrun its {buf.nbytes} bytes",
            )
        self._raw(buf)[msg.offset : end] = np.frombuffer(msg.data, dtype=np.uint8)
        entry.received += len(msg.data)
        if msg.final:
            entry.complete = True

    def release(self, msg: BufferKey) -> None:
        key = (msg.owner, msg.buffer_id, msg.generation, msg.session)
        entry = self.imports.pop(key, None)
        if entry is None:
            raise ControlFailure(
                E_CONTROL_FAILED,
                f"cannot release buffer {msg.buffer_id} (generation {msg.generation}) of worker "
                f"{msg.owner}: not imported on {self.where}",
            )
        self.inner.heap.free(entry.buffer)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "worker_id": self.worker_id,
            "host": self.host,
            "tasks": c.tasks,
            "tasks_failed": c.tasks_failed,
            "controls": c.controls,
            "controls_failed": c.controls_failed,
            "buffers": len(self.own),
            "imports": len(self.imports),
            "callables": len(self.installed),
            "heap_free_bytes": self.inner.heap.free_bytes(),
            "inner_workers": self.inner.list_workers(),
            # 0 for a parent on this host (docs/remote.md, "Latency of one remote task").
            "child_spin_ns": self.inner.child_spin_ns,
        }

    # -- task arguments -------------------------------------------------------------------------

    def task_args(self, tensors: list[RemoteTensor | InlineTensor], scalars: list[int]) -> TaskArgs:
        """Turn a TASK's tensors into NumPy views on the inner heap.

        Raises :class:`BadTaskArgs` naming the tensor index and its key. Inline
        tensors get a fresh heap buffer, freed by :meth:`task_done`.
        """
        args = TaskArgs()
        try:
            for i, t in enumerate(tensors):
                if isinstance(t, InlineTensor):
                    view, tag = self._inline_view(i, t), t.tag
                else:
                    view, tag = self._remote_view(i, t), t.tag
                args.add_tensor(view, Tag(tag))
            for s in scalars:
                args.add_scalar(s)
        except BadTaskArgs:
            self.task_done()
            raise
        except (ValueError, TypeError) as exc:
            self.task_done()
            raise BadTaskArgs(str(exc)) from exc
        return args

    def _inline_view(self, i: int, t: InlineTensor) -> np.ndarray[Any, Any]:
        dt = np.dtype(t.dtype)
        if len(t.shape) > MAX_NDIM:
            raise BadTaskArgs(f"tensor {i} (inline): {len(t.shape)} dims, at most {MAX_NDIM}")
        count = 1
        for d in t.shape:
            count *= d
        if count * dt.itemsize != len(t.data):
            raise BadTaskArgs(
                f"tensor {i} (inline): {len(t.data)} bytes of data for {t.dtype}{list(t.shape)} "
                f"({count * dt.itemsize} bytes)"
            )
        try:
            buf = self.inner.heap.alloc_buffer(tuple(t.shape), dt)
        except MemoryError as exc:
            raise BadTaskArgs(f"tensor {i} (inline): {exc}") from exc
        self._task_temps.append(buf)
        arr = self.inner.heap.array(buf)
        if len(t.data):
            self._raw(buf)[:] = np.frombuffer(t.data, dtype=np.uint8)
        return arr

    def _remote_view(self, i: int, t: RemoteTensor) -> np.ndarray[Any, Any]:
        key = f"tensor {i} (owner {t.owner}, buffer {t.buffer_id}, generation {t.generation})"
        if t.owner == self.worker_id:
            if t.session != self.session_generation:
                raise BadTaskArgs(f"tensor {i} is {self._lost(t.owner, t.buffer_id, t.session)}")
            buf = self.own.get(t.buffer_id)
            if buf is None:
                raise BadTaskArgs(f"{key}: not allocated on {self.where}")
            if buf.generation != t.generation:
                raise BadTaskArgs(f"{key}: stale generation (current {buf.generation})")
        else:
            entry = self.imports.get((t.owner, t.buffer_id, t.generation, t.session))
            if entry is None:
                raise BadTaskArgs(f"{key}: not imported on {self.where}")
            if not entry.complete:
                raise BadTaskArgs(f"{key}: its import is not complete")
            buf = entry.buffer
        dt = np.dtype(t.dtype)
        strides = tuple(t.strides) if t.strides else _c_strides(t.shape, dt.itemsize)
        if len(strides) != len(t.shape):
            raise BadTaskArgs(f"{key}: {len(t.shape)} dims but {len(strides)} strides")
        desc = TensorDesc(
            buf.buffer_id,
            buf.generation,
            buf.offset,
            t.byte_offset,
            buf.nbytes,
            dtype_code(dt),
            tuple(t.shape),
            strides,
        )
        lo, hi = desc.byte_range()
        if lo < 0 or hi > buf.nbytes:
            raise BadTaskArgs(f"{key}: view [{lo}, {hi}) lies outside its {buf.nbytes} bytes")
        if t.nbytes > buf.nbytes:
            raise BadTaskArgs(f"{key}: nbytes {t.nbytes} exceeds the buffer's {buf.nbytes}")
        return np.ndarray(
            tuple(t.shape), dtype=dt, buffer=self._raw(buf), offset=t.byte_offset, strides=strides
        )

    def task_done(self) -> None:
        """Free the inline buffers of the task that just ended (deferred by the heap's pins)."""
        temps, self._task_temps = self._task_temps, []
        for buf in temps:
            if not buf.freed:
                self.inner.heap.free(buf)


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
