"""TaskCodec: a dispatch's args blob and CallConfig -> one command-lane frame.

The parent's half of the TASK encoding, pure (no socket, no lock, no loop)::

    WorkerDispatch ──> slot.blobs[group]  ──> RemoteTensor[] + scalars ─┐
                       slot.config_bytes  ──> WireConfig (cached)  ─────┼─> Task
                                                                        v
                                  frame(TASK / CONTROL / SHUTDOWN, seq) -> header + msgpack

The args blob is read straight into wire structs (the layout of
``args.decode_descs`` without building a TensorDesc per tensor): this is the
per-task cost on the dispatch path. ``RemoteL3Endpoint`` owns one codec per
session and only moves the bytes it returns.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, Final

import msgspec

# The private layout of the args blob: one definition of the format, read here without
# building a TensorDesc per tensor (the dispatch path).
from simpler_daemon.args import _DESC as _ARGS_DESC
from simpler_daemon.args import _DTYPES, MAX_NDIM, CallConfig, Tag
from simpler_daemon.args import _HEADER as _ARGS_HEADER
from simpler_daemon.endpoints.base import WorkerDispatch
from simpler_daemon.errors import EndpointError
from simpler_daemon.mailbox.layout import TENSOR_DESC_SIZE
from simpler_daemon.remote.wire import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_PAYLOAD,
    PROTOCOL_VERSION,
    DType,
    InlineTensor,
    RemoteTensor,
    Task,
    WireConfig,
)
from simpler_daemon.taskvalues import read_section

__all__ = ["WIRE_CONFIG_CACHE", "TaskCodec"]

#: Distinct CallConfigs whose WireConfig is kept (a run reuses one config for all tasks).
WIRE_CONFIG_CACHE: Final = 256

_ENCODER: Final = msgspec.msgpack.Encoder()
_DTYPE_NAMES: Final[tuple[DType, ...]] = _DTYPES
_MAX_TAG: Final = max(Tag)


class TaskCodec:
    """Encodes the requests of one session's command lane (errors name ``label``)."""

    __slots__ = ("_wire_configs", "label", "live", "session_id", "worker_id")

    def __init__(
        self,
        session_id: int,
        worker_id: int,
        label: str,
        live: Mapping[int, int] | None = None,
    ) -> None:
        self.session_id = session_id
        self.worker_id = worker_id
        self.label = label
        #: Remote worker id -> generation of its live session (the fleet's table, read
        #: at each dispatch); a tensor of any other generation is refused. None: no check.
        self.live = live
        self._wire_configs: dict[bytes, tuple[WireConfig, int]] = {}

    def task(self, d: WorkerDispatch) -> tuple[Task, int]:
        """The TASK payload of ``d`` and its ``deadline_ms``.

        Raises ``EndpointError`` for a host tensor (it lives on this process's
        heap, the runner cannot see it), a tensor of a session that ended (queued
        before its owner reconnected: its data is lost) or a malformed args blob.
        """
        slot = d.task_slot
        blob: bytes = slot.blobs[d.group_index]
        names = _DTYPE_NAMES
        try:
            t, s = _ARGS_HEADER.unpack_from(blob, 0)
            off = _ARGS_HEADER.size
            end = off + t * TENSOR_DESC_SIZE
            if t < 0 or s < 0 or end + 8 * s > len(blob):
                raise ValueError(f"malformed args blob: T={t} S={s} for {len(blob)} bytes")
            tensors: list[RemoteTensor | InlineTensor] = []
            if t:
                for i, f in enumerate(_ARGS_DESC.iter_unpack(blob[off:end])):
                    nd = f[3]
                    if nd > MAX_NDIM or f[1] >= len(names) or f[2] > _MAX_TAG:
                        raise ValueError(
                            f"malformed tensor descriptor {i}: ndim={nd} dtype={f[1]} tag={f[2]}"
                        )
                    if not f[4]:
                        raise EndpointError(
                            f"cannot submit to {self.label}: tensor {i} is a host array on "
                            "this process's heap; allocate it with alloc_remote"
                        )
                    # buffer_offset (f[6]) holds the owner worker id of a remote tensor
                    # and, above it, the owner's session generation.
                    owner, session = f[6] & 0xFFFFFFFF, f[6] >> 32
                    live = self.live
                    if live is not None and live.get(owner) != session:
                        raise EndpointError(
                            f"cannot submit to {self.label}: tensor {i} is buffer {f[0]} of "
                            f"session {session} of remote worker {owner}, which ended: its "
                            "data is lost"
                        )
                    tensors.append(
                        RemoteTensor(
                            owner,
                            f[0],
                            f[5],
                            f[7],
                            f[8],
                            names[f[1]],
                            list(f[9 : 9 + nd]),
                            list(f[17 : 17 + nd]),
                            f[2],
                            session,
                        )
                    )
            scalars = list(struct.unpack_from(f"<{s}Q", blob, end)) if s else []
            if len(blob) > end + 8 * s:
                # Values in the frame go as they are; heap-backed ones were refused at submit.
                v = read_section(blob, end + 8 * s, None)
                assert v is not None
                values, kwargs = v.encoded()
                cfg, deadline_ms = self.wire_config(slot)
                return Task(slot.digest, cfg, tensors, scalars, values, kwargs), deadline_ms
        except (ValueError, struct.error) as exc:
            raise EndpointError(f"cannot submit to {self.label}: {exc}") from exc
        cfg, deadline_ms = self.wire_config(slot)
        return Task(slot.digest, cfg, tensors, scalars), deadline_ms

    def wire_config(self, slot: Any) -> tuple[WireConfig, int]:
        """The slot's CallConfig as a WireConfig and its ``deadline_ms`` (cached by bytes)."""
        key: bytes = slot.config_bytes
        hit = self._wire_configs.get(key)
        if hit is not None:
            return hit
        c = getattr(slot, "config", None)
        if not isinstance(c, CallConfig):
            c = CallConfig.decode(key)
        wc = WireConfig(
            c.deadline_ms, c.threads, c.enable_profile, c.enable_dump_args, c.output_prefix
        )
        if len(self._wire_configs) >= WIRE_CONFIG_CACHE:
            self._wire_configs.clear()
        hit = self._wire_configs[key] = (wc, c.deadline_ms)
        return hit

    def frame(self, ftype: int, seq: int, payload: msgspec.Struct | None, what: str) -> bytearray:
        """Header and payload in one buffer (one send on the hot path).

        Raises ``EndpointError`` when the payload exceeds ``MAX_PAYLOAD``.
        """
        buf = bytearray(HEADER_SIZE)
        if payload is not None:
            _ENCODER.encode_into(payload, buf, HEADER_SIZE)
        plen = len(buf) - HEADER_SIZE
        if plen > MAX_PAYLOAD:
            raise EndpointError(
                f"cannot send {what} to {self.label}: payload of {plen} bytes exceeds "
                f"MAX_PAYLOAD ({MAX_PAYLOAD})"
            )
        HEADER.pack_into(
            buf, 0, MAGIC, PROTOCOL_VERSION, ftype, self.session_id, self.worker_id, seq, plen, 0
        )
        return buf
