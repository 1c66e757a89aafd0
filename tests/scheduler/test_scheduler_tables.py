"""The Scheduler's pure core, as tables of events in and dispatches out.

NEXT_LEVEL rules cannot run on real children yet, so the lanes here sit on a
small in-memory endpoint (``MemEndpoint``) that implements the WorkerEndpoint
protocol of ``endpoints/base.py``: it records every publication and emits a
COMPLETED event only when the test releases that dispatch. The Scheduler is
built directly (no loop, no coroutine) and driven one ``round()`` at a time.

Each table row is ``(released, dispatched)``: the dispatches the test completes
(``"name"`` succeeds, ``"name!text"`` fails with ``text``), then exactly one
round, then every publication that round made, per worker. Group members are
``name[i]`` (member ``i`` runs on ``workers[i]``); a staged successor task is
``name+staged``; a refused publication is ``name(refused)``. ``validate()`` runs
at teardown of every test.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator
from typing import Any

import pytest

import simpler_daemon.scheduler.dispatch as scheduler_mod
from simpler_daemon.args import CallConfig, Tag, TaskArgs
from simpler_daemon.callables import spec_for_import
from simpler_daemon.engine.orchestrator import RunState, SlotState
from simpler_daemon.errors import RunCancelled, TaskError
from tests.support.scheduler_rig import Harness


@pytest.fixture
def make() -> Iterator[Any]:
    made: list[Harness] = []

    def factory(**kw: Any) -> Harness:
        h = Harness(**kw)
        made.append(h)
        return h

    yield factory
    try:
        for h in made:
            h.validate()
    finally:
        for h in made:
            h.close()


def tensor_args(*tensors: tuple[Any, Tag]) -> TaskArgs:
    a = TaskArgs()
    for t, tag in tensors:
        a.add_tensor(t, tag)
    return a


def slot_state(h: Harness, name: str) -> SlotState:
    for run in h.runs:
        for s in run.slots:
            if h.names.get(s.slot_id) == name:
                return s.state
    raise AssertionError(name)


# -- NEXT_LEVEL singles -----------------------------------------------------------------------------


def test_next_level_single_runs_only_on_its_target_and_is_never_stolen(make: Any) -> None:
    h = make()
    o = h.run()
    h.nl(o, "a0", 0)
    h.nl(o, "a1", 0)
    h.nl(o, "a2", 0)
    h.done_building(o)
    assert h.take() == {"nl0": ["a0"]}
    h.play(
        [
            # released   dispatched (worker 1 idles throughout)
            ([], {}),
            ([], {}),
            (["a0"], {"nl0": ["a1"]}),
            (["a1"], {"nl0": ["a2"]}),
            (["a2"], {}),
        ]
    )
    assert h.eps["nl1"].attempts == []
    assert o.run.state is RunState.COMPLETED


def test_dispatch_ids_are_per_lane_and_increase_from_one(make: Any) -> None:
    h = make()
    o = h.run()
    for i in range(3):
        h.nl(o, f"a{i}", 0)
        h.nl(o, f"b{i}", 1)
    h.done_building(o)
    assert h.take() == {"nl0": ["a0"], "nl1": ["b0"]}
    h.play(
        [
            (["a0", "b0"], {"nl0": ["a1"], "nl1": ["b1"]}),
            (["a1", "b1"], {"nl0": ["a2"], "nl1": ["b2"]}),
            (["a2", "b2"], {}),
        ]
    )
    for key in ("nl0", "nl1"):
        assert [d.dispatch_id for d, _ in h.eps[key].attempts] == [1, 2, 3]


# -- NEXT_LEVEL groups ------------------------------------------------------------------------------


def test_group_launches_all_or_nothing_and_is_not_overtaken_by_a_later_single(make: Any) -> None:
    h = make()
    o = h.run()
    h.nl(o, "s0", 0)
    h.nl(o, "s1", 1)
    h.group(o, "g", [1, 0])
    h.nl(o, "s3", 0)  # queued behind the group for one of its targets
    h.done_building(o)
    assert h.take() == {"nl0": ["s0"], "nl1": ["s1"]}
    h.play(
        [
            # worker 0 idles first: the group cannot launch, and s3 waits behind it
            (["s0"], {}),
            ([], {}),
            # both targets idle: every member launches in the same round (member i on workers[i])
            (["s1"], {"nl1": ["g[0]"], "nl0": ["g[1]"]}),
            # the group has launched, so worker 0 is free for s3 once its member is done
            (["g[1]"], {"nl0": ["s3"]}),
            (["g[0]"], {}),
            (["s3"], {}),
        ]
    )
    assert o.run.state is RunState.COMPLETED


def test_a_later_group_reserves_nothing_and_groups_launch_in_fifo_order(make: Any) -> None:
    h = make(next_level=(0, 1, 2))
    o = h.run()
    h.nl(o, "s0", 0)
    h.group(o, "g1", [0, 1])  # head group: blocked on worker 0, reserves 0 and 1
    h.group(o, "g2", [1, 2])  # later group: reserves nothing
    h.nl(o, "s3", 2)  # not reserved: runs now
    h.nl(o, "s4", 1)  # reserved by the head group: waits
    h.done_building(o)
    assert h.take() == {"nl0": ["s0"], "nl2": ["s3"]}
    h.play(
        [
            (["s0"], {"nl0": ["g1[0]"], "nl1": ["g1[1]"]}),
            # worker 2 idles, but g2 needs worker 1 too: nothing launches
            (["s3"], {}),
            # g1 launched, so g2 is the head now: it launches once workers 1 and 2 idle,
            # ahead of s4 (queued for worker 1 behind it)
            (["g1[1]"], {"nl1": ["g2[0]"], "nl2": ["g2[1]"]}),
            (["g1[0]"], {}),
            (["g2[0]"], {"nl1": ["s4"]}),
            (["g2[1]", "s4"], {}),
        ]
    )
    assert o.run.state is RunState.COMPLETED


def test_a_blocked_group_head_keeps_later_groups_waiting_even_on_idle_workers(make: Any) -> None:
    h = make(next_level=(0, 1, 2))
    o = h.run()
    h.nl(o, "s0", 0)
    h.group(o, "g1", [0, 1])
    h.group(o, "g2", [2])
    h.done_building(o)
    assert h.take() == {"nl0": ["s0"]}
    h.play(
        [
            ([], {}),
            (["s0"], {"nl0": ["g1[0]"], "nl1": ["g1[1]"], "nl2": ["g2[0]"]}),
            (["g1[0]", "g1[1]", "g2[0]"], {}),
        ]
    )


def test_group_yields_one_aggregate_completion_once_every_member_is_terminal(make: Any) -> None:
    h = make()
    x = h.heap.alloc((8,), "float32")
    o = h.run()
    g = h.group(
        o, "g", [0, 1], [tensor_args((x[:4], Tag.OUTPUT)), tensor_args((x[4:], Tag.OUTPUT))]
    )
    h.nl(o, "c", 0, tensor_args((x, Tag.INPUT)))
    h.done_building(o)
    assert h.take() == {"nl0": ["g[0]"], "nl1": ["g[1]"]}
    h.play(
        [
            # worker 0 is idle, but its consumer waits for the whole group
            (["g[0]"], {}),
        ]
    )
    assert g.state is SlotState.RUNNING and slot_state(h, "c") is SlotState.PENDING
    assert o.run.counts["done"] == 0
    h.play(
        [
            (["g[1]"], {"nl0": ["c"]}),
            (["c"], {}),
        ]
    )
    assert g.state is SlotState.COMPLETED
    assert o.run.counts == {"done": 2, "failed": 0, "running": 0, "skipped": 0}
    assert o.run.state is RunState.COMPLETED


def test_group_first_failing_member_error_wins_and_poisons_its_consumer(make: Any) -> None:
    h = make()
    x = h.heap.alloc((8,), "float32")
    o = h.run()
    g = h.group(o, "g", [0, 1], [tensor_args((x[:4], Tag.OUTPUT)), TaskArgs()])
    h.nl(o, "c", 1, tensor_args((x, Tag.INPUT)))
    h.nl(o, "d", 0)  # independent
    h.done_building(o)
    assert h.take() == {"nl0": ["g[0]"], "nl1": ["g[1]"]}
    h.play(
        [
            (["g[1]!member one failed"], {}),
            (["g[0]!member zero failed"], {"nl0": ["d"]}),  # c never runs; d still does
            (["d"], {}),
        ]
    )
    assert g.state is SlotState.FAILED and slot_state(h, "c") is SlotState.FAILED
    assert slot_state(h, "d") is SlotState.COMPLETED
    assert [h.label(d) for d, _ in h.eps["nl1"].attempts] == ["g[1]"]
    err = o.run.error
    assert isinstance(err, TaskError) and o.run.state is RunState.FAILED
    assert err.remote_text == "member one failed"
    assert (err.worker_id, err.dispatch_id, err.outcome) == (1, 1, "TASK_FAILURE")
    assert err.hashid == h.chip.hashid
    assert o.run.counts == {"done": 1, "failed": 1, "running": 0, "skipped": 1}


def test_group_with_one_failing_member_fails_after_the_other_finishes(make: Any) -> None:
    h = make()
    o = h.run()
    g = h.group(o, "g", [0, 1])
    h.done_building(o)
    h.take()
    h.play([(["g[0]!zero"], {})])
    assert g.state is SlotState.RUNNING and not o.run.terminal
    h.play([(["g[1]"], {})])
    assert g.state is SlotState.FAILED and o.run.state is RunState.FAILED
    assert o.run.error is not None and o.run.error.remote_text == "zero"


# -- runs and admission ---------------------------------------------------------------------------


def test_only_the_head_run_partition_dispatches(make: Any) -> None:
    h = make()
    a = h.run()
    b = h.run()
    c = h.run()
    assert h.admitted == [a.run, b.run] and not c.run.admitted
    h.nl(a, "a0", 0)
    h.nl(b, "b0", 1)  # worker 1 idles, but run B is not the head
    h.done_building(b)
    h.done_building(a)
    assert h.take() == {"nl0": ["a0"]}
    assert b.run.state is RunState.PREPARED
    h.play(
        [
            ([], {}),
            (["a0"], {"nl1": ["b0"]}),  # A completes, B becomes the head in the same round
        ]
    )
    assert a.run.state is RunState.COMPLETED and b.run.state is RunState.EXECUTING
    assert h.admitted == [a.run, b.run, c.run]  # A's lease went to C
    h.nl(c, "c0", 0)  # C is the successor now: worker 0 idles, c0 waits
    h.done_building(c)
    h.play(
        [
            ([], {}),
            (["b0"], {"nl0": ["c0"]}),
            (["c0"], {}),
        ]
    )
    assert [r.state for r in h.runs] == [RunState.COMPLETED] * 3


def test_two_frame_lane_stages_one_single_of_the_successor_and_promotes_it(make: Any) -> None:
    h = make(frames=2)
    a = h.run()
    b = h.run()
    h.nl(a, "a0", 0)
    h.nl(b, "b0", 0)
    h.nl(b, "b1", 0)
    h.nl(b, "b2", 1)
    h.done_building(b)
    h.done_building(a)
    assert h.take() == {"nl0": ["a0"]}
    h.play(
        [
            # one single of the prepared successor is staged (prepare_only), no more
            ([], {"nl0": ["b0+staged"]}),
            ([], {}),
        ]
    )
    b0 = h.find("b0+staged")[1]
    h.play(
        [
            # A completes: B is the head; its staged dispatch is promoted (no new publication)
            (["a0"], {"nl1": ["b2"]}),
        ]
    )
    assert h.eps["nl0"].activated == [b0.dispatch_id]
    lane0 = h.sched.manager.next_level[0]
    assert lane0.active is b0 and lane0.staged is None
    h.play(
        [
            (["b0+staged"], {"nl0": ["b1"]}),
            (["b1", "b2"], {}),
        ]
    )
    assert [r.state for r in h.runs] == [RunState.COMPLETED] * 2


def test_a_diagnostic_task_is_never_staged(make: Any) -> None:
    h = make(frames=2)
    a = h.run()
    b = h.run()
    h.nl(a, "a0", 0)
    h.nl(b, "b0", 0, config=CallConfig(enable_profile=True))
    h.done_building(a)
    h.done_building(b)
    assert h.take() == {"nl0": ["a0"]}
    h.play(
        [
            ([], {}),
            (["a0"], {"nl0": ["b0"]}),
            (["b0"], {}),
        ]
    )


def test_zero_task_run_completes_and_releases_its_lease(make: Any) -> None:
    h = make()
    a = h.run()
    b = h.run()
    h.done_building(a)
    assert a.run.state is RunState.COMPLETED
    assert h.sched.admission.head is b.run
    h.done_building(b)
    assert b.run.state is RunState.COMPLETED and h.sched.admission.runs() == []


def test_a_late_enqueue_for_a_terminal_run_is_dropped(make: Any) -> None:
    h = make()
    o = h.run()
    s = h.nl(o, "a0", 0)
    h.done_building(o)
    assert h.take() == {"nl0": ["a0"]}
    h.play([(["a0"], {})])
    assert o.run.terminal
    s.state = SlotState.READY
    h.sched.enqueue_ready(s)
    assert h.sched.queued() == 0
    s.state = SlotState.COMPLETED


# -- failures ------------------------------------------------------------------------------------


def test_a_rejected_dispatch_becomes_an_endpoint_failure_without_raising(make: Any) -> None:
    h = make()
    x = h.heap.alloc((4,), "float32")
    h.eps["nl0"].refuse = "device unplugged"
    o = h.run()
    h.nl(o, "a0", 0, tensor_args((x, Tag.OUTPUT)))
    h.nl(o, "a1", 1, tensor_args((x, Tag.INPUT)))  # consumer of the refused task
    h.done_building(o)
    assert h.take() == {"nl0": ["a0(refused)"]}
    h.play([([], {})])  # the refusal drains as a completion; nothing raised
    assert slot_state(h, "a0") is SlotState.FAILED and slot_state(h, "a1") is SlotState.FAILED
    assert o.run.state is RunState.FAILED
    err = o.run.error
    assert isinstance(err, TaskError)
    assert err.outcome == "ENDPOINT_FAILURE" and err.worker_id == 0 and err.dispatch_id == 1
    assert "device unplugged" in err.remote_text
    assert h.eps["nl1"].attempts == []


def test_a_refused_group_member_fails_the_group_once_the_others_are_terminal(make: Any) -> None:
    h = make()
    h.eps["nl1"].refuse = "link down"
    o = h.run()
    g = h.group(o, "g", [0, 1])
    h.done_building(o)
    assert h.take() == {"nl0": ["g[0]"], "nl1": ["g[1](refused)"]}
    h.play([([], {})])
    assert g.state is SlotState.RUNNING and not o.run.terminal  # member 0 still runs
    h.play([(["g[0]"], {})])
    assert g.state is SlotState.FAILED and o.run.state is RunState.FAILED
    err = o.run.error
    assert err is not None and err.outcome == "ENDPOINT_FAILURE" and err.worker_id == 1
    assert "link down" in err.remote_text


def test_a_refused_worker_does_not_stop_independent_tasks(make: Any) -> None:
    h = make()
    h.eps["nl0"].refuse = "gone"
    o = h.run()
    h.nl(o, "a0", 0)
    h.nl(o, "b0", 1)
    h.done_building(o)
    assert h.take() == {"nl0": ["a0(refused)"], "nl1": ["b0"]}
    h.play([(["b0"], {})])
    assert slot_state(h, "b0") is SlotState.COMPLETED
    assert o.run.state is RunState.FAILED and o.run.error is not None
    assert o.run.error.outcome == "ENDPOINT_FAILURE"


def test_failure_skips_consumers_recursively(make: Any) -> None:
    h = make()
    x = h.heap.alloc((4,), "float32")
    y = h.heap.alloc((4,), "float32")
    o = h.run()
    h.nl(o, "p", 0, tensor_args((x, Tag.OUTPUT)))
    h.nl(o, "c1", 0, tensor_args((x, Tag.INPUT), (y, Tag.OUTPUT)))
    h.nl(o, "c2", 1, tensor_args((y, Tag.INPUT)))
    h.nl(o, "i", 1)
    h.done_building(o)
    assert h.take() == {"nl0": ["p"], "nl1": ["i"]}
    h.play(
        [
            (["p!producer broke"], {}),
            (["i"], {}),
        ]
    )
    assert [slot_state(h, n) for n in ("p", "c1", "c2", "i")] == [
        SlotState.FAILED,
        SlotState.FAILED,
        SlotState.FAILED,
        SlotState.COMPLETED,
    ]
    assert o.run.counts == {"done": 1, "failed": 1, "running": 0, "skipped": 2}
    assert o.run.error is not None and o.run.error.remote_text == "producer broke"


def test_a_task_submitted_after_its_producer_failed_is_failed_at_submit(make: Any) -> None:
    h = make()
    x = h.heap.alloc((4,), "float32")
    o = h.run()
    h.nl(o, "p", 0, tensor_args((x, Tag.OUTPUT)))
    assert h.take() == {"nl0": ["p"]}
    h.play([(["p!nope"], {})])
    with pytest.raises(TaskError) as info:
        h.nl(o, "c", 1, tensor_args((x, Tag.INPUT)))
    assert info.value is o.run.error
    h.done_building(o)
    assert o.run.state is RunState.FAILED


def test_cancel_fails_unstarted_slots_and_lets_running_ones_finish(make: Any) -> None:
    h = make()
    x = h.heap.alloc((4,), "float32")
    o = h.run()
    h.nl(o, "r", 0, tensor_args((x, Tag.OUTPUT)))
    h.nl(o, "c", 1, tensor_args((x, Tag.INPUT)))
    h.nl(o, "q", 0)
    h.take()
    h.sched.cancel(o.run)
    h.done_building(o)
    assert slot_state(h, "r") is SlotState.RUNNING
    assert slot_state(h, "c") is SlotState.FAILED and slot_state(h, "q") is SlotState.FAILED
    assert not o.run.terminal
    h.play([(["r"], {})])  # nothing further is dispatched
    assert o.run.state is RunState.FAILED
    assert isinstance(o.run.error, RunCancelled)


def test_cancel_of_a_queued_run_never_dispatches_it(make: Any) -> None:
    h = make()
    a = h.run()
    b = h.run()
    h.nl(a, "a0", 0)
    h.nl(b, "b0", 1)
    h.done_building(a)
    h.done_building(b)
    assert h.take() == {"nl0": ["a0"]}
    h.sched.cancel(b.run)
    assert b.run.state is RunState.FAILED and isinstance(b.run.error, RunCancelled)
    h.play([(["a0"], {}), ([], {})])
    assert h.eps["nl1"].attempts == []


# -- SUB pool ------------------------------------------------------------------------------------


def test_sub_tasks_run_on_any_idle_sub_worker(make: Any) -> None:
    h = make(next_level=(), subs=2)
    o = h.run()
    for i in range(4):
        h.sub(o, f"s{i}")
    h.done_building(o)
    assert h.take() == {"sub0": ["s0"], "sub1": ["s1"]}
    h.play(
        [
            (["s1"], {"sub1": ["s2"]}),
            (["s0"], {"sub0": ["s3"]}),
            (["s2", "s3"], {}),
        ]
    )


def test_sub_group_needs_that_many_distinct_idle_sub_workers(make: Any) -> None:
    h = make(next_level=(), subs=2)
    o = h.run()
    h.sub(o, "s0")
    h.sub_group(o, "g", 2)
    h.sub(o, "s2")  # behind the group in the SUB FIFO
    h.done_building(o)
    assert h.take() == {"sub0": ["s0"]}
    h.play(
        [
            ([], {}),  # one SUB worker idles: the group waits, s2 behind it too
            (["s0"], {"sub0": ["g[0]"], "sub1": ["g[1]"]}),
            (["g[1]"], {"sub1": ["s2"]}),
            (["g[0]", "s2"], {}),
        ]
    )
    assert o.run.state is RunState.COMPLETED


def test_sub_group_larger_than_the_pool_fails_with_a_clear_error(make: Any) -> None:
    h = make(next_level=(), subs=2)
    o = h.run()
    h.sub(o, "s")
    h.sub_group(o, "g", 3)
    h.done_building(o)
    assert h.take() == {"sub0": ["s"]}
    h.play([(["s"], {})])
    assert slot_state(h, "g") is SlotState.FAILED
    err = o.run.error
    assert err is not None and "needs 3 distinct SUB workers, the pool has 2" in str(err)


# -- validation -----------------------------------------------------------------------------------


def test_handles_are_validated_against_the_registry(make: Any) -> None:
    h = make()
    o = h.run()
    with pytest.raises(TypeError, match=r"Worker\.register"):
        o.submit_sub(7)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Worker\.register"):
        o.submit_next_level(0, TaskArgs(), worker=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not as a SUB callable"):
        o.submit_sub(h.chip)
    unknown = spec_for_import("tests.support.sub_tasks:noop").handle
    with pytest.raises(ValueError, match="is not registered"):
        o.submit_sub(unknown)
    with pytest.raises(
        ValueError, match=r"worker=5 is not a registered NEXT_LEVEL worker \(known: \[0, 1\]\)"
    ):
        o.submit_next_level(h.chip, TaskArgs(), worker=5)
    h.done_building(o)
    assert o.run.state is RunState.COMPLETED


# -- stall warning ---------------------------------------------------------------------------------


def test_a_blocked_group_head_warns_once_per_episode(
    make: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [100.0]
    monkeypatch.setattr(scheduler_mod, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    caplog.set_level(logging.WARNING, logger="simpler_daemon.scheduler")
    h = make()
    o = h.run()
    h.nl(o, "s1", 1)
    h.group(o, "g", [0, 1])
    h.nl(o, "s0", 0)  # worker 0 idles with a queued single the group reserves
    h.done_building(o)
    h.take()

    def warnings() -> int:
        return sum("blocked" in r.getMessage() for r in caplog.records)

    h.sched.round()
    now[0] += 4.0
    h.sched.round()
    assert warnings() == 0
    now[0] += 2.0
    h.sched.round()
    assert warnings() == 1
    now[0] += 10.0
    h.sched.round()
    assert warnings() == 1  # one per episode
    h.play(
        [
            (["s1"], {"nl0": ["g[0]"], "nl1": ["g[1]"]}),
            (["g[0]", "g[1]"], {"nl0": ["s0"]}),
            (["s0"], {}),
        ]
    )
    assert warnings() == 1
