"""The retention of finished runs: which finished runs the run table still knows.

::

    RunTable._remember_finished(rec) --> FinishedRuns.remember(rec) --> trim()
                                                                          |
       limits.max_finished_run_age   (the oldest first; also before a lookup / listing)
       limits.max_finished_runs_kept (the oldest of the client holding the most runs)
       limits.max_finished_run_bytes (the oldest of the client holding the most bytes)
         --> evict: the run leaves the table's ``runs`` and the history; its idempotency
             key is forgotten (``on_evicted``); UnknownObject later names the limit
       limits.max_finished_result_bytes (the oldest runs' task results are dropped;
             the run stays)

A finished run keeps a small status, not its slots. Everything here runs on the
daemon's one event loop; :class:`~simpler_daemon.server.runs.RunTable` owns the
object and calls down into it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Final

from simpler_daemon.server.config import LimitsConfig
from simpler_daemon.server.history import History
from simpler_daemon.server.run_record import RunRecord

__all__ = ["FinishedRuns"]

log = logging.getLogger("simpler_daemon.service")

#: Evicted runs whose eviction reason (the limit) UnknownObject still names; older ones get
#: both limits named.
_EVICTIONS_REMEMBERED: Final = 4096


class FinishedRuns:
    """The finished runs kept, in order, with what they cost, and the recent evictions.

    ``runs`` is the run table's dict of every known run (shared: an eviction removes
    the run from it); ``on_evicted`` is called with each evicted run (the table forgets
    its idempotency key). ``history`` (None until the table is restored) is told of
    every run finished, changed or forgotten here.
    """

    def __init__(
        self,
        runs: dict[int, RunRecord],
        limits: LimitsConfig,
        on_evicted: Callable[[RunRecord], None],
    ) -> None:
        self._runs = runs
        self._limits = limits
        self._on_evicted = on_evicted
        self.history: History | None = None
        # Finished runs kept, oldest first: all of them, and per client (eviction takes
        # the oldest of the client holding the most, so one client cannot evict another's).
        self._finished: OrderedDict[int, None] = OrderedDict()
        self._finished_by_client: dict[str, OrderedDict[int, None]] = {}
        # Bytes the finished runs' statuses are counted for (RunRecord.status_bytes), in
        # all and per client (the byte limit evicts from the client holding the most bytes).
        self._finished_status_bytes = 0
        self._status_bytes_by_client: Counter[str] = Counter()
        # Recently evicted runs -> the limit that evicted them (for UnknownObject's text).
        self._evicted: OrderedDict[int, str] = OrderedDict()
        # Finished runs whose results are still kept, oldest first, and their bytes.
        self._with_results: OrderedDict[int, None] = OrderedDict()
        self._finished_result_bytes = 0

    def reconfigure(self, limits: LimitsConfig) -> None:
        """New retention limits (SIGHUP): finished runs past them are forgotten now."""
        self._limits = limits
        self.trim()

    def remember(self, rec: RunRecord) -> None:
        """Keep the finished ``rec`` (newest), then forget what is past the limits."""
        self._finished[rec.run_id] = None
        self._finished_by_client.setdefault(rec.client, OrderedDict())[rec.run_id] = None
        if rec.result_bytes:
            self._with_results[rec.run_id] = None
            self._finished_result_bytes += rec.result_bytes
        self._finished_status_bytes += rec.status_bytes
        self._status_bytes_by_client[rec.client] += rec.status_bytes
        if self.history is not None:
            self.history.finished(rec)
        self.trim()

    def eviction_reason(self, run_id: int) -> str:
        """The limit that evicted ``run_id`` (both count and byte limits when it is no
        longer remembered), for UnknownObject's text."""
        return self._evicted.get(run_id) or f"{self._count_limit()} or {self._bytes_limit()}"

    def expire(self) -> None:
        """Forget finished runs older than limits.max_finished_run_age (checked when a run
        finishes and before a lookup or a listing)."""
        age = self._limits.max_finished_run_age
        cutoff = time.time_ns() - int(age * 1e9)
        while age > 0 and self._finished:
            oldest = next(iter(self._finished))
            rec = self._runs.get(oldest)
            if rec is not None and rec.finish_ns > cutoff:
                return
            self._evict(oldest, f"limits.max_finished_run_age = {age:g}")

    def trim(self) -> None:
        """Forget finished runs past the age, count and byte limits; drop the oldest
        runs' results past limits.max_finished_result_bytes."""
        self.expire()
        while len(self._finished) > self._limits.max_finished_runs_kept:
            self._evict(self._eviction_victim(), self._count_limit())
        # One finished run stays whatever its size (a limit below one status keeps one).
        while self._finished_status_bytes > self._limits.max_finished_run_bytes and (
            len(self._finished) > 1
        ):
            self._evict(self._eviction_victim(by_bytes=True), self._bytes_limit())
        limit = self._limits.max_finished_result_bytes
        while self._finished_result_bytes > limit and self._with_results:
            old, _ = self._with_results.popitem(last=False)
            victim = self._runs.get(old)
            if victim is not None:
                freed = victim.drop_results(f"limits.max_finished_result_bytes = {limit}")
                if self.history is not None:
                    self.history.changed(victim)
                self._finished_result_bytes -= freed
                log.info(
                    "run %d: results (%d bytes) dropped: finished runs keep at most %d bytes",
                    old,
                    freed,
                    limit,
                )

    def _eviction_victim(self, *, by_bytes: bool = False) -> int:
        """The finished run to forget: the oldest of the client holding the most finished
        runs, or (``by_bytes``, for limits.max_finished_run_bytes) the most bytes of
        them, so one client's big statuses never evict another client's runs (ties: the
        client whose oldest is oldest)."""
        best: OrderedDict[int, None] | None = None
        best_key: tuple[int, int] = (0, 0)
        weight = self._status_bytes_by_client
        for client, runs in self._finished_by_client.items():
            key = (weight[client] if by_bytes else len(runs), -next(iter(runs)))
            if best is None or key > best_key:
                best, best_key = runs, key
        assert best is not None  # _finished is not empty, so neither is this
        return next(iter(best))

    def _count_limit(self) -> str:
        return f"limits.max_finished_runs_kept = {self._limits.max_finished_runs_kept}"

    def _bytes_limit(self) -> str:
        return f"limits.max_finished_run_bytes = {self._limits.max_finished_run_bytes}"

    def _evict(self, old: int, why: str) -> None:
        self._finished.pop(old, None)
        gone = self._runs.pop(old, None)
        if gone is None:
            return
        self._evicted[old] = why
        if self.history is not None:
            self.history.forget(old)
        if len(self._evicted) > _EVICTIONS_REMEMBERED:
            self._evicted.popitem(last=False)
        self._finished_status_bytes -= gone.status_bytes
        left = self._status_bytes_by_client[gone.client] - gone.status_bytes
        if left > 0:
            self._status_bytes_by_client[gone.client] = left
        else:
            del self._status_bytes_by_client[gone.client]
        own = self._finished_by_client.get(gone.client)
        if own is not None:
            own.pop(old, None)
            if not own:
                del self._finished_by_client[gone.client]
        if old in self._with_results:
            del self._with_results[old]
            self._finished_result_bytes -= gone.result_bytes
        self._on_evicted(gone)
