"""GetRunTrace through a real daemon: ``Client.trace`` and ``AsyncClient.trace`` over
both transports and ``simplerctl trace RUN -o FILE`` give the run's task attempts as a
Chrome trace (checked against the format's rules, tests/support/trace_check.py); a
queued run's trace has no task yet; another client may not read a run's trace; bad run
ids are refused before anything is sent, unknown ones by the daemon.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from simpler_daemon.client import AsyncClient, Client, sub_task
from simpler_daemon.client.errors import NotFound, PermissionDenied
from tests.support.ctl import Ctl
from tests.support.daemon_harness import (
    EXAMPLES,
    DaemonProcess,
    module_daemon,
    module_leak_guard,
)
from tests.support.trace_check import check_chrome_trace, task_events
from tests.support.two_clients import TcpAccess

pytestmark = pytest.mark.timeout(120)

TASKS = "tests.support.daemon_tasks"
CONFIG: dict[str, dict[str, Any]] = {
    "workers": {"num_sub_workers": 2},
    "limits": {"per_client_runs": 1},  # a second run of one client waits QUEUED
    "callables": {"allowed_modules": ["simpler_daemon.examples", "tests"]},
}
_MODULE_DAEMONS: set[int] = set()


@pytest.fixture(scope="module")
def tcp(tmp_path_factory: pytest.TempPathFactory) -> TcpAccess:
    return TcpAccess(tmp_path_factory.mktemp("trace-tls"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tcp: TcpAccess) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "trace", tcp.overrides(CONFIG), _MODULE_DAEMONS)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    yield from module_leak_guard(lambda: set(_MODULE_DAEMONS))


@pytest.fixture(params=["grpc", "fast"])
def c(daemon: DaemonProcess, request: pytest.FixtureRequest) -> Iterator[Client]:
    with daemon.client(timeout=60, transport=request.param) as client:
        assert client.transport == request.param
        yield client


def test_trace_of_a_finished_run(c: Client) -> None:
    echo = c.register(f"{TASKS}:echo")
    fail = c.register(f"{EXAMPLES}:fail")
    done = c.run([sub_task(echo, scalars=[1]), sub_task(echo, scalars=[2])])
    doc = c.trace(done.run_id)
    evs = task_events(doc)
    assert [(e["args"]["task"], e["args"]["attempt"], e["args"]["outcome"]) for e in evs] == [
        (0, 1, "SUCCESS"),
        (1, 1, "SUCCESS"),
    ]
    assert {e["name"] for e in evs} == {f"{TASKS}:echo"}
    assert {e["tid"] for e in evs} <= {1, 2}
    names = {(m["tid"], m["args"]["name"]) for m in doc["traceEvents"] if m["ph"] == "M"}
    assert (0, "run") in names
    proc = [m for m in doc["traceEvents"] if m["name"] == "process_name"]
    assert proc[0]["args"]["name"].startswith("simpler-daemon level 3")
    span = [e for e in doc["traceEvents"] if e["name"] == f"run {done.run_id}"]
    assert span[0]["args"] == {"run_id": done.run_id, "state": "COMPLETED"}
    assert doc["otherData"]["run_id"] == done.run_id and doc["otherData"]["attempts"] == 2
    failed = c.submit([sub_task(fail)])
    failed.exception(timeout=30)
    evs = task_events(c.trace(failed.run_id))
    assert [e["args"]["outcome"] for e in evs] == ["TASK_FAILURE"]


def test_trace_of_a_running_run_and_the_async_client(c: Client, daemon: DaemonProcess) -> None:
    sleep = c.register(f"{TASKS}:sleep_ms")
    nothing = c.register(f"{TASKS}:nothing")
    fut = c.submit([sub_task(nothing), sub_task(sleep, scalars=[800])])
    queued = c.submit([sub_task(nothing)])  # behind the sleeper (limits.per_client_runs)
    early = c.trace(queued.run_id)
    running = c.trace(fut.run_id)  # while the sleeper runs (or already done: both valid)
    check_chrome_trace(running)
    fut.result(timeout=30)
    assert early["otherData"]["state"] == "QUEUED"  # the sleeper holds it for 800 ms
    assert task_events(early) == [] and early["otherData"]["attempts"] == 0
    queued.result(timeout=30)
    assert len(task_events(c.trace(queued.run_id))) == 1

    async def go() -> dict[str, Any]:
        async with AsyncClient(daemon.socket, timeout=60, transport=c.transport) as ac:
            return await ac.trace(fut.run_id)

    doc = asyncio.run(go())
    assert [e["args"]["task"] for e in task_events(doc)] == [0, 1]
    sleeper = task_events(doc)[1]
    assert sleeper["dur"] >= 700_000  # 800 ms asleep, in microseconds


def test_bad_and_unknown_run_ids_and_another_clients_run(
    c: Client, daemon: DaemonProcess, tcp: TcpAccess
) -> None:
    for bad in (0, -1, "3", True, 1 << 64):
        with pytest.raises(
            ValueError, match=r"cannot read the trace of run .*: a run id is an int >= 1"
        ):
            c.trace(bad)  # type: ignore[arg-type]
    with pytest.raises(NotFound, match="never submitted"):
        c.trace(10**9)
    nothing = c.register(f"{TASKS}:nothing")
    with tcp.client(daemon, timeout=60) as other:
        theirs = other.run([sub_task(nothing)])
        assert task_events(other.trace(theirs.run_id))  # the owner reads it
        mine = c.run([sub_task(nothing)])
        with pytest.raises(PermissionDenied, match=f"cannot trace run {mine.run_id}"):
            other.trace(mine.run_id)
    assert task_events(c.trace(theirs.run_id))  # the admin reads every client's


def test_simplerctl_trace_writes_the_file(
    c: Client, daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    echo = c.register(f"{TASKS}:echo")
    run = c.run([sub_task(echo, scalars=[5])])
    ctl = Ctl(daemon.socket, capsys)
    path = tmp_path / "t.json"
    code, out, err = ctl("trace", str(run.run_id), "-o", str(path))
    assert code == 0, err
    assert f"run {run.run_id}: 1 task attempts written to {path}" in out
    evs = task_events(json.loads(path.read_text()))
    assert [e["args"]["task"] for e in evs] == [0]
    code, out, err = ctl("trace", str(run.run_id), "-o", "-")
    assert code == 0 and task_events(json.loads(out))
    code, out, err = ctl("trace", str(run.run_id), "-o", str(tmp_path / "no" / "such" / "t.json"))
    assert code == 1 and "cannot write the trace of run" in err and "No such file" in err
    code, out, err = ctl("trace", "999999999", "-o", str(path))
    assert code == 4 and "never submitted" in err
    code, out, err = ctl("trace", str(run.run_id))
    assert code == 2 and "-o" in err
