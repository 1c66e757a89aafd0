"""The benchmark suite runs end to end in smoke mode, on two workloads (W1: one empty task
per run, sequential round trips; W2: empty tasks, all submitted then all awaited) against
one peer (multiprocessing). No timing is ever asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_bench_smoke_writes_w1_w2_for_mp_and_ours(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "benchmarks", "--smoke", "--only", "W1,W2", "--peers", "mp"]
    proc = subprocess.run(
        [*cmd, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    stamped = [p for p in out.glob("*.json") if p.name != "latest.json"]
    assert len(stamped) == 1, sorted(p.name for p in out.iterdir())
    doc = json.loads(stamped[0].read_text())
    assert (out / "latest.md").read_text() == (out / stamped[0].with_suffix(".md").name).read_text()

    metric = {"W1": "median_us", "W2": "tasks_per_s"}
    for wid, key in metric.items():
        systems = doc["workloads"][wid]["systems"]
        mp = systems["mp"]
        assert mp["status"] == "ok", mp
        assert mp["median"][key] > 0
        assert all(rep[key] > 0 for rep in mp["reps"])
        for variant in ("ours", "ours_async"):
            ours = systems[variant]
            if ours["status"] == "ok":
                assert ours["median"][key] > 0
            else:  # the engine may be missing or broken: then it must say why
                assert ours["status"] in ("unavailable", "skipped"), ours
                assert ours["reason"].strip(), ours

    verdicts = {(t["workload"], t.get("metric"), t.get("variant")) for t in doc["targets"]}
    assert ("W1", "median_us", "ours") in verdicts
    assert ("W2", "tasks_per_s", "ours") in verdicts
    assert "W1" in proc.stdout and "| workload |" in proc.stdout
