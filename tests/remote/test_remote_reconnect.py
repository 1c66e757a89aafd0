"""A remote worker whose session ends comes back: no stale buffer reference ever
aliases a buffer of the new session, and the L4 reconnects with capped exponential
backoff, forever unless ``max_elapsed_s`` says otherwise.

Each test gets its own test host (a network namespace when this process is root,
else a loopback alias) running a real ``simpler-remote-worker``; an L4 ``Worker`` in
this process drives it. Sessions end by SIGKILL of the runner or by stopping the
whole service (and starting it again on the same address).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpler_daemon import CallConfig, TaskArgs
from simpler_daemon.engine.worker import Worker
from simpler_daemon.errors import ControlError, EndpointError, TaskError
from simpler_daemon.remote.spec import ReconnectPolicy, RemoteCallable, RemoteWorkerSpec
from simpler_daemon.remote.wire import CopyFrom, encode_payload
from simpler_daemon.server.health import pools_down
from simpler_daemon.testing import child_pids, poll_for
from simpler_daemon.testing.netns import TestHosts
from tests.support.remote_harness import (
    LOOPBACK_ENV,
    PORT,
    RemoteWorkerProcess,
    our_shm_files,
    pid_alive,
    session_processes,
    start_worker,
    wait_no_runners,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

JOBS = "tests.support.l3_jobs"
#: Small steps, so a test sees several attempts within seconds.
FAST = ReconnectPolicy(initial_s=0.2, max_s=1.0)


# -- one test host with a worker that can be stopped and started again ----------------------


@dataclass
class Site:
    hosts: TestHosts
    log_dir: Path
    port: int
    worker: RemoteWorkerProcess | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.hosts.address(0)}:{self.port}"

    def start(self) -> None:
        assert self.worker is None
        self.worker = start_worker(self.hosts, 0, self.log_dir, port=self.port)

    def stop(self) -> None:
        assert self.worker is not None
        rc = self.worker.stop()
        assert rc == 0, self.worker.log_text()[-3000:]
        self.worker = None


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    hosts = TestHosts(1, use_netns=False if os.environ.get(LOOPBACK_ENV) == "1" else None)
    hosts.start()
    port = PORT if hosts.netns else _free_port(hosts.address(0))
    s = Site(hosts, tmp_path, port)
    try:
        s.start()
        yield s
    finally:
        try:
            if s.worker is not None:
                s.stop()
        finally:
            hosts.close()
    wait_until(
        lambda: not session_processes(),
        10.0,
        lambda: f"remote processes outlived the test: {session_processes()}",
    )


@pytest.fixture(autouse=True)
def no_leaked_children(site: Site) -> Iterator[None]:
    """Overrides the conftest guard: the site's worker may live until its own teardown;
    nothing else may (no other child, no runner, no thread, no /dev/shm file)."""
    shm_before = our_shm_files()
    yield
    allowed = {site.worker.proc.pid} if site.worker is not None else set()
    poll_for(
        lambda: not (child_pids() - allowed),
        timeout=10.0,
        message=f"child processes outlived the test: {child_pids() - allowed}",
    )
    wait_no_runners(10.0)
    poll_for(
        lambda: threading.active_count() == 1,
        timeout=10.0,
        message=f"threads outlived the test: {threading.enumerate()}",
    )
    assert not our_shm_files() - shm_before


@contextlib.contextmanager
def level4(
    endpoint: str,
    *,
    n: int = 1,
    reconnect: ReconnectPolicy | bool = FAST,
    session_timeout_s: float = 5.0,
) -> Iterator[tuple[Worker, list[int], dict[str, Any]]]:
    """An initialised L4 Worker with ``n`` remote workers on ``endpoint``."""
    w4 = Worker(level=4, startup_timeout=5.0, reconnect=reconnect)
    try:
        ids = [
            w4.add_remote_worker(
                RemoteWorkerSpec(
                    endpoint=endpoint,
                    num_sub_workers=1,
                    session_timeout_s=session_timeout_s,
                    heap_bytes=8 << 20,
                )
            )
            for _ in range(n)
        ]
        for name in ("fill", "sleep_ms"):
            w4.register(f"tests.support.sub_tasks:{name}", kind="sub", workers=ids)
        orch = {
            name: w4.register(RemoteCallable(f"{JOBS}:{name}"), workers=ids)
            for name in ("fill_remote", "sleep_sub_remote", "noop_remote")
        }
        w4.init()
        yield w4, ids, orch
    finally:
        w4.close()


def row(w4: Worker, wid: int) -> dict[str, Any]:
    return next(r for r in w4.list_workers() if r.get("worker_id") == wid and r["kind"] == "remote")


def tasks(*calls: tuple[Any, int, TaskArgs]) -> Any:
    """An orchestration that submits each (handle, worker, args) in order."""

    def run(o: Any, _a: Any, _c: Any) -> None:
        for handle, worker, args in calls:
            o.submit_next_level(handle, args, CallConfig(), worker=worker)

    return run


def kill_runner(w4: Worker, wid: int) -> int:
    pid = int(row(w4, wid)["pid"])
    os.kill(pid, signal.SIGKILL)
    poll_for(lambda: not pid_alive(pid), timeout=10.0, message=f"runner {pid} still alive")
    return pid


def wait_reconnected(w4: Worker, wid: int, count: int = 1, timeout: float = 30.0) -> dict[str, Any]:
    found: dict[str, Any] = wait_until(
        lambda: (r := row(w4, wid))["state"] == "ready" and r["reconnects"] == count and r,
        timeout,
        lambda: f"worker {wid} did not reconnect: {row(w4, wid)}",
    )
    return found


def lost(ref: Any) -> str:
    return (
        rf"buffer {ref.buffer_id} of session {ref.session_generation} of remote worker "
        rf"{ref.owner}, which ended: its data is lost"
    )


# -- no stale reference ------------------------------------------------------------------------


def test_a_task_queued_across_a_reconnect_is_refused_and_touches_no_new_buffer(
    site: Site,
) -> None:
    with level4(site.endpoint) as (w4, (r,), orch):
        x = w4.alloc_remote(r, (64,), "float32")
        w4.copy_to_remote(x, np.full(64, 1.0, "float32"))
        # A holds the lane; B (its own sleep, then a fill of x) queues behind it.
        a = w4.submit(tasks((orch["sleep_sub_remote"], r, TaskArgs().add_scalar(60_000))))
        wait_until(lambda: row(w4, r)["queued"] >= 1, 20.0, lambda: f"A never sent: {row(w4, r)}")
        b = w4.submit(
            tasks(
                (orch["sleep_sub_remote"], r, TaskArgs().add_scalar(3000)),
                (orch["fill_remote"], r, TaskArgs().add_tensor(x).add_scalar(105)),
            )
        )
        kill_runner(w4, r)
        with pytest.raises(TaskError) as info_a:
            a.wait(30.0)
        assert info_a.value.outcome == "ENDPOINT_FAILURE", str(info_a.value)
        wait_reconnected(w4, r)
        # The new session numbers its buffers afresh: y has x's buffer id and generation,
        # allocated while B's first task runs, before B's fill of x is dispatched.
        y = w4.alloc_remote(r, (64,), "float32")
        assert (y.buffer_id, y.generation) == (x.buffer_id, x.generation)
        error: TaskError | None = None
        try:
            b.wait(30.0)
        except TaskError as exc:
            error = exc
        got = w4.copy_from_remote(y)
        assert (got == 0).all(), f"B's fill of x wrote into y of the new session: {got[:4]}"
        assert error is not None, "B completed: its fill of x reached the new session"
        text = str(error)
        assert error.outcome == "ENDPOINT_FAILURE", text
        assert (
            f"buffer {x.buffer_id} of session 1 of remote worker {r}, which ended: its data is lost"
            in text
        ), text
        assert (x.session_generation, y.session_generation) == (1, 2)
        assert row(w4, r)["session_generation"] == 2
        # Nothing of the new session was touched, and its pins are balanced: y frees now.
        assert (w4.copy_from_remote(y) == 0).all()
        w4.free(y)
        assert y.key not in w4._fleet.buffers and not w4._fleet._deferred
        z = w4.alloc_remote(r, (64,), "float32")  # the session goes on
        w4.submit(tasks((orch["fill_remote"], r, TaskArgs().add_tensor(z).add_scalar(7)))).wait(
            30.0
        )
        assert (w4.copy_from_remote(z) == 7).all()


def test_controls_refuse_an_old_ref_and_alloc_sees_the_new_session_without_a_run(
    site: Site,
) -> None:
    with level4(site.endpoint, n=2) as (w4, (r, other), orch):
        old = w4.alloc_remote(r, (8,), "int32")
        w4.copy_to_remote(old, np.arange(8, dtype="int32"))
        kill_runner(w4, r)
        # Only the blocking API's own calls from here on: no run, no list_workers,
        # nothing else that would take a Scheduler round.
        box: dict[str, Any] = {}

        def alloc_ok() -> bool:
            try:
                box["ref"] = w4.alloc_remote(r, (8,), "int32")
            except EndpointError as exc:
                box["error"] = str(exc)
                return False
            return True

        wait_until(alloc_ok, 30.0, lambda: f"alloc_remote kept failing: {box.get('error')}")
        new = box["ref"]
        assert new.session_generation == 2 and (new.buffer_id, new.generation) == (
            old.buffer_id,
            old.generation,
        )
        if "error" in box:  # while the session was being reopened, it said so
            assert "reconnecting" in box["error"] or "failed" in box["error"], box["error"]
        for call in (
            lambda: w4.copy_to_remote(old, np.full(8, 99, "int32")),
            lambda: w4.copy_from_remote(old),
            lambda: w4.import_remote(old, other),
            lambda: w4.free(old),
        ):
            with pytest.raises(ValueError, match=lost(old)):
                call()
        # At submit too: the orchestration's submit refuses it (raised to the caller of a
        # synchronous orchestration).
        with pytest.raises((TaskError, ValueError), match=lost(old)):
            w4.submit(
                tasks((orch["fill_remote"], r, TaskArgs().add_tensor(old).add_scalar(5)))
            ).wait(30.0)
        # The runner refuses a reference of another session on its own, whatever the
        # parent sends (here past the parent's checks, straight onto the command lane).
        stale = CopyFrom(
            buffer_id=old.buffer_id, generation=old.generation, offset=0, nbytes=32, session=1
        )
        with pytest.raises(ControlError, match=r"which ended: its data is lost .*is session 2"):
            w4._fleet.endpoints[r].control("copy_from", encode_payload(stale))
        assert (w4.copy_from_remote(new) == 0).all()
        r_row = row(w4, r)
        assert (r_row["state"], r_row["reconnects"], r_row["attempts"]) == ("ready", 1, 0), r_row
        assert r_row["session_generation"] == 2 and r_row["next_try_s"] is None, r_row


# -- reconnect with backoff ----------------------------------------------------------------------


def test_a_worker_down_for_several_attempts_rejoins_and_serves_new_work(site: Site) -> None:
    with level4(site.endpoint) as (w4, (r,), orch):
        w4.submit(tasks((orch["noop_remote"], r, TaskArgs()))).wait(30.0)
        site.stop()  # the service and its runner go away: the session ends
        down = wait_until(
            lambda: (x := row(w4, r))["state"] == "reconnecting" and x["attempts"] >= 3 and x,
            30.0,
            lambda: f"no reconnect attempts seen: {row(w4, r)}",
        )
        assert 0.0 <= down["next_try_s"] <= FAST.max_s, down
        # The daemon's health: the L3 pool is down (no worker can take work), but it is
        # coming back, so the watchdog pings go on.
        (l3,) = pools_down(w4.manager, 4)
        assert l3.pool == "l3" and l3.recovering and "reconnecting" in l3.reason
        assert "reconnecting: attempt" in down["reason"] and "next attempt in" in down["reason"]
        # Work for a worker that is down fails at once, naming its state.
        with pytest.raises(TaskError) as info:
            w4.submit(tasks((orch["noop_remote"], r, TaskArgs()))).wait(30.0)
        assert info.value.outcome == "ENDPOINT_FAILURE" and "reconnecting" in str(info.value)
        site.start()  # the same address and port, as systemd's Restart= does
        up = wait_reconnected(w4, r)
        assert (up["attempts"], up["next_try_s"], up["reason"]) == (0, None, None), up
        assert up["session_generation"] == 2
        # Registrations were replayed: the callables run, on a buffer of the new session.
        y = w4.alloc_remote(r, (16,), "float32")
        w4.submit(tasks((orch["fill_remote"], r, TaskArgs().add_tensor(y).add_scalar(3)))).wait(
            30.0
        )
        assert (w4.copy_from_remote(y) == 3).all()


def test_max_elapsed_s_gives_the_worker_up_with_a_clear_reason(site: Site) -> None:
    policy = ReconnectPolicy(initial_s=0.2, max_s=0.4, max_elapsed_s=1.5)
    with level4(site.endpoint, reconnect=policy) as (w4, (r,), orch):
        site.stop()
        gone = wait_until(
            lambda: (
                (x := row(w4, r))["state"] == "failed" and "gave up" in (x["reason"] or "") and x
            ),
            30.0,
            lambda: f"never gave up: {row(w4, r)}",
        )
        reason = gone["reason"]
        assert "gave up reconnecting after" in reason, reason
        assert "reconnect.max_elapsed_s=1.5" in reason and "the last one failed:" in reason
        assert gone["attempts"] == 0 and gone["next_try_s"] is None
        assert [p.pool for p in pools_down(w4.manager, 4)] == ["l3"]
        with pytest.raises(TaskError) as info:
            w4.submit(tasks((orch["noop_remote"], r, TaskArgs()))).wait(30.0)
        assert "gave up reconnecting" in str(info.value)


def test_a_partitioned_host_rejoins_once_its_link_is_back(site: Site) -> None:
    if not site.hosts.netns:
        pytest.skip("needs network namespaces (root and `ip netns`) to take a link down")
    with level4(site.endpoint, session_timeout_s=2.0) as (w4, (r,), orch):
        w4.submit(tasks((orch["noop_remote"], r, TaskArgs()))).wait(30.0)
        first = row(w4, r)
        site.hosts.link_down(0)
        try:
            # The health lane falls silent, the session fails, attempts fail.
            wait_until(
                lambda: (x := row(w4, r))["state"] == "reconnecting" and x["attempts"] >= 2,
                60.0,
                lambda: f"no reconnect attempts seen: {row(w4, r)}",
            )
        finally:
            site.hosts.link_up(0)
        up = wait_reconnected(w4, r, timeout=60.0)
        assert up["session_id"] != first["session_id"] and up["session_generation"] == 2
        w4.submit(tasks((orch["noop_remote"], r, TaskArgs()))).wait(30.0)


def test_a_frozen_host_rejoins_once_it_thaws(site: Site) -> None:
    assert site.worker is not None
    with level4(site.endpoint, session_timeout_s=2.0) as (w4, (r,), orch):
        w4.submit(tasks((orch["noop_remote"], r, TaskArgs()))).wait(30.0)
        frozen = [site.worker.proc.pid, int(row(w4, r)["pid"])]  # the service, the runner
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            # An idle session is judged on its next request: silent health fails it.
            with pytest.raises(TaskError, match="health lane silent"):
                w4.submit(tasks((orch["noop_remote"], r, TaskArgs()))).wait(30.0)
            # Attempts connect (the kernel still accepts) but get no answer in time.
            wait_until(
                lambda: (x := row(w4, r))["state"] == "reconnecting" and x["attempts"] >= 2,
                60.0,
                lambda: f"no reconnect attempts seen: {row(w4, r)}",
            )
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        up = wait_reconnected(w4, r, timeout=60.0)
        assert up["session_generation"] == 2
        w4.submit(tasks((orch["noop_remote"], r, TaskArgs()))).wait(30.0)
