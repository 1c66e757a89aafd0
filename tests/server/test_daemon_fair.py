"""Fair admission, the daemon's side: runs of different clients share the workers.

A real daemon with two SUB workers and two client identities (the Unix socket and
TCP, see tests/support/two_clients.py). Under ``scheduler.admission = "fair"`` (the
daemon's default) a one-task run of client B submitted behind client A's
200 x 20 ms run finishes long before A's run; under ``"fifo"`` it waits for A's
whole run, as before. Two clients submitting runs in a loop with priorities 1 and
3 both progress, about 1 : 3. Order is asserted, not time: the latencies are
printed (``-s``) for the record.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from simpler_daemon.client import Client, RunFuture, RunPhase, RunResult, sub_task
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from tests.support.daemon_harness import (
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    running_daemon,
    wait_until,
)
from tests.support.two_clients import TcpAccess

pytestmark = pytest.mark.timeout(120)

TASKS = "tests.support.daemon_tasks"
CONFIG: dict[str, dict[str, Any]] = {
    "workers": {"num_sub_workers": 2},
    "callables": {"allowed_modules": ["simpler_daemon.examples", "tests"]},
}

_MODULE_DAEMONS: set[int] = set()


@pytest.fixture(scope="module")
def tcp(tmp_path_factory: pytest.TempPathFactory) -> TcpAccess:
    return TcpAccess(tmp_path_factory.mktemp("fair-tls"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tcp: TcpAccess) -> Iterator[DaemonProcess]:
    """The daemon with its default admission (fair)."""
    yield from module_daemon(tmp_path_factory, "fair", tcp.overrides(CONFIG), _MODULE_DAEMONS)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    """The conftest guard, minus the module daemon (it lives across tests on purpose)."""
    yield from module_leak_guard(lambda: set(_MODULE_DAEMONS))


def _sleeps(c: Client, n: int, ms: int) -> list[pb.Task]:
    sleep = c.register(f"{TASKS}:sleep_ms")
    return [sub_task(sleep, scalars=[ms]) for _ in range(n)]


def _small_run_behind_big_run(
    daemon: DaemonProcess, tcp: TcpAccess, n: int
) -> tuple[float, RunResult, RunFuture, int, Client, Client]:
    """A submits n x 20 ms; once A's run executes, B runs one task. Returns B's
    latency (s) and result, A's future, A's tasks done when B's run had finished,
    and the two clients."""
    a, b = daemon.client(timeout=60), tcp.client(daemon, timeout=60)
    noop = b.register(f"{TASKS}:nothing")
    big = a.submit(_sleeps(a, n, 20), label="big")
    # B submits once A's tasks are running (not after a fixed 50 ms, which a loaded
    # machine could reach before A's first task).
    wait_until(lambda: big.status().counts.running > 0, 30, "A's run never started")
    t0 = time.monotonic()
    small = b.run([sub_task(noop)], timeout=60, label="small")
    latency = time.monotonic() - t0
    done_then = big.status().counts.done
    assert small.state is RunPhase.COMPLETED
    return latency, small, big, done_then, a, b


def test_fair_a_one_task_run_is_not_stuck_behind_another_clients_big_run(
    daemon: DaemonProcess, tcp: TcpAccess
) -> None:
    with daemon.client() as c:
        assert c.get_info().limits.admission == "fair"
    latency, small, big, done_then, a, b = _small_run_behind_big_run(daemon, tcp, 200)
    with a, b:
        a_result = big.result(timeout=60)
        small_finish = small.finish_time
        print(f"\nfair: B's one-task run took {latency * 1e3:.1f} ms behind A's 200 x 20 ms run")
        # B finished while A still had most of its 200 tasks left...
        assert done_then < 100, f"A had done {done_then} of 200 tasks when B finished"
        assert small_finish is not None and a_result.finish_time is not None
        assert small_finish < a_result.finish_time
        assert a_result.counts.done == 200
        # ...and the two runs belong to two clients the daemon tells apart.
        assert a_result.client != small.client and small.client.startswith("tcp:")


def test_fifo_keeps_the_whole_run_order(tmp_path: Path, tcp: TcpAccess) -> None:
    config = tcp.overrides({**CONFIG, "scheduler": {"admission": "fifo"}})
    with running_daemon(tmp_path / "fifo", config) as d:
        with d.client() as c:
            assert c.get_info().limits.admission == "fifo"
        latency, small, big, done_then, a, b = _small_run_behind_big_run(d, tcp, 50)
        with a, b:
            a_result = big.result(timeout=60)
            print(f"\nfifo: B's one-task run took {latency * 1e3:.1f} ms behind A's 50 x 20 ms run")
            # The seed's admission: B's run waited for every task of A's run.
            assert done_then == 50
            assert small.finish_time is not None and a_result.finish_time is not None
            assert small.finish_time >= a_result.finish_time


def test_two_clients_in_a_loop_progress_in_proportion_to_priority(
    daemon: DaemonProcess, tcp: TcpAccess
) -> None:
    runs, per_run, ms = 6, 10, 10
    with daemon.client(timeout=60) as a, tcp.client(daemon, timeout=60) as b:
        a_tasks, b_tasks = _sleeps(a, per_run, ms), _sleeps(b, per_run, ms)
        low: list[RunFuture] = []
        high: list[RunFuture] = []
        for _ in range(runs):  # each client submits its runs in a loop
            low.append(a.submit(a_tasks, label="low", priority=1))
            high.append(b.submit(b_tasks, label="high", priority=3))
        for fut in high:
            assert fut.result(timeout=60).priority == 3
        low_done = sum(f.status().counts.done for f in low)
        high_done = runs * per_run
        ratio = low_done / high_done
        print(f"\npriority 1 vs 3: {low_done} vs {high_done} tasks done (ratio {ratio:.2f})")
        # Both progress; the priority-1 client gets about a third of the priority-3 one.
        assert 0 < low_done < high_done
        assert 0.1 <= ratio <= 0.6, ratio
        for fut in low:
            assert fut.result(timeout=60).priority == 1
