"""A run's task slots and the cyclic collector (``runmodel.untrack_slot``): off its lists
while the run is in flight, so a long queue costs its passes nothing, and back on them
however the run ends, so a finished run that is dropped is still collected (its slots
and the run form cycles that reference counting alone never frees)."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from simpler_daemon import TaskArgs, Worker
from simpler_daemon.engine.orchestrator import Orchestrator
from simpler_daemon.errors import RunCancelled, WorkerClosedError
from simpler_daemon.mailbox import _mailbox
from simpler_daemon.scheduler.runmodel import Run
from tests.support.sub_tasks import targs

pytestmark = pytest.mark.timeout(120)


def empty(args: Any) -> None:
    return None


def nap(args: Any) -> None:
    time.sleep(int(args.scalars[0]) / 1e6)


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker(num_sub_workers=2)
    try:
        yield w
    finally:
        w.close()


def put_back(handle: Any, count: int | None = None) -> weakref.ref[Run]:
    """Check that every slot of ``handle``'s ended run is tracked again (``count`` of
    them when given); a weak reference to the run, for ``assert_collected`` once the
    caller dropped ``handle``."""
    run = handle.run
    assert run.slots and all(gc.is_tracked(s) for s in run.slots)
    if count is not None:
        assert len(run.slots) == count
    return weakref.ref(run)


def assert_collected(ref: weakref.ref[Run]) -> None:
    gc.collect()
    run = ref()
    if run is not None:
        held = [type(r).__name__ for r in gc.get_referrers(run)]
        del run
        pytest.fail(f"a dropped finished run was not collected (held by {held})")


def test_a_completed_runs_slots_are_tracked_again_and_the_run_is_collected(
    worker: Worker,
) -> None:
    h = worker.register(empty)
    worker.init()
    seen: list[bool] = []

    def orch(o: Orchestrator, args: Any = None, config: Any = None) -> None:
        for _ in range(500):
            o.submit_sub(h, TaskArgs())
        seen.append(any(gc.is_tracked(s) for s in o.run.slots))

    handle = worker.submit(orch)
    handle.result(timeout=60)
    assert seen == [False], "a queued slot was on the collector's lists"
    ref = put_back(handle, 500)
    del handle
    assert_collected(ref)


def test_a_failed_orchestration_puts_the_slots_it_made_back(worker: Worker) -> None:
    h = worker.register(empty)
    worker.init()

    def orch(o: Orchestrator, args: Any = None, config: Any = None) -> None:
        for _ in range(300):
            o.submit_sub(h, TaskArgs())
        raise RuntimeError("the orchestration gives up half way")

    handle = worker.submit(orch)
    with pytest.raises(RuntimeError, match="half way"):
        handle.result(timeout=60)
    ref = put_back(handle, 300)
    del handle
    assert_collected(ref)


def test_a_cancelled_run_puts_its_unstarted_slots_back(worker: Worker) -> None:
    h = worker.register(nap)
    worker.init()

    def orch(o: Orchestrator, args: Any = None, config: Any = None) -> None:
        for _ in range(200):
            o.submit_sub(h, targs(scalars=(20_000,)))

    handle = worker.submit(orch)
    assert handle.cancel()
    with pytest.raises(RunCancelled):
        handle.result(timeout=60)
    ref = put_back(handle)
    del handle
    assert_collected(ref)


def test_a_run_cut_off_by_the_workers_close_puts_its_slots_back() -> None:
    """``close(timeout=0)``: no time to drain, the run in flight is cancelled."""
    w = Worker(num_sub_workers=2)
    try:
        h = w.register(nap)
        w.init()
        built = threading.Event()

        def orch(o: Orchestrator, args: Any = None, config: Any = None) -> None:
            for _ in range(200):
                o.submit_sub(h, targs(scalars=(20_000,)))
            built.set()

        handle = w.submit(orch)
        assert built.wait(60)
    finally:
        w.close(timeout=0)
    with pytest.raises((RunCancelled, WorkerClosedError)):
        handle.result(timeout=60)
    ref = put_back(handle)
    del handle
    assert_collected(ref)


def test_the_tracking_calls_take_only_collector_objects_and_a_list() -> None:
    _mailbox.gc_untrack(7)  # not a collector type: nothing to do
    box: list[Any] = [[1], 7, "x"]
    inner = box[0]
    _mailbox.gc_untrack(inner)
    _mailbox.gc_untrack(inner)  # twice is fine
    assert not gc.is_tracked(inner)
    _mailbox.gc_track_all(box)
    _mailbox.gc_track_all(box)  # already tracked: left alone (tracking twice is fatal)
    assert gc.is_tracked(inner)
    with pytest.raises(TypeError, match="takes a list, not tuple"):
        _mailbox.gc_track_all((inner,))  # type: ignore[arg-type]
