"""The worker tree the configuration describes, built before the daemon forks.

::

    DaemonConfig --new_worker--> Worker(level, [workers] sizes, [scheduler], limits, reconnect)
                 --add_configured_workers--> .register(callables.preload...)
                     [[workers.local]]  -> local_worker_of -> Worker(level=3) ->  add_worker
                                           + its callables, registered on that L3 only
                     [[workers.remote]] -> remote_spec_of -> RemoteWorkerSpec ->
                                           add_remote_worker + its callables
                 (Daemon.prepare then calls Worker.init(): every fork happens there)

Locals come before remotes, so worker ids follow the file's order. Every rule only
the Worker or the spec knows becomes a ``ConfigError`` naming the table (or its
callables entry). Nothing here forks, starts a thread or opens a socket; the daemon
(``daemon.py``) composes it.
"""

from __future__ import annotations

import logging
from typing import Final

from simpler_daemon.engine.worker import Worker
from simpler_daemon.errors import ConfigError, RegistrationError, StartupError
from simpler_daemon.heap import heap_name
from simpler_daemon.remote.spec import ReconnectPolicy, RemoteWorkerSpec
from simpler_daemon.server.config import (
    DaemonConfig,
    LocalWorkerConfig,
    RemoteSessionConfig,
    RemoteWorkerConfig,
)

__all__ = [
    "CLOSE_TIMEOUT",
    "add_configured_workers",
    "local_worker_of",
    "new_worker",
    "remote_spec_of",
]

log = logging.getLogger("simpler_daemon.daemon")

#: Seconds a Worker gets to stop its children once the runs are settled.
CLOSE_TIMEOUT: Final = 10.0


def new_worker(cfg: DaemonConfig) -> Worker:
    """The daemon's top-level ``Worker`` (not initialised, nothing registered).

    Raises ``StartupError`` for settings the Worker refuses.
    """
    workers = cfg.workers
    try:
        return Worker(
            level=cfg.daemon.level,
            num_sub_workers=workers.num_sub_workers,
            num_chips=workers.num_chips or 0,  # resolve() filled it in
            chip_pipeline_depth=workers.chip_pipeline_depth,
            heap_bytes=workers.heap_bytes,
            heap_name=heap_name() if workers.heap_shared else None,
            startup_timeout=cfg.daemon.startup_timeout,
            close_timeout=CLOSE_TIMEOUT,
            admission=cfg.scheduler.admission,
            max_active_runs=cfg.limits.max_concurrent_runs,
            max_value_bytes=cfg.limits.max_value_bytes,
            max_result_bytes=cfg.limits.max_result_bytes,
            scheduler_spin_s=cfg.scheduler.spin_us / 1e6,
            child_spin_ns=cfg.scheduler.child_spin_us * 1000,
            sub_queue_depth=cfg.scheduler.sub_queue_depth,
            reconnect=ReconnectPolicy(
                initial_s=cfg.reconnect.initial_s,
                max_s=cfg.reconnect.max_s,
                max_elapsed_s=cfg.reconnect.max_elapsed_s,
            ),
            # GetRunTrace: one Python call per task event more, beside the daemon's own.
            trace=True,
        )
    except ValueError as exc:
        raise StartupError(f"cannot start the daemon: {exc}") from exc


def add_configured_workers(worker: Worker, cfg: DaemonConfig) -> None:
    """Register ``callables.preload`` on ``worker``, then add every ``[[workers.local]]``
    L3 and every ``[[workers.remote]]`` session with their callables (the caller closes
    ``worker`` when this raises)."""
    for path in cfg.callables.preload:
        worker.register(path)
    # Locals first, then remotes: worker ids follow the file's order that way.
    _add_local_workers(worker, cfg)
    _add_remote_workers(worker, cfg)


def remote_spec_of(
    remote: RemoteSessionConfig, key: str, endpoint: str | None = None
) -> RemoteWorkerSpec:
    """The ``RemoteWorkerSpec`` of one ``[[workers.remote]]`` table ("" settings -> None),
    or of ``[workers.discovery]`` for the address ``endpoint`` it found.

    Raises ``ConfigError`` naming ``key`` for a rule only the spec knows.
    """
    if endpoint is None:
        assert isinstance(remote, RemoteWorkerConfig), "a discovered worker needs its endpoint"
        endpoint = remote.endpoint
    try:
        return RemoteWorkerSpec(
            endpoint=endpoint,
            num_sub_workers=remote.num_sub_workers,
            num_chips=remote.num_chips,
            token_file=remote.token_file or None,
            session_timeout_s=remote.session_timeout_s,
            heap_bytes=remote.heap_bytes,
            chip_pipeline_depth=remote.chip_pipeline_depth,
            tls_ca_file=remote.tls_ca_file or None,
            tls_cert_file=remote.tls_cert_file or None,
            tls_key_file=remote.tls_key_file or None,
            tls_server_name=remote.tls_server_name or None,
        )
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}", key=key) from exc


def local_worker_of(local: LocalWorkerConfig, key: str, startup_timeout: float) -> Worker:
    """The NEW ``Worker(level=3)`` of one ``[[workers.local]]`` table, its callables
    registered (its children inherit them when the daemon forks the L3).

    Raises ``ConfigError`` naming ``key`` (or the callables entry) for a rule only the
    Worker knows or a callable that cannot be imported.
    """
    try:
        inner = Worker(
            level=3,
            num_sub_workers=local.num_sub_workers,
            num_chips=local.num_chips,
            chip_pipeline_depth=local.chip_pipeline_depth,
            heap_bytes=local.heap_bytes,
            startup_timeout=startup_timeout,
            close_timeout=CLOSE_TIMEOUT,
        )
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}", key=key) from exc
    return inner


def _add_local_workers(worker: Worker, cfg: DaemonConfig) -> None:
    """Build every ``[[workers.local]]`` L3 with its callables and add it; ``init()``
    forks it with its subtree (a child that does not come up fails start-up)."""
    startup_timeout = cfg.daemon.startup_timeout
    for i, local in enumerate(cfg.workers.local):
        key = f"workers.local[{i}]"
        inner = local_worker_of(local, key, startup_timeout)
        try:
            worker_id = worker.add_worker(inner)
        except (ValueError, TypeError) as exc:
            inner.close()
            raise ConfigError(f"{key}: {exc}", key=key) from exc
        log.info(
            "local L3 worker %d: %d SUB workers, %d chips (%s)",
            worker_id,
            local.num_sub_workers,
            local.num_chips,
            key,
        )
        for j, entry in enumerate(local.callables):
            try:
                worker.register(entry.target, kind=entry.kind, workers=[worker_id])
            except (ValueError, TypeError, RegistrationError) as exc:
                raise ConfigError(
                    f"{key}.callables[{j}]: cannot register {entry.target} on local L3 "
                    f"worker {worker_id}: {exc}",
                    key=f"{key}.callables[{j}]",
                ) from exc


def _add_remote_workers(worker: Worker, cfg: DaemonConfig) -> None:
    """Declare every ``[[workers.remote]]`` session and its callables; ``init()`` opens
    them (a session that cannot be opened fails start-up with a StartupError naming
    the worker and its endpoint)."""
    for i, remote in enumerate(cfg.workers.remote):
        key = f"workers.remote[{i}]"
        spec = remote_spec_of(remote, key)
        worker_id = worker.add_remote_worker(spec)
        log.info("remote worker %d: %s (%s)", worker_id, remote.endpoint, key)
        for j, entry in enumerate(remote.callables):
            try:
                worker.register(entry.target, kind=entry.kind, workers=[worker_id])
            except ValueError as exc:
                raise ConfigError(
                    f"{key}.callables[{j}]: cannot register {entry.target} on remote "
                    f"worker {worker_id} ({remote.endpoint}): {exc}",
                    key=f"{key}.callables[{j}]",
                ) from exc
