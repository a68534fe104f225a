"""Every allowed family, MoE included: split == unsplit bit for bit on its generated tiny model,
2-way, 3-way uneven and with 1-layer shards, over prefills across ubatches, decode steps and a
batched decode of several sessions. Refused families are refused naming the rule."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import numpy as np
import pytest
from test_runtime import OPTIONS, Pipeline, _generate, _prompt, _shard_paths

from shard_engine_llama._gguf import (
    ALLOWED_ARCHITECTURES,
    inspect_gguf,
    read_gguf_header,
    split_model,
    validate_gguf,
)
from shard_engine_llama._gguf.families import FAMILIES
from shard_engine_llama._tiny_model import write_tiny_model

N_LAYERS: Final = 6
SPLITS: Final = {
    "2-way": [(0, 3), (3, 6)],
    "3-way uneven": [(0, 1), (1, 5), (5, 6)],
    "1-layer shards": [(0, 2), (2, 3), (3, 4), (4, 6)],
}
# (family, generator arguments): llama with experts is the Mixtral-style MoE case.
CASES: Final = [
    ("granite", {}),
    ("granitemoe", {}),
    ("llama-moe", {"arch": "llama", "n_expert": 4, "n_expert_used": 2}),
    ("olmo2", {}),
    ("phi3", {}),
    ("qwen2moe", {}),
    ("qwen3moe", {}),
    ("smollm3", {}),
]


def _model(directory: Path, name: str, arguments: dict[str, object]) -> Path:
    path = directory / f"{name}.gguf"
    options = {"arch": name, **arguments}
    write_tiny_model(path, n_layers=N_LAYERS, seed=11, **options)  # type: ignore[arg-type]
    return path


def max_abs_diff(expected: list[np.ndarray], actual: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(e - a))) for e, a in zip(expected, actual, strict=True))


@pytest.mark.parametrize("split", SPLITS, ids=list(SPLITS))
@pytest.mark.parametrize(("name", "arguments"), CASES, ids=[case[0] for case in CASES])
def test_family_split_equals_unsplit_bitwise(
    tmp_path: Path, name: str, arguments: dict[str, object], split: str
) -> None:
    model = _model(tmp_path, name, arguments)
    assert inspect_gguf(model).shardable, inspect_gguf(model).refusal
    manifest = split_model(model, SPLITS[split], tmp_path / "shards")
    for path in _shard_paths(manifest):
        validate_gguf(path)  # a shard passes the same checks as any file before llama.cpp
    full = Pipeline([model], OPTIONS)
    pipeline = Pipeline(_shard_paths(manifest), OPTIONS)
    try:
        for seq_id, n in enumerate((1, 7, 33)):
            expected = _generate(full, seq_id, _prompt(n, seed=n), n_decode=3)
            actual = _generate(pipeline, seq_id, _prompt(n, seed=n), n_decode=3)
            assert np.std(expected[0][-1]) > 0.05, "degenerate logits make equality meaningless"
            assert max_abs_diff(expected, actual) == 0.0
        # One batched decode step of the three sessions, rows in item order.
        items = [(seq_id, n + 3, 5 + seq_id) for seq_id, n in enumerate((1, 7, 33))]
        np.testing.assert_array_equal(pipeline.run_batch(items), full.run_batch(items))
    finally:
        full.close()
        pipeline.close()


def test_moe_shards_hold_only_their_own_experts(tmp_path: Path) -> None:
    model = _model(tmp_path, "qwen3moe", {})
    manifest = split_model(model, [(0, 2), (2, 6)], tmp_path / "shards")
    head = read_gguf_header(manifest.shard_path(0))
    tail = read_gguf_header(manifest.shard_path(1))
    source = read_gguf_header(model)
    assert {n for n in head.tensors if "exps" in n} == {
        f"blk.{i}.ffn_{p}_exps.weight" for i in range(3) for p in ("gate", "up", "down")
    }
    assert {n for n in tail.tensors if "exps" in n} == {
        f"blk.{i}.ffn_{p}_exps.weight" for i in range(4) for p in ("gate", "up", "down")
    }
    # Routing is copied unchanged; the experts of layer 2 are the tail's block 0.
    for key in ("qwen3moe.expert_count", "qwen3moe.expert_used_count"):
        assert tail.metadata[key].value == source.metadata[key].value
    raw, shard_raw = model.read_bytes(), manifest.shard_path(1).read_bytes()
    original, moved = (
        source.tensors["blk.2.ffn_up_exps.weight"],
        tail.tensors["blk.0.ffn_up_exps.weight"],
    )
    assert (
        raw[original.offset : original.offset + original.n_bytes]
        == (shard_raw[moved.offset : moved.offset + moved.n_bytes])
    )


def test_smollm3_shards_keep_the_no_rope_step(tmp_path: Path) -> None:
    """smollm3 skips RoPE where (il + 1) % 4 == 0 with il the file's block index: a shard
    starting at layer 5 gets one leading identity block, so its layers keep il % 4."""
    model = _model(tmp_path, "smollm3", {})
    manifest = split_model(model, [(0, 5), (5, 6)], tmp_path / "shards")
    tail = read_gguf_header(manifest.shard_path(1))
    assert tail.get_int("shard.leading_identity_blocks") == 1
    assert tail.get_int("smollm3.block_count") == 2


@pytest.mark.parametrize("arch", ["granite", "granitemoe"])
def test_granite_non_head_shards_disable_the_embedding_scale(tmp_path: Path, arch: str) -> None:
    model = _model(tmp_path, arch, {})
    manifest = split_model(model, [(0, 2), (2, 4), (4, 6)], tmp_path / "shards")
    headers = [read_gguf_header(manifest.shard_path(i)) for i in range(3)]
    scales = [header.metadata[f"{arch}.embedding_scale"].value for header in headers]
    assert scales == [12.0, 0.0, 0.0]
    # The other multipliers act inside every layer and on the logits: copied unchanged.
    source = read_gguf_header(model)
    for key in ("residual_scale", "attention.scale", "logit_scale"):
        values = {header.metadata[f"{arch}.{key}"].value for header in headers}
        assert values == {source.metadata[f"{arch}.{key}"].value}


def test_gemma2_is_refused_naming_the_rule(tmp_path: Path) -> None:
    model = tmp_path / "gemma2.gguf"
    write_tiny_model(model, arch="gemma2", n_layers=4)
    info = inspect_gguf(model)
    assert not info.shardable
    assert info.refusal is not None
    assert info.refusal.startswith("embedding-input-scaled")


def test_every_allowed_family_has_a_case() -> None:
    covered = {str(arguments.get("arch", name)) for name, arguments in CASES}
    covered |= {"gemma3", "llama", "qwen2", "qwen3"}  # test_runtime / test_engine cover these
    assert set(ALLOWED_ARCHITECTURES) <= covered
    assert {name for name, family in FAMILIES.items() if family.moe} <= covered
