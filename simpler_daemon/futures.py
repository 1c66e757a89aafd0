"""The bridge that makes a run's handle a ``concurrent.futures.Future``.

``RunHandle`` (the in-process Worker) and ``RunFuture`` (the daemon client) learn that a
run ended in their own way: the Scheduler's done callback, or a WaitRun. They subclass
:class:`BridgedFuture` so that the standard library's ``concurrent.futures.wait``,
``as_completed`` and ``asyncio.wrap_future`` accept them::

    concurrent.futures.wait([h1, h2])       reads f._condition, f._state, f._waiters
    concurrent.futures.as_completed(fs)     the same
    asyncio.wrap_future(h)                  add_done_callback, result, exception, cancel

Those functions read three private attributes of ``Future``. None of them exists until
one of the functions asks (so a run nobody waits for that way costs nothing): the first
read of ``_condition`` or ``_waiters`` (properties here) creates both, takes the state the subclass knows
now, and subscribes :meth:`BridgedFuture._bridge_settle` to the run's end. The settle
step sets ``_state`` and wakes the installed waiters under ``_condition``, the same
critical section the standard library scans in, so a waiter is woken exactly once for a
future it counted as pending and never for one it counted as done.

The subclass answers ``done()``, ``result()``, ``exception()``, ``cancel()`` and
``add_done_callback()`` itself; ``set_result`` and its siblings belong to an executor
and are refused: a run is settled by the run, not by its holder.

:func:`gather` waits for several such futures and returns their results in order;
:func:`as_completed` yields them as they finish.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures._base import CANCELLED_AND_NOTIFIED, FINISHED, PENDING
from typing import Any

__all__ = ["BridgedFuture", "as_completed", "gather"]

#: Guards the creation of ``_condition`` against the settle step (one lock for all
#: futures: both sides hold it for a few instructions).
_CREATE = threading.Lock()


class BridgedFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """A ``concurrent.futures.Future`` whose end is known to the subclass.

    A subclass implements :meth:`_bridge_outcome` (None while the run is not finished,
    else ``("result", None)``, ``("exception", error)`` or ``("cancelled", None)``) and
    :meth:`_bridge_subscribe` (call a function once the run is finished, at once when
    it is). It must not call ``Future.__init__``.
    """

    #: The standard library's view of the state, before anyone asked for it.
    _state = PENDING

    def _bridge_outcome(self) -> tuple[str, BaseException | None] | None:
        raise NotImplementedError

    def _bridge_subscribe(self, fn: Any) -> None:
        raise NotImplementedError

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        return self._bridge_make()[0]

    @property
    def _waiters(self) -> list[Any]:  # type: ignore[override]
        return self._bridge_make()[1]

    def _bridge_make(self) -> tuple[threading.Condition, list[Any]]:
        """``_condition`` and ``_waiters``, made on the first read (see the module doc)."""
        made: tuple[threading.Condition, list[Any]] | None = self.__dict__.get("_bridge")
        if made is not None:
            return made
        with _CREATE:
            made = self.__dict__.get("_bridge")
            if made is None:
                self._state = _std_state(self._bridge_outcome())
                made = self.__dict__["_bridge"] = (threading.Condition(), [])
                subscribe = self._state is PENDING
            else:
                subscribe = False
        if subscribe:
            self._bridge_subscribe(lambda *_: self._bridge_settle())
        return made

    def _bridge_settle(self) -> None:
        """The run ended: the standard library's state follows, its waiters wake."""
        outcome = self._bridge_outcome()
        if outcome is None:  # pragma: no cover - subscribers fire only once finished
            return
        with _CREATE:
            made = self.__dict__.get("_bridge")
            if made is None:
                self._state = _std_state(outcome)
                return
        condition, waiters = made
        with condition:
            if self._state is not PENDING:
                return
            self._state = _std_state(outcome)
            kind, error = outcome
            if kind == "exception":
                self._exception = error
            for waiter in waiters:
                if kind == "cancelled":
                    waiter.add_cancelled(self)
                elif kind == "exception":
                    waiter.add_exception(self)
                else:
                    waiter.add_result(self)
            condition.notify_all()

    # An executor's half of the Future API: a run is settled by the run.

    def set_running_or_notify_cancel(self) -> bool:
        raise RuntimeError(f"{self!r} is settled by its run, not by its holder")

    def set_result(self, result: Any) -> None:
        raise RuntimeError(f"{self!r} is settled by its run, not by its holder")

    def set_exception(self, exception: BaseException | None) -> None:
        raise RuntimeError(f"{self!r} is settled by its run, not by its holder")


def _std_state(outcome: tuple[str, BaseException | None] | None) -> str:
    if outcome is None:
        return PENDING
    return CANCELLED_AND_NOTIFIED if outcome[0] == "cancelled" else FINISHED


def gather(
    futures: Iterable[concurrent.futures.Future[Any]],
    timeout: float | None = None,
    *,
    return_exceptions: bool = False,
) -> list[Any]:
    """Wait for every future and return their results in the order given.

    The first error (in that order) is raised once all have finished, unless
    ``return_exceptions``: then errors take their place in the list. ``TimeoutError``
    names how many were still pending when ``timeout`` (seconds, None = no limit)
    passed; the futures themselves are left as they are (nothing is cancelled).
    """
    fs = list(futures)
    _, pending = concurrent.futures.wait(fs, timeout)
    if pending:
        raise TimeoutError(f"{len(pending)} of {len(fs)} futures not finished within {timeout}s")
    out: list[Any] = []
    for f in fs:
        try:
            out.append(f.result(0))
        except Exception as exc:
            if not return_exceptions:
                raise
            out.append(exc)
    return out


def as_completed(
    futures: Iterable[concurrent.futures.Future[Any]], timeout: float | None = None
) -> Iterator[concurrent.futures.Future[Any]]:
    """Yield each future (``RunHandle``, ``RunFuture``, or any ``concurrent.futures``
    one) as it finishes, the finished ones first; a future given twice is yielded once.

    ``TimeoutError`` names how many were still pending when ``timeout`` (seconds from
    the call, None = no limit) passed; nothing is cancelled. The futures are checked at
    the call: anything else (an ``AsyncRunFuture``: use ``asyncio.as_completed``) is a
    ``TypeError`` naming its position.
    """
    fs = list(futures)
    for i, f in enumerate(fs):
        if not isinstance(f, concurrent.futures.Future):
            hint = " (await it, or use asyncio.as_completed)" if hasattr(f, "__await__") else ""
            raise TypeError(
                f"cannot wait for futures[{i}]: {type(f).__name__} {f!r} is not a RunHandle, "
                f"RunFuture or concurrent.futures.Future{hint}"
            )
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or math.isnan(timeout)
        or timeout < 0
    ):
        raise ValueError(
            f"cannot wait for futures: timeout={timeout!r} must be >= 0 seconds or None"
        )
    return _as_completed(fs, timeout)


def _as_completed(
    fs: list[concurrent.futures.Future[Any]], timeout: float | None
) -> Iterator[concurrent.futures.Future[Any]]:
    total = len(set(fs))
    done = 0
    try:
        for f in concurrent.futures.as_completed(fs, timeout):
            done += 1
            yield f
    except TimeoutError:
        raise TimeoutError(
            f"{total - done} of {total} futures not finished within {timeout}s"
        ) from None
