"""The model-based conformance test: runs the state machine of :mod:`._machine` (the engine
under test and the reference model of :mod:`._model` side by side) on one shard configuration.

The machine is a module-level hypothesis ``RuleBasedStateMachine`` that takes a
:class:`MachineContext` (engine supply, profile, replay and upstream shards); each of its steps
is a ``hypothesis.note``, so a failure reads as the numbered calls of the (shrunk) example, the
expectation, what came, and a "Fix:" hint. hypothesis is imported only when a machine runs: the
rest of the suite does not need it.
"""

from __future__ import annotations

from typing import Final, cast

from shard_engine_api._protocol import ShardEngine
from shard_engine_api.conformance._harness import Harness
from shard_engine_api.conformance._machine_context import (
    MachineConfig,
    MachineContext,
    machine_limits,
    upstream_limits,
)

__all__ = [
    "DEEP_EXAMPLES",
    "DEFAULT_EXAMPLES",
    "MachineConfig",
    "machine_limits",
    "run_machine",
    "upstream_limits",
]

DEFAULT_EXAMPLES: Final = 8
"""Examples per shard configuration by default (``--shard-engine-examples N`` for more)."""
DEEP_EXAMPLES: Final = 48
"""Examples per shard configuration in the deep profile (unless --shard-engine-examples)."""


def run_machine(
    harness: Harness,
    config: MachineConfig,
    *,
    examples: int,
    upstream: ShardEngine | None,
    replay: ShardEngine,
    shrink: bool = True,
    deep: bool = False,
) -> None:
    """Run the state machine on ``config`` for ``examples`` examples (derandomized); a
    failure is shrunk to a short call sequence unless ``shrink`` is false."""
    try:
        from hypothesis import HealthCheck, Phase, Verbosity, settings
        from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise AssertionError(
            "the model-based conformance test needs hypothesis: pip install 'hypothesis>=6.100'"
        ) from error
    from shard_engine_api.conformance._machine import ConformanceMachine, DeepConformanceMachine

    context = MachineContext.create(harness, config, upstream=upstream, replay=replay, deep=deep)
    machine = DeepConformanceMachine if deep else ConformanceMachine
    phases = (Phase.explicit, Phase.generate) + ((Phase.shrink,) if shrink else ())
    # hypothesis calls its first argument as a factory (a class is one); its annotation
    # names only the class. Derandomized examples follow from the factory's source (hypothesis
    # hashes it), so editing the rules does not reshuffle which examples run.
    factory = cast("type[RuleBasedStateMachine]", lambda: machine(context))
    run_state_machine_as_test(
        factory,
        settings=settings(
            max_examples=examples,
            stateful_step_count=context.profile.steps,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            phases=phases,
            report_multiple_bugs=False,
            # Normal verbosity prints nothing for a passing run; for a failing one it attaches
            # the example's steps (and the machine's notes) to the error.
            verbosity=Verbosity.normal,
            print_blob=False,
        ),
    )
