"""The ``ShardEngine`` protocol: what worker code may call, and nothing else.

Every method is synchronous and thread-safe. ``cancel``, ``health`` and ``metrics`` may be called
from any thread while ``prefill``/``decode`` run on another. Methods that take a request raise
only :class:`~shard_engine_api.ShardEngineError` subclasses.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from shard_engine_api._types import (
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    ExportSessionRequest,
    Health,
    ImportSessionRequest,
    ImportSessionResult,
    LoadConfig,
    Metrics,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    SessionSnapshot,
    ShardResult,
)

__all__ = ["ShardEngine"]


@runtime_checkable
class ShardEngine(Protocol):
    """One shard of one model, serving many sessions."""

    @property
    def name(self) -> str:
        """The engine's entry-point name."""
        ...

    def load(self, config: LoadConfig) -> Capabilities:
        """Open the shard and become ready.

        Raises InvalidRequest (bad config, unreadable model, second load), UnsupportedFeature
        (architecture or setting outside the engine's allow-list), ResourceExhausted.
        """
        ...

    def capabilities(self) -> Capabilities:
        """What the loaded engine is and can do. Raises NotReady when not serving (before load,
        while loading, after close) and EngineCrashed after a crash."""
        ...

    def prefill(self, request: PrefillRequest) -> ShardResult:
        """Process ``inputs`` at ``start_pos..``; truncates first when ``start_pos`` is below
        the committed length. Returns a BoundaryResult (head, middle) or LogitsResult (tail, full).

        Raises InvalidRequest, WrongRole, ShardMismatch, ContractVersionMismatch,
        ChecksumMismatch, UnsupportedFeature, NotReady, CacheMiss (gap), StaleEpoch,
        ResourceExhausted, Cancelled, EngineCrashed. On any error the session is unchanged.
        """
        ...

    def decode(self, request: DecodeRequest) -> ShardResult:
        """Process one row at ``pos`` == committed length.

        Raises the same errors as ``prefill``; CacheMiss carries the committed length.
        """
        ...

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        """One decode step for distinct sessions; per-item errors are returned, not raised.

        The first item naming a session is served as a single decode would be; every later
        item naming the same session fails alone with InvalidRequest. Admitting the batch
        evicts (with eviction "lru") only idle sessions, never a session a valid item names.
        Raises (for the whole batch) InvalidRequest, NotReady, Cancelled, EngineCrashed.
        """
        ...

    def cancel(self, request: CancelRequest) -> CancelResult:
        """Ask in-flight work to stop at its next safe point; its caller gets Cancelled and the
        session is rolled back. ``cancelled=True`` only when the counted requests will not
        commit; ``cancelled=False`` for unknown, finished or already committing requests.
        Raises InvalidRequest when the request names neither or both of request_id and
        session_id, and EngineCrashed after a crash."""
        ...

    def release(self, request: ReleaseRequest) -> ReleaseResult:
        """Free a session and tombstone its epoch. Raises StaleEpoch for an older epoch,
        NotReady, EngineCrashed."""
        ...

    def export_session(self, request: ExportSessionRequest) -> SessionSnapshot:
        """Snapshot a live session at exactly its current epoch; the source is unchanged (its
        LRU position too). Needs ``Features.session_migration``.

        Raises UnsupportedFeature (no migration), InvalidRequest, NotReady, CacheMiss (unknown,
        evicted, or newer epoch not yet prefilled), StaleEpoch (older or released epoch),
        Cancelled, EngineCrashed.
        """
        ...

    def import_session(self, request: ImportSessionRequest) -> ImportSessionResult:
        """Install a snapshot as a live session, atomically: on any error nothing changed (no
        session, no slot, no KV use, an older live epoch intact). Needs
        ``Features.session_migration``.

        Raises UnsupportedFeature, InvalidRequest (bad request, epoch below the snapshot's,
        undecodable state), ShardMismatch (another engine, version, model, layer range,
        boundary dtype or settings), ContractVersionMismatch, ChecksumMismatch (truncated or
        corrupted state), StaleEpoch (not newer than a live epoch, or fenced), ResourceExhausted
        (context, session slots, KV budget), NotReady, Cancelled, EngineCrashed.
        """
        ...

    def health(self) -> Health:
        """Lifecycle state and occupancy. Never raises."""
        ...

    def metrics(self) -> Metrics:
        """Counters since load. Never raises."""
        ...

    def close(self) -> None:
        """Free everything; later calls raise NotReady. Idempotent."""
        ...
