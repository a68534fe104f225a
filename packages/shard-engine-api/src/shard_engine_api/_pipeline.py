"""A sharded pipeline: head -> middle... -> tail engines driven for one session, with greedy
decoding. Worker code does this across machines; here it runs in one process, for the ``run``
command, benchmarks and tests."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api._codec import Codec, encode_bundle
from shard_engine_api._errors import InvalidRequest, MalformedOutput
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import (
    BoundaryBundle,
    BoundaryResult,
    DecodeRequest,
    LogitsResult,
    PrefillRequest,
    ReleaseRequest,
    SessionRef,
    ShardInput,
    ShardResult,
    TokenInput,
)

__all__ = ["GenerationResult", "Pipeline", "ShardTimings", "split_layers"]


def split_layers(n_layers: int, n_parts: int) -> list[tuple[int, int]]:
    """Split ``n_layers`` into ``n_parts`` contiguous ranges as evenly as possible (earlier
    ranges get the extra layer)."""
    if not 1 <= n_parts <= n_layers:
        raise InvalidRequest(f"cannot split {n_layers} layers into {n_parts} shards")
    base, extra = divmod(n_layers, n_parts)
    ranges: list[tuple[int, int]] = []
    start = 0
    for index in range(n_parts):
        end = start + base + (1 if index < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


class ShardTimings(msgspec.Struct, frozen=True, kw_only=True):
    """Per-shard wall time of one generation, in milliseconds."""

    shard: str
    prefill_ms: float
    decode_ms_median: float
    decode_ms_total: float


class GenerationResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a greedy generation produced: the new token ids, the last logits row of every
    step (prefill then each decode), and timings."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    step_logits: tuple[bytes, ...]
    shard_timings: tuple[ShardTimings, ...]
    prefill_ms: float
    decode_ms_median: float
    wire_bytes: int = 0

    def logits(self) -> npt.NDArray[np.float32]:
        """``(steps, vocab)`` array of the last-row logits of every step."""
        return np.stack([np.frombuffer(row, dtype="<f4") for row in self.step_logits])


class Pipeline:
    """Engines ordered head to tail (one engine of role "full" is a pipeline too).

    With ``wire=True`` every bundle crosses each boundary as msgpack bytes, decoded by a
    :class:`Codec` that expects the next shard's fingerprint and layer, as it would between
    machines; ``wire_bytes`` counts what crossed."""

    def __init__(self, engines: Sequence[ShardEngine], *, wire: bool = False) -> None:
        if not engines:
            raise InvalidRequest("a pipeline needs at least one engine")
        specs = [engine.capabilities().shard for engine in engines]
        if specs[0].start != 0 or specs[-1].end != specs[-1].n_layers:
            raise InvalidRequest("a pipeline must start at layer 0 and end at the last layer")
        for before, after in itertools.pairwise(specs):
            if before.end != after.start:
                raise InvalidRequest(
                    f"shards [{before.start},{before.end}) and [{after.start},{after.end}) "
                    "are not contiguous"
                )
        self.engines = list(engines)
        self._counter = 0
        self.wire_bytes = 0
        self._codecs: list[Codec | None] = [None] * len(self.engines)
        if wire:
            for index, engine in enumerate(self.engines[1:], start=1):
                caps = engine.capabilities()
                self._codecs[index] = Codec(
                    expected_fingerprint=caps.model_fingerprint, expected_layer=caps.shard.start
                )

    def _request_id(self) -> str:
        self._counter += 1
        return f"pipeline-{id(self):x}-{self._counter}"

    def _step(
        self, session: SessionRef, pos: int, inputs: ShardInput, *, prefill: bool
    ) -> tuple[LogitsResult, list[float]]:
        elapsed: list[float] = []
        current: ShardInput = inputs
        result: ShardResult | None = None
        for engine, codec in zip(self.engines, self._codecs, strict=True):
            started = time.perf_counter()
            if codec is not None and isinstance(current, BoundaryBundle):
                encoded = encode_bundle(current)
                self.wire_bytes += len(encoded)
                current = codec.decode_bundle(encoded)
            if prefill:
                result = engine.prefill(
                    PrefillRequest(
                        request_id=self._request_id(),
                        session=session,
                        start_pos=pos,
                        inputs=current,
                    )
                )
            else:
                result = engine.decode(
                    DecodeRequest(
                        request_id=self._request_id(), session=session, pos=pos, inputs=current
                    )
                )
            elapsed.append((time.perf_counter() - started) * 1000.0)
            if isinstance(result, BoundaryResult):
                current = result.bundle
        if not isinstance(result, LogitsResult):
            raise MalformedOutput("the last shard of a pipeline did not return logits")
        return result, elapsed

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        session: SessionRef | None = None,
    ) -> GenerationResult:
        """Prefill ``prompt_ids`` then greedily decode ``max_new_tokens`` tokens (argmax, lowest
        id on ties). The session is released afterwards."""
        if not prompt_ids:
            raise InvalidRequest("the prompt has no tokens")
        session = session or SessionRef(session_id=f"generate-{self._request_id()}", epoch=1)
        per_shard_prefill: list[float] = []
        per_shard_decode: list[list[float]] = [[] for _ in self.engines]
        step_logits: list[bytes] = []
        new_tokens: list[int] = []
        started = time.perf_counter()
        logits, per_shard_prefill = self._step(
            session, 0, TokenInput(token_ids=tuple(prompt_ids)), prefill=True
        )
        prefill_ms = (time.perf_counter() - started) * 1000.0
        decode_times: list[float] = []
        pos = len(prompt_ids)
        for step in range(max_new_tokens + 1):
            row = logits.array()[-1]
            step_logits.append(row.tobytes())
            if step == max_new_tokens:
                break
            token = int(np.argmax(row))
            new_tokens.append(token)
            started = time.perf_counter()
            logits, elapsed = self._step(
                session, pos, TokenInput(token_ids=(token,)), prefill=False
            )
            decode_times.append((time.perf_counter() - started) * 1000.0)
            for index, value in enumerate(elapsed):
                per_shard_decode[index].append(value)
            pos += 1
        for engine in self.engines:
            engine.release(ReleaseRequest(session=session))
        timings = tuple(
            ShardTimings(
                shard=_describe(engine),
                prefill_ms=per_shard_prefill[index],
                decode_ms_median=statistics.median(per_shard_decode[index])
                if per_shard_decode[index]
                else 0.0,
                decode_ms_total=sum(per_shard_decode[index]),
            )
            for index, engine in enumerate(self.engines)
        )
        return GenerationResult(
            prompt_ids=tuple(prompt_ids),
            token_ids=tuple(new_tokens),
            step_logits=tuple(step_logits),
            shard_timings=timings,
            prefill_ms=prefill_ms,
            decode_ms_median=statistics.median(decode_times) if decode_times else 0.0,
        )


def _describe(engine: ShardEngine) -> str:
    caps = engine.capabilities()
    return f"{caps.engine}[{caps.shard.start}:{caps.shard.end}] ({caps.role})"
