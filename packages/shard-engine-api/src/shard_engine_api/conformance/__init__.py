"""The ShardEngine conformance suite: a pytest plugin and a base class engines subclass.

Run the standard suite against an installed engine (see :mod:`.plugin` for every option)::

    pytest --shard-engine fake --shard-engine-report conformance.json

or subclass it in an engine's own tests::

    from shard_engine_api.conformance import ShardEngineConformance

    class TestMyEngine(ShardEngineConformance):
        engine_name = "mine"

The modules of this package:

- ``plugin``: the pytest plugin (``--shard-engine`` and its options, the JSON report).
- ``suite``: ``TestShardEngine``, the standard suite as a collectable test module.
- ``_base``: ``ShardEngineConformance`` (the test mixins composed), ``STANDARD_TESTS``, the
  override guard and the engine supply.
- ``_harness``: what the tests are written with: ``Harness``, output comparison, cancelling
  threads, and ``SuiteHelpers`` and the private helpers every test module shares.
- ``_lifecycle``: load, close, health states, capabilities, metrics, a permanent crash.
- ``_error_checks``: the error taxonomy on every path: refused requests, bundle checks,
  retryable flags, atomic failures.
- ``_sessions``: truncation, epochs and fences, release, isolation, session ids.
- ``_limits``: max_context, max_batch_tokens, max_sessions, the KV budget, LRU eviction.
- ``_cancellation``: cancels by request and session id, their latency, requests in flight.
- ``_batching``: ``decode_batch`` against single decodes, item errors, budget and LRU order.
- ``_numerics``: determinism, split invariance, chunks, boundary dtypes, finite outputs.
- ``_results``: result fields, evidence class, timings, the wire round trip.
- ``_model_based``: the two model-based tests (on a full shard, on every role).
- ``_concurrency``: many threads and sessions, starvation, queued cancels.
- ``_migration``: session export and import.
- ``_scale``: the paths small cases miss: evicted sessions moved, bf16 rounding, ids past the
  limit, reused ids, timings of batches and imports, refused loads and newer epochs.
- ``_stateful``: runs the model-based state machine on one shard configuration.
- ``_machine``: the hypothesis state machine that drives engine and model side by side.
- ``_machine_context``: the machine's configuration, profile, shared context and history.
- ``_model``: the reference model of the session semantics.
- ``_recorder``: what a run observed of each suite class, for the report.
- ``_report``: the report's typed structs, model hashing and certification.
- ``_provenance``: where a model file comes from, read from its GGUF metadata.
- ``_arguments``: the ``pytest.main`` arguments of a conformance run.
"""

from shard_engine_api.conformance._arguments import pytest_arguments
from shard_engine_api.conformance._base import (
    STANDARD_TESTS,
    ShardEngineConformance,
    conformance_override,
)
from shard_engine_api.conformance._harness import EngineUnderTest, Harness
from shard_engine_api.conformance._report import (
    Certification,
    ConformanceReport,
    EnvironmentReport,
    ModelReport,
    OverrideRecord,
    TestOutcome,
    TestResult,
    Totals,
)

__all__ = [
    "STANDARD_TESTS",
    "Certification",
    "ConformanceReport",
    "EngineUnderTest",
    "EnvironmentReport",
    "Harness",
    "ModelReport",
    "OverrideRecord",
    "ShardEngineConformance",
    "TestOutcome",
    "TestResult",
    "Totals",
    "conformance_override",
    "pytest_arguments",
]
