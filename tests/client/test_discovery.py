"""Clients find the daemon's socket where a systemd install puts it, and the
install steps put ``simplerctl`` on PATH; the unit waits for the network only when the
config listens on TCP (or talks to remote workers)."""

from __future__ import annotations

import configparser
import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from simpler_daemon import client
from simpler_daemon.client import discovery

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
VENV = REPO / ".venv"


@contextlib.contextmanager
def listening(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        sock.listen(1)
        yield
    finally:
        sock.close()
        path.unlink(missing_ok=True)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No SIMPLER_DAEMON_SOCKET; XDG_RUNTIME_DIR is an empty directory of the test."""
    monkeypatch.delenv(discovery.ENV_SOCKET, raising=False)
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    user_socket = Path(f"/run/user/{os.geteuid()}/simpler-daemon/daemon.sock")
    if user_socket.exists():
        pytest.skip(f"{user_socket} exists on this host: it would win the search")
    return xdg


def test_client_finds_the_system_socket(
    clean_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unit's socket (/run/simpler-daemon/daemon.sock) is found without any setting
    (the system directory is a test directory here)."""
    system = tmp_path / "system-run"
    monkeypatch.setattr(discovery, "SYSTEM_RUNTIME_DIR", str(system))
    with listening(system / "daemon.sock"):
        assert client.default_target() == str(system / "daemon.sock")
    # Gone: the default configuration's socket again (the user's runtime directory).
    assert client.default_target() == str(clean_env / "simpler-daemon" / "daemon.sock")


def test_search_order(clean_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    system = tmp_path / "system-run"
    monkeypatch.setattr(discovery, "SYSTEM_RUNTIME_DIR", str(system))
    uid = os.geteuid()
    assert discovery.candidates() == [
        str(clean_env / "simpler-daemon" / "daemon.sock"),
        f"/run/user/{uid}/simpler-daemon/daemon.sock",
        str(system / "daemon.sock"),
        f"/tmp/simpler-daemon-{uid}/daemon.sock",
    ]
    with listening(system / "daemon.sock"), listening(clean_env / "simpler-daemon" / "daemon.sock"):
        # The user's own daemon wins over the system's.
        assert discovery.default_target() == str(clean_env / "simpler-daemon" / "daemon.sock")
        monkeypatch.setenv(discovery.ENV_SOCKET, "/elsewhere/d.sock")
        assert discovery.default_target() == "/elsewhere/d.sock"


def test_unit_waits_for_the_network_only_through_the_tcp_drop_in() -> None:
    def parse(path: Path) -> configparser.ConfigParser:
        parser = configparser.ConfigParser(interpolation=None, strict=False)
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        parser.read_string(path.read_text())
        return parser

    unit = parse(DEPLOY / "systemd" / "simpler-daemon.service")
    assert "network-online.target" not in unit["Unit"].get("After", "")
    assert "Wants" not in unit["Unit"]
    assert unit["Service"]["ExecReload"] == "/bin/kill -HUP $MAINPID"
    drop_in = parse(DEPLOY / "systemd" / "simpler-daemon.service.d" / "network-online.conf")
    assert drop_in["Unit"]["Wants"] == "network-online.target"
    assert drop_in["Unit"]["After"] == "network-online.target"


def _install(root: Path, config: str | None = None) -> subprocess.CompletedProcess[str]:
    if config is not None:
        target = root / "etc" / "simpler-daemon" / "daemon.toml"
        target.parent.mkdir(parents=True)
        target.write_text(config)
    return subprocess.run(
        [str(DEPLOY / "install.sh"), "--root", str(root), "--venv", str(VENV)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_install_puts_the_programs_on_path(tmp_path: Path) -> None:
    root = tmp_path / "root"
    done = _install(root)
    assert done.returncode == 0, done.stderr
    bindir = root / "usr" / "local" / "bin"
    for program in ("simpler-daemon", "simplerctl", "simpler-remote-worker"):
        assert os.access(bindir / program, os.X_OK), program
    version = subprocess.run(
        ["simplerctl", "--help"],
        env={**os.environ, "PATH": f"{bindir}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert version.returncode == 0, version.stderr
    for path in (
        "etc/systemd/system/simpler-daemon.service",
        "etc/simpler-daemon/daemon.toml",
        "usr/lib/sysusers.d/simpler-daemon.conf",
        "usr/lib/tmpfiles.d/simpler-daemon.conf",
    ):
        assert (root / path).is_file(), path
    # The example config has no TCP listener: no wait for network-online.target.
    assert not (root / "etc/systemd/system/simpler-daemon.service.d/network-online.conf").exists()


def test_install_adds_the_network_drop_in_for_a_tcp_listener(tmp_path: Path) -> None:
    root = tmp_path / "root"
    config = (
        '[daemon]\nruntime_dir = "/run/simpler-daemon"\n[grpc]\ntcp_listen = "10.77.0.1:50051"\n'
        'tls_cert = "/etc/simpler-daemon/cert.pem"\ntls_key = "/etc/simpler-daemon/key.pem"\n'
        'token_file = "/etc/simpler-daemon/token"\n'
    )
    done = _install(root, config)
    assert done.returncode == 0, done.stderr
    assert (root / "etc/systemd/system/simpler-daemon.service.d/network-online.conf").is_file()
    # An operator's config is never overwritten.
    assert (root / "etc/simpler-daemon/daemon.toml").read_text() == config
