"""simpler-daemon: pre-forked worker pools scheduled through shared-memory mailboxes."""

from simpler_daemon.args import CallConfig, Tag, TaskArgs
from simpler_daemon.callables import CallableHandle
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
)
from simpler_daemon.orchestrator import Orchestrator, RunState, TaskRef
from simpler_daemon.remote.spec import RemoteCallable, RemoteTensorRef, RemoteWorkerSpec
from simpler_daemon.worker import RunHandle, Worker, WorkerState

__version__ = "0.1.0"

__all__ = [
    "CallConfig",
    "CallableHandle",
    "ConfigError",
    "EndpointError",
    "Orchestrator",
    "ProtocolError",
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
]
