"""The standard tests of many concurrent callers on one engine: many threads on many sessions
give the outputs of a serial run (within the declared batch tolerance, since an engine may
coalesce concurrent decodes into one batched forward); no caller starves behind another's
tight decode loop (bounded by a count of that loop's steps, not by time); cancelling one of
several queued requests leaves the others' results; a queued request hears its cancel at once.
:class:`ShardEngineConformance` inherits them; their names are pinned in
:data:`CONCURRENCY_TESTS`, part of the standard tests.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Final

import numpy as np
import numpy.typing as npt

from shard_engine_api._errors import Cancelled, ShardEngineError
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    BoundaryResult,
    CancelRequest,
    DecodeRequest,
    ExportSessionRequest,
    LogitsResult,
    PrefillRequest,
    TokenInput,
)
from shard_engine_api.conformance._harness import (
    SuiteHelpers,
    _rows,
    _wait_until,
    assert_cancelled,
    assert_matches,
    assert_threads_match_serial,
)
from shard_engine_api.conformance._recorder import suite_skip

__all__ = ["CONCURRENCY_TESTS", "ConcurrencyTests"]

CONCURRENCY_TESTS: Final[tuple[str, ...]] = (
    "test_cancel_one_of_queued_requests",
    "test_concurrent_threads_match_serial",
    "test_many_threads_many_sessions_match_serial",
    "test_no_starvation_behind_a_decode_loop",
    "test_queued_cancel_heard_at_once",
)
"""The tests of this module, sorted (part of STANDARD_TESTS)."""

_THREADS: Final = 8
_SESSIONS_PER_THREAD: Final = 2
_ROUNDS: Final = 5
_LOOP_STEPS: Final = 200
"""Decode steps of the tight loop the starvation test runs beside another caller before it
truncates back and goes on."""
_LOOP_BOUND: Final = 100_000
"""The most steps the decode loop of the starvation test takes before it gives up."""
_FAIR_STEPS: Final = 16
"""The most steps of that loop another caller's operation may wait: a fair (FIFO) engine lets
it in after the step running when it arrived, and a coalescing one sooner."""
_CANCEL_SLACK_MS: Final = 25.0


@dataclasses.dataclass(slots=True)
class _Watched:
    """An operation of the starvation test as its decode loop sees it: the metrics counter its
    commit moves, the value that means committed, and the loop steps at which it was first
    seen in flight and committed."""

    counter: str
    expect: int
    arrived: int | None = None
    committed: int | None = None


def _served(watched: _Watched, looping: threading.Thread) -> bool:
    return watched.committed is not None or not looping.is_alive()


class ConcurrencyTests(SuiteHelpers):
    """The standard tests of concurrent callers (module docstring)."""

    def test_many_threads_many_sessions_match_serial(self) -> None:
        """Eight threads, each driving two sessions (prefills of different lengths, then
        decode steps alternating between its sessions), started together on one engine, give
        every output of the same calls run serially on another engine: exactly when the
        engine declares batch_invariant (concurrent decodes may be served as one batch), else
        within its tolerance; health and metrics count every call and position.

        Fix: make every entry point thread-safe; when concurrent requests are coalesced into
        one forward, give each its own rows (in its own order) and its own result."""
        h = self.harness
        engine = h.load(max_sessions=_THREADS * _SESSIONS_PER_THREAD)
        serial = h.load(max_sessions=_THREADS * _SESSIONS_PER_THREAD)
        exact, tolerance = self._batch_exactness(engine.capabilities())
        vocab = engine.capabilities().vocab_size

        def script(target: ShardEngine, thread: int) -> list[npt.NDArray[np.floating]]:
            sessions = [h.session(f"t{thread}-{k}") for k in range(_SESSIONS_PER_THREAD)]
            lengths = [3 + thread + 5 * k for k in range(_SESSIONS_PER_THREAD)]
            out = [
                _rows(h.prefill(target, s, 0, h.tokens(n, seed=thread * 10 + k)))
                for k, (s, n) in enumerate(zip(sessions, lengths, strict=True))
            ]
            for step in range(_ROUNDS):
                for k, session in enumerate(sessions):
                    token = (thread * 3 + k * 7 + step) % vocab
                    out.append(_rows(h.decode(target, session, lengths[k] + step, (token,))))
            return out

        assert_threads_match_serial(
            engine, serial, script, _THREADS, exact=exact, tolerance=tolerance, join_s=120.0
        )
        calls = _THREADS * _SESSIONS_PER_THREAD * (1 + _ROUNDS)
        metrics, health = engine.metrics(), engine.health()
        positions = sum(
            3 + t + 5 * k + _ROUNDS for t in range(_THREADS) for k in range(_SESSIONS_PER_THREAD)
        )
        assert metrics.requests == calls, f"metrics.requests {metrics.requests}, {calls} calls"
        assert (health.sessions, health.kv_used_tokens, health.in_flight) == (
            _THREADS * _SESSIONS_PER_THREAD,
            positions,
            0,
        ), health

    def test_no_starvation_behind_a_decode_loop(self) -> None:
        """While one thread decodes in a tight loop (until they are done), an export (when
        advertised), a prefill and a decode of other sessions from this thread each get in
        within 16 of the loop's steps: the engine serves callers in arrival order, so no
        caller waits for another's loop to end.

        The loop itself counts, after each of its steps: from the step after which it first
        sees the operation in flight (``health().in_flight``) to the step after which the
        operation's commit shows in ``metrics()`` (an export in ``exports``, the prefill in
        ``prefill_tokens``, the decode in ``decode_tokens``, less the loop's own). So the
        count does not include the time the caller takes to resume after it was served (a
        thread switch, which on a loaded machine is dozens of a fast engine's steps).

        Fix: serve waiting callers in arrival order (a FIFO queue, not a bare lock that the
        looping thread re-takes before a woken waiter runs); coalescing the waiting decodes
        into the next forward is allowed."""
        h = self.harness
        engine = h.load(max_context=_LOOP_STEPS + 64)
        caps = engine.capabilities()
        loop_steps = min(_LOOP_STEPS, caps.limits.max_context - 8)
        looper, other = h.session("looper"), h.session("other")
        h.prefill(engine, looper, 0, h.tokens(4, seed=1))
        h.prefill(engine, other, 0, h.tokens(4, seed=2))
        steps = [0]
        own = {"decode_tokens": 0, "prefill_tokens": 0}  # the loop's own commits
        # Held by the loop across each of its calls and the count of it, so the baseline read
        # below never sees the loop's commit in metrics() before the loop counted it as its own.
        own_lock = threading.Lock()
        watched: list[_Watched] = []
        stop = threading.Event()
        failure: list[BaseException] = []

        def look() -> None:
            """After a loop step: has the watched operation arrived, has it committed?"""
            if not watched or watched[-1].committed is not None:
                return
            current = watched[-1]
            if current.arrived is None and engine.health().in_flight >= 1:
                current.arrived = steps[0]
            metrics = engine.metrics()
            count = getattr(metrics, current.counter) - own.get(current.counter, 0)
            if count >= current.expect:
                current.committed = steps[0]
                if current.arrived is None:  # arrived and committed between two looks
                    current.arrived = steps[0]

        def loop() -> None:
            # Decodes until the operations are done (at most _LOOP_BOUND steps): at the end of
            # the context it truncates back to position 4 with a one-row prefill and goes on,
            # so however fast the engine is, the loop is still running when they arrive.
            try:
                pos = 4
                while not stop.is_set() and steps[0] < _LOOP_BOUND:
                    with own_lock:
                        if pos >= 4 + loop_steps:
                            h.prefill(engine, looper, 4, (pos % caps.vocab_size,))
                            own["prefill_tokens"] += 1
                            pos = 5
                        else:
                            h.decode(engine, looper, pos, (pos % caps.vocab_size,))
                            own["decode_tokens"] += 1
                            pos += 1
                    steps[0] += 1
                    look()
            except BaseException as error:  # noqa: BLE001 - reported by the test thread
                failure.append(error)

        operations: list[tuple[str, str, int, Callable[[], object]]] = []
        if caps.features.session_migration:
            operations.append(
                (
                    "export_session",
                    "exports",
                    1,
                    partial(
                        engine.export_session,
                        ExportSessionRequest(request_id=h.request_id(), session=other),
                    ),
                )
            )
        operations += [
            (
                "prefill",
                "prefill_tokens",
                8,
                partial(h.prefill, engine, h.session("newcomer"), 0, h.tokens(8, seed=3)),
            ),
            ("decode", "decode_tokens", 1, partial(h.decode, engine, other, 4, (1,))),
        ]
        looping = threading.Thread(target=loop, name="conformance-decode-loop", daemon=True)
        waited: dict[str, int] = {}
        try:
            looping.start()
            _wait_until(lambda: steps[0] >= 3 or not looping.is_alive())
            for name, counter, rows, call in operations:
                if not looping.is_alive():
                    break
                with own_lock:  # between two of the loop's calls
                    before = getattr(engine.metrics(), counter) - own.get(counter, 0)
                current = _Watched(counter=counter, expect=before + rows)
                watched.append(current)
                call()
                # Served: the loop sees the commit at its next step (or it has ended).
                _wait_until(partial(_served, current, looping), 60)
                if current.committed is not None and current.arrived is not None:
                    waited[name] = current.committed - current.arrived
        finally:
            stop.set()
            looping.join(timeout=60.0)
        if failure:
            raise AssertionError(f"the decode loop failed: {failure[0]!r}") from failure[0]
        assert len(waited) == len(operations), (
            f"the decode loop took {_LOOP_BOUND} steps before every other caller's operation "
            f"was served (only {waited} were): they starved"
        )
        starved = {name: count for name, count in waited.items() if count > _FAIR_STEPS}
        assert not starved, (
            f"while another thread decoded in a tight loop, {starved} (operation: loop steps "
            f"from its arrival to its commit) waited more than {_FAIR_STEPS} steps; every "
            f"operation: {waited}"
        )

    def _queued_behind_a_slow_prefill(
        self, engine: ShardEngine, runs: list[Callable[[], object]]
    ) -> tuple[threading.Thread, list[threading.Thread], dict[int, object]]:
        """Start a slow prefill, then ``runs`` on their own threads once it is in flight;
        return when all are in flight (or have ended)."""
        h = self.harness
        caps = engine.capabilities()
        length = max(1, min(caps.limits.max_batch_tokens, caps.limits.max_context - 1, 32))
        outcomes: dict[int, object] = {}

        def blocker() -> None:
            try:
                outcomes[-1] = h.prefill(
                    engine, h.session(f"blocker-{h.request_id()}"), 0, h.tokens(length, seed=4)
                )
            except ShardEngineError as error:
                outcomes[-1] = error

        def run(index: int, call: Callable[[], object]) -> None:
            try:
                outcomes[index] = call()
            except ShardEngineError as error:
                outcomes[index] = error
                outcomes[-2 - index] = time.perf_counter()

        first = threading.Thread(target=blocker, daemon=True)
        first.start()
        _wait_until(lambda: engine.health().in_flight >= 1 or not first.is_alive())
        threads = [
            threading.Thread(target=run, args=(index, call), daemon=True)
            for index, call in enumerate(runs)
        ]
        for thread in threads:
            thread.start()
        _wait_until(lambda: engine.health().in_flight >= 1 + len(runs) or not first.is_alive(), 5.0)
        return first, threads, outcomes

    def test_cancel_one_of_queued_requests(self) -> None:
        """Three single decodes of different sessions queued (or coalesced) behind a slow
        prefill: cancelling one by its request id stops only it (Cancelled, its session
        unchanged); the other two are served with the outputs of clean runs. Fails when no
        cancel landed although cancellation options were supplied.

        Fix: cancel exactly the named request; if it shares a forward with others, drop its
        row (or run the others again) rather than fail or change them."""
        h = self.harness
        engine = self._slow()
        caps = engine.capabilities()
        if not caps.features.cancel:
            suite_skip("engine does not advertise cancel")
        exact, tolerance = self._batch_exactness(caps)
        clean = h.load()
        for attempt in range(3):
            sessions = [h.session(f"q{attempt}-{index}") for index in range(3)]
            for index, session in enumerate(sessions):
                for target in (engine, clean):
                    h.prefill(target, session, 0, h.tokens(3 + index, seed=index))
            requests = [
                DecodeRequest(
                    request_id=h.request_id(),
                    session=session,
                    pos=3 + index,
                    inputs=TokenInput(token_ids=(index + 1,)),
                )
                for index, session in enumerate(sessions)
            ]
            blocker, threads, outcomes = self._queued_behind_a_slow_prefill(
                engine, [partial(engine.decode, request) for request in requests]
            )
            queued = blocker.is_alive()
            result = engine.cancel(CancelRequest(request_id=requests[1].request_id))
            for thread in (blocker, *threads):
                thread.join(timeout=60.0)
            assert not any(t.is_alive() for t in (blocker, *threads)), "a call hung for 60 s"
            if not (queued and result.cancelled):
                for index, session in enumerate(sessions):
                    length = self._committed_length(engine, session)
                    assert length == 4 + index, f"{session.session_id}: {length} positions"
                continue
            assert result.n_requests == 1, f"cancel of one request id stopped {result}"
            stopped = outcomes.get(1)
            assert isinstance(stopped, Cancelled), f"the cancelled decode returned {stopped!r}"
            assert_cancelled(stopped, "a queued decode cancelled by its request id")
            assert self._committed_length(engine, sessions[1]) == 4
            for index in (0, 2):
                outcome = outcomes.get(index)
                assert isinstance(outcome, BoundaryResult | LogitsResult), (
                    f"cancelling another queued decode failed decode {index}: {outcome!r}"
                )
                h.observe(outcome)
                request = requests[index]
                assert_matches(
                    _rows(outcome),
                    _rows(h.decode(clean, request.session, request.pos, request.inputs)),
                    exact=exact,
                    tolerance=tolerance,
                    what=f"queued decode {index} beside a cancelled one vs a clean run",
                )
            assert engine.health().in_flight == 0
            return
        h.no_cancel_landed("no queued decode was cancelled while a slow prefill ran")

    def test_queued_cancel_heard_at_once(self) -> None:
        """A prefill queued behind a slow prefill (the fixture's cancellation options) hears
        its cancel at once: its caller sees Cancelled within twice the advertised cancel
        latency plus 25 ms of the cancel, while the slow prefill still runs, and the queued
        request left nothing behind. Fails when the slow prefill never overlapped although
        cancellation options were supplied.

        Fix: wake a waiting request when it is cancelled (an event per waiter), rather than
        letting it find out when the operation ahead of it ends."""
        h = self.harness
        engine = self._slow()
        caps = engine.capabilities()
        if not caps.features.cancel:
            suite_skip("engine does not advertise cancel")
        limit_ms = 2.0 * caps.features.cancel_latency_ms + _CANCEL_SLACK_MS
        for attempt in range(3):
            session = h.session(f"queued-{attempt}")
            request = PrefillRequest(
                request_id=h.request_id(),
                session=session,
                start_pos=0,
                inputs=TokenInput(token_ids=h.tokens(3, seed=attempt)),
            )
            blocker, [queued], outcomes = self._queued_behind_a_slow_prefill(
                engine, [partial(engine.prefill, request)]
            )
            time.sleep(0.005)
            sent = time.perf_counter()
            result = engine.cancel(CancelRequest(request_id=request.request_id))
            queued.join(timeout=30.0)
            blocker_running = blocker.is_alive()
            blocker.join(timeout=60.0)
            if not result.cancelled or not blocker_running:
                h.release(engine, session)
                continue
            stopped = outcomes.get(0)
            assert isinstance(stopped, Cancelled), f"the queued prefill returned {stopped!r}"
            heard = outcomes.get(-2)
            assert isinstance(heard, float)
            latency = (heard - sent) * 1000.0
            assert latency <= limit_ms, (
                f"a queued prefill heard its cancel after {latency:.1f} ms (allowed "
                f"{limit_ms:.1f} ms): it waited for the operation ahead of it"
            )
            assert self._committed_length(engine, session) == 0, (
                "the cancelled queued prefill left its session behind"
            )
            return
        h.no_cancel_landed("a queued prefill was never cancelled while a slow prefill ran")

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
            out = [_rows(h.prefill(target, session, 0, h.tokens(5 + index, seed=index)))]
            for step in range(4):
                out.append(_rows(h.decode(target, session, 5 + index + step, (step + index,))))
            out.append(_rows(h.prefill(target, session, 3, h.tokens(3, seed=index + 9))))
            for step in range(2):
                out.append(_rows(h.decode(target, session, 6 + step, (step,))))
            return out

        assert_threads_match_serial(
            engine, serial, script, n_threads, exact=exact, tolerance=tolerance, join_s=60.0
        )
        metrics, health = engine.metrics(), engine.health()
        assert metrics.requests == 8 * n_threads, f"metrics.requests {metrics.requests}"
        assert health.sessions == n_threads
        assert health.kv_used_tokens == 8 * n_threads
        assert health.in_flight == 0
