"""Buffer RPCs of the daemon servicer: AllocBuffer, WriteBuffer, ReadBuffer, FreeBuffer, ListBuffers."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from typing import Any, Final

import numpy as np

from simpler_daemon.args import MAX_NDIM
from simpler_daemon.errors import InvalidField, LimitExceeded
from simpler_daemon.heap import Buffer
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server import oplog
from simpler_daemon.server.decoding import BadRequest
from simpler_daemon.server.plan import check_label
from simpler_daemon.server.rpc_base import ServiceBase, server_stream, unary

__all__ = ["READ_CHUNK", "BuffersRpc"]

log = logging.getLogger("simpler_daemon.service")

#: Default ReadBuffer chunk; never more than the message limit allows.
READ_CHUNK: Final = 1 << 20
#: Room for the protobuf framing around a chunk.
_CHUNK_OVERHEAD: Final = 1024


class BuffersRpc(ServiceBase):
    """Shared-heap buffers: every buffer has an owner (access.py) and a generation."""

    def _buffer_info(self, buf: Buffer) -> Any:
        return pb.BufferInfo(
            buffer_id=buf.buffer_id,
            generation=buf.generation,
            nbytes=buf.nbytes,
            shape=list(buf.shape),
            dtype=np.dtype(buf.dtype).name,
            heap_name=self._worker.heap.name or "",
            heap_offset=buf.offset,
            label=self._labels.get(buf.buffer_id, ""),
            references=buf.pins,
        )

    @unary
    async def AllocBuffer(self, request: Any, context: Any) -> Any:
        dt = self._plan.dtype(request.dtype, "dtype")
        shape = tuple(request.shape)
        if len(shape) > MAX_NDIM:
            raise InvalidField("shape", f"{len(shape)} dimensions, at most {MAX_NDIM}")
        check_label(request.label)
        nbytes = math.prod(shape) * dt.itemsize
        limit = self._limits.max_buffer_bytes
        if nbytes > limit:
            raise LimitExceeded("shape", f"{nbytes} bytes, limits.max_buffer_bytes = {limit}")
        who = self._who(context)
        try:
            self._owners.check_alloc(who, nbytes)  # the client's heap quota
        except LimitExceeded as exc:
            oplog.heap_exhausted(who.owner, nbytes, str(exc))
            raise
        self._check_usable("allocate a buffer")
        heap = self._worker.heap
        try:
            buf = heap.alloc_buffer(shape, dt)
        except MemoryError as exc:
            oplog.heap_exhausted(who.owner, nbytes, str(exc))
            raise LimitExceeded("shape", str(exc)) from exc
        self._owners.add_buffer(who, buf.buffer_id, buf.generation, buf.nbytes)
        if request.label:
            self._labels[buf.buffer_id] = request.label
        return pb.AllocBufferResponse(
            buffer_id=buf.buffer_id,
            generation=buf.generation,
            nbytes=buf.nbytes,
            heap_name=heap.name or "",
            heap_offset=buf.offset,
        )

    @unary
    async def WriteBuffer(self, request_iterator: Any, context: Any) -> Any:
        who = self._who(context)
        with self._stream_slot(who.owner):
            heap = self._worker.heap
            buf: Buffer | None = None
            pos = written = 0
            async for msg in request_iterator:
                if isinstance(msg, BadRequest):
                    raise InvalidField("", msg.describe())
                which = msg.WhichOneof("chunk")
                if buf is None:
                    if which != "target":
                        raise InvalidField(
                            "target", "the first WriteBuffer message must carry the target"
                        )
                    t = msg.target
                    self._check_usable("write a buffer")
                    buf = self._plan.buffer(t.buffer_id, t.generation, "target")
                    self._owners.check_buffer(
                        who, buf.buffer_id, buf.generation, "write", "target.buffer_id"
                    )
                    if t.offset > buf.nbytes:
                        raise InvalidField(
                            "target.offset",
                            f"offset {t.offset} is past the end of buffer {buf.buffer_id} "
                            f"({buf.nbytes} bytes)",
                        )
                    if t.offset + t.total_bytes > buf.nbytes:  # refused before any data
                        raise InvalidField(
                            "target.total_bytes",
                            f"writing {t.total_bytes} bytes at offset {t.offset} overruns "
                            f"buffer {buf.buffer_id} of {buf.nbytes} bytes",
                        )
                    pos = t.offset
                    continue
                if which != "data":
                    raise InvalidField(
                        "target", "only the first WriteBuffer message may carry a target"
                    )
                data = msg.data
                # The buffer may have been freed while the stream was open.
                self._check_usable("write a buffer")
                self._plan.buffer(buf.buffer_id, buf.generation, "target")
                end = pos + len(data)
                if end > buf.nbytes:
                    raise InvalidField(
                        "data",
                        f"writing {len(data)} bytes at offset {pos} overruns buffer "
                        f"{buf.buffer_id} of {buf.nbytes} bytes",
                    )
                heap.mmap[buf.offset + pos : buf.offset + end] = data
                pos = end
                written += len(data)
            if buf is None:
                raise InvalidField(
                    "target", "empty stream: the first message must carry the target"
                )
            return pb.WriteBufferResponse(buffer_id=buf.buffer_id, bytes_written=written)

    @server_stream
    async def ReadBuffer(self, request: Any, context: Any) -> AsyncIterator[Any]:
        who = self._who(context)
        with self._stream_slot(who.owner):
            self._check_usable("read a buffer")
            buf = self._plan.buffer(request.buffer_id, request.generation, "")
            self._owners.check_buffer(who, buf.buffer_id, buf.generation, "read", "buffer_id")
            start = request.offset
            if start > buf.nbytes:
                raise InvalidField(
                    "offset",
                    f"offset {start} is past the end of buffer {buf.buffer_id} "
                    f"({buf.nbytes} bytes)",
                )
            length = request.length or buf.nbytes - start
            if start + length > buf.nbytes:
                raise InvalidField(
                    "length",
                    f"[{start}, {start + length}) overruns buffer {buf.buffer_id} of "
                    f"{buf.nbytes} bytes",
                )
            limit = max(1, self._limits.max_message_bytes - _CHUNK_OVERHEAD)
            chunk = min(request.chunk_bytes or READ_CHUNK, limit)
            heap = self._worker.heap
            pos, end = start, start + length
            while pos < end:
                self._check_usable("read a buffer")
                self._plan.buffer(buf.buffer_id, buf.generation, "")
                stop = min(end, pos + chunk)
                yield pb.ReadBufferResponse(
                    offset=pos, data=heap.mmap[buf.offset + pos : buf.offset + stop]
                )
                pos = stop
            if end == buf.nbytes:  # the last byte went out: a drain owes this buffer no more
                self._owed.read(buf.buffer_id, buf.generation)

    @unary
    async def FreeBuffer(self, request: Any, context: Any) -> Any:
        self._check_usable("free a buffer")
        buf = self._plan.buffer(request.buffer_id, request.generation, "")
        self._owners.check_buffer(
            self._who(context), buf.buffer_id, buf.generation, "free", "buffer_id"
        )
        deferred = buf.pins > 0
        self._worker.heap.free(buf.buffer_id)
        self._labels.pop(buf.buffer_id, None)
        self._owners.drop_buffer(buf.buffer_id)
        self._owed.changed()
        return pb.FreeBufferResponse(deferred=deferred)

    @unary
    async def ListBuffers(self, request: Any, context: Any) -> Any:
        heap = self._worker.heap
        out = pb.ListBuffersResponse()
        if heap.closed:
            return out
        who = self._who(context)
        for buf in heap.buffers():  # a client sees its own buffers; an admin every one
            if self._owners.may_use_buffer(who, buf.buffer_id, buf.generation):
                out.buffers.append(self._buffer_info(buf))
        out.heap.CopyFrom(
            pb.HeapInfo(
                name=heap.name or "", size_bytes=heap.size, used_bytes=heap.size - heap.free_bytes()
            )
        )
        return out
