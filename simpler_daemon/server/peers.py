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

Ownership and quotas key on :class:`Identity` ``.owner``: ``uid:<n>`` on the Unix
socket (every process of one user is one client), ``cert:<CN>`` under mutual TLS,
``token:admin`` for the admin token, else ``tcp:<host>``. :class:`AdminPolicy`
decides who is an admin (root, the daemon's uid, ``security.admin_uids``, members of
``security.admin_groups``, the holder of ``security.admin_token_file``).
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import hmac
import ipaddress
import logging
import os
import pwd
import secrets
import socket
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from simpler_daemon.protocol.metadata import CLIENT_ID_METADATA
from simpler_daemon.system.localtrust import bind_private_listener

__all__ = [
    "DAEMON_OWNER",
    "AdminPolicy",
    "Identity",
    "PeerCredentials",
    "UnixRelay",
    "client_label",
    "http_identity",
    "identify",
    "loopback_peer_uid",
    "peer_credentials",
]

log = logging.getLogger("simpler_daemon.daemon")

_UCRED: Final = struct.Struct("3i")
#: The metadata a client names itself with: shown in logs, never counted by.
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
        sock = bind_private_listener(self.public_path)
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
        if key == CLIENT_ID_METADATA:
            return str(value)[:_MAX_LABEL]
    return ""


# --------------------------------------------------------------------------- identities


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a call comes from: ownership and quotas key on ``owner``."""

    owner: str
    uid: int | None = None
    gid: int | None = None
    admin: bool = False

    def __str__(self) -> str:
        return f"{self.owner} (admin)" if self.admin else self.owner


#: The identity of objects the daemon made itself (preloaded callables): admins only.
DAEMON_OWNER: Final = "daemon"


class AdminPolicy:
    """Who is an admin: root, the daemon's own uid, ``admin_uids``, members of
    ``admin_groups`` (primary or supplementary, by the group database), and on TCP
    the holder of the admin token."""

    def __init__(
        self,
        *,
        admin_uids: Iterable[int] = (),
        admin_groups: Iterable[str] = (),
        admin_token: bytes = b"",
    ) -> None:
        self._uids = {0, os.getuid(), *admin_uids}
        self._gids: set[int] = set()
        self._members: set[str] = set()
        for name in admin_groups:
            try:
                entry = grp.getgrgid(int(name)) if name.isdigit() else grp.getgrnam(name)
            except (KeyError, OverflowError):
                if name.isdigit():  # a gid without a name still counts as a primary group
                    self._gids.add(int(name))
                    continue
                log.warning("security.admin_groups: no group named %r; ignored", name)
                continue
            self._gids.add(entry.gr_gid)
            self._members.update(entry.gr_mem)
        self._token = b"Bearer " + admin_token if admin_token else b""

    def is_admin_uid(self, uid: int, gid: int) -> bool:
        if uid in self._uids or gid in self._gids:
            return True
        if not self._gids:
            return False
        try:
            user = pwd.getpwuid(uid)
        except KeyError:
            return False
        return user.pw_gid in self._gids or user.pw_name in self._members

    def is_admin_token(self, authorization: bytes) -> bool:
        return bool(self._token) and hmac.compare_digest(authorization, self._token)


def _authorization(context: Any) -> bytes:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value.encode() if isinstance(value, str) else bytes(value)
    return b""


def identify(context: Any, relay: UnixRelay | None, policy: AdminPolicy) -> Identity:
    """The :class:`Identity` behind a call, as the kernel or the transport knows it."""
    creds = getattr(context, "peer_credentials", None)
    if isinstance(creds, PeerCredentials):  # the fast path (fastpath.py): SO_PEERCRED at accept
        return Identity(
            f"uid:{creds.uid}",
            uid=creds.uid,
            gid=creds.gid,
            admin=policy.is_admin_uid(creds.uid, creds.gid),
        )
    peer = str(context.peer() or "")
    if peer.startswith("unix"):
        creds = relay.credentials(peer) if relay is not None else None
        if creds is None:  # not through our relay: nobody we can name owns anything
            return Identity("unix:unidentified")
        return Identity(
            f"uid:{creds.uid}",
            uid=creds.uid,
            gid=creds.gid,
            admin=policy.is_admin_uid(creds.uid, creds.gid),
        )
    if policy.is_admin_token(_authorization(context)):
        return Identity("token:admin", admin=True)
    auth = context.auth_context() or {}
    cert = auth.get("x509_common_name") or auth.get("x509_subject_alternative_name")
    if cert:
        return Identity("cert:" + b",".join(cert).decode(errors="replace"))
    host, sep, _port = peer.rpartition(":")
    return Identity(f"tcp:{host if sep else peer}")


# --------------------------------------------------------------------------- TCP on loopback


def _kernel_hex(address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    """``address:port`` as ``/proc/net/tcp{,6}`` writes it: the address in the kernel's
    byte order, 32-bit word by word, in upper-case hex (``127.0.0.1:8080`` ->
    ``0100007F:1F90``)."""
    packed = address.packed
    words = b"".join(packed[i : i + 4][::-1] for i in range(0, len(packed), 4))
    return f"{words.hex().upper()}:{port:04X}"


def _forms(host: str, port: int) -> dict[str, str]:
    """How ``host:port`` appears in each of ``/proc/net/tcp`` and ``tcp6`` (an IPv4
    address also as IPv4-mapped IPv6, the form of an IPv6 socket's IPv4 peer)."""
    address = ipaddress.ip_address(host.partition("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if isinstance(address, ipaddress.IPv4Address):
        mapped = ipaddress.IPv6Address("::ffff:" + str(address))
        return {
            "/proc/net/tcp": _kernel_hex(address, port),
            "/proc/net/tcp6": _kernel_hex(mapped, port),
        }
    return {"/proc/net/tcp6": _kernel_hex(address, port)}


_NETLINK_SOCK_DIAG: Final = 4
_SOCK_DIAG_BY_FAMILY: Final = 20
_NLMSG_ERROR: Final = 2
_NLMSG_HEADER: Final = struct.Struct("=IHHII")
#: inet_diag_req_v2: family, protocol, ext, pad, states; then inet_diag_sockid:
#: sport, dport (network order: htons), src[16], dst[16], interface, cookie[2] (none).
_DIAG_REQUEST: Final = struct.Struct("=BBBxIHH16s16sIII")
_DIAG_UID_AT: Final = _NLMSG_HEADER.size + 4 + 48 + 12  # family..retrans, sockid, expires..wqueue


def _diag_uid(
    family: int, peer: bytes, peer_port: int, local: bytes, local_port: int
) -> int | None:
    """The uid of the TCP socket ``peer:peer_port`` -> ``local:local_port`` of ``family``,
    asked of the kernel by its exact address (sock_diag: one hash lookup, where reading
    ``/proc/net/tcp`` walks every socket); None when there is none."""
    request = _DIAG_REQUEST.pack(
        family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF, socket.htons(peer_port), socket.htons(local_port),
        peer.ljust(16, b"\0"), local.ljust(16, b"\0"), 0, 0xFFFFFFFF, 0xFFFFFFFF,
    )  # fmt: skip
    header = _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, 1, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(1.0)
        sock.send(header + request)
        answer = sock.recv(8192)
    if len(answer) < _NLMSG_HEADER.size:
        return None
    kind = _NLMSG_HEADER.unpack_from(answer)[1]
    if kind != _SOCK_DIAG_BY_FAMILY or len(answer) < _DIAG_UID_AT + 4:
        return None  # NLMSG_ERROR: no such socket
    return int(struct.unpack_from("=I", answer, _DIAG_UID_AT)[0])


def loopback_peer_uid(peer: tuple[str, int], local: tuple[str, int]) -> int | None:
    """The uid owning the client end of a TCP connection that came over loopback (the
    socket whose address is the peer's and whose peer is ``local``, our end), as the
    kernel's sock_diag tells it; None for a peer not on loopback or not found (it closed
    meanwhile). HTTP has no ``SO_PEERCRED``: this is how the dashboard names a local
    browser's user (an identd lookup, without a daemon). Where sock_diag is refused, the
    rows of ``/proc/net/tcp`` and ``tcp6`` are searched instead."""
    peer_ip = ipaddress.ip_address(peer[0].partition("%")[0])
    local_ip = ipaddress.ip_address(local[0].partition("%")[0])
    if isinstance(peer_ip, ipaddress.IPv6Address) and peer_ip.ipv4_mapped is not None:
        peer_ip = peer_ip.ipv4_mapped
    if isinstance(local_ip, ipaddress.IPv6Address) and local_ip.ipv4_mapped is not None:
        local_ip = local_ip.ipv4_mapped
    if not peer_ip.is_loopback or peer_ip.version != local_ip.version:
        return None
    # The client's socket: IPv4 (most), or IPv6 holding an IPv4-mapped address.
    tries = [(socket.AF_INET6, peer_ip.packed, local_ip.packed)]
    if isinstance(peer_ip, ipaddress.IPv4Address):
        mapped = b"\0" * 10 + b"\xff\xff"
        tries = [
            (socket.AF_INET, peer_ip.packed, local_ip.packed),
            (socket.AF_INET6, mapped + peer_ip.packed, mapped + local_ip.packed),
        ]
    try:
        for family, mine, ours in tries:
            uid = _diag_uid(family, mine, int(peer[1]), ours, int(local[1]))
            if uid is not None:
                return uid
        return None
    except OSError:
        return _proc_net_uid(peer, local)


def _proc_net_uid(peer: tuple[str, int], local: tuple[str, int]) -> int | None:
    """:func:`loopback_peer_uid` from ``/proc/net/tcp{,6}``, its rows matched as text."""
    ours, theirs = _forms(local[0], int(local[1])), _forms(peer[0], int(peer[1]))
    for name, mine in theirs.items():
        if name not in ours:
            continue
        try:
            with open(name, encoding="ascii") as f:
                text = f.read()
        except OSError:
            continue
        needle = f" {mine} {ours[name]} "
        at = text.find(needle)
        if at < 0:
            continue
        line = text[at : text.find("\n", at)].split()
        # local, remote, state, tx:rx, tr:when, retransmits, uid
        if len(line) >= 7 and line[6].isdigit():
            return int(line[6])
    return None


def http_identity(peer: tuple[str, int], local: tuple[str, int], policy: AdminPolicy) -> Identity:
    """Who an HTTP request (the dashboard) comes from, by the same rules as a gRPC call:
    a local user (``uid:<n>``, found through :func:`loopback_peer_uid`; an admin by
    ``policy``), else ``tcp:<host>`` like a TCP client without a certificate."""
    uid = loopback_peer_uid(peer, local)
    if uid is None:
        return Identity(f"tcp:{peer[0]}")
    try:
        gid = pwd.getpwuid(uid).pw_gid
    except KeyError:
        gid = -1
    return Identity(f"uid:{uid}", uid=uid, gid=gid, admin=policy.is_admin_uid(uid, gid))
