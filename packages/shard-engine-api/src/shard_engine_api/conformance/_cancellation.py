"""The standard tests of cancellation and of requests in flight: a cancel (by request id and by
session id, from another thread) rolls back, lands within the advertised latency, stops only
its target (one of two prefills, a running decode or batch, every request of a session), and
changes nothing once the request finished; ``health().in_flight`` counts running requests; a
request id reused in flight and a release during a running request leave a consistent engine.
:class:`ShardEngineConformance` inherits them; their names are pinned in
:data:`CANCELLATION_TESTS`, part of the standard tests.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Final

import numpy as np
import numpy.typing as npt

from shard_engine_api._errors import Cancelled, InvalidRequest, ShardEngineError, StaleEpoch
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    BoundaryResult,
    CancelRequest,
    DecodeBatchRequest,
    DecodeRequest,
    LogitsResult,
    SessionRef,
    ShardResult,
    TokenInput,
)
from shard_engine_api.conformance._harness import (
    Canceller,
    Harness,
    SuiteHelpers,
    _raises,
    _rows,
    _wait_until,
    assert_cancelled,
    assert_matches,
    logits_array,
)
from shard_engine_api.conformance._recorder import suite_skip

__all__ = ["CANCELLATION_TESTS", "CancellationTests"]

CANCELLATION_TESTS: Final[tuple[str, ...]] = (
    "test_cancel_after_completion_result_stands",
    "test_cancel_latency_within_advertised_bound",
    "test_cancel_one_of_two_in_flight",
    "test_cancel_rolls_back",
    "test_cancel_running_batch",
    "test_cancel_running_decode",
    "test_cancel_session_stops_all_its_requests",
    "test_cancel_unknown_or_finished",
    "test_in_flight_while_running",
    "test_release_while_a_request_runs",
    "test_request_id_reused_while_in_flight",
)
"""The tests of this module, sorted (part of STANDARD_TESTS)."""

_CANCEL_DELAYS: Final = (0.0, 0.0002, 0.001, 0.003, 0.008, 0.02)
"""Seconds the canceller waits after the request is in flight: from "before compute starts" to
well into a slow operation, so at least one attempt lands mid-computation."""
_CANCEL_RETRY_SECONDS: Final = 2.0
"""After one round of delays, how long to keep retrying while no cancel has landed: a fast
engine leaves only a short window between accepting a request and starting to compute."""
_CANCEL_LATENCY_SLACK_MS: Final = 25.0
"""Added to twice the advertised cancel latency: thread wake-ups on a loaded machine."""
_IN_FLIGHT_VISIBLE_S: Final = 0.05
"""An operation that runs this long is seen in flight by a thread polling every 0.5 ms."""


class CancellationTests(SuiteHelpers):
    """The standard tests of cancellation and requests in flight (module docstring)."""

    def test_cancel_rolls_back(self) -> None:
        """``cancel`` from another thread (by request id and by session id) while a
        truncating prefill runs: the caller sees Cancelled and the session is exactly as
        before (the committed length is unchanged and a decode there equals a clean run), or,
        if the cancel came too late, the prefill completed consistently. Skipped when no
        attempt could be cancelled (the engine is faster than the canceller): supply
        ``cancel_load_options`` that slow it down.

        Fix: poll the cancel token at safe points, raise Cancelled, and restore the slot in
        ``_rollback`` (positions from start_pos on must be put back, not just forgotten)."""
        h = self.harness
        engine = h.load(options=dict(h.target.cancel_load_options))
        caps = engine.capabilities()
        if not caps.features.cancel:
            suite_skip("engine does not advertise cancel")
        limits = caps.limits
        prefix = h.tokens(8, seed=1)
        follow = h.tokens(1, seed=2)[0]
        truncate_at = 4 if caps.features.truncate else len(prefix)
        budget_room = limits.kv_budget_tokens // 3 - truncate_at
        length = max(
            1, min(limits.max_batch_tokens, limits.max_context - truncate_at - 1, budget_room, 64)
        )
        suffix = h.tokens(length, seed=3)
        reference = h.session("reference")
        h.prefill(engine, reference, 0, prefix)
        expected_rolled_back = logits_array(h.decode(engine, reference, len(prefix), (follow,)))
        h.release(engine, reference)
        # A fast engine finishes a prefill within one GIL switch interval (5 ms), before the
        # canceller thread ever runs; switching often gives the cancel a chance to land.
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)
        try:
            observed = self._cancel_attempts(
                engine, prefix, follow, truncate_at, suffix, expected_rolled_back
            )
        finally:
            sys.setswitchinterval(switch_interval)
        metrics = engine.metrics()
        assert metrics.cancelled >= observed, (
            f"metrics.cancelled is {metrics.cancelled}; {observed} requests were cancelled"
        )
        assert engine.health().in_flight == 0
        if observed == 0:
            h.no_cancel_landed("no cancel landed while a prefill ran (each finished first)")

    def _cancel_attempts(
        self,
        engine: ShardEngine,
        prefix: tuple[int, ...],
        follow: int,
        truncate_at: int,
        suffix: tuple[int, ...],
        expected_rolled_back: npt.NDArray[np.float32],
    ) -> int:
        """Cancel a truncating prefill once per delay; check the state after each; return how
        many attempts were cancelled."""
        h = self.harness
        exact, tolerance = self._shape_exactness(engine.capabilities())
        length = len(suffix)
        expected_completed: npt.NDArray[np.float32] | None = None
        observed = 0
        deadline = time.monotonic() + _CANCEL_RETRY_SECONDS
        for attempt, delay in enumerate(itertools.cycle(_CANCEL_DELAYS)):
            if attempt >= len(_CANCEL_DELAYS) and (observed or time.monotonic() > deadline):
                break
            session = h.session(f"attempt-{attempt}")
            h.prefill(engine, session, 0, prefix)
            request_id = h.request_id()
            cancel = (
                CancelRequest(request_id=request_id)
                if attempt % 2
                else CancelRequest(session_id=session.session_id)
            )
            canceller = Canceller(engine, cancel, delay)
            canceller.start()
            try:
                h.prefill(engine, session, truncate_at, suffix, request_id=request_id)
                cancelled = False
            except Cancelled as error:
                assert_cancelled(error, f"a cancelled prefill (attempt {attempt})")
                cancelled = True
            finally:
                canceller.stop()
            if canceller.error is not None:
                raise AssertionError(f"cancel() raised {canceller.error!r}") from canceller.error
            if not cancelled and canceller.result is not None:
                raise AssertionError(
                    f"cancel() returned {canceller.result} while the prefill ran (attempt "
                    f"{attempt}), yet the prefill committed and returned its result; "
                    "cancelled=True means the operation will not commit"
                )
            if cancelled:
                observed += 1
                reported = canceller.result.n_requests if canceller.result else 0
                assert reported >= 1, (
                    "the caller saw Cancelled but cancel() did not report a cancelled request"
                )
                got = logits_array(h.decode(engine, session, len(prefix), (follow,)))
                assert_matches(
                    got,
                    expected_rolled_back,
                    exact=exact,
                    tolerance=tolerance,
                    what=f"after a cancelled prefill (attempt {attempt}) the session "
                    "must be rolled back to its committed state",
                )
            else:
                if expected_completed is None:
                    clean = h.session("clean")
                    h.prefill(engine, clean, 0, prefix[:truncate_at] + suffix)
                    expected_completed = logits_array(
                        h.decode(engine, clean, truncate_at + length, (follow,))
                    )
                    h.release(engine, clean)
                got = logits_array(h.decode(engine, session, truncate_at + length, (follow,)))
                assert_matches(
                    got,
                    expected_completed,
                    exact=exact,
                    tolerance=tolerance,
                    what="a prefill that completed despite a late cancel must "
                    "leave the session as a clean run does",
                )
            h.release(engine, session)
        return observed

    def test_cancel_unknown_or_finished(self) -> None:
        """Cancelling an unknown request, a finished request, or an idle session returns
        cancelled=False and never raises; naming neither or both targets is InvalidRequest.

        Fix: look the target up among in-flight requests only; return False when none."""
        h = self.harness
        engine = h.load()
        session = h.session("a")
        finished = h.request_id()
        h.prefill(engine, session, 0, h.tokens(3, seed=1), request_id=finished)
        for request in (
            CancelRequest(request_id="no-such-request"),
            CancelRequest(request_id=finished),
            CancelRequest(session_id=session.session_id),
            CancelRequest(session_id="no-such-session"),
        ):
            result = engine.cancel(request)
            assert (result.cancelled, result.n_requests) == (False, 0), f"{request}: {result}"
        _raises(InvalidRequest, lambda: engine.cancel(CancelRequest()), "cancel of nothing")
        _raises(
            InvalidRequest,
            lambda: engine.cancel(CancelRequest(request_id="x", session_id="y")),
            "cancel naming both a request and a session",
        )
        h.decode(engine, session, 3, (1,))

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
            want = _rows(h.prefill(clean, second, 0, second_tokens))
            assert_matches(
                _rows(other),
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


def _running(engine: ShardEngine, worker: threading.Thread) -> bool:
    """The engine has a request in flight, or ``worker`` (which sent it) has ended."""
    return engine.health().in_flight >= 1 or not worker.is_alive()
