"""Every refusal of the daemon has a precise status and names the field; it keeps serving.

Most cases share one module daemon (a table of malformed and oversized requests);
the TCP/TLS/token, drain and double-SIGINT cases start their own.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from simpler_daemon.client import Client, make_args, sub_task, tensor
from simpler_daemon.errors import RunCancelled
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.testing import self_signed_cert
from tests.support.daemon_harness import (
    EXAMPLES,
    REPO,
    DaemonProcess,
    merged,
    module_daemon,
    module_leak_guard,
    running_daemon,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.timeout(60)

Code = grpc.StatusCode
LIMITS = {"limits": {"max_concurrent_runs": 3}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "errors", LIMITS)


@pytest.fixture(autouse=True)
def no_leaked_children(daemon: DaemonProcess) -> Iterator[None]:
    """Overrides the conftest guard: the module daemon lives across tests on purpose."""
    yield from module_leak_guard(lambda: {daemon.pid})


@dataclass
class Ctx:
    client: Client
    stub: Any
    fill: str
    wait: str
    buf: int  # 8 x float32
    gen: int
    run_id: int  # a finished run


@pytest.fixture(scope="module")
def ctx(daemon: DaemonProcess) -> Iterator[Ctx]:
    # gRPC: these tests mix the raw stub with the client's calls and rely on their order
    # on one channel (a stream cancelled, then a new one); the fast path is another socket.
    with daemon.client(transport="grpc") as c:
        alloc = c.alloc_buffer((8,), "float32", label="errors")
        fill = c.register(f"{EXAMPLES}:fill")
        run_id = c.submit(
            [sub_task(fill, [tensor(alloc.buffer_id, "output", (8,), "float32")], [0])]
        )
        c.wait(run_id, timeout=10)
        wait_h = c.register(f"{EXAMPLES}:wait_for_flag")
        yield Ctx(c, c.stub, fill, wait_h, alloc.buffer_id, alloc.generation, run_id)


def _ref(buf: int, **kw: Any) -> pb.TensorRef:
    fields: dict[str, Any] = {
        "buffer_id": buf,
        "shape": [8],
        "dtype": "float32",
        "tag": pb.TAG_OUTPUT,
    }
    fields.update(kw)
    return pb.TensorRef(**fields)


def _submit(c: Ctx, *tasks: pb.Task) -> Any:
    return c.stub.SubmitRun(pb.SubmitRunRequest(tasks=list(tasks)), timeout=10)


def _sub(c: Ctx, *refs: pb.TensorRef, scalars: list[int] | None = None, **kw: Any) -> pb.Task:
    members = kw.pop("members", None) or [pb.Args(tensors=list(refs), scalars=scalars or [1])]
    return pb.Task(
        kind=kw.pop("kind", pb.TASK_KIND_SUB),
        hashid=kw.pop("hashid", c.fill),
        members=members,
        **kw,
    )


def _write(c: Ctx, *messages: pb.WriteBufferRequest) -> Any:
    return c.stub.WriteBuffer(iter(messages), timeout=10)


def _read(c: Ctx, **kw: Any) -> bytes:
    return b"".join(r.data for r in c.stub.ReadBuffer(pb.ReadBufferRequest(**kw), timeout=10))


def _first_event(c: Ctx, run_id: int) -> Any:
    return next(iter(c.stub.WatchRun(pb.WatchRunRequest(run_id=run_id), timeout=10)))


def _target(buf: int, offset: int = 0) -> pb.WriteBufferRequest:
    return pb.WriteBufferRequest(target=pb.WriteBufferTarget(buffer_id=buf, offset=offset))


def _data(n: int) -> pb.WriteBufferRequest:
    return pb.WriteBufferRequest(data=b"\0" * n)


# (id, request, status, text the message must contain)
CASES: list[tuple[str, Callable[[Ctx], Any], grpc.StatusCode, str]] = [
    ("no tasks", lambda c: _submit(c), Code.INVALID_ARGUMENT, "tasks: a run needs at least one"),
    (
        "too many tasks",
        lambda c: _submit(c, *[_sub(c, _ref(c.buf))] * 1001),
        Code.RESOURCE_EXHAUSTED,
        "tasks: 1001 tasks, limits.max_tasks_per_run = 1000",
    ),
    (
        "kind unspecified",
        lambda c: _submit(c, _sub(c, _ref(c.buf)), _sub(c, kind=0)),
        Code.INVALID_ARGUMENT,
        "tasks[1].kind: required",
    ),
    (
        "bad hashid",
        lambda c: _submit(c, _sub(c, hashid="sha256:xyz")),
        Code.INVALID_ARGUMENT,
        "tasks[0].hashid: hashid 'sha256:xyz' is not",
    ),
    (
        "unknown hashid",
        lambda c: _submit(c, _sub(c, hashid="sha256:" + "ab" * 32)),
        Code.NOT_FOUND,
        "tasks[0].hashid: callable sha256:abab",
    ),
    (
        "two members for SUB",
        lambda c: _submit(c, _sub(c, members=[pb.Args(), pb.Args()])),
        Code.INVALID_ARGUMENT,
        "tasks[0].members: a SUB task has exactly one member",
    ),
    (
        "workers on SUB",
        lambda c: _submit(c, _sub(c, _ref(c.buf), workers=[0])),
        Code.INVALID_ARGUMENT,
        "tasks[0].workers: must be empty",
    ),
    (
        "SUB callable as NEXT_LEVEL",
        lambda c: _submit(c, _sub(c, _ref(c.buf), kind=pb.TASK_KIND_NEXT_LEVEL, workers=[0])),
        Code.INVALID_ARGUMENT,
        "tasks[0].hashid: simpler_daemon.examples.tasks:fill is registered as sub",
    ),
    (
        "unknown buffer",
        lambda c: _submit(c, _sub(c, _ref(c.buf)), _sub(c, _ref(c.buf), _ref(99999))),
        Code.NOT_FOUND,
        "tasks[1].members[0].tensors[1].buffer_id: buffer 99999 is not allocated",
    ),
    (
        "stale generation",
        lambda c: _submit(c, _sub(c, _ref(c.buf, generation=c.gen + 1000))),
        Code.NOT_FOUND,
        "tasks[0].members[0].tensors[0].generation",
    ),
    (
        "bad dtype",
        lambda c: _submit(c, _sub(c, _ref(c.buf, dtype="f33"))),
        Code.INVALID_ARGUMENT,
        "tasks[0].members[0].tensors[0].dtype: unknown or unsupported dtype 'f33'",
    ),
    (
        "tag unspecified",
        lambda c: _submit(c, _sub(c, _ref(c.buf, tag=0))),
        Code.INVALID_ARGUMENT,
        "tasks[0].members[0].tensors[0].tag: required",
    ),
    (
        "view overruns",
        lambda c: _submit(c, _sub(c, _ref(c.buf, shape=[9]))),
        Code.INVALID_ARGUMENT,
        "tasks[0].members[0].tensors[0].shape: the view reaches bytes [0, 36)",
    ),
    (
        "offset overruns",
        lambda c: _submit(c, _sub(c, _ref(c.buf, shape=[2], byte_offset=28))),
        Code.INVALID_ARGUMENT,
        "overruns buffer",
    ),
    (
        "huge shape",
        lambda c: _submit(c, _sub(c, _ref(c.buf, shape=[1 << 62, 1 << 62]))),
        Code.INVALID_ARGUMENT,
        "tasks[0].members[0].tensors[0]",
    ),
    (
        "strides mismatch",
        lambda c: _submit(c, _sub(c, _ref(c.buf, strides=[4, 4]))),
        Code.INVALID_ARGUMENT,
        "tasks[0].members[0].tensors[0].strides: 2 strides for 1 dimensions",
    ),
    (
        "too many tensors",
        lambda c: _submit(c, _sub(c, *[_ref(c.buf, tag=pb.TAG_INPUT)] * 9)),
        Code.RESOURCE_EXHAUSTED,
        "tasks[0].members[0].tensors: 9 tensors, limits.max_tensors_per_task = 8",
    ),
    (
        "too many scalars",
        lambda c: _submit(c, _sub(c, _ref(c.buf), scalars=[1] * 9)),
        Code.RESOURCE_EXHAUSTED,
        "tasks[0].members[0].scalars: 9 scalars",
    ),
    (
        "output prefix too long",
        lambda c: _submit(c, _sub(c, _ref(c.buf), config=pb.CallConfig(output_prefix="x" * 1025))),
        Code.INVALID_ARGUMENT,
        "tasks[0].config.output_prefix: 1025 bytes",
    ),
    (
        "message too large",
        lambda c: _write(c, _target(c.buf), _data(2 << 20)),
        Code.RESOURCE_EXHAUSTED,
        "",
    ),
    (
        "write without target",
        lambda c: _write(c, _data(4)),
        Code.INVALID_ARGUMENT,
        "target: the first WriteBuffer message must carry the target",
    ),
    (
        "write overruns",
        lambda c: _write(c, _target(c.buf, 16), _data(20)),
        Code.INVALID_ARGUMENT,
        "data: writing 20 bytes at offset 16 overruns buffer",
    ),
    (
        "write offset past end",
        lambda c: _write(c, _target(c.buf, 33)),
        Code.INVALID_ARGUMENT,
        "target.offset",
    ),
    (
        "write unknown buffer",
        lambda c: _write(c, _target(424242), _data(1)),
        Code.NOT_FOUND,
        "target.buffer_id: buffer 424242 is not allocated",
    ),
    (
        "read unknown buffer",
        lambda c: _read(c, buffer_id=424242),
        Code.NOT_FOUND,
        "buffer_id: buffer 424242 is not allocated",
    ),
    (
        "read past end",
        lambda c: _read(c, buffer_id=c.buf, offset=8, length=32),
        Code.INVALID_ARGUMENT,
        "length: [8, 40) overruns buffer",
    ),
    (
        "free unknown buffer",
        lambda c: c.stub.FreeBuffer(pb.FreeBufferRequest(buffer_id=424242)),
        Code.NOT_FOUND,
        "buffer_id",
    ),
    (
        "alloc without dtype",
        lambda c: c.stub.AllocBuffer(pb.AllocBufferRequest(shape=[4])),
        Code.INVALID_ARGUMENT,
        "dtype: required",
    ),
    (
        "alloc object dtype",
        lambda c: c.stub.AllocBuffer(pb.AllocBufferRequest(shape=[4], dtype="object")),
        Code.INVALID_ARGUMENT,
        "dtype: unknown or unsupported dtype 'object'",
    ),
    (
        "alloc too big",
        lambda c: c.stub.AllocBuffer(pb.AllocBufferRequest(shape=[3 << 20], dtype="float32")),
        Code.RESOURCE_EXHAUSTED,
        "shape: 12582912 bytes, limits.max_buffer_bytes = 8388608",
    ),
    (
        "wait unknown run",
        lambda c: c.stub.WaitRun(pb.WaitRunRequest(run_id=987654)),
        Code.NOT_FOUND,
        "run_id: run 987654 is unknown",
    ),
    (
        "wait run 0",
        lambda c: c.stub.WaitRun(pb.WaitRunRequest(run_id=0)),
        Code.INVALID_ARGUMENT,
        "run_id: required",
    ),
    (
        "wait negative timeout",
        lambda c: c.stub.WaitRun(pb.WaitRunRequest(run_id=c.run_id, timeout_seconds=-1)),
        Code.INVALID_ARGUMENT,
        "timeout_seconds: must be >= 0, got -1.0",
    ),
    (
        "submit negative wait",
        lambda c: c.stub.SubmitRun(pb.SubmitRunRequest(wait_seconds=-0.5)),
        Code.INVALID_ARGUMENT,
        "wait_seconds: must be >= 0, got -0.5",
    ),
    (
        "cancel reason too long",
        lambda c: c.stub.CancelRun(pb.CancelRunRequest(run_id=c.run_id, reason="r" * 300)),
        Code.INVALID_ARGUMENT,
        "reason: 300 characters",
    ),
    (
        "idempotency key too long",
        lambda c: c.stub.SubmitRun(pb.SubmitRunRequest(idempotency_key="k" * 300)),
        Code.INVALID_ARGUMENT,
        "idempotency_key: 300 characters",
    ),
    (
        "cancel unknown run",
        lambda c: c.stub.CancelRun(pb.CancelRunRequest(run_id=987654)),
        Code.NOT_FOUND,
        "run_id: run 987654 is unknown",
    ),
    ("watch unknown run", lambda c: _first_event(c, 987654), Code.NOT_FOUND, "run_id"),
    (
        "register os:system",
        lambda c: c.client.register_callable("os:system"),
        Code.PERMISSION_DENIED,
        "import_path: module 'os' is not under callables.allowed_modules",
    ),
    (
        "register malformed path",
        lambda c: c.client.register_callable("no_colon"),
        Code.INVALID_ARGUMENT,
        "import_path: import path 'no_colon' must be 'module:qualname'",
    ),
    (
        "register missing function",
        lambda c: c.client.register_callable(f"{EXAMPLES}:nope"),
        Code.INVALID_ARGUMENT,
        "import_path: REGISTER_FAILED: cannot register simpler_daemon.examples.tasks:nope: "
        "failed on every worker",
    ),
    (
        "register without kind",
        lambda c: c.client.register_callable(f"{EXAMPLES}:fill", "?"),
        Code.INVALID_ARGUMENT,
        "kind: required",
    ),
    (
        "register with workers at L3",
        lambda c: c.client.register_callable(f"{EXAMPLES}:fill", "sub", [0]),
        Code.INVALID_ARGUMENT,
        "workers: only a level-4 daemon",
    ),
    (
        "register missing orchestration",
        lambda c: c.client.register_callable(f"{EXAMPLES}:missing", "orchestration"),
        Code.INVALID_ARGUMENT,
        "import_path: cannot import simpler_daemon.examples.tasks:missing",
    ),
    (
        "unregister unknown",
        lambda c: c.client.unregister("sha256:" + "cd" * 32),
        Code.NOT_FOUND,
        "hashid: callable sha256:cdcd",
    ),
    (
        "unregister malformed",
        lambda c: c.client.unregister("sha1:00"),
        Code.INVALID_ARGUMENT,
        "hashid",
    ),
    (
        "orchestration of a SUB callable",
        lambda c: c.client.run_orchestration(c.fill),
        Code.INVALID_ARGUMENT,
        "hashid: simpler_daemon.examples.tasks:fill is registered as sub",
    ),
    (
        "remote worker on a level-3 daemon",
        lambda c: c.client.add_remote_worker("127.0.0.1:19073"),
        Code.FAILED_PRECONDITION,
        "cannot add a remote worker: this daemon is level 3",
    ),
    (
        "drain negative grace",
        lambda c: c.client.drain(grace=-1),
        Code.INVALID_ARGUMENT,
        "grace_seconds: must be >= 0",
    ),
]


@pytest.mark.parametrize(("case", "call", "code", "text"), CASES, ids=[c[0] for c in CASES])
def test_refused_with_precise_status(
    ctx: Ctx, case: str, call: Callable[[Ctx], Any], code: grpc.StatusCode, text: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call(ctx)
    assert info.value.code() == code, info.value.details()
    assert text in (info.value.details() or ""), info.value.details()
    # ... and the daemon keeps serving.
    assert ctx.client.get_info().serving_state == pb.SERVING_STATE_SERVING


def test_heap_exhaustion_is_resource_exhausted(ctx: Ctx) -> None:
    c = ctx.client
    held = []
    try:
        with pytest.raises(grpc.RpcError) as info:
            for _ in range(4):  # 4 x 7 MiB > the 16 MiB heap
                held.append(c.alloc_buffer((7 << 20,), "uint8").buffer_id)
        assert info.value.code() == Code.RESOURCE_EXHAUSTED
        assert "shape: cannot allocate 7340032 bytes on the shared heap" in info.value.details()
    finally:
        for b in held:
            c.free_buffer(b)
    c.free_buffer(c.alloc_buffer((7 << 20,), "uint8").buffer_id)  # the memory came back


def test_freed_buffer_is_gone(ctx: Ctx) -> None:
    c = ctx.client
    alloc = c.alloc_buffer((4,), "int32")
    assert c.free_buffer(alloc.buffer_id) is False
    for call in (
        lambda: c.free_buffer(alloc.buffer_id),
        lambda: c.read_buffer(alloc.buffer_id),
        lambda: c.submit([sub_task(ctx.fill, [tensor(alloc.buffer_id, "output", (4,), "int32")])]),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == Code.NOT_FOUND


def _gated_run(c: Client, wait_h: str, **kw: Any) -> tuple[int, int]:
    """A run whose first task holds a SUB worker until the flag buffer is written."""
    flag = c.alloc_buffer((2,), "uint8").buffer_id
    run_id = c.submit([sub_task(wait_h, [tensor(flag, "inout", (2,), "uint8")], [20_000])], **kw)
    return run_id, flag


def test_client_disconnect_mid_stream(daemon: DaemonProcess, ctx: Ctx) -> None:
    c = ctx.client
    run_id, flag = _gated_run(c, ctx.wait)
    watcher = daemon.client(client_id="watcher")
    events = watcher.watch(run_id)
    assert next(events).type == pb.RUN_EVENT_TYPE_SNAPSHOT
    watcher.close()  # the client goes away mid-stream: the server side is cancelled

    # The daemon keeps serving, the run is unaffected, and the stream's slot was
    # released: the same client identity can open its full quota again.
    assert c.get_info().active_runs >= 1
    stub = c.stub
    md = (("x-simpler-client", "watcher"),)

    def open_streams() -> list[Any]:
        calls = []
        try:
            for _ in range(4):  # limits.max_streams_per_client
                call = stub.WatchRun(pb.WatchRunRequest(run_id=run_id), metadata=md)
                next(call)
                calls.append(call)
        except grpc.RpcError as exc:
            assert exc.code() == Code.RESOURCE_EXHAUSTED
            for call in calls:
                call.cancel()
            return []
        return calls

    calls = wait_until(open_streams, message="the cancelled stream was never released")
    with pytest.raises(grpc.RpcError) as info:
        next(stub.WatchRun(pb.WatchRunRequest(run_id=run_id), metadata=md))
    assert info.value.code() == Code.RESOURCE_EXHAUSTED
    assert "limits.max_streams_per_client = 4" in info.value.details()
    for call in calls:
        call.cancel()
    c.write_buffer(flag, b"\x01")
    c.wait(run_id, timeout=20)
    assert c.read_array(flag, (2,), "uint8").tolist() == [1, 1]


def test_two_clients_submit_concurrently(daemon: DaemonProcess, ctx: Ctx) -> None:
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def client_loop(value: int) -> None:
        try:
            with daemon.client() as c:
                buf = c.alloc_buffer((16,), "int64").buffer_id
                ids = []
                for i in range(8):
                    ref = tensor(buf, "output", (16,), "int64")
                    run_id = c.submit([sub_task(ctx.fill, [ref], [value * 100 + i])])
                    c.wait(run_id, timeout=20)
                    assert c.read_array(buf, (16,), "int64").tolist() == [value * 100 + i] * 16
                    ids.append(run_id)
                results[value] = ids
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=client_loop, args=(v,)) for v in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert not errors, errors
    assert len(results) == 2
    all_ids = results[1] + results[2]
    assert len(set(all_ids)) == 16


def test_idempotent_resubmit(ctx: Ctx) -> None:
    c = ctx.client
    task = sub_task(ctx.fill, [tensor(ctx.buf, "output", (8,), "float32")], [2])
    first = c.submit_run([task], idempotency_key="errors-key-1")
    again = c.submit_run([task], idempotency_key="errors-key-1")
    assert not first.deduplicated and again.deduplicated
    assert again.run_id == first.run_id
    other = c.submit_run([task], idempotency_key="errors-key-2")
    assert other.run_id != first.run_id and not other.deduplicated
    for run_id in (first.run_id, other.run_id):
        c.wait(run_id, timeout=10)


def test_cancel_and_concurrent_run_limit(daemon: DaemonProcess, ctx: Ctx) -> None:
    c = ctx.client
    run_id, flag = _gated_run(c, ctx.wait)
    # Gated too: under fair admission runs do not queue behind one another.
    queued = [
        c.submit([sub_task(ctx.wait, [tensor(flag, "inout", (2,), "uint8")], [20_000])])
        for i in range(2)
    ]
    bare = Client(daemon.socket, retry=None)  # the default client retries this refusal
    with bare, pytest.raises(grpc.RpcError) as info:  # limits.max_concurrent_runs = 3
        bare.submit([sub_task(ctx.fill, [tensor(ctx.buf, "output", (8,), "float32")], [9])])
    assert info.value.code() == Code.RESOURCE_EXHAUSTED
    assert "limits.max_concurrent_runs = 3" in info.value.details()
    assert info.value.retry_after is not None  # worth retrying later: a hint says when

    cancelled = c.cancel(queued[1], reason="not needed")
    assert not cancelled.already_finished
    watch = c.watch(run_id)
    assert next(watch).type == pb.RUN_EVENT_TYPE_SNAPSHOT
    c.cancel(run_id, reason="test")  # its running task finishes, the run ends CANCELLED
    c.write_buffer(flag, b"\x01")
    assert list(watch)[-1].state == pb.RUN_STATE_CANCELLED
    with pytest.raises(RunCancelled) as err:
        c.wait(run_id, timeout=10)
    assert err.value.outcome == "CANCELLED"
    c.wait(queued[0], timeout=10)
    status = c.wait_run(queued[1], 10)
    assert status.state == pb.RUN_STATE_CANCELLED and "not needed" in status.error.message
    again = c.cancel(run_id)
    assert again.already_finished and again.state == pb.RUN_STATE_CANCELLED


# --------------------------------------------------------------------------- own daemons


def test_tcp_without_tls_is_refused_at_start(tmp_path: Path) -> None:
    sections = merged({"grpc": {"tcp_listen": "127.0.0.1:0"}})
    sections["daemon"]["runtime_dir"] = str(tmp_path / "run")
    config = write_config(tmp_path / "tcp.toml", sections)
    for argv in (["serve", "--config", str(config)], ["check-config", str(config)]):
        proc = subprocess.run(
            [sys.executable, "-m", "simpler_daemon.server.main", *argv],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 2, proc.stderr
        assert "grpc.tcp_listen requires grpc.tls_cert and grpc.tls_key" in proc.stderr


def test_command_line_of_the_daemon(tmp_path: Path) -> None:
    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "simpler_daemon.server.main", *argv],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )

    version = run("--version")
    assert version.returncode == 0 and version.stdout.startswith("simpler-daemon 0.")
    sections = merged()
    sections["daemon"]["runtime_dir"] = str(tmp_path / "run")
    good = write_config(tmp_path / "good.toml", sections)
    assert run("check-config", str(good)).returncode == 0
    sections["limits"]["max_tensors_per_task"] = 1000
    too_many = write_config(tmp_path / "too_many.toml", sections)
    checked = run("check-config", str(too_many))
    assert checked.returncode == 2
    assert "limits.max_tensors_per_task: 1000 tensors do not fit" in checked.stderr
    bad_set = run("serve", "--config", str(good), "--set", "workers.num_sub_workers=-1")
    assert bad_set.returncode == 2 and "workers.num_sub_workers" in bad_set.stderr
    assert run("serve", "--set", "nonsense").returncode == 2
    # A start-up failure (the socket path is taken by a regular file) exits with 3.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "daemon.sock").write_text("not a socket")
    failed = run("serve", "--config", str(good))
    assert failed.returncode == 3, failed.stderr
    assert "it exists and is not a socket" in failed.stderr


def _self_signed(directory: Path) -> tuple[Path, Path]:
    pair = self_signed_cert(directory)
    if pair is None:
        pytest.skip("the openssl CLI is not available")
    return pair


def test_tcp_requires_the_bearer_token(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789\n")
    token.chmod(0o600)
    overrides = {
        "grpc": {
            "tcp_listen": "127.0.0.1:0",
            "tls_cert": str(cert),
            "tls_key": str(key),
            "token_file": str(token),
        }
    }
    with running_daemon(tmp_path / "tcp", overrides) as d:
        line = next(x for x in d.stdout().splitlines() if "listening on tcp" in x)
        address = line.split("listening on tcp ", 1)[1].split()[0]

        def tcp(tok: str | None) -> Client:
            return Client(
                address, token=tok, root_certificates=str(cert), server_name="localhost", timeout=10
            )

        for tok, text in ((None, "missing bearer token"), ("wrong", "wrong bearer token")):
            with tcp(tok) as c, pytest.raises(grpc.RpcError) as info:
                c.get_info()
            assert info.value.code() == Code.UNAUTHENTICATED, info.value.details()
            assert text in info.value.details()
            with tcp(tok) as c, pytest.raises(grpc.RpcError) as info:
                list(c.watch(1))
            assert info.value.code() == Code.UNAUTHENTICATED
        with tcp("s3cret-token-0123456789") as c:
            assert c.get_info().pid == d.pid
            fill = c.register(f"{EXAMPLES}:fill")
            buf = c.alloc_array(np.zeros(4, dtype=np.int32))
            c.wait(c.submit([sub_task(fill, [tensor(buf, "output", (4,), "int32")], [6])]), 10)
            assert c.read_array(buf, (4,), "int32").tolist() == [6] * 4
        # Health checks need no token; the local socket needs none either.
        with tcp(None) as c:
            reply = health_pb2_grpc.HealthStub(c.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with d.client() as c:
            assert c.get_info().pid == d.pid


def test_drain_refuses_new_runs_then_shuts_down(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "drain")
    try:
        d.start()
        with d.client() as c:
            wait_h = c.register(f"{EXAMPLES}:wait_for_flag")
            fill = c.register(f"{EXAMPLES}:fill")
            run_id, flag = _gated_run(c, wait_h)
            watch = c.watch(run_id)
            next(watch)
            drained = c.drain(grace=0.2)
            assert (drained.runs_finished, drained.runs_cancelled) == (0, 1)
            assert c.get_info().serving_state == pb.SERVING_STATE_DRAINING
            health = health_pb2_grpc.HealthStub(c.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as info:
                c.submit([sub_task(fill, [tensor(flag, "output", (2,), "uint8")], [1])])
            assert info.value.code() == Code.FAILED_PRECONDITION
            assert "draining" in info.value.details()
            c.write_buffer(flag, b"\x01")  # the running task finishes; the run stays cancelled
            assert list(watch)[-1].state == pb.RUN_STATE_CANCELLED
            assert c.drain(grace=1, shutdown=True).runs_cancelled == 0
        assert d.wait(30) == 0, d.stderr()
        assert d.notify.seen("STOPPING", "1")
        d.children_gone()
    finally:
        d.kill()


def test_second_sigint_exits_at_once(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "sigint", {"daemon": {"shutdown_grace": 30.0}})
    try:
        d.start()
        with d.client() as c:
            _gated_run(c, c.register(f"{EXAMPLES}:wait_for_flag"))
            wait_until(lambda: any(w.state == pb.WORKER_STATE_BUSY for w in c.list_workers()))
        d.send(signal.SIGINT)
        wait_until(lambda: d.notify.seen("STOPPING", "1"), message="no STOPPING=1 after SIGINT")
        assert d.proc is not None and d.proc.poll() is None  # waiting out the 30 s grace
        t0 = time.monotonic()
        d.send(signal.SIGINT)
        code = d.wait(5)
        assert time.monotonic() - t0 < 3
        assert code == 130, d.stderr()
        assert "second SIGINT" in d.stderr()
        d.children_gone(5)
        assert not Path(d.socket).exists()
    finally:
        d.kill()


def test_daemon_still_serves_after_everything(ctx: Ctx) -> None:
    c = ctx.client
    run_id = c.submit([sub_task(ctx.fill, [tensor(ctx.buf, "output", (8,), "float32")], [5])])
    c.wait(run_id, timeout=10)
    assert c.read_array(ctx.buf, (8,), "float32").tolist() == [5.0] * 8
    assert make_args().ByteSize() == 0
