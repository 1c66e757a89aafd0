"""A tiny DNS server on 127.0.0.1 that the test controls (``[workers.discovery]`` tests).

``DnsServer`` answers UDP A queries for the names in ``records`` (NOERROR with one A
record per address; NXDOMAIN for any other name) on a thread of its own. The test
changes the answer with :meth:`set`, and makes the server fail with ``mode``:
``"answer"`` (normal), ``"servfail"`` (SERVFAIL to every query) or ``"silent"`` (no
reply: a resolver that is down). ``queries`` counts the queries seen.

Use it only where the test process does not fork afterwards (a daemon subprocess test):
the thread lives until :meth:`close`.
"""

from __future__ import annotations

import socket
import struct
import threading
from types import TracebackType

from simpler_daemon.server.dnsquery import read_name


class DnsServer:
    """See the module docstring."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port: int = self.sock.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.records: dict[str, list[str]] = {}
        self.mode = "answer"
        self.queries = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="test-dns", daemon=True)
        self._thread.start()

    def set(self, name: str, addresses: list[str]) -> None:
        """From now on ``name`` resolves to ``addresses`` (empty: no records, NOERROR)."""
        with self._lock:
            self.records[name.rstrip(".").lower()] = list(addresses)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.queries += 1
                mode = self.mode
                reply = self._reply(data) if mode != "silent" else None
            if reply is not None:
                try:
                    self.sock.sendto(reply, peer)
                except OSError:
                    pass

    def _reply(self, query: bytes) -> bytes | None:
        if len(query) < 12:
            return None
        qid, _flags, qd = struct.unpack_from("!HHH", query)
        if qd != 1:
            return None
        name, end = read_name(query, 12)
        question = query[12 : end + 4]
        if self.mode == "servfail":
            return struct.pack("!HHHHHH", qid, 0x8182, 1, 0, 0, 0) + question
        addresses = self.records.get(name.lower())
        if addresses is None:  # NXDOMAIN
            return struct.pack("!HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question
        answers = b"".join(
            struct.pack("!HHHIH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(ip) for ip in addresses
        )
        header = struct.pack("!HHHHHH", qid, 0x8180, 1, len(addresses), 0, 0)
        return header + question + answers

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()

    def __enter__(self) -> DnsServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
