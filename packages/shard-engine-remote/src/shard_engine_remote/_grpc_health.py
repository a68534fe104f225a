"""``grpc.health.v1`` for one server: SERVING while its engine is ready or degraded,
NOT_SERVING otherwise and while draining, answered without a token for ``""`` and the
shard-engine service only.
"""

from __future__ import annotations

import threading
import typing
from collections.abc import Callable, Iterator
from typing import Final

import grpc
from grpc_health.v1 import health, health_pb2

from shard_engine_remote._callers import client_key
from shard_engine_remote._waiting import Waiting
from shard_engine_remote._wire import SERVICE_NAME

__all__ = ["SERVING_STATES", "GrpcHealth"]

SERVING_STATES: Final = ("ready", "degraded")
_HEALTH_SERVICE: Final = "grpc.health.v1.Health"
_HEALTH_SLOTS: Final = 4
"""Threads health checks may hold at once, waiting for their request or watching (a Watch
holds one for as long as it lasts), see Waiting. Few: health needs no token, and a request
may be as large as any message while it arrives."""
_HEALTH_REQUEST_S: Final = 5.0
"""How long a health check's request message may take to arrive."""
_HEALTH_SERVICES: Final = frozenset(("", SERVICE_NAME))


_RequestOf = Callable[
    [Iterator[health_pb2.HealthCheckRequest], grpc.ServicerContext, Waiting],
    health_pb2.HealthCheckRequest,
]


class GrpcHealth:
    """The health service's handlers and status. ``request_of`` reads a call's one request
    message, waited for as one of :attr:`waiting` (the server's own rule for every call);
    ``on_stalled`` and ``count`` keep the server's counters."""

    def __init__(
        self,
        request_of: _RequestOf,
        on_stalled: Callable[[], None],
        count: Callable[[str], None],
    ) -> None:
        self.waiting = Waiting(_HEALTH_SLOTS, _HEALTH_REQUEST_S, on_stalled)
        self._request_of = request_of
        self._count = count
        self._servicer = health.HealthServicer()
        self._status: int | None = None
        self._lock = threading.Lock()

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler serving ``Check`` and ``Watch``."""
        check: grpc.RpcMethodHandler[typing.Any, typing.Any]
        check = grpc.stream_unary_rpc_method_handler(
            self.check,
            request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
        watch: grpc.RpcMethodHandler[typing.Any, typing.Any]
        watch = grpc.stream_stream_rpc_method_handler(
            self.watch,
            request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(
            _HEALTH_SERVICE, {"Check": check, "Watch": watch}
        )

    # grpc.health.v1 answers without a token. Its handlers are request-streaming too, so
    # their wait for the request is bounded (its own Waiting: health callers cannot evict
    # token holders' calls). Only the services this server serves are answered: the
    # servicer keeps an entry per service watched, which names made up would grow for ever.

    def check(
        self, requests: Iterator[health_pb2.HealthCheckRequest], context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        request = self._request_of(requests, context, self.waiting)
        if request.service not in _HEALTH_SERVICES:
            context.abort(grpc.StatusCode.NOT_FOUND, "this server serves no such service")
        return self._servicer.Check(request, context)

    def watch(
        self, requests: Iterator[health_pb2.HealthCheckRequest], context: grpc.ServicerContext
    ) -> Iterator[health_pb2.HealthCheckResponse]:
        request = self._request_of(requests, context, self.waiting)
        if request.service not in _HEALTH_SERVICES:
            yield health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            )
            return
        # A watch holds its thread for as long as it lasts: it stays one of the waiting
        # (no time limit), the first to be evicted when a newer health call needs room.
        ticket = self.waiting.enter(context, client_key(context), timed=False)
        if ticket is None:
            self._count("busy")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "health checks are busy; retry")
        try:
            yield from self._servicer.Watch(request, context)
        finally:
            self.waiting.leave(ticket)

    def refresh(self, state: str) -> None:
        """Answer SERVING or NOT_SERVING for an engine in ``state``."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if state in SERVING_STATES
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        with self._lock:
            if status == self._status:
                return
            self._status = status
            self._servicer.set("", status)
            self._servicer.set(SERVICE_NAME, status)

    def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING from now on, whatever the engine says."""
        self._servicer.enter_graceful_shutdown()
