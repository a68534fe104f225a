"""The session migration standard tests: an engine that advertises
``Features.session_migration`` must move sessions exactly, fence epochs, refuse what it cannot
install and change nothing when it refuses, fails or is cancelled. Every test is skipped, with
the reason, for an engine that does not advertise the feature. :class:`ShardEngineConformance`
inherits them (their names are pinned in :data:`MIGRATION_TESTS`, part of the standard tests).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Final

import msgspec
import numpy as np

from shard_engine_api import _codec
from shard_engine_api._errors import (
    CacheMiss,
    Cancelled,
    ChecksumMismatch,
    ContractVersionMismatch,
    InvalidRequest,
    ResourceExhausted,
    ShardEngineError,
    ShardMismatch,
    StaleEpoch,
    UnsupportedFeature,
)
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    CONTRACT_VERSION,
    SNAPSHOT_CHUNK_BYTES,
    BoundaryBundle,
    CancelRequest,
    Capabilities,
    ExportSessionRequest,
    ImportSessionRequest,
    ImportSessionResult,
    OutputKind,
    PrefillRequest,
    SessionRef,
    SessionSnapshot,
    ShardInput,
    TokenInput,
)
from shard_engine_api.conformance._harness import (
    _PROMPT,
    SuiteHelpers,
    Tolerances,
    _rows,
    assert_matches,
    bundle_of,
    split_ranges,
)
from shard_engine_api.conformance._recorder import suite_skip

__all__ = ["MIGRATION_TESTS", "MigrationTests"]

MIGRATION_TESTS: Final[tuple[str, ...]] = (
    "test_migration_atomic_under_budget_pressure",
    "test_migration_cancelled_import_and_export",
    "test_migration_continues_exactly_every_role",
    "test_migration_corrupted_or_truncated_snapshot",
    "test_migration_epoch_fencing",
    "test_migration_failed_import_is_atomic",
    "test_migration_metrics_and_health",
    "test_migration_mismatched_snapshot",
    "test_migration_source_unchanged",
)
"""The migration tests, sorted (part of STANDARD_TESTS)."""

_STEPS: Final = 3


@dataclass(frozen=True, slots=True)
class _Feed:
    """The inputs of a shard ``[start, end)`` at every position of ``tokens``: token ids for a
    token-taking shard, else the rows a fresh upstream shard computed over all of them,
    re-addressed to the session and positions they are sent for."""

    tokens: tuple[int, ...]
    bundle: BoundaryBundle | None

    def at(self, session: SessionRef, first: int, stop: int) -> ShardInput:
        if self.bundle is None:
            return TokenInput(token_ids=self.tokens[first:stop])
        rows = np.array(self.bundle.array()[first:stop])
        return BoundaryBundle.from_array(
            rows,
            session=session,
            first_pos=first,
            layer=self.bundle.layer,
            model_fingerprint=self.bundle.model_fingerprint,
            dtype=self.bundle.dtype,
        )


class MigrationTests(SuiteHelpers):
    """The session migration standard tests (see the module docstring)."""

    def _migrating(
        self, start: int = 0, end: int | None = None, **overrides: object
    ) -> ShardEngine:
        h = self.harness
        engine = h.load(start, end, **overrides)
        if not engine.capabilities().features.session_migration:
            # The README's rule for an engine without the feature: both operations refused.
            self._expect(
                UnsupportedFeature,
                partial(self._export, engine, h.session("unmigrated")),
                "export_session on an engine that does not advertise session_migration",
            )
            suite_skip(
                "engine does not advertise session migration (features.session_migration; "
                "export_session is refused with UnsupportedFeature)"
            )
        return engine

    def _feed(self, start: int, tokens: tuple[int, ...], **overrides: object) -> _Feed:
        h = self.harness
        if start == 0:
            return _Feed(tokens, None)
        upstream = h.load(0, start, max_batch_tokens=64, **overrides)
        scratch = SessionRef(session_id=f"upstream-{h.request_id()}", epoch=1)
        bundle = bundle_of(h.prefill(upstream, scratch, 0, TokenInput(token_ids=tokens)))
        return _Feed(tokens, bundle)

    def _export(self, engine: ShardEngine, session: SessionRef) -> SessionSnapshot:
        snapshot = engine.export_session(
            ExportSessionRequest(request_id=self.harness.request_id(), session=session)
        )
        assert isinstance(snapshot, SessionSnapshot), f"export returned {snapshot!r}"
        _assert_chunked(snapshot)
        return snapshot

    def _import(
        self,
        engine: ShardEngine,
        snapshot: SessionSnapshot,
        epoch: int | None = None,
        request_id: str | None = None,
    ) -> ImportSessionResult:
        rid = self.harness.request_id() if request_id is None else request_id
        return engine.import_session(
            ImportSessionRequest(request_id=rid, snapshot=snapshot, epoch=epoch)
        )

    @staticmethod
    def _through_the_codec(snapshot: SessionSnapshot) -> SessionSnapshot:
        decoded = _codec.decode_message(_codec.encode(snapshot))
        assert isinstance(decoded, SessionSnapshot), f"decoded {type(decoded).__name__}"
        assert decoded == snapshot, "a snapshot changed in an encode/decode round trip"
        return decoded

    def _occupancy(self, engine: ShardEngine) -> tuple[int, int, int, int]:
        health, metrics = engine.health(), engine.metrics()
        return (health.sessions, health.kv_used_tokens, metrics.sessions_active, metrics.imports)

    def _length(self, engine: ShardEngine, session: SessionRef) -> int | str:
        """The committed length as a decode far ahead reports it, or the error code."""
        h = self.harness
        caps = engine.capabilities()
        probe = caps.limits.max_context - 1
        row: ShardInput = TokenInput(token_ids=(0,))
        if not caps.shard.takes_tokens:
            row = BoundaryBundle.from_array(
                np.zeros((1, caps.hidden_size), np.float32),
                session=session,
                first_pos=probe,
                layer=caps.shard.start,
                model_fingerprint=caps.model_fingerprint,
                dtype=caps.boundary_dtype or caps.boundary_dtypes[0],
            )
        try:
            h.decode(engine, session, probe, row)
        except CacheMiss as miss:
            return miss.committed_length if miss.reason == "position_mismatch" else miss.reason
        except ShardEngineError as error:
            return error.code
        raise AssertionError(f"a decode of {session.session_id} at {probe} did not miss")

    def _moved_exactness(self, caps: Capabilities) -> tuple[bool, Tolerances, OutputKind]:
        """A moved session vs. the unmoved run: bit-exact when the engine declares
        deterministic; else within its declared tolerance for what the shard returns."""
        tolerances = Tolerances.declared(caps.determinism, self.harness.record)
        kind: OutputKind = "logits" if caps.role in ("tail", "full") else "hidden"
        return caps.determinism.deterministic, tolerances, kind

    def _expect(
        self, expected: type[ShardEngineError], call: Callable[[], object], what: str
    ) -> ShardEngineError:
        """Run ``call``; it must raise ``expected`` (or a subclass). Say what came instead."""
        try:
            outcome = call()
        except ShardEngineError as error:
            if isinstance(error, expected):
                return error
            raise AssertionError(
                f"{what}: expected {expected.__name__} (code {expected.code!r}), got "
                f"{type(error).__name__} (code {error.code!r}): {error}"
            ) from error
        raise AssertionError(f"{what}: expected {expected.__name__}, it returned {outcome!r}")

    def _prefilled(
        self, engine: ShardEngine, feed: _Feed, session: SessionRef, length: int
    ) -> None:
        self.harness.prefill(engine, session, 0, feed.at(session, 0, length))

    def test_migration_continues_exactly_every_role(self) -> None:
        """A session prefilled and decoded on one engine, exported, sent through the wire
        codec and imported under a newer epoch into another engine of the same shard (head,
        middle, tail and full) continues there exactly as on an engine it never left: every
        later decode equals the unmoved run's (bit for bit when the engine is deterministic),
        and a session already live on the target is not disturbed. Every snapshot the suite
        exports (in every migration test) is chunked as transports stream it: each chunk but
        the last holds exactly SNAPSHOT_CHUNK_BYTES, none is empty.

        Fix: export every per-position state of the session's layers (the KV cache, any
        recurrent state) and install it unchanged; decode after import must read exactly the
        positions 0..length-1 the snapshot carries; cut the state with split_chunks."""
        h = self.harness
        self._migrating()
        n = h.n_layers
        ranges = [(0, n)]
        if n >= 3:
            ranges += split_ranges(n, 3)
        elif n == 2:
            ranges += split_ranges(n, 2)
        tokens = h.tokens(_PROMPT + _STEPS + 1, seed=11)
        for start, end in ranges:
            source = self._migrating(start, end)
            exact, tolerance, kind = self._moved_exactness(source.capabilities())
            unmoved = h.load(start, end)
            target = h.load(start, end)
            feed = self._feed(start, tokens)
            session = h.session(f"moving-{start}-{end}", epoch=2)
            bystander = h.session(f"bystander-{start}-{end}")
            self._prefilled(target, feed, bystander, _PROMPT)
            for engine in (source, unmoved):
                self._prefilled(engine, feed, session, _PROMPT)
                h.decode(engine, session, _PROMPT, feed.at(session, _PROMPT, _PROMPT + 1))
            snapshot = self._through_the_codec(self._export(source, session))
            assert snapshot.length == _PROMPT + 1, (
                f"snapshot of [{start}, {end}) says length {snapshot.length}, the session has "
                f"{_PROMPT + 1} positions"
            )
            moved = SessionRef(session_id=session.session_id, epoch=3)
            result = self._import(target, snapshot, epoch=3)
            assert (result.session, result.length) == (moved, _PROMPT + 1), (
                f"import answered {result.session} length {result.length}"
            )
            for pos in range(_PROMPT + 1, _PROMPT + 1 + _STEPS):
                want = _rows(h.decode(unmoved, session, pos, feed.at(session, pos, pos + 1)))
                got = _rows(h.decode(target, moved, pos, feed.at(moved, pos, pos + 1)))
                assert_matches(
                    got,
                    want,
                    exact=exact,
                    tolerance=tolerance,
                    kind=kind,
                    what=f"decode at {pos} after moving a session of [{start}, {end})",
                )
            assert self._length(target, bystander) == _PROMPT, (
                "importing a session changed another session's committed length"
            )

    def test_migration_source_unchanged(self) -> None:
        """``export_session`` changes nothing on the source: occupancy, committed length and
        later outputs are as if it had not been called, and it is not a use for LRU (with
        eviction "lru", the exported session is still the first evicted).

        Fix: read the state without touching the slot or the ledger (no truncation, no
        commit, no last-use update)."""
        h = self.harness
        source = self._migrating()
        exact, tolerance, kind = self._moved_exactness(source.capabilities())
        clean = h.load()
        tokens = h.tokens(_PROMPT + 2, seed=3)
        feed = self._feed(0, tokens)
        session = h.session("a")
        for engine in (source, clean):
            self._prefilled(engine, feed, session, _PROMPT)
        before = self._occupancy(source)
        self._export(source, session)
        self._export(source, session)
        assert self._occupancy(source) == before, (
            f"export changed occupancy: {before} -> {self._occupancy(source)}"
        )
        assert self._length(source, session) == _PROMPT
        want = _rows(h.decode(clean, session, _PROMPT, feed.at(session, _PROMPT, _PROMPT + 1)))
        got = _rows(h.decode(source, session, _PROMPT, feed.at(session, _PROMPT, _PROMPT + 1)))
        assert_matches(
            got, want, exact=exact, tolerance=tolerance, kind=kind, what="decode after export"
        )
        lru = h.load(kv_budget_tokens=12, eviction="lru")
        if not lru.capabilities().features.eviction:
            return
        oldest, recent = h.session("oldest"), h.session("recent")
        self._prefilled(lru, feed, oldest, 5)
        self._prefilled(lru, feed, recent, 5)
        self._export(lru, oldest)
        self._prefilled(lru, feed, h.session("new"), 5)
        assert self._length(lru, oldest) == "evicted", (
            "after exporting the least recently used session, a new admission evicted another "
            "one: export must not count as a use"
        )
        assert self._length(lru, recent) == 5

    def test_migration_epoch_fencing(self) -> None:
        """Export reads exactly the live epoch: a newer epoch (not prefilled) is CacheMiss
        "new_epoch" with committed length 0, an older one StaleEpoch, an unknown session
        CacheMiss "unknown_session", a released epoch (or an older one) StaleEpoch. Import
        follows the fences: an epoch older than, or equal to, the live one is StaleEpoch
        (nothing changed); a newer one replaces the live session (older epochs are then
        StaleEpoch); a released epoch (tombstone) and older ones are StaleEpoch, a newer one
        is installed; ``epoch`` below the snapshot's own is InvalidRequest.

        Fix: export under decode's rules (same epoch only: a newer epoch has no state yet);
        run import through the same fence rule as prefill, strict for live state; check the
        tombstones (for export too: a released epoch is StaleEpoch, not CacheMiss); install
        under ``request.epoch`` when given."""
        h = self.harness
        source = self._migrating()
        tokens = h.tokens(_PROMPT, seed=5)
        feed = self._feed(0, tokens)
        session = h.session("f", epoch=5)
        self._prefilled(source, feed, session, _PROMPT)
        for ref, reason in ((h.session("f", epoch=6), "new_epoch"), (h.session("nf"), None)):
            miss = self._expect(
                CacheMiss,
                partial(self._export, source, ref),
                f"export of {ref.session_id} at epoch {ref.epoch} (live: epoch 5 of f)",
            )
            assert isinstance(miss, CacheMiss)
            assert miss.committed_length == 0, f"export miss says {miss.committed_length}"
            assert reason is None or miss.reason == reason, f"export miss reason {miss.reason}"
        self._expect(
            StaleEpoch,
            partial(self._export, source, h.session("f", epoch=4)),
            "export at epoch 4 of a session live at epoch 5",
        )
        assert self._length(source, session) == _PROMPT, "a refused export changed the session"
        snapshot = self._export(source, session)
        target = h.load()
        live = h.session("f", epoch=6)
        self._prefilled(target, feed, live, 2)
        for epoch in (None, 6):
            self._expect(
                StaleEpoch,
                partial(self._import, target, snapshot, epoch),
                f"import at epoch {epoch or 5} over live epoch 6",
            )
        assert self._length(target, live) == 2, "a refused import changed the live session"
        self._expect(
            InvalidRequest,
            lambda: self._import(target, snapshot, epoch=4),
            "import under an epoch older than the snapshot's",
        )
        result = self._import(target, snapshot, epoch=7)
        assert result.replaced, "importing over an older live epoch must say it replaced it"
        assert self._length(target, h.session("f", epoch=7)) == _PROMPT
        assert (target.health().sessions, target.health().kv_used_tokens) == (1, _PROMPT), (
            "the replaced epoch still occupies a session or KV positions"
        )
        self._expect(
            StaleEpoch,
            lambda: h.prefill(target, live, 0, feed.at(live, 0, 1)),
            "a prefill at the replaced epoch",
        )
        h.release(target, h.session("f", epoch=7))
        for epoch in (7, 6):
            self._expect(
                StaleEpoch,
                partial(self._export, target, h.session("f", epoch=epoch)),
                f"export at epoch {epoch} after epoch 7 was released (its tombstone)",
            )
        for epoch in (None, 7):
            self._expect(
                StaleEpoch,
                partial(self._import, target, snapshot, epoch),
                f"import at epoch {epoch or 5} after epoch 7 was released",
            )
        assert target.health().sessions == 0
        assert self._import(target, snapshot, epoch=8).session.epoch == 8

    def test_migration_mismatched_snapshot(self) -> None:
        """A snapshot made for another layer range, boundary dtype or result-affecting
        settings (here: another max_context), or claiming another engine, engine version or
        model fingerprint, is ShardMismatch; another contract version is
        ContractVersionMismatch. Nothing is installed.

        Fix: compare engine, version, model fingerprint, layer range, boundary dtype and the
        settings fingerprint before touching any state (EngineCore does)."""
        h = self.harness
        source = self._migrating()
        caps = source.capabilities()
        tokens = h.tokens(_PROMPT, seed=6)
        session = h.session("m")
        self._prefilled(source, self._feed(0, tokens), session, _PROMPT)
        snapshot = self._export(source, session)
        targets: list[tuple[str, ShardEngine, SessionSnapshot]] = [
            ("another max_context", h.load(max_context=caps.limits.max_context // 2), snapshot)
        ]
        if h.n_layers >= 2:
            targets.append(("another layer range", h.load(0, h.n_layers - 1), snapshot))
        other_dtypes = [d for d in caps.boundary_dtypes if d != caps.boundary_dtype]
        if other_dtypes and h.n_layers >= 2:
            targets.append(
                (
                    f"boundary dtype {other_dtypes[0]}",
                    h.load(0, h.n_layers - 1, boundary_dtype=other_dtypes[0]),
                    self._head_snapshot(session, tokens),
                )
            )
        target = h.load()
        for field, value in (
            ("engine", caps.engine + "-other"),
            ("engine_version", caps.engine_version + "-other"),
            ("model_fingerprint", "0" * 16),
            ("settings_fingerprint", "f" * 32),
        ):
            targets.append(
                (f"another {field}", target, msgspec.structs.replace(snapshot, **{field: value}))
            )
        for what, engine, sent in targets:
            before = self._occupancy(engine)
            self._expect(ShardMismatch, partial(self._import, engine, sent), what)
            assert self._occupancy(engine) == before, f"a refused import ({what}) changed state"
        foreign = msgspec.structs.replace(snapshot, contract_version=CONTRACT_VERSION + 1)
        self._expect(ContractVersionMismatch, lambda: self._import(target, foreign), "version")
        assert target.health().sessions == 0

    def _head_snapshot(self, session: SessionRef, tokens: tuple[int, ...]) -> SessionSnapshot:
        h = self.harness
        head = h.load(0, h.n_layers - 1)
        self._prefilled(head, self._feed(0, tokens), session, _PROMPT)
        return self._export(head, session)

    def test_migration_corrupted_or_truncated_snapshot(self) -> None:
        """A snapshot whose state was corrupted (one bit), truncated (a chunk or bytes
        missing) or extended is ChecksumMismatch, at the engine and at the codec; a chunk
        above SNAPSHOT_CHUNK_BYTES is InvalidRequest; state that checks out but holds other
        positions than the snapshot's length says is InvalidRequest. Nothing is installed.

        Fix: verify ``state_bytes`` and the checksum before installing; make the backend
        check that the state it is given holds exactly ``length`` positions."""
        h = self.harness
        source = self._migrating()
        tokens = h.tokens(_PROMPT, seed=7)
        feed = self._feed(0, tokens)
        session, short = h.session("c"), h.session("short")
        self._prefilled(source, feed, session, _PROMPT)
        self._prefilled(source, feed, short, _PROMPT - 2)
        snapshot = self._export(source, session)
        state = b"".join(snapshot.chunks)
        flipped = bytearray(state)
        flipped[len(flipped) // 2] ^= 0x04
        bad: list[tuple[str, SessionSnapshot]] = [
            ("one bit flipped", msgspec.structs.replace(snapshot, chunks=(bytes(flipped),))),
            ("bytes missing", msgspec.structs.replace(snapshot, chunks=(state[:-3],))),
            ("bytes appended", msgspec.structs.replace(snapshot, chunks=(state + b"\0",))),
            ("no chunks", msgspec.structs.replace(snapshot, chunks=())),
            ("checksum changed", msgspec.structs.replace(snapshot, checksum=snapshot.checksum ^ 1)),
        ]
        target = h.load()
        for what, sent in bad:
            self._expect(ChecksumMismatch, partial(self._import, target, sent), what)
            self._expect(
                ChecksumMismatch,
                partial(_round_trip, sent),
                f"decoding a snapshot with {what}",
            )
        other = self._export(source, short)
        relabelled = msgspec.structs.replace(other, length=_PROMPT)
        self._expect(
            InvalidRequest,
            lambda: self._import(target, relabelled),
            "state of 4 positions labelled as 6",
        )
        assert target.health().sessions == 0, "a refused snapshot left a session behind"
        assert target.health().kv_used_tokens == 0

    def test_migration_failed_import_is_atomic(self) -> None:
        """An import that fails in the backend (state that does not decode for its length)
        leaves the target exactly as it was: no new session, no KV use, and an older live
        epoch of the same session intact (its next decode equals a clean run).

        Fix: install into an empty slot, keep the old epoch's slot until the commit, drop the
        new slot on any failure (EngineCore does; the backend must raise, not half-install)."""
        h = self.harness
        source = self._migrating()
        exact, tolerance, kind = self._moved_exactness(source.capabilities())
        tokens = h.tokens(_PROMPT + 1, seed=8)
        feed = self._feed(0, tokens)
        session = h.session("s", epoch=2)
        self._prefilled(source, feed, session, _PROMPT - 1)
        broken = msgspec.structs.replace(self._export(source, session), length=_PROMPT)
        target, clean = h.load(), h.load()
        old = h.session("s", epoch=1)
        for engine in (target, clean):
            self._prefilled(engine, feed, old, 3)
        before = self._occupancy(target)
        self._expect(InvalidRequest, lambda: self._import(target, broken), "undecodable state")
        assert self._occupancy(target) == before, "a failed import changed occupancy"
        assert self._length(target, old) == 3, "a failed import changed the older live epoch"
        want = _rows(h.decode(clean, old, 3, feed.at(old, 3, 4)))
        got = _rows(h.decode(target, old, 3, feed.at(old, 3, 4)))
        assert_matches(
            got, want, exact=exact, tolerance=tolerance, kind=kind, what="decode after failure"
        )

    def test_migration_atomic_under_budget_pressure(self) -> None:
        """Imports obey the limits: with eviction "reject", one beyond the KV budget, the
        session slots or max_context is ResourceExhausted and changes nothing; with "lru" an
        idle session is evicted to make room, but only when the import commits: a failing
        import under the same pressure evicts nothing.

        Fix: admit imports like prefills (budget, slots, context) and apply the evictions at
        the commit point, after the backend succeeded."""
        h = self.harness
        source = self._migrating(max_context=64)
        tokens = h.tokens(8, seed=9)
        feed = self._feed(0, tokens)
        session = h.session("big")
        self._prefilled(source, feed, session, 8)
        snapshot = self._export(source, session)
        short = h.session("short")
        self._prefilled(source, feed, short, 6)
        broken = msgspec.structs.replace(self._export(source, short), length=8, session=session)
        reject = h.load(max_context=64, kv_budget_tokens=12, eviction="reject")
        idle = h.session("idle")
        self._prefilled(reject, feed, idle, 5)
        before = self._occupancy(reject)
        error = self._expect(ResourceExhausted, lambda: self._import(reject, snapshot), "budget")
        assert self._occupancy(reject) == before, f"a refused import changed state ({error})"
        slots = h.load(max_context=64, max_sessions=1, eviction="reject")
        self._prefilled(slots, feed, idle, 2)
        self._expect(ResourceExhausted, lambda: self._import(slots, snapshot), "session slots")
        narrow = h.load(max_context=64)
        long = msgspec.structs.replace(snapshot, length=65)
        self._expect(
            ResourceExhausted,
            lambda: self._import(narrow, long),
            "a snapshot longer than max_context",
        )
        lru = h.load(max_context=64, kv_budget_tokens=12, eviction="lru")
        if not lru.capabilities().features.eviction:
            return
        self._prefilled(lru, feed, idle, 5)
        self._expect(InvalidRequest, lambda: self._import(lru, broken), "failing import")
        assert self._length(lru, idle) == 5, (
            "a failing import evicted an idle session: evictions must wait for the commit"
        )
        result = self._import(lru, snapshot)
        assert result.evicted == 1, f"import reported {result.evicted} evictions, expected 1"
        assert self._length(lru, idle) == "evicted"
        assert self._length(lru, session) == 8

    def test_migration_cancelled_import_and_export(self) -> None:
        """An import or export waiting behind a slow operation is cancelled by request id and
        by session id: the caller sees Cancelled, ``cancel`` answered cancelled=True, and
        nothing changed (no session installed; the source as it was). When a cancel arrives
        too late (the operation had committed), ``cancel`` says False and the result stands.

        Fix: register exports and imports for cancellation, check the token before and after
        the backend step and decide at the commit point (EngineCore does)."""
        h = self.harness
        source = self._migrating()
        tokens = h.tokens(_PROMPT, seed=10)
        feed = self._feed(0, tokens)
        session = h.session("c")
        self._prefilled(source, feed, session, _PROMPT)
        snapshot = self._export(source, session)
        engine = h.load(options=dict(h.target.cancel_load_options))
        if not engine.capabilities().features.cancel:
            suite_skip("engine does not advertise cancel")
        self._prefilled(engine, feed, session, _PROMPT)
        landed = 0
        for attempt, by in enumerate(("request_id", "session_id") * 3):
            moved = h.session(f"moved-{attempt}")
            sent = msgspec.structs.replace(snapshot, session=moved)
            rid = h.request_id()
            cancel = (
                CancelRequest(request_id=rid)
                if by == "request_id"
                else CancelRequest(session_id=moved.session_id)
            )
            outcome, answered = self._behind_a_slow_prefill(
                engine, partial(self._import, engine, sent, None, rid), cancel
            )
            if answered:
                assert isinstance(outcome, Cancelled), (
                    f"cancel ({by}) answered cancelled=True but the import returned {outcome!r}"
                )
                assert self._length(engine, moved) == "unknown_session", (
                    "a cancelled import installed the session"
                )
                landed += 1
            else:
                assert isinstance(outcome, ImportSessionResult), f"import raised {outcome!r}"
                assert self._length(engine, moved) == _PROMPT
        rid = h.request_id()
        outcome, answered = self._behind_a_slow_prefill(
            engine,
            lambda: engine.export_session(ExportSessionRequest(request_id=rid, session=session)),
            CancelRequest(request_id=rid),
        )
        if answered:
            assert isinstance(outcome, Cancelled), f"export returned {outcome!r} after cancel"
            landed += 1
        assert self._length(engine, session) == _PROMPT, "export (cancelled or not) changed it"
        assert engine.health().in_flight == 0
        if not landed:
            h.no_cancel_landed("no cancel landed while an import or export waited")

    def _behind_a_slow_prefill(
        self,
        engine: ShardEngine,
        run: Callable[[], object],
        cancel: CancelRequest,
    ) -> tuple[object, bool]:
        """Run ``run`` on a thread while a slow prefill holds the engine, cancel it once it is
        in flight; return what it returned or raised and whether cancel said True."""
        h = self.harness
        caps = engine.capabilities()
        length = max(1, min(caps.limits.max_batch_tokens, caps.limits.max_context - 1, 48))
        blocker = h.session(f"blocker-{h.request_id()}")
        outcomes: dict[str, object] = {}

        def slow() -> None:
            try:
                engine.prefill(
                    PrefillRequest(
                        request_id=h.request_id(),
                        session=blocker,
                        start_pos=0,
                        inputs=TokenInput(token_ids=h.tokens(length, seed=4)),
                    )
                )
            except ShardEngineError as error:
                outcomes["blocker"] = error

        def target() -> None:
            try:
                outcomes["run"] = run()
            except ShardEngineError as error:
                outcomes["run"] = error

        first = threading.Thread(target=slow)
        first.start()
        _wait(lambda: engine.health().in_flight >= 1 or not first.is_alive())
        second = threading.Thread(target=target)
        second.start()
        _wait(lambda: engine.health().in_flight >= 2 or not second.is_alive())
        answered = engine.cancel(cancel).cancelled
        second.join(30)
        first.join(30)
        h.release(engine, blocker)
        return outcomes.get("run"), answered

    def test_migration_metrics_and_health(self) -> None:
        """``metrics().exports`` and ``imports`` count successful operations only (refused
        ones count under ``errors`` by code); health and metrics count an imported session
        and its positions like a prefilled one.

        Fix: count exports and imports at their commit point, errors where callers see
        them; an imported session is a session (EngineCore does)."""
        h = self.harness
        source = self._migrating()
        tokens = h.tokens(_PROMPT, seed=12)
        session = h.session("m")
        self._prefilled(source, self._feed(0, tokens), session, _PROMPT)
        snapshot = self._export(source, session)
        self._export(source, session)
        target = h.load()
        self._import(target, snapshot)
        self._expect(StaleEpoch, lambda: self._import(target, snapshot), "second import")
        source_metrics, metrics, health = source.metrics(), target.metrics(), target.health()
        assert (source_metrics.exports, source_metrics.imports) == (2, 0), (
            f"source counts exports {source_metrics.exports}, imports {source_metrics.imports}"
        )
        assert (metrics.imports, metrics.exports) == (1, 0), (
            f"target counts imports {metrics.imports}, exports {metrics.exports}"
        )
        assert metrics.errors == {"stale_epoch": 1}, f"errors {metrics.errors}"
        assert (health.sessions, health.kv_used_tokens) == (1, _PROMPT), (
            f"health after an import: {health.sessions} sessions, {health.kv_used_tokens} kv"
        )
        assert (metrics.sessions_active, metrics.kv_used_tokens) == (1, _PROMPT)


def _assert_chunked(snapshot: SessionSnapshot) -> None:
    """The snapshot's state is cut as transports stream it: every chunk but the last holds
    exactly SNAPSHOT_CHUNK_BYTES, and no chunk is empty."""
    sizes = [memoryview(chunk).nbytes for chunk in snapshot.chunks]
    for index, size in enumerate(sizes):
        last = index == len(sizes) - 1
        conforming = 0 < size <= SNAPSHOT_CHUNK_BYTES and (last or size == SNAPSHOT_CHUNK_BYTES)
        assert conforming, (
            f"snapshot chunk {index} of {len(sizes)} holds {size} bytes; every chunk but the "
            f"last holds exactly SNAPSHOT_CHUNK_BYTES ({SNAPSHOT_CHUNK_BYTES}) and none is "
            "empty (cut the state with shard_engine_api's split_chunks; EngineCore does)"
        )


def _round_trip(snapshot: SessionSnapshot) -> object:
    return _codec.decode_message(_codec.encode(snapshot))


def _wait(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    event = threading.Event()
    for _ in range(int(seconds / 0.0005)):
        if condition():
            return
        event.wait(0.0005)
