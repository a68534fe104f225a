"""The model-based standard tests: random call sequences on a full shard and on shards of every
role, each step checked against the reference model (:mod:`._stateful` runs the state machine
of :mod:`._machine` beside the model of :mod:`._model`). :class:`ShardEngineConformance`
inherits them; their names are pinned in :data:`MODEL_BASED_TESTS`, part of the standard
tests.
"""

from __future__ import annotations

import itertools
import time
from typing import Final

import pytest

from shard_engine_api._types import EvictionPolicy
from shard_engine_api.conformance._harness import SuiteHelpers, split_ranges
from shard_engine_api.conformance._stateful import (
    DEEP_EXAMPLES,
    DEFAULT_EXAMPLES,
    MachineConfig,
    run_machine,
    upstream_limits,
)

__all__ = ["MODEL_BASED_TESTS", "ModelBasedTests"]

MODEL_BASED_TESTS: Final[tuple[str, ...]] = (
    "test_state_machine_every_role",
    "test_state_machine_full_shard",
)
"""The tests of this module, sorted (part of STANDARD_TESTS)."""

_EVICTION_POLICIES: Final[tuple[EvictionPolicy, ...]] = ("reject", "lru")


class ModelBasedTests(SuiteHelpers):
    """The model-based standard tests (module docstring)."""

    def test_state_machine_full_shard(self, request: pytest.FixtureRequest) -> None:
        """Model-based: random sequences of prefill, truncation, decode, decode_batch (with
        duplicate sessions and mixed errors), release, cancel, newer and huge (>= 2**40)
        epochs and LRU eviction over several sessions (long ids sharing a prefix) on a full
        shard, with eviction "reject" and "lru". After every step the outcome (error code,
        CacheMiss committed_length and reason), the committed lengths, health and metrics
        must equal the reference model's, and every output a fresh replay of the session's
        history. A failure prints the shrunk call sequence.

        Fix: follow the session semantics of ARCHITECTURE.md as the message says; build on
        EngineCore, which keeps them."""
        h = self.harness
        n = h.n_layers
        deep = _deep(request)
        examples = self._examples(request)
        for eviction in _EVICTION_POLICIES:
            replay = h.load(0, n, **upstream_limits(deep))
            run_machine(
                h,
                MachineConfig(start=0, end=n, n_layers=n, dtype="f32", eviction=eviction),
                examples=examples,
                upstream=None,
                replay=replay,
                shrink=not request.config.getoption("shard_engine_no_shrink", default=False),
                deep=deep,
            )

    def test_state_machine_every_role(self, request: pytest.FixtureRequest) -> None:
        """Model-based, as the full-shard test, on a head, a middle and a tail shard and with
        every boundary dtype the engine advertises (f16 included): non-head inputs are the
        rows of a fresh upstream shard run over the session's tokens.

        Fix: the session semantics do not depend on the role; a shard that takes or emits
        bundles must truncate, fence epochs, evict and roll back as a full one does."""
        h = self.harness
        self._need_layers(2, "shards of every role")
        n = h.n_layers
        splits = self._split_boundaries()
        boundaries = next(
            (split for split in splits if len(split) >= 4),
            (0, *(end for _start, end in split_ranges(n, 3 if n >= 3 else 2))),
        )
        ranges = list(itertools.pairwise(boundaries))
        if len(ranges) > 3:
            ranges = [ranges[0], ranges[1], ranges[-1]]
        dtypes = h.load(*ranges[0]).capabilities().boundary_dtypes
        policies = itertools.cycle(_EVICTION_POLICIES)
        deep = _deep(request)
        examples = max(1, self._examples(request, budget_s=6.0) // 2)
        for start, end in ranges:
            for dtype in dtypes:
                upstream = (
                    h.load(0, start, boundary_dtype=dtype, **upstream_limits(deep))
                    if start > 0
                    else None
                )
                replay = h.load(start, end, boundary_dtype=dtype, **upstream_limits(deep))
                run_machine(
                    h,
                    MachineConfig(
                        start=start, end=end, n_layers=n, dtype=dtype, eviction=next(policies)
                    ),
                    examples=examples,
                    upstream=upstream,
                    replay=replay,
                    shrink=not request.config.getoption("shard_engine_no_shrink", default=False),
                    deep=deep,
                )

    def _examples(self, request: pytest.FixtureRequest, budget_s: float = 12.0) -> int:
        """Examples per configuration of the model-based test: ``--shard-engine-examples``
        when given; else the default, fewer for a slow engine so that one configuration stays
        within about ``budget_s`` seconds (never fewer than 2)."""
        value = request.config.getoption("shard_engine_examples", default=None)
        if value is not None:
            return max(1, int(value))
        if request.config.getoption("shard_engine_profile", default="default") == "deep":
            return DEEP_EXAMPLES
        h = self.harness
        started = time.perf_counter()
        engine = h.load()
        session = h.session("probe")
        h.prefill(engine, session, 0, h.tokens(4, seed=1))
        for pos in range(4, 8):
            h.decode(engine, session, pos, (1,))
        engine.close()
        # An example is a fresh engine and about 24 steps, each with a replay: ~6 probes.
        per_example = 6.0 * (time.perf_counter() - started)
        return max(2, min(DEFAULT_EXAMPLES, int(budget_s / max(per_example, 1e-6))))


def _deep(request: pytest.FixtureRequest) -> bool:
    """Whether ``--shard-engine-profile deep`` asks the model-based tests to reach further."""
    return bool(request.config.getoption("shard_engine_profile", default="default") == "deep")
