"""The daemon's Unix sockets: where they live, claiming their paths at start, binding
them in a private staging directory and publishing them into place.

::

    prepare_socket_paths()  runtime and socket directories private (0750, ours), stale
                            staging directories and stale sockets removed, a live one
                            refused
    bind_private_socket()   the gRPC server's own socket (0600), behind the relay
    publish_relay()         the public socket (grpc.socket_mode, grpc.socket_group)
    publish_fast()          the fast path's socket, the same mode and group

A socket gets its mode and group before it appears at its path: a chmod after bind
would follow a symlink swapped in for the socket. The daemon (server/daemon.py) decides
when each happens and removes the sockets when it stops.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import stat
from typing import TYPE_CHECKING, Any

from simpler_daemon.errors import StartupError, UntrustedPathError
from simpler_daemon.server.config import DaemonConfig
from simpler_daemon.system.localtrust import (
    ensure_private_dir,
    publish_socket,
    staged_socket_path,
    sweep_staging_dirs,
)

if TYPE_CHECKING:  # the daemon imports these only when it serves (fastpath loads grpc)
    from simpler_daemon.server.fastpath import FastServer
    from simpler_daemon.server.peers import UnixRelay

__all__ = [
    "bind_private_socket",
    "claim_socket_path",
    "prepare_socket_paths",
    "private_socket_of",
    "publish_fast",
    "publish_relay",
    "remove_stale_socket",
]

# The daemon's logger: these lines are part of its start-up story.
log = logging.getLogger("simpler_daemon.daemon")


def private_socket_of(config: DaemonConfig) -> str:
    """Where the gRPC server itself listens (mode 0600): clients reach it through the
    public socket's relay, which records their peer credentials (see peers.py)."""
    digest = hashlib.sha256(os.fsencode(config.grpc.unix_socket)).hexdigest()[:16]
    return os.path.join(config.daemon.runtime_dir, f"private-{digest}.sock")


def prepare_socket_paths(cfg: DaemonConfig, path: str, private_path: str, fast_path: str) -> None:
    """Verify (or create) the runtime and socket directories, remove a stale socket.

    A directory someone else owns or can write, or a symlink, is refused: whoever
    controls it would receive the daemon's socket and its clients' connections.
    ``path`` is the public socket, ``private_path`` the gRPC server's, ``fast_path`` the
    fast path's ("" = none)."""
    socket_dir = os.path.dirname(os.path.abspath(path))
    runtime_dir = os.path.abspath(cfg.daemon.runtime_dir)
    directories = {runtime_dir: "runtime directory"}
    directories.setdefault(socket_dir, "socket directory")
    for directory, what in directories.items():
        try:
            ensure_private_dir(directory, 0o750, what=what)
        except UntrustedPathError as exc:
            raise StartupError(str(exc)) from exc
        except OSError as exc:
            raise StartupError(
                f"cannot create the {what} {directory}: {exc.strerror or exc}"
            ) from exc
        for stale in sweep_staging_dirs(directory):
            log.info("removed a staging directory a killed daemon left: %s", stale)
    if len(os.fsencode(private_path)) > 107:
        raise StartupError(
            f"cannot bind {private_path}: the path is too long for a Unix "
            "socket (choose a shorter daemon.runtime_dir)"
        )
    claim_socket_path(path)
    if fast_path:
        claim_socket_path(fast_path)
    elif cfg.fast.unix_socket:
        # Fast path off: auto clients probe the fast socket, but a stale one would
        # still cost each of them a probe; clear it (never a live one).
        remove_stale_socket(cfg.fast.unix_socket)


def remove_stale_socket(path: str) -> None:
    """Remove ``path`` if it is a socket nobody serves on (a fast socket a daemon with
    the fast path left behind, now ``[fast] enabled = false``); a live socket or
    anything else is left alone."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        log.info("removing stale socket %s", path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    finally:
        probe.close()


def claim_socket_path(path: str) -> None:
    """Remove a stale socket at ``path``; ``StartupError`` when something else is
    there or another process serves on it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"cannot bind {path}: it exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        log.info("removing stale socket %s", path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    finally:
        probe.close()
    raise StartupError(f"cannot bind {path}: another process is serving on it")


def bind_private_socket(server: Any, private: str) -> None:
    """Bind the gRPC ``server`` (not yet started) on the Unix socket ``private``."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(private)  # stale: the public socket was checked in prepare()
    # Bound in a private directory and renamed into place already 0600: only the
    # daemon's user may connect, ever, and a path swapped meanwhile is never followed.
    try:
        with staged_socket_path(private) as staged:
            server.add_insecure_port(f"unix:{staged}")
            publish_socket(staged, private, 0o600, None)
    except (RuntimeError, OSError) as exc:
        raise StartupError(f"cannot bind the Unix socket {private}: {exc}") from exc


async def publish_relay(relay: UnixRelay, path: str, mode: int, gid: int | None) -> None:
    """Start the Unix ``relay`` (server/peers.py) on the public socket ``path``."""
    # The public socket gets its mode and group before it appears at ``path`` (a chmod
    # after bind would follow a symlink swapped in for the socket).
    try:
        with staged_socket_path(path) as staged:
            relay.public_path = staged
            await relay.start()
            publish_socket(staged, path, mode, gid)
    except OSError as exc:
        raise StartupError(str(exc)) from exc
    finally:
        relay.public_path = path


async def publish_fast(fast: FastServer, path: str, mode: int, gid: int | None) -> None:
    """Start the fast path's ``FastServer`` (server/fastpath.py) on ``path``, with the
    gRPC socket's mode and group, published the same way (bound staged, renamed into
    place)."""
    try:
        with staged_socket_path(path) as staged:
            fast.path = staged
            await fast.start()
            publish_socket(staged, path, mode, gid)
    except OSError as exc:
        raise StartupError(str(exc)) from exc
    finally:
        fast.path = path
