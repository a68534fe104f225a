"""Cancellation that means it: an asyncio task cancelled at a random moment either changed
nothing (CancelledError, session and backend cache rolled back) or gets the committed result;
``cancel()`` answers True only for an operation that will not commit.

Bounded to seconds by default; ``SHARD_ENGINE_DEEP_TESTS=1`` runs many more cases."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import threading
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
from test_core import HistoryEngine

from shard_engine_api import (
    AsyncShardEngine,
    CacheMiss,
    Cancelled,
    CancelRequest,
    CancelResult,
    DecodeRequest,
    EngineCrashed,
    LoadConfig,
    MalformedOutput,
    NotReady,
    OutcomeUnknown,
    PrefillRequest,
    ReleaseRequest,
    SessionRef,
    ShardResult,
    ShardSpec,
    TokenInput,
)
from shard_engine_api.engine import CancelToken, ForwardItem, OutputMode

DEEP = os.environ.get("SHARD_ENGINE_DEEP_TESTS") == "1"
ASYNC_CASES = 4000 if DEEP else 300
THREAD_CASES = 3000 if DEEP else 200


class SlowHistory(HistoryEngine):
    """Each row of a forward takes ``row_delay`` seconds (cancellable)."""

    row_delay = 0.0003

    def _forward(
        self, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        for _ in range(item.n_tokens):
            token.sleep(self.row_delay)
        return super()._forward(item, output, token)


def _loaded(engine: SlowHistory) -> SlowHistory:
    engine.load(
        LoadConfig(
            shard=ShardSpec(model="m", n_layers=2, start=0, end=2),
            max_sessions=16,
            max_context=4096,
            kv_budget_tokens=1 << 20,
        )
    )
    return engine


def _committed(engine: HistoryEngine, session_id: str) -> int | None:
    """The ledger's committed length, checked against the backend's cache."""
    entry = engine._ledger.sessions.get(session_id)
    if entry is None:
        return None
    assert len(engine.cache.get(entry.slot, [])) == entry.length, "backend cache not rolled back"
    return entry.length


@dataclass
class _Tally:
    counts: Counter[str]
    failures: list[str]


async def _drive_session(
    adapter: AsyncShardEngine, engine: HistoryEngine, index: int, cases: int, tally: _Tally
) -> None:
    rng = random.Random(index)
    sid = f"s{index}"
    epoch = 1
    for case in range(cases):
        call: Coroutine[object, None, object]
        before = _committed(engine, sid)
        length = before or 0
        if before is None or rng.random() < 0.2:
            kind, start = "prefill", rng.randint(0, length)
            n = rng.randint(1, 6)
            call = adapter.prefill(
                PrefillRequest(
                    request_id=f"{sid}-{case}",
                    session=SessionRef(session_id=sid, epoch=epoch),
                    start_pos=start,
                    inputs=TokenInput(token_ids=tuple(rng.randrange(16) for _ in range(n))),
                )
            )
            after = start + n
        elif rng.random() < 0.1:
            kind, after = "release", -1
            call = adapter.release(ReleaseRequest(session=SessionRef(session_id=sid, epoch=epoch)))
        else:
            kind, after = "decode", length + 1
            call = adapter.decode(
                DecodeRequest(
                    request_id=f"{sid}-{case}",
                    session=SessionRef(session_id=sid, epoch=epoch),
                    pos=length,
                    inputs=TokenInput(token_ids=(rng.randrange(16),)),
                )
            )
        task = asyncio.ensure_future(call)
        await asyncio.sleep(rng.random() * 0.004)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            tally.counts["cancelled"] += 1
            now = _committed(engine, sid)
            if now != before:
                tally.failures.append(f"{kind} {sid}: CancelledError but {before} -> {now}")
            continue
        tally.counts["result_stands"] += 1
        now = _committed(engine, sid)
        if kind == "release":
            epoch += 1
            if now is not None:
                tally.failures.append(f"release {sid} returned but the session is live")
        elif now != after:
            tally.failures.append(f"{kind} {sid}: result returned but {before} -> {now}")


def test_async_cancellation_stress() -> None:
    """Hundreds of tasks cancelled at random moments (queued, running, just finished):
    after every CancelledError the session and its cache are exactly as before; otherwise the
    operation committed and its result was returned."""
    engine = _loaded(SlowHistory())
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    adapter = AsyncShardEngine(engine, executor=executor)
    tally = _Tally(Counter(), [])
    sessions = 6

    async def scenario() -> None:
        await asyncio.gather(
            *(
                _drive_session(adapter, engine, index, ASYNC_CASES // sessions, tally)
                for index in range(sessions)
            )
        )

    try:
        asyncio.run(scenario())
    finally:
        executor.shutdown(wait=True)
    assert tally.failures == [], tally.failures[:5]
    assert tally.counts["cancelled"] > 0
    assert tally.counts["result_stands"] > 0
    assert engine.health().in_flight == 0
    print(f"async cancellation cases: {dict(tally.counts)}, failures: {len(tally.failures)}")


def test_cancel_true_means_the_operation_did_not_commit() -> None:
    """cancel() racing the commit point from another thread: True exactly when the caller
    got Cancelled and the session kept its length; False when the prefill committed."""
    engine = _loaded(SlowHistory())
    engine.row_delay = 0.0001
    session = SessionRef(session_id="race", epoch=1)
    rng = random.Random(7)
    outcomes: Counter[str] = Counter()
    for case in range(THREAD_CASES):
        committed_before = _committed(engine, "race")
        before = committed_before or 0
        request = PrefillRequest(
            request_id=f"r{case}",
            session=session,
            start_pos=before,
            inputs=TokenInput(token_ids=(1, 2)),
        )
        result: list[ShardResult | BaseException] = []

        def run(
            request: PrefillRequest = request,
            result: list[ShardResult | BaseException] = result,
        ) -> None:
            try:
                result.append(engine.prefill(request))
            except Cancelled as error:
                result.append(error)

        thread = threading.Thread(target=run)
        thread.start()
        wait = rng.random() * 0.0008
        threading.Event().wait(wait)
        answer = engine.cancel(CancelRequest(request_id=request.request_id))
        thread.join()
        (outcome,) = result
        now = _committed(engine, "race")
        if answer.cancelled:
            assert isinstance(outcome, Cancelled), f"cancel said True but {request} committed"
            assert now == committed_before
            outcomes["cancelled"] += 1
        elif isinstance(outcome, Cancelled):
            raise AssertionError("Cancelled although cancel() answered False")
        else:
            assert now == before + 2
            outcomes["committed"] += 1
        if now is not None and now > 40:
            engine.release(ReleaseRequest(session=session))
            session = SessionRef(session_id="race", epoch=session.epoch + 1)
    assert outcomes["cancelled"] > 0
    assert outcomes["committed"] > 0
    print(f"cancel/commit race cases: {dict(outcomes)}")


def test_queued_call_is_withdrawn_before_it_runs() -> None:
    """With the executor busy, a cancelled queued prefill never reaches the engine."""
    engine = _loaded(SlowHistory())
    engine.row_delay = 0.05
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    adapter = AsyncShardEngine(engine, executor=executor)
    busy = SessionRef(session_id="busy", epoch=1)
    queued = SessionRef(session_id="queued", epoch=1)

    async def scenario() -> None:
        first = asyncio.ensure_future(
            adapter.prefill(
                PrefillRequest(
                    request_id="first", session=busy, start_pos=0, inputs=TokenInput(token_ids=(1,))
                )
            )
        )
        second = asyncio.ensure_future(
            adapter.prefill(
                PrefillRequest(
                    request_id="second",
                    session=queued,
                    start_pos=0,
                    inputs=TokenInput(token_ids=(1, 2, 3)),
                )
            )
        )
        await asyncio.sleep(0.01)
        second.cancel()
        try:
            await second
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("a queued prefill was not withdrawn")
        await first

    asyncio.run(scenario())
    executor.shutdown(wait=True)
    assert _committed(engine, "queued") is None
    assert engine.metrics().prefill_requests == 1


def test_async_with_closes_the_engine() -> None:
    engine = _loaded(SlowHistory())

    async def scenario() -> None:
        async with AsyncShardEngine(engine) as adapter:
            assert (await adapter.health()).state == "ready"

    asyncio.run(scenario())
    assert engine.health().state == "closed"


class CommitsThenFails(SlowHistory):
    """A decode that commits, then fails with ``error`` once ``proceed`` is set: what a
    transport that lost the reply (OutcomeUnknown), a validating wrapper refusing a committed
    step's result (MalformedOutput) or a crash after the commit look like to the caller."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error
        self.committed = threading.Event()
        self.proceed = threading.Event()

    def decode(self, request: DecodeRequest) -> ShardResult:
        super().decode(request)
        self.committed.set()
        self.proceed.wait(10)
        raise self.error


@pytest.mark.parametrize(
    ("error", "reported"),
    [
        (OutcomeUnknown("the link broke"), OutcomeUnknown),
        (MalformedOutput("bad result"), MalformedOutput),
        (EngineCrashed("gone"), EngineCrashed),
        (RuntimeError("not in the taxonomy"), RuntimeError),
        (Cancelled("rolled back"), asyncio.CancelledError),
        (CacheMiss("refused", committed_length=0, reason="r"), asyncio.CancelledError),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else value.__name__,
)
def test_cancellation_never_hides_an_error_that_may_have_changed_state(
    error: Exception, reported: type[BaseException]
) -> None:
    """A task cancelled while its call ends in an error: CancelledError ("nothing changed")
    only for an error that says the call rolled back or was refused; one that says it may have
    run, or may have committed, reaches the caller as it is."""
    engine = CommitsThenFails(error)
    _loaded(engine)
    session = SessionRef(session_id="s", epoch=1)
    engine.prefill(
        PrefillRequest(
            request_id="p", session=session, start_pos=0, inputs=TokenInput(token_ids=(1,))
        )
    )

    async def scenario() -> BaseException | None:
        adapter = AsyncShardEngine(engine)
        task = asyncio.ensure_future(
            adapter.decode(
                DecodeRequest(
                    request_id="d", session=session, pos=1, inputs=TokenInput(token_ids=(2,))
                )
            )
        )
        while not engine.committed.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.sleep(0.01)
        engine.proceed.set()
        try:
            await task
        except BaseException as raised:  # noqa: BLE001 (the outcome is what is tested)
            return raised
        return None

    raised = asyncio.run(scenario())
    assert type(raised) is reported
    assert _committed(engine, "s") == 2  # the decode did commit


def test_after_close_calls_are_not_ready_and_a_second_close_does_nothing() -> None:
    """A closed adapter answers like a closed engine (NotReady, not retryable), not with the
    executor's RuntimeError; closing twice is allowed."""
    engine = _loaded(SlowHistory())
    session = SessionRef(session_id="s", epoch=1)

    async def scenario() -> None:
        adapter = AsyncShardEngine(engine)
        await adapter.close()
        with pytest.raises(NotReady) as caught:
            await adapter.prefill(
                PrefillRequest(
                    request_id="p", session=session, start_pos=0, inputs=TokenInput(token_ids=(1,))
                )
            )
        assert caught.value.retryable is False
        await adapter.close()
        assert (await adapter.health()).state == "closed"

    asyncio.run(scenario())


def test_a_withdrawn_close_leaves_the_engine_and_the_adapter_usable() -> None:
    """A close cancelled while queued behind busy workers (of the adapter's own executor)
    never ran: CancelledError, the engine is still ready, and the adapter still serves it."""
    engine = _loaded(SlowHistory())
    busy = threading.Event()
    session = SessionRef(session_id="s", epoch=1)

    async def scenario() -> None:
        adapter = AsyncShardEngine(engine)
        for _ in range(8):  # every worker of the private pool
            adapter._executor.submit(busy.wait, 10)
        closing = asyncio.ensure_future(adapter.close())
        await asyncio.sleep(0.01)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        busy.set()
        assert engine.health().state == "ready"
        await adapter.prefill(
            PrefillRequest(
                request_id="p", session=session, start_pos=0, inputs=TokenInput(token_ids=(1,))
            )
        )
        await adapter.close()
        assert engine.health().state == "closed"

    try:
        asyncio.run(scenario())
    finally:
        busy.set()


class CancelExplodes(SlowHistory):
    """An engine whose cancel() raises an exception outside the taxonomy (a bug)."""

    def cancel(self, request: CancelRequest) -> CancelResult:
        raise RuntimeError("cancel is broken")


def test_a_cancel_that_raises_does_not_end_the_wait_for_the_running_call() -> None:
    """The task still waits for the running prefill to end (its result stands: the cancel
    never reached it), so the caller never races a half-finished operation."""
    engine = CancelExplodes()
    _loaded(engine)
    engine.row_delay = 0.01
    session = SessionRef(session_id="s", epoch=1)

    async def scenario() -> ShardResult:
        adapter = AsyncShardEngine(engine)
        task = asyncio.ensure_future(
            adapter.prefill(
                PrefillRequest(
                    request_id="p",
                    session=session,
                    start_pos=0,
                    inputs=TokenInput(token_ids=tuple(range(1, 9))),
                )
            )
        )
        await asyncio.sleep(0.02)
        task.cancel()
        return await task

    result = asyncio.run(scenario())
    assert result.session == session
    assert engine.health().in_flight == 0
    assert _committed(engine, "s") == 8
