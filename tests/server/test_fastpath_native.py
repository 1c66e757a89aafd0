"""The fast path's protocol version 2 (protocol/fastwire.py): the Hello's ``upto``, the
daemon's Welcome, and the Submit and Wait frames that stand for SubmitRun and WaitRun.

Codec units and the fingerprint first (no daemon); then a real daemon spoken to with
raw frames (negotiation, bad inputs, the same answers as the Call form, idempotency
keys across both forms); then the blocking client against stand-in daemons of either
version (it sends Submit and Wait frames only after a Welcome).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest

from simpler_daemon.client import sub_task
from simpler_daemon.client.fastpath import FastTransport
from simpler_daemon.client.requests import tensor
from simpler_daemon.errors import ProtocolError
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol.fastwire import (
    CLIENT_FRAMES,
    LENGTH,
    NATIVE_VERSION,
    SERVER_FRAMES,
    Call,
    FrameDecoder,
    Hello,
    NativeTask,
    Reply,
    Submit,
    Wait,
    Welcome,
    encode,
)
from simpler_daemon.server.keys import _digest, fingerprint, fingerprint_now, native_fingerprint
from tests.support.daemon_harness import (
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    wait_until,
)
from tests.support.fast_raw import RawFast

TASKS = "tests.support.daemon_tasks"
CONFIG: dict[str, dict[str, Any]] = {
    "callables": {"allowed_modules": ["simpler_daemon.examples", "tests"]},
}
_MODULE_DAEMONS: set[int] = set()
OK = 0
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
HASHID = "sha256:" + "ab" * 32

# --------------------------------------------------------------------------- units


class _HelloV1(msgspec.Struct, array_like=True, tag=0, frozen=True):
    """A version-1 daemon's Hello (before ``upto``)."""

    version: int
    label: str = ""


def test_hello_upto_is_ignored_by_a_version_1_decoder_and_defaults_to_1() -> None:
    old = msgspec.msgpack.Decoder(_HelloV1)
    assert old.decode(msgspec.msgpack.encode(Hello(1, "me", NATIVE_VERSION))) == _HelloV1(1, "me")
    new = FrameDecoder(SERVER_FRAMES, 1 << 20)
    (hello,) = new.feed(encode(_HelloV1(1, "me")))
    assert hello == Hello(1, "me") and hello.upto == 1


def test_version_2_frames_round_trip_and_malformed_ones_are_protocol_errors() -> None:
    server = FrameDecoder(SERVER_FRAMES, 1 << 20)
    submit = Submit(7, [NativeTask(1, HASHID), NativeTask(3, HASHID, (b"", b"\x10\x01"), (2, 3))])
    wait = Wait(8, 42, 1.5, True, 3.0)
    assert server.feed(encode(submit) + encode(wait)) == [submit, wait]
    assert submit.tasks[0].members == (b"",)  # the default: one call without arguments
    client = FrameDecoder(CLIENT_FRAMES, 1 << 20)
    assert client.feed(encode(Welcome(2))) == [Welcome(2)]
    bad = b"\x93\x07\x01\x05"  # [7 (Submit), 1, 5]: tasks is not a list
    with pytest.raises(ProtocolError, match="cannot decode frame"):
        FrameDecoder(SERVER_FRAMES, 1 << 20).feed(LENGTH.pack(len(bad)) + bad)
    with pytest.raises(ProtocolError, match="cannot decode frame"):  # Welcome is the daemon's
        FrameDecoder(SERVER_FRAMES, 1 << 20).feed(encode(Welcome(2)))


def _requests() -> Iterator[pb.SubmitRunRequest]:
    args = pb.Args(tensors=[tensor(5, "inout", (4,), "float32")], scalars=[1, 1 << 40])
    heavy = pb.Task(
        kind=pb.TASK_KIND_NEXT_LEVEL_GROUP,
        hashid=HASHID,
        members=[args, pb.Args()],
        workers=[0, -3],
        config=pb.CallConfig(deadline_ms=10, output_prefix="é"),
    )
    plain = sub_task(HASHID)
    yield pb.SubmitRunRequest(idempotency_key="k", tasks=[plain])
    yield pb.SubmitRunRequest(idempotency_key="ключ" * 40, tasks=[plain, heavy], label="l" * 200)
    for priority in (1, 127, 128, 1000, (1 << 32) - 1):
        yield pb.SubmitRunRequest(idempotency_key="k", tasks=[heavy] * 3, priority=priority)


@pytest.mark.parametrize("request_", list(_requests()))
def test_a_submit_frames_fingerprint_is_its_submit_run_requests(
    request_: pb.SubmitRunRequest,
) -> None:
    """A retry may come in either form: the digests agree (keys.native_fingerprint)."""
    tasks = [t.SerializeToString(deterministic=True) for t in request_.tasks]
    native = native_fingerprint(
        "SubmitRun", request_.idempotency_key, tasks, request_.label, request_.priority
    )
    assert native == fingerprint_now("SubmitRun", request_)


@pytest.mark.asyncio
async def test_a_submit_of_many_tasks_is_fingerprinted_on_a_thread_to_the_same_digest() -> None:
    """Past keys._MANY_TASKS tasks the size is not worked out (``ByteSize`` walks every
    task): the request goes to the thread, whose digest is the one computed in place,
    and the native form's."""
    one = sub_task("sha256:" + "ab" * 32)
    request = pb.SubmitRunRequest(tasks=[one] * 2000, idempotency_key="k", label="many")
    assert fingerprint_now("SubmitRun", request) is None
    digest = await fingerprint("SubmitRun", request)
    assert digest == _digest("SubmitRun", request)
    tasks = [t.SerializeToString(deterministic=True) for t in request.tasks]
    assert digest == native_fingerprint("SubmitRun", "k", tasks, "many", 0)


# --------------------------------------------------------------------------- a daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "fastnative", CONFIG, _MODULE_DAEMONS)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    yield from module_leak_guard(lambda: set(_MODULE_DAEMONS))


class Raw(RawFast):
    """One fast-path connection speaking frames by hand; ``upto``: the Hello's."""

    def __init__(self, daemon: DaemonProcess, upto: int = NATIVE_VERSION) -> None:
        super().__init__(daemon, Hello(1, "raw", upto))

    def welcomed(self) -> Raw:
        assert self.frame() == Welcome(NATIVE_VERSION)
        return self

    def reply(self, frame: Any) -> Reply:
        self.send(frame)
        got = self.frame()
        assert type(got) is Reply and got.id == frame.id, got
        return got


@pytest.fixture
def raw(daemon: DaemonProcess) -> Iterator[Raw]:
    conn = Raw(daemon).welcomed()
    yield conn
    conn.close()


@pytest.fixture(scope="module")
def callables(daemon: DaemonProcess) -> Iterator[dict[str, str]]:
    with daemon.client(timeout=60, transport="fast") as c:
        yield {name: c.register(f"{TASKS}:{name}") for name in ("nothing", "echo")}


def _status(reply: Reply) -> pb.SubmitRunResponse:
    assert reply.code == OK, reply
    return pb.SubmitRunResponse.FromString(reply.data)


@pytest.mark.timeout(60)
def test_only_a_client_offering_version_2_is_welcomed_and_may_send_its_frames(
    daemon: DaemonProcess, callables: dict[str, str]
) -> None:
    old = Raw(daemon, upto=1)
    try:
        got = old.reply(Call(1, "GetInfo", b""))  # no Welcome before the first reply
        assert got.code == OK
        old.send(Submit(2, [NativeTask(pb.TASK_KIND_SUB, callables["nothing"])], wait_seconds=9))
        assert old.closed_by_daemon()
    finally:
        old.close()
    wait_until(
        lambda: "did not negotiate protocol version 2" in daemon.stderr(),
        10,
        "no log line names the Submit frame of a version-1 connection",
    )
    new = Raw(daemon).welcomed()
    try:
        plain = [NativeTask(pb.TASK_KIND_SUB, callables["nothing"])]
        done = _status(new.reply(Submit(1, plain, wait_seconds=30.0)))
        assert done.status.state == pb.RUN_STATE_COMPLETED and done.status.run_id == done.run_id
        waited = new.reply(Wait(2, done.run_id, 30.0))
        assert pb.RunStatus.FromString(waited.data).state == pb.RUN_STATE_COMPLETED
        # Calls still work on a version-2 connection.
        assert new.reply(Call(3, "GetInfo", b"")).code == OK
    finally:
        new.close()


def _bad_submits(hashid: str) -> list[tuple[Submit, pb.SubmitRunRequest | None, int, str]]:
    """(frame, the equal SubmitRunRequest or None, code, field) of refused submits."""
    plain = NativeTask(pb.TASK_KIND_SUB, hashid)
    unknown = "sha256:" + "cd" * 32
    return [
        (Submit(1, []), pb.SubmitRunRequest(), INVALID, "tasks"),
        (
            Submit(1, [NativeTask(pb.TASK_KIND_SUB, unknown)]),
            pb.SubmitRunRequest(tasks=[sub_task(unknown)]),
            NOT_FOUND,
            "tasks[0].hashid",
        ),
        (
            Submit(1, [plain], wait_seconds=-1.0),
            pb.SubmitRunRequest(tasks=[sub_task(hashid)], wait_seconds=-1.0),
            INVALID,
            "wait_seconds",
        ),
        (
            Submit(1, [plain], priority=5000),
            pb.SubmitRunRequest(tasks=[sub_task(hashid)], priority=5000),
            INVALID,
            "priority",
        ),
        (
            Submit(1, [NativeTask(77, hashid)]),
            pb.SubmitRunRequest(tasks=[pb.Task(kind=77, hashid=hashid, members=[pb.Args()])]),  # type: ignore[arg-type]
            INVALID,
            "tasks[0].kind",
        ),
        (
            Submit(1, [plain], idempotency_key="k" * 1000),
            pb.SubmitRunRequest(tasks=[sub_task(hashid)], idempotency_key="k" * 1000),
            INVALID,
            "idempotency_key",
        ),
        # Only the frame can say these: no Task message holds them.
        (Submit(1, [NativeTask(1 << 40, hashid)]), None, INVALID, "tasks[0].kind"),
        (Submit(1, [plain], priority=-1), None, INVALID, "priority"),
        (
            Submit(1, [NativeTask(pb.TASK_KIND_SUB, hashid, (b"\xff\xff\xff",))]),
            None,
            INVALID,
            "tasks[0].members[0]",
        ),
        (
            Submit(1, [NativeTask(pb.TASK_KIND_SUB, hashid, (b"",), (), b"\x0a")]),
            None,
            INVALID,
            "tasks[0].config",
        ),
        (
            Submit(1, [NativeTask(pb.TASK_KIND_NEXT_LEVEL, hashid, (b"",), (1 << 40,))]),
            None,
            INVALID,
            "tasks[0].workers[0]",
        ),
    ]


@pytest.mark.timeout(60)
def test_bad_submits_and_waits_are_refused_as_their_calls_are_naming_the_field(
    raw: Raw, callables: dict[str, str]
) -> None:
    for frame, request, code, field in _bad_submits(callables["nothing"]):
        got = raw.reply(frame)
        assert (got.code, got.field) == (code, field), (frame, got)
        assert got.details
        if request is not None:  # the same status as the Call form
            call = raw.reply(Call(2, "SubmitRun", request.SerializeToString()))
            assert (call.code, call.field, call.details) == (got.code, got.field, got.details)
    for run_id, code in ((0, INVALID), (-5, INVALID), (10**12, NOT_FOUND)):
        got = raw.reply(Wait(3, run_id, 0.0))
        assert (got.code, got.field) == (code, "run_id"), (run_id, got)
    got = raw.reply(Wait(3, 10**12, -2.0))
    assert (got.code, got.field) == (INVALID, "timeout_seconds")
    assert raw.reply(Call(4, "GetInfo", b"")).code == OK  # the connection lives on


@pytest.mark.timeout(60)
def test_a_frame_not_of_its_schema_closes_the_connection(daemon: DaemonProcess) -> None:
    conn = Raw(daemon).welcomed()
    body = msgspec.msgpack.encode([7, 1, "not a list of tasks"])
    conn.sock.sendall(len(body).to_bytes(4, "big") + body)
    assert conn.closed_by_daemon()
    conn.close()


@pytest.mark.timeout(60)
def test_a_key_names_one_run_whichever_form_submits_or_retries_it(
    raw: Raw, callables: dict[str, str]
) -> None:
    key = os.urandom(8).hex()
    first = pb.SubmitRunRequest(idempotency_key=key, tasks=[sub_task(callables["nothing"])])
    made = pb.SubmitRunResponse.FromString(
        raw.reply(Call(1, "SubmitRun", first.SerializeToString())).data
    )
    retry = _status(
        raw.reply(
            Submit(2, [NativeTask(pb.TASK_KIND_SUB, callables["nothing"])], key, wait_seconds=30)
        )
    )
    assert (retry.run_id, retry.deduplicated) == (made.run_id, True)
    assert retry.status.state == pb.RUN_STATE_COMPLETED
    other = raw.reply(Submit(3, [NativeTask(pb.TASK_KIND_SUB, callables["echo"])], key))
    assert (other.code, other.field) == (PRECONDITION, "idempotency_key")
    assert "cannot reuse idempotency key" in other.details
    # And the other way round: a key first used by a Submit frame.
    key2 = os.urandom(8).hex()
    made2 = _status(raw.reply(Submit(4, [NativeTask(pb.TASK_KIND_SUB, callables["echo"])], key2)))
    again = pb.SubmitRunRequest(idempotency_key=key2, tasks=[sub_task(callables["echo"])])
    got = pb.SubmitRunResponse.FromString(
        raw.reply(Call(5, "SubmitRun", again.SerializeToString())).data
    )
    assert (got.run_id, got.deduplicated) == (made2.run_id, True)


@pytest.mark.timeout(60)
def test_tasks_with_arguments_run_as_their_task_messages_do(
    daemon: DaemonProcess, raw: Raw, callables: dict[str, str]
) -> None:
    echo = sub_task(callables["echo"], scalars=[3, 1 << 40])
    config = pb.CallConfig(deadline_ms=60_000)
    tasks = [echo, sub_task(callables["echo"], scalars=[7], config=config)]
    native = [
        NativeTask(t.kind, t.hashid, tuple(m.SerializeToString() for m in t.members), (), c)
        for t, c in zip(tasks, (None, config.SerializeToString()), strict=True)
    ]
    got = _status(raw.reply(Submit(1, native, wait_seconds=30.0, include_results=True)))
    with daemon.client(timeout=60, transport="grpc") as g:
        want = g.submit_run(tasks, wait_seconds=30.0, include_results=True)
    assert got.status.state == want.status.state == pb.RUN_STATE_COMPLETED
    # echo returns its scalars and its worker's pid: the scalars must be the same.
    echoed = [msgspec.msgpack.decode(r.value)["scalars"] for r in got.status.results]
    assert echoed == [msgspec.msgpack.decode(r.value)["scalars"] for r in want.status.results]
    assert echoed == [[3, 1 << 40], [7]]


# --------------------------------------------------------------------------- the client


class _StandIn:
    """A daemon stand-in on one connection: answers every call with an empty message
    (a Call's by its method, a Wait frame's with a RunStatus) and records the frames;
    ``welcome``: answers the Hello's ``upto`` as a version-2 daemon does."""

    def __init__(self, path: Path, welcome: bool) -> None:
        self.path = str(path)
        self.frames: list[Any] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(1)
        self._welcome = welcome
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        dec = FrameDecoder(SERVER_FRAMES, 1 << 20)
        with conn:
            while data := conn.recv(1 << 16):
                for frame in dec.feed(data):
                    self.frames.append(frame)
                    if type(frame) is Hello:
                        if self._welcome and frame.upto >= NATIVE_VERSION:
                            conn.sendall(encode(Welcome(NATIVE_VERSION)))
                    elif type(frame) is Wait:
                        status = pb.RunStatus(run_id=frame.run_id).SerializeToString()
                        conn.sendall(encode(Reply(frame.id, 0, "", "", status)))
                    else:
                        conn.sendall(encode(Reply(frame.id, 0)))

    def close(self) -> None:
        self._listener.close()
        self._thread.join(10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("welcome", [False, True])
def test_the_client_sends_version_2_frames_only_once_welcomed(
    tmp_path: Path, welcome: bool
) -> None:
    stand_in = _StandIn(tmp_path / "d.fast.sock", welcome)
    transport = FastTransport(stand_in.path, "me")
    try:
        got = [transport.unary("WaitRun", pb.WaitRunRequest(run_id=5), 10.0) for _ in range(2)]
        # The stand-in answers a Call with an empty message, a Wait frame with the run id.
        assert [s.run_id for s in got] == ([0, 5] if welcome else [0, 0])
        kinds = [type(f) for f in stand_in.frames]
        assert kinds[0] is Hello and stand_in.frames[0].upto == NATIVE_VERSION
        # The first call precedes the Welcome's arrival; the next one uses it.
        assert kinds[1:] == ([Call, Wait] if welcome else [Call, Call])
    finally:
        transport.close()
        stand_in.close()
