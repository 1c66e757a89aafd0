"""Where a daemon keeps its sockets: the default runtime directory and socket names.

The daemon creates these paths and a client searches for them
(``client/discovery.py``), so both take them from here::

    daemon.runtime_dir = ""      ->  default_runtime_dir()
    grpc.unix_socket = ""        ->  <runtime_dir>/daemon.sock
    fast.unix_socket = ""        ->  <runtime_dir>/daemon.fast.sock  (fast_socket_path)

and its run history (which, unlike the sockets, must survive a reboot)::

    daemon.state_dir = ""        ->  default_state_dir()
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import Final

__all__ = [
    "FAST_SUFFIX",
    "MEMORY_STATE",
    "SOCKET_NAME",
    "default_runtime_dir",
    "default_state_dir",
    "fast_socket_path",
]

#: The gRPC socket's file name in the runtime directory.
SOCKET_NAME: Final = "daemon.sock"
#: The fast path's socket sits beside the gRPC one: ``daemon.sock`` -> ``daemon.fast.sock``.
FAST_SUFFIX: Final = ".fast.sock"
#: ``daemon.state_dir`` that keeps no run history (ids still never repeat in one process).
MEMORY_STATE: Final = ":memory:"


def default_runtime_dir(env: Mapping[str, str] | None = None) -> str:
    """Where the daemon keeps its sockets when ``daemon.runtime_dir`` is not set.

    ``$XDG_RUNTIME_DIR/simpler-daemon`` when that is set; else
    ``/run/user/<uid>/simpler-daemon`` when ``/run/user/<uid>`` is a real directory of
    this user that nobody else can write; else, for root, ``/run/simpler-daemon``; else
    ``/tmp/simpler-daemon-<uid>``. A fixed name (not a random one) so that clients find
    the socket; the daemon creates it exclusively and refuses an existing one that is
    not its own private directory (another user may have planted it in ``/tmp``).
    """
    env = os.environ if env is None else env
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "simpler-daemon")
    uid = os.geteuid()
    for base in (f"/run/user/{uid}", "/run") if uid == 0 else (f"/run/user/{uid}",):
        try:
            st = os.lstat(base)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022:
            return os.path.join(base, "simpler-daemon")
    return f"/tmp/simpler-daemon-{uid}"


def fast_socket_path(grpc_socket: str) -> str:
    """The local fast path's socket of the daemon serving gRPC at ``grpc_socket`` (a
    path): the same directory, the stem plus ``.fast.sock`` (``fast.unix_socket = ""``)."""
    directory, name = os.path.split(grpc_socket)
    stem = name[: -len(".sock")] if name.endswith(".sock") else name
    return os.path.join(directory, stem + FAST_SUFFIX)


def default_state_dir(env: Mapping[str, str] | None = None) -> str:
    """Where the daemon keeps its run history when ``daemon.state_dir`` is not set.

    ``$STATE_DIRECTORY`` under systemd (``StateDirectory=``; the first of a
    colon-separated list); else ``$XDG_STATE_HOME/simpler-daemon``; else
    ``~/.local/state/simpler-daemon``.
    """
    env = os.environ if env is None else env
    systemd = env.get("STATE_DIRECTORY", "").split(":")[0]
    if systemd and os.path.isabs(systemd):
        return systemd
    xdg = env.get("XDG_STATE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "simpler-daemon")
    home = env.get("HOME", "") or os.path.expanduser("~")
    return os.path.join(home, ".local", "state", "simpler-daemon")
