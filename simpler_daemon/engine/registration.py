"""Registering a callable on every target after ``init``: on all of them or on none.

::

    register_on_all(registry, spec, targets)
      the same callable being registered already -> join it: one more reference, its outcome
      being unregistered (tombstone)             -> REGISTER_TOMBSTONE_ACTIVE (retry)
      registry.begin_register --> target.install(spec) on every idle target at once,
                                  queued behind the task of every busy one
        all answered installed -> registry.commit_register (the queued ones follow;
                                  a lane runs no task of it until it has it)
        any failed    -> target.uninstall(spec) where it was installed, abort_register,
                         RegistrationError(REGISTER_PARTIAL_FAILURE), REGISTER_FAILED
                         ("failed on every worker") when it succeeded nowhere
                         (REGISTER_CLEANUP_UNCERTAIN when that rollback failed too)

    reload_on_all(registry, spec, targets, hold)
      only an active registration of an import path; hashid and refcount stay
      hold(digest): the Scheduler dispatches no task of the callable  --> RELOAD_IMPORT
        on every idle target at once, queued behind the task of every busy one (the
        lane gets no dispatch until it reloaded)
        --> release: every later dispatch runs the new code
        failed everywhere -> REGISTER_FAILED, the old code keeps running
        failed somewhere  -> REGISTER_PARTIAL_FAILURE naming where the old code still runs

    unregister_on_all(registry, handle, targets_for)
      registry.begin_unregister --> target.uninstall(spec) on every idle target at once,
                                    queued behind the task of every busy one; waits for
                                    the busy ones running a task of this callable only
        all removed -> registry.finish_unregister
        a child that died (its endpoint is poisoned) or answered "not registered" holds
        nothing: its replacement starts from the registry, where the callable is gone
        any other failure -> an uncertain tombstone, REGISTER_CLEANUP_UNCERTAIN; a later
                             unregister retries, a later register reinstalls it everywhere

Every control has a deadline (``CONTROL_TIMEOUT_S``, a global of this module read at
call time, so a test may shorten it here); a child that misses it is poisoned and
replaced by the endpoint. The deadline counts only while the child has no task in
flight (it answers between tasks). A busy child's control is queued on its lane
(``delivery.py``): nothing waits for it but the lane, which takes no task until it was
delivered, and when no target is idle the first busy one to answer stands for them.
A queued control that fails later on a live child leaves the callable missing there
(``WorkerThread.missing``: that lane gets no task of it) and logs a WARNING.

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

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import Any, Protocol, TypeVar

from simpler_daemon.callables import (
    CallableHandle,
    CallableKind,
    CallableRegistry,
    CallableSpec,
    Role,
    encode_import_control,
    import_policy,
    parse_import_path,
    reload_import,
    spec_for_chip,
    spec_for_import,
    spec_for_object,
)
from simpler_daemon.endpoints.local import CONTROL_TIMEOUT_S, LocalMailboxEndpoint
from simpler_daemon.engine.delivery import deliver, lane_of, on_lane, running, then
from simpler_daemon.errors import ControlError, EndpointError, RegistrationError
from simpler_daemon.mailbox.layout import ControlOp

log = logging.getLogger("simpler_daemon.registration")


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


def nowhere_to_run(spec: CallableSpec, *, sub_workers: int, chips: int, l3_workers: int) -> str:
    """Why a callable of ``spec``'s role could never run on a worker of that shape ("" when
    it can): a SUB callable needs a SUB worker (or a local L3 child, which runs the L4
    callables), a chip kernel a chip. Orchestration functions run in the parent."""
    handle = spec.handle
    if handle.role == "sub" and not sub_workers and not l3_workers:
        return (
            f"{handle.name} is a SUB callable, but this worker has no SUB workers "
            "(num_sub_workers=0) and no local L3 workers: it could never run"
        )
    if handle.role == "chip" and not chips:
        return (
            f"{handle.name} is a chip kernel, but this worker has no chips (num_chips=0): it "
            "could never run (a level-4 Worker installs kernels into its L3 workers with "
            "register(..., kind='chip', workers=[ids]))"
        )
    return ""


class RegistrationTarget(Protocol):
    """One worker a callable is installed on (a local child or a remote worker)."""

    @property
    def worker_id(self) -> int: ...

    @property
    def gone(self) -> bool:
        """True once this child is gone for good (its endpoint is poisoned): it never runs
        anything again, and its replacement starts from the registry."""
        ...

    async def install(self, spec: CallableSpec) -> None:
        """Make ``spec`` callable there; raise ``ControlError``/``EndpointError`` on failure."""
        ...

    async def uninstall(self, spec: CallableSpec) -> None:
        """Forget ``spec`` there; raise ``ControlError``/``EndpointError`` on failure."""
        ...


class LocalTarget:
    """A local child, reached through control ops on its mailbox's base frame."""

    def __init__(
        self,
        endpoint: LocalMailboxEndpoint,
        lane: Any = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        #: The child's Scheduler lane (``WorkerThread``) and the Scheduler's wake-up: a
        #: control for a busy child is queued on the lane (``delivery.py``); None: the
        #: control is sent at once and awaited (a replacement's replay).
        self.lane = lane
        self.wake = wake

    @property
    def worker_id(self) -> int:
        return self.endpoint.worker_id

    @property
    def gone(self) -> bool:
        return self.endpoint.poisoned

    async def install(self, spec: CallableSpec) -> None:
        ep = self.endpoint
        if spec.handle.role == "chip":
            assert spec.import_path is not None
            op, body = ControlOp.REGISTER_CHIP, spec.import_path.encode()
        elif spec.import_path is not None:
            op = ControlOp.REGISTER_IMPORT
            body = encode_import_control(spec.import_path, import_policy())
        else:
            assert spec.payload is not None
            op, body = ControlOp.REGISTER_SERIALIZED, spec.payload
        await ep.control(op, spec.handle.digest, body, timeout=CONTROL_TIMEOUT_S)

    async def uninstall(self, spec: CallableSpec) -> None:
        op = ControlOp.UNREGISTER_CHIP if spec.handle.role == "chip" else ControlOp.UNREGISTER
        await self.endpoint.control(op, spec.handle.digest, timeout=CONTROL_TIMEOUT_S)

    async def reload(self, spec: CallableSpec) -> None:
        """Re-execute the module of ``spec``'s import path in the child and point its
        digest at the new function."""
        assert spec.import_path is not None
        body = encode_import_control(spec.import_path, import_policy())
        await self.endpoint.control(
            ControlOp.RELOAD_IMPORT, spec.handle.digest, body, timeout=CONTROL_TIMEOUT_S
        )


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
    """Run ``step`` on every item at once (an 8 s import on two children takes 8 s, not
    16); one failing does not stop the others.

    Returns the items it succeeded on (in their order) and ``{worker id: label + why}``
    for the others. Any other exception propagates once every step has ended.
    """
    todo = list(items)
    outcomes = await asyncio.gather(*(step(item) for item in todo), return_exceptions=True)
    done: list[T] = []
    failures: dict[int, str] = {}
    unexpected: BaseException | None = None
    for item, outcome in zip(todo, outcomes, strict=True):
        if not isinstance(outcome, BaseException):
            done.append(item)
        elif isinstance(outcome, errors):
            failures[worker_id(item)] = f"{label}{str(outcome) or type(outcome).__name__}"
        elif unexpected is None:
            unexpected = outcome
    if unexpected is not None:
        raise unexpected
    return done, failures


def name_workers(failures: Mapping[int, str]) -> str:
    """``worker 1: <why>; worker 3: <why>``: how every fan-out names where it failed."""
    return "; ".join(f"worker {w}: {m}" for w, m in failures.items())


def register_failed(
    what: str, failures: Mapping[int, str], cleanup: Mapping[int, str], *, everywhere: bool = False
) -> RegistrationError:
    """``what`` failed on ``failures`` and was undone where it had succeeded:
    ``REGISTER_PARTIAL_FAILURE``, or ``REGISTER_CLEANUP_UNCERTAIN`` when the undo
    failed too (on ``cleanup``). ``everywhere``: it succeeded nowhere, which is no
    partial failure but ``REGISTER_FAILED`` ("failed on every worker")."""
    detail = name_workers(failures)
    if everywhere:
        return RegistrationError(
            "REGISTER_FAILED", f"{what}: failed on every worker: {detail}", dict(failures)
        )
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
        _, cleanup = await fan_out(done, lambda t: _uninstall(t, spec), _target_id)
        raise register_failed(what, failures, cleanup, everywhere=not done)


async def uninstall_all(
    spec: CallableSpec, targets: Iterable[RegistrationTarget], what: str, note: str = ""
) -> None:
    """Uninstall ``spec`` from every target; ``cleanup_uncertain`` names those that may
    still hold it."""
    _, failures = await fan_out(targets, lambda t: _uninstall(t, spec), _target_id)
    if failures:
        raise cleanup_uncertain(what, failures, note)


async def _uninstall(target: RegistrationTarget, spec: CallableSpec) -> None:
    """``target.uninstall(spec)``, where a failure that leaves nothing behind counts as
    done: a child gone for good (dead, or poisoned and killed: its replacement starts
    from the registry) or one that answered it does not hold the callable."""
    try:
        await target.uninstall(spec)
    except CONTROL_ERRORS as exc:
        if target.gone or (isinstance(exc, ControlError) and "not registered" in str(exc)):
            return
        raise


def _mark(target: RegistrationTarget, digest: bytes, *, missing: bool) -> None:
    """Record on ``target``'s lane whether the callable ``digest`` is missing there (the
    Scheduler sends a lane no task of a callable it misses)."""
    lane = lane_of(target)
    if lane is None or lane.endpoint is not getattr(target, "endpoint", None):
        return  # no lane, or the child was replaced (its replacement replays the registry)
    if missing:
        lane.missing.add(digest)
    else:
        lane.missing.discard(digest)


async def _install(target: RegistrationTarget, spec: CallableSpec) -> None:
    """``target.install(spec)``; a live child that failed it misses the callable."""
    try:
        await target.install(spec)
    except CONTROL_ERRORS:
        if not target.gone:
            _mark(target, spec.handle.digest, missing=True)
        raise
    _mark(target, spec.handle.digest, missing=False)


async def _uninstall_marked(target: RegistrationTarget, spec: CallableSpec) -> None:
    await _uninstall(target, spec)
    _mark(target, spec.handle.digest, missing=False)


def _later_failed(
    target: RegistrationTarget, handle: CallableHandle, what: str, exc: BaseException | None
) -> None:
    """A control queued behind a busy child's task failed after its caller returned."""
    if exc is None or target.gone:
        return  # done, or the child is gone (its replacement replays the registry)
    after = {
        "register": "that worker runs no task of it (unregister and register it again to retry)",
        "reload": "that worker still runs the old code (reload again to retry)",
        "unregister": "that worker may still hold it",
    }[what]
    log.warning(
        "cannot %s %s on worker %d (it was busy, so the %s was queued): %s; %s",
        what,
        handle.name,
        target.worker_id,
        what,
        exc,
        after,
    )


async def _install_on_lanes(
    registry: CallableRegistry,
    spec: CallableSpec,
    targets: Sequence[RegistrationTarget],
    what: str,
) -> None:
    """Install ``spec`` on every idle target now and on every busy one when its task
    ends (``delivery.deliver``); when none is idle, the first busy one to answer counts.
    A failure among those answered rolls back everywhere: ``register_failed(what, ...)``.
    """
    got = await deliver(targets, lambda t: _install(t, spec), CONTROL_ERRORS)
    if got.failures:
        # Undo where it landed, and behind the installs still queued on busy children.
        undo = await deliver(
            got.done, lambda t: _uninstall_marked(t, spec), CONTROL_ERRORS, awaited=_always
        )
        for target, _ in got.later:
            task = on_lane(target, lambda t: _uninstall_marked(t, spec))
            then(task, partial(_later_failed, target, spec.handle, "unregister"))
        raise register_failed(what, got.failures, undo.failures, everywhere=not got.done)
    for target, task in got.later:
        then(task, partial(_later_failed, target, spec.handle, "register"))


def _always(_: object) -> bool:
    return True


async def _uninstall_on_lanes(
    spec: CallableSpec, targets: Sequence[RegistrationTarget], what: str
) -> None:
    """Uninstall ``spec`` from every idle target now, from every busy one when its task
    ends; waits for the busy ones only where a task of ``spec`` is in flight (the last
    reference waits for its own tasks, nobody else's). ``cleanup_uncertain`` names the
    children awaited that may still hold it."""
    digest = spec.handle.digest
    got = await deliver(
        targets,
        lambda t: _uninstall_marked(t, spec),
        CONTROL_ERRORS,
        awaited=lambda t: running(t, digest),
        first=False,
    )
    for target, task in got.later:
        then(task, partial(_later_failed, target, spec.handle, "unregister"))
    if got.failures:
        raise cleanup_uncertain(
            what,
            got.failures,
            "; the hashid stays tombstoned until unregister() is retried or it is registered again",
        )


async def register_on_all(
    registry: CallableRegistry, spec: CallableSpec, targets: Sequence[RegistrationTarget]
) -> CallableHandle:
    """Install ``spec`` on every target and commit it, or roll back and raise.

    A registration of the same callable already in progress is joined (one more
    reference, its outcome). One whose final unregister is still in flight is refused
    with ``REGISTER_TOMBSTONE_ACTIVE`` (the unregister wins; retry once it ended), so
    a register never waits for the tasks that unregister waits for.
    """
    hashid = spec.handle.hashid
    loop = asyncio.get_running_loop()
    entry = registry.lookup(hashid)
    settled = entry.settled if entry is not None else None
    if (
        entry is not None
        and entry.state == "pending"
        and settled is not None
        and not settled.done()
        and settled.get_loop() is loop
    ):
        registry.join_register(spec)
        await asyncio.shield(settled)  # raises that registration's own failure
        return spec.handle
    if not registry.begin_register(spec, frozenset(range(len(targets)))):
        return spec.handle  # already registered: one more reference
    entry = registry.lookup(hashid)
    assert entry is not None
    entry.settled = done = loop.create_future()

    async def broadcast() -> None:
        try:
            await _install_on_lanes(registry, spec, targets, f"cannot register {spec.handle.name}")
        except BaseException as exc:
            registry.abort_register(hashid)
            _settle(done, exc, f"cannot register {spec.handle.name}")
            raise
        finally:
            entry.settled = None
        registry.commit_register(hashid)
        done.set_result(None)

    # The broadcast runs to its end even when this caller is cancelled (a client's
    # deadline): a control cut in half would leave children holding a callable the
    # registry does not know. The caller's reference is then dropped the normal way.
    task = loop.create_task(broadcast())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        _BACKGROUND.add(task)
        task.add_done_callback(lambda t: _drop_abandoned(t, registry, spec, targets))
        raise
    return spec.handle


async def reload_on_all(
    registry: CallableRegistry,
    spec: CallableSpec,
    targets: Sequence[RegistrationTarget],
    hold: Callable[[bytes], AbstractContextManager[object]],
) -> CallableHandle:
    """Re-import a registered callable's module in every target child, atomically with
    respect to dispatch: inside ``hold(digest)`` (``Scheduler.holding``) no task of it
    is dispatched, so every task dispatched before ran the old code and every one after
    runs the new. Its hashid and reference count stay.

    Raises ``NOT_REGISTERED`` when ``spec`` is not registered (an active registration),
    ``ValueError`` for what a reload cannot reach (chip kernels, local L3 workers),
    ``REGISTER_FAILED`` when no child loaded the new code (they all keep the old), and
    ``REGISTER_PARTIAL_FAILURE`` naming the children that still run the old code.
    """
    handle = spec.handle
    what = f"cannot reload {handle.name}"
    entry = registry.lookup(handle.hashid)
    if entry is None or entry.state != "active":
        raise RegistrationError(
            "NOT_REGISTERED",
            f"{what}: it is not registered ({handle.hashid}); reload re-imports a registered "
            "callable, register it first",
        )
    if handle.role == "chip":
        raise ValueError(
            f"{what}: a chip kernel is not reloadable; unregister it and register it again"
        )
    current = entry.spec
    if current.handle.kind is not CallableKind.PYTHON_IMPORT or current.import_path is None:
        raise ValueError(f"{what}: only a callable registered by import path can be reloaded")
    module, qualname = parse_import_path(current.import_path)
    local = [t for t in targets if isinstance(t, LocalTarget)]
    if len(local) != len(targets):
        raise ValueError(
            f"{what}: it is installed in local L3 workers, which a reload does not reach; "
            "unregister it and register it again"
        )

    async def broadcast() -> None:
        with hold(handle.digest):
            got = await deliver(local, lambda t: _reload(t, current), CONTROL_ERRORS)
        done, failures = got.done, got.failures
        for target, task in got.later:
            then(task, partial(_later_failed, target, handle, "reload"))
        if failures and not done:
            raise RegistrationError(
                "REGISTER_FAILED",
                f"{what}: failed on every worker: {name_workers(failures)}; the old code "
                "keeps running",
                dict(failures),
            )
        if failures:
            old = ", ".join(str(w) for w in failures)
            raise RegistrationError(
                "REGISTER_PARTIAL_FAILURE",
                f"{what}: {name_workers(failures)}; worker(s) {old} still run the old code, "
                "the others the new: retry the reload",
                dict(failures),
            )

        if handle.role == "orchestration":
            # An orchestration function runs in this process: its module is reloaded here
            # (off the loop: an import may take long).
            await asyncio.to_thread(reload_import, module, qualname)

    # As for a registration: the broadcast (and the hold) runs to its end even when the
    # caller is cancelled, or the hold would end while children still reload.
    task = asyncio.get_running_loop().create_task(broadcast())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        _BACKGROUND_RELOADS.add(task)
        task.add_done_callback(_reload_abandoned)
        raise
    log.info("reloaded %s on %d workers", handle.name, len(local))
    return handle


async def _reload(target: LocalTarget, spec: CallableSpec) -> None:
    """``target.reload(spec)``, where a child gone for good counts as done: its
    replacement installs the callable from the registry, importing the current source.
    A live child that failed it keeps running the old code."""
    try:
        await target.reload(spec)
    except CONTROL_ERRORS:
        if target.gone:
            return
        raise


#: Reloads whose caller went away, kept referenced until they end.
_BACKGROUND_RELOADS: set[asyncio.Task[None]] = set()


def _reload_abandoned(task: asyncio.Task[None]) -> None:
    _BACKGROUND_RELOADS.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("a reload its caller abandoned failed: %s", task.exception())


#: Broadcasts whose caller went away, kept referenced until they and their undo end.
_BACKGROUND: set[asyncio.Task[None]] = set()


def _drop_abandoned(
    task: asyncio.Task[None],
    registry: CallableRegistry,
    spec: CallableSpec,
    targets: Sequence[RegistrationTarget],
) -> None:
    """A registration whose caller was cancelled: drop the reference it took, once the
    broadcast has ended (uninstalling it when it was the last one)."""
    _BACKGROUND.discard(task)
    if task.cancelled() or task.exception() is not None:
        return  # rolled back already
    undo = task.get_loop().create_task(
        unregister_on_all(registry, spec.handle, lambda _spec: targets)
    )
    _BACKGROUND.add(undo)

    def settled(t: asyncio.Task[None]) -> None:
        _BACKGROUND.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.warning(
                "cannot drop the registration of %s its caller abandoned: %s",
                spec.handle.name,
                t.exception(),
            )

    undo.add_done_callback(settled)


async def unregister_on_all(
    registry: CallableRegistry,
    handle: CallableHandle,
    targets_for: Callable[[CallableSpec], Sequence[RegistrationTarget]],
) -> None:
    """Drop one reference; the last one uninstalls the callable from every target.

    When some live child could not confirm it, the hashid stays an uncertain tombstone
    (``REGISTER_CLEANUP_UNCERTAIN``) until a later unregister or register settles it.
    """
    entry = registry.begin_unregister(handle.hashid)
    if entry is None:
        return  # other references remain
    loop = asyncio.get_running_loop()
    entry.settled = done = loop.create_future()
    try:
        await _uninstall_on_lanes(
            entry.spec, targets_for(entry.spec), f"cannot unregister {handle.name}"
        )
    except BaseException as exc:
        registry.mark_uncertain(handle.hashid)
        _settle(done, exc, f"cannot unregister {handle.name}")
        raise
    finally:
        entry.settled = None
    registry.finish_unregister(handle.hashid)
    done.set_result(None)


def _settle(done: asyncio.Future[None], exc: BaseException, what: str) -> None:
    """End a broadcast that failed: those that joined it get its failure."""
    if not isinstance(exc, Exception):  # cancelled or interrupted: not a result to share
        exc = RegistrationError(
            "CONTROL_FAILED", f"{what}: the broadcast was interrupted ({type(exc).__name__})"
        )
    done.set_exception(exc)
    done.exception()  # retrieved: nobody may have joined, which is no error
