"""Metrics an operator can alert on, scraped from a real daemon's /metrics.

Heap used / free / largest free block, live buffers, runs by state, CPU and resident
memory of every worker child, build info; and no ``_created`` series beside the
counters and histograms (one more series per label set that nobody alerts on).
"""

from __future__ import annotations

import os
import platform
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from simpler_daemon import __version__
from simpler_daemon.client.requests import sub_task, tensor
from simpler_daemon.server.metrics import Metrics, child_usage
from tests.support.daemon_harness import EXAMPLES, running_daemon, wait_until

HEAP = 16 << 20  # the harness's workers.heap_bytes


def samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape by (name, sorted labels); a duplicate series fails."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def test_render_has_build_info_and_no_created_series() -> None:
    m = Metrics()
    m.task_dispatched("sub")
    m.task_completed("sub", "SUCCESS", latency=0.001)
    m.run_finished("completed")
    m.grpc_request("SubmitRun", "OK")
    text = m.render().decode()
    assert "_created" not in text, [x for x in text.splitlines() if "_created" in x]
    assert 'simpler_daemon_runs_total{outcome="completed"} 1.0' in text
    assert "simpler_daemon_task_latency_seconds_count" in text
    found = samples(text)
    build = [k for k in found if k[0] == "simpler_daemon_build_info"]
    assert len(build) == 1 and ("version", __version__) in build[0][1]


def test_child_usage_reads_proc() -> None:
    usage = child_usage(os.getpid())
    assert usage is not None and usage[0] >= 0 and usage[1] > 0
    assert child_usage(2**22 + 12345) is None  # above pid_max: no such process


@pytest.mark.timeout(120)
def test_scraped_metrics_cover_heap_runs_and_children(tmp_path: Path) -> None:
    overrides = {"metrics": {"listen": "127.0.0.1:0"}}
    with running_daemon(tmp_path / "d", overrides) as d, d.client() as c:
        found = wait_until(
            lambda: re.search(r"metrics listening on 127\.0\.0\.1:(\d+)", d.stderr() + d.stdout()),
            message="the daemon never logged its metrics port",
        )
        url = f"http://127.0.0.1:{int(found.group(1))}/metrics"
        fill = c.register(f"{EXAMPLES}:fill")
        fail = c.register(f"{EXAMPLES}:fail")
        buf = c.alloc_buffer((1024,), "int32").buffer_id
        ref = tensor(buf, "output", (1024,), "int32")
        c.wait(c.submit([sub_task(fill, [ref], [3])]), timeout=60)
        c.wait_run(c.submit([sub_task(fail, [ref], [7])]), 60)  # FAILED (no raise)

        body = urllib.request.urlopen(url, timeout=10).read().decode()
        got = samples(body)

        def value(name: str, **labels: str) -> float:
            return got[(name, tuple(sorted(labels.items())))]

        assert not [k for k in got if k[0].endswith("_created")]
        python = platform.python_version()
        assert value("simpler_daemon_build_info", version=__version__, python=python) == 1.0

        size = value("simpler_daemon_heap_size_bytes")
        used = value("simpler_daemon_heap_used_bytes")
        free = value("simpler_daemon_heap_free_bytes")
        largest = value("simpler_daemon_heap_largest_free_block_bytes")
        assert size == HEAP and used >= 4096 and used + free == size
        assert 0 < largest <= free
        assert value("simpler_daemon_buffers") >= 1

        runs = {k[1][0][1]: v for k, v in got.items() if k[0] == "simpler_daemon_runs_in_state"}
        assert set(runs) == {"queued", "active", "completed", "failed", "cancelled", "lost"}
        assert runs["completed"] >= 1 and runs["failed"] >= 1

        def per_sub_worker(name: str) -> dict[str, float]:
            rows = {dict(k[1])["worker"]: v for k, v in got.items() if k[0] == name}
            kinds = {dict(k[1])["kind"] for k in got if k[0] == name}
            assert kinds == {"sub"}, kinds
            return rows

        cpu = per_sub_worker("simpler_daemon_child_cpu_seconds_total")
        rss = per_sub_worker("simpler_daemon_child_resident_memory_bytes")
        assert set(cpu) == set(rss) == {"0", "1"}, (cpu, rss)
        assert all(v >= 0 for v in cpu.values()) and all(v > 0 for v in rss.values())
