"""A remote task past its ``deadline_ms`` is stopped inside the runner, as a local one
is: the SUB child running it is killed and replaced, the task fails with the local
deadline's words, and the session with its buffers goes on serving.

A real ``simpler-remote-worker`` on a test host (a network namespace as root, a
loopback alias otherwise) and a level-4 Worker in this process."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from simpler_daemon import CallConfig, Tag, TaskArgs, TaskError, Worker
from simpler_daemon.callables import CallableHandle
from simpler_daemon.remote.spec import RemoteCallable, RemoteWorkerSpec
from simpler_daemon.testing import child_pids, poll_for
from simpler_daemon.testing.netns import TestHosts
from tests.support.remote_harness import (
    RemoteWorkerProcess,
    our_shm_files,
    start_worker,
    wait_no_runners,
)

pytestmark = pytest.mark.timeout(120)

JOBS = "tests.support.l3_jobs"


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteWorkerProcess]:
    hosts = TestHosts(1)
    hosts.start()
    try:
        rw = start_worker(hosts, 0, tmp_path_factory.mktemp("remote-deadline"), port=19393)
        try:
            yield rw
        finally:
            rw.stop()
    finally:
        hosts.close()


@pytest.fixture(autouse=True)
def no_leaked_children(worker: RemoteWorkerProcess) -> Iterator[None]:
    """Overrides the conftest guard: the module's remote worker outlives each test on
    purpose; nothing else may (no other child, no runner, no /dev/shm file)."""
    shm_before = our_shm_files()
    yield
    poll_for(
        lambda: not (child_pids() - {worker.proc.pid}),
        timeout=10.0,
        message=f"child processes outlived the test: {child_pids() - {worker.proc.pid}}",
    )
    wait_no_runners(10.0)
    assert worker.proc.poll() is None, f"the remote worker died:\n{worker.log_text()}"
    assert not our_shm_files() - shm_before


def orch(name: str) -> CallableHandle:
    return CallableHandle.for_import(f"{JOBS}:{name}", "orchestration")


def row(w4: Worker, r: int) -> dict[str, object]:
    return next(x for x in w4.list_workers() if x["worker_id"] == r)


def test_a_task_past_its_deadline_is_stopped_and_the_session_survives(
    worker: RemoteWorkerProcess,
) -> None:
    w4 = Worker(level=4, startup_timeout=30.0)
    r = w4.add_remote_worker(
        RemoteWorkerSpec(endpoint=worker.endpoint, num_sub_workers=1, session_timeout_s=10.0)
    )
    for sub in ("sleep_ms", "record_pid"):
        w4.register(f"tests.support.sub_tasks:{sub}", kind="sub", workers=[r])
    for name in ("sleep_sub_remote", "record_pid_remote"):
        w4.register(RemoteCallable(f"{JOBS}:{name}"), workers=[r])
    sleep, record = orch("sleep_sub_remote"), orch("record_pid_remote")
    w4.init()
    try:
        pids = w4.alloc_remote(r, (2,), "int64")
        keep = w4.alloc_remote(r, (4,), "float32")
        w4.copy_to_remote(keep, np.arange(1, 5, dtype="float32"))

        def record_at(i: int) -> None:
            w4.run(
                lambda o, _a, _c: o.submit_next_level(
                    record, TaskArgs().add_tensor(pids, Tag.INOUT).add_scalar(i), worker=r
                )
            )

        record_at(0)
        first_pid = int(w4.copy_from_remote(pids)[0])
        before = row(w4, r)

        # The SUB task sleeps 60 s; its run may take 1.5 s.
        t0 = time.monotonic()
        with pytest.raises(TaskError) as info:
            w4.run(
                lambda o, _a, _c: o.submit_next_level(
                    sleep, TaskArgs().add_scalar(60_000), CallConfig(deadline_ms=1500), worker=r
                )
            )
        took = time.monotonic() - t0
        err = info.value
        text = str(err)
        assert err.outcome == "TASK_FAILURE", text  # not ENDPOINT_FAILURE: the session lives
        assert "deadline exceeded (1500 ms)" in text, text
        assert f"remote worker {r}" in text, text
        # Answered at the deadline, not after the SUB task's 60 s.
        assert took < 30.0, took

        # The session, and the buffers on it, are the same.
        after = row(w4, r)
        assert after["state"] == "ready", after
        assert after["session_id"] == before["session_id"], (before, after)
        assert after["pid"] == before["pid"], (before, after)
        assert after.get("reconnects", 0) == before.get("reconnects", 0), (before, after)
        assert w4.copy_from_remote(keep).tolist() == [1.0, 2.0, 3.0, 4.0]

        # The next run on the same session succeeds, on a new SUB child.
        record_at(1)
        got = w4.copy_from_remote(pids)
        assert int(got[0]) == first_pid
        assert int(got[1]) not in (0, first_pid), got
        assert row(w4, r)["session_id"] == before["session_id"]
    finally:
        w4.close()
    wait_no_runners(15.0, "after close")
