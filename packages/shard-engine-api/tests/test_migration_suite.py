"""The migration standard tests hold engines to session migration: they pass on the
reference engine and on the fake, and each broken engine of ``migration_engines`` fails
exactly the tests its bug breaks (mirroring test_conformance_suite for the other standard
tests). Each run is an in-process pytest session on a generated suite module
(``suite_runner``), selecting the migration tests only."""

from __future__ import annotations

from typing import Final

import pytest
from migration_engines import MIGRATION_BROKEN
from suite_runner import check_pins, run_suite

from shard_engine_api.conformance import STANDARD_TESTS
from shard_engine_api.conformance._migration import MIGRATION_TESTS

pytest_plugins = ["pytester"]

# The migration tests only: the others are test_conformance_suite's.
SELECT: Final = ("-k", "test_migration_")


def test_migration_tests_are_standard_tests() -> None:
    assert set(MIGRATION_TESTS) <= set(STANDARD_TESTS)
    assert tuple(sorted(MIGRATION_TESTS)) == MIGRATION_TESTS


def test_reference_engine_passes_every_migration_test(pytester: pytest.Pytester) -> None:
    outcomes = run_suite(pytester, "ReferenceEngine", *SELECT)
    assert outcomes == dict.fromkeys(MIGRATION_TESTS, "passed")


@pytest.mark.parametrize("broken", sorted(MIGRATION_BROKEN))
def test_broken_migration_fails_the_expected_tests(pytester: pytest.Pytester, broken: str) -> None:
    entry = MIGRATION_BROKEN[broken]
    check_pins(pytester, entry, MIGRATION_TESTS, *SELECT, module="migration_engines")


def test_there_are_broken_migrations_of_every_kind() -> None:
    """At least ten broken engines, and every migration test fails on at least one."""
    assert len(MIGRATION_BROKEN) >= 10
    caught = {name for entry in MIGRATION_BROKEN.values() for name in entry.fails}
    assert caught == set(MIGRATION_TESTS)
