"""The standard tests of what outputs must equal: repeated runs (determinism), pipelines of 2,
3 and the fixture's uneven splits against one full shard, decodes against a longer prefill,
chunked against one prefill (also for sessions of about 300 positions), such a session moved
to another engine against its source, every boundary dtype (narrow ones against the f32 rows),
and finite outputs everywhere. Comparisons are exact or
within the declared tolerance as the engine's determinism says. :class:`ShardEngineConformance`
inherits them; their names are pinned in :data:`NUMERICS_TESTS`, part of the standard tests.
"""

from __future__ import annotations

import itertools
from typing import Final

import numpy as np

from shard_engine_api import _codec
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    Capabilities,
    ExportSessionRequest,
    ImportSessionRequest,
    SessionRef,
    SessionSnapshot,
)
from shard_engine_api.conformance._harness import (
    _PROMPT,
    SuiteHelpers,
    Tolerances,
    _rows,
    assert_matches,
    bundle_of,
    logits_array,
    logits_of,
    split_ranges,
)
from shard_engine_api.conformance._recorder import suite_skip

__all__ = ["NUMERICS_TESTS", "NumericsTests"]

NUMERICS_TESTS: Final[tuple[str, ...]] = (
    "test_chunked_prefill",
    "test_decode_consistency",
    "test_deterministic",
    "test_every_boundary_dtype",
    "test_long_prefill_vs_chunked_and_decode",
    "test_long_session_decode_and_chunks_match_one_prefill",
    "test_long_session_migrates_exactly",
    "test_narrow_boundary_dtypes_match_f32_rows",
    "test_outputs_finite",
    "test_split_invariance_fixture_splits",
    "test_split_invariance_three_way",
    "test_split_invariance_two_way",
)
"""The tests of this module, sorted (part of STANDARD_TESTS)."""


class NumericsTests(SuiteHelpers):
    """The standard tests of what outputs must equal (module docstring)."""

    def test_deterministic(self) -> None:
        """The same requests give bit-identical results: on two sessions of one engine and
        on two freshly loaded engines (prefill of all rows, then decodes; bundles too).

        Fix: remove any dependence on uninitialised memory, thread scheduling or global
        state; or declare determinism.deterministic = False."""
        h = self.harness
        first = h.load()
        if not first.capabilities().determinism.deterministic:
            suite_skip("engine declares determinism.deterministic = False")
        second = h.load()
        tokens = h.tokens(_PROMPT, seed=1)
        steps = h.tokens(2, seed=2)
        runs: list[list[bytes]] = []
        for engine, name in ((first, "a"), (first, "b"), (second, "a")):
            session = h.session(name)
            outputs = [
                bytes(logits_of(h.prefill(engine, session, 0, tokens, logits="all")).payload)
            ]
            for offset, token in enumerate(steps):
                outputs.append(
                    bytes(logits_of(h.decode(engine, session, _PROMPT + offset, (token,))).payload)
                )
            runs.append(outputs)
        assert runs[0] == runs[1], "two sessions of one engine gave different bytes"
        assert runs[0] == runs[2], "two fresh engines gave different bytes"
        if h.n_layers >= 2:
            (head_range, _tail) = split_ranges(h.n_layers, 2)
            bundles = [
                bytes(h.head_bundle(h.load(*head_range), h.session("h"), 0, tokens).payload)
                for _ in range(2)
            ]
            assert bundles[0] == bundles[1], "two fresh head shards gave different bundles"

    def test_split_invariance_two_way(self) -> None:
        """A 2-way pipeline (head -> tail) gives the logits of one full shard, for prefill
        (all rows) and decode steps: bit for bit when the engine declares split_exact, else
        within its tolerance.

        Fix: carry hidden states across the boundary without loss (f32), apply per-layer
        rules by absolute layer index, and keep numerics identical across shards."""
        self._check_split(2)

    def test_split_invariance_three_way(self) -> None:
        """A 3-way (uneven when it does not divide) pipeline head -> middle -> tail gives
        the full shard's logits (exact or within the declared tolerance).

        Fix: as for the 2-way split; a middle shard takes and emits bundles."""
        self._check_split(3)

    def test_decode_consistency(self) -> None:
        """Prefill N tokens then decode token N gives the last logits of prefilling N+1
        tokens (exact or within tolerance), for several consecutive decodes.

        Fix: decode must attend to the cached history at positions 0..N-1 and write
        position N; a decode that ignores the cache or the position fails this."""
        h = self.harness
        engine = h.load()
        exact, tolerance = self._shape_exactness(engine.capabilities())
        tokens = h.tokens(_PROMPT + 3, seed=1)
        session = h.session("incremental")
        h.prefill(engine, session, 0, tokens[:_PROMPT])
        for pos in range(_PROMPT, len(tokens)):
            got = logits_array(h.decode(engine, session, pos, (tokens[pos],)))
            whole = logits_array(h.prefill(engine, h.session(f"whole-{pos}"), 0, tokens[: pos + 1]))
            assert_matches(
                got,
                whole,
                exact=exact,
                tolerance=tolerance,
                what=f"decode at {pos} vs prefill of {pos + 1} tokens",
            )

    def test_chunked_prefill(self) -> None:
        """A prefill sent in chunks (each at the previous committed length) gives the rows of
        one prefill (logits "all") and the same following decode.

        Fix: a prefill at start_pos == committed length must append to the cache."""
        h = self.harness
        engine = h.load()
        exact, tolerance = self._shape_exactness(engine.capabilities())
        tokens = h.tokens(9, seed=1)
        one = h.session("one")
        whole = logits_array(h.prefill(engine, one, 0, tokens, logits="all"))
        chunked = h.session("chunked")
        rows = [
            logits_array(h.prefill(engine, chunked, start, tokens[start:end], logits="all"))
            for start, end in ((0, 2), (2, 7), (7, 9))
        ]
        assert_matches(
            np.concatenate(rows),
            whole,
            exact=exact,
            tolerance=tolerance,
            what="chunks (0-2, 2-7, 7-9) vs one prefill of 9 tokens",
        )
        follow = h.tokens(1, seed=2)
        assert_matches(
            logits_array(h.decode(engine, chunked, 9, follow)),
            logits_array(h.decode(engine, one, 9, follow)),
            exact=exact,
            tolerance=tolerance,
            what="decode after chunked prefill",
        )

    def _exactness(self, caps: Capabilities) -> tuple[bool, Tolerances]:
        """Pipeline vs. one full shard: bit-exact when the engine declares split_exact."""
        return caps.determinism.split_exact, self._tolerances(caps)

    def _check_split(self, parts: int, boundaries: tuple[int, ...] | None = None) -> None:
        h = self.harness
        self._need_layers(parts, f"a {parts}-way split")
        full = h.load()
        caps = full.capabilities()
        exact, tolerance = self._exactness(caps)
        ranges = (
            split_ranges(h.n_layers, parts)
            if boundaries is None
            else list(itertools.pairwise(boundaries))
        )
        pipeline = [h.load(start, end) for start, end in ranges]
        tokens = h.tokens(_PROMPT, seed=1)
        steps = h.tokens(3, seed=2)
        session = h.session("a")
        expected = logits_array(h.prefill(full, session, 0, tokens, logits="all"))
        got = np.array(h.pipeline_prefill(pipeline, session, 0, tokens, logits="all").array())
        assert_matches(
            got,
            expected,
            exact=exact,
            tolerance=tolerance,
            what=f"prefill logits of the {parts}-way pipeline {ranges}",
        )
        for offset, token in enumerate(steps):
            pos = _PROMPT + offset
            want = logits_array(h.decode(full, session, pos, (token,)))
            have = np.array(h.pipeline_decode(pipeline, session, pos, token).array())
            assert_matches(
                have,
                want,
                exact=exact,
                tolerance=tolerance,
                what=f"decode at {pos} through the {parts}-way pipeline {ranges}",
            )

    def test_long_prefill_vs_chunked_and_decode(self) -> None:
        """A prefill longer than any internal chunk (up to 40 rows, logits "all") equals the
        same positions sent in chunks of 7 and sent as one token plus decode steps.

        Fix: carry the cache across internal micro-batches; a long prefill is the same
        computation as its chunks."""
        h = self.harness
        engine = h.load()
        caps = engine.capabilities()
        exact, tolerance = self._shape_exactness(caps)
        length = max(2, min(40, caps.limits.max_batch_tokens, caps.limits.max_context - 1))
        tokens = h.tokens(length, seed=11)
        whole = logits_array(h.prefill(engine, h.session("whole"), 0, tokens, logits="all"))
        chunked = h.session("chunked")
        rows = [
            logits_array(h.prefill(engine, chunked, start, tokens[start : start + 7], logits="all"))
            for start in range(0, length, 7)
        ]
        assert_matches(
            np.concatenate(rows),
            whole,
            exact=exact,
            tolerance=tolerance,
            what=f"{length} rows in chunks of 7 vs one prefill",
        )
        stepped = h.session("stepped")
        steps = [logits_array(h.prefill(engine, stepped, 0, tokens[:1]))]
        steps += [
            logits_array(h.decode(engine, stepped, pos, (tokens[pos],))) for pos in range(1, length)
        ]
        assert_matches(
            np.concatenate(steps),
            whole,
            exact=exact,
            tolerance=tolerance,
            what=f"1 token + {length - 1} decode steps vs one prefill of {length}",
        )

    def test_outputs_finite(self) -> None:
        """Every output is finite: logits of prefill ("last" and "all"), decode and batch
        items, and the hidden states of every bundle, on every shard of a pipeline.

        Fix: never return NaN or infinity; a numerically broken step is a backend failure
        (EngineCrashed), not an output."""
        h = self.harness
        ranges = [(0, h.n_layers)] + (
            split_ranges(h.n_layers, 3 if h.n_layers >= 3 else 2) if h.n_layers >= 2 else []
        )
        for start, end in ranges:
            engine = h.load(start, end)
            upstream = self._row_sources(start)
            session = h.session(f"finite-{start}-{end}")
            sequence = h.tokens(7, seed=5)
            outputs = [
                _rows(
                    h.prefill(
                        engine,
                        session,
                        0,
                        self._inputs_for(upstream, session, sequence[:6], 0),
                        logits="all",
                    )
                )
            ]
            outputs.append(
                _rows(
                    h.decode(engine, session, 6, self._inputs_for(upstream, session, sequence, 6))
                )
            )
            for index, rows in enumerate(outputs):
                assert np.isfinite(rows).all(), (
                    f"[{start}, {end}) output {index} holds NaN or infinity"
                )

    def test_split_invariance_fixture_splits(self) -> None:
        """Every pipeline the model fixture names (uneven splits) gives the full shard's
        logits: exact when the engine declares split_exact, else within its tolerance.
        Skipped when the fixture names none.

        Fix: as for the even splits; layer-index rules must hold for any boundary."""
        splits = self._split_boundaries()
        if not splits:
            suite_skip("the model fixture names no splits")
        for boundaries in splits:
            self._check_split(len(boundaries) - 1, boundaries)

    def test_every_boundary_dtype(self) -> None:
        """Every advertised boundary dtype works through a pipeline: bundles carry that
        dtype and a payload of its size, the tail accepts them, repeated runs are bit-equal
        (when deterministic), and an engine that advertises f16 does not silently send f32.

        Fix: convert hidden states to the loaded boundary_dtype and advertise only dtypes
        the engine can produce and consume."""
        h = self.harness
        self._need_layers(2, "a pipeline")
        (head_range, tail_range) = split_ranges(h.n_layers, 2)
        dtypes = h.load(*head_range).capabilities().boundary_dtypes
        for dtype in dtypes:
            runs: list[bytes] = []
            for attempt in range(2):
                head = h.load(*head_range, boundary_dtype=dtype)
                tail = h.load(*tail_range, boundary_dtype=dtype)
                session = h.session(f"{dtype}-{attempt}")
                bundle = h.head_bundle(head, session, 0, h.tokens(5, seed=1))
                assert bundle.dtype == dtype, f"a shard loaded with {dtype} sent {bundle.dtype}"
                assert len(bundle.payload) == bundle.expected_payload_bytes
                logits = h.prefill(tail, session, 0, bundle)
                step = bundle_of(h.decode(head, session, 5, (1,)))
                assert step.dtype == dtype
                decoded = h.decode(tail, session, 5, step)
                runs.append(
                    bytes(logits_array(logits).tobytes()) + bytes(logits_array(decoded).tobytes())
                )
            if head.capabilities().determinism.deterministic:
                assert runs[0] == runs[1], f"two {dtype} pipelines gave different logits"

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

    def _migration_or_skip(self, engine: ShardEngine) -> None:
        if not engine.capabilities().features.session_migration:
            suite_skip("engine does not advertise session migration")

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
