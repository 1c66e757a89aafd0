"""How the remote worker hands a session to its runner: the spec file and the environment.

The runner (``simpler-remote-l3-session``) is exec'd with the path of a JSON spec
file: the validated manifest, where to listen, the absolute deadline of its
bring-up, the allow-list and the TLS files. The file holds the session's attach key,
so it is created 0600 and removed by the worker on every path.
"""

from __future__ import annotations

import os
import tempfile

import msgspec

from simpler_daemon.remote.manifest import Manifest, RunnerSpec, RunnerTLS
from simpler_daemon.remote_worker.config import RemoteWorkerConfig

__all__ = ["runner_env", "write_runner_spec"]


def write_runner_spec(config: RemoteWorkerConfig, m: Manifest, deadline_unix: float) -> str:
    """Write the runner's spec for session ``m``; returns the file's path."""
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
