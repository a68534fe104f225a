"""``EngineServer``: one loaded engine served over gRPC to remote engines.

Every operation arrives through the one ``Call`` method and is dispatched on the request's tag.
A call whose RPC ends before the engine answered (the client cancelled, its deadline passed, the
connection dropped) becomes ``engine.cancel(request_id)``, so the engine stops at its next safe
point and rolls back. Engine errors are answered as their ErrorInfo; nothing an engine or a
client does stops the server from serving other clients: undecodable frames get InvalidRequest,
messages over the size limit get ResourceExhausted (not retryable; beyond twice the limit gRPC
refuses them itself), a client over its rate limit gets a retryable ResourceExhausted with
``retry_after_s`` (per client: others keep their own budget), compute calls beyond the server's
slots wait in a bounded queue, fair per client (:mod:`~shard_engine_remote._admission`), and
only beyond its bound get a retryable ResourceExhausted with ``retry_after_s`` (cancel,
release, health and metrics never wait in it), calls without the bearer token are refused
before decoding, calls whose request
message is late or that hold a waiting thread another peer's call needs are cut off
(``stalled``), and
connections are bounded in number, handshake time and idle time. Each of these is counted
in :attr:`EngineServer.counters`, which clients read as :class:`ServerStats`
(``RemoteEngine.server_stats()``).

``grpc.health.v1`` is served alongside (``""`` and ``shard_engine.v1.Engine``): SERVING while
the engine is ready or degraded, NOT_SERVING otherwise and while draining.

Another transport serves through the same public surface, and so keeps every rule above: it
decodes a message and hands it, with a :class:`CallContext` whose end cancels the engine work,
to :meth:`EngineServer.serve_call`, :meth:`~EngineServer.serve_export` or
:meth:`~EngineServer.serve_import` (the framed transport, :mod:`~shard_engine_remote._framed`,
does; what it could not decode goes to :meth:`~EngineServer.refused_frame`).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import signal
import threading
import time
import traceback
import typing
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Final, TypeAlias, TypeVar

import grpc
import msgspec
from grpc_health.v1 import health, health_pb2

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_api._errors import clamp_text
from shard_engine_api._types import MAX_DETAIL_CHARS, MAX_ID_CHARS, SNAPSHOT_CHUNK_BYTES
from shard_engine_remote._admission import DEFAULT_MAX_QUEUED, Admission, Outcome, Ticket
from shard_engine_remote._idle import IdleSessions
from shard_engine_remote._import_limits import (
    DEFAULT_MAX_IMPORT_BYTES,
    ImportBudget,
    check_import_header,
)
from shard_engine_remote._ratelimit import RateLimit, RateLimiter
from shard_engine_remote._security import BearerTokenInterceptor, ServerSecurity
from shard_engine_remote._wire import (
    MAX_ENV_VALUE_CHARS,
    SERVICE_NAME,
    THREADING_ENV,
    CapabilitiesQuery,
    HealthQuery,
    MetricsQuery,
    Rejected,
    RemoteReply,
    RemoteRequest,
    ServerStats,
    ServerStatsQuery,
    SnapshotHeader,
    decode_export_header,
    decode_import_header,
    decode_request,
    encode_header,
    encode_reply,
)

__all__ = [
    "CALLER_METADATA_KEY",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_MAX_SNAPSHOT_BYTES",
    "DEFAULT_MIN_STREAM_BYTES_PER_S",
    "DEFAULT_STREAM_IDLE_S",
    "CallContext",
    "EngineServer",
    "ServerCounters",
    "Serving",
    "StreamBroken",
    "caller_key",
    "channel_options",
    "client_key",
    "drain_margin_s",
    "serve_until_signalled",
]

DEFAULT_MAX_MESSAGE_BYTES: Final = wire.DEFAULT_MAX_PAYLOAD_BYTES + (1 << 20)
"""The largest message either side accepts: the codec's payload limit plus room for headers."""

_SERVING_STATES: Final = ("ready", "degraded")
_HEALTH_SERVICE: Final = "grpc.health.v1.Health"
_HEALTH_SLOTS: Final = 4
"""Threads health checks may hold at once, waiting for their request or watching (a Watch
holds one for as long as it lasts), see _Waiting. Few: health needs no token, and a request
may be as large as any message while it arrives."""
_HEALTH_REQUEST_S: Final = 5.0
"""How long a health check's request message may take to arrive."""
DEFAULT_MAX_CONNECTIONS: Final = 1000
"""Connections a gRPC server holds at once (never more than half the process's descriptors):
gRPC closes any beyond it as soon as it is accepted."""
DEFAULT_HANDSHAKE_TIMEOUT_S: Final = 10.0
"""How long a new gRPC connection may take to complete its (TLS and HTTP/2) handshake."""
DEFAULT_CONNECTION_IDLE_S: Final = 300.0
"""How long a gRPC connection without calls stays open (its client reconnects when it next
calls)."""
DEFAULT_MAX_SNAPSHOT_BYTES: Final = 1 << 32
"""The largest session state an import stream may announce (the engine core's own default)."""
DEFAULT_STREAM_IDLE_S: Final = 30.0
"""How long an import stream may wait for its next message before it is cut off."""
DEFAULT_MIN_STREAM_BYTES_PER_S: Final = 1 << 20
"""The slowest a snapshot stream may move its bytes, on average: a stream of ``n`` bytes
holds its slot for at most ``stream_idle_s + n / min_stream_bytes_per_s`` seconds."""
_Result = TypeVar("_Result")
_Message = TypeVar("_Message")
_LOG: Final = logging.getLogger("shard_engine.remote")


class CallContext(typing.Protocol):
    """What dispatch needs of a call: who makes it, and callbacks run when it ends (completed,
    cancelled, past its deadline or its connection lost). gRPC's ServicerContext is one; the
    framed transport has its own."""

    def add_callback(self, callback: Callable[[], None]) -> bool: ...

    def peer(self) -> str: ...

    def peer_identities(self) -> Iterable[bytes] | None: ...

    def invocation_metadata(self) -> Iterable[tuple[str, str | bytes]] | None: ...


class StreamBroken(Exception):
    """A client's stream ended before its end: abandoned, or its connection lost."""


class Serving(typing.Protocol):
    """A server of one engine, whichever transport it speaks."""

    @property
    def engine(self) -> api.ShardEngine: ...

    def stop(self, grace: float | None = 10.0) -> None: ...


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


@dataclass
class ServerCounters:
    """What the server saw, refused or cut short since it started (see :class:`ServerStats`
    for what each counts)."""

    calls: int = 0
    in_flight: int = 0
    unauthenticated: int = 0
    rejected_frames: int = 0
    oversized: int = 0
    rate_limited: int = 0
    busy: int = 0
    transport_cancels: int = 0
    stalled: int = 0
    shared_memory_calls: int = 0
    refused_shared_memory: int = 0
    drain_refused: int = 0
    queue: Callable[[], dict[str, int | float]] | None = field(
        default=None, repr=False, compare=False
    )
    """The compute queue's own figures (depth, waits: ``Admission.stats``), when there is one."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def call_started(self) -> None:
        with self._lock:
            self.calls += 1
            self.in_flight += 1

    def call_ended(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def stats(self, rate_limited_clients: int = 0) -> ServerStats:
        queue = {} if self.queue is None else self.queue()
        with self._lock:
            stats = ServerStats(
                drain_refused=self.drain_refused,
                calls=self.calls,
                in_flight=self.in_flight,
                unauthenticated=self.unauthenticated,
                rejected_frames=self.rejected_frames,
                oversized=self.oversized,
                rate_limited=self.rate_limited,
                busy=self.busy,
                transport_cancels=self.transport_cancels,
                shared_memory_calls=self.shared_memory_calls,
                refused_shared_memory=self.refused_shared_memory,
                stalled=self.stalled,
                rate_limited_clients=rate_limited_clients,
                threading={
                    name: clamp_text(os.environ[name], MAX_ENV_VALUE_CHARS)
                    for name in THREADING_ENV
                    if name in os.environ
                },
            )
        return msgspec.structs.replace(stats, **queue) if queue else stats

    def snapshot(self) -> dict[str, int]:
        return msgspec.structs.asdict(self.stats())


def client_key(context: CallContext) -> str:
    """Who is calling, for the rate limiter: the mutual-TLS identity when the peer presented a
    certificate, else its connection (``ipv4:127.0.0.1:PORT``, ``unix:...``)."""
    identities = context.peer_identities()
    if identities:
        return "tls:" + b",".join(identities).decode("utf-8", "replace")
    return context.peer()


CALLER_METADATA_KEY: Final = "shard-engine-caller"
"""Metadata naming the remote engine a gRPC call comes from (a random id it draws once):
every gRPC client on a unix socket has the same peer, ``unix:``."""


def caller_key(context: CallContext) -> str:
    """Whose work a call is, for cancels: :func:`client_key` and, over gRPC, the caller's
    random id (unguessable, so naming it proves nothing to anyone else; never used for rate
    limits, which a client could dodge by drawing new ids)."""
    key = client_key(context)
    for name, value in context.invocation_metadata() or ():
        if name == CALLER_METADATA_KEY:
            caller = value if isinstance(value, str) else value.hex()
            if len(caller) > _MAX_CALLER_CHARS:
                # Held for as long as the call runs: a long id costs its digest's size only.
                caller = "sha256:" + hashlib.sha256(caller.encode("utf-8", "replace")).hexdigest()
            return f"{key}/{caller}"
    return key


_MAX_CALLER_CHARS: Final = 128
"""The longest caller id kept as sent (a client draws 32 hex digits); longer ones are hashed."""


class EngineServer:
    """Serves ``engine`` on one address. ``allow_load`` lets the first client load it (the
    private socket of a spawned child); a server started on a loaded engine refuses loads.

    ``max_workers`` threads serve calls; at most ``max_workers - 4`` of them compute at once so
    cancel, release, health and metrics are never starved. Compute calls beyond those slots
    wait, ``max_queued`` of them at most (all clients together), in a queue fair per client
    (see :mod:`~shard_engine_remote._admission`; each holds a thread of its own while it
    waits); beyond, and for every new call while the server drains, they are refused (a
    retryable ResourceExhausted with ``retry_after_s``; while draining a retryable NotReady
    naming the drain), nothing of them having run. A snapshot stream holds one of those
    compute slots from its first message to its last (a client that stops sending or reading
    would otherwise hold a thread no slot accounts for), at most half of them are streams, and
    an import stream whose next message does not arrive within ``stream_idle_s`` is cut off
    (Cancelled; nothing imported), as is an export whose client does not take its next message
    within it; nor may a stream, as a whole, move its bytes slower than
    ``min_stream_bytes_per_s`` (a message every ``stream_idle_s`` would otherwise keep a slot
    for as many times that as it has chunks). A call's request message too must arrive within
    ``stream_idle_s``; calls waiting for theirs hold threads of their own (beyond
    ``max_workers``), ``4 * max_workers`` of them: when all are taken, a new call cuts off
    (counted as ``stalled``) the oldest waiter, of at least a second, of the peer holding the
    most places, or is refused (busy, retryable) when there is none, so calls whose message
    never comes cannot stop the server serving anyone else. ``rate_limit`` bounds
    each client's calls (cancel is never limited: a client must always be able to stop its own
    work); ``clock`` is the rate limiter's (tests). At most ``max_connections`` gRPC connections
    are held at once (others are closed as they are accepted); one that has not completed its
    handshake within ``handshake_timeout_s``, or has had no call for ``connection_idle_s``, is
    closed. An import stream is admitted from its header before its body is read (see
    :mod:`~shard_engine_remote._import_limits`): at most ``max_snapshot_bytes`` and at most
    what its length takes on this shard, and all streams together hold at most
    ``max_import_bytes`` (over it: retryable ResourceExhausted). With ``session_idle_s``, a
    session no call was served on for that long is released with its fence (see
    :mod:`~shard_engine_remote._idle`; ``serve`` sets it, 600 s by default).
    """

    def __init__(
        self,
        engine: api.ShardEngine,
        *,
        security: ServerSecurity | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_workers: int = 16,
        allow_load: bool = False,
        rate_limit: RateLimit | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_snapshot_bytes: int = DEFAULT_MAX_SNAPSHOT_BYTES,
        stream_idle_s: float = DEFAULT_STREAM_IDLE_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        connection_idle_s: float = DEFAULT_CONNECTION_IDLE_S,
        min_stream_bytes_per_s: float = DEFAULT_MIN_STREAM_BYTES_PER_S,
        max_import_bytes: int = DEFAULT_MAX_IMPORT_BYTES,
        session_idle_s: float | None = None,
        max_queued: int = DEFAULT_MAX_QUEUED,
    ) -> None:
        if max_workers < 5:
            raise api.InvalidRequest(f"max_workers must be >= 5, got {max_workers}")
        if max_queued < 0:
            raise api.InvalidRequest(f"max_queued must be >= 0, got {max_queued}")
        if not stream_idle_s > 0:
            raise api.InvalidRequest(f"stream_idle_s must be > 0, got {stream_idle_s}")
        if max_connections < 1:
            raise api.InvalidRequest(f"max_connections must be >= 1, got {max_connections}")
        for name, seconds in (
            ("handshake_timeout_s", handshake_timeout_s),
            ("connection_idle_s", connection_idle_s),
            ("min_stream_bytes_per_s", min_stream_bytes_per_s),
        ):
            if not seconds > 0:
                raise api.InvalidRequest(f"{name} must be > 0, got {seconds}")
        self.stream_idle_s = stream_idle_s
        self.min_stream_bytes_per_s = min_stream_bytes_per_s
        self.engine = engine
        self.max_workers = max_workers
        self.max_message_bytes = max_message_bytes
        self.security = security or ServerSecurity()
        self.counters = ServerCounters()
        self.address: str | None = None
        self._allow_load = allow_load
        self.max_snapshot_bytes = max_snapshot_bytes
        self._import_budget = ImportBudget(max_import_bytes)
        self._idle: IdleSessions | None = None
        if session_idle_s is not None:
            self._idle = IdleSessions(
                engine, session_idle_s, max_sessions=_served_max_sessions(engine)
            )
        self._limiter = None if rate_limit is None else RateLimiter(rate_limit, clock)
        self.max_queued = max_queued
        self._compute_slots = Admission(max_workers - 4, max_queued)
        self.counters.queue = self._compute_slots.stats
        self._stream_slots = threading.BoundedSemaphore(max(1, (max_workers - 4) // 2))
        self._in_flight = _InFlight()
        self._waiting = _Waiting(
            4 * max_workers, stream_idle_s, functools.partial(self.counters.add, "stalled")
        )
        self._health_waiting = _Waiting(
            _HEALTH_SLOTS, _HEALTH_REQUEST_S, functools.partial(self.counters.add, "stalled")
        )
        self._health = health.HealthServicer()
        self._health_status: int | None = None
        self._health_lock = threading.Lock()
        interceptors: list[grpc.ServerInterceptor] = []
        if self.security.token:
            interceptors.append(
                BearerTokenInterceptor(
                    self.security.token, functools.partial(self.counters.add, "unauthenticated")
                )
            )
        # Calls waiting in the compute queue hold a thread each, beyond max_workers.
        threads = max_workers + max_queued + self._waiting.capacity + self._health_waiting.capacity
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="engine-rpc"),
            interceptors=interceptors,
            options=[
                # Up to twice the limit reaches the deserializer, which refuses (and counts)
                # what is over it; beyond that gRPC refuses the message unread.
                ("grpc.max_receive_message_length", 2 * max_message_bytes),
                *(
                    option
                    for option in channel_options(max_message_bytes)
                    if option[0] != "grpc.max_receive_message_length"
                ),
                ("grpc.so_reuseport", 0),
                ("grpc.max_allowed_incoming_connections", _connection_limit(max_connections)),
                ("grpc.server_handshake_timeout_ms", round(handshake_timeout_s * 1000)),
                ("grpc.max_connection_idle_ms", round(connection_idle_s * 1000)),
                # One connection's calls beyond this wait in its client, not on the server.
                ("grpc.max_concurrent_streams", 2 * max_workers),
                # Clients ping every 20 s (channel_options) to find a vanished server; gRPC's
                # default policy takes pings more often than every 5 minutes while no data
                # flows as abuse and ends the connection after two, which killed every call
                # computing longer than about a minute. Faster than once a second still is.
                ("grpc.http2.min_ping_interval_without_data_ms", 1000),
            ],
            maximum_concurrent_rpcs=max_workers * 8 + max_queued,
        )
        # Request-streaming handlers for unary calls (the same on the wire): the wait for
        # the request message is ours, bounded (see _Waiting).
        handler: grpc.RpcMethodHandler[RemoteRequest | Rejected, RemoteReply]
        handler = grpc.stream_unary_rpc_method_handler(
            self._grpc_call,
            request_deserializer=functools.partial(decode_request, max_bytes=max_message_bytes),
            response_serializer=encode_reply,
        )
        export: grpc.RpcMethodHandler[RemoteRequest | Rejected, bytes]
        export = grpc.stream_stream_rpc_method_handler(
            self._grpc_export,
            request_deserializer=functools.partial(decode_request, max_bytes=max_message_bytes),
        )
        import_: grpc.RpcMethodHandler[bytes, RemoteReply]
        import_ = grpc.stream_unary_rpc_method_handler(
            self._grpc_import, response_serializer=encode_reply
        )
        methods: dict[str, grpc.RpcMethodHandler[typing.Any, typing.Any]] = {
            "Call": handler,
            "ExportSession": export,
            "ImportSession": import_,
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, methods),)
        )
        check: grpc.RpcMethodHandler[typing.Any, typing.Any]
        check = grpc.stream_unary_rpc_method_handler(
            self._health_check,
            request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
        watch: grpc.RpcMethodHandler[typing.Any, typing.Any]
        watch = grpc.stream_stream_rpc_method_handler(
            self._health_watch,
            request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
        self._server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    _HEALTH_SERVICE, {"Check": check, "Watch": watch}
                ),
            )
        )

    # ----------------------------------------------------------------- lifecycle

    def start(self, listen: str) -> str:
        """Bind ``listen`` (``host:port``, port 0 picks one, or ``unix:PATH``) and serve.
        Returns the bound address. Raises InvalidRequest for an address the security settings
        do not allow, or one that cannot be bound."""
        self.security.check_listen(listen)
        credentials = self.security.credentials()
        try:
            if credentials is None:
                port = self._server.add_insecure_port(listen)
            else:
                port = self._server.add_secure_port(listen, credentials)
        except RuntimeError as error:
            raise api.InvalidRequest(f"cannot listen on {listen}: {error}") from error
        if listen.startswith("unix"):
            self.address = listen
        else:
            self.address = f"{listen.rsplit(':', 1)[0]}:{port}"
        self._waiting.start()
        self._health_waiting.start()
        self._server.start()
        self.refresh_health()
        return self.address

    def stop(self, grace: float | None = 10.0) -> None:
        """Stop taking calls, let in-flight ones finish for up to ``grace`` seconds (then they
        are cancelled, which cancels their engine work), and return. The engine stays open.
        Until no compute call runs or waits (at most until near the grace's end), the server
        still takes calls: compute calls are refused with a typed error naming the drain (see
        :meth:`refuse_new_calls`), cancel, release, health and metrics are served; calls
        waiting for a compute slot are served in turn, and those still waiting near the
        grace's end are refused the same way (see :meth:`refuse_queued_calls`). While calls
        keep arriving (a tenth of a second without one ends it), they keep getting that typed
        refusal. Then gRPC stops taking calls (one arriving after that is CANCELLED by gRPC
        itself, which a remote engine must take as "may have run") and waits for the rest of
        the grace."""
        self._health.enter_graceful_shutdown()
        self.refuse_new_calls()
        remaining = None
        if grace is not None:
            deadline = time.monotonic() + grace
            refuse_queued = deadline - drain_margin_s(grace)
            calls = self.counters.calls
            self._compute_slots.wait_idle(refuse_queued)
            while calls != self.counters.calls and time.monotonic() < refuse_queued:
                calls = self.counters.calls
                time.sleep(max(0.0, min(_DRAIN_QUIET_S, refuse_queued - time.monotonic())))
            remaining = max(0.0, deadline - time.monotonic())
        self.refuse_queued_calls()
        self._server.stop(remaining).wait()
        self._waiting.stop()
        self._health_waiting.stop()
        if self._idle is not None:
            self._idle.stop()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stopped; False on timeout."""
        return self._server.wait_for_termination(timeout)

    def refuse_new_calls(self) -> None:
        """The server drains: every compute call from now on is refused with a retryable
        NotReady naming the drain (nothing of it ran: the client may go to another server);
        calls waiting for a compute slot stay queued. Counted as ``drain_refused``."""
        self._compute_slots.close()

    def refuse_queued_calls(self) -> int:
        """The drain's grace is nearly over: refuse every compute call still waiting for a
        slot, as :meth:`refuse_new_calls` refuses new ones, before calls still running are
        cancelled. Returns how many were waiting."""
        return self._compute_slots.drain()

    def retry_after_s(self) -> float:
        """When a call refused now may find room in the compute queue (an estimate from
        recent calls' durations, see ``Admission.retry_after_s``)."""
        return self._compute_slots.retry_after_s()

    # ----------------------------------------------------------------- dispatch

    def stats(self) -> ServerStats:
        """The server's counters now (what ``RemoteEngine.server_stats()`` returns)."""
        limiter = self._limiter
        return self.counters.stats(0 if limiter is None else len(limiter))

    def _grpc_call(
        self, requests: Iterator[RemoteRequest | Rejected], context: grpc.ServicerContext
    ) -> RemoteReply:
        return self.serve_call(self._request(requests, context, self._waiting), context)

    def _request(
        self, requests: Iterator[_Message], context: grpc.ServicerContext, waiting: _Waiting
    ) -> _Message:
        """A call's one request message, waited for as one of ``waiting`` (cut off when it is
        late or older waiters must make room: the call ends CANCELLED). A stream that ends
        without it is INVALID_ARGUMENT; messages after it are not read."""
        request = self._first(requests, context, waiting)
        if request is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carries no request message")
        return request

    def _first(
        self, requests: Iterator[_Message], context: grpc.ServicerContext, waiting: _Waiting
    ) -> _Message | None:
        """The stream's first message (None: it ended without one), waited for as one of
        ``waiting``."""
        ticket = waiting.enter(context, client_key(context))
        if ticket is None:
            self.counters.add("busy")
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "the server holds as many calls waiting for their request as it has threads "
                "for; nothing ran; retry",
            )
        kept = False
        try:
            request = next(requests, None)
        except grpc.RpcError:
            request = None
        finally:
            kept = waiting.leave(ticket)
        if not kept:
            context.abort(grpc.StatusCode.CANCELLED, "the call waited too long for its request")
        return request

    def serve_call(self, request: RemoteRequest | Rejected, context: CallContext) -> RemoteReply:
        """Serve one unary call a transport decoded (a ``Rejected`` for what did not decode):
        rate limit, dispatch, counters; engine failures come back as ErrorInfo, never raised."""
        self.counters.call_started()
        try:
            return self._dispatch(request, context)
        finally:
            self.counters.call_ended()

    def _rate_limited(self, context: CallContext) -> api.ErrorInfo | None:
        limiter = self._limiter
        if limiter is None:
            return None
        retry_after = limiter.take(client_key(context))
        if retry_after is None:
            return None
        self.counters.add("rate_limited")
        return api.ResourceExhausted(
            f"this client is over its rate limit of {limiter.limit.calls_per_s:g} calls/s "
            f"(burst {limiter.limit.burst}); retry in {retry_after:.3f} s",
            details={"resource": "rate_limit", "retry_after_s": retry_after},
        ).to_info()

    def refused_frame(self, error: api.ShardEngineError) -> api.ErrorInfo:
        """The reply to a message a transport refused before decoding it (``error``: too large,
        or malformed), counted as ``oversized`` or ``rejected_frames``."""
        is_oversized = isinstance(error, api.ResourceExhausted)
        self.counters.add("oversized" if is_oversized else "rejected_frames")
        return error.to_info()

    def _guarded(self, run: Callable[[], _Result]) -> _Result | api.ErrorInfo:
        """``run()``, or the ErrorInfo of what it raised (an engine bug included: it must not
        kill the server)."""
        try:
            return run()
        except api.ShardEngineError as error:
            if isinstance(error, api.EngineCrashed | api.NotReady):
                self.refresh_health()
            return error.to_info()
        except Exception as error:  # noqa: BLE001 - an engine bug must not kill the server
            _LOG.exception("the served engine raised %s", type(error).__name__)
            frame = traceback.extract_tb(error.__traceback__)[-1]
            where = f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
            return api.ShardEngineError(
                f"the served engine raised {type(error).__name__}: {error} (at {where})",
                details={"exception": type(error).__name__, "where": where},
            ).to_info()

    def _dispatch(self, request: RemoteRequest | Rejected, context: CallContext) -> RemoteReply:
        if not isinstance(request, api.CancelRequest):
            refused = self._rate_limited(context)
            if refused is not None:
                return refused
        return self._guarded(functools.partial(self._operation, request, context))

    def _operation(self, request: RemoteRequest | Rejected, context: CallContext) -> RemoteReply:
        engine = self.engine
        match request:
            case Rejected(error=error):
                return self.refused_frame(error)
            case ServerStatsQuery():
                return self.stats()
            case CapabilitiesQuery():
                return engine.capabilities()
            case HealthQuery():
                return self._served_health()
            case MetricsQuery():
                return engine.metrics()
            case api.CancelRequest():
                return self._cancel(request, context)
            case api.ReleaseRequest():
                if self._idle is not None:
                    self._idle.forget(request.session.session_id)
                return engine.release(request)
            case api.LoadConfig():
                if not self._allow_load:
                    raise api.InvalidRequest(
                        "this server's engine was loaded when the server started; it takes "
                        "no load requests"
                    )
                self._allow_load = False
                capabilities = engine.load(request)
                self.refresh_health()
                return capabilities
            case api.PrefillRequest():
                return self._compute(request, context, self._watched_op(engine.prefill))
            case api.DecodeRequest():
                return self._compute(request, context, self._watched_op(engine.decode))
            case api.DecodeBatchRequest():
                return self._compute(request, context, self._watched_op(engine.decode_batch))
            case api.ExportSessionRequest() | api.ImportSessionRequest():
                raise api.InvalidRequest(
                    "snapshots travel on their own streams (ExportSession, ImportSession), "
                    "not through Call"
                )
            case _:
                typing.assert_never(request)

    # ----------------------------------------------------------------- snapshot streams

    def serve_export(
        self, request: RemoteRequest | Rejected, context: CallContext
    ) -> Generator[bytes, None, None]:
        """Serve an export stream: the header (or the ErrorInfo of a refusal), then each chunk.
        The transport sends each message and ends the stream (``close()``) when the client
        takes too long (see :meth:`stream_due`); closing it frees its slots at once."""
        self.counters.call_started()
        held = False
        try:
            refused = self._rate_limited(context) or self._take_stream_slots()
            held = refused is None
            reply: api.SessionSnapshot | api.ErrorInfo = (
                refused
                if refused is not None
                else self._guarded(functools.partial(self._export_snapshot, request, context))
            )
            if isinstance(reply, api.ErrorInfo):
                yield encode_header(reply)
                return
            header = SnapshotHeader(
                snapshot=msgspec.structs.replace(reply, chunks=()), n_chunks=len(reply.chunks)
            )
            yield encode_header(header)
            yield from reply.chunks
        finally:
            if held:
                self._release_stream_slots()
            self.counters.call_ended()

    def _grpc_export(
        self, requests: Iterator[RemoteRequest | Rejected], context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        """gRPC waits without a timeout for the client to take each message (flow control):
        one that stops reading would hold the stream's slots for good. A timer cancels the
        RPC when a message is not taken within ``stream_idle_s``, which ends the wait."""

        def cut_off() -> None:
            self.counters.add("transport_cancels")
            context.cancel()

        messages = self.serve_export(self._request(requests, context, self._waiting), context)
        due: float | None = None
        try:
            for message in messages:
                if due is None:
                    header = decode_export_header(message)
                    size = header.snapshot.state_bytes if isinstance(header, SnapshotHeader) else 0
                    due = self.stream_due(size)
                elif time.monotonic() > due:
                    self.counters.add("stalled")
                    context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"the client takes the export slower than {self.stream_rate_words()}",
                    )
                timer = threading.Timer(self.stream_idle_s, cut_off)
                timer.daemon = True
                timer.start()
                try:
                    yield message
                finally:
                    timer.cancel()
        finally:
            messages.close()

    def _export_snapshot(
        self, request: RemoteRequest | Rejected, context: CallContext
    ) -> api.SessionSnapshot:
        if isinstance(request, Rejected):
            raise api.InvalidRequest(self.refused_frame(request.error).message)
        if not isinstance(request, api.ExportSessionRequest):
            raise api.InvalidRequest(
                f"ExportSession takes an ExportSessionRequest, not {type(request).__name__}"
            )
        return self._compute(request, context, self.engine.export_session, slot_held=True)

    def _grpc_import(self, messages: Iterator[bytes], context: grpc.ServicerContext) -> RemoteReply:
        # The header is waited for as a call's request is, before the stream takes its slots:
        # streams that never send one hold no slot, only a waiting place others may evict.
        first = self._first(messages, context, self._waiting)
        head = () if first is None else (first,)
        return self.serve_import(itertools.chain(head, self._watched(messages, context)), context)

    def _watched(self, messages: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """gRPC's request iterator waits without a timeout: a timer cancels the RPC when the
        next message does not arrive within ``stream_idle_s``, which ends the wait."""
        idle = threading.Event()

        def cut_off() -> None:
            idle.set()
            context.cancel()

        while True:
            timer = threading.Timer(self.stream_idle_s, cut_off)
            timer.daemon = True
            timer.start()
            try:
                message = next(messages, None)
            finally:
                timer.cancel()
            if idle.is_set():
                raise StreamBroken(f"no message arrived within {self.stream_idle_s} s")
            if message is None:
                return
            yield message

    def serve_import(self, messages: Iterator[bytes], context: CallContext) -> RemoteReply:
        """Serve an import stream (``messages`` must end, or raise StreamBroken, within
        ``stream_idle_s`` of the previous message: the transport sees to it)."""
        self.counters.call_started()
        held = False
        try:
            refused = self._rate_limited(context) or self._take_stream_slots()
            if refused is not None:
                return refused
            held = True
            return self._guarded(functools.partial(self._import_stream, messages, context))
        finally:
            if held:
                self._release_stream_slots()
            self.counters.call_ended()

    def stream_due(self, size: int) -> float:
        """When a stream of ``size`` bytes starting now must have ended."""
        return time.monotonic() + self.stream_idle_s + size / self.min_stream_bytes_per_s

    def stream_rate_words(self) -> str:
        """The stream rate a client must keep, in words for its error."""
        return (
            f"{self.min_stream_bytes_per_s:g} bytes/s on average (after {self.stream_idle_s:g} "
            "s of grace)"
        )

    def _take_stream_slots(self) -> api.ErrorInfo | None:
        """Take a stream's slot and the compute slot it holds throughout; else the busy
        refusal (retryable)."""
        if self._stream_slots.acquire(blocking=False):
            if self._compute_slots.acquire(blocking=False):
                return None
            self._stream_slots.release()
        return self._busy(
            "the server serves as many snapshot streams as it has threads for"
        ).to_info()

    def _release_stream_slots(self) -> None:
        self._compute_slots.release()
        self._stream_slots.release()

    def _busy(self, message: str) -> api.ResourceExhausted:
        self.counters.add("busy")
        retry_after = self.retry_after_s()
        return api.ResourceExhausted(
            f"{message}; nothing ran; retry in {retry_after:.3f} s",
            details={"resource": "server_threads", "retry_after_s": retry_after},
        )

    def _refused(self) -> api.ShardEngineError:
        """Why the compute queue took no place for a call (nothing of it ran): the server
        drains (NotReady, retryable: another server may take it), or the queue is full
        (ResourceExhausted with ``retry_after_s``)."""
        admission = self._compute_slots
        if admission.draining:
            self.counters.add("drain_refused")
            return api.NotReady(
                "the server is draining (shutting down) and takes no more compute calls; "
                "nothing ran; call another server",
                retryable=True,
                details={"reason": "draining", "resource": "server_queue"},
            )
        return self._queue_full(
            f"the server's queue holds as many calls as it takes ({admission.max_queued} "
            f"waiting for {admission.slots} compute slots)"
        )

    def _queue_full(self, why: str) -> api.ResourceExhausted:
        admission = self._compute_slots
        self.counters.add("busy")
        retry_after = admission.retry_after_s()
        return api.ResourceExhausted(
            f"{why}; nothing ran; retry in {retry_after:.3f} s",
            details={
                "resource": "server_queue",
                "retry_after_s": retry_after,
                "max_queued": admission.max_queued,
            },
        )

    def _left_queue(self, outcome: Outcome, request_id: str) -> api.ShardEngineError:
        """The error of a call that left the compute queue without running."""
        if outcome == "draining":
            return self._refused()
        if outcome == "evicted":
            return self._queue_full(
                "another client's call took this call's place in the server's full queue (the "
                "client with the most calls waiting gives way)"
            )
        how = "was cancelled" if outcome == "cancelled" else "ended"
        return api.Cancelled(
            f"request {request_id!r} {how} while it waited for a compute slot; it never ran",
            details={"reason": outcome, "ran": False},
        )

    def _next_message(self, messages: Iterator[bytes], received: int) -> bytes | None:
        try:
            return next(messages, None)
        except (grpc.RpcError, StreamBroken):
            # The client cancelled, its deadline passed or its connection broke mid-stream.
            self.counters.add("transport_cancels")
            raise api.Cancelled(
                f"the import stream broke after {received} message(s); nothing was imported",
                details={"received_messages": received},
            ) from None

    def _import_stream(
        self, messages: Iterator[bytes], context: CallContext
    ) -> api.ImportSessionResult:
        """Receive the header and every chunk, checking sizes as they come; only a complete,
        well-formed stream reaches ``engine.import_session`` (which verifies the checksum and
        installs atomically). Anything short of that changes nothing."""
        first = self._next_message(messages, 0)
        if first is None:
            raise api.InvalidRequest("the import stream is empty; nothing was imported")
        header = decode_import_header(first)
        if isinstance(header, Rejected):
            self.counters.add("rejected_frames")
            raise header.error
        request, n_chunks = header.request, header.n_chunks
        snapshot = request.snapshot
        if snapshot.chunks:
            raise api.InvalidRequest(
                "an import header carries no chunks: they follow as their own messages",
                details={"field": "ImportHeader.request.snapshot.chunks"},
            )
        # Everything the header shows is checked before a byte of the body is read, and the
        # bytes it announces are reserved against the server's limit for all streams.
        check_import_header(
            self.engine, request, n_chunks, max_snapshot_bytes=self.max_snapshot_bytes
        )
        self._import_budget.reserve(snapshot.state_bytes)
        try:
            return self._import_body(messages, context, request, n_chunks)
        finally:
            self._import_budget.release(snapshot.state_bytes)

    def _import_body(
        self,
        messages: Iterator[bytes],
        context: CallContext,
        request: api.ImportSessionRequest,
        n_chunks: int,
    ) -> api.ImportSessionResult:
        """The chunks of an admitted stream, each checked as it arrives (none larger than a
        chunk, never more bytes or chunks than announced), then the engine's import."""
        snapshot = request.snapshot
        chunks: list[bytes] = []
        total = 0
        due = self.stream_due(snapshot.state_bytes)
        for index in range(n_chunks):
            if time.monotonic() > due:
                self.counters.add("stalled")
                raise api.Cancelled(
                    f"the import stream moved {total} bytes in {index} chunk(s), slower than "
                    f"{self.stream_rate_words()}; nothing was imported",
                    details={"received_bytes": total, "reason": "too_slow"},
                )
            chunk = self._next_message(messages, index + 1)
            if chunk is None:
                raise api.InvalidRequest(
                    f"the import stream ended after {index} of {n_chunks} chunks; nothing was "
                    "imported",
                    details={"received_chunks": index, "n_chunks": n_chunks},
                )
            total += len(chunk)
            if len(chunk) > SNAPSHOT_CHUNK_BYTES:
                raise api.InvalidRequest(
                    f"import chunk {index} holds {len(chunk)} bytes, more than the chunk size "
                    f"of {SNAPSHOT_CHUNK_BYTES}; nothing was imported",
                    details={"field": f"SessionSnapshot.chunks[{index}]"},
                )
            if total > snapshot.state_bytes:
                # What the engine would answer for the assembled snapshot (check_snapshot_
                # integrity), said before the excess is buffered.
                raise api.ChecksumMismatch(
                    f"snapshot state is extended: its chunks hold more than the "
                    f"{snapshot.state_bytes} bytes its header promises; nothing was imported",
                    details={"received_bytes": total, "state_bytes": snapshot.state_bytes},
                )
            chunks.append(chunk)
        if self._next_message(messages, n_chunks + 1) is not None:
            raise api.InvalidRequest(
                f"the import stream carries more than the {n_chunks} chunks it announced; "
                "nothing was imported",
                details={"n_chunks": n_chunks},
            )
        complete = msgspec.structs.replace(
            request, snapshot=msgspec.structs.replace(snapshot, chunks=tuple(chunks))
        )
        import_session = self._watched_op(self.engine.import_session)
        return self._compute(complete, context, import_session, slot_held=True)

    def _served_health(self) -> api.Health:
        """The engine's health, ``degraded`` while the served shard refuses new work for lack
        of room (see ``_idle``)."""
        health = self.engine.health()
        full = None if self._idle is None else self._idle.short_of_room
        if full is None or health.state != "ready":
            return health
        return msgspec.structs.replace(
            health, state="degraded", detail=clamp_text(full, MAX_DETAIL_CHARS)
        )

    def _watched_op(
        self, operation: Callable[[_Request], _Answer]
    ) -> Callable[[_Request], _Answer]:
        """``operation``, its sessions recorded for idle expiry when the server has it."""
        return operation if self._idle is None else self._idle.watch(operation)

    def _compute(
        self,
        request: _Request,
        context: CallContext,
        operation: Callable[[_Request], _Answer],
        *,
        slot_held: bool = False,
    ) -> _Answer:
        """Run ``operation`` (the engine's) on ``request`` as the caller's call: under an id
        of the server's making, unique among every client's requests (request ids are each
        caller's own: two clients may both use "req-1"), with the caller's id put back in the
        result and in the error. A caller's second call with an id it has in flight is
        refused, as the engine refuses it. Without ``slot_held`` the call first takes a compute
        slot, waiting for one in the fair queue (see :mod:`~shard_engine_remote._admission`)
        or refused when it is full; a call that leaves the queue without running (its RPC
        ended, its client cancelled it, another client's call took its place, the server
        drains) raises the error that says so and never reaches the engine."""
        ticket: Ticket | None = None
        if not slot_held:
            ticket = self._compute_slots.enter(client_key(context))
            if ticket is None:
                raise self._refused()
        client = caller_key(context)
        try:
            call = self._in_flight.begin(client, request)
        except BaseException:
            if ticket is not None:
                self._leave_queue(ticket)
            raise
        call.ticket = ticket
        request_id, engine_id = request.request_id, call.engine_id
        finished = threading.Event()

        def on_rpc_end() -> None:
            # Runs when the RPC terminates for any reason; only an RPC that ended before the
            # engine answered (cancelled, deadline, connection lost) cancels the engine work:
            # this call's, by the id no other request has (a call still queued just leaves).
            if not finished.is_set():
                self.counters.add("transport_cancels")
                if ticket is None or not self._compute_slots.withdraw(ticket, "ended"):
                    self.engine.cancel(api.CancelRequest(request_id=engine_id))

        outcome: Outcome | None = None
        try:
            if not context.add_callback(on_rpc_end):
                raise api.Cancelled(f"request {request_id!r} ended before it started")
            if ticket is not None:
                outcome = self._compute_slots.wait(ticket)
                if outcome != "granted":
                    raise self._left_queue(outcome, request_id)
            try:
                answer = operation(msgspec.structs.replace(request, request_id=engine_id))
            except api.ShardEngineError as error:
                raise _as_callers(error, engine_id, request_id) from None
            return _answer_as_callers(answer, engine_id, request_id)
        finally:
            finished.set()
            self._in_flight.end(client, call)
            if ticket is not None:
                if outcome is None:
                    self._leave_queue(ticket)
                elif outcome == "granted":
                    self._compute_slots.done(ticket)

    def _leave_queue(self, ticket: Ticket) -> None:
        """Give up a place never waited for: out of the queue, or its slot back."""
        admission = self._compute_slots
        if not admission.withdraw(ticket, "ended") and admission.wait(ticket) == "granted":
            admission.done(ticket)

    def _cancel(self, request: api.CancelRequest, context: CallContext) -> api.CancelResult:
        """The caller's cancel, translated into engine cancels of only its own requests in
        flight that it names: by request id (a batch's item ids name the batch) or by session.
        The engine's request ids and sessions are every client's, so what a caller names is
        never forwarded as it is: another client's work is never touched, and naming it
        answers ``cancelled=False``, as for a request not in flight."""
        engine = self.engine
        if (request.request_id is None) == (request.session_id is None):
            return engine.cancel(request)  # the engine's own InvalidRequest
        mine = self._in_flight.matching(caller_key(context), request)
        if not mine:
            if engine.health().state in _SERVING_STATES:
                return api.CancelResult(cancelled=False)
            # An engine that is not serving answers as it must (a failed one EngineCrashed),
            # asked about an id no request of anyone's has.
            return engine.cancel(api.CancelRequest(request_id=self._in_flight.unused_id()))
        stopped = 0
        for call in mine:
            ticket = call.ticket
            if ticket is not None and self._compute_slots.withdraw(ticket, "cancelled"):
                stopped += 1  # it waited in the queue: it leaves it, never having run
                continue
            stopped += engine.cancel(api.CancelRequest(request_id=call.engine_id)).n_requests
        return api.CancelResult(cancelled=stopped > 0, n_requests=stopped)

    # grpc.health.v1 answers without a token. Its handlers are request-streaming too, so
    # their wait for the request is bounded (its own _Waiting: health callers cannot evict
    # token holders' calls). Only the services this server serves are answered: the
    # servicer keeps an entry per service watched, which names made up would grow for ever.

    def _health_request(
        self, requests: Iterator[health_pb2.HealthCheckRequest], context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckRequest:
        return self._request(requests, context, self._health_waiting)

    def _health_check(
        self, requests: Iterator[health_pb2.HealthCheckRequest], context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        request = self._health_request(requests, context)
        if request.service not in _HEALTH_SERVICES:
            context.abort(grpc.StatusCode.NOT_FOUND, "this server serves no such service")
        return self._health.Check(request, context)

    def _health_watch(
        self, requests: Iterator[health_pb2.HealthCheckRequest], context: grpc.ServicerContext
    ) -> Iterator[health_pb2.HealthCheckResponse]:
        request = self._health_request(requests, context)
        if request.service not in _HEALTH_SERVICES:
            yield health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            )
            return
        # A watch holds its thread for as long as it lasts: it stays one of the waiting
        # (no time limit), the first to be evicted when a newer health call needs room.
        ticket = self._health_waiting.enter(context, client_key(context), timed=False)
        if ticket is None:
            self.counters.add("busy")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "health checks are busy; retry")
        try:
            yield from self._health.Watch(request, context)
        finally:
            self._health_waiting.leave(ticket)

    def refresh_health(self) -> None:
        """Bring ``grpc.health.v1``'s answer up to date with the engine's health (a transport
        calls it once it serves)."""
        state = self.engine.health().state
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if state in _SERVING_STATES
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        with self._health_lock:
            if status == self._health_status:
                return
            self._health_status = status
            self._health.set("", status)
            self._health.set(SERVICE_NAME, status)


def _served_max_sessions(engine: api.ShardEngine) -> int:
    """The served engine's session limit (16 before it is loaded: a child's engine loads
    through its first call)."""
    try:
        return engine.capabilities().limits.max_sessions
    except api.ShardEngineError:
        return 16


def _connection_limit(wanted: int) -> int:
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


def drain_margin_s(grace: float) -> float:
    """How long before a drain's grace ends the calls still waiting for a compute slot are
    refused (its last fifth, at most its last second): their refusals leave before the
    calls still running are cancelled."""
    return min(1.0, grace / 5)


_HEALTH_SERVICES: Final = frozenset(("", SERVICE_NAME))

_Compute: TypeAlias = (
    api.PrefillRequest
    | api.DecodeRequest
    | api.DecodeBatchRequest
    | api.ExportSessionRequest
    | api.ImportSessionRequest
)
_Request = TypeVar(
    "_Request",
    api.PrefillRequest,
    api.DecodeRequest,
    api.DecodeBatchRequest,
    api.ExportSessionRequest,
    api.ImportSessionRequest,
)
_Answer = TypeVar(
    "_Answer",
    api.BoundaryResult | api.LogitsResult,
    api.DecodeBatchResult,
    api.SessionSnapshot,
    api.ImportSessionResult,
)


def _answer_as_callers(answer: _Answer, engine_id: str, request_id: str) -> _Answer:
    """``answer`` with the caller's request id where the engine put the server's. An answer
    carrying any other id is left as it is: the client's checks refuse it (MalformedOutput)."""
    if isinstance(answer, api.SessionSnapshot) or answer.request_id != engine_id:
        return answer
    return msgspec.structs.replace(answer, request_id=request_id)


def _as_callers(
    error: api.ShardEngineError, engine_id: str, request_id: str
) -> api.ShardEngineError:
    """``error`` saying the caller's request id where it says the server's (its message and
    details), so the server's ids never reach a client."""
    message = error.message
    if isinstance(message, str) and engine_id in message:
        message = message.replace(repr(engine_id), repr(request_id))
        error.message = message.replace(engine_id, request_id)
        error.args = (error.message,)
    for name, value in list(error.details.items()):
        if isinstance(value, str) and engine_id in value:
            error.details[name] = value.replace(engine_id, request_id)
    return error


def _names(request: _Compute) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What else a cancel may name to reach ``request`` besides its id: its batch items' ids,
    and its session(s)."""
    match request:
        case api.DecodeBatchRequest():
            return (
                tuple(item.request_id for item in request.items),
                tuple(item.session.session_id for item in request.items),
            )
        case api.ImportSessionRequest():
            return (), (request.snapshot.session.session_id,)
        case _:
            return (), (request.session.session_id,)


class _Waiting:
    """Calls that hold one of the server's threads while they wait on their peer (for their
    request message, or a health Watch for as long as it lasts): at most ``capacity`` at once,
    for at most ``limit_s`` each (a Watch: no limit).

    gRPC's sync server gives each call a pool thread as it starts and waits there for the
    request message, without a timeout. Here that wait is bounded: a call whose message is
    ``limit_s`` late is cancelled, and when ``capacity`` calls wait, a new call cancels the
    oldest waiter of the peer holding the most places among those whose oldest has waited
    ``grace_s`` (a message that late is not merely queued behind a burst of others); when
    there is none, the new call is refused (None: the caller answers busy, retryable, nothing
    ran). A well-behaved client's message follows its headers at once: whoever keeps calls
    waiting loses them, and can keep others out only by opening ``capacity`` new calls every
    ``grace_s``. One sweeper thread (started with the server) enforces the time limit;
    entering and leaving cost a lock and dict updates, no thread or timer per call."""

    def __init__(self, capacity: int, limit_s: float, on_cut: Callable[[], None]) -> None:
        self.capacity = capacity
        self.limit_s = limit_s
        self.grace_s = min(1.0, limit_s / 2)
        self._on_cut = on_cut
        self._condition = threading.Condition()
        # peer -> ticket -> (entered, deadline, context), oldest first; and ticket -> peer.
        self._peers: dict[str, OrderedDict[int, tuple[float, float, grpc.ServicerContext]]] = {}
        self._owners: dict[int, str] = {}
        self._tickets = itertools.count()
        self._running = False
        self._sweeper: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._owners)

    def enter(self, context: grpc.ServicerContext, peer: str, *, timed: bool = True) -> int | None:
        """Count ``context`` as waiting for ``peer``; returns the ticket :meth:`leave` takes,
        or None when the call is refused (every place taken, none by a waiter ``grace_s``
        old)."""
        now = time.monotonic()
        deadline = now + self.limit_s if timed else float("inf")
        evicted: grpc.ServicerContext | None = None
        ticket = next(self._tickets)
        with self._condition:
            if len(self._owners) >= self.capacity:
                stale = now - self.grace_s
                holders = [
                    key
                    for key, waiters in self._peers.items()
                    if next(iter(waiters.values()))[0] <= stale
                ]
                if not holders:
                    return None
                biggest = max(holders, key=lambda key: len(self._peers[key]))
                victims = self._peers[biggest]
                victim, (_, _, evicted) = victims.popitem(last=False)
                del self._owners[victim]
                if not victims:
                    del self._peers[biggest]
            mine = self._peers.get(peer)
            if mine is None:
                mine = self._peers[peer] = OrderedDict()
            mine[ticket] = (now, deadline, context)
            self._owners[ticket] = peer
        if evicted is not None:
            self._cut(evicted)
        return ticket

    def leave(self, ticket: int) -> bool:
        """Stop counting a waiter; False when it was cut off already (it is being cancelled:
        the call must not go on, even when its message arrived meanwhile)."""
        with self._condition:
            return self._pop(ticket) is not None

    def _pop(self, ticket: int) -> grpc.ServicerContext | None:
        peer = self._owners.pop(ticket, None)
        if peer is None:
            return None
        waiters = self._peers[peer]
        _, _, context = waiters.pop(ticket)
        if not waiters:
            del self._peers[peer]
        return context

    def _cut(self, context: grpc.ServicerContext) -> None:
        self._on_cut()
        context.cancel()

    def start(self) -> None:
        with self._condition:
            if self._running:
                return
            self._running = True
        self._sweeper = threading.Thread(target=self._sweep, name="engine-rpc-waiting", daemon=True)
        self._sweeper.start()

    def stop(self) -> None:
        with self._condition:
            self._running = False
            self._condition.notify_all()
        if self._sweeper is not None:
            self._sweeper.join()

    def _sweep(self) -> None:
        while True:
            expired: list[grpc.ServicerContext] = []
            with self._condition:
                if not self._running:
                    return
                now = time.monotonic()
                due = now + self.limit_s
                late: list[int] = []
                for waiters in self._peers.values():
                    for ticket, (_, deadline, _) in waiters.items():
                        if deadline <= now:
                            late.append(ticket)
                        else:
                            due = min(due, deadline)
                for ticket in late:
                    context = self._pop(ticket)
                    if context is not None:
                        expired.append(context)
                # A waiter entering later is due no earlier than now + limit_s: sleeping
                # until the earliest deadline known (or limit_s) never oversleeps one.
                if not expired:
                    self._condition.wait(due - now)
            for context in expired:
                self._cut(context)


@dataclass(slots=True, eq=False)
class _Call:
    """One compute call in flight: the caller's request id, the id the engine knows it by, and
    what else a cancel may name to reach it (its batch items' ids, its sessions)."""

    request_id: str
    engine_id: str
    item_ids: tuple[str, ...]
    session_ids: tuple[str, ...]
    ticket: Ticket | None = None
    """Its place in the compute queue (None: a stream's call, which holds its slot)."""


class _InFlight:
    """Each caller's (see :func:`caller_key`) compute calls in flight, by the caller's request
    id.

    Request ids are the caller's own: the engine runs each call under an id the server makes,
    unique among all clients' requests, so two clients using the same id never collide, and a
    caller's second call with an id it has in flight is refused (as the engine refuses one).
    A cancel reaches only the caller's own work, as a local engine's cancel reaches only
    requests made through that engine: the server cancels in the engine exactly the caller's
    calls the cancel names; one client guessing (or sharing) another's request id or session
    id cannot stop the other's work, and learns nothing (the answer is the one for a request
    that is not in flight: ``cancelled=False``). Sessions themselves are the served engine's,
    shared by every client holding the server's token (see the package README)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, dict[str, _Call]] = {}
        self._serial = itertools.count(1)

    def begin(self, client: str, request: _Compute) -> _Call:
        """Register ``request`` as ``client``'s; InvalidRequest when the client has a call
        with its request id in flight."""
        request_id = request.request_id
        item_ids, session_ids = _names(request)
        with self._lock:
            calls = self._calls.get(client)
            if calls is None:
                calls = self._calls[client] = {}
            elif request_id in calls:
                raise api.InvalidRequest(f"request_id {request_id!r} is already in flight")
            # The serial makes it unique; the caller's id (cut to fit) makes the engine's
            # logs readable.
            engine_id = f"{next(self._serial)}:{request_id}"[:MAX_ID_CHARS]
            call = calls[request_id] = _Call(request_id, engine_id, item_ids, session_ids)
        return call

    def end(self, client: str, call: _Call) -> None:
        with self._lock:
            calls = self._calls.get(client)
            if calls is not None and calls.get(call.request_id) is call:
                del calls[call.request_id]
                if not calls:
                    del self._calls[client]

    def matching(self, client: str, request: api.CancelRequest) -> list[_Call]:
        """``client``'s calls in flight that ``request`` (naming exactly one of a request id
        and a session) names."""
        with self._lock:
            calls = self._calls.get(client)
            if not calls:
                return []
            request_id = request.request_id
            if request_id is not None:
                return [
                    call
                    for call in calls.values()
                    if call.request_id == request_id or request_id in call.item_ids
                ]
            session_id = request.session_id
            return [call for call in calls.values() if session_id in call.session_ids]

    def unused_id(self) -> str:
        """An engine request id no call was or will be given."""
        with self._lock:
            return f"{next(self._serial)}:"


_SIGNAL_POLL_S: Final = 0.05
"""How often the serving loop looks for a signal its handler recorded."""
_DRAIN_QUIET_S: Final = 0.1
"""How long a draining gRPC server, its compute calls done, must see no new call before it
stops taking them (until then they get the drain's typed refusal)."""


def serve_until_signalled(
    server: Serving,
    *,
    drain_seconds: float = 10.0,
    stop: threading.Event | None = None,
    on_stopped: Callable[[], None] | None = None,
) -> int | None:
    """Block until SIGTERM, SIGHUP or SIGINT (or ``stop`` is set), then drain in-flight calls
    for up to ``drain_seconds``, close the engine and return the first signal received (None
    when ``stop`` ended it). Call from the main thread. SIGHUP drains too: a closed terminal or
    a service manager's hang-up must not kill a server mid-call."""
    stop = stop or threading.Event()
    signalled: list[int] = []

    def handle(signum: int, frame: FrameType | None) -> None:
        # No lock here (not even Event.set's): a second signal runs this handler again on
        # the same thread, inside the first, and would wait for good on a lock it holds (a
        # supervisor sends SIGTERM twice: once to ask, once from its stop).
        signalled.append(signum)

    previous = {
        sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    }
    try:
        while not signalled and not stop.wait(_SIGNAL_POLL_S):
            pass
        server.stop(drain_seconds)
    finally:
        # The handlers stay until the engine is closed: a repeated SIGTERM must not kill the
        # process halfway through closing it.
        try:
            server.engine.close()
            if on_stopped is not None:
                on_stopped()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return signalled[0] if signalled else None
