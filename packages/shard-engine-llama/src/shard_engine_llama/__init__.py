"""shard-engine-llama: a llama.cpp-backed ShardEngine that runs GGUF layer ranges exactly.

The engine names load llama.cpp on first use, so that discovering the plugin (every
``shard-engine`` command, every conformance run of another engine) does not import it. The
shard builder is public and needs no llama.cpp: :func:`inspect_gguf` describes a model and its
shardability, :func:`parts_by_bytes` plans balanced ranges, :func:`split_model` writes the shard
files and their :class:`Manifest`; :func:`write_tiny_model` generates small deterministic models
of every supported family; :func:`threading_report` says which OpenMP spin setting applies
and where llama_decode runs.
"""

from typing import TYPE_CHECKING

from shard_engine_llama._gguf import (
    GGUFModelInfo,
    GGUFValidationError,
    Manifest,
    ShardFile,
    ShardingRefusedError,
    SplitProgress,
    inspect_gguf,
    parts_by_bytes,
    split_model,
)
from shard_engine_llama._threading import (
    COMPUTE_THREADS_ENV,
    DEFAULT_SPIN_COUNT,
    SPIN_COUNT_ENV,
    WAIT_POLICY_ENV,
    threading_report,
)
from shard_engine_llama._tiny_model import TinyModelConfig, write_tiny_model

if TYPE_CHECKING:
    from shard_engine_llama._engine import ENGINE_VERSION, LlamaEngine, LlamaOptions

__all__ = [
    "COMPUTE_THREADS_ENV",
    "DEFAULT_SPIN_COUNT",
    "ENGINE_VERSION",
    "SPIN_COUNT_ENV",
    "WAIT_POLICY_ENV",
    "GGUFModelInfo",
    "GGUFValidationError",
    "LlamaEngine",
    "LlamaOptions",
    "Manifest",
    "ShardFile",
    "ShardingRefusedError",
    "SplitProgress",
    "TinyModelConfig",
    "inspect_gguf",
    "parts_by_bytes",
    "split_model",
    "threading_report",
    "write_tiny_model",
]

_ENGINE_NAMES = frozenset({"ENGINE_VERSION", "LlamaEngine", "LlamaOptions"})


def __getattr__(name: str) -> object:
    if name in _ENGINE_NAMES:
        from shard_engine_llama import _engine

        return getattr(_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
