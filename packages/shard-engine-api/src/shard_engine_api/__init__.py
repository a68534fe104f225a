"""shard-engine-api: the project-owned contract between worker code and shard engines.

Worker names live here. Engine authors import from :mod:`shard_engine_api.engine`; code that
moves objects between processes imports the codec from :mod:`shard_engine_api.wire`.

The modules, one line each (public namespaces first, then the private implementation):

- ``engine``: the names an engine author needs (core, hooks, discovery, model store, helpers);
- ``wire``: the names for moving contract objects between processes (codec, limits, checksum);
- ``conformance/``: the conformance suite, a pytest plugin (its own docstring maps it);
- ``cli``: the ``shard-engine`` command line's entry point;
- ``_cli/``: the command line's parts, one module per command (its docstring maps them);
- ``__main__``: ``python -m shard_engine_api``, the same command line;
- ``_types``: the msgspec types of the contract, with their explicit wire tags;
- ``_errors``: the typed error tree and its wire form (``ErrorInfo``);
- ``_protocol``: the ``ShardEngine`` protocol, what worker code may call;
- ``_typecheck``: the edge checks of every request's field types and ranges;
- ``_bundle_checks``: whether a bundle or logits payload is sound (header, checksum, finiteness);
- ``_checksum``: the xxh3-64 payload checksum and the scan marks;
- ``_dtypes``: boundary dtypes: payload layout, conversions, finiteness tests;
- ``_native``: the optional C extension (checksum and finiteness in one pass; ``_native.c``);
- ``_codec``: the msgpack wire codec, bounded decoding and verified payloads;
- ``_core``: ``EngineCore``, the session semantics every engine builds on;
- ``_steps``: the backend steps a request takes in the core (admit, run, commit);
- ``_backend``: what a backend and the core exchange (``ModelInfo``, ``ForwardItem``);
- ``_ledger``: the pure session ledger (epochs, lengths, slots, KV budget, LRU);
- ``_fences``: the compact tombstones of released and evicted sessions;
- ``_scheduler``: who runs on the backend next, and which decodes run together;
- ``_cancel``: cancellation tokens and their commit point;
- ``_inputs``: a request's inputs turned into backend rows;
- ``_results``: a backend's rows checked and turned into results;
- ``_snapshot``: session snapshots built, fingerprinted and verified;
- ``_lifecycle``: the engine lifecycle state machine;
- ``_metrics``: the counters behind ``metrics()``;
- ``_validation``: ``ValidatingEngine``, which checks every result an engine returns;
- ``_asyncio``: ``AsyncShardEngine``, an asyncio adapter over any engine;
- ``_pipeline``: ``Pipeline``, the one driver of engines in layer order;
- ``_stages``: many sessions through one pipeline at once (``generate_many``);
- ``_sampling``: greedy or seeded sampling of the next token;
- ``_hookspecs``: the ``shard_engine`` hook specification and what a plugin registers;
- ``_plugins``: plugin discovery and ``load_engine``;
- ``_store``: the model store and the one file-hash function.
"""

import logging as _logging

from shard_engine_api._asyncio import AsyncShardEngine
from shard_engine_api._errors import (
    CacheMiss,
    Cancelled,
    ChecksumMismatch,
    ContractVersionMismatch,
    EngineCrashed,
    ErrorDetail,
    ErrorInfo,
    InvalidRequest,
    MalformedOutput,
    NotReady,
    OutcomeUnknown,
    ResourceExhausted,
    ShardEngineError,
    ShardMismatch,
    StaleEpoch,
    Unauthenticated,
    UnsupportedFeature,
    WrongRole,
)
from shard_engine_api._hookspecs import ChatMessage, ChatTokenizer, Tokenizer
from shard_engine_api._pipeline import (
    FinishReason,
    GeneratedToken,
    GenerationResult,
    Pipeline,
    PipelineStep,
    ShardTimings,
    TokenStream,
    load_pipeline,
    split_layers,
)
from shard_engine_api._plugins import (
    InstalledEngine,
    UnknownEngine,
    installed_engines,
    load_engine,
    load_tokenizer,
)
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._sampling import GREEDY, Sampler, Sampling
from shard_engine_api._stages import (
    GenerationRequest,
    ManyGenerationResult,
    SessionGeneration,
    StageTimings,
)
from shard_engine_api._types import (
    CONTRACT_VERSION,
    AuxState,
    BoundaryBundle,
    BoundaryDtype,
    BoundaryResult,
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    Determinism,
    EvictionPolicy,
    EvidenceClass,
    ExportSessionRequest,
    Features,
    Health,
    HookStatus,
    ImportSessionRequest,
    ImportSessionResult,
    LifecycleState,
    Limits,
    LoadConfig,
    LogitsMode,
    LogitsResult,
    Metrics,
    MtpState,
    OptionValue,
    OutputKind,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    ReservedHooks,
    Role,
    SessionRef,
    SessionSnapshot,
    ShardInput,
    ShardResult,
    ShardSpec,
    Timings,
    TokenInput,
    Tolerance,
)
from shard_engine_api._validation import ValidatingEngine

__version__ = "0.1.0"

# Silent unless the application configures logging (``shard-engine -v`` does).
_logging.getLogger("shard_engine").addHandler(_logging.NullHandler())

__all__ = [
    "CONTRACT_VERSION",
    "GREEDY",
    "AsyncShardEngine",
    "AuxState",
    "BoundaryBundle",
    "BoundaryDtype",
    "BoundaryResult",
    "CacheMiss",
    "CancelRequest",
    "CancelResult",
    "Cancelled",
    "Capabilities",
    "ChatMessage",
    "ChatTokenizer",
    "ChecksumMismatch",
    "ContractVersionMismatch",
    "DecodeBatchRequest",
    "DecodeBatchResult",
    "DecodeRequest",
    "Determinism",
    "EngineCrashed",
    "ErrorDetail",
    "ErrorInfo",
    "EvictionPolicy",
    "EvidenceClass",
    "ExportSessionRequest",
    "Features",
    "FinishReason",
    "GeneratedToken",
    "GenerationRequest",
    "GenerationResult",
    "Health",
    "HookStatus",
    "ImportSessionRequest",
    "ImportSessionResult",
    "InstalledEngine",
    "InvalidRequest",
    "LifecycleState",
    "Limits",
    "LoadConfig",
    "LogitsMode",
    "LogitsResult",
    "MalformedOutput",
    "ManyGenerationResult",
    "Metrics",
    "MtpState",
    "NotReady",
    "OptionValue",
    "OutcomeUnknown",
    "OutputKind",
    "Pipeline",
    "PipelineStep",
    "PrefillRequest",
    "ReleaseRequest",
    "ReleaseResult",
    "ReservedHooks",
    "ResourceExhausted",
    "Role",
    "Sampler",
    "Sampling",
    "SessionGeneration",
    "SessionRef",
    "SessionSnapshot",
    "ShardEngine",
    "ShardEngineError",
    "ShardInput",
    "ShardMismatch",
    "ShardResult",
    "ShardSpec",
    "ShardTimings",
    "StageTimings",
    "StaleEpoch",
    "Timings",
    "TokenInput",
    "TokenStream",
    "Tokenizer",
    "Tolerance",
    "Unauthenticated",
    "UnknownEngine",
    "UnsupportedFeature",
    "ValidatingEngine",
    "WrongRole",
    "__version__",
    "installed_engines",
    "load_engine",
    "load_pipeline",
    "load_tokenizer",
    "split_layers",
]
