"""A run's task stream as a Chrome trace (``Worker(trace=True)``, ``RunHandle.trace()``):
one complete event per task attempt on its lane, the run's queueing and execution, in a
document that loads as JSON and follows the format's rules (tests/support/trace_check.py).
Real SUB children.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from simpler_daemon import Tag, TaskError, Worker
from simpler_daemon.scheduler.trace import NEXT_LEVEL_TID, RUN_TID
from simpler_daemon.testing import poll_for
from tests.support import sub_tasks as tasks
from tests.support.sub_tasks import targs
from tests.support.trace_check import check_chrome_trace, task_events

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["fifo", "fair"])
def traced(request: pytest.FixtureRequest) -> Iterator[Worker]:
    w = Worker(num_sub_workers=2, admission=request.param, trace=True)
    try:
        yield w
    finally:
        w.close()


def test_every_task_on_its_lane_and_the_run(traced: Worker, tmp_path: Any) -> None:
    w = traced
    noop = w.register(tasks.noop)
    fill = w.register(tasks.fill)
    consume = w.register(tasks.consume)
    w.init()
    buf = w.alloc(4, "float32")
    out = w.alloc(4, "float32")

    def orch(o: Any, _a: Any, _c: Any) -> None:
        o.submit_sub(fill, targs((buf, Tag.OUTPUT_EXISTING), scalars=(3,)))
        o.submit_sub(consume, targs((buf, Tag.INPUT), (out, Tag.OUTPUT_EXISTING), scalars=(1,)))
        o.submit_sub(noop)
        o.submit_sub_group(noop, [targs(), targs()])

    h = w.submit(orch)
    h.wait(60)
    doc = h.trace()
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    loaded = json.loads(path.read_text())
    evs = task_events(loaded)
    assert [(e["args"]["task"], e["args"].get("member", 0)) for e in evs] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (3, 0),
        (3, 1),
    ]
    assert {e["args"]["attempt"] for e in evs} == {1}
    assert {e["args"]["outcome"] for e in evs} == {"SUCCESS"}
    assert [e["name"] for e in evs[:3]] == [fill.name, consume.name, noop.name]
    assert {e["tid"] for e in evs} <= {1, 2}  # sub worker 0 and 1
    # The consumer starts after its producer ended.
    assert evs[1]["ts"] >= evs[0]["ts"] + evs[0]["dur"]
    names = {(m["tid"], m["args"]["name"]) for m in loaded["traceEvents"] if m["ph"] == "M"}
    assert (RUN_TID, "run") in names and (1, "sub worker 0") in names
    run_evs = {e["name"]: e for e in loaded["traceEvents"] if e.get("cat") == "run"}
    assert set(run_evs) == {"queued", f"run {h.run_id}"}
    span = run_evs[f"run {h.run_id}"]
    assert span["args"] == {"run_id": h.run_id, "state": "COMPLETED"}
    for e in evs:  # every attempt inside the run's span
        assert span["ts"] <= e["ts"] and e["ts"] + e["dur"] <= span["ts"] + span["dur"] + 1
    assert loaded["otherData"]["run_id"] == h.run_id
    assert loaded["otherData"]["attempts"] == 5


def test_failed_task_and_its_skipped_consumer(traced: Worker) -> None:
    w = traced
    fail = w.register(tasks.raise_value_error)
    consume = w.register(tasks.consume)
    w.init()
    buf = w.alloc(4, "float32")

    def orch(o: Any, _a: Any, _c: Any) -> None:
        o.submit_sub(fail, targs((buf, Tag.OUTPUT_EXISTING)))
        o.submit_sub(consume, targs((buf, Tag.INPUT)))

    h = w.submit(orch)
    with pytest.raises(TaskError):
        h.wait(60)
    doc = h.trace()
    evs = task_events(doc)
    # The skipped consumer never ran: no attempt of it.
    assert [(e["args"]["task"], e["args"]["outcome"]) for e in evs] == [(0, "TASK_FAILURE")]
    span = [e for e in doc["traceEvents"] if e["name"] == f"run {h.run_id}"]
    assert span and span[0]["args"]["state"] == "FAILED"


def test_trace_of_a_running_run_and_a_chip_lane() -> None:
    """Asked while a task runs: the finished attempts and an open run span; a NEXT_LEVEL
    (chip) lane has its own thread id."""
    w = Worker(num_sub_workers=1, num_chips=1, trace=True)
    try:
        gate = w.register(tasks.wait_flag)
        kernel = w.register("tests.support.chip_kernels:noop", kind="chip")
        w.init()
        flag = w.alloc(1, "int64")
        flag[0] = 0

        def orch(o: Any, _a: Any, _c: Any) -> None:
            k = o.submit_next_level(kernel, targs(), worker=0)
            assert k == 0
            o.submit_sub(gate, targs((flag, Tag.NO_DEP), scalars=(0,)))

        h = w.submit(orch)
        try:
            poll_for(lambda: bool(task_events(h.trace())), timeout=30, message="no attempt traced")
            running = h.trace()
        finally:
            flag[0] = 1
        h.wait(60)
        evs = task_events(running)
        assert [(e["args"]["task"], e["tid"]) for e in evs] == [(0, NEXT_LEVEL_TID)]
        span = [e for e in running["traceEvents"] if e["name"] == f"run {h.run_id}"]
        assert span[0]["args"]["state"] == "EXECUTING"
        done = task_events(h.trace())
        assert [e["args"]["task"] for e in done] == [0, 1]
    finally:
        w.close()


def test_untraced_worker_refuses() -> None:
    w = Worker(num_sub_workers=1)
    try:
        noop = w.register(tasks.noop)
        w.init()
        h = w.submit(lambda o, a, c: o.submit_sub(noop))
        h.wait(60)
        with pytest.raises(ValueError, match=rf"cannot trace run {h.run_id}: .*trace=True"):
            h.trace()
    finally:
        w.close()
    with pytest.raises(TypeError, match="trace='yes' must be True or False"):
        Worker(num_sub_workers=1, trace="yes")


def test_trace_is_valid_json_for_an_empty_run(traced: Worker) -> None:
    traced.init()
    h = traced.submit(lambda o, a, c: None)
    h.wait(60)
    doc = h.trace()
    check_chrome_trace(doc)
    assert task_events(doc) == []


def test_attempt_numbers_through_retries_and_requeues() -> None:
    """``RunTrace.on_event`` alone: a requeued dispatch (never picked up) is not an
    attempt, a retried one is, and a task run once is attempt 1 (keeping nothing of it
    once it ends)."""
    from types import SimpleNamespace

    from simpler_daemon.endpoints.base import Outcome
    from simpler_daemon.scheduler.lanes import WorkerType
    from simpler_daemon.scheduler.trace import FIELDS, RunTrace

    trace = RunTrace()
    handle = SimpleNamespace(name="t")
    once = SimpleNamespace(slot_id=1, index=0, members_started=1, handle=handle)
    flaky = SimpleNamespace(slot_id=2, index=1, members_started=1, handle=handle)

    def done(outcome: Outcome, lane: int = 0) -> Any:
        return SimpleNamespace(
            dispatch=SimpleNamespace(group_index=0),
            outcome=outcome,
            worker_type=WorkerType.SUB,
            worker_id=lane,
        )

    trace.on_event(once, "dispatched", None)
    trace.on_event(once, "completed", done(Outcome.SUCCESS))
    trace.on_event(flaky, "dispatched", None)
    trace.on_event(flaky, "requeued", None)
    trace.on_event(flaky, "dispatched", None)
    trace.on_event(flaky, "retried", done(Outcome.TASK_FAILURE, 1))
    trace.on_event(flaky, "redispatched", done(Outcome.TASK_FAILURE, 1))
    trace.on_event(flaky, "requeued", None)
    trace.on_event(flaky, "dispatched", None)
    trace.on_event(flaky, "completed", done(Outcome.SUCCESS, 1))
    rows = [trace.ints[i : i + FIELDS].tolist() for i in range(0, len(trace.ints), FIELDS)]
    # (task index, member, attempt, start, end, lane, outcome code) per attempt
    assert [(r[0], r[2], r[5]) for r in rows] == [(0, 1, 0), (1, 1, 1), (1, 2, 1)]
    assert trace.open == {} and trace.tries == {}


def test_an_attempt_the_pump_published_lasts_from_its_publication() -> None:
    """A plain SUB task is published by the C pump, which notes no dispatch event: its
    attempt starts at the slot's publication time, whether it ends in the pump's batch
    (a success) or on the Python path (a failure). Each task sleeps 30 ms, so its
    attempt lasts at least that (a loaded machine can only make it longer)."""
    w = Worker(num_sub_workers=1, trace=True)
    try:
        sleep = w.register(tasks.sleep_ms)
        fail = w.register(tasks.sleep_then_fail)
        w.init()

        def ok(o: Any, _args: Any, _config: Any) -> None:
            o.submit_sub(sleep, targs(scalars=(30,)))

        def bad(o: Any, _args: Any, _config: Any) -> None:
            o.submit_sub(fail, targs(scalars=(30,)))

        done = w.submit(ok)
        done.wait(timeout=60)
        failed = w.submit(bad)
        with pytest.raises(TaskError):
            failed.wait(timeout=60)
        for handle, outcome in ((done, "SUCCESS"), (failed, "TASK_FAILURE")):
            (ev,) = task_events(handle.trace())
            assert ev["args"]["outcome"] == outcome and ev["args"]["attempt"] == 1
            assert ev["dur"] >= 29_000, ev  # microseconds
    finally:
        w.close()
