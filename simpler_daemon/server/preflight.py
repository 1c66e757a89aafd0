"""``simpler-daemon check-config``: what ``serve`` would refuse, found without serving.

Loading the file already checks types, ranges and cross-field rules. On top of that,
this module checks what depends on the host, as ``serve`` meets it at start:

* the heap fits: a named heap (``workers.heap_shared``) is reserved in full in
  ``/dev/shm`` at start, and every heap (the daemon's and each ``[[workers.local]]``
  L3's) must fit in the memory the kernel reports available;
* every callable registered at start (``callables.preload``, the callables of each
  ``[[workers.local]]``) imports under ``callables.allowed_modules``; checked in a
  subprocess, so the module's import side effects stay out of this process;
* the credential files (``grpc.token_file``, ``grpc.tls_*``, ``metrics.token_file``,
  ``security.admin_token_file``) can be read and pass the mode checks ``serve`` applies.

Each finding is a ``ConfigError`` naming the key; :func:`preflight` returns them all.
:func:`config_warnings` lists what is allowed but will not work as written (a per-client
heap quota larger than the heap); ``serve`` logs them at start, ``check-config`` prints
them, neither refuses to go on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Final

from simpler_daemon import heap as heap_module
from simpler_daemon.errors import ConfigError
from simpler_daemon.server.config import DaemonConfig

__all__ = [
    "check_credentials",
    "check_heap",
    "check_imports",
    "config_warnings",
    "mem_available",
    "preflight",
]

#: The import check's output line (a module may print while it is imported).
_MARK: Final = "simpler-daemon-preflight:"

_IMPORT_SCRIPT: Final = f"""
import json, sys
request = json.loads(sys.argv[1])
sys.path[:0] = request["python_path"]
from simpler_daemon.callables import resolve_import, restrict_imports
restrict_imports(request["allowed"])
problems = []
for key, target in request["targets"]:
    module, _, qualname = target.partition(":")
    try:
        resolve_import(module, qualname)
    except BaseException as exc:
        problems.append([key, target, f"{{type(exc).__name__}}: {{exc}}"])
sys.stdout.flush()
print({_MARK!r} + json.dumps(problems), flush=True)
"""


def mem_available(path: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes, None when the kernel does not say."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _shm_free(directory: str) -> int | None:
    try:
        vfs = os.statvfs(directory)
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize


def check_heap(
    config: DaemonConfig, *, shm_free: int | None = None, available: int | None = None
) -> list[ConfigError]:
    """A heap that /dev/shm or the available memory cannot hold; the sizes default to
    what the host reports now."""
    problems: list[ConfigError] = []
    workers = config.workers
    shm_dir = heap_module.SHM_DIR
    if workers.heap_shared:
        free = _shm_free(shm_dir) if shm_free is None else shm_free
        if free is not None and workers.heap_bytes > free:
            problems.append(
                ConfigError(
                    f"workers.heap_bytes: the heap needs {workers.heap_bytes} bytes in "
                    f"{shm_dir}, which has {free} bytes free (serve would fail to reserve "
                    "it: lower workers.heap_bytes or free space there)",
                    key="workers.heap_bytes",
                )
            )
    total = workers.heap_bytes + sum(local.heap_bytes for local in workers.local)
    avail = mem_available() if available is None else available
    if avail is not None and total > avail:
        parts = "workers.heap_bytes" + (
            " and the [[workers.local]] heap_bytes" if workers.local else ""
        )
        problems.append(
            ConfigError(
                f"workers.heap_bytes: the heaps need {total} bytes ({parts}), the host has "
                f"{avail} bytes of memory available (MemAvailable)",
                key="workers.heap_bytes",
            )
        )
    return problems


def _import_targets(config: DaemonConfig) -> list[tuple[str, str]]:
    targets = [(f"callables.preload[{i}]", t) for i, t in enumerate(config.callables.preload)]
    for i, local in enumerate(config.workers.local):
        targets += [
            (f"workers.local[{i}].callables[{j}]", entry.target)
            for j, entry in enumerate(local.callables)
        ]
    return targets


def check_imports(config: DaemonConfig, timeout: float | None = None) -> list[ConfigError]:
    """Import every callable the daemon registers at start, in a fresh interpreter with
    the daemon's allow-list (and ``callables.python_path`` when the config has it)."""
    targets = _import_targets(config)
    if not targets:
        return []
    python_path = list(getattr(config.callables, "python_path", []) or [])
    request = json.dumps(
        {
            "allowed": list(config.callables.allowed_modules),
            "python_path": python_path,
            "targets": targets,
        }
    )
    limit = timeout if timeout is not None else max(config.daemon.startup_timeout, 10.0)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _IMPORT_SCRIPT, request],
            capture_output=True,
            text=True,
            timeout=limit,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return [
            ConfigError(
                f"{targets[0][0]}: cannot check the callables: importing them took more than "
                f"{limit:.0f}s (daemon.startup_timeout)",
                key=targets[0][0],
            )
        ]
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith(_MARK)), None)
    if line is None:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return [
            ConfigError(
                f"{targets[0][0]}: cannot check the callables: the import check died: {tail}",
                key=targets[0][0],
            )
        ]
    return [
        ConfigError(f"{key}: cannot import {target}: {reason}", key=key)
        for key, target, reason in json.loads(line[len(_MARK) :])
    ]


def check_credentials(config: DaemonConfig) -> list[ConfigError]:
    """Read the credential files as ``serve`` does before it forks (same checks)."""
    from simpler_daemon.server.daemon import Daemon

    try:
        Daemon(config).load_credentials()
    except ConfigError as exc:
        return [exc]
    return []


def preflight(config: DaemonConfig) -> list[ConfigError]:
    """Every host-dependent problem ``serve`` would stop at (empty: none found)."""
    return check_heap(config) + check_credentials(config) + check_imports(config)


def config_warnings(config: DaemonConfig) -> list[str]:
    """Settings that are valid but cannot work as written, each naming its keys."""
    warnings: list[str] = []
    quota, heap = config.limits.per_client_heap_bytes, config.workers.heap_bytes
    if quota > heap:
        warnings.append(
            f"limits.per_client_heap_bytes ({quota} bytes) is larger than workers.heap_bytes "
            f"({heap} bytes): the heap runs out before any client reaches its quota; lower "
            "the quota or grow the heap"
        )
    return warnings
