"""The daemon process: the one place that composes the Worker, gRPC, health, metrics and systemd.

::

    main: load config -> Daemon(config)
      prepare()  sweep stale heaps, runtime dir, credentials,
                 the worker tree of the config (server/topology.py):
                 Worker(...).add_worker(Worker(level=3), [[workers.local]]...)   (level 4)
                       .add_remote_worker([[workers.remote]]...)                 (level 4)
                       .register(preload..., local and remote callables...)
                       .init()          <- every fork (the local L3 subtrees too) happens
                                           here, before any thread exists
      serve()    (uvloop)  Worker.start_async -> DaemonService
                 -> grpc.aio on the Unix socket (0660, group)   [+ TCP: TLS + bearer token]
                    [+ health.probe_listen: plain-text TCP, the gRPC health service only]
                 -> health SERVING, metrics listener -> READY=1, WATCHDOG=1 every ping period
                 ... a worker pool without capacity: health NOT_SERVING, and after
                     health.unhealthy_exit_s no WATCHDOG=1 (server/health.py) ...
                 ... SIGTERM / SIGINT / Drain(shutdown) ...
                 -> STOPPING=1, health NOT_SERVING, no new runs
                 -> admitted runs get daemon.shutdown_grace, then are cancelled (watchers see it);
                    within that grace, the runs' outputs stay readable until their owners
                    have read them (server/owed.py)
                 -> Worker.close_async -> gRPC servers stop -> socket removed

Signals (each leaves no socket and no /dev/shm heap behind):

    SIGTERM, SIGINT   graceful stop as above; a second SIGINT exits at once
    SIGQUIT           exit at once: children SIGKILLed, heap and sockets unlinked (131)
    SIGHUP            reload the config file (see server/reload.py): RELOADING=1 ... READY=1
    SIGUSR1, SIGUSR2  logged and ignored (their default action would kill the daemon
                      and leave its heap in /dev/shm)
    SIGPIPE           ignored (Python's default; a closed peer is an EPIPE error)

Signal handlers only record the request and wake the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import signal
from collections import Counter
from collections.abc import Callable
from typing import Any, Final

from simpler_daemon.args import MAX_TENSORS
from simpler_daemon.callables import extend_import_path, restrict_imports
from simpler_daemon.endpoints.taskwatch import set_max_task_seconds
from simpler_daemon.engine.worker import Worker
from simpler_daemon.errors import ConfigError, StartupError
from simpler_daemon.heap import sweep_stale_heaps
from simpler_daemon.mailbox.layout import MAILBOX_ARGS_CAPACITY, TENSOR_DESC_SIZE
from simpler_daemon.server.config import DaemonConfig, parse_host_port
from simpler_daemon.server.health import HealthState, HealthWatch
from simpler_daemon.server.history import History, open_history
from simpler_daemon.server.listeners import (
    bind_private_socket,
    prepare_socket_paths,
    private_socket_of,
    publish_fast,
    publish_relay,
)
from simpler_daemon.server.tcpauth import is_loopback, token_interceptor
from simpler_daemon.server.topology import (
    CLOSE_TIMEOUT,
    add_configured_workers,
    local_worker_of,
    new_worker,
    remote_spec_of,
)
from simpler_daemon.system.authguard import check_private_file, read_token_file
from simpler_daemon.system.exitcodes import EXIT_QUIT
from simpler_daemon.system.notify import SystemdNotifier

__all__ = [
    "EXIT_FORCED",
    "LIVENESS_NAME",
    "MAX_SCALARS",
    "SERVICE_NAME",
    "Daemon",
    "check_limits",
    "local_worker_of",
    "remote_spec_of",
]

log = logging.getLogger("simpler_daemon.daemon")

#: The gRPC service name (health checks and reflection).
SERVICE_NAME: Final = "simpler.daemon.v1.Daemon"
#: The gRPC health name for liveness: SERVING while the event loop answers, NOT_SERVING
#: once a pool has been down past ``health.unhealthy_exit_s`` with nothing coming back
#: (when a systemd watchdog would restart the daemon). A drain, or L3 workers that
#: reconnect, leave it SERVING: a restart would not help then.
LIVENESS_NAME: Final = "liveness"
#: Scalars the mailbox args blob is guaranteed to hold (ARCHITECTURE section 4.1).
MAX_SCALARS: Final = 128
#: Exit status of a second SIGINT (128 + SIGINT, as a shell reports it).
EXIT_FORCED: Final = 128 + signal.SIGINT
#: Signals whose default action would end the daemon without its cleanup: logged and
#: ignored while it serves.
IGNORED_SIGNALS: Final = (signal.SIGUSR1, signal.SIGUSR2)
#: Seconds open streams get to deliver their last events when the servers stop.
STREAM_GRACE: Final = 2.0
_GAUGE_PERIOD: Final = 1.0


# --------------------------------------------------------------------------- config checks


def check_limits(config: DaemonConfig) -> None:
    """``ConfigError`` when a task's tensor/scalar limits cannot fit the mailbox args blob."""
    lim = config.limits
    if lim.max_tensors_per_task > MAX_TENSORS:
        raise ConfigError(
            f"limits.max_tensors_per_task: {lim.max_tensors_per_task} tensors do not fit the "
            f"mailbox args capacity ({MAX_TENSORS} tensors)",
            key="limits.max_tensors_per_task",
        )
    if lim.max_scalars_per_task > MAX_SCALARS:
        raise ConfigError(
            f"limits.max_scalars_per_task: {lim.max_scalars_per_task} scalars exceed the "
            f"{MAX_SCALARS} the mailbox guarantees",
            key="limits.max_scalars_per_task",
        )
    need = 8 + lim.max_tensors_per_task * TENSOR_DESC_SIZE + 8 * lim.max_scalars_per_task
    if need > MAILBOX_ARGS_CAPACITY:
        raise ConfigError(
            f"limits.max_tensors_per_task: {lim.max_tensors_per_task} tensors and "
            f"{lim.max_scalars_per_task} scalars need {need} bytes, the mailbox args capacity "
            f"is {MAILBOX_ARGS_CAPACITY} bytes",
            key="limits.max_tensors_per_task",
        )


# --------------------------------------------------------------------------- the daemon


class Daemon:
    """One daemon process: ``prepare()`` (forks), then ``await serve()`` (threads, sockets).

    ``announce(line)`` receives the human-facing start-up lines (the CLI prints
    them). Raises ``ConfigError`` for a configuration the daemon cannot use and
    ``StartupError`` when it cannot start.
    """

    def __init__(
        self,
        config: DaemonConfig,
        *,
        notifier: SystemdNotifier | None = None,
        announce: Callable[[str], None] | None = None,
        reload_config: Callable[[], DaemonConfig] | None = None,
        reset_state: bool = False,
    ) -> None:
        """``reload_config()`` loads the configuration again from its sources (SIGHUP);
        None: SIGHUP has nothing to reload and says so. ``reset_state`` (``--reset-state``):
        a run history that cannot be opened is moved aside instead of failing start-up."""
        check_limits(config)
        self.config = config
        self._reset_state = reset_state
        #: The run history (server/history.py), opened by prepare(); None: ":memory:".
        self.history: History | None = None
        self.notifier = notifier if notifier is not None else SystemdNotifier(None)
        self._announce = announce or (lambda _line: None)
        self.worker: Worker | None = None
        #: ``[workers.discovery]`` once serving (server/discovery.py); None: off.
        self.discovery: Any = None
        self.socket_path = config.grpc.unix_socket
        self.private_socket_path = private_socket_of(config)
        self._relay: Any = None
        #: The local fast path's socket (server/fastpath.py); "" = [fast] enabled = false.
        self.fast_socket_path = config.fast.unix_socket if config.fast.enabled else ""
        self._fast: Any = None
        self._fast_bound = False
        self.tcp_port: int | None = None
        self.probe_port: int | None = None
        self._token: bytes | None = None
        self._tls: tuple[bytes, bytes, bytes | None] | None = None
        self._metrics_token: bytes | None = None
        self._admin_token = b""
        self._gid: int | None = None
        self._stop_event: asyncio.Event | None = None
        self._stop_reason: str | None = None
        self._socket_bound = False
        self._servers: list[Any] = []
        self._health: Any = None
        self._service: Any = None
        self._metrics: Any = None
        self._dashboard: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._reload_config = reload_config
        self._ready_status = ""
        #: Whether every worker pool has capacity (server/health.py).
        self.health = HealthState(config.health.unhealthy_exit_s)
        #: Signals that arrived between prepare() and serve() (main records them).
        self.pending_signals: list[int] = []

    # -- before any thread --------------------------------------------------------------

    def prepare(self) -> None:
        """Everything that must happen while the process is single-threaded: sweep stale
        heaps, check the socket path, read credentials, build and ``init()`` the Worker."""
        cfg = self.config
        # Before any fork: every import path this process and its children resolve from
        # now on (preload, [[workers.local]] callables, RegisterCallable, orchestrations)
        # must name something defined in an allowed module; and no task outlives the
        # operator's ceiling, whatever deadline its orchestration gave it.
        restrict_imports(cfg.callables.allowed_modules)
        # The operator's code directories, first on sys.path: the children forked below
        # (and by the fork servers) inherit it and import registered modules from there.
        extend_import_path(cfg.callables.python_path)
        set_max_task_seconds(cfg.limits.max_task_seconds)
        for name in sweep_stale_heaps():
            log.info("removed stale heap /dev/shm/%s", name)
        self._prepare_paths()
        self.load_credentials()
        workers = cfg.workers
        worker = new_worker(cfg)  # the worker tree: server/topology.py
        self.notifier.status(
            f"starting {workers.num_sub_workers} SUB workers, {workers.num_chips} chips,"
            f" {len(workers.local)} local L3 workers and {len(workers.remote)} remote workers"
        )
        try:
            add_configured_workers(worker, cfg)
            worker.init()
            # After the forks: no child holds the history's lock or database.
            self.history = open_history(cfg.daemon.state_dir, worker.heap, reset=self._reset_state)
        except BaseException:
            worker.close()
            raise
        self.worker = worker
        log.info(
            "worker pool ready: %d SUB workers, %d chips, %d local L3 workers, "
            "%d remote workers, heap %d bytes",
            workers.num_sub_workers,
            workers.num_chips,
            len(workers.local),
            len(workers.remote),
            worker.heap.size,
        )

    def _prepare_paths(self) -> None:
        """Verify (or create) the runtime and socket directories, remove a stale socket
        (see listeners.prepare_socket_paths)."""
        prepare_socket_paths(
            self.config, self.socket_path, self.private_socket_path, self.fast_socket_path
        )

    def load_credentials(self) -> None:
        """Read and check every credential file (tokens, TLS); ``ConfigError`` naming
        the key (``check-config`` runs this too). ``[workers.discovery]``'s files are
        only read to check them: every discovered session reads them when it opens."""
        self._load_credentials()
        cfg = self.config
        if cfg.daemon.level == 4 and cfg.workers.discovery.dns:
            from simpler_daemon.server.discovery import check_discovery

            check_discovery(cfg.workers.discovery)  # a table every session would fail on

    def _load_credentials(self) -> None:
        g = self.config.grpc

        def read(key: str, path: str) -> bytes:
            try:
                with open(path, "rb") as fh:
                    return fh.read()
            except OSError as exc:
                raise ConfigError(
                    f"grpc.{key}: cannot read {path}: {exc.strerror or exc}", key=f"grpc.{key}"
                ) from exc

        if g.socket_group:
            try:
                self._gid = (
                    int(g.socket_group)
                    if g.socket_group.isdigit()
                    else grp.getgrnam(g.socket_group).gr_gid
                )
            except KeyError as exc:
                raise ConfigError(
                    f"grpc.socket_group: no group named {g.socket_group!r}", key="grpc.socket_group"
                ) from exc
        self._warn_exposure()
        m = self.config.metrics
        if m.token_file:
            self._metrics_token = read_token_file(
                m.token_file, "metrics.token_file", "metrics token"
            )
        admin_file = self.config.security.admin_token_file
        if admin_file:  # read here too, so a bad file stops the daemon before it forks
            self._admin_token = read_token_file(
                admin_file, "security.admin_token_file", "admin token"
            )
        if not g.tcp_listen:
            return
        # Mode and length first: a token others may read, or one short enough to guess,
        # is refused before the listener exists.
        self._token = read_token_file(g.token_file, "grpc.token_file")
        check_private_file(g.tls_key, "grpc.tls_key")
        ca = read("tls_client_ca", g.tls_client_ca) if g.tls_client_ca else None
        self._tls = (read("tls_key", g.tls_key), read("tls_cert", g.tls_cert), ca)

    def _warn_exposure(self) -> None:
        """Warn (at start) about settings that open the daemon wider than its defaults."""
        cfg = self.config
        mode = cfg.grpc.socket_mode
        if mode & ~0o660:
            log.warning(
                "grpc.socket_mode %#o is wider than 0o660: %s may connect to %s and run "
                "registered code as this user",
                mode,
                "every local user" if mode & 0o006 else "more than the socket's owner and group",
                cfg.grpc.unix_socket,
            )
        if cfg.metrics.listen:
            host, _ = parse_host_port(cfg.metrics.listen, key="metrics.listen")
            if not is_loopback(host):
                log.warning(
                    "metrics.listen %s is not a loopback address: other hosts can reach /metrics%s",
                    cfg.metrics.listen,
                    "" if cfg.metrics.token_file else " without a token (set metrics.token_file)",
                )

    # -- the event loop ------------------------------------------------------------------

    async def serve(self) -> int:
        """Serve until SIGTERM, SIGINT or ``Drain(shutdown)``; returns the exit status (0).

        Raises ``StartupError`` when a listener cannot be started (after cleaning up).
        """
        if self.worker is None:
            raise StartupError("cannot serve: call prepare() first")
        loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        handlers: dict[int, Callable[[int], None]] = {
            signal.SIGTERM: self._on_signal,
            signal.SIGINT: self._on_signal,
            signal.SIGQUIT: self._on_quit,
            signal.SIGHUP: self._on_hup,
        }
        handlers.update(dict.fromkeys(IGNORED_SIGNALS, self._on_ignored))
        for sig, handler in handlers.items():
            loop.add_signal_handler(sig, handler, sig)
        for sig in self.pending_signals:
            loop.call_soon(handlers[sig], sig)
        self.pending_signals.clear()
        try:
            try:
                await self._start()
            except StartupError:
                self._stop_reason = "start-up failure"
                raise
            except Exception as exc:
                self._stop_reason = "start-up failure"
                raise StartupError(f"cannot start the daemon: {type(exc).__name__}: {exc}") from exc
            await self._stop_event.wait()
        finally:
            await self._shutdown()
            for sig in handlers:
                loop.remove_signal_handler(sig)
        return 0

    def request_stop(self, reason: str) -> None:
        """Begin a graceful stop (as SIGTERM does); later requests are ignored."""
        if self._stop_reason is not None:
            return
        self._stop_reason = reason
        if self._stop_event is not None:
            self._stop_event.set()

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._stop_reason is None:
            log.info("%s received: stopping gracefully", name)
            self.request_stop(name)
        elif signum == signal.SIGINT:
            self._exit_now("second SIGINT")
        else:
            log.info("%s received again: already stopping", name)

    def _on_quit(self, signum: int) -> None:
        self._exit_now("SIGQUIT", EXIT_QUIT)

    def _on_ignored(self, signum: int) -> None:
        log.info(
            "%s received: ignored (SIGHUP reloads the configuration, SIGTERM stops)",
            signal.Signals(signum).name,
        )

    def _on_hup(self, signum: int) -> None:
        if self._stop_reason is not None:
            log.info("SIGHUP received while stopping: not reloading")
            return
        if not self._ready_status:  # READY=1 must mean ready: no reload's READY before it
            log.info("SIGHUP received during start-up: ignored (the configuration was just read)")
            return
        self.reload()

    def reload(self) -> bool:
        """Reload the configuration (SIGHUP, see server/reload.py): apply what can change
        at run time, log the rest as needing a restart; a file that does not load keeps
        the running configuration. ``RELOADING=1`` before, ``READY=1`` after (systemd's
        ``Type=notify-reload`` protocol). True when a new configuration was applied."""
        from simpler_daemon.server.reload import reload_config

        if self._reload_config is None:
            log.warning("SIGHUP received: no configuration source to reload from")
            return False
        self.notifier.reloading("reloading the configuration")
        log.info("SIGHUP received: reloading the configuration")
        try:
            new = reload_config(self.config, self._reload_config, self._service)
        finally:
            self.notifier.ready(self._ready_status or None)
        if new is None:
            return False
        self.config = new
        return True

    def _exit_now(self, why: str, code: int = EXIT_FORCED) -> None:
        log.warning("%s: exiting at once without draining", why)
        if self.worker is not None:
            for child in self.worker.children:
                child.signal_group(signal.SIGKILL)
            if self.worker.heap.path is not None:  # nothing of ours stays in /dev/shm
                with contextlib.suppress(OSError):
                    os.unlink(self.worker.heap.path)
        for sock_path in (self.socket_path, self.private_socket_path) if self._socket_bound else ():
            with contextlib.suppress(OSError):
                os.unlink(sock_path)
        if self._fast_bound:
            with contextlib.suppress(OSError):
                os.unlink(self.fast_socket_path)
        self.notifier.status(f"exited at once ({why})")
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        os._exit(code)

    async def _start(self) -> None:
        from simpler_daemon.system.grpcsetup import prepare_grpc

        prepare_grpc()  # before grpc's first import in the daemon (system/grpcsetup.py)
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection

        from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2
        from simpler_daemon.server.decoding import add_daemon_servicer
        from simpler_daemon.server.metrics import Metrics
        from simpler_daemon.server.peers import UnixRelay
        from simpler_daemon.server.service import DaemonService

        cfg = self.config
        worker = self.worker
        assert worker is not None
        await worker.start_async()
        if cfg.metrics.listen:
            self._metrics = Metrics(token=self._metrics_token)
            if cfg.daemon.level == 4:
                self._metrics.watch_remote_workers(worker.list_workers)
        self._relay = UnixRelay(self.socket_path, self.private_socket_path)
        service = DaemonService(
            worker,
            cfg,
            metrics=self._metrics,
            request_shutdown=self.request_stop,
            on_draining=self._not_serving,
            on_resumed=self._serving_again,
            relay=self._relay,
            history=self.history,
        )
        service.start()
        self._service = service
        if self._metrics is not None and cfg.dashboard.enabled:
            from simpler_daemon.server.dashboard import Dashboard

            self._dashboard = Dashboard(service)
            self._metrics.serve_dashboard(self._dashboard)
        self._health = health.aio.HealthServicer()
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self._health.set(name, not_serving)
        await self._health.set(LIVENESS_NAME, health_pb2.HealthCheckResponse.SERVING)

        max_msg = cfg.limits.max_message_bytes
        options = [
            ("grpc.max_receive_message_length", max_msg),
            ("grpc.max_send_message_length", max_msg),
            ("grpc.so_reuseport", 0),
        ]
        names = (
            daemon_pb2.DESCRIPTOR.services_by_name["Daemon"].full_name,
            health.SERVICE_NAME,
            reflection.SERVICE_NAME,
        )

        def build(interceptors: list[Any]) -> Any:
            server = grpc.aio.server(options=options, interceptors=interceptors)
            add_daemon_servicer(service, server)
            health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
            reflection.enable_server_reflection(names, server)
            return server

        unix_server = build([])
        path = self.socket_path
        bind_private_socket(unix_server, self.private_socket_path)
        self._servers.append(unix_server)

        if cfg.grpc.tcp_listen:
            assert self._tls is not None and self._token is not None
            key, cert, ca = self._tls
            creds = grpc.ssl_server_credentials(
                [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
            )
            tcp_server = build([token_interceptor(self._token, admin_token=self._admin_token)])
            try:
                port = tcp_server.add_secure_port(cfg.grpc.tcp_listen, creds)
            except RuntimeError as exc:
                raise StartupError(f"cannot listen on {cfg.grpc.tcp_listen}: {exc}") from exc
            if not port:
                raise StartupError(f"cannot listen on {cfg.grpc.tcp_listen}: bind failed")
            self._servers.append(tcp_server)
            self.tcp_port = port

        if cfg.health.probe_listen:
            self._servers.append(self._probe_server(grpc, health_pb2_grpc))

        for server in self._servers:
            await server.start()
        await publish_relay(self._relay, path, cfg.grpc.socket_mode, self._gid)
        self._socket_bound = True
        if self.fast_socket_path:
            await self._start_fast(service)
        if self._metrics is not None:
            host, port = parse_host_port(cfg.metrics.listen, key="metrics.listen")
            await self._metrics.start(host, port)
            if self._dashboard is not None:
                shown = f"[{host}]" if ":" in host else (host or "0.0.0.0")
                self._announce(f"dashboard on http://{shown}:{self._metrics.port}/")
            self._tasks.append(asyncio.create_task(self._update_gauges(), name="metrics-gauges"))

        await self._publish_health()
        self._announce(f"listening on unix:{path}")
        if self._fast_bound:
            self._announce(f"fast path on {self.fast_socket_path}")
        if self.tcp_port is not None:
            host, _ = parse_host_port(cfg.grpc.tcp_listen, key="grpc.tcp_listen")
            shown = f"[{host}]" if ":" in host else host
            mtls = " (mutual TLS)" if self._tls and self._tls[2] else " (TLS)"
            self._announce(f"listening on tcp {shown}:{self.tcp_port}{mtls}")
        if self.probe_port is not None:
            host, _ = parse_host_port(cfg.health.probe_listen, key="health.probe_listen")
            shown = f"[{host}]" if ":" in host else host
            self._announce(f"health probes on tcp {shown}:{self.probe_port} (plain text)")
        status = (
            f"serving on unix:{path}; {worker.num_sub_workers} SUB workers, "
            f"{worker.num_chips} chips"
        )
        if cfg.daemon.level == 4:
            status += (
                f", {len(cfg.workers.local)} local and {len(cfg.workers.remote)} remote "
                "L3 workers from the config"
            )
        log.info("ready: %s", status)
        self._ready_status = status
        self.notifier.ready(status)
        period = self.notifier.ping_period() if cfg.daemon.watchdog else None
        if period:
            self._tasks.append(asyncio.create_task(self._watchdog(period), name="watchdog"))
        watch = HealthWatch(
            worker,
            self.health,
            publish=self._publish_health,
            notifier=self.notifier,
            watchdog=bool(period),
            metrics=self._metrics,
        )
        self._tasks.append(asyncio.create_task(watch.run(), name="health"))
        if cfg.daemon.level == 4 and cfg.workers.discovery.dns:
            self._start_discovery(service)

    def _start_discovery(self, service: Any) -> None:
        """``[workers.discovery]``: resolve off the start-up path (after READY=1), on a task
        of its own; the service and metrics show its view (server/discovery.py)."""
        from simpler_daemon.server.discovery import Discovery

        assert self.worker is not None
        self.discovery = Discovery(self.worker, self.config.workers.discovery)
        service.discovery = self.discovery
        if self._metrics is not None:
            self._metrics.watch_discovery(self.discovery.view)
        self._tasks.append(asyncio.create_task(self.discovery.run(), name="discovery"))

    def _probe_server(self, grpc: Any, health_pb2_grpc: Any) -> Any:
        """The plain-text listener of ``health.probe_listen``: the health servicer alone
        (no Daemon service, no reflection), for probes that carry no credentials."""
        listen = self.config.health.probe_listen
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            port = server.add_insecure_port(listen)
        except RuntimeError as exc:
            raise StartupError(f"cannot listen on {listen} (health.probe_listen): {exc}") from exc
        if not port:
            raise StartupError(f"cannot listen on {listen} (health.probe_listen): bind failed")
        self.probe_port = port
        return server

    async def _start_fast(self, service: Any) -> None:
        """The local fast path (server/fastpath.py) beside the gRPC socket, with the same
        mode and group, published the same way (bound staged, renamed into place)."""
        from simpler_daemon.server.fastpath import FastServer

        cfg = self.config
        path = self.fast_socket_path
        self._fast = FastServer(
            service,
            path,
            cfg.limits.max_message_bytes,
            max_connections=cfg.fast.max_connections,
            frame_timeout=cfg.fast.frame_timeout,
        )
        await publish_fast(self._fast, path, cfg.grpc.socket_mode, self._gid)
        self._fast_bound = True

    async def _publish_health(self) -> None:
        """gRPC health (both names), GetInfo's reason and the serving gauge: SERVING while
        runs are admitted and every worker pool has capacity, else NOT_SERVING."""
        from grpc_health.v1 import health_pb2

        from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2

        service = self._service
        serving = (
            service is not None
            and service.serving_state == daemon_pb2.SERVING_STATE_SERVING
            and self.health.healthy
        )
        if service is not None:
            service.health_reason = self.health.reason
        if self._health is not None:
            status = health_pb2.HealthCheckResponse
            for name in ("", SERVICE_NAME):
                await self._health.set(name, status.SERVING if serving else status.NOT_SERVING)
            live = not self.health.pings_stopped
            await self._health.set(LIVENESS_NAME, status.SERVING if live else status.NOT_SERVING)
        if self._metrics is not None:
            self._metrics.set_serving(serving)

    async def _not_serving(self) -> None:
        """Health turns NOT_SERVING: a drain began (load balancers stop sending work)."""
        await self._publish_health()
        self.notifier.status("draining: no new runs are admitted")

    async def _serving_again(self) -> None:
        """Health turns SERVING again (unless a pool is down): a Resume undid the drain."""
        await self._publish_health()
        if self.health.healthy:
            self.notifier.status("serving: drain undone by Resume")
        else:
            self.notifier.status(f"drain undone by Resume, but unhealthy: {self.health.reason}")

    async def _watchdog(self, period: float) -> None:
        """WATCHDOG=1 from the event loop: a wedged loop stops the pings, and so does a
        daemon unhealthy for health.unhealthy_exit_s (server/health.py)."""
        while True:
            if not self.health.pings_stopped:
                self.notifier.watchdog()
            await asyncio.sleep(period)

    async def _update_gauges(self) -> None:
        worker, metrics = self.worker, self._metrics
        assert worker is not None and metrics is not None
        reported = dict.fromkeys(worker.restarts, 0)
        while True:
            for kind, count in worker.restarts.items():
                for _ in range(count - reported.get(kind, 0)):
                    metrics.child_restarted(kind)
                reported[kind] = count
            lanes: Counter[tuple[str, str]] = Counter()
            for info in worker.list_workers():
                state = (
                    "failed"
                    if info.get("poisoned") or not info.get("alive", True)
                    else ("busy" if info.get("busy") else "idle")
                )
                lanes[(str(info.get("kind", "?")), state)] += 1
            for kind in {k for k, _ in lanes} | {"sub"}:
                for state in ("idle", "busy", "failed"):
                    metrics.set_lanes(kind, state, lanes.get((kind, state), 0))
            if worker.scheduler is not None:
                metrics.set_queue_depth("ready", worker.scheduler.queued())
            await asyncio.sleep(_GAUGE_PERIOD)

    async def _shutdown(self) -> None:
        reason = self._stop_reason or "stop"
        grace = self.config.daemon.shutdown_grace
        started = asyncio.get_running_loop().time()
        self.notifier.stopping(f"stopping ({reason})")
        log.info("stopping (%s)", reason)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._health is not None:
            with contextlib.suppress(Exception):
                await self._health.enter_graceful_shutdown()
        service = self._service
        if service is not None:
            service.begin_stopping()
            active = service.active_runs
            if active:
                self.notifier.status(f"stopping: {active} runs get {grace:.0f}s to finish")
            finished, cancelled = await service.drain(grace, reason=f"daemon stopping ({reason})")
            if cancelled:
                self.notifier.status(f"stopping: cancelled {cancelled} runs")
                # Cancelled runs end once their running tasks do; watchers then see CANCELLED.
                await service.wait_idle(CLOSE_TIMEOUT / 2)
            log.info("runs: %d finished during shutdown, %d cancelled", finished, cancelled)
            left = grace - (asyncio.get_running_loop().time() - started)
            await service.settle_owed(left, self.notifier.status)
        if self.worker is not None:
            self.notifier.status("stopping: shutting down worker processes")
            try:
                await self.worker.close_async(CLOSE_TIMEOUT)
            except Exception:
                log.exception("closing the worker pool failed")
        if self.history is not None:  # the runs are settled: record them, unlock
            await self.history.close()
        if self._relay is not None:
            self._relay.stop_accepting()
        if self._fast is not None:
            self._fast.stop_accepting()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.stop(STREAM_GRACE)
        self._servers.clear()
        if self._fast is not None:
            await self._fast.close(STREAM_GRACE)
            self._fast = None
        if self._fast_bound:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.fast_socket_path)
            self._fast_bound = False
        if self._relay is not None:
            await self._relay.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.private_socket_path)
        if self._metrics is not None:
            await self._metrics.close()
        if self._socket_bound:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            self._socket_bound = False
        self.notifier.status("stopped")
        log.info("stopped")
