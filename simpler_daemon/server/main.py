"""``simpler-daemon``: the command line of the daemon.

::

    simpler-daemon serve [--config FILE] [--set section.key=value ...]
    simpler-daemon check-config FILE
    simpler-daemon --version

Exit status: 0 clean stop, 2 configuration error, 3 start-up failure (systemd's
``RestartPreventExitStatus=3`` keeps a daemon that cannot start from looping),
130 after a second SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Final

from simpler_daemon import __version__
from simpler_daemon.configfile import add_set_option, overrides_from_set
from simpler_daemon.errors import ConfigError, StartupError

__all__ = ["EXIT_CONFIG", "EXIT_OK", "EXIT_STARTUP", "main"]

EXIT_OK: Final = 0
EXIT_CONFIG: Final = 2
EXIT_STARTUP: Final = 3
EXIT_INTERRUPTED: Final = 130

log = logging.getLogger("simpler_daemon.main")


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
    check = sub.add_parser("check-config", help="validate a configuration file and exit")
    check.add_argument("file", metavar="FILE")
    return ap


def _err(text: str) -> None:
    print(f"simpler-daemon: {text}", file=sys.stderr, flush=True)


def _check_config(path: str) -> int:
    from simpler_daemon.server.config import load
    from simpler_daemon.server.daemon import check_limits

    try:
        config = load(path)
        check_limits(config)
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_CONFIG
    print(f"{path}: ok (level {config.daemon.level}, socket {config.grpc.unix_socket})")
    return EXIT_OK


def _serve(args: argparse.Namespace) -> int:
    from simpler_daemon.server.config import load
    from simpler_daemon.server.daemon import Daemon, configure_logging
    from simpler_daemon.server.notify import SystemdNotifier

    try:
        config = load(args.config, overrides=overrides_from_set(args.set))
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_CONFIG
    configure_logging(config.daemon)
    print(f"simpler-daemon {__version__}: socket {config.grpc.unix_socket}", flush=True)
    # Children started later (there are none after the forks, but be safe) must not
    # speak for the daemon.
    notifier = SystemdNotifier.from_env(unset=True)

    def announce(line: str) -> None:
        print(f"simpler-daemon: {line}", flush=True)

    try:
        daemon = Daemon(config, notifier=notifier, announce=announce)
        daemon.prepare()  # every fork happens here, before any thread exists
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_CONFIG
    except StartupError as exc:
        _err(str(exc))
        return EXIT_STARTUP
    except KeyboardInterrupt:
        _err("interrupted during start-up")
        return EXIT_INTERRUPTED
    except Exception as exc:
        log.exception("start-up failed")
        _err(f"cannot start the daemon: {type(exc).__name__}: {exc}")
        return EXIT_STARTUP

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
