"""What deploy/kubernetes/ must hold, checked on the resources `kubectl kustomize` built.

``problems(resources)`` returns one line per broken rule (empty: all hold), each naming
the resource, the container or the config key; tests/ops/test_kubernetes.py runs it on
every build and on copies broken on purpose, so that each rule is seen to fail. The
TOML configs are read from the built ConfigMaps and parsed with the daemon's and the
remote worker's own loaders: the rules compare what the programs will read with what
the pods provide (ports, paths, sizes, bounds).
"""

from __future__ import annotations

import os
import posixpath
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from simpler_daemon.remote_worker import config as worker_cfg
from simpler_daemon.server import config as daemon_cfg
from simpler_daemon.server.daemon import LIVENESS_NAME

__all__ = ["Build", "parse_quantity", "problems"]

Resource = dict[str, Any]

DAEMON = "simpler-daemon"
WORKER = "simpler-remote-worker"
DAEMON_TOML = "daemon.toml"
WORKER_TOML = "worker.toml"
#: Secret-backed volume modes the rules accept (owner read, or read and write).
SECRET_MODES = (0o400, 0o600)

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")
_FACTORS = {
    None: 1,
    "m": 0.001,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def parse_quantity(value: object) -> float:
    """A Kubernetes quantity ("256Mi", "2", "500m", 1024) as a number."""
    m = _QUANTITY.match(str(value))
    if not m:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return float(m[1]) * _FACTORS[m[2]]


def _load_daemon_toml(text: str) -> daemon_cfg.DaemonConfig:
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    try:
        return daemon_cfg.load(f.name, env={})
    finally:
        os.unlink(f.name)


def _load_worker_toml(text: str) -> worker_cfg.RemoteWorkerConfig:
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    try:
        return worker_cfg.load(f.name, env={})
    finally:
        os.unlink(f.name)


def _port_of(text: str) -> int:
    return int(text.rpartition(":")[2])


@dataclass
class Build:
    """One build's resources, with lookups the rules share."""

    resources: list[Resource]

    def find(self, kind: str, name: str) -> Resource | None:
        for r in self.resources:
            if r.get("kind") == kind and r["metadata"]["name"] == name:
                return r
        return None

    def of_kind(self, kind: str) -> list[Resource]:
        return [r for r in self.resources if r.get("kind") == kind]

    def config_map(self, prefix: str, key: str) -> str:
        """The file ``key`` of the ConfigMap that ``prefix`` generated (hash suffixed)."""
        for r in self.of_kind("ConfigMap"):
            if r["metadata"]["name"].startswith(prefix + "-") and key in r.get("data", {}):
                return str(r["data"][key])
        raise LookupError(f"no ConfigMap {prefix}-* with {key}")

    @property
    def namespace(self) -> str:
        return str(self.of_kind("Namespace")[0]["metadata"]["name"])

    def workload(self, name: str) -> Resource:
        for kind in ("Deployment", "StatefulSet", "DaemonSet"):
            if (r := self.find(kind, name)) is not None:
                return r
        raise LookupError(f"no workload {name}")


def _pod(workload: Resource) -> dict[str, Any]:
    return dict(workload["spec"]["template"]["spec"])


def _labels(workload: Resource) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"].get("labels", {}))


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector matches ``labels`` (an empty one matches every pod, as in a
    NetworkPolicy or a PodDisruptionBudget). The rules refuse matchExpressions: a
    selector they cannot read matches nothing here."""
    if selector.get("matchExpressions"):
        return False
    wanted = selector.get("matchLabels", {})
    return all(labels.get(k) == v for k, v in wanted.items())


def _service_selects(service: Resource, labels: dict[str, str]) -> bool:
    """A Service's selector (a plain map; an empty one selects no pod) matches."""
    selector = service["spec"].get("selector", {})
    return bool(selector) and _matches({"matchLabels": selector}, labels)


def _containers(pod: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for c in pod.get("initContainers", []):
        yield "init container " + c["name"], c
    for c in pod.get("containers", []):
        yield "container " + c["name"], c


def _volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next((v for v in pod.get("volumes", []) if v["name"] == name), {})


def _mount_of(container: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The volume mount ``path`` lies in (the deepest one)."""
    best: dict[str, Any] | None = None
    for m in container.get("volumeMounts", []):
        root = m["mountPath"].rstrip("/")
        if (path == root or path.startswith(root + "/")) and (
            best is None or len(root) > len(best["mountPath"].rstrip("/"))
        ):
            best = m
    return best


def _memory_dir(pod: dict[str, Any], mount: dict[str, Any] | None) -> dict[str, Any] | None:
    """The emptyDir (medium Memory) behind ``mount``, else None."""
    if mount is None:
        return None
    empty = _volume(pod, mount["name"]).get("emptyDir")
    return empty if empty is not None and empty.get("medium") == "Memory" else None


def _main(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next((c for c in pod.get("containers", []) if c["name"] == name), {})


Rule = Callable[[Build, list[str]], None]
_RULES: list[Rule] = []


def _rule(fn: Rule) -> Rule:
    _RULES.append(fn)
    return fn


def problems(resources: list[Resource]) -> list[str]:
    """Every broken rule of this build, one line each; [] when all hold."""
    build = Build(resources)
    out: list[str] = []
    for rule in _RULES:
        try:
            rule(build, out)
        except (LookupError, KeyError, TypeError, ValueError) as exc:
            out.append(f"{rule.__name__}: cannot check: {type(exc).__name__}: {exc}")
        except Exception as exc:  # a config the loaders refuse
            out.append(f"{rule.__name__}: {type(exc).__name__}: {exc}")
    return out


@dataclass
class _Configs:
    daemon: daemon_cfg.DaemonConfig
    worker: worker_cfg.RemoteWorkerConfig


def _configs(build: Build) -> _Configs:
    return _Configs(
        _load_daemon_toml(build.config_map(f"{DAEMON}-config", DAEMON_TOML)),
        _load_worker_toml(build.config_map(f"{WORKER}-config", WORKER_TOML)),
    )


def _container_port(container: dict[str, Any], ref: object) -> int | None:
    """A probe's or Service's port: a number, or the name of a container port."""
    if isinstance(ref, int):
        return ref
    for p in container.get("ports", []):
        if p.get("name") == ref:
            return int(p["containerPort"])
    return None


# --------------------------------------------------------------------------- the rules


@_rule
def configs_load(build: Build, out: list[str]) -> None:
    """Both TOML files load with the programs' own loaders (unknown keys, bad values)."""
    _configs(build)


@_rule
def security(build: Build, out: list[str]) -> None:
    """Non-root with a non-zero uid, read-only root, no capabilities, no escalation."""
    for name in (DAEMON, WORKER):
        pod = _pod(build.workload(name))
        pod_ctx = pod.get("securityContext", {})
        for what, c in _containers(pod):
            ctx = {**pod_ctx, **c.get("securityContext", {})}
            where = f"{name} {what}"
            if ctx.get("runAsNonRoot") is not True:
                out.append(f"{where}: runAsNonRoot is not true")
            if not isinstance(ctx.get("runAsUser"), int) or ctx["runAsUser"] == 0:
                out.append(f"{where}: runAsUser is not a non-zero uid")
            own = c.get("securityContext", {})
            if own.get("readOnlyRootFilesystem") is not True:
                out.append(f"{where}: readOnlyRootFilesystem is not true")
            if own.get("allowPrivilegeEscalation") is not False:
                out.append(f"{where}: allowPrivilegeEscalation is not false")
            if own.get("privileged"):
                out.append(f"{where}: privileged")
            caps = own.get("capabilities", {})
            if "ALL" not in caps.get("drop", []):
                out.append(f"{where}: capabilities do not drop ALL")
            if caps.get("add"):
                out.append(f"{where}: capabilities add {caps['add']}")
        if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
            out.append(f"{name}: shares a host namespace")


@_rule
def probes(build: Build, out: list[str]) -> None:
    """Readiness and liveness on every container: the daemon's gRPC health service on
    health.probe_listen (liveness on its "liveness" name), a TCP connect on the worker's
    listen port."""
    c = _configs(build)
    for name in (DAEMON, WORKER):
        for what, container in _containers(_pod(build.workload(name))):
            if what.startswith("init "):
                continue
            for probe in ("readinessProbe", "livenessProbe"):
                if probe not in container:
                    out.append(f"{name} {what}: no {probe}")
    daemon = _main(_pod(build.workload(DAEMON)), "daemon")
    if not c.daemon.health.probe_listen:
        out.append(f"{DAEMON_TOML}: health.probe_listen is not set (the grpc: probes need it)")
        return
    probe_port = _port_of(c.daemon.health.probe_listen)
    for probe, service in (
        ("startupProbe", LIVENESS_NAME),
        ("readinessProbe", ""),
        ("livenessProbe", LIVENESS_NAME),
    ):
        grpc = daemon.get(probe, {}).get("grpc")
        if grpc is None:
            out.append(f"{DAEMON} container daemon: {probe} is not a grpc: probe")
            continue
        if grpc.get("port") != probe_port:
            out.append(
                f"{DAEMON} container daemon: {probe} on port {grpc.get('port')}, "
                f"health.probe_listen is {c.daemon.health.probe_listen}"
            )
        if grpc.get("service", "") != service:
            out.append(
                f"{DAEMON} container daemon: {probe} asks for health name "
                f"{grpc.get('service', '')!r}, not {service!r}"
            )
    startup = daemon.get("startupProbe", {})
    window = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    if window <= c.daemon.daemon.startup_timeout:
        out.append(
            f"{DAEMON} container daemon: startupProbe allows {window} s, not more than "
            f"daemon.startup_timeout ({c.daemon.daemon.startup_timeout:g} s)"
        )
    worker = _main(_pod(build.workload(WORKER)), "remote-worker")
    listen = _port_of(c.worker.worker.listen)
    for probe in ("readinessProbe", "livenessProbe"):
        tcp = worker.get(probe, {}).get("tcpSocket")
        port = _container_port(worker, tcp.get("port")) if tcp else None
        if port != listen:
            out.append(
                f"{WORKER} container remote-worker: {probe} is not a tcpSocket on "
                f"worker.listen's port {listen}"
            )


@_rule
def shared_memory(build: Build, out: list[str]) -> None:
    """/dev/shm of the daemon: a memory emptyDir of exactly workers.heap_bytes."""
    c = _configs(build)
    pod = _pod(build.workload(DAEMON))
    mount = _mount_of(_main(pod, "daemon"), "/dev/shm")
    if mount is None or mount["mountPath"] != "/dev/shm":
        out.append(f"{DAEMON} container daemon: /dev/shm is not a volume")
        return
    empty = _memory_dir(pod, mount)
    if empty is None:
        out.append(f"{DAEMON} volume {mount['name']} (/dev/shm): not an emptyDir of medium Memory")
        return
    if "sizeLimit" not in empty:
        out.append(f"{DAEMON} volume {mount['name']} (/dev/shm): no sizeLimit")
    elif parse_quantity(empty["sizeLimit"]) != c.daemon.workers.heap_bytes:
        out.append(
            f"{DAEMON} volume {mount['name']} (/dev/shm): sizeLimit {empty['sizeLimit']} "
            f"is not workers.heap_bytes ({c.daemon.workers.heap_bytes})"
        )
    if not c.daemon.workers.heap_shared:
        out.append(f"{DAEMON_TOML}: workers.heap_shared is false: /dev/shm would hold nothing")


def _secret_files(c: _Configs) -> list[tuple[str, str, str, str]]:
    """(workload, container, config key, path) of every token, key and certificate."""
    d, w = c.daemon, c.worker
    files = [
        (DAEMON, "daemon", "grpc.token_file", d.grpc.token_file),
        (DAEMON, "daemon", "grpc.tls_cert", d.grpc.tls_cert),
        (DAEMON, "daemon", "grpc.tls_key", d.grpc.tls_key),
        (DAEMON, "daemon", "workers.discovery.token_file", d.workers.discovery.token_file),
        (DAEMON, "daemon", "workers.discovery.tls_ca_file", d.workers.discovery.tls_ca_file),
        (WORKER, "remote-worker", "auth.token_file", w.auth.token_file),
        (WORKER, "remote-worker", "tls.cert_file", w.tls.cert_file),
        (WORKER, "remote-worker", "tls.key_file", w.tls.key_file),
    ]
    return files


def _from_secret(pod: dict[str, Any], container: dict[str, Any], path: str) -> str | None:
    """Why ``path`` in ``container`` is not a file of a Secret volume (None: it is)."""
    mount = _mount_of(container, path)
    if mount is None:
        return f"{path} is on no volume"
    volume = _volume(pod, mount["name"])
    relative = posixpath.relpath(path, mount["mountPath"])
    if "secret" in volume:
        source = volume["secret"]
        mode = source.get("defaultMode", 0o644)
        items = {i.get("path") for i in source.get("items", [])} or None
        names = [source.get("secretName")]
    elif "projected" in volume:
        source = volume["projected"]
        mode = source.get("defaultMode", 0o644)
        sources = source.get("sources", [])
        if not sources or any(set(s) != {"secret"} for s in sources):
            return f"volume {mount['name']} projects more than Secrets"
        items = {i.get("path") for s in sources for i in s["secret"].get("items", [])}
        names = [s["secret"].get("name") for s in sources]
    else:
        return f"{path} is on volume {mount['name']}, not a Secret's"
    if mode not in SECRET_MODES:
        return f"volume {mount['name']} has defaultMode {mode:#o}, not 0o400 or 0o600"
    if items is not None and relative not in items:
        return f"{relative} is not an item of volume {mount['name']} (Secrets {names})"
    return None


@_rule
def secrets(build: Build, out: list[str]) -> None:
    """Tokens, keys and certificates come from Secrets as files, never in env: an init
    container copies them (`install -m 0600`) from a Secret volume of mode 0400/0600
    into a memory emptyDir that the program's container mounts read-only."""
    c = _configs(build)
    for name in (DAEMON, WORKER):
        for what, container in _containers(_pod(build.workload(name))):
            for env in container.get("env", []):
                if "secretKeyRef" in env.get("valueFrom", {}):
                    out.append(f"{name} {what}: env {env['name']} comes from a Secret")
            for env in container.get("envFrom", []):
                if "secretRef" in env:
                    out.append(f"{name} {what}: envFrom a Secret")
    for name, cname, key, path in _secret_files(c):
        where = f"{name} container {cname}: {key} ({path or 'not set'})"
        if not path:
            out.append(f"{where}: not set")
            continue
        pod = _pod(build.workload(name))
        main = _main(pod, cname)
        mount = _mount_of(main, path)
        if _memory_dir(pod, mount) is None:
            out.append(f"{where}: not in a memory emptyDir")
            continue
        assert mount is not None
        if not mount.get("readOnly"):
            out.append(f"{where}: its volume is mounted writable")
        copied = False
        for init in pod.get("initContainers", []):
            into = next(
                (m for m in init.get("volumeMounts", []) if m["name"] == mount["name"]), None
            )
            argv = [*init.get("command", []), *init.get("args", [])]
            if into is None or argv[:4] != ["install", "-m", "0600", "-t"]:
                continue
            if posixpath.normpath(argv[4]) != posixpath.normpath(into["mountPath"]):
                continue
            rel = posixpath.relpath(path, mount["mountPath"])
            sources = [s for s in argv[5:] if posixpath.basename(s) == rel]
            if not sources:
                continue
            why = _from_secret(pod, init, sources[0])
            if why is not None:
                out.append(f"{where}: copied from {sources[0]}, but {why}")
            copied = True
        if not copied:
            out.append(f"{where}: no init container copies it there from a Secret (mode 0600)")


@_rule
def writable_paths(build: Build, out: list[str]) -> None:
    """The root file system is read-only: every directory the programs write is a
    volume. The runtime directory sits in a memory emptyDir (tmpfs: mode 1777, which
    the daemon accepts as the parent of its private directory), the history on the
    volume claim."""
    c = _configs(build)
    pod = _pod(build.workload(DAEMON))
    daemon = _main(pod, "daemon")
    runtime = c.daemon.daemon.runtime_dir
    mount = _mount_of(daemon, runtime)
    if _memory_dir(pod, mount) is None or mount is None or mount["mountPath"] == runtime:
        out.append(
            f"{DAEMON}: daemon.runtime_dir {runtime} is not a directory inside a memory emptyDir"
        )
    state = c.daemon.daemon.state_dir
    mount = _mount_of(daemon, state)
    if mount is None or "persistentVolumeClaim" not in _volume(pod, mount["name"]):
        out.append(f"{DAEMON}: daemon.state_dir {state} is not on a PersistentVolumeClaim")
    elif (claim := _volume(pod, mount["name"])["persistentVolumeClaim"]["claimName"]) and (
        build.find("PersistentVolumeClaim", claim) is None
    ):
        out.append(f"{DAEMON}: the PersistentVolumeClaim {claim} is not in the build")
    worker_pod = _pod(build.workload(WORKER))
    worker = _main(worker_pod, "remote-worker")
    spec_dir = c.worker.worker.spec_dir or "/tmp"
    mount = _mount_of(worker, spec_dir)
    if mount is None or mount.get("readOnly"):
        out.append(f"{WORKER}: worker.spec_dir {spec_dir} is not on a writable volume")
    for name, p, cname in ((DAEMON, pod, "daemon"), (WORKER, worker_pod, "remote-worker")):
        mount = _mount_of(_main(p, cname), "/tmp")
        if mount is None or mount["mountPath"] != "/tmp":
            out.append(f"{name}: /tmp is not a volume")


@_rule
def resources(build: Build, out: list[str]) -> None:
    """Requests and limits of CPU and memory on every container; the memory limit holds
    the memory emptyDirs it mounts (they count against it) and, for the worker,
    sessions.max sessions of sessions.max_heap_bytes."""
    c = _configs(build)
    for name in (DAEMON, WORKER):
        pod = _pod(build.workload(name))
        for what, container in _containers(pod):
            res = container.get("resources", {})
            for kind in ("requests", "limits"):
                for resource in ("cpu", "memory"):
                    if resource not in res.get(kind, {}):
                        out.append(f"{name} {what}: no {kind}.{resource}")
            if "memory" not in res.get("limits", {}):
                continue
            limit = parse_quantity(res["limits"]["memory"])
            need = 0.0
            for m in container.get("volumeMounts", []):
                empty = _memory_dir(pod, m)
                if empty is not None:
                    need += parse_quantity(empty.get("sizeLimit", "0"))
            if what == "container remote-worker":
                s = c.worker.sessions
                need += s.max * s.max_heap_bytes
            if limit <= need:
                out.append(
                    f"{name} {what}: memory limit {res['limits']['memory']} does not exceed "
                    f"the {int(need)} bytes its memory volumes and heaps may take"
                )


@_rule
def grace(build: Build, out: list[str]) -> None:
    """The kubelet waits longer than the programs' own drain before it SIGKILLs."""
    c = _configs(build)
    for name, drain, key in (
        (DAEMON, c.daemon.daemon.shutdown_grace, "daemon.shutdown_grace"),
        (WORKER, c.worker.worker.shutdown_grace, "worker.shutdown_grace"),
    ):
        period = _pod(build.workload(name)).get("terminationGracePeriodSeconds", 30)
        if period <= drain:
            out.append(f"{name}: terminationGracePeriodSeconds {period} <= {key} ({drain:g})")


@_rule
def discovery(build: Build, out: list[str]) -> None:
    """The daemon resolves the workers' headless Service by its name in this namespace,
    on the port the workers listen on, and asks for no more than they admit."""
    c = _configs(build)
    d = c.daemon
    service = build.find("Service", WORKER)
    worker = build.workload(WORKER)
    if service is None:
        out.append(f"no Service {WORKER}")
        return
    spec = service["spec"]
    if spec.get("clusterIP") != "None":
        out.append(f"Service {WORKER}: not headless (clusterIP: None)")
    if spec.get("publishNotReadyAddresses"):
        out.append(f"Service {WORKER}: publishes workers that are not ready")
    if not _service_selects(service, _labels(worker)):
        out.append(f"Service {WORKER}: its selector does not match the worker pods")
    if worker["kind"] == "StatefulSet" and worker["spec"].get("serviceName") != WORKER:
        out.append(f"StatefulSet {WORKER}: serviceName is not {WORKER}")
    listen = _port_of(c.worker.worker.listen)
    container = _main(_pod(worker), "remote-worker")
    ports = [_container_port(container, p.get("targetPort", p["port"])) for p in spec["ports"]]
    if [p["port"] for p in spec["ports"]] != [listen] or ports != [listen]:
        out.append(f"Service {WORKER}: ports {spec['ports']} are not worker.listen's {listen}")
    expected = f"{WORKER}.{build.namespace}.svc.cluster.local:{listen}"
    if d.workers.discovery.dns != expected:
        out.append(
            f"{DAEMON_TOML}: workers.discovery.dns is {d.workers.discovery.dns!r}, not {expected!r}"
        )
    s = c.worker.sessions
    wanted = d.workers.discovery
    if wanted.num_sub_workers > s.max_sub_workers:
        out.append(
            f"workers.discovery.num_sub_workers {wanted.num_sub_workers} > the worker's "
            f"sessions.max_sub_workers {s.max_sub_workers}"
        )
    if wanted.heap_bytes > s.max_heap_bytes:
        out.append(
            f"workers.discovery.heap_bytes {wanted.heap_bytes} > the worker's "
            f"sessions.max_heap_bytes {s.max_heap_bytes}"
        )


@_rule
def daemon_ports(build: Build, out: list[str]) -> None:
    """The daemon's Service reaches grpc.tcp_listen; its pod declares the probe port."""
    c = _configs(build)
    pod = _pod(build.workload(DAEMON))
    daemon = _main(pod, "daemon")
    service = build.find("Service", DAEMON)
    if service is None:
        out.append(f"no Service {DAEMON}")
        return
    if not _service_selects(service, _labels(build.workload(DAEMON))):
        out.append(f"Service {DAEMON}: its selector does not match the daemon pods")
    if not c.daemon.grpc.tcp_listen:
        out.append(f"{DAEMON_TOML}: grpc.tcp_listen is not set (no client could connect)")
        return
    listen = _port_of(c.daemon.grpc.tcp_listen)
    targets = [
        _container_port(daemon, p.get("targetPort", p["port"])) for p in service["spec"]["ports"]
    ]
    if targets != [listen]:
        out.append(f"Service {DAEMON}: targets {targets}, grpc.tcp_listen is port {listen}")
    declared = {p["containerPort"] for p in daemon.get("ports", [])}
    if c.daemon.health.probe_listen and _port_of(c.daemon.health.probe_listen) not in declared:
        out.append(f"{DAEMON} container daemon: the probe port is not among its ports")


@_rule
def disruption_budget(build: Build, out: list[str]) -> None:
    """A PodDisruptionBudget covers the remote workers."""
    labels = _labels(build.workload(WORKER))
    budgets = [
        b
        for b in build.of_kind("PodDisruptionBudget")
        if _matches(b["spec"].get("selector", {}), labels)
    ]
    if not budgets:
        out.append(f"no PodDisruptionBudget selects the {WORKER} pods")
    for b in budgets:
        if str(b["spec"].get("maxUnavailable", "")) in ("", "0", "0%"):
            out.append(f"PodDisruptionBudget {b['metadata']['name']}: allows no disruption")


@_rule
def network_policy(build: Build, out: list[str]) -> None:
    """Only the daemon's pods reach the workers, on the worker's port and on the range
    the session runners bind (the worker pods' net.ipv4.ip_local_port_range)."""
    c = _configs(build)
    worker = build.workload(WORKER)
    worker_labels, daemon_labels = _labels(worker), _labels(build.workload(DAEMON))
    policies = [
        p
        for p in build.of_kind("NetworkPolicy")
        if _matches(p["spec"]["podSelector"], worker_labels)
    ]
    if not policies:
        out.append(f"no NetworkPolicy selects the {WORKER} pods")
        return
    sysctls = {
        s["name"]: s["value"] for s in _pod(worker).get("securityContext", {}).get("sysctls", [])
    }
    low, high = (int(x) for x in sysctls.get("net.ipv4.ip_local_port_range", "0 0").split())
    if not low:
        out.append(f"{WORKER}: the pods do not set net.ipv4.ip_local_port_range")
    expected = [
        {"protocol": "TCP", "port": _port_of(c.worker.worker.listen)},
        {"protocol": "TCP", "port": low, "endPort": high},
    ]
    for p in policies:
        name = f"NetworkPolicy {p['metadata']['name']}"
        if _matches(p["spec"]["podSelector"], daemon_labels):
            out.append(f"{name}: its podSelector also selects the daemon pods")
        if "Ingress" not in p["spec"].get("policyTypes", ["Ingress"]):
            out.append(f"{name}: not an Ingress policy")
        rules = p["spec"].get("ingress", [])
        if not rules:
            out.append(f"{name}: no ingress rule (nothing reaches the workers)")
        for i, r in enumerate(rules):
            peers = r.get("from", [])
            if not peers:
                out.append(f"{name}: ingress[{i}] has no from: every source may connect")
            for peer in peers:
                if set(peer) != {"podSelector"}:
                    out.append(f"{name}: ingress[{i}] admits {sorted(set(peer) - {'podSelector'})}")
                elif not _matches(peer["podSelector"], daemon_labels) or _matches(
                    peer["podSelector"], worker_labels
                ):
                    out.append(f"{name}: ingress[{i}] admits pods other than the daemon's")
            if r.get("ports") != expected:
                out.append(f"{name}: ingress[{i}] ports {r.get('ports')}, expected {expected}")
