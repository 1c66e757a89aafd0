"""The daemon's two clients: ``Client`` (blocking) and ``AsyncClient``.

::

    from simpler_daemon.client import Client, sub_task, tensor

    with Client() as c:                                   # the default socket
        add = c.register("simpler_daemon.examples.tasks:add")
        a, b = c.alloc_array(np.ones(8, "float32")), c.alloc_array(np.arange(8, dtype="float32"))
        out = c.alloc_buffer((8,), "float32").buffer_id
        fut = c.submit([sub_task(add, [tensor(a, "input", (8,), "float32"),
                                       tensor(b, "input", (8,), "float32"),
                                       tensor(out, "output", (8,), "float32")])])
        fut.result(timeout=10)                            # TaskError if the run failed
        print(c.read_array(out, (8,), "float32"))

Targets: a Unix socket path (``/run/simpler-daemon/daemon.sock`` or
``unix:/path``), or ``host:port`` over TLS with a bearer token.

What comes back is plain Python (:mod:`simpler_daemon.client.results`): ``submit``
returns a :class:`RunFuture` (also the run id, an ``int``), ``run`` / ``wait`` /
``RunFuture.result`` a :class:`RunResult` with the tasks' return values, and raise
``TaskError`` (``RunCancelled`` for a cancelled run) or ``TimeoutError``. Every
other failure is a :class:`~simpler_daemon.client.errors.DaemonError` subclass chosen by
the status code (``InvalidArgument``, ``NotFound``, ``PermissionDenied``...), with
``.field`` naming the offending request field; it is also a ``grpc.RpcError``
(``.code()``, ``.details()``). Buffer and callable calls still return the
protobuf messages of the API.

Local clients call over the daemon's fast path (``daemon.fast.sock`` beside the
socket, :mod:`simpler_daemon.client.fastpath`) when it exists, else over gRPC: same
requests, answers and errors (``transport=`` / ``$SIMPLER_DAEMON_TRANSPORT`` pick one).

This module holds the calls of both clients and their per-call deadlines; the
target, TLS, token and transport they share are :mod:`simpler_daemon.client.base`, the
same-host zero-copy view of the heap is :mod:`simpler_daemon.client.heapview`, every
request is built by :mod:`simpler_daemon.client.requests`.
"""

from __future__ import annotations

import json
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Sequence,
)
from types import EllipsisType
from typing import Any, TypeVar

import grpc
import numpy as np

from simpler_daemon.client.asyncfast import AsyncFastTransport
from simpler_daemon.client.base import (
    DEFAULT_TIMEOUT,
    _Base,
    mapped_errors,
)
from simpler_daemon.client.errors import DaemonError
from simpler_daemon.client.fastpath import FastTransport
from simpler_daemon.client.mapping import map_items
from simpler_daemon.client.requests import (
    add_remote_request,
    alloc_request,
    array_bytes,
    call_deadline,
    cancel_request,
    check_wait,
    drain_request,
    list_runs_request,
    orchestration_request,
    read_request,
    register_request,
    submit_request,
    trace_request,
    wait_request,
    write_chunk,
    write_requests,
)
from simpler_daemon.client.results import (
    AsyncRunFuture,
    CancelResult,
    DoneWatcher,
    RunFuture,
    RunResult,
    RunSummaryInfo,
    cancel_result,
    check_result,
    run_result,
    run_summary,
)
from simpler_daemon.client.retry import new_key, safe_to_repeat
from simpler_daemon.client.session import AsyncSessionLease, SessionLease, session_lost
from simpler_daemon.mapcommon import DEFAULT_CHUNKSIZE
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

__all__ = ["AsyncClient", "Client"]

T = TypeVar("T")


class Client(_Base):
    """Blocking client; one channel, closed by :meth:`close` (or ``with``).

    ``target``: socket path, ``unix:`` URI, or ``host:port`` (TLS; ``token`` or
    ``token_file`` for the bearer token, ``root_certificates`` for a private CA,
    ``client_cert``/``client_key`` for mutual TLS, ``server_name`` to override
    the name checked against the certificate). ``timeout`` is the default
    deadline of unary calls (None = no deadline). A Unix socket is checked first:
    ``UntrustedPathError`` (a ``PermissionError``) when a user other than this one or
    root could have put it, or its directory, there (see :mod:`simpler_daemon.system.localtrust`).
    ``transport``: ``"auto"`` (the daemon's local fast path when its socket is beside a
    Unix target, else gRPC; ``$SIMPLER_DAEMON_TRANSPORT`` overrides it), ``"fast"``
    (``Unavailable`` without a fast socket) or ``"grpc"``; :attr:`transport` tells.
    ``retry``: how calls safe to repeat (reads, submits: each gets an idempotency key
    when given none) are retried on UNAVAILABLE and on a RESOURCE_EXHAUSTED that carries
    the daemon's retry-after hint (:class:`~simpler_daemon.client.retry.RetryPolicy`:
    capped exponential backoff with full jitter, 30 s in all by default); None: never.

    Every refusal or transport failure is a :class:`~simpler_daemon.client.errors.DaemonError`
    subclass (also a ``grpc.RpcError``), never a raw gRPC error.
    """

    def _open(self) -> None:
        self._lease = SessionLease(self._lease_socket())
        self._fast: FastTransport | None = None
        if self._fast_path is not None:
            self._fast = FastTransport(self._fast_path, self.client_id, self.spin_us)
        else:
            self._channel = self._new_channel()
        self._done_watcher = DoneWatcher()

    def _new_channel(self) -> Any:
        if self.credentials is not None:
            return grpc.secure_channel(self.address, self.credentials, self.options)
        return grpc.insecure_channel(self.address, self.options)

    @property
    def done_watcher(self) -> DoneWatcher:
        """The one thread that runs every ``RunFuture.add_done_callback`` of this client
        (see :class:`~simpler_daemon.client.results.DoneWatcher`)."""
        return self._done_watcher

    def close(self) -> None:
        self._lease.end(closing=True)  # the daemon releases its session's registrations
        if self._fast is not None:
            self._fast.close()
        if self._channel is not None:
            self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        method: str,
        request: Any,
        timeout: float | EllipsisType | None = ...,
        tasks: Sequence[pb.Task] | None = None,
    ) -> Any:
        """One unary (or client-streaming) call of RPC ``method``; ``timeout`` ``...`` =
        the client's default, None = no deadline. Retried per :attr:`retry` when safe.
        ``tasks``: a SubmitRun's tasks as given (the fast path reads them, not the
        request's copies)."""
        deadline = self.timeout if timeout is ... else timeout
        return self._retried(
            method, request, lambda: self._call_once(method, request, deadline, tasks)
        )

    def _retried(self, method: str, request: Any, attempt: Callable[[], T]) -> T:
        """``attempt()``, retried per :attr:`retry` when ``method`` is safe to repeat."""
        if self.retry is None or not safe_to_repeat(method, request):
            return attempt()
        return self.retry.call(attempt)

    def _call_once(
        self, method: str, request: Any, deadline: float | None, tasks: Any = None
    ) -> Any:
        if self._fast is not None:
            return self._fast.unary(method, request, deadline, tasks)
        with mapped_errors():
            return getattr(self.stub, method)(request, timeout=deadline, metadata=self.metadata)

    def _stream(self, method: str, request: Any, timeout: float | None) -> Iterator[Any]:
        """A server-streaming call: its messages; left early, the call is cancelled."""
        if self._fast is not None:
            yield from self._fast.stream(method, request, timeout)
            return
        call = getattr(self.stub, method)(request, timeout=timeout, metadata=self.metadata)
        try:
            with mapped_errors():
                yield from call
        finally:
            call.cancel()

    # -- info -----------------------------------------------------------------------

    def get_info(self) -> pb.GetInfoResponse:
        return self._call("GetInfo", pb.GetInfoRequest())  # type: ignore[no-any-return]

    def list_workers(self) -> list[pb.WorkerInfo]:
        return list(self._call("ListWorkers", pb.ListWorkersRequest()).workers)

    def discovery(self) -> pb.DiscoveryInfo:
        """``[workers.discovery]``'s view (``dns`` empty when it is off)."""
        return self._call("ListWorkers", pb.ListWorkersRequest()).discovery  # type: ignore[no-any-return]

    # -- callables ---------------------------------------------------------------------

    def register_callable(
        self,
        import_path: str,
        kind: str = "sub",
        workers: Sequence[int] = (),
        *,
        reload: bool = False,
        persist: bool = False,
    ) -> pb.RegisterCallableResponse:
        request = register_request(import_path, kind, workers, reload)
        if persist or reload:  # a reload adds no reference
            request.persist = persist
            return self._call("RegisterCallable", request)  # type: ignore[no-any-return]
        for retry in (False, True):
            request.session = self._lease.current(
                self._fast, lambda: self.stub, self.metadata, self.tcp
            )
            try:
                return self._call("RegisterCallable", request)  # type: ignore[no-any-return]
            except DaemonError as exc:
                if retry or not session_lost(exc):
                    raise
                self._lease.lost(request.session)  # the connection was lost meanwhile
        raise AssertionError("unreachable")  # pragma: no cover

    def register(
        self, import_path: str, kind: str = "sub", *, reload: bool = False, persist: bool = False
    ) -> str:
        """Register ``module:qualname``; returns its hashid. ``reload``: re-import the
        module in every worker (edited code) even when it is registered already.

        The reference belongs to this client's session: registering the same path again
        adds none, and the daemon releases it when the client closes, its connection
        ends or its process dies. ``persist``: keep it until :meth:`unregister`."""
        return self.register_callable(import_path, kind, reload=reload, persist=persist).hashid

    def unregister(self, hashid: str) -> int:
        """Drop one reference (this client's session's first); returns the references left."""
        request = pb.UnregisterCallableRequest(hashid=hashid, session=self._lease.id)
        return int(self._call("UnregisterCallable", request).refcount)

    def list_callables(self) -> list[pb.CallableInfo]:
        return list(self._call("ListCallables", pb.ListCallablesRequest()).callables)

    # -- buffers ----------------------------------------------------------------------

    def alloc_buffer(
        self, shape: Sequence[int], dtype: Any, label: str = ""
    ) -> pb.AllocBufferResponse:
        request = alloc_request(shape, dtype, label)
        return self._call("AllocBuffer", request)  # type: ignore[no-any-return]

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
        requests = write_requests(buffer_id, payload, offset, generation, chunk)
        return int(self._call("WriteBuffer", requests).bytes_written)

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

        def read() -> bytes:  # repeated whole when it fails retryably
            return b"".join(
                chunk.data for chunk in self._stream("ReadBuffer", request, self.timeout)
            )

        return self._retried("ReadBuffer", request, read)

    def free_buffer(self, buffer_id: int, generation: int = 0) -> bool:
        """Free a buffer; True when its memory is released later (still referenced)."""
        request = pb.FreeBufferRequest(buffer_id=buffer_id, generation=generation)
        return bool(self._call("FreeBuffer", request).deferred)

    def list_buffers(self) -> pb.ListBuffersResponse:
        return self._call("ListBuffers", pb.ListBuffersRequest())  # type: ignore[no-any-return]

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
        priority: int = 1,
        include_results: bool = False,
    ) -> pb.SubmitRunResponse:
        """The raw SubmitRun: the response message (``status`` set with ``wait_seconds``).
        Without an ``idempotency_key`` one is made up (when :attr:`retry` is set), so that
        a retry after a lost reply is answered with the run, not a second one."""
        wait = check_wait(wait_seconds, "wait_seconds")
        key = idempotency_key or (new_key() if self.retry is not None else "")
        request = submit_request(tasks, key, label, wait, priority, include_results)
        timeout = self.timeout if wait is None else call_deadline(wait, DEFAULT_TIMEOUT)
        given = tasks if isinstance(tasks, (list, tuple)) else None  # not an iterator spent
        return self._call("SubmitRun", request, timeout, given)  # type: ignore[no-any-return]

    def run(
        self,
        tasks: Sequence[pb.Task],
        timeout: float = 3600.0,
        *,
        label: str = "",
        priority: int = 1,
    ) -> RunResult:
        """Submit and wait in one round trip; the result with the tasks' return values.
        Raises like :meth:`wait`."""
        response = self.submit_run(
            tasks, label=label, wait_seconds=timeout, priority=priority, include_results=True
        )
        return check_result(run_result(response.status))

    def submit(
        self,
        tasks: Sequence[pb.Task],
        *,
        idempotency_key: str = "",
        label: str = "",
        priority: int = 1,
    ) -> RunFuture:
        """Submit a run of ``tasks``; a :class:`RunFuture` (also the run id, an int).
        ``priority`` (1 to 1000) weighs the run's share of the workers against this
        client's other runs under the daemon's ``fair`` admission."""
        response = self.submit_run(
            tasks, idempotency_key=idempotency_key, label=label, priority=priority
        )
        return RunFuture(response.run_id, self, deduplicated=response.deduplicated)

    def run_orchestration(
        self,
        hashid: str,
        args: pb.Args | None = None,
        config: pb.CallConfig | None = None,
        *,
        idempotency_key: str = "",
        label: str = "",
        priority: int = 1,
    ) -> RunFuture:
        """Run a registered orchestration function in the daemon; its :class:`RunFuture`
        (an ``idempotency_key`` is made up when none is given, as for :meth:`submit_run`)."""
        key = idempotency_key or (new_key() if self.retry is not None else "")
        request = orchestration_request(hashid, args, config, key, label, priority)
        response = self._call("RunOrchestration", request)
        return RunFuture(response.run_id, self, deduplicated=response.deduplicated)

    def future(self, run: int) -> RunFuture:
        """A :class:`RunFuture` for a run id (one submitted earlier, by any client of the
        same identity)."""
        return RunFuture(int(run), self)

    def watch(
        self, run: int, after_sequence: int = 0, *, timeout: float | None = None
    ) -> Generator[pb.RunEvent, None, None]:
        """Events of a run: a SNAPSHOT, then every change until a terminal RUN_STATE.
        ``timeout``: seconds for the whole stream (``DeadlineExceeded`` past it)."""
        request = pb.WatchRunRequest(run_id=int(run), after_sequence=after_sequence)
        deadline = call_deadline(check_wait(timeout, "timeout"), 0.0)
        yield from self._stream("WatchRun", request, deadline)

    def wait_run(
        self, run: int, timeout: float | None = None, *, include_results: bool = False
    ) -> RunResult:
        """The run's status once terminal or after ``timeout`` seconds (no exception for a
        failed run); ``include_results``: with the tasks' return values once terminal."""
        wait = check_wait(timeout, "timeout")
        request = wait_request(run, wait, include_results)
        status = self._call("WaitRun", request, call_deadline(wait, DEFAULT_TIMEOUT))
        return run_result(status)

    def wait(
        self, run: int, timeout: float | None = None, *, include_results: bool = True
    ) -> RunResult:
        """Wait for a run; raises ``TaskError``/``RunCancelled`` when it failed and
        ``TimeoutError`` when it is still running after ``timeout`` seconds."""
        return check_result(self.wait_run(run, timeout, include_results=include_results))

    def cancel(self, run: int, reason: str = "", *, terminate: bool = False) -> CancelResult:
        """Cancel a run: its tasks not started never start; ``terminate`` also stops the
        running ones (their workers are killed and replaced)."""
        request = cancel_request(run, reason, terminate)
        return cancel_result(self._call("CancelRun", request))

    def map(
        self,
        hashid: str,
        iterable: Iterable[Any],
        *,
        chunksize: int = DEFAULT_CHUNKSIZE,
        config: pb.CallConfig | None = None,
        timeout: float | None = None,
        label: str = "map",
    ) -> Iterator[Any]:
        """SUB callable ``hashid`` once per item (its single value), the results yielded
        in order; runs of ``chunksize`` tasks (``client/mapping.py``)."""
        return map_items(self, hashid, iterable, chunksize, config, timeout, label)

    def trace(self, run: int) -> dict[str, Any]:
        """The run's task stream as a Chrome trace (``{"traceEvents": [...]}``, one event
        per task attempt; Perfetto opens it), kept while the daemon keeps the run."""
        response = self._call("GetRunTrace", trace_request(run))
        return json.loads(response.trace_json)  # type: ignore[no-any-return]

    def list_runs(self, states: Iterable[int | str] = (), limit: int = 0) -> list[RunSummaryInfo]:
        """Runs the daemon knows, newest first: this client's (an admin's: everyone's),
        in ``states`` (names such as ``"failed"`` or ``RunPhase`` values; empty = all), at
        most ``limit`` (0 = 100). Finished runs are kept up to the daemon's
        limits.max_finished_runs_kept."""
        response = self._call("ListRuns", list_runs_request(states, limit))
        return [run_summary(row) for row in response.runs]

    # -- operations ---------------------------------------------------------------------

    def add_remote_worker(
        self, endpoint: str, num_sub_workers: int = 0, num_chips: int = 0, **options: Any
    ) -> int:
        """Open a session on a simpler-remote-worker (level-4 daemon); its worker id.

        ``options``: the other ``AddRemoteWorkerRequest`` fields (``session_timeout_s``,
        ``heap_bytes``, ``token_file``, ``tls_ca_file``...).
        """
        request = add_remote_request(endpoint, num_sub_workers, num_chips, options)
        return int(self._call("AddRemoteWorker", request).worker_id)

    def drain(self, grace: float | None = None, shutdown: bool = False) -> pb.DrainResponse:
        request = drain_request(grace, shutdown)
        timeout = None if grace is None else call_deadline(request.grace_seconds, DEFAULT_TIMEOUT)
        return self._call("Drain", request, timeout)  # type: ignore[no-any-return]

    def resume(self) -> bool:
        """Undo a drain (admin): the daemon admits runs again and its health is SERVING.
        False when it was not draining; ``FailedPrecondition`` when it is shutting down."""
        return bool(self._call("Resume", pb.ResumeRequest()).was_draining)


class AsyncClient(_Base):
    """The same API for asyncio (``grpc.aio``); ``watch`` is an async iterator and
    ``submit`` returns an :class:`AsyncRunFuture` (``await`` it for the result)."""

    def _open(self) -> None:
        if self._spin_given:
            raise ValueError(
                "cannot create an AsyncClient with spin_us: its event loop waits for the "
                "replies (spin_us is the blocking Client's)"
            )
        self._lease = AsyncSessionLease()
        self._fast: AsyncFastTransport | None = None
        if self._fast_path is not None:
            self._fast = AsyncFastTransport(self._fast_path, self.client_id)
        else:
            self._channel = self._new_channel()

    def _new_channel(self) -> Any:
        if self.credentials is not None:
            return grpc.aio.secure_channel(self.address, self.credentials, self.options)
        return grpc.aio.insecure_channel(self.address, self.options)

    async def close(self) -> None:
        self._lease.end()
        if self._fast is not None:
            await self._fast.close()
        if self._channel is not None:
            await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self, method: str, request: Any, timeout: float | EllipsisType | None = ...
    ) -> Any:
        deadline = self.timeout if timeout is ... else timeout
        return await self._retried(
            method, request, lambda: self._call_once(method, request, deadline)
        )

    async def _retried(self, method: str, request: Any, attempt: Callable[[], Awaitable[T]]) -> T:
        """``await attempt()``, retried per :attr:`retry` when ``method`` is safe to repeat."""
        if self.retry is None or not safe_to_repeat(method, request):
            return await attempt()
        return await self.retry.call_async(attempt)

    async def _call_once(self, method: str, request: Any, deadline: float | None) -> Any:
        if self._fast is not None:
            return await self._fast.unary(method, request, deadline)
        with mapped_errors():
            call = getattr(self.stub, method)
            return await call(request, timeout=deadline, metadata=self.metadata)

    async def _stream(self, method: str, request: Any, timeout: float | None) -> AsyncIterator[Any]:
        if self._fast is not None:
            async for item in self._fast.stream(method, request, timeout):
                yield item
            return
        call = getattr(self.stub, method)(request, timeout=timeout, metadata=self.metadata)
        try:
            with mapped_errors():
                async for item in call:
                    yield item
        finally:
            call.cancel()

    async def get_info(self) -> pb.GetInfoResponse:
        return await self._call("GetInfo", pb.GetInfoRequest())  # type: ignore[no-any-return]

    async def list_workers(self) -> list[pb.WorkerInfo]:
        return list((await self._call("ListWorkers", pb.ListWorkersRequest())).workers)

    async def discovery(self) -> pb.DiscoveryInfo:
        """``[workers.discovery]``'s view (``dns`` empty when it is off)."""
        return (await self._call("ListWorkers", pb.ListWorkersRequest())).discovery  # type: ignore[no-any-return]

    async def register_callable(
        self,
        import_path: str,
        kind: str = "sub",
        workers: Sequence[int] = (),
        *,
        reload: bool = False,
        persist: bool = False,
    ) -> pb.RegisterCallableResponse:
        request = register_request(import_path, kind, workers, reload)
        if persist or reload:
            request.persist = persist
            return await self._call("RegisterCallable", request)  # type: ignore[no-any-return]
        for retry in (False, True):
            request.session = await self._lease.current(
                self._fast, lambda: self.stub, self.metadata
            )
            try:
                return await self._call("RegisterCallable", request)  # type: ignore[no-any-return]
            except DaemonError as exc:
                if retry or not session_lost(exc):
                    raise
                self._lease.lost(request.session)
        raise AssertionError("unreachable")  # pragma: no cover

    async def register(
        self, import_path: str, kind: str = "sub", *, reload: bool = False, persist: bool = False
    ) -> str:
        """As :meth:`Client.register`."""
        response = await self.register_callable(import_path, kind, reload=reload, persist=persist)
        return response.hashid

    async def unregister(self, hashid: str) -> int:
        request = pb.UnregisterCallableRequest(hashid=hashid, session=self._lease.id)
        return int((await self._call("UnregisterCallable", request)).refcount)

    async def list_callables(self) -> list[pb.CallableInfo]:
        response = await self._call("ListCallables", pb.ListCallablesRequest())
        return list(response.callables)

    async def alloc_buffer(
        self, shape: Sequence[int], dtype: Any, label: str = ""
    ) -> pb.AllocBufferResponse:
        request = alloc_request(shape, dtype, label)
        return await self._call("AllocBuffer", request)  # type: ignore[no-any-return]

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
        requests = write_requests(buffer_id, payload, offset, generation, chunk)
        return int((await self._call("WriteBuffer", requests)).bytes_written)

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

        async def read() -> bytes:  # repeated whole when it fails retryably
            stream = self._stream("ReadBuffer", request, self.timeout)
            return b"".join([chunk.data async for chunk in stream])

        return await self._retried("ReadBuffer", request, read)

    async def free_buffer(self, buffer_id: int, generation: int = 0) -> bool:
        request = pb.FreeBufferRequest(buffer_id=buffer_id, generation=generation)
        return bool((await self._call("FreeBuffer", request)).deferred)

    async def map_buffer(self, buffer_id: int) -> np.ndarray[Any, Any]:
        """See :meth:`Client.map_buffer`."""
        return self._view(self._find_buffer(await self.list_buffers(), buffer_id))

    async def list_buffers(self) -> pb.ListBuffersResponse:
        return await self._call("ListBuffers", pb.ListBuffersRequest())  # type: ignore[no-any-return]

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

    async def submit_run(
        self,
        tasks: Sequence[pb.Task],
        *,
        idempotency_key: str = "",
        label: str = "",
        wait_seconds: float | None = None,
        priority: int = 1,
        include_results: bool = False,
    ) -> pb.SubmitRunResponse:
        wait = check_wait(wait_seconds, "wait_seconds")
        key = idempotency_key or (new_key() if self.retry is not None else "")
        request = submit_request(tasks, key, label, wait, priority, include_results)
        timeout = self.timeout if wait is None else call_deadline(wait, DEFAULT_TIMEOUT)
        return await self._call("SubmitRun", request, timeout)  # type: ignore[no-any-return]

    async def run(
        self,
        tasks: Sequence[pb.Task],
        timeout: float = 3600.0,
        *,
        label: str = "",
        priority: int = 1,
    ) -> RunResult:
        """Submit and wait in one round trip; raises like :meth:`wait`."""
        response = await self.submit_run(
            tasks, label=label, wait_seconds=timeout, priority=priority, include_results=True
        )
        return check_result(run_result(response.status))

    async def submit(
        self,
        tasks: Sequence[pb.Task],
        *,
        idempotency_key: str = "",
        label: str = "",
        priority: int = 1,
    ) -> AsyncRunFuture:
        response = await self.submit_run(
            tasks, idempotency_key=idempotency_key, label=label, priority=priority
        )
        return AsyncRunFuture(response.run_id, self, deduplicated=response.deduplicated)

    async def run_orchestration(
        self,
        hashid: str,
        args: pb.Args | None = None,
        config: pb.CallConfig | None = None,
        *,
        idempotency_key: str = "",
        label: str = "",
        priority: int = 1,
    ) -> AsyncRunFuture:
        key = idempotency_key or (new_key() if self.retry is not None else "")
        request = orchestration_request(hashid, args, config, key, label, priority)
        response = await self._call("RunOrchestration", request)
        return AsyncRunFuture(response.run_id, self, deduplicated=response.deduplicated)

    def future(self, run: int) -> AsyncRunFuture:
        return AsyncRunFuture(int(run), self)

    async def watch(
        self, run: int, after_sequence: int = 0, *, timeout: float | None = None
    ) -> AsyncGenerator[pb.RunEvent, None]:
        request = pb.WatchRunRequest(run_id=int(run), after_sequence=after_sequence)
        deadline = call_deadline(check_wait(timeout, "timeout"), 0.0)
        async for event in self._stream("WatchRun", request, deadline):
            yield event

    async def wait_run(
        self, run: int, timeout: float | None = None, *, include_results: bool = False
    ) -> RunResult:
        wait = check_wait(timeout, "timeout")
        request = wait_request(run, wait, include_results)
        deadline = call_deadline(wait, DEFAULT_TIMEOUT)
        return run_result(await self._call("WaitRun", request, deadline))

    async def wait(
        self, run: int, timeout: float | None = None, *, include_results: bool = True
    ) -> RunResult:
        return check_result(await self.wait_run(run, timeout, include_results=include_results))

    async def cancel(self, run: int, reason: str = "", *, terminate: bool = False) -> CancelResult:
        request = cancel_request(run, reason, terminate)
        return cancel_result(await self._call("CancelRun", request))

    async def trace(self, run: int) -> dict[str, Any]:
        """See :meth:`Client.trace`."""
        response = await self._call("GetRunTrace", trace_request(run))
        return json.loads(response.trace_json)  # type: ignore[no-any-return]

    async def list_runs(
        self, states: Iterable[int | str] = (), limit: int = 0
    ) -> list[RunSummaryInfo]:
        response = await self._call("ListRuns", list_runs_request(states, limit))
        return [run_summary(row) for row in response.runs]

    async def add_remote_worker(
        self, endpoint: str, num_sub_workers: int = 0, num_chips: int = 0, **options: Any
    ) -> int:
        """See :meth:`Client.add_remote_worker`."""
        request = add_remote_request(endpoint, num_sub_workers, num_chips, options)
        return int((await self._call("AddRemoteWorker", request)).worker_id)

    async def drain(self, grace: float | None = None, shutdown: bool = False) -> pb.DrainResponse:
        request = drain_request(grace, shutdown)
        timeout = None if grace is None else call_deadline(request.grace_seconds, DEFAULT_TIMEOUT)
        return await self._call("Drain", request, timeout)  # type: ignore[no-any-return]

    async def resume(self) -> bool:
        return bool((await self._call("Resume", pb.ResumeRequest())).was_draining)
