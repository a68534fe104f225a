"""The gRPC link's failures, each through a real loopback server: the server's own refusals
are told apart by the reason in their trailing metadata, grpcio's own failures (a size limit on
either side, its server's call limit, a connection never made) by the one table of grpcio's
words, and everything else by its status code; the framed transport says the same for the same
refusal."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import cast

import grpc
import msgspec
import pytest
from conftest import (
    RemoteFactory,
    ServeFactory,
    config,
    fill,
    free_port,
    prefill,
    sessions_at_once,
    slow_reader_channel,
    wait_until,
)

import shard_engine_api as api
from shard_engine_remote import ClientSecurity, OutcomeUnknown, ServerSecurity
from shard_engine_remote._framed.client import _ERROR_REASONS
from shard_engine_remote._grpc_link import (
    _SERVER_REFUSALS,
    REFUSED_STREAM_RETRY_S,
    GrpcLink,
    map_grpc_failures,
)
from shard_engine_remote._grpc_options import REFUSAL_METADATA_KEY
from shard_engine_remote._link import LinkFailure
from shard_engine_remote._wire import (
    CALL_METHOD,
    EXPORT_METHOD,
    SERVICE_NAME,
    CapabilitiesQuery,
    encode_request,
)

_OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
TOKEN = "t" * 32


def _fails(
    target: str, message: bytes, *, max_message_bytes: int = 1 << 20, token: str | None = None
) -> LinkFailure:
    """How one call of ``message`` on a new link to ``target`` fails."""
    link = GrpcLink(target, ClientSecurity(token=token), max_message_bytes)
    try:
        link.call(message, timeout=30)
    except LinkFailure as failure:
        return failure
    finally:
        link.close()
    raise AssertionError("the call did not fail")


def _refusal(error: grpc.RpcError) -> str | None:
    trailers = cast(grpc.Call, error).trailing_metadata() or ()
    return next((str(value) for key, value in trailers if key == REFUSAL_METADATA_KEY), None)


def test_the_servers_refusals_mean_what_the_framed_transports_do() -> None:
    """A refusal the two transports share maps to the same reason and "may have run": busy
    (nothing ran) and an export taken too slowly (it ran)."""
    assert _SERVER_REFUSALS["busy"] == _ERROR_REASONS["RESOURCE_EXHAUSTED"]
    assert _SERVER_REFUSALS["too_slow"] == _ERROR_REASONS["DEADLINE_EXCEEDED"]


class _Silent:
    """Calls whose request message never comes until ``close``, on connections of their own
    (each connection takes ``2 * max_workers`` calls at once)."""

    def __init__(self, address: str, per_connection: int, connections: int) -> None:
        self.release = threading.Event()
        self.channels = [
            grpc.insecure_channel(address, options=_OWN_CONNECTION) for _ in range(connections)
        ]
        self.calls: list[grpc.Future] = []  # type: ignore[type-arg]
        for channel in self.channels:
            call: grpc.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(CALL_METHOD)
            for _ in range(per_connection):
                self.calls.append(call.future(self._nothing(), timeout=60))

    def _nothing(self) -> Iterator[bytes]:
        self.release.wait(60)
        yield from ()

    def close(self) -> None:
        self.release.set()
        for channel in self.channels:
            channel.close()


def test_busy_is_the_servers_own_refusal(serve: ServeFactory, remote: RemoteFactory) -> None:
    """Every place for calls waiting for their request taken (none old enough to give way):
    the server refuses the next call RESOURCE_EXHAUSTED with ``busy`` in its trailers, which
    the link maps to busy, not sent, and the remote engine to a retryable ResourceExhausted."""
    server = serve(max_workers=5, stream_idle_s=60.0)
    assert server.address is not None
    server._waiting.grace_s = 3600.0  # no waiter gives way: the refusal, deterministically
    engine = remote(config(target=server.address, retry_busy=False))
    capacity = server._waiting.capacity
    silent = _Silent(server.address, per_connection=capacity // 2, connections=2)
    try:
        wait_until(lambda: len(server._waiting) == capacity)
        failure = _fails(server.address, encode_request(CapabilitiesQuery()))
        assert (failure.reason, failure.sent, failure.status) == (
            "busy",
            False,
            "RESOURCE_EXHAUSTED",
        )
        with pytest.raises(api.ResourceExhausted) as refused:
            prefill(engine)
        assert refused.value.retryable
        assert refused.value.details["resource"] == "server_calls"
        assert server.engine.health().sessions == 0
    finally:
        silent.close()


def test_a_call_without_its_request_is_refused_as_such(serve: ServeFactory) -> None:
    """A call whose stream ends without a request message: INVALID_ARGUMENT with
    ``no_request`` in its trailers; nothing ran."""
    server = serve()
    assert server.address is not None
    with grpc.insecure_channel(server.address) as channel:
        call: grpc.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(CALL_METHOD)
        with pytest.raises(grpc.RpcError) as raised:
            call(iter(()), timeout=30)
        assert _refusal(raised.value) == "no_request"
        with pytest.raises(LinkFailure) as mapped, map_grpc_failures():
            call(iter(()), timeout=30)
    assert (mapped.value.reason, mapped.value.sent) == ("transport_error", False)


def test_an_export_taken_too_slowly_is_the_servers_own_deadline(
    serve: ServeFactory, remote: RemoteFactory
) -> None:
    """A client taking an export's chunks one every 0.6 s (inside the 2 s idle limit) past the
    stream's due time: DEADLINE_EXCEEDED with ``too_slow`` in its trailers (the export ran)."""
    load = api.LoadConfig(shard=config().shard, max_context=8192)
    server = serve(load, max_workers=5, stream_idle_s=2.0, min_stream_bytes_per_s=1e12)
    assert server.address is not None
    worker = remote(api.LoadConfig(shard=load.shard, options={"target": server.address}))
    session = api.SessionRef(session_id="big", epoch=1)
    fill(worker, session, 5988)
    request = api.ExportSessionRequest(request_id="e", session=session)
    channel = slow_reader_channel(server.address)
    try:
        export: grpc.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(EXPORT_METHOD)
        stream = export(encode_request(request), timeout=60)
        with pytest.raises(LinkFailure) as mapped, map_grpc_failures():
            _take_slowly(stream)
    finally:
        channel.close()
    assert (mapped.value.reason, mapped.value.sent) == ("deadline_exceeded", True)
    assert mapped.value.status == "DEADLINE_EXCEEDED"
    assert server.stats().stalled == 1


def _take_slowly(stream: Iterator[bytes]) -> None:
    for _ in stream:
        time.sleep(0.6)


def test_a_request_over_this_sides_limit_never_leaves(serve: ServeFactory) -> None:
    """grpcio refuses to send a message over this channel's limit: request_too_large, not
    sent (grpcio's own words: "CLIENT: Sent message larger than max")."""
    server = serve()
    assert server.address is not None
    failure = _fails(server.address, bytes(4096), max_message_bytes=2048)
    assert (failure.reason, failure.sent) == ("request_too_large", False)
    assert server.stats().calls == 0


def test_a_request_over_the_servers_grpc_limit_is_refused_unread(serve: ServeFactory) -> None:
    """Beyond twice the server's message limit its grpcio refuses the request unread:
    request_too_large, not sent (grpcio's words: "SERVER: Received message larger than max");
    the remote engine raises a ResourceExhausted that is not retryable."""
    server = serve(max_message_bytes=4096)
    assert server.address is not None
    failure = _fails(server.address, bytes(3 * 4096))
    assert (failure.reason, failure.sent) == ("request_too_large", False)
    assert server.stats().calls == 0


def test_a_reply_over_the_servers_send_limit_may_have_run(
    serve: ServeFactory, remote: RemoteFactory
) -> None:
    """A head's prefill whose bundle is over the server's own message limit: the server's
    grpcio refuses to send the reply, but the prefill ran (the session holds it), so
    OutcomeUnknown, never a refusal saying nothing ran."""
    server = serve(config(0, 2), max_message_bytes=4096)
    assert server.address is not None
    engine = remote(config(0, 2, target=server.address))
    with pytest.raises(OutcomeUnknown) as raised:
        prefill(engine, tuple(range(1, 400)))
    assert raised.value.details["reason"] == "transport_error"
    assert server.engine.health().sessions == 1


def test_a_reply_over_this_sides_limit_may_have_run(
    serve: ServeFactory, remote: RemoteFactory
) -> None:
    """This side's grpcio refuses a reply over its limit ("CLIENT: Received message larger
    than max"): the prefill ran, so OutcomeUnknown."""
    server = serve(config(0, 2))
    assert server.address is not None
    engine = remote(config(0, 2, target=server.address, max_message_bytes=8192))
    with pytest.raises(OutcomeUnknown) as raised:
        prefill(engine, tuple(range(1, 400)))
    assert raised.value.details["reason"] == "transport_error"
    assert server.engine.health().sessions == 1


def test_a_server_never_reached_is_not_sent() -> None:
    """No server listens: grpcio's "failed to connect to all addresses", nothing sent."""
    failure = _fails(f"127.0.0.1:{free_port()}", encode_request(CapabilitiesQuery()))
    assert (failure.reason, failure.sent, failure.status) == (
        "connection_lost",
        False,
        "UNAVAILABLE",
    )


def test_grpcios_call_limit_is_busy() -> None:
    """A grpcio server at its ``maximum_concurrent_rpcs`` refuses a call before any handler
    ("Concurrent RPC limit exceeded!"): busy, not sent."""
    entered, release = threading.Event(), threading.Event()

    def hold(request: bytes, context: grpc.ServicerContext) -> bytes:
        entered.set()
        release.wait(30)
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), maximum_concurrent_rpcs=1)
    handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(hold)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, {"Call": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    holder = grpc.insecure_channel(f"127.0.0.1:{port}", options=_OWN_CONNECTION)
    try:
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = holder.unary_unary(CALL_METHOD)
        pending = call.future(b"", timeout=30)
        assert entered.wait(30)
        failure = _fails(f"127.0.0.1:{port}", encode_request(CapabilitiesQuery()))
        assert (failure.reason, failure.sent) == ("busy", False)
        release.set()
        pending.result()
    finally:
        release.set()
        holder.close()
        server.stop(None)


class _RefusedStream(grpc.RpcError):
    """grpcio's failure of a call whose stream the server's HTTP/2 layer refused, in the words
    grpcio 1.85 gives it (seen with 28 threads on one connection to a server taking 32)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "Stream removed (RST_STREAM (Received RST_STREAM with error code 7))"

    def trailing_metadata(self) -> tuple[()]:
        return ()


def test_a_stream_the_servers_http2_layer_refused_is_busy_and_never_ran() -> None:
    """RST_STREAM with REFUSED_STREAM (code 7) says the server refused the stream before any
    processing: busy, not sent, to be sent again shortly. It was "connection lost, may have
    run": OutcomeUnknown for a call that never ran, and a needless new connection."""
    with pytest.raises(LinkFailure) as refused, map_grpc_failures():
        raise _RefusedStream()
    failure = refused.value
    assert (failure.reason, failure.sent, failure.status) == ("busy", False, "UNAVAILABLE")
    assert failure.retry_after_s == REFUSED_STREAM_RETRY_S


def test_calls_over_a_connections_stream_limit_all_run_once(
    serve: ServeFactory, remote: RemoteFactory
) -> None:
    """Forty threads on one remote engine (one connection) against a server whose connections
    take 10 streams at once (``max_workers=5``): grpcio's server refuses some of their streams
    (its count of a connection's streams lags the client's), which ran nothing; each is sent
    again, and every call succeeds, once. Before, each such call was OutcomeUnknown."""
    load = msgspec.structs.replace(config(), max_sessions=64)
    server = serve(load, max_workers=5)
    assert server.address is not None
    engine = remote(config(target=server.address, timeout_s=120))
    sessions_at_once([engine] * 40, 20)
    metrics = server.engine.metrics()
    assert (metrics.prefill_requests, metrics.decode_requests) == (40, 40 * 20)


def test_a_missing_token_is_unauthenticated_by_its_status(serve: ServeFactory) -> None:
    """The token interceptor's UNAUTHENTICATED says why on its own: unauthenticated, not
    sent."""
    server = serve(security=ServerSecurity(token=TOKEN))
    assert server.address is not None
    failure = _fails(server.address, encode_request(CapabilitiesQuery()), token="w" * 32)
    assert (failure.reason, failure.sent) == ("unauthenticated", False)
