"""The crash table: fault x worker kind x phase.

Faults: SIGKILL, SIGSEGV, ``os._exit(3)``, SIGSTOP, and a task that ignores its deadline
(it blocks SIGALRM, swallows it, and keeps running). Worker kinds: a SUB worker, a chip
worker, and a nested local L3 child (``Worker(level=4)`` with ``add_worker(Worker(level=3))``).
Phases: the worker is idle, it is running a task, or it is inside a control (the register
of a callable whose import crashes or blocks).

Every cell asserts four things:

* outcome: the affected run (or register) fails; with an idle worker no run fails;
* cause: the message names the signal, the exit code, ``stopped`` or
  ``deadline exceeded (N ms)`` (idle deaths: the replacement's log record does);
* recovery: the next run on the same Worker succeeds on a new child (list_workers /
  restarts), and the bystander children were not touched;
* no leak: the conftest guard checks children and /dev/shm (overridden here only to
  ignore other live processes' heaps on a shared machine); each cell also checks that
  every descendant it saw (grandchildren, inner fork servers, processes a task spawned)
  is gone once the Worker is closed.

Cells whose fault has no natural meaning get a defined expectation instead of a skip:

* idle + ``os._exit(3)``: a task leaves a thread behind that exits the child once the
  run has completed and the test raises a heap flag (the child dies on its own, idle);
* idle + SIGSTOP: the next run must not hang; it either fails with ``stopped`` (the
  stopped child took it) or completes on a replacement, and the stopped child is gone;
* idle + deadline: a worker idle for longer than deadline + grace is not killed by the
  parent's deadline clock: runs with ``deadline_ms`` before and after the idle time
  complete on the same child and nothing restarts;
* control + SIGSTOP / deadline: the register fails at the control deadline (``stopped``
  or ``timed out``) and the child is replaced. ``CONTROL_TIMEOUT_S`` is shortened for
  these cells (patched wherever the engine defines it) so the table stays quick.

Running cells hit the fault twice: the first victim is forked by the Worker, the second
by the fork server (the replacement), whose death status must be forwarded too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import signal
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpler_daemon import CallConfig, RunCancelled, RunState, Tag, TaskError, Worker
from simpler_daemon.callables import CallableHandle
from simpler_daemon.engine.worker import RunHandle
from simpler_daemon.errors import RegistrationError
from simpler_daemon.testing import alive, child_pids, descendants, poll_for, stopped
from tests.support import sub_tasks as tasks
from tests.support.crash_tasks import (
    ARM_EXIT,
    MODE,
    QUICK,
    WAIT_S,
    misbehave,
    misbehave_orch,
    probe_orch,
)
from tests.support.sub_tasks import targs

pytestmark = pytest.mark.timeout(60)

HEAP = 1 << 20
#: ``deadline_ms`` of the task that ignores its deadline.
DEADLINE_MS = 300
#: The control deadline these cells use (the engine's default is 30 s).
SHORT_CONTROL_TIMEOUT_S = 3.0
#: A register still waiting this long has no working control deadline (even the engine's
#: default, 30 s, is shorter).
WATCHDOG_S = 40.0

FAULTS = ["sigkill", "sigsegv", "exit3", "sigstop", "deadline"]
KINDS = ["sub", "chip", "l3"]
PHASES = ["idle", "running", "control"]


CAUSE = {
    "sigkill": "killed by SIGKILL",
    "sigsegv": "killed by SIGSEGV",
    "exit3": "exited with code 3",
    "sigstop": "stopped",
    "deadline": f"deadline exceeded ({DEADLINE_MS} ms)",
}
#: In a control the blocked child is caught by the control deadline.
CONTROL_CAUSE = {**CAUSE, "sigstop": r"stopped|timed out", "deadline": r"timed out"}


IMPORT_FAULT = {
    "sigkill": "os.kill(os.getpid(), signal.SIGKILL)",
    "sigsegv": "faulthandler.disable()\nctypes.string_at(0)",
    "exit3": "os._exit(3)",
    "sigstop": "os.kill(os.getpid(), signal.SIGSTOP)",
    # An import that outlives any control deadline and cannot be interrupted by SIGALRM.
    "deadline": (
        f"signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGALRM}})\ntime.sleep({WAIT_S * 2})"
    ),
}


def write_crashing_module(directory: Path, fault: str) -> tuple[str, Path]:
    """A module whose import records its pid in a marker file, then faults."""
    name = f"crash_import_{fault}_{uuid.uuid4().hex[:8]}"
    marker = directory / f"{name}.pid"
    body = (
        "import ctypes, faulthandler, os, signal, time\n"
        f"with open({str(marker)!r}, 'w') as f:\n"
        "    f.write(str(os.getpid()))\n"
        f"{IMPORT_FAULT[fault]}\n"
        "def fn(args):\n    pass\n"
        "def kernel(args, config):\n    pass\n"
        "def orch(o, a, c):\n    pass\n"
    )
    (directory / f"{name}.py").write_text(body)
    return name, marker


# -- process bookkeeping ---------------------------------------------------------------------------


# -- one Worker per cell, seen through its victim ---------------------------------------------------


@dataclass
class Rig:
    """A Worker with one child of ``kind`` (the victim) and one bystander of another kind."""

    kind: str
    w: Worker
    misbehave: CallableHandle
    probe: CallableHandle
    rec: np.ndarray[Any, Any]
    flag: np.ndarray[Any, Any]
    seen: set[int] = field(default_factory=set)

    worker_id = 0

    def rows(self) -> list[dict[str, Any]]:
        return self.w.list_workers()

    def victim_row(self) -> dict[str, Any]:
        return next(
            r for r in self.rows() if r["kind"] == self.kind and r["worker_id"] == self.worker_id
        )

    def victim_pid(self) -> int:
        return int(self.victim_row()["pid"])

    def bystanders(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(kind, id) -> (pid, restarts) of every other child of this Worker."""
        return {
            (r["kind"], r["worker_id"]): (r["pid"], r["restarts"])
            for r in self.rows()
            if r["kind"] != self.kind
        }

    def restarts(self) -> int:
        return int(self.w.restarts.get(self.kind, 0))

    def note(self) -> None:
        """Remember every descendant alive now: all must be gone after close."""
        self.seen |= descendants()

    def drive(self, seconds: float = 0.01) -> None:
        """Run Scheduler rounds: deaths are noticed and replacements started."""
        self.w._drive_until(lambda: False, seconds)

    def submit(self, mode: int, config: CallConfig | None = None) -> RunHandle:
        """One run whose single task (on the victim) misbehaves as ``mode`` says."""
        t = targs((self.rec, Tag.NO_DEP), (self.flag, Tag.NO_DEP), scalars=(mode,))
        h, k = self.misbehave, self.kind
        if k == "sub":
            return self.w.submit(lambda o, a, c: o.submit_sub(h, t, config))
        return self.w.submit(
            lambda o, a, c: o.submit_next_level(h, t, config, worker=self.worker_id)
        )

    def run_probe(self, timeout: float = WAIT_S) -> int:
        """A good run on the victim's lane; returns the pid that ran it."""
        out = self.w.alloc((4,), "int64")
        try:
            h = self.probe
            if self.kind == "sub":
                handle = self.w.submit(
                    lambda o, a, c: o.submit_sub(h, targs((out, Tag.OUTPUT), scalars=(0,)))
                )
            else:
                handle = self.w.submit(
                    lambda o, a, c: o.submit_next_level(
                        h, targs((out, Tag.INOUT)), worker=self.worker_id
                    )
                )
            handle.wait(timeout)
            if self.kind == "l3":  # the L3 child's whole subtree works again
                assert out[2] != 0 and out[2] in child_pids(int(out[0]))
            return int(out[0])
        finally:
            self.w.free(out)

    def wait_replaced(self, old: int, restarts: int) -> int:
        """Poll until the victim's lane has a live child other than ``old``; its pid."""

        def replaced() -> int:
            self.drive()
            row = self.victim_row()
            ok = row["pid"] != old and row["alive"] and row["poisoned"] is None
            ok = ok and self.restarts() >= restarts and row["restarts"] >= restarts
            if self.kind == "l3":
                ok = ok and row["state"] == "ready"
            return int(row["pid"]) if ok else 0

        new = poll_for(replaced, timeout=WAIT_S, message=f"{self.kind} child {old} not replaced")
        self.note()
        return new


def make_rig(kind: str) -> Rig:
    if kind == "l3":
        inner = Worker(level=3, num_sub_workers=1, num_chips=1, heap_bytes=HEAP)
        inner.register(tasks.record_pid)
        w = Worker(level=4, num_sub_workers=1, heap_bytes=HEAP, startup_timeout=20.0)
        w.add_worker(inner)
        bad, probe = w.register(misbehave_orch), w.register(probe_orch)
        w.register(tasks.record_pid)  # the bystander SUB worker of the L4
    else:
        w = Worker(num_sub_workers=1, num_chips=1, heap_bytes=HEAP, startup_timeout=20.0)
        w.register(tasks.record_pid)
        w.register("tests.support.chip_kernels:record_pid", kind="chip")
        if kind == "sub":
            bad, probe = w.register(misbehave), w.register(tasks.record_pid)
        else:
            bad = w.register("tests.support.crash_tasks:misbehave_kernel", kind="chip")
            probe = w.register("tests.support.chip_kernels:record_pid", kind="chip")
    w.init()
    rig = Rig(kind, w, bad, probe, w.alloc((4,), "int64"), w.alloc((2,), "int64"))
    rig.note()
    return rig


@contextlib.contextmanager
def rig_for(kind: str) -> Iterator[Rig]:
    """A fresh Rig, closed at the end; then every descendant it saw must be gone (when
    the cell already failed, its own error is kept and the leftovers are only killed)."""
    rig = make_rig(kind)
    try:
        yield rig
    except BaseException:
        _close(rig, check=False)
        raise
    _close(rig, check=True)


def _close(rig: Rig, check: bool) -> None:
    with contextlib.suppress(Exception):
        rig.note()
    rig.w.close(timeout=5.0)

    def left() -> list[int]:
        return sorted(p for p in rig.seen if alive(p))

    with contextlib.suppress(TimeoutError):
        poll_for(lambda: not left(), timeout=10.0)
    leaked = left()
    for p in leaked:  # leave the machine clean for the next cell
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    assert not (check and leaked), f"processes outlived the Worker: {leaked}"


@pytest.fixture
def short_control_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shorten the control deadline wherever the engine defines it (set before the
    Worker forks, so a nested L3 child inherits it too)."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("simpler_daemon") and hasattr(mod, "CONTROL_TIMEOUT_S"):
            monkeypatch.setattr(mod, "CONTROL_TIMEOUT_S", SHORT_CONTROL_TIMEOUT_S)


def texts(err: BaseException) -> str:
    return f"{err}\n{getattr(err, 'remote_text', '')}"


def assert_bystanders(rig: Rig, before: dict[tuple[str, int], tuple[int, int]]) -> None:
    assert rig.bystanders() == before, "a child of another kind was disturbed"


# -- phase: running a task -----------------------------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("kind", KINDS)
def test_fault_while_running_a_task(kind: str, fault: str) -> None:
    config = CallConfig(deadline_ms=DEADLINE_MS) if fault == "deadline" else None
    with rig_for(kind) as rig:
        others = rig.bystanders()
        spawned: list[int] = []
        for round_ in (1, 2):  # the second victim was forked by the fork server
            victim = rig.victim_pid()
            rig.rec[:] = 0
            handle = rig.submit(MODE[fault], config)
            with pytest.raises(TaskError) as info:
                handle.wait(WAIT_S)
            rig.note()
            err = info.value
            assert not isinstance(err, RunCancelled)
            assert handle.state is RunState.FAILED
            assert int(rig.rec[0]) == victim, "the task did not run on the victim"
            spawned.append(int(rig.rec[1]))
            rig.seen.add(spawned[-1])
            assert err.worker_id == rig.worker_id, texts(err)
            assert CAUSE[fault] in texts(err), f"round {round_}: {texts(err)}"
            if fault != "deadline":
                assert err.outcome == "ENDPOINT_FAILURE", texts(err)
            new = rig.wait_replaced(victim, round_)
            assert not alive(victim)
            assert rig.run_probe() == new
            assert_bystanders(rig, others)
    # The processes the tasks spawned into their worker's group are gone as well.
    assert all(spawned) and not [p for p in spawned if alive(p)]


# -- phase: idle ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("kind", KINDS)
def test_fault_while_idle(kind: str, fault: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with rig_for(kind) as rig:
        others = rig.bystanders()
        victim = rig.victim_pid()
        assert rig.run_probe() == victim  # warm: the victim has served a run
        if fault == "deadline":
            _idle_past_a_deadline(rig, victim)
            assert_bystanders(rig, others)
            return
        if fault == "sigstop":
            _idle_stop(rig, victim)
            assert_bystanders(rig, others)
            return
        # The whole thread group is gone only when the pidfd turns readable: the leader
        # shows as a zombie in /proc while a chip's device thread is still exiting, and
        # a task published to a child that is still exiting fails with it.
        gone = os.pidfd_open(victim)
        try:
            if fault == "exit3":
                rig.submit(ARM_EXIT).wait(WAIT_S)  # completes: the child is idle again
                rig.flag[0] = 1
            else:
                os.kill(victim, signal.SIGKILL if fault == "sigkill" else signal.SIGSEGV)
            poll_for(
                lambda: select.select([gone], [], [], 0)[0],
                timeout=WAIT_S,
                message=f"{victim} did not die",
            )
        finally:
            os.close(gone)
        # No run fails: one submitted right away waits for the replacement.
        new = rig.run_probe()
        assert new != victim
        assert rig.wait_replaced(victim, 1) == new
        assert rig.restarts() == 1
        logged = [r.getMessage() for r in caplog.records if f"pid {victim}" in r.getMessage()]
        assert any(CAUSE[fault] in m for m in logged), logged
        assert_bystanders(rig, others)


def _idle_past_a_deadline(rig: Rig, victim: int) -> None:
    """A deadline clock must not fire on an idle worker: runs with ``deadline_ms`` before
    and after an idle period longer than the deadline complete on the same child."""
    config = CallConfig(deadline_ms=DEADLINE_MS)
    rig.submit(QUICK, config).wait(WAIT_S)
    rig.drive(3 * DEADLINE_MS / 1000.0)  # idle (the Scheduler keeps running) past it
    rig.rec[:] = 0
    rig.submit(QUICK, config).wait(WAIT_S)
    assert int(rig.rec[0]) == victim
    assert rig.victim_pid() == victim and rig.restarts() == 0


def _idle_stop(rig: Rig, victim: int) -> None:
    """SIGSTOP while idle: the next run must not hang. Either it reaches the stopped child
    and fails naming it ``stopped``, or the stop was noticed first and it runs on a
    replacement; in both cases the stopped child is killed and replaced."""
    os.kill(victim, signal.SIGSTOP)
    poll_for(lambda: stopped(victim), timeout=WAIT_S, message=f"{victim} not stopped")
    try:
        ran_on = rig.run_probe()
    except TaskError as err:
        assert err.worker_id == rig.worker_id, texts(err)
        assert "stopped" in texts(err), texts(err)
    else:
        assert ran_on != victim
    new = rig.wait_replaced(victim, 1)
    poll_for(lambda: not alive(victim), timeout=WAIT_S, message=f"stopped {victim} not killed")
    assert rig.run_probe() == new


# -- phase: in a control (register of a callable whose import faults) ------------------------------


@pytest.mark.usefixtures("short_control_timeout")
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("kind", KINDS)
def test_fault_inside_a_control(
    kind: str, fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))  # before the fork: the children see it
    with rig_for(kind) as rig:
        others = rig.bystanders()
        victim = rig.victim_pid()
        name, marker = write_crashing_module(tmp_path, fault)
        path, role = {
            "sub": (f"{name}:fn", "sub"),
            "chip": (f"{name}:kernel", "chip"),
            "l3": (f"{name}:orch", "orchestration"),
        }[kind]
        # A register that never ends would hang the cell: past WATCHDOG_S the victim is
        # SIGKILLed (the register then fails naming SIGKILL, and the cause check says so).
        bitten = threading.Event()

        def bite() -> None:
            bitten.set()
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)

        watchdog = threading.Timer(WATCHDOG_S, bite)
        watchdog.start()
        try:
            with pytest.raises(RegistrationError) as info:
                rig.w.register(path, kind=role)  # type: ignore[arg-type]
        finally:
            watchdog.cancel()
            watchdog.join()  # no thread may be left when the next Worker forks
        rig.note()
        assert not bitten.is_set(), f"register still waiting after {WATCHDOG_S:.0f} s: {info.value}"
        assert marker.read_text() == str(victim), "the import did not run in the victim"
        assert re.search(CONTROL_CAUSE[fault], str(info.value)), str(info.value)
        assert f"worker {rig.worker_id}" in str(info.value), str(info.value)
        new = rig.wait_replaced(victim, 1)
        poll_for(lambda: not alive(victim), timeout=WAIT_S, message=f"{victim} still alive")
        # The failed registration is not replayed into the replacement: it stays up.
        assert rig.run_probe() == new
        assert rig.victim_pid() == new and rig.restarts() == 1
        assert_bystanders(rig, others)
