"""Operator logs. With ``log_format = "json"`` everything the daemon writes (its
start-up lines, its records, a task's print(), a crashing child's faulthandler dump)
is one JSON object per line; a crash's dump reaches the task's error and one record.
(The journald text format is checked on the signal test's daemon, ops/test_ops_signals.py.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpler_daemon.client import sub_task, tensor
from simpler_daemon.client.requests import TERMINAL_STATES
from simpler_daemon.client.results import RunPhase
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server import oplog
from simpler_daemon.system.logsetup import JournalFormatter, syslog_priority
from tests.support.daemon_harness import EXAMPLES, running_daemon

OPS = "tests.support.daemon_tasks"


def records(text: str, stream: str) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"{stream} line {n} is not JSON: {line!r}\n--- {stream}:\n{text}")
    return out


def test_json_stream_of_a_session_with_failures_a_crash_and_a_cancel(tmp_path: Path) -> None:
    overrides: dict[str, dict[str, Any]] = {
        "daemon": {"log_format": "json"},
        "workers": {"num_sub_workers": 2},
        "callables": {"allowed_modules": ["simpler_daemon.examples", OPS]},
    }
    with running_daemon(tmp_path / "d", overrides) as d, d.client() as c:
        fail = c.register(f"{EXAMPLES}:fail")
        wait = c.register(f"{EXAMPLES}:wait_for_flag")
        shout, segfault, vanish = (
            c.register(f"{OPS}:{n}") for n in ("shout", "segfault", "vanish")
        )

        def run(task: pb.Task) -> Any:
            run_id = c.submit_run([task]).run_id
            status = c.wait_run(run_id, timeout=60)
            assert int(status.state) in TERMINAL_STATES
            return status

        assert run(sub_task(shout)).state == RunPhase.COMPLETED
        failed = run(sub_task(fail, scalars=[7]))
        assert failed.state == RunPhase.FAILED
        crashed = run(sub_task(segfault))
        assert crashed.state == RunPhase.FAILED
        # The dump's gist is in the task's error, not on the daemon's stderr.
        message = crashed.error.message
        assert "killed by SIGSEGV (Fatal Python error: Segmentation fault; at " in message
        assert ", from daemon_tasks.py:" in message and " in segfault)" in message
        assert run(sub_task(vanish)).state == RunPhase.FAILED
        # A cancel: the flag is never set, the task gives up after 300 ms.
        flag = c.alloc_array(np.zeros(2, dtype=np.uint8))
        run_id = c.submit_run(
            [sub_task(wait, [tensor(flag, "inout", (2,), "uint8")], [300])]
        ).run_id
        c.cancel(run_id, reason="ops test")
        assert c.wait_run(run_id, timeout=60).state == RunPhase.CANCELLED
        # The pool is whole again after the crashes (replacements came up).
        assert run(sub_task(shout)).state == RunPhase.COMPLETED

    err = records(d.stderr(), "stderr")
    out = records(d.stdout(), "stdout")
    assert any("listening on unix:" in r["message"] for r in out)
    messages = [r["message"] for r in err]
    # A task's print() and its stderr are records (with the child's pid), not raw lines.
    assert any(
        r["message"] == "hello from a task" and r["logger"] == "simpler_daemon.stdout" for r in err
    ), messages
    assert any(r["message"] == "a warning from a task" and r["level"] == "warning" for r in err)
    # The crash: one record with the whole faulthandler dump.
    [crash] = [r for r in err if r.get("event") == "child_crashed"]
    assert crash["level"] == "warning"
    assert "Fatal Python error: Segmentation fault" in crash["message"]
    assert 'daemon_tasks.py", line' in crash["message"] and "in segfault" in crash["message"]
    assert not any(m.startswith(("Fatal Python error", "Traceback")) for m in messages)


def test_oplog_records_carry_their_fields(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=oplog.LOGGER_NAME):
        oplog.run_finished(7, "uid:1000", "nightly", "RUN_STATE_FAILED", "ValueError: boom")
        oplog.run_finished(8, "uid:1000", "", "completed", None)
        oplog.task_failed(7, 2, "sub worker 0", 4242, "3f2a", "ValueError: boom", "TASK_FAILURE")
        oplog.run_cancelled(9, "uid:1000", "user asked", True)
        oplog.register_refused("json:dumps", "uid:1000", "module 'json' is not allowed")
        oplog.heap_exhausted("uid:1000", 1 << 20, "quota exceeded")
    by_event = {(r.__dict__["event"], r.__dict__.get("run_id")): r for r in caplog.records}
    failed = by_event[("run_finished", 7)]
    assert failed.levelno == logging.WARNING and failed.__dict__["state"] == "failed"
    assert (
        failed.getMessage() == "run 7 failed (client uid:1000, label 'nightly'): ValueError: boom"
    )
    assert by_event[("run_finished", 8)].levelno == logging.DEBUG
    task = by_event[("task_failed", 7)]
    assert task.levelno == logging.WARNING and task.__dict__["worker_pid"] == 4242
    assert task.getMessage() == (
        "task 2 of run 7 failed on sub worker 0 (pid 4242, hashid 3f2a): "
        "TASK_FAILURE: ValueError: boom"
    )
    assert by_event[("run_cancelled", 9)].levelno == logging.INFO
    assert by_event[("register_refused", None)].levelno == logging.WARNING
    assert by_event[("heap_exhausted", None)].__dict__["nbytes"] == 1 << 20


def test_journal_format_has_priorities_and_no_timestamp() -> None:
    record = logging.LogRecord("x.y", logging.ERROR, __file__, 1, "bad\nsecond line", None, None)
    assert JournalFormatter().format(record) == "<3>ERROR x.y: bad\n<3>second line"
    assert [syslog_priority(n) for n in (50, 40, 30, 20, 10)] == [2, 3, 4, 6, 7]


def test_a_failed_run_with_a_traceback_is_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """journald makes every line an entry: the message keeps the error's first line, the
    record's ``error`` field the whole text."""
    error = "run 3 failed: task 0 failed\nTraceback (most recent call last):\n  File x\nValueError: boom"
    with caplog.at_level(logging.DEBUG, logger=oplog.LOGGER_NAME):
        oplog.run_finished(3, "uid:1000", "", "failed", error)
    (record,) = caplog.records
    assert record.getMessage() == "run 3 failed (client uid:1000): task 0 failed (+3 lines)"
    assert record.__dict__["error"] == error
