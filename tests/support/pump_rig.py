"""A real Worker for the tests of the SUB pump's spins (scheduler/test_settle.py,
scheduler/test_single_runs.py): two SUB workers under fifo, an empty task and one that
sleeps ``scalars[0]`` ms registered, and the switch that makes every spin catch its task.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

from simpler_daemon import CallableHandle, Worker
from simpler_daemon.examples.tasks import empty
from simpler_daemon.scheduler import progress, subpump
from simpler_daemon.scheduler.dispatch import Scheduler
from tests.support.sub_tasks import sleep_ms

#: How long a spin made to catch its task may wait for it.
CATCH_S = 30.0


class Rig(NamedTuple):
    w: Worker
    sched: Scheduler
    quick: CallableHandle  # an empty task
    slow: CallableHandle  # sleeps scalars[0] ms


def new_worker() -> tuple[Worker, CallableHandle, CallableHandle]:
    """The rig's Worker, initialised (the caller starts it on its loop, or not, and
    closes it): the Worker, its quick handle and its slow one."""
    w = Worker(num_sub_workers=2, admission="fifo")
    quick = w.register(empty)
    slow = w.register(sleep_ms)
    w.init()
    return w, quick, slow


def spins_catch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every spin of the pump waits for its task (up to ``CATCH_S``) and the hit-rate
    threshold is zero, so the machine's load cannot decide whether a spin catches."""
    monkeypatch.setattr(subpump, "PUMP_SPIN_NS", int(CATCH_S * 1e9))
    monkeypatch.setattr(subpump, "PUMP_MIN_HIT_RATE", 0.0)
    monkeypatch.setattr(progress, "PUMP_MIN_HIT_RATE", 0.0)
