"""A worker-style migration: live sessions of a 3-shard pipeline move mid-decode to the same
shards in another process (and one moves back), every snapshot and request travelling through
the wire codec over a pipe; each session's greedy continuation equals the run that never moved,
logits bit for bit, while sessions that stay keep generating alongside."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
from collections.abc import Iterator, Sequence
from typing import Final

import numpy as np
import pytest

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_fake import FakeEngine

RANGES: Final = ((0, 2), (2, 4), (4, 6))
N_STEPS: Final = 8
MOVE_AT: Final = 3
BACK_AT: Final = 6
SESSIONS: Final = ("stays", "moves", "moves-and-returns")


def _config(start: int, end: int) -> api.LoadConfig:
    return api.LoadConfig(shard=api.ShardSpec(model="fake", n_layers=6, start=start, end=end))


def host(connection: multiprocessing.connection.Connection) -> None:
    """The other worker: one fake engine per range, answering framed requests (a shard index
    byte, then a codec message) until an empty frame."""
    engines = [FakeEngine() for _ in RANGES]
    for engine, (start, end) in zip(engines, RANGES, strict=True):
        engine.load(_config(start, end))
    codec = wire.Codec()
    try:
        while frame := connection.recv_bytes():
            engine = engines[frame[0]]
            try:
                request = codec.decode_request(frame[1:])
                reply: wire.WireReply
                if isinstance(request, api.PrefillRequest):
                    reply = engine.prefill(request)
                elif isinstance(request, api.DecodeRequest):
                    reply = engine.decode(request)
                elif isinstance(request, api.ExportSessionRequest):
                    reply = engine.export_session(request)
                elif isinstance(request, api.ImportSessionRequest):
                    reply = engine.import_session(request)
                elif isinstance(request, api.ReleaseRequest):
                    reply = engine.release(request)
                else:
                    raise api.InvalidRequest(f"unexpected {type(request).__name__}")
                connection.send_bytes(codec.encode(reply))
            except api.ShardEngineError as error:
                connection.send_bytes(codec.encode_error(error))
    finally:
        for engine in engines:
            engine.close()


class _Shard:
    """One shard of the other process, as the parent sees it."""

    def __init__(self, connection: multiprocessing.connection.Connection, index: int) -> None:
        self._connection = connection
        self._index = index

    def call(self, request: wire.WireRequest) -> wire.WireReply:
        self._connection.send_bytes(bytes([self._index]) + wire.encode(request))
        return wire.decode_reply(self._connection.recv_bytes())


Hop = FakeEngine | _Shard


def _call(shard: Hop, request: wire.WireRequest) -> wire.WireReply:
    if isinstance(shard, _Shard):
        return shard.call(request)
    if isinstance(request, api.PrefillRequest):
        return shard.prefill(request)
    if isinstance(request, api.DecodeRequest):
        return shard.decode(request)
    if isinstance(request, api.ExportSessionRequest):
        return shard.export_session(request)
    if isinstance(request, api.ImportSessionRequest):
        return shard.import_session(request)
    assert isinstance(request, api.ReleaseRequest)
    return shard.release(request)


def _step(
    shards: Sequence[Hop], ref: api.SessionRef, pos: int, tokens: Sequence[int], rid: str
) -> bytes:
    """Tokens through every shard (prefill at 0, decode after); the tail's logits bytes."""
    inputs: api.ShardInput = api.TokenInput(token_ids=tuple(tokens))
    result: wire.WireReply | None = None
    for index, shard in enumerate(shards):
        request: wire.WireRequest
        if pos == 0:
            request = api.PrefillRequest(
                request_id=f"{rid}-{index}", session=ref, start_pos=0, inputs=inputs
            )
        else:
            request = api.DecodeRequest(
                request_id=f"{rid}-{index}", session=ref, pos=pos, inputs=inputs
            )
        result = _call(shard, request)
        if isinstance(result, api.BoundaryResult):
            inputs = result.bundle
    assert isinstance(result, api.LogitsResult)
    return bytes(result.payload)


def _move(source: Sequence[Hop], target: Sequence[Hop], ref: api.SessionRef, epoch: int) -> None:
    """Export every shard of ``ref`` from ``source``, import it under ``epoch`` in ``target``
    (each snapshot crosses the codec), then release the source's copy."""
    for index, (src, dst) in enumerate(zip(source, target, strict=True)):
        snapshot = _call(src, api.ExportSessionRequest(request_id=f"x{index}", session=ref))
        assert isinstance(snapshot, api.SessionSnapshot)
        # In-process hops get the decoded snapshot, as a transport would hand it on.
        sent = wire.decode_message(wire.encode(snapshot))
        assert isinstance(sent, api.SessionSnapshot)
        result = _call(
            dst, api.ImportSessionRequest(request_id=f"i{index}", snapshot=sent, epoch=epoch)
        )
        assert isinstance(result, api.ImportSessionResult)
        assert result.session == api.SessionRef(session_id=ref.session_id, epoch=epoch)
        released = _call(src, api.ReleaseRequest(session=ref))
        assert isinstance(released, api.ReleaseResult)
        assert released.released


def _prompt(index: int) -> list[int]:
    return [(index * 53 + offset * 29 + 7) % 512 for offset in range(4 + 3 * index)]


@pytest.fixture
def other_worker() -> Iterator[list[_Shard]]:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=host, args=(child,), daemon=True)
    process.start()
    child.close()
    yield [_Shard(parent, index) for index in range(len(RANGES))]
    parent.send_bytes(b"")
    process.join(30)
    assert process.exitcode == 0
    parent.close()


def test_sessions_move_between_processes_mid_decode(other_worker: list[_Shard]) -> None:
    local = [FakeEngine() for _ in RANGES]
    unmoved = [FakeEngine() for _ in RANGES]
    for engine, (start, end) in zip([*local, *unmoved], RANGES * 2, strict=True):
        engine.load(_config(start, end))
    try:
        where: dict[str, tuple[Sequence[Hop], api.SessionRef]] = {}
        expected: dict[str, list[bytes]] = {}
        tokens: dict[str, list[int]] = {}
        for index, name in enumerate(SESSIONS):
            ref = api.SessionRef(session_id=name, epoch=1)
            prompt = _prompt(index)
            logits = _step(unmoved, ref, 0, prompt, f"u-{name}-0")
            expected[name] = [logits]
            tokens[name] = []
            pos = len(prompt)
            for step in range(N_STEPS):
                token = int(np.argmax(np.frombuffer(expected[name][-1], "<f4")))
                tokens[name].append(token)
                expected[name].append(_step(unmoved, ref, pos + step, [token], f"u-{name}-{step}"))
            where[name] = (local, ref)
            assert _step(local, ref, 0, prompt, f"l-{name}-0") == expected[name][0]
        for step in range(N_STEPS):
            if step == MOVE_AT:
                for name in ("moves", "moves-and-returns"):
                    shards, ref = where[name]
                    _move(shards, other_worker, ref, epoch=2)
                    where[name] = (other_worker, api.SessionRef(session_id=name, epoch=2))
            if step == BACK_AT:
                shards, ref = where["moves-and-returns"]
                _move(shards, local, ref, epoch=3)
                where["moves-and-returns"] = (
                    local,
                    api.SessionRef(session_id=ref.session_id, epoch=3),
                )
            for index, name in enumerate(SESSIONS):
                shards, ref = where[name]
                pos = len(_prompt(index)) + step
                got = _step(shards, ref, pos, [tokens[name][step]], f"{name}-{step}")
                assert got == expected[name][step + 1], f"{name} diverged at step {step}"
        # A straggler still holding the exporter's epoch is fenced where the session went.
        with pytest.raises(api.StaleEpoch):
            _step(other_worker, api.SessionRef(session_id="moves", epoch=1), 0, [1], "late")
        with pytest.raises(api.StaleEpoch):
            _step(local, api.SessionRef(session_id="moves-and-returns", epoch=2), 0, [1], "late2")
    finally:
        for engine in (*local, *unmoved):
            engine.close()
