"""Running your own code: ``callables.python_path``, a registration that "failed on every
worker" (and says why), and ``register(..., reload=True)``.

A module is written into a temp directory on the import path, registered, run as a
SUB group (one member per child, so every child shows what it runs), edited, reloaded
and run again: every child runs the new code, under the same hashid and refcount. The
same through a real daemon whose config names the directory in ``callables.python_path``.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import uuid
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from simpler_daemon import Tag, Worker
from simpler_daemon.callables import import_policy, restrict_imports
from simpler_daemon.client.requests import make_args, register_request, task, tensor
from simpler_daemon.errors import ConfigError, RegistrationError, TaskError
from simpler_daemon.server import config as cfg
from tests.support.daemon_harness import running_daemon
from tests.support.sub_tasks import targs

pytestmark = pytest.mark.timeout(120)

#: Version ``value`` of the module under test: each member writes (value, pid) into its
#: own row. Versions 1 and 2 have the same size (and may share an mtime second): the
#: reload must not trust the cached bytecode.
SOURCE = """import os


def stamp(args):
    args.tensors[0][0] = {value}
    args.tensors[0][1] = os.getpid()
"""

RAISING = """def stamp(args):
    raise RuntimeError("edited: version 3 raises")
"""

BROKEN = "def stamp(args:\n"


def write_module(directory: Path, name: str, text: str) -> Path:
    path = directory / f"{name}.py"
    path.write_text(text)
    return path


def fresh_name() -> str:
    return f"reload_tasks_{uuid.uuid4().hex[:10]}"


# -- in-process Worker ------------------------------------------------------------------------


def test_reload_runs_the_edited_code_on_every_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = fresh_name()
    src = write_module(tmp_path, name, SOURCE.format(value=1))
    monkeypatch.syspath_prepend(str(tmp_path))
    n = 3
    w = Worker(num_sub_workers=n, heap_bytes=4 << 20)
    w.init()
    try:
        h = w.register(f"{name}:stamp")
        out = w.alloc((n, 2), np.int64)

        def orch(o: Any, args: Any, config: Any) -> None:
            o.submit_sub_group(h, [targs((out[i], Tag.OUTPUT)) for i in range(n)])

        w.run(orch)
        assert out[:, 0].tolist() == [1] * n
        pids = set(out[:, 1].tolist())
        assert len(pids) == n  # one member per child

        src.write_text(SOURCE.format(value=2))
        again = w.register(f"{name}:stamp", reload=True)
        assert again == h
        assert w.registry.get(h.hashid).refcount == 1  # a reload is no new reference
        out[:] = 0
        w.run(orch)
        assert out[:, 0].tolist() == [2] * n
        assert set(out[:, 1].tolist()) == pids  # the same children, not replacements

        # The traceback shows the code that ran: the new one.
        src.write_text(RAISING)
        w.register(f"{name}:stamp", reload=True)
        with pytest.raises(TaskError) as info:
            w.run(orch)
        text = f"{info.value}\n{info.value.remote_text}"
        assert 'raise RuntimeError("edited: version 3 raises")' in text, text

        # Source that does not compile: refused on every worker, the last good code stays.
        src.write_text(BROKEN)
        with pytest.raises(RegistrationError) as failed:
            w.register(f"{name}:stamp", reload=True)
        assert failed.value.code == "REGISTER_FAILED"
        assert "failed on every worker" in str(failed.value)
        assert "SyntaxError" in str(failed.value)
        assert "PARTIAL" not in str(failed.value)
        with pytest.raises(TaskError, match="edited: version 3 raises"):
            w.run(orch)

        # A path that is not registered is no reload.
        with pytest.raises(RegistrationError) as missing:
            w.register(f"{name}:other", reload=True)
        assert missing.value.code == "NOT_REGISTERED"
        assert f"cannot reload {name}:other: it is not registered" in str(missing.value)
        with pytest.raises(TypeError, match="pass the import path"):
            w.register(len, reload=True)
    finally:
        w.close()


def test_reloading_an_orchestration_function_reimports_it_in_this_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = fresh_name()
    text = "VALUE = {value}\n\n\ndef orch(o, args, config):\n    return VALUE\n"
    src = write_module(tmp_path, name, text.format(value=1))
    monkeypatch.syspath_prepend(str(tmp_path))
    w = Worker(num_sub_workers=1, heap_bytes=4 << 20)
    w.init()
    try:
        h = w.register(f"{name}:orch", kind="orchestration")
        module = importlib.import_module(name)  # as the daemon does to run it
        assert module.VALUE == 1
        src.write_text(text.format(value=2))
        assert w.register(f"{name}:orch", kind="orchestration", reload=True) == h
        assert sys.modules[name] is module and module.VALUE == 2
    finally:
        w.close()
        sys.modules.pop(name, None)


def test_register_failing_on_every_worker_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = fresh_name()
    write_module(tmp_path, name, SOURCE.format(value=1))
    monkeypatch.syspath_prepend(str(tmp_path))
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20)
    w.init()
    try:
        with pytest.raises(RegistrationError) as info:
            w.register(f"{name}:no_such_function")
        err = info.value
        assert err.code == "REGISTER_FAILED"
        assert str(err).startswith(
            f"REGISTER_FAILED: cannot register {name}:no_such_function: failed on every worker: "
            "worker 0: "
        )
        assert set(err.failures) == {0, 1}
        assert not w.registry.active()
    finally:
        w.close()


@pytest.mark.asyncio
async def test_a_held_callable_is_not_dispatched_until_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dispatch hold a reload runs under: queued tasks of the callable wait (however
    many scheduler rounds run), then run once it ends; other callables are not held."""
    name = fresh_name()
    write_module(tmp_path, name, SOURCE.format(value=5))
    monkeypatch.syspath_prepend(str(tmp_path))
    # Fair admission: every admitted run dispatches (under fifo the held run, at the
    # head, would keep the other one waiting too).
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20, admission="fair")
    async with w:
        h = await w.register_async(f"{name}:stamp")
        other = await w.register_async("tests.support.sub_tasks:fill")
        out = w.alloc((2, 2), np.int64)
        filled = w.alloc((4,), np.int64)
        sched = w.scheduler
        assert sched is not None

        def orch(o: Any, args: Any, config: Any) -> None:
            o.submit_sub_group(h, [targs((out[i], Tag.OUTPUT)) for i in range(2)])

        with sched.holding(h.digest):
            held = await w.submit_async(orch)
            free = await w.submit_async(
                lambda o, a, c: o.submit_sub(other, targs((filled, Tag.OUTPUT), scalars=(4,)))
            )
            await asyncio.wait_for(free.wait_async(), 60)  # other callables still run
            for _ in range(200):
                sched.round()
                await asyncio.sleep(0)
            assert not held.done()
            assert held.run.counts["running"] == 0
            assert out[:, 0].tolist() == [0, 0]
        await asyncio.wait_for(held.wait_async(), 60)
        assert out[:, 0].tolist() == [5, 5]
        assert filled.tolist() == [4] * 4


@pytest.mark.asyncio
async def test_a_reload_amid_dispatch_never_mixes_old_and_new_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups (one member per child) keep being dispatched while a reload runs: every
    group ran one version on all its children, and in dispatch order (fifo) the versions
    never go back from new to old."""
    name = fresh_name()
    src = write_module(tmp_path, name, SOURCE.format(value=1))
    monkeypatch.syspath_prepend(str(tmp_path))
    n = 3
    w = Worker(num_sub_workers=n, heap_bytes=4 << 20)
    async with w:
        h = await w.register_async(f"{name}:stamp")
        outs = [w.alloc((n, 2), np.int64) for _ in range(31)]

        def group(out: Any) -> Any:
            def orch(o: Any, args: Any, config: Any) -> None:
                o.submit_sub_group(h, [targs((out[i], Tag.OUTPUT)) for i in range(n)])

            return orch

        handles = []
        reload: asyncio.Future[Any] | None = None
        for k, out in enumerate(outs[:-1]):
            handles.append(await w.submit_async(group(out)))
            if k == 10:
                src.write_text(SOURCE.format(value=2))
                reload = asyncio.ensure_future(w.register_async(f"{name}:stamp", reload=True))
        assert reload is not None
        assert await asyncio.wait_for(reload, 60) == h
        handles.append(await w.submit_async(group(outs[-1])))
        for handle in handles:
            await asyncio.wait_for(handle.wait_async(), 60)
        versions = [sorted(set(out[:, 0].tolist())) for out in outs]
        assert all(len(v) == 1 for v in versions), versions
        seq = [v[0] for v in versions]
        assert seq == sorted(seq) and seq[0] == 1 and seq[-1] == 2, seq


def test_children_resolve_under_the_allow_list_of_the_register(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A register carries the parent's current allow-list: a module allowed after the
    children were forked (a SIGHUP-reloaded ``callables.allowed_modules``) registers,
    one no longer allowed is refused in the children too."""
    first, second = fresh_name(), fresh_name()
    write_module(tmp_path, first, SOURCE.format(value=1))
    write_module(tmp_path, second, SOURCE.format(value=2))
    monkeypatch.syspath_prepend(str(tmp_path))
    before = import_policy()
    restrict_imports([first])
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20)
    try:
        w.init()
        restrict_imports([first, second])  # widened after the fork
        w.register(f"{second}:stamp")
        restrict_imports([second])  # narrowed: the children refuse the first one
        with pytest.raises(RegistrationError, match="PermissionError: cannot use") as info:
            w.register(f"{first}:stamp")
        assert info.value.code == "REGISTER_FAILED"
    finally:
        w.close()
        restrict_imports(before)


# -- callables.python_path ----------------------------------------------------------------------


def test_python_path_must_name_existing_directories(tmp_path: Path) -> None:
    a_file = tmp_path / "f.py"
    a_file.write_text("")
    cases = [
        ("rel/dir", "must be an absolute path"),
        (str(tmp_path / "missing"), "does not exist"),
        (str(a_file), "is not a directory"),
    ]
    for value, problem in cases:
        text = f"[callables]\npython_path = [{str(tmp_path)!r}, {value!r}]\n"
        path = tmp_path / "d.toml"
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            cfg.load(str(path), env={})
        assert "callables.python_path[1]" in str(info.value)
        assert problem in str(info.value)
    (tmp_path / "d.toml").write_text(f"[callables]\npython_path = [{str(tmp_path)!r}]\n")
    assert cfg.load(str(tmp_path / "d.toml"), env={}).callables.python_path == [str(tmp_path)]


# -- through the daemon --------------------------------------------------------------------------


def _raw_register(client: Any, path: str, *, reload: bool) -> Any:
    request = register_request(path, "sub", ())
    request.reload = reload
    return client.stub.RegisterCallable(request, timeout=60)


def test_daemon_imports_from_python_path_and_reloads(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    name = fresh_name()
    src = write_module(code, name, SOURCE.format(value=1))
    overrides: dict[str, dict[str, Any]] = {
        "workers": {"num_sub_workers": 2},
        "callables": {"allowed_modules": [name], "python_path": [str(code)]},
    }
    with running_daemon(tmp_path / "d", overrides) as d, d.client() as c:
        h = _raw_register(c, f"{name}:stamp", reload=False).hashid
        buf = c.alloc_buffer((2, 2), "int64").buffer_id
        rows = [tensor(buf, "output", (2,), "int64", byte_offset=16 * i) for i in range(2)]

        def run_group() -> list[int]:
            members = [make_args([row]) for row in rows]
            c.wait(c.submit([task("sub_group", h, members)]), timeout=60)
            return [int(v) for v in c.read_array(buf, (2, 2), "int64")[:, 0]]

        assert run_group() == [1, 1]
        src.write_text(SOURCE.format(value=2))
        reply = _raw_register(c, f"{name}:stamp", reload=True)
        assert reply.hashid == h and reply.refcount == 1
        assert run_group() == [2, 2]

        with pytest.raises(grpc.RpcError) as missing:
            _raw_register(c, f"{name}:other", reload=True)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert "it is not registered" in str(missing.value.details())

        src.write_text(BROKEN)
        with pytest.raises(grpc.RpcError) as broken:
            _raw_register(c, f"{name}:stamp", reload=True)
        assert broken.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "failed on every worker" in str(broken.value.details())
        assert run_group() == [2, 2]  # the last good code keeps running

        with pytest.raises(grpc.RpcError) as nowhere:
            _raw_register(c, f"{name}:no_such_function", reload=False)
        assert nowhere.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = str(nowhere.value.details())
        assert "failed on every worker" in details and "PARTIAL" not in details


#: A task that records (version, pid) once the test opens its gate (tensors[1][0] != 0).
GATED = """import os
import time

VERSION = {value}


def stamp(args):
    out, gate = args.tensors[0], args.tensors[1]
    out[1] = os.getpid()
    deadline = time.monotonic() + 120
    while not gate[0]:
        if time.monotonic() > deadline:
            raise TimeoutError("the gate never opened")
        time.sleep(0.001)
    out[0] = VERSION
"""


@pytest.mark.asyncio
@pytest.mark.slow
async def test_a_reload_control_waits_for_busy_children_instead_of_killing_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every SUB child runs a task of the reloaded callable longer than the (shortened)
    control deadline: the reload waits for the tasks (which end with the old code),
    holds a task of the callable queued meanwhile (it runs the new code), and no child is
    killed or replaced."""
    from simpler_daemon.engine import registration

    short = 2.0
    monkeypatch.setattr(registration, "CONTROL_TIMEOUT_S", short)
    name = fresh_name()
    src = write_module(tmp_path, name, GATED.format(value=1))
    monkeypatch.syspath_prepend(str(tmp_path))
    # Fair admission: every admitted run dispatches (fifo dispatches the head run only).
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20, admission="fair")
    async with w:
        h = await w.register_async(f"{name}:stamp")
        before = sorted(r["pid"] for r in w.list_workers())
        gate = w.alloc((1,), np.int64)
        outs = [w.alloc((2,), np.int64) for _ in range(3)]

        def one(out: Any) -> Any:
            return lambda o, a, c: o.submit_sub(h, targs((out, Tag.NO_DEP), (gate, Tag.NO_DEP)))

        loop = asyncio.get_running_loop()

        async def until(pred: Any, message: str) -> None:
            deadline = loop.time() + 60
            while not pred():
                assert loop.time() < deadline, message
                await asyncio.sleep(0.02)

        try:
            runs = [await w.submit_async(one(out)) for out in outs[:2]]
            await until(lambda: all(out[1] for out in outs[:2]), "the tasks never started")
            assert sorted(int(out[1]) for out in outs[:2]) == before  # one on each child
            src.write_text(GATED.format(value=2))
            reload = asyncio.ensure_future(w.register_async(f"{name}:stamp", reload=True))
            runs.append(await w.submit_async(one(outs[2])))  # queued behind the hold
            end = loop.time() + 3 * short
            await until(
                lambda: reload.done() or w.restarts["sub"] > 0 or loop.time() >= end,
                "the loop stalled",
            )
            assert w.restarts["sub"] == 0, "a busy child was killed for a control"
            assert not reload.done(), reload  # busy children: nobody could answer yet
            assert not outs[2][1], "a task of the held callable was dispatched"
        finally:
            gate[0] = 1
        assert await asyncio.wait_for(reload, 60) == h
        for run in runs:
            await asyncio.wait_for(run.wait_async(), 60)
        assert [int(out[0]) for out in outs] == [1, 1, 2]  # in flight: old; held: new
        assert w.restarts["sub"] == 0
        assert sorted(r["pid"] for r in w.list_workers()) == before
