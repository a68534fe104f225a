"""`serve --metrics-listen`: the request latency histograms. A scrape after N calls of each
operation shows each histogram's ``_count`` moved by exactly N and its ``_sum`` by no more than
the wall time the client spent on those calls (the server's part of a call lies inside the
client's; both clocks are the monotonic one), over each transport."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from conftest import RemoteFactory, ServeFactory, config, decode, prefill, ref
from prometheus_client.parser import text_string_to_metric_families

import shard_engine_api as api
from shard_engine_remote._latency import LATENCY_BUCKETS_S, OPERATIONS
from shard_engine_remote._prometheus import MetricsEndpoint, start_metrics_endpoint

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
CALLS = "shard_engine_server_call_duration_seconds"
WAITS = "shard_engine_server_queue_wait_seconds"
N = 3


def _scrape(endpoint: MetricsEndpoint) -> Samples:
    with urllib.request.urlopen(f"http://{endpoint.address}/metrics", timeout=30) as answer:
        text = answer.read().decode("utf-8")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _moved(before: Samples, after: Samples, name: str, operation: str) -> tuple[float, float]:
    """How far a histogram's ``_count`` and ``_sum`` moved between two scrapes."""
    key = (("operation", operation),)
    return (
        after[(f"{name}_count", key)] - before[(f"{name}_count", key)],
        after[(f"{name}_sum", key)] - before[(f"{name}_sum", key)],
    )


@pytest.fixture
def endpoints() -> Iterator[list[MetricsEndpoint]]:
    started: list[MetricsEndpoint] = []
    yield started
    for endpoint in started:
        endpoint.stop()


def test_each_operations_histograms_move_by_the_calls_made(
    serve: ServeFactory,
    remote: RemoteFactory,
    endpoints: list[MetricsEndpoint],
    transport: str,
) -> None:
    """Sessions move from one server to another (the second one's scrape shows the
    imports); every other call goes to the first."""
    server, target = serve(transport=transport), serve(transport=transport)
    endpoints.append(start_metrics_endpoint("127.0.0.1:0", server))
    endpoints.append(start_metrics_endpoint("127.0.0.1:0", target))
    engine = remote(config(target=server.address, transport=transport))
    receiver = remote(config(target=target.address, transport=transport))
    sessions = [f"s{index}" for index in range(N)]
    for session in sessions:
        prefill(engine, session=f"warm-{session}")

    def decode_batch(step: int) -> None:
        items = tuple(
            api.DecodeRequest(
                request_id=f"b{step}-{session}",
                session=ref(session),
                pos=4 + step,
                inputs=api.TokenInput(token_ids=(step + 1,)),
            )
            for session in sessions
        )
        result = engine.decode_batch(api.DecodeBatchRequest(request_id=f"b{step}", items=items))
        assert all(not isinstance(item, api.ErrorInfo) for item in result.items), result

    snapshots: list[api.SessionSnapshot] = []

    def export(index: int) -> None:
        request = api.ExportSessionRequest(request_id=f"e{index}", session=ref(sessions[index]))
        snapshots.append(engine.export_session(request))

    def import_(index: int) -> None:
        request = api.ImportSessionRequest(request_id=f"i{index}", snapshot=snapshots[index])
        assert receiver.import_session(request).length == 4 + N

    operations: list[tuple[str, Callable[[int], object]]] = [
        ("prefill", lambda index: prefill(engine, session=sessions[index])),
        ("decode", lambda index: decode(engine, 3, session=sessions[index], request_id="d")),
        ("decode_batch", decode_batch),
        ("export", export),
        ("import", import_),
        (
            "release",
            lambda index: engine.release(api.ReleaseRequest(session=ref(f"warm-s{index}"))),
        ),
        ("cancel", lambda index: engine.cancel(api.CancelRequest(request_id=f"gone-{index}"))),
    ]
    for operation, call in operations:
        endpoint = endpoints[1 if operation == "import" else 0]
        before = _scrape(endpoint)
        started = time.perf_counter()
        for index in range(N):
            call(index)
        wall = time.perf_counter() - started
        after = _scrape(endpoint)
        count, total = _moved(before, after, CALLS, operation)
        assert count == N, operation
        assert 0 < total <= wall, (operation, total, wall)
        if operation in ("prefill", "decode", "decode_batch", "export", "import"):
            count, total = _moved(before, after, WAITS, operation)
            assert count == N, operation
            assert 0 <= total <= wall, (operation, total, wall)
        buckets = {
            float(dict(labels)["le"]): value
            for (name, labels), value in after.items()
            if name == f"{CALLS}_bucket" and ("operation", operation) in labels
        }
        assert sorted(buckets) == [*LATENCY_BUCKETS_S, float("inf")]
        assert buckets[float("inf")] == after[(f"{CALLS}_count", (("operation", operation),))]


def test_every_operation_is_exported_from_the_start(
    serve: ServeFactory, endpoints: list[MetricsEndpoint]
) -> None:
    """Before any call each operation's histograms are there, at zero (a rate over the series
    counts the first calls too)."""
    endpoints.append(start_metrics_endpoint("127.0.0.1:0", serve()))
    samples = _scrape(endpoints[0])
    for operation in OPERATIONS:
        assert samples[(f"{CALLS}_count", (("operation", operation),))] == 0
    for operation in ("prefill", "decode", "decode_batch", "export", "import"):
        assert samples[(f"{WAITS}_count", (("operation", operation),))] == 0
