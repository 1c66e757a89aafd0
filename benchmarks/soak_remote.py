"""The remote phase of ``python -m benchmarks.soak``: remote hosts blip while runs flow.

::

    this process
      ├─ simpler-daemon serve, level 4 (its own temp dir; not the level-3 daemon of the
      │    other phases): one [[workers.remote]] table per test host
      ├─ load      thread: batches of fill_check runs (benchmarks/soak_remote_jobs.py) to
      │            the remote workers, each checked on its remote host
      ├─ probe     Worker(level=4) in this process, a session on every host: remote
      │            buffers filled and read back around each blip
      └─ test hosts (network namespaces with a veth each when root, else loopback aliases)
           host i: simpler-remote-worker serve
                     └─ simpler-remote-l3-session per session (daemon's, probe's) + children

Blips, one after another, each on one host, the kinds in turn:

    link     the host's veth down for 1-15 s (netns only: loopback has no link)
    restart  the service SIGKILLed (its runners follow), started again 1-3 s later on
             the same address, as systemd's RestartSec would
    freeze   the service and every process below it SIGSTOPped for 2-6 s, then SIGCONT

A short phase (``seconds`` under 120) draws shorter link and freeze blips, still
around the session timeout (3 s), and always has at least one blip.

After each blip the host must have rejoined within :data:`REJOIN_S`: the daemon's
row READY and a new run on it COMPLETED, the probe's session ready and a fresh
remote buffer filled and read back. A probe buffer of the session before the blip
is either intact (the session survived) or refused as the data of an ended
session; anything else is a wrong result. Every run of the load is accounted for:
COMPLETED (checked remotely), or FAILED with ENDPOINT_FAILURE naming its remote
worker during a blip of that worker's host; never wrong, missing or stuck. At the
end nothing of the phase may be left: no process (found by an environment mark),
no ``/dev/shm`` file, no namespace, no socket.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from benchmarks.soak_phases import Census, PhaseReport
from benchmarks.soak_remote_jobs import CHECK, FILL, FILL_CHECK, WRONG
from simpler_daemon.callables import spec_for_import
from simpler_daemon.client.errors import NotFound
from simpler_daemon.client.requests import task
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.testing import alive, descendants, shm_files
from simpler_daemon.testing.netns import TestHosts

REPO_ROOT = Path(__file__).resolve().parent.parent
EX = "simpler_daemon.examples"
PORT: Final = 19073
#: The line a worker prints once its socket is bound.
_LISTENING: Final = re.compile(rb"^listening on \S+:\d+$", re.MULTILINE)
MARK_ENV: Final = "SIMPLER_SOAK_REMOTE_MARK"
#: ``SIMPLER_SOAK_LOOPBACK=1``: loopback hosts even as root (no link blips then).
LOOPBACK_ENV: Final = "SIMPLER_SOAK_LOOPBACK"
#: A host must serve new work again within this many seconds of a blip's end.
REJOIN_S: Final = 30.0
#: A session whose health lane is silent this long fails (the blips outlast it).
SESSION_TIMEOUT_S: Final = 3.0
#: Longest a run of the load may take before it counts as stuck.
RUN_WAIT_S: Final = 60.0
#: A failure is explained by a blip of its host within this many seconds of its life.
BLIP_SLACK_S: Final = 2.0
#: Blip lengths (seconds) at full scale; a short phase draws from the first
#: :data:`SHORT_S` seconds of each range, so both a blip the session survives and one
#: that ends it stay possible.
LINK_S: Final = (1.0, 15.0)
RESTART_AFTER_S: Final = (1.0, 3.0)
FREEZE_S: Final = (2.0, 6.0)
SHORT_S: Final = SESSION_TIMEOUT_S + 1.5


def daemon_config(run_dir: Path, state_dir: Path, endpoints: list[str]) -> str:
    remotes = "".join(
        f"""
[[workers.remote]]
endpoint = "{e}"
num_sub_workers = 1
heap_bytes = {8 << 20}
session_timeout_s = {SESSION_TIMEOUT_S}
callables = [
  {{ target = "{FILL_CHECK}", kind = "orchestration" }},
  {{ target = "{FILL}", kind = "sub" }},
  {{ target = "{CHECK}", kind = "sub" }},
]
"""
        for e in endpoints
    )
    return f"""
[daemon]
level = 4
runtime_dir = "{run_dir}"
state_dir = "{state_dir}"
startup_timeout = 20.0
shutdown_grace = 10.0
log_level = "warning"

[workers]
heap_bytes = {8 << 20}
heap_shared = true
{remotes}
[reconnect]
initial_s = 0.2
max_s = 1.0

[limits]
max_concurrent_runs = 64
max_finished_runs_kept = 20000   # every run of the phase is looked up after each blip

[callables]
allowed_modules = ["{EX}", "benchmarks.soak_remote_jobs"]
"""


# -- the hosts ------------------------------------------------------------------------------------


class Hosts:
    """Test hosts with one ``simpler-remote-worker`` each, which can be killed,
    restarted, frozen and cut off; every process below them carries :data:`MARK_ENV`."""

    def __init__(self, n: int, log_dir: Path) -> None:
        self.hosts = TestHosts(n, use_netns=False if os.environ.get(LOOPBACK_ENV) == "1" else None)
        self.log_dir = log_dir
        self.mark = uuid.uuid4().hex
        self.services: list[subprocess.Popen[bytes] | None] = [None] * n
        self.ports: list[int] = []
        self.seen: set[int] = set()

    def start(self) -> None:
        self.hosts.start()
        for i in range(self.hosts.n):
            self.ports.append(PORT if self.hosts.netns else _free_port(self.hosts.address(i)))
            self.start_service(i)

    def endpoint(self, i: int) -> str:
        return f"{self.hosts.address(i)}:{self.ports[i]}"

    def start_service(self, i: int, timeout: float = 30.0) -> None:
        argv = [sys.executable, "-m", "simpler_daemon.remote_worker.service", "serve"]
        argv += ["--listen", self.endpoint(i), "--insecure"]
        argv += ["--set", f'callables.allowed_modules=["{EX}.", "benchmarks.soak_remote_jobs"]']
        argv += ["--set", f'callables.python_path=["{REPO_ROOT}"]']
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env[MARK_ENV] = self.mark
        env.pop("NOTIFY_SOCKET", None)
        log = self.log_dir / f"remote-worker-{i}.log"
        start = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as out:
            proc = self.hosts.run_in(
                i, argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, cwd=REPO_ROOT
            )
        self.services[i] = proc
        self.seen.add(proc.pid)
        deadline = time.monotonic() + timeout
        # The worker's own line, printed once its socket is bound (not a log line).
        while not _LISTENING.search(log.read_bytes()[start:]):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"simpler-remote-worker on host {i} did not start (exit {proc.poll()}):\n"
                    + log.read_text(errors="replace")[-3000:]
                )
            time.sleep(0.05)

    def tree(self, i: int) -> set[int]:
        proc = self.services[i]
        if proc is None or proc.poll() is not None:
            return set()
        pids = {proc.pid} | descendants(proc.pid)
        self.seen |= pids
        return pids

    def kill_service(self, i: int) -> set[int]:
        """SIGKILL host ``i``'s service; the processes it had (its runners must follow)."""
        proc = self.services[i]
        assert proc is not None
        old = self.tree(i)
        proc.kill()
        proc.wait(10)
        return old

    def stop_services(self) -> list[str]:
        problems = []
        for i, proc in enumerate(self.services):
            if proc is None or proc.poll() is not None:
                continue
            self.tree(i)
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait(10)
            if code != 0:
                problems.append(f"simpler-remote-worker on host {i} exited {code} on SIGTERM")
        return problems

    def marked(self) -> set[int]:
        """Live processes carrying this phase's mark (an orphan is found too)."""
        needle = f"{MARK_ENV}={self.mark}".encode()
        found = set()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as fh:
                    if needle in fh.read().split(b"\0") and alive(int(name)):
                        found.add(int(name))
            except OSError:
                continue
        self.seen |= found
        return found

    def close(self) -> list[str]:
        """Tear everything down (always); what was left is a problem."""
        problems = []
        try:
            problems += self.stop_services()
        finally:
            namespaces = list(self.hosts.namespaces)
            try:
                self.hosts.close()
            except RuntimeError as exc:
                problems.append(str(exc))
        if namespaces:
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
            left_ns = [ns for ns in namespaces if ns in listed.stdout.split()]
            if left_ns:
                problems.append(f"network namespaces left: {left_ns}")
        deadline = time.monotonic() + 10.0
        while self.marked() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = sorted(self.marked() | {p for p in self.seen if alive(p)})
        if left:
            problems.append(f"remote processes outlived the phase: {left}")
            for p in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
        return problems


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


# -- the report -----------------------------------------------------------------------------------


@dataclass
class RemoteReport(PhaseReport):
    hosts: int = 0
    transport: str = ""
    blips: Counter[str] = field(default_factory=Counter)
    rejoin_s: list[float] = field(default_factory=list)
    sessions_renewed: int = 0  # blips after which the daemon's worker had a new session
    kept: int = 0  # probe buffers that survived a blip with their data
    probe_runs: int = 0

    def lines(self) -> list[str]:
        rejoin = (
            f"rejoined in {min(self.rejoin_s):.1f}-{max(self.rejoin_s):.1f} s"
            if self.rejoin_s
            else "no rejoin"
        )
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.blips.items())) or "none"
        return [
            f"  phase {self.name}: {self.events} blips ({kinds}) on {self.hosts} hosts "
            f"({self.transport}), {rejoin}, {self.sessions_renewed} new sessions; "
            f"{self.runs} runs: {self.completed} completed and verified, "
            f"{self.failed_with_cause} failed with a cause; probe: {self.probe_runs} buffers "
            f"filled and read back, {self.kept} kept their data across a blip, "
            f"{self.refused_stale} uses of a stale one refused (copies and tasks); "
            f"{len(self.problems)} problems",
            f"    before: {self.before}",
            f"    after:  {self.after}",
            *(f"    problem: {p}" for p in self.problems[:20]),
        ]


# -- the load -------------------------------------------------------------------------------------


@dataclass
class Outcome:
    run_id: int
    worker: int
    start: float
    end: float
    state: str
    outcome: str = ""
    text: str = ""


class Load:
    """Batches of 1-3 ``fill_check`` runs, each to a random remote worker, waited for."""

    def __init__(self, daemon: Any, workers: list[int], seed: int) -> None:
        self.client = daemon.client(timeout=30.0)
        self.workers = workers
        self.rng = random.Random(seed)
        self.hashid = spec_for_import(FILL_CHECK, "orchestration").handle.hashid
        self.stop = threading.Event()
        self.outcomes: list[Outcome] = []
        self.errors: list[str] = []

    def submit(self, worker: int) -> tuple[int, float]:
        value, n = self.rng.randint(1, 1_000_000), self.rng.randint(1, 256)
        args = pb.Args(scalars=[value, n])
        t = task("next_level", self.hashid, [args], workers=[worker])
        start = time.monotonic()
        return int(self.client.submit([t], label=f"soak-remote-{worker}")), start

    def settle(self, run_id: int, worker: int, start: float) -> Outcome:
        status = self.client.wait_run(run_id, RUN_WAIT_S)
        state = pb.RunState.Name(status.state).removeprefix("RUN_STATE_")
        out = Outcome(run_id, worker, start, time.monotonic(), state)
        if status.error is not None:
            out.outcome = status.error.outcome
            out.text = f"{status.error.message} {status.error.remote_text}".strip()
        return out

    def loop(self) -> None:
        try:
            while not self.stop.is_set():
                batch = []
                for _ in range(self.rng.randint(1, 3)):
                    w = self.rng.choice(self.workers)
                    batch.append((*self.submit(w), w))
                for run_id, start, w in batch:
                    self.outcomes.append(self.settle(run_id, w, start))
                if any(o.state != "COMPLETED" for o in self.outcomes[-len(batch) :]):
                    time.sleep(0.05)  # a worker that is down fails runs at once: no flood
        except Exception as exc:  # a load that cannot talk to its daemon is a failure
            self.errors.append(f"remote load: {type(exc).__name__}: {exc}")


def classify(
    report: RemoteReport, outcomes: list[Outcome], windows: dict[int, list[tuple[float, float]]]
) -> None:
    """Every run: COMPLETED, or FAILED by its own remote worker during a blip of its host."""
    for o in outcomes:
        who = f"run {o.run_id} on remote worker {o.worker}"
        blipped = any(
            a - BLIP_SLACK_S <= o.end and o.start <= b + BLIP_SLACK_S
            for a, b in windows.get(o.worker, [])
        )
        if o.state == "COMPLETED":
            report.completed += 1
        elif WRONG in o.text:
            report.problems.append(f"{who}: WRONG RESULT: {o.text[:500]}")
        elif o.state not in ("FAILED", "CANCELLED", "LOST"):
            report.problems.append(f"{who}: still {o.state} after {RUN_WAIT_S:.0f} s")
        elif (
            o.state == "FAILED"
            and o.outcome == "ENDPOINT_FAILURE"
            and f"remote worker {o.worker}" in o.text
            and blipped
        ):
            report.failed_with_cause += 1
        else:
            when = "during a blip of its host" if blipped else "with no blip of its host"
            report.problems.append(f"{who}: {o.state} {when}: {o.outcome}: {o.text[:500]}")


# -- the probe: remote buffers around each blip -----------------------------------------------------


class Probe:
    """A ``Worker(level=4)`` in this process with a session on every host (it forks
    nothing: a level-4 Worker has no SUB children of its own)."""

    def __init__(self, endpoints: list[str]) -> None:
        from simpler_daemon.engine.worker import Worker
        from simpler_daemon.remote.spec import ReconnectPolicy, RemoteCallable, RemoteWorkerSpec

        self.w4 = Worker(
            level=4,
            heap_bytes=1 << 20,
            startup_timeout=10.0,
            reconnect=ReconnectPolicy(initial_s=0.2, max_s=1.0),
        )
        self.ids = []
        for e in endpoints:
            spec = RemoteWorkerSpec(
                endpoint=e,
                num_sub_workers=1,
                session_timeout_s=SESSION_TIMEOUT_S,
                heap_bytes=4 << 20,
            )
            self.ids.append(self.w4.add_remote_worker(spec))
        self.w4.register(FILL, kind="sub", workers=self.ids)
        self.fill_all = self.w4.register(RemoteCallable(f"{EX}.remote:fill_all"), workers=self.ids)
        self.rng = random.Random(0)
        self.w4.init()

    def row(self, i: int) -> dict[str, Any]:
        wid = self.ids[i]
        return next(
            r for r in self.w4.list_workers() if r.get("worker_id") == wid and r["kind"] == "remote"
        )

    def filled(self, i: int) -> tuple[Any, float]:
        """A fresh buffer on host ``i``, filled by a run and read back."""
        ref = self.w4.alloc_remote(self.ids[i], (16,), "float64")
        value = float(self.rng.randint(1, 1_000_000))
        self.fill(i, ref, value)
        got = self.w4.copy_from_remote(ref)
        if not (got == value).all():
            raise AssertionError(f"probe buffer on host {i}: read {got[:4]}, wrote {value}")
        return ref, value

    def fill(self, i: int, ref: Any, value: float) -> None:
        """A run that fills ``ref`` with ``value`` on host ``i``'s worker."""
        from simpler_daemon import CallConfig, Tag, TaskArgs

        args = TaskArgs().add_tensor(ref, Tag.OUTPUT).add_scalar(int(value))
        wid, handle = self.ids[i], self.fill_all

        def orch(o: Any, _a: Any, _c: Any) -> None:
            o.submit_next_level(handle, args, CallConfig(), worker=wid)

        self.w4.submit(orch).wait(30.0)

    def close(self) -> None:
        self.w4.close()


def _until(predicate: Any, timeout: float) -> Any:
    """``predicate()`` retried until it returns without raising (its last error then)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return predicate()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# -- the phase ------------------------------------------------------------------------------------


def remote(seconds: float, seed: int, keep: bool = False) -> RemoteReport:
    """Blips of remote hosts for ``seconds`` while runs flow (see the module docstring)."""
    from benchmarks.soak import Daemon, ours_in_shm, workdir

    rng = random.Random(seed)
    n = 1 if seconds < 60 else 2
    report = RemoteReport("remote", hosts=n)
    shm_before = shm_files()
    with workdir(keep) as d:
        hosts = Hosts(n, d)
        daemon: Daemon | None = None
        probe: Probe | None = None
        load: Load | None = None
        thread: threading.Thread | None = None
        daemon_pids: set[int] = set()
        try:
            hosts.start()
            report.transport = "network namespaces" if hosts.hosts.netns else "loopback"
            endpoints = [hosts.endpoint(i) for i in range(n)]
            daemon = Daemon(d)
            daemon.config.write_text(daemon_config(d / "run", d / "state", endpoints))
            daemon.start()
            with daemon.client() as c:
                rows = [w for w in c.list_workers() if w.kind == pb.WORKER_KIND_REMOTE_L3]
            workers = [w.worker_id for w in rows]  # in table order: worker i is on host i
            probe = Probe(endpoints)
            before = Census.take(daemon)
            report.before = before.line()
            load = Load(daemon, workers, seed + 101)
            thread = threading.Thread(target=load.loop, name="soak-remote-load", daemon=True)
            thread.start()
            windows: dict[int, list[tuple[float, float]]] = {w: [] for w in workers}
            kinds = ["restart", "freeze"] + (["link"] if hosts.hosts.netns else [])
            rng.shuffle(kinds)
            until = time.monotonic() + seconds
            checked = 0
            scale = min(1.0, seconds / 120.0)  # a short phase gets short blips
            while report.events == 0 or time.monotonic() < until:
                kind = kinds[report.events % len(kinds)]
                i = rng.randrange(n)
                daemon_pids |= descendants(daemon.pid)
                blip(report, hosts, daemon, probe, workers, windows, kind, i, rng, scale)
                # Looked up as they go: the history keeps the last 20000 runs only.
                seen = len(load.outcomes)
                report.problems += accounted(daemon, load.outcomes[checked:seen])
                checked = seen
                if time.monotonic() < until:
                    time.sleep(rng.uniform(0.5, 2.0) * scale + 0.2)  # runs flow between blips
            load.stop.set()
            thread.join(RUN_WAIT_S * 4)
            if thread.is_alive():
                report.problems.append("remote load did not stop")
            report.problems += load.errors
            report.runs = len(load.outcomes)
            classify(report, load.outcomes, windows)
            report.problems += accounted(daemon, load.outcomes[checked:])
            after = Census.take(daemon)
            report.after = after.line()
            report.problems += before.compare(after, "remote")
        except Exception as exc:
            report.problems.append(f"remote: {type(exc).__name__}: {exc}")
        finally:
            if load is not None:
                load.stop.set()
                if thread is not None:
                    thread.join(RUN_WAIT_S)
                load.client.close()
            if probe is not None:
                probe.close()
            if daemon is not None and daemon.proc is not None:
                daemon_pids |= descendants(daemon.pid) | {daemon.pid}
                code = daemon.stop()
                if code != 0:
                    report.problems.append(
                        f"remote: the level-4 daemon did not stop cleanly (exit {code}):\n"
                        f"{daemon.stderr()}"
                    )
            report.problems += hosts.close()
        deadline = time.monotonic() + 10.0
        while [p for p in daemon_pids if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        left = sorted(p for p in daemon_pids if alive(p))
        if left:
            report.problems.append(f"remote: processes outlived the level-4 daemon: {left}")
        shm = ours_in_shm(daemon_pids | hosts.seen | {os.getpid()}) - shm_before
        if shm:
            report.problems.append(f"remote: files left in /dev/shm: {sorted(shm)}")
        if daemon is not None and os.path.exists(daemon.socket):
            report.problems.append(f"remote: socket left behind: {daemon.socket}")
    return report


def blip(
    report: RemoteReport,
    hosts: Hosts,
    daemon: Any,
    probe: Probe,
    workers: list[int],
    windows: dict[int, list[tuple[float, float]]],
    kind: str,
    i: int,
    rng: random.Random,
    scale: float,
) -> None:
    """One blip of host ``i``, then proof that it rejoined (see the module docstring)."""
    wid = workers[i]
    with daemon.client() as c:
        gen_before = _row(c, wid).remote.session_generation
    ref, value = probe.filled(i)
    report.probe_runs += 1
    start = time.monotonic()
    orphans: set[int] = set()
    if kind == "link":
        length = rng.uniform(*_scaled(LINK_S, scale))
        hosts.hosts.link_down(i)
        try:
            time.sleep(length)
        finally:
            hosts.hosts.link_up(i)
    elif kind == "restart":
        length = rng.uniform(*RESTART_AFTER_S)
        orphans = hosts.kill_service(i)
        time.sleep(length)
        hosts.start_service(i)
    else:
        length = rng.uniform(*_scaled(FREEZE_S, scale))
        frozen = hosts.tree(i)
        for p in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
        try:
            time.sleep(length)
        finally:
            for p in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGCONT)
    report.events += 1
    report.blips[kind] += 1
    ended = time.monotonic()
    what = f"{kind} blip of host {i} ({length:.1f} s)"
    try:
        gen_after = _rejoin(daemon, wid, REJOIN_S, what)
        if gen_after != gen_before:
            report.sessions_renewed += 1
        probe_rejoin(report, probe, i, ref, value, what)
        report.rejoin_s.append(time.monotonic() - ended)
        deadline = time.monotonic() + 10.0
        while [p for p in orphans if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        if [p for p in orphans if alive(p)]:
            report.problems.append(
                f"{what}: processes of the killed service still alive 10 s after the rejoin: "
                f"{sorted(p for p in orphans if alive(p))}"
            )
    except Exception as exc:
        report.problems.append(f"{what}: {type(exc).__name__}: {exc}")
    finally:
        windows[wid].append((start, time.monotonic()))
        hosts.tree(i)


def _scaled(span: tuple[float, float], scale: float) -> tuple[float, float]:
    low, high = span
    return low, max(min(high, low + SHORT_S), low + (high - low) * scale)


def _row(c: Any, wid: int) -> Any:
    return next(w for w in c.list_workers() if w.worker_id == wid)


def _rejoin(daemon: Any, wid: int, timeout: float, what: str) -> int:
    """Wait until the daemon's worker ``wid`` is READY with a fresh heartbeat and a new run
    on it COMPLETED; its session generation."""
    hashid = spec_for_import(FILL_CHECK, "orchestration").handle.hashid
    deadline = time.monotonic() + timeout
    last = "never READY"
    with daemon.client() as c:
        while time.monotonic() < deadline:
            w = _row(c, wid)
            if (
                w.remote.state == pb.REMOTE_SESSION_STATE_READY
                and w.state in (pb.WORKER_STATE_IDLE, pb.WORKER_STATE_BUSY)
                and w.remote.health_age_seconds < 1.0
            ):
                t = task("next_level", hashid, [pb.Args(scalars=[7, 8])], workers=[wid])
                status = c.wait_run(c.submit([t], label="soak-remote-rejoin"), RUN_WAIT_S)
                if status.state == pb.RUN_STATE_COMPLETED:
                    return int(_row(c, wid).remote.session_generation)
                last = f"new run {pb.RunState.Name(status.state)}: {status.error.message[:300]}"
            else:
                last = f"{pb.RemoteSessionState.Name(w.remote.state)}: {w.message[:300]}"
            time.sleep(0.2)
    raise TimeoutError(
        f"remote worker {wid} did not rejoin the daemon within {timeout:.0f} s of the "
        f"{what} ({last})"
    )


def probe_rejoin(
    report: RemoteReport, probe: Probe, i: int, ref: Any, value: float, what: str
) -> None:
    """The probe's buffer of before the blip is intact or refused as lost, never other
    data; a fresh buffer is filled and read back within :data:`REJOIN_S`."""

    def ready() -> None:
        row = probe.row(i)
        if row["state"] != "ready":
            raise RuntimeError(f"probe session on host {i}: {row['state']} {row.get('reason')}")

    _until(ready, REJOIN_S)
    try:
        got = _until(lambda: _copy_or_lost(probe, ref), REJOIN_S)
    except Exception as exc:
        raise RuntimeError(f"probe buffer of before the blip: {exc}") from exc
    if got is None:
        report.refused_stale += 1
        try:  # a task on it is refused too, and touches no buffer of the new session
            probe.fill(i, ref, value + 1)
        except Exception as exc:
            if "its data is lost" not in str(exc):
                report.problems.append(f"{what}: a task on a stale buffer: unexplained {exc}")
            else:
                report.refused_stale += 1
        else:
            report.problems.append(f"{what}: WRONG: a task on a stale buffer completed")
    elif (got == value).all():
        report.kept += 1
        probe.w4.free(ref)
    else:
        report.problems.append(
            f"{what}: WRONG RESULT: probe buffer {ref.buffer_id} read {got[:4]}, wrote {value}"
        )
    fresh, _ = _until(lambda: probe.filled(i), REJOIN_S)
    report.probe_runs += 1
    probe.w4.free(fresh)


def _copy_or_lost(probe: Probe, ref: Any) -> Any:
    """The buffer's data, or None when it is refused as the data of an ended session;
    raises (``EndpointError``, to be retried) while the session is down."""
    try:
        return probe.w4.copy_from_remote(ref)
    except ValueError as exc:
        if "which ended: its data is lost" in str(exc):
            return None
        raise


def accounted(daemon: Any, outcomes: list[Outcome]) -> list[str]:
    """Every run the load saw end is in the daemon's history, terminal, as it was seen
    (``NotFound`` here is a run missing from the history: a problem)."""
    problems = []
    with daemon.client() as c:
        for o in outcomes:
            try:
                status = c.wait_run(o.run_id, 5.0)
            except NotFound as exc:
                problems.append(f"run {o.run_id} is missing from the history: {exc}")
                continue
            state = pb.RunState.Name(status.state).removeprefix("RUN_STATE_")
            if state != o.state:
                problems.append(f"run {o.run_id}: the history says {state}, the load saw {o.state}")
    return problems
