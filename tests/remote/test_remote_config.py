"""simpler-remote-worker config (layering, every error names its key, credentials, the
deploy example and unit) and the session manifest (validation, handshake byte helpers)."""

from __future__ import annotations

import asyncio
import configparser
import json
import re
import secrets
import socket
import ssl
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from simpler_daemon.callables import spec_for_chip, spec_for_import
from simpler_daemon.errors import ConfigError, ManifestError, ProtocolError
from simpler_daemon.remote.manifest import (
    MAX_MANIFEST_BYTES,
    HandshakeReply,
    Manifest,
    ManifestLimits,
    RunnerSpec,
    decode_manifest,
    decode_reply,
    encode_auth,
    encode_lp_json,
    format_host_port,
    module_allowed,
    read_auth,
    read_lp,
    read_lp_sock,
    validate_manifest,
)
from simpler_daemon.remote_worker import config as cfg
from simpler_daemon.remote_worker.config import RemoteWorkerConfig
from tests.support.remote_worker import run_cli, self_signed

pytestmark = pytest.mark.timeout(60)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EXAMPLE = DEPLOY / "config" / "remote-worker.toml"
UNIT = DEPLOY / "systemd" / "simpler-remote-worker.service"

# What the example changes for the systemd unit; everything else is the default.
DEPLOYMENT = {
    "worker.listen": "0.0.0.0:19073",
    "auth.token_file": "/etc/simpler-remote-worker/token",
    "tls.cert_file": "/etc/simpler-remote-worker/tls/worker.crt",
    "tls.key_file": "/etc/simpler-remote-worker/tls/worker.key",
}


def load_text(tmp_path: Path, text: str, **kwargs: Any) -> RemoteWorkerConfig:
    path = tmp_path / "worker.toml"
    path.write_text(text)
    kwargs.setdefault("env", {})
    return cfg.load(path, **kwargs)


def config_error(tmp_path: Path, text: str, **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, text, **kwargs)
    return info.value


# --------------------------------------------------------------------------- config


def test_defaults() -> None:
    config = cfg.load(None, env={})
    assert config == RemoteWorkerConfig()
    assert config.worker.listen == "127.0.0.1:19073" == cfg.DEFAULT_LISTEN
    assert config.listen_address == ("127.0.0.1", 19073)
    assert not config.tls_enabled
    assert config.auth.token_file == ""
    assert config.sessions.max == 16
    assert config.sessions.max_manifest_bytes == MAX_MANIFEST_BYTES
    assert config.callables.allowed_modules == ["simpler_daemon.examples"]
    assert config.callables.python_path == []


def test_layers_file_env_overrides(tmp_path: Path) -> None:
    text = '[worker]\nlisten = "127.0.0.2:1"\n[sessions]\nmax = 3\nhandshake_timeout = 4.5\n'
    config = load_text(
        tmp_path,
        text,
        env={"SIMPLER_REMOTE_WORKER__SESSIONS__MAX": "5", "OTHER": "x"},
        overrides={"worker.listen": "127.0.0.3:7", "sessions.kill_grace": "0.5"},
    )
    assert config.worker.listen == "127.0.0.3:7"
    assert config.sessions.max == 5
    assert config.sessions.handshake_timeout == 4.5
    assert config.sessions.kill_grace == 0.5


def test_string_setting_keeps_text_from_env(tmp_path: Path) -> None:
    config = load_text(tmp_path, "", env={"SIMPLER_REMOTE_WORKER__WORKER__LISTEN": "[::1]:9"})
    assert config.listen_address == ("::1", 9)


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ("[nope]\n", "nope", "unknown key nope"),
        ("[worker]\nlisten2 = 1\n", "worker.listen2", "unknown key worker.listen2"),
        ("[sessions]\nmax = 'x'\n", "sessions.max", "Expected int"),
        ("[worker]\nlog_level = 'loud'\n", "worker.log_level", "choose one of"),
        ("[worker]\nlisten = 'nocolon'\n", "worker.listen", "not host:port"),
        ("[worker]\nlisten = '::1:9'\n", "worker.listen", "brackets"),
        ("[worker]\nlisten = 'h:70000'\n", "worker.listen", "0..65535"),
        ("[worker]\nshutdown_grace = -1.0\n", "worker.shutdown_grace", ">= 0"),
        ("[worker]\nspec_dir = 'rel'\n", "worker.spec_dir", "absolute"),
        ("[auth]\ntoken_file = 'token'\n", "auth.token_file", "absolute"),
        ("[tls]\ncert_file = '/c.pem'\n", "tls.key_file", "required when tls.cert_file"),
        ("[tls]\nkey_file = '/k.pem'\n", "tls.cert_file", "required when tls.key_file"),
        ("[tls]\nclient_ca_file = '/ca.pem'\n", "tls.client_ca_file", "requires tls.cert_file"),
        ("[sessions]\nmax = 0\n", "sessions.max", "> 0"),
        ("[sessions]\nmax_connections = 0\n", "sessions.max_connections", "> 0"),
        (
            "[sessions]\nmax_connections_per_source = 0\n",
            "sessions.max_connections_per_source",
            "> 0",
        ),
        ("[sessions]\nmax_callables = -1\n", "sessions.max_callables", ">= 0"),
        ("[sessions]\nmax_manifest_bytes = 16777217\n", "sessions.max_manifest_bytes", "at most"),
        ("[sessions]\nhandshake_timeout = 0.0\n", "sessions.handshake_timeout", "> 0"),
        ("[sessions]\nhandshake_timeout = nan\n", "sessions.handshake_timeout", "> 0"),
        ("[sessions]\nmax_startup = inf\n", "sessions.max_startup", "> 0"),
        ("[sessions]\nkill_grace = -0.1\n", "sessions.kill_grace", ">= 0"),
        ("[sessions]\nmax_heap_bytes = 0\n", "sessions.max_heap_bytes", "> 0"),
        ("[callables]\nallowed_modules = ['a..b']\n", "callables.allowed_modules[0]", "dotted"),
        ("[callables]\npython_path = ['/tmp', 'rel']\n", "callables.python_path[1]", "absolute"),
        ("[callables]\npython_path = ['/a:/b']\n", "callables.python_path[0]", "separator"),
        ("[callables]\npython_path = ['']\n", "callables.python_path[0]", "empty"),
    ],
)
def test_every_error_names_its_key(tmp_path: Path, text: str, key: str, fragment: str) -> None:
    exc = config_error(tmp_path, text)
    assert exc.key == key
    assert key in str(exc) and fragment in str(exc)
    assert str(exc).startswith(f"cannot load config {tmp_path / 'worker.toml'}: ")


def test_python_path_entries_must_be_existing_directories(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    afile = tmp_path / "afile"
    afile.write_text("")
    for bad, fragment in (
        (tmp_path / "missing", "does not exist"),
        (afile, "is not a directory"),
    ):
        exc = config_error(tmp_path, f"[callables]\npython_path = ['{jobs}', '{bad}']\n")
        assert exc.key == "callables.python_path[1]"
        assert f"callables.python_path[1]: '{bad}' {fragment}" in str(exc)
    # check-config says the same, with exit status 2 and nothing started.
    (tmp_path / "w.toml").write_text(f"[callables]\npython_path = ['{tmp_path / 'missing'}']\n")
    done = run_cli("check-config", str(tmp_path / "w.toml"))
    assert done.returncode == 2, done
    assert f"callables.python_path[0]: '{tmp_path / 'missing'}' does not exist" in done.stderr
    assert cfg.load(None, env={}, overrides={"callables.python_path": [str(jobs)]})


def test_error_names_where_the_value_came_from(tmp_path: Path) -> None:
    exc = config_error(tmp_path, "", env={"SIMPLER_REMOTE_WORKER__SESSIONS__MAX": "-1"})
    assert "sessions.max (from SIMPLER_REMOTE_WORKER__SESSIONS__MAX): must be > 0" in str(exc)
    exc = config_error(tmp_path, "", overrides={"sessions.max": "-1"})
    assert "sessions.max (from the command line)" in str(exc)
    exc = config_error(tmp_path, "", overrides={"nodot": 1})
    assert exc.key == "nodot"
    exc = config_error(tmp_path, "", env={"SIMPLER_REMOTE_WORKER__X": "1"})
    assert exc.key == "SIMPLER_REMOTE_WORKER__X"


def test_unreadable_and_unparsable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        cfg.load(tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match="cannot parse config"):
        load_text(tmp_path, "[worker\n")
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        cfg.load(tmp_path / "bin.toml", env={})


@pytest.mark.parametrize("host", ["0.0.0.0", "10.77.0.2", "[::]", "example.org"])
def test_non_loopback_listener_needs_tls_and_token(tmp_path: Path, host: str) -> None:
    listen = f"{host}:19073"
    exc = config_error(tmp_path, f"[worker]\nlisten = '{listen}'\n")
    assert exc.key == "worker.listen"
    assert "TLS (tls.cert_file, tls.key_file) and a token (auth.token_file) are not" in str(exc)
    assert "TLS" in str(exc) and "auth.token_file" in str(exc) and "--insecure" in str(exc)
    # A token alone or TLS alone is not enough.
    token_only = f"[worker]\nlisten = '{listen}'\n[auth]\ntoken_file = '/t'\n"
    assert "tls.cert_file" in str(config_error(tmp_path, token_only))
    tls_only = f"[worker]\nlisten = '{listen}'\n[tls]\ncert_file = '/c'\nkey_file = '/k'\n"
    assert "auth.token_file" in str(config_error(tmp_path, tls_only))
    # Both, or --insecure, are accepted.
    both = tls_only + "[auth]\ntoken_file = '/t'\n"
    assert load_text(tmp_path, both).worker.listen == listen
    assert load_text(tmp_path, f"[worker]\nlisten = '{listen}'\n", insecure=True)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "localhost", "[::1]"])
def test_loopback_listener_needs_nothing(tmp_path: Path, host: str) -> None:
    assert load_text(tmp_path, f"[worker]\nlisten = '{host}:0'\n").listen_address[1] == 0


def test_manifest_limits_follow_config(tmp_path: Path) -> None:
    config = load_text(
        tmp_path,
        "[sessions]\nmax_callables = 2\nmax_sub_workers = 3\nmax_chips = 4\n"
        "max_heap_bytes = 5\nmax_session_timeout = 6.0\n"
        "[callables]\nallowed_modules = ['a.b', 'c.']\n",
    )
    assert cfg.manifest_limits(config) == ManifestLimits(
        allowed_modules=("a.b", "c."),
        max_callables=2,
        max_sub_workers=3,
        max_chips=4,
        max_heap_bytes=5,
        max_session_timeout_s=6.0,
    )
    assert config.callables.allows("c.d") and not config.callables.allows("cd")


# --------------------------------------------------------------------------- credentials


def test_token_file_is_read_stripped_and_guarded(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_bytes(b"  s3cret-s3cret-s3cret\n")
    token.chmod(0o600)
    config = load_text(tmp_path, f"[auth]\ntoken_file = '{token}'\n")
    assert cfg.load_credentials(config) == cfg.Credentials(b"s3cret-s3cret-s3cret", None)
    for mode in (0o644, 0o640):  # neither others nor the group may read it
        token.chmod(mode)
        with pytest.raises(ConfigError, match="group or others may read") as info:
            cfg.load_credentials(config)
        assert info.value.key == "auth.token_file"
    token.chmod(0o600)
    token.write_bytes(b" \n")
    with pytest.raises(ConfigError, match="is empty"):
        cfg.load_credentials(config)
    token.write_bytes(b"x" * 4097)
    with pytest.raises(ConfigError, match="at most 4096"):
        cfg.load_credentials(config)
    token.unlink()
    with pytest.raises(ConfigError, match="cannot read") as info:
        cfg.load_credentials(config)
    assert info.value.key == "auth.token_file"


def test_tls_context(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    text = f"[tls]\ncert_file = '{cert}'\nkey_file = '{key}'\n"
    context = cfg.load_credentials(load_text(tmp_path, text)).ssl_context
    assert context is not None and context.verify_mode == ssl.CERT_NONE
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    mutual = cfg.load_credentials(load_text(tmp_path, text + f"client_ca_file = '{cert}'\n"))
    assert mutual.ssl_context is not None
    assert mutual.ssl_context.verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(ConfigError) as info:
        cfg.load_credentials(load_text(tmp_path, text.replace(str(key), str(cert))))
    assert info.value.key == "tls.cert_file"
    missing_ca = text + f"client_ca_file = '{tmp_path / 'none.pem'}'\n"
    with pytest.raises(ConfigError) as info:
        cfg.load_credentials(load_text(tmp_path, missing_ca))
    assert info.value.key == "tls.client_ca_file"


# --------------------------------------------------------------------------- deploy


_SECTION = re.compile(r"^\[(\w+)\]\s*$")
_DEFAULT_LINE = re.compile(r"^#\s?([a-z_]+) = (.+)$")
_ACTIVE_LINE = re.compile(r"^([a-z_]+)\s*=\s*(.+)$")


def test_example_documents_every_option_with_its_default() -> None:
    defaults: dict[str, list[str]] = {}
    active: dict[str, str] = {}
    section = ""
    for line in EXAMPLE.read_text().splitlines():
        if m := _SECTION.match(line):
            section = m[1]
        elif m := _DEFAULT_LINE.match(line):
            defaults.setdefault(f"{section}.{m[1]}", []).append(m[2])
        elif m := _ACTIVE_LINE.match(line):
            active[f"{section}.{m[1]}"] = m[2]
    default = RemoteWorkerConfig()
    options = {
        f"{s.name}.{f.name}": getattr(getattr(default, s.name), f.name)
        for s in msgspec.structs.fields(RemoteWorkerConfig)
        for f in msgspec.structs.fields(s.type)
    }
    assert set(defaults) == set(options), "options missing or unknown in the example"
    for key, texts in defaults.items():
        assert len(texts) == 1, f"{key} is listed twice"
        assert tomllib.loads(f"v = {texts[0]}")["v"] == options[key], key
    assert {k: tomllib.loads(f"v = {v}")["v"] for k, v in active.items()} == DEPLOYMENT
    overrides: dict[str, object] = dict(DEPLOYMENT)
    assert cfg.load(EXAMPLE, env={}) == cfg.load(None, env={}, overrides=overrides)


def test_unit_runs_the_installed_command() -> None:
    parser = configparser.ConfigParser(interpolation=None, strict=True, comment_prefixes=("#",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    service = parser["Service"]
    assert service["ExecStart"] == (
        "/usr/local/bin/simpler-remote-worker serve --config /etc/simpler-remote-worker/worker.toml"
    )
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert service["WatchdogSec"] == "30"
    assert service["KillMode"] == "mixed"
    assert service["RestartPreventExitStatus"] == "2 3"
    grace = RemoteWorkerConfig().worker.shutdown_grace + RemoteWorkerConfig().sessions.kill_grace
    assert float(service["TimeoutStopSec"]) > grace


# --------------------------------------------------------------------------- manifest


def good_manifest(**changes: Any) -> dict[str, Any]:
    target = "simpler_daemon.examples.tasks:add_scaled"
    m: dict[str, Any] = {
        "session_id": 7,
        "attach_key": secrets.token_hex(32),
        "worker_id": 0,
        "parent_level": 4,
        "remote_level": 3,
        "num_sub_workers": 1,
        "callables": [
            {
                "hashid": spec_for_import(target, "orchestration").handle.hashid,
                "kind": "orchestration",
                "target": target,
            },
            {
                "hashid": spec_for_chip("simpler_daemon.examples.tasks:scale_kernel").handle.hashid,
                "kind": "chip",
                "target": "simpler_daemon.examples.tasks:scale_kernel",
            },
        ],
    }
    m.update(changes)
    return m


LIMITS = ManifestLimits(allowed_modules=("simpler_daemon.examples",), max_callables=2)
ZERO = "sha256:" + "0" * 64

BAD_MANIFESTS: list[tuple[dict[str, Any], str]] = [
    ({"session_id": 0}, "manifest.session_id"),
    ({"session_id": 1 << 64}, "manifest.session_id"),
    ({"session_id": -1}, "manifest.session_id"),
    ({"attach_key": "ab"}, "manifest.attach_key"),
    ({"attach_key": "A" * 64}, "manifest.attach_key"),
    ({"worker_id": -1}, "manifest.worker_id"),
    ({"worker_id": 1 << 31}, "manifest.worker_id"),
    ({"worker_id": "0"}, "manifest.worker_id"),
    ({"worker_id": True}, "manifest.worker_id"),
    ({"parent_level": 3}, "manifest.parent_level"),
    ({"remote_level": 4}, "manifest.remote_level"),
    ({"num_sub_workers": -1}, "manifest.num_sub_workers"),
    ({"num_sub_workers": 0}, "manifest.num_sub_workers"),
    ({"num_sub_workers": 1000}, "manifest.num_sub_workers"),
    ({"num_chips": 65}, "manifest.num_chips"),
    ({"chip_pipeline_depth": 3}, "manifest.chip_pipeline_depth"),
    ({"heap_bytes": 0}, "manifest.heap_bytes"),
    ({"heap_bytes": 1 << 40}, "manifest.heap_bytes"),
    ({"session_timeout_s": 0}, "manifest.session_timeout_s"),
    ({"session_timeout_s": 1e9}, "manifest.session_timeout_s"),
    ({"startup_budget_s": -1.0}, "manifest.startup_budget_s"),
    ({"startup_budget_s": "soon"}, "manifest.startup_budget_s"),
    ({"extra": 1}, "manifest.extra"),
    ({"callables": {}}, "manifest.callables"),
    ({"callables": [{"hashid": ZERO, "kind": "sub", "target": "a:b"}] * 3}, "manifest.callables"),
    ({"callables": [{"hashid": ZERO, "kind": "sub"}]}, "manifest.callables[0].target"),
    (
        {"callables": [{"hashid": ZERO, "kind": "gpu", "target": "a:b"}]},
        "manifest.callables[0].kind",
    ),
    (
        {"callables": [{"hashid": ZERO, "kind": "sub", "target": "a:b", "x": 1}]},
        "manifest.callables[0].x",
    ),
    (
        {"callables": [{"hashid": ZERO, "kind": "sub", "target": "os:system"}]},
        "callables[0].target",
    ),
    (
        {"callables": [{"hashid": ZERO, "kind": "sub", "target": "simpler_daemon.examplesx:f"}]},
        "manifest.callables[0].target",
    ),
    ({"callables": [{"hashid": ZERO, "kind": "sub", "target": "no colon"}]}, "callables[0].target"),
    ({"callables": [{"hashid": ZERO, "kind": "sub", "target": "x" * 2000}]}, "callables[0].target"),
]


@pytest.mark.parametrize(("changes", "key"), BAD_MANIFESTS)
def test_bad_manifest_field_names_its_key(changes: dict[str, Any], key: str) -> None:
    data = msgspec.json.encode(good_manifest(**changes))
    with pytest.raises(ManifestError) as info:
        validate_manifest(decode_manifest(data), LIMITS)
    assert str(info.value).startswith("cannot open session: ")
    assert key in str(info.value)
    assert info.value.key is not None and info.value.key.endswith(key.removeprefix("manifest."))


def test_manifest_hashid_checks() -> None:
    m = good_manifest()
    m["callables"][1]["hashid"] = m["callables"][0]["hashid"]
    with pytest.raises(ManifestError, match=r"manifest\.callables\[1\]\.hashid .* does not match"):
        validate_manifest(decode_manifest(msgspec.json.encode(m)), LIMITS)
    # The same import path as "sub" has the same hashid as "orchestration": a duplicate.
    m = good_manifest()
    m["callables"][1] = dict(m["callables"][0], kind="sub")
    with pytest.raises(ManifestError, match=r"callables\[1\]\.hashid .* repeats callables\[0\]"):
        validate_manifest(decode_manifest(msgspec.json.encode(m)), LIMITS)


def test_manifest_required_fields_and_json() -> None:
    m = good_manifest()
    del m["attach_key"]
    with pytest.raises(ManifestError, match=r"manifest\.attach_key is required") as info:
        decode_manifest(msgspec.json.encode(m))
    assert info.value.key == "manifest.attach_key"
    for data in (b"", b"{", b"[]", b'"x"', b"{}  x"):
        with pytest.raises(ManifestError, match="cannot open session"):
            decode_manifest(data)


def test_good_manifest_and_defaults() -> None:
    m = decode_manifest(msgspec.json.encode(good_manifest()))
    validate_manifest(m, LIMITS)
    assert (m.num_chips, m.chip_pipeline_depth, m.heap_bytes) == (0, 2, 64 << 20)
    assert (m.session_timeout_s, m.startup_budget_s) == (30.0, None)
    assert m.startup_bound_s() == 30.0  # no budget named: the session timeout bounds it
    assert msgspec.structs.replace(m, session_timeout_s=7.0).startup_bound_s() == 7.0
    assert msgspec.structs.replace(m, startup_budget_s=2.5).startup_bound_s() == 2.5
    validate_manifest(msgspec.structs.replace(m, num_sub_workers=0, num_chips=1), LIMITS)
    with pytest.raises(ManifestError, match=r"callables\.allowed_modules \(nothing\)"):
        validate_manifest(m, ManifestLimits())
    # The spec file round-trips.
    spec = RunnerSpec(m, "127.0.0.1", time.time(), ["simpler_daemon.examples"], [])
    assert msgspec.json.decode(msgspec.json.encode(spec), type=RunnerSpec) == spec
    assert json.loads(msgspec.json.encode(spec))["tls"] is None


def test_module_allowed() -> None:
    assert module_allowed("pkg", ["pkg"]) and module_allowed("pkg.a.b", ["pkg"])
    assert module_allowed("pkg.a", ["pkg."]) and module_allowed("pkg", ["pkg."])
    assert not module_allowed("pkgx", ["pkg"]) and not module_allowed("pkgx", ["pkg."])
    assert not module_allowed("pkg", []) and not module_allowed("a", ["", "."])


# --------------------------------------------------------------------------- handshake bytes


def test_encode_auth_and_lp() -> None:
    assert encode_auth(b"tok")[:12] == b"SLRW" + (1).to_bytes(4, "little") + (3).to_bytes(
        4, "little"
    )
    assert encode_auth(b"tok")[12:] == b"tok"
    with pytest.raises(ValueError, match="at most 4096"):
        encode_auth(b"x" * 4097)
    frame = encode_lp_json({"ok": True})
    assert frame == (11).to_bytes(4, "little") + b'{"ok":true}'


def feed(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


@pytest.mark.asyncio
async def test_read_auth_and_lp() -> None:
    assert await read_auth(feed(encode_auth(b"abc") + b"rest")) == b"abc"
    assert await read_auth(feed(encode_auth(b""))) == b""
    with pytest.raises(ProtocolError, match="bad magic"):
        await read_auth(feed(b"XXXX" + bytes(8)))
    with pytest.raises(ProtocolError, match="version 2"):
        await read_auth(feed(b"SLRW" + (2).to_bytes(4, "little") + bytes(4)))
    with pytest.raises(ProtocolError, match="exceeds 8"):
        await read_auth(feed(encode_auth(b"x" * 9)), limit=8)
    with pytest.raises(ProtocolError, match="closed after 5 of 12 bytes"):
        await read_auth(feed(b"SLRW\x01"))
    with pytest.raises(ProtocolError, match="closed after 1 of 3 bytes"):
        await read_auth(feed(encode_auth(b"abc")[:13]))
    assert await read_lp(feed(encode_lp_json([1, 2])), 100) == b"[1,2]"
    with pytest.raises(ProtocolError, match="exceed the limit of 4"):
        await read_lp(feed(encode_lp_json([1, 2])), 4)
    with pytest.raises(ProtocolError, match="closed after 2 of 5 bytes"):
        await read_lp(feed(encode_lp_json([1, 2])[:6]), 100)


def test_read_lp_sock() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(encode_lp_json({"ok": False, "error": "cannot x"}))
        b.settimeout(7.0)
        assert read_lp_sock(b, 1000, time.monotonic() + 5) == b'{"ok":false,"error":"cannot x"}'
        assert b.gettimeout() == 7.0
        # A reply that arrives in pieces is reassembled.
        data = encode_lp_json({"k": "v" * 1000})

        def send_in_pieces() -> None:
            for i in range(0, len(data), 7):
                a.sendall(data[i : i + 7])

        sender = threading.Thread(target=send_in_pieces)
        sender.start()
        assert len(read_lp_sock(b, 2000, time.monotonic() + 5)) == len(data) - 4
        sender.join()
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="deadline passed after 0 of 4 bytes"):
            read_lp_sock(b, 1000, time.monotonic() + 0.2)
        assert time.monotonic() - start < 2
        a.sendall((5000).to_bytes(4, "little"))
        with pytest.raises(ProtocolError, match="exceed the limit"):
            read_lp_sock(b, 1000, time.monotonic() + 5)
        a.sendall(b"\x05\x00\x00\x00ab")
        a.close()
        with pytest.raises(ProtocolError, match="closed after 2 of 5 bytes"):
            read_lp_sock(b, 1000, time.monotonic() + 5)


def test_decode_reply() -> None:
    ok = b'{"ok":true,"command":"127.0.0.1:5","health":"[::1]:6","pid":9}'
    assert decode_reply(ok) == HandshakeReply(True, "127.0.0.1:5", "[::1]:6", 9)
    assert decode_reply(b'{"ok":false,"error":"cannot y"}').error == "cannot y"
    assert msgspec.json.encode(HandshakeReply(ok=False, error="e")) == b'{"ok":false,"error":"e"}'
    for bad in (
        b'{"ok":true,"command":"x","health":"127.0.0.1:6","pid":9}',
        b'{"ok":true,"command":"127.0.0.1:0","health":"127.0.0.1:6","pid":9}',
        b'{"ok":true,"command":"127.0.0.1:5","health":"127.0.0.1:6"}',
        b'{"ok":false}',
        b'{"ok":1}',
        b"nope",
    ):
        with pytest.raises(ProtocolError, match="cannot read reply"):
            decode_reply(bad)
    assert format_host_port("::1", 5) == "[::1]:5"
    assert format_host_port("127.0.0.1", 5) == "127.0.0.1:5"
    assert format_host_port("localhost", 5) == "localhost:5"
    assert Manifest.__struct_config__.forbid_unknown_fields
