"""Measure how far an engine's outputs move when the same positions are computed through
other batch shapes: the numbers a ``Determinism`` tolerance must bound.

    python tools/measure_tolerance.py --engine llama [--model PATH] [--sequences N]

The engine runs on its conformance model fixture (the generated tiny model, or the GGUF named
by ``--model``, which is passed as the plugin's ``SHARD_ENGINE_LLAMA_MODEL``) with the
fixture's load options, on a full shard and on a head and a middle shard. For ``--sequences``
token sequences of 40 positions it computes one prefill of all rows and compares every row
with the same positions sent as chunks of 1 (decode steps), 3, 7, 16 and 17 rows and as the
rows of a 3-session ``decode_batch``: exactly the comparisons of the conformance suite.

Per output row ``e`` (expected) and ``a`` (other shape) it reports ``max|a - e|`` and that
divided by ``max|e|`` (the row's magnitude); the maxima per output kind (logits, hidden states)
are what the engine's declared ``Tolerance(absolute, relative)`` must cover with a margin, and
``absolute_needed`` gives, for relative parts of 0.1 to 0.5, the smallest absolute part that
covers every row (a row of small magnitude can differ by more than half of it while no row
differs by much in absolute terms). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from shard_engine_api import (
    BoundaryBundle,
    BoundaryResult,
    DecodeBatchRequest,
    DecodeRequest,
    ErrorInfo,
    LogitsResult,
    PrefillRequest,
    ReleaseRequest,
    SessionRef,
    ShardEngine,
    ShardInput,
    ShardResult,
    TokenInput,
)
from shard_engine_api.engine import (
    ModelFixture,
    engine_description,
    get_plugin_manager,
    model_fixture,
)

LENGTH = 40
CHUNKS = (1, 3, 7, 16, 17)
LIMITS: dict[str, object] = {
    "max_sessions": 4,
    "max_context": 64,
    "max_batch_tokens": 64,
    "kv_budget_tokens": 256,
}

Rows = npt.NDArray[np.float64]


@dataclass
class Kind:
    """Every row's difference and magnitude seen for one output kind, and the row with the
    largest relative difference."""

    max_relative: float = 0.0
    worst: dict[str, object] = field(default_factory=dict)
    gaps: list[float] = field(default_factory=list)
    magnitudes: list[float] = field(default_factory=list)

    def absolute_needed(self, relative: float) -> float:
        """The smallest absolute part of a ``Tolerance(absolute, relative)`` that covers every
        row seen: max over rows of ``gap - relative * magnitude`` (0 when none exceeds)."""
        if not self.gaps:
            return 0.0
        gaps, magnitudes = np.asarray(self.gaps), np.asarray(self.magnitudes)
        return max(0.0, float(np.max(gaps - relative * magnitudes)))

    def summary(self) -> dict[str, object]:
        return {
            "rows": len(self.gaps),
            "max_abs": max(self.gaps, default=0.0),
            "max_relative": self.max_relative,
            "max_magnitude": max(self.magnitudes, default=0.0),
            "worst": self.worst,
            "absolute_needed": {
                f"relative {relative}": self.absolute_needed(relative)
                for relative in (0.1, 0.2, 0.3, 0.4, 0.5)
            },
        }

    def add(self, got: Rows, want: Rows, what: str) -> None:
        gap = np.abs(got - want).max(axis=1)
        magnitude = np.abs(want).max(axis=1)
        self.gaps.extend(float(value) for value in gap)
        self.magnitudes.extend(float(value) for value in magnitude)
        relative = gap / np.maximum(magnitude, np.finfo(np.float64).tiny)
        index = int(relative.argmax())
        if float(relative[index]) > self.max_relative:
            self.max_relative = float(relative[index])
            self.worst = {
                "comparison": what,
                "row": index,
                "abs": float(gap[index]),
                "row_magnitude": float(magnitude[index]),
            }


def _rows(result: ShardResult) -> Rows:
    if isinstance(result, LogitsResult):
        return np.asarray(result.array(), dtype=np.float64)
    assert isinstance(result, BoundaryResult)
    return np.asarray(result.bundle.array(), dtype=np.float64)


class Runner:
    def __init__(self, engine: ShardEngine, upstream: ShardEngine | None) -> None:
        self.engine = engine
        self.upstream = upstream
        self.counter = 0

    def _id(self) -> str:
        self.counter += 1
        return f"measure-{self.counter}"

    def inputs(
        self, tokens: Sequence[int], first: int, count: int, session: SessionRef
    ) -> ShardInput:
        """Positions ``first..first+count-1``: tokens, or the rows of an upstream run over the
        whole sequence (the same rows for every shape, so only this shard's shape varies)."""
        if self.upstream is None:
            return TokenInput(token_ids=tuple(tokens[first : first + count]))
        scratch = SessionRef(session_id=self._id(), epoch=1)
        result = self.upstream.prefill(
            PrefillRequest(
                request_id=self._id(),
                session=scratch,
                start_pos=0,
                inputs=TokenInput(token_ids=tuple(tokens)),
            )
        )
        self.upstream.release(ReleaseRequest(session=scratch))
        assert isinstance(result, BoundaryResult)
        rows = np.asarray(result.bundle.array())[first : first + count]
        return BoundaryBundle.from_array(
            np.ascontiguousarray(rows),
            session=session,
            first_pos=first,
            layer=result.bundle.layer,
            model_fingerprint=result.bundle.model_fingerprint,
            dtype=result.bundle.dtype,
        )

    def prefill(self, session: SessionRef, tokens: Sequence[int], first: int, count: int) -> Rows:
        result = self.engine.prefill(
            PrefillRequest(
                request_id=self._id(),
                session=session,
                start_pos=first,
                inputs=self.inputs(tokens, first, count, session),
                logits="all",
            )
        )
        return _rows(result)

    def decode(self, session: SessionRef, tokens: Sequence[int], pos: int) -> Rows:
        result = self.engine.decode(
            DecodeRequest(
                request_id=self._id(),
                session=session,
                pos=pos,
                inputs=self.inputs(tokens, pos, 1, session),
            )
        )
        return _rows(result)

    def release(self, session: SessionRef) -> None:
        self.engine.release(ReleaseRequest(session=session))


def measure_shard(
    fixture: ModelFixture,
    factory: object,
    start: int,
    end: int,
    sequences: int,
    kinds: dict[str, Kind],
) -> None:
    assert callable(factory)
    engines: list[ShardEngine] = []

    def load(first: int, last: int) -> ShardEngine:
        engine = factory()
        assert isinstance(engine, ShardEngine)
        engine.load(fixture.config(first, last, **LIMITS))
        engines.append(engine)
        return engine

    try:
        engine = load(start, end)
        caps = engine.capabilities()
        kind = kinds["logits" if caps.shard.emits_logits else "hidden"]
        runner = Runner(engine, load(0, start) if start > 0 else None)
        vocab = caps.vocab_size if caps.shard.takes_tokens else 256
        if runner.upstream is not None:
            vocab = runner.upstream.capabilities().vocab_size
        where = f"[{start}, {end})"
        for seed in range(sequences):
            tokens = [(seed * 7919 + i * 104729 + 17) % vocab for i in range(LENGTH)]
            whole_session = SessionRef(session_id=f"whole-{seed}", epoch=1)
            whole = runner.prefill(whole_session, tokens, 0, LENGTH)
            runner.release(whole_session)
            for chunk in CHUNKS:
                session = SessionRef(session_id=f"chunk-{chunk}-{seed}", epoch=1)
                parts: list[Rows] = []
                for first in range(0, LENGTH, chunk):
                    count = min(chunk, LENGTH - first)
                    if chunk == 1 and first > 0:
                        parts.append(runner.decode(session, tokens, first))
                    else:
                        parts.append(runner.prefill(session, tokens, first, count))
                runner.release(session)
                kind.add(np.concatenate(parts), whole, f"{where} chunks of {chunk}")
            # decode_batch: three sessions at different lengths, one row each.
            lengths = (LENGTH - 3, LENGTH - 2, LENGTH - 1)
            sessions = [SessionRef(session_id=f"batch-{seed}-{n}", epoch=1) for n in lengths]
            for session, length in zip(sessions, lengths, strict=True):
                runner.prefill(session, tokens, 0, length)
            items = tuple(
                DecodeRequest(
                    request_id=runner._id(),
                    session=session,
                    pos=length,
                    inputs=runner.inputs(tokens, length, 1, session),
                )
                for session, length in zip(sessions, lengths, strict=True)
            )
            batch = engine.decode_batch(DecodeBatchRequest(request_id=runner._id(), items=items))
            for outcome, length in zip(batch.items, lengths, strict=True):
                assert not isinstance(outcome, ErrorInfo), outcome
                kind.add(_rows(outcome), whole[length : length + 1], f"{where} decode_batch")
            for session in sessions:
                runner.release(session)
    finally:
        for engine in engines:
            engine.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="llama")
    parser.add_argument("--model", type=Path, help="a GGUF instead of the generated model")
    parser.add_argument("--sequences", type=int, default=3)
    args = parser.parse_args(argv)
    if args.model is not None:
        os.environ["SHARD_ENGINE_LLAMA_MODEL"] = str(args.model.resolve())
    manager = get_plugin_manager()
    description = engine_description(args.engine, manager=manager)
    with tempfile.TemporaryDirectory() as workdir:
        fixture = model_fixture(manager, args.engine, Path(workdir))
        n = fixture.n_layers
        kinds = {"logits": Kind(), "hidden": Kind()}
        shards = [(0, n), (0, max(1, n // 2)), (max(1, n // 3), max(2, 2 * n // 3))]
        for start, end in shards:
            measure_shard(fixture, description.factory, start, end, args.sequences, kinds)
    report = {
        "engine": args.engine,
        "model": fixture.description,
        "options": dict(fixture.options),
        "sequences": args.sequences,
        "positions": LENGTH,
        "shapes": [f"chunks of {c}" for c in CHUNKS] + ["decode_batch of 3"],
        "shards": [list(shard) for shard in shards],
        **{name: kind.summary() for name, kind in kinds.items()},
    }
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
