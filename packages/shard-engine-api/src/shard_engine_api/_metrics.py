"""The counters behind ``metrics()``. The core updates them under its state lock only."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from shard_engine_api._errors import Cancelled, ShardEngineError
from shard_engine_api._scheduler import QueueStats
from shard_engine_api._types import Metrics

__all__ = ["Counters"]


@dataclass(slots=True)
class Counters:
    """Counts since load. ``errors`` counts exactly the errors callers saw, by code."""

    requests: int = 0
    prefill_requests: int = 0
    decode_requests: int = 0
    batch_requests: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cancelled: int = 0
    evictions: int = 0
    releases: int = 0
    exports: int = 0
    imports: int = 0
    compute_ms: float = 0.0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)

    def count_error(self, error: ShardEngineError) -> None:
        self.errors[error.code] += 1
        if isinstance(error, Cancelled):
            self.cancelled += 1

    def snapshot(
        self,
        *,
        sessions_active: int,
        tombstones: int,
        fences_dropped: int,
        kv_used_tokens: int,
        queue: QueueStats,
    ) -> Metrics:
        return Metrics(
            requests=self.requests,
            prefill_requests=self.prefill_requests,
            decode_requests=self.decode_requests,
            batch_requests=self.batch_requests,
            prefill_tokens=self.prefill_tokens,
            decode_tokens=self.decode_tokens,
            cancelled=self.cancelled,
            evictions=self.evictions,
            releases=self.releases,
            exports=self.exports,
            imports=self.imports,
            sessions_active=sessions_active,
            tombstones=tombstones,
            fences_dropped=fences_dropped,
            kv_used_tokens=kv_used_tokens,
            compute_ms=self.compute_ms,
            errors=dict(self.errors),
            queued=queue.queued_now,
            queue_peak=queue.queue_peak,
            queue_waits=queue.waited,
            queue_wait_ms=queue.wait_ms_total,
            queue_wait_max_ms=queue.wait_ms_max,
            coalesced_forwards=queue.groups,
            coalesced_requests=queue.grouped_requests,
            coalesced_max=queue.group_max,
        )
