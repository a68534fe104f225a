"""The ``fake`` plugin of the ``shard_engine`` entry-point group: hook implementations only."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from shard_engine_api import EngineSpec, InvalidRequest, ModelFixture, hookimpl
from shard_engine_fake._engine import FakeEngine
from shard_engine_fake._model import DEFAULT_MODEL, FakeModelSpec, parse_model_reference
from shard_engine_fake._tokenizer import BYTE_VOCAB_SIZE, detokenize, tokenize

ENGINE_NAME = FakeEngine.engine_name


def _has_tokenizer(model: str) -> bool:
    try:
        values = parse_model_reference(model)
    except InvalidRequest:
        return False
    return values.get("vocab_size", FakeModelSpec().vocab_size) >= BYTE_VOCAB_SIZE


@hookimpl
def shard_engine_register() -> EngineSpec:
    return EngineSpec(
        name=ENGINE_NAME,
        factory=FakeEngine,
        evidence="fixture",
        description="Deterministic fake engine with fault injection (no model, no GPU)",
    )


@hookimpl
def shard_engine_model_fixture(engine_name: str, workdir: Path) -> ModelFixture | None:
    if engine_name != ENGINE_NAME:
        return None
    spec = FakeModelSpec()
    return ModelFixture(
        model=DEFAULT_MODEL,
        n_layers=spec.n_layers,
        description=(
            f"built-in fake model: seed {spec.seed}, hidden {spec.hidden_size}, "
            f"vocab {spec.vocab_size}, {spec.n_layers} layers"
        ),
        has_tokenizer=True,
        # A cancellable delay after the cache was written: the conformance suite's cancel
        # lands mid-operation, so the rollback of real work is what it checks.
        cancel_options={
            "faults": {
                "rules": [
                    {
                        "action": {"kind": "delay", "milliseconds": 200},
                        "operations": ["prefill", "decode_batch"],
                    }
                ]
            }
        },
        # The first prefill or decode crashes the engine (the suite's crash test).
        crash_options={
            "faults": {
                "rules": [
                    {
                        "action": {"kind": "crash", "detail": "injected crash (conformance)"},
                        "operations": ["prefill", "decode", "decode_batch"],
                        "limit": 1,
                    }
                ]
            }
        },
        # Uneven pipelines: a one-layer head, a one-layer middle, a one-layer tail.
        splits=((0, 1, 6), (0, 2, 5, 6), (0, 4, 5, 6), (0, 1, 2, 3, 4, 5, 6)),
    )


@hookimpl
def shard_engine_tokenize(engine_name: str, model: str, text: str) -> list[int] | None:
    if engine_name != ENGINE_NAME or not _has_tokenizer(model):
        return None
    return tokenize(text)


@hookimpl
def shard_engine_detokenize(engine_name: str, model: str, token_ids: Sequence[int]) -> str | None:
    if engine_name != ENGINE_NAME or not _has_tokenizer(model):
        return None
    return detokenize(token_ids)
