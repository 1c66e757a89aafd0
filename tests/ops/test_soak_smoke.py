"""The 60 s smoke of the soak (``make soak`` runs it for 300 s): a real daemon under random
kills of its children and fork server, two clients, every run verified; then client
churn, daemon restarts and remote host blips, each phase ending with references, buffers, queued runs,
fds and RSS back where they were and every run accounted for; no leak."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from simpler_daemon.testing import child_pids, poll_for

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    """Overrides the conftest guard: the soak checks /dev/shm itself, for the files named
    after its own daemon and children, since other daemons on a shared machine come and
    go in /dev/shm meanwhile. No child of this process may outlive the test."""
    yield
    poll_for(lambda: not child_pids(), timeout=10.0, message="child processes outlived the test")


def test_soak_for_60_seconds_loses_nothing_and_leaks_nothing() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SIMPLER_DAEMON_SOCKET"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.soak", "--seconds", "60"],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the soak and its daemon: one group to kill on a hang
    )
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"the soak did not finish within 300 s:\n{out}")
    assert proc.returncode == 0, out
    assert "soak: ok" in out and "lost: 0   wrong: 0" in out, out
    assert "phase churn:" in out and "phase restarts:" in out, out
    assert "phase remote:" in out, out
