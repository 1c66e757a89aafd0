"""What an L4 program says about its remote L3 workers: specs, callables, tensor refs.

These are plain values with no I/O. ``RemoteWorkerSpec`` names a host's
``simpler-remote-worker`` and the inner L3 to build there; ``RemoteCallable``
names an L3 orchestration function by import path; ``RemoteTensorRef`` names a
buffer living in one remote worker's heap (its identity is the owner worker id,
the buffer id, the generation and the owner's session generation, so neither a
freed and reused buffer nor one of a later session ever aliases).
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simpler_daemon.args import MAX_NDIM, TensorRef, dtype_code
from simpler_daemon.callables import parse_import_path

DEFAULT_PORT = 19073


def parse_endpoint(endpoint: str, what: str = "endpoint") -> tuple[str, int]:
    """Split ``"IP:PORT"`` (or ``"[v6]:PORT"``, ``"localhost:PORT"``).

    Raises ``ValueError`` naming ``what`` for a hostname (no DNS on the startup
    path), a missing or out-of-range port, or anything that is not an address.
    """
    if not isinstance(endpoint, str) or not endpoint.strip():
        raise ValueError(f"cannot use {what}={endpoint!r}: expected 'IP:PORT'")
    text = endpoint.strip()
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep:
            raise ValueError(f"cannot use {what}={endpoint!r}: expected '[IPv6]:PORT'")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"cannot use {what}={endpoint!r}: expected 'IP:PORT' (port missing)")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(
            f"cannot use {what}={endpoint!r}: port {port_text!r} is not a number"
        ) from None
    if not 0 < port < 65536:
        raise ValueError(f"cannot use {what}={endpoint!r}: port {port} is out of range 1-65535")
    if host == "localhost":
        return "127.0.0.1", port
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"cannot use {what}={endpoint!r}: {host!r} is not a numeric address "
            "(hostnames are not resolved on the startup path; use an IP or 'localhost')"
        ) from None
    return host, port


@dataclass(frozen=True, slots=True)
class RemoteWorkerSpec:
    """One remote L3 worker: where its ``simpler-remote-worker`` listens and what to build.

    ``session_timeout_s`` bounds the health lane's silence and each control's
    round trip (not a task: a task is bounded by its own ``deadline_ms``).
    TLS is used when ``tls_ca_file`` is set (``tls_cert_file`` and
    ``tls_key_file`` add a client certificate for mutual TLS).
    """

    endpoint: str
    num_sub_workers: int = 1
    num_chips: int = 0
    token_file: str | None = None
    session_timeout_s: float = 30.0
    heap_bytes: int = 64 << 20
    chip_pipeline_depth: int = 2
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_server_name: str | None = None

    def __post_init__(self) -> None:
        parse_endpoint(self.endpoint, "RemoteWorkerSpec.endpoint")
        for name in ("num_sub_workers", "num_chips", "heap_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"cannot build RemoteWorkerSpec: {name}={v!r} must be an int >= 0")
        if self.heap_bytes == 0:
            raise ValueError("cannot build RemoteWorkerSpec: heap_bytes must be > 0")
        if self.chip_pipeline_depth not in (1, 2):
            raise ValueError(
                f"cannot build RemoteWorkerSpec: chip_pipeline_depth={self.chip_pipeline_depth!r} "
                "must be 1 or 2"
            )
        t = self.session_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(
                f"cannot build RemoteWorkerSpec: session_timeout_s={t!r} must be a positive number"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                "cannot build RemoteWorkerSpec: tls_cert_file and tls_key_file go together"
            )
        if self.tls_cert_file is not None and self.tls_ca_file is None:
            raise ValueError(
                "cannot build RemoteWorkerSpec: a client certificate needs tls_ca_file (TLS)"
            )

    def host_port(self) -> tuple[str, int]:
        return parse_endpoint(self.endpoint, "RemoteWorkerSpec.endpoint")

    @property
    def tls(self) -> bool:
        return self.tls_ca_file is not None


@dataclass(frozen=True, slots=True)
class ReconnectPolicy:
    """How a level-4 Worker reopens the session of a remote worker that failed.

    The first attempt starts at once; after the ``n``-th failed attempt in a row the
    next one waits ``min(max_s, initial_s * multiplier**(n-1))``, less a random part
    of up to ``jitter`` of it (so many parents do not retry in step), never more
    than ``max_s``. It goes on forever unless ``max_elapsed_s`` > 0: then the worker
    is given up once the next attempt would start later than that after the failure.
    ``Worker(level=4, reconnect=ReconnectPolicy(...))``; the daemon's
    ``[workers.reconnect]`` table.
    """

    initial_s: float = 0.5
    max_s: float = 10.0
    max_elapsed_s: float = 0.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        for name in ("initial_s", "max_s", "max_elapsed_s", "multiplier", "jitter"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"cannot build ReconnectPolicy: {name}={v!r} must be a number")
        if self.initial_s <= 0 or self.max_s < self.initial_s:
            raise ValueError(
                f"cannot build ReconnectPolicy: need 0 < initial_s ({self.initial_s!r}) <= "
                f"max_s ({self.max_s!r})"
            )
        if self.max_elapsed_s < 0:
            raise ValueError(
                f"cannot build ReconnectPolicy: max_elapsed_s={self.max_elapsed_s!r} must be "
                ">= 0 (0 = reconnect forever)"
            )
        if self.multiplier < 1:
            raise ValueError(
                f"cannot build ReconnectPolicy: multiplier={self.multiplier!r} must be >= 1"
            )
        if not 0 <= self.jitter < 1:
            raise ValueError(
                f"cannot build ReconnectPolicy: jitter={self.jitter!r} must be in [0, 1)"
            )

    def delay(self, failures: int, rand: float) -> float:
        """Seconds before the next attempt after ``failures`` (>= 1) failed ones in a row;
        ``rand`` in [0, 1) picks the jitter (``random.random()``)."""
        n = max(1, failures) - 1
        if (
            n
            and self.multiplier > 1
            and n * math.log(self.multiplier) >= math.log(self.max_s / self.initial_s)
        ):
            base = self.max_s  # (also keeps multiplier**n from overflowing)
        else:
            base = min(self.max_s, self.initial_s * self.multiplier**n)
        return base * (1.0 - self.jitter * min(max(rand, 0.0), 1.0))


@dataclass(frozen=True, slots=True)
class RemoteCallable:
    """An L3 orchestration function, by import path, that runs inside remote workers.

    Register it with ``Worker.register(RemoteCallable("pkg.mod:fn"), workers=[ids])``;
    it is called as ``fn(o, args, config)`` against the remote worker's inner L3.
    """

    target: str

    def __post_init__(self) -> None:
        if not isinstance(self.target, str):
            raise TypeError(
                f"cannot build RemoteCallable: target must be 'pkg.mod:fn', got {self.target!r}"
            )
        module, qualname = parse_import_path(self.target)
        object.__setattr__(self, "target", f"{module}:{qualname}")


@dataclass(frozen=True, slots=True)
class RemoteTensorRef(TensorRef):
    """A C-contiguous buffer in remote worker ``owner``'s heap (``Worker.alloc_remote``).

    Add it to ``TaskArgs`` like an array; the remote worker sees it as a NumPy view
    of its own heap. Only tasks on the owner (or on a worker that imported it)
    can use it.
    """

    owner: int
    buffer_id: int
    generation: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    byte_offset: int = 0
    #: The owner's session id when it was allocated (random, for diagnostics).
    session: int = 0
    #: The owner's session generation (1 for its first session, +1 per reconnect): a
    #: new session numbers its buffers afresh, so the generation is part of the
    #: buffer's identity and a ref from a session that ended never names a new buffer.
    session_generation: int = 0
    #: The strides of a C-contiguous array of ``shape`` (derived).
    strides: tuple[int, ...] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"cannot describe remote tensor: more than {MAX_NDIM} dimensions")
        dtype_code(self.dtype)
        item = np.dtype(self.dtype).itemsize
        strides: list[int] = []
        acc = item
        for dim in reversed(self.shape):
            strides.append(acc)
            acc *= max(dim, 1)
        object.__setattr__(self, "strides", tuple(reversed(strides)))

    @property
    def key(self) -> tuple[int, int, int, int]:
        """The buffer's identity: (owner worker id, buffer id, generation, session
        generation), the key of its descriptor (``TensorDesc.key``) too."""
        return (self.owner, self.buffer_id, self.generation, self.session_generation)

    def describe_lost(self) -> str:
        """What this ref names once its session ended (the words of every refusal)."""
        return (
            f"buffer {self.buffer_id} of session {self.session_generation} of remote worker "
            f"{self.owner}, which ended: its data is lost"
        )

    def __repr__(self) -> str:
        return (
            f"RemoteTensorRef(worker={self.owner}, session={self.session_generation}, "
            f"buffer={self.buffer_id}, generation={self.generation}, shape={self.shape}, "
            f"dtype={np.dtype(self.dtype).name})"
        )


def is_remote_tensor(obj: Any) -> bool:
    return isinstance(obj, RemoteTensorRef)
