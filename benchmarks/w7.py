"""W7: one empty remote L3 task per run over loopback TCP, and 4 remote workers in parallel.

::

    this process: Worker(level=4) --TCP, 127.0.0.1--> simpler-remote-worker serve (a subprocess)
                                                        └─ simpler-remote-l3-session, one per session
                                                             └─ Worker(level=3), 1 SUB worker

Each run submits ``one_empty`` (``simpler_daemon.examples.remote``), an L3
orchestration that submits one empty SUB task on the remote side, and waits
for its completion. Variants (one result each):

* ``ours``: ``Worker.run`` on a level-4 Worker with one remote worker: median and
  p99 round trip in µs, and tasks/s = runs / the sum of their round trips;
* ``ours_bare``: the same Worker running ``nothing``, an L3 orchestration that
  submits nothing: the session's own round trip without an inner run of the
  remote Scheduler (``ours`` minus this is what the inner L3 run costs);
* ``ours_async``: ``await Worker.run_async`` on a fresh Worker (a Worker serves
  one API: its Scheduler binds to one event loop);
* ``ours_x4``: a Worker with 4 remote workers, each run submits one ``one_empty``
  to each of them: tasks/s, and ``x4_ratio`` = its tasks/s over ``ours``' tasks/s
  (repetition i against repetition i of this cell).

All sessions go to one service process, as several parents' sessions share one
``simpler-remote-worker`` per host in a deployment. Its runners run this checkout's code:
the service execs them isolated (``python -I``), which would import the installed
package (the editable install of the main checkout) and make a comparison against an
old worktree (``PYTHONPATH=<worktree>``) measure the new runner on both sides; the
service's runner command (``SIMPLER_REMOTE_RUNNER_ARGV``) is set to an isolated
interpreter with this checkout first on ``sys.path``. The peers have no remote
counterpart: the report puts our in-process W1 of the same invocation beside W7.

Every process started here is stopped at the end, also on error: the Workers
close their sessions, the service gets SIGTERM (SIGKILL after a grace), and every
runner and inner child seen during the cell is checked gone (killed and reported
in ``leftover_processes`` otherwise). Runners live in sessions of their own, so
the suite's per-cell session sweep would not see them.

Run inside the suite (``python -m benchmarks --only W1,W7``) or standalone::

    python -m benchmarks.w7 [--smoke] [--repeat N]

Before and after in one invocation: ``--compare OLD_CHECKOUT`` (a worktree of the
old commit with its extension built) keeps one session per side up and runs
``ours`` and ``ours_bare`` in alternating batches (``--rounds``, ``--runs``); it
reports, per variant, the median over the rounds of each side's batch median, p99
and CPU per run (this process, the runner and its children), and the per-round
ratios new / old::

    git worktree add -f /tmp/w7-old <rev>
    (cd /tmp/w7-old && /work/main/.venv/bin/python setup.py build_ext --inplace -q)
    python -m benchmarks.w7 --compare /tmp/w7-old [--rounds 30] [--runs 300]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.ours import (
    Closer,
    Orch,
    _time_runs,
    _time_runs_async,
    close_blocking,
    close_in,
    event_loop_runner,
    unavailable,
)
from benchmarks.proctree import descendants, process_table
from benchmarks.workloads import (
    WORKLOADS,
    Result,
    latency_rep,
    ok,
)

READY_TIMEOUT = 30.0  # s for the service to print its listening address
STOP_TIMEOUT = 15.0  # s after SIGTERM (it gives its runners worker.shutdown_grace = 10 s)
GONE_TIMEOUT = 5.0  # s for runners and their children to be gone once the service is
WARM_UP_RUNS = 20
NUM_REMOTE_X4 = 4
REMOTE_SUB_WORKERS = 1
EMPTY = "simpler_daemon.examples.tasks:empty"
ONE_EMPTY = "simpler_daemon.examples.remote:one_empty"
NOTHING = "simpler_daemon.examples.remote:nothing"
ALLOWED_MODULES = 'callables.allowed_modules=["simpler_daemon.examples."]'
TRANSPORT = "TCP over 127.0.0.1, no TLS, no token"
REPO_ROOT = Path(__file__).resolve().parent.parent
_LISTENING = re.compile(r"listening on (\S+)")
#: The service's runner command (its test hook; ``--spec F --ready-fd N`` are appended).
RUNNER_ARGV_ENV = "SIMPLER_REMOTE_RUNNER_ARGV"


def runner_argv(root: Path = REPO_ROOT) -> list[str]:
    """``python -I`` running the session runner of the checkout ``root`` (not the
    installed one)."""
    boot = (
        f"import sys; sys.path.insert(0, {str(root)!r}); "
        "from simpler_daemon.remote_worker.session import main; main()"
    )
    return [sys.executable, "-I", "-c", boot]


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` (field 22 of /proc/<pid>/stat); None when gone or a zombie.

    Compared with the value seen earlier so a recycled pid is never taken for
    (or killed as) a process this cell started.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()  # comm may hold spaces and ')'
    if fields[0] == b"Z":
        return None
    return int(fields[19])


class Service:
    """A running ``simpler-remote-worker`` and every process seen below it."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path
        self.endpoint = ""
        self.seen: dict[int, tuple[int, str]] = {}  # pid -> (start time, name)
        self.sessions = 0
        self.exit_code: int | None = None
        self.leftovers: list[str] = []

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def wait_listening(self) -> str:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            found = _LISTENING.search(self.log_path.read_text(errors="replace"))
            if found:
                self.endpoint = found.group(1)
                return self.endpoint
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"cannot start simpler-remote-worker: exited with {self.proc.returncode} "
                    f"before listening: {self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"cannot start simpler-remote-worker: not listening within "
                    f"{READY_TIMEOUT:.0f} s: {self.log_tail()}"
                )
            time.sleep(0.02)

    def track(self) -> None:
        """Remember every process now below the service (runners, their SUB children)."""
        table = process_table()
        for pid in descendants(self.proc.pid, table):
            start = _start_time(pid)
            if pid == self.proc.pid or start is None or pid in self.seen:
                continue
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            self.seen[pid] = (start, name)

    def _alive(self) -> list[int]:
        return [pid for pid, (start, _) in self.seen.items() if _start_time(pid) == start]

    def stop(self) -> None:
        """SIGTERM (the service stops its runners), SIGKILL after a grace; then sweep."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.exit_code = self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.exit_code = self.proc.wait()
        # Runners end with their sessions or by PDEATHSIG; give them a moment, then kill.
        deadline = time.monotonic() + GONE_TIMEOUT
        alive = self._alive()
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = self._alive()
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.leftovers = [f"{self.seen[pid][1]} (pid {pid})" for pid in alive]
        if self.leftovers:
            print(
                "w7: killed processes left after simpler-remote-worker stopped: "
                + ", ".join(self.leftovers),
                file=sys.stderr,
            )
        if self.exit_code != 0:
            print(
                f"w7: simpler-remote-worker exited with {self.exit_code}: {self.log_tail()}",
                file=sys.stderr,
            )


@contextlib.contextmanager
def remote_worker_service(root: Path = REPO_ROOT) -> Iterator[Service]:
    """``simpler-remote-worker serve`` on 127.0.0.1, any port, its runners running the code of
    the checkout ``root``; stopped (and swept) after."""
    with tempfile.TemporaryDirectory(prefix="bench-w7-") as tmp:
        log_path = Path(tmp) / "service.log"
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # never talk to a systemd that started the suite
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(root)) if p)
        env[RUNNER_ARGV_ENV] = json.dumps(runner_argv(root))
        cmd = [sys.executable, "-m", "simpler_daemon.remote_worker.service", "serve"]
        cmd += ["--listen", "127.0.0.1:0", "--set", ALLOWED_MODULES]
        # Its output goes to a file, never a pipe nobody reads (a full pipe blocks it).
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        service = Service(proc, log_path)
        try:
            service.wait_listening()
            yield service
        finally:
            service.track()
            service.stop()


@dataclass
class Session:
    """A started level-4 Worker with ``n`` remote workers and the W7 callables installed."""

    w: Any
    workers: list[int]
    one: Any  # handle of ONE_EMPTY
    nothing: Any  # handle of NOTHING

    def orch(self, handle: Any) -> Orch:
        """An orchestration submitting one ``handle`` task to each remote worker."""
        workers = self.workers

        def orch(o: Any, args: Any = None, config: Any = None) -> None:
            for r in workers:
                o.submit_next_level(handle, worker=r)

        return orch


@contextlib.contextmanager
def level4(service: Service, n: int, close: Closer = close_blocking) -> Iterator[Session]:
    from simpler_daemon import Worker
    from simpler_daemon.remote.spec import RemoteCallable, RemoteWorkerSpec

    w = Worker(level=4)
    try:
        spec = RemoteWorkerSpec(endpoint=service.endpoint, num_sub_workers=REMOTE_SUB_WORKERS)
        workers = [w.add_remote_worker(spec) for _ in range(n)]
        w.register(EMPTY, kind="sub", workers=workers)
        one = w.register(RemoteCallable(ONE_EMPTY), workers=workers)
        nothing = w.register(RemoteCallable(NOTHING), workers=workers)
        w.init()  # opens the n sessions (in parallel)
        service.track()
        service.sessions += n
        yield Session(w, workers, one, nothing)
    except BaseException:
        try:
            close(w)
        except Exception:
            traceback.print_exc()  # the original error is the one worth reporting
        raise
    else:
        close(w)


def _figures(samples: list[int], tasks_per_run: int) -> Result:
    """Latency figures of one repetition, plus tasks/s when its runs carry tasks."""
    rep = latency_rep(samples)
    if tasks_per_run:
        busy_s = sum(samples) / 1e9
        rep["tasks"] = tasks_per_run * len(samples)
        rep["tasks_per_s"] = rep["tasks"] / busy_s
    return rep


def _describe(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def _blocking(service: Service, n: int, repeat: int) -> tuple[list[Result], list[Result]]:
    """``ours`` and ``ours_bare`` on one Worker, interleaved per repetition (same noise)."""
    with level4(service, 1) as s:
        one, bare = s.orch(s.one), s.orch(s.nothing)
        _time_runs(s.w.run, one, WARM_UP_RUNS)
        _time_runs(s.w.run, bare, WARM_UP_RUNS)
        reps_one, reps_bare = [], []
        for _ in range(repeat):
            reps_one.append(_figures(_time_runs(s.w.run, one, n), 1))
            reps_bare.append(_figures(_time_runs(s.w.run, bare, n), 0))
    return reps_one, reps_bare


def _async(service: Service, n: int, repeat: int) -> tuple[list[Result], str]:
    runner, loop_name = event_loop_runner()
    with runner, level4(service, 1, close_in(runner)) as s:
        one = s.orch(s.one)
        runner.run(_time_runs_async(s.w.run_async, one, WARM_UP_RUNS))
        reps = [
            _figures(runner.run(_time_runs_async(s.w.run_async, one, n)), 1) for _ in range(repeat)
        ]
    return reps, loop_name


def _x4(service: Service, n: int, repeat: int) -> list[Result]:
    with level4(service, NUM_REMOTE_X4) as s:
        each = s.orch(s.one)
        _time_runs(s.w.run, each, WARM_UP_RUNS)
        return [_figures(_time_runs(s.w.run, each, n), NUM_REMOTE_X4) for _ in range(repeat)]


def measure(p: dict[str, int], repeat: int) -> dict[str, Result]:
    """W7 on the engine: ``{ours, ours_bare, ours_async, ours_x4}``; a variant that fails
    is ``unavailable`` with its reason and the others are still measured."""
    out: dict[str, Result] = {}
    common: dict[str, Any] = {"transport": TRANSPORT, "remote_sub_workers": REMOTE_SUB_WORKERS}
    with remote_worker_service() as service:
        common.update(endpoint=service.endpoint, service_pid=service.proc.pid)
        one_reps: list[Result] | None = None
        try:
            one_reps, bare_reps = _blocking(service, p["n"], repeat)
            out["ours"] = ok(one_reps, api="Worker.run", callable=ONE_EMPTY, **common)
            out["ours_bare"] = ok(bare_reps, api="Worker.run", callable=NOTHING, **common)
        except Exception as exc:
            traceback.print_exc()
            out["ours"], out["ours_bare"] = unavailable(_describe(exc)), unavailable(_describe(exc))
        try:
            reps, loop_name = _async(service, p["n"], repeat)
            out["ours_async"] = ok(
                reps, api="await Worker.run_async", loop=loop_name, callable=ONE_EMPTY, **common
            )
        except Exception as exc:
            traceback.print_exc()
            out["ours_async"] = unavailable(_describe(exc))
        try:
            reps = _x4(service, p["n_x4"], repeat)
            if one_reps is not None:
                for rep, base in zip(reps, one_reps, strict=True):
                    rep["x4_ratio"] = rep["tasks_per_s"] / base["tasks_per_s"]
            out["ours_x4"] = ok(
                reps,
                api="Worker.run, one task to each remote worker per run",
                remote_workers=NUM_REMOTE_X4,
                callable=ONE_EMPTY,
                **common,
            )
        except Exception as exc:
            traceback.print_exc()
            out["ours_x4"] = unavailable(_describe(exc))
    for res in out.values():
        if res["status"] == "ok":
            res["info"].update(sessions=service.sessions, service_exit=service.exit_code)
        if service.leftovers:
            res["leftover_processes"] = service.leftovers
    return out


# -- before and after in one invocation -------------------------------------------------------

#: The variants ``--compare`` alternates (one level-4 Worker with one remote worker each side).
COMPARE_VARIANTS = ("ours", "ours_bare")


def _cpu_ns(pids: Iterable[int]) -> int:
    """CPU time of every thread of ``pids`` so far (``/proc/<pid>/task/*/schedstat``)."""
    total = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                    total += int(fh.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total


def serve_batches(root: Path) -> int:
    """The measuring side of ``--compare``: W7's session with the code of ``root`` (this
    interpreter's ``PYTHONPATH``), one batch per stdin line ``<variant> <runs>``, one JSON
    line per batch: median and p99 round trip, and the CPU per run of this process, the
    runner and its children. Ends (and stops everything it started) at EOF."""
    with remote_worker_service(root) as service, level4(service, 1) as s:
        orchs = {"ours": s.orch(s.one), "ours_bare": s.orch(s.nothing)}
        for orch in orchs.values():
            _time_runs(s.w.run, orch, WARM_UP_RUNS)
        service.track()
        pids = [os.getpid(), *service.seen]
        print("ready", flush=True)
        for line in sys.stdin:
            name, count = line.split()
            cpu = _cpu_ns(pids)
            rep = latency_rep(_time_runs(s.w.run, orchs[name], int(count)))
            cpu_us = (_cpu_ns(pids) - cpu) / 1e3 / int(count)
            print(
                json.dumps(
                    {"median_us": rep["median_us"], "p99_us": rep["p99_us"], "cpu_us": cpu_us}
                ),
                flush=True,
            )
    return 0


def _ratios(old: list[float], new: list[float]) -> Result:
    ratios = [b / a for a, b in zip(old, new, strict=True)]
    return {
        "old": statistics.median(old),
        "new": statistics.median(new),
        "ratio_median": statistics.median(ratios),
        "ratios": [round(r, 3) for r in ratios],
    }


def compare(old_root: Path, rounds: int, runs: int) -> Result:
    """``ours`` and ``ours_bare`` of the checkout ``old_root`` against this one, in lockstep:
    both sessions stay up, and each round runs one batch of ``runs`` on each side in turn
    (the first side alternating), so both see the same machine. Figures: the median over
    the rounds of each side's batch median (p99, CPU per run), and the per-round ratios
    new / old."""
    sides = {"old": old_root.resolve(), "new": REPO_ROOT}
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for side, root in sides.items():
            env = dict(os.environ, PYTHONPATH=str(root))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-batches", str(root)]
            procs[side] = subprocess.Popen(
                cmd, cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
        for side, proc in procs.items():
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"cannot compare: the {side} side ({sides[side]}) did not start")
        got: dict[str, dict[str, list[Result]]] = {
            v: {side: [] for side in sides} for v in COMPARE_VARIANTS
        }
        for r in range(rounds):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for variant in COMPARE_VARIANTS:
                for side in order:
                    proc = procs[side]
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(f"{variant} {runs}\n")
                    proc.stdin.flush()
                    line = proc.stdout.readline()
                    if not line:
                        raise RuntimeError(f"cannot compare: the {side} side ended early")
                    got[variant][side].append(json.loads(line))
    finally:
        for proc in procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in procs.values():
            try:
                proc.wait(STOP_TIMEOUT + GONE_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    out: Result = {"old": str(sides["old"]), "new": str(sides["new"]), "rounds": rounds}
    out["runs_per_batch"] = runs
    for variant, by_side in got.items():
        out[variant] = {
            key: _ratios([b[key] for b in by_side["old"]], [b[key] for b in by_side["new"]])
            for key in ("median_us", "p99_us", "cpu_us")
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.w7", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--smoke", action="store_true", help="small counts")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--compare",
        metavar="OLD_CHECKOUT",
        type=Path,
        help="ours and ours_bare of OLD_CHECKOUT (a worktree with its extension built) against "
        "this checkout, alternating batches in one invocation",
    )
    ap.add_argument("--rounds", type=int, default=30, help="--compare: batches per side")
    ap.add_argument("--runs", type=int, default=300, help="--compare: runs per batch")
    ap.add_argument("--serve-batches", metavar="ROOT", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_batches is not None:
        return serve_batches(args.serve_batches)
    if args.compare is not None:
        print(json.dumps(compare(args.compare, args.rounds, args.runs), indent=1))
        return 0
    params = WORKLOADS["W7"].params(args.smoke)
    result = measure(params, args.repeat)
    for res in result.values():
        for rep in res.get("reps", []):
            rep.pop("samples_us", None)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
