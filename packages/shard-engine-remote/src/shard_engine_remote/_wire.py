"""What travels over gRPC: one unary method whose messages are the project's msgpack codec.

The service ``shard_engine.v1.Engine`` has one method, ``Call``. Its request is a tagged
message of :data:`RemoteRequest` (the codec's requests plus four queries without arguments);
its reply is a :data:`~shard_engine_api.wire.WireReply`, the server's own :class:`ServerStats`
or an :class:`~shard_engine_api.ErrorInfo`.
No protobuf code generation: the (de)serializers below are handed to gRPC's generic handlers.

Deserializers never raise (gRPC would turn that into an opaque INTERNAL status): bytes that do not
decode come back as :class:`Rejected` carrying the typed error, which the server answers with its
ErrorInfo and the client raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, TypeAlias

import msgspec

import shard_engine_api as api
from shard_engine_api import wire

__all__ = [
    "CALL_METHOD",
    "SERVICE_NAME",
    "THREADING_ENV",
    "CapabilitiesQuery",
    "HealthQuery",
    "MetricsQuery",
    "Rejected",
    "RemoteReply",
    "RemoteRequest",
    "ServerStats",
    "ServerStatsQuery",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
]

SERVICE_NAME: Final = "shard_engine.v1.Engine"
CALL_METHOD: Final = f"/{SERVICE_NAME}/Call"
"""The full gRPC method name of the one call every operation goes through."""


class CapabilitiesQuery(msgspec.Struct, frozen=True, kw_only=True, tag="capabilities_query"):
    """Ask for the served engine's capabilities."""


class HealthQuery(msgspec.Struct, frozen=True, kw_only=True, tag="health_query"):
    """Ask for the served engine's health."""


class MetricsQuery(msgspec.Struct, frozen=True, kw_only=True, tag="metrics_query"):
    """Ask for the served engine's metrics."""


THREADING_ENV: Final = (
    "GOMP_SPINCOUNT",
    "OMP_WAIT_POLICY",
    "OMP_NUM_THREADS",
    "OMP_PROC_BIND",
    "GOMP_CPU_AFFINITY",
)
"""Environment variables that decide how an engine's native threads spin, sleep and bind."""


class ServerStatsQuery(msgspec.Struct, frozen=True, kw_only=True, tag="server_stats_query"):
    """Ask for the server's own counters (not the engine's)."""


class ServerStats(msgspec.Struct, frozen=True, kw_only=True, tag="server_stats"):
    """What the server saw and refused since it started, apart from the engine's own metrics.
    Every refusal below was answered with a typed error (or, for ``unauthenticated``, the gRPC
    status UNAUTHENTICATED) and changed nothing."""

    calls: int = 0
    """Calls that reached dispatch (refused frames included, unauthenticated calls not)."""
    in_flight: int = 0
    """Calls being served at the moment of the query (this query included)."""
    unauthenticated: int = 0
    """Calls refused for a missing or wrong bearer token, before any decoding."""
    rejected_frames: int = 0
    """Request bytes that did not decode (InvalidRequest)."""
    oversized: int = 0
    """Requests over the message limit (ResourceExhausted, not retryable). Beyond twice the
    limit gRPC refuses them before the server sees a byte, uncounted."""
    rate_limited: int = 0
    """Calls refused by the client's rate limit (ResourceExhausted with ``retry_after_s``)."""
    busy: int = 0
    """Compute calls refused because every compute thread was busy (retryable)."""
    transport_cancels: int = 0
    """Compute calls whose RPC ended first (cancel, deadline, lost connection): engine.cancel."""
    rate_limited_clients: int = 0
    """Clients (peers) the rate limiter tracks now (bounded; the idlest are forgotten)."""
    threading: dict[str, str] = msgspec.field(default_factory=dict)
    """The OpenMP/threading variables in force in the serving process (of
    :data:`THREADING_ENV`, those set): whether a served engine got the same threading defaults
    as one in the worker's process (llama sets ``GOMP_SPINCOUNT`` before it loads llama.cpp)."""


RemoteRequest: TypeAlias = (
    wire.WireRequest | CapabilitiesQuery | HealthQuery | MetricsQuery | ServerStatsQuery
)
"""Every message a client sends: the codec's requests and the argument-less queries."""

RemoteReply: TypeAlias = wire.WireReply | ServerStats | api.ErrorInfo
"""Every message a server answers with."""


@dataclass(frozen=True, slots=True)
class Rejected:
    """Bytes that did not decode, with the typed error that says why."""

    error: api.ShardEngineError


class _Tag(msgspec.Struct):
    """Only the tag of a message (everything else is skipped, not built)."""

    type: str = ""


# One prebuilt decoder per direction (reusable and thread-safe): the tag picks the type.
_TAG_DECODER: Final = msgspec.msgpack.Decoder(_Tag)
_REQUEST_DECODER: Final[msgspec.msgpack.Decoder[RemoteRequest]] = msgspec.msgpack.Decoder(
    RemoteRequest
)
_REPLY_DECODER: Final[msgspec.msgpack.Decoder[RemoteReply]] = msgspec.msgpack.Decoder(RemoteReply)
_QUERY_ENCODER: Final = msgspec.msgpack.Encoder()
_LOAD_TAG: Final = api.LoadConfig.__struct_config__.tag


def encode_request(message: RemoteRequest) -> bytes:
    """The bytes of a request: the codec's encoding (large payloads aligned) or a query's tag.
    Raises InvalidRequest for values the codec cannot encode."""
    if isinstance(message, CapabilitiesQuery | HealthQuery | MetricsQuery | ServerStatsQuery):
        return _QUERY_ENCODER.encode(message)
    return wire.encode(message)


def decode_request(buf: bytes, max_bytes: int | None = None) -> RemoteRequest | Rejected:
    """Decode a request's structure and types (payloads are the engine's to verify, so its
    metrics count what it refused exactly as a local engine's would). A load request goes
    through the codec's own decoder, which bounds engine options before building them. Bytes
    over ``max_bytes`` are ResourceExhausted (not retryable), undecoded. Never raises: bytes
    nested too deeply to decode are InvalidRequest too."""
    if max_bytes is not None and len(buf) > max_bytes:
        return Rejected(
            api.ResourceExhausted(
                f"the request is {len(buf)} bytes, over the server's message limit of {max_bytes}",
                retryable=False,
                details={
                    "resource": "message_bytes",
                    "message_bytes": len(buf),
                    "limit": max_bytes,
                },
            )
        )
    try:
        if _TAG_DECODER.decode(buf).type == _LOAD_TAG:
            return wire.decode_request(buf)
        return _REQUEST_DECODER.decode(buf)
    except api.ShardEngineError as error:
        return Rejected(error)
    except (msgspec.MsgspecError, RecursionError) as error:
        return Rejected(_explain(buf, error))


def encode_reply(message: RemoteReply) -> bytes:
    """The bytes of a reply (the codec's encoding; the server's stats are plain msgpack)."""
    if isinstance(message, ServerStats):
        return _QUERY_ENCODER.encode(message)
    return wire.encode(message)


def decode_reply(buf: bytes) -> RemoteReply | Rejected:
    """Decode a reply; an ErrorInfo is returned as is (the caller raises it). Never raises.
    Payload checksums are not recomputed here: the transport's own integrity covers the bytes,
    and the next shard verifies every bundle it is given."""
    try:
        return _REPLY_DECODER.decode(buf)
    except (msgspec.MsgspecError, RecursionError) as error:
        explained = _explain(buf, error)
        return Rejected(
            api.MalformedOutput(
                f"the server's reply does not decode: {explained.message}",
                details={"cause": explained.code},
            )
        )


def _explain(buf: bytes, error: Exception) -> api.ShardEngineError:
    """The codec's own verdict on bytes the union decoder refused: a contract version mismatch
    when they name another version, else InvalidRequest with msgspec's reason."""
    if isinstance(error, RecursionError):
        return api.InvalidRequest("undecodable request: nested too deeply")
    try:
        wire.decode_message(buf)
    except api.ShardEngineError as verdict:
        if isinstance(verdict, api.ContractVersionMismatch):
            return verdict
    except RecursionError:
        pass
    return api.InvalidRequest(f"undecodable request: {error}")
