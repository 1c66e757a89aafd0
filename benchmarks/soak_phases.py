"""The endurance phases of ``python -m benchmarks.soak`` after the kills.

::

    churn      client processes that connect (gRPC or the fast socket), register
               (a session reference), allocate, submit, and then close, exit without
               closing, or are SIGKILLed with their run in flight
    restarts   a load that keeps submitting while the daemon is SIGKILLed or SIGTERMed
               and started again on the same state directory

After each phase a :class:`Census` of the daemon is compared with the one taken before
it: registration references, buffers and heap bytes, queued runs, open file
descriptors and RSS must be back (fds and RSS within a margin). Every run a phase
submitted is accounted for: completed (its output checked), failed with a cause, or
LOST across a restart; none may be missing, and run and buffer ids never repeat
across restarts.

``python -m benchmarks.soak_phases client SOCKET MODE TRANSPORT LABEL`` is one churn
client (the soak starts it).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from simpler_daemon.client import Client
from simpler_daemon.client.errors import DaemonError, NotFound
from simpler_daemon.client.requests import sub_task, tensor

if TYPE_CHECKING:
    from benchmarks.soak import Daemon

EX = "simpler_daemon.examples.tasks"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: How far the daemon's open fds and RSS may end above their count before a phase.
FD_MARGIN = 16
RSS_MARGIN_BYTES = 96 << 20
#: How long a churn client or a run of the restart load may take.
CLIENT_S = 60.0


# -- the census ---------------------------------------------------------------------------------


@dataclass
class Census:
    """What must come back after a phase: the daemon's references, buffers, queue and
    process resources."""

    refs: dict[str, int]
    buffers: int
    heap_used: int
    queued: int
    fds: int
    rss: int

    @classmethod
    def take(cls, daemon: Daemon) -> Census:
        with daemon.client() as c:
            refs = {x.import_path: int(x.refcount) for x in c.list_callables()}
            listing = c.list_buffers()
            queued = len(c.list_runs(states=["queued"], limit=1000))
        pid = daemon.pid
        return cls(
            refs,
            len(listing.buffers),
            int(listing.heap.used_bytes),
            queued,
            len(os.listdir(f"/proc/{pid}/fd")),
            _rss(pid),
        )

    def compare(self, after: Census, phase: str) -> list[str]:
        problems = []
        if after.refs != self.refs:
            problems.append(f"{phase}: registration references {after.refs}, were {self.refs}")
        if (after.buffers, after.heap_used) != (self.buffers, self.heap_used):
            problems.append(
                f"{phase}: {after.buffers} buffers ({after.heap_used} heap bytes), were "
                f"{self.buffers} ({self.heap_used})"
            )
        if after.queued:
            problems.append(f"{phase}: {after.queued} runs still QUEUED")
        if after.fds > self.fds + FD_MARGIN:
            problems.append(f"{phase}: the daemon holds {after.fds} fds, {self.fds} before")
        if after.rss > self.rss + RSS_MARGIN_BYTES:
            problems.append(
                f"{phase}: the daemon's RSS is {after.rss >> 20} MiB, {self.rss >> 20} before"
            )
        return problems

    def line(self) -> str:
        refs = sum(self.refs.values())
        return (
            f"{refs} refs, {self.buffers} buffers ({self.heap_used} B), {self.queued} queued, "
            f"{self.fds} fds, {self.rss >> 20} MiB RSS"
        )


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class PhaseReport:
    name: str
    runs: int = 0
    completed: int = 0
    failed_with_cause: int = 0
    lost_across_restart: int = 0
    refused_stale: int = 0  # a buffer id from before a restart: refused, never aliased
    events: int = 0  # clients churned, or daemon restarts
    problems: list[str] = field(default_factory=list)
    before: str = ""
    after: str = ""

    def lines(self) -> list[str]:
        return [
            f"  phase {self.name}: {self.events} {'clients' if self.name == 'churn' else 'restarts'}, "
            f"{self.runs} runs: {self.completed} completed and verified, "
            f"{self.failed_with_cause} failed with a cause, {self.lost_across_restart} LOST "
            f"across a restart, {self.refused_stale} refused as stale; "
            f"{len(self.problems)} problems",
            f"    before: {self.before}",
            f"    after:  {self.after}",
            *(f"    problem: {p}" for p in self.problems[:20]),
        ]


# -- churn --------------------------------------------------------------------------------------


def churn(daemon: Daemon, seconds: float, seed: int) -> PhaseReport:
    """Short-lived client processes until ``seconds`` pass (see the module docstring)."""
    rng = random.Random(seed)
    report = PhaseReport("churn")
    before = Census.take(daemon)
    report.before = before.line()
    until = time.monotonic() + seconds
    runs: list[int] = []
    labels: list[str] = []
    while time.monotonic() < until:
        batch = []
        for _ in range(4):
            mode = rng.choice(("close", "exit", "kill"))
            transport = rng.choice(("grpc", "fast"))
            label = f"churn-{uuid.uuid4().hex[:8]}"
            cmd = [sys.executable, "-m", "benchmarks.soak_phases", "client"]
            cmd += [daemon.socket, mode, transport, label]
            proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            batch.append((proc, mode, label))
        for proc, mode, label in batch:
            labels.append(label)
            report.events += 1
            assert proc.stdout is not None
            line = proc.stdout.readline().split()  # "submitted RUN_ID"
            if len(line) == 2 and line[0] == "submitted":
                runs.append(int(line[1]))
            if mode == "kill":
                proc.kill()
            try:
                _, err = proc.communicate(timeout=CLIENT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                report.problems.append(f"churn client {label} ({mode}) hung")
                continue
            if mode != "kill" and proc.returncode != 0:
                report.problems.append(
                    f"churn client {label} ({mode}) exited {proc.returncode}: {err[-500:]}"
                )
    report.runs = len(runs)
    with daemon.client() as c:
        for run_id in runs:
            status = c.wait_run(run_id, CLIENT_S)
            if status.state.name == "COMPLETED":
                report.completed += 1
            else:
                report.problems.append(f"churn run {run_id}: {status.state.name}")
        # A killed client could not free its buffer: free what the churn left (the
        # heap accounting must then be back exactly).
        for b in c.list_buffers().buffers:
            if b.label.startswith("churn-"):
                c.free_buffer(b.buffer_id)
    after = _settled_census(daemon, before)
    report.after = after.line()
    report.problems += before.compare(after, "churn")
    return report


def _settled_census(daemon: Daemon, before: Census, timeout: float = 30.0) -> Census:
    """The census once the session leases of ended clients are released (a gRPC lease
    of a killed client ends when its stream breaks; a run still active keeps its
    callable until it ends)."""
    deadline = time.monotonic() + timeout
    while True:
        after = Census.take(daemon)
        if (
            after.refs == before.refs and after.buffers == before.buffers
        ) or time.monotonic() > deadline:
            return after
        time.sleep(0.1)


def churn_client(socket: str, mode: str, transport: str, label: str) -> int:
    """One churn client: register (a session reference), allocate, submit a fill, then
    end as ``mode`` says."""
    c = Client(socket, timeout=CLIENT_S, transport=transport)
    fill = c.register(f"{EX}:fill")
    bid = c.alloc_array(np.full(16, -1.0), label=label)
    value = random.randint(1, 1000)
    run = c.submit([sub_task(fill, [tensor(bid, "output", (16,), "float64")], [value])])
    print(f"submitted {int(run)}", flush=True)
    if mode == "kill":
        time.sleep(CLIENT_S)  # the soak SIGKILLs it here, its run in flight or done
        return 1
    status = c.wait_run(int(run), CLIENT_S)
    got = c.read_array(bid, (16,), np.float64)
    if status.state.name != "COMPLETED" or not (got == value).all():
        print(f"run {int(run)}: {status.state.name}, got {got.tolist()}", file=sys.stderr)
        return 1
    if mode == "exit":
        os._exit(0)  # no close, no free: the process end is the session's end
    c.free_buffer(bid)
    c.close()
    return 0


# -- restarts -----------------------------------------------------------------------------------


def restarts(daemon: Daemon, seconds: float, seed: int, register: Any) -> PhaseReport:
    """Submit fills without pause while the daemon is restarted (SIGKILL or SIGTERM,
    alternately) every few seconds on the same state directory; ``register(daemon)``
    registers the callables again after each start."""
    rng = random.Random(seed)
    report = PhaseReport("restarts")
    before = Census.take(daemon)
    report.before = before.line()
    until = time.monotonic() + seconds
    hashid = register(daemon)["fill"]
    submitted: list[tuple[int, int, float, int]] = []  # run id, buffer id, value, generation
    generation = 0
    ids_by_generation: dict[int, tuple[list[int], list[int]]] = {0: ([], [])}
    next_restart = time.monotonic() + rng.uniform(2.0, 4.0)
    c = daemon.client(timeout=10.0)
    try:
        while time.monotonic() < until:
            if time.monotonic() >= next_restart:
                c.close()
                how = "SIGKILL" if report.events % 2 == 0 else "SIGTERM"
                if how == "SIGKILL":
                    daemon.kill()
                else:
                    daemon.stop()
                daemon.start()
                report.events += 1
                generation += 1
                ids_by_generation[generation] = ([], [])
                hashid = register(daemon)["fill"]
                c = daemon.client(timeout=10.0)
                next_restart = time.monotonic() + rng.uniform(2.0, 4.0)
            value = float(rng.randint(1, 1000))
            try:
                bid = c.alloc_array(np.full(8, -1.0), label="restart-load")
                ids_by_generation[generation][1].append(bid)
                out = tensor(bid, "output", (8,), "float64")
                run = c.submit([sub_task(hashid, [out], [int(value)])])
            except NotFound:
                report.refused_stale += 1  # a buffer or callable of an earlier daemon
                continue
            except DaemonError as exc:
                report.problems.append(f"restart load: submit: {type(exc).__name__}: {exc}")
                continue
            ids_by_generation[generation][0].append(int(run))
            submitted.append((int(run), bid, value, generation))
            time.sleep(0.005)  # a steady load, not a flood the retention would drop
            if rng.random() < 0.5:  # some are waited for at once, some left in flight
                with_status(c, submitted[-1], report, generation, final=False)
    finally:
        c.close()
    report.runs = len(submitted)
    with daemon.client(timeout=30.0) as c:
        for entry in submitted:
            with_status(c, entry, report, generation, final=True)
        for b in c.list_buffers().buffers:
            if b.label == "restart-load":
                c.free_buffer(b.buffer_id)
    report.problems += _ids_never_repeat(ids_by_generation)
    # A new daemon process: its own baseline is what the first census after start saw
    # (fds and RSS of another process mean nothing here); refs and buffers must match.
    after = Census.take(daemon)
    report.after = after.line()
    for problem in before.compare(after, "restarts"):
        if "fds" not in problem and "RSS" not in problem:
            report.problems.append(problem)
    return report


def with_status(
    c: Client, entry: tuple[int, int, float, int], report: PhaseReport, current: int, *, final: bool
) -> None:
    """Account for one run of the restart load (``final``: at the end of the phase, on
    the last daemon; else at once after submit)."""
    run_id, bid, value, gen = entry
    try:
        status = c.wait_run(run_id, CLIENT_S)
    except NotFound as exc:
        # The soak's retention (max_finished_runs_kept) keeps every run it submits: a run
        # the daemon does not know is missing, whatever the text guesses.
        report.problems.append(f"run {run_id} (daemon {gen}) is missing from the history: {exc}")
        return
    except DaemonError:
        if final:
            raise
        return  # the daemon went away meanwhile: accounted for at the end
    state = status.state.name
    if not final:
        return
    if state == "COMPLETED":
        if gen == current:
            got = c.read_array(bid, (8,), np.float64)
            if not (got == value).all():
                report.problems.append(f"run {run_id}: wrong output {got.tolist()}, want {value}")
                return
        report.completed += 1
    elif state == "LOST":
        if gen == current:
            report.problems.append(f"run {run_id} LOST on the daemon that still runs")
        else:
            report.lost_across_restart += 1
    elif state in ("FAILED", "CANCELLED") and status.error is not None and status.error.message:
        report.failed_with_cause += 1
    else:
        report.problems.append(f"run {run_id} (daemon {gen}): {state} without a cause")


def _ids_never_repeat(by_generation: dict[int, tuple[list[int], list[int]]]) -> list[str]:
    problems = []
    last_runs = last_buffers = 0
    for gen in sorted(by_generation):
        runs, buffers = by_generation[gen]
        if runs and min(runs) <= last_runs:
            problems.append(f"daemon {gen} handed out run id {min(runs)} again (had {last_runs})")
        if buffers and min(buffers) <= last_buffers:
            problems.append(
                f"daemon {gen} handed out buffer id {min(buffers)} again (had {last_buffers})"
            )
        last_runs = max(runs, default=last_runs)
        last_buffers = max(buffers, default=last_buffers)
    return problems


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[0] == "client":
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        return churn_client(*argv[1:])
    print(
        "usage: python -m benchmarks.soak_phases client SOCKET MODE TRANSPORT LABEL",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
