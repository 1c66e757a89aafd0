"""W1's Python calls per run: how many Python functions one one-task run calls.

Time on the hot path is spread over many small functions (a flat profile), so a
count of calls shows a feature's cost in review where a noisy timing cannot.
Target (``/work/shared/design/PERFORMANCE.md``): at most 80 Python calls per run.

The count: a fresh ``Worker(level=3)`` with W1's pool (2 SUB workers, ``empty``
registered) is warmed up with ``warm`` runs of W1's orchestration (one empty
SUB task), then ``runs`` more runs go under a profile function, and the events
are divided by ``runs``:

* ``py_calls``: ``"call"`` events on the calling thread (``sys.setprofile``),
  i.e. Python frames entered there, a generator's or coroutine's resumption
  included (each resumption executes Python code again);
* ``c_calls``: ``"c_call"`` events there (builtins and C methods called from Python);
* ``py_calls_all`` / ``c_calls_all``: the same over every thread the Worker
  started through ``threading`` (its driver, if it has one), which the
  calling-thread figure does not see. ``threading.setprofile`` is installed
  before the Worker is created, so those threads carry the profile function
  from their start; it only counts while the timed window is open.

The counts are deterministic for a given code path (a few vary with timing: a
spin that loops more often, a wake-up that takes the slow branch), so one
repetition says most of it. The per-function list (calls per run, busiest
first, with file, line and thread) goes to the result's ``info["top"]``, and
``python -m benchmarks`` writes it to ``<stamp>-w1-calls.txt`` in its results
directory (``-w1-calls-before.txt`` for ``--baseline``).

Run inside the suite (``python -m benchmarks --only W1``: variant ``ours_calls``,
the W1 row "Python calls per run") or standalone::

    python -m benchmarks.calls [--smoke] [--repeat N]
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks import tasks
from benchmarks.ours import _describe, _time_runs, load_engine, unavailable, worker
from benchmarks.workloads import Result, ok, standalone

TOP = 40  # Python functions kept in the per-function list
TOP_C = 20  # C functions kept
# (event, thread tag, where, name) -> events
Key = tuple[str, str, str, str]


def _where(filename: str, line: int) -> str:
    """A code object's place, relative to the package or the standard library."""
    for marker in ("simpler_daemon/", "benchmarks/", "site-packages/", "python3.11/"):
        if marker in filename:
            filename = marker + filename.rsplit(marker, 1)[1]
            break
    return f"{filename}:{line}"


class CallCounter:
    """A profile function that counts call events while ``active``, per function and thread.

    Only the counting thread's events are "main"; every other thread's are "other".
    Keys are built from strings, never from the objects themselves, so counting
    keeps nothing alive.
    """

    def __init__(self) -> None:
        self.active = False
        self.main = threading.get_ident()
        self.counts: Counter[Key] = Counter()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.active or event not in ("call", "c_call"):
            return
        tag = "main" if threading.get_ident() == self.main else "other"
        if event == "call":
            code = frame.f_code
            key = (event, tag, _where(code.co_filename, code.co_firstlineno), code.co_qualname)
        else:
            owner = (
                getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__name__
            )
            key = (event, tag, str(owner), getattr(arg, "__qualname__", repr(arg)))
        self.counts[key] += 1

    def per_run(self, event: str, tags: tuple[str, ...], runs: int) -> float:
        return sum(v for k, v in self.counts.items() if k[0] == event and k[1] in tags) / runs

    def top(self, runs: int) -> list[dict[str, Any]]:
        """The ``TOP`` busiest Python functions, then the ``TOP_C`` busiest C ones."""
        rows = []
        for event, limit in (("call", TOP), ("c_call", TOP_C)):
            items = [kv for kv in self.counts.items() if kv[0][0] == event]
            rows += sorted(items, key=lambda kv: (-kv[1], kv[0]))[:limit]
        return [
            {"event": e, "thread": t, "where": w, "name": n, "per_run": round(v / runs, 2)}
            for (e, t, w, n), v in rows
        ]


def count_one(eng: Any, warm: int, runs: int) -> tuple[Result, list[dict[str, Any]]]:
    """One repetition: a fresh Worker, ``warm`` runs, ``runs`` counted runs."""
    counter = CallCounter()
    threading.setprofile(counter)  # threads started from here on carry it
    try:
        with worker(eng, [tasks.empty]) as (w, (h_empty,)):
            task_args = eng.TaskArgs

            def orch(o: Any, args: Any = None, config: Any = None) -> None:
                o.submit_sub(h_empty, task_args())

            _time_runs(w.run, orch, warm)
            sys.setprofile(counter)
            counter.active = True
            try:
                for _ in range(runs):
                    w.run(orch)
            finally:
                counter.active = False
                sys.setprofile(None)
    finally:
        threading.setprofile(None)  # None removes it
    rep = {
        "py_calls": counter.per_run("call", ("main",), runs),
        "c_calls": counter.per_run("c_call", ("main",), runs),
        "py_calls_all": counter.per_run("call", ("main", "other"), runs),
        "c_calls_all": counter.per_run("c_call", ("main", "other"), runs),
        "runs": runs,
    }
    return rep, counter.top(runs)


def measure(p: dict[str, int], repeat: int) -> dict[str, Result]:
    """``{"ours_calls": result}``; unavailable (with the reason) when the engine fails."""
    eng, reason = load_engine()
    if eng is None:
        return {"ours_calls": unavailable(reason)}
    try:
        reps: list[Result] = []
        top: list[dict[str, Any]] = []
        for _ in range(repeat):
            rep, top = count_one(eng, p["calls_warm"], p["calls_runs"])
            reps.append(rep)
    except Exception as exc:
        traceback.print_exc()
        return {"ours_calls": unavailable(_describe(exc))}
    return {"ours_calls": ok(reps, api="Worker.run", profiler="sys.setprofile", top=top)}


def top_text(result: Result, title: str) -> str:
    """The per-function list of a ``measure`` result as plain text (one line a function)."""
    rep = result["reps"][-1]
    lines = [
        title,
        f"{rep['py_calls']:.1f} Python calls and {rep['c_calls']:.1f} C calls per run on the "
        f"calling thread; {rep['py_calls_all']:.1f} and {rep['c_calls_all']:.1f} with the "
        f"Worker's other threads ({rep['runs']} runs counted, the last repetition).",
        "",
        f"{'per run':>8}  {'event':<6}  {'thread':<6}  function",
    ]
    for row in result["info"]["top"]:
        name = f"{row['where']} {row['name']}"
        lines.append(f"{row['per_run']:>8.2f}  {row['event']:<6}  {row['thread']:<6}  {name}")
    return "\n".join(lines) + "\n"


def write_listings(
    doc: dict[str, Any],
    out: Path,
    stamp: str,
    where: tuple[str, str, str],
    text: Callable[[Result, str], str],
) -> list[Path]:
    """``<stamp>-<name>.txt`` (and ``-before`` for the baseline) from the per-function list
    of variant ``variant`` of workload ``workload`` when it counted; ``where`` is
    ``(workload, variant, name)``, ``text`` renders one result under a title."""
    workload, variant, name = where
    written = []
    wl = doc["workloads"].get(workload, {})
    sources = (("", wl.get("systems", {})), ("-before", wl.get("baseline_systems", {})))
    for suffix, systems in sources:
        res = systems.get(variant)
        if not res or res.get("status") != "ok" or not res.get("info", {}).get("top"):
            continue
        what = "the working tree" if not suffix else f"the baseline {doc['baseline']['rev']}"
        path = out / f"{stamp}-{name}{suffix}.txt"
        path.write_text(text(res, what))
        written.append(path)
    return written


def write_top(doc: dict[str, Any], out: Path, stamp: str) -> list[Path]:
    """``<stamp>-w1-calls.txt`` (and ``-before`` for the baseline) when W1 counted calls."""
    return write_listings(
        doc,
        out,
        stamp,
        ("W1", "ours_calls", "w1-calls"),
        lambda res, what: top_text(res, f"W1 Python calls per run, {what}"),
    )


def main(argv: list[str] | None = None) -> int:
    return standalone("calls", "W1", measure, argv, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
