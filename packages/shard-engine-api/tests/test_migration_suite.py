"""The migration standard tests hold engines to session migration: they pass on the
reference engine and on the fake, and each broken engine of ``migration_engines`` fails
exactly the tests its bug breaks (mirroring test_conformance_suite for the other standard
tests). Each run is an in-process pytest session on a generated suite module, selecting the
migration tests only."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
from migration_engines import MIGRATION_BROKEN

from shard_engine_api.conformance import STANDARD_TESTS
from shard_engine_api.conformance._migration import MIGRATION_TESTS

pytest_plugins = ["pytester"]

TESTS_DIR: Final = Path(__file__).parent

SUITE_MODULE: Final = """
from pathlib import Path

from conformance_engines import CANCEL_OPTIONS, reference_fixture
from {module} import {engine} as Engine
from shard_engine_api import ShardEngine
from shard_engine_api.engine import ModelFixture
from shard_engine_api.conformance import ShardEngineConformance


class TestEngine(ShardEngineConformance):
    engine_name = "reference"
    cancel_load_options = CANCEL_OPTIONS

    @classmethod
    def make_engine(cls, name: str) -> ShardEngine:
        return Engine()

    @classmethod
    def model_fixture(cls, name: str, workdir: Path) -> ModelFixture:
        return reference_fixture(workdir)
"""

OPTIONS: Final = (
    "-W",
    "error",
    "-p",
    "no:cacheprovider",
    "-p",
    "no:hypothesispytest",
    "-p",
    "no:benchmark",
    "-k",
    "test_migration_",
)


def _run(pytester: pytest.Pytester, module: str, engine: str) -> dict[str, str]:
    pytester.syspathinsert(TESTS_DIR)
    pytester.makepyfile(test_suite=SUITE_MODULE.format(module=module, engine=engine))
    recorder = pytester.inline_run(*OPTIONS)
    outcomes: dict[str, str] = {}
    for report in recorder.getreports("pytest_runtest_logreport"):
        name = report.nodeid.rsplit("::", 1)[-1]
        if report.failed:
            outcomes[name] = "failed" if report.when == "call" else "error"
        elif report.skipped:
            outcomes.setdefault(name, "skipped")
        elif report.when == "call":
            outcomes.setdefault(name, "passed")
    return outcomes


def test_migration_tests_are_standard_tests() -> None:
    assert set(MIGRATION_TESTS) <= set(STANDARD_TESTS)
    assert tuple(sorted(MIGRATION_TESTS)) == MIGRATION_TESTS


def test_reference_engine_passes_every_migration_test(pytester: pytest.Pytester) -> None:
    outcomes = _run(pytester, "conformance_engines", "ReferenceEngine")
    assert outcomes == dict.fromkeys(MIGRATION_TESTS, "passed")


@pytest.mark.parametrize("broken", sorted(MIGRATION_BROKEN))
def test_broken_migration_fails_the_expected_tests(pytester: pytest.Pytester, broken: str) -> None:
    entry = MIGRATION_BROKEN[broken]
    outcomes = _run(pytester, "migration_engines", entry.engine.__name__)
    assert set(outcomes) == set(MIGRATION_TESTS), outcomes
    failed = {name for name, outcome in outcomes.items() if outcome != "passed"}
    missed = set(entry.fails) - failed
    extra = failed - set(entry.fails) - set(entry.may_fail)
    assert not missed, f"{entry.engine.__name__} passed {sorted(missed)}"
    assert not extra, f"{entry.engine.__name__} also failed {sorted(extra)}: {outcomes}"


def test_there_are_broken_migrations_of_every_kind() -> None:
    """At least ten broken engines, and every migration test fails on at least one."""
    assert len(MIGRATION_BROKEN) >= 10
    caught = {name for entry in MIGRATION_BROKEN.values() for name in entry.fails}
    assert caught == set(MIGRATION_TESTS)
