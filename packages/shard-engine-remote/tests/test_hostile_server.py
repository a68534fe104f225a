"""A broken or hostile server, seen from the client: the remote engine never returns data it
has not verified as a success, and every failure is a typed error with the right
``retryable``, saying "may or may not have executed" (OutcomeUnknown) where that is the truth.

Two kinds of server: one that serves a real fake engine whose results are altered before they
are encoded (wrong request id, session, checksum, evidence, shape, position; over both
transports), and a hand-written framed server that answers with bytes of its choosing
(garbage, another reply type, a reply for another call, a cut reply, an oversized header,
silence)."""

from __future__ import annotations

import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import msgspec
import pytest
from conftest import (
    CAPABILITIES,
    HEALTH,
    Background,
    RemoteFactory,
    ServeFactory,
    UnixPeer,
    config,
    prefill,
    ref,
)

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_api.wire import MAX_ID_CHARS
from shard_engine_remote import EngineServer, OutcomeUnknown, RemoteEngine, RemoteUnavailable
from shard_engine_remote._framed import FramedLink
from shard_engine_remote._framed.frames import (
    CALL,
    END,
    ERROR,
    HEADER,
    HELLO,
    ITEM,
    REPLY,
    encode_frame,
)
from shard_engine_remote._link import LinkFailure
from shard_engine_remote._wire import SERVICE_NAME

_Mutation = Callable[[api.ShardResult], api.ShardResult]


def _logits(result: api.ShardResult) -> api.LogitsResult:
    assert isinstance(result, api.LogitsResult)
    return result


MUTATIONS: dict[str, _Mutation] = {
    "request_id": lambda r: msgspec.structs.replace(r, request_id="someone-else"),
    "session": lambda r: msgspec.structs.replace(r, session=ref("other")),
    "checksum": lambda r: msgspec.structs.replace(r, checksum=_logits(r).checksum ^ 1),
    "evidence": lambda r: msgspec.structs.replace(r, evidence="real"),
    "vocab_size": lambda r: msgspec.structs.replace(r, vocab_size=_logits(r).vocab_size + 1),
    "position": lambda r: msgspec.structs.replace(r, first_pos=_logits(r).first_pos + 1),
    "payload": lambda r: msgspec.structs.replace(
        r, payload=memoryview(bytes(len(_logits(r).payload)))
    ),
}


class _Altering:
    """A loaded engine whose prefill and decode results are altered by ``mutation``; every
    other call is the engine's own."""

    def __init__(self, inner: api.ShardEngine, mutation: _Mutation) -> None:
        self._inner = inner
        self._mutation = mutation

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def prefill(self, request: api.PrefillRequest) -> api.ShardResult:
        return self._mutation(self._inner.prefill(request))

    def decode(self, request: api.DecodeRequest) -> api.ShardResult:
        return self._mutation(self._inner.decode(request))


class _AlteringServer(EngineServer):
    """An EngineServer of an :class:`_Altering` engine (the mutation is set per test)."""

    mutation: _Mutation = staticmethod(lambda result: result)

    def __init__(self, engine: api.ShardEngine, **kwargs: object) -> None:
        super().__init__(_Altering(engine, self.mutation), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("altered", sorted(MUTATIONS))
def test_results_that_break_the_contract_are_malformed_output(
    serve: ServeFactory, remote: RemoteFactory, transport: str, altered: str
) -> None:
    """A result for another request or session, with a damaged checksum or payload, another
    evidence class, vocabulary size or position is MalformedOutput (retryable), never
    returned; in a batch it becomes that item's MalformedOutput."""

    class Server(_AlteringServer):
        mutation = staticmethod(MUTATIONS[altered])

    server = serve(config(), transport=transport, server_type=Server)
    assert server.address is not None
    engine = remote(config(target=server.address, transport=transport))
    with pytest.raises(api.MalformedOutput) as raised:
        prefill(engine)
    assert raised.value.retryable
    assert raised.value.details["check"]
    with pytest.raises(api.MalformedOutput):
        engine.decode(
            api.DecodeRequest(
                request_id="d", session=ref(), pos=3, inputs=api.TokenInput(token_ids=(1,))
            )
        )


def test_batch_items_that_break_the_contract_are_their_own_errors(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """One altered item of a batch becomes that item's MalformedOutput; the other item, which
    committed, is handed on."""

    class Server(EngineServer):
        def __init__(self, engine: api.ShardEngine, **kwargs: object) -> None:
            super().__init__(_BatchAltering(engine), **kwargs)  # type: ignore[arg-type]

    server = serve(config(), transport=transport, server_type=Server)
    assert server.address is not None
    engine = remote(config(target=server.address, transport=transport))
    prefill(engine, session="a")
    prefill(engine, session="b")
    items = tuple(
        api.DecodeRequest(
            request_id=f"d-{name}", session=ref(name), pos=3, inputs=api.TokenInput(token_ids=(1,))
        )
        for name in ("a", "b")
    )
    result = engine.decode_batch(api.DecodeBatchRequest(request_id="batch", items=items))
    first, second = result.items
    assert isinstance(first, api.ErrorInfo)
    assert first.code == api.MalformedOutput.code
    assert isinstance(second, api.LogitsResult)


class _BatchAltering:
    """A loaded engine whose batches answer their first item under another request id."""

    def __init__(self, inner: api.ShardEngine) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def decode_batch(self, request: api.DecodeBatchRequest) -> api.DecodeBatchResult:
        result = self._inner.decode_batch(request)
        first, *rest = result.items
        assert not isinstance(first, api.ErrorInfo)
        altered = msgspec.structs.replace(first, request_id="someone-else")
        return msgspec.structs.replace(result, items=(altered, *rest))


def test_capabilities_that_break_the_contract_fail_the_load(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """A server whose capabilities break the contract (a full shard claiming a vocabulary of
    0) fails the load with MalformedOutput."""
    server = _serving_capabilities(serve, transport, vocab_size=0)
    assert server.address is not None
    with pytest.raises(api.MalformedOutput):
        remote(config(target=server.address, transport=transport))


def test_a_served_engine_at_the_length_limits_loads_within_them(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """A served engine whose name and version take the contract's whole length each: the
    remote engine's own version (naming both) is cut to the limit, and its capabilities still
    round-trip the wire."""
    server = _serving_capabilities(
        serve, transport, engine="e" * MAX_ID_CHARS, engine_version="v" * MAX_ID_CHARS
    )
    assert server.address is not None
    engine = remote(config(target=server.address, transport=transport))
    capabilities = engine.capabilities()
    assert capabilities.engine == "remote"
    assert len(capabilities.engine_version) <= MAX_ID_CHARS
    assert capabilities.engine_version.endswith("...)")
    assert wire.decode_reply(wire.encode(capabilities)) == capabilities


def _serving_capabilities(serve: ServeFactory, transport: str, **changes: object) -> EngineServer:
    """A fake engine served with its capabilities' fields ``changes`` replaced."""

    class Server(EngineServer):
        def __init__(self, engine: api.ShardEngine, **kwargs: object) -> None:
            altered = _AlteredCapabilities(engine, changes)
            super().__init__(altered, **kwargs)  # type: ignore[arg-type]

    return serve(config(), transport=transport, server_type=Server)


class _AlteredCapabilities:
    def __init__(self, inner: api.ShardEngine, changes: dict[str, object]) -> None:
        self._inner = inner
        self._changes = changes

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def capabilities(self) -> api.Capabilities:
        return msgspec.structs.replace(self._inner.capabilities(), **self._changes)


# ----------------------------------------------------------------- a framed server of bytes

Answer = Callable[[socket.socket, int], None]


class _ByteServer(UnixPeer):
    """A framed server that greets every client and answers each CALL with ``answer``."""

    def __init__(self, answer: Answer) -> None:
        self._answer = answer
        self.directory = Path(tempfile.mkdtemp(prefix="shard-engine-test-"))
        super().__init__(self.directory / "engine.sock")

    def serve(self, sock: socket.socket) -> None:
        with sock:
            try:
                reader = sock.makefile("rb")
                while True:
                    header = reader.read(HEADER.size)
                    if len(header) < HEADER.size:
                        return
                    length, kind, call_id = HEADER.unpack(header)
                    reader.read(length)
                    if kind == HELLO:
                        sock.sendall(encode_frame(HELLO, 0, b""))
                    elif kind == CALL:
                        self._answer(sock, call_id)
            except OSError:
                return

    def close(self) -> None:
        super().close()
        self.path.unlink(missing_ok=True)
        self.directory.rmdir()


@pytest.fixture
def byte_server() -> Iterator[Callable[[Answer], _ByteServer]]:
    servers: list[_ByteServer] = []

    def factory(answer: Answer) -> _ByteServer:
        servers.append(_ByteServer(answer))
        return servers[-1]

    yield factory
    for server in servers:
        server.close()


def _answering(second: Answer) -> Answer:
    """Capabilities for the load's first call, then ``second`` for every later call."""
    calls = iter(range(1 << 30))

    def answer(sock: socket.socket, call_id: int) -> None:
        if next(calls) == 0:
            sock.sendall(encode_frame(REPLY, call_id, CAPABILITIES))
        else:
            second(sock, call_id)

    return answer


def _garbage(sock: socket.socket, call_id: int) -> None:
    sock.sendall(encode_frame(REPLY, call_id, b"\xc1\xff garbage"))


def _wrong_type(sock: socket.socket, call_id: int) -> None:
    sock.sendall(encode_frame(REPLY, call_id, HEALTH))


def _end_instead(sock: socket.socket, call_id: int) -> None:
    sock.sendall(encode_frame(END, call_id, b""))


def _item_instead(sock: socket.socket, call_id: int) -> None:
    sock.sendall(encode_frame(ITEM, call_id, CAPABILITIES))


def _bad_error_frame(sock: socket.socket, call_id: int) -> None:
    sock.sendall(encode_frame(ERROR, call_id, b"\x93\x01\x02\x03"))


def _other_call(sock: socket.socket, call_id: int) -> None:
    sock.sendall(encode_frame(REPLY, call_id + 1000, CAPABILITIES))


def _silence(sock: socket.socket, call_id: int) -> None:
    pass


def _cut(sock: socket.socket, call_id: int) -> None:
    sock.sendall(HEADER.pack(1000, REPLY, call_id) + b"\x85" * 10)
    sock.shutdown(socket.SHUT_RDWR)


def _oversized(sock: socket.socket, call_id: int) -> None:
    sock.sendall(HEADER.pack(0xFFFFFFFF, REPLY, call_id))


def _closed(sock: socket.socket, call_id: int) -> None:
    sock.shutdown(socket.SHUT_RDWR)


def _bytes_engine(
    byte_server: Callable[[Answer], _ByteServer], remote: RemoteFactory, second: Answer
) -> RemoteEngine:
    server = byte_server(_answering(second))
    options = {"target": f"unix:{server.path}", "transport": "framed", "timeout_s": 0.5}
    return remote(config(**options, control_timeout_s=0.5))


@pytest.mark.parametrize(
    "answer", [_garbage, _wrong_type, _end_instead, _item_instead], ids=lambda a: a.__name__
)
def test_undecodable_or_mistyped_replies_are_malformed_output(
    byte_server: Callable[[Answer], _ByteServer], remote: RemoteFactory, answer: Answer
) -> None:
    """A reply that does not decode, or decodes to another type than the call's, is
    MalformedOutput for a compute call (never a success) and for a query."""
    engine = _bytes_engine(byte_server, remote, answer)
    with pytest.raises(api.MalformedOutput):
        prefill(engine)
    with pytest.raises(api.MalformedOutput):
        engine.release(api.ReleaseRequest(session=ref()))


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (_other_call, "deadline_exceeded"),
        (_silence, "deadline_exceeded"),
        (_cut, "connection_lost"),
        (_closed, "connection_lost"),
        (_oversized, "transport_error"),
        (_bad_error_frame, "transport_error"),
    ],
    ids=lambda a: getattr(a, "__name__", a),
)
def test_replies_that_never_arrive_whole_are_outcome_unknown(
    byte_server: Callable[[Answer], _ByteServer],
    remote: RemoteFactory,
    answer: Answer,
    reason: str,
) -> None:
    """No whole reply for a state-changing call (a reply for another call, silence, a reply
    cut by the connection closing, an oversized header, an undecodable error frame) is
    OutcomeUnknown, retryable: the server may have run it. For a query it is
    RemoteUnavailable: it changed nothing."""
    engine = _bytes_engine(byte_server, remote, answer)
    with pytest.raises(OutcomeUnknown) as raised:
        prefill(engine)
    assert raised.value.retryable
    assert raised.value.details["reason"] == reason
    assert raised.value.details["outcome"] == "unknown"
    with pytest.raises(RemoteUnavailable) as unavailable:
        engine.server_stats()
    assert unavailable.value.retryable


def test_an_oversized_grpc_reply_is_outcome_unknown(remote: RemoteFactory) -> None:
    """A gRPC server answering a prefill with more bytes than this side accepts: the prefill
    may have run, so OutcomeUnknown (retryable), not ResourceExhausted (which would say the
    request was refused and tell the worker not to retry)."""
    calls = iter(range(1 << 30))

    def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
        return CAPABILITIES if next(calls) == 0 else bytes(4096)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(answer)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, {"Call": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        engine = remote(config(target=f"127.0.0.1:{port}", max_message_bytes=2048))
        with pytest.raises(OutcomeUnknown) as raised:
            prefill(engine)
        assert raised.value.retryable
        assert raised.value.details["reason"] == "transport_error"
    finally:
        server.stop(None)


def test_a_grpc_reply_with_oversized_metadata_is_outcome_unknown(remote: RemoteFactory) -> None:
    """A server (or a proxy) answering a prefill with trailers over gRPC's metadata limit: the
    client refuses the reply, but the prefill ran (the session holds it), so OutcomeUnknown,
    never the retryable "server busy" ResourceExhausted that says nothing ran."""

    class Bloated(EngineServer):
        def serve_call(self, request: object, context: grpc.ServicerContext) -> object:  # type: ignore[override]
            reply = super().serve_call(request, context)  # type: ignore[arg-type]
            if isinstance(request, api.PrefillRequest):
                context.set_trailing_metadata((("x-padding", "a" * 200_000),))
            return reply

    server = Bloated(api.load_engine("fake", config()))
    address = server.start("127.0.0.1:0")
    try:
        engine = remote(config(target=address))
        with pytest.raises(OutcomeUnknown):
            prefill(engine)
        assert server.engine.health().sessions == 1, "the prefill did not run after all"
    finally:
        server.stop(None)
        server.engine.close()


def test_a_call_waits_for_another_callers_greeting_no_longer_than_its_deadline(
    tmp_path: Path,
) -> None:
    """A framed server that accepts and never answers the greeting holds the first caller
    until its connect gives up; a second caller, with a shorter deadline, waiting for that
    connection gets DEADLINE_EXCEEDED (not sent) at its own deadline, not the first's."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    path = private / "engine.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    link = FramedLink(path, token=None, max_message_bytes=1 << 20)
    query = msgspec.msgpack.encode({"type": "health_query"})
    try:
        first = Background(lambda: link.call(query, 8.0))
        accepted, _ = listener.accept()  # the first caller is greeting now
        started = time.monotonic()
        with pytest.raises(LinkFailure) as late:
            link.call(query, 0.5)
        assert time.monotonic() - started < 2.0
        assert late.value.reason == "deadline_exceeded"
        assert not late.value.sent
        accepted.close()
        with pytest.raises(LinkFailure):
            first.result(15)
    finally:
        link.close()
        listener.close()
