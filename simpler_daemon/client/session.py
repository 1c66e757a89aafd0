"""A client's session with the daemon: the lease its registrations belong to.

``Client.register`` (without ``persist``) registers inside the client's session, so
the daemon releases those references when the client goes away: the session lives
while one long-lived KeepSession call does::

    client                                          daemon (server/sessions.py)
      | -- KeepSession: {session: <random id>} -->  |  lease granted
      | <- SessionLease{ttl_seconds} -------------  |
      | -- RegisterCallable{session: id} -------->  |  one reference per path
      | -- {} every ttl/3 (gRPC, see below) ----->  |  renewal
      | close() / connection lost / process dies    |  session ends: references released

Over gRPC the ``AsyncClient`` renews (``renew``: a task of its loop sends a request
every ttl/3, so a half-open connection ends the session within
``limits.session_ttl``), and so does the blocking ``Client`` over TCP (from grpc's
own thread consuming the request iterator). Over a Unix socket the blocking client
sends no renewals, which would take a thread (a process with threads cannot fork a
Worker): the kernel reports the end of a local connection, so the open call holds the
session. Over the local fast path the lease is a call left open on a connection of
its own, for the same reason needing no renewals. A session is opened on the first
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
from simpler_daemon.client.errors import DaemonError, FailedPrecondition, Unavailable
from simpler_daemon.client.fastpath import FastTransport
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

    def __init__(self, fast_socket: str | None = None) -> None:
        self.id = ""
        self._pid = 0
        self._release: Callable[[], None] | None = None
        self._lock = threading.Lock()
        #: Where a gRPC client over a Unix socket holds its session (no thread).
        self._fast_socket = fast_socket
        self._holder: Any = None

    def current(self, fast: Any, stub: Callable[[], Any], metadata: Any, tcp: bool) -> str:
        """The open session's id, opening it first when there is none (or it is the
        parent's, after a fork). ``fast``: the FastTransport (None: gRPC ``stub()``);
        ``tcp``: the gRPC target is ``host:port`` (the session is renewed)."""
        with self._lock:
            if self.id and self._pid == os.getpid():
                return self.id
            self._release = None  # a parent's lease is the parent's to end
            session = secrets.token_hex(16)
            first = pb.KeepSessionRequest(session=session, renew=tcp and fast is None)
            if fast is None and self._fast_socket is not None:
                if self._holder is None:
                    self._holder = FastTransport(self._fast_socket, "session")
                fast = self._holder
            try:
                if fast is not None:
                    _, self._release = fast.hold("KeepSession", first, OPEN_TIMEOUT)
                else:
                    self._release = self._open_grpc(stub(), first, metadata)
            except Unavailable:
                if fast is not self._holder or fast is None:
                    raise
                # The fast socket beside the target does not answer: hold it over gRPC.
                self._holder, self._fast_socket = None, None
                fast.close()
                self._release = self._open_grpc(stub(), first, metadata)
            self.id, self._pid = session, os.getpid()
            return session

    @staticmethod
    def _open_grpc(stub: Any, first: Any, metadata: Any) -> Callable[[], None]:
        if not first.renew:
            # One request: the call holds the session until it is cancelled or its
            # Unix connection ends (which the kernel reports; no renewals, which would
            # take a thread, and a process with threads cannot fork a Worker).
            call = stub.KeepSession(iter([first]), metadata=metadata)
            try:
                with mapped_errors():
                    next(call)
            except BaseException:
                call.cancel()
                raise
            return call.cancel  # type: ignore[no-any-return]
        # Over TCP a connection can hang half-open (the host vanished): renew, from
        # grpc's own thread consuming this request iterator.
        stop = threading.Event()
        ttl: list[float] = []

        def requests() -> Iterator[Any]:
            yield first
            while not stop.wait(_interval(ttl[0]) if ttl else _FIRST_RENEWAL):
                yield pb.KeepSessionRequest()

        renewing = stub.KeepSession(requests(), metadata=metadata)

        def release() -> None:
            stop.set()  # the requests end: the daemon ends the session now
            renewing.cancel()

        try:
            with mapped_errors():
                lease = next(renewing)
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

    def end(self, *, closing: bool = False) -> None:
        """End the session: its registrations are released (``closing``: for good,
        ``Client.close``)."""
        release, self._release = self._release, None
        self.id = ""
        if release is not None and self._pid == os.getpid():
            release()
        if closing and self._holder is not None:
            self._holder.close()
            self._holder = None


class AsyncSessionLease:
    """The session of an ``AsyncClient``."""

    def __init__(self) -> None:
        self.id = ""
        self._pid = 0
        self._release: Callable[[], None] | None = None
        self._opening: asyncio.Lock | None = None

    async def current(self, fast: Any, stub: Callable[[], Any], metadata: Any) -> str:
        """The open session's id, opening it first when there is none (or it is the
        parent's, after a fork: a child over the fast path opens its own)."""
        if self.id and self._pid == os.getpid():
            return self.id
        if self._pid != os.getpid():
            # A parent's lease (and the lock of its event loop) are the parent's.
            self.id, self._release, self._opening, self._pid = "", None, None, os.getpid()
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self.id:
                return self.id
            session = secrets.token_hex(16)
            first = pb.KeepSessionRequest(session=session, renew=fast is None)
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
