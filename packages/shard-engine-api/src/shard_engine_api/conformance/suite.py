"""The standard suite as a collectable test module, run against the engine ``--shard-engine``
names::

    pytest --shard-engine NAME
    pytest --shard-engine NAME --pyargs shard_engine_api.conformance.suite

Without ``--shard-engine`` every test here is skipped with that reason.
"""

from __future__ import annotations

from shard_engine_api.conformance._base import ShardEngineConformance

__all__ = ["TestShardEngine"]


class TestShardEngine(ShardEngineConformance):
    """The standard conformance suite against the engine selected by ``--shard-engine``."""
