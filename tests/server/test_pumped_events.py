"""The daemon's bookkeeping of the tasks the C SUB pump publishes and completes.

The Scheduler hands those tasks to the run table in batches (``on_pumped``): the
run's trace and its record's counts take a batch in one call per run. In process (a
real Worker, the daemon's real RunTable on the test's loop, hooked as the servicer
hooks it): two runs of plain tasks submitted at once (a batch can hold tasks of
both: the tail of one and the head of the next), a run whose tasks return values (the per-task path, which accounts
each result against ``limits.max_run_result_bytes``), and a record with a watcher (one
event a task) all end with the counts, trace and events a task-by-task path gives.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from simpler_daemon import CallableHandle, Worker
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.scheduler import trace as trace_module
from simpler_daemon.scheduler.runmodel import by_run
from simpler_daemon.server.config import LimitsConfig
from simpler_daemon.server.run_record import RunRecord
from simpler_daemon.server.runs import RunTable
from tests.support import sub_tasks as tasks
from tests.support.sub_tasks import targs

WAIT_S = 60.0


def answer(args: Any) -> int:
    """A SUB callable (module level: the children inherit it): 3 * scalars[0]."""
    return int(args.scalars[0]) * 3


@contextlib.asynccontextmanager
async def hooked(
    admission: str, fn: Callable[[Any], Any], limits: LimitsConfig | None = None
) -> AsyncIterator[tuple[RunTable, CallableHandle, dict[str, list[int]]]]:
    """A traced Worker with ``fn`` registered, and the daemon's run table over it,
    hooked as the servicer hooks it: the table, ``fn``'s handle and the sizes of the
    batches the table's ``on_pumped`` got, by event."""
    w = Worker(num_sub_workers=2, admission=admission, trace=True)
    h = w.register(fn)
    async with w:
        table = RunTable(w, limits or LimitsConfig(), None)
        sched = w.scheduler
        assert sched is not None
        batches: dict[str, list[int]] = {"dispatched": [], "completed": []}

        def on_pumped(slots: list[Any], event: str, worker_id: int) -> None:
            batches[event].append(len(slots))
            table.on_pumped(slots, event, worker_id)

        sched.on_task_event = table.on_task_event
        sched.on_pumped = on_pumped
        yield table, h, batches


async def launch(table: RunTable, n: int, h: Any, *, valued: bool = False) -> RunRecord:
    """A run of ``n`` SUB tasks through the run table (plain ones unless ``valued``)."""
    rec = table.new_record(label="pumped", client="uid:1", key="", total=None)

    async def orch(o: Any, _a: Any, _c: Any) -> None:
        rec.bind(o.run)
        for i in range(n):
            o.submit_sub(h, targs(scalars=(i,)) if valued else None)
            if i % 64 == 63:
                await asyncio.sleep(0)  # the other run submits meanwhile

    await table.launch(rec, orch)
    return rec


def attempts(rec: RunRecord) -> list[tuple[int, int, int, str]]:
    """(task, member, attempt, outcome) of every attempt in the run's trace."""
    assert rec.trace is not None
    doc = rec.trace.chrome(rec.run_id)
    return sorted(
        (e["args"]["task"], e["args"].get("member", 0), e["args"]["attempt"], e["args"]["outcome"])
        for e in doc["traceEvents"]
        if e.get("cat") == "task"
    )


@pytest.mark.asyncio
async def test_two_runs_of_plain_tasks_count_and_trace_every_task() -> None:
    n = 300
    async with hooked("fifo", tasks.noop) as (table, h, batches):
        a, b = await launch(table, n, h), await launch(table, n, h)
        for rec in (a, b):
            status = await table.wait(rec, WAIT_S)
            assert status.state == pb.RUN_STATE_COMPLETED
            assert (status.counts.total, status.counts.done) == (n, n)
            assert (status.counts.running, status.counts.failed) == (0, 0)
            assert rec.trace is not None and len(rec.trace) == n
            assert not rec.trace._batches  # written out once answered: no slot held
            assert attempts(rec) == [(i, 0, 1, "SUCCESS") for i in range(n)]
            assert rec.seq >= 2 * n  # a sequence number per task event, as one by one
    # The pump's path took (most of) the tasks: in batches, none of them empty. A task
    # may be published twice (taken back unstarted from a queue frame for an idle
    # lane, then published again), but it completes once.
    done = batches["completed"]
    assert done and min(done) >= 1 and sum(done) <= 2 * n
    assert batches["dispatched"] and min(batches["dispatched"]) >= 1


@pytest.mark.asyncio
async def test_results_are_accounted_one_by_one_against_the_run_limit() -> None:
    # Room for about 5 small results: a later one fails the run, naming the limit,
    # and its attempt in the trace says TASK_FAILURE.
    async with hooked("fair", answer, LimitsConfig(max_run_result_bytes=5 * 16)) as (table, h, _):
        rec = await launch(table, 40, h, valued=True)
        status = await table.wait(rec, WAIT_S)
        assert status.state == pb.RUN_STATE_FAILED
        assert "limits.max_run_result_bytes" in status.error.message
        assert status.counts.failed >= 1
        outcomes = {outcome for _, _, _, outcome in attempts(rec)}
        assert "TASK_FAILURE" in outcomes and "SUCCESS" in outcomes


@pytest.mark.asyncio
async def test_a_watched_record_gets_an_event_per_task() -> None:
    n = 50
    async with hooked("fair", tasks.noop) as (table, h, _):
        rec = table.new_record(label="watched", client="uid:1", key="", total=None)
        started = asyncio.Event()
        go = asyncio.Event()

        async def orch(o: Any, _a: Any, _c: Any) -> None:
            rec.bind(o.run)
            started.set()
            await go.wait()  # the watcher is in place before the first task
            for _ in range(n):
                o.submit_sub(h, None)

        await table.launch(rec, orch)
        await asyncio.wait_for(started.wait(), WAIT_S)
        events: list[Any] = []

        async def watch() -> None:
            async for ev in rec.events():
                events.append(ev)

        watcher = asyncio.ensure_future(watch())
        await asyncio.sleep(0)
        go.set()
        await asyncio.wait_for(watcher, WAIT_S)
        kinds = [ev.type for ev in events]
        # Dispatched at least once each: a task taken back unstarted from a queue frame
        # (for an idle lane) is dispatched again; each completes once.
        assert kinds.count(pb.RUN_EVENT_TYPE_TASK_DISPATCHED) >= n
        assert kinds.count(pb.RUN_EVENT_TYPE_TASK_COMPLETED) == n
        assert kinds[-1] == pb.RUN_EVENT_TYPE_RUN_STATE
        assert events[-1].state == pb.RUN_STATE_COMPLETED


def test_a_batch_is_cut_where_its_run_changes() -> None:
    class Slot:
        def __init__(self, run: object) -> None:
            self.run = run

    a, b = object(), object()
    one = [Slot(a), Slot(a)]
    assert by_run(one)[0] is one  # type: ignore[arg-type]  # one run: the batch itself, no copy
    mixed = [Slot(a), Slot(a), Slot(b), Slot(a)]
    groups = by_run(mixed)  # type: ignore[arg-type]
    assert [[s.run for s in g] for g in groups] == [[a, a], [b], [a]]


@pytest.mark.asyncio
async def test_a_trace_keeps_at_most_its_cap_of_attempts_and_counts_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MAX_TRACE_ATTEMPTS bounds what a trace keeps, pending batches included; the
    attempts past it are counted as dropped, and the trace says so."""
    monkeypatch.setattr(trace_module, "MAX_TRACE_ATTEMPTS", 10)
    async with hooked("fifo", tasks.noop) as (table, h, _):
        rec = await launch(table, 40, h)
        assert (await table.wait(rec, WAIT_S)).state == pb.RUN_STATE_COMPLETED
        assert rec.trace is not None
        assert len(rec.trace) == 10 and rec.trace.dropped == 30
        doc = rec.trace.chrome(rec.run_id)
        assert doc["otherData"]["attempts"] == 10
        assert doc["otherData"]["attempts_dropped"] == 30
