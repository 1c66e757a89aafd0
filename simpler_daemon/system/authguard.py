"""What guards a listener's secrets: their files, their length, and peers that guess them.

Shared by the daemon (its TCP bearer token, its TLS key, the metrics token) and the
remote worker (its token and TLS key)::

    read_token_file(path, key)   regular file, mode 0600 (no group/other bits), stripped,
                                 MIN_TOKEN_BYTES..MAX_TOKEN_BYTES     -> ConfigError naming key
    check_private_file(path, key)  the same mode rule for a TLS key   -> ConfigError naming key

    FailedAuthLimiter            per peer host: MAX failures within WINDOW s -> refused for
                                 BLOCK s (a wrong token from a host that already failed too
                                 often is not even compared)

A token is the only thing between the network and code execution, so a file others
(or the group) may read is refused rather than warned about: the fix is ``chmod 600``.
"""

from __future__ import annotations

import os
import stat
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from typing import Final

from simpler_daemon.errors import ConfigError

__all__ = [
    "FAILED_AUTH_BLOCK_S",
    "FAILED_AUTH_MAX",
    "FAILED_AUTH_WINDOW_S",
    "MAX_TOKEN_BYTES",
    "MIN_TOKEN_BYTES",
    "FailedAuthLimiter",
    "check_private_file",
    "peer_host",
    "read_token_file",
]

#: Shortest bearer token a listener accepts (after stripping surrounding whitespace).
MIN_TOKEN_BYTES: Final = 16
#: Longest one (the remote worker's handshake carries at most this much).
MAX_TOKEN_BYTES: Final = 4096
#: Failed authentications from one host within FAILED_AUTH_WINDOW_S that block it...
FAILED_AUTH_MAX: Final = 10
FAILED_AUTH_WINDOW_S: Final = 60.0
#: ... for this long.
FAILED_AUTH_BLOCK_S: Final = 60.0
#: Hosts remembered at most; beyond it the oldest records are dropped (memory stays bounded).
_MAX_HOSTS: Final = 4096
_LOOSE_BITS: Final = stat.S_IRWXG | stat.S_IRWXO


def _check_mode(path: str, key: str, what: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{key}: cannot use {path} as the {what}: not a regular file", key=key)
    if st.st_mode & _LOOSE_BITS:
        raise ConfigError(
            f"{key}: cannot use {path} as the {what}: its mode is "
            f"{stat.S_IMODE(st.st_mode):04o}, so its group or others may read it; "
            f"run 'chmod 600 {path}'",
            key=key,
        )


def check_private_file(path: str, key: str, what: str = "TLS key") -> None:
    """``ConfigError`` naming ``key`` unless ``path`` is a regular file only its owner
    may read or write (no group or other permission bits)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror or exc}", key=key) from exc
    _check_mode(path, key, what, st)


def read_token_file(path: str, key: str, what: str = "bearer token") -> bytes:
    """The token in ``path``, surrounding whitespace stripped.

    ``ConfigError`` naming ``key`` when the file cannot be read, is not a regular
    file, has group or other permission bits, or holds fewer than
    ``MIN_TOKEN_BYTES`` or more than ``MAX_TOKEN_BYTES`` bytes.
    """
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())  # the file read, not whatever the path names later
            _check_mode(path, key, what, st)
            data = fh.read(MAX_TOKEN_BYTES + 64 * 1024)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror or exc}", key=key) from exc
    token = data.strip()
    if not token:
        raise ConfigError(f"{key}: {path} is empty; the {what} must not be", key=key)
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(
            f"{key}: {path} holds a {what} of {len(token)} bytes, at least "
            f"{MIN_TOKEN_BYTES} are required (e.g. 'openssl rand -hex 32 > {path}')",
            key=key,
        )
    if len(token) > MAX_TOKEN_BYTES:
        raise ConfigError(
            f"{key}: {path} holds {len(token)} bytes, at most {MAX_TOKEN_BYTES} allowed", key=key
        )
    return token


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string or ``host:port`` without the port:
    ``ipv4:10.0.0.1:5000`` -> ``10.0.0.1``, ``ipv6:[::1]:5000`` -> ``::1``."""
    kind, sep, rest = peer.partition(":")
    if not sep or kind not in ("ipv4", "ipv6"):
        rest = peer
    rest = urllib.parse.unquote(rest)  # newer gRPC writes ipv6:%5B::1%5D:5000
    if rest.startswith("["):
        return rest[1:].partition("]")[0]
    host, sep, port = rest.rpartition(":")
    if sep and port.isdigit() and ":" not in host:
        return host
    return rest


class FailedAuthLimiter:
    """Counts failed authentications per host; a host with too many is refused a while.

    Memory is bounded: at most ``max_hosts`` hosts are remembered, each with at most
    ``max_failures`` timestamps.
    """

    def __init__(
        self,
        max_failures: int = FAILED_AUTH_MAX,
        window_s: float = FAILED_AUTH_WINDOW_S,
        block_s: float = FAILED_AUTH_BLOCK_S,
        *,
        max_hosts: int = _MAX_HOSTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_failures < 1 or window_s <= 0 or block_s <= 0 or max_hosts < 1:
            raise ValueError(
                f"cannot create FailedAuthLimiter: max_failures={max_failures}, "
                f"window_s={window_s}, block_s={block_s}, max_hosts={max_hosts}"
            )
        self.max_failures = max_failures
        self.window_s = window_s
        self.block_s = block_s
        self._max_hosts = max_hosts
        self._clock = clock
        self._failures: dict[str, deque[float]] = {}
        self._blocked: dict[str, float] = {}

    def blocked_for(self, host: str) -> float:
        """Seconds ``host`` stays refused; 0.0 when it is not."""
        until = self._blocked.get(host)
        if until is None:
            return 0.0
        left = until - self._clock()
        if left <= 0:
            del self._blocked[host]
            return 0.0
        return left

    def failed(self, host: str) -> int:
        """Record a failure of ``host``; returns its failures within the window (the host
        is blocked once that reaches ``max_failures``)."""
        now = self._clock()
        times = self._failures.pop(host, None)
        if times is None:
            times = deque(maxlen=self.max_failures)
        times.append(now)
        while times and now - times[0] > self.window_s:
            times.popleft()
        count = len(times)
        if count >= self.max_failures:
            self._blocked.pop(host, None)
            self._blocked[host] = now + self.block_s
            times.clear()
        else:
            self._failures[host] = times  # re-inserted: the dict stays oldest-first
        self._trim(now)
        return count

    def _trim(self, now: float) -> None:
        for table in (self._failures, self._blocked):
            while len(table) > self._max_hosts:
                del table[next(iter(table))]
        if len(self._blocked) > self._max_hosts // 2:
            for host in [h for h, until in self._blocked.items() if until <= now]:
                del self._blocked[host]
