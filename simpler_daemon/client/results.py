"""What the daemon's clients return: plain Python types instead of protobuf messages.

::

    fut = client.submit(tasks)            # RunFuture: an int (the run id) and a future
    res = fut.result(timeout=60)          # RunResult; TaskError / RunCancelled / TimeoutError
    res.state is RunPhase.COMPLETED       # == pb.RUN_STATE_COMPLETED
    [r.value for r in res.results]        # the SUB tasks' return values, decoded

``RunResult`` mirrors the proto ``RunStatus`` field by field (``state`` an
:class:`RunPhase`, ``error`` a :class:`RunErrorInfo` or None, timestamps as
aware UTC ``datetime``), ``RunSummaryInfo`` mirrors ``RunSummary``. The futures
only hold a client and a run id: every question is a WaitRun on the daemon, so a
future can be rebuilt from a run id at any time (``client.future(run_id)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import threading
from collections.abc import Awaitable, Callable, Generator
from datetime import UTC, datetime
from typing import Any, Final, Protocol, Self

import msgspec

from simpler_daemon.client.errors import NotFound
from simpler_daemon.errors import RunCancelled, TaskError
from simpler_daemon.futures import BridgedFuture
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

__all__ = [
    "WATCH_SLICE",
    "AsyncRunFuture",
    "CancelResult",
    "DoneWatcher",
    "RunCountsInfo",
    "RunErrorInfo",
    "RunFuture",
    "RunPhase",
    "RunResult",
    "RunSummaryInfo",
    "TaskResultValue",
    "cancel_result",
    "check_result",
    "run_result",
    "run_summary",
]

log = logging.getLogger("simpler_daemon.client")


class RunPhase(enum.IntEnum):
    """A run's state; the values are the proto ``RunState``'s
    (``RunPhase.COMPLETED == pb.RUN_STATE_COMPLETED``)."""

    UNSPECIFIED = pb.RUN_STATE_UNSPECIFIED
    QUEUED = pb.RUN_STATE_QUEUED
    BUILDING = pb.RUN_STATE_BUILDING
    PREPARED = pb.RUN_STATE_PREPARED
    EXECUTING = pb.RUN_STATE_EXECUTING
    COMPLETED = pb.RUN_STATE_COMPLETED
    FAILED = pb.RUN_STATE_FAILED
    CANCELLED = pb.RUN_STATE_CANCELLED
    #: The daemon stopped while the run was active (reported after its restart).
    LOST = pb.RUN_STATE_LOST

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL

    @classmethod
    def of(cls, value: int) -> RunPhase:
        """The phase of a proto value (UNSPECIFIED for one this client does not know)."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


_TERMINAL: Final = frozenset(
    {RunPhase.COMPLETED, RunPhase.FAILED, RunPhase.CANCELLED, RunPhase.LOST}
)


@dataclasses.dataclass(frozen=True, slots=True)
class RunCountsInfo:
    """Task calls of a run (a group counts one per member)."""

    total: int = 0
    done: int = 0
    failed: int = 0
    running: int = 0
    #: Failed attempts that ran again (CallConfig.max_retries).
    retried: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class RunErrorInfo:
    """Why a run failed or was cancelled: the first failing task's identity."""

    message: str
    worker_id: int | None = None
    hashid: str | None = None
    dispatch_id: int | None = None
    outcome: str = ""
    remote_text: str = ""
    task_index: int | None = None
    #: Attempts the failing task had (1 without retries) and one line per failed one.
    attempts: int = 1
    attempt_causes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class TaskResultValue:
    """The return value of one SUB task (``member_index`` set for a group member)."""

    task_index: int
    member_index: int | None
    value: Any


@dataclasses.dataclass(frozen=True, slots=True)
class RunResult:
    """A run's status (the proto ``RunStatus``), with its task results when asked for.

    ``results`` holds only tasks that returned something other than None, in task
    order; it is empty for a run that is not terminal or when results were not asked
    for (``wait_run(..., include_results=True)``; ``run``, ``wait`` and
    ``RunFuture.result`` ask).
    """

    run_id: int
    state: RunPhase
    error: RunErrorInfo | None = None
    counts: RunCountsInfo = RunCountsInfo()
    label: str = ""
    client: str = ""
    priority: int = 1
    submit_time: datetime | None = None
    finish_time: datetime | None = None
    results: list[TaskResultValue] = dataclasses.field(default_factory=list)

    @property
    def terminal(self) -> bool:
        """COMPLETED, FAILED, CANCELLED or LOST."""
        return self.state.terminal

    def values(self) -> dict[int, Any]:
        """``{task_index: value}`` of the single tasks; a group's entry is the list of
        its members' values (None for a member that returned None)."""
        out: dict[int, Any] = {}
        for r in self.results:
            if r.member_index is None:
                out[r.task_index] = r.value
            else:
                members = out.setdefault(r.task_index, [])
                members.extend([None] * (r.member_index + 1 - len(members)))
                members[r.member_index] = r.value
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class RunSummaryInfo:
    """One row of ``list_runs`` (the proto ``RunSummary``)."""

    run_id: int
    state: RunPhase
    client: str
    label: str
    counts: RunCountsInfo
    age_seconds: float
    priority: int
    submit_time: datetime | None
    finish_time: datetime | None


@dataclasses.dataclass(frozen=True, slots=True)
class CancelResult:
    """What ``cancel`` did: the run's state after it, and whether it had finished."""

    state: RunPhase
    already_finished: bool


# --------------------------------------------------------------------------- conversions


def _time(msg: Any, has: bool) -> datetime | None:
    if not has:
        return None
    when: datetime = msg.ToDatetime(tzinfo=UTC)
    return when


def _counts(msg: Any) -> RunCountsInfo:
    return RunCountsInfo(
        total=msg.total,
        done=msg.done,
        failed=msg.failed,
        running=msg.running,
        retried=msg.retried,
    )


def _error(status: Any) -> RunErrorInfo | None:
    if not status.HasField("error"):
        return None
    err = status.error
    return RunErrorInfo(
        message=err.message,
        worker_id=err.worker_id if err.HasField("worker_id") else None,
        hashid=err.hashid or None,
        dispatch_id=err.dispatch_id or None,
        outcome=err.outcome,
        remote_text=err.remote_text,
        task_index=err.task_index if err.HasField("task_index") else None,
        attempts=err.attempts or 1,
        attempt_causes=tuple(err.attempt_causes),
    )


def run_result(status: pb.RunStatus) -> RunResult:
    """A ``RunStatus`` as a :class:`RunResult` (results decoded from msgpack)."""
    return RunResult(
        run_id=status.run_id,
        state=RunPhase.of(status.state),
        error=_error(status),
        counts=_counts(status.counts),
        label=status.label,
        client=status.client,
        priority=status.priority or 1,
        submit_time=_time(status.submit_time, status.HasField("submit_time")),
        finish_time=_time(status.finish_time, status.HasField("finish_time")),
        results=[
            TaskResultValue(
                task_index=r.task_index,
                member_index=r.member_index if r.HasField("member_index") else None,
                value=msgspec.msgpack.decode(r.value),
            )
            for r in status.results
        ],
    )


def run_summary(row: pb.RunSummary) -> RunSummaryInfo:
    return RunSummaryInfo(
        run_id=row.run_id,
        state=RunPhase.of(row.state),
        client=row.client,
        label=row.label,
        counts=_counts(row.counts),
        age_seconds=row.age_seconds,
        priority=row.priority or 1,
        submit_time=_time(row.submit_time, row.HasField("submit_time")),
        finish_time=_time(row.finish_time, row.HasField("finish_time")),
    )


def cancel_result(response: pb.CancelRunResponse) -> CancelResult:
    return CancelResult(
        state=RunPhase.of(response.state), already_finished=response.already_finished
    )


def check_result(result: RunResult) -> RunResult:
    """``result`` when COMPLETED; ``TaskError`` (``RunCancelled`` when cancelled) when it
    failed; ``TimeoutError`` when it is not terminal yet."""
    if result.state is RunPhase.COMPLETED:
        return result
    if not result.terminal:
        raise TimeoutError(f"run {result.run_id} is still {result.state.name}")
    err = result.error
    cls = RunCancelled if result.state is RunPhase.CANCELLED else TaskError
    if err is None:
        raise cls(f"run {result.run_id} {result.state.name}", run_id=result.run_id)
    raise cls(
        err.message or f"run {result.run_id} {result.state.name}",
        run_id=result.run_id,
        worker_id=err.worker_id,
        hashid=err.hashid,
        dispatch_id=err.dispatch_id,
        outcome=err.outcome or "TASK_FAILURE",
        remote_text=err.remote_text,
        attempts=err.attempts,
        attempt_causes=err.attempt_causes,
    )


# --------------------------------------------------------------------------- futures


class _Runs(Protocol):
    """What a RunFuture needs of ``Client``."""

    def wait_run(
        self, run: int, timeout: float | None = None, *, include_results: bool = False
    ) -> RunResult: ...

    def cancel(self, run: int, reason: str = "", *, terminate: bool = False) -> CancelResult: ...

    @property
    def done_watcher(self) -> DoneWatcher: ...


class _AsyncRuns(Protocol):
    """What an AsyncRunFuture needs of ``AsyncClient``."""

    async def wait_run(
        self, run: int, timeout: float | None = None, *, include_results: bool = False
    ) -> RunResult: ...

    async def cancel(
        self, run: int, reason: str = "", *, terminate: bool = False
    ) -> CancelResult: ...


class _FutureBase(int):
    """A run id (an ``int``, so code that passed run ids around keeps working) that
    also answers for the run."""

    def __new__(cls, run_id: int, *args: Any, **kwargs: Any) -> Self:
        return super().__new__(cls, run_id)

    def __init__(self, run_id: int, *, deduplicated: bool = False) -> None:
        self.deduplicated = deduplicated
        self._final: RunResult | None = None

    @property
    def run_id(self) -> int:
        return int(self)

    # str() / f-strings print the bare id, as for the int this used to be.
    __str__ = int.__repr__

    def __repr__(self) -> str:
        state = self._final.state.name if self._final is not None else "pending"
        return f"{type(self).__name__}(run_id={int(self)}, {state})"

    def _settle(self, result: RunResult) -> RunResult:
        if result.terminal and self._final is None:
            self._final = result
        return result


class RunFuture(_FutureBase, BridgedFuture):
    """A submitted run, a ``concurrent.futures.Future``: ``result(timeout)`` blocks
    and returns the :class:`RunResult` (task results included) or raises
    ``TaskError`` / ``RunCancelled`` / ``TimeoutError``; ``done()``, ``status()``,
    ``cancel(terminate=False)``, ``add_done_callback(fn)``. ``concurrent.futures.wait``,
    ``as_completed`` and ``asyncio.wrap_future`` take it (their wake-up comes from the
    client's :class:`DoneWatcher`, as a done callback's does).

    It is also the run id (an ``int``). ``deduplicated``: the daemon answered a retry
    of an idempotency key with the run it already had.

    Against the standard library: ``cancel()`` also cancels a run that has started
    (True unless it had finished), and the run may still be running when it returns;
    ``result()`` of a cancelled run raises ``RunCancelled``, not ``CancelledError``.
    """

    def __init__(self, run_id: int, client: _Runs, *, deduplicated: bool = False) -> None:
        super().__init__(run_id, deduplicated=deduplicated)
        self._client = client
        self._error: BaseException | None = None
        #: The daemon's NotFound once the run finished and was evicted (for good).
        self._gone: NotFound | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[RunFuture], object]] = []

    def _bridge_outcome(self) -> tuple[str, BaseException | None] | None:
        settled: BaseException | None = self._gone or self._error
        if settled is not None:
            return ("exception", settled)
        if self._final is None:
            return None
        if self._final.state is RunPhase.CANCELLED:
            return ("cancelled", None)
        try:
            check_result(self._final)
        except (TaskError, RunCancelled) as exc:
            return ("exception", exc)
        return ("result", None)

    def _bridge_subscribe(self, fn: Callable[[], None]) -> None:
        self.add_done_callback(lambda _: fn())

    def _wait(self, timeout: float | None) -> RunResult | None:
        """One WaitRun with the results; None (and ``_gone`` set) for an evicted run."""
        if self._gone is not None:
            return None
        try:
            return self._settle(self._client.wait_run(self, timeout, include_results=True))
        except NotFound as exc:
            self._gone = exc
            return None

    def status(self) -> RunResult:
        """The run's current status (with its results once terminal); ``NotFound`` once
        the run finished and was evicted (limits.max_finished_runs_kept)."""
        if self._final is not None:
            return self._final
        status = self._wait(0)
        if status is None:
            assert self._gone is not None
            raise self._gone
        return status

    def result(self, timeout: float | None = None) -> RunResult:
        """Wait up to ``timeout`` seconds (None: no limit) for the run to finish; the
        COMPLETED result, else ``TaskError`` / ``RunCancelled``, or ``TimeoutError``;
        ``NotFound`` ("run N finished and was evicted ...") when the daemon no longer
        keeps it."""
        if self._final is None:
            self._wait(timeout)
        if self._final is None:
            if self._gone is not None:
                raise self._gone
            if self._error is not None:
                raise self._error
            raise TimeoutError(f"run {int(self)} not finished within {timeout}s")
        return check_result(self._final)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The run's error (``TaskError`` / ``RunCancelled``) or None once it completed;
        ``TimeoutError`` when it is not finished within ``timeout``."""
        try:
            self.result(timeout)
        except (TaskError, RunCancelled) as exc:
            return exc
        return None

    def done(self) -> bool:
        """Whether the run is terminal (asks the daemon until it is). An evicted run
        finished: True (``result()`` then raises ``NotFound``); never raises for it."""
        if self._final is not None or self._gone is not None:
            return True
        try:
            # Without results: a finished run whose results were dropped is still done.
            return self._client.wait_run(self, 0).terminal
        except NotFound as exc:
            self._gone = exc
            return True

    def running(self) -> bool:
        return self.status().state in (RunPhase.BUILDING, RunPhase.PREPARED, RunPhase.EXECUTING)

    def cancelled(self) -> bool:
        return self.status().state is RunPhase.CANCELLED

    def cancel(self, terminate: bool = False, reason: str = "") -> bool:
        """Cancel the run (``terminate``: also stop its running tasks); False when it had
        already finished."""
        return not self._client.cancel(self, reason, terminate=terminate).already_finished

    def add_done_callback(self, fn: Callable[[RunFuture], object]) -> None:
        """Call ``fn(future)`` once the run is terminal (or evicted, or the client's
        channel failed): at once when it already is, else from the client's one
        :class:`DoneWatcher` thread (shared by all its futures)."""
        with self._lock:
            if self._final is None and self._error is None and self._gone is None:
                first = not self._callbacks
                self._callbacks.append(fn)
                if first:
                    self._client.done_watcher.add(self)
                return
        self._invoke(fn)

    def _poll(self, timeout: float) -> bool:
        """The watcher's WaitRun: True once the run is settled (terminal, evicted, or the
        call failed: the channel closed; the callbacks still run)."""
        try:
            self._wait(timeout)
        except Exception as exc:
            self._error = exc
            return True
        return self._final is not None or self._gone is not None

    def _fire(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self._invoke(fn)

    def _invoke(self, fn: Callable[[RunFuture], object]) -> None:
        try:
            fn(self)
        except Exception:
            log.exception("done callback of run %d failed", int(self))


#: The longest one WaitRun of the :class:`DoneWatcher` blocks before it asks about the
#: other pending runs: a done callback runs at most about this (plus one timeout-0
#: WaitRun per pending run) after its run finished.
WATCH_SLICE: Final = 0.25


class DoneWatcher:
    """The one thread per ``Client`` behind ``RunFuture.add_done_callback``.

    Round-robin over the pending futures, it blocks in one WaitRun of at most
    :data:`WATCH_SLICE` seconds on one of them and asks the others with a timeout-0
    WaitRun each, then runs the callbacks of the runs that finished. 100 pending
    futures cost one thread and one call in flight (not 100 of each). The thread ends
    when nothing is pending and starts again with the next callback.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, RunFuture] = {}  # id(future) -> future
        self._thread: threading.Thread | None = None
        self._turn = 0

    def add(self, future: RunFuture) -> None:
        with self._lock:
            self._pending[id(future)] = future
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="simpler-done-watcher", daemon=True
                )
                self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                pending = list(self._pending.values())
                if not pending:
                    self._thread = None
                    return
            self._turn = (self._turn + 1) % len(pending)
            order = pending[self._turn :] + pending[: self._turn]
            for i, future in enumerate(order):
                if future._poll(WATCH_SLICE if i == 0 else 0):
                    with self._lock:
                        self._pending.pop(id(future), None)
                    future._fire()


class AsyncRunFuture(_FutureBase):
    """The asyncio twin of :class:`RunFuture`: ``await future`` is ``await
    future.result()``; ``result``, ``exception``, ``done``, ``status`` and ``cancel``
    are coroutines; ``add_done_callback(fn)`` runs ``fn(future)`` on the loop."""

    def __init__(self, run_id: int, client: _AsyncRuns, *, deduplicated: bool = False) -> None:
        super().__init__(run_id, deduplicated=deduplicated)
        self._client = client
        self._tasks: set[asyncio.Task[None]] = set()

    async def status(self) -> RunResult:
        if self._final is not None:
            return self._final
        return self._settle(await self._client.wait_run(self, 0, include_results=True))

    async def result(self, timeout: float | None = None) -> RunResult:
        if self._final is None:
            self._settle(await self._client.wait_run(self, timeout, include_results=True))
        if self._final is None:
            raise TimeoutError(f"run {int(self)} not finished within {timeout}s")
        return check_result(self._final)

    async def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            await self.result(timeout)
        except (TaskError, RunCancelled) as exc:
            return exc
        return None

    async def done(self) -> bool:
        """Whether the run is terminal; an evicted run finished: True, never raises for it
        (``result()`` then raises ``NotFound``)."""
        if self._final is not None:
            return True
        try:
            # Without results: a finished run whose results were dropped is still done.
            return (await self._client.wait_run(self, 0)).terminal
        except NotFound:
            return True

    async def cancel(self, terminate: bool = False, reason: str = "") -> bool:
        response = await self._client.cancel(self, reason, terminate=terminate)
        return not response.already_finished

    def add_done_callback(self, fn: Callable[[AsyncRunFuture], object]) -> None:
        """Call ``fn(future)`` on the running loop once the run is terminal (a
        coroutine function's result is awaited)."""

        async def watch() -> None:
            with contextlib.suppress(Exception):  # the channel closed: still call back
                await self.result()
            try:
                out = fn(self)
                if isinstance(out, Awaitable):
                    await out
            except Exception:
                log.exception("done callback of run %d failed", int(self))

        task = asyncio.get_running_loop().create_task(watch(), name=f"simpler-run-{int(self)}")
        self._tasks.add(task)  # a task nobody references may be collected mid-flight
        task.add_done_callback(self._tasks.discard)

    def __await__(self) -> Generator[Any, None, RunResult]:
        return self.result().__await__()
