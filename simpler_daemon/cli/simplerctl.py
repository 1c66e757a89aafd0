"""``simplerctl``: the command-line client of simpler-daemon.

::

    simplerctl [--socket PATH|HOST:PORT] [--json] COMMAND ...
      info                      daemon version, level, heap (used/free), limits, state
      workers                   every worker and its state: local L3 workers with their
                                children indented, remote L3 sessions below
      callables                 every registered callable
      register PATH [--kind K] [--reload] [--timeout S]
                                register "module:qualname" until unregistered; --reload
                                re-imports edited code
      unregister HASHID|PATH    drop one reference to a registration
      submit FILE [--wait|--watch] [--timeout S] [--keep] [--cancel-on-interrupt]
             [--idempotency-key K] [--label L] [--priority P]
      watch RUN [--timeout S]   live progress until the run ends
      wait RUN [--timeout S]    wait for a run; its status and task results
      cancel RUN [--reason R] [--terminate]
      runs [--state S] [--limit N]
                                the runs you can see, newest first
      trace RUN -o FILE         the run's task attempts as a Chrome trace (Perfetto)
      buffers                   every live buffer and the heap
      free ID...                free buffers
      drain [--grace S] [--shutdown]
      resume                    undo a drain: admit runs again
      add-remote IP:PORT [--num-sub-workers N] [--num-chips N] [--session-timeout S]
             [--heap-bytes N] [--chip-pipeline-depth N] [--worker-token-file PATH]
             [--worker-tls-ca PATH] [--worker-tls-cert PATH] [--worker-tls-key PATH]
             [--worker-server-name NAME]
                                open a session on a simpler-remote-worker (level 4)
      completion bash|zsh       a shell completion script (needs the [completion] extra)

The run spec format is in :data:`simpler_daemon.cli.runspec.SPEC_FORMAT`
(``simplerctl submit --help``).

This module holds the argument parser, the error handling and the exit statuses
(:data:`EXIT_HELP`); the commands are in :mod:`simpler_daemon.cli.runs` and
:mod:`simpler_daemon.cli.admin`, specs in :mod:`simpler_daemon.cli.runspec`, every line
printed is formatted by :mod:`simpler_daemon.cli.output`. No user error ends in a
traceback: every exception a command can meet maps to a message and an exit status.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Final, NoReturn

# First: grpc core reads its process-wide settings at its import (system/grpcsetup.py).
import simpler_daemon.system.grpcsetup  # noqa: F401

# isort: split

import grpc

from simpler_daemon import __version__
from simpler_daemon.cli.admin import (
    cmd_add_remote,
    cmd_buffers,
    cmd_callables,
    cmd_discovery,
    cmd_drain,
    cmd_free,
    cmd_info,
    cmd_register,
    cmd_resume,
    cmd_unregister,
    cmd_workers,
)
from simpler_daemon.cli.output import (
    EXIT_EXHAUSTED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_PIPE,
    EXIT_REFUSED,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CliExit,
    Out,
    short_name,
)
from simpler_daemon.cli.runs import (
    RUN_STATES,
    cmd_cancel,
    cmd_runs,
    cmd_submit,
    cmd_trace,
    cmd_wait,
    cmd_watch,
)
from simpler_daemon.cli.runspec import SPEC_FORMAT, SpecError, SpecLimitError, SpecRpcError
from simpler_daemon.client import Client

__all__ = [
    "EXIT_EXHAUSTED",
    "EXIT_FAILED",
    "EXIT_HELP",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_PIPE",
    "EXIT_REFUSED",
    "EXIT_TIMEOUT",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "main",
    "parser",
]

EXIT_HELP: Final = f"""\
exit status:
  {EXIT_OK}    success (for a run: it completed)
  {EXIT_FAILED}    the run failed or was cancelled (or the daemon failed internally)
  {EXIT_USAGE}    usage error: a bad option, --socket or run spec, or a request the daemon
       refused as invalid or not permitted (INVALID_ARGUMENT, PERMISSION_DENIED,
       UNAUTHENTICATED)
  {EXIT_UNREACHABLE}    the daemon cannot be reached (UNAVAILABLE: nothing listens there, no fast
       socket for --transport fast, a socket path that cannot be trusted)
  {EXIT_NOT_FOUND}    no such run, buffer, callable or worker (NOT_FOUND)
  {EXIT_TIMEOUT}    --timeout passed while the run is still going (it keeps running), or the
       daemon did not answer a call in time (DEADLINE_EXCEEDED: --rpc-timeout,
       `register --timeout`)
  {EXIT_EXHAUSTED}    the daemon is out of room (RESOURCE_EXHAUSTED: heap full, a quota or a
       limit reached): free buffers (`simplerctl free`), let runs finish, retry
  {EXIT_REFUSED}    refused in the daemon's current state (FAILED_PRECONDITION: draining,
       stopping, another level; an idempotency key naming another request)
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
  {EXIT_PIPE}  stdout was closed early (e.g. `| head`)
"""

_STATUS_EXIT: Final[dict[grpc.StatusCode, int]] = {
    grpc.StatusCode.NOT_FOUND: EXIT_NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE: EXIT_UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: EXIT_TIMEOUT,
    grpc.StatusCode.INVALID_ARGUMENT: EXIT_USAGE,
    grpc.StatusCode.PERMISSION_DENIED: EXIT_USAGE,
    grpc.StatusCode.UNAUTHENTICATED: EXIT_USAGE,
    grpc.StatusCode.OUT_OF_RANGE: EXIT_USAGE,
    grpc.StatusCode.UNIMPLEMENTED: EXIT_USAGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: EXIT_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION: EXIT_REFUSED,
    grpc.StatusCode.ALREADY_EXISTS: EXIT_REFUSED,
    grpc.StatusCode.ABORTED: EXIT_REFUSED,
}

#: Default deadline of ``register``: the daemon imports the module in every worker (and
#: ``--reload`` waits for their running tasks), which can take far longer than a plain call.
REGISTER_TIMEOUT: Final = 300.0

#: Largest id the daemon's uint64 fields take.
_U64_MAX: Final = (1 << 64) - 1


# --------------------------------------------------------------------------- argument types


def _object_id(what: str) -> Callable[[str], int]:
    """An argparse type for the daemon's ids of ``what`` (runs, buffers): 1 .. 2**64-1."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {what} id (an integer)") from None
        if not 1 <= value <= _U64_MAX:
            raise argparse.ArgumentTypeError(f"{value} is not a {what} id (1 .. 2**64-1)")
        return value

    return parse


_run_id = _object_id("run")
_buffer_id = _object_id("buffer")


def _run_state(text: str) -> str:
    """``FAILED``, ``failed`` or ``RUN_STATE_FAILED`` -> ``failed`` (the choices' spelling)."""
    return short_name(text.strip().upper()).lower()


def _bounded(low: int, high: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value}: {what} must be in {low}..{high}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    # A year bounds every deadline: gRPC and the daemon refuse larger ones.
    if not math.isfinite(value) or not 0 <= value <= 366 * 86400:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be in 0..31622400")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"simplerctl: error: {message}", file=sys.stderr)
        raise CliExit(EXIT_USAGE)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            print(message, file=sys.stderr, end="")
        raise CliExit(status)


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``simplerctl`` (also the source of its shell completion)."""
    common = _Parser(add_help=False)
    common.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="machine-readable JSON output",
    )
    raw = argparse.RawDescriptionHelpFormatter
    ap = _Parser(
        prog="simplerctl",
        description="Client of simpler-daemon.",
        epilog=EXIT_HELP,
        formatter_class=raw,
        parents=[common],
    )
    ap.add_argument("--version", action="version", version=f"simplerctl {__version__}")
    ap.add_argument(
        "--socket",
        metavar="PATH|HOST:PORT",
        help="daemon address (default: $SIMPLER_DAEMON_SOCKET, else the first existing "
        "socket of the search order in docs/operations.md)",
    )
    ap.add_argument("--token-file", help="bearer token for a TCP daemon")
    ap.add_argument("--tls-ca", help="CA bundle that signed a TCP daemon's certificate")
    ap.add_argument("--tls-cert", help="client certificate (mutual TLS)")
    ap.add_argument("--tls-key", help="client key (mutual TLS)")
    ap.add_argument("--server-name", help="name to check the daemon's certificate against")
    ap.add_argument("--rpc-timeout", type=_seconds, default=30.0, help="per-call deadline (30 s)")
    ap.add_argument(
        "--transport",
        choices=("auto", "fast", "grpc"),
        default="auto",
        help="auto: the daemon's local fast path when its socket exists, else gRPC "
        "(default; $SIMPLER_DAEMON_TRANSPORT overrides auto)",
    )
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def add(
        name: str, fn: Callable[..., int], help_text: str, **kw: object
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, parents=[common], **kw)  # type: ignore[arg-type]
        p.set_defaults(fn=fn)
        return p

    add("info", cmd_info, "daemon version, level, heap, limits")
    add("workers", cmd_workers, "every worker and its state")
    add("discovery", cmd_discovery, "remote workers found by DNS: the last resolution")
    add("callables", cmd_callables, "every registered callable")
    p = add("register", cmd_register, "register a callable by import path")
    p.add_argument("path", metavar="PATH", help="module:qualname")
    p.add_argument("--kind", choices=("sub", "chip", "orchestration"), default="sub")
    p.add_argument(
        "--reload",
        action="store_true",
        help="re-import the module in every worker (after editing its code)",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        help=f"seconds the daemon may take to import the module in every worker "
        f"(default {REGISTER_TIMEOUT:g}, or --rpc-timeout when longer)",
    )
    p = add("unregister", cmd_unregister, "drop one reference to a registered callable")
    p.add_argument("target", metavar="HASHID|PATH", help="a hashid or a registered import path")
    p = add(
        "submit",
        cmd_submit,
        "submit a run spec (JSON or TOML)",
        description="Submit a run described by a run spec file.",
        epilog=SPEC_FORMAT + "\n" + EXIT_HELP,
        formatter_class=raw,
    )
    p.add_argument("file", metavar="FILE", help="run spec; '-' reads JSON from stdin")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--wait", action="store_true", help="wait for the run and print its status")
    g.add_argument("--watch", action="store_true", help="show live progress until it ends")
    p.add_argument("--timeout", type=_seconds, help="seconds to wait (default: until it ends)")
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the spec's buffers after printing them (default: freed)",
    )
    p.add_argument(
        "--cancel-on-interrupt",
        action="store_true",
        help="Ctrl-C cancels the run (default: ask on a terminal, else leave it running)",
    )
    p.add_argument("--idempotency-key", help="resubmitting with the same key returns the same run")
    p.add_argument("--label", help="label shown in events, logs and `simplerctl runs`")
    p.add_argument(
        "--priority", type=_bounded(1, 1000, "priority"), help="share under fair admission"
    )
    p = add("watch", cmd_watch, "live progress of a run until it ends")
    p.add_argument("run", type=_run_id, metavar="RUN")
    p.add_argument("--timeout", type=_seconds, help="seconds to watch (default: until it ends)")
    p = add("wait", cmd_wait, "wait for a run to end")
    p.add_argument("run", type=_run_id, metavar="RUN")
    p.add_argument("--timeout", type=_seconds, help="seconds to wait (default: until it ends)")
    p = add("cancel", cmd_cancel, "cancel a run")
    p.add_argument("run", type=_run_id, metavar="RUN")
    p.add_argument("--reason", default="", help="recorded in the run's error")
    p.add_argument(
        "--terminate",
        action="store_true",
        help="also stop its running tasks (their workers are killed and replaced)",
    )
    p = add("trace", cmd_trace, "write a run's task attempts as a Chrome trace")
    p.add_argument("run", type=_run_id, metavar="RUN")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        help="the JSON file to write (- for standard output); open it in Perfetto",
    )
    p = add("runs", cmd_runs, "list runs, newest first")
    p.add_argument(
        "--state",
        action="append",
        type=_run_state,
        choices=sorted(RUN_STATES),
        help="only runs in this state, any case (repeatable)",
    )
    p.add_argument(
        "--limit", type=_bounded(1, 100000, "limit"), default=50, help="at most N runs (50)"
    )
    add("buffers", cmd_buffers, "every live buffer")
    p = add("free", cmd_free, "free buffers")
    p.add_argument("buffers", type=_buffer_id, nargs="+", metavar="ID")
    p = add("drain", cmd_drain, "stop admitting runs; optionally stop the daemon")
    p.add_argument("--grace", type=_seconds, help="seconds admitted runs get (default: config)")
    p.add_argument("--shutdown", action="store_true", help="stop the daemon afterwards")
    add("resume", cmd_resume, "undo a drain: admit runs again")
    p = add("add-remote", cmd_add_remote, "open a session on a simpler-remote-worker (level 4)")
    p.add_argument("endpoint", metavar="IP:PORT", help="address of the simpler-remote-worker")
    p.add_argument(
        "--num-sub-workers",
        type=_bounded(0, 1024, "--num-sub-workers"),
        default=0,
        help="SUB workers there (default 1)",
    )
    p.add_argument(
        "--num-chips", type=_bounded(0, 1024, "--num-chips"), default=0, help="simulated chips"
    )
    p.add_argument("--session-timeout", type=_seconds, help="health silence allowed (30 s)")
    p.add_argument(
        "--heap-bytes", type=_bounded(0, 1 << 62, "--heap-bytes"), help="its heap size (bytes)"
    )
    p.add_argument(
        "--chip-pipeline-depth",
        type=_bounded(0, 1024, "--chip-pipeline-depth"),
        help="chip tasks in flight per chip there",
    )
    # The remote worker's credentials, read by the daemon (paths made absolute here).
    p.add_argument("--worker-token-file", metavar="PATH", help="its auth.token_file")
    p.add_argument("--worker-tls-ca", metavar="PATH", help="CA bundle to verify it (TLS)")
    p.add_argument("--worker-tls-cert", metavar="PATH", help="client certificate (mutual TLS)")
    p.add_argument("--worker-tls-key", metavar="PATH", help="key of --worker-tls-cert")
    p.add_argument("--worker-server-name", metavar="NAME", help="name its certificate carries")
    p = add("completion", _completion, "print a shell completion script")
    p.add_argument("shell", choices=("bash", "zsh", "tcsh"))
    return ap


def _completion(c: Client | None, a: argparse.Namespace, out: Out) -> int:
    """The completion script shtab generates from :func:`parser` (no daemon needed)."""
    try:
        import shtab
    except ImportError:
        out.error(
            "",
            "cannot generate a completion script: shtab is not installed "
            "(pip install 'simpler-daemon[completion]')",
        )
        return EXIT_USAGE
    out.stream.write(shtab.complete(parser(), shell=a.shell))
    return EXIT_OK


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``simplerctl``; returns the exit status."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (`simplerctl runs | head`): no traceback, and nothing more
        # written to the closed pipe when Python flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_PIPE


def _main(argv: Sequence[str] | None) -> int:
    ap = parser()
    try:
        args = ap.parse_args(argv)
    except CliExit as exc:
        return exc.code
    out = Out(getattr(args, "json", False))
    if not getattr(args, "command", None):
        ap.print_usage(sys.stderr)
        out.error("", "a command is required (see --help)")
        return EXIT_USAGE
    if args.command == "completion":  # needs no daemon
        return _completion(None, args, out)
    if args.socket is None and (args.token_file or args.tls_ca):
        out.error("", "--token-file/--tls-ca need --socket HOST:PORT")
        return EXIT_USAGE
    timeout: float = args.rpc_timeout
    if args.command == "register":
        timeout = args.timeout if args.timeout is not None else max(timeout, REGISTER_TIMEOUT)
    try:
        client = Client(
            args.socket,
            token_file=args.token_file,
            root_certificates=args.tls_ca,
            client_cert=args.tls_cert,
            client_key=args.tls_key,
            server_name=args.server_name,
            timeout=timeout or None,
            transport=args.transport,
            # A command answers at once: an unreachable daemon or a full run queue is
            # the exit code's to tell (a script retries), not a 30 s wait.
            retry=None,
        )
    except grpc.RpcError as exc:  # a DaemonError: Unavailable (no fast socket there), ...
        return _rpc_failed(out, exc, args.socket or "the default socket", what=args.command)
    except OSError as exc:  # no socket, or one whose path cannot be trusted
        out.error("UNAVAILABLE", f"cannot connect: {exc}")
        return EXIT_UNREACHABLE
    except ValueError as exc:  # a target that is neither a socket path nor HOST:PORT
        out.error("INVALID_ARGUMENT", f"cannot connect: {exc}")
        return EXIT_USAGE
    try:
        with client:
            code: int = args.fn(client, args, out)
            return code
    except CliExit as exc:
        return exc.code
    except SpecLimitError as exc:
        out.error("RESOURCE_EXHAUSTED", str(exc))
        return EXIT_EXHAUSTED
    except SpecError as exc:
        out.error("INVALID_SPEC", str(exc))
        return EXIT_USAGE
    except SpecRpcError as exc:
        return _rpc_failed(out, exc.rpc, client.target, where=exc.where, timeout=timeout)
    except grpc.RpcError as exc:
        return _rpc_failed(out, exc, client.target, what=args.command, timeout=timeout)
    except KeyboardInterrupt:
        out.error("", "interrupted")
        return EXIT_INTERRUPTED
    except (ValueError, OverflowError, TypeError) as exc:
        # A value the client library refuses before sending (e.g. out of a field's range).
        out.error("", f"cannot {args.command}: {exc}")
        return EXIT_USAGE


def _rpc_failed(
    out: Out,
    exc: grpc.RpcError,
    target: str,
    where: str = "",
    *,
    what: str = "",
    timeout: float = 0.0,
) -> int:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        # The daemon was reached (or is busy): a slow answer, not an unreachable daemon.
        # A register imports the module in every worker, hence its own --timeout.
        request = f"`simplerctl {what}`" if what else "the request"
        within = f" within {timeout:g} s" if timeout else " in time"
        option = "`register --timeout S`" if what == "register" else "--rpc-timeout S"
        details = (
            f"the daemon at {target} did not answer {request}{within} "
            f"(it may still be working on it; {option} allows longer): {details}"
        )
    elif code == grpc.StatusCode.UNAVAILABLE and not where:
        details = f"cannot reach the daemon at {target}: {details}"
    if where:
        details = f"{where}: {details}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        details += exhausted_hint(details)
    out.error(code.name, details or code.name)
    return _STATUS_EXIT.get(code, EXIT_FAILED)


#: What to do about a RESOURCE_EXHAUSTED, by the limit its text names (first match).
_EXHAUSTED_HINTS: Final = (
    (
        ("per_client_queued_runs", "per_client_runs", "max_concurrent_runs"),
        "runs wait for a slot: `simplerctl runs --state queued` lists the queued ones; "
        "retry once some have finished",
    ),
    (
        ("per_client_heap_bytes", "heap", "max_buffer_bytes"),
        "`simplerctl buffers` lists what holds the heap, `simplerctl free` frees",
    ),
    (
        ("per_client_registrations", "slot"),
        "`simplerctl callables` lists the registrations, `simplerctl unregister` drops one",
    ),
    (("max_streams_per_client",), "end other watch or read streams of this client first"),
    (
        ("max_message_bytes", "include_results", "max_run_result_bytes"),
        "the request or its answer is larger than the limit named",
    ),
)


def exhausted_hint(details: str) -> str:
    """The advice for a RESOURCE_EXHAUSTED refusal, picked by the limit it names."""
    for needles, hint in _EXHAUSTED_HINTS:
        if any(needle in details for needle in needles):
            return f" ({hint})"
    return " (a daemon limit was reached: its text names it; see docs/operations.md)"


if __name__ == "__main__":
    sys.exit(main())
