"""``ShardEngineConformance``: the standard suite every engine must pass.

An engine's test module subclasses it in one line::

    from shard_engine_api.conformance import ShardEngineConformance

    class TestMyEngine(ShardEngineConformance):
        engine_name = "mine"

The engine is found through its ``shard_engine`` entry point and runs on the model the
``model_fixture`` of its registered EngineDescription supplies. A subclass may instead override
the ``make_engine`` and ``model_fixture`` classmethods (no entry point needed).

Optional class attributes:

- ``cancel_load_options``: extra ``LoadConfig.options`` for the cancellation test, to make an
  operation slow enough to be cancelled mid-way (for example an engine's artificial per-token
  delay). Without it the suite uses the longest prefill the limits allow.

Standard tests may not be deleted or silently replaced: a subclass that defines a method with
a standard test's name must mark it ``@conformance_override(reason="...")``, else the class
fails to be created; the reason is written to the report. The standard test names are pinned
in :data:`STANDARD_TESTS`.

Tests are skipped, with the reason, when a capability they need is not advertised (batched
decode, cancellation, truncation, eviction, determinism) or the fixture model has too few
layers for a split.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import ClassVar, Final, TypeVar

import pluggy
import pytest

from shard_engine_api._hookspecs import TEST_OPTIONS_ENV, ModelFixture
from shard_engine_api._plugins import (
    engine_description,
    get_plugin_manager,
    installed_engines,
    load_engine,
)
from shard_engine_api._plugins import model_fixture as plugin_model_fixture
from shard_engine_api._protocol import ShardEngine
from shard_engine_api._types import OptionValue
from shard_engine_api.conformance._batching import BATCHING_TESTS, BatchingTests
from shard_engine_api.conformance._cancellation import CANCELLATION_TESTS, CancellationTests
from shard_engine_api.conformance._concurrency import CONCURRENCY_TESTS, ConcurrencyTests
from shard_engine_api.conformance._error_checks import ERROR_CHECK_TESTS, ErrorCheckTests
from shard_engine_api.conformance._harness import EngineUnderTest, Harness
from shard_engine_api.conformance._lifecycle import LIFECYCLE_TESTS, LifecycleTests
from shard_engine_api.conformance._limits import LIMIT_TESTS, LimitTests
from shard_engine_api.conformance._migration import MIGRATION_TESTS, MigrationTests
from shard_engine_api.conformance._model_based import MODEL_BASED_TESTS, ModelBasedTests
from shard_engine_api.conformance._numerics import NUMERICS_TESTS, NumericsTests
from shard_engine_api.conformance._recorder import RECORDER_KEY, Recorder
from shard_engine_api.conformance._report import model_report
from shard_engine_api.conformance._results import RESULT_TESTS, ResultTests
from shard_engine_api.conformance._scale import SCALE_TESTS, ScaleTests
from shard_engine_api.conformance._sessions import SESSION_TESTS, SessionTests

__all__ = ["STANDARD_TESTS", "ShardEngineConformance", "conformance_override"]

STANDARD_TESTS: Final[tuple[str, ...]] = tuple(
    sorted(
        LIFECYCLE_TESTS
        + ERROR_CHECK_TESTS
        + SESSION_TESTS
        + LIMIT_TESTS
        + CANCELLATION_TESTS
        + BATCHING_TESTS
        + NUMERICS_TESTS
        + RESULT_TESTS
        + MODEL_BASED_TESTS
        + CONCURRENCY_TESTS
        + MIGRATION_TESTS
        + SCALE_TESTS
    )
)
"""Every standard test, sorted. Pinned: the suite refuses to import if its methods differ."""

_OVERRIDE_ATTRIBUTE: Final = "__conformance_override__"


_Function = TypeVar("_Function", bound=Callable[..., object])


def conformance_override(*, reason: str) -> Callable[[_Function], _Function]:
    """Mark a method that replaces a standard test; ``reason`` goes into the report."""
    if not reason.strip():
        raise ValueError("conformance_override needs a non-empty reason")

    def mark(function: _Function) -> _Function:
        setattr(function, _OVERRIDE_ATTRIBUTE, reason)
        return function

    return mark


@functools.cache
def _entry_point_manager() -> pluggy.PluginManager:
    # Scanning entry points costs milliseconds; the suite asks for a manager per class.
    return get_plugin_manager()


_CUSTOMIZABLE: Final = (
    "engine_name",
    "cancel_load_options",
    "make_engine",
    "model_fixture",
    "plugin_manager",
)
"""What a subclass may set or override (besides standard tests marked with
``@conformance_override``; ``conformance_overrides`` is computed from those marks)."""


@functools.cache
def _internals() -> frozenset[str]:
    """Every attribute of the suite's classes a subclass may not replace: helpers and fixtures
    (not the standard tests, guarded on their own, nor the customization points)."""
    return frozenset(
        name
        for klass in ShardEngineConformance.__mro__
        if klass is not object
        for name in vars(klass)
        if not name.startswith("__")
        and not name.startswith("test_")
        and name not in _CUSTOMIZABLE
        and name != "conformance_overrides"
    )


def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class ShardEngineConformance(
    LifecycleTests,
    ErrorCheckTests,
    SessionTests,
    LimitTests,
    CancellationTests,
    BatchingTests,
    NumericsTests,
    ResultTests,
    ModelBasedTests,
    ConcurrencyTests,
    MigrationTests,
    ScaleTests,
):
    """The standard conformance suite. Subclass it with ``engine_name`` set (or leave it None
    to take the engine from ``--shard-engine``)."""

    engine_name: ClassVar[str | None] = None
    cancel_load_options: ClassVar[Mapping[str, OptionValue]] = {}
    conformance_overrides: ClassVar[Mapping[str, str]] = {}
    """Standard tests this class replaced, with reasons (filled in at class creation)."""

    harness: Harness

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        overrides = dict(cls.conformance_overrides)
        suite_classes = frozenset(ShardEngineConformance.__mro__)
        for name in _internals():
            owner = next(klass for klass in cls.__mro__ if name in vars(klass))
            if owner not in suite_classes:
                # A helper every standard test relies on (_batch, _need_layers, the harness
                # fixture) would change what the tests check without replacing any of them.
                raise TypeError(
                    f"{cls.__qualname__} replaces {name}, an internal of the conformance suite; "
                    f"only {', '.join(_CUSTOMIZABLE)} may be customized (and a standard test "
                    "with @conformance_override)"
                )
        for name in STANDARD_TESTS:
            # The class the test resolves to, not only this one's own namespace: a mixin
            # listed before the suite (class TestMine(Mixin, ShardEngineConformance)) would
            # otherwise replace a standard test unseen.
            owner = next(klass for klass in cls.__mro__ if name in vars(klass))
            if owner in suite_classes:
                continue
            value = vars(owner)[name]
            reason = getattr(value, _OVERRIDE_ATTRIBUTE, None)
            if not callable(value) or not isinstance(reason, str):
                raise TypeError(
                    f"{cls.__qualname__}.{name} replaces a standard conformance test; a standard "
                    "test may not be deleted or silently overridden. Mark the replacement with "
                    "@conformance_override(reason=...) so the report shows why."
                )
            overrides[name] = reason
        cls.conformance_overrides = overrides

    # ----------------------------------------------------------------- engine supply

    @classmethod
    def plugin_manager(cls) -> pluggy.PluginManager:
        """The plugin manager engines and model fixtures are found through (the installed
        ``shard_engine`` entry points)."""
        return _entry_point_manager()

    @classmethod
    def make_engine(cls, name: str) -> ShardEngine:
        """A new, unloaded engine. Override to test an engine without an entry point."""
        return load_engine(name, manager=cls.plugin_manager())

    @classmethod
    def model_fixture(cls, name: str, workdir: Path) -> ModelFixture:
        """The small model the suite runs on, generated under ``workdir``. Override to
        supply one without an EngineDescription ``model_fixture``."""
        return plugin_model_fixture(cls.plugin_manager(), name, workdir)

    @classmethod
    def _uses_entry_point(cls) -> bool:
        for klass in cls.__mro__:
            if klass is ShardEngineConformance:
                return True
            if "make_engine" in vars(klass):
                return False
        return True

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_target(
        cls, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
    ) -> EngineUnderTest:
        """The engine and model fixture of this suite class (built once per class)."""
        # The class the test runs in (a subclass), which is where overrides live.
        suite = request.cls
        assert suite is not None
        assert issubclass(suite, ShardEngineConformance)
        name = suite.engine_name or request.config.getoption("shard_engine", default=None)
        if not name:
            pytest.skip("no engine selected: pass --shard-engine NAME or set engine_name")
        # The suite loads engines with the fixture's test-only options (crash_options,
        # cancel_options); engines accept those only in a process that allows them, and this
        # is a test process. Set before any engine exists, so spawned ones inherit it.
        os.environ[TEST_OPTIONS_ENV] = "1"
        recorder = request.config.stash.get(RECORDER_KEY, None) or Recorder()
        record = recorder.suite(request.node.nodeid)
        record.engine = str(name)
        record.overrides = dict(suite.conformance_overrides)
        record.distributions["shard-engine-api"] = _distribution_version("shard-engine-api")
        if suite._uses_entry_point():
            manager = suite.plugin_manager()
            for installed in installed_engines(manager):
                if installed.name == name:
                    record.distributions[installed.distribution] = installed.version
            record.spec_evidence = [engine_description(str(name), manager=manager).evidence]
            factory: Callable[[], ShardEngine] = functools.partial(suite.make_engine, str(name))
        else:
            factory = functools.partial(suite.make_engine, str(name))
            probe = factory()
            package = type(probe).__module__.split(".")[0]
            record.distributions[package.replace("_", "-")] = _distribution_version(
                package.replace("_", "-")
            )
            probe.close()
        workdir = tmp_path_factory.mktemp(f"model-fixture-{name}")
        fixture = suite.model_fixture(str(name), workdir)
        record.model = model_report(
            fixture.model,
            description=fixture.description,
            n_layers=fixture.n_layers,
            synthetic=fixture.synthetic,
        )
        return EngineUnderTest(
            name=str(name),
            fixture=fixture,
            factory=factory,
            record=record,
            cancel_load_options=dict(suite.cancel_load_options or fixture.cancel_options),
        )

    @pytest.fixture(autouse=True)
    def _conformance_harness(
        self, conformance_target: EngineUnderTest, request: pytest.FixtureRequest
    ) -> Iterator[None]:
        self.harness = Harness(conformance_target, request.node.name)
        try:
            yield
        finally:
            self.harness.close_all()


def _check_pinned() -> None:
    defined = sorted(name for name in dir(ShardEngineConformance) if name.startswith("test_"))
    if tuple(defined) != STANDARD_TESTS:
        raise RuntimeError(
            f"ShardEngineConformance defines {defined}, STANDARD_TESTS pins {STANDARD_TESTS}"
        )
    for name in defined:
        if not getattr(ShardEngineConformance, name).__doc__:
            raise RuntimeError(f"standard test {name} has no docstring")


_check_pinned()
