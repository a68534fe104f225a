"""Boundary dtypes: how hidden states are laid out in a payload, converted to and from f32 (what
every backend computes in), and checked for finiteness.

A payload is row-major, little-endian values of its dtype: IEEE binary32 (``"f32"``), binary16
(``"f16"``) or bfloat16 (``"bf16"``: the top 16 bits of a binary32, so f32's range with 8
significant bits). numpy has no bfloat16, so a bf16 payload is read as ``<u2`` bits and every
conversion is integer bit work on views:

- bf16 -> f32 is exact: the 16 bits shifted into the top half of a 32-bit word.
- f32 -> bf16 rounds to nearest, ties to even (the rounding of IEEE conversions and of
  llama.cpp's ``ggml_fp32_to_bf16``); a NaN stays a (quiet) NaN of the same sign, never
  rounds to infinity; a finite value of magnitude >= :func:`overflow_threshold` becomes an
  infinity (the engine core refuses to send one, see shard_engine_api._results).

Why numpy bit operations and not ml-dtypes' bfloat16 numpy type: the API depends on msgspec,
pluggy, numpy and xxhash only (every worker installs it), the conversions are five integer
ufuncs whose semantics the tests pin exhaustively (every bf16 value, every rounding tie), and
measured side by side here they run within 2x of ml-dtypes' casts (2M values: 6-9 ms against
5-8 ms), a cost only prefill-sized bundles notice next to the compute that made them.

Finiteness is tested on the integer bits as well (see :func:`payload_finite`): numpy's isfinite
on float16 runs a scalar loop (~20x a memory copy), and on float32 writes a full-size boolean
temporary. Where the optional C extension is built (shard_engine_api._checksum.NATIVE), it
tests the bits in one vectorised pass with no numpy call; :func:`python_payload_finite` is the
fallback, and the tests pin that both agree on every 16-bit pattern and on f32 edge patterns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeAlias, cast

import numpy as np
import numpy.typing as npt

from shard_engine_api._checksum import NATIVE_MODULE, python_checksum

if TYPE_CHECKING:
    # Only for annotations: _types imports this module.
    from shard_engine_api._types import BoundaryDtype

__all__ = [
    "BOUNDARY_DTYPES",
    "FINITE_KINDS",
    "ITEMSIZE",
    "bf16_bits_to_f32",
    "checksum_and_finite",
    "copy_checksum_and_finite",
    "encode_rows",
    "f32_to_bf16_bits",
    "overflow_threshold",
    "payload_finite",
    "payload_rows",
    "python_checksum_and_finite",
    "python_copy_checksum_and_finite",
    "python_payload_finite",
    "storage_dtype",
]

ITEMSIZE: Final[dict[str, int]] = {"f32": 4, "f16": 2, "bf16": 2}
"""Bytes per value of each boundary dtype."""

_STORAGE: Final[dict[str, np.dtype[np.generic]]] = {
    "f32": np.dtype("<f4"),
    "f16": np.dtype("<f2"),
    "bf16": np.dtype("<u2"),
}
BOUNDARY_DTYPES: Final[frozenset[str]] = frozenset(_STORAGE)
"""Every boundary dtype name of the contract (``BoundaryDtype``'s values; a test pins that)."""
# Finiteness on the bits: a value is NaN or infinite iff its exponent bits are all ones, i.e.
# iff (bits without the sign) >= the exponent mask. Read as signed integers, the positive
# non-finite values are exactly those >= the mask; read as unsigned, the negative ones are
# exactly those >= sign | mask. Two read-only max reductions, no temporary.
_BitTest: TypeAlias = tuple[np.dtype[np.signedinteger], np.dtype[np.unsignedinteger], int, int]
_FINITE_BITS: Final[dict[str, _BitTest]] = {
    "f32": (np.dtype("<i4"), np.dtype("<u4"), 0x7F800000, 0xFF800000),
    "f16": (np.dtype("<i2"), np.dtype("<u2"), 0x7C00, 0xFC00),
    "bf16": (np.dtype("<i2"), np.dtype("<u2"), 0x7F80, 0xFF80),
}
FINITE_KINDS: Final[dict[BoundaryDtype, int]] = {"f16": 1, "bf16": 2, "f32": 3}
"""The C extension's code for each dtype's finiteness test (0 there means "not tested")."""
# The smallest magnitude that rounds to infinity: halfway between the largest finite value and
# the next power of two (a tie, which rounds to the even neighbour: infinity).
_OVERFLOW: Final[dict[str, float]] = {
    "f32": float("inf"),
    "f16": 65520.0,  # 65504 + 16
    "bf16": float(np.array([0x7F7F8000], dtype="<u4").view("<f4")[0]),  # (2 - 2**-8) * 2**127
}


# Typed by hand: numpy's own stubs for ufunc.reduce differ between releases (2.5 matches no
# overload for an integer array).
_max: Final = cast(
    "Callable[[npt.NDArray[np.signedinteger[Any] | np.unsignedinteger[Any]]], np.integer[Any]]",
    np.maximum.reduce,
)
_SMALL_F32_ITEMS: Final = 16 * 1024


def storage_dtype(dtype: BoundaryDtype) -> np.dtype[np.generic]:
    """The little-endian numpy dtype a payload of ``dtype`` is read as (bf16: its ``<u2`` bits)."""
    return _STORAGE[dtype]


def overflow_threshold(dtype: BoundaryDtype) -> float:
    """The smallest finite f32 magnitude that converts to an infinity in ``dtype``."""
    return _OVERFLOW[dtype]


def python_payload_finite(
    payload: bytes | bytearray | memoryview | npt.NDArray[np.generic], dtype: BoundaryDtype
) -> bool:
    """:func:`payload_finite` in numpy (the fallback without the C extension)."""
    signed, unsigned, positive_limit, negative_limit = _FINITE_BITS[dtype]
    as_signed = np.frombuffer(payload, dtype=signed)
    size = as_signed.size
    if not size:
        return True
    if dtype == "f32" and size <= _SMALL_F32_ITEMS:
        # A decode step's row: one vectorised isfinite and its all() cost fewer instructions
        # than two reductions here (numpy's per-call cost dominates); beyond, the reductions
        # win (a third of the instructions, no boolean temporary). Measured with callgrind.
        return bool(np.isfinite(as_signed.view(np.float32)).all())
    # np.maximum.reduce, not .max(): the method's Python wrapper adds to every call.
    return (
        int(_max(as_signed)) < positive_limit
        and int(_max(as_signed.view(unsigned))) < negative_limit
    )


if NATIVE_MODULE is None:
    payload_finite = python_payload_finite
else:
    _native_finite: Final = NATIVE_MODULE.finite
    _KIND: Final = FINITE_KINDS

    def payload_finite(
        payload: bytes | bytearray | memoryview | npt.NDArray[np.generic], dtype: BoundaryDtype
    ) -> bool:
        """Whether every value of a payload (a C-contiguous buffer of ``dtype`` values) is
        finite. ValueError when its length is not a whole number of values."""
        return _native_finite(payload, _KIND[dtype])


def python_checksum_and_finite(
    payload: bytes | bytearray | memoryview | npt.NDArray[np.generic], dtype: BoundaryDtype
) -> tuple[int, bool]:
    """:func:`checksum_and_finite` with the xxhash package and numpy (the fallback)."""
    raw = payload.data if isinstance(payload, np.ndarray) else payload
    return python_checksum(raw), python_payload_finite(payload, dtype)


if NATIVE_MODULE is None:
    checksum_and_finite = python_checksum_and_finite
else:
    _native_checksum_and_finite: Final = NATIVE_MODULE.checksum_and_finite

    def checksum_and_finite(
        payload: bytes | bytearray | memoryview | npt.NDArray[np.generic], dtype: BoundaryDtype
    ) -> tuple[int, bool]:
        """A payload's checksum (:func:`shard_engine_api._checksum.payload_checksum`) and
        whether every value is finite (:func:`payload_finite`): what an engine computes for a
        result it builds. One pass in the C extension. ValueError when the length is not a
        whole number of values."""
        return _native_checksum_and_finite(payload, _KIND[dtype])


def python_copy_checksum_and_finite(
    destination: bytearray | memoryview | npt.NDArray[np.generic],
    source: bytes | bytearray | memoryview | npt.NDArray[np.generic],
    dtype: BoundaryDtype,
) -> tuple[int, bool]:
    """:func:`copy_checksum_and_finite` as a copy, then the fallback's checksum and test."""
    target = (
        destination.data if isinstance(destination, np.ndarray) else memoryview(destination)
    ).cast("B")
    data = (source.data if isinstance(source, np.ndarray) else memoryview(source)).cast("B")
    if target.nbytes != data.nbytes:
        raise ValueError(f"destination has {target.nbytes} bytes, source {data.nbytes}")
    if data.nbytes % ITEMSIZE[dtype]:
        raise ValueError("buffer size must be a multiple of element size")
    target[:] = data
    return python_checksum_and_finite(target, dtype)


if NATIVE_MODULE is None:
    copy_checksum_and_finite = python_copy_checksum_and_finite
else:
    _native_copy_checksum_and_finite: Final = NATIVE_MODULE.copy_checksum_and_finite

    def copy_checksum_and_finite(
        destination: bytearray | memoryview | npt.NDArray[np.generic],
        source: bytes | bytearray | memoryview | npt.NDArray[np.generic],
        dtype: BoundaryDtype,
    ) -> tuple[int, bool]:
        """Copy ``source`` into the writable ``destination`` (the same length, no overlap) and
        return :func:`checksum_and_finite` of it, in one pass over the data (the C extension
        hashes and tests each stripe while it is in registers on its way over): for a backend
        that copies its output out of a buffer it reuses, the hash costs no second pass.
        ValueError for a length mismatch, an overlap or a partial value."""
        return _native_copy_checksum_and_finite(destination, source, _KIND[dtype])


def bf16_bits_to_f32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """bf16 bits (any shape) as f32 values, exactly (a new array)."""
    wide = bits.astype(np.uint32)
    wide <<= 16
    return wide.view(np.float32)


def f32_to_bf16_bits(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """f32 values (any shape) rounded to the nearest bf16, ties to even, as bits (a new array).
    A NaN stays a quiet NaN of the same sign; overflow gives an infinity (IEEE rounding)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32)
    # (values of another numeric dtype are converted to f32 first, as numpy casts do.)
    # Adding 0x7FFF plus the lowest kept bit and truncating rounds to nearest, ties to even.
    # A finite input cannot carry out of 32 bits (0xFF7FFFFF + 0x8000 < 2**32); a NaN could
    # round into the infinity or wrap, so NaNs are fixed up after.
    rounded = bits >> 16
    rounded &= 1
    rounded += 0x7FFF
    rounded += bits
    rounded >>= 16
    result = rounded.astype(np.uint16)
    # Any NaN? (positive NaNs read as int32 exceed 0x7F800000, negative ones as uint32 exceed
    # 0xFF800000: two read-only passes, where np.isnan would write a full-size temporary.)
    if bits.size and (
        int(np.max(bits.view(np.int32))) > 0x7F800000 or int(np.max(bits)) > 0xFF800000
    ):
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        result[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return result.reshape(np.shape(values))


def encode_rows(values: npt.NDArray[np.floating], dtype: BoundaryDtype) -> npt.NDArray[np.generic]:
    """``values`` converted to the storage of ``dtype`` (a new C-contiguous array: never a view
    of ``values``, so the caller owns it)."""
    if dtype == "bf16":
        return f32_to_bf16_bits(np.asarray(values, dtype=np.float32))
    converted = np.ascontiguousarray(values, dtype=_STORAGE[dtype])
    if converted is values or np.may_share_memory(converted, values):
        converted = converted.copy()
    return converted


def payload_rows(
    payload: memoryview | bytes, dtype: BoundaryDtype, n_rows: int, width: int
) -> npt.NDArray[np.float32]:
    """A payload as ``(n_rows, width)`` f32 rows: a read-only view of the payload for f32, a
    converted copy for f16 and bf16. The payload length must already match."""
    raw = np.frombuffer(payload, dtype=_STORAGE[dtype]).reshape(n_rows, width)
    if dtype == "f32":
        return raw
    if dtype == "bf16":
        return bf16_bits_to_f32(raw)
    return raw.astype(np.float32)
