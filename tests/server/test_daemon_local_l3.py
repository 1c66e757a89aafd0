"""A level-4 daemon with ``[[workers.local]]`` L3 workers: config rules, the ListWorkers
tree (L4 -> L3 -> SUB / chip) and a NEXT_LEVEL task that runs an L3 orchestration.

The config cases and the row mapping need no daemon; the last test starts a real
``simpler-daemon serve`` (tests/support/daemon_harness.py) whose one local L3 has one SUB
worker, and checks that every pid of the tree is gone after SIGTERM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from simpler_daemon.callables import CallableHandle
from simpler_daemon.cli.output import worker_header, worker_rows
from simpler_daemon.client.requests import task
from simpler_daemon.errors import ConfigError
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server import config as cfg
from simpler_daemon.server.config import DaemonConfig
from simpler_daemon.server.workers import worker_info
from simpler_daemon.testing import poll_for
from tests.support.daemon_harness import EXAMPLES, REPO, running_daemon, tree_pids

pytestmark = pytest.mark.timeout(90)

L4 = "[daemon]\nlevel = 4\n[workers]\nnum_sub_workers = 0\n"
LOCAL = "[[workers.local]]\n"
ONE_EMPTY = "simpler_daemon.examples.remote:one_empty"


def through_local_l3(o: Any, args: Any, config: Any) -> None:
    """An L4 orchestration (RunOrchestration imports it in the daemon): ``one_empty`` on
    local L3 worker ``args.scalars[0]``."""
    o.submit_next_level(CallableHandle.for_import(ONE_EMPTY), worker=int(args.scalars[0]))


def load_text(tmp_path: Path, text: str, **kwargs: Any) -> DaemonConfig:
    path = tmp_path / "daemon.toml"
    path.write_text(text)
    kwargs.setdefault("env", {})
    return cfg.load(path, **kwargs)


# --------------------------------------------------------------------------- config


def test_local_tables_load_with_defaults_and_round_trip(tmp_path: Path) -> None:
    config = load_text(
        tmp_path,
        L4
        + LOCAL
        + f"callables = [{{target = '{EXAMPLES}:empty', kind = 'sub'}}]\n"
        + LOCAL
        + "num_sub_workers = 0\nnum_chips = 2\nchip_pipeline_depth = 1\nheap_bytes = 4096\n"
        + f"callables = [{{target = '{EXAMPLES}:fill', kind = 'chip'}}]\n",
    )
    first, second = config.workers.local
    assert first == cfg.LocalWorkerConfig(
        callables=[cfg.LocalCallableConfig(target=f"{EXAMPLES}:empty", kind="sub")]
    )
    assert (first.num_sub_workers, first.num_chips, first.chip_pipeline_depth) == (1, 0, 2)
    assert first.heap_bytes == 64 * cfg.MIB
    assert (second.num_sub_workers, second.num_chips, second.heap_bytes) == (0, 2, 4096)
    assert config.workers.num_chips == 0  # the daemon's own: none at level 4
    assert load_text(tmp_path, cfg.dump(config)) == config


def test_local_tables_from_the_environment(tmp_path: Path) -> None:
    config = load_text(
        tmp_path, L4, env={"SIMPLER_DAEMON__WORKERS__LOCAL": "[{num_sub_workers = 3}]"}
    )
    assert config.workers.local == [cfg.LocalWorkerConfig(num_sub_workers=3)]


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        (
            "[workers]\nnum_chips = 0\n" + LOCAL,
            "workers.local",
            "[[workers.local]] tables need daemon.level = 4 (it is 3)",
        ),
        (L4 + LOCAL + "num_chips = -1\n", "workers.local[0].num_chips", "must be >= 0, got -1"),
        (
            L4 + LOCAL + LOCAL + "num_sub_workers = -2\n",
            "workers.local[1].num_sub_workers",
            "must be >= 0, got -2",
        ),
        (L4 + LOCAL + "heap_bytes = 0\n", "workers.local[0].heap_bytes", "must be > 0, got 0"),
        (
            L4 + LOCAL + "chip_pipeline_depth = 3\n",
            "workers.local[0].chip_pipeline_depth",
            "choose one of 1, 2",
        ),
        (L4 + LOCAL + "endpoint = '127.0.0.1:1'\n", "workers.local[0].endpoint", "unknown"),
        (
            L4 + LOCAL + "callables = [{target = 'simpler_daemon.examples.tasks.empty', "
            "kind = 'sub'}]\n",
            "workers.local[0].callables[0].target",
            "must be 'module:qualname'",
        ),
        (
            L4 + LOCAL + "callables = [{target = 'os:system', kind = 'sub'}]\n",
            "workers.local[0].callables[0].target",
            "module 'os' is not under callables.allowed_modules (simpler_daemon.examples)",
        ),
        (
            L4 + LOCAL + f"callables = [{{target = '{EXAMPLES}:fill', kind = 'chip'}}]\n",
            "workers.local[0].callables[0].kind",
            '"chip" needs chips, but workers.local[0].num_chips is 0',
        ),
        (
            L4 + LOCAL + f"callables = [{{target = '{ONE_EMPTY}', kind = 'orchestration'}}]\n",
            "workers.local[0].callables[0].kind",
            '"orchestration" is not installed into one local L3 worker',
        ),
        (
            L4 + LOCAL + f"callables = [{{target = '{EXAMPLES}:empty', kind = 'kernel'}}]\n",
            "workers.local[0].callables[0].kind",
            "",
        ),
        (
            L4 + LOCAL + "callables = [{kind = 'sub'}]\n",
            "workers.local[0].callables[0].target",
            "required",
        ),
    ],
)
def test_local_table_errors_name_the_key(
    tmp_path: Path, text: str, key: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, text)
    assert info.value.key == key, str(info.value)
    assert key in str(info.value)
    assert expected in str(info.value)


# --------------------------------------------------------------------------- rows


def l3_row(**over: Any) -> dict[str, Any]:
    """A ``kind == "l3"`` row of ``Worker.list_workers()`` with one SUB and one chip child."""
    row: dict[str, Any] = {
        "kind": "l3",
        "worker_id": 0,
        "pid": 4100,
        "alive": True,
        "state": "ready",
        "poisoned": None,
        "busy": False,
        "tasks_completed": 3,
        "restarts": 1,
        "children": [
            {"kind": "chip", "worker_id": 0, "pid": 4101, "alive": True, "busy": True},
            {"kind": "sub", "worker_id": 0, "pid": 4102, "alive": False, "poisoned": None},
        ],
    }
    row.update(over)
    return row


def test_local_l3_row_becomes_a_worker_info_tree() -> None:
    info = worker_info(l3_row(), stopping=False)
    assert (info.worker_id, info.kind, info.state, info.pid) == (
        0,
        pb.WORKER_KIND_NESTED_L3,
        pb.WORKER_STATE_IDLE,
        4100,
    )
    assert (info.tasks_completed, info.restarts) == (3, 1)
    assert not info.HasField("remote")
    chip, sub = info.children
    assert (chip.kind, chip.state, chip.pid) == (pb.WORKER_KIND_CHIP, pb.WORKER_STATE_BUSY, 4101)
    assert (sub.kind, sub.state, sub.pid) == (pb.WORKER_KIND_SUB, pb.WORKER_STATE_FAILED, 4102)
    assert sub.message == "the child process exited"
    assert not chip.children and not sub.children

    dead = worker_info(
        l3_row(alive=False, state="exited", poisoned="killed by SIGKILL"), stopping=False
    )
    assert (dead.state, dead.message) == (pb.WORKER_STATE_FAILED, "killed by SIGKILL")
    stopping = worker_info(l3_row(), stopping=True)
    assert stopping.state == pb.WORKER_STATE_STOPPING
    assert {c.state for c in stopping.children} == {
        pb.WORKER_STATE_STOPPING,
        pb.WORKER_STATE_FAILED,
    }


def test_a_failed_remote_row_says_why() -> None:
    """engine/remote_l3.py names the cause ``reason``; it becomes ``WorkerInfo.message``."""
    row = {
        "kind": "remote",
        "worker_id": 1,
        "endpoint": "127.0.0.1:19073",
        "state": "failed",
        "reason": "health lane silent for 10.0 s",
    }
    info = worker_info(row, stopping=False)
    assert (info.state, info.message) == (pb.WORKER_STATE_FAILED, "health lane silent for 10.0 s")
    assert not info.children


def test_simplerctl_rows_indent_the_children() -> None:
    rows = worker_rows(
        [
            worker_info(l3_row(), stopping=False),
            worker_info(l3_row(worker_id=1, pid=4200, children=[]), stopping=False),
        ]
    )
    header = worker_header()
    table = [dict(zip(header, row, strict=True)) for row in rows]
    assert [(r["ID"], r["KIND"], r["PID"]) for r in table] == [
        ("0", "NESTED_L3", 4100),
        ("  0", "CHIP", 4101),
        ("  0", "SUB", 4102),
        ("1", "NESTED_L3", 4200),
    ]


# --------------------------------------------------------------------------- a real daemon


def level4_local() -> dict[str, dict[str, Any]]:
    return {
        "daemon": {"level": 4},
        "callables": {"allowed_modules": ["simpler_daemon.examples", __name__]},
        "workers": {
            "num_sub_workers": 0,
            "heap_bytes": 4 << 20,
            "local": [
                {
                    "num_sub_workers": 1,
                    "num_chips": 0,
                    "heap_bytes": 1 << 20,
                    "callables": [{"target": f"{EXAMPLES}:empty", "kind": "sub"}],
                }
            ],
        },
    }


def simplerctl(socket: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "simpler_daemon.cli", "--socket", socket, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_level4_daemon_runs_next_level_tasks_on_a_local_l3(tmp_path: Path) -> None:
    with running_daemon(tmp_path / "daemon", level4_local()) as d, d.client() as c:
        assert c.get_info().level == 4
        assert c.get_info().num_next_level_workers == 1

        # The tree: one local L3 (worker 0) whose one SUB child is a grandchild.
        (l3,) = c.list_workers()
        assert (l3.worker_id, l3.kind, l3.state) == (
            0,
            pb.WORKER_KIND_NESTED_L3,
            pb.WORKER_STATE_IDLE,
        ), l3
        assert l3.pid > 0 and l3.pid != d.pid
        (sub,) = l3.children
        assert (sub.kind, sub.state) == (pb.WORKER_KIND_SUB, pb.WORKER_STATE_IDLE), sub
        assert sub.pid > 0 and sub.pid not in (l3.pid, d.pid)
        with open(f"/proc/{sub.pid}/stat") as fh:  # the SUB worker is the L3's child
            assert int(fh.read().rpartition(")")[2].split()[1]) == l3.pid
        assert set(d.worker_pids) == {l3.pid, sub.pid}

        # An L3 orchestration (it submits the `empty` SUB callable the table installed).
        hashid = c.register(ONE_EMPTY, kind="orchestration")
        for _ in range(3):
            status = c.run([task("next_level", hashid, [pb.Args()], workers=[0])], timeout=30)
            assert status.state == pb.RUN_STATE_COMPLETED, status

        # A target that is not a NEXT_LEVEL worker is refused naming the task's field.
        with pytest.raises(grpc.RpcError) as info:
            c.run([task("next_level", hashid, [pb.Args()], workers=[5])], timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "tasks[0].workers[0]" in str(info.value.details())
        assert "known: [0]" in str(info.value.details())

        # RunOrchestration: an L4 orchestration function targets the L3 by id.
        orch = c.register(f"{__name__}:through_local_l3", kind="orchestration")
        run_id = c.run_orchestration(orch, pb.Args(scalars=[0]))
        assert c.wait(run_id, timeout=30).state == pb.RUN_STATE_COMPLETED

        (l3,) = c.list_workers()
        assert l3.tasks_completed == 4, l3
        assert l3.state == pb.WORKER_STATE_IDLE

        listed = simplerctl(d.socket, "--json", "workers")
        assert listed.returncode == 0, listed.stderr
        (row,) = json.loads(listed.stdout)
        assert (row["worker_id"], row["kind"], row["pid"]) == (0, "NESTED_L3", l3.pid)
        assert [(x["kind"], x["pid"]) for x in row["children"]] == [("SUB", sub.pid)]

        text = simplerctl(d.socket, "workers")
        assert text.returncode == 0, text.stderr
        lines = text.stdout.splitlines()
        assert lines[0].split()[:4] == ["ID", "KIND", "STATE", "PID"]
        assert lines[1].split()[:4] == ["0", "NESTED_L3", "IDLE", str(l3.pid)]
        assert lines[2].startswith("  0") and lines[2].split()[:4] == [
            "0",
            "SUB",
            "IDLE",
            str(sub.pid),
        ]
        pids = tree_pids(c.list_workers())
    # running_daemon stopped it (exit 0) and saw every pid of the tree disappear.
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]


def test_level4_daemon_start_fails_when_a_local_callable_cannot_be_imported(
    tmp_path: Path,
) -> None:
    """The L3's SUB grandchild imports it at start: start-up fails (exit 3) naming the
    L3 worker, its SUB worker and the missing name; the log maps worker 0 to its table.
    No process of the subtree is left (the conftest guard checks)."""
    overrides = level4_local()
    overrides["workers"]["local"][0]["callables"] = [
        {"target": f"{EXAMPLES}:no_such_function", "kind": "sub"}
    ]
    with pytest.raises(RuntimeError) as info, running_daemon(tmp_path / "daemon", overrides):
        pass
    text = str(info.value)
    assert "daemon exited with 3 before READY=1" in text
    assert "local L3 worker 0: 1 SUB workers, 0 chips (workers.local[0])" in text
    assert "child worker 0 (pid " in text and "sub worker 0 (pid " in text
    assert "has no attribute 'no_such_function'" in text


def test_local_tables_come_before_remote_tables_in_the_id_order(tmp_path: Path) -> None:
    """One ``[[workers.local]]`` and one ``[[workers.remote]]`` table: ids 0 (local) and 1
    (remote), and one run reaches both."""
    from tests.support.remote_worker import RemoteWorkerProcess

    remote = RemoteWorkerProcess(tmp_path)
    runner_pids: list[int] = []
    try:
        overrides = level4_local()
        overrides["workers"]["remote"] = [
            {
                "endpoint": remote.address,
                "num_sub_workers": 1,
                "session_timeout_s": 10.0,
                "heap_bytes": 4 << 20,
                "callables": [
                    {"target": "simpler_daemon.examples.remote:nothing", "kind": "orchestration"}
                ],
            }
        ]
        with running_daemon(tmp_path / "daemon", overrides) as d, d.client() as c:
            local, far = c.list_workers()
            assert (local.worker_id, local.kind, len(local.children)) == (
                0,
                pb.WORKER_KIND_NESTED_L3,
                1,
            )
            assert (far.worker_id, far.kind, len(far.children)) == (1, pb.WORKER_KIND_REMOTE_L3, 0)
            runner_pids.append(far.remote.runner_pid)

            one_empty = c.register(ONE_EMPTY, kind="orchestration")
            nothing = CallableHandle.for_import("simpler_daemon.examples.remote:nothing").hashid
            status = c.run(
                [
                    task("next_level", one_empty, [pb.Args()], workers=[0]),
                    task("next_level", nothing, [pb.Args()], workers=[1]),
                ],
                timeout=30,
            )
            assert status.state == pb.RUN_STATE_COMPLETED, status
            # A remote row carries no task count (engine/remote_l3.py lists none); the local does.
            assert c.list_workers()[0].tasks_completed == 1
    finally:
        remote.stop()
    poll_for(
        lambda: not [p for p in runner_pids if os.path.exists(f"/proc/{p}")],
        timeout=15.0,
        message=f"session runners {runner_pids} outlived the test",
    )
