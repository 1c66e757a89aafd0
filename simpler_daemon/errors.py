"""Every exception the package raises, rooted by who is at fault.

Messages read "cannot <do X>: <reason>" and name the worker, pid, hashid or
field involved. Builtins are mixed in where callers would naturally catch
them (a bad config is also a ``ValueError``).
"""

from __future__ import annotations

from typing import Any


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
    """A run failed. Carries the identity of the first failing task, and with
    ``CallConfig.max_retries`` how many ``attempts`` it had and one line per failed
    attempt (``attempt_causes``, the last one's included)."""

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
        attempts: int = 1,
        attempt_causes: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.attempt_causes = tuple(attempt_causes)
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


class WorkerStateError(SimplerError, RuntimeError):
    """A call the Worker's state does not allow (the caller called it at the wrong time).

    ``submit`` before ``init``, ``init`` twice, ``add_worker`` after ``init``, on a level-3
    Worker or with a child that is not NEW or already attached. The message names the
    state. A bad argument is a ``ValueError`` / ``TypeError`` instead.
    """


class WorkerClosedError(WorkerStateError):
    """The Worker (or daemon) is closed or closing and takes no more work."""


class RunClosedError(RunCancelled, WorkerClosedError):
    """A run the Worker's ``close()`` ended before it finished: the run's error, both a
    ``WorkerClosedError`` (what ended it) and a ``RunCancelled`` (its outcome)."""


class UntrustedPathError(SimplerError, PermissionError):
    """A path someone other than the daemon's user or root could have prepared
    (``system/localtrust.py`` decides)."""


class ManifestError(SimplerError, ValueError):
    """A remote session's manifest is malformed or breaks a rule; ``key`` is the dotted
    field (``manifest.callables[2].hashid``), ``None`` when the JSON itself is unreadable."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# --------------------------------------------------------------------------- requests
# A request the daemon refuses: the caller is at fault. Each subclass picks the gRPC
# status the daemon answers with (``server/status.py``); the client raises the
# matching ``simpler_daemon.client.errors`` class.


class RequestError(SimplerError):
    """A request the daemon refuses; the subclass picks the status (see STATUS_TABLE).

    ``field`` is the offending field path (``tasks[3].members[0].tensors[1].buffer_id``)
    or "" when the request as a whole is refused.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class InvalidField(RequestError):
    """A malformed field."""


class UnknownObject(RequestError):
    """An unknown run, buffer, hashid or worker."""


class AccessDenied(RequestError):
    """An import path outside ``callables.allowed_modules``, another client's run,
    buffer or registration, or an admin call from a client that is not an admin."""


class LimitExceeded(RequestError):
    """A configured size or count limit."""


class Precondition(RequestError):
    """The daemon's state forbids the request (draining, stopping, wrong callable role...)."""


class Unimplemented(RequestError):
    """A feature this build does not have."""


class PeerUnavailable(RequestError):
    """A peer the request needs cannot be reached (a remote worker that does not start)."""
