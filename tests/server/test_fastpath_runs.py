"""The fast path's run calls answered from the run's completion (server/fastpath.py
``Deferred``): a SubmitRun that waits and a WaitRun on a run still going are answered
when the run ends or the wait expires, without a handler waiting for it; a Cancel, a
deadline or the client going away stop such a call as they stop a handler. Each
outcome is compared with what gRPC answers for the same request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from simpler_daemon.client import Client, sub_task
from simpler_daemon.client.errors import FailedPrecondition, NotFound
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol.fastwire import (
    Call,
    Cancel,
    Hello,
    Reply,
)
from tests.support.daemon_harness import (
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    wait_until,
)
from tests.support.fast_raw import RawFast

TASKS = "tests.support.daemon_tasks"
MAX_MESSAGE = 1 << 20
KEPT_RESULTS = 16 << 10  # limits.max_finished_result_bytes: a run keeping more drops them
CONFIG: dict[str, dict[str, Any]] = {
    "limits": {"max_message_bytes": MAX_MESSAGE, "max_finished_result_bytes": KEPT_RESULTS},
    "callables": {"allowed_modules": ["simpler_daemon.examples", "tests"]},
}
_MODULE_DAEMONS: set[int] = set()
OK = 0
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "fastruns", CONFIG, _MODULE_DAEMONS)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    yield from module_leak_guard(lambda: set(_MODULE_DAEMONS))


@pytest.fixture
def c(daemon: DaemonProcess) -> Iterator[Client]:
    with daemon.client(timeout=60, transport="fast") as client:
        assert client.transport == "fast"
        yield client


class Raw(RawFast):
    """One fast-path connection speaking frames by hand (replies collected by call id)."""

    def __init__(self, daemon: DaemonProcess) -> None:
        super().__init__(daemon, Hello(1, "raw"))

    def reply(self, call_id: int) -> Reply:
        """Call ``call_id``'s reply (other calls' frames read meanwhile are kept)."""
        return self.reply_to(call_id)


def _submit(tasks: list[Any], wait: float | None, *, include_results: bool = False) -> bytes:
    request = pb.SubmitRunRequest(tasks=tasks, include_results=include_results)
    if wait is not None:
        request.wait_seconds = wait
    return request.SerializeToString()


def _wait(run_id: int, timeout: float | None) -> bytes:
    request = pb.WaitRunRequest(run_id=run_id)
    if timeout is not None:
        request.timeout_seconds = timeout
    return request.SerializeToString()


@pytest.mark.timeout(90)
def test_a_waiting_submit_is_answered_when_the_run_ends_or_its_wait_expires(
    daemon: DaemonProcess, c: Client
) -> None:
    nothing = c.register(f"{TASKS}:nothing")
    sleep = c.register(f"{TASKS}:sleep_ms")
    raw = Raw(daemon)
    try:
        raw.send(Call(1, "SubmitRun", _submit([sub_task(nothing)], 60.0)))
        done = pb.SubmitRunResponse.FromString(raw.reply(1).data)
        assert done.status.state == pb.RUN_STATE_COMPLETED and done.status.run_id == done.run_id
        assert done.status.counts.done == 1 and done.status.HasField("finish_time")
        # A wait shorter than the run: the status of the run still going, not an error.
        raw.send(Call(2, "SubmitRun", _submit([sub_task(sleep, scalars=[1_500])], 0.2)))
        going = pb.SubmitRunResponse.FromString(raw.reply(2).data)
        assert going.status.state in (pb.RUN_STATE_PREPARED, pb.RUN_STATE_EXECUTING)
        # A WaitRun on it is answered at its end, another call answered meanwhile.
        raw.send(Call(3, "WaitRun", _wait(going.run_id, 60.0)), Call(4, "GetInfo", b""))
        assert raw.reply(4).code == OK
        ended = pb.RunStatus.FromString(raw.reply(3).data)
        assert ended.state == pb.RUN_STATE_COMPLETED and ended.run_id == going.run_id
        # Waiting for a finished run answers at once; a zero wait never waits.
        raw.send(Call(5, "WaitRun", _wait(going.run_id, 60.0)))
        assert pb.RunStatus.FromString(raw.reply(5).data).state == pb.RUN_STATE_COMPLETED
        raw.send(Call(6, "SubmitRun", _submit([sub_task(sleep, scalars=[300])], 0.0)))
        zero = pb.SubmitRunResponse.FromString(raw.reply(6).data)
        assert zero.HasField("status") and zero.status.state != pb.RUN_STATE_COMPLETED
        assert c.wait_run(zero.run_id, 30).state == pb.RUN_STATE_COMPLETED
    finally:
        raw.close()


@pytest.mark.timeout(90)
def test_a_waiting_call_stops_on_cancel_on_its_deadline_and_when_its_client_goes(
    daemon: DaemonProcess, c: Client
) -> None:
    sleep = c.register(f"{TASKS}:sleep_ms")
    run = c.submit([sub_task(sleep, scalars=[1_000])])
    raw = Raw(daemon)
    try:
        # Cancelled: never answered, even after the run ends.
        raw.send(Call(1, "WaitRun", _wait(run.run_id, 60.0)), Cancel(1))
        # Past its deadline: DEADLINE_EXCEEDED, as a waiting handler answers it.
        raw.send(Call(2, "WaitRun", _wait(run.run_id, 60.0), timeout=0.1))
        expired = raw.reply(2)
        assert (expired.code, expired.details) == (DEADLINE, "Deadline Exceeded")
        assert c.wait_run(run.run_id, 30).state == pb.RUN_STATE_COMPLETED
        # The next reply on the connection is the next call's: nothing owed for call 1.
        raw.send(Call(3, "GetInfo", b""))
        assert raw.reply(3).code == OK
        assert not [f for f in raw.pending if getattr(f, "id", None) == 1]
        # A client going away with a waiting submit: the run still ends, nothing breaks.
        gone = Raw(daemon)
        gone.send(Call(1, "SubmitRun", _submit([sub_task(sleep, scalars=[200])], 60.0)))
        wait_until(
            lambda: any(r.state == pb.RUN_STATE_EXECUTING for r in c.list_runs()),
            30,
            "the departing client's run never started",
        )
        gone.close()
        wait_until(
            lambda: all(r.state == pb.RUN_STATE_COMPLETED for r in c.list_runs()),
            30,
            "the departed client's run never ended",
        )
        raw.send(Call(4, "GetInfo", b""))
        assert raw.reply(4).code == OK
        assert "a finish callback failed" not in daemon.stderr()
    finally:
        raw.close()


@pytest.mark.timeout(90)
def test_a_refusal_at_the_runs_end_is_the_same_on_both_transports(
    daemon: DaemonProcess, c: Client
) -> None:
    """Results a finished run could not keep (limits.max_finished_result_bytes) refuse
    include_results when the status is built, at the run's end: the same code, field
    and words as over gRPC, whose handler builds it after waiting."""
    blob = c.register(f"{TASKS}:blob")
    tasks = [sub_task(blob, scalars=[10_000])] * 3  # each under a result's own limit (32 KiB)
    with pytest.raises(FailedPrecondition) as fast:
        c.submit_run(tasks, wait_seconds=60.0, include_results=True)
    with (
        daemon.client(timeout=60, transport="grpc") as g,
        pytest.raises(FailedPrecondition) as slow,
    ):
        g.submit_run(tasks, wait_seconds=60.0, include_results=True)
    assert fast.value.field == slow.value.field == "include_results"
    for refused in (fast.value, slow.value):
        assert "they were dropped (limits.max_finished_result_bytes" in str(refused)
    # The runs themselves completed: their status without results is answered.
    runs = [r for r in c.list_runs() if r.state == pb.RUN_STATE_COMPLETED]
    assert len(runs) >= 2
    assert c.wait_run(runs[0].run_id, 30).state == pb.RUN_STATE_COMPLETED


@pytest.mark.timeout(90)
def test_a_plain_task_planned_before_is_refused_once_its_callable_is_gone(
    daemon: DaemonProcess, c: Client
) -> None:
    """The planner keeps the plan of a plain task (server/plan.py ``_known``) only while
    its callable's registration lives: an unregister, or the end of the session that
    held the only reference, refuses the next run of that very task as if it had never
    been planned; registering again makes it runnable again."""
    echo = c.register(f"{TASKS}:echo")
    plain = [sub_task(echo)]
    assert c.submit_run(plain, wait_seconds=30.0).status.state == pb.RUN_STATE_COMPLETED
    assert c.unregister(echo) == 0
    with pytest.raises(NotFound) as gone:
        c.submit_run(plain, wait_seconds=30.0)
    assert gone.value.field == "tasks[0].hashid" and "is not registered" in str(gone.value)
    assert c.register(f"{TASKS}:echo") == echo
    assert c.submit_run(plain, wait_seconds=30.0).status.state == pb.RUN_STATE_COMPLETED
    # Another client's session holds the only reference of `shout`: when it ends, the
    # registration goes, and so does the plan.
    with daemon.client(timeout=60, transport="fast") as other:
        shout = other.register(f"{TASKS}:shout")
        loud = [sub_task(shout)]
        assert other.submit_run(loud, wait_seconds=30.0).status.state == pb.RUN_STATE_COMPLETED
        assert c.submit_run(loud, wait_seconds=30.0).status.state == pb.RUN_STATE_COMPLETED

    def refused() -> bool:
        try:
            c.submit_run(loud, wait_seconds=30.0)
        except NotFound as exc:
            return exc.field == "tasks[0].hashid"
        return False

    wait_until(refused, 30, "a run of a callable whose session ended was still accepted")
