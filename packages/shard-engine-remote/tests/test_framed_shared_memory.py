"""The framed transport's shared memory, seen from a worker: large requests and replies cross in
the connection's memfd slots instead of the socket, give the same results as the socket alone
and as the engine in this process, survive their slot's reuse, a slot for each session of an
engine the worker started (4 to 16), share their slots among any number of concurrent
callers, fall back to the socket when a body is larger than a slot, and a slot whose caller
gave up is reused only after the server answered."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
from conftest import RemoteFactory, ServeFactory, delay, ref, wait_until

import shard_engine_api as api
from shard_engine_remote import RemoteEngine
from shard_engine_remote._framed import SHARED_MEMORY, FramedLink
from shard_engine_remote._framed import arena as arena_module
from shard_engine_remote._framed import client as framed_client
from shard_engine_remote._framed.arena import ARENA_SLOTS, arena_slots_for
from shard_engine_remote._framed.client import _Connection

pytestmark = pytest.mark.skipif(not SHARED_MEMORY, reason="no sealed memfds here")

N_LAYERS = 6
WIDE = "fake:hidden=512,vocab=131072"
"""A tail's logits row is 512 KiB and a 256-row f32 bundle 512 KiB: both cross in a slot."""


def _config(model: str, start: int, end: int, **options: object) -> api.LoadConfig:
    return api.LoadConfig(
        shard=api.ShardSpec(model=model, n_layers=N_LAYERS, start=start, end=end),
        max_sessions=16,
        max_context=1024,
        max_batch_tokens=512,
        boundary_dtype="f32",
        options=dict(options),
    )


def _connection(engine: RemoteEngine) -> _Connection:
    link = engine._link
    assert isinstance(link, FramedLink)
    connection = link._connection
    assert connection is not None
    return connection


def _payload(result: api.ShardResult) -> tuple[bytes, int]:
    assert isinstance(result, api.LogitsResult | api.BoundaryResult)
    if isinstance(result, api.LogitsResult):
        return bytes(result.payload), result.checksum
    return bytes(result.bundle.payload), result.bundle.checksum


class _Pipeline:
    """A head shard [0, 3) in this process feeding tail shards [3, 6) under comparison."""

    def __init__(self, model: str, prompt: int = 256) -> None:
        self.head = api.load_engine("fake", _config(model, 0, 3))
        self.prompt = prompt

    def prefill(self, session: str) -> api.PrefillRequest:
        rng = np.random.default_rng(len(session))
        tokens = tuple(int(t) for t in rng.integers(1, 500, size=self.prompt))
        first = self.head.prefill(
            api.PrefillRequest(
                request_id=f"h-{session}",
                session=ref(session),
                start_pos=0,
                inputs=api.TokenInput(token_ids=tokens),
            )
        )
        assert isinstance(first, api.BoundaryResult)
        return api.PrefillRequest(
            request_id=f"t-{session}", session=ref(session), start_pos=0, inputs=first.bundle
        )

    def decode(self, session: str, step: int) -> api.DecodeRequest:
        pos = self.prompt + step
        row = self.head.decode(
            api.DecodeRequest(
                request_id=f"h-{session}-{step}",
                session=ref(session),
                pos=pos,
                inputs=api.TokenInput(token_ids=(1 + step % 400,)),
            )
        )
        assert isinstance(row, api.BoundaryResult)
        return api.DecodeRequest(
            request_id=f"t-{session}-{step}", session=ref(session), pos=pos, inputs=row.bundle
        )

    def close(self) -> None:
        self.head.close()


@pytest.fixture
def wide() -> Iterator[_Pipeline]:
    pipeline = _Pipeline(WIDE)
    yield pipeline
    pipeline.close()


def _tails(remote: RemoteFactory, where: str, model: str = WIDE) -> dict[str, api.ShardEngine]:
    """The tail in this process, and behind the framed transport with and without shared
    memory (a spawned child, or a server in this process)."""
    served: dict[str, object] = (
        {"spawn": "fake"} if where == "child" else {"in_process": "fake", "transport": "framed"}
    )
    return {
        "local": api.load_engine("fake", _config(model, 3, 6)),
        "shared": remote(_config(model, 3, 6, **served)),
        "socket": remote(_config(model, 3, 6, **served, shared_memory=False)),
    }


@pytest.mark.parametrize("where", ["child", "server"])
def test_large_bodies_cross_in_shared_memory_with_the_sockets_results(
    remote: RemoteFactory, wide: _Pipeline, where: str
) -> None:
    """A 512 KiB prefill bundle and 512 KiB logits rows cross in the slots (the server counts
    every such call), and every result is byte for byte the one the socket alone and the engine
    in this process give; with ``shared_memory=False`` nothing crosses in shared memory."""
    tails = _tails(remote, where)
    try:
        prefill = wide.prefill("a")
        steps = [wide.decode("a", step) for step in range(6)]
        outcomes = {
            name: [_payload(tail.prefill(prefill))] + [_payload(tail.decode(s)) for s in steps]
            for name, tail in tails.items()
        }
        assert outcomes["shared"] == outcomes["local"]
        assert outcomes["socket"] == outcomes["local"]
        shared, socket_only = tails["shared"], tails["socket"]
        assert isinstance(shared, RemoteEngine)
        assert isinstance(socket_only, RemoteEngine)
        assert _connection(shared).arena is not None
        assert _connection(socket_only).arena is None
        assert shared.server_stats().shared_memory_calls == 1 + len(steps)
        assert socket_only.server_stats().shared_memory_calls == 0
        assert shared.server_stats().refused_shared_memory == 0
    finally:
        tails["local"].close()


def test_a_result_outlives_the_reuse_of_its_slot(remote: RemoteFactory, wide: _Pipeline) -> None:
    """Results are copied out of their slot: three times as many results as slots, all kept,
    still equal the engine's own afterwards (a view into the slot would show a later reply)."""
    tails = _tails(remote, "server")
    try:
        local, shared = tails["local"], tails["shared"]
        prefill = wide.prefill("b")
        steps = [wide.decode("b", step) for step in range(3 * ARENA_SLOTS)]
        kept = [shared.prefill(prefill), *(shared.decode(step) for step in steps)]
        expected = [local.prefill(prefill), *(local.decode(step) for step in steps)]
        assert [_payload(r) for r in kept] == [_payload(r) for r in expected]
        assert len({_payload(r)[1] for r in kept}) == len(kept)  # every reply differs
    finally:
        tails["local"].close()


@pytest.mark.parametrize(
    ("where", "sessions", "slots"), [("child", 16, 16), ("server", 2, 4), ("server", 64, 16)]
)
def test_a_link_lends_a_slot_per_session_of_the_engine_it_started(
    remote: RemoteFactory, where: str, sessions: int, slots: int
) -> None:
    """A worker's link to an engine it started (a spawned child, a server in this process)
    lends a slot for each of the engine's sessions, at least 4 and at most 16: every
    session's decode may then cross in shared memory at once."""
    assert arena_slots_for(sessions) == slots
    served: dict[str, object] = (
        {"spawn": "fake"} if where == "child" else {"in_process": "fake", "transport": "framed"}
    )
    config = msgspec.structs.replace(_config(WIDE, 3, 6, **served), max_sessions=sessions)
    engine = remote(config)
    assert engine.health().state == "ready"
    arena = _connection(engine).arena
    assert arena is not None
    assert arena.slots == slots
    assert sorted(_connection(engine)._free_slots) == list(range(slots))


def test_concurrent_callers_share_the_slots(
    remote: RemoteFactory, wide: _Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twice as many concurrent callers as slots, each with its own session: a caller that
    finds no free slot goes over the socket, every result is right, and all slots are free
    once the calls have ended (the link lends 4 slots here, not one per session)."""
    monkeypatch.setattr(arena_module, "ARENA_MAX_SLOTS", ARENA_SLOTS)
    sessions = [f"c{index}" for index in range(2 * ARENA_SLOTS)]
    requests = {s: (wide.prefill(s), [wide.decode(s, step) for step in range(4)]) for s in sessions}
    tails = _tails(remote, "server")
    try:
        local, shared = tails["local"], tails["shared"]
        expected = {
            s: [_payload(local.prefill(p))] + [_payload(local.decode(d)) for d in steps]
            for s, (p, steps) in requests.items()
        }
        got: dict[str, list[tuple[bytes, int]]] = {}
        errors: list[BaseException] = []
        start = threading.Barrier(len(sessions))

        def run(session: str) -> None:
            try:
                first, steps = requests[session]
                start.wait()
                got[session] = [_payload(shared.prefill(first))]
                got[session] += [_payload(shared.decode(step)) for step in steps]
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        threads = [threading.Thread(target=run, args=(s,)) for s in sessions]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        assert got == expected
        assert isinstance(shared, RemoteEngine)
        assert sorted(_connection(shared)._free_slots) == list(range(ARENA_SLOTS))
    finally:
        tails["local"].close()


def test_bodies_larger_than_a_slot_take_the_socket(
    remote: RemoteFactory, wide: _Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 256 KiB slots, a 512 KiB bundle and 512 KiB logits rows go over the socket on a
    connection that has shared memory, with the same results, and nothing is counted as shared;
    a 1 KiB-row model's replies on the same kind of connection stay inline."""
    monkeypatch.setattr(framed_client, "ARENA_SLOT_BYTES", 256 << 10)
    tails = _tails(remote, "server")
    try:
        local, shared = tails["local"], tails["shared"]
        assert isinstance(shared, RemoteEngine)
        arena = _connection(shared).arena
        assert arena is not None
        assert arena.slot_bytes == 256 << 10
        prefill = wide.prefill("d")
        step = wide.decode("d", 0)
        assert _payload(shared.prefill(prefill)) == _payload(local.prefill(prefill))
        assert _payload(shared.decode(step)) == _payload(local.decode(step))
        assert shared.server_stats().shared_memory_calls == 0
    finally:
        tails["local"].close()


def test_a_large_request_alone_crosses_in_shared_memory(remote: RemoteFactory) -> None:
    """A 256-row bundle of 2048-wide f32 rows (2 MiB) to a tail with a 512-token vocabulary:
    the request crosses in the slot, the 2 KiB logits reply in its frame; counted once."""
    narrow = _Pipeline("fake:hidden=2048")
    try:
        local = api.load_engine("fake", _config("fake:hidden=2048", 3, 6))
        shared = remote(_config("fake:hidden=2048", 3, 6, in_process="fake", transport="framed"))
        prefill = narrow.prefill("e")
        assert prefill.inputs.payload.nbytes > 1 << 20  # type: ignore[union-attr]
        assert _payload(shared.prefill(prefill)) == _payload(local.prefill(prefill))
        assert shared.server_stats().shared_memory_calls == 1
        local.close()
    finally:
        narrow.close()


def test_an_abandoned_call_keeps_its_slot_until_the_server_answers(
    serve: ServeFactory, remote: RemoteFactory
) -> None:
    """A tail's decode (a 512 KiB logits row: it holds a slot) abandoned at its deadline
    while the engine still works on it: its slot stays taken (the server may still write it)
    until the server's answer for that call has been read; then it is free again, and the
    next calls are served right."""
    server = serve(
        _config(WIDE, 0, N_LAYERS, faults=delay("decode", 5_000, limit=1)), transport="framed"
    )
    assert server.address is not None
    engine = remote(
        _config(WIDE, 0, N_LAYERS, target=server.address, transport="framed", timeout_s=0.3)
    )
    engine.prefill(
        api.PrefillRequest(
            request_id="p", session=ref(), start_pos=0, inputs=api.TokenInput(token_ids=(1, 2, 3))
        )
    )
    connection = _connection(engine)
    assert len(connection._free_slots) == ARENA_SLOTS
    step = api.DecodeRequest(
        request_id="late", session=ref(), pos=3, inputs=api.TokenInput(token_ids=(4,))
    )
    with pytest.raises(api.OutcomeUnknown):
        engine.decode(step)
    assert len(connection._slot_of) == 1  # held: the abandoned call's answer has not come
    assert len(connection._free_slots) == ARENA_SLOTS - 1
    # The ABANDON cancels the engine's delay; its answer frees the slot when it is read.
    wait_until(lambda: connection.alive() and len(connection._free_slots) == ARENA_SLOTS)
    assert not connection._slot_of
    again = engine.decode(
        api.DecodeRequest(
            request_id="again", session=ref(), pos=3, inputs=api.TokenInput(token_ids=(4,))
        )
    )
    assert isinstance(again, api.LogitsResult)
    assert len(connection._free_slots) == ARENA_SLOTS


def test_only_calls_with_a_large_body_hold_a_slot(
    remote: RemoteFactory, wide: _Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The remote engine tells the link what a compute call's reply will carry (from the
    served capabilities): a middle shard's decode row (2 KiB each way) goes without a slot;
    its 256-row prefill, a tail's decode (a 512 KiB logits row) and queries (rare, their
    size unknown) hold one."""
    asked: list[bool] = []
    open_call = _Connection.open_call

    def recording(self: _Connection, slot: bool = False) -> tuple[int, int | None]:
        asked.append(slot)
        return open_call(self, slot)

    middle = remote(_config(WIDE, 3, 5, in_process="fake", transport="framed"))
    tail = remote(_config(WIDE, 3, 6, in_process="fake", transport="framed"))
    prefill, step = wide.prefill("f"), wide.decode("f", 0)
    monkeypatch.setattr(_Connection, "open_call", recording)
    middle.prefill(prefill)
    middle.decode(step)
    middle.health()
    tail.prefill(prefill)
    tail.decode(step)
    assert asked == [True, False, True, True, True]
