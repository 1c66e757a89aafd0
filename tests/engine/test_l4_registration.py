"""Level-4 registration as the origin does it.

* ``w4.register("pkg.mod:kernel", kind="chip")`` without ``workers=`` installs the kernel
  into every L3 worker that has chips, all or none: a chip grandchild that refuses it
  rolls the others back and the ``REGISTER_PARTIAL_FAILURE`` names its path;
  ``unregister`` removes it everywhere and the hashid can be registered again.
* ``w4.register(RemoteCallable(...))`` needs ``workers=[remote ids]``: ``RuntimeError``
  when there is no remote worker, ``ValueError`` without the list.
* Unregistering a ``RemoteCallable`` on a remote worker whose session died warns,
  leaves the hashid uncertain there and returns; a later unregister retries, a later
  register (once a session is back) installs it afresh.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from simpler_daemon import Tag, TaskArgs
from simpler_daemon.callables import spec_for_chip
from simpler_daemon.errors import RegistrationError, TaskError
from simpler_daemon.remote.spec import ReconnectPolicy, RemoteCallable, RemoteWorkerSpec
from simpler_daemon.testing import poll_for
from tests.support.nested_rig import closing, l3_worker, l4_call, l4_worker, subtree

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
ADD_ONE = "tests.support.chip_kernels:add_one"
KERNEL = spec_for_chip(ADD_ONE).handle


def on_chip(o: Any, a: Any, c: Any) -> None:
    """An L3 orchestration: ``KERNEL`` (``add_one``) once on the inner Worker's chip 0."""
    o.submit_next_level(KERNEL, TaskArgs().add_tensor(a.tensors[0], Tag.INOUT), c, worker=0)


def chip_l3() -> Any:
    return l3_worker(num_sub_workers=0, num_chips=1)


def test_a_chip_kernel_without_workers_goes_to_every_l3_worker_with_chips() -> None:
    w4 = l4_worker()
    a = w4.add_worker(chip_l3())
    b = w4.add_worker(chip_l3())
    w4.add_worker(l3_worker(num_sub_workers=1))  # no chips: not a target
    orch = w4.register(on_chip)
    w4.init()
    with closing(w4) as seen:
        seen |= subtree(w4)
        k = w4.register(ADD_ONE, kind="chip")
        assert k == KERNEL
        assert w4._pool.l3.installs[k.hashid].workers == {a, b}
        for i in (a, b):
            t = w4.alloc((3,), "float32")
            w4.run(l4_call(orch, i, [t]))
            assert t.tolist() == [1.0, 1.0, 1.0]
        w4.unregister(k)
        assert k.hashid not in w4._pool.l3.installs
        t = w4.alloc((3,), "float32")
        with pytest.raises(TaskError, match="not registered"):
            w4.run(l4_call(orch, a, [t]))
        # The hashid is free again: the same kernel registers and runs anew.
        assert w4.register(ADD_ONE, kind="chip") == k
        w4.run(l4_call(orch, b, [t]))
        assert t.tolist() == [1.0, 1.0, 1.0]


def test_a_level4_worker_without_l3_chips_refuses_a_chip_kernel() -> None:
    w4 = l4_worker()
    w4.add_worker(l3_worker(num_sub_workers=1))
    try:
        with pytest.raises(ValueError, match="L3 workers that have chips, and none has"):
            w4.register(ADD_ONE, kind="chip")
    finally:
        w4.close()


def test_a_chip_grandchild_refusing_the_kernel_rolls_back_and_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"l4_kernels_{uuid.uuid4().hex[:10]}"
    monkeypatch.syspath_prepend(str(tmp_path))  # before init: the children inherit it
    w4 = l4_worker()
    a = w4.add_worker(chip_l3())
    b = w4.add_worker(chip_l3())
    orch = w4.register(on_chip)
    w4.init()
    with closing(w4) as seen:
        seen |= subtree(w4)
        row = next(r for r in w4.list_workers() if r["worker_id"] == b)
        (grandchild,) = [c["pid"] for c in row["children"] if c["kind"] == "chip"]
        module = tmp_path / f"{name}.py"
        module.write_text(
            "import os\n"
            f"if os.getpid() == {grandchild}:\n"
            "    raise ImportError('this chip grandchild refuses the kernel')\n"
            "def kernel(args, config):\n"
            "    args.tensors[0][...] += 1\n"
        )
        path = f"{name}:kernel"
        with pytest.raises(RegistrationError) as info:
            w4.register(path, kind="chip")
        err = info.value
        assert err.code == "REGISTER_PARTIAL_FAILURE", err
        text = str(err)
        assert f"worker {b}: child_worker {b}: chip_worker 0:" in text, text
        assert "this chip grandchild refuses the kernel" in text, text
        assert set(err.failures) == {b}
        # Rolled back on L3 worker a too: nothing of it is installed anywhere.
        handle = spec_for_chip(path).handle
        assert handle.hashid not in w4._pool.l3.installs

        def run_it(o: Any, args: Any, config: Any) -> None:
            o.submit_next_level(
                handle, TaskArgs().add_tensor(args.tensors[0], Tag.INOUT), config, worker=0
            )

        relay = w4.register(run_it)
        t = w4.alloc((2,), "float32")
        with pytest.raises(TaskError, match="not registered"):
            w4.run(l4_call(relay, a, [t]))
        # Fixed, it registers everywhere and runs on both.
        module.write_text("def kernel(args, config):\n    args.tensors[0][...] += 1\n")
        assert w4.register(path, kind="chip") == handle
        for i in (a, b):
            t[:] = 0
            w4.run(l4_call(relay, i, [t]))
            assert t.tolist() == [1.0, 1.0]
        assert orch is not None
        sys.modules.pop(name, None)


def test_a_remote_callable_needs_an_explicit_list_of_remote_workers() -> None:
    w4 = l4_worker()
    try:
        orch = RemoteCallable("tests.support.l3_jobs:noop_remote")
        with pytest.raises(RuntimeError, match="add at least one remote worker"):
            w4.register(orch)
        r = w4.add_remote_worker(RemoteWorkerSpec(endpoint="127.0.0.1:9"))
        for workers in (None, []):
            with pytest.raises(
                ValueError, match="needs an explicit non-empty list of remote worker ids"
            ):
                w4.register(orch, workers=workers)
        assert w4.register(orch, workers=[r]).role == "orchestration"
    finally:
        w4.close()


# -- a remote worker whose session died -------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def remote_service(port: int) -> Iterator[subprocess.Popen[str]]:
    """``simpler-remote-worker serve`` on ``127.0.0.1:port`` (its own process group)."""
    proc = subprocess.Popen(
        [
            str(REPO / ".venv" / "bin" / "simpler-remote-worker"),
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            "--set",
            'callables.allowed_modules=["simpler_daemon.examples.", "tests."]',
            "--set",
            f'callables.python_path=["{REPO}"]',
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(REPO),
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        poll_for(lambda: "listening on" in (proc.stdout.readline() or "x"), 30, interval=0.0)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(15)
        if proc.stdout is not None:
            proc.stdout.close()


def remote_state(w4: Any, r: int) -> str:
    return str(next(row["state"] for row in w4.list_workers() if row["worker_id"] == r))


def test_unregistering_a_remote_callable_on_a_dead_worker_warns_and_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    policy = ReconnectPolicy(initial_s=0.2, max_s=0.5)
    w4 = l4_worker(startup_timeout=30.0, reconnect=policy)
    r = w4.add_remote_worker(RemoteWorkerSpec(endpoint=f"127.0.0.1:{port}", num_sub_workers=1))
    target = RemoteCallable("tests.support.l3_jobs:noop_remote")
    with remote_service(port) as first:
        h = w4.register(target, workers=[r])
        w4.init()
        try:
            w4.run(lambda o, a, c: o.submit_next_level(h, TaskArgs(), worker=r))
            os.killpg(first.pid, signal.SIGKILL)  # the service and its session runner
            poll_for(lambda: remote_state(w4, r) != "ready", 30, message="the death went unseen")
        except BaseException:
            w4.close()
            raise
    try:
        with caplog.at_level(logging.WARNING, logger="simpler_daemon.remote"):
            w4.unregister(h)  # returns: the dead worker cannot confirm it
        assert f"cannot confirm the unregister of {h.name} on remote worker(s) {r}" in caplog.text
        assert w4._fleet.uncertain == {h.hashid: {r}}
        assert h.hashid not in w4.registry
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="simpler_daemon.remote"):
            w4.unregister(h)  # a retry, still unconfirmed: warns again, returns
        assert "cannot confirm the unregister" in caplog.text
        assert w4._fleet.uncertain == {h.hashid: {r}}
        with remote_service(port):
            poll_for(lambda: remote_state(w4, r) == "ready", 60, message="no new session")
            # A register settles it: installed afresh on the new session, and it runs.
            assert w4.register(target, workers=[r]) == h
            assert w4._fleet.uncertain == {}
            w4.run(lambda o, a, c: o.submit_next_level(h, TaskArgs(), worker=r))
            w4.unregister(h)
            assert w4._fleet.uncertain == {}
    finally:
        w4.close()


def test_a_chip_kernel_without_workers_reaches_remote_workers_with_chips_too() -> None:
    """Local and, through its session, remote: every L3 worker with chips gets it (a
    remote worker without chips does not), and unregister removes it from all."""
    port = free_port()
    w4 = l4_worker(startup_timeout=30.0)
    a = w4.add_worker(chip_l3())
    with remote_service(port):
        endpoint = f"127.0.0.1:{port}"
        r = w4.add_remote_worker(RemoteWorkerSpec(endpoint=endpoint, num_chips=1))
        w4.add_remote_worker(RemoteWorkerSpec(endpoint=endpoint, num_sub_workers=1))
        w4.init()
        with closing(w4) as seen:
            seen |= subtree(w4)
            k = w4.register(ADD_ONE, kind="chip")
            assert w4._pool.l3.installs[k.hashid].workers == {a}
            assert w4._fleet.installs[k.hashid].workers == {r}
            w4.unregister(k)
            assert k.hashid not in w4._pool.l3.installs
            assert k.hashid not in w4._fleet.installs
            assert w4.register(ADD_ONE, kind="chip") == k  # the hashid is free again
