"""The JSON conformance report: typed structs, model hashing, environment and certification.

A report describes one engine's run of the suite. ``certification`` is ``"real-model"`` only
when every source of evidence says ``real`` (the registered engine spec, every loaded
engine's capabilities and every result the suite received), every standard test ran, and
nothing failed; a fixture engine therefore can never be reported as a real-model certification.
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

__all__ = [
    "REPORT_VERSION",
    "Certification",
    "ConformanceReport",
    "EnvironmentReport",
    "ModelReport",
    "OverrideRecord",
    "TestOutcome",
    "TestResult",
    "Totals",
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
    """A generated or built-in model (ModelFixture.synthetic): never a real-model run."""


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
) -> tuple[EvidenceClass, Certification]:
    """The evidence class of the run and its certification.

    The evidence is ``real`` only when there is at least one source and every value of every
    source is ``real``: one ``fixture`` anywhere (the registered spec, a capabilities object, a
    single result) makes the whole run fixture evidence. A real engine that passed everything on
    a generated model is ``synthetic-model``: only a real model makes ``real-model``.
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
        return evidence, "synthetic-model" if synthetic_model else "real-model"
    return evidence, "fixture-only"
