"""The daemon end to end: a real ``simpler-daemon serve`` subprocess, driven over gRPC.

One flow owns its own daemon (start -> READY=1 -> register -> buffers -> DAG ->
watch -> read back -> SIGTERM -> exit 0, no process or /dev/shm file left);
the other tests share one module daemon.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from simpler_daemon.client import AsyncClient, make_args, sub_task, tensor
from simpler_daemon.errors import TaskError
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.testing import leaked_shm, shm_files
from tests.support.daemon_harness import (
    EXAMPLES,
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    overrides = {"metrics": {"listen": f"127.0.0.1:{_free_port()}"}}
    yield from module_daemon(tmp_path_factory, "e2e", overrides)


@pytest.fixture(autouse=True)
def no_leaked_children(daemon: DaemonProcess) -> Iterator[None]:
    """Overrides the conftest guard: the module daemon lives across tests on purpose."""
    yield from module_leak_guard(lambda: {daemon.pid})


def test_dag_flow_then_sigterm(tmp_path: Path) -> None:
    """The whole life of a daemon, checked the way systemd and a client see it."""
    shm_before = shm_files()
    overrides = {
        "daemon": {"log_format": "json"},
        "grpc": {"socket_group": str(os.getgid())},
    }
    d = DaemonProcess(tmp_path / "d", overrides, env={"WATCHDOG_USEC": "200000"})
    try:
        d.start()
        assert f"socket {d.socket}" in d.stdout()
        st = Path(d.socket).stat()
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == os.getgid()
        wait_until(lambda: d.notify.seen("WATCHDOG", "1"), message="no WATCHDOG=1 ping")
        assert d.notify.seen("STATUS")
        assert len(d.worker_pids) == 2 and all(d.worker_pids)

        with d.client() as c:
            fill = c.register(f"{EXAMPLES}:fill")
            add = c.register(f"{EXAMPLES}:add")
            scale = c.register(f"{EXAMPLES}:scale")
            x = np.arange(16, dtype=np.float32)
            a = c.alloc_array(x, label="a")
            b = c.alloc_buffer((16,), "float32", label="b").buffer_id
            out = c.alloc_buffer((16,), "float32", label="out").buffer_id

            def t(buf: int, tag: str) -> pb.TensorRef:
                return tensor(buf, tag, (16,), "float32")

            # b = 5; out = a + b; out *= 3. Each step reads what the previous one wrote.
            tasks = [
                sub_task(fill, [t(b, "output")], [5]),
                sub_task(add, [t(a, "input"), t(b, "input"), t(out, "output")]),
                sub_task(scale, [t(out, "inout")], [3]),
            ]
            run_id = c.submit(tasks, label="dag")
            events = list(c.watch(run_id))
            assert events[0].type == pb.RUN_EVENT_TYPE_SNAPSHOT
            last = events[-1]
            assert last.type == pb.RUN_EVENT_TYPE_RUN_STATE
            assert last.state == pb.RUN_STATE_COMPLETED
            assert last.counts.total == 3 and last.counts.done == 3 and last.counts.failed == 0
            status = c.wait(run_id, timeout=10)
            assert status.label == "dag" and status.finish_time is not None
            np.testing.assert_array_equal(c.read_array(out, (16,), "float32"), (x + 5) * 3)

            # Dependencies: the three tasks ran strictly in order.
            completed = [e.task_index for e in events if e.type == pb.RUN_EVENT_TYPE_TASK_COMPLETED]
            if completed:  # a watcher that joined late sees only the snapshot
                assert completed == sorted(completed)

        code = d.stop(signal.SIGTERM)
        assert code == 0, d.stderr()
        assert d.notify.seen("STOPPING", "1")
        d.children_gone()
        assert not Path(d.socket).exists()
        assert not leaked_shm(shm_before)
        logs = [json.loads(line) for line in d.stderr().splitlines() if line.strip()]
        assert {"time", "level", "logger", "message", "pid"} <= set(logs[0])
        assert any(entry["message"].startswith("ready: serving on unix:") for entry in logs)
    finally:
        d.kill()


def test_sigterm_cancels_runs_after_the_grace_period(tmp_path: Path) -> None:
    """Admitted runs get daemon.shutdown_grace, then are cancelled; a watcher sees it."""
    d = DaemonProcess(tmp_path / "grace", {"daemon": {"shutdown_grace": 0.3}})
    try:
        d.start()
        with d.client() as c:
            wait_h = c.register(f"{EXAMPLES}:wait_for_flag")
            fill = c.register(f"{EXAMPLES}:fill")
            flag = c.alloc_buffer((2,), "uint8").buffer_id
            out = c.alloc_buffer((4,), "int32").buffer_id
            # The gated task gives up after 1.5 s; the fill behind it never starts.
            run_id = c.submit(
                [
                    sub_task(wait_h, [tensor(flag, "inout", (2,), "uint8")], [1500]),
                    sub_task(
                        fill,
                        [
                            tensor(flag, "input", (2,), "uint8"),
                            tensor(out, "output", (4,), "int32"),
                        ],
                        [1],
                    ),
                ]
            )
            events = c.watch(run_id)
            assert next(events).type == pb.RUN_EVENT_TYPE_SNAPSHOT
            d.send(signal.SIGTERM)
            rest = list(events)
        assert rest[-1].type == pb.RUN_EVENT_TYPE_RUN_STATE
        assert rest[-1].state == pb.RUN_STATE_CANCELLED
        assert "daemon stopping (SIGTERM)" in rest[-1].message
        assert d.wait(30) == 0, d.stderr()
        assert d.notify.seen("STOPPING", "1")
        d.children_gone()
    finally:
        d.kill()


def test_buffer_streams_in_chunks(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        data = np.arange(1000, dtype=np.int64)
        buf = c.alloc_buffer(data.shape, data.dtype).buffer_id
        assert c.write_buffer(buf, data[:500], chunk_bytes=333) == 4000
        assert c.write_buffer(buf, data[500:], offset=4000, chunk_bytes=1000) == 4000
        chunks = list(
            c.stub.ReadBuffer(
                pb.ReadBufferRequest(buffer_id=buf, offset=8, length=80, chunk_bytes=24)
            )
        )
        assert [x.offset for x in chunks] == [8, 32, 56, 80] and len(chunks[-1].data) == 8
        assert np.frombuffer(b"".join(x.data for x in chunks), np.int64).tolist() == list(
            range(1, 11)
        )
        np.testing.assert_array_equal(c.read_array(buf, (1000,), np.int64), data)
        alloc = c.list_buffers()
        assert any(b.buffer_id == buf and b.nbytes == 8000 for b in alloc.buffers)


def test_watch_sees_dispatch_and_completion(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        wait_h = c.register(f"{EXAMPLES}:wait_for_flag")
        fill = c.register(f"{EXAMPLES}:fill")
        flag = c.alloc_buffer((2,), "uint8").buffer_id
        out = c.alloc_buffer((4,), "int64").buffer_id
        f = tensor(flag, "inout", (2,), "uint8")
        run_id = c.submit(
            [
                sub_task(wait_h, [f], [20_000]),
                sub_task(fill, [tensor(out, "output", (4,), "int64")], [9]),
            ]
        )
        events = c.watch(run_id)
        first = next(events)
        assert first.type == pb.RUN_EVENT_TYPE_SNAPSHOT and first.counts.total == 2
        # The gate holds task 0; release it through WriteBuffer while watching.
        c.write_buffer(flag, b"\x01")
        rest = list(events)
        kinds = [e.type for e in rest]
        assert pb.RUN_EVENT_TYPE_TASK_COMPLETED in kinds
        assert rest[-1].state == pb.RUN_STATE_COMPLETED
        assert [e.sequence for e in rest] == sorted(e.sequence for e in rest)
        assert c.read_array(flag, (2,), "uint8").tolist() == [1, 1]
        assert c.read_array(out, (4,), "int64").tolist() == [9] * 4

        # A late subscriber gets the final state at once.
        late = list(c.watch(run_id))
        assert [e.type for e in late] == [pb.RUN_EVENT_TYPE_SNAPSHOT, pb.RUN_EVENT_TYPE_RUN_STATE]
        assert late[0].state == pb.RUN_STATE_COMPLETED and late[0].counts.done == 2


def test_failed_run_reports_task_error(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        fail = c.register(f"{EXAMPLES}:fail")
        fill = c.register(f"{EXAMPLES}:fill")
        buf = c.alloc_buffer((4,), "int32").buffer_id
        ref = tensor(buf, "inout", (4,), "int32")
        run_id = c.submit([sub_task(fail, [ref], [7]), sub_task(fill, [ref], [1])])
        with pytest.raises(TaskError) as info:
            c.wait(run_id, timeout=10)
        err = info.value
        assert err.run_id == run_id and err.outcome == "TASK_FAILURE"
        assert "example failure (scalar 7)" in err.remote_text
        assert err.hashid == fail and err.worker_id is not None
        status = c.wait_run(run_id, 0)
        assert status.state == pb.RUN_STATE_FAILED and status.error.task_index == 0
        assert status.counts.failed == 2 and status.counts.done == 0  # the consumer never ran
        # The pool is fine: the next run works.
        ok = c.submit([sub_task(fill, [ref], [3])])
        c.wait(ok, timeout=10)
        assert c.read_array(buf, (4,), "int32").tolist() == [3] * 4


def test_local_client_maps_a_buffer_and_writes_in_place(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        scale = c.register(f"{EXAMPLES}:scale")
        buf = c.alloc_buffer((6,), "float64").buffer_id
        view = c.map_buffer(buf)
        assert view.shape == (6,) and view.dtype == np.float64
        view[:] = np.arange(6)  # no WriteBuffer: the daemon's tasks see these bytes
        c.run([sub_task(scale, [tensor(buf, "inout", (6,), "float64")], [3])], timeout=10)
        assert view.tolist() == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]
        assert c.read_array(buf, (6,), "float64").tolist() == view.tolist()


def test_submit_and_wait_in_one_call(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        fill = c.register(f"{EXAMPLES}:fill")
        fail = c.register(f"{EXAMPLES}:fail")
        buf = c.alloc_buffer((4,), "int32").buffer_id
        status = c.run([sub_task(fill, [tensor(buf, "output", (4,), "int32")], [5])], timeout=10)
        assert status.state == pb.RUN_STATE_COMPLETED and status.counts.done == 1
        assert c.read_array(buf, (4,), "int32").tolist() == [5] * 4
        with pytest.raises(TaskError, match="example failure"):
            c.run([sub_task(fail, [], [1])], timeout=10)
        # wait_seconds=0: accepted at once, status reports the run as it stands.
        response = c.submit_run([sub_task(fill, [], [0])], wait_seconds=0)
        assert response.run_id > 0 and response.HasField("status")


def test_run_orchestration(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        c.register(f"{EXAMPLES}:add")
        c.register(f"{EXAMPLES}:scale")
        orch = c.register(f"{EXAMPLES}:add_scaled", kind="orchestration")
        a = c.alloc_array(np.arange(10, dtype=np.float64))
        b = c.alloc_array(np.full(10, 2.0))
        out = c.alloc_buffer((10,), "float64").buffer_id
        args = make_args(
            [
                tensor(a, "input", (10,), "float64"),
                tensor(b, "input", (10,), "float64"),
                tensor(out, "output", (10,), "float64"),
            ],
            [4],
        )
        run_id = c.run_orchestration(orch, args, label="orch")
        status = c.wait(run_id, timeout=10)
        assert status.counts.total == 3 and status.counts.done == 3
        np.testing.assert_array_equal(c.read_array(out, (10,), "float64"), (np.arange(10) + 2) * 4)


def test_health_reflection_metrics_and_listing(daemon: DaemonProcess) -> None:
    channel = grpc.insecure_channel(f"unix:{daemon.socket}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "simpler.daemon.v1.Daemon"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert "simpler.daemon.v1.Daemon" in names
    finally:
        channel.close()

    with daemon.client() as c:
        info = c.get_info()
        assert info.serving_state == pb.SERVING_STATE_SERVING and info.level == 3
        assert info.num_sub_workers == 2 and info.pid == daemon.pid
        assert info.limits.max_tasks_per_run == 1000
        workers = c.list_workers()
        assert sorted(w.pid for w in workers) == sorted(daemon.worker_pids)
        assert {w.kind for w in workers} == {pb.WORKER_KIND_SUB}
        h = c.register(f"{EXAMPLES}:empty")
        assert any(x.hashid == h and x.kind == pb.CALLABLE_KIND_SUB for x in c.list_callables())
        buf = c.alloc_buffer((3, 4), "int16", label="listed")
        listed = {b.buffer_id: b for b in c.list_buffers().buffers}
        assert listed[buf.buffer_id].shape == [3, 4] and listed[buf.buffer_id].dtype == "int16"
        assert listed[buf.buffer_id].label == "listed"
        assert not c.free_buffer(buf.buffer_id)
        assert buf.buffer_id not in {b.buffer_id for b in c.list_buffers().buffers}
        c.wait(c.submit([sub_task(h)]), timeout=10)

    port = int(
        next(line for line in daemon.config_path.read_text().splitlines() if "listen" in line)
        .rsplit(":", 1)[1]
        .strip('"')
    )
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "simpler_daemon_tasks_completed_total" in body
    assert 'simpler_daemon_grpc_requests_total{code="OK",method="SubmitRun"}' in body


@pytest.mark.asyncio
async def test_async_client(daemon: DaemonProcess) -> None:
    async with AsyncClient(daemon.socket) as c:
        fill = await c.register(f"{EXAMPLES}:fill")
        buf = await c.alloc_array(np.zeros(6, dtype=np.int32))
        run_id = await c.submit([sub_task(fill, [tensor(buf, "output", (6,), "int32")], [4])])
        events = [e async for e in c.watch(run_id)]
        assert events[-1].state == pb.RUN_STATE_COMPLETED
        await c.wait(run_id, timeout=10)
        assert (await c.read_array(buf, (6,), "int32")).tolist() == [4] * 6
