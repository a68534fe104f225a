"""shard-engine-llama: a llama.cpp-backed ShardEngine that runs GGUF layer ranges exactly.

The engine names load llama.cpp on first use, so that discovering the plugin (every
``shard-engine`` command, every conformance run of another engine) does not import it.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shard_engine_llama._engine import ENGINE_VERSION, LlamaEngine, LlamaOptions

__all__ = ["ENGINE_VERSION", "LlamaEngine", "LlamaOptions"]

_ENGINE_NAMES = frozenset({"ENGINE_VERSION", "LlamaEngine", "LlamaOptions"})


def __getattr__(name: str) -> object:
    if name in _ENGINE_NAMES:
        from shard_engine_llama import _engine

        return getattr(_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
