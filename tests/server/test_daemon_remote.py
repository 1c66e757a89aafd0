"""Remote L3 workers in the daemon: AddRemoteWorker refusals, ListWorkers rows, metrics.

The refusals need no remote host: a level-3 daemon refuses the RPC outright and
a level-4 daemon validates the request before it opens anything. The last test
drives a real ``simpler-remote-worker`` on loopback from a level-4 daemon; it is
skipped until the Worker has its remote API.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from simpler_daemon.cli.output import remote_header, remote_row
from simpler_daemon.client import Client
from simpler_daemon.engine.worker import Worker
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server.metrics import Metrics
from simpler_daemon.server.workers import worker_info
from simpler_daemon.testing import poll_for
from tests.support.daemon_harness import (
    EXAMPLES,
    REPO,
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    running_daemon,
)
from tests.support.remote_worker import RemoteWorkerProcess

pytestmark = pytest.mark.timeout(90)

Code = grpc.StatusCode
HAS_REMOTE_API = hasattr(Worker, "add_remote_worker") and hasattr(Worker, "add_remote_worker_async")


def level4(creds: Path) -> dict[str, dict[str, Any]]:
    return {
        "daemon": {"level": 4},
        "workers": {"num_sub_workers": 1, "remote_credentials_dir": str(creds)},
    }


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("creds")
    (directory / "token").write_text("s3cret\n")
    return directory


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, creds: Path) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "remote-l4", level4(creds))


@pytest.fixture(autouse=True)
def no_leaked_children(daemon: DaemonProcess) -> Iterator[None]:
    """Overrides the conftest guard: the module daemon lives across tests on purpose."""
    yield from module_leak_guard(lambda: {daemon.pid})


@pytest.fixture(scope="module")
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with daemon.client() as c:
        yield c


def refused(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


# --------------------------------------------------------------------------- refusals


def test_level3_daemon_refuses_add_remote_worker(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as d, d.client() as c:
        err = refused(lambda: c.add_remote_worker("127.0.0.1:19073"))
        assert err.code() == Code.FAILED_PRECONDITION, err.details()
        assert err.details() == (
            "cannot add a remote worker: this daemon is level 3; remote L3 workers need "
            "daemon.level = 4"
        )
        assert c.get_info().serving_state == pb.SERVING_STATE_SERVING


def test_level4_daemon_starts_without_remote_workers(client: Client) -> None:
    assert client.get_info().level == 4
    rows = client.list_workers()
    assert [w.kind for w in rows] == [pb.WORKER_KIND_SUB]
    assert not rows[0].HasField("remote")


@pytest.mark.parametrize(
    ("kwargs", "code", "field", "text"),
    [
        ({"endpoint": ""}, Code.INVALID_ARGUMENT, "endpoint", "required"),
        (
            {"endpoint": "worker-1.example:19073"},
            Code.INVALID_ARGUMENT,
            "endpoint",
            "'worker-1.example' is not a numeric address",
        ),
        ({"endpoint": "127.0.0.1"}, Code.INVALID_ARGUMENT, "endpoint", "port missing"),
        ({"endpoint": "127.0.0.1:0"}, Code.INVALID_ARGUMENT, "endpoint", "out of range"),
        ({"endpoint": "127.0.0.1:http"}, Code.INVALID_ARGUMENT, "endpoint", "not a number"),
        (
            {"endpoint": "127.0.0.1:1", "session_timeout_s": 0.0},
            Code.INVALID_ARGUMENT,
            "session_timeout_s",
            "must be > 0",
        ),
        (
            {"endpoint": "127.0.0.1:1", "chip_pipeline_depth": 3},
            Code.INVALID_ARGUMENT,
            "chip_pipeline_depth",
            "must be 1 or 2",
        ),
        (
            {"endpoint": "127.0.0.1:1", "tls_server_name": "w1"},
            Code.INVALID_ARGUMENT,
            "tls_server_name",
            "requires tls_ca_file",
        ),
        (
            {"endpoint": "127.0.0.1:1", "token_file": "/etc/passwd"},
            Code.PERMISSION_DENIED,
            "token_file",
            "outside workers.remote_credentials_dir",
        ),
        (
            {"endpoint": "127.0.0.1:1", "tls_ca_file": "ca.pem"},
            Code.INVALID_ARGUMENT,
            "tls_ca_file",
            "must be an absolute path",
        ),
    ],
)
def test_add_remote_worker_names_the_field(
    client: Client, kwargs: dict[str, Any], code: grpc.StatusCode, field: str, text: str
) -> None:
    endpoint = kwargs.pop("endpoint")
    err = refused(lambda: client.add_remote_worker(endpoint, **kwargs))
    assert err.code() == code, err.details()
    details = err.details() or ""
    assert details.startswith(f"{field}: "), details
    assert text in details, details
    assert [w.kind for w in client.list_workers()] == [pb.WORKER_KIND_SUB]


def test_credential_symlink_out_of_the_directory_is_refused(client: Client, creds: Path) -> None:
    link = creds / "escape"
    if not link.exists():
        link.symlink_to("/etc/hostname")
    err = refused(lambda: client.add_remote_worker("127.0.0.1:1", token_file=str(link)))
    assert err.code() == Code.PERMISSION_DENIED, err.details()
    assert "token_file" in (err.details() or "")


def test_register_on_unknown_worker_is_not_found(client: Client) -> None:
    request = pb.RegisterCallableRequest(
        import_path=f"{EXAMPLES}:scale", kind=pb.CALLABLE_KIND_SUB, workers=[99]
    )
    err = refused(lambda: client.stub.RegisterCallable(request, timeout=10))
    assert err.code() == Code.NOT_FOUND, err.details()
    assert (err.details() or "").startswith("workers[0]: worker 99 is not a NEXT_LEVEL worker")


@pytest.mark.skipif(not HAS_REMOTE_API, reason="Worker has no remote L3 API yet")
def test_unreachable_remote_worker_is_unavailable(client: Client) -> None:
    port = _closed_port()
    err = refused(
        lambda: client.add_remote_worker(
            f"127.0.0.1:{port}", session_timeout_s=2.0, num_sub_workers=1
        )
    )
    assert err.code() == Code.UNAVAILABLE, err.details()
    assert f"127.0.0.1:{port}" in (err.details() or "")
    assert client.get_info().serving_state == pb.SERVING_STATE_SERVING


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# --------------------------------------------------------------------------- rows, metrics, CLI

REMOTE_ROW: dict[str, Any] = {
    "kind": "remote",
    "worker_id": 2,
    "endpoint": "127.0.0.1:19073",
    "session_id": 0x0123456789ABCDEF,
    "pid": 4242,
    "state": "ready",
    "health_age_s": 0.25,
    "round_trip_us": 180.0,
    "failures": 1,
    "reconnects": 3,
    "restarts": 0,
}


@pytest.mark.parametrize(
    ("state", "busy", "stopping", "expected"),
    [
        ("ready", False, False, pb.WORKER_STATE_IDLE),
        ("ready", True, False, pb.WORKER_STATE_BUSY),
        ("ready", False, True, pb.WORKER_STATE_STOPPING),
        ("failed", False, False, pb.WORKER_STATE_FAILED),
        ("closed", False, False, pb.WORKER_STATE_STOPPING),
    ],
)
def test_remote_row_becomes_worker_info(
    state: str, busy: bool, stopping: bool, expected: int
) -> None:
    info = worker_info({**REMOTE_ROW, "state": state, "busy": busy}, stopping=stopping)
    assert info.kind == pb.WORKER_KIND_REMOTE_L3
    assert info.state == expected
    assert (info.worker_id, info.pid, info.endpoint) == (2, 0, "127.0.0.1:19073")
    r = info.remote
    assert (r.host, r.port, r.session_id, r.runner_pid) == (
        "127.0.0.1",
        19073,
        "0123456789abcdef",
        4242,
    )
    assert (
        r.state
        == {
            "ready": pb.REMOTE_SESSION_STATE_READY,
            "failed": pb.REMOTE_SESSION_STATE_FAILED,
            "closed": pb.REMOTE_SESSION_STATE_CLOSED,
        }[state]
    )
    assert (r.health_age_seconds, r.round_trip_us, r.failures, r.reconnects) == (0.25, 180.0, 1, 3)


def test_simplerctl_remote_row() -> None:
    info = worker_info(REMOTE_ROW, stopping=False)
    row = dict(zip(remote_header(), remote_row(info), strict=True))
    assert row == {
        "ID": 2,
        "KIND": "remote",
        "ENDPOINT": "127.0.0.1:19073",
        "SESSION": "0123456789abcdef",
        "RUNNER_PID": 4242,
        "STATE": "ready",
        "HEALTH_AGE_S": "0.250",
        "RTT_US": "180",
        "FAILURES": 1,
        "RECONNECTS": 3,
        "ATTEMPTS": 0,
        "NEXT_TRY_S": "-",
    }


def test_a_reconnecting_row_shows_its_attempts_and_next_try() -> None:
    down = {
        **REMOTE_ROW,
        "state": "reconnecting",
        "attempts": 4,
        "next_try_s": 1.25,
        "session_generation": 2,
        "reason": "remote worker 2 (127.0.0.1:19073) failed: command connection closed; "
        "reconnecting: attempt 4 failed (connection refused); next attempt in 1.2 s",
    }
    info = worker_info(down, stopping=False)
    assert info.state == pb.WORKER_STATE_FAILED and "next attempt in" in info.message
    r = info.remote
    assert r.state == pb.REMOTE_SESSION_STATE_RECONNECTING
    assert (r.reconnect_attempts, r.next_try_seconds, r.session_generation) == (4, 1.25, 2)
    row = dict(zip(remote_header(), remote_row(info), strict=True))
    assert (row["STATE"], row["ATTEMPTS"], row["NEXT_TRY_S"]) == ("reconnecting", 4, "1.2")
    assert not worker_info(REMOTE_ROW, stopping=False).remote.HasField("next_try_seconds")
    metrics = Metrics(runtime_metrics=False)
    metrics.watch_remote_workers(lambda: [down])
    text = metrics.render().decode()
    assert 'simpler_remote_state{state="reconnecting",worker="2"} 1.0' in text
    assert 'simpler_remote_state{state="ready",worker="2"} 0.0' in text
    assert 'simpler_remote_reconnect_attempts{worker="2"} 4.0' in text
    assert 'simpler_remote_next_try_seconds{worker="2"} 1.25' in text


def test_remote_metrics_follow_the_rows() -> None:
    rows = [dict(REMOTE_ROW), {"kind": "sub", "worker_id": 0}]
    metrics = Metrics(runtime_metrics=False)
    metrics.watch_remote_workers(lambda: rows)
    text = metrics.render().decode()
    assert 'simpler_remote_health_age_seconds{worker="2"} 0.25' in text
    assert 'simpler_remote_round_trip_seconds{worker="2"} 0.00018' in text
    assert 'simpler_remote_failures_total{worker="2"} 1.0' in text
    assert 'simpler_remote_reconnects_total{worker="2"} 3.0' in text
    assert 'worker="0"' not in text
    rows[0]["failures"] = 5
    assert 'simpler_remote_failures_total{worker="2"} 5.0' in metrics.render().decode()


def test_remote_metrics_survive_a_failing_source() -> None:
    def broken() -> list[dict[str, Any]]:
        raise RuntimeError("worker closed")

    metrics = Metrics(runtime_metrics=False)
    metrics.watch_remote_workers(broken)
    assert "# TYPE simpler_remote_failures_total counter" in metrics.render().decode()


# --------------------------------------------------------------------------- end to end


@pytest.mark.skipif(not HAS_REMOTE_API, reason="Worker has no remote L3 API yet")
def test_level4_daemon_with_a_real_remote_worker(tmp_path: Path) -> None:
    remote = RemoteWorkerProcess(tmp_path)
    runner_pids: list[int] = []
    try:
        overrides = {
            "daemon": {"level": 4},
            "workers": {
                "num_sub_workers": 1,
                "remote": [
                    {
                        "endpoint": remote.address,
                        "num_sub_workers": 1,
                        "session_timeout_s": 10.0,
                        "heap_bytes": 4 << 20,
                        "callables": [{"target": f"{EXAMPLES}:scale", "kind": "sub"}],
                    }
                ],
            },
        }
        with running_daemon(tmp_path / "daemon", overrides) as d, d.client() as c:
            remotes = [w for w in c.list_workers() if w.kind == pb.WORKER_KIND_REMOTE_L3]
            assert len(remotes) == 1, c.list_workers()
            w = remotes[0]
            assert w.state == pb.WORKER_STATE_IDLE, w
            assert w.endpoint == remote.address
            r = w.remote
            assert r.state == pb.REMOTE_SESSION_STATE_READY
            assert f"{r.host}:{r.port}" == remote.address
            assert re.fullmatch(r"[0-9a-f]{16}", r.session_id), r.session_id
            assert r.runner_pid > 0 and os.path.exists(f"/proc/{r.runner_pid}")
            runner_pids.append(r.runner_pid)
            assert r.health_age_seconds < 10.0
            assert (r.failures, r.reconnects) == (0, 0)
            assert c.get_info().num_next_level_workers >= 1

            # A second session on the same worker through the RPC.
            new_id = c.add_remote_worker(remote.address, num_sub_workers=1, heap_bytes=4 << 20)
            assert new_id != w.worker_id
            ids = {x.worker_id for x in c.list_workers() if x.HasField("remote")}
            assert ids == {w.worker_id, new_id}
            assert all(
                x.remote.state == pb.REMOTE_SESSION_STATE_READY
                for x in c.list_workers()
                if x.HasField("remote")
            )
            runner_pids += [x.remote.runner_pid for x in c.list_workers() if x.worker_id == new_id]

            ctl = [sys.executable, "-m", "simpler_daemon.cli", "--socket", d.socket]
            code = subprocess.run(
                [*ctl, "--json", "add-remote", "localhost:" + remote.address.rpartition(":")[2]],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert code.returncode == 0, code.stderr
            runner_pids += [
                x.remote.runner_pid
                for x in c.list_workers()
                if x.worker_id == json.loads(code.stdout)["worker_id"]
            ]

            out = subprocess.run(
                [*ctl, "workers"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout
            assert "SESSION" in out and remote.address in out and "ready" in out, out
    finally:
        remote.stop()
    poll_for(
        lambda: not [p for p in runner_pids if os.path.exists(f"/proc/{p}")],
        timeout=15.0,
        message=f"session runners {runner_pids} outlived the test",
    )


@pytest.mark.parametrize(
    ("argv", "code", "text"),
    [
        (["--worker-token-file", "/etc/passwd"], "PERMISSION_DENIED", "token_file: "),
        # A relative path is made absolute where the shell is, then judged by the daemon.
        (["--worker-tls-ca", "ca.pem"], "PERMISSION_DENIED", "tls_ca_file: "),
        (["--worker-server-name", "w1"], "INVALID_ARGUMENT", "requires tls_ca_file"),
        (["--chip-pipeline-depth", "3"], "INVALID_ARGUMENT", "must be 1 or 2"),
    ],
)
def test_simplerctl_add_remote_sends_the_credentials_and_options(
    daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], argv: list[str], code: str, text: str
) -> None:
    """`simplerctl add-remote` had no way to give the token or TLS files a secured
    remote worker needs; each option now reaches AddRemoteWorker (the daemon's answer
    names the field it got)."""
    from tests.support.ctl import Ctl

    ctl = Ctl(daemon.socket, capsys)
    status, _, err = ctl("add-remote", "127.0.0.1:1", *argv)
    assert status != 0 and f"{code}: " in err and text in err, err
