"""The exit statuses of both programs (``simpler-daemon``, ``simpler-remote-worker``).

systemd reads them: the shipped units set ``RestartPreventExitStatus=3``, so a
program that cannot start (a bad host, a missing credential) does not loop, while a
crash or a watchdog kill is restarted. ``simplerctl`` has its own table
(``cli/output.py``): its codes say what happened to a request, not to a process.

    0    clean stop
    2    configuration error (the file, an override, a credential's mode)
    3    start-up failure (the config was valid, the host could not serve it)
    130  a second SIGINT: exit at once
    131  SIGQUIT: exit at once, children killed, heap and sockets removed
"""

from __future__ import annotations

import signal
from typing import Final

__all__ = ["EXIT_CONFIG", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_QUIT", "EXIT_STARTUP"]

EXIT_OK: Final = 0
EXIT_CONFIG: Final = 2
EXIT_STARTUP: Final = 3
EXIT_INTERRUPTED: Final = 128 + signal.SIGINT
EXIT_QUIT: Final = 128 + signal.SIGQUIT
