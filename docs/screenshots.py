"""Capture docs/img/dashboard-*.png: every dashboard view of a real daemon, in Chromium.

``make screenshots`` (or ``.venv/bin/python docs/screenshots.py`` from the repository
root) starts a level-4 daemon with two SUB workers and one remote L3 worker on
loopback (a real ``simpler-remote-worker``), a metrics token and ``[dashboard]
enabled``; submits a run that finishes (its tasks released one by one, so its Gantt
chart has lanes and spans), one that fails, and one left running; then opens each view
in headless Chromium (simpler_daemon/testing/browser.py) and saves it. Everything it
started is stopped at the end. Needs /usr/bin/chromium and /usr/bin/chromedriver.
"""

from __future__ import annotations

import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from simpler_daemon.client import sub_task, tensor  # noqa: E402
from simpler_daemon.testing import poll_for  # noqa: E402
from simpler_daemon.testing.browser import browser, missing_browser  # noqa: E402
from tests.support.daemon_harness import EXAMPLES, running_daemon  # noqa: E402
from tests.support.remote_worker import RemoteWorkerProcess  # noqa: E402

OUT = REPO / "docs" / "img"
TOKEN = "screenshot-token-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flag_tasks(c: object, n: int) -> tuple[list[object], list[int]]:
    wait = c.register(f"{EXAMPLES}:wait_for_flag")  # type: ignore[attr-defined]
    flags = [int(c.alloc_buffer((2,), "uint8").buffer_id) for _ in range(n)]  # type: ignore[attr-defined]
    return [sub_task(wait, [tensor(f, "inout", (2,), "uint8")], [60_000]) for f in flags], flags


def main() -> int:
    why = missing_browser()
    if why:
        print(f"cannot take screenshots: {why}", file=sys.stderr)
        return 1
    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="simpler-screenshots-"))
    secret = work / "metrics-token"
    secret.write_text(TOKEN)
    secret.chmod(0o600)
    port = free_port()
    remote = RemoteWorkerProcess(work)
    try:
        overrides = {
            "daemon": {"level": 4},
            "workers": {
                "num_sub_workers": 2,
                "remote": [
                    {
                        "endpoint": remote.address,
                        "num_sub_workers": 1,
                        "session_timeout_s": 10.0,
                        "heap_bytes": 4 << 20,
                        "callables": [{"target": f"{EXAMPLES}:scale", "kind": "sub"}],
                    }
                ],
            },
            "metrics": {"listen": f"127.0.0.1:{port}", "token_file": str(secret)},
            "dashboard": {"enabled": True},
        }
        with running_daemon(work / "daemon", overrides) as daemon, daemon.client() as c:
            capture(c, f"http://127.0.0.1:{port}/")
    finally:
        remote.stop()
    for png in sorted(OUT.glob("dashboard-*.png")):
        print(png.relative_to(REPO))
    return 0


def capture(c: object, url: str) -> None:
    from selenium.webdriver.common.by import By

    fail = c.register(f"{EXAMPLES}:fail")  # type: ignore[attr-defined]
    tasks, flags = flag_tasks(c, 10)
    done_run = int(c.submit(tasks, label="nightly reduce <b>v2</b>"))  # type: ignore[attr-defined]
    with browser(1280, 760) as driver:
        driver.get(url)
        driver.save_screenshot(str(OUT / "dashboard-login.png"))
        driver.find_element(By.ID, "token").send_keys(TOKEN)
        driver.find_element(By.CSS_SELECTOR, "#login button").click()
        poll_for(lambda: driver.find_elements(By.CSS_SELECTOR, "header nav"), timeout=20)
        driver.execute_script("window.location.hash = arguments[0]", f"#/runs/{done_run}")
        poll_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".card .progress"), timeout=20)
        for i, flag in enumerate(flags):  # spans of different lengths on both lanes
            time.sleep(0.05 * (i % 4 + 1))
            c.write_buffer(flag, np.array([1, 0], dtype=np.uint8))  # type: ignore[attr-defined]
        c.wait(done_run, timeout=30)  # type: ignore[attr-defined]
        c.wait_run(int(c.submit([sub_task(fail, [], [7])], label="bad input")), timeout=30)  # type: ignore[attr-defined]
        held, held_flags = flag_tasks(c, 6)
        running = int(c.submit(held, label="training step 41"))  # type: ignore[attr-defined]
        c.write_buffer(held_flags[0], np.array([1, 0], dtype=np.uint8))  # type: ignore[attr-defined]
        poll_for(
            lambda: len(driver.find_elements(By.CSS_SELECTOR, "#gantt svg rect.span")) == 10,
            timeout=20,
        )
        time.sleep(1.2)  # one more poll: the finished state and the note
        driver.save_screenshot(str(OUT / "dashboard-run.png"))
        for view, ready in (
            ("#/overview", "#overview-cards .card"),
            ("#/workers", "tr.worker-row"),
            ("#/runs", f"tr.run-row[data-run-id='{running}']"),
            ("#/remote", "tr.remote-row"),
        ):
            driver.execute_script("window.location.hash = arguments[0]", view)
            poll_for(lambda ready=ready: driver.find_elements(By.CSS_SELECTOR, ready), timeout=20)
            time.sleep(1.2)
            driver.save_screenshot(str(OUT / f"dashboard-{view[2:]}.png"))
        for f in held_flags[1:]:
            c.write_buffer(f, np.array([1, 0], dtype=np.uint8))  # type: ignore[attr-defined]
        c.wait(running, timeout=30)  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
