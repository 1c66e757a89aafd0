"""Where a client finds the daemon's socket when it is not told.

Search order (the first that exists wins)::

    $SIMPLER_DAEMON_SOCKET                               set: used as given, never searched
    $XDG_RUNTIME_DIR/simpler-daemon/daemon.sock          a daemon run by this user (login session)
    /run/user/<uid>/simpler-daemon/daemon.sock           the same without XDG_RUNTIME_DIR (cron, ssh -T)
    /run/simpler-daemon/daemon.sock                      the systemd unit (deploy/)
    /tmp/simpler-daemon-<uid>/daemon.sock                a daemon run by this user without /run/user

When none exists, the answer is the socket a daemon started by this user with the
default configuration would create (``system.runtimedir.default_runtime_dir``), so the
error names the path a user expects. A candidate whose directory this user may not
enter (``/run/simpler-daemon`` is 0750, group ``simpler``) counts as existing: the
connection then fails with "Permission denied" on that path, which says what is
wrong (not in the group), where a fall-through would say "No such file".

Existence is all that is checked here; whether a socket can be trusted is decided
when the client connects (``localtrust.check_socket_path``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

from simpler_daemon.system.runtimedir import SOCKET_NAME, default_runtime_dir

__all__ = [
    "ENV_SOCKET",
    "SYSTEM_RUNTIME_DIR",
    "candidates",
    "default_target",
]

#: The variable that names the daemon's address (a path, ``unix:`` URI or host:port).
ENV_SOCKET: Final = "SIMPLER_DAEMON_SOCKET"
#: The systemd unit's ``RuntimeDirectory=`` (and the tmpfiles.d entry).
SYSTEM_RUNTIME_DIR = "/run/simpler-daemon"


def candidates(env: Mapping[str, str] | None = None, uid: int | None = None) -> list[str]:
    """The socket paths searched, in order (without ``$SIMPLER_DAEMON_SOCKET``)."""
    env = os.environ if env is None else env
    uid = os.geteuid() if uid is None else uid
    out: list[str] = []
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg):
        out.append(os.path.join(xdg, "simpler-daemon", SOCKET_NAME))
    out += [
        f"/run/user/{uid}/simpler-daemon/{SOCKET_NAME}",
        os.path.join(SYSTEM_RUNTIME_DIR, SOCKET_NAME),
        f"/tmp/simpler-daemon-{uid}/{SOCKET_NAME}",
    ]
    return list(dict.fromkeys(out))  # XDG_RUNTIME_DIR is usually /run/user/<uid>


def _present(path: str) -> bool:
    try:
        os.stat(path)
    except PermissionError:
        return True  # there, but not for us: let the connect say so
    except OSError:
        return False
    return True


def default_target(env: Mapping[str, str] | None = None) -> str:
    """``$SIMPLER_DAEMON_SOCKET``, else the first candidate socket that exists, else
    the socket of the default configuration."""
    env = os.environ if env is None else env
    given = env.get(ENV_SOCKET)
    if given:
        return given
    for path in candidates(env):
        if _present(path):
            return path
    return os.path.join(default_runtime_dir(env), SOCKET_NAME)
