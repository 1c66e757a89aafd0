"""The credentials of deploy/kubernetes/: make-secrets.sh makes what the pods ask for,
and docs/kubernetes.md's `kubectl create secret` commands give the Secrets the names
and keys the manifests mount."""

from __future__ import annotations

import re
import shutil
import ssl
import stat
import subprocess
from pathlib import Path

import pytest

from tests.support.kustomize import KUBERNETES, build

SCRIPT = KUBERNETES / "make-secrets.sh"
DOCS = KUBERNETES.parents[1] / "docs" / "kubernetes.md"
MADE = {"ca.crt", "ca.key", "daemon.crt", "daemon.key", "worker.crt", "worker.key"}
MADE |= {"daemon-token", "remote-token"}


def make_secrets(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not available")
    return subprocess.run(
        ["sh", str(SCRIPT), *args, str(directory)], capture_output=True, text=True, timeout=60
    )


def _dns_names(cert: Path) -> set[str]:
    shown = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return set(re.findall(r"DNS:([\w.-]+)", shown))


def test_make_secrets_makes_private_files_the_ca_signed(tmp_path: Path) -> None:
    out = tmp_path / "s"
    done = make_secrets(out, "-n", "jobs")
    assert done.returncode == 0, done.stderr
    assert {p.name for p in out.iterdir()} == MADE
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for p in out.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    for token in ("daemon-token", "remote-token"):
        assert re.fullmatch(r"[0-9a-f]{64}\n", (out / token).read_text()), token
    assert (out / "daemon-token").read_text() != (out / "remote-token").read_text()
    # Each certificate verifies against the CA for the Service names of the namespace
    # (the daemon checks workers against workers.discovery.tls_server_name).
    for name, service in (("daemon", "simpler-daemon"), ("worker", "simpler-remote-worker")):
        names = _dns_names(out / f"{name}.crt")
        assert f"{service}.jobs.svc" in names and f"{service}.jobs.svc.cluster.local" in names
        context = ssl.create_default_context(cafile=str(out / "ca.crt"))
        context.load_cert_chain(out / f"{name}.crt", out / f"{name}.key")  # key matches
        verified = subprocess.run(
            ["openssl", "verify", "-CAfile", str(out / "ca.crt"), str(out / f"{name}.crt")],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert verified.returncode == 0, verified.stdout + verified.stderr


def test_make_secrets_overwrites_nothing(tmp_path: Path) -> None:
    out = tmp_path / "s"
    out.mkdir()
    (out / "ca.key").write_text("keep me")
    done = make_secrets(out)
    assert done.returncode == 1
    assert f"{out} is not empty; give a new directory" in done.stderr
    assert (out / "ca.key").read_text() == "keep me"
    assert make_secrets(tmp_path / "t", "extra").returncode == 2


_CREATE = re.compile(r"^kubectl -n simpler create secret (generic|tls) (\S+) (.*)$", re.M)


def documented_secrets() -> dict[str, set[str]]:
    """Secret name -> its keys, from docs/kubernetes.md's `kubectl create secret` lines."""
    out: dict[str, set[str]] = {}
    for kind, name, rest in _CREATE.findall(DOCS.read_text()):
        if kind == "tls":
            assert "--cert=" in rest and "--key=" in rest, rest
            keys = {"tls.crt", "tls.key"}
        else:
            keys = set(re.findall(r"--from-file=([^=\s]+)=", rest))
        out[name] = keys
    return out


def mounted_secrets() -> dict[str, set[str]]:
    """Secret name -> the keys the built pods mount."""
    out: dict[str, set[str]] = {}
    for r in build("base"):
        if r["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for volume in r["spec"]["template"]["spec"]["volumes"]:
            sources = volume.get("projected", {}).get("sources", [])
            if "secret" in volume:
                sources = [{"secret": {**volume["secret"], "name": volume["secret"]["secretName"]}}]
            for source in sources:
                secret = source["secret"]
                keys = out.setdefault(secret["name"], set())
                keys |= {item["key"] for item in secret.get("items", [])}
    return out


def test_the_documented_secrets_are_the_mounted_ones() -> None:
    assert documented_secrets() == mounted_secrets()


def test_the_documented_files_are_the_made_ones() -> None:
    named = set(re.findall(r"\$HOME/simpler-secrets/([\w.-]+)", DOCS.read_text()))
    assert named and named <= MADE, named - MADE
