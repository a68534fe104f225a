"""The session ledger against a small independent model of the contract's session semantics:
epochs and fences, committed lengths, LRU evictions, slots, and "admission changes nothing
until commit" (every admitted operation is randomly committed or abandoned)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from shard_engine_api import CacheMiss, ResourceExhausted, ShardEngineError, StaleEpoch
from shard_engine_api._fences import BYTES_PER_FENCE, FenceTable
from shard_engine_api._ledger import Admission, LedgerLimits, SessionLedger

SESSIONS = st.sampled_from(["a", "b", "c", "d"])
EPOCHS = st.integers(0, 2)
STARTS = st.sampled_from(["zero", "append", "truncate", "gap"])
_T = TypeVar("_T")
DEEP = os.environ.get("SHARD_ENGINE_DEEP_TESTS") == "1"


@dataclasses.dataclass
class _Live:
    epoch: int
    length: int
    last_used: int


class LedgerModel(RuleBasedStateMachine):
    """Drives a SessionLedger and a dict-based model side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = SessionLedger(fence_generation=1 << 16)
        self.live: dict[str, _Live] = {}
        self.fences: dict[str, tuple[int, bool]] = {}
        self.tick = 0
        self.limits = LedgerLimits(max_sessions=3, max_context=8, kv_budget=12, evict_lru=True)

    @initialize(
        max_sessions=st.integers(1, 4),
        kv_budget=st.integers(2, 16),
        lru=st.booleans(),
        spare=st.booleans(),
    )
    def configure(self, max_sessions: int, kv_budget: int, lru: bool, spare: bool) -> None:
        self.limits = LedgerLimits(
            max_sessions=max_sessions,
            max_context=8,
            kv_budget=kv_budget,
            evict_lru=lru,
            spare_slot=spare,
        )

    # ----------------------------------------------------------------- the model

    def _fence_rule(self, sid: str, epoch: int, *, releasing: bool = False) -> str:
        live = self.live.get(sid)
        if live is not None:
            if epoch < live.epoch:
                raise StaleEpoch("older than live")
            return "live"
        fence = self.fences.get(sid)
        if fence is None:
            return "unknown_session"
        fenced, released = fence
        if epoch < fenced or (epoch == fenced and released and not releasing):
            raise StaleEpoch("fenced")
        if epoch == fenced:
            return "released" if released else "evicted"
        return "unknown_session"

    def _victims(
        self, sid: str, extra: int, *, is_new: bool, protect: frozenset[str] = frozenset()
    ) -> list[str]:
        need = is_new and len(self.live) >= self.limits.max_sessions
        over = sum(s.length for s in self.live.values()) + extra - self.limits.kv_budget
        if not need and over <= 0:
            return []
        if not self.limits.evict_lru:
            raise ResourceExhausted("no room")
        order = sorted(
            (s for s in self.live if s != sid and s not in protect),
            key=lambda s: self.live[s].last_used,
        )
        victims: list[str] = []
        for victim in order:
            if not need and over <= 0:
                break
            victims.append(victim)
            over -= self.live[victim].length
            need = False
        if need or over > 0:
            raise ResourceExhausted("no room even after evicting")
        return victims

    def _expect_prefill(self, sid: str, epoch: int, start: int, n: int) -> tuple[int, list[str]]:
        new_length = start + n
        if new_length > self.limits.max_context:
            raise ResourceExhausted("context")
        status = self._fence_rule(sid, epoch)
        live = self.live.get(sid)
        if live is not None:
            length = live.length if epoch == live.epoch else 0
            if start > length:
                raise CacheMiss("gap", committed_length=length, reason="gap")
            return new_length, self._victims(sid, new_length - live.length, is_new=False)
        if start > 0:
            reason = "evicted" if status == "evicted" else "unknown_session"
            raise CacheMiss("none", committed_length=0, reason=reason)
        return new_length, self._victims(sid, new_length, is_new=True)

    def _apply(self, sid: str, epoch: int, length: int, victims: list[str]) -> None:
        self.tick += 1
        self.live[sid] = _Live(epoch, length, self.tick)
        for victim in victims:
            self._evict(victim)

    def _evict(self, victim: str) -> None:
        gone = self.live.pop(victim)
        self.fences[victim] = max(self.fences.get(victim, (-1, False)), (gone.epoch, False))

    # ----------------------------------------------------------------- rules

    def _finish(self, admission: Admission, commit: bool) -> None:
        if admission.evict_first is not None:
            assert not self.limits.spare_slot or not self.limits.evict_lru
            self.ledger.hand_over(admission)
            self._evict(admission.evict_first)
        if commit:
            self.ledger.commit([admission])

    @rule(sid=SESSIONS, epoch=EPOCHS, where=STARTS, n=st.integers(1, 5), commit=st.booleans())
    def prefill(self, sid: str, epoch: int, where: str, n: int, commit: bool) -> None:
        length = self.live[sid].length if sid in self.live else 0
        offsets = {"zero": -length, "append": 0, "truncate": -1, "gap": 1}
        start = max(0, length + offsets[where])
        expected = _outcome(lambda: self._expect_prefill(sid, epoch, start, n))
        if isinstance(expected, ShardEngineError):
            with pytest.raises(type(expected)) as raised:
                self.ledger.admit_prefill(sid, epoch, start, n, self.limits)
            _same_miss(raised.value, expected)
            return
        length, victims = expected
        admission = self.ledger.admit_prefill(sid, epoch, start, n, self.limits)
        first = [admission.evict_first] if admission.evict_first else []
        assert first + list(admission.evict) == victims
        assert admission.new_length == length
        self._finish(admission, commit)
        if commit:
            self._apply(sid, epoch, length, [v for v in victims if v not in first])

    @rule(sid=SESSIONS, epoch=EPOCHS, delta=st.integers(-1, 1), commit=st.booleans())
    def decode(self, sid: str, epoch: int, delta: int, commit: bool) -> None:
        live = self.live.get(sid)
        pos = max(0, (live.length if live else 0) + delta)
        expected = _outcome(lambda: self._expect_decode(sid, epoch, pos))
        if isinstance(expected, ShardEngineError):
            with pytest.raises(type(expected)) as raised:
                self.ledger.admit_decode(sid, epoch, pos, self.limits)
            _same_miss(raised.value, expected)
            return
        victims = expected
        admission = self.ledger.admit_decode(sid, epoch, pos, self.limits)
        assert list(admission.evict) == victims
        assert admission.evict_first is None
        self._finish(admission, commit)
        if commit:
            self._apply(sid, epoch, pos + 1, victims)

    def _expect_decode(self, sid: str, epoch: int, pos: int) -> list[str]:
        live = self.live.get(sid)
        status = self._fence_rule(sid, epoch)
        if live is None:
            reason = "evicted" if status == "evicted" else "unknown_session"
            raise CacheMiss("none", committed_length=0, reason=reason)
        if epoch > live.epoch:
            raise CacheMiss("new epoch", committed_length=0, reason="new_epoch")
        if pos != live.length:
            raise CacheMiss("position", committed_length=live.length, reason="position_mismatch")
        if pos + 1 > self.limits.max_context:
            raise ResourceExhausted("context")
        return self._victims(sid, 1, is_new=False)

    @rule(data=st.data(), commit=st.booleans())
    def batch(self, data: st.DataObject, commit: bool) -> None:
        # Mostly live sessions (the interesting case: budget pressure with idle ones around).
        pool = [*sorted(self.live), "stranger"]
        members = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
        items = [
            (
                sid,
                self.live[sid].epoch if sid in self.live else 0,
                self.live[sid].length if sid in self.live else 0,
            )
            for sid in members
        ]
        decisions = self.ledger.admit_batch(items, self.limits)
        admitted = [d for d in decisions if isinstance(d, Admission)]
        victims = [v for d in admitted for v in d.evict]
        assert not set(victims) & set(members), "a batch evicted its own member"
        assert len(victims) == len(set(victims))
        lengths = {sid: live.length for sid, live in self.live.items()}
        idle = set(lengths) - set(members)
        admitted_before = 0
        for decision in decisions:
            if isinstance(decision, Admission):
                admitted_before += 1
            elif isinstance(decision, ResourceExhausted) and decision.details["resource"] == "kv":
                # Refused only when evicting every idle session could not make room.
                floor = sum(lengths.values()) - sum(lengths[sid] for sid in idle)
                assert floor + admitted_before + 1 > self.limits.kv_budget or not (
                    self.limits.evict_lru
                ), "refused although evicting idle sessions would make room"
        if commit:
            before = {sid: self.live[sid].length for sid in self.live}
            self.ledger.commit(admitted)
            for admission in admitted:
                self.tick += 1
                self.live[admission.session_id].length = before[admission.session_id] + 1
                self.live[admission.session_id].last_used = self.tick
            for victim in victims:
                self._evict(victim)

    @rule(sid=SESSIONS, epoch=EPOCHS)
    def release(self, sid: str, epoch: int) -> None:
        try:
            self._fence_rule(sid, epoch, releasing=True)
        except StaleEpoch:
            with pytest.raises(StaleEpoch):
                self.ledger.release(sid, epoch)
            return
        decision = self.ledger.release(sid, epoch)
        if sid in self.live:
            assert decision.slot is not None
            self.live.pop(sid)
            self.fences[sid] = max(self.fences.get(sid, (-1, False)), (epoch, True))
        else:
            assert decision.slot is None, "a second release freed again"

    @rule(budget=st.integers(2, 16))
    def pressure(self, budget: int) -> None:
        self.limits = dataclasses.replace(self.limits, kv_budget=budget)

    # ----------------------------------------------------------------- invariants

    @invariant()
    def agrees_with_model(self) -> None:
        ledger = self.ledger
        assert {sid: (s.epoch, s.length) for sid, s in ledger.sessions.items()} == {
            sid: (s.epoch, s.length) for sid, s in self.live.items()
        }
        assert ledger.kv_used == sum(s.length for s in self.live.values())
        slots = [s.slot for s in ledger.sessions.values()]
        assert len(slots) == len(set(slots)), f"two sessions share a slot: {slots}"
        pool = self.limits.max_sessions + (self.limits.spare_slot and self.limits.evict_lru)
        assert all(0 <= slot < pool for slot in slots)
        assert len(ledger.sessions) <= self.limits.max_sessions
        for sid, (epoch, released) in self.fences.items():
            fence = ledger.fences.get(sid)
            assert fence is not None
            assert (fence.epoch, fence.released) == (epoch, released)


def _outcome(call: Callable[[], _T]) -> _T | ShardEngineError:
    try:
        return call()
    except ShardEngineError as error:
        return error


def _same_miss(raised: BaseException, expected: ShardEngineError) -> None:
    """A CacheMiss carries the committed length and (except gap/new-epoch) the model's reason."""
    if isinstance(expected, CacheMiss):
        assert isinstance(raised, CacheMiss)
        assert raised.committed_length == expected.committed_length
        if expected.reason not in ("gap", "new_epoch"):
            assert raised.reason == expected.reason


LedgerModel.TestCase.settings = settings(
    max_examples=1000 if DEEP else 100,
    stateful_step_count=60 if DEEP else 30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLedgerModel = LedgerModel.TestCase


def test_fences_survive_churn_far_beyond_65536() -> None:
    """200,000 released sessions: every fence of the newest generation is kept, nothing is
    dropped silently, and a brand-new session at epoch 1 is still admitted."""
    table = FenceTable(generation_size=1 << 17)
    churn = 200_000
    for index in range(churn):
        table.put(f"session-{index}", 1, released=True)
    assert table.dropped == 0
    for index in range(0, churn, 997):
        fence = table.get(f"session-{index}")
        assert fence is not None
        assert (fence.epoch, fence.released) == (1, True)
    assert table.get("never-seen") is None
    assert table.nbytes <= (len(table) + 4096) * BYTES_PER_FENCE


def test_dropping_a_generation_is_counted() -> None:
    table = FenceTable(generation_size=1000)
    for index in range(2500):
        table.put(f"s{index}", 3, released=True)
    assert table.dropped > 0
    # The newest generation_size fences are always kept.
    for index in range(1500, 2500):
        assert table.get(f"s{index}") is not None
    ledger = SessionLedger(fence_generation=1000)
    limits = LedgerLimits(max_sessions=2, max_context=8, kv_budget=8, evict_lru=False)
    ledger.commit([ledger.admit_prefill("fresh", 1, 0, 1, limits)])
    assert ledger.sessions["fresh"].epoch == 1


def test_newer_fence_wins_across_generations() -> None:
    table = FenceTable(generation_size=4)
    table.put("x", 2, released=False)
    for index in range(5):
        table.put(f"filler{index}", 1, released=True)
    table.put("x", 5, released=True)
    fence = table.get("x")
    assert fence is not None
    assert (fence.epoch, fence.released) == (5, True)
