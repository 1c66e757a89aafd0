"""``--baseline REV``: the engine before (REV) and after (the working tree) in one invocation.

Machines are shared and noisy, so a change is judged by figures measured side by
side: ``python -m benchmarks --baseline REV`` runs every selected cell of "ours"
once on the working tree ("after") and once on REV ("before") per repetition,
alternating which goes first, and the report puts both beside the peers with
their per-round ratio after ÷ before.

REV's engine::

    <tmp>/bench-baseline-XXXX/
      tree/            git worktree add --detach REV; python setup.py build_ext --inplace -q
      path/simpler_daemon -> ../tree/simpler_daemon

A baseline cell runs ``python -m benchmarks --cell ...`` with ``path/`` as its
working directory and first on ``PYTHONPATH`` (the repository after it), so
``import simpler_daemon`` is REV's package with REV's C extension while
``import benchmarks`` is the *current* harness: REV's own ``benchmarks/`` may
be older and lack cells, and one harness measuring both keeps the loops equal.
A cell the old engine cannot run (an API it lacks) fails inside the cell and is
reported ``unavailable: <reason>``; each baseline cell records which
``simpler_daemon`` it imported and is rejected unless it is REV's. The worktree
is removed when the invocation ends, also on an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.workloads import TIMES, VARIANT_TAGS, WORKLOADS, Result, median

# Cells whose engine processes would not import REV's package: W7's remote runners
# start with ``python -I`` (PYTHONPATH ignored), so they import the installed
# simpler_daemon, i.e. the working tree, whatever the cell's path says.
UNSUPPORTED: dict[str, str] = {
    "W7": "the remote runners start with `python -I` (PYTHONPATH ignored) and would import "
    "the installed simpler_daemon (the working tree), not the baseline's",
}
BUILD_TIMEOUT = 600.0  # seconds for REV's C extension


class BaselineError(Exception):
    """REV cannot serve as the baseline (unknown, not buildable, ...); the message says why."""


@dataclass(frozen=True)
class Baseline:
    rev: str  # as given
    commit: str  # full hash
    subject: str  # its commit subject
    tree: Path  # the worktree
    path_dir: Path  # working directory and PYTHONPATH head of a baseline cell

    @property
    def short(self) -> str:
        return self.commit[:12]

    def describe(self) -> dict[str, Any]:
        return {
            "rev": self.rev,
            "commit": self.commit,
            "subject": self.subject,
            "worktree": str(self.tree),
            "harness": "the current benchmarks/ driving the baseline's simpler_daemon",
        }

    def owns(self, engine_dir: str | None) -> bool:
        """Whether a cell's ``simpler_daemon`` directory is this baseline's."""
        if not engine_dir:
            return False
        mine = (self.tree / "simpler_daemon").resolve()
        return Path(engine_dir).resolve() == mine


def _git(repo: Path, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _tail(text: str, lines: int = 6) -> str:
    return " | ".join(line for line in text.strip().splitlines()[-lines:] if line.strip())


def resolve(rev: str, repo: Path) -> tuple[str, str]:
    """``(full commit hash, subject)`` of ``rev`` in ``repo``, else :class:`BaselineError`."""
    if not rev.strip() or rev.startswith("-"):
        raise BaselineError(f"--baseline {rev!r}: not a revision")
    proc = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if proc.returncode != 0:
        raise BaselineError(
            f"--baseline {rev!r}: unknown revision in {repo} (git rev-parse found no commit "
            "by that name)"
        )
    commit = proc.stdout.strip()
    subject = _git(repo, "log", "-1", "--format=%s", commit).stdout.strip()
    return commit, subject


def _build(baseline_rev: str, commit: str, tree: Path) -> None:
    """REV's C extension in place with this interpreter; BaselineError naming REV and why."""
    what = f"--baseline {baseline_rev!r} ({commit[:12]})"
    if not (tree / "simpler_daemon" / "__init__.py").is_file():
        raise BaselineError(f"{what}: the revision has no simpler_daemon package")
    if not (tree / "setup.py").is_file():
        raise BaselineError(f"{what}: the revision has no setup.py to build its C extension")
    try:
        proc = subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--inplace", "-q"],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise BaselineError(
            f"{what}: building its C extension took over {exc.timeout:.0f} s"
        ) from exc
    if proc.returncode != 0:
        raise BaselineError(
            f"{what}: cannot build its C extension (setup.py build_ext exited with "
            f"{proc.returncode}): {_tail(proc.stderr or proc.stdout)}"
        )
    # The build must leave REV as committed: a build that rewrites tracked files (a
    # generated source out of date) would measure something that is not REV.
    changed = _git(tree, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    if changed:
        raise BaselineError(
            f"{what}: building it changed tracked files, so the tree is no longer the revision: "
            + _tail(changed)
        )


@contextlib.contextmanager
def checkout(rev: str, repo: Path) -> Iterator[Baseline]:
    """REV in a temporary worktree with its C extension built; removed afterwards.

    Raises :class:`BaselineError` (nothing left behind) when REV is unknown or
    cannot be built.
    """
    commit, subject = resolve(rev, repo)
    root = Path(tempfile.mkdtemp(prefix="bench-baseline-"))
    tree, path_dir = root / "tree", root / "path"
    added = False
    try:
        proc = _git(repo, "worktree", "add", "--detach", "--force", "-q", str(tree), commit)
        if proc.returncode != 0:
            raise BaselineError(
                f"--baseline {rev!r} ({commit[:12]}): git worktree add failed: {_tail(proc.stderr)}"
            )
        added = True
        _build(rev, commit, tree)
        path_dir.mkdir()
        (path_dir / "simpler_daemon").symlink_to(tree / "simpler_daemon", target_is_directory=True)
        yield Baseline(rev, commit, subject, tree, path_dir)
    finally:
        removed = False
        if added:
            proc = _git(repo, "worktree", "remove", "--force", str(tree))
            removed = proc.returncode == 0
            if not removed:
                print(
                    f"warning: cannot remove worktree {tree}: {_tail(proc.stderr)}", file=sys.stderr
                )
        shutil.rmtree(root, ignore_errors=True)
        if not removed:  # an add cut short, or a failed remove: drop its entry (dir gone now)
            _git(repo, "worktree", "prune")


def unsupported(workload: str) -> dict[str, Result] | None:
    """The baseline's results of a workload it cannot run here, or None when it can."""
    reason = UNSUPPORTED.get(workload)
    if reason is None:
        return None
    return {
        v: {"status": "unavailable", "reason": reason} for v in WORKLOADS[workload].ours_variants
    }


def check_engine(result: dict[str, Result], baseline: Baseline) -> dict[str, Result]:
    """Reject a baseline cell's figures when it did not import the baseline's engine."""
    for key, res in result.items():
        if res.get("status") == "ok" and not baseline.owns(res.get("engine")):
            result[key] = {
                "status": "unavailable",
                "reason": f"the cell imported simpler_daemon from {res.get('engine')}, not from "
                f"the baseline's worktree {baseline.tree}",
            }
    return result


def merge_rounds(rounds: list[dict[str, Result]]) -> dict[str, Result]:
    """One result per variant from per-round cells (each ``--repeat 1``).

    Every repetition keeps its round number (``rep["round"]``) so before and
    after pair up by round; a variant is ``ok`` when at least one round was, and
    the rounds that failed are named in ``failed_rounds``.
    """
    merged: dict[str, Result] = {}
    for i, result in enumerate(rounds):
        for key, res in result.items():
            into = merged.setdefault(key, {"status": "pending", "reps": [], "elapsed_s": 0.0})
            into["elapsed_s"] += res.get("elapsed_s", 0.0)
            for extra in ("engine", "leftover_processes"):
                if extra in res:
                    into[extra] = res[extra]
            if res.get("status") == "ok":
                into["reps"] += [{**rep, "round": i} for rep in res["reps"]]
                into.setdefault("info", res.get("info", {}))
                into["status"] = "ok"
            else:
                into.setdefault("failed_rounds", []).append(
                    {"round": i, "status": res.get("status"), "reason": res.get("reason", "")}
                )
    for res in merged.values():
        if res["status"] != "ok":  # no round measured it: the first failure says why
            first = res["failed_rounds"][0]
            res.update(status=first["status"], reason=first["reason"])
            res.pop("reps")
    return merged


# ------------------------------------------------------------------------ report


def compare(doc: dict[str, Any]) -> dict[str, Any]:
    """``{workload: {metric: {variant: before, after, per-round ratios after ÷ before}}}``.

    Needs the medians of both sides (``report.finalize``). A ratio below 1 is
    faster for µs and ms, above 1 for tasks/s.
    """
    out: dict[str, Any] = {}
    for wid, wl in doc["workloads"].items():
        before_systems = wl.get("baseline_systems")
        if not before_systems:
            continue
        spec = WORKLOADS[wid]
        for metric in spec.metrics:
            for variant in spec.ours_variants:
                if not metric.applies(variant):
                    continue
                after = wl["systems"].get(variant, {})
                before = before_systems.get(variant, {})
                entry: dict[str, Any] = {
                    "before": _median(before, metric.key),
                    "after": _median(after, metric.key),
                }
                a, b = _by_round(after, metric.key), _by_round(before, metric.key)
                rounds = sorted(set(a) & set(b))
                entry["round_ratios"] = [a[r] / b[r] for r in rounds if b[r]]
                if entry["round_ratios"]:
                    entry["ratio_median"] = median(entry["round_ratios"])
                    entry["ratio_min"] = min(entry["round_ratios"])
                    entry["ratio_max"] = max(entry["round_ratios"])
                out.setdefault(wid, {}).setdefault(metric.key, {})[variant] = entry
    return out


def before_view(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` as if the baseline were ours (peers unchanged), for the before side's verdicts."""
    workloads = {
        wid: {**wl, "systems": {**wl.get("systems", {}), **wl.get("baseline_systems", {})}}
        for wid, wl in doc["workloads"].items()
    }
    return {**doc, "workloads": workloads}


def _verdicts(doc: dict[str, Any], key: str, wid: str, metric: str, variant: str) -> list[str]:
    return [
        v["verdict"]
        for v in doc.get(key, [])
        if (v["workload"], v.get("metric"), v.get("variant")) == (wid, metric, variant)
    ]


def _median(res: Result, key: str) -> float | None:
    return res.get("median", {}).get(key) if res.get("status") == "ok" else None


def _by_round(res: Result, key: str) -> dict[int, float]:
    if res.get("status") != "ok":
        return {}
    return {rep["round"]: rep[key] for rep in res["reps"] if key in rep and "round" in rep}


def _num(v: float | None) -> str:
    from benchmarks.report import num

    return num(v)


def header(doc: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Headline columns before ours and after it: ``(["before (<rev>)"], ["after ÷ before"])``."""
    if "baseline" not in doc:
        return [], []
    return [f"before ({doc['baseline']['rev']})"], [f"after ÷ before (median, range, {TIMES})"]


def cells(doc: dict[str, Any], wid: str, metric: str, variant: str, ref: Any) -> tuple[str, str]:
    """The before figure (or its status with a note from ``ref``) and the ratio cell."""
    wl = doc["workloads"][wid]
    res = wl.get("baseline_systems", {}).get(variant)
    if res is None:
        before = "not run"
    elif res.get("status") == "ok":
        before = _num(res["median"].get(metric))
    else:
        status = res.get("status", "?")
        note = ref(f"before: {status}: {res.get('reason', '')}")
        before = f"{status} {note}"
    entry = doc.get("before_after", {}).get(wid, {}).get(metric, {}).get(variant, {})
    if "ratio_median" not in entry:
        return before, "—"
    ratio = _num(entry["ratio_median"])
    if len(entry["round_ratios"]) > 1:
        ratio += f" ({_num(entry['ratio_min'])} to {_num(entry['ratio_max'])})"
    return before, ratio


def lines(doc: dict[str, Any]) -> list[str]:
    """The before/after section: what was compared and every round's ratio."""
    b = doc["baseline"]
    out = [
        f"Before/after: before = {b['rev']} ({b['commit'][:12]}, “{b['subject']}”), after = "
        f"the working tree (git {(doc['git'].get('revision') or '?')[:12]}"
        f"{', dirty' if doc['git'].get('dirty') else ''}); {b['harness']}; "
        f"{doc['repeat']} round(s), one cell each per round, which one goes first alternating. "
        "Ratios after ÷ before per round (< 1 is faster for µs and ms or fewer calls, > 1 is "
        "faster for tasks/s); verdicts of the same targets on each side:",
        "",
        "| row | before | after | after ÷ before per round | verdict before → after |",
        "|---|---|---|---|---|",
    ]
    for wid, by_metric in doc.get("before_after", {}).items():
        spec = WORKLOADS[wid]
        for metric in spec.metrics:
            for variant, entry in by_metric.get(metric.key, {}).items():
                tag = (
                    f" ({VARIANT_TAGS.get(variant, variant)})"
                    if len(spec.ours_variants) > 1
                    else ""
                )
                per_round = ", ".join(_num(r) for r in entry["round_ratios"]) or "—"
                pairs = zip(
                    _verdicts(doc, "targets_before", wid, metric.key, variant),
                    _verdicts(doc, "targets", wid, metric.key, variant),
                    strict=False,
                )
                judged = "; ".join(f"{b} → {a}" for b, a in pairs) or "—"
                out.append(
                    f"| {wid} {metric.label}{tag} | {_num(entry['before'])} | "
                    f"{_num(entry['after'])} | {per_round} | {judged} |"
                )
    return out
