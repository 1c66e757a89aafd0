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

``install_all`` / ``uninstall_all`` are that fan-out without the registry (the
local L3 children's ``workers=`` installs use them too); ``fan_out``,
``register_failed`` and ``cleanup_uncertain`` are its parts, for a fan-out of
another shape (the remote workers' two-phase register), so every one names the
failed workers alike: ``cannot register X: worker W: <why>; ...``.

A target is anything with a ``worker_id`` and async ``install``/``uninstall``
(``RegistrationTarget``). ``LocalTarget`` reaches a local child through control
ops on its mailbox; a remote worker joins the broadcast by implementing the same
three members. The child pool also uses ``LocalTarget`` to replay registrations
onto a replacement child.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

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


#: What a failed install / uninstall control raises; anything else is a bug and propagates.
CONTROL_ERRORS: tuple[type[Exception], ...] = (ControlError, EndpointError)

T = TypeVar("T")


async def fan_out(
    items: Iterable[T],
    step: Callable[[T], Awaitable[object]],
    worker_id: Callable[[T], int],
    *,
    errors: tuple[type[Exception], ...] = CONTROL_ERRORS,
    label: str = "",
) -> tuple[list[T], dict[int, str]]:
    """Run ``step`` on every item in turn; one failing does not stop the others.

    Returns the items it succeeded on and ``{worker id: label + why}`` for the others.
    """
    done: list[T] = []
    failures: dict[int, str] = {}
    for item in items:
        try:
            await step(item)
            done.append(item)
        except errors as exc:
            failures[worker_id(item)] = f"{label}{str(exc) or type(exc).__name__}"
    return done, failures


def name_workers(failures: Mapping[int, str]) -> str:
    """``worker 1: <why>; worker 3: <why>``: how every fan-out names where it failed."""
    return "; ".join(f"worker {w}: {m}" for w, m in failures.items())


def register_failed(
    what: str, failures: Mapping[int, str], cleanup: Mapping[int, str]
) -> RegistrationError:
    """``what`` failed on ``failures`` and was undone where it had succeeded:
    ``REGISTER_PARTIAL_FAILURE``, or ``REGISTER_CLEANUP_UNCERTAIN`` when the undo
    failed too (on ``cleanup``)."""
    detail = name_workers(failures)
    if cleanup:
        return RegistrationError(
            "REGISTER_CLEANUP_UNCERTAIN",
            f"{what}: {detail}; rollback also failed on {name_workers(cleanup)}",
            {**failures, **cleanup},
        )
    return RegistrationError("REGISTER_PARTIAL_FAILURE", f"{what}: {detail}", dict(failures))


def cleanup_uncertain(what: str, failures: Mapping[int, str], note: str = "") -> RegistrationError:
    """``REGISTER_CLEANUP_UNCERTAIN``: whether ``failures`` still hold the callable is unknown."""
    return RegistrationError(
        "REGISTER_CLEANUP_UNCERTAIN", f"{what}: {name_workers(failures)}{note}", dict(failures)
    )


def _target_id(target: RegistrationTarget) -> int:
    return target.worker_id


async def install_all(spec: CallableSpec, targets: Iterable[RegistrationTarget], what: str) -> None:
    """Install ``spec`` on every target, or uninstall it where it landed and raise
    ``register_failed(what, ...)``."""
    done, failures = await fan_out(targets, lambda t: t.install(spec), _target_id)
    if failures:
        _, cleanup = await fan_out(done, lambda t: t.uninstall(spec), _target_id)
        raise register_failed(what, failures, cleanup)


async def uninstall_all(
    spec: CallableSpec, targets: Iterable[RegistrationTarget], what: str, note: str = ""
) -> None:
    """Uninstall ``spec`` from every target; ``cleanup_uncertain`` names those that failed."""
    _, failures = await fan_out(targets, lambda t: t.uninstall(spec), _target_id)
    if failures:
        raise cleanup_uncertain(what, failures, note)


async def register_on_all(
    registry: CallableRegistry, spec: CallableSpec, targets: Sequence[RegistrationTarget]
) -> CallableHandle:
    """Install ``spec`` on every target and commit it, or roll back and raise."""
    if not registry.begin_register(spec, frozenset(range(len(targets)))):
        return spec.handle  # already registered: one more reference
    try:
        await install_all(spec, targets, f"cannot register {spec.handle.name}")
    except RegistrationError:
        registry.abort_register(spec.handle.hashid)
        raise
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
    await uninstall_all(
        entry.spec,
        targets_for(entry.spec),
        f"cannot unregister {handle.name}",
        "; the hashid stays tombstoned",
    )
    registry.finish_unregister(handle.hashid)
