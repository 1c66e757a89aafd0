"""W1b: W1 (one empty task per run) in fresh Workers, one after another: is any
Worker stuck in a slow mode?

W1 was once seen at 245-280 µs in 4 of 30 cells instead of about 30: the
Scheduler's spin gate had locked itself into parking during warm-up. A fresh
Worker per W1 catches that where one long-lived Worker would hide it. Each
repetition starts ``workers`` Workers in turn (``Worker(level=3)``, 2 SUB
workers, ``empty`` registered), warms each up with 20 runs, times ``n`` one-task
runs with ``Worker.run`` (W1's loop) and closes it. Figures per repetition:

* ``spread``: the worst Worker's median / the best one's (target ≤ 1.5);
* ``worst_median_us`` / ``best_median_us``, and ``parked_pct_max``: the largest
  share of timed runs in which one Worker's Scheduler parked (when the Worker
  exposes ``scheduler.stats["parks"]``; an internal counter, a diagnosis only).

Run inside the suite (``python -m benchmarks --only W1b --peers none``) or
standalone: ``python -m benchmarks.bimodal [--smoke] [--repeat N]``.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks import tasks
from benchmarks.ours import _time_runs, load_engine, unavailable, worker
from benchmarks.workloads import Result, latency_rep, ok, standalone

WARM_UP_RUNS = 20


def _parks(w: Any) -> int | None:
    stats = getattr(getattr(w, "scheduler", None), "stats", None)
    return None if stats is None else int(stats.get("parks", 0))


def one_worker(eng: Any, n: int) -> tuple[float, float | None]:
    """W1 in a fresh Worker: (median µs, % of timed runs that parked or None)."""
    with worker(eng, [tasks.empty]) as (w, (h_empty,)):
        task_args = eng.TaskArgs

        def orch(o: Any, args: Any = None, config: Any = None) -> None:
            o.submit_sub(h_empty, task_args())

        _time_runs(w.run, orch, WARM_UP_RUNS)
        before = _parks(w)
        samples = _time_runs(w.run, orch, n)
        after = _parks(w)
    parked = None if before is None or after is None else 100.0 * min(after - before, n) / n
    return float(latency_rep(samples)["median_us"]), parked


def measure(p: dict[str, int], repeat: int) -> dict[str, Result]:
    eng, reason = load_engine()
    if eng is None:
        return {"ours": unavailable(reason)}
    reps = []
    for _ in range(repeat):
        medians, parked = [], []
        for _ in range(p["workers"]):
            med, pct = one_worker(eng, p["n"])
            medians.append(med)
            if pct is not None:
                parked.append(pct)
        reps.append(
            {
                "spread": max(medians) / min(medians),
                "worst_median_us": max(medians),
                "best_median_us": min(medians),
                "parked_pct_max": max(parked) if parked else None,
                "medians_us": [round(m, 1) for m in medians],
            }
        )
    return {"ours": ok(reps, api="Worker.run", workers=p["workers"], runs_per_worker=p["n"])}


def main(argv: list[str] | None = None) -> int:
    return standalone("bimodal", "W1b", measure, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
