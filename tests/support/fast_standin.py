"""A daemon stand-in on a fast socket, for the client tests that must see the frames a
client sends (its Hello, Submit and Wait frames, its Cancels) or make the connection
fail in ways a real daemon does not on demand (closed with calls in flight, a stream
faster than its reader).

It serves one connection at a time, from one thread, in the order they come, and
answers like an empty daemon: a ``Call`` or ``Submit`` gets its method's empty response
message, a ``Wait`` gets a ``RunStatus`` naming its run; ``ReadBuffer`` streams ``items``
chunks of ``item_bytes`` bytes, then an End (``WatchRun``: an End at once); a call of a method in ``hold`` is never
answered. Every frame it receives is in ``frames``. With ``read=False`` it accepts a
connection and never reads from it (a daemon that stopped reading).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path
from typing import Any

from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.protocol.fastwire import (
    NATIVE_VERSION,
    SERVER_FRAMES,
    Call,
    End,
    FrameDecoder,
    Hello,
    Item,
    Reply,
    Submit,
    Wait,
    Welcome,
    encode,
)

__all__ = ["FastStandIn"]


class FastStandIn:
    """``welcome``: answer a Hello's ``upto`` as a version-2 daemon does. ``late_welcome``:
    hold that Welcome until the next frame arrives and send it just before that frame's
    answer, as a daemon does whose Welcome the client had not read yet when it sent its
    first call (without it, whether the first call goes out before the Welcome is read
    depends on the event loop's timing)."""

    def __init__(
        self,
        path: Path,
        *,
        welcome: bool = True,
        late_welcome: bool = False,
        hold: tuple[str, ...] = (),
        items: int = 0,
        item_bytes: int = 0,
        read: bool = True,
    ) -> None:
        self.path = str(path)
        self.frames: list[Any] = []
        self.connections = 0
        self.items_sent = 0
        self._welcome, self._hold = welcome, hold
        self._late_welcome = late_welcome
        self._welcome_held = False
        self._items, self._item_bytes = items, item_bytes
        self._read = read
        self._closing = threading.Event()
        self._conn: socket.socket | None = None
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(4)
        self._thread = threading.Thread(target=self._serve, name="fast-stand-in", daemon=True)
        self._thread.start()

    def kinds(self) -> list[type]:
        return [type(f) for f in list(self.frames)]

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            self._conn = conn
            self.connections += 1
            with conn, contextlib.suppress(OSError):
                if self._read:
                    self._connection(conn)
                else:
                    self._closing.wait()
            self._conn = None

    def _connection(self, conn: socket.socket) -> None:
        dec = FrameDecoder(SERVER_FRAMES, 1 << 26)
        while data := conn.recv(1 << 16):
            for frame in dec.feed(data):
                self.frames.append(frame)
                self._answer(conn, frame)

    def _answer(self, conn: socket.socket, frame: Any) -> None:
        kind = type(frame)
        if kind is Hello:
            if self._welcome and frame.upto >= NATIVE_VERSION:
                if self._late_welcome:
                    self._welcome_held = True
                else:
                    conn.sendall(encode(Welcome(NATIVE_VERSION)))
            return
        if self._welcome_held:
            self._welcome_held = False
            conn.sendall(encode(Welcome(NATIVE_VERSION)))
        if kind is Wait:
            if "WaitRun" not in self._hold:
                status = pb.RunStatus(run_id=frame.run_id).SerializeToString()
                conn.sendall(encode(Reply(frame.id, 0, "", "", status)))
            return
        if kind is Submit:
            if "SubmitRun" not in self._hold:
                conn.sendall(encode(Reply(frame.id, 0)))
            return
        if kind is not Call or frame.method in self._hold or frame.stream:
            return  # a held call; a client stream's Items, End or Cancel
        if frame.method == "ReadBuffer":
            chunk = pb.ReadBufferResponse(data=b"\x01" * self._item_bytes).SerializeToString()
            for _ in range(self._items):
                conn.sendall(encode(Item(frame.id, chunk)))
                self.items_sent += 1
            conn.sendall(encode(End(frame.id)))
            return
        if frame.method == "WatchRun":
            conn.sendall(encode(End(frame.id)))
            return
        conn.sendall(encode(Reply(frame.id, 0)))

    def drop(self) -> None:
        """Close the connection being served (a daemon gone with calls in flight)."""
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self.drop()
        self._thread.join(10)
        self._listener.close()
