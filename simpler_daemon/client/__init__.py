"""Python clients of the daemon's API: ``Client`` (blocking) and ``AsyncClient``.

::

    from simpler_daemon.client import Client, sub_task, tensor

    with Client() as c:                                   # the default socket
        add = c.register("simpler_daemon.examples.tasks:add")
        ...

The parts, one concept per module: ``clients.py`` (the calls of both clients),
``base.py`` (target, TLS, token, transport choice), ``fastpath.py`` and
``asyncfast.py`` (the local fast path's blocking and asyncio transports), ``requests.py`` (every request, built without a channel),
``results.py`` (what the calls return: ``RunResult``, ``RunFuture``...),
``errors.py`` (``DaemonError`` and one subclass per status code), ``heapview.py``
(same-host zero-copy views of heap buffers) and ``discovery.py`` (where the daemon's
socket is found when no target is given).

Importing this package loads no engine, scheduler, child or C extension module: a
client process needs only the vocabulary, ``protocol/`` and ``system/``.
"""

from simpler_daemon.client.asyncfast import AsyncFastTransport
from simpler_daemon.client.base import (
    CLIENT_ID_METADATA,
    DEFAULT_TIMEOUT,
    ENV_TARGET,
    ENV_TOKEN,
    default_target,
    mapped_errors,
)
from simpler_daemon.client.clients import AsyncClient, Client
from simpler_daemon.client.errors import (
    Cancelled,
    DaemonError,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    daemon_error,
)
from simpler_daemon.client.fastpath import ENV_TRANSPORT, TRANSPORTS, FastTransport
from simpler_daemon.client.requests import (
    TERMINAL_STATES,
    add_remote_request,
    alloc_request,
    array_bytes,
    call_config,
    call_deadline,
    cancel_request,
    check_wait,
    drain_request,
    list_runs_request,
    make_args,
    orchestration_request,
    raise_for_status,
    read_request,
    register_request,
    sub_task,
    submit_request,
    task,
    tensor,
    wait_request,
    write_chunk,
    write_requests,
)
from simpler_daemon.client.results import (
    AsyncRunFuture,
    CancelResult,
    DoneWatcher,
    RunFuture,
    RunPhase,
    RunResult,
    RunSummaryInfo,
    cancel_result,
    check_result,
    run_result,
    run_summary,
)
from simpler_daemon.client.retry import DEFAULT_RETRY, RetryPolicy

__all__ = [
    "CLIENT_ID_METADATA",
    "DEFAULT_RETRY",
    "DEFAULT_TIMEOUT",
    "ENV_TARGET",
    "ENV_TOKEN",
    "ENV_TRANSPORT",
    "TERMINAL_STATES",
    "TRANSPORTS",
    "AsyncClient",
    "AsyncFastTransport",
    "AsyncRunFuture",
    "CancelResult",
    "Cancelled",
    "Client",
    "DaemonError",
    "DeadlineExceeded",
    "DoneWatcher",
    "FailedPrecondition",
    "FastTransport",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "RetryPolicy",
    "RunFuture",
    "RunPhase",
    "RunResult",
    "RunSummaryInfo",
    "Unauthenticated",
    "Unavailable",
    "add_remote_request",
    "alloc_request",
    "array_bytes",
    "call_config",
    "call_deadline",
    "cancel_request",
    "cancel_result",
    "check_result",
    "check_wait",
    "daemon_error",
    "default_target",
    "drain_request",
    "list_runs_request",
    "make_args",
    "mapped_errors",
    "orchestration_request",
    "raise_for_status",
    "read_request",
    "register_request",
    "run_result",
    "run_summary",
    "sub_task",
    "submit_request",
    "task",
    "tensor",
    "wait_request",
    "write_chunk",
    "write_requests",
]
