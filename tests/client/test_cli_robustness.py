"""simplerctl robustness, and the CLI side of cancel (``--terminate``, Ctrl-C), drain and
resume, and run listing, against one daemon for the module.

* Output and input: ``test_first_run_id_is_1``, ``test_closed_stdout_is_not_a_traceback``
  and ``test_closed_stdout_frees_the_submits_buffers``,
  ``test_out_of_range_values_are_usage_errors``, ``test_watch_timeout_is_honoured``,
  ``test_deadline_is_a_timeout_not_unreachable``, ``test_json_watch_carries_what_text_shows``,
  ``test_shell_completion``, ``test_progress_bar_ticks_without_events`` (the progress
  bar's elapsed/rate/ETA: tests/client/test_simplerctl.py::test_progress_bar_on_a_tty).
* Runs: ``test_cancel_terminate_stops_a_running_task``, ``test_ctrl_c_*`` (also
  ``test_ctrl_c_in_submit_watch``), ``test_runs_listing`` (states in any case, the same
  names), ``test_drain_then_resume``.
"""

from __future__ import annotations

import io
import json
import os
import pty
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from simpler_daemon.cli import simplerctl as cli
from simpler_daemon.cli.output import Out
from simpler_daemon.cli.runs import watch_run
from simpler_daemon.client import Client
from simpler_daemon.testing import poll_for
from tests.support.ctl import Ctl
from tests.support.daemon_harness import (
    EXAMPLES,
    REPO,
    DaemonProcess,
    module_daemon,
    module_leak_guard,
)

pytestmark = pytest.mark.timeout(90)

FIRST_RUN: dict[str, int] = {}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    for d in module_daemon(tmp_path_factory, "ctl-robust"):
        # The daemon's very first run, submitted by the CLI before any test runs.
        spec = d.dir / "first.json"
        spec.write_text(json.dumps({"tasks": [{"callable": f"{EXAMPLES}:empty"}]}))
        proc = _simplerctl(d.socket, "--json", "submit", str(spec), "--wait")
        FIRST_RUN["run_id"] = json.loads(proc.stdout)["run_id"]
        yield d


@pytest.fixture(autouse=True)
def no_leaked_children(daemon: DaemonProcess) -> Iterator[None]:
    yield from module_leak_guard(lambda: {daemon.pid})


@pytest.fixture
def ctl(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str]) -> Ctl:
    return Ctl(daemon.socket, capsys)


def _simplerctl(socket: str, *argv: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.run(
        [sys.executable, "-m", "simpler_daemon.cli", "--socket", socket, *argv],
        cwd=REPO,
        text=True,
        timeout=60,
        **kw,
    )


def _gated(tmp_path: Path, c: Client, ms: int = 30000) -> tuple[Path, int]:
    """A spec whose one task waits (up to ``ms``) until its flag buffer is set."""
    flag = c.alloc_buffer((2,), "uint8").buffer_id
    spec = tmp_path / "gated.json"
    spec.write_text(
        json.dumps(
            {
                "tasks": [
                    {
                        "callable": f"{EXAMPLES}:wait_for_flag",
                        "scalars": [ms],
                        "tensors": [{"buffer": flag, "tag": "inout"}],
                    }
                ]
            }
        )
    )
    return spec, int(flag)


def _release(c: Client, flag: int) -> None:
    c.write_buffer(flag, b"\x01")


def test_first_run_id_is_1() -> None:
    assert FIRST_RUN["run_id"] == 1


@pytest.mark.parametrize("follow", [["--wait"], ["--json", "--watch"]])
def test_closed_stdout_frees_the_submits_buffers(daemon: DaemonProcess, follow: list[str]) -> None:
    with Client(daemon.socket) as c:
        before = {b.buffer_id for b in c.list_buffers().buffers}
        r, w = os.pipe()
        os.close(r)  # `| head -1` gone before the outputs are printed
        try:
            proc = _simplerctl(daemon.socket, "submit", "examples/run.toml", *follow, stdout=w)
        finally:
            os.close(w)
        assert proc.returncode == cli.EXIT_PIPE, proc.stderr
        assert "Traceback" not in proc.stderr and "freeing the buffers" in proc.stderr
        # Released at once, or (a run still going) once it ends.
        poll_for(lambda: {b.buffer_id for b in c.list_buffers().buffers} <= before, timeout=20)


def test_deadline_is_a_timeout_not_unreachable(daemon: DaemonProcess) -> None:
    proc = _simplerctl(daemon.socket, "--rpc-timeout", "0.000001", "info")
    assert proc.returncode == cli.EXIT_TIMEOUT, proc.stderr
    assert "did not answer `simplerctl info` within 1e-06 s" in proc.stderr
    assert "cannot reach" not in proc.stderr
    proc = _simplerctl(daemon.socket, "register", f"{EXAMPLES}:empty", "--timeout", "0.000001")
    assert proc.returncode == cli.EXIT_TIMEOUT and "register --timeout" in proc.stderr
    # An import in every worker may take long: register has its own, longer deadline.
    args = cli.parser().parse_args(["register", f"{EXAMPLES}:empty"])
    assert args.timeout is None and cli.REGISTER_TIMEOUT >= 300


def test_closed_stdout_is_not_a_traceback(daemon: DaemonProcess) -> None:
    r, w = os.pipe()
    os.close(r)  # `| head` that already went away: every write gets EPIPE
    try:
        proc = _simplerctl(daemon.socket, "workers", stdout=w)
    finally:
        os.close(w)
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    assert proc.returncode == cli.EXIT_PIPE


@pytest.mark.parametrize(
    "argv",
    [
        ["wait", "99999999999999999999999"],
        ["cancel", "18446744073709551616"],
        ["free", "-3"],
        ["add-remote", "127.0.0.1:1", "--num-sub-workers", "-1"],
        ["drain", "--grace", "1e300"],
        ["--rpc-timeout", "inf", "info"],
        ["runs", "--limit", "0"],
        ["submit", "x.json", "--priority", "0"],
    ],
)
def test_out_of_range_values_are_usage_errors(daemon: DaemonProcess, argv: list[str]) -> None:
    proc = _simplerctl(daemon.socket, *argv)
    assert proc.returncode == cli.EXIT_USAGE, proc
    assert "Traceback" not in proc.stderr and "simplerctl: error:" in proc.stderr


def test_watch_timeout_is_honoured(ctl: Ctl, tmp_path: Path) -> None:
    with Client(ctl.socket) as c:
        spec, flag = _gated(tmp_path, c)
        started = time.monotonic()
        code, out, err = ctl("submit", str(spec), "--watch", "--timeout", "1")
        assert code == cli.EXIT_TIMEOUT, (out, err)
        assert time.monotonic() - started < 20  # not the task's 30 s
        assert "still" in err
        run_id = c.list_runs(limit=1)[0].run_id
        _release(c, flag)
        c.wait(run_id, 30)
        c.free_buffer(flag)


def test_json_watch_carries_what_text_shows(ctl: Ctl, tmp_path: Path) -> None:
    failing = tmp_path / "fail.json"
    failing.write_text(json.dumps({"tasks": [{"callable": f"{EXAMPLES}:fail", "scalars": [4]}]}))
    code, out, _err = ctl("--json", "submit", str(failing), "--watch")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == cli.EXIT_FAILED
    events, final = lines[:-1], lines[-1]
    assert all({"elapsed_seconds", "rate_per_second", "eta_seconds"} <= set(e) for e in events)
    assert final["state"] == "FAILED"
    assert "example failure (scalar 4)" in final["error"]["message"]


def test_shell_completion(daemon: DaemonProcess) -> None:
    proc = _simplerctl(daemon.socket, "completion", "bash")
    assert proc.returncode == 0, proc.stderr
    assert "simplerctl" in proc.stdout and "--idempotency-key" in proc.stdout
    assert "cancel-on-interrupt" in proc.stdout


def test_cancel_terminate_stops_a_running_task(ctl: Ctl, tmp_path: Path) -> None:
    with Client(ctl.socket) as c:
        spec, flag = _gated(tmp_path, c, ms=60000)
        run_id = ctl.json("submit", str(spec))["run_id"]
        poll_for(lambda: c.wait_run(run_id, 0).counts.running == 1, timeout=20)
        code, out, _ = ctl("cancel", str(run_id), "--terminate", "--reason", "stuck")
        assert code == 0 and "(its running tasks stopped)" in out
        status = c.wait_run(run_id, 20)  # well before the task's own 60 s
        assert status.state == 7 and status.terminal  # CANCELLED
        c.free_buffer(flag)


def _follow_and_interrupt(
    socket: str, spec: Path, *flags: str, stdin: int | None = None
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "simpler_daemon.cli",
            "--socket",
            socket,
            "submit",
            str(spec),
            "--watch",
            *flags,
        ],
        cwd=REPO,
        stdin=stdin if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # the SNAPSHOT line: the run is being watched
    assert "SNAPSHOT" in first, first
    proc.send_signal(signal.SIGINT)
    return proc


def _run_of(line_source: str) -> int:
    return int(line_source.split()[1])


@pytest.mark.parametrize("how", ["flag", "prompt", "leave"])
def test_ctrl_c_in_submit_watch(daemon: DaemonProcess, tmp_path: Path, how: str) -> None:
    with Client(daemon.socket) as c:
        spec, flag = _gated(tmp_path, c)
        master = slave = -1
        if how == "flag":
            proc = _follow_and_interrupt(daemon.socket, spec, "--cancel-on-interrupt")
        elif how == "prompt":
            master, slave = pty.openpty()
            proc = _follow_and_interrupt(daemon.socket, spec, stdin=slave)
            os.write(master, b"y\n")
        else:
            proc = _follow_and_interrupt(daemon.socket, spec)
        try:
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:  # it did not exit: do not leave it to the next tests
                proc.kill()
                proc.communicate()
            for fd in (master, slave):
                if fd >= 0:
                    os.close(fd)
        assert proc.returncode == cli.EXIT_INTERRUPTED, err
        assert "Traceback" not in err
        run_id = c.list_runs(limit=1)[0].run_id
        if how == "leave":
            assert f"run {run_id} keeps running" in err and "simplerctl cancel" in err
            assert not c.wait_run(run_id, 0).terminal
            _release(c, flag)
            assert c.wait_run(run_id, 30).state == 5  # COMPLETED
        else:
            assert f"run {run_id} cancelled" in err
            # Exited at once, the running task left to finish in the daemon.
            assert "running task(s) finish in the background" in err, err
            assert c.wait_run(run_id, 0).counts.running == 1
            if how == "prompt":
                assert "cancel it?" in err
            _release(c, flag)
            assert c.wait_run(run_id, 30).state == 7  # CANCELLED
        c.free_buffer(flag)


def test_runs_listing(ctl: Ctl, tmp_path: Path) -> None:
    spec = tmp_path / "empty.json"
    spec.write_text(json.dumps({"label": "listed", "tasks": [{"callable": f"{EXAMPLES}:empty"}]}))
    ids = [ctl.json("submit", str(spec), "--wait")["run_id"] for _ in range(3)]
    runs = ctl.json("runs", "--state", "COMPLETED", "--limit", "2")
    assert [r["run_id"] for r in runs] == ids[::-1][:2]
    assert {r["state"] for r in runs} == {"COMPLETED"}  # as the table shows it
    again = ctl.json("runs", "--state", "Completed", "--limit", "2")
    assert [r["run_id"] for r in again] == [r["run_id"] for r in runs]
    code, out, _ = ctl("runs", "--limit", "3")
    rows = out.splitlines()
    assert code == 0 and rows[0].split()[:2] == ["RUN", "STATE"]
    assert rows[1].split()[:2] == [str(ids[-1]), "COMPLETED"] and "listed" in rows[1]


def test_drain_then_resume(ctl: Ctl, tmp_path: Path) -> None:
    """Last in the module: the daemon drains (no runs active) and serves again."""
    code, out, _ = ctl("drain", "--grace", "5")
    assert code == 0 and "simplerctl resume" in out
    spec = tmp_path / "empty.json"
    spec.write_text(json.dumps({"tasks": [{"callable": f"{EXAMPLES}:empty"}]}))
    code, _, err = ctl("submit", str(spec))
    assert code == cli.EXIT_REFUSED and "draining" in err
    code, out, _ = ctl("resume")
    assert code == 0 and "serving again" in out
    assert ctl.json("info")["serving_state"] == "SERVING"
    assert ctl.json("submit", str(spec), "--wait")["state"] == "COMPLETED"
    assert ctl("resume")[1].startswith("was not draining")


def test_progress_bar_ticks_without_events(ctl: Ctl, tmp_path: Path) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    with Client(ctl.socket) as c:
        spec, flag = _gated(tmp_path, c)
        run_id = ctl.json("submit", str(spec))["run_id"]
        poll_for(lambda: c.wait_run(run_id, 0).counts.running == 1, timeout=20)
        stream = Tty()
        # No event comes while the task waits: the bar must still redraw, time moving.
        assert watch_run(c, run_id, Out(False, stream), timeout=2.5)[0] == cli.EXIT_TIMEOUT
        _release(c, flag)
        c.wait(run_id, 30)
        c.free_buffer(flag)
    seconds = [float(x) for x in re.findall(r"(\d+\.\d)s elapsed", stream.getvalue())]
    assert max(seconds) >= 1.0, stream.getvalue()
