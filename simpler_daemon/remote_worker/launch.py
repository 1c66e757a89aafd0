"""How the remote worker hands a session to its runner: the spec file and the environment.

The runner (``simpler-remote-l3-session``) is exec'd with the path of a JSON spec
file: the validated manifest, where to listen, the absolute deadline of its
bring-up, the allow-list and the TLS files. The file holds the session's attach key,
so it is created 0600 and removed by the worker on every path.
"""

from __future__ import annotations

import ipaddress
import os
import tempfile
from typing import Any

import msgspec

from simpler_daemon.remote.manifest import Manifest, RunnerSpec, RunnerTLS
from simpler_daemon.remote_worker.config import RemoteWorkerConfig

__all__ = ["runner_env", "same_host", "write_runner_spec"]


def same_host(peer: Any, local: Any) -> bool:
    """True when a connection with these ``peername`` / ``sockname`` comes from this
    host: a loopback peer, or a peer with the connection's own local address (both ends
    then share this host's CPUs). False when either is unknown."""
    if not peer or not local:
        return False
    try:
        address = ipaddress.ip_address(peer[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or peer[0] == local[0]


def write_runner_spec(
    config: RemoteWorkerConfig, m: Manifest, deadline_unix: float, *, parent_on_this_host: bool
) -> str:
    """Write the runner's spec for session ``m``; returns the file's path.

    ``parent_on_this_host``: the handshake came from this host (:func:`same_host`)."""
    tls = config.tls
    spec = RunnerSpec(
        manifest=m,
        listen_host=config.listen_address[0],
        deadline_unix=deadline_unix,
        allowed_modules=list(config.callables.allowed_modules),
        python_path=list(config.callables.python_path),
        tls=(
            RunnerTLS(tls.cert_file, tls.key_file, tls.client_ca_file or None)
            if config.tls_enabled
            else None
        ),
        parent_on_this_host=parent_on_this_host,
    )
    # mkstemp creates the file 0600: the attach key in it is a session secret.
    fd, path = tempfile.mkstemp(
        prefix=f"simpler-remote-{m.session_id:016x}-",
        suffix=".json",
        dir=config.worker.spec_dir or None,
    )
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(msgspec.json.encode(spec))
    except BaseException:
        os.unlink(path)
        raise
    return path


def runner_env(config: RemoteWorkerConfig, argv_env: str) -> dict[str, str]:
    """The runner's environment: ours, without the test hook ``argv_env``, with
    ``callables.python_path`` ahead of any ``PYTHONPATH``, and unbuffered output (its
    lines are logged as they come)."""
    env = dict(os.environ)
    env.pop(argv_env, None)
    paths = list(config.callables.python_path)
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env
