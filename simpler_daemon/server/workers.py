"""ListWorkers rows: ``Worker.list_workers()`` dicts -> ``WorkerInfo`` messages.

A local child's row carries liveness and lane state; a remote L3 session's row
(``kind == "remote"``) carries its endpoint, session id, runner pid, session
state and health numbers, which become the ``remote`` sub-message. A local L3
child's row (``kind == "l3"``, level 4) carries its own SUB and chip rows under
``children``; they become ``WorkerInfo.children``, so ListWorkers is the tree
L4 -> L3 -> SUB / chip with every pid.
"""

from __future__ import annotations

from typing import Any, Final

from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

__all__ = ["discovery_info", "remote_info", "worker_info"]

_WORKER_KINDS: Final[dict[str, pb.WorkerKind]] = {
    "sub": pb.WORKER_KIND_SUB,
    "chip": pb.WORKER_KIND_CHIP,
    "nested": pb.WORKER_KIND_NESTED_L3,
    "nested_l3": pb.WORKER_KIND_NESTED_L3,
    "l3": pb.WORKER_KIND_NESTED_L3,
    "remote": pb.WORKER_KIND_REMOTE_L3,
    "remote_l3": pb.WORKER_KIND_REMOTE_L3,
}


_REMOTE_STATES: Final[dict[str, pb.RemoteSessionState]] = {
    "ready": pb.REMOTE_SESSION_STATE_READY,
    "failed": pb.REMOTE_SESSION_STATE_FAILED,
    "closed": pb.REMOTE_SESSION_STATE_CLOSED,
    "reconnecting": pb.REMOTE_SESSION_STATE_RECONNECTING,
    "retired": pb.REMOTE_SESSION_STATE_RETIRED,
}


def _session_hex(value: Any) -> str:
    if isinstance(value, int):
        return f"{value:016x}"
    return str(value or "")


def remote_info(info: dict[str, Any]) -> Any:
    """The ``RemoteWorkerInfo`` of a ``kind == "remote"`` row of ``Worker.list_workers()``."""
    host, _, port = str(info.get("endpoint") or "").rpartition(":")
    return pb.RemoteWorkerInfo(
        host=host.strip("[]"),
        port=int(port) if port.isdigit() else 0,
        session_id=_session_hex(info.get("session_id")),
        runner_pid=int(info.get("pid") or 0),
        state=_REMOTE_STATES.get(str(info.get("state", "")), pb.REMOTE_SESSION_STATE_UNSPECIFIED),
        health_age_seconds=float(info.get("health_age_s") or 0.0),
        round_trip_us=float(info.get("round_trip_us") or 0.0),
        failures=int(info.get("failures") or 0),
        reconnects=int(info.get("reconnects") or 0),
        reconnect_attempts=int(info.get("attempts") or 0),
        next_try_seconds=None if info.get("next_try_s") is None else float(info["next_try_s"]),
        session_generation=int(info.get("session_generation") or 0),
    )


def worker_info(info: dict[str, Any], *, stopping: bool) -> Any:
    """One ``WorkerInfo`` from a ``Worker.list_workers()`` row."""
    if info.get("kind") == "remote":
        return _remote_worker_info(info, stopping=stopping)
    poisoned = info.get("poisoned")
    alive = info.get("alive", True)
    if poisoned or not alive:
        state = pb.WORKER_STATE_FAILED
    elif stopping:
        state = pb.WORKER_STATE_STOPPING
    elif info.get("busy"):
        state = pb.WORKER_STATE_BUSY
    else:
        state = pb.WORKER_STATE_IDLE
    # A local L3 child's subtree, as its last published status page lists it.
    children = [worker_info(row, stopping=stopping) for row in info.get("children") or ()]
    return pb.WorkerInfo(
        worker_id=int(info.get("worker_id", 0)),
        kind=_WORKER_KINDS.get(str(info.get("kind", "")), pb.WORKER_KIND_UNSPECIFIED),
        state=state,
        pid=int(info.get("pid") or 0),
        endpoint=str(info.get("endpoint") or ""),
        tasks_completed=int(info.get("tasks_completed") or 0),
        restarts=int(info.get("restarts") or 0),
        message=str(poisoned or ("" if alive else "the child process exited")),
        children=children,
    )


def _remote_worker_info(info: dict[str, Any], *, stopping: bool) -> Any:
    remote = remote_info(info)
    session = remote.state
    if session in (pb.REMOTE_SESSION_STATE_FAILED, pb.REMOTE_SESSION_STATE_RECONNECTING):
        state = pb.WORKER_STATE_FAILED
    elif stopping or session in (pb.REMOTE_SESSION_STATE_CLOSED, pb.REMOTE_SESSION_STATE_RETIRED):
        state = pb.WORKER_STATE_STOPPING
    elif session == pb.REMOTE_SESSION_STATE_READY:
        state = pb.WORKER_STATE_BUSY if info.get("busy") else pb.WORKER_STATE_IDLE
    else:
        state = pb.WORKER_STATE_STARTING
    # engine/remote_l3.py names a failed or removed session's cause "reason".
    message = info.get("poisoned") or info.get("reason") or info.get("message") or ""
    return pb.WorkerInfo(
        worker_id=int(info.get("worker_id", 0)),
        kind=pb.WORKER_KIND_REMOTE_L3,
        state=state,
        pid=0,  # the runner's pid lives on another host: remote.runner_pid
        endpoint=str(info.get("endpoint") or ""),
        tasks_completed=int(info.get("tasks_completed") or 0),
        restarts=int(info.get("restarts") or 0),
        message=str(message),
        remote=remote,
    )


def discovery_info(view: dict[str, Any] | None) -> Any:
    """The ``DiscoveryInfo`` of ``Discovery.view()`` (server/discovery.py); empty when
    discovery is off (``view`` None)."""
    if view is None:
        return pb.DiscoveryInfo()
    return pb.DiscoveryInfo(
        dns=view["dns"],
        resolver=view["resolver"],
        refresh_seconds=view["refresh_s"],
        last_resolve_unix=view["last_resolve"],
        last_success_unix=view["last_success"],
        resolutions=view["resolutions"],
        failures=view["failures"],
        error=view["error"],
        addresses=[pb.DiscoveredAddress(**a) for a in view["addresses"]],
    )
