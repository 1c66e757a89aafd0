"""Faults and misuse through a real daemon: buffers pinned by queued runs, a responsive
event loop under big requests (and the group size limit), hostile requests and client
identity, and the client library's wait timeouts.

Most cases share one module daemon; the big-request cases start their own with
larger limits.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from simpler_daemon.client import Client, make_args, sub_task, task, tensor
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from tests.support.daemon_harness import (
    EXAMPLES,
    REPO,
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    running_daemon,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

Code = grpc.StatusCode
LIMITS = {"limits": {"max_streams_per_client": 2, "max_group_members": 4}}
FLAG_WAIT_MS = 60_000


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "faults", LIMITS)


@pytest.fixture(autouse=True)
def no_leaked_children(daemon: DaemonProcess) -> Iterator[None]:
    """Overrides the conftest guard: the module daemon lives across tests on purpose."""
    yield from module_leak_guard(lambda: {daemon.pid})


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with daemon.client() as c:
        yield c


def _flag(c: Client) -> int:
    return int(c.alloc_buffer((2,), "uint8").buffer_id)


def _hold(c: Client, wait_h: str, flag: int) -> int:
    """A run whose one task waits until ``flag`` is released."""
    ref = tensor(flag, "inout", (2,), "uint8")
    return c.submit([sub_task(wait_h, [ref], [FLAG_WAIT_MS])])


def _release(c: Client, flag: int) -> None:
    c.write_buffer(flag, np.array([1, 0], dtype=np.uint8))


def _state(c: Client, run_id: int) -> int:
    return int(c.wait_run(run_id, timeout=0).state)


def _not_started(c: Client, run_id: int) -> bool:
    """Waiting for a worker: QUEUED under fifo admission, admitted under fair; either
    way none of its tasks has run."""
    status = c.wait_run(run_id, timeout=0)
    return not status.terminal and status.counts.done == status.counts.running == 0


def _references(c: Client, buffer_id: int) -> int:
    for info in c.list_buffers().buffers:
        if info.buffer_id == buffer_id:
            return int(info.references)
    return -1


# ============================================================== pin at submit


def test_free_of_a_buffer_a_queued_run_uses_is_deferred(client: Client) -> None:
    c = client
    wait_h = c.register(f"{EXAMPLES}:wait_for_flag")
    fill = c.register(f"{EXAMPLES}:fill")
    flags = [_flag(c), _flag(c)]
    holders = [_hold(c, wait_h, f) for f in flags]  # both pipeline leases taken
    target = c.alloc_buffer((256,), "float32").buffer_id
    queued = c.submit([sub_task(fill, [tensor(target, "output", (256,), "float32")], [7])])
    try:
        assert _not_started(c, queued)
        assert _references(c, target) >= 1, "a queued run must pin its buffers"
        assert c.free_buffer(target) is True, "the free must wait for the queued run"
        # The freed memory is not handed out while the queued run may still write it.
        other = c.alloc_array(np.full(256, 3.0, dtype=np.float32))
    finally:
        for f in flags:
            _release(c, f)
    for run_id in (*holders, queued):
        c.wait(run_id, timeout=60)
    assert np.all(c.read_array(other, (256,), "float32") == 3.0), "a queued run wrote into it"
    wait_until(lambda: _references(c, target) == -1, message="the deferred free never happened")
    c.free_buffer(other)
    for f in flags:
        c.free_buffer(f)


def test_run_orchestration_pins_its_argument_buffers(client: Client) -> None:
    c = client
    wait_h = c.register(f"{EXAMPLES}:wait_for_flag")
    c.register(f"{EXAMPLES}:fill")  # what the orchestration submits
    orch = c.register("simpler_daemon.examples.remote:fill_all", "orchestration")
    flags = [_flag(c), _flag(c)]
    holders = [_hold(c, wait_h, f) for f in flags]
    target = c.alloc_buffer((64,), "float32").buffer_id
    args = make_args([tensor(target, "output", (64,), "float32")], [5])
    queued = c.run_orchestration(orch, args)
    try:
        assert _not_started(c, queued)
        assert c.free_buffer(target) is True
    finally:
        for f in flags:
            _release(c, f)
    for run_id in (*holders, queued):
        c.wait(run_id, timeout=60)
    wait_until(lambda: _references(c, target) == -1, message="the deferred free never happened")
    for f in flags:
        c.free_buffer(f)


# ============================================================== hostile requests


GARBAGE = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length-delimited, length past the end


def _log_errors(daemon: DaemonProcess) -> list[str]:
    return [
        line for line in daemon.stderr().splitlines() if " ERROR " in line or "Traceback" in line
    ]


def test_garbage_request_bytes_are_invalid_argument(daemon: DaemonProcess) -> None:
    before = len(_log_errors(daemon))
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        for method in ("SubmitRun", "GetInfo", "WaitRun"):
            call = channel.unary_unary(f"/simpler.daemon.v1.Daemon/{method}")
            with pytest.raises(grpc.RpcError) as info:
                call(GARBAGE, timeout=10)
            assert info.value.code() == Code.INVALID_ARGUMENT, (method, info.value.details())
            assert "cannot parse the request" in (info.value.details() or "")
        write = channel.stream_unary("/simpler.daemon.v1.Daemon/WriteBuffer")
        with pytest.raises(grpc.RpcError) as info:
            write(iter([GARBAGE]), timeout=10)
        assert info.value.code() == Code.INVALID_ARGUMENT, info.value.details()
        watch = channel.unary_stream("/simpler.daemon.v1.Daemon/WatchRun")
        with pytest.raises(grpc.RpcError) as info:
            list(watch(GARBAGE, timeout=10))
        assert info.value.code() == Code.INVALID_ARGUMENT, info.value.details()
    with daemon.client() as c:
        assert c.get_info().serving_state == pb.SERVING_STATE_SERVING
    assert len(_log_errors(daemon)) == before, _log_errors(daemon)[before:]


def test_idempotency_key_reused_for_another_request_is_refused(client: Client) -> None:
    c = client
    fill = c.register(f"{EXAMPLES}:fill")
    buf = c.alloc_buffer((8,), "float32").buffer_id
    ref = tensor(buf, "output", (8,), "float32")
    first = c.submit_run([sub_task(fill, [ref], [1])], idempotency_key="faults-key-1")
    again = c.submit_run(
        [sub_task(fill, [ref], [1])], idempotency_key="faults-key-1", wait_seconds=30
    )
    assert again.deduplicated and again.run_id == first.run_id
    assert again.status.state == pb.RUN_STATE_COMPLETED
    with pytest.raises(grpc.RpcError) as info:
        c.submit_run([sub_task(fill, [ref], [2])], idempotency_key="faults-key-1")
    assert info.value.code() == Code.FAILED_PRECONDITION, info.value.details()
    details = info.value.details() or ""
    assert "idempotency_key" in details and "'faults-key-1'" in details, details
    assert f"run {first.run_id}" in details, details
    orch = c.register("simpler_daemon.examples.remote:nothing", "orchestration")
    with pytest.raises(grpc.RpcError) as info:
        c.run_orchestration(orch, idempotency_key="faults-key-1")
    assert info.value.code() == Code.FAILED_PRECONDITION, info.value.details()
    c.free_buffer(buf)


def test_same_key_sent_twice_at_once_starts_one_run(daemon: DaemonProcess) -> None:
    """Planning yields to the loop: a retry arriving meanwhile must join, not duplicate."""
    with daemon.client() as c, daemon.client() as d:
        empty = c.register(f"{EXAMPLES}:empty")
        buf = c.alloc_buffer((8,), "float32").buffer_id
        member = make_args([tensor(buf, "input", (8,), "float32")])
        tasks = [task("sub", empty, [member])] * 1000
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            calls = [
                pool.submit(x.submit_run, tasks, idempotency_key="faults-twice", wait_seconds=60)
                for x in (c, d)
            ]
            answers = [f.result(timeout=90) for f in calls]
        assert answers[0].run_id == answers[1].run_id
        assert sorted(a.deduplicated for a in answers) == [False, True]
        assert all(a.status.state == pb.RUN_STATE_COMPLETED for a in answers)
        c.free_buffer(buf)


def _watch_one(c: Client, run_id: int) -> Iterator[pb.RunEvent]:
    stream = c.watch(run_id)
    next(stream)  # the snapshot: the stream is open on the daemon
    return stream


_OTHER_PROCESS = textwrap.dedent(
    """
    import sys
    import grpc
    from simpler_daemon.client import Client
    with Client(sys.argv[1], client_id="faults-z") as c:
        try:
            stream = c.watch(int(sys.argv[2]))
            print(next(stream).type, flush=True)
            stream.close()
        except grpc.RpcError as exc:
            print(exc.code().name, exc.details(), flush=True)
    """
)


def test_per_client_limits_follow_peer_credentials_not_the_header(
    daemon: DaemonProcess, client: Client
) -> None:
    c = client
    wait_h = c.register(f"{EXAMPLES}:wait_for_flag")
    flag = _flag(c)
    run_id = _hold(c, wait_h, flag)
    streams: list[Iterator[pb.RunEvent]] = []
    try:
        with (
            daemon.client(client_id="faults-a") as a,
            daemon.client(client_id="faults-b") as b,
        ):
            streams = [_watch_one(a, run_id), _watch_one(a, run_id)]  # this pid's 2 streams
            # Another label from the same process is the same client.
            with pytest.raises(grpc.RpcError) as info:
                _watch_one(b, run_id)
            assert info.value.code() == Code.RESOURCE_EXHAUSTED, info.value.details()
            assert "max_streams_per_client" in (info.value.details() or "")
            # Another process of the same user, with a label of its own, is still the
            # same client: the kernel's uid decides, not the pid or the header.
            out = subprocess.run(
                [sys.executable, "-c", _OTHER_PROCESS, daemon.socket, str(run_id)],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert out.returncode == 0, out.stderr
            assert out.stdout.startswith("RESOURCE_EXHAUSTED"), out.stdout
            assert "max_streams_per_client" in out.stdout, out.stdout
            for s in streams:
                s.close()  # type: ignore[attr-defined]
    finally:
        _release(c, flag)
    c.wait(run_id, timeout=60)
    c.free_buffer(flag)


# ============================================================== group limit


def test_group_members_are_bounded(client: Client) -> None:
    empty = client.register(f"{EXAMPLES}:empty")
    with pytest.raises(grpc.RpcError) as info:
        client.submit([task("sub_group", empty, [make_args()] * 5)])
    assert info.value.code() == Code.RESOURCE_EXHAUSTED, info.value.details()
    details = info.value.details() or ""
    assert "tasks[0].members: 5 members, limits.max_group_members = 4" in details, details


# ============================================================== client timeouts


def test_client_wait_timeouts_are_checked_and_clamped(client: Client) -> None:
    c = client
    empty = c.register(f"{EXAMPLES}:empty")
    run_id = c.submit([sub_task(empty)])
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="timeout must be >= 0"):
            c.wait_run(run_id, timeout=bad)
        with pytest.raises(ValueError, match="wait_seconds must be >= 0"):
            c.submit_run([sub_task(empty)], wait_seconds=bad)
    for huge in (1e12, float("inf")):
        assert c.wait(run_id, timeout=huge).state == pb.RUN_STATE_COMPLETED
        status = c.submit_run([sub_task(empty)], wait_seconds=huge).status
        assert status.state == pb.RUN_STATE_COMPLETED
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        Client(c.target, timeout=float("nan"))


# ============================================================== a responsive loop

BIG = 100_000
BIG_LIMITS = {
    "limits": {
        "max_tasks_per_run": BIG,
        "max_message_bytes": 64 << 20,
        "max_concurrent_runs": 8,
    }
}


def _big_tasks(empty: str, buf: int) -> list[pb.Task]:
    member = make_args([tensor(buf, "input", (8,), "float32")])
    one = task("sub", empty, [member])
    return [one] * BIG


@pytest.fixture
def big_daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    """A daemon of its own that takes 100,000-task runs (stopped after the test, so the
    module's leak guard sees no extra process)."""
    with running_daemon(tmp_path / "big", BIG_LIMITS) as d:
        yield d


def test_other_clients_progress_while_a_big_submit_is_planned(big_daemon: DaemonProcess) -> None:
    with big_daemon.client(timeout=120) as big, big_daemon.client() as small:
        empty = big.register(f"{EXAMPLES}:empty")
        fill = small.register(f"{EXAMPLES}:fill")
        buf = big.alloc_buffer((8,), "float32").buffer_id
        out = small.alloc_buffer((8,), "float32").buffer_id
        request = _big_tasks(empty, buf)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(big.submit_run, request)
            # The daemon is working on the big request: its buffer is pinned by it.
            wait_until(
                lambda: pending.done() or _references(small, buf) > 0,
                timeout=60,
                message="the big request never started",
            )
            assert not pending.done(), "the big request was handled in one go"
            status = small.run(
                [sub_task(fill, [tensor(out, "output", (8,), "float32")], [9])], timeout=60
            )
            big_in_flight = not pending.done()
            response = pending.result(timeout=120)
        assert status.state == pb.RUN_STATE_COMPLETED
        assert big_in_flight, "another client's run waited for the whole big request"
        big.cancel(response.run_id, reason="test over")
        final = big.wait_run(response.run_id, timeout=120)
        assert final.state in (pb.RUN_STATE_CANCELLED, pb.RUN_STATE_COMPLETED)
        assert np.all(small.read_array(out, (8,), "float32") == 9)


def test_a_slow_orchestration_function_does_not_stall_the_loop(
    big_daemon: DaemonProcess,
) -> None:
    with big_daemon.client() as c, big_daemon.client() as other:
        sleeper = c.register("simpler_daemon.examples.remote:sleep_for", "orchestration")
        slow = c.run_orchestration(sleeper, make_args(scalars=[3000]))
        # Runs are admitted in order, but every other call is answered meanwhile.
        buf = other.alloc_buffer((8,), "float32").buffer_id
        assert other.get_info().active_runs == 1
        assert _state(other, slow) not in (
            pb.RUN_STATE_COMPLETED,
            pb.RUN_STATE_FAILED,
            pb.RUN_STATE_CANCELLED,
        ), "another client's calls waited for the orchestration function"
        c.wait(slow, timeout=60)
        other.free_buffer(buf)
