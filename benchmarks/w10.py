"""W10: an L4 driving 4 remote L3 hosts in 4 network namespaces, 10 ms L3 runs.

::

    this process: Worker(level=4), 4 remote workers
      ├─ TCP ──► host 0 (netns slr3-<pid>-0, 10.77.k.2): simpler-remote-worker serve
      │            └─ simpler-remote-l3-session: Worker(level=3), 1 SUB worker
      ├─ ...     host 1, host 2
      └─ TCP ──► host 3

Each run of the level-4 Worker is one orchestration that submits ``n`` NEXT_LEVEL tasks
of ``sleep_for`` (``simpler_daemon.examples.remote``: an L3 run that takes 10 ms) round
robin to its targets, so every host always has one queued behind the one it runs
(a remote lane holds one task at a time). Variants, each repetition alternating their
order so the machine's noise falls on both alike:

* ``ours_one``: the ``n`` runs all to host 0: runs/s;
* ``ours``: ``4 n`` runs over the 4 hosts: runs/s, and ``x_ratio`` = its runs/s over
  ``ours_one``'s of the same repetition (the target: >= 3.5);
* ``ours_dispatch``: ``nothing`` tasks (an L3 orchestration that submits nothing, so
  a task completes at once) over the 4 hosts: the L4's remote tasks/s, the CPU this
  process spends per task (every thread: the Scheduler, the loop reading the sockets),
  and ``hosts_projected`` = (1 s / that CPU per task) x 10 ms: how many hosts busy with
  10 ms runs one L4 core could keep fed, the L4's CPU being the only limit.

A 10 ms ``sleep_for`` occupies its host without using a CPU, so 4 hosts on a 2-core
machine measure the L4's fan-out (dispatch, the round trip between two runs of one
host), not 4 hosts' compute: with 10 ms of CPU per run, 2 cores would cap the ratio near
2. Every host's runner and its SUB worker share those cores with the L4.

Needs root (network namespaces); otherwise every variant is "unavailable" with the
reason. Namespaces, their veths and every process started in them are deleted at the
end, also on error (``simpler_daemon.testing.netns.TestHosts``).

Run inside the suite (``python -m benchmarks --only W10``) or standalone::

    python -m benchmarks.w10 [--smoke] [--repeat N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.ours import unavailable
from benchmarks.w7 import REPO_ROOT, RUNNER_ARGV_ENV, runner_argv
from benchmarks.workloads import WORKLOADS, Result, ok

HOSTS = 4
PORT = 19073
RUN_MS = 10
SLEEP_FOR = "simpler_daemon.examples.remote:sleep_for"
NOTHING = "simpler_daemon.examples.remote:nothing"
ALLOWED_MODULES = 'callables.allowed_modules=["simpler_daemon.examples."]'
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
WARM_UP = 8  # runs per host before measuring
LOG_TAIL_LINES = 6  # of each host's log, in an error
#: The line the worker prints once its socket is bound (its own line: a log line may
#: quote the address before that).
_LISTENING = re.compile(r"^listening on (\S+:\d+)$", re.MULTILINE)


def _wait_listening(proc: subprocess.Popen[bytes], log: Path, host: int) -> str:
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        text = log.read_text(errors="replace")
        if m := _LISTENING.search(text):
            return m[1]
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = " | ".join(text.strip().splitlines()[-5:])
            raise RuntimeError(f"simpler-remote-worker on host {host} is not listening: {tail}")
        time.sleep(0.02)


class HostsError(RuntimeError):
    """A failure while the hosts ran, with the end of every host's log (the hosts' side
    of a refused session: the logs go with the hosts)."""


def _with_logs(exc: Exception, logs: Path) -> HostsError:
    tails = []
    for log in sorted(logs.glob("host-*.log")):
        lines = log.read_text(errors="replace").strip().splitlines()[-LOG_TAIL_LINES:]
        tails.append(f"{log.stem}: " + " | ".join(lines))
    kind = type(exc).__name__
    return HostsError(f"{kind}: {exc}; the hosts' logs end with: " + "; ".join(tails))


@contextlib.contextmanager
def four_hosts() -> Iterator[list[str]]:
    """4 network namespaces, each running ``simpler-remote-worker serve`` on port 19073
    (runners of this checkout); their endpoints. Everything is deleted after."""
    from simpler_daemon.testing.netns import TestHosts

    with tempfile.TemporaryDirectory(prefix="bench-w10-") as tmp, TestHosts(HOSTS) as hosts:
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO_ROOT)) if p)
        env[RUNNER_ARGV_ENV] = json.dumps(runner_argv(REPO_ROOT))
        procs: list[subprocess.Popen[bytes]] = []
        try:
            endpoints = []
            for i in range(HOSTS):
                log = Path(tmp) / f"host-{i}.log"
                cmd = [sys.executable, "-m", "simpler_daemon.remote_worker.service", "serve"]
                cmd += ["--listen", f"{hosts.address(i)}:{PORT}", "--insecure"]
                cmd += ["--set", ALLOWED_MODULES]
                with open(log, "wb") as out:
                    proc = hosts.run_in(
                        i, cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
                    )
                procs.append(proc)
                endpoints.append(_wait_listening(proc, log, i))
            try:
                yield endpoints
            except Exception as exc:
                raise _with_logs(exc, Path(tmp)) from exc
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _fan_out(w: Any, handle: Any, workers: list[int], n: int, ms: int) -> float:
    """Seconds one run of ``n`` NEXT_LEVEL tasks of ``handle`` round robin over
    ``workers`` takes."""
    from simpler_daemon import CallConfig, TaskArgs

    def orch(o: Any, args: Any = None, config: Any = None) -> None:
        for i in range(n):
            o.submit_next_level(
                handle, TaskArgs().add_scalar(ms), CallConfig(), worker=workers[i % len(workers)]
            )

    t0 = time.perf_counter()
    w.run(orch)
    return time.perf_counter() - t0


def measure(p: dict[str, int], repeat: int) -> dict[str, Result]:
    from simpler_daemon.testing.netns import netns_available

    variants = WORKLOADS["W10"].ours_variants
    if not netns_available():
        why = "needs root and `ip netns` (4 network namespaces); not available here"
        print(f"W10 skipped: {why}", file=sys.stderr)
        return {v: unavailable(why) for v in variants}
    from simpler_daemon import Worker
    from simpler_daemon.remote.spec import RemoteCallable, RemoteWorkerSpec

    n, n_dispatch = p["n"], p["n_dispatch"]
    one: list[Result] = []
    four: list[Result] = []
    dispatch: list[Result] = []
    with four_hosts() as endpoints:
        w = Worker(level=4)
        try:
            workers = [
                w.add_remote_worker(RemoteWorkerSpec(endpoint=e, num_sub_workers=1))
                for e in endpoints
            ]
            sleep = w.register(RemoteCallable(SLEEP_FOR), workers=workers)
            nothing = w.register(RemoteCallable(NOTHING), workers=workers)
            w.init()  # opens the 4 sessions
            _fan_out(w, sleep, workers, WARM_UP * HOSTS, RUN_MS)
            _fan_out(w, nothing, workers, 200, 0)
            for i in range(repeat):
                order = ("one", "four") if i % 2 == 0 else ("four", "one")
                got: dict[str, float] = {}
                for side in order:
                    targets = workers[:1] if side == "one" else workers
                    runs = n * len(targets)
                    got[side] = runs / _fan_out(w, sleep, targets, runs, RUN_MS)
                one.append({"runs_per_s": got["one"]})
                four.append({"runs_per_s": got["four"], "x_ratio": got["four"] / got["one"]})
                cpu0 = time.process_time()
                elapsed = _fan_out(w, nothing, workers, n_dispatch, 0)
                cpu_s = time.process_time() - cpu0
                per_task = cpu_s / n_dispatch
                dispatch.append(
                    {
                        "tasks_per_s": n_dispatch / elapsed,
                        "cpu_us_per_task": per_task * 1e6,
                        "hosts_projected": (RUN_MS / 1000) / per_task if per_task else 0.0,
                    }
                )
        finally:
            try:
                w.close()
            except Exception:
                traceback.print_exc()
    info = {
        "hosts": HOSTS,
        "run_ms": RUN_MS,
        "runs_per_host": n,
        "transport": "TCP between network namespaces (veth), no TLS, no token",
        "cpus": os.cpu_count(),
    }
    return {
        "ours": ok(four, **info),
        "ours_one": ok(one, **info),
        "ours_dispatch": ok(dispatch, tasks=n_dispatch, **info),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.w10", description=__doc__)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    result = measure(WORKLOADS["W10"].params(args.smoke), args.repeat)
    print(json.dumps(result, indent=2))
    return 0 if all(r["status"] == "ok" for r in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
