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

    async def add_remote_worker_async(
        self, spec: RemoteWorkerSpec, *, worker_id: int | None = None
    ) -> int:
        """``add_remote_worker`` after ``init`` without blocking the event loop.

        ``worker_id``: an id from :meth:`reserve_worker_id` that no worker holds yet
        (discovery keeps one per address, so a retry after a failed open gets it again).
        """
        self._check_ready("add a remote worker")
        self._check_remote_spec(spec)
        fleet = self._fleet
        if worker_id is None:
            wid = self._take_worker_id()
        elif worker_id in fleet.reserved and worker_id not in fleet.specs:
            wid = worker_id
        else:
            raise ValueError(
                f"cannot add a remote worker as worker {worker_id}: that id is not reserved "
                "or a worker holds it already"
            )
        fleet.add(wid, spec)
        try:
            ep = await asyncio.to_thread(
                fleet.open_one, wid, time.monotonic() + self.startup_timeout
            )
        except BaseException:
            del fleet.specs[wid]
            raise
        fleet.reserved.discard(wid)
        return self._attach(wid, ep)

    def reserve_worker_id(self) -> int:
        """A worker id for a remote worker added later with ``add_remote_worker_async(...,
        worker_id=)``; never given to another worker."""
        self._check_ready("reserve a worker id")
        wid = self._take_worker_id()
        self._fleet.reserved.add(wid)
        return wid

    async def retire_remote_worker_async(self, worker_id: int, reason: str) -> None:
        """Retire remote worker ``worker_id`` (on the Worker's loop): its running task
        fails naming ``reason``, queued and new work for it is refused, its session ends.
        :meth:`revive_remote_worker_async` brings it back under the same id."""
        self._check_ready("retire a remote worker")
        self._fleet.retire(worker_id, reason)

    async def revive_remote_worker_async(self, worker_id: int) -> None:
        """Open a new session for retired worker ``worker_id`` (its spec as before) and let
        it take work again. Raises ``StartupError`` naming it when the session cannot open
        (it stays retired)."""
        self._check_ready("revive a remote worker")
        fleet = self._fleet
        if worker_id not in fleet.retired:
            raise ValueError(f"cannot revive worker {worker_id}: it is not a retired remote worker")
        ep = await asyncio.to_thread(
            fleet.open_one, worker_id, time.monotonic() + self.startup_timeout
        )
        if not self._ready() or worker_id not in fleet.retired:
            ep.close()
            raise WorkerClosedError(
                f"cannot revive remote worker {worker_id}: the worker closed meanwhile"
            )
        fleet.revive(worker_id, ep)

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
