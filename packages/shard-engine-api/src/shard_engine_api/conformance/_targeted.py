"""The targeted standard tests: what the model-based test reaches poorly (measured cancel
latency, threads, in-flight pairs, batches with interleaved errors, limits at their bounds,
boundary checks on every path, wire round-trips, the error taxonomy, injected crashes, long
session ids), and the helpers every standard test shares. :class:`ShardEngineConformance`
inherits them; each test's docstring says what it checks and how to fix a failure.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt
import pytest

from shard_engine_api import _codec
from shard_engine_api._errors import (
    CacheMiss,
    Cancelled,
    ChecksumMismatch,
    ContractVersionMismatch,
    EngineCrashed,
    ErrorInfo,
    InvalidRequest,
    MalformedOutput,
    NotReady,
    ResourceExhausted,
    ShardEngineError,
    ShardMismatch,
    StaleEpoch,
    UnsupportedFeature,
    WrongRole,
    error_from_info,
)
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    AuxState,
    BoundaryBundle,
    BoundaryResult,
    CancelRequest,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    LogitsResult,
    MtpState,
    OutputKind,
    PrefillRequest,
    SessionRef,
    ShardInput,
    ShardResult,
    TokenInput,
)
from shard_engine_api.conformance._harness import (
    Canceller,
    Harness,
    Tolerances,
    assert_cancelled,
    assert_matches,
    assert_threads_match_serial,
    bundle_of,
    logits_array,
    rebuilt_bundle,
    replace_bundle,
    split_ranges,
)
from shard_engine_api.conformance._recorder import suite_skip
from shard_engine_api.conformance._stateful import DEEP_EXAMPLES, DEFAULT_EXAMPLES

__all__ = ["TargetedTests"]

_PROMPT: Final = 6
"""Prompt length used by most tests: long enough for history to matter, short to stay fast."""

_TAXONOMY: Final[tuple[type[ShardEngineError], ...]] = (
    InvalidRequest,
    WrongRole,
    ShardMismatch,
    ContractVersionMismatch,
    ChecksumMismatch,
    UnsupportedFeature,
    NotReady,
    CacheMiss,
    StaleEpoch,
    ResourceExhausted,
    Cancelled,
    MalformedOutput,
    EngineCrashed,
)
"""The classes an engine may raise (the root is never raised itself)."""
_BY_CODE: Final = {cls.code: cls for cls in _TAXONOMY}
MAX_RELATIVE_TOLERANCE: Final = 0.5
"""The largest relative tolerance (of a row's magnitude) the suite accepts as a declaration."""
_CANCEL_LATENCY_SLACK_MS: Final = 25.0
"""Added to twice the advertised cancel latency: thread wake-ups on a loaded machine."""
_IN_FLIGHT_VISIBLE_S: Final = 0.05
"""An operation that runs this long is seen in flight by a thread polling every 0.5 ms."""


def _raises(
    expected: type[ShardEngineError], call: Callable[[], object], what: str
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
    raise AssertionError(f"{what}: expected {expected.__name__}, but it returned {outcome!r}")


def _raises_exactly(
    expected: type[ShardEngineError], call: Callable[[], object], what: str
) -> ShardEngineError:
    """As :func:`_raises`, but the error must be of class ``expected`` itself (its code)."""
    error = _raises(expected, call, what)
    if type(error) is not expected:
        raise AssertionError(
            f"{what}: expected {expected.__name__} (code {expected.code!r}) itself, got "
            f"{type(error).__name__} (code {error.code!r}): {error}"
        )
    return error


class TargetedTests:
    """The targeted standard tests and the helpers all standard tests use."""

    harness: Harness

    # ----------------------------------------------------------------- shared helpers

    def _need_layers(self, n_layers: int, purpose: str) -> None:
        if self.harness.n_layers < n_layers:
            suite_skip(
                f"{purpose} needs a model fixture with >= {n_layers} layers; this one has "
                f"{self.harness.n_layers}"
            )

    def _head_and_tail(self) -> tuple[ShardEngine, ShardEngine]:
        self._need_layers(2, "a bundle-taking shard")
        (head_range, tail_range) = split_ranges(self.harness.n_layers, 2)
        return self.harness.load(*head_range), self.harness.load(*tail_range)

    def _tolerances(self, caps: Capabilities) -> Tolerances:
        """The engine's declared tolerance per output kind, recording what is measured."""
        return Tolerances.declared(caps.determinism, self.harness.record)

    def _exactness(self, caps: Capabilities) -> tuple[bool, Tolerances]:
        """Pipeline vs. one full shard: bit-exact when the engine declares split_exact."""
        return caps.determinism.split_exact, self._tolerances(caps)

    def _shape_exactness(self, caps: Capabilities) -> tuple[bool, Tolerances]:
        """The same positions computed through other batch shapes (decode vs. a longer
        prefill, chunks, logits of all rows vs. the last, replays after rollback or eviction):
        bit-exact only when the engine declares batch_invariant; else within its tolerance."""
        determinism = caps.determinism
        exact = determinism.batch_invariant and determinism.deterministic
        return exact, self._tolerances(caps)

    def _repeat_exactness(self, caps: Capabilities) -> tuple[bool, Tolerances]:
        """The same calls repeated: bit-exact when the engine declares deterministic."""
        return caps.determinism.deterministic, self._tolerances(caps)

    def _batch_exactness(self, caps: Capabilities) -> tuple[bool, Tolerances]:
        """Batched vs. single decode: bit-exact when the engine declares batch_invariant."""
        determinism = caps.determinism
        exact = determinism.batch_invariant and determinism.deterministic
        return exact, self._tolerances(caps)

    def _isolation_exactness(self, caps: Capabilities) -> tuple[bool, Tolerances]:
        """A session run alone vs. interleaved with others (other cache layouts, other
        batches around it): bit-exact when the engine declares deterministic and
        batch_invariant; else within its tolerance."""
        return self._shape_exactness(caps)

    def _check_declared_tolerances(self, engine: ShardEngine) -> None:
        """The declared tolerances are numbers a comparison can fail: finite, >= 0, a
        relative part of at most ``MAX_RELATIVE_TOLERANCE``, and (when any comparison uses
        them) too tight to accept the outputs of a different prompt as the same."""
        h = self.harness
        determinism = engine.capabilities().determinism
        legacy = determinism.tolerance
        if not (math.isfinite(legacy) and legacy >= 0.0):
            raise AssertionError(f"determinism.tolerance is {legacy!r}; it must be finite and >= 0")
        kinds: tuple[OutputKind, ...] = ("logits", "hidden")
        for kind in kinds:
            declared = determinism.tolerance_for(kind)
            assert declared.relative <= MAX_RELATIVE_TOLERANCE, (
                f"the declared {kind} tolerance {declared} allows {declared.relative:.0%} of a "
                f"row's magnitude; at most {MAX_RELATIVE_TOLERANCE:.0%} is a bound a wrong output "
                "can fail"
            )
        if determinism.deterministic and determinism.split_exact and determinism.batch_invariant:
            return  # every comparison is bit for bit; no tolerance is ever applied
        tolerances = Tolerances.declared(determinism)
        first, second = h.tokens(_PROMPT, seed=1), h.tokens(_PROMPT, seed=2)
        engines: list[tuple[ShardEngine, OutputKind]] = [(engine, "logits")]
        if h.n_layers >= 2:
            (head_range, _tail) = split_ranges(h.n_layers, 2)
            engines.append((h.load(*head_range), "hidden"))
        for shard, kind in engines:
            outputs = [
                self._rows(
                    h.prefill(shard, h.session(f"tolerance-{seed}"), 0, tokens, logits="all")
                )
                for seed, tokens in ((1, first), (2, second))
            ]
            try:
                assert_matches(
                    outputs[1], outputs[0], exact=False, tolerance=tolerances, what="", kind=kind
                )
            except AssertionError:
                continue  # some row of the other prompt lies outside the tolerance
            raise AssertionError(
                f"the declared {kind} tolerance {tolerances.of(kind)} accepts the outputs of "
                f"another prompt ({_PROMPT} positions) as equal: comparisons within it cannot "
                "fail, so the tests that rely on it would pass any output"
            )

    def _split_boundaries(self) -> list[tuple[int, ...]]:
        """The pipelines split tests run: the fixture's own splits (uneven ones) and, when it
        has none, even 2- and 3-way splits."""
        n = self.harness.n_layers
        splits: list[tuple[int, ...]] = []
        for split in self.harness.fixture.splits:
            if (
                len(split) < 3
                or split[0] != 0
                or split[-1] != n
                or list(split) != sorted(set(split))
            ):
                raise AssertionError(
                    f"model fixture split {split} is not 0 < ... < {n} with >= 2 parts"
                )
            splits.append(tuple(split))
        return splits

    def _examples(self, request: pytest.FixtureRequest, budget_s: float = 12.0) -> int:
        """Examples per configuration of the model-based test: ``--shard-engine-examples``
        when given; else the default, fewer for a slow engine so that one configuration stays
        within about ``budget_s`` seconds (never fewer than 2)."""
        value = request.config.getoption("shard_engine_examples", default=None)
        if value is not None:
            return max(1, int(value))
        if request.config.getoption("shard_engine_profile", default="default") == "deep":
            return DEEP_EXAMPLES
        h = self.harness
        started = time.perf_counter()
        engine = h.load()
        session = h.session("probe")
        h.prefill(engine, session, 0, h.tokens(4, seed=1))
        for pos in range(4, 8):
            h.decode(engine, session, pos, (1,))
        engine.close()
        # An example is a fresh engine and about 24 steps, each with a replay: ~6 probes.
        per_example = 6.0 * (time.perf_counter() - started)
        return max(2, min(DEFAULT_EXAMPLES, int(budget_s / max(per_example, 1e-6))))

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

    def _slow(self, **overrides: object) -> ShardEngine:
        """An engine with the fixture's cancellation options (operations slow enough to be
        cancelled mid-way)."""
        h = self.harness
        options = dict(h.target.cancel_load_options)
        return h.load(0, None, options=options, **overrides)

    def _batch(self, engine: ShardEngine, items: Sequence[DecodeRequest]) -> DecodeBatchResult:
        return engine.decode_batch(
            DecodeBatchRequest(request_id=self.harness.request_id(), items=tuple(items))
        )

    def _item(
        self, session: SessionRef, pos: int, inputs: ShardInput | Sequence[int], **fields: object
    ) -> DecodeRequest:
        request = DecodeRequest(
            request_id=self.harness.request_id(),
            session=session,
            pos=pos,
            inputs=inputs
            if isinstance(inputs, TokenInput | BoundaryBundle)
            else TokenInput(token_ids=tuple(inputs)),
        )
        return msgspec.structs.replace(request, **fields) if fields else request

    def _need_batches(self, engine: ShardEngine) -> None:
        """Skip unless ``engine`` advertises batched decode; one that does not must refuse
        ``decode_batch`` with UnsupportedFeature and change nothing (a batch it serves
        anyway would otherwise never be checked)."""
        caps = engine.capabilities()
        if caps.features.batched_decode:
            return
        h = self.harness
        session = h.session(f"unbatched-{h.request_id()}")
        length = 0
        if caps.shard.takes_tokens:
            length = 2
            h.prefill(engine, session, 0, h.tokens(length, seed=3))
        _raises_exactly(
            UnsupportedFeature,
            lambda: self._batch(engine, [self._item(session, length, (1,))]),
            "decode_batch on an engine that declares features.batched_decode = False",
        )
        if length:
            assert self._committed_length(engine, session) == length, (
                "a refused decode_batch changed the session"
            )
            h.release(engine, session)
        suite_skip("engine declares features.batched_decode = False (and refuses batches)")

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

    def _observed_decode(self, engine: ShardEngine, request: DecodeRequest) -> ShardResult:
        return self.harness.observe(engine.decode(request))

    def _run_observed(self, engine: ShardEngine, call: Callable[[], object]) -> tuple[int, float]:
        """Run ``call`` on another thread while this one polls ``health().in_flight``; the
        most requests seen in flight and how long the call ran (its error is re-raised)."""
        outcome: dict[str, BaseException] = {}

        def run() -> None:
            try:
                call()
            except BaseException as error:  # noqa: BLE001 - re-raised by the test thread
                outcome["error"] = error

        worker = threading.Thread(target=run, name="conformance-in-flight", daemon=True)
        most = 0
        started = time.monotonic()
        worker.start()
        while worker.is_alive():
            most = max(most, engine.health().in_flight)
            time.sleep(0.0005)
        ran = time.monotonic() - started
        worker.join()
        if "error" in outcome:
            raise outcome["error"]
        return most, ran

    @staticmethod
    def _two_in_flight(engine: ShardEngine, threads: Sequence[threading.Thread]) -> bool:
        """Whether the engine reports two requests in flight at once within 5 s, while the
        started ``threads`` that run them are alive."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(t.is_alive() for t in threads):
            if engine.health().in_flight >= 2:
                return True
            time.sleep(0.0002)
        return False

    @staticmethod
    def _both_cancels_landed(
        h: Harness, engine: ShardEngine, landed: dict[str, int], what: str
    ) -> None:
        """After the attempts of a cancel test: some cancel stopped the running ``what``, both
        targets (request id and session id) did, and nothing is left in flight."""
        if not any(landed.values()):
            h.no_cancel_landed(f"no cancel landed while a {what} ran")
        missed = [kind for kind, count in landed.items() if not count]
        assert not missed, (
            f"cancel by {missed[0]} never stopped a running {what} while cancel by the other "
            "target did, with the same timing"
        )
        assert engine.health().in_flight == 0

    def _committed_length(self, engine: ShardEngine, session: SessionRef) -> int:
        """The committed length as the engine reports it: a decode at a position the session
        cannot be at (max_context - 1) must miss and carry it."""
        h = self.harness
        probe = engine.capabilities().limits.max_context - 1
        try:
            h.decode(engine, session, probe, self._probe_row(engine, session, probe))
        except CacheMiss as miss:
            return miss.committed_length
        raise AssertionError(f"a decode of {session.session_id} at {probe} did not miss")

    def _probe_row(self, engine: ShardEngine, session: SessionRef, pos: int) -> ShardInput:
        """A well-formed one-row input for ``engine`` at ``pos`` (a token, or a zero row)."""
        caps = engine.capabilities()
        if caps.shard.takes_tokens:
            return TokenInput(token_ids=(0,))
        return BoundaryBundle.from_array(
            np.zeros((1, caps.hidden_size), np.float32),
            session=session,
            first_pos=pos,
            layer=caps.shard.start,
            model_fingerprint=caps.model_fingerprint,
            dtype=engine.capabilities().boundary_dtypes[0],
        )

    def _cancel_mid_flight(
        self, engine: ShardEngine, cancel: CancelRequest, run: Callable[[], object]
    ) -> tuple[bool, Canceller]:
        """Run ``run`` while a canceller cancels ``cancel``; True if it raised Cancelled."""
        canceller = Canceller(engine, cancel, 0.0)
        canceller.start()
        try:
            run()
            cancelled = False
        except Cancelled as error:
            assert_cancelled(error, "a call cancelled mid-flight")
            cancelled = True
        finally:
            canceller.stop()
        if canceller.error is not None:
            raise AssertionError(f"cancel() raised {canceller.error!r}") from canceller.error
        return cancelled, canceller

    def _row_sources(self, start: int) -> ShardEngine | None:
        """A fresh upstream shard ``[0, start)`` (None for a token-taking shard)."""
        return self.harness.load(0, start, max_batch_tokens=64) if start > 0 else None

    def _inputs_for(
        self,
        upstream: ShardEngine | None,
        session: SessionRef,
        sequence: Sequence[int],
        first: int,
    ) -> ShardInput:
        """The inputs of positions ``first..`` of ``sequence`` for a shard whose upstream is
        ``upstream``: token ids, or rows of a fresh upstream run over the whole sequence."""
        h = self.harness
        if upstream is None:
            return TokenInput(token_ids=tuple(sequence[first:]))
        scratch = SessionRef(session_id=f"upstream-{h.request_id()}", epoch=1)
        bundle = bundle_of(h.prefill(upstream, scratch, 0, tuple(sequence)))
        h.release(upstream, scratch)
        width = len(bundle.payload) // bundle.n_tokens
        payload = memoryview(bytes(bundle.payload[first * width :]))
        return rebuilt_bundle(
            bundle,
            session=session,
            first_pos=first,
            n_tokens=len(sequence) - first,
            payload=payload,
        )

    @staticmethod
    def _rows(result: ShardResult) -> npt.NDArray[np.floating]:
        if isinstance(result, LogitsResult):
            return np.array(result.array())
        return np.array(result.bundle.array())

    # ================================================================= cancellation

    def test_cancel_latency_within_advertised_bound(self) -> None:
        """The advertised ``features.cancel_latency_ms`` holds: from ``cancel`` (another
        thread) to the caller seeing Cancelled takes at most twice the bound plus 25 ms, at
        best over a few attempts on a slow operation (the fixture's cancellation options).
        Skipped when no attempt could be cancelled mid-operation.

        Fix: poll the cancel token (or abort callback) often enough inside long operations,
        or advertise the latency the engine really has."""
        h = self.harness
        engine = self._slow()
        caps = engine.capabilities()
        if not caps.features.cancel:
            suite_skip("engine does not advertise cancel")
        limit_ms = 2.0 * caps.features.cancel_latency_ms + _CANCEL_LATENCY_SLACK_MS
        length = max(1, min(caps.limits.max_batch_tokens, caps.limits.max_context - 1, 64))
        best: float | None = None
        for attempt in range(4):
            session = h.session(f"latency-{attempt}")
            request_id = h.request_id()
            outcome: dict[str, float] = {}

            def run(
                session: SessionRef = session,
                request_id: str = request_id,
                seed: int = attempt,
                outcome: dict[str, float] = outcome,
            ) -> None:
                try:
                    h.prefill(
                        engine, session, 0, h.tokens(length, seed=seed), request_id=request_id
                    )
                except Cancelled:
                    outcome["cancelled_at"] = time.perf_counter()

            worker = threading.Thread(target=run, daemon=True)
            worker.start()
            deadline = time.monotonic() + 5.0
            while engine.health().in_flight == 0 and worker.is_alive():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.0005)
            time.sleep(min(0.005, caps.features.cancel_latency_ms / 4000.0))
            sent = time.perf_counter()
            result = engine.cancel(CancelRequest(request_id=request_id))
            worker.join(timeout=30.0)
            assert not worker.is_alive(), "a cancelled prefill did not return within 30 s"
            if not result.cancelled or "cancelled_at" not in outcome:
                continue
            latency = (outcome["cancelled_at"] - sent) * 1000.0
            best = latency if best is None else min(best, latency)
            if best <= limit_ms:
                break
        if best is None:
            h.no_cancel_landed("no cancel landed mid-operation in four attempts")
        assert best <= limit_ms, (
            f"cancel took {best:.1f} ms at best from cancel() to Cancelled; the engine "
            f"advertises {caps.features.cancel_latency_ms} ms (allowed {limit_ms:.1f} ms)"
        )

    def test_cancel_after_completion_result_stands(self) -> None:
        """A cancel that arrives after the request finished (by request id or session id)
        reports nothing cancelled, and the finished request's result stands: the session
        keeps its new length and decodes as a clean run; metrics count no cancellation.

        Fix: cancel only in-flight requests; never roll back a committed one."""
        h = self.harness
        engine = h.load()
        exact, tolerance = self._shape_exactness(engine.capabilities())
        session = h.session("done")
        finished = h.request_id()
        tokens = h.tokens(5, seed=1)
        h.prefill(engine, session, 0, tokens, request_id=finished)
        for request in (
            CancelRequest(request_id=finished),
            CancelRequest(session_id=session.session_id),
        ):
            result = engine.cancel(request)
            assert (result.cancelled, result.n_requests) == (False, 0), (
                f"cancel of a finished request ({request}) returned {result}"
            )
        assert engine.metrics().cancelled == 0, "a late cancel was counted as a cancellation"
        assert engine.health().kv_used_tokens == 5, "a late cancel changed the cached positions"
        got = logits_array(h.decode(engine, session, 5, (3,)))
        clean = h.load()
        h.prefill(clean, session, 0, tokens)
        want = logits_array(h.decode(clean, session, 5, (3,)))
        assert_matches(
            got, want, exact=exact, tolerance=tolerance, what="decode after a late cancel"
        )

    def test_cancel_one_of_two_in_flight(self) -> None:
        """With two prefills in flight (two threads), cancelling one by request id, then
        (another pair) by session id, stops only that one (Cancelled, its new session left
        no state), although the other's ids extend the cancelled one's; the other completes
        with the output of a clean run. Skipped when the two never overlapped.

        Fix: keep one cancel token per request; cancel by id sets only that token, matching
        request and session ids exactly (never by prefix)."""
        engine = self._slow()
        caps = engine.capabilities()
        if not caps.features.cancel:
            suite_skip("engine does not advertise cancel")
        checked = [self._cancel_one_of_two(engine, by) for by in ("request_id", "session_id")]
        if not any(checked):
            self.harness.no_cancel_landed(
                "the two prefills were never seen in flight together (or never cancelled)"
            )

    def _cancel_one_of_two(self, engine: ShardEngine, by: str) -> bool:
        """One round of :meth:`test_cancel_one_of_two_in_flight`, cancelling the first
        prefill ``by`` its request id or its session id; the second's ids extend the first's
        (a cancel naming one id must not match by prefix). False if they never overlapped."""
        h = self.harness
        caps = engine.capabilities()
        exact, tolerance = self._isolation_exactness(caps)
        length = max(1, min(caps.limits.max_batch_tokens, caps.limits.max_context - 1, 48))
        clean = h.load()
        for attempt in range(5):
            first = h.session(f"{by}-{attempt}")
            second = h.session(f"{by}-{attempt}-2")
            first_id = h.request_id()
            second_id = f"{first_id}-2"
            first_tokens = h.tokens(length, seed=1)
            second_tokens = h.tokens(length, seed=2)
            outcomes: dict[str, object] = {}

            def run(
                name: str,
                session: SessionRef,
                tokens: tuple[int, ...],
                request_id: str,
                outcomes: dict[str, object] = outcomes,
            ) -> None:
                try:
                    outcomes[name] = h.prefill(engine, session, 0, tokens, request_id=request_id)
                except ShardEngineError as error:
                    outcomes[name] = error

            threads = [
                threading.Thread(
                    target=run, args=("first", first, first_tokens, first_id), daemon=True
                ),
                threading.Thread(
                    target=run, args=("second", second, second_tokens, second_id), daemon=True
                ),
            ]
            for thread in threads:
                thread.start()
            overlapped = self._two_in_flight(engine, threads)
            named = (
                CancelRequest(request_id=first_id)
                if by == "request_id"
                else CancelRequest(session_id=first.session_id)
            )
            result = engine.cancel(named) if overlapped else None
            for thread in threads:
                thread.join(timeout=30.0)
            if not overlapped or result is None or not isinstance(outcomes.get("first"), Cancelled):
                for session in (first, second):
                    h.release(engine, session)
                continue
            assert result.n_requests == 1, f"cancel naming one {by} stopped {result}"
            other = outcomes.get("second")
            assert isinstance(other, ShardResult), (
                f"cancelling the first request disturbed the second: {other!r}"
            )
            want = self._rows(h.prefill(clean, second, 0, second_tokens))
            assert_matches(
                self._rows(other),
                want,
                exact=exact,
                tolerance=tolerance,
                what="the request left running vs a clean run",
            )
            health = engine.health()
            assert health.sessions == 1, f"{health.sessions} sessions; only the second survives"
            assert health.kv_used_tokens == length
            h.decode(engine, second, length, (1,))
            h.release(engine, second)
            return True
        return False

    def test_cancel_running_batch(self) -> None:
        """A running decode_batch is cancelled by its request id and by one item's session
        id: the caller sees Cancelled and every item's session is as before (same committed
        length, the next decode equals a clean run); or, if the cancel came too late, the
        batch completed consistently. Skipped when no cancel landed.

        Fix: give the batch one cancel token naming every item's session, poll it, and
        roll every item back."""
        h = self.harness
        engine = self._slow()
        caps = engine.capabilities()
        if not caps.features.cancel:
            suite_skip("engine does not advertise cancel")
        self._need_batches(engine)
        exact, tolerance = self._shape_exactness(caps)
        clean = h.load()
        landed = {"request id": 0, "session id": 0}
        for attempt in range(6):
            sessions = [h.session(f"batch-{attempt}-{index}") for index in range(2)]
            for index, session in enumerate(sessions):
                h.prefill(engine, session, 0, h.tokens(4, seed=index))
            items = [self._item(session, 4, (index + 1,)) for index, session in enumerate(sessions)]
            request = DecodeBatchRequest(request_id=h.request_id(), items=tuple(items))
            cancel = (
                CancelRequest(request_id=request.request_id)
                if attempt % 2 == 0
                else CancelRequest(session_id=sessions[1].session_id)
            )
            cancelled, _ = self._cancel_mid_flight(
                engine, cancel, partial(engine.decode_batch, request)
            )
            expected_length = 4 if cancelled else 5
            landed["request id" if attempt % 2 == 0 else "session id"] += cancelled
            for index, session in enumerate(sessions):
                length = self._committed_length(engine, session)
                assert length == expected_length, (
                    f"after a {'cancelled' if cancelled else 'completed'} batch ({cancel}), "
                    f"item {index} holds {length} positions, expected {expected_length}"
                )
                clean_session = h.session(f"clean-{attempt}-{index}")
                h.prefill(clean, clean_session, 0, h.tokens(4, seed=index))
                if not cancelled:
                    h.decode(clean, clean_session, 4, (index + 1,))
                want = logits_array(h.decode(clean, clean_session, expected_length, (7,)))
                got = logits_array(h.decode(engine, session, expected_length, (7,)))
                assert_matches(
                    got,
                    want,
                    exact=exact,
                    tolerance=tolerance,
                    what=f"decode after a {'cancelled' if cancelled else 'completed'} batch",
                )
            if all(landed.values()):
                break
        self._both_cancels_landed(h, engine, landed, "batch")

    def test_cancel_running_decode(self) -> None:
        """A running single decode, slowed by the fixture's cancellation options, is
        cancelled from another thread by its request id and by its session id: the caller
        sees Cancelled, cancel() reported exactly one request, and the session is as before
        (same committed length, the next decode equals a clean run); or, when the cancel came
        too late, cancel() said nothing was cancelled and the decode committed. Fails when no
        cancel landed although cancellation options were supplied (skipped without them).

        Fix: register a decode for cancel like a prefill, poll its token during the forward,
        roll it back, and answer cancelled=True only for a decode that will not commit."""
        h = self.harness
        engine = self._slow()
        caps = engine.capabilities()
        if not caps.features.cancel:
            suite_skip("engine does not advertise cancel")
        exact, tolerance = self._shape_exactness(caps)
        clean = h.load()
        landed = {"request id": 0, "session id": 0}
        for attempt in range(8):
            by = "request id" if attempt % 2 == 0 else "session id"
            session = h.session(f"decode-{attempt}")
            prompt = h.tokens(4, seed=attempt)
            h.prefill(engine, session, 0, prompt)
            request = DecodeRequest(
                request_id=h.request_id(),
                session=session,
                pos=4,
                inputs=TokenInput(token_ids=(5,)),
            )
            cancel = (
                CancelRequest(request_id=request.request_id)
                if by == "request id"
                else CancelRequest(session_id=session.session_id)
            )
            cancelled, canceller = self._cancel_mid_flight(
                engine, cancel, partial(self._observed_decode, engine, request)
            )
            if cancelled:
                reported = canceller.result
                assert reported is not None, (
                    "the decode's caller saw Cancelled, but cancel() never said cancelled=True"
                )
                assert reported.n_requests == 1, (
                    f"the decode's caller saw Cancelled; cancel by {by} returned {reported} "
                    "(expected cancelled=True, n_requests=1)"
                )
            else:
                assert canceller.result is None, (
                    f"cancel by {by} returned {canceller.result} while the decode ran, yet the "
                    "decode committed and returned its result; cancelled=True means the "
                    "operation will not commit"
                )
            landed[by] += cancelled
            expected_length = 4 if cancelled else 5
            length = self._committed_length(engine, session)
            assert length == expected_length, (
                f"after a {'cancelled' if cancelled else 'completed'} decode the session holds "
                f"{length} positions, expected {expected_length}"
            )
            reference = h.session(f"clean-decode-{attempt}")
            h.prefill(clean, reference, 0, prompt)
            if not cancelled:
                h.decode(clean, reference, 4, (5,))
            want = logits_array(h.decode(clean, reference, expected_length, (7,)))
            got = logits_array(h.decode(engine, session, expected_length, (7,)))
            assert_matches(
                got,
                want,
                exact=exact,
                tolerance=tolerance,
                what=f"decode after a {'cancelled' if cancelled else 'completed'} decode",
            )
            h.release(engine, session)
            h.release(clean, reference)
            if all(landed.values()):
                break
        self._both_cancels_landed(h, engine, landed, "decode")

    def test_cancel_session_stops_all_its_requests(self) -> None:
        """With two prefills of one session in flight (two threads, slowed by the fixture's
        cancellation options), one cancel by session id stops both: both callers see
        Cancelled, CancelResult.n_requests is 2 (in general: exactly the number of requests
        whose callers saw Cancelled), and the session keeps its committed length. Fails when
        the two were never cancelled together although cancellation options were supplied
        (skipped without them).

        Fix: cancel every in-flight request naming the session (queued ones included) and
        count each one stopped in n_requests."""
        h = self.harness
        engine = self._slow()
        caps = engine.capabilities()
        if not caps.features.cancel:
            suite_skip("engine does not advertise cancel")
        for attempt in range(5):
            session = h.session(f"pair-{attempt}")
            h.prefill(engine, session, 0, h.tokens(4, seed=attempt))
            request_ids = [h.request_id() for _ in range(2)]
            outcomes: dict[str, object] = {}

            def run(
                request_id: str,
                seed: int,
                session: SessionRef = session,
                outcomes: dict[str, object] = outcomes,
            ) -> None:
                try:
                    outcomes[request_id] = h.prefill(
                        engine, session, 4, h.tokens(3, seed=seed), request_id=request_id
                    )
                except BaseException as failure:  # noqa: BLE001 - judged by the test thread
                    outcomes[request_id] = failure

            threads = [
                threading.Thread(target=run, args=(request_id, index + 7), daemon=True)
                for index, request_id in enumerate(request_ids)
            ]
            for thread in threads:
                thread.start()
            together = self._two_in_flight(engine, threads)
            result = engine.cancel(CancelRequest(session_id=session.session_id))
            for thread in threads:
                thread.join(timeout=30.0)
            assert not any(t.is_alive() for t in threads), "a prefill did not return in 30 s"
            for outcome in outcomes.values():
                if isinstance(outcome, BaseException) and not isinstance(outcome, ShardEngineError):
                    raise outcome
            stopped = [o for o in outcomes.values() if isinstance(o, Cancelled)]
            for error in stopped:
                assert_cancelled(error, "a prefill cancelled by its session")
            assert (result.cancelled, result.n_requests) == (bool(stopped), len(stopped)), (
                f"cancel by session returned {result}, but {len(stopped)} of the session's two "
                "in-flight prefills saw Cancelled; n_requests counts every request it stopped"
            )
            if together and len(stopped) == 2:
                length = self._committed_length(engine, session)
                assert length == 4, (
                    f"both prefills were cancelled, yet the session holds {length} positions "
                    "(expected 4)"
                )
                h.release(engine, session)
                assert engine.health().in_flight == 0
                return
            h.release(engine, session)
        h.no_cancel_landed("two prefills of one session were never cancelled together")

    def test_in_flight_while_running(self) -> None:
        """``health().in_flight`` counts the requests running now: while a prefill, a decode
        and (when advertised) a decode_batch run on another thread, slowed by the fixture's
        cancellation options, health() polled from this thread sees at least one in flight
        (an operation that runs 50 ms or more unseen fails), and none once they returned.
        Fails when no operation was seen although cancellation options were supplied
        (skipped without them).

        Fix: count a request in flight from its arrival until it returns (EngineCore keeps
        one entry per request) and report that count in Health.in_flight."""
        h = self.harness
        engine = self._slow()
        caps = engine.capabilities()
        session = h.session("running")
        operations: list[tuple[str, Callable[[], object]]] = [
            ("prefill", partial(h.prefill, engine, session, 0, h.tokens(4, seed=1))),
            ("decode", partial(h.decode, engine, session, 4, (1,))),
        ]
        if caps.features.batched_decode:
            operations.append(
                ("decode_batch", lambda: self._batch(engine, [self._item(session, 5, (2,))]))
            )
        seen = 0
        for name, call in operations:
            most, ran = self._run_observed(engine, call)
            assert most >= 1 or ran < _IN_FLIGHT_VISIBLE_S, (
                f"a {name} ran for {ran * 1000:.0f} ms while health().in_flight stayed 0 "
                "(polled every 0.5 ms from another thread)"
            )
            assert engine.health().in_flight == 0, f"health().in_flight after the {name} returned"
            seen += most >= 1
        if not seen:
            h.no_cancel_landed("no operation was ever seen in flight")

    # ================================================================= batches

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
                want = self._rows(h.decode(single, item.session, item.pos, item.inputs))
                assert_matches(
                    self._rows(outcome),
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
                self._rows(h.decode(engine, twice, length, (5,))),
                self._rows(h.decode(clean, reference, length, (5,))),
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

    # ================================================================= boundaries

    def test_boundary_checks_on_every_path(self) -> None:
        """Bundles are checked on prefill, decode and batch items alike, on the tail and
        the middle shard: a wrong checksum is ChecksumMismatch; another fingerprint, an
        empty fingerprint, or a layer one below (layer 0 included) or one above the shard's
        start is ShardMismatch (that class exactly, not a plain InvalidRequest). Nothing
        changes.

        Fix: run the same bundle checks (checksum, fingerprint, layer == start, hidden
        size) for every operation that takes a bundle, before any state is touched."""
        h = self.harness
        self._need_layers(2, "a bundle-taking shard")
        ranges = split_ranges(h.n_layers, 3 if h.n_layers >= 3 else 2)[1:]
        for start, end in ranges:
            upstream = h.load(0, start)
            engine = h.load(start, end)
            batched = engine.capabilities().features.batched_decode
            session = h.session(f"checked-{start}")
            tokens = h.tokens(4, seed=1)
            prompt = bundle_of(h.prefill(upstream, session, 0, tokens))
            row = bundle_of(h.decode(upstream, session, 4, (2,)))

            def variants(
                bundle: BoundaryBundle, start: int = start
            ) -> list[tuple[str, type[ShardEngineError], BoundaryBundle]]:
                # A bundle that names no model, or enters no producer's end (layer 0), is not
                # this shard's bundle: ShardMismatch, like any other model or layer.
                return [
                    (
                        "checksum off by one",
                        ChecksumMismatch,
                        replace_bundle(bundle, checksum=bundle.checksum ^ 1),
                    ),
                    (
                        "another fingerprint",
                        ShardMismatch,
                        replace_bundle(bundle, model_fingerprint=bundle.model_fingerprint + "x"),
                    ),
                    (
                        "an empty fingerprint",
                        ShardMismatch,
                        replace_bundle(bundle, model_fingerprint=""),
                    ),
                    (
                        "layer one below the start",
                        ShardMismatch,
                        replace_bundle(bundle, layer=start - 1),
                    ),
                    (
                        "layer one above the start",
                        ShardMismatch,
                        replace_bundle(bundle, layer=start + 1),
                    ),
                ]

            where = f"[{start}, {end})"
            for what, error, candidate in variants(prompt):
                _raises_exactly(
                    error,
                    partial(h.prefill, engine, session, 0, candidate),
                    f"{where} prefill: {what}",
                )
            assert engine.health().sessions == 0, f"{where}: a refused bundle created a session"
            h.prefill(engine, session, 0, prompt)
            for what, error, candidate in variants(row):
                _raises_exactly(
                    error,
                    partial(h.decode, engine, session, 4, candidate),
                    f"{where} decode: {what}",
                )
                if batched:
                    [outcome] = self._batch(engine, [self._item(session, 4, candidate)]).items
                    codes = {error.code}
                    assert isinstance(outcome, ErrorInfo), f"{where} batch item: {what}: served"
                    assert outcome.code in codes, (
                        f"{where} batch item: {what}: expected {error.code}, got {outcome!r}"
                    )
            assert self._committed_length(engine, session) == 4
            h.decode(engine, session, 4, row)

    # ================================================================= limits

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

    # ================================================================= long runs and roles

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
            got = self._rows(
                h.prefill(
                    engine,
                    session,
                    4,
                    self._inputs_for(upstream, session, edited_sequence, 4),
                    logits="all",
                )
            )
            fresh = h.session(f"fresh-{start}")
            want = self._rows(
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
            renewed = self._rows(
                h.prefill(engine, newer, 0, self._inputs_for(upstream, newer, edit, 0))
            )
            other = h.session(f"other-{start}")
            baseline = self._rows(
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

    # ================================================================= epochs and tombstones

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
                self._rows(h.decode(engine, session, length, (4,))),
                self._rows(h.decode(clean, session, length, (4,))),
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

    # ================================================================= wire and taxonomy

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

    def test_error_codes_match_taxonomy(self) -> None:
        """Every error raised (and every error item of a batch) is an instance of exactly one
        taxonomy class with that class's code, and its retryable flag is the contract's: the
        class default, except that ResourceExhausted is retryable only for occupancy a release
        or eviction can free (KV budget, session slots), not for positions past max_context,
        and NotReady only while the engine is loading (never before load or after close). The
        wire form rebuilds the same class. A subclass with its own code, or a retryable
        StaleEpoch, violates the contract. Every raised error survives the wire: encoded,
        decoded and rebuilt (``to_info``, the codec, ``error_from_info``) it has the same
        class, code and retryable flag, and a CacheMiss the same committed length and reason.

        Fix: raise the contract's error classes themselves, with their default retryable;
        retryable=False for a context overflow and for an unloaded or closed engine."""
        h = self.harness
        engine = h.load(max_sessions=2, eviction="reject")
        vocab = engine.capabilities().vocab_size
        session = h.session("a")
        h.prefill(engine, session, 0, h.tokens(3, seed=1))
        h.prefill(engine, h.session("b", epoch=2), 0, h.tokens(3, seed=1))
        full = h.load(max_context=12, max_batch_tokens=16, kv_budget_tokens=64)
        limit = full.capabilities().limits.max_context
        h.prefill(full, session, 0, h.tokens(limit, seed=4))
        calls: list[tuple[str, Callable[[], object]]] = [
            ("cache miss", lambda: h.decode(engine, session, 9, (1,))),
            ("cache miss (unknown session)", lambda: h.decode(engine, h.session("z"), 0, (1,))),
            ("cache miss (prefill gap)", lambda: h.prefill(engine, session, 9, (1,))),
            ("stale epoch (decode)", lambda: h.decode(engine, h.session("b", epoch=1), 3, (1,))),
            ("stale epoch", lambda: h.prefill(engine, h.session("b", epoch=1), 0, (1,))),
            ("resource exhausted (slots)", lambda: h.prefill(engine, h.session("c"), 0, (1,))),
            ("resource exhausted (context)", lambda: h.decode(full, session, limit, (1,))),
            ("invalid token", lambda: h.prefill(engine, session, 3, (vocab,))),
            (
                "reserved field",
                lambda: engine.prefill(
                    PrefillRequest(
                        request_id=h.request_id(),
                        session=session,
                        start_pos=3,
                        inputs=TokenInput(token_ids=(1,)),
                        mtp=(MtpState(n_draft_tokens=1),),
                    )
                ),
            ),
        ]
        if h.n_layers >= 2:
            (head_range, tail_range) = split_ranges(h.n_layers, 2)
            head, tail = h.load(*head_range), h.load(*tail_range)
            bundle = h.head_bundle(head, session, 0, h.tokens(3, seed=1))
            calls += [
                ("wrong role", lambda: h.prefill(tail, session, 0, (1,))),
                (
                    "shard mismatch",
                    lambda: h.prefill(tail, session, 0, replace_bundle(bundle, layer=0)),
                ),
                (
                    "checksum mismatch",
                    lambda: h.prefill(
                        tail, session, 0, replace_bundle(bundle, checksum=bundle.checksum ^ 1)
                    ),
                ),
                (
                    "contract version",
                    lambda: h.prefill(
                        tail, session, 0, replace_bundle(bundle, contract_version=99)
                    ),
                ),
            ]
        closed = h.load()
        closed.close()
        unloaded = h.new_engine()
        calls.append(("not ready (closed)", lambda: h.prefill(closed, session, 0, (1,))))
        calls.append(("not ready (never loaded)", lambda: h.prefill(unloaded, session, 0, (1,))))
        retryable = {
            "resource exhausted (slots)": True,
            "resource exhausted (context)": False,
            "not ready (closed)": False,
            "not ready (never loaded)": False,
        }
        for what, call in calls:
            error = _raises(ShardEngineError, call, what)
            cls = type(error)
            assert cls in _TAXONOMY, (
                f"{what}: raised {cls.__module__}.{cls.__qualname__} (code {error.code!r}), "
                "not a contract error class"
            )
            assert error.code == cls.code, f"{what}: code {error.code!r} != {cls.code!r}"
            wanted = retryable.get(what, cls.default_retryable)
            assert error.retryable == wanted, (
                f"{what}: {cls.__name__}.retryable is {error.retryable}, the contract says {wanted}"
            )
            self._assert_survives_the_wire(error, what)
        if engine.capabilities().features.batched_decode:
            outcomes = self._batch(
                engine,
                [
                    self._item(session, 9, (1,)),
                    self._item(session, 3, (vocab,)),
                    self._item(h.session("b", epoch=1), 0, (1,)),
                ],
            ).items
            for outcome in outcomes:
                assert isinstance(outcome, ErrorInfo), outcome
                known = _BY_CODE.get(outcome.code)
                assert known is not None, (
                    f"batch item error code {outcome.code!r} is not in the taxonomy"
                )
                assert outcome.retryable == known.default_retryable, (
                    f"batch item {outcome.code}: retryable {outcome.retryable}"
                )

    def _assert_survives_the_wire(self, error: ShardEngineError, what: str) -> None:
        """``error`` encoded, decoded and rebuilt as a remote caller receives it is the same
        error: class, code, retryable flag and, for CacheMiss, committed length and reason."""
        try:
            decoded = _codec.decode_message(_codec.encode(error.to_info()))
        except ShardEngineError as failure:
            raise AssertionError(f"{what}: its wire form does not survive the codec") from failure
        assert isinstance(decoded, ErrorInfo), f"{what}: decoded {type(decoded).__name__}"
        rebuilt = error_from_info(decoded)
        have: tuple[object, ...] = (type(rebuilt), rebuilt.code, rebuilt.retryable)
        want: tuple[object, ...] = (type(error), error.code, error.retryable)
        if isinstance(error, CacheMiss):
            want += (error.committed_length, error.reason)
            have += (
                (rebuilt.committed_length, rebuilt.reason)
                if isinstance(rebuilt, CacheMiss)
                else (None, None)
            )
        assert have == want, (
            f"{what}: over the wire it becomes {have} (class, code, retryable"
            f"{', committed_length, reason' if isinstance(error, CacheMiss) else ''}), "
            f"raised as {want}; put every field in the error's details (the constructors of "
            "the contract's classes do)"
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
                self._rows(
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
                self._rows(
                    h.decode(engine, session, 6, self._inputs_for(upstream, session, sequence, 6))
                )
            )
            for index, rows in enumerate(outputs):
                assert np.isfinite(rows).all(), (
                    f"[{start}, {end}) output {index} holds NaN or infinity"
                )

    # ================================================================= isolation and threads

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

    def test_concurrent_threads_match_serial(self) -> None:
        """Calls from several threads at once (each thread one session: prefill, decodes, a
        truncation) give exactly the outputs of the same calls run serially, and health and
        metrics count every call.

        Fix: make every entry point thread-safe (one lock around the backend, atomic ledger
        updates); never share scratch buffers between calls."""
        h = self.harness
        engine = h.load()
        serial = h.load()
        exact, tolerance = self._isolation_exactness(engine.capabilities())
        n_threads = 4

        def script(target: ShardEngine, index: int) -> list[npt.NDArray[np.floating]]:
            session = h.session(f"thread-{index}")
            out = [self._rows(h.prefill(target, session, 0, h.tokens(5 + index, seed=index)))]
            for step in range(4):
                out.append(self._rows(h.decode(target, session, 5 + index + step, (step + index,))))
            out.append(self._rows(h.prefill(target, session, 3, h.tokens(3, seed=index + 9))))
            for step in range(2):
                out.append(self._rows(h.decode(target, session, 6 + step, (step,))))
            return out

        assert_threads_match_serial(
            engine, serial, script, n_threads, exact=exact, tolerance=tolerance, join_s=60.0
        )
        metrics, health = engine.metrics(), engine.health()
        assert metrics.requests == 8 * n_threads, f"metrics.requests {metrics.requests}"
        assert health.sessions == n_threads
        assert health.kv_used_tokens == 8 * n_threads
        assert health.in_flight == 0

    # ================================================================= crash, splits, dtypes

    def test_crash_is_permanent(self) -> None:
        """With the fixture's crash options the next operation fails the engine: that call
        and every later prefill, decode, decode_batch, release, cancel and capabilities raise
        EngineCrashed, health says "failed", metrics still answer, and close works. Skipped when
        the fixture supplies no crash options. Every one of those errors is not retryable.

        Fix: map backend failures to EngineCrashed (retryable=False, its default), enter the
        failed state, and check it at the top of every operation."""
        h = self.harness
        options = dict(h.fixture.crash_options)
        if not options:
            suite_skip("the model fixture supplies no crash_options")
        engine = h.load(options=options)
        session = h.session("crash")
        calls: list[tuple[str, Callable[[], object]]] = [
            ("the crashing prefill", lambda: h.prefill(engine, session, 0, h.tokens(3, seed=1))),
            ("prefill after the crash", lambda: h.prefill(engine, h.session("other"), 0, (1,))),
            ("decode after the crash", lambda: h.decode(engine, session, 0, (1,))),
            (
                "decode_batch after the crash",
                lambda: self._batch(engine, [self._item(session, 0, (1,))]),
            ),
            ("release after the crash", lambda: h.release(engine, session)),
            (
                "cancel after the crash",
                lambda: engine.cancel(CancelRequest(session_id=session.session_id)),
            ),
            ("capabilities after the crash", engine.capabilities),
        ]
        for what, call in calls:
            error = _raises(EngineCrashed, call, what)
            # A failed engine stays failed until it is reloaded: a worker told "retryable"
            # would retry against it forever instead of replacing it.
            assert not error.retryable, f"{what}: EngineCrashed.retryable is True"
        health = engine.health()
        assert health.state == "failed", f"health after a crash says {health.state!r}"
        engine.metrics()
        engine.close()
        assert engine.health().state == "closed"

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
