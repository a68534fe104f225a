"""What a :class:`~shard_engine_llama._abi.ShardRuntime` takes: its context settings, the rows
of a batched decode, and token ids checked to fit llama.cpp's int32 before they are staged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, cast

import numpy as np
import numpy.typing as npt

from shard_engine_llama._llama_library import InvalidInputError

__all__ = ["BatchItem", "ContextSettings", "checked_tokens"]

_INT32: Final = np.dtype(np.int32)


@dataclass(frozen=True, kw_only=True)
class ContextSettings:
    """Context settings; shards of one pipeline must use identical values for bitwise results."""

    n_ctx: int = 512
    n_seq_max: int = 4
    n_threads: int = 2
    n_batch: int = 512
    n_ubatch: int = 512
    flash_attn: bool = False
    kv_type: str = "f32"


@dataclass(slots=True)
class BatchItem:
    """One row of a batched decode: a sequence, its position and its token or hidden-state row.
    (A value, never changed once built; not frozen only because one is built per row of every
    batched step, and a frozen dataclass costs several times more to build.)"""

    seq_id: int
    pos: int
    token: int | None = None
    embedding: npt.NDArray[np.float32] | None = None


def checked_tokens(tokens: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.int32]:
    """Token ids as int32, refusing values that do not fit (they are checked against the
    vocabulary afterwards)."""
    if type(tokens) is np.ndarray and tokens.dtype is _INT32 and tokens.ndim == 1:
        # The decode step's case: numpy calls cost more than the row, cold.
        return cast("npt.NDArray[np.int32]", tokens)
    if type(tokens) is list and tokens:
        if all(type(token) is int for token in tokens):
            # A batch step's ids: the range test on the ints, not on an int64 array.
            if min(tokens) < -(2**31) or max(tokens) >= 2**31:
                raise InvalidInputError("token id outside the int32 range")
            return np.array(tokens, dtype=_INT32)
        if any(isinstance(token, bool | np.bool_) for token in tokens):
            # (numpy would read True and False among ints as the ids 1 and 0)
            raise InvalidInputError("token ids must be a 1-D sequence of integers")
    array = np.asarray(tokens)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InvalidInputError("token ids must be a 1-D sequence of integers")
    if array.dtype == np.int32:
        return array  # every value fits (the decode step's case: no reductions)
    if array.size and (int(array.min()) < -(2**31) or int(array.max()) >= 2**31):
        raise InvalidInputError("token id outside the int32 range")
    return array.astype(np.int32, copy=False)
