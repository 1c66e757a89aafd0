"""Remote buffers of one L4 ``Worker``'s remote L3 workers, as a mixin over the fleet.

::

    alloc_remote -> alloc ------------- "alloc" control ---> a buffer on its owner
    copy_to_remote / copy_from_remote --- CHUNK-sized "copy_to" / "copy_from" controls
    import_remote -> import_ ---- copy_from its owner, "import" chunks to the worker
    free / release_remote -------- "free" / "release" controls, deferred while a task
                                   pins the buffer (sent by a later control)
    Orchestrator submit: describe(ref) -> TensorDesc; pin / unpin(key) per task
    a session ends: _drop_buffers_of(worker) (its refs then fail clearly)

Every ref names the session generation it belongs to; one of any other generation is
refused (its data is lost with its session).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simpler_daemon.args import TensorDesc, dtype_code
from simpler_daemon.errors import ControlError, EndpointError
from simpler_daemon.remote import wire
from simpler_daemon.remote.spec import RemoteTensorRef

__all__ = ["CHUNK", "RemoteBuffers"]

log = logging.getLogger("simpler_daemon.remote")

#: Bytes per copy_to / copy_from / import control (the frame bound is 16 MiB).
CHUNK = 4 << 20


@dataclass(slots=True)
class _Buffer:
    ref: RemoteTensorRef
    pins: int = 0
    freed: bool = False
    #: Workers (other than the owner) holding an imported snapshot.
    imported_by: set[int] = field(default_factory=set)


class RemoteBuffers:
    """Remote buffers and the frees and releases deferred while a task pins them (mixed
    into :class:`~simpler_daemon.engine.remote_l3.RemoteFleet`).

    State of its own: ``buffers`` (the live buffers by key, with their pins and the
    workers holding an imported snapshot) and ``_deferred`` (("free" | "release", worker,
    its session generation, ref) deferred while a task pinned the buffer; sent by a later
    control once nothing references it, and only to that session: a new one never had
    the buffer), both set up by :meth:`_init_buffers`. It reads the fleet's ``live``
    session generations and ``endpoints``, and sends through its controls.
    """

    buffers: dict[tuple[int, ...], _Buffer]
    _deferred: list[tuple[str, int, int, RemoteTensorRef]]
    # Provided by RemoteFleet.
    live: dict[int, int]
    endpoints: dict[int, Any]

    def endpoint(self, worker_id: int, what: str) -> Any:
        raise NotImplementedError

    def catch_up(self) -> None:
        raise NotImplementedError

    async def control(self, worker_id: int, name: str, body: bytes) -> bytes:
        raise NotImplementedError

    async def _send(self, ep: Any, name: str, body: bytes) -> bytes:
        raise NotImplementedError

    def _init_buffers(self) -> None:
        self.buffers = {}
        self._deferred = []

    def _drop_buffers_of(self, worker_id: int) -> None:
        """Worker ``worker_id``'s session ended (no longer ``live``): forget its buffers,
        queue the releases of the snapshots others imported from them, drop what was
        deferred for it."""
        for key, buf in list(self.buffers.items()):
            if key[0] == worker_id:
                # Pins of queued tasks go with it: their keys name this generation,
                # which no buffer of a later session has, so unpinning them is a no-op.
                del self.buffers[key]
                # Its importers still hold snapshots: drop them with the next control.
                self._deferred.extend(
                    ("release", w, self.live.get(w, 0), buf.ref) for w in sorted(buf.imported_by)
                )
            else:
                buf.imported_by.discard(worker_id)
        # What was deferred for that session will never be sent: it holds nothing now.
        self._deferred = [e for e in self._deferred if e[1] != worker_id]

    async def _flush_deferred(self) -> None:
        """Send the frees and releases whose buffer no live task references any more."""
        keep: list[tuple[str, int, int, RemoteTensorRef]] = []
        ready: list[tuple[str, int, int, RemoteTensorRef]] = []
        for entry in self._deferred:
            (keep if entry[3].key in self.buffers else ready).append(entry)
        self._deferred = keep
        for op, w, gen, ref in ready:
            ep = self.endpoints.get(w)
            if ep is None or ep.poisoned or self.live.get(w) != gen:
                continue  # that session ended: what it held went with it
            try:
                await self._send(ep, op, _key_body(ref))
            except (ControlError, EndpointError, TimeoutError) as exc:
                log.warning("remote worker %d: deferred %s of %r failed: %s", w, op, ref, exc)

    # -- buffers ----------------------------------------------------------------------------

    async def alloc(
        self, worker_id: int, shape: tuple[int, ...] | int, dtype: Any
    ) -> RemoteTensorRef:
        shp = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        if any(d < 0 for d in shp):
            raise ValueError(f"cannot alloc_remote: shape {shp} has a negative dimension")
        dt = np.dtype(dtype)
        dtype_code(dt)
        self.catch_up()
        ep = self.endpoint(worker_id, "alloc_remote")
        sid, gen = ep.session.session_id, ep.generation
        raw = await self.control(
            worker_id, "alloc", wire.encode_payload(wire.AllocBody(shape=list(shp), dtype=dt.name))
        )
        res = wire.decode_payload(wire.AllocResult, raw)
        if self.endpoints.get(worker_id) is not ep:  # replaced while the reply came back
            raise EndpointError(
                f"cannot alloc_remote: the session of remote worker {worker_id} ended meanwhile"
            )
        ref = RemoteTensorRef(
            worker_id,
            res.buffer_id,
            res.generation,
            shp,
            dt.name,
            res.nbytes,
            session=sid,
            session_generation=gen,
        )
        self.buffers[ref.key] = _Buffer(ref)
        return ref

    def _live(self, ref: Any, what: str) -> _Buffer:
        if not isinstance(ref, RemoteTensorRef):
            raise TypeError(
                f"cannot {what}: expected a RemoteTensorRef from alloc_remote, got {type(ref).__name__}"
            )
        buf = self.buffers.get(ref.key)
        if buf is None and self.live.get(ref.owner) != ref.session_generation:
            # A new session numbers its buffers afresh: the generation tells them apart.
            raise ValueError(f"cannot {what}: {ref.describe_lost()}")
        if buf is None or buf.freed:
            raise ValueError(f"cannot {what}: {ref!r} is not a live buffer (it was freed)")
        return buf

    async def copy_to(self, ref: RemoteTensorRef, array: Any) -> None:
        self._live(ref, "copy_to_remote")
        src = np.asarray(array)
        if src.size != int(np.prod(ref.shape, dtype=np.int64)):
            raise ValueError(
                f"cannot copy_to_remote: the array has {src.size} elements, {ref!r} has "
                f"{int(np.prod(ref.shape, dtype=np.int64))}"
            )
        data = np.ascontiguousarray(src, dtype=np.dtype(ref.dtype)).tobytes()
        for off in range(0, max(len(data), 1), CHUNK):
            body = wire.CopyTo(
                buffer_id=ref.buffer_id,
                generation=ref.generation,
                offset=ref.byte_offset + off,
                data=data[off : off + CHUNK],
                session=ref.session_generation,
            )
            await self.control(ref.owner, "copy_to", wire.encode_payload(body))

    async def copy_from(self, ref: RemoteTensorRef) -> np.ndarray[Any, Any]:
        self._live(ref, "copy_from_remote")
        out = np.empty(ref.shape, dtype=np.dtype(ref.dtype))
        flat = out.reshape(-1).view(np.uint8)
        for off in range(0, ref.nbytes, CHUNK):
            n = min(CHUNK, ref.nbytes - off)
            body = wire.CopyFrom(
                buffer_id=ref.buffer_id,
                generation=ref.generation,
                offset=ref.byte_offset + off,
                nbytes=n,
                session=ref.session_generation,
            )
            raw = await self.control(ref.owner, "copy_from", wire.encode_payload(body))
            if len(raw) != n:
                raise EndpointError(
                    f"cannot copy_from_remote {ref!r}: worker {ref.owner} returned {len(raw)} "
                    f"bytes for {n}"
                )
            flat[off : off + n] = np.frombuffer(raw, dtype=np.uint8)
        return out

    async def free(self, ref: RemoteTensorRef) -> None:
        """Free a remote buffer and drop the snapshots imported from it; both wait while
        a task still references it."""
        buf = self._live(ref, "free")
        buf.freed = True
        ops = [("release", w, ref) for w in sorted(buf.imported_by)] + [("free", ref.owner, ref)]
        buf.imported_by.clear()
        if buf.pins:
            # Sent by a later control, once the last task retired (to these sessions only).
            self._deferred.extend((op, w, self.live.get(w, 0), r) for op, w, r in ops)
            return
        del self.buffers[ref.key]
        for op, w, r in ops:
            await self.control(w, op, _key_body(r))

    async def import_(self, ref: RemoteTensorRef, worker_id: int) -> None:
        """Give ``worker_id`` a snapshot of ``ref`` (read from its owner now)."""
        buf = self._live(ref, "import_remote")
        if worker_id == ref.owner:
            raise ValueError(f"cannot import_remote: worker {worker_id} already owns {ref!r}")
        self.endpoint(worker_id, "import_remote")
        data = (await self.copy_from(ref)).reshape(-1).view(np.uint8).tobytes()
        offsets = list(range(0, len(data), CHUNK)) or [0]
        for off in offsets:
            body = wire.ImportBody(
                owner=ref.owner,
                buffer_id=ref.buffer_id,
                generation=ref.generation,
                dtype=ref.dtype,
                shape=list(ref.shape),
                offset=off,
                data=data[off : off + CHUNK],
                final=off == offsets[-1],
                session=ref.session_generation,
            )
            await self.control(worker_id, "import", wire.encode_payload(body))
        buf.imported_by.add(worker_id)

    async def release(self, ref: RemoteTensorRef, worker_id: int) -> None:
        buf = self._live(ref, "release_remote")
        if worker_id not in buf.imported_by:
            raise ValueError(f"cannot release_remote: worker {worker_id} has not imported {ref!r}")
        buf.imported_by.discard(worker_id)  # no new task on that worker may use it
        if buf.pins:  # a queued task still may use it
            self._deferred.append(("release", worker_id, self.live.get(worker_id, 0), ref))
        elif worker_id in self.endpoints:
            await self.control(worker_id, "release", _key_body(ref))

    # -- RemoteTensors (what the Orchestrator and the Scheduler ask) -------------------------

    def describe(self, ref: Any, target: int, where: str) -> TensorDesc:
        buf = self._live(ref, where)
        if target != ref.owner and target not in buf.imported_by:
            raise ValueError(
                f"cannot {where}: {ref!r} belongs to remote worker {ref.owner}; worker {target} "
                f"has not imported it (Worker.import_remote(ref, worker={target}))"
            )
        return TensorDesc(
            ref.buffer_id,
            ref.generation,
            ref.owner,
            ref.byte_offset,
            ref.nbytes,
            dtype_code(ref.dtype),
            ref.shape,
            ref.strides,
            remote=True,
            session=ref.session_generation,
        )

    def pin(self, key: tuple[int, ...]) -> None:
        self.buffers[key].pins += 1

    def unpin(self, key: tuple[int, ...]) -> None:
        buf = self.buffers.get(key)
        if buf is not None:
            buf.pins -= 1
            if buf.pins == 0 and buf.freed:
                del self.buffers[key]


def _key_body(ref: RemoteTensorRef) -> bytes:
    return wire.encode_payload(
        wire.BufferKey(
            owner=ref.owner,
            buffer_id=ref.buffer_id,
            generation=ref.generation,
            session=ref.session_generation,
        )
    )
