"""Names for engine authors: the core an engine builds on, the registration hook and the
description it returns, plugin discovery, the model store, and the helpers a backend uses to
build and check what it returns (a payload's checksum and finiteness in one pass, the core's
result builder, the health and metrics checks of ``ValidatingEngine``). Worker code needs none
of these; it imports from ``shard_engine_api``. See the package README for a plugin author's
guide."""

from shard_engine_api._core import CancelToken, EngineCore, ForwardItem, ModelInfo, OutputMode
from shard_engine_api._dtypes import checksum_and_finite, copy_checksum_and_finite
from shard_engine_api._hookspecs import (
    TEST_OPTIONS_ENV,
    CliSubparsers,
    EngineDescription,
    ModelFixture,
    Tokenizer,
    hookimpl,
    hookspec,
    test_options_enabled,
)
from shard_engine_api._plugins import (
    ENTRY_POINT_GROUP,
    BrokenPlugin,
    PluginProblem,
    check_pending,
    describe_model,
    engine_description,
    get_plugin_manager,
    model_fixture,
    plugin_problems,
)
from shard_engine_api._results import build_result
from shard_engine_api._store import (
    DEFAULT_MODEL_STORE,
    MODEL_STORE_ENV,
    ModelStoreRefused,
    file_sha256,
    model_store,
    portable_path,
    portable_text,
    unchecked_model_store,
)
from shard_engine_api._validation import health_problem, metrics_problem

__all__ = [
    "DEFAULT_MODEL_STORE",
    "ENTRY_POINT_GROUP",
    "MODEL_STORE_ENV",
    "TEST_OPTIONS_ENV",
    "BrokenPlugin",
    "CancelToken",
    "CliSubparsers",
    "EngineCore",
    "EngineDescription",
    "ForwardItem",
    "ModelFixture",
    "ModelInfo",
    "ModelStoreRefused",
    "OutputMode",
    "PluginProblem",
    "Tokenizer",
    "build_result",
    "check_pending",
    "checksum_and_finite",
    "copy_checksum_and_finite",
    "describe_model",
    "engine_description",
    "file_sha256",
    "get_plugin_manager",
    "health_problem",
    "hookimpl",
    "hookspec",
    "metrics_problem",
    "model_fixture",
    "model_store",
    "plugin_problems",
    "portable_path",
    "portable_text",
    "test_options_enabled",
    "unchecked_model_store",
]
