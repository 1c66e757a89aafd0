"""W3's machine floor: the efficiency this machine gives the same CPU work with no engine.

W3 (``ours.py``) runs 4,000 tasks that each burn 500 µs of CPU on ``NUM_WORKERS``
SUB workers; efficiency is the ideal wall (work ÷ workers) over the actual wall. Part
of what is lost is not the engine's: a VM's neighbours take cores, the kernel's timer
and the clock reads take their share. This cell measures that part in the same
invocation: ``NUM_WORKERS`` bare Python processes, each spinning its share of the
tasks with the same ``tasks.spin`` one after another, no parent work between them, no
mailbox. Its efficiency is the ceiling of what any dispatcher can reach here; ours ÷
the floor is what the engine keeps of it.

The processes are started (``subprocess``, so the benchmark's threads do not matter);
each says it is ready, then waits for one byte on stdin. The clock starts when every
one is ready and the bytes are written, and stops when every process has written its
line back, so interpreter start and exit are not in the figure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

#: What each process runs: wait for the start byte, spin ``k`` tasks of ``us`` µs, report.
_CHILD = (
    "import sys\n"
    "from benchmarks.tasks import spin\n"
    "k, us = int(sys.argv[1]), int(sys.argv[2])\n"
    "sys.stdout.write('ready\\n')\n"
    "sys.stdout.flush()\n"
    "sys.stdin.buffer.read(1)\n"
    "for _ in range(k):\n"
    "    spin(us)\n"
    "sys.stdout.write('done\\n')\n"
    "sys.stdout.flush()\n"
)
_ROOT = str(Path(__file__).resolve().parent.parent)


def w3_floor_ns(n: int, spin_us: int, workers: int) -> int:
    """Wall time (ns) of ``n`` tasks of ``spin_us`` µs of CPU split over ``workers`` bare
    processes (the first ``n % workers`` take one more)."""
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    shares = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(k), str(spin_us)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=_ROOT,
        )
        for k in shares
    ]
    try:
        for p in procs:  # every interpreter is up and waiting before the clock starts
            assert p.stdout is not None
            if p.stdout.readline() != b"ready\n":
                raise RuntimeError(f"W3 machine floor: process {p.pid} did not start")
        t0 = time.perf_counter_ns()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"g")
            p.stdin.flush()
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline() != b"done\n":
                raise RuntimeError(f"W3 machine floor: process {p.pid} exited early")
        return time.perf_counter_ns() - t0
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
