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
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from typing import Final

__all__ = ["ENV_EXPERIMENTS", "EXPERIMENTS", "grpc_experiments", "prepare_grpc"]

#: The environment variable grpc core reads its experiments from.
ENV_EXPERIMENTS: Final = "GRPC_EXPERIMENTS"
#: What this process asks grpc core for when the user asked for nothing.
EXPERIMENTS: Final = "-event_engine_client,-event_engine_listener"

_lock = threading.Lock()
#: The value grpc core read at its import ("" = its defaults), once known.
_applied: str | None = None


def prepare_grpc() -> None:
    """Import grpc with :data:`EXPERIMENTS` unless the user set ``GRPC_EXPERIMENTS``
    (their value is used) or grpc is already imported (nothing can change then)."""
    global _applied
    with _lock:
        if "grpc" in sys.modules:
            return
        own = os.environ.get(ENV_EXPERIMENTS)
        if own is not None:
            importlib.import_module("grpc")  # reads the user's GRPC_EXPERIMENTS now

            _applied = own
            return
        os.environ[ENV_EXPERIMENTS] = EXPERIMENTS
        try:
            importlib.import_module("grpc")  # grpc core reads GRPC_EXPERIMENTS here
        finally:
            os.environ.pop(ENV_EXPERIMENTS, None)
        _applied = EXPERIMENTS


def grpc_experiments() -> str | None:
    """The ``GRPC_EXPERIMENTS`` grpc core read when :func:`prepare_grpc` imported it
    ("" or the user's value), or None when grpc was imported before it ran."""
    return _applied


prepare_grpc()
