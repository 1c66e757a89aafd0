"""The session manifest and the handshake between an L4 parent and ``simpler-remote-worker``.

One TCP connection (TLS first when the worker is configured for it)::

    parent -> worker   b"SLRW" | u32 version (1) | u32 token_len | token      (authentication)
    parent -> worker   u32 length | manifest JSON                            (msgspec JSON)
    worker -> parent   u32 length | reply JSON   {"ok": true, "command": "H:P",
                                                  "health": "H:P", "pid": N}
                                              or {"ok": false, "error": "..."}

All integers are little-endian. The worker compares the token before it reads a
byte of the manifest and validates the manifest completely (:func:`validate_manifest`)
before it spawns anything; every error names the offending key
(``manifest.callables[1].hashid``).

The worker hands the validated manifest to the session runner in a private spec
file (:class:`RunnerSpec`); the runner answers on its ready pipe with one line
shaped like the reply (:class:`HandshakeReply`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import re
import socket
import struct
import time
from dataclasses import dataclass
from typing import Final, Literal

import msgspec

# module_allowed lives with the resolver that applies it to every step of a qualname.
from simpler_daemon.callables import (
    module_allowed,
    parse_import_path,
    spec_for_chip,
    spec_for_import,
)
from simpler_daemon.errors import ManifestError, ProtocolError, RegistrationError

__all__ = [
    "AUTH_MAGIC",
    "AUTH_VERSION",
    "MAX_MANIFEST_BYTES",
    "MAX_REPLY_BYTES",
    "MAX_TOKEN_BYTES",
    "HandshakeReply",
    "Manifest",
    "ManifestCallable",
    "ManifestError",
    "ManifestLimits",
    "RunnerSpec",
    "RunnerTLS",
    "decode_manifest",
    "decode_reply",
    "encode_auth",
    "encode_lp_json",
    "format_host_port",
    "module_allowed",
    "read_auth",
    "read_lp",
    "read_lp_sock",
    "validate_manifest",
]

AUTH_MAGIC: Final = b"SLRW"
AUTH_VERSION: Final = 1
#: The longest bearer token a parent may send.
MAX_TOKEN_BYTES: Final = 4096
#: The hard ceiling of a manifest; the worker's ``sessions.max_manifest_bytes`` may be lower.
MAX_MANIFEST_BYTES: Final = 16 << 20
#: Replies are a few hundred bytes; an error text is bounded by the worker.
MAX_REPLY_BYTES: Final = 1 << 20

_AUTH_HEADER: Final = struct.Struct("<4sII")
_LENGTH: Final = struct.Struct("<I")
_U64_MAX: Final = (1 << 64) - 1
_I32_MAX: Final = (1 << 31) - 1
_ATTACH_KEY: Final = re.compile(r"[0-9a-f]{64}\Z")
_MAX_STR: Final = 1024


# --------------------------------------------------------------------------- structs


class ManifestCallable(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A callable the runner installs before its inner worker starts."""

    hashid: str
    kind: Literal["sub", "chip", "orchestration"]
    target: str
    """``"pkg.mod:fn"``; the hashid is recomputed from it and must match."""


class Manifest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What a parent asks of one remote L3 session."""

    session_id: int
    """Random, 1..2**64-1; every frame of the session carries it."""
    attach_key: str
    """64 lowercase hex digits (32 random bytes) the parent presents when it attaches."""
    worker_id: int
    """The parent's id for this worker, >= 0."""
    parent_level: int
    """Level of the parent: 4."""
    remote_level: int
    """Level of the session's inner worker: 3."""
    num_sub_workers: int
    num_chips: int = 0
    chip_pipeline_depth: int = 2
    heap_bytes: int = 64 << 20
    callables: list[ManifestCallable] = []
    session_timeout_s: float = 30.0
    """A peer silent for this long is gone (health and TCP user timeout)."""
    startup_budget_s: float | None = None
    """What remains of the parent's start-up budget; the runner must be attached by then.
    None (not named): ``session_timeout_s`` bounds the start-up (:meth:`startup_bound_s`)."""

    session_generation: int = 0
    """The parent's number for this session of the worker (1, then +1 per reconnect).
    Every remote tensor and buffer control names the generation it belongs to; the
    runner refuses any other one (its buffers are numbered afresh per session)."""

    def startup_bound_s(self) -> float:
        """Seconds the session's start-up may take, before the worker's own cap."""
        if self.startup_budget_s is None:
            return self.session_timeout_s
        return self.startup_budget_s


class HandshakeReply(msgspec.Struct, frozen=True, omit_defaults=True):
    """The worker's answer to a manifest, and the runner's ready line (same shape).

    ``ok`` True carries ``command``, ``health`` ("HOST:PORT") and ``pid`` (the
    runner); ``ok`` False carries ``error`` ("cannot open session: ...").
    """

    ok: bool
    command: str = ""
    health: str = ""
    pid: int = 0
    error: str = ""


class RunnerTLS(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """TLS the runner's command and health listeners use (the worker's own settings)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None


class RunnerSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The private spec file the worker writes for ``simpler-remote-l3-session --spec``."""

    manifest: Manifest
    listen_host: str
    """Host the runner binds its command and health listeners on (port 0)."""
    deadline_unix: float
    """``time.time()``-based absolute start-up deadline: ready and attached by then."""
    allowed_modules: list[str]
    """Module allow-list (see :func:`module_allowed`); [] allows nothing."""
    python_path: list[str]
    tls: RunnerTLS | None = None
    parent_on_this_host: bool = False
    """The parent's handshake came from this host (a loopback peer or the connection's
    own address): the parent shares this host's CPUs, so the inner children do not spin
    for their next task (see docs/remote.md, "Latency of one remote task")."""


@dataclass(frozen=True, slots=True)
class ManifestLimits:
    """The worker-side bounds a manifest is checked against (from the worker's config)."""

    allowed_modules: tuple[str, ...] = ()
    max_callables: int = 256
    max_sub_workers: int = 256
    max_chips: int = 64
    max_heap_bytes: int = 16 << 30
    max_session_timeout_s: float = 3600.0


# --------------------------------------------------------------------------- validation


def decode_manifest(data: bytes) -> Manifest:
    """Decode manifest JSON strictly; ``ManifestError`` naming the key on any problem."""
    try:
        return msgspec.json.decode(data, type=Manifest, strict=True)
    except msgspec.ValidationError as exc:
        raise _from_validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise ManifestError(f"cannot open session: manifest is not valid JSON: {exc}") from None


def _from_validation_error(exc: msgspec.ValidationError) -> ManifestError:
    """``Expected `int`, got `str` - at `$.callables[0].kind``` -> key and problem."""
    problem, sep, where = str(exc).partition(" - at `$")
    path = where.rstrip("`").lstrip(".") if sep else ""
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", problem)
    if unknown:
        key = f"manifest.{path}.{unknown[1]}" if path else f"manifest.{unknown[1]}"
        return ManifestError(f"cannot open session: unknown key {key}", key=key)
    missing = re.fullmatch(r"Object missing required field `(.*)`", problem)
    if missing:
        key = f"manifest.{path}.{missing[1]}" if path else f"manifest.{missing[1]}"
        return ManifestError(f"cannot open session: {key} is required", key=key)
    key = f"manifest.{path}" if path else "manifest"
    problem = problem.replace("`object`", "object").replace("`", "")
    return ManifestError(f"cannot open session: {key}: {problem}", key=key)


def validate_manifest(m: Manifest, limits: ManifestLimits) -> None:
    """Check every field against its range and the worker's limits.

    Raises ``ManifestError("cannot open session: manifest.<key> ...", key=...)`` on the
    first problem. Nothing is imported: the hashid is recomputed from the import path.
    """
    bad = _bad
    if not 1 <= m.session_id <= _U64_MAX:
        raise bad("session_id", f"must be in 1..2**64-1, got {m.session_id}")
    if not _ATTACH_KEY.match(m.attach_key):
        raise bad("attach_key", "must be 64 lowercase hex digits (32 random bytes)")
    if not 0 <= m.worker_id <= _I32_MAX:
        raise bad("worker_id", f"must be in 0..{_I32_MAX}, got {m.worker_id}")
    if not 0 <= m.session_generation <= _I32_MAX:
        raise bad("session_generation", f"must be in 0..{_I32_MAX}, got {m.session_generation}")
    if m.parent_level != 4:
        raise bad(
            "parent_level",
            f"must be 4 (a remote L3 worker serves an L4 parent), got {m.parent_level}",
        )
    if m.remote_level != 3:
        raise bad("remote_level", f"must be 3, got {m.remote_level}")
    if not 0 <= m.num_sub_workers <= limits.max_sub_workers:
        raise bad(
            "num_sub_workers",
            f"must be in 0..{limits.max_sub_workers} (sessions.max_sub_workers), "
            f"got {m.num_sub_workers}",
        )
    if not 0 <= m.num_chips <= limits.max_chips:
        raise bad(
            "num_chips",
            f"must be in 0..{limits.max_chips} (sessions.max_chips), got {m.num_chips}",
        )
    if m.num_sub_workers == 0 and m.num_chips == 0:
        raise bad("num_sub_workers", "is 0 and num_chips is 0: the session needs a worker")
    if m.chip_pipeline_depth not in (1, 2):
        raise bad("chip_pipeline_depth", f"must be 1 or 2, got {m.chip_pipeline_depth}")
    if not 0 < m.heap_bytes <= limits.max_heap_bytes:
        raise bad(
            "heap_bytes",
            f"must be in 1..{limits.max_heap_bytes} (sessions.max_heap_bytes), got {m.heap_bytes}",
        )
    if not (math.isfinite(m.session_timeout_s) and m.session_timeout_s > 0):
        raise bad("session_timeout_s", f"must be > 0, got {m.session_timeout_s}")
    if m.session_timeout_s > limits.max_session_timeout_s:
        raise bad(
            "session_timeout_s",
            f"must be at most {limits.max_session_timeout_s} (sessions.max_session_timeout_s), "
            f"got {m.session_timeout_s}",
        )
    if m.startup_budget_s is not None and not (
        math.isfinite(m.startup_budget_s) and m.startup_budget_s > 0
    ):
        raise bad("startup_budget_s", f"must be > 0, got {m.startup_budget_s}")
    if len(m.callables) > limits.max_callables:
        raise bad(
            "callables",
            f"has {len(m.callables)} entries, more than {limits.max_callables} "
            "(sessions.max_callables)",
        )
    seen: dict[str, int] = {}
    for i, c in enumerate(m.callables):
        _check_callable(f"callables[{i}]", c, limits)
        first = seen.setdefault(c.hashid, i)
        if first != i:
            raise bad(f"callables[{i}].hashid", f"{c.hashid} repeats callables[{first}]")


def _bad(key: str, text: str) -> ManifestError:
    return ManifestError(f"cannot open session: manifest.{key} {text}", key=f"manifest.{key}")


def _check_callable(key: str, c: ManifestCallable, limits: ManifestLimits) -> None:
    bad = _bad
    if len(c.target) > _MAX_STR:
        raise bad(f"{key}.target", f"is longer than {_MAX_STR} characters")
    try:
        module, _ = parse_import_path(c.target)
    except RegistrationError as exc:
        raise bad(f"{key}.target", f"is malformed: {exc}") from None
    if not module_allowed(module, limits.allowed_modules):
        allowed = ", ".join(limits.allowed_modules) or "nothing"
        raise bad(
            f"{key}.target",
            f"{c.target!r}: module {module!r} is not under callables.allowed_modules ({allowed})",
        )
    spec = spec_for_chip(c.target) if c.kind == "chip" else spec_for_import(c.target, c.kind)
    if c.hashid != spec.handle.hashid:
        raise bad(f"{key}.hashid", f"{c.hashid!r} does not match target {c.target!r}")


# --------------------------------------------------------------------------- handshake bytes


def encode_auth(token: bytes) -> bytes:
    """The authentication record: ``b"SLRW" | u32 version | u32 token_len | token``."""
    if len(token) > MAX_TOKEN_BYTES:
        raise ValueError(
            f"cannot encode authentication: token is {len(token)} bytes, at most "
            f"{MAX_TOKEN_BYTES} allowed"
        )
    return _AUTH_HEADER.pack(AUTH_MAGIC, AUTH_VERSION, len(token)) + token


async def read_auth(reader: asyncio.StreamReader, limit: int = MAX_TOKEN_BYTES) -> bytes:
    """Read the authentication record and return the token (possibly empty).

    ``ProtocolError`` on a wrong magic or version, a token longer than ``limit`` or a
    connection closed early; no more than the record's own bytes are read.
    """
    header = await _readexactly(reader, _AUTH_HEADER.size, "authentication header")
    magic, version, length = _AUTH_HEADER.unpack(header)
    if magic != AUTH_MAGIC:
        raise ProtocolError(f"cannot authenticate: bad magic {magic!r} (expected {AUTH_MAGIC!r})")
    if version != AUTH_VERSION:
        raise ProtocolError(
            f"cannot authenticate: handshake version {version} (this worker speaks {AUTH_VERSION})"
        )
    if length > limit:
        raise ProtocolError(f"cannot authenticate: token of {length} bytes exceeds {limit}")
    return await _readexactly(reader, length, "token")


def encode_lp_json(obj: object) -> bytes:
    """``u32 LE length | JSON`` of ``obj`` (a msgspec Struct, dict, list, ...)."""
    data = msgspec.json.encode(obj)
    if len(data) > 0xFFFFFFFF:
        raise ValueError(f"cannot encode message: {len(data)} bytes do not fit a u32 length")
    return _LENGTH.pack(len(data)) + data


async def read_lp(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    """Read one ``u32 LE length | body`` message; ``ProtocolError`` when the length exceeds
    ``max_bytes`` (nothing of the body is read then) or the connection closes early."""
    (length,) = _LENGTH.unpack(await _readexactly(reader, _LENGTH.size, "message length"))
    if length > max_bytes:
        raise ProtocolError(f"cannot read message: {length} bytes exceed the limit of {max_bytes}")
    return await _readexactly(reader, length, "message")


async def _readexactly(reader: asyncio.StreamReader, n: int, what: str) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(
            f"cannot read {what}: connection closed after {len(exc.partial)} of {n} bytes"
        ) from None


def read_lp_sock(sock: socket.socket, max_bytes: int, deadline: float) -> bytes:
    """Blocking :func:`read_lp` on a socket (plain or ``ssl.SSLSocket``).

    ``deadline`` is ``time.monotonic()``-based; ``TimeoutError`` when it passes,
    ``ProtocolError`` on EOF or an oversize length. The socket's timeout is restored.
    """
    saved = sock.gettimeout()
    try:
        (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size, deadline, "message length"))
        if length > max_bytes:
            raise ProtocolError(
                f"cannot read message: {length} bytes exceed the limit of {max_bytes}"
            )
        return _recv_exactly(sock, length, deadline, "message")
    finally:
        sock.settimeout(saved)


def _recv_exactly(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"cannot read {what}: deadline passed after {len(buf)} of {n} bytes")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except TimeoutError:
            raise TimeoutError(
                f"cannot read {what}: deadline passed after {len(buf)} of {n} bytes"
            ) from None
        if not chunk:
            raise ProtocolError(
                f"cannot read {what}: connection closed after {len(buf)} of {n} bytes"
            )
        buf += chunk
    return bytes(buf)


def decode_reply(data: bytes) -> HandshakeReply:
    """Decode a worker reply or a runner ready line; ``ProtocolError`` when malformed
    (``ok`` True without both addresses and a pid, ``ok`` False without an error)."""
    try:
        reply = msgspec.json.decode(data, type=HandshakeReply, strict=True)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"cannot read reply: {exc}") from None
    if reply.ok:
        for name in ("command", "health"):
            try:
                _split_host_port(getattr(reply, name))
            except ValueError as exc:
                raise ProtocolError(f"cannot read reply: {name}: {exc}") from None
        if reply.pid <= 0:
            raise ProtocolError(f"cannot read reply: pid must be > 0, got {reply.pid}")
    elif not reply.error:
        raise ProtocolError("cannot read reply: ok is false and error is empty")
    return reply


def format_host_port(host: str, port: int) -> str:
    """``"host:port"``, with an IPv6 host in brackets."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def _split_host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{text!r} is not host:port")
    return host, int(port)
