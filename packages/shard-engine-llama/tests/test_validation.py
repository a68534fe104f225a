"""The family-aware validator: every file llama.cpp would abort on or refuse is refused first,
with the rule and the field named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from gguf_edit import TensorEdit, f32, rewrite, u32

from shard_engine_llama._gguf import (
    GGUFValidationError,
    MetadataValue,
    inspect_gguf,
    read_gguf_header,
    validate_gguf,
)
from shard_engine_llama._gguf.families import FAMILIES
from shard_engine_llama._tiny_model import SUPPORTED_TINY_ARCHITECTURES, write_tiny_model

F32 = gguf.GGMLQuantizationType.F32


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "llama.gguf"
    write_tiny_model(path, n_layers=3)
    return path


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "qwen3moe.gguf"
    write_tiny_model(path, arch="qwen3moe", n_layers=3)
    return path


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHITECTURES)
def test_every_generated_family_validates(tmp_path: Path, arch: str) -> None:
    path = tmp_path / f"{arch}.gguf"
    write_tiny_model(path, arch=arch, n_layers=3)
    assert validate_gguf(path).architecture == arch
    assert arch in FAMILIES


LLAMA_CASES: list[
    tuple[str, dict[str, MetadataValue | None], dict[str, TensorEdit | None], str, str]
] = [
    # (case, metadata edits, tensor edits, rule, field)
    (
        "negative rms epsilon (GGML_ASSERT(eps >= 0.0f) on first prefill)",
        {"llama.attention.layer_norm_rms_epsilon": f32(-1e-5)},
        {},
        "hparam-positive-finite",
        "llama.attention.layer_norm_rms_epsilon",
    ),
    (
        "nan rms epsilon",
        {"llama.attention.layer_norm_rms_epsilon": f32(float("nan"))},
        {},
        "hparam-positive-finite",
        "llama.attention.layer_norm_rms_epsilon",
    ),
    (
        "missing rms epsilon",
        {"llama.attention.layer_norm_rms_epsilon": None},
        {},
        "metadata-missing",
        "llama.attention.layer_norm_rms_epsilon",
    ),
    (
        "epsilon stored as a double",
        {"llama.attention.layer_norm_rms_epsilon": MetadataValue(1e-5, gguf.GGUFValueType.FLOAT64)},
        {},
        "metadata-type",
        "llama.attention.layer_norm_rms_epsilon",
    ),
    (
        "zero heads",
        {"llama.attention.head_count": u32(0)},
        {},
        "hparam-head-count",
        "llama.attention.head_count",
    ),
    (
        "kv heads not dividing heads",
        {"llama.attention.head_count_kv": u32(3)},
        {},
        "hparam-head-count-kv",
        "llama.attention.head_count_kv",
    ),
    (
        "rope dimension larger than the head",
        {"llama.rope.dimension_count": u32(32)},
        {},
        "hparam-rope-dimension",
        "llama.rope.dimension_count",
    ),
    (
        "odd feed-forward length the tensors do not have",
        {"llama.feed_forward_length": u32(127)},
        {},
        "tensor-shape",
        "blk.0.ffn_gate.weight",
    ),
    (
        "zero context length",
        {"llama.context_length": u32(0)},
        {},
        "hparam-context-length",
        "llama.context_length",
    ),
    (
        "unknown rope scaling type (GGML_ASSERT in load_hparams)",
        {"llama.rope.scaling.type": MetadataValue("sideways", gguf.GGUFValueType.STRING)},
        {},
        "hparam-rope-scaling-type",
        "llama.rope.scaling.type",
    ),
    (
        "experts used without experts (GGML_ASSERT in load_hparams)",
        {"llama.expert_used_count": u32(2)},
        {},
        "hparam-expert-count",
        "llama.expert_used_count",
    ),
    (
        "tensor of the wrong shape",
        {},
        {"blk.1.attn_k.weight": TensorEdit("blk.1.attn_k.weight", (64, 16), F32)},
        "tensor-shape",
        "blk.1.attn_k.weight",
    ),
    (
        "missing block tensor",
        {},
        {"blk.2.ffn_up.weight": None},
        "tensor-missing",
        "blk.2.ffn_up.weight",
    ),
    (
        "tensor nobody uses",
        {},
        {"blk.0.extra.weight": TensorEdit("blk.0.extra.weight", (64,), F32)},
        "tensor-unexpected",
        "blk.0.extra.weight",
    ),
    (
        "F16 norm",
        {},
        {
            "blk.0.ffn_norm.weight": TensorEdit(
                "blk.0.ffn_norm.weight", (64,), gguf.GGMLQuantizationType.F16
            )
        },
        "tensor-type",
        "blk.0.ffn_norm.weight",
    ),
    (
        "integer matrix",
        {},
        {
            "blk.0.attn_q.weight": TensorEdit(
                "blk.0.attn_q.weight", (64, 64), gguf.GGMLQuantizationType.I32
            )
        },
        "tensor-type",
        "blk.0.attn_q.weight",
    ),
    (
        "unknown tokenizer",
        {"tokenizer.ggml.model": MetadataValue("klingon", gguf.GGUFValueType.STRING)},
        {},
        "tokenizer-model",
        "tokenizer.ggml.model",
    ),
    (
        "bos token outside the vocabulary",
        {"tokenizer.ggml.bos_token_id": u32(9999)},
        {},
        "vocabulary-token-id",
        "tokenizer.ggml.bos_token_id",
    ),
    (
        "block count as a signed integer",
        {"llama.block_count": MetadataValue(3, gguf.GGUFValueType.INT32)},
        {},
        "metadata-type",
        "llama.block_count",
    ),
]


@pytest.mark.parametrize(
    ("metadata", "tensors", "rule", "field"),
    [case[1:] for case in LLAMA_CASES],
    ids=[case[0] for case in LLAMA_CASES],
)
def test_bad_llama_files_are_refused_naming_rule_and_field(
    llama: Path,
    tmp_path: Path,
    metadata: dict[str, MetadataValue | None],
    tensors: dict[str, TensorEdit | None],
    rule: str,
    field: str,
) -> None:
    broken = rewrite(llama, tmp_path / "broken.gguf", metadata=metadata, tensors=tensors)
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(broken)
    assert (raised.value.rule, raised.value.field) == (rule, field), str(raised.value)
    assert field in str(raised.value)


MOE_CASES: list[tuple[str, dict[str, MetadataValue | None], str, str]] = [
    (
        "more experts used than exist",
        {"qwen3moe.expert_used_count": u32(5)},
        "hparam-expert-count",
        "qwen3moe.expert_used_count",
    ),
    (
        "no experts",
        {"qwen3moe.expert_count": u32(0), "qwen3moe.expert_used_count": u32(0)},
        "hparam-expert-count",
        "qwen3moe.expert_count",
    ),
    (
        "zero experts used",
        {"qwen3moe.expert_used_count": u32(0)},
        "hparam-expert-count",
        "qwen3moe.expert_used_count",
    ),
    (
        "expert count the tensors do not have",
        {"qwen3moe.expert_count": u32(8)},
        "tensor-shape",
        "blk.0.ffn_gate_inp.weight",
    ),
    (
        "expert feed-forward length the tensors do not have",
        {"qwen3moe.expert_feed_forward_length": u32(48)},
        "tensor-shape",
        "blk.0.ffn_gate_exps.weight",
    ),
    (
        "expert groups",
        {"qwen3moe.expert_group_count": u32(2)},
        "hparam-expert-groups",
        "qwen3moe.expert_group_count",
    ),
]


@pytest.mark.parametrize(
    ("metadata", "rule", "field"),
    [case[1:] for case in MOE_CASES],
    ids=[case[0] for case in MOE_CASES],
)
def test_bad_moe_files_are_refused(
    qwen3moe: Path, tmp_path: Path, metadata: dict[str, MetadataValue | None], rule: str, field: str
) -> None:
    broken = rewrite(qwen3moe, tmp_path / "broken.gguf", metadata=metadata)
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(broken)
    assert (raised.value.rule, raised.value.field) == (rule, field), str(raised.value)


def test_per_layer_arrays_must_be_uniform_where_the_loader_reads_one_value(
    llama: Path, tmp_path: Path
) -> None:
    varying = MetadataValue([4, 2, 4], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32)
    broken = rewrite(
        llama, tmp_path / "b.gguf", metadata={"llama.attention.head_count_kv": varying}
    )
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(broken)
    assert raised.value.rule == "hparam-per-layer-uniform"


def test_inspect_says_not_shardable_with_the_rule(llama: Path, tmp_path: Path) -> None:
    broken = rewrite(
        llama,
        tmp_path / "negative-eps.gguf",
        metadata={"llama.attention.layer_norm_rms_epsilon": f32(-1e-5)},
    )
    command = [
        sys.executable,
        "-c",
        "import sys; from shard_engine_api.cli import main; sys.exit(main())",
        "inspect",
        str(broken),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 2, result.stderr
    assert "shardable:     no — refused by rule: hparam-positive-finite" in result.stdout
    assert "llama.attention.layer_norm_rms_epsilon" in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_inspect_lists_the_shard_rules(llama: Path) -> None:
    info = inspect_gguf(llama)
    assert info.rules[:3] == ("slice-layers", "identity-block", "middle-no-vocabulary")


def test_a_shard_written_by_split_passes_the_validator(llama: Path, tmp_path: Path) -> None:
    from shard_engine_llama._gguf import split_model

    manifest = split_model(llama, [(0, 1), (1, 2), (2, 3)], tmp_path)
    for index in range(3):
        header = validate_gguf(manifest.shard_path(index))
        assert header.is_shard
    assert read_gguf_header(llama).architecture == "llama"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("shard.end", u32(3)),
        ("shard.role", MetadataValue("tail", gguf.GGUFValueType.STRING)),
        ("shard.has_identity_block", MetadataValue(False, gguf.GGUFValueType.BOOL)),
        ("shard.leading_identity_blocks", u32(2)),
        ("shard.start", None),
    ],
)
def test_shard_keys_must_describe_the_file(
    llama: Path, tmp_path: Path, key: str, value: MetadataValue | None
) -> None:
    """The shard keys pick the layer a runtime captures; keys that lie are refused."""
    from shard_engine_llama._gguf import split_model

    manifest = split_model(llama, [(0, 1), (1, 2), (2, 3)], tmp_path / "shards")
    broken = rewrite(manifest.shard_path(1), tmp_path / "lying.gguf", metadata={key: value})
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(broken)
    assert raised.value.rule == "shard-keys"
