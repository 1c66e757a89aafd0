"""The fork server: forks replacement children after the parent has threads.

Forking a threaded process can deadlock the child, so a daemon never forks
once its event loop, gRPC core or executors run. At ``init`` (still single
threaded) it forks two of these small servers, a primary and a spare, which
inherit the shared heap, every mailbox, the doorbell and the callable
snapshot. Later, a request names a worker; the server forks a fresh child for
that worker's mailbox and replies with its pid::

    parent (Worker)             fork server (single thread)       replacement child
    spawn(kind, index) --req--> clone(CLONE_PARENT) --------------> run the child loop
          <-----------pid------                                    on the same mailbox

``CLONE_PARENT`` makes every process a server forks a child of the Worker,
not of the server: the Worker reaps it (so a death reports its real wait
status: ``killed by SIGKILL``, not a bare "exited"), and it does not die with
the server (its ``PR_SET_PDEATHSIG`` follows the Worker).

**Restarting a dead server.** The Worker may be multi-threaded by then, so it
never forks a server itself after ``init``. A server forks its own successor
instead: on a ``successor`` request it forks a copy of itself (again with
``CLONE_PARENT``) on a new socketpair and passes the Worker's end back with
``SCM_RIGHTS``. Two servers run, so when one dies the other is there to
replace it; only when both die at once is no server left, and then
replacements are refused (``ChildPool`` bounds the restarts and fails what
cannot be served). Requests and replies are fixed-size records on a
``SOCK_SEQPACKET`` socketpair; a malformed request is answered with an error pid.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import signal
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from simpler_daemon.children.process import ChildProcess, fork_child, parent_only, reap_all
from simpler_daemon.errors import StartupError

_REQ = struct.Struct("<4sBi")  # magic, kind (0 sub, 1 chip, 2 nested L3, 255 successor), index
_REP = struct.Struct("<4si")  # magic, pid (negative errno on failure)
_MAGIC = b"SLFS"
KINDS = {"sub": 0, "chip": 1, "l3": 2}
_SUCCESSOR = 255
#: Servers kept running: one serves, the other replaces it when it dies.
SERVERS = 2
#: At most this many servers are restarted within ``FORKSERVER_WINDOW_S`` seconds; a
#: crash loop beyond that stops restarting (and the Worker fails what needs one).
FORKSERVER_RESTARTS = 5
FORKSERVER_WINDOW_S = 60.0

Spawner = Callable[[Any], int]
Contexts = dict[tuple[str, int], tuple[Any, Spawner]]


class _Server:
    """One server process and the Worker's end of its channel."""

    __slots__ = ("proc", "sock")

    def __init__(self, proc: ChildProcess, sock: socket.socket) -> None:
        self.proc = proc
        self.sock = sock


class ForkServer:
    """Parent-side handle of the fork servers (a primary and a spare)."""

    def __init__(self, contexts: Contexts) -> None:
        self._contexts = contexts
        self._servers: list[_Server] = []
        self._all: list[ChildProcess] = []  # every server ever started, for the final reap
        self._restarted_at: deque[float] = deque()

    @property
    def process(self) -> ChildProcess | None:
        """The server that serves requests now (None when none is left)."""
        live = self._live()
        return live[0].proc if live else None

    @property
    def processes(self) -> list[ChildProcess]:
        """Every server process not yet seen dead."""
        return [s.proc for s in self._servers if not s.proc.exited]

    def start(self) -> None:
        """Fork the servers (the caller must still be single-threaded); on failure none
        is left running."""
        try:
            self._start()
        except BaseException:
            self.close(2.0)
            raise

    def _start(self) -> None:
        for _ in range(SERVERS):
            parent_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            # The Worker's ends (this one's and the other server's) are closed in every
            # child fork_child makes, this server included.
            parent_only(parent_end)
            try:
                proc = fork_child(
                    functools.partial(_serve, server_end, self._contexts), "fork server"
                )
            except BaseException:
                parent_end.close()
                raise
            finally:
                server_end.close()
            self._servers.append(_Server(proc, parent_end))
            self._all.append(proc)

    def _live(self) -> list[_Server]:
        # peek, not poll: the pool watches each server's pidfd and reaps it there
        return [s for s in self._servers if not s.proc.peek()]

    def spawn(self, kind: str, index: int, timeout: float = 10.0) -> int:
        """Ask for a fresh child for ``(kind, index)``; returns its pid (a child of
        this process).

        Raises ``StartupError`` naming the fork server when none is running, it
        refuses, or does not answer.
        """
        what = f"cannot replace {kind} worker {index}"
        last = "the fork server is not running"
        for server in self._live():
            try:
                data = _request(server.sock, _REQ.pack(_MAGIC, KINDS[kind], index), timeout)
            except OSError as exc:
                last = f"the fork server (pid {server.proc.pid}) did not answer: {exc}"
                self._drop(server)
                continue
            if len(data) != _REP.size:
                last = f"the fork server (pid {server.proc.pid}) closed the channel"
                self._drop(server)
                continue
            magic, pid = _REP.unpack(data)
            if magic != _MAGIC or pid <= 0:
                reason = os.strerror(-pid) if pid < 0 else str(pid)
                raise StartupError(f"{what}: the fork server refused ({reason})")
            return int(pid)
        raise StartupError(f"{what}: {last}")

    def replenish(self, timeout: float = 10.0) -> ChildProcess | None:
        """Have a live server fork a successor until ``SERVERS`` run; returns the new
        server's process, or None when enough run. Raises ``StartupError`` naming the
        fork server when none is left or it cannot fork."""
        live = self._live()
        if len(live) >= SERVERS:
            return None
        now = time.monotonic()
        while self._restarted_at and now - self._restarted_at[0] > FORKSERVER_WINDOW_S:
            self._restarted_at.popleft()
        if len(self._restarted_at) >= FORKSERVER_RESTARTS:
            raise StartupError(
                f"cannot restart the fork server: it was restarted {len(self._restarted_at)} "
                f"times within {FORKSERVER_WINDOW_S:.0f} s (a crash loop)"
            )
        for dead in [s for s in self._servers if s not in live]:
            dead.sock.close()
        self._servers = live
        last = "no fork server is left"
        for server in live:
            try:
                server.sock.settimeout(timeout)
                server.sock.send(_REQ.pack(_MAGIC, _SUCCESSOR, 0))
                data, fds, _flags, _addr = socket.recv_fds(server.sock, _REP.size, 1)
            except OSError as exc:
                last = f"the fork server (pid {server.proc.pid}) did not answer: {exc}"
                self._drop(server)
                continue
            channel = socket.socket(fileno=fds[0]) if fds else None
            if len(data) != _REP.size or channel is None:
                if channel is not None:
                    channel.close()
                last = f"the fork server (pid {server.proc.pid}) sent no successor"
                continue
            magic, pid = _REP.unpack(data)
            if magic != _MAGIC or pid <= 0:
                channel.close()
                last = f"the fork server (pid {server.proc.pid}) could not fork ({pid})"
                continue
            proc = ChildProcess(pid, "fork server")
            parent_only(channel)
            self._servers.append(_Server(proc, channel))
            self._all.append(proc)
            self._restarted_at.append(now)
            return proc
        raise StartupError(f"cannot restart the fork server: {last}")

    def _drop(self, server: _Server) -> None:
        """A server that failed a request is of no use: kill it (its death is observed
        and counted like any other)."""
        server.proc.signal_group(signal.SIGKILL)

    def close(self, timeout: float) -> list[str]:
        """EOF to every server: each exits at once (its children are the Worker's); reap
        them all within ``timeout``. Returns a message per server that had to be killed."""
        for server in self._servers:
            server.sock.close()
        self._servers = []
        msgs = reap_all(self._all, timeout)
        for proc in self._all:
            proc.close()
        return msgs


def _request(sock: socket.socket, data: bytes, timeout: float) -> bytes:
    sock.settimeout(timeout)
    sock.send(data)
    return sock.recv(_REP.size)


def _serve(sock: socket.socket, contexts: Contexts) -> int:
    names = {v: k for k, v in KINDS.items()}
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    while True:
        if not poller.poll(1000):
            continue
        try:
            data = sock.recv(_REQ.size)
        except OSError:
            data = b""
        if not data:
            return 0  # the Worker closed the channel (or died): nothing of ours to reap
        pid = -22  # EINVAL
        fds: list[int] = []
        successor: socket.socket | None = None
        if len(data) == _REQ.size:
            magic, kind, index = _REQ.unpack(data)
            if magic == _MAGIC and kind == _SUCCESSOR:
                pid, successor = _fork_successor(sock, contexts)
                if successor is not None:
                    fds = [successor.fileno()]
            else:
                entry = contexts.get((names.get(kind, "?"), index))
                if magic == _MAGIC and entry is not None:
                    ctx, target = entry
                    with contextlib.suppress(StartupError, OSError):
                        proc = fork_child(_bind_target(target, ctx, sock), ctx.label, sibling=True)
                        proc.close()
                        pid = proc.pid
        try:
            if fds:
                socket.send_fds(sock, [_REP.pack(_MAGIC, pid)], fds)
            else:
                sock.send(_REP.pack(_MAGIC, pid))
        except OSError:
            return 0
        finally:
            if successor is not None:
                successor.close()


def _fork_successor(sock: socket.socket, contexts: Contexts) -> tuple[int, socket.socket | None]:
    """Fork a copy of this server (a child of the Worker) on a new channel; returns its
    pid and the Worker's end of that channel (to pass on), or ``(-errno, None)``."""
    try:
        parent_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except OSError as exc:
        return -(exc.errno or 12), None

    def serve() -> int:
        sock.close()  # this server's channel belongs to this server only
        parent_end.close()
        return _serve(server_end, contexts)

    try:
        proc = fork_child(serve, "fork server", sibling=True)
    except (StartupError, OSError) as exc:
        parent_end.close()
        return -(getattr(exc, "errno", None) or 11), None
    finally:
        server_end.close()
    proc.close()
    return proc.pid, parent_end


def _bind_target(target: Spawner, ctx: Any, sock: socket.socket) -> Callable[[], int]:
    def run() -> int:
        sock.close()  # a replacement holding the server's channel would hide its death
        return target(ctx)

    return run
