"""``serve --metrics-listen``: the served engine's metrics and health and the server's stats in
the Prometheus text format (``prometheus_client``, the ``metrics`` extra).

Every value is read at scrape time from ``engine.metrics()``, ``engine.health()`` and
``server.stats()``, so the scrape and the Python objects never disagree. Names:
``shard_engine_<field>`` for the engine's metrics (counters end in ``_total``; errors are
``shard_engine_errors_total{code=...}``), ``shard_engine_health_<field>`` and
``shard_engine_state{state=...}`` for its health, ``shard_engine_server_<field>`` for the
server's stats. Two histograms per operation (label ``operation``: prefill, decode, decode_batch,
export, import, cancel, release, ...) are the server's own records (:mod:`._latency`):
``shard_engine_server_call_duration_seconds`` (each call, from its decoded request to its reply,
queue wait included) and ``shard_engine_server_queue_wait_seconds`` (each compute call's wait
for a compute slot).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final, Protocol

import msgspec

import shard_engine_api as api

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.registry import CollectorRegistry

    from shard_engine_remote._latency import CallLatency, HistogramSnapshot
    from shard_engine_remote._wire import ServerStats

__all__ = ["MetricsEndpoint", "collector_registry", "start_metrics_endpoint"]

_ENGINE_GAUGES: Final = frozenset(
    {
        "sessions_active",
        "tombstones",
        "kv_used_tokens",
        "queued",
        "queue_peak",
        "queue_wait_max_ms",
        "coalesced_max",
    }
)
"""Metrics fields that are values now (or peaks), not counts since load."""
_SERVER_GAUGES: Final = frozenset(
    {
        "in_flight",
        "rate_limited_clients",
        "queued",
        "max_queued",
        "computing",
        "queue_wait_max_ms",
        "streams_queued",
    }
)
"""ServerStats fields that are values now, not counts since the server started."""
_LIFECYCLE_STATES: Final = ("loading", "ready", "degraded", "draining", "closed", "failed")


class _Served(Protocol):
    """What is scraped: an engine server (``EngineServer``)."""

    @property
    def engine(self) -> api.ShardEngine: ...

    @property
    def latency(self) -> CallLatency: ...

    def stats(self) -> ServerStats: ...


class _Collector:
    """A ``prometheus_client`` collector reading the served engine and its server."""

    def __init__(self, served: _Served) -> None:
        self._served = served

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engine = self._served.engine
        metrics = engine.metrics()
        health = engine.health()
        stats = self._served.stats()
        errors = CounterMetricFamily(
            "shard_engine_errors", "Errors callers received, by code", labels=["code"]
        )
        for code, count in sorted(metrics.errors.items()):
            errors.add_metric([code], count)
        yield errors
        for name, value in msgspec.structs.asdict(metrics).items():
            if name == "errors" or not isinstance(value, int | float):
                continue
            described = f"Engine metrics field {name}"
            if name in _ENGINE_GAUGES:
                yield GaugeMetricFamily(f"shard_engine_{name}", described, value=value)
            else:
                yield CounterMetricFamily(f"shard_engine_{name}", described, value=value)
        for name, value in msgspec.structs.asdict(health).items():
            if isinstance(value, int) and not isinstance(value, bool):
                yield GaugeMetricFamily(
                    f"shard_engine_health_{name}", f"Engine health field {name}", value=value
                )
        state = GaugeMetricFamily(
            "shard_engine_state", "1 for the engine's lifecycle state now", labels=["state"]
        )
        for known in sorted({*_LIFECYCLE_STATES, health.state}):
            state.add_metric([known], 1 if known == health.state else 0)
        yield state
        for name, value in msgspec.structs.asdict(stats).items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            described = f"Server stats field {name}"
            if name in _SERVER_GAUGES:
                yield GaugeMetricFamily(f"shard_engine_server_{name}", described, value=value)
            else:
                yield CounterMetricFamily(f"shard_engine_server_{name}", described, value=value)
        latency = self._served.latency
        yield _histograms(
            "shard_engine_server_call_duration_seconds",
            "Server-side latency of each call, queue wait included, by operation",
            latency.calls(),
        )
        yield _histograms(
            "shard_engine_server_queue_wait_seconds",
            "Time each compute call waited for a compute slot, by operation",
            latency.waits(),
        )


def _histograms(
    name: str, documentation: str, by_operation: dict[str, HistogramSnapshot]
) -> object:
    from prometheus_client.core import HistogramMetricFamily

    family = HistogramMetricFamily(name, documentation, labels=["operation"])
    for operation, histogram in by_operation.items():
        family.add_metric(
            [operation],
            buckets=[
                ("+Inf" if bound == math.inf else repr(bound), count)
                for bound, count in histogram.buckets
            ],
            sum_value=histogram.sum_s,
        )
    return family


def collector_registry(served: _Served) -> CollectorRegistry:
    """A registry holding only the served engine's and server's metrics."""
    from prometheus_client.registry import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(served))  # type: ignore[arg-type]
    return registry


class MetricsEndpoint:
    """A running HTTP endpoint (``GET /metrics``) at ``address``; :meth:`stop` ends it."""

    def __init__(self, address: str, server: WSGIServer) -> None:
        self.address = address
        self._server = server

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_metrics_endpoint(listen: str, served: _Served) -> MetricsEndpoint:
    """Serve ``served``'s metrics over HTTP at ``listen`` (``host:port``; port 0 picks one).

    Raises InvalidRequest when ``prometheus_client`` is not installed (naming the pip
    command), for an address that is not ``host:port``, or one that cannot be bound. The
    endpoint has no authentication (its values are counts, never request content): bind it
    beyond loopback only on a network the operator trusts."""
    try:
        from prometheus_client import start_http_server
    except ImportError:
        raise api.InvalidRequest(
            "--metrics-listen needs prometheus_client: python3 -m pip install "
            "'shard-engine-remote[metrics]' (or: python3 -m pip install prometheus-client)"
        ) from None
    host, separator, port = listen.rpartition(":")
    if not separator or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise api.InvalidRequest(f"--metrics-listen {listen!r} is not HOST:PORT")
    host = host.strip("[]")
    try:
        server, _ = start_http_server(int(port), addr=host, registry=collector_registry(served))
    except OSError as error:
        raise api.InvalidRequest(
            f"cannot listen on {listen} for metrics: {error.strerror or error}"
        ) from error
    shown = f"[{host}]" if ":" in host else host
    return MetricsEndpoint(f"{shown}:{server.server_address[1]}", server)
