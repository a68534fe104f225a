"""A forward that computes NaN or infinities (weights or an input that overflow a model's
arithmetic) is that request's MalformedOutput and commits nothing: the NaN is in the backend's
cache too, so a committed step would poison every later step of the session."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from test_core import HistoryEngine, _decode, _prefill

from shard_engine_api import (
    BoundaryResult,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    ErrorInfo,
    LoadConfig,
    LogitsResult,
    MalformedOutput,
    PrefillRequest,
    SessionRef,
    ShardSpec,
    TokenInput,
)
from shard_engine_api.engine import CancelToken, ForwardItem, OutputMode

POISON = 13
"""The token whose forward turns every value it computes, cached ones included, into NaN."""


class PoisonEngine(HistoryEngine):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value
        self.rollbacks: list[int] = []

    def _forward(
        self, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        rows = super()._forward(item, output, token)
        if item.tokens is not None and POISON in item.tokens:
            for cached in self.cache[item.slot][item.start_pos :]:
                cached[:] = self.value
            rows = rows.copy()
            rows[-1, 0] = self.value
        return rows

    def _rollback(self, slot: int, start_pos: int, committed_length: int) -> None:
        self.rollbacks.append(slot)
        super()._rollback(slot, start_pos, committed_length)


def _poison_engine(value: float, end: int = 2, max_sessions: int = 4) -> PoisonEngine:
    engine = PoisonEngine(value)
    engine.load(
        LoadConfig(
            shard=ShardSpec(model="m", n_layers=2, start=0, end=end), max_sessions=max_sessions
        )
    )
    return engine


def _length(engine: PoisonEngine, session_id: str) -> int | None:
    entry = engine._ledger.sessions.get(session_id)
    return None if entry is None else entry.length


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("end", [2, 1], ids=["logits", "hidden"])
def test_a_non_finite_decode_commits_nothing(value: float, end: int) -> None:
    engine, clean = _poison_engine(value, end), _poison_engine(value, end)
    session = SessionRef(session_id="s", epoch=1)
    for target in (engine, clean):
        target.prefill(
            PrefillRequest(
                request_id="p", session=session, start_pos=0, inputs=TokenInput(token_ids=(1, 2))
            )
        )
    request = DecodeRequest(
        request_id="d", session=session, pos=2, inputs=TokenInput(token_ids=(POISON,))
    )
    with pytest.raises(MalformedOutput, match="NaN or infinite values; nothing was committed"):
        engine.decode(request)
    assert _length(engine, "s") == 2
    assert engine.rollbacks
    assert engine.metrics().errors == {"malformed_output": 1}
    assert engine.metrics().decode_tokens == 0
    # The session goes on as if the poisoned step never ran: its cache was rolled back.
    for pos, token in ((2, 3), (3, 4)):
        step = DecodeRequest(
            request_id=f"d{pos}", session=session, pos=pos, inputs=TokenInput(token_ids=(token,))
        )
        assert _payload(engine.decode(step)) == _payload(clean.decode(step))


def _payload(result: object) -> bytes:
    if isinstance(result, LogitsResult):
        return bytes(result.payload)
    assert isinstance(result, BoundaryResult)
    return bytes(result.bundle.payload)


def test_a_non_finite_prefill_commits_nothing() -> None:
    engine = _poison_engine(np.nan)
    session = SessionRef(session_id="s", epoch=1)
    with pytest.raises(MalformedOutput):
        _prefill(engine, session, [1, POISON, 2])
    assert _length(engine, "s") is None
    _prefill(engine, session, [1, 2])
    with pytest.raises(MalformedOutput):
        _prefill(engine, session, [POISON], start=1)  # a truncating prefill restores the rest
    assert _length(engine, "s") == 2
    assert isinstance(_decode(engine, session, 2, 5), LogitsResult)
    assert engine.health().state == "ready"


def _batch_after_prefill(
    engine: PoisonEngine, tokens: tuple[int, ...]
) -> tuple[list[SessionRef], DecodeBatchResult]:
    """One session per token, each prefilled with two tokens, then one batched decode step."""
    sessions = [SessionRef(session_id=f"s{i}", epoch=1) for i in range(len(tokens))]
    for session in sessions:
        _prefill(engine, session, [1, 2])
    reply = engine.decode_batch(
        DecodeBatchRequest(
            request_id="b",
            items=tuple(
                DecodeRequest(
                    request_id=f"b{i}", session=session, pos=2, inputs=TokenInput(token_ids=(t,))
                )
                for i, (session, t) in enumerate(zip(sessions, tokens, strict=True))
            ),
        )
    )
    return sessions, reply


def test_a_non_finite_batch_item_is_that_items_error_and_the_others_commit() -> None:
    engine = _poison_engine(np.nan)
    sessions, reply = _batch_after_prefill(engine, (5, POISON, 5))
    first, poisoned, last = reply.items
    assert isinstance(first, LogitsResult)
    assert isinstance(last, LogitsResult)
    assert isinstance(poisoned, ErrorInfo)
    assert poisoned.code == "malformed_output"
    assert [_length(engine, s.session_id) for s in sessions] == [3, 2, 3]
    assert engine.metrics().decode_tokens == 2
    assert engine.metrics().errors == {"malformed_output": 1}
    # The poisoned session's cache was rolled back: it decodes as a clean engine does.
    clean = _poison_engine(np.nan)
    _prefill(clean, sessions[1], [1, 2])
    assert bytes(_decode(engine, sessions[1], 2, 5).payload) == bytes(
        _decode(clean, sessions[1], 2, 5).payload
    )


def test_a_batch_of_only_non_finite_items_commits_nothing() -> None:
    engine = _poison_engine(np.nan)
    sessions, reply = _batch_after_prefill(engine, (POISON, POISON))
    assert all(isinstance(item, ErrorInfo) for item in reply.items)
    assert [_length(engine, s.session_id) for s in sessions] == [2, 2]
    assert engine.metrics().decode_tokens == 0
