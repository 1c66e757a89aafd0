"""Level 4 with nested LOCAL L3 children: ``w4.add_worker(Worker(level=3, ...))``.

::

    this process: Worker(level=4)  --mailbox-->  L3 child (inner Worker)  --mailbox-->  SUB / chip
                  heap (mapped before any fork) ------ zero copy, same address ------->  grandchildren

Every test ends with no child, grandchild or inner fork server left: the subtree's pids
are collected while it runs (``list_workers`` rows, ``/proc`` children of each L3 child,
or pids the grandchildren record themselves) and must be gone afterwards.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpler_daemon import CallConfig, Tag, TaskArgs
from simpler_daemon.callables import CallableHandle, spec_for_object
from simpler_daemon.engine.worker import Worker, WorkerState
from simpler_daemon.errors import (
    RegistrationError,
    StartupError,
    TaskError,
    WorkerStateError,
)
from simpler_daemon.remote.spec import RemoteCallable, RemoteWorkerSpec
from simpler_daemon.testing import child_pids, poll_for
from tests.support.l3_jobs import orch_double
from tests.support.nested_rig import (
    HEAP,
    assert_gone,
    closing,
    forward,
    l3_worker,
    l4_call,
    l4_worker,
    subtree,
)
from tests.support.sub_tasks import sub_add, sub_fail, sub_fill, sub_gate, sub_scale

pytestmark = pytest.mark.timeout(90)

REPO = Path(__file__).resolve().parents[2]


FILL = spec_for_object(sub_fill).handle


# -- one L4 buffer filled through its L3 children, and the tree shapes -----------------------------


@pytest.mark.parametrize("n", [0, 1, 3])
def test_l4_with_n_local_l3_children(n: int) -> None:
    """Each L3 child fills its slice of one L4 buffer through its own SUB grandchild."""
    w4 = l4_worker()
    ids = []
    for _ in range(n):
        l3 = l3_worker()
        assert l3.register(sub_fill) == FILL
        ids.append(w4.add_worker(l3))
    orch = w4.register(forward(FILL))
    assert ids == list(range(n))
    if n == 0:
        # No SUB worker and no L3 child: the callable could never run, so init refuses.
        with pytest.raises(StartupError, match="no SUB workers"):
            w4.init()
        assert not child_pids()  # refused before any fork
        w4.close()
        return
    w4.init()
    with closing(w4) as seen:
        seen |= subtree(w4)
        rows = [r for r in w4.list_workers() if r["kind"] == "l3"]
        assert [r["worker_id"] for r in rows] == ids
        assert all(r["state"] == "ready" and len(r["children"]) == 1 for r in rows)
        out = w4.alloc((max(n, 1) * 4,), "float32")
        recs = w4.alloc((max(n, 1), 3), "int64")

        def orch_all(o: Any, a: Any, c: Any) -> None:
            for i in ids:
                t = TaskArgs().add_tensor(out[i * 4 : (i + 1) * 4], Tag.OUTPUT)
                t.add_tensor(recs[i], Tag.OUTPUT).add_scalar(10 + i)
                o.submit_next_level(orch, t, CallConfig(), worker=i)

        w4.run(orch_all)
        for i, row in enumerate(rows):
            assert np.all(out[i * 4 : (i + 1) * 4] == 10 + i)
            # Written by that L3 child's own SUB grandchild.
            assert recs[i][0] == row["children"][0]["pid"] and recs[i][1] == row["pid"]
    assert w4.state is WorkerState.CLOSED


def test_zero_copy_down_to_the_grandchild() -> None:
    """The grandchild sees the L4 buffer at the L4's own address and writes it in place."""
    l3 = l3_worker(num_sub_workers=2, num_chips=1)
    fill = l3.register(sub_fill)
    w4 = l4_worker()
    i = w4.add_worker(l3)
    orch = w4.register(forward(fill))
    w4.init()
    with closing(w4) as seen:
        seen |= subtree(w4)
        t = w4.alloc((4,), "float32")
        rec = w4.alloc((3,), "int64")
        w4.run(l4_call(orch, i, [t, rec], [5]))
        assert np.all(t == 5)
        assert rec[2] == t.__array_interface__["data"][0]  # same bytes, same address
        assert rec[1] == next(r["pid"] for r in w4.list_workers() if r["kind"] == "l3")
        # And again with a view into the middle of a buffer (a byte offset travels down).
        big = w4.alloc((16,), "float32")
        w4.run(l4_call(orch, i, [big[4:8], rec], [9]))
        assert big.tolist() == [0.0] * 4 + [9.0] * 4 + [0.0] * 8
        assert rec[2] == big[4:8].__array_interface__["data"][0]


ADD_ONE = "tests.support.chip_kernels:add_one"


def test_a_chip_grandchild_reads_and_writes_the_l4_buffer() -> None:
    """The same zero-copy path into a simulated chip: chip kernels registered before init
    on the inner Worker, and after init through ``register(..., kind="chip", workers=)``."""
    l3 = l3_worker(num_sub_workers=0, num_chips=1)
    kernel = l3.register(ADD_ONE, kind="chip")

    def on_chip(o: Any, a: Any, c: Any) -> None:
        o.submit_next_level(kernel, TaskArgs().add_tensor(a.tensors[0], Tag.INOUT), c, worker=0)
        o.submit_next_level(kernel, TaskArgs().add_tensor(a.tensors[0], Tag.INOUT), c, worker=0)

    w4 = l4_worker()
    i = w4.add_worker(l3)
    orch = w4.register(on_chip)
    w4.init()
    with closing(w4) as seen:
        seen |= subtree(w4)
        t = w4.alloc((3,), "float32")
        w4.run(l4_call(orch, i, [t]))
        assert t.tolist() == [2.0, 2.0, 2.0]
        again = w4.register("tests.support.chip_kernels:write_scalar", kind="chip", workers=[i])
        w4.unregister(again)


def test_scalars_and_tensors_reexported_with_dependencies() -> None:
    """L4 -> L3 -> SUB: every scalar (full u64 range) and tensor arrives; inside the L3 the
    parent-heap buffers order two SUB tasks (write, then read) on two SUB workers."""
    l3 = l3_worker(num_sub_workers=2)
    scale = l3.register(sub_scale)
    add = l3.register(sub_add)

    def l3_orch(o: Any, a: Any, c: Any) -> None:
        first = TaskArgs().add_tensor(a.tensors[0], Tag.INPUT)
        first.add_tensor(a.tensors[1], Tag.OUTPUT).add_tensor(a.tensors[2], Tag.OUTPUT)
        for s in a.scalars:
            first.add_scalar(s)
        o.submit_sub(scale, first)
        second = TaskArgs().add_tensor(a.tensors[1], Tag.INPUT).add_tensor(a.tensors[3], Tag.OUTPUT)
        o.submit_sub(add, second)

    w4 = l4_worker()
    i = w4.add_worker(l3)
    orch = w4.register(l3_orch)
    w4.init()
    with closing(w4) as seen:
        seen |= subtree(w4)
        x = w4.alloc((8,), "float64")
        x[:] = np.arange(8)
        y = w4.alloc((8,), "float64")
        got = w4.alloc((4,), "uint64")
        z = w4.alloc((8,), "float64")
        scalars = [3, (1 << 64) - 1, 7]

        def run(o: Any, a: Any, c: Any) -> None:
            t = TaskArgs().add_tensor(x, Tag.INPUT).add_tensor(y, Tag.OUTPUT)
            t.add_tensor(got, Tag.OUTPUT).add_tensor(z, Tag.OUTPUT)
            for s in scalars:
                t.add_scalar(s)
            o.submit_next_level(orch, t, CallConfig(), worker=i)

        w4.run(run)
        assert got[:3].tolist() == scalars
        assert y.tolist() == (np.arange(8) * 3 + 7).tolist()
        assert z.tolist() == (np.arange(8) * 3 + 8).tolist()


def test_bottom_sub_failure_surfaces_at_l4_and_the_next_run_works() -> None:
    l3 = l3_worker()
    fail = l3.register(sub_fail)
    fill = l3.register(sub_fill)
    w4 = l4_worker()
    i = w4.add_worker(l3)
    bad = w4.register(forward(fail))
    good = w4.register(forward(fill))
    w4.init()
    with closing(w4) as seen:
        seen |= subtree(w4)
        with pytest.raises(TaskError) as info:
            w4.run(l4_call(bad, i, [], [42]))
        text = str(info.value)
        assert info.value.worker_id == i and info.value.outcome == "TASK_FAILURE"
        # Both levels' context and the bottom traceback.
        assert f"child_worker {i}: run " in text
        assert "sub_worker: ValueError: bottom boom 42" in text
        assert "Traceback (most recent call last)" in text and "in sub_fail" in text
        t = w4.alloc((4,), "float32")
        w4.run(l4_call(good, i, [t], [3]))
        assert np.all(t == 3)


def test_l3_orchestration_error_and_unknown_handle() -> None:
    """An orchestration that raises inside the L3 child fails the L4 run with its traceback."""

    def broken(o: Any, a: Any, c: Any) -> None:
        raise RuntimeError("orchestration broke")

    w4 = l4_worker()
    i = w4.add_worker(l3_worker())
    orch = w4.register(broken)
    w4.init()
    with closing(w4) as seen:
        seen |= subtree(w4)
        with pytest.raises(TaskError, match=r"child_worker 0: RuntimeError: orchestration broke"):
            w4.run(l4_call(orch, i, []))
        # A SUB handle the inner Worker never registered fails inside the L3 orchestration.
        ghost = w4.register(forward(CallableHandle.for_import("tests.support.sub_tasks:sub_add")))
        with pytest.raises(TaskError, match=r"child_worker 0: ValueError: .* is not registered"):
            w4.run(l4_call(ghost, i, []))


# -- startup: one deadline, rollback of the whole tree ------------------------------------------------------


def _record(path: Path) -> Callable[[], None]:
    def hook() -> None:
        path.write_text(f"{os.getpid()} {os.getppid()}")

    return hook


def _recorded(tmp: Path) -> set[int]:
    pids: set[int] = set()
    for f in tmp.glob("pid-*"):
        with contextlib.suppress(ValueError):
            pids |= {int(p) for p in f.read_text().split()}
    return pids


def test_inner_init_failure_rolls_back_the_whole_tree(tmp_path: Path) -> None:
    l3a = l3_worker(num_sub_workers=2)
    l3b = l3_worker(num_sub_workers=2)

    def boom() -> None:
        (tmp_path / "pid-b0").write_text(f"{os.getpid()} {os.getppid()}")
        # The other grandchildren start concurrently; fail only once they recorded their pids, so
        # the rollback below is checked on every one of them (not only on those that were quick).
        others = [tmp_path / f"pid-{name}" for name in ("a0", "a1", "b1")]
        deadline = time.monotonic() + 10.0  # well inside the tree's 20 s startup deadline
        while time.monotonic() < deadline and not all(f.exists() and f.read_text() for f in others):
            time.sleep(0.005)
        raise RuntimeError("inner boom")

    l3a._init_hooks[0] = _record(tmp_path / "pid-a0")
    l3a._init_hooks[1] = _record(tmp_path / "pid-a1")
    l3b._init_hooks[0] = boom
    l3b._init_hooks[1] = _record(tmp_path / "pid-b1")
    w4 = l4_worker(num_sub_workers=1)
    w4.add_worker(l3a)
    j = w4.add_worker(l3b)
    with pytest.raises(StartupError) as info:
        w4.init()
    text = str(info.value)
    assert f"child worker {j}" in text and f"child_worker {j}: " in text
    assert "sub worker 0" in text and "RuntimeError: inner boom" in text
    assert w4.state is WorkerState.FAILED
    pids = _recorded(tmp_path)
    assert len(pids) == 6, pids  # four grandchildren and their two L3 parents
    assert_gone(pids)
    assert not child_pids()


@pytest.mark.slow
def test_inner_hang_is_bounded_by_the_root_deadline(tmp_path: Path) -> None:
    def hang() -> None:
        (tmp_path / "pid-hang").write_text(f"{os.getpid()} {os.getppid()}")
        time.sleep(60)

    l3 = l3_worker()
    l3._init_hooks[0] = hang
    w4 = l4_worker(startup_timeout=4.0)
    w4.add_worker(l3)
    start = time.monotonic()
    with pytest.raises(StartupError) as info:
        w4.init()
    elapsed = time.monotonic() - start
    assert elapsed < 4.0 + 3.0, elapsed  # one deadline for the tree, plus the reaping
    text = str(info.value)
    assert "child worker 0" in text and "not ready within" in text
    assert_gone(_recorded(tmp_path))
    assert not child_pids()


@pytest.mark.slow
def test_grandchild_ignoring_sigterm_is_killed_in_the_rollback(tmp_path: Path) -> None:
    def stubborn() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (tmp_path / "pid-stubborn").write_text(f"{os.getpid()} {os.getppid()}")
        time.sleep(60)

    l3 = l3_worker(num_sub_workers=2)
    l3._init_hooks[1] = stubborn
    w4 = l4_worker(startup_timeout=3.0)
    w4.add_worker(l3)
    with pytest.raises(StartupError, match=r"child.worker 0"):
        w4.init()
    pids = _recorded(tmp_path)
    assert len(pids) == 2
    assert_gone(pids)
    assert not child_pids()


# -- registration after init ---------------------------------------------------------------------------------


def test_register_and_unregister_after_init_cascade() -> None:
    l3 = l3_worker(num_sub_workers=2)
    w4 = l4_worker()
    i = w4.add_worker(l3)
    w4.init()
    with closing(w4) as seen:
        seen |= subtree(w4)
        t = w4.alloc((4,), "float32")
        t[:] = 1
        # L4 -> L3 -> SUB: the SUB callable into the inner Worker, the orchestration into L3.
        sub = w4.register("tests.support.sub_tasks:sub_double", kind="sub", workers=[i])
        orch = w4.register(orch_double)
        w4.run(l4_call(orch, i, [t]))
        assert np.all(t == 2)
        # A plain L4 registration cascades too: its handle works inside the L3's SUB children.
        fill = w4.register(sub_fill)
        via = w4.register(forward(fill))
        w4.run(l4_call(via, i, [t], [6]))
        assert np.all(t == 6)
        # Unregister cascades: the inner SUB callable is gone, the run fails inside the L3.
        w4.unregister(sub)
        with pytest.raises(TaskError, match=r"child_worker 0: .*not registered"):
            w4.run(l4_call(orch, i, [t]))
        w4.unregister(orch)
        with pytest.raises(ValueError, match="is not registered"):
            w4.run(l4_call(orch, i, [t]))
        # ... and comes back.
        w4.register("tests.support.sub_tasks:sub_double", kind="sub", workers=[i])
        orch = w4.register(orch_double)
        w4.run(l4_call(orch, i, [t]))
        assert np.all(t == 12)
        w4.unregister(via)
        w4.unregister(fill)


def test_grandchild_register_failure_names_its_path() -> None:
    w4 = l4_worker()
    w4.add_worker(l3_worker())
    j = w4.add_worker(l3_worker(num_sub_workers=2))
    w4.init()
    with closing(w4) as seen:
        seen |= subtree(w4)
        with pytest.raises(RegistrationError) as info:
            w4.register("tests.no_such_module_here:fn", kind="sub", workers=[0, j])
        err = info.value
        assert err.code == "REGISTER_FAILED"  # on both L3 workers: "failed on every worker"
        text = str(err)
        for w in (0, j):
            assert f"worker {w}: child_worker {w}: sub_worker 0: ModuleNotFoundError" in text
        assert f"child_worker {j}: sub_worker 1: ModuleNotFoundError" in text
        # Nothing is stuck: the same callable is not half-registered, a good one works.
        w4.register("tests.support.sub_tasks:sub_double", kind="sub", workers=[j])
        orch = w4.register(orch_double)
        t = w4.alloc((2,), "float32")
        t[:] = 4
        w4.run(l4_call(orch, j, [t]))
        assert np.all(t == 8)


def test_register_before_init_into_the_inner_worker_and_rules() -> None:
    l3 = l3_worker()
    w4 = l4_worker()
    i = w4.add_worker(l3)
    # Frozen once added: everything goes through the L4.
    with pytest.raises(WorkerStateError, match="L3 worker 0 of a level-4 Worker"):
        l3.register(sub_fill)
    with pytest.raises(WorkerStateError):
        l3.alloc(4)
    with pytest.raises(WorkerStateError, match="L3 worker 0 of a level-4 Worker"):
        l3.init()
    l3.close()  # a no-op: the L4 closes it
    with pytest.raises(WorkerStateError, match="not attached elsewhere"):
        l4_worker().add_worker(l3)
    with pytest.raises(ValueError, match="its own child"):
        w4.add_worker(w4)
    with pytest.raises(ValueError, match="its level is 4"):
        w4.add_worker(l4_worker())
    with pytest.raises(TypeError, match="expected a Worker"):
        w4.add_worker("l3")  # type: ignore[arg-type]
    with pytest.raises(WorkerStateError, match="only a level-4 Worker"):
        l3_worker().add_worker(l3_worker())
    with pytest.raises(ValueError, match="worker 7 is not an L3 worker"):
        w4.register("tests.support.sub_tasks:sub_double", kind="sub", workers=[7])
    with pytest.raises(ValueError, match="register the function itself"):
        w4.register(RemoteCallable("tests.support.l3_jobs:orch_double"), workers=[i])
    sub = w4.register("tests.support.sub_tasks:sub_double", kind="sub", workers=[i])
    dropped = w4.register("tests.support.sub_tasks:sub_add", kind="sub", workers=[i])
    w4.unregister(dropped)
    orch = w4.register(orch_double)
    w4.init()
    with closing(w4) as seen:
        seen |= subtree(w4)
        with pytest.raises(WorkerStateError, match="only before init"):
            w4.add_worker(l3_worker())
        t = w4.alloc((3,), "int32")
        t[:] = 5
        w4.run(l4_call(orch, i, [t]))
        assert np.all(t == 10)
        w4.unregister(sub)


# -- failure of an L3 child mid-task -----------------------------------------------------------------------------


def test_sigkill_of_an_l3_child_mid_task_fails_that_run_only() -> None:
    l3 = l3_worker(num_sub_workers=2)
    gate = l3.register(sub_gate)
    fill = l3.register(sub_fill)
    w4 = l4_worker()
    i = w4.add_worker(l3)
    orch_gate = w4.register(forward(gate))
    orch_fill = w4.register(forward(fill))
    w4.init()
    with closing(w4) as seen:
        before = subtree(w4)
        seen |= before
        row = next(r for r in w4.list_workers() if r["kind"] == "l3")
        flag = w4.alloc((2,), "int64")
        handle = w4.submit(l4_call(orch_gate, i, [flag]))
        w4._drive_until(lambda: flag[0] == 1, 20.0)
        assert flag[0] == 1
        os.kill(row["pid"], signal.SIGKILL)
        with pytest.raises(TaskError) as info:
            handle.wait(20.0)
        assert info.value.outcome == "ENDPOINT_FAILURE"
        assert info.value.worker_id == i
        # The old subtree is gone (grandchildren die with their parent) ...
        assert_gone(before)

        # ... and the fork server brought back the child with a whole new subtree.
        def replaced() -> dict[str, Any] | None:
            w4._drive_until(lambda: False, 0.01)
            rows = [r for r in w4.list_workers() if r["kind"] == "l3"]
            return rows[0] if rows[0]["restarts"] == 1 and rows[0]["state"] == "ready" else None

        new = poll_for(replaced, timeout=20.0)
        assert new is not None
        assert new["pid"] != row["pid"] and len(new["children"]) == 2
        assert not {r["pid"] for r in new["children"]} & before
        seen |= subtree(w4)
        t = w4.alloc((4,), "float32")
        w4.run(l4_call(orch_fill, i, [t], [8]))
        assert np.all(t == 8)
        assert w4.restarts["l3"] == 1


def test_a_grandchild_that_dies_while_its_l3_is_idle_is_replaced_without_a_task() -> None:
    w4 = l4_worker()
    w4.add_worker(l3_worker(num_sub_workers=1))
    w4.init()
    with closing(w4) as seen:

        def grandchild() -> int:
            (l3,) = [r for r in w4.list_workers() if r["kind"] == "l3"]
            (sub,) = [c for c in l3["children"] if c["kind"] == "sub"]
            return int(sub["pid"])

        old = grandchild()
        seen |= subtree(w4)
        os.kill(old, signal.SIGKILL)
        # No run is submitted: the idle L3 child notices and replaces it on its own.
        poll_for(lambda: grandchild() != old, timeout=10.0, message="grandchild not replaced")
        seen |= subtree(w4)


# -- no leaks over many runs --------------------------------------------------------------------------------------


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def test_hundred_runs_leak_no_process_fd_or_memory() -> None:
    l3 = l3_worker(num_sub_workers=2)
    fill = l3.register(sub_fill)
    w4 = l4_worker()
    i = w4.add_worker(l3)
    orch = w4.register(forward(fill))
    w4.init()
    with closing(w4) as seen:
        tree = subtree(w4)
        seen |= tree
        l3_pid = next(r["pid"] for r in w4.list_workers() if r["kind"] == "l3")
        t = w4.alloc((64,), "float32")
        for k in range(10):  # warm up: imports, caches, the first status pages
            w4.run(l4_call(orch, i, [t], [k]))
        gc.collect()
        fds, l3_fds, free = _fds(os.getpid()), _fds(l3_pid), w4.heap.free_bytes()
        rss, l3_rss = _rss_kib(os.getpid()), _rss_kib(l3_pid)
        for k in range(100):
            tmp = w4.alloc((16,), "float32")
            w4.run(l4_call(orch, i, [t, tmp], [k]))
            w4.free(tmp)
            assert t[0] == k
        gc.collect()
        assert subtree(w4) == tree  # no process came or went
        assert _fds(os.getpid()) == fds and _fds(l3_pid) == l3_fds
        assert w4.heap.free_bytes() == free
        assert _rss_kib(os.getpid()) - rss < 8 << 10
        assert _rss_kib(l3_pid) - l3_rss < 8 << 10


# -- async --------------------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_run_async_through_a_local_l3_child() -> None:
    l3 = l3_worker()
    fill = l3.register(sub_fill)
    w4 = l4_worker()
    i = w4.add_worker(l3)
    orch = w4.register(forward(fill))
    w4.init()
    pids = subtree(w4)
    try:
        await w4.start_async()
        t = w4.alloc((4,), "float32")
        for k in range(5):
            await w4.run_async(l4_call(orch, i, [t], [k]))
            assert np.all(t == k)
        h = await w4.register_async(forward(fill))
        await w4.run_async(l4_call(h, i, [t], [11]))
        assert np.all(t == 11)
    finally:
        await w4.close_async()
    assert_gone(pids)


# -- a local and a remote L3 in one run -------------------------------------------------------------------------------


@contextlib.contextmanager
def remote_worker() -> Iterator[str]:
    exe = REPO / ".venv" / "bin" / "simpler-remote-worker"
    proc = subprocess.Popen(
        [
            str(exe),
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--set",
            'callables.allowed_modules=["simpler_daemon.examples.", "tests."]',
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(REPO),
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 20.0
        addr = None
        while time.monotonic() < deadline and addr is None:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            m = re.search(r"listening on (\S+)", line)
            addr = m.group(1) if m else None
        assert addr, "simpler-remote-worker printed no 'listening on' line"
        yield addr
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()


FILL_EX = CallableHandle.for_import("simpler_daemon.examples.tasks:fill")


def local_fill_all(o: Any, a: Any, c: Any) -> None:
    """The local twin of ``simpler_daemon.examples.remote:fill_all``."""
    o.submit_sub(FILL_EX, TaskArgs().add_tensor(a.tensors[0], Tag.OUTPUT).add_scalar(a.scalars[0]))


def test_mixed_local_and_remote_l3_in_one_run() -> None:
    with remote_worker() as addr:
        w4 = l4_worker(startup_timeout=30.0)
        i = w4.add_worker(l3_worker())
        r = w4.add_remote_worker(RemoteWorkerSpec(endpoint=addr, num_sub_workers=1))
        assert (i, r) == (0, 1)  # one id space, in the order added
        w4.register("simpler_daemon.examples.tasks:fill", kind="sub", workers=[i, r])
        remote_orch = w4.register(
            RemoteCallable("simpler_daemon.examples.remote:fill_all"), workers=[r]
        )
        local_orch = w4.register(local_fill_all)
        w4.init()
        with closing(w4) as seen:
            seen |= subtree(w4)
            kinds = sorted(row["kind"] for row in w4.list_workers())
            assert kinds == ["l3", "remote"]
            x = w4.alloc_remote(worker=r, shape=(8,), dtype="float32")
            y = w4.alloc((8,), "float32")

            def both(o: Any, a: Any, c: Any) -> None:
                o.submit_next_level(
                    remote_orch, TaskArgs().add_tensor(x, Tag.INOUT).add_scalar(3), worker=r
                )
                o.submit_next_level(
                    local_orch, TaskArgs().add_tensor(y, Tag.INOUT).add_scalar(4), worker=i
                )

            w4.run(both)
            assert np.all(w4.copy_from_remote(x) == 3)
            assert np.all(y == 4)
            w4.free(x)


def nothing(o: Any, a: Any, c: Any) -> None:
    """An L3 orchestration that submits nothing."""


def test_an_empty_l3_child_runs_an_orchestration() -> None:
    """0 SUB workers and 0 chips is a valid L3 child (and 0 SUB workers a valid L4)."""
    w4 = l4_worker()
    i = w4.add_worker(Worker(level=3, num_sub_workers=0, heap_bytes=HEAP))
    orch = w4.register(nothing)
    w4.init()
    with closing(w4) as seen:
        seen |= subtree(w4)
        row = next(r for r in w4.list_workers() if r["kind"] == "l3")
        assert row["children"] == []
        for _ in range(3):
            w4.run(l4_call(orch, i, []))


def test_a_failing_remote_session_rolls_back_the_local_tree(tmp_path: Path) -> None:
    """Remote sessions open after the last local fork; when one fails, the local L3
    subtree (already ready) is stopped and reaped too."""
    l3 = l3_worker(num_sub_workers=2)
    l3._init_hooks[0] = _record(tmp_path / "pid-0")
    l3._init_hooks[1] = _record(tmp_path / "pid-1")
    w4 = l4_worker(startup_timeout=5.0)
    w4.add_worker(l3)
    w4.add_remote_worker(RemoteWorkerSpec(endpoint="127.0.0.1:1", num_sub_workers=1))
    with pytest.raises(StartupError, match="remote"):
        w4.init()
    pids = _recorded(tmp_path)
    assert len(pids) == 3  # two grandchildren and their L3 parent
    assert_gone(pids)
    assert not child_pids()


def test_the_l3_task_deadline_cancels_the_inner_run() -> None:
    """CallConfig.deadline_ms of the L4 task bounds the L3 run: past it the inner run is
    cancelled (its running SUB task finishes) and the L4 task fails with the deadline; when
    the inner run cannot end within the grace, the L4 kills and replaces the L3 child."""
    l3 = l3_worker()
    gate = l3.register(sub_gate)
    w4 = l4_worker()
    i = w4.add_worker(l3)
    orch = w4.register(forward(gate))
    w4.init()
    with closing(w4) as seen:
        seen |= subtree(w4)
        flag = w4.alloc((2,), "int64")

        def run(o: Any, a: Any, c: Any) -> None:
            t = TaskArgs().add_tensor(flag, Tag.INOUT)
            o.submit_next_level(orch, t, CallConfig(deadline_ms=200), worker=i)

        handle = w4.submit(run)
        w4._drive_until(lambda: flag[0] == 1, 20.0)
        w4._drive_until(lambda: False, 0.5)  # the deadline passes while the SUB task waits
        flag[1] = 1
        with pytest.raises(TaskError, match=r"deadline exceeded \(200 ms\)"):
            handle.wait(20.0)
        flag[:] = 0
        flag[1] = 1
        w4.run(l4_call(orch, i, [flag]))  # the child is fine afterwards


def test_a_dead_grandchild_is_replaced_inside_the_l3_child() -> None:
    """A SUB grandchild that dies is the L3 child's business: its own fork server replaces
    it, and the L4 sees no failure at all."""
    l3 = l3_worker(num_sub_workers=1)
    fill = l3.register(sub_fill)
    w4 = l4_worker()
    i = w4.add_worker(l3)
    orch = w4.register(forward(fill))
    w4.init()
    with closing(w4) as seen:
        seen |= subtree(w4)
        row = next(r for r in w4.list_workers() if r["kind"] == "l3")
        (grandchild,) = [r["pid"] for r in row["children"]]
        os.kill(grandchild, signal.SIGKILL)
        assert_gone({grandchild})
        t = w4.alloc((4,), "float32")
        rec = w4.alloc((3,), "int64")
        w4.run(l4_call(orch, i, [t, rec], [2]))
        assert np.all(t == 2) and rec[0] != grandchild
        # Forked by the L3 child's own fork server, as a child of the L3 child (CLONE_PARENT).
        assert rec[1] == row["pid"] and rec[0] in child_pids(row["pid"])
        seen |= subtree(w4)
