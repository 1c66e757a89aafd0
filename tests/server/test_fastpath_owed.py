"""The fast path's owed answers (server/fastowed.py): a waiting SubmitRun or
WaitRun is answered from its run's completion, its wait's timer, its deadline or a
Cancel, and leaves no reference cycle behind.

An in-process FastServer over a servicer whose Wait handler defers its answer to a
record this test ends (the record is the part of the run table the connection
sees: ``terminal`` and ``when_finished``). The socket, the frames, the connection
and its answers are the real ones. Each waiting call used to leave about 30 objects
of cyclic garbage (closures, a timer, a future), freed only by the cyclic collector
on the daemon's loop: ``gc.collect()`` after a batch of calls, with the collector
off meanwhile, proves none are left on any of the four ways a call ends.
"""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol.fastwire import (
    CLIENT_FRAMES,
    NATIVE_VERSION,
    PROTOCOL_VERSION,
    Cancel,
    FrameDecoder,
    Hello,
    Reply,
    Wait,
    Welcome,
    encode,
)
from simpler_daemon.server.fastcontext import Deferred

MAX_MESSAGE = 4 << 20
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
CALLS = 200


class _Record:
    """What the connection reads of a run record: ``terminal``, ``when_finished`` (as
    server/run_record.py's: the callbacks run once, when the run ends) and ``settle``
    (these runs never end inside it)."""

    def __init__(self, run_id: int) -> None:
        self.run_id = run_id
        self.terminal = False
        self._callbacks: list[Callable[[], None]] = []

    def when_finished(self, callback: Callable[[], None]) -> Callable[[], None]:
        self._callbacks.append(callback)

        def remove() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        return remove

    def settle(self) -> bool:
        return self.terminal

    def end(self) -> None:
        self.terminal = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


class _Service:
    """Wait defers its answer to the record of its run id; Submit is never sent."""

    def __init__(self) -> None:
        self.records: dict[int, _Record] = {}

    async def FastSubmitRun(self, frame: Any, context: Any) -> Any:
        raise AssertionError("not sent by these tests")

    async def FastWaitRun(self, frame: Wait, context: Any) -> Any:
        rec = self.records.setdefault(frame.run_id, _Record(frame.run_id))

        def finish() -> Any:
            return pb.RunStatus(run_id=rec.run_id, state=pb.RUN_STATE_COMPLETED)

        def refuse(exc: Exception) -> tuple[grpc.StatusCode, str, str]:
            return grpc.StatusCode.INTERNAL, str(exc), ""

        return Deferred(rec, frame.timeout_seconds, finish, refuse)


async def _poll(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.002)


class _Peer:
    """The client's end: frames out, Replies in."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.decoder = FrameDecoder(CLIENT_FRAMES, 1 << 24)
        self.replies: dict[int, Reply] = {}
        self.welcomed = False

    async def send(self, *frames: Any) -> None:
        await asyncio.get_running_loop().sock_sendall(
            self.sock, b"".join(encode(f) for f in frames)
        )

    async def replies_for(self, ids: range) -> dict[int, Reply]:
        loop = asyncio.get_running_loop()
        while not all(i in self.replies for i in ids):
            data = await asyncio.wait_for(loop.sock_recv(self.sock, 1 << 16), 20)
            assert data, "the server closed the connection"
            for frame in self.decoder.feed(data):
                if type(frame) is Welcome:
                    self.welcomed = True
                elif type(frame) is Reply:
                    self.replies[frame.id] = frame
        return {i: self.replies.pop(i) for i in ids}


def _serve(tmp_path: Path, loop: str, test: Callable[[Any, _Service, _Peer], Any]) -> None:
    import uvloop

    from simpler_daemon.server.fastpath import FastServer

    async def go() -> None:
        service = _Service()
        server = FastServer(service, str(tmp_path / "f.sock"), MAX_MESSAGE)
        await server.start()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(tmp_path / "f.sock"))
            sock.setblocking(False)
            peer = _Peer(sock)
            await peer.send(Hello(PROTOCOL_VERSION, "owed", NATIVE_VERSION))
            await _poll(lambda: len(server.connections) == 1, "no connection")
            await test(next(iter(server.connections)), service, peer)
        finally:
            sock.close()
            await server.close(0)

    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(go())


async def _garbage_of(batch: Callable[[], Any]) -> int:
    """Objects the cyclic collector finds unreachable after ``batch()`` (collector off
    meanwhile, so nothing it left is freed before the count)."""
    for _ in range(3):  # the loop's and the test's own start-up garbage first
        await asyncio.sleep(0)
        gc.collect()
    gc.disable()
    try:
        await batch()
        for _ in range(3):  # done callbacks scheduled by the batch's last turn
            await asyncio.sleep(0)
        return gc.collect()
    finally:
        gc.enable()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])  # the daemon's loop, and plain asyncio
def test_waiting_calls_end_four_ways_and_leave_no_cyclic_garbage(tmp_path: Path, loop: str) -> None:
    async def test(conn: Any, service: _Service, peer: _Peer) -> None:
        loop = asyncio.get_running_loop()
        next_id = [1]

        def batch_ids() -> range:  # call ids (and run ids) never used before
            first = next_id[0]
            next_id[0] += CALLS
            return range(first, first + CALLS)

        async def answered() -> None:  # the run ends: its status is the reply
            calls = batch_ids()
            await peer.send(*(Wait(i, run_id=i, timeout_seconds=600.0) for i in calls))
            await _poll(lambda: len(conn._calls) == CALLS, "the calls did not start")
            for i in calls:
                service.records[i].end()
            replies = await peer.replies_for(calls)
            assert {r.code for r in replies.values()} == {0}
            assert pb.RunStatus.FromString(replies[calls[0]].data).run_id == calls[0]

        async def timed_out() -> None:  # the wait's time is up: the status so far
            calls = batch_ids()
            await peer.send(*(Wait(i, run_id=i, timeout_seconds=0.001) for i in calls))
            replies = await peer.replies_for(calls)
            assert {r.code for r in replies.values()} == {0}

        async def past_deadline() -> None:  # the call's own deadline: DEADLINE_EXCEEDED
            calls = batch_ids()
            await peer.send(*(Wait(i, run_id=i, timeout=0.001) for i in calls))
            replies = await peer.replies_for(calls)
            assert {r.code for r in replies.values()} == {DEADLINE}
            assert {r.details for r in replies.values()} == {"Deadline Exceeded"}

        async def cancelled() -> None:  # a Cancel: no reply, and the call is gone
            calls = batch_ids()
            await peer.send(*(Wait(i, run_id=i) for i in calls))
            await _poll(lambda: len(conn._calls) == CALLS, "the calls did not start")
            await peer.send(*(Cancel(i) for i in calls))
            await _poll(lambda: not conn._calls, "the cancelled calls stayed")
            for i in calls:  # a run ending after its wait was cancelled answers nobody
                service.records[i].end()
            await peer.send(Wait(0, run_id=0, timeout_seconds=0.0))
            assert (await peer.replies_for(range(0, 1)))[0].code == 0
            assert not peer.replies, "a cancelled call was answered"

        await answered()  # warm: first-call caches are not the calls' garbage
        assert peer.welcomed
        for batch in (answered, timed_out, past_deadline, cancelled):
            assert await _garbage_of(batch) == 0, f"{batch.__name__} left cyclic garbage"
            assert not conn._calls
        assert loop.is_running()

    _serve(tmp_path, loop, test)
