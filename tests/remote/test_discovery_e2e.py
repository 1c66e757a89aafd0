"""``[workers.discovery]`` end to end: a level-4 daemon finds real ``simpler-remote-worker``
hosts (network namespaces, loopback aliases without root) through a DNS server the test
controls (tests/support/dns_server.py, ``nameserver = 127.0.0.1:PORT``).

One daemon and three hosts walk through: addresses added -> workers appear and run
tasks; an address also used by a ``[[workers.remote]]`` table stays that worker's; an
address removed -> its worker is retired, its running task fails naming the host, the
task queued behind it is refused, its session ends; the address back -> the same id
serves again; the DNS server silent or failing -> the daemon keeps serving and shows the
error; ``simplerctl workers`` shows the view.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from simpler_daemon.client import Client
from simpler_daemon.client.requests import task
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from tests.support.daemon_harness import REPO, DaemonProcess, running_daemon
from tests.support.dns_server import DnsServer
from tests.support.remote_harness import (
    PORT,
    RemoteHosts,
    remote_hosts,
    runner_processes,
    wait_until,
)
from tests.support.remote_worker import RemoteWorkerProcess

pytestmark = pytest.mark.timeout(240)

NAME = "workers.discovery.test"
BLOCK = "tests.support.l3_jobs:block_remote"
NOOP = "tests.support.l3_jobs:noop_remote"
CALLABLES = [{"target": BLOCK, "kind": "orchestration"}, {"target": NOOP, "kind": "orchestration"}]
SESSION = {"num_sub_workers": 1, "heap_bytes": 4 << 20, "session_timeout_s": 10.0}


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[RemoteHosts]:
    (tmp_path / "hosts").mkdir()
    with remote_hosts(tmp_path / "hosts", n=3) as h:
        yield h


def config(h: RemoteHosts, dns: DnsServer) -> dict[str, dict[str, Any]]:
    return {
        "daemon": {"level": 4, "startup_timeout": 30.0},
        "workers": {
            "num_sub_workers": 0,
            "num_chips": 0,
            # Host 2 is a static worker too: discovery must leave its address to it.
            "remote": [{"endpoint": h.endpoint(2), **SESSION, "callables": CALLABLES}],
            "discovery": {
                "dns": f"{NAME}:{PORT}",
                "refresh_s": 0.3,
                "nameserver": dns.address,
                **SESSION,
                "callables": CALLABLES,
            },
        },
        "callables": {"allowed_modules": ["simpler_daemon.examples", "tests"]},
        "reconnect": {"initial_s": 0.2, "max_s": 1.0},
    }


def addresses(c: Client) -> dict[str, tuple[int, str, str]]:
    return {d.address: (d.worker_id, d.state, d.message) for d in c.discovery().addresses}


def wait_states(c: Client, want: dict[str, str], what: str) -> dict[str, tuple[int, str, str]]:
    def ok() -> dict[str, tuple[int, str, str]] | None:
        seen = addresses(c)
        if all(seen.get(a, (0, "", ""))[1] == s for a, s in want.items()):
            return seen
        return None

    return wait_until(ok, 60.0, lambda: f"{what}: discovery shows {addresses(c)}, want {want}")


def remote_row(c: Client, wid: int) -> pb.WorkerInfo:
    (row,) = [w for w in c.list_workers() if w.worker_id == wid and w.HasField("remote")]
    return row


def sessions() -> set[str]:
    """The session ids of the runners alive on the hosts (their process titles)."""
    out = set()
    for title in runner_processes().values():
        if "session: session " in title:
            out.add(title.split("session: session ")[1].split(":")[0].strip())
    return out


def run_on(c: Client, hashid: str, wid: int, ms: int = 0) -> int:
    tasks = [task("next_level", hashid, [pb.Args(scalars=[ms])], workers=[wid])]
    return c.submit_run(tasks).run_id


@pytest.mark.slow
def test_discovery_adds_retires_and_revives_workers(tmp_path: Path, hosts: RemoteHosts) -> None:
    ep = [hosts.endpoint(i) for i in range(3)]
    ip = [e.rpartition(":")[0] for e in ep]
    with DnsServer() as dns:
        dns.set(NAME, ip)
        with running_daemon(tmp_path / "daemon", config(hosts, dns)) as d, d.client() as c:
            # Added: both new addresses become workers (ids after the static one, 0).
            seen = wait_states(c, {ep[0]: "active", ep[1]: "active", ep[2]: "static"}, "start")
            assert seen[ep[2]][0] == 0
            wid = {i: seen[ep[i]][0] for i in (0, 1)}
            assert sorted(wid.values()) == [1, 2]
            view = c.discovery()
            assert view.dns == f"{NAME}:{PORT}" and view.error == ""
            assert view.resolver == f"the DNS server {dns.address}"
            assert view.last_resolve_unix > 0 and view.resolutions >= 1
            # One session per host: the static address was not opened twice.
            remotes = [w for w in c.list_workers() if w.HasField("remote")]
            assert sorted(w.endpoint for w in remotes) == sorted(ep), remotes
            assert all(w.remote.state == pb.REMOTE_SESSION_STATE_READY for w in remotes)

            block = c.register(BLOCK, kind="orchestration")
            noop = c.register(NOOP, kind="orchestration")
            for w in (0, wid[0], wid[1]):
                status = c.wait_run(run_on(c, noop, w), timeout=60)
                assert status.state.name == "COMPLETED", (w, status)

            # Removed: host 1's running task fails naming it, the one queued behind it is
            # refused, new work for it too; its session ends; the others go on.
            live = sessions()
            assert len(live) == 3, live
            running = run_on(c, block, wid[1], ms=60_000)
            queued = run_on(c, noop, wid[1])
            wait_until(
                lambda: remote_row(c, wid[1]).state == pb.WORKER_STATE_BUSY,
                30.0,
                lambda: f"worker {wid[1]} never busy: {remote_row(c, wid[1])}",
            )
            dns.set(NAME, [ip[0], ip[2]])
            wait_states(c, {ep[1]: "retired"}, "after removal")
            first = c.wait_run(running, timeout=30)
            assert first.state.name == "FAILED", first
            assert first.error is not None and first.error.outcome == "ENDPOINT_FAILURE"
            assert ep[1] in first.error.message and "retired" in first.error.message
            assert f"{ip[1]} is no longer in the answer for {NAME}:{PORT}" in first.error.message
            second = c.wait_run(queued, timeout=30)
            assert second.state.name == "FAILED", second
            assert second.error is not None and f"worker {wid[1]} is gone" in second.error.message
            assert ip[1] in second.error.message
            later = c.wait_run(run_on(c, noop, wid[1]), timeout=30)
            assert later.state.name == "FAILED" and later.error is not None
            assert f"worker {wid[1]} is gone" in later.error.message
            row = remote_row(c, wid[1])
            assert row.remote.state == pb.REMOTE_SESSION_STATE_RETIRED, row
            assert ip[1] in row.message
            wait_until(
                lambda: len(sessions()) == 2 and sessions() < live,
                30.0,
                lambda: f"the retired session's runner lives on: {runner_processes()}",
            )
            assert c.get_info().serving_state == pb.SERVING_STATE_SERVING
            assert c.wait_run(run_on(c, noop, wid[0]), timeout=60).state.name == "COMPLETED"

            # Back: the same id serves again.
            dns.set(NAME, ip)
            seen = wait_states(c, {ep[1]: "active"}, "after the address came back")
            assert seen[ep[1]][0] == wid[1]
            assert remote_row(c, wid[1]).remote.state == pb.REMOTE_SESSION_STATE_READY
            assert c.wait_run(run_on(c, noop, wid[1]), timeout=60).state.name == "COMPLETED"

            # The resolver down: the daemon keeps serving with the workers it has.
            before = c.discovery().failures
            dns.mode = "silent"
            wait_until(
                lambda: "no reply within" in c.discovery().error,
                60.0,
                lambda: f"no resolver error shown: {c.discovery()}",
            )
            dns.mode = "servfail"
            wait_until(
                lambda: "SERVFAIL" in c.discovery().error,
                30.0,
                lambda: f"no SERVFAIL shown: {c.discovery()}",
            )
            assert c.discovery().failures > before
            assert c.get_info().serving_state == pb.SERVING_STATE_SERVING
            assert {a: s for a, (_, s, _) in addresses(c).items()} == {
                ep[0]: "active",
                ep[1]: "active",
                ep[2]: "static",
            }
            assert c.wait_run(run_on(c, noop, wid[1]), timeout=60).state.name == "COMPLETED"
            dns.mode = "answer"
            wait_until(lambda: c.discovery().error == "", 30.0, lambda: str(c.discovery()))

            # simplerctl shows the view.
            ctl = [sys.executable, "-m", "simpler_daemon.cli", "--socket", d.socket]
            out = subprocess.run(
                [*ctl, "workers"], cwd=REPO, capture_output=True, text=True, timeout=60
            )
            assert out.returncode == 0, out.stderr
            assert f"discovery: {NAME}:{PORT} via the DNS server {dns.address}" in out.stdout
            assert ep[1] in out.stdout and "static" in out.stdout
            out = subprocess.run(
                [*ctl, "--json", "discovery"], cwd=REPO, capture_output=True, text=True, timeout=60
            )
            assert out.returncode == 0, out.stderr
            view = json.loads(out.stdout)
            assert view["dns"] == f"{NAME}:{PORT}"
            states = {a["address"]: (a["worker_id"], a["state"]) for a in view["addresses"]}
            assert states == {
                ep[0]: (wid[0], "active"),
                ep[1]: (wid[1], "active"),
                ep[2]: (0, "static"),
            }
        log = d.stderr() + d.stdout()
        assert f"discovery: {ep[1]} left the answer: retired remote worker {wid[1]}" in log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_discovery_never_holds_up_start_and_shows_errors(tmp_path: Path) -> None:
    """No host needed: a silent DNS server at start (READY anyway), an address nobody
    listens on (kept "opening" with the error, retried), NXDOMAIN (no addresses)."""
    metrics = f"127.0.0.1:{free_port()}"
    with DnsServer() as dns:
        dns.mode = "silent"
        overrides = {
            "daemon": {"level": 4},
            "workers": {
                "num_sub_workers": 1,
                "num_chips": 0,
                "discovery": {
                    "dns": f"{NAME}:{free_port()}",
                    "refresh_s": 0.2,
                    "nameserver": dns.address,
                    "session_timeout_s": 5.0,
                },
            },
            "metrics": {"listen": metrics},
        }
        with running_daemon(tmp_path / "daemon", overrides) as d, d.client() as c:
            assert c.get_info().serving_state == pb.SERVING_STATE_SERVING
            wait_until(
                lambda: "no reply within" in c.discovery().error,
                60.0,
                lambda: f"no resolver error shown: {c.discovery()}",
            )
            view = c.discovery()
            assert view.failures >= 1 and view.last_success_unix == 0 and not view.addresses
            # An address where nothing listens: kept with its error, retried.
            dns.mode = "answer"
            dns.set(NAME, ["127.0.0.1"])
            wait_until(
                lambda: any("refused" in d.message for d in c.discovery().addresses),
                60.0,
                lambda: f"no open error shown: {c.discovery()}",
            )
            (entry,) = c.discovery().addresses
            assert entry.state == "opening" and entry.worker_id == 0, entry
            assert "tried again at the next resolution" in entry.message
            assert not [w for w in c.list_workers() if w.HasField("remote")]
            # NXDOMAIN: the name has no addresses now (an answer, not an outage).
            dns.records.clear()
            wait_until(
                lambda: (
                    "NXDOMAIN" in c.discovery().error
                    and c.discovery().addresses[0].state == "retired"
                ),
                60.0,
                lambda: f"NXDOMAIN not applied: {c.discovery()}",
            )
            with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
                text = reply.read().decode()
            assert "simpler_discovery_resolutions_total" in text
            assert 'simpler_discovery_workers{state="retired"} 1.0' in text
            assert "simpler_discovery_last_resolve_timestamp_seconds" in text
            assert "simpler_discovery_addresses 0.0" in text  # NXDOMAIN: no addresses
            assert c.get_info().serving_state == pb.SERVING_STATE_SERVING


def test_discovery_credentials_that_cannot_be_read_stop_the_start(tmp_path: Path) -> None:
    """Every session would fail: the daemon refuses to start (exit 2) naming the key."""
    missing = tmp_path / "no-such-token"
    overrides = {
        "daemon": {"level": 4},
        "workers": {
            "num_sub_workers": 1,
            "num_chips": 0,
            "discovery": {"dns": f"{NAME}:{PORT}", "token_file": str(missing)},
        },
    }
    d = DaemonProcess(tmp_path / "daemon", overrides)
    with pytest.raises(RuntimeError, match="exited with 2") as info:
        d.start()
    assert f"workers.discovery.token_file: cannot read '{missing}'" in str(info.value)
    d.kill()


@pytest.mark.slow
def test_discovery_with_the_system_resolver(tmp_path: Path) -> None:
    """No nameserver: getaddrinfo (in the executor) resolves the name; here "localhost",
    which /etc/hosts maps to the loopback worker's address."""
    remote = RemoteWorkerProcess(tmp_path)
    try:
        port = int(remote.address.rpartition(":")[2])
        overrides = {
            "daemon": {"level": 4},
            "workers": {
                "num_sub_workers": 1,
                "num_chips": 0,
                "discovery": {"dns": f"localhost:{port}", "refresh_s": 0.5, **SESSION},
            },
        }
        with running_daemon(tmp_path / "daemon", overrides) as d, d.client() as c:
            seen = wait_states(c, {f"127.0.0.1:{port}": "active"}, "system resolver")
            assert c.discovery().resolver == "the system resolver (getaddrinfo)"
            wid = seen[f"127.0.0.1:{port}"][0]
            row = remote_row(c, wid)
            assert row.remote.state == pb.REMOTE_SESSION_STATE_READY, row
            # An IPv6 answer for localhost (where /etc/hosts has one) finds nobody there:
            # kept "opening" with its error; the IPv4 worker serves regardless.
            others = {a: s for a, (_, s, _) in addresses(c).items() if a.startswith("[")}
            assert set(others.values()) <= {"opening"}, others
    finally:
        remote.stop()
