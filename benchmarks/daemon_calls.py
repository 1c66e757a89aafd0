"""W6's daemon calls per run: the Python work one fast-path one-task run costs the daemon.

The daemon's CPU per run is a timing, and this machine kind's timings move by ±10 %
between minutes; a count of the calls the daemon's event-loop thread makes per run
moves only with the code, so a change on the daemon's path shows in review (as W1's
count does in-process, ``benchmarks/calls.py``).

How: ``simpler-daemon serve`` runs under this module (``python -m
benchmarks.daemon_calls serve --config ...``), which installs a ``SIGRTMIN+3`` handler
and then calls the daemon's own ``main``. The first signal starts counting
(``sys.setprofile`` with ``calls.CallCounter`` on the main thread, where the daemon's
event loop runs) and writes ``<out>.on``; the second stops and writes ``<out>`` (the
counts as JSON). Between them the client makes ``calls_runs`` W6 W1 runs (one empty
SUB task, ``SubmitRun`` with ``wait_seconds``, over the fast path), after
``calls_warm`` runs. Nothing else runs in the daemon meanwhile, so what the window
holds is those runs; the per-function list goes to ``info["top"]``.

Rows: "W6 daemon Python calls per run (fast)" and "... C calls per run (fast)".

Run inside the suite (``python -m benchmarks --only W6``: variant ``ours_fast_calls``)
or standalone::

    python -m benchmarks.daemon_calls [--smoke] [--repeat N]
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.calls import CallCounter, write_listings
from benchmarks.workloads import Result, ok, standalone

#: The signal that starts and stops the count in the daemon.
TOGGLE = signal.SIGRTMIN + 3
#: Where the daemon writes the counts (its ``.on`` sibling once it counts).
OUT_ENV = "SIMPLER_BENCH_CALLS_OUT"
ACK_TIMEOUT = 30.0


def _serve(argv: list[str]) -> int:
    """The daemon's ``main`` with the count's signal handler installed first."""
    from simpler_daemon.server.main import main

    out = Path(os.environ[OUT_ENV])
    counter = CallCounter()

    def toggle(_signum: int, _frame: Any) -> None:
        if not counter.active:
            counter.counts.clear()
            counter.active = True
            sys.setprofile(counter)
            out.with_suffix(".on").write_text("counting\n")
            return
        sys.setprofile(None)
        counter.active = False
        doc = {
            "py_calls": counter.per_run("call", ("main",), 1),
            "c_calls": counter.per_run("c_call", ("main",), 1),
            "top": counter.top(1),
        }
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(out)

    signal.signal(TOGGLE, toggle)
    return main(argv)


def _await_file(path: Path, pid: int) -> None:
    deadline = time.monotonic() + ACK_TIMEOUT
    while not path.exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise RuntimeError("the daemon exited while calls were counted") from None
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemon did not write {path.name} within {ACK_TIMEOUT:.0f} s")
        time.sleep(0.001)


def count_one(p: dict[str, int]) -> tuple[Result, list[dict[str, Any]]]:
    """One repetition: a fresh daemon, ``calls_warm`` runs, ``calls_runs`` counted runs."""
    from benchmarks import w6
    from simpler_daemon.client import Client, sub_task
    from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

    warm, runs = p["calls_warm"], p["calls_runs"]
    with tempfile.TemporaryDirectory(prefix="bench-w6-calls-") as tmp:
        directory = Path(tmp)
        out = directory / "calls.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            x for x in (env.get("PYTHONPATH"), str(w6.REPO_ROOT)) if x
        )
        env[OUT_ENV] = str(out)
        config = w6._config(directory, 1)
        with (
            w6.serve(directory, config, env, "w6 calls", module="benchmarks.daemon_calls") as pid,
            Client(str(directory / "run" / "daemon.sock"), timeout=None, transport="fast") as c,
        ):
            one = [sub_task(c.register(w6.EMPTY))]

            def run_once() -> None:
                status = c.submit_run(one, wait_seconds=600.0).status
                if status.state != pb.RUN_STATE_COMPLETED:
                    raise RuntimeError(f"cannot count: run {status.run_id} {status.error.message}")

            for _ in range(warm):
                run_once()
            os.kill(pid, TOGGLE)
            _await_file(out.with_suffix(".on"), pid)
            for _ in range(runs):
                run_once()
            os.kill(pid, TOGGLE)
            _await_file(out, pid)
            doc = json.loads(out.read_text())
    rep = {"py_calls": doc["py_calls"] / runs, "c_calls": doc["c_calls"] / runs, "runs": runs}
    top = [dict(row, per_run=round(row["per_run"] / runs, 2)) for row in doc["top"]]
    return rep, top


def measure(p: dict[str, int], repeat: int) -> dict[str, Result]:
    """``{"ours_fast_calls": result}``; unavailable (with the reason) when it fails."""
    from benchmarks.ours import _describe, unavailable

    try:
        reps: list[Result] = []
        top: list[dict[str, Any]] = []
        for _ in range(repeat):
            rep, top = count_one(p)
            reps.append(rep)
    except Exception as exc:
        traceback.print_exc()
        return {"ours_fast_calls": unavailable(_describe(exc))}
    return {
        "ours_fast_calls": ok(
            reps,
            api="simpler_daemon.client.Client(transport='fast'): SubmitRun(wait_seconds)",
            profiler="sys.setprofile in the daemon's event-loop thread",
            top=top,
        )
    }


def top_text(result: Result, title: str) -> str:
    """The per-function list of a ``measure`` result as plain text (one line a function)."""
    rep = result["reps"][-1]
    lines = [
        title,
        f"{rep['py_calls']:.1f} Python calls and {rep['c_calls']:.1f} C calls per run on the "
        f"daemon's event-loop thread ({rep['runs']} runs counted, the last repetition).",
        "",
        f"{'per run':>8}  {'event':<6}  function",
    ]
    for row in result["info"]["top"]:
        lines.append(f"{row['per_run']:>8.2f}  {row['event']:<6}  {row['where']} {row['name']}")
    return "\n".join(lines) + "\n"


def write_top(doc: dict[str, Any], out: Path, stamp: str) -> list[Path]:
    """``<stamp>-w6-daemon-calls.txt`` (``-before`` for the baseline) when W6 counted."""
    return write_listings(
        doc,
        out,
        stamp,
        ("W6", "ours_fast_calls", "w6-daemon-calls"),
        lambda res, what: top_text(res, f"W6 daemon calls per fast-path W1 run, {what}"),
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["serve"]:  # the daemon under the count's handler
        return _serve(args)
    return standalone("daemon_calls", "W6", measure, argv, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
