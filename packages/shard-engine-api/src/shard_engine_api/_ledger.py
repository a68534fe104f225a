"""The session ledger: per session its epoch, committed length, slot and LRU position, plus the
tombstones that fence released and evicted epochs.

Pure bookkeeping: no threads, no backend calls, no clocks. Limits come in as arguments and the
answers are decisions: ``admit_*`` returns an :class:`Admission` (which slot, what is cached now,
the new length, which idle sessions to evict) or raises the contract's error, and changes
nothing; ``commit`` applies admissions (evictions included) and returns the slots the backend
must drop. So an operation that fails or is cancelled before ``commit`` leaves the ledger exactly
as it was, evictions included. The owner (``EngineCore``) serialises every call.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from shard_engine_api._errors import CacheMiss, ResourceExhausted, ShardEngineError, StaleEpoch
from shard_engine_api._fences import DEFAULT_GENERATION_SIZE, FenceTable

__all__ = [
    "Admission",
    "ImportAdmission",
    "LedgerLimits",
    "Release",
    "SessionEntry",
    "SessionLedger",
]


@dataclass(frozen=True, slots=True)
class LedgerLimits:
    """What admission may use now. ``spare_slot``: the backend accepts one slot more than
    ``max_sessions``, so a new session can run before its LRU victim is dropped."""

    max_sessions: int
    max_context: int
    kv_budget: int
    evict_lru: bool
    spare_slot: bool = False


@dataclass(slots=True)
class SessionEntry:
    """A live session."""

    session_id: str
    epoch: int
    slot: int
    length: int
    last_used: int


@dataclass(slots=True)
class Admission:
    """What an admitted request will do to the ledger when it commits (a value: not
    changed after admission; not frozen only because it is built on every decode).

    ``committed_length`` positions of ``slot`` are cached now; the backend replaces positions
    from ``start_pos`` on. ``evict`` are idle sessions dropped at commit. ``evict_first`` names
    the one victim whose slot must be handed over before the forward (only when every slot is
    in use and the backend has no spare slot); see :meth:`SessionLedger.hand_over`.
    """

    session_id: str
    epoch: int
    slot: int
    start_pos: int
    committed_length: int
    new_length: int
    is_new: bool
    evict: tuple[str, ...] = ()
    evict_first: str | None = None


@dataclass(frozen=True, slots=True)
class ImportAdmission:
    """What an admitted import will do when it commits: install ``length`` positions in the
    empty ``slot`` under ``epoch``, replace the older live epoch ``replaces`` (its slot is
    dropped at commit) and evict the idle sessions ``evict`` (also at commit)."""

    session_id: str
    epoch: int
    slot: int
    length: int
    replaces: int | None = None
    evict: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Release:
    """The decision of a release: the freed slot (None for a no-op) and why."""

    slot: int | None
    length: int
    detail: str


class SessionLedger:
    """Sessions, slots and fences of one engine."""

    def __init__(self, fence_generation: int = DEFAULT_GENERATION_SIZE) -> None:
        self.sessions: dict[str, SessionEntry] = {}
        self.fences = FenceTable(fence_generation)
        self.kv_used = 0
        self._tick = 0
        # Slots are handed out lazily (0, 1, 2, ...) and recycled: memory follows use, not
        # the configured maximum.
        self._free_slots: list[int] = []
        self._next_slot = 0

    # ----------------------------------------------------------------- the fence rule

    def _live_or_fenced(
        self, session_id: str, epoch: int, *, releasing: bool = False
    ) -> tuple[SessionEntry | None, str]:
        """The one fence rule. Returns the live entry (or None) and, for a session with no
        live state, whether its epoch was ``"evicted"``, ``"released"`` (only when releasing
        again) or is an ``"unknown_session"``. Raises StaleEpoch for an epoch older than the
        live one, not newer than a released one, or older than an evicted one."""
        current = self.sessions.get(session_id)
        if current is not None:
            if epoch < current.epoch:
                raise StaleEpoch(
                    f"session {session_id!r} is at epoch {current.epoch}; request has {epoch}"
                )
            return current, "live"
        fence = self.fences.get(session_id)
        if fence is None:
            return None, "unknown_session"
        if epoch < fence.epoch or (epoch == fence.epoch and fence.released and not releasing):
            kind = "released" if fence.released else "evicted"
            raise StaleEpoch(
                f"session {session_id!r} epoch {epoch} is fenced ({kind} epoch {fence.epoch})"
            )
        if epoch == fence.epoch:
            return None, "released" if fence.released else "evicted"
        return None, "unknown_session"

    # ----------------------------------------------------------------- admission

    def admit_prefill(
        self, session_id: str, epoch: int, start_pos: int, n_tokens: int, limits: LedgerLimits
    ) -> Admission:
        """Admit a prefill of ``n_tokens`` at ``start_pos`` (truncating first), or raise."""
        new_length = start_pos + n_tokens
        if new_length > limits.max_context:
            raise ResourceExhausted(
                f"positions up to {new_length} exceed max_context {limits.max_context}",
                retryable=False,
                details={"resource": "context"},
            )
        current, status = self._live_or_fenced(session_id, epoch)
        if current is not None:
            length = current.length if epoch == current.epoch else 0
            if start_pos > length:
                raise CacheMiss(
                    f"prefill at {start_pos} would leave a gap after {length} cached positions",
                    committed_length=length,
                    reason="gap" if epoch == current.epoch else "new_epoch",
                )
            evict = self._room_for(
                session_id, new_length - current.length, is_new=False, limits=limits
            )
            return Admission(
                session_id=session_id,
                epoch=epoch,
                slot=current.slot,
                start_pos=start_pos,
                committed_length=current.length,
                new_length=new_length,
                is_new=False,
                evict=evict,
            )
        if start_pos > 0:
            reason = "evicted" if status == "evicted" else "unknown_session"
            raise CacheMiss(
                f"session {session_id!r} has no cached positions ({reason}); prefill from 0",
                committed_length=0,
                reason=reason,
            )
        evict = self._room_for(session_id, new_length, is_new=True, limits=limits)
        slot = self._peek_slot(limits)
        first = None
        if slot is None:
            # Every slot is in use and the backend has no spare: the first victim's slot is
            # handed over before the forward.
            first, evict = evict[0], evict[1:]
            slot = self.sessions[first].slot
        return Admission(
            session_id=session_id,
            epoch=epoch,
            slot=slot,
            start_pos=0,
            committed_length=0,
            new_length=new_length,
            is_new=True,
            evict=evict,
            evict_first=first,
        )

    def admit_decode(
        self, session_id: str, epoch: int, pos: int, limits: LedgerLimits
    ) -> Admission:
        """Admit one decode row at ``pos``, or raise."""
        current = self._decode_entry(session_id, epoch, pos, limits)
        # The common case inline (the row fits the budget): exactly what _room_for answers then.
        if self.kv_used + 1 <= limits.kv_budget:
            evict: tuple[str, ...] = ()
        else:
            evict = self._room_for(session_id, 1, is_new=False, limits=limits)
        # Positional (session_id, epoch, slot, start_pos, committed_length, new_length, is_new,
        # evict): built on every decode step, and keywords cost twice as much here.
        return Admission(
            session_id, epoch, current.slot, pos, current.length, pos + 1, False, evict
        )

    def _decode_entry(
        self, session_id: str, epoch: int, pos: int, limits: LedgerLimits
    ) -> SessionEntry:
        """The live entry a decode row at ``pos`` extends, or the error it gets (budget aside)."""
        current = self.sessions.get(session_id)
        if current is None or epoch < current.epoch:
            # Not plainly live (the common case, every decode step): the fence rule decides.
            current = self._cached_entry(session_id, epoch, "")
        elif epoch > current.epoch:
            raise _not_prefilled(session_id, epoch)
        if pos != current.length:
            raise CacheMiss(
                f"decode at {pos} but session {session_id!r} has {current.length} cached positions",
                committed_length=current.length,
                reason="position_mismatch",
            )
        if pos + 1 > limits.max_context:
            raise ResourceExhausted(
                f"position {pos} reaches max_context {limits.max_context}",
                retryable=False,
                details={"resource": "context"},
            )
        return current

    def admit_batch(
        self,
        items: Sequence[tuple[str, int, int]],
        limits: LedgerLimits,
        *,
        protect: Collection[str] = (),
        reserved: int = 0,
    ) -> list[Admission | ShardEngineError]:
        """Admit one decode row per ``(session_id, epoch, pos)`` (distinct sessions). Members are
        never evicted; idle sessions are evicted (least recently used first) before an item is
        refused. O(items) plus one sort of the idle sessions, done only if some item needs
        room: the victims are taken from that one LRU order, in turn. ``protect``: sessions
        that are not idle though they look it (a chunked prefill is running on them), never
        evicted; ``reserved``: positions an admitted operation not yet committed will use."""
        members = frozenset(session_id for session_id, _, _ in items).union(protect)
        decisions: list[Admission | ShardEngineError] = []
        admitted = 0  # rows admitted so far
        freed = 0  # positions the victims chosen so far free
        idle: list[SessionEntry] | None = None  # the LRU order, made on first need
        next_victim = 0
        for session_id, epoch, pos in items:
            try:
                current = self._decode_entry(session_id, epoch, pos, limits)
            except ShardEngineError as error:
                decisions.append(error)
                continue
            over = self.kv_used - freed + admitted + reserved + 1 - limits.kv_budget
            evict: tuple[str, ...] = ()
            if over > 0:
                if not limits.evict_lru:
                    decisions.append(self._over_budget(over, limits))
                    continue
                if idle is None:
                    idle = sorted(
                        (s for s in self.sessions.values() if s.session_id not in members),
                        key=lambda s: s.last_used,
                    )
                first = next_victim
                released = 0
                while over > 0 and next_victim < len(idle):
                    released += idle[next_victim].length
                    over -= idle[next_victim].length
                    next_victim += 1
                if over > 0:  # the victims stay free for later items
                    next_victim = first
                    decisions.append(self._cannot_fit(limits))
                    continue
                freed += released
                evict = tuple(victim.session_id for victim in idle[first:next_victim])
            admitted += 1
            decisions.append(
                Admission(
                    session_id, epoch, current.slot, pos, current.length, pos + 1, False, evict
                )
            )
        return decisions

    def _over_budget(self, over: int, limits: LedgerLimits) -> ResourceExhausted:
        return ResourceExhausted(
            f"KV budget of {limits.kv_budget} positions would be exceeded by {over}",
            details={"resource": "kv", "kv_used": self.kv_used, "kv_budget": limits.kv_budget},
        )

    def _cannot_fit(self, limits: LedgerLimits) -> ResourceExhausted:
        return ResourceExhausted(
            f"KV budget of {limits.kv_budget} positions cannot fit the request even after "
            "evicting every idle session",
            details={"resource": "kv", "kv_used": self.kv_used, "kv_budget": limits.kv_budget},
        )

    def _room_for(
        self, session_id: str, extra_tokens: int, *, is_new: bool, limits: LedgerLimits
    ) -> tuple[str, ...]:
        """The idle sessions (least recently used first) to evict so ``extra_tokens`` more
        positions (and a session, if ``is_new``) fit; raise ResourceExhausted if they cannot."""
        need_session = is_new and len(self.sessions) >= limits.max_sessions
        over = self.kv_used + extra_tokens - limits.kv_budget
        if not need_session and over <= 0:
            return ()
        if not limits.evict_lru:
            if need_session:
                raise ResourceExhausted(
                    f"all {len(self.sessions)} session slots are in use",
                    details={"resource": "sessions"},
                )
            raise self._over_budget(over, limits)
        idle = sorted(
            (s for s in self.sessions.values() if s.session_id != session_id),
            key=lambda s: s.last_used,
        )
        chosen: list[str] = []
        for candidate in idle:
            if not need_session and over <= 0:
                break
            chosen.append(candidate.session_id)
            over -= candidate.length
            need_session = False
        if need_session or over > 0:
            raise self._cannot_fit(limits)
        return tuple(chosen)

    def _peek_slot(self, limits: LedgerLimits, *, replacing: bool = False) -> int | None:
        """The slot a new session would get now, without taking it. ``replacing``: the new
        state replaces a live session at commit, so the backend's spare slot may hold it
        meanwhile whatever the eviction policy (the session count does not grow)."""
        if self._free_slots:
            return self._free_slots[-1]
        spare = limits.spare_slot and (limits.evict_lru or replacing)
        pool = limits.max_sessions + (1 if spare else 0)
        return self._next_slot if self._next_slot < pool else None

    def _take_slot(self, slot: int) -> None:
        if slot == self._next_slot:
            self._next_slot += 1
        else:
            self._free_slots.remove(slot)

    # ----------------------------------------------------------------- migration

    def check_export(self, session_id: str, epoch: int) -> SessionEntry:
        """The live entry an export of ``(session_id, epoch)`` reads, or the error a decode of
        that epoch would get (CacheMiss for unknown, evicted or not-yet-prefilled newer epochs;
        StaleEpoch for older or released ones). Changes nothing, LRU order included."""
        return self._cached_entry(session_id, epoch, " to export")

    def _cached_entry(self, session_id: str, epoch: int, purpose: str) -> SessionEntry:
        """The live entry of ``(session_id, epoch)`` by the fence rule, or the CacheMiss /
        StaleEpoch a read of its cache gets (``purpose`` completes the CacheMiss message)."""
        current, status = self._live_or_fenced(session_id, epoch)
        if current is None:
            reason = "evicted" if status == "evicted" else "unknown_session"
            raise CacheMiss(
                f"session {session_id!r} has no cached state{purpose} ({reason})",
                committed_length=0,
                reason=reason,
            )
        if epoch > current.epoch:
            raise _not_prefilled(session_id, epoch)
        return current

    def admit_import(
        self, session_id: str, epoch: int, length: int, limits: LedgerLimits
    ) -> ImportAdmission:
        """Admit installing ``length`` positions of ``session_id`` under ``epoch``, or raise.

        The epoch rule is prefill's, made strict for live state: an epoch not newer than the
        live one, not newer than a released one, or older than an evicted one is StaleEpoch;
        an unknown session (or one evicted at this epoch) gets a new slot; an older live epoch
        is replaced at commit. The state goes into an empty slot while the old one is kept, and
        every eviction waits for the commit, so a failure changes nothing; when no empty slot
        exists without evicting first, the import is refused with ResourceExhausted."""
        if length > limits.max_context:
            raise ResourceExhausted(
                f"snapshot of {length} positions exceeds max_context {limits.max_context}",
                retryable=False,
                details={"resource": "context"},
            )
        current, _status = self._live_or_fenced(session_id, epoch)
        if current is not None and epoch <= current.epoch:
            raise StaleEpoch(
                f"session {session_id!r} is live at epoch {current.epoch}; an import must "
                f"carry a newer epoch, got {epoch}"
            )
        replacing = current is not None
        extra = length - (current.length if current is not None else 0)
        evict = self._room_for(session_id, extra, is_new=not replacing, limits=limits)
        slot = self._peek_slot(limits, replacing=replacing)
        if slot is None:
            raise ResourceExhausted(
                f"no empty session slot to install session {session_id!r} into (all "
                f"{limits.max_sessions} are in use and idle sessions are only evicted once an "
                "import has succeeded)",
                details={"resource": "sessions"},
            )
        return ImportAdmission(
            session_id=session_id,
            epoch=epoch,
            slot=slot,
            length=length,
            replaces=current.slot if current is not None else None,
            evict=evict,
        )

    def commit_import(self, admission: ImportAdmission) -> tuple[int, ...]:
        """Apply a succeeded import; return the slots the backend must drop (the replaced
        epoch's, then the evicted sessions')."""
        self._tick += 1
        self._take_slot(admission.slot)
        dropped: tuple[int, ...] = ()
        current = self.sessions.pop(admission.session_id, None)
        if current is not None:
            self.kv_used -= current.length
            self._free_slots.append(current.slot)
            dropped += (current.slot,)
        self.sessions[admission.session_id] = SessionEntry(
            session_id=admission.session_id,
            epoch=admission.epoch,
            slot=admission.slot,
            length=admission.length,
            last_used=self._tick,
        )
        self.kv_used += admission.length
        dropped += tuple(self._evict(victim) for victim in admission.evict)
        return dropped

    # ----------------------------------------------------------------- changes

    def hand_over(self, admission: Admission) -> int | None:
        """Evict ``admission.evict_first`` now (its slot goes to the new session); return the
        slot the backend must drop before the forward. The one eviction that cannot wait for
        the commit: it happens only when no slot is free and the backend has no spare slot."""
        if admission.evict_first is None:
            return None
        return self._evict(admission.evict_first)

    def commit(self, admissions: Sequence[Admission]) -> tuple[int, ...]:
        """Apply admitted operations that succeeded; return the evicted slots to drop."""
        for admission in admissions:
            self._tick += 1
            current = self.sessions.get(admission.session_id)
            if current is None:
                self._take_slot(admission.slot)
                self.sessions[admission.session_id] = SessionEntry(
                    session_id=admission.session_id,
                    epoch=admission.epoch,
                    slot=admission.slot,
                    length=admission.new_length,
                    last_used=self._tick,
                )
                self.kv_used += admission.new_length
            else:
                self.kv_used += admission.new_length - current.length
                current.length = admission.new_length
                current.epoch = admission.epoch
                current.last_used = self._tick
        dropped: list[int] = []  # a growing tuple would copy itself once per admission
        for admission in admissions:
            if admission.evict:
                dropped.extend(self._evict(victim) for victim in admission.evict)
        return tuple(dropped)

    def _evict(self, session_id: str) -> int:
        victim = self.sessions.pop(session_id)
        self.kv_used -= victim.length
        self._free_slots.append(victim.slot)
        self.fences.put(session_id, victim.epoch, released=False)
        return victim.slot

    def release(self, session_id: str, epoch: int) -> Release:
        """Free a live session and fence ``epoch``; a no-op for a session with no live state.
        Raises StaleEpoch for an epoch older than the live or fenced one."""
        current, _ = self._live_or_fenced(session_id, epoch, releasing=True)
        if current is None:
            fenced = self.fences.get(session_id) is not None
            detail = (
                "already released or evicted; nothing to free"
                if fenced
                else "unknown session; nothing to free"
            )
            return Release(slot=None, length=0, detail=detail)
        del self.sessions[session_id]
        self.kv_used -= current.length
        self._free_slots.append(current.slot)
        self.fences.put(session_id, epoch, released=True)
        return Release(slot=current.slot, length=current.length, detail="")

    def clear(self) -> None:
        """Forget every session (the engine is closing)."""
        self.sessions.clear()
        self.kv_used = 0
        self._free_slots.clear()
        self._next_slot = 0


def _not_prefilled(session_id: str, epoch: int) -> CacheMiss:
    return CacheMiss(
        f"session {session_id!r} epoch {epoch} has not been prefilled",
        committed_length=0,
        reason="new_epoch",
    )
