"""File digests verified once per file identity (the model store itself and the one file-hash
helper are the API's: ``shard_engine_api.engine.model_store`` / ``file_sha256``).

Hashing a multi-gigabyte model on every load would dominate a worker's start-up, so a digest is
remembered per *file identity* (resolved path, size, mtime_ns, ctime_ns, inode, device): a file
rewritten in place gets a new mtime/ctime (ctime cannot be set back by a user, unlike mtime), a
file replaced by rename a new inode, and either is hashed again. A digest of a file modified less
than ``RACY_SECONDS`` before it was hashed is not remembered: timestamps have a coarse
granularity, so a second write within the same tick could otherwise go unnoticed (git's "racy"
entries).
The cache lives in memory and, when a model store is usable, in ``verified-sha256.json`` there, so
a restarted worker does not re-hash either. That file lies in a directory a load configuration
names and only saves work: an entry that is not a sha256 hex digest is ignored (the file is hashed
again), since a digest is reported as a fingerprint and names a directory of the store, and a
digest that disagrees with the one a file records is re-computed before it is believed
(``expected``), so a damaged entry costs a re-hash, never the load.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shard_engine_api.engine import file_sha256

__all__ = [
    "FileIdentity",
    "HashCache",
    "file_identity",
    "file_sha256",
    "hash_cache",
    "is_sha256_hex",
    "read_json_document",
]

HASH_CACHE_NAME = "verified-sha256.json"
RACY_SECONDS = 2.0
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def is_sha256_hex(value: object) -> bool:
    """Whether ``value`` is a sha256 digest as hashlib writes it (64 lowercase hex digits)."""
    return isinstance(value, str) and _SHA256_HEX.fullmatch(value) is not None


@dataclass(frozen=True)
class FileIdentity:
    """What distinguishes one version of a file from another without reading it."""

    path: str
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int

    def as_json(self) -> dict[str, int]:
        return {
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "ctime_ns": self.ctime_ns,
            "inode": self.inode,
            "device": self.device,
        }


def file_identity(path: str | os.PathLike[str]) -> FileIdentity:
    """The identity of the file ``path`` opens now. The status comes from ``path`` itself, not
    from its resolved name: for a pinned ``/proc/self/fd/N`` link that is the open file even
    after its name was renamed over; the resolved name only keys the cache."""
    status = os.stat(path)
    resolved = os.path.realpath(path)
    return FileIdentity(
        resolved,
        status.st_size,
        status.st_mtime_ns,
        status.st_ctime_ns,
        status.st_ino,
        status.st_dev,
    )


class HashCache:
    """Digests keyed by (kind, file identity); ``kind`` names the digest (whole file, shard
    content), so two digests of one file never mix."""

    def __init__(self, persist_to: Path | None = None) -> None:
        self._lock = threading.Lock()
        # Each digest with whether this process computed it (True) or read it from a model
        # store's persistent cache (False), which ``expected`` re-checks.
        self._entries: dict[tuple[str, FileIdentity], tuple[str, bool]] = {}
        self._persist_to = persist_to
        self.computed = 0  # how many digests were really computed (tests and metrics read it)

    def digest(
        self,
        path: str | os.PathLike[str],
        kind: str,
        compute: Callable[[Path], str],
        *,
        store: Path | None = None,
        expected: str | None = None,
    ) -> str:
        """The ``kind`` digest of ``path``, computed only if this identity was not seen before.

        ``store``, when given, is a model store whose persistent cache is consulted and updated.
        ``expected``, when given, is the digest the caller will compare with: a digest read from
        the persistent cache that differs from it is dropped and the file hashed once more, so
        a damaged entry (or one written for other bytes) cannot refuse a good file. A digest
        this process computed is returned as it is.
        """
        identity = file_identity(path)
        key = (kind, identity)
        started_ns = time.time_ns()
        with self._lock:
            cached = self._entries.get(key)
        if cached is None and store is not None:
            persisted = _read_persistent(store, kind, identity)
            cached = None if persisted is None else (persisted, False)
        if cached is not None:
            digest, computed_here = cached
            if computed_here or expected is None or digest == expected:
                with self._lock:
                    self._entries[key] = cached
                return digest
            with self._lock:
                self._entries.pop(key, None)
            if store is not None:
                _drop_persistent(store, kind, identity)
        # Read through ``path`` (a pinned file stays the file whose identity was taken).
        value = compute(Path(path))
        if not is_sha256_hex(value):
            raise ValueError(f"{identity.path}: the {kind} digest {value!r} is not sha256 hex")
        if file_identity(path) != identity:
            # Changed while being read: the digest describes no single version of the file.
            raise OSError(f"{identity.path} changed while it was being hashed")
        with self._lock:
            self.computed += 1
        newest_change = max(identity.mtime_ns, identity.ctime_ns)
        if started_ns - newest_change < RACY_SECONDS * 1e9:
            return value
        with self._lock:
            self._entries[key] = (value, True)
        if store is not None:
            _write_persistent(store, kind, identity, value)
        return value

    def forget(self) -> None:
        with self._lock:
            self._entries.clear()


# The hash cache and a manifest hold a few entries per shard: kilobytes.
MAX_JSON_BYTES = 16 * 1024 * 1024


def read_json_document(path: Path) -> object | None:
    """The JSON in ``path``, or None for anything that is not a small, readable JSON file.

    These files live in directories a load configuration or a command line names, and only
    save work: a damaged one must cost a re-hash or a rewrite, never the load. Deep nesting
    raised RecursionError (not a ValueError) out of json.loads and failed the load; a large
    file was read whole into memory.
    """
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_JSON_BYTES + 1)
        if len(raw) > MAX_JSON_BYTES:
            return None
        document: object = json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return None
    return document


def _read_persistent(store: Path, kind: str, identity: FileIdentity) -> str | None:
    document = read_json_document(store / HASH_CACHE_NAME)
    entry = document.get(kind, {}).get(identity.path) if isinstance(document, dict) else None
    if not isinstance(entry, dict) or entry.get("identity") != identity.as_json():
        return None
    digest = entry.get("sha256")
    # Anything but a digest as hashlib writes it is damage (or a forgery that would otherwise
    # become a reported fingerprint and a path of the store): the file is hashed again.
    return digest if isinstance(digest, str) and is_sha256_hex(digest) else None


def _write_persistent(store: Path, kind: str, identity: FileIdentity, digest: str) -> None:
    def record(section: dict[str, object]) -> None:
        section[identity.path] = {"identity": identity.as_json(), "sha256": digest}

    _update_persistent(store, kind, record)


def _drop_persistent(store: Path, kind: str, identity: FileIdentity) -> None:
    def drop(section: dict[str, object]) -> None:
        section.pop(identity.path, None)

    _update_persistent(store, kind, drop)


def _update_persistent(store: Path, kind: str, change: Callable[[dict[str, object]], None]) -> None:
    # Read-merge-replace: concurrent writers may lose each other's entries, which costs only a
    # re-hash later, never a wrong answer (every entry carries the identity it was computed for).
    path = store / HASH_CACHE_NAME
    document = read_json_document(path)
    if not isinstance(document, dict):
        document = {}
    section = document.setdefault(kind, {})
    if not isinstance(section, dict):
        section = document[kind] = {}
    change(section)
    try:
        store.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
        staging.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
        os.replace(staging, path)
    except OSError:
        return


_process_cache = HashCache()


def hash_cache() -> HashCache:
    """The process-wide cache every engine of this process shares."""
    return _process_cache
