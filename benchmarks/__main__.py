"""``python -m benchmarks``: run the workloads (``benchmarks/README.md``) on engine and peers.

Data flow::

    parent (this module, no pools of its own)
      └─ one subprocess per (workload, system) "cell", in its own session:
           python -m benchmarks --cell W1 --system mp --cell-out F.json ...
             └─ the pool / cluster / Ray runtime / engine children it measures
      <- F.json: {system: {"status": ..., "reps": [...]}}

A fresh interpreter per cell keeps the systems from disturbing each other
(threads a peer leaves behind, imported runtimes, a crash), lets a hung cell be
killed on a deadline, and after each cell every process still in its session
is killed and reported, so no process outlives the run.

With ``--baseline REV`` every cell of ours runs once per repetition on the working
tree and once on REV (checked out and built by ``benchmarks/baseline.py``), the
two alternating; peers run as without it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import baseline as baseline_mod
from benchmarks import report
from benchmarks.baseline import Baseline, BaselineError
from benchmarks.proctree import process_table
from benchmarks.workloads import (
    ADMISSION_ENV,
    LABELS,
    PEER_KEYS,
    SMOKE_PEERS,
    WORKLOADS,
)

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
DEFAULT_OUT = PACKAGE_DIR / "results"
CELL_TIMEOUT = {False: 300.0, True: 30.0}  # seconds per cell: full, smoke


def _csv(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if items == ["none"]:
        return []
    bad = [x for x in items if x not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {what}: {', '.join(bad)}")
    return items


def _workload_ids(text: str) -> list[str]:
    """``--only``: workload ids in any case (``w1g`` is ``W1g``), spelled as WORKLOADS does."""
    canonical = {wid.upper(): wid for wid in WORKLOADS}
    return [canonical.get(x, x) for x in _csv(text.upper(), tuple(canonical), "workload")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="The workloads of benchmarks/README.md: the engine beside its peers, one table.",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny counts, mp + ppe + ours, < 1 min")
    ap.add_argument(
        "--only",
        type=_workload_ids,
        help=f"comma-separated workloads of {','.join(WORKLOADS)} (default: all)",
    )
    ap.add_argument(
        "--peers",
        type=lambda s: _csv(s.lower(), PEER_KEYS, "peer"),
        help="comma-separated peers of mp,ppe,loky,ray,dask or 'none' "
        "(default: all; --smoke: mp,ppe). The engine (ours) always runs.",
    )
    ap.add_argument("--repeat", type=int, help="repetitions per cell (default 3; --smoke 1)")
    ap.add_argument(
        "--out",
        type=Path,
        help=f"default {DEFAULT_OUT} (--smoke: {DEFAULT_OUT / 'smoke'}, so a smoke run never "
        "replaces the committed full report)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also run W2 on the engine under cProfile (and py-spy when on PATH)",
    )
    ap.add_argument("--cell-timeout", type=float, help="seconds per cell (300; --smoke 30)")
    ap.add_argument(
        "--admission",
        choices=("fifo", "fair"),
        help="the engine's admission policy for the in-process workloads (default: the "
        "Worker's own, fifo); compare W1/W2/W4 with and without fair",
    )
    ap.add_argument(
        "--baseline",
        metavar="REV",
        help="also run every cell of ours on git revision REV (a temporary worktree, its C "
        "extension built), alternating with the working tree per repetition; the report gets "
        "before/after columns and their per-round ratio",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="pass the cells' stderr through")
    # Internal: run one cell in this process (used by the parent's subprocesses).
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--cell-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--cprofile", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.admission is not None:
        # The cells are subprocesses: they inherit it (benchmarks.ours.worker reads it).
        os.environ[ADMISSION_ENV] = args.admission
    if args.repeat is None:
        args.repeat = 1 if args.smoke else 3
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    return args


# ---------------------------------------------------------------------- one cell


def _die_with_parent() -> None:
    """Have the kernel end this cell if the driver dies (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through spawn_cell's clean-up


def cell_main(args: argparse.Namespace) -> int:
    """Measure ``args.cell`` on ``args.system`` here and write the result as JSON."""
    _die_with_parent()
    t0 = time.monotonic()
    if args.system == "ours":
        from benchmarks import ours

        result = ours.run(args.cell, args.repeat, args.smoke, args.cprofile)
    else:
        from benchmarks import peers

        result = peers.run(args.cell, args.system, args.repeat, args.smoke)
    engine = getattr(sys.modules.get("simpler_daemon"), "__file__", None)
    for res in result.values():
        res["elapsed_s"] = time.monotonic() - t0
        if engine:  # which engine the cell measured (--baseline checks it is the baseline's)
            res["engine"] = str(Path(engine).resolve().parent)
    args.cell_out.write_text(json.dumps(result))
    return 0


def _session_members(sid: int) -> dict[int, str]:
    """Live (non-zombie) processes of session ``sid``: ``{pid: name}``."""
    members = {}
    for pid, info in process_table().items():
        if info.session == sid and info.state != "Z" and pid != os.getpid():
            try:
                members[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
    return members


def sweep_session(sid: int, grace: float = 3.0) -> list[str]:
    """Kill what is left of a cell's session after ``grace`` s; describe what was killed.

    Pools shut down asynchronously (loky's and Dask's workers and resource
    trackers exit a moment after the cell's interpreter), so give them time to
    go on their own before SIGKILL.
    """
    deadline = time.monotonic() + grace
    members = _session_members(sid)
    while members and time.monotonic() < deadline:
        time.sleep(0.05)
        members = _session_members(sid)
    for pid in members:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return [f"{name} (pid {pid})" for pid, name in members.items()]


def _cell_env(baseline: Baseline | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # Pools that spawn (loky, Dask) and Ray's workers import benchmarks.tasks by path.
    # A baseline cell finds the baseline's simpler_daemon first (benchmarks/baseline.py).
    head = [str(baseline.path_dir)] if baseline is not None else []
    extra = [p for p in (*head, env.get("PYTHONPATH", ""), str(REPO_ROOT)) if p]
    env["PYTHONPATH"] = os.pathsep.join(extra)
    env.setdefault("RAY_DISABLE_IMPORT_WARNING", "1")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def spawn_cell(
    workload: str,
    system: str,
    args: argparse.Namespace,
    timeout: float,
    cprofile: Path | None = None,
    wrapper: list[str] | None = None,
    baseline: Baseline | None = None,
) -> dict[str, Any]:
    """Run one cell in a fresh interpreter in its own session; never raises for its failure.

    With ``baseline`` the cell measures the baseline's engine (its working directory
    and the head of its ``PYTHONPATH`` hold only the baseline's ``simpler_daemon``).
    """
    keys = WORKLOADS[workload].ours_variants if system == "ours" else (system,)
    failed = "unavailable" if system == "ours" else "skipped"
    with tempfile.TemporaryDirectory(prefix="bench-cell-") as tmp:
        out = Path(tmp) / "cell.json"
        cmd = [*(wrapper or []), sys.executable, "-m", "benchmarks"]
        cmd += ["--cell", workload, "--system", system, "--cell-out", str(out)]
        cmd += ["--repeat", str(args.repeat)] + (["--smoke"] if args.smoke else [])
        if cprofile is not None:
            cmd += ["--cprofile", str(cprofile)]
        stderr = None if args.verbose else subprocess.PIPE
        proc = subprocess.Popen(
            cmd,
            env=_cell_env(baseline),
            cwd=None if baseline is None else baseline.path_dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL if not args.verbose else None,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
        reason = ""
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            reason = f"timed out after {timeout:.0f} s (cell killed)"
        except BaseException:  # Ctrl-C or SIGTERM of this process: take the cell down too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            leftovers = sweep_session(proc.pid)
        if not reason and out.exists():
            result: dict[str, Any] = json.loads(out.read_text())
        else:
            tail = " | ".join((err or "").strip().splitlines()[-3:])
            reason = reason or f"cell exited with {proc.returncode}: {tail}"
            result = {k: {"status": failed, "reason": reason} for k in keys}
    if leftovers:
        note = "killed leftover processes after the cell: " + ", ".join(leftovers)
        print(f"  warning: {note}", file=sys.stderr)
        for res in result.values():
            res["leftover_processes"] = leftovers
    if baseline is not None:
        result = baseline_mod.check_engine(result, baseline)
    return result


def run_ours(
    workload: str, args: argparse.Namespace, timeout: float, baseline: Baseline | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Ours on the working tree ("after") and, with ``baseline``, on the baseline ("before").

    Without a baseline: one cell of ``--repeat`` repetitions. With one: per
    repetition one cell of each (``--repeat 1``), which goes first alternating
    per round, so the machine's noise falls on both alike.
    """
    if baseline is None:
        return spawn_cell(workload, "ours", args, timeout), None
    skipped = baseline_mod.unsupported(workload)
    after: list[dict[str, Any]] = []
    before: list[dict[str, Any]] = []
    saved = args.repeat
    args.repeat = 1
    try:
        for i in range(saved):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            for side in order:
                if side == "before" and skipped is not None:
                    continue
                print(f"[{side} {i + 1}/{saved}]", end=" ", flush=True)
                if side == "after":
                    after.append(spawn_cell(workload, "ours", args, timeout))
                else:
                    before.append(spawn_cell(workload, "ours", args, timeout, baseline=baseline))
    finally:
        args.repeat = saved
    return baseline_mod.merge_rounds(after), skipped or baseline_mod.merge_rounds(before)


def _describe(res: dict[str, Any], workload: str, system: str) -> str:
    if res.get("status") != "ok":
        return f"{res.get('status')}: {res.get('reason', '')}"
    reps = res["reps"]
    metrics = WORKLOADS[workload].metrics
    parts = []
    for m in metrics:
        vals = sorted(r[m.key] for r in reps if m.key in r)
        if m.applies(system) and vals:
            parts.append(f"{m.label} {report.num(vals[len(vals) // 2])}")
    return ", ".join(parts) + f" ({len(reps)} reps, {res.get('elapsed_s', 0):.1f} s)"


# ------------------------------------------------------------------------- driver


def _profile(args: argparse.Namespace, stamp: str, timeout: float) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    prof = args.out / f"{stamp}-w2.prof"
    print("profile: W2 on ours under cProfile ...", flush=True)
    saved = args.repeat
    args.repeat = 1
    try:
        res = spawn_cell("W2", "ours", args, timeout, cprofile=prof)["ours"]
        info: dict[str, Any] = {"status": res.get("status"), "reason": res.get("reason")}
        if res.get("status") == "ok" and prof.exists():
            txt = prof.with_name(prof.stem + "-profile.txt")
            info["files"] = [prof.name, txt.name]
            print(f"  wrote {prof} and {txt}")
        else:
            print(f"  profile: ours {res.get('status')}: {res.get('reason')}")
        py_spy = shutil.which("py-spy")
        if py_spy is None:
            print("  py-spy: not on PATH, no flame graph")
        elif res.get("status") == "ok":
            svg = args.out / f"{stamp}-w2-flame.svg"
            wrapper = [py_spy, "record", "--subprocesses", "--rate", "500", "-o", str(svg), "--"]
            spawn_cell("W2", "ours", args, timeout, wrapper=wrapper)
            if svg.exists():
                info.setdefault("files", []).append(svg.name)
                print(f"  wrote {svg}")
            else:
                print("  py-spy: recorded nothing (ptrace not permitted?)")
    finally:
        args.repeat = saved
    return info


def measure_all(
    doc: dict[str, Any],
    selected: list[str],
    peers: list[str],
    args: argparse.Namespace,
    timeout: float,
    baseline: Baseline | None,
) -> None:
    """Every selected workload on ours (before and after with a baseline) and each peer."""
    for wid in selected:
        spec = WORKLOADS[wid]
        wl: dict[str, Any] = {"title": spec.title, "measured": spec.measured, "systems": {}}
        doc["workloads"][wid] = wl
        if not spec.measured:
            print(f"{wid}: not yet measured ({spec.title})", flush=True)
            continue
        wl["params"] = spec.params(args.smoke)
        for system in ["ours", *peers]:
            if system != "ours" and system not in spec.peers:
                wl["systems"][system] = {"status": "n/a", "reason": spec.na_reason}
                continue
            print(f"{wid} {LABELS[system]} ...", end=" ", flush=True)
            before = None
            if system == "ours":
                result, before = run_ours(wid, args, timeout, baseline)
            else:
                result = spawn_cell(wid, system, args, timeout)
            wl["systems"].update(result)
            if before is not None:
                wl["baseline_systems"] = before
                print("\n  after: ", end="")
            print("; ".join(f"{LABELS[k]}: {_describe(r, wid, k)}" for k, r in result.items()))
            if before is not None:
                described = (f"{LABELS[k]}: {_describe(r, wid, k)}" for k, r in before.items())
                print("  before: " + "; ".join(described))
        for peer in PEER_KEYS:
            wl["systems"].setdefault(
                peer, {"status": "not_run", "reason": "not selected (--peers)"}
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out is None:
        args.out = DEFAULT_OUT / "smoke" if args.smoke else DEFAULT_OUT
    if args.cell:
        return cell_main(args)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = dt.datetime.now(dt.UTC)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    t0 = time.monotonic()
    selected = args.only or list(WORKLOADS)
    peers = args.peers if args.peers is not None else list(SMOKE_PEERS if args.smoke else PEER_KEYS)
    timeout = args.cell_timeout or CELL_TIMEOUT[args.smoke]
    mode = "smoke" if args.smoke else "full"
    print(
        f"benchmarks: {mode}, workloads {','.join(selected)}, peers {','.join(peers) or 'none'}"
        f" + ours, repeat {args.repeat}, out {args.out}"
        + (f", baseline {args.baseline}" if args.baseline else ""),
        flush=True,
    )
    doc: dict[str, Any] = {
        "schema": 1,
        "timestamp": stamp,
        "started_utc": started.isoformat(timespec="seconds"),
        "mode": mode,
        "repeat": args.repeat,
        "argv": sys.argv[1:] if argv is None else argv,
        "peers": peers,
        "labels": LABELS,
        "machine": report.machine_facts(),
        "packages": report.package_versions(),
        "git": report.git_info(REPO_ROOT),
        "workloads": {},
    }
    try:
        with contextlib.ExitStack() as stack:
            baseline = None
            if args.baseline is not None:
                print(f"baseline: {args.baseline} in a temporary worktree ...", end=" ", flush=True)
                baseline = stack.enter_context(baseline_mod.checkout(args.baseline, REPO_ROOT))
                print(f"{baseline.short} “{baseline.subject}”, built in {baseline.tree}")
                doc["baseline"] = baseline.describe()
            measure_all(doc, selected, peers, args, timeout, baseline)
    except BaselineError as exc:
        print(f"\nbenchmarks: error: {exc}", file=sys.stderr)
        return 2
    if args.profile:
        doc["profile"] = _profile(args, stamp, timeout)
    doc["wall_s"] = time.monotonic() - t0
    doc["loadavg_at_end"] = [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    report.finalize(doc)
    json_path, md_path, pngs = report.write(doc, args.out)
    print()
    print(md_path.read_text())
    print(f"wrote {json_path}, {md_path}" + (f" and {len(pngs)} charts" if pngs else ""))
    print(f"total wall time {doc['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
