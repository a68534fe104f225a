"""What a pytest session observed of each conformance suite class, for the report.

The suite records into a :class:`Recorder` kept on ``config.stash`` (one per pytest session,
no module state), and the plugin adds per-test outcomes. When the plugin is not active the
suite records into a throwaway recorder, so it runs the same either way.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
from dataclasses import dataclass, field
from typing import NoReturn, cast

import msgspec
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

    def merge(self, other: SuiteRecord) -> None:
        """Fold in what another process recorded of the same suite class (a pytest-xdist
        worker: it collected the same tests and ran others of them)."""
        with self.lock:
            self.label = self.label or other.label
            if self.engine == "unknown":
                self.engine = other.engine
            if self.engine_version == "unknown":
                self.engine_version = other.engine_version
            if self.contract_version is None:
                self.contract_version = other.contract_version
            self.distributions = {**other.distributions, **self.distributions}
            self.spec_evidence += [e for e in other.spec_evidence if e not in self.spec_evidence]
            self.capability_evidence |= other.capability_evidence
            self.result_evidence |= other.result_evidence
            shards = other.shards
            if self.model is None:
                self.model = other.model
            elif other.model is not None and other.model.sha256 == self.model.sha256:
                # The same model, written to each worker's own directory: its shards are ours.
                mine, other_path = self.model.reference, other.model.reference
                shards = [
                    msgspec.structs.replace(shard, model=mine)
                    if shard.model == other_path
                    else shard
                    for shard in shards
                ]
            self.shards += [shard for shard in shards if shard not in self.shards]
            self.overrides = {**other.overrides, **self.overrides}
            if not self.declared_determinism:
                self.declared_determinism = other.declared_determinism
                self.declared_features = other.declared_features
                self.boundary_dtypes = other.boundary_dtypes
            for kind, theirs in other.observed.items():
                seen = self.observed.get(kind, ObservedDifferences())
                self.observed[kind] = ObservedDifferences(
                    rows_compared=seen.rows_compared + theirs.rows_compared,
                    max_abs_difference=max(seen.max_abs_difference, theirs.max_abs_difference),
                    max_relative_difference=max(
                        seen.max_relative_difference, theirs.max_relative_difference
                    ),
                    max_fraction_of_bound=max(
                        seen.max_fraction_of_bound, theirs.max_fraction_of_bound
                    ),
                    max_magnitude=max(seen.max_magnitude, theirs.max_magnitude),
                )
            known = set(self.nodeids)
            self.nodeids += [nodeid for nodeid in other.nodeids if nodeid not in known]
            self.test_names = {**other.test_names, **self.test_names}


_SUITE_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(SuiteRecord) if f.name != "lock"
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

    def to_bytes(self) -> bytes:
        """Everything recorded, for another process of the same run (a pytest-xdist worker
        sends it to the controller, which writes the report: :meth:`merge_bytes`)."""
        suites = {
            name: {name_: getattr(record, name_) for name_ in _SUITE_FIELDS}
            for name, record in self.suites.items()
        }
        return pickle.dumps((suites, self.tests, self.suite_of))

    def merge_bytes(self, data: bytes) -> None:
        """Fold in a recorder of :meth:`to_bytes` (from a worker process of this run)."""
        suites, tests, suite_of = cast(
            "tuple[dict[str, dict[str, object]], dict[str, TestRecord], dict[str, str]]",
            pickle.loads(data),  # written by a worker process of this same run
        )
        self.tests.update(tests)
        self.suite_of.update(suite_of)
        for name, fields in suites.items():
            theirs = SuiteRecord(**fields)  # type: ignore[arg-type]
            mine = self.suites.get(name)
            if mine is None:
                self.suites[name] = theirs
            else:
                mine.merge(theirs)


RECORDER_KEY = pytest.StashKey[Recorder]()
