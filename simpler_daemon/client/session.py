"""A client's session with the daemon: the lease its registrations belong to.

``Client.register`` (without ``persist``) registers inside the client's session, so
the daemon releases those references when the client goes away: the session lives
while one long-lived KeepSession call does::

    client                                          daemon (server/sessions.py)
      | -- KeepSession: {session: <random id>} -->  |  lease granted
      | <- SessionLease{ttl_seconds} -------------  |
      | -- RegisterCallable{session: id} -------->  |  one reference per path
      | -- {} every ttl/3 (gRPC only) ----------->  |  renewal
      | close() / connection lost / process dies    |  session ends: references released

Over gRPC the renewals are sent by grpc's own request-consuming thread (the
request iterator below waits between them); over the local fast path none are
needed (the daemon learns of a dead connection from the kernel), so the lease is a
call left open on a connection of its own. A session is opened on the first
registration, and anew when the daemon says it ended (``FailedPrecondition`` naming
the field ``session``: the connection was lost meanwhile) or after a fork.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Final

from simpler_daemon.client.base import mapped_errors
from simpler_daemon.client.errors import DaemonError, FailedPrecondition
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

__all__ = ["AsyncSessionLease", "SessionLease", "session_lost"]

#: Seconds to wait for the daemon to grant a session.
OPEN_TIMEOUT: Final = 30.0
#: Seconds between renewals before the daemon said its TTL.
_FIRST_RENEWAL: Final = 1.0


def session_lost(exc: DaemonError) -> bool:
    """Whether the daemon refused a call because the session it names ended."""
    return isinstance(exc, FailedPrecondition) and exc.field == "session"


def _interval(ttl: float) -> float:
    return ttl / 3 if ttl > 0 else 3600.0


class SessionLease:
    """The session of a blocking ``Client`` (see the module docstring)."""

    def __init__(self) -> None:
        self.id = ""
        self._pid = 0
        self._release: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def current(self, fast: Any, stub: Callable[[], Any], metadata: Any) -> str:
        """The open session's id, opening it first when there is none (or it is the
        parent's, after a fork). ``fast``: the FastTransport (None: gRPC ``stub()``)."""
        with self._lock:
            if self.id and self._pid == os.getpid():
                return self.id
            self._release = None  # a parent's lease is the parent's to end
            session = secrets.token_hex(16)
            first = pb.KeepSessionRequest(session=session)
            if fast is not None:
                _, self._release = fast.hold("KeepSession", first, OPEN_TIMEOUT)
            else:
                self._release = self._open_grpc(stub(), first, metadata)
            self.id, self._pid = session, os.getpid()
            return session

    @staticmethod
    def _open_grpc(stub: Any, first: Any, metadata: Any) -> Callable[[], None]:
        stop = threading.Event()
        ttl: list[float] = []

        def requests() -> Iterator[Any]:
            yield first
            while not stop.wait(_interval(ttl[0]) if ttl else _FIRST_RENEWAL):
                yield pb.KeepSessionRequest()

        call = stub.KeepSession(requests(), metadata=metadata)

        def release() -> None:
            stop.set()  # the request stream ends: the daemon ends the session now
            call.cancel()

        try:
            with mapped_errors():
                lease = next(call)
        except BaseException:
            release()
            raise
        ttl.append(lease.ttl_seconds)
        return release

    def lost(self, session: str) -> None:
        """The daemon says ``session`` ended: the next registration opens a new one."""
        with self._lock:
            if self.id == session:
                self.end()

    def end(self) -> None:
        """End the session (``Client.close``): its registrations are released."""
        release, self._release = self._release, None
        self.id = ""
        if release is not None and self._pid == os.getpid():
            release()


class AsyncSessionLease:
    """The session of an ``AsyncClient``."""

    def __init__(self) -> None:
        self.id = ""
        self._release: Callable[[], None] | None = None
        self._opening: asyncio.Lock | None = None

    async def current(self, fast: Any, stub: Callable[[], Any], metadata: Any) -> str:
        if self.id:
            return self.id
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self.id:
                return self.id
            session = secrets.token_hex(16)
            first = pb.KeepSessionRequest(session=session)
            if fast is not None:
                _, self._release = await fast.hold("KeepSession", first, OPEN_TIMEOUT)
            else:
                self._release = await self._open_grpc(stub(), first, metadata)
            self.id = session
            return session

    @staticmethod
    async def _open_grpc(stub: Any, first: Any, metadata: Any) -> Callable[[], None]:
        stop = asyncio.Event()
        ttl: list[float] = []

        async def requests() -> AsyncIterator[Any]:
            yield first
            while True:
                try:
                    await asyncio.wait_for(
                        stop.wait(), _interval(ttl[0]) if ttl else _FIRST_RENEWAL
                    )
                    return
                except TimeoutError:
                    yield pb.KeepSessionRequest()

        call = stub.KeepSession(requests(), metadata=metadata)

        def release() -> None:
            stop.set()
            call.cancel()

        try:
            with mapped_errors():
                async with asyncio.timeout(OPEN_TIMEOUT):
                    lease = await call.read()
        except BaseException:
            release()
            raise
        if lease is None or not hasattr(lease, "ttl_seconds"):  # grpc.aio.EOF
            release()
            raise ConnectionError("cannot open a session: the daemon ended the call")
        ttl.append(lease.ttl_seconds)
        return release

    def lost(self, session: str) -> None:
        if self.id == session:
            self.end()

    def end(self) -> None:
        release, self._release = self._release, None
        self.id = ""
        if release is not None:
            release()
