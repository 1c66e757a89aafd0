"""Shared fixtures: leak guards (no child process, no /dev/shm file, no unobserved loop
exception outlives a test), the event-loop choice (SIMPLER_LOOP=asyncio|uvloop), the
markers by folder (everything under tests/faults/ is ``chaos``) and the one ``Pool``
fixture (``make_pool``, ``pool``)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import signal
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

# The rigs in tests/support assert inside their methods; rewrite those asserts as in test
# modules (registered before anything imports them). The callables children run are
# left alone: their import must stay a plain import.
pytest.register_assert_rewrite(
    "tests.support.ctl",
    "tests.support.chip_endpoint_rig",
    "tests.support.chip_worker_rig",
    "tests.support.daemon_harness",
    "tests.support.endpoint_rig",
    "tests.support.fast_raw",
    "tests.support.kubernetes_policy",
    "tests.support.kustomize",
    "tests.support.nested_rig",
    "tests.support.remote_harness",
    "tests.support.remote_worker",
    "tests.support.scheduler_rig",
    "tests.support.submit_sink",
    "tests.support.two_clients",
    "tests.support.worker_pool",
)

# grpc core's process-wide settings, as in a client program: the first import of grpc in
# this process goes through them, whichever test module is collected first.
import simpler_daemon.system.grpcsetup  # noqa: E402, F401
from simpler_daemon.testing import (  # noqa: E402
    child_pids,
    settled_shm_leaks,
    shm_files,
    track_spawned_processes,
)
from tests.support.worker_pool import TASKS, Pool  # noqa: E402

# pytest-xdist runs other test processes beside this one, and their daemons create and
# remove heaps in the same /dev/shm: a heap whose creator has just died counts as a leak
# of ours only when this process started that creator.
track_spawned_processes()

# A daemon a test starts keeps no run history: never the user's ~/.local/state, and
# never one directory shared by daemons running at once. The variable overrides the
# daemon's config file, so a test whose daemon keeps a history (a restart test) both
# sets daemon.state_dir and drops this variable from the daemon's environment, as
# tests/support/daemon_harness.py does (one state_dir per daemon).
os.environ.setdefault("SIMPLER_DAEMON__DAEMON__STATE_DIR", ":memory:")

# A shell without job control starts background commands with SIGINT ignored (``make
# test &`` in a script, nohup), and Python then never raises KeyboardInterrupt; exec'd
# processes inherit an ignored signal, but not a handler. The Ctrl-C tests (a Worker's
# init interrupted, simplerctl interrupted while it follows a run) need the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def tmp_path(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """pytest's ``tmp_path`` with the test's name cut to 16 characters instead of 30.

    Daemons bind Unix sockets below it (``<tmp>/d/run/private-<16 hex>.sock``), and a
    socket path has at most 107 bytes: pytest-xdist puts each process's directories one
    level deeper (``.../pytest-N/popen-gwN/``), which pushed the longest ones past it."""
    name = re.sub(r"\W", "_", request.node.name)[:16]
    return tmp_path_factory.mktemp(name, numbered=True)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    """Fail a test that leaves a child process or a /dev/shm file of ours behind."""
    shm_before = shm_files()
    yield
    gc.collect()
    from simpler_daemon.testing import poll_for

    poll_for(lambda: not child_pids(), timeout=10.0, message="child processes outlived the test")
    leaked = settled_shm_leaks(shm_before)
    assert not leaked, f"files left in /dev/shm: {sorted(leaked)}"


@pytest.fixture(autouse=True)
def no_leaked_process_policy() -> Iterator[None]:
    """A test that runs ``Daemon.prepare()`` in this process sets the process-wide import
    allow-list and task-time ceiling the daemon sets for itself; later tests must not
    inherit them."""
    from simpler_daemon import callables
    from simpler_daemon.endpoints import taskwatch

    policy, ceiling = callables.import_policy(), taskwatch._max_task_ms
    yield
    callables.restrict_imports(policy)
    taskwatch._max_task_ms = ceiling


FAULTS = Path(__file__).parent / "faults"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/faults/ is marked ``chaos``: its point is a fault."""
    for item in items:
        if item.path.is_relative_to(FAULTS):
            item.add_marker(pytest.mark.chaos)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run async tests under uvloop unless SIMPLER_LOOP=asyncio."""
    if os.environ.get("SIMPLER_LOOP", "uvloop") == "asyncio":
        return {"asyncio": asyncio.new_event_loop}
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def fail_on_unobserved_loop_exception() -> Iterator[None]:
    """An exception that reached an event loop's default handler (logged by the
    ``asyncio`` logger: 'Task exception was never retrieved', a failing callback)
    fails the test, under asyncio and uvloop alike."""
    rec = _Recorder()
    logger = logging.getLogger("asyncio")
    logger.addHandler(rec)
    try:
        yield
        gc.collect()
    finally:
        logger.removeHandler(rec)
    assert not rec.records, f"unobserved exception in the event loop: {rec.records[0].getMessage()}"


# -- the one Pool fixture -----------------------------------------------------------------------


@pytest.fixture
def make_pool(request: pytest.FixtureRequest) -> Iterator[Callable[..., Pool]]:
    """``make_pool(n=2, admission="fifo", tasks=None)``: a started ``Pool``, closed after
    the test. ``tasks`` defaults to the test module's ``POOL_TASKS`` (``TASKS`` of
    tests/support/worker_pool.py when it has none)."""
    made: list[Pool] = []
    default_tasks: Sequence[str] = getattr(request.module, "POOL_TASKS", TASKS)

    def factory(n: int = 2, *, admission: str = "fifo", tasks: Sequence[str] | None = None) -> Pool:
        p = Pool(n, admission=admission, tasks=default_tasks if tasks is None else tasks)
        made.append(p)
        return p

    yield factory
    for p in made:
        p.w.close()


@pytest.fixture
def pool(request: pytest.FixtureRequest, make_pool: Callable[..., Pool]) -> Pool:
    """``make_pool()``: two SUB children. In a module that sets ``POOL_ADMISSIONS`` every
    test that uses it runs once per admission policy listed (see pytest_generate_tests)."""
    return make_pool(admission=getattr(request, "param", "fifo"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    admissions = getattr(metafunc.module, "POOL_ADMISSIONS", None)
    if admissions and "pool" in metafunc.fixturenames:
        metafunc.parametrize("pool", admissions, indirect=True)
