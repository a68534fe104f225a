"""What both ends of the gRPC transport agree on, and how a gRPC server sets its connections
up: the channel options (message sizes, keepalive), the connection bounds and the trailing
metadata with which :class:`~shard_engine_remote._server.EngineServer` says why it refused a
call itself (read by :mod:`~shard_engine_remote._grpc_link`)."""

from __future__ import annotations

import typing
from typing import Final

import grpc

__all__ = [
    "DEFAULT_HANDSHAKE_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "REFUSAL_METADATA_KEY",
    "channel_options",
    "connection_limit",
    "refuse",
    "server_options",
]

DEFAULT_MAX_CONNECTIONS: Final = 1000
"""Connections a gRPC server holds at once (never more than half the process's descriptors):
gRPC closes any beyond it as soon as it is accepted."""
DEFAULT_HANDSHAKE_TIMEOUT_S: Final = 10.0
"""How long a new gRPC connection may take to complete its (TLS and HTTP/2) handshake."""
REFUSAL_METADATA_KEY: Final = "shard-engine-refusal"
"""The trailing metadata key naming why this server refused a gRPC call itself, so a client
decides on it and never on the status's words: ``busy`` (every place for calls waiting for
their request is taken; RESOURCE_EXHAUSTED, nothing ran), ``no_request`` (the call carried no
request message; INVALID_ARGUMENT, nothing ran), ``too_slow`` (the client took an export slower
than the stream rate; DEADLINE_EXCEEDED, the export ran). The token interceptor's refusal is
UNAUTHENTICATED, which says it alone; calls cut off by cancelling them carry no trailers."""


def channel_options(max_message_bytes: int) -> list[tuple[str, object]]:
    """gRPC options both ends share: message size limits, and keepalive pings that find a
    peer that vanished without closing the connection."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def refuse(
    context: grpc.ServicerContext, code: grpc.StatusCode, refusal: str, message: str
) -> typing.NoReturn:
    """End the call with ``code``, its reason for clients in :data:`REFUSAL_METADATA_KEY`."""
    context.set_trailing_metadata(((REFUSAL_METADATA_KEY, refusal),))
    context.abort(code, message)


def connection_limit(wanted: int) -> int:
    """``wanted``, capped at half the descriptors this process may open (the rest stay for
    the engine, its files and the calls' own needs)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        return wanted
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft // 2))


def server_options(
    max_message_bytes: int,
    *,
    streams_per_connection: int,
    max_connections: int,
    handshake_timeout_s: float,
    connection_idle_s: float,
) -> list[tuple[str, object]]:
    """A serving gRPC server's options: message sizes, connection bounds, handshake and idle
    limits, streams per connection, the pings it accepts."""
    return [
        # Up to twice the limit reaches the deserializer, which refuses (and counts)
        # what is over it; beyond that gRPC refuses the message unread.
        ("grpc.max_receive_message_length", 2 * max_message_bytes),
        *(
            option
            for option in channel_options(max_message_bytes)
            if option[0] != "grpc.max_receive_message_length"
        ),
        ("grpc.so_reuseport", 0),
        ("grpc.max_allowed_incoming_connections", connection_limit(max_connections)),
        ("grpc.server_handshake_timeout_ms", round(handshake_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", round(connection_idle_s * 1000)),
        # One connection's calls beyond this wait in its client, not on the server.
        ("grpc.max_concurrent_streams", streams_per_connection),
        # Clients ping every 20 s (channel_options) to find a vanished server; gRPC's
        # default policy takes pings more often than every 5 minutes while no data
        # flows as abuse and ends the connection after two, which killed every call
        # computing longer than about a minute. Faster than once a second still is.
        ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ]
