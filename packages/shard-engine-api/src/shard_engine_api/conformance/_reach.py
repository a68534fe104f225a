"""The standard tests that look past the suite's habitual small cases: scale (sessions of
hundreds of positions, past 256 and past an engine's micro-batch; thousands of releases),
batches (more than 8 items in shuffled order, the KV budget at its limit through a batch, LRU
order updated by a batch, every error item's fields), single values at their edges (retryable
on every path, every contract version edge, empty reserved values, narrow boundary dtypes
against the f32 rows, session ids across the valid characters and lengths, a request id
reused in flight, a release during a running request) and time (timings against a wall
clock, a load after a refused load, a refused first prefill of a newer epoch).
:class:`ShardEngineConformance` inherits them; their names are pinned in
:data:`REACH_TESTS`, part of the standard tests.

Every test is bounded: a few hundred positions sent in batched prefills, a few thousand
calls at most, so an engine of a few milliseconds per step (or one behind a transport) runs
them in seconds.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api import _codec
from shard_engine_api._errors import (
    CacheMiss,
    Cancelled,
    ContractVersionMismatch,
    ErrorInfo,
    InvalidRequest,
    NotReady,
    ShardEngineError,
    StaleEpoch,
    UnsupportedFeature,
    error_from_info,
)
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    CONTRACT_VERSION,
    AuxState,
    BoundaryResult,
    CancelRequest,
    DecodeRequest,
    ExportSessionRequest,
    ImportSessionRequest,
    LogitsResult,
    MtpState,
    PrefillRequest,
    SessionRef,
    SessionSnapshot,
    ShardResult,
    TokenInput,
)
from shard_engine_api.conformance._harness import (
    assert_matches,
    bundle_of,
    replace_bundle,
    split_ranges,
)
from shard_engine_api.conformance._recorder import suite_skip
from shard_engine_api.conformance._targeted import TargetedTests, _raises, _raises_exactly

__all__ = ["REACH_TESTS", "ReachTests"]

REACH_TESTS: Final[tuple[str, ...]] = (
    "test_batch_at_the_kv_budget",
    "test_batch_error_items_carry_their_fields",
    "test_batch_use_refreshes_lru_order",
    "test_contract_version_at_its_edges",
    "test_empty_reserved_values_refused",
    "test_large_shuffled_batches_match_single_decodes",
    "test_load_after_a_refused_load",
    "test_long_session_decode_and_chunks_match_one_prefill",
    "test_long_session_migrates_exactly",
    "test_narrow_boundary_dtypes_match_f32_rows",
    "test_refused_first_prefill_of_a_newer_epoch",
    "test_release_while_a_request_runs",
    "test_request_id_reused_while_in_flight",
    "test_retryable_on_every_path",
    "test_session_ids_across_characters_and_lengths",
    "test_thousands_of_releases_keep_every_fence",
    "test_timings_against_the_wall_clock",
    "test_truncate_at_large_positions",
)
"""The tests of this module, sorted (part of STANDARD_TESTS)."""

_LONG: Final = 300
"""Positions of a long session: past 256 (a byte-sized index, a 256-bit map) and past any
micro-batch of up to a few hundred rows."""
_RELEASES: Final = 4200
"""Released sessions of the fence test: past 4,096 (a 12-bit counter, a 4096-entry table)."""
_BATCH: Final = 12
"""Items of the large batch test: past 8 (an 8-wide batch, a byte of item flags)."""
_WALL_SLACK_MS: Final = 1.0
"""What an engine's own timings may exceed the caller's wall clock by (clock granularity)."""


def _rows(result: ShardResult) -> npt.NDArray[np.floating]:
    if isinstance(result, LogitsResult):
        return np.array(result.array())
    return np.array(bundle_of(result).array())


def _chunks(total: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    """``[0, total)`` cut at ``cuts`` (those inside it)."""
    points = [0, *sorted(c for c in set(cuts) if 0 < c < total), total]
    return list(itertools.pairwise(points))


class ReachTests(TargetedTests):
    """The standard tests past the suite's habitual scales and values (module docstring)."""

    # ----------------------------------------------------------------- helpers

    def _long_engine(self) -> tuple[ShardEngine, int]:
        """A full shard with room for a session of :data:`_LONG` positions and prefills of
        that many rows; the length it allows (skipped when an engine lowers it below 260)."""
        h = self.harness
        engine = h.load(
            max_context=2 * _LONG, max_batch_tokens=_LONG + 8, kv_budget_tokens=8 * _LONG
        )
        limits = engine.capabilities().limits
        length = min(_LONG, limits.max_batch_tokens, limits.max_context - 8)
        if length < 260:
            suite_skip(
                f"the engine lowered max_batch_tokens/max_context to {limits.max_batch_tokens}/"
                f"{limits.max_context}: no session of 260 positions fits"
            )
        return engine, length

    def _fill(
        self,
        engine: ShardEngine,
        session: SessionRef,
        tokens: Sequence[int],
        cuts: Sequence[int],
    ) -> list[npt.NDArray[np.floating]]:
        """Prefill ``tokens`` in the chunks ``cuts`` make (logits "all"); their rows."""
        h = self.harness
        return [
            _rows(h.prefill(engine, session, start, tuple(tokens[start:end]), logits="all"))
            for start, end in _chunks(len(tokens), cuts)
        ]

    def _migration_or_skip(self, engine: ShardEngine) -> None:
        if not engine.capabilities().features.session_migration:
            suite_skip("engine does not advertise session migration")

    def _error_of(self, call: Callable[[], object], what: str) -> ShardEngineError:
        return _raises(ShardEngineError, call, what)

    # ================================================================= scale

    def test_long_session_decode_and_chunks_match_one_prefill(self) -> None:
        """A session of about 300 positions (past 256 and past any micro-batch) built from
        uneven prefill chunks (logits "all") and decode steps across position 256 gives the
        rows of one prefill of the whole sequence (logits "all", every row), exactly when
        the engine declares batch_invariant, else within its tolerance.

        Fix: size every per-session index, cell map and buffer by max_context (not 256 or a
        micro-batch); carry the cache across micro-batches; return every row of logits
        "all", however long the prefill."""
        h = self.harness
        engine, length = self._long_engine()
        exact, tolerance = self._shape_exactness(engine.capabilities())
        tokens = h.tokens(length, seed=21)
        whole = _rows(h.prefill(engine, h.session("whole"), 0, tokens, logits="all"))
        assert whole.shape[0] == length, (
            f'logits "all" of a {length}-token prefill has {whole.shape[0]} rows'
        )
        session = h.session("built")
        rows = self._fill(engine, session, tokens[:250], (1, 16, 33, 133))
        for pos in range(250, 266):
            rows.append(_rows(h.decode(engine, session, pos, (tokens[pos],))))
        rows += [_rows(h.prefill(engine, session, 266, tokens[266 : length - 3], logits="all"))]
        for pos in range(length - 3, length):
            rows.append(_rows(h.decode(engine, session, pos, (tokens[pos],))))
        assert_matches(
            np.concatenate(rows),
            whole,
            exact=exact,
            tolerance=tolerance,
            what=f"{length} positions as chunks 0-1-16-33-133-250, decodes 250..265, a chunk "
            f"to {length - 3} and decodes vs one prefill",
        )

    def test_truncate_at_large_positions(self) -> None:
        """Truncating a session of about 300 positions at 280, 257 and 255 (a prefill below
        the committed length) gives the rows of a fresh run of the edited sequence, and the
        next decode equals the fresh run's.

        Fix: truncate by position over the whole context: drop every cached position >=
        start_pos, wherever it lives (past 256, past a micro-batch)."""
        h = self.harness
        engine, length = self._long_engine()
        caps = engine.capabilities()
        if not caps.features.truncate:
            self._check_truncate_refused(engine)
            suite_skip("engine declares features.truncate = False (and refuses truncation)")
        exact, tolerance = self._shape_exactness(caps)
        original = list(h.tokens(length, seed=31))
        session = h.session("edited")
        self._fill(engine, session, original, (200,))
        sequence = original
        for number, cut in enumerate((280, 257, 255)):
            edit = h.tokens(6, seed=40 + number)
            got = _rows(h.prefill(engine, session, cut, edit, logits="all"))
            sequence = sequence[:cut] + list(edit)
            fresh = h.session(f"fresh-{cut}")
            want = self._fill(engine, fresh, sequence, (200,))
            assert_matches(
                got,
                np.concatenate(want)[cut:],
                exact=exact,
                tolerance=tolerance,
                what=f"prefill at {cut} over {len(original)} cached positions vs a fresh run",
            )
            follow = h.tokens(1, seed=50 + number)
            assert_matches(
                _rows(h.decode(engine, session, len(sequence), follow)),
                _rows(h.decode(engine, fresh, len(sequence), follow)),
                exact=exact,
                tolerance=tolerance,
                what=f"decode after truncating at {cut}",
            )
            sequence = [*sequence, *follow]
            original = sequence
            h.release(engine, fresh)

    def test_long_session_migrates_exactly(self) -> None:
        """A session of about 300 positions exported, sent through the wire codec and
        imported under a newer epoch continues exactly as the source does: equal snapshot
        length, equal decodes (bit for bit when the engine is deterministic).

        Fix: export and import every position's state (not a fixed-size window or the first
        256 cells); cut the state with split_chunks."""
        h = self.harness
        source, length = self._long_engine()
        self._migration_or_skip(source)
        exact, tolerance = self._repeat_exactness(source.capabilities())
        target, _ = self._long_engine()
        tokens = h.tokens(length + 3, seed=61)
        session = h.session("moving")
        self._fill(source, session, tokens[:length], (128, 256))
        snapshot = source.export_session(
            ExportSessionRequest(request_id=h.request_id(), session=session)
        )
        decoded = _codec.decode_message(_codec.encode(snapshot))
        assert isinstance(decoded, SessionSnapshot), f"decoded {type(decoded).__name__}"
        assert decoded.length == length, f"snapshot length {decoded.length}, expected {length}"
        moved = SessionRef(session_id=session.session_id, epoch=2)
        result = target.import_session(
            ImportSessionRequest(request_id=h.request_id(), snapshot=decoded, epoch=2)
        )
        assert (result.session, result.length) == (moved, length), f"import answered {result}"
        for pos in range(length, length + 3):
            assert_matches(
                _rows(h.decode(target, moved, pos, (tokens[pos],))),
                _rows(h.decode(source, session, pos, (tokens[pos],))),
                exact=exact,
                tolerance=tolerance,
                what=f"decode at {pos} after moving a session of {length} positions",
            )

    def test_thousands_of_releases_keep_every_fence(self) -> None:
        """4,200 sessions prefilled and released one after another: metrics count every
        release (releases, tombstones >= 4,200, no fence dropped, nothing left active),
        health says the engine is empty, every released epoch checked (the first, those
        around 4,096 and a sample) is still StaleEpoch, and a newer epoch starts fresh.

        Fix: keep tombstones in a table that grows past 4,096 (EngineCore keeps at least a
        million); count releases and fences in 64-bit counters."""
        h = self.harness
        engine = h.load(max_sessions=4, eviction="reject")
        token = h.tokens(1, seed=1)
        for index in range(_RELEASES):
            session = SessionRef(session_id=f"r{index}", epoch=1)
            h.prefill(engine, session, 0, token)
            released = h.release(engine, session)
            assert released.released, f"release {index} freed nothing: {released}"
        metrics, health = engine.metrics(), engine.health()
        assert metrics.releases == _RELEASES, f"metrics.releases is {metrics.releases}"
        assert metrics.tombstones >= _RELEASES, f"metrics.tombstones is {metrics.tombstones}"
        assert metrics.fences_dropped == 0, f"metrics.fences_dropped is {metrics.fences_dropped}"
        assert (metrics.sessions_active, metrics.kv_used_tokens) == (0, 0), metrics
        assert metrics.requests == _RELEASES, f"metrics.requests is {metrics.requests}"
        assert (health.sessions, health.kv_used_tokens) == (0, 0), health
        checked = sorted(
            {0, 1, 255, 256, 4095, 4096, 4097, _RELEASES - 1, *range(7, _RELEASES, 97)}
        )
        for index in checked:
            _raises(
                StaleEpoch,
                partial(h.prefill, engine, SessionRef(session_id=f"r{index}", epoch=1), 0, token),
                f"prefill of released session r{index} (of {_RELEASES})",
            )
        assert engine.metrics().errors.get("stale_epoch", 0) == len(checked)
        renewed = SessionRef(session_id="r0", epoch=2)
        h.prefill(engine, renewed, 0, token)
        assert engine.health().sessions == 1

    # ================================================================= batches

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

    # ================================================================= single values

    def test_retryable_on_every_path(self) -> None:
        """Every error has the contract's retryable flag on every path it can come from:
        prefill, decode, a batch item, export and import. KV budget and session slots are
        retryable everywhere; positions past max_context and a prefill over max_batch_tokens
        are not; ChecksumMismatch and CacheMiss are (a retransmission, a replay), StaleEpoch,
        ContractVersionMismatch, InvalidRequest and UnsupportedFeature are not.

        Fix: raise the contract's classes with their default retryable everywhere (one
        admission path for every operation), retryable=False only where the request itself
        cannot ever fit."""
        h = self.harness
        engine = h.load(max_context=12, kv_budget_tokens=16, max_sessions=2, eviction="reject")
        caps = engine.capabilities()
        limits = caps.limits
        batched = caps.features.batched_decode
        a, b = h.session("a"), h.session("b")
        h.prefill(engine, a, 0, h.tokens(limits.max_context, seed=1))
        h.prefill(engine, b, 0, h.tokens(limits.kv_budget_tokens - limits.max_context, seed=2))
        checks: list[tuple[str, bool, Callable[[], object]]] = [
            ("KV budget on prefill", True, partial(h.prefill, engine, b, 4, h.tokens(3, seed=3))),
            ("KV budget on decode", True, partial(h.decode, engine, b, 4, (1,))),
            ("slots on a new session", True, partial(h.prefill, engine, h.session("c"), 0, (1,))),
            ("context on decode", False, partial(h.decode, engine, a, limits.max_context, (1,))),
            (
                "context on prefill",
                False,
                partial(h.prefill, engine, a, limits.max_context, (1,)),
            ),
            (
                "a prefill over max_batch_tokens",
                False,
                partial(h.prefill, engine, a, 0, h.tokens(limits.max_batch_tokens + 1, seed=4)),
            ),
            ("cache miss on decode", True, partial(h.decode, engine, a, 3, (1,))),
            ("stale epoch on decode", False, partial(h.decode, engine, h.session("a", 0), 4, (1,))),
            ("stale epoch on release", False, partial(h.release, engine, h.session("a", 0))),
            ("invalid token on decode", False, partial(h.decode, engine, b, 4, (caps.vocab_size,))),
        ]
        items: list[tuple[str, bool, DecodeRequest]] = [
            ("KV budget in a batch", True, self._item(b, 4, (1,))),
            ("context in a batch", False, self._item(a, limits.max_context, (1,))),
            ("cache miss in a batch", True, self._item(a, 3, (1,))),
            ("stale epoch in a batch", False, self._item(h.session("a", 0), 4, (1,))),
        ]
        if caps.features.session_migration:
            checks += [
                (
                    "cache miss on export",
                    True,
                    partial(
                        engine.export_session,
                        ExportSessionRequest(request_id=h.request_id(), session=h.session("x")),
                    ),
                ),
                (
                    "stale epoch on export",
                    False,
                    partial(
                        engine.export_session,
                        ExportSessionRequest(request_id=h.request_id(), session=h.session("a", 0)),
                    ),
                ),
            ]
            snapshot = engine.export_session(
                ExportSessionRequest(request_id=h.request_id(), session=b)
            )
            moved = msgspec.structs.replace(snapshot, session=h.session("moved"))
            corrupted = msgspec.structs.replace(snapshot, checksum=snapshot.checksum ^ 1)
            newer = msgspec.structs.replace(snapshot, contract_version=CONTRACT_VERSION + 1)
            for what, retry, sent, epoch in (
                ("slots on import", True, moved, None),
                ("stale epoch on import", False, snapshot, None),
                ("checksum on import", True, corrupted, 5),
                ("contract version on import", False, newer, 5),
            ):
                request = ImportSessionRequest(
                    request_id=h.request_id(), snapshot=sent, epoch=epoch
                )
                checks.append((what, retry, partial(engine.import_session, request)))
        if h.n_layers >= 2:
            head, tail = self._head_and_tail()
            s = h.session("t")
            h.prefill(tail, s, 0, h.head_bundle(head, s, 0, h.tokens(3, seed=5)))
            row = bundle_of(h.decode(head, s, 3, (1,)))
            broken_row = replace_bundle(row, checksum=row.checksum ^ 1)
            versioned = replace_bundle(row, contract_version=CONTRACT_VERSION + 1)
            checks += [
                ("checksum on decode", True, partial(h.decode, tail, s, 3, broken_row)),
                ("contract version on decode", False, partial(h.decode, tail, s, 3, versioned)),
            ]
            if tail.capabilities().features.batched_decode:
                for what, retry, bad in (
                    ("checksum in a batch", True, broken_row),
                    ("contract version in a batch", False, versioned),
                ):
                    [outcome] = self._batch(tail, [self._item(s, 3, bad)]).items
                    assert isinstance(outcome, ErrorInfo), f"{what}: served"
                    assert outcome.retryable == retry, (
                        f"{what}: {outcome.code} retryable={outcome.retryable}, the contract "
                        f"says {retry}"
                    )
        for what, retry, call in checks:
            error = self._error_of(call, what)
            assert error.retryable == retry, (
                f"{what}: {type(error).__name__} retryable={error.retryable}, the contract "
                f"says {retry}"
            )
        for what, retry, item in items if batched else []:
            # One batch per item: items naming one session twice are refused for that.
            [outcome] = self._batch(engine, [item]).items
            assert isinstance(outcome, ErrorInfo), f"{what}: served"
            assert outcome.retryable == retry, (
                f"{what}: {outcome.code} retryable={outcome.retryable}, the contract says {retry}"
            )

    def test_contract_version_at_its_edges(self) -> None:
        """A bundle of any other contract version is ContractVersionMismatch on prefill,
        decode and in a batch: the previous version, 0, the next one, and versions that
        equal this one modulo 2**8, 2**16 and 2**32; nothing changes.

        Fix: compare the whole 64-bit contract_version with CONTRACT_VERSION for equality
        (not >=, not a narrowed integer) on every path that takes a bundle."""
        h = self.harness
        head, tail = self._head_and_tail()
        session = h.session("v")
        bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
        row = bundle_of(h.decode(head, session, 3, (1,)))
        versions = sorted(
            {
                CONTRACT_VERSION - 1,
                0,
                CONTRACT_VERSION + 1,
                CONTRACT_VERSION + 2**8,
                CONTRACT_VERSION + 2**16,
                CONTRACT_VERSION + 2**32,
            }
            - {CONTRACT_VERSION}
        )
        versions = [v for v in versions if v >= 0]
        for version in versions:
            _raises_exactly(
                ContractVersionMismatch,
                partial(
                    h.prefill, tail, session, 0, replace_bundle(bundle, contract_version=version)
                ),
                f"prefill with contract_version {version}",
            )
        assert tail.health().sessions == 0, "a refused bundle created a session"
        h.prefill(tail, session, 0, bundle)
        batched = tail.capabilities().features.batched_decode
        for version in versions:
            stepped = replace_bundle(row, contract_version=version)
            _raises_exactly(
                ContractVersionMismatch,
                partial(h.decode, tail, session, 3, stepped),
                f"decode with contract_version {version}",
            )
            if batched:
                [outcome] = self._batch(tail, [self._item(session, 3, stepped)]).items
                assert isinstance(outcome, ErrorInfo), f"batch item of version {version} served"
                assert outcome.code == ContractVersionMismatch.code, (
                    f"batch item of contract_version {version}: {outcome}"
                )
        assert self._committed_length(tail, session) == 3
        h.decode(tail, session, 3, row)

    def test_empty_reserved_values_refused(self) -> None:
        """A reserved field holding an empty value (``MtpState()``, ``AuxState(name="")``)
        is not empty: it is UnsupportedFeature on prefill, decode and batch items, and on a
        bundle's reserved fields; nothing changes.

        Fix: refuse any non-empty mtp or aux tuple, whatever its elements hold."""
        h = self.harness
        engine = h.load()
        session = h.session("r")
        tokens = TokenInput(token_ids=h.tokens(3, seed=1))
        empties: list[tuple[str, dict[str, object]]] = [
            ("mtp=(MtpState(),)", {"mtp": (MtpState(),)}),
            ("aux=(AuxState(name=''),)", {"aux": (AuxState(name=""),)}),
        ]
        for what, fields in empties:
            prefill = PrefillRequest(
                request_id=h.request_id(), session=session, start_pos=0, inputs=tokens
            )
            _raises_exactly(
                UnsupportedFeature,
                partial(engine.prefill, msgspec.structs.replace(prefill, **fields)),
                f"prefill with {what}",
            )
        h.prefill(engine, session, 0, tokens)
        for what, fields in empties:
            _raises_exactly(
                UnsupportedFeature,
                partial(engine.decode, self._item(session, 3, (1,), **fields)),
                f"decode with {what}",
            )
            if engine.capabilities().features.batched_decode:
                [outcome] = self._batch(engine, [self._item(session, 3, (1,), **fields)]).items
                assert isinstance(outcome, ErrorInfo), f"batch item with {what} served"
                assert outcome.code == UnsupportedFeature.code, f"batch item with {what}: {outcome}"
        assert self._committed_length(engine, session) == 3
        if h.n_layers < 2:
            return
        head, tail = self._head_and_tail()
        bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
        for what, fields in empties:
            _raises_exactly(
                UnsupportedFeature,
                partial(h.prefill, tail, session, 0, replace_bundle(bundle, **fields)),
                f"a bundle with {what}",
            )

    def test_narrow_boundary_dtypes_match_f32_rows(self) -> None:
        """Bundles in every advertised narrow dtype (f16, bf16) carry the f32 rows rounded to
        that dtype: each value within one unit in the last place of the narrow type of the
        head's f32 bundle, for prefill and decode rows alike.

        Fix: convert with round-to-nearest from the f32 hidden states (for bf16: the upper 16
        bits after rounding, in little-endian order); never reinterpret bytes."""
        h = self.harness
        self._need_layers(2, "a head shard")
        (head_range, _tail) = split_ranges(h.n_layers, 2)
        reference = h.load(*head_range)
        dtypes = [d for d in reference.capabilities().boundary_dtypes if d != "f32"]
        if not dtypes:
            suite_skip("the engine advertises only f32 boundaries")
        tokens = h.tokens(9, seed=3)
        session = h.session("narrow")
        wide = [
            np.array(h.head_bundle(reference, session, 0, tokens).array(), np.float64),
            np.array(bundle_of(h.decode(reference, session, 9, (2,))).array(), np.float64),
        ]
        bits = {"f16": 10, "bf16": 7}
        for dtype in dtypes:
            head = h.load(*head_range, boundary_dtype=dtype)
            narrow = [h.head_bundle(head, session, 0, tokens)]
            narrow.append(bundle_of(h.decode(head, session, 9, (2,))))
            for what, want, bundle in zip(("prefill", "decode"), wide, narrow, strict=True):
                assert bundle.dtype == dtype, f"{dtype} {what}: the bundle says {bundle.dtype}"
                got = np.array(bundle.array(), np.float64)
                assert got.shape == want.shape, f"{dtype} {what}: shape {got.shape}"
                exponent = np.floor(np.log2(np.maximum(np.abs(want), np.finfo(np.float32).tiny)))
                # f16 subnormals are evenly spaced 2**-24 apart.
                ulp = np.maximum(
                    np.exp2(exponent - bits[dtype]), 2.0**-24 if dtype == "f16" else 0.0
                )
                gap = np.abs(got - want)
                worst = int(np.argmax(gap - ulp))
                assert (gap <= ulp).all(), (
                    f"{dtype} {what} rows differ from the f32 rows by {gap.flat[worst]:.3g} at "
                    f"{want.flat[worst]:.6g} (one {dtype} unit there is {ulp.flat[worst]:.3g})"
                )

    def test_session_ids_across_characters_and_lengths(self) -> None:
        """Session ids across the valid range are distinct, isolated sessions: multi-byte
        ids at the 256-character limit (2-, 3- and 4-byte characters), ids holding NUL
        (alone, inside, at the end), ids differing only after a NUL, and one-character ids;
        each equals its run alone; releasing one leaves the others.

        Fix: key sessions by the whole id as a Python string (never a C string cut at NUL,
        never a byte buffer of 256 bytes)."""
        h = self.harness
        ids = [
            "\u00e9" * 256,
            "\u00e9" * 255 + "e",
            "\u4e2d" * 256,
            "\U0001f600" * 256,
            "\U0001f600" * 255 + "\U0001f601",
            "\x00",
            "a\x00b",
            "a\x00c",
            "a",
            "a\x00",
            "z",
        ]
        engine = h.load(max_sessions=len(ids))
        exact, tolerance = self._isolation_exactness(engine.capabilities())
        alone = h.load()
        sessions = [SessionRef(session_id=sid, epoch=1) for sid in ids]
        expected = []
        for index, session in enumerate(sessions):
            outputs = [_rows(h.prefill(alone, session, 0, h.tokens(2 + index, seed=index)))]
            outputs.append(_rows(h.decode(alone, session, 2 + index, (index,))))
            h.release(alone, session)
            expected.append(outputs)
        got: list[list[npt.NDArray[np.floating]]] = []
        for index, session in enumerate(sessions):
            got.append([_rows(h.prefill(engine, session, 0, h.tokens(2 + index, seed=index)))])
        for index in reversed(range(len(sessions))):
            got[index].append(_rows(h.decode(engine, sessions[index], 2 + index, (index,))))
        for index, session in enumerate(sessions):
            for step in range(2):
                assert_matches(
                    got[index][step],
                    expected[index][step],
                    exact=exact,
                    tolerance=tolerance,
                    what=f"session id {session.session_id[:3]!r}..{session.session_id[-2:]!r} "
                    f"({len(session.session_id)} characters) output {step}",
                )
        assert engine.health().sessions == len(ids)
        h.release(engine, sessions[6])
        assert engine.health().sessions == len(ids) - 1
        for index in (7, 8, 9):
            length = self._committed_length(engine, sessions[index])
            assert length == 3 + index, f"releasing 'a\\x00b' changed {ids[index]!r}: {length}"

    def test_request_id_reused_while_in_flight(self) -> None:
        """A request id reused while the first request with it is still in flight (slowed by
        the fixture's cancellation options) never disturbs the first: the second call is
        refused with InvalidRequest or served on its own; the first completes with its own
        result; a cancel by that id still reaches the first while it runs; afterwards the id
        is free again. Skipped when the two never overlapped without cancellation options.

        Fix: keep one registration per in-flight request id; refuse a duplicate before
        registering it, and never let its end remove the first one's registration."""
        h = self.harness
        engine = self._slow()
        if not engine.capabilities().features.cancel:
            suite_skip("engine does not advertise cancel")
        for attempt in range(4):
            first, second = h.session(f"first-{attempt}"), h.session(f"second-{attempt}")
            h.prefill(engine, second, 0, h.tokens(3, seed=2))
            shared = h.request_id()
            outcome: dict[str, object] = {}

            def run(
                first: SessionRef = first, outcome: dict[str, object] = outcome, rid: str = shared
            ) -> None:
                try:
                    outcome["first"] = h.prefill(
                        engine, first, 0, h.tokens(4, seed=1), request_id=rid
                    )
                except ShardEngineError as error:
                    outcome["first"] = error

            worker = threading.Thread(target=run, daemon=True)
            worker.start()
            _wait_until(partial(_running, engine, worker))
            if not worker.is_alive():
                worker.join()
                h.release(engine, first)
                continue
            duplicate = DecodeRequest(
                request_id=shared, session=second, pos=3, inputs=TokenInput(token_ids=(1,))
            )
            try:
                engine.decode(duplicate)
                served = True
            except InvalidRequest:
                served = False
            cancel = engine.cancel(CancelRequest(request_id=shared))
            worker.join(timeout=30.0)
            assert not worker.is_alive(), "the first request did not return in 30 s"
            result = outcome.get("first")
            if cancel.cancelled:
                assert isinstance(result, Cancelled), (
                    f"cancel by the shared id said cancelled=True, the first returned {result!r}"
                )
            elif not isinstance(result, BoundaryResult | LogitsResult):
                raise AssertionError(f"the first request returned {result!r}")
            elif served:
                pass  # both ran; the cancel came after the first committed
            else:
                continue  # the first ended before the cancel: try again
            assert engine.health().in_flight == 0
            assert self._committed_length(engine, second) == (4 if served else 3)
            assert self._committed_length(engine, first) == (0 if cancel.cancelled else 4)
            h.prefill(engine, h.session(f"after-{attempt}"), 0, (1,), request_id=shared)
            if cancel.cancelled:
                return
        h.no_cancel_landed("a cancel by a reused request id never reached the first request")

    def test_release_while_a_request_runs(self) -> None:
        """A release arriving while a prefill of the session runs (slowed by the fixture's
        cancellation options) leaves a consistent engine: when it says released, the
        session is gone and fenced (prefill and decode at its epoch are StaleEpoch, health
        and metrics count no session and no positions), whatever the prefill returned.

        Fix: serialise release with the operations of the session (EngineCore's compute
        lock), so a running operation's commit cannot revive a released session."""
        h = self.harness
        engine = self._slow()
        for attempt in range(3):
            session = h.session(f"released-{attempt}")
            h.prefill(engine, session, 0, h.tokens(3, seed=1))
            outcome: dict[str, object] = {}

            def run(session: SessionRef = session, outcome: dict[str, object] = outcome) -> None:
                try:
                    outcome["prefill"] = h.prefill(engine, session, 3, h.tokens(4, seed=2))
                except ShardEngineError as error:
                    outcome["prefill"] = error

            worker = threading.Thread(target=run, daemon=True)
            worker.start()
            _wait_until(partial(_running, engine, worker))
            released = h.release(engine, session)
            worker.join(timeout=30.0)
            assert not worker.is_alive(), "the prefill did not return in 30 s"
            assert released.released, f"releasing a live session said {released}"
            for what, call in (
                ("prefill", partial(h.prefill, engine, session, 0, (1,))),
                ("decode", partial(h.decode, engine, session, 7, (1,))),
            ):
                _raises(StaleEpoch, call, f"{what} of the released session ({outcome})")
            health, metrics = engine.health(), engine.metrics()
            assert (health.sessions, health.kv_used_tokens, health.in_flight) == (0, 0, 0), (
                f"after a release during a running prefill ({outcome}): {health}"
            )
            assert (metrics.sessions_active, metrics.kv_used_tokens) == (0, 0), metrics

    # ================================================================= time

    def test_timings_against_the_wall_clock(self) -> None:
        """Timings are milliseconds of this call: no result's total_ms or compute_ms exceeds
        the wall-clock time of its call (plus 1 ms), also for quick calls right after a long
        one; the growth of metrics.compute_ms over the calls is at most their wall clock;
        and a call slowed by the fixture's cancellation options to 40 ms or more reports at
        least a quarter of its wall clock as total_ms.

        Fix: measure each call on time.perf_counter from its own start (never a previous
        call's, never cumulative) and report milliseconds."""
        h = self.harness
        engine, length = self._long_engine()
        session = h.session("timed")
        before = engine.metrics().compute_ms
        walls: list[float] = []
        calls: list[tuple[str, Callable[[], ShardResult]]] = [
            ("a long prefill", partial(h.prefill, engine, session, 0, h.tokens(length, seed=1))),
            *[
                (f"decode {pos}", partial(h.decode, engine, session, pos, (1,)))
                for pos in range(length, length + 3)
            ],
        ]
        for what, call in calls:
            started = time.perf_counter()
            result = call()
            wall = (time.perf_counter() - started) * 1000.0
            walls.append(wall)
            for name in ("total_ms", "compute_ms", "queue_ms"):
                value = getattr(result.timings, name)
                assert value <= wall + _WALL_SLACK_MS, (
                    f"{what}: timings.{name} is {value:.3f} ms, the call took {wall:.3f} ms by "
                    "the wall clock"
                )
        grown = engine.metrics().compute_ms - before
        assert grown <= sum(walls) + _WALL_SLACK_MS * len(walls), (
            f"metrics.compute_ms grew by {grown:.3f} ms over calls of {sum(walls):.3f} ms"
        )
        if not h.target.cancel_load_options:
            return
        slow = self._slow()
        started = time.perf_counter()
        result = h.prefill(slow, h.session("slow"), 0, h.tokens(8, seed=2))
        wall = (time.perf_counter() - started) * 1000.0
        if wall >= 40.0:
            assert result.timings.total_ms >= wall / 4.0, (
                f"a call of {wall:.1f} ms by the wall clock reports total_ms "
                f"{result.timings.total_ms:.3f}: timings are milliseconds"
            )

    def test_load_after_a_refused_load(self) -> None:
        """A load refused for a model that does not exist leaves the engine unloaded (health
        "unloaded", capabilities NotReady); a following load of the fixture's model succeeds
        and the engine serves as a freshly loaded one.

        Fix: on a failed load, release what it opened and return to the initial state (a
        failed load may be retried)."""
        h = self.harness
        engine = h.new_engine()
        good = h.config()
        missing = msgspec.structs.replace(
            good,
            shard=msgspec.structs.replace(good.shard, model=f"{good.shard.model}.no-such-model"),
        )
        try:
            engine.load(missing)
        except ShardEngineError:
            pass
        else:
            suite_skip("the engine loaded a model reference that names no model")
        assert engine.health().state == "unloaded", (
            f"after a refused load health says {engine.health().state!r}"
        )
        _raises(NotReady, engine.capabilities, "capabilities() after a refused load")
        caps = engine.load(good)
        h.note_capabilities(caps)
        exact, tolerance = self._repeat_exactness(caps)
        tokens = h.tokens(4, seed=1)
        got = _rows(h.prefill(engine, h.session("a"), 0, tokens))
        want = _rows(h.prefill(h.load(), h.session("a"), 0, tokens))
        assert_matches(
            got, want, exact=exact, tolerance=tolerance, what="a prefill after a refused load"
        )

    def test_refused_first_prefill_of_a_newer_epoch(self) -> None:
        """A newer epoch's first prefill that is refused (bad token, KV budget) or cancelled
        leaves the live older epoch exactly as it was (its length, its next decode equals a
        clean run, health unchanged), and the newer epoch was not fenced: it can start
        afterwards.

        Fix: drop the older epoch's state only when the newer epoch's first prefill commits
        (EngineCore replaces it at the commit point)."""
        h = self.harness
        engine = self._slow(kv_budget_tokens=10, eviction="reject")
        caps = engine.capabilities()
        exact, tolerance = self._shape_exactness(caps)
        old, new = h.session("s", epoch=1), h.session("s", epoch=2)
        tokens = h.tokens(5, seed=1)
        h.prefill(engine, old, 0, tokens)
        h.prefill(engine, h.session("other"), 0, h.tokens(4, seed=2))
        attempts: list[tuple[str, Callable[[], object]]] = [
            ("bad token", partial(h.prefill, engine, new, 0, (1, caps.vocab_size))),
            ("KV budget", partial(h.prefill, engine, new, 0, h.tokens(7, seed=3))),
        ]
        if caps.features.cancel and h.target.cancel_load_options:
            rid = h.request_id()
            attempts.append(
                (
                    "cancelled",
                    partial(
                        self._cancelled_or_raise,
                        engine,
                        rid,
                        partial(h.prefill, engine, new, 0, (1, 2), request_id=rid),
                    ),
                )
            )
        for what, call in attempts:
            self._error_of(call, f"epoch 2's first prefill ({what})")
            assert self._committed_length(engine, old) == 5, f"after a {what} epoch-2 prefill"
            assert engine.health().kv_used_tokens == 9, f"after a {what} epoch-2 prefill"
        clean = h.load()
        h.prefill(clean, old, 0, tokens)
        assert_matches(
            _rows(h.decode(engine, old, 5, (3,))),
            _rows(h.decode(clean, old, 5, (3,))),
            exact=exact,
            tolerance=tolerance,
            what="the older epoch's decode after refused newer-epoch prefills",
        )
        h.prefill(engine, new, 0, (1,))
        _raises(StaleEpoch, partial(h.decode, engine, old, 6, (1,)), "epoch 1 after epoch 2")

    def _cancelled_or_raise(
        self, engine: ShardEngine, request_id: str, call: Callable[[], object]
    ) -> object:
        """Run ``call`` while a canceller cancels ``request_id``; a completed call (the
        cancel came too late) is reported as such."""
        from shard_engine_api.conformance._harness import Canceller

        canceller = Canceller(engine, CancelRequest(request_id=request_id), 0.0)
        canceller.start()
        try:
            result = call()
        finally:
            canceller.stop()
        raise AssertionError(
            f"a prefill slowed by the cancellation options completed before its cancel: {result}"
        )


def _wait_until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not condition():
        time.sleep(0.0002)


def _running(engine: ShardEngine, worker: threading.Thread) -> bool:
    """The engine has a request in flight, or ``worker`` (which sent it) has ended."""
    return engine.health().in_flight >= 1 or not worker.is_alive()
