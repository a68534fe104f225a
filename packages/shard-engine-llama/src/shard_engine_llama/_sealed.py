"""A private, sealed copy of a shard file for llama.cpp to map instead of the file itself.

llama.cpp maps the file it loads. A file rewritten in place under a running engine (``cp`` and
``rsync --inplace`` do that) changed its outputs with no error, and a truncated one killed the
process with SIGBUS at the next forward. A copy in a ``memfd`` sealed against writes, shrinking
and growing (``F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) can change for no one,
not even for another process of the same user that opens ``/proc/<pid>/fd/<n>``: what was
verified is what runs until the engine closes.

The copy is filled during the same read that verifies the file's digest (a hash-cache miss), or
by one read of its own when the digest was cached; either way the file is read once. It costs
the file's size in memory that is neither shared with other processes nor reclaimable (the
mapped file's pages were page cache): see the README's "Shard integrity" for measurements.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path
from typing import Final

__all__ = ["SealedCopy", "sealed_copies_supported"]

_CHUNK_BYTES: Final = 16 * 1024 * 1024
_SEALS: Final = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_PLACEHOLDER: Final = b"0" * 64


def sealed_copies_supported() -> bool:
    """Whether this system has sealable memfds and a procfs to name them by."""
    return hasattr(os, "memfd_create") and Path("/proc/self/fd").is_dir()


class SealedCopy:
    """A memfd that receives one file's bytes in order, then is sealed and named by its
    ``/proc/self/fd`` link. :meth:`close` drops this process's descriptor; a mapping llama.cpp
    made of it keeps the copy alive until the model is freed."""

    def __init__(self, name: str) -> None:
        self._descriptor: int | None = os.memfd_create(
            name[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        )
        self.size = 0
        self.complete = False  # a whole file was read into it (hash_copying or fill)
        self.sealed = False

    def _fd(self) -> int:
        if self._descriptor is None:
            raise ValueError("the sealed copy is closed")
        return self._descriptor

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        """Append ``chunk`` (the next bytes of the file, in order)."""
        if self.sealed:
            raise ValueError("the copy is sealed")
        view = memoryview(chunk)
        while view:
            written = os.pwrite(self._fd(), view, self.size)
            self.size += written
            view = view[written:]

    def reset(self) -> None:
        """Forget what was written (a read that failed half-way is started again)."""
        if self.sealed:
            raise ValueError("the copy is sealed")
        os.ftruncate(self._fd(), 0)
        self.size = 0
        self.complete = False

    def hash_copying(self, source: str | os.PathLike[str], placeholder_at: int | None) -> str:
        """Copy ``source`` into this (emptied first) and return the sha256 of its bytes, with
        the 64 bytes at ``placeholder_at`` read as ASCII zeros when given (a shard's content
        digest, see ``_gguf.integrity``): one read both verifies and copies."""
        self.reset()
        digest = hashlib.sha256()
        # The placeholder's span; an empty one past any file when there is none.
        low = -1 if placeholder_at is None else placeholder_at
        high = -1 if placeholder_at is None else low + len(_PLACEHOLDER)
        buffer = bytearray(_CHUNK_BYTES)
        view = memoryview(buffer)
        with open(source, "rb", buffering=0) as handle:
            while length := handle.readinto(buffer):
                chunk = view[:length]
                self.write(chunk)
                start, end = self.size - length, self.size
                if start < high and low < end:
                    patched = bytearray(chunk)
                    begin, stop = max(low, start) - start, min(high, end) - start
                    skip = max(low, start) - low
                    patched[begin:stop] = _PLACEHOLDER[skip : skip + stop - begin]
                    digest.update(patched)
                else:
                    digest.update(chunk)
        self.complete = True
        return digest.hexdigest()

    def fill(self, source: str | os.PathLike[str]) -> None:
        """Copy ``source`` into this (emptied first) without hashing: for a file whose digest
        the hash cache holds for its current identity (the caller compares the identity after
        the copy)."""
        self.reset()
        buffer = bytearray(_CHUNK_BYTES)
        view = memoryview(buffer)
        with open(source, "rb", buffering=0) as handle:
            while length := handle.readinto(buffer):
                self.write(view[:length])
        self.complete = True

    def seal(self, expected_size: int) -> Path:
        """Seal the copy against any change and return the path llama.cpp opens it by.
        Raises OSError when it does not hold ``expected_size`` bytes (the file shrank or grew
        while it was copied)."""
        if (
            not self.complete
            or self.size != expected_size
            or os.fstat(self._fd()).st_size != expected_size
        ):
            raise OSError(
                f"the copy holds {self.size} bytes, the file {expected_size}: it changed while "
                "it was being copied"
            )
        fcntl.fcntl(self._fd(), fcntl.F_ADD_SEALS, _SEALS)
        self.sealed = True
        return Path(f"/proc/self/fd/{self._fd()}")

    def close(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None
