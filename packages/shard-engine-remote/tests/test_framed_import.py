"""The framed import's flow: the client sends an import's header, then only the chunks the
server grants (GO_AHEAD). Against a server scripted frame by frame: the wait for a grant ends at
the call's deadline (the import abandoned, the connection still serving) or when the connection
breaks; grants for unknown calls, repeated or malformed ones break nothing; a server from
before GO_AHEAD (no version in its welcome) takes the chunks ungranted. Against the real
server: a client from before GO_AHEAD gets none; an import of more chunks than the window moves
its bytes exactly and answers as before."""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from conftest import (
    FramedPeer,
    RemoteFactory,
    ScriptedLinks,
    ServeFactory,
    UnixPeer,
    fill,
    read_frame,
    ref,
    shard,
)

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_api.wire import SNAPSHOT_CHUNK_BYTES
from shard_engine_remote import DEFAULT_MAX_MESSAGE_BYTES
from shard_engine_remote._framed import FramedLink
from shard_engine_remote._framed.frames import (
    ABANDON,
    CALL,
    CHUNK,
    END,
    GO_AHEAD,
    GRANT,
    HELLO,
    IMPORT,
    IMPORT_WINDOW_CHUNKS,
    PROTOCOL_VERSION,
    REPLY,
    Welcome,
    encode_frame,
)
from shard_engine_remote._link import LinkFailure
from shard_engine_remote._wire import ImportHeader, Rejected, decode_reply, encode_header

_HEADER = b"header"
_RESULT = api.ImportSessionResult(request_id="i", session=ref("s"), length=3)
_HEALTH = wire.encode(api.Health(state="ready", detail="still serving"))
_QUERY = msgspec.msgpack.encode({"type": "health_query"})

_Frame = tuple[socket.socket, int, int, bytes]
"""What the scripted server received: (connection, kind, call id, body)."""


class _Body:
    """An import's messages: the header, then ``n_chunks`` numbered chunks, counting how many
    the link took."""

    def __init__(self, n_chunks: int) -> None:
        self.n_chunks = n_chunks
        self.pulled = 0

    def __iter__(self) -> Iterator[bytes]:
        yield _HEADER
        for index in range(self.n_chunks):
            self.pulled += 1
            yield index.to_bytes(4, "little")


class _Script(UnixPeer):
    """A framed server driven by ``answer``, called for each frame after the greeting; its
    welcome names ``version`` (None: none, as a server from before GO_AHEAD). CALLs are
    answered with a health reply."""

    def __init__(self, path: Path, answer: Callable[[_Frame], None], version: int | None) -> None:
        self.answer = answer
        self.frames: queue.Queue[_Frame] = queue.Queue()
        self._welcome = (
            b""
            if version is None
            else msgspec.msgpack.encode(Welcome(arena=False, version=version))
        )
        super().__init__(path)

    def serve(self, sock: socket.socket) -> None:
        try:
            while True:
                kind, call_id, body = read_frame(sock)
                if kind == HELLO:
                    sock.sendall(encode_frame(HELLO, 0, self._welcome))
                elif kind == CALL:
                    sock.sendall(encode_frame(REPLY, call_id, _HEALTH))
                else:
                    self.frames.put((sock, kind, call_id, body))
                    self.answer((sock, kind, call_id, body))
        except (EOFError, OSError):
            return

    def received(self, kind: int) -> _Frame:
        """The next frame of ``kind`` the server received (others are skipped)."""
        while True:
            frame = self.frames.get(timeout=10)
            if frame[1] == kind:
                return frame


def _grant(sock: socket.socket, call_id: int, chunks: int) -> None:
    sock.sendall(encode_frame(GO_AHEAD, call_id, GRANT.pack(chunks)))


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[Callable[..., tuple[_Script, FramedLink]]]:
    """A scripted server and a link to it: ``scripted(answer, version=PROTOCOL_VERSION)``."""
    links = ScriptedLinks(tmp_path)

    def factory(
        answer: Callable[[_Frame], None], version: int | None = PROTOCOL_VERSION
    ) -> tuple[_Script, FramedLink]:
        return links.open(lambda path: _Script(path, answer, version))

    yield factory
    links.close()


def _still_serving(link: FramedLink) -> None:
    reply = link.call(_QUERY, 10.0)
    assert isinstance(reply, api.Health), reply
    assert reply.detail == "still serving"


def test_the_wait_for_a_grant_ends_at_the_deadline(
    scripted: Callable[..., tuple[_Script, FramedLink]],
) -> None:
    """A server that takes the header and never answers: the import fails DEADLINE_EXCEEDED at
    its deadline having taken no chunk, is abandoned (ABANDON, once), and the connection
    serves the next call."""
    script, link = scripted(lambda frame: None)
    body = _Body(4)
    with pytest.raises(LinkFailure) as late:
        link.import_(iter(body), 0.5)
    assert late.value.reason == "deadline_exceeded"
    _, _, import_id, _ = script.received(IMPORT)
    sent = [script.received(CHUNK), script.received(ABANDON)]
    assert [(kind, call_id, data) for _, kind, call_id, data in sent] == [
        (CHUNK, import_id, _HEADER),
        (ABANDON, import_id, b""),
    ]
    assert body.pulled == 0
    _still_serving(link)
    assert script.frames.empty()  # one ABANDON, nothing more of the import


def test_a_connection_lost_while_waiting_for_a_grant_fails_the_import(
    scripted: Callable[..., tuple[_Script, FramedLink]],
) -> None:
    """The server drops the connection once it has the header: the import fails at once as a
    lost connection (not at its deadline), having taken no chunk."""

    def drop(frame: _Frame) -> None:
        sock, kind, _, body = frame
        if kind == CHUNK and body == _HEADER:
            sock.shutdown(socket.SHUT_RDWR)

    _, link = scripted(drop)
    body = _Body(4)
    with pytest.raises(LinkFailure) as lost:
        link.import_(iter(body), 60.0)
    assert lost.value.reason == "connection_lost"
    assert body.pulled == 0
    _still_serving(link)  # on a new connection


def test_grants_for_unknown_calls_and_repeated_grants_break_nothing(
    scripted: Callable[..., tuple[_Script, FramedLink]],
) -> None:
    """A server that grants a call no one made, grants every chunk twice and once more after
    its answer: the import sends every chunk in order, ends, and gets its answer; the next
    call is served."""

    def sloppy(frame: _Frame) -> None:
        sock, kind, call_id, _ = frame
        if kind == CHUNK:
            _grant(sock, call_id + 1000, 8)  # no such call
            _grant(sock, call_id, 1)
            _grant(sock, call_id, 1)
        elif kind == END:
            sock.sendall(encode_frame(REPLY, call_id, wire.encode(_RESULT)))
            _grant(sock, call_id, 1)  # the call has ended

    script, link = scripted(sloppy)
    body = _Body(5)
    assert link.import_(iter(body), 10.0) == _RESULT
    _, _, import_id, _ = script.received(IMPORT)
    chunks = [script.received(CHUNK)[2:] for _ in range(6)]
    assert chunks == [(import_id, _HEADER)] + [
        (import_id, index.to_bytes(4, "little")) for index in range(5)
    ]
    assert script.received(END)[2] == import_id
    assert body.pulled == 5
    _still_serving(link)


def test_a_malformed_grant_is_a_malformed_answer(
    scripted: Callable[..., tuple[_Script, FramedLink]],
) -> None:
    """A GO_AHEAD whose body is not a grant ends the import as the malformed reply it is (the
    client decides nothing on it); the connection serves the next call."""

    def malformed(frame: _Frame) -> None:
        sock, kind, call_id, _ = frame
        if kind == CHUNK:
            sock.sendall(encode_frame(GO_AHEAD, call_id, b"\x01"))

    _, link = scripted(malformed)
    body = _Body(4)
    answer = link.import_(iter(body), 10.0)
    assert isinstance(answer, Rejected)
    assert isinstance(answer.error, api.MalformedOutput)
    assert body.pulled == 0
    _still_serving(link)


def test_a_server_from_before_grants_takes_the_chunks_ungranted(
    scripted: Callable[..., tuple[_Script, FramedLink]],
) -> None:
    """A welcome without a version (a server from before GO_AHEAD): the client sends every
    chunk after the header without waiting, as such a server expects."""

    def answer_at_end(frame: _Frame) -> None:
        sock, kind, call_id, _ = frame
        if kind == END:
            sock.sendall(encode_frame(REPLY, call_id, wire.encode(_RESULT)))

    script, link = scripted(answer_at_end, version=None)
    body = _Body(3)
    assert link.import_(iter(body), 10.0) == _RESULT
    assert body.pulled == 3
    assert [script.received(CHUNK)[3] for _ in range(4)][1:] == [
        index.to_bytes(4, "little") for index in range(3)
    ]


def _load(positions: int) -> api.LoadConfig:
    return api.LoadConfig(shard=shard(), max_context=positions, kv_budget_tokens=positions)


def _big_snapshot(remote: RemoteFactory, positions: int) -> api.SessionSnapshot:
    """A snapshot of ``positions`` (a multiple of 499, what :func:`fill` prefills at once),
    taken from an engine loaded as :func:`_load` loads the one it is imported into."""
    source = remote(msgspec.structs.replace(_load(positions), options={"in_process": "fake"}))
    fill(source, ref("s"), positions)
    return source.export_session(api.ExportSessionRequest(request_id="e", session=ref("s")))


def _messages(snapshot: api.SessionSnapshot, pulled: list[int]) -> Iterator[bytes]:
    request = api.ImportSessionRequest(
        request_id="i", snapshot=msgspec.structs.replace(snapshot, chunks=())
    )
    yield encode_header(ImportHeader(request=request, n_chunks=len(snapshot.chunks)))
    for chunk in snapshot.chunks:
        pulled.append(len(chunk))
        yield chunk


def test_an_import_of_more_chunks_than_the_window_moves_them_exactly(
    serve: ServeFactory, remote: RemoteFactory
) -> None:
    """A snapshot of twice the window's chunks and more: imported through the framed link,
    the served engine holds exactly its bytes (its export gives them back) and the answer is
    the engine's."""
    positions = (2 * IMPORT_WINDOW_CHUNKS * SNAPSHOT_CHUNK_BYTES // 768 // 499 + 1) * 499
    snapshot = _big_snapshot(remote, positions)
    assert len(snapshot.chunks) > 2 * IMPORT_WINDOW_CHUNKS
    server = serve(_load(positions), transport="framed")
    assert server.address is not None
    link = FramedLink(
        Path(server.address.removeprefix("unix:")),
        token=None,
        max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
    )
    pulled: list[int] = []
    try:
        answer = link.import_(_messages(snapshot, pulled), 60.0)
    finally:
        link.close()
    assert isinstance(answer, api.ImportSessionResult), answer
    assert (answer.request_id, answer.session, answer.length) == ("i", ref("s"), positions)
    assert sum(pulled) == snapshot.state_bytes
    back = server.engine.export_session(api.ExportSessionRequest(request_id="b", session=ref("s")))
    assert back.chunks == snapshot.chunks
    assert back.checksum == snapshot.checksum


def test_a_client_from_before_grants_gets_none(serve: ServeFactory, remote: RemoteFactory) -> None:
    """A client greeting without a version (from before GO_AHEAD) is welcomed without one, and
    its import, chunks sent right after the header, is answered with no GO_AHEAD first."""
    snapshot = _big_snapshot(remote, 1497)
    server = serve(_load(1497), transport="framed")
    assert server.address is not None
    peer = FramedPeer(server.address, token="")
    try:
        kind, _, welcome = peer.greeting()
        assert kind == HELLO
        assert msgspec.msgpack.decode(welcome, type=Welcome).version == 0
        call_id = peer.fresh_id()
        frames = [encode_frame(IMPORT, call_id, b"")]
        frames += [encode_frame(CHUNK, call_id, message) for message in _messages(snapshot, [])]
        frames.append(encode_frame(END, call_id, b""))
        sender = threading.Thread(target=peer.sock.sendall, args=(b"".join(frames),))
        sender.start()
        kind, answer_id, body = read_frame(peer.sock)
        sender.join(10)
    finally:
        peer.close()
    assert (kind, answer_id) == (REPLY, call_id)
    assert isinstance(decode_reply(body), api.ImportSessionResult)
