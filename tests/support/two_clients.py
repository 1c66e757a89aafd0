"""A daemon with two client identities, for tests of what one client does to another.

The test process talks to the daemon twice: over the Unix socket (``uid:<euid>``, an
admin when the tests run as root or as the daemon's user) and over TCP with TLS and
the bearer token (``tcp:127.0.0.1``, never an admin). No second system user is
needed, so these tests also run unprivileged.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from simpler_daemon.client import AsyncClient, Client
from simpler_daemon.testing import self_signed_cert
from tests.support.daemon_harness import DaemonProcess

TOKEN = "two-clients-token-0123456789"


class TcpAccess:
    """The TCP listener's certificate and token: ``overrides()`` for the daemon's
    config, ``client(daemon)`` for the second identity."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        pair = self_signed_cert(directory)
        if pair is None:
            pytest.skip("the openssl CLI is not available (TLS for the second client)")
        self.cert, self.key = pair
        self.token_file = directory / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.token_file.chmod(0o600)

    def overrides(
        self, extra: Mapping[str, Mapping[str, Any]] | None = None
    ) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {
            "grpc": {
                "tcp_listen": "127.0.0.1:0",
                "tls_cert": str(self.cert),
                "tls_key": str(self.key),
                "token_file": str(self.token_file),
            }
        }
        for section, values in (extra or {}).items():
            out.setdefault(section, {}).update(values)
        return out

    @staticmethod
    def address(daemon: DaemonProcess) -> str:
        line = next(x for x in daemon.stdout().splitlines() if "listening on tcp" in x)
        return line.split("listening on tcp ", 1)[1].split()[0]

    def client(self, daemon: DaemonProcess, **kwargs: Any) -> Client:
        return Client(
            self.address(daemon),
            token=TOKEN,
            root_certificates=str(self.cert),
            server_name="localhost",
            **kwargs,
        )

    def async_client(self, daemon: DaemonProcess, **kwargs: Any) -> AsyncClient:
        return AsyncClient(
            self.address(daemon),
            token=TOKEN,
            root_certificates=str(self.cert),
            server_name="localhost",
            **kwargs,
        )
