"""Peers that lie about sizes, trickle bytes, reuse call ids or squat on sockets: what the
framed transport's server and client do about each. Nothing they send holds memory it did not
receive, a slot past its deadline, engine work past its connection, or the client's token."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import tracemalloc
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import msgspec
import pytest
from conftest import (
    Background,
    RemoteFactory,
    ServeFactory,
    config,
    decode,
    delay,
    prefill,
    read_frame,
    wait_until,
)

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_remote import (
    EngineServer,
    OutcomeUnknown,
    RemoteUnavailable,
    ServerSecurity,
    Unauthenticated,
)
from shard_engine_remote._framed import FramedServer, frames
from shard_engine_remote._framed import connection as framed_connection
from shard_engine_remote._framed.frames import (
    CALL,
    CHUNK,
    HEADER,
    HELLO,
    IMPORT,
    REPLY,
    encode_frame,
)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the peer closed ``sock`` within ``seconds`` (data it sends is discarded)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


@pytest.fixture
def private_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="shard-engine-test-"))
    yield directory
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()


def test_a_length_header_takes_no_memory_for_bytes_never_sent() -> None:
    """A frame header announcing a large body, followed by a few bytes and silence (then a
    close), makes the reader hold only what arrived: both ends read frames this way, so
    neither a client nor a server can be made to commit the message limit per connection
    for 13 bytes."""
    reading, writing = socket.socketpair()
    announced = 64 << 20
    writing.sendall(HEADER.pack(announced, CALL, 1) + b"x" * 100)
    reader = frames.Reader(reading)
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            length, _, _ = reader.header()
            reader.body(length)
        except BaseException as error:  # noqa: BLE001 - inspected below
            outcome.append(error)

    tracemalloc.start()
    try:
        thread = threading.Thread(target=read)
        thread.start()
        writing.close()
        thread.join(30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        reading.close()
    assert not thread.is_alive()
    assert len(outcome) == 1
    assert isinstance(outcome[0], frames.Closed)
    assert peak < announced // 4, f"{peak} bytes held for a body of which 100 bytes arrived"


def test_a_body_read_in_pieces_is_whole() -> None:
    """The large-body path returns exactly what was sent, whatever the pieces."""
    reading, writing = socket.socketpair()
    body = os.urandom(3 << 20) + b"tail"
    sender = threading.Thread(target=writing.sendall, args=(encode_frame(CALL, 9, body) * 2,))
    sender.start()
    reader = frames.Reader(reading)
    try:
        for _ in range(2):
            length, kind, call_id = reader.header()
            assert (kind, call_id) == (CALL, 9)
            assert reader.body(length) == body
    finally:
        sender.join(30)
        reading.close()
        writing.close()


def test_a_trickled_greeting_is_cut_off_at_its_deadline(
    serve: ServeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection sending its HELLO a byte at a time, each byte well inside the greeting
    timeout, is closed once the greeting as a whole is late: it cannot hold one of the
    bounded greeting places for as long as it likes."""
    monkeypatch.setattr(framed_connection, "HELLO_TIMEOUT_S", 0.5)
    server = serve(config(), transport="framed", security=ServerSecurity(token="t"))
    assert server.address is not None
    hello = encode_frame(HELLO, 0, msgspec.msgpack.encode({"token": "t" * 4000}))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(server.address.removeprefix("unix:"))
    try:
        cut_off = False
        for index in range(400):  # 400 bytes at most, ~20 s: far past the 0.5 s deadline
            try:
                sock.send(hello[index : index + 1])
            except OSError:
                cut_off = True
                break
            if _closed_within(sock, 0.05):
                cut_off = True
                break
        assert cut_off, "a greeting trickled byte by byte was never cut off"
    finally:
        sock.close()


def test_a_client_greeting_a_trickling_server_gives_up_at_its_deadline(
    private_dir: Path, remote: RemoteFactory
) -> None:
    """A server answering the greeting a byte at a time cannot hold the client's load past
    its connect deadline: it is RemoteUnavailable, and the client closes the connection."""
    path = private_dir / "engine.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    outcome: list[str] = []

    def trickle() -> None:
        sock, _ = listener.accept()
        answer = encode_frame(HELLO, 0, b"\x80" * 4000)
        try:
            for index in range(400):  # ~20 s at most
                sock.send(answer[index : index + 1])
                if _closed_within(sock, 0.05):
                    outcome.append("cut off")
                    return
            outcome.append("sent everything")
        except OSError:
            outcome.append("cut off")
        finally:
            sock.close()

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        with pytest.raises(RemoteUnavailable):
            remote(config(target=f"unix:{path}", transport="framed", connect_timeout_s=0.5))
        thread.join(30)
        assert outcome == ["cut off"]
    finally:
        listener.close()


def test_a_call_id_in_flight_cannot_be_reused(serve: ServeFactory) -> None:
    """A second call under the id of one still running is refused (InvalidRequest) rather
    than shadowing it, so when the connection ends every call it started is cancelled and
    no engine work outlives it."""
    server = serve(config(faults=delay("prefill", 60_000)), transport="framed")
    assert server.address is not None
    request = api.PrefillRequest(
        request_id="slow",
        session=api.SessionRef(session_id="s", epoch=1),
        start_pos=0,
        inputs=api.TokenInput(token_ids=(1, 2)),
    )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(server.address.removeprefix("unix:"))
    try:
        sock.sendall(encode_frame(HELLO, 0, msgspec.msgpack.encode({})))
        assert read_frame(sock)[0] == HELLO
        sock.sendall(encode_frame(CALL, 7, wire.encode(request)))
        wait_until(lambda: server.engine.health().in_flight == 1)
        other = msgspec.structs.replace(
            request, request_id="slow-2", session=api.SessionRef(session_id="t", epoch=1)
        )
        sock.sendall(encode_frame(CALL, 7, wire.encode(other)))
        kind, call_id, body = read_frame(sock)
        assert (kind, call_id) == (REPLY, 7)
        error = wire.decode_error(body)
        assert isinstance(error, api.InvalidRequest)
        assert "already in flight" in error.message
    finally:
        sock.close()
    wait_until(lambda: server.stats().in_flight == 0 and server.engine.health().in_flight == 0)
    assert server.engine.metrics().cancelled == 1


def test_a_framed_target_outside_a_private_directory_is_refused(
    remote: RemoteFactory, serve: ServeFactory
) -> None:
    """The token is offered only to a socket in a directory no one else may enter: a framed
    target elsewhere (here a world-readable directory; another user could have put a socket
    there) fails load with InvalidRequest before connecting."""
    server = serve(config(), transport="framed", security=ServerSecurity(token="secret"))
    assert server.address is not None
    path = Path(server.address.removeprefix("unix:"))
    path.parent.chmod(0o755)
    try:
        with pytest.raises(api.InvalidRequest, match="private directory"):
            remote(config(target=server.address, transport="framed"))
    finally:
        path.parent.chmod(0o700)
    assert server.stats().unauthenticated == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="serving as another user needs root")
def test_a_server_of_another_user_never_sees_the_token(
    private_dir: Path, remote: RemoteFactory, tmp_path: Path
) -> None:
    """A socket served by another user (the directory swapped after the check, or a path
    someone else could write) is refused before the greeting with Unauthenticated: the token
    never leaves."""
    path = private_dir / "engine.sock"
    private_dir.chmod(0o777)
    token_file = tmp_path / "token"
    token_file.write_text("secret")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: listen as nobody, report what it reads
        try:
            os.close(read_end)
            os.setuid(65534)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(path))
            listener.listen(1)
            os.write(write_end, b"L")
            sock, _ = listener.accept()
            sock.settimeout(10)
            os.write(write_end, sock.recv(4096) or b"-")
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        assert os.read(read_end, 1) == b"L"
        private_dir.chmod(0o700)
        with pytest.raises(Unauthenticated, match="not this user"):
            remote(config(target=f"unix:{path}", transport="framed", token_file=str(token_file)))
        received = os.read(read_end, 4096)
        assert received
        assert b"secret" not in received
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)


def test_a_call_racing_close_is_not_ready(
    remote: RemoteFactory, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() from another thread landing between a call's check of the engine and its send
    (forced here) is NotReady, not an untyped error from the closed channel (which the
    result check would have called MalformedOutput)."""
    engine = remote(config(in_process="fake", transport=transport))
    prefill(engine)
    original = engine._serving_link

    def closed_meanwhile(*, restart: bool) -> tuple[object, object]:
        link = original(restart=restart)
        engine.close()
        return link

    monkeypatch.setattr(engine, "_serving_link", closed_meanwhile)
    with pytest.raises(api.NotReady, match="closed"):
        decode(engine, 3)


def test_close_during_a_decode_is_outcome_unknown(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """A decode in flight when another thread closes the engine may have run on the server
    (which outlives the close): OutcomeUnknown, never NotReady (which says nothing ran)."""
    server = serve(config(faults=delay("decode", 10_000)), transport=transport)
    assert server.address is not None
    engine = remote(config(target=server.address, transport=transport))
    prefill(engine)
    pending = Background(lambda: decode(engine, 3))
    wait_until(lambda: server.engine.health().in_flight == 1)
    engine.close()
    with pytest.raises(OutcomeUnknown, match="closed"):
        pending.result()


def test_import_chunks_sent_ahead_of_a_busy_server_are_bounded(
    monkeypatch: pytest.MonkeyPatch, private_dir: Path
) -> None:
    """An import queued for a pool thread (every one busy) takes none of its chunks: a client
    streaming them regardless has at most 64 MiB held for it, then the stream is refused with
    a retryable ResourceExhausted (nothing imported) instead of the server buffering whatever
    it is sent. (The framed pool has a thread for every call it admits, so an import waits
    for one only in the moment before it starts; here a pool of five makes it wait.)"""
    engine = api.load_engine("fake", config())
    gate = threading.Event()
    release = engine.release

    def held_release(request: api.ReleaseRequest) -> api.ReleaseResult:
        gate.wait(60)
        return release(request)

    monkeypatch.setattr(engine, "release", held_release)
    server = EngineServer(engine, max_workers=5)
    framed = FramedServer(server)
    framed.pool.shutdown()
    framed.pool = futures.ThreadPoolExecutor(max_workers=5)
    framed.start(private_dir / "engine.sock")
    releasing, streaming = _greeted(private_dir), _greeted(private_dir)
    try:
        for call_id in range(1, 7):  # its own thread and all five of the pool's
            releasing.sendall(
                encode_frame(CALL, call_id, wire.encode(api.ReleaseRequest(session=_REF)))
            )
        wait_until(lambda: server.stats().in_flight == 6)
        streaming.sendall(encode_frame(CALL, 1, wire.encode(api.ReleaseRequest(session=_REF))))
        wait_until(lambda: server.stats().in_flight == 7)
        streaming.sendall(encode_frame(IMPORT, 2, b""))  # queued: no thread is free
        chunk = bytes(1 << 20)
        tracemalloc.start()
        try:
            for _ in range(100):
                streaming.sendall(encode_frame(CHUNK, 2, chunk))
            # Answered by the reading thread once it handled every chunk before it.
            streaming.sendall(encode_frame(99, 3, b""))
            assert read_frame(streaming)[:2] == (REPLY, 3)
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert held < 64 << 20, f"{held} bytes of a queued import's chunks are held"
        gate.set()
        replies = {}
        while 2 not in replies:
            _, call_id, body = read_frame(streaming)
            replies[call_id] = body
        refused = wire.decode_error(replies[2])
        assert isinstance(refused, api.ResourceExhausted)
        assert refused.retryable
        assert refused.details["resource"] == "import_queue_bytes"
    finally:
        gate.set()
        releasing.close()
        streaming.close()
        framed.stop(grace=5)
        engine.close()


_REF = api.SessionRef(session_id="gone", epoch=1)


def _greeted(directory: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(directory / "engine.sock"))
    sock.sendall(encode_frame(HELLO, 0, msgspec.msgpack.encode({})))
    assert read_frame(sock)[0] == HELLO
    return sock
