"""Daemon configuration: frozen, typed settings and the one step that loads them.

Layers, later wins::

    struct defaults
      <- the file given to load() (or DEFAULT_CONFIG_TOML when there is none)
      <- environment variables  SIMPLER_DAEMON__<SECTION>__<KEY>=<value>
      <- overrides              {"grpc.unix_socket": "/run/x.sock"}     (the CLI)
         |
         v  msgspec.convert: types, Literal choices, unknown keys
         v  validate():      ranges and cross-field rules
         v  resolve():       "" -> runtime dir, socket path, CPU count

Every failure is a ``ConfigError`` whose ``key`` is the dotted setting and whose
message names the file (and where a value came from when it was not the file).
Loading has no side effects: nothing is created, bound or imported here. The layering
itself is :mod:`simpler_daemon.system.configfile`; the structs are
:mod:`simpler_daemon.server.config_types` (re-exported here); this module holds the
default file, the rules, loading and dumping.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Final

import msgspec

from simpler_daemon.server.config_types import (
    DEFAULT_RUN_RESULT_BYTES,
    GIB,
    MIB,
    CallablesConfig,
    DaemonConfig,
    DashboardConfig,
    DiscoveryConfig,
    GrpcConfig,
    LimitsConfig,
    LocalCallableConfig,
    LocalWorkerConfig,
    MetricsConfig,
    ReconnectConfig,
    RemoteCallableConfig,
    RemoteSessionConfig,
    RemoteWorkerConfig,
    SchedulerConfig,
    SecurityConfig,
    ServiceConfig,
    WorkersConfig,
)
from simpler_daemon.server.config_types import KIB as KIB
from simpler_daemon.server.config_types import FastConfig as FastConfig
from simpler_daemon.system.configfile import (
    ConfigSchema,
    Invalid,
    check_host_port,
    check_module_names,
    check_path,
    is_dotted,
    parse_host_port,
)
from simpler_daemon.system.runtimedir import (
    MEMORY_STATE,
    SOCKET_NAME,
    default_runtime_dir,
    default_state_dir,
    fast_socket_path,
)

__all__ = [
    "DEFAULT_CONFIG_TOML",
    "DEFAULT_RUN_RESULT_BYTES",
    "ENV_PREFIX",
    "GIB",
    "MEMORY_STATE",
    "MIB",
    "RESULT_HEADROOM_BYTES",
    "CallablesConfig",
    "DaemonConfig",
    "DashboardConfig",
    "DiscoveryConfig",
    "GrpcConfig",
    "LimitsConfig",
    "LocalCallableConfig",
    "LocalWorkerConfig",
    "MetricsConfig",
    "ReconnectConfig",
    "RemoteCallableConfig",
    "RemoteSessionConfig",
    "RemoteWorkerConfig",
    "SchedulerConfig",
    "SecurityConfig",
    "ServiceConfig",
    "WorkersConfig",
    "default_runtime_dir",
    "default_state_dir",
    "dump",
    "load",
    "parse_host_port",
    "resolve",
    "run_result_limit",
    "validate",
]

#: Environment variables ``SIMPLER_DAEMON__SECTION__KEY`` override the file.
ENV_PREFIX: Final = "SIMPLER_DAEMON__"

# gRPC message size options are C ints.
_GRPC_MAX_MESSAGE: Final = (1 << 31) - 1
#: Room one WaitRun reply keeps beside a run's results (its RunStatus, error text); a
#: quarter of limits.max_message_bytes when that is below 256 KiB.
RESULT_HEADROOM_BYTES: Final = 64 << 10
# sun_path is 108 bytes including the terminating NUL.
_UNIX_PATH_MAX: Final = 107


#: The configuration used when no file is given; equal to ``DaemonConfig()``.
DEFAULT_CONFIG_TOML: Final = """\
# simpler-daemon embedded default configuration.
# Works on a fresh machine: level 3, one SUB worker per CPU, 2 simulated chips,
# gRPC on a Unix socket in the runtime directory, no TCP listener, metrics off.

[daemon]
level = 3
runtime_dir = ""            # "" = $XDG_RUNTIME_DIR/simpler-daemon, /run/user/<uid>/..., see docs
state_dir = ""              # run history; "" = $STATE_DIRECTORY or ~/.local/state/simpler-daemon, ":memory:" = none
startup_timeout = 30.0
shutdown_grace = 30.0
log_format = "text"
log_level = "info"
watchdog = true

[workers]
num_sub_workers = 0         # 0 = one per CPU
# num_chips unset: 2 simulated chips at level 3
chip_pipeline_depth = 2
heap_bytes = 268435456      # 256 MiB
heap_shared = true          # /dev/shm name local clients can map
local = []                  # level 4: [[workers.local]] tables, see deploy/config/daemon.toml
remote = []                 # level 4: [[workers.remote]] tables, see deploy/config/daemon.toml
remote_credentials_dir = "" # where AddRemoteWorker credential files may live; "" = nowhere
# [workers.discovery]: level 4, remote workers found by DNS (dns = "NAME:PORT"), see deploy/config/daemon.toml

[grpc]
unix_socket = ""            # "" = <runtime_dir>/daemon.sock
socket_mode = 0o660
socket_group = ""
tcp_listen = ""
tls_cert = ""
tls_key = ""
tls_client_ca = ""
token_file = ""

[limits]
max_message_bytes = 67108864        # 64 MiB
max_tasks_per_run = 100000
max_tensors_per_task = 256
max_scalars_per_task = 128
max_value_bytes = 67108864          # 64 MiB of one task's values and kwargs
max_result_bytes = 67108864         # 64 MiB of one SUB task's return value
max_buffer_bytes = 1073741824       # 1 GiB
max_concurrent_runs = 256
max_streams_per_client = 16
max_finished_runs_kept = 10000
max_finished_run_bytes = 67108864   # 64 MiB of finished runs' statuses (about 2 KiB each)
max_run_result_bytes = 16777216     # 16 MiB of task results per run
max_finished_result_bytes = 268435456  # 256 MiB of results kept by finished runs
max_finished_run_age = 0.0          # seconds a finished run is kept; 0 = no age limit
max_group_members = 65536
per_client_runs = 128
per_client_queued_runs = 10000      # runs past per_client_runs wait QUEUED, up to this many
per_client_heap_bytes = 134217728   # 128 MiB
per_client_registrations = 256
per_client_sessions = 1024
session_ttl = 30.0                  # seconds a gRPC client session lives unrenewed
max_import_path_chars = 1024
max_task_seconds = 0.0              # 0 = no ceiling on a task's time

[callables]
allowed_modules = ["simpler_daemon.examples"]
preload = []
python_path = []            # directories your own modules are imported from

[fast]
enabled = true              # the local fast path for Python clients (docs/operations.md)
unix_socket = ""            # "" = beside grpc.unix_socket: <dir>/<stem>.fast.sock
max_connections = 1024      # connections at once (1..65536); more are closed at once
frame_timeout = 30.0        # seconds a partly received frame is waited for

[metrics]
listen = ""
token_file = ""             # set: scrapes send "Authorization: Bearer <token>"

[dashboard]
enabled = false             # the live status page at http://<metrics.listen>/ (docs/dashboard.md)

[security]
admin_uids = []
admin_groups = []
admin_token_file = ""

[scheduler]
admission = "fair"          # "fair": runs share the workers by priority; "fifo": head run first
spin_us = 200               # the Scheduler's spin before parking while tasks are in flight
child_spin_us = 50          # a SUB worker's spin for its next task before parking
sub_queue_depth = 2         # 2: a busy SUB worker holds its next task; 1: free workers only

[health]
unhealthy_exit_s = 60.0     # a pool without workers this long: stop the watchdog pings; 0 = never
probe_listen = ""           # "host:port": plain-text gRPC health only, for probes (Kubernetes grpc:)

[reconnect]                 # level 4: reopening a remote worker's failed session
initial_s = 0.5             # wait after the first failed attempt, doubling ...
max_s = 10.0                # ... up to this
max_elapsed_s = 0.0         # give the worker up after this long; 0 = never
"""

_SCHEMA: Final = ConfigSchema(
    root=DaemonConfig,
    env_prefix=ENV_PREFIX,
    env_origin=" (from environment variable {name})",
    override_origin=" (from override)",
    default_text=DEFAULT_CONFIG_TOML,
)


# --------------------------------------------------------------------------- helpers


def _split_import_path(text: str) -> tuple[str, str]:
    parts = text.strip().split(":")
    if len(parts) != 2:
        raise ValueError(f"{text!r} must be 'module:qualname' with exactly one colon")
    module, qualname = parts
    if not is_dotted(module):
        raise ValueError(f"{text!r}: module {module!r} must be an absolute dotted name")
    if not is_dotted(qualname):
        raise ValueError(f"{text!r}: qualname {qualname!r} must be dotted identifiers")
    return module, qualname


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def resolve(config: DaemonConfig, env: Mapping[str, str] | None = None) -> DaemonConfig:
    """Fill the derived defaults: runtime dir, Unix socket path, SUB worker count."""
    replace = msgspec.structs.replace
    service = config.daemon
    if not service.runtime_dir:
        service = replace(service, runtime_dir=default_runtime_dir(env))
    if not service.state_dir:
        service = replace(service, state_dir=default_state_dir(env))
    grpc = config.grpc
    if not grpc.unix_socket:
        grpc = replace(grpc, unix_socket=os.path.join(service.runtime_dir, SOCKET_NAME))
    workers = config.workers
    if workers.num_sub_workers == 0 and service.level == 3:
        workers = replace(workers, num_sub_workers=_available_cpus())
    if workers.num_chips is None:
        workers = replace(workers, num_chips=2 if service.level == 3 else 0)
    fast = config.fast
    if not fast.unix_socket:
        fast = replace(fast, unix_socket=fast_socket_path(grpc.unix_socket))
    return replace(config, daemon=service, grpc=grpc, workers=workers, fast=fast)


# --------------------------------------------------------------------------- validation


#: Largest ``limits.max_task_seconds``: ``CallConfig.deadline_ms`` stops at a week
#: (``args.MAX_DEADLINE_MS``; not imported here, the config loads without NumPy).
_MAX_TASK_SECONDS: Final = 7 * 24 * 3600.0
#: ``limits.session_ttl`` bounds: a client renews every third of it; a day at most.
_MIN_SESSION_TTL: Final = 0.5
_MAX_SESSION_TTL: Final = 24 * 3600.0
#: The longest spin the config accepts (µs): beyond it a spin costs more CPU than any
#: wake-up it could save.
_MAX_SPIN_US: Final = 10_000


def validate(config: DaemonConfig) -> None:
    """Check ranges and cross-field rules; ``ConfigError`` naming the key on the first problem."""
    try:
        _check(config)
    except Invalid as exc:
        raise exc.error() from None


def _check(config: DaemonConfig) -> None:
    service, workers, grpc = config.daemon, config.workers, config.grpc

    if not (math.isfinite(service.startup_timeout) and service.startup_timeout > 0):
        raise Invalid("daemon.startup_timeout", f": must be > 0, got {service.startup_timeout}")
    if not (math.isfinite(service.shutdown_grace) and service.shutdown_grace >= 0):
        raise Invalid("daemon.shutdown_grace", f": must be >= 0, got {service.shutdown_grace}")
    if service.state_dir != MEMORY_STATE:
        check_path("daemon.state_dir", service.state_dir)
    check_path("daemon.runtime_dir", service.runtime_dir)
    exit_s = config.health.unhealthy_exit_s
    if not (math.isfinite(exit_s) and exit_s >= 0):
        raise Invalid("health.unhealthy_exit_s", f": must be >= 0 (0 = never), got {exit_s}")

    for name in ("spin_us", "child_spin_us"):
        value = getattr(config.scheduler, name)
        if not 0 <= value <= _MAX_SPIN_US:
            raise Invalid(
                f"scheduler.{name}", f": must be between 0 and {_MAX_SPIN_US} (µs), got {value}"
            )

    depth = config.scheduler.sub_queue_depth
    if depth not in (1, 2):
        raise Invalid(
            "scheduler.sub_queue_depth",
            f": must be 1 (free workers only) or 2 (a busy worker holds its next task), "
            f"got {depth}",
        )

    for name in ("num_sub_workers", "num_chips"):
        value = getattr(workers, name)
        if value is not None and value < 0:
            raise Invalid(f"workers.{name}", f": must be >= 0, got {value}")
    if service.level == 4 and workers.num_chips:
        raise Invalid(
            "workers.num_chips",
            f": is {workers.num_chips}, but a level-4 daemon has no chips of its own (they "
            "belong to its L3 workers); set 0 or leave it out",
        )
    if workers.heap_bytes <= 0:
        raise Invalid("workers.heap_bytes", f": must be > 0, got {workers.heap_bytes}")
    check_path("workers.remote_credentials_dir", workers.remote_credentials_dir)
    _check_reconnect(config.reconnect)
    if workers.local and service.level != 4:
        raise Invalid(
            "workers.local",
            f": [[workers.local]] tables need daemon.level = 4 (it is {service.level})",
        )
    for i, local in enumerate(workers.local):
        _check_local(f"workers.local[{i}]", local, config.callables)
    if workers.remote and service.level != 4:
        raise Invalid(
            "workers.remote",
            f": [[workers.remote]] tables need daemon.level = 4 (it is {service.level})",
        )
    for i, remote in enumerate(workers.remote):
        _check_remote(f"workers.remote[{i}]", remote)
    _check_discovery(workers.discovery, service.level)

    check_path("grpc.unix_socket", grpc.unix_socket)
    if len(os.fsencode(grpc.unix_socket)) > _UNIX_PATH_MAX:
        raise Invalid(
            "grpc.unix_socket",
            f": {grpc.unix_socket!r} is {len(os.fsencode(grpc.unix_socket))} bytes, "
            f"a Unix socket path may have at most {_UNIX_PATH_MAX}",
        )
    if not 0 <= grpc.socket_mode <= 0o777:
        raise Invalid("grpc.socket_mode", f": {grpc.socket_mode:#o} is outside 0o000..0o777")
    fast = config.fast
    if not 1 <= fast.max_connections <= 65536:
        raise Invalid("fast.max_connections", f": {fast.max_connections} is outside 1..65536")
    if not (math.isfinite(fast.frame_timeout) and fast.frame_timeout > 0):
        raise Invalid("fast.frame_timeout", f": must be > 0, got {fast.frame_timeout}")
    if fast.enabled:
        check_path("fast.unix_socket", fast.unix_socket)
        if len(os.fsencode(fast.unix_socket)) > _UNIX_PATH_MAX:
            raise Invalid(
                "fast.unix_socket",
                f": {fast.unix_socket!r} is {len(os.fsencode(fast.unix_socket))} bytes, "
                f"a Unix socket path may have at most {_UNIX_PATH_MAX}",
            )
        if fast.unix_socket and os.path.abspath(fast.unix_socket) == os.path.abspath(
            grpc.unix_socket or "."
        ):
            raise Invalid("fast.unix_socket", ": must differ from grpc.unix_socket")
    if grpc.tcp_listen:
        check_host_port("grpc.tcp_listen", grpc.tcp_listen)
        if not (grpc.tls_cert and grpc.tls_key):
            raise Invalid(
                "grpc.tcp_listen",
                " requires grpc.tls_cert and grpc.tls_key: a TCP listener is refused without TLS",
            )
        if not grpc.token_file:
            raise Invalid(
                "grpc.tcp_listen",
                " requires grpc.token_file: a TCP listener is refused without a bearer token",
            )
    elif grpc.tls_client_ca:
        raise Invalid(
            "grpc.tls_client_ca", " requires grpc.tcp_listen: client certificates apply to TCP only"
        )

    for f in msgspec.structs.fields(LimitsConfig):
        value = getattr(config.limits, f.name)
        if f.name == "max_finished_run_age":  # 0 = no age limit
            if not (math.isfinite(value) and value >= 0):
                raise Invalid(f"limits.{f.name}", f": must be >= 0 (0 = none), got {value}")
        elif f.name == "max_task_seconds":  # 0 = no ceiling
            if not 0 <= value <= _MAX_TASK_SECONDS:  # NaN fails too
                raise Invalid(
                    f"limits.{f.name}",
                    f": must be between 0 (none) and {_MAX_TASK_SECONDS:.0f} (a week), got {value}",
                )
        elif f.name == "session_ttl":
            if not _MIN_SESSION_TTL <= value <= _MAX_SESSION_TTL:  # NaN fails too
                raise Invalid(
                    f"limits.{f.name}",
                    f": must be between {_MIN_SESSION_TTL} and {_MAX_SESSION_TTL:.0f} seconds, "
                    f"got {value}",
                )
        elif value <= 0:
            raise Invalid(f"limits.{f.name}", f": must be > 0, got {value}")
    if config.limits.max_message_bytes > _GRPC_MAX_MESSAGE:
        raise Invalid(
            "limits.max_message_bytes",
            f": must be at most {_GRPC_MAX_MESSAGE} (gRPC's limit), "
            f"got {config.limits.max_message_bytes}",
        )

    limits = config.limits
    room = _result_room(limits)
    if limits.max_run_result_bytes != DEFAULT_RUN_RESULT_BYTES and (
        limits.max_run_result_bytes > room
    ):
        raise Invalid(
            "limits.max_run_result_bytes",
            f": must be at most {room} (limits.max_message_bytes minus "
            f"{limits.max_message_bytes - room} bytes of headroom: a finished run's results "
            f"must fit one WaitRun reply), got {limits.max_run_result_bytes}",
        )

    callables = config.callables
    check_module_names("callables.allowed_modules", callables.allowed_modules)
    for i, directory in enumerate(callables.python_path):
        _check_import_dir(f"callables.python_path[{i}]", directory)
    for i, target in enumerate(callables.preload):
        _check_callable_target(f"callables.preload[{i}]", target, callables)

    if config.metrics.listen:
        check_host_port("metrics.listen", config.metrics.listen)
    if config.health.probe_listen:
        check_host_port("health.probe_listen", config.health.probe_listen)
    check_path("metrics.token_file", config.metrics.token_file)
    if config.dashboard.enabled and not config.metrics.listen:
        raise Invalid(
            "dashboard.enabled",
            ": the dashboard is served on the metrics listener: set metrics.listen "
            '(e.g. "127.0.0.1:9464") or dashboard.enabled = false',
        )

    security = config.security
    for i, uid in enumerate(security.admin_uids):
        if uid < 0:
            raise Invalid(f"security.admin_uids[{i}]", f": must be >= 0, got {uid}")
    for i, group in enumerate(security.admin_groups):
        if not group.strip():
            raise Invalid(f"security.admin_groups[{i}]", ": must name a group (or a gid)")
    check_path("security.admin_token_file", security.admin_token_file)


def _check_import_dir(key: str, directory: str) -> None:
    """``directory`` is an absolute path to a directory this user may list and enter
    (a module under it is imported by the daemon and its workers)."""
    if not directory:
        raise Invalid(key, ": must name a directory")
    check_path(key, directory)
    if not os.path.exists(directory):
        raise Invalid(key, f": {directory!r} does not exist")
    if not os.path.isdir(directory):
        raise Invalid(key, f": {directory!r} is not a directory")
    if not os.access(directory, os.R_OK | os.X_OK):
        raise Invalid(key, f": {directory!r} is not readable by uid {os.getuid()}")


def _check_callable_target(key: str, target: str, callables: CallablesConfig) -> None:
    """``target`` is ``module:qualname`` and its module may be imported on this host."""
    try:
        module, _ = _split_import_path(target)
    except ValueError as exc:
        raise Invalid(key, f": {exc}") from None
    if not callables.allows(module):
        allowed = ", ".join(callables.allowed_modules) or "nothing"
        raise Invalid(
            key, f": module {module!r} is not under callables.allowed_modules ({allowed})"
        )


def _check_local(key: str, local: LocalWorkerConfig, callables: CallablesConfig) -> None:
    for name in ("num_sub_workers", "num_chips"):
        if getattr(local, name) < 0:
            raise Invalid(f"{key}.{name}", f": must be >= 0, got {getattr(local, name)}")
    if local.heap_bytes <= 0:
        raise Invalid(f"{key}.heap_bytes", f": must be > 0, got {local.heap_bytes}")
    for j, entry in enumerate(local.callables):
        _check_callable_target(f"{key}.callables[{j}].target", entry.target, callables)
        if entry.kind == "orchestration":
            raise Invalid(
                f"{key}.callables[{j}].kind",
                ': "orchestration" is not installed into one local L3 worker; register it '
                "with RegisterCallable (kind ORCHESTRATION, no workers) and it reaches every "
                "local L3 worker",
            )
        if entry.kind == "chip" and not local.num_chips:
            raise Invalid(
                f"{key}.callables[{j}].kind",
                f': "chip" needs chips, but {key}.num_chips is 0',
            )


def _check_reconnect(r: ReconnectConfig) -> None:
    for name in ("initial_s", "max_s", "max_elapsed_s"):
        value = getattr(r, name)
        if not math.isfinite(value) or value < 0 or (name == "initial_s" and value == 0):
            bound = "> 0" if name == "initial_s" else ">= 0"
            raise Invalid(f"reconnect.{name}", f": must be {bound}, got {value}")
    if r.max_s < r.initial_s:
        raise Invalid(
            "reconnect.max_s",
            f": must be >= initial_s ({r.initial_s:g}), got {r.max_s:g}",
        )


def _check_remote(key: str, remote: RemoteWorkerConfig) -> None:
    # Imported here: loading a config without remote tables needs none of the engine.
    from simpler_daemon.remote.spec import parse_endpoint

    try:
        parse_endpoint(remote.endpoint, "endpoint")
    except ValueError as exc:
        raise Invalid(f"{key}.endpoint", f": {str(exc).partition(': ')[2] or exc}") from None
    _check_remote_settings(key, remote)


def _check_discovery(d: DiscoveryConfig, level: int) -> None:
    """``[workers.discovery]``: off while ``dns`` is ""; else level 4, a NAME:PORT, a
    positive refresh, an IP[:PORT] nameserver, and the session settings of a
    ``[[workers.remote]]`` table."""
    from simpler_daemon.server.dnsquery import parse_dns_target, parse_nameserver

    key = "workers.discovery"
    if not d.dns:
        if d.nameserver:
            raise Invalid(f"{key}.nameserver", " is set but workers.discovery.dns is not")
        return
    if level != 4:
        raise Invalid(f"{key}.dns", f": discovery needs daemon.level = 4 (it is {level})")
    try:
        parse_dns_target(d.dns)
    except ValueError as exc:
        raise Invalid(f"{key}.dns", f": {exc}") from None
    if not (math.isfinite(d.refresh_s) and d.refresh_s > 0):
        raise Invalid(f"{key}.refresh_s", f": must be > 0 (seconds), got {d.refresh_s}")
    if d.nameserver:
        try:
            parse_nameserver(d.nameserver)
        except ValueError as exc:
            raise Invalid(f"{key}.nameserver", f": {exc}") from None
    _check_remote_settings(key, d)


def _check_remote_settings(key: str, remote: RemoteSessionConfig) -> None:
    """The session settings a ``[[workers.remote]]`` table and ``[workers.discovery]``
    share."""
    for name in ("num_sub_workers", "num_chips"):
        if getattr(remote, name) < 0:
            raise Invalid(f"{key}.{name}", f": must be >= 0, got {getattr(remote, name)}")
    if remote.heap_bytes <= 0:
        raise Invalid(f"{key}.heap_bytes", f": must be > 0, got {remote.heap_bytes}")
    timeout = remote.session_timeout_s
    if not (math.isfinite(timeout) and timeout > 0):
        raise Invalid(f"{key}.session_timeout_s", f": must be > 0, got {timeout}")
    for name in ("token_file", "tls_ca_file", "tls_cert_file", "tls_key_file"):
        check_path(f"{key}.{name}", getattr(remote, name))
    if bool(remote.tls_cert_file) != bool(remote.tls_key_file):
        missing = "tls_key_file" if remote.tls_cert_file else "tls_cert_file"
        raise Invalid(
            f"{key}.{missing}", ": tls_cert_file and tls_key_file go together (mutual TLS)"
        )
    for name in ("tls_cert_file", "tls_server_name"):
        if getattr(remote, name) and not remote.tls_ca_file:
            raise Invalid(f"{key}.{name}", f" requires {key}.tls_ca_file (TLS to the worker)")
    for j, entry in enumerate(remote.callables):
        try:
            _split_import_path(entry.target)
        except ValueError as exc:
            raise Invalid(f"{key}.callables[{j}].target", f": {exc}") from None


# --------------------------------------------------------------------------- loading


def load(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> DaemonConfig:
    """Merge defaults <- file <- environment <- overrides, validate, resolve derived defaults.

    ``path=None`` uses :data:`DEFAULT_CONFIG_TOML`. ``env`` defaults to
    ``os.environ``; only ``SIMPLER_DAEMON__SECTION__KEY`` variables are read, and
    their values are parsed as TOML values when possible, else taken as strings
    (a ``str`` setting always takes the text as written). ``overrides`` maps dotted
    keys (``"grpc.unix_socket"``) to values; a string given for a non-string
    setting is parsed the same way as an environment value.

    Raises ``ConfigError`` (``key`` = dotted setting) when the file cannot be
    read or parsed, a key is unknown, a value has the wrong type, or a rule of
    :func:`validate` is broken.
    """
    environ = os.environ if env is None else env

    def finish(config: DaemonConfig) -> DaemonConfig:
        _check(config)
        config = resolve(config, environ)
        _check(config)  # the derived socket path must fit too
        return config

    return _SCHEMA.load(path, env=environ, overrides=overrides, finish=finish)


# --------------------------------------------------------------------------- dumping


def dump(config: DaemonConfig) -> str:
    """The configuration as TOML that :func:`load` reads back to an equal config."""
    lines: list[str] = []
    for section_field in msgspec.structs.fields(DaemonConfig):
        section = getattr(config, section_field.name)
        if lines:
            lines.append("")
        lines.append(f"[{section_field.encode_name}]")
        for f in msgspec.structs.fields(type(section)):
            value = getattr(section, f.name)
            text = f"{value:#o}" if f.name == "socket_mode" else _toml_value(value)
            lines.append(f"{f.encode_name} = {text}")
    return "\n".join(lines) + "\n"


_TOML_ESCAPES: Final = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # "inf", "nan" and "1e-05" are TOML too
    if isinstance(value, str):
        out = []
        for ch in value:
            if ch in _TOML_ESCAPES:
                out.append(_TOML_ESCAPES[ch])
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, msgspec.Struct):  # a [[workers.local/remote]] table, written inline
        items = [
            f"{f.encode_name} = {_toml_value(getattr(value, f.name))}"
            for f in msgspec.structs.fields(value)
        ]
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def run_result_limit(limits: LimitsConfig) -> int:
    """The effective limits.max_run_result_bytes: as configured, except that the default
    is lowered to fit one reply when limits.max_message_bytes is small (a value set
    explicitly above that is refused by :func:`validate`)."""
    return min(limits.max_run_result_bytes, _result_room(limits))


def _result_room(limits: LimitsConfig) -> int:
    """How many bytes of results one WaitRun reply can carry."""
    size = limits.max_message_bytes
    return size - min(RESULT_HEADROOM_BYTES, size // 4)
