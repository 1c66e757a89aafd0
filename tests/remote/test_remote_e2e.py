"""Remote L3 end to end: an L4 ``Worker`` in this process drives real ``simpler-remote-worker``
processes on two test hosts over real sockets, as a new user would (docs/remote.md).

::

    this process: Worker(level=4)  ──TCP──►  host 0: simpler-remote-worker :19073 ─► runner(s)
                                   ──TCP──►  host 1: simpler-remote-worker :19073 ─► runner(s)

The hosts are network namespaces with veth pairs when this process is root (the
run prints ``remote e2e hosts: network namespaces ...``), else loopback aliases
``127.77.<i>.2``; tests that need a link to take down are skipped then. Every test
ends with no runner, no inner child and no ``/dev/shm`` file of ours left (checked
in ``/proc`` by the environment mark of ``tests.support.remote_harness``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpler_daemon import CallConfig, Tag, TaskArgs
from simpler_daemon.engine.worker import Worker, WorkerState
from simpler_daemon.errors import StartupError, TaskError
from simpler_daemon.remote.spec import RemoteCallable, RemoteWorkerSpec
from simpler_daemon.testing import child_pids, poll_for
from tests.support.remote_harness import (
    REPO,
    SEEN_PIDS,
    RemoteHosts,
    marked_env,
    our_shm_files,
    pid_alive,
    remote_hosts,
    runner_processes,
    silent_listener,
    start_worker,
    wait_no_runners,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

EX = "simpler_daemon.examples.remote"
JOBS = "tests.support.l3_jobs"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteHosts]:
    """Two test hosts (network namespaces when root, else loopback aliases; the mode is
    logged at INFO and printed), each running ``simpler-remote-worker --insecure`` on port
    19073 with ``simpler_daemon.examples.`` and ``tests.`` allowed. Teardown stops them
    and proves no worker, runner or inner child of ours is left anywhere."""
    with remote_hosts(tmp_path_factory.mktemp("remote-e2e")) as h:
        yield h


@pytest.fixture(autouse=True)
def no_leaked_children(hosts: RemoteHosts) -> Iterator[None]:
    """Overrides the conftest guard: the module's remote workers outlive each test on
    purpose; nothing else may (no other child, no runner, no thread, no /dev/shm file)."""
    shm_before = our_shm_files()
    yield
    allowed = hosts.pids()
    poll_for(
        lambda: not (child_pids() - allowed),
        timeout=10.0,
        message=f"child processes outlived the test: {child_pids() - allowed}",
    )
    wait_no_runners(10.0)
    poll_for(
        lambda: threading.active_count() == 1,
        timeout=5.0,
        message=f"threads outlived the test: {threading.enumerate()}",
    )
    for w in hosts.workers:
        assert w.proc.poll() is None, f"remote worker on host {w.host} died:\n{w.log_text()}"
    leaked = our_shm_files() - shm_before
    assert not leaked, f"files left in /dev/shm: {sorted(leaked)}"


@contextlib.contextmanager
def level4(
    endpoints: list[str],
    *,
    session_timeout_s: float = 10.0,
    restart_children: bool = True,
    startup_timeout: float = 20.0,
    token_file: str | None = None,
    num_sub_workers: int = 2,
) -> Iterator[tuple[Worker, list[int]]]:
    """An initialised L4 Worker with one remote per endpoint and the test callables."""
    w4 = Worker(level=4, startup_timeout=startup_timeout, restart_children=restart_children)
    try:
        ids = [
            w4.add_remote_worker(
                RemoteWorkerSpec(
                    endpoint=e,
                    num_sub_workers=num_sub_workers,
                    session_timeout_s=session_timeout_s,
                    heap_bytes=8 << 20,
                    token_file=token_file,
                )
            )
            for e in endpoints
        ]
        for name in ("fill", "consume", "fail"):
            w4.register(f"tests.support.sub_tasks:{name}", kind="sub", workers=ids)
        w4.init()
        yield w4, ids
    finally:
        w4.close()


def orch(target: str, w4: Worker, ids: list[int]) -> Any:
    return w4.register(RemoteCallable(target), workers=ids)


def next_level(handle: Any, worker: int, args: TaskArgs | None = None) -> Any:
    def run(o: Any, _a: Any, _c: Any) -> None:
        o.submit_next_level(handle, args or TaskArgs(), CallConfig(), worker=worker)

    return run


def row(w4: Worker, wid: int) -> dict[str, Any]:
    return next(r for r in w4.list_workers() if r.get("worker_id") == wid and r["kind"] == "remote")


def net_ns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def in_sleep(pid: int) -> bool:
    """The runner's main thread is inside the orchestration's time.sleep."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return "nanosleep" in f.read()
    except OSError:
        return False


# -- the happy paths -----------------------------------------------------------------------------


def test_one_l4_run_drives_sub_tasks_on_both_hosts(hosts: RemoteHosts) -> None:
    with level4([hosts.endpoint(0), hosts.endpoint(1)]) as (w4, ids):
        fill = orch(f"{JOBS}:fill_remote", w4, ids)
        x = [w4.alloc_remote(worker=w, shape=(4096,), dtype="float32") for w in ids]
        w4.copy_to_remote(x[0], np.full(4096, -1, "float32"))
        assert (w4.copy_from_remote(x[0]) == -1).all()  # written remotely, read back

        def both(o: Any, _a: Any, _c: Any) -> None:
            for i, w in enumerate(ids):
                args = TaskArgs().add_tensor(x[i], Tag.INOUT).add_scalar(3 + i)
                o.submit_next_level(fill, args, CallConfig(), worker=w)

        w4.run(both)
        assert (w4.copy_from_remote(x[0]) == 3).all()
        assert (w4.copy_from_remote(x[1]) == 4).all()

        rows = [row(w4, w) for w in ids]
        assert [r["state"] for r in rows] == ["ready", "ready"], rows
        assert [r["endpoint"] for r in rows] == [hosts.endpoint(0), hosts.endpoint(1)]
        pids = [r["pid"] for r in rows]
        assert all(pid_alive(p) for p in pids), rows
        if hosts.netns:  # each runner really lives on its own host
            assert len({net_ns(p) for p in pids} | {net_ns(os.getpid())}) == 3
        for ref in x:
            w4.free(ref)


def test_import_from_host0_is_read_by_a_task_on_host1(hosts: RemoteHosts) -> None:
    with level4([hosts.endpoint(0), hosts.endpoint(1)], num_sub_workers=1) as (w4, ids):
        consume = orch(f"{JOBS}:consume_remote", w4, [ids[1]])
        src = w4.alloc_remote(worker=ids[0], shape=(64, 16), dtype="int64")
        dst = w4.alloc_remote(worker=ids[1], shape=(64, 16), dtype="int64")
        data = np.arange(64 * 16, dtype="int64").reshape(64, 16)
        w4.copy_to_remote(src, data)
        with pytest.raises(ValueError, match="has not imported it"):
            w4.run(next_level(consume, ids[1], TaskArgs().add_tensor(src).add_tensor(dst)))
        w4.import_remote(src, worker=ids[1])
        args = TaskArgs().add_tensor(src, Tag.INPUT).add_tensor(dst, Tag.OUTPUT).add_scalar(5)
        w4.run(next_level(consume, ids[1], args))
        np.testing.assert_array_equal(w4.copy_from_remote(dst), data + 5)
        w4.release_remote(src, worker=ids[1])
        w4.free(src)
        w4.free(dst)


@pytest.mark.slow
def test_values_and_kwargs_reach_a_remote_orchestration(hosts: RemoteHosts) -> None:
    """Values in the frame travel in the TASK; heap-backed ones are refused at submit."""
    with level4([hosts.endpoint(0)], num_sub_workers=1) as (w4, ids):
        job = orch(f"{JOBS}:fill_from_values", w4, ids)
        x = w4.alloc_remote(worker=ids[0], shape=(16,), dtype="int64")
        args = TaskArgs().add_tensor(x, Tag.OUTPUT).add_value(40).set_kwargs(add=2)
        w4.run(next_level(job, ids[0], args))
        assert (w4.copy_from_remote(x) == 42).all()
        big = TaskArgs().add_tensor(x, Tag.OUTPUT).add_value(b"v" * 100_000).set_kwargs(add=1)
        with pytest.raises(
            ValueError, match=r"task 0 .*to remote worker .*: its values and kwargs"
        ):
            w4.run(next_level(job, ids[0], big))
        w4.free(x)


def test_a_task_longer_than_the_session_timeout_keeps_health_alive(hosts: RemoteHosts) -> None:
    with level4([hosts.endpoint(0)], session_timeout_s=1.5, num_sub_workers=1) as (w4, ids):
        sleep = orch(f"{EX}:sleep_for", w4, ids)
        t0 = time.monotonic()
        w4.run(next_level(sleep, ids[0], TaskArgs().add_scalar(3000)))
        assert time.monotonic() - t0 >= 2.9
        r = row(w4, ids[0])
        assert (r["state"], r["failures"], r["reconnects"]) == ("ready", 0, 0), r


# -- failures inside and around the remote L3 ----------------------------------------------------


def test_a_sub_failure_inside_the_remote_l3_surfaces_with_its_traceback(
    hosts: RemoteHosts,
) -> None:
    with level4([hosts.endpoint(1)], num_sub_workers=1) as (w4, ids):
        fail = orch(f"{JOBS}:fail_remote", w4, ids)
        fill = orch(f"{JOBS}:fill_remote", w4, ids)
        with pytest.raises(TaskError) as info:
            w4.run(next_level(fail, ids[0], TaskArgs().add_scalar(42)))
        err = info.value
        text = str(err)
        assert err.worker_id == ids[0], text
        assert err.outcome == "TASK_FAILURE", text
        assert f"remote worker {ids[0]} (host " in text, text
        assert "SUB tests.support.sub_tasks:fail" in text, text
        # The bottom traceback: the SUB child's frame inside the remote L3.
        assert (
            "Traceback" in text
            and 'tests/support/sub_tasks.py", line' in text
            and "in fail" in text
        ), text
        assert "ValueError: producer exploded on purpose (42)" in text, text
        assert "producer exploded on purpose (42)" in err.remote_text, err.remote_text
        # The session goes on: the next run on the same worker works.
        x = w4.alloc_remote(worker=ids[0], shape=(8,), dtype="float32")
        w4.run(next_level(fill, ids[0], TaskArgs().add_tensor(x, Tag.OUTPUT).add_scalar(9)))
        assert (w4.copy_from_remote(x) == 9).all()
        assert row(w4, ids[0])["state"] == "ready"


def test_runner_sigkilled_mid_task_fails_that_run_then_reconnects(hosts: RemoteHosts) -> None:
    with level4([hosts.endpoint(0), hosts.endpoint(1)], num_sub_workers=1) as (w4, ids):
        sleep = orch(f"{EX}:sleep_for", w4, ids)
        fill = orch(f"{JOBS}:fill_remote", w4, ids)
        victim = row(w4, ids[0])["pid"]
        handle = w4.submit(next_level(sleep, ids[0], TaskArgs().add_scalar(20_000)))

        def sleeping() -> bool:
            with contextlib.suppress(TimeoutError):
                handle.wait(0.05)  # drives the Scheduler (blocking API, no thread)
            return in_sleep(victim)

        poll_for(sleeping, timeout=10.0, interval=0.02, message="the task never started")
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TaskError) as info:
            handle.wait(10.0)
        assert time.monotonic() - t0 < 5.0
        err = info.value
        assert err.outcome == "ENDPOINT_FAILURE", err
        assert f"remote worker {ids[0]} ({hosts.endpoint(0)})" in str(err), err

        # The other remote keeps working (and this run drives the pending reconnect).
        x = w4.alloc_remote(worker=ids[1], shape=(16,), dtype="float32")
        w4.run(next_level(fill, ids[1], TaskArgs().add_tensor(x, Tag.OUTPUT).add_scalar(2)))
        assert (w4.copy_from_remote(x) == 2).all()

        def reconnected() -> dict[str, Any] | None:
            r = row(w4, ids[0])
            return r if r["state"] == "ready" and r["reconnects"] == 1 else None

        r = poll_for(reconnected, timeout=15.0, interval=0.05, message="no reconnect")
        assert r is not None
        assert r["pid"] != victim and pid_alive(r["pid"]), r
        assert not pid_alive(victim)
        # Buffers went with the old session; a new one works on the new session.
        y = w4.alloc_remote(worker=ids[0], shape=(16,), dtype="float32")
        w4.run(next_level(fill, ids[0], TaskArgs().add_tensor(y, Tag.OUTPUT).add_scalar(6)))
        assert (w4.copy_from_remote(y) == 6).all()


def test_a_reconnect_to_a_frozen_host_does_not_stall_the_other_remote(
    hosts: RemoteHosts,
) -> None:
    service = hosts.workers[0].proc.pid
    with level4([hosts.endpoint(0), hosts.endpoint(1)], num_sub_workers=1, startup_timeout=3.0) as (
        w4,
        ids,
    ):
        fill = orch(f"{JOBS}:fill_remote", w4, ids)
        x = w4.alloc_remote(worker=ids[1], shape=(4,), dtype="float32")
        on1 = next_level(fill, ids[1], TaskArgs().add_tensor(x, Tag.OUTPUT).add_scalar(1))
        w4.run(on1)
        victim = row(w4, ids[0])["pid"]
        os.kill(service, signal.SIGSTOP)  # host 0 accepts connections but never answers
        try:
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda: not pid_alive(victim), 5.0, lambda: "runner not killed")
            # Keep host 1 busy until the L4 has seen host 0 fail (and one run more).
            slowest = 0.0
            deadline = time.monotonic() + 8.0
            noticed = False
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                w4.run(on1)
                slowest = max(slowest, time.monotonic() - t0)
                if noticed:
                    break
                noticed = row(w4, ids[0])["state"] != "ready"
        finally:
            os.kill(service, signal.SIGCONT)
        assert noticed, "the L4 never noticed the SIGKILLed runner"
        assert slowest < 1.5, f"a run on the healthy remote took {slowest:.1f} s"


def test_an_idle_session_failure_shows_in_list_workers(hosts: RemoteHosts) -> None:
    with level4([hosts.endpoint(1)], num_sub_workers=1, session_timeout_s=1.0) as (w4, ids):
        victim = row(w4, ids[0])["pid"]
        os.kill(victim, signal.SIGKILL)
        wait_until(
            lambda: row(w4, ids[0])["state"] != "ready" or row(w4, ids[0])["reconnects"],
            3.0,
            lambda: f"list_workers still says {row(w4, ids[0])}",
            interval=0.05,
        )


@pytest.mark.slow
def test_health_lane_cut_by_link_down_is_a_sticky_endpoint_failure(hosts: RemoteHosts) -> None:
    if not hosts.netns:
        pytest.skip("netns only: the loopback fallback has no link to take down (needs root)")
    timeout = 2.0
    with level4(
        [hosts.endpoint(0), hosts.endpoint(1)],
        session_timeout_s=timeout,
        restart_children=False,
        num_sub_workers=1,
    ) as (w4, ids):
        sleep = orch(f"{EX}:sleep_for", w4, ids)
        fill = orch(f"{JOBS}:fill_remote", w4, ids)
        victim = row(w4, ids[0])["pid"]
        handle = w4.submit(next_level(sleep, ids[0], TaskArgs().add_scalar(4_000)))
        poll_for(
            lambda: (not handle.done() and row(w4, ids[0])["busy"]) or handle.done(),
            timeout=5.0,
            message="task not dispatched",
        )
        hosts.hosts.link_down(0)
        try:
            t0 = time.monotonic()
            with pytest.raises(TaskError) as info:
                handle.wait(timeout + 5.0)
            elapsed = time.monotonic() - t0
        finally:
            hosts.hosts.link_up(0)
        err = info.value
        assert err.outcome == "ENDPOINT_FAILURE", err
        assert "health" in str(err) and f"remote worker {ids[0]}" in str(err), err
        assert timeout - 0.3 <= elapsed <= timeout + 2.0, elapsed
        # The link is back and the runner still sends health (its sleep ends now): the
        # failure stays, and a later run on that worker fails the same way.
        poll_for(lambda: not in_sleep(victim), timeout=6.0, message="runner still sleeping")
        with pytest.raises(TaskError) as later:
            w4.run(next_level(sleep, ids[0], TaskArgs().add_scalar(1)))
        assert later.value.outcome == "ENDPOINT_FAILURE", later.value
        assert "health" in str(later.value), later.value
        assert row(w4, ids[0])["state"] != "ready"
        # The other host never noticed.
        x = w4.alloc_remote(worker=ids[1], shape=(4,), dtype="float32")
        w4.run(next_level(fill, ids[1], TaskArgs().add_tensor(x, Tag.OUTPUT).add_scalar(1)))
        assert (w4.copy_from_remote(x) == 1).all()
    # The runner of the failed session notices on its own (TCP_USER_TIMEOUT, EOF).
    poll_for(lambda: not pid_alive(victim), timeout=timeout + 8.0, message="runner lingers")


# -- lifecycle: close, parent death ----------------------------------------------------------------


def test_close_leaves_no_runner_no_inner_child_and_no_shm(hosts: RemoteHosts) -> None:
    shm_before = our_shm_files()
    with level4([hosts.endpoint(0), hosts.endpoint(1)]) as (w4, ids):
        one = orch(f"{JOBS}:fill_remote", w4, ids)
        x = w4.alloc_remote(worker=ids[1], shape=(4,), dtype="float32")
        w4.run(next_level(one, ids[1], TaskArgs().add_tensor(x, Tag.OUTPUT).add_scalar(1)))
        runners = {row(w4, w)["pid"] for w in ids}
        procs = runner_processes()
        assert runners <= set(procs), procs
        assert len(procs) >= len(runners) + 2 * 2, procs  # each runner + its 2 SUB children
    assert w4.state is WorkerState.CLOSED
    wait_no_runners(10.0, "Worker.close()")
    poll_for(lambda: not (our_shm_files() - shm_before), timeout=5.0, message="shm left")


L4_SCRIPT = r"""
import json, sys
from simpler_daemon import CallConfig, TaskArgs
from simpler_daemon.remote.spec import RemoteCallable, RemoteWorkerSpec
from simpler_daemon.engine.worker import Worker

endpoints, timeout, target, ms = json.loads(sys.argv[1]), float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
w4 = Worker(level=4)
ids = [w4.add_remote_worker(RemoteWorkerSpec(endpoint=e, num_sub_workers=1,
       session_timeout_s=timeout, heap_bytes=8 << 20)) for e in endpoints]
w4.register("tests.support.sub_tasks:sleep_ms", kind="sub", workers=ids)
job = w4.register(RemoteCallable(target), workers=ids)
w4.init()
def orch(o, a, c):
    for w in ids:
        o.submit_next_level(job, TaskArgs().add_scalar(ms), CallConfig(), worker=w)
h = w4.submit(orch)
try:
    h.wait(0.3)  # dispatch (the blocking API drives the Scheduler while it waits)
except TimeoutError:
    pass
print(json.dumps([r["pid"] for r in w4.list_workers() if r["kind"] == "remote"]), flush=True)
h.wait(60)
"""


def sleeping_in_session(runner: int) -> bool:
    """The runner or one of its inner children is inside a task's sleep."""
    return any(in_sleep(p) for p in {runner} | child_pids(runner))


def sigkill_l4_parent_mid_task(
    hosts: RemoteHosts, tmp_path: Path, target: str, timeout: float, within: float, sleep_s: int
) -> None:
    """Run ``target`` (``sleep_s`` of sleep) on both hosts from an L4 in a subprocess
    with ``session_timeout_s=timeout``, SIGKILL that subprocess mid-task, and require
    every runner to exit within ``within`` seconds. The callers pick ``within`` well
    short of what a runner that missed the parent's death would take (its task's end,
    or the session timeout when EOF alone must do it), and long enough that a loaded
    machine cannot fail them."""
    out = tmp_path / "l4.out"
    argv = [
        json.dumps([hosts.endpoint(0), hosts.endpoint(1)]),
        str(timeout),
        target,
        str(sleep_s * 1000),
    ]
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", L4_SCRIPT, *argv],
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=marked_env(),
        )
    SEEN_PIDS.add(proc.pid)
    try:

        def pids() -> list[int] | None:
            text = out.read_text(errors="replace")
            for line in text.splitlines():
                if line.startswith("["):
                    return [int(p) for p in json.loads(line)]
            assert proc.poll() is None, f"L4 script exited {proc.returncode}:\n{text}"
            return None

        found = poll_for(pids, timeout=30.0, interval=0.05, message="L4 script printed no pids")
        assert found is not None
        runners = found
        assert len(runners) == 2 and all(pid_alive(p) for p in runners), runners
        poll_for(
            lambda: all(sleeping_in_session(p) for p in runners),
            timeout=10.0,
            interval=0.02,
            message="tasks not running",
        )
    finally:
        proc.kill()
        proc.wait(10)
    try:
        wait_until(
            lambda: not any(pid_alive(p) for p in runners),
            within,
            lambda: (
                f"runners outlived the SIGKILLed L4 parent (session_timeout_s={timeout}): "
                f"{runner_processes()}"
            ),
        )
    finally:
        # Either way, nothing may stay: the teardown guard waits for the rest.
        wait_no_runners(20.0, "the SIGKILLed L4 parent")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigkill_of_the_l4_parent_makes_every_runner_exit(
    hosts: RemoteHosts, tmp_path: Path
) -> None:
    """The SUB child sleeps; the runner's loop is free and sees EOF at once: it exits
    long before its 60 s session timeout or its 120 s task could end it."""
    sigkill_l4_parent_mid_task(
        hosts, tmp_path, f"{JOBS}:sleep_sub_remote", timeout=60.0, within=30.0, sleep_s=120
    )


@pytest.mark.timeout(150)
def test_sigkill_of_the_l4_parent_while_the_loop_is_blocked(
    hosts: RemoteHosts, tmp_path: Path
) -> None:
    """The orchestration itself sleeps on the runner's loop (only the health thread
    runs): the runner exits on the parent's silence (2 s), well before its 60 s task."""
    sigkill_l4_parent_mid_task(
        hosts, tmp_path, f"{EX}:sleep_for", timeout=2.0, within=30.0, sleep_s=60
    )


# -- start-up failures -------------------------------------------------------------------------------


def test_a_remote_worker_that_never_answers_fails_init_within_the_deadline(
    hosts: RemoteHosts,
) -> None:
    before = our_shm_files()
    with silent_listener() as endpoint:
        w4 = Worker(level=4, startup_timeout=2.0)
        wid = w4.add_remote_worker(RemoteWorkerSpec(endpoint=endpoint, num_sub_workers=1))
        t0 = time.monotonic()
        with pytest.raises(StartupError) as info:
            w4.init()
        elapsed = time.monotonic() - t0
        w4.close()
    # It waited for its 2 s deadline, and gave up then (the bound leaves room for load).
    assert 1.5 <= elapsed <= 15.0, elapsed
    text = str(info.value)
    assert f"remote worker {wid}" in text and endpoint in text, text
    assert w4.state in (WorkerState.FAILED, WorkerState.CLOSED)
    assert not (child_pids() - hosts.pids()) and our_shm_files() == before


def test_token_file_authenticates_and_a_wrong_token_is_refused(
    hosts: RemoteHosts, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("e2e-" + os.urandom(16).hex() + "\n")
    token.chmod(0o600)
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token\n")
    wrong.chmod(0o600)
    rw = start_worker(
        hosts.hosts, 1, tmp_path, port=19074, extra=["--token-file", str(token)], insecure=True
    )
    try:
        wait_until(lambda: "token on" in rw.log_text(), 5.0, rw.log_text)
        with level4([rw.endpoint], token_file=str(token), num_sub_workers=1) as (w4, ids):
            fill = orch(f"{JOBS}:fill_remote", w4, ids)
            x = w4.alloc_remote(worker=ids[0], shape=(4,), dtype="float32")
            w4.run(next_level(fill, ids[0], TaskArgs().add_tensor(x, Tag.OUTPUT).add_scalar(5)))
            assert (w4.copy_from_remote(x) == 5).all()
        for bad in (str(wrong), None):
            w4 = Worker(level=4, startup_timeout=10.0)
            wid = w4.add_remote_worker(
                RemoteWorkerSpec(endpoint=rw.endpoint, num_sub_workers=1, token_file=bad)
            )
            with pytest.raises(StartupError) as info:
                w4.init()
            w4.close()
            text = str(info.value)
            assert "authentication" in text, text
            assert f"remote worker {wid}" in text and rw.endpoint in text, text
        wait_no_runners(10.0)
    finally:
        assert rw.stop() == 0, rw.log_text()


def test_no_line_says_listening_before_the_worker_listens(hosts: RemoteHosts) -> None:
    """A watcher of the worker's output may connect at the first line that says
    ``listening on``: only lines printed once the socket is bound say it. (W10 took the
    ``--insecure`` warning, logged before the bind, for the ready line.)"""
    for w in hosts.workers:
        lines = w.log_text().splitlines()
        ready = lines.index(f"listening on {w.endpoint}")
        early = [line for line in lines[:ready] if "listening on" in line]
        assert not early, early
        if hosts.netns:  # a listener off loopback: the warning is printed, worded apart
            assert any("--insecure" in line for line in lines[:ready]), lines


def test_a_hostname_endpoint_is_refused_at_the_spec() -> None:
    with pytest.raises(ValueError, match="not a numeric address"):
        RemoteWorkerSpec(endpoint="remote-host.example:19073")
