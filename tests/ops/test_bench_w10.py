"""W10 (an L4 driving 4 remote L3 hosts in network namespaces) runs end to end in smoke
mode through ``python -m benchmarks --only W10``: every variant reports its figures (or,
without root, ``unavailable`` with the reason), the report judges the ratio's target,
and no namespace or process of the run is left behind. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from simpler_daemon.testing.netns import netns_available

REPO = Path(__file__).resolve().parents[2]


def _orphan_namespaces() -> list[str]:
    """``slr3-<pid>-<i>`` namespaces whose creator is dead: what a finished run left.
    One whose creator lives belongs to a test running beside this one (pytest-xdist)."""
    try:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.startswith("slr3-")]
    return [name for name in names if not os.path.exists(f"/proc/{name.split('-')[1]}")]


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_bench_w10_smoke(tmp_path: Path) -> None:
    before = set(_orphan_namespaces())
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "benchmarks", "--smoke", "--only", "W10", "--peers", "none"]
    proc = subprocess.run(
        [*cmd, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=200,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (stamped,) = [p for p in out.glob("*.json") if p.name != "latest.json"]
    doc = json.loads(stamped.read_text())
    systems = doc["workloads"]["W10"]["systems"]
    figures = {
        "ours": ("runs_per_s", "x_ratio"),
        "ours_one": ("runs_per_s",),
        "ours_dispatch": ("tasks_per_s", "cpu_us_per_task", "hosts_projected"),
    }
    for variant, keys in figures.items():
        res = systems[variant]
        if not netns_available():
            assert res["status"] == "unavailable" and "root" in res["reason"], res
            continue
        if res["status"] != "ok":  # the whole reason: pytest would cut a long repr short
            pytest.fail(f"W10 {variant}: {json.dumps(res, indent=1)}", pytrace=False)
        assert all(rep[k] > 0 for rep in res["reps"] for k in keys), res
    verdicts = {(t["workload"], t.get("metric"), t.get("variant")) for t in doc["targets"]}
    assert ("W10", "x_ratio", "ours") in verdicts, doc["targets"]
    assert "W10" in proc.stdout and "| workload |" in proc.stdout
    assert set(_orphan_namespaces()) <= before, "W10 left network namespaces behind"
