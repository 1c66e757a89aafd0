"""grpc core's I/O setting (system/grpcsetup.py) is in effect where it should be.

The client package and the daemon import grpc with the EventEngine client and listener
experiments off, so that grpc core's iomgr poller carries their calls; a user's
``GRPC_EXPERIMENTS`` wins; the environment is left as it was. Which poller carried a call
shows in grpc's ``tcp`` trace: iomgr's endpoint logs from ``tcp_posix.cc``, the
EventEngine's from ``posix_engine/`` sources. Each case runs in a fresh interpreter
(grpc reads the setting once, at its first import).

The same import turns grpc's fork support off: a fork of a process holding an idle
channel leaves grpc's threads running, where grpc's own fork handler stops every one of
them (and starts them again later): the handler that deadlocked ``fork()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from simpler_daemon.system.grpcsetup import (
    ENV_EXPERIMENTS,
    ENV_FORK_SUPPORT,
    EXPERIMENTS,
    FORK_SUPPORT,
)
from tests.support.daemon_harness import REPO, running_daemon

pytestmark = pytest.mark.timeout(60)

TRACE = {"GRPC_TRACE": "tcp", "GRPC_VERBOSITY": "debug"}
IOMGR = "tcp_posix.cc"
EVENT_ENGINE = "posix_engine/"

#: One unary call over a Unix socket to a sync echo server in the same process, after
#: importing ``FIRST``; prints what grpcsetup reports and what the environment holds.
PROBE = """
import json, os, sys
from concurrent.futures import ThreadPoolExecutor
{first}
import grpc
from simpler_daemon.system import grpcsetup

path = sys.argv[1]
server = grpc.server(ThreadPoolExecutor(max_workers=1))
echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
server.add_generic_rpc_handlers(
    (grpc.method_handlers_generic_handler("probe.Echo", {{"Echo": echo}}),)
)
server.add_insecure_port("unix:" + path)
server.start()
with grpc.insecure_channel("unix:" + path) as channel:
    assert channel.unary_unary("/probe.Echo/Echo")(b"ping", timeout=10) == b"ping"
server.stop(None)
print(json.dumps({{"read": grpcsetup.grpc_experiments(), "env": os.environ.get("GRPC_EXPERIMENTS")}}))
"""


def _clean_env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    return {**clean, "PYTHONPATH": str(REPO)}


def _probe(tmp_path: Path, first: str, env: dict[str, str]) -> tuple[dict[str, str | None], str]:
    """Run :data:`PROBE` in a fresh interpreter: (its report, its stderr)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first), str(tmp_path / "probe.sock")],
        env={**_clean_env(), **TRACE, **env},
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_the_client_package_imports_grpc_on_iomgr(tmp_path: Path) -> None:
    report, trace = _probe(tmp_path, "import simpler_daemon.client", {})
    assert report == {"read": EXPERIMENTS, "env": None}  # applied, and the env restored
    assert IOMGR in trace, "no iomgr endpoint in grpc's trace: is the setting still honoured?"
    assert EVENT_ENGINE not in trace


def test_simplerctl_imports_grpc_on_iomgr(tmp_path: Path) -> None:
    """simplerctl imports grpc itself, before the client package: the setting goes first."""
    report, trace = _probe(tmp_path, "import simpler_daemon.cli.simplerctl", {})
    assert report == {"read": EXPERIMENTS, "env": None}
    assert IOMGR in trace
    assert EVENT_ENGINE not in trace


def test_a_users_grpc_experiments_wins(tmp_path: Path) -> None:
    own = "event_engine_client,event_engine_listener"
    report, trace = _probe(tmp_path, "import simpler_daemon.client", {ENV_EXPERIMENTS: own})
    assert report == {"read": own, "env": own}
    assert EVENT_ENGINE in trace
    assert IOMGR not in trace


def test_grpc_imported_first_keeps_its_defaults(tmp_path: Path) -> None:
    report, trace = _probe(tmp_path, "import grpc; import simpler_daemon.client", {})
    assert report == {"read": None, "env": None}  # too late: grpcsetup says so
    assert EVENT_ENGINE in trace  # grpcio 1.85's default


def test_the_daemon_serves_on_iomgr(tmp_path: Path) -> None:
    with running_daemon(tmp_path / "d", env=TRACE) as daemon:
        with daemon.client(transport="grpc") as client:
            assert client.get_info().version
        trace = daemon.stderr()
    assert "tcp_server_posix.cc" in trace  # iomgr's listener accepted the connection
    assert IOMGR in trace
    assert EVENT_ENGINE not in trace


# --------------------------------------------------------------------------- fork support

#: A unary echo server in a process of its own (a server in the probe's process would keep
#: grpc busy, and grpc's fork handler skips a busy process): prints "up" once it serves.
ECHO_SERVER = """
import sys, time
from concurrent.futures import ThreadPoolExecutor
import grpc
server = grpc.server(ThreadPoolExecutor(max_workers=1))
echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
server.add_generic_rpc_handlers(
    (grpc.method_handlers_generic_handler("probe.Echo", {"Echo": echo}),)
)
server.add_insecure_port("unix:" + sys.argv[1])
server.start()
print("up", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""

#: After one call on a channel left open and idle, fork once: which of the threads grpc
#: ran before the fork still run after it, and what grpcsetup reports.
FORK_PROBE = """
import json, os, sys
import simpler_daemon.client
import grpc
from simpler_daemon.system import grpcsetup

def grpc_threads():
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                threads[tid] = f.read().strip()
        except OSError:
            pass
    threads.pop(str(os.getpid()), None)
    return threads

channel = grpc.insecure_channel("unix:" + sys.argv[1])
assert channel.unary_unary("/probe.Echo/Echo")(b"ping", timeout=10) == b"ping"
before = grpc_threads()
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
after = grpc_threads()
print(json.dumps({
    "read": grpcsetup.grpc_fork_support(),
    "env": os.environ.get("GRPC_ENABLE_FORK_SUPPORT"),
    "before": sorted(before.values()),
    "kept": sorted(name for tid, name in before.items() if after.get(tid) == name),
}))
"""


def _fork_probe(tmp_path: Path, env: dict[str, str]) -> dict[str, Any]:
    sock = str(tmp_path / "echo.sock")
    server = subprocess.Popen(
        [sys.executable, "-c", ECHO_SERVER, sock],
        env=_clean_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        out = subprocess.run(
            [sys.executable, "-c", FORK_PROBE, sock],
            env={**_clean_env(), **env},
            capture_output=True,
            text=True,
            timeout=50,
            check=False,
        )
    finally:
        server.communicate(timeout=30)  # closes its stdin: it stops and exits
    assert out.returncode == 0, out.stderr[-2000:]
    report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return report


def test_the_client_package_turns_grpcs_fork_handler_off(tmp_path: Path) -> None:
    report = _fork_probe(tmp_path, {})
    assert report["read"] == FORK_SUPPORT and report["env"] is None  # applied, env restored
    # grpc's timer thread and its thread pool's lifeguard live as long as the channel:
    # with the handler on, the fork would have stopped them (the case below).
    assert {"grpc_global_tim", "lifeguard"} <= set(report["kept"]), report


def test_a_users_grpc_fork_support_wins(tmp_path: Path) -> None:
    report = _fork_probe(tmp_path, {ENV_FORK_SUPPORT: "1"})
    assert report["read"] == "1" and report["env"] == "1"
    assert "lifeguard" in report["before"], report
    assert report["kept"] == [], report  # grpc's handler stopped every thread of its own
