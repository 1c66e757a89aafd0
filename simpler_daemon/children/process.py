"""Forking and supervising child processes.

Fork only while the process has one thread: a fork taken while another thread
holds a lock (gRPC core, a logging handler, the loop's executor) can deadlock
the child. ``fork_child`` refuses otherwise.

Each child gets its own process group (so a nested subtree dies together),
``PR_SET_PDEATHSIG`` (so it dies with its parent), ``faulthandler`` and a
pidfd in the parent (so a death is observed without polling).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

from simpler_daemon import _mailbox as _mb
from simpler_daemon.errors import StartupError

log = logging.getLogger("simpler_daemon.children")


def describe_status(status: int) -> str:
    """Readable wait status: 'exited with code 3', 'killed by SIGSEGV'."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    if os.WIFEXITED(status):
        return f"exited with code {os.WEXITSTATUS(status)}"
    return f"wait status {status}"


class ChildProcess:
    """A forked child as its parent sees it."""

    __slots__ = ("_next_sample", "foreign", "label", "pid", "pidfd", "status")

    def __init__(self, pid: int, label: str, *, foreign: bool = False) -> None:
        self.pid = pid
        self.label = label
        #: Not our child (forked by the fork server): exit is seen through the
        #: pidfd, and the fork server reaps it.
        self.foreign = foreign
        self.status: int | None = None
        self._next_sample = 0.0
        try:
            self.pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # pragma: no cover - kernels before 5.3
            self.pidfd = None

    @property
    def exited(self) -> bool:
        return self.status is not None

    def poll(self) -> bool:
        """Reap without blocking; True once the child has exited.

        Before reaping, whatever is left in the child's process group (a grandchild a
        task forked) is SIGKILLed: the unreaped zombie still holds the pid, so the
        group id cannot have been reused by then.
        """
        if self.status is None and self.foreign:
            fd = self.pidfd
            if fd is None or select.select([fd], [], [], 0)[0]:
                self.status = -1  # exited; its status belongs to the process that reaps it
                self._close_pidfd()
            return self.status is not None
        if self.status is None:
            try:
                if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                    return False
                kill_group(self.pid)
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.status = 0
                self._close_pidfd()
                return True
            if pid == self.pid:
                self.status = status
                self._close_pidfd()
        return self.status is not None

    def peek(self) -> bool:
        """True once the child has exited, without reaping it (its pidfd stays open,
        so a watcher of that fd still sees the exit)."""
        if self.status is not None:
            return True
        if self.foreign:
            fd = self.pidfd
            return fd is None or bool(select.select([fd], [], [], 0)[0])
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def sample(self, now: float) -> bool:
        """``poll`` at most every 10 ms (cheap enough for a progress round)."""
        if self.status is not None:
            return True
        if now >= self._next_sample:
            self._next_sample = now + 0.010
            return self.poll()
        return False

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while not self.poll():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.02)
        return True

    def signal_group(self, sig: int) -> None:
        """Signal the child's process group (the child and whatever its tasks forked)."""
        if self.status is not None:
            return
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def describe(self) -> str:
        if self.status is None:
            return f"{self.label} (pid {self.pid}) running"
        if self.status == -1:
            return f"{self.label} (pid {self.pid}) exited"
        return f"{self.label} (pid {self.pid}) {describe_status(self.status)}"

    def _close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def close(self) -> None:
        self._close_pidfd()


def kill_group(pgid: int) -> None:
    """SIGKILL process group ``pgid`` if anything is left in it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def fork_child(target: Callable[[], int], label: str, *, sibling: bool = False) -> ChildProcess:
    """Fork a child that runs ``target()`` and exits with its return code.

    ``sibling``: the new process is a child of this process's parent
    (``CLONE_PARENT``): the fork server starts replacements that way, so the
    Worker reaps them and they outlive the server. Its ``PR_SET_PDEATHSIG`` then
    follows the Worker. Raises ``StartupError`` when the process has more than one
    thread.
    """
    threads = threading.active_count()
    if threads != 1:
        names = ", ".join(t.name for t in threading.enumerate())
        raise StartupError(
            f"cannot fork {label}: the process runs {threads} threads ({names}); "
            "children must be forked before any thread starts"
        )
    parent = os.getppid() if sibling else os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = _mb.fork_sibling() if sibling else os.fork()
    if pid == 0:  # pragma: no cover - runs in the child; covered by integration tests
        code = 1
        try:
            os.setpgid(0, 0)
            _mb.set_pdeathsig(signal.SIGKILL)
            if os.getppid() != parent:
                os._exit(1)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            faulthandler.enable()
            code = target()
        except BaseException:
            with contextlib.suppress(BaseException):
                traceback.print_exc()
            code = 1
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    if not sibling:  # only a parent may set a child's group
        with contextlib.suppress(PermissionError, ProcessLookupError):
            os.setpgid(pid, pid)  # close the race with the child's own setpgid
    return ChildProcess(pid, label, foreign=sibling)


def reap_all(children: list[ChildProcess], timeout: float) -> list[str]:
    """Wait for every child under one shared deadline, then SIGKILL survivors.

    Returns a death message per child that had to be killed.
    """
    deadline = time.monotonic() + timeout
    delay = 0.0005
    pending = [c for c in children if not c.poll()]
    while pending and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
        pending = [c for c in pending if not c.poll()]
    killed = []
    for c in pending:
        c.signal_group(signal.SIGKILL)
    for c in pending:
        c.wait(5.0)
        killed.append(f"{c.label} (pid {c.pid}) did not exit in time and was killed")
        log.warning("%s did not exit within %.1fs; killed", c.label, timeout)
    return killed
