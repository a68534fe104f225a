"""A minimal in-process pipeline for tests and benchmarks: drive engines head -> ... -> tail for
one session, prefill then greedy decode. (The API's generic pipeline is what the CLI uses; this
one exists so the fake's tests need nothing beyond the contract.)"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api import (
    BoundaryResult,
    DecodeRequest,
    InvalidRequest,
    LogitsResult,
    PrefillRequest,
    SessionRef,
    ShardEngine,
    ShardInput,
    TokenInput,
)

__all__ = ["Generation", "generate", "step"]


class Generation(msgspec.Struct, frozen=True, kw_only=True):
    """Greedy generation output: the new token ids and the last-row logits of every step
    (the prefill first, then one per decoded token)."""

    tokens: tuple[int, ...]
    logits: tuple[npt.NDArray[np.float32], ...]


def step(
    engines: Sequence[ShardEngine],
    session: SessionRef,
    pos: int,
    token_ids: Sequence[int],
    *,
    request_id: str,
    decode: bool = False,
) -> LogitsResult:
    """Run ``token_ids`` at ``pos`` through every shard (prefill, or decode of one token) and
    return the tail's logits. Raises whatever a shard raises, and InvalidRequest when a shard
    returns the wrong kind of result for its place in the chain."""
    inputs: ShardInput = TokenInput(token_ids=tuple(token_ids))
    for index, engine in enumerate(engines):
        shard_request_id = f"{request_id}/{index}"
        result = (
            engine.decode(
                DecodeRequest(request_id=shard_request_id, session=session, pos=pos, inputs=inputs)
            )
            if decode
            else engine.prefill(
                PrefillRequest(
                    request_id=shard_request_id, session=session, start_pos=pos, inputs=inputs
                )
            )
        )
        is_last = index == len(engines) - 1
        if isinstance(result, BoundaryResult) and not is_last:
            inputs = result.bundle
        elif isinstance(result, LogitsResult) and is_last:
            return result
        else:
            raise InvalidRequest(f"shard {index} returned {type(result).__name__} out of place")
    raise InvalidRequest("a pipeline needs at least one engine")


def generate(
    engines: Sequence[ShardEngine],
    session: SessionRef,
    prompt: Sequence[int],
    n_tokens: int,
    *,
    start_pos: int = 0,
    request_prefix: str = "gen",
) -> Generation:
    """Prefill ``prompt`` at ``start_pos`` then greedily decode ``n_tokens`` tokens."""
    result = step(engines, session, start_pos, prompt, request_id=f"{request_prefix}/prefill")
    logits = [np.array(result.array()[-1])]
    tokens: list[int] = []
    pos = start_pos + len(prompt)
    for index in range(n_tokens):
        token = int(np.argmax(logits[-1]))
        tokens.append(token)
        result = step(
            engines, session, pos, (token,), request_id=f"{request_prefix}/{index}", decode=True
        )
        logits.append(np.array(result.array()[-1]))
        pos += 1
    return Generation(tokens=tuple(tokens), logits=tuple(logits))
