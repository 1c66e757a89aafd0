"""Remote workers found by DNS: ``[workers.discovery]`` of a level-4 daemon.

::

    Daemon._start (after READY=1) -> asyncio task Discovery.run():
      every refresh_s:  resolver.resolve(name)            (never blocks the loop)
        error          -> WARNING, view.error; the workers found so far stay
        answer (IPs)   -> reconcile(address = IP:port for each):
          new address       -> reserve a worker id (kept for this address for good),
                               add_remote_worker_async(spec, worker_id=) + callables
          address gone      -> retire_remote_worker_async (its running task fails
                               naming the host, its queued work is refused)
          address back      -> revive_remote_worker_async: the same worker id
          used by a [[workers.remote]] table or AddRemoteWorker -> left to it ("static")
      view() -> ListWorkersResponse.discovery, `simplerctl workers`, /metrics

A session that cannot be opened keeps its address "opening" with the error, and is
tried again at the next resolution. Every change is logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from simpler_daemon.errors import ConfigError
from simpler_daemon.remote.manifest import format_host_port
from simpler_daemon.remote.spec import parse_endpoint
from simpler_daemon.server.config_types import DiscoveryConfig
from simpler_daemon.server.dnsquery import (
    ResolveError,
    Resolver,
    SystemResolver,
    UdpResolver,
    parse_dns_target,
    parse_nameserver,
)
from simpler_daemon.server.topology import remote_spec_of

__all__ = ["Discovery", "check_discovery", "resolver_of"]

log = logging.getLogger("simpler_daemon.discovery")

_KEY: Final = "workers.discovery"
#: A resolution that takes longer than this fails (getaddrinfo has no timeout of its own).
_RESOLVE_TIMEOUT_S: Final = 10.0


def resolver_of(cfg: DiscoveryConfig) -> Resolver:
    """The system resolver, or a UDP client of ``nameserver`` when it is set."""
    if cfg.nameserver:
        host, port = parse_nameserver(cfg.nameserver)
        return UdpResolver(host, port)
    return SystemResolver()


def check_discovery(cfg: DiscoveryConfig) -> None:
    """At start-up: ``ConfigError`` naming the key when the table's settings make every
    session fail (a rule only the spec knows, a credential file that cannot be read), so
    the daemon refuses to start instead of retrying forever."""
    remote_spec_of(cfg, _KEY, endpoint="127.0.0.1:1")
    for name in ("token_file", "tls_ca_file", "tls_cert_file", "tls_key_file"):
        path = getattr(cfg, name)
        if not path:
            continue
        try:
            with open(path, "rb") as fh:
                data = fh.read(1 << 16)
        except OSError as exc:
            raise ConfigError(
                f"{_KEY}.{name}: cannot read {path!r}: {exc.strerror or exc}", key=f"{_KEY}.{name}"
            ) from None
        if name == "token_file" and not data.strip():
            raise ConfigError(f"{_KEY}.token_file: {path!r} is empty", key=f"{_KEY}.token_file")


@dataclass(slots=True)
class _Address:
    """One address seen in an answer (``DiscoveredAddress``)."""

    worker_id: int
    state: str  # "opening", "active", "retired", "static"
    message: str = ""
    #: Whether a session was ever added for it (then it is revived, not added).
    added: bool = False


class Discovery:
    """The discovery loop of one daemon (see the module docstring)."""

    def __init__(
        self,
        worker: Any,
        cfg: DiscoveryConfig,
        *,
        resolver: Resolver | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.worker = worker
        self.cfg = cfg
        self.name, self.port = parse_dns_target(cfg.dns)
        self.resolver = resolver if resolver is not None else resolver_of(cfg)
        self.clock = clock
        self.addresses: dict[str, _Address] = {}
        self.last_resolve = 0.0
        self.last_success = 0.0
        self.resolutions = 0
        self.failures = 0
        self.error = ""
        #: The addresses of the last answer ("IP:PORT"), in its order.
        self.answer: list[str] = []
        #: Set after each finished resolution (tests and ``refresh_now`` wait on it).
        self.resolved = asyncio.Event()

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        """Resolve and reconcile every ``refresh_s`` until cancelled; never raises."""
        log.info(
            "discovery: resolving %s with %s every %g s",
            self.cfg.dns,
            self.resolver.description,
            self.cfg.refresh_s,
        )
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end discovery: log it, go on
                log.exception("discovery: reconciling %s failed", self.cfg.dns)
            await asyncio.sleep(self.cfg.refresh_s)

    async def refresh(self) -> None:
        """One resolution and what follows from it."""
        ips: list[str] | None
        try:
            ips = await asyncio.wait_for(self.resolver.resolve(self.name), _RESOLVE_TIMEOUT_S)
            error = ""
        except ResolveError as exc:
            ips = [] if exc.no_such_name else None
            error = str(exc)
        except TimeoutError:
            ips, error = (
                None,
                (
                    f"cannot resolve {self.name!r} with {self.resolver.description}: "
                    f"no answer within {_RESOLVE_TIMEOUT_S:g} s"
                ),
            )
        self.resolutions += 1
        self.last_resolve = self.clock()
        self.error = error
        if ips is None:
            self.failures += 1
            log.warning(
                "discovery: %s; keeping the %d workers found so far, next try in %g s",
                error,
                sum(a.state == "active" for a in self.addresses.values()),
                self.cfg.refresh_s,
            )
        else:
            self.last_success = self.last_resolve
            if error:
                log.warning("discovery: %s: no addresses now", error)
            self.answer = [format_host_port(ip, self.port) for ip in ips]
            await self._reconcile(self.answer)
        self.resolved.set()

    # -- reconciling ----------------------------------------------------------------------

    async def _reconcile(self, found: list[str]) -> None:
        static = self._static_endpoints()
        todo: list[tuple[str, _Address]] = []
        for addr in found:
            entry = self.addresses.get(addr)
            if addr in static and (entry is None or not entry.added):
                if entry is None or entry.state != "static":
                    log.info(
                        "discovery: %s is remote worker %d of %s, not opened again",
                        addr,
                        static[addr],
                        "the config or AddRemoteWorker",
                    )
                self.addresses[addr] = _Address(
                    static[addr], "static", "a [[workers.remote]] table or AddRemoteWorker uses it"
                )
                continue
            if entry is None:
                entry = _Address(self.worker.reserve_worker_id(), "opening")
                self.addresses[addr] = entry
                log.info("discovery: new address %s is remote worker %d", addr, entry.worker_id)
            if entry.state in ("opening", "retired"):
                todo.append((addr, entry))
        if todo:
            await asyncio.gather(*(self._open(addr, entry) for addr, entry in todo))
        wanted = set(found)
        for addr, entry in self.addresses.items():
            if addr in wanted:
                continue
            if entry.state == "active":
                await self._retire(addr, entry)
            elif entry.state == "opening":
                entry.state = "retired"
                entry.message = f"left the answer for {self.cfg.dns} before its session opened"
            elif entry.state == "static":
                entry.message = f"no longer in the answer for {self.cfg.dns}"

    async def _open(self, addr: str, entry: _Address) -> None:
        wid = entry.worker_id
        try:
            if entry.added:
                await self.worker.revive_remote_worker_async(wid)
            else:
                spec = remote_spec_of(self.cfg, _KEY, endpoint=addr)
                await self.worker.add_remote_worker_async(spec, worker_id=wid)
                entry.added = True
        except (ConfigError, ValueError) as exc:  # a setting the spec refuses: not retried
            entry.state, entry.message = "opening", str(exc)
            log.error("discovery: cannot add %s as remote worker %d: %s", addr, wid, exc)
            return
        except Exception as exc:
            entry.state = "opening"
            entry.message = f"{exc}; tried again at the next resolution"
            log.warning("discovery: cannot open remote worker %d (%s): %s", wid, addr, exc)
            return
        message = ""
        if entry.state == "retired":
            log.warning("discovery: %s is back: remote worker %d serves again", addr, wid)
        else:  # a new session: install the table's callables (a revived one has them)
            log.info("discovery: %s is remote worker %d (session open)", addr, wid)
            for j, c in enumerate(self.cfg.callables):
                try:
                    await self.worker.register_async(c.target, kind=c.kind, workers=[wid])
                except Exception as exc:
                    message = f"cannot register {_KEY}.callables[{j}] {c.target}: {exc}"
                    log.error("discovery: remote worker %d (%s): %s", wid, addr, message)
        # "active" once its callables are in: a run that sees it can use them.
        entry.state, entry.message = "active", message

    async def _retire(self, addr: str, entry: _Address) -> None:
        ip = addr.rpartition(":")[0]
        reason = f"{ip} is no longer in the answer for {self.cfg.dns}"
        try:
            await self.worker.retire_remote_worker_async(entry.worker_id, reason)
        except Exception as exc:  # the Worker closes: nothing left to retire
            log.warning("discovery: cannot retire remote worker %d: %s", entry.worker_id, exc)
            return
        entry.state = "retired"
        entry.message = f"retired: {reason}"
        log.warning(
            "discovery: %s left the answer: retired remote worker %d", addr, entry.worker_id
        )

    def _static_endpoints(self) -> dict[str, int]:
        """ "IP:PORT" -> worker id of every remote worker discovery did not add."""
        mine = {a.worker_id for a in self.addresses.values() if a.added}
        out: dict[str, int] = {}
        for row in self.worker.list_workers():
            if row.get("kind") != "remote" or row.get("worker_id") in mine:
                continue
            try:
                host, port = parse_endpoint(str(row.get("endpoint") or ""))
            except ValueError:
                continue
            out[format_host_port(host, port)] = int(row["worker_id"])
        return out

    # -- the view -------------------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        """What ListWorkers, simplerctl and the metrics show."""
        return {
            "dns": self.cfg.dns,
            "resolver": self.resolver.description,
            "refresh_s": self.cfg.refresh_s,
            "last_resolve": self.last_resolve,
            "last_success": self.last_success,
            "resolutions": self.resolutions,
            "failures": self.failures,
            "error": self.error,
            "answer": list(self.answer),
            "addresses": [
                {"address": addr, "worker_id": a.worker_id, "state": a.state, "message": a.message}
                for addr, a in self.addresses.items()
            ],
        }
