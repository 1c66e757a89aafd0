"""The pods of deploy/kubernetes/ as the programs will see them, run on this host.

No cluster: each pod's volumes become directories laid out as the kubelet makes them
(a memory emptyDir is a tmpfs of mode 1777, a disk emptyDir 0777, a Secret volume's
files have its defaultMode, a ConfigMap volume holds the built ConfigMap's files), the
mount paths in the built configs are pointed at them and the listen addresses at
loopback ports; nothing else of the configs changes. The credentials are
make-secrets.sh's, loaded the way docs/kubernetes.md creates the Secrets. Then, as the
kubelet would: the init container's own command copies the Secrets, the worker and the
daemon start with the built configs, the daemon's probes are asked on its probe port,
a client connects over TLS with the daemon's token as docs/kubernetes.md shows, and the
daemon finds the worker through [workers.discovery] and opens a session on it with the
token, CA and server name of its ConfigMap.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from simpler_daemon.client import Client
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.testing import poll_for
from tests.support.kustomize import KUBERNETES, build

#: Each Secret key -> the make-secrets.sh file it is created from (docs/kubernetes.md;
#: tests/ops/test_kubernetes_secrets.py checks the docs say the same).
SECRET_FILES = {
    ("simpler-daemon-token", "token"): "daemon-token",
    ("simpler-daemon-tls", "tls.crt"): "daemon.crt",
    ("simpler-daemon-tls", "tls.key"): "daemon.key",
    ("simpler-remote-token", "token"): "remote-token",
    ("simpler-remote-worker-tls", "tls.crt"): "worker.crt",
    ("simpler-remote-worker-tls", "tls.key"): "worker.key",
    ("simpler-remote-worker-tls", "ca.crt"): "ca.crt",
}
WORKER_BIN = Path(sys.executable).with_name("simpler-remote-worker")
Status = health_pb2.HealthCheckResponse


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Pod:
    """One workload's pod laid out under ``root``: a directory per volume."""

    def __init__(self, root: Path, resources: list[dict[str, Any]], name: str, made: Path):
        workload = next(
            r
            for r in resources
            if r["kind"] in ("Deployment", "StatefulSet") and r["metadata"]["name"] == name
        )
        self.spec = workload["spec"]["template"]["spec"]
        self.root = root / name
        self.root.mkdir()
        config_maps = {r["metadata"]["name"]: r for r in resources if r["kind"] == "ConfigMap"}
        for volume in self.spec["volumes"]:
            path = self.root / volume["name"]
            path.mkdir()
            if "emptyDir" in volume:
                # tmpfs mounts start as 1777; kubelet makes a disk emptyDir 0777.
                memory = volume["emptyDir"].get("medium") == "Memory"
                os.chmod(path, 0o1777 if memory else 0o777)
            elif "configMap" in volume:
                for key, text in config_maps[volume["configMap"]["name"]]["data"].items():
                    (path / key).write_text(text)
            elif "projected" in volume:
                mode = volume["projected"]["defaultMode"]
                for source in volume["projected"]["sources"]:
                    secret = source["secret"]
                    for item in secret["items"]:
                        made_file = made / SECRET_FILES[(secret["name"], item["key"])]
                        target = path / item["path"]
                        shutil.copyfile(made_file, target)
                        os.chmod(target, mode)
            else:
                assert "persistentVolumeClaim" in volume, volume
                os.chmod(path, 0o755)

    def container(self, name: str, init: bool = False) -> dict[str, Any]:
        key = "initContainers" if init else "containers"
        return dict(next(c for c in self.spec[key] if c["name"] == name))

    def host_path(self, container: dict[str, Any], path: str) -> str:
        """Where ``path`` of ``container`` lies on this host ("/dev/shm" stays itself)."""
        for mount in sorted(container["volumeMounts"], key=lambda m: -len(m["mountPath"])):
            root = mount["mountPath"]
            if root != "/dev/shm" and (path == root or path.startswith(root + "/")):
                return str(self.root / mount["name"]) + path[len(root) :]
        return path

    def remap(self, container: dict[str, Any], text: str) -> str:
        """``text`` (a TOML file) with every quoted absolute path under a mount pointed
        at its directory here (each once)."""
        return re.sub(r'"(/[^"]*)"', lambda m: f'"{self.host_path(container, m[1])}"', text)

    def run_init(self, name: str) -> None:
        """The init container's own command, its paths pointed here."""
        init = self.container(name, init=True)
        argv = [*init.get("command", []), *init["args"]]
        argv = [self.host_path(init, a) if a.startswith("/") else a for a in argv]
        subprocess.run(argv, check=True, capture_output=True, timeout=30)

    def config(self, container: str, volume: str, key: str, replace: dict[str, str]) -> Path:
        """The ConfigMap file ``key`` of ``volume``, remapped, with ``replace`` applied."""
        c = self.container(container)
        text = self.remap(c, (self.root / volume / key).read_text())
        for old, new in replace.items():
            assert old in text, old
            text = text.replace(old, new)
        path = self.root / f"{container}.toml"
        path.write_text(text)
        return path


@contextlib.contextmanager
def process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIMPLER_", "NOTIFY_"))}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _health(port: int, name: str) -> int | None:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = health_pb2.HealthCheckRequest(service=name)
            return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status)
    except grpc.RpcError:
        return None


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _running(proc: subprocess.Popen[bytes], log: Path) -> None:
    assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()}"


@pytest.mark.timeout(240)
def test_the_built_pods_run_and_the_daemon_finds_the_worker() -> None:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not available (make-secrets.sh needs it)")
    resources = build("base")
    # Short paths: the daemon's sockets live under the runtime directory (108 bytes).
    root = Path(tempfile.mkdtemp(prefix="k8s", dir="/tmp"))
    try:
        made = root / "made"
        subprocess.run(
            ["sh", str(KUBERNETES / "make-secrets.sh"), str(made)],
            check=True,
            capture_output=True,
            timeout=60,
        )
        _run_pods(root, resources, made)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_pods(root: Path, resources: list[dict[str, Any]], made: Path) -> None:
    worker_pod = Pod(root, resources, "simpler-remote-worker", made)
    daemon_pod = Pod(root, resources, "simpler-daemon", made)
    for pod in (worker_pod, daemon_pod):
        pod.run_init("secrets")
        for f in (pod.root / "secrets").iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    worker_port, api_port, probe_port = _free_port(), _free_port(), _free_port()
    worker_cfg = worker_pod.config(
        "remote-worker", "config", "worker.toml", {"0.0.0.0:19073": f"127.0.0.1:{worker_port}"}
    )
    daemon_cfg = daemon_pod.config(
        "daemon",
        "config",
        "daemon.toml",
        {
            "simpler-remote-worker.simpler.svc.cluster.local:19073": f"127.0.0.1:{worker_port}",
            "0.0.0.0:50051": f"127.0.0.1:{api_port}",
            "0.0.0.0:8081": f"127.0.0.1:{probe_port}",
        },
    )
    worker_argv = [str(WORKER_BIN), *worker_pod.container("remote-worker")["args"][1:]]
    worker_argv[worker_argv.index("--config") + 1] = str(worker_cfg)
    daemon_argv = [sys.executable, "-m", "simpler_daemon.server.main"]
    daemon_argv += daemon_pod.container("daemon")["args"][1:]
    daemon_argv[daemon_argv.index("--config") + 1] = str(daemon_cfg)
    worker_log, daemon_log = root / "worker.log", root / "daemon.log"

    with process(worker_argv, worker_log) as worker:
        poll_for(lambda: _running(worker, worker_log) or _accepts(worker_port), timeout=60)
        with process(daemon_argv, daemon_log) as daemon:
            # The kubelet's view: startup and readiness on the probe port.
            poll_for(
                lambda: (
                    _running(daemon, daemon_log)
                    or _health(probe_port, "liveness") == Status.SERVING
                ),
                timeout=90,
                message="the daemon's startup probe never passed",
            )
            poll_for(lambda: _health(probe_port, "") == Status.SERVING, timeout=30)

            # A client as docs/kubernetes.md shows (port-forward: the Service's port).
            ctl = [sys.executable, "-m", "simpler_daemon.cli"]
            remote = [
                "--socket",
                f"127.0.0.1:{api_port}",
                "--token-file",
                str(daemon_pod.root / "secrets" / "daemon-token"),
                "--tls-ca",
                str(made / "ca.crt"),
                "--server-name",
                "simpler-daemon.simpler.svc",
            ]
            shown = subprocess.run(
                [*ctl, *remote, "info"], capture_output=True, text=True, timeout=60
            )
            assert shown.returncode == 0, shown.stderr
            assert "(level 4)" in shown.stdout, shown.stdout

            # `kubectl exec ... simplerctl workers`: the socket the pod's env names.
            env = dict(os.environ)
            socket_path = daemon_pod.host_path(
                daemon_pod.container("daemon"),
                next(
                    e["value"]
                    for e in daemon_pod.container("daemon")["env"]
                    if e["name"] == "SIMPLER_DAEMON_SOCKET"
                ),
            )
            env["SIMPLER_DAEMON_SOCKET"] = socket_path

            def remote_ready() -> bool:
                _running(daemon, daemon_log)
                with Client(socket_path) as c:
                    return any(
                        w.kind == pb.WORKER_KIND_REMOTE_L3
                        and w.endpoint == f"127.0.0.1:{worker_port}"
                        and w.state == pb.WORKER_STATE_IDLE
                        for w in c.list_workers()
                    )

            poll_for(remote_ready, timeout=90, message="discovery opened no session on the worker")
            listed = subprocess.run(
                [*ctl, "workers"], capture_output=True, text=True, timeout=60, env=env
            )
            assert listed.returncode == 0, listed.stderr
            assert f"127.0.0.1:{worker_port}" in listed.stdout, listed.stdout
            assert _health(probe_port, "") == Status.SERVING

            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(60) == 0, daemon_log.read_text()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0, worker_log.read_text()
