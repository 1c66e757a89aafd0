"""The peers: the same tiny interface over five process pools.

Each peer is started once per workload (in the cell's subprocess), warmed up
by the workload loop, and closed in a ``finally`` block. Peer packages are the
optional ``bench`` extra: a missing one raises ``ImportError`` from
:meth:`Peer.start` and the cell reports ``skipped: <reason>``.
"""

from __future__ import annotations

import logging
import multiprocessing
import traceback
from collections.abc import Callable
from typing import Any

from benchmarks.workloads import NUM_WORKERS, PEER_LOOPS, WORKLOADS, Result


class Peer:
    """Submit a task, wait for one result or for many."""

    key = ""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        raise NotImplementedError

    def result(self, handle: Any) -> Any:
        raise NotImplementedError

    def results(self, handles: list[Any]) -> list[Any]:
        return [self.result(h) for h in handles]

    def info(self) -> dict[str, Any]:
        return {}


class MpPool(Peer):
    key = "mp"
    pool: Any = None

    def start(self) -> None:
        self.pool = multiprocessing.get_context("fork").Pool(NUM_WORKERS)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.pool.apply_async(fn, args)

    def result(self, handle: Any) -> Any:
        return handle.get()


class _Executor(Peer):
    executor: Any = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.executor.submit(fn, *args)

    def result(self, handle: Any) -> Any:
        return handle.result()


class ProcessPool(_Executor):
    key = "ppe"

    def start(self) -> None:
        from concurrent.futures import ProcessPoolExecutor

        self.executor = ProcessPoolExecutor(
            NUM_WORKERS, mp_context=multiprocessing.get_context("fork")
        )

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)


class Loky(_Executor):
    key = "loky"

    def start(self) -> None:
        from loky import get_reusable_executor

        self.executor = get_reusable_executor(max_workers=NUM_WORKERS)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, kill_workers=True)


class Ray(Peer):
    key = "ray"
    ray: Any = None

    def start(self) -> None:
        import ray

        self.ray = ray
        self.remote: dict[Callable[..., Any], Any] = {}
        ray.init(
            num_cpus=NUM_WORKERS,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )

    def close(self) -> None:
        if self.ray is not None:
            self.ray.shutdown()  # also safe after a failed ray.init

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        remote = self.remote.get(fn)
        if remote is None:
            remote = self.remote[fn] = self.ray.remote(fn)
        # An ObjectRef argument is resolved to its value before the task runs: W4's chain
        # of dependent tasks passes each result on this way.
        return remote.remote(*args)

    def result(self, handle: Any) -> Any:
        return self.ray.get(handle)

    def results(self, handles: list[Any]) -> list[Any]:
        return list(self.ray.get(handles))


class Dask(Peer):
    key = "dask"
    cluster: Any = None
    client: Any = None

    def start(self) -> None:
        from distributed import Client, LocalCluster

        self.cluster = LocalCluster(
            n_workers=NUM_WORKERS,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=logging.ERROR,
        )
        self.client = Client(self.cluster)

    def close(self) -> None:
        try:
            if self.client is not None:
                self.client.close()
        finally:
            if self.cluster is not None:
                self.cluster.close()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        # pure=False: every call is a new task, never deduplicated by key. A
        # future argument is resolved to its result before the task runs: W4's chain of
        # dependent tasks passes each result on this way.
        return self.client.submit(fn, *args, pure=False)

    def result(self, handle: Any) -> Any:
        return handle.result()

    def results(self, handles: list[Any]) -> list[Any]:
        return list(self.client.gather(handles))


PEERS: dict[str, type[Peer]] = {cls.key: cls for cls in (MpPool, ProcessPool, Loky, Ray, Dask)}


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        return f"not installed ({exc})"
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return f"failed: {last}"


def run(workload: str, key: str, repeat: int, smoke: bool) -> dict[str, Result]:
    """Measure one workload on one peer; failures become ``skipped: <reason>``."""
    spec = WORKLOADS[workload]
    if key not in spec.peers:
        return {key: {"status": "n/a", "reason": spec.na_reason}}
    logging.getLogger("distributed").setLevel(logging.ERROR)
    peer = PEERS[key]()
    try:
        try:  # every close() tolerates a start() that failed halfway
            peer.start()
            return {key: PEER_LOOPS[workload](peer, spec.params(smoke), repeat)}
        finally:
            peer.close()
    except Exception as exc:
        traceback.print_exc()
        return {key: {"status": "skipped", "reason": _reason(exc)}}
