"""``simpler-remote-worker`` configuration: frozen, typed settings and the step that loads them.

Layers, later wins (the same scheme as ``simpler-daemon``)::

    struct defaults
      <- the file given to load() (none: the defaults alone)
      <- environment variables  SIMPLER_REMOTE_WORKER__<SECTION>__<KEY>=<value>
      <- overrides              {"worker.listen": "0.0.0.0:19073"}    (--listen, --set, ...)
         |
         v  msgspec.convert: types, Literal choices, unknown keys
         v  validate():      ranges, paths, and the rule that a listener reachable from
                             other hosts needs TLS and a token (unless insecure=True)

Every failure is a ``ConfigError`` whose ``key`` is the dotted setting. Loading has no
side effects; :func:`load_credentials` reads the token and certificate files at start.
The layering itself is :mod:`simpler_daemon.system.configfile`; this module holds the structs
and rules.
"""

from __future__ import annotations

import ipaddress
import math
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

import msgspec

from simpler_daemon.errors import ConfigError
from simpler_daemon.remote.manifest import (
    MAX_MANIFEST_BYTES,
    ManifestLimits,
    module_allowed,
)
from simpler_daemon.system.authguard import check_private_file, read_token_file
from simpler_daemon.system.configfile import (
    ConfigSchema,
    Invalid,
    check_host_port,
    check_module_names,
    check_path,
    default_allowed_modules,
    parse_host_port,
)

__all__ = [
    "DEFAULT_LISTEN",
    "DEFAULT_PORT",
    "ENV_PREFIX",
    "AuthConfig",
    "CallablesConfig",
    "Credentials",
    "RemoteWorkerConfig",
    "SessionsConfig",
    "TlsConfig",
    "WorkerSection",
    "is_loopback",
    "load",
    "load_credentials",
    "manifest_limits",
    "server_ssl_context",
    "validate",
]

DEFAULT_PORT: Final = 19073
DEFAULT_LISTEN: Final = f"127.0.0.1:{DEFAULT_PORT}"
#: Environment variables ``SIMPLER_REMOTE_WORKER__SECTION__KEY`` override the file.
ENV_PREFIX: Final = "SIMPLER_REMOTE_WORKER__"

_GIB: Final = 1 << 30


class WorkerSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[worker]`` section: the service process."""

    listen: str = DEFAULT_LISTEN
    """"host:port" parents connect to; runners bind their session ports on the same host.
    Anything but loopback requires TLS and a token (or ``--insecure``)."""
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    watchdog: bool = True
    """Ping the systemd watchdog from the event loop when systemd asks for it."""
    shutdown_grace: float = 10.0
    """On SIGTERM: seconds runners get to close their sessions before SIGKILL."""
    spec_dir: str = ""
    """Where the private (0600) runner spec files are written; "" = the temp directory."""


class AuthConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[auth]`` section."""

    token_file: str = ""
    """File holding the bearer token parents send (surrounding whitespace stripped);
    must not be readable by others. "" = no token: parents send an empty one."""


class TlsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[tls]`` section: TLS for the handshake and every session's connections."""

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""
    """Set: mutual TLS, parents must present a certificate issued by this CA."""


class SessionsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[sessions]`` section: every size and count a parent controls is bounded."""

    max: int = 16
    """Concurrent sessions (runner processes)."""
    max_connections: int = 64
    """Connections in their handshake at once. A new one beyond it closes the oldest
    unauthenticated handshake (of the source with the most); it is refused only when
    every handshake has authenticated already."""
    max_connections_per_source: int = 16
    """Connections from one source address in their handshake at once, counted from
    accept (before TLS); a new one beyond it closes that source's oldest
    unauthenticated handshake."""
    handshake_timeout: float = 10.0
    """Seconds a connection has, from accept, to complete TLS, authenticate and send its
    manifest; then it is closed."""
    max_manifest_bytes: int = MAX_MANIFEST_BYTES
    max_callables: int = 256
    """Callables one manifest may install."""
    max_sub_workers: int = 64
    max_chips: int = 16
    max_heap_bytes: int = 4 * _GIB
    max_session_timeout: float = 3600.0
    """Upper bound of a manifest's session_timeout_s."""
    max_startup: float = 300.0
    """Upper bound of a session's start-up: a larger budget in a manifest is cut to this."""
    kill_grace: float = 2.0
    """Seconds between SIGTERM and SIGKILL when a runner failed to start."""


class CallablesConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[callables]`` section: which code a session may install."""

    allowed_modules: list[str] = msgspec.field(default_factory=default_allowed_modules)
    """A module is allowed when it equals an entry or lies below one (``entry.``)."""
    python_path: list[str] = []
    """Absolute, existing directories put in front of the runners' import path. The
    runner starts isolated (``python -I``): neither the working directory nor
    PYTHON* variables reach its ``sys.path``; these entries are added explicitly."""

    def allows(self, module: str) -> bool:
        return module_allowed(module, self.allowed_modules)


class RemoteWorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration; load it with :func:`load`."""

    worker: WorkerSection = msgspec.field(default_factory=WorkerSection)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    tls: TlsConfig = msgspec.field(default_factory=TlsConfig)
    sessions: SessionsConfig = msgspec.field(default_factory=SessionsConfig)
    callables: CallablesConfig = msgspec.field(default_factory=CallablesConfig)

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls.cert_file)

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_host_port(self.worker.listen, key="worker.listen")


_SCHEMA: Final = ConfigSchema(
    root=RemoteWorkerConfig,
    env_prefix=ENV_PREFIX,
    env_origin=" (from {name})",
    override_origin=" (from the command line)",
)


def manifest_limits(config: RemoteWorkerConfig) -> ManifestLimits:
    """The bounds :func:`~simpler_daemon.remote.manifest.validate_manifest` applies."""
    s = config.sessions
    return ManifestLimits(
        allowed_modules=tuple(config.callables.allowed_modules),
        max_callables=s.max_callables,
        max_sub_workers=s.max_sub_workers,
        max_chips=s.max_chips,
        max_heap_bytes=s.max_heap_bytes,
        max_session_timeout_s=s.max_session_timeout,
    )


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and 127.0.0.0/8 / ::1 literals; a hostname is not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------------------- validation


def validate(config: RemoteWorkerConfig, *, insecure: bool = False) -> None:
    """Check ranges and cross-field rules; ``ConfigError`` naming the key on the first problem.

    ``insecure`` (``--insecure``) lifts the rule that a non-loopback listener needs both
    TLS and a token.
    """
    try:
        _check(config, insecure)
    except Invalid as exc:
        raise exc.error() from None


def _check(config: RemoteWorkerConfig, insecure: bool) -> None:
    w, tls, s = config.worker, config.tls, config.sessions
    host, _ = check_host_port("worker.listen", w.listen)
    if not (math.isfinite(w.shutdown_grace) and w.shutdown_grace >= 0):
        raise Invalid("worker.shutdown_grace", f": must be >= 0, got {w.shutdown_grace}")
    check_path("worker.spec_dir", w.spec_dir)

    check_path("auth.token_file", config.auth.token_file)
    for name in ("cert_file", "key_file", "client_ca_file"):
        check_path(f"tls.{name}", getattr(tls, name))
    if bool(tls.cert_file) != bool(tls.key_file):
        missing = "tls.key_file" if tls.cert_file else "tls.cert_file"
        given = "tls.cert_file" if tls.cert_file else "tls.key_file"
        raise Invalid(missing, f" is required when {given} is set")
    if tls.client_ca_file and not tls.cert_file:
        raise Invalid(
            "tls.client_ca_file", " requires tls.cert_file and tls.key_file (mutual TLS is TLS)"
        )

    for name in (
        "max",
        "max_connections",
        "max_connections_per_source",
        "max_manifest_bytes",
        "max_heap_bytes",
    ):
        if getattr(s, name) <= 0:
            raise Invalid(f"sessions.{name}", f": must be > 0, got {getattr(s, name)}")
    for name in ("max_callables", "max_sub_workers", "max_chips"):
        if getattr(s, name) < 0:
            raise Invalid(f"sessions.{name}", f": must be >= 0, got {getattr(s, name)}")
    if s.max_manifest_bytes > MAX_MANIFEST_BYTES:
        raise Invalid(
            "sessions.max_manifest_bytes",
            f": must be at most {MAX_MANIFEST_BYTES} (the protocol's limit), "
            f"got {s.max_manifest_bytes}",
        )
    for name in ("handshake_timeout", "max_session_timeout", "max_startup"):
        value = getattr(s, name)
        if not (math.isfinite(value) and value > 0):
            raise Invalid(f"sessions.{name}", f": must be > 0, got {value}")
    if not (math.isfinite(s.kill_grace) and s.kill_grace >= 0):
        raise Invalid("sessions.kill_grace", f": must be >= 0, got {s.kill_grace}")

    # "pkg." is allowed too: module_allowed() strips the dot.
    check_module_names(
        "callables.allowed_modules", config.callables.allowed_modules, trailing_dot=True
    )
    for i, path in enumerate(config.callables.python_path):
        _check_import_dir(f"callables.python_path[{i}]", path)

    if not is_loopback(host) and not insecure:
        lacking = [
            what
            for what, have in (
                ("TLS (tls.cert_file, tls.key_file)", config.tls_enabled),
                ("a token (auth.token_file)", bool(config.auth.token_file)),
            )
            if not have
        ]
        if lacking:
            raise Invalid(
                "worker.listen",
                f": {w.listen} is reachable from other hosts but {' and '.join(lacking)} "
                f"{'is' if len(lacking) == 1 else 'are'} not configured; anyone who can reach "
                "the port could run code as this user. Configure TLS and a token, or pass "
                "--insecure on a trusted network",
            )


def _check_import_dir(key: str, path: str) -> None:
    """``path`` is an absolute directory this user may list and enter: the runners
    import job modules from it."""
    if not path:
        raise Invalid(key, ": is empty")
    check_path(key, path)
    if ":" in path:
        raise Invalid(key, f": {path!r} contains ':', the PYTHONPATH separator")
    if not os.path.exists(path):
        raise Invalid(key, f": {path!r} does not exist")
    if not os.path.isdir(path):
        raise Invalid(key, f": {path!r} is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise Invalid(key, f": {path!r} is not readable by uid {os.getuid()}")


# --------------------------------------------------------------------------- loading


def load(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
    insecure: bool = False,
) -> RemoteWorkerConfig:
    """Merge defaults <- file <- environment <- overrides and validate.

    ``env`` defaults to ``os.environ`` (only ``SIMPLER_REMOTE_WORKER__SECTION__KEY`` is
    read); values and string overrides are parsed as TOML values when possible, else
    taken as text. ``overrides`` maps dotted keys (``"worker.listen"``) to values.
    Raises ``ConfigError`` (``key`` = the dotted setting) naming the file.
    """
    environ = os.environ if env is None else env

    def finish(config: RemoteWorkerConfig) -> RemoteWorkerConfig:
        _check(config, insecure)
        return config

    return _SCHEMA.load(path, env=environ, overrides=overrides, finish=finish)


# --------------------------------------------------------------------------- credentials


@dataclass(frozen=True, slots=True)
class Credentials:
    """What :func:`load_credentials` read: the token (b"" = none) and the server TLS context."""

    token: bytes
    ssl_context: ssl.SSLContext | None


def load_credentials(config: RemoteWorkerConfig) -> Credentials:
    """Read the token file and build the TLS context; ``ConfigError`` naming the key.

    A token or key file its group or others may read is refused, and so is a token
    shorter than ``MIN_TOKEN_BYTES``: the token is the only thing between the network
    and code execution.
    """
    token = b""
    if config.auth.token_file:
        token = _read_token(config.auth.token_file)
    context: ssl.SSLContext | None = None
    if config.tls_enabled:
        context = server_ssl_context(config.tls)
    return Credentials(token, context)


def _read_token(path: str) -> bytes:
    # At least MIN_TOKEN_BYTES, mode 0600 (no group or other bits): authguard's rules.
    return read_token_file(path, "auth.token_file")


def server_ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """A TLS >= 1.2 server context; with ``client_ca_file`` clients must present a cert."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"tls.cert_file: cannot load {tls.cert_file} with key {tls.key_file}: {exc}",
            key="tls.cert_file",
        ) from exc
    check_private_file(tls.key_file, "tls.key_file")
    if tls.client_ca_file:
        try:
            context.load_verify_locations(cafile=tls.client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"tls.client_ca_file: cannot load {tls.client_ca_file}: {exc}",
                key="tls.client_ca_file",
            ) from exc
        context.verify_mode = ssl.CERT_REQUIRED
    return context
