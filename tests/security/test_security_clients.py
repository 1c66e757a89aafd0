"""One client against another: ownership of runs and objects, and per-identity quotas.

A real daemon (root) and two clients: A is the test process (root, hence an admin),
B is a helper process that drops to a freshly created unprivileged user before it
connects, so the daemon sees another uid through SO_PEERCRED. B may not cancel,
wait for, watch, read, write, free or unregister A's objects, nor Drain; an admin
may act on B's; quotas refuse with RESOURCE_EXHAUSTED naming the quota; idempotency
keys are scoped per owner. Skipped (with the reason) when not root.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from simpler_daemon.client import Client, sub_task, tensor
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.testing import leaked_shm, shm_files
from tests.support.daemon_harness import (
    EXAMPLES,
    REPO,
    DaemonProcess,
    module_leak_guard,
    running_daemon,
)
from tests.support.users import User, throwaway_user

pytestmark = pytest.mark.timeout(120)

Code = grpc.StatusCode
FLAG_WAIT_MS = 60_000
QUOTAS = {
    "per_client_runs": 2,
    "per_client_queued_runs": 1,
    "per_client_heap_bytes": 1 << 20,
    "per_client_registrations": 4,
    "max_streams_per_client": 4,
}

# The other user's client: imports everything as root (the interpreter lives under
# /root, which the other user cannot read), then drops to the user for good and
# answers one JSON request per line.
_PEER = textwrap.dedent(
    """
    import contextlib, dataclasses, datetime, io, json, os, shutil, sys  # shutil: argparse
    import grpc, numpy as np
    from google.protobuf.json_format import MessageToDict
    from google.protobuf.message import Message
    from simpler_daemon.cli import simplerctl as cli
    from simpler_daemon.client import Client, RunPhase, sub_task, tensor

    uid, gid, target = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    client = Client(target, timeout=60, retry=None)  # refusals are what is tested

    def plain(value):
        if isinstance(value, Message):
            return MessageToDict(value, preserving_proto_field_name=True)
        if isinstance(value, RunPhase):  # as MessageToDict names a RunState
            return "RUN_STATE_" + value.name
        if dataclasses.is_dataclass(value):  # the client's result types
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, datetime.datetime):
            return value.isoformat()
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, bytes):
            return list(value)
        return value

    def tasks(spec):
        return [
            sub_task(h, [tensor(b, tag, shape, dt) for b, tag, shape, dt in refs], scalars)
            for h, refs, scalars in spec
        ]

    def run(req):
        op, args, kwargs = req["op"], req.get("args", []), req.get("kwargs", {})
        if op == "submit":
            return client.submit_run(tasks(args[0]), **kwargs)
        if op == "write":
            return client.write_buffer(args[0], np.array(args[1], dtype=np.uint8))
        if op == "watch_first":
            stream = client.watch(args[0])
            try:
                return int(next(stream).type)
            finally:
                stream.close()
        if op == "cli":
            err, out = io.StringIO(), io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                code = cli.main(["--socket", target, *args])
            return {"exit": code, "stderr": err.getvalue()}
        return getattr(client, op)(*args, **kwargs)

    for line in sys.stdin:
        try:
            answer = {"ok": plain(run(json.loads(line)))}
        except grpc.RpcError as exc:
            answer = {"code": exc.code().name, "details": exc.details() or ""}
        print(json.dumps(answer), flush=True)
    """
)


class Peer:
    """The other user's client process."""

    def __init__(self, user: User, target: str, log: Path) -> None:
        self._log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _PEER, str(user.uid), str(user.gid), target],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )

    def ask(self, op: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, "args": args, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the peer process died:\n{self._log.read_text()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ok(self, op: str, *args: Any, **kwargs: Any) -> Any:
        answer = self.ask(op, *args, **kwargs)
        assert "ok" in answer, f"{op}{args} refused: {answer}"
        return answer["ok"]

    def refused(self, op: str, *args: Any, code: grpc.StatusCode, **kwargs: Any) -> str:
        answer = self.ask(op, *args, **kwargs)
        assert answer.get("code") == code.name, f"{op}{args}: expected {code.name}, got {answer}"
        return str(answer["details"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def other_user() -> Iterator[User]:
    with throwaway_user() as user:
        yield user


@pytest.fixture(scope="module")
def sock_dir() -> Iterator[Path]:
    """Where the public socket lives: a root-owned 0755 directory the other user can
    traverse (the runtime dir under pytest's 0700 tmp dir is out of its reach)."""
    path = Path(tempfile.mkdtemp(prefix="simpler-sec-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _overrides(user: User, sock: Path, **extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        "grpc": {"unix_socket": str(sock), "socket_group": str(user.gid)},
        "limits": dict(QUOTAS),
    }
    for section, values in extra.items():
        out.setdefault(section, {}).update(values)
    return out


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, other_user: User, sock_dir: Path
) -> Iterator[DaemonProcess]:
    shm_before = shm_files()
    overrides = _overrides(other_user, sock_dir / "daemon.sock")
    with running_daemon(tmp_path_factory.mktemp("security"), overrides) as d:
        _MODULE_DAEMONS.add(d.pid)
        yield d
    _MODULE_DAEMONS.discard(d.pid)
    assert not leaked_shm(shm_before)


#: The module daemon, alive from the first test that uses it to the module's end.
_MODULE_DAEMONS: set[int] = set()


@pytest.fixture(autouse=True)
def no_leaked_children(request: pytest.FixtureRequest) -> Iterator[None]:
    """The conftest guard, minus the module daemon (it lives across tests on purpose)."""
    if "daemon" in request.fixturenames:
        request.getfixturevalue("daemon")
    yield from module_leak_guard(lambda: set(_MODULE_DAEMONS))


@dataclass
class Admin:
    client: Client
    wait: str
    fill: str


@pytest.fixture(scope="module")
def a(daemon: DaemonProcess) -> Iterator[Admin]:
    with daemon.client() as c:
        yield Admin(c, c.register(f"{EXAMPLES}:wait_for_flag"), c.register(f"{EXAMPLES}:fill"))


@pytest.fixture
def b(daemon: DaemonProcess, other_user: User, tmp_path: Path) -> Iterator[Peer]:
    peer = Peer(other_user, daemon.socket, tmp_path / "peer-stderr.txt")
    try:
        yield peer
    finally:
        peer.close()


def _hold(c: Client, wait_h: str, flag: int) -> int:
    return c.submit([sub_task(wait_h, [tensor(flag, "inout", (2,), "uint8")], [FLAG_WAIT_MS])])


def _hold_spec(wait_h: str, flag: int) -> list[Any]:
    return [[wait_h, [[flag, "inout", [2], "uint8"]], [FLAG_WAIT_MS]]]


def _fill_spec(fill_h: str, buf: int, n: int = 4) -> list[Any]:
    return [[fill_h, [[buf, "output", [n], "float32"]], [3]]]


def _state(c: Client, run_id: int) -> int:
    return int(c.wait_run(run_id, timeout=0).state)


# --------------------------------------------------------------------------- ownership


def test_another_user_cannot_touch_a_run_but_an_admin_can(a: Admin, b: Peer) -> None:
    c = a.client
    flag = int(c.alloc_buffer((2,), "uint8").buffer_id)
    run_id = _hold(c, a.wait, flag)
    try:
        for op, args in (("cancel", (run_id, "hijack")), ("wait_run", (run_id, 0))):
            details = b.refused(op, *args, code=Code.PERMISSION_DENIED)
            assert f"run {run_id}" in details and "another client" in details
        details = b.refused("watch_first", run_id, code=Code.PERMISSION_DENIED)
        assert f"run {run_id}" in details
        assert _state(c, run_id) not in (pb.RUN_STATE_CANCELLED, pb.RUN_STATE_FAILED)
        # An admin acts on the other user's run.
        b_flag = int(b.ok("alloc_buffer", [2], "uint8")["buffer_id"])
        b_run = int(b.ok("submit", _hold_spec(a.wait, b_flag))["run_id"])
        # terminate: under fair admission its task already runs on the other worker.
        assert not c.cancel(b_run, "admin", terminate=True).already_finished
        status = b.ok("wait_run", b_run, 30)
        assert status["state"] == pb.RunState.Name(pb.RUN_STATE_CANCELLED)
        b.ok("free_buffer", b_flag)
    finally:
        c.write_buffer(flag, np.array([1, 0], dtype=np.uint8))
    assert c.wait(run_id, timeout=30).state == pb.RUN_STATE_COMPLETED
    c.free_buffer(flag)


def test_another_user_cannot_touch_a_buffer_but_an_admin_can(a: Admin, b: Peer) -> None:
    c = a.client
    secret = np.arange(4, dtype=np.float32)
    mine = c.alloc_array(secret, label="a-secret")
    try:
        for op, args in (
            ("read_buffer", (mine,)),
            ("write", (mine, [0] * 16)),
            ("free_buffer", (mine,)),
        ):
            details = b.refused(op, *args, code=Code.PERMISSION_DENIED)
            assert f"buffer {mine}" in details, details
        # Using it in a run is refused too, and ListBuffers does not show it.
        details = b.refused("submit", _fill_spec(a.fill, mine), code=Code.PERMISSION_DENIED)
        assert f"buffer {mine}" in details
        listed = b.ok("list_buffers").get("buffers", [])
        assert mine not in [int(x["buffer_id"]) for x in listed]
        np.testing.assert_array_equal(c.read_array(mine, (4,), "float32"), secret)
        # The admin reads and frees the other user's buffer; the other user sees its own.
        theirs = int(b.ok("alloc_buffer", [8], "uint8")["buffer_id"])
        b.ok("write", theirs, list(range(8)))
        assert [int(x["buffer_id"]) for x in b.ok("list_buffers")["buffers"]] == [theirs]
        assert c.read_buffer(theirs) == bytes(range(8))
        assert theirs in [x.buffer_id for x in c.list_buffers().buffers]
        c.free_buffer(theirs)
        b.refused("read_buffer", theirs, code=Code.NOT_FOUND)
    finally:
        c.free_buffer(mine)


def test_another_user_drops_only_its_own_registrations(a: Admin, b: Peer) -> None:
    c = a.client
    path = f"{EXAMPLES}:add"
    hashid = c.register(path)

    def refcount() -> int:
        return next(x.refcount for x in c.list_callables() if x.hashid == hashid)

    before = refcount()
    details = b.refused("unregister", hashid, code=Code.PERMISSION_DENIED)
    assert hashid in details
    assert refcount() == before
    assert b.ok("register", path) == hashid  # the other user's own reference
    assert b.ok("unregister", hashid) == before
    b.refused("unregister", hashid, code=Code.PERMISSION_DENIED)
    assert refcount() == before
    c.unregister(hashid)  # the admin drops its own


def test_only_an_admin_drains_or_shuts_down(
    daemon: DaemonProcess, other_user: User, a: Admin, b: Peer
) -> None:
    for kwargs in ({"grace": 0.0}, {"grace": 0.0, "shutdown": True}):
        details = b.refused("drain", code=Code.PERMISSION_DENIED, **kwargs)
        assert "admin" in details
    shown = b.ok("cli", "drain", "--grace", "0")
    assert shown["exit"] != 0
    assert "PERMISSION_DENIED" in shown["stderr"] and "admin" in shown["stderr"]
    assert a.client.get_info().serving_state == pb.SERVING_STATE_SERVING
    assert daemon.proc is not None and daemon.proc.poll() is None
    # Each side is told who the daemon takes it for.
    info = b.ok("get_info")
    assert info["caller"] == f"uid:{other_user.uid}" and not info.get("caller_is_admin")
    assert info["limits"]["per_client_runs"] == QUOTAS["per_client_runs"]
    mine = a.client.get_info()
    assert (mine.caller, mine.caller_is_admin) == ("uid:0", True)


@pytest.mark.parametrize("how", ["admin_uids", "admin_groups"])
def test_a_configured_admin_may_shut_down(
    tmp_path: Path, other_user: User, sock_dir: Path, how: str
) -> None:
    value: list[Any] = [other_user.uid] if how == "admin_uids" else [other_user.name]
    sock = sock_dir / f"{how}.sock"
    overrides = _overrides(other_user, sock, security={how: value})
    with running_daemon(tmp_path / "d", overrides) as d:
        peer = Peer(other_user, str(sock), tmp_path / "peer-stderr.txt")
        try:
            peer.ok("drain", grace=0.0, shutdown=True)
            assert d.wait(30) == 0
        finally:
            peer.close()


def test_idempotency_keys_are_scoped_per_owner(a: Admin, b: Peer) -> None:
    c = a.client
    mine = int(c.alloc_buffer((4,), "float32").buffer_id)
    theirs = int(b.ok("alloc_buffer", [4], "float32")["buffer_id"])
    key = f"shared-{secrets.token_hex(4)}"
    try:
        a_run = c.submit(
            [sub_task(a.fill, [tensor(mine, "output", (4,), "float32")], [3])], idempotency_key=key
        )
        # The same key from another owner is another run, whatever its request.
        first = b.ok("submit", _fill_spec(a.fill, theirs), idempotency_key=key)
        assert int(first["run_id"]) != a_run and not first.get("deduplicated", False)
        again = b.ok("submit", _fill_spec(a.fill, theirs), idempotency_key=key)
        assert int(again["run_id"]) == int(first["run_id"]) and again["deduplicated"]
        same = c.submit_run(
            [sub_task(a.fill, [tensor(mine, "output", (4,), "float32")], [3])],
            idempotency_key=key,
        )
        assert same.run_id == a_run and same.deduplicated
        c.wait(a_run, timeout=30)
        assert b.ok("wait_run", int(first["run_id"]), 30)["state"] == "RUN_STATE_COMPLETED"
    finally:
        c.free_buffer(mine)
        b.ok("free_buffer", theirs)


# --------------------------------------------------------------------------- quotas


def test_run_quota_is_per_identity_and_named(a: Admin, b: Peer) -> None:
    flag = int(b.ok("alloc_buffer", [2], "uint8")["buffer_id"])
    runs = [int(b.ok("submit", _hold_spec(a.wait, flag))["run_id"]) for _ in range(3)]
    try:
        # Past limits.per_client_runs a run waits QUEUED; past the queue it is refused.
        assert b.ok("wait_run", runs[2], 0)["state"] == pb.RunState.Name(pb.RUN_STATE_QUEUED)
        details = b.refused("submit", _hold_spec(a.wait, flag), code=Code.RESOURCE_EXHAUSTED)
        assert "limits.per_client_queued_runs = 1" in details and "retry after" in details
        # Another identity is not affected by this one's quota.
        c = a.client
        buf = int(c.alloc_buffer((4,), "float32").buffer_id)
        other = c.submit([sub_task(a.fill, [tensor(buf, "output", (4,), "float32")], [3])])
    finally:
        b.ok("write", flag, [1, 0])
    for run_id in runs:
        assert b.ok("wait_run", run_id, 60)["state"] == "RUN_STATE_COMPLETED"
    c.wait(other, timeout=60)
    c.free_buffer(buf)
    b.ok("free_buffer", flag)


def test_heap_quota_is_per_identity_and_named(a: Admin, b: Peer) -> None:
    size = 600 << 10
    first = int(b.ok("alloc_buffer", [size], "uint8")["buffer_id"])
    details = b.refused("alloc_buffer", [size], "uint8", code=Code.RESOURCE_EXHAUSTED)
    assert "limits.per_client_heap_bytes" in details and f"({1 << 20} bytes)" in details
    theirs = a.client.alloc_buffer((size,), "uint8").buffer_id  # another identity's bytes
    a.client.free_buffer(theirs)
    b.ok("free_buffer", first)  # freed bytes stop counting
    second = int(b.ok("alloc_buffer", [size], "uint8")["buffer_id"])
    b.ok("free_buffer", second)


def test_registration_quota_and_path_length(a: Admin, b: Peer) -> None:
    path = f"{EXAMPLES}:scale"
    # Held until unregistered, each one a reference (one session holds one per path).
    quota = QUOTAS["per_client_registrations"]
    hashids = [b.ok("register", path, persist=True) for _ in range(quota)]
    try:
        details = b.refused("register", path, persist=True, code=Code.RESOURCE_EXHAUSTED)
        assert "limits.per_client_registrations" in details
        b.ok("unregister", hashids.pop())
        hashids.append(b.ok("register", path, persist=True))
    finally:
        for h in hashids:
            b.ok("unregister", h)
    long_path = f"{EXAMPLES}:" + "x" * 4000
    details = b.refused("register", long_path, code=Code.RESOURCE_EXHAUSTED)
    assert "limits.max_import_path_chars" in details and "xxxx" not in details


_SAME_USER = textwrap.dedent(
    """
    import sys
    import grpc
    from simpler_daemon.client import Client
    with Client(sys.argv[1], client_id="another-label") as c:
        try:
            next(c.watch(int(sys.argv[2])))
        except grpc.RpcError as exc:
            print(exc.code().name, exc.details())
        else:
            print("OK")
    """
)


def test_stream_quota_is_per_user_not_per_process(daemon: DaemonProcess, a: Admin, b: Peer) -> None:
    c = a.client
    flag = int(c.alloc_buffer((2,), "uint8").buffer_id)
    run_id = _hold(c, a.wait, flag)
    streams: list[Any] = []
    try:
        for _ in range(QUOTAS["max_streams_per_client"]):
            stream = c.watch(run_id)
            assert next(stream).type == pb.RUN_EVENT_TYPE_SNAPSHOT
            streams.append(stream)
        # Another process of the same user is the same client ...
        out = subprocess.run(
            [sys.executable, "-c", _SAME_USER, daemon.socket, str(run_id)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.stdout.startswith("RESOURCE_EXHAUSTED"), out.stdout + out.stderr
        assert "limits.max_streams_per_client" in out.stdout
        # ... another user is another client.
        buf = int(b.ok("alloc_buffer", [4], "float32")["buffer_id"])
        b_run = int(b.ok("submit", _fill_spec(a.fill, buf))["run_id"])
        assert b.ok("watch_first", b_run) == pb.RUN_EVENT_TYPE_SNAPSHOT
    finally:
        for stream in streams:
            stream.close()
        c.write_buffer(flag, np.array([1, 0], dtype=np.uint8))
    c.wait(run_id, timeout=30)
    b.ok("wait_run", b_run, 30)
    b.ok("free_buffer", buf)
    c.free_buffer(flag)


def test_an_overrunning_write_is_refused_before_its_data_is_sent(a: Admin) -> None:
    c = a.client
    buf = c.alloc_buffer((64,), "uint8")
    answered = threading.Event()
    sent_data: list[bool] = []

    def requests() -> Iterator[pb.WriteBufferRequest]:
        yield pb.WriteBufferRequest(
            target=pb.WriteBufferTarget(buffer_id=buf.buffer_id, total_bytes=48 << 20)
        )
        # The daemon answers at the target; a daemon that waits for the data gets it
        # after this deadline (and the test fails on sent_data).
        if not answered.wait(20.0):
            sent_data.append(True)
            yield pb.WriteBufferRequest(data=b"\0" * 4096)

    try:
        future = c.stub.WriteBuffer.future(requests(), timeout=60)
        with pytest.raises(grpc.RpcError) as info:
            future.result()
        answered.set()
        assert info.value.code() == Code.INVALID_ARGUMENT, info.value.details()
        details = info.value.details() or ""
        assert "target.total_bytes" in details and f"buffer {buf.buffer_id}" in details
        assert not sent_data
    finally:
        answered.set()
        c.free_buffer(buf.buffer_id)


def test_concurrent_registrations_cannot_overshoot_the_quota(a: Admin) -> None:
    c = a.client
    held = 2  # the module fixture's wait_for_flag and fill
    calls = [
        c.stub.RegisterCallable.future(
            pb.RegisterCallableRequest(import_path=f"{EXAMPLES}:empty", kind=pb.CALLABLE_KIND_SUB),
            timeout=60,
        )
        for _ in range(8)
    ]
    done: list[str] = []
    refused: list[str] = []
    for call in calls:
        try:
            done.append(call.result().hashid)
        except grpc.RpcError as exc:
            assert exc.code() == Code.RESOURCE_EXHAUSTED, exc.details()
            refused.append(exc.details() or "")
    try:
        assert len(done) == QUOTAS["per_client_registrations"] - held, (done, refused)
        assert all("limits.per_client_registrations" in r for r in refused)
    finally:
        for hashid in done:
            c.unregister(hashid)
