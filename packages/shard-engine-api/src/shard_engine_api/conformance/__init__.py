"""The ShardEngine conformance suite: a pytest plugin and a base class engines subclass.

Run the standard suite against an installed engine (see :mod:`.plugin` for every option)::

    pytest --shard-engine fake --shard-engine-report conformance.json

or subclass it in an engine's own tests::

    from shard_engine_api.conformance import ShardEngineConformance

    class TestMyEngine(ShardEngineConformance):
        engine_name = "mine"
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
