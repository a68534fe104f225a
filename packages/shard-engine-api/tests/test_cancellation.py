"""Cancellation that means it: an asyncio task cancelled at a random moment ends cancelled, and
either changed nothing (session and backend cache rolled back) or left its committed result
with the adapter; ``cancel()`` answers True only for an operation that will not commit. The
cancellation reaches asyncio.timeout(), TaskGroup and plain ``task.cancel()`` callers as they
expect.

Bounded to seconds by default; ``SHARD_ENGINE_DEEP_TESTS=1`` runs many more cases."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Final, TypeVar

import msgspec
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
    DecodeBatchRequest,
    DecodeRequest,
    EngineCrashed,
    ExportSessionRequest,
    Features,
    Health,
    ImportSessionRequest,
    InvalidRequest,
    LoadConfig,
    LogitsResult,
    MalformedOutput,
    Metrics,
    NotReady,
    OutcomeUnknown,
    PrefillRequest,
    ReleaseRequest,
    SessionRef,
    ShardResult,
    ShardSpec,
    TokenInput,
    _scheduler,
)
from shard_engine_api.engine import CancelToken, EngineCore, ForwardItem, ModelInfo, OutputMode

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


_Engine = TypeVar("_Engine", bound=SlowHistory)


def _loaded(engine: _Engine) -> _Engine:
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
            assert task.cancelled()
            now = _committed(engine, sid)
            if kind == "release":
                if now is not None and now != before:
                    tally.failures.append(f"release {sid}: CancelledError, {before} -> {now}")
                if now is None:  # it ran: the epoch is fenced
                    tally.counts["committed_then_cancelled"] += 1
                    epoch += 1
                continue
            outcome = adapter.take_outcome(f"{sid}-{case}")
            if outcome is None:
                if now != before:
                    tally.failures.append(f"{kind} {sid}: nothing recorded but {before} -> {now}")
            else:
                tally.counts["committed_then_cancelled"] += 1
                if not isinstance(outcome.result, LogitsResult) or now != after:
                    tally.failures.append(f"{kind} {sid}: recorded {outcome}, {before} -> {now}")
                elif outcome.result.session.session_id != sid:
                    tally.failures.append(f"{kind} {sid}: recorded another session's result")
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
    """Hundreds of tasks cancelled at random moments (queued, running, just finished): a
    cancelled task always ends cancelled; after a CancelledError the session and its cache are
    exactly as before unless the adapter recorded the call's committed result (and then the
    session holds it); a task that finished before the cancel returned its result."""
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
    assert tally.counts["committed_then_cancelled"] > 0
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
    ("error", "recorded"),
    [
        (OutcomeUnknown("the link broke"), True),
        (MalformedOutput("bad result"), True),
        (EngineCrashed("gone"), True),
        (RuntimeError("not in the taxonomy"), True),
        (Cancelled("rolled back"), False),
        (CacheMiss("refused", committed_length=0, reason="r"), False),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else str(value),
)
def test_cancellation_never_hides_an_error_that_may_have_changed_state(
    error: Exception, recorded: bool
) -> None:
    """A task cancelled while its call ends in an error ends cancelled. An error that says the
    call rolled back or was refused leaves nothing behind; one that says it may have run, or may
    have committed, is the CancelledError's cause and is kept for ``take_outcome``."""
    engine = CommitsThenFails(error)
    _loaded(engine)
    session = SessionRef(session_id="s", epoch=1)
    engine.prefill(
        PrefillRequest(
            request_id="p", session=session, start_pos=0, inputs=TokenInput(token_ids=(1,))
        )
    )

    async def scenario() -> tuple[BaseException | None, AsyncShardEngine]:
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
            assert task.cancelled()
            return raised, adapter
        return None, adapter

    raised, adapter = asyncio.run(scenario())
    assert type(raised) is asyncio.CancelledError
    outcome = adapter.take_outcome("d")
    if recorded:
        assert outcome is not None
        assert outcome.error is error
        assert outcome.result is None
        assert raised.__cause__ is error
    else:
        assert outcome is None
    assert adapter.take_outcome("d") is None  # taken once
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


def _cancelled_prefill(
    engine: SlowHistory, session: SessionRef, request_id: str, *, after_s: float
) -> AsyncShardEngine:
    """An 8-token prefill through a new adapter whose task is cancelled ``after_s`` after it
    started; the task must end CancelledError. Returns the adapter (for ``take_outcome``)."""

    async def scenario() -> AsyncShardEngine:
        adapter = AsyncShardEngine(engine)
        task = asyncio.ensure_future(
            adapter.prefill(
                PrefillRequest(
                    request_id=request_id,
                    session=session,
                    start_pos=0,
                    inputs=TokenInput(token_ids=tuple(range(1, 9))),
                )
            )
        )
        await asyncio.sleep(after_s)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return adapter

    return asyncio.run(scenario())


def test_a_cancel_that_raises_does_not_end_the_wait_for_the_running_call() -> None:
    """The task still waits for the running prefill to end (it commits: the cancel never
    reached it), so the caller never races a half-finished operation; then the task ends
    cancelled and the committed result is kept for ``take_outcome``."""
    engine = CancelExplodes()
    _loaded(engine)
    engine.row_delay = 0.01
    session = SessionRef(session_id="s", epoch=1)
    adapter = _cancelled_prefill(engine, session, "p", after_s=0.02)
    outcome = adapter.take_outcome("p")
    assert outcome is not None
    assert isinstance(outcome.result, LogitsResult)
    assert outcome.result.session == session
    assert engine.health().in_flight == 0
    assert _committed(engine, "s") == 8


# ----------------------------------------------------------------------------- asyncio's own
# cancellation machinery: a cancellation that arrives once the call has committed is delivered
# all the same, and the committed step is not lost.


class GatedCommit(SlowHistory):
    """A decode that commits, signals ``committed``, then returns once ``proceed`` is set:
    the cancellation lands after the commit point, while the call is still running."""

    def __init__(self) -> None:
        super().__init__()
        self.committed = threading.Event()
        self.proceed = threading.Event()

    def decode(self, request: DecodeRequest) -> ShardResult:
        result = super().decode(request)
        self.committed.set()
        self.proceed.wait(10)
        return result


def _gated(prefix: int = 3) -> tuple[GatedCommit, SessionRef]:
    engine = GatedCommit()
    _loaded(engine)
    session = SessionRef(session_id="s", epoch=1)
    engine.prefill(
        PrefillRequest(
            request_id="p",
            session=session,
            start_pos=0,
            inputs=TokenInput(token_ids=tuple(range(1, prefix + 1))),
        )
    )
    return engine, session


def _decode_at(session: SessionRef, pos: int, request_id: str = "d") -> DecodeRequest:
    return DecodeRequest(
        request_id=request_id, session=session, pos=pos, inputs=TokenInput(token_ids=(5,))
    )


async def _release_after_commit(engine: GatedCommit) -> None:
    await asyncio.to_thread(engine.committed.wait, 10)
    await asyncio.sleep(0.01)
    engine.proceed.set()


def test_timeout_expiring_after_the_commit_raises_timeout_error_at_the_block() -> None:
    """``asyncio.timeout()`` whose deadline passes while a committed decode is finishing: the
    block ends with TimeoutError (nothing after the call inside it runs), the task is not left
    cancelled, and the committed step is the adapter's recorded outcome and the session's new
    length (the next decode at the old position gets CacheMiss carrying it)."""
    engine, session = _gated()
    ran_on: list[str] = []

    async def scenario() -> AsyncShardEngine:
        adapter = AsyncShardEngine(engine)
        helper = asyncio.ensure_future(_release_after_commit(engine))

        async def in_block() -> None:
            await asyncio.to_thread(engine.committed.wait, 10)

        async def block() -> None:
            async with asyncio.timeout(None) as deadline:
                call = asyncio.ensure_future(adapter.decode(_decode_at(session, 3)))
                await in_block()
                deadline.reschedule(asyncio.get_running_loop().time())  # expires now
                await call
                ran_on.append("after the call")

        with pytest.raises(TimeoutError):
            await block()
        await helper
        task = asyncio.current_task()
        assert task is not None
        assert task.cancelling() == 0
        await asyncio.sleep(0)  # no stray cancellation left pending
        return adapter

    adapter = asyncio.run(scenario())
    assert ran_on == []
    outcome = adapter.take_outcome("d")
    assert outcome is not None
    assert isinstance(outcome.result, LogitsResult)
    assert outcome.result.first_pos == 3
    assert _committed(engine, "s") == 4
    with pytest.raises(CacheMiss) as caught:
        engine.decode(_decode_at(session, 3, "again"))
    assert caught.value.committed_length == 4


def test_timeout_around_the_awaited_call_itself() -> None:
    """The common shape, ``async with asyncio.timeout(t): await adapter.decode(...)``, whose
    deadline falls after the commit: TimeoutError, and the result is not lost."""
    engine, session = _gated()

    async def scenario() -> AsyncShardEngine:
        adapter = AsyncShardEngine(engine)
        helper = asyncio.ensure_future(_release_after_commit(engine))
        loop = asyncio.get_running_loop()

        async def block() -> None:
            async with asyncio.timeout(None) as deadline:
                loop.call_soon(lambda: loop.create_task(_expire_after_commit(engine, deadline)))
                await adapter.decode(_decode_at(session, 3))

        with pytest.raises(TimeoutError):
            await block()
        await helper
        return adapter

    adapter = asyncio.run(scenario())
    outcome = adapter.take_outcome("d")
    assert outcome is not None
    assert outcome.result is not None
    assert _committed(engine, "s") == 4


async def _expire_after_commit(engine: GatedCommit, deadline: asyncio.Timeout) -> None:
    await asyncio.to_thread(engine.committed.wait, 10)
    deadline.reschedule(asyncio.get_running_loop().time())


def test_task_group_cancelling_a_committed_call_ends_cleanly() -> None:
    """A sibling's failure cancels a TaskGroup child whose decode already committed: the
    group ends with the sibling's error only (the child ends cancelled, not with a result
    the group would wait on), and the committed step is recorded."""
    engine, session = _gated()

    async def scenario() -> tuple[AsyncShardEngine, asyncio.Task[ShardResult]]:
        adapter = AsyncShardEngine(engine)
        helper = asyncio.ensure_future(_release_after_commit(engine))

        async def failing_sibling() -> None:
            await asyncio.to_thread(engine.committed.wait, 10)
            raise LookupError("sibling failed")

        children: list[asyncio.Task[ShardResult]] = []

        async def group_of_two() -> None:
            async with asyncio.TaskGroup() as group:
                children.append(group.create_task(adapter.decode(_decode_at(session, 3))))
                group.create_task(failing_sibling())

        with pytest.raises(ExceptionGroup) as caught:
            await group_of_two()
        assert [type(e) for e in caught.value.exceptions] == [LookupError]
        (child,) = children
        await helper
        return adapter, child

    adapter, child = asyncio.run(scenario())
    assert child.cancelled()
    outcome = adapter.take_outcome("d")
    assert outcome is not None
    assert outcome.result is not None
    assert _committed(engine, "s") == 4


def test_plain_cancel_after_the_commit_is_delivered() -> None:
    """``task.cancel()`` landing after the commit: the task ends cancelled (the caller's own
    code after the call never runs), the result is recorded, and the session advanced."""
    engine, session = _gated()
    ran_on: list[str] = []

    async def scenario() -> AsyncShardEngine:
        adapter = AsyncShardEngine(engine)

        async def worker() -> None:
            await adapter.decode(_decode_at(session, 3))
            ran_on.append("after the call")
            await asyncio.sleep(10)

        task = asyncio.ensure_future(worker())
        await asyncio.to_thread(engine.committed.wait, 10)
        task.cancel("stop")
        await asyncio.sleep(0.01)
        assert not task.done()  # it waits for the running call
        engine.proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()
        return adapter

    adapter = asyncio.run(scenario())
    assert ran_on == []
    outcome = adapter.take_outcome("d")
    assert outcome is not None
    assert outcome.result is not None
    assert _committed(engine, "s") == 4


def test_repeated_cancels_while_waiting_are_all_accounted_for() -> None:
    """Two cancellations of a task waiting for its running call (a timeout and a TaskGroup,
    say): the task ends cancelled once the call ended, and an enclosing timeout that did not
    cause the cancellation does not turn it into TimeoutError."""
    engine, session = _gated()

    async def scenario() -> None:
        adapter = AsyncShardEngine(engine)

        async def worker() -> None:
            async with asyncio.timeout(None) as deadline:
                call = asyncio.ensure_future(adapter.decode(_decode_at(session, 3)))
                await asyncio.to_thread(engine.committed.wait, 10)
                deadline.reschedule(asyncio.get_running_loop().time())
                await call

        task = asyncio.ensure_future(worker())
        await asyncio.to_thread(engine.committed.wait, 10)
        await asyncio.sleep(0.01)
        task.cancel()  # a second, outer cancellation
        engine.proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert _committed(engine, "s") == 4


def test_outcomes_are_bounded() -> None:
    """The adapter keeps at most MAX_OUTCOMES recorded outcomes, the oldest forgotten first."""
    from shard_engine_api._asyncio import MAX_OUTCOMES, CallOutcome

    adapter = AsyncShardEngine(_loaded(SlowHistory()))
    for index in range(MAX_OUTCOMES + 5):
        adapter._record(CallOutcome(f"r{index}", error=RuntimeError("x")))
    assert adapter.take_outcome("r0") is None
    assert adapter.take_outcome(f"r{MAX_OUTCOMES + 4}") is not None
    assert AsyncShardEngine.Outcome is CallOutcome
    asyncio.run(adapter.close())


@pytest.mark.parametrize(
    "bad", [None, 5, "prefill", object()], ids=["None", "5", "'prefill'", "object()"]
)
@pytest.mark.parametrize(
    "method", ["prefill", "decode", "decode_batch", "export_session", "import_session"]
)
def test_a_non_request_is_invalid_request_not_attribute_error(method: str, bad: object) -> None:
    """The adapter read ``request.request_id`` before the engine's edge checked the request:
    a non-request raised AttributeError. It is the engine's InvalidRequest now."""
    engine = _loaded(SlowHistory())

    async def scenario() -> None:
        async with AsyncShardEngine(engine) as adapter:
            with pytest.raises(InvalidRequest):
                await getattr(adapter, method)(bad)

    asyncio.run(scenario())


class LateRegistration(SlowHistory):
    """An engine whose calls take a while to reach the point where cancel() can find them
    (a remote engine's request on the wire, a wrapper doing work first)."""

    def prefill(self, request: PrefillRequest) -> ShardResult:
        threading.Event().wait(0.01)
        return super().prefill(request)


def test_a_cancel_that_comes_before_the_call_reaches_the_engine_still_stops_it() -> None:
    """The first cancel finds no such request (it is not in flight yet) and used to be the
    only one: the call then committed although its task was cancelled long before its commit
    point. The adapter repeats the cancel while the call runs, so it rolls back."""
    engine = LateRegistration()
    _loaded(engine)
    engine.row_delay = 0.01
    session = SessionRef(session_id="s", epoch=1)
    # Cancelled while running in a worker, not yet in the engine.
    adapter = _cancelled_prefill(engine, session, "late", after_s=0.002)
    assert adapter.take_outcome("late") is None
    assert _committed(engine, "s") is None
    assert engine.metrics().cancelled == 1


class StartsLate(concurrent.futures.Executor):
    """An executor whose worker has taken each call (so it can no longer be withdrawn) but
    runs it only once ``go`` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.threads: list[threading.Thread] = []

    def submit(  # type: ignore[override]
        self, fn: Callable[[], object]
    ) -> concurrent.futures.Future[object]:
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()

        def work() -> None:
            self.go.wait(10)
            try:
                future.set_result(fn())
            except BaseException as error:  # noqa: BLE001 (handed to the future)
                future.set_exception(error)

        thread = threading.Thread(target=work)
        thread.start()
        self.threads.append(thread)
        return future


def test_a_call_taken_by_a_worker_after_the_cancel_never_starts() -> None:
    """A worker that picks the call up after its task was cancelled does not start it."""
    engine = _loaded(SlowHistory())
    executor = StartsLate()
    session = SessionRef(session_id="s", epoch=1)

    async def scenario() -> AsyncShardEngine:
        adapter = AsyncShardEngine(engine, executor=executor)
        task = asyncio.ensure_future(
            adapter.prefill(
                PrefillRequest(
                    request_id="p", session=session, start_pos=0, inputs=TokenInput(token_ids=(1,))
                )
            )
        )
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.01)
        executor.go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        return adapter

    adapter = asyncio.run(scenario())
    for thread in executor.threads:
        thread.join()
    assert adapter.take_outcome("p") is None
    assert _committed(engine, "s") is None
    assert engine.metrics().requests == 0


@pytest.mark.parametrize(
    ("engine", "executor"), [(None, None), ("fake", None), ("engine", 5), ("engine", "pool")]
)
def test_an_adapter_of_what_is_not_an_engine_or_executor_is_invalid_request(
    engine: object, executor: object
) -> None:
    """They used to fail with AttributeError, at construction or at the first call."""
    given = _loaded(SlowHistory()) if engine == "engine" else engine
    with pytest.raises(InvalidRequest):
        AsyncShardEngine(given, executor=executor)  # type: ignore[arg-type]


def test_a_reused_request_id_does_not_inherit_an_earlier_outcome() -> None:
    """An outcome left untaken for request id "d" must not answer for a later call "d" whose
    task was cancelled and which changed nothing."""
    engine, session = _gated()

    async def scenario() -> AsyncShardEngine:
        adapter = AsyncShardEngine(engine)
        first = asyncio.ensure_future(adapter.decode(_decode_at(session, 3)))
        await asyncio.to_thread(engine.committed.wait, 10)
        first.cancel()
        engine.proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await first
        # The same id again, at a position the engine refuses: nothing changes.
        with pytest.raises(CacheMiss):
            await adapter.decode(_decode_at(session, 3))
        return adapter

    adapter = asyncio.run(scenario())
    assert adapter.take_outcome("d") is None
    assert _committed(engine, "s") == 4


class SlowQueries(SlowHistory):
    """An engine whose cancel, health and metrics take a round trip (a remote one): each waits
    until ``answer`` is set (by the event loop the test runs: it can only be set while that
    loop runs other tasks) and records whether it was, within a backstop."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = threading.Event()
        self.answered: list[bool] = []

    def _round_trip(self) -> None:
        self.answered.append(self.answer.wait(60))

    def health(self) -> Health:
        self._round_trip()
        return super().health()

    def metrics(self) -> Metrics:
        self._round_trip()
        return super().metrics()

    def cancel(self, request: CancelRequest) -> CancelResult:
        self._round_trip()
        return super().cancel(request)


def test_queries_and_cancels_never_block_the_event_loop() -> None:
    """They ran on the event loop's thread: a peer that answers slowly stalled every task.
    Here each call answers only once another task of the loop has run meanwhile: called on the
    loop's thread, none could (each would wait out its backstop and record False)."""
    engine = _loaded(SlowQueries())

    async def scenario() -> None:
        adapter = AsyncShardEngine(engine)

        async def other_task() -> None:
            for _ in range(3):  # a few turns of the loop while the three calls wait
                await asyncio.sleep(0)
            engine.answer.set()

        await asyncio.gather(
            adapter.health(),
            adapter.metrics(),
            adapter.cancel(CancelRequest(request_id="x")),
            other_task(),
        )
        await adapter.close()

    asyncio.run(scenario())
    assert engine.answered == [True, True, True]


# ----------------------------------------------------------------- waiting for the compute lock

LONG = 15
"""A token whose forward holds the compute lock until the test opens the gate (another
session's long operation: it does not poll anything the waiting request's cancel sets)."""


class Queued(SlowHistory):
    """A history engine with session migration, whose forward of a row holding token LONG
    blocks (signalling ``holding``) until ``gate`` is set."""

    row_delay = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.holding = threading.Event()

    def _open(self, config: LoadConfig) -> ModelInfo:
        info = super()._open(config)
        return msgspec.structs.replace(info, features=Features(session_migration=True))

    def _forward(
        self, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        if item.tokens is not None and LONG in item.tokens:
            self.holding.set()
            assert self.gate.wait(20), "the test never opened the gate"
        return super()._forward(item, output, token)

    def _export_state(self, slot: int, length: int) -> bytes:
        return np.stack(self.cache[slot][:length]).astype(np.float32).tobytes()

    def _import_state(self, slot: int, length: int, state: bytes) -> None:
        rows = np.frombuffer(state, np.float32).reshape(length, -1)
        self.cache[slot] = [row.copy() for row in rows]


def _prefilled(engine: HistoryEngine, *session_ids: str) -> None:
    for session_id in session_ids:
        engine.prefill(
            PrefillRequest(
                request_id=f"p-{session_id}",
                session=SessionRef(session_id=session_id, epoch=1),
                start_pos=0,
                inputs=TokenInput(token_ids=(1, 2, 3)),
            )
        )


def _holding(engine: Queued, request_id: str = "long") -> _Thread:
    """A prefill of another session ("long") that holds the compute lock until the gate
    opens."""
    call = _Thread(
        lambda: engine.prefill(
            PrefillRequest(
                request_id=request_id,
                session=SessionRef(session_id="long", epoch=1),
                start_pos=0,
                inputs=TokenInput(token_ids=(LONG,)),
            )
        )
    )
    assert engine.holding.wait(10)
    return call


class _Thread:
    """A call on its own thread; ``outcome`` is its result or what it raised."""

    def __init__(self, call: Callable[[], object]) -> None:
        self.outcome: object = None

        def run() -> None:
            try:
                self.outcome = call()
            except BaseException as error:  # noqa: BLE001 (inspected by the test)
                self.outcome = error

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def ended(self, timeout: float = 5.0) -> object:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the call did not end in time"
        return self.outcome


def _waiters(engine: EngineCore) -> int:
    return engine._scheduler.queued


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


QUEUED_OPERATIONS: Final = ("prefill", "decode", "decode_batch", "export_session", "import_session")


def _queued_call(engine: Queued, operation: str) -> Callable[[], object]:
    """``operation`` on session "s" (3 positions committed), request id "w"."""
    s = SessionRef(session_id="s", epoch=1)
    step = DecodeRequest(request_id="w-item", session=s, pos=3, inputs=TokenInput(token_ids=(7,)))
    if operation == "prefill":
        prefill = PrefillRequest(
            request_id="w", session=s, start_pos=3, inputs=TokenInput(token_ids=(7, 8))
        )
        return lambda: engine.prefill(prefill)
    if operation == "decode":
        return lambda: engine.decode(msgspec.structs.replace(step, request_id="w"))
    if operation == "decode_batch":
        return lambda: engine.decode_batch(DecodeBatchRequest(request_id="w", items=(step,)))
    if operation == "export_session":
        return lambda: engine.export_session(ExportSessionRequest(request_id="w", session=s))
    snapshot = engine.export_session(ExportSessionRequest(request_id="x", session=s))
    request = ImportSessionRequest(request_id="w", snapshot=snapshot, epoch=2)
    return lambda: engine.import_session(request)


@pytest.mark.parametrize("by", ["request_id", "session_id"])
@pytest.mark.parametrize("operation", QUEUED_OPERATIONS)
def test_a_request_waiting_for_the_compute_lock_hears_its_cancel_at_once(
    operation: str, by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another session's operation holds the compute lock (for as long as the test likes); a
    request queued behind it is cancelled: its caller gets Cancelled while that operation
    still runs (it used to only once the operation ended, however long that was), nothing of
    its session changed, and the operation ahead of it is untouched. The waiting request's
    backstop poll is made a minute long: what ends the wait is the cancel itself."""
    monkeypatch.setattr(_scheduler, "WAIT_BACKSTOP_S", 60.0)
    engine = _loaded(Queued())
    _prefilled(engine, "s")
    call = _queued_call(engine, operation)
    long = _holding(engine)
    waiting = _Thread(call)
    _wait_for(lambda: _waiters(engine) == 1)
    cancel = CancelRequest(request_id="w") if by == "request_id" else CancelRequest(session_id="s")
    assert engine.cancel(cancel) == CancelResult(cancelled=True, n_requests=1)
    assert isinstance(waiting.ended(), Cancelled)
    assert long.thread.is_alive()
    assert not engine.gate.is_set()
    assert _waiters(engine) == 0
    assert engine.health().in_flight == 1
    assert _committed(engine, "s") == 3
    assert engine._ledger.sessions["s"].epoch == 1
    assert engine.metrics().cancelled == 1
    engine.gate.set()
    assert isinstance(long.ended(), LogitsResult)
    assert _committed(engine, "long") == 1
    assert engine.health().in_flight == 0


def test_requests_waiting_for_the_compute_lock_are_woken_when_it_is_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Waiters do not poll for the lock: each is woken when it is released (the backstop poll
    is a minute here), one after another, and every one commits."""
    monkeypatch.setattr(_scheduler, "WAIT_BACKSTOP_S", 60.0)
    engine = _loaded(Queued())
    sessions = ("a", "b", "c")
    _prefilled(engine, *sessions)
    long = _holding(engine)
    waiting = [
        _Thread(
            functools.partial(
                engine.decode,
                DecodeRequest(
                    request_id=f"d-{session_id}",
                    session=SessionRef(session_id=session_id, epoch=1),
                    pos=3,
                    inputs=TokenInput(token_ids=(5,)),
                ),
            )
        )
        for session_id in sessions
    ]
    _wait_for(lambda: _waiters(engine) == len(sessions))
    engine.gate.set()
    assert isinstance(long.ended(), LogitsResult)
    for call in waiting:
        assert isinstance(call.ended(), LogitsResult)
    assert [_committed(engine, session_id) for session_id in sessions] == [4, 4, 4]
    assert _waiters(engine) == 0


def test_close_ends_the_wait_of_queued_requests_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() cancels what is in flight: a request waiting for the compute lock leaves at
    once (Cancelled), not when the operation holding the lock ends; close itself returns once
    that operation has rolled back."""
    monkeypatch.setattr(_scheduler, "WAIT_BACKSTOP_S", 60.0)
    engine = _loaded(Queued())
    _prefilled(engine, "s")
    long = _holding(engine)
    waiting = _Thread(_queued_call(engine, "decode"))
    _wait_for(lambda: _waiters(engine) == 1)
    closing = _Thread(engine.close)
    assert isinstance(waiting.ended(), Cancelled)
    assert closing.thread.is_alive()
    assert not engine.gate.is_set()
    engine.gate.set()
    assert isinstance(long.ended(), Cancelled)
    assert closing.ended() is None
    assert engine.health().state == "closed"


def test_asyncio_timeout_reaches_a_call_queued_behind_another_sessions_operation() -> None:
    """``asyncio.timeout()`` around a decode queued behind another session's long operation
    raises TimeoutError at its deadline (it used to only when that operation ended), and the
    decode changed nothing."""
    engine = _loaded(Queued())
    _prefilled(engine, "s")
    long = _holding(engine)

    async def scenario() -> None:
        adapter = AsyncShardEngine(engine)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await adapter.decode(_decode_at(SessionRef(session_id="s", epoch=1), 3))
        assert long.thread.is_alive()
        assert not engine.gate.is_set()

    asyncio.run(scenario())
    assert _committed(engine, "s") == 3
    engine.gate.set()
    assert isinstance(long.ended(), LogitsResult)
    assert engine.metrics().cancelled == 1


# ----------------------------------------------------------------- one request id, two calls


def _prefill_of(session_id: str, request_id: str, *tokens: int) -> PrefillRequest:
    return PrefillRequest(
        request_id=request_id,
        session=SessionRef(session_id=session_id, epoch=1),
        start_pos=0,
        inputs=TokenInput(token_ids=tokens),
    )


def test_a_second_call_with_an_id_in_flight_is_refused_and_its_cancel_stops_nothing() -> None:
    """Task A runs request "X"; task B calls with "X" too (another session). B is refused with
    InvalidRequest before it reaches the engine, and cancelling B does not stop A (it used to:
    B's cancellation cancelled "X" in the engine, which was A's call)."""
    engine = _loaded(Queued())

    async def scenario() -> None:
        adapter = AsyncShardEngine(engine)
        a = asyncio.ensure_future(adapter.prefill(_prefill_of("sa", "X", 1, LONG)))
        await asyncio.to_thread(engine.holding.wait, 10)
        b = asyncio.ensure_future(adapter.prefill(_prefill_of("sb", "X", 4, 5)))
        await asyncio.sleep(0)
        b.cancel()
        with pytest.raises(InvalidRequest, match="already in flight"):
            await b
        with pytest.raises(InvalidRequest, match="already in flight"):
            await adapter.decode(_decode_at(SessionRef(session_id="sa", epoch=1), 2, "X"))
        assert engine.metrics().requests == 1  # the refusals never reached the engine
        engine.gate.set()
        assert isinstance(await a, LogitsResult)
        # Free again once A ended.
        assert isinstance(await adapter.prefill(_prefill_of("sb", "X", 4, 5)), LogitsResult)

    asyncio.run(scenario())
    assert _committed(engine, "sa") == 2
    assert _committed(engine, "sb") == 2
    assert engine.metrics().cancelled == 0


class _Recording(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that keeps the futures of the calls submitted to it."""

    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.submitted: list[concurrent.futures.Future[object]] = []

    def submit(  # type: ignore[override]
        self, fn: Callable[[], object]
    ) -> concurrent.futures.Future[object]:
        future = super().submit(fn)
        self.submitted.append(future)
        return future


def test_a_call_that_ended_is_not_cancelled_by_id_after_the_fact() -> None:
    """Another caller (a thread, not the adapter) has request "Y" in flight; the adapter's call
    "Y" is refused by the engine as a duplicate, and its task is cancelled only after that. The
    adapter must not then cancel "Y" in the engine: that request is the other caller's."""
    engine = _loaded(Queued())
    other = _Thread(lambda: engine.prefill(_prefill_of("other", "Y", 1, LONG)))
    assert engine.holding.wait(10)
    executor = _Recording()

    async def scenario() -> None:
        adapter = AsyncShardEngine(engine, executor=executor)
        task = asyncio.ensure_future(adapter.prefill(_prefill_of("mine", "Y", 4)))
        await asyncio.sleep(0)
        assert len(executor.submitted) == 1
        # Block the loop until the engine refused the call, then cancel the task.
        concurrent.futures.wait(executor.submitted, timeout=10)
        assert isinstance(executor.submitted[0].exception(), InvalidRequest)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    executor.shutdown()
    engine.gate.set()
    assert isinstance(other.ended(), LogitsResult)
    assert _committed(engine, "other") == 2
    assert _committed(engine, "mine") is None
    assert engine.metrics().cancelled == 0
