"""What an idempotency key stands for: the fingerprint of the request it was first
sent with (a retry with the same key must send the same request).

A SubmitRun reaches the daemon as a protobuf message (gRPC, or a Call on the fast
path) or as the fast path's Submit frame (protocol version 2); a retry may come in
either form, so both get the same digest: that of the SubmitRunRequest, without the
fields that only say how to answer (``wait_seconds``, ``include_results``), in
protobuf's deterministic encoding. :func:`native_fingerprint` writes that encoding
from a Submit frame's fields without building the message.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Final

__all__ = ["fingerprint", "fingerprint_now", "native_fingerprint"]

#: Requests larger than this are fingerprinted on a thread (hashing megabytes stalls the loop).
_BIG_REQUEST: Final = 1 << 16


async def fingerprint(method: str, request: Any) -> bytes:
    """What an idempotency key stands for: a digest of the method and the request
    (the caller clears fields that only say how to answer, such as ``wait_seconds``);
    a big request's on a thread."""
    small = fingerprint_now(method, request)
    if small is not None:
        return small
    return await asyncio.to_thread(_digest, method, request)


def fingerprint_now(method: str, request: Any) -> bytes | None:
    """:func:`fingerprint` of a small request, computed here (None: a big one)."""
    if request.ByteSize() > _BIG_REQUEST:
        return None
    return _digest(method, request)


def native_fingerprint(method: str, key: str, tasks: list[Any], label: str, priority: int) -> bytes:
    """:func:`fingerprint` of the SubmitRunRequest with these fields (``tasks``: Task
    messages), without building it: its deterministic encoding is written here, field by
    field in number order as protobuf writes it (tests/server/test_fastwire_native.py
    checks that both agree), so a retry's key matches whichever form it came in."""
    out = bytearray()
    if key:
        _field(out, 0x0A, key.encode())
    for task in tasks:
        _field(out, 0x12, task.SerializeToString(deterministic=True))
    if label:
        _field(out, 0x1A, label.encode())
    if priority:
        out.append(0x28)
        _varint(out, priority)
    h = hashlib.sha256(method.encode())
    h.update(out)
    return h.digest()


def _field(out: bytearray, tag: int, data: bytes) -> None:
    out.append(tag)
    _varint(out, len(data))
    out += data


def _varint(out: bytearray, value: int) -> None:
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _digest(method: str, request: Any) -> bytes:
    h = hashlib.sha256(method.encode())
    h.update(request.SerializeToString(deterministic=True))
    return h.digest()
