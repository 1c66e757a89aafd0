"""Protocol tests of the parent side of a remote L3 session (RemoteL3Endpoint, open_session).

The peer here is a scripted runner written in this file: real loopback TCP
sockets and threads that speak the frame codec (HELLO, COMPLETION,
CONTROL_REPLY, HEALTH), so each test states exactly what the runner sends and
when. They pin down the endpoint's side of the protocol; the end-to-end tests
against the real ``simpler-remote-l3-session`` runner live in their own files.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from simpler_daemon.args import (
    DEFAULT_CONFIG,
    CallConfig,
    Tag,
    TensorDesc,
    decode_descs,
    dtype_code,
    dtype_of,
    encode_args,
)
from simpler_daemon.endpoints.base import EndpointEvent, EventKind, Outcome, WorkerDispatch
from simpler_daemon.endpoints.remote import TASK_DEADLINE_GRACE_S, RemoteL3Endpoint
from simpler_daemon.errors import ControlError, EndpointError, StartupError
from simpler_daemon.remote.attach import Session, open_session
from simpler_daemon.remote.manifest import Manifest, ManifestCallable, decode_manifest
from simpler_daemon.remote.spec import RemoteWorkerSpec
from simpler_daemon.remote.wire import (
    E_CONTROL_FAILED,
    E_TASK_FAILED,
    Completion,
    Control,
    ControlReply,
    Frame,
    FrameDecoder,
    FrameType,
    Hello,
    RemoteTensor,
    Task,
    encode_frame,
)
from simpler_daemon.testing import poll_for, self_signed_cert

pytestmark = pytest.mark.timeout(60)

SID = 0x1234_5678_9ABC_DEF0
WID = 3
DIGEST = bytes(range(32))
_REQUESTS = frozenset({FrameType.TASK, FrameType.CONTROL, FrameType.SHUTDOWN})


# --------------------------------------------------------------------------- scripted peer


def _pair(rcvbuf: int | None = None) -> tuple[socket.socket, socket.socket, int]:
    """(client, server, port): one loopback TCP connection."""
    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    port = lst.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    server, _ = lst.accept()
    lst.close()
    return client, server, port


class Peer:
    """The runner side of one attached session, scripted by the test."""

    def __init__(
        self,
        cmd: socket.socket,
        health: socket.socket,
        *,
        session_id: int = SID,
        worker_id: int = WID,
        beat: float = 0.05,
    ) -> None:
        self.cmd = cmd
        self.health = health
        self.session_id = session_id
        self.worker_id = worker_id
        self.decoder = FrameDecoder(session_id=session_id, worker_id=worker_id, allowed=_REQUESTS)
        self.frames: list[Frame] = []
        self.beating = threading.Event()
        self.beating.set()
        self.beats = 0
        self._stop = threading.Event()
        self._interval = beat
        self._threads: list[threading.Thread] = []
        self.start(self._beat)

    def start(self, fn: Callable[[], None]) -> threading.Thread:
        t = threading.Thread(target=fn, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _beat(self) -> None:
        seq = 1
        while not self._stop.wait(self._interval):
            if self.beating.is_set():
                try:
                    self.health.sendall(encode_frame(FrameType.HEALTH, self.session_id, WID, seq))
                except OSError:
                    return
                seq += 1
                self.beats += 1

    def recv_frame(self, timeout: float = 5.0) -> Frame:
        """The next request frame; ``TimeoutError`` when none arrives in time."""
        deadline = time.monotonic() + timeout
        while not self.frames:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no frame from the endpoint")
            self.cmd.settimeout(left)
            try:
                data = self.cmd.recv(1 << 16)
            except TimeoutError:
                raise TimeoutError("no frame from the endpoint") from None
            if not data:
                raise EOFError("the endpoint closed the command lane")
            self.frames.extend(self.decoder.feed(data))
        return self.frames.pop(0)

    def send(self, ftype: FrameType, seq: int, payload: Any = None) -> None:
        self.cmd.sendall(encode_frame(ftype, self.session_id, self.worker_id, seq, payload))

    def complete(self, seq: int, code: int = 0, text: str = "", tb: str = "") -> None:
        self.send(FrameType.COMPLETION, seq, Completion(code, text, tb))

    def reply(
        self, seq: int, name: str, code: int = 0, text: str = "", result: bytes = b""
    ) -> None:
        self.send(FrameType.CONTROL_REPLY, seq, ControlReply(name, 1, code, text, result))

    def serve(self, handler: Callable[[Frame], None]) -> threading.Thread:
        """Answer every request with ``handler`` from a thread until the lane closes."""

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    frame = self.recv_frame(timeout=0.1)
                except TimeoutError:
                    continue
                except (EOFError, OSError):
                    return
                handler(frame)

        return self.start(loop)

    def saw_eof(self, timeout: float = 5.0) -> bool:
        """Whether the command lane reads EOF (what makes a real runner exit)."""
        try:
            while True:
                self.recv_frame(timeout)
        except (EOFError, ConnectionResetError):
            return True  # a reset (unread bytes at close) ends the lane as well
        except (TimeoutError, OSError):
            return False

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(5)
        for s in (self.cmd, self.health):
            s.close()


@dataclass
class Harness:
    peer: Peer
    session: Session
    port: int
    endpoints: list[RemoteL3Endpoint] = field(default_factory=list)

    def endpoint(self, timeout: float = 2.0) -> RemoteL3Endpoint:
        spec = RemoteWorkerSpec(endpoint=f"127.0.0.1:{self.port}", session_timeout_s=timeout)
        ep = RemoteL3Endpoint(WID, spec, self.session)
        self.endpoints.append(ep)
        return ep


def _harness(cmd_rcvbuf: int | None = None, cmd_sndbuf: int | None = None) -> Harness:
    ccmd, scmd, port = _pair(cmd_rcvbuf)
    if cmd_sndbuf is not None:
        ccmd.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cmd_sndbuf)
    chealth, shealth, _ = _pair()
    hello = Hello(SID, WID, 1, 0, True, "127.0.0.1", 4242)
    session = Session(WID, SID, "127.0.0.1", port, 4242, ccmd, chealth, hello)
    return Harness(Peer(scmd, shealth), session, port)


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = _harness()
    try:
        yield harness
    finally:
        for ep in harness.endpoints:
            ep.close()
        harness.peer.close()
        harness.session.close()


# --------------------------------------------------------------------------- dispatches


@dataclass
class Slot:
    """The fields of a task slot an endpoint reads (``endpoints.base.SlotView``)."""

    blobs: list[bytes]
    config: CallConfig = DEFAULT_CONFIG
    digest: bytes = DIGEST
    slot_id: int = 1
    run_id: int = 1
    lease_slot: int = 0
    lease_generation: int = 1
    hashid: str = "sha256:" + DIGEST.hex()

    @property
    def config_bytes(self) -> bytes:
        return self.config.encode()


def remote_desc(buffer_id: int = 7, owner: int = WID, ndim: int = 1) -> TensorDesc:
    shape = (2,) * ndim
    strides = tuple(4 * 2 ** (ndim - 1 - i) for i in range(ndim))
    return TensorDesc(
        buffer_id, 2, owner, 0, 4 * 2**ndim, dtype_code("float32"), shape, strides, Tag.INOUT, True
    )


_next_dispatch = iter(range(1, 1 << 30))


def dispatch(
    descs: tuple[TensorDesc, ...] = (), scalars: tuple[int, ...] = (), **cfg: Any
) -> WorkerDispatch:
    slot = Slot([encode_args(descs, scalars)], CallConfig(**cfg))
    return WorkerDispatch(slot, 0, next(_next_dispatch))


def events_until(
    ep: RemoteL3Endpoint, pred: Callable[[list[EndpointEvent]], bool], timeout: float = 5.0
) -> list[EndpointEvent]:
    out: list[EndpointEvent] = []

    def step() -> bool:
        ep.poll_progress(out)
        return pred(out)

    poll_for(step, timeout=timeout, interval=0.002)
    return out


def completed(out: list[EndpointEvent]) -> bool:
    return any(e.kind is EventKind.COMPLETED for e in out)


def final(out: list[EndpointEvent]) -> EndpointEvent:
    done = [e for e in out if e.kind is EventKind.COMPLETED]
    assert len(done) == 1, out
    return done[0]


# --------------------------------------------------------------------------- task path


def test_submit_and_poll_success(h: Harness) -> None:
    ep = h.endpoint()
    d = dispatch((remote_desc(),), (5, (1 << 64) - 1), deadline_ms=0, threads=2)
    ep.submit_progress(d)
    assert ep.owned() == 1
    f = h.peer.recv_frame()
    assert (f.type, f.sequence) == (FrameType.TASK, 1)
    task = f.payload
    assert isinstance(task, Task)
    assert task.digest == DIGEST
    assert task.config.threads == 2
    assert task.scalars == [5, (1 << 64) - 1]
    assert task.tensors == [
        RemoteTensor(WID, 7, 2, 0, 8, "float32", [2], [4], int(Tag.INOUT)),
    ]
    h.peer.complete(1)
    out = events_until(ep, completed)
    assert [e.kind for e in out] == [EventKind.ACCEPTED, EventKind.COMPLETED]
    assert out[1].outcome is Outcome.SUCCESS and out[1].dispatch is d
    assert ep.owned() == 0
    # The lane goes on: the next TASK takes the next sequence.
    ep.submit_progress(dispatch())
    assert h.peer.recv_frame().sequence == 2
    h.peer.complete(2)
    assert final(events_until(ep, completed)).outcome is Outcome.SUCCESS
    st = ep.stats()
    assert st["tasks"] == 2 and st["failures"] == 0 and st["round_trip_us"] > 0
    assert not ep.poisoned


def test_task_failure_is_not_sticky(h: Harness) -> None:
    ep = h.endpoint()
    ep.submit_progress(dispatch())
    h.peer.recv_frame()
    h.peer.complete(1, E_TASK_FAILED, "remote worker 3 run failed: boom", "Traceback: ...")
    ev = final(events_until(ep, completed))
    assert ev.outcome is Outcome.TASK_FAILURE
    assert ev.error == E_TASK_FAILED
    assert ev.message == "remote worker 3 run failed: boom\nTraceback: ..."
    assert not ep.poisoned
    ep.submit_progress(dispatch())
    h.peer.recv_frame()
    h.peer.complete(2)
    assert final(events_until(ep, completed)).outcome is Outcome.SUCCESS


def test_task_tensors_match_decode_descs(h: Harness) -> None:
    """The endpoint reads the args blob itself; it must agree with args.decode_descs."""
    descs = []
    for i, (dtype, ndim) in enumerate(
        [("float32", 0), ("int8", 1), ("complex128", 3), ("bool", 8), ("uint64", 2)]
    ):
        shape = tuple(range(2, 2 + ndim))
        strides = tuple(-s * 3 for s in range(1, ndim + 1))
        descs.append(
            TensorDesc(
                10 + i,
                1 << 40,
                9 - i,
                24 * i,
                1 << 33,
                dtype_code(dtype),
                shape,
                strides,
                Tag(i % 5),
                True,
            )
        )
    d = dispatch(tuple(descs), tuple(range(7)))
    ep = h.endpoint()
    ep.submit_progress(d)
    task = h.peer.recv_frame().payload
    assert isinstance(task, Task)
    ref, scalars = decode_descs(d.task_slot.blobs[0])
    assert task.scalars == scalars
    assert task.tensors == [
        RemoteTensor(
            x.buffer_offset,
            x.buffer_id,
            x.generation,
            x.byte_offset,
            x.buffer_nbytes,
            dtype_of(x.dtype).name,
            list(x.shape),
            list(x.strides),
            int(x.tag),
        )
        for x in ref
    ]
    h.peer.complete(1)
    assert final(events_until(ep, completed)).outcome is Outcome.SUCCESS


def test_malformed_args_blob_is_refused(h: Harness) -> None:
    ep = h.endpoint()
    d = WorkerDispatch(Slot([struct.pack("<ii", 3, 0)]), 0, 1)
    with pytest.raises(EndpointError, match="malformed args blob"):
        ep.submit_progress(d)
    assert not ep.poisoned


def test_local_tensor_is_refused_without_poisoning(h: Harness) -> None:
    ep = h.endpoint()
    local = TensorDesc(1, 1, 4096, 0, 8, dtype_code("float32"), (2,), (4,), Tag.INPUT)
    with pytest.raises(EndpointError, match=r"tensor 1 is a host array .* alloc_remote"):
        ep.submit_progress(dispatch((remote_desc(), local)))
    assert not ep.poisoned and ep.owned() == 0
    ep.submit_progress(dispatch((remote_desc(),)))
    assert h.peer.recv_frame().sequence == 1  # the refused task took no sequence
    h.peer.complete(1)
    assert final(events_until(ep, completed)).outcome is Outcome.SUCCESS


def test_capacity_one_and_stop_refuse_submits(h: Harness) -> None:
    ep = h.endpoint()
    ep.submit_progress(dispatch())
    with pytest.raises(EndpointError, match="still in flight"):
        ep.submit_progress(dispatch())
    h.peer.recv_frame()
    ep.request_stop()
    h.peer.complete(1)  # the task in flight still completes after request_stop
    assert final(events_until(ep, completed)).outcome is Outcome.SUCCESS
    with pytest.raises(EndpointError, match="stopping"):
        ep.submit_progress(dispatch())


def test_partial_read_completion_byte_by_byte(h: Harness) -> None:
    ep = h.endpoint()
    ep.submit_progress(dispatch())
    h.peer.recv_frame()
    data = encode_frame(FrameType.COMPLETION, SID, WID, 1, Completion(0, "", ""))
    out: list[EndpointEvent] = []
    for i in range(len(data)):
        h.peer.cmd.sendall(data[i : i + 1])
        time.sleep(0.001)
        ep.on_readable()
        ep.poll_progress(out)
        if i < len(data) - 1:
            assert not completed(out), f"completed after {i + 1} of {len(data)} bytes"

    def done() -> bool:
        ep.poll_progress(out)
        return completed(out)

    poll_for(done, timeout=5)
    assert final(out).outcome is Outcome.SUCCESS


def test_partial_write_of_a_large_task_is_resumed() -> None:
    h = _harness(cmd_rcvbuf=4096, cmd_sndbuf=4096)
    try:
        ep = h.endpoint()
        descs = tuple(remote_desc(buffer_id=1000 + i, ndim=8) for i in range(381))
        d = dispatch(descs, deadline_ms=60_000)
        ep.submit_progress(d)  # returns at once with most of the frame still unsent
        out: list[EndpointEvent] = []
        ep.poll_progress(out)
        assert not out, "the TASK cannot fit into the socket buffers yet"
        assert ep.stats()["bytes_sent"] < 40_000
        got: list[Frame] = []
        reader = h.peer.start(lambda: got.append(h.peer.recv_frame(timeout=10)))
        out = events_until(ep, lambda o: any(e.kind is EventKind.ACCEPTED for e in o), 10)
        reader.join(10)
        assert len(got) == 1 and isinstance(got[0].payload, Task)
        assert [getattr(t, "buffer_id", None) for t in got[0].payload.tensors] == [
            1000 + i for i in range(381)
        ]
        h.peer.complete(1)
        assert final(events_until(ep, completed)).outcome is Outcome.SUCCESS
    finally:
        for ep in h.endpoints:
            ep.close()
        h.peer.close()


# --------------------------------------------------------------------------- failures


def test_health_silence_fails_stickily(h: Harness) -> None:
    ep = h.endpoint(timeout=0.5)
    unwatched: list[int] = []
    fds = ep.wake_fds()
    ep.set_fd_watcher(unwatched.append)
    ep.submit_progress(dispatch())
    h.peer.recv_frame()
    h.peer.beating.clear()
    t0 = time.monotonic()
    ev = final(events_until(ep, completed))
    assert time.monotonic() - t0 >= 0.4
    assert ev.outcome is Outcome.ENDPOINT_FAILURE
    assert ev.message.startswith(
        f"remote worker {WID} (127.0.0.1:{h.port}) failed: health lane silent for"
    )
    assert ep.poisoned and "health lane silent" in (ep.failure or "")
    assert sorted(unwatched) == sorted(fds) and ep.wake_fds() == []
    assert h.peer.saw_eof(), "a failed endpoint must close the lane so the runner exits"
    # Health coming back never revives the session.
    h.peer.beating.set()
    time.sleep(0.15)
    ep.on_readable()
    assert ep.poisoned
    with pytest.raises(EndpointError, match="health lane silent"):
        ep.submit_progress(dispatch())
    with pytest.raises(EndpointError, match="health lane silent"):
        ep.control("stats", b"")


def test_long_task_is_bounded_by_health_not_session_timeout(h: Harness) -> None:
    ep = h.endpoint(timeout=0.5)
    ep.submit_progress(dispatch())
    h.peer.recv_frame()
    out: list[EndpointEvent] = []
    t_end = time.monotonic() + 1.6  # three session timeouts while health beats
    while time.monotonic() < t_end:
        ep.poll_progress(out)
        time.sleep(0.01)
    assert not completed(out) and not ep.poisoned
    h.peer.complete(1)
    assert final(out + events_until(ep, completed)).outcome is Outcome.SUCCESS


def test_command_eof_fails_the_task(h: Harness) -> None:
    ep = h.endpoint()
    ep.submit_progress(dispatch())
    h.peer.recv_frame()
    h.peer.cmd.shutdown(socket.SHUT_WR)
    ev = final(events_until(ep, completed))
    assert ev.outcome is Outcome.ENDPOINT_FAILURE
    assert (
        ev.message == f"remote worker {WID} (127.0.0.1:{h.port}) failed: command connection closed"
    )
    assert ep.poisoned


def test_a_session_ending_on_a_truncated_completion_names_the_truncation(h: Harness) -> None:
    """The runner's end closes both lanes: when the health lane's EOF is read, what is
    already on the command lane (here half a completion, then EOF) names the cause."""
    ep = h.endpoint()
    ep.submit_progress(dispatch())
    h.peer.recv_frame()
    h.peer.beating.clear()
    data = encode_frame(FrameType.COMPLETION, SID, WID, 1, Completion(0, "", ""))
    h.peer.cmd.sendall(data[: len(data) // 2])
    h.peer.cmd.shutdown(socket.SHUT_WR)
    h.peer.health.shutdown(socket.SHUT_WR)
    # Both lanes are readable before the endpoint reads either.
    socks = [h.session.command, h.session.health]
    poll_for(lambda: len(select.select(socks, [], [], 0)[0]) == 2, timeout=5)
    ev = final(events_until(ep, completed))
    assert ev.outcome is Outcome.ENDPOINT_FAILURE
    assert "truncated frame at EOF" in ev.message, ev.message


def test_closed_health_lane_while_idle_refuses_the_next_submit(h: Harness) -> None:
    ep = h.endpoint()
    h.peer.beating.clear()
    h.peer.health.shutdown(socket.SHUT_WR)
    with pytest.raises(EndpointError, match=r"remote worker 3 .*health lane closed"):
        ep.submit_progress(dispatch())
    assert ep.poisoned and ep.owned() == 0


def test_wrong_sequence_is_a_protocol_error(h: Harness) -> None:
    ep = h.endpoint()
    ep.submit_progress(dispatch())
    h.peer.recv_frame()
    h.peer.complete(5)
    ev = final(events_until(ep, completed))
    assert ev.outcome is Outcome.ENDPOINT_FAILURE
    assert "failed: protocol error: COMPLETION carries sequence 5" in ev.message
    assert ep.poisoned


def test_bad_health_frame_is_a_protocol_error(h: Harness) -> None:
    ep = h.endpoint()
    ep.submit_progress(dispatch())
    h.peer.recv_frame()
    h.peer.beating.clear()
    h.peer.health.sendall(encode_frame(FrameType.HEALTH, SID + 1, WID, 99))
    ev = final(events_until(ep, completed))
    assert ev.outcome is Outcome.ENDPOINT_FAILURE
    assert "protocol error on the health lane" in ev.message


def test_task_deadline_fails_the_session(h: Harness) -> None:
    ep = h.endpoint(timeout=5.0)
    ep.submit_progress(dispatch(deadline_ms=100))
    h.peer.recv_frame()
    t0 = time.monotonic()
    ev = final(events_until(ep, completed, timeout=20))
    elapsed = time.monotonic() - t0
    # Not before the deadline plus its grace; the upper bound leaves room for load.
    assert 0.1 + TASK_DEADLINE_GRACE_S - 0.1 <= elapsed < 0.1 + TASK_DEADLINE_GRACE_S + 8.0
    assert ev.outcome is Outcome.ENDPOINT_FAILURE
    assert ev.message.endswith("failed: task sequence 1 exceeded its deadline of 100 ms")
    assert ep.poisoned


# --------------------------------------------------------------------------- controls


def _answer(h: Harness) -> threading.Thread:
    def handler(f: Frame) -> None:
        assert f.type is FrameType.CONTROL
        c = f.payload
        if c.name == "stats":  # type: ignore[union-attr]
            h.peer.reply(f.sequence, "stats", result=b"xyz")
        elif c.name == "echo":  # type: ignore[union-attr]
            h.peer.reply(f.sequence, "echo", result=c.body)  # type: ignore[union-attr]
        else:
            h.peer.reply(f.sequence, c.name, E_CONTROL_FAILED, "no space left")  # type: ignore[union-attr]

    return h.peer.serve(handler)


def test_control_success_and_failure(h: Harness) -> None:
    ep = h.endpoint()
    _answer(h)
    assert ep.control("stats", b"") == b"xyz"
    with pytest.raises(
        ControlError, match=rf"alloc failed on remote worker 3 \(127.0.0.1:{h.port}\): no space"
    ):
        ep.control("alloc", b"\x80")
    assert not ep.poisoned
    big = os.urandom(3 << 20)  # several socket buffers: written across rounds
    assert ep.control("echo", big) == big
    st = ep.stats()
    assert st["controls"] == 3 and st["control_failures"] == 1


@pytest.mark.asyncio
async def test_control_async_pumps_itself_without_a_scheduler(h: Harness) -> None:
    ep = h.endpoint()
    _answer(h)
    assert await ep.control_async("stats", b"") == b"xyz"
    big = os.urandom(2 << 20)
    assert await ep.control_async("echo", big) == big
    with pytest.raises(ControlError, match="free failed"):
        await ep.control_async("free", b"")


@pytest.mark.asyncio
async def test_control_async_resolved_by_loop_readers(h: Harness) -> None:
    """The Scheduler's way: loop readers on wake_fds() call on_readable()."""
    loop = asyncio.get_running_loop()
    ep = h.endpoint()
    calls = 0

    def readable() -> None:
        nonlocal calls
        calls += 1
        ep.on_readable()

    for fd in ep.wake_fds():
        loop.add_reader(fd, readable)
    ep.set_fd_watcher(loop.remove_reader)
    try:
        _answer(h)
        results = await asyncio.gather(*(ep.control_async("echo", bytes([i])) for i in range(5)))
        assert results == [bytes([i]) for i in range(5)]
        await asyncio.sleep(0.3)
        assert calls > 0  # idle health beats reach the endpoint through the readers
        assert ep.health_age() < 0.2
    finally:
        for fd in ep.wake_fds():
            loop.remove_reader(fd)


def test_control_waits_for_the_task_in_flight(h: Harness) -> None:
    ep = h.endpoint()
    d = dispatch()
    ep.submit_progress(d)
    assert h.peer.recv_frame().type is FrameType.TASK
    result: list[bytes] = []
    t = threading.Thread(target=lambda: result.append(ep.control("stats", b"")), daemon=True)
    t.start()
    with pytest.raises(TimeoutError):
        h.peer.recv_frame(timeout=0.3)  # no CONTROL while the TASK runs
    h.peer.complete(1)
    f = h.peer.recv_frame()
    assert (f.type, f.sequence) == (FrameType.CONTROL, 2)
    h.peer.reply(2, "stats", result=b"ok")
    t.join(5)
    assert result == [b"ok"]
    # The completion the control's pump read is kept for the next poll.
    out: list[EndpointEvent] = []
    ep.poll_progress(out)
    assert [e.kind for e in out] == [EventKind.ACCEPTED, EventKind.COMPLETED]
    assert out[1].outcome is Outcome.SUCCESS and out[1].dispatch is d


def test_task_waits_behind_a_control(h: Harness) -> None:
    ep = h.endpoint()
    t = threading.Thread(target=lambda: ep.control("stats", b""), daemon=True)
    t.start()
    assert h.peer.recv_frame().type is FrameType.CONTROL
    ep.submit_progress(dispatch())
    with pytest.raises(TimeoutError):
        h.peer.recv_frame(timeout=0.2)
    h.peer.reply(1, "stats")
    t.join(5)
    f = h.peer.recv_frame()
    assert (f.type, f.sequence) == (FrameType.TASK, 2)
    h.peer.complete(2)
    out = events_until(ep, completed)
    assert [e.kind for e in out] == [EventKind.ACCEPTED, EventKind.COMPLETED]


def test_control_timeout_poisons(h: Harness) -> None:
    ep = h.endpoint(timeout=5.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"cannot complete stats on remote worker 3 .*0.3 s"):
        ep.control("stats", b"", timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 2.0
    assert ep.poisoned and "got no reply within 0.3 s" in (ep.failure or "")
    assert h.peer.recv_frame().type is FrameType.CONTROL


def test_pending_control_raises_endpoint_error_on_failure(h: Harness) -> None:
    ep = h.endpoint()
    errors: list[BaseException] = []

    def call() -> None:
        try:
            ep.control("stats", b"")
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    h.peer.recv_frame()
    h.peer.cmd.shutdown(socket.SHUT_WR)
    t.join(5)
    assert len(errors) == 1 and isinstance(errors[0], EndpointError)
    assert "command connection closed" in str(errors[0])


def test_shutdown_sends_shutdown_and_fails_the_owned_task(h: Harness) -> None:
    ep = h.endpoint()
    d = dispatch()
    ep.submit_progress(d)
    h.peer.recv_frame()
    seen: list[Frame] = []

    def runner_exit() -> None:
        seen.append(h.peer.recv_frame())
        h.peer.cmd.shutdown(socket.SHUT_WR)

    t = h.peer.start(runner_exit)
    t0 = time.monotonic()
    ep.shutdown(2.0)
    assert time.monotonic() - t0 < 1.5
    t.join(5)
    assert [(f.type, f.sequence) for f in seen] == [(FrameType.SHUTDOWN, 2)]
    out: list[EndpointEvent] = []
    ep.poll_progress(out)
    ev = final(out)
    assert ev.outcome is Outcome.ENDPOINT_FAILURE and "endpoint shut down" in ev.message
    assert ep.stats()["failures"] == 0  # a deliberate stop is not a failure
    with pytest.raises(EndpointError):
        ep.submit_progress(dispatch())


def test_on_readable_never_raises_and_unwatches_on_close(h: Harness) -> None:
    ep = h.endpoint()
    unwatched: list[int] = []
    ep.set_fd_watcher(unwatched.append)

    def beats() -> bool:
        ep.on_readable()
        return bool(ep.stats()["health_frames"] > 2)

    poll_for(beats, timeout=5)
    assert ep.health_age() < 1.0 and not ep.poisoned
    h.peer.cmd.sendall(b"garbage that is no frame header at all.......")
    ep.on_readable()
    assert ep.poisoned and "protocol error" in (ep.failure or "")
    assert len(unwatched) == 2
    ep.on_readable()  # a failed endpoint reads nothing and raises nothing
    ep.close()
    ep.on_readable()


# --------------------------------------------------------------------------- attach


class FakeWorker:
    """A scripted ``simpler-remote-worker``: handshake, then the runner's two listeners."""

    def __init__(
        self,
        *,
        reply: dict[str, Any] | None = None,
        hello_session_delta: int = 0,
        tls: ssl.SSLContext | None = None,
    ):
        self.tls = tls
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.reply = reply
        self.delta = hello_session_delta
        self.manifest: Manifest | None = None
        self.token = b""
        self.attach: list[bytes] = []
        self.peer: Peer | None = None
        self.sockets: list[socket.socket] = [self.listener]
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _wrap(self, sock: socket.socket) -> socket.socket:
        if self.tls is None:
            return sock
        sock.settimeout(10)
        return self.tls.wrap_socket(sock, server_side=True)

    def _recv(self, sock: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def _run(self) -> None:
        try:
            self.listener.settimeout(10)
            conn, _ = self.listener.accept()
            conn = self._wrap(conn)
            self.sockets.append(conn)
            magic, version, tlen = struct.unpack("<4sII", self._recv(conn, 12))
            assert (magic, version) == (b"SLRW", 1)
            self.token = self._recv(conn, tlen)
            (mlen,) = struct.unpack("<I", self._recv(conn, 4))
            self.manifest = m = decode_manifest(self._recv(conn, mlen))
            lanes = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
            self.sockets += lanes
            reply = self.reply or {
                "ok": True,
                "command": f"127.0.0.1:{lanes[0].getsockname()[1]}",
                "health": f"0.0.0.0:{lanes[1].getsockname()[1]}",
                "pid": 4242,
            }
            data = json.dumps(reply).encode()
            conn.sendall(struct.pack("<I", len(data)) + data)
            if not reply["ok"]:
                return
            accepted = []
            for lane in lanes:
                lane.settimeout(10)
                s, _ = lane.accept()
                s = self._wrap(s)
                self.sockets.append(s)
                self.attach.append(self._recv(s, 40))
                accepted.append(s)
            sid = m.session_id + self.delta
            hello = Hello(sid, m.worker_id, 1, 0, True, "127.0.0.1", 4242)
            accepted[0].sendall(encode_frame(FrameType.HELLO, sid, m.worker_id, 0, hello))
            self.peer = Peer(accepted[0], accepted[1], session_id=sid, worker_id=m.worker_id)
        except BaseException as exc:
            self.error = exc

    def close(self) -> None:
        self.thread.join(10)
        if self.peer is not None:
            self.peer.close()
        for s in self.sockets:
            s.close()


@pytest.fixture
def fake_worker() -> Iterator[Callable[..., FakeWorker]]:
    made: list[FakeWorker] = []

    def make(**kw: Any) -> FakeWorker:
        w = FakeWorker(**kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def _spec(port: int, **kw: Any) -> RemoteWorkerSpec:
    return RemoteWorkerSpec(endpoint=f"127.0.0.1:{port}", **kw)


CALLABLES = [ManifestCallable("sha256:" + "ab" * 32, "orchestration", "pkg.mod:fn")]


def test_open_session_attaches_and_runs_a_task(
    fake_worker: Callable[..., FakeWorker], tmp_path: Any
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    w = fake_worker()
    spec = _spec(w.port, token_file=str(token), session_timeout_s=7.0, num_sub_workers=2)
    deadline = time.monotonic() + 5.0
    session = open_session(spec, 5, CALLABLES, deadline)
    try:
        w.thread.join(5)
        assert w.error is None
        m = w.manifest
        assert m is not None and w.token == b"s3cret"
        assert (m.worker_id, m.parent_level, m.remote_level, m.num_sub_workers) == (5, 4, 3, 2)
        assert m.session_id == session.session_id != 0
        assert len(m.attach_key) == 64 and m.callables == CALLABLES
        assert 0 < m.startup_budget_s <= 5.0 and m.session_timeout_s == 7.0
        expected = struct.pack("<Q", m.session_id) + bytes.fromhex(m.attach_key)
        assert w.attach == [expected, expected]
        assert (session.host, session.port, session.pid) == ("127.0.0.1", w.port, 4242)
        assert session.hello.ready and session.command.getblocking() is False
        nodelay = session.command.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        keepalive = session.health.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        assert nodelay and keepalive
        ep = RemoteL3Endpoint(5, spec, session)
        try:
            assert w.peer is not None
            ep.submit_progress(dispatch())
            assert w.peer.recv_frame().type is FrameType.TASK
            w.peer.complete(1)
            assert final(events_until(ep, completed)).outcome is Outcome.SUCCESS
        finally:
            ep.close()
    finally:
        session.close()


def test_open_session_connection_refused() -> None:
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(
        StartupError, match=rf"cannot start remote worker 5 \(127.0.0.1:{port}\): .*refused"
    ):
        open_session(_spec(port), 5, [], time.monotonic() + 2.0)


def test_open_session_silent_listener_honours_the_deadline() -> None:
    s = socket.create_server(("127.0.0.1", 0))  # accepts in the backlog, never answers
    try:
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(StartupError) as info:
            open_session(_spec(port), 6, [], time.monotonic() + 0.5)
        assert time.monotonic() - t0 < 1.5
        assert str(info.value).startswith(f"cannot start remote worker 6 (127.0.0.1:{port}): ")
        assert "no answer within 0.5 s" in str(info.value)
    finally:
        s.close()


def test_open_session_ok_false(fake_worker: Callable[..., FakeWorker]) -> None:
    w = fake_worker(reply={"ok": False, "error": "cannot open session: authentication failed"})
    with pytest.raises(
        StartupError,
        match=rf"cannot start remote worker 1 \(127.0.0.1:{w.port}\): cannot open session: "
        "authentication failed",
    ):
        open_session(_spec(w.port), 1, [], time.monotonic() + 5.0)


def test_open_session_hello_with_wrong_session(fake_worker: Callable[..., FakeWorker]) -> None:
    w = fake_worker(hello_session_delta=1)
    with pytest.raises(StartupError, match=r"cannot start remote worker 2 .*bad HELLO.*session"):
        open_session(_spec(w.port), 2, [], time.monotonic() + 5.0)
    w.thread.join(5)
    assert w.peer is not None and w.peer.saw_eof(), "both lanes are closed on failure"


def test_open_session_missing_token_file(tmp_path: Any) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(StartupError, match=rf"remote worker 4 .*token_file '{missing}'"):
        open_session(_spec(9, token_file=missing), 4, [], time.monotonic() + 1.0)


def test_hostname_endpoint_is_refused_without_dns() -> None:
    with pytest.raises(ValueError, match=r"RemoteWorkerSpec\.endpoint"):
        RemoteWorkerSpec(endpoint="worker.example:19073")


def _self_signed(directory: Path) -> tuple[Path, Path]:
    pair = self_signed_cert(directory)
    if pair is None:
        pytest.skip("the openssl CLI is not available")
    return pair


def test_tls_session_with_partial_reads_and_writes(
    fake_worker: Callable[..., FakeWorker], tmp_path: Path
) -> None:
    """Non-blocking TLS: big controls both ways, then a task, through SSL sockets."""
    cert, key = _self_signed(tmp_path)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    w = fake_worker(tls=server)
    spec = _spec(w.port, tls_ca_file=str(cert))
    session = open_session(spec, WID, [], time.monotonic() + 10.0)
    ep = RemoteL3Endpoint(WID, spec, session)
    try:
        assert isinstance(session.command, ssl.SSLSocket)
        w.thread.join(5)
        assert w.peer is not None
        peer = w.peer

        def handler(f: Frame) -> None:
            c = f.payload
            if isinstance(c, Control):
                peer.reply(f.sequence, c.name, result=c.body[::-1])
            else:
                peer.complete(f.sequence)

        peer.serve(handler)
        big = os.urandom(3 << 20)
        assert ep.control("echo", big) == big[::-1]
        ep.submit_progress(dispatch((remote_desc(),)))
        assert final(events_until(ep, completed)).outcome is Outcome.SUCCESS
    finally:
        ep.close()
        session.close()


def test_tls_wrong_ca_fails_the_handshake(
    fake_worker: Callable[..., FakeWorker], tmp_path: Path
) -> None:
    cert, key = _self_signed(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    other_cert, _ = _self_signed(other)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    w = fake_worker(tls=server)
    with pytest.raises(StartupError, match=rf"remote worker 1 \(127.0.0.1:{w.port}\): TLS"):
        open_session(_spec(w.port, tls_ca_file=str(other_cert)), 1, [], time.monotonic() + 5.0)
