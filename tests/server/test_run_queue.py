"""Backpressure: a client's runs past limits.per_client_runs wait QUEUED, not refused.

A real daemon with limits.per_client_runs = 2 and limits.per_client_queued_runs = 3,
three SUB workers and two client identities (the Unix socket and TCP, see
tests/support/two_clients.py). Runs that hold a worker until the test writes their
flag buffer (``examples.tasks:wait_for_flag``) fill the client's two slots; later
runs are accepted QUEUED, start in submission order as the active ones end, and the
sixth is refused RESOURCE_EXHAUSTED naming limits.per_client_queued_runs with a
retry-after hint. Everything is event driven: the test waits for states, never time.
"""

from __future__ import annotations

import re
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpler_daemon.cli.output import EXIT_EXHAUSTED
from simpler_daemon.cli.simplerctl import exhausted_hint
from simpler_daemon.client import Client, RunPhase, sub_task, tensor
from simpler_daemon.client.errors import ResourceExhausted
from simpler_daemon.protocol.metadata import RETRY_AFTER_METADATA
from tests.support.ctl import Ctl
from tests.support.daemon_harness import (
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    wait_until,
)
from tests.support.two_clients import TcpAccess

pytestmark = pytest.mark.timeout(180)

EXAMPLES = "simpler_daemon.examples.tasks"
FLAG_WAIT_MS = 120_000
CONFIG: dict[str, dict[str, Any]] = {
    "workers": {"num_sub_workers": 3},
    "limits": {"per_client_runs": 2, "per_client_queued_runs": 3},
    "metrics": {"listen": "127.0.0.1:0"},
}

FILL_TOML = f"""\
[buffers.out]
shape = [4]
dtype = "float32"

[[tasks]]
callable = "{EXAMPLES}:fill"
tensors = [{{ buffer = "out", tag = "output" }}]
scalars = [2]
"""

_MODULE_DAEMONS: set[int] = set()


@pytest.fixture(scope="module")
def tcp(tmp_path_factory: pytest.TempPathFactory) -> TcpAccess:
    return TcpAccess(tmp_path_factory.mktemp("queue-tls"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tcp: TcpAccess) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "queue", tcp.overrides(CONFIG), _MODULE_DAEMONS)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    """The conftest guard, minus the module daemon (it lives across tests on purpose)."""
    yield from module_leak_guard(lambda: set(_MODULE_DAEMONS))


@pytest.fixture
def c(daemon: DaemonProcess) -> Iterator[Client]:
    # gRPC: the refusal's retry-after also travels as trailing metadata there.
    with daemon.client(timeout=60, transport="grpc", retry=None) as client:
        yield client
        # Every test leaves the client's slots and queue empty for the next one.
        wait_until(
            lambda: not client.list_runs(states=["queued", "building", "prepared", "executing"]),
            60,
            "runs were left behind",
        )


class Holds:
    """Runs that each hold a SUB worker until their own flag buffer is written."""

    def __init__(self, c: Client) -> None:
        self.c = c
        self.wait = c.register(f"{EXAMPLES}:wait_for_flag")
        self.fill = c.register(f"{EXAMPLES}:fill")
        self.flags: dict[int, int] = {}  # run id -> its flag buffer
        self.buffers: list[int] = []

    def buffer(self, shape: tuple[int, ...], dtype: str) -> int:
        buffer_id = int(self.c.alloc_buffer(shape, dtype).buffer_id)
        self.buffers.append(buffer_id)
        return buffer_id

    def task(self, flag: int) -> Any:
        return sub_task(self.wait, [tensor(flag, "inout", (2,), "uint8")], [FLAG_WAIT_MS])

    def submit(self, **kw: Any) -> int:
        flag = self.buffer((2,), "uint8")
        run_id = int(self.c.submit([self.task(flag)], **kw))
        self.flags[run_id] = flag
        return run_id

    def fill_run(self, value: int, **kw: Any) -> tuple[int, int]:
        out = self.buffer((4,), "float32")
        task = sub_task(self.fill, [tensor(out, "output", (4,), "float32")], [value])
        return int(self.c.submit([task], **kw)), out

    def release(self, run_id: int) -> None:
        self.c.write_buffer(self.flags[run_id], np.array([1, 0], dtype=np.uint8))

    def release_all(self) -> None:
        for run_id in self.flags:
            self.release(run_id)

    def free(self) -> None:
        for buffer_id in self.buffers:
            self.c.free_buffer(buffer_id)

    def state(self, run_id: int) -> RunPhase:
        return self.c.wait_run(run_id, timeout=0).state

    def running(self, run_id: int) -> bool:
        return self.c.wait_run(run_id, timeout=0).counts.running > 0


def _queued(c: Client) -> list[int]:
    return sorted(r.run_id for r in c.list_runs(states=["queued"]))


def _fill_the_slots(h: Holds) -> tuple[int, int]:
    first, second = h.submit(label="a1"), h.submit(label="a2")
    wait_until(lambda: h.running(first) and h.running(second), 60, "the holds never ran")
    return first, second


def _metric(daemon: DaemonProcess, pattern: str) -> str:
    found = wait_until(
        lambda: re.search(r"metrics listening on 127\.0\.0\.1:(\d+)", daemon.stderr()),
        message="the daemon never logged its metrics port",
    )
    url = f"http://127.0.0.1:{int(found.group(1))}/metrics"
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    match = re.search(pattern, body, re.MULTILINE)
    return match.group(1) if match else ""


def test_runs_past_the_quota_queue_start_in_order_and_finish_right(
    daemon: DaemonProcess, c: Client
) -> None:
    h = Holds(c)
    try:
        first, second = _fill_the_slots(h)
        third = h.submit(label="a3")
        fourth, out4 = h.fill_run(7, label="a4")
        fifth, out5 = h.fill_run(9, label="a5")
        # Accepted, not refused: QUEUED, in ListRuns as QUEUED, counted by the metrics.
        assert _queued(c) == [third, fourth, fifth]
        assert {h.state(r) for r in (third, fourth, fifth)} == {RunPhase.QUEUED}
        assert h.state(first) is RunPhase.EXECUTING
        assert _metric(daemon, r'^simpler_daemon_runs_in_state\{state="queued"\} (\S+)$') == "3.0"
        assert _metric(daemon, r"^simpler_daemon_runs_queued\{client=\"[^\"]+\"\} (\S+)$") == "3.0"
        # The first active run ends: the oldest queued one starts, the others wait.
        h.release(first)
        assert c.wait(first, timeout=60).state is RunPhase.COMPLETED
        wait_until(lambda: h.running(third), 60, "the oldest queued run never started")
        assert _queued(c) == [fourth, fifth]
        # The next slot frees: the two fill runs start in turn and finish.
        h.release(second)
        assert c.wait(fourth, timeout=60).state is RunPhase.COMPLETED
        assert c.wait(fifth, timeout=60).state is RunPhase.COMPLETED
        assert h.state(third) is RunPhase.EXECUTING
        h.release(third)
        for run_id in (second, third):
            assert c.wait(run_id, timeout=60).state is RunPhase.COMPLETED
        assert c.read_array(out4, (4,), "float32").tolist() == [7.0] * 4
        assert c.read_array(out5, (4,), "float32").tolist() == [9.0] * 4
        for run_id in (first, second, third):  # wait_for_flag acknowledges in flag[1]
            assert c.read_array(h.flags[run_id], (2,), "uint8").tolist() == [1, 1]
        assert _metric(daemon, r"^simpler_daemon_runs_queued\{[^}]*\} (\S+)$") == ""
    finally:
        h.release_all()
        h.free()


def test_past_the_queue_bound_resource_exhausted_names_the_limit_and_a_retry_after(
    daemon: DaemonProcess,
    c: Client,
    tcp: TcpAccess,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    h = Holds(c)
    try:
        _fill_the_slots(h)
        queued = [h.submit() for _ in range(3)]
        assert _queued(c) == queued
        flag = h.buffer((2,), "uint8")
        with pytest.raises(ResourceExhausted) as info:
            c.submit([h.task(flag)])
        err = info.value
        assert "limits.per_client_queued_runs = 3" in err.details()
        assert "limits.per_client_runs = 2" in err.details()
        assert re.search(r"retry after \d+ ms$", err.details()), err.details()
        trailer = dict(err.trailing_metadata())
        assert int(trailer[RETRY_AFTER_METADATA]) > 0
        assert err.retry_after is not None and err.retry_after > 0
        assert _queued(c) == queued  # the refused run was not queued
        # simplerctl: the queued runs show QUEUED; its refusal names the limit and says
        # what to do about it (not "free buffers": no buffer is the matter here).
        ctl = Ctl(daemon.socket, capsys)
        listed = ctl.json("runs", "--state", "queued")
        assert [(r["run_id"], r["state"]) for r in listed] == [(r, "QUEUED") for r in queued[::-1]]
        spec = tmp_path / "fill.toml"
        spec.write_text(FILL_TOML)
        code, _, err = ctl("submit", str(spec))
        assert code == EXIT_EXHAUSTED, err
        assert "limits.per_client_queued_runs" in err and "retry after" in err
        assert "runs --state queued" in err and "simplerctl free" not in err
        # The fast path carries the same hint in the text.
        with daemon.client(timeout=60, transport="fast", retry=None) as fast:
            with pytest.raises(ResourceExhausted) as info:
                fast.submit([h.task(flag)])
            assert "limits.per_client_queued_runs" in info.value.details()
            assert info.value.retry_after is not None and info.value.retry_after > 0
        # Another client identity is not blocked by this one's full queue.
        with tcp.client(daemon, timeout=60) as other:
            fill = other.register(f"{EXAMPLES}:fill")
            out = int(other.alloc_buffer((4,), "float32").buffer_id)
            result = other.run([sub_task(fill, [tensor(out, "output", (4,), "float32")], [5])])
            assert result.state is RunPhase.COMPLETED
            assert other.read_array(out, (4,), "float32").tolist() == [5.0] * 4
            other.free_buffer(out)
    finally:
        h.release_all()
        for run_id in h.flags:
            c.wait(run_id, timeout=60)
        h.free()


def test_a_queued_run_is_cancelled_watched_and_keeps_its_buffers(c: Client) -> None:
    h = Holds(c)
    try:
        first, _ = _fill_the_slots(h)
        doomed, out = h.fill_run(3)
        kept = h.submit()
        assert _queued(c) == [doomed, kept]
        # Its buffers are pinned while it waits: a free is deferred, not done.
        assert c.free_buffer(out) is True
        h.buffers.remove(out)
        events = c.watch(doomed, timeout=60)
        assert next(events).state == RunPhase.QUEUED
        result = c.cancel(doomed, "not needed")
        assert not result.already_finished and result.state is RunPhase.CANCELLED
        assert [e.state for e in events][-1] == RunPhase.CANCELLED
        status = c.wait_run(doomed, timeout=10)
        assert status.state is RunPhase.CANCELLED
        assert status.error is not None and "not needed" in status.error.message
        assert status.counts.failed == 1 and status.counts.done == 0
        assert _queued(c) == [kept]
        # The cancelled run gave its pin back: the deferred free completed.
        wait_until(
            lambda: out not in [b.buffer_id for b in c.list_buffers().buffers],
            30,
            "the cancelled queued run kept its buffer pinned",
        )
        assert c.cancel(doomed).already_finished
        # The queue moves on past it.
        h.release(first)
        wait_until(lambda: h.running(kept), 60, "the next queued run never started")
    finally:
        h.release_all()
        for run_id in h.flags:
            c.wait(run_id, timeout=60)
        h.free()


def test_a_queued_submit_is_deduplicated_by_its_key_and_waited_for(c: Client) -> None:
    h = Holds(c)
    try:
        first, _ = _fill_the_slots(h)
        out = h.buffer((4,), "float32")
        task = sub_task(h.fill, [tensor(out, "output", (4,), "float32")], [4])
        run = c.submit_run([task], idempotency_key="queued-once")
        again = c.submit_run([task], idempotency_key="queued-once")
        assert again.deduplicated and again.run_id == run.run_id
        assert _queued(c) == [run.run_id]
        # A submit that waits on a queued run answers once it has run.
        h.release(first)
        waited = c.submit_run([task], idempotency_key="queued-once", wait_seconds=60)
        assert waited.deduplicated and waited.status.state == RunPhase.COMPLETED
        assert c.read_array(out, (4,), "float32").tolist() == [4.0] * 4
    finally:
        h.release_all()
        for run_id in h.flags:
            c.wait(run_id, timeout=60)
        h.free()


def test_a_drain_cancels_the_queued_runs_and_lets_the_active_finish(
    daemon: DaemonProcess, c: Client
) -> None:
    if not c.get_info().caller_is_admin:
        pytest.skip("the Unix socket client is no admin here (Drain is an admin call)")
    h = Holds(c)
    drained: list[Any] = []
    try:
        first, second = _fill_the_slots(h)
        queued = h.submit()
        with daemon.client(timeout=120) as admin:
            # Drain waits for the active runs (its grace): call it beside the test.
            drain = threading.Thread(target=lambda: drained.append(admin.drain(grace=120)))
            drain.start()
            try:
                # At once, while the active runs still hold their slots: a drain never
                # admits a queued run, it cancels it.
                status = c.wait_run(queued, timeout=60)
                assert status.state is RunPhase.CANCELLED
                assert status.error is not None and "still queued" in status.error.message
                assert h.state(first) is RunPhase.EXECUTING
                h.release(first)
                h.release(second)
            finally:
                h.release_all()
                drain.join(120)
        assert drained and drained[0].runs_cancelled == 1 and drained[0].runs_finished == 2
        for run_id in (first, second):
            assert c.wait(run_id, timeout=60).state is RunPhase.COMPLETED
    finally:
        c.resume()
        h.release_all()
        for run_id in h.flags:
            c.wait_run(run_id, timeout=60)
        h.free()


def test_the_cli_hint_follows_the_limit_that_was_hit() -> None:
    queue = "cannot submit a run: queue full (limits.per_client_queued_runs = 3): ..."
    assert "runs --state queued" in exhausted_hint(queue)
    heap = "shape: cannot allocate 64 bytes: quota limits.per_client_heap_bytes (1024 bytes)"
    assert "simplerctl free" in exhausted_hint(heap)
    streams = "cannot open another stream: quota reached (limits.max_streams_per_client = 4)"
    assert "streams" in exhausted_hint(streams) and "free" not in exhausted_hint(streams)
    regs = "cannot register a callable: quota limits.per_client_registrations (256) reached"
    assert "unregister" in exhausted_hint(regs)
    assert "limit" in exhausted_hint("something else ran out")
