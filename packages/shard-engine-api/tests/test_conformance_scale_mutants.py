"""The conformance suite catches the engines of ``scale_mutants``, whose bugs show only on
paths small, regular cases do not take: each is caught by the standard tests pinned to it
(with SHARD_ENGINE_FULL_PINS=1: fails exactly those, nothing skipped)."""

from __future__ import annotations

import pytest
from scale_mutants import SCALE_MUTANTS
from suite_runner import check_pins

from shard_engine_api.conformance import STANDARD_TESTS

pytest_plugins = ["pytester"]


@pytest.mark.parametrize("mutant", sorted(SCALE_MUTANTS))
def test_scale_mutant_is_caught_by_the_expected_tests(
    pytester: pytest.Pytester, mutant: str
) -> None:
    entry = SCALE_MUTANTS[mutant]
    check_pins(pytester, entry, STANDARD_TESTS, module="scale_mutants")


def test_every_scale_test_catches_a_mutant() -> None:
    """Each standard test of conformance/_scale.py is pinned to catch at least one of them."""
    from shard_engine_api.conformance._scale import SCALE_TESTS

    pinned = {test for entry in SCALE_MUTANTS.values() for test in entry.fails}
    assert set(SCALE_TESTS) <= pinned, sorted(set(SCALE_TESTS) - pinned)
