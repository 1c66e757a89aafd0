"""Protobuf's wire format, the two pieces both ends write by hand.

A message is its fields one after another; a length-delimited field (a string,
bytes, a sub-message) is its tag byte, the length as a varint, then the bytes. The
server writes a SubmitRunRequest's deterministic encoding from a Submit frame's
fields this way (``server/keys.py``: the idempotency key's fingerprint), and the
client the ``tasks`` field of a big SubmitRunRequest from each distinct Task's
encoding (``client/requests.py``), which protobuf then parses once.
"""

from __future__ import annotations

from typing import Final

__all__ = ["field", "varint"]

_SMALL: Final = [bytes((i,)) for i in range(0x80)]


def varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf varint: 7 bits a byte, low first."""
    if value < 0x80:
        return _SMALL[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(parts: list[bytes], tag: bytes, data: bytes) -> None:
    """Append the length-delimited field ``tag`` (its key byte) holding ``data``."""
    parts += (tag, varint(len(data)), data)
