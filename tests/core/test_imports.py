"""What importing the package costs and what it offers, each checked in a fresh interpreter
(``sys.executable -c``, this process's environment): the layering rules of the package
(``import simpler_daemon`` loads no grpc; the client loads no engine), the public names
and the console scripts. Plus the size rules: no hand-written module past 800 lines, at
most 10 modules at the package root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "simpler_daemon"

#: Every name ``simpler_daemon.client`` exported before the package was split into folders.
CLIENT_NAMES = [
    "CLIENT_ID_METADATA",
    "AsyncClient",
    "AsyncFastTransport",
    "AsyncRunFuture",
    "CancelResult",
    "Client",
    "DEFAULT_TIMEOUT",
    "DoneWatcher",
    "ENV_TARGET",
    "ENV_TOKEN",
    "ENV_TRANSPORT",
    "FastTransport",
    "RunFuture",
    "RunPhase",
    "RunResult",
    "RunSummaryInfo",
    "TERMINAL_STATES",
    "TRANSPORTS",
    "add_remote_request",
    "alloc_request",
    "array_bytes",
    "call_config",
    "call_deadline",
    "cancel_request",
    "cancel_result",
    "check_result",
    "check_wait",
    "default_target",
    "drain_request",
    "list_runs_request",
    "make_args",
    "mapped_errors",
    "orchestration_request",
    "raise_for_status",
    "read_request",
    "register_request",
    "run_result",
    "run_summary",
    "sub_task",
    "submit_request",
    "task",
    "tensor",
    "wait_request",
    "write_chunk",
    "write_requests",
]
TESTING_NAMES = [
    "poll_for",
    "child_pids",
    "descendants",
    "foreign_heap",
    "leaked_shm",
    "proc_state",
    "self_signed_cert",
    "settled_shm_leaks",
    "shm_files",
    "stopped",
    "alive",
    "track_spawned_processes",
    "note_descendants",
]
#: What ``import simpler_daemon.client`` must not load: the engine, its children and the
#: programs (the C extension is ``simpler_daemon.mailbox._mailbox``).
NOT_FOR_THE_CLIENT = (
    "simpler_daemon.engine",
    "simpler_daemon.scheduler",
    "simpler_daemon.children",
    "simpler_daemon.endpoints",
    "simpler_daemon.mailbox",
    "simpler_daemon.server",
    "simpler_daemon.remote_worker",
    "simpler_daemon.cli",
)
CONSOLE_SCRIPTS = (
    "simpler-daemon",
    "simplerctl",
    "simpler-remote-worker",
    "simpler-remote-l3-session",
)


def fresh(code: str) -> str:
    """Run ``code`` in a new interpreter with this process's environment; its stdout."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def modules_after(statement: str) -> set[str]:
    """The names in ``sys.modules`` of a fresh interpreter once ``statement`` ran."""
    out = fresh(f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))")
    return set(json.loads(out.splitlines()[-1]))


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_import_simpler_daemon_loads_no_grpc_and_no_submodule() -> None:
    before = modules_after("pass")
    loaded = modules_after("import simpler_daemon") - before
    assert "simpler_daemon" in loaded
    assert not [m for m in loaded if under(m, "grpc")]
    assert sorted(m for m in loaded if under(m, "simpler_daemon")) == ["simpler_daemon"]


def test_import_simpler_daemon_client_loads_no_engine_module() -> None:
    loaded = modules_after("import simpler_daemon.client")
    assert "simpler_daemon.client" in loaded
    wrong = sorted(m for m in loaded for p in NOT_FOR_THE_CLIENT if under(m, p))
    assert not wrong, f"import simpler_daemon.client loaded {wrong}"


def test_the_public_names_and_the_version() -> None:
    out = fresh(
        "import importlib.metadata\n"
        "from simpler_daemon import (Worker, TaskArgs, Tag, CallConfig, CallableHandle,\n"
        "    RunHandle, Orchestrator, RemoteWorkerSpec, SimplerError, WorkerStateError,\n"
        "    __version__)\n"
        "print(__version__)\n"
        "print(importlib.metadata.version('simpler-daemon'))\n"
    )
    version, metadata = out.split()
    assert version == metadata


def test_the_client_and_the_testing_toolkit_keep_every_name() -> None:
    out = fresh(
        "import json, simpler_daemon.client as c, simpler_daemon.testing as t\n"
        f"print(json.dumps([[n for n in {CLIENT_NAMES!r} if not hasattr(c, n)],\n"
        f"                  [n for n in {TESTING_NAMES!r} if not hasattr(t, n)]]))\n"
    )
    missing_client, missing_testing = json.loads(out)
    assert missing_client == [], f"simpler_daemon.client lost {missing_client}"
    assert missing_testing == [], f"simpler_daemon.testing lost {missing_testing}"


def test_the_cli_main_and_every_console_script_resolve() -> None:
    out = fresh(
        "import importlib.metadata, json\n"
        "from simpler_daemon.cli import main\n"
        "assert callable(main)\n"
        "eps = importlib.metadata.entry_points(group='console_scripts')\n"
        "found = {}\n"
        f"for name in {CONSOLE_SCRIPTS!r}:\n"
        "    (ep,) = eps.select(name=name)\n"
        "    found[name] = [ep.value, callable(ep.load())]\n"
        "print(json.dumps(found))\n"
    )
    found = json.loads(out)
    assert sorted(found) == sorted(CONSOLE_SCRIPTS)
    assert all(loads for _, loads in found.values()), found
    assert found["simplerctl"][0] == "simpler_daemon.cli:main"


def test_no_hand_written_module_is_past_800_lines_and_the_root_stays_small() -> None:
    generated = PACKAGE / "protocol" / "_proto"
    sizes = {
        str(p.relative_to(REPO)): len(p.read_text().splitlines())
        for p in PACKAGE.rglob("*.py")
        if not p.is_relative_to(generated)
    }
    assert sizes, "no module found under simpler_daemon/"
    too_long = {name: n for name, n in sizes.items() if n > 800}
    assert not too_long, f"modules past 800 lines: {too_long}"
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 10, f"{len(root)} modules at the package root: {root}"
