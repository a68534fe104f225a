"""The payload checksum: xxh3-64 (the ``xxhash`` package), for every payload the project checks.

Every checksum the project computes or verifies goes through :func:`payload_checksum` (one
buffer) or :func:`chunks_checksum` (a sequence of buffers, checksummed as their
concatenation): bundle and logits payloads, session snapshots, and anything added later. The
algorithm is part of the contract version (:data:`CHECKSUM_ALGORITHM` belongs to
``CONTRACT_VERSION`` 2; version 1 used a home-made "gsum64-crc32"), so a bundle checksummed by
another algorithm is refused as ContractVersionMismatch before its checksum is looked at, never
misread as corrupt or, worse, as sound.

Why xxh3-64: it runs near memory bandwidth (~50 GB/s here, faster than one memory copy), every
output bit depends on every input bit and on the length, and its 64 bits make an undetected
random corruption a 2**-64 event. The home-made checksum it replaces summed 4 KiB groups as
uint64 words, so it could not see two words of one group changed by +d and -d, or two sign-bit
flips (1,618 of 1,620 such corruptions passed), and let random 2-bit errors through about once
in 30,000. It is not a cryptographic hash: it guards against corruption, not against a peer
that forges payloads (authenticated transports do that).

Two implementations, one result: the optional C extension ``shard_engine_api._native`` (xxHash's
own XXH3_64bits, vendored, with its run-time SSE2/AVX2/AVX-512 dispatch) when it was built, else
the ``xxhash`` package. The extension also verifies a payload's checksum and finiteness in one
pass (``verify_payload`` of shard_engine_api._bundle_checks); without it that is the checksum, then
the numpy bit tests of shard_engine_api._dtypes. :data:`NATIVE` says which is in use; the
environment variable ``SHARD_ENGINE_API_NATIVE=0``, set before the import, selects the fallback
(the tests pin that both give the same answers).

The value is an unsigned 64-bit integer (:data:`CHECKSUM_MAX`); on the wire it is a msgpack
uint64, so checksum fields are typed ``Checksum`` (0..2**64-1), not ``Count`` (<= INT64_MAX).

Scan marks: a bundle or logits result whose payload was verified (checksum, and optionally
finiteness) carries a private mark saying so, so the same object is not scanned twice at one
hop (see shard_engine_api._bundle_checks). A mark is only set where the payload cannot change.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Final, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt
import xxhash

__all__ = [
    "CHECKSUM_ALGORITHM",
    "CHECKSUM_MAX",
    "NATIVE",
    "NATIVE_ENV",
    "NATIVE_MODULE",
    "NATIVE_VECTOR",
    "SCANNED",
    "SCANNED_FINITE",
    "Buffer",
    "NativeScan",
    "chunks_checksum",
    "mark_checksummed",
    "mark_payload_scanned",
    "mark_scanned",
    "payload_checksum",
    "payload_immutable",
    "python_checksum",
    "scanned",
]

CHECKSUM_ALGORITHM: Final = "xxh3-64"
"""The payload checksum algorithm of this contract version: xxh3, 64 bits, seed 0."""
CHECKSUM_MAX: Final = 2**64 - 1
"""The largest checksum (an unsigned 64-bit value)."""

Buffer: TypeAlias = bytes | bytearray | memoryview

NATIVE_ENV: Final = "SHARD_ENGINE_API_NATIVE"
"""Set to ``0`` (before the import) to use the pure-Python fallback even where the extension
was built."""


class NativeScan(Protocol):
    """The C extension's functions (see _native.c and _native.pyi)."""

    VECTOR: str

    def checksum(self, buffer: Buffer, /) -> int: ...
    def finite(self, buffer: Buffer | npt.NDArray[np.generic], kind: int, /) -> bool: ...
    def verify(self, buffer: Buffer, checksum: int, kind: int, /) -> int: ...
    def checksum_and_finite(
        self, buffer: Buffer | npt.NDArray[np.generic], kind: int, /
    ) -> tuple[int, bool]: ...
    def copy_checksum_and_finite(
        self,
        destination: Buffer | npt.NDArray[np.generic],
        source: Buffer | npt.NDArray[np.generic],
        kind: int,
        /,
    ) -> tuple[int, bool]: ...
    def _select_scan(self, name: str, /) -> str: ...


def _load_native() -> NativeScan | None:
    """The built ``_native`` extension, or None (not built, or disabled by the environment)."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None
    try:
        from shard_engine_api import _native
    except ImportError:
        return None
    return _native


NATIVE_MODULE: Final = _load_native()
"""The C extension, or None (then the xxhash package and numpy do its work)."""
NATIVE: Final = NATIVE_MODULE is not None
"""Whether payload checksums and finiteness tests run in the C extension."""
NATIVE_VECTOR: Final[str | None] = None if NATIVE_MODULE is None else NATIVE_MODULE.VECTOR
"""The instruction set the C extension verifies payloads with (its run-time choice, e.g.
``"avx2"``), or None when the pure-Python fallback is in use (not built, or disabled by
``SHARD_ENGINE_API_NATIVE=0``)."""

_xxh3_64: Final = xxhash.xxh3_64
_digest: Final = xxhash.xxh3_64_intdigest

python_checksum: Final[Callable[[Buffer], int]] = _digest
"""The xxhash package's xxh3-64 (the fallback of :data:`payload_checksum`)."""

payload_checksum: Final[Callable[[Buffer], int]] = (
    _digest if NATIVE_MODULE is None else NATIVE_MODULE.checksum
)
"""``payload_checksum(payload)``: the xxh3-64 checksum of ``payload``'s bytes, an integer in
``[0, 2**64)`` (the extension's, or the xxhash package's: the same value)."""


def chunks_checksum(chunks: Iterable[Buffer]) -> int:
    """The checksum of the concatenation of ``chunks`` (equal to :func:`payload_checksum` of
    ``b"".join(chunks)``), computed without joining them."""
    state = _xxh3_64()
    for chunk in chunks:
        state.update(chunk)
    return state.intdigest()


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


def payload_immutable(payload: object) -> bool:
    """Whether ``payload`` is ``bytes`` or a memoryview whose bytes no one can change (see
    :func:`_immutable`): what is verified of it stays true while an engine reads it."""
    if type(payload) is bytes:
        return True
    return type(payload) is memoryview and (
        (payload.readonly and type(payload.obj) is bytes) or _immutable(payload)
    )


def scanned(carrier: object) -> int:
    """The verification level recorded on a bundle or logits result (0: none)."""
    level: int = getattr(carrier, _MARK, 0)
    return level


def mark_scanned(carrier: object, level: int) -> None:
    """Record ``level`` on ``carrier`` (a BoundaryBundle or LogitsResult), if its payload is
    immutable. The mark is not a field: never encoded, never compared."""
    mark_payload_scanned(carrier, getattr(carrier, "payload", None), level)


def mark_payload_scanned(carrier: object, payload: object, level: int) -> None:
    """:func:`mark_scanned` for a caller that already holds ``carrier.payload``."""
    if type(payload) is memoryview and (
        # A decoded payload: a read-only view into the message bytes (tested first, inline).
        (payload.readonly and type(payload.obj) is bytes) or _immutable(payload)
    ):
        # dict=True on these Structs gives an instance a __dict__ for this.
        carrier.__dict__[_MARK] = level


def mark_checksummed(carrier: object) -> None:
    """Record that ``carrier``'s checksum was just computed from its payload, as ``from_array``
    does: it is right by construction, so no check recomputes it. The finiteness scan still runs
    once, at the first check that asks for it. Only for a payload the caller itself made (a
    read-only view of a read-only array it owns): that is not checked again here."""
    carrier.__dict__[_MARK] = SCANNED
