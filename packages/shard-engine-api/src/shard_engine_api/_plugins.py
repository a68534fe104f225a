"""Plugin discovery: a plugin manager per caller, the engines its plugins describe, and
``load_engine`` to select one engine by its entry-point name.

The ``shard_engine`` entry points are scanned and imported once per process. Each plugin
manager asks each of its plugins once for its :class:`EngineDescription` and keeps the answer.
A plugin that fails (its module does not import or exits, it implements a hook no spec
declares or no ``shard_engine_register`` at all, its ``shard_engine_register`` raises or returns
something else, its entry-point name is not its engine name, another distribution declares the
same entry-point name) is recorded as a :class:`PluginProblem` under its name and left out; the
other engines stay available. ``shard-engine engines`` lists both. ``load_engine`` raises
BrokenPlugin for an engine whose factory fails or makes something that is not a ShardEngine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import logging
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import msgspec
import pluggy

from shard_engine_api._errors import InvalidRequest, ShardEngineError, UnsupportedFeature
from shard_engine_api._hookspecs import (
    PROJECT_NAME,
    EngineDescription,
    EngineHookSpecs,
    ModelFixture,
    Tokenizer,
)
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import LoadConfig

__all__ = [
    "ENTRY_POINT_GROUP",
    "BrokenPlugin",
    "InstalledEngine",
    "PluginProblem",
    "UnknownEngine",
    "add_cli_commands",
    "check_pending",
    "describe_model",
    "detokenize",
    "engine_description",
    "get_plugin_manager",
    "installed_engines",
    "load_engine",
    "load_tokenizer",
    "model_fixture",
    "plugin_problems",
    "tokenize",
    "tokenizer",
]

ENTRY_POINT_GROUP = "shard_engine"
_LOG = logging.getLogger("shard_engine.plugins")


class UnknownEngine(InvalidRequest):
    """Raised when no installed plugin provides the named engine; the message lists the
    installed ones (and the broken ones, by name)."""

    code = "unknown_engine"


class BrokenPlugin(UnknownEngine):
    """Raised when the named engine's plugin is installed but failed (see PluginProblem)."""

    code = "broken_plugin"


class InstalledEngine(msgspec.Struct, frozen=True, kw_only=True):
    """An engine found through its plugin: what ``shard-engine engines`` lists."""

    name: str
    distribution: str
    version: str
    evidence: str
    summary: str


class PluginProblem(msgspec.Struct, frozen=True, kw_only=True):
    """A plugin that was left out, under the name it was registered with (the entry-point
    name), with the distribution that ships it and one line saying what went wrong."""

    plugin: str
    distribution: str
    version: str
    problem: str


class _EntryPoint(msgspec.Struct, frozen=True):
    name: str
    distribution: str
    version: str
    plugin: object | None
    problem: str | None


_PLUGIN_FAILURES: Final = (Exception, SystemExit)
"""What a third-party plugin's import or hook may raise and be left out for: SystemExit too
(a module that exits when its backend library is missing must not end every caller of
``load_engine``); KeyboardInterrupt still stops the program."""


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _distribution_of(entry: importlib.metadata.EntryPoint) -> tuple[str, str]:
    if entry.dist is None:
        return "unknown", "unknown"
    return entry.dist.name, entry.dist.version


@functools.cache
def _entry_points() -> tuple[_EntryPoint, ...]:
    """Every ``shard_engine`` entry point, imported once per process."""
    found: list[_EntryPoint] = []
    by_name: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        declared = by_name.setdefault(entry.name, [])
        if all(entry.value != other.value for other in declared):
            declared.append(entry)
    for name, declared in by_name.items():
        entry = declared[0]
        distribution, version = _distribution_of(entry)
        if len(declared) > 1:
            # Which one import order would pick is an accident of sys.path: refuse the name
            # (every other engine stays available) rather than run an engine nobody chose.
            origins = "; ".join(
                "{} {} ({})".format(*_distribution_of(other), other.value) for other in declared
            )
            twice = f"entry point {name!r} is declared more than once: {origins}"
            found.append(_EntryPoint(name, distribution, version, None, twice))
            continue
        try:
            plugin: object | None = entry.load()
            problem = None
        except _PLUGIN_FAILURES as error:  # any import failure of a third-party plugin
            plugin, problem = None, f"failed to import {entry.value}: {_one_line(error)}"
        found.append(_EntryPoint(entry.name, distribution, version, plugin, problem))
    return tuple(sorted(found, key=lambda entry: entry.name))


class _Engine(msgspec.Struct, frozen=True):
    description: EngineDescription
    distribution: str
    version: str


class _Catalog:
    """What one plugin manager's plugins provide, asked once."""

    def __init__(self) -> None:
        self.origins: dict[str, tuple[str, str]] = {}
        self.problems: list[PluginProblem] = []
        self.engines: dict[str, _Engine] | None = None

    def problem(self, plugin: str, problem: str) -> None:
        distribution, version = self.origins.get(plugin, ("unknown", "unknown"))
        _LOG.warning("engine plugin %r (%s): %s", plugin, distribution, problem)
        self.problems.append(
            PluginProblem(
                plugin=plugin, distribution=distribution, version=version, problem=problem
            )
        )


_CATALOGS: weakref.WeakKeyDictionary[pluggy.PluginManager, _Catalog] = weakref.WeakKeyDictionary()


def _catalog_of(manager: pluggy.PluginManager) -> _Catalog:
    catalog = _CATALOGS.get(manager)
    if catalog is None:
        catalog = _CATALOGS[manager] = _Catalog()
    return catalog


def _register(manager: pluggy.PluginManager, catalog: _Catalog, name: str, plugin: object) -> None:
    try:
        manager.register(plugin, name=name)
    except _PLUGIN_FAILURES as error:
        # A validation error, a duplicate name, or the plugin's own attribute access failing
        # while pluggy looks for hook implementations on it.
        catalog.problem(name, _one_line(error))


def get_plugin_manager(
    *, entry_points: bool = True, plugins: Sequence[tuple[str, object]] = ()
) -> pluggy.PluginManager:
    """A new plugin manager with the hookspec, the ``shard_engine`` entry points (unless
    ``entry_points`` is false) and ``plugins`` (name, module-or-object) registered.

    Broken plugins are not registered; :func:`plugin_problems` says why."""
    manager = pluggy.PluginManager(PROJECT_NAME)
    manager.add_hookspecs(EngineHookSpecs)
    catalog = _catalog_of(manager)
    if entry_points:
        for entry in _entry_points():
            catalog.origins[entry.name] = (entry.distribution, entry.version)
            if entry.plugin is None:
                catalog.problem(entry.name, entry.problem or "failed to import")
            else:
                _register(manager, catalog, entry.name, entry.plugin)
    for name, plugin in plugins:
        _register(manager, catalog, name, plugin)
    return manager


def check_pending(manager: pluggy.PluginManager) -> None:
    """Raise InvalidRequest naming the plugin and the hook if a plugin implements a hook that
    no hookspec declares (a misspelt hook name)."""
    try:
        manager.check_pending()
    except pluggy.PluginValidationError as error:
        raise InvalidRequest(
            f"plugin {manager.get_name(error.plugin)!r}: {_one_line(error)}"
        ) from error


def _drop_plugins_with_unknown_hooks(manager: pluggy.PluginManager, catalog: _Catalog) -> None:
    # check_pending() stops at the first offender; drop it and look again, so one misspelt
    # hook leaves out its own plugin only.
    for _ in range(len(manager.get_plugins()) + 1):
        try:
            manager.check_pending()
            return
        except pluggy.PluginValidationError as error:
            name = manager.get_name(error.plugin) or repr(error.plugin)
            catalog.problem(name, f"{_one_line(error)} (a misspelt hook name?)")
            manager.unregister(error.plugin)


def _engines(manager: pluggy.PluginManager) -> dict[str, _Engine]:
    catalog = _catalog_of(manager)
    if catalog.engines is not None:
        return catalog.engines
    _drop_plugins_with_unknown_hooks(manager, catalog)
    engines: dict[str, _Engine] = {}
    # Each plugin's implementation is called on its own (not manager.hook.shard_engine_register()
    # for all at once), so that one plugin's exception names that plugin and leaves the rest.
    for implementation in manager.hook.shard_engine_register.get_hookimpls():
        name = implementation.plugin_name
        try:
            description = implementation.function()
        except _PLUGIN_FAILURES as error:  # a third-party plugin's own failure
            catalog.problem(name, f"shard_engine_register raised {_one_line(error)}")
            continue
        if not isinstance(description, EngineDescription):
            catalog.problem(
                name,
                f"shard_engine_register returned {type(description).__name__}, not an "
                "EngineDescription",
            )
            continue
        if name in catalog.origins and name != description.name:
            catalog.problem(
                name,
                f"the entry point {name!r} registers engine {description.name!r}; the "
                "entry-point name must be the engine name",
            )
            continue
        if description.name in engines:
            catalog.problem(name, f"engine {description.name!r} is already provided")
            continue
        distribution, version = catalog.origins.get(name, _origin_of(implementation.plugin))
        engines[description.name] = _Engine(description, distribution, version)
    implemented = {
        implementation.plugin_name
        for implementation in manager.hook.shard_engine_register.get_hookimpls()
    }
    for name, _plugin in manager.list_name_plugin():
        if name not in implemented:
            # Registered, but pluggy found no hook on it: without this it would be "not
            # installed", which its author cannot tell from a missing entry point.
            catalog.problem(
                name,
                "implements no shard_engine_register hook (is it marked with "
                "shard_engine_api.engine.hookimpl?)",
            )
    catalog.engines = dict(sorted(engines.items()))
    return catalog.engines


def _origin_of(plugin: object) -> tuple[str, str]:
    module = getattr(plugin, "__name__", None) or type(plugin).__module__
    package = str(module).split(".")[0]
    try:
        return package.replace("_", "-"), importlib.metadata.version(package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return package, "unknown"


def installed_engines(manager: pluggy.PluginManager) -> list[InstalledEngine]:
    """Every engine the manager's working plugins provide, sorted by name."""
    return [
        InstalledEngine(
            name=name,
            distribution=engine.distribution,
            version=engine.version,
            evidence=engine.description.evidence,
            summary=engine.description.summary,
        )
        for name, engine in _engines(manager).items()
    ]


def plugin_problems(manager: pluggy.PluginManager) -> list[PluginProblem]:
    """The plugins that were left out, and why."""
    _engines(manager)
    return list(_catalog_of(manager).problems)


def _installed_list(manager: pluggy.PluginManager) -> str:
    names = ", ".join(_engines(manager)) or "none"
    broken = [problem.plugin for problem in _catalog_of(manager).problems]
    return f"installed: {names}" + (f"; broken: {', '.join(broken)}" if broken else "")


def engine_description(
    name: str, *, manager: pluggy.PluginManager | None = None
) -> EngineDescription:
    """The description the named engine's plugin registered.

    Raises UnknownEngine (listing the installed engines) when no plugin provides ``name``, and
    BrokenPlugin when the plugin of that name is installed but failed."""
    manager = manager or get_plugin_manager()
    engine = _engines(manager).get(name)
    if engine is not None:
        return engine.description
    for problem in _catalog_of(manager).problems:
        if problem.plugin == name:
            raise BrokenPlugin(
                f"engine {name!r} ({problem.distribution} {problem.version}) is installed but "
                f"its plugin failed: {problem.problem}"
            )
    if name in PROJECT_DISTRIBUTIONS:
        raise UnknownEngine(
            f"engine {name!r} is not installed ({_installed_list(manager)}); install it: "
            f"{install_command(name)}"
        )
    raise UnknownEngine(
        f"engine {name!r} is not installed ({_installed_list(manager)}); install a "
        f"distribution that declares a {ENTRY_POINT_GROUP!r} entry point named {name!r}"
    )


PROJECT_DISTRIBUTIONS: Final = {
    "fake": "shard-engine-fake",
    "llama": "shard-engine-llama",
    "remote": "shard-engine-remote",
}
"""This project's own engines and the distributions that provide them: a missing one's error
names the pip command that installs it."""


def install_command(engine: str) -> str:
    """The pip command that installs one of this project's engines (``PROJECT_DISTRIBUTIONS``)."""
    distribution = PROJECT_DISTRIBUTIONS[engine]
    return (
        f"python3 -m pip install ./packages/{distribution} (from the repository root; "
        f"elsewhere: python3 -m pip install {distribution})"
    )


def load_engine(
    name: str,
    config: LoadConfig | None = None,
    *,
    manager: pluggy.PluginManager | None = None,
) -> ShardEngine:
    """A new engine of the named plugin, loaded with ``config`` when one is given.

    Raises UnknownEngine (listing the installed engines) when no plugin provides ``name``, and
    BrokenPlugin when its plugin failed, its factory raised something outside the taxonomy or
    returned something that is not a ShardEngine; a failed load's own error otherwise.
    """
    description = engine_description(name, manager=manager)
    try:
        engine = description.factory()
    except ShardEngineError:
        raise
    except _PLUGIN_FAILURES as error:
        raise BrokenPlugin(
            f"engine {name!r}: its factory raised {_one_line(error)}", details={"engine": name}
        ) from error
    if not isinstance(engine, ShardEngine):
        raise BrokenPlugin(
            f"engine {name!r}: its factory returned {type(engine).__name__}, which is not a "
            "ShardEngine (it lacks the contract's operations)",
            details={"engine": name},
        )
    if config is not None:
        try:
            engine.load(config)
        except BaseException:
            # The load's own error is the one to report, not a failure of the clean-up.
            with contextlib.suppress(Exception):
                engine.close()
            raise
    return engine


def model_fixture(manager: pluggy.PluginManager, engine_name: str, workdir: Path) -> ModelFixture:
    """The small model ``engine_name`` runs its conformance suite and ``run`` on.

    Raises UnknownEngine, or UnsupportedFeature when the engine supplies no fixture."""
    description = engine_description(engine_name, manager=manager)
    if description.model_fixture is None:
        raise UnsupportedFeature(
            f"engine {engine_name!r} supplies no built-in model; name one with --model"
        )
    return description.model_fixture(workdir)


def describe_model(manager: pluggy.PluginManager, engine_name: str, model: str) -> ModelFixture:
    """What ``engine_name`` knows of a user-given model reference (layer count, options).

    Raises UnknownEngine, or UnsupportedFeature when the engine cannot describe models."""
    description = engine_description(engine_name, manager=manager)
    if description.describe_model is None:
        raise UnsupportedFeature(
            f"engine {engine_name!r} does not take a --model; it runs its built-in model only"
        )
    return description.describe_model(model)


def tokenizer(manager: pluggy.PluginManager, engine_name: str, model: str) -> Tokenizer | None:
    """The tokenizer of ``model`` on ``engine_name``, or None when there is none.

    Raises InvalidRequest when ``model`` is not a non-empty str, the plugin's own typed error
    for a model it refuses, and BrokenPlugin when its tokenizer hook raised something outside
    the taxonomy or returned something without ``encode`` and ``decode``."""
    if type(model) is not str or not model:
        raise InvalidRequest(f"model must be a non-empty str, got {model!r}")
    description = engine_description(engine_name, manager=manager)
    if description.tokenizer is None:
        return None
    try:
        found = description.tokenizer(model)
    except ShardEngineError:
        raise
    except _PLUGIN_FAILURES as error:
        raise BrokenPlugin(
            f"engine {engine_name!r}: its tokenizer raised {_one_line(error)}",
            details={"engine": engine_name},
        ) from error
    if found is not None and not (
        callable(getattr(found, "encode", None)) and callable(getattr(found, "decode", None))
    ):
        raise BrokenPlugin(
            f"engine {engine_name!r}: its tokenizer hook returned {type(found).__name__}, which "
            "has no encode and decode",
            details={"engine": engine_name},
        )
    return found


def load_tokenizer(
    name: str, model: str, *, manager: pluggy.PluginManager | None = None
) -> Tokenizer | None:
    """The tokenizer engine ``name`` has for ``model``, or None when it has none. Raises
    UnknownEngine like :func:`load_engine`."""
    return tokenizer(manager or get_plugin_manager(), name, model)


def tokenize(
    manager: pluggy.PluginManager, engine_name: str, model: str, text: str
) -> list[int] | None:
    """Token ids of ``text``, or None when the engine has no tokenizer for ``model``."""
    found = tokenizer(manager, engine_name, model)
    return None if found is None else found.encode(text)


def detokenize(
    manager: pluggy.PluginManager, engine_name: str, model: str, token_ids: Sequence[int]
) -> str | None:
    """Text of ``token_ids``, or None when the engine has no tokenizer for ``model``."""
    found = tokenizer(manager, engine_name, model)
    return None if found is None else found.decode(list(token_ids))


def add_cli_commands(
    manager: pluggy.PluginManager, subparsers: argparse._SubParsersAction[argparse.ArgumentParser]
) -> None:
    """Let every engine add its subcommands; one that fails is recorded and left out."""
    catalog = _catalog_of(manager)
    for name, engine in _engines(manager).items():
        add = engine.description.add_cli_commands
        if add is None:
            continue
        try:
            add(subparsers)
        except _PLUGIN_FAILURES as error:  # a third-party plugin's own failure
            catalog.problem(name, f"add_cli_commands raised {_one_line(error)}")
