"""The ``llama`` engine plugin: hook implementations only."""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from shard_engine_api import (
    EngineSpec,
    InvalidRequest,
    ModelFixture,
    UnsupportedFeature,
    hookimpl,
)
from shard_engine_api.engine import model_store
from shard_engine_llama import _commands
from shard_engine_llama._fixtures import TINY_MODEL_LAYERS, tiny_model_path

if TYPE_CHECKING:
    from shard_engine_llama._abi import Vocabulary

ENGINE_NAME = "llama"


@hookimpl
def shard_engine_register() -> EngineSpec:
    from shard_engine_llama._engine import LlamaEngine

    return EngineSpec(
        name=ENGINE_NAME,
        factory=LlamaEngine,
        evidence="real",
        description="llama.cpp (llama-cpp-python, CPU) running GGUF layer ranges bit-exactly",
    )


MODEL_ENV = "SHARD_ENGINE_LLAMA_MODEL"
"""A GGUF path that replaces the generated tiny model (e.g. for certification on a real model)."""


@hookimpl
def shard_engine_model_fixture(engine_name: str, workdir: Path) -> ModelFixture | None:
    if engine_name != ENGINE_NAME:
        return None
    real_model = os.environ.get(MODEL_ENV)
    if real_model:
        described = shard_engine_describe_model(engine_name, real_model)
        assert described is not None
        return msgspec.structs.replace(described, options={"n_ubatch": 16})
    # The store check: the tiny model is written there, and never under /home.
    path = tiny_model_path(model_store(workdir))
    return ModelFixture(
        model=str(path),
        n_layers=TINY_MODEL_LAYERS,
        options={"n_ubatch": 16},
        description=f"generated tiny llama GGUF ({TINY_MODEL_LAYERS} layers, n_embd 64, F32)",
        has_tokenizer=True,
        synthetic=True,
    )


@hookimpl
def shard_engine_describe_model(engine_name: str, model: str) -> ModelFixture | None:
    if engine_name != ENGINE_NAME:
        return None
    from shard_engine_llama._gguf_split import (
        GGUFValidationError,
        inspect_gguf,
    )

    path = Path(model)
    if not path.is_file():
        raise InvalidRequest(f"model file {path} does not exist")
    try:
        info = inspect_gguf(path)
    except GGUFValidationError as error:
        raise InvalidRequest(str(error)) from error
    if not info.shardable and not info.is_shard:
        raise UnsupportedFeature(f"{path.name} cannot be sharded: {info.refusal}")
    return ModelFixture(
        model=str(path.resolve()),
        n_layers=info.n_layers,
        description=f"{path.name} ({info.architecture}, {info.n_layers} layers)",
        has_tokenizer=True,
        synthetic=False,
    )


@functools.lru_cache(maxsize=4)
def _vocabulary(model: str) -> Vocabulary:
    # Imported here: llama_cpp loads only when a tokenizer is really needed.
    from shard_engine_llama._abi import Vocabulary

    return Vocabulary(model)


@hookimpl
def shard_engine_tokenize(engine_name: str, model: str, text: str) -> list[int] | None:
    if engine_name != ENGINE_NAME:
        return None
    return _vocabulary(model).tokenize(text)


@hookimpl
def shard_engine_detokenize(engine_name: str, model: str, token_ids: Sequence[int]) -> str | None:
    if engine_name != ENGINE_NAME:
        return None
    return _vocabulary(model).detokenize(token_ids)


@hookimpl
def shard_engine_add_cli_commands(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    _commands.add_commands(subparsers)
