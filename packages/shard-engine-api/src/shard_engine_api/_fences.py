"""Tombstones: per session id, the newest epoch that was released or evicted, stored compactly.

A fence must outlive any realistic churn, so the table keeps each entry in 17 bytes (a 64-bit
hash of the session id, the epoch, and whether it was a release) in sorted numpy arrays
instead of a dict of strings. Entries live in two generations of ``generation_size`` distinct
sessions each: when the newest generation is full, the older one is forgotten. So the fences of
at least the ``generation_size`` most recently released or evicted sessions are always kept
(up to twice that many), and every fence forgotten that way is counted in ``dropped``, which the
engine reports in metrics and health: a fence never expires silently.

The 64-bit hash is a keyed BLAKE2b whose 32-byte key each table draws from ``os.urandom`` when
it is made, and never shows: session ids come from callers, and with an unkeyed hash a caller
could search offline for an id sharing another session's hash (2**32 work for a pair of its
own, 2**64 / N to hit one of N predictable ids of others) and fence that session at every epoch
by releasing its own id at epoch 2**63 - 1. Keyed, no id can be computed to collide without
the key, so two ids share a fence only by chance: with a million fences kept, about 5e-14 per
new session. Hashes differ between tables and processes (and so do the arrays' orders); a
table never leaves its process.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = ["BYTES_PER_FENCE", "DEFAULT_GENERATION_SIZE", "Fence", "FenceTable"]

DEFAULT_GENERATION_SIZE: Final = 1 << 20
"""Fences of at least this many most recently released or evicted sessions are kept."""

BYTES_PER_FENCE: Final = 17
"""Storage per kept fence once merged: 8 (hash) + 8 (epoch) + 1 (released flag)."""

_log = logging.getLogger("shard_engine.core")
_MERGE_EVERY: Final = 4096
_EPOCH_CEILING: Final = (1 << 64) - 1
_KEY_BYTES: Final = 32
"""The secret BLAKE2b key of a table (BLAKE2b takes up to 64 bytes)."""

_Keys = npt.NDArray[np.uint64]
_Flags = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class Fence:
    """The newest released (``released=True``) or evicted epoch of a session."""

    epoch: int
    released: bool


class _Generation:
    """Sorted, deduplicated arrays: hash -> (epoch, released)."""

    __slots__ = ("epochs", "keys", "released")

    def __init__(self, keys: _Keys, epochs: _Keys, released: _Flags) -> None:
        self.keys = keys
        self.epochs = epochs
        self.released = released

    @classmethod
    def empty(cls) -> _Generation:
        return cls(np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.bool_))

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    def get(self, key: int) -> Fence | None:
        keys = self.keys
        index = int(np.searchsorted(keys, np.uint64(key)))
        if index < keys.shape[0] and int(keys[index]) == key:
            return Fence(int(self.epochs[index]), bool(self.released[index]))
        return None

    def merged(self, pending: dict[int, tuple[int, bool]]) -> _Generation:
        """This generation with ``pending`` folded in, keeping the newest fence per key."""
        count = len(pending)
        keys = np.concatenate([self.keys, np.fromiter(pending, np.uint64, count)])
        epochs = np.concatenate(
            [self.epochs, np.fromiter((e for e, _ in pending.values()), np.uint64, count)]
        )
        released = np.concatenate(
            [self.released, np.fromiter((r for _, r in pending.values()), np.bool_, count)]
        )
        order = np.lexsort((released, epochs, keys))
        keys, epochs, released = keys[order], epochs[order], released[order]
        last = np.ones(keys.shape[0], np.bool_)
        last[:-1] = keys[1:] != keys[:-1]
        return _Generation(keys[last], epochs[last], released[last])


class FenceTable:
    """Session id -> newest released/evicted :class:`Fence`. Not thread-safe (the ledger's
    owner serialises access)."""

    def __init__(self, generation_size: int = DEFAULT_GENERATION_SIZE) -> None:
        if generation_size < 1:
            raise ValueError(f"generation_size must be >= 1, got {generation_size}")
        self.generation_size = generation_size
        self.dropped = 0
        """Fences forgotten early (their session's old epochs would be accepted again)."""
        self._pending: dict[int, tuple[int, bool]] = {}
        self._current = _Generation.empty()
        self._previous = _Generation.empty()
        # Drawn once per table and kept for its life: the same id must keep its key. A
        # BLAKE2b state holding the key, copied per id, skips re-keying on every lookup.
        self._keyed = hashlib.blake2b(digest_size=8, key=os.urandom(_KEY_BYTES))

    def _key(self, session_id: str) -> int:
        digest = self._keyed.copy()
        digest.update(session_id.encode("utf-8", "surrogatepass"))
        return int.from_bytes(digest.digest(), "little")

    def get(self, session_id: str) -> Fence | None:
        key = self._key(session_id)
        found = [
            fence
            for fence in (
                self._fence_of(self._pending.get(key)),
                self._current.get(key),
                self._previous.get(key),
            )
            if fence is not None
        ]
        return max(found, key=lambda f: (f.epoch, f.released)) if found else None

    @staticmethod
    def _fence_of(entry: tuple[int, bool] | None) -> Fence | None:
        return None if entry is None else Fence(entry[0], entry[1])

    def put(self, session_id: str, epoch: int, *, released: bool) -> None:
        """Fence ``epoch`` (and older) of ``session_id``; an older fence never replaces a newer."""
        key = self._key(session_id)
        entry = (min(epoch, _EPOCH_CEILING), released)
        previous = self._pending.get(key)
        self._pending[key] = entry if previous is None else max(previous, entry)
        if len(self._pending) >= min(_MERGE_EVERY, self.generation_size):
            self._merge()

    def _merge(self) -> None:
        self._current = self._current.merged(self._pending)
        self._pending = {}
        if len(self._current) >= self.generation_size:
            forgotten = int(
                np.count_nonzero(np.isin(self._previous.keys, self._current.keys, invert=True))
            )
            if forgotten:
                self.dropped += forgotten
                _log.warning(
                    "%d session fences dropped early: their old epochs are accepted again",
                    forgotten,
                )
            self._previous, self._current = self._current, _Generation.empty()

    @property
    def note(self) -> str:
        """A health detail when fences were dropped early, else empty."""
        if not self.dropped:
            return ""
        return (
            f"{self.dropped} session fences dropped early (only the newest "
            f"{self.generation_size} are guaranteed)"
        )

    def __len__(self) -> int:
        """Fences held (a session present in both generations counts once per generation)."""
        return len(self._pending) + len(self._current) + len(self._previous)

    @property
    def nbytes(self) -> int:
        """Bytes held by the merged arrays (the pending buffer holds at most 4096 entries)."""
        return sum(
            g.keys.nbytes + g.epochs.nbytes + g.released.nbytes
            for g in (self._current, self._previous)
        )

    def clear(self) -> None:
        """Forget every fence (the engine is closing); not counted as dropped."""
        self._pending = {}
        self._current = _Generation.empty()
        self._previous = _Generation.empty()
