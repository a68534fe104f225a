"""The standard tests of session semantics: truncation (also at large positions and on every
role), epochs (a newer one starts fresh, older ones are fenced, a refused first prefill of a
newer epoch leaves the older one), release (tombstones that hold after slot reuse and
thousands of releases, a second release that frees nothing), a refused first prefill that
leaves nothing, isolation between sessions, and session ids across their valid characters and
lengths. :class:`ShardEngineConformance` inherits them; their names are pinned in
:data:`SESSION_TESTS`, part of the standard tests.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Final

import numpy as np
import numpy.typing as npt

from shard_engine_api._errors import (
    CacheMiss,
    ResourceExhausted,
    ShardEngineError,
    StaleEpoch,
    UnsupportedFeature,
)
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import CancelRequest, OutputKind, SessionRef
from shard_engine_api.conformance._harness import (
    _PROMPT,
    SuiteHelpers,
    _assert_addressed_to,
    _raises,
    _raises_exactly,
    _rows,
    assert_matches,
    logits_array,
    split_ranges,
)
from shard_engine_api.conformance._recorder import suite_skip

__all__ = ["SESSION_TESTS", "SessionTests"]

SESSION_TESTS: Final[tuple[str, ...]] = (
    "test_double_release_frees_once",
    "test_failed_first_prefill_leaves_nothing",
    "test_fence_holds_after_slot_reuse",
    "test_long_and_shared_prefix_session_ids",
    "test_newer_epoch_sees_no_old_cache",
    "test_refused_first_prefill_of_a_newer_epoch",
    "test_release_tombstone",
    "test_release_unknown_session",
    "test_session_ids_across_characters_and_lengths",
    "test_session_isolation",
    "test_stale_epoch",
    "test_thousands_of_releases_keep_every_fence",
    "test_truncate",
    "test_truncate_and_new_epoch_every_role",
    "test_truncate_at_large_positions",
)
"""The tests of this module, sorted (part of STANDARD_TESTS)."""

_RELEASES: Final = 4200
"""Released sessions of the fence test: past 4,096 (a 12-bit counter, a 4096-entry table)."""


class SessionTests(SuiteHelpers):
    """The standard tests of session semantics (module docstring)."""

    def test_stale_epoch(self) -> None:
        """Epochs fence: a newer epoch starts the session fresh (its output equals a brand
        new session's, and its results name the newer epoch), after which prefill, decode
        and release with the older epoch raise StaleEpoch. Epochs are exact 64-bit integers:
        2**53 is older than 2**53 + 1, and 2**63 - 1 (the largest) fences like any other.

        Fix: keep the session's current epoch; drop its state on a newer epoch; refuse older
        ones with StaleEpoch (not CacheMiss, not success); store and compare epochs as
        integers (never as floats, never narrower than 64 bits); address every result to the
        session and epoch of its request."""
        h = self.harness
        engine = h.load()
        caps = engine.capabilities()
        exact, tolerance = self._shape_exactness(caps)
        old = h.session("a", epoch=1)
        new = h.session("a", epoch=2)
        h.prefill(engine, old, 0, h.tokens(5, seed=1))
        newer = h.prefill(engine, new, 0, h.tokens(3, seed=2))
        _assert_addressed_to(newer, new, "prefill at the newer epoch")
        fresh = logits_array(newer)
        reference = logits_array(h.prefill(engine, h.session("ref"), 0, h.tokens(3, seed=2)))
        assert_matches(
            fresh,
            reference,
            exact=exact,
            tolerance=tolerance,
            what="a newer epoch must start from an empty cache",
        )
        _raises(
            StaleEpoch,
            lambda: h.prefill(engine, old, 0, h.tokens(2, seed=3)),
            "prefill with the older epoch",
        )
        _raises(StaleEpoch, lambda: h.decode(engine, old, 5, (1,)), "decode with older epoch")
        _raises(
            StaleEpoch,
            lambda: h.decode(engine, old, 3, (1,)),
            "decode with older epoch at the current length",
        )
        _raises(StaleEpoch, lambda: h.release(engine, old), "release with the older epoch")
        _assert_addressed_to(h.decode(engine, new, 3, (1,)), new, "decode at the newer epoch")
        for first, second in ((2**53, 2**53 + 1), (2**63 - 2, 2**63 - 1)):
            older, younger = h.session(f"big-{second}", first), h.session(f"big-{second}", second)
            h.prefill(engine, older, 0, h.tokens(2, seed=4))
            _assert_addressed_to(
                h.prefill(engine, younger, 0, h.tokens(2, seed=5)), younger, f"epoch {second}"
            )
            _raises(
                StaleEpoch,
                partial(h.prefill, engine, older, 0, h.tokens(2, seed=6)),
                f"prefill with epoch {first} after {second}",
            )
            _raises(
                StaleEpoch,
                partial(h.decode, engine, older, 2, (1,)),
                f"decode with epoch {first} after {second}",
            )
            h.release(engine, younger)
            _raises(
                StaleEpoch,
                partial(h.prefill, engine, younger, 0, h.tokens(2, seed=7)),
                f"prefill with the released epoch {second}",
            )

    def test_truncate(self) -> None:
        """A prefill at start_pos below the committed length truncates there and continues:
        the result and the following decodes equal a fresh run of the new sequence.

        With features.truncate = False a truncating prefill must raise UnsupportedFeature and
        change nothing (then the rest is skipped).

        Fix: drop cached positions >= start_pos before appending (or declare
        features.truncate = False and refuse truncation with UnsupportedFeature)."""
        h = self.harness
        engine = h.load()
        caps = engine.capabilities()
        if not caps.features.truncate:
            self._check_truncate_refused(engine)
            suite_skip("engine declares features.truncate = False (and refuses truncation)")
        exact, tolerance = self._shape_exactness(caps)
        original = h.tokens(8, seed=1)
        replacement = h.tokens(3, seed=2)
        edited = h.session("edited")
        h.prefill(engine, edited, 0, original)
        h.decode(engine, edited, 8, (1,))
        got = logits_array(h.prefill(engine, edited, 4, replacement, logits="all"))
        fresh = h.session("fresh")
        want = logits_array(h.prefill(engine, fresh, 0, original[:4] + replacement, logits="all"))
        assert_matches(
            got,
            want[4:],
            exact=exact,
            tolerance=tolerance,
            what="prefill at 4 over 9 cached positions vs a fresh run",
        )
        for pos, token in enumerate(h.tokens(2, seed=3), start=7):
            assert_matches(
                logits_array(h.decode(engine, edited, pos, (token,))),
                logits_array(h.decode(engine, fresh, pos, (token,))),
                exact=exact,
                tolerance=tolerance,
                what=f"decode at {pos} after truncate",
            )

    def test_session_isolation(self) -> None:
        """Interleaving other sessions (prefills, decodes, truncations, releases) does not
        change a session's outputs compared with running it alone on a fresh engine, also when
        two sessions with different histories get the same inputs at the same positions.

        Fix: keep every cache per session; never share or reuse a slot's state, and never
        reuse outputs keyed by inputs and positions without the session's history."""
        h = self.harness
        alone = h.load()
        caps = alone.capabilities()
        exact, tolerance = self._isolation_exactness(caps)
        tokens = h.tokens(_PROMPT, seed=1)
        steps = h.tokens(3, seed=2)
        session = h.session("a")
        expected = [logits_array(h.prefill(alone, session, 0, tokens))]
        expected += [
            logits_array(h.decode(alone, session, _PROMPT + i, (t,))) for i, t in enumerate(steps)
        ]
        shared = h.load()
        b, c = h.session("b"), h.session("c")
        h.prefill(shared, b, 0, h.tokens(9, seed=3))
        got = [logits_array(h.prefill(shared, session, 0, tokens))]
        h.prefill(shared, c, 0, h.tokens(4, seed=4))
        h.decode(shared, b, 9, (2,))
        got.append(logits_array(h.decode(shared, session, _PROMPT, (steps[0],))))
        h.prefill(shared, b, 2, h.tokens(5, seed=5))
        h.release(shared, c)
        got.append(logits_array(h.decode(shared, session, _PROMPT + 1, (steps[1],))))
        h.prefill(shared, h.session("d"), 0, h.tokens(7, seed=6))
        got.append(logits_array(h.decode(shared, session, _PROMPT + 2, (steps[2],))))
        for index, (have, want) in enumerate(zip(got, expected, strict=True)):
            assert_matches(
                have,
                want,
                exact=exact,
                tolerance=tolerance,
                what=f"output {index} of a session interleaved with others",
            )
        # Two sessions with different histories given the same inputs at the same positions (a
        # prefill chunk, then a decode): an engine that reuses outputs or state keyed by inputs
        # and positions, not by session, gives the second one the first one's outputs.
        continuation = h.tokens(2, seed=8)
        for name, seed in (("x", 9), ("y", 10)):
            other = h.session(name)
            prompt = h.tokens(_PROMPT, seed=seed)
            runs: list[list[npt.NDArray[np.float32]]] = []
            for engine in (h.load(), shared):
                runs.append(
                    [
                        logits_array(h.prefill(engine, other, 0, prompt)),
                        logits_array(h.prefill(engine, other, _PROMPT, continuation)),
                        logits_array(h.decode(engine, other, _PROMPT + 2, (steps[0],))),
                    ]
                )
            for index, (have, want) in enumerate(zip(runs[1], runs[0], strict=True)):
                assert_matches(
                    have,
                    want,
                    exact=exact,
                    tolerance=tolerance,
                    what=f"output {index} of session {name!r}, whose history differs from "
                    "another session's that got the same inputs at the same positions",
                )

    def test_release_tombstone(self) -> None:
        """``release`` frees a session and fences its epoch: prefill and decode with that
        epoch or an older one raise StaleEpoch (never a silent fresh session); a newer epoch
        starts fresh and equals a brand-new session.

        Fix: keep a tombstone of the released epoch and check it before creating state."""
        h = self.harness
        engine = h.load()
        exact, tolerance = self._shape_exactness(engine.capabilities())
        released = h.session("a", epoch=3)
        h.prefill(engine, released, 0, h.tokens(5, seed=1))
        result = h.release(engine, released)
        assert result.released, f"releasing a live session must say released: {result}"
        assert engine.health().sessions == 0
        for epoch in (3, 2):
            stale = h.session("a", epoch=epoch)
            _raises(
                StaleEpoch,
                partial(h.prefill, engine, stale, 0, h.tokens(2, seed=2)),
                f"prefill with released epoch {epoch}",
            )
            _raises(
                StaleEpoch,
                partial(h.decode, engine, stale, 5, (1,)),
                f"decode with released epoch {epoch}",
            )
        newer = h.session("a", epoch=4)
        _raises(
            CacheMiss,
            lambda: h.decode(engine, newer, 5, (1,)),
            "decode of a newer epoch that has no state",
        )
        got = logits_array(h.prefill(engine, newer, 0, h.tokens(3, seed=3)))
        want = logits_array(h.prefill(engine, h.session("b"), 0, h.tokens(3, seed=3)))
        assert_matches(
            got,
            want,
            exact=exact,
            tolerance=tolerance,
            what="a newer epoch after release must start fresh",
        )

    def test_release_unknown_session(self) -> None:
        """Releasing a session the engine does not hold is a no-op that says so
        (released=False, a detail) and never raises; live sessions are untouched.

        Fix: return ReleaseResult(released=False, detail=...) for unknown sessions."""
        h = self.harness
        engine = h.load()
        live = h.session("live")
        h.prefill(engine, live, 0, h.tokens(3, seed=1))
        result = h.release(engine, h.session("never-seen"))
        assert not result.released, f"an unknown session cannot be released: {result}"
        assert result.detail, "the release result must say why nothing was freed"
        assert engine.health().sessions == 1
        h.decode(engine, live, 3, (1,))

    def _check_truncate_refused(self, engine: ShardEngine) -> None:
        """An engine that declares features.truncate = False refuses a truncating prefill
        with UnsupportedFeature and keeps the session as it was."""
        h = self.harness
        if not engine.capabilities().shard.takes_tokens:
            return
        session = h.session(f"untruncated-{h.request_id()}")
        h.prefill(engine, session, 0, h.tokens(4, seed=11))
        _raises_exactly(
            UnsupportedFeature,
            lambda: h.prefill(engine, session, 2, h.tokens(1, seed=12)),
            "a truncating prefill on an engine that declares features.truncate = False",
        )
        assert self._committed_length(engine, session) == 4, (
            "a refused truncating prefill changed the session"
        )
        h.release(engine, session)

    def test_truncate_and_new_epoch_every_role(self) -> None:
        """On a head, a middle and a tail shard: truncating (prefill below the committed
        length) and starting a newer epoch give the outputs of a fresh session with the
        same inputs, and the older epoch is then StaleEpoch.

        Fix: truncation and epochs are ledger rules; they must not depend on the role."""
        h = self.harness
        self._need_layers(2, "shards of every role")
        ranges = split_ranges(h.n_layers, 3 if h.n_layers >= 3 else 2)
        for start, end in ranges:
            engine = h.load(start, end)
            caps = engine.capabilities()
            exact, tolerance = self._shape_exactness(caps)
            kind: OutputKind = "logits" if caps.shard.emits_logits else "hidden"
            upstream = self._row_sources(start)
            where = f"[{start}, {end}) ({caps.role})"
            original, edit = h.tokens(8, seed=1), h.tokens(3, seed=2)
            edited_sequence = original[:4] + edit
            session = h.session(f"edited-{start}")
            h.prefill(engine, session, 0, self._inputs_for(upstream, session, original, 0))
            got = _rows(
                h.prefill(
                    engine,
                    session,
                    4,
                    self._inputs_for(upstream, session, edited_sequence, 4),
                    logits="all",
                )
            )
            fresh = h.session(f"fresh-{start}")
            want = _rows(
                h.prefill(
                    engine,
                    fresh,
                    0,
                    self._inputs_for(upstream, fresh, edited_sequence, 0),
                    logits="all",
                )
            )
            assert_matches(
                got,
                want[-3:] if caps.shard.emits_logits else want[4:],
                exact=exact,
                tolerance=tolerance,
                what=f"{where}: truncate at 4 vs a fresh run",
                kind=kind,
            )
            newer = SessionRef(session_id=session.session_id, epoch=2)
            renewed = _rows(h.prefill(engine, newer, 0, self._inputs_for(upstream, newer, edit, 0)))
            other = h.session(f"other-{start}")
            baseline = _rows(
                h.prefill(engine, other, 0, self._inputs_for(upstream, other, edit, 0))
            )
            assert_matches(
                renewed,
                baseline,
                exact=exact,
                tolerance=tolerance,
                what=f"{where}: a newer epoch vs a brand-new session",
                kind=kind,
            )
            _raises(
                StaleEpoch,
                partial(
                    h.prefill, engine, session, 0, self._inputs_for(upstream, session, edit, 0)
                ),
                f"{where}: the older epoch after a newer one",
            )

    def test_newer_epoch_sees_no_old_cache(self) -> None:
        """A newer epoch of a live session sees none of the old cache: its decode at the old
        length and its prefill at a position > 0 miss with committed_length 0; from 0 it
        equals a brand-new session. Epochs >= 2**40 (and up to 2**62) work the same.

        Fix: a newer epoch has length 0 until prefilled from 0; compare epochs as 64-bit
        integers."""
        h = self.harness
        engine = h.load()
        exact, tolerance = self._shape_exactness(engine.capabilities())
        reference = logits_array(h.prefill(engine, h.session("reference"), 0, h.tokens(3, seed=2)))
        for old_epoch, new_epoch in ((1, 2), (2, 2**40), (2**40, 2**40 + 1), (2**40 + 1, 2**62)):
            old = h.session(f"e{old_epoch}", epoch=old_epoch)
            new = h.session(f"e{old_epoch}", epoch=new_epoch)
            h.prefill(engine, old, 0, h.tokens(6, seed=1))
            for what, call in (
                ("decode at the old length", partial(h.decode, engine, new, 6, (1,))),
                ("prefill at 3", partial(h.prefill, engine, new, 3, (1, 2))),
                ("decode at 0", partial(h.decode, engine, new, 0, (1,))),
            ):
                miss = _raises(CacheMiss, call, f"epoch {new_epoch} over {old_epoch}: {what}")
                assert isinstance(miss, CacheMiss)
                assert miss.committed_length == 0, (
                    f"epoch {new_epoch} over {old_epoch}: {what}: committed_length "
                    f"{getattr(miss, 'committed_length', None)}, expected 0"
                )
            got = logits_array(h.prefill(engine, new, 0, h.tokens(3, seed=2)))
            assert_matches(
                got,
                reference,
                exact=exact,
                tolerance=tolerance,
                what=f"epoch {new_epoch} prefilled from 0 vs a new session",
            )
            _raises(
                StaleEpoch,
                partial(h.decode, engine, old, 3, (1,)),
                f"epoch {old_epoch} after {new_epoch}",
            )
            h.decode(engine, new, 3, (1,))
            h.release(engine, new)
            _raises(
                StaleEpoch,
                partial(h.prefill, engine, new, 0, (1,)),
                f"released epoch {new_epoch}",
            )
        assert engine.health().sessions == 1

    def test_fence_holds_after_slot_reuse(self) -> None:
        """The tombstone of a released session holds after another session reuses its slot
        (max_sessions 1): the released epoch stays StaleEpoch for prefill, decode and
        release while the other session is served; a newer epoch starts fresh.

        Fix: keep tombstones by session id, not by slot."""
        h = self.harness
        engine = h.load(max_sessions=1, eviction="reject")
        exact, tolerance = self._shape_exactness(engine.capabilities())
        released, other = h.session("released"), h.session("other")
        h.prefill(engine, released, 0, h.tokens(5, seed=1))
        assert h.release(engine, released).released
        h.prefill(engine, other, 0, h.tokens(5, seed=1))
        h.decode(engine, other, 5, (1,))
        for what, call in (
            ("prefill", lambda: h.prefill(engine, released, 0, h.tokens(5, seed=1))),
            ("decode", lambda: h.decode(engine, released, 5, (1,))),
            ("decode at the reused slot's length", lambda: h.decode(engine, released, 6, (1,))),
        ):
            _raises(StaleEpoch, call, f"released epoch, {what}, after slot reuse")
        h.release(engine, other)
        renewed = h.session("released", epoch=2)
        got = logits_array(h.prefill(engine, renewed, 0, h.tokens(4, seed=3)))
        h.release(engine, renewed)
        want = logits_array(h.prefill(engine, h.session("fresh"), 0, h.tokens(4, seed=3)))
        assert_matches(
            got, want, exact=exact, tolerance=tolerance, what="newer epoch after slot reuse"
        )

    def test_double_release_frees_once(self) -> None:
        """A second release of the same session frees nothing (released=False with a
        detail): the slot and KV positions are not freed twice, so max_sessions still
        holds afterwards and metrics count one release.

        Fix: release only a live session; make a repeated release a no-op."""
        h = self.harness
        engine = h.load(max_sessions=2, eviction="reject")
        a = h.session("a")
        h.prefill(engine, a, 0, h.tokens(3, seed=1))
        assert h.release(engine, a).released
        again = h.release(engine, a)
        assert not again.released, f"a second release freed again: {again}"
        assert again.detail, f"a second release must say why nothing was freed: {again}"
        metrics = engine.metrics()
        assert (metrics.releases, metrics.sessions_active, metrics.kv_used_tokens) == (1, 0, 0), (
            metrics
        )
        b, c, d = h.session("b"), h.session("c"), h.session("d")
        h.prefill(engine, b, 0, h.tokens(3, seed=2))
        h.prefill(engine, c, 0, h.tokens(3, seed=3))
        _raises(
            ResourceExhausted,
            lambda: h.prefill(engine, d, 0, (1,)),
            "a third session after a double release",
        )
        assert engine.health().kv_used_tokens == 6
        # A slot freed twice is handed to two sessions: their caches collide.
        exact, tolerance = self._isolation_exactness(engine.capabilities())
        clean = h.load()
        for seed, session in ((2, b), (3, c)):
            h.prefill(clean, session, 0, h.tokens(3, seed=seed))
        for session in (b, c, b):
            length = self._committed_length(engine, session)
            assert_matches(
                _rows(h.decode(engine, session, length, (4,))),
                _rows(h.decode(clean, session, length, (4,))),
                exact=exact,
                tolerance=tolerance,
                what=f"{session.session_id} after a double release (sessions sharing a slot?)",
            )

    def test_failed_first_prefill_leaves_nothing(self) -> None:
        """A brand-new session whose first prefill is refused (KV budget), fails (bad token)
        or is cancelled leaves no session, no slot and no KV positions behind: health and
        metrics say so, its decode misses with committed_length 0 (not "evicted"), and the
        slots and budget are all still available.

        Fix: create a session's ledger entry only when its first prefill commits."""
        h = self.harness
        engine = self._slow(max_sessions=2, kv_budget_tokens=8, eviction="reject")
        vocab = engine.capabilities().vocab_size
        newcomer = h.session("newcomer")
        attempts: list[tuple[str, Callable[[], object]]] = [
            ("refused (KV budget)", lambda: h.prefill(engine, newcomer, 0, h.tokens(9, seed=1))),
            ("failed (bad token)", lambda: h.prefill(engine, newcomer, 0, (1, vocab))),
        ]
        for what, call in attempts:
            _raises(ShardEngineError, call, f"first prefill {what}")
            self._assert_empty(engine, newcomer, what)
        if engine.capabilities().features.cancel:
            for attempt in range(3):
                request_id = h.request_id()
                cancelled_one = h.session(f"cancelled-{attempt}")
                cancelled, _ = self._cancel_mid_flight(
                    engine,
                    CancelRequest(request_id=request_id),
                    partial(
                        h.prefill,
                        engine,
                        cancelled_one,
                        0,
                        h.tokens(4, seed=2),
                        request_id=request_id,
                    ),
                )
                if cancelled:
                    self._assert_empty(engine, cancelled_one, "cancelled")
                    break
                h.release(engine, cancelled_one)
        first, second = h.session("first"), h.session("second")
        h.prefill(engine, first, 0, h.tokens(4, seed=3))
        h.prefill(engine, second, 0, h.tokens(4, seed=4))
        assert engine.health().kv_used_tokens == 8

    def _assert_empty(self, engine: ShardEngine, session: SessionRef, what: str) -> None:
        h = self.harness
        health, metrics = engine.health(), engine.metrics()
        assert (health.sessions, health.kv_used_tokens, health.in_flight) == (0, 0, 0), (
            f"after a {what} first prefill health says {health}"
        )
        assert (metrics.sessions_active, metrics.kv_used_tokens) == (0, 0), (
            f"after a {what} first prefill metrics say {metrics.sessions_active} sessions, "
            f"{metrics.kv_used_tokens} positions"
        )
        miss = _raises(
            CacheMiss,
            lambda: h.decode(engine, session, 0, (1,)),
            f"decode after a {what} first prefill",
        )
        assert isinstance(miss, CacheMiss)
        assert miss.committed_length == 0, f"after a {what} first prefill: {miss}"
        assert miss.reason != "evicted", f"a {what} first prefill left an 'evicted' session"

    def test_long_and_shared_prefix_session_ids(self) -> None:
        """Session ids of the maximum length (256), ids sharing a 255-character prefix and
        ids that differ only in case, surrounding whitespace or Unicode normalization (NFC
        against NFD) are distinct, isolated sessions: interleaved, each equals its run alone;
        releasing one leaves the others.

        Fix: key sessions by the whole id, code point for code point; never truncate, hash
        lossily, case-fold, strip or normalize it."""
        h = self.harness
        ids = [
            "p" * 255 + "1",
            "p" * 255 + "2",
            "p" * 255,
            "q" * 256,
            "Case",
            "case",
            " case",
            "caf\u00e9",
            "cafe\u0301",
        ]
        engine = h.load(max_sessions=len(ids))
        exact, tolerance = self._isolation_exactness(engine.capabilities())
        alone = h.load()
        sessions = [SessionRef(session_id=sid, epoch=1) for sid in ids]
        expected: dict[str, list[npt.NDArray[np.float32]]] = {}
        for index, session in enumerate(sessions):
            outputs = [logits_array(h.prefill(alone, session, 0, h.tokens(3 + index, seed=index)))]
            outputs.append(logits_array(h.decode(alone, session, 3 + index, (index,))))
            expected[session.session_id] = outputs
            h.release(alone, session)
        got: dict[str, list[npt.NDArray[np.float32]]] = {s.session_id: [] for s in sessions}
        for index, session in enumerate(sessions):
            got[session.session_id].append(
                logits_array(h.prefill(engine, session, 0, h.tokens(3 + index, seed=index)))
            )
        for index, session in enumerate(reversed(sessions)):
            position = len(sessions) - 1 - index
            got[session.session_id].append(
                logits_array(h.decode(engine, session, 3 + position, (position,)))
            )
        for session in sessions:
            for step, (have, want) in enumerate(
                zip(got[session.session_id], expected[session.session_id], strict=True)
            ):
                assert_matches(
                    have,
                    want,
                    exact=exact,
                    tolerance=tolerance,
                    what=f"session id {session.session_id[:6]}..{session.session_id[-4:]} {step}",
                )
        assert engine.health().sessions == len(sessions)
        h.release(engine, sessions[0])
        assert engine.health().sessions == len(sessions) - 1
        h.decode(engine, sessions[1], 5, (1,))

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
