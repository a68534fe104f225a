"""The standard tests of the advertised limits: max_context, max_batch_tokens, max_sessions
and the KV budget at and one past their bounds, ResourceExhausted under eviction "reject", and
LRU eviction by last use under eviction "lru". :class:`ShardEngineConformance` inherits them;
their names are pinned in :data:`LIMIT_TESTS`, part of the standard tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Final

from shard_engine_api._errors import CacheMiss, ErrorInfo, InvalidRequest, ResourceExhausted
from shard_engine_api._types import DecodeBatchRequest, DecodeRequest, SessionRef, TokenInput
from shard_engine_api.conformance._harness import (
    SuiteHelpers,
    _raises,
    assert_matches,
    logits_array,
)
from shard_engine_api.conformance._recorder import suite_skip

__all__ = ["LIMIT_TESTS", "LimitTests"]

LIMIT_TESTS: Final[tuple[str, ...]] = (
    "test_limit_kv_budget",
    "test_limit_max_batch_tokens",
    "test_limit_max_context",
    "test_limit_max_sessions",
    "test_lru_by_last_use_unequal_sizes",
    "test_lru_eviction",
    "test_resource_exhausted_kv_budget",
    "test_resource_exhausted_session_slots",
)
"""The tests of this module, sorted (part of STANDARD_TESTS)."""


class LimitTests(SuiteHelpers):
    """The standard tests of the advertised limits (module docstring)."""

    def test_resource_exhausted_kv_budget(self) -> None:
        """With eviction "reject", a prefill that would exceed the KV budget raises
        ResourceExhausted and leaves the sessions already admitted intact.

        Fix: count cached positions of all sessions against kv_budget_tokens at admission."""
        h = self.harness
        engine = h.load(kv_budget_tokens=10, eviction="reject")
        caps = engine.capabilities()
        if caps.limits.kv_budget_tokens != 10:
            suite_skip(f"engine lowered the KV budget to {caps.limits.kv_budget_tokens}")
        first = h.session("a")
        h.prefill(engine, first, 0, h.tokens(7, seed=1))
        _raises(
            ResourceExhausted,
            lambda: h.prefill(engine, h.session("b"), 0, h.tokens(7, seed=2)),
            "second session",
        )
        _raises(
            ResourceExhausted,
            lambda: h.prefill(engine, first, 7, h.tokens(4, seed=3)),
            "growing the first session past the budget",
        )
        assert engine.health().kv_used_tokens == 7
        h.decode(engine, first, 7, (1,))

    def test_resource_exhausted_session_slots(self) -> None:
        """With eviction "reject", a new session beyond max_sessions raises ResourceExhausted;
        releasing one frees its slot.

        Fix: admit a new session only while a slot is free."""
        h = self.harness
        engine = h.load(max_sessions=1, eviction="reject")
        first = h.session("a")
        h.prefill(engine, first, 0, h.tokens(3, seed=1))
        second = h.session("b")
        _raises(
            ResourceExhausted,
            lambda: h.prefill(engine, second, 0, h.tokens(3, seed=2)),
            "a second session with one slot",
        )
        h.decode(engine, first, 3, (1,))
        h.release(engine, first)
        h.prefill(engine, second, 0, h.tokens(3, seed=2))

    def test_lru_eviction(self) -> None:
        """With eviction "lru", admitting past the KV budget evicts the least recently used
        idle session; its next decode raises CacheMiss with reason "evicted", and the
        evicted epoch can restart with a prefill at 0. Others are untouched. A decode_batch
        never evicts a session it names, even one used less recently than an idle session.

        Fix: evict by last use, remember the evicted epoch, report reason "evicted"; when
        admitting a batch, exclude every session the batch names from the candidates."""
        h = self.harness
        engine = h.load(kv_budget_tokens=12, eviction="lru")
        caps = engine.capabilities()
        if not caps.features.eviction:
            suite_skip("engine does not support eviction (features.eviction is False)")
        exact, tolerance = self._shape_exactness(caps)
        oldest, recent, newcomer = h.session("oldest"), h.session("recent"), h.session("new")
        h.prefill(engine, oldest, 0, h.tokens(5, seed=1))
        h.prefill(engine, recent, 0, h.tokens(5, seed=2))
        h.prefill(engine, newcomer, 0, h.tokens(5, seed=3))
        miss = _raises(CacheMiss, lambda: h.decode(engine, oldest, 5, (1,)), "decode evicted")
        reason = miss.reason if isinstance(miss, CacheMiss) else None
        assert reason == "evicted", f"CacheMiss reason must be 'evicted', got {reason!r}"
        assert engine.metrics().evictions >= 1
        h.decode(engine, recent, 5, (1,))
        h.decode(engine, newcomer, 5, (1,))
        h.release(engine, recent)
        got = logits_array(h.prefill(engine, oldest, 0, h.tokens(5, seed=1)))
        fresh = h.load()
        want = logits_array(h.prefill(fresh, oldest, 0, h.tokens(5, seed=1)))
        assert_matches(
            got, want, exact=exact, tolerance=tolerance, what="re-prefill of an evicted session"
        )
        if caps.features.batched_decode:
            self._check_batch_spares_its_members()

    def _check_batch_spares_its_members(self) -> None:
        """A full budget, three sessions (the batch's second member used least recently):
        admitting the batch's first item must evict the idle third session, never the
        batch's own later member."""
        h = self.harness
        engine = h.load(kv_budget_tokens=12, eviction="lru")
        later, first, idle = h.session("later"), h.session("first"), h.session("idle")
        for seed, session in enumerate((later, first, idle)):
            h.prefill(engine, session, 0, h.tokens(4, seed=seed))
        items = tuple(
            DecodeRequest(
                request_id=h.request_id(), session=session, pos=4, inputs=TokenInput(token_ids=(1,))
            )
            for session in (first, later)
        )
        outcomes = engine.decode_batch(DecodeBatchRequest(request_id=h.request_id(), items=items))
        for name, outcome in zip(("first", "later"), outcomes.items, strict=True):
            assert not isinstance(outcome, ErrorInfo), (
                f"batch item of {name!r} failed ({outcome}): admitting a batch may evict only "
                "idle sessions, never one the batch names"
            )
            h.observe(outcome)
        miss = _raises(CacheMiss, lambda: h.decode(engine, idle, 4, (1,)), "decode of the idle")
        assert isinstance(miss, CacheMiss)
        assert miss.reason == "evicted", f"the idle session must be the one evicted: {miss}"

    def test_limit_max_context(self) -> None:
        """max_context holds at and one past the bound: a prefill to exactly max_context
        positions and decodes up to it succeed; one position more (prefill or decode) is
        ResourceExhausted and changes nothing.

        Fix: refuse positions >= max_context at admission (prefill start + n, decode pos)."""
        h = self.harness
        engine = h.load(max_context=12, max_batch_tokens=16, kv_budget_tokens=64)
        limit = engine.capabilities().limits.max_context
        full, short = h.session("full"), h.session("short")
        h.prefill(engine, full, 0, h.tokens(limit, seed=1))
        _raises(
            ResourceExhausted, lambda: h.decode(engine, full, limit, (1,)), "decode at max_context"
        )
        _raises(
            ResourceExhausted,
            lambda: h.prefill(engine, short, 0, h.tokens(limit + 1, seed=2)),
            "a prefill one past max_context",
        )
        h.prefill(engine, short, 0, h.tokens(limit - 1, seed=2))
        h.decode(engine, short, limit - 1, (1,))
        _raises(
            ResourceExhausted,
            lambda: h.prefill(engine, short, limit, (1,)),
            "append past max_context",
        )
        health = engine.health()
        assert (health.sessions, health.kv_used_tokens) == (2, 2 * limit), health

    def test_limit_max_batch_tokens(self) -> None:
        """max_batch_tokens holds at and one past the bound: a prefill of exactly that many
        rows and a batch of that many items succeed; one more is refused (InvalidRequest or
        ResourceExhausted) and changes nothing.

        Fix: compare the rows of a prefill and the items of a batch with max_batch_tokens
        before admission."""
        h = self.harness
        # 16: engines may need a micro-batch of that size (llama's n_ubatch) to load at all;
        # no more sessions than rows per batch (some backends size their outputs by it).
        engine = h.load(max_batch_tokens=16, max_sessions=16, max_context=64, kv_budget_tokens=512)
        limit = engine.capabilities().limits.max_batch_tokens
        session = h.session("rows")
        h.prefill(engine, session, 0, h.tokens(limit, seed=1))
        refused = (InvalidRequest, ResourceExhausted)
        try:
            h.prefill(engine, h.session("too-many"), 0, h.tokens(limit + 1, seed=2))
        except refused:
            pass
        else:
            raise AssertionError(f"a prefill of {limit + 1} rows passed max_batch_tokens {limit}")
        assert engine.health().sessions == 1, "a refused prefill created a session"
        if not engine.capabilities().features.batched_decode:
            return
        h.release(engine, session)
        count = min(limit, engine.capabilities().limits.max_sessions)
        sessions = [h.session(f"b{index}") for index in range(count)]
        for index, item_session in enumerate(sessions):
            h.prefill(engine, item_session, 0, h.tokens(1, seed=index))
        outcomes = self._batch(engine, [self._item(s, 1, (1,)) for s in sessions]).items
        assert not any(isinstance(o, ErrorInfo) for o in outcomes), (
            f"a batch of {count} items (max_batch_tokens {limit}) failed: {outcomes}"
        )
        # One item past the bound; the extra items name sessions that need no slot.
        extra = [h.session(f"ghost{index}") for index in range(limit + 1 - count)]
        try:
            result = self._batch(
                engine,
                [self._item(s, 2, (1,)) for s in sessions]
                + [self._item(s, 0, (1,)) for s in extra],
            )
        except refused:
            result = None
        if result is not None:
            raise AssertionError(
                f"a batch of {limit + 1} items passed max_batch_tokens {limit}: {result.items}"
            )
        assert [self._committed_length(engine, s) for s in sessions] == [2] * count

    def test_limit_max_sessions(self) -> None:
        """max_sessions holds at and one past the bound (eviction "reject"): exactly that
        many sessions are admitted, one more is ResourceExhausted and leaves nothing; after
        a release it is admitted.

        Fix: admit a new session only while a slot is free; free the slot on release."""
        h = self.harness
        engine = h.load(max_sessions=3, eviction="reject")
        limit = engine.capabilities().limits.max_sessions
        sessions = [h.session(f"s{index}") for index in range(limit + 1)]
        for session in sessions[:limit]:
            h.prefill(engine, session, 0, h.tokens(2, seed=1))
        _raises(
            ResourceExhausted,
            lambda: h.prefill(engine, sessions[-1], 0, h.tokens(2, seed=2)),
            f"session {limit + 1} of max_sessions {limit}",
        )
        assert engine.health().sessions == limit
        assert engine.health().kv_used_tokens == 2 * limit
        h.release(engine, sessions[0])
        h.prefill(engine, sessions[-1], 0, h.tokens(2, seed=2))

    def test_limit_kv_budget(self) -> None:
        """The KV budget holds at and one past the bound (eviction "reject"): sessions may
        fill it exactly; one more position (a decode, an append, a new session) is
        ResourceExhausted and changes nothing; a truncating prefill that shrinks a session
        fits again.

        Fix: count every cached position of every session against kv_budget_tokens,
        including the positions a truncation frees."""
        h = self.harness
        engine = h.load(kv_budget_tokens=10, eviction="reject")
        if engine.capabilities().limits.kv_budget_tokens != 10:
            suite_skip("engine lowered the KV budget")
        a, b = h.session("a"), h.session("b")
        h.prefill(engine, a, 0, h.tokens(6, seed=1))
        h.prefill(engine, b, 0, h.tokens(4, seed=2))
        for what, call in (
            ("decode one past the budget", lambda: h.decode(engine, a, 6, (1,))),
            ("append one past the budget", lambda: h.prefill(engine, b, 4, (1,))),
            ("a new session past the budget", lambda: h.prefill(engine, h.session("c"), 0, (1,))),
        ):
            _raises(ResourceExhausted, call, what)
            assert engine.health().kv_used_tokens == 10, f"{what} changed the KV positions"
        h.prefill(engine, a, 3, h.tokens(2, seed=3))
        assert engine.health().kv_used_tokens == 9
        h.decode(engine, a, 5, (1,))
        assert engine.health().kv_used_tokens == 10

    def test_lru_by_last_use_unequal_sizes(self) -> None:
        """LRU eviction orders by last use, not by creation or size, and evicts only as many
        sessions as needed: with a KV budget of 20 and sessions of 8 (touched last), 4 and
        4 positions, a newcomer of 5 evicts the untouched 4; a later newcomer of 4 evicts the
        next least recently used; one of 6 evicts the two least recently used (4 and 10
        positions), not just the largest. Evicted sessions miss with reason "evicted".

        Fix: update last use on every successful prefill/decode and evict in that order,
        stopping as soon as the request fits."""
        h = self.harness
        engine = h.load(kv_budget_tokens=20, max_sessions=8, eviction="lru")
        if not engine.capabilities().features.eviction:
            suite_skip("engine does not support eviction")
        big, small, middle = h.session("big"), h.session("small"), h.session("middle")
        h.prefill(engine, big, 0, h.tokens(8, seed=1))
        h.prefill(engine, small, 0, h.tokens(4, seed=2))
        h.prefill(engine, middle, 0, h.tokens(4, seed=3))
        h.decode(engine, big, 8, (1,))

        def check(step: str, evicted: Sequence[SessionRef], alive: dict[str, int]) -> None:
            for session in evicted:
                miss = _raises(
                    CacheMiss,
                    partial(h.decode, engine, session, 0, (2,)),
                    f"{step}: decode of {session.session_id}, which should be evicted",
                )
                assert isinstance(miss, CacheMiss)
                assert miss.reason == "evicted", (
                    f"{step}: {session.session_id} must miss with reason 'evicted', got "
                    f"{getattr(miss, 'reason', None)!r}"
                )
            live = {name: self._committed_length(engine, h.session(name)) for name in alive}
            assert live == alive, f"{step}: committed lengths {live}, expected {alive}"

        h.prefill(engine, h.session("newcomer"), 0, h.tokens(5, seed=4))
        check("a newcomer of 5", [small], {"big": 9, "middle": 4, "newcomer": 5})
        assert engine.metrics().evictions == 1, "evict only as many sessions as needed"
        h.prefill(engine, h.session("late"), 0, h.tokens(4, seed=5))
        check("a newcomer of 4", [middle], {"big": 9, "newcomer": 5, "late": 4})
        h.decode(engine, big, 9, (2,))
        h.decode(engine, h.session("newcomer"), 5, (2,))
        h.prefill(engine, h.session("huge"), 0, h.tokens(6, seed=6))
        check("a newcomer of 6", [h.session("late"), big], {"newcomer": 6, "huge": 6})
        assert engine.metrics().evictions == 4
        assert engine.health().kv_used_tokens == 12
