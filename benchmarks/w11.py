"""W11: another client's one-task runs (W1) through the daemon while a 100,000-task
SubmitRun is handled.

::

    this process, client A (a thread) --SubmitRun(100,000 tasks)--> simpler-daemon serve
    this process, client B            --W1 over and over-------->     (one event loop)

Client B repeats W1 (one ``SubmitRun`` of one empty SUB task that waits for it)
from the moment client A sends its big request until A's call returns (the
daemon has validated and queued the 100,000 tasks); then A's run is cancelled.
A W1 still in flight when A's call returns is left out (reported as
``last_straddling_ms``): runs are admitted in order, so once A's run is queued
B's run waits for its tasks, which says nothing about the event loop.
A third client calls GetInfo in a loop meanwhile: its worst round trip
(``getinfo_max_ms``) is the longest the event loop stalled.
Figures: B's median, p99 and worst round trip during A's call, B's W1 median
with no big request (``idle_median_us``), and how long A's call took
(``big_call_s``). A daemon whose loop did the big request in one go shows the
whole request time as B's worst round trip; one that works in slices shows a
few milliseconds.

Run inside the suite (``python -m benchmarks --only W6,W11``) or standalone::

    python -m benchmarks.w11 [--smoke] [--repeat N]
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from benchmarks.w6 import EMPTY, WARM_UP_RUNS, daemon
from benchmarks.workloads import NUM_WORKERS, Result, latency_rep, ok, standalone

IDLE_RUNS = 200
BIG_TIMEOUT = 600.0  # s for the big SubmitRun call


class _Window:
    """What one repetition saw while the big SubmitRun call was in flight."""

    def __init__(self) -> None:
        self.samples: list[int] = []  # W1 round trips that ended within the call
        self.last = 0  # the W1 in flight when the call returned
        self.probes: list[int] = []  # GetInfo round trips
        self.ns = 0  # the big call
        self.run_id = 0


def _during_big_call(big: Any, probe: Any, request: list[Any], w1: Any) -> _Window:
    """Send ``request`` from ``big`` on a thread; W1 from this thread and GetInfo from
    another one until it returns."""
    out = _Window()
    answer: list[Any] = []
    failure: list[BaseException] = []

    def submit_big() -> None:
        try:
            answer.append(big.submit_run(request))
        except BaseException as exc:  # reported below, on the measuring thread
            failure.append(exc)

    thread = threading.Thread(target=submit_big, name="w11-big-client")

    def probe_loop() -> None:
        # GetInfo never waits for a run: its round trip is the event loop's stall.
        while thread.is_alive():
            t0 = time.perf_counter_ns()
            probe.get_info()
            out.probes.append(time.perf_counter_ns() - t0)

    prober = threading.Thread(target=probe_loop, name="w11-probe")
    t_big = time.perf_counter_ns()
    thread.start()
    prober.start()
    while thread.is_alive():
        out.last = w1()
        if thread.is_alive():
            out.samples.append(out.last)
    # The last W1 may have been queued behind the big run once it was launched:
    # runs are admitted in order, so it waited for 100,000 tasks, not for the loop.
    thread.join()
    out.ns = time.perf_counter_ns() - t_big
    prober.join()
    if failure:
        raise RuntimeError(f"cannot measure W11: the big SubmitRun failed: {failure[0]}")
    out.run_id = answer[0].run_id
    return out


def measure(p: dict[str, int], repeat: int) -> dict[str, Result]:
    """W11 on the engine: ``{"ours": result}``."""
    from simpler_daemon.client import Client, make_args, sub_task, task, tensor
    from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

    n_big = p["n_big"]
    clock = time.perf_counter_ns
    with (
        daemon(n_big) as (sock, pid),
        Client(sock, timeout=BIG_TIMEOUT) as big,
        Client(sock, timeout=None) as small,
        Client(sock, timeout=BIG_TIMEOUT) as probe,
    ):
        empty = small.register(EMPTY)
        buf = big.alloc_buffer((8,), "float32").buffer_id
        # Every task names a tensor: the daemon checks and maps each one.
        member = make_args([tensor(buf, "input", (8,), "float32")])
        request = [task("sub", empty, [member])] * n_big
        one = [sub_task(empty)]

        def w1() -> int:
            t0 = clock()
            status = small.submit_run(one, wait_seconds=BIG_TIMEOUT).status
            if status.state != pb.RUN_STATE_COMPLETED:
                raise RuntimeError(
                    f"cannot measure W11: run {status.run_id} {status.error.message}"
                )
            return clock() - t0

        for _ in range(WARM_UP_RUNS):
            w1()
        reps = []
        for _ in range(repeat):
            idle = latency_rep([w1() for _ in range(IDLE_RUNS)])
            window = _during_big_call(big, probe, request, w1)
            samples, last, probes, big_ns = window.samples, window.last, window.probes, window.ns
            run_id = window.run_id
            big.cancel(run_id, reason="W11 measured")
            big.wait_run(run_id, timeout=BIG_TIMEOUT)
            rep = latency_rep(samples or [big_ns])
            rep["max_ms"] = rep["max_us"] / 1000.0
            rep["idle_median_us"] = idle["median_us"]
            rep["big_call_s"] = big_ns / 1e9
            rep["n_big"] = n_big
            rep["w1_during"] = len(samples)
            rep["last_straddling_ms"] = last / 1e6
            rep["getinfo_max_ms"] = max(probes, default=0) / 1e6
            rep["getinfo_median_us"] = latency_rep(probes)["median_us"] if probes else None
            reps.append(rep)
    return {
        "ours": ok(
            reps,
            api="simpler_daemon.client.Client: SubmitRun(wait_seconds) over the Unix socket, "
            f"beside a {n_big}-task SubmitRun from another client",
            daemon_pid=pid,
            sub_workers=NUM_WORKERS,
        )
    }


def main(argv: list[str] | None = None) -> int:
    return standalone("w11", "W11", measure, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
