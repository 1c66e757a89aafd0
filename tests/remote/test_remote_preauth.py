"""What a remote worker does before a connection has authenticated: idle, slow and
guessing connections, even from the parent's own address, never keep the real parent
out, and every one is closed by the handshake deadline.

Real ``simpler-remote-worker`` processes: on a test host (a network namespace as root, a
loopback alias otherwise) with a level-4 Worker in this process as the parent, whose
address the hostile connections share; and on loopback with TLS for the connections
that never start their TLS handshake."""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from simpler_daemon import TaskArgs, Worker
from simpler_daemon.callables import CallableHandle
from simpler_daemon.remote.manifest import encode_auth, encode_lp_json
from simpler_daemon.remote.spec import RemoteCallable, RemoteWorkerSpec
from simpler_daemon.system.authguard import FailedAuthLimiter
from simpler_daemon.testing import poll_for
from simpler_daemon.testing.netns import TestHosts
from tests.support.remote_harness import (
    RemoteWorkerProcess,
    start_worker,
    wait_no_runners,
)
from tests.support.remote_worker import RunningWorker, manifest, self_signed

pytestmark = pytest.mark.timeout(120)

JOBS = "tests.support.l3_jobs"


@pytest.fixture
def host(tmp_path: Path) -> Iterator[tuple[TestHosts, Path]]:
    hosts = TestHosts(1)
    hosts.start()
    try:
        yield hosts, tmp_path
    finally:
        hosts.close()


@contextlib.contextmanager
def remote_worker(
    host: tuple[TestHosts, Path], port: int, *extra: str
) -> Iterator[RemoteWorkerProcess]:
    hosts, log_dir = host
    rw = start_worker(
        hosts, 0, log_dir, port=port, extra=("--set", "worker.log_level=debug", *extra)
    )
    try:
        yield rw
    finally:
        assert rw.stop() == 0, rw.log_text()[-3000:]
        assert "Traceback" not in rw.log_text(), rw.log_text()[-3000:]


def attach_and_run(rw: RemoteWorkerProcess, token_file: Path | None = None) -> float:
    """A level-4 parent attaches to ``rw`` and runs one task there; returns the attach's
    seconds."""
    w4 = Worker(level=4, startup_timeout=30.0)
    try:
        w4.init()
        t0 = time.monotonic()
        r = w4.add_remote_worker(
            RemoteWorkerSpec(
                endpoint=rw.endpoint,
                num_sub_workers=1,
                token_file=str(token_file) if token_file else None,
            )
        )
        took = time.monotonic() - t0
        w4.register(RemoteCallable(f"{JOBS}:noop_remote"), workers=[r])
        noop = CallableHandle.for_import(f"{JOBS}:noop_remote", "orchestration")
        w4.run(lambda o, _a, _c: o.submit_next_level(noop, TaskArgs(), worker=r))
        return took
    finally:
        w4.close()
        wait_no_runners(15.0, "after close")


def idle_connections(address: str, port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection((address, port), timeout=30) for _ in range(n)]


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the worker closed ``sock`` (EOF or reset), without waiting."""
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def test_idle_connections_from_the_parents_address_do_not_keep_it_out(
    host: tuple[TestHosts, Path],
) -> None:
    with remote_worker(host, 19395, "--set", "sessions.handshake_timeout=3.0") as rw:
        # More idle connections than sessions.max_connections (64), all from the address
        # the parent connects from; none ever sends a byte.
        idle = idle_connections(rw.address, rw.port, 80)
        try:
            poll_for(
                lambda: rw.log_text().count("connection from") >= 80,
                timeout=30,
                message="the worker did not accept every idle connection",
            )
            attach_and_run(rw)
            # Each idle one is closed: to make room, or at the handshake deadline.
            poll_for(
                lambda: all(closed_by_peer(s) for s in idle),
                timeout=30,
                interval=0.05,
                message="idle connections outlived the handshake deadline",
            )
        finally:
            for s in idle:
                s.close()
        assert "to make room (sessions.max_connections_per_source)" in rw.log_text()


def test_wrong_tokens_from_the_parents_address_never_lock_the_parent_out(
    host: tuple[TestHosts, Path], token_file: Path
) -> None:
    with remote_worker(host, 19396, "--token-file", str(token_file)) as rw:
        # A guesser on the parent's host: more failures than the limit, within its window.
        for _ in range(FailedAuthLimiter().max_failures + 2):
            with socket.create_connection((rw.address, rw.port), timeout=30) as s:
                s.sendall(encode_auth(b"not the token at all") + encode_lp_json(manifest()))
                data = s.recv(4096)
                assert b"authentication failed" in data, data
        # The parent, with the correct token, attaches at once.
        took = attach_and_run(rw, token_file)
        assert took < 20.0, took
        assert "a correct token is still accepted" in rw.log_text()


# -- TLS: connections that never start their TLS handshake ---------------------------------------


def test_connections_that_never_start_tls_count_against_the_source_limit(
    start_worker: Callable[..., RunningWorker], tmp_path: Path
) -> None:
    cert, key = self_signed(tmp_path)
    w = start_worker(
        "--set",
        f'tls.cert_file="{cert}"',
        "--set",
        f'tls.key_file="{key}"',
        "--set",
        "sessions.max_connections_per_source=4",
        "--set",
        "sessions.handshake_timeout=60.0",
    )
    idle = [socket.create_connection(("127.0.0.1", w.port), timeout=30) for _ in range(10)]
    try:
        for s in idle:
            w.wait_accepted(s)
        # The 6 oldest were closed to make room, long before the 60 s deadline.
        poll_for(
            lambda: all(closed_by_peer(s) for s in idle[:6]),
            timeout=20,
            interval=0.05,
            message="connections in no TLS handshake were not counted",
        )
        assert not any(closed_by_peer(s) for s in idle[6:])
        # A parent from the same address gets its session.
        client = ssl.create_default_context(cafile=str(cert))
        assert w.handshake(manifest(worker_id=0), context=client)["ok"] is True
    finally:
        for s in idle:
            with contextlib.suppress(OSError):
                s.close()
    assert w.stop() == 0


def test_with_a_source_limit_of_one_each_new_connection_replaces_the_last(
    start_worker: Callable[..., RunningWorker],
) -> None:
    w = start_worker(
        "--set", "sessions.max_connections_per_source=1", "--set", "sessions.handshake_timeout=60.0"
    )
    conns = [socket.create_connection(("127.0.0.1", w.port), timeout=30) for _ in range(4)]
    try:
        for s in conns:
            w.wait_accepted(s)
        poll_for(
            lambda: all(closed_by_peer(s) for s in conns[:3]),
            timeout=20,
            interval=0.05,
            message="a connection that was replaced stayed open",
        )
        assert not closed_by_peer(conns[3])
        assert w.handshake(manifest(worker_id=0))["ok"] is True
    finally:
        for s in conns:
            s.close()
    assert w.stop() == 0
