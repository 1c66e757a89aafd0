"""Registrations belong to the client session that made them (server/sessions.py,
callables_rpc.py KeepSession, client/session.py).

The bookkeeping first (no daemon), then one real daemon with a small registration
quota, driven by real client processes (tests/support/lease_client.py) over both
transports: a client that exits, closes or is SIGKILLed leaves the reference counts
where they were; many short-lived clients never fill the quota; one session holds one
reference per path; ``persist`` and ``callables.preload`` registrations stay; a run
the client left behind keeps its callables until it ends. A second daemon with a
short ``limits.session_ttl`` ends the session of a gRPC client that stopped renewing
(a stopped process: what a vanished host looks like to the daemon).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from simpler_daemon.client import AsyncClient, Client, sub_task, tensor
from simpler_daemon.client.errors import FailedPrecondition, ResourceExhausted
from simpler_daemon.errors import AccessDenied, InvalidField, LimitExceeded, Precondition
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.server.peers import Identity
from simpler_daemon.server.sessions import Sessions
from tests.support.daemon_harness import (
    EXAMPLES,
    REPO,
    DaemonProcess,
    module_daemon,
    module_leak_guard,
    running_daemon,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

QUOTA = 8  # limits.per_client_registrations: 3 x QUOTA clients would fill it for good
PRELOADED = f"{EXAMPLES}:scale"
CONFIG: dict[str, dict[str, Any]] = {
    "limits": {"per_client_registrations": QUOTA},
    "callables": {"allowed_modules": ["simpler_daemon.examples"], "preload": [PRELOADED]},
}
TRANSPORTS = ("grpc", "fast")
RELEASE_TIMEOUT = 60.0  # generous: the machine is loaded

_MODULE_DAEMONS: set[int] = set()
_CLIENT = (sys.executable, "-m", "tests.support.lease_client")


def _who(owner: str) -> Identity:
    return Identity(owner=owner, admin=False)


# --------------------------------------------------------------------------- bookkeeping


def test_a_session_belongs_to_the_identity_that_opened_it() -> None:
    s = Sessions()
    mine = s.open(_who("uid:1"), "abc", limit=2)
    assert s.get(_who("uid:1"), "abc", "register") is mine
    with pytest.raises(AccessDenied, match="belongs to another client") as info:
        s.get(_who("uid:2"), "abc", "register a callable")
    assert info.value.field == "session"
    with pytest.raises(AccessDenied, match="belongs to another client"):
        s.open(_who("uid:2"), "abc", limit=2)
    with pytest.raises(Precondition, match="open already"):
        s.open(_who("uid:1"), "abc", limit=2)
    with pytest.raises(InvalidField, match="session id"):
        s.open(_who("uid:1"), "no spaces", limit=2)
    with pytest.raises(InvalidField, match="session id"):
        s.get(_who("uid:1"), "x" * 65, "register a callable")
    s.open(_who("uid:1"), "def", limit=2)
    with pytest.raises(LimitExceeded, match=r"limits.per_client_sessions \(2\)"):
        s.open(_who("uid:1"), "ghi", limit=2)
    s.open(_who("uid:2"), "ghi", limit=2)  # another identity's own quota


def test_session_references_are_counted_until_dropped() -> None:
    s = Sessions()
    a = s.open(_who("uid:1"), "a", limit=8)
    b = s.open(_who("uid:1"), "b", limit=8)
    s.add_ref(a, "h1")
    s.add_ref(b, "h1")
    s.add_ref(b, "h2")
    assert (s.held("h1"), s.held("h2"), s.held_by("uid:1", "h1"), s.held_by("uid:2", "h1")) == (
        2,
        1,
        2,
        0,
    )
    # An unregister drops the caller's session's reference first, then one held
    # until unregistered, then another session's.
    assert s.holder("uid:1", "h1", "b", persistent=True) is b
    assert s.holder("uid:1", "h1", "", persistent=True) is None
    assert s.holder("uid:1", "h2", "a", persistent=False) is b
    assert s.holder("uid:2", "h1", "a", persistent=False) is None
    s.end(a)
    with pytest.raises(Precondition, match="not open") as info:
        s.get(_who("uid:1"), "a", "register a callable")
    assert info.value.field == "session"
    assert a.ended and s.held("h1") == 2  # released by the daemon, one by one
    s.drop_ref(a, "h1")
    s.drop_ref(a, "h1")  # once only
    assert (s.held("h1"), dict(a.refs)) == (1, {})
    s.forget("h2")
    assert (s.held("h2"), dict(b.refs)) == (0, {"h1": 1})
    s.open(_who("uid:1"), "a", limit=8)  # its id is free again


# --------------------------------------------------------------------------- one daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from module_daemon(tmp_path_factory, "leases", CONFIG, _MODULE_DAEMONS)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    yield from module_leak_guard(lambda: set(_MODULE_DAEMONS))


@pytest.fixture
def admin(daemon: DaemonProcess) -> Iterator[Client]:
    """The test's own client: it only looks (ListCallables), registers nothing."""
    with daemon.client(timeout=60, transport="grpc") as c:
        yield c


def _refs(c: Client) -> dict[str, tuple[int, int]]:
    """import path -> (refcount, session_refs) of every registered callable."""
    return {x.import_path: (x.refcount, x.session_refs) for x in c.list_callables()}


def _settled(c: Client, baseline: dict[str, tuple[int, int]], message: str) -> None:
    """Poll until the daemon's registrations are ``baseline`` again."""
    seen: list[Any] = []

    def back() -> bool:
        seen[:] = [_refs(c)]
        return seen[0] == baseline

    try:
        wait_until(back, timeout=RELEASE_TIMEOUT, message=message)
    except TimeoutError as exc:
        raise AssertionError(f"{message}: {seen[0]} != baseline {baseline}") from exc


class LeaseClient:
    """One client process (tests/support/lease_client.py) fed commands on stdin."""

    def __init__(
        self,
        daemon: DaemonProcess,
        transport: str,
        *commands: str,
        target: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        self.proc = subprocess.Popen(
            [*_CLIENT, target or daemon.socket, transport, *commands, "wait"],
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines = [self.read() for _ in commands]

    def read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            raise AssertionError(
                f"the client process died: {self.proc.stderr and self.proc.stderr.read()}"
            )
        return line.strip()

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def end(self, how: str) -> None:
        """``exit`` (unclosed), ``close`` (Client.close, the process lives on), ``kill``."""
        if how == "close":
            assert self.ask("close") == "closed"
        elif how == "exit":
            assert self.proc.stdin is not None
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            assert self.proc.wait(30) == 0
        else:
            self.proc.send_signal(signal.SIGKILL)
            assert self.proc.wait(30) == -signal.SIGKILL

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("how", ["exit", "close", "kill"])
def test_references_return_to_baseline_when_a_client_ends(
    daemon: DaemonProcess, admin: Client, transport: str, how: str
) -> None:
    baseline = _refs(admin)
    assert baseline[PRELOADED] == (1, 0)  # callables.preload: held until unregistered
    lc = LeaseClient(daemon, transport, f"run:{EXAMPLES}:empty", f"register:{PRELOADED}")
    try:
        # While the client lives it holds one reference to each, in its session.
        assert _refs(admin)[f"{EXAMPLES}:empty"] == (1, 1)
        assert _refs(admin)[PRELOADED] == (2, 1)
        lc.end(how)
        _settled(admin, baseline, f"a {transport} client that ended by {how} kept references")
        if how == "close":
            assert lc.proc.poll() is None  # released at close, not at exit
    finally:
        lc.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_short_lived_clients_never_fill_the_quota(
    daemon: DaemonProcess, admin: Client, transport: str
) -> None:
    baseline = _refs(admin)
    n = 3 * QUOTA
    script = [f"run:{EXAMPLES}:empty", f"register:{EXAMPLES}:add", "exit"]
    started = time.monotonic()
    for i in range(n):  # each would leave two references behind for good before
        done = subprocess.run(
            [*_CLIENT, daemon.socket, transport, *script],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"client {i} of {n} failed: {done.stderr}"
        assert done.stdout.split()[:2] == ["ran", "hashid"], done.stdout
    took = time.monotonic() - started
    _settled(admin, baseline, f"{n} short-lived {transport} clients left references behind")
    print(f"{n} {transport} clients registered, ran and exited in {took:.1f} s")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_session_holds_one_reference_per_path(
    daemon: DaemonProcess, admin: Client, transport: str
) -> None:
    baseline = _refs(admin)
    path = f"{EXAMPLES}:add"
    with daemon.client(timeout=60, transport=transport) as c:
        hashids = {c.register(path) for _ in range(50)}
        assert len(hashids) == 1
        assert c.register_callable(path).refcount == 1
        assert _refs(admin)[path] == (1, 1)
        # Each client is its own session: a second one holds a second reference.
        with daemon.client(timeout=60, transport=transport) as other:
            assert other.register_callable(path).refcount == 2
        _settled(admin, {**baseline, path: (1, 1)}, "a closed client's reference stayed")
        # An unregister drops the session's reference: registering again adds it back.
        assert c.unregister(hashids.pop()) == 0
        assert c.register_callable(path).refcount == 1
    _settled(admin, baseline, "a closed client's reference stayed")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_async_client_sessions(daemon: DaemonProcess, admin: Client, transport: str) -> None:
    baseline = _refs(admin)
    path = f"{EXAMPLES}:add"

    async def main() -> None:
        async with AsyncClient(daemon.socket, timeout=60, transport=transport) as c:
            assert c.transport == transport
            for _ in range(20):
                await c.register(path)
            assert (await c.register_callable(path)).refcount == 1
            assert (await c.register_callable(path, persist=True)).refcount == 2

    asyncio.run(main())
    _settled(admin, {**baseline, path: (1, 0)}, "an AsyncClient's session outlived it")
    hashid = next(x.hashid for x in admin.list_callables() if x.import_path == path)
    assert admin.unregister(hashid) == 0
    assert _refs(admin) == baseline


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_persist_and_preload_outlive_the_client(
    daemon: DaemonProcess, admin: Client, transport: str
) -> None:
    baseline = _refs(admin)
    kept, gone = f"{EXAMPLES}:add", f"{EXAMPLES}:empty"
    lc = LeaseClient(daemon, transport, f"persist:{kept}", f"register:{gone}")
    try:
        hashid = lc.lines[0].split()[1]
        assert _refs(admin)[kept] == (1, 0)
        lc.end("kill")
        # The session's registration goes; the persistent one and the preload stay.
        _settled(admin, {**baseline, kept: (1, 0)}, "the session's registration stayed")
        assert _refs(admin)[PRELOADED] == (1, 0)
        assert admin.unregister(hashid) == 0  # until unregistered
        assert _refs(admin) == baseline
    finally:
        lc.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_run_left_behind_keeps_its_callables_until_it_ends(
    daemon: DaemonProcess, admin: Client, transport: str
) -> None:
    baseline = _refs(admin)
    path = f"{EXAMPLES}:wait_for_flag"
    lc = LeaseClient(daemon, transport, f"hold:{path}")
    flag = -1
    try:
        _, run, flag_id = lc.lines[0].split()
        flag = int(flag_id)
        lc.end("exit")
        # Its second task is dispatched only after the client is gone: it still finds
        # the callable registered.
        admin.write_buffer(flag, np.array([1, 0], dtype=np.uint8))
        result = admin.wait(int(run), timeout=60)
        assert result.state.name == "COMPLETED", result
        _settled(admin, baseline, "a finished run's session references stayed")
    finally:
        lc.stop()
        if flag >= 0:
            admin.free_buffer(flag)


def test_a_session_is_refused_to_a_call_that_does_not_hold_it(
    daemon: DaemonProcess, admin: Client
) -> None:
    """RegisterCallable naming a session that is not open: FAILED_PRECONDITION naming
    the field (the client opens a new session and retries)."""
    request = pb.RegisterCallableRequest(
        import_path=f"{EXAMPLES}:add", kind=pb.CALLABLE_KIND_SUB, session="never-opened"
    )
    with pytest.raises(grpc.RpcError) as info:
        admin.stub.RegisterCallable(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "session never-opened is not open" in (info.value.details() or "")
    request.session = "bad id!"
    with pytest.raises(grpc.RpcError) as info:
        admin.stub.RegisterCallable(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_quota_counts_live_references_only(daemon: DaemonProcess, admin: Client) -> None:
    """Persistent references fill the quota; a closed client's stop counting."""
    wait_until(  # an earlier test's closed clients are released
        lambda: not any(session for _, session in _refs(admin).values()),
        timeout=RELEASE_TIMEOUT,
        message="sessions of earlier tests kept references",
    )
    baseline = _refs(admin)
    path = f"{EXAMPLES}:fill"
    held = [admin.register(path, persist=True) for _ in range(QUOTA)]
    try:
        with pytest.raises(ResourceExhausted, match=r"limits\.per_client_registrations"):
            admin.register(path, persist=True)
        with daemon.client(timeout=60) as c, pytest.raises(ResourceExhausted):
            c.register(f"{EXAMPLES}:add")  # a session's reference counts too
        admin.unregister(held.pop())
        with daemon.client(timeout=60) as c:
            c.register(f"{EXAMPLES}:add")
        # The closed client's reference no longer counts: the quota has room again.
        wait_until(
            lambda: f"{EXAMPLES}:add" not in _refs(admin),
            timeout=RELEASE_TIMEOUT,
            message="a closed client's reference stayed",
        )
        held.append(admin.register(path, persist=True))
    finally:
        for h in held:
            admin.unregister(h)
    assert _refs(admin) == baseline


# --------------------------------------------------------------------------- lease TTL


def _stopped_client_loses_its_session(
    daemon: DaemonProcess, admin: Client, transport: str, **where: Any
) -> None:
    baseline = _refs(admin)
    path = f"{EXAMPLES}:empty"
    lc = LeaseClient(daemon, transport, f"run:{path}", **where)
    try:
        assert _refs(admin)[path] == (1, 1)
        os.kill(lc.proc.pid, signal.SIGSTOP)
        try:
            _settled(admin, baseline, "a stopped client kept its session")
        finally:
            os.kill(lc.proc.pid, signal.SIGCONT)
        # Its next registration finds the session ended, opens another and succeeds.
        assert lc.ask(f"run:{path}") == "ran"
        assert _refs(admin)[path] == (1, 1)
        lc.end("close")
        _settled(admin, baseline, "a closed client's reference stayed")
    finally:
        lc.stop()
    assert "not renewed for limits.session_ttl" in daemon.stderr() + daemon.stdout()


TTL_CONFIG = {**CONFIG, "limits": {**CONFIG["limits"], "session_ttl": 1.0}}


def test_an_async_client_that_stops_renewing_loses_its_session(tmp_path: Path) -> None:
    """An AsyncClient that stops renewing (SIGSTOP: its connection stays open, nothing
    is sent) loses its session after limits.session_ttl; resumed, it opens a new one."""
    with running_daemon(tmp_path / "d", TTL_CONFIG) as daemon, daemon.client() as admin:
        _stopped_client_loses_its_session(daemon, admin, "grpc-async")


def test_a_tcp_client_that_stops_renewing_loses_its_session(tmp_path: Path) -> None:
    """Over TCP (where a connection can hang half-open) the blocking Client renews
    too; stopped, it loses its session after limits.session_ttl."""
    from simpler_daemon.testing import self_signed_cert

    pair = self_signed_cert(tmp_path)
    if pair is None:
        pytest.skip("the openssl CLI is not available")
    cert, key = pair
    token = tmp_path / "token"
    token.write_text("lease-token-0123456789abcdef\n")
    token.chmod(0o600)
    tcp = {"tcp_listen": "127.0.0.1:0", "tls_cert": str(cert), "tls_key": str(key)}
    config = {**TTL_CONFIG, "grpc": {**tcp, "token_file": str(token)}}
    with running_daemon(tmp_path / "d", config) as daemon, daemon.client() as admin:
        line = next(x for x in daemon.stdout().splitlines() if "listening on tcp" in x)
        address = line.split("listening on tcp ", 1)[1].split()[0]
        env = {"LEASE_TOKEN": "lease-token-0123456789abcdef", "LEASE_CA": str(cert)}
        _stopped_client_loses_its_session(daemon, admin, "grpc", target=address, env=env)


def test_a_local_blocking_client_holds_its_session_without_threads(
    daemon: DaemonProcess, admin: Client
) -> None:
    """Over a Unix socket (gRPC or the fast path) the session costs the blocking
    Client no thread: the process may still fork a Worker."""
    baseline = _refs(admin)
    for transport in TRANSPORTS:
        with daemon.client(timeout=60, transport=transport) as c:
            c.register(f"{EXAMPLES}:add")
            # (grpc's thread sending the session's one request ends once it is sent)
            wait_until(
                lambda: threading.active_count() == 1,
                timeout=RELEASE_TIMEOUT,
                message=f"the session keeps threads: {threading.enumerate()}",
            )
            assert _refs(admin)[f"{EXAMPLES}:add"] == (1, 1)
        _settled(admin, baseline, "a closed client's reference stayed")


def test_session_ttl_is_validated(tmp_path: Path) -> None:
    from simpler_daemon.errors import ConfigError
    from simpler_daemon.server.config import load

    path = tmp_path / "d.toml"
    path.write_text("[limits]\nsession_ttl = 0.1\n")
    with pytest.raises(ConfigError, match=r"limits\.session_ttl"):
        load(str(path), env={})


def test_failed_precondition_names_the_session_field() -> None:
    err = FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, "x", "session")
    from simpler_daemon.client.session import session_lost

    assert session_lost(err)
    assert not session_lost(FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, "x", "hashid"))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_registering_while_the_last_reference_is_released(
    daemon: DaemonProcess, admin: Client, transport: str
) -> None:
    """A client registering what a client that just closed is releasing (its last
    reference, being uninstalled from the workers) waits for that, then registers."""
    baseline = _refs(admin)
    path = f"{EXAMPLES}:add"
    for _ in range(20):
        with daemon.client(timeout=60, transport=transport) as c:
            c.register(path)
    _settled(admin, baseline, "a closed client's reference stayed")


def test_a_run_older_than_the_session_does_not_hold_its_references(
    daemon: DaemonProcess, admin: Client
) -> None:
    """The same identity's long run, submitted before a short client's session opened,
    does not keep that session's references (only runs it could have submitted do)."""
    wait = admin.register(f"{EXAMPLES}:wait_for_flag", persist=True)
    flag = admin.alloc_buffer((2,), "uint8").buffer_id
    run = admin.submit([sub_task(wait, [tensor(flag, "inout", (2,), "uint8")], [60_000])])
    try:
        baseline = _refs(admin)
        done = subprocess.run(
            [*_CLIENT, daemon.socket, "fast", f"run:{EXAMPLES}:empty", "exit"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        _settled(admin, baseline, "a run older than the session held its references")
        assert not run.done()
    finally:
        admin.write_buffer(flag, np.array([1, 0], dtype=np.uint8))
        admin.wait(run, timeout=60)
        admin.free_buffer(flag)
        admin.unregister(wait)
