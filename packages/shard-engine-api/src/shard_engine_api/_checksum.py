"""The payload checksum of contract version 1 ("gsum64-crc32").

CRC-32 over megabytes runs ~10x slower than a memory copy, which would dominate a boundary hop.
This checksum reads the payload once at vectorised speed: the bytes are split into 4 KiB groups,
each group is summed as little-endian uint64 words (wrapping), and CRC-32 runs over the group
sums (1/512 of the data), then over the trailing bytes that do not fill a group, then over the
length. It detects any change confined to one word, truncation and extension, and any
reordering of groups; it does not detect a permutation of words within one 4 KiB group, which
no transport produces. Payloads under 64 KiB are CRC-32'd directly (numpy overhead would
dominate there).

Scan marks: a bundle or logits result whose payload was verified (checksum, and optionally
finiteness) carries a private mark saying so, so the same object is not scanned twice at one
hop (see shard_engine_api._boundary). A mark is only set where the payload cannot change.
"""

from __future__ import annotations

import zlib
from typing import Final

import numpy as np

__all__ = [
    "CHECKSUM_ALGORITHM",
    "SCANNED",
    "SCANNED_FINITE",
    "mark_checksummed",
    "mark_scanned",
    "payload_checksum",
    "scanned",
]

CHECKSUM_ALGORITHM: Final = "gsum64-crc32"
_GROUP_WORDS: Final = 512
_GROUP_BYTES: Final = _GROUP_WORDS * 8
_DIRECT_LIMIT: Final = 64 * 1024


def payload_checksum(payload: bytes | bytearray | memoryview) -> int:
    """The 32-bit checksum of ``payload`` (see the module docstring for the algorithm)."""
    view = memoryview(payload).cast("B")
    length = len(view)
    if length < _DIRECT_LIMIT:
        crc = zlib.crc32(view)
    else:
        grouped = length - length % _GROUP_BYTES
        words = np.frombuffer(view[:grouped], dtype="<u8").reshape(-1, _GROUP_WORDS)
        sums = words.sum(axis=1, dtype=np.uint64).astype("<u8", copy=False)
        crc = zlib.crc32(memoryview(sums).cast("B"))
        crc = zlib.crc32(view[grouped:], crc)
    return zlib.crc32(length.to_bytes(8, "little"), crc)


# ----------------------------------------------------------------------------- scan marks

_MARK: Final = "_shard_engine_scanned"
SCANNED: Final = 1
"""Payload length and checksum verified."""
SCANNED_FINITE: Final = 2
"""Payload length, checksum and finiteness verified."""


def _immutable(payload: memoryview) -> bool:
    """Whether no one can change ``payload``'s bytes (so a verification of them stays true):
    a read-only view of ``bytes`` or of a read-only numpy array that owns its memory."""
    if not payload.readonly:
        return False
    owner = payload.obj
    if type(owner) is bytes:
        return True
    return (
        isinstance(owner, np.ndarray)
        and not owner.flags.writeable
        and owner.flags.owndata
        and owner.base is None
    )


def scanned(carrier: object) -> int:
    """The verification level recorded on a bundle or logits result (0: none)."""
    level: int = getattr(carrier, _MARK, 0)
    return level


def mark_scanned(carrier: object, level: int) -> None:
    """Record ``level`` on ``carrier`` (a BoundaryBundle or LogitsResult), if its payload is
    immutable. The mark is not a field: never encoded, never compared."""
    payload = getattr(carrier, "payload", None)
    if type(payload) is memoryview and _immutable(payload):
        # dict=True on these Structs gives an instance a __dict__ for this.
        carrier.__dict__[_MARK] = level


def mark_checksummed(carrier: object) -> None:
    """Record that ``carrier``'s checksum was just computed from its payload, as ``from_array``
    does: it is right by construction, so no check recomputes it. The finiteness scan still runs
    once, at the first check that asks for it. Only for a payload the caller itself made (a
    read-only view of a read-only array it owns): that is not checked again here."""
    carrier.__dict__[_MARK] = SCANNED
