"""What is measured: the workloads, their targets, and the timing loops.

Everything here is data or a plain function. The loops for peers are written
once against the small :class:`benchmarks.peers.Peer` interface (submit one
task, wait for one or for many); :mod:`benchmarks.ours` has the engine's own
loops, which go through ``Worker.run`` / ``Worker.run_async``.

A *cell* is one workload measured on one system in one fresh subprocess (see
``__main__``); it returns ``{system_key: result}`` where a result is either
``{"status": "ok", "reps": [{metric: value, ...}, ...], "info": {...}}`` or
``{"status": "skipped" | "unavailable" | "n/a", "reason": "..."}``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final, Literal

from benchmarks import tasks
from benchmarks.proctree import measure_idle_cpu

if TYPE_CHECKING:
    from benchmarks.peers import Peer

#: Environment variable naming the engine's admission policy for the in-process cells
#: (``python -m benchmarks --admission fair``); unset = the Worker's default.
ADMISSION_ENV: Final = "SIMPLER_BENCH_ADMISSION"
NUM_WORKERS = 2
TIMES = "\N{MULTIPLICATION SIGN}"
W5_ELEMENTS = 8 * 1024 * 1024 // 8  # 8 MiB of float64

Result = dict[str, Any]


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    # The ours variants that report this metric (None: every variant and every peer).
    variants: tuple[str, ...] | None = None
    # Ours variants that do not report it although ``variants`` is None (W1's call count).
    exclude: tuple[str, ...] = ()

    def applies(self, system: str) -> bool:
        if system in self.exclude:
            return False
        return self.variants is None or system in self.variants


@dataclass(frozen=True)
class Workload:
    id: str
    title: str
    metrics: tuple[Metric, ...]
    full: dict[str, int] = field(default_factory=dict)
    smoke: dict[str, int] = field(default_factory=dict)
    # Peers this workload applies to; the others are reported "n/a" with `na_reason`.
    peers: tuple[str, ...] = ("mp", "ppe", "loky", "ray", "dask")
    na_reason: str = ""
    # Engine variants measured: "ours" is Worker.run, "ours_async" is Worker.run_async.
    ours_variants: tuple[str, ...] = ("ours",)
    measured: bool = True

    def params(self, smoke: bool) -> dict[str, int]:
        return dict(self.smoke if smoke else self.full)


@dataclass(frozen=True)
class Target:
    """One line of the target table (``benchmarks/README.md``, *Targets*), as data.

    ``kind="ratio"``: ours / ``peer`` (same invocation) ``op`` ``bound``.
    ``kind="absolute"``: ours ``op`` ``bound`` in the metric's unit.
    ``ref_workload``: take the peer's figure from that workload instead (W6, the daemon's
    API from another process, compares with Ray's one-task run W1 and with our own
    in-process 20,000-task run W2, ``peer="ours"``). ``offset``: the ratio is
    (ours - offset) / peer (W9, a small run behind another client's big one: at most
    3 x the one-task run W1 plus one task duration).
    """

    workload: str
    metric: str
    kind: Literal["ratio", "absolute"]
    op: Literal["<=", ">="]
    bound: float
    peer: str | None = None
    text: str = ""
    ref_workload: str | None = None
    # Subtracted from ours before the ratio (W9, a small run behind a big one: one task
    # duration, in the metric's unit).
    offset: float = 0.0
    # The ours variants judged against this target (None: every variant of the workload).
    variants: tuple[str, ...] | None = None

    def holds(self, value: float) -> bool:
        return value <= self.bound if self.op == "<=" else value >= self.bound


LATENCY = (
    Metric("median_us", "median µs", "µs", higher_is_better=False),
    Metric("p99_us", "p99 µs", "µs", higher_is_better=False),
)
THROUGHPUT = (Metric("tasks_per_s", "tasks/s", "tasks/s", higher_is_better=True),)

# W1's call count (benchmarks/calls.py): not a latency, so W1's latency metrics skip it.
W1_CALLS = (
    Metric(
        "py_calls", "Python calls per run", "", higher_is_better=False, variants=("ours_calls",)
    ),
    Metric("c_calls", "C calls per run", "", higher_is_better=False, variants=("ours_calls",)),
    Metric(
        "py_calls_all",
        "Python calls per run, all threads",
        "",
        higher_is_better=False,
        variants=("ours_calls",),
    ),
)

# W6's count of the daemon's calls per fast-path W1 run (benchmarks/daemon_calls.py).
W6_CALLS = (
    Metric(
        "py_calls",
        "W1 daemon Python calls per run",
        "",
        higher_is_better=False,
        variants=("ours_fast_calls",),
    ),
    Metric(
        "c_calls",
        "W1 daemon C calls per run",
        "",
        higher_is_better=False,
        variants=("ours_fast_calls",),
    ),
)

# W7: blocking run, run_async, the bare session round trip (the L3 orchestration submits
# nothing), and 4 remote workers with one task each per run (see benchmarks/w7.py).
W7_VARIANTS = ("ours", "ours_async", "ours_bare", "ours_x4")

WORKLOADS: dict[str, Workload] = {
    w.id: w
    for w in (
        Workload(
            "W1",
            "one empty task per run, sequential round trips",
            (*(replace(m, exclude=("ours_calls",)) for m in LATENCY), *W1_CALLS),
            full={"n": 2000, "calls_warm": 200, "calls_runs": 200},
            smoke={"n": 200, "calls_warm": 50, "calls_runs": 50},
            # ours_nested: "W1 nested", the same task through L4 -> local L3 -> SUB;
            # ours_calls: Python calls per run (benchmarks/calls.py), no timing.
            ours_variants=("ours", "ours_async", "ours_nested", "ours_calls"),
        ),
        Workload(
            "W1g",
            "one empty task per run after an idle gap of 0.1, 1 and 10 ms, beside a bare "
            "futex ping-pong after the same gap (benchmarks/gaps.py)",
            (
                *(
                    Metric(f"g{gap}_{key}", f"{gap} ms gap {label}", "µs", higher_is_better=False)
                    for gap in ("0.1", "1", "10")
                    for key, label in (("median_us", "median µs"), ("p99_us", "p99 µs"))
                ),
                *(
                    Metric(
                        f"g{gap}_ratio",
                        f"{gap} ms gap median ÷ floor's",
                        "x",
                        higher_is_better=False,
                        variants=("ours",),
                    )
                    for gap in ("0.1", "1", "10")
                ),
            ),
            full={"n": 1000, "n_slow": 300},
            smoke={"n": 100, "n_slow": 30},
            peers=(),
            na_reason="the floor is a bare futex ping-pong measured in the same cell",
            ours_variants=("ours", "ours_floor", "ours_floor_park"),
        ),
        Workload(
            "W1b",
            "W1 in fresh Workers one after another: the worst Worker's median ÷ the best's "
            "(benchmarks/bimodal.py)",
            (
                Metric("spread", "worst median ÷ best", "x", higher_is_better=False),
                Metric("worst_median_us", "worst median µs", "µs", higher_is_better=False),
                Metric("best_median_us", "best median µs", "µs", higher_is_better=False),
            ),
            full={"workers": 10, "n": 2000},
            smoke={"workers": 10, "n": 100},
            peers=(),
            na_reason="a check of the engine against itself",
        ),
        Workload(
            "W2",
            "empty tasks, all submitted then all awaited",
            THROUGHPUT,
            full={"n": 20000},
            smoke={"n": 2000},
            ours_variants=("ours", "ours_async"),
        ),
        Workload(
            "W1v",
            "W1 with one small value argument (a 4-key dict: TaskArgs.add_value; peers "
            "pass the same dict), read by the task",
            LATENCY,
            full={"n": 2000},
            smoke={"n": 200},
            ours_variants=("ours", "ours_async"),
        ),
        Workload(
            "W2v",
            "W2 with one small value per task (the same dict), read by the task",
            THROUGHPUT,
            full={"n": 20000},
            smoke={"n": 2000},
            ours_variants=("ours", "ours_async"),
        ),
        Workload(
            "W3",
            "tasks that each spin CPU",
            (Metric("efficiency", "efficiency", "", higher_is_better=True),),
            full={"n": 4000, "spin_us": 500},
            smoke={"n": 200, "spin_us": 500},
            ours_variants=("ours", "ours_machine"),
        ),
        Workload(
            "W4",
            "a chain of dependent tasks",
            THROUGHPUT,
            full={"n": 2000},
            smoke={"n": 200},
            peers=("ray", "dask"),
            na_reason="no task dependencies in this API",
        ),
        Workload(
            "W5",
            "tasks that each read an 8 MiB float64 array",
            (Metric("ms_per_task", "ms/task", "ms", higher_is_better=False),),
            full={"n": 100},
            smoke={"n": 10},
        ),
        Workload(
            "W6",
            "W1 and W2 through the daemon's API from a separate client process, over gRPC "
            "and over the local fast path; GetInfo is the bare transport round trip",
            (
                *(
                    replace(m, exclude=("ours_fast_calls",))
                    for m in (
                        Metric("median_us", "W1 median µs", "µs", higher_is_better=False),
                        Metric("p99_us", "W1 p99 µs", "µs", higher_is_better=False),
                        Metric("tasks_per_s", "W2 tasks/s", "tasks/s", higher_is_better=True),
                        Metric("info_us", "GetInfo median µs", "µs", higher_is_better=False),
                        Metric(
                            "daemon_cpu_us", "W1 daemon CPU µs/run", "µs", higher_is_better=False
                        ),
                    )
                ),
                *W6_CALLS,
            ),
            full={"n1": 2000, "n2": 20000, "calls_warm": 200, "calls_runs": 200},
            smoke={"n1": 200, "n2": 2000, "calls_warm": 50, "calls_runs": 50},
            peers=(),
            na_reason="daemon API; the targets use Ray's W1 and our W1/W2 of this invocation",
            # ours_fast_calls: the daemon's Python calls per fast-path W1 run
            # (benchmarks/daemon_calls.py), no timing.
            ours_variants=("ours_grpc", "ours_fast", "ours_fast_calls"),
        ),
        Workload(
            "W7",
            "one empty remote L3 task per run (an L3 orchestration submitting one SUB task), "
            "loopback TCP",
            (
                *LATENCY,
                Metric(
                    "tasks_per_s",
                    "tasks/s",
                    "tasks/s",
                    higher_is_better=True,
                    variants=("ours", "ours_x4"),
                ),
                Metric(
                    "x4_ratio",
                    "tasks/s ÷ one worker's",
                    "x",
                    higher_is_better=True,
                    variants=("ours_x4",),
                ),
            ),
            full={"n": 2000, "n_x4": 1000},
            smoke={"n": 100, "n_x4": 50},
            peers=(),
            na_reason="no remote equivalent in the peers; W1 of this invocation is the reference",
            ours_variants=W7_VARIANTS,
        ),
        Workload(
            "W8",
            "idle pool of 2 workers: CPU of the parent and every descendant",
            (Metric("cpu_pct", "CPU % of a core", "%", higher_is_better=False),),
            full={"seconds": 10},
            smoke={"seconds": 2},
            # ppe's and loky's idle workers block on a pipe read exactly like mp.Pool's
            # (all measured 0.0 %); leaving them out saves a minute of a full run.
            peers=("mp", "ray", "dask"),
            na_reason="not measured: idle like mp.Pool (workers block on a pipe read)",
        ),
        Workload(
            "W9",
            "one-task run's round trip through the daemon while another client's 2 s run "
            "executes: fair admission (run) vs fifo",
            (
                *LATENCY,
                Metric("p90_us", "p90 µs", "µs", higher_is_better=False),
                Metric("idle_median_us", "idle median µs", "µs", higher_is_better=False),
            ),
            full={"probes": 50, "fifo_probes": 5, "big_ms": 2000},
            smoke={"probes": 10, "fifo_probes": 2, "big_ms": 500},
            peers=(),
            na_reason="daemon API: admission between two clients' runs",
            ours_variants=("ours", "ours_fifo"),
        ),
        Workload(
            "W10",
            "L4 -> 4 remote L3 hosts in network namespaces, 10 ms L3 runs keeping every "
            "host busy; the L4's dispatch capacity with tasks that complete at once",
            (
                Metric(
                    "runs_per_s",
                    "runs/s",
                    "runs/s",
                    higher_is_better=True,
                    variants=("ours", "ours_one"),
                ),
                Metric(
                    "x_ratio",
                    "runs/s ÷ one host's",
                    "x",
                    higher_is_better=True,
                    variants=("ours",),
                ),
                Metric(
                    "tasks_per_s",
                    "remote tasks/s",
                    "tasks/s",
                    higher_is_better=True,
                    variants=("ours_dispatch",),
                ),
                Metric(
                    "cpu_us_per_task",
                    "L4 CPU µs per task",
                    "µs",
                    higher_is_better=False,
                    variants=("ours_dispatch",),
                ),
                Metric(
                    "hosts_projected",
                    "10 ms hosts one L4 core keeps busy",
                    "",
                    higher_is_better=True,
                    variants=("ours_dispatch",),
                ),
            ),
            full={"n": 100, "n_dispatch": 4000},
            smoke={"n": 20, "n_dispatch": 400},
            peers=(),
            na_reason="no remote equivalent in the peers; one host of this invocation is the "
            "reference",
            ours_variants=("ours", "ours_one", "ours_dispatch"),
        ),
        Workload(
            "W11",
            "another client's W1 through the daemon during a 100,000-task SubmitRun",
            (
                *LATENCY,
                Metric("max_ms", "worst W1 ms", "ms", higher_is_better=False),
                Metric("getinfo_max_ms", "worst GetInfo ms", "ms", higher_is_better=False),
                Metric("big_call_s", "big SubmitRun s", "s", higher_is_better=False),
            ),
            full={"n_big": 100_000},
            smoke={"n_big": 20_000},
            peers=(),
            na_reason="daemon API: one client's big request beside another's W1",
        ),
        Workload(
            "M1",
            "daemon memory over its history: runs of empty SUB tasks through the daemon, "
            "RSS and tracked objects after the first run, a tenth of them and all",
            (
                Metric("rss_first_mib", "RSS after run 1 MiB", "MiB", higher_is_better=False),
                Metric("rss_mid_mib", "RSS after runs/10 MiB", "MiB", higher_is_better=False),
                Metric("rss_last_mib", "RSS after all runs MiB", "MiB", higher_is_better=False),
                Metric("growth_mib", "RSS growth MiB", "MiB", higher_is_better=False),
                Metric("objects_first", "objects after run 1", "", higher_is_better=False),
                Metric("objects_last", "objects after all runs", "", higher_is_better=False),
            ),
            full={"runs": 100, "n": 20000},
            smoke={"runs": 10, "n": 2000},
            peers=(),
            na_reason="daemon API: what the daemon keeps per finished run",
        ),
        Workload(
            "S1",
            "chip staging: single-task runs, 5 ms kernel + 5 ms prepare, depth 2 vs depth 1",
            (
                Metric("depth2_ms", "depth 2 ms/run (ideal 5)", "ms", higher_is_better=False),
                Metric("depth1_ms", "depth 1 ms/run (ideal 10)", "ms", higher_is_better=False),
                Metric("ratio", "depth 2 / depth 1 (ideal 0.5)", "x", higher_is_better=False),
            ),
            full={"runs": 50},
            smoke={"runs": 10},
            peers=(),
            na_reason="two-frame chip staging has no counterpart in the peers",
        ),
    )
}

TARGETS: tuple[Target, ...] = (
    # W1's targets (one empty task per run) judge the in-process variants; W1 nested is
    # reported beside them.
    Target(
        "W1",
        "median_us",
        "ratio",
        "<=",
        0.2,
        "mp",
        f"median ≤ 0.2 {TIMES} mp.Pool",
        variants=("ours", "ours_async"),
    ),
    Target(
        "W1",
        "p99_us",
        "ratio",
        "<=",
        0.2,
        "mp",
        f"p99 ≤ 0.2 {TIMES} mp.Pool",
        variants=("ours", "ours_async"),
    ),
    Target(
        "W1",
        "py_calls",
        "absolute",
        "<=",
        80.0,
        None,
        "≤ 80 Python calls per run (calling thread)",
        variants=("ours_calls",),
    ),
    Target("W2", "tasks_per_s", "ratio", ">=", 5.0, "mp", f"≥ 5 {TIMES} mp.Pool"),
    Target(
        "W3", "efficiency", "absolute", ">=", 0.90, None, "efficiency ≥ 0.90", variants=("ours",)
    ),
    Target(
        "W1g",
        "g1_ratio",
        "absolute",
        "<=",
        2.0,
        None,
        f"1 ms gap: median ≤ 2 {TIMES} the futex floor's",
        variants=("ours",),
    ),
    Target("W1b", "spread", "absolute", "<=", 1.5, None, f"worst median ≤ 1.5 {TIMES} the best"),
    Target("W4", "tasks_per_s", "ratio", ">=", 30.0, "ray", f"≥ 30 {TIMES} Ray"),
    Target("W5", "ms_per_task", "ratio", "<=", 0.02, "ppe", f"≤ 0.02 {TIMES} ProcessPoolExecutor"),
    Target("W8", "cpu_pct", "absolute", "<=", 1.0, None, "≤ 1 % of a core"),
    Target(
        "W7",
        "median_us",
        "absolute",
        "<=",
        250.0,
        None,
        "median ≤ 250 µs",
        variants=("ours", "ours_async"),
    ),
    Target(
        "W10",
        "x_ratio",
        "absolute",
        ">=",
        3.5,
        None,
        f"4 hosts ≥ 3.5 {TIMES} one host's runs/s (same invocation)",
        variants=("ours",),
    ),
    Target(
        "W9",
        "median_us",
        "ratio",
        "<=",
        3.0,
        "ours",
        f"median ≤ 3 {TIMES} our W1 + one task (20 ms), fair admission",
        ref_workload="W1",
        offset=20_000.0,
        variants=("ours",),
    ),
    Target(
        "W6",
        "median_us",
        "ratio",
        "<=",
        0.3,
        "ray",
        f"W1 over gRPC ≤ 0.3 {TIMES} Ray's W1",
        ref_workload="W1",
        variants=("ours_grpc",),
    ),
    Target(
        "W6",
        "median_us",
        "absolute",
        "<=",
        60.0,
        None,
        "W1 over the fast path ≤ 60 µs",
        variants=("ours_fast",),
    ),
    Target(
        "W6",
        "median_us",
        "ratio",
        "<=",
        3.0,
        "ours",
        f"W1 over the fast path ≤ 3 {TIMES} our in-process W1",
        ref_workload="W1",
        variants=("ours_fast",),
    ),
    Target(
        "W6",
        "daemon_cpu_us",
        "absolute",
        "<=",
        150.0,
        None,
        "daemon CPU per one-task run over the fast path ≤ 150 µs",
        variants=("ours_fast",),
    ),
    Target(
        "W6",
        "tasks_per_s",
        "ratio",
        ">=",
        0.7,
        "ours",
        f"W2 through the daemon ≥ 0.7 {TIMES} our in-process W2",
        ref_workload="W2",
    ),
    Target(
        "M1",
        "growth_mib",
        "absolute",
        "<=",
        20.0,
        None,
        "daemon RSS after 100 runs of 20,000 tasks ≤ RSS after 1 run + 20 MiB",
    ),
)

# Targets of workloads not measured yet, printed so they are never silently dropped.
PENDING_TARGETS: dict[str, str] = {}

# Targets of PERFORMANCE.md (/work/shared/design) this harness cannot judge, with why;
# every report lists them so they are never silently dropped.
UNMEASURED_TARGETS: tuple[tuple[str, str, str], ...] = (
    (
        "W1",
        f"median ≤ 0.3 {TIMES} the original engine's",
        "the original engine is not a peer of this harness",
    ),
    (
        "W4",
        f"≥ 1.5 {TIMES} the original engine",
        "the original engine is not a peer of this harness",
    ),
)

# How a table row names an ours variant when a workload measures more than one.
VARIANT_TAGS: dict[str, str] = {
    "ours": "run",
    "ours_async": "run_async",
    "ours_bare": "bare session, run",
    "ours_x4": "4 workers, run",
    "ours_one": "one host",
    "ours_dispatch": "dispatch, tasks that complete at once",
    "ours_nested": "W1 nested: L4 → local L3 → SUB, run",
    "ours_fifo": "fifo admission",
    "ours_floor": "futex floor, same spins",
    "ours_floor_park": "futex floor, park at once",
    "ours_grpc": "gRPC",
    "ours_fast": "fast",
    "ours_calls": "sys.setprofile, run",
    "ours_fast_calls": "fast, sys.setprofile in the daemon",
    "ours_machine": "machine floor: bare processes, no engine",
}

PEER_KEYS: tuple[str, ...] = ("mp", "ppe", "loky", "ray", "dask")
SMOKE_PEERS: tuple[str, ...] = ("mp", "ppe")

LABELS: dict[str, str] = {
    "ours": "ours",
    "ours_async": "ours (async)",
    "ours_bare": "ours (bare session)",
    "ours_x4": "ours (4 remote workers)",
    "ours_one": "ours (one host)",
    "ours_dispatch": "ours (dispatch capacity)",
    "ours_nested": "ours (W1 nested)",
    "ours_fifo": "ours (fifo admission)",
    "ours_floor": "futex floor (same spins)",
    "ours_floor_park": "futex floor (park at once)",
    "ours_grpc": "ours (gRPC)",
    "ours_fast": "ours (fast path)",
    "ours_calls": "ours (calls counted)",
    "ours_fast_calls": "ours (fast path, the daemon's calls counted)",
    "ours_machine": "machine floor (bare processes)",
    "mp": "mp.Pool",
    "ppe": "ProcessPoolExecutor",
    "loky": "loky",
    "ray": "Ray",
    "dask": "Dask",
}


# --------------------------------------------------------------------- statistics


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an already sorted list."""
    if not sorted_values:
        raise ValueError("cannot take a percentile of no samples")
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


def median(values: Iterable[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        raise ValueError("cannot take the median of no values")
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def latency_rep(samples_ns: list[int]) -> Result:
    """Figures of one W1 repetition from its round trips in nanoseconds."""
    us = sorted(s / 1000.0 for s in samples_ns)
    return {
        "median_us": median(us),
        "p99_us": percentile(us, 99),
        "p90_us": percentile(us, 90),
        "mean_us": sum(us) / len(us),
        "min_us": us[0],
        "max_us": us[-1],
        "n": len(us),
        # Kept in run order for the CDF chart; rounded to keep the JSON small.
        "samples_us": [round(s / 1000.0, 1) for s in samples_ns],
    }


def throughput_rep(n: int, wall_ns: int) -> Result:
    wall_s = wall_ns / 1e9
    return {"tasks_per_s": n / wall_s, "wall_s": wall_s, "n": n}


def efficiency_rep(n: int, spin_us: int, wall_ns: int) -> Result:
    ideal_s = n * spin_us / 1e6 / NUM_WORKERS
    wall_s = wall_ns / 1e9
    return {"efficiency": ideal_s / wall_s, "wall_s": wall_s, "ideal_s": ideal_s, "n": n}


def per_task_rep(n: int, wall_ns: int) -> Result:
    wall_s = wall_ns / 1e9
    return {"ms_per_task": wall_s * 1000.0 / n, "wall_s": wall_s, "n": n}


def ok(reps: list[Result], **info: Any) -> Result:
    return {"status": "ok", "reps": reps, "info": info}


# ------------------------------------------------------------------ peer loops


def _timed(fn: Callable[[], Any]) -> tuple[int, Any]:
    t0 = time.perf_counter_ns()
    value = fn()
    return time.perf_counter_ns() - t0, value


def warm_up(peer: Peer, spin_us: int = 0) -> None:
    """Start every worker and run a few tasks of each kind before timing."""
    for _ in range(10):
        peer.result(peer.submit(tasks.empty))
    peer.results([peer.submit(tasks.empty) for _ in range(20)])
    if spin_us:
        peer.results([peer.submit(tasks.spin, spin_us) for _ in range(4)])


def peer_w1(peer: Peer, p: dict[str, int], repeat: int) -> Result:
    n = p["n"]
    warm_up(peer)
    reps = []
    submit, result, empty, clock = peer.submit, peer.result, tasks.empty, time.perf_counter_ns
    for _ in range(repeat):
        samples = []
        for _ in range(n):
            t0 = clock()
            result(submit(empty))
            samples.append(clock() - t0)
        reps.append(latency_rep(samples))
    return ok(reps)


def peer_w2(peer: Peer, p: dict[str, int], repeat: int) -> Result:
    n = p["n"]
    warm_up(peer)
    reps = []
    for _ in range(repeat):
        wall, _ = _timed(lambda: peer.results([peer.submit(tasks.empty) for _ in range(n)]))
        reps.append(throughput_rep(n, wall))
    return ok(reps)


def peer_w1v(peer: Peer, p: dict[str, int], repeat: int) -> Result:
    n = p["n"]
    warm_up(peer)
    reps = []
    submit, result, take, clock = peer.submit, peer.result, tasks.take_value, time.perf_counter_ns
    value = tasks.VALUE
    for _ in range(repeat):
        samples = []
        for _ in range(n):
            t0 = clock()
            result(submit(take, value))
            samples.append(clock() - t0)
        reps.append(latency_rep(samples))
    return ok(reps)


def peer_w2v(peer: Peer, p: dict[str, int], repeat: int) -> Result:
    n = p["n"]
    warm_up(peer)
    reps = []
    value = tasks.VALUE
    for _ in range(repeat):
        wall, _ = _timed(
            lambda: peer.results([peer.submit(tasks.take_value, value) for _ in range(n)])
        )
        reps.append(throughput_rep(n, wall))
    return ok(reps)


def peer_w3(peer: Peer, p: dict[str, int], repeat: int) -> Result:
    n, us = p["n"], p["spin_us"]
    warm_up(peer, us)
    reps = []
    for _ in range(repeat):
        wall, _ = _timed(lambda: peer.results([peer.submit(tasks.spin, us) for _ in range(n)]))
        reps.append(efficiency_rep(n, us, wall))
    return ok(reps)


def peer_w4(peer: Peer, p: dict[str, int], repeat: int) -> Result:
    n = p["n"]
    warm_up(peer)
    peer.result(peer.submit(tasks.incr, peer.submit(tasks.incr, 0)))

    def chain() -> int:
        handle = peer.submit(tasks.incr, 0)
        for _ in range(n - 1):
            handle = peer.submit(tasks.incr, handle)  # the previous result as the argument
        return int(peer.result(handle))

    reps = []
    for _ in range(repeat):
        wall, last = _timed(chain)
        if last != n:
            raise RuntimeError(f"cannot verify W4 chain: last value {last} != {n}")
        reps.append(throughput_rep(n, wall))
    return ok(reps)


def peer_w5(peer: Peer, p: dict[str, int], repeat: int) -> Result:
    import numpy as np

    n = p["n"]
    arr = np.ones(W5_ELEMENTS, dtype=np.float64)
    expected = float(W5_ELEMENTS)
    warm_up(peer)
    peer.results([peer.submit(tasks.sum_array, arr, expected) for _ in range(2)])
    reps = []
    for _ in range(repeat):
        wall, _ = _timed(
            lambda: peer.results([peer.submit(tasks.sum_array, arr, expected) for _ in range(n)])
        )
        reps.append(per_task_rep(n, wall))
    return ok(reps, array_mib=arr.nbytes / 2**20, passed_as="pickled argument")


def peer_w8(peer: Peer, p: dict[str, int], repeat: int) -> Result:
    warm_up(peer)
    time.sleep(0.5)  # let the warm-up's bookkeeping settle before the window opens
    reps = [measure_idle_cpu(p["seconds"]) for _ in range(repeat)]
    return ok(reps)


PEER_LOOPS: dict[str, Callable[[Peer, dict[str, int], int], Result]] = {
    "W1": peer_w1,
    "W2": peer_w2,
    "W1v": peer_w1v,
    "W2v": peer_w2v,
    "W3": peer_w3,
    "W4": peer_w4,
    "W5": peer_w5,
    "W8": peer_w8,
}


def standalone(
    prog: str,
    workload: str,
    measure: Callable[[dict[str, Any], int], Result],
    argv: list[str] | None,
    doc: str,
) -> int:
    """``python -m benchmarks.<prog> [--smoke] [--repeat N]``: one workload, printed as JSON
    (per-sample lists left out)."""
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{prog}", description=doc)
    ap.add_argument("--smoke", action="store_true", help="small counts")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args(argv)
    result = measure(WORKLOADS[workload].params(args.smoke), args.repeat)
    result = result.get("ours", result)
    for rep in result.get("reps", []):
        rep.pop("samples_us", None)
    print(json.dumps(result, indent=1))
    return 0
