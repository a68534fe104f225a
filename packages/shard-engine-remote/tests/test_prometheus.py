"""`serve --metrics-listen`: a Prometheus scrape of a served engine shows its counters moving
with the calls made (parsed with prometheus_client's own parser)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from conftest import RemoteFactory, ServeFactory, config, decode, prefill
from prometheus_client.parser import text_string_to_metric_families

import shard_engine_api as api
from shard_engine_remote._prometheus import MetricsEndpoint, start_metrics_endpoint


def _scrape(endpoint: MetricsEndpoint) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{endpoint.address}/metrics", timeout=30) as answer:
        text = answer.read().decode("utf-8")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture
def endpoints() -> Iterator[list[MetricsEndpoint]]:
    started: list[MetricsEndpoint] = []
    yield started
    for endpoint in started:
        endpoint.stop()


def test_a_scrape_shows_the_counters_moving_with_the_calls(
    serve: ServeFactory, remote: RemoteFactory, endpoints: list[MetricsEndpoint]
) -> None:
    server = serve()
    endpoints.append(start_metrics_endpoint("127.0.0.1:0", server))
    before = _scrape(endpoints[0])
    assert before[("shard_engine_requests_total", ())] == 0
    assert before[("shard_engine_state", (("state", "ready"),))] == 1
    assert before[("shard_engine_state", (("state", "closed"),))] == 0

    engine = remote(config(target=server.address))
    prefill(engine)
    decode(engine, 3)
    with pytest.raises(api.CacheMiss):
        decode(engine, 9, request_id="d2")  # out of step: an error callers received

    after = _scrape(endpoints[0])
    assert after[("shard_engine_requests_total", ())] == 3
    assert after[("shard_engine_prefill_requests_total", ())] == 1
    assert after[("shard_engine_decode_requests_total", ())] == 2
    assert after[("shard_engine_prefill_tokens_total", ())] == 3
    assert after[("shard_engine_errors_total", (("code", "cache_miss"),))] == 1
    assert after[("shard_engine_sessions_active", ())] == 1
    assert after[("shard_engine_health_sessions", ())] == 1
    assert after[("shard_engine_health_kv_used_tokens", ())] == 4
    assert (
        after[("shard_engine_server_calls_total", ())]
        > before[("shard_engine_server_calls_total", ())]
    )
    # Each scrape reads the engine now: the values equal its own metrics.
    metrics = server.engine.metrics()
    assert after[("shard_engine_decode_tokens_total", ())] == metrics.decode_tokens


def test_a_bad_or_busy_metrics_address_is_an_invalid_request(
    serve: ServeFactory, endpoints: list[MetricsEndpoint]
) -> None:
    server = serve()
    with pytest.raises(api.InvalidRequest, match="is not HOST:PORT"):
        start_metrics_endpoint("7450", server)
    endpoints.append(start_metrics_endpoint("127.0.0.1:0", server))
    with pytest.raises(api.InvalidRequest, match=r"cannot listen on .* for metrics"):
        start_metrics_endpoint(endpoints[0].address, server)
