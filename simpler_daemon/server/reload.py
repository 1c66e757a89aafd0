"""What a SIGHUP may change in a running daemon, and what needs a restart.

::

    SIGHUP -> load the file again (same --config, --set and environment layers)
           -> changed_settings(running, loaded)       every dotted key that differs
           -> plan_reload(...)                         applied | needs a restart
           -> the daemon applies the first group, logs the second by name

A setting is reloadable when the running daemon reads it per request or can swap it
in place: the log level, the task-time ceiling, and (when the gRPC service can take
them, :data:`SERVICE_RELOADABLE`) the per-request limits and the allow-list.
Everything the daemon built at start (sockets, worker pools, heaps, TLS credentials,
the gRPC message size, which is an option of the server) needs a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from simpler_daemon.callables import restrict_imports
from simpler_daemon.endpoints.taskwatch import set_max_task_seconds
from simpler_daemon.errors import ConfigError
from simpler_daemon.server.config import DaemonConfig, LimitsConfig
from simpler_daemon.system.logsetup import set_level

__all__ = [
    "ALWAYS_RELOADABLE",
    "SERVICE_RELOADABLE",
    "ReloadPlan",
    "changed_settings",
    "plan_reload",
    "reload_config",
]

log = logging.getLogger("simpler_daemon.daemon")

#: Applied by the daemon itself (process-wide settings).
ALWAYS_RELOADABLE: Final = frozenset({"daemon.log_level", "limits.max_task_seconds"})

#: Applied by the gRPC service (``DaemonService.apply_config``): read per request.
#: ``limits.max_message_bytes`` is not among them: the gRPC server took it at start.
SERVICE_RELOADABLE: Final = frozenset(
    {
        f"limits.{f.name}"
        for f in msgspec.structs.fields(LimitsConfig)
        if f.name not in ("max_message_bytes", "max_task_seconds")
    }
    | {"callables.allowed_modules"}
)


def _settings(config: DaemonConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section in msgspec.structs.fields(DaemonConfig):
        values = getattr(config, section.name)
        for f in msgspec.structs.fields(type(values)):
            out[f"{section.name}.{f.name}"] = getattr(values, f.name)
    return out


def changed_settings(old: DaemonConfig, new: DaemonConfig) -> list[str]:
    """Dotted names of the settings whose values differ, in the config's order."""
    before, after = _settings(old), _settings(new)
    return [key for key, value in after.items() if before.get(key) != value]


@dataclass(frozen=True)
class ReloadPlan:
    """``config``: the running config with the reloadable changes applied (what the
    daemon runs with from now on); ``applied`` and ``needs_restart``: dotted names."""

    config: DaemonConfig
    applied: list[str]
    needs_restart: list[str]


def plan_reload(old: DaemonConfig, new: DaemonConfig, *, service_reloads: bool) -> ReloadPlan:
    """Split the changes from ``old`` to ``new``; ``service_reloads``: the gRPC service
    can take :data:`SERVICE_RELOADABLE` settings (else they need a restart too)."""
    reloadable = ALWAYS_RELOADABLE | (SERVICE_RELOADABLE if service_reloads else frozenset())
    applied: list[str] = []
    needs_restart: list[str] = []
    config = old
    replace = msgspec.structs.replace
    for key in changed_settings(old, new):
        if key not in reloadable:
            needs_restart.append(key)
            continue
        applied.append(key)
        section, name = key.split(".", 1)
        value = getattr(getattr(new, section), name)
        config = replace(config, **{section: replace(getattr(config, section), **{name: value})})
    return ReloadPlan(config=config, applied=applied, needs_restart=needs_restart)


def reload_config(
    running: DaemonConfig, load: Callable[[], DaemonConfig], service: Any
) -> DaemonConfig | None:
    """Load the configuration with ``load()`` and apply what may change at run time to
    this process and to ``service`` (its ``apply_config(config)``, when it has one);
    log what was applied and what needs a restart. Returns the configuration now in
    force, or None (logged) when the new one does not load: nothing changed then."""
    from simpler_daemon.server.daemon import check_limits

    try:
        new = load()
        check_limits(new)
    except ConfigError as exc:
        log.error("cannot reload the configuration: %s; the running one stays", exc)
        return None
    except Exception as exc:  # a bug, not the file: keep serving with what runs
        log.exception(
            "cannot reload the configuration: %s: %s; the running one stays",
            type(exc).__name__,
            exc,
        )
        return None
    apply_config = getattr(service, "apply_config", None)
    plan = plan_reload(running, new, service_reloads=callable(apply_config))
    _apply(running, plan, apply_config)
    if plan.needs_restart:
        log.warning(
            "configuration reloaded; these changed settings need a restart to take effect: %s",
            ", ".join(plan.needs_restart),
            extra={"event": "reload", "needs_restart": plan.needs_restart},
        )
    log.info(
        "configuration reloaded: %s",
        ", ".join(plan.applied) + " applied" if plan.applied else "nothing to apply",
        extra={"event": "reload", "applied": plan.applied},
    )
    return plan.config


def _apply(old: DaemonConfig, plan: ReloadPlan, apply_config: Any) -> None:
    config, applied = plan.config, plan.applied
    if "daemon.log_level" in applied:
        set_level(config.daemon.log_level)
    if "limits.max_task_seconds" in applied:
        set_max_task_seconds(config.limits.max_task_seconds)
    if "callables.allowed_modules" in applied:
        restrict_imports(config.callables.allowed_modules)
        added = set(config.callables.allowed_modules) - set(old.callables.allowed_modules)
        if added:
            # A registration carries the daemon's current list to the SUB workers;
            # chip workers and local L3 workers resolve under the one they inherited.
            log.warning(
                "callables.allowed_modules: %s added; SUB workers accept it now, chip "
                "workers and local L3 workers only after a restart",
                ", ".join(sorted(added)),
            )
    if callable(apply_config) and applied:
        try:
            apply_config(config)
        except Exception:
            log.exception("cannot apply the reloaded limits and allow-list to the service")
