"""Engines a mutation probe of the conformance suite found it let through, each violating one
rule of the contract while looking right everywhere else; copies of the probe's FakeEngine
subclasses on the reference engine of ``conformance_engines``. test_conformance_mutants runs
the suite on each and checks that it is caught (and by which tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, TypeVar

import msgspec
from conformance_engines import Broken, ReferenceEngine

from shard_engine_api import (
    CacheMiss,
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    ExportSessionRequest,
    Health,
    LoadConfig,
    Metrics,
    NotReady,
    PrefillRequest,
    SessionSnapshot,
    ShardResult,
    StaleEpoch,
)
from shard_engine_api.conformance._migration import MIGRATION_TESTS
from shard_engine_api.engine import ModelInfo

__all__ = ["MUTANTS"]

_T = TypeVar("_T")
replace = msgspec.structs.replace


class TimingsTotalZero(ReferenceEngine):
    """``timings.total_ms`` is 0 while ``compute_ms`` is not: the whole call looks shorter
    than its part."""

    @staticmethod
    def _rewritten(result: ShardResult) -> ShardResult:
        timings = replace(
            result.timings, total_ms=0.0, compute_ms=max(result.timings.compute_ms, 0.5)
        )
        return replace(result, timings=timings)

    def prefill(self, request: PrefillRequest) -> ShardResult:
        return self._rewritten(super().prefill(request))

    def decode(self, request: DecodeRequest) -> ShardResult:
        return self._rewritten(super().decode(request))


class CancelClaimsDecodes(ReferenceEngine):
    """``cancel`` of a running single decode answers cancelled=True without stopping it: the
    decode commits and returns its result."""

    def __init__(self) -> None:
        super().__init__()
        self._decoding: set[str] = set()

    def decode(self, request: DecodeRequest) -> ShardResult:
        self._decoding.add(request.request_id)
        try:
            return super().decode(request)
        finally:
            self._decoding.discard(request.request_id)

    def cancel(self, request: CancelRequest) -> CancelResult:
        if request.request_id in self._decoding:
            return CancelResult(cancelled=True, n_requests=1)
        return super().cancel(request)


class CancelCountAlwaysOne(ReferenceEngine):
    """``CancelResult.n_requests`` is 1 whenever anything was cancelled, though a cancel by
    session stopped several requests."""

    def cancel(self, request: CancelRequest) -> CancelResult:
        result = super().cancel(request)
        return replace(result, n_requests=1) if result.cancelled else result


class CapabilitiesAfterClose(ReferenceEngine):
    """``capabilities()`` after ``close()`` still answers with the loaded capabilities."""

    def __init__(self) -> None:
        super().__init__()
        self._loaded: Capabilities | None = None

    def load(self, config: LoadConfig) -> Capabilities:
        self._loaded = super().load(config)
        return self._loaded

    def capabilities(self) -> Capabilities:
        try:
            return super().capabilities()
        except NotReady:
            if self._loaded is None:
                raise
            return self._loaded


class HealthInFlightZero(ReferenceEngine):
    """``health().in_flight`` is always 0 (cancel works)."""

    def health(self) -> Health:
        return replace(super().health(), in_flight=0)


class InFlightZeroCancelIsNoop(ReferenceEngine):
    """Two bugs that hide each other: ``health().in_flight`` is always 0, and ``cancel`` of a
    running prefill or batch answers cancelled=True but never stops it."""

    def __init__(self) -> None:
        super().__init__()
        self._running: set[str] = set()

    def health(self) -> Health:
        return replace(super().health(), in_flight=0)

    def _tracked(self, request_id: str, call: Callable[[], _T]) -> _T:
        self._running.add(request_id)
        try:
            return call()
        finally:
            self._running.discard(request_id)

    def prefill(self, request: PrefillRequest) -> ShardResult:
        return self._tracked(request.request_id, lambda: ReferenceEngine.prefill(self, request))

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        return self._tracked(
            request.request_id, lambda: ReferenceEngine.decode_batch(self, request)
        )

    def cancel(self, request: CancelRequest) -> CancelResult:
        if request.request_id in self._running:
            return CancelResult(cancelled=True, n_requests=1)
        return super().cancel(request)


class MetricsComputeMsZero(ReferenceEngine):
    """``metrics().compute_ms`` never grows."""

    def metrics(self) -> Metrics:
        return replace(super().metrics(), compute_ms=0.0)


class ExportChunksUneven(ReferenceEngine):
    """Snapshots cut the state into two halves (every chunk but the last must hold exactly
    SNAPSHOT_CHUNK_BYTES); the checksum and ``state_bytes`` stay right."""

    def export_session(self, request: ExportSessionRequest) -> SessionSnapshot:
        snapshot = super().export_session(request)
        state = b"".join(snapshot.chunks)
        if len(state) > 1:
            half = len(state) // 2
            snapshot = replace(snapshot, chunks=(state[:half], state[half:]))
        return snapshot


class ExportReleasedIsCacheMiss(ReferenceEngine):
    """Export of a released (tombstoned) epoch raises CacheMiss "unknown_session" instead of
    StaleEpoch."""

    def export_session(self, request: ExportSessionRequest) -> SessionSnapshot:
        try:
            return super().export_session(request)
        except StaleEpoch as error:
            if request.session.session_id in self._ledger.sessions:
                raise
            raise CacheMiss(error.message, committed_length=0, reason="unknown_session") from None


class NoBatchFlagButBuggyBatch(ReferenceEngine):
    """Declares ``features.batched_decode = False`` (so batch tests used to be skipped), yet
    serves ``decode_batch``, its items in reverse order."""

    def _open(self, config: LoadConfig) -> ModelInfo:
        info = super()._open(config)
        return replace(info, features=replace(info.features, batched_decode=False))

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        batch = super().decode_batch(request)
        return replace(batch, items=tuple(reversed(batch.items)))


class NoTruncateFlagButTruncates(ReferenceEngine):
    """Declares ``features.truncate = False`` yet truncates (no UnsupportedFeature)."""

    def _open(self, config: LoadConfig) -> ModelInfo:
        info = super()._open(config)
        return replace(info, features=replace(info.features, truncate=False))


class CacheMissWireLosesLength(ReferenceEngine):
    """A decode's CacheMiss keeps ``committed_length`` on the object, but its wire form
    (``details``) lacks it: a remote caller sees committed length 0."""

    def decode(self, request: DecodeRequest) -> ShardResult:
        try:
            return super().decode(request)
        except CacheMiss as miss:
            miss.details = {k: v for k, v in miss.details.items() if k != "committed_length"}
            raise


_CANCEL_TESTS: Final = (
    "test_cancel_latency_within_advertised_bound",
    "test_cancel_one_of_queued_requests",
    "test_cancel_one_of_two_in_flight",
    "test_cancel_rolls_back",
    "test_cancel_running_batch",
    "test_cancel_running_decode",
    "test_cancel_session_stops_all_its_requests",
    "test_in_flight_while_running",
    "test_migration_cancelled_import_and_export",
    "test_queued_cancel_heard_at_once",
    "test_refused_first_prefill_of_a_newer_epoch",
    "test_request_id_reused_while_in_flight",
)
"""Every test that lands a cancel (or watches ``in_flight``) on an operation the fixture's
cancellation options slow down: none can while health hides running requests."""

MUTANTS: Final[dict[str, Broken]] = {
    "timings_total_zero": Broken(
        TimingsTotalZero, ("test_result_fields", "test_timings_against_the_wall_clock")
    ),
    "cancel_claims_decodes": Broken(
        CancelClaimsDecodes,
        ("test_cancel_one_of_queued_requests", "test_cancel_running_decode"),
    ),
    "cancel_count_always_one": Broken(
        CancelCountAlwaysOne, ("test_cancel_session_stops_all_its_requests",)
    ),
    "capabilities_after_close": Broken(CapabilitiesAfterClose, ("test_not_ready_after_close",)),
    "health_in_flight_zero": Broken(HealthInFlightZero, _CANCEL_TESTS),
    "in_flight_zero_cancel_is_noop": Broken(InFlightZeroCancelIsNoop, _CANCEL_TESTS),
    "metrics_compute_ms_zero": Broken(MetricsComputeMsZero, ("test_health_metrics_consistent",)),
    # Every migration test checks the chunking of the snapshots it exports, and so do the
    # reach tests that export.
    "export_chunks_uneven": Broken(
        ExportChunksUneven,
        (*MIGRATION_TESTS, "test_long_session_migrates_exactly", "test_retryable_on_every_path"),
    ),
    "export_released_is_cache_miss": Broken(
        ExportReleasedIsCacheMiss, ("test_migration_epoch_fencing",)
    ),
    "no_batch_flag_but_buggy_batch": Broken(
        NoBatchFlagButBuggyBatch,
        (
            "test_batch_at_the_kv_budget",
            "test_batch_error_items_carry_their_fields",
            "test_batch_use_refreshes_lru_order",
            "test_batched_decode_item_errors",
            "test_batched_decode_matches_single",
            "test_batched_decode_metrics",
            "test_batched_decode_order_with_interleaved_errors",
            "test_batched_decode_reserved_fields",
            "test_batched_decode_same_session_twice",
            "test_cancel_running_batch",
            "test_large_shuffled_batches_match_single_decodes",
        ),
    ),
    "no_truncate_flag_but_truncates": Broken(
        NoTruncateFlagButTruncates, ("test_truncate", "test_truncate_at_large_positions")
    ),
    "cache_miss_wire_loses_length": Broken(
        CacheMissWireLosesLength,
        ("test_error_codes_match_taxonomy", "test_wire_round_trip_of_every_returned_object"),
    ),
}
"""Each mutant and the standard tests that must fail on it (exactly those)."""

_ALSO_FAILS_SCALE_TESTS: Final[dict[str, tuple[str, ...]]] = {
    "export_chunks_uneven": (
        "test_import_over_an_eviction_fence_and_a_tombstone",
        "test_retryable_at_every_contract_version_and_path",
        "test_timings_of_batches_and_imports_against_the_wall_clock",
    ),
    "export_released_is_cache_miss": ("test_export_of_an_evicted_session",),
    "health_in_flight_zero": ("test_request_id_reused_in_flight_on_every_path",),
    "in_flight_zero_cancel_is_noop": ("test_request_id_reused_in_flight_on_every_path",),
}
"""Standard tests of conformance/_scale.py that also fail on these engines, found by running
them on every broken engine: allowed in the full pins run, not pinned (each _scale test has
broken engines of its own in scale_mutants)."""
for _name, _tests in _ALSO_FAILS_SCALE_TESTS.items():
    _entry = MUTANTS[_name]
    MUTANTS[_name] = _entry._replace(may_fail=_entry.may_fail + _tests)
