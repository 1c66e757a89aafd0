"""``AsyncClient`` over both transports (gRPC and the local fast path,
client/asyncfast.py): the same answers, errors, deadlines and cancellation; then what
only the fast path's one multiplexed connection has to get right (version 2 frames,
Cancel frames, a lost connection, reconnection, backpressure, fork, a new event loop).

One real daemon for the module (a small message limit, so that buffers travel in
chunks, and two streams per client, so that a leaked stream shows); the frame-level
checks use the stand-in of tests/support/fast_standin.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from simpler_daemon.client import AsyncClient, AsyncFastTransport, sub_task, write_requests
from simpler_daemon.client.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from simpler_daemon.errors import RunCancelled
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol.fastwire import NATIVE_VERSION, Call, Cancel, Hello, Submit, Wait
from simpler_daemon.system.runtimedir import fast_socket_path
from tests.support.daemon_harness import (
    REPO,
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    running_daemon,
    wait_until,
)
from tests.support.fast_standin import FastStandIn

pytestmark = pytest.mark.timeout(120)

TASKS = "tests.support.daemon_tasks"
MAX_MESSAGE = 1 << 20
STREAMS = 2  # limits.max_streams_per_client
CONFIG: dict[str, dict[str, Any]] = {
    "workers": {"num_sub_workers": 2},
    "limits": {"max_message_bytes": MAX_MESSAGE, "max_streams_per_client": STREAMS},
    "callables": {"allowed_modules": ["simpler_daemon.examples", "tests"]},
}

_MODULE_DAEMONS: set[int] = set()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "async-client", CONFIG, _MODULE_DAEMONS)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    yield from module_leak_guard(lambda: set(_MODULE_DAEMONS))


@pytest.fixture(params=["grpc", "fast"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _client(daemon: DaemonProcess, transport: str, **kwargs: Any) -> AsyncClient:
    client = AsyncClient(daemon.socket, timeout=60, transport=transport, **kwargs)
    assert client.transport == transport
    return client


# --------------------------------------------------------------------------- both transports


def test_runs_errors_and_deadlines_are_the_same_on_both_transports(
    daemon: DaemonProcess, transport: str
) -> None:
    async def go() -> None:
        async with _client(daemon, transport) as ac:
            echo = await ac.register(f"{TASKS}:echo")
            sleep = await ac.register(f"{TASKS}:sleep_ms")
            waited = await ac.submit_run([sub_task(echo, scalars=[4])], wait_seconds=30)
            assert waited.status.state == pb.RUN_STATE_COMPLETED
            again = await ac.submit_run([sub_task(echo, scalars=[5])], wait_seconds=30)
            assert again.status.state == pb.RUN_STATE_COMPLETED and again.run_id > waited.run_id
            status = await ac.wait_run(again.run_id, include_results=True)
            assert status.results[0].value["scalars"] == [5]
            # Refusals: the same DaemonError subclass, naming the same field.
            with pytest.raises(NotFound) as missing:
                await ac.submit_run([sub_task("sha256:" + "0" * 64)])
            assert missing.value.field.startswith("tasks[0]")
            with pytest.raises(InvalidArgument) as bad:
                await ac.submit_run([sub_task(echo), pb.Task()])
            assert bad.value.field.startswith("tasks[1]")
            with pytest.raises(NotFound) as unknown:
                await ac.wait_run(1 << 40)
            assert unknown.value.field == "run_id"
            # The daemon checks priority itself (the client refuses it before sending).
            with pytest.raises(InvalidArgument) as priority:
                await ac._call(
                    "SubmitRun", pb.SubmitRunRequest(tasks=[sub_task(echo)], priority=1001)
                )
            assert priority.value.field == "priority"
            # Deadlines: of a unary call, of a stream; a run's own wait is no error.
            slow = await ac.submit([sub_task(sleep, scalars=[30_000])])
            with pytest.raises(DeadlineExceeded):
                await ac._call("WaitRun", pb.WaitRunRequest(run_id=slow.run_id), 0.3)
            assert (await ac.wait_run(slow.run_id, timeout=0.2)).state == pb.RUN_STATE_EXECUTING
            with pytest.raises(DeadlineExceeded):
                async for _ in ac.watch(slow, timeout=0.3):
                    pass
            # Calls still work after all that, and the slow run ends as asked.
            await ac.cancel(slow, terminate=True)
            with pytest.raises(RunCancelled):
                await ac.wait(slow, timeout=30)

    asyncio.run(go())


def test_concurrent_calls_and_cancelled_waits_leave_no_call_behind(
    daemon: DaemonProcess, transport: str
) -> None:
    """Calls run concurrently (on the fast path: on one connection), and a cancelled
    awaiting call is cancelled in the daemon too: a stream's slot comes back, so more
    cancelled watches than ``max_streams_per_client`` never exhaust them."""

    async def go() -> None:
        async with _client(daemon, transport) as ac:
            echo = await ac.register(f"{TASKS}:echo")
            sleep = await ac.register(f"{TASKS}:sleep_ms")
            slow = await ac.submit([sub_task(sleep, scalars=[30_000])])
            conn = ac._fast._conn if ac._fast is not None else None
            calls = [ac.run([sub_task(echo, scalars=[i])], timeout=30) for i in range(20)]
            results = await asyncio.gather(*calls, ac.get_info(), ac.list_buffers())
            assert [r.results[0].value["scalars"] for r in results[:20]] == [[i] for i in range(20)]
            if ac._fast is not None:
                assert ac._fast._conn is conn is not None  # all of them on one connection
            for _ in range(STREAMS + 2):
                watch = ac.watch(slow)
                first = await watch.__anext__()
                assert first.type == pb.RUN_EVENT_TYPE_SNAPSHOT
                pending = asyncio.ensure_future(watch.__anext__())
                await asyncio.sleep(0)
                pending.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pending
                await watch.aclose()
            for _ in range(STREAMS + 2):  # a watch left by break, then by a timeout
                async for _event in ac.watch(slow):
                    break
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(ac.wait_run(slow.run_id, timeout=30), 0.05)
            info = await ac.get_info()
            assert info.pid == daemon.pid
            await ac.cancel(slow, terminate=True)

    asyncio.run(go())


def test_every_waiter_on_one_run_is_answered_when_it_ends(
    daemon: DaemonProcess, transport: str
) -> None:
    """Several WaitRuns (and a future's done callback, which waits too) on one run
    still going: each is answered when it ends. On the fast path the daemon answers
    them from the run's end, one callback each; removing one while they were called
    used to skip the next, whose call then waited for its whole wait time."""

    async def go() -> None:
        async with _client(daemon, transport) as ac:
            sleep = await ac.register(f"{TASKS}:sleep_ms")
            fut = await ac.submit([sub_task(sleep, scalars=[1_000])])
            called = asyncio.Event()
            fut.add_done_callback(lambda _f: called.set())
            # Waits without a wait limit: a skipped one is answered never, and its
            # call's deadline (30 s, the run takes 1 s) fails it with DeadlineExceeded.
            request = pb.WaitRunRequest(run_id=fut.run_id)
            waits = [ac._call("WaitRun", request, 30.0) for _ in range(3)]
            statuses = await asyncio.gather(*waits, fut.status())
            assert [s.state for s in statuses[:3]] == [pb.RUN_STATE_COMPLETED] * 3
            await fut
            await called.wait()  # the callback's own wait was answered too

    asyncio.run(go())


def test_buffers_stream_both_ways_in_chunks_of_the_message_limit(
    daemon: DaemonProcess, transport: str
) -> None:
    data = bytes(range(256)) * (5 * MAX_MESSAGE // 256 + 7)  # five chunks and a bit

    async def go() -> None:
        async with _client(daemon, transport) as ac:
            buf = (await ac.alloc_buffer((len(data),), "uint8")).buffer_id
            try:
                assert await ac.write_buffer(buf, data) == len(data)
                assert await ac.read_buffer(buf) == data
                assert await ac.read_buffer(buf, offset=3, length=10) == data[3:13]
                over = list(write_requests(buf, data[: MAX_MESSAGE + 1], 0, 0, MAX_MESSAGE + 1))
                with pytest.raises(ResourceExhausted):  # one message over the limit
                    await ac._call("WriteBuffer", over)
                assert await ac.read_buffer(buf, length=4) == data[:4]  # still served
            finally:
                await ac.free_buffer(buf)

    asyncio.run(go())


def test_a_session_is_held_until_close_and_opened_again_after(
    daemon: DaemonProcess, transport: str
) -> None:
    async def go() -> None:
        ac = _client(daemon, transport)
        await ac.register(f"{TASKS}:echo")
        assert ac._lease.id
        session = ac._lease.id
        await ac.close()
        if transport == "fast":
            with pytest.raises(Unavailable, match="the client is closed"):
                await ac.get_info()
        async with _client(daemon, transport) as again:
            await again.register(f"{TASKS}:echo")
            assert again._lease.id not in ("", session)

    asyncio.run(go())


def test_the_same_client_serves_one_event_loop_after_another(daemon: DaemonProcess) -> None:
    """``asyncio.run`` twice with one client (a test suite's loop per test): the second
    loop gets a connection of its own, and what the first registered stays registered
    (its session is held on the first connection until close). The fast path only: a
    grpc.aio channel belongs to its first event loop (docs/operations.md)."""
    ac = _client(daemon, "fast")

    async def register() -> str:
        return await ac.register(f"{TASKS}:echo")

    async def run(echo: str) -> Any:
        return (await ac.run([sub_task(echo, scalars=[8])], timeout=30)).results[0].value

    echo = asyncio.run(register())
    assert ac._fast is not None
    first = ac._fast._conn
    assert asyncio.run(run(echo))["scalars"] == [8]
    assert ac._fast._conn is not first and first is not None and first.closed is None
    asyncio.run(ac.close())
    assert first.closed is not None and first.sock.fileno() == -1


# --------------------------------------------------------------------------- the fast path


def _serve(stand_in: FastStandIn, go: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``go()`` on a new event loop, then close ``stand_in`` whatever happened."""
    try:
        asyncio.run(go())
    finally:
        stand_in.close()


def test_a_welcomed_connection_sends_submit_and_wait_frames(tmp_path: Path) -> None:
    # The Welcome comes only after the first call was sent, so that call is a Call
    # whatever the event loop's timing (a prompt Welcome may be read before it or not).
    stand_in = FastStandIn(tmp_path / "d.fast.sock", late_welcome=True)

    async def go() -> None:
        transport = AsyncFastTransport(stand_in.path, "me")
        try:
            first = await transport.unary("WaitRun", pb.WaitRunRequest(run_id=5), 10.0)
            assert first.run_id == 0  # sent as a Call: the Welcome was not there yet
            assert transport._conn is not None and transport._conn.version == NATIVE_VERSION
            second = await transport.unary("WaitRun", pb.WaitRunRequest(run_id=5), 10.0)
            assert second.run_id == 5  # a Wait frame
            submit = pb.SubmitRunRequest(tasks=[sub_task("sha256:" + "a" * 64)], wait_seconds=2.0)
            await transport.unary("SubmitRun", submit, 10.0)
            await transport.unary("GetInfo", pb.GetInfoRequest(), 10.0)
        finally:
            await transport.close()

    try:
        asyncio.run(go())
        kinds = stand_in.kinds()
        assert kinds == [Hello, Call, Wait, Submit, Call]
        hello, submit = stand_in.frames[0], stand_in.frames[3]
        assert hello.upto == NATIVE_VERSION and hello.label == "me"
        assert submit.wait_seconds == 2.0 and submit.timeout == 10.0
    finally:
        stand_in.close()


def test_a_welcome_read_before_the_first_call_makes_it_a_wait_frame(tmp_path: Path) -> None:
    stand_in = FastStandIn(tmp_path / "d.fast.sock")

    async def go() -> None:
        transport = AsyncFastTransport(stand_in.path, "me")
        try:
            conn = await transport._connection()
            for _ in range(2000):  # 10 s at most, for the prompt Welcome to be read
                if conn.version >= NATIVE_VERSION:
                    break
                await asyncio.sleep(0.005)
            else:
                pytest.fail("the daemon's Welcome was never read")
            first = await transport.unary("WaitRun", pb.WaitRunRequest(run_id=5), 10.0)
            assert first.run_id == 5  # a Wait frame
        finally:
            await transport.close()

    try:
        asyncio.run(go())
        assert stand_in.kinds() == [Hello, Wait]
    finally:
        stand_in.close()


def test_a_daemon_that_does_not_welcome_gets_calls_only(tmp_path: Path) -> None:
    stand_in = FastStandIn(tmp_path / "d.fast.sock", welcome=False)

    async def go() -> None:
        transport = AsyncFastTransport(stand_in.path, "me")
        try:
            for _ in range(2):
                status = await transport.unary("WaitRun", pb.WaitRunRequest(run_id=5), 10.0)
                assert status.run_id == 0
        finally:
            await transport.close()

    try:
        asyncio.run(go())
        assert stand_in.kinds() == [Hello, Call, Call]
    finally:
        stand_in.close()


def test_cancelled_and_timed_out_calls_send_cancel_frames(tmp_path: Path) -> None:
    stand_in = FastStandIn(tmp_path / "d.fast.sock", hold=("WaitRun", "GetInfo"))

    async def go() -> None:
        transport = AsyncFastTransport(stand_in.path, "me")
        try:
            with pytest.raises(DeadlineExceeded):
                await transport.unary("GetInfo", pb.GetInfoRequest(), 0.2)
            task = asyncio.ensure_future(
                transport.unary("WaitRun", pb.WaitRunRequest(run_id=7), None)
            )
            await asyncio.sleep(0)
            wait_until(lambda: len(stand_in.frames) >= 3, 10, "the WaitRun never arrived")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert transport._conn is not None
            assert not transport._conn.replies  # nothing left waiting
            await transport.unary("ListBuffers", pb.ListBuffersRequest(), 10.0)
        finally:
            await transport.close()

    try:
        asyncio.run(go())
        frames = stand_in.frames
        cancels = [f.id for f in frames if type(f) is Cancel]
        held = [f.id for f in frames if type(f) in (Call, Wait) and f.id in cancels]
        assert len(cancels) == 2 and sorted(held) == sorted(cancels)
    finally:
        stand_in.close()


def test_a_lost_connection_fails_the_calls_in_flight_and_the_next_call_reconnects(
    tmp_path: Path,
) -> None:
    stand_in = FastStandIn(tmp_path / "d.fast.sock", hold=("GetInfo",))

    async def go() -> None:
        transport = AsyncFastTransport(stand_in.path, "me")
        try:
            calls = [
                asyncio.ensure_future(transport.unary("GetInfo", pb.GetInfoRequest(), 30.0))
                for _ in range(3)
            ]
            watch = transport.stream("WatchRun", pb.WatchRunRequest(run_id=1), 30.0)
            watching = asyncio.ensure_future(watch.__anext__())
            await asyncio.sleep(0.05)
            wait_until(lambda: len(stand_in.frames) >= 5, 10, "the calls never arrived")
            stand_in.drop()
            for call in calls:
                with pytest.raises(Unavailable, match="closed the connection"):
                    await call
            with pytest.raises((Unavailable, StopAsyncIteration)):
                await watching  # its End raced with the close, or it failed
            await watch.aclose()
            assert stand_in.connections == 1
            await transport.unary("ListBuffers", pb.ListBuffersRequest(), 10.0)
            assert stand_in.connections == 2
        finally:
            await transport.close()

    _serve(stand_in, go)


def test_closing_fails_the_calls_in_flight(tmp_path: Path) -> None:
    stand_in = FastStandIn(tmp_path / "d.fast.sock", hold=("GetInfo",))

    async def go() -> None:
        transport = AsyncFastTransport(stand_in.path, "me")
        call = asyncio.ensure_future(transport.unary("GetInfo", pb.GetInfoRequest(), 30.0))
        await asyncio.sleep(0.05)
        await transport.close()
        with pytest.raises(Unavailable, match="the client is closed"):
            await call
        with pytest.raises(Unavailable, match="the client is closed"):
            await transport.unary("ListBuffers", pb.ListBuffersRequest(), 10.0)

    _serve(stand_in, go)


def test_a_stream_faster_than_its_reader_pauses_the_connections_reading(tmp_path: Path) -> None:
    from simpler_daemon.client.asyncfast import _READ_HIGH

    size, count = 1 << 20, 3 * (_READ_HIGH >> 20)  # three times the high mark
    stand_in = FastStandIn(tmp_path / "d.fast.sock", items=count, item_bytes=size)

    async def go() -> None:
        transport = AsyncFastTransport(stand_in.path, "me")
        try:
            watch = transport.stream("ReadBuffer", pb.ReadBufferRequest(buffer_id=1), 60.0)
            first = await watch.__anext__()
            assert len(first.data) == size
            conn = transport._conn
            assert conn is not None
            for _ in range(2000):  # the loop runs until reading pauses
                if not conn._reading:
                    break
                await asyncio.sleep(0.005)
            assert not conn._reading
            # The stand-in is held back: it cannot have sent everything.
            assert stand_in.items_sent < count
            got = 1 + sum([len(chunk.data) == size async for chunk in watch])
            assert got == count and conn._reading and conn._buffered == 0
        finally:
            await transport.close()

    _serve(stand_in, go)


def test_an_upload_to_a_daemon_that_stopped_reading_waits_for_room(tmp_path: Path) -> None:
    """The chunks are not all buffered in the client: the call waits for room in the
    socket's write buffer, and its deadline still ends it."""
    stand_in = FastStandIn(tmp_path / "d.fast.sock", read=False)
    chunk = 1 << 20
    sent: list[int] = []

    def chunks() -> Iterator[pb.WriteBufferRequest]:
        for _ in range(64):  # 64 MiB, far more than the socket's buffers hold
            sent.append(chunk)
            yield pb.WriteBufferRequest(data=b"\x02" * chunk)

    async def go() -> None:
        transport = AsyncFastTransport(stand_in.path, "me")
        try:
            with pytest.raises(DeadlineExceeded):
                await transport.unary("WriteBuffer", chunks(), 2.0)
            conn = transport._conn
            assert conn is not None
            high = conn.transport.get_write_buffer_limits()[1]
            assert len(sent) < 64
            assert conn.transport.get_write_buffer_size() <= high + 2 * chunk
        finally:
            await transport.close()

    _serve(stand_in, go)


def test_a_client_after_close_or_without_a_daemon_is_unavailable(tmp_path: Path) -> None:
    async def go() -> None:
        transport = AsyncFastTransport(str(tmp_path / "nobody.fast.sock"), "me")
        with pytest.raises(Unavailable, match="cannot connect to the daemon's fast socket"):
            await transport.unary("GetInfo", pb.GetInfoRequest(), 10.0)
        await transport.close()

    asyncio.run(go())


def test_a_restarted_daemon_is_reached_by_the_next_call(tmp_path: Path) -> None:
    config = {"callables": {"allowed_modules": ["tests"]}}

    async def call(ac: AsyncClient) -> int:
        return int((await ac.get_info()).pid)

    ac: AsyncClient | None = None
    loop = asyncio.new_event_loop()
    try:
        with running_daemon(tmp_path / "d", config) as first:
            ac = AsyncClient(first.socket, timeout=30, transport="fast", retry=None)
            assert loop.run_until_complete(call(ac)) == first.pid
        with pytest.raises(Unavailable):
            loop.run_until_complete(call(ac))
        with running_daemon(tmp_path / "d", config) as second:
            assert loop.run_until_complete(call(ac)) == second.pid
            loop.run_until_complete(ac.close())
    finally:
        loop.close()


_FORK_SCRIPT = """
import asyncio, os, sys
from simpler_daemon.client import AsyncClient, sub_task

async def use(ac):
    echo = await ac.register("tests.support.daemon_tasks:echo")
    runs = [await ac.run([sub_task(echo, scalars=[i])], timeout=30) for i in range(20)]
    return sum(1 for i, r in enumerate(runs) if r.results[0].value["scalars"] == [i])

ac = AsyncClient(sys.argv[1], transport="fast", timeout=30)
loop = asyncio.new_event_loop()
print("before", loop.run_until_complete(use(ac)), flush=True)
inherited = ac._fast._conn
session = ac._lease.id
pid = os.fork()
if pid == 0:
    ok = asyncio.run(use(ac))
    fresh = ac._fast._conn is not inherited and ac._lease.id != session
    asyncio.run(ac.close())
    print("child", fresh, ok, flush=True)
    os._exit(0)
ok = loop.run_until_complete(use(ac))
_, status = os.waitpid(pid, 0)
ok += loop.run_until_complete(use(ac))
print("parent", ok, status, ac._fast._conn is inherited, ac._lease.id == session, flush=True)
loop.run_until_complete(ac.close())
loop.close()
"""


def test_a_forked_child_gets_its_own_connection_and_session(daemon: DaemonProcess) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, daemon.socket],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=str(REPO),
    )
    assert out.returncode == 0, out.stderr
    assert "before 20" in out.stdout, out.stdout
    assert "child True 20" in out.stdout and "parent 40 0 True True" in out.stdout, out.stdout


def test_fast_means_the_fast_socket_must_exist(tmp_path: Path) -> None:
    with pytest.raises(Unavailable, match=str(fast_socket_path(str(tmp_path / "x.sock")))):
        AsyncClient(str(tmp_path / "x.sock"), transport="fast")
    with pytest.raises(ValueError, match="cannot use transport 'udp'"):
        AsyncClient(str(tmp_path / "x.sock"), transport="udp")


def test_a_session_refusal_names_its_field(daemon: DaemonProcess, transport: str) -> None:
    async def go() -> None:
        async with _client(daemon, transport) as ac:
            request = pb.RegisterCallableRequest(import_path=f"{TASKS}:echo", session="f" * 32)
            with pytest.raises(FailedPrecondition) as ended:
                await ac._call("RegisterCallable", request)
            assert ended.value.field == "session"

    asyncio.run(go())
