"""Shard integrity: every shard file carries the sha256 of its own bytes, checked before use.

``split_model`` writes ``shard.content_sha256`` as 64 ASCII zeros, streams the file, hashes it
once (those 64 bytes still zeros) and patches the digest in place. A shard's *content digest* is
therefore the sha256 of the file with that value read as zeros: a file altered anywhere after
the split (tensor data, metadata, tensor table) no longer matches the digest it carries, and a
worker holding only the shard file (no manifest) can still check it. Verification goes through
the per-identity digest cache (``store.py``), so an unchanged file is hashed once, not on every
load.

What this does not stop: someone who alters a shard *and* recomputes its digest. Binding a
shard to its source against a deliberate forger needs a signature from whoever ran the split.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import gguf

from shard_engine_llama._gguf.reader import GGUFHeader, GGUFValidationError
from shard_engine_llama._gguf.store import hash_cache

if TYPE_CHECKING:
    from shard_engine_llama._sealed import SealedCopy

__all__ = [
    "CONTENT_KEY",
    "PLACEHOLDER",
    "ShardIntegrityError",
    "content_sha256",
    "seal_shard",
    "verify_shard",
    "verify_shard_file",
]

CONTENT_KEY = "shard.content_sha256"
PLACEHOLDER = "0" * 64
_DIGEST_KIND = "shard-content"
_CHUNK_BYTES = 16 * 1024 * 1024
# The shard keys are written first, so the digest's value lies within the first few KiB.
_SEARCH_BYTES = 1024 * 1024
_VALUE_PREFIX = (
    struct.pack("<Q", len(CONTENT_KEY))
    + CONTENT_KEY.encode()
    + struct.pack("<IQ", int(gguf.GGUFValueType.STRING), len(PLACEHOLDER))
)


class ShardIntegrityError(GGUFValidationError):
    """A shard file is not the file ``split_model`` wrote: its bytes do not match the content
    digest it carries (or it carries none)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, rule="shard-integrity", field=CONTENT_KEY)


def _value_offset(path: Path) -> int:
    with open(path, "rb") as handle:
        head = handle.read(_SEARCH_BYTES)
    position = head.find(_VALUE_PREFIX)
    if position < 0:
        raise ShardIntegrityError(
            f"{path}: carries no {CONTENT_KEY} (written by an older split, or not a shard); "
            "split the source model again"
        )
    return position + len(_VALUE_PREFIX)


def content_sha256(path: str | os.PathLike[str], value_offset: int) -> str:
    """The sha256 of ``path`` with the 64 bytes at ``value_offset`` read as ASCII zeros."""
    digest = hashlib.sha256()
    position = 0
    placeholder = PLACEHOLDER.encode()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            start, end = position, position + len(chunk)
            if start < value_offset + len(placeholder) and value_offset < end:
                buffer = bytearray(chunk)
                low = max(value_offset, start) - start
                high = min(value_offset + len(placeholder), end) - start
                skip = max(value_offset, start) - value_offset
                buffer[low:high] = placeholder[skip : skip + high - low]
                chunk = bytes(buffer)
            digest.update(chunk)
            position = end
    return digest.hexdigest()


def seal_shard(path: Path) -> str:
    """Hash a freshly written shard (its digest value still the placeholder), write the digest
    into it, and return it."""
    offset = _value_offset(path)
    with open(path, "r+b") as handle:
        handle.seek(offset)
        if handle.read(len(PLACEHOLDER)) != PLACEHOLDER.encode():
            raise ShardIntegrityError(f"{path}: {CONTENT_KEY} is already set")
    digest = content_sha256(path, offset)
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(digest.encode())
        handle.flush()
        os.fsync(handle.fileno())
    return digest


def _verify(
    path: Path, offset: int, recorded: str, store: Path | None, copy: SealedCopy | None = None
) -> str:
    # ``expected``: a cached digest that disagrees with the recorded one is re-computed before
    # the shard is refused (a damaged cache entry must not refuse a good shard for good).
    # ``copy``: a file that is hashed is copied into it by the same read.
    actual = hash_cache().digest(
        path,
        _DIGEST_KIND,
        (
            (lambda target: content_sha256(target, offset))
            if copy is None
            else (lambda target: copy.hash_copying(target, offset))
        ),
        store=store,
        expected=recorded,
    )
    if actual != recorded:
        raise ShardIntegrityError(
            f"{path}: its bytes hash to {actual[:16]}…, but it records {recorded[:16]}…: the "
            "file was altered or damaged after it was split; split the source model again"
        )
    return actual


def verify_shard(
    header: GGUFHeader, *, store: Path | None = None, copy: SealedCopy | None = None
) -> str:
    """Check a parsed shard against the digest it carries; return the digest. ``copy``: when
    the shard is hashed (its digest is not cached for its identity), the read that hashes it
    also fills ``copy`` (:class:`shard_engine_llama._sealed.SealedCopy`); otherwise ``copy``
    is left empty for the caller to fill."""
    entry = header.metadata.get(CONTENT_KEY)
    if entry is None or not isinstance(entry.value, str) or entry.offset < 0:
        raise ShardIntegrityError(
            f"{header.path}: carries no {CONTENT_KEY} (written by an older split); split the "
            "source model again"
        )
    return _verify(header.path, entry.offset, entry.value, store, copy)


def verify_shard_file(path: Path, *, store: Path | None = None) -> str:
    """Check a shard without parsing it (its digest is found near the start); return it."""
    offset = _value_offset(path)
    with open(path, "rb") as handle:
        handle.seek(offset)
        recorded = handle.read(len(PLACEHOLDER)).decode("ascii", errors="replace")
    return _verify(path, offset, recorded, store)
