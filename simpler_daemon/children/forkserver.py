"""The fork server: forks replacement children after the parent has threads.

Forking a threaded process can deadlock the child, so a daemon never forks
once its event loop, gRPC core or executors run. At ``init`` (still single
threaded) it forks this small server, which inherits the shared heap, every
mailbox, the doorbell and the callable snapshot. Later, a request names a
worker; the server forks a fresh child for that worker's mailbox and
replies with its pid::

    parent                      fork server (single thread)       replacement child
    spawn(kind, index) --req--> fork() ---------------------------> run the child loop
          <-----------pid------ reap exited children (WNOHANG)      on the same mailbox

The replacement is the server's child: the parent watches it through a
pidfd (no waitpid), the server reaps it. Requests and replies are fixed-size
records on a socketpair; a malformed request is answered with an error pid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import socket
import struct
from collections.abc import Callable
from typing import Any

from simpler_daemon.children.process import ChildProcess, fork_child
from simpler_daemon.errors import StartupError

_REQ = struct.Struct("<4sBi")  # magic, kind (0 sub, 1 chip, 2 nested L3), index
_REP = struct.Struct("<4si")  # magic, pid (negative errno on failure)
_MAGIC = b"SLFS"
KINDS = {"sub": 0, "chip": 1, "l3": 2}

Spawner = Callable[[Any], int]


class ForkServer:
    """Parent-side handle of the fork server process."""

    def __init__(self, contexts: dict[tuple[str, int], tuple[Any, Spawner]]) -> None:
        self._contexts = contexts
        self._sock: socket.socket | None = None
        self.process: ChildProcess | None = None

    def start(self) -> None:
        """Fork the server (the caller must still be single-threaded)."""
        parent_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        contexts = self._contexts

        def serve() -> int:
            parent_end.close()
            return _serve(server_end, contexts)

        try:
            self.process = fork_child(serve, "fork server")
        finally:
            server_end.close()
        self._sock = parent_end

    def spawn(self, kind: str, index: int, timeout: float = 10.0) -> int:
        """Ask for a fresh child for ``(kind, index)``; returns its pid.

        Raises ``StartupError`` when the server is gone, refuses, or does not answer.
        """
        sock = self._sock
        if sock is None or self.process is None or self.process.poll():
            raise StartupError(
                f"cannot replace {kind} worker {index}: the fork server is not running"
            )
        sock.settimeout(timeout)
        try:
            sock.send(_REQ.pack(_MAGIC, KINDS[kind], index))
            data = sock.recv(_REP.size)
        except OSError as exc:
            raise StartupError(f"cannot replace {kind} worker {index}: fork server: {exc}") from exc
        if len(data) != _REP.size:
            raise StartupError(
                f"cannot replace {kind} worker {index}: fork server closed the channel"
            )
        magic, pid = _REP.unpack(data)
        if magic != _MAGIC or pid <= 0:
            raise StartupError(
                f"cannot replace {kind} worker {index}: fork server refused ({os.strerror(-pid) if pid < 0 else pid})"
            )
        return int(pid)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()  # EOF: the server exits after reaping its children
            self._sock = None


def _serve(sock: socket.socket, contexts: dict[tuple[str, int], tuple[Any, Spawner]]) -> int:
    names = {v: k for k, v in KINDS.items()}
    children: set[int] = set()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    me = os.getpid()
    while True:
        _reap(children)
        if not poller.poll(200):
            continue
        try:
            data = sock.recv(_REQ.size)
        except OSError:
            data = b""
        if not data:
            break
        pid = -22  # EINVAL
        if len(data) == _REQ.size:
            magic, kind, index = _REQ.unpack(data)
            entry = contexts.get((names.get(kind, "?"), index))
            if magic == _MAGIC and entry is not None:
                ctx, target = entry
                fresh = dataclasses.replace(ctx, parent_pid=me)
                with contextlib.suppress(StartupError, OSError):
                    proc = fork_child(_bind_target(target, fresh), ctx.label)
                    proc.close()
                    children.add(proc.pid)
                    pid = proc.pid
        try:
            sock.send(_REP.pack(_MAGIC, pid))
        except OSError:
            break
    # Parent gone or closing: ask children to stop via their mailboxes is the parent's job;
    # here we only make sure none becomes an orphan zombie.
    for pid in list(children):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    while children:
        _reap(children, block=True)
    return 0


def _bind_target(target: Spawner, ctx: Any) -> Callable[[], int]:
    return lambda: target(ctx)


def _reap(children: set[int], block: bool = False) -> None:
    for pid in list(children):
        try:
            done, _ = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done == pid:
            children.discard(pid)
