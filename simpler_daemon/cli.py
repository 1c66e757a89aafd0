"""``simplerctl``: the command-line client of simpler-daemon.

::

    simplerctl [--socket PATH|HOST:PORT] [--json] COMMAND ...
      info                      daemon version, level, heap, limits, serving state
      workers                   every worker and its state: local L3 workers with their
                                children indented, remote L3 sessions below
      callables                 every registered callable
      register PATH [--kind]    register "module:qualname" (kind sub, chip or orchestration)
      submit FILE [--wait|--watch] [--timeout S] [--idempotency-key K] [--label L]
      watch RUN                 live progress until the run ends
      wait RUN [--timeout S]    wait for a run; its status
      cancel RUN [--reason R]   cancel a run
      buffers                   every live buffer
      drain [--grace S] [--shutdown]
      add-remote IP:PORT [--num-sub-workers N] [--num-chips N] [--session-timeout S]
                                open a session on a simpler-remote-worker (level 4)

A run spec (JSON, or TOML when the file ends in ``.toml``)::

    label = "demo"
    [buffers.a]                       # optional: buffers created (and filled) for the run
    shape = [8]
    dtype = "float32"
    fill = 2                          # or data = [...]
    [buffers.out]
    shape = [8]
    dtype = "float32"

    [[tasks]]
    kind = "sub"                      # sub | sub_group | next_level | next_level_group
    callable = "simpler_daemon.examples.tasks:scale"   # import path (registered first) or hashid
    scalars = [3]                     # one member: tensors/scalars inline, else [[tasks.members]]
    tensors = [{ buffer = "a", tag = "inout" }]         # buffer: a name above or a buffer id;
                                                        # shape/dtype default to the buffer's
    workers = []                      # NEXT_LEVEL targets
    config = { deadline_ms = 1000 }

Exit status: 0 ok, 1 the run failed (or was cancelled), 2 usage or validation
error (a bad spec, an INVALID_ARGUMENT, PERMISSION_DENIED, RESOURCE_EXHAUSTED or
FAILED_PRECONDITION from the daemon), 3 daemon unreachable, 4 not found,
5 ``wait``/``--wait`` timed out with the run still active.

This module holds the commands, the argument parser and the exit codes; run
specs become ``Task`` messages in :mod:`simpler_daemon.cli_spec` and every line
printed is formatted by :mod:`simpler_daemon.cli_output`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final, NoReturn

import grpc

from simpler_daemon import __version__
from simpler_daemon.cli_output import (
    Out,
    event_line,
    print_status,
    progress_line,
    remote_header,
    remote_row,
    short_name,
    state_name,
    to_dict,
    worker_header,
    worker_rows,
)
from simpler_daemon.cli_spec import SpecBuilder, SpecError, SpecRpcError, get_field, load_spec
from simpler_daemon.client import TERMINAL_STATES, Client
from simpler_daemon.server._proto.simpler.daemon.v1 import daemon_pb2 as pb

__all__ = ["EXIT_FAILED", "EXIT_NOT_FOUND", "EXIT_OK", "EXIT_UNREACHABLE", "EXIT_USAGE", "main"]

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_UNREACHABLE: Final = 3
EXIT_NOT_FOUND: Final = 4
EXIT_TIMEOUT: Final = 5

_STATUS_EXIT: Final[dict[grpc.StatusCode, int]] = {
    grpc.StatusCode.NOT_FOUND: EXIT_NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE: EXIT_UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: EXIT_UNREACHABLE,
    grpc.StatusCode.INVALID_ARGUMENT: EXIT_USAGE,
    grpc.StatusCode.PERMISSION_DENIED: EXIT_USAGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: EXIT_USAGE,
    grpc.StatusCode.FAILED_PRECONDITION: EXIT_USAGE,
    grpc.StatusCode.UNAUTHENTICATED: EXIT_USAGE,
    grpc.StatusCode.OUT_OF_RANGE: EXIT_USAGE,
    grpc.StatusCode.UNIMPLEMENTED: EXIT_USAGE,
}
_MAX_SHOWN: Final = 64


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


# --------------------------------------------------------------------------- commands


def _status_exit(status: pb.RunStatus) -> int:
    if status.state == pb.RUN_STATE_COMPLETED:
        return EXIT_OK
    if status.state in TERMINAL_STATES:
        return EXIT_FAILED
    return EXIT_TIMEOUT


def cmd_info(c: Client, a: argparse.Namespace, out: Out) -> int:
    info = c.get_info()
    if out.json:
        out.data(to_dict(info))
        return EXIT_OK
    lim = info.limits
    out.line(
        f"simpler-daemon {info.version} (level {info.level}) on {info.hostname}, pid {info.pid}"
    )
    out.line(
        f"state:    {short_name(pb.ServingState.Name(info.serving_state))}, "
        f"{info.active_runs} active runs"
    )
    out.line(f"workers:  {info.num_sub_workers} SUB, {info.num_next_level_workers} NEXT_LEVEL")
    out.line(
        f"heap:     {info.heap.used_bytes}/{info.heap.size_bytes} bytes used"
        + (f" ({info.heap.name})" if info.heap.name else "")
    )
    out.line(
        f"limits:   {lim.max_tasks_per_run} tasks/run, {lim.max_tensors_per_task} tensors "
        f"and {lim.max_scalars_per_task} scalars/task, {lim.max_message_bytes} bytes/message, "
        f"{lim.max_buffer_bytes} bytes/buffer, {lim.max_concurrent_runs} concurrent runs"
    )
    out.line(
        f"quotas:   {lim.per_client_runs} runs, {lim.per_client_heap_bytes} heap bytes, "
        f"{lim.per_client_registrations} registrations, {lim.max_streams_per_client} streams "
        "per client"
    )
    out.line(f"caller:   {info.caller}" + (" (admin)" if info.caller_is_admin else ""))
    return EXIT_OK


def cmd_workers(c: Client, a: argparse.Namespace, out: Out) -> int:
    workers = c.list_workers()
    if out.json:
        out.data([to_dict(w) for w in workers])
        return EXIT_OK
    out.table(worker_header(), worker_rows(workers))
    remotes = [w for w in workers if w.HasField("remote")]
    if remotes:
        out.line("")
        out.table(remote_header(), [remote_row(w) for w in remotes])
    return EXIT_OK


def cmd_callables(c: Client, a: argparse.Namespace, out: Out) -> int:
    callables = c.list_callables()
    if out.json:
        out.data([to_dict(x) for x in callables])
        return EXIT_OK
    out.table(
        ["HASHID", "KIND", "REFS", "IMPORT PATH"],
        [
            [x.hashid, short_name(pb.CallableKind.Name(x.kind)), x.refcount, x.import_path]
            for x in callables
        ],
    )
    return EXIT_OK


def cmd_register(c: Client, a: argparse.Namespace, out: Out) -> int:
    response = c.register_callable(a.path, a.kind)
    if out.json:
        out.data({"import_path": a.path, "kind": a.kind, **to_dict(response)})
    else:
        out.line(f"{response.hashid} {a.path} ({a.kind}, refcount {response.refcount})")
    return EXIT_OK


def cmd_buffers(c: Client, a: argparse.Namespace, out: Out) -> int:
    response = c.list_buffers()
    if out.json:
        out.data(to_dict(response))
        return EXIT_OK
    out.table(
        ["ID", "GEN", "DTYPE", "SHAPE", "BYTES", "REFS", "LABEL"],
        [
            [
                b.buffer_id,
                b.generation,
                b.dtype,
                "x".join(map(str, b.shape)) or "()",
                b.nbytes,
                b.references,
                b.label,
            ]
            for b in response.buffers
        ],
    )
    h = response.heap
    out.line(f"heap: {h.used_bytes}/{h.size_bytes} bytes used")
    return EXIT_OK


def cmd_submit(c: Client, a: argparse.Namespace, out: Out) -> int:
    spec = load_spec(a.file)
    builder = SpecBuilder(c)
    label = a.label if a.label is not None else get_field(spec, "label", "spec", str, "")
    key = (
        a.idempotency_key
        if a.idempotency_key is not None
        else get_field(spec, "idempotency_key", "spec", str, "")
    )
    builder.buffers(spec)
    tasks = builder.tasks(spec)
    response = c.submit_run(tasks, idempotency_key=key, label=label)
    run_id = response.run_id
    buffers = {name: bid for name, (bid, _, _) in builder.created.items()}
    if not (a.wait or a.watch):
        if out.json:
            out.data({"run_id": run_id, "deduplicated": response.deduplicated, "buffers": buffers})
        else:
            dedup = " (deduplicated: an earlier run with this key)" if response.deduplicated else ""
            out.line(f"run {run_id} submitted{dedup}")
            for name, bid in buffers.items():
                out.line(f"  buffer {name}: {bid}")
        return EXIT_OK
    if a.watch:
        code = _watch(c, run_id, out, a.timeout)
        status = c.wait_run(run_id, 0)
    else:
        status = c.wait_run(run_id, a.timeout)
        code = _status_exit(status)
    contents = {}
    if status.state == pb.RUN_STATE_COMPLETED:
        for name, (bid, shape, dtype) in builder.created.items():
            if math.prod(shape) <= _MAX_SHOWN:
                contents[name] = c.read_array(bid, shape, dtype).tolist()
    if out.json:
        if a.wait:
            out.data({**to_dict(status), "buffers": buffers, "contents": contents})
    else:
        if a.wait:
            print_status(out, status)
        for name, values in contents.items():
            out.line(f"  {name} (buffer {buffers[name]}): {values}")
    return code


def _watch(c: Client, run_id: int, out: Out, timeout: float | None = None) -> int:
    tty = not out.json and out.stream.isatty()
    last: pb.RunEvent | None = None
    for ev in c.watch(run_id):
        last = ev
        if out.json:
            print(json.dumps(to_dict(ev)), file=out.stream, flush=True)
        elif tty:
            print("\r\x1b[2K" + progress_line(ev), end="", file=out.stream, flush=True)
        else:
            out.line(event_line(ev))
        if ev.type == pb.RUN_EVENT_TYPE_RUN_STATE and ev.state in TERMINAL_STATES:
            break
    if tty:
        print(file=out.stream)
    if last is None or last.state not in TERMINAL_STATES:
        return EXIT_TIMEOUT
    if last.state != pb.RUN_STATE_COMPLETED and not out.json:
        status = c.wait_run(run_id, 0)
        if status.error.message:
            print(
                f"simplerctl: run {run_id} {state_name(last.state)}: {status.error.message}",
                file=sys.stderr,
            )
    return EXIT_OK if last.state == pb.RUN_STATE_COMPLETED else EXIT_FAILED


def cmd_watch(c: Client, a: argparse.Namespace, out: Out) -> int:
    return _watch(c, a.run, out)


def cmd_wait(c: Client, a: argparse.Namespace, out: Out) -> int:
    status = c.wait_run(a.run, a.timeout)
    print_status(out, status)
    if status.state not in TERMINAL_STATES and not out.json:
        out.line(f"  still {state_name(status.state)} after {a.timeout}s")
    return _status_exit(status)


def cmd_cancel(c: Client, a: argparse.Namespace, out: Out) -> int:
    response = c.cancel(a.run, a.reason)
    if out.json:
        out.data({"run_id": a.run, **to_dict(response)})
    elif response.already_finished:
        out.line(f"run {a.run} had already finished ({state_name(response.state)})")
    else:
        out.line(f"run {a.run} cancelled ({state_name(response.state)})")
    return EXIT_OK


def cmd_add_remote(c: Client, a: argparse.Namespace, out: Out) -> int:
    options: dict[str, Any] = {}
    if a.session_timeout is not None:
        options["session_timeout_s"] = a.session_timeout
    worker_id = c.add_remote_worker(a.endpoint, a.num_sub_workers, a.num_chips, **options)
    if out.json:
        out.data({"worker_id": worker_id})
    else:
        out.line(f"remote worker {worker_id} added: {a.endpoint}")
    return EXIT_OK


def cmd_drain(c: Client, a: argparse.Namespace, out: Out) -> int:
    response = c.drain(a.grace, a.shutdown)
    if out.json:
        out.data(to_dict(response))
    else:
        out.line(
            f"drained: {response.runs_finished} runs finished, {response.runs_cancelled} cancelled"
        )
    return EXIT_OK


# --------------------------------------------------------------------------- main


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive run id")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"simplerctl: error: {message}", file=sys.stderr)
        raise _Exit(EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="machine-readable JSON output",
    )
    ap = _Parser(prog="simplerctl", description="Client of simpler-daemon.", parents=[common])
    ap.add_argument("--version", action="version", version=f"simplerctl {__version__}")
    ap.add_argument(
        "--socket",
        metavar="PATH|HOST:PORT",
        help="daemon address (default: $SIMPLER_DAEMON_SOCKET or the default socket)",
    )
    ap.add_argument("--token-file", help="bearer token for a TCP daemon")
    ap.add_argument("--tls-ca", help="CA bundle that signed a TCP daemon's certificate")
    ap.add_argument("--tls-cert", help="client certificate (mutual TLS)")
    ap.add_argument("--tls-key", help="client key (mutual TLS)")
    ap.add_argument("--server-name", help="name to check the daemon's certificate against")
    ap.add_argument("--rpc-timeout", type=_seconds, default=30.0, help="per-call deadline (30 s)")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def add(name: str, fn: Callable[..., int], help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, parents=[common])
        p.set_defaults(fn=fn)
        return p

    add("info", cmd_info, "daemon version, level, heap, limits")
    add("workers", cmd_workers, "every worker and its state")
    add("callables", cmd_callables, "every registered callable")
    p = add("register", cmd_register, "register a callable by import path")
    p.add_argument("path", metavar="PATH", help="module:qualname")
    p.add_argument("--kind", choices=("sub", "chip", "orchestration"), default="sub")
    p = add("submit", cmd_submit, "submit a run spec (JSON or TOML)")
    p.add_argument("file", metavar="FILE", help="run spec; '-' reads JSON from stdin")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--wait", action="store_true", help="wait for the run and print its status")
    g.add_argument("--watch", action="store_true", help="show live progress until it ends")
    p.add_argument("--timeout", type=_seconds, help="seconds to wait (default: until it ends)")
    p.add_argument("--idempotency-key", help="resubmitting with the same key returns the same run")
    p.add_argument("--label", help="label shown in events and logs")
    p = add("watch", cmd_watch, "live progress of a run until it ends")
    p.add_argument("run", type=_positive_int, metavar="RUN")
    p = add("wait", cmd_wait, "wait for a run to end")
    p.add_argument("run", type=_positive_int, metavar="RUN")
    p.add_argument("--timeout", type=_seconds, help="seconds to wait (default: until it ends)")
    p = add("cancel", cmd_cancel, "cancel a run")
    p.add_argument("run", type=_positive_int, metavar="RUN")
    p.add_argument("--reason", default="", help="recorded in the run's error")
    add("buffers", cmd_buffers, "every live buffer")
    p = add("drain", cmd_drain, "stop admitting runs; optionally stop the daemon")
    p.add_argument("--grace", type=_seconds, help="seconds admitted runs get (default: config)")
    p.add_argument("--shutdown", action="store_true", help="stop the daemon afterwards")
    p = add("add-remote", cmd_add_remote, "open a session on a simpler-remote-worker (level 4)")
    p.add_argument("endpoint", metavar="IP:PORT", help="address of the simpler-remote-worker")
    p.add_argument("--num-sub-workers", type=int, default=0, help="SUB workers there (default 1)")
    p.add_argument("--num-chips", type=int, default=0, help="simulated chips there")
    p.add_argument("--session-timeout", type=_seconds, help="health silence allowed (30 s)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``simplerctl``; returns the exit status."""
    ap = _parser()
    try:
        args = ap.parse_args(argv)
    except _Exit as exc:
        return exc.code
    out = Out(getattr(args, "json", False))
    if not getattr(args, "command", None):
        ap.print_usage(sys.stderr)
        out.error("", "a command is required (see --help)")
        return EXIT_USAGE
    if args.socket is None and (args.token_file or args.tls_ca):
        out.error("", "--token-file/--tls-ca need --socket HOST:PORT")
        return EXIT_USAGE
    try:
        client = Client(
            args.socket,
            token_file=args.token_file,
            root_certificates=args.tls_ca,
            client_cert=args.tls_cert,
            client_key=args.tls_key,
            server_name=args.server_name,
            timeout=args.rpc_timeout or None,
        )
    except (OSError, ValueError) as exc:
        out.error("", f"cannot connect: {exc}")
        return EXIT_USAGE
    try:
        with client:
            return int(args.fn(client, args, out))
    except SpecError as exc:
        out.error("INVALID_SPEC", str(exc))
        return EXIT_USAGE
    except SpecRpcError as exc:
        return _rpc_failed(out, exc.rpc, client.target, where=exc.where)
    except grpc.RpcError as exc:
        return _rpc_failed(out, exc, client.target)
    except KeyboardInterrupt:
        out.error("", "interrupted")
        return 130


def _rpc_failed(out: Out, exc: grpc.RpcError, target: str, where: str = "") -> int:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not where:
        details = f"cannot reach the daemon at {target}: {details}"
    if where:
        details = f"{where}: {details}"
    out.error(code.name, details or code.name)
    return _STATUS_EXIT.get(code, EXIT_FAILED)


if __name__ == "__main__":
    sys.exit(main())
