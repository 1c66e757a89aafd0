"""Loading a TOML configuration into frozen msgspec structs: the one mechanism behind
``simpler-daemon`` and ``simpler-remote-worker``.

A program describes its configuration with a :class:`ConfigSchema` (root struct,
environment prefix, how origins are named) and keeps its own semantic checks::

    struct defaults
      <- the file given to load() (or the schema's default text when there is none)
      <- environment variables  <PREFIX><SECTION>__<KEY>=<value>
      <- overrides              {"section.key": value}               (--set and flags)
         |
         v  msgspec.convert:  types, Literal choices, unknown and missing keys
         v  finish(config):   the program's ranges, cross-field rules, derived defaults
         |
         v  any problem -> ConfigError("cannot load config FILE: <key><origin><problem>",
                                       key=<dotted key>)

Checks raise :class:`Invalid` (a key and a problem); the loader adds the file and,
when the value did not come from the file, where it did come from. Nothing here
knows a section by name, and loading has no side effects.
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, Literal, TypeVar, get_args, get_origin

import msgspec

from simpler_daemon.errors import ConfigError

__all__ = [
    "ConfigSchema",
    "Invalid",
    "add_set_option",
    "check_host_port",
    "check_module_names",
    "check_path",
    "default_allowed_modules",
    "is_dotted",
    "overrides_from_set",
    "parse_host_port",
]

T = TypeVar("T", bound=msgspec.Struct)

_IDENT: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PORT: Final = re.compile(r"[0-9]{1,5}\Z")


# --------------------------------------------------------------------------- errors


class Invalid(Exception):
    """A problem with one setting; :meth:`ConfigSchema.load` adds the file and the origin.

    The message reads ``before + key + <origin> + after``: the origin goes right after
    the key it qualifies (``daemon.level (from override): Invalid enum value 9``).
    """

    def __init__(self, key: str, after: str, before: str = "") -> None:
        super().__init__(key)
        self.key = key
        self.after = after
        self.before = before

    def text(self, origin: str = "") -> str:
        return f"{self.before}{self.key}{origin}{self.after}"

    def error(self, prefix: str = "", origin: str = "") -> ConfigError:
        """The ``ConfigError`` to raise (``key`` = the dotted setting)."""
        return ConfigError(f"{prefix}{self.text(origin)}", key=self.key)


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True, slots=True)
class ConfigSchema(Generic[T]):
    """How one program's configuration is layered; the root struct holds one struct per
    ``[section]``."""

    root: type[T]
    env_prefix: str
    """Environment variables ``<env_prefix><SECTION>__<KEY>`` override the file."""
    env_origin: str
    """Named after the key of a value taken from the environment; ``{name}`` = the variable."""
    override_origin: str
    """Named after the key of a value given as an override."""
    default_text: str = ""
    """The TOML read when load() is given no file."""

    def field_type(self, path: str) -> Any:
        """The annotated type at a dotted path such as ``workers.remote[0].callables[1].kind``;
        None when there is no such setting."""
        current: Any = self.root
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

    def load(
        self,
        path: str | os.PathLike[str] | None,
        *,
        env: Mapping[str, str],
        overrides: Mapping[str, object] | None,
        finish: Callable[[T], T],
    ) -> T:
        """Merge defaults <- file <- environment <- overrides, convert, then ``finish``.

        Environment values and string overrides are parsed as TOML values when possible,
        else taken as text (a ``str`` setting keeps the text unless it is a quoted TOML
        string). ``finish`` runs the program's checks (raising :class:`Invalid`) and may
        return a config with derived defaults filled in.

        Raises ``ConfigError`` (``key`` = the dotted setting) when the file cannot be read
        or parsed, an environment variable or override is malformed, a key is unknown or
        missing, a value has the wrong type, or ``finish`` finds a problem.
        """
        where = f" {os.fspath(path)}" if path is not None else ""
        raw = _read_toml(path, where, self.default_text)

        # Where a value came from when it was not the file; named in error messages.
        origins: dict[str, str] = {}

        def fail(exc: Invalid) -> ConfigError:
            base = exc.key.partition("[")[0]
            origin = origins.get(base, "")
            if not origin:  # an unknown section that only the environment or an override named
                origin = next((o for k, o in origins.items() if k.startswith(base + ".")), "")
            return exc.error(f"cannot load config{where}: ", origin)

        def put(section: str, key: str, value: object, origin: str) -> None:
            table = raw.get(section)
            if not isinstance(table, dict):
                table = raw[section] = {}
            table[key] = value
            origins[f"{section}.{key}"] = origin

        prefix = self.env_prefix
        for name in sorted(env):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix) :].split("__")
            if len(parts) != 2 or not all(parts):
                raise ConfigError(
                    f"cannot load config{where}: environment variable {name}: "
                    f"expected {prefix}<SECTION>__<KEY>",
                    key=name,
                )
            section, key = parts[0].lower(), parts[1].lower()
            value = self._parse_value(section, key, env[name])
            put(section, key, value, self.env_origin.format(name=name))

        for dotted, value in (overrides or {}).items():
            section, dot, key = dotted.partition(".")
            if not (section and dot and key) or "." in key:
                raise ConfigError(
                    f"cannot load config{where}: override {dotted!r}: expected section.key",
                    key=dotted,
                )
            if isinstance(value, str):
                value = self._parse_value(section, key, value)
            put(section, key, value, self.override_origin)

        try:
            config = msgspec.convert(raw, type=self.root)
        except msgspec.ValidationError as exc:
            raise fail(self._from_validation_error(exc)) from None
        try:
            return finish(config)
        except Invalid as exc:
            raise fail(exc) from None

    def _parse_value(self, section: str, key: str, text: str) -> object:
        """A TOML value when ``text`` is one, else the text itself; ``str`` settings keep
        the text unless it is a quoted TOML string (so ``--set a.b=1.0`` stays ``"1.0"``)."""
        try:
            parsed = tomllib.loads(f"v = {text}")
        except tomllib.TOMLDecodeError:
            return text
        if set(parsed) != {"v"}:
            return text
        value = parsed["v"]
        if self.field_type(f"{section}.{key}") is str and not isinstance(value, str):
            return text
        return value

    def _from_validation_error(self, exc: msgspec.ValidationError) -> Invalid:
        """Turn ``Expected `int`, got `str` - at `$.limits.x``` into a key and a problem."""
        problem, sep, where = str(exc).partition(" - at `$")
        path = where.rstrip("`").lstrip(".") if sep else ""
        unknown = re.fullmatch(r"Object contains unknown field `(.*)`", problem)
        if unknown:
            key = f"{path}.{unknown[1]}" if path else unknown[1]
            return Invalid(key, "", before="unknown key ")
        missing = re.fullmatch(r"Object missing required field `(.*)`", problem)
        if missing:
            key = f"{path}.{missing[1]}" if path else missing[1]
            return Invalid(key, ": required")
        problem = problem.replace("`object`", "table").replace("`", "")
        ftype = self.field_type(path)
        if problem.startswith("Invalid enum value") and get_origin(ftype) is Literal:
            choices = ", ".join(repr(c) for c in get_args(ftype))
            problem = f"{problem} (choose one of {choices})"
        return Invalid(path or "config", f": {problem}")


def _read_toml(path: str | os.PathLike[str] | None, where: str, default: str) -> dict[str, Any]:
    if path is None:
        text = default
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
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cannot parse config{where}: {exc}") from exc


# --------------------------------------------------------------------------- checks


def check_path(key: str, path: str) -> None:
    """``Invalid`` unless ``path`` is "" or absolute, and free of NUL bytes."""
    if "\0" in path:
        raise Invalid(key, ": contains a NUL byte")
    if path and not os.path.isabs(path):
        raise Invalid(key, f": {path!r} must be an absolute path")


def is_dotted(name: str) -> bool:
    """Whether ``name`` is dotted identifiers (``pkg.mod``), as a module name must be."""
    return bool(name) and all(_IDENT.match(part) for part in name.split("."))


def default_allowed_modules() -> list[str]:
    """The default ``callables.allowed_modules``: the bundled examples only."""
    return ["simpler_daemon.examples"]


def check_module_names(key: str, entries: Iterable[str], *, trailing_dot: bool = False) -> None:
    """``Invalid`` naming ``key[i]`` for the first entry that is not a dotted module name;
    ``trailing_dot`` accepts ``"pkg."`` as well (where the allow-list matching strips it)."""
    for i, entry in enumerate(entries):
        name = entry[:-1] if trailing_dot and entry.endswith(".") else entry
        if not is_dotted(name):
            raise Invalid(f"{key}[{i}]", f": {entry!r} is not a dotted module name")


def parse_host_port(text: str, *, key: str = "address") -> tuple[str, int]:
    """Split ``"host:port"`` (``"[::1]:9090"`` for IPv6) into ``(host, port)``.

    Raises ``ConfigError`` naming ``key`` when the host is empty, an IPv6 host
    is not bracketed, or the port is not an integer in 0..65535.
    """
    try:
        return _split_host_port(text)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}", key=key) from None


def check_host_port(key: str, text: str) -> tuple[str, int]:
    """:func:`parse_host_port` for a check: ``Invalid`` naming ``key``."""
    try:
        return _split_host_port(text)
    except ValueError as exc:
        raise Invalid(key, f": {exc}") from None


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


# --------------------------------------------------------------------------- command line


def add_set_option(parser: argparse.ArgumentParser, example: str) -> None:
    """Add the repeatable ``--set section.key=value`` option; read it with
    :func:`overrides_from_set`."""
    parser.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help=f"override one setting, e.g. --set {example} (repeatable)",
    )


def overrides_from_set(items: Sequence[str]) -> dict[str, object]:
    """``["section.key=value", ...]`` -> the ``overrides`` of :meth:`ConfigSchema.load`
    (values stay text; the loader parses them against the setting's type).

    Raises ``ConfigError`` naming the item when it has no ``=`` or no key.
    """
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected section.key=value", key=item)
        out[key.strip()] = value
    return out
