"""SUB task return values come back (the engine's side; the daemon's is in
tests/client/test_client_api.py).

A SUB callable's non-None return value is encoded in the child with
``msgspec.msgpack.encode`` into the task frame's args area (its length in the frame's
``reserved`` word); the parent stores the bytes on the task slot. ``Run.task_results()``
decodes them in submission order, ``Run.encoded_results()`` hands the bytes on as they
are (the daemon's path), and every ``submit_*`` returns a ``TaskRef`` (an ``int`` equal to
the old index) whose ``result()`` is readable once the run is terminal. A None return
writes nothing; a value over ``MAX_RESULT_BYTES`` comes back through a memfd, one
msgspec cannot encode is a TASK_FAILURE naming the task.

Real SUB children, under ``fifo`` and ``fair`` admission.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from simpler_daemon import Tag, TaskError, Worker
from simpler_daemon.args import encode_args
from simpler_daemon.engine.orchestrator import Orchestrator, TaskRef
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.layout import MAX_RESULT_BYTES, OFF_ARGS, OFF_RESERVED, TASK_FRAMES
from tests.support import sub_tasks as tasks
from tests.support.sub_tasks import targs
from tests.support.worker_pool import run_to_end

pytestmark = pytest.mark.timeout(120)

#: msgpack's bin16 header is 3 bytes: a bytes value of this length encodes to exactly
#: MAX_RESULT_BYTES (one more byte is over the limit).
AT_LIMIT = MAX_RESULT_BYTES - 3


# -- SUB callables (module level: the children inherit them) ------------------------------------


def value_of(args: Any) -> Any:
    """A plain value built from scalars[0]."""
    i = int(args.scalars[0])
    return {"i": i, "pid_is_int": isinstance(os.getpid(), int), "items": [i, "v", 1.5, None]}


def bytes_of(args: Any) -> bytes:
    """scalars[0] bytes (msgpack bin: 3 header bytes while shorter than 64 KiB)."""
    return b"x" * int(args.scalars[0])


def an_array(args: Any) -> Any:
    """A numpy array: msgspec cannot encode it."""
    return np.zeros(3)


def gated_value(args: Any) -> int:
    """Wait for tensors[0][0] != 0 (the test opens the gate), then return 42."""
    tasks.wait_flag(args)
    return 42


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(params=["fifo", "fair"])
def worker(request: pytest.FixtureRequest) -> Iterator[Worker]:
    w = Worker(num_sub_workers=2, admission=request.param)
    try:
        yield w
    finally:
        w.close()


# -- tests ------------------------------------------------------------------------------------


def test_values_per_task_and_per_group_member(worker: Worker) -> None:
    w = worker
    value = w.register(value_of)
    noop = w.register(tasks.noop)
    w.init()
    refs: list[Any] = []

    def orch(o: Orchestrator, _a: Any, _c: Any) -> None:
        refs.append(o.submit_sub(value, targs(scalars=(7,))))
        refs.append(o.submit_sub(noop))
        refs.append(o.submit_sub_group(value, [targs(scalars=(i,)) for i in (1, 2)]))
        refs.append(o.submit_sub_group(noop, [targs(), targs()]))

    run = run_to_end(w, orch)
    assert run.error is None
    expect = [value_of(targs(scalars=(i,))) for i in (7, 1, 2)]
    # TaskRef is the old index (an int), with the task's value once the run is terminal.
    assert refs == [0, 1, 2, 3] and all(isinstance(r, TaskRef) for r in refs)
    assert [type(r).__mro__[1] for r in refs] == [int] * 4
    assert refs[0].result() == expect[0]
    assert refs[1].result() is None
    assert refs[2].result() == [expect[1], expect[2]]
    assert refs[3].result() == [None, None]
    assert run.task_results() == [expect[0], None, [expect[1], expect[2]], [None, None]]
    enc = msgspec.msgpack.encode
    assert run.encoded_results() == [
        (0, None, enc(expect[0])),
        (2, 0, enc(expect[1])),
        (2, 1, enc(expect[2])),
    ]


def scalars_and_values(args: Any) -> Any:
    """What the child decoded: its scalars and its values."""
    return [list(args.scalars), list(args.values)]


def test_scalars_alone_and_with_values_reach_the_child(worker: Worker) -> None:
    """Scalars alone take submit_sub's inline path and a one-unpack decode; with values
    they take the general path: the child sees the same either way. Too many scalars
    are refused at submit, naming the capacity, and nothing of that task is kept."""
    w = worker
    echo = w.register(scalars_and_values)
    w.init()
    refs: list[Any] = []
    refused: list[str] = []
    big = 1 << 63

    def orch(o: Orchestrator, _a: Any, _c: Any) -> None:
        refs.append(o.submit_sub(echo, targs(scalars=(3, big))))
        refs.append(o.submit_sub(echo, targs(scalars=(4,)).add_value({"k": [1, 2]})))
        try:
            o.submit_sub(echo, targs(scalars=tuple(range(9000))))
        except ValueError as exc:
            refused.append(str(exc))
        refs.append(o.submit_sub(echo, targs()))

    run = run_to_end(w, orch)
    assert run.error is None
    assert [r.result() for r in refs] == [[[3, big], []], [[4], [{"k": [1, 2]}]], [[], []]]
    assert refs == [0, 1, 2]  # the refused task took no index
    assert len(refused) == 1 and "0 tensors and 9000 scalars need 72008 bytes" in refused[0]


def test_none_writes_nothing_and_no_stale_value(worker: Worker) -> None:
    """A None return leaves the frame as published (reserved 0, the args blob intact), and
    a value left in the frame by an earlier task is never read as a later task's result."""
    w = worker
    value = w.register(value_of)
    noop = w.register(tasks.noop)
    w.init()
    for i in range(3):
        r1 = run_to_end(w, lambda o, a, c, i=i: o.submit_sub(value, targs(scalars=(i,))))
        assert r1.task_results() == [value_of(targs(scalars=(i,)))]
        r2 = run_to_end(w, lambda o, a, c: o.submit_sub(noop, targs(scalars=(5, 6))))
        assert r2.error is None
        assert r2.task_results() == [None] and r2.encoded_results() == []
    # Both runs of the last round ran on the first idle worker (worker 0): its frame
    # still holds what the parent published for the noop task, untouched by the child.
    buf = w.mailboxes[0].buf
    frame = TASK_FRAMES[0]
    assert _mb.load64(buf, frame + OFF_RESERVED) == 0
    blob = encode_args((), [5, 6])
    assert _mb.read_bytes(buf, frame + OFF_ARGS, len(blob)) == blob


def test_result_past_the_frame_comes_back(worker: Worker) -> None:
    """At MAX_RESULT_BYTES a result travels in the frame; one byte more goes through the
    child's memfd (mailbox/results.py): both come back the same (the size limit itself,
    max_result_bytes, is tests/engine/test_task_values.py's)."""
    w = worker
    big = w.register(bytes_of)
    w.init()
    refs: list[Any] = []

    def orch(o: Orchestrator, _a: Any, _c: Any) -> None:
        refs.append(o.submit_sub(big, targs(scalars=(AT_LIMIT,))))
        refs.append(o.submit_sub(big, targs(scalars=(AT_LIMIT + 1,))))

    run = run_to_end(w, orch)
    assert refs[0].result() == b"x" * AT_LIMIT  # exactly MAX_RESULT_BYTES encoded: the frame
    assert refs[1].result() == b"x" * (AT_LIMIT + 1)  # one more: the memfd
    assert run.error is None
    assert run.task_results() == [b"x" * AT_LIMIT, b"x" * (AT_LIMIT + 1)]


def test_unencodable_result_fails_clearly(worker: Worker) -> None:
    w = worker
    arr = w.register(an_array)
    value = w.register(value_of)
    w.init()
    refs: list[Any] = []

    def orch(o: Orchestrator, _a: Any, _c: Any) -> None:
        refs.append(o.submit_sub(value, targs(scalars=(3,))))
        refs.append(o.submit_sub(arr))

    run = run_to_end(w, orch)
    assert refs[0].result() == value_of(targs(scalars=(3,)))
    with pytest.raises(TaskError) as ei:
        refs[1].result()
    text = str(ei.value)
    assert ei.value.outcome == "TASK_FAILURE"
    assert "cannot return the result of task 1 (" in text and "an_array" in text
    assert "numpy.ndarray" in text and "msgspec" in text
    assert run.error is not None and run.error.hashid == arr.hashid


def test_task_ref_result_before_after_and_failed(worker: Worker) -> None:
    w = worker
    gated = w.register(gated_value)
    fail = w.register(tasks.fail)
    w.init()
    flags = w.alloc(1, "int64")
    flags[0] = 0
    refs: list[Any] = []

    def orch(o: Orchestrator, _a: Any, _c: Any) -> None:
        refs.append(o.submit_sub(gated, targs((flags, Tag.NO_DEP), scalars=(0,))))
        refs.append(o.submit_sub(fail, targs(scalars=(9,))))

    h = w.submit(orch)
    assert len(refs) == 2
    with pytest.raises(asyncio.InvalidStateError, match=f"run {h.run_id}"):
        refs[0].result()
    flags[0] = 1
    with pytest.raises(TaskError):
        h.wait(60)
    assert refs[0].result() == 42
    with pytest.raises(TaskError) as ei:
        refs[1].result()
    # The task's own error: its hashid, its outcome, its message.
    assert ei.value.hashid == fail.hashid and ei.value.outcome == "TASK_FAILURE"
    assert "producer exploded on purpose (9)" in str(ei.value)
    w.free(flags)


def test_task_ref_of_a_task_that_never_ran_raises() -> None:
    """A task that never ran (the orchestration raised while it was queued) has no value:
    its ref raises; a task of the same run that finished still has its value."""
    w = Worker(num_sub_workers=1)
    try:
        gated = w.register(gated_value)
        value = w.register(value_of)
        w.init()
        flags = w.alloc(1, "int64")
        flags[0] = 0
        refs: list[Any] = []

        def orch(o: Orchestrator, _a: Any, _c: Any) -> None:
            refs.append(o.submit_sub(gated, targs((flags, Tag.NO_DEP), scalars=(0,))))
            refs.append(o.submit_sub(value, targs(scalars=(1,))))  # queued: one worker
            raise RuntimeError("stop here")

        h = w.submit(orch)
        flags[0] = 1
        with pytest.raises(RuntimeError, match="stop here"):
            h.wait(60)
        assert refs[0].result() == 42
        with pytest.raises(TaskError, match="run cancelled") as ei:
            refs[1].result()
        assert ei.value.outcome == "SKIPPED" and ei.value.hashid == value.hashid
        assert h.run.task_results() == [42, None]
        w.free(flags)
    finally:
        w.close()
