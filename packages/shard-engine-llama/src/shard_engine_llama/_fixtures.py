"""The generated tiny model the conformance suite, the ``run`` command and tests use."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Final

from shard_engine_api import InvalidRequest

TINY_MODEL_LAYERS: Final = 6
_TINY_SEED: Final = 7


def tiny_model_path(workdir: Path) -> Path:
    """Generate (once; the generator is deterministic) the default tiny llama model.

    Raises InvalidRequest naming the directory when it cannot be written (a model store that
    is a file, read-only or on a pseudo-filesystem)."""
    from shard_engine_llama._tiny_model import write_tiny_model

    path = workdir / f"tiny-llama-{TINY_MODEL_LAYERS}l-64d-f32-s{_TINY_SEED}.gguf"
    if path.is_file():
        return path
    # Per process and thread: two writers of one store never share a partial file.
    partial = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.partial")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        write_tiny_model(partial, n_layers=TINY_MODEL_LAYERS, seed=_TINY_SEED, dtype="f32")
        os.replace(partial, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise InvalidRequest(
            f"cannot write the generated tiny model into {workdir}: "
            f"{error.strerror or error} ({error.filename or workdir})",
            details={"path": str(workdir)},
        ) from error
    return path
