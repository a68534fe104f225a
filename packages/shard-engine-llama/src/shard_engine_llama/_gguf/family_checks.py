"""Family-aware checks: metadata types, sane hyper-parameters, and every tensor a family needs.
The values are read as llama.cpp's loader reads them by ``hyperparameters``; the tokenizer's
checks are ``tokenizer_checks``.

Each check mirrors something llama.cpp does with the file, and says which:

* ``metadata-type``: ``GGUFMeta::GKV::get_kv`` throws when a key has another GGUF type than the
  one it is read as (uint32, float32, bool, string; no conversions).
* ``hparam-*``: values ``load_hparams`` asserts on (``GGML_ASSERT`` aborts the process: block
  count, expert counts, rope scaling type), values the graph asserts on (head sizes equal to the
  rope dimension, ``eps >= 0`` in ggml's norm, rope dimensions even and within the head, grouped
  heads dividing), and values no real model has but that turn every logit into NaN (non-finite or
  non-positive epsilons, frequencies and scales).
* ``tensor-missing`` / ``tensor-shape`` / ``tensor-type`` / ``tensor-unexpected``:
  ``create_tensor`` refuses a missing required tensor or a wrong shape;
  ``done_getting_tensors`` refuses a file with tensors nobody asked for; 1-D tensors (norms,
  biases) must be F32 and matrices a float or block-quantized weight type, which every CPU
  kernel takes.
* ``metadata-unknown-key``: llama.cpp reads more ``<arch>.*`` keys than any one family
  needs (multi-token prediction layer counts it asserts on, SWA head sizes, pooling, ...); a
  key it reads for the family that the checked table does not cover is refused rather than
  handed on unchecked. A key it never reads for the family is ignored, as llama.cpp does.
"""

from __future__ import annotations

import math

import gguf
import numpy as np

from shard_engine_llama._gguf.families import (
    ROPE_FACTOR_TENSORS,
    Family,
    Hyperparameters,
    TensorNeed,
)
from shard_engine_llama._gguf.hyperparameters import (
    fail,
    hyperparameters,
    optional_int,
    swa_pattern,
    uses_sliding_window,
)
from shard_engine_llama._gguf.reader import GGUFHeader, GGUFValidationError
from shard_engine_llama._gguf.tokenizer_checks import (
    TOKENIZER_ARRAYS,
    TOKENIZER_KEYS,
    check_tokenizer,
)

__all__ = ["check_family"]

_U32 = gguf.GGUFValueType.UINT32
_F32 = gguf.GGUFValueType.FLOAT32
_BOOL = gguf.GGUFValueType.BOOL
_STR = gguf.GGUFValueType.STRING
_ARRAY = gguf.GGUFValueType.ARRAY
_I32 = gguf.GGUFValueType.INT32

LLAMA_MAX_EXPERTS = 1024
# Mixtral routes to 2 experts, Qwen MoE models to 4 to 8, Granite MoE to 8.
MAX_EXPERTS_USED = 8
_ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")

# Keys under "<arch>." and the GGUF type llama.cpp reads them as; ``True`` where a per-layer
# array is accepted as well (get_key_or_arr).
_ARCH_KEYS: dict[str, tuple[gguf.GGUFValueType, bool]] = {
    "context_length": (_U32, False),
    "embedding_length": (_U32, False),
    "block_count": (_U32, False),
    "feed_forward_length": (_U32, True),
    "attention.head_count": (_U32, True),
    "attention.head_count_kv": (_U32, True),
    "attention.key_length": (_U32, False),
    "attention.value_length": (_U32, False),
    "attention.layer_norm_rms_epsilon": (_F32, False),
    "attention.sliding_window": (_U32, False),
    "attention.scale": (_F32, False),
    "attention.causal": (_BOOL, False),
    "rope.dimension_count": (_U32, False),
    "rope.freq_base": (_F32, False),
    "rope.freq_base_swa": (_F32, False),
    "rope.scaling.factor": (_F32, False),
    "rope.scale_linear": (_F32, False),
    "rope.scaling.attn_factor": (_F32, False),
    "rope.scaling.type": (_STR, False),
    "rope.scaling.finetuned": (_BOOL, False),
    "rope.scaling.original_context_length": (_U32, False),
    "expert_count": (_U32, False),
    "expert_used_count": (_U32, True),
    "expert_feed_forward_length": (_U32, True),
    "expert_shared_feed_forward_length": (_U32, False),
    "expert_weights_scale": (_F32, False),
    "expert_weights_norm": (_BOOL, False),
    "expert_group_count": (_U32, False),
    "expert_group_used_count": (_U32, False),
    "leading_dense_block_count": (_U32, False),
    "vocab_size": (_U32, False),
    "attn_logit_softcapping": (_F32, False),
    "final_logit_softcapping": (_F32, False),
    "logit_scale": (_F32, False),
    "residual_scale": (_F32, False),
    "embedding_scale": (_F32, False),
}
_POSITIVE_FLOATS = (
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.freq_base_swa",
    "logit_scale",
)
_NON_NEGATIVE_FLOATS = (
    "rope.scaling.factor",
    "rope.scale_linear",
    "rope.scaling.attn_factor",
    "attention.scale",
    "expert_weights_scale",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "residual_scale",
    "embedding_scale",
)
# rope.scaling.attn_factor scales queries and keys alike; real models use about 1 (YaRN's
# 0.1 ln(factor) + 1 stays below 3 for any factor a context could need).
_MAX_ROPE_ATTN_FACTOR = 100.0
# llama.cpp passes the YaRN original context to ggml_rope_ext as an int.
_MAX_INT32 = 2**31 - 1
# Floats a graph divides by ("" for every family): llama.cpp's loader takes 0 or a denormal, and
# the quotient (every logit, or every attention score) overflows to inf or NaN. Real values are
# 8 to 50. gemma2's graph scales the logits by 1 / final_logit_softcapping unconditionally
# (models/gemma2.cpp), gemma3's only when it is not 0 (models/gemma3.cpp: "if
# (hparams.f_final_logit_softcapping)").
_DIVISORS: dict[str, tuple[str, ...]] = {
    "": ("logit_scale",),
    "gemma2": ("attn_logit_softcapping", "final_logit_softcapping"),
}
_MIN_DIVISOR = 1e-6
# Divisors for which llama.cpp reads 0 as "not set" (rope's frequency scale is 1 / factor;
# gemma3 skips the final soft-capping at 0).
_DIVISORS_ZERO_OFF: dict[str, tuple[str, ...]] = {
    "": ("rope.scaling.factor", "rope.scale_linear"),
    "gemma3": ("final_logit_softcapping",),
}
# Multipliers of activations (granite's): real models use 0.0078 to 12; at 3e38 the products
# overflow to inf and every logit became NaN.
_MAX_MULTIPLIER = 1e6
_MULTIPLIERS = ("attention.scale", "embedding_scale", "residual_scale")
# general.* keys llama.cpp reads (GGUFMeta::get_kv throws on another type; gguf.cpp reads the
# alignment, see reader.py).
_GENERAL_KEYS: dict[str, gguf.GGUFValueType] = {
    "general.architecture": _STR,
    "general.name": _STR,
    "general.file_type": _U32,
    "general.alignment": _U32,
}
# general.tensor_extra.*: a per-tensor precision policy (llama_prec_policy::load) no supported
# family uses; its own consistency rules are llama.cpp's, so files carrying it are refused.
_UNSUPPORTED_GENERAL_PREFIX = "general.tensor_extra."
# Keys under "<arch>." other than _ARCH_KEYS that the validator checks itself.
_CHECKED_ARCH_KEYS = frozenset({"attention.sliding_window_pattern"})
# Keys under "<arch>." that llama.cpp (of llama-cpp-python 0.3.36) reads for a supported family
# but this validator does not check: refused (``metadata-unknown-key``), because llama.cpp
# asserts on some (``nextn_predict_layers`` beyond the block count) and refuses the tensors or
# the graph on others. The list is every ``LLM_KV_*`` that ``llama_model::load_hparams`` in
# src/llama-model.cpp reads for every architecture, plus those src/models/<family>.cpp reads,
# minus _ARCH_KEYS and _CHECKED_ARCH_KEYS. Any other ``<arch>.*`` key is never read by
# llama.cpp for the family (``llama.tensor_data_layout`` of older llama conversions, keys of
# other architectures, a converter's own notes), so it is accepted and ignored, as llama.cpp
# ignores it. Re-derive the list when the llama.cpp pin moves.
_READ_UNCHECKED_ARCH_KEYS: dict[str, frozenset[str]] = {
    "": frozenset(
        {
            "attention.key_length_swa",
            "attention.value_length_swa",
            "classifier.output_labels",
            "classifier.pooling_type",
            "convnext.block_count",
            "convnext.embedding_length",
            "embedding_length_out",
            "features_length",
            "nextn_predict_layers",
            "pooling_type",
            "posnet.block_count",
            "posnet.embedding_length",
            "rope.dimension_count_swa",
            "rope.scaling.alpha",
        }
    ),
    "granite": frozenset({"deepstack_mapping"}),
}  # Types no weight matrix may have: integer and F64 tensors, and Q8_1 / Q8_K, which ggml uses
# only for quantized activations (no dequantize or get_rows kernel: a weight of either type
# crashes the first forward, SIGSEGV, or is refused).
_NON_MATRIX_TYPES = frozenset(
    {
        gguf.GGMLQuantizationType.Q8_1,
        gguf.GGMLQuantizationType.Q8_K,
        gguf.GGMLQuantizationType.F64,
        gguf.GGMLQuantizationType.I8,
        gguf.GGMLQuantizationType.I16,
        gguf.GGMLQuantizationType.I32,
        gguf.GGMLQuantizationType.I64,
    }
)


def _wrong_type(
    header: GGUFHeader, key: str, got: gguf.GGUFValueType, expected: gguf.GGUFValueType
) -> GGUFValidationError:
    return fail(
        header,
        "metadata-type",
        key,
        f"has GGUF type {got.name}, llama.cpp reads it as {expected.name}",
    )


def _check_scalar_types(header: GGUFHeader, expected_types: dict[str, gguf.GGUFValueType]) -> None:
    """Each of these keys, where present, has the one GGUF type llama.cpp reads it as."""
    for key, expected in expected_types.items():
        entry = header.metadata.get(key)
        if entry is not None and entry.value_type != expected:
            raise _wrong_type(header, key, entry.value_type, expected)


def _check_key_types(header: GGUFHeader, arch: str) -> None:
    prefix = f"{arch}."
    read_unchecked = _READ_UNCHECKED_ARCH_KEYS[""] | _READ_UNCHECKED_ARCH_KEYS.get(
        arch, frozenset()
    )
    for key in header.metadata:
        if key.startswith(prefix):
            suffix = key[len(prefix) :]
            if suffix in read_unchecked:
                # llama.cpp reads it for this family (multi-token prediction layers, SWA head
                # sizes, pooling, ...) and may assert on its value: refused, not handed on.
                raise fail(
                    header,
                    "metadata-unknown-key",
                    key,
                    f"is a key llama.cpp reads for {arch} that this package does not check "
                    "(llama.cpp may refuse or abort on its value)",
                )
        elif key.startswith(_UNSUPPORTED_GENERAL_PREFIX):
            raise fail(
                header,
                "metadata-unsupported",
                key,
                "per-tensor precision policies are not supported",
            )
    _check_scalar_types(header, _GENERAL_KEYS)
    for key, element_types in TOKENIZER_ARRAYS.items():
        entry = header.metadata.get(key)
        if entry is not None and (
            entry.value_type != _ARRAY or entry.element_type not in element_types
        ):
            got = entry.value_type.name + (
                f" of {entry.element_type.name}" if entry.element_type is not None else ""
            )
            raise fail(
                header,
                "metadata-type",
                key,
                f"is {got}; llama.cpp reads an array of "
                + " or ".join(element.name for element in element_types),
            )
    for suffix, (expected, array_ok) in _ARCH_KEYS.items():
        key = f"{arch}.{suffix}"
        entry = header.metadata.get(key)
        if entry is None:
            continue
        if entry.value_type == _ARRAY and array_ok:
            if entry.element_type != expected:
                raise fail(header, "metadata-type", key, "per-layer array of the wrong type")
            continue
        if entry.value_type != expected:
            raise _wrong_type(header, key, entry.value_type, expected)
    _check_scalar_types(header, TOKENIZER_KEYS)


def _float(header: GGUFHeader, key: str) -> float | None:
    entry = header.metadata.get(key)
    if entry is None:
        return None
    if isinstance(entry.value, bool) or not isinstance(entry.value, int | float):
        raise fail(header, "metadata-type", key, "is not a number")
    return float(entry.value)


def _check_hyperparameters(header: GGUFHeader, family: Family, h: Hyperparameters) -> None:
    """Every hyper-parameter check, in the order a file's first problem is reported."""
    arch = family.name
    key = f"{arch}."
    _check_positive_numbers(header, key)
    _check_rope_and_attention(header, key)
    _check_overflowing_numbers(header, arch)
    _check_shapes(header, family, h)
    _check_experts(header, family, h)
    _check_sliding_window(header, family, h)


def _check_positive_numbers(header: GGUFHeader, key: str) -> None:
    """``hparam-*`` of the sizes and floats that must be positive or non-negative (and finite),
    and the norm epsilon llama.cpp requires; ``key`` is the ``<arch>.`` prefix."""
    for name in ("context_length", "embedding_length"):
        if header.get_int(key + name) <= 0:
            raise fail(header, f"hparam-{name.replace('_', '-')}", key + name, "must be positive")
    epsilon = _float(header, key + "attention.layer_norm_rms_epsilon")
    if epsilon is None:
        raise fail(
            header,
            "metadata-missing",
            key + "attention.layer_norm_rms_epsilon",
            "required key is missing (llama.cpp refuses the file)",
        )
    for name in _POSITIVE_FLOATS:
        number = _float(header, key + name)
        if number is not None and not (math.isfinite(number) and number > 0):
            raise fail(
                header,
                "hparam-positive-finite",
                key + name,
                f"{number!r} must be finite and positive"
                + (
                    " (a negative epsilon aborts ggml: GGML_ASSERT(eps >= 0.0f))"
                    if name.endswith("epsilon")
                    else ""
                ),
            )
    for name in _NON_NEGATIVE_FLOATS:
        number = _float(header, key + name)
        if number is not None and not (math.isfinite(number) and number >= 0):
            raise fail(
                header, "hparam-non-negative-finite", key + name, f"{number!r} must be finite, >= 0"
            )


def _check_rope_and_attention(header: GGUFHeader, key: str) -> None:
    """Rope's frequency base and attention factor within what keeps angles and scores finite,
    and causal attention (what cached sessions need)."""
    for name in ("rope.freq_base", "rope.freq_base_swa"):
        base = _float(header, key + name)
        if base is not None and base < 1:
            # Rotation angles grow as pos * base ** -(i / n): below 1 they grow with the
            # dimension instead of shrinking, and at 1e-45 they overflow to inf (sin(inf) is NaN).
            raise fail(
                header,
                "hparam-rope-freq-base",
                key + name,
                f"{base!r} is below 1 (real models use 1e4 and more; tiny ones overflow rope's "
                "angles and every logit becomes NaN)",
            )
    attn_factor = _float(header, key + "rope.scaling.attn_factor")
    if attn_factor is not None and attn_factor > _MAX_ROPE_ATTN_FACTOR:
        raise fail(
            header,
            "hparam-rope-attn-factor",
            key + "rope.scaling.attn_factor",
            f"{attn_factor!r} exceeds {_MAX_ROPE_ATTN_FACTOR:g}: rope multiplies both queries "
            "and keys by it, so attention scores grow with its square and overflow to NaN "
            "(real models use about 1)",
        )
    causal = header.metadata.get(key + "attention.causal")
    if causal is not None and causal.value is False:
        # Non-causal attention lets every position see the later ones of its batch: a cached
        # prefix then differs from the same positions prefilled with what follows, so
        # prefill + decode no longer equals one prefill (0.36 apart on a tiny llama).
        raise fail(
            header,
            "hparam-causal",
            key + "attention.causal",
            "non-causal attention: sessions cache positions and extend them one token at a "
            "time, which only causal attention computes the same way as one prefill",
        )


def _check_overflowing_numbers(header: GGUFHeader, arch: str) -> None:
    """Multipliers, divisors and YaRN's original context within what keeps every logit
    finite."""
    key = f"{arch}."
    for name in _MULTIPLIERS:
        number = _float(header, key + name)
        if number is not None and number > _MAX_MULTIPLIER:
            raise fail(
                header,
                "hparam-multiplier",
                key + name,
                f"{number!r} exceeds {_MAX_MULTIPLIER:g}: the graph multiplies activations by it "
                "and the products overflow (every logit becomes NaN)",
            )
    zero_off = _DIVISORS_ZERO_OFF[""] + _DIVISORS_ZERO_OFF.get(arch, ())
    for name in _DIVISORS[""] + _DIVISORS.get(arch, ()) + zero_off:
        number = _float(header, key + name)
        if name in zero_off and number == 0:
            continue
        if number is not None and number < _MIN_DIVISOR:
            raise fail(
                header,
                "hparam-divisor",
                key + name,
                f"{number!r} is below {_MIN_DIVISOR:g}: {arch}'s graph divides by it, and the "
                "quotient overflows (every logit becomes inf or NaN)",
            )
    if _scaling_is_yarn(header, arch):
        original = optional_int(
            header,
            key + "rope.scaling.original_context_length",
            header.get_int(key + "context_length"),
        )
        if original > _MAX_INT32:
            raise fail(
                header,
                "hparam-rope-original-context",
                key + "rope.scaling.original_context_length"
                if key + "rope.scaling.original_context_length" in header.metadata
                else key + "context_length",
                f"{original} does not fit llama.cpp's 32-bit signed n_ctx_orig: YaRN takes the "
                "logarithm of a negative length and every logit becomes NaN",
            )


def _check_shapes(header: GGUFHeader, family: Family, h: Hyperparameters) -> None:
    """The family's required keys, the rope scaling type, the heads (``_check_heads``), and the
    rope dimensions and feed-forward width that the loader and the graph assert on."""
    arch = family.name
    key = f"{arch}."
    for name in family.extra_required_keys:
        if key + name not in header.metadata:
            raise fail(header, "metadata-missing", key + name, "required key is missing")
    scaling = header.metadata.get(key + "rope.scaling.type")
    if scaling is not None and scaling.value not in _ROPE_SCALING_TYPES:
        raise fail(
            header,
            "hparam-rope-scaling-type",
            key + "rope.scaling.type",
            f"{scaling.value!r} is not one of {list(_ROPE_SCALING_TYPES)} (GGML_ASSERT)",
        )
    _check_heads(header, family, h)
    if not 0 < h.n_rot <= h.n_embd_head_k or h.n_rot % 2:
        raise fail(
            header,
            "hparam-rope-dimension",
            key + "rope.dimension_count",
            f"{h.n_rot} must be even and within the head size {h.n_embd_head_k} "
            "(ggml's rope asserts both)",
        )
    if (family.rope_is_head or arch == "llama") and h.n_rot != h.n_embd_head_k:
        raise fail(
            header,
            "hparam-rope-dimension",
            key + "rope.dimension_count",
            f"{h.n_rot} must equal the head size {h.n_embd_head_k} for {arch} "
            "(GGML_ASSERT(n_embd_head == n_rot) in its graph)",
        )
    if h.n_ff <= 0 and not (family.moe and h.n_ff_exp > 0):
        raise fail(
            header, "hparam-feed-forward-length", key + "feed_forward_length", "must be positive"
        )


def _check_heads(header: GGUFHeader, family: Family, h: Hyperparameters) -> None:
    """Head counts that divide, positive and equal key and value head sizes, and heads that
    span the embedding where the family's projections need it."""
    arch = family.name
    key = f"{arch}."
    if h.n_head <= 0:
        raise fail(header, "hparam-head-count", key + "attention.head_count", "must be positive")
    if h.n_head_kv <= 0 or h.n_head % h.n_head_kv:
        raise fail(
            header,
            "hparam-head-count-kv",
            key + "attention.head_count_kv",
            f"{h.n_head_kv} must be positive and divide head_count {h.n_head}",
        )
    if h.n_embd_head_k <= 0 or h.n_embd_head_v <= 0:
        raise fail(
            header, "hparam-head-size", key + "attention.key_length", "head sizes must be positive"
        )
    if family.heads_span_embedding and h.n_head * h.n_embd_head_k != h.n_embd:
        raise fail(
            header,
            "hparam-head-count",
            key + "attention.head_count",
            f"{h.n_head} heads of {h.n_embd_head_k} do not span embedding_length {h.n_embd}, "
            f"the width {arch}'s attention projections have (the graph asserts it)",
        )
    if h.n_embd_head_v != h.n_embd_head_k:
        raise fail(
            header,
            "hparam-head-size",
            key + "attention.value_length",
            f"value head size {h.n_embd_head_v} differs from key head size {h.n_embd_head_k} "
            "(the graph asserts they are equal)",
        )


def _check_sliding_window(header: GGUFHeader, family: Family, h: Hyperparameters) -> None:
    """A sliding window that is positive where the family always has one, no longer than the
    context, and a pattern llama.cpp can build its cache from."""
    key = f"{family.name}."
    window = optional_int(header, key + "attention.sliding_window", 0)
    context = header.get_int(key + "context_length")
    if family.swa_always and window <= 0 and key + "attention.sliding_window" in header.metadata:
        raise fail(
            header, "hparam-sliding-window", key + "attention.sliding_window", "must be positive"
        )
    if window > context:
        # llama-kv-cache.cpp reserves memory in proportion to the window on every ubatch.
        raise fail(
            header,
            "hparam-sliding-window",
            key + "attention.sliding_window",
            f"{window} is longer than context_length {context}",
        )
    _check_swa_pattern(header, family, h)


def _scaling_is_yarn(header: GGUFHeader, arch: str) -> bool:
    """Whether llama.cpp runs this model's rope with YaRN (the scaling type names it)."""
    entry = header.metadata.get(f"{arch}.rope.scaling.type")
    return entry is not None and entry.value == "yarn"


def _check_swa_pattern(header: GGUFHeader, family: Family, h: Hyperparameters) -> None:
    key = f"{family.name}.attention.sliding_window_pattern"
    pattern = header.metadata.get(key)
    if pattern is not None:
        if pattern.value_type == _ARRAY:
            # get_arr into the per-layer bool array: BOOL, UINT32 or INT32 elements.
            if pattern.element_type not in (_BOOL, _U32, _I32):
                raise fail(header, "metadata-type", key, "per-layer array of the wrong type")
            assert isinstance(pattern.value, list)
            if len(pattern.value) != h.n_layer:
                raise fail(
                    header,
                    "hparam-per-layer-length",
                    key,
                    f"has {len(pattern.value)} entries for {h.n_layer} layers",
                )
        elif pattern.value_type != _U32:
            raise fail(
                header,
                "metadata-type",
                key,
                f"has GGUF type {pattern.value_type.name}, llama.cpp reads a per-layer array or "
                "a UINT32 period",
            )
    if (
        family.swa_period
        and uses_sliding_window(header)
        and not any(swa_pattern(header, h.n_layer, family.swa_period))
    ):
        # The sliding-window half of llama.cpp's iSWA cache would hold no layer: it asserts.
        raise fail(
            header,
            "hparam-sliding-window-pattern",
            key,
            "names no sliding-window layer, but the model has a sliding window (llama.cpp "
            "aborts building its cache)",
        )


def _check_experts(header: GGUFHeader, family: Family, h: Hyperparameters) -> None:
    key = f"{family.name}."
    if h.n_expert > LLAMA_MAX_EXPERTS:
        raise fail(
            header, "hparam-expert-count", key + "expert_count", f"exceeds {LLAMA_MAX_EXPERTS}"
        )
    if h.n_expert_used > h.n_expert:
        raise fail(
            header,
            "hparam-expert-count",
            key + "expert_used_count",
            f"{h.n_expert_used} exceeds expert_count {h.n_expert} (GGML_ASSERT in load_hparams)",
        )
    if h.n_expert_used > MAX_EXPERTS_USED:
        # llama.cpp sizes the pool that holds a forward graph's tensors at max(1024,
        # 8 * n_tensors) and build_moe_ffn adds two tensors per routed expert per layer: 12 of
        # 12 experts aborted at 12 and 24 layers (GGML_ASSERT(obj_new) in ggml.c), 10 at 200
        # granitemoe layers, and 9 loaded at every layer count measured.
        raise fail(
            header,
            "hparam-expert-count",
            key + "expert_used_count",
            f"{h.n_expert_used} experts per token exceeds {MAX_EXPERTS_USED}, the most a "
            "supported MoE family routes to (llama.cpp's graph pool overflows and aborts the "
            "process from about 10)",
        )
    if h.n_expert > 0 and h.n_expert_used <= 0:
        raise fail(
            header,
            "hparam-expert-count",
            key + "expert_used_count",
            "must be positive when expert_count is (GGML_ASSERT in load_hparams)",
        )
    if family.moe and h.n_expert <= 0:
        raise fail(
            header, "hparam-expert-count", key + "expert_count", f"{family.name} needs experts"
        )
    groups = optional_int(header, key + "expert_group_count", 0)
    if groups:
        raise fail(
            header, "hparam-expert-groups", key + "expert_group_count", "expert groups unsupported"
        )
    if h.n_expert > 0 and family.moe and h.n_ff_exp <= 0 and h.n_ff // h.n_expert_used <= 0:
        raise fail(
            header,
            "hparam-feed-forward-length",
            key + "expert_feed_forward_length",
            "the expert feed-forward length must be positive",
        )


def _check_tensor(header: GGUFHeader, need: TensorNeed) -> None:
    record = header.tensors.get(need.name)
    if record is None:
        if need.required:
            raise fail(header, "tensor-missing", need.name, "required tensor is missing")
        return
    if record.shape != need.shape:
        raise fail(
            header,
            "tensor-shape",
            need.name,
            f"has shape {list(record.shape)}, the hyper-parameters imply {list(need.shape)}",
        )
    if len(need.shape) == 1:
        if record.ggml_type != gguf.GGMLQuantizationType.F32:
            raise fail(
                header, "tensor-type", need.name, f"1-D tensor of type {record.ggml_type.name}"
            )
    elif record.ggml_type in _NON_MATRIX_TYPES:
        raise fail(header, "tensor-type", need.name, f"type {record.ggml_type.name}")


def _check_tensors(header: GGUFHeader, family: Family, h: Hyperparameters) -> None:
    def present(name: str) -> bool:
        return name in header.tensors

    needs: list[TensorNeed] = list(family.model_tensors(h, present))
    for il in range(h.n_layer):
        needs += family.layer_tensors(h, il, present)
    expected = {need.name for need in needs}
    for need in needs:
        _check_tensor(header, need)
    unexpected = sorted(name for name in header.tensors if name not in expected)
    if unexpected:
        rope_note = ""
        if unexpected[0] in ROPE_FACTOR_TENSORS:
            asked = sorted(set(ROPE_FACTOR_TENSORS) & expected)
            rope_note = (
                f"; with rope.scaling.type {h.rope_scaling_type!r} its loader asks for "
                f"{asked or 'no rope factors'} only"
            )
        raise fail(
            header,
            "tensor-unexpected",
            unexpected[0],
            f"{len(unexpected)} tensor(s) {family.name} does not use (llama.cpp refuses the file "
            f"with 'wrong number of tensors'): {unexpected[:4]}{rope_note}",
        )


def _identity_blocks(header: GGUFHeader, n_layer: int) -> set[int]:
    """The blocks a shard's writer filled with zeros and ones (see writer.py), by its keys."""
    blocks: set[int] = set()
    leading = header.metadata.get("shard.leading_identity_blocks")
    if leading is not None and isinstance(leading.value, int) and leading.value > 0:
        blocks.update(range(min(leading.value, n_layer)))
    trailing = header.metadata.get("shard.has_identity_block")
    if trailing is not None and trailing.value is True:
        blocks.add(n_layer - 1)
    return blocks


def _check_vectors(header: GGUFHeader, family: Family, h: Hyperparameters) -> None:
    """The 1-D tensors (norms, biases, gates; F32, a few KiB per block) hold finite values, and
    none makes a gate llama.cpp divides by exactly zero for every input.

    A NaN or infinite norm weight turns every logit into NaN. qwen2moe computes its shared
    expert's sigmoid gate as silu(x) / x (models/qwen2moe.cpp), 0 / 0 when the gate logit is
    exactly 0: a zero gate vector (or a zero ffn_norm in front of it) makes every row NaN.
    """
    vectors = [record for record in header.tensors.values() if len(record.shape) == 1]
    values: dict[str, np.ndarray] = {}
    try:
        with open(header.path, "rb") as handle:
            for record in vectors:
                handle.seek(record.offset)
                raw = handle.read(record.n_bytes)
                values[record.name] = np.frombuffer(raw, dtype="<f4")
    except OSError as error:
        raise fail(
            header, "file-unreadable", vectors[0].name if vectors else "", str(error)
        ) from error
    for record in vectors:
        data = values[record.name]
        if data.size * 4 != record.n_bytes or not np.isfinite(data).all():
            raise fail(
                header,
                "tensor-values",
                record.name,
                "holds NaN or infinite values (every logit would be NaN)",
            )
    for name in ROPE_FACTOR_TENSORS:
        factors = values.get(name)
        if factors is not None and not bool(np.all(factors >= _MIN_DIVISOR)):
            # ggml's rope divides each rotation angle by its factor: 0 or a denormal is inf.
            raise fail(
                header,
                "tensor-values",
                name,
                f"holds a factor below {_MIN_DIVISOR:g}; rope divides the angles by it "
                "(every logit would be NaN)",
            )
    if family.name != "qwen2moe":
        return
    skipped = _identity_blocks(header, h.n_layer)
    for il in range(h.n_layer):
        gate = values.get(f"blk.{il}.ffn_gate_inp_shexp.weight")
        norm = values.get(f"blk.{il}.ffn_norm.weight")
        if il in skipped or gate is None or norm is None or gate.shape != norm.shape:
            continue
        # Products this small underflow to a logit of exactly 0 as well (a gate of 1e-45s).
        if float(np.max(np.abs(gate * norm))) < _MIN_DIVISOR:
            raise fail(
                header,
                "tensor-values",
                f"blk.{il}.ffn_gate_inp_shexp.weight",
                "with ffn_norm.weight gives a shared-expert gate logit of 0 for every input; "
                "llama.cpp computes the gate as silu(x) / x, so every row becomes NaN",
            )


def check_family(header: GGUFHeader, family: Family) -> Hyperparameters:
    """Run every family-aware check on ``header``; return the derived hyper-parameters."""
    _check_key_types(header, family.name)
    h = hyperparameters(header, family)
    _check_hyperparameters(header, family, h)
    check_tokenizer(header, h)
    _check_tensors(header, family, h)
    _check_vectors(header, family, h)
    return h
