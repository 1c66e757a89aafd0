"""What every sans-IO frame decoder of a byte stream shares: the buffer, the first
defect that ends the stream, and error messages that say where in the stream.

Two wires use it: the remote L3 session's (``remote/wire.py``) and the local fast
path's (``fastwire.py``). A subclass parses its own header in :meth:`_feed`.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from simpler_daemon.errors import ProtocolError

__all__ = ["StreamDecoder"]

F = TypeVar("F")


class StreamDecoder(Generic[F]):
    """Feed arbitrary splits of a stream, get the frames they complete.

    The first defect raises ``ProtocolError`` and every later :meth:`feed` or
    :meth:`eof` re-raises it: frames decoded earlier in the failing chunk are
    dropped with the connection. A bug in a subclass's parsing ends the stream the
    same way (as a ``ProtocolError`` naming the frame), never with a stray exception.
    """

    __slots__ = ("_buf", "_consumed", "_failed", "_frames")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._consumed = 0  # stream offset of _buf[0], for error messages
        self._frames = 0  # frames decoded so far, for error messages
        self._failed: ProtocolError | None = None

    @property
    def failed(self) -> ProtocolError | None:
        return self._failed

    @property
    def buffered(self) -> int:
        """Bytes held back waiting for the rest of a frame."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[F]:
        """Add ``data`` and return every frame it completes, in order."""
        if self._failed is not None:
            raise self._failed
        return self._guarded(data)

    def _guarded(self, data: bytes | bytearray | memoryview) -> list[F]:
        try:
            return self._feed(data)
        except ProtocolError as exc:
            self._fail(exc)
            raise
        except Exception as exc:  # a codec bug must still end the connection cleanly
            err = ProtocolError(f"cannot decode frame {self._where()}: {exc!r}")
            self._fail(err)
            raise err from exc

    def eof(self) -> None:
        """Raise ``ProtocolError`` when the stream ended inside a frame."""
        if self._failed is not None:
            raise self._failed
        if self._buf:
            exc = ProtocolError(
                f"cannot decode frame {self._where()}: truncated frame at EOF "
                f"({len(self._buf)} bytes of an incomplete frame buffered)"
            )
            self._fail(exc)
            raise exc

    def _fail(self, exc: ProtocolError) -> None:
        self._failed = exc
        self._buf = bytearray()

    def _where(self) -> str:
        return f"{self._frames}{self._who()} (stream offset {self._consumed})"

    def _who(self) -> str:
        """Who sent the stream, for error messages (" from worker 3"); "" = unknown."""
        return ""

    def _feed(self, data: bytes | bytearray | memoryview) -> list[F]:
        """Parse ``data`` (after what is buffered) into frames; raise ``ProtocolError``."""
        raise NotImplementedError
