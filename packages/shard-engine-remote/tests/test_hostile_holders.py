"""gRPC peers that hold what the server has little of: calls from a token holder whose request
message never comes, health checks kept open, silent connections by the thousand. Each is
bounded (cut off, evicted, closed) and every other client keeps being served."""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import grpc
import msgspec
import pytest
from conftest import (
    Background,
    RemoteFactory,
    ServeFactory,
    config,
    decode,
    fill,
    prefill,
    read_frame,
    ref,
    slow_reader_channel,
    wait_until,
)
from grpc_health.v1 import health_pb2

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_remote import EngineServer, ServerSecurity
from shard_engine_remote._framed.frames import CHUNK, HELLO, IMPORT, REPLY, encode_frame
from shard_engine_remote._waiting import Waiting
from shard_engine_remote._wire import (
    CALL_METHOD,
    EXPORT_METHOD,
    IMPORT_METHOD,
    SERVICE_NAME,
    ImportHeader,
    SnapshotHeader,
    decode_export_header,
    encode_header,
    encode_request,
)

TOKEN = "holder-token"
IDLE_S = 0.5
_CHECK = "/grpc.health.v1.Health/Check"
_WATCH = "/grpc.health.v1.Health/Watch"
_OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
"""Channel options for a connection of its own (gRPC shares one between channels alike)."""


class _Silent:
    """Request-streaming calls on one channel whose message never comes until ``close``."""

    def __init__(self, address: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.channel = grpc.insecure_channel(address, options=_OWN_CONNECTION)
        self.release = threading.Event()
        self.calls: list[grpc.Future] = []  # type: ignore[type-arg]
        self.streams: list[Iterator[bytes]] = []
        self._metadata = metadata

    def _nothing(self) -> Iterator[bytes]:
        self.release.wait(60)
        yield from ()

    def open(self, method: str, count: int) -> None:
        for _ in range(count):
            if method == EXPORT_METHOD:
                stream_stream: grpc.StreamStreamMultiCallable[bytes, bytes]
                stream_stream = self.channel.stream_stream(method)
                self.streams.append(stream_stream(self._nothing(), metadata=self._metadata))
            else:
                stream_unary: grpc.StreamUnaryMultiCallable[bytes, bytes]
                stream_unary = self.channel.stream_unary(method)
                self.calls.append(
                    stream_unary.future(self._nothing(), metadata=self._metadata, timeout=60)
                )

    def close(self) -> None:
        self.release.set()
        for stream in self.streams:
            cast(grpc.Call, stream).cancel()
        self.channel.close()


@pytest.fixture
def guarded(serve: ServeFactory) -> EngineServer:
    """A fake engine served with a token and 8 threads for its calls."""
    return serve(
        config(), security=ServerSecurity(token=TOKEN), max_workers=8, stream_idle_s=IDLE_S
    )


def _worker(server: EngineServer, remote: RemoteFactory, tmp_path: Path) -> api.ShardEngine:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    assert server.address is not None
    return remote(
        config(
            target=server.address, token_file=str(token_file), timeout_s=10, control_timeout_s=10
        )
    )


def test_a_token_holders_silent_calls_do_not_stop_service(
    guarded: EngineServer, remote: RemoteFactory, tmp_path: Path
) -> None:
    """A client holding the token opens forty calls and ten exports whose request never comes,
    and a hundred more over six other connections (gRPC's sync server would wait for each on
    one of its 8 threads, without a timeout).
    Another token holder's decodes are answered at once throughout; each silent call is cut
    off (counted as stalled) within the idle limit or refused, with no success."""
    worker = _worker(guarded, remote, tmp_path)
    prefill(worker)
    assert guarded.address is not None
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    silent = _Silent(guarded.address, metadata)
    # Over more connections than the server takes calls at once (64 here) in all.
    others = [_Silent(guarded.address, metadata) for _ in range(6)]
    try:
        silent.open(CALL_METHOD, 40)
        silent.open(EXPORT_METHOD, 10)
        for other in others:
            other.open(CALL_METHOD, 16)
        time.sleep(0.3)
        for position in range(3, 13):
            started = time.monotonic()
            assert decode(worker, position).first_pos == position
            assert time.monotonic() - started < 2.0
        for call in silent.calls:
            error = call.exception(timeout=10)
            assert error is not None
            assert cast(grpc.Call, error).code() != grpc.StatusCode.OK
        for stream in silent.streams:
            with pytest.raises(grpc.RpcError):
                Background(functools.partial(list, stream)).result(timeout=10)
        # Those beyond the server's streams per connection were refused (UNAVAILABLE) by
        # gRPC itself; every one that reached the server was cut off.
        assert guarded.stats().stalled >= 2 * 8
        assert guarded.stats().in_flight == 0
        assert guarded.engine.metrics().exports == 0
    finally:
        silent.close()
        for other in others:
            other.close()


def _check(address: str, service: str = "", timeout: float = 5.0) -> int:
    with grpc.insecure_channel(address, options=_OWN_CONNECTION) as channel:
        check: grpc.UnaryUnaryMultiCallable[health_pb2.HealthCheckRequest, object]
        check = channel.unary_unary(
            _CHECK,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        answer = check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return int(cast(health_pb2.HealthCheckResponse, answer).status)


def test_one_client_cannot_keep_health_busy(guarded: EngineServer) -> None:
    """One client keeping a dozen health watches open and a dozen checks whose request never
    comes (beyond the server's places for them it is refused, retryable): another client's
    health check is answered SERVING every time (the biggest holder's oldest call makes
    room once a second old), and each watch evicted ends with a status, not a hang."""
    assert guarded.address is not None
    holder = grpc.insecure_channel(guarded.address, options=_OWN_CONNECTION)
    silent = _Silent(guarded.address)
    watches = []
    try:
        watch: grpc.UnaryStreamMultiCallable[health_pb2.HealthCheckRequest, object]
        watch = holder.unary_stream(
            _WATCH,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        refused: list[grpc.StatusCode] = []
        for _ in range(12):
            stream = watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=60)
            try:
                next(stream)
            except grpc.RpcError as error:
                refused.append(cast(grpc.Call, error).code())
            else:
                watches.append(stream)
        # One client holds at most every place, not more (retryable refusals).
        assert refused.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 12 - 4
        silent.open(_CHECK, 12)
        time.sleep(1.2)  # a holder's place goes to others once it is a second old
        for _ in range(10):
            assert _check(guarded.address) == health_pb2.HealthCheckResponse.SERVING
        ended = Background(lambda: list(watches[0]))
        with pytest.raises(grpc.RpcError):
            ended.result(timeout=10)
    finally:
        silent.close()
        holder.close()


def test_health_of_unknown_services_keeps_nothing(guarded: EngineServer) -> None:
    """Checks and watches naming services the server does not serve (a fresh, long name each
    time) are answered NOT_FOUND and SERVICE_UNKNOWN and leave nothing behind: the health
    servicer keeps no entry per name a client made up."""
    assert guarded.address is not None
    with grpc.insecure_channel(guarded.address) as channel:
        watch: grpc.UnaryStreamMultiCallable[health_pb2.HealthCheckRequest, object]
        watch = channel.unary_stream(
            _WATCH,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        for n in range(50):
            name = f"{n}-" + "x" * 10_000
            with pytest.raises(grpc.RpcError) as unknown:
                _check(guarded.address, name)
            assert cast(grpc.Call, unknown.value).code() == grpc.StatusCode.NOT_FOUND
            stream = watch(health_pb2.HealthCheckRequest(service=name), timeout=5)
            first = cast(health_pb2.HealthCheckResponse, next(stream))
            assert first.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            cast(grpc.Call, stream).cancel()
    servicer = guarded._grpc_health._servicer  # what the servicer keeps is the point
    wait_until(lambda: len(servicer._send_response_callbacks) <= 2)
    assert _check(guarded.address) == health_pb2.HealthCheckResponse.SERVING


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_thousands_of_silent_connections_cost_bounded_descriptors(
    serve: ServeFactory, remote: RemoteFactory, tmp_path: Path
) -> None:
    """Three thousand TCP connections that never send a byte: the server holds at most
    ``max_connections`` of them (the rest are closed at once), closes the silent ones at the
    handshake limit, and an established client is served throughout; once they are closed a
    new client connects and is served."""
    server = serve(
        config(),
        security=ServerSecurity(token=TOKEN),
        max_connections=64,
        handshake_timeout_s=1.0,
    )
    worker = _worker(server, remote, tmp_path)
    prefill(worker)
    assert server.address is not None
    host, port = server.address.rsplit(":", 1)
    before = _open_fds()
    flood = []
    try:
        for _ in range(3000):
            sock = socket.create_connection((host, int(port)))
            flood.append(sock)
        time.sleep(0.5)
        # The flood's own 3000 descriptors are this process's; the server's share is the rest.
        assert _open_fds() - before - len(flood) <= 64 + 16
        assert decode(worker, 3).first_pos == 3
        time.sleep(2.0)
        late = _worker(server, remote, tmp_path)
        prefill(late, session="late")
        assert decode(worker, 4).first_pos == 4
    finally:
        for sock in flood:
            sock.close()


def _trickle(header: bytes, chunks: int, every_s: float) -> Iterator[bytes]:
    yield header
    for _ in range(chunks):
        time.sleep(every_s)
        yield bytes(10_000)


def test_a_trickled_import_holds_its_slot_only_as_long_as_its_size_allows(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """An import announcing 1 MiB in 100 chunks, sending one every 0.4 s (just inside the
    0.5 s idle limit, 40 s in all): it moves slower than ``min_stream_bytes_per_s`` and is
    cut off once ``stream_idle_s + size / rate`` (1.5 s) passed, Cancelled, counted as
    stalled, nothing imported; it held one stream slot that long, not forty seconds."""
    server = serve(config(), transport=transport, max_workers=5, stream_idle_s=IDLE_S)
    assert server.address is not None
    worker = remote(config(target=server.address, transport=transport))
    prefill(worker)
    snapshot = worker.export_session(api.ExportSessionRequest(request_id="e", session=ref()))
    # A length whose state may take 1 MiB on this shard: the header is admitted, the body
    # trickles.
    announced = msgspec.structs.replace(snapshot, length=1400, state_bytes=1 << 20, chunks=())
    header = encode_header(
        ImportHeader(
            request=api.ImportSessionRequest(request_id="i", snapshot=announced), n_chunks=100
        )
    )
    started = time.monotonic()
    if transport == "grpc":
        with grpc.insecure_channel(server.address) as channel:
            stream: grpc.StreamUnaryMultiCallable[bytes, bytes]
            stream = channel.stream_unary(IMPORT_METHOD)
            answer = stream(_trickle(header, 100, 0.4), timeout=60)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(60)
        sock.connect(server.address.removeprefix("unix:"))
        sock.sendall(encode_frame(HELLO, 0, msgspec.msgpack.encode({})))
        assert read_frame(sock)[0] == HELLO
        sock.sendall(encode_frame(IMPORT, 1, b""))
        replied: list[bytes] = []

        def feed() -> None:
            for message in _trickle(header, 100, 0.4):
                if replied:
                    return
                sock.sendall(encode_frame(CHUNK, 1, message))

        feeding = threading.Thread(target=feed, daemon=True)
        feeding.start()
        kind, call_id, answer = read_frame(sock)
        replied.append(answer)
        assert (kind, call_id) == (REPLY, 1)
        feeding.join(5)
        sock.close()
    assert time.monotonic() - started < 5
    refused = wire.decode_error(answer)
    assert isinstance(refused, api.Cancelled)
    assert refused.details["reason"] == "too_slow"
    assert server.stats().stalled == 1
    assert server.engine.metrics().imports == 0


def test_an_export_taken_slowly_holds_its_slot_only_as_long_as_its_size_allows(
    serve: ServeFactory, remote: RemoteFactory
) -> None:
    """A gRPC client taking an export's chunks one every 1.2 s (inside the 2 s idle limit)
    moves its ~4.6 MB slower than ``min_stream_bytes_per_s`` (4 MB/s here): the server ends
    the stream DEADLINE_EXCEEDED once ``stream_idle_s + size / rate`` passed, counted as
    stalled, instead of holding its stream slot for as long as the client cares to read."""
    load = api.LoadConfig(shard=config().shard, max_context=8192)
    server = serve(load, max_workers=5, stream_idle_s=2.0, min_stream_bytes_per_s=4_000_000)
    assert server.address is not None
    worker = remote(api.LoadConfig(shard=load.shard, options={"target": server.address}))
    session = api.SessionRef(session_id="big", epoch=1)
    fill(worker, session, 5988)
    request = api.ExportSessionRequest(request_id="e", session=session)
    channel = slow_reader_channel(server.address)
    try:
        export: grpc.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(EXPORT_METHOD)
        stream = export(encode_request(request), timeout=60)
        header = wire_header(next(stream))
        assert header.n_chunks >= 4
        taken: list[bytes] = []
        with pytest.raises(grpc.RpcError) as cut:
            _take_slowly(stream, taken)
        assert cast(grpc.Call, cut.value).code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len(taken) < header.n_chunks
        assert server.stats().stalled == 1
        assert worker.export_session(request).state_bytes == header.snapshot.state_bytes
    finally:
        channel.close()


def _take_slowly(stream: Iterator[bytes], taken: list[bytes]) -> None:
    for chunk in stream:
        taken.append(chunk)
        time.sleep(1.2)


def wire_header(message: bytes) -> SnapshotHeader:
    header = decode_export_header(message)
    assert isinstance(header, SnapshotHeader)
    return header


class _Context:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_waiting_places_go_to_new_calls_only_from_stale_waiters() -> None:
    """When every waiting place is taken, a new call takes the place of a waiter whose message
    is ``grace_s`` late (the oldest of the peer holding the most such places: cancelled,
    counted), else it is refused. A waiter cut off (evicted or past its time) is told so when
    it stops waiting, even if its message arrived in between: it never starts work its
    client will see cancelled."""
    cut: list[int] = []
    waiting = Waiting(3, 0.4, lambda: cut.append(1))
    assert waiting.grace_s == 0.2
    hog = [_Context() for _ in range(3)]
    tickets = [waiting.enter(cast(grpc.ServicerContext, context), "hog") for context in hog]
    assert waiting.enter(cast(grpc.ServicerContext, _Context()), "other") is None
    time.sleep(0.25)
    mine = [waiting.enter(cast(grpc.ServicerContext, _Context()), "other") for _ in range(3)]
    assert all(ticket is not None for ticket in mine)
    assert [context.cancelled for context in hog] == [True, True, True]
    assert len(cut) == 3
    # Every place is "other"'s now, none stale yet: the next call is refused.
    assert waiting.enter(cast(grpc.ServicerContext, _Context()), "hog") is None
    assert tickets[0] is not None
    assert not waiting.leave(tickets[0])
    assert all(ticket is not None and waiting.leave(ticket) for ticket in mine)
    assert len(waiting) == 0
    timed = Waiting(4, 0.2, lambda: cut.append(1))
    timed.start()
    try:
        late = _Context()
        ticket = timed.enter(cast(grpc.ServicerContext, late), "late")
        assert ticket is not None
        wait_until(lambda: late.cancelled, timeout=5)
        assert not timed.leave(ticket)
        assert len(cut) == 4
    finally:
        timed.stop()


def test_a_connection_closed_for_idleness_costs_its_client_nothing(
    serve: ServeFactory, remote: RemoteFactory
) -> None:
    """The server closes a connection without calls after ``connection_idle_s``; the remote
    engine's next call reconnects and is served (no error, no lost session)."""
    server = serve(config(), connection_idle_s=0.5)
    assert server.address is not None
    worker = remote(config(target=server.address))
    prefill(worker)
    for position in range(3, 6):
        time.sleep(1.2)
        assert decode(worker, position).first_pos == position


def test_a_burst_of_calls_is_served_whole(serve: ServeFactory) -> None:
    """A hundred and sixty calls sent at once over ten connections, each with its message,
    more than the server has waiting places: none is cut off (a message merely queued
    behind the others is not late); each is answered, or, should every place be taken by
    calls less than a second old, refused as busy (retryable, nothing ran)."""
    server = serve(config(), max_workers=8)
    assert server.address is not None
    query = msgspec.msgpack.encode({"type": "health_query"})
    channels = [grpc.insecure_channel(server.address, options=_OWN_CONNECTION) for _ in range(10)]
    try:
        calls = []
        for channel in channels:
            call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(CALL_METHOD)
            calls += [call.future(query, timeout=30) for _ in range(16)]
        codes = [cast(grpc.Call, call).code() for call in calls]
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert server.stats().stalled == 0
    finally:
        for channel in channels:
            channel.close()
