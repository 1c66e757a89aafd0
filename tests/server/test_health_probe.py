"""health.probe_listen: a plain-text TCP listener with the gRPC health service alone.

What a probe that carries no credentials (a Kubernetes ``grpc:`` probe) sees: readiness
("" and the Daemon's name) follows the daemon's serving state, a drain included;
"liveness" stays SERVING through a drain; nothing but health is served there.
"""

from __future__ import annotations

import socket
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from simpler_daemon.errors import ConfigError
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2_grpc as pb_grpc
from simpler_daemon.server import config as cfg
from simpler_daemon.server.daemon import LIVENESS_NAME, SERVICE_NAME
from tests.support.daemon_harness import running_daemon, wait_until

Status = health_pb2.HealthCheckResponse


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check(port: int, name: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status)


@pytest.mark.timeout(120)
def test_probe_port_serves_health_only_and_follows_a_drain(tmp_path: Path) -> None:
    port = _free_port()
    overrides = {
        "workers": {"num_sub_workers": 1, "num_chips": 0},
        "health": {"probe_listen": f"127.0.0.1:{port}"},
    }
    with running_daemon(tmp_path / "d", overrides) as d:
        assert f"health probes on tcp 127.0.0.1:{port} (plain text)" in d.stdout()
        for name in ("", SERVICE_NAME, LIVENESS_NAME):
            assert _check(port, name) == Status.SERVING, name

        # The daemon's API is not there, nor is reflection: only health.
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        with channel, pytest.raises(grpc.RpcError) as info:
            pb_grpc.DaemonStub(channel).GetInfo(pb.GetInfoRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as unknown:
            _check(port, "no.such.Service")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        # A drain: not ready (no new work), but alive (a restart would not help).
        with d.client() as c:
            c.drain(grace=60.0)
            wait_until(lambda: _check(port, "") == Status.NOT_SERVING, timeout=30)
            assert _check(port, SERVICE_NAME) == Status.NOT_SERVING
            assert _check(port, LIVENESS_NAME) == Status.SERVING
            assert c.resume()
            wait_until(lambda: _check(port, "") == Status.SERVING, timeout=30)


def test_probe_listen_must_be_host_port() -> None:
    with pytest.raises(ConfigError, match=r"health\.probe_listen.*not host:port"):
        cfg.load(None, env={}, overrides={"health.probe_listen": "8081"})
