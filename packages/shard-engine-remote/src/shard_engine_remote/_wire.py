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
from typing import Annotated, Final, TypeAlias

import msgspec

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_api.wire import MAX_ID_CHARS, MAX_SNAPSHOT_CHUNKS, Count, Milliseconds

__all__ = [
    "CALL_METHOD",
    "EXPORT_METHOD",
    "IMPORT_METHOD",
    "SERVICE_NAME",
    "THREADING_ENV",
    "CapabilitiesQuery",
    "HealthQuery",
    "ImportHeader",
    "MetricsQuery",
    "Rejected",
    "RemoteReply",
    "RemoteRequest",
    "ServerStats",
    "ServerStatsQuery",
    "SnapshotHeader",
    "decode_export_header",
    "decode_import_header",
    "decode_reply",
    "decode_request",
    "encode_header",
    "encode_reply",
    "encode_request",
    "oversized_error",
]

SERVICE_NAME: Final = "shard_engine.v1.Engine"
CALL_METHOD: Final = f"/{SERVICE_NAME}/Call"
"""The full gRPC method name of the one call every operation goes through (but snapshots)."""
EXPORT_METHOD: Final = f"/{SERVICE_NAME}/ExportSession"
"""Server streaming: an ExportSessionRequest in; a :class:`SnapshotHeader` (or ErrorInfo) out,
then the snapshot's chunks, one raw message each."""
IMPORT_METHOD: Final = f"/{SERVICE_NAME}/ImportSession"
"""Client streaming: an :class:`ImportHeader`, then the snapshot's chunks, one raw message each;
an ImportSessionResult (or ErrorInfo) out. The engine imports only once every chunk arrived."""


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
    "SHARD_ENGINE_LLAMA_COMPUTE_THREADS",
)
"""Environment variables that decide how an engine's native threads spin, sleep and bind, and
which threads the llama engine computes on."""


MAX_THREADING_ENTRIES: Final = 64
"""The most entries of ``ServerStats.threading``."""
MAX_ENV_VALUE_CHARS: Final = 4096
"""The longest value of ``ServerStats.threading`` (a longer one is cut by the server)."""
EnvName: TypeAlias = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
EnvValue: TypeAlias = Annotated[str, msgspec.Meta(max_length=MAX_ENV_VALUE_CHARS)]


class ServerStatsQuery(msgspec.Struct, frozen=True, kw_only=True, tag="server_stats_query"):
    """Ask for the server's own counters (not the engine's)."""


class ServerStats(msgspec.Struct, frozen=True, kw_only=True, tag="server_stats"):
    """What the server saw and refused since it started, apart from the engine's own metrics.
    Every refusal below was answered with a typed error (or, for ``unauthenticated``, the gRPC
    status UNAUTHENTICATED) and changed nothing. Every count is a non-negative 64-bit integer
    and ``threading`` is bounded (the decoder refuses anything else)."""

    calls: Count = 0
    """Calls that reached dispatch (refused frames included, unauthenticated calls not)."""
    in_flight: Count = 0
    """Calls being served at the moment of the query (this query included)."""
    unauthenticated: Count = 0
    """Calls refused for a missing or wrong bearer token, before any decoding."""
    rejected_frames: Count = 0
    """Request bytes that did not decode (InvalidRequest)."""
    oversized: Count = 0
    """Requests over the message limit (ResourceExhausted, not retryable). Over gRPC, beyond
    twice the limit gRPC refuses them before the server sees a byte, uncounted; the framed
    transport skips and counts every one."""
    rate_limited: Count = 0
    """Calls refused by the client's rate limit (ResourceExhausted with ``retry_after_s``)."""
    busy: Count = 0
    """Calls refused, nothing of them having run, because the server had no room for them
    (retryable, with ``retry_after_s``): compute calls beyond the compute queue's bound (or
    that gave their place in a full queue to another client's, ``queue_evicted``), snapshot
    streams beyond their slots and their queue's; over gRPC calls beyond the threads waiting
    for their request message; on the framed transport also calls and connections beyond
    what it queues."""
    transport_cancels: Count = 0
    """Compute calls whose RPC ended first (cancel, deadline, lost connection): engine.cancel."""
    stalled: Count = 0
    """gRPC calls cut off (CANCELLED) while they held a thread waiting on their peer: their
    request message was later than ``stream_idle_s`` (health checks: 5 s), or, over a second
    late, another call needed its thread (the peer holding the most goes first; a health
    Watch counts as waiting)."""
    shared_memory_calls: Count = 0
    """Framed calls whose request or reply crossed in the shared memory their connection lent
    the server (see ``_framed``) instead of the socket."""
    refused_shared_memory: Count = 0
    """Framed connections whose offered shared memory was refused (not a sealed memory file
    of the announced size): they were served over the socket alone."""
    rate_limited_clients: Count = 0
    """Clients (peers) the rate limiter tracks now (bounded; the idlest are forgotten)."""
    queued: Count = 0
    """Compute calls waiting for a compute slot now (the queue's depth), all clients."""
    max_queued: Count = 0
    """The most compute calls the server holds waiting (``serve --max-queued``)."""
    computing: Count = 0
    """Compute slots taken now (calls in the engine, and snapshot streams)."""
    queued_calls: Count = 0
    """Compute calls that waited in the queue for a slot (not those granted one at once)."""
    queue_wait_ms: Milliseconds = 0.0
    """Their waits, in total."""
    queue_wait_max_ms: Milliseconds = 0.0
    """The longest of their waits."""
    streams_queued: Count = 0
    """Snapshot streams (exports, imports) waiting for a stream slot now, all clients (a
    stream then holds a compute slot too, waiting for it among the compute calls)."""
    queue_evicted: Count = 0
    """Queued compute calls refused (ResourceExhausted, counted in ``busy`` too) to make
    room in the full queue for a call of a client with fewer waiting."""
    drain_refused: Count = 0
    """Compute calls refused while the server drained (NotReady naming the drain, nothing
    ran): new ones, and those still waiting for a slot near the drain's end."""
    threading: Annotated[
        dict[EnvName, EnvValue], msgspec.Meta(max_length=MAX_THREADING_ENTRIES)
    ] = msgspec.field(default_factory=dict)
    """The OpenMP/threading variables in force in the serving process (of
    :data:`THREADING_ENV`, those set): whether a served engine got the same threading defaults
    as one in the worker's process (llama sets ``GOMP_SPINCOUNT`` before it loads llama.cpp).
    A value longer than MAX_ENV_VALUE_CHARS is cut to it."""


class SnapshotHeader(msgspec.Struct, frozen=True, kw_only=True, tag="snapshot_header"):
    """The first message of an export stream: the snapshot without its chunks, and how many
    chunk messages follow."""

    snapshot: api.SessionSnapshot
    n_chunks: Annotated[int, msgspec.Meta(ge=0, le=MAX_SNAPSHOT_CHUNKS)]


class ImportHeader(msgspec.Struct, frozen=True, kw_only=True, tag="import_header"):
    """The first message of an import stream: the request whose snapshot has no chunks, and how
    many chunk messages follow."""

    request: api.ImportSessionRequest
    n_chunks: Annotated[int, msgspec.Meta(ge=0, le=MAX_SNAPSHOT_CHUNKS)]


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
        return Rejected(oversized_error(len(buf), max_bytes))
    try:
        if _TAG_DECODER.decode(buf).type == _LOAD_TAG:
            return wire.decode_request(buf)
        return _REQUEST_DECODER.decode(buf)
    except api.ShardEngineError as error:
        return Rejected(error)
    except (msgspec.MsgspecError, RecursionError) as error:
        return Rejected(_explain(buf, error))


def oversized_error(size: int, limit: int) -> api.ResourceExhausted:
    """What a request of ``size`` bytes over the server's message limit is answered with."""
    return api.ResourceExhausted(
        f"the request is {size} bytes, over the server's message limit of {limit}",
        retryable=False,
        details={"resource": "message_bytes", "message_bytes": size, "limit": limit},
    )


def encode_reply(message: RemoteReply) -> bytes:
    """The bytes of a reply (the codec's encoding; the server's stats are plain msgpack)."""
    if isinstance(message, ServerStats):
        return _QUERY_ENCODER.encode(message)
    return wire.encode(message)


def payload_bytes(message: RemoteReply) -> int:
    """Bytes of the payloads a reply carries (what dominates its encoding; 0 for the rest)."""
    match message:
        case api.LogitsResult(payload=payload):
            return payload.nbytes
        case api.BoundaryResult(bundle=bundle):
            return bundle.payload.nbytes
        case api.DecodeBatchResult(items=items):
            return sum(payload_bytes(item) for item in items)
        case _:
            return 0


def encode_reply_into(message: RemoteReply, out: memoryview) -> int | None:
    """Encode a reply into the start of ``out`` (shared memory): the bytes written, or None
    when the reply does not fit (nothing written). The same bytes as :func:`encode_reply`."""
    if isinstance(message, ServerStats):
        encoded = _QUERY_ENCODER.encode(message)
        if len(encoded) > out.nbytes:
            return None
        out[: len(encoded)] = encoded
        return len(encoded)
    return wire.encode_into(message, out)


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


_EXPORT_HEADER_DECODER: Final[msgspec.msgpack.Decoder[SnapshotHeader | api.ErrorInfo]] = (
    msgspec.msgpack.Decoder(SnapshotHeader | api.ErrorInfo)
)
_IMPORT_HEADER_DECODER: Final[msgspec.msgpack.Decoder[ImportHeader]] = msgspec.msgpack.Decoder(
    ImportHeader
)


def encode_header(header: SnapshotHeader | ImportHeader | api.ErrorInfo) -> bytes:
    """The bytes of a stream's first message."""
    return _QUERY_ENCODER.encode(header)


def decode_export_header(buf: bytes) -> SnapshotHeader | api.ErrorInfo | Rejected:
    """The first message of an export stream (MalformedOutput when it does not decode)."""
    try:
        return _EXPORT_HEADER_DECODER.decode(buf)
    except (msgspec.MsgspecError, RecursionError) as error:
        return Rejected(api.MalformedOutput(f"the export stream's header does not decode: {error}"))


def decode_import_header(buf: bytes) -> ImportHeader | Rejected:
    """The first message of an import stream (InvalidRequest when it does not decode)."""
    try:
        return _IMPORT_HEADER_DECODER.decode(buf)
    except (msgspec.MsgspecError, RecursionError) as error:
        return Rejected(api.InvalidRequest(f"the import stream's header does not decode: {error}"))
