"""A fast-path connection that speaks frames by hand (protocol/fastwire.py), for tests
that send what the Python client never would: raw Calls, malformed or unwelcomed
frames, several calls in flight on one connection."""

from __future__ import annotations

import socket
from typing import Any

from simpler_daemon.protocol.fastwire import CLIENT_FRAMES, FrameDecoder, Reply, encode
from simpler_daemon.system.runtimedir import fast_socket_path
from tests.support.daemon_harness import DaemonProcess

__all__ = ["RawFast"]


class RawFast:
    """One connection to ``daemon``'s fast socket; ``hello``: the first frame to send
    (None: none, the test sends its own). Frames read ahead of the one asked for wait
    in order (``frame``) or by call id (``reply_to``)."""

    def __init__(self, daemon: DaemonProcess, hello: Any = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(fast_socket_path(daemon.socket))
        self.dec = FrameDecoder(CLIENT_FRAMES, 1 << 30)
        self.pending: list[Any] = []
        if hello is not None:
            self.send(hello)

    def send(self, *frames: Any) -> None:
        self.sock.sendall(b"".join(encode(f) for f in frames))

    def frame(self) -> Any:
        """The next frame from the daemon; fails when the daemon closed the connection."""
        while not self.pending:
            data = self.sock.recv(1 << 16)
            assert data, "the daemon closed the connection"
            self.pending += self.dec.feed(data)
        return self.pending.pop(0)

    def reply_to(self, call_id: int) -> Reply:
        """Call ``call_id``'s reply; the other frames read meanwhile stay pending."""
        while True:
            for i, frame in enumerate(self.pending):
                if getattr(frame, "id", None) == call_id:
                    del self.pending[i]
                    assert type(frame) is Reply, frame
                    return frame
            data = self.sock.recv(1 << 16)
            assert data, "the daemon closed the connection"
            self.pending += self.dec.feed(data)

    def closed_by_daemon(self) -> bool:
        try:
            return self.sock.recv(1 << 16) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()
