"""Registering a callable on every target after ``init``: on all of them or on none.

::

    register_on_all(registry, spec, targets)
      registry.begin_register --> target.install(spec), one target after the other
        all installed -> registry.commit_register
        any failed    -> target.uninstall(spec) where it was installed, abort_register,
                         RegistrationError(REGISTER_PARTIAL_FAILURE)
                         (REGISTER_CLEANUP_UNCERTAIN when that rollback failed too)

    unregister_on_all(registry, handle, targets_for)
      registry.begin_unregister --> target.uninstall(spec) on every target
        all removed -> registry.finish_unregister
        any failed  -> the hashid stays tombstoned, REGISTER_CLEANUP_UNCERTAIN

``spec_for(fn, kind)`` turns what ``Worker.register`` was given into the spec
(hashid, descriptor) that is broadcast.

A target is anything with a ``worker_id`` and async ``install``/``uninstall``
(``RegistrationTarget``). ``LocalTarget`` reaches a local child through control
ops on its mailbox; a remote worker joins the broadcast by implementing the same
three members. The child pool also uses ``LocalTarget`` to replay registrations
onto a replacement child.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from simpler_daemon.callables import (
    CallableHandle,
    CallableRegistry,
    CallableSpec,
    Role,
    spec_for_chip,
    spec_for_import,
    spec_for_object,
)
from simpler_daemon.endpoints.local import LocalMailboxEndpoint
from simpler_daemon.errors import ControlError, EndpointError, RegistrationError
from simpler_daemon.mailbox import ControlOp


def spec_for(fn: Callable[..., Any] | str, kind: Role) -> CallableSpec:
    """The spec of a callable object or ``"pkg.mod:fn"`` registered as ``kind``."""
    if kind not in ("sub", "chip", "orchestration"):
        raise ValueError(f"cannot register: kind={kind!r} must be 'sub', 'chip' or 'orchestration'")
    if kind == "chip":
        if not isinstance(fn, str):
            raise TypeError("cannot register a chip kernel: pass its import path 'pkg.mod:kernel'")
        return spec_for_chip(fn)
    if isinstance(fn, str):
        return spec_for_import(fn, kind)
    return spec_for_object(fn, kind)


class RegistrationTarget(Protocol):
    """One worker a callable is installed on (a local child or a remote worker)."""

    @property
    def worker_id(self) -> int: ...

    async def install(self, spec: CallableSpec) -> None:
        """Make ``spec`` callable there; raise ``ControlError``/``EndpointError`` on failure."""
        ...

    async def uninstall(self, spec: CallableSpec) -> None:
        """Forget ``spec`` there; raise ``ControlError``/``EndpointError`` on failure."""
        ...


class LocalTarget:
    """A local child, reached through control ops on its mailbox's base frame."""

    def __init__(self, endpoint: LocalMailboxEndpoint) -> None:
        self.endpoint = endpoint

    @property
    def worker_id(self) -> int:
        return self.endpoint.worker_id

    async def install(self, spec: CallableSpec) -> None:
        ep = self.endpoint
        if spec.handle.role == "chip":
            assert spec.import_path is not None
            await ep.control(ControlOp.REGISTER_CHIP, spec.handle.digest, spec.import_path.encode())
        elif spec.import_path is not None:
            await ep.control(
                ControlOp.REGISTER_IMPORT, spec.handle.digest, spec.import_path.encode()
            )
        else:
            assert spec.payload is not None
            await ep.control(ControlOp.REGISTER_SERIALIZED, spec.handle.digest, spec.payload)

    async def uninstall(self, spec: CallableSpec) -> None:
        op = ControlOp.UNREGISTER_CHIP if spec.handle.role == "chip" else ControlOp.UNREGISTER
        await self.endpoint.control(op, spec.handle.digest)


async def register_on_all(
    registry: CallableRegistry, spec: CallableSpec, targets: Sequence[RegistrationTarget]
) -> CallableHandle:
    """Install ``spec`` on every target and commit it, or roll back and raise."""
    if not registry.begin_register(spec, frozenset(range(len(targets)))):
        return spec.handle  # already registered: one more reference
    done: list[RegistrationTarget] = []
    failures: dict[int, str] = {}
    for target in targets:
        try:
            await target.install(spec)
            done.append(target)
        except (ControlError, EndpointError) as exc:
            failures[target.worker_id] = str(exc)
    if failures:
        cleanup: dict[int, str] = {}
        for target in done:
            try:
                await target.uninstall(spec)
            except (ControlError, EndpointError) as exc:
                cleanup[target.worker_id] = str(exc)
        registry.abort_register(spec.handle.hashid)
        detail = "; ".join(f"worker {w}: {m}" for w, m in failures.items())
        if cleanup:
            raise RegistrationError(
                "REGISTER_CLEANUP_UNCERTAIN",
                f"cannot register {spec.handle.name}: {detail}; rollback also failed on "
                + "; ".join(f"worker {w}: {m}" for w, m in cleanup.items()),
                {**failures, **cleanup},
            )
        raise RegistrationError(
            "REGISTER_PARTIAL_FAILURE",
            f"cannot register {spec.handle.name}: {detail}",
            failures,
        )
    registry.commit_register(spec.handle.hashid)
    return spec.handle


async def unregister_on_all(
    registry: CallableRegistry,
    handle: CallableHandle,
    targets_for: Callable[[CallableSpec], Sequence[RegistrationTarget]],
) -> None:
    """Drop one reference; the last one uninstalls the callable from every target."""
    entry = registry.begin_unregister(handle.hashid)
    if entry is None:
        return  # other references remain
    failures: dict[int, str] = {}
    for target in targets_for(entry.spec):
        try:
            await target.uninstall(entry.spec)
        except (ControlError, EndpointError) as exc:
            failures[target.worker_id] = str(exc)
    if failures:
        raise RegistrationError(
            "REGISTER_CLEANUP_UNCERTAIN",
            f"cannot unregister {handle.name}: "
            + "; ".join(f"worker {w}: {m}" for w, m in failures.items())
            + "; the hashid stays tombstoned",
            failures,
        )
    registry.finish_unregister(handle.hashid)
