"""What a server saw, refused or cut short: :class:`ServerCounters`, which clients read as
:class:`~shard_engine_remote._wire.ServerStats`."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from shard_engine_api.wire import clamp_text
from shard_engine_remote._wire import MAX_ENV_VALUE_CHARS, THREADING_ENV, ServerStats

__all__ = ["ServerCounters"]


@dataclass
class ServerCounters:
    """What the server saw, refused or cut short since it started (see :class:`ServerStats`
    for what each counts)."""

    calls: int = 0
    in_flight: int = 0
    unauthenticated: int = 0
    rejected_frames: int = 0
    oversized: int = 0
    rate_limited: int = 0
    busy: int = 0
    transport_cancels: int = 0
    stalled: int = 0
    shared_memory_calls: int = 0
    refused_shared_memory: int = 0
    drain_refused: int = 0
    queue: Callable[[], dict[str, int | float]] | None = field(
        default=None, repr=False, compare=False
    )
    """The compute queue's own figures (depth, waits: ``Admission.stats``), when there is one."""
    streams: Callable[[], int] | None = field(default=None, repr=False, compare=False)
    """How many snapshot streams wait for a stream slot now, when the server has a queue."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def call_started(self) -> None:
        with self._lock:
            self.calls += 1
            self.in_flight += 1

    def call_ended(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def stats(self, rate_limited_clients: int = 0) -> ServerStats:
        queue: dict[str, int | float] = {} if self.queue is None else self.queue()
        if self.streams is not None:
            queue["streams_queued"] = self.streams()
        with self._lock:
            stats = ServerStats(
                drain_refused=self.drain_refused,
                calls=self.calls,
                in_flight=self.in_flight,
                unauthenticated=self.unauthenticated,
                rejected_frames=self.rejected_frames,
                oversized=self.oversized,
                rate_limited=self.rate_limited,
                busy=self.busy,
                transport_cancels=self.transport_cancels,
                shared_memory_calls=self.shared_memory_calls,
                refused_shared_memory=self.refused_shared_memory,
                stalled=self.stalled,
                rate_limited_clients=rate_limited_clients,
                threading={
                    name: clamp_text(os.environ[name], MAX_ENV_VALUE_CHARS)
                    for name in THREADING_ENV
                    if name in os.environ
                },
            )
        return msgspec.structs.replace(stats, **queue) if queue else stats

    def snapshot(self) -> dict[str, int]:
        return msgspec.structs.asdict(self.stats())
