"""``simplerctl``, the command-line client of the daemon.

``simplerctl.py`` is the parser and ``main``; ``runs.py`` the run commands,
``admin.py`` the daemon, callable and buffer commands, ``runspec.py`` the run specs
``submit`` reads, ``output.py`` tables, JSON and exit codes.
"""

from simpler_daemon.cli.simplerctl import main

__all__ = ["main"]
