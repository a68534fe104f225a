"""The shared memory a framed client lends its server: a sealed ``memfd`` of slots (see
:mod:`~shard_engine_remote._framed.frames` for how calls use them)."""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from contextlib import suppress
from typing import Final

__all__ = [
    "ARENA_MAX_SLOTS",
    "ARENA_SLOTS",
    "ARENA_SLOT_BYTES",
    "SHARED_MEMORY",
    "Arena",
    "arena_slots_for",
]

ARENA_SLOTS: Final = 4
"""Calls of one connection that may use its shared memory at once (more travel the socket), by
default: a worker's link to the child it spawned lends as many as the child's engine has
sessions, up to :data:`ARENA_MAX_SLOTS` (see :func:`arena_slots_for`)."""

ARENA_MAX_SLOTS: Final = 16
"""The most slots a link lends for its engine's sessions. 16 callers of one child with 4 slots
sent 12 replies of 1 MiB logits through the socket each step: their per-token p99 was 2.1x
a raw batch(16) step against 1.6x with 16 slots (gemma3-270m, 4 alternating repetitions)."""

ARENA_SLOT_BYTES: Final = 16 << 20
"""Largest body that crosses in a slot: 8 rows of a 262k-vocabulary tail's f32 logits, or a
512-row f32 bundle of 4096-wide hidden states (pages are taken as slots are first used)."""

_MAX_ARENA_BYTES: Final = 1 << 30

_ARENA_SEALS: Final = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
SHARED_MEMORY: Final = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")
"""Whether this platform can lend a server shared memory (Linux: sealed memfds)."""


def arena_slots_for(max_sessions: int) -> int:
    """Slots for a link to an engine of ``max_sessions``: one per session that may decode at
    once, at least :data:`ARENA_SLOTS` and at most :data:`ARENA_MAX_SLOTS`. A slot's pages are
    taken only as calls first use it."""
    return min(ARENA_MAX_SLOTS, max(ARENA_SLOTS, max_sessions))


class Arena:
    """A connection's shared memory: ``slots`` slots of ``slot_bytes``, mapped by both ends."""

    def __init__(self, memory: mmap.mmap, slots: int, slot_bytes: int) -> None:
        self._memory = memory
        self._view = memoryview(memory)
        self.slots = slots
        self.slot_bytes = slot_bytes

    def close(self) -> None:
        """Unmap now, closing the descriptor the mapping holds, unless another thread is
        copying (then when the last reference goes). Later reads and writes raise
        ValueError."""
        with suppress(BufferError):
            self._view.release()
            self._memory.close()

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> tuple[Arena, int]:
        """A new arena and its file (the caller sends, then closes it). Raises OSError."""
        size = slots * slot_bytes
        fd = os.memfd_create("shard-engine-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _ARENA_SEALS | fcntl.F_SEAL_SEAL)
            return cls(mmap.mmap(fd, size), slots, slot_bytes), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def adopt(cls, fd: int, slots: int, slot_bytes: int) -> Arena | None:
        """The arena a client sent (``fd`` is closed here), or None when it is not one: a
        regular memory file of exactly the announced size that can neither shrink nor grow.
        An unsealed file could be cut short under the mapping, and touching the lost pages
        would kill this process (SIGBUS)."""
        try:
            if not (0 < slots <= 64 and slot_bytes > 0 and slots * slot_bytes <= _MAX_ARENA_BYTES):
                return None
            status = os.fstat(fd)
            size = slots * slot_bytes
            if not stat.S_ISREG(status.st_mode) or status.st_size != size:
                return None
            if status.st_blksize != mmap.PAGESIZE:
                # Not an ordinary memory file: hugetlbfs, say, whose pages a hole punched by
                # the client may leave impossible to fault back in (SIGBUS).
                return None
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _ARENA_SEALS != _ARENA_SEALS:
                return None
            return cls(mmap.mmap(fd, size), slots, slot_bytes)
        except (OSError, ValueError, OverflowError):  # not sealable (no memory file), not mappable
            return None
        finally:
            os.close(fd)

    def slot(self, index: int) -> memoryview:
        start = index * self.slot_bytes
        return self._view[start : start + self.slot_bytes]

    def put(self, index: int, body: bytes) -> None:
        self.slot(index)[: len(body)] = body

    def take(self, index: int, length: int) -> bytes:
        """A copy of the first ``length`` bytes of a slot (what decodes from it must not see
        the slot written again)."""
        return bytes(self.slot(index)[:length])
