"""Who a client is, for the per-client limits: the kernel's word, never the client's.

gRPC's Python server tells a handler nothing about a Unix-socket peer
(``context.peer()`` is ``"unix:"`` for every client). So the daemon owns the
public socket itself and relays each connection to the gRPC server's private
socket, reading the peer's credentials (``SO_PEERCRED``) at accept::

    client --unix--> public socket (0660)  [UnixRelay: SO_PEERCRED -> pid, uid, gid]
                        |  one relayed connection per client connection, its local end
                        v  bound to the abstract name  "\\0simpler-daemon-<nonce>/<n>"
                     private socket (0600, only the daemon's user) --> gRPC server
                        context.peer() == "unix-abstract:simpler-daemon-<nonce>/<n>"
                                                   -> UnixRelay.credentials -> "uid 1000 pid 4242"

TCP clients are identified by their TLS client certificate when mutual TLS is on,
else by their address (without the port: a new connection is the same client).
The client's ``x-simpler-client`` header is only ever a display label.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import struct
from collections.abc import Callable
from typing import Any, Final, NamedTuple

__all__ = [
    "CLIENT_LABEL_KEY",
    "PeerCredentials",
    "UnixRelay",
    "client_identity",
    "client_label",
    "peer_credentials",
]

log = logging.getLogger("simpler_daemon.daemon")

_UCRED: Final = struct.Struct("3i")
#: The metadata a client names itself with: shown in logs, never counted by.
CLIENT_LABEL_KEY: Final = "x-simpler-client"
_MAX_LABEL: Final = 64
#: Bytes a relay direction buffers before it stops reading the other side.
_HIGH_WATER: Final = 4 << 20


class PeerCredentials(NamedTuple):
    pid: int
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"uid {self.uid} pid {self.pid}"


def peer_credentials(sock: Any) -> PeerCredentials:
    """``SO_PEERCRED`` of a connected Unix socket (the peer's at ``connect()``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCredentials(pid, uid, gid)


class _Side(asyncio.Protocol):
    """One end of a relayed connection; forwards what it reads to its partner."""

    def __init__(self) -> None:
        self.transport: Any = None  # uvloop's transports are not asyncio.Transport
        self.partner: _Side | None = None
        self.pending: list[bytes] = []  # read before the partner was connected
        self.closed = False
        self.on_gone: Callable[[], None] | None = None
        self.on_made: Callable[[_Side], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=_HIGH_WATER)  # type: ignore[attr-defined]
        if self.on_made is not None:
            self.on_made(self)

    def data_received(self, data: bytes) -> None:
        partner = self.partner
        if partner is None or partner.transport is None:
            self.pending.append(data)
            return
        partner.transport.write(data)

    def eof_received(self) -> bool | None:
        self.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.partner is not None:
            self.partner.close()
        if self.on_gone is not None:
            self.on_gone()

    def pause_writing(self) -> None:  # our buffer is full: stop reading the partner
        if self.partner is not None and self.partner.transport is not None:
            self.partner.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.partner is not None and self.partner.transport is not None:
            self.partner.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()  # flushes what is buffered first

    def join(self, partner: _Side) -> None:
        self.partner, partner.partner = partner, self
        for side in (self, partner):
            if side.pending and side.partner is not None and side.partner.transport is not None:
                for chunk in side.pending:
                    side.partner.transport.write(chunk)
                side.pending.clear()


class UnixRelay:
    """The public Unix socket: accepts clients, records their credentials and relays
    each connection to the gRPC server listening on ``private_path``."""

    def __init__(self, public_path: str, private_path: str) -> None:
        self.public_path = public_path
        self.private_path = private_path
        self._prefix = f"simpler-daemon-{secrets.token_hex(8)}/"
        self._next = 0
        self._peers: dict[str, PeerCredentials] = {}
        self._server: asyncio.AbstractServer | None = None
        self._sides: set[_Side] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Bind the public socket (mode 0600 until the caller chmods it) and serve."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # never world-accessible, not even for an instant
        try:
            sock.bind(self.public_path)
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot bind the Unix socket {self.public_path}: {exc}") from exc
        finally:
            os.umask(old_umask)
        sock.listen(128)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._accepted, sock=sock)

    def credentials(self, peer: str) -> PeerCredentials | None:
        """The credentials behind a gRPC peer string (None: not one of our relays)."""
        name = peer.removeprefix("unix-abstract:")
        return self._peers.get(name) if name.startswith(self._prefix) else None

    def _accepted(self) -> _Side:
        side = _Side()
        side.on_made = self._made
        self._sides.add(side)
        return side

    def _made(self, side: _Side) -> None:
        task = asyncio.get_running_loop().create_task(self._connect(side))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, down: _Side) -> None:
        """Open the private connection for ``down`` once its credentials are known."""
        transport = down.transport
        if transport is None or down.closed:
            return
        try:
            creds = peer_credentials(transport.get_extra_info("socket"))
        except OSError as exc:
            log.warning("refused a client on %s: no peer credentials: %s", self.public_path, exc)
            down.close()
            return
        self._next += 1
        name = f"{self._prefix}{self._next}"
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind("\0" + name)
            sock.setblocking(False)
            await loop.sock_connect(sock, self.private_path)
            self._peers[name] = creds
            _, up = await loop.create_unix_connection(_Side, sock=sock)
        except OSError as exc:
            sock.close()
            self._peers.pop(name, None)
            log.warning("cannot relay a client (%s): %s", creds, exc)
            down.close()
            return
        self._sides.add(up)
        down.join(up)

        def gone() -> None:  # both ends closed: the name may not identify anyone again
            if down.closed and up.closed:
                self._peers.pop(name, None)
                self._sides.discard(up)
                self._sides.discard(down)

        down.on_gone = up.on_gone = gone
        if down.closed or up.closed:
            up.close()
            down.close()
            gone()

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        """Stop accepting, close every relayed connection, remove the public socket."""
        self.stop_accepting()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for side in list(self._sides):
            side.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
        self._sides.clear()
        self._peers.clear()


def client_label(context: Any) -> str:
    """The label the client chose for itself ("" when none): for display only."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_LABEL_KEY:
            return str(value)[:_MAX_LABEL]
    return ""


def client_identity(context: Any, relay: UnixRelay | None) -> str:
    """The client a call comes from, as the kernel or the transport knows it."""
    peer = str(context.peer() or "")
    if peer.startswith("unix"):
        creds = relay.credentials(peer) if relay is not None else None
        return f"unix {creds}" if creds is not None else "unix (unidentified)"
    auth = context.auth_context() or {}
    cert = auth.get("x509_common_name") or auth.get("x509_subject_alternative_name")
    if cert:
        return "tls " + b",".join(cert).decode(errors="replace")
    host, sep, _port = peer.rpartition(":")
    return f"tcp {host if sep else peer}"
