"""Plugin discovery: a plugin manager per caller (no global state), typed hook wrappers and
``load_engine`` to select one engine by its entry-point name."""

from __future__ import annotations

import argparse
import importlib.metadata
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import msgspec
import pluggy

from shard_engine_api._errors import InvalidRequest
from shard_engine_api._hookspecs import PROJECT_NAME, EngineHookSpecs, EngineSpec, ModelFixture
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import LoadConfig

__all__ = [
    "ENTRY_POINT_GROUP",
    "InstalledEngine",
    "UnknownEngine",
    "add_cli_commands",
    "check_pending",
    "describe_model",
    "detokenize",
    "get_plugin_manager",
    "installed_engines",
    "load_engine",
    "model_fixture",
    "tokenize",
]

ENTRY_POINT_GROUP = "shard_engine"


class UnknownEngine(InvalidRequest):
    """Raised by ``load_engine`` when no installed plugin provides the named engine; the
    message lists the installed ones."""

    code = "unknown_engine"


class InstalledEngine(msgspec.Struct, frozen=True, kw_only=True):
    """An engine found through its entry point: what ``shard-engine engines`` lists."""

    name: str
    distribution: str
    version: str
    evidence: str
    description: str


def get_plugin_manager(
    *, entry_points: bool = True, plugins: Sequence[tuple[str, object]] = ()
) -> pluggy.PluginManager:
    """A new plugin manager with the hookspecs, the ``shard_engine`` entry points (unless
    ``entry_points`` is false) and ``plugins`` (name, module-or-object) registered."""
    manager = pluggy.PluginManager(PROJECT_NAME)
    manager.add_hookspecs(EngineHookSpecs)
    if entry_points:
        manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    for name, plugin in plugins:
        manager.register(plugin, name=name)
    return manager


def check_pending(manager: pluggy.PluginManager) -> None:
    """Raise if a plugin implements a hook that no hookspec declares (a typo'd hook name)."""
    manager.check_pending()


def _distribution_of(manager: pluggy.PluginManager, plugin: object) -> tuple[str, str]:
    for plugin_object, distribution in manager.list_plugin_distinfo():
        if plugin_object is plugin:
            return distribution.project_name, distribution.version
    module = plugin if isinstance(plugin, ModuleType) else None
    package = module.__name__.split(".")[0] if module else type(plugin).__module__.split(".")[0]
    try:
        return package, importlib.metadata.version(package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return package, "unknown"


def installed_engines(manager: pluggy.PluginManager) -> list[InstalledEngine]:
    """Every engine the registered plugins provide, sorted by name. A plugin registered under
    an entry-point name must provide the engine of that name."""
    found: list[InstalledEngine] = []
    for plugin in manager.get_plugins():
        impl = getattr(plugin, "shard_engine_register", None)
        if impl is None:
            continue
        spec = impl()
        if not isinstance(spec, EngineSpec):
            raise InvalidRequest(f"plugin {manager.get_name(plugin)!r} registered {spec!r}")
        registered_name = manager.get_name(plugin)
        if (
            registered_name is not None
            and registered_name != spec.name
            and not str(registered_name).isdigit()
        ):
            raise InvalidRequest(
                f"entry point {registered_name!r} provides engine {spec.name!r}; the entry-point "
                "name must be the engine name"
            )
        distribution, version = _distribution_of(manager, plugin)
        found.append(
            InstalledEngine(
                name=spec.name,
                distribution=distribution,
                version=version,
                evidence=spec.evidence,
                description=spec.description,
            )
        )
    return sorted(found, key=lambda engine: engine.name)


def _engine_specs(manager: pluggy.PluginManager) -> dict[str, EngineSpec]:
    specs: list[EngineSpec] = manager.hook.shard_engine_register()
    return {spec.name: spec for spec in specs}


def load_engine(
    name: str,
    config: LoadConfig | None = None,
    *,
    manager: pluggy.PluginManager | None = None,
) -> ShardEngine:
    """A new engine of the named plugin, loaded with ``config`` when one is given.

    Raises UnknownEngine (listing the installed engines) when no plugin provides ``name``.
    """
    manager = manager or get_plugin_manager()
    specs = _engine_specs(manager)
    spec = specs.get(name)
    if spec is None:
        installed = ", ".join(sorted(specs)) or "none"
        raise UnknownEngine(
            f"no shard engine named {name!r} is installed (installed: {installed}); install a "
            f"distribution that declares a {ENTRY_POINT_GROUP!r} entry point named {name!r}"
        )
    engine = spec.factory()
    if config is not None:
        engine.load(config)
    return engine


def model_fixture(manager: pluggy.PluginManager, engine_name: str, workdir: Path) -> ModelFixture:
    """The small model ``engine_name`` runs its conformance suite and ``run`` on."""
    fixture: ModelFixture | None = manager.hook.shard_engine_model_fixture(
        engine_name=engine_name, workdir=workdir
    )
    if fixture is None:
        raise UnknownEngine(f"engine {engine_name!r} supplies no model fixture")
    return fixture


def describe_model(manager: pluggy.PluginManager, engine_name: str, model: str) -> ModelFixture:
    """What ``engine_name`` knows of a user-given model reference (layer count, options)."""
    fixture: ModelFixture | None = manager.hook.shard_engine_describe_model(
        engine_name=engine_name, model=model
    )
    if fixture is None:
        raise UnknownEngine(f"engine {engine_name!r} cannot describe model {model!r}")
    return fixture


def tokenize(
    manager: pluggy.PluginManager, engine_name: str, model: str, text: str
) -> list[int] | None:
    """Token ids of ``text``, or None when the engine has no tokenizer for ``model``."""
    result: list[int] | None = manager.hook.shard_engine_tokenize(
        engine_name=engine_name, model=model, text=text
    )
    return result


def detokenize(
    manager: pluggy.PluginManager, engine_name: str, model: str, token_ids: Sequence[int]
) -> str | None:
    """Text of ``token_ids``, or None when the engine has no tokenizer for ``model``."""
    result: str | None = manager.hook.shard_engine_detokenize(
        engine_name=engine_name, model=model, token_ids=list(token_ids)
    )
    return result


def add_cli_commands(
    manager: pluggy.PluginManager, subparsers: argparse._SubParsersAction[argparse.ArgumentParser]
) -> None:
    """Let every plugin add its subcommands."""
    manager.hook.shard_engine_add_cli_commands(subparsers=subparsers)
