"""Test hosts in network namespaces, so remote tests use real, separate addresses.

::

    root namespace (test process, L4 parent)
      s3<pid>r<i>  10.77.<k>.1/24 ----veth----  s3<pid>n<i>  10.77.<k>.2/24
                                                namespace slr3-<pid>-<i> (lo up)
                                                processes started with run_in(i, ...)

Host ``i`` gets subnet ``10.77.<k>.0/24`` where ``k`` is the first subnet no
other live ``TestHosts`` holds (an ``flock`` per subnet under
:data:`LOCK_DIR`), so test processes running side by side never share a
route. Taking a link down (``link_down``) cuts every connection to the host
without closing a socket, the way a pulled cable does.

Without root (or where ``ip netns`` does not work) the hosts are loopback
aliases ``127.77.<i>.2`` in the current namespace: ``run_in`` runs the command
directly and ``link_down`` raises ``NotImplementedError``.

Teardown always runs (also on exceptions): processes started with ``run_in``
get SIGTERM, then SIGKILL; whatever else still lives in a namespace is
killed; then namespaces (which takes their veth pairs with them), stray veths
and subnet locks go. :func:`sweep_stale` removes what a killed test process
left behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from types import TracebackType
from typing import IO, Any, Final

__all__ = ["LOCK_DIR", "TestHosts", "netns_available", "sweep_stale"]

LOCK_DIR: Final = "/run/lock/simpler-slr3"
_NS_RE: Final = re.compile(r"^slr3-(\d+)-(\d+|probe)$")
_VETH_RE: Final = re.compile(r"^s3(\d+)[rn](\d+)$")
_IP_TIMEOUT: Final = 10.0


class _IpError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> str:
    res = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT, check=False
    )
    if check and res.returncode != 0:
        raise _IpError(f"`ip {' '.join(args)}` failed: {res.stderr.strip() or res.returncode}")
    return res.stdout


@functools.cache
def netns_available() -> bool:
    """True when this process can create network namespaces (root and a working ``ip``)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"slr3-{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except (_IpError, OSError, subprocess.TimeoutExpired):
        return False
    with contextlib.suppress(_IpError, OSError, subprocess.TimeoutExpired):
        _ip("netns", "del", probe)
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_list() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _kill_namespace_pids(ns: str, timeout: float) -> None:
    """SIGKILL everything left in ``ns`` and wait until it is gone (it is not our child)."""
    pids = [int(p) for p in _ip("netns", "pids", ns, check=False).split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _pid_alive(p) and not _is_zombie(p)]
        if pids:
            time.sleep(0.01)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def sweep_stale() -> list[str]:
    """Delete ``slr3-*`` namespaces and ``s3<pid>*`` veths whose creator pid is dead.

    Returns the names removed. Safe to call at any time; a no-op without namespaces.
    """
    if not netns_available():
        return []
    removed: list[str] = []
    for ns in _netns_list():
        m = _NS_RE.match(ns)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        _kill_namespace_pids(ns, timeout=5.0)
        with contextlib.suppress(_IpError):
            _ip("netns", "del", ns)
            removed.append(ns)
    for line in _ip("-o", "link", "show").splitlines():
        name = line.split(":", 2)[1].strip().split("@", 1)[0] if line.count(":") >= 2 else ""
        m = _VETH_RE.match(name)
        if m is not None and not _pid_alive(int(m.group(1))):
            with contextlib.suppress(_IpError):
                _ip("link", "del", name)
                removed.append(name)
    return removed


class TestHosts:
    """``n`` test hosts: network namespaces with a veth each, or loopback aliases.

    Use as a context manager; :meth:`close` always tears everything down.
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, n: int, *, use_netns: bool | None = None, term_timeout: float = 3.0):
        if n < 1:
            raise ValueError(f"cannot create test hosts: n must be >= 1, got {n}")
        self.n = n
        self.netns = netns_available() if use_netns is None else use_netns
        if self.netns and not netns_available():
            raise RuntimeError("cannot create test hosts: network namespaces are not available")
        self.term_timeout = term_timeout
        self.pid = os.getpid()
        self.namespaces: list[str] = []  # created so far (empty in the loopback fallback)
        self._subnets: list[int] = []
        self._locks: list[IO[bytes]] = []
        self._veths: list[str] = []
        self._procs: list[tuple[subprocess.Popen[Any], bool]] = []  # (process, own group)
        self._started = False
        self._closed = False

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Create the hosts; on any failure everything created so far is removed."""
        if self._started:
            raise RuntimeError("cannot start test hosts: already started")
        self._started = True
        if not self.netns:
            return
        try:
            sweep_stale()
            for i in range(self.n):
                self._create(i)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TestHosts:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Kill what was started, delete namespaces, veths and subnet locks. Idempotent."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        self._stop_procs()
        for ns in self.namespaces:
            try:
                _kill_namespace_pids(ns, timeout=5.0)
                _ip("netns", "del", ns)
            except (_IpError, OSError, subprocess.TimeoutExpired) as exc:
                errors.append(f"{ns}: {exc}")
        for veth in self._veths:
            # Normally gone with its namespace; a half-created pair may remain.
            if _ip("link", "show", veth, check=False):
                with contextlib.suppress(_IpError):
                    _ip("link", "del", veth)
        for lock in self._locks:
            lock.close()  # releases the flock; the file stays (unlinking would race a locker)
        self._locks.clear()
        if errors:
            raise RuntimeError(f"cannot tear down test hosts: {'; '.join(errors)}")

    # -- hosts --------------------------------------------------------------------------------

    def address(self, i: int) -> str:
        """The address processes on host ``i`` listen on and the parent connects to."""
        self._check_index(i)
        if not self.netns:
            return f"127.77.{i}.2"
        return f"10.77.{self._subnets[i]}.2"

    def gateway(self, i: int) -> str:
        """The root namespace's address as seen from host ``i``."""
        self._check_index(i)
        return f"10.77.{self._subnets[i]}.1" if self.netns else "127.0.0.1"

    def namespace(self, i: int) -> str | None:
        self._check_index(i)
        return self.namespaces[i] if self.netns else None

    def run_in(self, i: int, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on host ``i`` (``ip netns exec``; the pid is the command's own).

        The process gets its own session unless ``start_new_session`` is given, so
        teardown can signal its whole process group.
        """
        self._check_index(i)
        if self._closed or not self._started:
            raise RuntimeError(f"cannot run on test host {i}: hosts are not running")
        own_group = bool(popen_kwargs.setdefault("start_new_session", True))
        cmd = list(argv)
        if self.netns:
            cmd = ["ip", "netns", "exec", self.namespaces[i], *cmd]
        proc: subprocess.Popen[Any] = subprocess.Popen(cmd, **popen_kwargs)
        self._procs.append((proc, own_group))
        return proc

    def link_down(self, i: int) -> None:
        """Take host ``i``'s link down: packets stop, sockets stay open."""
        self._set_link(i, "down")

    def link_up(self, i: int) -> None:
        self._set_link(i, "up")

    # -- internals ----------------------------------------------------------------------------

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self.n:
            raise IndexError(f"cannot use test host {i}: there are {self.n} hosts")

    def _set_link(self, i: int, state: str) -> None:
        self._check_index(i)
        if not self.netns:
            raise NotImplementedError(
                f"cannot set link_{state} on test host {i}: the loopback fallback has no link "
                "to take down (needs root and `ip netns`)"
            )
        _ip("link", "set", self._veths[2 * i], state)

    def _create(self, i: int) -> None:
        subnet = self._take_subnet()
        ns = f"slr3-{self.pid}-{i}"
        root_side, ns_side = f"s3{self.pid}r{i}", f"s3{self.pid}n{i}"
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        self._veths += [root_side, ns_side]
        _ip("link", "add", root_side, "type", "veth", "peer", "name", ns_side, "netns", ns)
        _ip("addr", "add", f"10.77.{subnet}.1/24", "dev", root_side)
        _ip("link", "set", root_side, "up")
        _ip("-n", ns, "addr", "add", f"10.77.{subnet}.2/24", "dev", ns_side)
        _ip("-n", ns, "link", "set", ns_side, "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def _take_subnet(self) -> int:
        os.makedirs(LOCK_DIR, exist_ok=True)
        for k in range(256):
            if k in self._subnets:
                continue
            path = os.path.join(LOCK_DIR, f"subnet-{k}.lock")
            f = open(path, "ab")  # noqa: SIM115 -- held open (locked) for the hosts' lifetime
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            # A dead process's veth may still hold the subnet if it was not swept yet.
            if _ip("-4", "-o", "addr", "show", "to", f"10.77.{k}.0/24"):
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
                continue
            self._locks.append(f)
            self._subnets.append(k)
            return k
        raise RuntimeError("cannot create test host: all 256 subnets of 10.77.0.0/16 are in use")

    def _stop_procs(self) -> None:
        for proc, group in self._procs:
            if proc.poll() is None:
                self._signal(proc, group, signal.SIGTERM)
        deadline = time.monotonic() + self.term_timeout
        for proc, _ in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for proc, group in self._procs:
            # The group too: a process that exited may have left children behind.
            self._signal(proc, group, signal.SIGKILL)
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()

    @staticmethod
    def _signal(proc: subprocess.Popen[Any], group: bool, sig: signal.Signals) -> None:
        # A group id is not reused while any member lives, so killpg is safe after the
        # leader was reaped; a lone process is signalled only while unreaped (send_signal
        # checks returncode).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
