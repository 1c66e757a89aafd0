"""Every exception the package raises, rooted by who is at fault.

Messages read "cannot <do X>: <reason>" and name the worker, pid, hashid or
field involved. Builtins are mixed in where callers would naturally catch
them (a bad config is also a ``ValueError``).
"""

from __future__ import annotations

import re
from typing import Any, Final

import grpc


class SimplerError(Exception):
    """Root of every error raised by simpler-daemon."""


class ConfigError(SimplerError, ValueError):
    """A configuration value is missing, malformed or contradictory.

    ``key`` is the dotted path of the offending setting (``limits.max_tasks``).
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class StartupError(SimplerError, RuntimeError):
    """A worker tree could not be brought up; everything started was rolled back."""


class EndpointError(SimplerError, RuntimeError):
    """An endpoint is poisoned, stopping or refused a request."""


class ProtocolError(SimplerError):
    """Bytes on a mailbox or a wire violated the protocol; the channel is unusable."""


class RegistrationError(SimplerError, ValueError):
    """A callable could not be registered or unregistered.

    ``code`` is one of the section 9 codes (``HASHID_FORMAT_INVALID``,
    ``HASHID_DESCRIPTOR_MISMATCH``, ``LOCAL_SLOT_EXHAUSTED``,
    ``REGISTER_PARTIAL_FAILURE``, ``REGISTER_CLEANUP_UNCERTAIN``,
    ``REGISTER_TOMBSTONE_ACTIVE``, ``UNREGISTER_TOMBSTONE_ACTIVE``) or
    ``NOT_REGISTERED`` / ``CONTROL_FAILED`` for the remaining cases.
    """

    def __init__(self, code: str, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.failures: dict[int, str] = dict(failures or {})


class ControlError(SimplerError, RuntimeError):
    """A control request failed on the child; the endpoint stays healthy."""


class TaskError(SimplerError, RuntimeError):
    """A run failed. Carries the identity of the first failing task."""

    def __init__(
        self,
        message: str,
        *,
        run_id: int = 0,
        worker_id: int | None = None,
        hashid: str | None = None,
        dispatch_id: int | None = None,
        outcome: str = "TASK_FAILURE",
        remote_text: str = "",
        pid: int | None = None,
    ) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.worker_id = worker_id
        self.hashid = hashid
        self.dispatch_id = dispatch_id
        self.outcome = outcome
        self.remote_text = remote_text
        self.pid = pid

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_task_error, (str(self), self.__dict__))


def _rebuild_task_error(message: str, state: dict[str, Any]) -> TaskError:
    err = TaskError(message)
    err.__dict__.update(state)
    return err


class RunCancelled(TaskError):
    """The run was cancelled before it finished."""


class WorkerClosedError(SimplerError, RuntimeError):
    """The Worker (or daemon) is closed or closing and takes no more work."""


# --------------------------------------------------------------------------- daemon API

#: Trailing metadata key carrying the request field a daemon refusal names.
FIELD_METADATA: Final = "x-simpler-field"
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
    """RESOURCE_EXHAUSTED: a limit or quota (the message names the setting)."""


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
