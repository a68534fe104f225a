"""The scheduler under the core: arrival order, continuous batching of waiting single decodes,
and every guarantee a coalesced request keeps (its own result or error, cancel, rollback).

Every test holds the backend with a prefill whose forward waits for a gate (``Queued``), queues
what it needs behind it, counted by the scheduler's queue, and only then opens the gate: what
runs together is decided by the queue, never by timing."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest
from test_cancellation import (
    LONG,
    Queued,
    _committed,
    _holding,
    _loaded,
    _prefilled,
    _Thread,
    _wait_for,
)
from test_core import HistoryEngine

from shard_engine_api import (
    CacheMiss,
    Cancelled,
    CancelRequest,
    DecodeRequest,
    EngineCrashed,
    ExportSessionRequest,
    LogitsResult,
    PrefillRequest,
    SessionRef,
    TokenInput,
    _scheduler,
)
from shard_engine_api._ledger import Admission, LedgerLimits, SessionLedger
from shard_engine_api._scheduler import Scheduler
from shard_engine_api.engine import CancelToken, ForwardItem, OutputMode

Array = npt.NDArray[np.float32]


class Recording(Queued):
    """Records every forward as ("one", session slot) or ("batch", slots); the first batched
    forward can be held on ``batch_gate`` (polling its token when ``poll`` is set)."""

    def __init__(self, *, hold_batch: bool = False, poll: bool = True) -> None:
        super().__init__()
        self.log: list[tuple[str, tuple[int, ...]]] = []
        self.batch_gate = threading.Event()
        self.in_batch = threading.Event()
        self.hold_batch = hold_batch
        self.poll = poll

    def _forward(self, item: ForwardItem, output: OutputMode, token: CancelToken) -> Array:
        if not (item.tokens is not None and LONG in item.tokens):
            self.log.append(("one", (item.slot,)))
        return super()._forward(item, output, token)

    def _export_state(self, slot: int, length: int) -> bytes:
        self.log.append(("export", (slot,)))
        return super()._export_state(slot, length)

    def _forward_batch(
        self, items: Sequence[ForwardItem], output: OutputMode, token: CancelToken
    ) -> list[Array]:
        self.log.append(("batch", tuple(item.slot for item in items)))
        if self.hold_batch:
            self.hold_batch = False
            self.in_batch.set()
            while not self.batch_gate.wait(0.001):
                if self.poll:
                    token.check()
        # The history forward itself, which never looks at the token.
        return [HistoryEngine._forward(self, item, output, token) for item in items]


def _decode(engine: Queued, session_id: str, pos: int, token_id: int = 5) -> LogitsResult:
    result = engine.decode(
        DecodeRequest(
            request_id=f"d-{session_id}-{pos}",
            session=SessionRef(session_id=session_id, epoch=1),
            pos=pos,
            inputs=TokenInput(token_ids=(token_id,)),
        )
    )
    assert isinstance(result, LogitsResult)
    return result


def _serial_logits(sessions: Sequence[str]) -> dict[str, bytes]:
    """What each session's decode at 3 gives when run alone, one after another."""
    engine = _loaded(Queued())
    _prefilled(engine, *sessions)
    return {
        s: bytes(_decode(engine, s, 3, token_id=10 + i).payload) for i, s in enumerate(sessions)
    }


def _queued_decodes(engine: Queued, sessions: Sequence[str]) -> list[_Thread]:
    threads = []
    for i, session_id in enumerate(sessions):
        threads.append(
            _Thread(lambda s=session_id, t=10 + i: _decode(engine, s, 3, token_id=t))  # type: ignore[misc]
        )
        _wait_for(lambda n=i + 1: engine._scheduler.queued == n)  # type: ignore[misc]
    return threads


def test_waiting_decodes_of_other_sessions_run_as_one_forward() -> None:
    """Four single decodes that wait behind another session's prefill run as one batched
    forward when it ends, each with the logits it gets alone, its own timings and result."""
    sessions = ("a", "b", "c", "d")
    engine = _loaded(Recording())
    _prefilled(engine, *sessions)
    engine.log.clear()
    long = _holding(engine)
    threads = _queued_decodes(engine, sessions)
    engine.gate.set()
    assert isinstance(long.ended(), LogitsResult)
    results = [thread.ended() for thread in threads]
    expected = _serial_logits(sessions)
    for session_id, result in zip(sessions, results, strict=True):
        assert isinstance(result, LogitsResult)
        assert result.session.session_id == session_id
        assert result.payload == expected[session_id]
        assert result.timings.queue_ms >= 0
        assert result.timings.total_ms >= result.timings.compute_ms
    assert [kind for kind, _ in engine.log] == ["batch"]
    assert len(engine.log[0][1]) == 4
    assert [_committed(engine, s) for s in sessions] == [4, 4, 4, 4]
    metrics = engine.metrics()
    assert (metrics.coalesced_forwards, metrics.coalesced_requests) == (1, 4)
    assert metrics.coalesced_max == 4
    assert metrics.decode_requests == 4
    assert metrics.decode_tokens == 4
    assert metrics.queue_waits == 4
    assert metrics.queued == 0
    assert metrics.queue_peak == 4
    assert engine.health().in_flight == 0


def test_arrival_order_is_served() -> None:
    """A prefill and an export that wait are served in arrival order; a later decode of
    another session joins the decode waiting before them (one forward), but an operation never
    overtakes an earlier one of its own session."""
    engine = _loaded(Recording())
    _prefilled(engine, "a", "b", "x")
    engine.log.clear()
    long = _holding(engine)
    order: list[str] = []
    first = _Thread(lambda: order.append(f"a:{_decode(engine, 'a', 3).first_pos}"))
    _wait_for(lambda: engine._scheduler.queued == 1)
    prefill = _Thread(
        lambda: order.append(
            "prefill-b"
            if engine.prefill(
                PrefillRequest(
                    request_id="p-b2",
                    session=SessionRef(session_id="b", epoch=1),
                    start_pos=3,
                    inputs=TokenInput(token_ids=(7, 8)),
                )
            )
            else ""
        )
    )
    _wait_for(lambda: engine._scheduler.queued == 2)
    # Must wait for the prefill of b before it: position 5 exists only after it.
    later_b = _Thread(lambda: order.append(f"b:{_decode(engine, 'b', 5).first_pos}"))
    _wait_for(lambda: engine._scheduler.queued == 3)
    later_x = _Thread(lambda: order.append(f"x:{_decode(engine, 'x', 3).first_pos}"))
    _wait_for(lambda: engine._scheduler.queued == 4)
    engine.gate.set()
    long.ended()
    for thread in (first, prefill, later_b, later_x):
        assert thread.ended() is None
    # a and x ran as one forward; the prefill of b then b's decode after it.
    assert engine.log[0] == (
        "batch",
        (engine._ledger.sessions["a"].slot, engine._ledger.sessions["x"].slot),
    )
    assert order.index("prefill-b") < order.index("b:5")
    assert [_committed(engine, s) for s in ("a", "b", "x")] == [4, 6, 4]


def test_a_queued_export_is_not_overtaken_by_a_decode_loop() -> None:
    """While one caller decodes in a loop, an export from another thread that waits before
    the loop's first step is served before that step, not when the loop ends."""
    engine = _loaded(Recording())
    _prefilled(engine, "loop", "s")
    engine.log.clear()
    long = _holding(engine)
    exported = _Thread(
        lambda: engine.export_session(
            ExportSessionRequest(request_id="x", session=SessionRef(session_id="s", epoch=1))
        )
    )
    _wait_for(lambda: engine._scheduler.queued == 1)
    looping = _Thread(lambda: [_decode(engine, "loop", pos) for pos in range(3, 23)])
    _wait_for(lambda: engine._scheduler.queued == 2)
    engine.gate.set()
    long.ended()
    assert exported.ended() is not None
    looping.ended()
    assert engine.log[0] == ("export", (engine._ledger.sessions["s"].slot,))
    assert len(engine.log) == 21
    assert _committed(engine, "loop") == 23


def test_cancelling_a_queued_member_leaves_the_others() -> None:
    """One of three waiting decodes is cancelled: it hears Cancelled at once (the prefill
    ahead still runs), the other two run together and commit; its session is unchanged."""
    sessions = ("a", "b", "c")
    engine = _loaded(Recording())
    _prefilled(engine, *sessions)
    engine.log.clear()
    long = _holding(engine)
    threads = _queued_decodes(engine, sessions)
    assert engine.cancel(CancelRequest(request_id="d-b-3")).cancelled
    assert isinstance(threads[1].ended(), Cancelled)
    assert long.thread.is_alive()
    engine.gate.set()
    long.ended()
    expected = _serial_logits(sessions)
    for index in (0, 2):
        result = threads[index].ended()
        assert isinstance(result, LogitsResult)
        assert result.payload == expected[sessions[index]]
    assert [_committed(engine, s) for s in sessions] == [4, 3, 4]
    assert [kind for kind, _ in engine.log] == ["batch"]


@pytest.mark.parametrize("poll", [True, False], ids=["stops-the-forward", "too-late-to-stop"])
def test_cancelling_a_member_of_a_running_forward_leaves_the_others(poll: bool) -> None:
    """A member of a coalesced forward is cancelled while it runs. A backend that polls the
    forward's token stops; the forward is rolled back whole and the others run again without
    it. One that does not stop finishes; the cancelled member alone is rolled back. Either
    way the others get exactly their results alone and the cancelled session is unchanged."""
    sessions = ("a", "b", "c")
    engine = _loaded(Recording(hold_batch=True, poll=poll))
    _prefilled(engine, *sessions)
    engine.log.clear()
    long = _holding(engine)
    threads = _queued_decodes(engine, sessions)
    engine.gate.set()
    long.ended()
    assert engine.in_batch.wait(10)
    assert engine.cancel(CancelRequest(request_id="d-b-3")).cancelled
    if not poll:
        engine.batch_gate.set()
    assert isinstance(threads[1].ended(), Cancelled)
    expected = _serial_logits(sessions)
    for index in (0, 2):
        result = threads[index].ended()
        assert isinstance(result, LogitsResult), result
        assert result.payload == expected[sessions[index]]
    assert [_committed(engine, s) for s in sessions] == [4, 3, 4]
    kinds = [len(slots) for kind, slots in engine.log if kind == "batch"]
    assert kinds == ([3, 2] if poll else [3])
    assert engine.metrics().cancelled == 1
    assert engine.health().in_flight == 0


def test_a_backend_failure_in_a_shared_forward_is_every_members_error() -> None:
    """The backend fails inside a coalesced forward: every member hears EngineCrashed, none
    commits, and the engine is failed (as a lone request's backend failure fails it)."""
    sessions = ("a", "b")
    engine = _loaded(Recording())
    engine.fail_on_token = 11
    _prefilled(engine, *sessions)
    long = _holding(engine)
    threads = _queued_decodes(engine, sessions)
    engine.gate.set()
    long.ended()
    outcomes = [thread.ended() for thread in threads]
    assert all(isinstance(outcome, EngineCrashed) for outcome in outcomes), outcomes
    assert engine.health().state == "failed"


def test_a_member_refused_by_admission_gets_its_own_error() -> None:
    """A coalesced decode at the wrong position gets its own CacheMiss (its committed length
    inside); the others of the forward commit."""
    engine = _loaded(Recording())
    _prefilled(engine, "a", "b")
    long = _holding(engine)
    good = _Thread(lambda: _decode(engine, "a", 3))
    _wait_for(lambda: engine._scheduler.queued == 1)
    wrong = _Thread(lambda: _decode(engine, "b", 9))
    _wait_for(lambda: engine._scheduler.queued == 2)
    engine.gate.set()
    long.ended()
    assert isinstance(good.ended(), LogitsResult)
    miss = wrong.ended()
    assert isinstance(miss, CacheMiss)
    assert miss.committed_length == 3
    assert [_committed(engine, s) for s in ("a", "b")] == [4, 3]


def test_a_lone_caller_never_waits() -> None:
    """One caller decoding step after step always finds the backend idle: no waits, no
    groups (the scheduler costs it one uncontended lock round trip)."""
    engine = _loaded(Recording())
    _prefilled(engine, "a")
    for pos in range(3, 53):
        _decode(engine, "a", pos)
    metrics = engine.metrics()
    assert (metrics.queue_waits, metrics.coalesced_forwards, metrics.queue_peak) == (0, 0, 0)


def test_batch_admission_evicts_in_lru_order_once_per_item() -> None:
    """8,191 idle sessions fill the KV budget; a batch of 4,096 other sessions' decodes
    evicts exactly one idle session per item, least recently used first (admission is one
    pass over the items and one sort of the idle sessions, not one sort per item)."""
    ledger = SessionLedger()
    limits = LedgerLimits(max_sessions=1 << 16, max_context=64, kv_budget=12_287, evict_lru=True)
    idle = [f"idle-{i}" for i in range(8_191)]
    members = [f"m-{i}" for i in range(4_096)]
    for session_id in [*idle, *members]:
        ledger.commit([ledger.admit_prefill(session_id, 1, 0, 1, dataclass_limits(limits))])
    assert ledger.kv_used == 12_287
    decisions = ledger.admit_batch([(m, 1, 1) for m in members], limits)
    assert all(isinstance(d, Admission) for d in decisions)
    evicted = [d.evict for d in decisions if isinstance(d, Admission)]
    assert evicted == [(idle[i],) for i in range(4_096)]


def dataclass_limits(limits: LedgerLimits) -> LedgerLimits:
    """The same limits with room to set the sessions up."""
    return LedgerLimits(
        max_sessions=limits.max_sessions,
        max_context=limits.max_context,
        kv_budget=1 << 30,
        evict_lru=False,
    )


class Chunking(Recording):
    """Prefills longer than 4 rows run in chunks of 4; the backend keeps what the first chunk
    replaced until the prefill commits or rolls back (what a chunking backend must do)."""

    prefill_chunk_tokens = 4

    def _forward(self, item: ForwardItem, output: OutputMode, token: CancelToken) -> Array:
        kept = self.saved.get(item.slot)
        try:
            return super()._forward(item, output, token)
        finally:
            if kept is not None and item.start_pos == item.committed_length:
                self.saved[item.slot] = kept


def _prefill(engine: Queued, session_id: str, start: int, tokens: Sequence[int]) -> Array:
    result = engine.prefill(
        PrefillRequest(
            request_id=f"p-{session_id}-{start}",
            session=SessionRef(session_id=session_id, epoch=1),
            start_pos=start,
            inputs=TokenInput(token_ids=tuple(tokens)),
            logits="all",
        )
    )
    assert isinstance(result, LogitsResult)
    return np.frombuffer(result.payload, np.float32).reshape(result.n_rows, -1).copy()


def test_a_long_prefill_lets_waiting_decodes_run_between_its_chunks() -> None:
    """A prefill of 10 rows runs as chunks of 4, 4 and 2; the decodes of other sessions that
    wait when its first chunk ends run as one forward before its second chunk. Every result
    equals what the same requests give on an engine that does not chunk."""
    tokens = (LONG, 2, 3, 4, 5, 6, 7, 8, 9, 10)
    engine = _loaded(Chunking())
    _prefilled(engine, "a", "b")
    engine.log.clear()
    prefill = _Thread(lambda: _prefill(engine, "p", 0, tokens))
    assert engine.holding.wait(10)
    decodes = _queued_decodes(engine, ("a", "b"))
    engine.gate.set()
    rows = prefill.ended()
    results = [thread.ended() for thread in decodes]
    slots = {s: engine._ledger.sessions[s].slot for s in ("a", "b", "p")}
    # (The first chunk, which holds the backend, is not logged.)
    assert engine.log == [
        ("batch", (slots["a"], slots["b"])),
        ("one", (slots["p"],)),
        ("one", (slots["p"],)),
    ]
    plain = _loaded(Queued())
    plain.gate.set()
    _prefilled(plain, "a", "b")
    expected = _prefill(plain, "p", 0, tokens)
    assert isinstance(rows, np.ndarray)
    assert rows.tobytes() == expected.tobytes()
    serial = _serial_logits(("a", "b"))
    assert [bytes(r.payload) for r in results if isinstance(r, LogitsResult)] == [
        serial["a"],
        serial["b"],
    ]
    assert [_committed(engine, s) for s in ("a", "b", "p")] == [4, 4, 10]


def test_a_cancelled_chunked_prefill_rolls_back_every_chunk() -> None:
    """A truncating prefill is cancelled in its second chunk: every chunk is undone, the
    positions it truncated are back, and the decodes that ran between its chunks stand."""
    engine = _loaded(Chunking())
    _prefilled(engine, "a")
    _prefill(engine, "p", 0, (1, 2, 3, 4, 5, 6))
    before = [row.copy() for row in engine.cache[engine._ledger.sessions["p"].slot]]
    prefill = _Thread(lambda: _prefill(engine, "p", 2, (1, 2, 3, 4, LONG, 6, 7)))
    assert engine.holding.wait(10)
    assert engine.cancel(CancelRequest(request_id="p-p-2")).cancelled
    engine.gate.set()  # the held chunk goes on and meets the cancel at its next row
    assert isinstance(prefill.ended(), Cancelled)
    after = engine.cache[engine._ledger.sessions["p"].slot]
    assert _committed(engine, "p") == 6
    assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))
    assert isinstance(_decode(engine, "a", 3), LogitsResult)


def test_a_cancelled_waiter_leaving_hands_the_free_backend_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The backend is left while the only waiting request is cancelled but not yet gone (it
    is passed over: the backend is free), and another request queues behind it. When the
    cancelled one leaves, the one behind it runs: it used to wait for ever (a release, which
    has no token, waited with nobody left to wake it)."""
    monkeypatch.setattr(_scheduler, "WAIT_BACKSTOP_S", 60.0)
    scheduler: Scheduler[None] = Scheduler()
    scheduler.enter(None, ("a",))
    token = CancelToken("b", ("b",))
    cancelled = _Thread(lambda: scheduler.enter(token, ("b",)))
    _wait_for(lambda: scheduler.queued == 1)
    token.cancel()  # not woken yet: it is still in the queue
    scheduler.leave()  # passes it over as cancelled: the backend is free
    entered = threading.Event()

    def release() -> None:
        scheduler.enter(None, ("c",))  # queues behind the cancelled one
        entered.set()

    behind = _Thread(release)
    _wait_for(lambda: scheduler.queued == 2)
    scheduler.wake(token)
    assert isinstance(cancelled.ended(), Cancelled)
    assert behind.ended() is None
    assert entered.is_set()
    scheduler.leave()
    assert scheduler.try_enter_alone()


def test_a_decode_that_missed_a_group_is_counted_in_the_next_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three decodes run as a group while a fourth session's decode waits. The next group
    gathers four: the three callers coming back and the one that waited (which leads it). It
    used to gather only as many as the last group had (three), so it formed without the last
    caller to come back, who then missed that group too, and so on: one session a whole
    forward behind at every step."""
    monkeypatch.setattr(_scheduler, "GATHER_CAP_S", 60.0)  # only arrivals end a gather here
    scheduler: Scheduler[None] = Scheduler()
    scheduler.enter(None, ("x",))  # the backend is busy: what follows queues
    forward = threading.Event()
    groups: list[list[str]] = []

    def decode(session_id: str, hold: bool = False) -> None:
        ticket = scheduler.enter_decode(CancelToken(session_id, (session_id,)), session_id, None)
        if not scheduler.leads(ticket):
            return  # run by its group's leader
        group = scheduler.gather(ticket, 8)
        groups.append([session for member in group for session in member.session_ids or ()])
        if hold:
            assert forward.wait(20), "the test never ended the forward"
        scheduler.finish_group(group, 100.0)
        scheduler.leave()

    first = [_Thread(lambda s=s: decode(s, hold=True)) for s in ("a", "b", "c")]  # type: ignore[misc]
    _wait_for(lambda: scheduler.queued == 3)
    scheduler.leave()  # "a" leads "a", "b", "c"; its forward waits
    _wait_for(lambda: len(groups) == 1)
    late = _Thread(lambda: decode("d"))
    _wait_for(lambda: scheduler.queued == 1)
    forward.set()  # the group ends with "d" waiting: "d" leads the next group and gathers
    for thread in first:
        assert thread.ended() is None
    again = []
    for n, session_id in enumerate(("a", "b", "c"), start=1):
        again.append(_Thread(lambda s=session_id: decode(s)))  # type: ignore[misc]
        if n < 3:
            _wait_for(lambda n=n: scheduler.queued == n)  # type: ignore[misc]
    assert late.ended() is None
    for thread in again:
        assert thread.ended() is None
    assert groups == [["a", "b", "c"], ["d", "a", "b", "c"]]
    assert scheduler.stats.groups == 2
