"""The standard tests of what results carry: request ids, sessions and positions, the evidence
class, timings that fit the caller's wall clock, and every returned object surviving the wire
codec. :class:`ShardEngineConformance` inherits them; their names are pinned in
:data:`RESULT_TESTS`, part of the standard tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Final

import numpy as np

from shard_engine_api import _codec
from shard_engine_api._checksum import payload_checksum
from shard_engine_api._errors import CacheMiss, ErrorInfo, ShardEngineError
from shard_engine_api._types import (
    CONTRACT_VERSION,
    BoundaryBundle,
    BoundaryResult,
    CancelRequest,
    DecodeBatchRequest,
    DecodeRequest,
    ShardResult,
    TokenInput,
)
from shard_engine_api.conformance._harness import (
    SuiteHelpers,
    _raises,
    assert_matches,
    assert_timings,
    bundle_of,
    logits_of,
    rebuilt_bundle,
    split_ranges,
)

__all__ = ["RESULT_TESTS", "ResultTests"]

RESULT_TESTS: Final[tuple[str, ...]] = (
    "test_evidence_class",
    "test_result_fields",
    "test_timings_against_the_wall_clock",
    "test_wire_round_trip_of_every_returned_object",
)
"""The tests of this module, sorted (part of STANDARD_TESTS)."""

_WALL_SLACK_MS: Final = 1.0
"""What an engine's own timings may exceed the caller's wall clock by (clock granularity)."""


class ResultTests(SuiteHelpers):
    """The standard tests of what results carry (module docstring)."""

    def test_result_fields(self) -> None:
        """Results echo the request id and session and carry the right positions: logits
        "last" is one row at start+n-1, "all" is n rows from start (whose last row equals
        "last"), a decode is at pos; bundles enter layer == the shard's end, with the shard's
        fingerprint, matching positions and a valid checksum; every result's timings (batch
        items' too) are finite and >= 0.

        Fix: build results from the request's positions (EngineCore._make_result does), and
        timings from one monotonic clock (time.perf_counter)."""
        h = self.harness
        engine = h.load()
        caps = engine.capabilities()
        tokens = h.tokens(5, seed=1)
        last_id = h.request_id()
        session = h.session("a")
        last = logits_of(h.prefill(engine, session, 0, tokens, request_id=last_id))
        assert last.request_id == last_id
        assert last.session == session
        assert (last.first_pos, last.n_rows, last.vocab_size) == (4, 1, caps.vocab_size), (
            f"logits 'last' of a 5-token prefill at 0: first_pos {last.first_pos}, "
            f"n_rows {last.n_rows} (expected 4, 1)"
        )
        assert payload_checksum(last.payload) == last.checksum, "logits checksum is wrong"
        every = logits_of(h.prefill(engine, h.session("b"), 0, tokens, logits="all"))
        assert (every.first_pos, every.n_rows) == (0, 5), (
            f"logits 'all': first_pos {every.first_pos}, n_rows {every.n_rows} (expected 0, 5)"
        )
        exact, tolerance = self._shape_exactness(caps)
        assert_matches(
            np.array(every.array())[-1:],
            np.array(last.array()),
            exact=exact,
            tolerance=tolerance,
            what="the last row of logits 'all' vs. logits 'last'",
        )
        step = logits_of(h.decode(engine, session, 5, (1,)))
        assert (step.first_pos, step.n_rows) == (5, 1), (
            f"decode at 5: first_pos {step.first_pos}, n_rows {step.n_rows}"
        )
        extended = logits_of(h.prefill(engine, session, 6, (2, 3), logits="all"))
        assert (extended.first_pos, extended.n_rows) == (6, 2)
        results: list[tuple[str, ShardResult]] = [
            ("a prefill (logits 'last')", last),
            ("a prefill (logits 'all')", every),
            ("a decode", step),
            ("a truncating prefill", extended),
        ]
        if h.n_layers >= 2:
            (head_range, _tail) = split_ranges(h.n_layers, 2)
            head = h.load(*head_range)
            head_caps = head.capabilities()
            result = h.prefill(head, session, 0, tokens)
            assert isinstance(result, BoundaryResult), "a head shard returns a BoundaryResult"
            bundle = result.bundle
            assert (result.first_pos, result.n_tokens) == (0, 5)
            assert result.session == session
            assert bundle.session == session
            assert (bundle.first_pos, bundle.n_tokens) == (0, 5)
            assert bundle.layer == head_range[1], (
                f"bundle.layer must be the producer's end {head_range[1]}, got {bundle.layer}"
            )
            assert bundle.model_fingerprint == head_caps.model_fingerprint
            assert bundle.hidden_size == head_caps.hidden_size
            assert bundle.contract_version == CONTRACT_VERSION
            assert payload_checksum(bundle.payload) == bundle.checksum, "bundle checksum wrong"
            assert len(bundle.payload) == bundle.expected_payload_bytes
            head_step = h.decode(head, session, 5, (1,))
            step_bundle = bundle_of(head_step)
            assert (step_bundle.first_pos, step_bundle.n_tokens) == (5, 1)
            results += [("a head prefill", result), ("a head decode", head_step)]
        for what, timed in results:
            assert_timings(timed.timings, what)
        if caps.features.batched_decode:
            for item in self._batch(engine, [self._item(session, 8, (4,))]).items:
                assert not isinstance(item, ErrorInfo), f"a batched decode failed: {item}"
                assert_timings(item.timings, "a batch item")

    def test_evidence_class(self) -> None:
        """Every result (logits, bundles, batch items) carries the evidence class of the
        capabilities, and the capabilities carry the class the engine registered; a fixture
        engine's run is therefore never reported as a real-model certification.

        Fix: stamp ``capabilities.evidence`` on every result; register the same class in
        the EngineDescription."""
        h = self.harness
        engines = [h.load()]
        if h.n_layers >= 2:
            engines += h.load_pipeline(2)
        full_caps = engines[0].capabilities()
        spec_evidence = h.record.spec_evidence
        if spec_evidence:
            assert set(spec_evidence) == {full_caps.evidence}, (
                f"the registered EngineDescription says {spec_evidence}, capabilities say "
                f"{full_caps.evidence!r}"
            )
        for engine in engines:
            caps = engine.capabilities()
            assert caps.evidence == full_caps.evidence, "shards disagree on evidence"
            session = h.session("a")
            inputs: TokenInput | BoundaryBundle
            if caps.shard.takes_tokens:
                inputs = TokenInput(token_ids=h.tokens(3, seed=1))
                step: TokenInput | BoundaryBundle = TokenInput(token_ids=(1,))
            else:
                producer = engines[1]
                inputs = bundle_of(h.prefill(producer, h.session("p"), 0, h.tokens(3, seed=1)))
                inputs = rebuilt_bundle(inputs, session=session)
                step = rebuilt_bundle(
                    bundle_of(h.decode(producer, h.session("p"), 3, (1,))), session=session
                )
            results: list[ShardResult] = [
                h.prefill(engine, session, 0, inputs),
                h.decode(engine, session, 3, step),
            ]
            if caps.features.batched_decode and caps.shard.takes_tokens:
                batch = engine.decode_batch(
                    DecodeBatchRequest(
                        request_id=h.request_id(),
                        items=(
                            DecodeRequest(
                                request_id=h.request_id(),
                                session=session,
                                pos=4,
                                inputs=TokenInput(token_ids=(2,)),
                            ),
                        ),
                    )
                )
                for outcome in batch.items:
                    assert not isinstance(outcome, ErrorInfo), outcome
                    results.append(h.observe(outcome))
            for result in results:
                assert result.evidence == caps.evidence, (
                    f"{type(result).__name__} says evidence {result.evidence!r}; capabilities "
                    f"of {caps.role} shard say {caps.evidence!r}"
                )

    def _round_trip(self, value: object, what: str) -> None:
        try:
            encoded = _codec.encode(value)  # type: ignore[arg-type]
            decoded = _codec.decode_message(encoded)
        except ShardEngineError as error:
            raise AssertionError(f"{what} does not survive the wire codec: {error!r}") from error
        assert type(decoded) is type(value), f"{what} came back as {type(decoded).__name__}"
        assert decoded == value, f"{what} changed over the wire codec: {value!r} -> {decoded!r}"

    def test_wire_round_trip_of_every_returned_object(self) -> None:
        """Every object the engine returns (capabilities, logits and boundary results,
        bundles, batch results with errors, cancel and release results, health, metrics, and
        the wire form of every raised error) round-trips through the project's codec
        unchanged and passes its checks (checksums, finite values, sizes); a CacheMiss's wire
        form carries its committed length and reason.

        Fix: return only contract types with valid field values (no numpy scalars, no
        subclasses, checksums over the payload, finite rows)."""
        h = self.harness
        engine = h.load()
        returned: list[tuple[str, object]] = [("capabilities", engine.capabilities())]
        session = h.session("wire")
        returned.append(
            (
                "prefill logits 'all'",
                h.prefill(engine, session, 0, h.tokens(4, seed=1), logits="all"),
            )
        )
        returned.append(("decode logits", h.decode(engine, session, 4, (1,))))
        if engine.capabilities().features.batched_decode:
            returned.append(
                (
                    "a batch result with an error item",
                    self._batch(
                        engine,
                        [self._item(session, 5, (2,)), self._item(h.session("ghost"), 3, (2,))],
                    ),
                )
            )
        returned.append(("a cancel result", engine.cancel(CancelRequest(request_id="nothing"))))
        returned.append(("health", engine.health()))
        returned.append(("metrics", engine.metrics()))
        for what, call in (
            ("cache miss", lambda: h.decode(engine, session, 99, (1,))),
            ("cache miss (unknown session)", lambda: h.decode(engine, h.session("no"), 0, (1,))),
            ("cache miss (prefill gap)", lambda: h.prefill(engine, session, 99, (1,))),
            ("stale epoch", lambda: h.prefill(engine, h.session("wire", epoch=0), 0, (1,))),
            ("invalid request", lambda: h.prefill(engine, session, 0, ())),
        ):
            error = _raises(ShardEngineError, call, what)
            info = error.to_info()
            if isinstance(error, CacheMiss):
                carried = (info.details.get("committed_length"), info.details.get("reason"))
                assert carried == (error.committed_length, error.reason), (
                    f"the wire form of {what} carries committed_length and reason {carried}, "
                    f"the error itself {(error.committed_length, error.reason)}: a remote caller "
                    "would replay from the wrong position"
                )
            returned.append((f"the wire form of {what}", info))
        if h.n_layers >= 2:
            (head_range, _tail) = split_ranges(h.n_layers, 2)
            head = h.load(*head_range)
            result = h.prefill(head, session, 0, h.tokens(3, seed=2))
            returned += [("a boundary result", result), ("a bundle", bundle_of(result))]
        returned.append(("a release result", h.release(engine, session)))
        returned.append(
            ("a release result of an unknown session", h.release(engine, h.session("never")))
        )
        for what, value in returned:
            self._round_trip(value, what)

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
