"""Broken engines whose bug shows only on paths small, regular cases do not take: evicted
sessions exported or imported over, bf16 rounding, request ids reused and releases arriving
while a request runs, ``retryable`` at version edges, reserved values inside bundles, session
ids past the length limit, timings of batches and imports, loads after refusals, refused
first requests of a newer epoch. Each violates one rule of the contract and passed every
standard test before ``conformance/_scale.py``; test_conformance_scale_mutants runs the suite
on each and checks which tests catch it."""

from __future__ import annotations

import dataclasses
import threading
from typing import Final

import msgspec
import numpy as np
from conformance_engines import Array, Broken, ReferenceEngine, _RewritesBundles

from shard_engine_api import (
    BoundaryBundle,
    CacheMiss,
    CancelRequest,
    CancelResult,
    Capabilities,
    ContractVersionMismatch,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    ExportSessionRequest,
    ImportSessionRequest,
    InvalidRequest,
    LoadConfig,
    NotReady,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    ResourceExhausted,
    SessionRef,
    SessionSnapshot,
    ShardEngineError,
    ShardResult,
    StaleEpoch,
    Timings,
)
from shard_engine_api._ledger import ImportAdmission, LedgerLimits, SessionLedger
from shard_engine_api._types import CONTRACT_VERSION, AuxState, ImportSessionResult
from shard_engine_api.engine import CancelToken, ForwardItem, ModelInfo, OutputMode

__all__ = ["SCALE_MUTANTS"]

replace = msgspec.structs.replace


# --------------------------------------------------------------------- eviction


class ExportOfEvictedSaysUnknown(ReferenceEngine):
    """Exports look sessions up among live ones only: an evicted session is reported as an
    unknown one (CacheMiss reason "unknown_session")."""

    def export_session(self, request: ExportSessionRequest) -> SessionSnapshot:
        try:
            return super().export_session(request)
        except CacheMiss as miss:
            if miss.reason != "evicted":
                raise
            raise CacheMiss(
                f"session {request.session.session_id!r} is unknown",
                committed_length=0,
                reason="unknown_session",
            ) from None


class _BatchEvictionUnfenced(SessionLedger):
    """Sessions evicted to admit a batch leave no fence (their slot is simply reused)."""

    def __init__(self, fence_generation: int) -> None:
        super().__init__(fence_generation)
        self.batching = False

    def admit_batch(self, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        self.batching = True
        return super().admit_batch(*args, **kwargs)  # type: ignore[arg-type]

    def commit(self, admissions):  # type: ignore[no-untyped-def]
        try:
            return super().commit(admissions)
        finally:
            self.batching = False

    def _evict(self, session_id: str) -> int:
        if not self.batching:
            return super()._evict(session_id)
        victim = self.sessions.pop(session_id)
        self.kv_used -= victim.length
        self._free_slots.append(victim.slot)
        return victim.slot


class BatchEvictionLeavesNoFence(ReferenceEngine):
    """Evicts idle sessions for a batch without fencing them: the evicted session reads as
    unknown, and older epochs of it are admitted again."""

    ledger_type = _BatchEvictionUnfenced


class _ImportSkipsEvictionFence(SessionLedger):
    def admit_import(
        self, session_id: str, epoch: int, length: int, limits: LedgerLimits
    ) -> ImportAdmission:
        fence = self.fences.get(session_id)
        if (
            fence is not None
            and not fence.released
            and session_id not in self.sessions
            and epoch < fence.epoch
        ):
            admission = super().admit_import(session_id, fence.epoch, length, limits)
            return dataclasses.replace(admission, epoch=epoch)
        return super().admit_import(session_id, epoch, length, limits)


class ImportIgnoresEvictionFence(ReferenceEngine):
    """Import checks release tombstones only: a snapshot older than an evicted epoch is
    installed."""

    ledger_type = _ImportSkipsEvictionFence


class ImportRefusesTheEvictedEpoch(ReferenceEngine):
    """Treats an eviction fence as a tombstone on import: a snapshot imported under the
    evicted epoch itself is StaleEpoch (the contract installs it)."""

    def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        epoch = request.snapshot.session.epoch if request.epoch is None else request.epoch
        fence = self._ledger.fences.get(request.snapshot.session.session_id)
        if fence is not None and not fence.released and epoch == fence.epoch:
            raise StaleEpoch(f"epoch {epoch} was evicted")
        return super().import_session(request)


# --------------------------------------------------------------------- values


def _truncated_to_bf16(rows: Array) -> Array:
    bits = np.ascontiguousarray(rows, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


class _Bf16Truncates(ReferenceEngine):
    def _truncates(self, item: ForwardItem) -> bool:
        return False

    def _open(self, config: LoadConfig) -> ModelInfo:
        info = super()._open(config)
        return replace(info, boundary_dtypes=("f32", "f16", "bf16"))

    def _forward(self, item: ForwardItem, output: OutputMode, token: CancelToken) -> Array:
        rows = super()._forward(item, output, token)
        if output == "hidden" and self.config.boundary_dtype == "bf16" and self._truncates(item):
            return _truncated_to_bf16(rows)
        return rows


class Bf16DecodeRowsTruncated(_Bf16Truncates):
    """Converts single decode rows to bf16 by dropping the low 16 bits (rounding toward
    zero); prefill rows are rounded to nearest-even."""

    def _truncates(self, item: ForwardItem) -> bool:
        return item.n_tokens == 1


class Bf16PrefillRowsTruncated(_Bf16Truncates):
    """Converts the rows of a multi-row prefill to bf16 by dropping the low 16 bits."""

    def _truncates(self, item: ForwardItem) -> bool:
        return item.n_tokens > 1


def _meaningless_mtp(bundle: BoundaryBundle) -> bool:
    return bool(bundle.mtp) and not any(m.n_draft_tokens or m.payload for m in bundle.mtp)


class EmptyBundleMtpAcceptedOnDecode(_RewritesBundles):
    """On (batched) decode, drops a bundle's ``mtp`` entries that hold nothing before the
    reserved-field check."""

    def _patched(
        self, bundle: BoundaryBundle, caps: Capabilities, single_row: bool
    ) -> BoundaryBundle:
        if single_row and _meaningless_mtp(bundle):
            return replace(bundle, mtp=())
        return bundle


class EmptyBundleAuxAcceptedOnDecode(_RewritesBundles):
    """On (batched) decode, drops a bundle's nameless, empty ``aux`` entries."""

    def _patched(
        self, bundle: BoundaryBundle, caps: Capabilities, single_row: bool
    ) -> BoundaryBundle:
        empty = AuxState(name="")
        if single_row and bundle.aux and all(entry == empty for entry in bundle.aux):
            return replace(bundle, aux=())
        return bundle


def _older_bundle(request: PrefillRequest | DecodeRequest) -> bool:
    inputs = request.inputs
    return isinstance(inputs, BoundaryBundle) and inputs.contract_version < CONTRACT_VERSION


class OlderContractRetryable(ReferenceEngine):
    """Marks ContractVersionMismatch retryable for bundles of an older contract version (the
    sender "may upgrade and retry")."""

    def prefill(self, request: PrefillRequest) -> ShardResult:
        try:
            return super().prefill(request)
        except ContractVersionMismatch as error:
            if not _older_bundle(request):
                raise
            raise ContractVersionMismatch(error.message, retryable=True) from None

    def decode(self, request: DecodeRequest) -> ShardResult:
        try:
            return super().decode(request)
        except ContractVersionMismatch as error:
            if not _older_bundle(request):
                raise
            raise ContractVersionMismatch(error.message, retryable=True) from None


class ImportBudgetNotRetryable(ReferenceEngine):
    """Refuses an import over the KV budget as not retryable."""

    def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        try:
            return super().import_session(request)
        except ResourceExhausted as error:
            if error.details.get("resource") != "kv":
                raise
            raise ResourceExhausted(
                error.message, retryable=False, details=dict(error.details)
            ) from None


def _cut(session: SessionRef) -> SessionRef:
    if len(session.session_id) <= 256:
        return session
    return SessionRef(session_id=session.session_id[:256], epoch=session.epoch)


class OverlongIdsCutOnPrefill(ReferenceEngine):
    """Cuts a session id past 256 characters to its first 256 on prefill and decode (a
    fixed-size id field) instead of refusing it."""

    def prefill(self, request: PrefillRequest) -> ShardResult:
        return super().prefill(replace(request, session=_cut(request.session)))

    def decode(self, request: DecodeRequest) -> ShardResult:
        return super().decode(replace(request, session=_cut(request.session)))


class OverlongIdsCutOnRelease(ReferenceEngine):
    """Cuts a session id past 256 characters to its first 256 on release."""

    def release(self, request: ReleaseRequest) -> ReleaseResult:
        return super().release(replace(request, session=_cut(request.session)))


# --------------------------------------------------------------------- in flight


class _OrphansReusedIds(ReferenceEngine):
    """Refuses a request reusing the id of an in-flight prefill, but the refusal drops the
    first request's registration: a cancel by that id no longer reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self._prefilling: set[str] = set()
        self._orphaned: set[str] = set()
        self._ids_lock = threading.Lock()

    def _prefill(self, request: PrefillRequest) -> ShardResult:
        with self._ids_lock:
            mine = request.request_id not in self._prefilling
            self._prefilling.add(request.request_id)
        try:
            return super().prefill(request)
        finally:
            if mine:
                with self._ids_lock:
                    self._prefilling.discard(request.request_id)

    def prefill(self, request: PrefillRequest) -> ShardResult:
        return self._prefill(request)

    def _refuse_reused(self, *request_ids: str) -> None:
        with self._ids_lock:
            reused = [rid for rid in request_ids if rid in self._prefilling]
            self._orphaned.update(reused)
        if reused:
            raise InvalidRequest(f"request_id {reused[0]!r} is already in flight")

    def cancel(self, request: CancelRequest) -> CancelResult:
        if request.request_id is not None and request.request_id in self._orphaned:
            return CancelResult(cancelled=False, n_requests=0)
        return super().cancel(request)


class ReusedIdByAPrefillLosesTheFirst(_OrphansReusedIds):
    """A prefill reusing the id of an in-flight prefill is refused and orphans the first."""

    def prefill(self, request: PrefillRequest) -> ShardResult:
        self._refuse_reused(request.request_id)
        return self._prefill(request)


class ReusedIdByABatchLosesTheFirst(_OrphansReusedIds):
    """A batch (its own id or an item's) reusing the id of an in-flight prefill is refused
    and orphans the first."""

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        self._refuse_reused(request.request_id, *(item.request_id for item in request.items))
        return super().decode_batch(request)


class ReleaseIgnoresRunningDecodes(ReferenceEngine):
    """A release arriving while a decode of the session runs answers released=True at once
    and leaves the session to the decode, which commits it again."""

    def __init__(self) -> None:
        super().__init__()
        self._decoding: set[str] = set()
        self._decoding_lock = threading.Lock()

    def decode(self, request: DecodeRequest) -> ShardResult:
        with self._decoding_lock:
            self._decoding.add(request.session.session_id)
        try:
            return super().decode(request)
        finally:
            with self._decoding_lock:
                self._decoding.discard(request.session.session_id)

    def release(self, request: ReleaseRequest) -> ReleaseResult:
        with self._decoding_lock:
            running = request.session.session_id in self._decoding
        if running:
            return ReleaseResult(released=True, detail="released")
        return super().release(request)


# --------------------------------------------------------------------- time and load


class BatchItemsReportTheBatchSum(ReferenceEngine):
    """Gives every item of a batch the batch's timings multiplied by its item count (the
    forward "per item", summed)."""

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        result = super().decode_batch(request)
        n = len(result.items)
        items = []
        for item in result.items:
            timings = getattr(item, "timings", None)
            if timings is None:
                items.append(item)
                continue
            summed = replace(
                timings, compute_ms=timings.compute_ms * n, total_ms=timings.total_ms * n
            )
            items.append(replace(item, timings=summed))
        return replace(result, items=tuple(items))


class ImportReportsThePreviousCall(ReferenceEngine):
    """Reports in an import's result the timings of the call before it (a timer that an
    import does not restart)."""

    def __init__(self) -> None:
        super().__init__()
        self._last: Timings | None = None

    def prefill(self, request: PrefillRequest) -> ShardResult:
        result = super().prefill(request)
        self._last = result.timings
        return result

    def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        result = super().import_session(request)
        if self._last is None:
            return result
        return replace(result, timings=self._last)


class LayerCountRefusalSticks(ReferenceEngine):
    """After a load refused for a layer count the model does not have, it stays "loading":
    every later load is refused (a refused model file is handled)."""

    def __init__(self) -> None:
        super().__init__()
        self._stuck = False

    def load(self, config: LoadConfig) -> Capabilities:
        if self._stuck:
            raise NotReady("the engine is still loading")
        try:
            return super().load(config)
        except ShardEngineError as error:
            if "layers" in error.message:
                self._stuck = True
            raise


class RefusedLoadKeepsItsLimits(ReferenceEngine):
    """Keeps the max_context of a refused load and applies it to the next load."""

    def __init__(self) -> None:
        super().__init__()
        self._kept: int | None = None

    def load(self, config: LoadConfig) -> Capabilities:
        applied = config if self._kept is None else replace(config, max_context=self._kept)
        try:
            return super().load(applied)
        except ShardEngineError:
            self._kept = config.max_context
            raise


def _live_epoch(engine: ReferenceEngine, session_id: str) -> int | None:
    with engine._state_lock:
        entry = engine._ledger.sessions.get(session_id)
        return None if entry is None else entry.epoch


def _drop_older(engine: ReferenceEngine, session: SessionRef) -> None:
    live = _live_epoch(engine, session.session_id)
    if live is not None and live < session.epoch:
        ReferenceEngine.release(engine, ReleaseRequest(session=replace(session, epoch=live)))


class NewerEpochGapDropsTheOld(ReferenceEngine):
    """A newer epoch's prefill that starts past 0 drops the older epoch before it is refused
    for the gap."""

    def prefill(self, request: PrefillRequest) -> ShardResult:
        if request.start_pos > 0:
            _drop_older(self, request.session)
        return super().prefill(request)


class NewerEpochDecodeDropsTheOld(ReferenceEngine):
    """A decode at a newer epoch drops the older epoch before it misses."""

    def decode(self, request: DecodeRequest) -> ShardResult:
        _drop_older(self, request.session)
        return super().decode(request)


SCALE_MUTANTS: Final[dict[str, Broken]] = {
    "export_of_evicted_says_unknown": Broken(
        ExportOfEvictedSaysUnknown, ("test_export_of_an_evicted_session",)
    ),
    "batch_eviction_leaves_no_fence": Broken(
        BatchEvictionLeavesNoFence,
        (
            "test_export_of_an_evicted_session",
            "test_import_over_an_eviction_fence_and_a_tombstone",
        ),
    ),
    "import_ignores_eviction_fence": Broken(
        ImportIgnoresEvictionFence, ("test_import_over_an_eviction_fence_and_a_tombstone",)
    ),
    "import_refuses_the_evicted_epoch": Broken(
        ImportRefusesTheEvictedEpoch, ("test_import_over_an_eviction_fence_and_a_tombstone",)
    ),
    "bf16_decode_rows_truncated": Broken(
        Bf16DecodeRowsTruncated, ("test_narrow_rows_round_the_f32_rows_to_nearest_even",)
    ),
    "bf16_prefill_rows_truncated": Broken(
        Bf16PrefillRowsTruncated, ("test_narrow_rows_round_the_f32_rows_to_nearest_even",)
    ),
    "empty_bundle_mtp_accepted_on_decode": Broken(
        EmptyBundleMtpAcceptedOnDecode, ("test_empty_reserved_values_inside_bundles_refused",)
    ),
    "empty_bundle_aux_accepted_on_decode": Broken(
        EmptyBundleAuxAcceptedOnDecode, ("test_empty_reserved_values_inside_bundles_refused",)
    ),
    "older_contract_retryable": Broken(
        OlderContractRetryable, ("test_retryable_at_every_contract_version_and_path",)
    ),
    "import_budget_not_retryable": Broken(
        ImportBudgetNotRetryable, ("test_retryable_at_every_contract_version_and_path",)
    ),
    "overlong_ids_cut_on_prefill": Broken(
        OverlongIdsCutOnPrefill, ("test_session_ids_at_and_past_the_length_limit",)
    ),
    "overlong_ids_cut_on_release": Broken(
        OverlongIdsCutOnRelease, ("test_session_ids_at_and_past_the_length_limit",)
    ),
    "reused_id_by_a_prefill_loses_the_first": Broken(
        ReusedIdByAPrefillLosesTheFirst, ("test_request_id_reused_in_flight_on_every_path",)
    ),
    "reused_id_by_a_batch_loses_the_first": Broken(
        ReusedIdByABatchLosesTheFirst, ("test_request_id_reused_in_flight_on_every_path",)
    ),
    "release_ignores_running_decodes": Broken(
        ReleaseIgnoresRunningDecodes, ("test_release_while_a_decode_runs_keeps_the_others",)
    ),
    "batch_items_report_the_batch_sum": Broken(
        BatchItemsReportTheBatchSum,
        ("test_timings_of_batches_and_imports_against_the_wall_clock",),
    ),
    "import_reports_the_previous_call": Broken(
        ImportReportsThePreviousCall,
        ("test_timings_of_batches_and_imports_against_the_wall_clock",),
    ),
    "layer_count_refusal_sticks": Broken(
        LayerCountRefusalSticks, ("test_loads_after_refused_loads_of_every_kind",)
    ),
    "refused_load_keeps_its_limits": Broken(
        RefusedLoadKeepsItsLimits, ("test_loads_after_refused_loads_of_every_kind",)
    ),
    "newer_epoch_gap_drops_the_old": Broken(
        NewerEpochGapDropsTheOld, ("test_newer_epoch_refused_on_every_path_keeps_the_older",)
    ),
    "newer_epoch_decode_drops_the_old": Broken(
        NewerEpochDecodeDropsTheOld, ("test_newer_epoch_refused_on_every_path_keeps_the_older",)
    ),
}
"""Each broken engine and the standard tests pinned to catch it."""
