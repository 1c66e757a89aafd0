"""Program 2, ``simpler-remote-worker``, and its session runner.

``service.py`` is the program: the listener, the handshake, one runner process per
session; ``config.py`` its configuration and credentials; ``launch.py`` a runner's
spec file and environment. ``session.py`` is the runner
(``simpler-remote-l3-session``): the inner L3 Worker of one session, ``lanes.py``
its command protocol and health thread, ``controls.py`` its CONTROL handlers.
The protocol both ends speak is in ``simpler_daemon.remote``.
"""
