"""A reference model of the contract's session semantics, for the model-based conformance test.

Written from ARCHITECTURE.md ("Session semantics"), not from :class:`EngineCore`, and sharing no
code with it: a bug in the core cannot certify itself. It keeps, per session, the epoch, the
committed length and the last use; per released session the fenced epoch (tombstone); per
evicted session its epoch; and the counters a worker may read. It answers what an operation
must do: admit it (with the sessions it evicts) or refuse it with one of a set of errors, each
with the fields the error must carry.

Where the contract leaves an order of checks open (a request that is both stale and too long),
the model accepts every error that applies. Where it leaves a behaviour open (how a batch naming
one session twice is refused), the caller picks the variant the engine showed, among the
allowed ones, and the model follows it.
"""

from __future__ import annotations

import collections
import copy
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "Admission",
    "ContractModel",
    "ExpectedError",
    "ModelLimits",
    "ModelSession",
    "Refusal",
]

EvictionPolicy = Literal["reject", "lru"]


@dataclass(frozen=True, slots=True)
class ExpectedError:
    """One error an operation may raise. ``committed_length`` and ``evicted`` apply to
    cache_miss: the length the error must carry and whether its reason must be "evicted"."""

    code: str
    why: str
    committed_length: int | None = None
    evicted: bool = False

    def describe(self) -> str:
        extra = ""
        if self.code == "cache_miss":
            extra = f"(committed_length={self.committed_length}"
            extra += ', reason="evicted")' if self.evicted else ")"
        return f"{self.code}{extra}: {self.why}"


@dataclass(frozen=True, slots=True)
class Refusal:
    """The operation must fail with one of ``errors`` and change nothing."""

    errors: tuple[ExpectedError, ...]

    def codes(self) -> set[str]:
        return {error.code for error in self.errors}

    def describe(self) -> str:
        return " or ".join(error.describe() for error in self.errors)


@dataclass(frozen=True, slots=True)
class Admission:
    """The operation must succeed: the session then holds ``new_length`` positions at
    ``epoch`` and the sessions in ``evict`` (least recently used first) are evicted."""

    session_id: str
    epoch: int
    start_pos: int
    new_length: int
    evict: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelLimits:
    max_sessions: int
    max_context: int
    max_batch_tokens: int
    kv_budget_tokens: int
    eviction: EvictionPolicy


@dataclass(slots=True)
class ModelSession:
    epoch: int
    length: int
    last_used: int


@dataclass(slots=True)
class ModelCounters:
    requests: int = 0
    prefill_requests: int = 0
    decode_requests: int = 0
    batch_requests: int = 0
    batch_items: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    evictions: int = 0
    releases: int = 0
    cancelled: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    """Every error a caller received, by code: raised (any operation, release included) or
    returned as an item of a batch result."""


class ContractModel:
    """The state of one engine as the contract defines it."""

    def __init__(self, limits: ModelLimits) -> None:
        self.limits = limits
        self.sessions: dict[str, ModelSession] = {}
        self.released: dict[str, int] = {}
        self.evicted: dict[str, int] = {}
        self.counters = ModelCounters()
        self._clock = 0

    def copy(self) -> ContractModel:
        return copy.deepcopy(self)

    # ----------------------------------------------------------------- queries

    @property
    def kv_used(self) -> int:
        return sum(session.length for session in self.sessions.values())

    def committed_length(self, session_id: str) -> int:
        session = self.sessions.get(session_id)
        return 0 if session is None else session.length

    def epoch_of(self, session_id: str) -> int | None:
        session = self.sessions.get(session_id)
        return None if session is None else session.epoch

    def fence(self, session_id: str) -> int | None:
        """The newest released or evicted epoch of a session with no state."""
        epochs = [
            epoch
            for epoch in (self.released.get(session_id), self.evicted.get(session_id))
            if epoch is not None
        ]
        return max(epochs) if epochs else None

    def tombstones(self) -> int:
        """Released sessions that hold no state now: at least this many fences exist."""
        return sum(1 for session_id in self.released if session_id not in self.sessions)

    # ----------------------------------------------------------------- planning

    def _fenced(self, session_id: str, epoch: int) -> ExpectedError | None:
        released = self.released.get(session_id)
        if released is not None and epoch <= released:
            return ExpectedError(
                "stale_epoch", f"epoch {epoch} <= released epoch {released} (tombstone)"
            )
        evicted = self.evicted.get(session_id)
        if evicted is not None and epoch < evicted:
            return ExpectedError("stale_epoch", f"epoch {epoch} < evicted epoch {evicted}")
        return None

    def _missing(self, session_id: str, epoch: int, why: str) -> ExpectedError:
        evicted = self.evicted.get(session_id) == epoch
        return ExpectedError(
            "cache_miss",
            f"{why} ({'evicted' if evicted else 'no state'})",
            committed_length=0,
            evicted=evicted,
        )

    def _budget(
        self,
        session_id: str,
        *,
        is_new: bool,
        extra_tokens: int,
        protected: frozenset[str] = frozenset(),
    ) -> tuple[str, ...] | ExpectedError:
        """The sessions to evict (LRU by last use, never the requester or ``protected``)
        so the request fits; or the ResourceExhausted it must get."""
        limits = self.limits
        need_slot = is_new and len(self.sessions) >= limits.max_sessions
        over = self.kv_used + extra_tokens - limits.kv_budget_tokens
        if not need_slot and over <= 0:
            return ()
        if limits.eviction != "lru":
            what = "every session slot is in use" if need_slot else "the KV budget is full"
            return ExpectedError("resource_exhausted", what)
        candidates = sorted(
            (
                (session.last_used, sid)
                for sid, session in self.sessions.items()
                if sid != session_id and sid not in protected
            ),
        )
        evict: list[str] = []
        freed = 0
        for _, sid in candidates:
            if not need_slot and over - freed <= 0:
                break
            evict.append(sid)
            freed += self.sessions[sid].length
            need_slot = False
        if need_slot or over - freed > 0:
            return ExpectedError(
                "resource_exhausted", "does not fit even after evicting every idle session"
            )
        return tuple(evict)

    def plan_prefill(
        self, session_id: str, epoch: int, start_pos: int, n_tokens: int
    ) -> Admission | Refusal:
        """What ``prefill(epoch, start_pos, n_tokens rows)`` must do (inputs valid)."""
        errors: list[ExpectedError] = []
        limits = self.limits
        if n_tokens > limits.max_batch_tokens:
            why = f"{n_tokens} rows > max_batch_tokens {limits.max_batch_tokens}"
            errors += [
                ExpectedError("invalid_request", why),
                ExpectedError("resource_exhausted", why),
            ]
        new_length = start_pos + n_tokens
        if new_length > limits.max_context:
            errors.append(
                ExpectedError("resource_exhausted", f"positions up to {new_length} > max_context")
            )
        current = self.sessions.get(session_id)
        is_new = current is None
        if current is not None:
            if epoch < current.epoch:
                errors.append(
                    ExpectedError("stale_epoch", f"epoch {epoch} < current {current.epoch}")
                )
                return Refusal(tuple(errors))
            length = current.length if epoch == current.epoch else 0
            if start_pos > length:
                errors.append(
                    ExpectedError(
                        "cache_miss",
                        f"prefill at {start_pos} leaves a gap after {length} positions"
                        + (" (a newer epoch starts empty)" if epoch > current.epoch else ""),
                        committed_length=length,
                    )
                )
            extra = new_length - current.length
        else:
            fenced = self._fenced(session_id, epoch)
            if fenced is not None:
                errors.append(fenced)
                return Refusal(tuple(errors))
            if start_pos > 0:
                errors.append(self._missing(session_id, epoch, f"prefill at {start_pos}"))
            extra = new_length
        budget = self._budget(session_id, is_new=is_new, extra_tokens=extra)
        if isinstance(budget, ExpectedError):
            # The order of admission checks is the engine's: a gap that also overflows the
            # budget may be refused either way.
            return Refusal((*errors, budget))
        if errors:
            return Refusal(tuple(errors))
        return Admission(session_id, epoch, start_pos, new_length, budget)

    def plan_decode(
        self,
        session_id: str,
        epoch: int,
        pos: int,
        protected: frozenset[str] = frozenset(),
    ) -> Admission | Refusal:
        """What ``decode(epoch, pos, one row)`` must do (inputs valid)."""
        current = self.sessions.get(session_id)
        if current is None:
            fenced = self._fenced(session_id, epoch)
            return Refusal((fenced or self._missing(session_id, epoch, "decode"),))
        if epoch < current.epoch:
            return Refusal(
                (ExpectedError("stale_epoch", f"epoch {epoch} < current {current.epoch}"),)
            )
        if epoch > current.epoch:
            return Refusal(
                (
                    ExpectedError(
                        "cache_miss",
                        f"epoch {epoch} was never prefilled (current {current.epoch})",
                        committed_length=0,
                    ),
                )
            )
        if pos != current.length:
            return Refusal(
                (
                    ExpectedError(
                        "cache_miss",
                        f"decode at {pos}, {current.length} positions cached",
                        committed_length=current.length,
                    ),
                )
            )
        if pos + 1 > self.limits.max_context:
            return Refusal((ExpectedError("resource_exhausted", "decode past max_context"),))
        budget = self._budget(session_id, is_new=False, extra_tokens=1, protected=protected)
        if isinstance(budget, ExpectedError):
            return Refusal((budget,))
        return Admission(session_id, epoch, pos, pos + 1, budget)

    # ----------------------------------------------------------------- effects

    def commit(self, admission: Admission) -> None:
        """Apply an admitted operation that succeeded."""
        for victim in admission.evict:
            state = self.sessions.pop(victim)
            self.evicted[victim] = max(state.epoch, self.evicted.get(victim, state.epoch))
            self.counters.evictions += 1
        self._clock += 1
        current = self.sessions.get(admission.session_id)
        if current is None:
            self.sessions[admission.session_id] = ModelSession(
                epoch=admission.epoch, length=admission.new_length, last_used=self._clock
            )
            # A new session supersedes what was remembered of its older incarnation.
            self.released.pop(admission.session_id, None)
            self.evicted.pop(admission.session_id, None)
        else:
            current.epoch = admission.epoch
            current.length = admission.new_length
            current.last_used = self._clock

    def release(self, session_id: str, epoch: int) -> bool | Refusal:
        """``release(epoch)``: True (freed), False (nothing to free) or the StaleEpoch it
        must raise. Applies the effect."""
        current = self.sessions.get(session_id)
        if current is None:
            fence = self.fence(session_id)
            if fence is not None and epoch < fence:
                return Refusal(
                    (ExpectedError("stale_epoch", f"release of {epoch} < fenced {fence}"),)
                )
            return False
        if epoch < current.epoch:
            return Refusal(
                (ExpectedError("stale_epoch", f"release of {epoch} < current {current.epoch}"),)
            )
        del self.sessions[session_id]
        self.released[session_id] = max(epoch, self.released.get(session_id, epoch))
        self.counters.releases += 1
        return True
