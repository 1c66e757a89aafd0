"""``Worker.map``: one SUB task per item of an iterable, the results in order.

The items go in runs of ``chunksize`` tasks (each item the task's single value,
``TaskArgs().add_value(item)``; the callable reads ``args.values[0]``). At most
:data:`~simpler_daemon.mapcommon.MAP_WINDOW` runs are in flight ahead of the consumer,
so an endless iterable is read as the results are taken, not all at once::

    items -> [chunk 0: run] [chunk 1: run]  ...      (submitted MAP_WINDOW ahead)
    yield chunk 0's results in order, then chunk 1's ...

A failed task raises its run's ``TaskError`` where its result would have been yielded
(the results before it were yielded already); closing the generator early, or an error,
cancels the runs still in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from simpler_daemon.args import CallConfig, TaskArgs
from simpler_daemon.callables import CallableHandle
from simpler_daemon.mapcommon import MAP_WINDOW, check_chunksize, check_map_timeout, chunks

if TYPE_CHECKING:
    from simpler_daemon.engine.handle import RunHandle
    from simpler_daemon.engine.worker import Worker

__all__ = ["map_tasks"]


def map_tasks(
    worker: Worker,
    handle: CallableHandle,
    iterable: Iterable[Any],
    *,
    chunksize: int,
    config: CallConfig | None,
    timeout: float | None,
) -> Iterator[Any]:
    """``Worker.map``'s generator (its arguments checked before the first item is read)."""
    if not isinstance(handle, CallableHandle):
        raise TypeError(
            "cannot map: expected a CallableHandle of a SUB callable returned by "
            f"Worker.register, got {type(handle).__name__} {handle!r}"
        )
    if handle.role != "sub":
        raise ValueError(
            f"cannot map: {handle.name} ({handle.hashid}) is registered as {handle.role}, "
            "not as a SUB callable"
        )
    if config is not None and not isinstance(config, CallConfig):
        raise TypeError(f"cannot map: config must be a CallConfig, got {type(config).__name__}")
    size = check_chunksize(chunksize)
    wait = check_map_timeout(timeout)
    return _results(worker, handle, iter(iterable), size, config, wait)


def _results(
    worker: Worker,
    handle: CallableHandle,
    items: Iterator[Any],
    size: int,
    config: CallConfig | None,
    timeout: float | None,
) -> Iterator[Any]:
    pending: deque[RunHandle] = deque()
    batches = chunks(items, size)
    try:
        while True:
            while len(pending) < MAP_WINDOW:
                batch = next(batches, None)
                if batch is None:
                    break
                pending.append(_submit(worker, handle, batch, config))
            if not pending:
                return
            yield from pending.popleft().result(timeout)
    finally:
        for h in pending:
            h.cancel()


def _submit(
    worker: Worker, handle: CallableHandle, batch: tuple[int, list[Any]], config: CallConfig | None
) -> RunHandle:
    """One run of the batch's items (``first`` is the index of its first item)."""
    first, items = batch
    args: list[TaskArgs] = []
    for k, item in enumerate(items):
        try:
            args.append(TaskArgs().add_value(item))
        except TypeError as exc:
            raise TypeError(f"cannot map item {first + k}: {exc}") from None

    def orch(o: Any, _a: Any, _c: Any) -> None:
        for a in args:
            o.submit_sub(handle, a, config)

    return worker.submit(orch)
