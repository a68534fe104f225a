"""Mutated calls: every message a client sends through ``Call`` (prefill of tokens and of a
bundle, decode, decode batch, cancel, release and the queries), mutated by structure (a value
swapped for a boundary value or another type, a field dropped or added, a list shortened or
grown, payload bytes flipped, cut, extended or made NaN) and by bytes, sent to the servers of a
head, a middle and a tail shard, over gRPC and over the framed transport. Every call gets a
reply or a typed error (never EngineCrashed, never an untyped failure), every engine stays
ready, and afterwards a well-formed pipeline through the same servers computes exactly what
fresh engines compute."""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib.util
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import msgspec
import numpy as np
import pytest
from conftest import FramedPeer

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_remote import EngineServer, ServerSecurity
from shard_engine_remote._framed import FramedServer
from shard_engine_remote._framed.frames import HELLO
from shard_engine_remote._wire import (
    CALL_METHOD,
    CapabilitiesQuery,
    HealthQuery,
    MetricsQuery,
    RemoteRequest,
    ServerStatsQuery,
    decode_reply,
    encode_request,
)

N_LAYERS = 6
RANGES = ((0, 2), (2, 4), (4, 6))
CALLS = 900
INTS = (0, 1, -1, 2, 3, 63, 64, 65, 255, 256, 2**31 - 1, 2**31, 2**32, 2**53, 2**63 - 1, -(2**63))
STRINGS = ("", "x" * 300, "\x00", "é", "s/../t", "decode", "prefill", "f16", "bf16", "int8")
HAS_LLAMA = (
    importlib.util.find_spec("shard_engine_llama") is not None
    and importlib.util.find_spec("llama_cpp") is not None
)


def _model(engine: str, directory: Path) -> str:
    if engine == "fake":
        return "fake"
    from shard_engine_llama import write_tiny_model

    path = directory / "tiny.gguf"
    write_tiny_model(path, n_layers=N_LAYERS, seed=3)
    return str(path)


def _load(engine: str, model: str, start: int, end: int) -> api.ShardEngine:
    spec = api.ShardSpec(model=model, n_layers=N_LAYERS, start=start, end=end)
    return api.load_engine(engine, api.LoadConfig(shard=spec, max_sessions=4, max_context=64))


_NO_LLAMA = pytest.mark.skipif(
    not HAS_LLAMA, reason="shard-engine-llama (llama-cpp-python) is not installed"
)


TOKEN = "fuzz-token"
Send = Callable[[bytes], bytes]
"""One shard's ``Call``: an encoded request in, the encoded reply out."""


class _Shards:
    """Servers of a head, a middle and a tail shard of one model: gRPC on loopback, or the
    framed transport on unix sockets in a private directory."""

    def __init__(self, engine: str, model: str, transport: str) -> None:
        self.engine = engine
        self.model = model
        self.transport = transport
        self.servers: list[EngineServer] = []
        self._framed: list[FramedServer] = []
        self._directory = Path(tempfile.mkdtemp(prefix="shard-engine-fuzz-"))
        try:
            for index, (start, end) in enumerate(RANGES):
                engine_server = EngineServer(
                    _load(engine, model, start, end), security=ServerSecurity(token=TOKEN)
                )
                self.servers.append(engine_server)
                if transport == "framed":
                    framed = FramedServer(engine_server)
                    self._framed.append(framed)
                    engine_server.address = framed.start(self._directory / f"{index}.sock")
                else:
                    engine_server.start("127.0.0.1:0")
        except BaseException:
            self.close()
            raise

    @contextlib.contextmanager
    def clients(self) -> Iterator[list[Send]]:
        """Each shard's ``Call``, over this transport."""
        closers: list[Callable[[], None]] = []
        sends: list[Send] = []
        try:
            for server in self.servers:
                address = server.address or ""
                if self.transport == "framed":
                    peer = FramedPeer(address, TOKEN)
                    closers.append(peer.close)
                    assert peer.greeting()[0] == HELLO
                    sends.append(peer.exchange)
                else:
                    channel = grpc.insecure_channel(address)
                    closers.append(channel.close)
                    call: grpc.UnaryUnaryMultiCallable[bytes, bytes]
                    call = channel.unary_unary(CALL_METHOD)
                    sends.append(functools.partial(call, timeout=30, metadata=_METADATA))
            yield sends
        finally:
            for close in closers:
                close()

    def logits(self) -> np.ndarray:
        with self.clients() as sends:
            return _pipeline_logits(sends)

    def close(self) -> None:
        for framed in self._framed:
            framed.stop(grace=0.5)
        for server in self.servers:
            if self.transport != "framed":
                server.stop(grace=0.5)
            server.engine.close()
        shutil.rmtree(self._directory, ignore_errors=True)


_METADATA = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture(
    params=[
        ("fake", "grpc"),
        ("fake", "framed"),
        pytest.param(("llama", "grpc"), marks=_NO_LLAMA),
        pytest.param(("llama", "framed"), marks=_NO_LLAMA),
    ],
    ids="-".join,
)
def shards(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[_Shards]:
    engine, transport = request.param
    started = _Shards(engine, _model(engine, tmp_path), transport)
    try:
        yield started
    finally:
        started.close()


def _seeds(caps: api.Capabilities, hidden: int) -> list[RemoteRequest]:
    """One well-formed message of every kind ``Call`` takes, for a shard of ``caps``."""
    ref = api.SessionRef(session_id="s", epoch=1)

    def rows(n: int, first: int) -> api.ShardInput:
        if caps.shard.start == 0:
            return api.TokenInput(token_ids=tuple(range(5, 5 + n)))
        values = np.random.default_rng(n).standard_normal((n, hidden)).astype(np.float32)
        return api.BoundaryBundle.from_array(
            values,
            session=ref,
            first_pos=first,
            layer=caps.shard.start,
            model_fingerprint=caps.model_fingerprint,
        )

    other = api.SessionRef(session_id="t", epoch=2)
    return [
        api.PrefillRequest(request_id="p", session=ref, start_pos=0, inputs=rows(3, 0)),
        api.DecodeRequest(request_id="d", session=ref, pos=3, inputs=rows(1, 3)),
        api.DecodeBatchRequest(
            request_id="b",
            items=(
                api.DecodeRequest(request_id="d1", session=ref, pos=3, inputs=rows(1, 3)),
                api.DecodeRequest(request_id="d2", session=other, pos=0, inputs=rows(1, 0)),
            ),
        ),
        api.CancelRequest(request_id="x"),
        api.ReleaseRequest(session=ref),
        CapabilitiesQuery(),
        HealthQuery(),
        MetricsQuery(),
        ServerStatsQuery(),
    ]


def _mutate(value: object, rng: random.Random) -> object:
    """``value`` (a generic msgpack value) with one structural change somewhere inside."""
    roll = rng.random()
    if isinstance(value, dict):
        changed = dict(value)
        if changed and roll < 0.1:
            del changed[rng.choice(list(changed))]
        elif roll < 0.15:
            key = rng.choice(["type", "x", "request_id", "pos", "inputs", "payload", "session"])
            changed[key] = rng.choice([None, 1, "s", [], {}, b"\x00"])
        elif changed:
            key = rng.choice(list(changed))
            changed[key] = _mutate(changed[key], rng)
        return changed
    if isinstance(value, list):
        items = list(value)
        if items and roll < 0.2:
            del items[rng.randrange(len(items))]
        elif roll < 0.35:
            items.append(rng.choice(items) if items else 0)
        elif roll < 0.45:
            items = items * rng.choice([2, 10, 100])
        elif items:
            index = rng.randrange(len(items))
            items[index] = _mutate(items[index], rng)
        return items
    if isinstance(value, bool):
        return rng.choice([not value, 0, 1, None, "true"])
    if isinstance(value, int):
        return rng.choice([*INTS, value + 1, value - 1, -value, None, str(value), 1.5])
    if isinstance(value, float):
        return rng.choice([float("nan"), float("inf"), -0.0, 1e308, 0, -1.0])
    if isinstance(value, str):
        return rng.choice([*STRINGS, value * 50, 1, None])
    if isinstance(value, bytes):
        data = bytearray(value)
        if roll < 0.3 and data:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif roll < 0.5:
            del data[rng.randrange(len(data) + 1) :]
        elif roll < 0.6:
            data += rng.randbytes(rng.randint(1, 16))
        elif roll < 0.7:
            data = bytearray(np.full(len(data) // 4, np.nan, np.float32).tobytes())
        else:
            data = bytearray()
        return bytes(data)
    return rng.choice([0, "", [], {}, None])


def _mutate_bytes(message: bytes, rng: random.Random) -> bytes:
    data = bytearray(message)
    for _ in range(rng.randint(1, 6)):
        roll = rng.random()
        if roll < 0.4 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif roll < 0.6 and data:
            start = rng.randrange(len(data))
            del data[start : start + rng.randint(1, 8)]
        elif roll < 0.8:
            at = rng.randrange(len(data) + 1)
            data[at:at] = rng.randbytes(rng.randint(1, 8))
        else:
            del data[rng.randrange(len(data) + 1) :]
    return bytes(data)


def _pipeline_logits(calls: list[Send]) -> np.ndarray:
    """A 4-token prefill and 3 decode steps of a fresh session through the three shards; the
    tail's logits of every step."""
    ref = api.SessionRef(session_id="after", epoch=1)
    steps: list[np.ndarray] = []
    inputs: api.ShardInput
    for n, (pos, tokens) in enumerate(((0, (7, 8, 9, 10)), (4, (11,)), (5, (12,)), (6, (13,)))):
        inputs = api.TokenInput(token_ids=tokens)
        for call in calls:
            request: RemoteRequest = (
                api.PrefillRequest(request_id=f"a{n}", session=ref, start_pos=pos, inputs=inputs)
                if n == 0
                else api.DecodeRequest(request_id=f"a{n}", session=ref, pos=pos, inputs=inputs)
            )
            reply = decode_reply(call(encode_request(request)))
            if isinstance(reply, api.BoundaryResult):
                inputs = reply.bundle
            else:
                assert isinstance(reply, api.LogitsResult), reply
                steps.append(reply.array().copy())
    return np.concatenate(steps)


def test_mutated_calls_get_typed_answers_and_change_nothing(shards: _Shards) -> None:
    rng = random.Random(20261205)
    servers = shards.servers
    capabilities = [server.engine.capabilities() for server in servers]
    hidden = capabilities[0].hidden_size
    seeds = [[encode_request(m) for m in _seeds(caps, hidden)] for caps in capabilities]
    outcomes: collections.Counter[str] = collections.Counter()
    with shards.clients() as sends:
        for _ in range(CALLS):
            shard = rng.randrange(len(servers))
            seed = rng.choice(seeds[shard])
            if rng.random() < 0.75:
                value = msgspec.msgpack.decode(seed)
                for _ in range(1 if rng.random() < 0.7 else rng.randint(2, 3)):
                    value = _mutate(value, rng)
                message = msgspec.msgpack.encode(value)
            else:
                message = _mutate_bytes(seed, rng)
            reply = decode_reply(sends[shard](message))
            if isinstance(reply, api.ErrorInfo):
                error = wire.error_from_info(reply)
                assert type(error) is not api.ShardEngineError, (message, error)
                assert not isinstance(error, api.EngineCrashed), (message, error)
                outcomes[type(error).__name__] += 1
            else:
                outcomes[type(reply).__name__] += 1
            for server in servers:
                assert server.engine.health().state == "ready", (message, server.engine.health())
    # The mutations reach past the decoder: results, and refusals of several kinds.
    assert outcomes["InvalidRequest"] < CALLS * 0.95, outcomes
    assert len(outcomes) >= 8, outcomes
    assert {"BoundaryResult", "DecodeBatchResult", "StaleEpoch"} <= set(outcomes), outcomes
    fresh = _Shards(shards.engine, shards.model, shards.transport)
    try:
        expected = fresh.logits()
    finally:
        fresh.close()
    np.testing.assert_array_equal(shards.logits(), expected)
