"""The README as a shell walk-through: its shell blocks, run in order as written.

The commands are extracted from README.md's ```sh blocks at test time (never copied
here). A block preceded by ``<!-- walkthrough: skip (why) -->`` is not run (root,
systemd, another host; the comment says why). In the runnable blocks:

* ``make run`` is started in the background in its own process group, as a user would
  start it in another shell; the test waits for its socket, and stops it at the end
  with SIGINT (Ctrl-C), checking it exits cleanly and leaves nothing in /dev/shm.
* ``make test`` is skipped: this test is part of that suite (it would recurse).
* every other line runs with ``bash -c`` in the repository; a non-zero exit fails the test.

It runs in place rather than in a ``git clone``: a clone has no ``.venv``, and building
one (``pip install`` of every dependency, the C extension) is what the README's first
block does once, taking minutes; the in-place ``.venv`` is that same result.
``XDG_RUNTIME_DIR`` points at a temporary directory so the daemon's default socket (and
the clients' default search) lands there, not in the machine's /run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from simpler_daemon.testing import leaked_shm, note_descendants, poll_for, shm_files
from tests.support.daemon_harness import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

_BLOCK = re.compile(
    r"(<!-- walkthrough: skip \((?P<why>[^)]*)\) -->\n)?```sh\n(?P<body>.*?)```", re.S
)


def readme_commands() -> list[str]:
    """Every command line of the README's runnable shell blocks, in order."""
    text = (REPO / "README.md").read_text()
    commands: list[str] = []
    for m in _BLOCK.finditer(text):
        if m["why"] is not None:
            assert m["why"].strip(), "a skipped README block must say why"
            continue
        for line in m["body"].splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def _command(line: str) -> str:
    return line.split("#", 1)[0].strip()


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ)
    for name in ("SIMPLER_DAEMON_SOCKET", "NOTIFY_SOCKET", "MAKEFLAGS", "MAKELEVEL"):
        env.pop(name, None)
    env["XDG_RUNTIME_DIR"] = str(runtime)
    yield env


def test_readme_walkthrough(env: dict[str, str], tmp_path: Path) -> None:
    commands = readme_commands()
    assert [_command(c) for c in commands[:2]] == ["make run", "make test"]
    assert any("simplerctl submit" in c for c in commands)
    socket = Path(env["XDG_RUNTIME_DIR"]) / "simpler-daemon" / "daemon.sock"
    shm_before = shm_files()
    daemon: subprocess.Popen[bytes] | None = None
    log = tmp_path / "make-run.log"
    ran: list[str] = []
    try:
        for line in commands:
            cmd = _command(line)
            if cmd == "make test":
                continue  # this test is part of `make test`: running it here would recurse
            if cmd == "make run":
                with open(log, "wb") as fh:
                    daemon = subprocess.Popen(
                        ["make", "run"],
                        cwd=REPO,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )

                def ready(proc: subprocess.Popen[bytes] = daemon) -> bool:
                    if proc.poll() is not None:
                        raise AssertionError(f"`make run` exited:\n{log.read_text()}")
                    return socket.exists()

                poll_for(ready, timeout=90, interval=0.05, message="`make run` never served")
                note_descendants()  # the daemon is make's child: its heap is ours
                continue
            result = subprocess.run(
                ["bash", "-c", cmd],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert result.returncode == 0, (
                f"README command failed ({result.returncode}): {cmd}\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
            )
            assert "Traceback" not in result.stderr, result.stderr
            ran.append(cmd)
            if "submit examples/run.toml --wait" in cmd:
                assert "COMPLETED" in result.stdout and "out (buffer" in result.stdout
    finally:
        if daemon is not None and daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGINT)  # Ctrl-C in the shell running `make run`
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait(10)
                raise
    assert daemon is not None
    assert daemon.returncode in (0, 2, -signal.SIGINT), log.read_text()  # make: 2 on SIGINT
    assert len(ran) >= 5, ran
    poll_for(lambda: not leaked_shm(shm_before), timeout=10, message="heap left in /dev/shm")
    assert "Traceback" not in log.read_text(), log.read_text()
