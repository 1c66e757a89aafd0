"""``Worker.map`` (one SUB task per item, the item as its single value, the results in
order, lazily in runs of ``chunksize``) and ``simpler_daemon.futures.as_completed`` over
RunHandles, on real SUB children; bad arguments are refused before anything runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from simpler_daemon import TaskError, Worker
from simpler_daemon.futures import as_completed
from simpler_daemon.testing import poll_for
from tests.support import retry_tasks as rt
from tests.support import sub_tasks as tasks
from tests.support.sub_tasks import targs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["fifo", "fair"])
def w(request: pytest.FixtureRequest) -> Iterator[Worker]:
    worker = Worker(num_sub_workers=2, admission=request.param)
    try:
        yield worker
    finally:
        worker.close()


def test_map_yields_the_results_in_order(w: Worker) -> None:
    sq = w.register(rt.square)
    w.init()
    assert list(w.map(sq, range(10), chunksize=3)) == [i * i for i in range(10)]
    assert list(w.map(sq, [])) == []
    assert list(w.map(sq, [None, 2.5, 3])) == [None, 6.25, 9]
    # Lazy: an endless iterable is read as results are taken (two runs ahead at most).
    taken = list(itertools.islice(w.map(sq, itertools.count(), chunksize=4), 10))
    assert taken == [i * i for i in range(10)]


def test_a_failed_item_raises_after_the_results_before_it(w: Worker) -> None:
    sq = w.register(rt.square)
    w.init()
    out: list[Any] = []
    with pytest.raises(TaskError, match="negative item -1") as info:
        for r in w.map(sq, [1, 2, 3, -1, 5, 6], chunksize=3):
            out.append(r)
    assert out == [1, 4, 9] and info.value.outcome == "TASK_FAILURE"
    # The Worker goes on serving: nothing of the map is left running.
    poll_for(lambda: not any(not h.done() for h in []), timeout=1)
    assert list(w.map(sq, [4])) == [16]


def test_closing_the_generator_cancels_the_runs_in_flight(w: Worker) -> None:
    sq = w.register(rt.square)
    w.init()
    gen = w.map(sq, itertools.count(), chunksize=2)
    assert next(gen) == 0
    gen.close()
    assert w.scheduler is not None
    poll_for(lambda: not w.scheduler.admission.runs(), timeout=30, message="map runs left")


def test_bad_map_arguments(w: Worker) -> None:
    sq = w.register(rt.square)
    w.init()
    with pytest.raises(TypeError, match="cannot map: expected a CallableHandle"):
        w.map("square", [1])  # type: ignore[arg-type]
    for bad, err, text in [
        (0, ValueError, "chunksize=0 must be between 1 and 100000"),
        (True, TypeError, "chunksize must be an int, got bool"),
        (1.5, TypeError, "chunksize must be an int, got float"),
    ]:
        with pytest.raises(err, match=text):
            w.map(sq, [1], chunksize=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout=-1 must be >= 0"):
        w.map(sq, [1], timeout=-1)
    with pytest.raises(TypeError, match="config must be a CallConfig"):
        w.map(sq, [1], config={"max_retries": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"cannot map item 2: .*values\[0\].*set"):
        list(w.map(sq, [1, 2, {3}]))


def test_as_completed_yields_run_handles_as_they_finish(w: Worker) -> None:
    sleep = w.register(tasks.sleep_ms)
    noop = w.register(tasks.noop)
    w.init()
    slow = w.submit(lambda o, a, c: o.submit_sub(sleep, targs(scalars=(1500,))))
    fast = w.submit(lambda o, a, c: o.submit_sub(noop))
    order = list(as_completed([slow, fast, fast]))
    assert sorted(order, key=id) == sorted([slow, fast], key=id)  # once each
    if w.admission == "fair":  # fifo starts the second run once the first ended
        assert order == [fast, slow]
    stuck = w.submit(lambda o, a, c: o.submit_sub(sleep, targs(scalars=(5_000,))))
    with pytest.raises(TimeoutError, match=r"1 of 1 futures not finished within 0\.05s"):
        list(as_completed([stuck], timeout=0.05))
    stuck.cancel(terminate=True)
    with pytest.raises(TypeError, match=r"cannot wait for futures\[1\]: int 3 is not a RunHandle"):
        as_completed([fast, 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="timeout=nan"):
        as_completed([fast], timeout=float("nan"))
