"""Run RPCs of the daemon servicer: SubmitRun, RunOrchestration, WatchRun, WaitRun,
CancelRun, ListRuns.

A client's runs past ``limits.per_client_runs`` are accepted and wait QUEUED in its
queue (runs.py), validated and with their buffers pinned from the submit on: a
FreeBuffer meanwhile is deferred, so a queued run never finds its buffers gone.

A run belongs to its submitter (``Identity.owner``): only the owner or an admin
waits for, watches or cancels it, and ListRuns shows a client its own runs (an
admin every client's). The owner is also the engine's ``client`` of the run, so
under ``scheduler.admission = "fair"`` the workers are shared between clients
first, then between one client's runs by their ``priority``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from simpler_daemon.callables import parse_import_path, resolve_import
from simpler_daemon.errors import AccessDenied, InvalidField, Precondition
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server.history import UnrecordedRun
from simpler_daemon.server.offloop import run_off_loop
from simpler_daemon.server.owed import output_buffers
from simpler_daemon.server.peers import Identity, client_label
from simpler_daemon.server.plan import (
    check_label,
    check_reason,
    declarative,
    run_priority,
    timeout_field,
)
from simpler_daemon.server.rpc_base import ServiceBase, server_stream, unary
from simpler_daemon.server.runs import fingerprint

__all__ = ["RunsRpc"]

log = logging.getLogger("simpler_daemon.service")


class RunsRpc(ServiceBase):
    """Runs: planned (plan.py), launched and tracked (runs.py), owned by their submitter."""

    @unary
    async def SubmitRun(self, request: Any, context: Any) -> Any:
        runs = self._runs
        wait = timeout_field(request, "wait_seconds") if request.HasField("wait_seconds") else None
        key = request.idempotency_key
        key_print = b""
        results = request.include_results
        if key:
            runs.check_key(key)
            # How to answer, not what to run: a retry may wait or ask for results or not.
            request.ClearField("wait_seconds")
            request.ClearField("include_results")
            key_print = await fingerprint("SubmitRun", request)
        who = self._who(context)
        if key:
            async with runs.claim_key(who.owner, key, key_print) as run_id:
                if run_id is not None:
                    response = pb.SubmitRunResponse(run_id=run_id, deduplicated=True)
                    if wait is not None:
                        status = await runs.wait(runs.record(run_id), wait, include_results=results)
                        response.status.CopyFrom(status)
                    return response
                rec = await self._submit_run(request, who, key_print)
        else:  # nothing to claim: skip the context manager (the one-task run's hot path)
            rec = await self._submit_run(request, who, key_print)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("run %d is from client %r", rec.run_id, client_label(context))
        response = pb.SubmitRunResponse(run_id=rec.run_id)
        if wait is not None:
            response.status.CopyFrom(await runs.wait(rec, wait, include_results=results))
            self._took_status(rec)
        return response

    async def _submit_run(self, request: Any, who: Identity, key_print: bytes) -> Any:
        """Plan (in slices: the loop keeps serving) and launch a SubmitRun; its record.

        Every buffer the tasks reference is pinned from the moment it is checked until
        the run is terminal (a queued run's too): a FreeBuffer meanwhile is deferred
        (``deferred = true``)."""
        runs = self._runs
        check_label(request.label)
        priority = run_priority(request.priority)
        client = who.owner
        self._admission_checks(client, "submit a run")
        pins: set[int] = set()

        def hold(rec: Any) -> None:  # once the run started (or ended while queued)
            self._hold_until_done(rec, pins)

        try:
            plan, total = await self._plan.plan_run(request, pins)
            self._check_pins(who, pins, "submit a run with")
            # Planning yielded to the loop: the daemon may have begun stopping meanwhile.
            self._admission_checks(client, "submit a run")
            rec = runs.new_record(
                label=request.label,
                client=client,
                key=request.idempotency_key,
                total=total,
                priority=priority,
            )
            rec.key_print = key_print
            await runs.launch(rec, declarative(plan, rec.bind), on_start=hold)
        except BaseException:
            self._unpin(pins)
            raise
        self._owed.note(rec, output_buffers(m for task in request.tasks for m in task.members))
        return rec

    @unary
    async def RunOrchestration(self, request: Any, context: Any) -> Any:
        key = request.idempotency_key
        key_print = b""
        if key:
            self._runs.check_key(key)
            key_print = await fingerprint("RunOrchestration", request)
        who = self._who(context)
        async with self._runs.claim_key(who.owner, key, key_print) as run_id:
            if run_id is not None:
                return pb.RunOrchestrationResponse(run_id=run_id, deduplicated=True)
            run_id = await self._run_orchestration(request, who, key_print)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("run %d is from client %r", run_id, client_label(context))
        return pb.RunOrchestrationResponse(run_id=run_id)

    async def _run_orchestration(self, request: Any, who: Identity, key_print: bytes) -> int:
        """Launch a RunOrchestration; the function runs on a worker thread (see
        :func:`run_off_loop`) and its argument buffers stay pinned until the run ends."""
        check_label(request.label)
        priority = run_priority(request.priority)
        handle = self._plan.orchestration_handle(request.hashid, "hashid")
        fn = self._orch_fns.get(handle.hashid)
        if fn is None:
            module, qualname = parse_import_path(handle.name)
            try:
                fn = await asyncio.to_thread(resolve_import, module, qualname)
            except PermissionError as exc:
                raise AccessDenied("hashid", str(exc)) from exc
            except Exception as exc:
                raise Precondition(
                    "hashid", f"cannot import {handle.name}: {type(exc).__name__}: {exc}"
                ) from exc
            self._orch_fns[handle.hashid] = fn
        client = who.owner
        self._admission_checks(client, "run an orchestration")
        pins: set[int] = set()

        def hold(rec: Any) -> None:  # once the run started (or ended while queued)
            self._hold_until_done(rec, pins)

        try:
            args = self._plan.task_args(request.args, "args", pins)
            self._check_pins(who, pins, "run an orchestration with")
            config = self._plan.call_config(request.config, "config")
            rec = self._runs.new_record(
                label=request.label or handle.name,
                client=client,
                key=request.idempotency_key,
                total=None,
                priority=priority,
            )
            rec.key_print = key_print
            target = fn

            async def orch(o: Any, a: Any, c: Any) -> Any:
                rec.bind(o.run)
                return await run_off_loop(target, o, a, c)

            run_id = await self._runs.launch(rec, orch, args, config, on_start=hold)
        except BaseException:
            self._unpin(pins)
            raise
        self._owed.note(rec, output_buffers((request.args,)))
        return run_id

    @server_stream
    async def WatchRun(self, request: Any, context: Any) -> AsyncIterator[Any]:
        rec = self._runs.record(request.run_id)
        who = self._who(context)
        self._owners.check_run(who, rec.client, rec.run_id, "watch")
        with self._stream_slot(who.owner):
            async with contextlib.aclosing(rec.events(request.after_sequence)) as events:
                async for event in events:
                    yield event
        self._took_status(rec)

    @unary
    async def WaitRun(self, request: Any, context: Any) -> Any:
        try:
            rec = self._runs.record(request.run_id)
        except UnrecordedRun as lost:  # nothing known of it, not even its owner: LOST
            return lost.status()
        self._owners.check_run(self._who(context), rec.client, rec.run_id, "wait for")
        timeout = (
            timeout_field(request, "timeout_seconds")
            if request.HasField("timeout_seconds")
            else None
        )
        status = await self._runs.wait(rec, timeout, include_results=request.include_results)
        self._took_status(rec)
        return status

    @unary
    async def CancelRun(self, request: Any, context: Any) -> Any:
        rec = self._runs.record(request.run_id)
        who = self._who(context)
        self._owners.check_run(who, rec.client, rec.run_id, "cancel")
        check_reason(request.reason)
        cancelled = self._runs.cancel(
            rec, request.reason, terminate=request.terminate, by=who.owner
        )
        return pb.CancelRunResponse(state=rec.proto_state(), already_finished=not cancelled)

    @unary
    async def ListRuns(self, request: Any, context: Any) -> Any:
        who = self._who(context)
        states: set[int] = set()
        for i, state in enumerate(request.states):
            if state not in pb.RunState.values() or state == pb.RUN_STATE_UNSPECIFIED:
                raise InvalidField(f"states[{i}]", f"{state} is not a run state")
            states.add(state)
        owner = None if who.admin else who.owner  # a client sees its own runs only
        now = time.time_ns()
        records = self._runs.list_runs(owner, states, request.limit)
        return pb.ListRunsResponse(runs=[rec.summary(now) for rec in records])
