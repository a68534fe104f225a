"""The tolerance model of ``Determinism``: per output kind, relative to each row's magnitude,
with the older single absolute ``tolerance`` as the backwards-compatible default."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from shard_engine_api import Determinism, InvalidRequest, Tolerance
from shard_engine_api.conformance._harness import Tolerances, assert_matches
from shard_engine_api.conformance._recorder import SuiteRecord


@pytest.mark.parametrize(
    "fields",
    [
        {"absolute": -1.0},
        {"relative": -0.1},
        {"absolute": math.nan},
        {"relative": math.inf},
        {"relative": 1.0},
        {"relative": 5.0},
        {"absolute": True},
    ],
)
def test_a_tolerance_that_promises_nothing_is_refused(fields: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest, match="Tolerance"):
        Tolerance(**fields)  # type: ignore[arg-type]
    encoded = msgspec.json.encode(fields)
    with pytest.raises((InvalidRequest, msgspec.ValidationError)):
        msgspec.json.decode(encoded, type=Tolerance)


def test_tolerance_bound_scales_with_the_row() -> None:
    tolerance = Tolerance(absolute=0.01, relative=0.2)
    assert tolerance.bound(0.0) == 0.01
    assert tolerance.bound(1e5) == pytest.approx(0.01 + 2e4)


def test_the_single_absolute_tolerance_still_applies_to_both_kinds() -> None:
    legacy = Determinism(deterministic=True, split_exact=False, tolerance=2.0)
    assert legacy.tolerance_for("logits") == Tolerance(absolute=2.0)
    assert legacy.tolerance_for("hidden") == Tolerance(absolute=2.0)
    per_kind = Determinism(
        deterministic=True,
        split_exact=False,
        tolerance=2.0,
        logits_tolerance=Tolerance(relative=0.4),
    )
    assert per_kind.tolerance_for("logits") == Tolerance(relative=0.4)
    assert per_kind.tolerance_for("hidden") == Tolerance(absolute=2.0)
    for broken in (math.nan, -1.0, math.inf):
        odd = Determinism(deterministic=True, split_exact=False, tolerance=broken)
        assert odd.tolerance_for("logits") == Tolerance(), "an invalid bound means exactness"


def test_determinism_with_tolerances_round_trips_and_old_messages_decode() -> None:
    declared = Determinism(
        deterministic=True,
        split_exact=True,
        batch_invariant=False,
        logits_tolerance=Tolerance(absolute=0.01, relative=0.4),
        hidden_tolerance=Tolerance(absolute=0.01, relative=0.2),
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(declared), type=Determinism) == declared
    old = msgspec.msgpack.encode({"deterministic": True, "split_exact": False, "tolerance": 1.5})
    decoded = msgspec.msgpack.decode(old, type=Determinism)
    assert decoded.logits_tolerance is None
    assert decoded.tolerance_for("hidden") == Tolerance(absolute=1.5)


def test_comparisons_apply_the_declared_bound_per_row_and_record_it() -> None:
    record = SuiteRecord(suite="t")
    tolerances = Tolerances(
        logits=Tolerance(relative=0.1), hidden=Tolerance(absolute=1.0), record=record
    )
    expected = np.array([[10.0, 1.0], [1000.0, 2.0]], np.float32)
    within = expected + np.array([[0.9, 0.9], [99.0, 99.0]], np.float32)
    assert_matches(within, expected, exact=False, tolerance=tolerances, what="rows")
    # The second row's large magnitude does not widen the first row's bound.
    beyond = expected + np.array([[1.1, 0.0], [0.0, 0.0]], np.float32)
    with pytest.raises(AssertionError, match=r"row 0: .* exceeds the declared logits tolerance"):
        assert_matches(beyond, expected, exact=False, tolerance=tolerances, what="rows")
    with pytest.raises(AssertionError, match="hidden tolerance"):
        assert_matches(within, expected, exact=False, tolerance=tolerances, what="", kind="hidden")
    logits = record.observed["logits"]
    assert logits.rows_compared == 4
    assert logits.max_relative_difference == pytest.approx(0.11, rel=1e-3)
    assert logits.max_fraction_of_bound == pytest.approx(1.1, rel=1e-3)
    assert record.observed["hidden"].max_abs_difference == pytest.approx(99.0)
