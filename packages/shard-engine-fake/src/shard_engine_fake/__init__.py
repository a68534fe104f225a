"""shard-engine-fake: a deterministic ShardEngine with fault injection, for testing worker code
with no model, no GPU and no downloads.

The modules, one line each:

- ``plugin``: the ``fake`` entry point: its registration hook, model fixtures and tokenizer;
- ``pipeline``: short names over the API's pipeline driver (one step, greedy generation);
- ``_engine``: ``FakeEngine``, the fake model behind ``EngineCore``, with its fault plan;
- ``_model``: the deterministic model: exact integer arithmetic on lane-packed integers;
- ``_faults``: the declarative fault plan and the injector that decides which faults fire;
- ``_corrupt``: malformed-output faults, each turning a sound result into one that breaks the
  contract in one way;
- ``_tokenizer``: the fake model's byte-level tokenizer.
"""

from shard_engine_fake._corrupt import corrupt_result
from shard_engine_fake._engine import ENGINE_VERSION, FakeEngine
from shard_engine_fake._faults import (
    FAULTS_ENV_VAR,
    Crash,
    Defect,
    Delay,
    FaultAction,
    FaultEvent,
    FaultPlan,
    FaultRule,
    Malformed,
    MemoryPressure,
    MemoryRelief,
    Operation,
    StateFailure,
    fault_plan_from_options,
    load_fault_plan,
)
from shard_engine_fake._model import (
    DEFAULT_MODEL,
    FakeModelSpec,
    parse_model_reference,
    resolve_model,
)
from shard_engine_fake._tokenizer import detokenize, tokenize

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "ENGINE_VERSION",
    "FAULTS_ENV_VAR",
    "Crash",
    "Defect",
    "Delay",
    "FakeEngine",
    "FakeModelSpec",
    "FaultAction",
    "FaultEvent",
    "FaultPlan",
    "FaultRule",
    "Malformed",
    "MemoryPressure",
    "MemoryRelief",
    "Operation",
    "StateFailure",
    "__version__",
    "corrupt_result",
    "detokenize",
    "fault_plan_from_options",
    "load_fault_plan",
    "parse_model_reference",
    "resolve_model",
    "tokenize",
]
