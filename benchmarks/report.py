"""Turn the cells' figures into medians, ratios, target verdicts, JSON, Markdown and charts.

The document (``doc``) built by ``__main__`` holds, per workload and system,
the status and per-repetition figures. :func:`finalize` adds medians across
repetitions, the ours/peer ratio of every metric against every peer of the same
invocation, and one verdict per target (MET / MISSED / N/A).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks import baseline, calls, daemon_calls
from benchmarks.workloads import (
    LABELS,
    PENDING_TARGETS,
    TARGETS,
    TIMES,
    UNMEASURED_TARGETS,
    VARIANT_TAGS,
    WORKLOADS,
    Target,
    median,
)

Doc = dict[str, Any]

PACKAGES = (
    "numpy",
    "loky",
    "ray",
    "dask",
    "distributed",
    "matplotlib",
    "uvloop",
    "msgspec",
    "cloudpickle",
    "simpler-daemon",
)


# ------------------------------------------------------------------ machine facts


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def machine_facts() -> dict[str, Any]:
    cpu_model = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    mem_kib = next(
        (
            int(line.split()[1])
            for line in _read("/proc/meminfo").splitlines()
            if line.startswith("MemTotal:")
        ),
        0,
    )
    load = _read("/proc/loadavg").split()[:3]
    return {
        "cpu_model": cpu_model,
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "python_impl": platform.python_implementation(),
        "loadavg_at_start": [float(x) for x in load],
        "openblas_env": {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")},
    }


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["py-spy"] = "on PATH" if shutil.which("py-spy") else None
    return versions


def git_info(repo: Path) -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(
                ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    status = git("status", "--porcelain")
    return {"revision": git("rev-parse", "HEAD"), "dirty": bool(status) if status else None}


# --------------------------------------------------------------------- aggregation


def _ok(res: dict[str, Any] | None) -> bool:
    return bool(res) and res.get("status") == "ok"


def finalize(doc: Doc) -> Doc:
    """Add medians (and min/max) across repetitions, ratios and target verdicts."""
    for wid, wl in doc["workloads"].items():
        spec = WORKLOADS[wid]
        # With --baseline the baseline's results ("before") get their medians too.
        measured = [*wl.get("systems", {}).items(), *wl.get("baseline_systems", {}).items()]
        for system, res in measured:
            if not _ok(res):
                continue
            for key in ("median", "min", "max"):
                res[key] = {}
            for metric in spec.metrics:
                # A metric some variants do not report (the x4 ratio of W7, the remote
                # workload: four remote workers against one, which needs the one-worker
                # figure of the same cell) is left out rather than invented.
                values = [rep[metric.key] for rep in res["reps"] if metric.key in rep]
                if not metric.applies(system) or not values:
                    continue
                res["median"][metric.key] = median(values)
                res["min"][metric.key] = min(values)
                res["max"][metric.key] = max(values)
    doc["ratios"] = ratios(doc)
    doc["targets"] = verdicts(doc)
    doc["unmeasured_targets"] = [
        {"workload": wid, "target": text, "why": why} for wid, text, why in UNMEASURED_TARGETS
    ]
    if "baseline" in doc:
        doc["before_after"] = baseline.compare(doc)
        doc["targets_before"] = verdicts(baseline.before_view(doc))
    if "W7" in doc["workloads"]:
        doc["remote_hop"] = remote_hop(doc)
    if "W1" in doc["workloads"]:
        doc["nested_level"] = nested_level(doc)
    if "W1g" in doc["workloads"]:
        doc["idle_gaps"] = idle_gaps(doc)
    if "W6" in doc["workloads"]:
        doc["transports"] = transports(doc)
    return doc


def idle_gaps(doc: Doc) -> dict[str, Any]:
    """W1g (one-task runs after an idle gap) per gap: ours beside the futex floor (same
    spins, and park at once), medians over repetitions, and ours ÷ the same-spins floor."""
    out: dict[str, Any] = {}
    for gap in ("0.1", "1", "10"):
        row: dict[str, Any] = {}
        for variant in ("ours", "ours_floor", "ours_floor_park"):
            for fig in ("median_us", "p99_us"):
                row[f"{variant}_{fig}"] = value(doc, "W1g", variant, f"g{gap}_{fig}")
        row["ratio"] = value(doc, "W1g", "ours", f"g{gap}_ratio")
        out[gap] = row
    return out


def value(doc: Doc, wid: str, system: str, metric: str) -> float | None:
    res = doc["workloads"].get(wid, {}).get("systems", {}).get(system)
    return res["median"].get(metric) if _ok(res) else None


def transports(doc: Doc) -> dict[str, Any]:
    """W6 (one-task runs through the daemon from another process) per transport: the bare
    round trip (GetInfo), the one-task run (W1), and W1 minus the round trip (the run
    path through the daemon), beside in-process W1 of the same invocation."""
    out: dict[str, Any] = {"w1_in_process_us": value(doc, "W1", "ours", "median_us")}
    for variant in ("ours_grpc", "ours_fast"):
        w6 = value(doc, "W6", variant, "median_us")
        info = value(doc, "W6", variant, "info_us")
        out[variant] = {
            "w1_us": w6,
            "info_us": info,
            "run_path_us": w6 - info if w6 is not None and info is not None else None,
        }
    return out


def remote_hop(doc: Doc) -> dict[str, Any]:
    """W7 (one empty remote L3 task per run) beside W1 (one empty task per run, in
    process) of the same invocation: what the remote hop adds to a one-task run.

    ``hop_us`` is W7's median minus W1's (same API: run or run_async); the x4
    figure is the median of per-repetition ratios measured inside the W7 cell.
    """
    out: dict[str, Any] = {}
    for variant in ("ours", "ours_async"):
        w7 = value(doc, "W7", variant, "median_us")
        w1 = value(doc, "W1", variant, "median_us")
        out[variant] = {
            "w7_median_us": w7,
            "w1_median_us": w1,
            "hop_us": w7 - w1 if w7 is not None and w1 is not None else None,
            "ratio": w7 / w1 if w7 is not None and w1 else None,
        }
    bare = value(doc, "W7", "ours_bare", "median_us")
    w7 = value(doc, "W7", "ours", "median_us")
    out["inner_l3_us"] = w7 - bare if w7 is not None and bare is not None else None
    out["bare_median_us"] = bare
    out["x4_tasks_per_s"] = value(doc, "W7", "ours_x4", "tasks_per_s")
    out["one_tasks_per_s"] = value(doc, "W7", "ours", "tasks_per_s")
    out["x4_ratio"] = value(doc, "W7", "ours_x4", "x4_ratio")
    return out


def nested_level(doc: Doc) -> dict[str, Any]:
    """W1 nested (L4 -> local L3 -> SUB) beside W1 (one empty task per run; both
    ``Worker.run``, same cell): what one local level costs.

    ``level_us`` / ``level_p99_us`` are W1 nested's median / p99 minus W1's.
    """
    out: dict[str, Any] = {}
    for metric in ("median_us", "p99_us"):
        nested = value(doc, "W1", "ours_nested", metric)
        w1 = value(doc, "W1", "ours", metric)
        out[f"nested_{metric}"] = nested
        out[f"w1_{metric}"] = w1
        out[f"level_{metric}"] = nested - w1 if nested is not None and w1 is not None else None
    return out


def ratios(doc: Doc) -> dict[str, Any]:
    """``{workload: {metric: {ours_variant: {peer: ours/peer}}}}`` (None when either is missing)."""
    out: dict[str, Any] = {}
    for wid, wl in doc["workloads"].items():
        spec = WORKLOADS[wid]
        if not wl.get("measured"):
            continue
        for metric in spec.metrics:
            for variant in spec.ours_variants:
                if not metric.applies(variant):
                    continue
                ours = value(doc, wid, variant, metric.key)
                row = out.setdefault(wid, {}).setdefault(metric.key, {}).setdefault(variant, {})
                for peer in doc["peers"]:
                    theirs = value(doc, wid, peer, metric.key)
                    row[peer] = ours / theirs if ours is not None and theirs else None
    return out


def _verdict(doc: Doc, target: Target, variant: str) -> dict[str, Any]:
    wid = target.workload
    out: dict[str, Any] = {
        "workload": wid,
        "metric": target.metric,
        "variant": variant,
        "target": target.text,
        "kind": target.kind,
        "op": target.op,
        "bound": target.bound,
        "offset": target.offset,
        "peer": target.peer,
    }
    ours_res = doc["workloads"][wid]["systems"].get(variant, {})
    ours = value(doc, wid, variant, target.metric)
    out["ours"] = ours
    if ours is None:
        reason = ours_res.get("reason", "")
        return {**out, "verdict": "N/A", "why": f"{ours_res.get('status')}: {reason}"}
    if target.kind == "absolute":
        return {**out, "verdict": "MET" if target.holds(ours) else "MISSED", "why": ""}
    assert target.peer is not None
    ref = target.ref_workload or wid
    theirs = value(doc, ref, target.peer, target.metric)
    out["peer_value"] = theirs
    if not theirs:
        if ref not in doc["workloads"]:
            return {**out, "verdict": "N/A", "why": f"{ref} not measured (--only)"}
        peer_res = doc["workloads"][ref]["systems"].get(target.peer)
        label = LABELS[target.peer]
        why = (
            f"peer missing: {label} {peer_res.get('status')}: {peer_res.get('reason', '')}"
            if peer_res
            else f"peer missing: {label} not run"
        )
        return {**out, "verdict": "N/A", "why": why}
    ratio = (ours - target.offset) / theirs
    return {**out, "ratio": ratio, "verdict": "MET" if target.holds(ratio) else "MISSED", "why": ""}


def verdicts(doc: Doc) -> list[dict[str, Any]]:
    rows = []
    for target in TARGETS:
        if target.workload not in doc["workloads"]:
            continue
        for variant in WORKLOADS[target.workload].ours_variants:
            if target.variants is None or variant in target.variants:
                rows.append(_verdict(doc, target, variant))
    for wid, text in PENDING_TARGETS.items():
        if wid in doc["workloads"]:
            rows.append(
                {"workload": wid, "target": text, "verdict": "N/A", "why": "not yet measured"}
            )
    return rows


# ------------------------------------------------------------------------ Markdown


def num(v: float | None) -> str:
    if v is None:
        return "—"
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


class _Notes:
    """Footnotes for statuses with a reason, so the table stays narrow."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def ref(self, text: str) -> str:
        if text not in self.items:
            self.items.append(text)
        return f"[{self.items.index(text) + 1}]"


def _cell(doc: Doc, wid: str, system: str, metric: str, notes: _Notes) -> str:
    res = doc["workloads"][wid]["systems"].get(system)
    if res is None:
        return "not run"
    if _ok(res):
        return num(res["median"].get(metric))
    status = res.get("status", "?")
    reason = res.get("reason", "")
    if status == "n/a":
        return "n/a"
    return f"{status} {notes.ref(f'{status}: {reason}')}"


def _row_label(wid: str, metric_label: str, variant: str, variants: tuple[str, ...]) -> str:
    if len(variants) == 1:
        return f"{wid} {metric_label}"
    return f"{wid} {metric_label} ({VARIANT_TAGS.get(variant, variant)})"


def markdown(doc: Doc) -> str:
    notes = _Notes()
    peers = doc["peers"]
    # Several targets may judge one row (W6's one-task run over the fast path: at most
    # 60 µs, and at most 3 x the in-process one, W1): a line each.
    verdicts_of: dict[tuple[Any, Any, Any], list[dict[str, Any]]] = {}
    for v in doc["targets"]:
        verdicts_of.setdefault((v["workload"], v.get("metric"), v.get("variant")), []).append(v)
    before_head, ratio_head = baseline.header(doc)
    ours_head = "after (ours)" if before_head else "ours"
    head = ["workload", *before_head, ours_head, *ratio_head, *(LABELS[p] for p in peers)]
    head += ["ratio vs target peer"]
    head += ["target", "verdict"]
    lines = [
        f"# simpler-daemon benchmarks — {doc['started_utc']}",
        "",
        _summary_line(doc),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for wid, wl in doc["workloads"].items():
        spec = WORKLOADS[wid]
        if not wl.get("measured"):
            cells = [f"{wid} {spec.title}", *(["—"] * (len(before_head) + len(ratio_head)))]
            cells += ["not yet measured"] + ["not yet measured"] * len(peers)
            cells += ["—", PENDING_TARGETS.get(wid, "—"), "N/A (not yet measured)"]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        for metric in spec.metrics:
            for variant in spec.ours_variants:
                if not metric.applies(variant):
                    continue
                ours_cell = _cell(doc, wid, variant, metric.key, notes)
                if before_head:  # --baseline: before, after, their per-round ratio
                    before, ratio_cell = baseline.cells(doc, wid, metric.key, variant, notes.ref)
                    ours_cells = [before, ours_cell, ratio_cell]
                else:
                    ours_cells = [ours_cell]
                row = [
                    _row_label(wid, metric.label, variant, spec.ours_variants),
                    *ours_cells,
                    *(_cell(doc, wid, p, metric.key, notes) for p in peers),
                ]
                judged = verdicts_of.get((wid, metric.key, variant)) or [None]
                for v in judged:
                    cells = list(row)
                    if v is None:
                        cells += ["—", "—", "—"]
                    else:
                        ratio = (
                            f"{num(v['ratio'])} {TIMES} {LABELS[v['peer']]}"
                            if "ratio" in v
                            else "—"
                        )
                        # W9 (a small run behind another client's big one): the ratio is
                        # (ours - one task) / W1.
                        if "ratio" in v and v.get("offset"):
                            ratio = f"(ours - {num(v['offset'])}) ÷ W1 = {num(v['ratio'])}"
                        verdict = v["verdict"]
                        if v.get("why"):
                            verdict += f" {notes.ref(v['why'])}"
                        cells += [ratio, v["target"], verdict]
                    lines.append("| " + " | ".join(cells) + " |")
    if doc.get("unmeasured_targets"):
        lines += ["", "Targets of PERFORMANCE.md this harness does not judge:", ""]
        lines += [
            f"- {t['workload']}: {t['target']} — {t['why']}" for t in doc["unmeasured_targets"]
        ]
    if "baseline" in doc:
        lines += ["", *baseline.lines(doc)]
    lines += ["", *_ratio_table(doc)]
    if "nested_level" in doc:
        lines += ["", *_nested_lines(doc)]
    if "idle_gaps" in doc:
        lines += ["", *_gap_lines(doc)]
    if "remote_hop" in doc:
        lines += ["", *_remote_lines(doc)]
    if "transports" in doc:
        lines += ["", *_transport_lines(doc)]
    lines += ["", *_params(doc)]
    profile = doc.get("profile")
    if profile:
        files = ", ".join(profile.get("files", [])) or f"none ({profile.get('reason')})"
        lines += ["", f"Profile of W2 on ours (--profile): {files}"]
    if notes.items:
        lines += ["", "Notes:", ""]
        lines += [f"{i}. {text}" for i, text in enumerate(notes.items, 1)]
    return "\n".join(lines) + "\n"


def _summary_line(doc: Doc) -> str:
    m, g = doc["machine"], doc["git"]
    rev = (g.get("revision") or "no commit")[:12] + (" (dirty)" if g.get("dirty") else "")
    return (
        f"{doc['mode']} run, {doc['repeat']} repetition(s), medians across repetitions; "
        f"ratios are ours / peer from this invocation. Machine: {m['cpu_model']}, "
        f"{m['nproc']} CPUs, {m['memory_gib']} GiB, {m['kernel']}, Python {m['python']}; "
        f"git {rev}; wall {doc.get('wall_s', 0):.0f} s; load average (1 min) "
        f"{m['loadavg_at_start'][0]:.2f} at start, {doc.get('loadavg_at_end', ['?'])[0]} at end."
    )


def _ratio_table(doc: Doc) -> list[str]:
    peers = doc["peers"]
    if not peers:
        return ["No peer was run (--peers none): no ratios."]
    lines = [
        "Ratios ours / peer (< 1 is faster for µs and ms, > 1 is faster for tasks/s):",
        "",
        "| workload | " + " | ".join(LABELS[p] for p in peers) + " |",
        "|---|" + "---|" * len(peers),
    ]
    for wid, by_metric in doc["ratios"].items():
        spec = WORKLOADS[wid]
        # Ours only (W6 daemon transports, W7 remote L3, S1 chip staging): no row of dashes.
        if not spec.peers:
            continue
        for metric in spec.metrics:
            if metric.variants is not None:  # ours only (W1's call count): no peer figure
                continue
            for variant, row in by_metric.get(metric.key, {}).items():
                label = _row_label(wid, metric.label, variant, spec.ours_variants)
                lines.append(f"| {label} | " + " | ".join(num(row[p]) for p in peers) + " |")
    if len(lines) == 4:
        return ["No ratios: the selected workloads have no peer counterpart."]
    return lines


def _nested_lines(doc: Doc) -> list[str]:
    """W1 nested beside W1: the cost of one nested local level."""
    n = doc["nested_level"]
    lines = ["W1 nested (L4 → local L3 → SUB) beside W1, same invocation, Worker.run:", ""]
    if n["nested_median_us"] is None:
        return [*lines, "- W1 nested not measured (see the notes)"]
    lines.append(
        f"- W1 nested: median {num(n['nested_median_us'])} µs, p99 {num(n['nested_p99_us'])} µs"
    )
    if n["level_median_us"] is None:
        return [*lines, "- W1 not measured: no cost of one level"]
    lines += [
        f"- W1: median {num(n['w1_median_us'])} µs, p99 {num(n['w1_p99_us'])} µs",
        f"- one level costs {num(n['level_median_us'])} µs at the median, "
        f"{num(n['level_p99_us'])} µs at p99",
    ]
    return lines


def _gap_lines(doc: Doc) -> list[str]:
    """W1g: one-task runs after an idle gap beside the bare futex ping-pong."""
    lines = [
        "Runs after an idle gap (W1g) beside a bare futex ping-pong after the same gap "
        "(benchmarks/floor.c), median / p99 µs:",
        "",
        "| gap | ours (run) | floor, same spins | floor, park at once | ours ÷ floor |",
        "|---|---|---|---|---|",
    ]
    for gap, row in doc["idle_gaps"].items():
        cells = [
            f"{num(row[f'{v}_median_us'])} / {num(row[f'{v}_p99_us'])}"
            for v in ("ours", "ours_floor", "ours_floor_park")
        ]
        lines.append(f"| {gap} ms | " + " | ".join(cells) + f" | {num(row['ratio'])} |")
    return lines


def _transport_lines(doc: Doc) -> list[str]:
    """W6 (the daemon's API from another process): what each transport costs by itself
    and what the run path adds."""
    t = doc["transports"]
    lines = ["Daemon transports (W6), same invocation:", ""]
    for variant, name in (("ours_grpc", "gRPC"), ("ours_fast", "fast path")):
        row = t[variant]
        if row["w1_us"] is None:
            continue
        lines.append(
            f"- {name}: GetInfo round trip {num(row['info_us'])} µs, W1 {num(row['w1_us'])} µs, "
            f"so the run path adds {num(row['run_path_us'])} µs"
        )
    grpc_row, fast_row = t["ours_grpc"], t["ours_fast"]
    if grpc_row["info_us"] and fast_row["info_us"] and grpc_row["w1_us"] and fast_row["w1_us"]:
        lines.append(
            f"- fast ÷ gRPC: round trip {num(fast_row['info_us'] / grpc_row['info_us'])}, "
            f"W1 {num(fast_row['w1_us'] / grpc_row['w1_us'])}"
        )
    if t["w1_in_process_us"] is not None and fast_row["w1_us"] is not None:
        lines.append(
            f"- in-process W1 {num(t['w1_in_process_us'])} µs: fast-path W1 is "
            f"{num(fast_row['w1_us'] / t['w1_in_process_us'])} {TIMES} it"
        )
    return lines


def _remote_lines(doc: Doc) -> list[str]:
    """W7 (one remote L3 task per run) beside W1 (the same in process): the cost of the
    hop, where it goes, and what 4 workers give."""
    hop = doc["remote_hop"]
    lines = ["Remote L3 (W7) beside in-process W1, same invocation:", ""]
    for variant, api in (("ours", "run"), ("ours_async", "run_async")):
        h = hop[variant]
        if h["w7_median_us"] is None:
            continue
        if h["hop_us"] is None:
            lines.append(f"- {api}: W7 median {num(h['w7_median_us'])} µs; W1 not measured")
            continue
        lines.append(
            f"- {api}: W7 median {num(h['w7_median_us'])} µs vs W1 {num(h['w1_median_us'])} µs:"
            f" the hop adds {num(h['hop_us'])} µs ({num(h['ratio'])} {TIMES} W1)"
        )
    if hop["inner_l3_us"] is not None:
        lines.append(
            f"- bare session round trip (the L3 orchestration submits nothing): "
            f"{num(hop['bare_median_us'])} µs; the inner L3 run with its SUB task adds "
            f"{num(hop['inner_l3_us'])} µs"
        )
    if hop["x4_tasks_per_s"] is not None:
        ratio = "—" if hop["x4_ratio"] is None else f"{num(hop['x4_ratio'])} {TIMES}"
        lines.append(
            f"- 4 remote workers, one task each per run: {num(hop['x4_tasks_per_s'])} tasks/s, "
            f"{ratio} one worker's {num(hop['one_tasks_per_s'])} tasks/s"
        )
    if len(lines) == 2:
        lines.append("- W7 not measured (see the notes)")
    return lines


def _params(doc: Doc) -> list[str]:
    lines = ["Workload sizes:", ""]
    for wid, wl in doc["workloads"].items():
        if wl.get("measured"):
            params = ", ".join(f"{k}={v}" for k, v in wl["params"].items())
            lines.append(f"- {wid}: {WORKLOADS[wid].title} ({params})")
    return lines


# -------------------------------------------------------------------------- charts


def _systems(doc: Doc, wid: str) -> list[tuple[str, dict[str, Any]]]:
    return [(s, r) for s, r in doc["workloads"][wid]["systems"].items() if _ok(r)]


def charts(doc: Doc, out: Path, stamp: str) -> list[Path]:
    """PNG charts; an empty list (and a printed notice) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError as exc:
        print(f"charts: skipped, matplotlib is not installed ({exc})")
        return []
    made: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out / f"{stamp}-{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)

    def cdf(series: list[tuple[str, dict[str, Any]]], title: str, name: str) -> None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for label, res in series:
            samples = sorted(s for rep in res["reps"] for s in rep["samples_us"])
            ys = [(i + 1) / len(samples) for i in range(len(samples))]
            ax.plot(samples, ys, label=f"{label} (median {num(res['median']['median_us'])} µs)")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("round trip, µs (log)")
        ax.set_ylabel("fraction of runs")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, name)

    # W1's call count (ours_calls) has no samples: no curve.
    w1 = _systems(doc, "W1") if "W1" in doc["workloads"] else []
    w1_timed = [(s, r) for s, r in w1 if "samples_us" in r["reps"][0]]
    if w1_timed:
        series = [(LABELS[s], r) for s, r in w1_timed]
        cdf(series, "W1 — one empty task per run, latency CDF", "w1_latency")
    if "W7" in doc["workloads"] and _systems(doc, "W7"):
        # Our in-process W1 of the same invocation beside the remote runs: the hop's cost.
        series = [(f"W7 {LABELS[s]}", r) for s, r in _systems(doc, "W7")]
        if "W1" in doc["workloads"]:
            series += [(f"W1 {LABELS[s]}", r) for s, r in _systems(doc, "W1") if s == "ours"]
        cdf(series, "W7 — one remote L3 task per run over loopback, latency CDF", "w7_latency")

    bars = {
        "W2": ("tasks_per_s", "tasks/s", "W2 — empty tasks, throughput", None),
        "W3": ("efficiency", "ideal wall / actual wall", "W3 — 500 µs spin tasks", 0.90),
        "W4": ("tasks_per_s", "tasks/s", "W4 — dependent chain, throughput", None),
        "W5": ("ms_per_task", "ms per task (log)", "W5 — read an 8 MiB array", None),
        "W8": ("cpu_pct", "% of one core", "W8 — idle CPU", 1.0),
    }
    for wid, (metric, ylabel, title, line) in bars.items():
        if wid not in doc["workloads"] or not _systems(doc, wid):
            continue
        systems = _systems(doc, wid)
        names = [LABELS[s] for s, _ in systems]
        mids = [r["median"][metric] for _, r in systems]
        lo = [m - r["min"][metric] for m, (_, r) in zip(mids, systems, strict=True)]
        hi = [r["max"][metric] - m for m, (_, r) in zip(mids, systems, strict=True)]
        fig, ax = plt.subplots(figsize=(8, 4.5))
        colors = ["tab:red" if s.startswith("ours") else "tab:blue" for s, _ in systems]
        ax.bar(names, mids, yerr=[lo, hi], color=colors, capsize=4)
        for i, m in enumerate(mids):
            ax.annotate(num(m), (i, m), ha="center", va="bottom", fontsize=8)
        if wid == "W5":
            ax.set_yscale("log")
        if line is not None:
            ax.axhline(line, color="tab:green", linestyle="--", label=f"target {line}")
            ax.legend(fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} (median, min to max over repetitions)")
        ax.tick_params(axis="x", labelrotation=20)
        save(fig, wid.lower() + "_" + metric)
    return made


# -------------------------------------------------------------------------- output


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write(doc: Doc, out: Path) -> tuple[Path, Path, list[Path]]:
    """``<stamp>.json``, ``<stamp>.md``, charts, and their ``latest*`` copies."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = doc["timestamp"]
    md = markdown(doc)
    json_path, md_path = out / f"{stamp}.json", out / f"{stamp}.md"
    pngs = charts(doc, out, stamp)
    # W1's Python calls per function, and the daemon's per fast-path run (W6)
    tops = [*calls.write_top(doc, out, stamp), *daemon_calls.write_top(doc, out, stamp)]
    doc["files"] = [p.name for p in (json_path, md_path, *pngs, *tops)]
    _write_atomic(json_path, json.dumps(doc, indent=1, default=str) + "\n")
    _write_atomic(md_path, md)
    shutil.copyfile(json_path, out / "latest.json")
    shutil.copyfile(md_path, out / "latest.md")
    for stale in out.glob("latest_*.png"):  # never leave a chart of an older run as "latest"
        with contextlib.suppress(OSError):
            stale.unlink()
    for png in pngs:
        shutil.copyfile(png, out / f"latest_{png.name.split('-', 1)[1]}")
    return json_path, md_path, pngs
