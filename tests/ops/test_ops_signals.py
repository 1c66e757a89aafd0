"""SIGHUP reloads what can change at run time (RELOADING=1 ... READY=1), logs
what needs a restart by name and keeps the running config when the file is bad; no
common signal leaves a socket or a /dev/shm heap behind. The reload daemon runs with
``JOURNAL_STREAM`` naming its stderr, so its text log is journald's format (no timestamp, a
``<N>`` priority prefix)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from simpler_daemon.testing import leaked_shm, shm_files
from tests.support.daemon_harness import DaemonProcess, merged, wait_until, write_config

SMALL: dict[str, dict[str, Any]] = {"workers": {"num_sub_workers": 1}}


def leftovers(d: DaemonProcess) -> list[str]:
    run_dir = d.dir / "run"
    return sorted(os.listdir(run_dir)) if run_dir.exists() else []


def ready_count(d: DaemonProcess) -> int:
    return sum(1 for m in d.notify.drain() if m.get("READY") == "1")


def hup_and_wait(d: DaemonProcess) -> None:
    before = ready_count(d)
    d.send(signal.SIGHUP)
    wait_until(lambda: ready_count(d) > before, message="no READY=1 after SIGHUP")


def test_sighup_reload_and_the_signals_that_keep_the_daemon(tmp_path: Path) -> None:
    shm_before = shm_files()
    directory = tmp_path / "d"
    directory.mkdir()
    stderr = directory / "stderr.txt"  # the harness reopens it: same inode
    stderr.touch()
    st = stderr.stat()
    d = DaemonProcess(directory, SMALL, env={"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
    try:
        d.start()
        with d.client() as c:
            per_client_runs = c.get_info().limits.per_client_runs

        # A good file: the log level, limits and a setting that cannot change.
        write_config(
            d.config_path,
            merged(
                {
                    "daemon": {"log_level": "debug", "runtime_dir": str(directory / "run")},
                    "workers": {"num_sub_workers": 3},
                    "limits": {"max_task_seconds": 60.0, "per_client_runs": 7},
                }
            ),
        )
        hup_and_wait(d)
        reloading = [m for m in d.notify.messages if m.get("RELOADING") == "1"]
        assert len(reloading) == 1 and int(reloading[0]["MONOTONIC_USEC"]) > 0
        text = wait_until(lambda: "configuration reloaded:" in d.stderr() and d.stderr())
        applied = re.search(r"configuration reloaded: (.*) applied", text)
        assert applied, text
        assert "daemon.log_level" in applied[1] and "limits.max_task_seconds" in applied[1]
        assert re.search(r"<4>WARNING .*need a restart.*workers\.num_sub_workers", text), text
        assert "limits.per_client_runs" in applied[1]
        with d.client() as c:
            assert per_client_runs != 7 and c.get_info().limits.per_client_runs == 7

        # A bad file: an error naming the problem; the running config stays.
        d.config_path.write_text("[daemon]\nlog_level = 'loud'\n")
        hup_and_wait(d)
        text = wait_until(lambda: "cannot reload" in d.stderr() and d.stderr())
        assert re.search(
            r"<3>ERROR simpler_daemon\.daemon: cannot reload the configuration: .*"
            r"daemon\.log_level.*the running one stays",
            text,
        ), text

        # Signals whose default action would kill the daemon (or that Python ignores).
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE):
            d.send(sig)
        wait_until(lambda: "SIGUSR2 received: ignored" in d.stderr())
        with d.client() as c:
            assert c.get_info().pid == d.pid
        assert d.stop(signal.SIGTERM) == 0, d.stderr()
        d.children_gone()
    finally:
        d.kill()
    # journald's format: every line starts with its priority, no timestamp of ours.
    lines = d.stderr().splitlines()
    assert lines and all(re.match(r"<[2-7]>[A-Z]+ \S+: ", line) for line in lines), lines
    assert any(line.startswith("<7>DEBUG ") for line in lines), "log_level reload not applied"
    assert not leftovers(d)
    assert not leaked_shm(shm_before)


@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGINT, 0), (signal.SIGQUIT, 128 + signal.SIGQUIT)]
)
def test_stopping_signals_leave_nothing(tmp_path: Path, sig: int, code: int) -> None:
    shm_before = shm_files()
    d = DaemonProcess(tmp_path / "d", SMALL)
    try:
        d.start()
        assert d.stop(sig) == code, d.stderr()
        d.children_gone()
    finally:
        d.kill()
    assert not leftovers(d)
    assert not leaked_shm(shm_before)


def test_plan_reload_splits_what_a_running_daemon_can_take() -> None:
    from simpler_daemon.server.config import load
    from simpler_daemon.server.reload import plan_reload

    old = load(None, env={}, overrides={"daemon.runtime_dir": "/srv/x"})
    new = load(
        None,
        env={},
        overrides={
            "daemon.runtime_dir": "/srv/x",
            "daemon.log_level": "debug",
            "limits.per_client_runs": 7,
            "limits.max_message_bytes": 1 << 20,
            "callables.allowed_modules": ["simpler_daemon.examples", "mytasks"],
            "grpc.socket_mode": 0o600,
        },
    )
    plan = plan_reload(old, new, service_reloads=True)
    assert plan.applied == [
        "daemon.log_level",
        "limits.per_client_runs",
        "callables.allowed_modules",
    ]
    assert plan.needs_restart == ["grpc.socket_mode", "limits.max_message_bytes"]
    assert plan.config.limits.per_client_runs == 7
    assert plan.config.limits.max_message_bytes == old.limits.max_message_bytes
    assert plan.config.grpc == old.grpc
    # A service that cannot take limits: only the process-wide settings apply.
    plan = plan_reload(old, new, service_reloads=False)
    assert plan.applied == ["daemon.log_level"]
    assert "limits.per_client_runs" in plan.needs_restart


def test_sigterm_during_start_up_rolls_back(tmp_path: Path) -> None:
    """A SIGTERM while the daemon is still starting (a preload that imports slowly)
    stops the start and removes what it made; before, the default action killed the
    daemon and left its heap in /dev/shm."""
    shm_before = shm_files()
    marker = tmp_path / "importing"
    overrides: dict[str, dict[str, Any]] = {
        **SMALL,
        "callables": {
            "allowed_modules": ["simpler_daemon.examples", "tests.support.slow_import"],
            "preload": ["tests.support.slow_import:fn"],
        },
    }
    d = DaemonProcess(
        tmp_path / "d",
        overrides,
        env={"SIMPLER_TEST_IMPORT_MARKER": str(marker), "SIMPLER_TEST_IMPORT_SLEEP": "30"},
    )
    try:
        with pytest.raises(TimeoutError):  # never READY: the import sleeps 30 s
            d.start(timeout=0.5)
        wait_until(marker.exists, timeout=30.0, message="the preload import never began")
        assert d.stop(signal.SIGTERM, timeout=30.0) == 130, d.stderr()
        assert "SIGTERM during start-up: stopped" in d.stderr()
    finally:
        d.kill()
    assert not leftovers(d)
    assert not leaked_shm(shm_before)
