"""Hostile framed peers against an in-process framed server: a greeting that carries a
descriptor with every byte, an export read at a trickle, connections that never read their
replies, and connections that greet and then say nothing."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from conftest import (
    FramedPeer,
    RemoteFactory,
    config,
    delay,
    fill,
    read_frame,
    ref,
    wait_until,
)

import shard_engine_api as api
from shard_engine_remote import EngineServer, ServerSecurity
from shard_engine_remote._framed import FramedServer
from shard_engine_remote._framed import connection as framed_connection
from shard_engine_remote._framed.frames import (
    CALL,
    END,
    ERROR,
    EXPORT,
    HEADER,
    HELLO,
    ITEM,
    REPLY,
    encode_frame,
)
from shard_engine_remote._wire import (
    CapabilitiesQuery,
    HealthQuery,
    decode_reply,
    encode_request,
)

TOKEN = "framed-hostile-token"

Serve = Callable[..., tuple[FramedServer, EngineServer]]


@pytest.fixture
def framed() -> Iterator[Serve]:
    """Start in-process framed servers of loaded fake engines (token ``TOKEN``); the
    FramedServer itself is returned too (its connections are inspected)."""
    started: list[tuple[FramedServer, EngineServer, Path]] = []

    def factory(
        load: api.LoadConfig | None = None,
        *,
        connection_idle_s: float = 300.0,
        **kwargs: object,
    ) -> tuple[FramedServer, EngineServer]:
        engine = api.load_engine("fake", load or config())
        server = EngineServer(engine, security=ServerSecurity(token=TOKEN), **kwargs)  # type: ignore[arg-type]
        directory = Path(tempfile.mkdtemp(prefix="shard-engine-test-"))
        serving = FramedServer(server, connection_idle_s=connection_idle_s)
        started.append((serving, server, directory))
        server.address = serving.start(directory / "engine.sock")
        return serving, server

    yield factory
    for serving, server, directory in started:
        serving.stop(grace=0.5)
        server.engine.close()
        shutil.rmtree(directory, ignore_errors=True)


def _path(server: EngineServer) -> str:
    assert server.address is not None
    return server.address.removeprefix("unix:")


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _unread(sock: socket.socket) -> int:
    """Bytes this side sent that the peer has not read yet (SIOCOUTQ)."""
    value = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
    return int(struct.unpack("i", value)[0])


def _peer(server: EngineServer) -> FramedPeer:
    peer = FramedPeer(_path(server), TOKEN)
    kind, _, _ = peer.greeting()
    assert kind == HELLO
    return peer


def _remote_load(server: EngineServer, tmp_path: Path, **options: object) -> api.LoadConfig:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    return config(target=server.address, transport="framed", token_file=str(token_file), **options)


# ----------------------------------------------------------------- F1: descriptors in a greeting


def _flood(path: str, n_bytes: int, devnull: int) -> socket.socket:
    """A peer without the token sending a HELLO (4096-byte body) one byte per message, four
    descriptors with each, ``n_bytes`` of it (or until the server closes the connection)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    data = HEADER.pack(4096, HELLO, 0) + b"\0" * 4096
    for index in range(n_bytes):
        while True:
            try:
                socket.send_fds(sock, [data[index : index + 1]], [devnull] * 4)
                break
            except BlockingIOError:
                time.sleep(0.001)
            except OSError as error:
                if error.errno == 109:  # ETOOMANYREFS: the server has not caught up yet
                    time.sleep(0.001)
                    continue
                return sock  # the server closed the connection
    return sock


def test_a_greeting_cannot_make_the_server_hold_descriptors(
    framed: Serve, remote: RemoteFactory, tmp_path: Path
) -> None:
    """Two unauthenticated peers send their HELLO a byte at a time with four descriptors each
    (16k descriptors if kept): the server takes at most one, refuses each greeting (counted
    as a rejected frame) at the second message, and its descriptor count stays where it was,
    while a client with the token connects and computes meanwhile."""
    _, server = framed()
    engine = remote(_remote_load(server, tmp_path))
    assert engine.capabilities().vocab_size > 0
    before = _open_descriptors()
    peak = [before]
    stop = threading.Event()

    def monitor() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _open_descriptors())
            time.sleep(0.002)

    watcher = threading.Thread(target=monitor, daemon=True)
    watcher.start()
    devnull = os.open(os.devnull, os.O_RDONLY)
    path = _path(server)
    try:
        floods = [_flood(path, 13 + 4095, devnull) for _ in range(2)]
        for flood in floods:
            # Everything sent was read by the server (or the connection is gone).
            wait_until(lambda flood=flood: _unread(flood) == 0)  # type: ignore[misc]
            assert _closed_by_peer(flood), "the refused greeting's connection was closed"
        result = engine.prefill(
            api.PrefillRequest(
                request_id="good",
                session=ref("good"),
                start_pos=0,
                inputs=api.TokenInput(token_ids=(1, 2, 3)),
            )
        )
        assert result.request_id == "good"
        for flood in floods:
            flood.close()
    finally:
        stop.set()
        watcher.join()
        os.close(devnull)
    assert server.stats().rejected_frames == 2
    assert server.stats().unauthenticated == 0
    # The two flood connections (and the monitor's listing) at most, never their descriptors.
    assert peak[0] <= before + 8, (before, peak[0])
    wait_until(lambda: _open_descriptors() <= before + 1)
    assert engine.capabilities().vocab_size > 0


def test_a_greeting_with_several_descriptors_keeps_none(framed: Serve) -> None:
    """A HELLO carrying the token and three descriptors at once: the server closes all three
    at once, refuses the shared memory (counted) and serves the connection over the socket."""
    _, server = framed()
    before = _open_descriptors()
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(3)]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(_path(server))
        hello = msgspec.msgpack.encode({"token": TOKEN, "arena_slots": 4, "arena_slot_bytes": 4096})
        socket.send_fds(sock, [encode_frame(HELLO, 0, hello)], fds)
        kind, _, _ = read_frame(sock)
        assert kind == HELLO
        sock.sendall(encode_frame(CALL, 1, encode_request(CapabilitiesQuery())))
        kind, call_id, body = read_frame(sock)
        assert (kind, call_id) == (REPLY, 1)
        assert isinstance(decode_reply(body), api.Capabilities)
        assert server.stats().refused_shared_memory == 1
        # This side's three and the two ends of the connection, nothing the server received.
        assert _open_descriptors() <= before + 3 + 2
    finally:
        sock.close()
        for fd in fds:
            os.close(fd)


# ----------------------------------------------------------------- F2: a trickled export


def test_a_framed_export_read_at_a_trickle_is_cut_off_and_frees_its_slot(
    framed: Serve, remote: RemoteFactory, tmp_path: Path
) -> None:
    """A client reads a ~9 MB export at ~80 KB/s, far below min_stream_bytes_per_s: at
    ``stream_idle_s + size / rate`` the server ends the stream (counted as stalled), its one
    stream slot is free for another client's export while the slow connection is still open,
    and the slow client finds DEADLINE_EXCEEDED after what it read, never END."""
    load = api.LoadConfig(shard=config().shard, max_context=16384)
    _, server = framed(load, max_workers=5, stream_idle_s=1.0, min_stream_bytes_per_s=4_000_000)
    engine = remote(_remote_load(server, tmp_path, shared_memory=False))
    session = ref("big")
    fill(engine, session, 12000)
    request = api.ExportSessionRequest(request_id="e", session=session)
    size = engine.export_session(request).state_bytes
    assert size > 6_000_000  # beyond what the socket's kernel buffer holds
    due = 1.0 + size / 4_000_000

    slow = _peer(server)
    slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.sock.sendall(encode_frame(EXPORT, 7, encode_request(request)))
    received = bytearray()
    start = time.monotonic()
    while server.stats().stalled == 0:
        assert time.monotonic() - start < due + 5, "the slow export was not cut off"
        received += slow.sock.recv(4096)
        time.sleep(0.05)
    elapsed = time.monotonic() - start
    assert elapsed >= min(due, 1.0) - 0.2
    # The slot is free while the slow client still holds its connection.
    again = engine.export_session(api.ExportSessionRequest(request_id="e2", session=session))
    assert again.state_bytes == size
    # The slow client, reading on: items, then the deadline error, no END.
    slow.sock.settimeout(10)
    kinds: list[int] = []
    while True:
        while len(received) < HEADER.size:
            received += slow.sock.recv(1 << 20)
        length, kind, call_id = HEADER.unpack_from(received)
        while len(received) < HEADER.size + length:
            received += slow.sock.recv(1 << 20)
        body = bytes(received[HEADER.size : HEADER.size + length])
        del received[: HEADER.size + length]
        assert call_id == 7
        kinds.append(kind)
        if kind != ITEM:
            break
    assert kinds[-1] == ERROR
    assert END not in kinds
    status, message = msgspec.msgpack.decode(body)
    assert status == "DEADLINE_EXCEEDED"
    assert "export" in message
    assert server.stats().stalled == 1
    slow.close()


# ----------------------------------------------------------------- F3: replies never read


def _attack_call(connection: int, index: int) -> bytes:
    """A cheap call with a large reply (500 positions of logits: ~1 MB)."""
    return encode_request(
        api.PrefillRequest(
            request_id=f"a{connection}-{index}",
            session=ref(f"attack{connection}-{index}"),
            start_pos=0,
            logits="all",
            inputs=api.TokenInput(token_ids=tuple(range(500))),
        )
    )


def _overlapping(peer: FramedPeer, first: bytes, *others: bytes) -> dict[int, object]:
    """Send ``first`` and ``others`` in one write (the others overlap the first: the server
    cannot serve them on the connection's own thread) and return every reply by position
    (1 for ``first``). Each call has a fresh id: the server may not yet have forgotten the
    ids of an earlier round whose replies already arrived."""
    ids = {peer.fresh_id(): position for position in range(1, len(others) + 2)}
    peer.sock.sendall(
        b"".join(
            encode_frame(CALL, call_id, body)
            for call_id, body in zip(ids, (first, *others), strict=True)
        )
    )
    replies: dict[int, object] = {}
    while len(replies) < len(ids):
        kind, call_id, body = read_frame(peer.sock)
        assert kind == REPLY
        replies[ids[call_id]] = decode_reply(body)
    return replies


def _control_calls() -> tuple[bytes, ...]:
    return (
        encode_request(api.CancelRequest(request_id="nothing")),
        encode_request(HealthQuery()),
        encode_request(CapabilitiesQuery()),
    )


def _check_control_replies(replies: dict[int, object]) -> None:
    assert isinstance(replies[2], api.CancelResult)
    assert not replies[2].cancelled
    assert isinstance(replies[3], api.Health)
    assert isinstance(replies[4], api.Capabilities)


def test_connections_that_never_read_hold_no_pool_place(
    framed: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four connections send bursts of overlapping calls with ~1 MB replies and never read:
    their frames wait to leave without a thread, so the pool's places all come back while
    they are still connected, their reading stops (no new call of theirs is taken) and
    another client's overlapping calls, a cancel among them, are all answered."""
    # A loaded machine may take long over the attack: the server must not drop a non-reading
    # attacker for its send timeout (30 s, tested on its own) meanwhile.
    monkeypatch.setattr(framed_connection, "_SERVER_SEND_TIMEOUT_S", 3600.0)
    load = api.LoadConfig(shard=config().shard, max_sessions=256, kv_budget_tokens=1 << 17)
    serving, server = framed(load, max_workers=8, rate_limit=None)
    attackers = [_peer(server) for _ in range(4)]
    try:
        _attack(serving, server, attackers)
    finally:
        for attacker in attackers:
            attacker.close()


def test_a_connection_that_stops_reading_is_dropped_after_the_send_timeout(
    framed: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client whose replies cannot leave (it never reads: a 4 KiB receive buffer, calls with
    ~1 MB replies until the server stops reading it) loses its connection once a frame has
    waited the send timeout (here 0.5 s instead of 30 s): the server shuts the socket and
    forgets the connection, and a reading client on the same server is answered."""
    monkeypatch.setattr(framed_connection, "_SERVER_SEND_TIMEOUT_S", 0.5)
    load = api.LoadConfig(shard=config().shard, max_sessions=256, kv_budget_tokens=1 << 17)
    serving, server = framed(load, rate_limit=None)
    stalled = _peer(server)
    good = _peer(server)
    try:
        stalled.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.sock.setblocking(False)
        dropped = False
        for index in range(256):  # until the server stops reading it, or drops it
            try:
                stalled.sock.sendall(encode_frame(CALL, index + 1, _attack_call(0, index)))
            except BlockingIOError:
                break
            except (BrokenPipeError, ConnectionResetError):
                dropped = True
                break
        # Backstop only: the drop comes 0.5 s after a frame stops leaving.
        wait_until(lambda: len(serving._connections) == 1, timeout=300)
        if not dropped:
            stalled.sock.setblocking(True)
            stalled.sock.settimeout(60)
            while _recv_or_empty(stalled.sock):  # what had left, then the end the server made
                pass
        replies = _overlapping(good, *_control_calls())
        assert isinstance(replies[1], api.CancelResult)
        assert isinstance(replies[2], api.Health)
    finally:
        stalled.close()
        good.close()


def _recv_or_empty(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 16)
    except ConnectionResetError:
        return b""


def _reading_stopped(serving: FramedServer) -> int:
    """How many connections the server stopped reading: more of their replies wait to leave
    than it lets wait, so it takes no further call of theirs (a reader that never reads keeps
    them waiting)."""
    limit = framed_connection._MAX_OUTGOING_BYTES
    return sum(c._out_bytes > limit for c in list(serving._connections))


def _attack(serving: FramedServer, server: EngineServer, attackers: list[FramedPeer]) -> None:
    for number, attacker in enumerate(attackers):
        attacker.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        attacker.sock.setblocking(False)
        stopped_before = _reading_stopped(serving)
        for pair in range(16):  # two overlapping calls at a time (each finds a compute slot)
            calls = server.stats().calls
            frames = b"".join(
                encode_frame(CALL, 2 * pair + index + 1, _attack_call(number, 2 * pair + index))
                for index in range(2)
            )
            try:
                attacker.sock.sendall(frames)
            except BlockingIOError:
                break  # the server stopped reading this connection
            # Until the server took both calls, or stopped reading this connection (its
            # later frames then wait unread in the socket: no use waiting for them).
            deadline = time.monotonic() + 2
            while (
                server.stats().calls < calls + 2
                and _reading_stopped(serving) == stopped_before
                and time.monotonic() < deadline
            ):
                time.sleep(0.005)
    waiting = [c._out_bytes for c in list(serving._connections)]
    assert len(waiting) == 4
    assert sum(waiting) > 8 << 20, waiting  # replies wait to leave, unread
    # Every place of the pool comes back (no thread waits on a client that does not read).
    # Backstops only (the places come back as soon as the frames are queued).
    wait_until(lambda: all(c._pooled == 0 for c in list(serving._connections)), timeout=300)
    wait_until(lambda: serving._calls._value == server.max_workers * 8, timeout=300)
    good = _peer(server)
    try:
        for round_ in range(3):
            replies = _overlapping(
                good,
                encode_request(
                    api.PrefillRequest(
                        request_id="g",
                        session=ref(f"good{round_}"),
                        start_pos=0,
                        inputs=api.TokenInput(token_ids=tuple(range(400))),
                    )
                ),
                encode_request(api.ReleaseRequest(session=ref("nothing"))),
                *_control_calls(),
            )
            assert isinstance(replies[1], api.ShardResult), replies[1]
            assert isinstance(replies[2], api.ReleaseResult), replies[2]
            replies = {key - 1: value for key, value in replies.items() if key > 2}
            _check_control_replies(replies)
            good.exchange(encode_request(api.ReleaseRequest(session=ref(f"good{round_}"))))
    finally:
        good.close()


def test_control_calls_are_served_when_the_pool_has_no_place(
    framed: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no pool place to be had, a connection's calls overlapping a slow one: a cancel,
    health and capabilities are answered at once (on the connection's own thread), a decode
    gets the retryable busy refusal."""
    serving, server = framed(config(faults=delay("prefill", 1000, session_id="slow")))
    monkeypatch.setattr(serving, "admit", lambda: False)
    peer = _peer(server)
    try:
        slow = encode_request(
            api.PrefillRequest(
                request_id="slow",
                session=ref("slow"),
                start_pos=0,
                inputs=api.TokenInput(token_ids=(1, 2)),
            )
        )
        decode = encode_request(
            api.DecodeRequest(
                request_id="d", session=ref("other"), pos=0, inputs=api.TokenInput(token_ids=(1,))
            )
        )
        peer.sock.sendall(
            encode_frame(CALL, 1, slow)
            + b"".join(encode_frame(CALL, i + 2, call) for i, call in enumerate(_control_calls()))
            + encode_frame(CALL, 5, decode)
        )
        replies: dict[int, object] = {}
        start = time.monotonic()
        while len(replies) < 4:
            kind, call_id, body = read_frame(peer.sock)
            assert kind == REPLY
            replies[call_id] = decode_reply(body)
        assert time.monotonic() - start < 0.9, "the control calls waited for the slow call"
        assert 1 not in replies
        _check_control_replies(replies)
        busy = replies[5]
        assert isinstance(busy, api.ErrorInfo)
        assert busy.code == "resource_exhausted"
        kind, call_id, body = read_frame(peer.sock)
        assert (kind, call_id) == (REPLY, 1)
        assert isinstance(decode_reply(body), api.ShardResult)
    finally:
        peer.close()


# ----------------------------------------------------------------- idle connections


def test_idle_greeted_connections_are_closed_and_clients_reconnect(
    framed: Serve, remote: RemoteFactory, tmp_path: Path
) -> None:
    """connection_idle_s=0.5: a greeted connection with no call is closed after it; one whose
    call runs longer is not closed under it; a remote engine reconnects when it next calls."""
    _, server = framed(
        config(faults=delay("prefill", 1500, session_id="long")), connection_idle_s=0.5
    )
    idle = _peer(server)
    start = time.monotonic()
    assert _closed_by_peer(idle.sock)
    assert 0.4 < time.monotonic() - start < 3
    idle.close()

    busy = _peer(server)
    busy.sock.settimeout(5)
    reply = busy.exchange(
        encode_request(
            api.PrefillRequest(
                request_id="long",
                session=ref("long"),
                start_pos=0,
                inputs=api.TokenInput(token_ids=(1, 2)),
            )
        )
    )
    assert isinstance(decode_reply(reply), api.ShardResult)
    busy.close()

    engine = remote(_remote_load(server, tmp_path))
    assert engine.capabilities().vocab_size > 0
    time.sleep(1.0)
    assert engine.health().state == "ready"
