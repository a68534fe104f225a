"""The conformance suite itself: it passes on a correct engine, fails on each broken engine
with the expected test, guards its standard tests, and reports evidence honestly.

Each suite run is an in-process pytest session (``pytester``) on a generated test module that
subclasses ShardEngineConformance for one engine of ``conformance_engines``.
"""

from __future__ import annotations

import hashlib
import re
import struct
from pathlib import Path
from typing import Final

import msgspec
import pluggy
import pytest
from conformance_engines import BROKEN_ENGINES, CORRECT_ENGINES, ReferencePlugin
from suite_runner import (
    INNER_OPTIONS,
    TESTS_DIR,
    check_pins,
    outcomes_of,
    run_suite,
    write_suite,
)

from shard_engine_api import CONTRACT_VERSION, EvidenceClass
from shard_engine_api.conformance import (
    STANDARD_TESTS,
    ConformanceReport,
    ShardEngineConformance,
    Totals,
    conformance_override,
    pytest_arguments,
)
from shard_engine_api.conformance._report import certify, model_report
from shard_engine_api.engine import get_plugin_manager

pytest_plugins = ["pytester"]

PINNED_STANDARD_TESTS: Final = (
    "test_batch_at_the_kv_budget",
    "test_batch_error_items_carry_their_fields",
    "test_batch_use_refreshes_lru_order",
    "test_batched_decode_item_errors",
    "test_batched_decode_matches_single",
    "test_batched_decode_metrics",
    "test_batched_decode_order_with_interleaved_errors",
    "test_batched_decode_reserved_fields",
    "test_batched_decode_same_session_twice",
    "test_boundary_checks_on_every_path",
    "test_cache_miss_decode_position",
    "test_cache_miss_prefill_gap",
    "test_cache_miss_unknown_session",
    "test_cancel_after_completion_result_stands",
    "test_cancel_latency_within_advertised_bound",
    "test_cancel_one_of_queued_requests",
    "test_cancel_one_of_two_in_flight",
    "test_cancel_rolls_back",
    "test_cancel_running_batch",
    "test_cancel_running_decode",
    "test_cancel_session_stops_all_its_requests",
    "test_cancel_unknown_or_finished",
    "test_capabilities_fields",
    "test_checksum_mismatch",
    "test_chunked_prefill",
    "test_concurrent_threads_match_serial",
    "test_contract_version_at_its_edges",
    "test_contract_version_mismatch",
    "test_crash_is_permanent",
    "test_decode_consistency",
    "test_deterministic",
    "test_double_release_frees_once",
    "test_empty_reserved_values_inside_bundles_refused",
    "test_empty_reserved_values_refused",
    "test_error_codes_match_taxonomy",
    "test_every_boundary_dtype",
    "test_evidence_class",
    "test_export_of_an_evicted_session",
    "test_failed_first_prefill_leaves_nothing",
    "test_failed_request_is_atomic",
    "test_fence_holds_after_slot_reuse",
    "test_health_metrics_consistent",
    "test_health_states",
    "test_import_over_an_eviction_fence_and_a_tombstone",
    "test_in_flight_while_running",
    "test_invalid_request_bad_token_ids",
    "test_invalid_request_empty_request_id",
    "test_invalid_request_malformed_bundle",
    "test_large_shuffled_batches_match_single_decodes",
    "test_limit_kv_budget",
    "test_limit_max_batch_tokens",
    "test_limit_max_context",
    "test_limit_max_sessions",
    "test_load_after_a_refused_load",
    "test_load_twice_rejected",
    "test_loads_after_refused_loads_of_every_kind",
    "test_long_and_shared_prefix_session_ids",
    "test_long_prefill_vs_chunked_and_decode",
    "test_long_session_decode_and_chunks_match_one_prefill",
    "test_long_session_migrates_exactly",
    "test_lru_by_last_use_unequal_sizes",
    "test_lru_eviction",
    "test_many_threads_many_sessions_match_serial",
    "test_migration_atomic_under_budget_pressure",
    "test_migration_cancelled_import_and_export",
    "test_migration_continues_exactly_every_role",
    "test_migration_corrupted_or_truncated_snapshot",
    "test_migration_epoch_fencing",
    "test_migration_failed_import_is_atomic",
    "test_migration_metrics_and_health",
    "test_migration_mismatched_snapshot",
    "test_migration_source_unchanged",
    "test_narrow_boundary_dtypes_match_f32_rows",
    "test_narrow_rows_round_the_f32_rows_to_nearest_even",
    "test_newer_epoch_refused_on_every_path_keeps_the_older",
    "test_newer_epoch_sees_no_old_cache",
    "test_no_starvation_behind_a_decode_loop",
    "test_not_ready_after_close",
    "test_not_ready_before_load",
    "test_outputs_finite",
    "test_queued_cancel_heard_at_once",
    "test_refused_first_prefill_of_a_newer_epoch",
    "test_release_tombstone",
    "test_release_unknown_session",
    "test_release_while_a_decode_runs_keeps_the_others",
    "test_release_while_a_request_runs",
    "test_request_id_reused_in_flight_on_every_path",
    "test_request_id_reused_while_in_flight",
    "test_reserved_hooks_present_but_disabled",
    "test_resource_exhausted_kv_budget",
    "test_resource_exhausted_session_slots",
    "test_result_fields",
    "test_retryable_at_every_contract_version_and_path",
    "test_retryable_on_every_path",
    "test_role_derived_from_shard",
    "test_session_ids_across_characters_and_lengths",
    "test_session_ids_at_and_past_the_length_limit",
    "test_session_isolation",
    "test_shard_mismatch",
    "test_split_invariance_fixture_splits",
    "test_split_invariance_three_way",
    "test_split_invariance_two_way",
    "test_stale_epoch",
    "test_state_machine_every_role",
    "test_state_machine_full_shard",
    "test_thousands_of_releases_keep_every_fence",
    "test_timings_against_the_wall_clock",
    "test_timings_of_batches_and_imports_against_the_wall_clock",
    "test_truncate",
    "test_truncate_and_new_epoch_every_role",
    "test_truncate_at_large_positions",
    "test_unsupported_feature_on_bundles",
    "test_unsupported_feature_on_requests",
    "test_wire_round_trip_of_every_returned_object",
    "test_wrong_role_bundle_to_token_shard",
    "test_wrong_role_tokens_to_bundle_shard",
)


A_FEW: Final = ("-k", "test_evidence_class or (test_truncate and not every_role and not large)")
"""Two standard tests, ``test_evidence_class`` and ``test_truncate``: what the report tests
below check of a run (a test's outcome, whether it counts as run, the evidence) shows on these
two as on all 116, in a second instead of ~15. That a correct engine passes every test and
what a whole run's report holds are checked on whole runs."""


def _read_report(path: Path) -> ConformanceReport:
    return msgspec.json.decode(path.read_bytes(), type=ConformanceReport)


def _use_plugin_manager(monkeypatch: pytest.MonkeyPatch, plugin: ReferencePlugin) -> None:
    """Make the suite find engines through a manager holding ``plugin`` (no entry point)."""
    manager = get_plugin_manager(entry_points=False, plugins=[(plugin.name, plugin)])

    def plugin_manager(cls: type[ShardEngineConformance]) -> pluggy.PluginManager:
        return manager

    monkeypatch.setattr(ShardEngineConformance, "plugin_manager", classmethod(plugin_manager))


# --------------------------------------------------------------------- the suite's shape


def test_standard_tests_are_pinned() -> None:
    defined = sorted(name for name in dir(ShardEngineConformance) if name.startswith("test_"))
    assert tuple(defined) == STANDARD_TESTS == PINNED_STANDARD_TESTS


def test_every_standard_test_says_what_it_checks_and_how_to_fix_it() -> None:
    for name in STANDARD_TESTS:
        doc = getattr(ShardEngineConformance, name).__doc__ or ""
        checked, _, fix = doc.partition("Fix:")
        assert len(checked.strip()) > 20, f"{name} does not say what it checks"
        assert fix.strip(), f"{name} does not say how to fix a failure"


def test_override_without_marker_is_refused() -> None:
    with pytest.raises(TypeError, match="test_stale_epoch replaces a standard conformance test"):

        class TestSilentOverride(ShardEngineConformance):  # pragma: no cover - never created
            engine_name = "x"

            def test_stale_epoch(self) -> None:
                pass


def test_deleting_a_standard_test_is_refused() -> None:
    with pytest.raises(TypeError, match="may not be deleted or silently overridden"):

        class TestDeleted(ShardEngineConformance):  # pragma: no cover - never created
            test_truncate = None  # type: ignore[assignment]  # the deletion under test


def test_a_mixin_cannot_replace_a_standard_test_unseen() -> None:
    """A class listed before the suite wins the method lookup: its unmarked test_truncate
    used to replace the standard one without a word."""

    class Quiet:
        def test_truncate(self) -> None:
            pass

    with pytest.raises(TypeError, match="test_truncate replaces a standard conformance test"):

        class TestMixedIn(Quiet, ShardEngineConformance):  # pragma: no cover - never created
            engine_name = "x"


def test_a_marked_override_from_a_mixin_is_recorded() -> None:
    class Marked:
        @conformance_override(reason="engine has no truncation yet")
        def test_truncate(self) -> None:
            pytest.skip("no truncation")

    class TestMixedIn(Marked, ShardEngineConformance):
        engine_name = "x"

    assert TestMixedIn.conformance_overrides == {"test_truncate": "engine has no truncation yet"}


def test_marked_override_is_recorded_and_inherited() -> None:
    class TestMarked(ShardEngineConformance):
        engine_name = "x"

        @conformance_override(reason="engine has no truncation yet")
        def test_truncate(self) -> None:
            pytest.skip("no truncation")

    class TestChild(TestMarked):
        pass

    assert TestMarked.conformance_overrides == {"test_truncate": "engine has no truncation yet"}
    assert TestChild.conformance_overrides == TestMarked.conformance_overrides
    assert ShardEngineConformance.conformance_overrides == {}


def test_override_reason_is_required() -> None:
    with pytest.raises(ValueError, match="non-empty reason"):
        conformance_override(reason=" ")


# --------------------------------------------------------------------- suite runs


@pytest.mark.parametrize("broken", sorted(BROKEN_ENGINES))
def test_broken_engine_fails_the_expected_tests(pytester: pytest.Pytester, broken: str) -> None:
    """Each broken engine fails exactly its tests: the ones that must fail do, and no test
    beyond those that may (timing-dependent) fails; nothing is skipped."""
    entry = BROKEN_ENGINES[broken]
    check_pins(pytester, entry, STANDARD_TESTS)


def test_there_are_broken_engines_of_every_kind() -> None:
    """At least 40 broken engines, each failing at least one test."""
    assert len(BROKEN_ENGINES) >= 40
    assert all(entry.fails for entry in BROKEN_ENGINES.values())


@pytest.mark.parametrize("correct", sorted(CORRECT_ENGINES))
def test_correct_engine_passes_every_standard_test(pytester: pytest.Pytester, correct: str) -> None:
    """The reference engine and an honest engine that declares a tolerance (split_exact and
    batch_invariant False) pass everything."""
    outcomes = run_suite(pytester, CORRECT_ENGINES[correct].__name__)
    assert outcomes == dict.fromkeys(STANDARD_TESTS, "passed")


def test_state_machine_failure_reads_as_a_short_call_sequence(pytester: pytest.Pytester) -> None:
    """A model-based failure is shrunk to a few calls on a fresh engine and says how to fix
    it. The engine's bug shows on one thread (a decode that ignores its history): a failure
    first found through a call racing another thread cannot be replayed reliably, so it would
    not shrink."""
    write_suite(pytester, "DecodeIgnoresHistory")
    recorder = pytester.inline_run(
        *(option for option in INNER_OPTIONS if option != "--shard-engine-no-shrink"),
        "-k",
        "test_state_machine_full_shard",
    )
    [report] = [r for r in recorder.getreports("pytest_runtest_logreport") if r.failed]
    text = report.longreprtext
    steps = re.findall(r"^E?\s+\d+\. (?:prefill|decode|decode_batch|release|cancel)\(", text, re.M)
    assert 1 <= len(steps) <= 6, text[-3000:]
    assert "Fix: " in text
    assert "fresh replay" in text


def test_report_of_a_fixture_engine_is_fixture_only(pytester: pytest.Pytester) -> None:
    body = """
    @conformance_override(reason="covered by the engine's own eviction tests")
    def test_lru_eviction(self) -> None:
        pass
"""
    write_suite(pytester, body=body)
    report_path = pytester.path / "out" / "report.json"
    pytester.inline_run(*INNER_OPTIONS, f"--shard-engine-report={report_path}")
    report = _read_report(report_path)
    assert report.engine == "reference"
    assert report.engine_version == "0.0-test"
    assert report.evidence == "fixture"
    assert report.certification == "fixture-only"
    assert report.contract_version == CONTRACT_VERSION
    assert report.totals == Totals(total=len(STANDARD_TESTS), passed=len(STANDARD_TESTS))
    assert report.missing_standard_tests == ()
    assert [(o.test, o.reason) for o in report.overrides] == [
        ("test_lru_eviction", "covered by the engine's own eviction tests")
    ]
    assert report.model is not None
    assert report.model.hashed == "file"
    model_bytes = Path(report.model.reference).read_bytes()
    assert report.model.sha256 == hashlib.sha256(model_bytes).hexdigest()
    assert {(shard.start, shard.end) for shard in report.shards} >= {
        (0, 4),
        (0, 2),
        (2, 4),
        (0, 1),
        (1, 2),
    }
    assert report.distributions["shard-engine-api"] == "0.1.0"
    assert report.environment.cpu_count >= 1
    assert report.environment.python
    assert {test.name for test in report.tests} == set(STANDARD_TESTS)


def test_failing_run_is_reported_failed(pytester: pytest.Pytester) -> None:
    """A failed test fails the report, named with its message. (That no other standard test
    fails on this engine is its pin's full run: ``nox -s conformance_pins_full``.)"""
    write_suite(pytester, "NoRollback")
    report_path = pytester.path / "report.json"
    pytester.inline_run(
        *INNER_OPTIONS,
        "-k",
        "test_cancel_rolls_back or test_evidence_class",
        f"--shard-engine-report={report_path}",
    )
    report = _read_report(report_path)
    assert report.certification == "failed"
    [failed] = [test for test in report.tests if test.outcome == "failed"]
    assert failed.name == "test_cancel_rolls_back"
    assert failed.message


def test_unregistered_engine_claiming_real_is_not_certified(pytester: pytest.Pytester) -> None:
    """An engine supplied without an entry point has no registered evidence class: even a
    consistent "real" claim gives no real-model certification."""
    write_suite(pytester, evidence="real")
    report_path = pytester.path / "report.json"
    outcomes = outcomes_of(
        pytester.inline_run(*INNER_OPTIONS, *A_FEW, f"--shard-engine-report={report_path}")
    )
    assert outcomes == {"test_evidence_class": "passed", "test_truncate": "passed"}
    report = _read_report(report_path)
    assert report.evidence_sources["results"] == ("real",)
    # Evidence "fixture" alone rules out a real-model certification, however many tests ran.
    assert report.evidence == "fixture"
    assert report.certification == "fixture-only"


def test_suite_is_skipped_without_an_engine(pytester: pytest.Pytester) -> None:
    outcomes = outcomes_of(
        pytester.inline_run(*INNER_OPTIONS, "--pyargs", "shard_engine_api.conformance.suite")
    )
    assert outcomes == dict.fromkeys(STANDARD_TESTS, "skipped")


# --------------------------------------------------------------------- --shard-engine NAME


def _run_selected(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    plugin: ReferencePlugin,
    *arguments: str,
) -> tuple[dict[str, str], ConformanceReport]:
    _use_plugin_manager(monkeypatch, plugin)
    report_path = pytester.path / "report.json"
    recorder = pytester.inline_run(
        *INNER_OPTIONS, *pytest_arguments(plugin.name, str(report_path)), *arguments
    )
    return outcomes_of(recorder), _read_report(report_path)


def test_shard_engine_option_runs_the_suite_with_no_paths(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(The whole suite with no paths, every test passing: the real-model test below.)"""
    outcomes, report = _run_selected(pytester, monkeypatch, ReferencePlugin(), *A_FEW)
    assert outcomes == {"test_evidence_class": "passed", "test_truncate": "passed"}
    assert report.suite == "shard_engine_api.conformance.suite.TestShardEngine"
    assert report.evidence_sources["spec"] == ("fixture",)
    assert report.certification == "fixture-only"


def test_shard_engine_option_with_pyargs(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    outcomes, _ = _run_selected(
        pytester,
        monkeypatch,
        ReferencePlugin(),
        "--pyargs",
        "shard_engine_api.conformance.suite",
        "-k",
        "split_invariance",
    )
    assert outcomes == {
        "test_split_invariance_fixture_splits": "passed",
        "test_split_invariance_three_way": "passed",
        "test_split_invariance_two_way": "passed",
    }


def test_shard_engine_option_adds_the_suite_to_given_paths(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every standard test is collected besides the given path's (collection is what the
    option changes), and the given path's test runs."""
    pytester.makepyfile(test_other="def test_other() -> None:\n    pass\n")
    _use_plugin_manager(monkeypatch, ReferencePlugin())
    arguments = (*INNER_OPTIONS, *pytest_arguments("reference"), "test_other.py")
    items, _ = pytester.inline_genitems(*arguments)
    assert sorted(item.name for item in items) == sorted([*STANDARD_TESTS, "test_other"])
    outcomes = outcomes_of(pytester.inline_run(*arguments, "-k", "test_other"))
    assert outcomes == {"test_other": "passed"}


def test_registered_real_engine_can_certify(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The only way to "real-model": registered real, capabilities real, results real, every
    standard test run and passed."""
    outcomes, report = _run_selected(pytester, monkeypatch, ReferencePlugin(evidence="real"))
    # With no paths, the option ran the whole suite.
    assert outcomes == dict.fromkeys(STANDARD_TESTS, "passed")
    assert report.suite == "shard_engine_api.conformance.suite.TestShardEngine"
    assert report.evidence == "real"
    assert report.certification == "real-model"


def test_deselected_tests_prevent_certification(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, report = _run_selected(
        pytester,
        monkeypatch,
        ReferencePlugin(evidence="real"),
        "-k",
        "test_evidence_class",
    )
    assert "test_truncate" in report.missing_standard_tests
    assert report.certification == "fixture-only"


def test_a_standard_test_skipped_by_a_marker_is_not_verified(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conftest hook (or any marker) that skips a standard test used to count it as run, so
    a real engine could skip the tests it fails and still be certified "real-model". Only the
    suite's own skips (a feature the engine does not advertise) count as run."""
    pytester.makeconftest(
        """
import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if item.name == "test_truncate":
            item.add_marker(pytest.mark.skip(reason="known to fail"))
"""
    )
    outcomes, report = _run_selected(
        pytester, monkeypatch, ReferencePlugin(evidence="real"), *A_FEW
    )
    assert outcomes == {"test_evidence_class": "passed", "test_truncate": "skipped"}
    assert "test_truncate" in report.missing_standard_tests
    assert "test_evidence_class" not in report.missing_standard_tests
    assert report.certification == "fixture-only"


def _comparable(report: ConformanceReport) -> ConformanceReport:
    """``report`` without what differs from run to run (times, the model's temporary path)."""
    assert report.model is not None
    return msgspec.structs.replace(
        report,
        created_at="",
        environment=msgspec.structs.replace(report.environment, python=""),
        model=msgspec.structs.replace(report.model, reference=""),
        shards=tuple(
            msgspec.structs.replace(shard, model="model")
            for shard in report.shards
            if shard.model == report.model.reference
        ),
        tests=tuple(msgspec.structs.replace(test, duration_s=0.0) for test in report.tests),
    )


def test_a_run_on_xdist_workers_reports_what_one_process_does(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``-n 2`` each pytest-xdist worker records what its tests saw and the controller
    writes one report from both: the same report as one process writes. (The engine declares
    a tolerance: its comparisons are recorded as observed differences.)"""
    pytest.importorskip("xdist", reason="pytest-xdist is not installed in this environment")
    write_suite(pytester, CORRECT_ENGINES["honest_tolerance"].__name__)
    # The workers import the engines' module by name, as this process does.
    monkeypatch.setenv("PYTHONPATH", str(TESTS_DIR))
    selected = ("-k", "test_evidence_class or test_lru_eviction or split_invariance_two_way")
    reports: dict[str, ConformanceReport] = {}
    for workers in ("0", "2"):
        path = pytester.path / f"report-{workers}.json"
        result = pytester.runpytest_subprocess(
            *INNER_OPTIONS, *selected, "-n", workers, f"--shard-engine-report={path}"
        )
        result.assert_outcomes(passed=3)
        reports[workers] = _read_report(path)
    serial, parallel = reports["0"], reports["2"]
    assert serial.totals == Totals(total=3, passed=3)
    assert serial.shards
    assert parallel.model is not None
    assert {shard.model for shard in parallel.shards} == {parallel.model.reference}
    assert serial.evidence_sources["results"]
    assert serial.verified is not None
    assert serial.verified.observed_differences
    assert _comparable(parallel) == _comparable(serial)


@pytest.mark.parametrize(("skip", "verified"), [("suite_skip", True), ("pytest.skip", False)])
def test_only_the_suites_own_skips_count_as_run(
    pytester: pytest.Pytester, skip: str, verified: bool
) -> None:
    body = f"""
    @conformance_override(reason="this engine has no truncation")
    def test_truncate(self) -> None:
        import pytest
        from shard_engine_api.conformance._recorder import suite_skip

        {skip}("engine declares features.truncate = False")
"""
    write_suite(pytester, body=body)
    report_path = pytester.path / "report.json"
    pytester.inline_run(*INNER_OPTIONS, *A_FEW, f"--shard-engine-report={report_path}")
    report = _read_report(report_path)
    assert [t.outcome for t in report.tests if t.name == "test_truncate"] == ["skipped"]
    assert ("test_truncate" in report.missing_standard_tests) is not verified
    assert "test_evidence_class" not in report.missing_standard_tests


def test_registered_fixture_engine_claiming_real_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    outcomes, report = _run_selected(
        pytester, monkeypatch, ReferencePlugin(evidence="fixture", engine_evidence="real"), *A_FEW
    )
    assert outcomes["test_evidence_class"] == "failed"
    assert report.evidence == "fixture"
    assert report.certification == "failed"


def test_plugin_named_with_p_coexists_with_its_entry_point(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``-p shard_engine_api.conformance.plugin`` while the pytest11 entry point also loads
    the module must not register it twice (pluggy would refuse)."""
    _use_plugin_manager(monkeypatch, ReferencePlugin())
    result = pytester.runpytest_inprocess(
        *INNER_OPTIONS,
        "-p",
        "shard_engine_api.conformance.plugin",
        "--shard-engine",
        "reference",
        "--collect-only",
        "-q",
    )
    result.assert_outcomes()
    assert f"{len(STANDARD_TESTS)} tests collected" in result.stdout.str()


# --------------------------------------------------------------------- report pieces


@pytest.mark.parametrize("count", ["0", "-5", "many"])
def test_examples_option_needs_a_positive_count(pytester: pytest.Pytester, count: str) -> None:
    """0 or a negative count used to run one example without a word: a run that asked for
    none would look like one that asked for the usual number."""
    result = pytester.runpytest("--shard-engine-examples", count)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--shard-engine-examples*"])


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_engine_name_is_a_usage_error(pytester: pytest.Pytester, name: str) -> None:
    """``--shard-engine "$ENGINE"`` with the variable unset used to run nothing: a certification
    run that never ran must not look like one that passed."""
    result = pytester.runpytest("--shard-engine", name)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--shard-engine needs an engine name*"])


@pytest.mark.parametrize("kind", ["directory", "under a file", "empty"])
def test_a_report_path_that_cannot_be_written_is_refused_before_any_test(
    pytester: pytest.Pytester, kind: str
) -> None:
    """The report is written when the run ends: a path that could never be written (a
    directory, a path under a regular file) used to fail with an OSError after the whole run."""
    blocker = pytester.path / "file.json"
    blocker.write_text("{}")
    path = {
        "directory": str(pytester.path),
        "under a file": str(blocker / "report.json"),
        "empty": "",
    }[kind]
    result = pytester.runpytest("--shard-engine-report", path)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--shard-engine-report*"])


def test_pytest_arguments() -> None:
    base = [
        "-p",
        "shard_engine_api.conformance.plugin",
        "--shard-engine",
        "fake",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
        "-p",
        "no:cacheprovider",
    ]
    assert pytest_arguments("fake", "r.json", ["-x"]) == [
        *base,
        "--shard-engine-report",
        "r.json",
        "-x",
    ]
    assert pytest_arguments("fake") == base


def test_model_report_hashes_files_directories_and_references(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    assert model_report(str(model), description="", n_layers=2).sha256 == (
        hashlib.sha256(b"weights").hexdigest()
    )
    directory = model_report(str(tmp_path), description="", n_layers=2)
    assert directory.hashed == "directory"
    assert directory.files == ("model.gguf",)
    named = model_report("builtin:tiny", description="", n_layers=2)
    assert named.hashed == "reference"
    assert named.sha256 == hashlib.sha256(b"builtin:tiny").hexdigest()


@pytest.mark.parametrize(
    ("sources", "totals", "missing", "expected"),
    [
        (
            {"spec": ["real"], "capabilities": ["real"], "results": ["real"]},
            Totals(total=1, passed=1),
            (),
            ("real", "real-model"),
        ),
        (
            {"spec": ["real"], "capabilities": ["real"], "results": ["real", "fixture"]},
            Totals(total=1, passed=1),
            (),
            ("fixture", "fixture-only"),
        ),
        (
            {"spec": [], "capabilities": ["real"], "results": ["real"]},
            Totals(total=1, passed=1),
            (),
            ("fixture", "fixture-only"),
        ),
        (
            {"spec": ["real"], "capabilities": ["real"], "results": ["real"]},
            Totals(total=1, passed=1),
            ("test_truncate",),
            ("real", "fixture-only"),
        ),
        (
            {"spec": ["real"], "capabilities": ["real"], "results": ["real"]},
            Totals(total=2, passed=1, failed=1),
            (),
            ("real", "failed"),
        ),
        (
            {"spec": ["fixture"], "capabilities": ["fixture"], "results": []},
            Totals(total=1, skipped=1),
            (),
            ("fixture", "failed"),
        ),
    ],
)
def test_certification_rules(
    sources: dict[str, list[EvidenceClass]],
    totals: Totals,
    missing: tuple[str, ...],
    expected: tuple[str, str],
    tmp_path: Path,
) -> None:
    model = tmp_path / "weights.bin"
    model.write_bytes(b"real weights")
    assert (
        certify(
            totals=totals,
            evidence_sources=sources,
            missing_standard_tests=missing,
            synthetic_model=False,
            model=model_report(str(model), description="", n_layers=2, synthetic=False),
        )
        == expected
    )


_ALL_REAL: Final[dict[str, list[EvidenceClass]]] = {
    "spec": ["real"],
    "capabilities": ["real"],
    "results": ["real"],
}


def _gguf_bytes(metadata: dict[str, str]) -> bytes:
    """A GGUF v3 header with string metadata and no tensors."""

    def text(value: str) -> bytes:
        data = value.encode()
        return struct.pack("<Q", len(data)) + data

    body = b"".join(
        text(key) + struct.pack("<I", 8) + text(value) for key, value in metadata.items()
    )
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(metadata)) + body


@pytest.mark.parametrize(
    ("metadata", "generated"),
    [
        ({"general.name": "tiny-llama-f32-seed0"}, True),
        ({"general.name": "tiny-gemma3-q8_0-seed7 layers [0, 2) of 4"}, True),
        ({"general.name": "Gemma 3 270m", "shard_engine.generated_by": "tiny-model"}, True),
        ({"general.name": "Gemma 3 270m"}, False),
        ({"general.name": "tiny-but-real"}, False),
    ],
)
def test_generated_models_are_recognised_and_never_certify(
    tmp_path: Path, metadata: dict[str, str], generated: bool
) -> None:
    """The suite opens the model itself: a file of the project's tiny-model generator (or a
    shard of one) is recognised by its GGUF metadata and never certifies real-model, even when
    the plugin declares it not synthetic."""
    path = tmp_path / "model.gguf"
    path.write_bytes(_gguf_bytes(metadata))
    report = model_report(str(path), description="", n_layers=4, synthetic=False)
    assert report.hashed == "file"
    assert report.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert report.generated_by_project is generated
    _, certification = certify(
        totals=Totals(total=1, passed=1),
        evidence_sources=_ALL_REAL,
        missing_standard_tests=(),
        synthetic_model=False,
        model=report,
    )
    assert certification == ("synthetic-model" if generated else "real-model")


def test_a_model_the_suite_could_not_hash_never_certifies() -> None:
    """A model that is no file (a built-in name) cannot be real-model, whatever is claimed."""
    report = model_report("builtin:tiny", description="", n_layers=2, synthetic=False)
    assert report.hashed == "reference"
    for model in (report, None):
        assert certify(
            totals=Totals(total=1, passed=1),
            evidence_sources=_ALL_REAL,
            missing_standard_tests=(),
            synthetic_model=False,
            model=model,
        ) == ("real", "synthetic-model")


def test_report_separates_verified_facts_from_declarations(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, report = _run_selected(
        pytester, monkeypatch, ReferencePlugin(evidence="real"), "-k", "capabilities_fields"
    )
    assert report.verified is not None
    assert report.declared is not None
    assert report.verified.model_hashed_by_suite
    assert report.model is not None
    assert report.verified.model_sha256 == report.model.sha256
    assert not report.verified.model_generated_by_project
    assert report.verified.standard_tests_run == 1
    assert report.verified.capability_evidence == ("real",)
    assert report.declared.registered_evidence == ("real",)
    assert report.declared.model_synthetic is False
    assert report.declared.determinism["split_exact"] is True
    assert report.declared.features["cancel"] is True


def test_an_engine_that_is_not_installed_fails_with_one_line(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use_plugin_manager(monkeypatch, ReferencePlugin())
    result = pytester.runpytest_inprocess(*INNER_OPTIONS, *pytest_arguments("no-such-engine"))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.errlines if "no-such-engine" in line]
    assert errors == [
        "ERROR: shard-engine conformance: no engine named 'no-such-engine' is installed "
        "(installed: reference)"
    ]
    assert "passed" not in result.stdout.str()


def test_real_engine_on_a_generated_model_is_not_a_real_model_certification() -> None:
    """A real engine passing everything on a synthetic model certifies "synthetic-model"."""
    sources: dict[str, list[EvidenceClass]] = {
        "spec": ["real"],
        "capabilities": ["real"],
        "results": ["real"],
    }
    assert certify(
        totals=Totals(total=1, passed=1), evidence_sources=sources, missing_standard_tests=()
    ) == ("real", "synthetic-model")


def test_report_shows_declared_tolerances_next_to_what_was_measured(
    pytester: pytest.Pytester,
) -> None:
    """A certification names the tolerance the engine declared and the differences the
    suite's comparisons measured within it (never more than the bound on a passing run)."""
    write_suite(pytester, "HonestRelativeTolerance")
    report_path = pytester.path / "report.json"
    pytester.inline_run(
        *INNER_OPTIONS, f"--shard-engine-report={report_path}", "-k", "decode_consistency"
    )
    report = _read_report(report_path)
    assert report.declared is not None
    assert report.declared.determinism["logits_tolerance"] == {"absolute": 0.0, "relative": 1e-4}
    assert report.verified is not None
    logits = report.verified.observed_differences["logits"]
    assert logits.rows_compared == 3
    assert 0.0 < logits.max_relative_difference <= 1e-4
    assert 0.0 < logits.max_fraction_of_bound <= 1.0


@pytest.mark.parametrize("internal", ["_need_layers", "_batch", "conformance_target"])
def test_a_suite_internal_cannot_be_replaced(internal: str) -> None:
    """Replacing a helper the standard tests rely on (``_need_layers`` returning without a
    skip, ``_batch`` answering for the engine) would change what they check without touching
    any test."""
    with pytest.raises(TypeError, match=f"replaces {internal}, an internal"):
        type("TestSneaky", (ShardEngineConformance,), {internal: lambda *args: None})
