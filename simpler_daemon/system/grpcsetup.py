"""grpc core's process-wide I/O setting, applied before grpc is first imported.

grpcio 1.85 runs a channel's and a server's I/O on grpc core's EventEngine, whose own
threads poll the sockets and hand each event to the thread waiting on the completion
queue. With the ``event_engine_client`` and ``event_engine_listener`` experiments off,
grpc core uses its iomgr poller (epoll1), which the thread waiting for a call polls
itself instead of being handed each event. On a Unix socket, both sides set alike, a
bare unary echo took 0.67-0.78 times the EventEngine's round trip, with about 0.7 times
the CPU on each side (``python -m benchmarks.grpc_settings``, a busy 2-core machine).
The API and what a call does (deadlines, cancellation, streaming, TLS, grpc.aio) do not
depend on the poller, which was grpc core's only one before the EventEngine.

grpc core reads ``GRPC_EXPERIMENTS`` once, when its C extension is imported, so
:func:`prepare_grpc` must run before the process's first ``import grpc``: importing this
module runs it (client/base.py imports it before grpc), and the daemon calls it before
its gRPC server is built. It leaves a ``GRPC_EXPERIMENTS`` the user set
alone (``GRPC_EXPERIMENTS=event_engine_client,event_engine_listener`` keeps the
EventEngine), does nothing once grpc is imported (too late; :func:`grpc_experiments`
then says None), and restores the environment after the import, so that the
process's children inherit the user's environment unchanged.

The same import turns grpc core's fork support off (``GRPC_ENABLE_FORK_SUPPORT=0``, a
user's value wins). On iomgr's epoll1 poller that support is live: every ``fork()`` of a
process that has used grpc runs grpc's ``pthread_atfork`` handler, which stops grpc's
timer and thread-pool threads, waits for them and starts them again. A Worker forks its
children from a process that may hold a client channel, and there the handler
deadlocked ``fork()`` (1 in 2 runs of 15,000 forks, each after a call on a channel
then closed), and a test process crashed in a thread of no Python code while its
Worker forked. Off, a fork is a plain fork and
grpc's threads in the parent carry on. The price: a child forked after its parent
opened a channel or a server cannot use grpc (its calls wait forever); one forked
before, as the daemon's children are, can.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from typing import Final

__all__ = [
    "ENV_EXPERIMENTS",
    "ENV_FORK_SUPPORT",
    "EXPERIMENTS",
    "FORK_SUPPORT",
    "grpc_experiments",
    "grpc_fork_support",
    "prepare_grpc",
]

#: The environment variable grpc core reads its experiments from.
ENV_EXPERIMENTS: Final = "GRPC_EXPERIMENTS"
#: What this process asks grpc core for when the user asked for nothing.
EXPERIMENTS: Final = "-event_engine_client,-event_engine_listener"
#: The environment variable grpc core reads its fork support from.
ENV_FORK_SUPPORT: Final = "GRPC_ENABLE_FORK_SUPPORT"
#: Fork support off: no grpc handler runs inside this process's ``fork()``.
FORK_SUPPORT: Final = "0"

_lock = threading.Lock()
#: What grpc core read at its import, per variable, once known.
_applied: dict[str, str] | None = None


def prepare_grpc() -> None:
    """Import grpc with :data:`EXPERIMENTS` and :data:`FORK_SUPPORT`, each unless the user
    set its variable (their value is used), or do nothing when grpc is already imported
    (nothing can change then). The environment is as it was afterwards."""
    global _applied
    with _lock:
        if "grpc" in sys.modules:
            return
        ours = {ENV_EXPERIMENTS: EXPERIMENTS, ENV_FORK_SUPPORT: FORK_SUPPORT}
        applied = {name: os.environ.get(name, value) for name, value in ours.items()}
        added = [name for name in ours if name not in os.environ]
        os.environ.update({name: ours[name] for name in added})
        try:
            importlib.import_module("grpc")  # grpc core reads both variables here
        finally:
            for name in added:
                os.environ.pop(name, None)
        _applied = applied


def grpc_experiments() -> str | None:
    """The ``GRPC_EXPERIMENTS`` grpc core read when :func:`prepare_grpc` imported it
    (ours or the user's value), or None when grpc was imported before it ran."""
    return None if _applied is None else _applied[ENV_EXPERIMENTS]


def grpc_fork_support() -> str | None:
    """The ``GRPC_ENABLE_FORK_SUPPORT`` grpc core read when :func:`prepare_grpc` imported
    it (:data:`FORK_SUPPORT` or the user's value), or None when grpc was imported first."""
    return None if _applied is None else _applied[ENV_FORK_SUPPORT]


prepare_grpc()
