"""W9: a one-task run's latency while another client's 2 s run executes, fair vs fifo.

::

    this process, client A --SubmitRun(big: 20 ms sleeps filling every worker, 2 s)--+
    this process, client B --SubmitRun(one empty task, wait_seconds) x probes------>  simpler-daemon serve
                                                                                     (scheduler.admission)

Client A keeps a run of ``20 ms`` sleeping SUB tasks executing (``big_ms`` of work
over the pool's workers; a new one is submitted when it ends); client B submits a
one-task run and waits for it (one ``SubmitRun`` with ``wait_seconds``), each time
while A's run is executing, at a random moment (a pause of up to one task between
probes). The figure is B's round trip: median and p90 over
``probes`` runs. Measured twice, each on its own daemon: ``scheduler.admission =
"fair"`` (variant ``ours``, the daemon's default), where B's task takes the next
worker that frees up, and ``"fifo"`` (variant ``ours_fifo``, the original whole-run
order), where B's run waits for A's. Target (``workloads.TARGETS``): fair's median
at most 3 x W1 (our in-process one-task run) of the same invocation plus one task
duration (20 ms).

A and B are two connections of this process's user: the daemon sees one identity
with two runs, which fair admission shares by run priority (equal here); clients of
different identities are shared first by client, with the same arithmetic.

Run inside the suite (``python -m benchmarks --only W1,W9``) or standalone::

    python -m benchmarks.w9 [--smoke] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from benchmarks.w6 import EMPTY, WARM_UP_RUNS, daemon
from benchmarks.workloads import NUM_WORKERS, WORKLOADS, Result, latency_rep, ok

#: Duration of each task of A's run: the "one task duration" of the target.
TASK_MS = 20
SLEEP = "benchmarks.tasks:sleep_task"
IDLE_RUNS = 50
WAIT_S = 600.0
_EXTRA = """
[callables]
allowed_modules = ["simpler_daemon.examples", "benchmarks"]

[scheduler]
admission = "{admission}"
"""


def _probe(small: Any, one: list[Any]) -> int:
    """B's one-task run: submit and wait in one round trip; nanoseconds."""
    from simpler_daemon.client.results import RunPhase, run_result

    t0 = time.perf_counter_ns()
    status = run_result(small.submit_run(one, wait_seconds=WAIT_S).status)
    took = time.perf_counter_ns() - t0
    if status.state is not RunPhase.COMPLETED:
        raise RuntimeError(f"cannot measure W9: run {status.run_id} {status.state.name}")
    return took


def _executing(big: Any, run: int) -> bool:
    """Whether A's run is executing: admitted, some of its tasks running, not finished."""
    status = big.wait_run(run, 0)
    if status.terminal:
        return False
    return bool(status.counts.running > 0)


def _measure_one(admission: str, p: dict[str, int], probes: int, repeat: int) -> Result:
    from simpler_daemon.client import Client, sub_task

    n_big = max(NUM_WORKERS, p["big_ms"] * NUM_WORKERS // TASK_MS)
    with (
        daemon(n_big, _EXTRA.format(admission=admission)) as (sock, pid),
        Client(sock, timeout=WAIT_S) as big,
        Client(sock, timeout=None) as small,
    ):
        if big.get_info().limits.admission != admission:
            raise RuntimeError(f"cannot measure W9: the daemon does not run {admission!r}")
        one = [sub_task(small.register(EMPTY))]
        sleep = big.register(SLEEP)
        work = [sub_task(sleep, scalars=[TASK_MS * 1000])] * n_big
        for _ in range(WARM_UP_RUNS):
            _probe(small, one)
        reps = []
        rng = random.Random(9)  # the same pauses in every invocation
        for _ in range(repeat):
            idle = latency_rep([_probe(small, one) for _ in range(IDLE_RUNS)])
            samples: list[int] = []
            big_runs = 0
            while len(samples) < probes:
                run = big.submit(work, label="w9-big")
                big_runs += 1
                deadline = time.monotonic() + WAIT_S
                while not _executing(big, run):  # wait until A's tasks hold the workers
                    if big.wait_run(run, 0).terminal or time.monotonic() > deadline:
                        raise RuntimeError(f"cannot measure W9: A's run {run} never executed")
                    time.sleep(0.001)
                # Probes count only when submitted while A's run executes, each after a
                # random pause below one task: back-to-back probes would arrive in step
                # with the workers' task cycle and always wait about the same.
                while len(samples) < probes and _executing(big, run):
                    samples.append(_probe(small, one))
                    time.sleep(rng.uniform(0.0, TASK_MS / 1000.0))
                big.cancel(run, "W9 measured")  # its running tasks end within TASK_MS
                big.wait_run(run, WAIT_S)
            rep = latency_rep(samples)
            rep["idle_median_us"] = idle["median_us"]
            rep["task_ms"] = TASK_MS
            rep["big_tasks"] = n_big
            rep["big_runs"] = big_runs
            reps.append(rep)
    return ok(
        reps,
        api="simpler_daemon.client.Client: SubmitRun(wait_seconds) over the Unix socket, "
        f"beside another client's run of {n_big} x {TASK_MS} ms tasks",
        admission=admission,
        daemon_pid=pid,
        sub_workers=NUM_WORKERS,
    )


def measure(p: dict[str, int], repeat: int) -> dict[str, Result]:
    """W9 on the engine: ``{"ours": fair, "ours_fifo": fifo}``."""
    return {
        "ours": _measure_one("fair", p, p["probes"], repeat),
        "ours_fifo": _measure_one("fifo", p, p["fifo_probes"], repeat),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.w9 [--smoke] [--repeat N]``: both variants as JSON."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.w9", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--smoke", action="store_true", help="small counts")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args(argv)
    results = measure(WORKLOADS["W9"].params(args.smoke), args.repeat)
    for result in results.values():
        for r in result.get("reps", []):
            r.pop("samples_us", None)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
