"""Metrics: recorded values render in the Prometheus format; /metrics is served on the loop."""

from __future__ import annotations

import asyncio
import contextlib

import prometheus_client
import pytest

from simpler_daemon.server.metrics import LATENCY_BUCKETS, Metrics


def test_recorded_values_render() -> None:
    m = Metrics()
    for _ in range(3):
        m.task_dispatched("sub")
    m.task_dispatched("chip")
    m.task_completed("sub", "SUCCESS", latency=0.000_02)
    m.task_completed("sub", "TASK_FAILURE", latency=2.0)
    m.task_completed("chip", "ENDPOINT_FAILURE")
    m.observe_task_latency("chip", 0.5)
    m.run_finished("completed")
    m.run_finished("failed")
    m.run_finished("failed")
    m.set_queue_depth("sub", 12)
    m.set_lanes("chip", "busy", 2)
    m.set_lanes("chip", "idle", 0)
    m.child_restarted("sub")
    m.grpc_request("SubmitRun", "OK")
    m.grpc_request("SubmitRun", "INVALID_ARGUMENT")

    text = m.render().decode()
    expected = [
        'simpler_daemon_tasks_dispatched_total{kind="sub"} 3.0',
        'simpler_daemon_tasks_dispatched_total{kind="chip"} 1.0',
        'simpler_daemon_tasks_completed_total{kind="sub",outcome="SUCCESS"} 1.0',
        'simpler_daemon_tasks_completed_total{kind="sub",outcome="TASK_FAILURE"} 1.0',
        'simpler_daemon_tasks_completed_total{kind="chip",outcome="ENDPOINT_FAILURE"} 1.0',
        'simpler_daemon_runs_total{outcome="failed"} 2.0',
        'simpler_daemon_queue_depth{queue="sub"} 12.0',
        'simpler_daemon_lanes{kind="chip",state="busy"} 2.0',
        'simpler_daemon_lanes{kind="chip",state="idle"} 0.0',
        'simpler_daemon_child_restarts_total{kind="sub"} 1.0',
        'simpler_daemon_grpc_requests_total{code="OK",method="SubmitRun"} 1.0',
        'simpler_daemon_task_latency_seconds_count{kind="sub"} 2.0',
        'simpler_daemon_task_latency_seconds_count{kind="chip"} 1.0',
        'simpler_daemon_task_latency_seconds_bucket{kind="sub",le="1e-05"} 0.0',
        'simpler_daemon_task_latency_seconds_bucket{kind="sub",le="2.5e-05"} 1.0',
        'simpler_daemon_task_latency_seconds_bucket{kind="sub",le="10.0"} 2.0',
        'simpler_daemon_task_latency_seconds_bucket{kind="chip",le="0.5"} 1.0',
        "# TYPE simpler_daemon_task_latency_seconds histogram",
        "# TYPE simpler_daemon_queue_depth gauge",
    ]
    for line in expected:
        assert line in text, line
    assert "process_resident_memory_bytes" in text or "python_info" in text


def test_latency_buckets_span_10us_to_10s() -> None:
    assert LATENCY_BUCKETS[0] == 1e-5
    assert LATENCY_BUCKETS[-1] == 10.0
    assert list(LATENCY_BUCKETS) == sorted(set(LATENCY_BUCKETS))


def test_registries_are_private() -> None:
    a, b = Metrics(), Metrics(runtime_metrics=False)  # no duplicate-name error
    a.task_dispatched("sub")
    assert b"tasks_dispatched_total{" not in b.render()
    assert b"process_" not in b.render()
    assert (
        prometheus_client.REGISTRY.get_sample_value("simpler_daemon_tasks_dispatched_total") is None
    )
    assert "simpler_daemon_tasks_dispatched" not in prometheus_client.generate_latest().decode()


async def request(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        async with asyncio.timeout(10):
            data = await reader.read()  # the server closes after one response
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split(" ")[1]), headers, body


def get(path: str, method: str = "GET", extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n{extra}\r\n".encode()


@pytest.mark.asyncio
async def test_http_listener_serves_metrics() -> None:
    m = Metrics()
    m.task_dispatched("sub")
    await m.start("127.0.0.1", 0)
    try:
        port = m.port
        assert port is not None and port > 0
        assert m.addresses == [("127.0.0.1", port)]

        status, headers, body = await request(port, get("/metrics"))
        assert status == 200
        assert headers["content-type"].startswith("text/plain; version=0.0.4")
        assert int(headers["content-length"]) == len(body)
        assert b'simpler_daemon_tasks_dispatched_total{kind="sub"} 1.0' in body

        status, _, body = await request(port, get("/metrics?x=1"))
        assert status == 200 and b"simpler_daemon_tasks_dispatched_total" in body

        status, headers, body = await request(
            port, get("/metrics", extra="Accept: application/openmetrics-text; version=1.0.0\r\n")
        )
        assert status == 200
        assert headers["content-type"].startswith("application/openmetrics-text")
        assert body.rstrip().endswith(b"# EOF")

        status, headers, body = await request(port, get("/metrics", method="HEAD"))
        assert status == 200 and body == b"" and int(headers["content-length"]) > 0

        for path in ("/", "/metricsx", "/favicon.ico"):
            status, _, _ = await request(port, get(path))
            assert status == 404, path

        status, headers, _ = await request(port, get("/metrics", method="POST"))
        assert status == 405 and headers["allow"] == "GET, HEAD"

        status, _, _ = await request(port, b"garbage\r\n\r\n")
        assert status == 400
    finally:
        await m.close()
    assert m.closed and m.port is None
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


@pytest.mark.asyncio
async def test_close_drops_idle_connections() -> None:
    m = Metrics(runtime_metrics=False)
    await m.start("127.0.0.1", 0)
    assert m.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", m.port)
    writer.write(b"GET /metr")  # never finishes its request
    await writer.drain()
    await asyncio.sleep(0)  # let the server accept it
    async with asyncio.timeout(10):
        await m.close()
        # The unread request bytes may make the kernel answer the close with RST.
        with contextlib.suppress(ConnectionResetError):
            assert await reader.read() == b""
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
    await m.close()  # idempotent


@pytest.mark.asyncio
async def test_start_twice_or_after_close_is_refused() -> None:
    m = Metrics(runtime_metrics=False)
    await m.start("127.0.0.1", 0)
    try:
        with pytest.raises(RuntimeError, match="already started"):
            await m.start("127.0.0.1", 0)
    finally:
        await m.close()
    with pytest.raises(RuntimeError, match="closed"):
        await m.start("127.0.0.1", 0)


def test_task_counts_render_as_prometheus_client_children_would() -> None:
    """The per-task counts are plain integers (server/task_tally.py), not Counter and
    Histogram children: their series are what those children render, bucket edges
    included (``le`` is inclusive)."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    reg = CollectorRegistry()
    dispatched = Counter("tasks_dispatched", "", ["kind"], namespace="simpler_daemon", registry=reg)
    completed = Counter(
        "tasks_completed", "", ["kind", "outcome"], namespace="simpler_daemon", registry=reg
    )
    latency = Histogram(
        "task_latency_seconds",
        "",
        ["kind"],
        namespace="simpler_daemon",
        registry=reg,
        buckets=LATENCY_BUCKETS,
    )
    m = Metrics(runtime_metrics=False)
    samples = [0.0, 1e-5, 1.1e-5, 2.5e-5, 0.5, 10.0, 11.0, 3e-4]
    for kind in ("sub", "chip"):
        for i, seconds in enumerate(samples):
            outcome = "SUCCESS" if i % 3 else "TASK_FAILURE"
            m.task_dispatched(kind)
            dispatched.labels(kind).inc()
            m.task_completed(kind, outcome, latency=seconds)
            completed.labels(kind, outcome).inc()
            latency.labels(kind).observe(seconds)
    m.task_completed("sub", "ENDPOINT_FAILURE")  # no latency: counted, not observed
    completed.labels("sub", "ENDPOINT_FAILURE").inc()

    def series(text: str) -> set[str]:
        return {
            line
            for line in text.splitlines()
            if line.startswith("simpler_daemon_task") and "_created" not in line
        }

    ours = series(m.render().decode())
    assert ours == series(generate_latest(reg).decode())
    assert 'simpler_daemon_task_latency_seconds_bucket{kind="sub",le="1e-05"} 2.0' in ours
