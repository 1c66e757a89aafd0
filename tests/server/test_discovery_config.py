"""``[workers.discovery]``: the keys load with their defaults, share the checks of a
``[[workers.remote]]`` table, and every bad value is refused naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from simpler_daemon.errors import ConfigError
from simpler_daemon.server import config as cfg
from simpler_daemon.server.dnsquery import parse_dns_target, parse_nameserver
from simpler_daemon.server.topology import remote_spec_of

L4 = "[daemon]\nlevel = 4\n"
D = "[workers.discovery]\n"


def load(tmp_path: Path, text: str) -> cfg.DaemonConfig:
    path = tmp_path / "daemon.toml"
    path.write_text(text)
    return cfg.load(path, env={})


def test_discovery_is_off_by_default() -> None:
    config = cfg.load(None, env={})
    assert config.workers.discovery == cfg.DiscoveryConfig()
    assert config.workers.discovery.dns == ""
    assert config.workers.discovery.refresh_s == 10.0


def test_discovery_table_loads(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        L4
        + D
        + "dns = 'workers.simpler.svc.cluster.local:19073'\nrefresh_s = 2.5\n"
        + "nameserver = '10.96.0.10'\nnum_sub_workers = 2\ntoken_file = '/etc/t'\n"
        + "callables = [{target = 'pkg.l3:step', kind = 'orchestration'}]\n",
    )
    d = config.workers.discovery
    assert d.dns == "workers.simpler.svc.cluster.local:19073"
    assert (d.refresh_s, d.nameserver, d.num_sub_workers, d.token_file) == (
        2.5,
        "10.96.0.10",
        2,
        "/etc/t",
    )
    assert d.callables == [cfg.RemoteCallableConfig(target="pkg.l3:step", kind="orchestration")]
    # The same spec builder as a [[workers.remote]] table, with the address found.
    spec = remote_spec_of(d, "workers.discovery", endpoint="10.0.0.7:19073")
    assert (spec.endpoint, spec.num_sub_workers, spec.token_file) == ("10.0.0.7:19073", 2, "/etc/t")


def test_dump_round_trips_discovery(tmp_path: Path) -> None:
    config = load(tmp_path, L4 + D + "dns = 'w.local:19073'\nrefresh_s = 0.5\n")
    again = load(tmp_path, cfg.dump(config))
    assert again.workers.discovery == config.workers.discovery


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        (D + "dns = 'w.local:1'\n", "workers.discovery.dns", "needs daemon.level = 4"),
        (L4 + D + "dns = 'w.local'\n", "workers.discovery.dns", "has no port"),
        (L4 + D + "dns = 'w.local:0'\n", "workers.discovery.dns", "out of range 1-65535"),
        (L4 + D + "dns = 'w.local:70000'\n", "workers.discovery.dns", "out of range 1-65535"),
        (L4 + D + "dns = 'w.local:http'\n", "workers.discovery.dns", "is not a number"),
        (L4 + D + "dns = ':19073'\n", "workers.discovery.dns", "has no name"),
        (L4 + D + "dns = 'bad name:19073'\n", "workers.discovery.dns", "is not a DNS name"),
        (L4 + D + "dns = '[::1]:19073'\n", "workers.discovery.dns", "IPv6 literals"),
        (L4 + D + "dns = 'w.local:1'\nrefresh_s = 0\n", "workers.discovery.refresh_s", "> 0"),
        (L4 + D + "dns = 'w.local:1'\nrefresh_s = -1.0\n", "workers.discovery.refresh_s", "> 0"),
        (L4 + D + "dns = 'w.local:1'\nrefresh_s = nan\n", "workers.discovery.refresh_s", "> 0"),
        (
            L4 + D + "dns = 'w.local:1'\nnameserver = 'dns.local'\n",
            "workers.discovery.nameserver",
            "not a name",
        ),
        (
            L4 + D + "dns = 'w.local:1'\nnameserver = '10.0.0.1:99999'\n",
            "workers.discovery.nameserver",
            "1..65535",
        ),
        (L4 + D + "nameserver = '10.0.0.1'\n", "workers.discovery.nameserver", "dns is not"),
        (
            L4 + D + "dns = 'w.local:1'\nnum_sub_workers = -1\n",
            "workers.discovery.num_sub_workers",
            ">= 0",
        ),
        (
            L4 + D + "dns = 'w.local:1'\ntls_cert_file = '/c.pem'\n",
            "workers.discovery.tls_key_file",
            "go together",
        ),
        (
            L4 + D + "dns = 'w.local:1'\ntls_server_name = 'w'\n",
            "workers.discovery.tls_server_name",
            "requires workers.discovery.tls_ca_file",
        ),
        (
            L4 + D + "dns = 'w.local:1'\ncallables = [{target = 'nocolon', kind = 'sub'}]\n",
            "workers.discovery.callables[0].target",
            "",
        ),
        (L4 + D + "dns = 'w.local:1'\nendpoint = '1.2.3.4:5'\n", "workers.discovery", "endpoint"),
    ],
)
def test_discovery_errors_name_the_key(tmp_path: Path, text: str, key: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    message = str(info.value)
    assert expected in message, message
    assert key in message, message


def test_parse_helpers() -> None:
    assert parse_dns_target("workers.ns.svc.:19073") == ("workers.ns.svc.", 19073)
    assert parse_nameserver("127.0.0.1") == ("127.0.0.1", 53)
    assert parse_nameserver("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert parse_nameserver("[::1]:5353") == ("::1", 5353)
    assert parse_nameserver("::1") == ("::1", 53)


def test_check_config_reads_the_discovery_credentials(tmp_path: Path) -> None:
    """check-config (and serve, before it forks) refuses a token file every discovered
    session would fail to read, naming the key; a readable one passes."""
    from simpler_daemon.server.preflight import check_credentials

    missing = tmp_path / "no-token"
    config = load(tmp_path, L4 + D + f"dns = 'w.local:1'\ntoken_file = '{missing}'\n")
    (err,) = check_credentials(config)
    assert err.key == "workers.discovery.token_file"
    assert f"cannot read '{missing}'" in str(err)
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    config = load(tmp_path, L4 + D + f"dns = 'w.local:1'\ntoken_file = '{empty}'\n")
    (err,) = check_credentials(config)
    assert "is empty" in str(err)
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-16-bytes\n")
    config = load(tmp_path, L4 + D + f"dns = 'w.local:1'\ntoken_file = '{token}'\n")
    assert check_credentials(config) == []
