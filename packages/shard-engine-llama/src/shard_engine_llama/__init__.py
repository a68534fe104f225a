"""shard-engine-llama: a llama.cpp-backed ShardEngine that runs GGUF layer ranges exactly."""

from shard_engine_llama._engine import ENGINE_VERSION, LlamaEngine, LlamaOptions

__all__ = ["ENGINE_VERSION", "LlamaEngine", "LlamaOptions"]
