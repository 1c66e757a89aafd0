"""Staging benchmark: a chain of single-task runs on one chip, depth 2 versus depth 1.

Not a test: it prints figures. Each run is one NEXT_LEVEL task on chip 0 whose
kernel sleeps ``kernel_ms`` and whose preparation on the simulated backend
takes ``prepare_ms`` (the kernel's ``sim_prepare_s``). All runs are submitted
up front with ``Worker.submit`` and then waited for, so admission decides the
overlap:

* ``chip_pipeline_depth=1``: one task frame, serial runs; each run pays
  prepare + kernel. Ideal: ``prepare + kernel`` per run.
* ``chip_pipeline_depth=2``: the next run's first task is staged and natively
  prepared while the current one executes. Ideal: ``max(prepare, kernel)``
  per run.

Both configurations are measured in the same invocation, after a few warm-up
runs each, with ``Worker(num_sub_workers=1, num_chips=1)``.

Run: ``python -m benchmarks.staging [--runs 50] [--kernel-ms 5] [--prepare-ms 5] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from benchmarks import tasks
from simpler_daemon import CallConfig, TaskArgs, Worker

KERNEL = "benchmarks.tasks:staging_kernel"
WARMUP_RUNS = 3


def _measure(depth: int, runs: int, kernel_ms: float, prepare_ms: float) -> dict[str, Any]:
    # Children inherit the parent's module objects through fork: the attribute set
    # here is the preparation time their simulated backend sees.
    tasks.staging_kernel.sim_prepare_s = prepare_ms / 1000.0  # type: ignore[attr-defined]
    w = Worker(num_sub_workers=1, num_chips=1, chip_pipeline_depth=depth)
    k = w.register(KERNEL, kind="chip")
    staged: list[int] = []
    args = TaskArgs().add_scalar(int(kernel_ms * 1000))
    config = CallConfig()

    def orch(o: Any, _a: Any, _c: CallConfig) -> None:
        o.submit_next_level(k, args, config, worker=0)

    with w:
        assert w.scheduler is not None
        w.scheduler.on_task_event = lambda slot, kind, _c: (
            staged.append(slot.run_id) if kind == "staged" else None
        )
        for h in [w.submit(orch) for _ in range(WARMUP_RUNS)]:
            h.wait(60.0)
        staged.clear()
        t0 = time.perf_counter()
        handles = [w.submit(orch) for _ in range(runs)]
        for h in handles:
            h.wait(60.0 + runs * (kernel_ms + prepare_ms) / 1000.0)
        elapsed = time.perf_counter() - t0
        info = w.list_workers()[0]
    return {
        "depth": depth,
        "task_frames": info["task_frames"],
        "wall_s": elapsed,
        "ms_per_run": elapsed * 1000.0 / runs,
        "staged_runs": len(staged),
    }


def run_staging(runs: int = 50, kernel_ms: float = 5, prepare_ms: float = 5) -> dict[str, Any]:
    """Measure ``runs`` single-task runs at depth 2 and at depth 1; return the figures.

    Keys: ``depth2`` / ``depth1`` (``ms_per_run``, ``wall_s``, ``staged_runs``,
    ``task_frames``), ``ratio`` (depth-2 over depth-1 time per run), and
    ``ideal_depth2_ms``, ``ideal_depth1_ms``, ``ideal_ratio``.
    """
    if runs < 1:
        raise ValueError(f"cannot run the staging benchmark: runs={runs} must be >= 1")
    if kernel_ms < 0 or prepare_ms < 0:
        raise ValueError("cannot run the staging benchmark: kernel_ms and prepare_ms must be >= 0")
    default_prepare = getattr(tasks.staging_kernel, "sim_prepare_s", 0.005)
    try:
        d2 = _measure(2, runs, kernel_ms, prepare_ms)
        d1 = _measure(1, runs, kernel_ms, prepare_ms)
    finally:
        tasks.staging_kernel.sim_prepare_s = default_prepare  # type: ignore[attr-defined]
    ideal1 = float(prepare_ms + kernel_ms)
    ideal2 = float(max(prepare_ms, kernel_ms))
    return {
        "runs": runs,
        "kernel_ms": kernel_ms,
        "prepare_ms": prepare_ms,
        "depth2": d2,
        "depth1": d1,
        "ratio": d2["ms_per_run"] / d1["ms_per_run"],
        "ideal_depth2_ms": ideal2,
        "ideal_depth1_ms": ideal1,
        "ideal_ratio": ideal2 / ideal1 if ideal1 else 1.0,
    }


def format_table(res: dict[str, Any]) -> str:
    rows = [
        ("configuration", "ms/run", "ideal ms/run", "overhead ms/run", "staged runs"),
        (
            "depth 2 (staging)",
            f"{res['depth2']['ms_per_run']:.2f}",
            f"{res['ideal_depth2_ms']:.2f}",
            f"{res['depth2']['ms_per_run'] - res['ideal_depth2_ms']:.2f}",
            str(res["depth2"]["staged_runs"]),
        ),
        (
            "depth 1 (serial)",
            f"{res['depth1']['ms_per_run']:.2f}",
            f"{res['ideal_depth1_ms']:.2f}",
            f"{res['depth1']['ms_per_run'] - res['ideal_depth1_ms']:.2f}",
            str(res["depth1"]["staged_runs"]),
        ),
        ("ratio depth2/depth1", f"{res['ratio']:.3f}", f"{res['ideal_ratio']:.3f}", "", ""),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        f"staging: {res['runs']} runs, kernel {res['kernel_ms']} ms, prepare {res['prepare_ms']} ms, 1 chip",
    ]
    for n, r in enumerate(rows):
        lines.append(
            "  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))
        )
        if n == 0:
            lines.append("  ".join("-" * wd for wd in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.staging", description=__doc__.splitlines()[0]
    )
    ap.add_argument(
        "--runs", type=int, default=50, help="measured runs per configuration (default 50)"
    )
    ap.add_argument("--kernel-ms", type=float, default=5.0, help="kernel time per task (default 5)")
    ap.add_argument(
        "--prepare-ms", type=float, default=5.0, help="preparation time per task (default 5)"
    )
    ap.add_argument(
        "--json", action="store_true", help="print the result dict as JSON instead of a table"
    )
    ns = ap.parse_args(argv)
    res = run_staging(ns.runs, ns.kernel_ms, ns.prepare_ms)
    print(json.dumps(res, indent=2) if ns.json else format_table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
