"""The dashboard in a real headless browser (Debian's Chromium through Selenium).

One module daemon with a metrics token and ``[dashboard] enabled``; each test opens a
fresh browser (simpler_daemon/testing/browser.py: no browser process outlives it). The
tests skip, saying why, where no Chromium, chromedriver or selenium is installed.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpler_daemon.client import sub_task, tensor
from simpler_daemon.testing.browser import browser, missing_browser
from tests.server.test_dashboard import TOKEN, free_port
from tests.support.daemon_harness import (
    EXAMPLES,
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    running_daemon,
    wait_until,
)
from tests.support.remote_worker import RemoteWorkerProcess

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(bool(missing_browser()), reason=missing_browser() or "browser present"),
]

#: A label that would run script if the page ever wrote it as HTML.
EVIL = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    secret = tmp_path_factory.mktemp("token") / "metrics-token"
    secret.write_text(TOKEN)
    secret.chmod(0o600)
    port = free_port()
    overrides = {
        "metrics": {"listen": f"127.0.0.1:{port}", "token_file": str(secret)},
        "dashboard": {"enabled": True},
    }
    for d in module_daemon(tmp_path_factory, "dashboard-browser", overrides):
        d.dashboard_url = f"http://127.0.0.1:{port}/"  # type: ignore[attr-defined]
        yield d


@pytest.fixture(autouse=True)
def no_leaked_children(daemon: DaemonProcess) -> Iterator[None]:
    yield from module_leak_guard(lambda: {daemon.pid})


def poll(check: Callable[[], Any], message: str, timeout: float = 20.0) -> Any:
    """The first truthy value of ``check()``; an element not drawn yet, or replaced by
    the view's next refresh, is looked for again."""
    from selenium.common.exceptions import (
        NoSuchElementException,
        StaleElementReferenceException,
    )

    def safe() -> Any:
        try:
            return check()
        except (NoSuchElementException, StaleElementReferenceException):
            return None

    return wait_until(safe, timeout=timeout, message=message)


def logged_in(driver: Any, daemon: DaemonProcess, view: str = "") -> None:
    """Open the dashboard, give the token in its login form, go to ``view``."""
    from selenium.webdriver.common.by import By

    driver.get(daemon.dashboard_url)  # type: ignore[attr-defined]
    driver.find_element(By.ID, "token").send_keys(TOKEN)
    driver.find_element(By.CSS_SELECTOR, "#login button").click()
    poll(lambda: driver.find_elements(By.CSS_SELECTOR, "header nav"), "the dashboard never loaded")
    if view:
        driver.execute_script("window.location.hash = arguments[0]", view)


def texts(driver: Any, css: str) -> list[str]:
    from selenium.webdriver.common.by import By

    return [e.text for e in driver.find_elements(By.CSS_SELECTOR, css)]


def test_token_is_required(daemon: DaemonProcess) -> None:
    from selenium.webdriver.common.by import By

    with browser() as driver:
        driver.get(daemon.dashboard_url)  # type: ignore[attr-defined]
        assert driver.find_element(By.ID, "login").is_displayed()
        assert not driver.find_elements(By.CSS_SELECTOR, "header nav")
        driver.find_element(By.ID, "token").send_keys("a-wrong-token-for-this-daemon")
        driver.find_element(By.CSS_SELECTOR, "#login button").click()
        poll(lambda: "Wrong token" in driver.find_element(By.ID, "login-error").text, "no refusal")
        assert (
            driver.execute_script("return sessionStorage.getItem('simpler-dashboard-token')")
            is None
        )
        assert "token" not in driver.current_url
        logged_in(driver, daemon)
        # Kept for the tab's session only: a reload opens the dashboard without the form.
        driver.refresh()
        poll(lambda: driver.find_elements(By.CSS_SELECTOR, "header nav"), "not kept on reload")
        assert TOKEN not in driver.current_url


def test_overview_and_workers_render(daemon: DaemonProcess) -> None:
    with browser() as driver:
        logged_in(driver, daemon, "#/overview")
        poll(lambda: "serving" in " ".join(texts(driver, "#overview-cards .card")), "no overview")
        cards = " ".join(texts(driver, "#overview-cards .card"))
        assert "level 3" in cards and "admission" in cards and "fair" in cards
        driver.execute_script("window.location.hash = '#/workers'")
        rows = poll(lambda: texts(driver, "tr.worker-row[data-kind=sub]"), "no worker rows")
        assert len(rows) == 2
        pids = {int(p) for p in daemon.worker_pids}
        shown = " ".join(rows)
        assert all(f"pid {pid}" in shown for pid in pids), (shown, pids)


def _flag_run(c: Any, n: int, label: str) -> tuple[int, list[int]]:
    wait = c.register(f"{EXAMPLES}:wait_for_flag")
    flags = [int(c.alloc_buffer((2,), "uint8").buffer_id) for _ in range(n)]
    tasks = [sub_task(wait, [tensor(f, "inout", (2,), "uint8")], [30_000]) for f in flags]
    return int(c.submit(tasks, label=label)), flags


def test_a_run_its_progress_and_its_gantt(daemon: DaemonProcess) -> None:
    from selenium.webdriver.common.by import By

    with daemon.client() as c, browser() as driver:
        run_id, flags = _flag_run(c, 3, EVIL)
        logged_in(driver, daemon, f"#/runs/{run_id}")
        bar = ".card .progress"

        def done() -> int:
            found = driver.find_elements(By.CSS_SELECTOR, bar)
            return int(found[0].get_attribute("data-done")) if found else -1

        poll(lambda: done() == 0, "the run view never showed its progress bar")
        assert driver.find_element(By.CSS_SELECTOR, bar).get_attribute("data-total") == "3"
        for i, flag in enumerate(flags):  # release one task at a time: the bar follows
            c.write_buffer(flag, np.array([1, 0], dtype=np.uint8))
            poll(lambda i=i: done() == i + 1, f"the bar never reached {i + 1} of 3")
        c.wait(run_id, timeout=20)
        spans = poll(
            lambda: len(driver.find_elements(By.CSS_SELECTOR, "#gantt svg rect.span")) == 3,
            "the Gantt chart never drew the three tasks",
        )
        assert spans
        lanes = texts(driver, "#gantt svg text")
        assert any(t.startswith("sub worker ") for t in lanes), lanes
        # The label is text, never markup: nothing it holds ran or became an element.
        assert driver.find_element(By.ID, "run-label").text == EVIL
        assert driver.execute_script("return window.__pwned") is None
        driver.execute_script("window.location.hash = '#/runs'")
        poll(lambda: EVIL in texts(driver, "td.label"), "the runs view never listed the run")
        assert not driver.find_elements(By.CSS_SELECTOR, "td.label img, td.label script")
        row = driver.find_element(By.CSS_SELECTOR, f"tr.run-row[data-run-id='{run_id}']")
        assert "completed" in row.text and "3 done / 3" in row.text
        assert driver.execute_script("return window.__pwned") is None
        for f in flags:
            c.free_buffer(f)


@pytest.mark.chaos
def test_a_killed_worker_shows_its_restart(daemon: DaemonProcess) -> None:
    from selenium.webdriver.common.by import By

    with daemon.client() as c:
        before = {w.worker_id: w for w in c.list_workers()}
    victim = before[0]
    with browser() as driver:
        logged_in(driver, daemon, "#/workers")
        css = "tr.worker-row[data-kind=sub][data-worker-id='0']"
        poll(
            lambda: f"pid {victim.pid}" in driver.find_element(By.CSS_SELECTOR, css).text, "no row"
        )
        os.kill(victim.pid, signal.SIGKILL)

        def restarted() -> bool:
            row = driver.find_element(By.CSS_SELECTOR, css)
            count = row.find_element(By.CSS_SELECTOR, "td.restarts").text
            where = row.find_element(By.CSS_SELECTOR, "td.where").text
            return count == str(victim.restarts + 1) and where != f"pid {victim.pid}"

        try:
            poll(restarted, "the workers view never showed the restart", timeout=40.0)
        except TimeoutError as exc:
            with daemon.client() as c:
                now = [(w.worker_id, w.pid, w.restarts, w.message) for w in c.list_workers()]
            shown = texts(driver, "tr.worker-row")
            raise AssertionError(f"{exc}: the page shows {shown}; ListWorkers says {now}") from exc
        cause = driver.find_element(By.CSS_SELECTOR, css + " td.cause").text
        assert "last restart:" in cause and "SIGKILL" in cause, cause
    with daemon.client() as c:
        daemon.worker_pids = [w.pid for w in c.list_workers() if w.pid]


def test_runs_filters_survive_the_refresh(daemon: DaemonProcess) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    with daemon.client() as c:
        fail = c.register(f"{EXAMPLES}:fail")
        empty = c.register(f"{EXAMPLES}:empty")
        bad = int(c.submit([sub_task(fail, [], [3])], label="filter: fails"))
        good = int(c.submit([sub_task(empty)], label="filter: works"))
        c.wait_run(bad, timeout=20)
        c.wait(good, timeout=20)
    with browser() as driver:
        logged_in(driver, daemon, "#/runs")
        poll(
            lambda: driver.find_elements(By.CSS_SELECTOR, f"tr.run-row[data-run-id='{good}']"),
            "no runs",
        )
        Select(driver.find_element(By.ID, "state-filter")).select_by_value("failed")
        poll(
            lambda: (
                driver.find_elements(By.CSS_SELECTOR, f"tr.run-row[data-run-id='{bad}']")
                and not driver.find_elements(By.CSS_SELECTOR, f"tr.run-row[data-run-id='{good}']")
            ),
            "the state filter did not apply",
        )
        states = {t for t in texts(driver, "tr.run-row td:nth-child(2)")}
        assert states == {"failed"}, states
        owner = driver.find_element(By.ID, "owner-filter")
        owner.send_keys("uid:42")
        stamp = driver.find_element(By.ID, "status-line").text
        poll(lambda: driver.find_element(By.ID, "status-line").text != stamp, "no refresh")
        # Half typed across a refresh: still there, and the filter applies once entered.
        assert driver.find_element(By.ID, "owner-filter").get_attribute("value") == "uid:42"
        driver.find_element(By.ID, "owner-filter").send_keys("4242", Keys.ENTER)
        poll(lambda: "no runs to show" in texts(driver, "p.note"), "the owner filter did not apply")


def test_remote_hosts_at_level_4(tmp_path: Path) -> None:
    """A level-4 daemon with a real simpler-remote-worker on loopback: the workers view
    shows its health, the remote hosts view its session."""
    from selenium.webdriver.common.by import By

    remote = RemoteWorkerProcess(tmp_path)
    try:
        port = free_port()
        overrides = {
            "daemon": {"level": 4},
            "workers": {
                "num_sub_workers": 1,
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
            "metrics": {"listen": f"127.0.0.1:{port}"},
            "dashboard": {"enabled": True},
        }
        with running_daemon(tmp_path / "l4", overrides), browser() as driver:
            driver.get(f"http://127.0.0.1:{port}/#/workers")
            row = "tr.worker-row[data-kind=remote_l3]"
            poll(lambda: driver.find_elements(By.CSS_SELECTOR, row), "no remote worker row")
            text = driver.find_element(By.CSS_SELECTOR, row).text
            assert remote.address in text and "health " in text and "reconnects" in text, text
            driver.execute_script("window.location.hash = '#/remote'")
            cells = poll(lambda: texts(driver, "tr.remote-row td"), "no remote hosts row")
            assert cells[1] == remote.address and cells[2] == "ready", cells
            assert int(cells[3]) > 0  # the session runner's pid on the remote host
    finally:
        remote.stop()
