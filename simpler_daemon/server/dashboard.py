"""The live status page: a read-only dashboard and its JSON, on the metrics listener.

``[dashboard] enabled = true`` adds these paths to ``metrics.listen`` (``/metrics``
stays what it was; metrics.py owns the socket, the limits and the token)::

    GET /                  the page (dashboard_static/: HTML, CSS, plain JS, no build)
    GET /api/overview      GetInfo as the caller sees it, queue depths, runs by state
    GET /api/workers       ListWorkers rows, with each lane's current task and the last
                           restart's cause
    GET /api/runs          ListRuns as the caller may see it: ?state=&owner=&limit=&before=
    GET /api/runs/{id}     the run's status (WaitRun's RunStatus without results)
    GET /api/runs/{id}/trace   its task stream as a Chrome trace (GetRunTrace's document)

Nothing is computed unless a page or a script asks (the page polls its view's JSON
about once a second and stops while hidden). Who asks is named like a gRPC caller
(peers.http_identity: the local user of a loopback connection, else ``tcp:<host>``),
and runs are shown as ListRuns shows them: a client its own, an admin everyone's.
With ``metrics.token_file`` every path answers 401 without the token; the 401 page
is a login form that keeps the token in the browser's sessionStorage and sends it as
``Authorization: Bearer`` (never in a URL). Every answer is bounded (row limits,
texts clipped); the page writes data with ``textContent`` only.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import time
import urllib.parse
from collections.abc import Mapping
from importlib import resources
from typing import Any, Final

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict

from simpler_daemon.errors import AccessDenied, Precondition, RequestError, UnknownObject
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server.access import Owners
from simpler_daemon.server.peers import Identity, http_identity
from simpler_daemon.server.workers import worker_info

__all__ = ["MAX_RUNS", "MAX_SPANS", "MAX_TEXT", "MAX_WORKERS", "Dashboard", "Response"]

#: Runs in one ``/api/runs`` answer at most (``limit`` above it is refused).
MAX_RUNS: Final = 500
#: Runs when no ``limit`` is given.
DEFAULT_RUNS: Final = 50
#: Worker rows in one ``/api/workers`` answer at most.
MAX_WORKERS: Final = 2000
#: Characters of one text (label, error, callable name) in any answer.
MAX_TEXT: Final = 2000
#: Task events of a run's trace the page gets (a download gets them all).
MAX_SPANS: Final = 5000
_JSON_HEADERS: Final = {
    "Content-Type": "application/json; charset=utf-8",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
}

Response = tuple[int, dict[str, str], bytes]

_STATIC: Final = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
#: Run states by the names the API takes and gives (``RUN_STATE_`` dropped, lower case).
RUN_STATES: Final = {
    name.removeprefix("RUN_STATE_").lower(): value
    for name, value in pb.RunState.items()
    if value != pb.RUN_STATE_UNSPECIFIED
}
_RUN_PATH: Final = re.compile(r"^/api/runs/([0-9]{1,19})(/trace)?$")
_OWNER: Final = re.compile(r"^[\w.:@\-\[\]]{1,200}$")


def _static(name: str) -> bytes:
    return resources.files("simpler_daemon.server").joinpath("dashboard_static", name).read_bytes()


def _inline_hash(page: bytes, tag: bytes) -> str:
    block = re.search(b"<" + tag + b">(.*?)</" + tag + b">", page, re.S)
    assert block is not None, f"dashboard_static/login.html has no inline {tag.decode()}"
    return "'sha256-" + base64.b64encode(hashlib.sha256(block.group(1)).digest()).decode() + "'"


def _login_page() -> tuple[bytes, str]:
    """The 401 page and its Content-Security-Policy: its own inline script and style
    are allowed by their hashes, nothing else inline."""
    page = _static("login.html")
    return page, _csp(_inline_hash(page, b"script"), _inline_hash(page, b"style"))


def _csp(script_hash: str = "", style_hash: str = "") -> str:
    return (
        f"default-src 'none'; script-src 'self' blob: {script_hash}".rstrip()
        + f"; style-src 'self' blob: {style_hash}".rstrip()
        + "; img-src 'self' data:; connect-src 'self'; "
        "form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
    )


def _clip(value: Any) -> Any:
    """``value`` with every string cut to :data:`MAX_TEXT` characters (nested too)."""
    if isinstance(value, str):
        return value if len(value) <= MAX_TEXT else value[: MAX_TEXT - 1] + "…"
    if isinstance(value, list):
        return [_clip(v) for v in value]
    if isinstance(value, dict):
        return {k: _clip(v) for k, v in value.items()}
    return value


_INT64: Final = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def _numbers(descriptor: Any, data: dict[str, Any]) -> dict[str, Any]:
    """64-bit integers back to JSON numbers (protobuf's JSON mapping writes them as
    strings); a script reading ``run_id`` gets an int."""
    for f in descriptor.fields:
        value = data.get(f.name)
        if value is None:
            continue
        items = value if isinstance(value, list) else [value]
        if f.type in _INT64:
            ints = [int(v) for v in items]
            data[f.name] = ints if isinstance(value, list) else ints[0]
        elif f.message_type is not None and f.message_type.full_name.startswith("simpler."):
            for item in items:
                if isinstance(item, dict):
                    _numbers(f.message_type, item)
    return data


def _dict(message: Any) -> dict[str, Any]:
    """``message`` as JSON: proto field names, every field present, enums by name."""
    out = MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers(message.DESCRIPTOR, out)


def _state_name(value: int) -> str:
    return pb.RunState.Name(value).removeprefix("RUN_STATE_").lower()


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Dashboard:
    """The dashboard's routes over a started DaemonService (metrics.py calls
    :meth:`handle` for every path but ``/metrics``)."""

    def __init__(self, service: Any) -> None:
        self._service = service
        self._files = {path: (_static(name), kind) for path, (name, kind) in _STATIC.items()}
        self._login, self._login_csp = _login_page()

    # -- entry points (metrics.py) -----------------------------------------------------

    def unauthorized(self, path: str) -> Response:
        """The 401 of a request without the token: the login page, or JSON for /api/."""
        headers = {"WWW-Authenticate": 'Bearer realm="dashboard"', "Cache-Control": "no-store"}
        if path.startswith("/api/"):
            return self._json(
                401,
                {"error": "missing or wrong bearer token: send 'Authorization: Bearer <token>'"},
                headers,
            )
        headers["Content-Type"] = "text/html; charset=utf-8"
        headers["Content-Security-Policy"] = self._login_csp
        return 401, headers, self._login

    async def handle(
        self, method: str, target: str, peer: tuple[str, int], local: tuple[str, int]
    ) -> Response:
        """Answer ``method target`` from ``peer`` (already past the token check)."""
        path, _, query = target.partition("?")
        if method not in ("GET", "HEAD"):
            return self._json(
                405,
                {"error": f"method {method} not allowed: the dashboard is read-only"},
                {"Allow": "GET, HEAD"},
            )
        try:
            if path in self._files:
                body, kind = self._files[path]
                headers = {"Content-Type": kind, "Cache-Control": "no-store"}
                headers["Content-Security-Policy"] = _csp()
                headers["X-Content-Type-Options"] = "nosniff"
                return 200, headers, body
            params = self._params(query)
            who = http_identity(peer, local, self._service.admins)
            if path == "/api/overview":
                return self._json(200, self._overview(who))
            if path == "/api/workers":
                return self._json(200, self._workers())
            if path == "/api/runs":
                return self._json(200, self._runs(who, params))
            match = _RUN_PATH.match(path)
            if match is not None:
                rec = self._record(who, int(match.group(1)))
                if match.group(2):
                    return await self._trace(rec, download=bool(params.get("download")))
                return self._json(200, self._run(rec))
        except _BadRequest as exc:
            return self._json(exc.status, {"error": str(exc)})
        return self._json(
            404,
            {
                "error": f"no such page: {path[:200]} (the dashboard serves /, /api/overview, "
                "/api/workers, /api/runs and /api/runs/{id}[/trace]; metrics are at /metrics)"
            },
        )

    # -- views --------------------------------------------------------------------------

    def _overview(self, who: Identity) -> dict[str, Any]:
        service = self._service
        info = _dict(service.info(who))
        worker = service.worker
        scheduler = worker.scheduler
        runs = service.runs
        info["uptime_seconds"] = round(max(0.0, (time.time_ns() - service.start_ns) / 1e9), 1)
        info["queues"] = {
            "ready_tasks": scheduler.queued() if scheduler is not None else 0,
            "queued_runs": runs.queued_count,
            "active_runs": runs.active_count,
        }
        info["runs_by_state"] = runs.state_counts()
        info["restarts"] = dict(worker.restarts)
        return _clip(info)  # type: ignore[no-any-return]

    def _workers(self) -> dict[str, Any]:
        from simpler_daemon.engine.worker import WorkerState

        worker = self._service.worker
        stopping = worker.state is not WorkerState.READY
        rows = worker.list_workers()
        out = []
        for row in rows[:MAX_WORKERS]:
            item = _dict(worker_info(row, stopping=stopping))
            item["current_task"] = str(row.get("current_task") or "")
            item["last_restart_cause"] = str(row.get("last_restart_cause") or "")
            out.append(item)
        return _clip(  # type: ignore[no-any-return]
            {"level": worker.level, "workers": out, "truncated": len(rows) > MAX_WORKERS}
        )

    def _runs(self, who: Identity, params: Mapping[str, str]) -> dict[str, Any]:
        states: set[int] = set()
        for name in filter(None, params.get("state", "").split(",")):
            if name not in RUN_STATES:
                raise _BadRequest(
                    400,
                    f"state {name[:40]!r} is not a run state (one of {', '.join(RUN_STATES)})",
                )
            states.add(RUN_STATES[name])
        limit = self._int(params, "limit", DEFAULT_RUNS, 1, MAX_RUNS)
        before = self._int(params, "before", 0, 0, 2**63 - 1)
        owner: str | None = params.get("owner", "") or None
        if owner is not None and not _OWNER.match(owner):
            raise _BadRequest(400, f"owner {owner[:40]!r} is not a client name (e.g. uid:1000)")
        if not who.admin:
            if owner is not None and owner != who.owner:
                raise _BadRequest(
                    403,
                    f"cannot list the runs of {owner}: only an admin sees other clients' runs "
                    f"(you are {who.owner})",
                )
            owner = who.owner  # a client sees its own runs only (as ListRuns)
        now = time.time_ns()
        records = self._service.runs.list_runs(owner, states, limit + 1, before)
        rows = [self._summary(rec, now) for rec in records[:limit]]
        more = len(records) > limit
        return _clip(  # type: ignore[no-any-return]
            {
                "caller": who.owner,
                "caller_is_admin": who.admin,
                "runs": rows,
                "next_before": rows[-1]["run_id"] if more and rows else None,
            }
        )

    @staticmethod
    def _summary(rec: Any, now: int) -> dict[str, Any]:
        row = _dict(rec.summary(now))
        row["state"] = _state_name(rec.proto_state())
        error = rec.error_proto() if row["state"] in ("failed", "cancelled", "lost") else None
        row["error"] = str(error.message) if error is not None else ""
        return row

    def _record(self, who: Identity, run_id: int) -> Any:
        try:
            rec = self._service.runs.record(run_id, field="")
            Owners.check_run(who, rec.client, rec.run_id, "see")
        except UnknownObject as exc:
            raise _BadRequest(404, str(exc)) from exc
        except AccessDenied as exc:
            raise _BadRequest(403, str(exc)) from exc
        except RequestError as exc:
            raise _BadRequest(400, str(exc)) from exc
        return rec

    def _run(self, rec: Any) -> dict[str, Any]:
        out = _dict(rec.status())
        out.pop("results", None)  # never asked for: WaitRun's include_results gives them
        out["state"] = _state_name(rec.proto_state())
        out["age_seconds"] = round(max(0.0, (time.time_ns() - rec.submit_ns) / 1e9), 3)
        return _clip(out)  # type: ignore[no-any-return]

    async def _trace(self, rec: Any, *, download: bool) -> Response:
        """The run's Chrome trace (scheduler/trace.py, as GetRunTrace gives it): whole for
        a download, its first :data:`MAX_SPANS` task events for the page (which polls it);
        encoded off the loop, as GetRunTrace does."""
        try:
            doc = self._service.trace_document(rec)
        except Precondition as exc:
            raise _BadRequest(409, str(exc)) from exc
        headers = {}
        if download:
            headers["Content-Disposition"] = f'attachment; filename="run-{rec.run_id}-trace.json"'
        else:
            events = doc["traceEvents"]
            tasks = [e for e in events if e.get("cat") == "task"]
            if len(tasks) > MAX_SPANS:
                kept = [e for e in events if e.get("cat") != "task"] + tasks[:MAX_SPANS]
                doc = {**doc, "traceEvents": kept}
                doc["otherData"] = {**doc["otherData"], "not_drawn": len(tasks) - MAX_SPANS}
        body = await asyncio.to_thread(
            lambda: json.dumps(_clip(doc), ensure_ascii=False, separators=(",", ":")).encode()
        )
        return 200, {**_JSON_HEADERS, **headers}, body

    # -- helpers ------------------------------------------------------------------------

    @staticmethod
    def _params(query: str) -> dict[str, str]:
        try:
            pairs = urllib.parse.parse_qsl(query[:4096], strict_parsing=False, max_num_fields=16)
        except ValueError as exc:
            raise _BadRequest(400, f"bad query string: {exc}") from exc
        return dict(pairs)

    @staticmethod
    def _int(params: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
        text = params.get(name, "")
        if not text:
            return default
        if not text.isdigit() or not low <= int(text) <= high:
            raise _BadRequest(
                400, f"{name} must be an integer from {low} to {high}, got {text[:40]!r}"
            )
        return int(text)

    @staticmethod
    def _json(status: int, data: Any, headers: Mapping[str, str] | None = None) -> Response:
        body = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
        out = dict(_JSON_HEADERS)
        out.update(headers or {})
        return status, out, body


def dashboard_files() -> list[str]:
    """The package data the dashboard needs (checked by the tests: an install ships them)."""
    return sorted({name for name, _ in _STATIC.values()} | {"login.html"})
