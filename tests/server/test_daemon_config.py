"""Daemon config: defaults, layering (file <- env <- overrides), dump/load, errors name the key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from simpler_daemon.errors import ConfigError
from simpler_daemon.server import config as cfg
from simpler_daemon.server.config import DaemonConfig


def write(tmp_path: Path, text: str, name: str = "daemon.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_text(tmp_path: Path, text: str, **kwargs: Any) -> DaemonConfig:
    kwargs.setdefault("env", {})
    return cfg.load(write(tmp_path, text), **kwargs)


# --------------------------------------------------------------------------- defaults


def test_defaults_load_on_a_fresh_machine() -> None:
    config = cfg.load(None, env={})
    assert config == cfg.resolve(DaemonConfig(), env={})
    assert config.daemon.level == 3
    assert config.daemon.runtime_dir == cfg.default_runtime_dir({})  # /run/..., else /tmp/...
    assert config.grpc.unix_socket == os.path.join(config.daemon.runtime_dir, "daemon.sock")
    assert config.grpc.tcp_listen == ""
    assert config.grpc.socket_mode == 0o660
    assert config.workers.num_sub_workers >= 1
    assert config.workers.num_chips == 2
    assert config.workers.heap_bytes == 256 * cfg.MIB
    assert config.limits.max_message_bytes == 64 * cfg.MIB
    assert config.limits.max_buffer_bytes == cfg.GIB
    assert config.callables.allowed_modules == ["simpler_daemon.examples"]
    assert config.metrics.listen == ""


def test_runtime_dir_follows_xdg_runtime_dir() -> None:
    config = cfg.load(None, env={"XDG_RUNTIME_DIR": "/run/user/1000"})
    assert config.daemon.runtime_dir == "/run/user/1000/simpler-daemon"
    assert config.grpc.unix_socket == "/run/user/1000/simpler-daemon/daemon.sock"


def test_explicit_paths_and_counts_are_kept(tmp_path: Path) -> None:
    config = load_text(
        tmp_path,
        '[daemon]\nruntime_dir = "/srv/sd"\n[workers]\nnum_sub_workers = 3\n'
        '[grpc]\nunix_socket = "/srv/other.sock"\n',
        env={"XDG_RUNTIME_DIR": "/run/user/1000"},
    )
    assert config.daemon.runtime_dir == "/srv/sd"
    assert config.grpc.unix_socket == "/srv/other.sock"
    assert config.workers.num_sub_workers == 3


def test_embedded_default_toml_equals_struct_defaults() -> None:
    assert msgspec.toml.decode(cfg.DEFAULT_CONFIG_TOML, type=DaemonConfig) == DaemonConfig()


def test_default_config_validates() -> None:
    cfg.validate(DaemonConfig())


# --------------------------------------------------------------------------- dump / load

NON_DEFAULTS: dict[str, dict[str, Any]] = {
    "daemon": {
        "level": 4,
        "runtime_dir": "/srv/simpler",
        "state_dir": "/var/lib/simpler",
        "startup_timeout": 12.5,
        "shutdown_grace": 0.0,
        "log_format": "json",
        "log_level": "debug",
        "watchdog": False,
    },
    "workers": {
        "num_sub_workers": 7,
        "num_chips": 0,
        "chip_pipeline_depth": 1,
        "heap_bytes": 4096,
        "heap_shared": False,
        # No callables here: the section test keeps the default allowed_modules, the
        # whole-config test does not (tests/server/test_daemon_local_l3.py round-trips them).
        "local": [
            cfg.LocalWorkerConfig(num_sub_workers=2, num_chips=1, chip_pipeline_depth=1),
            cfg.LocalWorkerConfig(num_sub_workers=0, heap_bytes=4096),
        ],
        "remote": [
            cfg.RemoteWorkerConfig(
                endpoint="127.0.0.1:19073",
                num_sub_workers=2,
                num_chips=1,
                token_file="/etc/simpler/token",
                tls_ca_file="/etc/simpler/ca.pem",
                tls_server_name="worker-1",
                callables=[cfg.RemoteCallableConfig(target="pkg.l3:step", kind="orchestration")],
            )
        ],
        "discovery": cfg.DiscoveryConfig(
            dns="workers.simpler.svc.cluster.local:19073",
            refresh_s=2.5,
            nameserver="10.96.0.10:53",
            num_sub_workers=3,
            token_file="/etc/simpler/token",
            callables=[cfg.RemoteCallableConfig(target="pkg.l3:step", kind="orchestration")],
        ),
        "remote_credentials_dir": "/etc/simpler/remote",
    },
    "grpc": {
        "unix_socket": "/srv/simpler/d.sock",
        "socket_mode": 0o600,
        "socket_group": "wheel",
        "tcp_listen": "[::1]:50051",
        "tls_cert": "/etc/c.pem",
        "tls_key": "/etc/k.pem",
        "tls_client_ca": "/etc/ca.pem",
        "token_file": "/etc/token",
    },
    "limits": {
        "max_message_bytes": 1024,
        "max_tasks_per_run": 5,
        "max_tensors_per_task": 6,
        "max_scalars_per_task": 7,
        "max_value_bytes": 1 << 20,
        "max_result_bytes": 2 << 20,
        "max_buffer_bytes": 8,
        "max_concurrent_runs": 9,
        "max_streams_per_client": 10,
        "max_finished_runs_kept": 11,
        "max_finished_run_bytes": 4097,
        "max_run_result_bytes": 700,
        "max_finished_result_bytes": 701,
        "max_finished_run_age": 86400.0,
        "max_group_members": 12,
        "per_client_runs": 13,
        "per_client_queued_runs": 17,
        "per_client_heap_bytes": 14,
        "per_client_registrations": 15,
        "per_client_sessions": 18,
        "session_ttl": 4.5,
        "max_import_path_chars": 16,
        "max_task_seconds": 2.5,
    },
    "callables": {
        "allowed_modules": ["pkg", "other.mod"],
        "preload": ["pkg.sub:fn", "pkg:Cls.m"],
        "python_path": ["/tmp"],
    },
    "metrics": {"listen": "127.0.0.1:9464", "token_file": "/etc/simpler/metrics-token"},
    "dashboard": {"enabled": True},
    "fast": {
        "enabled": False,
        "unix_socket": "/srv/simpler/d.fast.sock",
        "max_connections": 64,
        "frame_timeout": 5.0,
    },
    "security": {
        "admin_uids": [1001, 1002],
        "admin_groups": ["simpler-admins", "1003"],
        "admin_token_file": "/etc/simpler/admin-token",
    },
    "scheduler": {"admission": "fifo", "spin_us": 150, "child_spin_us": 75, "sub_queue_depth": 1},
    "health": {"unhealthy_exit_s": 5.0, "probe_listen": "127.0.0.1:8081"},
    "reconnect": {"initial_s": 0.25, "max_s": 30.0, "max_elapsed_s": 600.0},
}


def test_non_default_table_covers_every_option() -> None:
    for section in msgspec.structs.fields(DaemonConfig):
        names = {f.name for f in msgspec.structs.fields(section.type)}
        assert set(NON_DEFAULTS[section.name]) == names, section.name
        for name, value in NON_DEFAULTS[section.name].items():
            assert getattr(getattr(DaemonConfig(), section.name), name) != value, name


@pytest.mark.parametrize("section", list(NON_DEFAULTS))
def test_each_section_round_trips_through_dump_and_load(tmp_path: Path, section: str) -> None:
    base = cfg.load(None, env={})
    if section == "workers":  # [[workers.local/remote]] tables need a level-4 daemon
        base = msgspec.structs.replace(base, daemon=msgspec.structs.replace(base.daemon, level=4))
    if section == "dashboard":  # served on the metrics listener
        base = msgspec.structs.replace(base, metrics=cfg.MetricsConfig(listen="127.0.0.1:9464"))
    changed = msgspec.structs.replace(getattr(base, section), **NON_DEFAULTS[section])
    config = msgspec.structs.replace(base, **{section: changed})
    if config.daemon.level == 4 and section != "workers":  # no chips of its own at level 4
        workers = msgspec.structs.replace(config.workers, num_chips=0)
        config = msgspec.structs.replace(config, workers=workers)
    text = cfg.dump(config)
    assert f"[{section}]" in text
    assert load_text(tmp_path, text) == config


def test_whole_config_round_trips(tmp_path: Path) -> None:
    config = msgspec.convert(NON_DEFAULTS, type=DaemonConfig)
    text = cfg.dump(config)
    assert "socket_mode = 0o600" in text
    assert load_text(tmp_path, text) == config
    assert msgspec.toml.decode(text, type=DaemonConfig) == config


def test_dump_escapes_strings(tmp_path: Path) -> None:
    odd = 'a "quoted" \\ back\nslash\ttab \x01\x7f é 😀'
    config = msgspec.structs.replace(
        cfg.load(None, env={}),
        grpc=msgspec.structs.replace(cfg.GrpcConfig(), socket_group=odd, unix_socket="/x/d.sock"),
    )
    loaded = load_text(tmp_path, cfg.dump(config))
    assert loaded.grpc.socket_group == odd


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ("[grpc]\ntcp_lissten = 'x'\n", "grpc.tcp_lissten", "unknown key grpc.tcp_lissten"),
        ("[grpx]\nfoo = 1\n", "grpx", "unknown key grpx"),
        (
            "[limits]\nmax_tasks_per_run = 'many'\n",
            "limits.max_tasks_per_run",
            "limits.max_tasks_per_run: Expected int, got str",
        ),
        ("[daemon]\nwatchdog = 1\n", "daemon.watchdog", "daemon.watchdog: Expected bool, got int"),
        ("[daemon]\nlevel = 5\n", "daemon.level", "choose one of 3, 4"),
        ("[daemon]\nlog_format = 'xml'\n", "daemon.log_format", "choose one of 'text', 'json'"),
        ("daemon = 3\n", "daemon", "daemon: Expected table, got int"),
        ("[callables]\npreload = [1]\n", "callables.preload[0]", "Expected str, got int"),
        ("[grpc]\nsocket_mode = 0o1000\n", "grpc.socket_mode", "0o1000 is outside 0o000..0o777"),
        ("[grpc]\nsocket_mode = -1\n", "grpc.socket_mode", "outside 0o000..0o777"),
        (
            "[grpc]\ntcp_listen = '0.0.0.0:50051'\n",
            "grpc.tcp_listen",
            "grpc.tcp_listen requires grpc.tls_cert and grpc.tls_key: "
            "a TCP listener is refused without TLS",
        ),
        (
            "[grpc]\ntcp_listen = '0.0.0.0:50051'\ntls_cert = '/c'\n",
            "grpc.tcp_listen",
            "requires grpc.tls_cert and grpc.tls_key",
        ),
        (
            "[grpc]\ntcp_listen = '0.0.0.0:50051'\ntls_cert = '/c'\ntls_key = '/k'\n",
            "grpc.tcp_listen",
            "grpc.tcp_listen requires grpc.token_file",
        ),
        ("[grpc]\ntls_client_ca = '/ca'\n", "grpc.tls_client_ca", "requires grpc.tcp_listen"),
        ("[grpc]\ntcp_listen = 'localhost'\n", "grpc.tcp_listen", "is not host:port"),
        ("[grpc]\ntcp_listen = 'h:70000'\n", "grpc.tcp_listen", "0..65535"),
        ("[grpc]\nunix_socket = 'rel.sock'\n", "grpc.unix_socket", "must be an absolute path"),
        ("[grpc]\nunix_socket = '/" + "x" * 120 + "'\n", "grpc.unix_socket", "at most 107"),
        ("[metrics]\nlisten = '::1:9090'\n", "metrics.listen", "must be in brackets"),
        ("[metrics]\nlisten = 'host:http'\n", "metrics.listen", "0..65535"),
        ("[callables]\npreload = ['nocolon']\n", "callables.preload[0]", "module:qualname"),
        (
            "[callables]\npreload = ['simpler_daemon.examples:f', 'a.<locals>:f']\n",
            "callables.preload[1]",
            "must be an absolute dotted name",
        ),
        (
            "[callables]\npreload = ['os:system']\n",
            "callables.preload[0]",
            "module 'os' is not under callables.allowed_modules (simpler_daemon.examples)",
        ),
        (
            "[callables]\nallowed_modules = ['pkg']\npreload = ['pkgx:f']\n",
            "callables.preload[0]",
            "not under callables.allowed_modules (pkg)",
        ),
        (
            "[callables]\nallowed_modules = ['bad-name']\n",
            "callables.allowed_modules[0]",
            "is not a dotted module name",
        ),
        ("[limits]\nmax_concurrent_runs = 0\n", "limits.max_concurrent_runs", "must be > 0"),
        ("[limits]\nmax_message_bytes = 4294967296\n", "limits.max_message_bytes", "at most"),
        (
            "[limits]\nmax_message_bytes = 1048576\nmax_run_result_bytes = 1048576\n",
            "limits.max_run_result_bytes",
            "must be at most 983040 (limits.max_message_bytes minus 65536 bytes of headroom",
        ),
        ("[workers]\nnum_chips = -1\n", "workers.num_chips", "must be >= 0"),
        ("[workers]\nheap_bytes = 0\n", "workers.heap_bytes", "must be > 0"),
        ("[daemon]\nstartup_timeout = 0.0\n", "daemon.startup_timeout", "must be > 0"),
        ("[daemon]\nshutdown_grace = nan\n", "daemon.shutdown_grace", "must be >= 0"),
        ("[health]\nunhealthy_exit_s = -1.0\n", "health.unhealthy_exit_s", "must be >= 0"),
        ("[health]\nunhealthy_exit_s = inf\n", "health.unhealthy_exit_s", "(0 = never)"),
        ("[daemon]\nruntime_dir = 'run'\n", "daemon.runtime_dir", "must be an absolute path"),
        ("[dashboard]\nenabled = true\n", "dashboard.enabled", "set metrics.listen"),
    ],
)
def test_errors_name_the_file_and_key(tmp_path: Path, text: str, key: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        cfg.load(path, env={})
    message = str(info.value)
    assert message.startswith(f"cannot load config {path}: "), message
    assert expected in message
    assert info.value.key == key
    assert isinstance(info.value, ValueError)


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[daemon]\nlevel = 3\nthis is not toml\n")
    with pytest.raises(ConfigError, match=r"line 3") as info:
        cfg.load(path, env={})
    assert str(info.value).startswith(f"cannot parse config {path}: ")


def test_unreadable_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        cfg.load(missing, env={})
    assert str(info.value) == f"cannot read config {missing}: No such file or directory"
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_bytes(b"[daemon]\nlog_level = '\xff'\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        cfg.load(path, env={})


# --------------------------------------------------------------------------- env and overrides


def test_env_overrides_file(tmp_path: Path) -> None:
    config = load_text(
        tmp_path,
        "[limits]\nmax_concurrent_runs = 32\n",
        env={
            "SIMPLER_DAEMON__LIMITS__MAX_CONCURRENT_RUNS": "64",
            "SIMPLER_DAEMON__DAEMON__LOG_FORMAT": "json",
            "SIMPLER_DAEMON__DAEMON__WATCHDOG": "false",
            "SIMPLER_DAEMON__DAEMON__STARTUP_TIMEOUT": "5",
            "SIMPLER_DAEMON__GRPC__UNIX_SOCKET": "/run/x/d.sock",
            "SIMPLER_DAEMON__GRPC__SOCKET_GROUP": "1000",
            "SIMPLER_DAEMON__GRPC__SOCKET_MODE": "0o600",
            "SIMPLER_DAEMON__CALLABLES__ALLOWED_MODULES": '["a", "b.c"]',
            "SIMPLER_DAEMON__METRICS__LISTEN": "127.0.0.1:9464",
            "UNRELATED": "x",
        },
    )
    assert config.limits.max_concurrent_runs == 64
    assert config.daemon.log_format == "json"
    assert config.daemon.watchdog is False
    assert config.daemon.startup_timeout == 5.0
    assert config.grpc.unix_socket == "/run/x/d.sock"
    assert config.grpc.socket_group == "1000"  # a str setting keeps the text as written
    assert config.grpc.socket_mode == 0o600
    assert config.callables.allowed_modules == ["a", "b.c"]
    assert config.metrics.listen == "127.0.0.1:9464"


def test_env_errors_name_the_variable(tmp_path: Path) -> None:
    path = write(tmp_path, "")
    name = "SIMPLER_DAEMON__LIMITS__MAX_TASKS_PER_RUN"
    with pytest.raises(ConfigError) as info:
        cfg.load(path, env={name: "lots"})
    assert str(info.value) == (
        f"cannot load config {path}: limits.max_tasks_per_run "
        f"(from environment variable {name}): Expected int, got str"
    )
    assert info.value.key == "limits.max_tasks_per_run"

    with pytest.raises(ConfigError, match=r"unknown key grpc.nope \(from environment"):
        cfg.load(path, env={"SIMPLER_DAEMON__GRPC__NOPE": "1"})
    with pytest.raises(ConfigError, match="SIMPLER_DAEMON__GRPC: expected"):
        cfg.load(path, env={"SIMPLER_DAEMON__GRPC": "1"})


def test_overrides_win_over_env_and_file(tmp_path: Path) -> None:
    config = load_text(
        tmp_path,
        "[limits]\nmax_concurrent_runs = 32\n",
        env={"SIMPLER_DAEMON__LIMITS__MAX_CONCURRENT_RUNS": "64"},
        overrides={
            "limits.max_concurrent_runs": 128,
            "grpc.unix_socket": "/tmp/o/d.sock",
            "workers.num_chips": "4",  # CLI strings are parsed like env values
            "daemon.log_level": "warning",
        },
    )
    assert config.limits.max_concurrent_runs == 128
    assert config.grpc.unix_socket == "/tmp/o/d.sock"
    assert config.workers.num_chips == 4
    assert config.daemon.log_level == "warning"


def test_override_errors() -> None:
    with pytest.raises(ConfigError, match=r"override 'grpc': expected section.key"):
        cfg.load(None, env={}, overrides={"grpc": "x"})
    with pytest.raises(ConfigError, match=r"daemon.level \(from override\): Invalid enum value 9"):
        cfg.load(None, env={}, overrides={"daemon.level": 9})
    with pytest.raises(ConfigError, match=r"unknown key limits.max_foo \(from override\)") as info:
        cfg.load(None, env={}, overrides={"limits.max_foo": 1})
    assert info.value.key == "limits.max_foo"
    with pytest.raises(ConfigError, match=r"requires grpc\.tls_cert"):
        cfg.load(None, env={}, overrides={"grpc.tcp_listen": "0.0.0.0:1"})


def test_tcp_with_tls_and_token_is_accepted() -> None:
    config = cfg.load(
        None,
        env={},
        overrides={
            "grpc.tcp_listen": "0.0.0.0:50051",
            "grpc.tls_cert": "/etc/c.pem",
            "grpc.tls_key": "/etc/k.pem",
            "grpc.tls_client_ca": "/etc/ca.pem",
            "grpc.token_file": "/etc/token",
        },
    )
    assert config.grpc.tcp_listen == "0.0.0.0:50051"


def test_preload_under_allowed_module_is_accepted() -> None:
    config = cfg.load(
        None, env={}, overrides={"callables.preload": ["simpler_daemon.examples.sub:fill"]}
    )
    assert config.callables.preload == ["simpler_daemon.examples.sub:fill"]


# --------------------------------------------------------------------------- helpers


def test_callables_allows() -> None:
    c = cfg.CallablesConfig(allowed_modules=["pkg", "a.b"])
    assert c.allows("pkg") and c.allows("pkg.sub.x") and c.allows("a.b.c")
    assert not c.allows("pkgx") and not c.allows("a") and not c.allows("os")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9090", ("127.0.0.1", 9090)),
        ("[::1]:0", ("::1", 0)),
        ("localhost:65535", ("localhost", 65535)),
    ],
)
def test_parse_host_port(text: str, expected: tuple[str, int]) -> None:
    assert cfg.parse_host_port(text) == expected


@pytest.mark.parametrize("text", ["", ":80", "host", "host:", "::1:80", "[::1:80", "h:-1", "h:1e3"])
def test_parse_host_port_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^metrics.listen: ") as info:
        cfg.parse_host_port(text, key="metrics.listen")
    assert info.value.key == "metrics.listen"


def test_validate_names_key_without_load() -> None:
    bad = DaemonConfig(grpc=cfg.GrpcConfig(socket_mode=0o7777))
    with pytest.raises(ConfigError, match=r"^grpc.socket_mode: ") as info:
        cfg.validate(bad)
    assert info.value.key == "grpc.socket_mode"


def test_config_is_frozen() -> None:
    config = DaemonConfig()
    with pytest.raises(AttributeError):
        config.daemon.level = 4  # type: ignore[misc]


# --------------------------------------------------------------------------- [[workers.remote]]

L4 = "[daemon]\nlevel = 4\n[workers]\nnum_sub_workers = 0\nnum_chips = 0\n"


def test_remote_tables_load_with_defaults(tmp_path: Path) -> None:
    config = load_text(
        tmp_path,
        L4
        + "[[workers.remote]]\nendpoint = '127.0.0.1:19073'\n"
        + "callables = [{target = 'pkg.l3:step', kind = 'orchestration'}]\n"
        + "[[workers.remote]]\nendpoint = 'localhost:19074'\nnum_sub_workers = 0\n"
        + "num_chips = 2\ntoken_file = '/etc/t'\ntls_ca_file = '/etc/ca.pem'\n"
        + "tls_cert_file = '/etc/c.pem'\ntls_key_file = '/etc/k.pem'\n"
        + "session_timeout_s = 2.5\n",
    )
    first, second = config.workers.remote
    assert first == cfg.RemoteWorkerConfig(
        endpoint="127.0.0.1:19073",
        callables=[cfg.RemoteCallableConfig(target="pkg.l3:step", kind="orchestration")],
    )
    assert (first.num_sub_workers, first.num_chips, first.heap_bytes) == (1, 0, 64 * cfg.MIB)
    assert first.session_timeout_s == 30.0 and first.token_file == ""
    assert (second.num_sub_workers, second.num_chips, second.session_timeout_s) == (0, 2, 2.5)
    # At level 4, 0 SUB workers means none (not one per CPU as at level 3).
    assert config.workers.num_sub_workers == 0
    assert load_text(tmp_path, cfg.dump(config)) == config


def test_remote_tables_from_the_environment(tmp_path: Path) -> None:
    config = load_text(
        tmp_path,
        L4,
        env={"SIMPLER_DAEMON__WORKERS__REMOTE": "[{endpoint = '127.0.0.1:9', num_chips = 1}]"},
    )
    assert config.workers.remote == [cfg.RemoteWorkerConfig(endpoint="127.0.0.1:9", num_chips=1)]


REMOTE = "[[workers.remote]]\nendpoint = '127.0.0.1:19073'\n"


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        (
            "[workers]\n" + REMOTE,
            "workers.remote",
            "[[workers.remote]] tables need daemon.level = 4 (it is 3)",
        ),
        (
            L4 + "[[workers.remote]]\nnum_chips = 1\n",
            "workers.remote[0].endpoint",
            "workers.remote[0].endpoint: required",
        ),
        (
            L4 + REMOTE + "[[workers.remote]]\nendpoint = 'worker-2.example:19073'\n",
            "workers.remote[1].endpoint",
            "'worker-2.example' is not a numeric address",
        ),
        (
            L4 + "[[workers.remote]]\nendpoint = '127.0.0.1'\n",
            "workers.remote[0].endpoint",
            "port missing",
        ),
        (
            L4 + "[[workers.remote]]\nendpoint = '127.0.0.1:70000'\n",
            "workers.remote[0].endpoint",
            "out of range",
        ),
        (
            "[daemon]\nlevel = 4\n[workers]\nnum_chips = 2\n",
            "workers.num_chips",
            "a level-4 daemon has no chips",
        ),
        (L4 + REMOTE + "num_chips = -1\n", "workers.remote[0].num_chips", "must be >= 0"),
        (L4 + REMOTE + "heap_bytes = 0\n", "workers.remote[0].heap_bytes", "must be > 0"),
        (
            L4 + REMOTE + "session_timeout_s = 0.0\n",
            "workers.remote[0].session_timeout_s",
            "must be > 0",
        ),
        (
            L4 + REMOTE + "session_timeout_s = inf\n",
            "workers.remote[0].session_timeout_s",
            "must be > 0",
        ),
        (
            L4 + REMOTE + "chip_pipeline_depth = 3\n",
            "workers.remote[0].chip_pipeline_depth",
            "choose one of 1, 2",
        ),
        (
            L4 + REMOTE + "token_file = 'token'\n",
            "workers.remote[0].token_file",
            "must be an absolute path",
        ),
        (
            L4 + REMOTE + "tls_ca_file = '/ca'\ntls_cert_file = '/c'\n",
            "workers.remote[0].tls_key_file",
            "tls_cert_file and tls_key_file go together",
        ),
        (
            L4 + REMOTE + "tls_cert_file = '/c'\ntls_key_file = '/k'\n",
            "workers.remote[0].tls_cert_file",
            "requires workers.remote[0].tls_ca_file",
        ),
        (
            L4 + REMOTE + "tls_server_name = 'w1'\n",
            "workers.remote[0].tls_server_name",
            "requires workers.remote[0].tls_ca_file",
        ),
        (
            L4 + REMOTE + "endpointt = '127.0.0.1:1'\n",
            "workers.remote[0].endpointt",
            "unknown key workers.remote[0].endpointt",
        ),
        (
            L4 + REMOTE + "callables = [{target = 'pkg:f', kind = 'remote'}]\n",
            "workers.remote[0].callables[0].kind",
            "choose one of 'sub', 'chip', 'orchestration'",
        ),
        (
            L4 + REMOTE + "callables = [{target = 'pkg:f'}]\n",
            "workers.remote[0].callables[0].kind",
            "workers.remote[0].callables[0].kind: required",
        ),
        (
            L4 + REMOTE + "callables = [{target = 'pkg:f', kind = 'sub'}, "
            "{target = 'nocolon', kind = 'sub'}]\n",
            "workers.remote[0].callables[1].target",
            "module:qualname",
        ),
        (
            L4 + "[reconnect]\ninitial_s = 0\n",
            "reconnect.initial_s",
            "must be > 0, got 0",
        ),
        (
            L4 + "[reconnect]\ninitial_s = 2.0\nmax_s = 1.0\n",
            "reconnect.max_s",
            "must be >= initial_s (2), got 1",
        ),
        (
            L4 + "[reconnect]\nmax_elapsed_s = -1.0\n",
            "reconnect.max_elapsed_s",
            "must be >= 0, got -1.0",
        ),
        (
            L4 + "[reconnect]\nmax_elapsd_s = 5.0\n",
            "reconnect.max_elapsd_s",
            "unknown key reconnect.max_elapsd_s",
        ),
        (
            L4 + "remote_credentials_dir = 'creds'\n",
            "workers.remote_credentials_dir",
            "must be an absolute path",
        ),
    ],
)
def test_remote_errors_name_the_table_and_key(
    tmp_path: Path, text: str, key: str, expected: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        cfg.load(path, env={})
    message = str(info.value)
    assert message.startswith(f"cannot load config {path}: "), message
    assert expected in message, message
    assert info.value.key == key
