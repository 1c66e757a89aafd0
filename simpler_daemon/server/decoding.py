"""Request bytes that do not parse: INVALID_ARGUMENT, not UNKNOWN and a traceback.

gRPC calls a method's request deserializer before the handler; when it raises,
grpc.aio logs the exception at ERROR and answers UNKNOWN, once per request, so a
client sending garbage floods the log. :func:`add_daemon_servicer` registers the
servicer with deserializers that return a :class:`BadRequest` instead; the
servicer's decorators refuse it with INVALID_ARGUMENT naming the message type.

    client bytes --tolerant(FromString)--> message | BadRequest --handler--> status
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2_grpc as pb_grpc

__all__ = ["BadRequest", "add_daemon_servicer", "tolerant"]


class BadRequest:
    """Stands for a request whose bytes did not parse as ``type_name``."""

    __slots__ = ("reason", "size", "type_name")

    def __init__(self, type_name: str, size: int, reason: str) -> None:
        self.type_name = type_name
        self.size = size
        self.reason = reason

    def describe(self) -> str:
        return (
            f"cannot parse the request: {self.size} bytes are not a valid "
            f"{self.type_name} ({self.reason})"
        )


def tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserializer`` returning a :class:`BadRequest` where it would raise."""
    if deserializer is None:
        return None
    owner = getattr(deserializer, "__self__", None)
    type_name = getattr(owner, "DESCRIPTOR", None)
    name = type_name.full_name if type_name is not None else "request message"

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, ValueError, TypeError) as exc:
            return BadRequest(name, len(data), str(exc) or type(exc).__name__)

    return parse


class _Collect:
    """Stands in for the server while the generated code registers the handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}
        self.service = ""

    def add_generic_rpc_handlers(self, _handlers: Any) -> None:
        pass  # the same handlers arrive through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.service = service
        self.handlers = handlers


def add_daemon_servicer(servicer: Any, server: Any) -> None:
    """``add_DaemonServicer_to_server`` with tolerant request deserializers."""
    collect = _Collect()
    pb_grpc.add_DaemonServicer_to_server(servicer, collect)
    handlers = {
        name: h._replace(request_deserializer=tolerant(h.request_deserializer))
        for name, h in collect.handlers.items()
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(collect.service, handlers),)
    )
    server.add_registered_method_handlers(collect.service, handlers)
