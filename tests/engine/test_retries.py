"""Automatic retries (``CallConfig(max_retries=..., retry_on=..., retry_exceptions=...,
idempotent=...)``) on real SUB children: a worker SIGKILLed mid-task, a deadline, an
exception of a listed class run again on a live worker and the run completes, its trace
showing every attempt; consumers wait for the final attempt; a group retries only its
failed member; exhausted retries fail with every attempt's cause; unsafe and bad
configs are refused with errors naming the task or field.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from simpler_daemon import CallConfig, Tag, TaskError, Worker
from simpler_daemon.testing import alive, poll_for
from tests.support import retry_tasks as rt
from tests.support.sub_tasks import targs
from tests.support.trace_check import task_events

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["fifo", "fair"])
def w(request: pytest.FixtureRequest) -> Iterator[Worker]:
    worker = Worker(num_sub_workers=2, admission=request.param, trace=True)
    try:
        yield worker
    finally:
        worker.close()


def _state(w: Worker) -> Any:
    state = w.alloc(16, "int64")
    state[:] = 0
    return state


def _attempts(doc: dict[str, Any], task: int = 0) -> list[tuple[int, int, str]]:
    return [
        (e["args"].get("member", 0), e["args"]["attempt"], e["args"]["outcome"])
        for e in task_events(doc)
        if e["args"]["task"] == task
    ]


def test_a_worker_sigkilled_mid_task_is_retried_and_the_run_completes(w: Worker) -> None:
    hang = w.register(rt.hang_first)
    read = w.register(rt.read_sum)
    w.init()
    state = _state(w)
    out = w.alloc(4, "float64")
    retry = CallConfig(max_retries=2)

    def orch(o: Any, _a: Any, _c: Any) -> None:
        o.submit_sub(hang, targs((state, Tag.NO_DEP), (out, Tag.OUTPUT)), retry)
        o.submit_sub(read, targs((out, Tag.INPUT)))  # waits for the final attempt

    h = w.submit(orch)
    poll_for(lambda: state[1] != 0, timeout=30, message="the first attempt never started")
    victim = int(state[1])
    os.kill(victim, signal.SIGKILL)
    assert h.result(60) == [42, 0.0]
    assert state[0] == 2 and state[2] != victim  # the retry ran in another (live) child
    poll_for(lambda: not alive(victim), timeout=10, message=f"pid {victim} still alive")
    assert _attempts(h.trace()) == [(0, 1, "ENDPOINT_FAILURE"), (0, 2, "SUCCESS")]
    assert _attempts(h.trace(), 1) == [(0, 1, "SUCCESS")]
    consumer = task_events(h.trace())[-1]
    retried = next(e for e in task_events(h.trace()) if e["args"]["attempt"] == 2)
    assert consumer["ts"] >= retried["ts"] + retried["dur"]
    assert w.scheduler is not None and w.scheduler.stats["retried"] == 1


def test_a_self_kill_retried_on_the_replacement_with_one_worker() -> None:
    """One SUB worker: the retry waits for its replacement and runs there."""
    w = Worker(num_sub_workers=1, trace=True)
    try:
        die = w.register(rt.kill_self_first)
        w.init()
        state = _state(w)
        h = w.submit(
            lambda o, a, c: o.submit_sub(die, targs((state, Tag.NO_DEP)), CallConfig(max_retries=1))
        )
        assert h.result(60) == [7]
        assert state[1] != state[2] and w.restarts.get("sub", 0) == 1
        assert [a[2] for a in _attempts(h.trace())] == ["ENDPOINT_FAILURE", "SUCCESS"]
    finally:
        w.close()


def test_exceptions_retried_only_when_listed(w: Worker) -> None:
    flaky = w.register(rt.raise_first)
    key = w.register(rt.raise_key_error)
    w.init()
    state = _state(w)
    cfg = CallConfig(max_retries=3, retry_on=("exception",), retry_exceptions=(ValueError,))
    h = w.submit(lambda o, a, c: o.submit_sub(flaky, targs((state, Tag.NO_DEP), scalars=(2,)), cfg))
    assert h.result(60) == ["ok"]  # FlakyError is a ValueError subclass
    assert [a[1:] for a in _attempts(h.trace())] == [
        (1, "TASK_FAILURE"),
        (2, "TASK_FAILURE"),
        (3, "SUCCESS"),
    ]
    by_name = CallConfig(max_retries=1, retry_on=("exception",), retry_exceptions=("ValueError",))
    state[:] = 0
    h = w.submit(
        lambda o, a, c: o.submit_sub(flaky, targs((state, Tag.NO_DEP), scalars=(1,)), by_name)
    )
    assert h.result(60) == ["ok"]
    state[:] = 0
    h = w.submit(lambda o, a, c: o.submit_sub(key, targs((state, Tag.NO_DEP)), cfg))
    with pytest.raises(TaskError) as info:
        h.wait(60)
    assert state[0] == 1 and info.value.attempts == 1  # a KeyError is not retried
    # The default retry_on has every cause: an exception is retried.
    state[:] = 0
    h = w.submit(
        lambda o, a, c: o.submit_sub(
            flaky, targs((state, Tag.NO_DEP), scalars=(1,)), CallConfig(max_retries=5)
        )
    )
    assert h.result(60) == ["ok"] and state[0] == 2
    # retry_on=("crash",): an exception is not retried.
    state[:] = 0
    crash_only = CallConfig(max_retries=5, retry_on=("crash",))
    h = w.submit(
        lambda o, a, c: o.submit_sub(flaky, targs((state, Tag.NO_DEP), scalars=(1,)), crash_only)
    )
    with pytest.raises(TaskError):
        h.wait(60)
    assert state[0] == 1


def test_exhausted_retries_fail_with_every_attempts_cause(w: Worker) -> None:
    flaky = w.register(rt.raise_first)
    w.init()
    state = _state(w)
    cfg = CallConfig(max_retries=2, retry_on=("exception",))
    h = w.submit(lambda o, a, c: o.submit_sub(flaky, targs((state, Tag.NO_DEP), scalars=(9,)), cfg))
    with pytest.raises(TaskError) as info:
        h.wait(60)
    err = info.value
    assert state[0] == 3 and err.attempts == 3 and len(err.attempt_causes) == 3
    for k, cause in enumerate(err.attempt_causes):
        assert cause.startswith(f"attempt {k + 1}: TASK_FAILURE (exception) on sub worker")
        assert f"FlakyError: flaky attempt {k}" in cause
    assert "after 3 attempts (attempt 1: TASK_FAILURE" in str(err)
    assert "tests.support.retry_tasks.FlakyError: flaky attempt 2" in err.remote_text
    assert [a[2] for a in _attempts(h.trace())] == ["TASK_FAILURE"] * 3


def test_deadline_retried(w: Worker) -> None:
    slow = w.register(rt.slow_first)
    w.init()
    state = _state(w)
    cfg = CallConfig(deadline_ms=200, max_retries=1, retry_on=("deadline",))
    h = w.submit(
        lambda o, a, c: o.submit_sub(slow, targs((state, Tag.NO_DEP), scalars=(10_000,)), cfg)
    )
    assert h.result(60) == [5]
    assert [a[1] for a in _attempts(h.trace())] == [1, 2]
    # Without "deadline" in retry_on the deadline fails the task at once.
    state[:] = 0
    crash_only = CallConfig(deadline_ms=200, max_retries=1, retry_on=("crash",))
    h = w.submit(
        lambda o, a, c: o.submit_sub(
            slow, targs((state, Tag.NO_DEP), scalars=(10_000,)), crash_only
        )
    )
    with pytest.raises(TaskError, match="deadline"):
        h.wait(60)
    assert h.exception().attempts == 1  # type: ignore[union-attr]


def test_a_group_retries_only_its_failed_member(w: Worker) -> None:
    member = w.register(rt.member_dies_first)
    w.init()
    state = _state(w)
    counts = w.alloc(2, "int64")
    counts[:] = 0

    def orch(o: Any, _a: Any, _c: Any) -> None:
        o.submit_sub_group(
            member,
            [targs((state, Tag.NO_DEP), (counts, Tag.NO_DEP), scalars=(i,)) for i in (0, 1)],
            CallConfig(max_retries=2),
        )

    h = w.submit(orch)
    assert h.result(60) == [[0, 10]]
    assert list(counts) == [1, 2]  # member 0 ran once, member 1 twice
    assert sorted(_attempts(h.trace())) == [
        (0, 1, "SUCCESS"),
        (1, 1, "ENDPOINT_FAILURE"),
        (1, 2, "SUCCESS"),
    ]


def test_in_place_writes_need_idempotent(w: Worker) -> None:
    write = w.register(rt.write_then_hang)
    w.init()
    state = _state(w)
    buf = w.alloc(4, "float64")
    errors: list[BaseException] = []

    def orch(o: Any, _a: Any, _c: Any) -> None:
        for tag in (Tag.INOUT, Tag.OUTPUT_EXISTING):
            try:
                o.submit_sub(
                    write,
                    targs((state, Tag.NO_DEP), (buf, tag), scalars=(3,)),
                    CallConfig(max_retries=1),
                )
            except ValueError as exc:
                errors.append(exc)

    w.submit(orch).wait(60)
    assert len(errors) == 2
    assert (
        "cannot submit_sub: task 0 (tests.support.retry_tasks:write_then_hang) has max_retries=1"
        in str(errors[0])
    )
    assert "writes tensors[1] in place (INOUT)" in str(errors[0])
    assert "(OUTPUT_EXISTING)" in str(errors[1]) and "idempotent=True" in str(errors[1])
    ok = CallConfig(max_retries=1, idempotent=True)
    h = w.submit(
        lambda o, a, c: o.submit_sub(
            write, targs((state, Tag.NO_DEP), (buf, Tag.INOUT), scalars=(3,)), ok
        )
    )
    poll_for(lambda: state[1] != 0, timeout=30, message="never started")
    os.kill(int(state[1]), signal.SIGKILL)
    h.wait(60)
    assert list(buf) == [3.0] * 4 and state[0] == 2


def test_cancel_stops_a_pending_retry(w: Worker) -> None:
    hang = w.register(rt.hang_first)
    w.init()
    state = _state(w)
    cfg = CallConfig(max_retries=3)
    h = w.submit(lambda o, a, c: o.submit_sub(hang, targs((state, Tag.NO_DEP)), cfg))
    poll_for(lambda: state[1] != 0, timeout=30, message="never started")
    h.cancel()
    os.kill(int(state[1]), signal.SIGKILL)
    with pytest.raises(TaskError):
        h.wait(60)
    assert h.cancelled() and state[0] == 1  # cancelled: not run again


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"max_retries": -1}, ValueError, "max_retries=-1 must be between 0 (no retry) and 100"),
        ({"max_retries": 101}, ValueError, "max_retries=101 must be between 0"),
        ({"max_retries": 1.5}, TypeError, "max_retries must be an int, got float"),
        ({"max_retries": True}, TypeError, "max_retries must be an int, got bool"),
        (
            {"retry_on": ("crash", "oops")},
            ValueError,
            "retry_on has 'oops', not one of crash, deadline, exception",
        ),
        ({"retry_on": 3}, TypeError, "retry_on must be a tuple of"),
        (
            {"retry_on": ("exception",), "retry_exceptions": (int,)},
            TypeError,
            "retry_exceptions[0] = <class 'int'> is not an exception class",
        ),
        (
            {"retry_on": ("exception",), "retry_exceptions": (ValueError(),)},
            TypeError,
            "is not an exception class or its qualified name (ValueError)",
        ),
        (
            {"retry_on": ("exception",), "retry_exceptions": ("no such-name",)},
            TypeError,
            "not a qualified name",
        ),
        (
            {"retry_on": ("crash",), "retry_exceptions": (ValueError,)},
            ValueError,
            "retry_exceptions narrows retry_on='exception'",
        ),
        ({"idempotent": "yes"}, TypeError, "idempotent must be True or False"),
    ],
)
def test_bad_retry_configs(kwargs: dict[str, Any], error: type[Exception], text: str) -> None:
    with pytest.raises(error) as info:
        CallConfig(**kwargs)
    assert text in str(info.value) and str(info.value).startswith("cannot build CallConfig: ")


def test_the_retry_policy_stays_out_of_the_frame() -> None:
    assert (
        CallConfig(max_retries=3, retry_on=("crash", "exception")).encoded == CallConfig().encoded
    )
