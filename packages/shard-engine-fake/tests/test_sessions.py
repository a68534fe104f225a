"""Session semantics through the core: CacheMiss, StaleEpoch, release, rollback, cancellation."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import EngineFactory, decode, logits_of, prefill, session

import shard_engine_api as api
from shard_engine_fake import Delay, FaultPlan, FaultRule


def test_decode_at_wrong_position_is_a_cache_miss_with_committed_length(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    prefill(engine, session(), 0, [1, 2, 3])
    with pytest.raises(api.CacheMiss) as caught:
        decode(engine, session(), 5, 4)
    assert (caught.value.committed_length, caught.value.reason) == (3, "position_mismatch")
    with pytest.raises(api.CacheMiss) as unknown:
        decode(engine, session("nobody"), 0, 4)
    assert unknown.value.reason == "unknown_session"
    with pytest.raises(api.CacheMiss) as gap:
        prefill(engine, session(), 4, [1])
    assert (gap.value.committed_length, gap.value.reason) == (3, "gap")


def test_epochs_fence_old_requests(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prefill(engine, session(epoch=1), 0, [1, 2, 3])
    fresh = logits_of(prefill(engine, session(epoch=2), 0, [7, 8]))
    assert engine.health().kv_used_tokens == 2
    with pytest.raises(api.StaleEpoch):
        decode(engine, session(epoch=1), 3, 4)
    with pytest.raises(api.StaleEpoch):
        prefill(engine, session(epoch=1), 0, [1])
    other = logits_of(prefill(engine, session("b", epoch=5), 0, [7, 8]))
    assert fresh.array().tobytes() == other.array().tobytes()


def test_release_leaves_a_tombstone(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prefill(engine, session(epoch=3), 0, [1, 2])
    released = engine.release(api.ReleaseRequest(session=session(epoch=3)))
    assert released.released
    assert engine.health().sessions == 0
    with pytest.raises(api.StaleEpoch):
        decode(engine, session(epoch=3), 2, 1)
    with pytest.raises(api.StaleEpoch):
        prefill(engine, session(epoch=2), 0, [1])
    again = engine.release(api.ReleaseRequest(session=session("never", epoch=1)))
    assert not again.released
    assert again.detail
    prefill(engine, session(epoch=4), 0, [1])
    assert engine.metrics().releases == 1


def test_failed_request_leaves_the_session_unchanged(make_engine: EngineFactory) -> None:
    engine = make_engine(max_context=8)
    ref = session()
    prefill(engine, ref, 0, [1, 2, 3, 4])
    with pytest.raises(api.ResourceExhausted):
        prefill(engine, ref, 2, [5] * 7)
    assert engine.health().kv_used_tokens == 4
    expected = logits_of(prefill(make_engine(), ref, 0, [1, 2, 3, 4, 9])).array().tobytes()
    assert logits_of(decode(engine, ref, 4, 9)).array().tobytes() == expected


def test_session_slots_are_reused_without_leaking_state(make_engine: EngineFactory) -> None:
    engine = make_engine(max_sessions=1)
    first = logits_of(prefill(engine, session("a"), 0, [1, 2])).array().tobytes()
    with pytest.raises(api.ResourceExhausted):
        prefill(engine, session("b"), 0, [1, 2])
    engine.release(api.ReleaseRequest(session=session("a")))
    assert logits_of(prefill(engine, session("b"), 0, [1, 2])).array().tobytes() == first


def test_cancel_during_injected_delay_rolls_back(make_engine: EngineFactory) -> None:
    """A cancel from another thread ends the delay at once with Cancelled, and the session is
    left exactly as before the request (the forward's cache writes are undone)."""
    plan = FaultPlan(
        rules=(FaultRule(action=Delay(milliseconds=10_000), operations=("prefill",), nth=2),)
    )
    engine = make_engine(options={"faults": plan})
    reference = make_engine()
    ref = session()
    prefill(engine, ref, 0, [1, 2, 3, 4, 5], request_id="first")
    prefill(reference, ref, 0, [1, 2, 3, 4, 5], request_id="first")
    outcome: list[BaseException] = []

    def truncating_prefill() -> None:
        try:
            prefill(engine, ref, 2, [9, 9, 9, 9, 9, 9], request_id="slow")
        except api.ShardEngineError as error:
            outcome.append(error)

    worker = threading.Thread(target=truncating_prefill)
    started = time.monotonic()
    worker.start()
    while engine.health().in_flight == 0:
        time.sleep(0.001)
    time.sleep(0.02)
    assert engine.cancel(api.CancelRequest(request_id="slow")).cancelled
    worker.join(timeout=5)
    assert time.monotonic() - started < 2.0
    assert len(outcome) == 1
    assert isinstance(outcome[0], api.Cancelled)
    assert engine.health().kv_used_tokens == 5
    assert engine.metrics().cancelled == 1
    assert not engine.cancel(api.CancelRequest(request_id="slow")).cancelled
    got = logits_of(decode(engine, ref, 5, 7)).array().tobytes()
    assert got == logits_of(decode(reference, ref, 5, 7)).array().tobytes()


def test_cancel_by_session_during_batched_decode(make_engine: EngineFactory) -> None:
    plan = FaultPlan(
        rules=(FaultRule(action=Delay(milliseconds=10_000), operations=("decode_batch",)),)
    )
    engine = make_engine(options={"faults": plan})
    for name in "ab":
        prefill(engine, session(name), 0, [1, 2])
    errors: list[BaseException] = []

    def batch() -> None:
        request = api.DecodeBatchRequest(
            request_id="batch",
            items=tuple(
                api.DecodeRequest(
                    request_id=f"i{name}",
                    session=session(name),
                    pos=2,
                    inputs=api.TokenInput(token_ids=(3,)),
                )
                for name in "ab"
            ),
        )
        try:
            engine.decode_batch(request)
        except api.Cancelled as error:
            errors.append(error)

    worker = threading.Thread(target=batch)
    worker.start()
    while engine.health().in_flight == 0:
        time.sleep(0.001)
    assert engine.cancel(api.CancelRequest(session_id="b")).n_requests == 1
    worker.join(timeout=5)
    assert len(errors) == 1
    assert engine.health().kv_used_tokens == 4


def test_reserved_hooks_are_refused(make_engine: EngineFactory) -> None:
    engine = make_engine()
    with pytest.raises(api.UnsupportedFeature):
        engine.prefill(
            api.PrefillRequest(
                request_id="r",
                session=session(),
                start_pos=0,
                inputs=api.TokenInput(token_ids=(1,)),
                mtp=(api.MtpState(n_draft_tokens=1),),
            )
        )


def test_wrong_role_inputs(make_engine: EngineFactory) -> None:
    head, tail = make_engine(0, 3), make_engine(3, 6)
    with pytest.raises(api.WrongRole):
        prefill(tail, session(), 0, [1])
    bundle = head.prefill(
        api.PrefillRequest(
            request_id="r", session=session(), start_pos=0, inputs=api.TokenInput(token_ids=(1,))
        )
    )
    assert isinstance(bundle, api.BoundaryResult)
    with pytest.raises(api.WrongRole):
        prefill(head, session(), 1, bundle.bundle)


def test_close_then_calls_are_not_ready(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prefill(engine, session(), 0, [1])
    engine.close()
    engine.close()
    assert engine.health().state == "closed"
    with pytest.raises(api.NotReady):
        decode(engine, session(), 1, 1)
