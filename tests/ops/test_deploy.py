"""deploy/: the example config documents every option and loads; the units are valid."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from simpler_daemon.server import config as cfg

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EXAMPLE = DEPLOY / "config" / "daemon.toml"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))

# The settings the example changes for the systemd unit; everything else is the default.
DEPLOYMENT = {"daemon.runtime_dir": "/run/simpler-daemon"}

_SECTION = re.compile(r"^\[(\w+)\]\s*$")
# A sub-table shown commented out, e.g. "# [workers.discovery]".
_SUBTABLE = re.compile(r"^#\s?\[(\w+\.\w+)\]\s*$")
_DEFAULT_LINE = re.compile(r"^#\s?([a-z_]+) = (.+)$")
_ACTIVE_LINE = re.compile(r"^([a-z_]+)\s*=\s*(.+)$")


def example_lines() -> tuple[dict[str, list[str]], dict[str, str]]:
    """``# key = default`` lines per dotted key, and active ``key = value`` lines."""
    defaults: dict[str, list[str]] = {}
    active: dict[str, str] = {}
    section = ""
    for line in EXAMPLE.read_text().splitlines():
        if m := _SECTION.match(line) or _SUBTABLE.match(line):
            section = m[1]
        elif m := _DEFAULT_LINE.match(line):
            defaults.setdefault(f"{section}.{m[1]}", []).append(m[2])
        elif m := _ACTIVE_LINE.match(line):
            active[f"{section}.{m[1]}"] = m[2]
    return defaults, active


def all_options() -> dict[str, Any]:
    """Every option with a literal default (one that depends on the level, None here, is
    documented in prose instead)."""
    default = cfg.DaemonConfig()
    options: dict[str, Any] = {}
    for section in msgspec.structs.fields(cfg.DaemonConfig):
        for f in msgspec.structs.fields(section.type):
            value = getattr(getattr(default, section.name), f.name)
            if isinstance(value, msgspec.Struct):  # a sub-table: [workers.discovery]
                for sub in msgspec.structs.fields(value):
                    options[f"{section.name}.{f.name}.{sub.name}"] = getattr(value, sub.name)
            else:
                options[f"{section.name}.{f.name}"] = value
    return {k: v for k, v in options.items() if v is not None}


def test_example_documents_every_option_with_its_default() -> None:
    defaults, _ = example_lines()
    options = all_options()
    assert set(defaults) == set(options), "options missing or unknown in the example"
    for key, texts in defaults.items():
        assert len(texts) == 1, f"{key} is listed twice"
        value = tomllib.loads(f"v = {texts[0]}")["v"]
        assert value == options[key], f"{key}: the example says {texts[0]}"


def test_example_loads_and_equals_defaults_except_deployment_settings() -> None:
    _, active = example_lines()
    assert {k: tomllib.loads(f"v = {v}")["v"] for k, v in active.items()} == DEPLOYMENT
    overrides: dict[str, object] = dict(DEPLOYMENT)
    assert cfg.load(EXAMPLE, env={}) == cfg.load(None, env={}, overrides=overrides)


def unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True, comment_prefixes=("#",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


def test_daemon_unit_settings() -> None:
    service = unit(DEPLOY / "systemd" / "simpler-daemon.service")["Service"]
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "ExecStart": "/usr/local/bin/simpler-daemon serve --config /etc/simpler-daemon/daemon.toml",
        "WatchdogSec": "30",
        "KillMode": "mixed",
        "TimeoutStopSec": "60",
        "RuntimeDirectory": "simpler-daemon",
        "RuntimeDirectoryMode": "0750",
        "StateDirectory": "simpler-daemon",
        "StateDirectoryMode": "0700",
        "Restart": "on-failure",
        "RestartPreventExitStatus": "2 3",
        "User": "simpler",
        "Group": "simpler",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectControlGroups": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "LockPersonality": "yes",
    }
    for key, value in expected.items():
        assert service.get(key) == value, key
    # fork + /dev/shm + numpy: these would break the daemon.
    assert "MemoryDenyWriteExecute" not in service
    assert "PrivateDevices" not in service
    # The socket directory the unit creates is the one the example config uses.
    assert "/run/" + service["RuntimeDirectory"] == DEPLOYMENT["daemon.runtime_dir"]
    # systemd waits longer than the daemon's own drain before it SIGKILLs.
    assert float(service["TimeoutStopSec"]) > cfg.DaemonConfig().daemon.shutdown_grace


def test_remote_worker_unit_settings() -> None:
    service = unit(DEPLOY / "systemd" / "simpler-remote-worker.service")["Service"]
    assert service["ExecStart"].startswith("/usr/local/bin/simpler-remote-worker")
    assert service["KillMode"] == "mixed"
    assert service["User"] == "simpler"
    assert "MemoryDenyWriteExecute" not in service
    assert "PrivateDevices" not in service


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not found")
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    # The binaries are not installed here: verify copies whose ExecStart runs
    # /bin/true with the same arguments, so "not executable" cannot hide
    # anything; every other message (unknown key, bad value) fails the test.
    true = shutil.which("true") or "/bin/true"
    copies = []
    for path in UNITS:
        text = re.sub(r"^ExecStart=\S+", f"ExecStart={true}", path.read_text(), flags=re.M)
        copy = tmp_path / path.name
        copy.write_text(text)
        copies.append(str(copy))
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *copies],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not output, output


needs_root_tools = pytest.mark.skipif(
    os.geteuid() != 0
    or shutil.which("systemd-sysusers") is None
    or shutil.which("systemd-tmpfiles") is None,
    reason="needs root and systemd-sysusers/systemd-tmpfiles",
)


@needs_root_tools
def test_sysusers_and_tmpfiles_apply_to_a_scratch_root(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    sysusers = DEPLOY / "sysusers.d" / "simpler-daemon.conf"
    tmpfiles = DEPLOY / "tmpfiles.d" / "simpler-daemon.conf"
    for command in (
        ["systemd-sysusers", f"--root={tmp_path}", str(sysusers)],
        ["systemd-tmpfiles", f"--root={tmp_path}", "--create", str(tmpfiles)],
    ):
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stderr
    assert "simpler:" in (tmp_path / "etc" / "passwd").read_text()
    for name, mode in [("run/simpler-daemon", 0o750), ("etc/simpler-daemon", 0o750)]:
        path = tmp_path / name
        assert path.is_dir(), name
        assert path.stat().st_mode & 0o777 == mode, name
