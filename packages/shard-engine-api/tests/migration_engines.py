"""Engines that get session migration wrong, each in one realistic way, for the migration
standard tests (shard_engine_api.conformance._migration). All build on the conformance
reference engine, which moves sessions correctly; ``MIGRATION_BROKEN`` says which migration
tests each must fail."""

from __future__ import annotations

import dataclasses
import threading
from typing import Final

import msgspec
from conformance_engines import Broken, ReferenceEngine

from shard_engine_api import (
    CancelRequest,
    CancelResult,
    ExportSessionRequest,
    ImportSessionRequest,
    ImportSessionResult,
    Metrics,
    SessionSnapshot,
)
from shard_engine_api._checksum import payload_checksum
from shard_engine_api._ledger import ImportAdmission, LedgerLimits, SessionLedger
from shard_engine_api._metrics import Counters
from shard_engine_api._scheduler import QueueStats

__all__ = ["MIGRATION_BROKEN"]


class ExportMutates(ReferenceEngine):
    """Export reads the state, then clobbers the session's last cached position (an export
    that reuses the slot's buffer as scratch space)."""

    def _export_state(self, slot: int, length: int) -> bytes:
        state = super()._export_state(slot, length)
        self._slot_sums(slot)[:, length - 1] = 0.0
        return state


class ExportCountsAsUse(ReferenceEngine):
    """Export refreshes the session's LRU position, so a session being drained away is kept
    and a busy one is evicted instead."""

    def export_session(self, request: ExportSessionRequest) -> SessionSnapshot:
        snapshot = super().export_session(request)
        with self._state_lock:
            ledger = self._ledger
            ledger._tick += 1
            ledger.sessions[request.session.session_id].last_used = ledger._tick
        return snapshot


class _NoFenceLedger(SessionLedger):
    def admit_import(
        self, session_id: str, epoch: int, length: int, limits: LedgerLimits
    ) -> ImportAdmission:
        # Forget the live epoch and the tombstones before deciding.
        live = self.sessions.get(session_id)
        fences = self.fences
        self.fences = type(fences)(fences.generation_size)
        saved_epoch = None
        if live is not None:
            saved_epoch, live.epoch = live.epoch, -1
        try:
            return super().admit_import(session_id, epoch, length, limits)
        finally:
            self.fences = fences
            if live is not None and saved_epoch is not None:
                live.epoch = saved_epoch


class ImportIgnoresFences(ReferenceEngine):
    """Import installs whatever epoch the snapshot carries: over a newer live epoch, over a
    released one."""

    ledger_type = _NoFenceLedger


class _EqualEpochLedger(SessionLedger):
    def admit_import(
        self, session_id: str, epoch: int, length: int, limits: LedgerLimits
    ) -> ImportAdmission:
        live = self.sessions.get(session_id)
        if live is not None and live.epoch == epoch:
            live.epoch -= 1  # "not older" taken for "newer"
            try:
                return super().admit_import(session_id, epoch, length, limits)
            finally:
                live.epoch += 1
        return super().admit_import(session_id, epoch, length, limits)


class ImportReplacesEqualEpoch(ReferenceEngine):
    """An import at the live session's own epoch replaces it (two holders of one fencing
    token can then overwrite each other's state)."""

    ledger_type = _EqualEpochLedger


class _EagerLedger(SessionLedger):
    def __init__(self, fence_generation: int) -> None:
        super().__init__(fence_generation)
        self._applied: set[int] = set()

    def admit_import(
        self, session_id: str, epoch: int, length: int, limits: LedgerLimits
    ) -> ImportAdmission:
        admission = super().admit_import(session_id, epoch, length, limits)
        super().commit_import(admission)  # committed before the backend ran
        self._applied.add(id(admission))
        return admission

    def commit_import(self, admission: ImportAdmission) -> tuple[int, ...]:
        if id(admission) in self._applied:
            self._applied.discard(id(admission))
            return ()
        return super().commit_import(admission)


class ImportCommitsFirst(ReferenceEngine):
    """The ledger takes the imported session (and its evictions) before the backend has
    installed the state: a failed or cancelled import leaves a session without state."""

    ledger_type = _EagerLedger


class ChecksumNotVerified(ReferenceEngine):
    """Import trusts the bytes it got: it recomputes the checksum and size over them instead
    of comparing with the snapshot's."""

    def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        snapshot = request.snapshot
        state = b"".join(snapshot.chunks)
        trusted = msgspec.structs.replace(
            snapshot, checksum=payload_checksum(state), state_bytes=len(state)
        )
        return super().import_session(msgspec.structs.replace(request, snapshot=trusted))


class SettingsNotCompared(ReferenceEngine):
    """Import compares engine, model and range but not the settings fingerprint (a context
    size or cache type that changes results is accepted)."""

    def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        target = self._snapshot_target
        assert target is not None
        snapshot = msgspec.structs.replace(
            request.snapshot, settings_fingerprint=target.settings_fingerprint
        )
        return super().import_session(msgspec.structs.replace(request, snapshot=snapshot))


class IgnoresRequestedEpoch(ReferenceEngine):
    """Import installs the snapshot under the epoch it was exported with, ignoring the newer
    epoch the mover asked for (so the exporter's stragglers are not fenced)."""

    def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        return super().import_session(msgspec.structs.replace(request, epoch=None))


class _ShortLedger(SessionLedger):
    def commit_import(self, admission: ImportAdmission) -> tuple[int, ...]:
        return super().commit_import(dataclasses.replace(admission, length=admission.length - 1))


class ImportLengthOffByOne(ReferenceEngine):
    """An imported session is committed one position short (length taken as the index of
    the last position)."""

    ledger_type = _ShortLedger


class _EvictingLedger(SessionLedger):
    def admit_import(
        self, session_id: str, epoch: int, length: int, limits: LedgerLimits
    ) -> ImportAdmission:
        admission = super().admit_import(session_id, epoch, length, limits)
        for victim in admission.evict:
            self._evict(victim)
        return dataclasses.replace(admission, evict=())


class EvictsBeforeCommit(ReferenceEngine):
    """Import evicts its LRU victims when it is admitted, so an import that then fails has
    evicted them for nothing."""

    ledger_type = _EvictingLedger


class _UnboundedLedger(SessionLedger):
    def admit_import(
        self, session_id: str, epoch: int, length: int, limits: LedgerLimits
    ) -> ImportAdmission:
        roomy = LedgerLimits(
            max_sessions=limits.max_sessions,
            max_context=limits.max_context,
            kv_budget=1 << 40,
            evict_lru=limits.evict_lru,
            spare_slot=limits.spare_slot,
        )
        return super().admit_import(session_id, epoch, length, roomy)


class ImportIgnoresBudget(ReferenceEngine):
    """Import does not count the snapshot's positions against the KV budget."""

    ledger_type = _UnboundedLedger


class _LongContextLedger(SessionLedger):
    def admit_import(
        self, session_id: str, epoch: int, length: int, limits: LedgerLimits
    ) -> ImportAdmission:
        wide = LedgerLimits(
            max_sessions=limits.max_sessions,
            max_context=1 << 30,
            kv_budget=limits.kv_budget,
            evict_lru=limits.evict_lru,
            spare_slot=limits.spare_slot,
        )
        return super().admit_import(session_id, epoch, length, wide)


class ImportIgnoresContext(ReferenceEngine):
    """Import does not check the snapshot's length against max_context (the backend is then
    handed more positions than a slot holds)."""

    ledger_type = _LongContextLedger


class CancelClaimsImports(ReferenceEngine):
    """``cancel`` answers cancelled=True for an in-flight import without stopping it, which
    then commits: the caller was told nothing happened."""

    def __init__(self) -> None:
        super().__init__()
        self._imports: dict[str, str] = {}
        self._imports_lock = threading.Lock()

    def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        with self._imports_lock:
            self._imports[request.request_id] = request.snapshot.session.session_id
        try:
            return super().import_session(request)
        finally:
            with self._imports_lock:
                self._imports.pop(request.request_id, None)

    def cancel(self, request: CancelRequest) -> CancelResult:
        with self._imports_lock:
            claimed = request.request_id in self._imports or (
                request.session_id in self._imports.values()
            )
        if claimed:
            return CancelResult(cancelled=True, n_requests=1)
        return super().cancel(request)


class _UncountedCounters(Counters):
    def snapshot(
        self,
        *,
        sessions_active: int,
        tombstones: int,
        fences_dropped: int,
        kv_used_tokens: int,
        queue: QueueStats,
    ) -> Metrics:
        metrics = super().snapshot(
            sessions_active=sessions_active,
            tombstones=tombstones,
            fences_dropped=fences_dropped,
            kv_used_tokens=kv_used_tokens,
            queue=queue,
        )
        return msgspec.structs.replace(metrics, exports=0, imports=0)


class MigrationNotCounted(ReferenceEngine):
    """Exports and imports never reach the metrics."""

    counters_type = _UncountedCounters


class _LeakyReplaceLedger(SessionLedger):
    def commit_import(self, admission: ImportAdmission) -> tuple[int, ...]:
        replaced = self.sessions.get(admission.session_id)
        length = replaced.length if replaced is not None else 0
        dropped = super().commit_import(admission)
        self.kv_used += length  # the replaced epoch's positions are never given back
        return dropped


class ReplacedEpochLeaksKv(ReferenceEngine):
    """Replacing an older live epoch frees its slot but keeps counting its positions against
    the KV budget."""

    ledger_type = _LeakyReplaceLedger


_CANCEL: Final = "test_migration_cancelled_import_and_export"

MIGRATION_BROKEN: Final[dict[str, Broken]] = {
    # Each entry: the migration tests the engine must fail (the others must pass), and those it
    # may fail (their outcome depends on thread timing).
    "export_mutates": Broken(ExportMutates, ("test_migration_source_unchanged",)),
    "export_counts_as_use": Broken(ExportCountsAsUse, ("test_migration_source_unchanged",)),
    "import_ignores_fences": Broken(
        ImportIgnoresFences,
        ("test_migration_epoch_fencing", "test_migration_metrics_and_health"),
    ),
    "import_replaces_equal_epoch": Broken(
        ImportReplacesEqualEpoch,
        ("test_migration_epoch_fencing", "test_migration_metrics_and_health"),
    ),
    "import_commits_first": Broken(
        ImportCommitsFirst,
        (
            "test_migration_atomic_under_budget_pressure",
            "test_migration_corrupted_or_truncated_snapshot",
            "test_migration_failed_import_is_atomic",
        ),
    ),
    "checksum_not_verified": Broken(
        ChecksumNotVerified, ("test_migration_corrupted_or_truncated_snapshot",)
    ),
    "settings_not_compared": Broken(SettingsNotCompared, ("test_migration_mismatched_snapshot",)),
    "ignores_requested_epoch": Broken(
        IgnoresRequestedEpoch,
        ("test_migration_continues_exactly_every_role", "test_migration_epoch_fencing"),
    ),
    "import_length_off_by_one": Broken(
        ImportLengthOffByOne,
        (
            "test_migration_atomic_under_budget_pressure",
            "test_migration_continues_exactly_every_role",
            "test_migration_epoch_fencing",
            "test_migration_metrics_and_health",
        ),
        may_fail=(_CANCEL,),
    ),
    "evicts_before_commit": Broken(
        EvictsBeforeCommit, ("test_migration_atomic_under_budget_pressure",)
    ),
    "import_ignores_budget": Broken(
        ImportIgnoresBudget, ("test_migration_atomic_under_budget_pressure",)
    ),
    "import_ignores_context": Broken(
        ImportIgnoresContext, ("test_migration_atomic_under_budget_pressure",)
    ),
    "cancel_claims_imports": Broken(CancelClaimsImports, (_CANCEL,)),
    "migration_not_counted": Broken(MigrationNotCounted, ("test_migration_metrics_and_health",)),
    "replaced_epoch_leaks_kv": Broken(ReplacedEpochLeaksKv, ("test_migration_epoch_fencing",)),
}
