"""The daemon's TCP authentication: the bearer-token interceptor and its failed-auth limit.

::

    TCP call --TLS--> TokenInterceptor: health? pass
                        else wrap the method: Bearer token / admin? -> the method (always:
                                                   a correct token is never refused)
                                              else count a failure, log the peer;
                                                   past 10 in 60 s from that host the
                                                   answer waits FAILURE_DELAY_S (60 s) and
                                                   is RESOURCE_EXHAUSTED, else
                                                   UNAUTHENTICATED

Limiting the failures, not the source: a guesser on the host of a real client
(another local user, say) slows its own guesses down, and can never lock the real
client out.
"""

from __future__ import annotations

import hmac
import inspect
import ipaddress
import logging
from typing import Any, Final

from simpler_daemon.system.authguard import FailedAuthLimiter, peer_host

__all__ = ["FAILURE_DELAY_S", "HEALTH_SERVICE", "is_loopback", "token_interceptor"]

log = logging.getLogger("simpler_daemon.daemon")

#: Health checks need no token (load balancers probe without one).
HEALTH_SERVICE: Final = "grpc.health.v1.Health"
#: How late a failure is answered once its host is over the failed-auth limit.
FAILURE_DELAY_S: Final = 1.0


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or "" for every interface) is loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "" (every interface) or a name: assume reachable
        return False


def token_interceptor(
    token: bytes, limiter: FailedAuthLimiter | None = None, admin_token: bytes = b""
) -> Any:
    """A server interceptor requiring ``authorization: Bearer <token>`` (health is exempt);
    ``Bearer <admin_token>`` passes too (the service makes its holder an admin).

    A host with too many failed authentications (``limiter``) gets its further
    failures answered :data:`FAILURE_DELAY_S` late; the right token always passes at
    once. Each failure is logged naming the peer. The peer is only known inside the
    call (``context.peer()``), so the check wraps the method's behaviour instead of
    choosing a handler.
    """
    import asyncio

    import grpc

    expected = b"Bearer " + token
    # Never b"Bearer ": an unset admin token must not let an empty one through.
    admin_expected = b"Bearer " + admin_token if admin_token else None
    guard = limiter if limiter is not None else FailedAuthLimiter()

    async def check(given: bytes, method: str, context: Any) -> None:
        if given:
            ok = hmac.compare_digest(given, expected)
            if admin_expected is not None:
                ok = hmac.compare_digest(given, admin_expected) or ok
            if ok:
                return
        peer = str(context.peer())
        host = peer_host(peer)
        left = guard.blocked_for(host)
        if left:
            guard.failed(host)
            await asyncio.sleep(FAILURE_DELAY_S)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many failed authentications from {host}: its failures are answered "
                f"{FAILURE_DELAY_S:g} s late for {left:.0f} s more (a correct token passes)",
            )
        count = guard.failed(host)
        why = "wrong bearer token" if given else "missing bearer token"
        if count >= guard.max_failures:
            log.warning(
                "slowing failed TCP calls from %s for %.0f s: %d failed authentications "
                "within %.0f s (last: %s to %s); a correct token still passes",
                peer, guard.block_s, count, guard.window_s, why, method,
            )  # fmt: skip
        else:
            log.warning("rejected a TCP call to %s from %s: %s", method, peer, why)
        if given:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong bearer token")
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing bearer token: send 'authorization: Bearer <token>'",
        )

    def guarded(handler: Any, given: bytes, method: str) -> Any:
        if handler.request_streaming and handler.response_streaming:
            attr = "stream_stream"
        elif handler.request_streaming:
            attr = "stream_unary"
        elif handler.response_streaming:
            attr = "unary_stream"
        else:
            attr = "unary_unary"
        behavior = getattr(handler, attr)
        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: Any) -> Any:
                await check(given, method, context)
                async for item in behavior(request, context):
                    yield item

            return handler._replace(**{attr: stream})

        async def call(request: Any, context: Any) -> Any:
            await check(given, method, context)
            return await behavior(request, context)

        return handler._replace(**{attr: call})

    class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            if details.method.startswith(f"/{HEALTH_SERVICE}/"):
                return await continuation(details)
            given = b""
            for key, value in details.invocation_metadata or ():
                if key == "authorization":
                    given = value.encode() if isinstance(value, str) else bytes(value)
                    break
            handler = await continuation(details)
            if handler is None:
                return None
            return guarded(handler, given, details.method)

    return TokenInterceptor()
