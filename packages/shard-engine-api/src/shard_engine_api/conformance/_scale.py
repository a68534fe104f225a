"""The standard tests of the paths small, regular cases do not take: sessions that were evicted
(exported, imported over their fence; evicted through a prefill and through a batch), bf16 and
f16 rows against the f32 rows of the same computation (rounded to nearest-even), request ids
reused and releases arriving while a request runs, ``retryable`` at every contract version edge
and on every path, empty reserved values inside bundles, session ids at the length limit and one
past it, timings of batches and imports against the wall clock, loads after refusals of every
kind, and every way a newer epoch's first request can be refused. :class:`ShardEngineConformance`
inherits them; their names are pinned in :data:`SCALE_TESTS`, part of the standard tests.

Every test is bounded: a handful of small engines, a few dozen calls; the slowed ones (the
fixture's cancellation options) a few calls each.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api._errors import (
    CacheMiss,
    Cancelled,
    ErrorInfo,
    InvalidRequest,
    NotReady,
    ShardEngineError,
    StaleEpoch,
    UnsupportedFeature,
)
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    CONTRACT_VERSION,
    AuxState,
    BoundaryBundle,
    BoundaryResult,
    CancelRequest,
    DecodeBatchRequest,
    ExportSessionRequest,
    ImportSessionRequest,
    LogitsResult,
    MtpState,
    PrefillRequest,
    SessionRef,
    SessionSnapshot,
    TokenInput,
)
from shard_engine_api.conformance._harness import (
    SuiteHelpers,
    _raises,
    _raises_exactly,
    _rows,
    _wait_until,
    assert_matches,
    bundle_of,
    replace_bundle,
    split_ranges,
)
from shard_engine_api.conformance._recorder import suite_skip

__all__ = ["SCALE_TESTS", "ScaleTests"]

SCALE_TESTS: Final[tuple[str, ...]] = (
    "test_empty_reserved_values_inside_bundles_refused",
    "test_export_of_an_evicted_session",
    "test_import_over_an_eviction_fence_and_a_tombstone",
    "test_loads_after_refused_loads_of_every_kind",
    "test_narrow_rows_round_the_f32_rows_to_nearest_even",
    "test_newer_epoch_refused_on_every_path_keeps_the_older",
    "test_release_while_a_decode_runs_keeps_the_others",
    "test_request_id_reused_in_flight_on_every_path",
    "test_retryable_at_every_contract_version_and_path",
    "test_session_ids_at_and_past_the_length_limit",
    "test_timings_of_batches_and_imports_against_the_wall_clock",
)
"""The tests of this module, sorted (part of STANDARD_TESTS)."""

_WALL_SLACK_MS: Final = 1.0
"""What an engine's own timings may exceed the caller's wall clock by (clock granularity)."""
_ID_LIMIT: Final = 256
"""The longest session id, in characters (``MAX_ID_CHARS`` of the contract)."""


def _overlong(session: SessionRef, session_id: str) -> SessionRef:
    """``session`` naming ``session_id`` although it breaks the contract's rules: built past
    the constructor's check, as a peer that skips it (or a hand-made wire message) sends it."""
    broken = msgspec.structs.replace(session)
    msgspec.structs.force_setattr(broken, "session_id", session_id)
    return broken


def _nearest_even(values: npt.NDArray[np.floating], dtype: str) -> npt.NDArray[np.float64]:
    """f32 values rounded to ``dtype`` (nearest, ties to even) and widened back: bf16 written
    here from the definition, apart from the API's own conversion; f16 by numpy's IEEE cast."""
    if dtype == "f16":
        return np.asarray(values, np.float32).astype(np.float16).astype(np.float64)
    bits = np.asarray(values, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    widened = (rounded << 16).astype(np.uint32).view(np.float32)
    return widened.astype(np.float64)


class ScaleTests(SuiteHelpers):
    """The standard tests of the paths past small, regular cases (module docstring)."""

    # ----------------------------------------------------------------- helpers

    def _export_session(self, engine: ShardEngine, session: SessionRef) -> SessionSnapshot:
        return engine.export_session(
            ExportSessionRequest(request_id=self.harness.request_id(), session=session)
        )

    def _import_session(
        self, engine: ShardEngine, snapshot: SessionSnapshot, epoch: int | None
    ) -> object:
        return engine.import_session(
            ImportSessionRequest(
                request_id=self.harness.request_id(), snapshot=snapshot, epoch=epoch
            )
        )

    def _evicting(self) -> ShardEngine:
        """A full shard with eviction "lru", a KV budget of 12 positions and session
        migration (else skipped)."""
        h = self.harness
        engine = h.load(eviction="lru", kv_budget_tokens=12, max_context=16, max_batch_tokens=16)
        features = engine.capabilities().features
        if not features.session_migration:
            suite_skip("engine does not advertise session migration")
        if not features.eviction:
            suite_skip("engine does not advertise LRU eviction (features.eviction)")
        return engine

    def _eviction_occupancy(self, engine: ShardEngine) -> tuple[int, int, int, int, int]:
        health, metrics = engine.health(), engine.metrics()
        return (
            health.sessions,
            health.kv_used_tokens,
            metrics.sessions_active,
            metrics.evictions,
            metrics.imports,
        )

    def _evict(
        self, engine: ShardEngine, victim: SessionRef, through: str, tag: str
    ) -> list[SessionRef]:
        """Fill ``engine`` (eviction "lru") so that ``victim``, prefilled first, is evicted
        ``through`` a prefill or a decode_batch; the sessions that filled it."""
        h = self.harness
        budget = engine.capabilities().limits.kv_budget_tokens
        filler = h.session(f"filler-{tag}")
        h.prefill(engine, victim, 0, h.tokens(2, seed=1))
        h.prefill(engine, filler, 0, h.tokens(budget - 2, seed=2))
        if through == "a prefill":
            other = h.session(f"other-{tag}")
            h.prefill(engine, other, 0, (3,))
            fillers = [filler, other]
        else:
            [outcome] = self._batch(engine, [self._item(filler, budget - 2, (3,))]).items
            assert not isinstance(outcome, ErrorInfo), (
                f"a batch decoding a session at a full KV budget (eviction 'lru') was refused: "
                f"{outcome}"
            )
            fillers = [filler]
        miss = _raises(
            CacheMiss,
            partial(h.decode, engine, victim, 2, (1,)),
            f"a decode of the session evicted through {through}",
        )
        assert isinstance(miss, CacheMiss)
        assert miss.reason == "evicted", (
            f"the least recently used session, evicted through {through}, is not reported "
            f"evicted: {miss!r}"
        )
        return fillers

    def _eviction_paths(self, engine: ShardEngine) -> list[str]:
        if engine.capabilities().features.batched_decode:
            return ["a prefill", "a decode_batch"]
        return ["a prefill"]

    # ================================================================= eviction

    def test_export_of_an_evicted_session(self) -> None:
        """Exporting a session evicted by LRU, through a prefill and through a decode_batch,
        is CacheMiss with reason "evicted" and committed length 0 at its epoch, StaleEpoch
        at an older one; the exports change nothing (sessions, KV, evictions, imports, the
        other sessions' lengths) and the evicted epoch stays fenced.

        Fix: export under decode's rules, fences included: look the session up in the ledger
        (an evicted session has a fence, not a slot) and never read a slot the ledger does
        not hold; an export is a read and changes nothing."""
        h = self.harness
        probe = self._evicting()
        for path in self._eviction_paths(probe):
            engine = self._evicting()
            victim = h.session("evicted", epoch=3)
            fillers = self._evict(engine, victim, path, "export")
            lengths = [self._committed_length(engine, filler) for filler in fillers]
            before = self._eviction_occupancy(engine)
            miss = _raises_exactly(
                CacheMiss,
                partial(self._export_session, engine, victim),
                f"export of a session evicted through {path}",
            )
            assert isinstance(miss, CacheMiss)
            assert (miss.reason, miss.committed_length, miss.retryable) == ("evicted", 0, True), (
                f"export of a session evicted through {path}: CacheMiss reason "
                f"{miss.reason!r}, committed_length {miss.committed_length}, retryable "
                f"{miss.retryable}; the contract says 'evicted', 0, True"
            )
            _raises_exactly(
                StaleEpoch,
                partial(self._export_session, engine, h.session("evicted", epoch=2)),
                f"export at an epoch older than the one evicted through {path}",
            )
            assert self._eviction_occupancy(engine) == before, (
                f"exporting a session evicted through {path} changed (sessions, KV, sessions "
                f"active, evictions, imports) from {before} to {self._eviction_occupancy(engine)}"
            )
            assert [self._committed_length(engine, f) for f in fillers] == lengths
            _raises(
                StaleEpoch,
                partial(h.prefill, engine, h.session("evicted", epoch=2), 0, (1,)),
                f"a prefill older than the epoch evicted through {path}, after its export",
            )

    def test_import_over_an_eviction_fence_and_a_tombstone(self) -> None:
        """A snapshot imported over a session evicted at epoch e (through a prefill and
        through a decode_batch): under an epoch below e it is StaleEpoch and changes nothing;
        at e or above it is installed (the contract's table: "evicted at an epoch <= e") and
        continues exactly as the exporter would; afterwards epochs below it are StaleEpoch.
        Over a release tombstone at e: e and below are StaleEpoch, e + 1 is installed.

        Fix: run import through the one fence rule of prefill (EngineCore's ledger): an
        evicted epoch fences older epochs only; a released epoch fences itself too."""
        h = self.harness
        probe = self._evicting()
        caps = probe.capabilities()
        exact, tolerance = self._repeat_exactness(caps)
        # Loaded as the importers are (the same result-affecting settings), without eviction.
        source = h.load(kv_budget_tokens=12, max_context=16, max_batch_tokens=16)
        moved = h.session("moved", epoch=2)
        h.prefill(source, moved, 0, h.tokens(4, seed=7))
        snapshot = self._export_session(source, moved)
        want = _rows(h.decode(source, moved, 4, (5,)))
        for path in self._eviction_paths(probe):
            for epoch, installed in ((None, False), (2, False), (3, True), (4, True)):
                engine = self._evicting()
                for filler in self._evict(engine, h.session("moved", epoch=3), path, "import"):
                    h.release(engine, filler)
                before = self._eviction_occupancy(engine)
                what = f"import at epoch {epoch or 2} over epoch 3 evicted through {path}"
                if not installed:
                    _raises_exactly(
                        StaleEpoch, partial(self._import_session, engine, snapshot, epoch), what
                    )
                    assert self._eviction_occupancy(engine) == before, f"{what} changed the engine"
                    continue
                assert epoch is not None
                try:
                    self._import_session(engine, snapshot, epoch)
                except ShardEngineError as error:
                    raise AssertionError(f"{what}: refused with {error!r}") from error
                here = h.session("moved", epoch=epoch)
                got = _rows(h.decode(engine, here, 4, (5,)))
                assert_matches(
                    got, want, exact=exact, tolerance=tolerance, what=f"decode after the {what}"
                )
                if epoch > 3:
                    _raises(
                        StaleEpoch,
                        partial(h.prefill, engine, h.session("moved", epoch=3), 0, (1,)),
                        f"a prefill at the evicted epoch 3 after the {what}",
                    )
        engine = h.load(kv_budget_tokens=12, max_context=16, max_batch_tokens=16)
        released = h.session("moved", epoch=3)
        h.prefill(engine, released, 0, (1, 2))
        h.release(engine, released)
        for epoch in (None, 3):
            _raises_exactly(
                StaleEpoch,
                partial(self._import_session, engine, snapshot, epoch),
                f"import at epoch {epoch or 2} over the tombstone of epoch 3",
            )
        assert engine.health().sessions == 0, "a refused import over a tombstone installed"
        self._import_session(engine, snapshot, 4)
        assert self._committed_length(engine, h.session("moved", epoch=4)) == 4

    # ================================================================= values

    def test_narrow_rows_round_the_f32_rows_to_nearest_even(self) -> None:
        """A head shard with bf16 (or f16) boundaries returns the f32 rows of the same
        computation rounded to nearest, ties to even (bit for bit when the engine is
        deterministic, else within its declared tolerance): prefill rows, decode rows and
        the rows of a batch; and a tail fed those narrow rows computes what it computes from
        the same values in f32. Every advertised narrow dtype is checked.

        Fix: convert with round-to-nearest-even from the f32 hidden states (for bf16: add
        0x7FFF plus the lowest kept bit, keep the upper 16 bits); never truncate, never round
        ties away from zero; on every path that builds a bundle."""
        h = self.harness
        self._need_layers(2, "a head shard")
        head_range, tail_range = split_ranges(h.n_layers, 2)
        wide_head = h.load(*head_range)
        sessions = [h.session("narrow-a"), h.session("narrow-b")]
        wide_rows = self._rows_of_every_path(wide_head, sessions)
        advertised = wide_head.capabilities().boundary_dtypes
        dtypes = [dtype for dtype in ("bf16", "f16") if dtype in advertised]
        if not dtypes:
            suite_skip("the engine advertises no narrow (bf16, f16) boundary dtype")
        for dtype in dtypes:
            narrow_head = h.load(*head_range, boundary_dtype=dtype)
            exact, tolerance = self._repeat_exactness(narrow_head.capabilities())
            narrow_rows = self._rows_of_every_path(narrow_head, sessions)
            for (label, wide), (_label, narrow) in zip(wide_rows, narrow_rows, strict=True):
                assert narrow.dtype == dtype, f"{dtype} {label}: the bundle says {narrow.dtype}"
                want = _nearest_even(np.asarray(wide.array(), np.float32), dtype)
                got = np.asarray(narrow.array(), np.float64)
                assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
                assert_matches(
                    got,
                    want,
                    exact=exact,
                    tolerance=tolerance,
                    kind="hidden",
                    what=f"{dtype} {label} vs the f32 rows rounded to nearest-even",
                )
            _label, narrow = narrow_rows[0]
            as_f32 = BoundaryBundle.from_array(
                np.asarray(narrow.array(), np.float32),
                session=narrow.session,
                first_pos=narrow.first_pos,
                layer=narrow.layer,
                model_fingerprint=narrow.model_fingerprint,
                dtype="f32",
            )
            wide_tail = h.load(*tail_range)
            narrow_tail = h.load(*tail_range, boundary_dtype=dtype)
            assert_matches(
                _rows(h.prefill(narrow_tail, sessions[0], 0, narrow, logits="all")),
                _rows(h.prefill(wide_tail, sessions[0], 0, as_f32, logits="all")),
                exact=exact,
                tolerance=tolerance,
                what=f"a tail fed {dtype} rows vs the same values in f32",
            )

    def _rows_of_every_path(
        self, head: ShardEngine, sessions: Sequence[SessionRef]
    ) -> list[tuple[str, BoundaryBundle]]:
        """The bundles ``head`` returns for two prefills, a decode and a batch (or a second
        decode) of ``sessions``, each with what it is."""
        h = self.harness
        bundles = [
            (
                f"prefill rows of session {index}",
                h.head_bundle(head, session, 0, h.tokens(9 + index, seed=3 + index)),
            )
            for index, session in enumerate(sessions)
        ]
        bundles.append(("a decode row", bundle_of(h.decode(head, sessions[0], 9, (2,)))))
        if not head.capabilities().features.batched_decode:
            bundles.append(("a decode row", bundle_of(h.decode(head, sessions[0], 10, (4,)))))
            return bundles
        items = [self._item(sessions[0], 10, (4,)), self._item(sessions[1], 10, (6,))]
        outcomes = self._batch(head, items).items
        for index, outcome in enumerate(outcomes):
            assert not isinstance(outcome, ErrorInfo), f"a batch of two live sessions: {outcome}"
            bundles.append((f"batch row {index}", bundle_of(outcome)))
        return bundles

    def test_empty_reserved_values_inside_bundles_refused(self) -> None:
        """A bundle whose reserved fields hold an empty value (``mtp=(MtpState(),)``,
        ``aux=(AuxState(name=""),)``) is UnsupportedFeature wherever a bundle is taken: on
        prefill, decode and in a batch item, of a tail and of a middle shard; nothing changes.

        Fix: run the bundle's reserved-field check (any non-empty tuple is refused, whatever
        its elements hold) on every path that takes a bundle, single rows included."""
        h = self.harness
        self._need_layers(2, "a bundle-taking shard")
        ranges = split_ranges(h.n_layers, 3 if h.n_layers >= 3 else 2)[1:]
        empties: list[tuple[str, dict[str, object]]] = [
            ("mtp=(MtpState(),)", {"mtp": (MtpState(),)}),
            ("aux=(AuxState(name=''),)", {"aux": (AuxState(name=""),)}),
        ]
        for start, end in ranges:
            upstream, engine = h.load(0, start), h.load(start, end)
            batched = engine.capabilities().features.batched_decode
            session = h.session(f"reserved-{start}")
            prompt = h.head_bundle(upstream, session, 0, h.tokens(3, seed=1))
            row = bundle_of(h.decode(upstream, session, 3, (2,)))
            for what, fields in empties:
                _raises_exactly(
                    UnsupportedFeature,
                    partial(h.prefill, engine, session, 0, replace_bundle(prompt, **fields)),
                    f"[{start}, {end}) prefill of a bundle with {what}",
                )
            assert engine.health().sessions == 0, "a refused bundle created a session"
            h.prefill(engine, session, 0, prompt)
            for what, fields in empties:
                stepped = replace_bundle(row, **fields)
                _raises_exactly(
                    UnsupportedFeature,
                    partial(h.decode, engine, session, 3, stepped),
                    f"[{start}, {end}) decode of a bundle with {what}",
                )
                if batched:
                    [outcome] = self._batch(engine, [self._item(session, 3, stepped)]).items
                    assert isinstance(outcome, ErrorInfo), f"a batch item with {what} served"
                    assert outcome.code == UnsupportedFeature.code, (
                        f"[{start}, {end}) batch item of a bundle with {what}: {outcome}"
                    )
            assert self._committed_length(engine, session) == 3
            h.decode(engine, session, 3, row)

    def test_retryable_at_every_contract_version_and_path(self) -> None:
        """``retryable`` is the contract's on the paths the other retryable test leaves: a
        bundle of the previous contract version, of version 0 and of the next one is
        ContractVersionMismatch retryable=False on prefill, decode and in a batch; a bad
        checksum is ChecksumMismatch retryable=True on each of them; the KV budget is
        retryable on a bundle-taking shard's prefill and decode and on an import.

        Fix: raise the contract's classes with their default retryable on every path (one
        check per field, shared by every operation); never decide retryable from the
        direction of a version difference."""
        h = self.harness
        self._need_layers(2, "a bundle-taking shard")
        head_range, tail_range = split_ranges(h.n_layers, 2)
        head = h.load(*head_range)
        tail = h.load(*tail_range, kv_budget_tokens=8, eviction="reject")
        batched = tail.capabilities().features.batched_decode
        session = h.session("v")
        prompt = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
        row = bundle_of(h.decode(head, session, 3, (1,)))
        versions = sorted({CONTRACT_VERSION - 1, 0, CONTRACT_VERSION + 1} - {CONTRACT_VERSION})
        cases: list[tuple[str, bool, BoundaryBundle, BoundaryBundle]] = [
            (
                f"contract version {version}",
                False,
                replace_bundle(prompt, contract_version=version),
                replace_bundle(row, contract_version=version),
            )
            for version in versions
            if version >= 0
        ]
        cases.append(
            (
                "checksum",
                True,
                replace_bundle(prompt, checksum=prompt.checksum ^ 1),
                replace_bundle(row, checksum=row.checksum ^ 1),
            )
        )
        checks: list[tuple[str, bool, Callable[[], object]]] = [
            (f"{what} on prefill", retry, partial(h.prefill, tail, session, 0, bad_prompt))
            for what, retry, bad_prompt, _row in cases
        ]
        self._check_retryable(checks)
        h.prefill(tail, session, 0, prompt)
        checks = [
            (f"{what} on decode", retry, partial(h.decode, tail, session, 3, bad_row))
            for what, retry, _prompt, bad_row in cases
        ]
        self._check_retryable(checks)
        for what, retry, _prompt, bad_row in cases if batched else []:
            [outcome] = self._batch(tail, [self._item(session, 3, bad_row)]).items
            assert isinstance(outcome, ErrorInfo), f"{what} in a batch: served"
            assert outcome.retryable == retry, (
                f"{what} in a batch: {outcome.code} retryable={outcome.retryable}, the "
                f"contract says {retry}"
            )
        assert self._committed_length(tail, session) == 3
        other = h.session("w")
        more = h.head_bundle(head, other, 0, h.tokens(5, seed=2))
        h.prefill(tail, other, 0, more)
        budget: list[tuple[str, bool, Callable[[], object]]] = [
            ("KV budget on a bundle prefill", True, partial(h.prefill, tail, session, 3, row))
        ]
        budget.append(
            ("KV budget on a bundle decode", True, partial(h.decode, tail, session, 3, row))
        )
        if tail.capabilities().features.session_migration:
            snapshot = self._export_session(tail, other)
            elsewhere = msgspec.structs.replace(snapshot, session=h.session("elsewhere"))
            budget.append(
                (
                    "KV budget on an import",
                    True,
                    partial(self._import_session, tail, elsewhere, None),
                )
            )
        self._check_retryable(budget)

    def _check_retryable(self, checks: Sequence[tuple[str, bool, Callable[[], object]]]) -> None:
        for what, retry, call in checks:
            error = _raises(ShardEngineError, call, what)
            assert error.retryable == retry, (
                f"{what}: {type(error).__name__} retryable={error.retryable}, the contract "
                f"says {retry}"
            )

    def test_session_ids_at_and_past_the_length_limit(self) -> None:
        """Session ids at the 256-character limit (multi-byte characters, NUL first, last and
        alone) are distinct sessions; an id one character past the limit (ASCII, 2- and
        4-byte characters, a NUL as its 257th character) is InvalidRequest on prefill,
        decode, a batch item, release, export and a cancel by session id, and changes
        nothing: not the session named by its first 256 characters, not the engine's
        sessions.

        Fix: count the id's characters (not bytes) and refuse an id over 256 at the edge,
        before any lookup; never cut it to a fixed-size key."""
        h = self.harness
        at_limit = [
            "\u00e9" * _ID_LIMIT,
            "\x00" + "\u00e9" * (_ID_LIMIT - 1),
            "\u00e9" * (_ID_LIMIT - 1) + "\x00",
            "\x00" * _ID_LIMIT,
            "\U0001f600" * (_ID_LIMIT - 1) + "\x00",
            "a" * _ID_LIMIT,
        ]
        engine = h.load(max_sessions=len(at_limit))
        caps = engine.capabilities()
        sessions = [SessionRef(session_id=sid, epoch=1) for sid in at_limit]
        for index, session in enumerate(sessions):
            h.prefill(engine, session, 0, h.tokens(1 + index, seed=index))
        assert engine.health().sessions == len(at_limit), (
            f"{len(at_limit)} distinct ids at the length limit made {engine.health().sessions} "
            "sessions"
        )
        for index, session in enumerate(sessions):
            assert self._committed_length(engine, session) == 1 + index
        past = [
            ("a" * (_ID_LIMIT + 1), 5),
            ("\u00e9" * (_ID_LIMIT + 1), 0),
            ("\U0001f600" * (_ID_LIMIT - 1) + "\x00\x00", 4),
            ("\x00" * (_ID_LIMIT + 1), 3),
        ]
        before = (engine.health().sessions, engine.health().kv_used_tokens)
        for session_id, prefix_index in past:
            overlong = _overlong(sessions[0], session_id)
            label = f"an id of {len(session_id)} characters ({session_id[:2]!r}...)"
            calls: list[tuple[str, Callable[[], object]]] = [
                ("prefill", partial(h.prefill, engine, overlong, 0, (1,))),
                (
                    "decode",
                    partial(h.decode, engine, overlong, 1 + prefix_index, (1,)),
                ),
                ("release", partial(h.release, engine, overlong)),
                (
                    "cancel by session id",
                    partial(
                        engine.cancel,
                        _overlong_cancel(session_id),
                    ),
                ),
            ]
            if caps.features.session_migration:
                calls.append(("export", partial(self._export_session, engine, overlong)))
            for what, call in calls:
                _raises(InvalidRequest, call, f"{what} with {label}")
            if caps.features.batched_decode:
                item = self._item(sessions[0], 1, (1,))
                msgspec.structs.force_setattr(item, "session", overlong)
                try:
                    batch = engine.decode_batch(
                        DecodeBatchRequest(request_id=h.request_id(), items=(item,))
                    )
                except InvalidRequest:
                    pass
                else:
                    [outcome] = batch.items
                    assert isinstance(outcome, ErrorInfo), f"a batch item with {label} served"
                    assert outcome.code == InvalidRequest.code, (
                        f"a batch item with {label}: {outcome}"
                    )
            assert (engine.health().sessions, engine.health().kv_used_tokens) == before, (
                f"requests with {label} changed the engine's sessions or KV use"
            )
            length = self._committed_length(engine, sessions[prefix_index])
            assert length == 1 + prefix_index, (
                f"requests with {label} changed the session named by its first 256 "
                f"characters: committed length {length}, was {1 + prefix_index}"
            )

    # ================================================================= in flight

    def test_request_id_reused_in_flight_on_every_path(self) -> None:
        """While a prefill runs (slowed by the fixture's cancellation options), its request
        id reused by a prefill of another session, as a batch's own id and by a batch item
        is refused (InvalidRequest, or an InvalidRequest item), served on its own or, when
        still queued, cancelled too (the cancel names its id); a cancel by the id still
        reaches the first, which returns Cancelled and changes nothing; the other session is
        as the served duplicates left it.

        Fix: one registration per in-flight request id for every operation (prefill, decode,
        batch): refuse a duplicate before registering it and never let its end (or its
        refusal) remove the first one's registration."""
        h = self.harness
        engine = self._slow()
        if not engine.capabilities().features.cancel:
            suite_skip("engine does not advertise cancel")
        for attempt in range(4):
            first, second = h.session(f"first-{attempt}"), h.session(f"second-{attempt}")
            h.prefill(engine, second, 0, h.tokens(3, seed=2))
            shared = h.request_id()
            outcome: dict[str, object] = {}
            worker = threading.Thread(
                target=partial(self._prefill_into, engine, first, shared, outcome), daemon=True
            )
            worker.start()
            _wait_until(partial(_running, engine, worker))
            # A duplicate may be served: then it waits for the first, on a thread of its own.
            duplicates = threading.Thread(
                target=partial(self._send_duplicates, engine, second, shared, outcome),
                daemon=True,
            )
            duplicates.start()
            _wait_until(partial(_queued_or_done, engine, duplicates))
            cancel = engine.cancel(CancelRequest(request_id=shared))
            for thread in (worker, duplicates):
                thread.join(timeout=30.0)
                assert not thread.is_alive(), "a request did not return in 30 s"
            result = outcome.get("result")
            served = outcome.get("served")
            assert isinstance(served, int), f"sending the duplicates failed: {served!r}"
            assert self._committed_length(engine, second) == 3 + served, (
                f"the other session after {served} served duplicates"
            )
            if not cancel.cancelled:
                assert isinstance(result, BoundaryResult | LogitsResult), (
                    f"the first request returned {result!r}"
                )
                h.release(engine, first)
                continue  # the first ended before the cancel: try again
            assert isinstance(result, Cancelled), (
                f"a cancel by the reused id said cancelled=True, the first returned {result!r}"
            )
            assert engine.health().in_flight == 0
            assert self._committed_length(engine, first) == 0, "a cancelled prefill committed"
            return
        h.no_cancel_landed(
            "a cancel by a request id reused (by a prefill, a batch, a batch item) never "
            "reached the first request with it"
        )

    def _prefill_into(
        self, engine: ShardEngine, session: SessionRef, request_id: str, out: dict[str, object]
    ) -> None:
        h = self.harness
        try:
            out["result"] = h.prefill(
                engine, session, 0, h.tokens(4, seed=1), request_id=request_id
            )
        except ShardEngineError as error:
            out["result"] = error

    def _send_duplicates(
        self, engine: ShardEngine, second: SessionRef, shared: str, out: dict[str, object]
    ) -> None:
        """Send requests on ``second`` reusing ``shared``: a prefill, a batch with that id
        and a batch item with it; ``out["served"]``: the positions the served ones added."""
        h = self.harness
        served = 0
        try:
            try:
                h.prefill(engine, second, 3, (1,), request_id=shared)
                served += 1
            except (InvalidRequest, Cancelled):
                pass
            if engine.capabilities().features.batched_decode:
                for batch_id, item_id in ((shared, h.request_id()), (h.request_id(), shared)):
                    item = msgspec.structs.replace(
                        self._item(second, 3 + served, (2,)), request_id=item_id
                    )
                    try:
                        batch = engine.decode_batch(
                            DecodeBatchRequest(request_id=batch_id, items=(item,))
                        )
                    except (InvalidRequest, Cancelled):
                        continue
                    [outcome] = batch.items
                    if isinstance(outcome, ErrorInfo):
                        assert outcome.code in (InvalidRequest.code, Cancelled.code), (
                            f"a batch item reusing an in-flight id: {outcome}"
                        )
                    else:
                        served += 1
            out["served"] = served
        except Exception as error:  # noqa: BLE001 - judged by the test's thread
            out["served"] = error

    def test_release_while_a_decode_runs_keeps_the_others(self) -> None:
        """A release arriving while a decode of the session runs (slowed by the fixture's
        cancellation options) has a typed outcome for both calls; when the release says
        released, the session is fenced and counts no position; other sessions keep their
        lengths and their next outputs equal a clean run's.

        Fix: serialise release with the session's running operations (EngineCore's compute
        lock); a commit after a release must not revive the session, and a release frees
        only that session's slot."""
        h = self.harness
        engine = self._slow()
        exact, tolerance = self._isolation_exactness(engine.capabilities())
        clean = h.load()
        bystander = h.session("bystander")
        for target in (engine, clean):
            h.prefill(target, bystander, 0, h.tokens(4, seed=3))
        session = h.session("released")
        h.prefill(engine, session, 0, h.tokens(3, seed=1))
        outcome: dict[str, object] = {}

        def run() -> None:
            try:
                outcome["decode"] = h.decode(engine, session, 3, (5,))
            except ShardEngineError as error:
                outcome["decode"] = error

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        _wait_until(partial(_running, engine, worker))
        released = h.release(engine, session)
        worker.join(timeout=30.0)
        assert not worker.is_alive(), "the decode did not return in 30 s"
        assert isinstance(outcome.get("decode"), ShardEngineError | BoundaryResult | LogitsResult)
        assert released.released, f"releasing a live session said {released}"
        _raises(
            StaleEpoch,
            partial(h.decode, engine, session, 4, (1,)),
            f"a decode of the session released while its decode ran ({outcome})",
        )
        health = engine.health()
        assert (health.sessions, health.kv_used_tokens, health.in_flight) == (1, 4, 0), (
            f"after a release during a running decode ({outcome}), with one 4-position "
            f"session left: {health}"
        )
        assert self._committed_length(engine, bystander) == 4
        assert_matches(
            _rows(h.decode(engine, bystander, 4, (7,))),
            _rows(h.decode(clean, bystander, 4, (7,))),
            exact=exact,
            tolerance=tolerance,
            what="the other session's decode after a release during a running decode",
        )

    # ================================================================= time and load

    def test_timings_of_batches_and_imports_against_the_wall_clock(self) -> None:
        """No timing exceeds the wall clock of its own call (plus 1 ms): the items of a
        batch (each reports the batch's forward at most, never a sum over the items), an
        import right after a slow call (it reports its own time, less than the slow call's
        when it took less by the clock), and the decode after it.

        Fix: measure each call on time.perf_counter from its own start; give every item of a
        batch the batch's timings; never carry a previous call's timer over."""
        h = self.harness
        engine = self._slow()
        caps = engine.capabilities()
        sessions = [h.session(f"timed-{index}") for index in range(3)]
        for index, session in enumerate(sessions):
            h.prefill(engine, session, 0, h.tokens(2 + index, seed=index))
        if caps.features.batched_decode:
            items = [self._item(s, 2 + index, (1,)) for index, s in enumerate(sessions)]
            started = time.perf_counter()
            batch = self._batch(engine, items)
            wall = (time.perf_counter() - started) * 1000.0
            for index, outcome in enumerate(batch.items):
                assert not isinstance(outcome, ErrorInfo), f"batch item {index}: {outcome}"
                for name in ("total_ms", "compute_ms", "queue_ms"):
                    value = getattr(outcome.timings, name)
                    assert value <= wall + _WALL_SLACK_MS, (
                        f"batch item {index}: timings.{name} is {value:.3f} ms, the batch took "
                        f"{wall:.3f} ms by the wall clock"
                    )
        if not caps.features.session_migration:
            return
        snapshot = self._export_session(engine, sessions[0])
        started = time.perf_counter()
        slow = h.prefill(engine, h.session("slow"), 0, h.tokens(6, seed=5))
        slow_wall = (time.perf_counter() - started) * 1000.0
        started = time.perf_counter()
        result = self._import_session(engine, snapshot, sessions[0].epoch + 1)
        wall = (time.perf_counter() - started) * 1000.0
        timings = getattr(result, "timings")  # noqa: B009 - ImportSessionResult.timings
        for name in ("total_ms", "compute_ms", "queue_ms"):
            value = getattr(timings, name)
            assert value <= wall + _WALL_SLACK_MS, (
                f"an import right after a call of {slow_wall:.1f} ms (compute_ms "
                f"{slow.timings.compute_ms:.1f}): timings.{name} is {value:.3f} ms, the import "
                f"took {wall:.3f} ms by the wall clock"
            )

    def test_loads_after_refused_loads_of_every_kind(self) -> None:
        """Loads refused for every reason an engine checks (a model that does not exist, a
        layer count the model does not have, an option the engine does not know) each leave
        the engine unloaded (health "unloaded", capabilities NotReady); a load after them
        succeeds with its own settings (not a refused load's) and serves as a fresh engine.

        Fix: validate and open everything before changing state; on any refusal release what
        was opened and return to the initial state, whatever the reason."""
        h = self.harness
        engine = h.new_engine()
        good = h.config(max_context=24)
        shard = good.shard
        refusals = [
            (
                "a model that does not exist",
                msgspec.structs.replace(
                    good, shard=msgspec.structs.replace(shard, model=f"{shard.model}.missing")
                ),
            ),
            (
                "a layer count the model does not have",
                msgspec.structs.replace(
                    good,
                    max_context=40,
                    shard=msgspec.structs.replace(
                        shard, end=shard.n_layers + 1, n_layers=shard.n_layers + 1
                    ),
                ),
            ),
            (
                "an unknown option",
                msgspec.structs.replace(
                    good, max_context=48, options={**good.options, "no-such-option": 1}
                ),
            ),
        ]
        refused = 0
        for what, config in refusals:
            try:
                engine.load(config)
            except ShardEngineError:
                refused += 1
            else:
                engine = h.new_engine()  # it accepted this one: go on with a fresh engine
                continue
            assert engine.health().state == "unloaded", (
                f"after a load refused for {what}, health says {engine.health().state!r}"
            )
            _raises(
                NotReady, engine.capabilities, f"capabilities() after a load refused for {what}"
            )
        if not refused:
            suite_skip("the engine refused none of the loads this test tries")
        caps = engine.load(good)
        h.note_capabilities(caps)
        assert caps.limits.max_context <= 24, (
            f"a load of max_context 24 after refused loads reports {caps.limits.max_context}"
        )
        exact, tolerance = self._repeat_exactness(caps)
        tokens = h.tokens(4, seed=1)
        assert_matches(
            _rows(h.prefill(engine, h.session("a"), 0, tokens)),
            _rows(h.prefill(h.load(max_context=24), h.session("a"), 0, tokens)),
            exact=exact,
            tolerance=tolerance,
            what="a prefill after refused loads",
        )

    def test_newer_epoch_refused_on_every_path_keeps_the_older(self) -> None:
        """A newer epoch whose first request is refused leaves the live older epoch as it
        was (length, health, next decode equal to a clean run), on every path: a prefill
        leaving a gap (CacheMiss), a prefill past max_context, a prefill with reserved
        values, a decode and a batch item at the newer epoch (CacheMiss), a corrupted
        snapshot imported under it; the newer epoch can start afterwards.

        Fix: drop the older epoch's state only when the newer epoch's first operation
        commits (EngineCore replaces it at the commit point)."""
        h = self.harness
        engine = h.load(max_context=12)
        caps = engine.capabilities()
        exact, tolerance = self._shape_exactness(caps)
        old, new = h.session("s", epoch=1), h.session("s", epoch=2)
        tokens = h.tokens(5, seed=1)
        h.prefill(engine, old, 0, tokens)
        attempts: list[tuple[str, Callable[[], object]]] = [
            ("a prefill leaving a gap", partial(h.prefill, engine, new, 2, (1,))),
            (
                "a prefill past max_context",
                partial(h.prefill, engine, new, 0, h.tokens(caps.limits.max_context + 1, seed=2)),
            ),
            (
                "a prefill with reserved values",
                partial(
                    engine.prefill,
                    PrefillRequest(
                        request_id=h.request_id(),
                        session=new,
                        start_pos=0,
                        inputs=TokenInput(token_ids=(1,)),
                        mtp=(MtpState(n_draft_tokens=1),),
                    ),
                ),
            ),
            ("a decode", partial(h.decode, engine, new, 0, (1,))),
        ]
        if caps.features.session_migration:
            snapshot = self._export_session(engine, old)
            corrupted = msgspec.structs.replace(snapshot, checksum=snapshot.checksum ^ 1)
            attempts.append(
                ("a corrupted import", partial(self._import_session, engine, corrupted, new.epoch))
            )
        health = engine.health()
        occupancy = (health.sessions, health.kv_used_tokens)
        for what, call in attempts:
            _raises(ShardEngineError, call, f"epoch 2's first request ({what})")
            self._assert_older_intact(engine, old, occupancy, what)
        if caps.features.batched_decode:
            [outcome] = self._batch(engine, [self._item(new, 0, (1,))]).items
            assert isinstance(outcome, ErrorInfo), (
                f"a batch item at a newer epoch with no prefill was served: {outcome}"
            )
            self._assert_older_intact(engine, old, occupancy, "a batch item")
        clean = h.load(max_context=12)
        h.prefill(clean, old, 0, tokens)
        assert_matches(
            _rows(h.decode(engine, old, 5, (3,))),
            _rows(h.decode(clean, old, 5, (3,))),
            exact=exact,
            tolerance=tolerance,
            what="the older epoch's decode after refused newer-epoch requests",
        )
        h.prefill(engine, new, 0, (1,))
        _raises(StaleEpoch, partial(h.decode, engine, old, 6, (1,)), "epoch 1 after epoch 2")

    def _assert_older_intact(
        self, engine: ShardEngine, old: SessionRef, occupancy: tuple[int, int], what: str
    ) -> None:
        length = self._committed_length(engine, old)
        assert length == 5, f"after {what} at epoch 2 the live epoch 1 has {length} positions"
        health = engine.health()
        assert (health.sessions, health.kv_used_tokens) == occupancy, (
            f"after {what} at epoch 2: {health}, was (sessions, KV) {occupancy}"
        )


def _overlong_cancel(session_id: str) -> CancelRequest:
    request = CancelRequest(session_id="x")
    msgspec.structs.force_setattr(request, "session_id", session_id)
    return request


def _running(engine: ShardEngine, worker: threading.Thread) -> bool:
    """The engine has a request in flight, or ``worker`` (which sent it) has ended."""
    return engine.health().in_flight >= 1 or not worker.is_alive()


def _queued_or_done(engine: ShardEngine, worker: threading.Thread) -> bool:
    """A second request is in flight beside the first (queued behind it), or ``worker``
    (which sends it) has ended."""
    return engine.health().in_flight >= 2 or not worker.is_alive()
