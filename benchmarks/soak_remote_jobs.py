"""What the remote phase of the soak runs on a remote host (``benchmarks/soak_remote.py``).

``fill_check`` is an L3 orchestration the level-4 daemon sends to a remote worker:
it fills a buffer of the remote heap with a value and checks it there, so a run
whose data went wrong on the remote side ends FAILED with ``soak check: wrong
value`` (the daemon cannot read a remote buffer back: no value crosses the hop).
Kept apart from ``soak_remote`` so the session runner imports nothing but this.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from simpler_daemon.args import Tag, TaskArgs
from simpler_daemon.callables import CallableHandle

FILL = "simpler_daemon.examples.tasks:fill"
CHECK = "benchmarks.soak_remote_jobs:check"
FILL_CHECK = "benchmarks.soak_remote_jobs:fill_check"

#: A wrong value seen on the remote side starts with this.
WRONG = "soak check: wrong value"


def check(args: Any) -> None:
    """SUB: every element of ``tensors[0]`` equals ``scalars[0]``."""
    got, want = args.tensors[0], float(args.scalars[0])
    if not np.all(got == want):
        bad = np.flatnonzero(got != want)
        raise ValueError(
            f"{WRONG}: {bad.size} of {got.size} elements differ, e.g. [{bad[0]}] = "
            f"{got[bad[0]]!r}, want {want!r}"
        )


def fill_check(o: Any, args: Any, config: Any) -> None:
    """Fill an intermediate buffer of ``scalars[1]`` float64 with ``scalars[0]``, then
    check it (a dependency: the check reads what the fill wrote)."""
    value, n = args.scalars[0], args.scalars[1]
    buf = o.alloc(n, "float64")
    buf[...] = -1.0  # a lost write shows up as a wrong value
    o.submit_sub(
        CallableHandle.for_import(FILL), TaskArgs().add_tensor(buf, Tag.OUTPUT).add_scalar(value)
    )
    o.submit_sub(
        CallableHandle.for_import(CHECK), TaskArgs().add_tensor(buf, Tag.INPUT).add_scalar(value)
    )
