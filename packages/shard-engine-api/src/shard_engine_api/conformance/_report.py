"""The JSON conformance report: typed structs, model hashing, environment and certification.

A report describes one engine's run of the suite. ``certification`` is ``"real-model"`` only
when every source of evidence says ``real`` (the registered engine description, every loaded
engine's capabilities and every result the suite received), every standard test ran, nothing
failed, and the model is a file (or directory) the suite itself opened and hashed that the
project's tiny-model generator did not write; a fixture engine, a built-in model or a generated
file can therefore never be reported as a real-model certification. ``verified`` holds what the
suite established itself, ``declared`` what the plugin merely said.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final, Literal

import msgspec

from shard_engine_api._store import file_sha256
from shard_engine_api._types import EvidenceClass, ShardSpec
from shard_engine_api.conformance._provenance import generated_by_project

__all__ = [
    "REPORT_VERSION",
    "Certification",
    "ConformanceReport",
    "EnvironmentReport",
    "ModelReport",
    "ObservedDifferences",
    "OverrideRecord",
    "PluginDeclarations",
    "TestOutcome",
    "TestResult",
    "Totals",
    "VerifiedFacts",
    "certify",
    "current_environment",
    "model_report",
]

REPORT_VERSION: Final = 1

Certification = Literal["real-model", "synthetic-model", "fixture-only", "failed"]
TestOutcome = Literal["passed", "failed", "skipped", "error"]


class ModelReport(msgspec.Struct, frozen=True, kw_only=True):
    """The model fixture the suite ran on. ``sha256`` hashes the model file (or every file of
    a model directory: each relative path and its content's sha256, in sorted order) when
    ``reference`` is a path; else the reference string itself (``hashed == "reference"``)."""

    reference: str
    description: str
    n_layers: int
    sha256: str
    hashed: Literal["file", "directory", "reference"]
    files: tuple[str, ...] = ()
    synthetic: bool = True
    """The plugin declares a generated or built-in model (ModelFixture.synthetic)."""
    generated_by_project: bool = False
    """The suite found the project's tiny-model generator's marks in the file (GGUF metadata):
    never a real-model run, whatever the plugin declares."""


class EnvironmentReport(msgspec.Struct, frozen=True, kw_only=True):
    """Where the suite ran."""

    python: str
    implementation: str
    platform: str
    machine: str
    cpu_count: int
    pytest: str


class TestResult(msgspec.Struct, frozen=True, kw_only=True):
    """One test: its outcome over setup, call and teardown, and why it was skipped or failed."""

    __test__ = False  # a report struct, not a pytest test class

    nodeid: str
    name: str
    outcome: TestOutcome
    duration_s: float
    skip_reason: str = ""
    message: str = ""


class Totals(msgspec.Struct, frozen=True, kw_only=True):
    total: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0


class OverrideRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A standard test an engine replaced, with the reason it gave."""

    test: str
    reason: str


class ObservedDifferences(msgspec.Struct, frozen=True, kw_only=True):
    """The differences the suite measured, for one output kind, wherever it compared outputs
    within the engine's declared tolerance rather than bit for bit. A row's magnitude is its
    largest absolute expected value; its bound is the declared ``absolute + relative *
    magnitude``."""

    rows_compared: int = 0
    max_abs_difference: float = 0.0
    max_relative_difference: float = 0.0
    """The largest ``max |difference| / magnitude`` of a row."""
    max_fraction_of_bound: float = 0.0
    """The largest ``max |difference| / bound`` of a row: above 1 a comparison failed."""
    max_magnitude: float = 0.0


DeclaredValue = float | bool | dict[str, float] | None
"""A declared capability field as reported: a flag, a number or a nested tolerance."""


class VerifiedFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What the suite established by itself during the run."""

    model_hashed_by_suite: bool
    """The model reference is a file or directory the suite opened and hashed (sha256 below)."""
    model_sha256: str | None
    model_generated_by_project: bool
    standard_tests_run: int
    standard_tests_passed: int
    missing_standard_tests: tuple[str, ...]
    capability_evidence: tuple[EvidenceClass, ...]
    result_evidence: tuple[EvidenceClass, ...]
    """Evidence classes seen on every capabilities object and every result."""
    observed_differences: dict[str, ObservedDifferences] = msgspec.field(default_factory=dict)
    """Per output kind ("logits", "hidden"): what the tolerance comparisons measured, to be
    read next to ``declared.determinism``."""


class PluginDeclarations(msgspec.Struct, frozen=True, kw_only=True):
    """What the plugin and the engine said about themselves, unverified as such (the tests
    hold the engine to it, but a declaration is not a measurement)."""

    registered_evidence: tuple[EvidenceClass, ...]
    model_synthetic: bool | None
    model_description: str
    determinism: dict[str, DeclaredValue] = msgspec.field(default_factory=dict)
    """The declared ``Determinism``, tolerances included (see ``verified.observed_differences``
    for what the comparisons measured)."""
    features: dict[str, DeclaredValue] = msgspec.field(default_factory=dict)
    boundary_dtypes: tuple[str, ...] = ()


class ConformanceReport(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of one engine's conformance run (written as JSON at session end)."""

    report_version: int = REPORT_VERSION
    created_at: str
    suite: str
    engine: str
    engine_version: str
    distributions: dict[str, str]
    contract_version: int | None
    evidence: EvidenceClass
    evidence_sources: dict[str, tuple[EvidenceClass, ...]]
    certification: Certification
    model: ModelReport | None
    shards: tuple[ShardSpec, ...]
    environment: EnvironmentReport
    tests: tuple[TestResult, ...]
    totals: Totals
    missing_standard_tests: tuple[str, ...] = ()
    overrides: tuple[OverrideRecord, ...] = ()
    verified: VerifiedFacts | None = None
    declared: PluginDeclarations | None = None


def model_report(
    reference: str, *, description: str, n_layers: int, synthetic: bool = True
) -> ModelReport:
    """Describe and hash a model reference (see :class:`ModelReport`)."""
    digest = hashlib.sha256()
    path = Path(reference)
    # A built-in model name is not a path; only hash the file system when it really is one.
    if path.is_file():
        return ModelReport(
            reference=reference,
            description=description,
            n_layers=n_layers,
            synthetic=synthetic,
            sha256=file_sha256(path),
            hashed="file",
            files=(path.name,),
            generated_by_project=generated_by_project(path),
        )
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
            digest.update(file_sha256(file).encode() + b"\0")
        return ModelReport(
            reference=reference,
            description=description,
            n_layers=n_layers,
            synthetic=synthetic,
            sha256=digest.hexdigest(),
            hashed="directory",
            files=tuple(file.relative_to(path).as_posix() for file in files),
            generated_by_project=generated_by_project(path),
        )
    digest.update(reference.encode())
    return ModelReport(
        reference=reference,
        description=description,
        n_layers=n_layers,
        synthetic=synthetic,
        sha256=digest.hexdigest(),
        hashed="reference",
    )


def current_environment(pytest_version: str) -> EnvironmentReport:
    return EnvironmentReport(
        python=sys.version.split()[0],
        implementation=platform.python_implementation(),
        platform=platform.platform(),
        machine=platform.machine(),
        cpu_count=os.cpu_count() or 0,
        pytest=pytest_version,
    )


def certify(
    *,
    totals: Totals,
    evidence_sources: Mapping[str, Iterable[EvidenceClass]],
    missing_standard_tests: Iterable[str],
    synthetic_model: bool = True,
    model: ModelReport | None = None,
) -> tuple[EvidenceClass, Certification]:
    """The evidence class of the run and its certification.

    The evidence is ``real`` only when there is at least one source and every value of every
    source is ``real``: one ``fixture`` anywhere (the registered description, a capabilities
    object, a single result) makes the whole run fixture evidence. A real engine that passed
    everything is ``real-model`` only on a model the suite hashed itself (a file or directory:
    ``model.hashed``) that the project's generator did not write and the plugin does not call
    synthetic; else ``synthetic-model``.
    """
    values = [value for source in evidence_sources.values() for value in source]
    evidence: EvidenceClass = (
        "real"
        if values and all(value == "real" for value in values) and evidence_sources.get("spec")
        else "fixture"
    )
    if totals.failed or totals.errors or totals.passed == 0:
        return evidence, "failed"
    if evidence == "real" and not list(missing_standard_tests):
        earned = (
            not synthetic_model
            and model is not None
            and model.hashed in ("file", "directory")
            and not model.generated_by_project
        )
        return evidence, "real-model" if earned else "synthetic-model"
    return evidence, "fixture-only"
