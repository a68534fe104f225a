"""Clients that hold what they should not: snapshot streams opened and never finished (over
both transports), one framed connection queueing call after call, credentials in the wrong
place. Each is refused (typed, counted) or cut off, and a well-behaved client keeps getting
answers throughout."""

from __future__ import annotations

import errno
import shutil
import socket
import tempfile
import threading
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
    delay,
    fill,
    prefill,
    slow_reader_channel,
    wait_until,
)

import shard_engine_api as api
from shard_engine_remote import EngineServer, ServerSecurity
from shard_engine_remote._framed import FramedServer
from shard_engine_remote._framed.frames import HELLO, IMPORT, encode_frame
from shard_engine_remote._wire import CALL_METHOD, EXPORT_METHOD, IMPORT_METHOD, encode_request

TOKEN = "hostile-token"
IDLE_S = 0.5
"""The servers' stream idle limit here: short, so a stalled stream is cut off within a test."""


class _StalledGrpcImports:
    """``count`` gRPC import streams that send nothing until released."""

    def __init__(self, address: str, count: int) -> None:
        self._release = threading.Event()
        self._channel = grpc.insecure_channel(address)
        stream: grpc.StreamUnaryMultiCallable[bytes, bytes]
        stream = self._channel.stream_unary(IMPORT_METHOD)
        metadata = (("authorization", f"Bearer {TOKEN}"),)

        def silent() -> Iterator[bytes]:
            self._release.wait(30)
            yield b""

        def call() -> object:
            try:
                return stream(silent(), metadata=metadata, timeout=30)
            except grpc.RpcError as error:
                return error.code()

        self.calls = [Background(call) for _ in range(count)]

    def close(self) -> None:
        self._release.set()
        for call in self.calls:
            call.result()
        self._channel.close()


class _StalledFramedImports:
    """One framed connection opening ``count`` import streams that send nothing."""

    def __init__(self, address: str, count: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(address.removeprefix("unix:"))
        self.sock.sendall(encode_frame(HELLO, 0, msgspec.msgpack.encode({"token": TOKEN})))
        self.sock.recv(64)
        # Its refusals are read (and dropped): a client that stops reading loses only its
        # own connection, which is another test's matter.
        self._drain = threading.Thread(target=self._read, daemon=True)
        self._drain.start()
        self.sock.sendall(b"".join(encode_frame(IMPORT, 100 + n, b"") for n in range(count)))

    def _read(self) -> None:
        try:
            while self.sock.recv(1 << 16):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self._drain.join(10)
        self.sock.close()


@pytest.fixture
def guarded(serve: ServeFactory, transport: str) -> EngineServer:
    """A fake engine served with a token, 8 threads (4 compute slots, 2 of them for streams)
    and a short stream idle limit."""
    return serve(
        config(),
        transport=transport,
        security=ServerSecurity(token=TOKEN),
        max_workers=8,
        stream_idle_s=IDLE_S,
    )


@pytest.fixture
def worker(guarded: EngineServer, remote: RemoteFactory, transport: str, tmp_path: Path) -> object:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    assert guarded.address is not None
    engine = remote(config(target=guarded.address, transport=transport, token_file=str(token_file)))
    prefill(engine)
    return engine


def test_stalled_import_streams_pin_nothing_and_are_cut_off(
    guarded: EngineServer, worker: api.ShardEngine, transport: str
) -> None:
    """Twenty import streams that never send. A stream's header is waited for before the
    stream takes its slots, over gRPC as a call's request is: they hold no stream slot, nor
    a place in the streams' queue, and are cut off (over gRPC stalled: evicted by one
    another, the last at the idle limit; on the framed transport each at the idle limit,
    those beyond its share of the connection refused busy at once) while another client's
    export is served. Every other client keeps being served, and nothing was imported. (On
    the framed transport two took the stream slots, and once streams waited for a slot in
    a queue, the other 18 waited there for their turn to stall: nine idle limits.)"""
    assert guarded.address is not None
    stalled: _StalledGrpcImports | _StalledFramedImports
    if transport == "grpc":
        stalled = _StalledGrpcImports(guarded.address, 20)
    else:
        stalled = _StalledFramedImports(guarded.address, 20)
    try:
        request = api.ExportSessionRequest(
            request_id="e", session=api.SessionRef(session_id="s", epoch=1)
        )
        if transport == "grpc":
            wait_until(lambda: guarded.stats().stalled >= 16)
        assert worker.export_session(request).length == 3
        assert guarded.stats().streams_queued == 0
        for position in range(3, 8):
            decode(worker, position)
        # The streams waiting for their headers are cut off at their idle limit.
        if transport == "framed":
            wait_until(lambda: guarded.stats().transport_cancels + guarded.stats().busy >= 20)
        wait_until(lambda: guarded.stats().in_flight == 0)
        decode(worker, 8)
        metrics = guarded.engine.metrics()
        assert (metrics.imports, metrics.sessions_active) == (0, 1), "nothing was imported"
    finally:
        stalled.close()


def test_one_connection_cannot_take_every_queued_call(
    serve: ServeFactory, remote: RemoteFactory
) -> None:
    """A framed connection queueing a thousand calls that never finish gets a share of the
    server's queue (the rest busy); another connection's calls are still admitted and
    answered."""
    server = serve(config(), transport="framed", stream_idle_s=IDLE_S)
    assert server.address is not None
    stalled = _StalledFramedImports(server.address, 1000)
    try:
        worker = remote(config(target=server.address, transport="framed"))
        wait_until(lambda: server.stats().busy >= 1000 - 2 * server.max_workers - 1)
        prefill(worker)
        decode(worker, 3)
    finally:
        stalled.close()


@pytest.mark.parametrize(
    "metadata",
    [
        (("x-token", TOKEN),),
        (("authorization", TOKEN),),
        (("authorization", f"bearer {TOKEN}"),),
        (("authorization", f"Bearer {TOKEN} "),),
        (("authorization", f"Bearer {TOKEN}x"),),
        (("authorization", "Bearer "),),
        (("authorization", "Bearer " + "x" * 100_000),),
    ],
    ids=["other-key", "no-scheme", "lowercase", "trailing-space", "longer", "empty", "huge"],
)
def test_credentials_anywhere_else_are_refused(
    serve: ServeFactory, metadata: tuple[tuple[str, str], ...]
) -> None:
    """The token under another metadata key, without its scheme, in another case, with more
    characters, empty or oversized is refused before any decoding (UNAUTHENTICATED, counted;
    gRPC itself refuses metadata over its limit); the server keeps serving."""
    server = serve(config(), security=ServerSecurity(token=TOKEN))
    assert server.address is not None
    query = msgspec.msgpack.encode({"type": "health_query"})
    with grpc.insecure_channel(server.address) as channel:
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(CALL_METHOD)
        with pytest.raises(grpc.RpcError) as refused:
            call(query, metadata=metadata, timeout=10)
        code = cast(grpc.Call, refused.value).code()
        assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            assert server.stats().unauthenticated == 1
        answer = call(query, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)
        assert isinstance(answer, bytes)
        assert server.stats().unauthenticated <= 1


def test_a_client_cannot_cancel_another_clients_work(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """A second client naming the first one's request id or session in a cancel stops
    nothing and learns nothing (``cancelled=False``, as for a request not in flight); the
    first client's own cancel still stops its work (Cancelled, rolled back). gRPC is served
    on a unix socket here, where every client has the same peer address."""
    directory = Path(tempfile.mkdtemp(prefix="shard-engine-test-"))
    server = serve(
        config(faults=delay("prefill", 3000)),
        transport=transport,
        listen=f"unix:{directory / 'engine.sock'}",
    )
    assert server.address is not None
    owner = remote(config(target=server.address, transport=transport))
    stranger = remote(config(target=server.address, transport=transport))
    pending = Background(lambda: prefill(owner, session="mine", request_id="slow"))
    wait_until(lambda: server.engine.health().in_flight == 1)
    assert not stranger.cancel(api.CancelRequest(request_id="slow")).cancelled
    assert not stranger.cancel(api.CancelRequest(session_id="mine")).cancelled
    assert server.engine.health().in_flight == 1
    assert owner.cancel(api.CancelRequest(session_id="mine")).cancelled
    with pytest.raises(api.Cancelled):
        pending.result()
    assert server.engine.health().sessions == 0
    if transport == "grpc":
        server.stop(grace=0.5)
    shutil.rmtree(directory, ignore_errors=True)


def _step(request_id: str, session: str, pos: int = 3) -> api.DecodeRequest:
    return api.DecodeRequest(
        request_id=request_id,
        session=api.SessionRef(session_id=session, epoch=1),
        pos=pos,
        inputs=api.TokenInput(token_ids=(5,)),
    )


def _length(server: EngineServer, session: str) -> int | None:
    entry = server.engine._ledger.sessions.get(session)  # type: ignore[attr-defined]
    return None if entry is None else int(entry.length)


def test_a_cancel_reaches_only_the_callers_own_calls(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """What a client's cancel names is translated into cancels of that client's own calls:
    (a) an id that is one of the client's own batch items cancels that batch, not another
    client's decode whose request id is the same; (b) a session both clients have work on
    cancels only the caller's work there. (Both used to reach the other client's call: the
    cancel went to the engine, whose request ids and sessions all clients share.)"""
    server = serve(
        config(faults=delay("decode", 1000, operations=["decode", "decode_batch"])),
        transport=transport,
    )
    assert server.address is not None
    a = remote(config(target=server.address, transport=transport))
    b = remote(config(target=server.address, transport=transport))
    for session in ("a1", "b1", "shared"):
        prefill(a, session=session)

    batch = api.DecodeBatchRequest(request_id="A-batch", items=(_step("X", "a1"),))
    mine = Background(lambda: a.decode_batch(batch))
    theirs = Background(lambda: b.decode(_step("X", "b1")))
    wait_until(lambda: server.engine.health().in_flight == 2)
    assert a.cancel(api.CancelRequest(request_id="X")) == api.CancelResult(
        cancelled=True, n_requests=1
    )
    with pytest.raises(api.Cancelled):
        mine.result()
    result = theirs.result()
    assert isinstance(result, api.LogitsResult)
    assert result.request_id == "X"
    assert (_length(server, "a1"), _length(server, "b1")) == (3, 4)

    mine = Background(lambda: a.decode(_step("A3", "shared")))
    wait_until(lambda: server.engine.health().in_flight == 1)
    theirs = Background(
        lambda: b.prefill(
            api.PrefillRequest(
                request_id="B3",
                session=api.SessionRef(session_id="shared", epoch=1),
                start_pos=3,
                inputs=api.TokenInput(token_ids=(9,)),
            )
        )
    )
    wait_until(lambda: server.engine.health().in_flight == 2)
    assert a.cancel(api.CancelRequest(session_id="shared")) == api.CancelResult(
        cancelled=True, n_requests=1
    )
    with pytest.raises(api.Cancelled):
        mine.result()
    assert isinstance(theirs.result(), api.LogitsResult)
    assert _length(server, "shared") == 4
    assert server.engine.metrics().cancelled == 2


def test_request_ids_are_each_clients_own(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """Two clients may use the same request id at once (the engine runs each under an id of
    the server's making; results and errors carry the client's own): the second used to be
    refused "already in flight". One client's second call with an id it has in flight is
    refused as an engine refuses it, and its cancel of that id stops only its own call."""
    server = serve(config(faults=delay("prefill", 1000)), transport=transport)
    assert server.address is not None
    a = remote(config(target=server.address, transport=transport))
    b = remote(config(target=server.address, transport=transport))
    mine = Background(lambda: prefill(a, session="sa", request_id="req-1"))
    wait_until(lambda: server.engine.health().in_flight == 1)
    theirs = Background(lambda: prefill(b, (4, 5), session="sb", request_id="req-1"))
    wait_until(lambda: server.engine.health().in_flight == 2)
    with pytest.raises(api.InvalidRequest, match="'req-1' is already in flight"):
        prefill(a, session="sc", request_id="req-1")
    assert a.cancel(api.CancelRequest(request_id="req-1")) == api.CancelResult(
        cancelled=True, n_requests=1
    )
    with pytest.raises(api.Cancelled, match="'req-1'") as cancelled:
        mine.result()
    assert ":req-1" not in cancelled.value.message
    result = theirs.result()
    assert isinstance(result, api.LogitsResult)
    assert result.request_id == "req-1"
    assert (_length(server, "sa"), _length(server, "sb"), _length(server, "sc")) == (None, 2, None)
    # Free again once it ended.
    assert prefill(a, session="sa", request_id="req-1").request_id == "req-1"


def test_abandoned_calls_queued_behind_a_long_one_free_their_slots_at_once(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """A client whose calls pass their deadline while they wait behind another client's long
    operation: each call's cancel ends its wait in the engine at once, so its server slot is
    free again long before that operation ends (the slots used to stay taken until then, and
    other clients got ResourceExhausted)."""
    server = serve(config(faults=delay("prefill", 20_000)), transport=transport, max_workers=8)
    assert server.address is not None
    patient = remote(config(target=server.address, transport=transport))
    hasty = remote(config(target=server.address, transport=transport, timeout_s=0.05))
    other = remote(config(target=server.address, transport=transport))
    long = Background(lambda: prefill(patient, session="long", request_id="long"))
    wait_until(lambda: server.engine.health().in_flight == 1)
    for n in range(2 * (server.max_workers - 4)):
        with pytest.raises(api.OutcomeUnknown):
            decode(hasty, 0, session=f"other-{n}", request_id=f"h{n}")
        wait_until(lambda: server.stats().in_flight == 1, timeout=5)
        assert server.engine.health().in_flight == 1  # the long prefill still runs
    stats = server.stats()
    assert (stats.busy, stats.transport_cancels) == (0, 2 * (server.max_workers - 4))
    assert server.engine.metrics().cancelled == 2 * (server.max_workers - 4)
    assert patient.cancel(api.CancelRequest(request_id="long")).cancelled
    with pytest.raises(api.Cancelled):
        long.result()
    with pytest.raises(api.CacheMiss):
        decode(other, 0, session="never")


class _ExhaustedListener(socket.socket):
    """A listening socket whose first two accepts fail as a process out of descriptors does."""

    failures = 2

    def accept(self) -> tuple[socket.socket, object]:
        if _ExhaustedListener.failures:
            _ExhaustedListener.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


def test_running_out_of_descriptors_does_not_stop_accepting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, remote: RemoteFactory
) -> None:
    """accept() failing with EMFILE (a connection flood used up the process's descriptors)
    is counted (busy) and retried: the framed server goes on accepting once descriptors are
    free, instead of never again."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setattr(socket, "socket", _ExhaustedListener)
    engine = api.load_engine("fake", config())
    server = FramedServer(EngineServer(engine))
    try:
        address = server.start(private / "engine.sock")
        monkeypatch.undo()
        worker = remote(config(target=address, transport="framed"))
        prefill(worker)
        assert server.server.stats().busy == 2
    finally:
        server.stop(grace=0.5)
        engine.close()


def test_an_export_the_client_stops_reading_is_cut_off(
    serve: ServeFactory, remote: RemoteFactory
) -> None:
    """A gRPC client that opens an export and stops reading it (a small flow-control window,
    so the server's send waits on it) holds the stream's slots only for ``stream_idle_s``:
    then the server cancels the RPC, counts it, and the next client's export is served. (The
    framed server cuts such a connection when its send times out.)"""
    server = serve(config(), max_workers=5, stream_idle_s=IDLE_S)  # one stream slot
    assert server.address is not None
    worker = remote(config(target=server.address))
    session = api.SessionRef(session_id="big", epoch=1)
    fill(worker, session, 1497)
    request = api.ExportSessionRequest(request_id="e", session=session)
    channel = slow_reader_channel(server.address)
    try:
        export: grpc.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(EXPORT_METHOD)
        stalled = export(encode_request(request), timeout=60)
        next(stalled)  # the header: the stream holds its slots now
        wait_until(lambda: server.stats().in_flight == 0, timeout=20)
        assert server.stats().transport_cancels >= 1
        snapshot = worker.export_session(request)
        assert snapshot.state_bytes > 1 << 20
        stalled.cancel()
    finally:
        channel.close()


def test_calls_whose_message_never_comes_hold_no_thread_without_credentials(
    serve: ServeFactory, remote: RemoteFactory, tmp_path: Path
) -> None:
    """gRPC's sync server waits on a pool thread for a unary call's message. Calls without
    the token (to Call, which is refused unread) and health checks (which need none) whose
    message never comes hold at most two of the server's threads, for at most a few seconds:
    a client with the token keeps being served while dozens of them hang."""
    server = serve(config(), security=ServerSecurity(token=TOKEN), max_workers=8)
    assert server.address is not None
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    worker = remote(
        config(
            target=server.address, token_file=str(token_file), timeout_s=10, control_timeout_s=10
        )
    )
    prefill(worker)
    release = threading.Event()
    # Two connections of 12 calls each: the server lets a connection open 16 streams at once
    # (2 * max_workers), and a refused call whose client never ends its message may keep its
    # stream open on the client's side, so calls queued behind 16 on one connection may never
    # be sent at all. (A local subchannel pool each: channels to one address otherwise share
    # one connection.)
    channels = [
        grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(2)
    ]

    def silent() -> Iterator[bytes]:
        release.wait(60)
        yield from ()

    try:
        stalled = []
        for channel in channels:
            for method in (CALL_METHOD, "/grpc.health.v1.Health/Check") * 6:
                stream: grpc.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(method)
                stalled.append(stream.future(silent(), timeout=60))
        wait_until(lambda: server.stats().unauthenticated == 12)
        assert decode(worker, 3).first_pos == 3
        assert worker.health().state == "ready"
        release.set()
        codes = {cast(grpc.Call, call.exception()).code() for call in stalled}
        assert grpc.StatusCode.OK not in codes
    finally:
        release.set()
        for channel in channels:
            channel.close()
