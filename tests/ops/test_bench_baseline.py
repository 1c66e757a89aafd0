"""``python -m benchmarks --baseline REV``: the engine before (REV, a temporary worktree) and
after (the working tree) in one invocation, and W1's Python calls per run.

The smoke runs the real thing against HEAD; the worktree handling (unknown, unbuildable,
interrupted) is checked on a throwaway git repository, so no test depends on how fast
anything is. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import baseline
from benchmarks.baseline import BaselineError
from benchmarks.calls import CallCounter

REPO = Path(__file__).resolve().parents[2]


def _worktrees(repo: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "worktree", "list", "--porcelain"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_baseline_head_smoke_reports_before_after_and_calls(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "benchmarks", "--smoke", "--only", "W1", "--peers", "none"]
    cmd += ["--baseline", "HEAD", "--repeat", "2", "--out", str(out)]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=200, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "latest.json").read_text())
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert doc["baseline"]["commit"] == head
    tree = doc["baseline"]["worktree"]
    assert not Path(tree).exists()  # removed at the end
    assert tree not in _worktrees(REPO)

    w1 = doc["workloads"]["W1"]
    for side in ("systems", "baseline_systems"):
        for variant, key in (("ours", "median_us"), ("ours_calls", "py_calls")):
            res = w1[side][variant]
            if res["status"] == "ok":
                assert [rep["round"] for rep in res["reps"]] == [0, 1], res["reps"]
                assert all(rep[key] > 0 for rep in res["reps"])
            else:  # the engine may be broken on one side: then it must say why
                assert res["status"] == "unavailable" and res["reason"].strip(), res
    for variant, key in (("ours", "median_us"), ("ours_calls", "py_calls")):
        entry = doc["before_after"]["W1"][key][variant]
        both = w1["systems"][variant]["status"] == w1["baseline_systems"][variant]["status"] == "ok"
        assert len(entry["round_ratios"]) == (2 if both else 0), entry
        assert all(r > 0 for r in entry["round_ratios"])
    for side, suffix in (("systems", ""), ("baseline_systems", "-before")):
        if w1[side]["ours"]["status"] != "ok":
            continue  # a broken engine said why above
        calls = w1[side]["ours_calls"]  # where the engine runs, its calls are counted
        assert calls["status"] == "ok", calls
        assert calls["median"]["py_calls"] > 0 and calls["median"]["c_calls"] > 0
        listing = (out / f"{doc['timestamp']}-w1-calls{suffix}.txt").read_text()
        assert listing.count(" call ") > 5, listing
    for side in ("targets", "targets_before"):
        verdicts = {(t["workload"], t["metric"], t["variant"]) for t in doc[side]}
        assert ("W1", "py_calls", "ours_calls") in verdicts, side
    md = (out / "latest.md").read_text()
    assert "| workload | before (HEAD) | after (ours) | after ÷ before" in md
    assert "W1 Python calls per run" in md


@pytest.mark.timeout(60)
def test_an_unknown_baseline_fails_naming_the_revision(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "benchmarks", "--smoke", "--only", "W1", "--peers", "none"]
    cmd += ["--baseline", "no-such-rev-4711", "--out", str(out)]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=50, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "'no-such-rev-4711': unknown revision" in proc.stderr
    assert not out.exists()  # nothing measured, nothing written


# ------------------------------------------------------------ worktrees of a scratch repo


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, check=True).stdout


def _scratch_repo(tmp_path: Path, setup_py: str, package: bool = True) -> Path:
    """A git repository with one commit: ``setup.py`` and (``package``) simpler_daemon/."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "setup.py").write_text(setup_py)
    if package:
        (repo / "simpler_daemon").mkdir()
        (repo / "simpler_daemon" / "__init__.py").write_text("")
    (repo / "data.txt").write_text("as committed\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "scratch")
    return repo


def _assert_no_worktree_left(repo: Path) -> None:
    assert _worktrees(repo).count("worktree ") == 1, _worktrees(repo)


def test_checkout_builds_links_and_removes_the_worktree_also_on_ctrl_c(tmp_path: Path) -> None:
    repo = _scratch_repo(tmp_path, "import pathlib; pathlib.Path('built').write_text('1')\n")
    with pytest.raises(KeyboardInterrupt), baseline.checkout("HEAD", repo) as b:
        assert (b.tree / "built").read_text() == "1"  # setup.py ran in the worktree
        assert b.owns(str(b.path_dir / "simpler_daemon"))  # the link resolves to REV's package
        assert not b.owns(str(repo / "simpler_daemon"))
        tree = b.tree
        raise KeyboardInterrupt
    assert not tree.exists()
    _assert_no_worktree_left(repo)


@pytest.mark.parametrize(
    ("setup_py", "package", "why"),
    [
        ("import sys; print('error: no compiler here', file=sys.stderr); sys.exit(1)\n", True,
         "cannot build its C extension (setup.py build_ext exited with 1): error: no compiler"),
        ("\n", False, "the revision has no simpler_daemon package"),
        ("open('data.txt', 'w').write('rewritten')\n", True, "building it changed tracked files"),
    ],
)  # fmt: skip
def test_an_unusable_baseline_names_the_revision_and_why(
    tmp_path: Path, setup_py: str, package: bool, why: str
) -> None:
    repo = _scratch_repo(tmp_path, setup_py, package)
    with pytest.raises(BaselineError) as err, baseline.checkout("HEAD", repo):
        pytest.fail("an unusable baseline was checked out")
    assert "--baseline 'HEAD' (" in str(err.value) and why in str(err.value), err.value
    _assert_no_worktree_left(repo)


def test_an_unknown_revision_is_refused_before_any_worktree(tmp_path: Path) -> None:
    repo = _scratch_repo(tmp_path, "\n")
    with pytest.raises(BaselineError, match=r"'v0\.0-nope': unknown revision"):
        baseline.resolve("v0.0-nope", repo)
    _assert_no_worktree_left(repo)


# ------------------------------------------------------------------- rounds and counting


def test_rounds_pair_up_and_a_failed_round_is_named() -> None:
    after = baseline.merge_rounds(
        [
            {"ours": {"status": "ok", "reps": [{"median_us": 10.0}]}},
            {"ours": {"status": "ok", "reps": [{"median_us": 30.0}]}},
        ]
    )
    before = baseline.merge_rounds(
        [
            {"ours": {"status": "ok", "reps": [{"median_us": 20.0}]}},
            {"ours": {"status": "unavailable", "reason": "cannot import name 'x'"}},
        ]
    )
    assert before["ours"]["failed_rounds"] == [
        {"round": 1, "status": "unavailable", "reason": "cannot import name 'x'"}
    ]
    for res in (after["ours"], before["ours"]):
        values = [rep["median_us"] for rep in res["reps"]]
        res["median"] = {"median_us": sorted(values)[len(values) // 2]}
    doc = {"workloads": {"W1": {"systems": after, "baseline_systems": before}}}
    entry = baseline.compare(doc)["W1"]["median_us"]["ours"]
    assert entry["round_ratios"] == [0.5]  # round 1 has no before: no ratio
    assert entry["before"] == 20.0

    never = baseline.merge_rounds([{"ours": {"status": "unavailable", "reason": "gone"}}])
    assert never["ours"]["status"] == "unavailable" and never["ours"]["reason"] == "gone"


def test_call_counter_counts_calls_of_the_counting_thread() -> None:
    def leaf() -> int:
        return len("x")

    def body() -> None:
        leaf()
        leaf()

    counter = CallCounter()
    sys.setprofile(counter)
    counter.active = True
    for _ in range(5):
        body()
    counter.active = False
    sys.setprofile(None)
    assert counter.per_run("call", ("main",), 5) == 3  # body and twice leaf
    assert counter.per_run("c_call", ("main",), 5) == 2  # len, twice
    top = counter.top(5)
    assert [(row["name"], row["per_run"]) for row in top if row["event"] == "call"] == [
        ("test_call_counter_counts_calls_of_the_counting_thread.<locals>.leaf", 2.0),
        ("test_call_counter_counts_calls_of_the_counting_thread.<locals>.body", 1.0),
    ]
