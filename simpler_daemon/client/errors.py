"""The client's errors: one ``DaemonError`` subclass per gRPC status code.

A call the daemon refuses (or cannot take: unreachable, deadline passed) raises the
subclass its status code picks, with ``field`` naming the offending request field
when the daemon named one. They subclass ``grpc.RpcError`` as well, which is why they
live with the client and not in :mod:`simpler_daemon.errors`: importing the package
(or the in-process engine) never loads grpc.
"""

from __future__ import annotations

import re
from typing import Any, Final

import grpc

from simpler_daemon.errors import SimplerError
from simpler_daemon.protocol.metadata import FIELD_METADATA, RETRY_AFTER_METADATA

__all__ = [
    "Cancelled",
    "DaemonError",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "daemon_error",
]


# The daemon's retry-after hint as its refusals end ("...; retry after 500 ms"): what the
# fast path carries (gRPC has the RETRY_AFTER_METADATA trailer too).
_RETRY_AFTER_TEXT: Final = re.compile(r"retry after (\d+) ms$")

# "tasks[3].members[0].tensors[1].dtype: ..." when the daemon sent no FIELD_METADATA.
_FIELD_PREFIX: Final = re.compile(
    r"^([a-z_][a-z0-9_]*(?:\[\d+\])*(?:\.[a-z_][a-z0-9_]*(?:\[\d+\])*)*): "
)


class DaemonError(SimplerError, grpc.RpcError):  # type: ignore[misc]  # grpc is untyped
    """The daemon refused a call, or could not be reached (``simpler_daemon.client``).

    Also a ``grpc.RpcError``: code written as ``except grpc.RpcError as e: e.code()``
    keeps working. ``field`` is the request field the daemon named
    (``tasks[3].members[0].tensors[1].dtype``) or None; ``status_name`` the status
    code's name (``"INVALID_ARGUMENT"``).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        field: str | None = None,
        trailing_metadata: tuple[tuple[str, str | bytes], ...] = (),
    ) -> None:
        super().__init__(details or code.name)
        self._code = code
        self._details = details
        self.field = field
        self._trailing = trailing_metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._trailing

    @property
    def status_name(self) -> str:
        return str(self._code.name)

    @property
    def retry_after(self) -> float | None:
        """Seconds the daemon suggests waiting before trying again, or None when it gave
        no hint. A RESOURCE_EXHAUSTED with a hint is a limit reached for now (a client's
        run queue, limits.per_client_queued_runs, or limits.max_concurrent_runs): the
        client libraries retry it; one without a hint (a request too large) is final."""
        for key, value in self._trailing:
            if key == RETRY_AFTER_METADATA:
                text = value.decode(errors="replace") if isinstance(value, bytes) else value
                if text.isdigit():
                    return int(text) / 1000.0
        match = _RETRY_AFTER_TEXT.search(self._details or "")
        return int(match.group(1)) / 1000.0 if match else None

    def __str__(self) -> str:
        return f"{self._code.name}: {self._details}" if self._details else self._code.name

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._code, self._details, self.field, self._trailing))


class InvalidArgument(DaemonError, ValueError):
    """INVALID_ARGUMENT: a malformed request field (``field`` names it)."""


class NotFound(DaemonError, LookupError):
    """NOT_FOUND: an unknown run, buffer, hashid or worker."""


class PermissionDenied(DaemonError, PermissionError):
    """PERMISSION_DENIED: another client's object, an admin call, a module not allowed."""


class ResourceExhausted(DaemonError):
    """RESOURCE_EXHAUSTED: a limit or quota (the message names the setting);
    :attr:`retry_after` is set when the daemon says a retry may succeed soon."""


class FailedPrecondition(DaemonError):
    """FAILED_PRECONDITION: the daemon's state forbids it (draining, stopping...)."""


class Unauthenticated(DaemonError):
    """UNAUTHENTICATED: a missing or wrong bearer token."""


class Unavailable(DaemonError, ConnectionError):
    """UNAVAILABLE: the daemon (or a peer it needs) cannot be reached."""


class DeadlineExceeded(DaemonError, TimeoutError):
    """DEADLINE_EXCEEDED: the call's deadline passed."""


class Cancelled(DaemonError):
    """CANCELLED: the call was cancelled (the channel closed)."""


class Internal(DaemonError):
    """INTERNAL: a daemon bug; the daemon log has the details."""


_BY_CODE: Final[dict[grpc.StatusCode, type[DaemonError]]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: Internal,
}


def daemon_error(error: grpc.RpcError) -> DaemonError:
    """The :class:`DaemonError` subclass for a failed gRPC call (its status code picks
    the class; ``field`` from the daemon's FIELD_METADATA trailer, else from a
    ``field: message`` details text). A DaemonError is returned as it is."""
    if isinstance(error, DaemonError):
        return error
    code = _call_part(error, "code", grpc.StatusCode.UNKNOWN)
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details = _call_part(error, "details", "") or ""
    trailing = tuple(_call_part(error, "trailing_metadata", ()) or ())
    field: str | None = None
    for key, value in trailing:
        if key == FIELD_METADATA:
            field = value.decode(errors="replace") if isinstance(value, bytes) else value
    if field is None and (match := _FIELD_PREFIX.match(str(details))):
        field = match.group(1)
    return _BY_CODE.get(code, DaemonError)(code, str(details), field or None, trailing)


def _call_part(error: grpc.RpcError, name: str, default: Any) -> Any:
    """``error.<name>()`` of a grpc Call error; ``default`` for a bare RpcError."""
    method = getattr(error, name, None)
    if method is None:
        return default
    try:
        return method()
    except Exception:  # a half-built call object: fall back rather than mask the error
        return default
