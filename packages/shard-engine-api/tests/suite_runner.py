"""One way to run the conformance suite on an engine of this folder, for the tests of the suite
itself (test_conformance_suite, test_migration_suite): an in-process pytest session
(``pytester``) on a generated module that subclasses ShardEngineConformance in one line, and the
outcome of every test it ran."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

import pytest
from conformance_engines import Broken

from shard_engine_api import EvidenceClass

TESTS_DIR: Final = Path(__file__).parent

SUITE_MODULE_TEMPLATE: Final = """
from pathlib import Path

from conformance_engines import CANCEL_OPTIONS, reference_fixture
from {module} import {engine} as Engine
from shard_engine_api import ShardEngine
from shard_engine_api.engine import ModelFixture
from shard_engine_api.conformance import ShardEngineConformance, conformance_override


class TestEngine(ShardEngineConformance):
    engine_name = "reference"
    cancel_load_options = CANCEL_OPTIONS

    @classmethod
    def make_engine(cls, name: str) -> ShardEngine:
        return Engine()

    @classmethod
    def model_fixture(cls, name: str, workdir: Path) -> ModelFixture:
        return reference_fixture(workdir, evidence="{evidence}")
{body}
"""

INNER_OPTIONS: Final = (
    "-W",
    "error",
    # Pass or fail is what these runs check; shrinking a failure to its shortest call
    # sequence is checked once, on its own.
    "--shard-engine-no-shrink",
    # A fixed number of examples: by default the model-based test runs fewer on a slow (loaded)
    # machine, and which bugs it finds must not depend on the machine's load.
    "--shard-engine-examples",
    "8",
    # Third-party plugins cost ~0.5 s per in-process session (hypothesis) and play no part here.
    "-p",
    "no:cacheprovider",
    "-p",
    "no:hypothesispytest",
    "-p",
    "no:benchmark",
)


def outcomes_of(recorder: pytest.HookRecorder) -> dict[str, str]:
    """Test name -> passed / failed / skipped / error, folding setup, call and teardown."""
    found: dict[str, str] = {}
    for report in recorder.getreports("pytest_runtest_logreport"):
        name = report.nodeid.rsplit("::", 1)[-1]
        if report.failed:
            found[name] = "failed" if report.when == "call" else "error"
        elif report.skipped:
            found.setdefault(name, "skipped")
        elif report.when == "call":
            found.setdefault(name, "passed")
    return found


def write_suite(
    pytester: pytest.Pytester,
    engine: str = "ReferenceEngine",
    *,
    module: str = "conformance_engines",
    evidence: EvidenceClass = "fixture",
    body: str = "",
) -> Path:
    """The suite module for ``module.engine``, with ``body`` added to its class."""
    pytester.syspathinsert(TESTS_DIR)
    return pytester.makepyfile(
        test_engine_suite=SUITE_MODULE_TEMPLATE.format(
            module=module, engine=engine, evidence=evidence, body=body
        )
    )


def run_suite(
    pytester: pytest.Pytester,
    engine: str = "ReferenceEngine",
    *options: str,
    module: str = "conformance_engines",
) -> dict[str, str]:
    """Run the suite (``INNER_OPTIONS`` plus ``options``) on ``module.engine``."""
    write_suite(pytester, engine, module=module)
    return outcomes_of(pytester.inline_run(*INNER_OPTIONS, *options))


def assert_fails_exactly(entry: Broken, found: dict[str, str], tests: tuple[str, ...]) -> None:
    """A broken engine ran every one of ``tests`` and failed exactly its tests: the ones that
    must fail did, and none beyond those that may (timing-dependent) failed."""
    name = entry.engine.__name__
    assert set(found) == set(tests), f"{name}: {found}"
    failed = {test for test, outcome in found.items() if outcome != "passed"}
    missed = set(entry.fails) - failed
    extra = failed - set(entry.fails) - set(entry.may_fail)
    assert not missed, f"{name} passed {sorted(missed)}"
    assert not extra, f"{name} also failed {sorted(extra)}: {found}"


FULL_PINS: Final = os.environ.get("SHARD_ENGINE_FULL_PINS") == "1"
"""Run every standard test on every broken engine (``nox -s conformance_pins_full``) instead
of only the tests pinned to catch it."""


def check_pins(
    pytester: pytest.Pytester,
    entry: Broken,
    tests: tuple[str, ...],
    *options: str,
    module: str = "conformance_engines",
) -> None:
    """The broken engine ``entry`` is caught by each test pinned to it: by default only those
    tests run, and each must fail (a skip is not a catch). With ``FULL_PINS`` every one of
    ``tests`` runs and it must fail exactly its tests (:func:`assert_fails_exactly`): that no
    other test fails on it is what the slower run adds, and the correct engines' full runs
    (every test passes) are what keeps the tests from failing good engines."""
    name = entry.engine.__name__
    if FULL_PINS:
        assert_fails_exactly(entry, run_suite(pytester, name, *options, module=module), tests)
        return
    path = write_suite(pytester, name, module=module)
    ids = [f"{path.name}::TestEngine::{test}" for test in sorted(entry.fails)]
    found = outcomes_of(pytester.inline_run(*INNER_OPTIONS, *options, *ids))
    assert set(found) == set(entry.fails), f"{name}: ran {sorted(found)}"
    missed = sorted(test for test, outcome in found.items() if outcome not in ("failed", "error"))
    assert not missed, f"{name} was not caught by {missed}: {found}"
