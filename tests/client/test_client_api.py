"""The client API against a real daemon: futures with results, errors as project
types, cancel that stops running tasks, drain then resume, run listing.

One real daemon for the module (two SUB workers, a TCP listener for a second,
non-admin client identity, and a small limits.max_finished_runs_kept so that
eviction shows).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from simpler_daemon.client import (
    AsyncClient,
    AsyncRunFuture,
    CancelResult,
    Client,
    RunFuture,
    RunPhase,
    RunResult,
    sub_task,
    tensor,
)
from simpler_daemon.client.errors import (
    DaemonError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    daemon_error,
)
from simpler_daemon.client.results import TaskResultValue
from simpler_daemon.errors import RunCancelled, SimplerError, TaskError
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol.metadata import FIELD_METADATA
from simpler_daemon.server.run_record import RESULT_KEPT_OVERHEAD
from tests.support.daemon_harness import (
    EXAMPLES,
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    wait_until,
)
from tests.support.two_clients import TcpAccess

pytestmark = pytest.mark.timeout(120)

TASKS = "tests.support.daemon_tasks"
KEPT = 6  # limits.max_finished_runs_kept
RUN_RESULTS = 600  # limits.max_run_result_bytes: five big echo results fit, six do not
# limits.max_finished_result_bytes: two runs of five results fit, three not (a kept
# result counts its msgpack bytes + RESULT_FRAMING + RESULT_KEPT_OVERHEAD)
FINISHED_RESULTS = 1500 + 10 * RESULT_KEPT_OVERHEAD
BIG = [2**63 + i for i in range(8)]  # eight 9-byte scalars: an echo result of ~90 bytes
CONFIG: dict[str, dict[str, Any]] = {
    "workers": {"num_sub_workers": 2},
    "limits": {
        "max_finished_runs_kept": KEPT,
        "max_run_result_bytes": RUN_RESULTS,
        "max_finished_result_bytes": FINISHED_RESULTS,
    },
    "callables": {"allowed_modules": ["simpler_daemon.examples", "tests"]},
}

_MODULE_DAEMONS: set[int] = set()


@pytest.fixture(scope="module")
def tcp(tmp_path_factory: pytest.TempPathFactory) -> TcpAccess:
    return TcpAccess(tmp_path_factory.mktemp("client-api-tls"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tcp: TcpAccess) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "client-api", tcp.overrides(CONFIG), _MODULE_DAEMONS)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    """The conftest guard, minus the module daemon (it lives across tests on purpose)."""
    yield from module_leak_guard(lambda: set(_MODULE_DAEMONS))


@pytest.fixture(params=["grpc", "fast"])
def c(daemon: DaemonProcess, request: pytest.FixtureRequest) -> Iterator[Client]:
    """The suite runs over both transports (gRPC and the local fast path): same answers,
    same errors."""
    with daemon.client(timeout=60, transport=request.param) as client:
        assert client.transport == request.param
        yield client


# --------------------------------------------------------------------------- futures


def test_submit_returns_a_future_whose_result_has_the_task_results(c: Client) -> None:
    echo = c.register(f"{TASKS}:echo")
    nothing = c.register(f"{TASKS}:nothing")
    tasks = [sub_task(echo, scalars=[1, 2]), sub_task(nothing), sub_task(echo, scalars=[7])]
    fut = c.submit(tasks, label="futures")
    assert isinstance(fut, RunFuture) and not fut.deduplicated
    assert fut == fut.run_id and str(fut) == str(fut.run_id)  # still the run id
    called = threading.Event()
    seen: list[RunFuture] = []

    def on_done(f: RunFuture) -> None:
        seen.append(f)
        called.set()

    fut.add_done_callback(on_done)
    result = fut.result(timeout=30)
    assert isinstance(result, RunResult) and result.terminal and fut.done()
    assert result.state is RunPhase.COMPLETED
    assert int(result.state) == pb.RUN_STATE_COMPLETED
    assert result.label == "futures" and result.priority == 1 and result.client.startswith("uid:")
    assert result.counts.total == result.counts.done == 3 and result.error is None
    assert result.finish_time is not None and result.submit_time is not None
    # Only the tasks that returned something, in task order, decoded.
    assert [(r.task_index, r.member_index) for r in result.results] == [(0, None), (2, None)]
    assert result.results[0].value["scalars"] == [1, 2]
    assert result.values()[2]["scalars"] == [7]
    assert called.wait(30) and seen == [fut]
    # A status without results unless asked for; run() returns them in one round trip.
    assert c.wait_run(fut).results == []
    assert c.wait_run(fut, include_results=True).results == result.results
    ran = c.run([sub_task(echo, scalars=[5])], timeout=30)
    assert ran.results == [TaskResultValue(0, None, ran.results[0].value)]
    assert ran.results[0].value["scalars"] == [5]
    # A done callback added late runs at once.
    late: list[RunFuture] = []
    fut.add_done_callback(late.append)
    assert late == [fut]


def test_a_failed_run_raises_from_result_and_wait(c: Client, daemon: DaemonProcess) -> None:
    fail = c.register(f"{EXAMPLES}:fail")
    fut = c.submit([sub_task(fail, scalars=[3])])
    with pytest.raises(TaskError, match="example failure") as info:
        fut.result(timeout=30)
    assert info.value.run_id == fut.run_id and info.value.outcome == "TASK_FAILURE"
    assert isinstance(fut.exception(timeout=30), TaskError)
    status = c.wait_run(fut)  # no exception: the status says it
    assert status.state is RunPhase.FAILED and status.error is not None
    assert status.error.task_index == 0 and "example failure" in status.error.message
    # The operator log has one line for the task and one for the run (server/oplog.py).
    wait_until(
        lambda: (
            f"task 0 of run {fut.run_id} failed on sub worker" in daemon.stderr()
            and f"run {fut.run_id} failed" in daemon.stderr()
        ),
        10,
        "no operator log lines for the failed run",
    )


def _async_client(daemon: DaemonProcess, tcp: TcpAccess, how: str) -> AsyncClient:
    """An AsyncClient over TCP (gRPC, TLS), or the local socket by ``transport``."""
    if how == "tcp":
        return tcp.async_client(daemon, timeout=60)
    client = AsyncClient(daemon.socket, timeout=60, transport=how)
    assert client.transport == how
    return client


@pytest.mark.parametrize("how", ["tcp", "grpc", "fast"])
def test_async_client_futures_are_awaitable(
    daemon: DaemonProcess, tcp: TcpAccess, how: str
) -> None:
    async def go() -> None:
        async with _async_client(daemon, tcp, how) as ac:
            echo = await ac.register(f"{TASKS}:echo")
            fut = await ac.submit([sub_task(echo, scalars=[9])], priority=2)
            assert isinstance(fut, AsyncRunFuture)
            done = asyncio.Event()
            fut.add_done_callback(lambda _f: done.set())
            result = await fut
            assert result.results[0].value["scalars"] == [9] and result.priority == 2
            assert await fut.done()
            await asyncio.wait_for(done.wait(), 30)
            runs = await ac.list_runs(limit=1)
            assert runs[0].run_id == fut.run_id

    asyncio.run(go())


def test_run_futures_work_with_concurrent_futures_and_wrap_future(c: Client) -> None:
    """``wait``/``as_completed`` read Future internals and ``wrap_future`` checks the
    type: a RunFuture used to raise AttributeError ('_condition') in them."""
    from simpler_daemon.futures import gather

    echo = c.register(f"{TASKS}:echo")
    sleep = c.register(f"{TASKS}:sleep_ms")
    slow = c.submit([sub_task(sleep, scalars=[60_000])], label="held")
    fast = c.submit([sub_task(echo, scalars=[3])])
    assert isinstance(fast, concurrent.futures.Future)
    done, pending = concurrent.futures.wait(
        [slow, fast], timeout=60, return_when=concurrent.futures.FIRST_COMPLETED
    )
    assert done == {fast} and pending == {slow}
    assert slow.cancel(terminate=True)
    assert list(concurrent.futures.as_completed([slow], timeout=60)) == [slow]
    assert slow.cancelled()

    async def main() -> RunResult:
        return await asyncio.wait_for(asyncio.wrap_future(fast), 60)

    assert asyncio.run(main()).results[0].value["scalars"] == [3]
    results = gather([c.submit([sub_task(echo, scalars=[n])]) for n in range(3)], timeout=60)
    assert [r.results[0].value["scalars"] for r in results] == [[0], [1], [2]]


@pytest.mark.parametrize("how", ["tcp", "grpc", "fast"])
def test_async_run_futures_compose_with_asyncio(
    daemon: DaemonProcess, tcp: TcpAccess, how: str
) -> None:
    async def go() -> None:
        async with _async_client(daemon, tcp, how) as ac:
            echo = await ac.register(f"{TASKS}:echo")
            futs = [await ac.submit([sub_task(echo, scalars=[n])]) for n in range(3)]
            got = await asyncio.gather(*futs)
            assert [r.results[0].value["scalars"] for r in got] == [[0], [1], [2]]
            one = await asyncio.wait_for(futs[0], 30)
            assert one.run_id == futs[0].run_id
            seen = [await f for f in asyncio.as_completed(futs, timeout=60)]
            assert sorted(r.run_id for r in seen) == sorted(f.run_id for f in futs)

    asyncio.run(go())


# --------------------------------------------------------------------------- errors


def test_errors_are_daemon_errors_naming_the_field(c: Client) -> None:
    fill = c.register(f"{EXAMPLES}:fill")
    buf = c.alloc_buffer((4,), "int32").buffer_id
    try:
        with pytest.raises(InvalidArgument) as bad:
            c.submit([sub_task(fill, [tensor(buf, "output", (4,), "int32")], [1]), pb.Task()])
        err = bad.value
        # A project type, and still what old code caught: grpc.RpcError with code().
        assert isinstance(err, (DaemonError, SimplerError, ValueError, grpc.RpcError))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert err.status_name == "INVALID_ARGUMENT"
        assert err.field is not None and err.field.startswith("tasks[1]"), err.field
        assert err.details().startswith(err.field)
        with pytest.raises(NotFound) as missing:
            c.wait(10**9, timeout=0)
        assert isinstance(missing.value, LookupError) and missing.value.field == "run_id"
        with pytest.raises(NotFound):
            c.cancel(10**9)
        # The daemon checks priority itself (the client refuses it before sending).
        with pytest.raises(ValueError, match="priority"):
            c.submit([sub_task(fill, [tensor(buf, "output", (4,), "int32")])], priority=1001)
        request = pb.SubmitRunRequest(tasks=[sub_task(fill)], priority=1001)
        with pytest.raises(grpc.RpcError) as raw:
            c.stub.SubmitRun(request, timeout=30)
        assert dict(raw.value.trailing_metadata())[FIELD_METADATA] == "priority"
        mapped = daemon_error(raw.value)
        assert isinstance(mapped, InvalidArgument) and mapped.field == "priority"
        assert "1001" in mapped.details()
    finally:
        c.free_buffer(buf)


def test_another_clients_run_is_permission_denied(
    c: Client, daemon: DaemonProcess, tcp: TcpAccess
) -> None:
    nothing = c.register(f"{TASKS}:nothing")
    mine = c.submit([sub_task(nothing)])
    mine.result(timeout=30)
    with tcp.client(daemon, timeout=30) as other:
        with pytest.raises(PermissionDenied) as info:
            other.wait(mine)
        assert isinstance(info.value, PermissionError)
        with pytest.raises(PermissionDenied):
            other.resume()  # admin only, like Drain


# --------------------------------------------------------------------------- cancel


def _sub_pids(c: Client) -> dict[int, int]:
    return {w.worker_id: w.pid for w in c.list_workers() if w.pid}


def test_cancel_terminate_stops_a_task_in_sleep_and_replaces_its_worker(c: Client) -> None:
    sleep = c.register(f"{TASKS}:sleep_ms")
    before = _sub_pids(c)
    fut = c.submit([sub_task(sleep, scalars=[60_000])], label="stuck")
    wait_until(lambda: fut.status().counts.running == 1, 30, "the task never started")
    t0 = time.monotonic()
    answer = c.cancel(fut, "stop it now", terminate=True)
    assert isinstance(answer, CancelResult) and not answer.already_finished
    with pytest.raises(RunCancelled) as info:
        fut.result(timeout=30)
    stopped = time.monotonic() - t0
    print(f"\ncancel(terminate=True) stopped time.sleep(60) in {stopped * 1e3:.0f} ms")
    assert stopped < 1.0, f"the task took {stopped:.2f}s to stop"
    status = c.wait_run(fut)
    assert status.state is RunPhase.CANCELLED and status.error is not None
    assert status.error.outcome == "CANCELLED"
    assert "stop it now" in str(info.value) or "terminate" in str(info.value)

    # The worker that ran it was killed and replaced; the pool keeps serving.
    def replaced_pool() -> dict[int, int] | None:
        now = _sub_pids(c)
        return now if len(now) == len(before) and now != before else None

    after = wait_until(replaced_pool, 30, "the stopped worker was not replaced")
    replaced = [w for w in before if after[w] != before[w]]
    assert len(replaced) == 1 and not os.path.exists(f"/proc/{before[replaced[0]]}")
    assert c.run([sub_task(sleep, scalars=[1])] * 4, timeout=30).counts.done == 4


def test_cancel_without_terminate_lets_the_running_task_finish(c: Client) -> None:
    sleep = c.register(f"{TASKS}:sleep_ms")
    before = _sub_pids(c)
    fut = c.submit([sub_task(sleep, scalars=[300]), sub_task(sleep, scalars=[300])] * 2)
    wait_until(lambda: fut.status().counts.running > 0, 30, "the tasks never started")
    with pytest.raises(DeadlineExceeded) as late:  # a watch bounded in time
        list(c.watch(fut, timeout=0.05))
    assert isinstance(late.value, TimeoutError)
    assert fut.cancel()
    with pytest.raises(RunCancelled):
        fut.result(timeout=30)
    assert c.wait_run(fut).counts.done >= 1  # the running ones ran to their end
    assert _sub_pids(c) == before
    assert not fut.cancel()  # already finished


# --------------------------------------------------------------------------- drain, resume


def test_drain_then_resume_serves_again(c: Client) -> None:
    nothing = c.register(f"{TASKS}:nothing")
    health = health_pb2_grpc.HealthStub(c.channel)

    def serving() -> int:
        return int(health.Check(health_pb2.HealthCheckRequest(), timeout=10).status)

    assert not c.resume()  # not draining: nothing to undo
    c.drain(grace=0)
    try:
        assert c.get_info().serving_state == pb.SERVING_STATE_DRAINING
        assert serving() == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(FailedPrecondition, match="draining"):
            c.submit([sub_task(nothing)])
    finally:
        assert c.resume()
    assert c.get_info().serving_state == pb.SERVING_STATE_SERVING
    assert serving() == health_pb2.HealthCheckResponse.SERVING
    assert c.run([sub_task(nothing)], timeout=30).state is RunPhase.COMPLETED


def test_resume_during_a_drain_grace_cancels_nothing(c: Client) -> None:
    sleep = c.register(f"{TASKS}:sleep_ms")
    fut = c.submit([sub_task(sleep, scalars=[60_000])], label="outlives-the-drain")
    try:
        wait_until(lambda: fut.status().counts.running == 1, 30, "the task never started")
        answers: list[pb.DrainResponse] = []
        drain = threading.Thread(target=lambda: answers.append(c.drain(grace=3)))
        drain.start()
        try:
            wait_until(
                lambda: c.get_info().serving_state == pb.SERVING_STATE_DRAINING, 30, "no drain"
            )
        finally:
            assert c.resume()
            drain.join(30)
        assert not drain.is_alive()
        # The Resume ended the drain's grace: it cancelled nothing and the run goes on.
        assert answers[0].runs_cancelled == 0 and answers[0].runs_finished == 0
        assert fut.status().state is RunPhase.EXECUTING
        assert c.get_info().serving_state == pb.SERVING_STATE_SERVING
    finally:
        fut.cancel(terminate=True)
    with pytest.raises(RunCancelled):
        fut.result(timeout=30)


# --------------------------------------------------------------------------- limits


def test_a_run_past_max_run_result_bytes_fails_naming_the_limit(c: Client) -> None:
    echo = c.register(f"{TASKS}:echo")
    fits = c.run([sub_task(echo, scalars=BIG)] * 5, timeout=30)
    assert len(fits.results) == 5 and fits.results[4].value["scalars"] == BIG
    fut = c.submit([sub_task(echo, scalars=BIG)] * 8)
    with pytest.raises(TaskError, match=f"limits.max_run_result_bytes = {RUN_RESULTS}") as info:
        fut.result(timeout=30)
    assert info.value.outcome == "TASK_FAILURE"
    status = c.wait_run(fut, include_results=True)  # what was kept is still fetchable
    assert status.state is RunPhase.FAILED and 0 < len(status.results) <= 5
    assert status.counts.failed >= 1


def test_finished_runs_results_past_max_finished_result_bytes_are_dropped(c: Client) -> None:
    echo = c.register(f"{TASKS}:echo")
    runs: list[RunFuture] = []
    for _ in range(3):  # one after the other: they finish oldest first
        runs.append(c.submit([sub_task(echo, scalars=BIG)] * 5))
        assert c.wait_run(runs[-1], 30).state is RunPhase.COMPLETED  # results not fetched
    with pytest.raises(FailedPrecondition, match="max_finished_result_bytes") as info:
        c.wait_run(runs[0], include_results=True)
    assert f"run {runs[0].run_id}" in str(info.value)
    with pytest.raises(FailedPrecondition, match="dropped"):
        runs[0].result(timeout=30)
    assert runs[0].done()
    assert c.wait_run(runs[0]).state is RunPhase.COMPLETED  # the status stays
    assert [len(f.result(timeout=30).results) for f in runs[1:]] == [5, 5]


def test_done_callbacks_share_one_watcher_thread(c: Client) -> None:
    sleep = c.register(f"{TASKS}:sleep_ms")
    before = {t.ident for t in threading.enumerate()}
    futures = [c.submit([sub_task(sleep, scalars=[50])]) for _ in range(20)]
    called: list[RunFuture] = []
    lock = threading.Lock()

    def on_done(f: RunFuture) -> None:
        with lock:
            called.append(f)

    for fut in futures:
        fut.add_done_callback(on_done)
    new = [t for t in threading.enumerate() if t.ident not in before]
    assert len(new) <= 1, [t.name for t in new]
    wait_until(lambda: len(called) == len(futures), 60, "not every done callback ran")
    assert sorted(called) == sorted(futures)
    assert all(f.done() for f in futures)


def test_a_negative_scalar_is_a_value_error_naming_it(c: Client) -> None:
    with pytest.raises(ValueError, match=r"scalars\[1\] = -1 is out of range"):
        sub_task("0" * 16, scalars=[1, -1])


@pytest.mark.parametrize("bad", [1.5, 1.0, True, "7", None])
def test_a_scalar_that_is_not_an_integer_is_never_converted(c: Client, bad: Any) -> None:
    """1.5 used to travel as 1, True as 1 and "7" as 7: now the client refuses them
    before anything is sent, with the rule TaskArgs.add_scalar applies."""
    with pytest.raises(TypeError, match=r"scalars\[1\] must be an int or a NumPy integer"):
        sub_task("0" * 16, scalars=[1, bad])


# --------------------------------------------------------------------------- listing


def test_list_runs_own_runs_newest_first_with_filters_and_eviction(
    c: Client, daemon: DaemonProcess, tcp: TcpAccess
) -> None:
    nothing = c.register(f"{TASKS}:nothing")
    fail = c.register(f"{EXAMPLES}:fail")
    with tcp.client(daemon, timeout=60) as other:
        theirs = other.submit([sub_task(nothing)], label="theirs")
        theirs.result(timeout=30)
        # One after another: a full table (the other transport's runs of this module's
        # daemon) evicts the oldest *finished*, so the finish order must be the submit order.
        ours = []
        for i in range(3):
            ours.append(c.submit([sub_task(nothing)], label=f"ours-{i}"))
            ours[-1].result(timeout=30)
        failed = c.submit([sub_task(fail)], label="ours-failed")
        failed.exception(timeout=30)
        # A client sees its own runs only; the admin (this process, root or the
        # daemon's user) sees every client's, newest first.
        mine = other.list_runs()
        assert mine[0].run_id == theirs.run_id and mine[0].label == "theirs"
        assert mine[0].client.startswith("tcp:") and mine[0].age_seconds >= 0
        everyone = c.list_runs(limit=5)
        assert [r.run_id for r in everyone] == sorted((r.run_id for r in everyone), reverse=True)
        assert everyone[0].run_id == failed.run_id
        assert theirs.run_id in {r.run_id for r in everyone}
        assert all(r.client.startswith("tcp:") for r in mine)
        assert [r.run_id for r in c.list_runs(states=["failed"], limit=1)] == [failed.run_id]
        assert c.list_runs(states=[RunPhase.FAILED])[0].state is RunPhase.FAILED
        completed = c.list_runs(states=["completed"], limit=2)
        assert [r.run_id for r in completed] == [ours[2].run_id, ours[1].run_id]
        assert completed[0].counts.done == 1 and completed[0].finish_time is not None
        with pytest.raises(ValueError, match="unknown state"):
            c.list_runs(states=["bogus"])
        # Finished runs are kept up to limits.max_finished_runs_kept, then the oldest of
        # the client holding the most is evicted: our many runs never evict theirs.
        more: list[RunFuture] = []
        for _ in range(KEPT):
            more.append(c.submit([sub_task(nothing)]))
            more[-1].result(timeout=30)
        kept = c.list_runs(limit=100)
        assert len(kept) == KEPT
        assert theirs.run_id in {r.run_id for r in kept}
        assert theirs.result(timeout=30).state is RunPhase.COMPLETED
        assert more[-1].run_id in {r.run_id for r in kept}
        # Ours went first; an evicted future is done, and result() says why.
        assert ours[0].run_id not in {r.run_id for r in kept}
        gone = c.future(ours[0].run_id)
        assert gone.done()
        evicted = f"run {ours[0].run_id} finished and was evicted "
        with pytest.raises(
            NotFound, match=evicted + rf"\(limits.max_finished_runs_kept = {KEPT}\)"
        ):
            gone.result(timeout=30)
        with pytest.raises(NotFound, match="its status is gone"):
            c.wait_run(ours[0])
        with pytest.raises(NotFound, match="never submitted"):
            c.wait_run(10**9)


def test_a_retry_may_differ_in_how_it_asks_for_the_answer(c: Client) -> None:
    """wait_seconds and include_results say how to answer, not what to run: a retry with
    the same idempotency key that differs only in them names the same run."""
    nothing = c.register(f"{TASKS}:nothing")
    key = f"retry-answer-{c.transport}-{os.getpid()}"
    first = c.submit_run(
        [sub_task(nothing)], idempotency_key=key, wait_seconds=30, include_results=True
    )
    again = c.submit([sub_task(nothing)], idempotency_key=key)
    assert again.deduplicated and again.run_id == first.run_id
