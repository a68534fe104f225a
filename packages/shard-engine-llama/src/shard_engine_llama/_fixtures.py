"""The generated tiny model the conformance suite, the ``run`` command and tests use."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

TINY_MODEL_LAYERS: Final = 6
_TINY_SEED: Final = 7


def tiny_model_path(workdir: Path) -> Path:
    """Generate (once; the generator is deterministic) the default tiny llama model."""
    from shard_engine_llama._tiny_model import write_tiny_model

    path = workdir / f"tiny-llama-{TINY_MODEL_LAYERS}l-64d-f32-s{_TINY_SEED}.gguf"
    if not path.is_file():
        workdir.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        write_tiny_model(partial, n_layers=TINY_MODEL_LAYERS, seed=_TINY_SEED, dtype="f32")
        os.replace(partial, path)
    return path
