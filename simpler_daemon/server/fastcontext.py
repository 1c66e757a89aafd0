"""What the fast path's handlers see of their call (server/fastpath.py): the context
standing for a ``grpc.aio.ServicerContext``, its abort, and the answer a handler may
owe until a run ends (:class:`Deferred`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, NoReturn

import grpc

from simpler_daemon.protocol.metadata import CLIENT_ID_METADATA, FIELD_METADATA
from simpler_daemon.server.peers import PeerCredentials

__all__ = ["CODE_NUMBER", "Deferred", "FastAbort", "FastContext"]

#: A status code's number in a Reply or End frame.
CODE_NUMBER: Final[dict[grpc.StatusCode, int]] = {c: c.value[0] for c in grpc.StatusCode}


class FastAbort(grpc.aio.AbortError):  # type: ignore[misc]  # grpc is untyped
    """``context.abort`` on the fast path: a ``grpc.aio.AbortError`` (the decorators let
    it through as they do gRPC's) carrying the status for the reply frame."""

    def __init__(self, code: grpc.StatusCode, details: str, field: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.field = field


class FastContext:
    """What the servicer's handlers use of a ``grpc.aio.ServicerContext``, for one fast-path
    connection: its peer's credentials (read at accept) and the client's label."""

    __slots__ = ("_metadata", "identity", "peer_credentials")

    def __init__(self, creds: PeerCredentials) -> None:
        #: ``peers.identify`` names the caller from this, as the relay's credentials.
        self.peer_credentials = creds
        self._metadata: tuple[tuple[str, str], ...] = ()
        #: ``(policy, Identity)``: the caller as named under that AdminPolicy, kept for
        #: the connection (its credentials are the kernel's snapshot at connect).
        self.identity: tuple[Any, Any] | None = None

    def set_label(self, label: str) -> None:
        self._metadata = ((CLIENT_ID_METADATA, label),) if label else ()

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: tuple[tuple[str, str], ...] = (),
    ) -> NoReturn:
        field = ""
        for key, value in trailing_metadata or ():
            if key == FIELD_METADATA:
                field = str(value)
        raise FastAbort(code, details, field)

    def peer(self) -> str:
        creds = self.peer_credentials
        return f"fast:uid {creds.uid} pid {creds.pid}"

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}


class Deferred:
    """What a unary handler returns on the fast path for an answer owed later: when
    ``rec``'s run ends, or after ``timeout`` seconds (None: no limit), whichever is
    first. The connection then writes ``finish()``'s response from that very turn (the
    run's completion callback, or the timer), without a handler woken for it; when
    ``finish`` raises, ``refuse(exc)`` names the status: ``(code, details, field)``.
    Of ``rec`` the connection reads ``terminal``, ``when_finished`` and ``settle`` (a
    RunRecord's: a lone run of quick tasks may end inside that call)."""

    __slots__ = ("finish", "rec", "refuse", "timeout")

    def __init__(
        self,
        rec: Any,
        timeout: float | None,
        finish: Callable[[], Any],
        refuse: Callable[[Exception], tuple[grpc.StatusCode, str, str]],
    ) -> None:
        self.rec = rec
        self.timeout = timeout
        self.finish = finish
        self.refuse = refuse
