"""sd_notify client against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from collections.abc import Iterator

import pytest

from simpler_daemon.system.notify import SystemdNotifier


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket (short path: sun_path holds 107 bytes) and its address."""
    with tempfile.TemporaryDirectory(prefix="sdn-") as directory:
        path = os.path.join(directory, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.settimeout(5.0)
        sock.bind(path)
        try:
            yield sock, path
        finally:
            sock.close()


def test_messages_reach_the_socket(notify_socket: tuple[socket.socket, str]) -> None:
    server, path = notify_socket
    with SystemdNotifier.from_env({"NOTIFY_SOCKET": path}) as notifier:
        assert notifier.enabled
        assert notifier.ready("serving on /run/simpler-daemon/daemon.sock")
        assert server.recv(4096) == b"READY=1\nSTATUS=serving on /run/simpler-daemon/daemon.sock"
        assert notifier.watchdog()
        assert server.recv(4096) == b"WATCHDOG=1"
        assert notifier.status("draining 3 runs")
        assert server.recv(4096) == b"STATUS=draining 3 runs"
        assert notifier.stopping()
        assert server.recv(4096) == b"STOPPING=1"
        assert notifier.ready()
        assert server.recv(4096) == b"READY=1"
        assert notifier.extend_timeout(2.5)
        assert server.recv(4096) == b"EXTEND_TIMEOUT_USEC=2500000"
        assert notifier.notify(STATUS="two\nlines", ERRNO=5, READY=True)
        assert server.recv(4096) == b"STATUS=two lines\nERRNO=5\nREADY=1"
    assert notifier.closed
    assert not notifier.enabled
    assert not notifier.watchdog()


def test_abstract_socket() -> None:
    name = f"simpler-test-notify-{os.getpid()}-{os.urandom(4).hex()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.settimeout(5.0)
    server.bind("\0" + name)
    try:
        notifier = SystemdNotifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready("up")
        assert server.recv(4096) == b"READY=1\nSTATUS=up"
        notifier.close()
        notifier.close()  # idempotent
    finally:
        server.close()


@pytest.mark.parametrize("env", [{}, {"NOTIFY_SOCKET": ""}, {"NOTIFY_SOCKET": "vsock:2:1234"}])
def test_disabled_without_a_usable_socket(env: dict[str, str]) -> None:
    notifier = SystemdNotifier.from_env(env)
    assert not notifier.enabled
    assert not notifier.ready("x")
    assert not notifier.watchdog()
    assert not notifier.stopping()
    notifier.close()


def test_send_errors_never_raise_and_log_once(caplog: pytest.LogCaptureFixture) -> None:
    notifier = SystemdNotifier("/nonexistent/simpler-notify")
    with caplog.at_level(logging.DEBUG, logger="simpler_daemon.server.notify"):
        assert not notifier.ready("x")
        assert not notifier.watchdog()
        assert not notifier.stopping()
    failures = [r for r in caplog.records if "cannot notify systemd" in r.getMessage()]
    assert len(failures) == 1
    assert failures[0].levelno == logging.DEBUG
    notifier.close()


def test_socket_is_close_on_exec(notify_socket: tuple[socket.socket, str]) -> None:
    server, path = notify_socket
    notifier = SystemdNotifier(path)
    assert notifier.watchdog()
    server.recv(64)
    sock = notifier._sock
    assert sock is not None and not sock.get_inheritable()
    notifier.close()
    assert notifier._sock is None


@pytest.mark.parametrize(
    ("env", "interval"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": str(os.getpid())}, 0.5),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "nope"}, 1.0),
    ],
)
def test_watchdog_interval(env: dict[str, str], interval: float | None) -> None:
    notifier = SystemdNotifier.from_env(env)
    assert notifier.watchdog_interval() == interval
    assert notifier.ping_period() == (None if interval is None else interval / 2)


def test_from_env_can_unset_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    notifier = SystemdNotifier.from_env(unset=True)
    assert notifier.enabled
    assert notifier.watchdog_interval() == 2.0
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        assert name not in os.environ
    notifier.close()
