"""Remote L3 sessions under network faults, end to end on loopback.

A real ``simpler-remote-worker`` (subprocess) spawns real runners; an L4
``Worker`` in this process reaches it through a :class:`SessionProxy`, which
puts a frame-aware ChaosProxy on the command and the health lane of every
session. Each test injects one fault and asserts the exact outcome of the run
it hits, that the failure is sticky, what L4 does next, and that no runner
outlives it (``/proc`` children of the worker process).

The L4 Worker is initialised BEFORE the proxies start: ``init`` forks the fork
server, and forking is only allowed while this process has one thread. The
remote worker is then added (and its callables registered) live.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpler_daemon import CallConfig, TaskArgs
from simpler_daemon.callables import CallableHandle
from simpler_daemon.engine.worker import Worker
from simpler_daemon.errors import EndpointError, StartupError, TaskError
from simpler_daemon.remote.spec import RemoteCallable, RemoteWorkerSpec
from simpler_daemon.testing import child_pids, poll_for, shm_files
from simpler_daemon.testing.session_proxy import ProxiedSession, SessionProxy

pytestmark = pytest.mark.timeout(60)

WORKER_BIN = Path(sys.executable).with_name("simpler-remote-worker")
ALLOW = 'callables.allowed_modules=["simpler_daemon.examples."]'
EX = "simpler_daemon.examples.remote"
RUN_TIMEOUT = 15.0


# -- the remote worker process ------------------------------------------------------------------


@dataclass
class RemoteWorkerProc:
    proc: subprocess.Popen[bytes]
    host: str
    port: int
    log: Path

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def runners(self) -> set[int]:
        """Live runner processes of this worker (its children)."""
        return child_pids(self.proc.pid)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_no_runners(self, timeout: float = 15.0) -> None:
        poll_for(
            lambda: not self.runners(),
            timeout=timeout,
            interval=0.02,
            message=f"runners of the remote worker outlived the test: {self.runners()}",
        )


def _start_worker(log: Path, *extra: str) -> RemoteWorkerProc:
    cmd = [str(WORKER_BIN), "serve", "--listen", "127.0.0.1:0", "--set", ALLOW, *extra]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
    }
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=fh, stdin=subprocess.DEVNULL, env=env
        )
    assert proc.stdout is not None
    line = b""
    deadline = time.monotonic() + 30
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            proc.kill()
            proc.wait()
            pytest.fail(f"simpler-remote-worker did not start: {log.read_text()}")
        chunk = os.read(proc.stdout.fileno(), 1)
        if not chunk:
            proc.wait()
            pytest.fail(f"simpler-remote-worker exited: {log.read_text()}")
        line += chunk
    m = re.search(r"listening on (\S+):(\d+)", line.decode())
    assert m, line
    return RemoteWorkerProc(proc, m[1], int(m[2]), log)


def _stop_worker(w: RemoteWorkerProc) -> None:
    try:
        w.wait_no_runners()
    finally:
        w.proc.send_signal(signal.SIGTERM)
        try:
            w.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
        assert w.proc.stdout is not None
        w.proc.stdout.close()


#: The module's shared worker (lives across tests) and every runner pid seen.
_SHARED: list[RemoteWorkerProc] = []
_RUNNER_PIDS: set[int] = set()


@pytest.fixture(scope="module")
def shared_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteWorkerProc]:
    w = _start_worker(tmp_path_factory.mktemp("remote-faults") / "worker.log")
    _SHARED.append(w)
    try:
        yield w
    finally:
        _SHARED.remove(w)
        _stop_worker(w)


@pytest.fixture
def wk(shared_worker: RemoteWorkerProc) -> Iterator[RemoteWorkerProc]:
    """The shared worker; after each test none of its runners is left and it still serves
    (a fault in one session never takes the worker down)."""
    yield shared_worker
    shared_worker.wait_no_runners()
    assert shared_worker.proc.poll() is None, shared_worker.log_text()[-2000:]


@pytest.fixture
def remote_worker(tmp_path: Path) -> Iterator[Callable[..., RemoteWorkerProc]]:
    """A worker of its own, for a configuration the shared one does not have."""
    started: list[RemoteWorkerProc] = []

    def start(*extra: str) -> RemoteWorkerProc:
        w = _start_worker(tmp_path / f"worker{len(started)}.log", *extra)
        started.append(w)
        return w

    yield start
    for w in started:
        _stop_worker(w)


def _creator_pid(name: str) -> int | None:
    m = re.match(r"simpler-\w+-(\d+)-", name)
    return int(m[1]) if m else None


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    """Overrides the conftest guard. The shared worker outlives each test on purpose, and
    /dev/shm is shared with other test sessions on this machine: only files created by
    this process or by a runner of ours count."""
    before = shm_files()
    yield
    gc.collect()
    keep = {w.proc.pid for w in _SHARED}
    poll_for(
        lambda: not (child_pids() - keep),
        timeout=10.0,
        message=f"child processes outlived the test: {child_pids() - keep}",
    )
    ours = {os.getpid(), *_RUNNER_PIDS}
    leaked = {n for n in shm_files() - before if _creator_pid(n) in ours}
    assert not leaked, f"files left in /dev/shm: {sorted(leaked)}"


# -- an L4 parent behind a session proxy ----------------------------------------------------------


@dataclass
class Pod:
    w4: Worker
    sp: SessionProxy
    r: int
    orch: dict[str, CallableHandle]

    def submit(self, name: str, *scalars: int, config: CallConfig | None = None) -> Any:
        handle = self.orch[name]
        r = self.r
        args = TaskArgs()
        for s in scalars:
            args.add_scalar(s)

        def body(o: Any, a: Any, c: Any) -> None:
            o.submit_next_level(handle, args, config or CallConfig(), worker=r)

        return self.w4.submit(body)

    def run(self, name: str, *scalars: int) -> None:
        self.submit(name, *scalars).wait(RUN_TIMEOUT)

    def fail(self, name: str, *scalars: int) -> TaskError:
        with pytest.raises(TaskError) as info:
            self.run(name, *scalars)
        return info.value

    def row(self) -> dict[str, Any]:
        rows = [x for x in self.w4.list_workers() if x.get("kind") == "remote"]
        assert len(rows) == 1, rows
        return rows[0]

    def label(self) -> str:
        return f"remote worker {self.r} ({self.sp.endpoint})"


@contextlib.contextmanager
def pod(
    wk: RemoteWorkerProc,
    *,
    session_timeout_s: float = 2.0,
    on_session: Callable[[ProxiedSession], None] | None = None,
) -> Iterator[Pod]:
    w4 = Worker(level=4, startup_timeout=20.0)
    sp = SessionProxy(wk.host, wk.port, on_session=on_session)
    try:
        w4.init()  # the fork server forks here: before any proxy thread exists
        sp.start()
        r = w4.add_remote_worker(
            RemoteWorkerSpec(
                endpoint=sp.endpoint, num_sub_workers=1, session_timeout_s=session_timeout_s
            )
        )
        w4.register("simpler_daemon.examples.tasks:empty", kind="sub", workers=[r])
        orch = {
            name: w4.register(RemoteCallable(f"{EX}:{name}"), workers=[r])
            for name in ("one_empty", "nothing", "sleep_for")
        }
        yield Pod(w4, sp, r, orch)
    finally:
        try:
            w4.close(5.0)
        finally:
            sp.close()
            _RUNNER_PIDS.update(s.pid for s in sp.sessions)
    wk.wait_no_runners()
    assert not sp.errors, sp.errors


def runner_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped before or while reading
        return True


def assert_endpoint_failure(err: TaskError, p: Pod, *reasons: str) -> str:
    text = str(err)
    assert err.outcome == "ENDPOINT_FAILURE", text
    assert err.worker_id == p.r, text
    assert f"{p.label()} failed: " in text, text
    assert any(reason in text for reason in reasons), text
    return text


# -- command lane -------------------------------------------------------------------------------


def test_truncated_completion_fails_that_run_and_l4_reconnects(
    wk: RemoteWorkerProc,
) -> None:
    with pod(wk) as p:
        p.run("one_empty")
        first = p.sp.latest
        p.sp.command.truncate_after(p.sp.command.frames["down"], "down")
        err = p.fail("one_empty")
        assert_endpoint_failure(err, p, "command connection closed", "truncated frame at EOF")
        row = p.row()
        if row["session_id"] == first.session_id:  # the failed session, sticky
            assert (row["state"], row["failures"], row["reconnects"]) == ("failed", 1, 0), row
            assert row["pid"] == first.pid, row
        else:  # the L4 already opened a new session on its reconnect thread
            assert row["reconnects"] == 1, row
        poll_for(lambda: runner_gone(first.pid), timeout=10, message="first runner still alive")
        # Sticky until L4 replaces the session; the next run gets a fresh one and works.
        p.run("one_empty")
        row = p.row()
        assert (row["state"], row["reconnects"], row["reason"]) == ("ready", 1, None), row
        assert len(p.sp.sessions) == 2
        assert row["session_id"] == p.sp.latest.session_id != first.session_id
        p.run("nothing")


@pytest.mark.parametrize("direction", ["up", "down"])
def test_corrupted_command_header_fails_exactly_that_run(
    wk: RemoteWorkerProc, direction: str
) -> None:
    with pod(wk) as p:
        p.run("one_empty")
        first = p.sp.latest
        p.sp.command.corrupt_frame(p.sp.command.frames[direction], direction, "magic")  # type: ignore[arg-type]
        err = p.fail("one_empty")
        if direction == "up":
            # The runner drops the lane on its ProtocolError; the parent sees it close.
            assert_endpoint_failure(err, p, "command connection closed")
            poll_for(
                lambda: re.search(
                    rf"runner {first.pid}: .*protocol error on the command lane: .*bad magic",
                    wk.log_text(),
                ),
                timeout=10,
                message=f"runner did not report the protocol error: {wk.log_text()[-2000:]}",
            )
        else:
            assert_endpoint_failure(err, p, "protocol error")
            assert "bad magic" in str(err)
        poll_for(lambda: runner_gone(first.pid), timeout=10, message="first runner still alive")
        p.run("one_empty")
        assert p.row()["reconnects"] == 1


def test_every_frame_delayed_50ms_still_succeeds(
    wk: RemoteWorkerProc,
) -> None:
    with pod(wk, session_timeout_s=2.0) as p:
        p.sp.command.delay(0.05, "both")
        p.sp.health.delay(0.05, "both")
        for _ in range(3):
            t0 = time.monotonic()
            p.run("one_empty")
            assert time.monotonic() - t0 >= 0.1  # TASK up + COMPLETION down, 50 ms each
        ref = p.w4.alloc_remote(p.r, (256,), "float32")
        p.w4.copy_to_remote(ref, np.full(256, 2.5, "float32"))
        assert float(p.w4.copy_from_remote(ref).sum()) == 640.0
        p.w4.free(ref)
        # A task longer than session_timeout_s with delayed beats: health never trips.
        p.run("sleep_for", 2500)
        row = p.row()
        assert (row["state"], row["failures"], row["reconnects"]) == ("ready", 0, 0), row
        assert row["health_age_s"] < 2.0


def test_replayed_task_frame_kills_the_session_and_fails_that_run(
    wk: RemoteWorkerProc,
) -> None:
    with pod(wk) as p:
        p.run("one_empty")
        first = p.sp.latest
        p.sp.command.replay_frame(p.sp.command.frames["up"], "up")
        err = p.fail("one_empty")
        assert_endpoint_failure(err, p, "command connection closed")
        poll_for(
            lambda: re.search(
                rf"runner {first.pid}: .*protocol error on the command lane: TASK frame has "
                r"sequence (\d+), expected (\d+)",
                wk.log_text(),
            ),
            timeout=10,
            message=f"runner did not refuse the duplicate: {wk.log_text()[-2000:]}",
        )
        p.run("one_empty")
        assert p.row()["reconnects"] == 1


def test_replayed_completion_is_never_taken_as_a_result(wk: RemoteWorkerProc) -> None:
    with pod(wk) as p:
        p.run("one_empty")
        first = p.sp.latest
        p.sp.command.replay_frame(p.sp.command.frames["down"], "down")
        # The genuine COMPLETION answers this run; its duplicate arrives with no request
        # in flight: a protocol error that fails the session stickily and answers nothing.
        p.run("one_empty")
        row = poll_for(lambda: (r := p.row())["state"] == "failed" and r, timeout=5)
        assert row["reason"].startswith("protocol error: unexpected COMPLETION sequence "), row
        assert row["reason"].endswith(": no request is in flight"), row
        assert row["failures"] == 1, row
        poll_for(lambda: runner_gone(first.pid), timeout=10, message="first runner still alive")


@pytest.mark.parametrize("cause", ["replayed completion", "failed control"])
def test_run_after_a_session_failed_between_runs_reaches_a_new_session(
    wk: RemoteWorkerProc, cause: str
) -> None:
    with pod(wk) as p:
        if cause == "replayed completion":
            p.run("one_empty")
            p.sp.command.replay_frame(p.sp.command.frames["down"], "down")
            p.run("one_empty")
            poll_for(lambda: p.row()["state"] == "failed", timeout=5)
        else:
            ref = p.w4.alloc_remote(p.r, (64,), "float32")
            p.sp.command.cut()
            with pytest.raises(EndpointError):
                p.w4.copy_from_remote(ref)
        run_or_fail_hanging(p, "nothing")
        assert p.row()["reconnects"] == 1


def run_or_fail_hanging(p: Pod, name: str, timeout: float = 4.0) -> None:
    h = p.submit(name)
    try:
        h.wait(timeout)
    except TimeoutError:
        p.w4.cancel(h)
        pytest.fail(f"the run never ran within {timeout} s; remote row: {p.row()}")


# -- health lane --------------------------------------------------------------------------------


def test_health_lane_cut_fails_the_task_in_flight(
    wk: RemoteWorkerProc,
) -> None:
    with pod(wk, session_timeout_s=2.0) as p:
        p.run("nothing")
        up = p.sp.command.frames["up"]
        h = p.submit("sleep_for", 2000)
        poll_for(lambda: p.sp.command.frames["up"] > up, timeout=5, message="TASK never sent")
        t0 = time.monotonic()
        p.sp.health.cut()
        with pytest.raises(TaskError) as info:
            h.wait(RUN_TIMEOUT)
        assert time.monotonic() - t0 < 2.0  # within session_timeout_s
        assert_endpoint_failure(info.value, p, "health lane closed", "health lane failed")
        row = p.row()
        assert row["state"] == "failed" and "health lane" in row["reason"], row
        p.run("nothing")
        assert p.row()["reconnects"] == 1


def test_health_delayed_past_session_timeout_fails_and_stays_failed(
    wk: RemoteWorkerProc,
) -> None:
    with pod(wk, session_timeout_s=1.0) as p:
        p.run("nothing")
        p.sp.health.delay(2.5, "down")
        t0 = time.monotonic()
        with pytest.raises(TaskError) as info:
            p.submit("sleep_for", 2000).wait(RUN_TIMEOUT)
        elapsed = time.monotonic() - t0
        # Not before the session timeout; what ended it is in the text (a loaded
        # machine may take longer to notice, so no tight upper bound).
        assert 1.0 <= elapsed < RUN_TIMEOUT, elapsed
        text = assert_endpoint_failure(info.value, p, "health lane silent for")
        assert "session_timeout_s=1" in text
        failed = p.row()
        # The held beats are released 2.5 s after they were sent: they revive nothing.
        # The failed session stays failed; what may become ready is a new session (the
        # L4 reconnects), never the old one.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            row = p.row()
            if row["session_id"] == failed["session_id"]:
                assert (row["state"], row["reason"]) == ("failed", failed["reason"]), row
            else:
                assert row["reconnects"] == 1, row
            time.sleep(0.1)
        p.sp.latest.health.pass_through()
        p.run("nothing")
        row = p.row()
        assert row["reconnects"] == 1 and row["session_id"] != failed["session_id"], row


# -- attach ------------------------------------------------------------------------------------


def _probe(addr: tuple[str, int], record: bytes, timeout: float = 5.0) -> str:
    """Connect, present ``record`` as the attach bytes; how the runner treated it
    (a runner that stopped listening refuses the connection: dropped as well)."""
    try:
        conn = socket.create_connection(addr, timeout=timeout)
    except ConnectionRefusedError:
        return "dropped"
    with conn as s:
        s.sendall(record)
        try:
            data = s.recv(1)
        except ConnectionResetError:
            return "dropped"
        except TimeoutError:
            return "kept open"
        return "dropped" if data == b"" else f"answered {data!r}"


def test_stale_attach_is_dropped_and_the_real_session_works(
    wk: RemoteWorkerProc,
) -> None:
    verdicts: dict[str, str] = {}

    def stale(s: ProxiedSession) -> None:
        # Runs while the runner waits for its parent: probe its real ports first.
        assert s.session_id is not None and s.attach_key is not None
        key = bytes.fromhex(s.attach_key)
        wrong_key = bytes(b ^ 0x5A for b in key)
        u64 = struct.Struct("<Q")
        verdicts["command wrong session"] = _probe(
            s.runner_command, u64.pack(s.session_id ^ 1) + key
        )
        verdicts["command wrong key"] = _probe(s.runner_command, u64.pack(s.session_id) + wrong_key)
        verdicts["health wrong key"] = _probe(s.runner_health, u64.pack(s.session_id) + wrong_key)

    with pod(wk, on_session=stale) as p:
        assert verdicts == {
            "command wrong session": "dropped",
            "command wrong key": "dropped",
            "health wrong key": "dropped",
        }
        assert "rejected a connection with a wrong attach key" in wk.log_text()
        p.run("one_empty")
        p.run("one_empty")
        row = p.row()
        assert (row["state"], row["failures"], row["reconnects"]) == ("ready", 0, 0), row


# -- start-up ----------------------------------------------------------------------------------


def test_worker_that_never_answers_is_a_startup_error_within_the_deadline() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never accepts
        port = silent.getsockname()[1]
        w4 = Worker(level=4, startup_timeout=1.5)
        try:
            r = w4.add_remote_worker(RemoteWorkerSpec(endpoint=f"127.0.0.1:{port}"))
            w4.register(RemoteCallable(f"{EX}:nothing"), workers=[r])
            t0 = time.monotonic()
            with pytest.raises(StartupError) as info:
                w4.init()
            assert time.monotonic() - t0 < 4.0
        finally:
            w4.close()
    text = str(info.value)
    assert f"cannot start remote worker {r} (127.0.0.1:{port})" in text, text
    assert "no answer within" in text, text
    assert "startup_timeout=1.5 s" in text and "init() waited" in text, text


def test_wrong_token_is_refused_before_anything_spawns(
    remote_worker: Callable[..., RemoteWorkerProc], tmp_path: Path
) -> None:
    good = tmp_path / "token"
    good.write_text("the right token, long enough\n")
    good.chmod(0o600)
    bad = tmp_path / "wrong"
    bad.write_text("not the token\n")
    w = remote_worker("--token-file", str(good))
    # Through the session proxy: a refused handshake is relayed as it is. Without a fork
    # server (restart_children=False) init forks nothing, so the proxy may start first.
    with SessionProxy(w.host, w.port) as sp:
        w4 = Worker(level=4, startup_timeout=10.0, restart_children=False)
        try:
            r = w4.add_remote_worker(RemoteWorkerSpec(endpoint=sp.endpoint, token_file=str(bad)))
            w4.register(RemoteCallable(f"{EX}:nothing"), workers=[r])
            with pytest.raises(StartupError) as info:
                w4.init()
        finally:
            w4.close()
    text = str(info.value)
    assert f"cannot start remote worker {r} ({sp.endpoint})" in text, text
    assert "authentication failed" in text, text
    assert sp.refused == ["cannot open session: authentication failed"]
    assert sp.sessions == [] and not sp.errors
    assert not w.runners()
    assert "opened" not in w.log_text()


def test_callable_outside_the_allow_list_is_a_startup_error(wk: RemoteWorkerProc) -> None:
    target = "tests.support.l3_jobs:noop_remote"
    log_start = len(wk.log_text())
    w4 = Worker(level=4, startup_timeout=10.0)
    try:
        r = w4.add_remote_worker(RemoteWorkerSpec(endpoint=wk.endpoint))
        w4.register(RemoteCallable(target), workers=[r])
        with pytest.raises(StartupError) as info:
            w4.init()
    finally:
        w4.close()
    text = str(info.value)
    assert f"cannot start remote worker {r} ({wk.endpoint})" in text, text
    assert target in text and "allowed_modules" in text, text
    assert not wk.runners()
    assert "opened" not in wk.log_text()[log_start:]


# -- controls under faults -----------------------------------------------------------------------


def test_copy_from_remote_on_a_cut_command_lane_is_an_endpoint_error(
    wk: RemoteWorkerProc,
) -> None:
    with pod(wk) as p:
        ref = p.w4.alloc_remote(p.r, (64,), "float32")
        p.w4.copy_to_remote(ref, np.arange(64, dtype="float32"))
        p.sp.command.cut()
        t0 = time.monotonic()
        with pytest.raises(EndpointError) as info:
            p.w4.copy_from_remote(ref)
        assert time.monotonic() - t0 < 2.0
        text = str(info.value)
        assert p.label() in text and "command connection closed" in text, text
        assert p.row()["state"] == "failed"


def test_stale_attach_after_the_session_attached_is_dropped(wk: RemoteWorkerProc) -> None:
    with pod(wk) as p:
        p.run("one_empty")
        s = p.sp.latest
        assert s.session_id is not None
        record = struct.pack("<Q", s.session_id ^ 1) + bytes(32)
        verdicts = {
            lane: _probe(addr, record, timeout=1.0)
            for lane, addr in (("command", s.runner_command), ("health", s.runner_health))
        }
        p.run("one_empty")  # the real session is not disturbed either way
        assert p.row()["failures"] == 0
        assert verdicts == {"command": "dropped", "health": "dropped"}
