"""The engine, measured through its public API only.

``simpler_daemon`` is imported lazily inside the cell: when ``Worker`` cannot
be imported, or fails while being measured, every variant of the workload is
reported ``unavailable (<reason>)`` and the peers are measured all the same.

Variants: ``ours`` drives ``Worker.run`` (blocking); ``ours_async`` awaits
``Worker.run_async`` under ``asyncio.Runner`` with uvloop when importable;
``ours_nested`` is W1 (one empty task per run) through a local L3
(``benchmarks/nested.py``); ``ours_calls`` counts W1's Python calls per run
(``benchmarks/calls.py``).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks import tasks
from benchmarks.machine import w3_floor_ns
from benchmarks.proctree import measure_idle_cpu
from benchmarks.workloads import (
    ADMISSION_ENV,
    NUM_WORKERS,
    W5_ELEMENTS,
    WORKLOADS,
    Result,
    efficiency_rep,
    latency_rep,
    ok,
    per_task_rep,
    throughput_rep,
)

WARM_UP_RUNS = 20
Orch = Callable[..., None]


def _describe(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def load_engine() -> tuple[Any, str]:
    """``(namespace of Worker, TaskArgs, Tag, CallConfig, "")`` or ``(None, reason)``."""
    try:
        module = importlib.import_module("simpler_daemon")
        names = {}
        for name in ("Worker", "TaskArgs", "Tag", "CallConfig"):  # Worker first: named if absent
            if not hasattr(module, name):
                where = getattr(module, "__file__", None) or "no __init__.py"
                raise ImportError(f"cannot import name {name!r} from 'simpler_daemon' ({where})")
            names[name] = getattr(module, name)
    except Exception as exc:  # ImportError, or anything the package raises on import
        return None, _describe(exc)
    return SimpleNamespace(**names), ""


def unavailable(reason: str) -> Result:
    return {"status": "unavailable", "reason": reason}


Closer = Callable[[Any], None]


def close_blocking(w: Any) -> None:
    w.close()


def close_in(runner: asyncio.Runner) -> Closer:
    """Close a Worker used through run_async on its own loop (``close_async`` when it has one).

    A Worker bound to an event loop cannot block on that loop while it is not
    running, so ``close()`` after ``runner.run(...)`` returned would raise.
    """

    def close(w: Any) -> None:
        if hasattr(w, "close_async"):
            runner.run(w.close_async())
        else:
            w.close()

    return close


@contextmanager
def worker(
    eng: Any, fns: list[Callable[..., Any]], close: Closer = close_blocking
) -> Iterator[tuple[Any, list[Any]]]:
    """A started ``Worker(level=3, num_sub_workers=2)`` with ``fns`` registered; closed after."""
    admission = os.environ.get(ADMISSION_ENV)
    if admission:  # python -m benchmarks --admission fair
        w = eng.Worker(level=3, num_sub_workers=NUM_WORKERS, admission=admission)
    else:
        w = eng.Worker(level=3, num_sub_workers=NUM_WORKERS)
    try:
        handles = [w.register(fn) for fn in fns]
        w.init()
        yield w, handles
    except BaseException:
        try:
            close(w)
        except Exception:
            traceback.print_exc()  # the original error is the one worth reporting
        raise
    else:
        close(w)


def event_loop_runner() -> tuple[asyncio.Runner, str]:
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner(), "asyncio"
    return asyncio.Runner(loop_factory=uvloop.new_event_loop), f"uvloop {uvloop.__version__}"


def _time_runs(run: Callable[[Orch], Any], orch: Orch, count: int) -> list[int]:
    samples, clock = [], time.perf_counter_ns
    for _ in range(count):
        t0 = clock()
        run(orch)
        samples.append(clock() - t0)
    return samples


async def _time_runs_async(run_async: Callable[[Orch], Any], orch: Orch, count: int) -> list[int]:
    samples, clock = [], time.perf_counter_ns
    for _ in range(count):
        t0 = clock()
        await run_async(orch)
        samples.append(clock() - t0)
    return samples


Setup = Callable[[Closer], AbstractContextManager[tuple[Any, Orch]]]


def _both_variants(
    setup: Setup,
    runs_per_rep: int,
    repeat: int,
    figures: Callable[[list[int]], Result],
    profile: Path | None = None,
) -> dict[str, Result]:
    """Time ``orch`` with run (``ours``), then run_async (``ours_async``) on a fresh Worker.

    A Worker serves either the blocking or the async API (its scheduler binds
    to one event loop), so each variant gets its own, warmed up first.
    """
    out: dict[str, Result] = {}
    warm = WARM_UP_RUNS if runs_per_rep > 1 else 1
    try:
        with setup(close_blocking) as (w, orch):
            _time_runs(w.run, orch, warm)
            if profile is not None:
                return {"ours": _profiled(w, orch, runs_per_rep, repeat, figures, profile)}
            reps = [figures(_time_runs(w.run, orch, runs_per_rep)) for _ in range(repeat)]
        out["ours"] = ok(reps, api="Worker.run")
    except Exception as exc:
        traceback.print_exc()
        out["ours"] = unavailable(_describe(exc))
    runner, loop_name = event_loop_runner()
    try:
        with runner, setup(close_in(runner)) as (w, orch):
            runner.run(_time_runs_async(w.run_async, orch, warm))
            reps = [
                figures(runner.run(_time_runs_async(w.run_async, orch, runs_per_rep)))
                for _ in range(repeat)
            ]
        out["ours_async"] = ok(reps, api="await Worker.run_async", loop=loop_name)
    except Exception as exc:
        traceback.print_exc()
        out["ours_async"] = unavailable(_describe(exc))
    return out


def _profiled(
    w: Any,
    orch: Orch,
    runs_per_rep: int,
    repeat: int,
    figures: Callable[[list[int]], Result],
    profile: Path,
) -> Result:
    """Run the timed part under cProfile; write ``.prof`` and a top-30 text summary."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        reps = [figures(_time_runs(w.run, orch, runs_per_rep)) for _ in range(repeat)]
    finally:
        prof.disable()
    prof.dump_stats(str(profile))
    text = io.StringIO()
    for order in ("cumulative", "tottime"):
        text.write(f"==== top 30 by {order} (parent process, Worker.run) ====\n")
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(30)
    profile.with_name(profile.stem + "-profile.txt").write_text(text.getvalue())
    return ok(reps, api="Worker.run", profiled=True)


def _empty_tasks(eng: Any, n: int) -> Setup:
    """A Worker with ``empty`` registered and an orch submitting ``n`` empty SUB tasks."""

    @contextmanager
    def setup(close: Closer) -> Iterator[tuple[Any, Orch]]:
        with worker(eng, [tasks.empty], close) as (w, (h_empty,)):
            task_args = eng.TaskArgs

            def orch(o: Any, args: Any = None, config: Any = None) -> None:
                for _ in range(n):
                    o.submit_sub(h_empty, task_args())

            yield w, orch

    return setup


def _value_tasks(eng: Any, n: int) -> Setup:
    """A Worker with ``take_value_task`` registered and an orch submitting ``n`` SUB
    tasks of one small value each (W1v, W2v: the value is added per task, as a caller
    building its arguments would)."""

    @contextmanager
    def setup(close: Closer) -> Iterator[tuple[Any, Orch]]:
        with worker(eng, [tasks.take_value_task], close) as (w, (h,)):
            task_args, value = eng.TaskArgs, tasks.VALUE

            def orch(o: Any, args: Any = None, config: Any = None) -> None:
                for _ in range(n):
                    o.submit_sub(h, task_args().add_value(value))

            yield w, orch

    return setup


def _w1(eng: Any, p: dict[str, int], repeat: int, profile: Path | None) -> dict[str, Result]:
    out = _both_variants(_empty_tasks(eng, 1), p["n"], repeat, latency_rep, profile)
    # W1 nested: the same one empty task one level down (L4 -> local L3 -> SUB), in the
    # same cell so the report can subtract W1 for the cost of one level.
    try:
        from benchmarks import nested

        out["ours_nested"] = nested.measure(p, repeat)
    except Exception as exc:
        traceback.print_exc()
        out["ours_nested"] = unavailable(_describe(exc))
    if profile is None:  # Python calls per run (benchmarks/calls.py), untimed, a fresh Worker
        from benchmarks import calls

        out.update(calls.measure(p, 1))
    return out


def _w2(eng: Any, p: dict[str, int], repeat: int, profile: Path | None) -> dict[str, Result]:
    n = p["n"]

    def figures(samples: list[int]) -> Result:
        return throughput_rep(n, samples[0])

    return _both_variants(_empty_tasks(eng, n), 1, repeat, figures, profile)


def _one_run_per_rep(
    w: Any, orch: Orch, repeat: int, figures: Callable[[int], Result], check: Callable[[], None]
) -> list[Result]:
    _time_runs(w.run, orch, 1)  # warm-up
    check()
    reps = []
    for _ in range(repeat):
        wall = _time_runs(w.run, orch, 1)[0]
        check()
        reps.append(figures(wall))
    return reps


def _w3(eng: Any, p: dict[str, int], repeat: int) -> dict[str, Result]:
    n, us = p["n"], p["spin_us"]
    with worker(eng, [tasks.spin_task]) as (w, (h_spin,)):

        def orch(o: Any, args: Any = None, config: Any = None) -> None:
            for _ in range(n):
                a = eng.TaskArgs()
                a.add_scalar(us)
                o.submit_sub(h_spin, a)

        reps = _one_run_per_rep(w, orch, repeat, lambda ns: efficiency_rep(n, us, ns), lambda: None)
    # The same CPU work in bare processes, no engine (benchmarks/machine.py): the
    # machine's own ceiling in this invocation.
    floor = [efficiency_rep(n, us, w3_floor_ns(n, us, NUM_WORKERS)) for _ in range(repeat)]
    return {
        "ours": ok(reps, api="Worker.run"),
        "ours_machine": ok(floor, api="bare processes (benchmarks/machine.py)"),
    }


def _w4(eng: Any, p: dict[str, int], repeat: int) -> dict[str, Result]:
    n = p["n"]
    with worker(eng, [tasks.incr_task]) as (w, (h_incr,)):
        counter = w.alloc((1,), "float64")

        def orch(o: Any, args: Any = None, config: Any = None) -> None:
            counter[0] = 0.0
            for _ in range(n):
                a = eng.TaskArgs()
                a.add_tensor(counter, eng.Tag.INOUT)  # each task depends on the previous one
                o.submit_sub(h_incr, a)

        def check() -> None:
            if counter[0] != n:
                raise RuntimeError(f"cannot verify W4 chain: counter {counter[0]} != {n}")

        reps = _one_run_per_rep(w, orch, repeat, lambda ns: throughput_rep(n, ns), check)
        return {"ours": ok(reps, api="Worker.run", dependency="INOUT on one heap tensor")}


def _w5(eng: Any, p: dict[str, int], repeat: int) -> dict[str, Result]:
    n = p["n"]
    with worker(eng, [tasks.sum_task]) as (w, (h_sum,)):
        x = w.alloc((W5_ELEMENTS,), "float64")
        x[:] = 1.0

        def orch(o: Any, args: Any = None, config: Any = None) -> None:
            for _ in range(n):
                a = eng.TaskArgs()
                a.add_tensor(x, eng.Tag.INPUT)  # readers only: no dependencies among them
                a.add_scalar(W5_ELEMENTS)  # expected sum; the task raises on a mismatch
                o.submit_sub(h_sum, a)

        reps = _one_run_per_rep(w, orch, repeat, lambda ns: per_task_rep(n, ns), lambda: None)
        return {"ours": ok(reps, api="Worker.run", passed_as="heap tensor (INPUT)")}


def _w8(eng: Any, p: dict[str, int], repeat: int) -> dict[str, Result]:
    with worker(eng, [tasks.empty]) as (w, (h_empty,)):

        def orch(o: Any, args: Any = None, config: Any = None) -> None:
            o.submit_sub(h_empty, eng.TaskArgs())

        _time_runs(w.run, orch, 5)
        time.sleep(0.5)
        reps = [measure_idle_cpu(p["seconds"]) for _ in range(repeat)]
        return {"ours": ok(reps, sub_workers=NUM_WORKERS)}


def run(workload: str, repeat: int, smoke: bool, profile: Path | None = None) -> dict[str, Result]:
    """Measure one workload on the engine; never raises for an engine failure."""
    spec = WORKLOADS[workload]
    eng, reason = load_engine()
    if eng is None:
        return {v: unavailable(reason) for v in spec.ours_variants}
    p = spec.params(smoke)
    try:
        if workload == "W1":
            return _w1(eng, p, repeat, profile)
        if workload == "W2":
            return _w2(eng, p, repeat, profile)
        if workload == "W1v":
            return _both_variants(_value_tasks(eng, 1), p["n"], repeat, latency_rep, None)
        if workload == "W2v":
            n = p["n"]
            return _both_variants(
                _value_tasks(eng, n), 1, repeat, lambda s: throughput_rep(n, s[0]), None
            )
        if workload == "W6":
            from benchmarks import daemon_calls, w6

            # The daemon's calls per run: a daemon of its own, counted, not timed.
            return {**w6.measure(p, repeat), **daemon_calls.measure(p, 1)}
        if workload == "W7":
            from benchmarks import w7

            return w7.measure(p, repeat)
        if workload == "W10":
            from benchmarks import w10

            return w10.measure(p, repeat)
        if workload == "W9":
            from benchmarks import w9

            return w9.measure(p, repeat)
        if workload == "W11":
            from benchmarks import w11

            return w11.measure(p, repeat)
        if workload == "M1":
            from benchmarks import memory

            return memory.measure(p, repeat)
        if workload == "W1g":
            from benchmarks import gaps

            return gaps.measure(p, repeat)
        if workload == "W1b":
            from benchmarks import bimodal

            return bimodal.measure(p, repeat)
        if workload == "S1":
            from benchmarks.staging import run_staging

            reps = []
            for _ in range(repeat):
                res = run_staging(runs=p["runs"])
                reps.append(
                    {
                        "depth2_ms": res["depth2"]["ms_per_run"],
                        "depth1_ms": res["depth1"]["ms_per_run"],
                        "ratio": res["ratio"],
                    }
                )
            return {"ours": ok(reps, kernel_ms=5, prepare_ms=5, chips=1)}
        measure = {"W3": _w3, "W4": _w4, "W5": _w5, "W8": _w8}[workload]
        return measure(eng, p, repeat)
    except Exception as exc:
        traceback.print_exc()
        return {v: unavailable(_describe(exc)) for v in spec.ours_variants}
