"""The model store (where engines write generated models and shard files) and the one file-hash
helper every package uses.

The store is ``$SHARD_ENGINE_MODEL_STORE`` or ``~/.cache/shard-engine``. Directories under
``/home`` are refused: model files are large, and home directories are often small, synced or
backed up, so a store there must never be chosen by accident. Resolving the store creates nothing;
whoever writes into it creates what it writes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Final

from shard_engine_api._errors import InvalidRequest

__all__ = [
    "DEFAULT_MODEL_STORE",
    "MODEL_STORE_ENV",
    "ModelStoreRefused",
    "file_sha256",
    "model_store",
]

MODEL_STORE_ENV: Final = "SHARD_ENGINE_MODEL_STORE"
DEFAULT_MODEL_STORE: Final = "~/.cache/shard-engine"
_REFUSED_ROOT: Final = Path("/home")
_HASH_CHUNK_BYTES: Final = 16 * 1024 * 1024


class ModelStoreRefused(InvalidRequest):
    """Raised by :func:`model_store` for a directory under ``/home``; the message names the
    directory, where it came from, and how to choose another one."""

    code = "model_store_refused"


def unchecked_model_store() -> Path:
    """Where :func:`model_store` points without an explicit path, before the ``/home`` check:
    what a caller passes on to an engine that may never write anything (the engine checks it
    with ``model_store(path)`` before writing)."""
    return _candidate(None)[0]


def _candidate(explicit: str | os.PathLike[str] | None) -> tuple[Path, str]:
    if explicit is not None and str(explicit):
        return Path(explicit).expanduser().resolve(), "an explicit path"
    from_env = os.environ.get(MODEL_STORE_ENV)
    if from_env:
        return Path(from_env).expanduser().resolve(), MODEL_STORE_ENV
    return Path(DEFAULT_MODEL_STORE).expanduser().resolve(), f"the default {DEFAULT_MODEL_STORE}"


def model_store(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The model store directory, resolved to an absolute path (not created).

    ``explicit`` wins (an engine option, a ``--workdir``), then ``$SHARD_ENGINE_MODEL_STORE``,
    then ``~/.cache/shard-engine``. Raises :class:`ModelStoreRefused` when the directory is
    under ``/home``.
    """
    path, source = _candidate(explicit)
    if path == _REFUSED_ROOT or _REFUSED_ROOT in path.parents:
        raise ModelStoreRefused(
            f"model store {path} (from {source}) is under /home; set {MODEL_STORE_ENV} "
            "(or pass a directory) outside /home",
            details={"path": str(path), "source": source},
        )
    return path


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The hex sha256 of a file's bytes, read in chunks (model files do not fit in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
