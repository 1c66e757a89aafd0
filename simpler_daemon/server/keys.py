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

from simpler_daemon.protocol.pbwire import field, varint

__all__ = ["fingerprint", "fingerprint_now", "native_fingerprint"]

#: Requests larger than this are fingerprinted on a thread (hashing megabytes stalls the loop).
_BIG_REQUEST: Final = 1 << 16
#: A request with more tasks than this goes to the thread without its size being worked
#: out: ``ByteSize`` walks every task (2 ms of a 20,000-task SubmitRun), and so many
#: tasks are over ``_BIG_REQUEST`` anyway (a plain task's encoding is ~75 bytes).
_MANY_TASKS: Final = 1024


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
    tasks = getattr(request, "tasks", None)
    if tasks is not None and len(tasks) > _MANY_TASKS:
        return None
    if request.ByteSize() > _BIG_REQUEST:
        return None
    return _digest(method, request)


def native_fingerprint(
    method: str, key: str, tasks: list[bytes], label: str, priority: int
) -> bytes:
    """:func:`fingerprint` of the SubmitRunRequest with these fields (``tasks``: each
    Task message's deterministic encoding), without building it: the request's
    encoding is written here, field by field in number order as protobuf writes it
    (tests/server/test_fastpath_native.py checks that both agree), so a retry's key
    matches whichever form it came in."""
    parts: list[bytes] = []
    if key:
        field(parts, b"\x0a", key.encode())
    for task in tasks:
        field(parts, b"\x12", task)
    if label:
        field(parts, b"\x1a", label.encode())
    if priority:
        parts += (b"\x28", varint(priority))
    h = hashlib.sha256(method.encode())
    h.update(b"".join(parts))
    return h.digest()


def _digest(method: str, request: Any) -> bytes:
    h = hashlib.sha256(method.encode())
    h.update(request.SerializeToString(deterministic=True))
    return h.digest()
