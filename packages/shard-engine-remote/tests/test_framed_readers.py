"""The framed client has no reader thread: a waiting caller reads the socket itself, one at a
time, and files what it reads for the others. Against a server scripted frame by frame: a
lone caller reads its own reply; concurrent callers get their own replies whatever the order;
a reader whose deadline passes mid-frame leaves the stream whole for the next; a connection
the server closed while no call waited is replaced before a call is sent on it; a connection
lost while callers wait fails them all at once."""

from __future__ import annotations

import functools
import queue
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from conftest import (
    Background,
    RemoteFactory,
    ServeFactory,
    UnixPeer,
    config,
    decode,
    prefill,
    read_frame,
)

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_remote import EngineServer
from shard_engine_remote._framed import FramedLink
from shard_engine_remote._framed.client import _ReplyFrames
from shard_engine_remote._framed.frames import ABANDON, CALL, HEADER, HELLO, REPLY, encode_frame
from shard_engine_remote._link import LinkFailure

QUERY = msgspec.msgpack.encode({"type": "health_query"})


def _reply(tag: str, padding: int = 0) -> bytes:
    """A Health reply whose detail is ``tag``, ``padding`` bytes longer by a field a decoder
    ignores (a large reply, whatever the limits on Health's own fields)."""
    fields = msgspec.msgpack.decode(wire.encode(api.Health(state="ready", detail=tag)))
    if padding:
        fields["padding"] = "p" * padding
    return msgspec.msgpack.encode(fields)


def _detail(reply: object) -> str:
    assert isinstance(reply, api.Health), reply
    return reply.detail


class _Script(UnixPeer):
    """A framed server the test drives by hand: each accepted connection is greeted, and the
    frames it receives are put on ``frames`` as (connection, kind, call id)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(mode=0o700)
        self.frames: queue.Queue[tuple[socket.socket, int, int]] = queue.Queue()
        super().__init__(directory / "engine.sock", backlog=4)

    def serve(self, sock: socket.socket) -> None:
        try:
            while True:
                kind, call_id, _ = read_frame(sock)
                if kind == HELLO:
                    sock.sendall(encode_frame(HELLO, 0, b""))
                else:
                    self.frames.put((sock, kind, call_id))
        except (EOFError, OSError):
            return

    def next_call(self, kind: int = CALL) -> tuple[socket.socket, int]:
        while True:
            sock, got, call_id = self.frames.get(timeout=10)
            if got == kind:
                return sock, call_id


@pytest.fixture
def script(tmp_path: Path) -> Iterator[_Script]:
    server = _Script(tmp_path / "private")
    yield server
    server.close()


@pytest.fixture
def link(script: _Script) -> Iterator[FramedLink]:
    framed = FramedLink(script.path, token=None, max_message_bytes=8 << 20)
    yield framed
    framed.close()


def test_a_lone_caller_reads_its_own_reply(
    script: _Script, link: FramedLink, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread reads for the caller: the reply is read on the calling thread, and the
    connection starts none."""
    readers: set[int] = set()
    original = _ReplyFrames.next

    def recording(self: _ReplyFrames, deadline: float) -> tuple[int, int, bytes]:
        readers.add(threading.get_ident())
        return original(self, deadline)

    monkeypatch.setattr(_ReplyFrames, "next", recording)

    def calling() -> tuple[int, object]:
        return threading.get_ident(), link.call(QUERY, 5.0)

    before = set(threading.enumerate())
    for index in range(3):
        readers.clear()
        call = Background(calling)
        sock, call_id = script.next_call()
        sock.sendall(encode_frame(REPLY, call_id, _reply(f"reply {index}")))
        outcome = call.result()
        assert isinstance(outcome, tuple)
        caller, reply = outcome
        assert _detail(reply) == f"reply {index}"
        assert readers == {caller}
    started = [thread for thread in threading.enumerate() if thread not in before]
    assert len(started) == 1  # the script's thread for the connection, none of the client's


def _call_answered(script: _Script, link: FramedLink, tag: str) -> object:
    answer = threading.Thread(target=_answer_next, args=(script, tag), daemon=True)
    answer.start()
    return link.call(QUERY, 5.0)


def _answer_next(script: _Script, tag: str) -> None:
    sock, call_id = script.next_call()
    sock.sendall(encode_frame(REPLY, call_id, _reply(tag)))


@pytest.mark.parametrize("padding", [0, 3 << 20], ids=["small", "3MiB"])
def test_concurrent_callers_get_their_own_replies_in_any_order(
    script: _Script, link: FramedLink, padding: int
) -> None:
    """Eight callers at once; the server answers in reverse order of arrival (a large reply
    crosses many reads): each caller gets its own reply, whichever of them reads."""
    calls = [Background(lambda: link.call(QUERY, 20.0)) for _ in range(8)]
    arrived = [script.next_call() for _ in calls]
    for sock, call_id in reversed(arrived):
        sock.sendall(encode_frame(REPLY, call_id, _reply(f"call {call_id}", padding)))
    details = sorted(_detail(call.result()) for call in calls)
    assert details == sorted(f"call {call_id}" for _, call_id in arrived)


def test_a_reader_whose_deadline_passes_mid_frame_leaves_the_stream_whole(
    script: _Script, link: FramedLink
) -> None:
    """The first caller (0.5 s) reads; the server sends half of the second caller's reply,
    then nothing until the first caller's deadline has passed. The first caller gets
    DEADLINE_EXCEEDED and abandons its call; the second, now the reader, gets its reply whole,
    and the connection serves the next call."""
    first = Background(lambda: link.call(QUERY, 0.5))
    sock, first_id = script.next_call()
    second = Background(lambda: link.call(QUERY, 10.0))
    _, second_id = script.next_call()
    frame = encode_frame(REPLY, second_id, _reply("second", 1 << 20))
    sock.sendall(frame[: len(frame) // 2])
    with pytest.raises(LinkFailure) as late:
        first.result(5)
    assert late.value.reason == "deadline_exceeded"
    assert script.next_call(ABANDON)[1] == first_id
    sock.sendall(frame[len(frame) // 2 :])
    assert _detail(second.result(5)) == "second"
    assert _detail(_call_answered(script, link, "third")) == "third"


def test_a_connection_closed_while_no_call_waited_is_replaced(
    script: _Script, link: FramedLink
) -> None:
    """The server closes the connection between calls (no one reads it then): the next call
    sees it before sending and goes out on a new connection."""
    assert _detail(_call_answered(script, link, "first")) == "first"
    old = script.connections[0]
    old.shutdown(socket.SHUT_RDWR)
    old.close()
    time.sleep(0.05)
    assert _detail(_call_answered(script, link, "second")) == "second"
    assert len(script.connections) == 2


def test_a_lost_connection_fails_every_waiting_caller(script: _Script, link: FramedLink) -> None:
    """Three callers wait (one reads, two wait for it); the server drops the connection: all
    three get UNAVAILABLE at once, not at their deadlines."""
    calls = [Background(lambda: link.call(QUERY, 30.0)) for _ in range(3)]
    sock, _ = script.next_call()
    for _ in calls[1:]:
        script.next_call()
    started = time.monotonic()
    sock.sendall(HEADER.pack(100, REPLY, 999) + b"\x00" * 10)  # half a frame, then gone
    sock.shutdown(socket.SHUT_RDWR)
    for call in calls:
        with pytest.raises(LinkFailure) as lost:
            call.result(5)
        assert lost.value.reason == "connection_lost"
    assert time.monotonic() - started < 3.0


# ----------------------------------------------------------------- the server's side


class _Recording:
    """A served engine that records the thread of every decode."""

    def __init__(self, inner: api.ShardEngine) -> None:
        self._inner = inner
        self.threads: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def decode(self, request: api.DecodeRequest) -> api.ShardResult:
        self.threads.append(threading.get_ident())
        return self._inner.decode(request)


def test_one_callers_calls_are_served_on_one_thread(
    serve: ServeFactory, remote: RemoteFactory
) -> None:
    """Calls one after another on a connection are read and served by the same server thread:
    the connection's other thread is woken only when bytes arrive while a call is served (a
    hop then costs no wake-up of a second thread)."""
    recording: list[_Recording] = []

    class Server(EngineServer):
        def __init__(self, engine: api.ShardEngine, **kwargs: object) -> None:
            recording.append(_Recording(engine))
            super().__init__(recording[0], **kwargs)  # type: ignore[arg-type]

    server = serve(config(), transport="framed", server_type=Server)
    assert server.address is not None
    engine = remote(config(target=server.address, transport="framed"))
    prefill(engine)
    for pos in range(3, 23):
        decode(engine, pos)
    assert len(recording[0].threads) == 20
    assert len(set(recording[0].threads)) == 1


def test_closing_the_link_under_waiting_callers_fails_them_typed(script: _Script) -> None:
    """close() from another thread while callers wait (one reading, others waiting for it),
    at varying moments: every caller gets a LinkFailure, never another exception, and no
    caller waits out its deadline."""
    for attempt in range(20):
        link = FramedLink(script.path, token=None, max_message_bytes=1 << 20)
        calls = [Background(functools.partial(link.call, QUERY, 30.0)) for _ in range(3)]
        for _ in calls:
            script.next_call()
        time.sleep(0.001 * (attempt % 5))
        started = time.monotonic()
        link.close()
        for call in calls:
            with pytest.raises(LinkFailure):
                call.result(5)
        assert time.monotonic() - started < 3.0


def test_a_caller_reading_after_the_socket_closed_gets_a_link_error(
    script: _Script, link: FramedLink
) -> None:
    """The socket closed just before a waiting caller starts reading it (close() between two
    of its steps): a LinkFailure (connection lost), not the socket's ValueError."""
    assert _detail(_call_answered(script, link, "first")) == "first"
    connection = link._connection
    assert connection is not None
    call_id, _ = connection.open_call()
    connection.close()
    with pytest.raises(LinkFailure) as lost:
        connection.receive(call_id, time.monotonic() + 5.0)
    assert lost.value.reason == "connection_lost"


def test_a_send_on_a_closed_connection_is_a_link_error(script: _Script, link: FramedLink) -> None:
    """A send after the connection's socket closed (another thread closed the link): a
    LinkFailure saying the request was not sent, never the socket's own exception."""
    assert _detail(_call_answered(script, link, "first")) == "first"
    connection = link._connection
    assert connection is not None
    connection.close()
    with pytest.raises(LinkFailure) as lost:
        connection.send(CALL, 99, b"x" * (1 << 20), time.monotonic() + 1.0)
    assert lost.value.reason == "connection_lost"
    assert not lost.value.sent
