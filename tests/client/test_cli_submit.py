"""``simplerctl submit`` owns what it creates.

* Retries: ``test_retry_with_a_key_reports_the_original_run`` /
  ``test_retry_after_the_outputs_were_freed_refuses`` /
  ``test_retry_without_wait_names_the_original_buffers``: a retry with an idempotency
  key reports the run the key names and the buffers it really used, or refuses.
* Buffers and registrations: ``test_submits_free_their_buffers_and_reuse_registrations``,
  ``test_full_heap_is_its_own_exit_status``, ``test_unregister_and_info_heap``.
* Bad input refused before it costs anything: ``test_huge_shape_is_refused_before_allocating``
  (and the fill overflows in tests/client/test_cli_spec.py); results printed:
  ``test_submit_wait_prints_task_results``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from simpler_daemon.cli import simplerctl as cli
from tests.support.ctl import Ctl
from tests.support.daemon_harness import (
    EXAMPLES,
    REPO,
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    wait_until,
)

pytestmark = pytest.mark.timeout(90)

RUN_TOML = (REPO / "examples" / "run.toml").read_text()
EXPECTED_OUT = [(i + 10) * 2.0 for i in range(8)]

BIG = f"""\
[buffers.big]
shape = [{6 << 20}]
dtype = "uint8"
fill = 1

[[tasks]]
callable = "{EXAMPLES}:fill"
tensors = [{{ buffer = "big", tag = "output" }}]
scalars = [7]
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    # A 16 MiB heap: three 6 MiB submits that leaked their buffers would exhaust it.
    # tests.support.daemon_tasks: a callable that returns a value (echo).
    modules = ["simpler_daemon.examples", "tests.support.daemon_tasks"]
    yield from module_daemon(
        tmp_path_factory, "ctl-submit", {"callables": {"allowed_modules": modules}}
    )


@pytest.fixture(autouse=True)
def no_leaked_children(daemon: DaemonProcess) -> Iterator[None]:
    yield from module_leak_guard(lambda: {daemon.pid})


@pytest.fixture
def ctl(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str]) -> Ctl:
    return Ctl(daemon.socket, capsys)


def _buffers(ctl: Ctl) -> list[dict[str, Any]]:
    return ctl.json("buffers")["buffers"]  # type: ignore[no-any-return]


def _used(ctl: Ctl) -> int:
    return int(ctl.json("buffers")["heap"].get("used_bytes", 0))


def test_retry_with_a_key_reports_the_original_run(ctl: Ctl, tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(RUN_TOML)
    first = ctl.json("submit", str(spec), "--wait", "--keep", "--idempotency-key", "k2")
    assert first["contents"]["out"] == EXPECTED_OUT and first["deduplicated"] is False
    # The retry: the same run, its real outputs (not fresh zeros), then its buffers freed.
    code, out, err = ctl("submit", str(spec), "--wait", "--idempotency-key", "k2")
    assert code == 0, err
    assert f"run {first['run_id']}: COMPLETED" in out and "deduplicated" in out
    assert str(EXPECTED_OUT) in out
    second = ctl.json("submit", str(spec), "--wait", "--idempotency-key", "k2b")
    assert second["run_id"] != first["run_id"]
    ids = set(first["buffers"].values()) | set(second["buffers"].values())
    assert not ids & {b["buffer_id"] for b in _buffers(ctl)}


def test_retry_after_the_outputs_were_freed_refuses(ctl: Ctl, tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(RUN_TOML)
    code, out, err = ctl("submit", str(spec), "--wait", "--idempotency-key", "k-gone")
    assert code == 0 and str(EXPECTED_OUT) in out
    before = _buffers(ctl)
    code, out, err = ctl("submit", str(spec), "--wait", "--idempotency-key", "k-gone")
    assert code == cli.EXIT_REFUSED, (out, err)
    assert "COMPLETED" not in out and "0.0, 0.0" not in out
    assert "idempotency key 'k-gone'" in err and "buffers its first submit created are gone" in err
    assert _buffers(ctl) == before  # the retry's fresh buffers were freed


def test_retry_without_wait_names_the_original_buffers(ctl: Ctl, tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text(RUN_TOML)
    first = ctl.json("submit", str(spec), "--idempotency-key", "k3")
    again = ctl.json("submit", str(spec), "--idempotency-key", "k3")
    assert again == {**first, "deduplicated": True}
    listed = {b["buffer_id"] for b in _buffers(ctl)}
    assert set(first["buffers"].values()) <= listed and len(listed) >= 3
    ctl.json("wait", str(first["run_id"]))
    code, out, _ = ctl("free", *map(str, first["buffers"].values()))
    assert code == 0 and out.count("freed") == 3
    assert not set(first["buffers"].values()) & {b["buffer_id"] for b in _buffers(ctl)}


def test_submits_free_their_buffers_and_reuse_registrations(ctl: Ctl, tmp_path: Path) -> None:
    spec = tmp_path / "big.toml"
    spec.write_text(BIG)

    def refs() -> dict[str, int]:
        return {x["import_path"]: x["refcount"] for x in ctl.json("callables")}

    before = refs()
    used = _used(ctl)
    for _ in range(4):  # 24 MiB through a 16 MiB heap
        code, _out, err = ctl("submit", str(spec), "--wait")
        assert code == 0, err
        assert _used(ctl) == used
    # A submit's registrations belong to its process's session: released as it exits.
    wait_until(lambda: refs() == before, timeout=30.0, message="registrations outlived submits")


def test_full_heap_is_its_own_exit_status(ctl: Ctl, tmp_path: Path) -> None:
    spec = tmp_path / "big.toml"
    spec.write_text(BIG)
    kept = [ctl.json("submit", str(spec), "--wait", "--keep")["buffers"]["big"] for _ in range(2)]
    used = _used(ctl)
    code, _, err = ctl("submit", str(spec), "--wait")
    assert code == cli.EXIT_EXHAUSTED  # not EXIT_USAGE: nothing was wrong with the command
    assert "RESOURCE_EXHAUSTED" in err and "simplerctl free" in err
    assert _used(ctl) == used  # nothing of the refused submit stays
    code, _out, _ = ctl("free", *map(str, kept))
    assert code == 0
    code, _, err = ctl("free", str(kept[0]))
    assert code == cli.EXIT_NOT_FOUND and "NOT_FOUND" in err


def test_unregister_and_info_heap(ctl: Ctl) -> None:
    path = f"{EXAMPLES}:empty"
    first = ctl.json("register", path)
    second = ctl.json("register", path)
    assert second["refcount"] == first["refcount"] + 1
    code, out, _ = ctl("unregister", path)
    assert code == 0 and f"{first['refcount']} left" in out
    left = ctl.json("unregister", second["hashid"])
    assert left["refcount"] == first["refcount"] - 1
    code, _, err = ctl("unregister", f"{EXAMPLES}:nothing_here")
    assert code == cli.EXIT_NOT_FOUND and "no callable registered" in err

    code, out, _ = ctl("info")
    heap = next(line for line in out.splitlines() if line.startswith("heap:"))
    assert "used of 16.0 MiB" in heap and "free" in heap, heap
    code, out, _ = ctl("buffers")
    assert "heap: " in out and "MiB" in out


def test_huge_shape_is_refused_before_allocating(ctl: Ctl, tmp_path: Path) -> None:
    spec = tmp_path / "huge.toml"
    spec.write_text(BIG.replace(f"shape = [{6 << 20}]", "shape = [100000000000]"))
    before = _buffers(ctl)
    code, _, err = ctl("submit", str(spec), "--wait")
    # Not a numpy MemoryError traceback: the daemon's per-buffer limit, named.
    assert code == cli.EXIT_EXHAUSTED, err
    assert "buffers.big.shape" in err and "limits.max_buffer_bytes (8388608 bytes)" in err
    assert _buffers(ctl) == before
    spec.write_text(BIG.replace("fill = 1", "fill = 1e400"))
    code, _, err = ctl("submit", str(spec), "--wait")
    assert code == cli.EXIT_USAGE and "buffers.big.fill: 1e400 is out of range" in err
    spec.write_text(BIG.replace("fill = 1", "fill = 256"))  # uint8
    code, _, err = ctl("submit", str(spec), "--wait")
    assert code == cli.EXIT_USAGE and "buffers.big.fill: 256 is out of range of uint8" in err
    assert _buffers(ctl) == before


def test_submit_wait_prints_task_results(ctl: Ctl, tmp_path: Path) -> None:
    spec = tmp_path / "echo.json"
    spec.write_text('{"tasks": [{"callable": "tests.support.daemon_tasks:echo", "scalars": [41]}]}')
    for follow in ("--wait", "--watch"):
        code, out, err = ctl("submit", str(spec), follow)
        assert code == 0, err
        assert "task 0 returned {'scalars': [41], 'pid': " in out, out
