"""A SUB child spins for its next task only while its spins catch tasks.

After a task a child spins ``spin_ns`` for the next one, then parks. When tasks come
further apart than that (a daemon's client that makes one run at a time), each spin
catches nothing and takes turns at a core with the very processes the answer goes
through; the child then parks at once, but for a probe now and then, and spins again
once tasks come close together (``children/sub.py``, ``_SpinGap``).

* The gate alone, on a made-up clock: far-apart tasks stop the spin (probes only),
  close ones bring it back, one late task among close ones does not stop it; spins
  that catch a task one time in three keep it; a park that runs out is a miss.
* A real Worker whose child would spin 5 ms after every task, with runs 15 ms apart:
  the child's CPU over those runs is far below the 5 ms a run the spins would burn
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


class Clock:
    """A made-up monotonic clock (ns) for the child's gate."""

    def __init__(self) -> None:
        self.now = 10**9

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(sub, "_monotonic_ns", c)
    return c


def test_far_apart_tasks_stop_the_spin_and_close_ones_bring_it_back(clock: Clock) -> None:
    gate = sub._SpinGap(SPIN_NS)

    def task_after(gap_ns: int) -> bool:
        """Out of work, then a task ``gap_ns`` later: whether the child spun for it."""
        spin = gate.went_idle()
        clock.now += gap_ns
        gate.task_came()
        assert gate.idle_since == 0
        return spin == SPIN_NS

    assert task_after(4 * SPIN_NS)  # a new child spins
    spun = [task_after(4 * SPIN_NS) for _ in range(150)]
    # Far apart: after a few dozen misses only a probe spins, one in SPIN_PROBE_EVERY.
    tail = spun[-4 * sub.SPIN_PROBE_EVERY :]
    assert tail.count(True) == 4, tail
    # Close together again: the probes see it and spinning comes back, for good.
    back = [task_after(SPIN_NS // 5) for _ in range(8 * sub.SPIN_PROBE_EVERY)]
    assert all(back[-sub.SPIN_PROBE_EVERY :]), back
    assert task_after(10**9)  # one late task (an idle second) does not stop it
    assert task_after(SPIN_NS // 5)


def test_a_child_whose_spins_catch_some_tasks_keeps_spinning(clock: Clock) -> None:
    """A parent that publishes in rounds: every third wait of the child is short. Each
    catch saves the parent a wake-up, so the spin stays."""
    gate = sub._SpinGap(SPIN_NS)
    spun = []
    for i in range(300):
        spun.append(gate.went_idle() == SPIN_NS)
        clock.now += SPIN_NS // 5 if i % 3 == 0 else 3 * SPIN_NS
        gate.task_came()
    assert all(spun[-50:])


def test_a_park_that_times_out_after_a_spin_counts_as_a_miss(clock: Clock) -> None:
    gate = sub._SpinGap(SPIN_NS)
    for _ in range(60):  # idle for good: every park runs out
        gate.went_idle()
        gate.timed_out()
        gate.timed_out()  # a second timed-out park of the same wait is not judged again
        clock.now += 10**9
        gate.task_came()
    assert gate.hit_rate < sub.SPIN_MIN_HIT_RATE


def _cpu_s(pids: set[int]) -> float:
    """User + system CPU of ``pids`` (s)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def test_a_child_whose_tasks_come_far_apart_stops_spinning_for_them() -> None:
    spin_s = 0.005
    gap_s = 0.015
    runs = 32
    w = Worker(num_sub_workers=1, admission="fifo", child_spin_ns=int(spin_s * 1e9))
    h = w.register(empty)
    w.init()
    try:

        def orch(o: object, _args: object = None, _config: object = None) -> None:
            o.submit_sub(h, TaskArgs())  # type: ignore[attr-defined]

        for _ in range(2 * runs):  # the gate learns that tasks come far apart
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
    # Spinning after each task would cost runs * spin_s = 160 ms; parking at once costs
    # the tasks themselves (a few ms in all, counted in 10 ms clock ticks) and a probe's
    # spin in SPIN_PROBE_EVERY waits.
    assert spent < runs * spin_s / 4, f"the children used {spent * 1e3:.0f} ms of CPU"
