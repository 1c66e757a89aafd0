"""Callable identity: descriptors, hashids, the parent registry, the child slot table.

``hashid = "sha256:" + hex(sha256(descriptor))``; the descriptor is canonical::

    u32 schema version (1) | u32 kind | fields, each u32 length + bytes   (little-endian)

    PYTHON_IMPORT (3):     module, qualname
    PYTHON_SERIALIZED (2): sha256 of the cloudpickle serialization
    CHIP_CALLABLE (1):     platform, runtime, sha256(kernel payload), sha256(signature)

Frames carry the raw 32-byte digest. A child resolves it to a private slot;
no child slot number ever crosses the mailbox. The parent registry counts
references and keeps a tombstone while an unregister is being confirmed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import importlib.machinery
import os
import re
import struct
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Final, Literal

import cloudpickle

from simpler_daemon.errors import RegistrationError

SCHEMA_VERSION: Final = 1
HASHID_PREFIX: Final = "sha256:"
_HASHID_RE: Final = re.compile(r"^sha256:[0-9a-f]{64}$")
_IDENT_RE: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DEFAULT_SLOT_CAPACITY: Final = 4096

Role = Literal["sub", "chip", "orchestration"]


class CallableKind(IntEnum):
    CHIP_CALLABLE = 1
    PYTHON_SERIALIZED = 2
    PYTHON_IMPORT = 3


def _lp(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def make_descriptor(kind: CallableKind, *fields: bytes) -> bytes:
    return struct.pack("<II", SCHEMA_VERSION, int(kind)) + b"".join(_lp(f) for f in fields)


def import_descriptor(module: str, qualname: str) -> bytes:
    return make_descriptor(CallableKind.PYTHON_IMPORT, module.encode(), qualname.encode())


def serialized_descriptor(payload: bytes) -> bytes:
    return make_descriptor(CallableKind.PYTHON_SERIALIZED, hashlib.sha256(payload).digest())


def chip_descriptor(platform: str, runtime: str, kernel_payload: bytes, signature: bytes) -> bytes:
    return make_descriptor(
        CallableKind.CHIP_CALLABLE,
        platform.encode(),
        runtime.encode(),
        hashlib.sha256(kernel_payload).digest(),
        hashlib.sha256(signature).digest(),
    )


def hashid_of(descriptor: bytes) -> str:
    return HASHID_PREFIX + hashlib.sha256(descriptor).hexdigest()


def digest_of(hashid: str) -> bytes:
    """Raw digest of a hashid; ``RegistrationError(HASHID_FORMAT_INVALID)`` when malformed."""
    if not isinstance(hashid, str) or not _HASHID_RE.match(hashid):
        raise RegistrationError(
            "HASHID_FORMAT_INVALID",
            f"hashid {hashid!r} is not 'sha256:' followed by 64 lowercase hex digits",
        )
    return bytes.fromhex(hashid[len(HASHID_PREFIX) :])


def hashid_of_digest(digest: bytes) -> str:
    return HASHID_PREFIX + digest.hex()


def verify_hashid(hashid: str, descriptor: bytes) -> None:
    """Raise ``HASHID_DESCRIPTOR_MISMATCH`` when ``hashid`` does not name ``descriptor``."""
    digest_of(hashid)
    actual = hashid_of(descriptor)
    if actual != hashid:
        raise RegistrationError(
            "HASHID_DESCRIPTOR_MISMATCH",
            f"hashid {hashid} does not match its descriptor ({actual})",
        )


def parse_import_path(target: str) -> tuple[str, str]:
    """Split ``module:qualname``; ``RegistrationError(HASHID_FORMAT_INVALID)`` when malformed."""
    text = target.strip() if isinstance(target, str) else ""
    parts = text.split(":")
    if len(parts) != 2:
        raise RegistrationError(
            "HASHID_FORMAT_INVALID",
            f"import path {target!r} must be 'module:qualname' with exactly one colon",
        )
    module, qualname = parts
    if (
        not module
        or module.startswith(".")
        or not all(_IDENT_RE.match(p) for p in module.split("."))
    ):
        raise RegistrationError(
            "HASHID_FORMAT_INVALID",
            f"import path {target!r}: module {module!r} must be an absolute dotted name",
        )
    if not qualname or not all(_IDENT_RE.match(p) for p in qualname.split(".")):
        raise RegistrationError(
            "HASHID_FORMAT_INVALID",
            f"import path {target!r}: qualname {qualname!r} must be dotted identifiers "
            "(no <locals>)",
        )
    return module, qualname


def module_allowed(module: str, allowed: Sequence[str]) -> bool:
    """Whether ``module`` lies under an allow-list entry.

    ``"pkg"`` and ``"pkg."`` both allow ``pkg`` itself and every ``pkg.x`` below it,
    never ``pkgfoo``: a prefix always ends at a dot.
    """
    for entry in allowed:
        base = entry[:-1] if entry.endswith(".") else entry
        if base and (module == base or module.startswith(base + ".")):
            return True
    return False


#: The process-wide allow-list (:func:`restrict_imports`); ``None``: unrestricted.
_import_policy: tuple[str, ...] | None = None


def restrict_imports(allowed: Sequence[str] | None) -> None:
    """Make every :func:`resolve_import` of this process (and of the children it forks
    afterwards) apply the allow-list ``allowed``; ``None`` lifts it.

    The daemon sets it before it forks its workers: a child resolves the import paths
    it is sent by itself, and the parent never imports a SUB callable.
    """
    global _import_policy
    _import_policy = None if allowed is None else tuple(allowed)


def import_policy() -> tuple[str, ...] | None:
    """The allow-list :func:`restrict_imports` set, ``None`` when there is none."""
    return _import_policy


def resolve_import(
    module: str, qualname: str, allowed: Sequence[str] | None = None
) -> Callable[..., Any]:
    """Import ``module`` and walk ``qualname``; raises ImportError/AttributeError/TypeError.

    Under an allow-list (``allowed``, else the one of :func:`restrict_imports`) the
    target must be a function defined in an allowed module, or a method of a class
    defined in one (``Cls.m``): a ``PermissionError`` naming the path and the reason
    otherwise (see :func:`_resolve_allowed`).
    """
    policy = _import_policy if allowed is None else tuple(allowed)
    if policy is not None:
        return _resolve_allowed(module, qualname, policy)
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{module}:{qualname} is a {type(obj).__name__}, not a callable")
    return obj  # type: ignore[no-any-return]


#: What an allow-listed import path may name: a Python function, a bound method (a
#: classmethod reached through its class) or a C function.
_FUNCTION_TYPES: Final = (types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def _allowed_text(allowed: Sequence[str]) -> str:
    return ", ".join(allowed) or "nothing"


def _resolve_allowed(module: str, qualname: str, allowed: tuple[str, ...]) -> Callable[..., Any]:
    """The allow-listed walk: checking only the module is not enough, since an attribute
    chain reaches anything the module imported (``tasks:np.f2py.subprocess.Popen``).

    * the module is under ``allowed``;
    * the first name is looked up in the module's own namespace (no module
      ``__getattr__``, which may import more code);
    * every step before the last is a class whose ``__module__`` is allowed, never
      a module;
    * the target is a Python function, a method, or a C function, whose
      ``__module__`` is allowed (``os.system`` imported into an allowed module is
      still ``posix``'s).
    """
    path = f"{module}:{qualname}"
    if not module_allowed(module, allowed):
        raise PermissionError(
            f"cannot use {path}: module {module!r} is not under the allowed modules "
            f"({_allowed_text(allowed)})"
        )
    obj: Any = importlib.import_module(module)
    walked = ""
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        if isinstance(obj, types.ModuleType):
            try:
                obj = vars(obj)[part]
            except KeyError:
                raise AttributeError(f"module {module!r} has no attribute {part!r}") from None
        else:
            obj = getattr(obj, part)
        walked = f"{walked}.{part}" if walked else part
        if isinstance(obj, types.ModuleType):
            raise PermissionError(
                f"cannot use {path}: {walked!r} is the module {obj.__name__!r}; a qualname "
                "must not reach into another module"
            )
        if i < len(parts) - 1 and not isinstance(obj, type):
            raise PermissionError(
                f"cannot use {path}: {walked!r} is of type {type(obj).__name__}, not a class "
                "(only a class's methods may be named through a dot)"
            )
        if i == len(parts) - 1 and not isinstance(obj, _FUNCTION_TYPES):
            raise PermissionError(
                f"cannot use {path}: it is of type {type(obj).__name__}, not a function"
            )
        owner = getattr(obj, "__module__", None)
        if not isinstance(owner, str) or not module_allowed(owner, allowed):
            raise PermissionError(
                f"cannot use {path}: {walked!r} is defined in "
                f"{'no module' if owner is None else repr(owner)}, outside the allowed "
                f"modules ({_allowed_text(allowed)})"
            )
    return obj  # type: ignore[no-any-return]


def reload_import(
    module: str, qualname: str, allowed: Sequence[str] | None = None
) -> Callable[..., Any]:
    """Re-execute ``module`` from its current source and resolve ``qualname`` in it.

    ``importlib.reload`` keeps the module object (every reference to it sees the new
    code); a module not imported yet is imported. The allow-list (``allowed``, else the
    one of :func:`restrict_imports`) is checked before anything runs. When the new
    source fails (a ``SyntaxError``, an exception at import) that error is raised and
    ``sys.modules`` keeps the module it had.
    """
    policy = _import_policy if allowed is None else tuple(allowed)
    if policy is not None and not module_allowed(module, policy):
        raise PermissionError(
            f"cannot reload {module}:{qualname}: module {module!r} is not under the allowed "
            f"modules ({_allowed_text(policy)})"
        )
    # A file written since the last import may be one the finders' directory caches do
    # not list yet.
    importlib.invalidate_caches()
    loaded = sys.modules.get(module)
    if loaded is not None:
        _drop_bytecode(loaded)
        importlib.reload(loaded)
    return resolve_import(module, qualname, policy)


def _drop_bytecode(module: types.ModuleType) -> None:
    """Remove the cached bytecode of ``module``'s source file, so a reload compiles the
    source: a timestamp ``.pyc`` is trusted when the source's mtime (whole seconds) and
    size match, and an edit within the same second keeping the size would otherwise
    reload the old code. Several children may race here; each recompiles the same
    source, and the ``.pyc`` is written atomically."""
    spec = module.__spec__
    if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
        return
    if spec.cached:
        with contextlib.suppress(OSError):
            os.unlink(spec.cached)


def encode_import_control(import_path: str, policy: Sequence[str] | None) -> bytes:
    """The body of a REGISTER_IMPORT / RELOAD_IMPORT control: the import path, then (on
    a second line) the parent's allow-list, comma-separated, when it has one.

    The child resolves the path under that list rather than the one it inherited at
    fork, so an allow-list the daemon reloaded (SIGHUP) applies to later registrations
    in children forked before it.
    """
    if policy is None:
        return import_path.encode()
    return f"{import_path}\n{','.join(policy)}".encode()


def decode_import_control(body: bytes) -> tuple[str, tuple[str, ...] | None]:
    """``(import path, allow-list or None)`` of :func:`encode_import_control`'s body;
    ``None``: resolve under the child's own (inherited) allow-list."""
    path, sep, policy = body.decode().partition("\n")
    if not sep:
        return path, None
    return path, tuple(e for e in policy.split(",") if e)


def extend_import_path(directories: Sequence[str]) -> None:
    """Put ``directories`` first on ``sys.path``, in their order (an entry already there
    moves to the front). The daemon calls it before it forks its children, which
    inherit it (``callables.python_path``)."""
    for directory in reversed(directories):
        while directory in sys.path:
            sys.path.remove(directory)
        sys.path.insert(0, directory)
    importlib.invalidate_caches()


def importable_path(fn: Callable[..., Any]) -> str | None:
    """``module:qualname`` when importing it yields this very object, else ``None``."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    try:
        if resolve_import(module, qualname) is fn:
            return f"{module}:{qualname}"
    except Exception:
        return None
    return None


@dataclass(frozen=True, slots=True)
class CallableHandle:
    """A registered callable, as returned by ``Worker.register``."""

    hashid: str
    kind: CallableKind
    name: str
    role: Role = "sub"
    #: Raw 32-byte digest (what a frame carries), derived from ``hashid`` once.
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", digest_of(self.hashid))

    def __repr__(self) -> str:
        return f"CallableHandle({self.name!r}, {self.hashid[:19]}…, role={self.role})"

    @classmethod
    def for_import(cls, target: str, kind: Role = "sub") -> CallableHandle:
        """The handle of ``"pkg.mod:fn"`` without registering it: an import path's hashid
        is the same on every host, so an L3 orchestration running inside a remote worker
        names the callables its L4 parent installed there with this."""
        if kind == "chip":
            return spec_for_chip(target).handle
        return spec_for_import(target, kind).handle


@dataclass(frozen=True, slots=True)
class CallableSpec:
    """Everything needed to make a child able to run a callable.

    ``import_path`` or ``payload`` (cloudpickle bytes) says how a child gets
    it after init; ``obj`` is the object itself, inherited through fork when
    the callable is registered before init.
    """

    handle: CallableHandle
    import_path: str | None = None
    payload: bytes | None = None
    obj: Callable[..., Any] | None = None


def spec_for_import(target: str, role: Role = "sub") -> CallableSpec:
    module, qualname = parse_import_path(target)
    desc = import_descriptor(module, qualname)
    handle = CallableHandle(
        hashid_of(desc), CallableKind.PYTHON_IMPORT, f"{module}:{qualname}", role
    )
    return CallableSpec(handle, import_path=f"{module}:{qualname}")


def spec_for_object(fn: Callable[..., Any], role: Role = "sub") -> CallableSpec:
    if not callable(fn):
        raise TypeError(f"cannot register {fn!r}: it is not callable")
    try:
        payload = cloudpickle.dumps(fn, protocol=5)
    except Exception as exc:
        raise RegistrationError(
            "HASHID_DESCRIPTOR_MISMATCH", f"cannot serialize {fn!r} to identify it: {exc}"
        ) from exc
    desc = serialized_descriptor(payload)
    name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    handle = CallableHandle(hashid_of(desc), CallableKind.PYTHON_SERIALIZED, name, role)
    return CallableSpec(handle, import_path=importable_path(fn), payload=payload, obj=fn)


def spec_for_chip(target: str, platform: str = "sim", runtime: str = "python") -> CallableSpec:
    module, qualname = parse_import_path(target)
    path = f"{module}:{qualname}"
    desc = chip_descriptor(platform, runtime, path.encode(), b"kernel(args, config)")
    handle = CallableHandle(hashid_of(desc), CallableKind.CHIP_CALLABLE, path, "chip")
    return CallableSpec(handle, import_path=path)


def load_spec(import_path: str | None, payload: bytes | None) -> Callable[..., Any]:
    """Child side: turn a shipped spec back into a callable."""
    if import_path is not None:
        module, qualname = parse_import_path(import_path)
        return resolve_import(module, qualname)
    if payload is not None:
        fn = cloudpickle.loads(payload)
        if not callable(fn):
            raise TypeError(f"serialized payload is a {type(fn).__name__}, not a callable")
        return fn  # type: ignore[no-any-return]
    raise ValueError("callable spec has neither an import path nor a payload")


# -- parent registry -------------------------------------------------------------------


@dataclass(slots=True)
class Registration:
    spec: CallableSpec
    refcount: int = 1
    state: Literal["pending", "active", "tombstone"] = "active"
    workers: frozenset[int] = field(default_factory=frozenset)
    #: Resolved when the broadcast in progress (a pending registration, or the
    #: unregister a tombstone waits for) ends: identical registrations join it.
    settled: asyncio.Future[None] | None = None
    #: A tombstone whose unregister some live child did not confirm: it may still hold
    #: the callable. Registering it again (installed everywhere) or unregistering it
    #: again (a retry) settles it.
    uncertain: bool = False


class CallableRegistry:
    """Parent-side registry: refcounts, pending registrations and tombstones.

    The Worker drives the broadcast; this object only keeps the bookkeeping
    honest so a hashid is reusable only after every child confirmed.

    ::

        (none) --begin_register--> pending --commit--> active --last unregister--> tombstone
                                      |  abort -> (none), or back to an uncertain tombstone
        tombstone --finish_unregister--> (none)
                  --mark_uncertain--> uncertain tombstone --begin_register / begin_unregister-->
                                      pending / tombstone again (a retry)
    """

    def __init__(self) -> None:
        self._entries: dict[str, Registration] = {}

    def __contains__(self, hashid: str) -> bool:
        entry = self._entries.get(hashid)
        return entry is not None and entry.state == "active"

    def get(self, hashid: str) -> Registration:
        entry = self._entries.get(hashid)
        if entry is None or entry.state != "active":
            raise RegistrationError("NOT_REGISTERED", f"callable {hashid} is not registered")
        return entry

    def lookup(self, hashid: str) -> Registration | None:
        return self._entries.get(hashid)

    def active(self) -> list[Registration]:
        return [e for e in self._entries.values() if e.state == "active"]

    def begin_register(self, spec: CallableSpec, workers: frozenset[int]) -> bool:
        """Start a registration. True: the children must be told; False: refcount bumped."""
        hashid = spec.handle.hashid
        entry = self._entries.get(hashid)
        if entry is None:
            self._entries[hashid] = Registration(spec, 1, "pending", workers)
            return True
        if entry.state == "tombstone" and entry.uncertain:
            # Installing it on every child again makes the uncertain state certain.
            self._check_role(entry, spec)
            entry.state, entry.refcount, entry.workers = "pending", 1, workers
            return True
        if entry.state == "tombstone":
            raise RegistrationError(
                "REGISTER_TOMBSTONE_ACTIVE",
                f"callable {hashid} is still being unregistered; retry once that completes",
            )
        if entry.state == "pending":
            raise RegistrationError(
                "REGISTER_TOMBSTONE_ACTIVE", f"callable {hashid} registration is in progress"
            )
        self._check_role(entry, spec)
        entry.refcount += 1
        return False

    def join_register(self, spec: CallableSpec) -> Registration:
        """One more reference to a registration in progress (``pending``); the caller
        then waits for its ``settled`` future and shares its outcome."""
        entry = self._entries.get(spec.handle.hashid)
        assert entry is not None and entry.state == "pending"
        self._check_role(entry, spec)
        entry.refcount += 1
        return entry

    @staticmethod
    def _check_role(entry: Registration, spec: CallableSpec) -> None:
        if entry.spec.handle.role != spec.handle.role:
            raise RegistrationError(
                "HASHID_DESCRIPTOR_MISMATCH",
                f"callable {spec.handle.hashid} is registered as {entry.spec.handle.role}, "
                f"not {spec.handle.role}",
            )

    def commit_register(self, hashid: str) -> None:
        entry = self._entries[hashid]
        entry.state = "active"
        entry.uncertain = False

    def abort_register(self, hashid: str) -> None:
        entry = self._entries.get(hashid)
        if entry is None or entry.state != "pending":
            return
        if entry.uncertain:
            # A registration over an uncertain tombstone failed: still uncertain.
            entry.state, entry.refcount = "tombstone", 0
        else:
            del self._entries[hashid]

    def begin_unregister(self, hashid: str) -> Registration | None:
        """Drop one reference. Returns the entry when children must be told (now a tombstone)."""
        digest_of(hashid)
        entry = self._entries.get(hashid)
        if entry is None or entry.state == "pending":
            raise RegistrationError("NOT_REGISTERED", f"callable {hashid} is not registered")
        if entry.state == "tombstone" and entry.uncertain:
            entry.uncertain = False  # a retry: the children are asked again
            return entry
        if entry.state == "tombstone":
            raise RegistrationError(
                "UNREGISTER_TOMBSTONE_ACTIVE", f"callable {hashid} is already being unregistered"
            )
        entry.refcount -= 1
        if entry.refcount > 0:
            return None
        entry.state = "tombstone"
        return entry

    def finish_unregister(self, hashid: str) -> None:
        """Every child confirmed: the hashid may be registered again."""
        self._entries.pop(hashid, None)

    def mark_uncertain(self, hashid: str) -> None:
        """The unregister of this tombstone was not confirmed by every live child."""
        entry = self._entries.get(hashid)
        if entry is not None and entry.state == "tombstone":
            entry.uncertain = True

    def clear(self) -> None:
        """Forget every callable (the Worker closed: nothing may keep them alive)."""
        self._entries.clear()


# -- child slot table --------------------------------------------------------------------


class SlotTable:
    """A child's private digest -> slot map, bounded by ``capacity``."""

    def __init__(self, capacity: int = DEFAULT_SLOT_CAPACITY) -> None:
        self.capacity = capacity
        self._by_digest: dict[bytes, int] = {}
        self._slots: list[Callable[..., Any] | None] = []
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._by_digest)

    def add(self, digest: bytes, fn: Callable[..., Any]) -> int:
        slot = self._by_digest.get(digest)
        if slot is not None:
            self._slots[slot] = fn
            return slot
        if self._free:
            slot = self._free.pop()
            self._slots[slot] = fn
        elif len(self._slots) < self.capacity:
            slot = len(self._slots)
            self._slots.append(fn)
        else:
            raise RegistrationError(
                "LOCAL_SLOT_EXHAUSTED",
                f"child holds {self.capacity} callables already; unregister one first",
            )
        self._by_digest[digest] = slot
        return slot

    def remove(self, digest: bytes) -> bool:
        slot = self._by_digest.pop(digest, None)
        if slot is None:
            return False
        self._slots[slot] = None
        self._free.append(slot)
        return True

    def resolve(self, digest: bytes) -> Callable[..., Any] | None:
        slot = self._by_digest.get(digest)
        return None if slot is None else self._slots[slot]

    def slot_of(self, digest: bytes) -> int | None:
        return self._by_digest.get(digest)


def not_registered_message(digest: bytes) -> str:
    return f"callable hash {hashid_of_digest(digest)} not registered"
