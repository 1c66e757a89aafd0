"""What both clients of the daemon share: the target (a Unix socket, checked, or
``host:port`` over TLS with a bearer token), the transport it is reached over (the
local fast path or gRPC) and the gRPC-to-``DaemonError`` mapping.

:mod:`simpler_daemon.client` builds ``Client`` and ``AsyncClient`` on ``_Base``.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator
from typing import Any, Final

# First: grpc core reads its process-wide settings at its import (system/grpcsetup.py).
import simpler_daemon.system.grpcsetup  # noqa: F401

# isort: split

import grpc
import numpy as np

from simpler_daemon.client.discovery import ENV_SOCKET as ENV_TARGET
from simpler_daemon.client.discovery import default_target as discover
from simpler_daemon.client.errors import DaemonError, daemon_error
from simpler_daemon.client.fastpath import DEFAULT_SPIN_US, MAX_SPIN_US, pick_fast_socket
from simpler_daemon.client.heapview import map_buffer_view
from simpler_daemon.client.requests import call_deadline, check_wait
from simpler_daemon.client.retry import DEFAULT_RETRY, RetryPolicy
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2_grpc as pb_grpc
from simpler_daemon.protocol.metadata import CLIENT_ID_METADATA
from simpler_daemon.system.localtrust import check_socket_path

__all__ = [
    "CLIENT_ID_METADATA",
    "DEFAULT_TIMEOUT",
    "ENV_TARGET",
    "ENV_TOKEN",
    "default_target",
    "mapped_errors",
]

#: Environment variables read when no target / token is given.
ENV_TOKEN: Final = "SIMPLER_DAEMON_TOKEN"
DEFAULT_TIMEOUT: Final = 30.0


def default_target() -> str:
    """``$SIMPLER_DAEMON_SOCKET``, else the first socket found in the search order of
    :func:`simpler_daemon.client.discovery.default_target` (the user's runtime directory, then
    the systemd unit's ``/run/simpler-daemon/daemon.sock``, ...)."""
    return discover()


@contextlib.contextmanager
def mapped_errors() -> Iterator[None]:
    """Turn a ``grpc.RpcError`` raised inside into its :class:`DaemonError` subclass."""
    try:
        yield
    except grpc.RpcError as exc:
        raise daemon_error(exc) from exc


#: ``host:port`` or ``[v6 address]:port``: a TCP target names its port.
_HOST_PORT: Final = re.compile(r"(?:\[[0-9A-Fa-f:.%\w]+\]|[^:/\[\]\s]+):(\d{1,5})")


def _address(target: str) -> tuple[str, bool]:
    """``(grpc address, is_tcp)`` for a socket path, ``unix:`` URI or ``host:port``;
    ``ValueError`` for anything else (a host without a port would silently be :443)."""
    if target.startswith(("unix:", "unix-abstract:")):
        return target, False
    if "/" in target or target.endswith(".sock"):
        return "unix:" + os.path.abspath(target), False
    match = _HOST_PORT.fullmatch(target)
    if match is None or not 0 < int(match.group(1)) < 65536:
        raise ValueError(
            f"target {target!r} is neither a socket path nor HOST:PORT: give the port of a "
            "TCP listener (localhost:50051, [::1]:50051), or a unix socket as a path "
            "(./daemon.sock) or unix:PATH"
        )
    return target, True


def _unix_path(address: str) -> str:
    """The file path of a ``unix:path`` / ``unix:///path`` gRPC address."""
    path = address.removeprefix("unix:")
    return path[2:] if path.startswith("///") else path


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as fh:
        return fh.read()


class _Base:
    def __init__(
        self,
        target: str | None = None,
        *,
        token: str | None = None,
        token_file: str | None = None,
        root_certificates: str | bytes | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
        server_name: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        client_id: str | None = None,
        transport: str = "auto",
        retry: RetryPolicy | None = DEFAULT_RETRY,
        spin_us: int | None = None,
    ) -> None:
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(
                f"cannot create a client: retry must be a RetryPolicy or None: {retry!r}"
            )
        if spin_us is not None and (type(spin_us) is not int or not 0 <= spin_us <= MAX_SPIN_US):
            raise ValueError(
                f"cannot create a client: spin_us must be an int from 0 to {MAX_SPIN_US} "
                f"(µs), got {spin_us!r}"
            )
        #: How long a blocking call over the fast path looks for its reply before it
        #: sleeps (µs; 0: never; None given: DEFAULT_SPIN_US). An AsyncClient takes none:
        #: its event loop waits for replies.
        self.spin_us = DEFAULT_SPIN_US if spin_us is None else spin_us
        self._spin_given = spin_us is not None
        #: How calls safe to repeat are retried (client/retry.py); None: never.
        self.retry = retry
        self.target = target or default_target()
        self.address, self.tcp = _address(self.target)
        #: The uid trusted to own the daemon's heap besides ours and root's (the owner of
        #: a trusted socket directory); None over TCP.
        self._daemon_uid: int | None = None
        if self.address.startswith("unix:"):
            # Refuse a socket someone else could have planted (a directory in /tmp made
            # by another user would receive our connection): UntrustedPathError.
            self._daemon_uid = check_socket_path(_unix_path(self.address))
        self.timeout = call_deadline(check_wait(timeout, "timeout"), 0.0)
        self.client_id = client_id or uuid.uuid4().hex[:16]
        self.metadata: tuple[tuple[str, str], ...] = ((CLIENT_ID_METADATA, self.client_id),)
        self.options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1),
            ("grpc.enable_http_proxy", 0),
            # A daemon restarting is reconnected to within 2 s, not gRPC's 120 s: the
            # retries of client/retry.py would otherwise fail fast against the backoff.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        self.credentials: Any = None
        if self.tcp:
            if token is None and token_file:
                token = (_read(token_file) or b"").decode().strip()
            token = token if token is not None else os.environ.get(ENV_TOKEN)
            roots = (
                _read(root_certificates)
                if isinstance(root_certificates, str)
                else root_certificates
            )
            creds = grpc.ssl_channel_credentials(
                root_certificates=roots,
                private_key=_read(client_key),
                certificate_chain=_read(client_cert),
            )
            if token:
                # Plain metadata rather than call credentials: grpc runs a credentials
                # plugin on its own C threads, which would leave threads in the caller
                # (and a process with threads must not fork a Worker).
                self.metadata += (("authorization", f"Bearer {token}"),)
            self.credentials = creds
            if server_name:
                self.options.append(("grpc.ssl_target_name_override", server_name))
        self._chunk: int | None = None
        #: The daemon's fast socket in use (None: gRPC), see ``transport``.
        unix = _unix_path(self.address) if self.address.startswith("unix:") else None
        self._fast_path = pick_fast_socket(transport, unix, self.address)
        self._channel: Any = None
        self._stub: Any = None
        self._open()

    @property
    def transport(self) -> str:
        """``"fast"`` (the daemon's local fast path) or ``"grpc"``: what calls go over."""
        return "grpc" if self._fast_path is None else "fast"

    @property
    def channel(self) -> Any:
        """The gRPC channel (opened on first use when calls go over the fast path)."""
        if self._channel is None:
            self._channel = self._new_channel()
        return self._channel

    @property
    def stub(self) -> Any:
        """The generated gRPC stub over :attr:`channel`."""
        if self._stub is None:
            self._stub = pb_grpc.DaemonStub(self.channel)
        return self._stub

    def _new_channel(self) -> Any:
        raise NotImplementedError  # each client opens its own kind of channel

    def _lease_socket(self) -> str | None:
        """The fast socket a blocking gRPC client holds its session over (None: none).

        A sync gRPC stream left open keeps a grpc thread polling in this process (and a
        process with threads cannot fork a Worker); a call on the fast socket beside
        the Unix target holds it with none, for the same identity (client/session.py)."""
        if self._fast_path is not None or not self.address.startswith("unix:"):
            return self._fast_path
        try:
            return pick_fast_socket("fast", _unix_path(self.address), self.address)
        except (DaemonError, OSError):  # none beside it (or not trusted): a gRPC call
            return None

    def _view(self, info: Any) -> np.ndarray[Any, Any]:
        return map_buffer_view(info, self._daemon_uid)

    def _find_buffer(self, listing: Any, buffer_id: int) -> Any:
        for info in listing.buffers:
            if info.buffer_id == buffer_id:
                return info
        raise KeyError(f"cannot map buffer {buffer_id}: no such buffer")

    def _open(self) -> None:
        raise NotImplementedError  # each client opens its own kind of channel
