"""The conformance suite catches the engines a mutation probe found it let through
(``suite_mutants``): each fails exactly its standard tests, nothing skipped. Before these
checks every one of them passed the whole suite (an engine whose health hid running requests
had its cancellation tests skipped as "too fast", one that declared a feature unsupported had
its tests of that feature skipped while serving it wrongly)."""

from __future__ import annotations

import pytest
from suite_mutants import MUTANTS
from suite_runner import check_pins

from shard_engine_api.conformance import STANDARD_TESTS

pytest_plugins = ["pytester"]


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutant_is_caught_by_the_expected_tests(pytester: pytest.Pytester, mutant: str) -> None:
    entry = MUTANTS[mutant]
    check_pins(pytester, entry, STANDARD_TESTS, module="suite_mutants")
