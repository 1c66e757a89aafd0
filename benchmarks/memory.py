"""M1: the daemon's memory over its history: RSS and tracked objects after 1, 10 and 100 runs.

::

    this process (the client) --gRPC, Unix socket--> simpler-daemon serve (a subprocess)
         |                                              └─ 2 SUB workers (pre-forked)
         +-- /proc/<daemon pid>/status VmRSS
         +-- GET /metrics: simpler_daemon_gc_objects (objects its collector tracks)

``runs`` runs of ``n`` empty SUB tasks each, one ``SubmitRun`` that waits per run, in
sequence; RSS and objects are read after the first run, after ``runs // 10`` and after
``runs``. A daemon that keeps a finished run's task slots grows by megabytes per run; one
that keeps a small status per finished run stays flat. The target: RSS after 100 runs
<= RSS after 1 run + 20 MiB.

Run inside the suite (``python -m benchmarks --only M1``) or standalone::

    python -m benchmarks.memory [--smoke] [--repeat N]
"""

from __future__ import annotations

import re
import socket
import sys
import time
import urllib.request
from typing import Any

from benchmarks.w6 import EMPTY, daemon
from benchmarks.workloads import NUM_WORKERS, Result, ok, standalone

MIB = 1 << 20
SCRAPE_TIMEOUT = 10.0
_GC_OBJECTS = re.compile(rb"^simpler_daemon_gc_objects ([0-9.eE+]+)$", re.MULTILINE)


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (``VmRSS`` of ``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"cannot read the RSS of pid {pid}: no VmRSS in /proc/{pid}/status")


def gc_objects(port: int) -> int:
    """``simpler_daemon_gc_objects`` from the daemon's ``/metrics`` on loopback ``port``."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT) as resp:
        body = resp.read()
    m = _GC_OBJECTS.search(body)
    if m is None:
        raise RuntimeError(f"cannot read simpler_daemon_gc_objects from {url}: not exposed")
    return int(float(m.group(1)))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def checkpoints(runs: int) -> tuple[int, int, int]:
    """After which runs the figures are read: the first, a tenth of the way, the last."""
    return 1, max(2, runs // 10), runs


def measure(p: dict[str, int], repeat: int) -> dict[str, Result]:
    """M1 on one fresh daemon per repetition: ``{"ours": result}``."""
    from simpler_daemon.client import Client, sub_task
    from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

    runs, n = p["runs"], p["n"]
    first, mid, last = checkpoints(runs)
    reps = []
    for _ in range(repeat):
        port = _free_port()
        extra = f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n'
        with daemon(n, extra) as (sock, pid), Client(sock, timeout=None) as c:
            tasks: list[Any] = [sub_task(c.register(EMPTY))] * n
            rep: Result = {"runs": runs, "n": n}
            t0 = time.perf_counter()
            for i in range(1, runs + 1):
                status = c.submit_run(tasks, wait_seconds=600.0).status
                if status.state != pb.RUN_STATE_COMPLETED:
                    raise RuntimeError(
                        f"cannot measure M1: run {status.run_id} {status.error.message}"
                    )
                if i in (first, mid, last):
                    tag = {first: "first", mid: "mid", last: "last"}[i]
                    rep[f"rss_{tag}_mib"] = rss_bytes(pid) / MIB
                    rep[f"objects_{tag}"] = gc_objects(port)
                    rep[f"after_{tag}"] = i
            rep["growth_mib"] = rep["rss_last_mib"] - rep["rss_first_mib"]
            rep["wall_s"] = time.perf_counter() - t0
            rep["tasks_per_s"] = runs * n / rep["wall_s"]
            reps.append(rep)
    return {
        "ours": ok(
            reps,
            api="simpler_daemon.client.Client: SubmitRun(wait_seconds) over the Unix socket",
            rss="/proc/<daemon pid>/status VmRSS",
            objects="simpler_daemon_gc_objects (/metrics)",
            checkpoints=[first, mid, last],
            sub_workers=NUM_WORKERS,
        )
    }


def main(argv: list[str] | None = None) -> int:
    return standalone("memory", "M1", measure, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
