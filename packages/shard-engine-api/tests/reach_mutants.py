"""Broken engines whose bug lives past the conformance suite's habitual small cases (positions
past 256, batches past 8 items, thousands of releases, values at their edges, clocks, several
callers): each violates one rule of the contract and passed every test before the suite
reached that far (the tests at scale and at the edges, now in the conformance modules of their
subjects, and ``conformance/_concurrency.py``).
test_conformance_reach_mutants runs the suite on each and checks which tests catch it."""

from __future__ import annotations

import threading
from typing import Final

import msgspec
import numpy as np
from conformance_engines import (
    Array,
    Broken,
    ReferenceEngine,
    _RekeyedLedger,
    _RewritesBundles,
)

from shard_engine_api import (
    BoundaryBundle,
    BoundaryResult,
    CancelRequest,
    CancelResult,
    Capabilities,
    ChecksumMismatch,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    ErrorInfo,
    InvalidRequest,
    LoadConfig,
    LogitsResult,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    SessionRef,
    ShardEngineError,
    ShardResult,
)
from shard_engine_api._fences import FenceTable
from shard_engine_api._ledger import SessionLedger
from shard_engine_api._types import CONTRACT_VERSION, AuxState, MtpState
from shard_engine_api.engine import ForwardItem

__all__ = ["REACH_MUTANTS"]

replace = msgspec.structs.replace


class DecodeCellIndexWrapsAt256(ReferenceEngine):
    """A single-row forward past position 255 reads its history from a cell index kept in a
    byte: position ``p`` sees the history of ``(p - 1) % 256``."""

    def _history(self, item: ForwardItem, layer: int, pos: int, sums: Array) -> Array:
        if item.n_tokens == 1 and pos > 256:
            return np.asarray(sums[layer, (pos - 1) % 256], dtype=np.float32)
        return super()._history(item, layer, pos, sums)


class _ForgetsPast4096(FenceTable):
    """Keeps the newest 4,096 fences and forgets older ones without counting them."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []
        self.forgotten: set[str] = set()

    def get(self, session_id: str):  # type: ignore[no-untyped-def]
        return None if session_id in self.forgotten else super().get(session_id)

    def put(self, session_id: str, epoch: int, *, released: bool) -> None:
        self.forgotten.discard(session_id)
        self.order.append(session_id)
        if len(self.order) > 4096:
            self.forgotten.add(self.order.pop(0))
        super().put(session_id, epoch, released=released)


class _ForgettingLedger(SessionLedger):
    def __init__(self, fence_generation: int) -> None:
        super().__init__(fence_generation)
        self.fences = _ForgetsPast4096()


class FencesForgottenPast4096(ReferenceEngine):
    """Keeps tombstones in a table of 4,096 entries and silently forgets the oldest."""

    ledger_type = _ForgettingLedger


class _RewritesBatches(ReferenceEngine):
    def _rewrite(self, request: DecodeBatchRequest, items: list[object]) -> None:
        return None

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        result = super().decode_batch(request)
        items: list[object] = list(result.items)
        self._rewrite(request, items)
        return replace(result, items=tuple(items))


def _with_payload(result: LogitsResult | BoundaryResult, source: object) -> object:
    if isinstance(result, LogitsResult) and isinstance(source, LogitsResult):
        return replace(result, payload=source.payload, checksum=source.checksum)
    return result


class BatchRowsWrapAt8(_RewritesBatches):
    """Maps the rows of a batch back to items modulo 8: item 8 gets item 0's row."""

    def _rewrite(self, request: DecodeBatchRequest, items: list[object]) -> None:
        for index in range(8, len(items)):
            item = items[index]
            if isinstance(item, LogitsResult | BoundaryResult):
                items[index] = _with_payload(item, items[index - 8])


class BatchSharesRowsOfEqualInputs(_RewritesBatches):
    """Computes one row per distinct (position, token) of a batch and hands it to every item
    with those inputs, whatever their sessions' histories."""

    def _rewrite(self, request: DecodeBatchRequest, items: list[object]) -> None:
        first: dict[tuple[int, object], object] = {}
        for index, (item, outcome) in enumerate(zip(request.items, items, strict=True)):
            if not isinstance(outcome, LogitsResult):
                continue
            key = (item.pos, getattr(item.inputs, "token_ids", None))
            if key in first:
                items[index] = _with_payload(outcome, first[key])
            else:
                first[key] = outcome


class BatchBudgetNotRetryable(_RewritesBatches):
    """Marks a batch item refused for the KV budget not retryable."""

    def _rewrite(self, request: DecodeBatchRequest, items: list[object]) -> None:
        for index, outcome in enumerate(items):
            if (
                isinstance(outcome, ErrorInfo)
                and outcome.code == "resource_exhausted"
                and outcome.details.get("resource") == "kv"
            ):
                items[index] = replace(outcome, retryable=False)


class BatchMissesLoseReason(_RewritesBatches):
    """Reports every CacheMiss item of a batch with reason "position_mismatch"."""

    def _rewrite(self, request: DecodeBatchRequest, items: list[object]) -> None:
        for index, outcome in enumerate(items):
            if isinstance(outcome, ErrorInfo) and outcome.code == "cache_miss":
                details = {**outcome.details, "reason": "position_mismatch"}
                items[index] = replace(outcome, details=details)


class BatchKeepsLruOrder(ReferenceEngine):
    """A batch does not count as a use for LRU (only single requests refresh last use)."""

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        sessions = self._ledger.sessions
        with self._state_lock:
            before = {sid: entry.last_used for sid, entry in sessions.items()}
        result = super().decode_batch(request)
        with self._state_lock:
            for sid, entry in sessions.items():
                if sid in before:
                    entry.last_used = before[sid]
        return result


class DecodeChecksumNotRetryable(ReferenceEngine):
    """Raises ChecksumMismatch on decode as not retryable (prefill's is)."""

    def decode(self, request: DecodeRequest) -> ShardResult:
        try:
            return super().decode(request)
        except ChecksumMismatch as error:
            raise ChecksumMismatch(error.message, retryable=False) from None


class DecodeAcceptsOlderContract(_RewritesBundles):
    """On decode, accepts bundles of any older contract version (a ``>=`` check)."""

    def _patched(
        self, bundle: BoundaryBundle, caps: Capabilities, single_row: bool
    ) -> BoundaryBundle:
        if single_row and bundle.contract_version < CONTRACT_VERSION:
            return replace(bundle, contract_version=CONTRACT_VERSION)
        return bundle


class ContractVersionInAByte(_RewritesBundles):
    """Compares contract versions modulo 256 (stored in a byte)."""

    def _patched(
        self, bundle: BoundaryBundle, caps: Capabilities, single_row: bool
    ) -> BoundaryBundle:
        if bundle.contract_version % 256 == CONTRACT_VERSION % 256:
            return replace(bundle, contract_version=CONTRACT_VERSION)
        return bundle


def _meaningful_mtp(mtp: tuple[MtpState, ...]) -> tuple[MtpState, ...]:
    return tuple(m for m in mtp if m.n_draft_tokens or m.payload)


def _meaningful_aux(aux: tuple[AuxState, ...]) -> tuple[AuxState, ...]:
    return tuple(a for a in aux if a.name or a.payload)


class EmptyReservedValuesAccepted(ReferenceEngine):
    """Treats ``MtpState()`` and ``AuxState(name="")`` as absent ("nothing in them")."""

    def prefill(self, request: PrefillRequest) -> ShardResult:
        return super().prefill(
            replace(request, mtp=_meaningful_mtp(request.mtp), aux=_meaningful_aux(request.aux))
        )

    def decode(self, request: DecodeRequest) -> ShardResult:
        return super().decode(
            replace(request, mtp=_meaningful_mtp(request.mtp), aux=_meaningful_aux(request.aux))
        )


class _CStringLedger(_RekeyedLedger):
    @staticmethod
    def key(session_id: str) -> str:
        return session_id.split("\x00", 1)[0]


class SessionIdsEndAtNul(ReferenceEngine):
    """Keys sessions by their id up to the first NUL (a C string)."""

    ledger_type = _CStringLedger


class _ByteKeyLedger(_RekeyedLedger):
    @staticmethod
    def key(session_id: str) -> str:
        return session_id.encode()[:256].decode(errors="ignore")


class SessionIdsKeptIn256Bytes(ReferenceEngine):
    """Keys sessions by the first 256 bytes of their UTF-8 id."""

    ledger_type = _ByteKeyLedger


class _TracksRequests(ReferenceEngine):
    def __init__(self) -> None:
        super().__init__()
        self._mine: dict[str, str] = {}
        self._mine_lock = threading.Lock()

    def _tracked(self, request_id: str, session_id: str, call: object) -> ShardResult:
        with self._mine_lock:
            self._mine[request_id] = session_id
        try:
            return call()  # type: ignore[operator,no-any-return]
        finally:
            with self._mine_lock:
                self._mine.pop(request_id, None)

    def prefill(self, request: PrefillRequest) -> ShardResult:
        return self._tracked(
            request.request_id,
            request.session.session_id,
            lambda: super(_TracksRequests, self).prefill(request),
        )


class ReusedIdLosesTheFirst(_TracksRequests):
    """A decode reusing the id of an in-flight prefill is refused, but the refusal drops the
    first request's registration: a cancel by that id no longer reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self._orphaned: set[str] = set()

    def decode(self, request: DecodeRequest) -> ShardResult:
        with self._mine_lock:
            reused = request.request_id in self._mine
            if reused:
                self._orphaned.add(request.request_id)
        if reused:
            raise InvalidRequest(f"request_id {request.request_id!r} is already in flight")
        return super().decode(request)

    def cancel(self, request: CancelRequest) -> CancelResult:
        if request.request_id is not None and request.request_id in self._orphaned:
            return CancelResult(cancelled=False, n_requests=0)
        return super().cancel(request)


class ReleaseIgnoresRunningRequests(_TracksRequests):
    """A release arriving while a prefill of the session runs answers released=True at once
    and leaves the session to the prefill, which commits it again."""

    def release(self, request: ReleaseRequest) -> ReleaseResult:
        with self._mine_lock:
            running = request.session.session_id in self._mine.values()
        if running:
            return ReleaseResult(released=True, detail="released")
        return super().release(request)


class _RewritesTimings(ReferenceEngine):
    def _timed(self, result: ShardResult) -> ShardResult:
        return result

    def prefill(self, request: PrefillRequest) -> ShardResult:
        return self._timed(super().prefill(request))

    def decode(self, request: DecodeRequest) -> ShardResult:
        return self._timed(super().decode(request))


class ComputeMsCumulative(_RewritesTimings):
    """Reports in each result the compute time of every call so far, not of this one."""

    def __init__(self) -> None:
        super().__init__()
        self._total = 0.0

    def _timed(self, result: ShardResult) -> ShardResult:
        self._total += result.timings.compute_ms
        timings = replace(
            result.timings,
            compute_ms=self._total,
            total_ms=max(result.timings.total_ms, self._total),
        )
        return replace(result, timings=timings)


class TimingsInSeconds(_RewritesTimings):
    """Reports timings in seconds in the fields named milliseconds."""

    def _timed(self, result: ShardResult) -> ShardResult:
        t = result.timings
        timings = replace(
            t,
            queue_ms=t.queue_ms / 1000,
            compute_ms=t.compute_ms / 1000,
            total_ms=t.total_ms / 1000,
        )
        return replace(result, timings=timings)


class RefusedLoadSticks(ReferenceEngine):
    """After a refused load it stays "loading": every later load is refused."""

    def __init__(self) -> None:
        super().__init__()
        self._refused = False

    def load(self, config: LoadConfig) -> Capabilities:
        if self._refused:
            raise InvalidRequest("the engine is already loading")
        try:
            return super().load(config)
        except ShardEngineError:
            self._refused = True
            raise


class NewerEpochDropsTheOldFirst(ReferenceEngine):
    """Releases a live session's older epoch as soon as a newer epoch's prefill arrives,
    before that prefill is validated or run."""

    def __init__(self) -> None:
        super().__init__()
        self._epochs: dict[str, int] = {}

    def prefill(self, request: PrefillRequest) -> ShardResult:
        sid, epoch = request.session.session_id, request.session.epoch
        live = self._epochs.get(sid)
        if live is not None and live < epoch:
            super().release(ReleaseRequest(session=SessionRef(session_id=sid, epoch=live)))
        result = super().prefill(request)
        self._epochs[sid] = epoch
        return result


class CancelReachesQueuedNeighbours(ReferenceEngine):
    """Cancelling one single decode by request id also cancels every other decode waiting
    beside it."""

    def __init__(self) -> None:
        super().__init__()
        self._decoding: set[str] = set()
        self._decoding_lock = threading.Lock()

    def decode(self, request: DecodeRequest) -> ShardResult:
        with self._decoding_lock:
            self._decoding.add(request.request_id)
        try:
            return super().decode(request)
        finally:
            with self._decoding_lock:
                self._decoding.discard(request.request_id)

    def cancel(self, request: CancelRequest) -> CancelResult:
        result = super().cancel(request)
        with self._decoding_lock:
            neighbours = set(self._decoding) - {request.request_id}
        if result.cancelled and request.request_id is not None:
            for other in neighbours:
                super().cancel(CancelRequest(request_id=other))
        return result


class QueuesOutsideTheCore(ReferenceEngine):
    """Serialises every prefill and decode behind a lock of its own, taken before the request
    is registered with the core: a queued request cannot be cancelled until it runs."""

    def __init__(self) -> None:
        super().__init__()
        self._outer = threading.Lock()

    def prefill(self, request: PrefillRequest) -> ShardResult:
        with self._outer:
            return super().prefill(request)

    def decode(self, request: DecodeRequest) -> ShardResult:
        with self._outer:
            return super().decode(request)


_MACHINE: Final = ("test_state_machine_every_role", "test_state_machine_full_shard")

REACH_MUTANTS: Final[dict[str, Broken]] = {
    "decode_cell_index_wraps_at256": Broken(
        DecodeCellIndexWrapsAt256, ("test_long_session_decode_and_chunks_match_one_prefill",)
    ),
    "fences_forgotten_past4096": Broken(
        FencesForgottenPast4096, ("test_thousands_of_releases_keep_every_fence",)
    ),
    "batch_rows_wrap_at8": Broken(
        BatchRowsWrapAt8, ("test_large_shuffled_batches_match_single_decodes",)
    ),
    "batch_shares_rows_of_equal_inputs": Broken(
        BatchSharesRowsOfEqualInputs, ("test_large_shuffled_batches_match_single_decodes",)
    ),
    "batch_budget_not_retryable": Broken(
        BatchBudgetNotRetryable,
        (
            "test_batch_at_the_kv_budget",
            "test_retryable_on_every_path",
        ),
    ),
    "batch_misses_lose_reason": Broken(
        BatchMissesLoseReason,
        ("test_batch_error_items_carry_their_fields",),
    ),
    "batch_keeps_lru_order": Broken(BatchKeepsLruOrder, ("test_batch_use_refreshes_lru_order",)),
    "decode_checksum_not_retryable": Broken(
        DecodeChecksumNotRetryable, ("test_retryable_on_every_path",)
    ),
    "decode_accepts_older_contract": Broken(
        DecodeAcceptsOlderContract, ("test_contract_version_at_its_edges",)
    ),
    "contract_version_in_a_byte": Broken(
        ContractVersionInAByte, ("test_contract_version_at_its_edges",)
    ),
    "empty_reserved_values_accepted": Broken(
        EmptyReservedValuesAccepted, ("test_empty_reserved_values_refused",)
    ),
    "session_ids_end_at_nul": Broken(
        SessionIdsEndAtNul, ("test_session_ids_across_characters_and_lengths",)
    ),
    "session_ids_kept_in256_bytes": Broken(
        SessionIdsKeptIn256Bytes, ("test_session_ids_across_characters_and_lengths",)
    ),
    "reused_id_loses_the_first": Broken(
        ReusedIdLosesTheFirst, ("test_request_id_reused_while_in_flight",)
    ),
    "release_ignores_running_requests": Broken(
        ReleaseIgnoresRunningRequests, ("test_release_while_a_request_runs",)
    ),
    "compute_ms_cumulative": Broken(ComputeMsCumulative, ("test_timings_against_the_wall_clock",)),
    "timings_in_seconds": Broken(TimingsInSeconds, ("test_timings_against_the_wall_clock",)),
    "refused_load_sticks": Broken(RefusedLoadSticks, ("test_load_after_a_refused_load",)),
    "newer_epoch_drops_the_old_first": Broken(
        NewerEpochDropsTheOldFirst,
        (
            "test_refused_first_prefill_of_a_newer_epoch",
            *_MACHINE,
        ),
    ),
    "cancel_reaches_queued_neighbours": Broken(
        CancelReachesQueuedNeighbours, ("test_cancel_one_of_queued_requests",)
    ),
    "queues_outside_the_core": Broken(
        QueuesOutsideTheCore,
        (
            "test_cancel_one_of_queued_requests",
            "test_cancel_one_of_two_in_flight",
            "test_cancel_session_stops_all_its_requests",
            "test_queued_cancel_heard_at_once",
            "test_request_id_reused_while_in_flight",
        ),
    ),
}
"""Each broken engine and the standard tests that must fail on it (and no others)."""

_ALSO_FAILS_SCALE_TESTS: Final[dict[str, tuple[str, ...]]] = {
    "decode_accepts_older_contract": ("test_retryable_at_every_contract_version_and_path",),
    "decode_checksum_not_retryable": ("test_retryable_at_every_contract_version_and_path",),
    "newer_epoch_drops_the_old_first": ("test_newer_epoch_refused_on_every_path_keeps_the_older",),
    "queues_outside_the_core": ("test_request_id_reused_in_flight_on_every_path",),
    "refused_load_sticks": ("test_loads_after_refused_loads_of_every_kind",),
    "session_ids_end_at_nul": ("test_session_ids_at_and_past_the_length_limit",),
    "session_ids_kept_in256_bytes": ("test_session_ids_at_and_past_the_length_limit",),
}
"""Standard tests of conformance/_scale.py that also fail on these engines, found by running
them on every broken engine: allowed in the full pins run, not pinned (each _scale test has
broken engines of its own in scale_mutants)."""
for _name, _tests in _ALSO_FAILS_SCALE_TESTS.items():
    _entry = REACH_MUTANTS[_name]
    REACH_MUTANTS[_name] = _entry._replace(may_fail=_entry.may_fail + _tests)
