"""The daemon process: gRPC service, configuration, systemd notify, metrics.

Only ``daemon.py`` composes these pieces; each module here receives what it
needs in its constructor and never imports the daemon.
"""
