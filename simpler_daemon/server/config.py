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
itself is :mod:`simpler_daemon.configfile`; this module holds the structs and rules.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping
from typing import Final, Literal

import msgspec

from simpler_daemon.configfile import (
    ConfigSchema,
    Invalid,
    check_host_port,
    check_module_names,
    check_path,
    default_allowed_modules,
    is_dotted,
    parse_host_port,
)

__all__ = [
    "DEFAULT_CONFIG_TOML",
    "DEFAULT_RUN_RESULT_BYTES",
    "ENV_PREFIX",
    "GIB",
    "MIB",
    "RESULT_HEADROOM_BYTES",
    "CallablesConfig",
    "DaemonConfig",
    "GrpcConfig",
    "LimitsConfig",
    "LocalCallableConfig",
    "LocalWorkerConfig",
    "MetricsConfig",
    "RemoteCallableConfig",
    "RemoteWorkerConfig",
    "SchedulerConfig",
    "SecurityConfig",
    "ServiceConfig",
    "WorkersConfig",
    "default_runtime_dir",
    "dump",
    "load",
    "parse_host_port",
    "resolve",
    "run_result_limit",
    "validate",
]

KIB: Final = 1 << 10
MIB: Final = 1 << 20
GIB: Final = 1 << 30

#: Environment variables ``SIMPLER_DAEMON__SECTION__KEY`` override the file.
ENV_PREFIX: Final = "SIMPLER_DAEMON__"

# gRPC message size options are C ints.
_GRPC_MAX_MESSAGE: Final = (1 << 31) - 1
#: Default of limits.max_run_result_bytes.
DEFAULT_RUN_RESULT_BYTES: Final = 16 * MIB
#: Room one WaitRun reply keeps beside a run's results (its RunStatus, error text); a
#: quarter of limits.max_message_bytes when that is below 256 KiB.
RESULT_HEADROOM_BYTES: Final = 64 << 10
# sun_path is 108 bytes including the terminating NUL.
_UNIX_PATH_MAX: Final = 107


class ServiceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[daemon]`` section: the process itself."""

    level: Literal[3, 4] = 3
    """3 = node (one host: chips and SUB workers), 4 = pod parent of L3 workers."""
    runtime_dir: str = ""
    """Socket and state directory; "" = ``default_runtime_dir()`` (``$XDG_RUNTIME_DIR``,
    ``/run/user/<uid>``, ``/run`` for root, else ``/tmp/simpler-daemon-<uid>``)."""
    startup_timeout: float = 30.0
    """Seconds for every child to report ready before start-up fails."""
    shutdown_grace: float = 30.0
    """Seconds admitted runs get to finish on SIGTERM/Drain before they are cancelled."""
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    watchdog: bool = True
    """Ping the systemd watchdog from the event loop when systemd asks for it."""


class RemoteCallableConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``callables`` entry of a ``[[workers.remote]]`` table: installed at start."""

    target: str
    """``module:qualname``, importable on the remote host."""
    kind: Literal["sub", "chip", "orchestration"]


class RemoteWorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[workers.remote]]`` table (level 4): a session on a simpler-remote-worker."""

    endpoint: str
    """"IP:PORT" (or "localhost:PORT") of the simpler-remote-worker; host names are
    not resolved."""
    num_sub_workers: int = 1
    num_chips: int = 0
    chip_pipeline_depth: Literal[1, 2] = 2
    heap_bytes: int = 64 * MIB
    """Shared heap of the remote L3."""
    session_timeout_s: float = 30.0
    """Seconds the health lane may stay silent (and a control may take) before the
    session counts as failed."""
    token_file: str = ""
    """File holding the worker's bearer token; "" = none (loopback workers only)."""
    tls_ca_file: str = ""
    """Set: TLS to the worker, verified against this CA."""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    """Both set: a client certificate (mutual TLS)."""
    tls_server_name: str = ""
    """Name checked against the worker's certificate; "" = the endpoint's host."""
    callables: list[RemoteCallableConfig] = []


class LocalCallableConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``callables`` entry of a ``[[workers.local]]`` table: installed into that L3."""

    target: str
    """``module:qualname`` under ``callables.allowed_modules``."""
    kind: Literal["sub", "chip", "orchestration"]
    """"sub" or "chip"; "orchestration" is refused: an orchestration is never installed
    into one L3, a RegisterCallable of kind ORCHESTRATION (no workers) reaches every
    local L3 worker."""


class LocalWorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One ``[[workers.local]]`` table (level 4): an L3 worker forked on this host, with
    SUB and chip children of its own."""

    num_sub_workers: int = 1
    num_chips: int = 0
    chip_pipeline_depth: Literal[1, 2] = 2
    heap_bytes: int = 64 * MIB
    """The L3's own heap (mapped by the daemon before it forks, so the L3's children
    see the daemon's heap and this one zero-copy)."""
    callables: list[LocalCallableConfig] = []


class WorkersConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[workers]`` section: the pre-forked pools."""

    num_sub_workers: int = 0
    """SUB worker processes; 0 = one per CPU available to the daemon at level 3, none
    at level 4 (a pod parent's work runs on its L3 workers)."""
    num_chips: int | None = None
    """Simulated chip children (NEXT_LEVEL workers 0..num_chips-1); unset = 2 at level 3,
    0 at level 4 (a pod parent's chips belong to its L3 workers)."""
    chip_pipeline_depth: Literal[1, 2] = 2
    heap_bytes: int = 256 * MIB
    """Size of the shared heap that tensors live in."""
    heap_shared: bool = True
    """Expose the heap as /dev/shm/simpler-heap-<pid>-<id> so local clients running as
    the daemon's user map buffers zero-copy (Client.map_buffer); unlinked at stop,
    swept at start if a crashed daemon left it."""
    local: list[LocalWorkerConfig] = []
    """Level 4: ``[[workers.local]]`` L3 workers forked at start (NEXT_LEVEL workers;
    ids 0.. in file order, before the remote ones)."""
    remote: list[RemoteWorkerConfig] = []
    """Level 4: ``[[workers.remote]]`` sessions opened at start (NEXT_LEVEL workers;
    ids follow the local ones, in file order)."""
    remote_credentials_dir: str = ""
    """Directory the credential files named in an AddRemoteWorker request must lie in;
    "" = such a request may name none (the daemon never reads a client-chosen path
    outside it)."""


class GrpcConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[grpc]`` section: where and how clients connect."""

    unix_socket: str = ""
    """"" = ``<runtime_dir>/daemon.sock``."""
    socket_mode: int = 0o660
    socket_group: str = ""
    """Group (name or gid) given to the socket; "" = the daemon's group."""
    tcp_listen: str = ""
    """"host:port" of an optional TCP listener; requires TLS and a token."""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    """Set: mutual TLS, every TCP client must present a certificate from this CA."""
    token_file: str = ""
    """File holding the bearer token TCP clients must send."""


#: Largest ``limits.max_task_seconds``: ``CallConfig.deadline_ms`` stops at a week
#: (``args.MAX_DEADLINE_MS``; not imported here, the config loads without NumPy).
_MAX_TASK_SECONDS: Final = 7 * 24 * 3600.0


class LimitsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[limits]`` section: every size and count a client controls is bounded."""

    max_message_bytes: int = 64 * MIB
    max_tasks_per_run: int = 100_000
    max_tensors_per_task: int = 256
    max_scalars_per_task: int = 128
    max_buffer_bytes: int = 1 * GIB
    max_concurrent_runs: int = 256
    max_streams_per_client: int = 16
    max_finished_runs_kept: int = 10_000
    """Finished runs whose status WaitRun / ListRuns still report; past it the oldest
    finished run of the client holding the most finished runs is forgotten (one client's
    many runs never evict another client's recent one)."""
    max_finished_run_bytes: int = 64 * MIB
    """Bytes the statuses of the kept finished runs may take together (about 2 KiB each
    plus their label, key and error text; results count under max_finished_result_bytes):
    past it finished runs are forgotten as past max_finished_runs_kept. A finished run
    keeps a status only, never its tasks (at least one finished run is kept)."""
    max_run_result_bytes: int = DEFAULT_RUN_RESULT_BYTES
    """Bytes of SUB task results one run may keep (each result counts its size plus 16):
    a task whose result would pass it fails (TASK_FAILURE naming this limit), so a
    finished run's results always fit one WaitRun reply. At most limits.max_message_bytes
    minus RESULT_HEADROOM_BYTES; the default is lowered to that when max_message_bytes is
    smaller (see :func:`run_result_limit`)."""
    max_finished_result_bytes: int = 256 * MIB
    """Bytes of results all finished runs keep together; past it the results of the
    oldest finished runs are dropped (their WaitRun / SubmitRun ``include_results`` is
    FAILED_PRECONDITION naming this limit; their status stays)."""
    max_group_members: int = 65_536
    """Members of one SUB_GROUP / NEXT_LEVEL_GROUP task."""
    per_client_runs: int = 128
    """Active runs of one client identity (``Identity.owner``); below max_concurrent_runs
    so that one client cannot take every run slot."""
    per_client_heap_bytes: int = 128 * MIB
    """Bytes of heap buffers one client identity may hold at once (freed buffers stop
    counting; a client's buffers outlive its connection and keep counting)."""
    per_client_registrations: int = 256
    """Callable registrations (references) one client identity may hold at once."""
    max_import_path_chars: int = 1024
    """Length of a RegisterCallable import path."""
    max_task_seconds: float = 0.0
    """Ceiling on every task's time: its effective deadline is min(deadline_ms, this),
    enforced by the parent (the child is killed, the task fails with ``deadline
    exceeded``); 0 = none."""


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[scheduler]`` section: how runs share the workers."""

    admission: Literal["fair", "fifo"] = "fair"
    """"fair": every admitted run (up to limits.max_concurrent_runs) dispatches, runs of
    different clients share idle workers round-robin weighted by their priority, so a
    small run is never stuck behind a big one; "fifo": the run at the head of admission
    takes the workers first (the in-process Worker's default)."""
    spin_us: int = 200
    """How long (µs) the Scheduler spins on the doorbell word while tasks are in flight
    before it parks on the eventfd (0 = park at once). Spinning saves a wake-up per task
    that finishes within it and costs the daemon this much CPU per completion wait; it
    spins only while tasks typically finish within it (the Worker's scheduler_spin_s)."""
    child_spin_us: int = 50
    """How long (µs) a SUB worker spins for its next task after one ends, before it
    parks on its futex (0 = park at once): a task arriving within it skips a wake-up; it
    costs up to this much CPU per task, none while idle (the Worker's child_spin_ns).
    Both spins are read at start: a change needs a restart."""


class SecurityConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[security]`` section: who is an admin (see docs/operations.md, threat model).

    Root and the daemon's own uid are always admins."""

    admin_uids: list[int] = []
    """Further uids (Unix-socket peers) that may Drain, shut down and act on others' objects."""
    admin_groups: list[str] = []
    """Groups (name or gid) whose members are admins on the Unix socket."""
    admin_token_file: str = ""
    """File holding the bearer token that makes a TCP client an admin; "" = none."""


class CallablesConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[callables]`` section: which code clients may register by import path."""

    allowed_modules: list[str] = msgspec.field(default_factory=default_allowed_modules)
    """A module is allowed when it equals an entry or lies below one (``entry.``)."""
    preload: list[str] = []
    """``module:qualname`` paths registered at start; each must be allowed."""
    python_path: list[str] = []
    """Directories (absolute, existing) put first on the daemon's ``sys.path`` before it
    forks its workers, which inherit it: where your own modules are imported from."""

    def allows(self, module: str) -> bool:
        """Whether ``module`` may be imported on a client's behalf."""
        return any(
            module == entry or module.startswith(entry + ".") for entry in self.allowed_modules
        )


class FastConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[fast]`` section: the local fast path (server/fastpath.py), a framed msgspec
    protocol on its own Unix socket that local Python clients prefer over gRPC."""

    enabled: bool = True
    unix_socket: str = ""
    """"" = beside ``grpc.unix_socket``: ``<dir>/<stem>.fast.sock``, where clients look.
    It gets ``grpc.socket_mode`` and ``grpc.socket_group``."""


class MetricsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[metrics]`` section."""

    listen: str = ""
    """"host:port" of the Prometheus ``/metrics`` listener; "" = off."""
    token_file: str = ""
    """Set: scrapes must send ``Authorization: Bearer <token>`` (the file's content, at
    least 16 bytes, mode 0600); "" = no token (keep ``listen`` on loopback then)."""


class DaemonConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration; decode with ``msgspec.toml.decode(data, type=DaemonConfig)``
    or, with layering and validation, :func:`load`."""

    daemon: ServiceConfig = msgspec.field(default_factory=ServiceConfig)
    workers: WorkersConfig = msgspec.field(default_factory=WorkersConfig)
    grpc: GrpcConfig = msgspec.field(default_factory=GrpcConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    callables: CallablesConfig = msgspec.field(default_factory=CallablesConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    fast: FastConfig = msgspec.field(default_factory=FastConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)


#: The configuration used when no file is given; equal to ``DaemonConfig()``.
DEFAULT_CONFIG_TOML: Final = """\
# simpler-daemon embedded default configuration.
# Works on a fresh machine: level 3, one SUB worker per CPU, 2 simulated chips,
# gRPC on a Unix socket in the runtime directory, no TCP listener, metrics off.

[daemon]
level = 3
runtime_dir = ""            # "" = $XDG_RUNTIME_DIR/simpler-daemon, /run/user/<uid>/..., see docs
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
max_buffer_bytes = 1073741824       # 1 GiB
max_concurrent_runs = 256
max_streams_per_client = 16
max_finished_runs_kept = 10000
max_finished_run_bytes = 67108864   # 64 MiB of finished runs' statuses (about 2 KiB each)
max_run_result_bytes = 16777216     # 16 MiB of task results per run
max_finished_result_bytes = 268435456  # 256 MiB of results kept by finished runs
max_group_members = 65536
per_client_runs = 128
per_client_heap_bytes = 134217728   # 128 MiB
per_client_registrations = 256
max_import_path_chars = 1024
max_task_seconds = 0.0              # 0 = no ceiling on a task's time

[callables]
allowed_modules = ["simpler_daemon.examples"]
preload = []
python_path = []            # directories your own modules are imported from

[fast]
enabled = true              # the local fast path for Python clients (docs/operations.md)
unix_socket = ""            # "" = beside grpc.unix_socket: <dir>/<stem>.fast.sock

[metrics]
listen = ""
token_file = ""             # set: scrapes send "Authorization: Bearer <token>"

[security]
admin_uids = []
admin_groups = []
admin_token_file = ""

[scheduler]
admission = "fair"          # "fair": runs share the workers by priority; "fifo": head run first
spin_us = 200               # the Scheduler's spin before parking while tasks are in flight
child_spin_us = 50          # a SUB worker's spin for its next task before parking
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


def default_runtime_dir(env: Mapping[str, str] | None = None) -> str:
    """Where the daemon keeps its sockets when ``daemon.runtime_dir`` is not set.

    ``$XDG_RUNTIME_DIR/simpler-daemon`` when that is set; else
    ``/run/user/<uid>/simpler-daemon`` when ``/run/user/<uid>`` is a real directory of
    this user that nobody else can write; else, for root, ``/run/simpler-daemon``; else
    ``/tmp/simpler-daemon-<uid>``. A fixed name (not a random one) so that clients find
    the socket; the daemon creates it exclusively and refuses an existing one that is
    not its own private directory (another user may have planted it in ``/tmp``).
    """
    env = os.environ if env is None else env
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "simpler-daemon")
    uid = os.geteuid()
    for base in (f"/run/user/{uid}", "/run") if uid == 0 else (f"/run/user/{uid}",):
        try:
            st = os.lstat(base)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022:
            return os.path.join(base, "simpler-daemon")
    return f"/tmp/simpler-daemon-{uid}"


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
    grpc = config.grpc
    if not grpc.unix_socket:
        grpc = replace(grpc, unix_socket=os.path.join(service.runtime_dir, "daemon.sock"))
    workers = config.workers
    if workers.num_sub_workers == 0 and service.level == 3:
        workers = replace(workers, num_sub_workers=_available_cpus())
    if workers.num_chips is None:
        workers = replace(workers, num_chips=2 if service.level == 3 else 0)
    fast = config.fast
    if not fast.unix_socket:
        from simpler_daemon.discovery import fast_socket_path

        fast = replace(fast, unix_socket=fast_socket_path(grpc.unix_socket))
    return replace(config, daemon=service, grpc=grpc, workers=workers, fast=fast)


# --------------------------------------------------------------------------- validation


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
    check_path("daemon.runtime_dir", service.runtime_dir)

    for name in ("spin_us", "child_spin_us"):
        value = getattr(config.scheduler, name)
        if not 0 <= value <= _MAX_SPIN_US:
            raise Invalid(
                f"scheduler.{name}", f": must be between 0 and {_MAX_SPIN_US} (µs), got {value}"
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
        if f.name == "max_task_seconds":  # 0 = no ceiling
            if not 0 <= value <= _MAX_TASK_SECONDS:  # NaN fails too
                raise Invalid(
                    f"limits.{f.name}",
                    f": must be between 0 (none) and {_MAX_TASK_SECONDS:.0f} (a week), got {value}",
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
    check_path("metrics.token_file", config.metrics.token_file)

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


def _check_remote(key: str, remote: RemoteWorkerConfig) -> None:
    # Imported here: loading a config without remote tables needs none of the engine.
    from simpler_daemon.remote.spec import parse_endpoint

    try:
        parse_endpoint(remote.endpoint, "endpoint")
    except ValueError as exc:
        raise Invalid(f"{key}.endpoint", f": {str(exc).partition(': ')[2] or exc}") from None
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
