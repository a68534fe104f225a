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
import re
import tempfile
from pathlib import Path
from typing import Final

from shard_engine_api._errors import InvalidRequest

__all__ = [
    "DEFAULT_MODEL_STORE",
    "MODEL_STORE_ENV",
    "ModelStoreRefused",
    "file_sha256",
    "model_store",
    "portable_path",
    "portable_text",
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
    if explicit is not None:
        given: object = explicit
        if not isinstance(given, str | os.PathLike) or isinstance(os.fspath(given), bytes):
            raise InvalidRequest(
                f"a model store must be a directory path (str), got {type(given).__name__}"
            )
        if str(explicit):
            return _resolved(str(explicit), "an explicit path"), "an explicit path"
    from_env = os.environ.get(MODEL_STORE_ENV)
    if from_env:
        return _resolved(from_env, MODEL_STORE_ENV), MODEL_STORE_ENV
    source = f"the default {DEFAULT_MODEL_STORE}"
    return _resolved(DEFAULT_MODEL_STORE, source), source


def _resolved(text: str, source: str) -> Path:
    """``text`` with ``~`` expanded, made absolute; InvalidRequest naming ``source`` when it
    cannot be (a NUL byte, ``~user`` of an unknown user, no home directory)."""
    try:
        return Path(text).expanduser().resolve()
    except (ValueError, RuntimeError, OSError) as error:
        raise InvalidRequest(
            f"model store {text!r} (from {source}) is not a usable directory path: {error}; "
            f"set {MODEL_STORE_ENV} (or pass a directory) to another one",
            details={"path": text, "source": source},
        ) from error


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


def _anchors(root: str | os.PathLike[str] | None) -> list[tuple[str, str]]:
    """(absolute prefix, portable spelling), longest prefix first, so a store inside the
    repository reads as a repository path and a repository inside the home as one too."""
    anchors: dict[str, str] = {}
    home = Path.home()
    temporary = Path(tempfile.gettempdir())
    for prefix, spelling in (
        (temporary, "$TMPDIR"),
        (home, "~"),
        (_candidate(None)[0], f"${MODEL_STORE_ENV}"),
        (Path(root) if root is not None else None, "."),
    ):
        if prefix is None:
            continue
        for form in {str(prefix), str(Path(prefix).resolve())}:
            if form not in ("", "/"):
                anchors[form] = spelling
    return sorted(anchors.items(), key=lambda item: len(item[0]), reverse=True)


def portable_path(
    path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None
) -> str:
    """``path`` as evidence and reports record it: relative to ``root`` (the repository) as
    ``./...``, or to the model store as ``$SHARD_ENGINE_MODEL_STORE/...``, the temporary
    directory as ``$TMPDIR/...`` or the home as ``~/...``; a path under none of them keeps
    only its last two parts (``.../dir/name``). Relative paths and non-paths (``fake``) are
    returned unchanged."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        return text
    for prefix, spelling in _anchors(root):
        if text == prefix:
            return spelling
        if text.startswith(prefix + os.sep):
            return spelling + "/" + Path(text[len(prefix) + 1 :]).as_posix()
    parts = Path(text).parts
    return ".../" + "/".join(parts[-2:]) if len(parts) > 2 else text


def portable_text(text: str, *, root: str | os.PathLike[str] | None = None) -> str:
    """``text`` (a command's output, a report) with every absolute prefix
    :func:`portable_path` knows replaced by its portable spelling."""
    for prefix, spelling in _anchors(root):
        # Only whole path components: /root must not rewrite /rootfs.
        pattern = re.compile(re.escape(prefix) + r"(?![\w.-])")
        text = pattern.sub(spelling.replace("\\", "\\\\"), text)
    return text
