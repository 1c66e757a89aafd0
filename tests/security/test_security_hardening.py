"""Hardening: a cancelled control, tokens and key files (failed-auth limit, start-up
warnings), the metrics listener's limits and token, bounded error texts and
LOCAL_SLOT_EXHAUSTED.

The daemon cases share one module daemon: TCP (TLS + token), metrics with a token, and
``tests`` allowed, so a slow import holds a registration control open on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest

from simpler_daemon import Worker
from simpler_daemon.callables import SlotTable
from simpler_daemon.client import Client, sub_task, tensor
from simpler_daemon.errors import ConfigError, RegistrationError
from simpler_daemon.remote_worker import config as remote_cfg
from simpler_daemon.remote_worker.admission import FAILED_AUTH_DELAY_S
from simpler_daemon.server import config as cfg
from simpler_daemon.server.daemon import Daemon
from simpler_daemon.server.metrics import MAX_CONNECTIONS, Metrics
from simpler_daemon.server.status import bound_text, status_of
from simpler_daemon.system.authguard import (
    MIN_TOKEN_BYTES,
    FailedAuthLimiter,
    peer_host,
    read_token_file,
)
from simpler_daemon.testing import leaked_shm, poll_for, self_signed_cert, shm_files
from tests.support.daemon_harness import EXAMPLES, DaemonProcess, module_leak_guard, wait_until
from tests.support.remote_worker import TOKEN, RunningWorker

pytestmark = pytest.mark.timeout(120)

Code = grpc.StatusCode
SLOW = "tests.support.slow_import:fn"
GOOD_TOKEN = "hardening-token-0123456789abcdef"
METRICS_TOKEN = "metrics-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"


def _cert(directory: Path) -> tuple[Path, Path]:
    pair = self_signed_cert(directory)
    if pair is None:
        pytest.skip("the openssl CLI is not available")
    return pair


def _secret(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


# --------------------------------------------------------------------------- the module daemon


#: Pids of this module's daemon: the leak guard of tests that do not use it ignores it.
_MODULE_DAEMONS: set[int] = set()


class Hardened:
    def __init__(self, daemon: DaemonProcess, cert: Path) -> None:
        self.daemon = daemon
        self.cert = cert
        out = daemon.stdout()
        line = next(x for x in out.splitlines() if "listening on tcp" in x)
        self.tcp = line.split("listening on tcp ", 1)[1].split()[0]
        found = wait_until(
            lambda: re.search(r"metrics listening on 127\.0\.0\.1:(\d+)", daemon.stderr()),
            message="the daemon never logged its metrics port",
        )
        self.metrics_port = int(found.group(1))

    def tcp_client(self, token: str | None, **kw: Any) -> Client:
        return Client(
            self.tcp, token=token, root_certificates=str(self.cert), server_name="localhost", **kw
        )


@pytest.fixture(scope="module")
def hardened(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hardened]:
    secrets = tmp_path_factory.mktemp("secrets")
    cert, key = _cert(secrets)
    token = _secret(secrets / "token", GOOD_TOKEN)
    metrics_token = _secret(secrets / "metrics-token", METRICS_TOKEN)
    admin_token = _secret(secrets / "admin-token", ADMIN_TOKEN)
    overrides: dict[str, dict[str, Any]] = {
        "workers": {"num_sub_workers": 2, "num_chips": 0},
        "grpc": {
            "tcp_listen": "127.0.0.1:0",
            "tls_cert": str(cert),
            "tls_key": str(key),
            "token_file": str(token),
        },
        "callables": {"allowed_modules": ["simpler_daemon.examples", "tests"]},
        "metrics": {"listen": "127.0.0.1:0", "token_file": str(metrics_token)},
        "security": {"admin_token_file": str(admin_token)},
    }
    # The daemon's children import SLOW in 2 s: a registration outlives its caller.
    env = {"SIMPLER_TEST_IMPORT_SLEEP": "2.0"}
    shm_before = shm_files()
    daemon = DaemonProcess(tmp_path_factory.mktemp("hardened"), overrides, env=env)
    try:
        daemon.start()
        _MODULE_DAEMONS.add(daemon.pid)
        yield Hardened(daemon, cert)
    except BaseException:
        daemon.kill()
        raise
    code = daemon.stop()
    assert code == 0, f"daemon exited with {code}:\n{daemon.stderr()}"
    daemon.children_gone()
    # Other daemons on the machine (not ours) may hold heaps: leaked_shm ignores them.
    assert not leaked_shm(shm_before)


@pytest.fixture(autouse=True)
def no_leaked_children(request: pytest.FixtureRequest) -> Iterator[None]:
    """The conftest guard, minus the module daemon (alive from its first test on)."""
    if "hardened" in request.fixturenames:
        request.getfixturevalue("hardened")
    yield from module_leak_guard(lambda: set(_MODULE_DAEMONS))


# --------------------------------------------------------------------------- a cancelled control


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_a_register_cancelled_inside_its_control_leaves_registration_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "importing"
    monkeypatch.setenv("SIMPLER_TEST_IMPORT_MARKER", str(marker))
    monkeypatch.setenv("SIMPLER_TEST_IMPORT_SLEEP", "1.0")
    w = Worker(num_sub_workers=2, heap_bytes=4 << 20)
    async with w:
        slow = asyncio.create_task(w.register_async(SLOW))
        # Cancel only once a child is inside the control (between begin and poll).
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert time.monotonic() < deadline, "no child started the slow import"
            await asyncio.sleep(0.01)
        assert any(ep.control_busy for ep in w.sub_endpoints)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        # The next registration waits for the abandoned control, then goes through.
        h = await asyncio.wait_for(w.register_async("tests.support.sub_tasks:noop"), 30)
        assert w.registry.get(h.hashid).refcount == 1
        # Tiny deadlines again and again: every control still ends, none is left busy.
        for name in ("record_pid", "add_one", "set_flag"):
            with contextlib.suppress(TimeoutError, RegistrationError):
                await asyncio.wait_for(w.register_async(f"tests.support.sub_tasks:{name}"), 0.0003)
        h2 = await asyncio.wait_for(w.register_async("tests.support.sub_tasks:record_pid"), 30)
        assert w.registry.get(h2.hashid) is not None
        deadline = time.monotonic() + 30
        while any(ep.control_busy for ep in w.sub_endpoints):
            assert time.monotonic() < deadline, "a control stayed in flight"
            await asyncio.sleep(0.01)
        assert not any(ep.poisoned for ep in w.sub_endpoints)


def test_register_callable_past_its_deadline_leaves_registration_working(
    hardened: Hardened,
) -> None:
    d = hardened.daemon
    # The slow import (2 s) outlives the caller's 0.5 s deadline: the control is
    # cancelled in the daemon between its publication and its answer.
    with d.client(timeout=0.5) as c, pytest.raises(grpc.RpcError) as info:
        c.register(SLOW)
    assert info.value.code() == Code.DEADLINE_EXCEEDED
    for _ in range(5):
        with d.client(timeout=0.0003) as c, contextlib.suppress(grpc.RpcError):
            c.register(f"{EXAMPLES}:empty")
    with d.client(timeout=30) as c:
        fill = c.register(f"{EXAMPLES}:fill")
        buf = int(c.alloc_buffer((4,), "int32").buffer_id)
        c.wait(c.submit([sub_task(fill, [tensor(buf, "output", (4,), "int32")], [7])]), 30)
        assert c.read_array(buf, (4,), "int32").tolist() == [7] * 4
        c.free_buffer(buf)


# --------------------------------------------------------------------------- tokens and key files


def test_token_files_need_a_minimum_length_and_mode_0600(tmp_path: Path) -> None:
    short = _secret(tmp_path / "short", "x" * (MIN_TOKEN_BYTES - 1))
    with pytest.raises(ConfigError) as info:
        read_token_file(str(short), "grpc.token_file")
    assert info.value.key == "grpc.token_file"
    assert str(short) in str(info.value) and f"at least {MIN_TOKEN_BYTES}" in str(info.value)
    for mode in (0o640, 0o604, 0o660):
        loose = _secret(tmp_path / f"loose{mode:o}", GOOD_TOKEN, mode)
        with pytest.raises(ConfigError) as info:
            read_token_file(str(loose), "grpc.token_file")
        assert f"chmod 600 {loose}" in str(info.value)
    assert read_token_file(str(_secret(tmp_path / "ok", GOOD_TOKEN)), "k") == GOOD_TOKEN.encode()


def _tcp_config(tmp_path: Path, token: Path, key: Path, cert: Path) -> cfg.DaemonConfig:
    return cfg.load(
        None,
        env={},
        overrides={
            "daemon.runtime_dir": str(tmp_path / "run"),
            "grpc.tcp_listen": "127.0.0.1:0",
            "grpc.tls_cert": str(cert),
            "grpc.tls_key": str(key),
            "grpc.token_file": str(token),
        },
    )


def test_daemon_refuses_a_short_token_or_a_loose_key_at_start(tmp_path: Path) -> None:
    cert, key = _cert(tmp_path)
    short = _secret(tmp_path / "token", "s3cret-token")  # 12 bytes: accepted before
    with pytest.raises(ConfigError) as info:
        Daemon(_tcp_config(tmp_path, short, key, cert)).prepare()
    assert info.value.key == "grpc.token_file" and str(short) in str(info.value)
    good = _secret(tmp_path / "good", GOOD_TOKEN)
    key.chmod(0o644)
    with pytest.raises(ConfigError) as info:
        Daemon(_tcp_config(tmp_path, good, key, cert)).prepare()
    assert info.value.key == "grpc.tls_key" and f"chmod 600 {key}" in str(info.value)
    metrics_token = _secret(tmp_path / "m", METRICS_TOKEN, 0o644)
    config = cfg.load(
        None,
        env={},
        overrides={
            "daemon.runtime_dir": str(tmp_path / "run"),
            "metrics.listen": "127.0.0.1:0",
            "metrics.token_file": str(metrics_token),
        },
    )
    with pytest.raises(ConfigError) as info:
        Daemon(config).prepare()
    assert info.value.key == "metrics.token_file"
    short_admin = _secret(tmp_path / "admin", "admin")
    config = cfg.load(
        None,
        env={},
        overrides={
            "daemon.runtime_dir": str(tmp_path / "run"),
            "security.admin_token_file": str(short_admin),
        },
    )
    with pytest.raises(ConfigError) as info:
        Daemon(config).prepare()
    assert info.value.key == "security.admin_token_file"


def test_remote_worker_refuses_a_short_token_or_a_loose_key(tmp_path: Path) -> None:
    cert, key = _cert(tmp_path)
    short = _secret(tmp_path / "token", "s3cret")
    config = remote_cfg.load(None, env={}, overrides={"auth.token_file": str(short)})
    with pytest.raises(ConfigError) as info:
        remote_cfg.load_credentials(config)
    assert info.value.key == "auth.token_file" and str(short) in str(info.value)
    key.chmod(0o640)
    config = remote_cfg.load(
        None, env={}, overrides={"tls.cert_file": str(cert), "tls.key_file": str(key)}
    )
    with pytest.raises(ConfigError) as info:
        remote_cfg.load_credentials(config)
    assert info.value.key == "tls.key_file" and "chmod 600" in str(info.value)


def test_failed_auth_limiter_blocks_a_host_for_a_while() -> None:
    now = [1000.0]
    lim = FailedAuthLimiter(3, 10.0, 30.0, max_hosts=4, clock=lambda: now[0])
    assert [lim.failed("10.77.0.1") for _ in range(2)] == [1, 2]
    assert lim.blocked_for("10.77.0.1") == 0.0
    now[0] += 11  # the window slid past both failures
    assert lim.failed("10.77.0.1") == 1
    assert lim.failed("10.77.0.1") == 2 and lim.failed("10.77.0.1") == 3
    assert lim.blocked_for("10.77.0.1") == 30.0
    assert lim.blocked_for("10.77.0.2") == 0.0  # per host
    now[0] += 30.5
    assert lim.blocked_for("10.77.0.1") == 0.0
    for i in range(100):  # memory stays bounded
        lim.failed(f"10.77.1.{i}")
    assert len(lim._failures) <= 4
    assert peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "::1"
    assert peer_host("ipv6:%5B::1%5D:5000") == "::1"


def test_tcp_host_with_too_many_failed_auths_is_slowed_but_its_right_token_passes(
    hardened: Hardened,
) -> None:
    """Limit the failures, not the source: wrong tokens from one host used to lock that
    host out for 60 s, the right token included (a local user who cannot read the token
    could lock the real client out)."""
    h = hardened
    with h.tcp_client(ADMIN_TOKEN, timeout=10) as c:  # the admin token passes TCP too
        assert c.get_info().pid == h.daemon.pid
    for _ in range(FailedAuthLimiter().max_failures):
        with h.tcp_client("wrong-token", timeout=10) as c, pytest.raises(grpc.RpcError) as info:
            c.get_info()
        assert info.value.code() == Code.UNAUTHENTICATED
    # Over the limit: a further wrong token is answered late and named ...
    with h.tcp_client("wrong-token", timeout=10) as c, pytest.raises(grpc.RpcError) as info:
        c.get_info()
    assert info.value.code() == Code.RESOURCE_EXHAUSTED
    assert "too many failed authentications from 127.0.0.1" in (info.value.details() or "")
    # ... while the right token from the same host passes.
    with h.tcp_client(GOOD_TOKEN, timeout=10) as c:
        assert c.get_info().pid == h.daemon.pid
    err = h.daemon.stderr()
    assert re.search(r"rejected a TCP call to \S+ from ipv4:127\.0\.0\.1:\d+: wrong bearer", err)
    assert "slowing failed TCP calls from ipv4:127.0.0.1" in err
    with h.daemon.client() as c:  # the Unix socket is not affected
        assert c.get_info().pid == h.daemon.pid


def test_remote_worker_slows_a_hosts_failures_but_never_refuses_its_correct_token(
    start_worker: Callable[..., RunningWorker],
) -> None:
    w = start_worker()
    for _ in range(FailedAuthLimiter().max_failures):
        assert w.handshake(token=b"wrong")["error"].endswith("authentication failed")
    # Over the limit: the right token from the same host is still accepted at once...
    assert w.handshake(token=TOKEN)["ok"] is True
    # ... and a wrong one is still refused, only later (answered after a delay).
    t0 = time.monotonic()
    assert w.handshake(token=b"wrong")["error"].endswith("authentication failed")
    assert time.monotonic() - t0 >= FAILED_AUTH_DELAY_S * 0.9
    log = w.log_text()
    assert re.search(r"refused 127\.0\.0\.1:\d+: cannot open session: authentication", log)
    assert "failed authentications from 127.0.0.1 within 60 s" in log
    assert "a correct token is still accepted" in log
    assert w.stop() == 0


def test_wide_socket_mode_and_public_metrics_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = cfg.load(
        None,
        env={},
        overrides={
            "daemon.runtime_dir": str(tmp_path / "run"),
            "grpc.socket_mode": 0o666,
            "metrics.listen": "0.0.0.0:9464",  # never bound: only the warning is checked
        },
    )
    with caplog.at_level(logging.WARNING, logger="simpler_daemon.daemon"):
        Daemon(config)._load_credentials()
    text = caplog.text
    assert "grpc.socket_mode 0o666 is wider than 0o660" in text
    assert "metrics.listen 0.0.0.0:9464 is not a loopback address" in text
    assert "set metrics.token_file" in text
    caplog.clear()
    quiet = msgspec.structs.replace(
        config,
        grpc=msgspec.structs.replace(config.grpc, socket_mode=0o660),
        metrics=msgspec.structs.replace(config.metrics, listen="127.0.0.1:9464"),
    )
    with caplog.at_level(logging.WARNING, logger="simpler_daemon.daemon"):
        Daemon(quiet)._load_credentials()
    assert "wider" not in caplog.text and "loopback" not in caplog.text


# --------------------------------------------------------------------------- the metrics listener


async def _http(port: int, head: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@pytest.mark.asyncio
async def test_metrics_listener_caps_connections_and_idle_time() -> None:
    metrics = Metrics(runtime_metrics=False, idle_timeout=1.0)
    await metrics.start("127.0.0.1", 0)
    port = metrics.port
    assert port is not None
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(MAX_CONNECTIONS + 36):
            conns.append(await asyncio.open_connection("127.0.0.1", port))

        async def closed(reader: asyncio.StreamReader) -> bool:
            try:
                return await asyncio.wait_for(reader.read(1), 0.01) == b""
            except TimeoutError:
                return False
            except ConnectionError:
                return True

        # Past the cap, connections are closed at once; the others when idle too long.
        deadline = time.monotonic() + 30
        while sum([await closed(r) for r, _ in conns]) < 36:
            assert time.monotonic() < deadline, "connections past the cap stayed open"
            await asyncio.sleep(0.01)
        assert metrics.refused_connections >= 36
        deadline = time.monotonic() + 30
        while len(metrics._connections):
            assert time.monotonic() < deadline, "idle connections were never closed"
            await asyncio.sleep(0.05)
        reply = await _http(port, b"GET /metrics HTTP/1.1\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 200 ")
    finally:
        for _, writer in conns:
            writer.close()
        await metrics.close()


@pytest.mark.asyncio
async def test_metrics_listener_can_require_a_token() -> None:
    metrics = Metrics(runtime_metrics=False, token=METRICS_TOKEN.encode())
    await metrics.start("127.0.0.1", 0)
    port = metrics.port
    assert port is not None
    try:
        for head in (
            b"GET /metrics HTTP/1.1\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer wrong\r\n\r\n",
            b"GET /nothing HTTP/1.1\r\n\r\n",  # no token: not even a 404
        ):
            reply = await _http(port, head)
            assert reply.startswith(b"HTTP/1.1 401 "), reply[:80]
            assert b"WWW-Authenticate: Bearer" in reply
        good = f"GET /metrics HTTP/1.1\r\nauthorization: Bearer {METRICS_TOKEN}\r\n\r\n"
        reply = await _http(port, good.encode())
        assert reply.startswith(b"HTTP/1.1 200 ") and b"simpler_daemon_runs" in reply
    finally:
        await metrics.close()


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_idle_metrics_connections_cannot_exhaust_the_daemons_descriptors(
    hardened: Hardened,
) -> None:
    h = hardened
    before = _open_fds(h.daemon.pid)
    socks: list[socket.socket] = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", h.metrics_port), timeout=10)
            s.setblocking(False)
            socks.append(s)

        def closed_by_daemon() -> int:
            n = 0
            for s in socks:
                try:
                    n += s.recv(1) == b""
                except BlockingIOError:
                    pass
                except ConnectionError:
                    n += 1
            return n

        # Past the cap the daemon closes them at once (long before the 10 s idle limit
        # would), so it holds at most MAX_CONNECTIONS descriptors for them.
        poll_for(
            lambda: closed_by_daemon() >= 300 - MAX_CONNECTIONS,
            timeout=8,
            message="the daemon kept every idle metrics connection open",
        )
        assert _open_fds(h.daemon.pid) <= before + MAX_CONNECTIONS + 8
        with h.daemon.client(timeout=30) as c:  # gRPC still serves
            assert c.get_info().pid == h.daemon.pid
    finally:
        for s in socks:
            s.close()
    head = f"GET /metrics HTTP/1.1\r\nAuthorization: Bearer {METRICS_TOKEN}\r\n\r\n".encode()

    def scrape(request: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", h.metrics_port), timeout=30) as s:
            s.sendall(request)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            return data

    reply = wait_until(lambda: scrape(head), timeout=30)
    assert reply.startswith(b"HTTP/1.1 200 ")
    assert scrape(b"GET /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 401 ")


# --------------------------------------------------------------------------- bounded error texts


def test_bound_text_cuts_long_echoed_values() -> None:
    text = bound_text("cannot register " + "a" * 16384 + ":fn: not allowed")
    assert text.startswith("cannot register " + "a" * 256 + " … (16388 chars)")
    assert text.endswith(" not allowed") and len(text) < 400
    assert len(bound_text(" ".join(["word"] * 5000)).encode()) <= 2100
    assert bound_text("short text") == "short text"
    assert bound_text(text) == text


def test_a_16_kib_import_path_gets_a_bounded_error_not_stream_removed(
    hardened: Hardened,
) -> None:
    with hardened.daemon.client(timeout=30) as c:
        for path in ("x" * 16384 + ":fn", f"{EXAMPLES}:" + "a" * 16384, "m:" + "b" * 16384):
            with pytest.raises(grpc.RpcError) as info:
                c.register(path)
            code, details = info.value.code(), info.value.details() or ""
            assert code not in (Code.UNAVAILABLE, Code.UNKNOWN, Code.INTERNAL), (code, details)
            assert "Stream removed" not in details
            assert len(details) < 2200, details[:300]
        # A long value that is echoed arrives cut to its start and its length.
        with pytest.raises(grpc.RpcError) as info:
            c.register(f"{EXAMPLES}:" + "a" * 900)
        details = info.value.details() or ""
        assert re.search(r"tasks:a+ … \(931 chars\)", details) and "a" * 257 not in details
        assert c.get_info().pid == hardened.daemon.pid


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_local_slot_exhausted_is_resource_exhausted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Children build their slot table after the fork: a capacity of 2 applies to them.
    monkeypatch.setattr(SlotTable.__init__, "__defaults__", (2,))
    w = Worker(num_sub_workers=1, heap_bytes=4 << 20)
    async with w:
        await w.register_async("tests.support.sub_tasks:noop")
        await w.register_async("tests.support.sub_tasks:record_pid")
        with pytest.raises(RegistrationError) as info:
            await w.register_async("tests.support.sub_tasks:add_one")
    assert "LOCAL_SLOT_EXHAUSTED" in str(info.value)
    assert status_of(info.value) == Code.RESOURCE_EXHAUSTED
