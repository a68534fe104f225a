"""Names for engine authors: the core an engine builds on, the plugin hook markers, the model
description objects and the model store. Worker code needs none of these; it imports from
``shard_engine_api``."""

from shard_engine_api._core import CancelToken, EngineCore, ForwardItem, ModelInfo, OutputMode
from shard_engine_api._hookspecs import EngineSpec, ModelFixture, hookimpl, hookspec
from shard_engine_api._store import (
    DEFAULT_MODEL_STORE,
    MODEL_STORE_ENV,
    ModelStoreRefused,
    file_sha256,
    model_store,
)

__all__ = [
    "DEFAULT_MODEL_STORE",
    "MODEL_STORE_ENV",
    "CancelToken",
    "EngineCore",
    "EngineSpec",
    "ForwardItem",
    "ModelFixture",
    "ModelInfo",
    "ModelStoreRefused",
    "OutputMode",
    "file_sha256",
    "hookimpl",
    "hookspec",
    "model_store",
]
