"""Automatic retries through a real daemon (both transports): a worker SIGKILLed
mid-task with ``max_retries=2`` completes the run, the trace shows both attempts and the
status counts the retry; exceptions retried by qualified name; exhausted retries fail
with every attempt's cause; the watch stream has TASK_RETRYING with attempt numbers;
bad retry settings are refused naming the field; run specs carry retries.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpler_daemon.client import Client, InvalidArgument, call_config, sub_task, tensor
from simpler_daemon.errors import TaskError
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from tests.support.ctl import Ctl
from tests.support.daemon_harness import (
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    wait_until,
)
from tests.support.trace_check import task_events

pytestmark = pytest.mark.timeout(120)

TASKS = "tests.support.retry_tasks"
CONFIG: dict[str, dict[str, Any]] = {
    "workers": {"num_sub_workers": 2},
    "callables": {"allowed_modules": ["simpler_daemon.examples", "tests"]},
}
_MODULE_DAEMONS: set[int] = set()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "retries", CONFIG, _MODULE_DAEMONS)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    yield from module_leak_guard(lambda: set(_MODULE_DAEMONS))


@pytest.fixture(params=["grpc", "fast"])
def c(daemon: DaemonProcess, request: pytest.FixtureRequest) -> Iterator[Client]:
    with daemon.client(timeout=60, transport=request.param) as client:
        assert client.transport == request.param
        yield client


def _state(c: Client) -> tuple[int, pb.TensorRef]:
    buf = c.alloc_array(np.zeros(16, dtype=np.int64))
    return buf, tensor(buf, "no_dep", (16,), "int64")


def test_a_worker_sigkilled_mid_task_is_retried(c: Client) -> None:
    hang = c.register(f"{TASKS}:hang_first")
    buf, state = _state(c)
    try:
        fut = c.submit([sub_task(hang, [state], [1], config=call_config(max_retries=2))])
        events = c.watch(fut.run_id, timeout=60)
        first = next(events)  # the snapshot: the stream is open from here on
        pid = wait_until(lambda: int(c.read_array(buf, (16,), "int64")[1]), timeout=30)
        os.kill(pid, signal.SIGKILL)
        res = fut.result(timeout=60)
        assert [r.value for r in res.results] == [43]
        assert res.counts.retried == 1 and res.counts.done == 1 and res.counts.failed == 0
        seen = [first, *events]
        retrying = [e for e in seen if e.type == pb.RUN_EVENT_TYPE_TASK_RETRYING]
        assert len(retrying) == 1 and retrying[0].attempt == 1
        assert retrying[0].outcome == "ENDPOINT_FAILURE" and retrying[0].counts.retried == 1
        done = [e for e in seen if e.type == pb.RUN_EVENT_TYPE_TASK_COMPLETED]
        assert [e.attempt for e in done] == [2]
        attempts = [
            (e["args"]["attempt"], e["args"]["outcome"]) for e in task_events(c.trace(fut.run_id))
        ]
        assert attempts == [(1, "ENDPOINT_FAILURE"), (2, "SUCCESS")]
        state_now = c.read_array(buf, (16,), "int64")
        assert state_now[0] == 2 and state_now[2] != pid
    finally:
        c.free_buffer(buf)


def test_exceptions_by_qualified_name_and_exhausted_retries(c: Client) -> None:
    flaky = c.register(f"{TASKS}:raise_first")
    buf, state = _state(c)
    try:
        for names in (["ValueError"], [f"{TASKS.replace(':', '.')}.FlakyError"]):
            c.write_buffer(buf, np.zeros(16, dtype=np.int64))
            cfg = call_config(max_retries=2, retry_on=["exception"], retry_exceptions=names)
            res = c.run([sub_task(flaky, [state], [2], config=cfg)], timeout=60)
            assert [r.value for r in res.results] == ["ok"] and res.counts.retried == 2
        c.write_buffer(buf, np.zeros(16, dtype=np.int64))
        cfg = call_config(max_retries=1, retry_on=["exception"], retry_exceptions=["KeyError"])
        with pytest.raises(TaskError) as info:
            c.run([sub_task(flaky, [state], [5], config=cfg)], timeout=60)
        assert info.value.attempts == 1  # a FlakyError is no KeyError
        c.write_buffer(buf, np.zeros(16, dtype=np.int64))
        cfg = call_config(max_retries=2, retry_on=["exception"], retry_exceptions=[ValueError])
        fut = c.submit([sub_task(flaky, [state], [9], config=cfg)])
        with pytest.raises(TaskError) as info:
            fut.result(timeout=60)
        err = info.value
        assert err.attempts == 3 and len(err.attempt_causes) == 3
        assert err.attempt_causes[2].startswith("attempt 3: TASK_FAILURE (exception)")
        assert "after 3 attempts" in str(err)
        status = c.wait_run(fut.run_id, timeout=10)
        assert status.error is not None and status.error.attempts == 3
        assert status.counts.retried == 2 and status.counts.failed == 1
    finally:
        c.free_buffer(buf)


def test_bad_retry_settings_are_refused_naming_the_field(c: Client) -> None:
    hang = c.register(f"{TASKS}:hang_first")
    buf, state = _state(c)
    out = c.alloc_array(np.zeros(4, dtype=np.float64))
    try:
        for cfg, field, text in [
            (pb.CallConfig(max_retries=101), "tasks[0].config.max_retries", "more than 100"),
            (
                pb.CallConfig(max_retries=1, retry_on=["oops"]),
                "tasks[0].config.retry_on[0]",
                "'oops' is not one of crash, deadline, exception",
            ),
            (
                pb.CallConfig(max_retries=1, retry_on=["exception"], retry_exceptions=["no such"]),
                "tasks[0].config.retry_exceptions[0]",
                "not a qualified exception class name",
            ),
            (
                pb.CallConfig(max_retries=1, retry_on=["crash"], retry_exceptions=["ValueError"]),
                "tasks[0].config",
                "retry_exceptions narrows retry_on='exception'",
            ),
        ]:
            with pytest.raises(InvalidArgument) as info:
                c.submit([sub_task(hang, [state], config=cfg)])
            assert info.value.field == field and text in info.value.details()
        inout = tensor(out, "inout", (4,), "float64")
        with pytest.raises(InvalidArgument) as info:
            c.submit([sub_task(hang, [state, inout], config=pb.CallConfig(max_retries=1))])
        assert info.value.field == "tasks[0].config.idempotent"
        assert "writes members[0].tensors[1] in place (INOUT)" in info.value.details()
        # The client's own checks, before anything is sent.
        with pytest.raises(ValueError, match="max_retries=-1"):
            call_config(max_retries=-1)
        with pytest.raises(TypeError, match=r"retry_exceptions\[0\] = 3"):
            call_config(max_retries=1, retry_on=["exception"], retry_exceptions=[3])  # type: ignore[list-item]
    finally:
        c.free_buffer(out)
        c.free_buffer(buf)


def test_run_spec_retries_and_watch_shows_attempts(
    c: Client, daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "retry.toml"
    spec.write_text(
        f"""
[buffers.state]
shape = [16]
dtype = "int64"

[[tasks]]
callable = "{TASKS}:raise_first"
scalars = [1]
tensors = [{{ buffer = "state", tag = "no_dep" }}]
config = {{ max_retries = 2, retry_on = ["exception"], retry_exceptions = ["ValueError"] }}
"""
    )
    ctl = Ctl(daemon.socket, capsys)
    code, out, err = ctl("submit", str(spec), "--wait")
    assert code == 0, err + out
    assert "COMPLETED" in out
    run_id = int(out.split("run ", 1)[1].split(":")[0].split()[0])
    attempts = [e["args"]["attempt"] for e in task_events(c.trace(run_id))]
    assert attempts == [1, 2]
    bad = tmp_path / "bad.toml"
    bad.write_text(spec.read_text().replace('retry_on = ["exception"]', 'retry_on = ["oops"]'))
    code, out, err = ctl("submit", str(bad), "--wait")
    assert code != 0 and "retry_on" in err


def test_watch_lines_show_attempts_and_retries() -> None:
    """What ``simplerctl watch`` prints for a retry (cli/output.py)."""
    from simpler_daemon.cli.output import event_line, progress_line

    counts = pb.RunCounts(total=2, done=1, running=1, retried=1)
    ev = pb.RunEvent(
        run_id=4,
        sequence=3,
        type=pb.RUN_EVENT_TYPE_TASK_RETRYING,
        task_index=0,
        attempt=1,
        outcome="ENDPOINT_FAILURE",
        message="endpoint failure on sub worker 0\nmore",
        counts=counts,
        state=pb.RUN_STATE_EXECUTING,
    )
    line = event_line(ev)
    assert "TASK_RETRYING task 0 attempt 1 ENDPOINT_FAILURE" in line
    assert "retried 1)" in line and line.endswith("- endpoint failure on sub worker 0")
    assert "retried 1" in progress_line(ev, 1.0)
    plain = pb.RunEvent(
        run_id=4, sequence=4, type=pb.RUN_EVENT_TYPE_TASK_COMPLETED, counts=pb.RunCounts(total=1)
    )
    assert "attempt" not in event_line(plain) and "retried" not in progress_line(plain, 1.0)
