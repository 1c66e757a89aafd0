"""``simpler-daemon check-config`` refuses what ``serve`` would refuse: a heap
the host cannot hold, a start-up callable that does not import, credential files that
cannot be read."""

from __future__ import annotations

from pathlib import Path

import pytest

from simpler_daemon.server import preflight
from simpler_daemon.server.config import load
from simpler_daemon.server.main import main
from simpler_daemon.system.exitcodes import EXIT_CONFIG, EXIT_OK


def check(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = tmp_path / "daemon.toml"
    path.write_text(f'[daemon]\nruntime_dir = "{tmp_path}/run"\n' + text)
    code = main(["check-config", str(path)])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_sound_config_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, text = check(
        tmp_path,
        '[workers]\nheap_bytes = 1048576\n[callables]\npreload = ["simpler_daemon.examples.tasks:fill"]\n',
        capsys,
    )
    assert code == EXIT_OK, text
    assert ": ok (level 3" in text


def test_a_heap_larger_than_the_host_allows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = check(tmp_path, "[workers]\nheap_bytes = 1125899906842624\n", capsys)  # 1 PiB
    assert code == EXIT_CONFIG, text
    assert "workers.heap_bytes: the heap needs 1125899906842624 bytes in /dev/shm" in text
    assert "MemAvailable" in text


def test_heap_limits_are_the_hosts() -> None:
    config = load(None, env={}, overrides={"workers.heap_bytes": 4096 * 1024})
    assert preflight.check_heap(config, shm_free=1 << 30, available=1 << 30) == []
    [shm] = preflight.check_heap(config, shm_free=4096, available=1 << 30)
    assert shm.key == "workers.heap_bytes" and "4096 bytes free" in str(shm)
    [mem] = preflight.check_heap(config, shm_free=1 << 30, available=4096)
    assert "4096 bytes of memory available" in str(mem)
    unshared = load(
        None, env={}, overrides={"workers.heap_bytes": 1 << 20, "workers.heap_shared": False}
    )
    assert preflight.check_heap(unshared, shm_free=0, available=1 << 30) == []


def test_a_preload_module_that_does_not_import(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = check(
        tmp_path,
        "[workers]\nheap_bytes = 1048576\n[callables]\n"
        'preload = ["simpler_daemon.examples.tasks:fill", "simpler_daemon.examples.no_such:fn",'
        ' "simpler_daemon.examples.tasks:no_such_function"]\n',
        capsys,
    )
    assert code == EXIT_CONFIG, text
    assert "callables.preload[1]: cannot import simpler_daemon.examples.no_such:fn: " in text
    assert "ModuleNotFoundError" in text
    assert (
        "callables.preload[2]: cannot import simpler_daemon.examples.tasks:no_such_function" in text
    )
    assert "preload[0]" not in text


def test_unreadable_tls_and_token_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing"
    code, text = check(
        tmp_path,
        f'[workers]\nheap_bytes = 1048576\n[grpc]\ntcp_listen = "127.0.0.1:0"\n'
        f'tls_cert = "{missing}/cert.pem"\ntls_key = "{missing}/key.pem"\n'
        f'token_file = "{missing}/token"\n',
        capsys,
    )
    assert code == EXIT_CONFIG, text
    assert f"grpc.token_file: cannot read {missing}/token" in text

    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    code, text = check(
        tmp_path,
        f'[workers]\nheap_bytes = 1048576\n[grpc]\ntcp_listen = "127.0.0.1:0"\n'
        f'tls_cert = "{missing}/cert.pem"\ntls_key = "{missing}/key.pem"\n'
        f'token_file = "{token}"\n',
        capsys,
    )
    assert code == EXIT_CONFIG, text
    assert f"grpc.tls_key: cannot read {missing}/key.pem" in text


def test_a_heap_quota_the_heap_cannot_meet_is_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Valid, but no client can ever reach such a quota: check-config (and serve, in
    its log) warn and go on."""
    code, text = check(
        tmp_path,
        "[workers]\nheap_bytes = 1048576\n[limits]\nper_client_heap_bytes = 2097152\n",
        capsys,
    )
    assert code == EXIT_OK, text
    assert (
        "warning: limits.per_client_heap_bytes (2097152 bytes) is larger than "
        "workers.heap_bytes (1048576 bytes)"
    ) in text
    code, text = check(
        tmp_path,
        "[workers]\nheap_bytes = 4194304\n[limits]\nper_client_heap_bytes = 4194304\n",
        capsys,
    )
    assert code == EXIT_OK and "warning" not in text, text
