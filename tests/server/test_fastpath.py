"""The daemon's local fast path (protocol/fastwire.py, server/fastpath.py,
client/fastpath.py: framed requests over a Unix socket beside gRPC) and the client's
transport selection.

Codec units first (no daemon); then one real daemon for the module, reached over its
fast socket both with raw frames (what a misbehaving client sends) and with the
Python clients. The client API suite itself runs over both transports in
tests/client/test_client_api.py, the AsyncClient's in tests/client/test_async_client.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import msgspec
import numpy as np
import pytest

from simpler_daemon.client import AsyncClient, Client, sub_task
from simpler_daemon.client.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from simpler_daemon.client.fastpath import DEFAULT_SPIN_US, MAX_SPIN_US
from simpler_daemon.errors import ProtocolError, RunCancelled
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol.fastwire import (
    CLIENT_FRAMES,
    LENGTH,
    SERVER_FRAMES,
    Call,
    Cancel,
    End,
    FrameDecoder,
    Hello,
    Item,
    Reply,
    encode,
    frame_limit,
)
from simpler_daemon.system.runtimedir import fast_socket_path
from tests.support.daemon_harness import (
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    running_daemon,
    wait_until,
)
from tests.support.fast_raw import RawFast

TASKS = "tests.support.daemon_tasks"
MAX_MESSAGE = 1 << 20
STREAMS = 2  # limits.max_streams_per_client: quota sharing shows with few streams
CONFIG: dict[str, dict[str, Any]] = {
    "limits": {"max_message_bytes": MAX_MESSAGE, "max_streams_per_client": STREAMS},
    "callables": {"allowed_modules": ["simpler_daemon.examples", "tests"]},
    # Few connections and a short frame timeout, so their tests need no second daemon.
    "fast": {"max_connections": 32, "frame_timeout": 3.0},
}
MAX_CONNECTIONS = 32

# --------------------------------------------------------------------------- codec


def _frames() -> list[Any]:
    return [
        Hello(1, "label"),
        Call(1, "GetInfo", b"", None),
        Call(2, "WriteBuffer", b"", 2.5, True),
        Item(2, b"\x00" * 300),
        End(2),
        Cancel(1),
    ]


@pytest.mark.timeout(30)
def test_codec_reassembles_frames_split_anywhere_and_several_per_read() -> None:
    frames = _frames()
    stream = b"".join(encode(f) for f in frames)
    one_by_one = FrameDecoder(SERVER_FRAMES, 1 << 16)
    got: list[Any] = []
    for i in range(len(stream)):
        got += one_by_one.feed(stream[i : i + 1])
    assert got == frames and one_by_one.buffered == 0
    together = FrameDecoder(SERVER_FRAMES, 1 << 16)
    assert together.feed(stream) == frames
    split = FrameDecoder(SERVER_FRAMES, 1 << 16)
    cut = len(stream) // 2 + 3
    assert split.feed(stream[:cut]) + split.feed(memoryview(stream)[cut:]) == frames
    split.eof()
    replies = [Reply(7, 0, "", "", b"abc"), Item(8, b"x"), End(8, 5, "gone", "run_id")]
    assert FrameDecoder(CLIENT_FRAMES, 1 << 16).feed(b"".join(map(encode, replies))) == replies


@pytest.mark.timeout(30)
def test_codec_refuses_an_oversize_length_before_buffering_it() -> None:
    dec = FrameDecoder(SERVER_FRAMES, frame_limit(1024))
    with pytest.raises(ProtocolError, match="exceed the limit"):
        # no call id in its first bytes: nothing to answer, the head is enough
        dec.feed(LENGTH.pack(frame_limit(1024) + 1) + b"\xc1" * 96)
    assert dec.buffered == 0
    with pytest.raises(ProtocolError):  # failed for good: never resynchronised
        dec.feed(encode(Hello(1)))


@pytest.mark.timeout(30)
def test_codec_refuses_garbage_wrong_side_frames_and_a_truncated_end() -> None:
    for junk in (b"\xc1\xc1\xc1", b"\x93\x01\x02", encode(Reply(1, 0))[4:]):
        dec = FrameDecoder(SERVER_FRAMES, 1 << 16)
        with pytest.raises(ProtocolError, match="cannot decode frame 0"):
            dec.feed(LENGTH.pack(len(junk)) + junk)
        assert dec.failed is not None
    dec = FrameDecoder(CLIENT_FRAMES, 1 << 16)
    with pytest.raises(ProtocolError):  # a Call is not something a client accepts
        dec.feed(encode(Call(1, "GetInfo")))
    dec = FrameDecoder(SERVER_FRAMES, 1 << 16)
    assert dec.feed(encode(Hello(1))[:-1]) == []
    with pytest.raises(ProtocolError, match="truncated"):
        dec.eof()


# --------------------------------------------------------------------------- daemon

_MODULE_DAEMONS: set[int] = set()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "fastpath", CONFIG, _MODULE_DAEMONS)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    yield from module_leak_guard(lambda: set(_MODULE_DAEMONS))


@pytest.fixture
def c(daemon: DaemonProcess) -> Iterator[Client]:
    with daemon.client(timeout=60, transport="fast") as client:
        assert client.transport == "fast"
        yield client


class Raw(RawFast):
    """One fast-path connection speaking frames by hand (no Hello sent)."""


@pytest.mark.timeout(60)
def test_the_fast_socket_has_the_grpc_sockets_mode_and_owner(daemon: DaemonProcess) -> None:
    fast = os.stat(fast_socket_path(daemon.socket))
    public = os.stat(daemon.socket)
    assert stat.S_ISSOCK(fast.st_mode)
    assert stat.S_IMODE(fast.st_mode) == stat.S_IMODE(public.st_mode) == 0o660
    assert (fast.st_uid, fast.st_gid) == (public.st_uid, public.st_gid)
    assert "fast path on " + fast_socket_path(daemon.socket) in daemon.stdout()


@pytest.mark.timeout(60)
def test_garbage_and_oversize_frames_close_only_that_connection(
    daemon: DaemonProcess, c: Client
) -> None:
    garbage = Raw(daemon)
    garbage.sock.sendall(LENGTH.pack(3) + b"\xc1\xc1\xc1")
    assert garbage.closed_by_daemon()
    garbage.close()
    big = Raw(daemon)
    big.sock.sendall(LENGTH.pack(frame_limit(MAX_MESSAGE) + 1) + b"\xc1" * 96)  # no call id
    assert big.closed_by_daemon()
    big.close()
    assert c.get_info().limits.max_message_bytes == MAX_MESSAGE  # still serving
    wait_until(
        lambda: daemon.stderr().count("closed a fast-path connection") >= 2,
        10,
        "no log line names the protocol violations",
    )
    assert "exceed the limit" in daemon.stderr()


@pytest.mark.timeout(60)
def test_unknown_method_is_unimplemented_naming_it_and_bad_bytes_invalid(
    daemon: DaemonProcess,
) -> None:
    raw = Raw(daemon)
    try:
        raw.send(Hello(1, "raw"), Call(1, "NoSuchRpc", b""), Call(2, "WaitRun", b"\xff\xff"))
        got: dict[int, Any] = {}  # replies arrive in completion order: collect by id
        while len(got) < 2:
            frame = raw.frame()
            got[frame.id] = frame
        assert got[1].code == grpc.StatusCode.UNIMPLEMENTED.value[0]
        assert "NoSuchRpc" in got[1].details
        assert got[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "WaitRunRequest" in got[2].details
    finally:
        raw.close()


@pytest.mark.timeout(90)
def test_identity_is_the_peer_uid_and_stream_quotas_are_shared_with_grpc(
    daemon: DaemonProcess, c: Client
) -> None:
    sleep = c.register(f"{TASKS}:sleep_ms")
    run = c.submit([sub_task(sleep, scalars=[30_000])], label="held")
    with daemon.client(timeout=60, transport="grpc") as g:
        assert g.transport == "grpc"
        assert g.wait_run(run, 0).client == f"uid:{os.geteuid()}"  # one owner, both ways
        raw = Raw(daemon)
        try:
            # One stream over each transport fills the quota of this uid (STREAMS = 2).
            raw.send(Call(1, "WatchRun", pb.WatchRunRequest(run_id=run).SerializeToString()))
            assert type(raw.frame()) is Item  # the SNAPSHOT: the stream holds its slot
            watch = g.watch(run)
            next(watch)
            with pytest.raises(ResourceExhausted, match="max_streams_per_client"):
                next(c.watch(run))
            # A client that goes away mid-call has its handler cancelled: the slot frees.
            raw.close()
            wait_until(lambda: _can_watch(c, run), 30, "the closed stream kept its slot")
            watch.close()
        finally:
            raw.close()
            c.cancel(run, terminate=True)
    with pytest.raises(RunCancelled):
        c.wait(run, timeout=30)


def _can_watch(c: Client, run: int) -> bool:
    try:
        events = c.watch(run)
        next(events)
        events.close()
        return True
    except ResourceExhausted:
        return False


@pytest.mark.timeout(60)
def test_watch_streams_to_the_terminal_event_and_deadlines_match_grpc(c: Client) -> None:
    nothing = c.register(f"{TASKS}:nothing")
    run = c.submit([sub_task(nothing)])
    run.result(timeout=30)
    events = list(c.watch(run, timeout=30))
    assert (
        events[0].type == pb.RUN_EVENT_TYPE_SNAPSHOT and events[-1].state == pb.RUN_STATE_COMPLETED
    )
    sleep = c.register(f"{TASKS}:sleep_ms")
    slow = c.submit([sub_task(sleep, scalars=[30_000])])
    try:
        with pytest.raises(DeadlineExceeded):
            list(c.watch(slow, timeout=0.3))
        with pytest.raises(NotFound) as missing:
            c.wait(10**9, timeout=0)
        assert missing.value.field == "run_id"
    finally:
        c.cancel(slow, terminate=True)


@pytest.mark.timeout(90)
def test_kernel_timeouts_kept_between_calls_neither_cut_nor_stretch_a_call(c: Client) -> None:
    """The blocking transport keeps SO_RCVTIMEO armed from call to call (client/fastpath.py,
    ``_Conn.arm``): a call without a deadline outlives the timeout a short call left,
    and a shorter deadline than the one held still fires. A WaitRun on a finished run
    answers the terminal state, also when the terminal event is built late."""
    sleep = c.register(f"{TASKS}:sleep_ms")
    second = c.submit([sub_task(sleep, scalars=[1_000])])
    assert c._call("GetInfo", pb.GetInfoRequest(), 0.3).caller  # leaves ~0.27 s armed
    status = c._call("WaitRun", pb.WaitRunRequest(run_id=second.run_id), None)
    assert status.state == pb.RUN_STATE_COMPLETED
    events = list(c.watch(second, timeout=30))
    assert events[-1].type == pb.RUN_EVENT_TYPE_RUN_STATE
    assert events[-1].state == pb.RUN_STATE_COMPLETED
    assert events[-1].counts.done == 1 and events[-1].sequence == events[0].sequence
    slow = c.submit([sub_task(sleep, scalars=[30_000])])
    try:
        assert c._call("GetInfo", pb.GetInfoRequest(), 20.0).caller  # ~18 s armed
        with pytest.raises(DeadlineExceeded):
            c._call("WaitRun", pb.WaitRunRequest(run_id=slow.run_id), 0.5)
        waited = c.submit_run([sub_task(sleep, scalars=[30_000])], wait_seconds=0.2).status
        assert waited.state in (pb.RUN_STATE_EXECUTING, pb.RUN_STATE_QUEUED)
        c.cancel(waited.run_id, terminate=True)
    finally:
        c.cancel(slow, terminate=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [-1, MAX_SPIN_US + 1, 1.5, "250", True])
def test_spin_us_out_of_range_is_refused_naming_it(daemon: DaemonProcess, bad: Any) -> None:
    with pytest.raises(ValueError, match="spin_us"):
        daemon.client(transport="fast", spin_us=bad)
    with pytest.raises(ValueError, match="AsyncClient with spin_us"):
        AsyncClient(daemon.socket, spin_us=100)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spin_us", [0, DEFAULT_SPIN_US, MAX_SPIN_US])
def test_a_call_spinning_for_its_reply_keeps_its_deadline(
    daemon: DaemonProcess, spin_us: int
) -> None:
    """A blocking call looks for its reply without sleeping for up to ``spin_us``, never
    past its deadline: a 2 ms deadline under a 10 ms spin still fails DEADLINE_EXCEEDED,
    and the connection serves the next call (a late reply of the expired call is
    skipped)."""
    with daemon.client(timeout=30, transport="fast", spin_us=spin_us) as c:
        assert c.spin_us == spin_us
        assert c.get_info().caller
        sleep = c.register(f"{TASKS}:sleep_ms")
        slow = c.submit([sub_task(sleep, scalars=[30_000])])
        try:
            with pytest.raises(DeadlineExceeded):
                c._call("WaitRun", pb.WaitRunRequest(run_id=slow.run_id), 0.002)
            for _ in range(20):
                assert c.get_info().caller
        finally:
            c.cancel(slow, terminate=True)


@pytest.mark.timeout(90)
def test_threads_share_one_sync_client_without_sharing_a_connection(c: Client) -> None:
    echo = c.register(f"{TASKS}:echo")
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(10):
                result = c.run([sub_task(echo, scalars=[n, i])], timeout=30)
                assert result.results[0].value["scalars"] == [n, i]
                assert c.get_info().pid > 0
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    futures = [c.submit([sub_task(echo, scalars=[k])]) for k in range(8)]
    done = threading.Event()
    seen: list[int] = []

    def called(f: Any) -> None:  # on the DoneWatcher thread, beside our own calls
        seen.append(int(f))
        if len(seen) == len(futures):
            done.set()

    for fut in futures:
        fut.add_done_callback(called)
    values = [f.result(timeout=30).results[0].value for f in futures]
    assert [v["scalars"] for v in values] == [[k] for k in range(8)]
    assert done.wait(30)


@pytest.mark.timeout(60)
def test_transport_selection(
    daemon: DaemonProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Client(daemon.socket, client_id="label" * 100) as auto:  # any label, as gRPC
        assert auto.transport == "fast" and auto.get_info().pid > 0  # the fast socket exists
    monkeypatch.setenv("SIMPLER_DAEMON_TRANSPORT", "grpc")
    with Client(daemon.socket) as forced:
        assert forced.transport == "grpc" and forced.get_info().pid > 0
    with Client(daemon.socket, transport="fast") as explicit:  # explicit beats the env
        assert explicit.transport == "fast"
    monkeypatch.delenv("SIMPLER_DAEMON_TRANSPORT")
    with pytest.raises(ValueError, match="transport"):
        Client(daemon.socket, transport="carrier-pigeon")
    lone = tmp_path / "daemon.sock"  # no daemon, no fast socket beside it
    with Client(str(lone)) as fallback:
        assert fallback.transport == "grpc"
    with pytest.raises(Unavailable, match=str(tmp_path / "daemon.fast.sock")):
        Client(str(lone), transport="fast")


@pytest.mark.timeout(120)
def test_fast_socket_follows_the_socket_mode_and_is_removed_at_stop(tmp_path: Path) -> None:
    with running_daemon(tmp_path / "d", {"grpc": {"socket_mode": 0o600}}) as d:
        path = fast_socket_path(d.socket)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with d.client(transport="fast") as client:
            assert client.get_info().pid == d.pid
    assert not os.path.exists(path) and not os.path.exists(d.socket)
    with running_daemon(tmp_path / "off", {"fast": {"enabled": False}}) as off:
        assert not os.path.exists(fast_socket_path(off.socket))
        with off.client() as client:
            assert client.transport == "grpc"


@pytest.mark.timeout(30)
def test_the_daemon_refuses_a_live_fast_socket_and_removes_a_stale_one(tmp_path: Path) -> None:
    from simpler_daemon.errors import StartupError
    from simpler_daemon.server.config import DaemonConfig, resolve
    from simpler_daemon.server.daemon import Daemon

    run = tmp_path / "run"
    config = resolve(
        DaemonConfig(daemon=msgspec.structs.replace(DaemonConfig().daemon, runtime_dir=str(run)))
    )
    fast = config.fast.unix_socket
    assert fast == str(run / "daemon.fast.sock")
    run.mkdir(mode=0o750)
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        live.bind(fast)
        live.listen(1)
        with pytest.raises(StartupError, match="another process is serving on it"):
            Daemon(config)._prepare_paths()
    finally:
        live.close()
    assert os.path.exists(fast)  # closed, not removed: a stale socket now
    Daemon(config)._prepare_paths()
    assert not os.path.exists(fast)
    Path(fast).write_text("not a socket")
    with pytest.raises(StartupError, match="is not a socket"):
        Daemon(config)._prepare_paths()


@pytest.mark.timeout(60)
def test_buffers_stream_both_ways_in_chunks_of_the_message_limit(c: Client) -> None:
    data = np.random.default_rng(14).integers(0, 255, 6 << 20, dtype=np.uint8)
    buf = c.alloc_array(data)  # WriteBuffer: a client stream of ~1 MiB chunks
    try:
        assert np.array_equal(c.read_array(buf, data.shape, data.dtype), data)
        with pytest.raises(InvalidArgument) as bad:
            c.write_buffer(buf, b"x" * 16, offset=(6 << 20) - 8)
        assert bad.value.field == "target.total_bytes"
    finally:
        c.free_buffer(buf)


@pytest.mark.timeout(30)
def test_a_pooled_connection_the_daemon_closed_is_replaced(tmp_path: Path) -> None:
    from simpler_daemon.client.fastpath import FastTransport

    path = str(tmp_path / "d.fast.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    transport = FastTransport(path, "test")
    try:
        first = transport._take()
        transport._give(first)
        accepted, _ = listener.accept()
        accepted.close()  # the daemon went away (restarted) while the connection idled
        wait_until(first.stale, 10, "a closed connection does not read as stale")
        first.idle_since -= 1.0  # idle long enough to be checked (back-to-back calls are not)
        second = transport._take()
        assert second is not first and not second.stale()
        transport._give(second)
        assert transport._take() is second  # an alive idle connection is reused
    finally:
        transport.close()
        listener.close()


def _stale_socket(path: Path) -> None:
    """A socket file nobody listens on (what a SIGKILLed daemon leaves)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()


@pytest.mark.timeout(30)
def test_auto_falls_back_to_grpc_past_a_stale_fast_socket_and_fast_names_it(
    tmp_path: Path,
) -> None:
    lone = tmp_path / "daemon.sock"
    _stale_socket(tmp_path / "daemon.fast.sock")
    with Client(str(lone)) as auto:
        assert auto.transport == "grpc"
    fast = Client(str(lone), transport="fast", timeout=5, retry=None)  # no retry: at once
    try:
        with pytest.raises(Unavailable, match=str(tmp_path / "daemon.fast.sock")):
            fast.get_info()
    finally:
        fast.close()


@pytest.mark.timeout(30)
def test_a_daemon_without_the_fast_path_removes_only_a_stale_fast_socket(
    tmp_path: Path,
) -> None:
    from simpler_daemon.server.config import DaemonConfig, resolve
    from simpler_daemon.server.daemon import Daemon

    run = tmp_path / "run"
    config = resolve(
        DaemonConfig(daemon=msgspec.structs.replace(DaemonConfig().daemon, runtime_dir=str(run)))
    )
    config = msgspec.structs.replace(
        config, fast=msgspec.structs.replace(config.fast, enabled=False)
    )
    fast = config.fast.unix_socket
    run.mkdir(mode=0o750)
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        live.bind(fast)
        live.listen(1)
        Daemon(config)._prepare_paths()
        assert os.path.exists(fast)  # live: never touched
    finally:
        live.close()
    Daemon(config)._prepare_paths()
    assert not os.path.exists(fast)


@pytest.mark.timeout(30)
def test_codec_skips_an_oversize_frame_after_reading_its_call_id() -> None:
    from simpler_daemon.protocol.fastwire import Oversize

    limit = frame_limit(1024)
    big = Call(9, "SubmitRun", b"z" * (limit + 100))
    stream = encode(big) + encode(Cancel(3))
    dec = FrameDecoder(SERVER_FRAMES, limit)
    got: list[Any] = []
    for i in range(0, len(stream), 7):  # never buffers the body, whatever the split
        got += dec.feed(stream[i : i + 7])
        assert dec.buffered <= 256
    assert got == [Oversize(1, 9, limit + 100), Cancel(3)]
    assert FrameDecoder(SERVER_FRAMES, limit).feed(stream) == got
    item = encode(Item(4, b"q" * (limit + 1)))
    assert FrameDecoder(SERVER_FRAMES, limit).feed(item) == [Oversize(3, 4, limit + 1)]
    hello = encode(Hello(1, "x" * 200))  # no call id to answer: still a protocol error
    with pytest.raises(ProtocolError, match="exceed the limit"):
        FrameDecoder(SERVER_FRAMES, 64).feed(hello)


@pytest.mark.timeout(60)
def test_an_oversize_request_is_resource_exhausted_as_over_grpc_and_keeps_the_connection(
    daemon: DaemonProcess, c: Client
) -> None:
    request = pb.GetInfoRequest()
    too_big = b"\x00" * (MAX_MESSAGE + 1)
    details = {}
    for transport in ("fast", "grpc"):
        with daemon.client(timeout=30, transport=transport) as client:
            e = client.register(f"{TASKS}:nothing")
            with pytest.raises(ResourceExhausted) as exc:
                client.submit([sub_task(e, scalars=list(range(8))) for _ in range(20000)])
            details[transport] = exc.value.details()
    assert details["fast"] == details["grpc"]
    assert "Received message larger than max (" in details["fast"]
    raw = Raw(daemon)
    try:
        code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        raw.send(Hello(1, "raw"), Call(1, "GetInfo", too_big))  # under the frame cap
        first = raw.frame()
        assert (first.id, first.code) == (1, code)
        assert first.details.endswith(f"({MAX_MESSAGE + 1} vs. {MAX_MESSAGE})")
        raw.send(Call(2, "GetInfo", b"\x00" * (frame_limit(MAX_MESSAGE) + 10)))  # over it
        second = raw.frame()
        assert (second.id, second.code) == (2, code)
        raw.send(Call(3, "WriteBuffer", b"", None, True), Item(3, too_big), End(3))
        third = raw.frame()
        assert (third.id, third.code) == (3, code)
        raw.send(Call(4, "GetInfo", request.SerializeToString()))
        fourth = raw.frame()
        assert (fourth.id, fourth.code) == (4, 0)  # the same connection still serves
    finally:
        raw.close()


_FORK_SCRIPT = """
import os, sys
from simpler_daemon.client import Client
from simpler_daemon.client.errors import Unavailable
c = Client(sys.argv[1], transport="fast", timeout=30)
c.get_info()
inherited = list(c._fast._idle)
pid = os.fork()
if pid == 0:
    conn = c._fast._take()
    fresh = conn not in inherited
    c._fast._give(conn)
    ok = sum(1 for _ in range(100) if c.list_buffers() is not None)
    print("child", fresh, ok, flush=True)
    os._exit(0)
ok = sum(1 for _ in range(100) if c.get_info().pid > 0)
_, status = os.waitpid(pid, 0)
print("parent", ok, status, flush=True)
"""


@pytest.mark.timeout(90)
def test_a_forked_child_gets_its_own_fast_connections(daemon: DaemonProcess) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, daemon.socket],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    assert out.returncode == 0, out.stderr
    assert "child True 100" in out.stdout and "parent 100 0" in out.stdout, out.stdout


@pytest.mark.timeout(60)
def test_connections_past_max_connections_are_closed_with_one_warning(
    daemon: DaemonProcess,
) -> None:
    raws: list[Raw] = []
    try:
        for _ in range(MAX_CONNECTIONS + 16):
            raws.append(Raw(daemon))
        served = refused = 0
        for raw in raws:
            try:
                raw.send(Hello(1, "many"), Call(1, "GetInfo", b""))
                raw.frame()
            except (AssertionError, OSError):
                refused += 1
            else:
                served += 1
        assert served <= MAX_CONNECTIONS and refused >= 16
    finally:
        for raw in raws:
            raw.close()
    wait_until(lambda: "max_connections" in daemon.stderr(), 10, "no warning")
    assert daemon.stderr().count("fast.max_connections") == 1
    with daemon.client(timeout=30, transport="fast") as client:
        wait_until(lambda: client.get_info().pid > 0, 10, "the daemon stopped serving")


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_frame_left_incomplete_past_frame_timeout_drops_its_connection(
    daemon: DaemonProcess,
) -> None:
    idle, stuck = Raw(daemon), Raw(daemon)
    try:
        idle.send(Hello(1, "idle"))
        stuck.sock.sendall(encode(Hello(1, "stuck")) + LENGTH.pack(100) + b"x")
        assert stuck.closed_by_daemon()  # after frame_timeout (3 s), not the 30 s recv
        wait_until(lambda: "incomplete frame" in daemon.stderr(), 10, "no warning")
        idle.send(Call(1, "GetInfo", b""))  # an idle connection holds no frame: kept
        assert idle.frame().code == 0
    finally:
        idle.close()
        stuck.close()


@pytest.mark.timeout(30)
def test_fast_limits_are_validated() -> None:
    from simpler_daemon.errors import ConfigError
    from simpler_daemon.server.config import load

    for key, value in (
        ("max_connections", 0),
        ("max_connections", 65537),
        ("frame_timeout", 0.0),
        ("frame_timeout", float("inf")),
    ):
        with pytest.raises(ConfigError, match=f"fast.{key}"):
            load(None, env={}, overrides={f"fast.{key}": value})


class _Service:
    """A real FastServer's handlers for the backpressure tests: GetInfo answers 32 KiB,
    WaitRun waits until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return pb.GetInfoResponse(version="v" * (32 << 10))

    async def WaitRun(self, request: Any, context: Any) -> Any:
        await self.release.wait()
        return pb.WaitRunResponse()


async def _poll(predicate: Any, what: str, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.005)


def _in_process_server(tmp_path: Path, test: Any) -> None:
    from simpler_daemon.server.fastpath import FastServer

    async def go() -> None:
        server = FastServer(_Service(), str(tmp_path / "f.sock"), MAX_MESSAGE)
        await server.start()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(tmp_path / "f.sock"))
            sock.setblocking(False)
            await _poll(lambda: len(server.connections) == 1, "no connection")
            await test(server, next(iter(server.connections)), sock)
        finally:
            sock.close()
            await server.close(0)

    asyncio.run(go())


@pytest.mark.timeout(60)
def test_a_client_that_never_reads_stops_the_daemon_reading(tmp_path: Path) -> None:
    from simpler_daemon.server.fastpath import _HIGH_WATER

    padded = b"\x7a\xfa\x01" + b"p" * 250  # an unknown field: more than the kernel buffers
    calls = b"".join(encode(Call(i, "GetInfo", padded)) for i in range(1, 3001))

    async def test(server: Any, conn: Any, sock: socket.socket) -> None:
        sent = 0
        blocked_since: float | None = None
        loop = asyncio.get_running_loop()
        while sent < len(calls):  # pipeline every call, never read a reply
            try:
                sent += sock.send(calls[sent:])
                blocked_since = None
            except BlockingIOError:
                blocked_since = blocked_since or loop.time()
                if loop.time() - blocked_since > 2.0 and conn._transport_paused:
                    break  # the daemon stopped reading: the kernel buffers are full
            await asyncio.sleep(0.005)
        assert sent < len(calls), "the daemon read every call and buffered every reply"
        buffered = conn._transport.get_write_buffer_size()
        assert buffered <= _HIGH_WATER + 256 * (40 << 10)

    _in_process_server(tmp_path, test)


@pytest.mark.timeout(60)
def test_calls_in_flight_per_connection_are_capped(tmp_path: Path) -> None:
    from simpler_daemon.server.fastpath import MAX_CALLS

    request = pb.WaitRunRequest().SerializeToString()
    n = MAX_CALLS + 40

    async def test(server: Any, conn: Any, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(
            sock, b"".join(encode(Call(i, "WaitRun", request)) for i in range(1, n + 1))
        )
        await _poll(lambda: len(conn._calls) >= MAX_CALLS, "the calls did not start")
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(conn._calls) == MAX_CALLS
        next(iter(server.table.values()))  # the server is the real one
        server.table["WaitRun"][1].__self__.release.set()
        dec = FrameDecoder(CLIENT_FRAMES, 1 << 30)
        got: set[int] = set()
        while len(got) < n:  # every call, held ones too, is answered
            data = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 20)
            assert data
            got |= {f.id for f in dec.feed(data)}
        assert got == set(range(1, n + 1))

    _in_process_server(tmp_path, test)
