"""The family-aware validator: every file llama.cpp would abort on or refuse is refused first,
with the rule and the field named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_edit import (
    TensorEdit,
    array,
    f32,
    reseal,
    rewrite,
    swap_tensor_offsets,
    tensors_of,
    u32,
)

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
Q8_K = gguf.GGMLQuantizationType.Q8_K


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
    # llama_model_loader reads the gguf-split keys as UINT16 (split.no, split.count) and INT32
    # (split.tensors.count): "key split.count has wrong type u32 but expected type u16".
    ("split.count as UINT32", {"split.count": u32(1)}, {}, "metadata-type", "split.count"),
    ("split.no as UINT32", {"split.no": u32(0)}, {}, "metadata-type", "split.no"),
    (
        "split.tensors.count as UINT32",
        {"split.tensors.count": u32(30)},
        {},
        "metadata-type",
        "split.tensors.count",
    ),
    (
        "one part of a gguf-split model: llama.cpp opens the other parts by name",
        {
            "split.count": MetadataValue(2, gguf.GGUFValueType.UINT16),
            "split.no": MetadataValue(0, gguf.GGUFValueType.UINT16),
        },
        {},
        "gguf-split",
        "split.count",
    ),
    (
        "whitespace pre-tokenizer of a BPE vocabulary (its merges abort on two spaces)",
        {
            "tokenizer.ggml.model": MetadataValue("gpt2", gguf.GGUFValueType.STRING),
            "tokenizer.ggml.pre": MetadataValue("whitespace", gguf.GGUFValueType.STRING),
            "tokenizer.ggml.merges": array(["a b"], gguf.GGUFValueType.STRING),
        },
        {},
        "tokenizer-pre",
        "tokenizer.ggml.pre",
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


_BOOL = gguf.GGUFValueType.BOOL
_STRING = gguf.GGUFValueType.STRING


def _string(value: str) -> MetadataValue:
    return MetadataValue(value, _STRING)


# Each of these loaded past the validator and then aborted llama.cpp (SIGABRT/SIGSEGV) or made
# it refuse the file with its generic "could not load": (case, family, metadata edits, tensor
# edits, rule, field).
FAMILY_CASES: list[
    tuple[str, str, dict[str, MetadataValue | None], dict[str, TensorEdit | None], str, str]
] = [
    (
        "gemma2 pattern with no sliding-window layer (abort building the iSWA cache)",
        "gemma2",
        {"gemma2.attention.sliding_window_pattern": array([False] * 3, _BOOL)},
        {},
        "hparam-sliding-window-pattern",
        "gemma2.attention.sliding_window_pattern",
    ),
    (
        "gemma3 pattern period 1: every layer global (abort)",
        "gemma3",
        {"gemma3.attention.sliding_window_pattern": u32(1)},
        {},
        "hparam-sliding-window-pattern",
        "gemma3.attention.sliding_window_pattern",
    ),
    (
        "olmo2 with a window and pattern period 1 (abort)",
        "olmo2",
        {
            "olmo2.attention.sliding_window": u32(8),
            "olmo2.attention.sliding_window_pattern": u32(1),
        },
        {},
        "hparam-sliding-window-pattern",
        "olmo2.attention.sliding_window_pattern",
    ),
    (
        "sliding-window pattern as a float",
        "gemma3",
        {"gemma3.attention.sliding_window_pattern": f32(6.0)},
        {},
        "metadata-type",
        "gemma3.attention.sliding_window_pattern",
    ),
    (
        "more multi-token-prediction layers than blocks (GGML_ASSERT in load_hparams)",
        "llama",
        {"llama.nextn_predict_layers": u32(9)},
        {},
        "metadata-unknown-key",
        "llama.nextn_predict_layers",
    ),
    (
        "sliding-window key length (llama.cpp refuses the tensors)",
        "gemma3",
        {"gemma3.attention.key_length_swa": u32(8)},
        {},
        "metadata-unknown-key",
        "gemma3.attention.key_length_swa",
    ),
    (
        "pooling type as a string",
        "qwen3",
        {"qwen3.pooling_type": _string("mean")},
        {},
        "metadata-unknown-key",
        "qwen3.pooling_type",
    ),
    (
        "SWA rope dimension (read for every family)",
        "qwen3",
        {"qwen3.rope.dimension_count_swa": u32(6)},
        {},
        "metadata-unknown-key",
        "qwen3.rope.dimension_count_swa",
    ),
    (
        "deepstack mapping (read by granite only)",
        "granite",
        {"granite.deepstack_mapping": array([1, 0, 1], gguf.GGUFValueType.UINT32)},
        {},
        "metadata-unknown-key",
        "granite.deepstack_mapping",
    ),
    (
        "model name as an integer",
        "qwen3",
        {"general.name": u32(3)},
        {},
        "metadata-type",
        "general.name",
    ),
    (
        "file type as a string",
        "smollm3",
        {"general.file_type": _string("f32")},
        {},
        "metadata-type",
        "general.file_type",
    ),
    (
        "alignment 8: tensors not 32-byte aligned (GGML_ASSERT buffer pointer must be aligned)",
        "qwen2",
        {"general.alignment": u32(8)},
        {},
        "gguf-alignment",
        "general.alignment",
    ),
    (
        "alignment as a bool",
        "qwen2",
        {"general.alignment": MetadataValue(True, _BOOL)},
        {},
        "gguf-alignment",
        "general.alignment",
    ),
    (
        "per-tensor precision policy",
        "llama",
        {"general.tensor_extra.name": array(["blk.0.attn_q.weight"], _STRING)},
        {},
        "metadata-unsupported",
        "general.tensor_extra.name",
    ),
    (
        "token types as uint8",
        "phi3",
        {"tokenizer.ggml.token_type": array([1] * 260, gguf.GGUFValueType.UINT8)},
        {},
        "metadata-type",
        "tokenizer.ggml.token_type",
    ),
    (
        "scores as float64",
        "granite",
        {"tokenizer.ggml.scores": array([0.0] * 260, gguf.GGUFValueType.FLOAT64)},
        {},
        "metadata-type",
        "tokenizer.ggml.scores",
    ),
    (
        "add_space_prefix as an integer",
        "qwen3moe",
        {"tokenizer.ggml.add_space_prefix": u32(1)},
        {},
        "metadata-type",
        "tokenizer.ggml.add_space_prefix",
    ),
    (
        "suppressed tokens as uint32",
        "llama",
        {"tokenizer.ggml.suppress_tokens": array([1, 2], gguf.GGUFValueType.UINT32)},
        {},
        "metadata-type",
        "tokenizer.ggml.suppress_tokens",
    ),
    (
        "mask token beyond the vocabulary",
        "qwen2moe",
        {"tokenizer.ggml.mask_token_id": u32(2**32 - 1)},
        {},
        "vocabulary-token-id",
        "tokenizer.ggml.mask_token_id",
    ),
    (
        "BPE vocabulary with an unknown pre-tokenizer",
        "qwen2",
        {
            "tokenizer.ggml.model": _string("gpt2"),
            "tokenizer.ggml.merges": array(["a b"], _STRING),
            "tokenizer.ggml.pre": _string("bogus"),
        },
        {},
        "tokenizer-pre",
        "tokenizer.ggml.pre",
    ),
    (
        "rope attention factor whose square overflows the scores (every logit NaN)",
        "qwen3",
        {"qwen3.rope.scaling.attn_factor": f32(1e30)},
        {},
        "hparam-rope-attn-factor",
        "qwen3.rope.scaling.attn_factor",
    ),
    (
        "YaRN original context past int32 (every logit NaN)",
        "llama",
        {
            "llama.rope.scaling.type": _string("yarn"),
            "llama.rope.scaling.factor": f32(4.0),
            "llama.rope.scaling.original_context_length": u32(2**31),
        },
        {},
        "hparam-rope-original-context",
        "llama.rope.scaling.original_context_length",
    ),
    (
        "YaRN without an original context, context_length past int32 (every logit NaN)",
        "gemma3",
        {
            "gemma3.rope.scaling.type": _string("yarn"),
            "gemma3.rope.scaling.factor": f32(4.0),
            "gemma3.context_length": u32(2**32 - 1),
        },
        {},
        "hparam-rope-original-context",
        "gemma3.context_length",
    ),
    (
        "denormal rope base: angles overflow to inf (every logit NaN)",
        "granite",
        {"granite.rope.freq_base": f32(1e-45)},
        {},
        "hparam-rope-freq-base",
        "granite.rope.freq_base",
    ),
    (
        "denormal rope scaling factor: rope's frequency scale 1 / factor is inf (NaN logits)",
        "qwen2",
        {"qwen2.rope.scaling.type": _string("linear"), "qwen2.rope.scaling.factor": f32(1e-45)},
        {},
        "hparam-divisor",
        "qwen2.rope.scaling.factor",
    ),
    (
        "denormal linear rope scale (NaN logits)",
        "smollm3",
        {"smollm3.rope.scale_linear": f32(1e-45)},
        {},
        "hparam-divisor",
        "smollm3.rope.scale_linear",
    ),
    (
        "granite residual multiplier of 3e38: the products overflow (NaN logits)",
        "granite",
        {"granite.residual_scale": f32(3e38)},
        {},
        "hparam-multiplier",
        "granite.residual_scale",
    ),
    (
        "granite embedding multiplier of 3e38 (NaN logits)",
        "granitemoe",
        {"granitemoe.embedding_scale": f32(3e38)},
        {},
        "hparam-multiplier",
        "granitemoe.embedding_scale",
    ),
    (
        "granite attention multiplier of 3e38 (NaN logits)",
        "granite",
        {"granite.attention.scale": f32(3e38)},
        {},
        "hparam-multiplier",
        "granite.attention.scale",
    ),
    (
        "non-causal attention: prefill 5 + decode 1 was 0.36 off prefill 6",
        "llama",
        {"llama.attention.causal": MetadataValue(False, gguf.GGUFValueType.BOOL)},
        {},
        "hparam-causal",
        "llama.attention.causal",
    ),
    (
        "gemma2 attention softcap 0, which its graph divides by (every logit NaN)",
        "gemma2",
        {"gemma2.attn_logit_softcapping": f32(0.0)},
        {},
        "hparam-divisor",
        "gemma2.attn_logit_softcapping",
    ),
    (
        "gemma2 final logit softcap 1e-40: the logits are scaled by its reciprocal (inf)",
        "gemma2",
        {"gemma2.final_logit_softcapping": f32(1e-40)},
        {},
        "hparam-divisor",
        "gemma2.final_logit_softcapping",
    ),
    (
        "gemma2 final logit softcap 0: gemma2's graph divides by it unconditionally",
        "gemma2",
        {"gemma2.final_logit_softcapping": f32(0.0)},
        {},
        "hparam-divisor",
        "gemma2.final_logit_softcapping",
    ),
    (
        "gemma3 final logit softcap 1e-40 (0 turns it off, a denormal overflows)",
        "gemma3",
        {"gemma3.final_logit_softcapping": f32(1e-40)},
        {},
        "hparam-divisor",
        "gemma3.final_logit_softcapping",
    ),
    (
        "gemma2 attention softcap 1e-45: its reciprocal overflows (every logit NaN)",
        "gemma2",
        {"gemma2.attn_logit_softcapping": f32(1e-45)},
        {},
        "hparam-divisor",
        "gemma2.attn_logit_softcapping",
    ),
    (
        "granite logit scale 1e-45, which divides the logits (every logit inf)",
        "granitemoe",
        {"granitemoe.logit_scale": f32(1e-45)},
        {},
        "hparam-divisor",
        "granitemoe.logit_scale",
    ),
    (
        "weight matrix of the activation-only type Q8_K (SIGSEGV in the first forward)",
        "llama",
        {},
        {"blk.0.attn_q.weight": TensorEdit("blk.0.attn_q.weight", (256, 256), Q8_K)},
        "tensor-type",
        "blk.0.attn_q.weight",
    ),
]


@pytest.mark.parametrize(
    ("arch", "metadata", "tensors", "rule", "field"),
    [case[1:] for case in FAMILY_CASES],
    ids=[case[0] for case in FAMILY_CASES],
)
def test_files_llama_cpp_aborts_on_or_refuses_are_refused_first(
    tmp_path: Path,
    arch: str,
    metadata: dict[str, MetadataValue | None],
    tensors: dict[str, TensorEdit | None],
    rule: str,
    field: str,
) -> None:
    source = tmp_path / f"{arch}.gguf"
    wide = bool(tensors)  # a K-quant needs rows of 256
    write_tiny_model(
        source, arch=arch, n_layers=3, n_embd=256 if wide else 64, n_ff=256 if wide else 128
    )
    broken = rewrite(source, tmp_path / "broken.gguf", metadata=metadata, tensors=tensors)
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(broken)
    assert (raised.value.rule, raised.value.field) == (rule, field), str(raised.value)


def test_empty_token_named_like_an_existing_one_is_a_duplicate(llama: Path, tmp_path: Path) -> None:
    # llama.cpp renames an empty token i to "[EMPTY_i]"; a second token of that text made
    # GGML_ASSERT(id_to_token.size() == token_to_id.size()) abort the process.
    tokens = list(read_gguf_header(llama).metadata["tokenizer.ggml.tokens"].value)  # type: ignore[arg-type]
    tokens[10], tokens[11] = "", "[EMPTY_10]"
    broken = rewrite(
        llama, tmp_path / "b.gguf", metadata={"tokenizer.ggml.tokens": array(tokens, _STRING)}
    )
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(broken)
    assert raised.value.rule == "vocabulary-duplicate-tokens"


def test_byte_token_must_name_its_byte(llama: Path, tmp_path: Path) -> None:
    header = read_gguf_header(llama)
    tokens = list(header.metadata["tokenizer.ggml.tokens"].value)  # type: ignore[arg-type]
    types = list(header.metadata["tokenizer.ggml.token_type"].value)  # type: ignore[arg-type]
    index = types.index(6)
    tokens[index] = "<x"  # llama.cpp: basic_string::substr while building its piece cache
    broken = rewrite(
        llama, tmp_path / "b.gguf", metadata={"tokenizer.ggml.tokens": array(tokens, _STRING)}
    )
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(broken)
    assert (raised.value.rule, raised.value.field) == (
        "vocabulary-byte-token",
        "tokenizer.ggml.tokens",
    )


def test_tensor_data_out_of_table_order_is_refused(llama: Path, tmp_path: Path) -> None:
    # Both offsets stay inside the file; gguf.cpp still refuses ("has offset X, expected Y").
    broken = tmp_path / "swapped.gguf"
    broken.write_bytes(llama.read_bytes())
    names = [tensor.name for tensor in tensors_of(read_gguf_header(llama))]
    swap_tensor_offsets(broken, names[1], names[2])
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(broken)
    assert (raised.value.rule, raised.value.field) == ("tensor-offset", names[1])


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


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("shard.source_sha256", _string("x")),
        ("shard.source_sha256", _string("Z" * 64)),
        ("shard.source_vocab_size", _string("260")),
        ("shard.source_vocab_size", u32(0)),
        ("shard.source_vocab_size", MetadataValue(-5, gguf.GGUFValueType.INT32)),
        ("shard.source_vocab_size", u32(261)),
    ],
    ids=repr,
)
def test_tail_shard_keys_the_engine_reports_must_be_sound(
    llama: Path, tmp_path: Path, key: str, value: MetadataValue
) -> None:
    """A shard reports its source digest as the model fingerprint and its source vocabulary
    size as the model's: a re-sealed shard carrying nonsense there ('x', -5, a size other
    than the tail's logits width) used to load and report it."""
    from shard_engine_llama._gguf import split_model

    manifest = split_model(llama, [(0, 1), (1, 3)], tmp_path / "shards")
    broken = rewrite(manifest.shard_path(1), tmp_path / "lying.gguf", metadata={key: value})
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(broken)
    assert (raised.value.rule, raised.value.field) == ("shard-keys", key)


@pytest.mark.parametrize(
    ("arch", "suffix", "value"),
    [
        ("llama", "tensor_data_layout", _string("Meta AI original pth")),
        ("qwen3moe", "expert_gating_func", u32(7)),
        ("qwen2", "attention.q_lora_rank", f32(float("nan"))),
        ("gemma3", "converter.note", array([1, 2], gguf.GGUFValueType.UINT32)),
        ("llama", "deepstack_mapping", array([1, 0, 1], gguf.GGUFValueType.UINT32)),
    ],
)
def test_keys_llama_cpp_never_reads_for_the_family_are_ignored(
    tmp_path: Path, arch: str, suffix: str, value: MetadataValue
) -> None:
    """Older llama conversions carry ``llama.tensor_data_layout``; converters add notes and keys
    of other architectures. llama.cpp never reads them for the family, so refusing them would
    refuse sound files; ``test_engine`` loads such a file and gets the same logits."""
    source = tmp_path / f"{arch}.gguf"
    write_tiny_model(source, arch=arch, n_layers=3)
    extended = rewrite(source, tmp_path / "extra.gguf", metadata={f"{arch}.{suffix}": value})
    assert validate_gguf(extended).architecture == arch


_BOOL = gguf.GGUFValueType.BOOL


@pytest.mark.parametrize(
    ("arch", "ranges", "index", "metadata", "rule", "field"),
    [
        (
            "granite",
            [(0, 1), (1, 2), (2, 3)],
            1,
            {"granite.embedding_scale": f32(12.0)},
            "embedding-scale-head-only",
            "granite.embedding_scale",
        ),
        (
            "granitemoe",
            [(0, 1), (1, 3)],
            1,
            {"granitemoe.embedding_scale": None},
            "embedding-scale-head-only",
            "granitemoe.embedding_scale",
        ),
        (
            "gemma3",
            [(0, 1), (1, 2), (2, 3)],
            1,
            {"gemma3.attention.sliding_window_pattern": None},
            "swa-pattern-explicit",
            "gemma3.attention.sliding_window_pattern",
        ),
        (
            "gemma3",
            [(0, 1), (1, 3)],
            1,
            {"gemma3.attention.sliding_window_pattern": u32(6)},
            "swa-pattern-explicit",
            "gemma3.attention.sliding_window_pattern",
        ),
        (
            # One leading identity block dropped from the count, the range shifted to match:
            # the block count still adds up, the no-RoPE layers move.
            "smollm3",
            [(0, 1), (1, 2), (2, 3)],
            1,
            {
                "shard.leading_identity_blocks": u32(0),
                "shard.end": u32(3),
                "shard.n_layers_total": u32(4),
            },
            "no-rope-step-padding",
            "shard.leading_identity_blocks",
        ),
        (
            "llama",
            [(0, 1), (1, 3)],
            1,
            {"shard.leading_identity_blocks": u32(1), "shard.start": u32(2)},
            "no-rope-step-padding",
            "shard.leading_identity_blocks",
        ),
    ],
    ids=[
        "granite-middle-scaled",
        "granitemoe-tail-no-scale-key",
        "gemma3-middle-no-pattern",
        "gemma3-tail-period",
        "smollm3-padding-dropped",
        "llama-padding-added",
    ],
)
def test_a_resealed_shard_without_its_family_rule_is_refused(
    tmp_path: Path,
    arch: str,
    ranges: list[tuple[int, int]],
    index: int,
    metadata: dict[str, MetadataValue | None],
    rule: str,
    field: str,
) -> None:
    """A shard edited after split and sealed again passes the digest check: the digest is no
    signature. One whose family's shard rewrite is undone (granite's input scale back, gemma3's
    explicit window pattern gone, smollm3's no-RoPE padding wrong) used to validate and load,
    and computed other hidden states than the full model's layers."""
    from shard_engine_llama._gguf import split_model

    source = tmp_path / f"{arch}.gguf"
    write_tiny_model(source, arch=arch, n_layers=3)
    manifest = split_model(source, ranges, tmp_path / "shards")
    assert validate_gguf(manifest.shard_path(index)).is_shard
    forged = reseal(manifest.shard_path(index), tmp_path / "forged.gguf", metadata)
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(forged)
    assert (raised.value.rule, raised.value.field) == (rule, field), str(raised.value)


def _as_shard(source: Path, destination: Path, start: int, end: int, total: int, role: str) -> Path:
    """A full model re-labelled as a shard of a larger model, sealed."""
    return reseal(
        source,
        destination,
        {
            "shard.start": u32(start),
            "shard.end": u32(end),
            "shard.n_layers_total": u32(total),
            "shard.role": MetadataValue(role, _STRING),
            "shard.has_identity_block": MetadataValue(False, _BOOL),
            "shard.source_sha256": _string("0" * 64),
            "shard.leading_identity_blocks": u32(0),
        },
    )


def test_a_shard_of_a_family_that_cannot_be_split_is_refused(tmp_path: Path) -> None:
    """split refuses gemma2 (its graph scales hidden-state input too); a hand-made gemma2 tail
    shard used to load and rescale the boundary it received."""
    source = tmp_path / "gemma2.gguf"
    write_tiny_model(source, arch="gemma2", n_layers=3)
    tail = _as_shard(source, tmp_path / "tail.gguf", 1, 4, 4, "tail")
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(tail)
    assert (raised.value.rule, raised.value.field) == (
        "embedding-input-scaled",
        "general.architecture",
    )


def test_a_gemma3_shard_whose_block_count_switches_the_attention_scale_is_refused(
    tmp_path: Path,
) -> None:
    """gemma3 picks the 27B attention scale when it has 62 blocks: a 62-block shard of a
    63-layer model would compute attention with another scale than its model."""
    source = tmp_path / "gemma3.gguf"
    write_tiny_model(source, arch="gemma3", n_layers=62, n_embd=32, n_head=2, n_head_kv=1, n_ff=32)
    pattern = array([il % 6 < 5 for il in range(1, 63)], _BOOL)
    staged = rewrite(
        source,
        tmp_path / "staged.gguf",
        metadata={"gemma3.attention.sliding_window_pattern": pattern},
    )
    tail = _as_shard(staged, tmp_path / "tail.gguf", 1, 63, 63, "tail")
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(tail)
    assert (raised.value.rule, raised.value.field) == (
        "gemma3-layer-count-attention-scale",
        "gemma3.block_count",
    )


def _vector(name: str, n: int, value: float) -> TensorEdit:
    return TensorEdit(name, (n,), F32, np.full(n, value, dtype="<f4").tobytes())


@pytest.mark.parametrize(
    ("arch", "tensor", "value", "field"),
    [
        ("llama", "blk.1.attn_norm.weight", float("nan"), "blk.1.attn_norm.weight"),
        ("gemma3", "output_norm.weight", float("inf"), "output_norm.weight"),
        ("qwen2", "blk.0.attn_q.bias", float("-inf"), "blk.0.attn_q.bias"),
        # qwen2moe's shared-expert gate is silu(x) / x: 0 / 0 for a gate logit of exactly 0.
        ("qwen2moe", "blk.1.ffn_gate_inp_shexp.weight", 0.0, "blk.1.ffn_gate_inp_shexp.weight"),
        ("qwen2moe", "blk.2.ffn_norm.weight", 0.0, "blk.2.ffn_gate_inp_shexp.weight"),
        ("qwen2moe", "blk.0.ffn_gate_inp_shexp.weight", 1e-45, "blk.0.ffn_gate_inp_shexp.weight"),
    ],
)
def test_vectors_that_make_every_logit_nan_are_refused(
    tmp_path: Path, arch: str, tensor: str, value: float, field: str
) -> None:
    """Each of these files loaded and returned NaN from every prefill and decode."""
    source = tmp_path / f"{arch}.gguf"
    write_tiny_model(source, arch=arch, n_layers=3)
    n = read_gguf_header(source).tensors[tensor].shape[0]
    broken = rewrite(source, tmp_path / "broken.gguf", tensors={tensor: _vector(tensor, n, value)})
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(broken)
    assert (raised.value.rule, raised.value.field) == ("tensor-values", field), str(raised.value)


def test_a_qwen2moe_shard_identity_block_may_have_a_zero_gate(tmp_path: Path) -> None:
    """split's identity block is all zeros, shared-expert gate included; the runtime stops the
    graph before it, so the rule leaves it alone."""
    from shard_engine_llama._gguf import split_model

    source = tmp_path / "qwen2moe.gguf"
    write_tiny_model(source, arch="qwen2moe", n_layers=3)
    manifest = split_model(source, [(0, 1), (1, 2), (2, 3)], tmp_path / "shards")
    for index in range(3):
        assert validate_gguf(manifest.shard_path(index)).is_shard


@pytest.mark.parametrize(("arch", "used"), [("llama", 12), ("granitemoe", 12), ("qwen3moe", 32)])
def test_more_experts_per_token_than_llama_cpp_graph_pool_holds_are_refused(
    tmp_path: Path, arch: str, used: int
) -> None:
    """12 layers routing every token to all of their experts: consistent files that loaded into
    llama.cpp and aborted the process building its first graph (GGML_ASSERT(obj_new): the
    graph's tensor pool, sized by the model's tensor count, overflows). 8 experts per token,
    the most a released model of these families uses, still validates."""
    shape = {"n_layers": 12, "n_embd": 32, "n_head": 2, "n_head_kv": 1, "n_ff": 32, "n_ff_exp": 8}
    source = tmp_path / f"{arch}.gguf"
    write_tiny_model(source, arch=arch, n_expert=used, n_expert_used=used, **shape)  # type: ignore[arg-type]
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(source)
    assert (raised.value.rule, raised.value.field) == (
        "hparam-expert-count",
        f"{arch}.expert_used_count",
    )
    eight = tmp_path / "eight.gguf"
    write_tiny_model(eight, arch=arch, n_expert=used, n_expert_used=8, **shape)  # type: ignore[arg-type]
    assert validate_gguf(eight).architecture == arch


def test_an_empty_vocabulary_is_refused(llama: Path, tmp_path: Path) -> None:
    """A vocabulary-less model with vocab_size 0 and zero-row embedding and lm-head loaded,
    reported a vocabulary of 0, refused every token as a head and returned empty logits as a
    tail."""
    empty = rewrite(
        llama,
        tmp_path / "empty.gguf",
        metadata={
            "tokenizer.ggml.model": _string("none"),
            "llama.vocab_size": u32(0),
            "tokenizer.ggml.tokens": None,
            "tokenizer.ggml.scores": None,
            "tokenizer.ggml.token_type": None,
        },
        tensors={
            "token_embd.weight": TensorEdit("token_embd.weight", (64, 0), F32),
            "output.weight": TensorEdit("output.weight", (64, 0), F32),
        },
    )
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(empty)
    assert (raised.value.rule, raised.value.field) == ("vocabulary-size", "llama.vocab_size")


def test_a_sentencepiece_vocabulary_without_byte_tokens_is_refused(
    llama: Path, tmp_path: Path
) -> None:
    """SentencePiece tokenizes a character it has no token for as its UTF-8 bytes, each
    looked up as "<0xHH>" (or the byte itself) with .at(): a vocabulary whose byte tokens were
    renamed loaded, and tokenizing any such character through load_tokenizer aborted the
    process."""
    header = read_gguf_header(llama)
    tokens = header.metadata["tokenizer.ggml.tokens"].value
    types = header.metadata["tokenizer.ggml.token_type"].value
    assert isinstance(tokens, list)
    assert isinstance(types, list)
    renamed = rewrite(
        llama,
        tmp_path / "renamed.gguf",
        metadata={
            "tokenizer.ggml.tokens": array(
                [f"b{token}" if str(token).startswith("<0x") else token for token in tokens],
                _STRING,
            ),
            "tokenizer.ggml.token_type": array(
                [1 if kind == 6 else kind for kind in types], gguf.GGUFValueType.INT32
            ),
        },
    )
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(renamed)
    assert (raised.value.rule, raised.value.field) == (
        "vocabulary-byte-tokens",
        "tokenizer.ggml.tokens",
    )


@pytest.mark.parametrize(
    ("arch", "tensor", "value"),
    [
        ("llama", "rope_freqs.weight", 0.0),
        ("llama", "rope_factors_short.weight", 1e-45),
        ("phi3", "rope_factors_short.weight", 0.0),
    ],
)
def test_rope_factors_rope_divides_by_must_be_positive(
    tmp_path: Path, arch: str, tensor: str, value: float
) -> None:
    """ggml's rope divides each rotation angle by its factor: a factor of 0 or 1e-45 loaded and
    made every logit NaN."""
    source = tmp_path / f"{arch}.gguf"
    write_tiny_model(source, arch=arch, n_layers=2)
    scaling = {
        f"{arch}.rope.scaling.type": _string("longrope"),
        f"{arch}.rope.scaling.factor": f32(4.0),
    }
    broken = rewrite(
        source,
        tmp_path / "broken.gguf",
        metadata=scaling if "factors" in tensor else {},
        tensors={tensor: _vector(tensor, 8, value)},
    )
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(broken)
    assert (raised.value.rule, raised.value.field) == ("tensor-values", tensor), str(raised.value)


def test_phi3_has_no_rope_freqs_tensor(tmp_path: Path) -> None:
    """phi3's loader asks for the long and short rope factors only: a phi3 file with
    rope_freqs.weight validated, and llama.cpp refused it (an extra tensor)."""
    source = tmp_path / "phi3.gguf"
    write_tiny_model(source, arch="phi3", n_layers=2)
    extra = rewrite(
        source,
        tmp_path / "extra.gguf",
        tensors={"rope_freqs.weight": _vector("rope_freqs.weight", 8, 1.0)},
    )
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(extra)
    assert (raised.value.rule, raised.value.field) == ("tensor-unexpected", "rope_freqs.weight")


def _byte_level_vocabulary(
    llama: Path, tmp_path: Path, tokens: list[str], merges: tuple[str, ...] = ("H e",)
) -> Path:
    return rewrite(
        llama,
        tmp_path / "bpe.gguf",
        metadata={
            "tokenizer.ggml.model": _string("gpt2"),
            "tokenizer.ggml.pre": _string("default"),
            "tokenizer.ggml.tokens": array(tokens, _STRING),
            "tokenizer.ggml.scores": None,
            "tokenizer.ggml.token_type": array([1] * len(tokens), gguf.GGUFValueType.INT32),
            "tokenizer.ggml.merges": array(list(merges), _STRING),
            "tokenizer.ggml.bos_token_id": u32(len(tokens) - 2),
            "tokenizer.ggml.eos_token_id": u32(len(tokens) - 1),
            "tokenizer.ggml.unknown_token_id": None,
        },
    )


def test_a_byte_level_vocabulary_missing_byte_tokens_loads_and_its_tokenizer_refuses_them(
    llama: Path, tmp_path: Path
) -> None:
    """llama.cpp's byte-level BPE drops, without a word, every piece it has no token for: a
    gpt2 vocabulary of 260 other tokens encoded "Hello world" as no tokens at all. Real models
    lack a few (SmolLM2-135M has no token for eight control bytes), so such a file is accepted,
    ``inspect`` names the bytes, and its tokenizer refuses text containing one instead of
    losing it."""
    from shard_engine_api import (
        InvalidRequest,
        LoadConfig,
        Pipeline,
        SessionRef,
        ShardSpec,
        load_engine,
        load_tokenizer,
    )
    from shard_engine_llama._abi import Vocabulary
    from shard_engine_llama._gguf.validation import _BYTE_LEVEL

    others = _byte_level_vocabulary(llama, tmp_path, [f"tok{index}" for index in range(260)])
    info = inspect_gguf(others)
    assert info.shardable
    assert len(info.unspellable) == 243  # every byte UTF-8 text can hold
    tokenizer = load_tokenizer("llama", str(others))
    assert tokenizer is not None
    with pytest.raises(InvalidRequest, match=r"no token for \(0x20, 0x48, 0x64, 0x65"):
        tokenizer.encode("Hello world")

    missing = {0x04, 0x06, 0xF1}  # as many tokens as the file's 260 embedding rows
    alphabet = [_BYTE_LEVEL[byte] for byte in range(256) if byte not in missing]
    partial_path = tmp_path / "partial"
    partial_path.mkdir()
    partial = _byte_level_vocabulary(
        llama, partial_path, [*alphabet, "He", "llo", "wo", "rld", "ab", "<s>", "</s>"]
    )
    assert inspect_gguf(partial).unspellable == bytes(sorted(missing))
    tokenizer = load_tokenizer("llama", str(partial))
    assert tokenizer is not None
    for text in ("Hello world", "héllo\n\t\x05", "\U0001f600 \x00"):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    for text, offset in (("a\x04b", 1), ("\x06", 0), ("ok \U00044444", 3), ("ü\x06\x04", 2)):
        with pytest.raises(InvalidRequest, match="no token for") as raised:
            tokenizer.encode(text)
        assert raised.value.details["offset"] == offset
        assert raised.value.details["unspellable_bytes"] in ("04", "06", "f1", "0406")
    # The model runs: a vocabulary missing byte tokens is no reason for llama.cpp to refuse it.
    engine = load_engine(
        "llama",
        LoadConfig(
            shard=ShardSpec(model=str(partial), n_layers=3, start=0, end=3),
            max_sessions=1,
            max_context=64,
            options={"model_store": str(tmp_path / "store")},
        ),
    )
    try:
        prompt = tokenizer.encode("Hello world")
        result = Pipeline([engine]).generate(prompt, 3, session=SessionRef(session_id="s", epoch=1))
        assert len(result.token_ids) == 3
        assert np.isfinite(result.logits()).all()
    finally:
        engine.close()
    # What the refusal prevents: llama.cpp itself loses the byte.
    vocabulary = Vocabulary(partial)
    try:
        assert vocabulary.detokenize(vocabulary.tokenize("a\x04b", add_special=False)) == "ab"
    finally:
        vocabulary.close()


def test_text_a_byte_level_merge_would_lose_is_refused(llama: Path, tmp_path: Path) -> None:
    """A merge whose result is not a token: llama.cpp falls back to the merged piece's single
    bytes, and the two bytes of the space's stand-in "Ġ" are no tokens, so "a w" encoded as
    "a" "w". Every byte must be spelled by the tokens, or the text is refused."""
    from shard_engine_api import InvalidRequest, load_tokenizer
    from shard_engine_llama._abi import Vocabulary
    from shard_engine_llama._gguf.validation import _BYTE_LEVEL

    alphabet = [_BYTE_LEVEL[byte] for byte in range(256)]
    path = _byte_level_vocabulary(
        llama, tmp_path, [*alphabet, "xx", "yy", "<s>", "</s>"], merges=("\u0120 w",)
    )
    assert inspect_gguf(path).unspellable == b""
    vocabulary = Vocabulary(path)
    try:
        lost = vocabulary.tokenize("a w", add_special=False)
        assert vocabulary.detokenize(lost) == "aw"  # what llama.cpp does with it
    finally:
        vocabulary.close()
    tokenizer = load_tokenizer("llama", str(path))
    assert tokenizer is not None
    with pytest.raises(InvalidRequest, match="spells 2 of the text's 3 bytes") as raised:
        tokenizer.encode("a w")
    assert raised.value.details == {"text_bytes": 3, "spelled_bytes": 2}
    for text in ("aw", "a  x", "w a", "\u00e9 \U0001f600"):
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_byte_level_tokenizers_encode_all_of_a_text_or_refuse_it(
    llama: Path, tmp_path: Path
) -> None:
    """Vocabularies with random holes in the byte alphabet and random merges, some of whose
    results are no tokens, on random texts: every text is either encoded into tokens that
    decode back to exactly the text, or refused, and refused only where llama.cpp's own
    encoding loses part of it."""
    import random

    from shard_engine_api import InvalidRequest, load_tokenizer
    from shard_engine_llama._abi import Vocabulary
    from shard_engine_llama._gguf.validation import _BYTE_LEVEL

    rng = random.Random(11)
    letters = "ab \u00e9\n\x04\u4e2d"
    stand_ins = {ch: "".join(_BYTE_LEVEL[b] for b in ch.encode()) for ch in letters}
    outcomes = {"encoded": 0, "refused": 0}
    for case in range(6):
        holes = set(rng.sample(range(256), rng.choice((0, 1, 3))))
        alphabet = [_BYTE_LEVEL[byte] for byte in range(256) if byte not in holes]
        pairs = [(x, y) for x in stand_ins.values() for y in stand_ins.values()]
        merges = rng.sample(pairs, 4)
        # Half the merges make a token, half make a string the vocabulary lacks.
        made = [x + y for x, y in merges[:2] if x + y not in alphabet]
        extra = [f"t{index}" for index in range(260 - len(alphabet) - len(made) - 2)]
        directory = tmp_path / f"case{case}"
        directory.mkdir()
        path = _byte_level_vocabulary(
            llama,
            directory,
            [*alphabet, *made, *extra, "<s>", "</s>"],
            merges=tuple(f"{x} {y}" for x, y in merges),
        )
        tokenizer = load_tokenizer("llama", str(path))
        assert tokenizer is not None
        for _ in range(40):
            text = "".join(rng.choice(letters) for _ in range(rng.randint(1, 12)))
            try:
                tokens = tokenizer.encode(text)
            except InvalidRequest:
                # Refused only where llama.cpp itself loses part of the text.
                raw = Vocabulary(path)
                try:
                    assert raw.detokenize(raw.tokenize(text, add_special=False)) != text
                finally:
                    raw.close()
                outcomes["refused"] += 1
                continue
            assert tokenizer.decode(tokens) == text, (case, text, tokens)
            outcomes["encoded"] += 1
    # Both outcomes occur (seeded: 233 encoded, 7 refused).
    assert outcomes["encoded"] > 100, outcomes
    assert outcomes["refused"] >= 5, outcomes


def _rope_set_file(
    tmp_path: Path, arch: str, scaling: str | None, tensors: tuple[str, ...]
) -> Path:
    """A tiny ``arch`` model with ``<arch>.rope.scaling.type`` = ``scaling`` (None: no key) and
    the rope factor tensors ``tensors`` (ones, n_rot / 2 of them)."""
    source = tmp_path / f"{arch}.gguf"
    if not source.exists():
        write_tiny_model(source, arch=arch, n_layers=2)
    from shard_engine_llama._gguf.hyperparameters import hyperparameters

    n_rot = hyperparameters(read_gguf_header(source), FAMILIES[arch]).n_rot
    name = f"{arch}-{scaling}-{'-'.join(tensors) or 'none'}.gguf"
    return rewrite(
        source,
        tmp_path / name,
        metadata={f"{arch}.rope.scaling.type": None if scaling is None else _string(scaling)},
        tensors={tensor: _vector(tensor, n_rot // 2, 1.0) for tensor in tensors},
    )


_LONGROPE_SET = ("rope_factors_long.weight", "rope_factors_short.weight")
_FREQS_SET = ("rope_freqs.weight",)


@pytest.mark.parametrize("arch", ["llama", "granite", "granitemoe"])
@pytest.mark.parametrize(
    ("scaling", "tensors", "refused"),
    [
        (None, _FREQS_SET, None),
        ("linear", _FREQS_SET, None),
        ("yarn", _FREQS_SET, None),
        ("none", _FREQS_SET, None),
        ("longrope", _LONGROPE_SET, None),
        ("longrope", _LONGROPE_SET[:1], None),  # each is optional
        ("longrope", _FREQS_SET, "rope_freqs.weight"),
        ("longrope", (*_LONGROPE_SET, *_FREQS_SET), "rope_freqs.weight"),
        (None, _LONGROPE_SET, "rope_factors_long.weight"),
        ("yarn", _LONGROPE_SET[1:], "rope_factors_short.weight"),
    ],
)
def test_the_rope_factor_tensors_follow_the_scaling_type(
    tmp_path: Path, arch: str, scaling: str | None, tensors: tuple[str, ...], refused: str | None
) -> None:
    """llama.cpp's llama, granite and granitemoe loaders create rope_factors_long/short when
    the scaling type is longrope and rope_freqs otherwise (the default type is linear): a file
    with the other set validated and llama.cpp refused it ("done_getting_tensors: wrong number
    of tensors"). test_engine.py loads the accepted combinations."""
    path = _rope_set_file(tmp_path, arch, scaling, tensors)
    if refused is None:
        assert set(tensors) <= set(validate_gguf(path).tensors)
        return
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(path)
    assert (raised.value.rule, raised.value.field) == ("tensor-unexpected", refused)
    assert "rope.scaling.type" in str(raised.value)


def test_gemma3_final_logit_softcap_of_zero_is_off_and_accepted(tmp_path: Path) -> None:
    """gemma3's graph skips the final soft-capping when it is 0 (gemma2's does not)."""
    source = tmp_path / "gemma3.gguf"
    write_tiny_model(source, arch="gemma3", n_layers=2)
    off = rewrite(
        source, tmp_path / "off.gguf", metadata={"gemma3.final_logit_softcapping": f32(0.0)}
    )
    assert validate_gguf(off).architecture == "gemma3"


def test_whitespace_is_the_only_known_bpe_pre_tokenizer_refused() -> None:
    """The table of refused pre-tokenizers is a subset of the ones llama.cpp knows: every other
    known name is accepted (test_tokenizer.py encodes whitespace runs with each of them)."""
    from shard_engine_llama._gguf.tokenizer_checks import (
        _BPE_PRE_TOKENIZERS,
        _REFUSED_BPE_PRE_TOKENIZERS,
    )

    assert set(_REFUSED_BPE_PRE_TOKENIZERS) == {"whitespace"}
    assert set(_REFUSED_BPE_PRE_TOKENIZERS) <= _BPE_PRE_TOKENIZERS


def test_inspect_refuses_the_whitespace_pre_tokenizer(llama: Path, tmp_path: Path) -> None:
    from shard_engine_llama._gguf.validation import _BYTE_LEVEL

    tokens = [_BYTE_LEVEL[byte] for byte in range(256)] + ["He", "<s>", "</s>", "<unk>"]
    path = _byte_level_vocabulary(llama, tmp_path, tokens)
    assert inspect_gguf(path).shardable  # the same vocabulary with the default pre-tokenizer
    whitespace = rewrite(
        path, tmp_path / "whitespace.gguf", metadata={"tokenizer.ggml.pre": _string("whitespace")}
    )
    with pytest.raises(GGUFValidationError) as raised:
        validate_gguf(whitespace)
    assert (raised.value.rule, raised.value.field) == ("tokenizer-pre", "tokenizer.ggml.pre")
    command = [
        sys.executable,
        "-c",
        "import sys; from shard_engine_api.cli import main; sys.exit(main())",
        "inspect",
        str(whitespace),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 2, result.stderr
    assert "shardable:     no — refused by rule: tokenizer-pre" in result.stdout
    assert "tokenizer.ggml.pre" in result.stdout
    assert "Traceback" not in result.stderr


def _patched(source: Path, destination: Path, needle: bytes, offset: int, value: bytes) -> Path:
    """``source`` with ``value`` written ``offset`` bytes after the end of the first ``needle``."""
    raw = bytearray(source.read_bytes())
    position = raw.index(needle) + len(needle) + offset
    raw[position : position + len(value)] = value
    destination.write_bytes(bytes(raw))
    return destination


def _key(name: str) -> bytes:
    return len(name).to_bytes(8, "little") + name.encode()


def test_an_empty_metadata_key_is_refused(llama: Path, tmp_path: Path) -> None:
    """gguf.cpp refuses a file with an empty key ("key N is empty"); it used to validate."""
    broken = rewrite(llama, tmp_path / "empty-key.gguf", metadata={"": _string("x")})
    with pytest.raises(GGUFValidationError) as raised:
        read_gguf_header(broken)
    assert raised.value.rule == "gguf-empty-key"
    assert "is empty" in str(raised.value)


def test_reader_errors_name_the_key_or_tensor_as_their_field(llama: Path, tmp_path: Path) -> None:
    """Each of these named a key or tensor in its message but carried no field, so an engine's
    InvalidRequest had none in its details."""
    extra = rewrite(
        llama,
        tmp_path / "extra.gguf",
        metadata={
            "x.u": u32(1),
            "x.s": _string("abc"),
            "x.a": array([1, 2], gguf.GGUFValueType.UINT32),
            "x.w": u32(2),
        },
    )
    tensor = "blk.0.attn_q.weight"
    u32_type = int(gguf.GGUFValueType.UINT32).to_bytes(4, "little")
    cases: list[tuple[str, bytes, int, bytes, str]] = [
        # (case, needle, offset after it, bytes written there, field)
        ("unknown value type", _key("x.u"), 0, (13).to_bytes(4, "little"), "x.u"),
        (
            "unknown array element type",
            _key("x.a") + (9).to_bytes(4, "little"),
            0,
            (13).to_bytes(4, "little"),
            "x.a",
        ),
        (
            "nested array",
            _key("x.a") + (9).to_bytes(4, "little"),
            0,
            (9).to_bytes(4, "little"),
            "x.a",
        ),
        (
            "array longer than the file",
            _key("x.a") + (9).to_bytes(4, "little") + u32_type,
            0,
            (2**62).to_bytes(8, "little"),
            "x.a",
        ),
        ("string past the end of the file", _key("x.s"), 4, (2**40).to_bytes(8, "little"), "x.s"),
        ("duplicate key", _key("x.w"), -1, b"u", "x.u"),
        ("five dimensions", _key(tensor), 0, (5).to_bytes(4, "little"), tensor),
        ("unknown ggml type", _key(tensor), 4 + 8 * 2, (31).to_bytes(4, "little"), tensor),
        ("data past the end of the file", _key(tensor), 4, (2**40).to_bytes(8, "little"), tensor),
    ]
    for case, needle, offset, value, field in cases:
        broken = _patched(extra, tmp_path / "broken.gguf", needle, offset, value)
        with pytest.raises(GGUFValidationError) as raised:
            read_gguf_header(broken)
        assert raised.value.rule == "malformed-gguf", case
        assert raised.value.field == field, (case, str(raised.value))
        assert field in str(raised.value), case


def test_a_tensor_name_llama_cpp_cannot_hold_is_refused(llama: Path, tmp_path: Path) -> None:
    """gguf.cpp refuses tensor names of GGML_MAX_NAME (64) bytes or more."""
    name = "blk.0." + "x" * 60 + ".weight"
    broken = rewrite(llama, tmp_path / "long-name.gguf", tensors={name: _vector(name, 64, 1.0)})
    with pytest.raises(GGUFValidationError) as raised:
        read_gguf_header(broken)
    assert raised.value.field == name
    assert "at most 63" in str(raised.value)
