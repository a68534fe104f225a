"""EngineCore's session ledger, lifecycle, admission, cancellation and rollback, tested on a
minimal in-file engine whose outputs depend on the whole cached history."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest

from shard_engine_api import (
    AsyncShardEngine,
    BoundaryResult,
    CacheMiss,
    Cancelled,
    CancelRequest,
    DecodeBatchRequest,
    DecodeRequest,
    Determinism,
    EngineCrashed,
    ErrorInfo,
    InvalidRequest,
    LoadConfig,
    LogitsResult,
    MtpState,
    NotReady,
    PrefillRequest,
    ReleaseRequest,
    ResourceExhausted,
    SessionRef,
    ShardSpec,
    StaleEpoch,
    TokenInput,
    UnsupportedFeature,
    WrongRole,
    _steps,
)
from shard_engine_api._checksum import payload_checksum
from shard_engine_api._dtypes import checksum_and_finite, copy_checksum_and_finite
from shard_engine_api._types import MAX_DETAIL_CHARS
from shard_engine_api.engine import CancelToken, EngineCore, ForwardItem, ModelInfo, OutputMode
from shard_engine_api.wire import decode_message, encode

HIDDEN = 4
VOCAB = 16


class HistoryEngine(EngineCore):
    """Hidden row = token embedding + running sum of the session's cached rows; so any lost or
    mixed-up cache changes outputs. ``delay`` makes forwards slow (cancellable)."""

    engine_name = "history"

    def __init__(self, delay: float = 0.0, fail_on_token: int | None = None) -> None:
        super().__init__()
        self.delay = delay
        self.fail_on_token = fail_on_token
        self.cache: dict[int, list[npt.NDArray[np.float32]]] = {}
        self.saved: dict[int, list[npt.NDArray[np.float32]]] = {}
        self.started = threading.Event()

    def _open(self, config: LoadConfig) -> ModelInfo:
        return ModelInfo(
            engine_version="1",
            evidence="fixture",
            model_fingerprint="history-model",
            hidden_size=HIDDEN,
            vocab_size=VOCAB,
            determinism=Determinism(deterministic=True, split_exact=True),
        )

    def _forward(
        self, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        self.started.set()
        if self.delay:
            token.sleep(self.delay)
        cache = self.cache.setdefault(item.slot, [])
        self.saved[item.slot] = list(cache)
        del cache[item.start_pos :]
        if item.tokens is not None:
            rows = np.repeat(item.tokens.astype(np.float32)[:, None], HIDDEN, axis=1)
            if self.fail_on_token is not None and self.fail_on_token in item.tokens:
                cache.extend(rows)
                raise RuntimeError("backend exploded")
        else:
            assert item.hidden is not None
            rows = item.hidden
        out = []
        for row in rows:
            total = np.sum(cache, axis=0) if cache else np.zeros(HIDDEN, np.float32)
            value = (row + 0.5 * total).astype(np.float32)
            cache.append(value)
            out.append(value)
        hidden = np.stack(out)
        if output == "hidden":
            return hidden
        logits = np.tile(hidden[:, :1], (1, VOCAB)) + np.arange(VOCAB, dtype=np.float32)
        return logits[-1:] if output == "last" else logits

    def _rollback(self, slot: int, start_pos: int, committed_length: int) -> None:
        if slot in self.saved:
            self.cache[slot] = self.saved.pop(slot)
        del self.cache.setdefault(slot, [])[committed_length:]

    def _commit(self, slot: int) -> None:
        self.saved.pop(slot, None)

    def _drop(self, slot: int) -> None:
        self.cache.pop(slot, None)

    def _close(self) -> None:
        self.cache.clear()


def _engine(**overrides: object) -> HistoryEngine:
    delay = overrides.pop("delay", 0.0)
    fail = overrides.pop("fail_on_token", None)
    engine = HistoryEngine(delay=float(delay), fail_on_token=fail)  # type: ignore[arg-type]
    fields: dict[str, object] = {"shard": ShardSpec(model="m", n_layers=2, start=0, end=2)}
    fields.update(overrides)
    engine.load(LoadConfig(**fields))  # type: ignore[arg-type]
    return engine


def _prefill(
    engine: HistoryEngine, session: SessionRef, tokens: Sequence[int], start: int = 0
) -> LogitsResult:
    result = engine.prefill(
        PrefillRequest(
            request_id=f"p-{session.session_id}-{start}-{len(tokens)}",
            session=session,
            start_pos=start,
            inputs=TokenInput(token_ids=tuple(tokens)),
        )
    )
    assert isinstance(result, LogitsResult)
    return result


def _decode(engine: HistoryEngine, session: SessionRef, pos: int, token: int) -> LogitsResult:
    result = engine.decode(
        DecodeRequest(
            request_id=f"d-{session.session_id}-{pos}",
            session=session,
            pos=pos,
            inputs=TokenInput(token_ids=(token,)),
        )
    )
    assert isinstance(result, LogitsResult)
    return result


S1 = SessionRef(session_id="s1", epoch=1)


def test_not_ready_before_load_and_after_close() -> None:
    engine = HistoryEngine()
    assert engine.health().state == "unloaded"
    with pytest.raises(NotReady, match="not loaded") as never_loaded:
        _prefill(engine, S1, [1])
    assert never_loaded.value.retryable is False
    engine.load(LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=2)))
    assert engine.health().state == "ready"
    with pytest.raises(InvalidRequest):
        engine.load(LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=2)))
    engine.close()
    engine.close()
    assert engine.health().state == "closed"
    with pytest.raises(NotReady):
        _prefill(engine, S1, [1])


def test_decode_equals_longer_prefill_and_truncate_replays() -> None:
    engine = _engine()
    full = _prefill(engine, S1, [1, 2, 3, 4]).array()
    other = SessionRef(session_id="s2", epoch=1)
    _prefill(engine, other, [1, 2, 3])
    stepped = _decode(engine, other, 3, 4).array()
    assert np.array_equal(full, stepped)
    truncated = _prefill(engine, other, [4], start=3).array()
    assert np.array_equal(full, truncated)
    assert engine.health().kv_used_tokens == 8


def test_cache_miss_carries_committed_length_and_reason() -> None:
    engine = _engine()
    _prefill(engine, S1, [1, 2, 3])
    with pytest.raises(CacheMiss) as miss:
        _decode(engine, S1, 5, 1)
    assert (miss.value.committed_length, miss.value.reason) == (3, "position_mismatch")
    with pytest.raises(CacheMiss) as gap:
        _prefill(engine, S1, [1], start=4)
    assert (gap.value.committed_length, gap.value.reason) == (3, "gap")
    with pytest.raises(CacheMiss) as unknown:
        _decode(engine, SessionRef(session_id="nobody", epoch=1), 0, 1)
    assert unknown.value.reason == "unknown_session"


def test_epochs_fence_and_newer_epoch_starts_fresh() -> None:
    engine = _engine()
    fresh = _prefill(engine, S1, [1, 2]).array()
    _decode(engine, S1, 2, 3)
    newer = SessionRef(session_id="s1", epoch=2)
    with pytest.raises(CacheMiss):
        _decode(engine, newer, 3, 1)
    assert np.array_equal(_prefill(engine, newer, [1, 2]).array(), fresh)
    with pytest.raises(StaleEpoch):
        _decode(engine, S1, 2, 3)
    assert engine.release(ReleaseRequest(session=newer)).released
    for epoch in (1, 2):
        with pytest.raises(StaleEpoch):
            _prefill(engine, SessionRef(session_id="s1", epoch=epoch), [1])
    third = SessionRef(session_id="s1", epoch=3)
    assert np.array_equal(_prefill(engine, third, [1, 2]).array(), fresh)
    unknown = engine.release(ReleaseRequest(session=SessionRef(session_id="zz", epoch=1)))
    assert not unknown.released
    assert "unknown" in unknown.detail


def test_failed_forward_rolls_back_and_crashes_engine() -> None:
    engine = _engine(fail_on_token=9)
    _prefill(engine, S1, [1, 2])
    before = engine.cache[0][:]
    with pytest.raises(EngineCrashed):
        _prefill(engine, S1, [9], start=1)
    assert [row.tolist() for row in engine.cache[0]] == [row.tolist() for row in before]
    assert engine.health().state == "failed"
    with pytest.raises(EngineCrashed):
        _decode(engine, S1, 2, 1)
    assert engine.metrics().errors["engine_crashed"] == 2


def test_a_backend_failure_of_any_length_leaves_a_health_within_the_wire_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backend exception's message becomes the failed engine's health detail: cut to
    MAX_DETAIL_CHARS (saying so), so the health still encodes and decodes."""
    engine = _engine()
    _prefill(engine, S1, [1, 2])

    def explode(*args: object) -> npt.NDArray[np.float32]:
        raise RuntimeError("x" * 100_000)

    monkeypatch.setattr(engine, "_forward", explode)
    with pytest.raises(EngineCrashed):
        _prefill(engine, S1, [3], start=2)
    health = engine.health()
    assert health.state == "failed"
    assert len(health.detail) == MAX_DETAIL_CHARS
    assert health.detail.endswith("more characters cut]")
    assert decode_message(encode(health)) == health


def test_budget_rejects_or_evicts_lru() -> None:
    engine = _engine(kv_budget_tokens=6)
    _prefill(engine, S1, [1, 2, 3, 4])
    with pytest.raises(ResourceExhausted):
        _prefill(engine, SessionRef(session_id="s2", epoch=1), [1, 2, 3])
    assert engine.health().kv_used_tokens == 4
    lru = _engine(kv_budget_tokens=6, eviction="lru")
    _prefill(lru, S1, [1, 2, 3, 4])
    _prefill(lru, SessionRef(session_id="s2", epoch=1), [1, 2, 3])
    with pytest.raises(CacheMiss) as miss:
        _decode(lru, S1, 4, 1)
    assert miss.value.reason == "evicted"
    assert lru.metrics().evictions == 1


def test_session_slots_limit() -> None:
    engine = _engine(max_sessions=1)
    _prefill(engine, S1, [1])
    with pytest.raises(ResourceExhausted):
        _prefill(engine, SessionRef(session_id="s2", epoch=1), [1])


def test_cancel_from_another_thread_rolls_back() -> None:
    engine = _engine(delay=5.0)
    engine.delay = 0.0
    _prefill(engine, S1, [1, 2])
    engine.delay = 5.0
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _decode(engine, S1, 2, 3)
        except Cancelled as error:
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    assert engine.started.wait(5)
    assert engine.cancel(CancelRequest(session_id="s1")).cancelled
    thread.join(5)
    assert len(errors) == 1, "the 5 s delay ended only through the cancel"
    assert not engine.cancel(CancelRequest(request_id="d-s1-2")).cancelled
    engine.delay = 0.0
    assert _decode(engine, S1, 2, 3).first_pos == 2
    assert engine.metrics().cancelled == 1


def test_batch_gives_per_item_errors_and_matches_single_decodes() -> None:
    engine = _engine()
    reference = _engine()
    sessions = [SessionRef(session_id=f"b{i}", epoch=1) for i in range(3)]
    for index, session in enumerate(sessions):
        _prefill(engine, session, [index + 1, 2])
        _prefill(reference, session, [index + 1, 2])
    items = [
        DecodeRequest(request_id=f"i{i}", session=s, pos=2, inputs=TokenInput(token_ids=(5,)))
        for i, s in enumerate(sessions)
    ]
    items.append(
        DecodeRequest(
            request_id="bad",
            session=SessionRef(session_id="ghost", epoch=1),
            pos=0,
            inputs=TokenInput(token_ids=(1,)),
        )
    )
    batch = engine.decode_batch(DecodeBatchRequest(request_id="batch", items=tuple(items)))
    assert len(batch.items) == 4
    for session, item in zip(sessions, batch.items[:3], strict=True):
        assert isinstance(item, LogitsResult)
        assert np.array_equal(item.array(), _decode(reference, session, 2, 5).array())
    error = batch.items[3]
    assert isinstance(error, ErrorInfo)
    assert error.code == "cache_miss"


def test_wrong_role_and_reserved_hooks() -> None:
    engine = _engine()
    with pytest.raises(UnsupportedFeature):
        engine.prefill(
            PrefillRequest(
                request_id="r",
                session=S1,
                start_pos=0,
                inputs=TokenInput(token_ids=(1,)),
                mtp=(MtpState(n_draft_tokens=1),),
            )
        )
    tail = HistoryEngine()
    tail.load(LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=1, end=2)))
    with pytest.raises(WrongRole):
        _prefill(tail, S1, [1])
    with pytest.raises(InvalidRequest):
        _prefill(engine, S1, [VOCAB])


def test_head_bundle_feeds_tail() -> None:
    head = HistoryEngine()
    head.load(LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=1)))
    result = head.prefill(
        PrefillRequest(request_id="h", session=S1, start_pos=0, inputs=TokenInput(token_ids=(3,)))
    )
    assert isinstance(result, BoundaryResult)
    assert result.bundle.layer == 1
    tail = HistoryEngine()
    tail.load(LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=1, end=2)))
    out = tail.prefill(
        PrefillRequest(request_id="t", session=S1, start_pos=0, inputs=result.bundle)
    )
    assert isinstance(out, LogitsResult)
    assert out.evidence == "fixture"


def test_async_adapter_cancels_on_task_cancel() -> None:
    engine = _engine()
    _prefill(engine, S1, [1, 2])
    engine.delay = 5.0
    adapter = AsyncShardEngine(engine)

    async def scenario() -> None:
        task = asyncio.create_task(
            adapter.decode(
                DecodeRequest(
                    request_id="async", session=S1, pos=2, inputs=TokenInput(token_ids=(1,))
                )
            )
        )
        await asyncio.to_thread(engine.started.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        health = await adapter.health()
        assert health.kv_used_tokens == 2
        assert health.in_flight == 0

    engine.started.clear()
    asyncio.run(scenario())
    engine.delay = 0.0
    assert _decode(engine, S1, 2, 1).first_pos == 2


def test_f16_boundary_overflow_is_refused_and_rolled_back() -> None:
    """Hidden states beyond the f16 range cannot travel as f16: the request fails with
    ResourceExhausted and the session keeps its committed length."""

    class Loud(HistoryEngine):
        def _forward(
            self, item: ForwardItem, output: OutputMode, token: CancelToken
        ) -> npt.NDArray[np.float32]:
            return super()._forward(item, output, token) * np.float32(1e5)

    head = Loud()
    head.load(
        LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=1), boundary_dtype="f16")
    )
    with pytest.raises(ResourceExhausted) as refused:
        head.prefill(
            PrefillRequest(
                request_id="h", session=S1, start_pos=0, inputs=TokenInput(token_ids=(3,))
            )
        )
    assert refused.value.details["resource"] == "boundary_dtype_range"
    assert head.health().kv_used_tokens == 0
    assert head.cache.get(0, []) == []


class _KeepsRows(HistoryEngine):
    """Remembers every array its forwards return (to test who owns them afterwards)."""

    def __init__(self) -> None:
        super().__init__()
        self.returned: list[npt.NDArray[np.float32]] = []

    def _forward(
        self, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        rows = np.ascontiguousarray(super()._forward(item, output, token), dtype=np.float32)
        self.returned.append(rows)
        return rows


class _PrivateRows(_KeepsRows):
    rows_private = True


@pytest.mark.parametrize("end", [1, 2], ids=["head-bundle", "tail-logits"])
def test_private_rows_become_the_payload_read_only(end: int) -> None:
    engine = _PrivateRows()
    engine.load(LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=end)))
    result = engine.prefill(
        PrefillRequest(request_id="p", session=S1, start_pos=0, inputs=TokenInput(token_ids=(3, 4)))
    )
    rows = engine.returned[-1]
    payload = result.bundle.payload if isinstance(result, BoundaryResult) else result.payload
    array = result.bundle.array() if isinstance(result, BoundaryResult) else result.array()
    # No copy: the result's payload is the backend's array, which is now read-only.
    assert np.shares_memory(np.frombuffer(payload, dtype=np.uint8), rows)
    assert not rows.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        rows[0, 0] = 1.0
    np.testing.assert_array_equal(array, rows)
    carrier = result.bundle if isinstance(result, BoundaryResult) else result
    assert carrier.checksum == payload_checksum(carrier.payload)


class _DigestingRows(_PrivateRows):
    """Copies its rows out of a scratch buffer it reuses, hashing them on the way (what a
    backend copying out of its library's output buffer does), and records the digests; with
    ``lie`` it records a wrong checksum, to show which value the result carries."""

    def __init__(self, *, private: bool = True, lie: bool = False) -> None:
        super().__init__()
        self.private = private
        self.lie = lie

    def _forward(
        self, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        scratch = super()._forward(item, output, token)
        rows = np.empty_like(scratch)
        checksum, finite = copy_checksum_and_finite(rows, scratch, "f32")
        self.returned[-1] = rows
        self._record_digest(rows, checksum ^ 1 if self.lie else checksum, finite)
        return rows


@pytest.mark.parametrize("end", [1, 2], ids=["head-bundle", "tail-logits"])
def test_a_recorded_digest_is_the_results_checksum_without_a_second_pass(
    end: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A private backend's recorded digest becomes the payload's checksum and scan mark (the
    payload is not hashed again); the entry is consumed, and entries of rows that died are swept."""
    from shard_engine_api import _results

    hashed: list[int] = []
    original = checksum_and_finite

    def counting(payload: memoryview, dtype: str) -> tuple[int, bool]:
        hashed.append(len(payload))
        return original(payload, "f32")

    monkeypatch.setattr(_results, "checksum_and_finite", counting)
    engine = _DigestingRows()
    engine.load(LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=end)))
    result = engine.prefill(
        PrefillRequest(request_id="p", session=S1, start_pos=0, inputs=TokenInput(token_ids=(3, 4)))
    )
    carrier = result.bundle if isinstance(result, BoundaryResult) else result
    assert carrier.checksum == payload_checksum(carrier.payload)
    assert hashed == []
    assert engine._digests == {}
    liar = _DigestingRows(lie=True)
    liar.load(LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=end)))
    lied = liar.prefill(
        PrefillRequest(request_id="p", session=S1, start_pos=0, inputs=TokenInput(token_ids=(3, 4)))
    )
    carrier = lied.bundle if isinstance(lied, BoundaryResult) else lied
    # The core trusts the backend's digest (it is the backend's own promise, like its rows).
    assert carrier.checksum == payload_checksum(carrier.payload) ^ 1
    rows = np.ones((1, 4), dtype=np.float32)
    engine._record_digest(rows, 5, True)
    assert len(engine._digests) == 1
    del rows
    # Entries of rows that died unconsumed are dropped once the table fills: it stays bounded,
    # and the entries of rows still alive are kept.
    alive = [np.ones((1, 4), dtype=np.float32) for _ in range(5)]
    for row in alive:
        engine._record_digest(row, 7, True)
    for _ in range(3 * _steps._DIGEST_ENTRIES):
        engine._record_digest(np.ones((1, 4), dtype=np.float32), 5, True)
        assert len(engine._digests) <= _steps._DIGEST_ENTRIES
    for row in alive:
        entry = engine._digests[id(row)]
        assert entry[0]() is row
        assert entry[1:] == (7, True)
    # Many live rows at once (a large batch): every entry is kept, and the table is swept once
    # per doubling, not once per row.
    engine._digests.clear()
    engine._digest_limit = _steps._DIGEST_ENTRIES
    sweeps: list[int] = []
    sweep = engine._sweep_digests

    def counted_sweep() -> None:
        sweeps.append(len(engine._digests))
        sweep()

    monkeypatch.setattr(engine, "_sweep_digests", counted_sweep)
    batch = [np.ones((1, 4), dtype=np.float32) for _ in range(8 * _steps._DIGEST_ENTRIES)]
    for row in batch:
        engine._record_digest(row, 3, True)
    assert len(engine._digests) == len(batch)
    assert sweeps == [1024, 2048, 4096]


def test_digests_of_rows_not_declared_private_are_ignored() -> None:
    """Without rows_private the payload is a copy, hashed by the core whatever was recorded."""

    class Shared(_DigestingRows):
        rows_private = False

    engine = Shared(lie=True)
    engine.load(LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=2)))
    result = _prefill(engine, S1, [3, 4])
    assert result.checksum == payload_checksum(result.payload)
    assert engine._digests == {}


def test_rows_not_declared_private_are_copied() -> None:
    """Without the promise the core copies: a backend that overwrites the array it returned
    (a reused buffer) changes no result already handed out."""
    engine = _KeepsRows()
    engine.load(LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=2)))
    first = _prefill(engine, S1, [3, 4])
    before = first.array().copy()
    engine.returned[-1][...] = -7.0
    np.testing.assert_array_equal(first.array(), before)
    assert first.checksum == payload_checksum(first.payload)


def test_private_rows_with_a_converting_boundary_dtype() -> None:
    """f16 bundles are a conversion (a new array) whether or not the rows are private."""
    engine = _PrivateRows()
    engine.load(
        LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=1), boundary_dtype="f16")
    )
    result = engine.prefill(
        PrefillRequest(request_id="p", session=S1, start_pos=0, inputs=TokenInput(token_ids=(3,)))
    )
    assert isinstance(result, BoundaryResult)
    assert result.bundle.dtype == "f16"
    np.testing.assert_array_equal(result.bundle.array(), engine.returned[-1].astype(np.float16))
    assert result.bundle.checksum == payload_checksum(result.bundle.payload)
