"""``Client.map``: one SUB task per item of an iterable through the daemon, the results
in order (the daemon's side of ``Worker.map``, ``engine/mapping.py``).

Each item is the task's single value (``sub_task(hashid, values=[item])``); the items
go in runs of ``chunksize`` tasks, at most ``MAP_WINDOW`` runs submitted ahead of the
results taken. A task that returned None gives None. A failed task raises its run's
``TaskError`` where its result would have been yielded; closing the generator early,
or an error, cancels the runs still in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from simpler_daemon.client.requests import sub_task
from simpler_daemon.mapcommon import MAP_WINDOW, check_chunksize, check_map_timeout, chunks
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

if TYPE_CHECKING:
    from simpler_daemon.client.clients import Client
    from simpler_daemon.client.results import RunFuture

__all__ = ["map_items"]


def map_items(
    client: Client,
    hashid: str,
    iterable: Iterable[Any],
    chunksize: int,
    config: pb.CallConfig | None,
    timeout: float | None,
    label: str,
) -> Iterator[Any]:
    """``Client.map``'s generator (its arguments checked before the first item is read)."""
    if not isinstance(hashid, str) or not hashid:
        raise TypeError(
            f"cannot map: expected the hashid of a registered SUB callable (a str), got "
            f"{type(hashid).__name__} {hashid!r}"
        )
    if config is not None and not isinstance(config, pb.CallConfig):
        raise TypeError(
            f"cannot map: config must be a CallConfig message (call_config(...)), got "
            f"{type(config).__name__}"
        )
    size = check_chunksize(chunksize)
    wait = check_map_timeout(timeout)
    return _results(client, hashid, iter(iterable), size, config, wait, label)


def _results(
    client: Client,
    hashid: str,
    items: Iterator[Any],
    size: int,
    config: pb.CallConfig | None,
    timeout: float | None,
    label: str,
) -> Iterator[Any]:
    pending: deque[tuple[RunFuture, int]] = deque()
    batches = chunks(items, size)
    try:
        while True:
            while len(pending) < MAP_WINDOW:
                batch = next(batches, None)
                if batch is None:
                    break
                first, chunk = batch
                tasks = []
                for k, item in enumerate(chunk):
                    try:
                        tasks.append(sub_task(hashid, values=[item], config=config))
                    except TypeError as exc:
                        raise TypeError(f"cannot map item {first + k}: {exc}") from None
                pending.append((client.submit(tasks, label=label), len(tasks)))
            if not pending:
                return
            fut, n = pending.popleft()
            values = fut.result(timeout).values()
            for i in range(n):
                yield values.get(i)
    finally:
        for fut, _ in pending:
            fut.cancel()
