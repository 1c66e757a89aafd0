"""Real ``simpler-remote-worker`` processes on this host.

* ``start_worker`` (a fixture, with ``token_file``) starts one on loopback with a
  stand-in runner (``FAKE_RUNNER``, through the documented test hook
  ``SIMPLER_REMOTE_RUNNER_ARGV``) whose behaviour is picked by the manifest's worker id,
  or with the real runner; ``RunningWorker`` talks to it and ``run_cli`` runs its
  command line (the remote worker service and security tests);
* ``RemoteWorkerProcess`` is a plain ``serve --listen 127.0.0.1:0`` for a daemon to use
  (the daemon's remote and local-L3 tests);
* ``self_signed`` makes a certificate pair, or skips the test without openssl.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import select
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from simpler_daemon.callables import spec_for_import
from simpler_daemon.remote.manifest import (
    MAX_REPLY_BYTES,
    encode_auth,
    encode_lp_json,
    read_lp_sock,
)
from simpler_daemon.testing import child_pids, poll_for, self_signed_cert
from tests.support.daemon_harness import REPO


class RemoteWorkerProcess:
    """``simpler-remote-worker serve --listen 127.0.0.1:0``; ``address`` once it listens."""

    def __init__(self, directory: Path) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("NOTIFY_SOCKET", None)
        cmd = [sys.executable, "-m", "simpler_daemon.remote_worker.service", "serve"]
        cmd += ["--listen", "127.0.0.1:0"]
        self.stderr_path = directory / "remote-worker.stderr"
        self._err = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._err,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.address = poll_for(self._listening, timeout=30.0, message="no 'listening on' line")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").strip())

    def _listening(self) -> str | None:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"simpler-remote-worker exited with {self.proc.returncode}:\n"
                + self.stderr_path.read_text(errors="replace")
            )
        for line in self.lines:
            m = re.search(r"listening on (\S+:\d+)", line)
            if m:
                return m[1]
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._err.close()


def self_signed(directory: Path, name: str = "worker") -> tuple[Path, Path]:
    pair = self_signed_cert(directory, name)
    if pair is None:
        pytest.skip("the openssl CLI is not available")
    return pair


WORKER_BIN = Path(sys.executable).with_name("simpler-remote-worker")


TOKEN = b"correct horse battery staple"


# Stand-in runner. Behaviour by manifest.worker_id:
#   0 ready (real listeners), then sleeps      1 never ready
#   2 never ready, ignores SIGTERM, forks a grandchild (same process group)
#   3 prints to stderr and exits 3             4 writes {"ok": false}
#   5 writes a malformed ready line            6 ready, ignores SIGTERM
#   7 ready with wildcard addresses
FAKE_RUNNER = r"""
import json, os, signal, socket, sys, time
args = sys.argv[1:]
spec_path = args[args.index("--spec") + 1]
fd = int(args[args.index("--ready-fd") + 1])
mode_bits = os.stat(spec_path).st_mode & 0o777
with open(spec_path) as f:
    spec = json.load(f)
m = spec["manifest"]
record = os.environ.get("FAKE_RECORD_DIR")
if record:
    with open(os.path.join(record, "%d.json" % m["session_id"]), "w") as f:
        json.dump({"spec": spec, "mode": mode_bits, "pid": os.getpid(), "pgid": os.getpgrp(),
                   "pythonpath": os.environ.get("PYTHONPATH", ""),
                   "notify": os.environ.get("NOTIFY_SOCKET"), "spec_path": spec_path}, f)
mode = m["worker_id"]
print("fake runner %d mode %d" % (os.getpid(), mode), file=sys.stderr, flush=True)

def ready(host="127.0.0.1"):
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    line = {"ok": True, "command": "%s:%d" % (host, socks[0].getsockname()[1]),
            "health": "%s:%d" % (host, socks[1].getsockname()[1]), "pid": os.getpid()}
    os.write(fd, (json.dumps(line) + "\n").encode())
    os.close(fd)
    return socks

if mode == 0:
    keep = ready()
    time.sleep(3600)
elif mode == 1:
    time.sleep(3600)
elif mode == 2:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = os.fork()
    if child == 0:
        time.sleep(3600)
        os._exit(0)
    with open(os.path.join(record, "grandchild"), "w") as f:
        f.write(str(child))
    time.sleep(3600)
elif mode == 3:
    print("boom: cannot import the job package", file=sys.stderr, flush=True)
    sys.exit(3)
elif mode == 4:
    os.write(fd, b'{"ok": false, "error": "cannot install callables: no module named x"}\n')
    sys.exit(1)
elif mode == 5:
    os.write(fd, b"garbage\n")
    time.sleep(3600)
elif mode == 6:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    keep = ready()
    time.sleep(3600)
elif mode == 7:
    keep = ready("0.0.0.0")
    time.sleep(3600)
"""


ORCH = "simpler_daemon.examples.tasks:add_scaled"


def manifest(**changes: Any) -> dict[str, Any]:
    m: dict[str, Any] = {
        "session_id": secrets.randbelow(1 << 63) + 1,
        "attach_key": secrets.token_hex(32),
        "worker_id": 0,
        "parent_level": 4,
        "remote_level": 3,
        "num_sub_workers": 1,
        "callables": [
            {
                "hashid": spec_for_import(ORCH, "orchestration").handle.hashid,
                "kind": "orchestration",
                "target": ORCH,
            }
        ],
        "startup_budget_s": 20.0,
    }
    m.update(changes)
    return m


@dataclass
class RunningWorker:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    record: Path

    def children(self) -> set[int]:
        return child_pids(self.proc.pid)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def wait_accepted(self, sock: socket.socket) -> None:
        """Until the worker logged the connection (it runs with log_level debug)."""
        peer = f"127.0.0.1:{sock.getsockname()[1]}"
        poll_for(lambda: f"connection from {peer}" in self.log_text(), timeout=10)

    def handshake(
        self,
        m: dict[str, Any] | None = None,
        *,
        token: bytes = TOKEN,
        raw: bytes | None = None,
        timeout: float = 30.0,
        context: ssl.SSLContext | None = None,
    ) -> dict[str, Any]:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        try:
            if context is not None:
                sock = context.wrap_socket(sock, server_hostname="localhost")
            data = raw if raw is not None else encode_auth(token) + encode_lp_json(m or manifest())
            sock.sendall(data)
            reply = read_lp_sock(sock, MAX_REPLY_BYTES, time.monotonic() + timeout)
        finally:
            sock.close()
        result: dict[str, Any] = json.loads(reply)
        return result


def worker_cmd() -> list[str]:
    if WORKER_BIN.exists():
        return [str(WORKER_BIN)]
    return [sys.executable, "-m", "simpler_daemon.remote_worker.service"]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*worker_cmd(), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_bytes(TOKEN + b"\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def start_worker(tmp_path: Path, token_file: Path) -> Iterator[Callable[..., RunningWorker]]:
    started: list[RunningWorker] = []

    def start(
        *args: str,
        fake: bool = True,
        token: bool = True,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> RunningWorker:
        n = len(started)
        record = tmp_path / f"record{n}"
        record.mkdir()
        log = tmp_path / f"worker{n}.log"
        full_env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
        }
        full_env["FAKE_RECORD_DIR"] = str(record)
        if fake:
            full_env["SIMPLER_REMOTE_RUNNER_ARGV"] = json.dumps([sys.executable, "-c", FAKE_RUNNER])
        full_env.update(env or {})
        cmd = [
            *worker_cmd(),
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--set",
            "worker.log_level=debug",
        ]
        cmd += args
        if token:
            cmd += ["--token-file", str(token_file)]
        with open(log, "wb") as log_fh:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=log_fh,
                stdin=subprocess.DEVNULL,
                env=full_env,
                cwd=cwd,
            )
        assert proc.stdout is not None
        line = b""
        deadline = time.monotonic() + 30
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            readable, _, _ = select.select([proc.stdout], [], [], max(0.0, remaining))
            if not readable:
                proc.kill()
                proc.wait()
                pytest.fail(f"worker did not report its address: {log.read_text()}")
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                proc.wait()
                pytest.fail(f"worker exited with {proc.returncode}: {log.read_text()}")
            line += chunk
        text = line.decode().strip()
        assert text.startswith("listening on 127.0.0.1:"), text
        worker = RunningWorker(proc, int(text.rpartition(":")[2]), log, record)
        started.append(worker)
        return worker

    yield start
    for w in started:
        if w.proc.poll() is None:
            runners = w.children()
            w.proc.send_signal(signal.SIGTERM)
            try:
                w.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                for pid in runners:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                w.proc.kill()
                w.proc.wait()
        assert w.proc.stdout is not None
        w.proc.stdout.close()
        # No connection, however hostile, may make the worker log a traceback.
        assert "Traceback" not in w.log_text(), w.log_text()
