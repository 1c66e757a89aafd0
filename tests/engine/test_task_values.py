"""Python values and kwargs in, results of any size out (the engine's side; the daemon's
is tests/server/test_task_values.py).

``TaskArgs.add_value`` / ``set_kwargs`` encode in the parent; the child reads
``args.values`` / ``args.kwargs``. A values section that does not fit the frame goes
through a run-owned heap buffer, released when the task retires (success, failure or
cancel: the heap's free bytes come back to where they started). A return value past
the frame goes through the child's memfd, up to ``max_result_bytes``. Real SUB children.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from simpler_daemon import Tag, TaskArgs, TaskError, Worker
from simpler_daemon.args import decode_args, encode_args
from simpler_daemon.engine.orchestrator import Orchestrator
from simpler_daemon.taskvalues import TaskValues, section
from simpler_daemon.testing import poll_for
from tests.support import sub_tasks as tasks
from tests.support.worker_pool import run_to_end

pytestmark = pytest.mark.timeout(120)

#: A value that does not fit the frame (64 KiB): it goes through the heap.
BIG = b"v" * 200_000
NESTED = {"a": [1, 2.5, None, True, "s", b"\x00\xff"], "b": {"c": [[], {}]}, "n": -(2**63)}


# -- SUB callables (module level: the children inherit them) ------------------------------------


def echo(args: Any) -> Any:
    """What the child received: values, kwargs and scalars."""
    return {"values": args.values, "kwargs": args.kwargs, "scalars": args.scalars}


def sizes(args: Any) -> list[int]:
    """The length of each bytes value."""
    return [len(v) for v in args.values]


def fail_with_values(args: Any) -> None:
    raise ValueError(f"refused {len(args.values)} values")


def sized_result(args: Any) -> bytes:
    """values[0] bytes."""
    return b"r" * int(args.values[0])


def big_list(args: Any) -> list[int]:
    return list(range(int(args.values[0])))


def gated_with_values(args: Any) -> int:
    tasks.wait_flag(args)
    return len(args.values[0])


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker(num_sub_workers=2, max_value_bytes=1 << 20, max_result_bytes=2 << 20)
    try:
        yield w
    finally:
        w.close()


def _heap_settled(w: Worker, free: int) -> None:
    poll_for(lambda: w.heap.free_bytes() == free, 20, message="heap free bytes back to their start")


# -- the codec (no children) --------------------------------------------------------------------


def test_add_value_and_set_kwargs_return_the_args() -> None:
    a = TaskArgs()
    assert a.add_value(1) is a and a.set_kwargs(k="v") is a
    assert a.values == [1] and a.kwargs == {"k": "v"}
    assert TaskArgs().values == [] and TaskArgs().kwargs == {}
    assert "values=1" in repr(a)
    # set_kwargs replaces, set_kwargs() clears.
    assert a.set_kwargs(x=1).kwargs == {"x": 1} and a.set_kwargs().kwargs == {}


def test_child_decodes_lazily_and_tensors_and_scalars_are_unchanged() -> None:
    a = TaskArgs().add_scalar(5).add_value([1, "x"]).set_kwargs(k=NESTED)
    assert a._values is not None
    values, kwargs = a._values.encoded()
    blob = encode_args((), a.scalars) + section(values, kwargs, None)
    got = decode_args(blob, lambda d: np.zeros(1))
    assert got.scalars == [5]
    v = got._values
    assert isinstance(v, TaskValues) and v.raw_values is not None  # not decoded yet
    assert got.values == [[1, "x"]] and v.raw_values is None
    assert got.kwargs == {"k": NESTED}


@pytest.mark.parametrize(
    ("value", "where", "kind"),
    [
        (np.zeros(3), "values[0]", "numpy.ndarray"),
        ({1, 2}, "values[0]", "set"),
        (object(), "values[0]", "object"),
        ([1, [2, {3}]], "values[0][1][1]", "set"),
        ({"k": np.int64(3)}, "values[0]['k']", "numpy.int64"),
        (2**70, "values[0]", "int"),
    ],
)
def test_unencodable_value_is_a_type_error_naming_it(value: Any, where: str, kind: str) -> None:
    a = TaskArgs()
    with pytest.raises(TypeError) as ei:
        a.add_value(value)
    text = str(ei.value)
    assert f"cannot add value: {where} is a {kind}" in text
    assert "put arrays in tensors" in text
    assert a.values == []  # a refused value leaves the args unchanged


def test_bad_kwargs_are_refused_naming_the_key() -> None:
    with pytest.raises(TypeError, match=r"kwargs\['x'\] is a set.*put arrays in tensors"):
        TaskArgs().set_kwargs(x={1})
    with pytest.raises(TypeError, match=r"values\[0\]\['d'\] has the key 1 of type int"):
        TaskArgs().add_value({"d": {1: "one"}})
    with pytest.raises(TypeError, match=r"kwargs\['d'\] has the key 2 of type int"):
        TaskArgs().set_kwargs(d={2: "two"})
    from simpler_daemon.taskvalues import encode_kwargs

    with pytest.raises(TypeError, match="kwargs has the key 3 of type int"):
        encode_kwargs({3: "x"}, "submit")
    with pytest.raises(ValueError, match="not a Python identifier"):
        encode_kwargs({"a-b": 1}, "submit")


# -- through real children ----------------------------------------------------------------------


def test_values_and_kwargs_reach_the_child(worker: Worker) -> None:
    w = worker
    h = w.register(echo)
    w.init()
    refs: list[Any] = []

    def orch(o: Orchestrator, _a: Any, _c: Any) -> None:
        refs.append(o.submit_sub(h, TaskArgs().add_value(1).add_value("two").add_value((3, 4))))
        refs.append(o.submit_sub(h, TaskArgs().set_kwargs(cfg=NESTED, raw=b"\x00\x01")))
        refs.append(o.submit_sub(h, TaskArgs().add_scalar(9).add_value(None).set_kwargs(k=1)))
        refs.append(o.submit_sub(h, TaskArgs()))  # plain: still nothing
        refs.append(
            o.submit_sub_group(h, [TaskArgs().add_value(i).set_kwargs(m=i) for i in range(2)])
        )

    run = run_to_end(w, orch)
    assert run.error is None
    assert refs[0].result() == {"values": [1, "two", [3, 4]], "kwargs": {}, "scalars": []}
    r1 = refs[1].result()
    assert r1["kwargs"] == {"cfg": NESTED, "raw": b"\x00\x01"}
    assert type(r1["kwargs"]["raw"]) is bytes  # bytes come back as bytes
    assert refs[2].result() == {"values": [None], "kwargs": {"k": 1}, "scalars": [9]}
    assert refs[3].result() == {"values": [], "kwargs": {}, "scalars": []}
    assert refs[4].result() == [
        {"values": [i], "kwargs": {"m": i}, "scalars": []} for i in range(2)
    ]


def test_values_with_tensors_keep_dependencies(worker: Worker) -> None:
    w = worker
    fill = w.register(tasks.fill)
    h = w.register(echo)
    w.init()
    x = w.alloc(4, "int64")
    refs: list[Any] = []

    def orch(o: Orchestrator, _a: Any, _c: Any) -> None:
        o.submit_sub(fill, TaskArgs().add_tensor(x, Tag.OUTPUT).add_scalar(7).add_value("v"))
        refs.append(o.submit_sub(h, TaskArgs().add_tensor(x, Tag.INPUT).add_value(BIG)))

    run = run_to_end(w, orch)
    assert run.error is None
    assert list(x) == [7] * 4
    assert refs[0].result()["values"] == [BIG]


def test_many_small_values_through_the_sub_pump(worker: Worker) -> None:
    """Plain-config SUB tasks with one small value each: the C pump publishes them."""
    w = worker
    h = w.register(sizes)
    w.init()
    refs: list[Any] = []

    def orch(o: Orchestrator, _a: Any, _c: Any) -> None:
        for i in range(300):
            refs.append(o.submit_sub(h, TaskArgs().add_value(b"x" * (i % 40))))
        refs.append(o.submit_sub(h, TaskArgs()))  # a plain one after: no stale values seen

    run = run_to_end(w, orch)
    assert run.error is None
    assert [r.result() for r in refs[:-1]] == [[i % 40] for i in range(300)]
    assert refs[-1].result() == []


def test_heap_backed_values_are_freed_after_success_failure_and_cancel(worker: Worker) -> None:
    w = worker
    h = w.register(sizes)
    bad = w.register(fail_with_values)
    gated = w.register(gated_with_values)
    w.init()
    flags = w.alloc(1, "int64")
    flags[0] = 0
    free = w.heap.free_bytes()

    refs: list[Any] = []
    run = run_to_end(w, lambda o, a, c: refs.append(o.submit_sub(h, TaskArgs().add_value(BIG))))
    assert run.error is None and refs[0].result() == [len(BIG)]
    _heap_settled(w, free)

    run = run_to_end(w, lambda o, a, c: o.submit_sub(bad, TaskArgs().add_value(BIG)))
    assert run.error is not None and "refused 1 values" in str(run.error)
    _heap_settled(w, free)

    def gate(o: Orchestrator, _a: Any, _c: Any) -> None:
        o.submit_sub(gated, TaskArgs().add_tensor(flags, Tag.NO_DEP).add_scalar(0).add_value(BIG))
        for _ in range(3):  # queued behind it, never run
            o.submit_sub(h, TaskArgs().add_value(BIG))

    handle = w.submit(gate)
    poll_for(lambda: w.heap.free_bytes() < free, 20, message="the values on the heap")
    handle.cancel()
    flags[0] = 1
    try:
        handle.wait(60)
    except BaseException:
        pass
    assert handle.run.terminal
    _heap_settled(w, free)


def test_value_past_the_limit_is_refused_at_submit(worker: Worker) -> None:
    w = worker
    h = w.register(sizes)
    w.init()
    free = w.heap.free_bytes()
    seen: list[BaseException] = []

    def orch(o: Orchestrator, _a: Any, _c: Any) -> None:
        o.submit_sub(h, TaskArgs().add_value(b"ok"))
        try:
            o.submit_sub(h, TaskArgs().add_value(b"x" * (1 << 20)))
        except ValueError as exc:
            seen.append(exc)
        try:  # the first member fits on the heap, the second is too big: nothing stays
            o.submit_sub_group(
                h, [TaskArgs().add_value(BIG), TaskArgs().set_kwargs(k=b"y" * (2 << 20))]
            )
        except ValueError as exc:
            seen.append(exc)

    run = run_to_end(w, orch)
    assert run.error is None
    text = str(seen[0])
    assert "cannot submit_sub task 1 (" in text and "sizes" in text
    assert f"{(1 << 20) + 6} bytes encoded, more than max_value_bytes ({1 << 20})" in text
    assert "cannot submit_sub_group task 1 member 1" in str(seen[1])
    _heap_settled(w, free)


def test_worker_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_value_bytes=-1 must be an int >= 0"):
        Worker(num_sub_workers=1, max_value_bytes=-1)
    with pytest.raises(ValueError, match="max_result_bytes='1' must be an int >= 0"):
        Worker(num_sub_workers=1, max_result_bytes="1")  # type: ignore[arg-type]


def test_results_of_any_size_come_back(worker: Worker) -> None:
    w = worker
    h = w.register(sized_result)
    lst = w.register(big_list)
    w.init()
    refs: list[Any] = []
    sizes_ = [0, 10, 40_000, 1 << 20]

    def orch(o: Orchestrator, _a: Any, _c: Any) -> None:
        for n in sizes_:
            refs.append(o.submit_sub(h, TaskArgs().add_value(n)))
        refs.append(o.submit_sub(lst, TaskArgs().add_value(100_000)))
        refs.append(o.submit_sub_group(h, [TaskArgs().add_value(50_000)] * 2))

    run = run_to_end(w, orch)
    assert run.error is None
    for r, n in zip(refs, sizes_, strict=False):
        got = r.result()
        assert type(got) is bytes and got == b"r" * n
    assert refs[4].result() == list(range(100_000))
    assert refs[5].result() == [b"r" * 50_000] * 2
    assert run.task_results()[3] == b"r" * (1 << 20)


def test_result_past_max_result_bytes_is_a_task_failure(worker: Worker) -> None:
    w = worker
    h = w.register(sized_result)
    w.init()
    refs: list[Any] = []
    n = (2 << 20) + 1

    def orch(o: Orchestrator, _a: Any, _c: Any) -> None:
        refs.append(o.submit_sub(h, TaskArgs().add_value(n)))

    run = run_to_end(w, orch)
    with pytest.raises(TaskError) as ei:
        refs[0].result()
    err = ei.value
    assert err.outcome == "TASK_FAILURE"
    text = str(err)
    assert "cannot return the result of task 0 (" in text and "sized_result" in text
    assert f"{n + 5} bytes encoded, more than max_result_bytes ({2 << 20})" in text
    assert run.error is not None


def _memfds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "memfd:simpler-result" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                n += 1
        except OSError:
            pass
    return n


def test_large_results_hold_one_memfd_and_a_killed_child_leaks_nothing(worker: Worker) -> None:
    w = Worker(num_sub_workers=1)
    try:
        h = w.register(sized_result)
        w.init()
        pid = w.children[0].pid
        for _ in range(3):
            run = run_to_end(w, lambda o, a, c: [o.submit_sub(h, TaskArgs().add_value(1 << 20))])
            assert run.error is None
            assert _memfds(pid) <= 1  # the last one, until the next task or an idle park
        poll_for(lambda: _memfds(pid) == 0, 20, message="the idle child to close its result memfd")
        # A child SIGKILLed right after handing back a large result (its memfd open).
        run = run_to_end(w, lambda o, a, c: [o.submit_sub(h, TaskArgs().add_value(1 << 20))])
        assert run.error is None and run.task_results() == [b"r" * (1 << 20)]
        os.kill(pid, signal.SIGKILL)
        # The next task runs on the replacement (a task the dead child never picked up is
        # queued again).
        refs: list[Any] = []
        run = run_to_end(
            w, lambda o, a, c: refs.append(o.submit_sub(h, TaskArgs().add_value(40_000)))
        )
        assert run.error is None and refs[0].result() == b"r" * 40_000
        assert w._pool.restarts["sub"] == 1
        # The memfd died with the child (the kernel's); the heap holds nothing of it.
        assert w.heap.free_bytes() == w.heap.size
    finally:
        w.close()


def test_the_parent_believes_no_forged_large_result() -> None:
    """``read_large`` (the parent's side of mailbox/results.py) reads only a regular file
    of the announced size, at most ``max_result_bytes``: a child naming more, a pipe or
    a closed descriptor gets a clear error, never a read of the parent's memory's worth."""
    import mmap
    from types import SimpleNamespace

    from simpler_daemon.mailbox.layout import MAILBOX_SIZE, OFF_ARGS, TASK_FRAMES
    from simpler_daemon.mailbox.results import LARGE_RESULT, pack_fd, read_large, write_large

    buf = mmap.mmap(-1, MAILBOX_SIZE)
    frame = TASK_FRAMES[0]
    ep = SimpleNamespace(buf=buf, child=SimpleNamespace(pid=os.getpid()), max_result_bytes=1 << 20)
    fd = write_large(b"z" * 100_000)
    r, w = os.pipe()
    try:
        buf[frame + OFF_ARGS : frame + OFF_ARGS + 8] = pack_fd(fd)
        assert read_large(ep, frame, LARGE_RESULT | 100_000) == b"z" * 100_000
        with pytest.raises(ValueError, match="more than max_result_bytes"):
            read_large(ep, frame, LARGE_RESULT | (2 << 20))
        with pytest.raises(ValueError, match="not a result memfd of 200000 bytes"):
            read_large(ep, frame, LARGE_RESULT | 200_000)  # larger than the file
        buf[frame + OFF_ARGS : frame + OFF_ARGS + 8] = pack_fd(r)
        with pytest.raises(ValueError, match="not a result memfd"):
            read_large(ep, frame, LARGE_RESULT | 10)
    finally:
        os.close(fd)
        os.close(r)
        os.close(w)
    buf[frame + OFF_ARGS : frame + OFF_ARGS + 8] = pack_fd(1 << 20)  # no such descriptor
    with pytest.raises(OSError):
        read_large(ep, frame, LARGE_RESULT | 10)
    buf.close()
