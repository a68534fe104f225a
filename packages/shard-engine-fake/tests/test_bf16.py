"""bf16 boundaries on the fake: the semantics its determinism declares, exactly.

A bf16 boundary carries each integer hidden value rounded to nearest even; the receiving shard
reads the nearest integer wrapped into 11 bits. So a bf16 pipeline equals a pipeline in which
the upstream rows are rounded to bf16 by hand and sent as f32 (bit for bit), is deterministic
and batch-invariant, and is declared not split-exact with a tolerance of the logit range."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import EngineFactory, bundle_of, decode, logits_of, prefill, session

import shard_engine_api as api
from shard_engine_api.wire import decode_bundle, encode_bundle
from shard_engine_fake._engine import BF16_LOGIT_TOLERANCE
from shard_engine_fake._model import LOGIT_BOUND

PROMPT = tuple(range(1, 9))


def _bf16_rounded(values: np.ndarray) -> np.ndarray:
    """Round to nearest even with 8 significant bits, in float64 (independent of the codec's
    integer bit operations): what a bf16 boundary does to the fake's integer values."""
    out = np.empty_like(values, dtype=np.float64)
    for index, value in np.ndenumerate(values.astype(np.float64)):
        if value == 0:
            out[index] = 0.0
            continue
        step = 2.0 ** (np.floor(np.log2(abs(value))) - 7)
        quotient = value / step
        low = np.floor(quotient)
        nearest = low + 1 if quotient - low > 0.5 else low
        if quotient - low == 0.5:
            nearest = low if low % 2 == 0 else low + 1
        out[index] = nearest * step
    return out


def test_bf16_is_advertised_with_its_declared_determinism(make_engine: EngineFactory) -> None:
    caps = make_engine(0, 3, boundary_dtype="bf16").capabilities()
    assert "bf16" in caps.boundary_dtypes
    assert caps.boundary_dtype == "bf16"
    assert caps.determinism == api.Determinism(
        deterministic=True,
        split_exact=False,
        tolerance=BF16_LOGIT_TOLERANCE,
        batch_invariant=True,
    )
    assert BF16_LOGIT_TOLERANCE == 2 * LOGIT_BOUND
    f32 = make_engine(0, 3).capabilities().determinism
    assert f32.split_exact
    assert f32.tolerance == 0.0


def test_a_bf16_boundary_carries_the_rounded_integers(make_engine: EngineFactory) -> None:
    head_f32 = make_engine(0, 3)
    head_bf16 = make_engine(0, 3, boundary_dtype="bf16")
    exact = bundle_of(prefill(head_f32, session(), 0, PROMPT)).array()
    bundle = bundle_of(prefill(head_bf16, session(), 0, PROMPT))
    assert bundle.dtype == "bf16"
    assert len(bundle.payload) == exact.size * 2
    assert np.array_equal(bundle.array(), _bf16_rounded(exact).astype(np.float32))
    # Values above 256 in magnitude lose bits, so the boundary is lossy on this model.
    assert float(np.abs(exact).max()) > 256
    assert not np.array_equal(bundle.array(), exact)


def test_a_bf16_pipeline_equals_the_hand_rounded_f32_pipeline(make_engine: EngineFactory) -> None:
    """The receiving shard computes on exactly the bf16 values (converted to f32 exactly)."""
    head = make_engine(0, 3, boundary_dtype="bf16")
    tail = make_engine(3, 6)
    reference_head = make_engine(0, 3)
    reference_tail = make_engine(3, 6)
    got = logits_of(prefill(tail, session(), 0, bundle_of(prefill(head, session(), 0, PROMPT))))
    exact = bundle_of(prefill(reference_head, session(), 0, PROMPT))
    rounded = api.BoundaryBundle.from_array(
        _bf16_rounded(exact.array()).astype(np.float32),
        session=session(),
        first_pos=0,
        layer=3,
        model_fingerprint=exact.model_fingerprint,
    )
    want = logits_of(prefill(reference_tail, session(), 0, rounded))
    assert got.array().tobytes() == want.array().tobytes()
    step_head = bundle_of(decode(head, session(), len(PROMPT), 5))
    step_tail = logits_of(decode(tail, session(), len(PROMPT), step_head))
    assert np.isfinite(step_tail.array()).all()


def test_bf16_pipelines_are_deterministic_and_within_the_declared_tolerance(
    make_engine: EngineFactory,
) -> None:
    runs = []
    for attempt in range(2):
        head = make_engine(0, 2, boundary_dtype="bf16")
        middle = make_engine(2, 4, boundary_dtype="bf16")
        tail = make_engine(4, 6, boundary_dtype="bf16")
        ref = session(f"run-{attempt}")
        # Through the codec, as between processes.
        first = decode_bundle(encode_bundle(bundle_of(prefill(head, ref, 0, PROMPT))))
        second = decode_bundle(encode_bundle(bundle_of(prefill(middle, ref, 0, first))))
        runs.append(logits_of(prefill(tail, ref, 0, second)).array().tobytes())
    assert runs[0] == runs[1]
    full = logits_of(prefill(make_engine(0, 6), session(), 0, PROMPT)).array()
    split = np.frombuffer(runs[0], dtype=np.float32).reshape(full.shape)
    assert float(np.max(np.abs(split - full))) <= BF16_LOGIT_TOLERANCE


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_a_nan_result_is_caught_in_every_dtype(make_engine: EngineFactory, dtype: str) -> None:
    """The malformed-output fault builds its NaN bundle in the loaded dtype (bf16 included),
    and the validation wrapper refuses it."""
    plan = {
        "rules": [{"action": {"kind": "malformed", "defect": "nan"}, "operations": ["prefill"]}]
    }
    holder: list[api.ShardEngine] = []

    def wrap(engine: api.ShardEngine) -> api.ShardEngine:
        holder.append(api.ValidatingEngine(engine))
        return holder[0]

    make_engine(0, 3, boundary_dtype=dtype, options={"faults": plan}, wrapper=wrap)
    with pytest.raises(api.MalformedOutput) as caught:
        prefill(holder[0], session(), 0, PROMPT)
    assert caught.value.details["check"] == "finite"
