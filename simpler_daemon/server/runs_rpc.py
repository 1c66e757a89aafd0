"""Run RPCs of the daemon servicer: SubmitRun, RunOrchestration, WatchRun, WaitRun,
CancelRun, ListRuns, GetRunTrace.

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
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from simpler_daemon.args import MAX_PRIORITY
from simpler_daemon.callables import parse_import_path, resolve_import
from simpler_daemon.errors import AccessDenied, InvalidField, Precondition
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol.fastwire import Submit, Wait
from simpler_daemon.server.declarative import declarative
from simpler_daemon.server.fastcontext import FastContext
from simpler_daemon.server.history import UnrecordedRun
from simpler_daemon.server.keys import fingerprint, fingerprint_now, native_fingerprint
from simpler_daemon.server.offloop import run_off_loop
from simpler_daemon.server.owed import output_buffers
from simpler_daemon.server.peers import Identity, client_label
from simpler_daemon.server.plan import (
    Slicer,
    check_label,
    check_reason,
    run_priority,
    timeout_field,
)
from simpler_daemon.server.rpc_base import ServiceBase, server_stream, unary, unary_as

__all__ = ["RunsRpc"]

log = logging.getLogger("simpler_daemon.service")

_NONE: frozenset[int] = frozenset()
_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1


async def _until_end(rec: Any, timeout: float | None) -> None:
    """Return once ``rec``'s run is terminal or ``timeout`` seconds passed (0: at once;
    None: no limit). Its status is built by the caller, once."""
    if timeout != 0 and not rec.terminal:
        await rec.wait_finished(timeout)


class _Request(NamedTuple):
    """What the submit path reads of a SubmitRunRequest, from a Submit frame (``tasks``:
    protobuf Task messages, see ``Planner.native_tasks``)."""

    tasks: list[Any]
    label: str
    priority: int
    idempotency_key: str


class RunsRpc(ServiceBase):
    """Runs: planned (plan.py), launched and tracked (runs.py), owned by their submitter."""

    @unary
    async def SubmitRun(self, request: Any, context: Any) -> Any:
        wait = timeout_field(request, "wait_seconds") if request.HasField("wait_seconds") else None
        key = request.idempotency_key
        key_print = b""
        results = request.include_results
        if key:
            self._runs.check_key(key)
            # How to answer, not what to run: a retry may wait or ask for results or not.
            request.ClearField("wait_seconds")
            request.ClearField("include_results")
            key_print = fingerprint_now("SubmitRun", request) or await fingerprint(
                "SubmitRun", request
            )
        return await self._submit(request, wait, results, key_print, context)

    @unary_as("SubmitRun")
    async def FastSubmitRun(self, frame: Submit, context: Any) -> Any:
        """A SubmitRun sent as the fast path's Submit frame (protocol version 2): the
        same run and answer, from msgspec fields instead of a protobuf message."""
        wait = timeout_field(frame, "wait_seconds") if frame.wait_seconds is not None else None
        key = frame.idempotency_key
        if key:
            self._runs.check_key(key)
        label, priority = frame.label, frame.priority
        if not 0 <= priority <= _U32_MAX:  # a uint32 in a SubmitRunRequest
            raise InvalidField(
                "priority", f"priority {priority} is out of range (1 to {MAX_PRIORITY})"
            )
        tasks, encoded = self._plan.native_tasks(frame.tasks)
        # The digest of the equal SubmitRunRequest: a retry may come in either form.
        key_print = native_fingerprint("SubmitRun", key, encoded, label, priority) if key else b""
        request = _Request(tasks, label, priority, key)
        return await self._submit(request, wait, frame.include_results, key_print, context)

    async def _submit(
        self, request: Any, wait: float | None, results: bool, key_print: bytes, context: Any
    ) -> Any:
        """Submit ``request``'s run (or find the one its idempotency key names) and answer:
        at once, or once it ends or ``wait`` seconds passed."""
        runs = self._runs
        key = request.idempotency_key
        who = self._who(context)
        if not key:  # nothing to claim
            rec = await self._submit_run(request, who, key_print)
        elif callable(claim := runs.claim_now(who.owner, key, key_print)):
            try:  # a new key, claimed without a context manager (every client submit's path)
                rec = await self._submit_run(request, who, key_print)
            finally:
                claim()
        elif claim is not None:  # a retry: the run this key names already
            return await self._deduplicated(claim, wait, results, context)
        else:  # another request holds the key now: wait for it
            async with runs.claim_key(who.owner, key, key_print) as run_id:
                if run_id is not None:
                    return await self._deduplicated(run_id, wait, results, context)
                rec = await self._submit_run(request, who, key_print)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("run %d is from client %r", rec.run_id, client_label(context))
        if wait is None:
            return pb.SubmitRunResponse(run_id=rec.run_id)
        if type(context) is FastContext and wait != 0 and not rec.terminal:
            # The reply is written from the run's completion (no handler woken for it; a
            # lone run of quick tasks ends before the call does: server/fastowed.py).
            return self._defer(rec, wait, "SubmitRun", lambda: self._submitted(rec, results))
        await _until_end(rec, wait)
        return self._submitted(rec, results)

    async def _deduplicated(
        self, run_id: int, wait: float | None, results: bool, context: Any
    ) -> Any:
        """The answer to a retry of a submit: the run its key names (its status too when
        the retry waits)."""
        if wait is None:
            return pb.SubmitRunResponse(run_id=run_id, deduplicated=True)
        rec = self._runs.record(run_id)
        if type(context) is FastContext and wait != 0 and not rec.terminal:
            return self._defer(
                rec, wait, "SubmitRun", lambda: self._submitted(rec, results, deduplicated=True)
            )
        await _until_end(rec, wait)
        return self._submitted(rec, results, deduplicated=True)

    def _submitted(self, rec: Any, results: bool, *, deduplicated: bool = False) -> Any:
        """The SubmitRunResponse of a waiting submit: the run's status now. Its own
        submitter's final status is then no longer owed (a deduplicated retry's is not
        taken: the status went to whoever submitted first as well)."""
        response = pb.SubmitRunResponse(run_id=rec.run_id, deduplicated=deduplicated)
        self._runs.status(rec, results, response.status)
        if not deduplicated:
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
            slicer = Slicer()
            plan, total = await self._plan.plan_run(request, pins, slicer)
            # Every buffer a task names is pinned, an output's too (the launch hands the
            # pins over to the run: look now).
            buffers = bool(pins)
            if buffers:
                self._check_pins(who, pins, "submit a run with")
            if slicer.paused:  # the loop ran meanwhile: the daemon may have begun stopping
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
        outputs = output_buffers(m for t in request.tasks for m in t.members) if buffers else _NONE
        self._owed.note(rec, outputs)
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
        timeout = (
            timeout_field(request, "timeout_seconds")
            if request.HasField("timeout_seconds")
            else None
        )
        return await self._wait(request.run_id, timeout, request.include_results, context)

    @unary_as("WaitRun")
    async def FastWaitRun(self, frame: Wait, context: Any) -> Any:
        """A WaitRun sent as the fast path's Wait frame (protocol version 2)."""
        if not 0 <= frame.run_id <= _U64_MAX:
            raise InvalidField("run_id", f"{frame.run_id} is not a run id")
        timeout = (
            timeout_field(frame, "timeout_seconds") if frame.timeout_seconds is not None else None
        )
        return await self._wait(frame.run_id, timeout, frame.include_results, context)

    async def _wait(self, run_id: int, timeout: float | None, include: bool, context: Any) -> Any:
        try:
            rec = self._runs.record(run_id)
        except UnrecordedRun as lost:  # nothing known of it, not even its owner: LOST
            return lost.status()
        self._owners.check_run(self._who(context), rec.client, rec.run_id, "wait for")
        if type(context) is FastContext and timeout != 0 and not rec.terminal:
            return self._defer(rec, timeout, "WaitRun", lambda: self._waited(rec, include))
        await _until_end(rec, timeout)
        return self._waited(rec, include)

    def _waited(self, rec: Any, include_results: bool) -> Any:
        status = self._runs.status(rec, include_results)
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

    @unary
    async def GetRunTrace(self, request: Any, context: Any) -> Any:
        """The run's task stream as Chrome Trace Event JSON (``scheduler/trace.py``): who
        may wait for a run may read its trace; a queued run's has no task yet."""
        rec = self._runs.record(request.run_id)
        self._owners.check_run(self._who(context), rec.client, rec.run_id, "trace")
        doc = self.trace_document(rec)
        # Built on the loop (where the attempts are appended), encoded off it.
        text = await asyncio.to_thread(json.dumps, doc, separators=(",", ":"))
        return pb.GetRunTraceResponse(trace_json=text.encode())

    def trace_document(self, rec: Any) -> dict[str, Any]:
        """Run ``rec``'s trace document (GetRunTrace, the dashboard); Precondition for a
        run restored from the history (its trace was in the old daemon's memory)."""
        state = pb.RunState.Name(rec.state).removeprefix("RUN_STATE_")
        worker = f"simpler-daemon level {self._worker.level} (pid {self._worker._pid})"
        trace = rec.trace
        if trace is not None:
            return trace.chrome(rec.run_id, state=state, worker=worker)  # type: ignore[no-any-return]
        if rec.terminal and rec.submit_ns < self.start_ns:  # restored from the history
            raise Precondition(
                "run_id",
                f"cannot trace run {rec.run_id}: it finished before the daemon restarted "
                "(a trace lives in the daemon's memory; the run history keeps its status only)",
            )
        return {  # queued, or ended before it started: no task ever ran
            "traceEvents": [
                {
                    "name": "process_name",
                    "ph": "M",
                    "pid": 1,
                    "tid": 0,
                    "args": {"name": worker},
                },
                {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "run"}},
            ],
            "displayTimeUnit": "ms",
            "otherData": {"run_id": rec.run_id, "state": state, "attempts": 0},
        }
