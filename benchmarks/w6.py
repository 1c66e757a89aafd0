"""W6: W1 and W2 submitted through the daemon's API from a separate client process,
over both transports of ``simpler_daemon.client.Client``.

::

    this process (the client) --gRPC, Unix socket ----------> simpler-daemon serve
                              --fast path, daemon.fast.sock -->   └─ 2 SUB workers

W1: one empty SUB task per run, one ``SubmitRun`` that also waits (``wait_seconds``), ``n1`` times in
sequence (round trip in µs; and the daemon process's own CPU per run, from ``/proc``). W2: one run of ``n2`` empty SUB tasks, submitted
in one ``SubmitRun`` that waits for it (tasks/s). GetInfo: ``n1`` bare round trips
(the transport's own cost, without the run path). Variants ``ours_grpc`` (rows
"gRPC") and ``ours_fast`` (rows "fast"), measured alternately in each repetition
against the same daemon. The targets compare with Ray's W1 and our in-process
W1 and W2 measured in the same invocation (see ``workloads.TARGETS``).

Run inside the suite (``python -m benchmarks --only W1,W2,W6``) or standalone::

    python -m benchmarks.w6 [--smoke] [--repeat N]
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.proctree import process_cpu_s
from benchmarks.workloads import (
    NUM_WORKERS,
    Result,
    latency_rep,
    ok,
    standalone,
    throughput_rep,
)

READY_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
WARM_UP_RUNS = 20
EMPTY = "simpler_daemon.examples.tasks:empty"
REPO_ROOT = Path(__file__).resolve().parent.parent


def _config(directory: Path, n2: int, extra: str = "") -> str:
    return f"""\
[daemon]
runtime_dir = "{directory / "run"}"
state_dir = "{directory / "state"}"
shutdown_grace = 5.0
log_level = "warning"
watchdog = false

[workers]
num_sub_workers = {NUM_WORKERS}
num_chips = 0
heap_bytes = 16777216

[limits]
max_tasks_per_run = {max(n2, 100_000)}
{extra}"""


@contextlib.contextmanager
def serve(
    directory: Path,
    config_text: str,
    env: dict[str, str],
    who: str,
    module: str = "simpler_daemon.server.main",
) -> Iterator[int]:
    """A ``simpler-daemon serve`` subprocess with ``config_text`` as its configuration
    (written to ``directory``/daemon.toml) and ``env`` as its environment; yields its pid
    once it said READY=1, SIGTERMs it after (SIGKILL past STOP_TIMEOUT). ``who`` names
    the benchmark in the line printed when the daemon exits with a non-zero status;
    ``module``: what ``python -m`` runs (one whose ``main`` ends in the daemon's)."""
    config = directory / "daemon.toml"
    config.write_text(config_text)
    notify_path = str(directory / "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(0.1)
    err = open(directory / "stderr.txt", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "serve", "--config", str(config)],
        env=dict(env, NOTIFY_SOCKET=notify_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=err,
    )
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"simpler-daemon exited with {proc.returncode} before READY=1: "
                    + (directory / "stderr.txt").read_text(errors="replace")[-500:]
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"simpler-daemon not ready within {READY_TIMEOUT:.0f} s")
            try:
                if b"READY=1" in notify.recv(4096):
                    break
            except TimeoutError:
                continue
        yield proc.pid
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        notify.close()
        err.close()
        if code != 0:
            print(f"{who}: simpler-daemon exited with {code}", file=sys.stderr)


@contextlib.contextmanager
def daemon(n2: int, extra: str = "") -> Iterator[tuple[str, int]]:
    """A ``simpler-daemon serve`` subprocess; yields ``(socket path, pid)``, stops it after.
    ``extra``: more TOML sections for its configuration (the ``[scheduler]`` admission
    policy of W9, fair against fifo)."""
    with tempfile.TemporaryDirectory(prefix="bench-w6-") as tmp:
        directory = Path(tmp)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO_ROOT)) if p)
        with serve(directory, _config(directory, n2, extra), env, "w6") as pid:
            yield str(directory / "run" / "daemon.sock"), pid


def measure(p: dict[str, int], repeat: int) -> dict[str, Result]:
    """W6 on the engine: ``{"ours_grpc": result, "ours_fast": result}``."""
    from simpler_daemon.client import Client, sub_task
    from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

    n1, n2 = p["n1"], p["n2"]
    transports = {"ours_grpc": "grpc", "ours_fast": "fast"}
    with contextlib.ExitStack() as stack:
        sock, pid = stack.enter_context(daemon(n2))
        clients = {
            key: stack.enter_context(Client(sock, timeout=None, transport=name))
            for key, name in transports.items()
        }
        empty = clients["ours_grpc"].register(EMPTY)
        one = [sub_task(empty)]
        many = [sub_task(empty)] * n2
        clock = time.perf_counter_ns

        def run_once(c: Client, tasks: list[Any]) -> None:
            # SubmitRun with wait_seconds: submit and wait in one round trip.
            status = c.submit_run(tasks, wait_seconds=600.0).status
            if status.state != pb.RUN_STATE_COMPLETED:
                raise RuntimeError(f"cannot measure W6: run {status.run_id} {status.error.message}")

        for c in clients.values():
            for _ in range(WARM_UP_RUNS):
                run_once(c, one)
                c.get_info()
            run_once(c, many[: max(1, n2 // 10)])
        reps: dict[str, list[dict[str, Any]]] = {key: [] for key in clients}
        for _ in range(repeat):
            for key, c in clients.items():
                samples = []
                cpu0 = process_cpu_s(pid)
                for _ in range(n1):
                    t0 = clock()
                    run_once(c, one)
                    samples.append(clock() - t0)
                cpu1 = process_cpu_s(pid)
                rep = latency_rep(samples)
                if cpu0 is not None and cpu1 is not None:
                    # The daemon's own CPU per one-task run (its threads, not its
                    # children), clock-tick resolution: 10 ms over the n1 runs.
                    rep["daemon_cpu_us"] = (cpu1 - cpu0) * 1e6 / n1
                info = []
                for _ in range(n1):
                    t0 = clock()
                    c.get_info()
                    info.append(clock() - t0)
                rep["info_us"] = latency_rep(info)["median_us"]
                t0 = clock()
                run_once(c, many)
                rep.update(throughput_rep(n2, clock() - t0))
                rep["n1"], rep["n2"] = n1, n2
                reps[key].append(rep)
    return {
        key: ok(
            reps[key],
            api=f"simpler_daemon.client.Client(transport={name!r}): SubmitRun(wait_seconds)",
            daemon_pid=pid,
            sub_workers=NUM_WORKERS,
        )
        for key, name in transports.items()
    }


def main(argv: list[str] | None = None) -> int:
    return standalone("w6", "W6", measure, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
