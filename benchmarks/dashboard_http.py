"""What one dashboard request costs: each JSON endpoint of a real daemon, timed over HTTP.

A ``simpler-daemon serve`` subprocess (two SUB workers, ``[dashboard] enabled``) gets
``--runs`` finished one-task runs and one run of ``--tasks`` tasks; then each endpoint is
asked ``--n`` times, one connection per request as the page makes them. Figures per
endpoint: the answer's size, the median and the maximum wall time of a request, and the
daemon's CPU time per request (all its threads, from ``/proc/<pid>/stat`` around the
requests; its worker children are not counted). The page asks for one view about once a
second, so the CPU column is the daemon's cost of one open page::

    python -m benchmarks.dashboard_http [--runs N] [--tasks N] [--n N]
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

from simpler_daemon.client import sub_task
from tests.support.daemon_harness import EXAMPLES, running_daemon

_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        body = answer.read()
        if answer.status != 200:
            raise RuntimeError(f"GET {path}: {answer.status} {body[:200]!r}")
        return len(body)
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=300, help="finished one-task runs")
    parser.add_argument("--tasks", type=int, default=1000, help="tasks of the big run")
    parser.add_argument("--n", type=int, default=50, help="requests per endpoint")
    args = parser.parse_args()
    port = _free_port()
    overrides = {
        "metrics": {"listen": f"127.0.0.1:{port}"},
        "dashboard": {"enabled": True},
        "limits": {"max_finished_runs_kept": args.runs + 10, "max_tasks_per_run": args.tasks},
    }
    with (
        tempfile.TemporaryDirectory(prefix="simpler-bench-dashboard-") as tmp,
        running_daemon(Path(tmp), overrides) as daemon,
        daemon.client() as c,
    ):
        empty = c.register(f"{EXAMPLES}:empty")
        for i in range(args.runs):
            c.wait(int(c.submit([sub_task(empty)], label=f"run {i}")), timeout=30)
        big = int(c.submit([sub_task(empty)] * args.tasks, label="big"))
        c.wait(big, timeout=120)
        paths = [
            "/api/overview",
            "/api/workers",
            "/api/runs?limit=50",
            "/api/runs?limit=500",
            f"/api/runs/{big}",
            f"/api/runs/{big}/trace",
            f"/api/runs/{big}/trace?download=1",
        ]
        print(f"{'endpoint':36s} {'bytes':>8s} {'median ms':>10s} {'max ms':>8s} {'CPU ms':>7s}")
        for path in paths:
            times = []
            size = 0
            cpu0 = _cpu_seconds(daemon.pid)
            for _ in range(args.n):
                t0 = time.perf_counter()
                size = _get(port, path)
                times.append((time.perf_counter() - t0) * 1e3)
            cpu = (_cpu_seconds(daemon.pid) - cpu0) / args.n * 1e3
            print(
                f"{path:36s} {size:8d} {statistics.median(times):10.2f} "
                f"{max(times):8.2f} {cpu:7.2f}"
            )
        print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
