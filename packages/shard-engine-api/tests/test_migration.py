"""Session export/import as EngineCore implements it: continuation, the source left unchanged,
the epoch rules, atomicity under failures and budgets, refused snapshots, cancellation, the
edge, metrics and health, the codec, the validation wrapper and the asyncio adapter; on a small
in-file engine whose outputs depend on the whole cached history."""

from __future__ import annotations

import asyncio
import threading
from typing import ClassVar

import msgspec
import numpy as np
import numpy.typing as npt
import pytest

from shard_engine_api import (
    CONTRACT_VERSION,
    AsyncShardEngine,
    CacheMiss,
    Cancelled,
    CancelRequest,
    ChecksumMismatch,
    ContractVersionMismatch,
    DecodeRequest,
    Determinism,
    EngineCrashed,
    ExportSessionRequest,
    Features,
    ImportSessionRequest,
    ImportSessionResult,
    InvalidRequest,
    LoadConfig,
    LogitsResult,
    MalformedOutput,
    PrefillRequest,
    ReleaseRequest,
    ResourceExhausted,
    SessionRef,
    SessionSnapshot,
    ShardMismatch,
    ShardSpec,
    StaleEpoch,
    TokenInput,
    UnsupportedFeature,
    ValidatingEngine,
)
from shard_engine_api._types import SNAPSHOT_CHUNK_BYTES
from shard_engine_api.engine import CancelToken, EngineCore, ForwardItem, ModelInfo, OutputMode
from shard_engine_api.wire import Codec, decode_message, encode, payload_checksum

HIDDEN = 4
VOCAB = 16
Rows = npt.NDArray[np.float32]


class StateEngine(EngineCore):
    """Row at position p = token + 0.5 * sum of the cached rows; the cache is the state.
    Knobs make the import hook fail after writing its slot, raise a foreign exception, block
    until released (to cancel it mid-way) or make dropping a slot fail."""

    engine_name: ClassVar[str] = "state"

    def __init__(self, *, migration: bool = True, settings: str = "a") -> None:
        super().__init__()
        self.migration = migration
        self.settings = settings
        self.cache: dict[int, list[Rows]] = {}
        self.saved: dict[int, list[Rows]] = {}
        self.fail_import: Exception | None = None
        self.fail_drop = False
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def _open(self, config: LoadConfig) -> ModelInfo:
        return ModelInfo(
            engine_version="1",
            evidence="fixture",
            model_fingerprint="state-model",
            hidden_size=HIDDEN,
            vocab_size=VOCAB,
            determinism=Determinism(deterministic=True, split_exact=True),
            features=Features(session_migration=self.migration),
            spare_slot=True,
            settings=(("kind", self.settings),),
        )

    def _forward(self, item: ForwardItem, output: OutputMode, token: CancelToken) -> Rows:
        cache = self.cache.setdefault(item.slot, [])
        self.saved[item.slot] = list(cache)
        del cache[item.start_pos :]
        assert item.tokens is not None
        out = []
        total = np.sum(cache, axis=0, dtype=np.float32) if cache else np.zeros(HIDDEN, np.float32)
        for value in item.tokens:
            row = (np.full(HIDDEN, value, np.float32) + np.float32(0.5) * total).astype(np.float32)
            total = (total + row).astype(np.float32)
            cache.append(row)
            out.append(row)
        hidden = np.stack(out)
        logits = (np.tile(hidden[:, :1], (1, VOCAB)) + np.arange(VOCAB)).astype(np.float32)
        return logits[-1:] if output == "last" else logits

    def _rollback(self, slot: int, start_pos: int, committed_length: int) -> None:
        self.cache[slot] = self.saved.pop(slot, [])[:committed_length]

    def _commit(self, slot: int) -> None:
        self.saved.pop(slot, None)

    def _drop(self, slot: int) -> None:
        if self.fail_drop:
            raise RuntimeError("drop failed")
        self.cache.pop(slot, None)

    def _close(self) -> None:
        self.cache.clear()

    def _export_state(self, slot: int, length: int) -> bytes:
        rows = self.cache[slot]
        assert len(rows) == length
        return np.stack(rows).astype("<f4").tobytes()

    def _import_state(self, slot: int, length: int, state: bytes) -> None:
        assert slot not in self.cache, "the core must give an empty slot"
        if len(state) != length * HIDDEN * 4:
            raise InvalidRequest("state size does not fit")
        self.cache[slot] = list(np.frombuffer(state, "<f4").reshape(length, HIDDEN).copy())
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail_import is not None:
            raise self.fail_import


def _engine(*, migration: bool = True, settings: str = "a", **fields: object) -> StateEngine:
    engine = StateEngine(migration=migration, settings=settings)
    values: dict[str, object] = {
        "shard": ShardSpec(model="m", n_layers=2, start=0, end=2),
        "max_sessions": 4,
        "kv_budget_tokens": 64,
    }
    values.update(fields)
    engine.load(LoadConfig(**values))  # type: ignore[arg-type]
    return engine


def ref(name: str = "s", epoch: int = 1) -> SessionRef:
    return SessionRef(session_id=name, epoch=epoch)


def prefill(engine: EngineCore, session: SessionRef, tokens: list[int], start: int = 0) -> None:
    engine.prefill(
        PrefillRequest(
            request_id="p",
            session=session,
            start_pos=start,
            inputs=TokenInput(token_ids=tuple(tokens)),
        )
    )


def decode(engine: EngineCore, session: SessionRef, pos: int, token: int) -> bytes:
    result = engine.decode(
        DecodeRequest(
            request_id="d", session=session, pos=pos, inputs=TokenInput(token_ids=(token,))
        )
    )
    assert isinstance(result, LogitsResult)
    return bytes(result.payload)


def export(engine: EngineCore, session: SessionRef, rid: str = "x") -> SessionSnapshot:
    return engine.export_session(ExportSessionRequest(request_id=rid, session=session))


def import_(
    engine: EngineCore, snapshot: SessionSnapshot, epoch: int | None = None, rid: str = "i"
) -> ImportSessionResult:
    return engine.import_session(
        ImportSessionRequest(request_id=rid, snapshot=snapshot, epoch=epoch)
    )


def replaced(snapshot: SessionSnapshot, **changes: object) -> SessionSnapshot:
    return msgspec.structs.replace(snapshot, **changes)


def state_of(engine: StateEngine) -> tuple[object, ...]:
    """Everything an unchanged engine keeps the same (requests and exports aside)."""
    ledger = engine._ledger
    sessions = sorted(
        (s.session_id, s.epoch, s.slot, s.length, s.last_used) for s in ledger.sessions.values()
    )
    caches = sorted((slot, np.stack(rows).tobytes()) for slot, rows in engine.cache.items())
    health = engine.health()
    metrics = engine.metrics()
    return (
        sessions,
        caches,
        ledger.kv_used,
        len(ledger.fences),
        health.sessions,
        health.kv_used_tokens,
        metrics.imports,
        metrics.evictions,
    )


# ----------------------------------------------------------------------------- continuation


def test_moved_session_continues_bit_for_bit_through_the_codec() -> None:
    source, target, unmoved = _engine(), _engine(), _engine()
    for engine in (source, unmoved):
        prefill(engine, ref(), [3, 1, 4, 1, 5])
    wire_bytes = encode(export(source, ref()))
    snapshot = decode_message(wire_bytes)
    assert isinstance(snapshot, SessionSnapshot)
    assert snapshot.length == 5
    assert snapshot.session == ref()
    result = import_(target, snapshot, epoch=2)
    assert (result.session, result.length, result.replaced, result.evicted) == (
        ref("s", 2),
        5,
        False,
        0,
    )
    for pos, token in enumerate([9, 2, 6], start=5):
        assert decode(target, ref("s", 2), pos, token) == decode(unmoved, ref(), pos, token)
    assert target.metrics().imports == 1
    assert source.metrics().exports == 1
    assert target.health().sessions == 1
    assert target.health().kv_used_tokens == 8


def test_large_state_is_cut_into_bounded_chunks() -> None:
    engine = _engine(max_context=70000, max_batch_tokens=70000, kv_budget_tokens=70000)
    prefill(engine, ref(), [0] * 66000)
    snapshot = export(engine, ref())
    assert snapshot.state_bytes == 66000 * HIDDEN * 4
    total = 66000 * HIDDEN * 4
    assert [len(c) for c in snapshot.chunks] == [SNAPSHOT_CHUNK_BYTES, total - SNAPSHOT_CHUNK_BYTES]
    assert snapshot.checksum == payload_checksum(b"".join(snapshot.chunks))


def test_export_leaves_the_source_unchanged_lru_order_included() -> None:
    engine = _engine(eviction="lru", kv_budget_tokens=10)
    prefill(engine, ref("old"), [1, 2, 3])
    prefill(engine, ref("new"), [4, 5, 6])
    before = state_of(engine)
    export(engine, ref("old"))
    assert state_of(engine) == before
    # "old" is still the least recently used: the next admission evicts it, not "new".
    prefill(engine, ref("third"), [7, 8, 9, 1, 2])
    with pytest.raises(CacheMiss) as miss:
        decode(engine, ref("old"), 3, 1)
    assert miss.value.reason == "evicted"
    decode(engine, ref("new"), 3, 1)


def test_export_errors_follow_decode() -> None:
    engine = _engine(eviction="lru", kv_budget_tokens=4)
    prefill(engine, ref("a", 2), [1, 2])
    with pytest.raises(CacheMiss) as unknown:
        export(engine, ref("nobody"))
    assert unknown.value.reason == "unknown_session"
    with pytest.raises(StaleEpoch):
        export(engine, ref("a", 1))
    with pytest.raises(CacheMiss) as newer:
        export(engine, ref("a", 3))
    assert newer.value.reason == "new_epoch"
    prefill(engine, ref("b"), [1, 2, 3])  # evicts a
    with pytest.raises(CacheMiss) as evicted:
        export(engine, ref("a", 2))
    assert evicted.value.reason == "evicted"
    engine.release(ReleaseRequest(session=ref("b")))
    with pytest.raises(StaleEpoch):
        export(engine, ref("b"))
    assert engine.metrics().exports == 0
    assert engine.metrics().errors == {"cache_miss": 3, "stale_epoch": 2}


# ----------------------------------------------------------------------------- epochs


@pytest.fixture
def snapshot() -> SessionSnapshot:
    source = _engine()
    prefill(source, ref("s", 5), [1, 2, 3])
    return export(source, ref("s", 5))


def test_import_epoch_rules(snapshot: SessionSnapshot) -> None:
    # Unknown session: installed under the snapshot's epoch.
    target = _engine()
    assert import_(target, snapshot).session == ref("s", 5)
    # Equal to the live epoch, or older than it: StaleEpoch, nothing changed.
    before = state_of(target)
    with pytest.raises(StaleEpoch):
        import_(target, snapshot)
    prefill(target, ref("s", 7), [9])
    before = state_of(target)
    with pytest.raises(StaleEpoch):
        import_(target, snapshot, epoch=6)
    with pytest.raises(StaleEpoch):
        import_(target, snapshot, epoch=7)
    assert state_of(target) == before
    # Newer than the live epoch: replaces it (the old slot is freed at commit).
    result = import_(target, snapshot, epoch=8)
    assert result.replaced
    assert result.session == ref("s", 8)
    assert target.health().sessions == 1
    assert target.health().kv_used_tokens == 3
    assert len(target.cache) == 1
    with pytest.raises(StaleEpoch):
        decode(target, ref("s", 7), 1, 1)
    decode(target, ref("s", 8), 3, 1)


def test_import_respects_tombstones(snapshot: SessionSnapshot) -> None:
    target = _engine()
    prefill(target, ref("s", 5), [9])
    target.release(ReleaseRequest(session=ref("s", 5)))
    with pytest.raises(StaleEpoch):
        import_(target, snapshot)  # epoch 5 was released here
    assert target.health().sessions == 0
    assert import_(target, snapshot, epoch=6).session == ref("s", 6)


def test_import_after_eviction_at_the_same_epoch_is_allowed(snapshot: SessionSnapshot) -> None:
    target = _engine(eviction="lru", kv_budget_tokens=4)
    prefill(target, ref("s", 5), [9])
    prefill(target, ref("other"), [1, 2, 3, 4])  # evicts s at epoch 5
    with pytest.raises(StaleEpoch):
        import_(target, replaced(snapshot, session=ref("s", 4)))
    result = import_(target, snapshot)  # evicts "other" at commit to fit
    assert (result.session, result.evicted) == (ref("s", 5), 1)


def test_import_epoch_argument_must_not_be_older_than_the_snapshot(
    snapshot: SessionSnapshot,
) -> None:
    target = _engine()
    with pytest.raises(InvalidRequest, match="older than the snapshot") as caught:
        import_(target, snapshot, epoch=4)
    assert caught.value.details["field"] == "ImportSessionRequest.epoch"
    assert target.health().sessions == 0


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("field", "error"),
    [
        ("engine", ShardMismatch),
        ("engine_version", ShardMismatch),
        ("model_fingerprint", ShardMismatch),
        ("shard", ShardMismatch),
        ("boundary_dtype", ShardMismatch),
        ("settings_fingerprint", ShardMismatch),
        ("contract_version", ContractVersionMismatch),
    ],
)
def test_snapshot_for_another_target_is_refused(
    snapshot: SessionSnapshot, field: str, error: type[Exception]
) -> None:
    changes: dict[str, object] = {
        "engine": {"engine": "other"},
        "engine_version": {"engine_version": "2"},
        "model_fingerprint": {"model_fingerprint": "other-model"},
        "shard": {"shard": ShardSpec(model="m", n_layers=2, start=0, end=1)},
        "boundary_dtype": {"boundary_dtype": "f16"},
        "settings_fingerprint": {"settings_fingerprint": "0" * 32},
        "contract_version": {"contract_version": CONTRACT_VERSION + 1},
    }[field]  # type: ignore[assignment]
    target = _engine()
    before = state_of(target)
    with pytest.raises(error):
        import_(target, replaced(snapshot, **changes))
    assert state_of(target) == before


def test_the_model_path_may_differ_but_settings_may_not(snapshot: SessionSnapshot) -> None:
    elsewhere = replaced(
        snapshot, shard=ShardSpec(model="/other/path/m", n_layers=2, start=0, end=2)
    )
    assert import_(_engine(), elsewhere).length == 3
    for engine in (_engine(settings="b"), _engine(max_context=1024), _engine(boundary_dtype="f16")):
        with pytest.raises(ShardMismatch):
            import_(engine, snapshot)
        assert engine.health().sessions == 0


def test_corrupted_truncated_and_oversized_snapshots(snapshot: SessionSnapshot) -> None:
    state = b"".join(snapshot.chunks)
    flipped = bytearray(state)
    flipped[5] ^= 0x10
    target = _engine()
    cases: list[tuple[SessionSnapshot, type[Exception], str]] = [
        (replaced(snapshot, chunks=(bytes(flipped),)), ChecksumMismatch, "checksum"),
        (replaced(snapshot, chunks=(state[:-4],)), ChecksumMismatch, "truncated"),
        (replaced(snapshot, chunks=(state, b"x")), ChecksumMismatch, "extended"),
        (replaced(snapshot, chunks=()), ChecksumMismatch, "truncated"),
        (replaced(snapshot, state_bytes=10**12), ResourceExhausted, "exceeds the limit"),
        (replaced(snapshot, length=0), InvalidRequest, "at least one position"),
        (replaced(snapshot, length=10**6), ResourceExhausted, "max_context"),
        (replaced(snapshot, length=2), InvalidRequest, "state size does not fit"),
    ]
    for bad, error, text in cases:
        with pytest.raises(error, match=text):
            import_(target, bad)
        assert target.health().sessions == 0
        assert target.cache == {}
    assert target.health().state == "ready"


@pytest.mark.parametrize(
    "layout", ["halves", "empty first", "empty last", "short then full", "two short"]
)
def test_chunks_must_be_full_but_the_last(snapshot: SessionSnapshot, layout: str) -> None:
    """Every chunk but the last holds exactly SNAPSHOT_CHUNK_BYTES and none is empty (what
    split_chunks makes and transports stream): another cut of the same state and checksum is
    InvalidRequest from the engine, the validating wrapper and the codec, and installs
    nothing."""
    state = b"".join(snapshot.chunks)
    full = b"\0" * SNAPSHOT_CHUNK_BYTES
    chunks = {
        "halves": _halves(state),
        "empty first": (b"", state),
        "empty last": (state, b""),
        "short then full": (state, full),
        "two short": (state[:1], state[1:]),
    }[layout]
    joined = b"".join(chunks)
    bad = replaced(
        snapshot, chunks=chunks, state_bytes=len(joined), checksum=payload_checksum(joined)
    )
    target = _engine()
    with pytest.raises(InvalidRequest, match="every chunk but the last"):
        import_(target, bad)
    with pytest.raises(InvalidRequest, match="every chunk but the last"):
        ValidatingEngine(_engine()).import_session(
            ImportSessionRequest(request_id="i", snapshot=bad)
        )
    with pytest.raises(InvalidRequest, match="every chunk but the last"):
        Codec().verify_snapshot(bad)
    assert target.health().sessions == 0


def test_chunks_are_measured_in_bytes_whatever_their_buffer_format(
    snapshot: SessionSnapshot,
) -> None:
    """A chunk may be any contiguous buffer: one viewed as float32 (or 2-D) holds as many
    bytes as it says, not as many items, and is installed like its bytes."""
    state = b"".join(snapshot.chunks)
    # The state is one chunk (it is shorter than SNAPSHOT_CHUNK_BYTES), viewed as 2-D float32
    # rows when its size allows, else as one 2-D row of bytes: len() counts rows either way.
    if len(state) % 4 == 0:
        view = np.frombuffer(state, dtype=np.float32).reshape(-1, 1).data
    else:
        view = np.frombuffer(state, dtype=np.uint8).reshape(1, -1).data
    assert len(view) != len(state)
    moved = replaced(snapshot, chunks=(view,))
    Codec().verify_snapshot(moved)
    target = _engine()
    assert import_(target, moved).length == snapshot.length


def test_migration_needs_the_capability() -> None:
    engine = _engine(migration=False)
    prefill(engine, ref(), [1, 2])
    with pytest.raises(UnsupportedFeature):
        export(engine, ref())
    source = _engine()
    prefill(source, ref("t"), [1])
    with pytest.raises(UnsupportedFeature):
        import_(engine, export(source, ref("t")))
    assert engine.health().sessions == 1


class _NoHooks(StateEngine):
    """Claims the feature but implements neither hook: the core's defaults refuse."""

    def _export_state(self, slot: int, length: int) -> bytes:
        return EngineCore._export_state(self, slot, length)

    def _import_state(self, slot: int, length: int, state: bytes) -> None:
        EngineCore._import_state(self, slot, length, state)


def test_default_hooks_refuse(snapshot: SessionSnapshot) -> None:
    engine = _NoHooks()
    engine.load(LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=2)))
    prefill(engine, ref(), [1])
    with pytest.raises(UnsupportedFeature):
        export(engine, ref())
    with pytest.raises(UnsupportedFeature):
        import_(engine, snapshot)
    assert engine.health().sessions == 1
    assert engine.health().state == "ready"


# ----------------------------------------------------------------------------- atomicity


def test_failed_import_leaves_no_session_no_slot_and_the_older_epoch_intact(
    snapshot: SessionSnapshot,
) -> None:
    target = _engine()
    prefill(target, ref("s", 1), [7, 7])
    expected = decode(_copy_of(target, ref("s", 1)), ref("s", 1), 2, 3)
    before = state_of(target)
    target.fail_import = ResourceExhausted("backend out of memory")
    with pytest.raises(ResourceExhausted):
        import_(target, snapshot)
    assert state_of(target) == before
    target.fail_import = ValueError("a backend bug on hostile state")
    with pytest.raises(InvalidRequest, match="could not be installed"):
        import_(target, snapshot)
    assert state_of(target) == before
    assert target.health().state == "ready"
    assert decode(target, ref("s", 1), 2, 3) == expected
    assert target.metrics().errors == {"resource_exhausted": 1, "invalid_request": 1}


def _copy_of(engine: StateEngine, session: SessionRef) -> StateEngine:
    copy = _engine()
    import_(copy, export(engine, session, rid="copy"))
    return copy


def test_a_backend_that_cannot_drop_a_failed_import_fails_the_engine(
    snapshot: SessionSnapshot,
) -> None:
    target = _engine()
    target.fail_import = ResourceExhausted("out of memory")
    target.fail_drop = True
    with pytest.raises(EngineCrashed):
        import_(target, snapshot)
    assert target.health().state == "failed"


def test_import_under_budget_pressure_evicts_only_at_commit(snapshot: SessionSnapshot) -> None:
    # reject: refused, nothing changed.
    target = _engine(kv_budget_tokens=4)
    prefill(target, ref("idle"), [1, 2])
    before = state_of(target)
    with pytest.raises(ResourceExhausted):
        import_(target, snapshot)
    assert state_of(target) == before
    # lru, but the import fails: the victim is untouched (no eviction before the commit).
    target = _engine(kv_budget_tokens=4, eviction="lru")
    prefill(target, ref("idle"), [1, 2])
    before = state_of(target)
    target.fail_import = ResourceExhausted("out of memory")
    with pytest.raises(ResourceExhausted):
        import_(target, snapshot)
    assert state_of(target) == before
    decode(target, ref("idle"), 2, 1)
    # lru, succeeding: the victim is evicted at commit and its next decode is CacheMiss.
    target.fail_import = None
    assert import_(target, snapshot).evicted == 1
    with pytest.raises(CacheMiss) as miss:
        decode(target, ref("idle"), 3, 1)
    assert miss.value.reason == "evicted"
    assert target.metrics().evictions == 1


def test_import_obeys_max_sessions(snapshot: SessionSnapshot) -> None:
    target = _engine(max_sessions=1)
    prefill(target, ref("other"), [1])
    with pytest.raises(ResourceExhausted) as caught:
        import_(target, snapshot)
    assert caught.value.details["resource"] == "sessions"
    # Replacing a live epoch needs no new session: the spare slot holds it until the commit.
    target = _engine(max_sessions=1)
    prefill(target, ref("s", 1), [1])
    assert import_(target, snapshot).replaced
    assert target.health().sessions == 1


# ----------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("by", ["request_id", "session_id"])
def test_cancelled_import_installs_nothing(snapshot: SessionSnapshot, by: str) -> None:
    target = _engine()
    prefill(target, ref("s", 1), [7])
    before = state_of(target)
    target.gate = threading.Event()
    errors: list[Exception] = []

    def run() -> None:
        try:
            import_(target, snapshot, rid="slow")
        except Exception as error:  # noqa: BLE001 - examined below
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    assert target.entered.wait(10)
    request = (
        CancelRequest(request_id="slow") if by == "request_id" else CancelRequest(session_id="s")
    )
    assert target.cancel(request).cancelled
    target.gate.set()
    thread.join()
    assert len(errors) == 1
    assert isinstance(errors[0], Cancelled)
    assert state_of(target) == before
    assert target.metrics().cancelled == 1
    assert not target.cancel(CancelRequest(request_id="slow")).cancelled


def test_cancel_after_export_and_import_finished_answers_false(snapshot: SessionSnapshot) -> None:
    target = _engine()
    import_(target, snapshot, rid="done")
    assert not target.cancel(CancelRequest(request_id="done")).cancelled
    export(target, ref("s", 5), rid="done2")
    assert not target.cancel(CancelRequest(request_id="done2")).cancelled


def test_asyncio_cancel_of_a_running_import_means_nothing_changed(
    snapshot: SessionSnapshot,
) -> None:
    target = _engine()
    target.gate = threading.Event()

    async def scenario() -> None:
        adapter = AsyncShardEngine(target)
        task = asyncio.ensure_future(
            adapter.import_session(ImportSessionRequest(request_id="a", snapshot=snapshot))
        )
        while not target.entered.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.sleep(0.01)
        assert target.gate is not None
        target.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert target.health().sessions == 0
        target.gate = None
        result = await adapter.import_session(
            ImportSessionRequest(request_id="b", snapshot=snapshot)
        )
        assert result.length == 3
        moved = await adapter.export_session(
            ExportSessionRequest(request_id="c", session=ref("s", 5))
        )
        assert moved.checksum == snapshot.checksum

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- the edge


def test_badly_typed_requests_are_refused_before_anything_changes(
    snapshot: SessionSnapshot,
) -> None:
    target = _engine()
    bad_imports: list[object] = [
        ImportSessionRequest(request_id="i", snapshot=snapshot, epoch=-1),
        ImportSessionRequest(request_id="i", snapshot=snapshot, epoch=True),
        ImportSessionRequest(request_id="", snapshot=snapshot),
        ImportSessionRequest(
            request_id="i", snapshot=replaced(snapshot, chunks=list(snapshot.chunks))
        ),
        ImportSessionRequest(request_id="i", snapshot=replaced(snapshot, chunks=("text",))),
        ImportSessionRequest(
            request_id="i", snapshot=replaced(snapshot, chunks=(b"x" * (SNAPSHOT_CHUNK_BYTES + 1),))
        ),
        ImportSessionRequest(request_id="i", snapshot=replaced(snapshot, length=2**64)),
        ImportSessionRequest(request_id="i", snapshot=replaced(snapshot, boundary_dtype="f8")),
        ImportSessionRequest(request_id="i", snapshot=None),  # type: ignore[arg-type]
    ]
    for request in bad_imports:
        with pytest.raises(InvalidRequest):
            target.import_session(request)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        target.export_session(ExportSessionRequest(request_id="x", session="s"))  # type: ignore[arg-type]
    assert target.metrics().requests == 0
    assert target.health().sessions == 0


# ----------------------------------------------------------------------------- the codec


def test_codec_bounds_and_verifies_snapshots(snapshot: SessionSnapshot) -> None:
    for message in (snapshot, ImportSessionRequest(request_id="i", snapshot=snapshot, epoch=9)):
        assert decode_message(encode(message)) == message
    state = b"".join(snapshot.chunks)
    corrupted = encode(replaced(snapshot, chunks=(state[:-1] + bytes([state[-1] ^ 1]),)))
    with pytest.raises(ChecksumMismatch):
        decode_message(corrupted)
    with pytest.raises(ChecksumMismatch):
        Codec().decode_request(
            encode(ImportSessionRequest(request_id="i", snapshot=replaced(snapshot, chunks=())))
        )
    with pytest.raises(ResourceExhausted):
        Codec(max_payload_bytes=8).decode_message(encode(snapshot))
    foreign = encode(replaced(snapshot, contract_version=CONTRACT_VERSION + 1))
    with pytest.raises(ContractVersionMismatch):
        decode_message(foreign)
    # A chunk above the bound is refused from its length header.
    big = msgspec.msgpack.encode(replaced(snapshot, chunks=(b"x" * (SNAPSHOT_CHUNK_BYTES + 1),)))
    with pytest.raises(InvalidRequest):
        decode_message(big)


# ----------------------------------------------------------------------------- validation


def test_validating_engine_checks_exports_and_imports(snapshot: SessionSnapshot) -> None:
    inner = _engine()
    engine = ValidatingEngine(inner)
    prefill(inner, ref("v"), [1, 2])
    good = engine.export_session(ExportSessionRequest(request_id="x", session=ref("v")))
    assert good.length == 2
    with pytest.raises(ChecksumMismatch):
        engine.import_session(
            ImportSessionRequest(request_id="i", snapshot=replaced(snapshot, checksum=1))
        )
    assert inner.health().sessions == 1
    result = engine.import_session(ImportSessionRequest(request_id="i", snapshot=snapshot, epoch=6))
    assert result.session == ref("s", 6)


class _Lies(StateEngine):
    """Exports snapshots that break the contract in the way ``lie`` says."""

    lie = "checksum"

    def export_session(self, request: ExportSessionRequest) -> SessionSnapshot:
        snapshot = super().export_session(request)
        all_changes: dict[str, dict[str, object]] = {
            "checksum": {"checksum": snapshot.checksum ^ 1},
            "session": {"session": ref("someone-else")},
            "shard": {"shard": ShardSpec(model="m", n_layers=2, start=0, end=1)},
            "truncated": {"chunks": ()},
            "uneven": {"chunks": _halves(b"".join(snapshot.chunks))},
            "empty chunk": {"chunks": (*snapshot.chunks, b"")},
            "dtype": {"boundary_dtype": "f16"},
            "fields": {"length": "3"},
        }
        return replaced(snapshot, **all_changes[self.lie])

    def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        result = super().import_session(request)
        if self.lie == "import_epoch":
            return msgspec.structs.replace(result, session=ref(result.session.session_id, 99))
        return result


def _halves(state: bytes) -> tuple[bytes, ...]:
    """``state`` cut in two (a layout no transport streams: the first chunk is not full)."""
    return (state[: len(state) // 2], state[len(state) // 2 :])


@pytest.mark.parametrize(
    "lie",
    ["checksum", "session", "shard", "truncated", "uneven", "empty chunk", "dtype", "fields"],
)
def test_validating_engine_refuses_bad_exports(lie: str) -> None:
    inner = _Lies()
    inner.lie = lie
    engine = ValidatingEngine(inner)
    engine.load(LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=2)))
    prefill(inner, ref(), [1, 2])
    with pytest.raises(MalformedOutput):
        engine.export_session(ExportSessionRequest(request_id="x", session=ref()))


def test_validating_engine_types_the_import_request_first(snapshot: SessionSnapshot) -> None:
    engine = ValidatingEngine(_engine())
    for chunks in (("text",), [b"x"], (None,)):
        bad = ImportSessionRequest(
            request_id="i",
            snapshot=replaced(snapshot, chunks=chunks),
        )
        with pytest.raises(InvalidRequest, match="chunks"):
            engine.import_session(bad)


def test_validating_engine_refuses_a_wrong_import_result(snapshot: SessionSnapshot) -> None:
    inner = _Lies()
    inner.lie = "import_epoch"
    engine = ValidatingEngine(inner)
    engine.load(LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=2)))
    with pytest.raises(MalformedOutput, match="session"):
        engine.import_session(ImportSessionRequest(request_id="i", snapshot=snapshot))


def test_validating_engine_refuses_exports_of_an_engine_without_the_capability() -> None:
    class Sneaky(StateEngine):
        def _migration_target(self, caps: object) -> object:  # type: ignore[override]
            assert self._snapshot_target is not None
            return self._snapshot_target

    inner = Sneaky(migration=False)
    engine = ValidatingEngine(inner)
    engine.load(LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=2)))
    prefill(inner, ref(), [1])
    with pytest.raises(MalformedOutput, match="session_migration"):
        engine.export_session(ExportSessionRequest(request_id="x", session=ref()))


def test_export_and_import_count_as_requests(snapshot: SessionSnapshot) -> None:
    """Metrics.requests counts every call that carries a request id, as its docstring says."""
    source = _engine()
    prefill(source, ref(), [1, 2, 3])
    before = source.metrics().requests
    export(source, ref())
    assert source.metrics().requests == before + 1
    target = _engine()
    import_(target, snapshot)
    assert (target.metrics().requests, target.metrics().imports) == (1, 1)
