"""W1 nested: W1 (one empty task per run) through one nested level, L4 -> local L3 -> SUB.

::

    this process: Worker(level=4) --mailbox--> L3 child (inner Worker(level=3)) --mailbox--> SUB x2
                  run(orch): orch submits one NEXT_LEVEL task   one_empty: one empty SUB task

Each run submits ``one_empty`` (``simpler_daemon.examples.remote``), an L3
orchestration that submits one empty SUB task, to the local L3 worker and waits
for its completion: W1's one empty task, one level further down, measured in the
W1 cell. The L3 has
W1's pool (2 SUB workers), so the only difference from W1 is the level; the
report puts it next to W1 of the same cell as "W1 nested" and subtracts W1
(``Worker.run`` both) for the cost of one level.

Run inside the suite (``python -m benchmarks --only W1``) or standalone::

    python -m benchmarks.nested [--smoke] [--repeat N]
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from benchmarks.ours import WARM_UP_RUNS, Orch, _time_runs, close_blocking
from benchmarks.workloads import NUM_WORKERS, Result, latency_rep, ok, standalone

EMPTY = "simpler_daemon.examples.tasks:empty"
ONE_EMPTY = "simpler_daemon.examples.remote:one_empty"


@contextmanager
def nested_worker() -> Iterator[tuple[Any, Orch]]:
    """A started level-4 Worker with one local L3 (``NUM_WORKERS`` SUB workers, ``empty``
    installed) and the L4 orchestration of one W1-nested run; closed after."""
    from simpler_daemon import Worker

    w4 = Worker(level=4)
    try:
        l3 = w4.add_worker(Worker(level=3, num_sub_workers=NUM_WORKERS, num_chips=0))
        w4.register(EMPTY, kind="sub", workers=[l3])
        one_empty = w4.register(ONE_EMPTY, kind="orchestration")
        w4.init()

        def orch(o: Any, args: Any = None, config: Any = None) -> None:
            o.submit_next_level(one_empty, worker=l3)

        yield w4, orch
    except BaseException:
        try:
            close_blocking(w4)
        except Exception:
            traceback.print_exc()  # the original error is the one worth reporting
        raise
    else:
        close_blocking(w4)


def measure(p: dict[str, int], repeat: int) -> Result:
    """The ``ours_nested`` result of W1: ``p["n"]`` runs per repetition, ``Worker.run``."""
    with nested_worker() as (w4, orch):
        _time_runs(w4.run, orch, WARM_UP_RUNS)
        reps = [latency_rep(_time_runs(w4.run, orch, p["n"])) for _ in range(repeat)]
    return ok(
        reps,
        api="Worker.run",
        path="L4 -> local L3 -> SUB",
        callable=ONE_EMPTY,
        l3_sub_workers=NUM_WORKERS,
    )


def main(argv: list[str] | None = None) -> int:
    return standalone("nested", "W1", measure, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
