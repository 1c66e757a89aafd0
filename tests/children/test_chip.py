"""Chip children under a real Worker: two-frame staging, failures, controls, death.

Every ordering claim is read from recorded events, never from durations:

* the simulated backend's JSON-lines trace (``chip_trace_dir``): one file per chip
  child with ``prepare / launch / complete / finalize / launch_failed`` and the
  dispatch id, in the order the child recorded them;
* the Scheduler's ``on_task_event`` ("dispatched", "staged", "completed") plus the
  lanes' acceptance callbacks, in the order the parent observed them, with a
  snapshot of the mailbox words at the moment of each "staged" event.

A "long" run is a ``gate`` kernel that waits on a heap word the test sets (with a
deadline inside the kernel); a helper thread releases it once the condition the
test is about has been observed (or after a deadline, so a broken engine fails
the test instead of hanging it).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpler_daemon.args import CallConfig, Tag, TaskArgs
from simpler_daemon.callables import CallableHandle, spec_for_chip
from simpler_daemon.endpoints.base import Outcome
from simpler_daemon.engine.orchestrator import Orchestrator, TaskSlot
from simpler_daemon.engine.worker import Worker
from simpler_daemon.errors import TaskError
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.layout import (
    BASE_FRAME,
    OFF_ACCEPTED,
    OFF_DISPOSITION,
    TASK_FRAMES,
    ControlOp,
    Disposition,
    MailboxState,
)
from simpler_daemon.scheduler.lanes import WorkerCompletion
from simpler_daemon.testing import poll_for
from tests.support.chip_worker_rig import Chips, wait_all

KERNELS = ("add_one", "noop", "gate", "record_pid", "fail_prepare", "fail_launch", "boom")


# -- harness -----------------------------------------------------------------------------------


@pytest.fixture
def make_chips(tmp_path: Path) -> Iterator[Callable[..., Chips]]:
    made: list[Chips] = []

    def make(num_chips: int = 1, depth: int = 2, num_sub_workers: int = 0) -> Chips:
        trace_dir = tmp_path / f"trace-{len(made)}"
        trace_dir.mkdir()
        w = Worker(
            num_sub_workers=num_sub_workers,
            num_chips=num_chips,
            chip_pipeline_depth=depth,
            chip_trace_dir=str(trace_dir),
            heap_bytes=4 << 20,
        )
        handles = {
            name: w.register(f"tests.support.chip_kernels:{name}", kind="chip") for name in KERNELS
        }
        w.init()
        c = Chips(w, trace_dir, handles)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()


def single(
    k: CallableHandle,
    args: TaskArgs | None = None,
    config: CallConfig | None = None,
    worker: int = 0,
) -> Callable[[Orchestrator, Any, CallConfig], None]:
    def orch(o: Orchestrator, _a: Any, _c: CallConfig) -> None:
        o.submit_next_level(k, args, config, worker=worker)

    return orch


# -- data and placement ------------------------------------------------------------------------------


def test_a_kernel_writes_through_its_tensor_and_the_parent_sees_it(
    make_chips: Callable[..., Chips],
) -> None:
    c = make_chips()
    x = c.w.alloc((2, 8), "float32")
    x[...] = np.arange(16, dtype=np.float32).reshape(2, 8)
    c.w.run(single(c.k["add_one"], TaskArgs().add_tensor(x, Tag.INOUT)))
    assert x.tolist() == (np.arange(16, dtype=np.float32).reshape(2, 8) + 1).tolist()
    ws = c.w.list_workers()
    assert [(e["kind"], e["task_frames"], e["pipeline_depth"]) for e in ws] == [("chip", 2, 2)]
    assert c.w.scheduler is not None and c.w.scheduler.admission.depth == 2


def test_register_chip_after_init_sends_a_register_chip_control(
    make_chips: Callable[..., Chips],
) -> None:
    c = make_chips(num_chips=2)
    sent: list[tuple[int, ControlOp]] = []
    for ep in c.w.chip_endpoints:
        orig = ep.control

        async def spy(
            op: ControlOp, *a: Any, _orig: Any = orig, _wid: int = ep.worker_id, **kw: Any
        ) -> Any:
            sent.append((_wid, op))
            return await _orig(op, *a, **kw)

        ep.control = spy  # type: ignore[method-assign]
    h = c.w.register("tests.support.chip_kernels:write_scalar", kind="chip")
    assert (
        h.role == "chip"
        and h.hashid == spec_for_chip("tests.support.chip_kernels:write_scalar").handle.hashid
    )
    assert sorted(sent) == [(0, ControlOp.REGISTER_CHIP), (1, ControlOp.REGISTER_CHIP)]
    out = c.w.alloc(4, "int64")

    def orch(o: Orchestrator, _a: Any, _c: CallConfig) -> None:
        for wid in (0, 1):
            o.submit_next_level(
                h,
                TaskArgs()
                .add_tensor(out[wid : wid + 1], Tag.OUTPUT)
                .add_scalar(0)
                .add_scalar(7 + wid),
                worker=wid,
            )

    c.w.run(orch)
    assert out.tolist() == [7, 8, 0, 0]


def test_a_next_level_single_runs_only_on_its_target_chip(make_chips: Callable[..., Chips]) -> None:
    c = make_chips(num_chips=2)
    pids = {e["worker_id"]: e["pid"] for e in c.w.list_workers() if e["kind"] == "chip"}
    assert len(set(pids.values())) == 2
    seen = c.w.alloc((2, 3), "int64")

    def orch(o: Orchestrator, _a: Any, _c: CallConfig) -> None:
        for i in range(3):
            for wid in (1, 0):
                o.submit_next_level(
                    c.k["record_pid"],
                    TaskArgs().add_tensor(seen[wid, i : i + 1], Tag.OUTPUT),
                    worker=wid,
                )

    c.w.run(orch)
    assert seen[0].tolist() == [pids[0]] * 3
    assert seen[1].tolist() == [pids[1]] * 3
    for chip in (0, 1):
        recs = [r for r in c.records(chip) if r["event"] == "launch"]
        assert len(recs) == 3 and {r["pid"] for r in recs} == {pids[chip]}
    for e in c.of("completed"):
        assert e["outcome"] is Outcome.SUCCESS


def test_a_group_launches_only_when_every_target_is_idle(make_chips: Callable[..., Chips]) -> None:
    """Chip 0 runs a held single; the group on workers [1, 0] waits for it even though
    chip 1 is idle the whole time, then both members launch; member i ran on workers[i]."""
    c = make_chips(num_chips=2)
    g = c.gate()
    pids = {e["worker_id"]: e["pid"] for e in c.w.list_workers()}
    seen = c.w.alloc(2, "int64")

    def orch(o: Orchestrator, _a: Any, _c: CallConfig) -> None:
        o.submit_next_level(c.k["gate"], g.args(), worker=0)
        members = [TaskArgs().add_tensor(seen[i : i + 1], Tag.OUTPUT) for i in range(2)]
        o.submit_next_level_group(c.k["record_pid"], members, workers=[1, 0])

    h = c.w.submit(orch)
    quiet = c.quiet_rounds(20, 0.1)
    snapshot: list[list[tuple[str, int]]] = []

    def held() -> bool:
        if g.started() and quiet():
            snapshot.append(c.trace(1))
            return True
        return False

    c.release_when(g, held)
    wait_all(h)
    assert snapshot == [[]], "a group member launched on chip 1 while chip 0 was busy"
    assert seen.tolist() == [pids[1], pids[0]]
    gate_end = c.t(0, "finalize", 1)
    assert c.t(0, "launch", 2) > gate_end and c.t(1, "launch", 1) > gate_end
    assert c.at(0, "finalize", 1) < c.at(0, "launch", 2)


# -- staging the successor's first single --------------------------------------------------------------


def test_the_successors_first_single_is_staged_and_prepared_while_run_1_executes(
    make_chips: Callable[..., Chips],
) -> None:
    c = make_chips()
    g = c.gate()
    x = c.w.alloc(4, "float32")
    y = c.w.alloc(4, "float32")

    def run1(o: Orchestrator, _a: Any, _c: CallConfig) -> None:
        o.submit_next_level(c.k["add_one"], TaskArgs().add_tensor(x, Tag.INOUT), worker=0)
        o.submit_next_level(c.k["gate"], g.args(), worker=0)

    def run2(o: Orchestrator, _a: Any, _c: CallConfig) -> None:
        o.submit_next_level(c.k["add_one"], TaskArgs().add_tensor(y, Tag.INOUT), worker=0)
        o.submit_next_level(c.k["add_one"], TaskArgs().add_tensor(y, Tag.INOUT), worker=0)

    h1 = c.w.submit(run1)
    h2 = c.w.submit(run2)
    buf = c.endpoint(0).buf

    def staged_and_prepared() -> bool:
        staged = c.successors(h2.run_id)
        frame = staged[0]["frame"] if staged else None
        return (
            frame is not None
            and _mb.load32(buf, TASK_FRAMES[frame] + OFF_DISPOSITION) == Disposition.PREPARED
        )

    c.release_when(g, staged_and_prepared)
    wait_all(h1, h2)
    assert x.tolist() == [1.0] * 4 and y.tolist() == [2.0] * 4

    # Exactly one staged task: run 2's first single, in the frame of run 2's lease slot.
    assert [(e["run"], e["index"]) for e in c.successors()] == [(h2.run_id, 0)]
    st = c.successors()[0]
    succ = st["dispatch"]
    assert st["frame"] == h2.run.lease_slot == 1
    assert st["state"] == MailboxState.FRAME_STAGED
    assert st["accepted"] == 0
    assert ("launch", succ) not in st["trace"]
    # ... while run 1 executed: its last task completed only after the staging.
    last1 = c.one("completed", h1.run_id, 1)
    assert c.events.index(st) < c.events.index(last1)
    assert not any(
        e["kind"] == "accepted" and e["dispatch"] == succ for e in c.events[: c.events.index(last1)]
    )
    # Natively prepared during run 1, launched only after run 1's last task finalized.
    run1_last = last1["dispatch"]
    assert c.at(0, "prepare", succ) < c.at(0, "complete", run1_last)
    assert c.at(0, "finalize", run1_last) < c.at(0, "launch", succ)
    assert c.count(0, "launch", succ) == c.count(0, "finalize", succ) == 1
    # ACCEPTED once, after the launch boundary (above), before its completion.
    acc = [i for i, e in enumerate(c.events) if e["kind"] == "accepted" and e["dispatch"] == succ]
    assert len(acc) == 1 and acc[0] < c.pos("completed", h2.run_id, 0)
    # The second single of run 2 was dispatched normally, after run 2 became the head.
    assert c.pos("dispatched", h2.run_id, 1) > c.events.index(last1)


def test_a_diagnostic_successor_is_not_staged(make_chips: Callable[..., Chips]) -> None:
    c = make_chips()
    g = c.gate()
    h1 = c.w.submit(single(c.k["gate"], g.args()))
    h2 = c.w.submit(single(c.k["noop"], None, CallConfig(enable_profile=True)))
    quiet = c.quiet_rounds(20, 0.1)
    c.release_when(g, lambda: g.started() and quiet())
    wait_all(h1, h2)
    assert c.successors() == []
    assert c.staged_before(c.one("completed", h1.run_id)) == []
    end1 = c.pos("completed", h1.run_id)
    assert c.pos("dispatched", h2.run_id) > end1
    d1, d2 = c.one("completed", h1.run_id)["dispatch"], c.one("completed", h2.run_id)["dispatch"]
    assert c.at(0, "finalize", d1) < c.at(0, "prepare", d2) < c.at(0, "launch", d2)


def test_a_diagnostic_predecessor_stages_the_successor_validation_only(
    make_chips: Callable[..., Chips],
) -> None:
    c = make_chips()
    g = c.gate()
    h1 = c.w.submit(single(c.k["gate"], g.args(), CallConfig(enable_dump_args=True)))
    h2 = c.w.submit(single(c.k["noop"]))
    quiet = c.quiet_rounds(10, 0.05)
    c.release_when(g, lambda: bool(c.successors(h2.run_id)) and quiet())
    wait_all(h1, h2)
    (st,) = c.successors(h2.run_id)
    assert st["disposition"] == Disposition.VALIDATED
    d1, d2 = c.one("completed", h1.run_id)["dispatch"], st["dispatch"]
    # Native prepare deferred until the diagnostic predecessor released the device.
    assert c.at(0, "finalize", d1) < c.at(0, "prepare", d2) < c.at(0, "launch", d2)


def test_a_group_in_the_prepared_run_is_not_staged_and_its_singles_do_not_overtake_it(
    make_chips: Callable[..., Chips],
) -> None:
    c = make_chips(num_chips=2)
    g = c.gate()
    h1 = c.w.submit(single(c.k["gate"], g.args(), worker=0))

    def run2(o: Orchestrator, _a: Any, _c: CallConfig) -> None:
        o.submit_next_level_group(c.k["noop"], [TaskArgs(), TaskArgs()], workers=[1, 0])
        o.submit_next_level(c.k["noop"], worker=1)
        o.submit_next_level(c.k["noop"], worker=0)

    h2 = c.w.submit(run2)
    quiet = c.quiet_rounds(20, 0.1)
    snapshot: list[list[tuple[str, int]]] = []

    def held() -> bool:
        if g.started() and quiet():
            snapshot.append(c.trace(1))
            return True
        return False

    c.release_when(g, held)
    wait_all(h1, h2)
    assert c.of("staged") == []  # also not the transient FRAME_STAGED of an active dispatch
    assert snapshot == [[]], "run 2 launched on the idle chip 1 while run 1 executed"
    # Nothing of run 2 was dispatched before run 1 ended; the group went first.
    end1 = c.pos("completed", h1.run_id)
    dispatched = [
        (e["index"], i)
        for i, e in enumerate(c.events)
        if e["kind"] == "dispatched" and e["run"] == h2.run_id
    ]
    assert [idx for idx, _ in dispatched] in ([0, 0, 1, 2], [0, 0, 2, 1])  # group: one per member
    assert all(i > end1 for _, i in dispatched)
    # chip 1: group member (dispatch 1), then the single (dispatch 2);
    # chip 0: run 1's kernel (1), the member (2), then the single (3).
    gate_end = c.t(0, "finalize", 1)
    assert min(c.t(1, "launch", 1), c.t(0, "launch", 2)) > gate_end
    assert c.at(1, "launch", 1) < c.at(1, "finalize", 1) < c.at(1, "launch", 2)
    assert (
        c.at(0, "finalize", 1)
        < c.at(0, "launch", 2)
        < c.at(0, "finalize", 2)
        < c.at(0, "launch", 3)
    )


def test_depth_one_keeps_the_single_frame_path_and_serial_runs(
    make_chips: Callable[..., Chips],
) -> None:
    c = make_chips(depth=1)
    ws = c.w.list_workers()
    assert [(e["task_frames"], e["pipeline_depth"]) for e in ws] == [(1, 1)]
    assert c.endpoint(0).caps.supports_frame_staging is False
    assert c.w.scheduler is not None and c.w.scheduler.admission.depth == 1
    g = c.gate()
    h1 = c.w.submit(single(c.k["gate"], g.args()))
    hs = [c.w.submit(single(c.k["noop"])) for _ in range(3)]
    assert not any(h.run.admitted for h in hs)  # admission depth 1: they wait for run 1
    quiet = c.quiet_rounds(10, 0.05)
    c.release_when(g, lambda: g.started() and quiet())
    wait_all(h1, *hs)
    assert c.of("staged") == []
    runs = [h1, *hs]
    dids = [c.one("completed", h.run_id)["dispatch"] for h in runs]
    assert dids == [1, 2, 3, 4]
    for i in range(1, len(runs)):
        prev, nxt = dids[i - 1], dids[i]
        assert c.at(0, "finalize", prev) < c.at(0, "prepare", nxt) < c.at(0, "launch", nxt)
        assert c.pos("dispatched", runs[i].run_id) > c.pos("completed", runs[i - 1].run_id)
    # Every task went through task frame 0 (the only one).
    assert {r.get("bank") for r in c.records(0) if r["event"] == "prepare"} == {0}


# -- failures -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kernel", "text"),
    [
        ("fail_prepare", "injected prepare failure"),
        ("fail_launch", "injected launch failure"),
    ],
)
def test_prepare_and_launch_failures_fail_the_run_unaccepted_with_one_finalize(
    make_chips: Callable[..., Chips],
    kernel: str,
    text: str,
) -> None:
    c = make_chips()
    c.w.run(single(c.k["noop"]))
    frame0 = TASK_FRAMES[0] + OFF_ACCEPTED
    assert _mb.load32(c.endpoint(0).buf, frame0) == 1  # a launched task sets the word
    h = c.w.submit(single(c.k[kernel]))
    with pytest.raises(TaskError) as ei:
        h.wait(20.0)
    err = ei.value
    assert err.outcome == "TASK_FAILURE"
    assert text in str(err) and err.worker_id == 0 and err.dispatch_id == 2
    assert h.run.lease_slot == 0
    assert _mb.load32(c.endpoint(0).buf, frame0) == 0  # cleared at publish, never set
    done = c.one("completed", h.run_id)
    assert done["outcome"] is Outcome.TASK_FAILURE
    assert c.count(0, "finalize", 2) == 1
    assert c.count(0, "launch", 2) == 0
    # The run failed, the worker did not: the next run works.
    x = c.w.alloc(1, "float32")
    c.w.run(single(c.k["add_one"], TaskArgs().add_tensor(x, Tag.INOUT)))
    assert x.tolist() == [1.0]
    assert c.w.list_workers()[0]["poisoned"] is None


def test_a_failing_staged_successor_fails_its_run_and_not_the_active_one(
    make_chips: Callable[..., Chips],
) -> None:
    c = make_chips()
    g = c.gate()
    h1 = c.w.submit(single(c.k["gate"], g.args()))
    h2 = c.w.submit(single(c.k["fail_prepare"]))
    c.release_when(g, lambda: bool(c.of("completed", h2.run_id)))
    with pytest.raises(TaskError) as ei:
        h2.wait(20.0)
    assert ei.value.outcome == "TASK_FAILURE" and "injected prepare failure" in str(ei.value)
    h1.wait(20.0)
    succ = c.one("completed", h2.run_id)["dispatch"]
    assert c.pos("completed", h2.run_id) < c.pos("completed", h1.run_id)
    assert c.count(0, "finalize", succ) == 1 and c.count(0, "launch", succ) == 0


# -- controls during a run -------------------------------------------------------------------------------


def test_register_during_a_long_run_completes_after_it_while_ping_answers_at_once(
    make_chips: Callable[..., Chips],
) -> None:
    c = make_chips()
    g = c.gate()
    ep = c.endpoint(0)
    h = c.w.submit(single(c.k["gate"], g.args()))
    poll_for(g.started, 10.0, message="gate kernel never started")
    # Ordinary control: answered while the kernel runs.
    pong = ep.control_sync(ControlOp.PING, timeout=10.0)
    assert pong.result0 == ep.child.pid
    assert not g.finished()
    # Registry-mutating control: deferred until the native run is finalized.
    spec = spec_for_chip("tests.support.chip_kernels:write_scalar")
    ep.begin_control(ControlOp.REGISTER_CHIP, spec.handle.digest, (spec.import_path or "").encode())
    end = time.monotonic() + 0.1
    while time.monotonic() < end:
        assert ep.poll_control() is None
        time.sleep(0.002)
    assert _mb.load32(ep.buf, BASE_FRAME) == MailboxState.CONTROL_REQUEST
    assert not g.finished()
    g.release()
    poll_for(ep.poll_control, 10.0, message="REGISTER_CHIP never completed")
    registered_at = time.monotonic()
    assert c.t(0, "finalize", 1) < registered_at
    h.wait(20.0)


def test_register_control_from_a_thread_waits_for_the_run(make_chips: Callable[..., Chips]) -> None:
    c = make_chips()
    g = c.gate()
    ep = c.endpoint(0)
    h = c.w.submit(single(c.k["gate"], g.args()))
    poll_for(g.started, 10.0, message="gate kernel never started")
    spec = spec_for_chip("tests.support.chip_kernels:write_scalar")
    done: list[float] = []
    errors: list[BaseException] = []

    def register() -> None:
        try:
            payload = (spec.import_path or "").encode()
            ep.control_sync(ControlOp.REGISTER_CHIP, spec.handle.digest, payload, timeout=20.0)
            done.append(time.monotonic())
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=register)
    t.start()
    try:
        poll_for(lambda: _mb.load32(ep.buf, BASE_FRAME) == MailboxState.CONTROL_REQUEST, 5.0)
        t.join(0.1)
        assert t.is_alive() and not done
    finally:
        g.release()
        t.join(20.0)
    assert not errors and done
    assert c.t(0, "finalize", 1) < done[0]
    h.wait(20.0)


# -- shutdown and death ------------------------------------------------------------------------------


def test_close_with_an_active_and_a_staged_task_finalizes_both_and_never_launches_the_staged_one(
    make_chips: Callable[..., Chips],
) -> None:
    c = make_chips()
    g = c.gate()
    h1 = c.w.submit(single(c.k["gate"], g.args()))
    h2 = c.w.submit(single(c.k["noop"]))
    poll_for(g.started, 10.0, message="gate kernel never started")
    c.w._drive_until(lambda: bool(c.successors(h2.run_id)), 10.0)
    succ = c.successors(h2.run_id)[0]["dispatch"]
    poll_for(lambda: c.count(0, "prepare", succ) == 1, 10.0)

    # The held kernel is let go once the child has failed both frames (the parent
    # sees that completion inside close), so its device thread can exit.
    sched = c.w.scheduler
    assert sched is not None and sched.on_task_event is not None
    inner = sched.on_task_event

    def release_on_completion(slot: TaskSlot, kind: str, comp: WorkerCompletion | None) -> None:
        inner(slot, kind, comp)
        if kind == "completed" and slot.run_id == h1.run_id:
            g.release()

    sched.on_task_event = release_on_completion
    c.w.close(timeout=2.0)
    assert h1.done() and h2.done()
    for h in (h1, h2):
        with pytest.raises(TaskError):
            h.result()
    for e in (c.one("completed", h1.run_id), c.one("completed", h2.run_id)):
        assert e["outcome"] is Outcome.ENDPOINT_FAILURE and "shut down" in e["message"], e
    assert c.count(0, "launch", succ) == 0
    assert c.count(0, "finalize", 1) == 1 and c.count(0, "finalize", succ) == 1
    fin = {r["dispatch_id"]: r["launched"] for r in c.records(0) if r["event"] == "finalize"}
    assert fin == {1: True, succ: False}


@pytest.mark.chaos
def test_a_chip_child_killed_mid_run_fails_both_owned_frames_after_it_exited(
    make_chips: Callable[..., Chips],
) -> None:
    c = make_chips()
    g = c.gate()
    ep = c.endpoint(0)
    h1 = c.w.submit(single(c.k["gate"], g.args()))
    h2 = c.w.submit(single(c.k["noop"]))
    poll_for(g.started, 10.0, message="gate kernel never started")
    c.w._drive_until(lambda: bool(c.successors(h2.run_id)), 10.0)
    assert ep.owned() == 2
    os.kill(ep.child.pid, signal.SIGKILL)
    for h in (h1, h2):
        with pytest.raises(TaskError) as ei:
            h.wait(20.0)
        assert ei.value.outcome == "ENDPOINT_FAILURE"
    comps = c.of("completed")
    assert sorted(e["dispatch"] for e in comps) == [1, 2]
    for e in comps:
        assert e["outcome"] is Outcome.ENDPOINT_FAILURE
        assert e["child_exited"], "an ENDPOINT_FAILURE was reported before the child was reaped"
        assert "SIGKILL" in e["message"]
    assert ep.poisoned and c.w.list_workers()[0]["alive"] is False
    assert c.count(0, "finalize", 1) == 0 and c.count(0, "launch", 2) == 0
