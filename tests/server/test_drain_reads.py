"""A drain keeps what clients are owed: the outputs of the runs it let finish.

A run is held on a flag (``wait_for_flag``: the task waits until the client writes
``flag[0]``, then sets ``flag[1]``, an INOUT buffer: the run's output). The daemon is
told to stop (SIGTERM, or Drain(shutdown=true)) while the run executes; the client
releases it, waits for it, sees the daemon say that it waits for the run's outputs to
be read, reads them, and only then does the daemon exit, 0, within
daemon.shutdown_grace. A client that never reads gets the grace and no more.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpler_daemon.client import Client, sub_task, tensor
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server.owed import OwedOutputs, output_buffers
from tests.support.daemon_harness import EXAMPLES, DaemonProcess, wait_until

pytestmark = pytest.mark.timeout(120)

WAITING = "stopping: waiting up to"
ALL_READ = "stopping: every output owed to a client was read"

# --------------------------------------------------------------------------- the rule


class _Rec:
    def __init__(self, run_id: int) -> None:
        self.run_id = run_id
        self.terminal = False
        self.finish_ns = 0

    def finish(self) -> None:
        self.terminal = True
        self.finish_ns = time.time_ns()


class _Buf:
    def __init__(self, generation: int) -> None:
        self.generation = generation


class _Heap:
    closed = False

    def __init__(self) -> None:
        self.buffers = {7: _Buf(1), 8: _Buf(1)}

    def get(self, buffer_id: int) -> _Buf:
        return self.buffers[buffer_id]


def test_output_buffers_are_the_written_ones() -> None:
    args = pb.Args(
        tensors=[
            pb.TensorRef(buffer_id=1, tag=pb.TAG_INPUT),
            pb.TensorRef(buffer_id=2, tag=pb.TAG_OUTPUT),
            pb.TensorRef(buffer_id=3, tag=pb.TAG_INOUT),
            pb.TensorRef(buffer_id=4, tag=pb.TAG_OUTPUT_EXISTING),
        ]
    )
    assert output_buffers([args, pb.Args()]) == {2, 3, 4}


def test_a_run_is_owed_until_each_output_is_read_after_it_ended() -> None:
    heap = _Heap()
    owed = OwedOutputs(heap)
    before, during, no_outputs = _Rec(1), _Rec(2), _Rec(3)
    owed.note(before, frozenset({7}))
    before.finish()  # ended before the drain: owes nothing
    owed.note(during, frozenset({7, 8}))
    owed.note(no_outputs, frozenset())
    owed.read(7, 1)  # not tracking yet: not counted
    owed.begin()
    assert owed.owed() == [during, no_outputs]
    owed.read(7, 1)  # read before the run ended: the data was not final
    during.finish()
    no_outputs.finish()
    assert owed.owed() == [during, no_outputs]
    owed.read(7, 1)
    assert owed.owed() == [during, no_outputs]
    del heap.buffers[8]  # freed: nothing to read there
    owed.collected(3)
    assert owed.owed() == []


def test_a_reused_buffer_id_is_not_owed_and_resume_forgets_everything() -> None:
    heap = _Heap()
    owed = OwedOutputs(heap)
    rec = _Rec(5)
    owed.note(rec, frozenset({7}))
    owed.begin()
    rec.finish()
    assert owed.owed() == [rec]
    heap.buffers[7] = _Buf(2)  # freed, and the id went to a new buffer
    assert owed.owed() == []
    heap.buffers[7] = _Buf(1)
    owed.end()
    assert owed.owed() == [] and not owed.tracking


# --------------------------------------------------------------------------- real daemons


def _held_run(c: Client) -> tuple[int, int]:
    """A run whose one task waits for ``flag[0]`` (then sets ``flag[1]``); (run, flag)."""
    wait_h = c.register(f"{EXAMPLES}:wait_for_flag")
    flag = c.alloc_buffer((2,), "uint8").buffer_id
    run_id = c.submit([sub_task(wait_h, [tensor(flag, "inout", (2,), "uint8")], [60_000])])
    with contextlib.closing(c.watch(run_id, timeout=60)) as events:
        for event in events:  # until the task runs (the stream ends only with the run)
            if event.type == pb.RUN_EVENT_TYPE_TASK_DISPATCHED or event.counts.running:
                break
    return run_id, flag


def _release_wait_and_read(d: DaemonProcess, c: Client, run_id: int, flag: int) -> list[int]:
    """Let the run finish, wait for it, wait for the daemon to say it waits for the
    output to be read, read it; the daemon is still up at each step."""
    c.write_buffer(flag, np.array([1], np.uint8))
    status = c.wait(run_id, timeout=30)
    assert status.state == pb.RUN_STATE_COMPLETED, status
    wait_until(lambda: WAITING in d.stderr(), timeout=30, message="the daemon did not wait")
    assert d.proc is not None and d.proc.poll() is None, d.stderr()
    return [int(x) for x in c.read_array(flag, (2,), "uint8")]


def _check_order(d: DaemonProcess, stop_sent: float, read_done: float, grace: float) -> None:
    code = d.wait(60)
    exited = time.monotonic()
    assert code == 0, d.stderr()
    log = d.stderr()
    assert ALL_READ in log, log
    assert log.index(WAITING) < log.index(ALL_READ) < log.index("stopped")
    assert "cannot read a buffer" not in log
    # The exit follows the read, within daemon.shutdown_grace of the stop (60 s: the
    # daemon did not wait the grace out, it stopped once the output was read).
    assert stop_sent < read_done <= exited < stop_sent + grace
    d.children_gone()
    assert "shutdown_grace ended" not in log


@pytest.mark.parametrize("how", ["SIGTERM", "Drain"])
def test_outputs_stay_readable_until_read_then_the_daemon_exits(tmp_path: Path, how: str) -> None:
    grace = 60.0
    d = DaemonProcess(tmp_path / "d", {"daemon": {"shutdown_grace": grace}})
    try:
        d.start()
        with d.client() as c:
            run_id, flag = _held_run(c)
            empty = c.register(f"{EXAMPLES}:empty")
            drained: dict[str, Any] = {}
            drainer = None
            stop_sent = time.monotonic()
            if how == "SIGTERM":
                d.send(signal.SIGTERM)
            else:

                def drain() -> None:
                    with d.client() as admin:
                        drained["reply"] = admin.drain(shutdown=True)

                drainer = threading.Thread(target=drain)
                drainer.start()
            wait_until(
                lambda: c.get_info().serving_state != pb.SERVING_STATE_SERVING,
                timeout=30,
                message="the daemon did not begin to stop",
            )
            assert c.get_info().active_runs == 1
            with pytest.raises(Exception, match=r"draining|shutting down|stopping"):
                c.submit([sub_task(empty)])
            got = _release_wait_and_read(d, c, run_id, flag)
            read_done = time.monotonic()
        assert got == [1, 1]
        if drainer is not None:
            drainer.join(60)
            assert drained["reply"].runs_finished == 1, drained
        _check_order(d, stop_sent, read_done, grace)
    finally:
        d.kill()


def test_a_client_that_never_reads_gets_the_grace_and_no_more(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "d", {"daemon": {"shutdown_grace": 3.0}})
    try:
        d.start()
        with d.client() as c:
            run_id, flag = _held_run(c)
            d.send(signal.SIGTERM)
            wait_until(lambda: "stopping (SIGTERM)" in d.stderr(), timeout=30)
            c.write_buffer(flag, np.array([1], np.uint8))
            assert c.wait(run_id, timeout=30).state == pb.RUN_STATE_COMPLETED
        assert d.wait(60) == 0, d.stderr()
        log = d.stderr()
        assert WAITING in log
        assert "daemon.shutdown_grace ended with the outputs of 1 runs unread" in log, log
        d.children_gone()
    finally:
        d.kill()
