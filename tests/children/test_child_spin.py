"""A SUB child spins for its next task only while its tasks come within the spin.

After a task a child spins ``spin_ns`` for the next one, then parks. When tasks come
further apart than that (a daemon's client that makes one run at a time), each spin
catches nothing and takes turns at a core with the very processes the answer goes
through; the child then parks at once, and spins again once tasks come close together
(``children/sub.py``, ``_SpinGap``).

* The gate alone, on a made-up clock: far-apart tasks stop the spin, close ones bring
  it back, one late task among close ones does not stop it.
* A real Worker whose child would spin 20 ms after every task, with runs 60 ms apart:
  the child's CPU over those runs is far below the 20 ms a run the spins would burn
  (load only lowers a yielding spinner's CPU, so it cannot fail this bound).
"""

from __future__ import annotations

import os
import time

import pytest

from simpler_daemon import TaskArgs, Worker
from simpler_daemon.children import sub
from simpler_daemon.examples.tasks import empty
from simpler_daemon.testing import child_pids

pytestmark = pytest.mark.timeout(60)

SPIN_NS = 50_000


def test_far_apart_tasks_stop_the_spin_and_close_ones_bring_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [10**9]
    monkeypatch.setattr(sub, "_monotonic_ns", lambda: now[0])
    gate = sub._SpinGap(SPIN_NS)

    def task_after(gap_ns: int) -> None:  # idle, then a task ``gap_ns`` later
        gate.idle_since = now[0]
        now[0] += gap_ns
        gate.task_came()
        assert gate.idle_since == 0

    assert gate.spins()  # a new child spins
    for _ in range(8):
        task_after(4 * SPIN_NS)
    assert not gate.spins()
    for _ in range(8):
        task_after(SPIN_NS // 5)
    assert gate.spins()
    task_after(10**9)  # one late task (an idle second)
    assert gate.spins()


def _cpu_s(pids: set[int]) -> float:
    """User + system CPU of ``pids`` (s)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def test_a_child_whose_tasks_come_far_apart_stops_spinning_for_them() -> None:
    spin_s = 0.02
    gap_s = 0.06
    runs = 16
    w = Worker(num_sub_workers=1, admission="fifo", child_spin_ns=int(spin_s * 1e9))
    h = w.register(empty)
    w.init()
    try:

        def orch(o: object, _args: object = None, _config: object = None) -> None:
            o.submit_sub(h, TaskArgs())  # type: ignore[attr-defined]

        for _ in range(8):  # the gate learns that tasks come far apart
            w.run(orch)
            time.sleep(gap_s)  # the gap between two runs is the workload here
        kids = child_pids()
        assert kids
        before = _cpu_s(kids)
        for _ in range(runs):
            w.run(orch)
            time.sleep(gap_s)
        spent = _cpu_s(kids) - before
    finally:
        w.close()
    # Spinning after each task would cost runs * spin_s = 320 ms; parking at once costs
    # the tasks themselves (a few ms in all, counted in 10 ms clock ticks).
    assert spent < runs * spin_s / 4, f"the children used {spent * 1e3:.0f} ms of CPU"
