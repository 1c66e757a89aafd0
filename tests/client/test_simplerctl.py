"""``simplerctl`` driven through the daemon flow: text and ``--json`` output, exit codes."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from simpler_daemon.cli import simplerctl as cli
from simpler_daemon.cli.output import Out
from simpler_daemon.cli.runs import watch_run
from simpler_daemon.client import Client
from tests.support.ctl import Ctl
from tests.support.daemon_harness import (
    EXAMPLES,
    REPO,
    DaemonProcess,
    module_daemon,
    module_leak_guard,
)

pytestmark = pytest.mark.timeout(60)

RUN_SPEC = f"""\
label = "ctl-demo"

[buffers.a]
shape = [8]
dtype = "float32"
data = [0, 1, 2, 3, 4, 5, 6, 7]

[buffers.b]
shape = [8]
dtype = "float32"

[buffers.out]
shape = [8]
dtype = "float32"

[[tasks]]
callable = "{EXAMPLES}:fill"
tensors = [{{ buffer = "b", tag = "output" }}]
scalars = [10]

[[tasks]]
callable = "{EXAMPLES}:add"
tensors = [
  {{ buffer = "a", tag = "input" }},
  {{ buffer = "b", tag = "input" }},
  {{ buffer = "out", tag = "output" }},
]

[[tasks]]
kind = "sub"
callable = "{EXAMPLES}:scale"
config = {{ deadline_ms = 10000 }}
[[tasks.members]]
tensors = [{{ buffer = "out", tag = "inout" }}]
scalars = [2]
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "ctl")


@pytest.fixture(autouse=True)
def no_leaked_children(daemon: DaemonProcess) -> Iterator[None]:
    """Overrides the conftest guard: the module daemon lives across tests on purpose."""
    yield from module_leak_guard(lambda: {daemon.pid})


@pytest.fixture
def ctl(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str]) -> Ctl:
    return Ctl(daemon.socket, capsys)


def test_info_workers_register_buffers(ctl: Ctl, daemon: DaemonProcess) -> None:
    code, out, _ = ctl("info")
    assert code == 0 and "level 3" in out and "2 SUB" in out
    info = ctl.json("info")
    assert info["level"] == 3 and info["pid"] == daemon.pid
    assert info["serving_state"] == "SERVING"
    assert info["limits"]["max_tasks_per_run"] == 1000  # numbers, not strings

    workers = ctl.json("workers")
    assert sorted(w["pid"] for w in workers) == sorted(daemon.worker_pids)
    assert {w["kind"] for w in workers} == {"SUB"}
    code, out, _ = ctl("workers")
    assert code == 0 and out.splitlines()[0].split()[:3] == ["ID", "KIND", "STATE"]

    reg = ctl.json("register", f"{EXAMPLES}:fill")
    assert reg["hashid"].startswith("sha256:") and reg["refcount"] >= 1
    code, out, _ = ctl("register", f"{EXAMPLES}:empty")
    assert code == 0 and out.startswith("sha256:")
    # `--json` may also follow the command.
    listed = json.loads(ctl("callables", "--json")[1])
    assert reg["hashid"] in {x["hashid"] for x in listed}

    with Client(daemon.socket) as c:
        buf = c.alloc_array(np.arange(6, dtype=np.int16), label="ctl-buffer")
    buffers = ctl.json("buffers")
    mine = next(b for b in buffers["buffers"] if b["buffer_id"] == buf)
    assert mine["shape"] == [2 * 3] and mine["dtype"] == "int16" and mine["label"] == "ctl-buffer"
    code, out, _ = ctl("buffers")
    assert code == 0 and "ctl-buffer" in out and "heap:" in out


def test_submit_toml_and_wait(ctl: Ctl, tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(RUN_SPEC)
    result = ctl.json("submit", str(spec), "--wait", "--timeout", "20")
    assert result["state"] == "COMPLETED" and result["label"] == "ctl-demo"
    assert result["counts"] == {"total": 3, "done": 3, "failed": 0, "running": 0, "retried": 0}
    assert result["contents"]["out"] == [(i + 10) * 2 for i in range(8)]
    assert set(result["buffers"]) == {"a", "b", "out"}

    # Text output: the status line and the buffers' contents.
    code, out, _ = ctl("submit", str(spec), "--wait")
    assert code == 0 and "COMPLETED (done 3/3, failed 0, running 0)" in out
    assert "out (buffer" in out
    # The spec's buffers were freed once printed: a submit owns what it creates.
    labels = {b["label"] for b in ctl.json("buffers")["buffers"]}
    assert not labels & {"a", "b", "out"}


def test_submit_json_watch_plain_lines(ctl: Ctl, tmp_path: Path) -> None:
    with Client(ctl.socket) as c:
        buf = c.alloc_buffer((4,), "int32").buffer_id
    spec = tmp_path / "run.json"
    spec.write_text(
        json.dumps(
            {
                "tasks": [
                    {
                        "callable": f"{EXAMPLES}:fill",
                        "scalars": [3],
                        "tensors": [{"buffer": buf, "tag": "output"}],
                    }
                ]
            }
        )
    )
    code, out, _ = ctl("submit", str(spec), "--watch")
    assert code == 0, out
    lines = out.strip().splitlines()
    assert "SNAPSHOT" in lines[0]
    assert any("RUN_STATE" in line and "COMPLETED" in line for line in lines)
    assert "\r" not in out  # not a TTY: plain lines, no progress bar
    with Client(ctl.socket) as c:
        assert c.read_array(buf, (4,), "int32").tolist() == [3] * 4


def test_watch_wait_cancel_and_failed_runs(ctl: Ctl, tmp_path: Path) -> None:
    with Client(ctl.socket) as c:
        flag = c.alloc_buffer((2,), "uint8").buffer_id
    gated = tmp_path / "gated.json"
    gated.write_text(
        json.dumps(
            {
                "tasks": [
                    {
                        "callable": f"{EXAMPLES}:wait_for_flag",
                        "scalars": [20000],
                        "tensors": [{"buffer": flag, "tag": "inout"}],
                    }
                ]
            }
        )
    )
    submitted = ctl.json("submit", str(gated), "--idempotency-key", "ctl-gated")
    run_id = submitted["run_id"]
    assert ctl.json("submit", str(gated), "--idempotency-key", "ctl-gated") == {
        "run_id": run_id,
        "deduplicated": True,
        "buffers": {},
    }

    code, out, _ = ctl("wait", str(run_id), "--timeout", "0.1")
    assert code == 5 and "still" in out
    cancelled = ctl.json("cancel", str(run_id), "--reason", "from simplerctl")
    assert cancelled["already_finished"] is False
    with Client(ctl.socket) as c:
        c.write_buffer(flag, b"\x01")
    code, out, _ = ctl("wait", str(run_id))
    assert code == 1 and "CANCELLED" in out and "from simplerctl" in out
    status = json.loads(ctl("--json", "wait", str(run_id))[1])
    assert status["state"] == "CANCELLED" and status["error"]["outcome"] == "CANCELLED"

    # --json watch: one JSON object per line, ending with the terminal RUN_STATE.
    code, out, _ = ctl("--json", "watch", str(run_id))
    events = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and events[0]["type"] == "SNAPSHOT"
    assert events[-1]["state"] == "CANCELLED"
    code, out, _ = ctl("cancel", str(run_id))
    assert code == 0 and "already finished" in out

    failing = tmp_path / "fail.json"
    failing.write_text(json.dumps({"tasks": [{"callable": f"{EXAMPLES}:fail", "scalars": [4]}]}))
    code, out, _err = ctl("submit", str(failing), "--wait")
    assert code == 1 and "FAILED" in out and "example failure (scalar 4)" in out


def test_progress_bar_on_a_tty(ctl: Ctl, tmp_path: Path) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    with Client(ctl.socket) as c:
        fill = c.register(f"{EXAMPLES}:fill")
        buf = c.alloc_buffer((4,), "int8").buffer_id
        from simpler_daemon.client import sub_task, tensor

        run_id = c.submit([sub_task(fill, [tensor(buf, "output", (4,), "int8")], [1])] * 3)
        stream = Tty()
        assert watch_run(c, run_id, Out(False, stream))[0] == 0
        c.free_buffer(buf)
    text = stream.getvalue()
    assert "\r" in text and "[" in text and "3/3" in text and "COMPLETED" in text
    assert "done 3" in text and "failed 0" in text
    # The progress bar shows elapsed time, rate and ETA.
    assert "elapsed" in text and "tasks/s" in text and "ETA" in text


def test_exit_codes(ctl: Ctl, tmp_path: Path) -> None:
    code, out, err = ctl("wait", "987654")
    assert code == 4 and "NOT_FOUND" in err and "run 987654 is unknown" in err
    code, out, err = ctl("--json", "cancel", "987654")
    assert code == 4 and json.loads(out)["error"]["code"] == "NOT_FOUND"
    code, _, err = ctl("register", "os:system")
    assert code == 2 and "PERMISSION_DENIED" in err

    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {
                "tasks": [
                    {
                        "callable": f"{EXAMPLES}:fill",
                        "tensors": [{"buffer": "nope", "tag": "input"}],
                    }
                ]
            }
        )
    )
    code, _, err = ctl("submit", str(bad))
    assert code == 2 and "tasks[0].tensors[0].buffer: no buffer named 'nope'" in err
    bad.write_text(json.dumps({"tasks": [{"callable": f"{EXAMPLES}:fill", "kind": "group"}]}))
    code, _, err = ctl("submit", str(bad))
    assert code == 2 and "tasks[0].kind" in err
    bad.write_text(json.dumps({"tasks": [{"callable": "os:system"}]}))
    code, _, err = ctl("submit", str(bad))
    assert code == 2 and "PERMISSION_DENIED: tasks[0].callable: import_path: module 'os'" in err
    with Client(ctl.socket) as c:
        buf = c.alloc_buffer((4,), "int8").buffer_id
    bad.write_text(
        json.dumps(
            {
                "tasks": [
                    {
                        "callable": f"{EXAMPLES}:fill",
                        "scalars": [1],
                        "tensors": [{"buffer": buf, "tag": "output", "shape": [5]}],
                    }
                ]
            }
        )
    )
    code, _, err = ctl("submit", str(bad))
    assert code == 2 and "INVALID_ARGUMENT" in err and "tasks[0].members[0].tensors[0]" in err

    code, _, err = ctl("add-remote", "127.0.0.1:19073", "--num-sub-workers", "1")
    assert code == cli.EXIT_REFUSED and "FAILED_PRECONDITION" in err
    assert "this daemon is level 3" in err

    code, _, err = ctl("wait", "not-a-number")
    assert code == 2
    code, _, err = ctl()
    assert code == 2
    code = cli.main(["--socket", str(tmp_path / "nothing.sock"), "info"])
    assert code == 3


def test_console_script_in_a_subprocess(daemon: DaemonProcess) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "simpler_daemon.cli", "--socket", daemon.socket, "info", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["pid"] == daemon.pid


def test_json_prints_one_document_per_command(ctl: Ctl) -> None:
    """`--json free 45 777` printed two documents (an error object each) and a list."""
    with Client(ctl.socket) as c:
        buf = c.alloc_buffer((4,), "int8").buffer_id
    code, out, err = ctl("--json", "free", "987001", str(buf), "987002")
    assert code == cli.EXIT_NOT_FOUND
    doc = json.loads(out)  # one document: json.loads refuses trailing data
    assert [entry["buffer_id"] for entry in doc] == [987001, buf, 987002]
    assert doc[0]["error"]["code"] == "NOT_FOUND" and doc[1] == {
        "buffer_id": buf,
        "deferred": False,
    }
    assert "987002 is not allocated" in err  # still said for the human, on stderr


def test_state_names_are_spelt_one_way_in_text_and_json(ctl: Ctl, tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(RUN_SPEC)
    status = ctl.json("submit", str(spec), "--wait")
    assert status["state"] == "COMPLETED"
    code, text, _ = ctl("wait", str(status["run_id"]))
    assert code == 0 and "COMPLETED" in text and "RUN_STATE" not in text
    runs = ctl.json("runs", "--limit", "1")
    assert runs[0]["state"] == "COMPLETED"
    workers = ctl.json("workers")
    assert {w["kind"] for w in workers} <= {"SUB", "CHIP", "NESTED_L3", "REMOTE_L3"}
    assert all("_STATE_" not in w["state"] for w in workers)
    assert ctl.json("info")["serving_state"] == "SERVING"


def test_a_tcp_target_without_a_port_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """`--socket localhost` used to dial localhost:443."""
    code = cli.main(["--socket", "localhost", "info"])
    _, err = capsys.readouterr()
    assert code == cli.EXIT_USAGE and "neither a socket path nor HOST:PORT" in err


def test_an_unavailable_socket_exits_unreachable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 3 (UNAVAILABLE) as the table says, for every way of not reaching a daemon:
    no socket, and a socket without the fast one beside it (--transport fast)."""
    import socket

    code = cli.main(["--socket", str(tmp_path / "nothing.sock"), "info"])
    assert code == cli.EXIT_UNREACHABLE
    path = tmp_path / "daemon.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen()
        capsys.readouterr()
        code = cli.main(["--socket", str(path), "--transport", "fast", "info"])
    _, err = capsys.readouterr()
    assert code == cli.EXIT_UNREACHABLE and "UNAVAILABLE" in err and "fast" in err, err
