"""What the core returns: a backend's rows, checked before anything is committed, then turned
into the contract's results."""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from shard_engine_api._backend import OutputMode
from shard_engine_api._checksum import SCANNED, SCANNED_FINITE, mark_scanned
from shard_engine_api._dtypes import checksum_and_finite, overflow_threshold, payload_finite
from shard_engine_api._errors import EngineCrashed, MalformedOutput, ResourceExhausted
from shard_engine_api._types import (
    BoundaryBundle,
    BoundaryDtype,
    BoundaryResult,
    Capabilities,
    LogitsResult,
    SessionRef,
    Timings,
)

__all__ = ["build_result", "check_range", "check_rows", "scan_rows"]


def check_rows(
    caps: Capabilities,
    boundary_dtype: BoundaryDtype,
    rows: npt.NDArray[np.float32],
    output: OutputMode,
    n_tokens: int,
    *,
    finite: bool,
) -> None:
    """Check a backend's rows before anything is committed (the caller rolls back on an
    error): the shape (EngineCrashed); that every value is finite (``finite``, as the caller
    found it: MalformedOutput, because a NaN or an infinity the forward computed is in the
    session's cache too, and every later step of the session would carry it); and that hidden
    states fit the boundary dtype."""
    width = caps.hidden_size if output == "hidden" else caps.vocab_size
    expected_rows = 1 if output == "last" else n_tokens
    if rows.shape != (expected_rows, width):
        raise EngineCrashed(
            f"backend returned shape {rows.shape}, expected {(expected_rows, width)}"
        )
    if not finite:
        kind = "hidden states" if output == "hidden" else "logits"
        raise MalformedOutput(
            f"the forward computed {kind} with NaN or infinite values; nothing was committed "
            "(the model's weights or this input overflow its arithmetic)",
            details={"output": kind},
        )
    if output == "hidden" and boundary_dtype != "f32":
        check_range(rows, boundary_dtype)


def scan_rows(rows: npt.NDArray[np.float32]) -> tuple[int | None, bool]:
    """The checksum of plain f32 rows' bytes (None for any other array, whose result payload
    is a conversion) and whether every value is finite: one pass over plain f32 rows."""
    if _exact_f32(rows):
        return checksum_and_finite(rows.data.cast("B"), "f32")
    return None, bool(np.isfinite(rows).all())


def check_range(rows: npt.NDArray[np.float32], boundary_dtype: BoundaryDtype) -> None:
    """Refuse hidden states that ``boundary_dtype`` would turn into infinities: a finite value
    of magnitude >= its overflow threshold (f16: 65520; bf16: ~3.4e38). ResourceExhausted, not
    retryable (the same shard gives the same states again), naming the dtype and the largest
    magnitude; NaN and infinities already in the rows are not an overflow (they pass, as they
    would in f32, and receivers refuse them under the default non-finite policy)."""
    if not rows.size:
        return
    limit = overflow_threshold(boundary_dtype)
    # Two read-only reductions (no |rows| temporary); NaN fails both comparisons and takes
    # the exact path.
    if float(np.max(rows)) < limit and float(np.min(rows)) > -limit:
        return
    magnitudes = np.abs(rows)
    overflowing = np.isfinite(magnitudes) & (magnitudes >= limit)
    if overflowing.any():
        largest = float(magnitudes[overflowing].max())
        raise ResourceExhausted(
            f"hidden states reach {largest:.4g}, beyond the {boundary_dtype} range (values of "
            f"magnitude >= {limit:.5g} become infinite); load the shard with "
            "boundary_dtype='f32'",
            retryable=False,
            details={
                "resource": "boundary_dtype_range",
                "dtype": boundary_dtype,
                "largest": largest,
                "limit": limit,
            },
        )


def build_result(
    caps: Capabilities,
    boundary_dtype: BoundaryDtype,
    rows: npt.NDArray[np.float32],
    output: OutputMode,
    *,
    request_id: str,
    session: SessionRef,
    start_pos: int,
    n_tokens: int,
    timings: Timings,
    rows_private: bool = False,
    digest: tuple[int, bool] | None = None,
) -> BoundaryResult | LogitsResult:
    """A bundle of hidden rows (non-tail) or the logits of the last / all rows (tail).

    An f32 payload is checked for finiteness here (the payload itself: a copy, or the private
    rows made read-only, never rows the backend may still change) and a result that passes is
    marked so (see
    shard_engine_api._checksum): a ValidatingEngine in front of the core then does not scan it
    again. A result with NaN or infinities carries no such mark, and whoever checks it finds
    them.

    ``rows_private``: the backend promises never to write ``rows`` (or what they view) again
    (``EngineCore.rows_private``); a plain f32 payload is then the rows' own memory, made
    read-only, instead of a copy. ``digest``: the (checksum, finite) of exactly those rows'
    bytes, computed as the backend wrote them; used for private f32 rows instead of hashing
    them again (see ``EngineCore._record_digest``)."""
    if output == "hidden":
        if boundary_dtype == "f32" and _exact_f32(rows):
            payload, checksum, scanned = _f32_payload(rows, rows_private, digest)
            bundle = BoundaryBundle(
                session=session,
                first_pos=start_pos,
                n_tokens=int(rows.shape[0]),
                hidden_size=int(rows.shape[1]),
                dtype="f32",
                layer=caps.shard.end,
                model_fingerprint=caps.model_fingerprint,
                payload=payload,
                checksum=checksum,
            )
            mark_scanned(bundle, scanned)
        else:
            # A conversion (f16, bf16, another input dtype) or a refusal: from_array's.
            bundle = BoundaryBundle.from_array(
                rows,
                session=session,
                first_pos=start_pos,
                layer=caps.shard.end,
                model_fingerprint=caps.model_fingerprint,
                dtype=boundary_dtype,
            )
            if bundle.dtype == "f32" and payload_finite(bundle.payload, "f32"):
                mark_scanned(bundle, SCANNED_FINITE)
        return BoundaryResult(
            request_id=request_id,
            session=session,
            first_pos=start_pos,
            n_tokens=bundle.n_tokens,
            evidence=caps.evidence,
            bundle=bundle,
            timings=timings,
        )
    first_pos = start_pos if output == "all" else start_pos + n_tokens - 1
    if not _exact_f32(rows):
        # Anything but a plain f32 array: from_array converts it or refuses it.
        return LogitsResult.from_array(
            rows,
            request_id=request_id,
            session=session,
            first_pos=first_pos,
            evidence=caps.evidence,
            timings=timings,
        )
    # What from_array builds, minus its copies.
    n_rows, width = rows.shape
    payload, checksum, scanned = _f32_payload(rows, rows_private, digest)
    result = LogitsResult(
        request_id=request_id,
        session=session,
        first_pos=first_pos,
        n_rows=n_rows,
        vocab_size=width,
        evidence=caps.evidence,
        payload=payload,
        checksum=checksum,
        timings=timings,
    )
    mark_scanned(result, scanned)
    return result


_F32: Final = np.dtype("<f4")


def _exact_f32(rows: object) -> bool:
    """Whether ``rows`` is a non-empty, C-contiguous 2-D little-endian f32 array (its bytes
    are a payload)."""
    if type(rows) is not np.ndarray or rows.ndim != 2 or not rows.size:
        return False
    dtype = rows.dtype
    return (dtype is _F32 or dtype == _F32) and rows.flags.c_contiguous


def _f32_payload(
    rows: npt.NDArray[np.float32], private: bool, digest: tuple[int, bool] | None = None
) -> tuple[memoryview, int, int]:
    """The payload of plain f32 ``rows`` with its checksum and its scan mark (SCANNED_FINITE
    when every value is finite, else SCANNED), hashed and tested in one pass. Private rows are
    the payload themselves, made read-only so nothing holding them can change a result through
    them (with a ``digest``, not hashed again); others are copied once into immutable bytes."""
    if private:
        rows.setflags(write=False)
        payload = rows.data.cast("B")
        if digest is not None:
            checksum, finite = digest
            return payload, checksum, SCANNED_FINITE if finite else SCANNED
    else:
        payload = memoryview(rows.tobytes())
    checksum, finite = checksum_and_finite(payload, "f32")
    return payload, checksum, SCANNED_FINITE if finite else SCANNED
