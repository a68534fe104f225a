"""The ``fake`` plugin of the ``shard_engine`` entry-point group: the reference implementation
of the one registration hook. Everything the project asks of an engine is a field of the
description returned here."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from shard_engine_api import OptionValue
from shard_engine_api.engine import EngineDescription, ModelFixture, Tokenizer, hookimpl
from shard_engine_fake._engine import FakeEngine
from shard_engine_fake._model import DEFAULT_MODEL, FakeModelSpec, parse_model_reference
from shard_engine_fake._tokenizer import BYTE_VOCAB_SIZE, detokenize, tokenize

ENGINE_NAME = FakeEngine.engine_name

# A cancellable delay after the cache was written: the conformance suite's cancel lands
# mid-operation, so the rollback of real work is what it checks. Every operation the suite
# cancels is slowed, a single decode included (a cancel of a running decode must stop it).
_CANCEL_OPTIONS: dict[str, OptionValue] = {
    "faults": {
        "rules": [
            {
                "action": {"kind": "delay", "milliseconds": 200},
                "operations": ["prefill", "decode", "decode_batch"],
            }
        ]
    }
}
# The first prefill or decode crashes the engine: the suite's crash test.
_CRASH_OPTIONS: dict[str, OptionValue] = {
    "faults": {
        "rules": [
            {
                "action": {"kind": "crash", "detail": "injected crash (conformance)"},
                "operations": ["prefill", "decode", "decode_batch"],
                "limit": 1,
            }
        ]
    }
}
# Uneven pipelines of the built-in 6-layer model: one-layer heads, middles and tails.
_SPLITS: tuple[tuple[int, ...], ...] = (
    (0, 1, 6),
    (0, 2, 5, 6),
    (0, 4, 5, 6),
    (0, 1, 2, 3, 4, 5, 6),
)


class _ByteTokenizer:
    """The fake model's byte-level tokenizer (see ``shard_engine_fake._tokenizer``)."""

    def encode(self, text: str) -> list[int]:
        return tokenize(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return detokenize(token_ids)


def _spec_of(model: str) -> FakeModelSpec:
    # Raises InvalidRequest naming the bad part of the reference.
    values = parse_model_reference(model)
    return FakeModelSpec(**values)


def _fixture(spec: FakeModelSpec, *, built_in: bool) -> ModelFixture:
    kind = "built-in fake model" if built_in else "fake model"
    return ModelFixture(
        model=spec.reference,
        n_layers=spec.n_layers,
        description=(
            f"{kind}: seed {spec.seed}, hidden {spec.hidden_size}, vocab {spec.vocab_size}, "
            f"{spec.n_layers} layers"
        ),
        has_tokenizer=spec.vocab_size >= BYTE_VOCAB_SIZE,
        cancel_options=_CANCEL_OPTIONS,
        crash_options=_CRASH_OPTIONS,
    )


def _model_fixture(workdir: Path) -> ModelFixture:
    """The built-in model (it needs no files, so ``workdir`` is never touched)."""
    return msgspec.structs.replace(_fixture(FakeModelSpec(), built_in=True), splits=_SPLITS)


def _describe_model(model: str) -> ModelFixture:
    """``fake`` or ``fake:key=value,...`` (seed, hidden, vocab, layers)."""
    return _fixture(_spec_of(model), built_in=model in ("fake", DEFAULT_MODEL))


def _tokenizer(model: str) -> Tokenizer | None:
    """The byte tokenizer, for models whose vocabulary holds every byte; None for a smaller
    vocabulary. A reference that names no fake model is InvalidRequest, as for loading it:
    a typo is not "a model without a tokenizer"."""
    spec = _spec_of(model)
    return _ByteTokenizer() if spec.vocab_size >= BYTE_VOCAB_SIZE else None


@hookimpl
def shard_engine_register() -> EngineDescription:
    return EngineDescription(
        name=ENGINE_NAME,
        factory=FakeEngine,
        evidence="fixture",
        summary="Deterministic fake engine with fault injection (no model, no GPU)",
        model_fixture=_model_fixture,
        describe_model=_describe_model,
        tokenizer=_tokenizer,
    )
