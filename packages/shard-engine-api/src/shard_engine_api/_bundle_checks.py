"""Boundary checks: the one place that decides whether a bundle or a logits payload is sound.

Three consumers check what crosses a shard boundary: the engine core (a bundle arriving as
input), the wire codec (a bundle or logits result arriving as bytes) and
:class:`~shard_engine_api.ValidatingEngine` (a result leaving an engine). Each calls
:func:`check_bundle` or :func:`check_logits` with what it expects, gets back ``None`` or a
:class:`Violation` naming what is wrong (a :class:`ViolationKind`), and maps it to its own error:
the core and the codec through :func:`violation_error` (InvalidRequest and its subclasses,
UnsupportedFeature, ResourceExhausted), the wrapper to MalformedOutput with
``details["check"] = kind.value``.

Checks run cheapest first: contract version, reserved MTP/aux state, header ranges, dtype,
hidden size, model fingerprint (which must be non-empty), layer index, the request's session,
position and row count, the payload size limit (before any hashing), payload length against the
header, then the checksum (xxh3-64) and finiteness (NaN/Inf, tested on the bits) together by
:func:`verify_payload`: one pass in the optional C extension (with AVX2, each 64-byte stripe
tested inside xxHash's own hashing loop; see _native.c), else the xxhash package and two
read-only numpy max reductions over integer views of the bits (see shard_engine_api._dtypes).
A payload that fails both is reported as a checksum mismatch, whichever implementation ran;
measured against the alternatives in benchmarks/codec_bench.py.

One scan per hop: the checksum and finiteness passes read the whole payload, so a bundle that
passed them carries a private mark recording it, and a later check of the same object skips them
(the header checks are a few comparisons and always run). ``from_array`` marks what it builds as
checksummed (it just computed the checksum from the bytes it owns), so the checksum of a result
is never recomputed by the wrapper that checks it. The mark is only set on a bundle whose
payload cannot change: a read-only view of an immutable ``bytes`` object or of a read-only numpy
array that owns its memory. A decoded bundle (a view into ``bytes``) scanned by the codec is
therefore not rescanned by the engine core that receives it, and a result bundle scanned by
``ValidatingEngine`` is not rescanned by the next shard's core in an in-process pipeline.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import numpy.typing as npt

from shard_engine_api._checksum import (
    NATIVE_MODULE,
    SCANNED,
    SCANNED_FINITE,
    Buffer,
    mark_payload_scanned,
    python_checksum,
    scanned,
)
from shard_engine_api._dtypes import (
    BOUNDARY_DTYPES,
    FINITE_KINDS,
    ITEMSIZE,
    payload_finite,
    python_payload_finite,
)
from shard_engine_api._errors import (
    ChecksumMismatch,
    ContractVersionMismatch,
    ErrorDetail,
    InvalidRequest,
    ResourceExhausted,
    ShardEngineError,
    ShardMismatch,
    UnsupportedFeature,
)
from shard_engine_api._types import (
    CONTRACT_VERSION,
    BoundaryBundle,
    BoundaryDtype,
    LogitsResult,
    SessionRef,
)

__all__ = [
    "CHECKSUM_MISMATCH",
    "NONFINITE",
    "SOUND",
    "BundleExpectation",
    "Violation",
    "ViolationKind",
    "all_finite",
    "check_bundle",
    "check_logits",
    "python_verify_payload",
    "verify_payload",
    "violation_error",
]


class ViolationKind(enum.StrEnum):
    """What is wrong with a bundle or logits payload. The values are stable: they are the
    ``details["check"]`` of MalformedOutput and the ``details["violation"]`` of other errors."""

    CONTRACT_VERSION = "contract_version"
    RESERVED = "reserved"
    HEADER = "header"
    DTYPE = "dtype"
    HIDDEN_SIZE = "hidden_size"
    VOCAB_SIZE = "vocab_size"
    FINGERPRINT = "fingerprint"
    LAYER = "layer"
    SESSION = "session"
    POSITION = "position"
    ROWS = "rows"
    PAYLOAD_LIMIT = "payload_limit"
    PAYLOAD_LENGTH = "payload_length"
    CHECKSUM = "checksum"
    FINITE = "finite"


@dataclass(frozen=True, slots=True)
class Violation:
    """One failed check: its kind, a message for people, and structured details."""

    kind: ViolationKind
    message: str
    details: dict[str, ErrorDetail] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BundleExpectation:
    """What a receiver requires of every bundle; ``None`` means "not checked". Build it once
    (at load, or with a codec) and reuse it for every bundle."""

    fingerprint: str | None = None
    layer: int | None = None
    hidden_size: int | None = None
    dtypes: frozenset[str] | None = None
    max_payload_bytes: int | None = None
    check_finite: bool = True


_KNOWN_DTYPES: Final = BOUNDARY_DTYPES

# ----------------------------------------------------------------------------- finiteness

_DTYPE_NAMES: Final[dict[np.dtype[np.generic], BoundaryDtype]] = {
    np.dtype("<f4"): "f32",
    np.dtype("<f2"): "f16",
}


def all_finite(values: npt.NDArray[np.floating]) -> bool:
    """Whether every value of an f32 or f16 array is finite (no NaN, no infinity), tested on
    the bits (see :func:`shard_engine_api._dtypes.payload_finite`); other float dtypes go
    through numpy's isfinite."""
    name = _DTYPE_NAMES.get(values.dtype)
    if name is None or not values.flags.c_contiguous:
        return bool(np.isfinite(values).all())
    return payload_finite(values, name)


# ----------------------------------------------------------------------------- one pass

SOUND: Final = 0
""":func:`verify_payload`: the checksum matches and (when tested) every value is finite."""
CHECKSUM_MISMATCH: Final = 1
""":func:`verify_payload`: the payload does not match its checksum (whatever its values)."""
NONFINITE: Final = 2
""":func:`verify_payload`: the checksum matches, but a value is NaN or infinite."""

_KIND_DTYPES: Final[dict[int, BoundaryDtype]] = {
    kind: dtype for dtype, kind in FINITE_KINDS.items()
}
_F32_KIND: Final = FINITE_KINDS["f32"]


def python_verify_payload(payload: Buffer, checksum: int, finite_kind: int) -> int:
    """:func:`verify_payload` with the xxhash package and numpy (the fallback without the C
    extension): the checksum, then, if it matches, the finiteness test."""
    if python_checksum(payload) != checksum:
        return CHECKSUM_MISMATCH
    if finite_kind and not python_payload_finite(payload, _KIND_DTYPES[finite_kind]):
        return NONFINITE
    return SOUND


verify_payload: Final[Callable[[Buffer, int, int], int]] = (
    python_verify_payload if NATIVE_MODULE is None else NATIVE_MODULE.verify
)
"""``verify_payload(payload, checksum, finite_kind)``: :data:`SOUND`, :data:`CHECKSUM_MISMATCH`
or :data:`NONFINITE`. ``finite_kind`` is ``FINITE_KINDS[dtype]`` (shard_engine_api._dtypes), or
0 to test the checksum only. ValueError when the length is not a whole number of values."""


# ----------------------------------------------------------------------------- checks


def _size_violation(what: str, size: int, limit: int) -> Violation:
    return Violation(
        ViolationKind.PAYLOAD_LIMIT,
        f"{what} payload of {size} bytes exceeds the limit of {limit}",
        {"resource": "payload_bytes", "payload_bytes": size, "limit": limit},
    )


def _payload_violation(what: str, status: int) -> Violation:
    """The violation a non-zero :func:`verify_payload` status stands for."""
    if status == CHECKSUM_MISMATCH:
        return Violation(ViolationKind.CHECKSUM, f"{what} does not match its checksum")
    return Violation(ViolationKind.FINITE, f"{what} contain NaN or Inf")


def check_bundle(
    bundle: BoundaryBundle,
    expect: BundleExpectation,
    *,
    session: SessionRef | None = None,
    first_pos: int | None = None,
    n_tokens: int | None = None,
) -> Violation | None:
    """Check ``bundle`` against the contract, ``expect``, and (when given) the session,
    first position and row count of the request it belongs to. Returns the first violation,
    or None. The bundle's fields must already have their declared types (see
    shard_engine_api._typecheck); nothing here raises."""
    version = bundle.contract_version
    if version != CONTRACT_VERSION:
        return Violation(
            ViolationKind.CONTRACT_VERSION,
            f"bundle speaks contract version {version}; this library speaks {CONTRACT_VERSION}",
            {"contract_version": version, "supported": CONTRACT_VERSION},
        )
    if bundle.mtp or bundle.aux:
        return Violation(
            ViolationKind.RESERVED,
            "bundle carries reserved multi-token-prediction (mtp) or auxiliary (aux) state, "
            "which is not enabled",
        )
    rows, width, layer = bundle.n_tokens, bundle.hidden_size, bundle.layer
    if rows < 1 or width < 1 or bundle.first_pos < 0:
        return Violation(
            ViolationKind.HEADER,
            f"bundle header out of range: n_tokens={rows} (>= 1), hidden_size={width} "
            f"(>= 1), first_pos={bundle.first_pos} (>= 0)",
        )
    dtype = bundle.dtype
    allowed = _KNOWN_DTYPES if expect.dtypes is None else expect.dtypes
    if dtype not in allowed:
        return Violation(
            ViolationKind.DTYPE, f"bundle dtype {dtype!r} is not one of {sorted(allowed)}"
        )
    if expect.hidden_size is not None and width != expect.hidden_size:
        return Violation(
            ViolationKind.HIDDEN_SIZE,
            f"bundle hidden size {width}; expected {expect.hidden_size}",
        )
    fingerprint = bundle.model_fingerprint
    if not fingerprint:
        return Violation(ViolationKind.FINGERPRINT, "bundle carries no model fingerprint")
    if expect.fingerprint is not None and fingerprint != expect.fingerprint:
        return Violation(
            ViolationKind.FINGERPRINT,
            f"bundle is for model {fingerprint!r}; expected {expect.fingerprint!r}",
        )
    # Every layer mismatch is the same violation (ShardMismatch for a receiver): layer 0 is
    # no shard's boundary (a bundle enters the producer's end, which is >= 1).
    if layer < 1 or (expect.layer is not None and layer != expect.layer):
        expected = (
            "a layer >= 1 (the producer's end)" if expect.layer is None else f"layer {expect.layer}"
        )
        return Violation(ViolationKind.LAYER, f"bundle enters layer {layer}; expected {expected}")
    if session is not None and bundle.session != session:
        return Violation(
            ViolationKind.SESSION,
            f"bundle belongs to session {bundle.session.session_id!r} epoch "
            f"{bundle.session.epoch}; the request names {session.session_id!r} epoch "
            f"{session.epoch}",
        )
    if first_pos is not None and bundle.first_pos != first_pos:
        return Violation(
            ViolationKind.POSITION,
            f"bundle starts at position {bundle.first_pos}; expected {first_pos}",
        )
    if n_tokens is not None and rows != n_tokens:
        return Violation(ViolationKind.ROWS, f"bundle carries {rows} rows; expected {n_tokens}")
    payload = bundle.payload
    size = payload.nbytes if type(payload) is memoryview else memoryview(payload).nbytes
    if expect.max_payload_bytes is not None and size > expect.max_payload_bytes:
        return _size_violation("bundle", size, expect.max_payload_bytes)
    expected_size = rows * width * ITEMSIZE[dtype]
    if size != expected_size:
        return Violation(
            ViolationKind.PAYLOAD_LENGTH,
            f"bundle payload has {size} bytes; header promises {rows} x {width} x {dtype} "
            f"= {expected_size}",
        )
    check_finite = expect.check_finite
    level = scanned(bundle)
    if level:
        # Checksum already verified (or computed from the payload by from_array).
        if not check_finite or level >= SCANNED_FINITE:
            return None
        if not payload_finite(payload, dtype):
            return _payload_violation("bundle hidden states", NONFINITE)
        mark_payload_scanned(bundle, payload, SCANNED_FINITE)
        return None
    status = verify_payload(payload, bundle.checksum, FINITE_KINDS[dtype] if check_finite else 0)
    if status:
        what = "bundle payload" if status == CHECKSUM_MISMATCH else "bundle hidden states"
        return _payload_violation(what, status)
    mark_payload_scanned(bundle, payload, SCANNED_FINITE if check_finite else SCANNED)
    return None


def check_logits(
    result: LogitsResult,
    *,
    vocab_size: int | None = None,
    first_pos: int | None = None,
    n_rows: int | None = None,
    max_payload_bytes: int | None = None,
    check_finite: bool = True,
) -> Violation | None:
    """Check a logits result's header, the expected vocabulary size, first position and row
    count (when given), payload size limit and length, checksum and (when asked) finiteness.
    Returns the first violation, or None; nothing here raises."""
    rows, width = result.n_rows, result.vocab_size
    if rows < 1 or width < 1 or result.first_pos < 0:
        return Violation(
            ViolationKind.HEADER,
            f"logits header out of range: n_rows={rows} (>= 1), vocab_size={width} (>= 1), "
            f"first_pos={result.first_pos} (>= 0)",
        )
    if vocab_size is not None and width != vocab_size:
        return Violation(
            ViolationKind.VOCAB_SIZE, f"logits vocab size {width}; expected {vocab_size}"
        )
    if first_pos is not None and result.first_pos != first_pos:
        return Violation(
            ViolationKind.POSITION,
            f"logits start at position {result.first_pos}; expected {first_pos}",
        )
    if n_rows is not None and rows != n_rows:
        return Violation(ViolationKind.ROWS, f"{rows} logits rows; expected {n_rows}")
    payload = result.payload
    size = memoryview(payload).nbytes
    if max_payload_bytes is not None and size > max_payload_bytes:
        return _size_violation("logits", size, max_payload_bytes)
    expected_size = rows * width * 4
    if size != expected_size:
        return Violation(
            ViolationKind.PAYLOAD_LENGTH,
            f"logits payload has {size} bytes; header promises {rows} x {width} x f32 "
            f"= {expected_size}",
        )
    if scanned(result):
        if check_finite and not payload_finite(payload, "f32"):
            return _payload_violation("logits", NONFINITE)
        return None
    status = verify_payload(payload, result.checksum, _F32_KIND if check_finite else 0)
    if status:
        what = "logits payload" if status == CHECKSUM_MISMATCH else "logits"
        return _payload_violation(what, status)
    return None


# ----------------------------------------------------------------------------- mapping

_SHARD_MISMATCH: Final = frozenset(
    {ViolationKind.FINGERPRINT, ViolationKind.LAYER, ViolationKind.HIDDEN_SIZE}
)


def violation_error(violation: Violation) -> ShardEngineError:
    """The error a receiver of a bad bundle raises (the core and the codec): ShardMismatch
    for another model, layer or hidden size, ContractVersionMismatch, ChecksumMismatch,
    UnsupportedFeature for reserved state, ResourceExhausted (not retryable) for a payload
    above the limit, InvalidRequest for the rest. ``details["violation"]`` names the kind."""
    kind = violation.kind
    details: dict[str, ErrorDetail] = {**violation.details, "violation": kind.value}
    message = violation.message
    if kind in _SHARD_MISMATCH:
        return ShardMismatch(message, details=details)
    if kind is ViolationKind.CONTRACT_VERSION:
        return ContractVersionMismatch(message, details=details)
    if kind is ViolationKind.CHECKSUM:
        return ChecksumMismatch(message, details=details)
    if kind is ViolationKind.RESERVED:
        return UnsupportedFeature(message, details=details)
    if kind is ViolationKind.PAYLOAD_LIMIT:
        # A receiver limit, not a malformed message; the same payload cannot succeed later.
        return ResourceExhausted(message, retryable=False, details=details)
    return InvalidRequest(message, details=details)
