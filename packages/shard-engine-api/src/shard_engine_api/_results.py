"""What the core returns: a backend's rows, checked before anything is committed, then turned
into the contract's results."""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from shard_engine_api._backend import OutputMode
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

__all__ = ["build_result", "check_rows"]

_F16_MAX: Final = 65504.0


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
    if output == "hidden" and boundary_dtype == "f16":
        largest = float(np.max(np.abs(rows))) if rows.size else 0.0
        if not largest <= _F16_MAX:
            raise ResourceExhausted(
                f"hidden states reach {largest:.4g}, beyond the f16 range; load the shard "
                "with boundary_dtype='f32'",
                retryable=False,
                details={"resource": "boundary_dtype_range"},
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
