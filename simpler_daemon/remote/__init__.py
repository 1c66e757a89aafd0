"""The level-4 <-> level-3 protocol both sides share.

``spec.py`` the plain values an L4 program names (``RemoteWorkerSpec``,
``RemoteCallable``, ``RemoteTensorRef``); ``wire.py`` the frame codec (sans-IO);
``manifest.py`` the session manifest and the handshake helpers; ``attach.py`` the
parent's side of opening a session. The parent's endpoint is
``endpoints/remote.py``; the far side is ``simpler_daemon.remote_worker``.
"""
