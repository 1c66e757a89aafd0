"""A SUB child's spin for its next task follows the gap between its tasks.

``stretched_spin`` is the rule (unit tests on its edges); the integration test counts a
real child's futex parks through its voluntary context switches (``/proc``), for runs
that come steadily twice ``child_spin_ns`` apart: before, every such run found the
child parked; now it is still spinning. The spin is long (20 ms) and the gap is kept
by the parent's own clock, so load cannot make runs come outside the window by chance
often enough to matter (the bound allows a third of them).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from simpler_daemon import Worker
from simpler_daemon.children.sub import SPIN_STRETCH, stretched_spin
from tests.support import sub_tasks as tasks
from tests.support.sub_tasks import targs

pytestmark = pytest.mark.timeout(120)

US = 1_000


@pytest.mark.parametrize(
    ("gap_ns", "spin_ns", "expected"),
    [
        (0, 50 * US, 50 * US),  # no gap seen yet
        (20 * US, 50 * US, 50 * US),  # tasks come within the spin: nothing to stretch
        (40 * US, 50 * US, 60 * US),  # 1.5 x the gap, once that is past the spin
        (80 * US, 50 * US, 120 * US),
        (133 * US, 50 * US, 199_500),  # just within SPIN_STRETCH x the spin
        (134 * US, 50 * US, 50 * US),  # past it: spinning through would only burn the core
        (10_000 * US, 50 * US, 50 * US),
        (80 * US, 0, 0),  # no spin configured: none
    ],
)
def test_the_spin_is_a_half_again_the_gap_within_reach(
    gap_ns: int, spin_ns: int, expected: int
) -> None:
    assert stretched_spin(gap_ns, spin_ns) == expected
    assert stretched_spin(gap_ns, spin_ns) <= max(spin_ns, spin_ns * SPIN_STRETCH)


def _voluntary_switches(pid: int) -> int:
    """The times ``pid``'s threads blocked (a futex park each, for an idle SUB child)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError(f"no voluntary_ctxt_switches in /proc/{pid}/status")


def _runs_apart(w: Worker, orch: Any, runs: int, gap_s: float) -> None:
    """``runs`` runs, each submitted ``gap_s`` after the last one ended (a busy wait on
    this process's clock: no sleep's wake-up latency in the gap)."""
    for _ in range(runs):
        w.run(orch)
        until = time.monotonic() + gap_s
        while time.monotonic() < until:
            pass


def test_runs_that_come_steadily_past_the_spin_find_the_child_spinning() -> None:
    spin_ns = 20_000 * US  # 20 ms: the window for the gap is 20 to 53 ms
    w = Worker(level=3, num_sub_workers=1, child_spin_ns=spin_ns)
    try:
        noop = w.register(tasks.noop)
        w.init()

        def orch(o: Any, _a: Any = None, _c: Any = None) -> None:
            o.submit_sub(noop, targs())

        (child,) = w.children
        _runs_apart(w, orch, 16, 0.04)  # the child learns the gap (1/8 per sample)
        before = _voluntary_switches(child.pid)
        runs = 12
        _runs_apart(w, orch, runs, 0.04)
        parks = _voluntary_switches(child.pid) - before
        assert parks <= runs // 3, f"the child parked {parks} times in {runs} runs 40 ms apart"
    finally:
        w.close()
