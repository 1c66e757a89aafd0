"""Python clients of the daemon's gRPC API: ``Client`` (blocking) and ``AsyncClient``.

::

    from simpler_daemon.client import Client, sub_task, tensor

    with Client() as c:                                   # the default socket
        add = c.register("simpler_daemon.examples.tasks:add")
        a, b = c.alloc_array(np.ones(8, "float32")), c.alloc_array(np.arange(8, dtype="float32"))
        out = c.alloc_buffer((8,), "float32").buffer_id
        run_id = c.submit([sub_task(add, [tensor(a, "input", (8,), "float32"),
                                          tensor(b, "input", (8,), "float32"),
                                          tensor(out, "output", (8,), "float32")])])
        c.wait(run_id, timeout=10)                        # TaskError if the run failed
        print(c.read_array(out, (8,), "float32"))

Targets: a Unix socket path (``/run/simpler-daemon/daemon.sock`` or
``unix:/path``), or ``host:port`` over TLS with a bearer token. ``wait`` raises
``TaskError`` (``RunCancelled`` for a cancelled run) and ``TimeoutError``;
every other failure is the ``grpc.RpcError`` with the daemon's status and a
message naming the offending field.

This module holds the channels (target, TLS, token, per-call deadlines) and
the same-host zero-copy view of the daemon's heap; every request is built by
:mod:`simpler_daemon.client_requests`.
"""

from __future__ import annotations

import math
import mmap
import os
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Final

import grpc
import numpy as np

from simpler_daemon.client_requests import (
    TERMINAL_STATES,
    add_remote_request,
    alloc_request,
    array_bytes,
    call_config,
    call_deadline,
    check_wait,
    drain_request,
    make_args,
    orchestration_request,
    raise_for_status,
    read_request,
    register_request,
    sub_task,
    submit_request,
    task,
    tensor,
    wait_request,
    write_chunk,
    write_requests,
)
from simpler_daemon.heap import SHM_DIR
from simpler_daemon.localtrust import UntrustedPathError, check_socket_path, open_trusted_heap
from simpler_daemon.server._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server._proto.simpler.daemon.v1 import daemon_pb2_grpc as pb_grpc

__all__ = [
    "CLIENT_ID_METADATA",
    "TERMINAL_STATES",
    "AsyncClient",
    "Client",
    "call_config",
    "default_target",
    "make_args",
    "raise_for_status",
    "sub_task",
    "task",
    "tensor",
]

#: Metadata key carrying a client's display label (the daemon's logs). Per-client limits
#: never trust it: the daemon identifies a client by its peer credentials or its TLS
#: identity / address.
CLIENT_ID_METADATA: Final = "x-simpler-client"
#: Environment variables read when no target / token is given.
ENV_TARGET: Final = "SIMPLER_DAEMON_SOCKET"
ENV_TOKEN: Final = "SIMPLER_DAEMON_TOKEN"
DEFAULT_TIMEOUT: Final = 30.0


def default_target() -> str:
    """``$SIMPLER_DAEMON_SOCKET``, else the socket of the default configuration."""
    env = os.environ.get(ENV_TARGET)
    if env:
        return env
    from simpler_daemon.server.config import DaemonConfig, resolve

    return resolve(DaemonConfig()).grpc.unix_socket


def _address(target: str) -> tuple[str, bool]:
    """``(grpc address, is_tcp)`` for a socket path, ``unix:`` URI or ``host:port``."""
    if target.startswith(("unix:", "unix-abstract:")):
        return target, False
    if "/" in target or target.endswith(".sock"):
        return "unix:" + os.path.abspath(target), False
    return target, True


def _unix_path(address: str) -> str:
    """The file path of a ``unix:path`` / ``unix:///path`` gRPC address."""
    path = address.removeprefix("unix:")
    return path[2:] if path.startswith("///") else path


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as fh:
        return fh.read()


class _Base:
    def __init__(
        self,
        target: str | None = None,
        *,
        token: str | None = None,
        token_file: str | None = None,
        root_certificates: str | bytes | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
        server_name: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        client_id: str | None = None,
    ) -> None:
        self.target = target or default_target()
        self.address, self.tcp = _address(self.target)
        #: The uid trusted to own the daemon's heap besides ours and root's (the owner of
        #: a trusted socket directory); None over TCP.
        self._daemon_uid: int | None = None
        if self.address.startswith("unix:"):
            # Refuse a socket someone else could have planted (a directory in /tmp made
            # by another user would receive our connection): UntrustedPathError.
            self._daemon_uid = check_socket_path(_unix_path(self.address))
        self.timeout = call_deadline(check_wait(timeout, "timeout"), 0.0)
        self.client_id = client_id or uuid.uuid4().hex[:16]
        self.metadata: tuple[tuple[str, str], ...] = ((CLIENT_ID_METADATA, self.client_id),)
        self.options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1),
            ("grpc.enable_http_proxy", 0),
        ]
        self.credentials: Any = None
        if self.tcp:
            if token is None and token_file:
                token = (_read(token_file) or b"").decode().strip()
            token = token if token is not None else os.environ.get(ENV_TOKEN)
            roots = (
                _read(root_certificates)
                if isinstance(root_certificates, str)
                else root_certificates
            )
            creds = grpc.ssl_channel_credentials(
                root_certificates=roots,
                private_key=_read(client_key),
                certificate_chain=_read(client_cert),
            )
            if token:
                # Plain metadata rather than call credentials: grpc runs a credentials
                # plugin on its own C threads, which would leave threads in the caller
                # (and a process with threads must not fork a Worker).
                self.metadata += (("authorization", f"Bearer {token}"),)
            self.credentials = creds
            if server_name:
                self.options.append(("grpc.ssl_target_name_override", server_name))
        self._chunk: int | None = None
        self._open()

    def _view(self, info: Any) -> np.ndarray[Any, Any]:
        """Zero-copy view of the buffer a ``BufferInfo`` describes (same host only).

        Only the pages holding that buffer are mapped, never the whole heap (the other
        buffers may be other clients'), and only from a heap file the client trusts: a
        regular file (not a symlink) owned by the client's user, root or the daemon's
        user, that nobody else can write."""
        buffer_id = info.buffer_id
        name = info.heap_name
        if not name:
            raise ValueError(
                f"cannot map buffer {buffer_id}: the daemon's heap is not shared "
                "(workers.heap_shared = false); use write_buffer / read_buffer"
            )
        if "/" in name or not name.startswith("simpler-heap-"):
            raise ValueError(f"cannot map buffer {buffer_id}: unexpected heap name {name!r}")
        dt = np.dtype(info.dtype)
        shape = tuple(int(d) for d in info.shape)
        need = math.prod(shape) * dt.itemsize
        offset, nbytes = int(info.heap_offset), int(info.nbytes)
        if need > nbytes:
            raise ValueError(
                f"cannot map buffer {buffer_id}: shape {shape} of {dt.name} needs {need} "
                f"bytes, the buffer has {nbytes}"
            )
        path = os.path.join(SHM_DIR, name)
        owners = {0, os.geteuid()}
        if self._daemon_uid is not None:
            owners.add(self._daemon_uid)
        try:
            fd, size = open_trusted_heap(path, owners)
        except UntrustedPathError as exc:
            raise ValueError(f"cannot map buffer {buffer_id}: {exc}") from exc
        except OSError as exc:
            raise ValueError(
                f"cannot map buffer {buffer_id}: heap {path}: {exc.strerror} "
                "(map_buffer works on the daemon's host, as its user)"
            ) from exc
        try:
            if offset + nbytes > size:
                raise ValueError(
                    f"cannot map buffer {buffer_id}: its bytes [{offset}, {offset + nbytes}) "
                    f"lie outside heap {path} of {size} bytes"
                )
            if need == 0:
                return np.zeros(shape, dtype=dt)  # no bytes to share: nothing to map
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            region = mmap.mmap(fd, offset + need - start, flags=mmap.MAP_SHARED, offset=start)
        finally:
            os.close(fd)
        # The array keeps ``region`` alive; it is unmapped when the array is collected.
        return np.ndarray(shape, dtype=dt, buffer=region, offset=offset - start)

    def _find_buffer(self, listing: Any, buffer_id: int) -> Any:
        for info in listing.buffers:
            if info.buffer_id == buffer_id:
                return info
        raise KeyError(f"cannot map buffer {buffer_id}: no such buffer")

    def _open(self) -> None:
        raise NotImplementedError  # each client opens its own kind of channel


class Client(_Base):
    """Blocking client; one channel, closed by :meth:`close` (or ``with``).

    ``target``: socket path, ``unix:`` URI, or ``host:port`` (TLS; ``token`` or
    ``token_file`` for the bearer token, ``root_certificates`` for a private CA,
    ``client_cert``/``client_key`` for mutual TLS, ``server_name`` to override
    the name checked against the certificate). ``timeout`` is the default
    deadline of unary calls (None = no deadline). A Unix socket is checked first:
    ``UntrustedPathError`` (a ``PermissionError``) when a user other than this one or
    root could have put it, or its directory, there (see :mod:`simpler_daemon.localtrust`).
    """

    def _open(self) -> None:
        if self.credentials is not None:
            self.channel = grpc.secure_channel(self.address, self.credentials, self.options)
        else:
            self.channel = grpc.insecure_channel(self.address, self.options)
        self.stub = pb_grpc.DaemonStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        return method(request, timeout=timeout or self.timeout, metadata=self.metadata)

    # -- info -----------------------------------------------------------------------

    def get_info(self) -> pb.GetInfoResponse:
        return self._call(self.stub.GetInfo, pb.GetInfoRequest())  # type: ignore[no-any-return]

    def list_workers(self) -> list[pb.WorkerInfo]:
        return list(self._call(self.stub.ListWorkers, pb.ListWorkersRequest()).workers)

    # -- callables ---------------------------------------------------------------------

    def register_callable(
        self, import_path: str, kind: str = "sub", workers: Sequence[int] = ()
    ) -> pb.RegisterCallableResponse:
        request = register_request(import_path, kind, workers)
        return self._call(self.stub.RegisterCallable, request)  # type: ignore[no-any-return]

    def register(self, import_path: str, kind: str = "sub") -> str:
        """Register ``module:qualname``; returns its hashid."""
        return self.register_callable(import_path, kind).hashid

    def unregister(self, hashid: str) -> int:
        """Drop one reference; returns the references left."""
        request = pb.UnregisterCallableRequest(hashid=hashid)
        return int(self._call(self.stub.UnregisterCallable, request).refcount)

    def list_callables(self) -> list[pb.CallableInfo]:
        return list(self._call(self.stub.ListCallables, pb.ListCallablesRequest()).callables)

    # -- buffers ----------------------------------------------------------------------

    def alloc_buffer(
        self, shape: Sequence[int], dtype: Any, label: str = ""
    ) -> pb.AllocBufferResponse:
        request = alloc_request(shape, dtype, label)
        return self._call(self.stub.AllocBuffer, request)  # type: ignore[no-any-return]

    def _max_chunk(self, chunk: int | None) -> int:
        if self._chunk is None:
            self._chunk = int(self.get_info().limits.max_message_bytes)
        return write_chunk(self._chunk, chunk)

    def write_buffer(
        self,
        buffer_id: int,
        data: bytes | memoryview | np.ndarray[Any, Any],
        *,
        offset: int = 0,
        generation: int = 0,
        chunk_bytes: int | None = None,
    ) -> int:
        """Write ``data`` at ``offset``; returns the bytes written."""
        payload = array_bytes(data) if isinstance(data, np.ndarray) else data
        chunk = self._max_chunk(chunk_bytes)
        response = self.stub.WriteBuffer(
            write_requests(buffer_id, payload, offset, generation, chunk),
            timeout=self.timeout,
            metadata=self.metadata,
        )
        return int(response.bytes_written)

    def read_buffer(
        self,
        buffer_id: int,
        *,
        offset: int = 0,
        length: int = 0,
        generation: int = 0,
        chunk_bytes: int = 0,
    ) -> bytes:
        """The bytes ``[offset, offset + length)`` (length 0 = to the end)."""
        request = read_request(buffer_id, offset, length, generation, chunk_bytes)
        stream = self.stub.ReadBuffer(request, timeout=self.timeout, metadata=self.metadata)
        return b"".join(chunk.data for chunk in stream)

    def free_buffer(self, buffer_id: int, generation: int = 0) -> bool:
        """Free a buffer; True when its memory is released later (still referenced)."""
        request = pb.FreeBufferRequest(buffer_id=buffer_id, generation=generation)
        return bool(self._call(self.stub.FreeBuffer, request).deferred)

    def list_buffers(self) -> pb.ListBuffersResponse:
        return self._call(self.stub.ListBuffers, pb.ListBuffersRequest())  # type: ignore[no-any-return]

    def map_buffer(self, buffer_id: int) -> np.ndarray[Any, Any]:
        """A NumPy array over the buffer's bytes in the daemon's shared heap: writes are
        seen by tasks without any copy. Only that buffer's pages are mapped, from a heap
        file the client trusts. Local clients only (same host, the daemon's user);
        raises ``KeyError`` for a buffer the caller cannot list, ``ValueError`` otherwise
        or when the heap is not shared or not trusted."""
        return self._view(self._find_buffer(self.list_buffers(), buffer_id))

    def alloc_array(self, array: np.ndarray[Any, Any], label: str = "") -> int:
        """Allocate a buffer shaped like ``array``, copy it in; returns the buffer id."""
        arr = np.asarray(array)
        buffer_id = int(self.alloc_buffer(arr.shape, arr.dtype, label).buffer_id)
        if arr.nbytes:
            self.write_buffer(buffer_id, arr)
        return buffer_id

    def read_array(self, buffer_id: int, shape: Sequence[int], dtype: Any) -> np.ndarray[Any, Any]:
        """The buffer's first ``prod(shape)`` elements as a new array."""
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        data = self.read_buffer(buffer_id, length=count * dt.itemsize) if count else b""
        return np.frombuffer(data, dtype=dt, count=count).reshape(tuple(shape)).copy()

    # -- runs ---------------------------------------------------------------------------

    def submit_run(
        self,
        tasks: Sequence[pb.Task],
        *,
        idempotency_key: str = "",
        label: str = "",
        wait_seconds: float | None = None,
    ) -> pb.SubmitRunResponse:
        wait = check_wait(wait_seconds, "wait_seconds")
        request = submit_request(tasks, idempotency_key, label, wait)
        timeout = self.timeout if wait is None else call_deadline(wait, DEFAULT_TIMEOUT)
        # Not through _call: a None deadline here means "no limit", not "the default".
        return self.stub.SubmitRun(request, timeout=timeout, metadata=self.metadata)  # type: ignore[no-any-return]

    def run(
        self, tasks: Sequence[pb.Task], timeout: float = 3600.0, *, label: str = ""
    ) -> pb.RunStatus:
        """Submit and wait in one round trip; raises like :meth:`wait`."""
        response = self.submit_run(tasks, label=label, wait_seconds=timeout)
        return raise_for_status(response.status)

    def submit(
        self, tasks: Sequence[pb.Task], *, idempotency_key: str = "", label: str = ""
    ) -> int:
        """Submit a run of ``tasks``; returns its run id."""
        return int(self.submit_run(tasks, idempotency_key=idempotency_key, label=label).run_id)

    def run_orchestration(
        self,
        hashid: str,
        args: pb.Args | None = None,
        config: pb.CallConfig | None = None,
        *,
        idempotency_key: str = "",
        label: str = "",
    ) -> int:
        """Run a registered orchestration function in the daemon; returns the run id."""
        request = orchestration_request(hashid, args, config, idempotency_key, label)
        return int(self._call(self.stub.RunOrchestration, request).run_id)

    def watch(self, run_id: int, after_sequence: int = 0) -> Iterator[pb.RunEvent]:
        """Events of a run: a SNAPSHOT, then every change until a terminal RUN_STATE."""
        request = pb.WatchRunRequest(run_id=run_id, after_sequence=after_sequence)
        call = self.stub.WatchRun(request, metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def wait_run(self, run_id: int, timeout: float | None = None) -> pb.RunStatus:
        """The run's status once terminal or after ``timeout`` seconds (no exception)."""
        wait = check_wait(timeout, "timeout")
        request = wait_request(run_id, wait)
        deadline = call_deadline(wait, DEFAULT_TIMEOUT)
        return self.stub.WaitRun(request, timeout=deadline, metadata=self.metadata)  # type: ignore[no-any-return]

    def wait(self, run_id: int, timeout: float | None = None) -> pb.RunStatus:
        """Wait for a run; raises ``TaskError``/``RunCancelled`` when it failed and
        ``TimeoutError`` when it is still running after ``timeout`` seconds."""
        return raise_for_status(self.wait_run(run_id, timeout))

    def cancel(self, run_id: int, reason: str = "") -> pb.CancelRunResponse:
        request = pb.CancelRunRequest(run_id=run_id, reason=reason)
        return self._call(self.stub.CancelRun, request)  # type: ignore[no-any-return]

    # -- operations ---------------------------------------------------------------------

    def add_remote_worker(
        self, endpoint: str, num_sub_workers: int = 0, num_chips: int = 0, **options: Any
    ) -> int:
        """Open a session on a simpler-remote-worker (level-4 daemon); its worker id.

        ``options``: the other ``AddRemoteWorkerRequest`` fields (``session_timeout_s``,
        ``heap_bytes``, ``token_file``, ``tls_ca_file``...).
        """
        request = add_remote_request(endpoint, num_sub_workers, num_chips, options)
        return int(self._call(self.stub.AddRemoteWorker, request).worker_id)

    def drain(self, grace: float | None = None, shutdown: bool = False) -> pb.DrainResponse:
        request = drain_request(grace, shutdown)
        timeout = None if grace is None else call_deadline(request.grace_seconds, DEFAULT_TIMEOUT)
        return self.stub.Drain(request, timeout=timeout, metadata=self.metadata)  # type: ignore[no-any-return]


class AsyncClient(_Base):
    """The same API for asyncio (``grpc.aio``); ``watch`` is an async iterator."""

    def _open(self) -> None:
        if self.credentials is not None:
            self.channel = grpc.aio.secure_channel(self.address, self.credentials, self.options)
        else:
            self.channel = grpc.aio.insecure_channel(self.address, self.options)
        self.stub = pb_grpc.DaemonStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        return await method(request, timeout=timeout or self.timeout, metadata=self.metadata)

    async def get_info(self) -> pb.GetInfoResponse:
        return await self._call(self.stub.GetInfo, pb.GetInfoRequest())  # type: ignore[no-any-return]

    async def list_workers(self) -> list[pb.WorkerInfo]:
        return list((await self._call(self.stub.ListWorkers, pb.ListWorkersRequest())).workers)

    async def register_callable(
        self, import_path: str, kind: str = "sub", workers: Sequence[int] = ()
    ) -> pb.RegisterCallableResponse:
        request = register_request(import_path, kind, workers)
        return await self._call(self.stub.RegisterCallable, request)  # type: ignore[no-any-return]

    async def register(self, import_path: str, kind: str = "sub") -> str:
        return (await self.register_callable(import_path, kind)).hashid

    async def unregister(self, hashid: str) -> int:
        request = pb.UnregisterCallableRequest(hashid=hashid)
        return int((await self._call(self.stub.UnregisterCallable, request)).refcount)

    async def list_callables(self) -> list[pb.CallableInfo]:
        response = await self._call(self.stub.ListCallables, pb.ListCallablesRequest())
        return list(response.callables)

    async def alloc_buffer(
        self, shape: Sequence[int], dtype: Any, label: str = ""
    ) -> pb.AllocBufferResponse:
        request = alloc_request(shape, dtype, label)
        return await self._call(self.stub.AllocBuffer, request)  # type: ignore[no-any-return]

    async def _max_chunk(self, chunk: int | None) -> int:
        if self._chunk is None:
            self._chunk = int((await self.get_info()).limits.max_message_bytes)
        return write_chunk(self._chunk, chunk)

    async def write_buffer(
        self,
        buffer_id: int,
        data: bytes | memoryview | np.ndarray[Any, Any],
        *,
        offset: int = 0,
        generation: int = 0,
        chunk_bytes: int | None = None,
    ) -> int:
        payload = array_bytes(data) if isinstance(data, np.ndarray) else data
        chunk = await self._max_chunk(chunk_bytes)
        response = await self.stub.WriteBuffer(
            write_requests(buffer_id, payload, offset, generation, chunk),
            timeout=self.timeout,
            metadata=self.metadata,
        )
        return int(response.bytes_written)

    async def read_buffer(
        self,
        buffer_id: int,
        *,
        offset: int = 0,
        length: int = 0,
        generation: int = 0,
        chunk_bytes: int = 0,
    ) -> bytes:
        request = read_request(buffer_id, offset, length, generation, chunk_bytes)
        parts = [
            chunk.data
            async for chunk in self.stub.ReadBuffer(
                request, timeout=self.timeout, metadata=self.metadata
            )
        ]
        return b"".join(parts)

    async def free_buffer(self, buffer_id: int, generation: int = 0) -> bool:
        request = pb.FreeBufferRequest(buffer_id=buffer_id, generation=generation)
        return bool((await self._call(self.stub.FreeBuffer, request)).deferred)

    async def map_buffer(self, buffer_id: int) -> np.ndarray[Any, Any]:
        """See :meth:`Client.map_buffer`."""
        return self._view(self._find_buffer(await self.list_buffers(), buffer_id))

    async def list_buffers(self) -> pb.ListBuffersResponse:
        return await self._call(self.stub.ListBuffers, pb.ListBuffersRequest())  # type: ignore[no-any-return]

    async def alloc_array(self, array: np.ndarray[Any, Any], label: str = "") -> int:
        arr = np.asarray(array)
        buffer_id = int((await self.alloc_buffer(arr.shape, arr.dtype, label)).buffer_id)
        if arr.nbytes:
            await self.write_buffer(buffer_id, arr)
        return buffer_id

    async def read_array(
        self, buffer_id: int, shape: Sequence[int], dtype: Any
    ) -> np.ndarray[Any, Any]:
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        data = await self.read_buffer(buffer_id, length=count * dt.itemsize) if count else b""
        return np.frombuffer(data, dtype=dt, count=count).reshape(tuple(shape)).copy()

    async def run(
        self, tasks: Sequence[pb.Task], timeout: float = 3600.0, *, label: str = ""
    ) -> pb.RunStatus:
        """Submit and wait in one round trip; raises like :meth:`wait`."""
        response = await self.submit_run(tasks, label=label, wait_seconds=timeout)
        return raise_for_status(response.status)

    async def submit_run(
        self,
        tasks: Sequence[pb.Task],
        *,
        idempotency_key: str = "",
        label: str = "",
        wait_seconds: float | None = None,
    ) -> pb.SubmitRunResponse:
        wait = check_wait(wait_seconds, "wait_seconds")
        request = submit_request(tasks, idempotency_key, label, wait)
        timeout = self.timeout if wait is None else call_deadline(wait, DEFAULT_TIMEOUT)
        return await self.stub.SubmitRun(request, timeout=timeout, metadata=self.metadata)  # type: ignore[no-any-return]

    async def submit(
        self, tasks: Sequence[pb.Task], *, idempotency_key: str = "", label: str = ""
    ) -> int:
        response = await self.submit_run(tasks, idempotency_key=idempotency_key, label=label)
        return int(response.run_id)

    async def run_orchestration(
        self,
        hashid: str,
        args: pb.Args | None = None,
        config: pb.CallConfig | None = None,
        *,
        idempotency_key: str = "",
        label: str = "",
    ) -> int:
        request = orchestration_request(hashid, args, config, idempotency_key, label)
        return int((await self._call(self.stub.RunOrchestration, request)).run_id)

    async def watch(self, run_id: int, after_sequence: int = 0) -> AsyncIterator[pb.RunEvent]:
        request = pb.WatchRunRequest(run_id=run_id, after_sequence=after_sequence)
        call = self.stub.WatchRun(request, metadata=self.metadata)
        try:
            async for event in call:
                yield event
        finally:
            call.cancel()

    async def wait_run(self, run_id: int, timeout: float | None = None) -> pb.RunStatus:
        wait = check_wait(timeout, "timeout")
        request = wait_request(run_id, wait)
        deadline = call_deadline(wait, DEFAULT_TIMEOUT)
        return await self.stub.WaitRun(request, timeout=deadline, metadata=self.metadata)  # type: ignore[no-any-return]

    async def wait(self, run_id: int, timeout: float | None = None) -> pb.RunStatus:
        return raise_for_status(await self.wait_run(run_id, timeout))

    async def cancel(self, run_id: int, reason: str = "") -> pb.CancelRunResponse:
        request = pb.CancelRunRequest(run_id=run_id, reason=reason)
        return await self._call(self.stub.CancelRun, request)  # type: ignore[no-any-return]

    async def add_remote_worker(
        self, endpoint: str, num_sub_workers: int = 0, num_chips: int = 0, **options: Any
    ) -> int:
        """See :meth:`Client.add_remote_worker`."""
        request = add_remote_request(endpoint, num_sub_workers, num_chips, options)
        return int((await self._call(self.stub.AddRemoteWorker, request)).worker_id)

    async def drain(self, grace: float | None = None, shutdown: bool = False) -> pb.DrainResponse:
        request = drain_request(grace, shutdown)
        timeout = None if grace is None else call_deadline(request.grace_seconds, DEFAULT_TIMEOUT)
        return await self.stub.Drain(request, timeout=timeout, metadata=self.metadata)  # type: ignore[no-any-return]
