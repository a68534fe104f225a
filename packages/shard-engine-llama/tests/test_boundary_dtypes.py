"""16-bit boundaries on llama.cpp: bf16 and f16 pipelines run through the wire codec, declare
themselves not split-exact, and stay within the engine's declared tolerance of the f32
pipeline (which equals the unsplit model bit for bit), measured on generated models: greedy
tokens over a generation, and max |delta logits| of every row of prompt + those tokens.
(gemma3-270m's figures are in the package README: measured there, not in a test, because the
tests never need a downloaded model.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from shard_engine_api import BoundaryDtype, SessionRef, Tolerance, load_pipeline
from shard_engine_api.engine import ModelFixture
from shard_engine_llama._engine import LlamaEngine
from shard_engine_llama._tiny_model import write_tiny_model

PROMPT = tuple(range(5, 21))
NEW_TOKENS = 12
N_LAYERS = 6


def _run(
    model: Path,
    ranges: list[tuple[int, int]],
    dtype: BoundaryDtype,
    forced: tuple[int, ...] | None,
) -> tuple[tuple[int, ...], npt.NDArray[np.float32], Tolerance]:
    """Greedy tokens, the logits of every row of prompt + ``forced`` (or + those tokens), and
    the logits tolerance the head shard declares."""
    fixture = ModelFixture(model=str(model), n_layers=N_LAYERS, options={"n_ubatch": 16})
    with load_pipeline(
        LlamaEngine,
        fixture,
        ranges,
        wire=True,
        boundary_dtype=dtype,
        max_sessions=2,
        max_context=128,
        kv_budget_tokens=256,
    ) as pipeline:
        tokens = pipeline.generate(PROMPT, max_new_tokens=NEW_TOKENS).token_ids
        rows = PROMPT + (tokens if forced is None else forced)
        logits = pipeline.prefill(SessionRef(session_id="forced", epoch=1), 0, rows, logits="all")
        declared = pipeline.engines[0].capabilities().determinism
        assert declared.split_exact == (dtype == "f32")
        assert pipeline.engines[0].capabilities().boundary_dtypes == ("f32", "f16", "bf16")
        return tokens, np.array(logits.array()), declared.tolerance_for("logits")


@pytest.mark.parametrize("boundary", ["bf16", "f16"])
@pytest.mark.parametrize(
    ("arch", "weights", "n_embd", "ranges"),
    [
        ("llama", "f32", 64, [(0, 3), (3, 6)]),
        ("llama", "f32", 64, [(0, 2), (2, 4), (4, 6)]),
        ("gemma3", "f32", 64, [(0, 3), (3, 6)]),
        ("llama", "f16", 256, [(0, 1), (1, 5), (5, 6)]),
    ],
)
def test_16_bit_boundaries_stay_within_the_declared_tolerance(
    tmp_path: Path,
    boundary: BoundaryDtype,
    arch: str,
    weights: str,
    n_embd: int,
    ranges: list[tuple[int, int]],
) -> None:
    model = tmp_path / f"{arch}-{weights}-{n_embd}.gguf"
    write_tiny_model(
        model, arch=arch, n_layers=N_LAYERS, seed=3, dtype=weights, n_embd=n_embd, n_ff=2 * n_embd
    )
    tokens, exact, _ = _run(model, ranges, "f32", None)
    rounded_tokens, rounded, tolerance = _run(model, ranges, boundary, tokens)
    drift = np.abs(rounded.astype(np.float64) - exact).max(axis=1)
    allowed = tolerance.absolute + tolerance.relative * np.abs(exact).max(axis=1)
    assert float(drift.max()) > 0.0  # lossy
    assert (drift <= allowed).all(), np.max(drift / allowed)  # within what the engine declares
    assert rounded_tokens == tokens  # far from any tie on these models: greedy tokens agree
