"""The conformance suite catches the engines of ``reach_mutants``, whose bugs live past the
suite's habitual small cases: each fails exactly its standard tests, nothing skipped."""

from __future__ import annotations

import pytest
from reach_mutants import REACH_MUTANTS
from suite_runner import check_pins

from shard_engine_api.conformance import STANDARD_TESTS

pytest_plugins = ["pytester"]


@pytest.mark.parametrize("mutant", sorted(REACH_MUTANTS))
def test_reach_mutant_is_caught_by_the_expected_tests(
    pytester: pytest.Pytester, mutant: str
) -> None:
    entry = REACH_MUTANTS[mutant]
    check_pins(pytester, entry, STANDARD_TESTS, module="reach_mutants")
