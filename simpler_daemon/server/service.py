"""The ``simpler.daemon.v1.Daemon`` gRPC servicer: one thin handler per RPC.

Everything runs on the daemon's one event loop, beside the Scheduler coroutine::

    client --gRPC--> DaemonService.<Rpc>
                         |-- Planner (plan.py): request -> validated plan, or a RequestError
                         |-- RunTable (runs.py): run records, events, watchers, retention
                         |-- worker_info (workers.py): ListWorkers rows, remote sessions
                         |-- Worker: register / alloc / submit_async / add_remote_worker_async
                         v
                     status_of (status.py): exception -> gRPC status code

Data flows down: handlers call the planner and the run table; neither of them
knows this module.

The loop must stay responsive for every client: a big SubmitRun is planned and
built in slices (plan.py), a RunOrchestration function runs on a worker thread
(offloop.py), garbage request bytes never reach a handler as a message
(decoding.py), and a client is who the kernel or the transport says (peers.py).

Every run, buffer and registration has an owner (``Identity.owner``); only the owner
or an admin acts on it, admin calls need an admin, and each owner has quotas
(access.py).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import Any

from simpler_daemon import __version__
from simpler_daemon.engine.worker import WorkerState
from simpler_daemon.errors import InvalidField, PeerUnavailable, Precondition, StartupError
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2_grpc as pb_grpc
from simpler_daemon.server.access import require_admin
from simpler_daemon.server.buffers_rpc import READ_CHUNK, BuffersRpc
from simpler_daemon.server.callables_rpc import CallablesRpc
from simpler_daemon.server.peers import AdminPolicy, Identity
from simpler_daemon.server.rpc_base import unary
from simpler_daemon.server.runs import RunTable, now_ts
from simpler_daemon.server.runs_rpc import RunsRpc
from simpler_daemon.server.workers import discovery_info, worker_info

__all__ = ["READ_CHUNK", "DaemonService"]

log = logging.getLogger("simpler_daemon.service")


class DaemonService(RunsRpc, BuffersRpc, CallablesRpc, pb_grpc.DaemonServicer):
    """Every RPC of ``simpler.daemon.v1.Daemon`` over one started ``Worker``.

    The handlers live in one module per concept (runs_rpc.py, buffers_rpc.py,
    callables_rpc.py); the shared state and plumbing in rpc_base.py. This class
    adds the info and operations RPCs.
    """

    #: The daemon's DNS discovery (server/discovery.py), set by the daemon; None: off.
    discovery: Any = None

    # ====================================================================== for the dashboard

    @property
    def runs(self) -> RunTable:
        """The run table (server/dashboard.py reads it as ListRuns and WaitRun do)."""
        return self._runs

    @property
    def admins(self) -> AdminPolicy:
        """Who is an admin (server/dashboard.py names its callers with it)."""
        return self._admins

    @property
    def worker(self) -> Any:
        """The Worker the RPCs drive."""
        return self._worker

    # ====================================================================== RPCs: info

    @unary
    async def GetInfo(self, request: Any, context: Any) -> Any:
        return self.info(self._who(context))

    def info(self, who: Identity) -> Any:
        """The ``GetInfoResponse`` as ``who`` sees it (GetInfo, the dashboard's overview)."""
        w = self._worker
        heap = w.heap
        lim = self._limits
        used = 0 if heap.closed else heap.size - heap.free_bytes()
        return pb.GetInfoResponse(
            version=__version__,
            level=w.level,
            hostname=self._hostname,
            pid=os.getpid(),
            start_time=now_ts(self.start_ns),
            serving_state=(
                pb.SERVING_STATE_UNHEALTHY
                if self.health_reason and self.serving_state == pb.SERVING_STATE_SERVING
                else self.serving_state
            ),
            serving_reason=self.health_reason,
            heap=pb.HeapInfo(name=heap.name or "", size_bytes=heap.size, used_bytes=used),
            limits=pb.Limits(
                max_message_bytes=lim.max_message_bytes,
                max_tasks_per_run=lim.max_tasks_per_run,
                max_tensors_per_task=lim.max_tensors_per_task,
                max_scalars_per_task=lim.max_scalars_per_task,
                max_buffer_bytes=lim.max_buffer_bytes,
                max_concurrent_runs=lim.max_concurrent_runs,
                max_streams_per_client=lim.max_streams_per_client,
                per_client_runs=lim.per_client_runs,
                per_client_heap_bytes=lim.per_client_heap_bytes,
                per_client_registrations=lim.per_client_registrations,
                max_group_members=lim.max_group_members,
                max_value_bytes=lim.max_value_bytes,
                max_result_bytes=lim.max_result_bytes,
                admission=self._config.scheduler.admission,
            ),
            num_sub_workers=w.num_sub_workers,
            num_next_level_workers=len(self._plan.next_level_ids()),
            active_runs=self._runs.active_count,
            caller=who.owner,
            caller_is_admin=who.admin,
        )

    @unary
    async def ListWorkers(self, request: Any, context: Any) -> Any:
        stopping = self._worker.state is not WorkerState.READY
        out = pb.ListWorkersResponse()
        for info in self._worker.list_workers():
            out.workers.append(worker_info(info, stopping=stopping))
        if self.discovery is not None:
            out.discovery.CopyFrom(discovery_info(self.discovery.view()))
        return out

    # ====================================================================== operations

    @unary
    async def AddRemoteWorker(self, request: Any, context: Any) -> Any:
        level = self._worker.level
        if level != 4:
            raise Precondition(
                "",
                f"cannot add a remote worker: this daemon is level {level}; remote L3 workers "
                "need daemon.level = 4",
            )
        require_admin(self._who(context), "add a remote worker")
        spec = self._plan.remote_spec(request)
        self._check_usable("add a remote worker")
        try:
            worker_id = await self._worker.add_remote_worker_async(spec)
        except StartupError as exc:
            raise PeerUnavailable("", str(exc)) from exc
        except ValueError as exc:  # the Worker's own checks of the spec
            raise InvalidField("endpoint", str(exc)) from exc
        log.info("remote worker %d added: %s", worker_id, spec.endpoint)
        return pb.AddRemoteWorkerResponse(worker_id=worker_id)

    @unary
    async def Drain(self, request: Any, context: Any) -> Any:
        require_admin(self._who(context), "shut down" if request.shutdown else "drain")
        if request.HasField("grace_seconds"):
            grace = request.grace_seconds
            if not math.isfinite(grace) or grace < 0:
                raise InvalidField("grace_seconds", f"must be >= 0, got {grace}")
        else:
            grace = self._config.daemon.shutdown_grace
        if request.shutdown:
            # From now on a Resume cannot undo this drain: the daemon is going away.
            self._shutdown_requested = True
        finished, cancelled = await self.drain(grace, reason="drain requested")
        if request.shutdown and self._request_shutdown is not None:
            self._request_shutdown("Drain(shutdown=true)")
        return pb.DrainResponse(runs_finished=finished, runs_cancelled=cancelled)

    @unary
    async def Resume(self, request: Any, context: Any) -> Any:
        who = self._who(context)
        require_admin(who, "resume")
        if (
            self._shutdown_requested
            or self.serving_state == pb.SERVING_STATE_STOPPING
            or self._worker.state is not WorkerState.READY
        ):
            raise Precondition("", "cannot resume: the daemon is shutting down")
        if self.serving_state != pb.SERVING_STATE_DRAINING:
            return pb.ResumeResponse(was_draining=False)
        # A drain still in its grace period ends now and cancels nothing: its Drain
        # call answers runs_cancelled = 0 (runs_finished: those that finished meanwhile).
        self.serving_state = pb.SERVING_STATE_SERVING
        aborted = self._runs.abort_drain()
        self._owed.end()
        log.info(
            "resumed by %s: admitting runs again%s",
            who,
            "; the drain in its grace period cancels nothing" if aborted else "",
        )
        if self._on_resumed is not None:
            await self._on_resumed()
        return pb.ResumeResponse(was_draining=True)

    async def drain(self, grace: float, *, reason: str) -> tuple[int, int]:
        """Stop admitting runs, give the active ones ``grace`` seconds, cancel the rest.

        Returns ``(finished, cancelled)``. The cancelled runs become terminal once
        their running tasks finish; watchers see them CANCELLED.
        """
        if self.serving_state == pb.SERVING_STATE_SERVING:
            self.serving_state = pb.SERVING_STATE_DRAINING
            if self._on_draining is not None:
                await self._on_draining()
        self._owed.begin()
        return await self._runs.drain(grace, reason=reason)

    async def settle_owed(self, timeout: float, status: Callable[[str], Any]) -> bool:
        """Keep serving until the owners of the runs a drain let finish have read their
        outputs (server/owed.py), at most ``timeout`` seconds; ``status`` gets a line for
        systemd. False when something was left unread."""
        return await self._owed.settle(timeout, status)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no run is active; False when ``timeout`` passed first."""
        return await self._runs.wait_idle(timeout)
