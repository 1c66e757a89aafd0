"""The daemon configuration's typed sections: one frozen msgspec struct per TOML section
(``[daemon]``, ``[workers]``, ``[grpc]``, ...) with its defaults and the size constants
those use.

Nothing here reads, checks or derives a setting: :mod:`simpler_daemon.server.config`
layers, validates and resolves these structs, and re-exports every name of this module.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from simpler_daemon.system.configfile import default_allowed_modules

__all__ = [
    "DEFAULT_RUN_RESULT_BYTES",
    "GIB",
    "KIB",
    "MIB",
    "CallablesConfig",
    "DaemonConfig",
    "DiscoveryConfig",
    "FastConfig",
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
]

KIB: Final = 1 << 10
MIB: Final = 1 << 20
GIB: Final = 1 << 30

#: Default of limits.max_run_result_bytes.
DEFAULT_RUN_RESULT_BYTES: Final = 16 * MIB


class ServiceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[daemon]`` section: the process itself."""

    level: Literal[3, 4] = 3
    """3 = node (one host: chips and SUB workers), 4 = pod parent of L3 workers."""
    runtime_dir: str = ""
    """Socket and state directory; "" = ``default_runtime_dir()`` (``$XDG_RUNTIME_DIR``,
    ``/run/user/<uid>``, ``/run`` for root, else ``/tmp/simpler-daemon-<uid>``)."""
    state_dir: str = ""
    """Where the run history lives (``runs.sqlite3``, server/history.py); "" =
    ``$STATE_DIRECTORY`` under systemd, else ``$XDG_STATE_HOME/simpler-daemon``, else
    ``~/.local/state/simpler-daemon``; ``":memory:"`` = keep no history."""
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


class RemoteSessionConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The settings of a session on a simpler-remote-worker that a ``[[workers.remote]]``
    table and ``[workers.discovery]`` share (one parser and one check for both:
    ``config._check_remote_settings``, ``topology.remote_spec_of``)."""

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
    """Name checked against the worker's certificate; "" = the endpoint's host (for a
    discovered worker: its address, so set the name its certificate carries)."""
    callables: list[RemoteCallableConfig] = []


class RemoteWorkerConfig(
    RemoteSessionConfig, frozen=True, forbid_unknown_fields=True, kw_only=True
):
    """One ``[[workers.remote]]`` table (level 4): a session on a simpler-remote-worker."""

    endpoint: str
    """"IP:PORT" (or "localhost:PORT") of the simpler-remote-worker; host names are
    not resolved (``[workers.discovery]`` resolves a DNS name)."""


class DiscoveryConfig(RemoteSessionConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[workers.discovery]`` table (level 4): remote workers found by DNS.

    Every address ``dns`` resolves to becomes a remote worker with the session settings
    of this table (those of a ``[[workers.remote]]`` table, without ``endpoint``);
    one whose address leaves the answer is retired (server/discovery.py)."""

    dns: str = ""
    """"NAME:PORT" to resolve (a headless Service's name); "" = no discovery."""
    refresh_s: float = 10.0
    """Seconds between two resolutions (> 0)."""
    nameserver: str = ""
    """"" = the system resolver (getaddrinfo, in a thread: A and AAAA records, search
    domains apply); "IP" or "IP:PORT" = ask this DNS server directly over UDP for A
    records of the name as written (port 53 by default)."""


class ReconnectConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[reconnect]`` section (level 4): how the session of a remote worker
    that failed is reopened (``ReconnectPolicy``). The first attempt starts at once;
    after the n-th failed one the next waits ``initial_s * 2**(n-1)``, at most
    ``max_s``, shortened by up to a fifth at random."""

    initial_s: float = 0.5
    """Seconds after the first failed attempt."""
    max_s: float = 10.0
    """The longest wait between two attempts."""
    max_elapsed_s: float = 0.0
    """Give the worker up once the next attempt would start later than this after
    the failure (its work then fails at once, for good); 0 = reconnect forever."""


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
    discovery: DiscoveryConfig = msgspec.field(default_factory=DiscoveryConfig)
    """Level 4: ``[workers.discovery]``, remote workers found by resolving a DNS name."""
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


class LimitsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[limits]`` section: every size and count a client controls is bounded."""

    max_message_bytes: int = 64 * MIB
    max_tasks_per_run: int = 100_000
    max_tensors_per_task: int = 256
    max_scalars_per_task: int = 128
    max_value_bytes: int = 64 * MIB
    """Bytes one task's values and kwargs may take together, msgpack-encoded (a task past
    it is refused at submit, INVALID_ARGUMENT naming the field, its size and this limit)."""
    max_result_bytes: int = 64 * MIB
    """Bytes one SUB task's return value may take msgpack-encoded (past it the task
    fails, TASK_FAILURE naming its size and this limit). A run's results together are
    bounded by max_run_result_bytes too."""
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
    max_finished_run_age: float = 0.0
    """Seconds a finished run is kept after it ended (in memory and in the run history);
    older ones are forgotten, oldest first. 0 = no age limit (the count and byte limits
    still apply)."""
    max_group_members: int = 65_536
    """Members of one SUB_GROUP / NEXT_LEVEL_GROUP task."""
    per_client_runs: int = 128
    """Active runs of one client identity (``Identity.owner``); below max_concurrent_runs
    so that one client cannot take every run slot. Runs past it wait QUEUED in the
    client's queue (per_client_queued_runs) and start in order as its active runs end."""
    per_client_queued_runs: int = 10_000
    """Runs of one client identity waiting QUEUED for one of its per_client_runs slots;
    past it SubmitRun / RunOrchestration fail RESOURCE_EXHAUSTED naming this limit, with
    a retry-after hint (the client libraries back off and retry)."""
    per_client_heap_bytes: int = 128 * MIB
    """Bytes of heap buffers one client identity may hold at once (freed buffers stop
    counting; a client's buffers outlive its connection and keep counting)."""
    per_client_registrations: int = 256
    """Callable registrations (references) one client identity may hold at once: the
    live ones (those of a client session count until it ends, see session_ttl)."""
    per_client_sessions: int = 1024
    """Client sessions (KeepSession leases: one per client that registered) one client
    identity may hold open at once."""
    session_ttl: float = 30.0
    """Seconds the session of a client that renews (over TCP, and an AsyncClient over
    gRPC: every third of it) lives without a renewal: a client whose host or network
    vanished without closing the connection loses its session's registrations after
    this long. Local blocking clients need none (the kernel reports the end of a Unix
    connection)."""
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
    costs up to this much CPU per task, none while idle (the Worker's child_spin_ns). A
    worker whose spins catch almost no task (tasks further apart) parks at once but for
    a probe now and then. Both spins are read at start: a change needs a restart."""
    sub_queue_depth: int = 2
    """Tasks a SUB worker holds: 2 queues the next task in a second mailbox frame while
    one runs, so the worker starts it without waiting for the daemon (a queued task that
    has not started moves to a worker that frees up first); 1 hands a task over only to
    a free worker (the Worker's sub_queue_depth). Read at start."""


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
    max_connections: int = 1024
    """Connections served at once (1..65536); past it a new one is closed at once."""
    frame_timeout: float = 30.0
    """Seconds a connection may hold a partly received frame before it is dropped."""


class MetricsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[metrics]`` section."""

    listen: str = ""
    """"host:port" of the Prometheus ``/metrics`` listener; "" = off."""
    token_file: str = ""
    """Set: scrapes must send ``Authorization: Bearer <token>`` (the file's content, at
    least 16 bytes, mode 0600); "" = no token (keep ``listen`` on loopback then)."""


class DashboardConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[dashboard]`` section: the live status page (server/dashboard.py)."""

    enabled: bool = False
    """Serve the read-only status page and its JSON (``/``, ``/api/...``) on
    ``metrics.listen``, behind ``metrics.token_file`` like ``/metrics``."""


class HealthConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[health]`` section: what the daemon does when a worker pool has no live
    worker left and none is being replaced (server/health.py)."""

    unhealthy_exit_s: float = 60.0
    """Seconds the daemon may stay unhealthy (health NOT_SERVING) before it stops its
    systemd watchdog pings, so that systemd (``WatchdogSec=``) restarts it; the pings
    resume if capacity returns first. 0 = never stop them (report only)."""
    probe_listen: str = ""
    """"host:port" of a plain-text gRPC listener that serves the gRPC health service and
    nothing else (no TLS, no token: it tells only whether the daemon serves), for
    probes that cannot present credentials, such as a Kubernetes ``grpc:`` probe.
    Empty: off."""


class DaemonConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration; decode with ``msgspec.toml.decode(data, type=DaemonConfig)``
    or, with layering and validation, :func:`load`."""

    daemon: ServiceConfig = msgspec.field(default_factory=ServiceConfig)
    workers: WorkersConfig = msgspec.field(default_factory=WorkersConfig)
    grpc: GrpcConfig = msgspec.field(default_factory=GrpcConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    callables: CallablesConfig = msgspec.field(default_factory=CallablesConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    dashboard: DashboardConfig = msgspec.field(default_factory=DashboardConfig)
    fast: FastConfig = msgspec.field(default_factory=FastConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    reconnect: ReconnectConfig = msgspec.field(default_factory=ReconnectConfig)
