"""A framed server's drain tells each client which of its calls it never read (GOAWAY).

Against the real server, spoken to by hand: GOAWAY comes after every answer the server sends
on the connection, counts the frames it read (not the highest call id: ids may reach the
socket out of order), leaves unanswered only a call that outlived the grace, and goes to no
client older than the frame. Against a server scripted frame by frame, the client: a call
whose first frame came after the count never ran (``sent=False``), one within it that got no
answer may have (``sent=True``), whatever their ids; a connection that goes away while idle
carries no further call.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from conftest import (
    HEALTH,
    Background,
    ScriptedLinks,
    UnixPeer,
    config,
    delay,
    read_frame,
    ref,
    wait_until,
)

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_remote import EngineServer
from shard_engine_remote._framed import FramedLink, FramedServer
from shard_engine_remote._framed.frames import (
    CALL,
    ERROR,
    ERROR_DECODER,
    GOAWAY,
    HELLO,
    PROTOCOL_VERSION,
    REPLY,
    Hello,
    Welcome,
    encode_frame,
)
from shard_engine_remote._link import LinkFailure

_QUERY = msgspec.msgpack.encode({"type": "health_query"})


def _prefill(request_id: str) -> bytes:
    request = api.PrefillRequest(
        request_id=request_id,
        session=ref(request_id),
        start_pos=0,
        inputs=api.TokenInput(token_ids=(1, 2, 3)),
    )
    return wire.encode(request)


@pytest.fixture
def framed(tmp_path: Path) -> Iterator[tuple[FramedServer, EngineServer]]:
    """A framed server of a fake engine whose prefills take 30 s (cancellable)."""
    engine = api.load_engine("fake", config(faults=delay("prefill", 30_000)))
    server = EngineServer(engine)
    serving = FramedServer(server)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    serving.start(private / "engine.sock")
    yield serving, server
    serving.stop(grace=0.0)
    engine.close()


def _greeted(serving: FramedServer, version: int) -> socket.socket:
    assert serving.address is not None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(serving.address.removeprefix("unix:"))
    sock.sendall(encode_frame(HELLO, 0, msgspec.msgpack.encode(Hello(version=version))))
    kind, _, body = read_frame(sock)
    assert kind == HELLO
    assert msgspec.msgpack.decode(body, type=Welcome).version == min(version, PROTOCOL_VERSION)
    return sock


def _rest(sock: socket.socket) -> list[tuple[int, int, bytes]]:
    """Every frame until the server closes the connection."""
    frames: list[tuple[int, int, bytes]] = []
    while True:
        try:
            frames.append(read_frame(sock))
        except EOFError:
            return frames


def _drain_under_a_long_prefill(
    framed: tuple[FramedServer, EngineServer], version: int
) -> tuple[list[tuple[int, int, bytes]], bool]:
    """On one connection: a health query (id 9, answered), a prefill that outlives the grace
    (id 4), then, once the drain began, another health query (id 7). The frames the server
    sent after the first answer, and whether the prefill's engine work was cancelled."""
    serving, server = framed
    sock = _greeted(serving, version)
    try:
        sock.sendall(encode_frame(CALL, 9, _QUERY))
        assert read_frame(sock)[:2] == (REPLY, 9)
        sock.sendall(encode_frame(CALL, 4, _prefill("long")))
        wait_until(lambda: server.counters.in_flight == 1)
        stopping = Background(lambda: serving.stop(grace=2.0))
        wait_until(lambda: serving.draining)
        sock.sendall(encode_frame(CALL, 7, _QUERY))
        frames = _rest(sock)
        stopping.result()
    finally:
        sock.close()
    wait_until(lambda: server.counters.in_flight == 0)
    metrics = server.engine.metrics()
    return frames, metrics.cancelled == 1 and server.engine.health().kv_used_tokens == 0


def test_goaway_follows_every_answer_and_counts_the_frames_read(
    framed: tuple[FramedServer, EngineServer],
) -> None:
    """The call that arrived during the drain is refused (UNAVAILABLE: nothing ran), the
    prefill that outlived the grace is cancelled and unanswered, and the last frame before
    the server closes is GOAWAY counting the three frames read."""
    frames, cancelled = _drain_under_a_long_prefill(framed, PROTOCOL_VERSION)
    assert [(kind, call_id) for kind, call_id, _ in frames] == [(ERROR, 7), (GOAWAY, 3)]
    status, message = ERROR_DECODER.decode(frames[0][2])
    assert status == "UNAVAILABLE"
    assert "not sent to its engine" in message
    assert frames[1][2] == b""
    assert cancelled


def test_a_client_from_before_goaway_gets_none(
    framed: tuple[FramedServer, EngineServer],
) -> None:
    """A client speaking version 1 would take GOAWAY for its call's answer: it gets the
    answers and the close alone."""
    frames, cancelled = _drain_under_a_long_prefill(framed, 1)
    assert [(kind, call_id) for kind, call_id, _ in frames] == [(ERROR, 7)]
    assert cancelled


def test_an_idle_drain_says_goaway_at_once(framed: tuple[FramedServer, EngineServer]) -> None:
    """No call in flight: the drain ends without waiting out its grace, and a connection that
    made calls gets GOAWAY counting them, then the close."""
    serving, _ = framed
    sock = _greeted(serving, PROTOCOL_VERSION)
    try:
        for call_id in (3, 1, 2):
            sock.sendall(encode_frame(CALL, call_id, _QUERY))
            assert read_frame(sock)[:2] == (REPLY, call_id)
        stopping = Background(lambda: serving.stop(grace=60.0))
        frames = _rest(sock)
        stopping.result(timeout=30.0)
    finally:
        sock.close()
    assert [(kind, call_id, body) for kind, call_id, body in frames] == [(GOAWAY, 3, b"")]


# ----------------------------------------------------------------- the client, scripted


class _Going(UnixPeer):
    """A framed server of version 2 that files every frame after the greeting in ``frames``
    and sends what the test puts in ``to_send`` (``None``: shut the connection down)."""

    def __init__(self, path: Path) -> None:
        self.frames: queue.Queue[tuple[socket.socket, int, int]] = queue.Queue()
        self.greeted = threading.Event()
        super().__init__(path)

    def serve(self, sock: socket.socket) -> None:
        try:
            while True:
                kind, call_id, _ = read_frame(sock)
                if kind == HELLO:
                    welcome = Welcome(arena=False, version=PROTOCOL_VERSION)
                    sock.sendall(encode_frame(HELLO, 0, msgspec.msgpack.encode(welcome)))
                    self.greeted.set()
                else:
                    self.frames.put((sock, kind, call_id))
        except (EOFError, OSError):
            return

    def received(self) -> tuple[socket.socket, int, int]:
        return self.frames.get(timeout=10)


@pytest.fixture
def going(tmp_path: Path) -> Iterator[Callable[[], tuple[_Going, FramedLink]]]:
    links = ScriptedLinks(tmp_path)
    yield lambda: links.open(_Going)
    links.close()


def test_calls_the_goaway_did_not_count_never_ran_whatever_their_ids(
    going: Callable[[], tuple[_Going, FramedLink]],
) -> None:
    """Three calls whose ids reach the socket in the order 2, 1, 3; the server answers the
    first, then says GOAWAY after two frames and closes: call 2 has its answer, call 1 (read,
    unanswered) may have run, call 3 (never read) did not, though its id is the highest."""
    script, link = going()
    connection = link._connected(time.monotonic() + 10)
    ids = [connection.open_call()[0] for _ in range(3)]
    assert ids == [1, 2, 3]
    deadline = time.monotonic() + 10
    for call_id in (2, 1, 3):
        connection.send(CALL, call_id, _QUERY, deadline)
    received = [script.received() for _ in range(3)]
    assert [call_id for _, _, call_id in received] == [2, 1, 3]
    sock = received[0][0]
    sock.sendall(encode_frame(REPLY, 2, HEALTH) + encode_frame(GOAWAY, 2, b""))
    sock.shutdown(socket.SHUT_RDWR)
    outcomes: dict[int, object] = {}
    for call_id in (1, 2, 3):
        try:
            outcomes[call_id] = connection.receive(call_id, deadline)
        except LinkFailure as error:
            outcomes[call_id] = (error.reason, error.sent)
    assert outcomes == {
        2: (REPLY, HEALTH),
        1: ("connection_lost", True),
        3: ("connection_lost", False),
    }


def test_a_connection_going_away_while_idle_takes_no_further_call(
    going: Callable[[], tuple[_Going, FramedLink]],
) -> None:
    """GOAWAY reaches a connection no call waits on: the next call goes on a new connection,
    and the old one carries nothing more."""
    script, link = going()
    first = link._connected(time.monotonic() + 10)
    assert script.greeted.wait(10)
    script.connections[0].sendall(encode_frame(GOAWAY, 0, b""))
    answering = Background(lambda: link.call(_QUERY, 10.0))
    sock, kind, call_id = script.received()
    assert sock is script.connections[1], "the call went on the connection that went away"
    sock.sendall(encode_frame(REPLY, call_id, HEALTH))
    assert kind == CALL
    assert isinstance(answering.result(), api.Health)
    assert first.broken is not None
    assert "shut down" in first.broken.message
    assert script.frames.empty()
