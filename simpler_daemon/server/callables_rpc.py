"""Callable RPCs of the daemon servicer: RegisterCallable, UnregisterCallable, ListCallables."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Final

from simpler_daemon.callables import CallableHandle, resolve_import
from simpler_daemon.errors import AccessDenied, InvalidField, LimitExceeded, UnknownObject
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server import oplog
from simpler_daemon.server.peers import Identity
from simpler_daemon.server.plan import REGISTER_KINDS
from simpler_daemon.server.rpc_base import ServiceBase, unary
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
        with self._owners.registering(who) as commit:
            module, qualname, kind = self._plan.register_target(request)
            self._check_usable("register a callable")
            target = f"{module}:{qualname}"
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
        entry = self._worker.registry.lookup(handle.hashid)
        refcount = entry.refcount if entry is not None else 1
        log.info(
            "registered %s as %s (%s, refcount %d) for %s",
            target,
            kind,
            handle.hashid,
            refcount,
            who,
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
        try:
            await self._worker.unregister_async(handle)
        except Exception as exc:
            raise at_field("hashid", exc) from exc
        self._owners.drop_registration(owner, handle.hashid)
        entry = self._worker.registry.lookup(handle.hashid)
        refcount = entry.refcount if entry is not None and entry.state == "active" else 0
        if refcount == 0:
            self._orch_fns.pop(handle.hashid, None)
            self._owners.forget_registration(handle.hashid)
        return pb.UnregisterCallableResponse(refcount=refcount)

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
            )
        return out
