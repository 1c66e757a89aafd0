"""Real ``simpler-remote-worker`` processes on real test hosts, for the remote L3 e2e tests.

::

    test process (root namespace, the L4 parent)
      └─ RemoteHosts(2): TestHosts (network namespaces, or loopback aliases without root)
           host i: simpler-remote-worker serve --listen <address(i)>:19073 --insecure ...
                     └─ simpler-remote-l3-session runner per session (+ its inner children)

Every process started here carries the environment variable :data:`MARK_ENV` with a
value unique to this test process, and so does everything they start (runners and
their forked children inherit the environment). :func:`session_processes` finds
them by that mark in ``/proc/<pid>/environ``, which also catches an orphan whose
parent chain no longer leads back to the test.

No thread is started here: the L4 ``Worker`` forks and fork refuses to run while
other threads exist, so worker output goes to a log file that is polled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from simpler_daemon.testing import poll_for, shm_files
from simpler_daemon.testing.netns import TestHosts

log = logging.getLogger("tests.support.remote_harness")

REPO = Path(__file__).resolve().parents[2]
PORT = 19073
T = TypeVar("T")
LOOPBACK_ENV = "SIMPLER_E2E_LOOPBACK"
MARK_ENV = "SIMPLER_E2E_MARK"
#: Unique to this test process: tells our processes from any other test run's.
MARK = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
#: Command lines that belong to the remote side.
#: A runner sets its title (``simpler-remote-l3-session: session 3``, its children
#: ``...: session 3: sub worker 0``); before that its cmdline names its module.
RUNNER_CMDLINES = ("simpler_daemon.remote_worker.session", "simpler-remote-l3-session")
REMOTE_CMDLINES = (*RUNNER_CMDLINES, "simpler-remote-worker")
SERVICE_CMDLINE = "simpler-remote-worker"


def worker_command() -> list[str]:
    """The ``simpler-remote-worker`` console script of this venv (or PATH)."""
    script = Path(sys.executable).parent / "simpler-remote-worker"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "simpler_daemon.remote_worker.service"]


def marked_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env[MARK_ENV] = MARK
    env.pop("NOTIFY_SOCKET", None)  # never talk to a real systemd
    return env


@dataclass
class RemoteWorkerProcess:
    """One ``simpler-remote-worker`` on test host ``host``."""

    host: int
    address: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    _log_file: Any = field(repr=False, default=None)

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_listening(self, timeout: float) -> str:
        """Wait for the ``listening on HOST:PORT`` line; return ``HOST:PORT``."""

        def listening() -> str | None:
            m = re.search(r"^listening on (\S+:\d+)$", self.log_text(), re.MULTILINE)
            if m:
                return m[1]
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"simpler-remote-worker on host {self.host} exited with "
                    f"{self.proc.returncode}:\n{self.log_text()[-3000:]}"
                )
            return None

        found: str | None = wait_until(
            listening,
            timeout,
            lambda: (
                f"simpler-remote-worker on host {self.host} printed no 'listening on' "
                f"line:\n{self.log_text()[-3000:]}"
            ),
        )
        assert found is not None  # poll_for returns only a truthy value
        return found

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (it stops its runners), then SIGKILL of its process group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait(10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return rc


def start_worker(
    hosts: TestHosts,
    i: int,
    log_dir: Path,
    *,
    port: int = PORT,
    extra: Sequence[str] = (),
    insecure: bool = True,
    timeout: float = 30.0,
) -> RemoteWorkerProcess:
    """Start ``simpler-remote-worker serve`` on host ``i`` and wait until it listens."""
    address = hosts.address(i)
    argv = [
        *worker_command(),
        "serve",
        "--listen",
        f"{address}:{port}",
        "--set",
        'callables.allowed_modules=["simpler_daemon.examples.", "tests."]',
        "--set",
        f'callables.python_path=["{REPO}"]',
        *(["--insecure"] if insecure else []),
        *extra,
    ]
    log_path = log_dir / f"remote-worker-{i}-{port}.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 -- closed by RemoteWorkerProcess.stop
    proc = hosts.run_in(
        i,
        argv,
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=marked_env(),
        cwd=str(REPO),
    )
    rw = RemoteWorkerProcess(i, address, port, proc, log_path, log_file)
    try:
        rw.wait_listening(timeout)
    except BaseException:
        rw.stop()
        raise
    return rw


# -- /proc scans ----------------------------------------------------------------------------------


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return b""


def _is_zombie(pid: int) -> bool:
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return True
    try:
        return stat.rsplit(b")", 1)[1].split()[0] == b"Z"
    except IndexError:
        return True


def session_processes(kind: Sequence[str] = REMOTE_CMDLINES) -> dict[int, str]:
    """Live processes of this test process (by :data:`MARK`) whose cmdline names ``kind``."""
    needle = f"{MARK_ENV}={MARK}".encode()
    found: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        cmdline = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace")
        if not any(k in cmdline for k in kind):
            continue
        if needle not in _read(f"/proc/{pid}/environ").split(b"\0"):
            continue
        if not _is_zombie(pid):
            found[pid] = cmdline.strip()
    SEEN_PIDS.update(found)
    return found


#: Every pid of ours the scans have seen (so a file named after a dead one is still ours).
SEEN_PIDS: set[int] = set()
_SHM_PID = re.compile(r"-(\d+)-[0-9a-f]+$")


def _marked(pid: int) -> bool:
    return f"{MARK_ENV}={MARK}".encode() in _read(f"/proc/{pid}/environ").split(b"\0")


def our_shm_files() -> set[str]:
    """``/dev/shm`` files of this test process and the processes it started.

    Other test processes share the machine and ``/dev/shm`` (a daemon test's named
    heap is ``simpler-heap-<pid>-<hex>``); their files are not ours to judge.
    """
    out: set[str] = set()
    for name in shm_files():
        m = _SHM_PID.search(name)
        if m is None:
            out.add(name)
            continue
        pid = int(m[1])
        if pid == os.getpid() or pid in SEEN_PIDS or _marked(pid):
            out.add(name)
    return out


def runner_processes() -> dict[int, str]:
    """Session runners and their forked inner children (by the runner's module or title)."""
    return session_processes(RUNNER_CMDLINES)


def wait_no_runners(timeout: float, what: str = "") -> None:
    wait_until(
        lambda: not runner_processes(),
        timeout,
        lambda: f"runner processes outlived {what or 'the test'}: {runner_processes()}",
    )


def pid_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and not _is_zombie(pid)


# -- the hosts with their workers ------------------------------------------------------------------


@dataclass
class RemoteHosts:
    """Two test hosts, each running one ``simpler-remote-worker`` on port 19073."""

    hosts: TestHosts
    workers: list[RemoteWorkerProcess]
    log_dir: Path

    @property
    def netns(self) -> bool:
        return self.hosts.netns

    def endpoint(self, i: int) -> str:
        return self.workers[i].endpoint

    def pids(self) -> set[int]:
        return {w.proc.pid for w in self.workers}

    def logs(self) -> str:
        return "\n".join(f"--- host {w.host}:\n{w.log_text()[-4000:]}" for w in self.workers)


@contextlib.contextmanager
def remote_hosts(log_dir: Path, n: int = 2) -> Iterator[RemoteHosts]:
    """Create ``n`` test hosts with a worker each; tear all down and prove nothing is left."""
    # SIMPLER_E2E_LOOPBACK=1 forces the loopback fallback (to test it as root).
    hosts = TestHosts(n, use_netns=False if os.environ.get(LOOPBACK_ENV) == "1" else None)
    hosts.start()
    mode = (
        "network namespaces " + ", ".join(str(hosts.namespace(i)) for i in range(n))
        if hosts.netns
        else "loopback aliases (no netns: link_down tests are skipped)"
    )
    log.info("remote e2e hosts: %s", mode)
    print(f"\nremote e2e hosts: {mode}")
    workers: list[RemoteWorkerProcess] = []
    codes: dict[int, int] = {}
    try:
        for i in range(n):
            workers.append(start_worker(hosts, i, log_dir))
        yield RemoteHosts(hosts, workers, log_dir)
    finally:
        try:
            for w in workers:
                codes[w.host] = w.stop()
        finally:
            hosts.close()
        # Runners get PR_SET_PDEATHSIG from their worker; give them a moment to go.
        wait_until(
            lambda: not session_processes(),
            10.0,
            lambda: f"remote processes outlived the hosts: {session_processes()}",
        )
    # Reached only when the body did not raise: a worker that crashed is a finding too.
    bad = {h: rc for h, rc in codes.items() if rc != 0}
    assert not bad, f"remote workers exited with {bad} after SIGTERM:\n" + "\n".join(
        w.log_text()[-3000:] for w in workers if w.host in bad
    )


# -- a peer that accepts and never answers ----------------------------------------------------------


@contextlib.contextmanager
def silent_listener() -> Iterator[str]:
    """A loopback TCP listener that completes handshakes and never says a byte.

    The kernel accepts the connections into the backlog (no thread needed); they are
    accepted and closed on exit.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"127.0.0.1:{sock.getsockname()[1]}"
        sock.setblocking(False)
        while True:
            try:
                conn, _ = sock.accept()
            except BlockingIOError:
                break
            conn.close()
    finally:
        sock.close()


def wait_until(
    predicate: Callable[[], T], timeout: float, describe: Callable[[], str], interval: float = 0.02
) -> T:
    """``poll_for`` whose failure message is built when it fails (so it shows the state
    at the deadline, not at the start)."""
    try:
        return poll_for(predicate, timeout=timeout, interval=interval)
    except TimeoutError:
        raise TimeoutError(f"{describe()} (waited {timeout:.1f} s)") from None
