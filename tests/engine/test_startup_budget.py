"""``startup_timeout`` counts from the call of ``init()``, at every level: time spent
before ``init`` costs nothing, an L3 child's subtree gets the whole budget (not a
share of it), the error names the child and how long init waited, and ``init()``
checks the deadline once more before it publishes READY (as the origin does)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from simpler_daemon import StartupError, Worker, WorkerState
from simpler_daemon.testing import child_pids, poll_for
from tests.support import sub_tasks

pytestmark = pytest.mark.timeout(90)


def _sleep_until(path: Path, seconds: float) -> object:
    """An init hook (runs in the SUB child before it reports ready): write ``path``,
    then hold the child ``seconds``."""

    def hook() -> None:
        path.write_text("started")
        time.sleep(seconds)

    return hook


def test_time_before_init_is_not_part_of_the_budget(tmp_path: Path) -> None:
    w = Worker(num_sub_workers=1, heap_bytes=1 << 20, startup_timeout=8.0)
    w.register(sub_tasks.noop)
    w._init_hooks[0] = _sleep_until(tmp_path / "a", 0.5)  # type: ignore[assignment]
    # Longer than the whole budget, before init: a budget counted from Worker() is spent.
    created = time.monotonic()
    poll_for(lambda: time.monotonic() - created > 8.5, timeout=20, interval=0.1)
    try:
        w.init()
        assert w.state is WorkerState.READY
    finally:
        w.close()
    assert not child_pids()


def test_a_late_child_is_named_with_the_time_init_waited(tmp_path: Path) -> None:
    w = Worker(num_sub_workers=2, heap_bytes=1 << 20, startup_timeout=1.5)
    w.register(sub_tasks.noop)
    w._init_hooks[1] = _sleep_until(tmp_path / "b", 60)  # type: ignore[assignment]
    t0 = time.monotonic()
    with pytest.raises(StartupError) as info:
        w.init()
    elapsed = time.monotonic() - t0
    w.close()
    text = str(info.value)
    assert "sub worker 1" in text and "sub worker 0" not in text, text
    waited = float(re.search(r"waited (\d+\.\d+) s since init\(\) was called", text)[1])  # type: ignore[index]
    # The message rounds to 10 ms: half a digit above the time init() took at most.
    assert 1.5 <= waited <= elapsed + 0.005, (waited, elapsed, text)
    assert "not ready within startup_timeout=1.5 s" in text
    assert not child_pids()


@pytest.mark.slow
def test_an_l3_subtree_gets_the_whole_budget_and_its_late_grandchild_is_named(
    tmp_path: Path,
) -> None:
    # A grandchild that needs 80 % of the root budget: a subtree given a share of what
    # was left (three quarters) would fail; counted from the root's init() it is in time.
    inner = Worker(num_sub_workers=1, heap_bytes=1 << 20)
    inner.register(sub_tasks.noop)
    inner._init_hooks[0] = _sleep_until(tmp_path / "c", 6.4)  # type: ignore[assignment]
    w4 = Worker(level=4, heap_bytes=1 << 20, startup_timeout=8.0)
    w4.add_worker(inner)
    try:
        w4.init()
        assert w4.state is WorkerState.READY
    finally:
        w4.close()
    assert not child_pids()
    # A grandchild that never comes up: the error names it and the root's budget, and
    # comes once the root budget is spent, not before.
    inner = Worker(num_sub_workers=1, heap_bytes=1 << 20)
    inner.register(sub_tasks.noop)
    inner._init_hooks[0] = _sleep_until(tmp_path / "d", 60)  # type: ignore[assignment]
    w4 = Worker(level=4, heap_bytes=1 << 20, startup_timeout=1.5)
    w4.add_worker(inner)
    t0 = time.monotonic()
    with pytest.raises(StartupError) as info:
        w4.init()
    elapsed = time.monotonic() - t0
    w4.close()
    text = str(info.value)
    assert elapsed >= 1.5, elapsed
    assert "child worker 0" in text and "sub worker 0" in text, text
    assert "startup_timeout=1.5 s" in text, text
    assert not child_pids()


def test_init_checks_the_deadline_once_more_before_ready(tmp_path: Path) -> None:
    w = Worker(num_sub_workers=1, heap_bytes=1 << 20, startup_timeout=1.0)
    w.register(sub_tasks.noop)
    pids: list[set[int]] = []

    def held_up() -> None:
        # The init thread, every child up, is held past the deadline (a slow host, a
        # stop signal, a long GC pause): it must not publish READY.
        pids.append(child_pids())
        t0 = time.monotonic()
        poll_for(lambda: time.monotonic() - t0 > 1.5, timeout=10, interval=0.05)

    w._after_attach = held_up
    with pytest.raises(StartupError) as info:
        w.init()
    assert w.state is WorkerState.FAILED
    w.close()
    text = str(info.value)
    assert "every child started" in text and "past startup_timeout=1 s" in text, text
    assert pids and pids[0]  # the children were up when init was held
    assert not child_pids()
