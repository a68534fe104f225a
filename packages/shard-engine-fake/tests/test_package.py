"""The package surface: pinned exports, the plugin module and the entry point."""

from __future__ import annotations

import inspect
from pathlib import Path

import shard_engine_api as api
import shard_engine_fake
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


def test_plugin_module_holds_only_hook_implementations() -> None:
    functions = {
        name
        for name, value in vars(plugin).items()
        if inspect.isfunction(value) and value.__module__ == plugin.__name__
    }
    hooks = {name for name in functions if name.startswith("shard_engine_")}
    assert hooks == {
        "shard_engine_register",
        "shard_engine_model_fixture",
        "shard_engine_tokenize",
        "shard_engine_detokenize",
    }
    for name in hooks:
        assert hasattr(getattr(plugin, name), "shard_engine_impl"), name


def test_entry_point_discovery_and_load_engine() -> None:
    manager = api.get_plugin_manager()
    api.check_pending(manager)
    engines = {engine.name: engine for engine in api.installed_engines(manager)}
    assert engines["fake"].evidence == "fixture"
    assert engines["fake"].distribution == "shard-engine-fake"
    fixture = manager.hook.shard_engine_model_fixture(engine_name="fake", workdir=Path("."))
    assert isinstance(fixture, api.ModelFixture)
    assert (fixture.model, fixture.n_layers, fixture.has_tokenizer) == (DEFAULT_MODEL, 6, True)
    engine = api.load_engine("fake", fixture.config(0, 3), manager=manager)
    assert isinstance(engine, FakeEngine)
    assert engine.capabilities().role == "head"
    engine.close()


def test_other_engines_are_not_answered() -> None:
    manager = api.get_plugin_manager(entry_points=False, plugins=[("fake", plugin)])
    hook = manager.hook
    assert hook.shard_engine_model_fixture(engine_name="llama", workdir=Path(".")) is None
    assert hook.shard_engine_tokenize(engine_name="llama", model=DEFAULT_MODEL, text="x") is None
    assert hook.shard_engine_tokenize(engine_name="fake", model="fake:vocab=100", text="x") is None
    assert hook.shard_engine_detokenize(engine_name="fake", model="gguf", token_ids=[1]) is None


def test_byte_tokenizer_round_trips() -> None:
    manager = api.get_plugin_manager(entry_points=False, plugins=[("fake", plugin)])
    text = "héllo, shard ✓"
    ids = manager.hook.shard_engine_tokenize(engine_name="fake", model=DEFAULT_MODEL, text=text)
    assert ids == tokenize(text) == list(text.encode())
    back = manager.hook.shard_engine_detokenize(
        engine_name="fake", model=DEFAULT_MODEL, token_ids=ids
    )
    assert back == text
    assert detokenize([72, 105, 256, 511]) == "Hi" + chr(0x20 + 256 % 95) + chr(0x20 + 511 % 95)
