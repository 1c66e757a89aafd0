"""``python -m benchmarks.soak --seconds N``: a bounded soak of a real daemon under faults.

What it does::

    this process
      ├─ simpler-daemon serve (temp config: 2 SUB workers, 1 simulated chip, shared heap)
      │    ├─ SUB / chip children ........ killed at random (SIGKILL, SIGSEGV)
      │    └─ fork server ................ killed at random (below its restart budget)
      ├─ client A ┐ threads, one simpler_daemon.client.Client each: batches of runs
      ├─ client B ┘ (SUB fills, chip kernels, dependency graphs, failing runs, cancels)
      └─ chaos     thread: the kills, and a census of every process the daemon owns

Every run is checked: a completed run's outputs against the values it was given, a
failing run's error and its untouched dependants, a cancelled run's untouched
dependants. A run may fail only when it was meant to, or when a kill happened during
its life and the error says so (a killed child). At the end the chaos stops, a last
run of every shape must complete on the recovered workers, the daemon gets SIGTERM
and must exit 0, and no process it ever had and no ``/dev/shm`` file of it may remain.

That is the kills phase (2/5 of ``--seconds``). Then ``benchmarks/soak_phases.py``
runs client churn and daemon restarts on the same daemon, each checked against a
census taken before it (references, buffers, queued runs, fds, RSS) and every run
accounted for. ``benchmarks/soak_remote.py`` blips remote hosts (link down, service
restarted, host frozen) under a level-4 daemon of its own while runs flow; every host
must rejoin. ``--phases`` picks and orders them.

Exit status: 0 clean; 1 any lost, wrong, missing or unexplained run, a census that did
not come back, a leak, or an unclean stop; 2 the daemon did not start. ``make soak``
runs it for 300 s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

from simpler_daemon.client import Client
from simpler_daemon.client.requests import task, tensor
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.testing import alive, child_pids, descendants, shm_files

EX = "simpler_daemon.examples.tasks"
REPO_ROOT = Path(__file__).resolve().parent.parent

#: Longest a run may take before it counts as lost (a kill adds a replacement at most).
RUN_WAIT_S = 45.0
#: A failure is explained by a kill that happened within this many seconds of the run's life.
KILL_SLACK_S = 1.0
#: Seconds between two fork server kills: at most 4 a minute, below the engine's
#: crash-loop bound (5 restarts in 60 s), which would rightly refuse more.
FORKSERVER_KILL_EVERY_S = (15.0, 25.0)
#: How long the end of the soak waits for every worker to be back.
RECOVER_S = 60.0
#: The texts of a failure caused by a killed child or fork server.
KILL_CAUSES = ("killed by", "exited", "fork server", "endpoint failure", "stopped")

DEFAULT = -1.0  # every output starts as this: a lost write shows up as a wrong value


def daemon_config(run_dir: Path, state_dir: Path) -> str:
    return f"""
[daemon]
runtime_dir = "{run_dir}"
state_dir = "{state_dir}"
startup_timeout = 30.0
shutdown_grace = 10.0
log_level = "warning"

[workers]
num_sub_workers = 2
num_chips = 1
heap_bytes = {32 << 20}
heap_shared = true

[limits]
max_tasks_per_run = 64
max_concurrent_runs = 64
max_streams_per_client = 8
max_finished_runs_kept = 20000   # the restart phase checks every run it submitted

[callables]
allowed_modules = ["{EX}"]
"""


# -- bookkeeping --------------------------------------------------------------------------------


@dataclass
class Tally:
    """Counters shared by the client threads and the chaos thread (under ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    runs: Counter[str] = field(default_factory=Counter)  # by shape
    completed: int = 0
    failed_intended: int = 0  # the runs meant to fail (or to be cancelled) did
    failed_by_kill: int = 0  # failures a kill explains
    unexpected: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    kills: Counter[str] = field(default_factory=Counter)  # "sub SIGKILL", "fork server"...
    kill_times: list[float] = field(default_factory=list)
    seen_pids: set[int] = field(default_factory=set)

    def killed_during(self, start: float, end: float) -> bool:
        with self.lock:
            return any(start - KILL_SLACK_S <= t <= end + KILL_SLACK_S for t in self.kill_times)

    def add(self, what: str, text: str = "") -> None:
        with self.lock:
            if what == "completed":
                self.completed += 1
            elif what == "intended":
                self.failed_intended += 1
            elif what == "kill":
                self.failed_by_kill += 1
            else:
                getattr(self, what).append(text)


def worker_pids(rows: Any) -> set[int]:
    out: set[int] = set()
    for r in rows:
        if r.pid:
            out.add(int(r.pid))
        out |= worker_pids(r.children)
    return out


# -- the daemon -----------------------------------------------------------------------------------


class Daemon:
    """``simpler-daemon serve`` with a temp config and runtime dir."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.socket = str(directory / "run" / "daemon.sock")
        self.config = directory / "daemon.toml"
        self.config.write_text(daemon_config(directory / "run", directory / "state"))
        self.stderr_path = directory / "stderr.txt"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> None:
        cmd = [sys.executable, "-m", "simpler_daemon.server.main", "serve"]
        cmd += ["--config", str(self.config)]
        # Its config names its socket and state_dir: no variable may override them (the
        # test suite sets SIMPLER_DAEMON__DAEMON__STATE_DIR=:memory: for its daemons).
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("SIMPLER_DAEMON_SOCKET", "SIMPLER_DAEMON__DAEMON__STATE_DIR")
        }
        with open(self.stderr_path, "ab") as err:  # a restart appends
            self.proc = subprocess.Popen(
                cmd,
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
            )  # our process group: whoever kills the soak's group kills the daemon too
        deadline = time.monotonic() + timeout
        last = "no socket yet"
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.stderr()}")
            if os.path.exists(self.socket):
                try:
                    with self.client(timeout=2.0) as c:
                        c.get_info()
                        return
                except Exception as exc:  # not serving yet: retry until the deadline
                    last = f"GetInfo: {type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"daemon not ready within {timeout:.0f} s ({last[:500]}):\n{self.stderr()}"
                )
            time.sleep(0.05)

    def client(self, timeout: float = 30.0) -> Client:
        return Client(self.socket, timeout=timeout)

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 40.0) -> int | None:
        """SIGTERM and wait; the exit status, or None when it had to be SIGKILLed."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # its children follow it (their parent-death signal)
            self.proc.wait(10)


# -- the load -------------------------------------------------------------------------------------


@dataclass
class Planned:
    """One run: its tasks, what it should end as, and how to check its outputs."""

    shape: str
    tasks: list[pb.Task]
    expect: str  # "complete" | "fail" | "cancel"
    check: Callable[[], str | None]  # None when the outputs are right
    buffers: list[int] = field(default_factory=list)
    fail_text: str = ""
    flag: int | None = None  # a wait_for_flag buffer, released after the cancel
    run_id: int = 0
    start: float = 0.0


class Load:
    """One client: batches of 1-3 runs of random shapes, submitted together, each verified."""

    def __init__(
        self, name: str, daemon: Daemon, hashids: dict[str, str], tally: Tally, seed: int
    ) -> None:
        self.name = name
        self.client = daemon.client()
        self.h = hashids
        self.tally = tally
        self.rng = random.Random(seed)

    # -- buffers ----------------------------------------------------------------------------

    def _buf(self, n: int, plan_buffers: list[int], dtype: Any = np.float64) -> int:
        fill = 0 if dtype == np.uint8 else DEFAULT
        bid = self.client.alloc_array(np.full(n, fill, dtype=dtype), label=self.name)
        plan_buffers.append(bid)
        return bid

    def _read(self, bid: int, n: int) -> np.ndarray[Any, Any]:
        return self.client.read_array(bid, (n,), np.float64)

    @staticmethod
    def _expect(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any], what: str) -> str | None:
        if np.array_equal(got, want):
            return None
        return f"{what}: got {got.tolist()}, want {want.tolist()}"

    def _t(self, bid: int, tag: str, n: int = 8, offset: int = 0, dt: str = "float64") -> Any:
        return tensor(bid, tag, [n], dt, byte_offset=offset)

    def _sub(self, name: str, tensors: list[Any], scalars: list[int]) -> pb.Task:
        return task("sub", self.h[name], [pb.Args(tensors=tensors, scalars=scalars)])

    def _chip(self, tensors: list[Any], scalars: list[int]) -> pb.Task:
        args = pb.Args(tensors=tensors, scalars=scalars)
        return task("next_level", self.h["scale_kernel"], [args], workers=[0])

    # -- shapes -----------------------------------------------------------------------------

    def plan_fills(self) -> Planned:
        """Short SUB tasks: independent fills of the slices of one buffer."""
        n = self.rng.randint(1, 8)
        bufs: list[int] = []
        b = self._buf(4 * n, bufs)
        vals = [self.rng.randint(1, 1_000_000) for _ in range(n)]
        tasks = [
            self._sub("fill", [self._t(b, "output", 4, 32 * i)], [v]) for i, v in enumerate(vals)
        ]
        want = np.repeat(np.array(vals, dtype=np.float64), 4)
        return Planned(
            "sub",
            tasks,
            "complete",
            lambda: self._expect(self._read(b, 4 * n), want, "fills"),
            bufs,
        )

    def plan_chip(self) -> Planned:
        """A SUB fill, then a chip kernel scaling it in place."""
        bufs: list[int] = []
        b = self._buf(8, bufs)
        v, k = self.rng.randint(1, 10_000), self.rng.randint(2, 9)
        tasks = [
            self._sub("fill", [self._t(b, "output")], [v]),
            self._chip([self._t(b, "inout")], [k]),
        ]
        want = np.full(8, float(v * k))
        return Planned(
            "chip", tasks, "complete", lambda: self._expect(self._read(b, 8), want, "chip"), bufs
        )

    def plan_graph(self) -> Planned:
        """fill a, fill b -> add c = a + b -> scale c -> chip scale c: (v1 + v2) * k1 * k2."""
        bufs: list[int] = []
        a, b, c = self._buf(8, bufs), self._buf(8, bufs), self._buf(8, bufs)
        v1, v2 = self.rng.randint(1, 1000), self.rng.randint(1, 1000)
        k1, k2 = self.rng.randint(2, 9), self.rng.randint(2, 9)
        tasks = [
            self._sub("fill", [self._t(a, "output")], [v1]),
            self._sub("fill", [self._t(b, "output")], [v2]),
            self._sub("add", [self._t(a, "input"), self._t(b, "input"), self._t(c, "output")], []),
            self._sub("scale", [self._t(c, "inout")], [k1]),
            self._chip([self._t(c, "inout")], [k2]),
        ]
        want = np.full(8, float((v1 + v2) * k1 * k2))
        return Planned(
            "graph", tasks, "complete", lambda: self._expect(self._read(c, 8), want, "graph"), bufs
        )

    def plan_fail(self) -> Planned:
        """fill a; a failing task that 'writes' b; add a + b -> c must never run."""
        bufs: list[int] = []
        a, b, c = self._buf(8, bufs), self._buf(8, bufs), self._buf(8, bufs)
        s = self.rng.randint(1, 1_000_000)
        tasks = [
            self._sub("fill", [self._t(a, "output")], [1]),
            self._sub("fail", [self._t(b, "output")], [s]),
            self._sub("add", [self._t(a, "input"), self._t(b, "input"), self._t(c, "output")], []),
        ]
        want = np.full(8, DEFAULT)
        plan = Planned(
            "fail",
            tasks,
            "fail",
            lambda: self._expect(self._read(c, 8), want, "dependant of a failed task"),
            bufs,
        )
        plan.fail_text = f"example failure (scalar {s})"
        return plan

    def plan_cancel(self) -> Planned:
        """A task held on a flag, and a dependant; the run is cancelled, the dependant never runs."""
        bufs: list[int] = []
        flag = self._buf(8, bufs, np.uint8)
        c = self._buf(8, bufs)
        tasks = [
            self._sub("wait_for_flag", [self._t(flag, "inout", 8, 0, "uint8")], [10_000]),
            self._sub("fill", [self._t(c, "output"), self._t(flag, "input", 8, 0, "uint8")], [7]),
        ]
        want = np.full(8, DEFAULT)
        plan = Planned(
            "cancel",
            tasks,
            "cancel",
            lambda: self._expect(self._read(c, 8), want, "dependant of a cancelled run"),
            bufs,
        )
        plan.flag = flag
        return plan

    def plan(self) -> Planned:
        shape = self.rng.choices(
            [self.plan_fills, self.plan_chip, self.plan_graph, self.plan_fail, self.plan_cancel],
            weights=[40, 15, 25, 10, 10],
        )[0]
        return shape()

    # -- one batch --------------------------------------------------------------------------

    def batch(self) -> None:
        plans = [self.plan() for _ in range(self.rng.randint(1, 3))]
        for p in plans:
            p.start = time.monotonic()
            p.run_id = self.client.submit(p.tasks, label=f"{self.name}-{p.shape}")
            with self.tally.lock:
                self.tally.runs[p.shape] += 1
        for p in plans:
            if p.expect == "cancel":
                time.sleep(
                    self.rng.uniform(0.0, 0.02)
                )  # sometimes before dispatch, sometimes after
                self.client.cancel(p.run_id, reason="soak")
                assert p.flag is not None
                self.client.write_buffer(p.flag, np.array([1] + [0] * 7, dtype=np.uint8))
        for p in plans:
            self.settle(p)
        for p in plans:
            for bid in p.buffers:
                self.client.free_buffer(bid)

    def settle(self, p: Planned) -> None:
        who = f"{self.name} run {p.run_id} ({p.shape})"
        status = self.client.wait_run(p.run_id, RUN_WAIT_S)
        end = time.monotonic()
        state = pb.RunState.Name(status.state).removeprefix("RUN_STATE_")
        if state not in ("COMPLETED", "FAILED", "CANCELLED"):
            self.tally.add("lost", f"{who}: still {state} after {RUN_WAIT_S:.0f} s")
            return
        err = status.error  # None for a completed run
        outcome = err.outcome if err is not None else ""
        text = f"{outcome}: {err.message} {err.remote_text}".strip() if err is not None else ""
        by_kill = (
            state != "COMPLETED"
            and self.tally.killed_during(p.start, end)
            and (outcome == "ENDPOINT_FAILURE" or any(c in text for c in KILL_CAUSES))
        )
        if p.expect == "complete":
            if state == "COMPLETED":
                problem = p.check()
                self.tally.add("wrong", f"{who}: {problem}") if problem else self.tally.add(
                    "completed"
                )
            elif by_kill:
                self.tally.add("kill")
            else:
                self.tally.add("unexpected", f"{who}: {state} {text[:1000]}")
            return
        if state == "COMPLETED":
            self.tally.add("wrong", f"{who}: COMPLETED, expected {p.expect}")
            return
        wanted = "FAILED" if p.expect == "fail" else "CANCELLED"
        if state == wanted and (p.expect != "fail" or p.fail_text in text):
            problem = p.check()
            self.tally.add("wrong", f"{who}: {problem}") if problem else self.tally.add("intended")
        elif by_kill:
            self.tally.add("kill")
        else:
            self.tally.add("unexpected", f"{who}: {state} {text[:1000]}, expected {p.expect}")

    def loop(self, until: float, errors: list[str]) -> None:
        try:
            while time.monotonic() < until:
                self.batch()
        except Exception as exc:  # a client that cannot talk to the daemon is a failure
            errors.append(f"{self.name}: {type(exc).__name__}: {exc}")
        finally:
            self.client.close()


# -- the chaos ------------------------------------------------------------------------------------


class Chaos:
    """Random kills of SUB and chip children (SIGKILL / SIGSEGV) and of the fork server."""

    def __init__(
        self, daemon: Daemon, tally: Tally, seed: int, interval: tuple[float, float]
    ) -> None:
        self.daemon = daemon
        self.tally = tally
        self.rng = random.Random(seed)
        self.interval = interval
        self.stop = threading.Event()
        self.client = daemon.client(timeout=10.0)
        # The first fork server kill comes early, so even a short soak has one.
        self._next_server_kill = time.monotonic() + self.rng.uniform(5.0, 15.0)
        self._maybe_servers: set[int] = set()

    def census(self) -> tuple[set[int], set[int]]:
        """The workers' pids and the fork servers': the daemon's own children that are no
        worker (replacements are its children too), seen in two censuses in a row so a
        replacement still starting up is never taken for a server."""
        rows = self.client.list_workers()
        workers = worker_pids(rows)
        tree = descendants(self.daemon.pid)
        with self.tally.lock:
            self.tally.seen_pids |= workers | tree
        others = {p for p in child_pids(self.daemon.pid) if alive(p)} - workers
        others -= worker_pids(self.client.list_workers())
        servers, self._maybe_servers = others & self._maybe_servers, others
        return workers, servers

    def kill_one(self) -> None:
        rows = [r for r in self.client.list_workers() if r.pid and alive(int(r.pid))]
        _, servers = self.census()
        now = time.monotonic()
        if servers and now >= self._next_server_kill:
            self._kill(self.rng.choice(sorted(servers)), signal.SIGKILL, "fork server SIGKILL")
            self._next_server_kill = now + self.rng.uniform(*FORKSERVER_KILL_EVERY_S)
            return
        if not rows:
            return
        row = self.rng.choice(rows)
        sig = signal.SIGKILL if self.rng.random() < 0.75 else signal.SIGSEGV
        kind = pb.WorkerKind.Name(row.kind).removeprefix("WORKER_KIND_").lower()
        self._kill(int(row.pid), sig, f"{kind} {sig.name}")

    def _kill(self, pid: int, sig: int, what: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            with self.tally.lock:
                self.tally.kills[what] += 1
                self.tally.kill_times.append(time.monotonic())

    def loop(self, errors: list[str]) -> None:
        try:
            while not self.stop.wait(self.rng.uniform(*self.interval)):
                self.kill_one()
        except Exception as exc:
            errors.append(f"chaos: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        self.client.close()


# -- the end: recovery, stop, leaks -----------------------------------------------------------------


def await_recovery(daemon: Daemon, tally: Tally) -> str | None:
    """Every worker is back (alive, not FAILED or STARTING) within RECOVER_S."""
    deadline = time.monotonic() + RECOVER_S
    with daemon.client() as c:
        while True:
            rows = c.list_workers()
            bad = [
                f"{pb.WorkerKind.Name(r.kind)} {r.worker_id}: {pb.WorkerState.Name(r.state)} {r.message}"
                for r in rows
                if r.state not in (pb.WORKER_STATE_IDLE, pb.WORKER_STATE_BUSY) or not alive(r.pid)
            ]
            with tally.lock:
                tally.seen_pids |= worker_pids(rows) | descendants(daemon.pid)
            if not bad:
                return None
            if time.monotonic() > deadline:
                return f"workers not recovered within {RECOVER_S:.0f} s: {'; '.join(bad)}"
            time.sleep(0.2)


def final_runs(daemon: Daemon, hashids: dict[str, str], tally: Tally) -> None:
    """After the chaos, each shape once more: all must end as intended, with no kill to blame."""
    load = Load("final", daemon, hashids, tally, seed=0)
    try:
        for shape in (load.plan_fills, load.plan_chip, load.plan_graph, load.plan_fail):
            p = shape()
            p.start = time.monotonic()
            p.run_id = load.client.submit(p.tasks, label=f"final-{p.shape}")
            with tally.lock:
                tally.runs[p.shape] += 1
            load.settle(p)
            for bid in p.buffers:
                load.client.free_buffer(bid)
    finally:
        load.client.close()


def ours_in_shm(pids: set[int]) -> set[str]:
    """/dev/shm files named after one of our processes (simpler-heap-<pid>-...)."""
    return {n for n in shm_files() if any(f"-{p}-" in n for p in pids)}


def register(daemon: Daemon) -> dict[str, str]:
    with daemon.client() as c:
        # persist: the soak's registrations outlive this short client session.
        names = ("fill", "add", "scale", "fail", "wait_for_flag")
        out = {n: c.register(f"{EX}:{n}", persist=True) for n in names}
        out["scale_kernel"] = c.register(f"{EX}:scale_kernel", kind="chip", persist=True)
    return out


def summary(tally: Tally, seconds: float, problems: list[str], phases: Sequence[str] = ()) -> str:
    runs = sum(tally.runs.values())
    kills = sum(tally.kills.values())
    lines = [
        f"soak: {seconds:.0f} s, {runs} runs ({', '.join(f'{k} {v}' for k, v in sorted(tally.runs.items()))})",
        f"  kills: {kills} ({', '.join(f'{k} {v}' for k, v in sorted(tally.kills.items())) or 'none'})",
        f"  completed and verified: {tally.completed}",
        f"  failures expected: {tally.failed_intended} intended (failing / cancelled runs), "
        f"{tally.failed_by_kill} caused by a kill",
        f"  failures unexpected: {len(tally.unexpected)}",
        f"  lost: {len(tally.lost)}   wrong: {len(tally.wrong)}",
        f"  processes seen: {len(tally.seen_pids)}",
        *phases,
    ]
    for title, items in (
        ("unexpected", tally.unexpected),
        ("lost", tally.lost),
        ("wrong", tally.wrong),
        ("problem", problems),
    ):
        lines += [f"  {title}: {x}" for x in items[:20]]
        if len(items) > 20:
            lines.append(f"  ... and {len(items) - 20} more {title}")
    lines.append(
        "soak: " + ("FAILED" if problems or tally.unexpected or tally.lost or tally.wrong else "ok")
    )
    return "\n".join(lines)


@contextlib.contextmanager
def workdir(keep: bool) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="simpler-soak-"))
    try:
        yield d
    finally:
        if not keep:
            shutil.rmtree(d, ignore_errors=True)


#: Each phase's share of ``--seconds`` (benchmarks/soak_phases.py has churn and restarts,
#: benchmarks/soak_remote.py the remote blips).
PHASES: Final = {"kills": 0.4, "churn": 0.2, "restarts": 0.2, "remote": 0.2}


def soak(
    seconds: float,
    seed: int,
    interval: tuple[float, float],
    keep: bool,
    phases: Sequence[str] = tuple(PHASES),
) -> int:
    from benchmarks import soak_phases

    tally = Tally()
    problems: list[str] = []
    reports: list[soak_phases.PhaseReport] = []
    share = sum(PHASES[p] for p in phases)
    length = {p: seconds * PHASES[p] / share for p in phases}
    with workdir(keep) as d:
        daemon = Daemon(d)
        try:
            daemon.start()
        except RuntimeError as exc:
            daemon.kill()
            print(f"soak: cannot start the daemon: {exc}", file=sys.stderr)
            return 2
        try:
            hashids = register(daemon)
            before = soak_phases.Census.take(daemon)
            chaos = Chaos(daemon, tally, seed, interval)
            chaos.census()
            until = time.monotonic() + length.get("kills", 0.0)
            loads = [Load(n, daemon, hashids, tally, seed + i + 1) for i, n in enumerate("AB")]
            threads = [
                threading.Thread(
                    target=ld.loop, args=(until, problems), name=f"soak-{ld.name}", daemon=True
                )
                for ld in loads
            ]
            killer = threading.Thread(
                target=chaos.loop, args=(problems,), name="soak-chaos", daemon=True
            )
            for t in [*threads, killer]:
                t.start()
            for t in threads:
                t.join()
            chaos.stop.set()
            killer.join()
            chaos.census()
            chaos.close()
            stuck = await_recovery(daemon, tally)
            if stuck:
                problems.append(stuck)
            else:
                final_runs(daemon, hashids, tally)
                problems += before.compare(soak_phases.Census.take(daemon), "kills")
            with tally.lock:
                tally.seen_pids |= descendants(daemon.pid)
            if "churn" in length and not problems:
                reports.append(soak_phases.churn(daemon, length["churn"], seed))
            if "restarts" in length and not problems:

                def track(daemon: Daemon) -> dict[str, str]:
                    with tally.lock:  # the old daemon's processes must be gone at the end
                        tally.seen_pids |= descendants(daemon.pid) | {daemon.pid}
                    return register(daemon)

                reports.append(soak_phases.restarts(daemon, length["restarts"], seed, track))
            if "remote" in length and not problems:
                # Its own level-4 daemon and remote hosts, started and stopped by the
                # phase (which checks their leaks): this daemon only waits meanwhile.
                from benchmarks import soak_remote

                reports.append(soak_remote.remote(length["remote"], seed, keep))
            with tally.lock:
                tally.seen_pids |= descendants(daemon.pid)
            for report in reports:
                problems += report.problems
        except Exception as exc:
            problems.append(f"soak: {type(exc).__name__}: {exc}")
        finally:
            code = daemon.stop()
        if code != 0:
            problems.append(f"daemon did not stop cleanly (exit {code}):\n{daemon.stderr()}")
        seen = tally.seen_pids | {daemon.pid}
        deadline = time.monotonic() + 10.0
        while [p for p in seen if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        left = sorted(p for p in seen if alive(p))
        if left:
            problems.append(f"processes outlived the daemon: {left}")
            for p in left:  # leave the machine clean even when the soak fails
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
        shm = ours_in_shm(seen)
        if shm:
            problems.append(f"files left in /dev/shm: {sorted(shm)}")
        if os.path.exists(daemon.socket):
            problems.append(f"socket left behind: {daemon.socket}")
        print(summary(tally, seconds, problems, [x for r in reports for x in r.lines()]))
    return 1 if problems or tally.unexpected or tally.lost or tally.wrong else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.soak",
        description="Soak a real daemon under random kills; every run verified.",
    )
    ap.add_argument("--seconds", type=float, default=300.0, help="length of the load (default 300)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock)")
    ap.add_argument(
        "--kill-every",
        type=float,
        nargs=2,
        default=(1.5, 4.5),
        metavar=("MIN", "MAX"),
        help="seconds between two kills, drawn uniformly (default 1.5 4.5)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (config, daemon log)")
    ap.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"comma-separated phases, run in this order (default {','.join(PHASES)})",
    )
    ns = ap.parse_args(argv)
    if not ns.seconds > 0:
        ap.error("--seconds must be > 0")
    seed = ns.seed if ns.seed is not None else int(time.time())
    print(f"soak: seed {seed}, {ns.seconds:.0f} s", flush=True)
    phases = [p for p in ns.phases.split(",") if p]
    unknown = [p for p in phases if p not in PHASES]
    if unknown or not phases:
        ap.error(f"--phases: unknown {unknown} (choose from {', '.join(PHASES)})")
    return soak(ns.seconds, seed, (ns.kill_every[0], ns.kill_every[1]), ns.keep, phases)


if __name__ == "__main__":
    sys.exit(main())
