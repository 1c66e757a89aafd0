"""simplerctl output: protobuf messages as JSON data, tables and status lines.

Every command formats through :class:`Out`, which prints human text or JSON
on stdout and errors on stderr; the helpers below only turn daemon messages
(``RunStatus``, ``RunEvent``, ``WorkerInfo``) into strings or plain data and
never talk to the daemon.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from simpler_daemon.server._proto.simpler.daemon.v1 import daemon_pb2 as pb

__all__ = [
    "Out",
    "event_line",
    "print_status",
    "progress_line",
    "remote_header",
    "remote_row",
    "short_name",
    "state_name",
    "to_dict",
    "worker_header",
    "worker_rows",
]


def to_dict(msg: Any) -> dict[str, Any]:
    """A message as plain JSON data: enum names, ints as numbers, RFC 3339 timestamps."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        name = field.name
        if field.has_presence and not msg.HasField(name):
            continue
        value = getattr(msg, name)
        if field.is_repeated:
            out[name] = [_value(field, v) for v in value]
        else:
            out[name] = _value(field, value)
    return out


def _value(field: Any, value: Any) -> Any:
    if field.type == field.TYPE_MESSAGE:
        if field.message_type.full_name == "google.protobuf.Timestamp":
            return value.ToJsonString() if (value.seconds or value.nanos) else None
        return to_dict(value)
    if field.type == field.TYPE_ENUM:
        ev = field.enum_type.values_by_number.get(value)
        return ev.name if ev is not None else value
    if field.type == field.TYPE_BYTES:
        return value.hex()
    return value


def short_name(enum_name: str) -> str:
    for prefix in (
        "RUN_STATE_",
        "RUN_EVENT_TYPE_",
        "WORKER_KIND_",
        "WORKER_STATE_",
        "SERVING_STATE_",
        "CALLABLE_KIND_",
    ):
        if enum_name.startswith(prefix):
            return enum_name[len(prefix) :]
    return enum_name


class Out:
    """Human text or JSON on stdout; errors on stderr."""

    def __init__(self, as_json: bool, stream: TextIO | None = None) -> None:
        self.json = as_json
        self.stream = stream or sys.stdout

    def data(self, obj: Any) -> None:
        print(json.dumps(obj, indent=None if isinstance(obj, list) else 2), file=self.stream)

    def line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def table(self, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        cells = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        for r in cells:
            self.line("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())

    def error(self, code: str, message: str) -> None:
        if self.json:
            print(json.dumps({"error": {"code": code, "message": message}}), file=self.stream)
        print(
            f"simplerctl: {code}: {message}" if code else f"simplerctl: {message}",
            file=sys.stderr,
            flush=True,
        )


def state_name(state: int) -> str:
    return short_name(pb.RunState.Name(state)) if state in pb.RunState.values() else str(state)


def print_status(out: Out, status: pb.RunStatus) -> None:
    if out.json:
        out.data(to_dict(status))
        return
    c = status.counts
    out.line(
        f"run {status.run_id}: {state_name(status.state)} "
        f"(done {c.done}/{c.total}, failed {c.failed}, running {c.running})"
    )
    if status.state in (pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED) and status.error.message:
        out.line(f"  error: {status.error.message}")


def worker_header() -> list[str]:
    """The columns of :func:`worker_rows`."""
    return ["ID", "KIND", "STATE", "PID", "TASKS", "RESTARTS", "MESSAGE"]


def worker_rows(workers: Sequence[pb.WorkerInfo], depth: int = 0) -> list[list[Any]]:
    """``simplerctl workers``: one row per worker, a local L3 worker's own SUB and chip
    children right below it, their ids indented (the tree L4 -> L3 -> children)."""
    rows: list[list[Any]] = []
    for w in workers:
        rows.append(
            [
                "  " * depth + str(w.worker_id),
                short_name(pb.WorkerKind.Name(w.kind)),
                short_name(pb.WorkerState.Name(w.state)),
                w.pid,
                w.tasks_completed,
                w.restarts,
                w.message or w.endpoint,
            ]
        )
        rows += worker_rows(w.children, depth + 1)
    return rows


def remote_header() -> list[str]:
    """The columns of :func:`remote_row`."""
    return [
        "ID",
        "KIND",
        "ENDPOINT",
        "SESSION",
        "RUNNER_PID",
        "STATE",
        "HEALTH_AGE_S",
        "RTT_US",
        "FAILURES",
        "RECONNECTS",
    ]


def remote_row(w: pb.WorkerInfo) -> list[Any]:
    """One remote L3 session of ``simplerctl workers``."""
    r = w.remote
    host = f"[{r.host}]" if ":" in r.host else r.host
    return [
        w.worker_id,
        "remote",
        f"{host}:{r.port}",
        r.session_id,
        r.runner_pid,
        pb.RemoteSessionState.Name(r.state).removeprefix("REMOTE_SESSION_STATE_").lower(),
        f"{r.health_age_seconds:.3f}",
        f"{r.round_trip_us:.0f}",
        r.failures,
        r.reconnects,
    ]


def progress_line(ev: pb.RunEvent, width: int = 30) -> str:
    c = ev.counts
    total = max(c.total, 1)
    filled = min(width, round(width * (c.done + c.failed) / total))
    bar = "#" * filled + "-" * (width - filled)
    return (
        f"run {ev.run_id} [{bar}] {c.done + c.failed}/{c.total}  done {c.done}  "
        f"failed {c.failed}  running {c.running}  {state_name(ev.state)}"
    )


def event_line(ev: pb.RunEvent) -> str:
    parts = [f"run {ev.run_id}", f"#{ev.sequence}", short_name(pb.RunEventType.Name(ev.type))]
    if ev.HasField("task_index"):
        parts.append(f"task {ev.task_index}")
    if ev.HasField("member_index"):
        parts.append(f"member {ev.member_index}")
    if ev.HasField("worker_id"):
        parts.append(f"worker {ev.worker_id}")
    if ev.outcome:
        parts.append(ev.outcome)
    c = ev.counts
    parts.append(f"(done {c.done}/{c.total}, failed {c.failed}, running {c.running})")
    parts.append(state_name(ev.state))
    if ev.message:
        parts.append("- " + ev.message.splitlines()[0])
    return " ".join(parts)
