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
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import ssl
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args, get_origin

import msgspec

from simpler_daemon.errors import ConfigError
from simpler_daemon.remote.manifest import (
    MAX_MANIFEST_BYTES,
    MAX_TOKEN_BYTES,
    ManifestLimits,
    module_allowed,
)
from simpler_daemon.server.config import parse_host_port

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
_IDENT: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


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
    """Connections in their handshake at once; more are refused at accept."""
    handshake_timeout: float = 10.0
    """Seconds a parent has to authenticate and send its manifest."""
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


def _default_allowed_modules() -> list[str]:
    return ["simpler_daemon.examples"]


class CallablesConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[callables]`` section: which code a session may install."""

    allowed_modules: list[str] = msgspec.field(default_factory=_default_allowed_modules)
    """A module is allowed when it equals an entry or lies below one (``entry.``)."""
    python_path: list[str] = []
    """Absolute directories put in front of the runners' import path (PYTHONPATH)."""

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


_SECTIONS: Final[dict[str, type[msgspec.Struct]]] = {
    f.encode_name: f.type for f in msgspec.structs.fields(RemoteWorkerConfig)
}


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


class _Invalid(Exception):
    """One bad setting; ``load`` adds the file and where the value came from."""

    def __init__(self, key: str, after: str, before: str = "") -> None:
        super().__init__(key)
        self.key, self.after, self.before = key, after, before

    def text(self, origin: str = "") -> str:
        return f"{self.before}{self.key}{origin}{self.after}"


def validate(config: RemoteWorkerConfig, *, insecure: bool = False) -> None:
    """Check ranges and cross-field rules; ``ConfigError`` naming the key on the first problem.

    ``insecure`` (``--insecure``) lifts the rule that a non-loopback listener needs both
    TLS and a token.
    """
    try:
        _check(config, insecure)
    except _Invalid as exc:
        raise ConfigError(exc.text(), key=exc.key) from None


def _check(config: RemoteWorkerConfig, insecure: bool) -> None:
    w, tls, s = config.worker, config.tls, config.sessions
    try:
        host, _ = parse_host_port(w.listen, key="worker.listen")
    except ConfigError as exc:
        raise _Invalid("worker.listen", str(exc).removeprefix("worker.listen")) from None
    if not (math.isfinite(w.shutdown_grace) and w.shutdown_grace >= 0):
        raise _Invalid("worker.shutdown_grace", f": must be >= 0, got {w.shutdown_grace}")
    _check_path("worker.spec_dir", w.spec_dir)

    _check_path("auth.token_file", config.auth.token_file)
    for name in ("cert_file", "key_file", "client_ca_file"):
        _check_path(f"tls.{name}", getattr(tls, name))
    if bool(tls.cert_file) != bool(tls.key_file):
        missing = "tls.key_file" if tls.cert_file else "tls.cert_file"
        given = "tls.cert_file" if tls.cert_file else "tls.key_file"
        raise _Invalid(missing, f" is required when {given} is set")
    if tls.client_ca_file and not tls.cert_file:
        raise _Invalid(
            "tls.client_ca_file", " requires tls.cert_file and tls.key_file (mutual TLS is TLS)"
        )

    for name in ("max", "max_connections", "max_manifest_bytes", "max_heap_bytes"):
        if getattr(s, name) <= 0:
            raise _Invalid(f"sessions.{name}", f": must be > 0, got {getattr(s, name)}")
    for name in ("max_callables", "max_sub_workers", "max_chips"):
        if getattr(s, name) < 0:
            raise _Invalid(f"sessions.{name}", f": must be >= 0, got {getattr(s, name)}")
    if s.max_manifest_bytes > MAX_MANIFEST_BYTES:
        raise _Invalid(
            "sessions.max_manifest_bytes",
            f": must be at most {MAX_MANIFEST_BYTES} (the protocol's limit), "
            f"got {s.max_manifest_bytes}",
        )
    for name in ("handshake_timeout", "max_session_timeout", "max_startup"):
        value = getattr(s, name)
        if not (math.isfinite(value) and value > 0):
            raise _Invalid(f"sessions.{name}", f": must be > 0, got {value}")
    if not (math.isfinite(s.kill_grace) and s.kill_grace >= 0):
        raise _Invalid("sessions.kill_grace", f": must be >= 0, got {s.kill_grace}")

    for i, entry in enumerate(config.callables.allowed_modules):
        name = entry[:-1] if entry.endswith(".") else entry
        if not (name and all(_IDENT.match(part) for part in name.split("."))):
            raise _Invalid(
                f"callables.allowed_modules[{i}]", f": {entry!r} is not a dotted module name"
            )
    for i, path in enumerate(config.callables.python_path):
        if not path:
            raise _Invalid(f"callables.python_path[{i}]", ": is empty")
        _check_path(f"callables.python_path[{i}]", path)
        if ":" in path:
            raise _Invalid(
                f"callables.python_path[{i}]", f": {path!r} contains ':', the PYTHONPATH separator"
            )

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
            raise _Invalid(
                "worker.listen",
                f": {w.listen} is reachable from other hosts but {' and '.join(lacking)} "
                f"{'is' if len(lacking) == 1 else 'are'} not configured; anyone who can reach "
                "the port could run code as this user. Configure TLS and a token, or pass "
                "--insecure on a trusted network",
            )


def _check_path(key: str, path: str) -> None:
    if "\0" in path:
        raise _Invalid(key, ": contains a NUL byte")
    if path and not os.path.isabs(path):
        raise _Invalid(key, f": {path!r} must be an absolute path")


def _field_type(section: str, key: str) -> Any:
    cls = _SECTIONS.get(section)
    if cls is None:
        return None
    for f in msgspec.structs.fields(cls):
        if f.encode_name == key:
            return f.type
    return None


def _from_validation_error(exc: msgspec.ValidationError) -> _Invalid:
    """``Expected `int`, got `str` - at `$.sessions.max``` -> the key and the problem."""
    problem, sep, where = str(exc).partition(" - at `$")
    path = where.rstrip("`").lstrip(".") if sep else ""
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", problem)
    if unknown:
        key = f"{path}.{unknown[1]}" if path else unknown[1]
        return _Invalid(key, "", before="unknown key ")
    problem = problem.replace("`object`", "table").replace("`", "")
    section, _, key = path.partition(".")
    ftype = _field_type(section, key.partition("[")[0])
    if problem.startswith("Invalid enum value") and get_origin(ftype) is Literal:
        choices = ", ".join(repr(c) for c in get_args(ftype))
        problem = f"{problem} (choose one of {choices})"
    return _Invalid(path or "config", f": {problem}")


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
    env = os.environ if env is None else env
    where = f" {os.fspath(path)}" if path is not None else ""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise ConfigError(f"cannot read config{where}: {exc.strerror or exc}") from exc
        try:
            raw = tomllib.loads(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"cannot parse config{where}: not UTF-8: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"cannot parse config{where}: {exc}") from exc

    # Where a value came from when it was not the file; named in error messages.
    origins: dict[str, str] = {}

    def fail(exc: _Invalid) -> ConfigError:
        base = exc.key.partition("[")[0]
        origin = origins.get(base, "")
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
        put(section, key, _parse_value(section, key, env[name]), f" (from {name})")

    for dotted, value in (overrides or {}).items():
        section, dot, key = dotted.partition(".")
        if not (section and dot and key) or "." in key:
            raise ConfigError(
                f"cannot load config{where}: override {dotted!r}: expected section.key",
                key=dotted,
            )
        if isinstance(value, str):
            value = _parse_value(section, key, value)
        put(section, key, value, " (from the command line)")

    try:
        config = msgspec.convert(raw, type=RemoteWorkerConfig)
    except msgspec.ValidationError as exc:
        raise fail(_from_validation_error(exc)) from None
    try:
        _check(config, insecure)
    except _Invalid as exc:
        raise fail(exc) from None
    return config


def _parse_value(section: str, key: str, text: str) -> object:
    """A TOML value when ``text`` is one, else the text; ``str`` settings keep the text
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


# --------------------------------------------------------------------------- credentials


@dataclass(frozen=True, slots=True)
class Credentials:
    """What :func:`load_credentials` read: the token (b"" = none) and the server TLS context."""

    token: bytes
    ssl_context: ssl.SSLContext | None


def load_credentials(config: RemoteWorkerConfig) -> Credentials:
    """Read the token file and build the TLS context; ``ConfigError`` naming the key.

    A token file readable or writable by others is refused: the token is the only
    thing between the network and code execution.
    """
    token = b""
    if config.auth.token_file:
        token = _read_token(config.auth.token_file)
    context: ssl.SSLContext | None = None
    if config.tls_enabled:
        context = server_ssl_context(config.tls)
    return Credentials(token, context)


def _read_token(path: str) -> bytes:
    key = "auth.token_file"
    try:
        with open(path, "rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            data = fh.read(64 << 10)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror or exc}", key=key) from exc
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{key}: {path} is not a regular file", key=key)
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        raise ConfigError(
            f"{key}: {path} has mode {stat.S_IMODE(mode):04o}; others must not read or write "
            "the token (chmod 600 or 640)",
            key=key,
        )
    token = data.strip()
    if not token:
        raise ConfigError(f"{key}: {path} is empty", key=key)
    if len(token) > MAX_TOKEN_BYTES:
        raise ConfigError(
            f"{key}: {path} holds {len(token)} bytes, at most {MAX_TOKEN_BYTES} allowed", key=key
        )
    return token


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
