"""The chaos proxy against a frame echo server on loopback, and network-namespace test hosts."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from simpler_daemon.errors import ProtocolError
from simpler_daemon.remote.wire import (
    HEADER_SIZE,
    Control,
    ControlReply,
    Frame,
    FrameDecoder,
    FrameType,
    encode_frame,
)
from simpler_daemon.testing import poll_for
from simpler_daemon.testing.chaos_proxy import ChaosProxy
from simpler_daemon.testing.netns import TestHosts, netns_available, sweep_stale

pytestmark = pytest.mark.timeout(60)

SID = 77
WID = 2
ATTACH = b"A" * HEADER_SIZE  # stands in for the 40-byte attach record before the frames


@dataclass
class EchoServer:
    """Answers every CONTROL with a CONTROL_REPLY carrying the same sequence and body.

    Every connection's outcome lands in ``events``: ("frame", Frame),
    ("error", ProtocolError) or ("eof", None).
    """

    preamble: int = 0
    events: queue.Queue[tuple[str, object]] = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._closing = False
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        dec = FrameDecoder(session_id=SID, worker_id=WID)
        pre = self.preamble
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    dec.eof()
                    self.events.put(("eof", None))
                    return
                if pre:
                    assert data[:pre] == ATTACH[: min(pre, len(data))]
                    taken = min(pre, len(data))
                    pre -= taken
                    data = data[taken:]
                for frame in dec.feed(data):
                    self.events.put(("frame", frame))
                    if frame.type is FrameType.SHUTDOWN:
                        conn.shutdown(socket.SHUT_WR)
                    elif isinstance(frame.payload, Control):
                        reply = ControlReply(frame.payload.name, 1, 0, "", frame.payload.body)
                        conn.sendall(
                            encode_frame(FrameType.CONTROL_REPLY, SID, WID, frame.sequence, reply)
                        )
        except ProtocolError as exc:
            self.events.put(("error", exc))
        except OSError as exc:
            if not self._closing:
                self.events.put(("error", exc))
        finally:
            conn.close()

    def take(self, timeout: float = 5.0) -> tuple[str, object]:
        return self.events.get(timeout=timeout)

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        self.sock.close()
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in [self._acceptor, *self._threads]:
            t.join(5)
            assert not t.is_alive()


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


class Client:
    def __init__(self, addr: tuple[str, int], preamble: bytes = b"") -> None:
        self.sock = socket.create_connection(addr, timeout=5)
        self.dec = FrameDecoder(session_id=SID, worker_id=WID)
        if preamble:
            self.sock.sendall(preamble)

    def control(self, seq: int, body: bytes = b"") -> None:
        self.sock.sendall(
            encode_frame(FrameType.CONTROL, SID, WID, seq, Control(name="echo", body=body))
        )

    def read(self, n: int) -> list[Frame]:
        """Read until ``n`` frames or EOF; ProtocolError propagates."""
        out: list[Frame] = []
        while len(out) < n:
            data = self.sock.recv(65536)
            if not data:
                self.dec.eof()
                break
            out += self.dec.feed(data)
        return out

    def at_eof(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_pass_through_many_frames(echo: EchoServer) -> None:
    with ChaosProxy("127.0.0.1", echo.port) as proxy:
        assert proxy.address is not None
        with Client(proxy.address) as client:
            for seq in range(1, 51):
                client.control(seq, bytes([seq]) * seq * 100)
            replies = client.read(50)
            assert [f.sequence for f in replies] == list(range(1, 51))
            assert all(isinstance(f.payload, ControlReply) for f in replies)
            assert replies[9].payload.result == bytes([10]) * 1000  # type: ignore[union-attr]
            client.sock.shutdown(socket.SHUT_WR)
            assert client.at_eof()  # half-closes travel through the proxy
        assert proxy.frames == {"up": 50, "down": 50}
        poll_for(lambda: proxy.active_connections == 0, timeout=5, message="proxy kept the pair")
    kinds = [echo.take()[0] for _ in range(51)]
    assert kinds == ["frame"] * 50 + ["eof"]


def test_truncate_after_up(echo: EchoServer) -> None:
    with ChaosProxy("127.0.0.1", echo.port) as proxy:
        proxy.truncate_after(3, "up")
        assert proxy.address is not None
        with Client(proxy.address) as client:
            for seq in range(1, 4):
                client.control(seq, b"x" * 64)
                assert [f.sequence for f in client.read(1)] == [seq]
            client.control(4, b"x" * 64)
            client.control(5, b"x" * 64)
            assert client.read(1) == []  # half of frame 4 went up, then both sides closed
    events = [echo.take() for _ in range(4)]
    assert [k for k, _ in events[:3]] == ["frame"] * 3
    kind, err = events[3]
    assert kind == "error" and "truncated frame at EOF" in str(err)


def test_truncate_after_down(echo: EchoServer) -> None:
    with ChaosProxy("127.0.0.1", echo.port) as proxy:
        proxy.truncate_after(1, "down")
        assert proxy.address is not None
        with Client(proxy.address) as client:
            client.control(1)
            client.control(2)
            with pytest.raises(ProtocolError, match="truncated frame at EOF"):
                client.read(2)


@pytest.mark.parametrize("where", ["magic", "payload"])
def test_corrupt_frame(echo: EchoServer, where: str) -> None:
    with ChaosProxy("127.0.0.1", echo.port) as proxy:
        proxy.corrupt_frame(1, "down", where=where)  # type: ignore[arg-type]
        assert proxy.address is not None
        with Client(proxy.address) as client:
            client.control(1, b"body")
            assert [f.sequence for f in client.read(1)] == [1]
            client.control(2, b"body")
            expected = "bad magic" if where == "magic" else "cannot decode CONTROL_REPLY"
            with pytest.raises(ProtocolError, match=expected):
                client.read(1)


def test_corrupt_frame_without_payload_flips_flags(echo: EchoServer) -> None:
    with ChaosProxy("127.0.0.1", echo.port) as proxy:
        proxy.corrupt_frame(0, "up", where="payload")
        assert proxy.address is not None
        with Client(proxy.address) as client:
            client.sock.sendall(encode_frame(FrameType.SHUTDOWN, SID, WID, 1))
            assert client.read(1) == []
    kind, err = echo.take()
    assert kind == "error" and "unknown flag bits" in str(err)


def test_replay_frame(echo: EchoServer) -> None:
    with ChaosProxy("127.0.0.1", echo.port) as proxy:
        proxy.replay_frame(1, "up")
        assert proxy.address is not None
        with Client(proxy.address) as client:
            for seq in (1, 2, 3):
                client.control(seq)
            assert [f.sequence for f in client.read(4)] == [1, 2, 2, 3]
    seqs = []
    for _ in range(4):
        kind, frame = echo.take()
        assert kind == "frame" and isinstance(frame, Frame)
        seqs.append(frame.sequence)
    assert seqs == [1, 2, 2, 3]


def test_delay_holds_frames_in_order(echo: EchoServer) -> None:
    with ChaosProxy("127.0.0.1", echo.port) as proxy:
        proxy.delay(0.3, "down")
        assert proxy.address is not None
        with Client(proxy.address) as client:
            t0 = time.monotonic()
            for seq in range(1, 6):
                client.control(seq)
            replies = client.read(5)
            assert time.monotonic() - t0 >= 0.3
            assert [f.sequence for f in replies] == [1, 2, 3, 4, 5]
            proxy.pass_through()
            client.control(6)
            assert [f.sequence for f in client.read(1)] == [6]


@pytest.mark.parametrize("reset", [False, True])
def test_cut_closes_both_sides(echo: EchoServer, reset: bool) -> None:
    with ChaosProxy("127.0.0.1", echo.port) as proxy:
        assert proxy.address is not None
        with Client(proxy.address) as client:
            client.control(1)
            assert len(client.read(1)) == 1
            proxy.cut(reset=reset)
            assert client.at_eof()
            assert echo.take()[0] == "frame"
            assert echo.take()[0] in ("eof", "error")
        assert proxy.active_connections == 0
        with Client(proxy.address) as again:  # new connections are still served
            again.control(1)
            assert len(again.read(1)) == 1


def test_preamble_passes_through_uncounted() -> None:
    server = EchoServer(preamble=HEADER_SIZE)
    try:
        with ChaosProxy("127.0.0.1", server.port, preamble=(HEADER_SIZE, 0)) as proxy:
            proxy.corrupt_frame(0, "up")  # frame 0 is the first frame after the preamble
            assert proxy.address is not None
            with Client(proxy.address, preamble=ATTACH) as client:
                client.control(1)
                assert client.read(1) == []
        kind, err = server.take()
        assert kind == "error" and "bad magic" in str(err)
    finally:
        server.close()


def test_non_frame_stream_passes_through_raw(echo: EchoServer) -> None:
    # A handshake that is not made of frames is forwarded untouched.
    with ChaosProxy("127.0.0.1", echo.port) as proxy:
        proxy.corrupt_frame(0, "up")
        assert proxy.address is not None
        with Client(proxy.address) as client:
            client.sock.sendall(b"SLRW" + bytes(100))
            client.sock.shutdown(socket.SHUT_WR)
            assert client.at_eof()
    kind, err = echo.take()
    assert kind == "error" and "b'SLRW'" in str(err)  # the original bytes, not flipped ones


def test_unreachable_target_resets_the_client() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with ChaosProxy("127.0.0.1", port) as proxy:
        assert proxy.address is not None
        try:
            with Client(proxy.address) as client:
                assert client.at_eof()
        except ConnectionResetError:
            # The reset came before the client's connect() returned (a loaded machine
            # schedules the proxy's thread first): the same outcome as a reset read.
            pass
        assert proxy.errors and "cannot connect" in proxy.errors[0]


# --- network-namespace test hosts -------------------------------------------------------------

ECHO_SRC = """
import socket, sys
s = socket.create_server((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
while data := c.recv(4096):
    c.sendall(data)
"""


def _roundtrip(host: str, port: int, payload: bytes) -> bytes:
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while data := s.recv(4096):
            out += data
        return out


def _netns_names() -> list[str]:
    if shutil.which("ip") is None:
        return []
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


@pytest.mark.parametrize("use_netns", [None, False], ids=["auto", "loopback"])
def test_test_hosts_echo_in_each(use_netns: bool | None) -> None:
    prefix = f"slr3-{os.getpid()}-"
    with TestHosts(2, use_netns=use_netns) as hosts:
        procs = []
        for i in range(2):
            proc = hosts.run_in(
                i,
                [sys.executable, "-c", ECHO_SRC, hosts.address(i)],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(proc)
        for i, proc in enumerate(procs):
            assert proc.stdout is not None
            port = int(proc.stdout.readline())
            assert (
                _roundtrip(hosts.address(i), port, f"hello {i}".encode()) == f"hello {i}".encode()
            )
        for proc in procs:
            proc.wait(5)
            assert proc.stdout is not None
            proc.stdout.close()
        if hosts.namespaces:
            assert all(n.startswith(prefix) for n in hosts.namespaces)
            assert set(hosts.namespaces) <= set(_netns_names())
    assert not [n for n in _netns_names() if n.startswith(prefix)]


def test_test_hosts_teardown_on_exception_kills_children() -> None:
    prefix = f"slr3-{os.getpid()}-"
    with pytest.raises(RuntimeError, match="boom"), TestHosts(1) as hosts:
        proc = hosts.run_in(0, [sys.executable, "-c", "import time; time.sleep(60)"])
        raise RuntimeError("boom")
    assert proc.poll() is not None
    assert not [n for n in _netns_names() if n.startswith(prefix)]


def test_link_down_cuts_connections() -> None:
    if not netns_available():
        pytest.skip("link_down needs network namespaces (root and `ip netns`); loopback fallback")
    with TestHosts(1) as hosts:
        proc = hosts.run_in(
            0, [sys.executable, "-c", ECHO_SRC, hosts.address(0)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        sock = socket.create_connection((hosts.address(0), port), timeout=5)
        sock.sendall(b"ping")
        assert sock.recv(4) == b"ping"
        hosts.link_down(0)
        sock.settimeout(0.5)
        sock.sendall(b"lost")
        with pytest.raises(TimeoutError):
            sock.recv(4)  # nothing gets through while the link is down
        hosts.link_up(0)
        sock.settimeout(5)
        assert sock.recv(4) == b"lost"  # TCP retransmits once the link is back
        sock.close()
        proc.stdout.close()


def test_link_down_unsupported_without_namespaces() -> None:
    with TestHosts(1, use_netns=False) as hosts:
        assert hosts.address(0) == "127.77.0.2"
        with pytest.raises(NotImplementedError, match="link_down"):
            hosts.link_down(0)


def test_sweep_stale_leaves_live_namespaces() -> None:
    with TestHosts(1) as hosts:
        sweep_stale()
        assert set(hosts.namespaces) <= set(_netns_names())
