"""shard-engine-llama: a llama.cpp-backed ShardEngine that runs GGUF layer ranges exactly.

Besides the engine, the shard builder is public: :func:`inspect_gguf` describes a model and its
shardability, :func:`parts_by_bytes` plans balanced ranges, :func:`split_model` writes the shard
files and their :class:`Manifest`.

The engine names load llama.cpp on first use, so that discovering the plugin (every
``shard-engine`` command, every conformance run of another engine) does not import it; the
shard builder does not need llama.cpp and is imported eagerly.
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

if TYPE_CHECKING:
    from shard_engine_llama._engine import ENGINE_VERSION, LlamaEngine, LlamaOptions

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

_ENGINE_NAMES = frozenset({"ENGINE_VERSION", "LlamaEngine", "LlamaOptions"})


def __getattr__(name: str) -> object:
    if name in _ENGINE_NAMES:
        from shard_engine_llama import _engine

        return getattr(_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
