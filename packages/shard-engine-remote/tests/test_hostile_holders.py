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
import pytest
from conftest import Background, RemoteFactory, ServeFactory, config, decode, prefill, wait_until
from grpc_health.v1 import health_pb2

import shard_engine_api as api
from shard_engine_remote import EngineServer, ServerSecurity
from shard_engine_remote._wire import CALL_METHOD, EXPORT_METHOD, SERVICE_NAME

TOKEN = "holder-token"
IDLE_S = 0.5
_CHECK = "/grpc.health.v1.Health/Check"
_WATCH = "/grpc.health.v1.Health/Watch"


class _Silent:
    """Request-streaming calls on one channel whose message never comes until ``close``."""

    def __init__(self, address: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.channel = grpc.insecure_channel(address)
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
    """A client holding the token opens forty calls and ten exports whose request never comes
    (gRPC's sync server would wait for each on one of its 8 threads, without a timeout).
    Another token holder's decodes are answered at once throughout; each silent call is cut
    off (counted as stalled) within the idle limit or refused, with no success."""
    worker = _worker(guarded, remote, tmp_path)
    prefill(worker)
    assert guarded.address is not None
    silent = _Silent(guarded.address, (("authorization", f"Bearer {TOKEN}"),))
    try:
        silent.open(CALL_METHOD, 40)
        silent.open(EXPORT_METHOD, 10)
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


def _check(address: str, service: str = "", timeout: float = 5.0) -> int:
    with grpc.insecure_channel(address) as channel:
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
    comes: another client's health check is answered SERVING every time (the oldest holder
    makes room), and each watch evicted ends with a status, not a hang."""
    assert guarded.address is not None
    holder = grpc.insecure_channel(guarded.address)
    silent = _Silent(guarded.address)
    watches = []
    try:
        watch: grpc.UnaryStreamMultiCallable[health_pb2.HealthCheckRequest, object]
        watch = holder.unary_stream(
            _WATCH,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        for _ in range(12):
            stream = watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=60)
            next(stream)
            watches.append(stream)
        silent.open(_CHECK, 12)
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
    servicer = guarded._health  # what the servicer keeps is the point
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
