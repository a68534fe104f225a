"""The model store (where engines write generated models and shard files) and the one file-hash
helper every package uses.

The store is an explicit directory, else ``$SHARD_ENGINE_MODEL_STORE``, else the default: a
per-user directory ``shard-engine-<uid>`` in the system's temporary area (``$TMPDIR`` when set,
else ``/var/tmp``, which unlike ``/tmp`` usually survives a reboot), created ``0700`` on first use
and refused unless it is a real directory of this user that no one else can open. Directories
under ``/home`` are refused wherever the path comes from: model files are large, and home
directories are often small, synced or backed up, so a store there must never be chosen by
accident. Resolving an explicit or ``$SHARD_ENGINE_MODEL_STORE`` store creates nothing; whoever
writes into it creates what it writes.
"""

from __future__ import annotations

import getpass
import hashlib
import logging
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Final, NoReturn

from shard_engine_api._errors import InvalidRequest

__all__ = [
    "DEFAULT_MODEL_STORE",
    "MODEL_STORE_ENV",
    "ModelStoreRefused",
    "default_model_store",
    "file_sha256",
    "model_store",
    "portable_path",
    "portable_text",
]

MODEL_STORE_ENV: Final = "SHARD_ENGINE_MODEL_STORE"
DEFAULT_MODEL_STORE: Final = "$TMPDIR/shard-engine-<uid> ($TMPDIR unset: /var/tmp)"
"""How messages and help texts spell the default store (:func:`default_model_store` is it)."""
_REFUSED_ROOT: Final = Path("/home")
_HASH_CHUNK_BYTES: Final = 16 * 1024 * 1024
_PERSISTENT_TEMPORARY: Final = Path("/var/tmp")
_LOG = logging.getLogger("shard_engine.store")
_announced: set[tuple[Path, str]] = set()
_DEFAULT_SOURCE: Final = "the default"


class ModelStoreRefused(InvalidRequest):
    """Raised by :func:`model_store` for a directory under ``/home``, or a default store that
    is not this user's private directory; the message names the directory, where it came from
    (an explicit path, ``$SHARD_ENGINE_MODEL_STORE`` or the default), and how to choose another
    one."""

    code = "model_store_refused"


def default_model_store() -> Path:
    """The default store's path (not created): ``shard-engine-<uid>`` in ``$TMPDIR`` when it is
    set, else in ``/var/tmp`` (else wherever :func:`tempfile.gettempdir` points). Only the
    temporary area is resolved, never the store's own name: a link planted there is refused by
    :func:`model_store`, not followed."""
    return _default_candidate()[0]


def _default_candidate() -> tuple[Path, str]:
    temporary = os.environ.get("TMPDIR")
    if temporary:
        base, where = Path(temporary), "$TMPDIR"
    elif _PERSISTENT_TEMPORARY.is_dir():
        base, where = _PERSISTENT_TEMPORARY, str(_PERSISTENT_TEMPORARY)
    else:
        base = Path(tempfile.gettempdir())
        where = str(base)
    owner = str(os.getuid()) if hasattr(os, "getuid") else getpass.getuser()
    name = f"shard-engine-{owner}"
    return base.expanduser().resolve() / name, f"{_DEFAULT_SOURCE}: {name} in {where}"


def unchecked_model_store() -> Path:
    """Where :func:`model_store` points without an explicit path, before the ``/home`` check:
    what a caller passes on to an engine that may never write anything (the engine checks it
    with ``model_store(path)`` before writing)."""
    return _candidate(None)[0]


def _candidate(explicit: str | os.PathLike[str] | None) -> tuple[Path, str]:
    """The store's path and where it came from. An explicit path equal to the store that
    would be chosen without it (a command passing on the store it was given) keeps that
    store's source: a message then names the setting the user can change."""
    implicit = _implicit_candidate()
    if explicit is not None:
        given: object = explicit
        if not isinstance(given, str | os.PathLike) or isinstance(os.fspath(given), bytes):
            raise InvalidRequest(
                f"a model store must be a directory path (str), got {type(given).__name__}"
            )
        if str(explicit):
            path = _resolved(str(explicit), "an explicit path")
            # Compared before links are resolved too: the default's own name is never
            # followed (a link planted there must be refused, not become "explicit").
            spelled = Path(os.path.abspath(Path(str(explicit)).expanduser()))
            if isinstance(implicit, tuple) and implicit[0] in (path, spelled):
                return implicit
            return path, "an explicit path"
    if isinstance(implicit, InvalidRequest):
        raise implicit
    return implicit


def _implicit_candidate() -> tuple[Path, str] | InvalidRequest:
    """The store without an explicit path, or the error that it cannot be resolved."""
    try:
        from_env = os.environ.get(MODEL_STORE_ENV)
        if from_env:
            return _resolved(from_env, MODEL_STORE_ENV), MODEL_STORE_ENV
        try:
            return _default_candidate()
        except (ValueError, RuntimeError, OSError) as error:
            raise InvalidRequest(
                f"the default model store ({DEFAULT_MODEL_STORE}) is not a usable directory "
                f"path: {error}; set {MODEL_STORE_ENV} to a directory outside /home",
                details={"path": DEFAULT_MODEL_STORE, "source": _DEFAULT_SOURCE},
            ) from error
    except InvalidRequest as error:
        return error


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
    """The model store directory, resolved to an absolute path.

    ``explicit`` wins (an engine option, a ``--workdir``), then ``$SHARD_ENGINE_MODEL_STORE``,
    then the default (:func:`default_model_store`), which is created here (mode ``0700``) when
    it does not exist. Raises :class:`ModelStoreRefused`, naming the path and where it came
    from, when the directory is under ``/home``, or when the default cannot be created or is
    not a private directory of this user (a file, a link, another user's, open to others).
    """
    path, source = _candidate(explicit)
    if path == _REFUSED_ROOT or _REFUSED_ROOT in path.parents:
        raise ModelStoreRefused(
            f"model store {path} (from {source}) is under /home; set {MODEL_STORE_ENV} "
            "(or pass a directory) outside /home",
            details={"path": str(path), "source": source},
        )
    if source.startswith(_DEFAULT_SOURCE):
        _private_directory(path, source)
    if (path, source) not in _announced:
        _announced.add((path, source))
        _LOG.info("model store %s (from %s)", path, source)
    return path


def _private_directory(path: Path, source: str) -> None:
    """Create ``path`` (mode 0700) unless it exists, then insist that it is a directory (not a
    link) owned by this user and closed to everyone else: in a shared temporary area another
    user could have made it first, to read or replace the models written there."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as error:
        _refuse(path, source, f"cannot be created: {error.strerror or error}")
    try:
        status = os.lstat(path)
    except OSError as error:
        _refuse(path, source, f"cannot be read: {error.strerror or error}")
    if not stat.S_ISDIR(status.st_mode):
        _refuse(path, source, "is not a directory (a link or a file is there)")
    if hasattr(os, "getuid") and status.st_uid != os.getuid():
        _refuse(path, source, f"belongs to another user (uid {status.st_uid})")
    if status.st_mode & 0o077:
        _refuse(
            path,
            source,
            f"is open to other users (mode {stat.S_IMODE(status.st_mode):04o}; "
            f"chmod 700 {path} if it is yours)",
        )


def _refuse(path: Path, source: str, problem: str) -> NoReturn:
    raise ModelStoreRefused(
        f"model store {path} (from {source}) {problem}; set {MODEL_STORE_ENV} to a directory "
        "of yours outside /home",
        details={"path": str(path), "source": source},
    )


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
