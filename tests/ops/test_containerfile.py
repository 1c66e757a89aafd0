"""Containerfile: not built here (no container runtime in the suite), but what it
relies on is checked: the files it copies build the package's wheel on their own (its
C extension included), the programs the pods run are that wheel's entry points, and it
runs as the uid and gid the manifests ask for."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.kustomize import build

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "Containerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each line, continuations joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", CONTAINERFILE.read_text())
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def copied_sources() -> list[str]:
    """What the build stage copies from the build context."""
    sources = []
    for word, rest in instructions():
        if word == "COPY" and not rest.startswith("--from"):
            *src, _ = rest.split()
            sources += src
    return sources


@pytest.mark.timeout(300)
def test_the_copied_files_alone_build_the_wheel(tmp_path: Path) -> None:
    context = tmp_path / "context"
    tracked = subprocess.run(
        ["git", "ls-files", "-z", *copied_sources()],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout.split(b"\0")
    files = [f.decode() for f in tracked if f]
    assert files, copied_sources()
    for name in files:
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, context / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*pip_wheel, "--wheel-dir", str(tmp_path / "wheels"), str(context)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "wheels").glob("simpler_daemon-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        scripts = set(re.findall(r"^([\w-]+) =", z.read(entry_points).decode(), re.M))
    assert any(re.match(r"simpler_daemon/mailbox/_mailbox\..*\.so$", n) for n in names), names
    # The programs the pods' args start, and the image's default command.
    programs = {
        c["args"][0]
        for r in build("base")
        if r["kind"] in ("Deployment", "StatefulSet")
        for c in r["spec"]["template"]["spec"]["containers"]
    }
    cmd = next(rest for word, rest in instructions() if word == "CMD")
    programs.add(re.findall(r'"([^"]+)"', cmd)[0])
    assert programs == {"simpler-daemon", "simpler-remote-worker"}
    assert programs <= scripts, scripts


def test_it_runs_as_the_manifests_user_under_tini() -> None:
    steps = instructions()
    (user,) = [rest for word, rest in steps if word == "USER"]
    uid, gid = (int(x) for x in user.split(":"))
    assert uid != 0
    for r in build("base"):
        if r["kind"] in ("Deployment", "StatefulSet"):
            ctx = r["spec"]["template"]["spec"]["securityContext"]
            assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"]) == (uid, gid, gid)
            # Args only: a command would replace the image's tini entry point.
            for c in r["spec"]["template"]["spec"]["containers"]:
                assert "command" not in c, c["name"]
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    assert f"--uid {uid}" in runs and f"--gid {gid}" in runs
    (entry,) = [rest for word, rest in steps if word == "ENTRYPOINT"]
    assert entry.startswith('["/usr/bin/tini", "--"')
    assert "install -y --no-install-recommends tini" in runs
