"""shard-engine-llama: a llama.cpp-backed ShardEngine that runs GGUF layer ranges exactly.

The engine names load llama.cpp on first use, so that discovering the plugin (every
``shard-engine`` command, every conformance run of another engine) does not import it. The
shard builder is public and needs no llama.cpp: :func:`inspect_gguf` describes a model and its
shardability, :func:`parts_by_bytes` plans balanced ranges, :func:`split_model` writes the shard
files and their :class:`Manifest`; :func:`write_tiny_model` generates small deterministic models
of every supported family; :func:`threading_report` says which OpenMP spin setting applies
and where llama_decode runs.

The modules, one line each:

- ``plugin``: the ``llama`` entry point: its registration hook and what its description names;
- ``_engine``: ``LlamaEngine``, the core's backend steps over one llama.cpp context per shard;
- ``_abi``: ``ShardRuntime``, the only caller of llama.cpp (batches, eval callback, abort);
- ``_llama_library``: llama.cpp loaded once per process, pinned to one bindings release;
- ``_runtime_inputs``: what a ``ShardRuntime`` takes (context settings, rows, outputs);
- ``_self_test``: the start-up self-test: a split must reproduce unsplit logits;
- ``_state``: the byte layout of one sequence's KV state, checked before llama.cpp reads it;
- ``_determinism``: what the engine declares about its results (split-exact, tolerances);
- ``_options``: the engine's load options and their checks;
- ``_memory``: whether a shard's context fits llama.cpp's limits and this machine;
- ``_threading``: OpenMP spin-wait, thread count and affinity defaults;
- ``_shard_files``: which file a shard loads, and the proof that it is the right one;
- ``_sealed``: a private, sealed copy of a shard file for llama.cpp to map;
- ``_vocabulary``: a model's tokenizer through llama.cpp (vocabulary only);
- ``_chat``: chat prompts from the template a GGUF stores (``tokenizer.chat_template``);
- ``_commands``: ``shard-engine split`` and ``shard-engine inspect``;
- ``_fixtures``: the generated tiny model the suite, ``run`` and tests use;
- ``_tiny_model``: deterministic tiny GGUF models of every supported family;
- ``_reference``: a float64 numpy forward pass, an oracle independent of llama.cpp;
- ``_native``: the optional C eval and abort callbacks (``_native.c``), loaded with ctypes;
- ``_gguf/``: GGUF files without llama.cpp: reading, validation, planning, writing (its
  docstring maps it).
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
