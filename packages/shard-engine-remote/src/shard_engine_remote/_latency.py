"""How long a server took over its calls: :class:`CallLatency`, two histograms per operation
that ``serve --metrics-listen`` exports (:mod:`~shard_engine_remote._prometheus`).

Both are recorded where every call of either transport passes (``EngineServer.serve_call``,
``serve_export``, ``serve_import`` and the compute slot's wait in ``_compute``), with the
monotonic clock:

- a call's latency: from its decoded request to its reply ready to encode (for an export,
  its header; for an import, from its first message, so the client's upload is in it),
  queue wait included; every call is counted, refused ones too;
- a compute call's queue wait: from asking for a compute slot to holding one or leaving the
  queue without it (prefill, decode, decode_batch; an export or import takes its slot at once
  or is refused, so its wait is 0). A call refused at once, the queue being full, has none.

The buckets span a fake engine's tens of microseconds to a llama.cpp prefill's seconds.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Final

import shard_engine_api as api
from shard_engine_remote._wire import (
    CapabilitiesQuery,
    HealthQuery,
    MetricsQuery,
    Rejected,
    ServerStatsQuery,
)

__all__ = ["LATENCY_BUCKETS_S", "OPERATIONS", "CallLatency", "HistogramSnapshot", "operation_of"]

LATENCY_BUCKETS_S: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Upper bounds (seconds) of the histograms' buckets; one more, unbounded, holds the rest."""

_OPERATION_NAMES: Final[dict[type[object], str]] = {
    api.PrefillRequest: "prefill",
    api.DecodeRequest: "decode",
    api.DecodeBatchRequest: "decode_batch",
    api.ExportSessionRequest: "export",
    api.ImportSessionRequest: "import",
    api.CancelRequest: "cancel",
    api.ReleaseRequest: "release",
    api.LoadConfig: "load",
    CapabilitiesQuery: "capabilities",
    HealthQuery: "health",
    MetricsQuery: "metrics",
    ServerStatsQuery: "server_stats",
    Rejected: "rejected",
}
OPERATIONS: Final = tuple(_OPERATION_NAMES.values())
"""Every operation's label (``rejected``: a message that did not decode), each exported from
the start (at zero) so a rate over a scrape series never misses its first calls."""
_COMPUTE: Final = ("prefill", "decode", "decode_batch", "export", "import")


def operation_of(request: object) -> str:
    """The operation label of a decoded request (``rejected`` for anything unknown)."""
    return _OPERATION_NAMES.get(type(request), "rejected")


@dataclass(frozen=True)
class HistogramSnapshot:
    """One histogram now: cumulative counts per bucket bound (the last one is ``+Inf`` and
    equals ``count``), and the sum of the observed seconds."""

    buckets: tuple[tuple[float, int], ...]
    count: int
    sum_s: float


class _Histogram:
    __slots__ = ("counts", "sum_s")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.sum_s = 0.0

    def snapshot(self) -> HistogramSnapshot:
        cumulative: list[tuple[float, int]] = []
        running = 0
        for bound, count in zip((*LATENCY_BUCKETS_S, float("inf")), self.counts, strict=True):
            running += count
            cumulative.append((bound, running))
        return HistogramSnapshot(buckets=tuple(cumulative), count=running, sum_s=self.sum_s)


class CallLatency:
    """The server's call-latency and queue-wait histograms, per operation (thread-safe; a
    record costs a lock and a bisect)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls = {operation: _Histogram() for operation in OPERATIONS}
        self._waits = {operation: _Histogram() for operation in _COMPUTE}

    def record_call(self, operation: str, seconds: float) -> None:
        self._record(self._calls, operation, seconds)

    def record_wait(self, operation: str, seconds: float) -> None:
        self._record(self._waits, operation, seconds)

    def _record(self, histograms: dict[str, _Histogram], operation: str, seconds: float) -> None:
        seconds = max(0.0, seconds)
        index = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)
        with self._lock:
            histogram = histograms.get(operation)
            if histogram is None:
                histogram = histograms[operation] = _Histogram()
            histogram.counts[index] += 1
            histogram.sum_s += seconds

    def calls(self) -> dict[str, HistogramSnapshot]:
        """Each operation's call latency now."""
        return self._snapshot(self._calls)

    def waits(self) -> dict[str, HistogramSnapshot]:
        """Each compute operation's queue wait now."""
        return self._snapshot(self._waits)

    def _snapshot(self, histograms: dict[str, _Histogram]) -> dict[str, HistogramSnapshot]:
        with self._lock:
            return {name: histogram.snapshot() for name, histogram in sorted(histograms.items())}
