"""How the parent watches a local child's task: its deadline and its stopped state.

``LocalMailboxEndpoint`` applies these each progress round while a task is in flight
(see ``endpoints/local.py``): past ``deadline_ms`` plus ``DEADLINE_GRACE_S`` the child's
process group is killed; stopped (SIGSTOP) for ``STOPPED_GRACE_S`` it is killed too.
``set_max_task_seconds`` is the daemon's ``limits.max_task_seconds``: a ceiling on every
task's deadline in this process.
"""

from __future__ import annotations

import math
from typing import Final

__all__ = [
    "DEADLINE_GRACE_S",
    "STOPPED_GRACE_S",
    "STOPPED_POLL_S",
    "deadline_ms_of",
    "proc_state",
    "set_max_task_seconds",
]

#: A task still in flight ``deadline_ms`` + this long after its publication is killed.
DEADLINE_GRACE_S: Final = 0.25
#: A child stopped (SIGSTOP) this long with a task in flight is killed.
STOPPED_GRACE_S: Final = 2.0
#: How often the state of a child with a task in flight is read from /proc.
STOPPED_POLL_S: Final = 0.5

#: Ceiling on every task's deadline in ms (:func:`set_max_task_seconds`); 0 = none.
_max_task_ms = 0


def set_max_task_seconds(seconds: float) -> None:
    """Cap the deadline of every task this process's endpoints publish at ``seconds``
    (``limits.max_task_seconds``; 0 = no ceiling): a task without a deadline gets this
    one, a longer one is shortened. Process-wide, so that the tasks an orchestration
    function submits are capped too; set it before forking (a nested L3 inherits it)."""
    global _max_task_ms
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"cannot cap task time: {seconds!r} seconds is not >= 0 and finite")
    _max_task_ms = math.ceil(seconds * 1000) if seconds > 0 else 0


def deadline_ms_of(config: bytes) -> int:
    """``CallConfig.deadline_ms`` (the first 8 bytes of the encoded config), capped by
    :func:`set_max_task_seconds`."""
    ms = int.from_bytes(config[:8], "little")
    cap = _max_task_ms
    return ms if not cap or (ms and ms <= cap) else cap


def proc_state(pid: int) -> str:
    """The one-letter state of ``pid`` in /proc ('R', 'S', 'T' stopped, ...); '' if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return ""
    fields = data.rpartition(b")")[2].split()
    return fields[0].decode() if fields else ""
