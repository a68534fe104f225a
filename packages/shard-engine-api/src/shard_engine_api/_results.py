"""What the core returns: a backend's rows, checked before anything is committed, then turned
into the contract's results."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from shard_engine_api._backend import OutputMode
from shard_engine_api._dtypes import overflow_threshold
from shard_engine_api._errors import EngineCrashed, ResourceExhausted
from shard_engine_api._types import (
    BoundaryBundle,
    BoundaryDtype,
    BoundaryResult,
    Capabilities,
    LogitsResult,
    SessionRef,
    Timings,
)

__all__ = ["build_result", "check_range", "check_rows"]


def check_rows(
    caps: Capabilities,
    boundary_dtype: BoundaryDtype,
    rows: npt.NDArray[np.float32],
    output: OutputMode,
    n_tokens: int,
) -> None:
    """Check a backend's rows before anything is committed (the caller rolls back on an
    error): the shape (EngineCrashed), and that hidden states fit the boundary dtype."""
    width = caps.hidden_size if output == "hidden" else caps.vocab_size
    expected_rows = 1 if output == "last" else n_tokens
    if rows.shape != (expected_rows, width):
        raise EngineCrashed(
            f"backend returned shape {rows.shape}, expected {(expected_rows, width)}"
        )
    if output == "hidden" and boundary_dtype != "f32":
        check_range(rows, boundary_dtype)


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
    if float(rows.max()) < limit and float(rows.min()) > -limit:
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
) -> BoundaryResult | LogitsResult:
    """A bundle of hidden rows (non-tail) or the logits of the last / all rows (tail)."""
    if output == "hidden":
        bundle = BoundaryBundle.from_array(
            rows,
            session=session,
            first_pos=start_pos,
            layer=caps.shard.end,
            model_fingerprint=caps.model_fingerprint,
            dtype=boundary_dtype,
        )
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
    return LogitsResult.from_array(
        rows,
        request_id=request_id,
        session=session,
        first_pos=first_pos,
        evidence=caps.evidence,
        timings=timings,
    )
