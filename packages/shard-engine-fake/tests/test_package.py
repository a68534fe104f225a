"""The package surface: pinned exports, the plugin module and the entry point."""

from __future__ import annotations

from pathlib import Path

import pytest

import shard_engine_api as api
import shard_engine_fake
from shard_engine_api.engine import (
    ModelFixture,
    Tokenizer,
    check_pending,
    engine_description,
    get_plugin_manager,
)
from shard_engine_fake import DEFAULT_MODEL, FakeEngine, detokenize, plugin, tokenize

EXPECTED_ALL = [
    "DEFAULT_MODEL",
    "ENGINE_VERSION",
    "FAULTS_ENV_VAR",
    "Crash",
    "Defect",
    "Delay",
    "FakeEngine",
    "FakeModelSpec",
    "FaultAction",
    "FaultEvent",
    "FaultPlan",
    "FaultRule",
    "Malformed",
    "MemoryPressure",
    "MemoryRelief",
    "Operation",
    "StateFailure",
    "__version__",
    "corrupt_result",
    "detokenize",
    "fault_plan_from_options",
    "load_fault_plan",
    "parse_model_reference",
    "resolve_model",
    "tokenize",
]


def test_all_is_sorted_and_pinned() -> None:
    assert shard_engine_fake.__all__ == EXPECTED_ALL

    # isort-style order (what ruff's RUF022 keeps): constants, then classes, then the rest.
    def kind(name: str) -> tuple[int, str]:
        return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)

    assert shard_engine_fake.__all__ == sorted(shard_engine_fake.__all__, key=kind)
    for name in shard_engine_fake.__all__:
        assert hasattr(shard_engine_fake, name), name


def test_plugin_module_implements_only_the_registration_hook() -> None:
    """No hook is keyed by engine name: the one hook returns the whole description."""
    hooks = {name for name in vars(plugin) if name.startswith("shard_engine_")}
    assert hooks == {"shard_engine_register"}
    assert hasattr(plugin.shard_engine_register, "shard_engine_impl")


def test_entry_point_discovery_and_load_engine() -> None:
    manager = get_plugin_manager()
    check_pending(manager)
    engines = {engine.name: engine for engine in api.installed_engines(manager)}
    assert engines["fake"].evidence == "fixture"
    assert engines["fake"].distribution == "shard-engine-fake"
    description = engine_description("fake", manager=manager)
    assert description.model_fixture is not None
    fixture = description.model_fixture(Path("never-created"))
    assert not Path("never-created").exists()
    assert isinstance(fixture, ModelFixture)
    assert (fixture.model, fixture.n_layers, fixture.has_tokenizer) == (DEFAULT_MODEL, 6, True)
    engine = api.load_engine("fake", fixture.config(0, 3), manager=manager)
    assert isinstance(engine, FakeEngine)
    assert engine.capabilities().role == "head"
    engine.close()


def test_described_models_follow_the_reference() -> None:
    description = plugin.shard_engine_register()
    assert description.describe_model is not None
    small = description.describe_model("fake:hidden=32,layers=4")
    assert (small.n_layers, small.model) == (4, "fake:seed=0,hidden=32,vocab=512,layers=4")
    assert small.config(0, 2).shard.n_layers == 4
    assert not description.describe_model("fake:vocab=100").has_tokenizer
    with pytest.raises(api.InvalidRequest, match="layers"):
        description.describe_model("fake:layers=x")


def test_tokenizer_only_for_byte_vocabularies() -> None:
    description = plugin.shard_engine_register()
    assert description.tokenizer is not None
    assert description.tokenizer("fake:vocab=100") is None
    with pytest.raises(api.InvalidRequest):  # no fake model: refused, as loading it is
        description.tokenizer("gguf")
    assert description.tokenizer(DEFAULT_MODEL) is not None


def test_byte_tokenizer_round_trips() -> None:
    manager = get_plugin_manager(entry_points=False, plugins=[("fake", plugin)])
    text = "héllo, shard ✓"
    tokenizer = engine_description("fake", manager=manager).tokenizer
    assert tokenizer is not None
    found = tokenizer(DEFAULT_MODEL)
    assert isinstance(found, Tokenizer)
    ids = found.encode(text)
    assert ids == tokenize(text) == list(text.encode())
    assert found.decode(ids) == text
    assert detokenize([72, 105, 256, 511]) == "Hi" + chr(0x20 + 256 % 95) + chr(0x20 + 511 % 95)
