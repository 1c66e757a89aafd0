"""Code execution: the allow-list, and bounded task views and time.

The allow-list: an allow-listed import path names a function defined in an allowed module;
the qualname may not walk into another module (``tasks:np.f2py.subprocess.Popen``)
nor name something an allowed module merely imported. Checked by the resolver
itself (every child, the daemon's orchestration imports, the remote worker).

Bounds: a tensor view is checked against its buffer (bytes reachable, elements
presented), and ``limits.max_task_seconds`` caps every task's time, enforced by the
parent (the child is killed, the run fails with ``deadline exceeded``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from simpler_daemon.args import ViewError, check_view
from simpler_daemon.callables import (
    import_policy,
    load_spec,
    resolve_import,
    restrict_imports,
    spec_for_import,
)
from simpler_daemon.client import sub_task, tensor
from simpler_daemon.errors import TaskError
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from tests.support.daemon_harness import (
    EXAMPLES,
    DaemonProcess,
    running_daemon,
)

pytestmark = pytest.mark.timeout(120)

ALLOWED = ("simpler_daemon.examples",)
#: Paths under an allowed module that reach code of other modules.
BYPASSES = [
    f"{EXAMPLES}:np._pytesttester.os.system",
    f"{EXAMPLES}:np.f2py.subprocess.Popen",
    f"{EXAMPLES}:np._core.numeric.builtins.eval",
    f"{EXAMPLES}:np._pytesttester.os.kill",
    f"{EXAMPLES}:time.sleep",  # a module the allowed module imported
    f"{EXAMPLES}:spec_for_import",  # a function it imported from another module
    f"{EXAMPLES}:Tag.INPUT",  # a class it imported, and not a function
]


def _split(path: str) -> tuple[str, str]:
    module, _, qualname = path.partition(":")
    return module, qualname


# ----------------------------------------------------------------------------- allow-list, unit


@pytest.fixture
def no_policy() -> Iterator[None]:
    """Tests that set the process-wide policy leave the process unrestricted."""
    assert import_policy() is None
    try:
        yield
    finally:
        restrict_imports(None)


@pytest.mark.parametrize("path", BYPASSES)
def test_resolver_refuses_paths_out_of_the_allowed_modules(path: str) -> None:
    with pytest.raises(PermissionError, match="cannot use " + path.replace(".", r"\.")):
        resolve_import(*_split(path), ALLOWED)


def test_resolver_names_the_reason() -> None:
    with pytest.raises(PermissionError, match="'np' is the module 'numpy'; a qualname must not"):
        resolve_import(*_split(BYPASSES[1]), ALLOWED)
    with pytest.raises(PermissionError, match=r"defined in 'simpler_daemon\.callables', outside"):
        resolve_import(*_split(f"{EXAMPLES}:spec_for_import"), ALLOWED)
    with pytest.raises(PermissionError, match="it is of type int, not a function"):
        resolve_import(*_split(f"{EXAMPLES}:MAX_WAIT_MS"), ALLOWED)
    with pytest.raises(PermissionError, match="module 'os' is not under the allowed modules"):
        resolve_import("os", "kill", ALLOWED)
    # A module __getattr__ is not consulted: a missing name stays an AttributeError.
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        resolve_import(EXAMPLES, "nope", ALLOWED)


def test_resolver_accepts_functions_and_class_methods(tmp_path: Path) -> None:
    from simpler_daemon.examples import tasks

    assert resolve_import(EXAMPLES, "fill", ALLOWED) is tasks.fill
    pkg = tmp_path / "sec_exec_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import os\n"
        "class Kernels:\n"
        "    @staticmethod\n"
        "    def s(args): return 1\n"
        "    @classmethod\n"
        "    def c(cls, args): return 2\n"
        "    system = os.system\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        assert resolve_import("sec_exec_pkg", "Kernels.s", ("sec_exec_pkg",))(None) == 1
        assert resolve_import("sec_exec_pkg", "Kernels.c", ("sec_exec_pkg",))(None) == 2
        with pytest.raises(PermissionError, match="defined in 'posix'"):
            resolve_import("sec_exec_pkg", "Kernels.system", ("sec_exec_pkg",))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("sec_exec_pkg", None)


def test_process_policy_applies_to_what_children_load(no_policy: None) -> None:
    """A child resolves the paths it is sent with ``load_spec``: the policy the daemon
    set before forking applies there, without the allow-list being passed along."""
    assert callable(load_spec(BYPASSES[0], None))  # unrestricted: the library's own use
    restrict_imports(ALLOWED)
    for path in BYPASSES:
        with pytest.raises(PermissionError, match="cannot use"):
            load_spec(path, None)
    assert load_spec(f"{EXAMPLES}:fill", None) is not None


def test_remote_worker_refuses_the_bypass() -> None:
    from simpler_daemon.remote_worker.controls import InstallError, check_target

    path = BYPASSES[1]
    hashid = spec_for_import(path, "sub").handle.hashid
    with pytest.raises(InstallError, match="must not reach into another module"):
        check_target(path, "sub", hashid, ALLOWED)


# ----------------------------------------------------------------------------- bounds, unit


def test_check_view_bounds_elements_and_bytes() -> None:
    # The attack: a stride-0 view over one byte claiming 2**40 elements (1 TiB presented).
    with pytest.raises(ViewError, match="1099511627776 elements") as info:
        check_view((1 << 40,), (0,), 1, 0, 1, max_view_bytes=1 << 30)
    assert info.value.field == "shape"
    # Inside the buffer: C-contiguous, negative strides, broadcast within the limit.
    assert check_view((2, 3), (12, 4), 4, 0, 24, max_view_bytes=1 << 30) == (0, 24)
    assert check_view((6,), (-4,), 4, 20, 24, max_view_bytes=1 << 30) == (0, 24)
    assert check_view((1000,), (0,), 4, 4, 8, max_view_bytes=1 << 30) == (4, 8)
    assert check_view((0, 1 << 62), (0, 8), 8, 8, 8, max_view_bytes=8) == (8, 8)
    # Outside: one element too many, a negative stride below the start, the offset.
    with pytest.raises(
        ViewError, match=r"reaches bytes \[0, 28\): it overruns the buffer of 24"
    ) as info:
        check_view((7,), (4,), 4, 0, 24, max_view_bytes=1 << 30)
    assert info.value.field == "strides"
    with pytest.raises(ViewError, match=r"reaches bytes \[-4, 4\)"):
        check_view((2,), (-4,), 4, 0, 24, max_view_bytes=1 << 30)
    with pytest.raises(ViewError) as info:
        check_view((1,), (4,), 4, 24, 24, max_view_bytes=1 << 30)
    assert info.value.field == "byte_offset"
    with pytest.raises(ViewError) as info:
        check_view((2,), (1 << 63,), 1, 0, 24, max_view_bytes=1 << 30)
    assert info.value.field == "strides"


# ----------------------------------------------------------------------------- the daemon
def test_daemon_refuses_the_bypass(tmp_path: Path) -> None:
    """SUB callables are resolved by the children, orchestration functions by the
    daemon itself: both refuse, and the daemon keeps serving allowed functions."""
    with running_daemon(tmp_path) as daemon, daemon.client() as c:
        for kind in ("sub", "orchestration"):
            for path in BYPASSES[:4]:
                with pytest.raises(grpc.RpcError) as info:
                    c.register_callable(path, kind)
                details = info.value.details() or ""
                assert details.startswith("import_path"), (kind, path, details)
                assert "must not reach into another module" in details, (kind, path, details)
        assert not c.list_callables()
        fill = c.register(f"{EXAMPLES}:fill")
        buf = c.alloc_buffer((4,), "float32", label="after-bypass")
        c.run([sub_task(fill, [tensor(buf.buffer_id, "output", (4,), "float32")], [3])], 30)


def test_daemon_refuses_a_preload_bypass(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, {"callables": {"preload": [BYPASSES[0]]}})
    try:
        with pytest.raises(RuntimeError, match="must not reach into another module"):
            daemon.start()
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop()  # it started (the old code): SIGTERM lets it remove its heap
        daemon.kill()


def test_daemon_refuses_a_stride0_view_of_2_40_elements(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as daemon, daemon.client() as c:
        empty = c.register(f"{EXAMPLES}:empty")
        one = c.alloc_buffer((1,), "uint8", label="one-byte")
        ref = tensor(one.buffer_id, "output", (1 << 40,), "uint8", strides=(0,))
        request = pb.SubmitRunRequest(tasks=[sub_task(empty, [ref])])
        assert request.ByteSize() < 160  # the attack costs its sender about 106 bytes
        with pytest.raises(grpc.RpcError) as info:
            c.stub.SubmitRun(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = info.value.details() or ""
        assert "tensors[0].shape" in details and "1099511627776 elements" in details
        # Overruns are refused too, naming the field; a broadcast within bounds runs.
        ref = tensor(one.buffer_id, "output", (2,), "uint8", strides=(1,))
        with pytest.raises(grpc.RpcError) as info:
            c.stub.SubmitRun(pb.SubmitRunRequest(tasks=[sub_task(empty, [ref])]), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tensors[0].strides" in (info.value.details() or "")
        ref = tensor(one.buffer_id, "input", (64,), "uint8", strides=(0,))
        c.run([sub_task(empty, [ref])], 30)


def test_max_task_seconds_kills_a_stuck_task(tmp_path: Path) -> None:
    overrides: dict[str, dict[str, Any]] = {
        "limits": {"max_task_seconds": 1.0},
        "callables": {"allowed_modules": ["simpler_daemon.examples", "tests.support.sub_tasks"]},
    }
    with running_daemon(tmp_path, overrides) as daemon, daemon.client() as c:
        sleep = c.register("tests.support.sub_tasks:sleep_ms")
        run_id = c.submit([sub_task(sleep, [], [60_000])])
        with pytest.raises(TaskError, match=r"deadline exceeded \(1000 ms\)"):
            c.wait(run_id, timeout=60)
        # A shorter deadline of the client's own still applies.
        config = pb.CallConfig(deadline_ms=300)
        run_id = c.submit([sub_task(sleep, [], [60_000], config=config)])
        with pytest.raises(TaskError, match=r"deadline exceeded \(300 ms\)"):
            c.wait(run_id, timeout=60)
        # Later runs proceed (the killed children were replaced).
        fill = c.register(f"{EXAMPLES}:fill")
        buf = c.alloc_buffer((4,), "float32", label="after-deadline")
        for _ in range(3):
            c.run([sub_task(fill, [tensor(buf.buffer_id, "output", (4,), "float32")], [1])], 30)
