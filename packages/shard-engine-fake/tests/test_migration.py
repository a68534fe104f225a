"""Session migration on the fake engine: a session exported mid-generation and imported into
another engine continues bit for bit, for every role and through the wire codec; injected
faults fail exports and imports without changing anything."""

from __future__ import annotations

import threading

import pytest
from conftest import EngineFactory, bundle_of, decode, logits_of, prefill, session

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_fake import (
    Crash,
    Delay,
    FakeEngine,
    FaultPlan,
    FaultRule,
    MemoryPressure,
    StateFailure,
)

PROMPT = [5, 17, 301, 42, 9, 77, 128]
STEPS = [11, 260, 3, 499]
ROLES = {"head": (0, 2), "middle": (2, 4), "tail": (4, 6), "full": (0, 6)}


def _export(engine: api.ShardEngine, ref: api.SessionRef, rid: str = "x") -> api.SessionSnapshot:
    return engine.export_session(api.ExportSessionRequest(request_id=rid, session=ref))


def _import(
    engine: api.ShardEngine,
    snapshot: api.SessionSnapshot,
    epoch: int | None = None,
    rid: str = "i",
) -> api.ImportSessionResult:
    return engine.import_session(
        api.ImportSessionRequest(request_id=rid, snapshot=snapshot, epoch=epoch)
    )


def _over_the_wire(snapshot: api.SessionSnapshot) -> api.SessionSnapshot:
    decoded = wire.decode_message(wire.encode(snapshot))
    assert isinstance(decoded, api.SessionSnapshot)
    return decoded


def _rows(result: api.ShardResult) -> bytes:
    if isinstance(result, api.LogitsResult):
        return bytes(result.payload)
    return bytes(bundle_of(result).payload)


class _Feed:
    """The inputs of a shard at every position: token ids for a head or full shard, else the
    rows a fresh upstream shard computes over the whole token sequence, re-addressed to the
    session and position they are sent for (the fake is split-exact and batch-invariant)."""

    def __init__(self, upstream: FakeEngine | None, tokens: list[int]) -> None:
        self.tokens = tokens
        self.bundle: api.BoundaryBundle | None = None
        if upstream is not None:
            self.bundle = bundle_of(prefill(upstream, session("feed"), 0, tokens))

    def at(self, ref: api.SessionRef, start: int, stop: int) -> list[int] | api.BoundaryBundle:
        if self.bundle is None:
            return self.tokens[start:stop]
        return api.BoundaryBundle.from_array(
            self.bundle.array()[start:stop],
            session=ref,
            first_pos=start,
            layer=self.bundle.layer,
            model_fingerprint=self.bundle.model_fingerprint,
        )

    def one(self, ref: api.SessionRef, pos: int) -> int | api.BoundaryBundle:
        inputs = self.at(ref, pos, pos + 1)
        return inputs[0] if isinstance(inputs, list) else inputs


@pytest.mark.parametrize("role", sorted(ROLES))
def test_moved_session_continues_bit_for_bit(make_engine: EngineFactory, role: str) -> None:
    """Prefill and one decode on the source, export, the snapshot through the codec, import
    under a newer epoch elsewhere: every later decode there equals the unmoved session's, the
    source is unchanged (it continues too), and the old epoch is fenced at the target."""
    start, end = ROLES[role]
    feed = _Feed(make_engine(0, start) if start else None, PROMPT + STEPS)
    unmoved = make_engine(start, end)
    source = make_engine(start, end)
    target = make_engine(start, end)
    ref = session("moving", epoch=3)
    pos = len(PROMPT)
    for engine in (unmoved, source):
        prefill(engine, ref, 0, feed.at(ref, 0, pos))
        decode(engine, ref, pos, feed.one(ref, pos))
    before = (source.health(), source.metrics().kv_used_tokens)
    snapshot = _over_the_wire(_export(source, ref))
    assert (source.health(), source.metrics().kv_used_tokens) == before
    assert snapshot.length == pos + 1
    moved = _import(target, snapshot, epoch=4)
    assert moved.session == api.SessionRef(session_id="moving", epoch=4)
    end_pos = len(PROMPT) + len(STEPS)
    for at in range(pos + 1, end_pos):
        expected = decode(unmoved, ref, at, feed.one(ref, at))
        got = decode(target, moved.session, at, feed.one(moved.session, at))
        assert _rows(got) == _rows(expected)
    # The source was left as it was: its next step equals the unmoved session's.
    replay = make_engine(start, end)
    prefill(replay, ref, 0, feed.at(ref, 0, pos + 1))
    step = feed.one(ref, pos + 1)
    assert _rows(decode(source, ref, pos + 1, step)) == _rows(decode(replay, ref, pos + 1, step))
    with pytest.raises(api.StaleEpoch):
        prefill(target, ref, 0, feed.at(ref, 0, 1))


def test_upstream_replays_are_not_needed_after_a_move_of_every_shard(
    make_engine: EngineFactory,
) -> None:
    """A whole 3-shard pipeline moves: every shard exports, the peer pipeline imports under a
    newer epoch, and generation continues there with the logits of the unmoved pipeline."""
    ranges = [(0, 2), (2, 4), (4, 6)]
    unmoved = [make_engine(s, e) for s, e in ranges]
    source = [make_engine(s, e) for s, e in ranges]
    target = [make_engine(s, e) for s, e in ranges]
    ref = session("whole", epoch=1)
    for pipeline in (unmoved, source):
        api.Pipeline(pipeline, request_prefix="p").prefill(ref, 0, PROMPT)
    moved = api.SessionRef(session_id="whole", epoch=2)
    for src, dst in zip(source, target, strict=True):
        _import(dst, _over_the_wire(_export(src, ref)), epoch=2)
    for offset, token in enumerate(STEPS):
        pos = len(PROMPT) + offset
        expected = api.Pipeline(unmoved, request_prefix=f"u{pos}").decode(ref, pos, token)
        got = api.Pipeline(target, request_prefix=f"t{pos}").decode(moved, pos, token)
        assert bytes(got.payload) == bytes(expected.payload)


def test_snapshot_of_a_long_session_is_chunked(make_engine: EngineFactory) -> None:
    engine = make_engine(0, 6, model="fake:hidden=512", max_batch_tokens=2048)
    ref = session("long")
    prefill(engine, ref, 0, [index % 500 for index in range(400)])
    snapshot = _export(engine, ref)
    assert snapshot.state_bytes == 6 * 400 * 512 * 2
    assert len(snapshot.chunks) == 3
    assert [len(chunk) for chunk in snapshot.chunks[:-1]] == [1 << 20, 1 << 20]
    target = make_engine(0, 6, model="fake:hidden=512", max_batch_tokens=2048)
    _import(target, _over_the_wire(snapshot))
    assert logits_of(decode(target, ref, 400, 3)).array().tobytes() == (
        logits_of(decode(engine, ref, 400, 3)).array().tobytes()
    )


def test_state_that_does_not_fit_the_shard_is_refused(make_engine: EngineFactory) -> None:
    """The state decodes only into its own layer count, size and lane range: a snapshot whose
    checksum was recomputed over other bytes is still refused, and nothing is installed."""
    source = make_engine()
    prefill(source, session(), 0, PROMPT)
    snapshot = _export(source, session())
    target = make_engine()
    state = b"".join(snapshot.chunks)
    for forged in (state[:-2], state + b"\x00\x00", b"\xff" * len(state)):
        tampered = api.SessionSnapshot(
            **{
                **{name: getattr(snapshot, name) for name in snapshot.__struct_fields__},
                "chunks": (forged,),
                "state_bytes": len(forged),
                "checksum": wire.payload_checksum(forged),
            }
        )
        with pytest.raises(api.InvalidRequest, match="fake session state"):
            _import(target, tampered)
        assert target.health().sessions == 0
        assert target.metrics().kv_used_tokens == 0


# ----------------------------------------------------------------------------- faults


def _faulty(make_engine: EngineFactory, *rules: FaultRule, **fields: object) -> FakeEngine:
    return make_engine(options={"faults": FaultPlan(rules=rules)}, **fields)


def test_injected_import_failure_changes_nothing(make_engine: EngineFactory) -> None:
    source = make_engine()
    prefill(source, session("a", epoch=1), 0, PROMPT)
    snapshot = _export(source, session("a", epoch=1))
    target = _faulty(
        make_engine, FaultRule(action=StateFailure(), operations=("import_session",), nth=2)
    )
    prefill(target, session("a", epoch=1), 0, [1, 2])  # an older live epoch of the session
    old = logits_of(prefill(target, session("b"), 0, [3, 4]))
    # The first import replaces epoch 1; the second, under epoch 3, fails after writing its
    # slot: epoch 2 stays, untouched.
    assert _import(target, snapshot, epoch=2, rid="first").replaced
    with pytest.raises(api.ResourceExhausted, match="injected state failure"):
        _import(target, snapshot, epoch=3, rid="second")
    assert target.health().sessions == 2
    assert target.metrics().kv_used_tokens == len(PROMPT) + 2
    # Epoch 2 is intact and continues; no slot leaked (the failed import's cache is gone).
    expected = logits_of(decode(source, session("a", epoch=1), len(PROMPT), 9))
    got = logits_of(decode(target, session("a", epoch=2), len(PROMPT), 9))
    assert got.array().tobytes() == expected.array().tobytes()
    assert len(target._caches) == 2
    assert logits_of(decode(target, session("b"), 2, 5)).first_pos == old.first_pos + 1
    assert target.metrics().errors == {"resource_exhausted": 1}


def test_injected_export_failure_and_crash(make_engine: EngineFactory) -> None:
    engine = _faulty(
        make_engine,
        FaultRule(action=StateFailure(), operations=("export_session",), nth=1),
        FaultRule(action=Crash(), operations=("export_session",), nth=3),
    )
    prefill(engine, session(), 0, PROMPT)
    with pytest.raises(api.ResourceExhausted):
        _export(engine, session(), "x1")
    assert _export(engine, session(), "x2").length == len(PROMPT)
    assert engine.metrics().exports == 1
    with pytest.raises(api.EngineCrashed):
        _export(engine, session(), "x3")
    assert engine.health().state == "failed"


def test_cancelled_import_installs_nothing(make_engine: EngineFactory) -> None:
    """A delay inside the import's state step, a cancel by session id meanwhile: Cancelled,
    no session, no slot; the same import then succeeds."""
    source = make_engine()
    prefill(source, session(), 0, PROMPT)
    snapshot = _export(source, session())
    target = _faulty(
        make_engine,
        FaultRule(action=Delay(milliseconds=400), operations=("import_session",), nth=1),
    )
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(_import(target, snapshot, rid="slow"))
        except api.ShardEngineError as error:
            outcome.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    cancelled = api.CancelResult(cancelled=False)
    while thread.is_alive() and not cancelled.cancelled:
        if target.health().in_flight:
            cancelled = target.cancel(api.CancelRequest(session_id=session().session_id))
    thread.join()
    assert cancelled.cancelled
    assert isinstance(outcome[0], api.Cancelled)
    assert (target.health().sessions, target.metrics().kv_used_tokens) == (0, 0)
    assert target._caches == {}
    assert target.metrics().cancelled == 1
    assert _import(target, snapshot, rid="again").length == len(PROMPT)


def test_memory_pressure_at_import(make_engine: EngineFactory) -> None:
    """Pressure before an import: refused with reject; with LRU the idle session is evicted
    at the import's commit (its next decode is CacheMiss "evicted")."""
    source = make_engine()
    prefill(source, session("m"), 0, PROMPT)
    snapshot = _export(source, session("m"))
    rule = FaultRule(action=MemoryPressure(kv_budget_tokens=8), operations=("import_session",))
    for eviction in ("reject", "lru"):
        target = _faulty(make_engine, rule, eviction=eviction)
        prefill(target, session("idle"), 0, [1, 2, 3])
        if eviction == "reject":
            with pytest.raises(api.ResourceExhausted):
                _import(target, snapshot)
            assert target.health().sessions == 1
            continue
        result = _import(target, snapshot)
        assert result.evicted == 1
        with pytest.raises(api.CacheMiss) as miss:
            decode(target, session("idle"), 3, 4)
        assert miss.value.reason == "evicted"
        assert target.metrics().evictions == 1


def test_fake_declares_migration(make_engine: EngineFactory) -> None:
    caps = make_engine().capabilities()
    assert caps.features.session_migration
