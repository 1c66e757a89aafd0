"""Start a real ``simpler-daemon serve`` in a temp dir and talk to it (tests only).

The daemon runs as a subprocess (``python -m simpler_daemon.server.main``) with a
generated config whose runtime dir and socket live under the test's directory.
Readiness is observed the way systemd observes it: a real ``AF_UNIX`` datagram
socket passed as ``NOTIFY_SOCKET`` receives ``READY=1``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from simpler_daemon.client import Client
from simpler_daemon.testing import child_pids, poll_for, settled_shm_leaks, shm_files

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = "simpler_daemon.examples.tasks"

BASE_CONFIG: dict[str, dict[str, Any]] = {
    "daemon": {"startup_timeout": 20.0, "shutdown_grace": 5.0, "log_level": "info"},
    "workers": {"num_sub_workers": 2, "num_chips": 0, "heap_bytes": 16 << 20},
    "limits": {
        "max_message_bytes": 1 << 20,
        "max_tasks_per_run": 1000,
        "max_tensors_per_task": 8,
        "max_scalars_per_task": 8,
        "max_buffer_bytes": 8 << 20,
        "max_concurrent_runs": 64,
        "max_streams_per_client": 4,
        "max_finished_runs_kept": 100,
    },
    "callables": {"allowed_modules": ["simpler_daemon.examples"]},
}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):  # an inline table, e.g. one [[workers.remote]] entry
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def write_config(path: Path, sections: Mapping[str, Mapping[str, Any]]) -> Path:
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def merged(overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    out = {k: dict(v) for k, v in BASE_CONFIG.items()}
    for section, values in (overrides or {}).items():
        out.setdefault(section, {}).update(values)
    return out


class NotifySocket:
    """A systemd-style notify socket: collects every ``KEY=value`` datagram."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setblocking(False)
        self.messages: list[dict[str, str]] = []

    def drain(self) -> list[dict[str, str]]:
        while self.sock.fileno() >= 0:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return self.messages
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append(fields)
        return self.messages

    def seen(self, key: str, value: str | None = None) -> bool:
        return any(key in m and (value is None or m[key] == value) for m in self.drain())

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            self.drain()
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def tree_pids(workers: Any) -> list[int]:
    """The pids of ``ListWorkers`` rows and, below a local L3 worker, of its children."""
    out: list[int] = []
    for w in workers:
        if w.pid:
            out.append(w.pid)
        out += tree_pids(w.children)
    return out


class DaemonProcess:
    """One daemon subprocess with its config, notify socket, stdout and stderr files."""

    def __init__(
        self,
        directory: Path,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
    ) -> None:
        """``args``: more ``serve`` options (``--reset-state``)."""
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        sections = merged(overrides)
        sections["daemon"].setdefault("runtime_dir", str(directory / "run"))
        # Its own run history (server/history.py), beside its sockets.
        sections["daemon"].setdefault("state_dir", str(directory / "state"))
        self.socket = str(
            sections.get("grpc", {}).get("unix_socket") or directory / "run" / "daemon.sock"
        )
        self.config_path = write_config(directory / "daemon.toml", sections)
        self.notify = NotifySocket(directory / "notify.sock")
        self.stdout_path = directory / "stdout.txt"
        self.stderr_path = directory / "stderr.txt"
        self.extra_env = dict(env or {})
        self.extra_args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.worker_pids: list[int] = []

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        env = dict(os.environ)
        env.pop("SIMPLER_DAEMON_SOCKET", None)
        env.pop("SIMPLER_DAEMON__DAEMON__STATE_DIR", None)  # the config names its state_dir
        env.update(NOTIFY_SOCKET=self.notify.path, PYTHONUNBUFFERED="1", **self.extra_env)
        cmd = [sys.executable, "-m", "simpler_daemon.server.main", "serve"]
        cmd += ["--config", str(self.config_path), *self.extra_args]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err
            )
        proc = self.proc

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"daemon exited with {proc.returncode} before READY=1:\n{self.stderr()}"
                )
            return self.notify.seen("READY", "1")

        poll_for(ready, timeout=timeout, interval=0.01, message="daemon never sent READY=1")
        with self.client() as c:
            self.worker_pids = tree_pids(c.list_workers())
        return self

    def client(self, **kwargs: Any) -> Client:
        return Client(self.socket, **kwargs)

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def send(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the daemon and wait for it; SIGKILL when it does not exit in time."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise
        finally:
            self.notify.close()

    def children_gone(self, timeout: float = 10.0) -> None:
        """Every worker child of the daemon has disappeared from /proc."""
        poll_for(
            lambda: not [p for p in self.worker_pids if os.path.exists(f"/proc/{p}")],
            timeout=timeout,
            message=f"worker processes {self.worker_pids} outlived the daemon",
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.notify.close()


@contextlib.contextmanager
def running_daemon(
    directory: Path, overrides: Mapping[str, Mapping[str, Any]] | None = None, **kw: Any
) -> Iterator[DaemonProcess]:
    """A started daemon, stopped with SIGTERM (exit 0 asserted) when the block ends."""
    daemon = DaemonProcess(directory, overrides, **kw)
    try:
        daemon.start()
        yield daemon
    except BaseException:
        # SIGTERM first, also when the test failed: a SIGKILLed daemon leaves its heap in
        # /dev/shm (the next start sweeps it, but the leak guards would count it).
        if daemon.proc is not None and daemon.proc.poll() is None:
            with contextlib.suppress(Exception):
                daemon.stop(timeout=10.0)
        daemon.kill()
        raise
    code = daemon.stop()
    assert code == 0, f"daemon exited with {code}:\n{daemon.stderr()}"
    daemon.children_gone()


def module_leak_guard(kept: Callable[[], set[int]]) -> Iterator[None]:
    """The conftest leak guard, minus the processes ``kept()`` names: a module's own
    daemons outlive each test on purpose (their teardown checks that they and their
    children go away)."""
    shm_before = shm_files()
    yield
    gc.collect()
    allowed = kept()
    poll_for(
        lambda: not (child_pids() - allowed),
        timeout=10.0,
        message="child processes outlived the test",
    )
    # gRPC must leave no thread behind in the test process: later tests fork Workers
    # here, and fork refuses to run while other threads exist.
    poll_for(
        lambda: threading.active_count() == 1,
        timeout=5.0,
        message=f"threads outlived the test: {threading.enumerate()}",
    )
    leaked = settled_shm_leaks(shm_before)
    assert not leaked, f"files left in /dev/shm: {sorted(leaked)}"


def module_daemon(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    kept: set[int] | None = None,
) -> Iterator[DaemonProcess]:
    """Body of a module-scoped daemon fixture: start, yield, SIGTERM, check the exit.
    ``kept``: the module's set of daemon pids its ``module_leak_guard`` spares."""
    shm_before = shm_files()
    with running_daemon(tmp_path_factory.mktemp(name), overrides) as daemon:
        if kept is not None:
            kept.add(daemon.pid)
        yield daemon
        if kept is not None:
            kept.discard(daemon.pid)
    assert not settled_shm_leaks(shm_before)


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, message: str = "") -> Any:
    return poll_for(predicate, timeout=timeout, interval=0.01, message=message)


def elapsed(since: float) -> float:
    return time.monotonic() - since
