"""The one table from exception type to gRPC status code, and the texts clients see.

Handlers and the validation layer (``plan.py``, ``runs.py``) raise a
``RequestError`` subclass (``simpler_daemon.errors``) naming the offending field;
engine exceptions that reach a handler are mapped by :data:`STATUS_TABLE`::

    InvalidField("tasks[3].members[0].tensors[1].dtype", "...")  -> INVALID_ARGUMENT
    RegistrationError(code="NOT_REGISTERED")                        -> REGISTRATION_STATUS
    KeyError / MemoryError / TimeoutError ...                       -> STATUS_TABLE row
    anything else                                                   -> INTERNAL

Nothing here imports the servicer; it is the bottom of the server's layers.
"""

from __future__ import annotations

import re
from typing import Final

import grpc

from simpler_daemon.errors import (
    AccessDenied,
    InvalidField,
    LimitExceeded,
    PeerUnavailable,
    Precondition,
    RegistrationError,
    RequestError,
    Unimplemented,
    UnknownObject,
    WorkerClosedError,
    WorkerStateError,
)

__all__ = [
    "REGISTRATION_STATUS",
    "STATUS_TABLE",
    "at_field",
    "bound_text",
    "error_text",
    "status_of",
]

Code = grpc.StatusCode


#: The one table from exception type to status code; the first matching row wins.
STATUS_TABLE: Final[tuple[tuple[type[BaseException], grpc.StatusCode], ...]] = (
    (InvalidField, Code.INVALID_ARGUMENT),
    (UnknownObject, Code.NOT_FOUND),
    (AccessDenied, Code.PERMISSION_DENIED),
    (LimitExceeded, Code.RESOURCE_EXHAUSTED),
    (Precondition, Code.FAILED_PRECONDITION),
    (Unimplemented, Code.UNIMPLEMENTED),
    (PeerUnavailable, Code.UNAVAILABLE),
    (RegistrationError, Code.INVALID_ARGUMENT),  # refined by code below
    (WorkerClosedError, Code.FAILED_PRECONDITION),
    (WorkerStateError, Code.FAILED_PRECONDITION),  # a call the Worker's state forbids
    (MemoryError, Code.RESOURCE_EXHAUSTED),  # the shared heap is full
    (KeyError, Code.NOT_FOUND),  # heap lookups
    (LookupError, Code.NOT_FOUND),
    (PermissionError, Code.PERMISSION_DENIED),
    (TimeoutError, Code.DEADLINE_EXCEEDED),
    (NotImplementedError, Code.UNIMPLEMENTED),
    (ValueError, Code.INVALID_ARGUMENT),
    (TypeError, Code.INVALID_ARGUMENT),
)

#: RegistrationError codes (ARCHITECTURE section 9) that are not INVALID_ARGUMENT.
REGISTRATION_STATUS: Final[dict[str, grpc.StatusCode]] = {
    "HASHID_FORMAT_INVALID": Code.INVALID_ARGUMENT,
    "HASHID_DESCRIPTOR_MISMATCH": Code.FAILED_PRECONDITION,
    "NOT_REGISTERED": Code.NOT_FOUND,
    "LOCAL_SLOT_EXHAUSTED": Code.RESOURCE_EXHAUSTED,
    # Every target child failed to load it: the import path does not resolve there.
    "REGISTER_PARTIAL_FAILURE": Code.INVALID_ARGUMENT,
    # It failed on every target worker: the import path does not resolve anywhere.
    "REGISTER_FAILED": Code.INVALID_ARGUMENT,
    "REGISTER_CLEANUP_UNCERTAIN": Code.INTERNAL,
    "REGISTER_TOMBSTONE_ACTIVE": Code.FAILED_PRECONDITION,
    "UNREGISTER_TOMBSTONE_ACTIVE": Code.FAILED_PRECONDITION,
    "CONTROL_FAILED": Code.INTERNAL,
}


class _AtField(RequestError):
    """An engine exception re-expressed with the request field it concerns; keeps the
    status STATUS_TABLE gave the original."""

    def __init__(self, field: str, exc: BaseException) -> None:
        super().__init__(field, error_text(exc))
        self.code = status_of(exc)


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The status code for an exception (``INTERNAL`` when no row of STATUS_TABLE matches)."""
    if isinstance(exc, _AtField):
        return exc.code
    if isinstance(exc, RegistrationError):
        # A child whose callable slots are full reports it inside the broadcast's
        # failure: that is a resource running out, not a bad argument.
        if exc.code in ("REGISTER_PARTIAL_FAILURE", "REGISTER_FAILED") and any(
            "LOCAL_SLOT_EXHAUSTED" in why for why in exc.failures.values()
        ):
            return Code.RESOURCE_EXHAUSTED
        return REGISTRATION_STATUS.get(exc.code, Code.INVALID_ARGUMENT)
    for exc_type, code in STATUS_TABLE:
        if isinstance(exc, exc_type):
            return code
    return Code.INTERNAL


#: Longest run of non-blank characters (a path, a name, a value) an error text echoes whole.
MAX_ECHOED_CHARS: Final = 256
#: Longest error text (UTF-8 bytes) a client is sent: status details travel in gRPC
#: trailing metadata (percent-encoded, up to 3x), and a text past its size limit (8 KiB
#: by default) turns the refusal into a bare "Stream removed".
MAX_DETAILS_BYTES: Final = 2048
_LONG_WORD: Final = re.compile(rf"\S{{{MAX_ECHOED_CHARS + 1},}}")


def _shorten(match: re.Match[str]) -> str:
    word = match.group(0)
    # The space keeps the cut word at MAX_ECHOED_CHARS: bounding again changes nothing.
    return f"{word[:MAX_ECHOED_CHARS]} … ({len(word)} chars)"


def bound_text(text: str) -> str:
    """``text`` with every echoed value longer than MAX_ECHOED_CHARS cut to its start and
    `` … (N chars)``, and the whole at most about MAX_DETAILS_BYTES bytes of UTF-8.
    Idempotent: a bounded text is bounded already."""
    text = _LONG_WORD.sub(_shorten, text)
    data = text.encode(errors="replace")
    if len(data) > MAX_DETAILS_BYTES:
        head = data[: MAX_DETAILS_BYTES - 32].decode(errors="ignore")
        text = f"{head} … ({len(text)} chars)"
    return text


def error_text(exc: BaseException) -> str:
    """The message a client sees (a KeyError's bare argument, not its repr), bounded by
    :func:`bound_text`."""
    if isinstance(exc, KeyError) and exc.args:
        return bound_text(str(exc.args[0]))
    return bound_text(str(exc) or type(exc).__name__)


def at_field(field: str, exc: BaseException) -> RequestError:
    """Re-express an engine exception as a RequestError naming ``field`` (same status)."""
    if isinstance(exc, RequestError):
        return exc
    err = _AtField(field, exc)
    err.__cause__ = exc
    return err
