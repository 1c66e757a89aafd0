"""The remote L3 session runner, driven as its parent would: a real subprocess, raw sockets.

Each test spawns ``python -m simpler_daemon.remote_worker.session --spec F --ready-fd N``,
reads the ready line, attaches both lanes with the 40 attach bytes and speaks
frames through the wire codec. The runner's inner children are recorded while it
lives and must all be gone once it exited. ``SessionControls`` is also unit
tested on a Worker that was never initialised (its heap exists before init).
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import secrets
import select
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from simpler_daemon.callables import spec_for_import
from simpler_daemon.engine.worker import Worker
from simpler_daemon.remote.wire import (
    E_BAD_ARGS,
    E_CONTROL_FAILED,
    E_DEADLINE,
    E_OK,
    E_TASK_FAILED,
    E_UNKNOWN_CALLABLE,
    E_UNKNOWN_CONTROL,
    AllocBody,
    AllocResult,
    BufferKey,
    Completion,
    Control,
    ControlReply,
    CopyFrom,
    CopyTo,
    Frame,
    FrameDecoder,
    FrameType,
    HashidBody,
    Hello,
    ImportBody,
    InlineTensor,
    RegisterPrepare,
    RemoteTensor,
    Task,
    WireConfig,
    decode_payload,
    encode_frame,
    encode_payload,
)
from simpler_daemon.remote_worker.controls import BadTaskArgs, ControlFailure, SessionControls
from simpler_daemon.remote_worker.launch import same_host
from simpler_daemon.remote_worker.session import parent_on_this_host
from simpler_daemon.testing import child_pids, descendants, poll_for, self_signed_cert

pytestmark = pytest.mark.timeout(60)

REPO = str(Path(__file__).resolve().parents[2])
WID = 2


def hashid(target: str, kind: str = "sub") -> str:
    return spec_for_import(target, kind).handle.hashid  # type: ignore[arg-type]


def digest(target: str) -> bytes:
    return spec_for_import(target, "orchestration").handle.digest


def callables(*items: tuple[str, str]) -> list[dict[str, str]]:
    return [{"hashid": hashid(t, k), "kind": k, "target": t} for k, t in items]


DEFAULT_CALLABLES = (
    ("sub", "tests.support.sub_tasks:fill"),
    ("sub", "tests.support.sub_tasks:consume"),
    ("sub", "tests.support.sub_tasks:fail"),
    ("orchestration", "tests.support.l3_jobs:fill_remote"),
    ("orchestration", "tests.support.l3_jobs:consume_remote"),
    ("orchestration", "tests.support.l3_jobs:fail_remote"),
    ("orchestration", "tests.support.l3_jobs:block_remote"),
    ("sub", "tests.support.sub_tasks:sleep_ms"),
    ("orchestration", "tests.support.l3_jobs:sleep_sub_remote"),
)


_PARENT_SCRIPT = """
import subprocess, sys
w = int(sys.argv[-1])
p = subprocess.Popen(sys.argv[1:], pass_fds=(w,))
print(p.pid, flush=True)
p.wait()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class Runner:
    """One runner subprocess and the parent's side of its two lanes."""

    def __init__(
        self,
        tmp: Path,
        *,
        items: tuple[tuple[str, str], ...] = DEFAULT_CALLABLES,
        allowed: tuple[str, ...] = ("tests.",),
        num_sub_workers: int = 1,
        budget_s: float = 30.0,
        extra_callables: list[dict[str, str]] | None = None,
        tls: dict[str, str | None] | None = None,
        client_tls: ssl.SSLContext | None = None,
        via_parent: bool = False,
        parent_on_this_host: bool = False,
    ) -> None:
        self.client_tls = client_tls
        self.session_id = secrets.randbits(63) + 1
        self.key = secrets.token_bytes(32)
        manifest = {
            "session_id": self.session_id,
            "attach_key": self.key.hex(),
            "worker_id": WID,
            "parent_level": 4,
            "remote_level": 3,
            "num_sub_workers": num_sub_workers,
            "heap_bytes": 4 << 20,
            "callables": callables(*items) + (extra_callables or []),
            "session_timeout_s": 10.0,
            "startup_budget_s": budget_s,
        }
        spec = {
            "manifest": manifest,
            "listen_host": "127.0.0.1",
            "deadline_unix": time.time() + budget_s,
            "allowed_modules": list(allowed),
            "python_path": [REPO],
            "tls": tls,
            "parent_on_this_host": parent_on_this_host,
        }
        self.spec_path = tmp / f"spec-{self.session_id}.json"
        self.spec_path.write_text(json.dumps(spec))
        self.stderr_path = tmp / f"stderr-{self.session_id}.txt"
        r, w = os.pipe()
        cmd = [
            sys.executable,
            "-m",
            "simpler_daemon.remote_worker.session",
            "--spec",
            str(self.spec_path),
            "--ready-fd",
            str(w),
        ]
        if via_parent:
            # A stand-in for simpler-remote-worker that the test can kill.
            cmd = [sys.executable, "-c", _PARENT_SCRIPT, *cmd]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                pass_fds=(w,),
                start_new_session=True,
                stderr=err,
                stdout=subprocess.PIPE if via_parent else None,
                cwd=REPO,
            )
        self.pid = self.proc.pid
        if via_parent:
            assert self.proc.stdout is not None
            self.pid = int(self.proc.stdout.readline())
        os.close(w)
        self.ready = self._read_ready(r)
        self.command: socket.socket | None = None
        self.health: socket.socket | None = None
        self.seq = 0
        self.decoder = FrameDecoder(session_id=self.session_id, worker_id=WID)
        self.frames: list[Frame] = []
        self.health_times: list[float] = []
        self.health_seqs: list[int] = []
        self._health_thread: threading.Thread | None = None
        self.inner_pids: set[int] = set()

    def _read_ready(self, fd: int) -> dict[str, Any]:
        data = b""
        deadline = time.monotonic() + 30
        try:
            while not data.endswith(b"\n"):
                left = deadline - time.monotonic()
                assert left > 0, f"no ready line within 30 s; stderr: {self.stderr()}"
                if not select.select([fd], [], [], left)[0]:
                    continue
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(fd)
        assert data, f"ready fd closed without a line; stderr: {self.stderr()}"
        out: dict[str, Any] = json.loads(data)
        return out

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    @staticmethod
    def _addr(text: str) -> tuple[str, int]:
        host, _, port = text.rpartition(":")
        return host, int(port)

    def connect(self, lane: str, key: bytes | None = None) -> socket.socket:
        sock = socket.create_connection(self._addr(self.ready[lane]), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.client_tls is not None:
            sock = self.client_tls.wrap_socket(sock, server_hostname="127.0.0.1")
        sock.sendall(self.session_id.to_bytes(8, "little") + (key or self.key))
        return sock

    def attach(self) -> Hello:
        self.command = self.connect("command")
        self.health = self.connect("health")
        hello = self.read_frame()
        assert hello.type is FrameType.HELLO and hello.sequence == 0
        assert isinstance(hello.payload, Hello)
        assert hello.payload.ready and hello.payload.pid == self.pid
        self._health_thread = threading.Thread(target=self._read_health, daemon=True)
        self._health_thread.start()
        self.inner_pids = child_pids(self.pid)
        assert self.inner_pids, "the runner has no inner children"
        return hello.payload

    def _read_health(self) -> None:
        dec = FrameDecoder(session_id=self.session_id, worker_id=WID)
        sock = self.health
        assert sock is not None
        while True:
            try:
                # Blocking with a timeout: the test may close the socket under this thread.
                sock.settimeout(1.0)
                data = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            for f in dec.feed(data):
                assert f.type is FrameType.HEALTH
                self.health_times.append(time.monotonic())
                self.health_seqs.append(f.sequence)

    def read_frame(self, timeout: float = 20.0) -> Frame:
        sock = self.command
        assert sock is not None
        deadline = time.monotonic() + timeout
        while not self.frames:
            left = deadline - time.monotonic()
            assert left > 0, f"no frame within {timeout} s; stderr: {self.stderr()}"
            sock.settimeout(left)
            data = sock.recv(1 << 20)
            assert data, f"command connection closed; stderr: {self.stderr()}"
            self.frames.extend(self.decoder.feed(data))
        return self.frames.pop(0)

    def send(self, ftype: FrameType, payload: Any = None) -> int:
        assert self.command is not None
        self.seq += 1
        self.command.sendall(encode_frame(ftype, self.session_id, WID, self.seq, payload))
        return self.seq

    def control(self, name: str, body: Any = None, version: int = 1) -> ControlReply:
        raw = b"" if body is None else encode_payload(body)
        seq = self.send(FrameType.CONTROL, Control(name=name, version=version, body=raw))
        f = self.read_frame()
        assert f.type is FrameType.CONTROL_REPLY and f.sequence == seq
        assert isinstance(f.payload, ControlReply)
        return f.payload

    def ok(self, name: str, body: Any = None) -> bytes:
        reply = self.control(name, body)
        assert reply.error_code == E_OK, reply.error_text
        return reply.result

    def alloc(self, shape: list[int], dtype: str) -> AllocResult:
        return decode_payload(AllocResult, self.ok("alloc", AllocBody(shape=shape, dtype=dtype)))

    def task(
        self,
        target: str | bytes,
        tensors: list[RemoteTensor | InlineTensor] | None = None,
        scalars: list[int] | None = None,
        config: WireConfig | None = None,
    ) -> Completion:
        d = target if isinstance(target, bytes) else digest(target)
        t = Task(
            digest=d, config=config or WireConfig(), tensors=tensors or [], scalars=scalars or []
        )
        seq = self.send(FrameType.TASK, t)
        f = self.read_frame()
        assert f.type is FrameType.COMPLETION and f.sequence == seq
        assert isinstance(f.payload, Completion)
        return f.payload

    def wait_exit(self, timeout: float = 20.0) -> int:
        code = self.proc.wait(timeout)
        poll_for(
            lambda: not any(_alive(p) for p in self.inner_pids),
            timeout=10,
            message=f"inner children {self.inner_pids} outlived the runner",
        )
        return code

    def close(self) -> None:
        for s in (self.command, self.health):
            if s is not None:
                s.close()
        if self.pid != self.proc.pid and _alive(self.pid):
            os.kill(self.pid, signal.SIGKILL)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self._health_thread is not None:
            self._health_thread.join(5)
        for pid in self.inner_pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def tensor(buf: AllocResult, shape: list[int], dtype: str, tag: int = 2, **kw: Any) -> RemoteTensor:
    itemsize = np.dtype(dtype).itemsize
    strides = kw.pop("strides", None)
    if strides is None:
        strides, acc = [], itemsize
        for d in reversed(shape):
            strides.insert(0, acc)
            acc *= d
    return RemoteTensor(
        owner=kw.pop("owner", WID),
        buffer_id=buf.buffer_id,
        generation=kw.pop("generation", buf.generation),
        byte_offset=kw.pop("byte_offset", 0),
        nbytes=buf.nbytes,
        dtype=dtype,
        shape=shape,
        strides=strides,
        tag=tag,
    )


@pytest.fixture
def runners(tmp_path: Path) -> Iterator[list[Runner]]:
    made: list[Runner] = []
    yield made
    for r in made:
        r.close()


@pytest.fixture
def runner(tmp_path: Path, runners: list[Runner]) -> Runner:
    r = Runner(tmp_path)
    runners.append(r)
    assert r.ready["ok"], r.ready
    r.attach()
    return r


# -- tasks ---------------------------------------------------------------------------------------


def test_task_writes_remote_buffer(runner: Runner) -> None:
    buf = runner.alloc([16], "int64")
    assert buf.nbytes == 128
    runner.ok(
        "copy_to",
        CopyTo(
            buffer_id=buf.buffer_id,
            generation=buf.generation,
            offset=0,
            data=np.arange(16, dtype=np.int64).tobytes(),
        ),
    )
    done = runner.task(
        "tests.support.l3_jobs:fill_remote", [tensor(buf, [8], "int64", byte_offset=64)], [7]
    )
    assert done.error_code == E_OK, done.error_text
    raw = runner.ok(
        "copy_from",
        CopyFrom(buffer_id=buf.buffer_id, generation=buf.generation, offset=0, nbytes=128),
    )
    out = np.frombuffer(raw, dtype=np.int64)
    assert out[:8].tolist() == list(range(8)) and out[8:].tolist() == [7] * 8

    # An inline input and a strided remote output (every other element).
    src = np.arange(4, dtype=np.int64)
    inline = InlineTensor(data=src.tobytes(), dtype="int64", shape=[4], tag=1)
    out_t = tensor(buf, [4], "int64", strides=[16])
    done = runner.task("tests.support.l3_jobs:consume_remote", [inline, out_t], [100])
    assert done.error_code == E_OK, done.error_text
    raw = runner.ok(
        "copy_from",
        CopyFrom(buffer_id=buf.buffer_id, generation=buf.generation, offset=0, nbytes=64),
    )
    assert np.frombuffer(raw, dtype=np.int64)[::2].tolist() == [100, 101, 102, 103]

    stats = msgspec.msgpack.decode(runner.ok("stats"))
    assert stats["tasks"] == 2 and stats["buffers"] == 1 and stats["worker_id"] == WID
    runner.ok("free", BufferKey(owner=WID, buffer_id=buf.buffer_id, generation=buf.generation))
    reply = runner.control(
        "copy_from",
        CopyFrom(buffer_id=buf.buffer_id, generation=buf.generation, offset=0, nbytes=8),
    )
    assert reply.error_code == E_CONTROL_FAILED and "not allocated" in reply.error_text


def test_the_runner_and_its_children_are_named_in_ps(runner: Runner) -> None:
    def title(pid: int) -> str:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()

    expected = f"simpler-remote-l3-session: session {runner.session_id}"
    assert title(runner.pid) == expected
    children = [title(p) for p in descendants(runner.pid)]
    assert f"{expected}: sub worker 0" in children, children


def test_failing_sub_task_carries_traceback(runner: Runner) -> None:
    done = runner.task("tests.support.l3_jobs:fail_remote", scalars=[42])
    assert done.error_code == E_TASK_FAILED
    h = hashid("tests.support.l3_jobs:fail_remote")
    assert done.error_text.startswith(f"remote worker {WID} (host ")
    assert f"hashid={h}, sequence=1" in done.error_text
    assert "producer exploded on purpose (42)" in done.error_text
    assert "Traceback (most recent call last)" in done.traceback
    assert "tests/support/sub_tasks.py" in done.traceback and "ValueError" in done.traceback
    # The session goes on.
    buf = runner.alloc([2], "int32")
    assert (
        runner.task(
            "tests.support.l3_jobs:fill_remote", [tensor(buf, [2], "int32")], [3]
        ).error_code
        == E_OK
    )


def test_unknown_digest_and_bad_args(runner: Runner) -> None:
    done = runner.task(b"\x01" * 32)
    assert done.error_code == E_UNKNOWN_CALLABLE
    assert done.error_text == (
        f"callable hash sha256:{'01' * 32} not registered on worker {WID} "
        f"(host {socket.gethostname()})"
    )
    buf = runner.alloc([4], "float32")
    bad = tensor(buf, [4], "float32", generation=buf.generation + 9)
    done = runner.task("tests.support.l3_jobs:fill_remote", [bad], [1])
    assert done.error_code == E_BAD_ARGS
    assert f"tensor 0 (owner {WID}, buffer {buf.buffer_id}" in done.error_text
    assert "stale generation" in done.error_text
    over = tensor(buf, [4], "float32", byte_offset=4)
    done = runner.task("tests.support.l3_jobs:fill_remote", [over], [1])
    assert done.error_code == E_BAD_ARGS and "outside" in done.error_text
    foreign = tensor(buf, [4], "float32", owner=WID + 1)
    done = runner.task("tests.support.l3_jobs:fill_remote", [foreign], [1])
    assert done.error_code == E_BAD_ARGS and "not imported" in done.error_text
    assert (
        runner.task(
            "tests.support.l3_jobs:fill_remote", [tensor(buf, [4], "float32")], [1]
        ).error_code
        == E_OK
    )


def test_control_errors_and_registration(runner: Runner) -> None:
    reply = runner.control("no_such_control")
    assert reply.error_code == E_UNKNOWN_CONTROL and reply.name == "no_such_control"
    reply = runner.control("stats", version=7)
    assert reply.error_code == E_CONTROL_FAILED and "version 7" in reply.error_text
    reply = runner.control("alloc", HashidBody(hashid="x"))
    assert reply.error_code == E_CONTROL_FAILED
    assert reply.error_text.startswith("cannot alloc: malformed body")
    reply = runner.control("copy_to", CopyTo(buffer_id=999, generation=1, offset=0, data=b"x"))
    assert reply.error_code == E_CONTROL_FAILED
    assert reply.error_text.startswith("cannot copy_to buffer 999")
    buf = runner.alloc([2], "uint8")
    reply = runner.control(
        "copy_to", CopyTo(buffer_id=buf.buffer_id, generation=buf.generation, offset=1, data=b"abc")
    )
    assert reply.error_code == E_CONTROL_FAILED and "overrun" in reply.error_text

    # Not allowed, and a wrong hashid: both refused in prepare.
    target = "simpler_daemon.examples.tasks:fill"
    reply = runner.control(
        "register_prepare", RegisterPrepare(hashid=hashid(target), kind="sub", target=target)
    )
    assert reply.error_code == E_CONTROL_FAILED and "not allowed" in reply.error_text
    reply = runner.control(
        "register_prepare",
        RegisterPrepare(
            hashid=hashid("tests.support.sub_tasks:noop"),
            kind="sub",
            target="tests.support.sub_tasks:add_one",
        ),
    )
    assert reply.error_code == E_CONTROL_FAILED and "does not match" in reply.error_text

    # Two-phase: an orchestration resolves only after commit, and not after unregister.
    orch = "tests.support.l3_jobs:raise_remote"
    h = hashid(orch, "orchestration")
    runner.ok("register_prepare", RegisterPrepare(hashid=h, kind="orchestration", target=orch))
    assert runner.task(orch).error_code == E_UNKNOWN_CALLABLE
    runner.ok("register_commit", HashidBody(hashid=h))
    done = runner.task(orch)
    assert done.error_code == E_TASK_FAILED
    assert "RuntimeError: orchestration refused on purpose" in done.error_text
    assert "raise_remote" in done.traceback
    runner.ok("unregister", HashidBody(hashid=h))
    assert runner.task(orch).error_code == E_UNKNOWN_CALLABLE
    reply = runner.control("unregister", HashidBody(hashid=h))
    assert reply.error_code == E_CONTROL_FAILED and "not registered" in reply.error_text

    # A SUB callable prepared (registered on the inner children), aborted, then committed.
    sub = "tests.support.sub_tasks:add_one"
    hs = hashid(sub)
    runner.ok("register_prepare", RegisterPrepare(hashid=hs, kind="sub", target=sub))
    runner.ok("register_abort", HashidBody(hashid=hs))
    reply = runner.control("register_commit", HashidBody(hashid=hs))
    assert reply.error_code == E_CONTROL_FAILED and "not prepared" in reply.error_text
    runner.ok("register_prepare", RegisterPrepare(hashid=hs, kind="sub", target=sub))
    runner.ok("register_commit", HashidBody(hashid=hs))
    runner.ok("unregister", HashidBody(hashid=hs))

    # Imports: chunked snapshot of another worker's buffer, usable as a task input.
    data = np.arange(6, dtype=np.int32)
    key = {"owner": WID + 1, "buffer_id": 5, "generation": 3}
    runner.ok(
        "import",
        ImportBody(**key, dtype="int32", shape=[6], offset=0, data=data[:3].tobytes(), final=False),
    )
    out = runner.alloc([6], "int32")
    src = RemoteTensor(
        **key, byte_offset=0, nbytes=24, dtype="int32", shape=[6], strides=[4], tag=1
    )
    done = runner.task(
        "tests.support.l3_jobs:consume_remote", [src, tensor(out, [6], "int32")], [1]
    )
    assert done.error_code == E_BAD_ARGS and "not complete" in done.error_text
    runner.ok(
        "import",
        ImportBody(**key, dtype="int32", shape=[6], offset=12, data=data[3:].tobytes(), final=True),
    )
    done = runner.task(
        "tests.support.l3_jobs:consume_remote", [src, tensor(out, [6], "int32")], [1]
    )
    assert done.error_code == E_OK, done.error_text
    raw = runner.ok(
        "copy_from",
        CopyFrom(buffer_id=out.buffer_id, generation=out.generation, offset=0, nbytes=24),
    )
    assert np.frombuffer(raw, dtype=np.int32).tolist() == [1, 2, 3, 4, 5, 6]
    runner.ok("release", BufferKey(**key))
    reply = runner.control("release", BufferKey(**key))
    assert reply.error_code == E_CONTROL_FAILED and "not imported" in reply.error_text


def test_task_deadline(runner: Runner) -> None:
    start = time.monotonic()
    done = runner.task(
        "tests.support.l3_jobs:sleep_sub_remote", scalars=[1500], config=WireConfig(deadline_ms=200)
    )
    assert done.error_code == E_DEADLINE
    assert "deadline exceeded (200 ms); the run was stopped" in done.error_text
    # Answered within the runner's stop bound, far inside the parent's grace of 2 s.
    assert time.monotonic() - start < 1.5 + 10
    assert runner.task("tests.support.l3_jobs:sleep_sub_remote", scalars=[1]).error_code == E_OK


def test_requests_sent_back_to_back_are_answered_in_order(runner: Runner) -> None:
    """The parent may write a TASK and what follows it at once: the runner answers the
    TASK from its run's end (a done callback, no coroutine waiting), then the next ones,
    in order, each after the side effects of the one before."""
    buf = runner.alloc([4], "int64")
    fill = Task(
        digest=digest("tests.support.l3_jobs:fill_remote"),
        config=WireConfig(),
        tensors=[tensor(buf, [4], "int64")],
        scalars=[5],
    )
    slow = Task(
        digest=digest("tests.support.l3_jobs:sleep_sub_remote"),
        config=WireConfig(),
        tensors=[],
        scalars=[100],
    )
    raw = CopyFrom(buffer_id=buf.buffer_id, generation=buf.generation, offset=0, nbytes=32)
    read = Control(name="copy_from", version=1, body=encode_payload(raw))
    seqs = [
        runner.send(FrameType.TASK, slow),
        runner.send(FrameType.TASK, fill),
        runner.send(FrameType.CONTROL, read),
        runner.send(FrameType.TASK, slow),
    ]
    frames = [runner.read_frame() for _ in seqs]
    assert [(f.type, f.sequence) for f in frames] == [
        (FrameType.COMPLETION, seqs[0]),
        (FrameType.COMPLETION, seqs[1]),
        (FrameType.CONTROL_REPLY, seqs[2]),
        (FrameType.COMPLETION, seqs[3]),
    ]
    for f in frames[:2] + frames[3:]:
        assert isinstance(f.payload, Completion) and f.payload.error_code == E_OK, f.payload
    reply = frames[2].payload
    assert isinstance(reply, ControlReply) and reply.error_code == E_OK, reply
    assert np.frombuffer(reply.result, dtype=np.int64).tolist() == [5] * 4


def test_a_run_that_fails_after_a_deadline_config_was_cached(runner: Runner) -> None:
    """One CallConfig per wire config is kept: a deadline still applies to the second
    task that carries it, and a failure after a success is still reported."""
    config = WireConfig(deadline_ms=5000)
    first = runner.task("tests.support.l3_jobs:sleep_sub_remote", scalars=[1], config=config)
    assert first.error_code == E_OK, first
    failed = runner.task("tests.support.l3_jobs:fail_remote", config=config)
    assert failed.error_code == E_TASK_FAILED, failed
    late = runner.task(
        "tests.support.l3_jobs:sleep_sub_remote", scalars=[3000], config=WireConfig(deadline_ms=200)
    )
    assert late.error_code == E_DEADLINE and "deadline exceeded (200 ms)" in late.error_text, late
    again = runner.task(
        "tests.support.l3_jobs:sleep_sub_remote", scalars=[3000], config=WireConfig(deadline_ms=200)
    )
    assert again.error_code == E_DEADLINE, again
    assert runner.task("tests.support.l3_jobs:sleep_sub_remote", scalars=[1]).error_code == E_OK


class _Transport:
    def __init__(self, peer: tuple[Any, ...] | None, local: tuple[Any, ...] | None) -> None:
        self.extra = {"peername": peer, "sockname": local}

    def get_extra_info(self, name: str) -> Any:
        return self.extra[name]


class _Proto:
    def __init__(self, peer: tuple[Any, ...] | None, local: tuple[Any, ...] | None) -> None:
        self.transport = _Transport(peer, local)


def test_the_inner_children_spin_only_for_a_parent_on_another_host(
    tmp_path: Path, runners: list[Runner]
) -> None:
    """A parent on this host shares its CPUs with the inner children: they do not spin
    for a next task (the spin would hold the CPU the parent needs for the reply)."""
    default = inspect.signature(Worker).parameters["child_spin_ns"].default
    assert default > 0
    for local, spin in ((False, default), (True, 0)):
        runner = Runner(tmp_path, parent_on_this_host=local)
        runners.append(runner)
        assert runner.ready["ok"], runner.ready
        runner.attach()
        done = runner.task("tests.support.l3_jobs:sleep_sub_remote", scalars=[1])
        assert done.error_code == E_OK, done
        stats = msgspec.msgpack.decode(runner.ok("stats"))
        assert stats["child_spin_ns"] == spin, stats


@pytest.mark.parametrize(
    ("peer", "local", "expected"),
    [
        (("127.0.0.1", 5000), ("127.0.0.1", 19000), True),
        (("127.8.9.10", 5000), ("127.0.0.1", 19000), True),
        (("::1", 5000, 0, 0), ("::1", 19000, 0, 0), True),
        (("::ffff:127.0.0.1", 5000, 0, 0), ("::ffff:127.0.0.1", 19000, 0, 0), True),
        (("10.0.0.2", 5000), ("10.0.0.2", 19000), True),
        (("10.0.0.1", 5000), ("10.0.0.2", 19000), False),
        (("fd00::1", 5000, 0, 0), ("fd00::2", 19000, 0, 0), False),
        (None, ("10.0.0.2", 19000), False),
    ],
)
def test_the_runner_lingers_only_for_a_parent_on_another_host(
    peer: tuple[Any, ...] | None, local: tuple[Any, ...] | None, expected: bool
) -> None:
    assert parent_on_this_host(_Proto(peer, local)) is expected  # type: ignore[arg-type]
    assert parent_on_this_host(None) is False
    # The worker's test of the handshake connection (it tells the runner the result).
    assert same_host(peer, local) is expected


def test_health_beats_while_orchestration_blocks_the_loop(runner: Runner) -> None:
    poll_for(lambda: len(runner.health_times) >= 2, timeout=5)
    start = time.monotonic()
    done = runner.task("tests.support.l3_jobs:block_remote", scalars=[2000])
    end = time.monotonic()
    assert done.error_code == E_OK and end - start >= 2.0
    poll_for(lambda: runner.health_times[-1] > end, timeout=5)
    during = [t for t in runner.health_times if start <= t <= end]
    assert len(during) >= 6, f"only {len(during)} HEALTH frames during a 2 s block"
    times = [t for t in runner.health_times if start - 0.5 <= t <= end + 0.5]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) < 0.8, gaps
    assert runner.health_seqs == list(range(1, len(runner.health_seqs) + 1))


# -- lifecycle -----------------------------------------------------------------------------------


def test_tls_lanes(tmp_path: Path, runners: list[Runner]) -> None:
    pair = self_signed_cert(tmp_path)
    if pair is None:
        pytest.skip("the openssl CLI is not available")
    cert, key = pair
    ctx = ssl.create_default_context(cafile=str(cert))
    r = Runner(
        tmp_path,
        tls={"cert_file": str(cert), "key_file": str(key), "client_ca_file": None},
        client_tls=ctx,
    )
    runners.append(r)
    assert r.ready["ok"], r.ready
    r.attach()
    buf = r.alloc([3], "int16")
    assert (
        r.task("tests.support.l3_jobs:fill_remote", [tensor(buf, [3], "int16")], [9]).error_code
        == 0
    )
    raw = r.ok(
        "copy_from",
        CopyFrom(buffer_id=buf.buffer_id, generation=buf.generation, offset=0, nbytes=6),
    )
    assert np.frombuffer(raw, dtype=np.int16).tolist() == [9, 9, 9]
    poll_for(lambda: len(r.health_seqs) >= 2, timeout=5)
    r.send(FrameType.SHUTDOWN)
    assert r.wait_exit() == 0


def test_wrong_attach_key_rejected_then_right_key_attaches(
    tmp_path: Path, runners: list[Runner]
) -> None:
    r = Runner(tmp_path)
    runners.append(r)
    bad = r.connect("command", key=b"\x00" * 32)
    bad.settimeout(10)
    try:
        assert bad.recv(100) == b""
    except ConnectionResetError:
        pass
    bad.close()
    bad_h = r.connect("health", key=b"\x00" * 32)
    bad_h.settimeout(10)
    try:
        assert bad_h.recv(100) == b""
    except ConnectionResetError:
        pass
    bad_h.close()
    r.attach()
    buf = r.alloc([1], "int8")
    assert (
        r.task("tests.support.l3_jobs:fill_remote", [tensor(buf, [1], "int8")], [1]).error_code == 0
    )


@pytest.mark.parametrize("with_tls", [False, True], ids=["tcp", "tls"])
def test_silent_health_connections_during_attach_do_not_stall_it(
    tmp_path: Path, runners: list[Runner], with_tls: bool
) -> None:
    # Checked one at a time, 12 silent candidates held the health lane for 2 s each,
    # past the 15 s attach deadline.
    tls: dict[str, str | None] | None = None
    ctx: ssl.SSLContext | None = None
    if with_tls:
        pair = self_signed_cert(tmp_path)
        if pair is None:
            pytest.skip("the openssl CLI is not available")
        cert, key = pair
        tls = {"cert_file": str(cert), "key_file": str(key), "client_ca_file": None}
        ctx = ssl.create_default_context(cafile=str(cert))
    r = Runner(tmp_path, budget_s=15.0, tls=tls, client_tls=ctx)
    runners.append(r)
    assert r.ready["ok"], r.ready
    silent = [socket.create_connection(r._addr(r.ready["health"]), timeout=10) for _ in range(12)]
    try:
        if ctx is not None:
            # Half of them finish TLS, then say nothing; the rest never start it.
            for i, s in enumerate(silent[:6]):
                silent[i] = ctx.wrap_socket(s, server_hostname="127.0.0.1")
        r.attach()
        poll_for(lambda: len(r.health_seqs) >= 2, timeout=10)
        buf = r.alloc([1], "int8")
        assert (
            r.task("tests.support.l3_jobs:fill_remote", [tensor(buf, [1], "int8")], [5]).error_code
            == 0
        )
    finally:
        for s in silent:
            s.close()
    r.send(FrameType.SHUTDOWN)
    assert r.wait_exit() == 0


def test_silent_command_connections_are_dropped_before_the_attach(
    tmp_path: Path, runners: list[Runner]
) -> None:
    r = Runner(tmp_path)
    runners.append(r)
    assert r.ready["ok"], r.ready
    silent = [socket.create_connection(r._addr(r.ready["command"]), timeout=10) for _ in range(5)]
    try:
        # Each is closed once its time to present the attach bytes is up, long before
        # the 30 s attach deadline: they hold no slot (or descriptor) while the runner waits.
        for s in silent:
            s.settimeout(15)
            try:
                assert s.recv(100) == b""
            except ConnectionResetError:
                pass
        assert "command lane: dropped a candidate: no attach bytes in time" in r.stderr()
        r.attach()
        buf = r.alloc([1], "int8")
        assert (
            r.task("tests.support.l3_jobs:fill_remote", [tensor(buf, [1], "int8")], [3]).error_code
            == 0
        )
    finally:
        for s in silent:
            s.close()
    r.send(FrameType.SHUTDOWN)
    assert r.wait_exit() == 0


def test_command_eof_ends_session(runner: Runner) -> None:
    assert runner.command is not None
    runner.command.close()
    runner.command = None
    assert runner.wait_exit() == 0
    assert "command connection closed" in runner.stderr()


def test_shutdown_frame_ends_session(runner: Runner) -> None:
    runner.send(FrameType.SHUTDOWN)
    assert runner.wait_exit() == 0


def test_sigterm_ends_session(runner: Runner) -> None:
    runner.proc.send_signal(signal.SIGTERM)
    assert runner.wait_exit() == 0


def test_parent_death_ends_session(tmp_path: Path, runners: list[Runner]) -> None:
    r = Runner(tmp_path, via_parent=True)
    runners.append(r)
    assert r.ready["ok"], r.ready
    r.attach()
    assert r.pid != r.proc.pid
    r.proc.kill()
    r.proc.wait(10)
    poll_for(lambda: not _alive(r.pid), timeout=20, message="runner outlived its parent")
    poll_for(
        lambda: not any(_alive(p) for p in r.inner_pids),
        timeout=10,
        message=f"inner children {r.inner_pids} outlived the runner",
    )


def test_bad_sequence_is_a_protocol_error(runner: Runner) -> None:
    runner.seq = 5
    runner.send(FrameType.CONTROL, Control(name="stats"))
    assert runner.wait_exit() == 1
    assert "expected 1" in runner.stderr()


def test_health_close_ends_session(runner: Runner) -> None:
    assert runner.health is not None
    runner.health.shutdown(socket.SHUT_RDWR)
    runner.health.close()
    runner.health = None
    assert runner.wait_exit() == 1
    assert "health send failed" in runner.stderr()


@pytest.mark.slow
def test_attach_deadline_missed(tmp_path: Path, runners: list[Runner]) -> None:
    r = Runner(tmp_path, budget_s=4.0)
    runners.append(r)
    assert r.ready["ok"]
    r.inner_pids = child_pids(r.pid)
    r.command = r.connect("command")  # only one lane: never ready
    assert r.wait_exit(20) == 1
    assert "attach deadline missed: no health lane attached" in r.stderr()


@pytest.mark.parametrize(
    ("kwargs", "expect"),
    [
        ({"allowed": ("simpler_daemon.",)}, "callables[0] (sub 'tests.support.sub_tasks:fill')"),
        ({"allowed": ()}, "is not allowed"),
        (
            {
                "extra_callables": [
                    {
                        "hashid": hashid("tests.support.sub_tasks:noop"),
                        "kind": "sub",
                        "target": "tests.support.sub_tasks:add_one",
                    }
                ]
            },
            "does not match target 'tests.support.sub_tasks:add_one'",
        ),
        (
            {
                "items": (),
                "extra_callables": [
                    {"hashid": hashid("tests.nope:f"), "kind": "sub", "target": "tests.nope:f"}
                ],
            },
            "cannot be imported",
        ),
    ],
)
def test_bring_up_failure_reports_ready_false(
    tmp_path: Path, runners: list[Runner], kwargs: dict[str, Any], expect: str
) -> None:
    r = Runner(tmp_path, **kwargs)
    runners.append(r)
    assert r.ready["ok"] is False
    assert r.ready["error"].startswith("cannot start session: ")
    assert expect in r.ready["error"]
    assert r.wait_exit() == 1


# -- SessionControls without sockets --------------------------------------------------------------


@pytest.fixture
def controls() -> Iterator[SessionControls]:
    inner = Worker(level=3, num_sub_workers=1, heap_bytes=1 << 20)
    try:
        yield SessionControls(inner, worker_id=0, host="h", allowed_modules=("tests.",))
    finally:
        inner.close()


def test_views_respect_offset_strides_and_bounds(controls: SessionControls) -> None:
    res = controls.alloc(AllocBody(shape=[4, 4], dtype="float64"))
    controls.copy_to(
        CopyTo(
            buffer_id=res.buffer_id,
            generation=res.generation,
            offset=0,
            data=np.arange(16, dtype=np.float64).tobytes(),
        )
    )
    buf = AllocResult(buffer_id=res.buffer_id, generation=res.generation, nbytes=res.nbytes)
    col = tensor(buf, [4], "float64", owner=0, byte_offset=8, strides=[32])
    args = controls.task_args([col], [1, 2**64 - 1])
    assert args.tensors[0].tolist() == [1.0, 5.0, 9.0, 13.0]
    assert args.scalars == [1, 2**64 - 1]
    # The view is on the inner heap: the orchestrator can describe it.
    desc = controls.inner.heap.describe(args.tensors[0])
    assert desc.buffer_id == res.buffer_id and desc.byte_offset == 8
    rev = tensor(buf, [4], "float64", owner=0, byte_offset=120, strides=[-32])
    assert controls.task_args([rev], []).tensors[0].tolist() == [15.0, 11.0, 7.0, 3.0]
    with pytest.raises(BadTaskArgs, match="outside"):
        controls.task_args([tensor(buf, [4], "float64", owner=0, byte_offset=8, strides=[40])], [])
    with pytest.raises(BadTaskArgs, match="outside"):
        controls.task_args([tensor(buf, [2], "float64", owner=0, byte_offset=0, strides=[-8])], [])
    with pytest.raises(BadTaskArgs, match="4 bytes of data"):
        controls.task_args([InlineTensor(data=b"1234", dtype="int64", shape=[1], tag=1)], [])
    free_before = controls.inner.heap.free_bytes()
    controls.task_args([InlineTensor(data=b"\0" * 8, dtype="int64", shape=[1], tag=1)], [])
    controls.task_done()
    assert controls.inner.heap.free_bytes() == free_before


@pytest.mark.asyncio
async def test_controls_unit(controls: SessionControls) -> None:
    with pytest.raises(ControlFailure) as info:
        await controls.handle(
            "import",
            1,
            encode_payload(
                ImportBody(
                    owner=0,
                    buffer_id=1,
                    generation=1,
                    dtype="int8",
                    shape=[1],
                    offset=0,
                    data=b"x",
                    final=True,
                )
            ),
        )
    assert info.value.code == E_CONTROL_FAILED and "this worker owns it" in info.value.text
    with pytest.raises(ControlFailure) as info:
        await controls.handle(
            "free", 1, encode_payload(BufferKey(owner=3, buffer_id=1, generation=1))
        )
    assert "owned by worker 3" in info.value.text
    res = decode_payload(
        AllocResult,
        await controls.handle("alloc", 1, encode_payload(AllocBody(shape=[3], dtype="uint8"))),
    )
    with pytest.raises(ControlFailure, match="stale"):
        await controls.handle(
            "free",
            1,
            encode_payload(
                BufferKey(owner=0, buffer_id=res.buffer_id, generation=res.generation + 1)
            ),
        )
    await controls.handle(
        "free",
        1,
        encode_payload(BufferKey(owner=0, buffer_id=res.buffer_id, generation=res.generation)),
    )
    assert controls.own == {}
    with pytest.raises(ControlFailure) as info:
        await controls.handle(
            "register_prepare",
            1,
            encode_payload(
                RegisterPrepare(
                    hashid=hashid("os:getpid"), kind="orchestration", target="os:getpid"
                )
            ),
        )
    assert "not allowed" in info.value.text
