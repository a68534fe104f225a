"""What a pytest session observed of each conformance suite class, for the report.

The suite records into a :class:`Recorder` kept on ``config.stash`` (one per pytest session,
no module state), and the plugin adds per-test outcomes. When the plugin is not active the
suite records into a throwaway recorder, so it runs the same either way.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NoReturn

import pytest

from shard_engine_api._types import EvidenceClass, ShardSpec
from shard_engine_api.conformance._report import (
    DeclaredValue,
    ModelReport,
    ObservedDifferences,
    TestOutcome,
    TestResult,
)

__all__ = ["RECORDER_KEY", "Recorder", "SuiteRecord", "SuiteSkip", "TestRecord", "suite_skip"]


@dataclass(slots=True)
class SuiteRecord:
    """One suite class (one engine): identity, versions, evidence seen, shards loaded."""

    suite: str
    label: str = ""
    engine: str = "unknown"
    engine_version: str = "unknown"
    contract_version: int | None = None
    distributions: dict[str, str] = field(default_factory=dict)
    spec_evidence: list[EvidenceClass] = field(default_factory=list)
    capability_evidence: set[EvidenceClass] = field(default_factory=set)
    result_evidence: set[EvidenceClass] = field(default_factory=set)
    model: ModelReport | None = None
    shards: list[ShardSpec] = field(default_factory=list)
    overrides: dict[str, str] = field(default_factory=dict)
    declared_determinism: dict[str, DeclaredValue] = field(default_factory=dict)
    declared_features: dict[str, DeclaredValue] = field(default_factory=dict)
    observed: dict[str, ObservedDifferences] = field(default_factory=dict)
    """Per output kind: the largest differences of the tolerance comparisons."""
    boundary_dtypes: tuple[str, ...] = ()
    nodeids: list[str] = field(default_factory=list)
    test_names: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_shard(self, shard: ShardSpec) -> None:
        with self.lock:
            if shard not in self.shards:
                self.shards.append(shard)

    def add_result_evidence(self, evidence: EvidenceClass) -> None:
        with self.lock:
            self.result_evidence.add(evidence)

    def add_differences(
        self,
        kind: str,
        *,
        rows: int,
        max_abs: float,
        max_relative: float,
        max_fraction: float,
        max_magnitude: float,
    ) -> None:
        """Fold one tolerance comparison into the kind's maxima."""
        with self.lock:
            seen = self.observed.get(kind, ObservedDifferences())
            self.observed[kind] = ObservedDifferences(
                rows_compared=seen.rows_compared + rows,
                max_abs_difference=max(seen.max_abs_difference, max_abs),
                max_relative_difference=max(seen.max_relative_difference, max_relative),
                max_fraction_of_bound=max(seen.max_fraction_of_bound, max_fraction),
                max_magnitude=max(seen.max_magnitude, max_magnitude),
            )


class SuiteSkip(pytest.skip.Exception):  # type: ignore[name-defined,misc]
    """A skip the suite itself decided (the engine does not advertise a feature, the fixture
    cannot exercise a path): the only skips a certification accepts. A skip from anywhere
    else (a marker, a conftest hook) leaves the test unverified."""

    __module__ = "shard_engine_api.conformance"


def suite_skip(reason: str) -> NoReturn:
    """Skip the running standard test for ``reason`` as the suite's own decision."""
    raise SuiteSkip(msg=reason)


@dataclass(slots=True)
class TestRecord:
    """The phases of one test folded into a single outcome."""

    __test__ = False  # a record, not a pytest test class

    nodeid: str
    name: str
    outcome: TestOutcome = "passed"
    duration_s: float = 0.0
    skip_reason: str = ""
    message: str = ""
    suite_skip: bool = False
    """The skip (if any) was the suite's own (:class:`SuiteSkip`)."""

    def freeze(self) -> TestResult:
        return TestResult(
            nodeid=self.nodeid,
            name=self.name,
            outcome=self.outcome,
            duration_s=round(self.duration_s, 6),
            skip_reason=self.skip_reason,
            message=self.message,
        )


@dataclass(slots=True)
class Recorder:
    suites: dict[str, SuiteRecord] = field(default_factory=dict)
    tests: dict[str, TestRecord] = field(default_factory=dict)
    suite_of: dict[str, str] = field(default_factory=dict)

    def suite(self, suite: str) -> SuiteRecord:
        record = self.suites.get(suite)
        if record is None:
            record = self.suites[suite] = SuiteRecord(suite=suite)
        return record


RECORDER_KEY = pytest.StashKey[Recorder]()
