"""Session snapshots over gRPC: export streams the chunks from the server, import streams them
to it. Live sessions move between two engines in two child processes mid-decode and continue
bit for bit; truncated, extended or corrupted streams and a peer dying mid-stream give typed
errors and change nothing."""

from __future__ import annotations

import os
import signal
from collections.abc import Generator, Iterator
from pathlib import Path

import grpc
import msgspec
import pytest
from conftest import Background, RemoteFactory, ServeFactory, fill, ref, shard, wait_until

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_api.wire import SNAPSHOT_CHUNK_BYTES
from shard_engine_remote import DEFAULT_MAX_MESSAGE_BYTES, EngineServer, RemoteUnavailable
from shard_engine_remote._callers import CallContext
from shard_engine_remote._framed import FramedLink
from shard_engine_remote._wire import (
    IMPORT_METHOD,
    ImportHeader,
    Rejected,
    RemoteRequest,
    encode_header,
)

LONG_PROMPT = tuple(index % 500 + 1 for index in range(1500))
"""Long enough for the fake's state to span two snapshot chunks."""


def config(**options: object) -> api.LoadConfig:
    """A full fake shard taking the long prompt in one prefill."""
    return api.LoadConfig(shard=shard(), max_batch_tokens=2048, options=dict(options))


def _prefill(engine: api.ShardEngine, session: str, tokens: tuple[int, ...]) -> None:
    engine.prefill(
        api.PrefillRequest(
            request_id=f"p-{session}",
            session=ref(session),
            start_pos=0,
            inputs=api.TokenInput(token_ids=tokens),
        )
    )


def _step(engine: api.ShardEngine, session: str, pos: int) -> bytes:
    result = engine.decode(
        api.DecodeRequest(
            request_id=f"d-{session}-{pos}",
            session=ref(session),
            pos=pos,
            inputs=api.TokenInput(token_ids=(pos % 97 + 1,)),
        )
    )
    assert isinstance(result, api.LogitsResult)
    return bytes(result.payload)


def _export(engine: api.ShardEngine, session: str) -> api.SessionSnapshot:
    return engine.export_session(
        api.ExportSessionRequest(request_id=f"e-{session}", session=ref(session))
    )


def _import(engine: api.ShardEngine, snapshot: api.SessionSnapshot) -> api.ImportSessionResult:
    return engine.import_session(api.ImportSessionRequest(request_id="i", snapshot=snapshot))


def _unchanged_and_empty(engine: api.ShardEngine, session: str = "s") -> None:
    """Nothing was imported: no session, no import counted, the session is unknown."""
    assert engine.health().sessions == 0
    assert engine.metrics().imports == 0
    with pytest.raises(api.CacheMiss):
        _step(engine, session, 3)


def test_live_sessions_move_between_child_processes(remote: RemoteFactory, transport: str) -> None:
    """A worker moves two live sessions (one spanning two chunks) from one spawned engine to
    another mid-decode; both continue exactly as they would have where they were, and the
    source is left as it was."""
    source = remote(config(spawn="fake", transport=transport))
    target = remote(config(spawn="fake", transport=transport))
    assert source.child_pid != target.child_pid
    prompts = {"short": (5, 6, 7), "long": LONG_PROMPT}
    for session, prompt in prompts.items():
        _prefill(source, session, prompt)
        for pos in range(len(prompt), len(prompt) + 3):
            _step(source, session, pos)
    before = source.health()
    snapshots = {session: _export(source, session) for session in prompts}
    assert len(snapshots["long"].chunks) == 2
    assert source.health() == before, "export leaves the source unchanged"
    for session, snapshot in snapshots.items():
        result = _import(target, snapshot)
        assert (result.session, result.length) == (ref(session), len(prompts[session]) + 3)
    for session, prompt in prompts.items():
        for pos in range(len(prompt) + 3, len(prompt) + 8):
            assert _step(target, session, pos) == _step(source, session, pos), (session, pos)
    assert target.metrics().imports == 2
    assert source.metrics().exports == 2


def test_corrupted_chunk_is_refused(remote: RemoteFactory, transport: str) -> None:
    """A chunk changed in transit fails the engine's checksum: ChecksumMismatch (retryable),
    nothing imported."""
    source = remote(config(in_process="fake", transport=transport))
    target = remote(config(in_process="fake", transport=transport))
    _prefill(source, "s", (1, 2, 3))
    snapshot = _export(source, "s")
    chunk = bytearray(snapshot.chunks[0])
    chunk[len(chunk) // 2] ^= 0x01
    corrupted = msgspec.structs.replace(snapshot, chunks=(bytes(chunk),))
    with pytest.raises(api.ChecksumMismatch) as caught:
        _import(target, corrupted)
    assert caught.value.retryable
    truncated = msgspec.structs.replace(snapshot, chunks=(snapshot.chunks[0][:-1],))
    with pytest.raises(api.ChecksumMismatch):
        _import(target, truncated)
    _unchanged_and_empty(target)
    _import(target, snapshot)
    assert _step(target, "s", 3) == _step(source, "s", 3)


def _raw_import(
    server: EngineServer, messages: Iterator[bytes], transport: str = "grpc"
) -> api.ShardEngineError:
    """Send an import stream as a hostile or dying client would; the server's typed answer."""
    assert server.address is not None
    if transport == "framed":
        link = FramedLink(
            Path(server.address.removeprefix("unix:")),
            token=None,
            max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
        )
        try:
            answer = link.import_(messages, 10)
        finally:
            link.close()
        assert isinstance(answer, api.ErrorInfo), answer
        return wire.error_from_info(answer)
    with grpc.insecure_channel(server.address) as channel:
        call: grpc.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(IMPORT_METHOD)
        reply = call(messages, timeout=10)
    return wire.decode_error(reply)


def _header(snapshot: api.SessionSnapshot, n_chunks: int) -> bytes:
    request = api.ImportSessionRequest(
        request_id="raw", snapshot=msgspec.structs.replace(snapshot, chunks=())
    )
    return encode_header(ImportHeader(request=request, n_chunks=n_chunks))


def test_broken_import_streams_change_nothing(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """Streams that end early, carry more chunks than announced, oversized chunks, garbage
    headers, chunks inside the header, or a client that dies mid-stream: each is refused
    (typed, or the stream is cut) before the engine sees anything."""
    source = remote(config(in_process="fake"))
    _prefill(source, "s", LONG_PROMPT)
    snapshot = _export(source, "s")
    first, second = snapshot.chunks
    server = serve(config(), transport=transport)
    cases: dict[str, tuple[list[bytes], type[api.ShardEngineError], str]] = {
        "truncated": ([_header(snapshot, 2), first], api.InvalidRequest, "ended after 1 of 2"),
        "extended": (
            [_header(snapshot, 2), first, second, b"x"],
            api.InvalidRequest,
            "more than the 2 chunks",
        ),
        "chunk too large": (
            [_header(snapshot, 2), first + second],
            api.InvalidRequest,
            "more than the chunk size",
        ),
        "bytes appended": (
            [_header(snapshot, 2), first, second + b"x"],
            api.ChecksumMismatch,
            "extended",
        ),
        "garbage header": ([b"\xc1\x00", first], api.InvalidRequest, "does not decode"),
        "empty": ([], api.InvalidRequest, "empty"),
    }
    for name, (messages, error_type, match) in cases.items():
        error = _raw_import(server, iter(messages), transport)
        assert type(error) is error_type, (name, error)
        assert match in error.message, (name, error.message)
    inline = api.ImportSessionRequest(request_id="raw", snapshot=snapshot)
    error = _raw_import(
        server, iter([encode_header(ImportHeader(request=inline, n_chunks=0))]), transport
    )
    assert "no chunks" in error.message

    def dying() -> Iterator[bytes]:
        yield _header(snapshot, 2)
        yield first
        raise ConnectionError("the client died mid-stream")

    with pytest.raises((grpc.RpcError, ConnectionError)):
        _raw_import(server, dying(), transport)
    wait_until(lambda: server.stats().in_flight == 0)
    assert server.engine.health().sessions == 0
    assert server.engine.metrics().imports == 0
    assert server.stats().rejected_frames == 1


def test_server_dying_mid_export_is_engine_crashed(remote: RemoteFactory, transport: str) -> None:
    """kill -9 of the child while it exports: EngineCrashed naming the signal, never a
    snapshot."""
    plan = {
        "rules": [
            {"action": {"kind": "delay", "milliseconds": 5000}, "operations": ["export_session"]}
        ]
    }
    engine = remote(config(spawn="fake", transport=transport, faults=plan))
    _prefill(engine, "s", (1, 2, 3))
    pid = engine.child_pid
    assert pid is not None
    pending = Background(lambda: _export(engine, "s"))
    wait_until(lambda: engine.server_stats().in_flight >= 2)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(api.EngineCrashed, match="SIGKILL"):
        pending.result()


class _HostileServer(EngineServer):
    """Serves everything honestly but export, whose stream it damages as ``mode`` says."""

    mode = "truncate"

    def serve_export(
        self, request: RemoteRequest | Rejected, context: CallContext
    ) -> Generator[bytes, None, None]:
        messages = list(super().serve_export(request, context))
        if self.mode == "truncate":
            yield from messages[:-1]
        elif self.mode == "extend":
            yield from [*messages, b"more"]
        elif self.mode == "bloat":
            # A chunk past the chunk size: refused as it arrives, before the rest is read.
            yield from [messages[0], bytes(SNAPSHOT_CHUNK_BYTES + 1), *messages[2:]]
        elif self.mode == "flip":
            last = bytearray(messages[-1])
            last[0] ^= 0xFF
            yield from [*messages[:-1], bytes(last)]
        else:
            yield b"\xc1"


@pytest.mark.parametrize(
    ("mode", "error_type"),
    [
        ("truncate", api.MalformedOutput),
        ("extend", api.MalformedOutput),
        ("bloat", api.MalformedOutput),
        ("flip", api.ChecksumMismatch),
        ("garbage", api.MalformedOutput),
    ],
)
def test_damaged_export_streams_are_typed_errors(
    serve: ServeFactory,
    remote: RemoteFactory,
    mode: str,
    error_type: type[api.ShardEngineError],
    transport: str,
) -> None:
    server = serve(config(), transport=transport, server_type=_HostileServer)
    assert isinstance(server, _HostileServer)
    assert server.address is not None
    server.mode = mode
    engine = remote(config(target=server.address, transport=transport))
    _prefill(engine, "s", LONG_PROMPT)
    with pytest.raises(error_type):
        _export(engine, "s")
    assert engine.health().sessions == 1
    _step(engine, "s", len(LONG_PROMPT))


def test_snapshots_do_not_travel_through_call(serve: ServeFactory) -> None:
    """Call refuses snapshot requests (they have their own streams): InvalidRequest."""
    server = serve()
    assert server.address is not None
    request = api.ExportSessionRequest(request_id="e", session=ref("s"))
    with grpc.insecure_channel(server.address) as channel:
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/shard_engine.v1.Engine/Call"
        )
        error = wire.decode_error(call(wire.encode(request), timeout=5))
    assert isinstance(error, api.InvalidRequest)
    assert "streams" in error.message


def test_export_past_its_deadline_cancels_the_engine_work(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """An export whose deadline passes while the engine works: the client gets
    RemoteUnavailable (the source is unchanged, so retrying is safe), the server cancels the
    export, and the session decodes on."""
    plan = {
        "rules": [
            {"action": {"kind": "delay", "milliseconds": 3000}, "operations": ["export_session"]}
        ]
    }
    server = serve(config(faults=plan), transport=transport)
    assert server.address is not None
    engine = remote(config(target=server.address, transport=transport, timeout_s=0.5))
    _prefill(engine, "s", (1, 2, 3))
    with pytest.raises(RemoteUnavailable):
        _export(engine, "s")
    wait_until(lambda: server.engine.metrics().cancelled == 1)
    assert server.stats().transport_cancels == 1
    _step(engine, "s", 3)


class _CuttingServer(EngineServer):
    """Serves everything honestly but export, whose stream ends after ``keep`` messages
    (header first, then the chunks), as a server dying between two of them would leave it."""

    keep = 0

    def serve_export(
        self, request: RemoteRequest | Rejected, context: CallContext
    ) -> Generator[bytes, None, None]:
        yield from list(super().serve_export(request, context))[: self.keep]


def test_export_streams_cut_after_any_message_are_malformed(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """An export stream that ends after its k-th message, for every k short of the whole (a
    snapshot of several chunks): MalformedOutput each time, never a snapshot, and the source
    session is unchanged."""
    server = serve(config(), transport=transport, server_type=_CuttingServer)
    assert isinstance(server, _CuttingServer)
    assert server.address is not None
    engine = remote(config(target=server.address, transport=transport))
    session = ref("s")
    fill(engine, session, 1497)
    server.keep = 1 << 30
    n_messages = 1 + len(_export(engine, "s").chunks)
    assert n_messages >= 3
    for keep in range(n_messages):
        server.keep = keep
        with pytest.raises(api.MalformedOutput, match="ended"):
            _export(engine, "s")
    assert engine.health().sessions == 1
    _step(engine, "s", 1497)
