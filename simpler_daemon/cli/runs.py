"""simplerctl run commands: ``submit``, ``watch``, ``wait``, ``cancel``, ``runs``, ``trace``.

``submit`` owns what it creates: the buffers of the spec's ``[buffers]`` are freed
once their contents are printed (``--wait``/``--watch``, unless ``--keep``) and on
every failure before the run exists; callables already registered are reused.
A retry with an idempotency key reports the run the key names and the buffers
that run really used, or refuses (see :func:`_submit`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Final

import grpc

from simpler_daemon.cli.output import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_TIMEOUT,
    CliExit,
    Out,
    error_message,
    event_line,
    human_seconds,
    plain,
    print_status,
    progress_fields,
    progress_line,
    result_lines,
    short_name,
    state_name,
    status_dict,
    to_dict,
)
from simpler_daemon.cli.runspec import CreatedBuffer, SpecBuilder, load_spec
from simpler_daemon.client import TERMINAL_STATES, Client
from simpler_daemon.client.results import RunPhase, RunResult
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

__all__ = [
    "RUN_STATES",
    "cmd_cancel",
    "cmd_runs",
    "cmd_submit",
    "cmd_trace",
    "cmd_wait",
    "cmd_watch",
    "watch_run",
]

#: ``simplerctl runs --state`` choices -> proto states.
RUN_STATES = {
    short_name(name).lower(): value
    for name, value in pb.RunState.items()
    if value != pb.RUN_STATE_UNSPECIFIED
}


#: The progress bar redraws at least this often (seconds), events or not, so the elapsed
#: time and the rate keep moving while a long task runs.
TICK_SECONDS: Final = 1.0


def _status_exit(status: RunResult) -> int:
    if status.state is RunPhase.COMPLETED:
        return EXIT_OK
    return EXIT_FAILED if status.terminal else EXIT_TIMEOUT


# --------------------------------------------------------------------------- submit


def _is_key_conflict(exc: grpc.RpcError) -> bool:
    """The daemon refused the key: it names a run submitted with a different request."""
    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return False
    field = getattr(exc, "field", None)
    return field == "idempotency_key" or (exc.details() or "").startswith("idempotency_key")


def _free(c: Client, created: dict[str, CreatedBuffer], out: Out) -> None:
    """Free the buffers a submit made; a failure is reported, never raised (the command's
    own outcome matters more)."""
    for name, made in created.items():
        try:
            c.free_buffer(made.buffer_id)
        except grpc.RpcError as exc:
            out.note(f"cannot free buffer {made.buffer_id} ({name}): {exc.details()}")


def _submit(c: Client, builder: SpecBuilder, a: argparse.Namespace, out: Out) -> tuple[int, bool]:
    """Create the buffers, submit; ``(run_id, deduplicated)``.

    A run's idempotency key stands for one exact request, buffer ids included. A retry
    of ``simplerctl submit --idempotency-key K`` makes fresh buffers, so the daemon sees
    a different request: the retry then frees them and submits the request again on the
    buffers the earlier submit with K made (labelled with K, see ``buffer_label``), which
    the daemon recognises, so the real run and its real outputs are reported. When
    those buffers are gone (freed once that submit printed them) it refuses.
    """
    spec, key = builder.spec, builder.key
    priority = a.priority if a.priority is not None else spec.priority
    try:
        builder.allocate()
        tasks = builder.tasks()
        try:
            fut = c.submit(tasks, idempotency_key=key, label=a.label_value, priority=priority)
            if not (fut.deduplicated and builder.created):
                return fut.run_id, fut.deduplicated
            conflict: grpc.RpcError | None = None
        except grpc.RpcError as exc:
            if not (key and _is_key_conflict(exc)):
                raise
            conflict = exc
    except BaseException:
        _free(c, builder.created, out)
        builder.created = {}
        raise
    # A retry: the fresh buffers are not the ones the earlier run used.
    earlier = builder.earlier_buffers()
    _free(c, builder.created, out)
    builder.created = {}
    if earlier is None:
        said = f" (the daemon says: {conflict.details()})" if conflict is not None else ""
        out.error(
            "DEDUPLICATED",
            f"cannot show the run idempotency key {key!r} names: the buffers its first "
            "submit created are gone (freed after it printed them; --keep keeps them) or "
            f"the spec differs from that submit's; use a new key to run again{said}",
        )
        raise CliExit(EXIT_REFUSED)
    builder.adopt(earlier)
    # The same request as the earlier submit's: the daemon answers with that run. (Had
    # the daemon forgotten the key meanwhile, this would start a run on those buffers.)
    fut = c.submit(builder.tasks(), idempotency_key=key, label=a.label_value, priority=priority)
    return fut.run_id, fut.deduplicated


def cmd_submit(c: Client, a: argparse.Namespace, out: Out) -> int:
    spec = load_spec(a.file)
    a.label_value = a.label if a.label is not None else spec.label
    key = a.idempotency_key if a.idempotency_key is not None else spec.idempotency_key
    builder = SpecBuilder(c, spec, key)
    run_id, deduplicated = _submit(c, builder, a, out)
    buffers = {name: b.buffer_id for name, b in builder.created.items()}
    if not (a.wait or a.watch):
        if out.json:
            out.data({"run_id": run_id, "deduplicated": deduplicated, "buffers": buffers})
        else:
            dedup = " (deduplicated: an earlier run with this key)" if deduplicated else ""
            out.line(f"run {run_id} submitted{dedup}")
            if c.wait_run(run_id, 0).state is RunPhase.QUEUED:
                out.note(
                    f"run {run_id} is QUEUED: this client has limits.per_client_runs active "
                    "runs; it starts as they end (`simplerctl runs --state queued`)"
                )
            for name, bid in buffers.items():
                out.line(f"  buffer {name}: {bid}")
            if buffers:
                ids = " ".join(map(str, buffers.values()))
                out.note(f"the buffers stay until freed: simplerctl free {ids}")
        return EXIT_OK
    try:
        return _follow(c, a, out, run_id, builder, deduplicated)
    except BrokenPipeError:
        # `simplerctl submit ... --wait | head -1`: nobody reads the outputs any more, so
        # the buffers are freed as after printing them (released by the daemon once the
        # run ends when it is still going); main() then exits 141.
        if not a.keep and builder.created:
            ids = " ".join(str(b.buffer_id) for b in builder.created.values())
            out.note(f"stdout closed: freeing the buffers of run {run_id} ({ids})")
            _free(c, builder.created, out)
        raise


def _follow(
    c: Client,
    a: argparse.Namespace,
    out: Out,
    run_id: int,
    builder: SpecBuilder,
    deduplicated: bool,
) -> int:
    """``submit --wait|--watch`` once the run exists: follow it, print it, free."""
    buffers = {name: b.buffer_id for name, b in builder.created.items()}
    try:
        if a.watch:
            code, status = watch_run(c, run_id, out, a.timeout, summary=False)
        else:
            status = c.wait_run(run_id, a.timeout, include_results=True)
            code = _status_exit(status)
    except KeyboardInterrupt:
        return _interrupted(c, a, out, run_id, builder)
    contents = {}
    if status.state is RunPhase.COMPLETED:
        for name, made in builder.created.items():
            if made.shown:
                contents[name] = c.read_array(made.buffer_id, made.shape, made.dtype).tolist()
    terminal = status.terminal
    keep = a.keep or not terminal
    if out.json:
        final = {
            **status_dict(status),
            "deduplicated": deduplicated,
            "buffers": buffers,
            "contents": contents,
            "kept": keep,
        }
        # --watch: the last line of the one-object-per-line event stream.
        (out.record if a.watch else out.data)(final)
    else:
        if a.wait:
            print_status(out, status)
            if not terminal:
                out.line(f"  still {state_name(status.state)} after {a.timeout}s")
        if deduplicated:
            out.line("  (deduplicated: the run an earlier submit with this key started)")
        for line in result_lines(status):
            out.line(line)
        for name, values in contents.items():
            out.line(f"  {name} (buffer {buffers[name]}): {values}")
        if keep and buffers:
            ids = " ".join(map(str, buffers.values()))
            why = "--keep" if a.keep else "the run is still going"
            out.note(f"buffers kept ({why}); free them with: simplerctl free {ids}")
    if not keep:
        _free(c, builder.created, out)
    return code


def _interrupted(
    c: Client, a: argparse.Namespace, out: Out, run_id: int, builder: SpecBuilder
) -> int:
    """Ctrl-C while following a submitted run: cancel it (``--cancel-on-interrupt``, or
    when the user says so at the prompt) or leave it running and say how to find it."""
    print(file=sys.stderr)
    answer = "y" if a.cancel_on_interrupt else ""
    if not answer and sys.stdin.isatty() and not out.json:
        # The question goes to stderr: stdout may be a pipe that only wants the output.
        print(
            f"run {run_id} is still running: cancel it? "
            "[y = cancel, t = cancel and stop its running tasks, N = leave it running] ",
            end="",
            file=sys.stderr,
            flush=True,
        )
        try:
            answer = sys.stdin.readline()
        except KeyboardInterrupt:
            answer = ""
    answer = answer.strip().lower()
    if answer in ("y", "yes", "t", "terminate"):
        terminate = answer.startswith("t")
        result = c.cancel(run_id, "interrupted in simplerctl submit", terminate=terminate)
        # Exit as soon as the daemon acknowledged the cancel: tasks already running (without
        # terminate) finish in the daemon, nothing here needs to wait for them.
        running = 0 if terminate else c.wait_run(run_id, 0).counts.running
        ids = " ".join(str(b.buffer_id) for b in builder.created.values())
        if not a.keep:
            # Freed now, released by the daemon once the run's tasks let go of them.
            _free(c, builder.created, out)
        if out.json:
            out.record({"run_id": run_id, "interrupted": True, "running": running, **plain(result)})
        else:
            detail = " (its running tasks stopped)" if terminate else ""
            if running:
                detail = (
                    f"; its {running} running task(s) finish in the background "
                    f"(`simplerctl cancel {run_id} --terminate` stops them)"
                )
            if ids:
                detail += (
                    f"; its buffers ({ids}) are released when the run ends"
                    if not a.keep
                    else f"; its buffers stay until `simplerctl free {ids}`"
                )
            out.note(f"run {run_id} cancelled{detail}")
        return EXIT_INTERRUPTED
    ids = " ".join(str(b.buffer_id) for b in builder.created.values())
    out.note(
        f"run {run_id} keeps running: `simplerctl watch {run_id}` follows it, "
        f"`simplerctl cancel {run_id}` cancels it"
        + (f"; its buffers stay until `simplerctl free {ids}`" if ids else "")
    )
    return EXIT_INTERRUPTED


# --------------------------------------------------------------------------- watch / wait


class _WatchTimeout(Exception):
    """``--timeout`` passed while watching."""


@contextlib.contextmanager
def _deadline(seconds: float | None, tick: Callable[[], None] | None = None) -> Iterator[None]:
    """Raise :class:`_WatchTimeout` in this (main) thread after ``seconds``, and call
    ``tick`` every :data:`TICK_SECONDS` meanwhile (the progress bar's redraw).

    A run whose tasks are stuck sends no event, so neither can wait for the next event.
    The blocking gRPC stream iterator wakes every 0.1 s to run signal handlers (that is
    how Ctrl-C reaches it), so an interval timer's handler ends the watch (the
    iterator's cleanup cancels the stream) or redraws. Outside the main thread (no
    signals) the watch is unbounded, as without ``--timeout``, and redraws only on
    events."""
    if (seconds is None and tick is None) or (
        threading.current_thread() is not threading.main_thread()
    ):
        yield
        return
    end = None if seconds is None else time.monotonic() + max(seconds, 0.001)

    def arm() -> None:
        left = TICK_SECONDS if end is None else min(TICK_SECONDS, end - time.monotonic())
        signal.setitimer(signal.ITIMER_REAL, max(left, 0.001))

    def expired(signum: int, frame: object) -> None:
        if end is not None and time.monotonic() >= end:
            raise _WatchTimeout
        arm()
        if tick is not None:
            tick()

    previous = signal.signal(signal.SIGALRM, expired)
    arm()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def watch_run(
    c: Client, run_id: int, out: Out, timeout: float | None = None, *, summary: bool = True
) -> tuple[int, RunResult]:
    """Follow a run until it ends or ``timeout`` seconds pass; ``(exit status, status)``.

    On a terminal a progress bar (elapsed, rate, ETA) redraws in place; otherwise one line
    per event; with ``--json`` one object per event with the same numbers. ``summary``:
    print the final status too (``watch``; ``submit`` prints its own)."""
    tty = not out.json and out.stream.isatty()
    started = time.monotonic()
    last: pb.RunEvent | None = None
    timed_out = False
    drawing = False

    def draw() -> None:
        # Also called from the SIGALRM handler: never inside another draw (the stream is
        # not reentrant), and with the latest event's counts at the current elapsed time.
        nonlocal drawing
        if drawing or last is None:
            return
        drawing = True
        try:
            line = "\r\x1b[2K" + progress_line(last, time.monotonic() - started)
            print(line, end="", file=out.stream, flush=True)
        finally:
            drawing = False

    try:
        with _deadline(timeout, draw if tty else None):
            for ev in c.watch(run_id):
                last = ev
                elapsed = time.monotonic() - started
                if out.json:
                    out.record({**to_dict(ev), **progress_fields(ev, elapsed)})
                elif tty:
                    draw()
                else:
                    out.line(event_line(ev))
                if ev.type == pb.RUN_EVENT_TYPE_RUN_STATE and ev.state in TERMINAL_STATES:
                    break
    except _WatchTimeout:
        timed_out = True
    finally:
        if tty and last is not None:
            print(file=out.stream, flush=True)
    status = c.wait_run(run_id, 0, include_results=True)
    if timed_out or not status.terminal:
        text = f"run {run_id} still {state_name(status.state)} after {human_seconds(timeout or 0)}"
        if out.json and summary:
            out.record({**status_dict(status), "timed_out": True})
        elif not out.json:
            out.note(text)
        return EXIT_TIMEOUT, status
    if out.json:
        if summary:
            out.record(status_dict(status))
    elif status.state is not RunPhase.COMPLETED and error_message(status):
        out.note(f"run {run_id} {state_name(status.state)}: {error_message(status)}")
    return _status_exit(status), status


def cmd_watch(c: Client, a: argparse.Namespace, out: Out) -> int:
    return watch_run(c, a.run, out, a.timeout)[0]


def cmd_wait(c: Client, a: argparse.Namespace, out: Out) -> int:
    status = c.wait_run(a.run, a.timeout, include_results=True)
    print_status(out, status)
    if not status.terminal and not out.json:
        out.line(f"  still {state_name(status.state)} after {a.timeout}s")
    if not out.json:
        for line in result_lines(status):
            out.line(line)
    return _status_exit(status)


def cmd_cancel(c: Client, a: argparse.Namespace, out: Out) -> int:
    result = c.cancel(a.run, a.reason, terminate=a.terminate)
    if out.json:
        out.data({"run_id": a.run, **plain(result)})
    elif result.already_finished:
        out.line(f"run {a.run} had already finished ({state_name(result.state)})")
    else:
        out.line(f"run {a.run} cancelled" + _cancel_detail(result.state, a.terminate))
    return EXIT_OK


def _cancel_detail(state: int, terminate: bool) -> str:
    if terminate:
        return " (its running tasks stopped)"
    if state in TERMINAL_STATES:
        return ""
    return " (tasks already running finish first; --terminate stops them)"


def cmd_trace(c: Client, a: argparse.Namespace, out: Out) -> int:
    """Write the run's Chrome trace (JSON) to ``-o FILE`` (``-``: standard output)."""
    doc = c.trace(a.run)
    text = json.dumps(doc, separators=(",", ":"))
    attempts = doc.get("otherData", {}).get("attempts", 0)
    if a.output == "-":
        sys.stdout.write(text + "\n")
        return EXIT_OK
    try:
        with open(a.output, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        out.error(
            "WRITE_FAILED",
            f"cannot write the trace of run {a.run} to {a.output}: {exc.strerror or exc}",
        )
        raise CliExit(EXIT_FAILED) from None
    if out.json:
        out.data({"run_id": a.run, "file": a.output, "attempts": attempts})
    else:
        out.line(
            f"run {a.run}: {attempts} task attempts written to {a.output} "
            "(open it in https://ui.perfetto.dev or chrome://tracing)"
        )
    return EXIT_OK


def cmd_runs(c: Client, a: argparse.Namespace, out: Out) -> int:
    states = [RUN_STATES[s] for s in a.state or ()]
    runs = c.list_runs(states=states, limit=a.limit)
    if out.json:
        # The table's state names (and --state's): COMPLETED, not RUN_STATE_COMPLETED.
        out.data([{**plain(r), "state": state_name(r.state)} for r in runs])
        return EXIT_OK
    out.table(
        ["RUN", "STATE", "DONE", "FAILED", "AGE", "PRIO", "CLIENT", "LABEL"],
        [
            [
                r.run_id,
                state_name(r.state),
                f"{r.counts.done}/{r.counts.total}",
                r.counts.failed,
                human_seconds(r.age_seconds),
                r.priority,
                r.client,
                r.label,
            ]
            for r in runs
        ],
    )
    return EXIT_OK
