"""The level-4 ``Worker``'s remote API, as a mixin over its ``RemoteFleet``.

Every call has a blocking form (the caller's thread drives, or the call is handed to
the bound loop) and an ``*_async`` form for code running on the Worker's loop. A
session is opened without holding the driver's lock, so a host that is slow to
answer never holds up the other workers' runs.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from simpler_daemon.errors import WorkerClosedError, WorkerStateError
from simpler_daemon.remote.spec import RemoteTensorRef, RemoteWorkerSpec

if TYPE_CHECKING:
    from simpler_daemon.engine.remote_l3 import RemoteFleet
    from simpler_daemon.scheduler.driver import Driver


class RemoteMethods:
    """``add_remote_worker``, remote buffers and their async forms (mixed into Worker)."""

    level: int
    startup_timeout: float
    _fleet: RemoteFleet
    _driver: Driver

    # Provided by Worker.
    def _check_usable(self, what: str) -> None:
        raise NotImplementedError

    def _check_ready(self, what: str) -> None:
        raise NotImplementedError

    def _is_new(self) -> bool:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _take_worker_id(self) -> int:
        raise NotImplementedError

    # -- sessions ---------------------------------------------------------------------------

    def add_remote_worker(self, spec: RemoteWorkerSpec) -> int:
        """Add a remote L3 worker and return its stable worker id.

        Before ``init`` the session opens during ``init`` (after every local fork,
        within the same startup deadline); after ``init`` it opens now.
        Raises ``StartupError`` naming the worker and endpoint when it cannot.
        """
        self._check_usable("add a remote worker")
        self._check_remote_spec(spec)
        if self._is_new():
            wid = self._take_worker_id()
            self._fleet.add(wid, spec)
            return wid
        loop = self._driver.bound_elsewhere()
        if loop is not None:
            fut = asyncio.run_coroutine_threadsafe(self.add_remote_worker_async(spec), loop)
            return fut.result()
        self._check_ready("add a remote worker")
        wid = self._take_worker_id()  # a failed attempt burns its id: ids are never reused
        self._fleet.add(wid, spec)
        try:
            ep = self._fleet.open_one(wid, time.monotonic() + self.startup_timeout)
        except BaseException:
            del self._fleet.specs[wid]
            raise
        with self._driver.lock:
            return self._attach(wid, ep)

    async def add_remote_worker_async(self, spec: RemoteWorkerSpec) -> int:
        """``add_remote_worker`` after ``init`` without blocking the event loop."""
        self._check_ready("add a remote worker")
        self._check_remote_spec(spec)
        wid = self._take_worker_id()
        self._fleet.add(wid, spec)
        try:
            ep = await asyncio.to_thread(
                self._fleet.open_one, wid, time.monotonic() + self.startup_timeout
            )
        except BaseException:
            del self._fleet.specs[wid]
            raise
        return self._attach(wid, ep)

    def _attach(self, wid: int, ep: Any) -> int:
        if not self._ready():
            ep.shutdown(0.5)
            raise WorkerClosedError(f"cannot add remote worker {wid}: the worker closed meanwhile")
        self._fleet.attach_live(wid, ep)
        return wid

    def _check_remote_spec(self, spec: Any) -> None:
        if self.level < 4:
            raise WorkerStateError(
                "cannot add a remote worker: only a level-4 Worker holds L3 workers "
                f"(this one is level {self.level})"
            )
        if not isinstance(spec, RemoteWorkerSpec):
            raise TypeError(
                f"cannot add a remote worker: expected a RemoteWorkerSpec, got {type(spec).__name__}"
            )

    # -- buffers ----------------------------------------------------------------------------

    def alloc_remote(
        self, worker: int, shape: tuple[int, ...] | int, dtype: Any = "float32"
    ) -> RemoteTensorRef:
        """A zero-filled buffer in remote worker ``worker``'s heap."""
        self._check_ready("alloc_remote")
        return self._driver.drive(self._fleet.alloc(worker, shape, dtype))  # type: ignore[no-any-return]

    async def alloc_remote_async(
        self, worker: int, shape: tuple[int, ...] | int, dtype: Any = "float32"
    ) -> RemoteTensorRef:
        self._check_ready("alloc_remote")
        return await self._fleet.alloc(worker, shape, dtype)

    def copy_to_remote(self, ref: RemoteTensorRef, array: Any) -> None:
        """Write ``array`` (same number of elements) into a remote buffer."""
        self._check_ready("copy_to_remote")
        self._driver.drive(self._fleet.copy_to(ref, array))

    async def copy_to_remote_async(self, ref: RemoteTensorRef, array: Any) -> None:
        self._check_ready("copy_to_remote")
        await self._fleet.copy_to(ref, array)

    def copy_from_remote(self, ref: RemoteTensorRef) -> np.ndarray[Any, Any]:
        """Read a remote buffer into a new NumPy array."""
        self._check_ready("copy_from_remote")
        return self._driver.drive(self._fleet.copy_from(ref))  # type: ignore[no-any-return]

    async def copy_from_remote_async(self, ref: RemoteTensorRef) -> np.ndarray[Any, Any]:
        self._check_ready("copy_from_remote")
        return await self._fleet.copy_from(ref)

    def import_remote(self, ref: RemoteTensorRef, worker: int) -> None:
        """Give remote ``worker`` a read-only snapshot of ``ref`` (its owner's bytes now)."""
        self._check_ready("import_remote")
        self._driver.drive(self._fleet.import_(ref, worker))

    async def import_remote_async(self, ref: RemoteTensorRef, worker: int) -> None:
        self._check_ready("import_remote")
        await self._fleet.import_(ref, worker)

    def release_remote(self, ref: RemoteTensorRef, worker: int) -> None:
        """Drop ``worker``'s imported snapshot of ``ref``."""
        self._check_ready("release_remote")
        self._driver.drive(self._fleet.release(ref, worker))

    async def release_remote_async(self, ref: RemoteTensorRef, worker: int) -> None:
        self._check_ready("release_remote")
        await self._fleet.release(ref, worker)

    async def free_remote_async(self, ref: RemoteTensorRef) -> None:
        """``free(ref)`` from the Worker's loop (deferred while a task still uses it)."""
        self._check_ready("free a remote buffer")
        await self._fleet.free(ref)
