"""Per-client token buckets: one client's flood is refused without slowing anyone else.

Each client (the mutual-TLS identity when the peer presented a certificate, else its
connection) owns a bucket of ``burst`` calls refilled at ``calls_per_s``. A call finding its
bucket empty is refused at once with a retryable ResourceExhausted carrying ``retry_after_s``,
before any decoding or engine work, so a flooding client costs the server only the refusal and
the other clients' buckets are untouched. At most ``max_clients`` buckets are kept: the
longest-idle one is forgotten first (a forgotten client starts again with a full bucket, which
is never less than a fresh connection would get anyway).

Hand-written (about forty lines) rather than taken from a rate-limiting library: the server
needs bounded memory under a flood of new connections, the time until the next token for the
retry-after detail, and an injectable clock so tests need no sleeping; the packages found
(``token-bucket``, ``limits``) keep unbounded per-key storage or count windows instead.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import shard_engine_api as api

__all__ = ["DEFAULT_MAX_CLIENTS", "RateLimit", "RateLimiter"]

DEFAULT_MAX_CLIENTS: Final = 4096


@dataclass(frozen=True, slots=True)
class RateLimit:
    """``calls_per_s`` sustained, ``burst`` at once, per client. Raises InvalidRequest."""

    calls_per_s: float
    burst: int
    max_clients: int = DEFAULT_MAX_CLIENTS

    def __post_init__(self) -> None:
        if not self.calls_per_s > 0:
            raise api.InvalidRequest(f"rate limit calls_per_s must be > 0: {self.calls_per_s}")
        if self.burst < 1:
            raise api.InvalidRequest(f"rate limit burst must be >= 1: {self.burst}")
        if self.max_clients < 1:
            raise api.InvalidRequest(f"rate limit max_clients must be >= 1: {self.max_clients}")


class RateLimiter:
    """The buckets of one server. Thread-safe."""

    def __init__(self, limit: RateLimit, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self._clock = clock
        self._lock = threading.Lock()
        # client -> (tokens, time of the last refill); least recently used first.
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, client: str) -> float | None:
        """Take one call's token from ``client``'s bucket: None when admitted, else the seconds
        until a token is due (the caller refuses the call)."""
        limit = self.limit
        now = self._clock()
        with self._lock:
            tokens, last = self._buckets.pop(client, (float(limit.burst), now))
            tokens = min(float(limit.burst), tokens + (now - last) * limit.calls_per_s)
            admitted = tokens >= 1.0
            if admitted:
                tokens -= 1.0
            self._buckets[client] = (tokens, now)
            if len(self._buckets) > limit.max_clients:
                self._buckets.popitem(last=False)
        return None if admitted else (1.0 - tokens) / limit.calls_per_s
