"""Callable RPCs of the daemon servicer: RegisterCallable, UnregisterCallable,
ListCallables, and KeepSession, the lease of a client session (sessions.py).

A registration in a session holds one reference per hashid, released when the
session's KeepSession call ends (once the owner's runs active at that moment have
finished: their tasks may still need the callable); one with ``persist`` or without
a session holds its reference until unregistered, as do ``callables.preload``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

from simpler_daemon.callables import CallableHandle, resolve_import
from simpler_daemon.errors import (
    AccessDenied,
    InvalidField,
    LimitExceeded,
    Precondition,
    UnknownObject,
)
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server import oplog
from simpler_daemon.server.decoding import BadRequest
from simpler_daemon.server.fastcontext import FastContext
from simpler_daemon.server.peers import Identity
from simpler_daemon.server.plan import REGISTER_KINDS
from simpler_daemon.server.rpc_base import ServiceBase, server_stream, unary
from simpler_daemon.server.sessions import Session
from simpler_daemon.server.status import at_field, error_text

__all__ = ["CallablesRpc"]

log = logging.getLogger("simpler_daemon.service")

_ROLE_KINDS: Final[dict[str, int]] = {role: kind for kind, role in REGISTER_KINDS.items()}


class CallablesRpc(ServiceBase):
    """Registration of SUB, chip, orchestration and next-level callables."""

    @unary
    async def RegisterCallable(self, request: Any, context: Any) -> Any:
        who = self._who(context)
        try:
            return await self._register(request, who)
        except Exception as exc:
            oplog.register_refused(request.import_path, who.owner, error_text(exc))
            raise

    async def _register(self, request: Any, who: Identity) -> Any:
        """RegisterCallable for ``who``: the response, or the refusal as an exception."""
        limit = self._limits.max_import_path_chars
        if len(request.import_path) > limit:  # before anything parses or echoes it
            raise LimitExceeded(
                "import_path",
                f"{len(request.import_path)} characters, limits.max_import_path_chars = {limit}",
            )
        if request.reload:
            return await self._reload(request, who)
        session: Session | None = None
        if request.session and not request.persist:
            session = self._sessions.get(who, request.session, "register a callable")
        module, qualname, kind = self._plan.register_target(request)
        target = f"{module}:{qualname}"
        hashid = CallableHandle.for_import(target, kind).hashid  # type: ignore[arg-type]
        entry = self._worker.registry.lookup(hashid)
        if entry is not None and entry.state == "active":
            if session is not None and not request.workers and session.refs[hashid] > 0:
                # The session holds it already: no second reference (a client
                # registering in a loop must not fill its quota).
                return pb.RegisterCallableResponse(hashid=hashid, refcount=entry.refcount)
        elif entry is not None and entry.state == "tombstone" and entry.settled is not None:
            # Its last reference is being dropped (the session of a client that just
            # exited, say): register it anew once that is done, rather than refuse.
            with contextlib.suppress(Exception):
                await asyncio.shield(entry.settled)
        with self._owners.registering(who) as commit:
            self._check_usable("register a callable")
            fn: Callable[..., Any] | None = None
            if kind == "orchestration":
                # Orchestration functions run in the daemon itself: import them here (off
                # the loop, so a slow import does not stall the Scheduler).
                try:
                    fn = await asyncio.to_thread(resolve_import, module, qualname)
                except PermissionError as exc:  # outside the allow-list (callables.py)
                    raise AccessDenied("import_path", str(exc)) from exc
                except Exception as exc:
                    raise InvalidField(
                        "import_path", f"cannot import {target}: {type(exc).__name__}: {exc}"
                    ) from exc
            try:
                if request.workers:  # level 4 only (checked by the planner)
                    handle = await self._worker.register_async(
                        target,
                        kind=kind,  # type: ignore[arg-type]
                        workers=list(request.workers),
                    )
                else:
                    handle = await self._worker.register_async(target, kind=kind)  # type: ignore[arg-type]
            except Exception as exc:
                raise at_field("import_path", exc) from exc
            if fn is not None:
                self._orch_fns[handle.hashid] = fn
            commit(handle.hashid)
        if session is not None:
            if session.ended:  # its KeepSession call ended while this one registered
                await self._drop_reference(who.owner, handle.hashid)
                raise Precondition(
                    "session",
                    f"cannot register {target}: session {session.id} ended meanwhile "
                    "(open a new one)",
                )
            self._sessions.add_ref(session, handle.hashid)
        entry = self._worker.registry.lookup(handle.hashid)
        refcount = entry.refcount if entry is not None else 1
        log.info(
            "registered %s as %s (%s, refcount %d) for %s%s",
            target,
            kind,
            handle.hashid,
            refcount,
            who,
            f" in {session}" if session is not None else " until unregistered",
        )
        return pb.RegisterCallableResponse(hashid=handle.hashid, refcount=refcount)

    async def _reload(self, request: Any, who: Identity) -> Any:
        """RegisterCallable with ``reload``: re-import a registered callable's module in
        every SUB worker (and here, for an orchestration function), no task of it being
        dispatched meanwhile; its hashid and references stay (``Worker.register``)."""
        module, qualname, kind = self._plan.register_target(request)
        target = f"{module}:{qualname}"
        if request.workers:
            raise InvalidField(
                "workers",
                f"cannot reload {target}: a reload reaches this daemon's own workers; "
                "leave workers empty",
            )
        self._check_usable("reload a callable")
        hashid = CallableHandle.for_import(target, kind).hashid  # type: ignore[arg-type]
        entry = self._worker.registry.lookup(hashid)
        if entry is None or entry.state != "active":
            raise UnknownObject(
                "import_path",
                f"cannot reload {target}: it is not registered (register it first; a reload "
                "re-imports a registered callable)",
            )
        # The code changes for every client running it: only one holding a registration
        # of it, or an admin, may do that.
        try:
            self._owners.registration_owner(who, hashid)
        except AccessDenied:
            raise AccessDenied(
                "import_path",
                f"cannot reload {target}: {who.owner} holds no registration of it (a client "
                "may reload what it registered; an admin anything)",
            ) from None
        try:
            handle = await self._worker.register_async(target, kind=kind, reload=True)  # type: ignore[arg-type]
        except Exception as exc:
            raise at_field("import_path", exc) from exc
        if kind == "orchestration":  # reloaded in this process: take its new function
            self._orch_fns[hashid] = await asyncio.to_thread(resolve_import, module, qualname)
        entry = self._worker.registry.lookup(hashid)
        refcount = entry.refcount if entry is not None else 0
        log.info("reloaded %s as %s (%s, refcount %d) for %s", target, kind, hashid, refcount, who)
        return pb.RegisterCallableResponse(hashid=handle.hashid, refcount=refcount)

    @unary
    async def UnregisterCallable(self, request: Any, context: Any) -> Any:
        handle = self._plan.handle(request.hashid, "hashid")
        owner = self._owners.registration_owner(self._who(context), handle.hashid)
        self._check_usable("unregister a callable")
        # Which of the owner's references: its session's (the caller's first), else
        # one held until unregistered.
        unsessioned = self._owners.references(owner, handle.hashid) - self._sessions.held_by(
            owner, handle.hashid
        )
        session = self._sessions.holder(owner, handle.hashid, request.session, unsessioned > 0)
        refcount = await self._drop_reference(owner, handle.hashid, session)
        return pb.UnregisterCallableResponse(refcount=refcount)

    async def _drop_reference(self, owner: str, hashid: str, session: Session | None = None) -> int:
        """Drop one reference ``owner`` holds (``session``'s when given): the references
        left (0: the callable is gone from every worker)."""
        handle = self._plan.handle(hashid, "hashid")
        # The quota frees with the reference, before the children are told: a client
        # that sees the reference gone (ListCallables) finds the room at once.
        dropped = self._owners.drop_registration(owner, hashid)
        try:
            await self._worker.unregister_async(handle)
        except Exception as exc:
            if dropped:
                self._owners.restore_registration(owner, hashid)
            raise at_field("hashid", exc) from exc
        if session is not None:
            self._sessions.drop_ref(session, hashid)
        entry = self._worker.registry.lookup(hashid)
        refcount = entry.refcount if entry is not None and entry.state == "active" else 0
        if refcount == 0:
            self._orch_fns.pop(hashid, None)
            self._owners.forget_registration(hashid)
            self._sessions.forget(hashid)
        return refcount

    @unary
    async def ListCallables(self, request: Any, context: Any) -> Any:
        out = pb.ListCallablesResponse()
        for entry in self._worker.registry.active():
            h = entry.spec.handle
            out.callables.add(
                hashid=h.hashid,
                import_path=entry.spec.import_path or h.name,
                kind=_ROLE_KINDS.get(h.role, pb.CALLABLE_KIND_UNSPECIFIED),
                refcount=entry.refcount,
                session_refs=min(self._sessions.held(h.hashid), entry.refcount),
            )
        return out

    # -- client sessions -------------------------------------------------------------

    @server_stream
    async def KeepSession(self, request: Any, context: Any) -> AsyncIterator[Any]:
        """The lease of one client session: open while this call lasts (sessions.py)."""
        who = self._who(context)
        requests = aiter(request)
        # A first request that never comes holds nothing: give up on it after the TTL
        # (the local fast path learns of a dead client from the kernel at once).
        fast = type(context) is FastContext
        try:
            async with asyncio.timeout(None if fast else self._limits.session_ttl):
                first = await anext(requests, None)
        except TimeoutError:
            return
        if first is None:
            return  # closed before it named a session
        if isinstance(first, BadRequest):
            raise InvalidField("", first.describe())
        self._check_usable("open a session")
        session = self._sessions.open(who, first.session, self._limits.per_client_sessions)
        # A client that renews (AsyncClient over gRPC) must, within the TTL; one that
        # cannot without a thread of its own (the blocking Client) holds the call only:
        # a peer that vanished is found by the server's keepalive pings instead.
        ttl = self._limits.session_ttl if first.renew and not fast else 0.0
        why = "closed by the client"
        log.debug("%s opened (ttl %s)", session, ttl or "none")
        try:
            yield pb.SessionLease(session=session.id, ttl_seconds=ttl)
            while True:
                try:
                    async with asyncio.timeout(ttl or None):
                        renewal = await anext(requests, None)
                except TimeoutError:
                    why = f"not renewed for limits.session_ttl = {ttl} s"
                    log.info("%s expired: %s", session, why)
                    return
                if renewal is None:
                    if ttl:
                        return  # a renewing client ends its session so
                    await asyncio.get_running_loop().create_future()  # until cancelled
        except BaseException:
            why = "its call ended (the connection was lost or the client died)"
            raise
        finally:
            self._end_session(session, why)

    def _end_session(self, session: Session, why: str) -> None:
        """The session's call ended: release its references (in a task: this runs in a
        handler being cancelled, and the owner's active runs are waited for first)."""
        self._sessions.end(session)
        if not session.refs:
            log.debug("%s ended (%s)", session, why)
            return
        log.info(
            "%s ended (%s): releasing its %d references",
            session,
            why,
            sum(session.refs.values()),
        )
        task = asyncio.get_running_loop().create_task(self._release(session))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release(self, session: Session) -> None:
        # Runs of the owner submitted while the session was open, still active, may
        # dispatch tasks of these callables: they keep them until they end (a script
        # that submits and exits leaves its runs running). Older runs cannot have
        # needed this session's references (a long run would hold them for ever).
        for rec in self._runs.list_runs(session.owner, set(), 1 << 62):
            if rec.submit_ns >= session.opened_ns and not rec.terminal:
                await rec.wait_finished(None)
        if self.serving_state == pb.SERVING_STATE_STOPPING:
            return  # the registrations end with the daemon
        for hashid, n in list(session.refs.items()):
            for _ in range(n):
                if self._worker.registry.lookup(hashid) is None:
                    self._sessions.drop_ref(session, hashid)
                    continue  # gone already (an admin unregistered it)
                try:
                    self._check_usable("release a session's registration")
                    await self._drop_reference(session.owner, hashid, session)
                except Exception as exc:
                    log.warning(
                        "cannot release %s's reference to %s: %s", session, hashid, error_text(exc)
                    )
                    return
