"""The standard tests of ``decode_batch``: per item what a single decode gives (also for large
shuffled batches), errors that fail alone in their place and carry a single decode's fields,
one session named twice, reserved fields, metrics, the KV budget reached through a batch and
LRU order refreshed by one. :class:`ShardEngineConformance` inherits them; their names are
pinned in :data:`BATCHING_TESTS`, part of the standard tests.
"""

from __future__ import annotations

import random
from functools import partial
from typing import Final

from shard_engine_api import _codec
from shard_engine_api._errors import CacheMiss, ErrorInfo, ShardEngineError, error_from_info
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    AuxState,
    BoundaryResult,
    DecodeBatchRequest,
    DecodeRequest,
    LogitsResult,
    MtpState,
    TokenInput,
)
from shard_engine_api.conformance._harness import (
    SuiteHelpers,
    _assert_addressed_to,
    _raises,
    _rows,
    assert_matches,
    bundle_of,
    logits_array,
    replace_bundle,
    split_ranges,
)
from shard_engine_api.conformance._recorder import suite_skip

__all__ = ["BATCHING_TESTS", "BatchingTests"]

BATCHING_TESTS: Final[tuple[str, ...]] = (
    "test_batch_at_the_kv_budget",
    "test_batch_error_items_carry_their_fields",
    "test_batch_use_refreshes_lru_order",
    "test_batched_decode_item_errors",
    "test_batched_decode_matches_single",
    "test_batched_decode_metrics",
    "test_batched_decode_order_with_interleaved_errors",
    "test_batched_decode_reserved_fields",
    "test_batched_decode_same_session_twice",
    "test_large_shuffled_batches_match_single_decodes",
)
"""The tests of this module, sorted (part of STANDARD_TESTS)."""

_BATCH: Final = 12
"""Items of the large batch test: past 8 (an 8-wide batch, a byte of item flags)."""


class BatchingTests(SuiteHelpers):
    """The standard tests of ``decode_batch`` (module docstring)."""

    def test_batched_decode_matches_single(self) -> None:
        """``decode_batch`` over several sessions (at different epochs) gives, per item and
        in item order, what a single decode gives (exact when the engine declares
        batch_invariant and split_exact, else within tolerance), addressed to the item's own
        request id, session and epoch.

        Fix: keep rows in item order; make batching not change numerics, or declare
        batch_invariant = False and a tolerance; build each item's result from its own
        request."""
        h = self.harness
        batched = h.load()
        caps = batched.capabilities()
        self._need_batches(batched)
        exact, tolerance = self._batch_exactness(caps)
        single = h.load()
        lengths = (3, 7, 5)
        sessions = [h.session(f"s{i}", epoch=i + 1) for i in range(len(lengths))]
        for index, (session, length) in enumerate(zip(sessions, lengths, strict=True)):
            for engine in (batched, single):
                h.prefill(engine, session, 0, h.tokens(length, seed=index))
        for step in range(2):
            items = tuple(
                DecodeRequest(
                    request_id=h.request_id(),
                    session=session,
                    pos=length + step,
                    inputs=TokenInput(token_ids=(index + step,)),
                )
                for index, (session, length) in enumerate(zip(sessions, lengths, strict=True))
            )
            result = batched.decode_batch(
                DecodeBatchRequest(request_id=h.request_id(), items=items)
            )
            assert len(result.items) == len(items), "one outcome per item"
            for item, outcome in zip(items, result.items, strict=True):
                if isinstance(outcome, ErrorInfo):
                    raise AssertionError(f"batch item {item.session.session_id} failed: {outcome}")
                h.observe(outcome)
                assert outcome.session == item.session, "batch outcomes must be in item order"
                assert outcome.request_id == item.request_id
                _assert_addressed_to(outcome, item.session, f"batch item {item.request_id}")
                want = logits_array(h.decode(single, item.session, item.pos, item.inputs))
                assert_matches(
                    logits_array(outcome),
                    want,
                    exact=exact,
                    tolerance=tolerance,
                    what=f"batched vs single decode of {item.session.session_id} at {item.pos}",
                )

    def test_batched_decode_item_errors(self) -> None:
        """A bad item of a batch fails alone, as an ErrorInfo in its place (CacheMiss with
        the committed length for a wrong position or unknown session, InvalidRequest for a bad
        token); the good items succeed and only they advance.

        Fix: plan and validate each item separately; never fail or advance the others."""
        h = self.harness
        engine = h.load()
        caps = engine.capabilities()
        self._need_batches(engine)
        good, wrong_pos, bad_token = h.session("good"), h.session("wrong"), h.session("bad")
        for session in (good, wrong_pos, bad_token):
            h.prefill(engine, session, 0, h.tokens(4, seed=1))
        items = (
            DecodeRequest(
                request_id=h.request_id(), session=good, pos=4, inputs=TokenInput(token_ids=(1,))
            ),
            DecodeRequest(
                request_id=h.request_id(),
                session=wrong_pos,
                pos=6,
                inputs=TokenInput(token_ids=(1,)),
            ),
            DecodeRequest(
                request_id=h.request_id(),
                session=h.session("unknown"),
                pos=0,
                inputs=TokenInput(token_ids=(1,)),
            ),
            DecodeRequest(
                request_id=h.request_id(),
                session=bad_token,
                pos=4,
                inputs=TokenInput(token_ids=(caps.vocab_size,)),
            ),
        )
        result = engine.decode_batch(DecodeBatchRequest(request_id=h.request_id(), items=items))
        assert len(result.items) == len(items), "one outcome per item, in item order"
        first, second, third, fourth = result.items
        assert isinstance(first, LogitsResult | BoundaryResult), f"good item failed: {first}"
        h.observe(first)
        for outcome, code, committed in (
            (second, "cache_miss", 4),
            (third, "cache_miss", 0),
            (fourth, "invalid_request", None),
        ):
            assert isinstance(outcome, ErrorInfo), f"expected an ErrorInfo, got {outcome!r}"
            assert outcome.code == code, f"expected code {code!r}, got {outcome.code!r}"
            if committed is not None:
                assert outcome.details.get("committed_length") == committed, outcome.details
        h.decode(engine, good, 5, (1,))
        h.decode(engine, wrong_pos, 4, (1,))
        h.decode(engine, bad_token, 4, (1,))

    def test_batched_decode_order_with_interleaved_errors(self) -> None:
        """Batch outcomes are in item order whatever the mix: errors first, last and between
        successes (wrong position, bad token, unknown session), each success carrying its
        own item's request id and session and equal to a single decode of it.

        Fix: fill the result list by item index; never collect successes and errors
        separately."""
        h = self.harness
        engine = h.load()
        self._need_batches(engine)
        caps = engine.capabilities()
        exact, tolerance = self._batch_exactness(caps)
        single = h.load()
        sessions = [h.session(f"s{index}") for index in range(5)]
        for number, session in enumerate(sessions):
            for target in (engine, single):
                h.prefill(target, session, 0, h.tokens(4, seed=number))
        vocab = caps.vocab_size
        orders: list[list[tuple[str, int | None]]] = [
            [("miss", 0), ("ok", 1), ("bad", 2), ("ok", 3), ("unknown", None), ("ok", 4)],
            [("ok", 0), ("unknown", None), ("ok", 1), ("miss", 2), ("ok", 3), ("bad", 4)],
        ]
        lengths = [4] * len(sessions)
        for order in orders:
            items: list[DecodeRequest] = []
            for kind, index in order:
                if kind == "unknown":
                    items.append(self._item(h.session(f"ghost-{h.request_id()}"), 0, (1,)))
                    continue
                assert index is not None
                session, length = sessions[index], lengths[index]
                if kind == "ok":
                    items.append(self._item(session, length, (index,)))
                elif kind == "miss":
                    items.append(self._item(session, length + 2, (index,)))
                else:
                    items.append(self._item(session, length, (vocab,)))
            result = self._batch(engine, items)
            assert len(result.items) == len(items), "one outcome per item"
            for position, ((kind, index), item, outcome) in enumerate(
                zip(order, items, result.items, strict=True)
            ):
                where = f"item {position} ({kind}) of order {[k for k, _ in order]}"
                if kind != "ok":
                    assert isinstance(outcome, ErrorInfo), (
                        f"{where}: expected an error, got {outcome!r}"
                    )
                    code = "invalid_request" if kind == "bad" else "cache_miss"
                    assert outcome.code == code, f"{where}: code {outcome.code!r} != {code!r}"
                    if kind == "miss":
                        assert index is not None
                        assert outcome.details.get("committed_length") == lengths[index], (
                            f"{where}: {outcome.details}"
                        )
                    continue
                assert isinstance(outcome, LogitsResult | BoundaryResult), (
                    f"{where}: expected a result, got {outcome!r}"
                )
                h.observe(outcome)
                assert (outcome.request_id, outcome.session) == (item.request_id, item.session), (
                    f"{where}: the outcome belongs to {outcome.session.session_id!r} / "
                    f"{outcome.request_id!r}"
                )
                want = _rows(h.decode(single, item.session, item.pos, item.inputs))
                assert_matches(
                    _rows(outcome),
                    want,
                    exact=exact,
                    tolerance=tolerance,
                    what=f"{where} vs a single decode",
                )
                assert index is not None
                lengths[index] += 1
        for session, length in zip(sessions, lengths, strict=True):
            assert self._committed_length(engine, session) == length

    def test_batched_decode_same_session_twice(self) -> None:
        """A batch naming one session twice never decodes it twice: the batch result is
        returned (not raised), the first item naming the session is served as a single decode
        would be, every later item naming it fails alone with invalid_request (at the same
        position or the next), the other sessions are served, the session grows by exactly
        one position and its next decode equals a clean run.

        Fix: while planning the batch, refuse every item after the first that names an
        already named session (InvalidRequest in its place), and serve the rest."""
        h = self.harness
        engine = h.load()
        self._need_batches(engine)
        exact, tolerance = self._shape_exactness(engine.capabilities())
        clean = h.load()
        for case, second_pos in (("same position", 4), ("next position", 5)):
            twice, other = h.session(f"twice-{second_pos}"), h.session(f"other-{second_pos}")
            for session in (twice, other):
                h.prefill(engine, session, 0, h.tokens(4, seed=1))
            items = [
                self._item(twice, 4, (1,)),
                self._item(other, 4, (2,)),
                self._item(twice, second_pos, (3,)),
                self._item(twice, second_pos, (3,)),
            ]
            try:
                result = self._batch(engine, items)
            except ShardEngineError as error:
                raise AssertionError(
                    f"{case}: a batch naming a session twice raised {error!r}; only the later "
                    "items naming it may fail, in their place"
                ) from error
            first, middle, *later = result.items
            assert isinstance(first, LogitsResult | BoundaryResult), (
                f"{case}: the first item naming the session failed: {first!r}"
            )
            h.observe(first)
            assert isinstance(middle, LogitsResult | BoundaryResult), (
                f"{case}: the other session's item failed: {middle!r}"
            )
            h.observe(middle)
            for number, outcome in enumerate(later, start=2):
                if not (isinstance(outcome, ErrorInfo) and outcome.code == "invalid_request"):
                    raise AssertionError(
                        f"{case}: item {number} names the session again and must fail with "
                        f"invalid_request, got {outcome!r}"
                    )
            length = self._committed_length(engine, twice)
            assert length == 5, (
                f"{case}: the session named twice holds {length} positions; expected 5"
            )
            reference = h.session(f"clean-{second_pos}")
            h.prefill(clean, reference, 0, h.tokens(4, seed=1))
            h.decode(clean, reference, 4, (1,))
            assert_matches(
                _rows(h.decode(engine, twice, length, (5,))),
                _rows(h.decode(clean, reference, length, (5,))),
                exact=exact,
                tolerance=tolerance,
                what=f"{case}: decode after the batch vs a clean run",
            )

    def test_batched_decode_reserved_fields(self) -> None:
        """Batch items with non-empty reserved fields (mtp, aux) fail alone with
        unsupported_feature, in their place; the other items are served.

        Fix: check the reserved fields of every item (and of every item's bundle)."""
        h = self.harness
        engine = h.load()
        self._need_batches(engine)
        sessions = [h.session(f"r{index}") for index in range(3)]
        for session in sessions:
            h.prefill(engine, session, 0, h.tokens(3, seed=1))
        items = [
            self._item(sessions[0], 3, (1,), mtp=(MtpState(n_draft_tokens=1),)),
            self._item(sessions[1], 3, (1,)),
            self._item(sessions[2], 3, (1,), aux=(AuxState(name="recurrent"),)),
        ]
        first, middle, last = self._batch(engine, items).items
        for where, outcome in (("mtp item", first), ("aux item", last)):
            assert isinstance(outcome, ErrorInfo), f"{where}: expected an error, got {outcome!r}"
            assert outcome.code == "unsupported_feature", (
                f"{where}: expected unsupported_feature, got {outcome!r}"
            )
        assert isinstance(middle, LogitsResult | BoundaryResult), f"plain item: {middle!r}"
        assert [self._committed_length(engine, s) for s in sessions] == [3, 4, 3]
        if h.n_layers < 2:
            return
        (head_range, tail_range) = split_ranges(h.n_layers, 2)
        head, tail = h.load(*head_range), h.load(*tail_range)
        session = h.session("bundle-reserved")
        h.prefill(tail, session, 0, h.head_bundle(head, session, 0, h.tokens(3, seed=1)))
        row = bundle_of(h.decode(head, session, 3, (1,)))
        outcomes = self._batch(
            tail,
            [
                self._item(session, 3, replace_bundle(row, mtp=(MtpState(n_draft_tokens=1),))),
                self._item(session, 3, replace_bundle(row, aux=(AuxState(name="recurrent"),))),
            ],
        ).items
        assert all(
            isinstance(outcome, ErrorInfo)
            and outcome.code in ("unsupported_feature", "invalid_request")
            for outcome in outcomes
        ), f"bundles with reserved fields in a batch: {outcomes}"
        assert any(
            isinstance(outcome, ErrorInfo) and outcome.code == "unsupported_feature"
            for outcome in outcomes
        ), f"a bundle's reserved field must be refused as unsupported_feature: {outcomes}"
        assert self._committed_length(tail, session) == 3

    def test_batched_decode_metrics(self) -> None:
        """After a batch, metrics count one request and one batch request (no decode
        requests), decode tokens for the successful items only, the KV positions they added,
        and each item error exactly once in metrics.errors; health agrees.

        Fix: count a batch once, in requests and batch_requests; its tokens per successful
        item; every error item of a returned batch result in metrics.errors."""
        h = self.harness
        engine = h.load()
        self._need_batches(engine)
        a, b = h.session("a"), h.session("b")
        for session in (a, b):
            h.prefill(engine, session, 0, h.tokens(4, seed=1))
        before = engine.metrics()
        result = self._batch(
            engine,
            [
                self._item(a, 4, (1,)),
                self._item(h.session("ghost"), 0, (1,)),
                self._item(b, 4, (1,)),
            ],
        )
        assert [isinstance(o, ErrorInfo) for o in result.items] == [False, True, False]
        after = engine.metrics()
        observed = {
            "requests": after.requests - before.requests,
            "batch_requests": after.batch_requests - before.batch_requests,
            "decode_tokens": after.decode_tokens - before.decode_tokens,
            "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
            "prefill_requests": after.prefill_requests - before.prefill_requests,
            "kv_used_tokens": after.kv_used_tokens - before.kv_used_tokens,
            "sessions_active": after.sessions_active,
        }
        expected = {
            "requests": 1,
            "batch_requests": 1,
            "decode_tokens": 2,
            "prefill_tokens": 0,
            "prefill_requests": 0,
            "kv_used_tokens": 2,
            "sessions_active": 2,
        }
        assert observed == expected, f"metrics changes {observed} != {expected}"
        decode_requests = after.decode_requests - before.decode_requests
        assert decode_requests == 0, (
            f"decode_requests grew by {decode_requests}: a batch counts once, in batch_requests"
        )
        misses = after.errors.get("cache_miss", 0) - before.errors.get("cache_miss", 0)
        assert misses == 1, (
            f"one failed item counted {misses} times in metrics.errors (every error a caller "
            "receives counts once, batch items included)"
        )
        health = engine.health()
        assert (health.sessions, health.kv_used_tokens) == (2, 10)
        failing = self._batch(engine, [self._item(a, 9, (1,))])
        assert isinstance(failing.items[0], ErrorInfo)
        assert engine.metrics().decode_tokens == after.decode_tokens, (
            "a batch whose only item failed counted decode tokens"
        )

    def test_large_shuffled_batches_match_single_decodes(self) -> None:
        """Batches of 12 items in shuffled orders (a new order every step) over sessions of
        different lengths give, per item, what a single decode gives (exact when the engine
        declares batch_invariant, else within tolerance), addressed to the item; two of the
        sessions have different histories but get the same input at the same position.

        Fix: map every row of a batch back to its own item by index, whatever the order or
        the size; key any reuse of work by session, never by input and position."""
        h = self.harness
        batched = h.load(max_sessions=_BATCH + 2, max_batch_tokens=64)
        self._need_batches(batched)
        caps = batched.capabilities()
        if min(caps.limits.max_sessions, caps.limits.max_batch_tokens) < _BATCH:
            suite_skip(f"the engine's limits hold fewer than {_BATCH} sessions in a batch")
        exact, tolerance = self._batch_exactness(caps)
        single = h.load(max_sessions=_BATCH + 2, max_batch_tokens=64)
        sessions = [h.session(f"s{index}", epoch=1 + index % 3) for index in range(_BATCH)]
        lengths = [3 + index for index in range(_BATCH)]
        # The twins: different histories, the same length (so the same positions).
        lengths[1] = lengths[0]
        for index, (session, length) in enumerate(zip(sessions, lengths, strict=True)):
            for engine in (batched, single):
                h.prefill(engine, session, 0, h.tokens(length, seed=index))
        shuffle = random.Random(1234)
        for step in range(3):
            order = list(range(_BATCH))
            shuffle.shuffle(order)
            items = [
                self._item(
                    sessions[index],
                    lengths[index] + step,
                    (0,) if index in (0, 1) else ((index * 5 + step) % caps.vocab_size,),
                )
                for index in order
            ]
            outcomes = self._batch(batched, items).items
            assert len(outcomes) == len(items), "one outcome per item"
            for where, (item, outcome) in enumerate(zip(items, outcomes, strict=True)):
                if isinstance(outcome, ErrorInfo):
                    raise AssertionError(f"step {step} item {where} failed: {outcome}")
                h.observe(outcome)
                assert (outcome.request_id, outcome.session) == (item.request_id, item.session), (
                    f"step {step}: item {where} answered as {outcome.session} / "
                    f"{outcome.request_id}"
                )
                assert_matches(
                    _rows(outcome),
                    _rows(h.decode(single, item.session, item.pos, item.inputs)),
                    exact=exact,
                    tolerance=tolerance,
                    what=f"step {step}, item {where} of a shuffled batch of {_BATCH} "
                    f"({item.session.session_id}) vs a single decode",
                )

    def test_batch_at_the_kv_budget(self) -> None:
        """A batch at the KV budget's limit: with eviction "reject" its items are admitted in
        item order while they fit and the rest fail alone as retryable ResourceExhausted
        (nothing of theirs changes, the budget is full exactly); with eviction "lru" the
        batch evicts idle sessions, least recently used first, never one it names, and all
        its items are served.

        Fix: admit a batch item by item against the budget left after the items before it;
        evict only idle sessions, and refuse an item that does not fit as retryable."""
        h = self.harness
        engine = h.load(kv_budget_tokens=22, max_sessions=8, eviction="reject")
        self._need_batches(engine)
        if engine.capabilities().limits.kv_budget_tokens != 22:
            suite_skip("engine lowered the KV budget")
        members = [h.session(f"m{index}") for index in range(4)]
        for index, session in enumerate(members):
            h.prefill(engine, session, 0, h.tokens(5, seed=index))
        order = [2, 0, 3, 1]
        outcomes = self._batch(engine, [self._item(members[i], 5, (1,)) for i in order]).items
        for where, (index, outcome) in enumerate(zip(order, outcomes, strict=True)):
            if where < 2:
                assert not isinstance(outcome, ErrorInfo), (
                    f"item {where} fits the budget (20 of 22 used before the batch) but failed: "
                    f"{outcome}"
                )
                h.observe(outcome)
                continue
            assert isinstance(outcome, ErrorInfo), f"item {where} passed a full budget"
            assert outcome.code == "resource_exhausted", f"item {where}: {outcome}"
            assert outcome.retryable, (
                f"item {where}: a full KV budget is retryable (a release frees it): {outcome}"
            )
            assert self._committed_length(engine, members[index]) == 5
        assert engine.health().kv_used_tokens == 22
        lru = h.load(kv_budget_tokens=22, max_sessions=8, eviction="lru")
        if not lru.capabilities().features.eviction:
            return
        idle = [h.session("idle-old"), h.session("idle-new")]
        named = [h.session(f"n{index}") for index in range(3)]
        for seed, session in enumerate([named[0], idle[0], named[1], idle[1], named[2]]):
            h.prefill(lru, session, 0, h.tokens(4, seed=seed))
        # 20 of 22 used; the batch needs 3: one idle session goes, the older one.
        outcomes = self._batch(lru, [self._item(s, 4, (2,)) for s in reversed(named)]).items
        failed = [o for o in outcomes if isinstance(o, ErrorInfo)]
        assert not failed, f"a batch that eviction can make room for failed: {failed}"
        miss = _raises(CacheMiss, partial(h.decode, lru, idle[0], 4, (1,)), "the older idle")
        assert isinstance(miss, CacheMiss)
        assert miss.reason == "evicted", miss
        assert self._committed_length(lru, idle[1]) == 4, "evicted more than needed"
        assert [self._committed_length(lru, s) for s in named] == [5, 5, 5]
        assert lru.health().kv_used_tokens == 19

    def test_batch_use_refreshes_lru_order(self) -> None:
        """A decode through a batch is a use for LRU: after a batch decodes the oldest
        session, admitting a newcomer evicts the next least recently used one instead.

        Fix: update each served item's last use when the batch commits, as a single decode
        does."""
        h = self.harness
        engine = h.load(kv_budget_tokens=15, max_sessions=8, eviction="lru")
        self._need_batches(engine)
        if not engine.capabilities().features.eviction:
            suite_skip("engine does not support eviction")
        a, b, c = h.session("a"), h.session("b"), h.session("c")
        for seed, session in enumerate((a, b, c)):
            h.prefill(engine, session, 0, h.tokens(4, seed=seed))
        [outcome] = self._batch(engine, [self._item(a, 4, (1,))]).items
        assert not isinstance(outcome, ErrorInfo), outcome
        h.prefill(engine, h.session("newcomer"), 0, h.tokens(3, seed=9))
        miss = _raises(CacheMiss, partial(h.decode, engine, b, 4, (1,)), "decode of b")
        assert isinstance(miss, CacheMiss)
        assert miss.reason == "evicted", (
            f"b (least recently used once the batch used a) must be evicted: {miss}"
        )
        assert self._committed_length(engine, a) == 5, (
            "the session a batch just decoded was evicted: a batch item is a use"
        )
        assert self._committed_length(engine, c) == 4

    def test_batch_error_items_carry_their_fields(self) -> None:
        """Every kind of failed batch item carries the fields a single decode's error
        carries: the code, the retryable flag of the contract, and for CacheMiss the
        committed length and the reason (position_mismatch, unknown_session, new_epoch,
        evicted); its wire form rebuilds the same error.

        Fix: build each item's ErrorInfo from the error the item's own admission raised
        (``error.to_info()``), never a generic one."""
        h = self.harness
        engine = h.load(max_context=12, kv_budget_tokens=40, max_sessions=8, eviction="lru")
        self._need_batches(engine)
        caps = engine.capabilities()
        vocab = caps.vocab_size
        full = h.session("full")
        for name in ("ahead", "newer", "bad"):
            h.prefill(engine, h.session(name), 0, h.tokens(4, seed=1))
        h.prefill(engine, full, 0, h.tokens(caps.limits.max_context, seed=2))
        h.prefill(engine, h.session("old", epoch=3), 0, h.tokens(2, seed=3))
        # One item per session: a session named twice is refused for that reason instead.
        cases: list[tuple[str, DecodeRequest]] = [
            ("position_mismatch", self._item(h.session("ahead"), 6, (1,))),
            ("unknown_session", self._item(h.session("ghost"), 0, (1,))),
            ("new_epoch", self._item(h.session("newer", epoch=2), 0, (1,))),
            ("stale_epoch", self._item(h.session("old", epoch=2), 2, (1,))),
            ("bad token", self._item(h.session("bad"), 4, (vocab,))),
            ("context", self._item(full, caps.limits.max_context, (1,))),
        ]
        if caps.features.eviction:
            gone = h.session("gone")
            lru = h.load(kv_budget_tokens=8, max_sessions=8, eviction="lru")
            h.prefill(lru, gone, 0, h.tokens(5, seed=4))
            h.prefill(lru, h.session("pusher"), 0, h.tokens(5, seed=5))
            evicted = self._item(gone, 5, (1,))
            [outcome] = self._batch(lru, [evicted]).items
            self._compare_item_error(lru, "evicted", evicted, outcome)
        outcomes = self._batch(engine, [item for _, item in cases]).items
        for (what, item), outcome in zip(cases, outcomes, strict=True):
            self._compare_item_error(engine, what, item, outcome)

    def _compare_item_error(
        self, engine: ShardEngine, what: str, item: DecodeRequest, outcome: object
    ) -> None:
        """A failed item's ErrorInfo says what the same decode, sent alone, raises."""
        assert isinstance(outcome, ErrorInfo), f"{what}: the item was served: {outcome!r}"
        single = self._error_of(partial(engine.decode, item), f"{what} as a single decode")
        fields = ("code", "retryable")
        have = tuple(getattr(outcome, name) for name in fields)
        want = tuple(getattr(single, name) for name in fields)
        if isinstance(single, CacheMiss):
            have += (outcome.details.get("committed_length"), outcome.details.get("reason"))
            want += (single.committed_length, single.reason)
        assert have == want, (
            f"{what}: the batch item's error says {have} (code, retryable"
            f"{', committed_length, reason' if isinstance(single, CacheMiss) else ''}); the "
            f"same decode alone raises {want}"
        )
        rebuilt = error_from_info(_codec.decode_message(_codec.encode(outcome)))  # type: ignore[arg-type]
        assert (type(rebuilt), rebuilt.retryable) == (type(single), single.retryable), (
            f"{what}: the item's error rebuilds as {type(rebuilt).__name__}"
        )
        if isinstance(single, CacheMiss):
            assert isinstance(rebuilt, CacheMiss)
            assert (rebuilt.committed_length, rebuilt.reason) == (
                single.committed_length,
                single.reason,
            ), f"{what}: the item's CacheMiss lost its fields over the wire"
