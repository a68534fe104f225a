"""The framed transport against hostile and broken peers: junk instead of a greeting, wrong
tokens, undecodable and oversized bodies, unknown frame kinds, frames for calls that do not
exist, frames cut short. Each is refused (typed where a call id says whom to answer), counted,
and the server keeps serving a well-behaved client. It serves only in a private directory."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import stat
from pathlib import Path

import msgspec
import pytest
from conftest import (
    Background,
    FramedPeer,
    RemoteFactory,
    ServeFactory,
    config,
    decode,
    prefill,
    read_frame,
    wait_until,
)

import shard_engine_api as api
from shard_engine_api import cli, wire
from shard_engine_remote import EngineServer, RemoteEngine, ServerSecurity, Unauthenticated
from shard_engine_remote._framed import FramedServer
from shard_engine_remote._framed.client import CONNECTION_RETRY_S
from shard_engine_remote._framed.frames import (
    ABANDON,
    CALL,
    CHUNK,
    END,
    ERROR,
    HEADER,
    HELLO,
    REPLY,
    encode_frame,
)
from shard_engine_remote._wire import decode_reply

TOKEN = "framed-token"


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


class _Raw(FramedPeer):
    """A socket speaking frames by hand, greeted with ``token``; its calls answer errors."""

    def __init__(self, address: str, token: str | None = TOKEN) -> None:
        super().__init__(address, token)

    def call(self, body: bytes, kind: int = CALL) -> api.ShardEngineError:
        return wire.decode_error(self.exchange(body, kind))


@pytest.fixture
def framed(serve: ServeFactory) -> EngineServer:
    """A fake engine served framed, with a token and a 64 KiB message limit."""
    return serve(
        config(), transport="framed", security=ServerSecurity(token=TOKEN), max_message_bytes=65536
    )


@pytest.fixture
def worker(framed: EngineServer, remote: RemoteFactory, tmp_path: Path) -> api.ShardEngine:
    """A well-behaved remote engine of the framed server, with a session at length 3."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    assert framed.address is not None
    engine = remote(config(target=framed.address, transport="framed", token_file=str(token_file)))
    prefill(engine)
    return engine


def test_greetings_other_than_hello_are_refused(
    framed: EngineServer, worker: api.ShardEngine, remote: RemoteFactory, tmp_path: Path
) -> None:
    """Junk instead of a greeting closes the connection; a wrong or missing token gets
    UNAUTHENTICATED and the connection closes; a remote engine with the wrong token fails
    load with Unauthenticated. All counted; the worker keeps decoding."""
    assert framed.address is not None
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 8, b"\x00" * 13):
        raw = _Raw(framed.address, token=None)
        raw.sock.sendall(junk)
        assert _closed(raw.sock)
        raw.close()
    for token in ("wrong", ""):
        raw = _Raw(framed.address, token=token)
        kind, _, body = raw.greeting()
        assert kind == ERROR
        assert msgspec.msgpack.decode(body)[0] == "UNAUTHENTICATED"
        assert _closed(raw.sock)
        raw.close()
    wrong = tmp_path / "wrong"
    wrong.write_text("wrong")
    with pytest.raises(Unauthenticated):
        remote(config(target=framed.address, transport="framed", token_file=str(wrong)))
    decode(worker, 3)
    stats = framed.stats()
    assert (stats.rejected_frames, stats.unauthenticated) == (3, 3)


def test_bad_frames_get_typed_errors(framed: EngineServer, worker: api.ShardEngine) -> None:
    """Undecodable bodies and unknown kinds get InvalidRequest, bodies over the limit
    ResourceExhausted (not retryable, skipped unread), frames for calls that do not exist are
    dropped; the connection keeps serving, and nothing reaches the engine."""
    assert framed.address is not None
    raw = _Raw(framed.address)
    assert raw.greeting()[0] == HELLO
    bomb = b"\x82\xa4type\xa6decode\xa4junk" + b"\x91" * 100_000 + b"\xc0"
    for garbage in (b"", b"\x00", b"\xc1\xff\xfe", b"\x81\xa4type\xa5bogus", b"x" * 5000):
        error = raw.call(garbage)
        assert isinstance(error, api.InvalidRequest), (garbage, error)
    error = raw.call(wire.encode(api.CancelRequest(request_id="x")), kind=99)
    assert isinstance(error, api.InvalidRequest)
    assert "kind 99" in error.message
    for oversized in (bomb, b"\x00" * (65536 + 10)):
        error = raw.call(oversized)
        assert isinstance(error, api.ResourceExhausted)
        assert not error.retryable
        assert error.details["resource"] == "message_bytes"
    # Chunks, ends and abandons of calls that do not exist change nothing.
    for kind in (CHUNK, END, ABANDON):
        raw.sock.sendall(encode_frame(kind, 12345, b"junk"))
    health_id = raw.fresh_id()
    raw.sock.sendall(
        encode_frame(CALL, health_id, msgspec.msgpack.encode({"type": "health_query"}))
    )
    kind, call_id, body = read_frame(raw.sock)
    assert (kind, call_id) == (REPLY, health_id)
    health = decode_reply(body)
    assert isinstance(health, api.Health)
    assert health.sessions == 1, "the same connection still serves"
    raw.close()
    decode(worker, 3)
    stats = framed.stats()
    assert (stats.rejected_frames, stats.oversized) == (6, 2)
    assert framed.engine.metrics().errors == {}, "garbage never reached the engine"


def test_frames_cut_short_leave_the_server_serving(
    framed: EngineServer, worker: api.ShardEngine
) -> None:
    """A frame announcing 4 GiB then hanging up, and a connection closed mid-header: the
    server drops those connections only."""
    assert framed.address is not None
    raw = _Raw(framed.address)
    raw.greeting()
    raw.sock.sendall(HEADER.pack(0xFFFFFFFF, CALL, 1) + b"\x00" * 100_000)
    raw.close()
    raw = _Raw(framed.address)
    raw.greeting()
    raw.sock.sendall(HEADER.pack(10, CALL, 1)[:5])
    raw.close()
    decode(worker, 3)
    assert framed.stats().oversized == 0, "nothing was answered: the frames never ended"


def test_serves_only_in_a_private_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A socket whose directory others may enter is refused, by the server, the serve command
    and the client options (framed reaches unix sockets only)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    engine = api.load_engine("fake", config())
    try:
        with pytest.raises(api.InvalidRequest, match="private directory"):
            FramedServer(EngineServer(engine)).start(shared / "engine.sock")
    finally:
        engine.close()
    arguments = ["serve", "--engine", "fake", "--layers", "0:6", "--transport", "framed"]
    assert cli.main([*arguments, "--listen", f"unix:{shared}/engine.sock"]) == 2
    assert "private directory" in capsys.readouterr().err
    assert cli.main([*arguments, "--listen", "127.0.0.1:0"]) == 2
    assert "unix socket" in capsys.readouterr().err
    remote = api.load_engine("remote")
    with pytest.raises(api.InvalidRequest, match="unix socket"):
        remote.load(config(target="127.0.0.1:7450", transport="framed"))


def _bounded(tmp_path: Path, connections: int) -> tuple[FramedServer, api.ShardEngine, str]:
    """A framed server of a fake engine holding at most ``connections``, and its address."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    engine = api.load_engine("fake", config())
    server = FramedServer(EngineServer(engine), max_connections=connections)
    return server, engine, server.start(private / "engine.sock")


def test_connection_floods_are_refused(tmp_path: Path, remote: RemoteFactory) -> None:
    """Connections beyond the server's bound are answered with a retryable refusal
    (RESOURCE_EXHAUSTED: a remote engine that may not wait raises ResourceExhausted with
    ``retry_after_s``) and closed at once, and counted (busy); those already open keep being
    served; a remote engine that may wait connects again until a place frees, and takes it."""
    server, engine, address = _bounded(tmp_path, 2)
    raws: list[_Raw] = []
    try:
        first = _Raw(address, token="")
        raws.append(first)
        assert first.greeting()[0] == HELLO
        worker = remote(config(target=address, transport="framed"))
        prefill(worker)
        flood = _Raw(address, token=None)
        raws.append(flood)
        # The server may close it before its greeting arrives: refused all the same.
        with contextlib.suppress(OSError):
            flood.sock.sendall(encode_frame(HELLO, 0, msgspec.msgpack.encode({"token": ""})))
        kind, _, body = flood.greeting()
        assert kind == ERROR
        assert msgspec.msgpack.decode(body)[0] == "RESOURCE_EXHAUSTED"
        assert _closed(flood.sock)
        flood.close()
        with pytest.raises(api.ResourceExhausted) as refused:
            remote(config(target=address, transport="framed", retry_busy=False))
        assert refused.value.retryable
        assert refused.value.details["retry_after_s"] == CONNECTION_RETRY_S
        assert server.server.stats().busy == 2
        # A remote engine that may wait connects again until a place frees.
        waiting = Background(lambda: remote(config(target=address, transport="framed")))
        wait_until(lambda: server.server.stats().busy >= 3)
        decode(worker, 3)
        first.close()
        late = waiting.result()
        assert isinstance(late, RemoteEngine)
        prefill(late, session="late")
        worker.close()
        wait_until(lambda: _greeted(address))
    finally:
        for raw in raws:  # (a failed assertion leaves no socket for a later test's warnings)
            raw.close()
        server.stop(grace=0.5)
        engine.close()


def _greeted(address: str) -> bool:
    try:
        raw = _Raw(address, token="")
    except OSError:  # refused before the greeting was sent
        return False
    try:
        return raw.greeting()[0] == HELLO
    except (EOFError, OSError):
        return False
    finally:
        raw.close()


def test_clients_beyond_the_connection_bound_wait_for_a_place(
    tmp_path: Path, remote: RemoteFactory
) -> None:
    """A server of 4 connections, all held; 12 remote engines start loading meanwhile (each
    refused at least once), then the 4 are closed: every engine loads, makes a prefill and 3
    decodes, and closes (freeing its place for the next); none raises."""
    server, engine, address = _bounded(tmp_path, 4)
    holders: list[_Raw] = []

    def client(index: int) -> int:
        worker = remote(config(target=address, transport="framed"))
        prefill(worker, session=f"c{index}")
        for pos in range(3, 6):
            decode(worker, pos, session=f"c{index}", request_id=f"d{index}-{pos}")
        worker.close()
        return index

    try:
        for _ in range(4):
            holders.append(_Raw(address, token=""))
            assert holders[-1].greeting()[0] == HELLO
        clients = [Background(functools.partial(client, index)) for index in range(12)]
        wait_until(lambda: server.server.stats().busy >= 12)
        for holder in holders:
            holder.close()
        assert [each.result() for each in clients] == list(range(12))
        assert engine.metrics().decode_requests == 36
    finally:
        for holder in holders:
            holder.close()
        server.stop(grace=0.5)
        engine.close()
