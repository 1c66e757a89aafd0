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
Loading has no side effects: nothing is created, bound or imported here.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from typing import Any, Final, Literal, get_args, get_origin

import msgspec

from simpler_daemon.errors import ConfigError

__all__ = [
    "DEFAULT_CONFIG_TOML",
    "ENV_PREFIX",
    "GIB",
    "MIB",
    "CallablesConfig",
    "DaemonConfig",
    "GrpcConfig",
    "LimitsConfig",
    "MetricsConfig",
    "RemoteCallableConfig",
    "RemoteWorkerConfig",
    "ServiceConfig",
    "WorkersConfig",
    "default_runtime_dir",
    "dump",
    "load",
    "parse_host_port",
    "resolve",
    "validate",
]

KIB: Final = 1 << 10
MIB: Final = 1 << 20
GIB: Final = 1 << 30

#: Environment variables ``SIMPLER_DAEMON__SECTION__KEY`` override the file.
ENV_PREFIX: Final = "SIMPLER_DAEMON__"

# gRPC message size options are C ints.
_GRPC_MAX_MESSAGE: Final = (1 << 31) - 1
# sun_path is 108 bytes including the terminating NUL.
_UNIX_PATH_MAX: Final = 107

_IDENT: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PORT: Final = re.compile(r"[0-9]{1,5}\Z")


class ServiceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[daemon]`` section: the process itself."""

    level: Literal[3, 4] = 3
    """3 = node (one host: chips and SUB workers), 4 = pod parent of L3 workers."""
    runtime_dir: str = ""
    """Socket and state directory; "" = ``$XDG_RUNTIME_DIR/simpler-daemon``, else
    ``/tmp/simpler-daemon-<uid>``."""
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


class WorkersConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[workers]`` section: the pre-forked pools."""

    num_sub_workers: int = 0
    """SUB worker processes; 0 = one per CPU available to the daemon at level 3, none
    at level 4 (a pod parent's work runs on its L3 workers)."""
    num_chips: int = 2
    """Simulated chip children (NEXT_LEVEL workers 0..num_chips-1)."""
    chip_pipeline_depth: Literal[1, 2] = 2
    heap_bytes: int = 256 * MIB
    """Size of the shared heap that tensors live in."""
    heap_shared: bool = True
    """Expose the heap as /dev/shm/simpler-heap-<pid>-<id> so local clients running as
    the daemon's user map buffers zero-copy (Client.map_buffer); unlinked at stop,
    swept at start if a crashed daemon left it."""
    remote: list[RemoteWorkerConfig] = []
    """Level 4: ``[[workers.remote]]`` sessions opened at start (NEXT_LEVEL workers)."""
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
    max_buffer_bytes: int = 1 * GIB
    max_concurrent_runs: int = 256
    max_streams_per_client: int = 16
    max_finished_runs_kept: int = 10_000


def _default_allowed_modules() -> list[str]:
    return ["simpler_daemon.examples"]


class CallablesConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[callables]`` section: which code clients may register by import path."""

    allowed_modules: list[str] = msgspec.field(default_factory=_default_allowed_modules)
    """A module is allowed when it equals an entry or lies below one (``entry.``)."""
    preload: list[str] = []
    """``module:qualname`` paths registered at start; each must be allowed."""

    def allows(self, module: str) -> bool:
        """Whether ``module`` may be imported on a client's behalf."""
        return any(
            module == entry or module.startswith(entry + ".") for entry in self.allowed_modules
        )


class MetricsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[metrics]`` section."""

    listen: str = ""
    """"host:port" of the Prometheus ``/metrics`` listener; "" = off."""


class DaemonConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration; decode with ``msgspec.toml.decode(data, type=DaemonConfig)``
    or, with layering and validation, :func:`load`."""

    daemon: ServiceConfig = msgspec.field(default_factory=ServiceConfig)
    workers: WorkersConfig = msgspec.field(default_factory=WorkersConfig)
    grpc: GrpcConfig = msgspec.field(default_factory=GrpcConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    callables: CallablesConfig = msgspec.field(default_factory=CallablesConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)


#: The configuration used when no file is given; equal to ``DaemonConfig()``.
DEFAULT_CONFIG_TOML: Final = """\
# simpler-daemon embedded default configuration.
# Works on a fresh machine: level 3, one SUB worker per CPU, 2 simulated chips,
# gRPC on a Unix socket in the runtime directory, no TCP listener, metrics off.

[daemon]
level = 3
runtime_dir = ""            # "" = $XDG_RUNTIME_DIR/simpler-daemon or /tmp/simpler-daemon-<uid>
startup_timeout = 30.0
shutdown_grace = 30.0
log_format = "text"
log_level = "info"
watchdog = true

[workers]
num_sub_workers = 0         # 0 = one per CPU
num_chips = 2
chip_pipeline_depth = 2
heap_bytes = 268435456      # 256 MiB
heap_shared = true          # /dev/shm name local clients can map
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

[callables]
allowed_modules = ["simpler_daemon.examples"]
preload = []

[metrics]
listen = ""
"""

_SECTIONS: Final[dict[str, type[msgspec.Struct]]] = {
    f.encode_name: f.type for f in msgspec.structs.fields(DaemonConfig)
}


# --------------------------------------------------------------------------- errors


class _Invalid(Exception):
    """A problem with one setting; ``load`` adds the file and the value's origin.

    The message reads ``before + key + <origin> + after``.
    """

    def __init__(self, key: str, after: str, before: str = "") -> None:
        super().__init__(key)
        self.key = key
        self.after = after
        self.before = before

    def text(self, origin: str = "") -> str:
        return f"{self.before}{self.key}{origin}{self.after}"


def _field_type(section: str, key: str) -> Any:
    cls = _SECTIONS.get(section)
    if cls is None:
        return None
    for f in msgspec.structs.fields(cls):
        if f.encode_name == key:
            return f.type
    return None


def _path_type(path: str) -> Any:
    """The annotated type at a dotted path such as ``workers.remote[0].callables[1].kind``."""
    current: Any = DaemonConfig
    for part in path.split("."):
        name = part.partition("[")[0]
        if not (isinstance(current, type) and issubclass(current, msgspec.Struct)):
            return None
        current = next(
            (f.type for f in msgspec.structs.fields(current) if f.encode_name == name), None
        )
        if "[" in part and get_origin(current) is list:
            current = get_args(current)[0]
    return current


def _from_validation_error(exc: msgspec.ValidationError) -> _Invalid:
    """Turn ``Expected `int`, got `str` - at `$.limits.x``` into a key and a problem."""
    message = str(exc)
    problem, sep, where = message.partition(" - at `$")
    path = where.rstrip("`").lstrip(".") if sep else ""
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", problem)
    if unknown:
        key = f"{path}.{unknown[1]}" if path else unknown[1]
        return _Invalid(key, "", before="unknown key ")
    missing = re.fullmatch(r"Object missing required field `(.*)`", problem)
    if missing:
        key = f"{path}.{missing[1]}" if path else missing[1]
        return _Invalid(key, ": required")
    problem = problem.replace("`object`", "table").replace("`", "")
    ftype = _path_type(path)
    if problem.startswith("Invalid enum value") and get_origin(ftype) is Literal:
        choices = ", ".join(repr(c) for c in get_args(ftype))
        problem = f"{problem} (choose one of {choices})"
    return _Invalid(path or "config", f": {problem}")


# --------------------------------------------------------------------------- helpers


def parse_host_port(text: str, *, key: str = "address") -> tuple[str, int]:
    """Split ``"host:port"`` (``"[::1]:9090"`` for IPv6) into ``(host, port)``.

    Raises ``ConfigError`` naming ``key`` when the host is empty, an IPv6 host
    is not bracketed, or the port is not an integer in 0..65535.
    """
    try:
        return _split_host_port(text)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}", key=key) from None


def _split_host_port(text: str) -> tuple[str, int]:
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not host:port")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"{text!r}: unbalanced brackets around the host")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: an IPv6 host must be in brackets, e.g. [::1]:{port_text}")
    if not _PORT.match(port_text) or int(port_text) > 65535:
        raise ValueError(f"{text!r}: the port must be an integer in 0..65535")
    return host, int(port_text)


def _split_import_path(text: str) -> tuple[str, str]:
    parts = text.strip().split(":")
    if len(parts) != 2:
        raise ValueError(f"{text!r} must be 'module:qualname' with exactly one colon")
    module, qualname = parts
    if not _is_dotted(module):
        raise ValueError(f"{text!r}: module {module!r} must be an absolute dotted name")
    if not _is_dotted(qualname):
        raise ValueError(f"{text!r}: qualname {qualname!r} must be dotted identifiers")
    return module, qualname


def _is_dotted(name: str) -> bool:
    return bool(name) and all(_IDENT.match(part) for part in name.split("."))


def default_runtime_dir(env: Mapping[str, str] | None = None) -> str:
    """``$XDG_RUNTIME_DIR/simpler-daemon`` when that is set, else ``/tmp/simpler-daemon-<uid>``."""
    env = os.environ if env is None else env
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "simpler-daemon")
    return f"/tmp/simpler-daemon-{os.getuid()}"


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
    return replace(config, daemon=service, grpc=grpc, workers=workers)


# --------------------------------------------------------------------------- validation


def validate(config: DaemonConfig) -> None:
    """Check ranges and cross-field rules; ``ConfigError`` naming the key on the first problem."""
    try:
        _check(config)
    except _Invalid as exc:
        raise ConfigError(exc.text(), key=exc.key) from None


def _check(config: DaemonConfig) -> None:
    service, workers, grpc = config.daemon, config.workers, config.grpc

    if not (math.isfinite(service.startup_timeout) and service.startup_timeout > 0):
        raise _Invalid("daemon.startup_timeout", f": must be > 0, got {service.startup_timeout}")
    if not (math.isfinite(service.shutdown_grace) and service.shutdown_grace >= 0):
        raise _Invalid("daemon.shutdown_grace", f": must be >= 0, got {service.shutdown_grace}")
    _check_path("daemon.runtime_dir", service.runtime_dir)

    for name in ("num_sub_workers", "num_chips"):
        if getattr(workers, name) < 0:
            raise _Invalid(f"workers.{name}", f": must be >= 0, got {getattr(workers, name)}")
    if workers.heap_bytes <= 0:
        raise _Invalid("workers.heap_bytes", f": must be > 0, got {workers.heap_bytes}")
    _check_path("workers.remote_credentials_dir", workers.remote_credentials_dir)
    if workers.remote and service.level != 4:
        raise _Invalid(
            "workers.remote",
            f": [[workers.remote]] tables need daemon.level = 4 (it is {service.level})",
        )
    for i, remote in enumerate(workers.remote):
        _check_remote(f"workers.remote[{i}]", remote)

    _check_path("grpc.unix_socket", grpc.unix_socket)
    if len(os.fsencode(grpc.unix_socket)) > _UNIX_PATH_MAX:
        raise _Invalid(
            "grpc.unix_socket",
            f": {grpc.unix_socket!r} is {len(os.fsencode(grpc.unix_socket))} bytes, "
            f"a Unix socket path may have at most {_UNIX_PATH_MAX}",
        )
    if not 0 <= grpc.socket_mode <= 0o777:
        raise _Invalid("grpc.socket_mode", f": {grpc.socket_mode:#o} is outside 0o000..0o777")
    if grpc.tcp_listen:
        _check_host_port("grpc.tcp_listen", grpc.tcp_listen)
        if not (grpc.tls_cert and grpc.tls_key):
            raise _Invalid(
                "grpc.tcp_listen",
                " requires grpc.tls_cert and grpc.tls_key: a TCP listener is refused without TLS",
            )
        if not grpc.token_file:
            raise _Invalid(
                "grpc.tcp_listen",
                " requires grpc.token_file: a TCP listener is refused without a bearer token",
            )
    elif grpc.tls_client_ca:
        raise _Invalid(
            "grpc.tls_client_ca", " requires grpc.tcp_listen: client certificates apply to TCP only"
        )

    for f in msgspec.structs.fields(LimitsConfig):
        value = getattr(config.limits, f.name)
        if value <= 0:
            raise _Invalid(f"limits.{f.name}", f": must be > 0, got {value}")
    if config.limits.max_message_bytes > _GRPC_MAX_MESSAGE:
        raise _Invalid(
            "limits.max_message_bytes",
            f": must be at most {_GRPC_MAX_MESSAGE} (gRPC's limit), "
            f"got {config.limits.max_message_bytes}",
        )

    callables = config.callables
    for i, entry in enumerate(callables.allowed_modules):
        if not _is_dotted(entry):
            raise _Invalid(
                f"callables.allowed_modules[{i}]", f": {entry!r} is not a dotted module name"
            )
    for i, target in enumerate(callables.preload):
        try:
            module, _ = _split_import_path(target)
        except ValueError as exc:
            raise _Invalid(f"callables.preload[{i}]", f": {exc}") from None
        if not callables.allows(module):
            allowed = ", ".join(callables.allowed_modules) or "nothing"
            raise _Invalid(
                f"callables.preload[{i}]",
                f": module {module!r} is not under callables.allowed_modules ({allowed})",
            )

    if config.metrics.listen:
        _check_host_port("metrics.listen", config.metrics.listen)


def _check_remote(key: str, remote: RemoteWorkerConfig) -> None:
    # Imported here: loading a config without remote tables needs none of the engine.
    from simpler_daemon.remote.spec import parse_endpoint

    try:
        parse_endpoint(remote.endpoint, "endpoint")
    except ValueError as exc:
        raise _Invalid(f"{key}.endpoint", f": {str(exc).partition(': ')[2] or exc}") from None
    for name in ("num_sub_workers", "num_chips"):
        if getattr(remote, name) < 0:
            raise _Invalid(f"{key}.{name}", f": must be >= 0, got {getattr(remote, name)}")
    if remote.num_sub_workers == 0 and remote.num_chips == 0:
        raise _Invalid(
            f"{key}.num_sub_workers", ": the remote L3 needs num_sub_workers or num_chips > 0"
        )
    if remote.heap_bytes <= 0:
        raise _Invalid(f"{key}.heap_bytes", f": must be > 0, got {remote.heap_bytes}")
    timeout = remote.session_timeout_s
    if not (math.isfinite(timeout) and timeout > 0):
        raise _Invalid(f"{key}.session_timeout_s", f": must be > 0, got {timeout}")
    for name in ("token_file", "tls_ca_file", "tls_cert_file", "tls_key_file"):
        _check_path(f"{key}.{name}", getattr(remote, name))
    if bool(remote.tls_cert_file) != bool(remote.tls_key_file):
        missing = "tls_key_file" if remote.tls_cert_file else "tls_cert_file"
        raise _Invalid(
            f"{key}.{missing}", ": tls_cert_file and tls_key_file go together (mutual TLS)"
        )
    for name in ("tls_cert_file", "tls_server_name"):
        if getattr(remote, name) and not remote.tls_ca_file:
            raise _Invalid(f"{key}.{name}", f" requires {key}.tls_ca_file (TLS to the worker)")
    for j, entry in enumerate(remote.callables):
        try:
            _split_import_path(entry.target)
        except ValueError as exc:
            raise _Invalid(f"{key}.callables[{j}].target", f": {exc}") from None


def _check_path(key: str, path: str) -> None:
    if path and not os.path.isabs(path):
        raise _Invalid(key, f": {path!r} must be an absolute path")
    if "\0" in path:
        raise _Invalid(key, ": contains a NUL byte")


def _check_host_port(key: str, text: str) -> None:
    try:
        _split_host_port(text)
    except ValueError as exc:
        raise _Invalid(key, f": {exc}") from None


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
    env = os.environ if env is None else env
    where = f" {os.fspath(path)}" if path is not None else ""
    if path is None:
        text = DEFAULT_CONFIG_TOML
    else:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise ConfigError(f"cannot read config{where}: {exc.strerror or exc}") from exc
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"cannot parse config{where}: not UTF-8: {exc}") from exc
    try:
        raw: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cannot parse config{where}: {exc}") from exc

    # Where a value came from when it was not the file; named in error messages.
    origins: dict[str, str] = {}

    def fail(exc: _Invalid) -> ConfigError:
        base = exc.key.partition("[")[0]
        origin = origins.get(base, "")
        if not origin:
            origin = next((o for k, o in origins.items() if k.startswith(base + ".")), "")
        return ConfigError(f"cannot load config{where}: {exc.text(origin)}", key=exc.key)

    def put(section: str, key: str, value: object, origin: str) -> None:
        table = raw.get(section)
        if not isinstance(table, dict):
            table = raw[section] = {}
        table[key] = value
        origins[f"{section}.{key}"] = origin

    for name in sorted(env):
        if not name.startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX) :].split("__")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(
                f"cannot load config{where}: environment variable {name}: "
                f"expected {ENV_PREFIX}<SECTION>__<KEY>",
                key=name,
            )
        section, key = parts[0].lower(), parts[1].lower()
        put(
            section,
            key,
            _parse_value(section, key, env[name]),
            f" (from environment variable {name})",
        )

    for dotted, value in (overrides or {}).items():
        section, dot, key = dotted.partition(".")
        if not (section and dot and key) or "." in key:
            raise ConfigError(
                f"cannot load config{where}: override {dotted!r}: expected section.key",
                key=dotted,
            )
        if isinstance(value, str):
            value = _parse_value(section, key, value)
        put(section, key, value, " (from override)")

    try:
        config = msgspec.convert(raw, type=DaemonConfig)
    except msgspec.ValidationError as exc:
        raise fail(_from_validation_error(exc)) from None
    try:
        _check(config)
        config = resolve(config, env)
        _check(config)  # the derived socket path must fit too
    except _Invalid as exc:
        raise fail(exc) from None
    return config


def _parse_value(section: str, key: str, text: str) -> object:
    """A TOML value when ``text`` is one, else the text itself; ``str`` settings keep the text
    unless it is a quoted TOML string."""
    try:
        parsed = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    if set(parsed) != {"v"}:
        return text
    value = parsed["v"]
    if _field_type(section, key) is str and not isinstance(value, str):
        return text
    return value


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
    if isinstance(value, msgspec.Struct):  # a [[workers.remote]] table, written inline
        items = [
            f"{f.encode_name} = {_toml_value(getattr(value, f.name))}"
            for f in msgspec.structs.fields(value)
        ]
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")
