"""EngineCore side effects that must stay inside atomicity: LRU evictions, fences, crashes,
error counting, the unloaded state, double releases and epoch changes."""

from __future__ import annotations

import threading
from collections.abc import Callable

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from test_core import S1, HistoryEngine, _decode, _engine, _prefill

from shard_engine_api import (
    CacheMiss,
    Cancelled,
    CancelRequest,
    DecodeBatchRequest,
    DecodeRequest,
    EngineCrashed,
    ErrorInfo,
    LoadConfig,
    LogitsResult,
    NotReady,
    ReleaseRequest,
    ResourceExhausted,
    SessionRef,
    ShardSpec,
    StaleEpoch,
    TokenInput,
)
from shard_engine_api._fences import BYTES_PER_FENCE
from shard_engine_api._ledger import LedgerLimits, SessionLedger
from shard_engine_api.engine import CancelToken, ForwardItem, ModelInfo, OutputMode

A = SessionRef(session_id="a", epoch=1)
B = SessionRef(session_id="b", epoch=1)
C = SessionRef(session_id="c", epoch=1)


class Refusing(HistoryEngine):
    """Token 13 makes the backend refuse the forward (not a crash); token 12 waits for a
    cancel."""

    def _forward(
        self, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        rows = super()._forward(item, output, token)
        if item.tokens is not None and 13 in item.tokens:
            raise ResourceExhausted("backend out of scratch memory")
        if item.tokens is not None and 12 in item.tokens:
            self.started.set()
            token.sleep(10.0)
        return rows


class SpareSlot(Refusing):
    def _open(self, config: LoadConfig) -> ModelInfo:
        return msgspec.structs.replace(super()._open(config), spare_slot=True)


def _load(engine: HistoryEngine, **config: object) -> HistoryEngine:
    engine.load(
        LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=2), **config)  # type: ignore[arg-type]
    )
    return engine


def _cancel_prefill_midway(engine: HistoryEngine, session: SessionRef) -> None:
    engine.started.clear()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _prefill(engine, session, [1, 12, 2])
        except Cancelled as error:
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    assert engine.started.wait(5)
    assert engine.cancel(CancelRequest(request_id=f"p-{session.session_id}-0-3")).cancelled
    thread.join()
    assert len(errors) == 1


# --------------------------------------------------------------------- LRU side effects


def test_cancelled_prefill_evicts_nothing() -> None:
    """A new session whose admission needs an LRU eviction of an idle session is cancelled
    mid-forward: the idle session survives whole."""
    engine = _load(Refusing(), kv_budget_tokens=6, eviction="lru")
    _prefill(engine, A, [1, 2, 3, 4])
    _cancel_prefill_midway(engine, B)
    assert engine.metrics().evictions == 0
    assert _decode(engine, A, 4, 5).first_pos == 4


def test_failed_prefill_evicts_nothing() -> None:
    engine = _load(Refusing(), kv_budget_tokens=6, eviction="lru")
    _prefill(engine, A, [1, 2, 3, 4])
    with pytest.raises(ResourceExhausted):
        _prefill(engine, B, [1, 13, 2])
    assert engine.health().state == "ready"
    assert engine.metrics().evictions == 0
    assert _decode(engine, A, 4, 5).first_pos == 4


def test_slot_eviction_waits_for_commit_with_a_spare_slot() -> None:
    """Every slot in use: with a spare slot the LRU victim is dropped only when the new
    session commits, so a cancelled newcomer leaves it serving."""
    engine = _load(SpareSlot(), max_sessions=1, eviction="lru")
    _prefill(engine, A, [1, 2])
    _cancel_prefill_midway(engine, B)
    assert _decode(engine, A, 2, 3).first_pos == 2
    _prefill(engine, B, [4])
    with pytest.raises(CacheMiss) as miss:
        _decode(engine, A, 3, 1)
    assert miss.value.reason == "evicted"
    assert engine.metrics().evictions == 1


def _batch(engine: HistoryEngine, *items: tuple[SessionRef, int]) -> list[object]:
    result = engine.decode_batch(
        DecodeBatchRequest(
            request_id="batch",
            items=tuple(
                DecodeRequest(
                    request_id=f"item-{session.session_id}",
                    session=session,
                    pos=pos,
                    inputs=TokenInput(token_ids=(1,)),
                )
                for session, pos in items
            ),
        )
    )
    return list(result.items)


def test_batch_evicts_idle_sessions_not_its_members() -> None:
    engine = _load(HistoryEngine(), kv_budget_tokens=10, eviction="lru")
    _prefill(engine, C, [1])  # idle and least recently used
    _prefill(engine, A, [1, 2, 3, 4])
    _prefill(engine, B, [1, 2, 3, 4])
    outcomes = _batch(engine, (A, 4), (B, 4))
    assert all(isinstance(outcome, LogitsResult) for outcome in outcomes), outcomes
    assert engine.metrics().evictions == 1
    with pytest.raises(CacheMiss):
        _decode(engine, C, 1, 1)


def test_batch_refuses_an_item_rather_than_evict_a_member() -> None:
    engine = _load(HistoryEngine(), kv_budget_tokens=9, eviction="lru")
    _prefill(engine, A, [1, 2, 3, 4])
    _prefill(engine, B, [1, 2, 3, 4])
    first, second = _batch(engine, (A, 4), (B, 4))
    assert isinstance(first, LogitsResult)
    assert isinstance(second, ErrorInfo)
    assert second.code == "resource_exhausted"
    assert engine.metrics().evictions == 0
    assert engine.health().kv_used_tokens == 9  # A grew by one, B kept its four


# --------------------------------------------------------------------- fences


def test_fences_outlive_churn_far_beyond_65536() -> None:
    """The issue's scenario: 70,000 newer sessions released after the first; the first's
    released epoch is still refused, nothing was dropped, and a new session at epoch 1 is
    admitted. Driven through the ledger (the engine adds only locking)."""
    ledger = SessionLedger()
    limits = LedgerLimits(max_sessions=4, max_context=8, kv_budget=32, evict_lru=False)
    churn = 70_000
    for index in range(churn):
        session_id = f"churn-{index}"
        ledger.commit([ledger.admit_prefill(session_id, 3, 0, 1, limits)])
        ledger.release(session_id, 3)
    with pytest.raises(StaleEpoch):
        ledger.admit_prefill("churn-0", 3, 0, 1, limits)
    assert ledger.fences.dropped == 0
    assert len(ledger.fences) == churn
    assert ledger.fences.nbytes <= churn * BYTES_PER_FENCE
    ledger.commit([ledger.admit_prefill("newcomer", 1, 0, 1, limits)])


def test_dropped_fences_show_in_metrics_and_health() -> None:
    class SmallFences(HistoryEngine):
        fence_generation = 64

    engine = _load(SmallFences(), max_sessions=4)
    for index in range(300):
        session = SessionRef(session_id=f"s{index}", epoch=2)
        _prefill(engine, session, [1])
        engine.release(ReleaseRequest(session=session))
    metrics = engine.metrics()
    assert metrics.fences_dropped > 0
    assert "fences dropped early" in engine.health().detail
    assert engine.health().state == "ready"
    with pytest.raises(StaleEpoch):  # the newest are always kept
        _prefill(engine, SessionRef(session_id="s299", epoch=2), [1])
    _prefill(engine, SessionRef(session_id="brand-new", epoch=1), [1])


def test_second_release_frees_nothing() -> None:
    drops: list[int] = []

    class Counting(HistoryEngine):
        def _drop(self, slot: int) -> None:
            drops.append(slot)
            super()._drop(slot)

    engine = _load(Counting())
    _prefill(engine, S1, [1, 2, 3])
    assert engine.release(ReleaseRequest(session=S1)).released
    again = engine.release(ReleaseRequest(session=S1))
    assert not again.released
    assert drops == [0]
    assert engine.health().kv_used_tokens == 0
    assert engine.metrics().releases == 1


def test_newer_epoch_on_a_live_session_sees_none_of_the_old_cache() -> None:
    engine = _engine()
    _prefill(engine, S1, [5, 6, 7, 8])
    newer = _prefill(engine, SessionRef(session_id="s1", epoch=2), [1, 2])
    fresh = _prefill(engine, SessionRef(session_id="other", epoch=1), [1, 2])
    assert newer.array().tolist() == fresh.array().tolist()
    with pytest.raises(StaleEpoch):
        _decode(engine, S1, 4, 1)


# --------------------------------------------------------------------- crash and metrics


def test_after_a_crash_every_operation_that_needs_the_engine_raises_engine_crashed() -> None:
    engine = _engine(fail_on_token=9)
    _prefill(engine, S1, [1])
    with pytest.raises(EngineCrashed):
        _prefill(engine, SessionRef(session_id="x", epoch=1), [9])
    calls: dict[str, Callable[[], object]] = {
        "prefill": lambda: _prefill(engine, S1, [1], start=1),
        "decode": lambda: _decode(engine, S1, 1, 1),
        "decode_batch": lambda: _batch(engine, (S1, 1)),
        "release": lambda: engine.release(ReleaseRequest(session=S1)),
        "cancel": lambda: engine.cancel(CancelRequest(session_id="s1")),
        "capabilities": engine.capabilities,
        "load": lambda: engine.load(
            LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=2))
        ),
    }
    for name, call in calls.items():
        with pytest.raises(EngineCrashed):
            call()
        assert engine.health().state == "failed", name
    assert engine.metrics().errors == {"engine_crashed": 7}  # load is not counted
    engine.close()
    assert engine.health().state == "closed"


def test_errors_count_exactly_what_callers_saw() -> None:
    engine = _engine()
    _prefill(engine, S1, [1, 2])
    engine.release(ReleaseRequest(session=S1))
    with pytest.raises(StaleEpoch):
        engine.release(ReleaseRequest(session=SessionRef(session_id="s1", epoch=0)))
    assert engine.metrics().errors == {"stale_epoch": 1}


def test_errors_of_a_cancelled_batch_are_not_counted() -> None:
    engine = _load(Refusing())
    _prefill(engine, A, [1])
    engine.started.clear()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            engine.decode_batch(
                DecodeBatchRequest(
                    request_id="doomed",
                    items=(
                        DecodeRequest(
                            request_id="ok",
                            session=A,
                            pos=1,
                            inputs=TokenInput(token_ids=(12,)),
                        ),
                        DecodeRequest(
                            request_id="miss",
                            session=B,
                            pos=5,
                            inputs=TokenInput(token_ids=(1,)),
                        ),
                    ),
                )
            )
        except Cancelled as error:
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    assert engine.started.wait(5)
    assert engine.cancel(CancelRequest(request_id="doomed")).cancelled
    thread.join()
    assert len(errors) == 1
    assert engine.metrics().errors == {"cancelled": 1}


# --------------------------------------------------------------------- lifecycle


def test_never_loaded_is_distinct_from_loading() -> None:
    opened = threading.Event()
    proceed = threading.Event()

    class SlowOpen(HistoryEngine):
        def _open(self, config: LoadConfig) -> ModelInfo:
            opened.set()
            assert proceed.wait(5)
            return super()._open(config)

    engine = SlowOpen()
    with pytest.raises(NotReady, match="not loaded") as unloaded:
        engine.capabilities()
    assert not unloaded.value.retryable
    assert engine.health().state == "unloaded"
    loader = threading.Thread(
        target=lambda: engine.load(
            LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=2))
        )
    )
    loader.start()
    assert opened.wait(5)
    assert engine.health().state == "loading"
    with pytest.raises(NotReady) as loading:
        engine.capabilities()
    assert loading.value.retryable
    proceed.set()
    loader.join()
    assert engine.health().state == "ready"


def test_with_closes_the_engine() -> None:
    with _engine() as engine:
        _prefill(engine, S1, [1])
    assert engine.health().state == "closed"
    with pytest.raises(NotReady):
        engine.capabilities()


def test_max_sessions_allocates_nothing_up_front() -> None:
    engine = _engine(max_sessions=1 << 20)
    _prefill(engine, S1, [1])
    assert engine._ledger._next_slot == 1
    assert engine._ledger._free_slots == []
