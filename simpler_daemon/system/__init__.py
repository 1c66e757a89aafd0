"""Operating-system plumbing both programs share (``simpler-daemon`` and
``simpler-remote-worker``).

``configfile.py`` loads a TOML config (file, environment, ``--set``); ``logsetup.py``
configures logging from a format and a level; ``notify.py`` speaks sd_notify;
``exitcodes.py`` is the exit-code table; ``runtimedir.py`` says where the sockets
live; ``localtrust.py`` which local paths can be trusted (the private runtime
directory, staged sockets, heap files); ``authguard.py`` token and key files and
the failed-authentication limit.
"""
