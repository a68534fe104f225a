"""What each supported GGUF family needs, written once, so a reader can check it against llama.cpp.

Every function ``_<family>_layer`` lists, for block ``il``, the tensors llama.cpp's
``load_arch_tensors`` creates in ``src/models/<family>.cpp`` (of the llama.cpp release pinned by
llama-cpp-python 0.3.36), with the shapes in ggml order (``ne[0]`` first) exactly as the
``create_tensor`` calls write them. :data:`FAMILIES` adds, per family, the rules that make a shard
exact (:class:`ShardRule`, applied by the writer and printed by ``inspect``) or the reason it is
refused.

Hyper-parameters are derived as ``llama_model_base::load_hparams`` (``src/llama-model.cpp``)
derives them: ``n_head_kv`` defaults to ``n_head``, the head sizes to ``n_embd / n_head``, ``n_rot``
to the key head size; these families read layer 0's value of per-layer arrays for every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "FAMILIES",
    "Family",
    "Hyperparameters",
    "ShardRule",
    "TensorNeed",
]


@dataclass(frozen=True)
class TensorNeed:
    """One tensor llama.cpp asks for: its name, ggml shape, and whether it may be absent."""

    name: str
    shape: tuple[int, ...]
    required: bool = True


@dataclass(frozen=True)
class Hyperparameters:
    """The values llama.cpp derives from the metadata (layer 0 of per-layer arrays)."""

    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_rot: int
    n_ff: int
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    n_layer_dense_lead: int = 0
    # <arch>.rope.scaling.type; load_hparams defaults it to "linear" when the key is absent.
    rope_scaling_type: str = "linear"

    @property
    def n_embd_k_gqa(self) -> int:
        return self.n_embd_head_k * self.n_head_kv

    @property
    def n_embd_v_gqa(self) -> int:
        return self.n_embd_head_v * self.n_head_kv

    @property
    def n_embd_q(self) -> int:
        return self.n_embd_head_k * self.n_head


@dataclass(frozen=True)
class ShardRule:
    """A per-shard rewrite that keeps a shard computing what its layers compute in the model.

    ``name`` is stable (printed by ``inspect``, used in refusals); ``source`` says where in
    llama.cpp the behaviour it compensates for lives.
    """

    name: str
    summary: str
    source: str


# -- rules shared by several families ------------------------------------------------------------

SLICE_LAYERS = ShardRule(
    "slice-layers",
    "keep blocks [start, end) renumbered from 0, slice per-layer metadata arrays, set block_count",
    "llama-model.cpp load_hparams (get_key_or_arr over n_layer)",
)
IDENTITY_BLOCK = ShardRule(
    "identity-block",
    "non-tail shards append one zero-weight, unit-norm block and capture l_out-<last real>, "
    "because the graph keeps only output rows inside its last layer",
    "models/*.cpp: `if (il == n_layer - 1 && inp_out_ids)` get_rows",
)
MIDDLE_NO_VOCABULARY = ShardRule(
    "middle-no-vocabulary",
    "no shard carries the tokenizer (tokenizer 'none' with <arch>.vocab_size nameless tokens); "
    "middle shards have one token and a 1 x n_embd zero token embedding",
    "llama-vocab.cpp load (tokenizer_model == 'none'); loaders require token_embd",
)
TAIL_LM_HEAD_AS_EMBEDDING = ShardRule(
    "tail-lm-head-as-embedding",
    "a tail shard stores the lm-head in token_embd.weight and omits output.weight; the loader "
    "then ties them, so the tail holds one vocabulary-sized matrix (families whose loader "
    "insists on output.weight keep it and get a zero, sparse token embedding)",
    "models/*.cpp: `if (output == NULL) output = create_tensor(tok_embd, TENSOR_DUPLICATED)`",
)
SWA_PATTERN_EXPLICIT = ShardRule(
    "swa-pattern-explicit",
    "write the full model's sliding-window layer pattern as a per-layer BOOL array, sliced; the "
    "identity block is local; an all-global shard gets sliding_window = 0",
    "llama-model.cpp load_swa_pattern / llama-hparams.cpp set_swa_pattern (il % n_pattern)",
)
# gemma3 picks the 27B attention-scale rule from the layer count.
GEMMA3_27B_LAYER_COUNT = 62
GEMMA3_ATTENTION_SCALE = ShardRule(
    "gemma3-layer-count-attention-scale",
    "refuse shards whose block count would switch gemma3's layer-count-based attention scale",
    "models/gemma3.cpp load_arch_hparams (n_layer 62 -> 27B query scale)",
)
TOKEN_ONLY_EMBEDDING_SCALE = ShardRule(
    "token-only-embedding-scale",
    "none needed: the embedding scale applies to token input only, hidden states pass unscaled",
    "models/gemma3.cpp: ggml_scale(inpL, ubatch.token ? sqrtf(n_embd) : 1.0f)",
)
EMBEDDING_SCALE_HEAD_ONLY = ShardRule(
    "embedding-scale-head-only",
    "non-head shards get <arch>.embedding_scale = 0, which disables the scale llama.cpp would "
    "otherwise apply to hidden-state (embd) input as well",
    "llama-graph.cpp build_inp_embd: `if (hparams.f_embedding_scale != 0.0f && ...)`",
)
EXPERTS_WITH_LAYERS = ShardRule(
    "experts-with-layers",
    "expert tensors (ffn_*_exps, router ffn_gate_inp, shared experts) travel with their block; "
    "routing hyper-parameters are copied unchanged; the identity block's experts are zero",
    "llama-graph.cpp build_moe_ffn",
)
NO_ROPE_STEP_PADDING = ShardRule(
    "no-rope-step-padding",
    "a shard starting at a layer that is not a multiple of the no-RoPE step gets leading identity "
    "blocks so every real layer keeps its index modulo the step",
    "models/smollm3.cpp: use_rope = (il + 1) % n_no_rope_layer_step != 0 (step fixed at 4)",
)


@dataclass(frozen=True)
class Family:
    """One architecture: its layout, its hyper-parameter constraints and its shard rules."""

    name: str
    model_tensors: Callable[[Hyperparameters, Callable[[str], bool]], list[TensorNeed]]
    layer_tensors: Callable[[Hyperparameters, int, Callable[[str], bool]], list[TensorNeed]]
    rules: tuple[ShardRule, ...]
    moe: bool = False
    # The graph asserts head_dim_v == head_dim_k == n_rot (GGML_ASSERT: aborts the process).
    rope_is_head: bool = True
    # Per-layer metadata arrays these loaders read as one value (layer 0 for every layer).
    uniform_arrays: bool = True
    swa_period: int = 0  # default sliding-window pattern period (0: no sliding window)
    swa_always: bool = False  # the family is sliding-window even without the key (gemma2)
    no_rope_step: int = 0
    refusal: str | None = None
    # The attention projections are sized n_embd, so n_head * head size must equal it (the graph
    # reshapes Q into heads: GGML_ASSERT(ggml_nelements(a) == ne0*ne1*ne2) otherwise).
    heads_span_embedding: bool = False
    extra_required_keys: tuple[str, ...] = field(default=())


# -- tensor helpers ----------------------------------------------------------------------------


def _blk(il: int, name: str) -> str:
    return f"blk.{il}.{name}"


def _embedding_and_output(
    h: Hyperparameters,
    present: Callable[[str], bool],
    *,
    output_required: bool = False,
    output_bias: bool = False,
    rope_factors: tuple[str, ...] = (),
    tied_only: bool = False,
) -> list[TensorNeed]:
    needs = [
        TensorNeed("token_embd.weight", (h.n_embd, h.n_vocab)),
        TensorNeed("output_norm.weight", (h.n_embd,)),
    ]
    if not tied_only:
        needs.append(TensorNeed("output.weight", (h.n_embd, h.n_vocab), output_required))
    if output_bias:
        needs.append(TensorNeed("output.bias", (h.n_vocab,), False))
    # tn(LLM_TENSOR_ROPE_FACTORS_*, "weight", i) names one model-level tensor, shared by every
    # block (TENSOR_DUPLICATED for i != 0).
    for name in rope_factors:
        needs.append(TensorNeed(name, (h.n_rot // 2,), False))
    return needs


def _qkv(
    h: Hyperparameters,
    il: int,
    present: Callable[[str], bool],
    n_q: int,
    n_k: int,
    n_v: int,
    *,
    required: bool = True,
) -> list[TensorNeed]:
    """``llama_model_base::create_tensor_qkv``: a fused attn_qkv, or separate q/k/v."""
    fused = _blk(il, "attn_qkv.weight")
    if present(fused):
        needs = [
            TensorNeed(fused, (h.n_embd, n_q + n_k + n_v)),
            TensorNeed(_blk(il, "attn_qkv.bias"), (n_q + n_k + n_v,), False),
        ]
        if not present(_blk(il, "attn_qkv.bias")):
            needs += [
                TensorNeed(_blk(il, "attn_q.bias"), (n_q,), False),
                TensorNeed(_blk(il, "attn_k.bias"), (n_k,), False),
                TensorNeed(_blk(il, "attn_v.bias"), (n_v,), False),
            ]
        return needs
    return [
        TensorNeed(_blk(il, "attn_q.weight"), (h.n_embd, n_q), required),
        TensorNeed(_blk(il, "attn_k.weight"), (h.n_embd, n_k), required),
        TensorNeed(_blk(il, "attn_v.weight"), (h.n_embd, n_v), required),
        TensorNeed(_blk(il, "attn_q.bias"), (n_q,), False),
        TensorNeed(_blk(il, "attn_k.bias"), (n_k,), False),
        TensorNeed(_blk(il, "attn_v.bias"), (n_v,), False),
    ]


def _dense_ffn(h: Hyperparameters, il: int, *, biases: bool = False) -> list[TensorNeed]:
    needs = [
        TensorNeed(_blk(il, "ffn_gate.weight"), (h.n_embd, h.n_ff)),
        TensorNeed(_blk(il, "ffn_down.weight"), (h.n_ff, h.n_embd)),
        TensorNeed(_blk(il, "ffn_up.weight"), (h.n_embd, h.n_ff)),
    ]
    if biases:
        needs += [
            TensorNeed(_blk(il, "ffn_gate.bias"), (h.n_ff,), False),
            TensorNeed(_blk(il, "ffn_down.bias"), (h.n_embd,), False),
            TensorNeed(_blk(il, "ffn_up.bias"), (h.n_ff,), False),
        ]
    return needs


def _experts(
    h: Hyperparameters, il: int, n_ff_exp: int, *, gate_required: bool
) -> list[TensorNeed]:
    return [
        TensorNeed(_blk(il, "ffn_gate_inp.weight"), (h.n_embd, h.n_expert)),
        TensorNeed(
            _blk(il, "ffn_gate_exps.weight"), (h.n_embd, n_ff_exp, h.n_expert), gate_required
        ),
        TensorNeed(_blk(il, "ffn_down_exps.weight"), (n_ff_exp, h.n_embd, h.n_expert)),
        TensorNeed(_blk(il, "ffn_up_exps.weight"), (h.n_embd, n_ff_exp, h.n_expert)),
    ]


def _shared_experts(h: Hyperparameters, il: int, n_ff_shexp: int) -> list[TensorNeed]:
    return [
        TensorNeed(_blk(il, "ffn_gate_shexp.weight"), (h.n_embd, n_ff_shexp)),
        TensorNeed(_blk(il, "ffn_up_shexp.weight"), (h.n_embd, n_ff_shexp)),
        TensorNeed(_blk(il, "ffn_down_shexp.weight"), (n_ff_shexp, h.n_embd)),
    ]


# -- families ------------------------------------------------------------------------------------


ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")
LONGROPE_FACTOR_TENSORS = ROPE_FACTOR_TENSORS[:2]


def _llama_model(h: Hyperparameters, present: Callable[[str], bool]) -> list[TensorNeed]:
    # models/llama.cpp, granite.cpp and granite-moe.cpp ask for the long and short factors when
    # the scaling type is longrope and for rope_freqs otherwise, never for both: a file with
    # the other set has a tensor nobody asks for, and llama.cpp refuses it ("wrong number of
    # tensors").
    if h.rope_scaling_type == "longrope":
        return _embedding_and_output(h, present, rope_factors=LONGROPE_FACTOR_TENSORS)
    return _embedding_and_output(h, present, rope_factors=("rope_freqs.weight",))


def _llama_layer(h: Hyperparameters, il: int, present: Callable[[str], bool]) -> list[TensorNeed]:
    """models/llama.cpp (also granite.cpp for granite and granitemoe, which have the same
    tensors): dense or Mixtral-style experts by ``n_expert``, ``n_ff`` wide."""
    needs = [TensorNeed(_blk(il, "attn_norm.weight"), (h.n_embd,))]
    needs += _qkv(h, il, present, h.n_embd_q, h.n_embd_k_gqa, h.n_embd_v_gqa)
    needs += [
        TensorNeed(_blk(il, "attn_output.weight"), (h.n_embd_q, h.n_embd)),
        TensorNeed(_blk(il, "attn_output.bias"), (h.n_embd,), False),
        TensorNeed(_blk(il, "ffn_norm.weight"), (h.n_embd,)),
    ]
    if h.n_expert == 0:
        return needs + _dense_ffn(h, il, biases=True)
    needs += _experts(h, il, h.n_ff, gate_required=False)
    if h.n_ff_shexp > 0:
        needs += _shared_experts(h, il, h.n_ff_shexp)
    return needs


def _qwen2_model(h: Hyperparameters, present: Callable[[str], bool]) -> list[TensorNeed]:
    return _embedding_and_output(h, present, output_bias=True)


def _qwen2_layer(h: Hyperparameters, il: int, present: Callable[[str], bool]) -> list[TensorNeed]:
    """models/qwen2.cpp."""
    needs = [TensorNeed(_blk(il, "attn_norm.weight"), (h.n_embd,))]
    needs += _qkv(h, il, present, h.n_embd, h.n_embd_v_gqa, h.n_embd_v_gqa)
    needs += [
        TensorNeed(_blk(il, "attn_output.weight"), (h.n_embd, h.n_embd)),
        TensorNeed(_blk(il, "ffn_norm.weight"), (h.n_embd,)),
    ]
    return needs + _dense_ffn(h, il)


def _qwen2moe_model(h: Hyperparameters, present: Callable[[str], bool]) -> list[TensorNeed]:
    return _embedding_and_output(h, present, output_required=True)


def _qwen2moe_layer(
    h: Hyperparameters, il: int, present: Callable[[str], bool]
) -> list[TensorNeed]:
    """models/qwen2moe.cpp: routed experts plus a gated shared expert."""
    needs = [TensorNeed(_blk(il, "attn_norm.weight"), (h.n_embd,))]
    needs += _qkv(h, il, present, h.n_embd, h.n_embd_v_gqa, h.n_embd_v_gqa)
    needs += [
        TensorNeed(_blk(il, "attn_output.weight"), (h.n_embd, h.n_embd)),
        TensorNeed(_blk(il, "ffn_norm.weight"), (h.n_embd,)),
    ]
    n_ff_exp = h.n_ff_exp or (h.n_ff // h.n_expert_used if h.n_expert_used else 0)
    needs += _experts(h, il, n_ff_exp, gate_required=True)
    needs.append(TensorNeed(_blk(il, "ffn_gate_inp_shexp.weight"), (h.n_embd,)))
    return needs + _shared_experts(h, il, h.n_ff_shexp or h.n_ff)


def _qwen3_model(h: Hyperparameters, present: Callable[[str], bool]) -> list[TensorNeed]:
    return _embedding_and_output(h, present)


def _qwen3_layer(h: Hyperparameters, il: int, present: Callable[[str], bool]) -> list[TensorNeed]:
    """models/qwen3.cpp."""
    needs = [TensorNeed(_blk(il, "attn_norm.weight"), (h.n_embd,))]
    needs += _qkv(h, il, present, h.n_embd_q, h.n_embd_v_gqa, h.n_embd_v_gqa)
    needs += [
        TensorNeed(_blk(il, "attn_output.weight"), (h.n_embd_q, h.n_embd)),
        TensorNeed(_blk(il, "attn_k_norm.weight"), (h.n_embd_head_k,)),
        TensorNeed(_blk(il, "attn_q_norm.weight"), (h.n_embd_head_k,)),
        TensorNeed(_blk(il, "ffn_norm.weight"), (h.n_embd,)),
    ]
    return needs + _dense_ffn(h, il)


def _qwen3moe_layer(
    h: Hyperparameters, il: int, present: Callable[[str], bool]
) -> list[TensorNeed]:
    """models/qwen3moe.cpp."""
    needs = [TensorNeed(_blk(il, "attn_norm.weight"), (h.n_embd,))]
    needs += _qkv(h, il, present, h.n_embd_q, h.n_embd_v_gqa, h.n_embd_v_gqa)
    needs += [
        TensorNeed(_blk(il, "attn_output.weight"), (h.n_embd_q, h.n_embd)),
        TensorNeed(_blk(il, "attn_k_norm.weight"), (h.n_embd_head_k,)),
        TensorNeed(_blk(il, "attn_q_norm.weight"), (h.n_embd_head_k,)),
        TensorNeed(_blk(il, "ffn_norm.weight"), (h.n_embd,)),
    ]
    n_ff_exp = h.n_ff_exp or (h.n_ff // h.n_expert_used if h.n_expert_used else 0)
    return needs + _experts(h, il, n_ff_exp, gate_required=True)


def _gemma_layer(
    h: Hyperparameters, il: int, present: Callable[[str], bool], *, qk_norm: bool
) -> list[TensorNeed]:
    needs = [TensorNeed(_blk(il, "attn_norm.weight"), (h.n_embd,))]
    needs += _qkv(h, il, present, h.n_embd_q, h.n_embd_k_gqa, h.n_embd_v_gqa)
    needs += [
        TensorNeed(_blk(il, "attn_output.weight"), (h.n_embd_q, h.n_embd)),
        TensorNeed(_blk(il, "post_attention_norm.weight"), (h.n_embd,)),
    ]
    if qk_norm:
        needs += [
            TensorNeed(_blk(il, "attn_k_norm.weight"), (h.n_embd_head_k,)),
            TensorNeed(_blk(il, "attn_q_norm.weight"), (h.n_embd_head_k,)),
        ]
    needs.append(TensorNeed(_blk(il, "ffn_norm.weight"), (h.n_embd,)))
    needs += _dense_ffn(h, il)
    return [*needs, TensorNeed(_blk(il, "post_ffw_norm.weight"), (h.n_embd,))]


def _gemma3_model(h: Hyperparameters, present: Callable[[str], bool]) -> list[TensorNeed]:
    return _embedding_and_output(h, present)


def _gemma3_layer(h: Hyperparameters, il: int, present: Callable[[str], bool]) -> list[TensorNeed]:
    """models/gemma3.cpp."""
    return _gemma_layer(h, il, present, qk_norm=True)


def _gemma2_model(h: Hyperparameters, present: Callable[[str], bool]) -> list[TensorNeed]:
    return _embedding_and_output(h, present, tied_only=True)


def _gemma2_layer(h: Hyperparameters, il: int, present: Callable[[str], bool]) -> list[TensorNeed]:
    """models/gemma2.cpp."""
    return _gemma_layer(h, il, present, qk_norm=False)


def _phi3_model(h: Hyperparameters, present: Callable[[str], bool]) -> list[TensorNeed]:
    # phi3's loader creates the long and short factors only: a file with rope_freqs has a
    # tensor it does not ask for, and llama.cpp refuses it.
    return _embedding_and_output(h, present, rope_factors=LONGROPE_FACTOR_TENSORS)


def _phi3_layer(h: Hyperparameters, il: int, present: Callable[[str], bool]) -> list[TensorNeed]:
    """models/phi3.cpp: fused (or separate) qkv, fused gate+up (``ffn_up`` is 2 * n_ff wide)."""
    needs = [TensorNeed(_blk(il, "attn_norm.weight"), (h.n_embd,))]
    # llama.cpp asks for separate q/k/v as optional (TENSOR_NOT_REQUIRED) and dereferences
    # them unchecked when attn_qkv is absent too: required here.
    needs += _qkv(h, il, present, h.n_embd, h.n_embd_v_gqa, h.n_embd_v_gqa)
    return [
        *needs,
        TensorNeed(_blk(il, "attn_output.weight"), (h.n_embd, h.n_embd)),
        TensorNeed(_blk(il, "ffn_norm.weight"), (h.n_embd,)),
        TensorNeed(_blk(il, "ffn_down.weight"), (h.n_ff, h.n_embd)),
        TensorNeed(_blk(il, "ffn_up.weight"), (h.n_embd, 2 * h.n_ff)),
    ]


def _olmo2_model(h: Hyperparameters, present: Callable[[str], bool]) -> list[TensorNeed]:
    return _embedding_and_output(h, present, output_required=True)


def _olmo2_layer(h: Hyperparameters, il: int, present: Callable[[str], bool]) -> list[TensorNeed]:
    """models/olmo2.cpp: no pre-norms; post-attention/post-ffn norms; q/k norms over all heads."""
    head = h.n_embd // h.n_head if h.n_head else 0
    needs = _qkv(h, il, present, h.n_embd, h.n_embd_v_gqa, h.n_embd_v_gqa)
    return [
        *needs,
        TensorNeed(_blk(il, "attn_output.weight"), (h.n_embd, h.n_embd)),
        TensorNeed(_blk(il, "attn_q_norm.weight"), (h.n_embd,)),
        TensorNeed(_blk(il, "attn_k_norm.weight"), (h.n_head_kv * head,)),
        TensorNeed(_blk(il, "post_attention_norm.weight"), (h.n_embd,)),
        *_dense_ffn(h, il),
        TensorNeed(_blk(il, "post_ffw_norm.weight"), (h.n_embd,)),
    ]


def _smollm3_layer(h: Hyperparameters, il: int, present: Callable[[str], bool]) -> list[TensorNeed]:
    """models/smollm3.cpp."""
    needs = [TensorNeed(_blk(il, "attn_norm.weight"), (h.n_embd,))]
    needs += _qkv(h, il, present, h.n_embd_q, h.n_embd_k_gqa, h.n_embd_v_gqa)
    return [
        *needs,
        TensorNeed(_blk(il, "attn_output.weight"), (h.n_embd_q, h.n_embd)),
        TensorNeed(_blk(il, "ffn_norm.weight"), (h.n_embd,)),
        *_dense_ffn(h, il),
    ]


_BASE_RULES = (SLICE_LAYERS, IDENTITY_BLOCK, MIDDLE_NO_VOCABULARY, TAIL_LM_HEAD_AS_EMBEDDING)
_EMBEDDING_SCALED_REASON = (
    "embedding-input-scaled: {arch} multiplies the embedding input by sqrt(n_embd) inside the "
    "graph even for hidden-state (embd) batches, a constant in the code that no metadata turns "
    "off, so a non-head shard would rescale the boundary (compensating by dividing is not exact)"
)

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("llama", _llama_model, _llama_layer, (*_BASE_RULES, EXPERTS_WITH_LAYERS)),
        Family("qwen2", _qwen2_model, _qwen2_layer, _BASE_RULES, heads_span_embedding=True),
        Family(
            "qwen2moe",
            _qwen2moe_model,
            _qwen2moe_layer,
            (*_BASE_RULES, EXPERTS_WITH_LAYERS),
            moe=True,
            heads_span_embedding=True,
        ),
        Family("qwen3", _qwen3_model, _qwen3_layer, _BASE_RULES),
        Family(
            "qwen3moe",
            _qwen3_model,
            _qwen3moe_layer,
            (*_BASE_RULES, EXPERTS_WITH_LAYERS),
            moe=True,
        ),
        Family(
            "gemma3",
            _gemma3_model,
            _gemma3_layer,
            (
                *_BASE_RULES,
                SWA_PATTERN_EXPLICIT,
                GEMMA3_ATTENTION_SCALE,
                TOKEN_ONLY_EMBEDDING_SCALE,
            ),
            rope_is_head=False,
            swa_period=6,
        ),
        Family(
            "gemma2",
            _gemma2_model,
            _gemma2_layer,
            _BASE_RULES,
            rope_is_head=False,
            swa_period=2,
            swa_always=True,
            refusal=_EMBEDDING_SCALED_REASON.format(arch="gemma2"),
        ),
        Family(
            "phi3",
            _phi3_model,
            _phi3_layer,
            _BASE_RULES,
            rope_is_head=False,
            heads_span_embedding=True,
        ),
        Family(
            "granite",
            _llama_model,
            _llama_layer,
            (*_BASE_RULES, EMBEDDING_SCALE_HEAD_ONLY),
            extra_required_keys=("logit_scale",),
        ),
        Family(
            "granitemoe",
            _llama_model,
            _llama_layer,
            (*_BASE_RULES, EMBEDDING_SCALE_HEAD_ONLY, EXPERTS_WITH_LAYERS),
            moe=True,
            extra_required_keys=("logit_scale",),
        ),
        Family(
            "olmo2",
            _olmo2_model,
            _olmo2_layer,
            (*_BASE_RULES, SWA_PATTERN_EXPLICIT),
            swa_period=4,
            heads_span_embedding=True,
        ),
        Family(
            "smollm3",
            _qwen3_model,
            _smollm3_layer,
            (*_BASE_RULES, NO_ROPE_STEP_PADDING),
            no_rope_step=4,
        ),
    )
}
