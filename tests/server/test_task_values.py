"""Values and kwargs in, results of any size out, through a real daemon over both
transports (gRPC and the local fast path): ``sub_task(h, values=[...], kwargs={...})``,
``Args.values`` / ``Args.kwargs`` as msgpack bytes, ``limits.max_value_bytes`` and
``limits.max_result_bytes``, and the run's result limit counting large results.

One module daemon: small limits so that each shows with small data.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from simpler_daemon.client import AsyncClient, Client, make_args, sub_task, task
from simpler_daemon.client.errors import InvalidArgument, ResourceExhausted
from simpler_daemon.errors import TaskError
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from tests.support.ctl import Ctl
from tests.support.daemon_harness import (
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

TASKS = "tests.support.daemon_tasks"
MAX_VALUE = 1 << 20
MAX_RESULT = 4 << 20
RUN_RESULTS = 6 << 20
CONFIG: dict[str, dict[str, Any]] = {
    "workers": {"num_sub_workers": 2},
    "limits": {
        "max_message_bytes": 32 << 20,
        "max_value_bytes": MAX_VALUE,
        "max_result_bytes": MAX_RESULT,
        "max_run_result_bytes": RUN_RESULTS,
    },
    "callables": {"allowed_modules": ["simpler_daemon.examples", "tests"]},
}
NESTED = {"a": [1, 2.5, None, True, "s", b"\x00\xff"], "b": {"c": [[], {}]}}

_MODULE_DAEMONS: set[int] = set()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "task-values", CONFIG, _MODULE_DAEMONS)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    yield from module_leak_guard(lambda: set(_MODULE_DAEMONS))


@pytest.fixture(params=["grpc", "fast"])
def c(daemon: DaemonProcess, request: pytest.FixtureRequest) -> Iterator[Client]:
    with daemon.client(timeout=60, transport=request.param) as client:
        assert client.transport == request.param
        yield client


def _heap_used(c: Client) -> int:
    return int(c.get_info().heap.used_bytes)


def test_values_and_kwargs_reach_the_callable(c: Client) -> None:
    echo = c.register(f"{TASKS}:echo_values")
    tasks = [
        sub_task(echo, values=[1, "two", (3, 4)]),
        sub_task(echo, kwargs={"cfg": NESTED, "raw": b"\x01"}),
        sub_task(echo, scalars=[5], values=[None], kwargs={"k": 1}),
        sub_task(echo),
        task("sub_group", echo, [make_args(values=[i], kwargs={"m": i}) for i in range(2)]),
    ]
    result = c.run(tasks, timeout=60)
    values = result.values()
    assert values[0] == {"values": [1, "two", [3, 4]], "kwargs": {}}
    assert values[1] == {"values": [], "kwargs": {"cfg": NESTED, "raw": b"\x01"}}
    assert type(values[1]["kwargs"]["raw"]) is bytes
    assert values[2] == {"values": [None], "kwargs": {"k": 1}}
    assert values[3] == {"values": [], "kwargs": {}}
    assert [r.value for r in result.results if r.task_index == 4] == [
        {"values": [i], "kwargs": {"m": i}} for i in range(2)
    ]


def test_values_past_the_frame_go_through_the_heap_and_are_freed(c: Client) -> None:
    sizes = c.register(f"{TASKS}:value_sizes")
    c.run([sub_task(sizes, values=[b"warm"])], timeout=60)
    before = _heap_used(c)
    big = b"v" * 300_000
    result = c.run([sub_task(sizes, values=[big, b"x"]) for _ in range(3)], timeout=60)
    assert [r.value for r in result.results] == [[300_000, 1]] * 3
    wait_until(lambda: _heap_used(c) == before, 20, "the values' heap buffers freed")


def test_a_value_past_max_value_bytes_is_refused_at_submit(c: Client) -> None:
    sizes = c.register(f"{TASKS}:value_sizes")
    with pytest.raises(ResourceExhausted) as ei:  # as every limits.* a request passes
        c.run([sub_task(sizes), sub_task(sizes, values=[b"x" * MAX_VALUE])], timeout=60)
    text = str(ei.value)
    assert "tasks[1].members[0].values" in text
    assert f"values and kwargs of {MAX_VALUE + 6} bytes" in text
    assert f"limits.max_value_bytes = {MAX_VALUE}" in text


def test_bad_values_are_refused_naming_the_argument(c: Client) -> None:
    echo = c.register(f"{TASKS}:echo_values")
    with pytest.raises(TypeError, match=r"values\[1\] is a numpy.ndarray.*put arrays in tensors"):
        sub_task(echo, values=[1, np.zeros(2)])
    with pytest.raises(TypeError, match=r"values\[0\] is a set"):
        sub_task(echo, values=[{1}])
    with pytest.raises(TypeError, match="kwargs has the key 1 of type int"):
        sub_task(echo, kwargs={1: "x"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="values= must be a list or tuple"):
        sub_task(echo, values="abc")
    # Bytes that are not what the field says: INVALID_ARGUMENT naming the field.
    raw = [
        (pb.Args(values=b"\x01"), "tasks[0].members[0].values", "not one msgpack array"),
        (
            pb.Args(kwargs=msgspec.msgpack.encode({1: 2})),
            "tasks[0].members[0].kwargs",
            "not one msgpack map",
        ),
        (
            pb.Args(kwargs=msgspec.msgpack.encode({"a b": 1})),
            "tasks[0].members[0].kwargs",
            "not a Python identifier",
        ),
    ]
    for args, field, why in raw:
        with pytest.raises(InvalidArgument) as ei:
            c.run([task("sub", echo, [args])], timeout=60)
        assert field in str(ei.value) and why in str(ei.value)


def test_results_of_any_size_come_back(c: Client) -> None:
    sized = c.register(f"{TASKS}:sized")
    ns = [10, 40_000, 1 << 20]
    result = c.run([sub_task(sized, values=[n]) for n in ns], timeout=60)
    got = result.values()
    for i, n in enumerate(ns):
        assert type(got[i]) is bytes and got[i] == b"r" * n
    fut = c.submit([sub_task(sized, values=[2 << 20])])
    assert fut.result(timeout=60).values()[0] == b"r" * (2 << 20)
    status = c.wait_run(fut, include_results=True)
    assert status.results[0].value == b"r" * (2 << 20)


def test_a_result_past_max_result_bytes_fails_its_task(c: Client) -> None:
    sized = c.register(f"{TASKS}:sized")
    with pytest.raises(TaskError) as ei:
        c.run([sub_task(sized, values=[MAX_RESULT + 1])], timeout=60)
    err = ei.value
    assert err.outcome == "TASK_FAILURE"
    text = str(err)
    assert "cannot return the result of task 0" in text and "sized" in text
    assert f"{MAX_RESULT + 6} bytes encoded, more than max_result_bytes ({MAX_RESULT})" in text


def test_large_results_count_against_the_runs_result_limit(c: Client) -> None:
    sized = c.register(f"{TASKS}:sized")
    with pytest.raises(TaskError) as ei:
        c.run([sub_task(sized, values=[3 << 20]) for _ in range(2)], timeout=60)
    assert "max_run_result_bytes" in str(ei.value)


def test_a_run_spec_takes_values_and_kwargs(
    daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ctl = Ctl(daemon.socket, capsys)
    code, out, _ = ctl("info")
    assert code == 0 and "values:   1.0 MiB of values and kwargs/task, 4.0 MiB/result" in out
    spec = tmp_path / "values.toml"
    spec.write_text(
        f"""\
[[tasks]]
callable = "{TASKS}:echo_values"
values = [1, "two", [3]]
kwargs = {{ mode = "fast", n = 2 }}

[[tasks]]
callable = "{TASKS}:sized"
values = [100000]

[[tasks]]
callable = "{TASKS}:echo_values"
kind = "sub_group"
[[tasks.members]]
values = [0]
[[tasks.members]]
kwargs = {{ m = 1 }}
"""
    )
    code, out, err = ctl("submit", str(spec), "--wait")
    assert code == 0, err
    assert "task 0 returned {'values': [1, 'two', [3]], 'kwargs': {'mode': 'fast', 'n': 2}}" in out
    # A large result: its head and its size, not 100 kB of text.
    line = next(x for x in out.splitlines() if "task 1 returned" in x)
    assert line.endswith("... (bytes of 100000 bytes)") and len(line) < 300
    assert "task 2 member 0 returned {'values': [0], 'kwargs': {}}" in out
    assert "task 2 member 1 returned {'values': [], 'kwargs': {'m': 1}}" in out
    bad = tmp_path / "bad.toml"
    bad.write_text(
        f'[[tasks]]\ncallable = "{TASKS}:echo_values"\nvalues = [1979-05-27T07:32:00Z]\n'
    )
    code, _out, err = ctl("submit", str(bad), "--wait")
    assert code != 0
    assert "tasks[0]: cannot build task arguments: values[0] is a datetime.datetime" in err


def test_the_async_client_sends_values_and_gets_large_results(daemon: DaemonProcess) -> None:
    async def go() -> None:
        async with AsyncClient(daemon.socket, timeout=60) as ac:
            echo = await ac.register(f"{TASKS}:echo_values")
            sized = await ac.register(f"{TASKS}:sized")
            result = await ac.run(
                [
                    sub_task(echo, values=[b"v" * 100_000], kwargs={"k": 1}),
                    sub_task(sized, values=[1 << 20]),
                ],
                timeout=60,
            )
            got = result.values()
            assert got[0] == {"values": [b"v" * 100_000], "kwargs": {"k": 1}}
            assert got[1] == b"r" * (1 << 20)

    asyncio.run(go())
