"""Import streams are admitted from their header before their body is read: a stranger holding
the token cannot make a server buffer what the shard could never hold, and all streams together
hold at most the server's ``max_import_bytes``. Over both transports.

What a refusal costs a framed client in chunks is bounded by construction, whatever the load:
a refused header none (the chunks wait for the server's GO_AHEAD), a chunk refused as it
arrives at most :data:`IMPORT_WINDOW_CHUNKS` (the chunks the server grants ahead of those it
checked). Over gRPC it is what HTTP/2 flow control lets through before the server's handler
reads past the refused message: gRPC core sizes that window from its bandwidth-delay estimate
(up to 1 GiB), so no number holds by construction: on loopback at most 4 chunks of 1 MiB
left before a refused header here (180 refusals), but 4 to 8, once 20, when the handler was
held 0.5 s before reading the header. The 16 asserted below for gRPC is what a handler that
reads at once allows, not a bound gRPC keeps for a late one."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import msgspec
import pytest
from conftest import RemoteFactory, ServeFactory, ref, shard, wait_until

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_api.wire import SNAPSHOT_CHUNK_BYTES
from shard_engine_remote import DEFAULT_MAX_MESSAGE_BYTES, EngineServer
from shard_engine_remote._framed import FramedLink
from shard_engine_remote._framed.frames import IMPORT_WINDOW_CHUNKS
from shard_engine_remote._import_limits import ImportBudget, check_import_header
from shard_engine_remote._wire import IMPORT_METHOD, ImportHeader, encode_header

LONG_PROMPT = tuple(index % 500 + 1 for index in range(1500))
"""Long enough for the fake's state to span two snapshot chunks."""
_GIB = 1 << 30
_CHUNK = b"\x01" * SNAPSHOT_CHUNK_BYTES
_GRPC_AHEAD = 15
"""Chunks a gRPC client is expected to have pulled beyond those the server read (see the
module docstring: not a bound gRPC guarantees)."""
_AHEAD_OF_A_REFUSED_HEADER = {"framed": 0, "grpc": _GRPC_AHEAD}
_AHEAD_OF_A_REFUSED_CHUNK = {"framed": IMPORT_WINDOW_CHUNKS, "grpc": _GRPC_AHEAD}


def _config(**fields: object) -> api.LoadConfig:
    return api.LoadConfig(shard=shard(), max_batch_tokens=2048, **fields)  # type: ignore[arg-type]


def _snapshot(remote: RemoteFactory, prompt: tuple[int, ...] = LONG_PROMPT) -> api.SessionSnapshot:
    source = remote(
        api.LoadConfig(shard=shard(), max_batch_tokens=2048, options={"in_process": "fake"})
    )
    source.prefill(
        api.PrefillRequest(
            request_id="p", session=ref("s"), start_pos=0, inputs=api.TokenInput(token_ids=prompt)
        )
    )
    return source.export_session(api.ExportSessionRequest(request_id="e", session=ref("s")))


class _Body:
    """An import stream's messages: the header, then ``n_chunks`` chunks made as they are
    pulled (a GiB announced costs nothing here), counting how many were pulled."""

    def __init__(self, header: bytes, n_chunks: int, chunks: tuple[bytes, ...] = ()) -> None:
        self.header, self.n_chunks, self.chunks = header, n_chunks, chunks
        self.pulled = 0
        self.hold = threading.Event()
        self.hold.set()

    def __iter__(self) -> Iterator[bytes]:
        yield self.header
        for index in range(self.n_chunks):
            self.hold.wait()
            self.pulled += 1
            yield self.chunks[index] if index < len(self.chunks) else _CHUNK


def _header(
    snapshot: api.SessionSnapshot, n_chunks: int | None = None, epoch: int | None = None
) -> bytes:
    request = api.ImportSessionRequest(
        request_id="raw", snapshot=msgspec.structs.replace(snapshot, chunks=()), epoch=epoch
    )
    if n_chunks is None:
        n_chunks = -(-snapshot.state_bytes // SNAPSHOT_CHUNK_BYTES)
    return encode_header(ImportHeader(request=request, n_chunks=n_chunks))


def _send(server: EngineServer, body: _Body, transport: str) -> api.ShardEngineError | None:
    """The server's typed refusal of ``body`` (None: it imported)."""
    assert server.address is not None
    if transport == "framed":
        link = FramedLink(
            Path(server.address.removeprefix("unix:")),
            token=None,
            max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
        )
        try:
            answer = link.import_(iter(body), 30)
        finally:
            link.close()
        if isinstance(answer, api.ErrorInfo):
            return wire.error_from_info(answer)
        return None
    with grpc.insecure_channel(server.address) as channel:
        call: grpc.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(IMPORT_METHOD)
        reply = call(iter(body), timeout=30)
    try:
        return wire.decode_error(reply)
    except Exception:  # noqa: BLE001 - not an error: the import result
        return None


def _forged(snapshot: api.SessionSnapshot, **fields: object) -> api.SessionSnapshot:
    return msgspec.structs.replace(snapshot, **fields)


def test_headers_that_show_a_refusal_are_refused_before_the_body(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """Each header below announces a GiB (1024 chunks); each is refused with the error the
    engine would give for the whole snapshot, before any chunk left a framed client (a few
    chunks of a gRPC one), and the server holds no import bytes afterwards."""
    snapshot = _snapshot(remote)
    server = serve(_config(kv_budget_tokens=1600, max_context=2048), transport=transport)
    bound = server.engine.max_state_bytes(1600)  # type: ignore[attr-defined]
    other_shard = api.ShardSpec(model="fake", n_layers=6, start=0, end=3)
    cases: dict[str, tuple[bytes, type[api.ShardEngineError], str]] = {
        "over max_context (the reported attack)": (
            _header(_forged(snapshot, length=2049, state_bytes=_GIB)),
            api.ResourceExhausted,
            "exceeds max_context",
        ),
        "over the whole KV budget": (
            _header(_forged(snapshot, length=1601, state_bytes=_GIB)),
            api.ResourceExhausted,
            "whole KV budget",
        ),
        "more bytes than its length takes on this shard": (
            _header(_forged(snapshot, length=1000, state_bytes=_GIB)),
            api.ResourceExhausted,
            "positions of this shard take at most",
        ),
        "another model": (
            _header(_forged(snapshot, model_fingerprint="f" * 64, state_bytes=_GIB)),
            api.ShardMismatch,
            "model_fingerprint",
        ),
        "another layer range": (
            _header(_forged(snapshot, shard=other_shard, state_bytes=_GIB)),
            api.ShardMismatch,
            "shard.end",
        ),
        "another engine": (
            _header(_forged(snapshot, engine="llama", state_bytes=_GIB)),
            api.ShardMismatch,
            "engine",
        ),
        "another contract": (
            _header(_forged(snapshot, contract_version=99, state_bytes=_GIB)),
            api.ContractVersionMismatch,
            "contract version",
        ),
        "an epoch older than its own": (
            _header(_forged(snapshot, state_bytes=_GIB, session=ref("s", 5)), epoch=4),
            api.InvalidRequest,
            "older than the snapshot's epoch",
        ),
        "chunks that do not add up to its bytes": (
            _header(_forged(snapshot, state_bytes=_GIB), n_chunks=3),
            api.InvalidRequest,
            "announces 3 chunks",
        ),
    }
    for name, (header, error_type, match) in cases.items():
        body = _Body(header, _GIB // SNAPSHOT_CHUNK_BYTES)
        error = _send(server, body, transport)
        assert type(error) is error_type, (name, error)
        assert match in error.message, (name, error.message)
        assert body.pulled <= _AHEAD_OF_A_REFUSED_HEADER[transport], (name, body.pulled)
        if isinstance(error, api.ResourceExhausted):
            assert not error.retryable, name
    assert server._import_budget.held == 0
    too_large = _send(
        server, _Body(_header(_forged(snapshot, length=1600, state_bytes=bound + 1)), 0), transport
    )
    assert isinstance(too_large, api.ResourceExhausted)
    assert too_large.details["limit"] == bound
    assert server.engine.metrics().imports == 0
    # The honest import still goes through, exactly as announced.
    assert _send(server, _Body(_header(snapshot), 2, snapshot.chunks), transport) is None
    assert server.engine.metrics().imports == 1


def test_a_body_larger_than_announced_is_refused_as_it_arrives(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """A header honest about a small state, followed by a flood of chunks: refused at the first
    byte past what was announced, not after the flood (a framed client sent at most the chunks
    the server granted ahead of the first)."""
    snapshot = _snapshot(remote, (1, 2, 3))
    server = serve(_config(), transport=transport)
    body = _Body(_header(snapshot, n_chunks=1), 1024)
    error = _send(server, body, transport)
    assert isinstance(error, api.ChecksumMismatch)
    assert "extended" in error.message
    assert body.pulled <= _AHEAD_OF_A_REFUSED_CHUNK[transport]
    assert server._import_budget.held == 0


def test_a_header_refused_late_still_costs_a_framed_client_no_chunk(
    serve: ServeFactory, remote: RemoteFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The import thread stalls before it looks at the header, as under load (for 0.5 s, or
    until a chunk left the client): the client sends no chunk meanwhile, and the header's
    refusal finds none sent. (Before GO_AHEAD the client streamed from the start.)"""
    snapshot = _snapshot(remote)
    server = serve(_config(), transport="framed")
    body = _Body(_header(_forged(snapshot, length=2049, state_bytes=_GIB)), 1024)
    stalled = threading.Event()

    def late_check(*args: object, **kwargs: object) -> None:
        stalled.set()
        until = time.monotonic() + 0.5
        while not body.pulled and time.monotonic() < until:
            time.sleep(0.01)
        check_import_header(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("shard_engine_remote._server.check_import_header", late_check)
    error = _send(server, body, "framed")
    assert stalled.is_set()
    assert isinstance(error, api.ResourceExhausted)
    assert "exceeds max_context" in error.message
    assert body.pulled == 0
    assert server._import_budget.held == 0
    assert server.engine.metrics().imports == 0


def test_streams_together_hold_at_most_the_import_budget(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """With room for one stream of this size, a second stream while the first holds its
    bytes is refused (retryable: the first will end); a stream larger than the whole budget is
    refused for good; once the first ends its bytes are free again."""
    snapshot = _snapshot(remote)
    limit = snapshot.state_bytes + SNAPSHOT_CHUNK_BYTES
    server = serve(_config(), transport=transport, max_import_bytes=limit)
    stalled = _Body(_header(snapshot), 2, snapshot.chunks)
    stalled.hold.clear()
    outcome: list[api.ShardEngineError | None] = []
    first = threading.Thread(target=lambda: outcome.append(_send(server, stalled, transport)))
    first.start()
    try:
        wait_until(lambda: server._import_budget.held == snapshot.state_bytes, timeout=30)
        second = _send(server, _Body(_header(_forged(snapshot, session=ref("t"))), 2), transport)
        assert isinstance(second, api.ResourceExhausted)
        assert second.retryable
        assert second.details["resource"] == "import_bytes"
        huge = _forged(snapshot, session=ref("u"), state_bytes=limit + 1)
        whole = _send(server, _Body(_header(huge), 0), transport)
        assert isinstance(whole, api.ResourceExhausted)
        assert not whole.retryable
    finally:
        stalled.hold.set()
        first.join()
    assert outcome == [None]
    assert server._import_budget.held == 0
    assert server.engine.metrics().imports == 1


def test_import_budget_refuses_a_limit_below_one_chunk() -> None:
    with pytest.raises(api.InvalidRequest):
        ImportBudget(SNAPSHOT_CHUNK_BYTES - 1)
    budget = ImportBudget(3 * SNAPSHOT_CHUNK_BYTES)
    budget.reserve(2 * SNAPSHOT_CHUNK_BYTES)
    with pytest.raises(api.ResourceExhausted) as caught:
        budget.reserve(2 * SNAPSHOT_CHUNK_BYTES)
    assert caught.value.retryable
    budget.release(2 * SNAPSHOT_CHUNK_BYTES)
    budget.reserve(3 * SNAPSHOT_CHUNK_BYTES)
    assert budget.held == 3 * SNAPSHOT_CHUNK_BYTES
