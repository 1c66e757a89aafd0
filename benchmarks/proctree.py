"""CPU time of a process tree, read from ``/proc`` (no psutil): W8's idle CPU, W7's
runner census, and the harness's check that a cell left no process behind."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields of /proc/<pid>/stat from field 3 (state) on, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    return data[data.rindex(b")") + 2 :].split()


@dataclass(frozen=True)
class ProcInfo:
    ppid: int
    session: int
    ticks: int  # utime + stime, in clock ticks
    state: str  # "R", "S", ..., "Z" for a zombie


def process_table() -> dict[int, ProcInfo]:
    """Every visible process, from /proc/<pid>/stat."""
    table: dict[int, ProcInfo] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is None:
            continue
        # Field k of proc(5) is fields[k - 3]: state 3, ppid 4, session 6, utime 14, stime 15.
        table[int(entry)] = ProcInfo(
            ppid=int(fields[1]),
            session=int(fields[3]),
            ticks=int(fields[11]) + int(fields[12]),
            state=fields[0].decode(),
        )
    return table


def descendants(root: int, table: dict[int, ProcInfo] | None = None) -> list[int]:
    """``root`` and every live process below it (found by ppid; no psutil)."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, info in table.items():
        children.setdefault(info.ppid, []).append(pid)
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        if pid in table:
            found.append(pid)
        stack.extend(children.get(pid, ()))
    return found


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) ``pid`` has used, all its threads, not its
    children; None if it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def tree_ticks(root: int) -> dict[int, int]:
    table = process_table()
    return {pid: table[pid].ticks for pid in descendants(root, table)}


def measure_idle_cpu(seconds: float, root: int | None = None) -> dict[str, Any]:
    """CPU used by ``root`` (default: this process) and its descendants while idle.

    utime+stime of every process of the tree, sampled before and after; a
    process born during the window counts in full, one that exits during it
    is not counted. Returned as % of one core.
    """
    root = os.getpid() if root is None else root
    before = tree_ticks(root)
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    after = tree_ticks(root)
    ticks = sum(t - before.get(pid, 0) for pid, t in after.items())
    cpu_s = ticks / _CLK_TCK
    return {
        "cpu_pct": 100.0 * cpu_s / wall,
        "cpu_s": cpu_s,
        "window_s": wall,
        "processes": len(after),
        "exited": len(set(before) - set(after)),
    }
