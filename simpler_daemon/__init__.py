"""simpler-daemon: pre-forked worker pools scheduled through shared-memory mailboxes.

The public names below resolve on first use (PEP 562), so ``import simpler_daemon``
costs almost nothing and loads neither the engine nor grpc: a client process that
only imports ``simpler_daemon.client`` never pays for the Worker, the Scheduler or
the C extension. ``from simpler_daemon import Worker`` loads the engine then.

The package, one folder per layer or program (``docs/architecture.md`` has the map):
``errors``, ``args``, ``callables``, ``heap`` (the shared vocabulary); ``mailbox/``,
``children/``, ``endpoints/``, ``remote/``, ``scheduler/``, ``engine/`` (the in-process
engine, bottom up); ``protocol/`` and ``system/`` (what the programs share);
``server/``, ``remote_worker/``, ``client/``, ``cli/`` (the programs and the client);
``testing/`` and ``examples/``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simpler_daemon.args import CallConfig, Tag, TaskArgs
    from simpler_daemon.callables import CallableHandle
    from simpler_daemon.engine.orchestrator import Orchestrator, RunState, TaskRef
    from simpler_daemon.engine.worker import RunHandle, Worker, WorkerState
    from simpler_daemon.errors import (
        ConfigError,
        EndpointError,
        ProtocolError,
        RegistrationError,
        RunCancelled,
        SimplerError,
        StartupError,
        TaskError,
        WorkerClosedError,
        WorkerStateError,
    )
    from simpler_daemon.remote.spec import (
        ReconnectPolicy,
        RemoteCallable,
        RemoteTensorRef,
        RemoteWorkerSpec,
    )

#: Where each public name lives: ``name -> module``.
_PUBLIC: dict[str, str] = {
    "CallConfig": "simpler_daemon.args",
    "Tag": "simpler_daemon.args",
    "TaskArgs": "simpler_daemon.args",
    "CallableHandle": "simpler_daemon.callables",
    "ConfigError": "simpler_daemon.errors",
    "EndpointError": "simpler_daemon.errors",
    "ProtocolError": "simpler_daemon.errors",
    "RegistrationError": "simpler_daemon.errors",
    "RunCancelled": "simpler_daemon.errors",
    "SimplerError": "simpler_daemon.errors",
    "StartupError": "simpler_daemon.errors",
    "TaskError": "simpler_daemon.errors",
    "WorkerClosedError": "simpler_daemon.errors",
    "WorkerStateError": "simpler_daemon.errors",
    "Orchestrator": "simpler_daemon.engine.orchestrator",
    "RunState": "simpler_daemon.engine.orchestrator",
    "TaskRef": "simpler_daemon.engine.orchestrator",
    "ReconnectPolicy": "simpler_daemon.remote.spec",
    "RemoteCallable": "simpler_daemon.remote.spec",
    "RemoteTensorRef": "simpler_daemon.remote.spec",
    "RemoteWorkerSpec": "simpler_daemon.remote.spec",
    "RunHandle": "simpler_daemon.engine.worker",
    "Worker": "simpler_daemon.engine.worker",
    "WorkerState": "simpler_daemon.engine.worker",
}

__all__ = [
    "CallConfig",
    "CallableHandle",
    "ConfigError",
    "EndpointError",
    "Orchestrator",
    "ProtocolError",
    "ReconnectPolicy",
    "RegistrationError",
    "RemoteCallable",
    "RemoteTensorRef",
    "RemoteWorkerSpec",
    "RunCancelled",
    "RunHandle",
    "RunState",
    "SimplerError",
    "StartupError",
    "Tag",
    "TaskArgs",
    "TaskError",
    "TaskRef",
    "Worker",
    "WorkerClosedError",
    "WorkerState",
    "WorkerStateError",
    "__version__",
]


def _version() -> str:
    """The installed distribution's version: ``pyproject.toml`` is the one place it is set."""
    from importlib import metadata

    try:
        return metadata.version("simpler-daemon")
    except metadata.PackageNotFoundError:  # a source tree used without installing it
        return "0+unknown"


def __getattr__(name: str) -> Any:
    """Resolve a public name on first use and keep it (PEP 562)."""
    if name == "__version__":
        value: Any = _version()
    else:
        module = _PUBLIC.get(name)
        if module is None:
            raise AttributeError(f"module 'simpler_daemon' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
