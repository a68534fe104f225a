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
import itertools
import logging
import threading
import time
import traceback
import typing
from collections.abc import Callable, Generator, Iterator
from concurrent import futures
from pathlib import Path
from typing import Final, TypeVar

import grpc
import msgspec

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_api.wire import MAX_DETAIL_CHARS, SNAPSHOT_CHUNK_BYTES, clamp_text
from shard_engine_remote._admission import DEFAULT_MAX_QUEUED, Admission, Outcome, Ticket
from shard_engine_remote._callers import (
    CallContext,
    InFlight,
    answer_as_callers,
    as_callers,
    caller_key,
    client_key,
)
from shard_engine_remote._counters import ServerCounters
from shard_engine_remote._grpc_health import SERVING_STATES, GrpcHealth
from shard_engine_remote._grpc_options import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    refuse,
    server_options,
)
from shard_engine_remote._idle import IdleSessions, served_max_sessions
from shard_engine_remote._import_limits import (
    DEFAULT_MAX_IMPORT_BYTES,
    ImportBudget,
    check_import_header,
)
from shard_engine_remote._latency import CallLatency, operation_of
from shard_engine_remote._ratelimit import RateLimit, RateLimiter
from shard_engine_remote._security import BearerTokenInterceptor, ServerSecurity
from shard_engine_remote._waiting import Waiting
from shard_engine_remote._wire import (
    SERVICE_NAME,
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
    "DEFAULT_CONNECTION_IDLE_S",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_MAX_SNAPSHOT_BYTES",
    "DEFAULT_MAX_WORKERS",
    "DEFAULT_MIN_STREAM_BYTES_PER_S",
    "DEFAULT_STREAM_IDLE_S",
    "EngineServer",
    "Serving",
    "StreamBroken",
    "drain_margin_s",
]

DEFAULT_MAX_WORKERS: Final = 16
"""Threads serving calls when ``max_workers`` is not given (then single decodes also get decode
slots up to the engine's session limit, see :class:`EngineServer`)."""
DEFAULT_MAX_MESSAGE_BYTES: Final = wire.DEFAULT_MAX_PAYLOAD_BYTES + (1 << 20)
"""The largest message either side accepts: the codec's payload limit plus room for headers."""

DEFAULT_CONNECTION_IDLE_S: Final = 300.0
"""How long a connection (gRPC or framed) without calls stays open (its client reconnects when
it next calls)."""
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


class StreamBroken(Exception):
    """A client's stream ended before its end: abandoned, or its connection lost."""


class Serving(typing.Protocol):
    """A server of one engine, whichever transport it speaks."""

    @property
    def engine(self) -> api.ShardEngine: ...

    def stop(self, grace: float | None = 10.0) -> None: ...


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


def _check_settings(
    *, max_workers: int, max_queued: int, max_connections: int, positive: dict[str, float]
) -> None:
    """InvalidRequest for a server setting out of its range (nothing is started)."""
    if max_workers < 5:
        raise api.InvalidRequest(f"max_workers must be >= 5, got {max_workers}")
    if max_queued < 0:
        raise api.InvalidRequest(f"max_queued must be >= 0, got {max_queued}")
    if max_connections < 1:
        raise api.InvalidRequest(f"max_connections must be >= 1, got {max_connections}")
    for name, value in positive.items():
        if not value > 0:
            raise api.InvalidRequest(f"{name} must be > 0, got {value}")


class EngineServer:
    """Serves ``engine`` on one address. ``allow_load`` lets the first client load it (the
    private socket of a spawned child); a server started on a loaded engine refuses loads.

    ``max_workers`` threads serve calls; at most ``max_workers - 4`` of them compute at once so
    cancel, release, health and metrics are never starved. Without ``max_workers`` (16
    threads), single decodes may also reach the engine as many at once as it has sessions
    (``max_sessions``, the most its scheduler runs as one forward) once it is loaded: the
    slots beyond 12 are decode slots, each taken from the queue's places (see
    ``Admission.widen``; the threads calls may hold stay as many), while prefills and batches
    still get 12 and wait fairly beyond. Fewer slots than callers decoding at once would split
    them: 16 callers of a spawned child given 12 calls at once ran as forwards of 12 and of 4
    in turn, at 0.45 of llama.cpp's own batch(16) (gemma3-270m). Compute calls beyond those
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
        max_workers: int | None = None,
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
        self._slots_follow_engine = max_workers is None
        if max_workers is None:
            max_workers = DEFAULT_MAX_WORKERS
        _check_settings(
            max_workers=max_workers,
            max_queued=max_queued,
            max_connections=max_connections,
            positive={
                "stream_idle_s": stream_idle_s,
                "handshake_timeout_s": handshake_timeout_s,
                "connection_idle_s": connection_idle_s,
                "min_stream_bytes_per_s": min_stream_bytes_per_s,
            },
        )
        self.stream_idle_s = stream_idle_s
        self.min_stream_bytes_per_s = min_stream_bytes_per_s
        self.engine = engine
        self.max_workers = max_workers
        self.max_message_bytes = max_message_bytes
        self.security = security or ServerSecurity()
        self.counters = ServerCounters()
        self.latency = CallLatency()
        """Each operation's call latency and queue wait (see :mod:`._latency`)."""
        self.address: str | None = None
        self._allow_load = allow_load
        self.max_snapshot_bytes = max_snapshot_bytes
        self._import_budget = ImportBudget(max_import_bytes)
        self._idle: IdleSessions | None = None
        if session_idle_s is not None:
            self._idle = IdleSessions(
                engine, session_idle_s, max_sessions=served_max_sessions(engine)
            )
        self._limiter = None if rate_limit is None else RateLimiter(rate_limit, clock)
        self.max_queued = max_queued
        self._compute_slots = Admission(max_workers - 4, max_queued)
        self.counters.queue = self._compute_slots.stats
        self._follow_engine()
        self._stream_slots = Admission(
            max(1, (max_workers - 4) // 2), max_queued // _STREAM_QUEUE_SHARE
        )
        """Snapshot streams at once (half the compute slots), and those waiting for one of
        them, fair per client as compute calls are (see :meth:`_take_stream_slots`)."""
        self.counters.streams = self._stream_slots.waiting
        self._in_flight = InFlight()
        self._waiting = Waiting(
            4 * max_workers, stream_idle_s, functools.partial(self.counters.add, "stalled")
        )
        self._grpc_health = GrpcHealth(
            self._request, functools.partial(self.counters.add, "stalled"), self.counters.add
        )
        self._server = self._grpc_server(
            max_connections=max_connections,
            handshake_timeout_s=handshake_timeout_s,
            connection_idle_s=connection_idle_s,
        )

    def _grpc_server(
        self, *, max_connections: int, handshake_timeout_s: float, connection_idle_s: float
    ) -> grpc.Server:
        """The gRPC server: its thread pool, limits and options, and the service's methods
        (``start`` binds and starts it)."""
        limit, workers, queued = self.max_message_bytes, self.max_workers, self.max_queued
        interceptors: list[grpc.ServerInterceptor] = []
        if self.security.token:
            interceptors.append(
                BearerTokenInterceptor(
                    self.security.token, functools.partial(self.counters.add, "unauthenticated")
                )
            )
        # Calls waiting in the compute queue, and streams in theirs, hold a thread each,
        # beyond max_workers.
        threads = (
            workers
            + queued
            + self._stream_slots.max_queued
            + self._waiting.capacity
            + self._grpc_health.waiting.capacity
        )
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="engine-rpc"),
            interceptors=interceptors,
            options=server_options(
                limit,
                # Twice the threads, and at least as many as the engine is given compute
                # calls at once and 4 control calls: one worker's sessions decoding at once
                # must all reach it, and its cancel too.
                streams_per_connection=max(2 * workers, self._widest_compute_slots() + 4),
                max_connections=max_connections,
                handshake_timeout_s=handshake_timeout_s,
                connection_idle_s=connection_idle_s,
            ),
            maximum_concurrent_rpcs=workers * 8 + queued,
        )
        # Request-streaming handlers for unary calls (the same on the wire): the wait for
        # the request message is ours, bounded (see Waiting).
        handler: grpc.RpcMethodHandler[RemoteRequest | Rejected, RemoteReply]
        handler = grpc.stream_unary_rpc_method_handler(
            self._grpc_call,
            request_deserializer=functools.partial(decode_request, max_bytes=limit),
            response_serializer=encode_reply,
        )
        export: grpc.RpcMethodHandler[RemoteRequest | Rejected, bytes]
        export = grpc.stream_stream_rpc_method_handler(
            self._grpc_export,
            request_deserializer=functools.partial(decode_request, max_bytes=limit),
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
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, methods),)
        )
        server.add_generic_rpc_handlers((self._grpc_health.handler(),))
        return server

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
        self._grpc_health.waiting.start()
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
        self._grpc_health.enter_graceful_shutdown()
        self.refuse_new_calls()
        remaining = None
        if grace is not None:
            deadline = time.monotonic() + grace
            refuse_queued = deadline - drain_margin_s(grace)
            calls = self.counters.calls
            self._compute_slots.wait_idle(refuse_queued)
            self._stream_slots.wait_idle(refuse_queued)
            while calls != self.counters.calls and time.monotonic() < refuse_queued:
                calls = self.counters.calls
                time.sleep(max(0.0, min(_DRAIN_QUIET_S, refuse_queued - time.monotonic())))
            remaining = max(0.0, deadline - time.monotonic())
        self.refuse_queued_calls()
        self._server.stop(remaining).wait()
        self._waiting.stop()
        self._grpc_health.waiting.stop()
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
        self._stream_slots.close()

    def refuse_queued_calls(self) -> int:
        """The drain's grace is nearly over: refuse every compute call still waiting for a
        slot (and every snapshot stream waiting for a stream slot), as
        :meth:`refuse_new_calls` refuses new ones, before calls still running are cancelled.
        Returns how many were waiting."""
        return self._compute_slots.drain() + self._stream_slots.drain()

    @property
    def compute_slots(self) -> int:
        """How many compute calls the engine may be given at once now (single decodes: other
        calls get ``max_workers - 4``)."""
        admission = self._compute_slots
        return admission.slots + admission.decode_slots

    def _widest_compute_slots(self) -> int:
        """:attr:`compute_slots`, or, while the slots are still to follow an engine that is not
        loaded (a spawned child's, an in-process server's: its client loads it), the most they
        may widen to. gRPC fixes a connection's stream limit when the server starts: at twice
        the threads (32), one worker's 39 sessions decoding at once on a child never all
        reached its engine."""
        if self._slots_follow_engine and not self._engine_loaded():
            return self.compute_slots + self._compute_slots.widenable
        return self.compute_slots

    def _engine_loaded(self) -> bool:
        return self.engine.health().state in ("ready", "degraded")

    def _follow_engine(self, capabilities: api.Capabilities | None = None) -> None:
        """Without ``max_workers`` given: as many single decodes at once as the loaded
        engine's ``max_sessions`` (nothing while it is not loaded: a child's engine loads
        through its first call, which calls this again with what the load returned). An
        engine not loaded is never asked for its capabilities: its refusal would count in its
        metrics."""
        if not self._slots_follow_engine:
            return
        if capabilities is None:
            if not self._engine_loaded():
                return
            try:
                capabilities = self.engine.capabilities()
            except api.ShardEngineError:
                return
        self._compute_slots.widen(capabilities.limits.max_sessions)

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
        self, requests: Iterator[_Message], context: grpc.ServicerContext, waiting: Waiting
    ) -> _Message:
        """A call's one request message, waited for as one of ``waiting`` (cut off when it is
        late or older waiters must make room: the call ends CANCELLED). A stream that ends
        without it is INVALID_ARGUMENT; messages after it are not read."""
        request = self._first(requests, context, waiting)
        if request is None:
            refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "no_request",
                "the call carries no request message",
            )
        return request

    def _first(
        self, requests: Iterator[_Message], context: grpc.ServicerContext, waiting: Waiting
    ) -> _Message | None:
        """The stream's first message (None: it ended without one), waited for as one of
        ``waiting``."""
        ticket = waiting.enter(context, client_key(context))
        if ticket is None:
            self.counters.add("busy")
            refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "busy",
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
        started = time.perf_counter()
        self.counters.call_started()
        try:
            return self._dispatch(request, context)
        finally:
            self.counters.call_ended()
            self.latency.record_call(operation_of(request), time.perf_counter() - started)

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
                self._follow_engine(capabilities)
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
        started = time.perf_counter()
        self.counters.call_started()
        held: _StreamHold | None = None
        try:
            refused = self._rate_limited(context)
            if refused is None:
                taken = self._take_stream_slots(context)
                refused, held = (taken, None) if isinstance(taken, api.ErrorInfo) else (None, taken)
            reply: api.SessionSnapshot | api.ErrorInfo = (
                refused
                if refused is not None
                else self._guarded(functools.partial(self._export_snapshot, request, context))
            )
            self.latency.record_call("export", time.perf_counter() - started)
            if isinstance(reply, api.ErrorInfo):
                yield encode_header(reply)
                return
            header = SnapshotHeader(
                snapshot=msgspec.structs.replace(reply, chunks=()), n_chunks=len(reply.chunks)
            )
            yield encode_header(header)
            yield from reply.chunks
        finally:
            if held is not None:
                self._release_stream_slots(held)
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
                    refuse(
                        context,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        "too_slow",
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
        started = time.perf_counter()
        self.counters.call_started()
        held: _StreamHold | None = None
        try:
            refused = self._rate_limited(context)
            if refused is not None:
                return refused
            taken = self._take_stream_slots(context)
            if isinstance(taken, api.ErrorInfo):
                return taken
            held = taken
            return self._guarded(functools.partial(self._import_stream, messages, context))
        finally:
            if held is not None:
                self._release_stream_slots(held)
            self.counters.call_ended()
            self.latency.record_call("import", time.perf_counter() - started)

    def stream_due(self, size: int) -> float:
        """When a stream of ``size`` bytes starting now must have ended."""
        return time.monotonic() + self.stream_idle_s + size / self.min_stream_bytes_per_s

    def stream_rate_words(self) -> str:
        """The stream rate a client must keep, in words for its error."""
        return (
            f"{self.min_stream_bytes_per_s:g} bytes/s on average (after {self.stream_idle_s:g} "
            "s of grace)"
        )

    def _take_stream_slots(self, context: CallContext) -> _StreamHold | api.ErrorInfo:
        """Take a stream slot, then the compute slot the stream holds throughout, waiting for
        each in its fair queue as a compute call does; else the refusal: the streams' queue
        is full (retryable, with ``retry_after_s`` from recent streams' durations), the
        compute queue is full or the server drains, or the stream ended while it waited.
        Streams that found every compute slot busy were refused, and under concurrent decodes
        most of them were: 40 threads mixing decodes with exports on one spawned child had 234
        of 326 exports refused. Streams beyond their slots were refused too, with the compute
        queue's estimate: 64 threads exporting (20 ms streams, 6 stream slots) sent their
        exports 11,404 times for 256 exports, and took 5.6 s."""
        client = client_key(context)
        streams, admission = self._stream_slots, self._compute_slots
        stream = streams.enter(client)
        if stream is None:
            return self._streams_refused().to_info()
        waiting = [(streams, stream)]

        def ended() -> None:  # the stream ended: a waiting one leaves its queue
            for queue, ticket in list(waiting):
                queue.withdraw(ticket, "ended")

        if not context.add_callback(ended):  # the stream ended before it waited
            self._leave_queue(stream, streams)
            return self._left_queue("ended", "snapshot stream").to_info()
        outcome = streams.wait(stream)
        if outcome != "granted":
            return self._left_queue(outcome, "snapshot stream").to_info()
        ticket = admission.enter(client)
        if ticket is None:
            streams.done(stream)
            return self._refused().to_info()
        waiting.append((admission, ticket))
        outcome = admission.wait(ticket)
        if outcome != "granted":
            streams.done(stream)
            return self._left_queue(outcome, "snapshot stream").to_info()
        return _StreamHold(stream, ticket)

    def _release_stream_slots(self, held: _StreamHold) -> None:
        self._compute_slots.done(held.compute)
        self._stream_slots.done(held.stream)

    def _streams_refused(self) -> api.ShardEngineError:
        """Why the streams' queue took no place for a stream (nothing of it ran)."""
        streams = self._stream_slots
        if streams.draining:
            return self._refused()
        self.counters.add("busy")
        retry_after = streams.retry_after_s()
        return api.ResourceExhausted(
            f"the server holds as many snapshot streams as it serves and queues "
            f"({streams.slots} at once, {streams.max_queued} waiting); nothing ran; retry in "
            f"{retry_after:.3f} s",
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

    def refresh_health(self) -> None:
        """Bring ``grpc.health.v1``'s answer up to date with the engine's health (a transport
        calls it once it serves)."""
        self._grpc_health.refresh(self.engine.health().state)

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
        asked = time.perf_counter()
        if not slot_held:
            ticket = self._compute_slots.enter(
                client_key(context), decode=isinstance(request, api.DecodeRequest)
            )
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
            self.latency.record_wait(operation_of(request), time.perf_counter() - asked)
            if outcome is not None and outcome != "granted":
                raise self._left_queue(outcome, request_id)
            try:
                answer = operation(msgspec.structs.replace(request, request_id=engine_id))
            except api.ShardEngineError as error:
                raise as_callers(error, engine_id, request_id) from None
            return answer_as_callers(answer, engine_id, request_id)
        finally:
            finished.set()
            self._in_flight.end(client, call)
            if ticket is not None:
                if outcome is None:
                    self._leave_queue(ticket)
                elif outcome == "granted":
                    self._compute_slots.done(ticket)

    def _leave_queue(self, ticket: Ticket, admission: Admission | None = None) -> None:
        """Give up a place never waited for: out of the queue, or its slot back (the compute
        queue's unless ``admission`` names another)."""
        admission = self._compute_slots if admission is None else admission
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
            if engine.health().state in SERVING_STATES:
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


def drain_margin_s(grace: float) -> float:
    """How long before a drain's grace ends the calls still waiting for a compute slot are
    refused (its last fifth, at most its last second): their refusals leave before the
    calls still running are cancelled."""
    return min(1.0, grace / 5)


_DRAIN_QUIET_S: Final = 0.1
"""How long a draining gRPC server, its compute calls done, must see no new call before it
stops taking them (until then they get the drain's typed refusal)."""

_STREAM_QUEUE_SHARE: Final = 4
"""Snapshot streams waiting for a stream slot: this share of the compute queue's places (64
of 256). Each holds a server thread while it waits, as a queued compute call does."""


class _StreamHold(typing.NamedTuple):
    """A snapshot stream's places: its stream slot and the compute slot it holds."""

    stream: Ticket
    compute: Ticket
