"""The level-4 remote API under its edge cases: refs from a session that
ended, frees and releases deferred behind queued tasks, imported snapshots after their
owner's session died, the async forms, and no thread left behind by the blocking API.
One real simpler-remote-worker on a loopback address serves every test."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from simpler_daemon import StartupError, Tag, TaskArgs, TaskError, Worker
from simpler_daemon.remote.spec import RemoteCallable, RemoteWorkerSpec
from simpler_daemon.testing import child_pids, poll_for
from simpler_daemon.testing.netns import TestHosts
from tests.support.remote_harness import (
    RemoteWorkerProcess,
    our_shm_files,
    runner_processes,
    start_worker,
    wait_no_runners,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

JOBS = "tests.support.l3_jobs"


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteWorkerProcess]:
    hosts = TestHosts(1, use_netns=False)  # a loopback alias: this file tests the API
    hosts.start()
    try:
        rw = start_worker(hosts, 0, tmp_path_factory.mktemp("remote-api"), port=19391)
        try:
            yield rw
        finally:
            rw.stop()
    finally:
        hosts.close()


@pytest.fixture(autouse=True)
def no_leaked_children(worker: RemoteWorkerProcess) -> Iterator[None]:
    """Overrides the conftest guard: the module's remote worker outlives each test on
    purpose; nothing else may (no other child, no runner, no thread, no /dev/shm file)."""
    shm_before = our_shm_files()
    yield
    allowed = {worker.proc.pid}
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
    assert worker.proc.poll() is None, f"the remote worker died:\n{worker.log_text()}"
    assert not our_shm_files() - shm_before


@pytest.fixture
def l4(worker: RemoteWorkerProcess) -> Iterator[tuple[Worker, list[int]]]:
    w4 = Worker(level=4, startup_timeout=20.0)
    ids = [
        w4.add_remote_worker(RemoteWorkerSpec(endpoint=worker.endpoint, num_sub_workers=1))
        for _ in range(2)
    ]
    w4.register("tests.support.sub_tasks:fill", kind="sub", workers=ids)
    w4.register("tests.support.sub_tasks:consume", kind="sub", workers=ids)
    w4.register("tests.support.sub_tasks:sleep_ms", kind="sub", workers=ids)
    for name in ("fill_remote", "consume_remote", "sleep_sub_remote"):
        w4.register(RemoteCallable(f"{JOBS}:{name}"), workers=ids)
    w4.init()
    try:
        yield w4, ids
    finally:
        w4.close()
    wait_no_runners(15.0, "after close")


def orch(w4: Worker, name: str) -> object:
    from simpler_daemon.callables import CallableHandle

    return CallableHandle.for_import(f"{JOBS}:{name}", "orchestration")


def test_a_ref_from_a_session_that_ended_never_touches_the_new_sessions_buffers(
    l4: tuple[Worker, list[int]],
) -> None:
    w4, (a, _) = l4
    old = w4.alloc_remote(a, (4,), "float32")
    runner = next(r["pid"] for r in w4.list_workers() if r["worker_id"] == a)
    os.kill(runner, signal.SIGKILL)
    wait_until(
        lambda: (
            next(r for r in w4.list_workers() if r["worker_id"] == a)["reconnects"] == 1
            and next(r for r in w4.list_workers() if r["worker_id"] == a)["state"] == "ready"
        ),
        20.0,
        lambda: f"no reconnect: {w4.list_workers()}",
    )
    new = w4.alloc_remote(a, (4,), "float32")  # the new runner numbers its buffers afresh
    assert (new.buffer_id, new.generation) == (old.buffer_id, old.generation)
    for call in (
        lambda: w4.copy_to_remote(old, np.full(4, 99, "float32")),
        lambda: w4.copy_from_remote(old),
        lambda: w4.free(old),
    ):
        with pytest.raises(
            ValueError,
            match=rf"buffer {old.buffer_id} of session 1 of remote worker {a}, which ended: "
            "its data is lost",
        ):
            call()
    assert (w4.copy_from_remote(new) == 0).all()


def test_free_and_release_wait_for_a_queued_task_on_the_importer(
    l4: tuple[Worker, list[int]],
) -> None:
    w4, (a, b) = l4
    fill, consume, sleep = (
        orch(w4, n) for n in ("fill_remote", "consume_remote", "sleep_sub_remote")
    )
    x = w4.alloc_remote(a, (4,), "float32")
    out = w4.alloc_remote(b, (4,), "float32")
    w4.run(
        lambda o, _a, _c: o.submit_next_level(
            fill, TaskArgs().add_tensor(x, Tag.OUTPUT).add_scalar(3), worker=a
        )
    )
    w4.import_remote(x, b)

    def later(o: object, _a: object, _c: object) -> None:
        # b is busy for 300 ms first, so the task reading x on b is still queued when
        # x is freed below.
        o.submit_next_level(sleep, TaskArgs().add_scalar(300), worker=b)  # type: ignore[attr-defined]
        o.submit_next_level(  # type: ignore[attr-defined]
            consume,
            TaskArgs().add_tensor(x, Tag.INPUT).add_tensor(out, Tag.OUTPUT).add_scalar(1),
            worker=b,
        )

    handle = w4.submit(later)
    w4.free(x)  # deferred: the queued task still reads x's snapshot on b
    handle.wait(30.0)
    assert (w4.copy_from_remote(out) == 4).all()
    with pytest.raises(ValueError, match="not a live buffer"):
        w4.copy_from_remote(x)


def test_an_owner_that_reconnects_frees_the_snapshots_its_importers_held(
    l4: tuple[Worker, list[int]],
) -> None:
    w4, (a, b) = l4
    x = w4.alloc_remote(a, (4,), "float32")
    w4.import_remote(x, b)
    runner = next(r["pid"] for r in w4.list_workers() if r["worker_id"] == a)
    os.kill(runner, signal.SIGKILL)
    wait_until(
        lambda: (
            next(r for r in w4.list_workers() if r["worker_id"] == a)["state"] == "ready"
            and next(r for r in w4.list_workers() if r["worker_id"] == a)["reconnects"] == 1
        ),
        20.0,
        lambda: f"no reconnect: {w4.list_workers()}",
    )
    y = w4.alloc_remote(a, (4,), "float32")  # same (owner, id, generation) as x had
    w4.copy_to_remote(y, np.arange(4, dtype="float32"))
    w4.import_remote(y, b)  # b's old snapshot of x was released, so this is no clash
    consume, fill = orch(w4, "consume_remote"), orch(w4, "fill_remote")
    out = w4.alloc_remote(b, (4,), "float32")
    w4.run(
        lambda o, _a, _c: o.submit_next_level(
            consume,
            TaskArgs().add_tensor(y, Tag.INPUT).add_tensor(out, Tag.OUTPUT).add_scalar(10),
            worker=b,
        )
    )
    assert w4.copy_from_remote(out).tolist() == [10.0, 11.0, 12.0, 13.0]
    # A snapshot is read-only: writing it on the importer is refused, not silently lost;
    # NO_DEP too, which needs read-write access (as the origin requires).
    for tag in (Tag.OUTPUT, Tag.INOUT, Tag.OUTPUT_EXISTING, Tag.NO_DEP):
        with pytest.raises(ValueError, match="read-only snapshot") as info:
            w4.run(
                lambda o, _a, _c, tag=tag: o.submit_next_level(
                    fill, TaskArgs().add_tensor(y, tag).add_scalar(1), worker=b
                )
            )
        text = str(info.value)
        assert f"tensors[0] is tagged {tag.name}" in text, text  # the tensor
        assert repr(y) in text and "access read-only" in text, text  # the buffer, its access
        assert f"remote worker {b}" in text, text


def test_the_async_forms_work_on_the_workers_loop(worker: RemoteWorkerProcess) -> None:
    async def main() -> list[float]:
        w4 = Worker(level=4, startup_timeout=20.0)
        r = w4.add_remote_worker(RemoteWorkerSpec(endpoint=worker.endpoint, num_sub_workers=1))
        w4.register("tests.support.sub_tasks:fill", kind="sub", workers=[r])
        fill = w4.register(RemoteCallable(f"{JOBS}:fill_remote"), workers=[r])
        async with w4:
            x = await w4.alloc_remote_async(r, (3,), "float32")
            await w4.copy_to_remote_async(x, np.ones(3, "float32"))
            await w4.run_async(
                lambda o, _a, _c: o.submit_next_level(
                    fill, TaskArgs().add_tensor(x, Tag.INOUT).add_scalar(6), worker=r
                )
            )
            got = await w4.copy_from_remote_async(x)
            extra = await w4.add_remote_worker_async(
                RemoteWorkerSpec(endpoint=worker.endpoint, num_sub_workers=1)
            )
            assert extra == r + 1
            await w4.free_remote_async(x)
            with pytest.raises(ValueError, match="not a live buffer"):
                await w4.copy_from_remote_async(x)
            return [float(v) for v in got]

    assert asyncio.run(main()) == [6.0, 6.0, 6.0]
    wait_no_runners(15.0, "after the async Worker closed")


def test_the_blocking_api_leaves_no_thread_so_a_later_init_can_fork(
    worker: RemoteWorkerProcess,
) -> None:
    w4 = Worker(level=4, startup_timeout=20.0)
    w4.init()
    r = w4.add_remote_worker(RemoteWorkerSpec(endpoint=worker.endpoint, num_sub_workers=1))
    w4.alloc_remote(r, (4,), "float32")
    w4.close()
    assert [t.name for t in threading.enumerate()] == ["MainThread"]
    w = Worker(num_sub_workers=1, heap_bytes=1 << 20)
    w.init()  # forking needs a single-threaded process
    w.close()
    wait_no_runners(15.0, "after close")


def test_a_task_error_two_levels_down_names_the_remote_worker(
    l4: tuple[Worker, list[int]], tmp_path: Path
) -> None:
    w4, (a, _) = l4
    x = w4.alloc_remote(a, (4,), "float32")
    fill = orch(w4, "fill_remote")
    with pytest.raises(TaskError) as info:
        w4.run(
            lambda o, _a, _c: o.submit_next_level(
                fill, TaskArgs().add_tensor(x, Tag.OUTPUT), worker=a
            )
        )
    assert f"remote worker {a}" in str(info.value)


def test_init_held_up_after_the_sessions_attach_is_a_startup_error(
    worker: RemoteWorkerProcess,
) -> None:
    # As the origin: init() checks the startup deadline once more before READY. Its
    # thread is held past the deadline once the session is attached (a slow host, a stop
    # signal); the session that did attach is shut down with everything else.
    budget = 8.0
    w4 = Worker(level=4, startup_timeout=budget)
    r = w4.add_remote_worker(RemoteWorkerSpec(endpoint=worker.endpoint, num_sub_workers=1))
    w4.register(RemoteCallable(f"{JOBS}:fill_remote"), workers=[r])
    attached: list[int] = []

    def held_up() -> None:
        attached.append(len(runner_processes()))
        poll_for(lambda: time.monotonic() > called + budget + 0.5, timeout=30, interval=0.05)

    w4._after_attach = held_up
    called = time.monotonic()
    try:
        with pytest.raises(StartupError, match=r"past startup_timeout=8 s") as info:
            w4.init()
    finally:
        w4.close()
    assert attached and attached[0] >= 1, attached  # the session's runner was up
    assert "every child started" in str(info.value)
    wait_no_runners(15.0, "after the late init rolled back")
