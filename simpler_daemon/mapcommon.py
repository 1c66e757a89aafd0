"""What ``Worker.map`` and ``Client.map`` share: their argument checks and the chunking
of the items into runs (``engine/mapping.py``, ``client/mapping.py``)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Final

__all__ = ["DEFAULT_CHUNKSIZE", "MAP_WINDOW", "check_chunksize", "check_map_timeout", "chunks"]

#: Tasks per run when ``chunksize`` is not given.
DEFAULT_CHUNKSIZE: Final = 256
#: Runs a map keeps submitted ahead of the results taken: one runs while the next waits.
MAP_WINDOW: Final = 2
#: The most tasks one map run may hold (the daemon's default limits.max_tasks_per_run).
MAX_CHUNKSIZE: Final = 100_000


def check_chunksize(chunksize: object) -> int:
    if isinstance(chunksize, bool) or not isinstance(chunksize, int):
        raise TypeError(
            f"cannot map: chunksize must be an int, got {type(chunksize).__name__} {chunksize!r}"
        )
    if not 1 <= chunksize <= MAX_CHUNKSIZE:
        raise ValueError(
            f"cannot map: chunksize={chunksize} must be between 1 and {MAX_CHUNKSIZE} tasks per run"
        )
    return chunksize


def check_map_timeout(timeout: object) -> float | None:
    """Seconds one run's results may take (None: no limit)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"cannot map: timeout must be a number of seconds or None, got {type(timeout).__name__}"
        )
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"cannot map: timeout={timeout!r} must be >= 0 seconds (None: no limit)")
    return None if math.isinf(timeout) else float(timeout)


def chunks(items: Iterator[Any], size: int) -> Iterator[tuple[int, list[Any]]]:
    """(index of the first item, up to ``size`` items), read from ``items`` lazily."""
    first = 0
    while True:
        batch: list[Any] = []
        for item in items:
            batch.append(item)
            if len(batch) == size:
                break
        if not batch:
            return
        yield first, batch
        first += len(batch)
