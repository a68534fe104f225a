"""llama.cpp agrees with an independent float64 numpy forward pass (F32 weights and KV)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shard_engine_llama._abi import ContextSettings, ShardRuntime
from shard_engine_llama._gguf import split_model
from shard_engine_llama._reference import ReferenceModel
from shard_engine_llama._tiny_model import write_tiny_model

TOLERANCE = 1e-4
OPTIONS = ContextSettings(n_ctx=128, n_seq_max=1, n_threads=2, n_batch=64, n_ubatch=16)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe"])
def test_logits_match_reference(tmp_path: Path, arch: str) -> None:
    path = tmp_path / f"{arch}.gguf"
    write_tiny_model(path, arch=arch, seed=2)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 260, 45)]
    expected = ReferenceModel(path).logits(tokens)
    with ShardRuntime(path, settings=OPTIONS) as runtime:
        actual = runtime.run(0, 0, tokens=tokens, all_logits=True)
    assert np.std(expected) > 0.5
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE)


def test_decode_matches_reference(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    write_tiny_model(path, seed=3)
    tokens = [5, 77, 200, 13, 99, 150, 31]
    expected = ReferenceModel(path).logits(tokens)
    with ShardRuntime(path, settings=OPTIONS) as runtime:
        runtime.run(0, 0, tokens=tokens[:4])
        rows = [runtime.run(0, pos, tokens=[tokens[pos]])[0] for pos in range(4, len(tokens))]
    np.testing.assert_allclose(np.stack(rows), expected[4:], rtol=0, atol=TOLERANCE)


def test_boundary_hidden_states_match_reference(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    write_tiny_model(path, n_layers=4, seed=4)
    tokens = [int(t) for t in np.random.default_rng(2).integers(0, 260, 33)]
    reference = ReferenceModel(path)
    manifest = split_model(path, [(0, 1), (1, 3), (3, 4)], tmp_path / "out")
    with (
        ShardRuntime(manifest.shard_path(0), settings=OPTIONS) as head,
        ShardRuntime(manifest.shard_path(1), settings=OPTIONS) as middle,
    ):
        after_head = head.run(0, 0, tokens=tokens)
        after_middle = middle.run(0, 0, embeddings=after_head)
    np.testing.assert_allclose(
        after_head, reference.hidden_states(tokens, 1), rtol=0, atol=TOLERANCE
    )
    np.testing.assert_allclose(
        after_middle, reference.hidden_states(tokens, 3), rtol=0, atol=TOLERANCE
    )


def test_reference_refuses_other_architectures(tmp_path: Path) -> None:
    path = tmp_path / "gemma3.gguf"
    write_tiny_model(path, arch="gemma3", n_layers=2)
    with pytest.raises(ValueError, match="gemma3"):
        ReferenceModel(path)
