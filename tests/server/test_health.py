"""Health tells the truth: a worker pool without capacity turns the daemon NOT_SERVING.

The state machine (``HealthState``) runs against a fake clock; the daemon tests kill
real children: first every fork server (each death may start a successor, up to the
restart bound), so nothing can be replaced any more, then the workers of one pool.
gRPC health, GetInfo, ``simplerctl info``, the metrics, the log and the systemd
notify socket (WATCHDOG=1 pings) must all say so, and a level-4 daemon whose L3
pool came back through AddRemoteWorker serves again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from simpler_daemon.client import Client
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server.health import HealthState, PoolDown, pools_down
from simpler_daemon.testing import alive
from tests.support.daemon_harness import REPO, DaemonProcess, tree_pids, wait_until
from tests.support.remote_worker import RemoteWorkerProcess

Health = health_pb2.HealthCheckResponse

# --------------------------------------------------------------------------- the state machine


def test_state_goes_unhealthy_stops_pings_after_the_bound_and_recovers() -> None:
    state = HealthState(exit_after=60.0)
    down = [PoolDown("sub", "no SUB worker left")]
    assert state.observe([], 0.0) == [] and state.healthy
    assert state.observe(down, 10.0) == ["unhealthy"]
    assert not state.healthy and state.reason == "no SUB worker left"
    assert state.down == {"sub"}
    assert state.observe(down, 69.9) == [] and not state.pings_stopped
    assert state.observe(down, 70.0) == ["pings_stopped"] and state.pings_stopped
    assert state.observe(down, 500.0) == []  # once
    assert state.observe([], 501.0) == ["healthy"]
    assert state.healthy and not state.pings_stopped and state.down == frozenset()
    # The bound counts from the latest transition, not the first.
    assert state.observe(down, 600.0) == ["unhealthy"]
    assert state.observe(down, 659.0) == []


def test_state_reports_another_pool_and_zero_means_never() -> None:
    state = HealthState(exit_after=0.0)
    sub, chip = PoolDown("sub", "a"), PoolDown("chip", "b")
    assert state.observe([sub], 0.0) == ["unhealthy"]
    assert state.observe([sub, chip], 1.0) == ["changed"] and state.reason == "a; b"
    assert state.observe([sub, chip], 1e9) == [] and not state.pings_stopped


def test_state_can_stop_the_pings_at_the_first_check() -> None:
    state = HealthState(exit_after=1e-9)
    assert state.observe([PoolDown("sub", "x")], 5.0) == ["unhealthy"]
    assert state.observe([PoolDown("sub", "x")], 5.1) == ["pings_stopped"]


def test_state_keeps_pinging_while_the_pool_down_is_reconnecting() -> None:
    """A level-4 daemon whose every L3 worker reconnects cannot serve (NOT_SERVING),
    but a restart would not bring its remote hosts back: the pings go on until a pool
    is down with nothing coming back."""
    state = HealthState(exit_after=10.0)
    reconnecting = PoolDown("l3", "no L3 worker can take work", recovering=True)
    assert state.observe([reconnecting], 0.0) == ["unhealthy"]
    assert state.observe([reconnecting], 1000.0) == [] and not state.pings_stopped
    given_up = PoolDown("l3", "no L3 worker left", recovering=False)
    assert state.observe([given_up], 1001.0) == []  # same pool; the bound starts now
    assert state.observe([given_up], 1010.5) == []
    assert state.observe([given_up], 1011.0) == ["pings_stopped"]


class _Lane:
    def __init__(self, gone: str | None) -> None:
        self.gone = gone


class _Manager:
    def __init__(self, sub: list[_Lane], next_level: list[_Lane]) -> None:
        self.started = True
        self.sub = sub
        self.next_level = dict(enumerate(next_level))


def test_a_pool_is_down_only_when_every_lane_is_given_up() -> None:
    gone, replacing = _Lane("sub worker 0 stays down"), _Lane(None)
    assert pools_down(_Manager([gone, replacing], []), 3) == []  # one is being replaced
    assert pools_down(_Manager([], []), 3) == []  # no pool configured: not down
    assert pools_down(None, 3) == []
    (down,) = pools_down(_Manager([gone, _Lane("y")], [replacing]), 3)
    assert down.pool == "sub"
    assert down.reason.startswith("no SUB worker left: all 2 SUB workers are down")
    assert "(sub worker 0 stays down)" in down.reason
    (down,) = pools_down(_Manager([replacing], [_Lane("session lost")]), 4)
    assert down.pool == "l3" and down.reason.startswith("no L3 worker left: the L3 worker is")
    (down,) = pools_down(_Manager([], [_Lane("chip died")]), 3)
    assert down.pool == "chip" and not down.recovering
    # Remote workers between reconnect attempts: down now, coming back.
    from simpler_daemon.engine.remote_reconnect import Reconnecting

    waiting = _Lane(Reconnecting("remote worker 1 failed; reconnecting: next try in 2.0 s"))
    (down,) = pools_down(_Manager([replacing], [waiting, _Lane("session lost")]), 4)
    assert down.recovering and down.reason.startswith(
        "no L3 worker can take work: all 2 L3 workers are down, 1 of them reconnecting"
    )


def test_retired_remote_workers_are_no_capacity_lost() -> None:
    """DNS discovery retired them on purpose: an L3 pool of only retired lanes is not
    down (the name answers that there is no worker now); with a failed one beside, the
    failed one alone decides."""
    from simpler_daemon.engine.remote_reconnect import Retired

    retired = _Lane(Retired("10.0.0.5 is no longer in the answer for w.svc:19073"))
    assert pools_down(_Manager([], [retired, retired]), 4) == []
    (down,) = pools_down(_Manager([], [retired, _Lane("session lost")]), 4)
    assert down.reason.startswith("no L3 worker left: the L3 worker is down"), down.reason


# --------------------------------------------------------------------------- real daemons


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> set[int]:
    """Live children of ``pid``, read from every process's /proc/<pid>/stat."""
    out: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if fields[1] == str(pid) and fields[0] != "Z":
            out.add(int(entry))
    return out


def _kill_every_fork_server(d: DaemonProcess, c: Client) -> None:
    """Kill the daemon's fork servers one by one (each death may start a successor, up to
    the restart bound) until the daemon says no child can be replaced any more."""

    def none_left() -> bool:
        if "children can no longer be replaced" in d.stderr():
            return True
        workers = set(tree_pids(c.list_workers()))
        servers = sorted(_children(d.pid) - workers)
        if servers:
            os.kill(servers[0], signal.SIGKILL)
            wait_until(lambda: not alive(servers[0]), timeout=20)
        return False

    wait_until(none_left, timeout=120, message="fork servers kept coming back")


def _health(d: DaemonProcess) -> int | None:
    """The gRPC health status both service names ("" and the Daemon's) report; None while
    they differ (the daemon sets one after the other)."""
    channel = grpc.insecure_channel(f"unix:{d.socket}")
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        replies = {
            stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            for name in ("", "simpler.daemon.v1.Daemon")
        }
    finally:
        channel.close()
    return replies.pop() if len(replies) == 1 else None


def _metrics(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def _ctl_info(d: DaemonProcess) -> str:
    cmd = [sys.executable, "-m", "simpler_daemon.cli", "--socket", d.socket, "info"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _liveness(port: int) -> int:
    """The "liveness" health name on the plain-text probe port (health.probe_listen)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="liveness")
        return int(stub.Check(request, timeout=10).status)


@contextlib.contextmanager
def _drained(d: DaemonProcess) -> Iterator[None]:
    """Empty the notify socket all along, as systemd does (a datagram socket holds only
    net.unix.max_dgram_qlen messages: a full one would cost the daemon its pings, and
    the test what it looks for). Read ``d.notify.messages`` meanwhile."""
    stop = threading.Event()

    def drain() -> None:
        while not stop.wait(0.02):
            d.notify.drain()

    thread = threading.Thread(target=drain, name="notify-drain")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def _statuses(d: DaemonProcess, prefix: str) -> bool:
    return any(m.get("STATUS", "").startswith(prefix) for m in list(d.notify.messages))


def _after(messages: list[dict[str, str]], key: str, prefix: str) -> list[dict[str, str]]:
    """The notify messages after the first whose ``key`` starts with ``prefix``."""
    for i, m in enumerate(messages):
        if m.get(key, "").startswith(prefix):
            return messages[i + 1 :]
    raise AssertionError(f"no {key}={prefix}... among {messages}")


@pytest.fixture
def stopped_at_end() -> Iterator[list[DaemonProcess]]:
    """Daemons the test started: SIGTERMed (exit 0 asserted) at the end."""
    daemons: list[DaemonProcess] = []
    yield daemons
    for d in daemons:
        try:
            code = d.stop(timeout=30)
        finally:
            d.kill()
        assert code == 0, d.stderr()
        d.children_gone(timeout=20)


@pytest.mark.timeout(240)
def test_no_sub_worker_left_turns_not_serving_and_stops_the_pings(
    tmp_path: Path, stopped_at_end: list[DaemonProcess]
) -> None:
    port, probe = _free_port(), _free_port()
    overrides: dict[str, dict[str, Any]] = {
        "workers": {"num_sub_workers": 1, "num_chips": 0},
        "metrics": {"listen": f"127.0.0.1:{port}"},
        "health": {"unhealthy_exit_s": 1.0, "probe_listen": f"127.0.0.1:{probe}"},
    }
    d = DaemonProcess(tmp_path / "d", overrides, env={"WATCHDOG_USEC": "400000"})
    stopped_at_end.append(d)
    d.start()
    wait_until(lambda: d.notify.seen("WATCHDOG", "1"), message="no WATCHDOG=1 ping")
    assert _health(d) == Health.SERVING
    assert _liveness(probe) == Health.SERVING
    body = _metrics(port)
    assert "simpler_daemon_serving 1.0" in body
    assert 'simpler_daemon_worker_pool_down{pool="sub"} 0.0' in body

    with d.client() as c, _drained(d):
        _kill_every_fork_server(d, c)
        # Still serving: the SUB worker lives, it just cannot be replaced any more.
        assert _health(d) == Health.SERVING
        (sub,) = [w for w in c.list_workers() if w.kind == pb.WORKER_KIND_SUB]
        os.kill(sub.pid, signal.SIGKILL)

        wait_until(lambda: _health(d) == Health.NOT_SERVING, timeout=30, message="still SERVING")
        info = c.get_info()
        assert info.serving_state == pb.SERVING_STATE_UNHEALTHY
        assert info.serving_reason.startswith("no SUB worker left: the SUB worker is down"), info
        shown = _ctl_info(d)
        assert "state:    UNHEALTHY" in shown and "health:   no SUB worker left" in shown, shown
        body = _metrics(port)
        assert "simpler_daemon_serving 0.0" in body
        assert 'simpler_daemon_worker_pool_down{pool="sub"} 1.0' in body

        # After health.unhealthy_exit_s the pings stop, and say so on the notify socket.
        stopped = "unhealthy, watchdog pings stopped: no SUB worker left"
        wait_until(lambda: _statuses(d, stopped), timeout=30)
        # Ten ping periods without a ping (an observation window: more load only
        # means fewer periods in it, never a ping that should not be there).
        window_end = time.monotonic() + 4.0
        wait_until(lambda: time.monotonic() > window_end, timeout=30)
        late = _after(list(d.notify.messages), "STATUS", stopped)
        assert not [m for m in late if "WATCHDOG" in m], late
        assert _health(d) == Health.NOT_SERVING  # the loop itself still answers
        # Liveness follows the pings (published before the status above is sent): a
        # liveness probe restarts the daemon now, not while a drain or a reconnect
        # makes it unready (tests/server/test_health_probe.py).
        assert _liveness(probe) == Health.NOT_SERVING

    log = d.stderr()
    assert log.count("unhealthy, gRPC health NOT_SERVING: no SUB worker left") == 1, log
    assert log.count("watchdog pings stopped, systemd restarts the daemon") == 1, log


@pytest.mark.timeout(240)
def test_level4_without_l3_workers_recovers_when_one_is_added(
    tmp_path: Path, stopped_at_end: list[DaemonProcess]
) -> None:
    remote = RemoteWorkerProcess(tmp_path)
    try:
        overrides: dict[str, dict[str, Any]] = {
            "daemon": {"level": 4},
            "workers": {
                "num_sub_workers": 1,
                "local": [{"num_sub_workers": 1, "heap_bytes": 4 << 20}],
            },
            "health": {"unhealthy_exit_s": 0.5},
        }
        d = DaemonProcess(tmp_path / "d", overrides, env={"WATCHDOG_USEC": "400000"})
        stopped_at_end.append(d)
        d.start()
        with d.client() as c, _drained(d):
            assert _health(d) == Health.SERVING
            _kill_every_fork_server(d, c)
            (l3,) = [w for w in c.list_workers() if w.kind == pb.WORKER_KIND_NESTED_L3]
            os.kill(l3.pid, signal.SIGKILL)
            wait_until(lambda: _health(d) == Health.NOT_SERVING, timeout=30)
            info = c.get_info()
            assert info.serving_state == pb.SERVING_STATE_UNHEALTHY
            assert info.serving_reason.startswith("no L3 worker left"), info
            stopped = "unhealthy, watchdog pings stopped: no L3 worker left"
            wait_until(lambda: _statuses(d, stopped), timeout=30)

            # Capacity returns: a remote L3 worker joins.
            c.add_remote_worker(remote.address, num_sub_workers=1, heap_bytes=4 << 20)
            wait_until(lambda: _health(d) == Health.SERVING, timeout=30, message="not SERVING")
            info = c.get_info()
            assert info.serving_state == pb.SERVING_STATE_SERVING and not info.serving_reason
            back = "serving: every worker pool has capacity again"
            wait_until(
                lambda: (
                    _statuses(d, back)
                    and any(
                        "WATCHDOG" in m for m in _after(list(d.notify.messages), "STATUS", back)
                    )
                ),
                timeout=30,
                message="the watchdog pings did not resume",
            )
        log = d.stderr()
        assert log.count("unhealthy, gRPC health NOT_SERVING: no L3 worker left") == 1, log
        assert log.count("healthy again: every worker pool has capacity") == 1, log
    finally:
        for d in stopped_at_end:  # before the remote worker goes: its session ends cleanly
            if d.proc is not None and d.proc.poll() is None:
                d.send(signal.SIGTERM)
                d.wait(60)
        remote.stop()
