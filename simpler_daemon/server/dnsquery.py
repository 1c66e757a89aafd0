"""Resolving ``[workers.discovery] dns`` without blocking the event loop.

::

    parse_dns_target("workers.ns.svc:19073") -> ("workers.ns.svc", 19073)
    parse_nameserver("10.96.0.10")           -> ("10.96.0.10", 53)
    SystemResolver().resolve(name)  getaddrinfo in the loop's executor (A and AAAA, the
                                    host's search domains and /etc/hosts apply)
    UdpResolver(ip, port).resolve(name)  one A query over UDP to that server, the name
                                    as written; the answer's A records (CNAMEs followed
                                    within the answer)

Both return the sorted, de-duplicated IP addresses, or raise ``ResolveError`` saying
what failed (no such name, server failure, timeout, a malformed reply). The UDP
client is small on purpose (RFC 1035 header, one question, answer records): it lets
the daemon ask a cluster DNS service, or a test's server, without a dependency.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import secrets
import socket
import struct
from typing import Final, Protocol

__all__ = [
    "ResolveError",
    "Resolver",
    "SystemResolver",
    "UdpResolver",
    "parse_dns_target",
    "parse_nameserver",
]

_LABEL: Final = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")
_TYPE_A: Final = 1
_TYPE_CNAME: Final = 5
_CLASS_IN: Final = 1
_NXDOMAIN: Final = 3
#: getaddrinfo's "the name has no address" (EAI_NODATA is missing on some platforms).
_NO_NAME: Final = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
_RCODES: Final = {
    1: "FORMERR (the server could not read the query)",
    2: "SERVFAIL (the server failed)",
    3: "NXDOMAIN (no such name)",
    4: "NOTIMP (the server does not do this query)",
    5: "REFUSED (the server refused the query)",
}


class ResolveError(Exception):
    """A resolution failed; the text says what and why. ``no_such_name``: the server
    answered that the name does not exist (NXDOMAIN, or getaddrinfo's EAI_NONAME /
    EAI_NODATA): the name has no addresses now (a headless Service without ready pods
    answers so), which is an answer, not an outage."""

    def __init__(self, message: str, *, no_such_name: bool = False) -> None:
        super().__init__(message)
        self.no_such_name = no_such_name


def parse_dns_target(text: str) -> tuple[str, int]:
    """Split ``"NAME:PORT"``; ``ValueError`` saying what is wrong (no port, a port out of
    1..65535, an empty or malformed name)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("expected 'NAME:PORT', e.g. 'workers.default.svc.cluster.local:19073'")
    name, sep, port_text = text.strip().rpartition(":")
    if not sep:
        raise ValueError(f"{text!r} has no port: expected 'NAME:PORT'")
    if not name:
        raise ValueError(f"{text!r} has no name before the port: expected 'NAME:PORT'")
    if not port_text.isdigit():
        raise ValueError(f"{text!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"{text!r}: port {port} is out of range 1-65535")
    check_name(name)
    return name, port


def check_name(name: str) -> None:
    """``ValueError`` unless ``name`` is a DNS name (labels of letters, digits, ``-`` and
    ``_``, at most 63 characters each and 253 in all) or an IPv4 address."""
    bare = name[:-1] if name.endswith(".") else name
    if ":" in bare or "[" in bare:
        raise ValueError(f"{name!r} is not a DNS name (IPv6 literals are not resolved)")
    if len(bare) > 253:
        raise ValueError(f"{name!r} is {len(bare)} characters long, a DNS name has at most 253")
    for label in bare.split("."):
        if not _LABEL.match(label):
            raise ValueError(
                f"{name!r} is not a DNS name: label {label!r} must be 1-63 letters, digits, "
                "'-' or '_', not starting or ending with '-'"
            )


def parse_nameserver(text: str) -> tuple[str, int]:
    """``"IP"`` (port 53) or ``"IP:PORT"`` (``"[v6]:PORT"``); ``ValueError`` otherwise."""
    text = text.strip()
    host, port_text = text, "53"
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]")
        port_text = port_text[1:] if port_text.startswith(":") else (port_text or "53")
        if not sep:
            raise ValueError(f"{text!r}: unbalanced brackets around the IPv6 address")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"{text!r} is not 'IP' or 'IP:PORT' (the nameserver is an address, not a name)"
        ) from None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{text!r}: the port must be an integer in 1..65535")
    return str(ip), int(port_text)


class Resolver(Protocol):
    """What the discovery loop asks: the addresses ``name`` has now."""

    description: str

    async def resolve(self, name: str) -> list[str]: ...


class SystemResolver:
    """``getaddrinfo`` in the running loop's executor (it blocks, the loop must not)."""

    description = "the system resolver (getaddrinfo)"

    async def resolve(self, name: str) -> list[str]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            missing = exc.errno in _NO_NAME
            raise ResolveError(
                f"cannot resolve {name!r}: {exc.strerror or exc}", no_such_name=missing
            ) from None
        except OSError as exc:
            raise ResolveError(f"cannot resolve {name!r}: {exc}") from None
        return _sorted_ips(str(info[4][0]) for info in infos)


class UdpResolver:
    """One A query per resolution to the DNS server at ``(host, port)`` over UDP."""

    def __init__(self, host: str, port: int, *, timeout: float = 2.0, tries: int = 2) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.tries = tries
        shown = f"[{host}]" if ":" in host else host
        self.description = f"the DNS server {shown}:{port}"

    async def resolve(self, name: str) -> list[str]:
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        last = "no reply"
        for _ in range(self.tries):
            query_id = secrets.randbelow(1 << 16)
            query = encode_query(query_id, name)
            reply: asyncio.Future[bytes] = loop.create_future()
            transport, _proto = await loop.create_datagram_endpoint(
                lambda r=reply, q=query_id: _Reply(r, q),  # type: ignore[misc]
                family=family,
                remote_addr=(self.host, self.port),
            )
            try:
                transport.sendto(query)
                data = await asyncio.wait_for(reply, self.timeout)
            except TimeoutError:
                last = f"no reply within {self.timeout:g} s"
                continue
            except OSError as exc:
                last = exc.strerror or str(exc)
                continue
            finally:
                transport.close()
            try:
                return decode_answer(data, query_id, name)
            except ResolveError as exc:
                raise ResolveError(
                    f"cannot resolve {name!r} at {self.description}: {exc}",
                    no_such_name=exc.no_such_name,
                ) from None
        raise ResolveError(
            f"cannot resolve {name!r} at {self.description}: {last} ({self.tries} tries)"
        )


class _Reply(asyncio.DatagramProtocol):
    """Takes the first datagram carrying our query id; a connection error fails it."""

    def __init__(self, fut: asyncio.Future[bytes], query_id: int) -> None:
        self.fut = fut
        self.query_id = query_id

    def datagram_received(self, data: bytes, addr: object) -> None:
        if not self.fut.done() and len(data) >= 2 and data[:2] == struct.pack("!H", self.query_id):
            self.fut.set_result(data)

    def error_received(self, exc: Exception) -> None:  # ICMP port unreachable: nobody there
        if not self.fut.done():
            self.fut.set_exception(exc)


def encode_name(name: str) -> bytes:
    out = bytearray()
    for label in name.rstrip(".").split("."):
        raw = label.encode("ascii")
        out += bytes([len(raw)]) + raw
    return bytes(out + b"\0")


def encode_query(query_id: int, name: str) -> bytes:
    """A standard query (recursion desired) for the A records of ``name``."""
    header = struct.pack("!HHHHHH", query_id, 0x0100, 1, 0, 0, 0)
    return header + encode_name(name) + struct.pack("!HH", _TYPE_A, _CLASS_IN)


def read_name(data: bytes, pos: int) -> tuple[str, int]:
    """The (possibly compressed) name at ``pos`` and the offset after it."""
    labels: list[str] = []
    end: int | None = None
    for _ in range(128):  # bounds a pointer loop
        if pos >= len(data):
            raise ResolveError("a name runs past the end of the reply")
        n = data[pos]
        if n & 0xC0 == 0xC0:
            if pos + 1 >= len(data):
                raise ResolveError("a compression pointer runs past the end of the reply")
            if end is None:
                end = pos + 2
            pos = ((n & 0x3F) << 8) | data[pos + 1]
            continue
        if n == 0:
            return ".".join(labels), (end if end is not None else pos + 1)
        labels.append(data[pos + 1 : pos + 1 + n].decode("ascii", "replace"))
        pos += 1 + n
    raise ResolveError("a name's compression pointers loop")


def decode_answer(data: bytes, query_id: int, name: str) -> list[str]:
    """The A addresses for ``name`` in reply ``data`` (following CNAMEs in the answer)."""
    if len(data) < 12:
        raise ResolveError(f"the reply is {len(data)} bytes, shorter than a DNS header")
    rid, flags, qd, an, _ns, _ar = struct.unpack_from("!HHHHHH", data)
    if rid != query_id or not flags & 0x8000:
        raise ResolveError("the reply does not answer our query")
    if flags & 0x0200:
        raise ResolveError("the reply is truncated (over 512 bytes; TCP is not supported)")
    rcode = flags & 0x000F
    if rcode:
        raise ResolveError(
            _RCODES.get(rcode, f"error code {rcode}"), no_such_name=rcode == _NXDOMAIN
        )
    pos = 12
    for _ in range(qd):
        _, pos = read_name(data, pos)
        pos += 4
    wanted = {name.rstrip(".").lower()}
    found: list[str] = []
    for _ in range(an):
        owner, pos = read_name(data, pos)
        if pos + 10 > len(data):
            raise ResolveError("an answer record runs past the end of the reply")
        rtype, rclass, _ttl, size = struct.unpack_from("!HHIH", data, pos)
        pos += 10
        rdata = data[pos : pos + size]
        if len(rdata) != size:
            raise ResolveError("an answer record's data runs past the end of the reply")
        if rclass == _CLASS_IN and owner.lower() in wanted:
            if rtype == _TYPE_A and size == 4:
                found.append(socket.inet_ntoa(rdata))
            elif rtype == _TYPE_CNAME:
                target, _ = read_name(data, pos)
                wanted.add(target.lower())
        pos += size
    return _sorted_ips(found)


def _sorted_ips(ips: object) -> list[str]:
    unique = {ipaddress.ip_address(ip) for ip in ips}  # type: ignore[attr-defined]
    return [str(ip) for ip in sorted(unique, key=lambda ip: (ip.version, ip))]
