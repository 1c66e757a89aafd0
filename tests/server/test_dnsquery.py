"""The discovery resolvers: the UDP A-record client against the test's DNS server
(answers, NXDOMAIN, SERVFAIL, a server that does not answer, nobody listening) and
getaddrinfo in the executor."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from simpler_daemon.server.dnsquery import (
    ResolveError,
    SystemResolver,
    UdpResolver,
    decode_answer,
    encode_query,
)
from tests.support.dns_server import DnsServer

pytestmark = pytest.mark.timeout(30)


def resolve(server: DnsServer, name: str, **kw: float) -> list[str]:
    return asyncio.run(UdpResolver("127.0.0.1", server.port, **kw).resolve(name))  # type: ignore[arg-type]


def test_udp_resolver_follows_the_answer() -> None:
    with DnsServer() as dns:
        dns.set("workers.test.local", ["10.0.0.3", "10.0.0.1", "10.0.0.3"])
        assert resolve(dns, "workers.test.local") == ["10.0.0.1", "10.0.0.3"]
        dns.set("workers.test.local", ["10.0.0.2"])
        assert resolve(dns, "Workers.Test.Local.") == ["10.0.0.2"]
        dns.set("workers.test.local", [])  # NOERROR without records: no workers now
        assert resolve(dns, "workers.test.local") == []


def test_udp_resolver_errors_say_what_failed() -> None:
    with DnsServer() as dns:
        with pytest.raises(ResolveError) as info:
            resolve(dns, "missing.test.local")
        assert info.value.no_such_name
        assert "NXDOMAIN" in str(info.value) and f"127.0.0.1:{dns.port}" in str(info.value)

        dns.set("w.test.local", ["10.0.0.1"])
        dns.mode = "servfail"
        with pytest.raises(ResolveError) as info:
            resolve(dns, "w.test.local")
        assert not info.value.no_such_name
        assert "SERVFAIL" in str(info.value)

        dns.mode = "silent"
        with pytest.raises(ResolveError) as info:
            resolve(dns, "w.test.local", timeout=0.2)
        assert "no reply within 0.2 s (2 tries)" in str(info.value), info.value
        assert not info.value.no_such_name


def test_udp_resolver_with_nobody_listening() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ResolveError) as info:
        asyncio.run(UdpResolver("127.0.0.1", port, timeout=0.5).resolve("w.test.local"))
    assert f"127.0.0.1:{port}" in str(info.value)


def test_decode_refuses_malformed_replies() -> None:
    query = encode_query(7, "w.local")
    with pytest.raises(ResolveError, match="shorter than a DNS header"):
        decode_answer(b"\0\7", 7, "w.local")
    with pytest.raises(ResolveError, match="does not answer our query"):
        decode_answer(query, 7, "w.local")  # the query itself: QR bit clear
    header = struct.pack("!HHHHHH", 7, 0x8180, 1, 1, 0, 0)
    truncated = header + query[12:] + struct.pack("!HHHIH", 0xC00C, 1, 1, 5, 4) + b"\1\2"
    with pytest.raises(ResolveError, match="runs past the end"):
        decode_answer(truncated, 7, "w.local")
    at = len(header + query[12:])  # an answer whose name points at itself
    loop = header + query[12:] + bytes([0xC0, at]) + b"\0" * 10
    with pytest.raises(ResolveError, match="pointers loop"):
        decode_answer(loop, 7, "w.local")


def test_system_resolver_uses_the_executor() -> None:
    assert asyncio.run(SystemResolver().resolve("localhost")) in (
        ["127.0.0.1"],
        ["127.0.0.1", "::1"],
        ["::1"],
    )
    with pytest.raises(ResolveError) as info:
        asyncio.run(SystemResolver().resolve("no-such-host.invalid"))
    assert "no-such-host.invalid" in str(info.value)
