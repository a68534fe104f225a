"""The conformance pytest plugin (registered as the ``shard_engine`` pytest11 entry point).

It is inactive unless ``--shard-engine NAME`` is given. Then the standard suite
(:mod:`shard_engine_api.conformance.suite`) is collected against the engine of that name,
found through its ``shard_engine`` entry point, on the model fixture its
``EngineDescription.model_fixture`` generates into a temporary directory::

    pytest --shard-engine fake
    pytest --shard-engine fake --shard-engine-report conformance-fake.json
    pytest --shard-engine fake --pyargs shard_engine_api.conformance.suite
    pytest -p shard_engine_api.conformance.plugin --shard-engine fake   # autoload disabled

With no test paths only the suite runs; with test paths the suite is added to them (unless one
of them already names it).

Options:

``--shard-engine NAME``
    The engine to run the standard suite against.
``--shard-engine-examples N``
    Examples per shard configuration of the model-based state-machine test (default 8;
    derandomized, so a run is repeatable; raise it for deeper runs).
``--shard-engine-profile deep``
    The model-based tests reach further: sessions of hundreds of positions, six sessions,
    batches of up to 12 items in any order, evictions through batches, 60 steps and more
    examples. Minutes on the fake engine; ``nox -s conformance_deep`` runs it there.
``--shard-engine-no-shrink``
    Report a failing model-based example as found, unshrunk (faster when only pass or fail
    matters, as in the suite's own tests of broken engines).
``--shard-engine-report PATH``
    Write a JSON :class:`~shard_engine_api.conformance.ConformanceReport` at session end
    (default: none). It covers every conformance suite class that ran, with or without
    ``--shard-engine``; when several classes (engines) ran, one file per class is written,
    named ``<stem>-<class><suffix>``. On pytest-xdist workers (``-n 2``; ``shard-engine
    conformance --engine NAME -- -n 2``) each worker records what its tests saw and the
    controller writes one report from every worker's part.

A report says ``"certification": "real-model"`` only when the engine registered ``real``
evidence, every capabilities object and every result said ``real``, every standard test ran and
none failed; a fixture engine's passing run is ``"fixture-only"``, any failure ``"failed"``.

PYTEST_DONT_REWRITE: this module asserts nothing worth rewriting, and ``-p`` naming it after an
import (``shard-engine conformance`` imports it) would otherwise warn that it cannot be.
"""

from __future__ import annotations

import datetime
import importlib.util
import re
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Final

import msgspec
import pluggy
import pytest

from shard_engine_api._plugins import installed_engines
from shard_engine_api.conformance._base import STANDARD_TESTS, ShardEngineConformance
from shard_engine_api.conformance._recorder import (
    RECORDER_KEY,
    Recorder,
    SuiteRecord,
    SuiteSkip,
    TestRecord,
)
from shard_engine_api.conformance._report import (
    ConformanceReport,
    OverrideRecord,
    PluginDeclarations,
    Totals,
    VerifiedFacts,
    certify,
    current_environment,
)
from shard_engine_api.conformance._stateful import DEFAULT_EXAMPLES

__all__ = ["SUITE_MODULE", "build_reports"]

SUITE_MODULE: Final = "shard_engine_api.conformance.suite"
_ENTRY_POINT_NAME: Final = "shard_engine"
_REPORTS_KEY = pytest.StashKey[list[tuple[Path | None, ConformanceReport]]]()
_WORKER_PARTS_KEY = pytest.StashKey[dict[str, bytes]]()
"""What each pytest-xdist worker recorded, by worker id (the controller's stash)."""


def _examples_option(text: str) -> int:
    """``--shard-engine-examples``: a whole number of examples, at least 1 (0 or a negative
    count would otherwise have been run as 1 without a word)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"needs at least 1 example, got {value}")
    return value


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shard-engine", "shard-engine conformance suite")
    group.addoption(
        "--shard-engine",
        metavar="NAME",
        default=None,
        help="run the shard-engine conformance suite against the installed engine NAME",
    )
    group.addoption(
        "--shard-engine-examples",
        metavar="N",
        type=_examples_option,
        default=None,
        help="examples per shard configuration of the model-based test (default "
        f"{DEFAULT_EXAMPLES}; more for deeper runs)",
    )
    group.addoption(
        "--shard-engine-profile",
        choices=("default", "deep"),
        default="default",
        help="'deep': the model-based tests run longer sessions (hundreds of positions), more "
        "sessions, batches of up to 12 items and more examples (for CI on a fast engine)",
    )
    group.addoption(
        "--shard-engine-no-shrink",
        action="store_true",
        default=False,
        help="report a failing model-based example as found, without shrinking it (faster "
        "when only pass/fail matters)",
    )
    group.addoption(
        "--shard-engine-report",
        metavar="PATH",
        default=None,
        help="write the conformance report (JSON) to PATH at the end of the session",
    )


def pytest_plugin_registered(
    plugin: object, plugin_name: str, manager: pluggy.PluginManager
) -> None:
    # `-p shard_engine_api.conformance.plugin` registers this module under its module name
    # before entry points load; the pytest11 entry point would then register the same module
    # as "shard_engine" and pluggy refuses one module under two names. Block that name.
    if (
        plugin is sys.modules[__name__]
        and plugin_name != _ENTRY_POINT_NAME
        and manager.get_plugin(_ENTRY_POINT_NAME) is None
    ):
        manager.set_blocked(_ENTRY_POINT_NAME)


def _suite_path() -> Path:
    spec = importlib.util.find_spec(SUITE_MODULE)
    assert spec is not None
    assert spec.origin is not None
    return Path(spec.origin).resolve()


def _names_suite(argument: str, suite_path: Path) -> bool:
    target = argument.split("::", 1)[0]
    if target == SUITE_MODULE:
        return True
    try:
        return Path(target).resolve() == suite_path
    except OSError:
        return False


def _check_installed(name: str) -> None:
    """Stop the run with one line when no installed plugin provides ``name``."""
    manager = ShardEngineConformance.plugin_manager()
    installed = [engine.name for engine in installed_engines(manager)]
    if name not in installed:
        raise pytest.UsageError(
            f"shard-engine conformance: no engine named {name!r} is installed "
            f"(installed: {', '.join(installed) or 'none'})"
        )


def _check_report_option(report: str) -> None:
    """Stop the run with one line, before any test, when the report could not be written at
    its end (a directory, a device, a path under a file): a certification run must not spend
    minutes and then lose its report to an OSError."""
    path = Path(report)
    if not report.strip() or path.is_dir():
        raise pytest.UsageError(
            f"--shard-engine-report: {report!r} is not a file name; name a JSON file"
        )
    if path.exists() and not path.is_file():
        raise pytest.UsageError(f"--shard-engine-report: {report!r} is not a regular file")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise pytest.UsageError(
                    f"--shard-engine-report: {str(parent)!r} is not a directory"
                )
            break


def pytest_configure(config: pytest.Config) -> None:
    config.stash[RECORDER_KEY] = Recorder()
    report = config.getoption("shard_engine_report")
    if report is not None:
        _check_report_option(str(report))
    selected = config.getoption("shard_engine")
    if selected is None:
        return
    if not str(selected).strip():
        # An empty name (an unset shell variable) would otherwise run nothing and pass.
        raise pytest.UsageError(
            "--shard-engine needs an engine name, got an empty one (installed: "
            + ", ".join(e.name for e in installed_engines(ShardEngineConformance.plugin_manager()))
            + ")"
        )
    _check_installed(str(selected))
    suite_path = _suite_path()
    target = SUITE_MODULE if config.option.pyargs else str(suite_path)
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args = [target]
    elif not any(_names_suite(argument, suite_path) for argument in config.args):
        config.args.append(target)


def pytest_collection_finish(session: pytest.Session) -> None:
    recorder = session.config.stash.get(RECORDER_KEY, None)
    if recorder is None:
        return
    selected = session.config.getoption("shard_engine")
    for item in session.items:
        cls = getattr(item, "cls", None)
        if cls is None or not issubclass(cls, ShardEngineConformance):
            continue
        parent = item.getparent(pytest.Class)
        suite = parent.nodeid if parent is not None else cls.__qualname__
        recorder.suite_of[item.nodeid] = suite
        record = recorder.suite(suite)
        record.label = f"{cls.__module__}.{cls.__qualname__}"
        record.engine = cls.engine_name or selected or record.engine
        record.overrides = dict(cls.conformance_overrides)
        record.nodeids.append(item.nodeid)
        record.test_names[item.nodeid] = getattr(item, "originalname", None) or item.name


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "")


def _failure_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    message = getattr(crash, "message", None)
    if message:
        return str(message)
    lines = report.longreprtext.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    recorder = item.config.stash.get(RECORDER_KEY, None)
    if recorder is None or item.nodeid not in recorder.suite_of:
        return report
    record = recorder.tests.get(item.nodeid)
    if record is None:
        suite = recorder.suites[recorder.suite_of[item.nodeid]]
        record = recorder.tests[item.nodeid] = TestRecord(
            nodeid=item.nodeid, name=suite.test_names.get(item.nodeid, item.name)
        )
    record.duration_s += report.duration
    if report.failed:
        if record.outcome not in ("failed", "error"):
            record.outcome = "failed" if report.when == "call" else "error"
            record.message = _failure_message(report)
    elif report.skipped and record.outcome == "passed":
        record.outcome = "skipped"
        record.skip_reason = _skip_reason(report)
        excinfo = call.excinfo
        record.suite_skip = excinfo is not None and isinstance(excinfo.value, SuiteSkip)
    return report


def _totals(results: list[TestRecord]) -> Totals:
    outcomes = [result.outcome for result in results]
    return Totals(
        total=len(outcomes),
        passed=outcomes.count("passed"),
        failed=outcomes.count("failed"),
        skipped=outcomes.count("skipped"),
        errors=outcomes.count("error"),
    )


def _report_of(record: SuiteRecord, recorder: Recorder, config: pytest.Config) -> ConformanceReport:
    results = [recorder.tests[nodeid] for nodeid in record.nodeids if nodeid in recorder.tests]
    totals = _totals(results)
    # A standard test skipped by anything but the suite itself (a skip marker, a conftest
    # hook) verified nothing: it counts as missing, as a deselected one does.
    ran = {result.name for result in results if result.outcome != "skipped" or result.suite_skip}
    missing = tuple(name for name in STANDARD_TESTS if name not in ran)
    sources = {
        "spec": tuple(record.spec_evidence),
        "capabilities": tuple(sorted(record.capability_evidence)),
        "results": tuple(sorted(record.result_evidence)),
    }
    model = record.model
    evidence, certification = certify(
        totals=totals,
        evidence_sources=sources,
        missing_standard_tests=missing,
        synthetic_model=model.synthetic if model is not None else True,
        model=model,
    )
    standard = [result for result in results if result.name in STANDARD_TESTS]
    verified = VerifiedFacts(
        model_hashed_by_suite=model is not None and model.hashed in ("file", "directory"),
        model_sha256=model.sha256 if model is not None and model.hashed != "reference" else None,
        model_generated_by_project=model.generated_by_project if model is not None else False,
        standard_tests_run=len({result.name for result in standard}),
        standard_tests_passed=len(
            {result.name for result in standard if result.outcome == "passed"}
        ),
        missing_standard_tests=missing,
        capability_evidence=sources["capabilities"],
        result_evidence=sources["results"],
        observed_differences=dict(sorted(record.observed.items())),
    )
    declared = PluginDeclarations(
        registered_evidence=sources["spec"],
        model_synthetic=model.synthetic if model is not None else None,
        model_description=model.description if model is not None else "",
        determinism=dict(record.declared_determinism),
        features=dict(record.declared_features),
        boundary_dtypes=record.boundary_dtypes,
    )
    return ConformanceReport(
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        suite=record.label or record.suite,
        engine=record.engine,
        engine_version=record.engine_version,
        distributions=dict(sorted(record.distributions.items())),
        contract_version=record.contract_version,
        evidence=evidence,
        evidence_sources=sources,
        certification=certification,
        model=record.model,
        shards=tuple(sorted(record.shards, key=lambda shard: (shard.start, shard.end))),
        environment=current_environment(pytest.__version__),
        tests=tuple(result.freeze() for result in results),
        totals=totals,
        missing_standard_tests=missing,
        overrides=tuple(
            OverrideRecord(test=name, reason=reason)
            for name, reason in sorted(record.overrides.items())
        ),
        verified=verified,
        declared=declared,
    )


def build_reports(config: pytest.Config) -> list[ConformanceReport]:
    """The reports of every conformance suite class that ran in this session."""
    recorder = config.stash.get(RECORDER_KEY, None)
    if recorder is None:
        return []
    return [
        _report_of(record, recorder, config)
        for record in recorder.suites.values()
        if any(nodeid in recorder.tests for nodeid in record.nodeids)
    ]


def _report_paths(path: Path, reports: list[ConformanceReport]) -> list[Path]:
    if len(reports) == 1:
        return [path]
    return [
        path.with_name(f"{path.stem}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', report.suite)}{path.suffix}")
        for report in reports
    ]


_WORKER_OUTPUT_KEY: Final = "shard_engine_recorder"
"""Where a pytest-xdist worker leaves what it recorded (``-n``: the controller writes the
report from every worker's part)."""


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist: a worker finished; fold what it recorded into this (the controller's)
    recorder, in the order of the workers' ids."""
    config = getattr(node, "config", None)
    output = getattr(node, "workeroutput", None)
    worker = getattr(node, "workerinput", None)
    if not isinstance(config, pytest.Config) or not isinstance(output, dict):
        return
    data = output.get(_WORKER_OUTPUT_KEY)
    if isinstance(data, bytes):
        parts = config.stash.setdefault(_WORKER_PARTS_KEY, {})
        name = worker.get("workerid") if isinstance(worker, dict) else None
        parts[str(name or len(parts))] = data


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    recorder = config.stash.get(RECORDER_KEY, None)
    worker_output = getattr(config, "workeroutput", None)
    if isinstance(worker_output, dict):
        # A pytest-xdist worker: the controller merges every worker's part and reports.
        if recorder is not None:
            worker_output[_WORKER_OUTPUT_KEY] = recorder.to_bytes()
        return
    if recorder is not None:
        for _, data in sorted(config.stash.get(_WORKER_PARTS_KEY, {}).items()):
            recorder.merge_bytes(data)
    reports = build_reports(config)
    option = config.getoption("shard_engine_report")
    written: list[tuple[Path | None, ConformanceReport]] = []
    if option and reports:
        for path, report in zip(_report_paths(Path(option), reports), reports, strict=True):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n")
            written.append((path, report))
    else:
        written = [(None, report) for report in reports]
    config.stash[_REPORTS_KEY] = written


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    for path, report in config.stash.get(_REPORTS_KEY, []):
        totals = report.totals
        line = (
            f"shard-engine conformance: engine {report.engine!r} ({report.suite}): "
            f"{totals.passed} passed, {totals.failed} failed, {totals.errors} errors, "
            f"{totals.skipped} skipped; evidence {report.evidence}; "
            f"certification {report.certification}"
        )
        if path is not None:
            line += f"; report {path}"
        terminalreporter.write_line(line)
