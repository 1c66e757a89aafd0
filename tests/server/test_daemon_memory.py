"""A finished run costs the daemon a small status, not its tasks; and a SubmitRun of
repeated identical tasks is validated once (the daemon's half of the C SUB pump work).

In process (a real Worker and the daemon's real RunTable on the test's loop): once a
run is terminal its record holds no engine ``Run`` (a weak reference to it is dead
without a collection: no cycle keeps it) while its status, counts, error and results
still answer; ``Run.release`` keeps what ``task_results`` / ``TaskRef.result`` read;
a finished run's record costs about ``STATUS_BYTES``. Through one real daemon
(module-scoped): ``limits.max_finished_run_bytes`` evicts the oldest finished runs
(NotFound names that limit) and the statuses kept after the release are right.
"""

from __future__ import annotations

import asyncio
import gc
import re
import sys
import time
import tracemalloc
import urllib.request
import weakref
from collections.abc import Iterator
from typing import Any, cast

import pytest

from simpler_daemon import Worker
from simpler_daemon.client import Client, RunPhase, sub_task
from simpler_daemon.client.errors import NotFound
from simpler_daemon.engine.orchestrator import Run, TaskRef
from simpler_daemon.errors import InvalidField, TaskError, UnknownObject
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.scheduler.trace import ATTEMPT_BYTES, RunTrace
from simpler_daemon.server.config import CallablesConfig, LimitsConfig
from simpler_daemon.server.plan import Planner
from simpler_daemon.server.run_record import STATUS_BYTES
from simpler_daemon.server.runs import RunTable
from tests.support import sub_tasks as tasks
from tests.support.daemon_harness import (
    EXAMPLES,
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    wait_until,
)
from tests.support.sub_tasks import targs

pytestmark = pytest.mark.timeout(120)

TASKS = "tests.support.daemon_tasks"


def answer(args: Any) -> int:
    """A SUB callable (module level: the children inherit it): 3 * scalars[0]."""
    return int(args.scalars[0]) * 3


# --------------------------------------------------------------------------- in process


def _table(w: Worker) -> RunTable:
    """The daemon's run table over ``w``, hooked to its task events as the servicer does."""
    table = RunTable(w, LimitsConfig(), None)
    assert w.scheduler is not None
    w.scheduler.on_task_event = table.on_task_event
    w.scheduler.on_pumped = table.on_pumped
    return table


async def _launch(
    table: RunTable, n: int, h: Any, fail_at: int | None = None, bad: Any = None
) -> tuple[Any, weakref.ref[Run]]:
    """Launch a run of ``n`` SUB tasks through the daemon's RunTable (the orchestration
    keeps none of its TaskRefs: they would keep the Run alive); its record and a weak
    reference to its engine Run."""
    rec = table.new_record(label="mem", client="uid:1", key="", total=None)

    async def orch(o: Any, _a: Any, _c: Any) -> None:
        rec.bind(o.run)
        for i in range(n):
            if i == fail_at:
                o.submit_sub(bad, targs())
            else:
                o.submit_sub(h, targs(scalars=(i,)))

    await table.launch(rec, orch)
    assert rec.run is not None
    return rec, weakref.ref(rec.run)


@pytest.mark.asyncio
async def test_a_finished_record_keeps_a_status_and_no_run() -> None:
    w = Worker(num_sub_workers=2, admission="fair")
    h = w.register(answer)
    bad = w.register(tasks.fail)
    async with w:
        table = _table(w)
        rec, run_ref = await _launch(table, 40, h)
        status = await table.wait(rec, 60, include_results=True)
        assert status.state == pb.RUN_STATE_COMPLETED
        # Freed by reference counting at the run's end: no cycle, no collection needed.
        assert rec.run is None and rec.handle is None
        assert run_ref() is None, gc.get_referrers(run_ref())
        assert status.counts.total == status.counts.done == 40 and status.counts.failed == 0
        got = {r.task_index: r.value for r in status.results}
        assert sorted(got) == list(range(40))  # task 0 returned 0: a value too
        assert table.list_runs(None, set(), 10)[0].summary(0).counts.done == 40
        # A failed run: the error naming the task survives the release.
        rec2, run_ref2 = await _launch(table, 10, h, fail_at=3, bad=bad)
        failed = await table.wait(rec2, 60, include_results=True)
        assert run_ref2() is None
        assert failed.state == pb.RUN_STATE_FAILED
        assert failed.error.task_index == 3 and "task 3" in failed.error.message
        assert failed.error.outcome == "TASK_FAILURE"
        assert failed.counts.failed >= 1 and failed.counts.total == 10
        assert table.record(rec2.run_id).status().error.message == failed.error.message


@pytest.mark.asyncio
async def test_a_run_whose_orchestration_submitted_after_its_failure_is_freed() -> None:
    """A submit after the run failed raises the run's error into the orchestration. The
    record keeps that error: its traceback (the orchestration's frames, which hold the
    Orchestrator) must not keep the Run alive. The orchestration waits for the failure,
    so this is the case every time (the 10-task run above meets it only by timing)."""
    w = Worker(num_sub_workers=1)
    h = w.register(answer)
    bad = w.register(tasks.fail)
    async with w:
        table = _table(w)
        rec = table.new_record(label="mem", client="uid:1", key="", total=None)
        raised: list[BaseException] = []

        async def orch(o: Any, _a: Any, _c: Any) -> None:
            rec.bind(o.run)
            o.submit_sub(bad, targs())
            deadline = time.monotonic() + 60
            # The engine's own state, which no event announces: polled, with a deadline.
            while o.run.error is None and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.001)
            try:
                o.submit_sub(h, targs(scalars=(1,)))
            except TaskError as exc:
                raised.append(exc)
                raise

        await table.launch(rec, orch)
        assert rec.run is not None
        run_ref = weakref.ref(rec.run)
        failed = await table.wait(rec, 60, include_results=True)
        assert failed.state == pb.RUN_STATE_FAILED and failed.error.task_index == 0
        assert len(raised) == 1  # the case under test happened
        raised.clear()
        assert run_ref() is None, gc.get_referrers(run_ref())


@pytest.mark.asyncio
async def test_kept_results_count_what_they_cost_in_memory() -> None:
    """limits.max_finished_result_bytes bounds memory: a kept result counts its tuple
    and objects too, not only its msgpack bytes (small results were undercounted ~6 x)."""
    w = Worker(num_sub_workers=2)
    h = w.register(answer)
    async with w:
        table = _table(w)
        rec, _ref = await _launch(table, 500, h)
        await table.wait(rec, 60)
        kept = rec._results
        assert len(kept) == 500
        actual = sys.getsizeof(kept) + sum(
            sys.getsizeof(t) + sys.getsizeof(t[0]) + sys.getsizeof(t[2]) for t in kept
        )
        assert rec.result_bytes >= actual, (rec.result_bytes, actual)


def test_the_byte_limit_evicts_from_the_client_holding_the_most_bytes() -> None:
    """One client's huge status must not evict another client's runs: past
    limits.max_finished_run_bytes the victim is the client holding the most bytes."""
    table = RunTable(cast(Any, None), LimitsConfig(max_finished_run_bytes=100_000), None)

    def finished(run_id: int, client: str, size: int) -> Any:
        rec = table.new_record(label=f"r{run_id}", client=client, key="", total=None)
        rec.run_id, rec.status_bytes = run_id, size
        table._runs[run_id] = rec
        table._highest_id = run_id
        table._remember_finished(rec)
        return rec

    small = [finished(i, "tcp:a", 3_000).run_id for i in range(1, 6)]
    huge = finished(6, "uid:0", 200_000)
    for run_id in small:
        assert table.record(run_id).label == f"r{run_id}"
    with pytest.raises(UnknownObject, match=r"max_finished_run_bytes = 100000"):
        table.record(huge.run_id)


def test_an_orchestration_error_text_is_bounded() -> None:
    from simpler_daemon.scheduler.completion import MAX_ORCH_ERROR_CHARS

    def orch(o: Any, _a: Any, _c: Any) -> None:
        raise ValueError("x" * (MAX_ORCH_ERROR_CHARS * 4))

    with Worker(num_sub_workers=1) as w:
        h = w.submit(orch)
        with pytest.raises(ValueError):  # in-process: the orchestration's own exception
            h.result(timeout=30)
        # What the run keeps (and the daemon's status carries) is bounded.
        text = str(h.run.error)
    assert len(text) < MAX_ORCH_ERROR_CHARS + 1000 and "more characters cut" in text


@pytest.mark.asyncio
async def test_release_keeps_what_task_results_and_task_refs_read() -> None:
    w = Worker(num_sub_workers=2, admission="fair")
    h = w.register(answer)
    bad = w.register(tasks.fail)
    nothing = w.register(tasks.noop)
    async with w:
        got: list[TaskRef] = []

        def orch(o: Any, _a: Any, _c: Any) -> None:
            got.append(o.submit_sub(h, targs(scalars=(2,))))
            got.append(o.submit_sub(nothing, targs()))
            got.append(o.submit_sub_group(h, [targs(scalars=(1,)), targs(scalars=(4,))]))

        handle = await w.submit_async(orch)
        before = await handle
        handle.run.release()
        assert handle.run.slots == [] and handle.run.released
        assert handle.result() == before == [6, None, [3, 12]]
        assert [r.result() for r in got] == [6, None, [3, 12]]
        assert handle.run.encoded_results() == [
            (0, None, b"\x06"),
            (2, 0, b"\x03"),
            (2, 1, b"\x0c"),
        ]

        def failing(o: Any, _a: Any, _c: Any) -> None:
            got.append(o.submit_sub(bad, targs()))

        second = await w.submit_async(failing)
        with pytest.raises(TaskError) as first_error:
            await second
        second.run.release()
        with pytest.raises(TaskError) as after:
            got[-1].result()
        assert str(after.value) == str(first_error.value)
        assert second.run.task_results() == [None]


@pytest.mark.asyncio
async def test_a_finished_record_costs_about_status_bytes() -> None:
    w = Worker(num_sub_workers=2, admission="fair")
    h = w.register(tasks.noop)
    async with w:
        table = _table(w)
        rec, _ = await _launch(table, 200, h)
        await table.wait(rec, 60)
        runs = 20
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(runs):
                rec, _ = await _launch(table, 200, h)
                await table.wait(rec, 60)
            await asyncio.sleep(0)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        # 200 kept slots would be ~100 KB per run; a status is STATUS_BYTES.
        assert grown / runs <= 2 * STATUS_BYTES, grown / runs
        assert rec.status_bytes >= STATUS_BYTES


class CountingPlanner(Planner):
    """The daemon's Planner, counting the task configs it validates."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checked: list[str] = []

    def call_config(self, msg: Any, field: str) -> Any:
        self.checked.append(field)
        return super().call_config(msg, field)


@pytest.mark.asyncio
async def test_plan_validates_repeated_identical_tasks_once() -> None:
    w = Worker(num_sub_workers=1)
    h = w.register(tasks.noop)
    async with w:
        planner = CountingPlanner(w, LimitsConfig(), CallablesConfig())
        task = pb.Task(
            kind=pb.TASK_KIND_SUB,
            hashid=h.hashid,
            members=[pb.Args(scalars=[7])],
            config=pb.CallConfig(threads=1),
        )
        other = pb.Task(kind=pb.TASK_KIND_SUB, hashid=h.hashid, members=[pb.Args(scalars=[8])])
        request = pb.SubmitRunRequest(tasks=[task] * 1000 + [other] + [task] * 999)
        plan, total = await planner.plan_run(request, set())
        assert total == 2000 and len(plan) == 2000
        assert planner.checked == ["tasks[0].config", "tasks[1001].config"]
        assert [p.members[0].scalars for p in (plan[0], plan[999], plan[1000], plan[1999])] == [
            [7],
            [7],
            [8],
            [7],
        ]
        # A bad task repeated: the error still names the first one's index and field.
        bad = pb.Task(kind=pb.TASK_KIND_SUB, hashid=h.hashid, members=[pb.Args()])
        bad.config.deadline_ms = 1 << 63
        request = pb.SubmitRunRequest(tasks=[task] * 10 + [bad] * 5)
        with pytest.raises(InvalidField) as info:
            await planner.plan_run(request, set())
        assert info.value.field == "tasks[10].config.deadline_ms"


# --------------------------------------------------------------------------- one daemon

# A finished run of 50 tasks keeps its status and its trace (one attempt per task).
KEPT_RUN = STATUS_BYTES + RunTrace().nbytes() + 50 * ATTEMPT_BYTES
STATUS_LIMIT = 3 * KEPT_RUN + 1500  # limits.max_finished_run_bytes: three such runs fit
CONFIG: dict[str, dict[str, Any]] = {
    "workers": {"num_sub_workers": 2},
    "limits": {"max_finished_run_bytes": STATUS_LIMIT},
    "metrics": {"listen": "127.0.0.1:0"},
    "callables": {"allowed_modules": ["simpler_daemon.examples", "tests"]},
}
_MODULE_DAEMONS: set[int] = set()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "daemon-memory", CONFIG, _MODULE_DAEMONS)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    yield from module_leak_guard(lambda: set(_MODULE_DAEMONS))


@pytest.fixture
def c(daemon: DaemonProcess) -> Iterator[Client]:
    with daemon.client(timeout=60) as client:
        yield client


def test_finished_runs_past_max_finished_run_bytes_are_evicted_oldest_first(c: Client) -> None:
    echo = c.register(f"{TASKS}:echo")
    fail = c.register(f"{EXAMPLES}:fail")
    failed = c.submit([sub_task(echo, scalars=[9]), sub_task(fail)], label="mem-failed")
    status = c.wait_run(failed, 60, include_results=True)
    # The status kept after the run let go of its tasks: state, counts, error, results.
    assert status.state is RunPhase.FAILED and status.error is not None
    assert status.error.task_index == 1 and status.error.outcome == "TASK_FAILURE"
    assert status.counts.failed == 1 and status.counts.done == 1 and status.counts.total == 2
    assert status.label == "mem-failed" and status.finish_time is not None
    assert [(r.task_index, r.value["scalars"]) for r in status.results] == [(0, [9])]
    runs = [failed]
    for i in range(4):
        fut = c.submit([sub_task(echo, scalars=[i])] * 50, label=f"mem-{i}")
        runs.append(fut)
        result = fut.result(timeout=60)
        assert result.counts.done == result.counts.total == 50
        assert [r.value["scalars"] for r in result.results] == [[i]] * 50
    # Three statuses fit the limit: the oldest finished runs are gone, the newest stay.
    kept = [r.run_id for r in c.list_runs(limit=100)]
    assert kept == [f.run_id for f in reversed(runs[-3:])]
    for gone in runs[:2]:
        with pytest.raises(
            NotFound, match=r"limits.max_finished_run_bytes = \d+\): its status is gone"
        ):
            c.wait_run(gone)
    assert c.wait_run(runs[-3], include_results=True).counts.done == 50


def test_metrics_expose_the_objects_the_daemon_tracks(daemon: DaemonProcess, c: Client) -> None:
    found = wait_until(
        lambda: re.search(r"metrics listening on 127\.0\.0\.1:(\d+)", daemon.stderr()),
        message="the daemon never logged its metrics port",
    )
    url = f"http://127.0.0.1:{int(found.group(1))}/metrics"
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    objects = re.search(r"^simpler_daemon_gc_objects (\S+)$", body, re.MULTILINE)
    assert objects is not None, body[-2000:]
    assert float(objects.group(1)) > 1000  # the daemon's modules, frozen or not
