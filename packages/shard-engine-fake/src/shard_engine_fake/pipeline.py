"""Short names over the API's pipeline driver (:class:`shard_engine_api.Pipeline`) for the
fake's tests: one step through every shard, and greedy generation that keeps its session."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api import GREEDY, LogitsResult, Pipeline, Sampler, SessionRef, ShardEngine

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
    return the tail's logits; shard ``i`` gets request id ``f"{request_id}/{i}"``."""
    pipeline = Pipeline(engines)
    return pipeline.step(session, pos, token_ids, decode=decode, request_id=request_id).logits


def generate(
    engines: Sequence[ShardEngine],
    session: SessionRef,
    prompt: Sequence[int],
    n_tokens: int,
    *,
    start_pos: int = 0,
    request_prefix: str = "gen",
) -> Generation:
    """Prefill ``prompt`` at ``start_pos`` then greedily decode ``n_tokens`` tokens. Unlike
    :meth:`Pipeline.generate` the session is kept (the tests continue it)."""
    pipeline = Pipeline(engines)
    choose = Sampler(GREEDY)
    result = pipeline.step(session, start_pos, prompt, request_id=f"{request_prefix}/prefill")
    logits = [np.array(result.logits.array()[-1])]
    tokens: list[int] = []
    pos = start_pos + len(prompt)
    for index in range(n_tokens):
        tokens.append(choose(logits[-1]))
        result = pipeline.step(
            session, pos, tokens[-1:], decode=True, request_id=f"{request_prefix}/{index}"
        )
        logits.append(np.array(result.logits.array()[-1]))
        pos += 1
    return Generation(tokens=tuple(tokens), logits=tuple(logits))
