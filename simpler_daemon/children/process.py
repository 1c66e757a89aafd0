"""Forking and supervising child processes.

Fork only while the process has one thread: a fork taken while another thread
holds a lock (gRPC core, a logging handler, the loop's executor) can deadlock
the child. ``fork_child`` refuses otherwise.

Each child gets its own process group (so a nested subtree dies together),
``PR_SET_PDEATHSIG`` (so it dies with its parent), ``faulthandler`` and a
pidfd in the parent (so a death is observed without polling).

A crashing child's ``faulthandler`` dump (the Python stack at the SIGSEGV) goes to a
memfd of its slot, not to the daemon's stderr (that may be a JSON stream): the
process that reaps the child reads it, logs it as one record and puts its gist into
the death message (``describe()``), which the task's error carries. The memfd is
made by the process that forks the slot first (the Worker, at ``init``); the fork
servers inherit it, so a replacement they fork writes where the Worker reads.

A channel whose far end must see EOF once this process closes its end (a fork
server's, ``parent_only``) is closed in every child forked here: otherwise a child of
a second Worker of the same process would hold the first Worker's ends open, and
that Worker's fork servers would never see it close (10 s, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import select
import signal
import sys
import sysconfig
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from simpler_daemon.errors import StartupError
from simpler_daemon.mailbox import _mailbox as _mb

log = logging.getLogger("simpler_daemon.children")

#: Memfds for faulthandler dumps, by (reaping process pid, child label): one per slot,
#: reused by its replacements. Keyed by the reaper so a nested L3 (which inherits this
#: table) makes its own for its own children.
_fault_files: dict[tuple[int, str], int] = {}
#: Bytes of a dump read back (a dump of every thread of a big process is a few KiB).
_FAULT_READ_MAX = 1 << 16


def _fault_file(reaper: int, label: str) -> int | None:
    """The memfd of slot ``label`` under ``reaper``; made on first use (None if memfds
    are unavailable: the child then dumps to stderr, as before)."""
    key = (reaper, label)
    fd = _fault_files.get(key)
    if fd is None:
        try:
            fd = os.memfd_create(f"simpler-fault {label}", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            return None
        _fault_files[key] = fd
    return fd


def _read_fault(label: str) -> str:
    """The faulthandler dump the last child of slot ``label`` left (reaper: us), or ""."""
    fd = _fault_files.get((os.getpid(), label))
    if fd is None:
        return ""
    try:
        data = os.pread(fd, _FAULT_READ_MAX, 0)
        os.ftruncate(fd, 0)  # read once: a later clean exit must not repeat it
    except OSError:
        return ""
    return data.replace(b"\0", b"").decode("utf-8", "replace").strip()


def fault_summary(dump: str) -> str:
    """The gist of a faulthandler dump: its first line and the innermost frame of the
    thread that crashed, plus the innermost frame outside the standard library when
    that is another (``Fatal Python error: Segmentation fault; at __init__.py:519 in
    string_at, from tasks.py:12 in crash``)."""
    lines = [line.strip() for line in dump.splitlines() if line.strip()]
    if not lines:
        return ""
    frames: list[tuple[str, str]] = []
    for line in lines[1:]:
        if line.startswith("File "):
            # 'File "/x/tasks.py", line 12 in crash' -> ('/x/tasks.py', '12 in crash')
            path, _, rest = line.removeprefix("File ").partition(", line ")
            frames.append((path.strip('"'), rest))
        elif frames:
            break  # the crashing thread comes first; stop at its end
    if not frames:
        return lines[0]
    stdlib = sysconfig.get_paths()["stdlib"]
    text = f"{lines[0]}; at {_frame_text(frames[0])}"
    own = next((f for f in frames if not f[0].startswith(stdlib)), None)
    if own is not None and own is not frames[0]:
        text += f", from {_frame_text(own)}"
    return text


def _frame_text(frame: tuple[str, str]) -> str:
    return f"{os.path.basename(frame[0])}:{frame[1]}"


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

    __slots__ = ("fault", "foreign", "label", "next_sample", "pid", "pidfd", "status", "watched")

    def __init__(self, pid: int, label: str, *, foreign: bool = False) -> None:
        self.pid = pid
        self.label = label
        #: Not our child (forked by the fork server): exit is seen through the
        #: pidfd, and the fork server reaps it.
        self.foreign = foreign
        self.status: int | None = None
        #: The faulthandler dump it left when it crashed ("" otherwise); set when reaped.
        self.fault = ""
        #: ``time.monotonic()`` before which ``sample`` does not poll (a caller on the
        #: hot path may test it first and skip the call).
        self.next_sample = 0.0
        #: A driver watches the pidfd (``Driver.watch``): reaping leaves it open, so its
        #: number cannot be reused (by a socket, another child's pidfd) while the watch
        #: still names it; ``unwatched`` closes it once the watch is gone.
        self.watched = False
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
                self._reaped_pidfd()
            return self.status is not None
        if self.status is None:
            try:
                if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                    return False
                kill_group(self.pid)
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.status = 0
                self._reaped_pidfd()
                return True
            if pid == self.pid:
                self.status = status
                self._reaped_pidfd()
                self._collect_fault()
        return self.status is not None

    def _collect_fault(self) -> None:
        """Take the dump a crash left in the slot's memfd: one log record with all of
        it, its gist in :meth:`describe`."""
        dump = _read_fault(self.label)
        if not dump:
            return
        self.fault = dump
        log.warning(
            "%s (pid %d) %s; faulthandler:\n%s",
            self.label,
            self.pid,
            describe_status(self.status or 0),
            dump,
            extra={"event": "child_crashed", "worker": self.label, "worker_pid": self.pid},
        )

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
        if now >= self.next_sample:
            self.next_sample = now + 0.010
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
        text = f"{self.label} (pid {self.pid}) {describe_status(self.status)}"
        summary = fault_summary(self.fault)
        return f"{text} ({summary})" if summary else text

    def _reaped_pidfd(self) -> None:
        if not self.watched:
            self._close_pidfd()

    def unwatched(self) -> None:
        """The driver no longer watches the pidfd: close it if the child was reaped."""
        self.watched = False
        if self.status is not None:
            self._close_pidfd()

    def _close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def close(self) -> None:
        """Close the pidfd (unwatch it first: see ``watched``)."""
        self.watched = False
        self._close_pidfd()


def kill_group(pgid: int) -> None:
    """SIGKILL process group ``pgid`` if anything is left in it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


#: This process's ends of channels no child may hold (``parent_only``).
_PARENT_ONLY: weakref.WeakSet[Any] = weakref.WeakSet()


def parent_only(sock: Any) -> None:
    """Close ``sock`` (this process's end of a channel) in every child forked from now
    on, by any Worker of this process: its peer sees EOF when this process closes it."""
    _PARENT_ONLY.add(sock)


def _close_parent_only() -> None:
    for sock in list(_PARENT_ONLY):
        with contextlib.suppress(OSError):
            sock.close()


#: Signals a child takes with their default action whatever the forking process set.
_DEFAULT_IN_CHILD = (signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

#: What a forked child's process title starts with: ``"<prefix>: <label>"``, as ``ps``
#: and ``top`` show it (``simpler-daemon: sub worker 0``). The programs name themselves
#: (:func:`set_title_prefix`); an in-process Worker's children say ``simpler``.
_title_prefix = "simpler"


def set_title_prefix(prefix: str) -> None:
    """Name this program in the titles of the children it forks from now on."""
    global _title_prefix
    _title_prefix = prefix


def set_process_title(title: str) -> None:
    """Set this process's title (``/proc/PID/cmdline``, ``ps``; ``comm`` gets its first
    15 bytes). Only the argv area is rewritten (``SPT_NOENV``): ``/proc/PID/environ``
    stays readable, and a title longer than the original command line is cut."""
    os.environ.setdefault("SPT_NOENV", "1")
    try:
        import setproctitle
    except ImportError:  # pragma: no cover - a dependency; the title is a convenience
        return
    setproctitle.setproctitle(title)


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
    fault_fd = _fault_file(parent, label)
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
            _close_parent_only()
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            # The daemon's own handlers (SIGHUP reloads, ...) are not the child's.
            for sig in _DEFAULT_IN_CHILD:
                signal.signal(sig, signal.SIG_DFL)
            with contextlib.suppress(Exception):
                set_process_title(f"{_title_prefix}: {label}")
            if fault_fd is None:
                faulthandler.enable()
            else:
                # Empty and rewound: the slot's previous child may have left a dump.
                os.ftruncate(fault_fd, 0)
                os.lseek(fault_fd, 0, os.SEEK_SET)
                faulthandler.enable(file=fault_fd)
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
