"""Every process says what it is in ``ps``: the daemon's children
(``simpler-daemon: sub worker 0``, ``...: chip 0``, ``...: fork server``), an in-process
Worker's (``simpler: sub worker 1``), and their replacements; ``/proc/PID/environ``
stays readable (the leak guards of the remote tests look for a mark in it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from simpler_daemon import Worker
from simpler_daemon.testing import descendants, poll_for
from tests.support.daemon_harness import DaemonProcess

pytestmark = pytest.mark.timeout(120)


def _title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path / "d", {"workers": {"num_sub_workers": 2, "num_chips": 1}})
    d.start()
    try:
        yield d
    finally:
        d.stop()


def test_the_daemons_children_are_named_in_ps(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        workers = {(w.kind, w.worker_id): w.pid for w in c.list_workers()}
    titles = {key: _title(pid) for key, pid in workers.items()}
    assert sorted(titles.values()) == [
        "simpler-daemon: chip 0",
        "simpler-daemon: sub worker 0",
        "simpler-daemon: sub worker 1",
    ]
    others = [_title(p) for p in descendants(daemon.pid) if p not in workers.values()]
    assert others and all(t == "simpler-daemon: fork server" for t in others), others
    # A replacement (forked by the fork server) is named like the child it replaces.
    sub0 = next(pid for (kind, wid), pid in workers.items() if wid == 0 and kind == 1)
    os.kill(sub0, 9)

    def replaced() -> bool:
        with daemon.client() as c:
            pids = [w.pid for w in c.list_workers() if w.kind == 1 and w.worker_id == 0]
        return bool(pids) and pids[0] not in (0, sub0)

    poll_for(replaced, timeout=60, message="sub worker 0 was not replaced")
    with daemon.client() as c:
        new = next(w.pid for w in c.list_workers() if w.kind == 1 and w.worker_id == 0)
    assert _title(new) == "simpler-daemon: sub worker 0"
    assert b"PATH=" in Path(f"/proc/{new}/environ").read_bytes()


def test_an_in_process_workers_children_are_named_in_ps() -> None:
    w = Worker(level=3, num_sub_workers=2)
    w.init()
    try:
        pids = [p for p in descendants(os.getpid())]
        titles = sorted(_title(p) for p in pids)
        assert "simpler: sub worker 0" in titles and "simpler: sub worker 1" in titles
    finally:
        w.close()
