"""The run history across daemon restarts: real ``simpler-daemon`` processes on one
``daemon.state_dir``, stopped with SIGTERM or killed with SIGKILL and started again.

What a client sees after the restart (ListRuns, WaitRun, ``simplerctl runs`` /
``wait``), that a run active at the kill comes back LOST with its last counts, that
run and buffer ids never repeat, how a corrupt, locked or full store is reported, and
that retention prunes the stored runs per owner as it prunes those in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import sqlite3
import stat
import subprocess
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpler_daemon.client import NotFound, PermissionDenied, RunPhase, sub_task
from simpler_daemon.client.errors import FailedPrecondition
from simpler_daemon.errors import TaskError
from simpler_daemon.server.history import DB_NAME, ID_BLOCK, History
from tests.support.ctl import Ctl
from tests.support.daemon_harness import EXAMPLES, DaemonProcess, wait_until
from tests.support.two_clients import TcpAccess

pytestmark = pytest.mark.timeout(180)

TASKS = "tests.support.daemon_tasks"
_ALLOWED = {"callables": {"allowed_modules": ["simpler_daemon.examples", "tests.support"]}}


def daemon_on(
    tmp_path: Path,
    name: str,
    state: Path,
    extra: Mapping[str, Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> DaemonProcess:
    """A daemon (not started) in ``tmp_path/name`` whose run history is ``state``."""
    overrides: dict[str, dict[str, Any]] = {k: dict(v) for k, v in _ALLOWED.items()}
    overrides["daemon"] = {"state_dir": str(state)}
    for section, values in (extra or {}).items():
        overrides.setdefault(section, {}).update(values)
    return DaemonProcess(tmp_path / name, overrides, **kwargs)


@contextlib.contextmanager
def stopped_at_the_end(daemon: DaemonProcess) -> Iterator[DaemonProcess]:
    """``daemon`` (started), stopped with SIGTERM when the block ends (exit 0 asserted
    when the block succeeded)."""
    try:
        yield daemon
    except BaseException:
        with contextlib.suppress(Exception):
            daemon.stop(timeout=15.0)
        daemon.kill()
        raise
    code = daemon.stop()
    assert code == 0, f"daemon exited with {code}:\n{daemon.stderr()}"
    daemon.children_gone()


def stored(state: Path) -> dict[int, dict[str, Any]]:
    """The runs the history file holds now, read beside the daemon (WAL readers do not
    block its writer)."""
    path = state / DB_NAME
    if not path.exists():
        return {}
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    try:
        db.row_factory = sqlite3.Row
        rows = db.execute("SELECT run_id, state, done, failed, running, total FROM runs")
        return {row["run_id"]: dict(row) for row in rows}
    except sqlite3.OperationalError:  # created but not yet holding its tables
        return {}
    finally:
        db.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


# --------------------------------------------------------------------------- restarts


def test_runs_results_and_ids_survive_a_graceful_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    first = daemon_on(tmp_path, "a", state).start()
    with stopped_at_the_end(first), first.client() as c:
        echo = c.register(f"{TASKS}:echo")
        fail = c.register(f"{EXAMPLES}:fail")
        ok = c.run(
            [sub_task(echo, scalars=[7]), sub_task(echo, scalars=[8])],
            label="two echoes",
            priority=5,
        )
        keyed = c.submit([sub_task(echo, scalars=[1])], idempotency_key="once")
        assert c.wait_run(int(keyed), timeout=60).state is RunPhase.COMPLETED
        bad = c.submit([sub_task(fail, scalars=[3])], label="fails")
        bad_status = c.wait_run(int(bad), timeout=60)
        assert bad_status.state is RunPhase.FAILED
        buffer = int(c.alloc_array(np.zeros(4, dtype=np.float32)))

    # Owner only: the history holds every client's labels, errors and results.
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / DB_NAME).stat().st_mode) == 0o600
    with stopped_at_the_end(daemon_on(tmp_path, "b", state).start()) as second:
        with second.client() as c:
            assert stat.S_IMODE((state / f"{DB_NAME}-wal").stat().st_mode) == 0o600
            runs = {r.run_id: r for r in c.list_runs()}
            assert set(runs) == {ok.run_id, int(keyed), int(bad)}
            row = runs[ok.run_id]
            assert row.state is RunPhase.COMPLETED and row.label == "two echoes"
            assert (row.counts.total, row.counts.done, row.counts.failed) == (2, 2, 0)
            assert row.priority == 5 and row.submit_time == ok.submit_time
            assert runs[int(bad)].state is RunPhase.FAILED

            again = c.wait_run(ok.run_id, include_results=True)
            assert again.values() == ok.values()
            assert again.finish_time == ok.finish_time
            failed = c.wait_run(int(bad))
            assert failed.state is RunPhase.FAILED and failed.error is not None
            assert bad_status.error is not None
            assert failed.error.message == bad_status.error.message
            assert "example failure (scalar 3)" in failed.error.remote_text
            with pytest.raises(TaskError):
                c.wait(int(bad))
            events = list(c.watch(ok.run_id, timeout=30))
            # A trace lives in the daemon's memory: the restored run's status only.
            with pytest.raises(FailedPrecondition, match="finished before the daemon restarted"):
                c.trace(ok.run_id)
            assert events[-1].state == RunPhase.COMPLETED and events[-1].counts.done == 2

            # The idempotency key still names its run: a retry starts nothing.
            echo = c.register(f"{TASKS}:echo")
            retry = c.submit([sub_task(echo, scalars=[1])], idempotency_key="once")
            assert retry.deduplicated and int(retry) == int(keyed)

            # A clean stop stored the exact next ids: they go on from there.
            later = c.run([sub_task(echo, scalars=[9])])
            assert later.run_id == int(bad) + 1
            assert int(c.alloc_array(np.zeros(4, dtype=np.float32))) == buffer + 1

        ctl = Ctl(second.socket, capsys)
        code, out, err = ctl("runs")
        assert code == 0, err
        lines = {int(line.split()[0]): line for line in out.splitlines()[1:]}
        assert "COMPLETED" in lines[ok.run_id] and "two echoes" in lines[ok.run_id]
        assert "FAILED" in lines[int(bad)] and "fails" in lines[int(bad)]
        code, out, err = ctl("wait", str(ok.run_id))
        assert code == 0, err
        assert f"run {ok.run_id}: COMPLETED" in out and "'scalars': [7]" in out


def test_a_run_active_when_the_daemon_is_killed_comes_back_lost_with_its_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    # One active run per client: a second one waits QUEUED in the client's queue.
    first = daemon_on(tmp_path, "a", state, {"limits": {"per_client_runs": 1}}).start()
    try:
        with first.client() as c:
            nothing = c.register(f"{TASKS}:nothing")
            sleep = c.register(f"{TASKS}:sleep_ms")
            buffer = int(c.alloc_array(np.zeros(4, dtype=np.float32)))
            done = c.run([sub_task(nothing)], label="before")
            tasks = [sub_task(nothing) for _ in range(3)] + [sub_task(sleep, scalars=[60_000])]
            run = int(c.submit(tasks, label="long"))
            queued = int(c.submit([sub_task(nothing)], label="queued"))
            assert c.wait_run(queued, timeout=0).state is RunPhase.QUEUED

            def recorded() -> bool:
                rows = stored(state)
                row, waiting = rows.get(run), rows.get(queued)
                return (
                    row is not None
                    and (row["done"], row["running"]) == (3, 1)
                    and waiting is not None
                    and waiting["state"] == RunPhase.QUEUED
                )

            wait_until(recorded, timeout=60, message="the history never recorded 3 done, 1 running")
    finally:
        first.kill()  # SIGKILL: nothing is written on the way out
    first.children_gone()

    port = _free_port()
    second = daemon_on(tmp_path, "b", state, {"metrics": {"listen": f"127.0.0.1:{port}"}})
    with stopped_at_the_end(second.start()):
        with second.client() as c:
            lost = c.wait_run(run, timeout=30)  # terminal: answers at once
            assert lost.state is RunPhase.LOST and lost.terminal
            counts = lost.counts
            assert (counts.total, counts.done, counts.failed, counts.running) == (4, 3, 0, 0)
            assert lost.label == "long" and lost.error is not None
            assert f"the daemon stopped (pid {first.pid})" in lost.error.message
            assert lost.error.outcome == "LOST"
            with pytest.raises(TaskError, match=f"pid {first.pid}"):
                c.wait(run)
            assert [r.run_id for r in c.list_runs(states=["lost"])] == [queued, run]
            never = c.wait_run(queued, timeout=30)
            assert never.state is RunPhase.LOST and never.label == "queued"
            assert (never.counts.total, never.counts.done) == (1, 0)
            assert c.wait_run(done.run_id).state is RunPhase.COMPLETED
            assert _metric(port, 'simpler_daemon_runs_in_state{state="lost"}') == 2

            # Ids were reserved ahead: after a kill they jump, never repeat.
            nothing = c.register(f"{TASKS}:nothing")
            assert c.run([sub_task(nothing)]).run_id > queued
            assert int(c.alloc_array(np.zeros(4, dtype=np.float32))) > buffer

        code, out, err = Ctl(second.socket, capsys)("runs", "--state", "lost")
        assert code == 0, err
        assert f"{run} " in out and f"{queued} " in out and out.count("LOST") == 2
        code, out, err = Ctl(second.socket, capsys)("wait", str(run))
        assert code == 1, err  # a run that did not complete
        assert f"run {run}: LOST (done 3/4, failed 0, running 0)" in out
        assert f"pid {first.pid}" in out


# --------------------------------------------------------------------------- start-up errors


def test_a_corrupt_history_stops_start_up_until_reset_state_moves_it_aside(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    garbage = b"this is not an SQLite database\n" * 200
    (state / DB_NAME).write_bytes(garbage)
    broken = daemon_on(tmp_path, "a", state)
    try:
        with pytest.raises(RuntimeError, match="exited with 3 before READY"):
            broken.start()
    finally:
        broken.kill()
    broken.children_gone()
    err = broken.stderr()
    assert f"cannot open the run history {state / DB_NAME}" in err
    assert "--reset-state" in err
    assert (state / DB_NAME).read_bytes() == garbage  # left as it was

    fresh = daemon_on(tmp_path, "b", state, args=["--reset-state"]).start()
    with stopped_at_the_end(fresh):
        aside = list(state.glob(f"{DB_NAME}.corrupt-*"))
        assert len(aside) == 1 and aside[0].read_bytes() == garbage
        assert "moved aside" in fresh.stderr()
        with fresh.client() as c:
            nothing = c.register(f"{TASKS}:nothing")
            run = c.run([sub_task(nothing)])
            assert run.state is RunPhase.COMPLETED
        wait_until(lambda: run.run_id in stored(state), message="the new history records nothing")


def test_a_second_daemon_on_the_same_state_dir_fails_at_once(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with stopped_at_the_end(daemon_on(tmp_path, "a", state).start()) as first:
        second = daemon_on(tmp_path, "b", state)
        try:
            with pytest.raises(RuntimeError, match="exited with 3 before READY"):
                second.start()
        finally:
            second.kill()
        second.children_gone()
        err = second.stderr()
        assert f"another daemon (pid {first.pid}) is using it" in err
        assert str(state) in err and "daemon.state_dir" in err
        with first.client() as c:  # the first one is untouched
            nothing = c.register(f"{TASKS}:nothing")
            assert c.run([sub_task(nothing)]).state is RunPhase.COMPLETED


# --------------------------------------------------------------------------- a full disk


@contextlib.contextmanager
def tiny_filesystem(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` for the block (root only)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a small tmpfs to fill up")
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def _fill(path: Path) -> None:
    """Write ``path`` until its filesystem is full."""
    chunk = b"\xff" * 65536
    with open(path, "wb", buffering=0) as fh:
        while True:
            try:
                fh.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
        with contextlib.suppress(OSError):
            while fh.write(b"\xff" * 512):
                pass


def test_a_full_disk_fails_recording_loudly_never_the_runs(tmp_path: Path) -> None:
    port = _free_port()
    failures = "simpler_daemon_history_write_failures_total"
    with tiny_filesystem(tmp_path / "state", "4m") as state:
        extra = {"metrics": {"listen": f"127.0.0.1:{port}"}}
        d = daemon_on(tmp_path, "a", state, extra).start()
        with stopped_at_the_end(d), d.client() as c:
            blob = c.register(f"{TASKS}:blob")
            first = c.run([sub_task(blob, scalars=[1000])])
            wait_until(lambda: first.run_id in stored(state), message="nothing recorded")
            assert _metric(port, failures) == 0
            filler = state / "filler"
            _fill(filler)
            # Results at most 32 KiB a task: 120 KB a run, more than the history has room.
            tasks = [sub_task(blob, scalars=[30_000]) for _ in range(4)]
            big = {i: bytes(30_000) for i in range(4)}
            runs = [c.run(tasks) for _ in range(3)]
            assert all(r.state is RunPhase.COMPLETED for r in runs)
            assert all(r.values() == big for r in runs)
            wait_until(
                lambda: _metric(port, failures) >= 1,
                timeout=30,
                message="no recording failure counted",
            )
            err = d.stderr()
            assert err.count("cannot record the run history") == 1, err
            assert str(state / DB_NAME) in err and "full" in err
            # Served from memory meanwhile, results too.
            kept = c.wait_run(runs[-1].run_id, include_results=True)
            assert kept.values() == big
            nothing = c.register(f"{TASKS}:nothing")
            assert c.run([sub_task(nothing)]).state is RunPhase.COMPLETED

            filler.unlink()
            wait_until(
                lambda: all(r.run_id in stored(state) for r in runs),
                timeout=60,
                message="the runs were never written once there was room again",
            )
            wait_until(lambda: "recording works again" in d.stderr())
        again = daemon_on(tmp_path, "b", state).start()
        with stopped_at_the_end(again), again.client() as c:
            back = c.wait_run(runs[0].run_id, include_results=True)
            assert back.values() == big


# --------------------------------------------------------------------------- retention


def test_retention_prunes_the_history_per_owner(tmp_path: Path) -> None:
    state = tmp_path / "state"
    tcp = TcpAccess(tmp_path / "tls")
    first = daemon_on(
        tmp_path, "a", state, tcp.overrides({"limits": {"max_finished_runs_kept": 3}})
    ).start()
    with stopped_at_the_end(first):
        with first.client() as mine, tcp.client(first) as other:
            theirs = other.run([sub_task(other.register(f"{TASKS}:nothing"))], label="theirs")
            nothing = mine.register(f"{TASKS}:nothing")
            my_runs = [mine.run([sub_task(nothing)], label=f"mine {i}") for i in range(4)]
        # The client holding the most finished runs loses its oldest: never the other's.
        kept = {theirs.run_id, my_runs[2].run_id, my_runs[3].run_id}
        wait_until(lambda: set(stored(state)) == kept, message=f"history is not {kept}")

    # Lower limits at the next start prune the history the same way.
    second = daemon_on(
        tmp_path, "b", state, tcp.overrides({"limits": {"max_finished_runs_kept": 2}})
    ).start()
    with stopped_at_the_end(second), second.client() as mine, tcp.client(second) as other:
        assert {r.run_id for r in mine.list_runs()} == {theirs.run_id, my_runs[3].run_id}
        assert [r.run_id for r in other.list_runs()] == [theirs.run_id]
        assert other.wait_run(theirs.run_id).state is RunPhase.COMPLETED
        with pytest.raises(PermissionDenied):
            other.wait_run(my_runs[3].run_id)
    assert set(stored(state)) == {theirs.run_id, my_runs[3].run_id}


def test_finished_runs_past_the_age_limit_are_forgotten_also_from_the_history(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    first = daemon_on(tmp_path, "a", state).start()  # no age limit
    with stopped_at_the_end(first), first.client() as c:
        nothing = c.register(f"{TASKS}:nothing")
        old = c.run([sub_task(nothing)], label="old")
    assert old.run_id in stored(state)

    aged = {"limits": {"max_finished_run_age": 1.0}}
    second = daemon_on(tmp_path, "b", state, aged).start()
    with stopped_at_the_end(second), second.client() as c:
        nothing = c.register(f"{TASKS}:nothing")
        new = c.run([sub_task(nothing)], label="new")
        wait_until(
            lambda: old.run_id not in {r.run_id for r in c.list_runs()},
            timeout=60,
            message="a run older than max_finished_run_age is still listed",
        )
        with pytest.raises(NotFound, match="max_finished_run_age"):
            c.wait_run(old.run_id)
        wait_until(lambda: old.run_id not in stored(state), message="still in the history")
        wait_until(
            lambda: new.run_id not in {r.run_id for r in c.list_runs()},
            timeout=60,
            message="the new run never aged out",
        )
    assert new.run_id not in stored(state)


def test_memory_state_keeps_nothing(tmp_path: Path) -> None:
    state = tmp_path / "never"
    extra = {"daemon": {"state_dir": ":memory:"}}
    first = daemon_on(tmp_path, "a", state, extra).start()
    with stopped_at_the_end(first), first.client() as c:
        nothing = c.register(f"{TASKS}:nothing")
        ids = [c.run([sub_task(nothing)]).run_id for _ in range(3)]
        assert ids == sorted(set(ids))
    second = daemon_on(tmp_path, "b", state, extra).start()
    with stopped_at_the_end(second), second.client() as c:
        assert c.list_runs() == []
    assert not state.exists()


# --------------------------------------------------------------------------- the store itself


def _crash(history: History) -> None:
    """What a SIGKILL leaves: the writer gone, nothing stored on the way out."""
    history._queue.put(("stop", None))
    if history._thread is not None:
        history._thread.join(10)
    history._db.close()
    os.close(history._lock_fd)


def test_ids_are_reserved_ahead_so_a_crash_never_repeats_them(tmp_path: Path) -> None:
    history = History.open(str(tmp_path))
    before_start = [next(history.run_ids) for _ in range(ID_BLOCK + 10)]

    async def serving() -> list[int]:
        history.start()
        return [next(history.run_ids) for _ in range(2 * ID_BLOCK)]

    served = asyncio.run(serving())
    buffers = [next(history.buffer_ids) for _ in range(3)]
    _crash(history)
    ids = before_start + served
    assert ids == list(range(1, len(ids) + 1))

    again = History.open(str(tmp_path))
    try:
        assert next(again.run_ids) > ids[-1]
        assert next(again.buffer_ids) > buffers[-1]
    finally:
        _crash(again)


def test_an_id_handed_out_but_never_recorded_before_a_crash_is_reported_lost(
    tmp_path: Path,
) -> None:
    """A run submitted within FLUSH_DELAY of a SIGKILL has no row: its id must not read
    as "finished and was evicted" (nor as unknown): WaitRun answers LOST."""
    from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
    from simpler_daemon.server.history import UnrecordedRun

    history = History.open(str(tmp_path))
    handed_out = [next(history.run_ids) for _ in range(3)]  # submitted, never recorded
    _crash(history)
    again = History.open(str(tmp_path))
    try:
        lost = again.unrecorded(handed_out[1], "run_id")
        assert isinstance(lost, UnrecordedRun)
        status = lost.status()
        assert status.state == pb.RUN_STATE_LOST and status.run_id == handed_out[1]
        assert "has no record" in status.error.message and status.error.outcome == "LOST"
        assert again.unrecorded(next(again.run_ids), "run_id") is None  # this daemon's own
    finally:
        _crash(again)
    third = History.open(str(tmp_path))  # a second crash keeps the first one's range
    try:
        assert isinstance(third.unrecorded(handed_out[0], "run_id"), UnrecordedRun)
    finally:
        _crash(third)


def test_a_failing_write_is_counted_logged_once_and_retried_until_it_works(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The full-disk path without root: SQLite's own limit on the file's pages gives the
    same ``database or disk is full`` a full filesystem does."""
    from simpler_daemon.server.history import StoredRun
    from simpler_daemon.server.run_record import RunRecord

    def finished(run_id: int) -> RunRecord:
        row = StoredRun(
            run_id, "uid:0", "", "", b"", 1, 5, 1, 1, 0, 0, 1, 2, 3, "", None,
            [(0, None, bytes(50_000))], "",
        )  # fmt: skip
        return RunRecord.restored(row, None)

    history = History.open(str(tmp_path))
    pages = history._db.execute("PRAGMA page_count").fetchone()[0]
    history._db.execute(f"PRAGMA max_page_count = {pages + 2}")  # no room for 50 KB

    async def scenario() -> None:
        history.start()
        for run_id in (1, 2, 3):
            history.finished(finished(run_id))
        await asyncio.to_thread(wait_until, lambda: history.failing, 30, "the write never failed")
        history.finished(finished(4))  # more while it fails: kept for the retry
        await asyncio.to_thread(wait_until, lambda: history.failures >= 2, 30, "no retry")
        history._db.execute("PRAGMA max_page_count = 1000000")  # room again
        await asyncio.to_thread(
            wait_until, lambda: not history.failing, 30, "recording never resumed"
        )
        await history.close()

    with caplog.at_level(logging.INFO, logger="simpler_daemon.history"):
        asyncio.run(scenario())
    texts = [r.getMessage() for r in caplog.records]
    failed = [t for t in texts if t.startswith("cannot record the run history")]
    assert len(failed) == 1, texts  # once per incident, however many retries failed
    assert "database or disk is full" in failed[0] and "runs go on" in failed[0]
    assert any("recording works again" in t for t in texts)

    again = History.open(str(tmp_path))
    try:
        assert [row.run_id for row in again.stored] == [1, 2, 3, 4]
        assert all(row.results == [(0, None, bytes(50_000))] for row in again.stored)
    finally:
        _crash(again)
