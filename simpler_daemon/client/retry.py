"""Retrying the calls that are safe to repeat: capped exponential backoff, full jitter.

::

    Client._call(method, request)
        | safe to repeat? (a read, or a submit with an idempotency key)
        v
    RetryPolicy.call(attempt) --UNAVAILABLE, or RESOURCE_EXHAUSTED with a retry-after hint-->
        sleep(hint + U(0, min(cap, base * 2**n)))  (no hint: U(0, min(cap, base * 2**n)))
        --> attempt again, until ``total`` seconds have passed since the first one;
            then the last error is raised as it was

A RESOURCE_EXHAUSTED without a hint (a request larger than a limit, a full heap) is
final: retrying cannot help. The daemon's hint (``DaemonError.retry_after``) comes with
a limit reached for now: a client's run queue (``limits.per_client_queued_runs``) or
``limits.max_concurrent_runs``. Mutations without a key (FreeBuffer, CancelRun,
WriteBuffer, Drain...) are never repeated: the client cannot know whether the first
attempt took effect. Submits are made safe by an idempotency key, which the clients
generate per submit when the caller gives none (the daemon answers a repeated key
with the run it started, ``deduplicated``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import grpc

from simpler_daemon.client.errors import DaemonError

__all__ = [
    "DEFAULT_RETRY",
    "KEYED_METHODS",
    "SAFE_METHODS",
    "RetryPolicy",
    "new_key",
    "safe_to_repeat",
]

T = TypeVar("T")

#: RPCs that change nothing: repeating one is always safe.
SAFE_METHODS: Final = frozenset(
    {
        "GetInfo",
        "ListWorkers",
        "ListCallables",
        "ListBuffers",
        "ListRuns",
        "WaitRun",
        "ReadBuffer",
    }
)
#: RPCs that are safe to repeat when their request carries an ``idempotency_key``.
KEYED_METHODS: Final = frozenset({"SubmitRun", "RunOrchestration"})


def safe_to_repeat(method: str, request: Any) -> bool:
    """Whether a call of ``method`` with ``request`` may be sent again after a failure
    that leaves unknown whether the daemon did it."""
    if method in SAFE_METHODS:
        return True
    return method in KEYED_METHODS and bool(getattr(request, "idempotency_key", ""))


class _Keys:
    """Idempotency keys unique across processes: a random prefix per process (drawn
    again in a forked child) and a counter; no system call per key."""

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.prefix = "auto-" + uuid.uuid4().hex[:20] + "-"
        self.counter = itertools.count(1)

    def __call__(self) -> str:
        return self.prefix + str(next(self.counter))


#: An idempotency key for one submit (what the clients use when given none).
new_key: Final[Callable[[], str]] = _Keys()


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long a client retries a call that is safe to repeat.

    ``total``: seconds from the first attempt after which no retry starts (the last
    error is raised); ``base`` and ``cap``: the backoff before retry ``n`` (from 0) is
    uniform in ``[0, min(cap, base * 2**n)]`` (full jitter), added to the daemon's
    retry-after hint when it gave one. ``rand``, ``clock`` and ``sleep`` are there
    for tests (a seeded generator, a fake clock).
    """

    total: float = 30.0
    base: float = 0.05
    cap: float = 2.0
    rand: Callable[[], float] = field(default=random.random, repr=False, compare=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("total", "base", "cap"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and value < float("inf")):
                raise ValueError(f"cannot use RetryPolicy: {name} must be >= 0, got {value!r}")

    @staticmethod
    def retryable(exc: DaemonError) -> bool:
        """UNAVAILABLE (the daemon not up yet, restarting, a connection lost) and a
        RESOURCE_EXHAUSTED that carries a retry-after hint."""
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            # "cannot call: ..." is the fast transport naming this client's own state (it
            # is closed, or used after fork): final. The daemon down reads "cannot connect
            # to ..." / "cannot call the daemon on ...".
            return not exc.details().startswith("cannot call: ")
        return code == grpc.StatusCode.RESOURCE_EXHAUSTED and exc.retry_after is not None

    def backoff(self, attempt: int, hint: float | None = None) -> float:
        """Seconds to wait before retry ``attempt`` (0 for the first retry)."""
        ceiling = min(self.cap, self.base * 2.0 ** min(attempt, 64))
        jitter = self.rand() * ceiling
        return jitter + (hint or 0.0)

    def _next(self, exc: DaemonError, attempt: int, start: float) -> float | None:
        """The wait before the next attempt, or None when ``exc`` is final."""
        if not self.retryable(exc):
            return None
        delay = self.backoff(attempt, exc.retry_after)
        if self.clock() + delay - start > self.total:
            return None
        return delay

    def call(self, attempt: Callable[[], T]) -> T:
        """``attempt()``, repeated while it fails retryably and time is left."""
        start = self.clock()
        n = 0
        while True:
            try:
                return attempt()
            except DaemonError as exc:
                delay = self._next(exc, n, start)
                if delay is None:
                    raise
            self.sleep(delay)
            n += 1

    async def call_async(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """:meth:`call` for a coroutine (waits with ``asyncio.sleep``)."""
        start = self.clock()
        n = 0
        while True:
            try:
                return await attempt()
            except DaemonError as exc:
                delay = self._next(exc, n, start)
                if delay is None:
                    raise
            await asyncio.sleep(delay)
            n += 1


#: What a client retries with unless told otherwise (``retry=None``: never).
DEFAULT_RETRY: Final = RetryPolicy()
