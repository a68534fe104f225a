"""shard-engine-llama: a llama.cpp-backed ShardEngine that runs GGUF layer ranges exactly.

Besides the engine, the shard builder is public: :func:`inspect_gguf` describes a model and its
shardability, :func:`parts_by_bytes` plans balanced ranges, :func:`split_model` writes the shard
files and their :class:`Manifest`.
"""

from shard_engine_llama._engine import ENGINE_VERSION, LlamaEngine, LlamaOptions
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

__all__ = [
    "ENGINE_VERSION",
    "GGUFModelInfo",
    "GGUFValidationError",
    "LlamaEngine",
    "LlamaOptions",
    "Manifest",
    "ShardFile",
    "ShardingRefusedError",
    "SplitProgress",
    "inspect_gguf",
    "parts_by_bytes",
    "split_model",
]
