"""``simpler-remote-worker`` as a real process on loopback: authentication before the
manifest, validation before any spawn, connection isolation, limits, runner start-up
failures reclaimed with their process group, SIGTERM, sd_notify, the CLI's exit codes.

Runner failure modes come from a stand-in runner (the documented test hook
``SIMPLER_REMOTE_RUNNER_ARGV``) whose behaviour is picked by the manifest's worker id;
the success path also runs the real ``simpler_daemon.remote_worker.session`` runner.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from simpler_daemon.callables import spec_for_import
from simpler_daemon.errors import ProtocolError
from simpler_daemon.remote.manifest import (
    MAX_REPLY_BYTES,
    RunnerSpec,
    encode_auth,
    encode_lp_json,
    read_lp_sock,
)
from simpler_daemon.testing import poll_for
from tests.support.remote_worker import ORCH, TOKEN, RunningWorker, manifest, run_cli

pytestmark = pytest.mark.timeout(120)


def alive(pid: int) -> bool:
    """True unless ``pid`` is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped before or while reading
        return False


# --------------------------------------------------------------------------- authentication


def test_wrong_token_is_refused_before_the_manifest(
    start_worker: Callable[..., RunningWorker],
) -> None:
    w = start_worker()
    for token in (b"wrong", b"", TOKEN + b"x", TOKEN[:-1]):
        reply = w.handshake(token=token)
        assert reply == {"ok": False, "error": "cannot open session: authentication failed"}
    # Not a byte of the manifest is parsed: garbage after a wrong token gives the same answer.
    reply = w.handshake(raw=encode_auth(b"wrong") + b"\xff" * 100)
    assert reply["error"] == "cannot open session: authentication failed"
    # Garbage instead of the authentication record.
    reply = w.handshake(raw=b"GET / HTTP/1.1\r\n\r\n")
    assert reply["ok"] is False and "bad magic" in reply["error"]
    assert w.children() == set()
    assert not list(w.record.iterdir()), "a runner was started"
    assert w.stop() == 0


def test_tokenless_worker_accepts_only_an_empty_token(
    start_worker: Callable[..., RunningWorker],
) -> None:
    w = start_worker(token=False)
    assert w.handshake(token=b"something")["error"].endswith("authentication failed")
    reply = w.handshake(manifest(worker_id=1, startup_budget_s=0.3), token=b"")
    assert "not ready within 0.3s" in reply["error"]  # authenticated: a runner was started
    assert w.stop() == 0


# --------------------------------------------------------------------------- manifest


BAD_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({"session_id": 0}, "manifest.session_id"),
    ({"attach_key": "xyz"}, "manifest.attach_key"),
    ({"worker_id": -3}, "manifest.worker_id"),
    ({"parent_level": 5}, "manifest.parent_level"),
    ({"remote_level": 2}, "manifest.remote_level"),
    ({"num_sub_workers": -1}, "manifest.num_sub_workers"),
    ({"num_sub_workers": 0, "num_chips": 0}, "manifest.num_sub_workers"),
    ({"num_chips": 99}, "manifest.num_chips"),
    ({"chip_pipeline_depth": 0}, "manifest.chip_pipeline_depth"),
    ({"heap_bytes": -5}, "manifest.heap_bytes"),
    ({"session_timeout_s": -1}, "manifest.session_timeout_s"),
    ({"startup_budget_s": 0}, "manifest.startup_budget_s"),
    ({"num_chips": "2"}, "manifest.num_chips"),
    ({"surprise": True}, "manifest.surprise"),
    (
        {"callables": [{"hashid": "sha256:" + "0" * 64, "kind": "orchestration", "target": ORCH}]},
        "manifest.callables[0].hashid",
    ),
    (
        {"callables": [{"hashid": "sha256:" + "0" * 64, "kind": "sub", "target": "os:system"}]},
        "manifest.callables[0].target",
    ),
    (
        {"callables": [{"hashid": "x", "kind": "daemon", "target": ORCH}]},
        "manifest.callables[0].kind",
    ),
    ({"callables": [{"hashid": "x", "kind": "sub", "target": "a:b"}] * 3}, "manifest.callables"),
]


def test_every_bad_manifest_field_is_refused_before_a_spawn(
    start_worker: Callable[..., RunningWorker],
) -> None:
    w = start_worker("--set", "sessions.max_callables=2")
    for changes, key in BAD_FIELDS:
        reply = w.handshake(manifest(**changes))
        assert reply["ok"] is False, changes
        assert reply["error"].startswith("cannot open session: "), reply
        assert key in reply["error"], (key, reply)
    missing = manifest()
    del missing["session_id"]
    assert "manifest.session_id is required" in w.handshake(missing)["error"]
    raw = encode_auth(TOKEN) + (5).to_bytes(4, "little") + b"{nope"
    assert "not valid JSON" in w.handshake(raw=raw)["error"]
    assert w.children() == set()
    assert not list(w.record.iterdir()), "a runner was started"
    assert w.stop() == 0


# --------------------------------------------------------------------------- isolation


@pytest.mark.slow
def test_hostile_connections_do_not_affect_a_good_one(
    start_worker: Callable[..., RunningWorker],
) -> None:
    w = start_worker(
        "--set", "sessions.handshake_timeout=5.0", "--set", "sessions.max_manifest_bytes=4096"
    )
    # A slow client: half an authentication header, then silence.
    slow = socket.create_connection(("127.0.0.1", w.port), timeout=30)
    slow.sendall(encode_auth(TOKEN)[:6])
    # A client that authenticates and then stalls mid-manifest.
    stalled = socket.create_connection(("127.0.0.1", w.port), timeout=30)
    stalled.sendall(encode_auth(TOKEN) + (100).to_bytes(4, "little") + b"{")
    # An idle connection that never sends anything.
    idle = socket.create_connection(("127.0.0.1", w.port), timeout=30)
    try:
        # Truncated: closes in the middle of the manifest; oversize: length over the limit.
        truncated = socket.create_connection(("127.0.0.1", w.port), timeout=30)
        truncated.sendall(encode_auth(TOKEN) + (100).to_bytes(4, "little") + b'{"session_id"')
        truncated.shutdown(socket.SHUT_WR)
        reply = json.loads(read_lp_sock(truncated, MAX_REPLY_BYTES, time.monotonic() + 10))
        truncated.close()
        assert "connection closed after 13 of 100 bytes" in reply["error"]
        oversize = encode_auth(TOKEN) + (1 << 31).to_bytes(4, "little") + b"x" * 1000
        assert "exceed the limit of 4096" in w.handshake(raw=oversize)["error"]
        too_long_token = b"SLRW" + (1).to_bytes(4, "little") + (1 << 20).to_bytes(4, "little")
        assert "exceeds 4096" in w.handshake(raw=too_long_token)["error"]

        # Meanwhile a good parent gets its session at once.
        start = time.monotonic()
        good = w.handshake(manifest(worker_id=0))
        assert good["ok"] is True, good
        assert time.monotonic() - start < 4.0
        assert int(good["pid"]) in w.children()

        # The stalled clients are answered when their handshake time is up.
        for sock in (slow, stalled, idle):
            reply = json.loads(read_lp_sock(sock, MAX_REPLY_BYTES, time.monotonic() + 10))
            assert reply["ok"] is False
            assert "handshake not completed within 5s" in reply["error"]
    finally:
        for sock in (slow, stalled, idle):
            sock.close()
    assert w.handshake(manifest(worker_id=0))["ok"] is True
    assert w.stop() == 0


def test_connection_and_session_limits(start_worker: Callable[..., RunningWorker]) -> None:
    w = start_worker("--set", "sessions.max=1", "--set", "sessions.max_connections=1")
    first = w.handshake(manifest(worker_id=0))
    assert first["ok"] is True
    again = w.handshake(manifest(worker_id=0))
    assert again == {
        "ok": False,
        "error": "cannot open session: 1 sessions already running (limit sessions.max)",
    }
    # An unauthenticated connection in its handshake fills sessions.max_connections: a
    # new one closes it to make room (a parent is never kept out by idle connections).
    hold = socket.create_connection(("127.0.0.1", w.port), timeout=30)
    try:
        hold.sendall(b"SL")
        w.wait_accepted(hold)
        reply = w.handshake(manifest(worker_id=0))
        assert reply["error"].endswith("1 sessions already running (limit sessions.max)")
        with contextlib.suppress(ConnectionError):
            assert hold.recv(100) == b""
        assert "to make room (sessions.max_connections)" in w.log_text()
        # One that authenticated is a parent's: it is never closed, so the next is refused.
        hold2 = socket.create_connection(("127.0.0.1", w.port), timeout=30)
        with hold2:
            hold2.sendall(encode_auth(TOKEN) + (100).to_bytes(4, "little"))
            peer = f"127.0.0.1:{hold2.getsockname()[1]}"
            poll_for(lambda: f"connection from {peer}: authenticated" in w.log_text(), timeout=10)
            reply = w.handshake(manifest(worker_id=0))
            assert reply["error"] == (
                "cannot open session: 1 connections are already in their handshake "
                "(limit sessions.max_connections)"
            )
    finally:
        hold.close()
    # The session ends (its runner dies): the worker reaps it and the slot is free again.
    os.kill(int(first["pid"]), signal.SIGKILL)
    poll_for(lambda: not w.children(), timeout=10, message="runner not reaped")

    def reopened() -> bool:
        return w.handshake(manifest(worker_id=0))["ok"] is True

    assert poll_for(reopened, timeout=10)
    assert "session" in w.log_text() and "closed" in w.log_text()
    assert w.stop() == 0


def test_duplicate_session_id_is_refused(start_worker: Callable[..., RunningWorker]) -> None:
    w = start_worker()
    m = manifest(worker_id=0)
    assert w.handshake(m)["ok"] is True
    reply = w.handshake(dict(m, attach_key=secrets.token_hex(32)))
    assert reply["error"] == f"cannot open session: session id {m['session_id']} is already in use"
    assert len(w.children()) == 1
    assert w.stop() == 0


# --------------------------------------------------------------------------- runner start-up


def test_runner_spec_file_and_environment(
    start_worker: Callable[..., RunningWorker], tmp_path: Path
) -> None:
    spec_dir = tmp_path / "specs"
    spec_dir.mkdir()
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    w = start_worker(
        "--set",
        f'worker.spec_dir="{spec_dir}"',
        "--set",
        f'callables.python_path=["{jobs}"]',
        env={"NOTIFY_SOCKET": str(tmp_path / "nowhere"), "PYTHONPATH": "/elsewhere"},
    )
    m = manifest(worker_id=0, startup_budget_s=1000.0)
    before = time.time()
    reply = w.handshake(m)
    assert reply["ok"] is True
    rec = json.loads((w.record / f"{m['session_id']}.json").read_text())
    spec = msgspec.convert(rec["spec"], type=RunnerSpec)
    assert spec.manifest == msgspec.convert(m, type=type(spec.manifest))
    assert spec.listen_host == "127.0.0.1"
    assert spec.allowed_modules == ["simpler_daemon.examples"]
    assert spec.python_path == [str(jobs)]
    assert spec.tls is None
    assert spec.parent_on_this_host is True  # the handshake came over loopback
    # The start-up budget is cut to sessions.max_startup (300 s).
    assert before + 290 < spec.deadline_unix < time.time() + 301
    assert rec["mode"] == 0o600
    assert rec["spec_path"].startswith(str(spec_dir))
    assert rec["pythonpath"] == f"{jobs}{os.pathsep}/elsewhere"
    assert rec["notify"] is None, "runners must not speak to systemd"
    # Its own process group, its pid reported; the spec file is gone after the ready line.
    assert rec["pgid"] == rec["pid"] == reply["pid"]
    assert reply["command"].startswith("127.0.0.1:") and reply["health"].startswith("127.0.0.1:")
    assert list(spec_dir.iterdir()) == []
    assert w.stop() == 0


@pytest.mark.parametrize(
    ("mode", "fragment"),
    [
        (1, "the session runner was not ready within 0.5s"),
        (3, "the session runner exited before it was ready (exit status 3)"),
        (4, "cannot install callables: no module named x"),
        (5, "the session runner's ready line is invalid"),
    ],
)
def test_runner_start_failures_are_reclaimed(
    start_worker: Callable[..., RunningWorker], tmp_path: Path, mode: int, fragment: str
) -> None:
    spec_dir = tmp_path / "specs"
    spec_dir.mkdir()
    w = start_worker("--set", f'worker.spec_dir="{spec_dir}"', "--set", "sessions.kill_grace=0.5")
    # Only the runner that never gets ready waits out its (short) budget.
    reply = w.handshake(manifest(worker_id=mode, startup_budget_s=0.5 if mode == 1 else 30.0))
    assert reply["ok"] is False
    assert fragment in reply["error"], reply
    if mode == 3:  # the runner's output tail is part of the error
        tail = r"; runner output:\nfake runner \d+ mode 3\nboom: cannot import the job package\Z"
        assert re.search(tail, reply["error"]), reply["error"]
    assert w.children() == set()
    assert list(spec_dir.iterdir()) == []
    assert w.stop() == 0


def test_stubborn_runner_and_its_grandchild_are_killed(
    start_worker: Callable[..., RunningWorker],
) -> None:
    w = start_worker("--set", "sessions.kill_grace=0.5")
    start = time.monotonic()
    reply = w.handshake(manifest(worker_id=2, startup_budget_s=2.0))
    assert "not ready within 2s" in reply["error"]
    assert time.monotonic() - start < 2.0 + 0.5 + 5  # budget + kill_grace + slack
    grandchild = int(poll_for(lambda: (w.record / "grandchild").read_text(), timeout=5))
    poll_for(lambda: not alive(grandchild), timeout=10, message="grandchild survived")
    assert w.children() == set()
    assert w.stop() == 0


def test_a_manifest_without_a_startup_budget_is_bounded_by_its_session_timeout(
    start_worker: Callable[..., RunningWorker],
) -> None:
    w = start_worker("--set", "sessions.kill_grace=0.5")
    # A runner that never gets ready is given up after the session timeout (2 s)...
    m = manifest(worker_id=1, session_timeout_s=2.0)
    del m["startup_budget_s"]
    reply = w.handshake(m)
    assert reply["ok"] is False
    assert "the session runner was not ready within 2s" in reply["error"], reply
    # ... and a longer session timeout gives a longer bound (the runner's deadline).
    m = manifest(worker_id=0, session_timeout_s=45.0)
    del m["startup_budget_s"]
    before = time.time()
    assert w.handshake(m)["ok"] is True
    rec = json.loads((w.record / f"{m['session_id']}.json").read_text())
    assert before + 44 < rec["spec"]["deadline_unix"] < time.time() + 46
    assert w.stop() == 0


def test_unstartable_runner_command(start_worker: Callable[..., RunningWorker]) -> None:
    w = start_worker(env={"SIMPLER_REMOTE_RUNNER_ARGV": json.dumps(["/nonexistent/runner"])})
    reply = w.handshake(manifest())
    assert reply["ok"] is False
    assert "cannot start the session runner /nonexistent/runner" in reply["error"]
    assert w.stop() == 0


def test_wildcard_runner_address_is_replaced_by_the_address_used(
    start_worker: Callable[..., RunningWorker],
) -> None:
    w = start_worker()
    reply = w.handshake(manifest(worker_id=7))
    assert reply["ok"] is True
    assert reply["command"].startswith("127.0.0.1:") and reply["health"].startswith("127.0.0.1:")
    assert w.stop() == 0


# --------------------------------------------------------------------------- stopping


def test_sigterm_stops_every_runner_and_exits_0(start_worker: Callable[..., RunningWorker]) -> None:
    w = start_worker("--set", "worker.shutdown_grace=1.0")
    polite = w.handshake(manifest(worker_id=0))
    stubborn = w.handshake(manifest(worker_id=6))
    assert polite["ok"] and stubborn["ok"]
    # A connection still in its handshake does not delay the stop.
    pending = socket.create_connection(("127.0.0.1", w.port), timeout=30)
    try:
        pending.sendall(b"SLRW")
        w.wait_accepted(pending)
        start = time.monotonic()
        assert w.stop() == 0
        assert time.monotonic() - start < 10
    finally:
        pending.close()
    for reply in (polite, stubborn):
        assert not alive(int(reply["pid"]))
    log = w.log_text()
    assert "stopping: 2 sessions" in log and "ignored SIGTERM; killing" in log


def test_sd_notify_ready_watchdog_stopping(
    start_worker: Callable[..., RunningWorker], tmp_path: Path
) -> None:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    messages: list[str] = []
    try:
        w = start_worker(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})

        def received(text: str) -> bool:
            while not any(text in m for m in messages):
                messages.append(sock.recv(4096).decode())
            return True

        assert received("READY=1")
        assert received("WATCHDOG=1")
        assert w.stop() == 0
        assert received("STOPPING=1")
    finally:
        sock.close()
    assert any(f"listening on 127.0.0.1:{w.port}" in m for m in messages if "READY=1" in m)


# --------------------------------------------------------------------------- TLS


def _self_signed(directory: Path) -> tuple[Path, Path]:
    from tests.support.remote_worker import self_signed

    return self_signed(directory)


def test_tls_and_mutual_tls(start_worker: Callable[..., RunningWorker], tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    tls = ["--set", f'tls.cert_file="{cert}"', "--set", f'tls.key_file="{key}"']
    w = start_worker(*tls, "--set", "sessions.handshake_timeout=2.0")
    client = ssl.create_default_context(cafile=str(cert))
    reply = w.handshake(manifest(worker_id=0), context=client)
    assert reply["ok"] is True
    assert w.handshake(token=b"bad", context=client)["error"].endswith("authentication failed")
    # Plain text on the TLS port gets no reply, and does not disturb the worker.
    plain = socket.create_connection(("127.0.0.1", w.port), timeout=10)
    with plain:
        plain.sendall(encode_auth(TOKEN) + encode_lp_json(manifest()))
        with contextlib.suppress(ConnectionError):
            assert plain.recv(100) == b""
    assert w.handshake(manifest(worker_id=0), context=client)["ok"] is True
    assert w.stop() == 0

    m = start_worker(*tls, "--set", f'tls.client_ca_file="{cert}"')
    with pytest.raises((ssl.SSLError, ConnectionError, ProtocolError)):
        m.handshake(manifest(worker_id=0), context=client)
    mutual = ssl.create_default_context(cafile=str(cert))
    mutual.load_cert_chain(str(cert), str(key))
    assert m.handshake(manifest(worker_id=0), context=mutual)["ok"] is True
    assert m.stop() == 0


# --------------------------------------------------------------------------- the real runner


def test_real_runner_session_opens_and_is_stopped(
    start_worker: Callable[..., RunningWorker],
) -> None:
    w = start_worker(fake=False)
    reply = w.handshake(manifest(worker_id=3, startup_budget_s=60.0))
    assert reply["ok"] is True, reply
    pid = int(reply["pid"])
    assert pid in w.children()
    # The runner listens where it says (attaching is the parent's business, not tested here).
    host, _, port = reply["command"].rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10):
        pass
    assert w.stop() == 0
    assert not alive(pid)
    assert "session" in w.log_text() and "opened" in w.log_text()


_PLANTED = """
import importlib, os, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "planted-ran"), "a") as f:
    f.write("%s %d\\n" % (__name__, os.getpid()))
if __name__ == "argparse":  # then behave: load the real one in its place
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    del sys.modules[__name__]
    sys.modules[__name__] = importlib.import_module(__name__)
def orch(o, args, config):
    pass
"""


def test_the_runner_imports_nothing_from_the_workers_working_directory(
    start_worker: Callable[..., RunningWorker], tmp_path: Path
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    # A module shadowing the stdlib (the runner imports argparse) and one named like an
    # allowed job module, planted where the worker runs.
    (cwd / "argparse.py").write_text(_PLANTED)
    (cwd / "plantedjob.py").write_text(_PLANTED)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "realjob.py").write_text("def orch(o, args, config):\n    pass\n")
    w = start_worker(
        "--set",
        'callables.allowed_modules=["simpler_daemon.examples", "plantedjob", "realjob"]',
        "--set",
        f'callables.python_path=["{jobs}"]',
        fake=False,
        cwd=cwd,
    )

    def job(target: str) -> dict[str, Any]:
        item = {
            "hashid": spec_for_import(target, "orchestration").handle.hashid,
            "kind": "orchestration",
            "target": target,
        }
        return manifest(worker_id=0, startup_budget_s=60.0, callables=[item])

    assert w.handshake(manifest(worker_id=0, startup_budget_s=60.0))["ok"] is True
    # callables.python_path is on the isolated runner's import path, explicitly.
    assert w.handshake(job("realjob:orch"))["ok"] is True
    refused = w.handshake(job("plantedjob:orch"))
    assert refused["ok"] is False
    assert "plantedjob" in refused["error"] and "No module named" in refused["error"]
    assert not (cwd / "planted-ran").exists(), (cwd / "planted-ran").read_text()
    assert w.stop() == 0


# --------------------------------------------------------------------------- CLI


def test_cli_exit_codes(tmp_path: Path, token_file: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text("[sessions]\nmax = 2\n")
    result = run_cli("check-config", str(good))
    assert result.returncode == 0, result.stderr
    assert "ok (listen 127.0.0.1:19073, tls off, token off, up to 2 sessions)" in result.stdout

    bad = tmp_path / "bad.toml"
    bad.write_text("[sessions]\nmax = -2\n")
    result = run_cli("check-config", str(bad))
    assert result.returncode == 2 and "sessions.max" in result.stderr
    assert run_cli("serve", "--config", str(bad)).returncode == 2

    exposed = tmp_path / "exposed.toml"
    exposed.write_text("[worker]\nlisten = '10.77.0.9:19073'\n")
    result = run_cli("check-config", str(exposed))
    assert (
        result.returncode == 2
        and "worker.listen" in result.stderr
        and "--insecure" in result.stderr
    )
    assert run_cli("check-config", "--insecure", str(exposed)).returncode == 0
    # serve refuses before binding anything.
    result = run_cli("serve", "--listen", "0.0.0.0:0")
    assert result.returncode == 2 and "worker.listen" in result.stderr
    result = run_cli("serve", "--listen", "10.77.0.9:0", "--token-file", str(token_file))
    assert result.returncode == 2 and "tls.cert_file" in result.stderr

    token_file.chmod(0o644)
    result = run_cli("serve", "--listen", "127.0.0.1:0", "--token-file", str(token_file))
    assert result.returncode == 2 and "auth.token_file" in result.stderr
    assert run_cli("serve", "--set", "nonsense").returncode == 2
    result = run_cli("serve", "--listen", "127.0.0.1:0", "--set", f"worker.spec_dir={tmp_path}/no")
    assert result.returncode == 2 and "worker.spec_dir" in result.stderr
    assert run_cli().returncode == 2
    bad_hook = dict(os.environ, SIMPLER_REMOTE_RUNNER_ARGV="[1]")
    result = run_cli("serve", "--listen", "127.0.0.1:0", env=bad_hook)
    assert result.returncode == 2 and "SIMPLER_REMOTE_RUNNER_ARGV" in result.stderr

    # A port that is taken: start-up failure, exit 3.
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run_cli("serve", "--listen", f"127.0.0.1:{port}")
    assert result.returncode == 3 and "cannot listen on" in result.stderr


def test_concurrent_handshakes_from_threads(start_worker: Callable[..., RunningWorker]) -> None:
    w = start_worker("--set", "sessions.max=8")
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        never_ready = i % 2 == 0
        m = manifest(
            worker_id=1 if never_ready else 0, startup_budget_s=1.0 if never_ready else 30.0
        )
        reply = w.handshake(m)
        with lock:
            results.append(reply)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sum(r["ok"] for r in results) == 4
    assert all("not ready within 1s" in r["error"] for r in results if not r["ok"])
    poll_for(lambda: len(w.children()) == 4, timeout=10)
    assert w.stop() == 0
