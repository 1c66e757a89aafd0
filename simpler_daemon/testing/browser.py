"""A headless Debian Chromium driven through Selenium, for the dashboard's browser tests
and docs/screenshots.py.

The system's ``/usr/bin/chromium`` and ``/usr/bin/chromedriver`` (Debian's
``chromium`` and ``chromium-driver``; ``make test`` installs them as root): Selenium is
given the driver's path, so it never looks for or downloads one. Each browser gets a
fresh profile directory, flags that keep it off the network (no updates, sync, QUIC or
background fetches), and is killed with every process it started when the block ends:
no browser outlives a test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from typing import Any, Final

__all__ = ["CHROMEDRIVER", "CHROMIUM", "browser", "missing_browser"]

CHROMIUM: Final = "/usr/bin/chromium"
CHROMEDRIVER: Final = "/usr/bin/chromedriver"
_FLAGS: Final = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--disable-extensions",
)


def missing_browser() -> str:
    """Why no browser test can run here ("" when one can)."""
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            return (
                f"no {path}: install Debian's {package} (`make test` does, as root: "
                "apt-get install -y chromium chromium-driver)"
            )
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed: pip install -e '.[test]'"
    return ""


def _profile_processes(profile: str) -> list[int]:
    """Pids whose command line names ``profile`` (this browser's own directory)."""
    out = []
    needle = profile.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle in f.read():
                    out.append(int(entry))
        except OSError:
            continue
    return out


@contextlib.contextmanager
def browser(width: int = 1280, height: int = 800) -> Iterator[Any]:
    """A Selenium ``webdriver.Chrome`` on the system's Chromium; everything it started is
    gone when the block ends (its profile directory too)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="simpler-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in _FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.add_argument(f"--window-size={width},{height}")
    driver = None
    try:
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
        driver.set_page_load_timeout(30)
        driver.set_script_timeout(30)
        yield driver
    finally:
        if driver is not None:
            with contextlib.suppress(Exception):
                driver.quit()
        deadline = time.monotonic() + 10.0
        while left := _profile_processes(profile):  # what quit() left (a crashed renderer)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise RuntimeError(f"browser processes {left} outlived SIGKILL for 10 s")
            time.sleep(0.05)
        shutil.rmtree(profile, ignore_errors=True)
