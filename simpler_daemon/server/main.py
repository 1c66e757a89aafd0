"""``simpler-daemon``: the command line of the daemon.

::

    simpler-daemon serve [--config FILE] [--set section.key=value ...] [--reset-state]
    simpler-daemon check-config FILE
    simpler-daemon --version

Exit status: the table of ``system/exitcodes.py`` (0 clean stop, 2 configuration
error, 3 start-up failure, 130 after a second SIGINT, 131 after SIGQUIT).

``check-config`` loads and validates the file, then checks what ``serve`` meets only
on the host (server/preflight.py): heap sizes against /dev/shm and MemAvailable, the
start-up callables' imports (in a subprocess), the credential files.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Final

from simpler_daemon import __version__
from simpler_daemon.errors import ConfigError, StartupError
from simpler_daemon.system.configfile import add_set_option, overrides_from_set
from simpler_daemon.system.exitcodes import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_OK, EXIT_STARTUP

__all__ = ["main"]

log = logging.getLogger("simpler_daemon.main")

#: Set once logging is JSON: errors then go through it, so stderr stays JSON lines.
_json_errors = False


class _StopDuringStartup(KeyboardInterrupt):
    """SIGTERM / SIGQUIT before the event loop runs: unwind start-up (the Worker rolls
    its children and heap back on any BaseException), as Ctrl-C does."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_STARTUP_SIGNALS: Final = (
    signal.SIGTERM,
    signal.SIGQUIT,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def _startup_signal(signum: int, frame: FrameType | None) -> None:
    if signum in (signal.SIGTERM, signal.SIGQUIT):
        raise _StopDuringStartup(signum)
    log.info("%s received during start-up: ignored", signal.Signals(signum).name)


def _catch_startup_signals() -> None:
    """Until serve() takes over: no common signal may end the process without its
    cleanup (a default SIGHUP or SIGTERM would leave the heap in /dev/shm)."""
    for sig in _STARTUP_SIGNALS:
        signal.signal(sig, _startup_signal)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="simpler-daemon",
        description="Per-host task daemon: pre-forked worker pools behind a gRPC API.",
    )
    ap.add_argument("--version", action="version", version=f"simpler-daemon {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument(
        "--config", metavar="FILE", help="TOML configuration (default: the embedded default)"
    )
    add_set_option(serve, example="workers.num_sub_workers=4")
    serve.add_argument(
        "--reset-state",
        action="store_true",
        help="move a run history that cannot be opened (corrupt) aside and start an empty one",
    )
    check = sub.add_parser("check-config", help="validate a configuration file and exit")
    check.add_argument("file", metavar="FILE")
    return ap


def _err(text: str) -> None:
    if _json_errors:
        log.error("%s", text)
        return
    from simpler_daemon.system.logsetup import journal_stream

    # journald reads "<3>" as the line's priority (err); a terminal gets the bare text.
    prefix = "<3>" if journal_stream(sys.stderr) else ""
    print(f"{prefix}simpler-daemon: {text}", file=sys.stderr, flush=True)


def _check_config(path: str) -> int:
    from simpler_daemon.server.config import load
    from simpler_daemon.server.daemon import check_limits
    from simpler_daemon.server.preflight import config_warnings, preflight

    try:
        config = load(path)
        check_limits(config)
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_CONFIG
    for warning in config_warnings(config):
        print(f"simpler-daemon: {path}: warning: {warning}", file=sys.stderr, flush=True)
    problems = preflight(config)
    for problem in problems:
        _err(f"{path}: {problem}")
    if problems:
        return EXIT_CONFIG
    print(f"{path}: ok (level {config.daemon.level}, socket {config.grpc.unix_socket})")
    return EXIT_OK


def _serve(args: argparse.Namespace) -> int:
    global _json_errors
    from simpler_daemon.server.config import DaemonConfig, load
    from simpler_daemon.server.daemon import Daemon
    from simpler_daemon.system.logsetup import announcer, configure_logging
    from simpler_daemon.system.notify import SystemdNotifier

    def reload_config() -> DaemonConfig:
        # The same layers as at start: the file, the environment, the --set overrides.
        return load(args.config, overrides=overrides)

    _catch_startup_signals()
    try:
        overrides = overrides_from_set(args.set)
        config = load(args.config, overrides=overrides)
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_CONFIG
    configure_logging(config.daemon.log_format, config.daemon.log_level)
    _json_errors = config.daemon.log_format == "json"
    announcer(config.daemon.log_format)(
        f"simpler-daemon {__version__}: socket {config.grpc.unix_socket}"
    )
    from simpler_daemon.server.preflight import config_warnings

    for warning in config_warnings(config):
        log.warning("config: %s", warning)
    from simpler_daemon.children.process import set_title_prefix

    set_title_prefix("simpler-daemon")  # its children: "simpler-daemon: sub worker 0"
    # Children started later (there are none after the forks, but be safe) must not
    # speak for the daemon.
    notifier = SystemdNotifier.from_env(unset=True)
    announce = announcer(config.daemon.log_format, prefix="simpler-daemon")

    try:
        daemon = Daemon(
            config,
            notifier=notifier,
            announce=announce,
            reload_config=reload_config,
            reset_state=args.reset_state,
        )
        daemon.prepare()  # every fork happens here, before any thread exists
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_CONFIG
    except StartupError as exc:
        _err(str(exc))
        return EXIT_STARTUP
    except KeyboardInterrupt as exc:
        why = exc.args[0] if isinstance(exc, _StopDuringStartup) else "interrupted"
        _err(f"{why} during start-up: stopped")
        return EXIT_INTERRUPTED
    except Exception as exc:
        log.exception("start-up failed")
        _err(f"cannot start the daemon: {type(exc).__name__}: {exc}")
        return EXIT_STARTUP

    # Prepared: a signal now waits for serve(), which handles it once its loop runs.
    def defer(signum: int, frame: FrameType | None) -> None:
        daemon.pending_signals.append(signum)

    for sig in _STARTUP_SIGNALS:
        signal.signal(sig, defer)

    tune_gc()
    import uvloop

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(daemon.serve())
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_CONFIG
    except StartupError as exc:
        _err(str(exc))
        return EXIT_STARTUP
    finally:
        notifier.close()


#: The collector's thresholds in the daemon (Python's default: 700, 10, 10).
GC_THRESHOLDS: Final = (50_000, 20, 100)


def tune_gc() -> None:
    """Tune the cyclic collector for a long-lived daemon, once its children are forked.

    A run in flight holds ~5 objects per task: with the default thresholds a
    20,000-task run triggered ~34 collections, some full ones traversing every
    object. Measured (runs of 20,000 empty tasks submitted over gRPC, 26 runs / 120,020
    tasks, same session): the
    default ran 882 collections (7 full) for 0.91-1.83 s of collector time; freezing
    the start-up objects (imports, the Worker: ~35,000 never garbage) and these
    thresholds: 12 collections, none full, 0.14-0.20 s. What the daemon drops is freed
    by reference counting (a finished run breaks its cycles, ``Run.release``).
    """
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``simpler-daemon`` console script; returns the exit status."""
    ap = _parser()
    args = ap.parse_args(argv)
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command == "serve":
        return _serve(args)
    ap.print_usage(sys.stderr)
    _err("a command is required: serve or check-config")
    return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
