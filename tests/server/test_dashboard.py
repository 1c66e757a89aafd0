"""The dashboard's HTTP side against a real daemon: every endpoint, the token, bounds.

One module daemon with ``[dashboard] enabled`` and a metrics token; the browser tests
(test_dashboard_browser.py) drive the page itself.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpler_daemon.client import sub_task, tensor
from simpler_daemon.errors import Precondition
from simpler_daemon.server import dashboard, peers
from simpler_daemon.server.dashboard import (
    MAX_RUNS,
    MAX_SPANS,
    MAX_TEXT,
    Dashboard,
    _BadRequest,
    _clip,
    dashboard_files,
)
from tests.support.daemon_harness import (
    EXAMPLES,
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    running_daemon,
    wait_until,
)
from tests.support.users import throwaway_user

pytestmark = pytest.mark.timeout(90)

TOKEN = "dashboard-test-token-0123456789"
EVIL = "<script>alert('label')</script>&amp;\"'"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    secret = tmp_path_factory.mktemp("token") / "metrics-token"
    secret.write_text(TOKEN)
    secret.chmod(0o600)
    overrides = {
        "metrics": {"listen": f"127.0.0.1:{free_port()}", "token_file": str(secret)},
        "dashboard": {"enabled": True},
    }
    yield from module_daemon(tmp_path_factory, "dashboard", overrides)


@pytest.fixture(autouse=True)
def no_leaked_children(daemon: DaemonProcess) -> Iterator[None]:
    yield from module_leak_guard(lambda: {daemon.pid})


def port_of(daemon: DaemonProcess) -> int:
    text = daemon.config_path.read_text()
    line = next(x for x in text.splitlines() if x.startswith("listen = "))
    return int(line.rsplit(":", 1)[1].strip('"'))


def fetch(
    daemon: DaemonProcess, path: str, *, token: str | None = TOKEN, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port_of(daemon), timeout=10)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        conn.request(method, path, headers=headers)
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        conn.close()


def get_json(daemon: DaemonProcess, path: str, status: int = 200) -> Any:
    code, headers, body = fetch(daemon, path)
    assert code == status, (path, code, body)
    assert headers["content-type"] == "application/json; charset=utf-8"
    assert headers["x-content-type-options"] == "nosniff"
    return json.loads(body)


def test_every_path_needs_the_token(daemon: DaemonProcess) -> None:
    for path in ("/", "/dashboard.js", "/api/overview", "/api/runs", "/api/runs/1", "/nope"):
        for token in (None, "wrong-token-of-the-same-length-xx"):
            code, headers, body = fetch(daemon, path, token=token)
            assert code == 401, (path, token)
            assert "Bearer" in headers["www-authenticate"]
    code, headers, body = fetch(daemon, "/", token=None)
    page = body.decode()
    assert headers["content-type"].startswith("text/html")
    assert 'id="login"' in page and 'type="password"' in page
    assert "sessionStorage" in page and "Authorization" in page
    # The login page's own script is allowed by its hash, nothing else inline.
    csp = headers["content-security-policy"]
    assert "'sha256-" in csp and "unsafe-inline" not in csp
    code, headers, body = fetch(daemon, "/api/workers", token=None)
    assert "bearer token" in json.loads(body)["error"]
    assert fetch(daemon, "/metrics", token=None)[0] == 401  # /metrics keeps its own 401
    assert fetch(daemon, "/metrics")[0] == 200


def test_page_and_assets(daemon: DaemonProcess) -> None:
    for path, kind in (
        ("/", "text/html"),
        ("/dashboard.js", "text/javascript"),
        ("/dashboard.css", "text/css"),
    ):
        code, headers, body = fetch(daemon, path)
        assert code == 200 and headers["content-type"].startswith(kind), path
        assert "script-src 'self' blob:" in headers["content-security-policy"]
        assert body
    js = fetch(daemon, "/dashboard.js")[2].decode()
    assert "innerHTML" not in js and "textContent" in js
    assert set(dashboard_files()) == {"dashboard.css", "dashboard.js", "index.html", "login.html"}


def test_unknown_paths_and_methods(daemon: DaemonProcess) -> None:
    for path in ("/nope", "/api", "/api/runs/abc", "/api/runs/1/other", "/api/runs/-1"):
        data = get_json(daemon, path, 404)
        assert "no such page" in data["error"]
    data = get_json(daemon, "/api/runs/987654", 404)
    assert data["error"] == "run 987654 is unknown (never submitted)"
    assert "required" in get_json(daemon, "/api/runs/0", 400)["error"]
    code, headers, body = fetch(daemon, "/api/runs", method="POST")
    assert code == 405 and "read-only" in json.loads(body)["error"]
    code, headers, body = fetch(daemon, "/api/overview", method="HEAD")
    assert code == 200 and body == b"" and int(headers["content-length"]) > 0


def test_overview_and_workers(daemon: DaemonProcess) -> None:
    o = get_json(daemon, "/api/overview")
    assert o["level"] == 3 and o["serving_state"] == "SERVING_STATE_SERVING"
    assert o["caller"] == f"uid:{os.getuid()}" and o["caller_is_admin"] is True
    assert o["heap"]["size_bytes"] == 16 << 20 and isinstance(o["heap"]["used_bytes"], int)
    assert set(o["queues"]) == {"ready_tasks", "queued_runs", "active_runs"}
    assert o["limits"]["admission"] == "fair" and o["uptime_seconds"] >= 0
    assert set(o["runs_by_state"]) >= {"queued", "active", "completed", "failed"}
    w = get_json(daemon, "/api/workers")
    assert w["level"] == 3 and not w["truncated"]
    subs = [x for x in w["workers"] if x["kind"] == "WORKER_KIND_SUB"]
    assert len(subs) == 2 and {x["pid"] for x in subs} == set(daemon.worker_pids)
    for row in subs:
        assert {"current_task", "last_restart_cause", "restarts", "tasks_completed"} <= set(row)


def _flag_run(c: Any, n: int, label: str) -> tuple[int, list[int]]:
    """A run of ``n`` wait_for_flag tasks, each held until its flag buffer is written."""
    wait = c.register(f"{EXAMPLES}:wait_for_flag")
    flags = [int(c.alloc_buffer((2,), "uint8").buffer_id) for _ in range(n)]
    tasks = [sub_task(wait, [tensor(f, "inout", (2,), "uint8")], [20_000]) for f in flags]
    return int(c.submit(tasks, label=label)), flags


def test_runs_a_run_its_trace_and_the_current_task(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        run_id, flags = _flag_run(c, 3, EVIL)
        trace = get_json(daemon, f"/api/runs/{run_id}/trace")
        assert trace["otherData"]["run_id"] == run_id
        busy = wait_until(
            lambda: [
                w
                for w in get_json(daemon, "/api/workers")["workers"]
                if w["current_task"].startswith(f"{EXAMPLES}:wait_for_flag (run {run_id}, task")
            ],
            message="no worker shows the task it runs",
        )
        assert busy[0]["state"] == "WORKER_STATE_BUSY"
        row = get_json(daemon, "/api/runs?limit=1")["runs"][0]
        assert row["run_id"] == run_id and row["label"] == EVIL and row["state"] == "executing"
        assert row["counts"]["total"] == 3
        for i, flag in enumerate(flags):
            c.write_buffer(flag, np.array([1, 0], dtype=np.uint8))
            wait_until(
                lambda i=i: get_json(daemon, f"/api/runs/{run_id}")["counts"]["done"] >= i + 1,
                message=f"task {i} never counted done",
            )
        c.wait(run_id, timeout=20)
        run = get_json(daemon, f"/api/runs/{run_id}")
        assert run["state"] == "completed" and run["label"] == EVIL and "results" not in run
        trace = get_json(daemon, f"/api/runs/{run_id}/trace")
        spans = [e for e in trace["traceEvents"] if e.get("cat") == "task"]
        assert {s["name"] for s in spans} == {f"{EXAMPLES}:wait_for_flag"}
        assert sorted(s["args"]["task"] for s in spans) == [0, 1, 2]
        assert {s["args"]["outcome"] for s in spans} == {"SUCCESS"}
        lanes = {
            e["tid"]: e["args"]["name"]
            for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"
        }
        assert all(lanes[s["tid"]].startswith("sub worker ") for s in spans), lanes
        assert all(s["dur"] > 0 for s in spans)
        assert f"run {run_id}" in {e["name"] for e in trace["traceEvents"] if e.get("cat") == "run"}
        code, headers, _ = fetch(daemon, f"/api/runs/{run_id}/trace?download=1")
        assert code == 200 and f"run-{run_id}-trace.json" in headers["content-disposition"]
        for f in flags:
            c.free_buffer(f)


def test_failed_run_error_and_its_trace(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        fail = c.register(f"{EXAMPLES}:fail")
        run_id = int(c.submit([sub_task(fail, [], [7])], label="fails"))
        assert c.wait_run(run_id, timeout=20).state.name == "FAILED"
        row = get_json(daemon, "/api/runs?state=failed&limit=1")["runs"][0]
        assert row["run_id"] == run_id and "example failure (scalar 7)" in row["error"]
        trace = get_json(daemon, f"/api/runs/{run_id}/trace")
        spans = [e for e in trace["traceEvents"] if e.get("cat") == "task"]
        assert [s["args"]["outcome"] for s in spans] == ["TASK_FAILURE"]
        # The same document as GetRunTrace gives.
        assert c.trace(run_id)["traceEvents"] == trace["traceEvents"]


class _Traces:
    """A DaemonService stand-in with only what Dashboard._trace reads."""

    def __init__(self, doc: dict[str, Any] | None) -> None:
        self.doc = doc

    def trace_document(self, rec: Any) -> dict[str, Any]:
        if self.doc is None:
            raise Precondition("run_id", f"cannot trace run {rec.run_id}: it finished before")
        return self.doc


@pytest.mark.asyncio
async def test_trace_for_the_page_is_bounded_and_a_download_is_whole() -> None:
    task = {"cat": "task", "ph": "X", "name": "f", "ts": 0, "dur": 1, "pid": 1, "tid": 1}
    doc = {"traceEvents": [task] * (MAX_SPANS + 7), "otherData": {"run_id": 3}}
    rec = types.SimpleNamespace(run_id=3)
    board = Dashboard(_Traces(doc))
    status, headers, body = await board._trace(rec, download=False)
    page = json.loads(body)
    assert status == 200 and len(page["traceEvents"]) == MAX_SPANS
    assert page["otherData"] == {"run_id": 3, "not_drawn": 7}
    status, headers, body = await board._trace(rec, download=True)
    assert len(json.loads(body)["traceEvents"]) == MAX_SPANS + 7
    assert headers["Content-Disposition"] == 'attachment; filename="run-3-trace.json"'
    with pytest.raises(_BadRequest) as info:  # a run restored from the history: no trace
        await Dashboard(_Traces(None))._trace(rec, download=False)
    assert info.value.status == 409 and "cannot trace run 3" in str(info.value)


def test_runs_filters_bounds_and_pages(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        empty = c.register(f"{EXAMPLES}:empty")
        ids = [int(c.submit([sub_task(empty)], label=f"page {i}")) for i in range(3)]
        for run_id in ids:
            c.wait(run_id, timeout=20)
    page = get_json(daemon, "/api/runs?limit=2&state=completed")
    assert [r["run_id"] for r in page["runs"]] == [ids[2], ids[1]]
    nxt = get_json(daemon, f"/api/runs?limit=2&state=completed&before={page['next_before']}")
    assert nxt["runs"][0]["run_id"] == ids[0]
    assert get_json(daemon, "/api/runs?owner=uid:424242")["runs"] == []
    for query, words in (
        ("limit=0", "limit must be an integer from 1 to 500"),
        (f"limit={MAX_RUNS + 1}", "limit must be an integer"),
        ("limit=abc", "limit must be an integer"),
        ("before=-3", "before must be an integer"),
        ("state=bogus", "state 'bogus' is not a run state"),
        ("owner=%3Cb%3E", "is not a client name"),
    ):
        assert words in get_json(daemon, f"/api/runs?{query}", 400)["error"], query


def test_texts_are_clipped() -> None:
    """Any text in an answer (an error of a remote host, a callable name) is bounded."""
    data = _clip({"a": ["x" * (MAX_TEXT + 500)], "b": {"c": "y" * 10}, "n": 5})
    assert len(data["a"][0]) == MAX_TEXT and data["a"][0].endswith("…")
    assert data["b"] == {"c": "y" * 10} and data["n"] == 5


def test_another_user_sees_only_its_own_runs(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        empty = c.register(f"{EXAMPLES}:empty")
        mine = int(c.submit([sub_task(empty)], label="root's"))
        c.wait(mine, timeout=20)
    code = (
        "import http.client, json, sys\n"
        "out = {}\n"
        "for path in sys.argv[2:]:\n"
        "    c = http.client.HTTPConnection('127.0.0.1', int(sys.argv[1]), timeout=10)\n"
        f"    c.request('GET', path, headers={{'Authorization': 'Bearer {TOKEN}'}})\n"
        "    r = c.getresponse()\n"
        "    out[path] = [r.status, json.loads(r.read())]\n"
        "print(json.dumps(out))\n"
    )
    with throwaway_user() as user:
        paths = ["/api/overview", "/api/runs", f"/api/runs/{mine}", "/api/runs?owner=uid:0"]
        # The system's Python: the test's may live where the other user cannot enter.
        done = subprocess.run(
            ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups",
             "/usr/bin/python3", "-c", code, str(port_of(daemon)), *paths],
            capture_output=True, text=True, timeout=30, check=True, cwd="/",
        )  # fmt: skip
    got = json.loads(done.stdout)
    assert got["/api/overview"][1]["caller"] == f"uid:{user.uid}"
    assert got["/api/overview"][1]["caller_is_admin"] is False
    assert got["/api/runs"] == [
        200,
        {"caller": f"uid:{user.uid}", "caller_is_admin": False, "runs": [], "next_before": None},
    ]
    status, body = got[f"/api/runs/{mine}"]
    assert status == 403 and f"cannot see run {mine}" in body["error"]
    status, body = got["/api/runs?owner=uid:0"]
    assert status == 403 and "only an admin" in body["error"]


def test_every_page_file_ships_in_the_package() -> None:
    """pyproject's package-data takes every file of dashboard_static/ (an installed
    daemon serves the page from the package)."""
    import fnmatch
    import tomllib

    static = Path(dashboard.__file__).parent / "dashboard_static"
    assert set(os.listdir(static)) == set(dashboard_files())
    with open(Path(__file__).parents[2] / "pyproject.toml", "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["simpler_daemon"]
    for name in dashboard_files():
        path = f"server/dashboard_static/{name}"
        assert any(fnmatch.fnmatch(path, p) for p in patterns), path


def test_without_a_token_the_page_is_served_at_once(tmp_path: Path) -> None:
    port = free_port()
    overrides = {"metrics": {"listen": f"127.0.0.1:{port}"}, "dashboard": {"enabled": True}}
    with running_daemon(tmp_path / "open", overrides) as d:
        assert f"dashboard on http://127.0.0.1:{port}/" in d.stdout()
        code, _, body = fetch(d, "/", token=None)
        assert code == 200 and b'<script src="/dashboard.js">' in body
        code, _, body = fetch(d, "/api/overview", token=None)
        assert code == 200 and json.loads(body)["caller"] == f"uid:{os.getuid()}"
        assert fetch(d, "/metrics", token=None)[0] == 200


@pytest.mark.parametrize(
    ("family", "listen", "connect"),
    [
        (socket.AF_INET, "127.0.0.1", "127.0.0.1"),
        (socket.AF_INET6, "::1", "::1"),
        (socket.AF_INET6, "::", "127.0.0.1"),  # dual stack: an IPv4 client, IPv4-mapped here
        (socket.AF_INET6, "::", "::ffff:127.0.0.1"),  # an IPv6 client with a mapped address
    ],
)
def test_a_loopback_peer_is_named_by_its_uid(family: int, listen: str, connect: str) -> None:
    """sock_diag and the /proc/net/tcp fallback agree on the uid behind a connection; a
    closed one (or another host) has none."""
    with socket.socket(family) as server:
        if listen == "::":
            server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        server.bind((listen, 0))
        server.listen()
        kind = socket.AF_INET if "." in connect and ":" not in connect else socket.AF_INET6
        with socket.socket(kind) as client:
            client.connect((connect, server.getsockname()[1]))
            accepted, _ = server.accept()
            with accepted:
                peer, local = accepted.getpeername()[:2], accepted.getsockname()[:2]
                assert peers.loopback_peer_uid(peer, local) == os.getuid()
                assert peers._proc_net_uid(peer, local) == os.getuid()
        assert peers.loopback_peer_uid(("10.1.2.3", 5000), local) is None
    assert peers.loopback_peer_uid(("127.0.0.1", 1), ("127.0.0.1", 2)) is None


def test_the_browser_tests_say_why_they_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Chromium or its driver the reason names the Debian package to install."""
    from simpler_daemon.testing import browser

    monkeypatch.setattr(browser.os, "access", lambda path, mode: path != browser.CHROMEDRIVER)
    why = browser.missing_browser()
    assert why.startswith("no /usr/bin/chromedriver: install Debian's chromium-driver"), why
    assert "apt-get install -y chromium chromium-driver" in why
