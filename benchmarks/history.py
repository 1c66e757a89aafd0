"""H1: what the run history costs a submit: W6's W1 (one empty SUB task per run, one
``SubmitRun`` that waits) against a daemon recording its runs in SQLite and against
one keeping nothing (``daemon.state_dir = ":memory:"``), alternately.

::

    this process (the client) --gRPC or fast path--> simpler-daemon serve
                                                       ├─ 2 SUB workers
                                                       └─ history writer thread
                                                          -> <tmp>/state/runs.sqlite3

Per variant and repetition: the median and p90 round trip (µs) of ``runs`` W1s after
a warm-up, and the daemon's CPU time per run (``/proc/<pid>/stat`` utime + stime, the
writer thread included). Figures only: no target, nothing asserted.

    python -m benchmarks.history [--runs N] [--repeat N] [--transport grpc|fast]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator

from benchmarks.w6 import EMPTY, WARM_UP_RUNS, daemon

MEMORY = ":memory:"


@contextlib.contextmanager
def _state_dir(value: str | None) -> Iterator[None]:
    """``daemon.state_dir`` for the daemons started in the block (None: w6's own)."""
    key = "SIMPLER_DAEMON__DAEMON__STATE_DIR"
    old = os.environ.pop(key, None)
    if value is not None:
        os.environ[key] = value
    try:
        yield
    finally:
        os.environ.pop(key, None)
        if old is not None:
            os.environ[key] = old


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(state_dir: str | None, runs: int, transport: str) -> tuple[float, float, float]:
    """(median µs, p90 µs, daemon CPU µs per run) of ``runs`` W1s."""
    from simpler_daemon.client import Client, sub_task

    with (
        _state_dir(state_dir),
        daemon(1) as (sock, pid),
        Client(sock, timeout=None, transport=transport) as c,
    ):
        tasks = [sub_task(c.register(EMPTY))]
        for _ in range(WARM_UP_RUNS * 10):
            c.run(tasks)
        times = []
        cpu0 = _cpu_seconds(pid)
        for _ in range(runs):
            t0 = time.perf_counter_ns()
            c.run(tasks)
            times.append((time.perf_counter_ns() - t0) / 1e3)
        cpu = (_cpu_seconds(pid) - cpu0) / runs * 1e6
    times.sort()
    return times[len(times) // 2], times[int(len(times) * 0.9)], cpu


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.history", description=__doc__)
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--transport", choices=("grpc", "fast"), default="grpc")
    a = ap.parse_args()
    figures: dict[str, list[tuple[float, float, float]]] = {"sqlite": [], "memory": []}
    for i in range(a.repeat):
        for name, state in (("sqlite", None), ("memory", MEMORY)):
            med, p90, cpu = one(state, a.runs, a.transport)
            figures[name].append((med, p90, cpu))
            print(
                f"rep {i} {name:6s}: median {med:7.1f} us  p90 {p90:8.1f} us  cpu {cpu:6.1f} us/run"
            )
    for name, rows in figures.items():
        med = statistics.median(r[0] for r in rows)
        p90 = statistics.median(r[1] for r in rows)
        cpu = statistics.median(r[2] for r in rows)
        print(
            f"H1 {a.transport} {name:6s}: median {med:.1f} us, p90 {p90:.1f} us, daemon CPU {cpu:.1f} us/run (medians of {a.repeat})"
        )


if __name__ == "__main__":
    main()
