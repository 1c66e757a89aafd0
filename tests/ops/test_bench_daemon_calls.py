"""``python -m benchmarks.daemon_calls``: the daemon's Python calls per fast-path W1 run,
counted inside a real ``simpler-daemon serve`` (the count's signal handler installed
before the daemon's own ``main``). Counts, never timings, are asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def counted_daemons() -> list[int]:
    """Processes running the counted daemon (``benchmarks.daemon_calls serve``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"benchmarks.daemon_calls" in argv and b"serve" in argv:
            pids.append(int(entry.name))
    return pids


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_the_daemon_counts_its_own_calls_per_run() -> None:
    assert not counted_daemons()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.daemon_calls", "--smoke"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout)["ours_fast_calls"]
    assert result["status"] == "ok", result
    (rep,) = result["reps"]
    assert rep["runs"] == 50
    # What one run costs the daemon's loop thread: well above nothing (the handler, the
    # plan, the Scheduler), and counted in the daemon, not in this client.
    assert rep["py_calls"] > 50 and rep["c_calls"] > 50, rep
    top = result["info"]["top"]
    # Every run goes through the Scheduler (its round, its run's end), counted per run.
    scheduler = [row for row in top if row["where"].startswith("simpler_daemon/scheduler/")]
    assert any(row["per_run"] >= 1.0 for row in scheduler), top
    # The submit's round, then the one that sees the task end: the daemon's submit does
    # not wait for the task itself (rpc_base.py: spins_first_submit).
    rounds = [row["per_run"] for row in scheduler if row["name"] == "Scheduler.round"]
    assert rounds and rounds[0] >= 2.0, top
    assert not any("client" in row["where"] for row in result["info"]["top"]), result["info"]
    assert not counted_daemons()  # the benchmark stopped its daemon
