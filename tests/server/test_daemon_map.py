"""``Client.map`` through a real daemon (both transports): one SUB task per item, the
item as its single value, the results in order, lazily in runs of ``chunksize``; a
failed item raises after the results before it; bad arguments are refused before
anything is sent; ``as_completed`` over RunFutures.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from simpler_daemon.client import Client, NotFound, call_config, sub_task
from simpler_daemon.errors import TaskError
from simpler_daemon.futures import as_completed
from tests.support.daemon_harness import DaemonProcess, module_daemon, module_leak_guard

pytestmark = pytest.mark.timeout(120)

TASKS = "tests.support"
CONFIG: dict[str, dict[str, Any]] = {
    "workers": {"num_sub_workers": 2},
    "callables": {"allowed_modules": ["simpler_daemon.examples", "tests"]},
}
_MODULE_DAEMONS: set[int] = set()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "map", CONFIG, _MODULE_DAEMONS)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    yield from module_leak_guard(lambda: set(_MODULE_DAEMONS))


@pytest.fixture(params=["grpc", "fast"])
def c(daemon: DaemonProcess, request: pytest.FixtureRequest) -> Iterator[Client]:
    with daemon.client(timeout=60, transport=request.param) as client:
        assert client.transport == request.param
        yield client


def test_map_in_order_lazily(c: Client) -> None:
    sq = c.register(f"{TASKS}.retry_tasks:square")
    assert list(c.map(sq, range(7), chunksize=3)) == [i * i for i in range(7)]
    assert list(c.map(sq, [None, 2, 1.5])) == [None, 4, 2.25]
    assert list(c.map(sq, [])) == []
    taken = list(itertools.islice(c.map(sq, itertools.count(), chunksize=5), 12))
    assert taken == [i * i for i in range(12)]
    retried = list(c.map(sq, [3], config=call_config(max_retries=1)))
    assert retried == [9]


def test_a_failed_item_and_bad_arguments(c: Client) -> None:
    sq = c.register(f"{TASKS}.retry_tasks:square")
    out: list[Any] = []
    with pytest.raises(TaskError, match="negative item -2") as info:
        for r in c.map(sq, [1, 2, -2, 4], chunksize=2):
            out.append(r)
    assert out == [1, 4] and info.value.outcome == "TASK_FAILURE"
    with pytest.raises(TypeError, match="cannot map: expected the hashid"):
        c.map(3, [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunksize=0 must be between 1"):
        c.map(sq, [1], chunksize=0)
    with pytest.raises(TypeError, match="config must be a CallConfig message"):
        c.map(sq, [1], config={"x": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"cannot map item 1: .*values\[0\]"):
        list(c.map(sq, [1, {2}]))
    with pytest.raises(NotFound):
        list(c.map("sha256:" + "0" * 64, [1]))


def test_as_completed_over_run_futures(c: Client) -> None:
    sleep = c.register(f"{TASKS}.daemon_tasks:sleep_ms")
    nothing = c.register(f"{TASKS}.daemon_tasks:nothing")
    slow = c.submit([sub_task(sleep, scalars=[300])])
    fast = c.submit([sub_task(nothing)])
    done = list(as_completed([slow, fast], timeout=60))
    assert sorted(int(f) for f in done) == sorted([slow.run_id, fast.run_id])
    assert all(f.done() for f in done)
