"""Client retries: capped exponential backoff with full jitter, for calls safe to repeat.

Unit tests drive ``RetryPolicy`` with an injected random source, clock and sleep.
Integration tests use real processes: a client process started before its daemon
waits for it (UNAVAILABLE, retried); a client survives a daemon restart; a submit
whose reply is lost (a relay in front of the fast socket drops it) is retried with
its generated idempotency key and answered with the run it started, not a second
one; a submit refused because the client's run queue is full is retried after the
daemon's hint until the queue has room.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from simpler_daemon.client import Client, RetryPolicy, RunPhase, sub_task, tensor
from simpler_daemon.client.errors import (
    FailedPrecondition,
    ResourceExhausted,
    Unavailable,
)
from simpler_daemon.client.retry import new_key, safe_to_repeat
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol.metadata import RETRY_AFTER_METADATA
from tests.support.daemon_harness import REPO, DaemonProcess, running_daemon, wait_until

EXAMPLES = "simpler_daemon.examples.tasks"
Code = grpc.StatusCode


class FakeTime:
    """A clock that only moves when the policy sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _policy(t: FakeTime, rand: Callable[[], float], **kw: Any) -> RetryPolicy:
    return RetryPolicy(rand=rand, clock=t.clock, sleep=t.sleep, **kw)


def _failing(errors: list[Exception], result: str = "ok") -> Callable[[], str]:
    """An attempt that raises ``errors`` one per call, then returns ``result``."""
    pending = list(errors)

    def attempt() -> str:
        if pending:
            raise pending.pop(0)
        return result

    return attempt


def _unavailable() -> Unavailable:
    return Unavailable(Code.UNAVAILABLE, "cannot connect")


# --------------------------------------------------------------------------- the schedule


def test_backoff_doubles_up_to_the_cap_with_full_jitter() -> None:
    t = FakeTime()
    top = _policy(t, lambda: 1.0, base=0.1, cap=1.0)
    assert [top.backoff(n) for n in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert top.backoff(10_000) == 1.0  # no overflow far out
    bottom = _policy(t, lambda: 0.0, base=0.1, cap=1.0)
    assert [bottom.backoff(n) for n in range(4)] == [0.0] * 4
    half = _policy(t, lambda: 0.5, base=0.1, cap=1.0)
    assert half.backoff(3) == pytest.approx(0.4)
    # With the daemon's hint: never earlier than it, the jitter on top.
    assert half.backoff(0, 0.25) == pytest.approx(0.3)
    assert bottom.backoff(5, 0.25) == 0.25


def test_jitter_stays_within_its_bounds_with_a_real_random_source() -> None:
    import random

    source = random.Random(1234)
    policy = RetryPolicy(base=0.05, cap=0.4, rand=source.random)
    for n in range(12):
        ceiling = min(0.4, 0.05 * 2**n)
        delays = [policy.backoff(n) for _ in range(200)]
        assert all(0.0 <= d <= ceiling for d in delays)
        assert max(delays) > ceiling / 2  # spread, not a constant


def test_retries_until_success_sleeping_the_schedule() -> None:
    t = FakeTime()
    policy = _policy(t, lambda: 1.0, base=0.1, cap=0.5, total=30.0)
    assert policy.call(_failing([_unavailable()] * 4)) == "ok"
    assert t.sleeps == [0.1, 0.2, 0.4, 0.5]


def test_gives_up_with_the_last_error_once_total_would_pass() -> None:
    t = FakeTime()
    policy = _policy(t, lambda: 1.0, base=1.0, cap=1.0, total=3.5)
    errors = [Unavailable(Code.UNAVAILABLE, f"try {i}") for i in range(10)]
    with pytest.raises(Unavailable, match="try 3"):
        policy.call(_failing(errors))
    assert t.sleeps == [1.0, 1.0, 1.0]  # a fourth sleep would end past 3.5 s
    assert t.now - 100.0 <= 3.5


def test_resource_exhausted_is_retried_only_with_a_hint_and_after_it() -> None:
    t = FakeTime()
    policy = _policy(t, lambda: 0.0, base=0.1, cap=1.0)
    hinted = ResourceExhausted(
        Code.RESOURCE_EXHAUSTED,
        "cannot submit a run: queue full (limits.per_client_queued_runs = 3)",
        trailing_metadata=((RETRY_AFTER_METADATA, "750"),),
    )
    texted = ResourceExhausted(Code.RESOURCE_EXHAUSTED, "...: retry after 40 ms")
    assert hinted.retry_after == 0.75 and texted.retry_after == 0.04
    assert policy.call(_failing([hinted, texted])) == "ok"
    assert t.sleeps == [0.75, 0.04]
    final = ResourceExhausted(Code.RESOURCE_EXHAUSTED, "shape: 9 bytes, limits.max_buffer_bytes")
    assert final.retry_after is None
    with pytest.raises(ResourceExhausted):
        policy.call(_failing([final]))
    with pytest.raises(FailedPrecondition):
        policy.call(_failing([FailedPrecondition(Code.FAILED_PRECONDITION, "draining")]))
    assert t.sleeps == [0.75, 0.04]  # neither was retried


@pytest.mark.asyncio
async def test_the_async_form_follows_the_same_schedule() -> None:
    t = FakeTime()
    policy = _policy(t, lambda: 1.0, base=0.001, cap=0.004, total=1.0)
    calls = []

    async def attempt() -> int:
        calls.append(1)
        if len(calls) < 4:
            raise _unavailable()
        return len(calls)

    assert await policy.call_async(attempt) == 4


def test_only_calls_safe_to_repeat_are_retried() -> None:
    for method in ("GetInfo", "ListRuns", "ListBuffers", "WaitRun", "ReadBuffer"):
        assert safe_to_repeat(method, None)
    keyed = pb.SubmitRunRequest(idempotency_key=new_key())
    assert safe_to_repeat("SubmitRun", keyed)
    assert not safe_to_repeat("SubmitRun", pb.SubmitRunRequest())
    assert safe_to_repeat("RunOrchestration", pb.RunOrchestrationRequest(idempotency_key="k"))
    for method in ("FreeBuffer", "CancelRun", "WriteBuffer", "AllocBuffer", "Drain"):
        assert not safe_to_repeat(method, pb.FreeBufferRequest())
    with pytest.raises(ValueError, match="total must be >= 0"):
        RetryPolicy(total=-1.0)
    with pytest.raises(TypeError, match="retry must be a RetryPolicy"):
        Client("/nonexistent-dir-for-retry/daemon.sock", retry=30.0)  # type: ignore[arg-type]


def test_generated_keys_are_unique_across_calls_and_processes() -> None:
    keys = {new_key() for _ in range(1000)}
    assert len(keys) == 1000
    other = subprocess.run(
        [sys.executable, "-c", "from simpler_daemon.client.retry import new_key; print(new_key())"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert other.startswith("auto-") and other not in keys
    assert other.rsplit("-", 1)[0] != next(iter(keys)).rsplit("-", 1)[0]  # its own prefix


# --------------------------------------------------------------------------- real daemons

_CLIENT = textwrap.dedent(
    """
    import sys
    from simpler_daemon.client import Client, RetryPolicy
    from simpler_daemon.client.errors import Unavailable

    socket_path, transport = sys.argv[1], sys.argv[2]
    try:
        Client(socket_path, transport="grpc", retry=None).get_info()
        print("up already", flush=True)
    except Unavailable:
        print("down", flush=True)
    with Client(socket_path, transport=transport, retry=RetryPolicy(total=120.0)) as c:
        print("pid", c.get_info().pid, flush=True)
        for line in sys.stdin:  # "again": call once more (the daemon restarts meanwhile)
            print("calling", flush=True)
            print("pid", c.get_info().pid, flush=True)
    """
)


class ClientProcess:
    """A client in its own process, answering "pid N" once per call it made."""

    def __init__(self, socket_path: str, transport: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, socket_path, transport],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def again(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("again\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            if self.proc.stdout is not None:
                self.proc.stdout.close()


@pytest.mark.timeout(240)
def test_a_client_started_before_its_daemon_waits_for_it(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path / "d")
    client = ClientProcess(daemon.socket, "grpc")
    try:
        assert client.line() == "down"  # it found nobody there, and retries now
        daemon.start()
        assert client.line() == f"pid {daemon.pid}"
        client.close()
        assert client.proc.returncode == 0
        assert daemon.stop() == 0
        daemon.children_gone()
    finally:
        client.close()
        daemon.kill()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["grpc", "fast"])
def test_a_client_rides_out_a_daemon_restart(tmp_path: Path, transport: str) -> None:
    first = DaemonProcess(tmp_path / "d").start()
    client = None
    try:
        client = ClientProcess(first.socket, transport)
        assert client.line() == "up already"
        assert client.line() == f"pid {first.pid}"
        assert first.stop() == 0
        first.children_gone()
        client.again()  # the daemon is down now: the call is retried until it is back
        assert client.line() == "calling"
        with running_daemon(tmp_path / "d") as second:
            assert client.line() == f"pid {second.pid}"
            client.close()
            assert client.proc.returncode == 0
    finally:
        if client is not None:
            client.close()
        first.kill()


class DropFirstReply:
    """A relay in front of a daemon's fast socket (at ``<dir>/daemon.fast.sock``, beside
    a ``daemon.sock`` target) that, once armed, cuts the connection as the daemon's
    next reply arrives instead of passing it on: the client's call lost its answer."""

    def __init__(self, directory: Path, upstream: str) -> None:
        directory.mkdir(mode=0o700)
        self.target = str(directory / "daemon.sock")
        self.upstream = upstream
        self.armed = threading.Event()
        self.dropped = threading.Event()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(directory / "daemon.fast.sock"))
        self.listener.listen(16)
        self.threads: list[threading.Thread] = []
        self.sockets: list[socket.socket] = []
        self._spawn(self._accept)

    def _spawn(self, fn: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=fn, args=args, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            up.connect(self.upstream)
            self.sockets += [down, up]
            self._spawn(self._pipe, down, up, False)
            self._spawn(self._pipe, up, down, True)

    def _pipe(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while data := src.recv(65536):
                if replies and self.armed.is_set():
                    self.armed.clear()
                    self.dropped.set()
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self.threads:
            thread.join(10)
        for s in self.sockets:
            s.close()


@pytest.fixture
def daemon_with_queue(tmp_path: Path) -> Iterator[DaemonProcess]:
    limits = {"per_client_runs": 1, "per_client_queued_runs": 1}
    with running_daemon(tmp_path / "q", {"limits": limits}) as daemon:
        yield daemon


@pytest.mark.timeout(180)
def test_a_submit_whose_reply_was_lost_is_deduplicated_by_its_key(
    daemon_with_queue: DaemonProcess, tmp_path: Path
) -> None:
    fast_socket = str(Path(daemon_with_queue.socket).with_name("daemon.fast.sock"))
    relay = DropFirstReply(tmp_path / "relay", fast_socket)
    try:
        with Client(relay.target, transport="fast", timeout=60) as c:
            fill = c.register(f"{EXAMPLES}:fill")
            out = int(c.alloc_buffer((4,), "float32").buffer_id)
            task = sub_task(fill, [tensor(out, "output", (4,), "float32")], [6])
            relay.armed.set()
            future = c.submit([task], label="once")
            assert relay.dropped.is_set()  # the first reply never reached the client
            assert future.deduplicated  # the retry found the run the lost reply named
            assert future.result(timeout=60).state is RunPhase.COMPLETED
            assert [r.run_id for r in c.list_runs() if r.label == "once"] == [int(future)]
            assert c.read_array(out, (4,), "float32").tolist() == [6.0] * 4
            # Without retries the same loss is the caller's to handle.
            bare = Client(relay.target, transport="fast", timeout=60, retry=None)
            with bare:
                relay.armed.set()
                with pytest.raises(Unavailable):
                    bare.submit([task], label="bare")
            c.free_buffer(out)
    finally:
        relay.close()


@pytest.mark.timeout(180)
def test_a_submit_past_a_full_queue_is_retried_until_there_is_room(
    daemon_with_queue: DaemonProcess,
) -> None:
    with daemon_with_queue.client(timeout=60) as c:
        wait = c.register(f"{EXAMPLES}:wait_for_flag")
        flag = int(c.alloc_buffer((2,), "uint8").buffer_id)
        hold = sub_task(wait, [tensor(flag, "inout", (2,), "uint8")], [120_000])
        active, queued = c.submit([hold]), c.submit([hold])
        wait_until(lambda: c.wait_run(int(queued), timeout=0).state is RunPhase.QUEUED, 30)
        bare = Client(daemon_with_queue.socket, retry=None)
        with bare, pytest.raises(ResourceExhausted, match="per_client_queued_runs"):
            bare.submit([hold])
        # The retrying client's sleeps are observed: the slots are freed (from another
        # thread) only once its submit was refused and it backs off.
        refused = threading.Event()
        waits: list[float] = []

        def sleep(seconds: float) -> None:
            waits.append(seconds)
            refused.set()
            time.sleep(seconds)

        def release() -> None:
            if refused.wait(60):
                c.write_buffer(flag, np.array([1, 0], dtype=np.uint8))

        helper = threading.Thread(target=release)
        helper.start()
        policy = RetryPolicy(total=120.0, sleep=sleep)
        try:
            with Client(daemon_with_queue.socket, timeout=60, retry=policy) as retrying:
                third = retrying.submit([hold])  # queue full: refused with a hint, retried
                assert retrying.wait(int(third), timeout=60).state is RunPhase.COMPLETED
        finally:
            c.write_buffer(flag, np.array([1, 0], dtype=np.uint8))
            helper.join(60)
        # Each wait honoured the daemon's hint (at least 50 ms: RETRY_AFTER's floor).
        assert waits and min(waits) >= 0.05
        for future in (active, queued):
            assert future.result(timeout=60).state is RunPhase.COMPLETED
        c.free_buffer(flag)
