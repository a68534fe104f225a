"""Deterministic tiny GGUF models for tests, self-tests and examples.

The models are random but small and reproducible byte for byte for a given set of arguments, so a
test can generate one into a temporary directory instead of downloading anything. Weights are
scaled so that activations stay in a sane range through every layer (a degenerate model, whose
logits are all equal, would make bitwise comparisons meaningless).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import gguf
import numpy as np
import numpy.typing as npt

__all__ = ["SUPPORTED_TINY_ARCHITECTURES", "TinyModelConfig", "write_tiny_model"]

SUPPORTED_TINY_ARCHITECTURES: tuple[str, ...] = (
    "gemma2",
    "gemma3",
    "granite",
    "granitemoe",
    "llama",
    "olmo2",
    "phi3",
    "qwen2",
    "qwen2moe",
    "qwen3",
    "qwen3moe",
    "smollm3",
)
# Families whose feed-forward is a mixture of experts (llama gets experts with ``n_expert``).
MOE_TINY_ARCHITECTURES = frozenset({"granitemoe", "qwen2moe", "qwen3moe"})
# granite's multipliers (embedding, residual, attention, logit scales) in both granite families.
_GRANITE_ARCHITECTURES = frozenset({"granite", "granitemoe"})
# Experts as wide as n_ff, no expert_feed_forward_length key (llama.cpp's llama/granite loader).
_FF_WIDE_EXPERT_ARCHITECTURES = frozenset({"llama", "granitemoe"})
_QK_NORM_ARCHITECTURES = frozenset({"qwen3", "qwen3moe", "gemma3"})
_QKV_BIAS_ARCHITECTURES = frozenset({"qwen2", "qwen2moe"})
_GEMMA_ARCHITECTURES = frozenset({"gemma3", "gemma2"})

# SentencePiece-style vocabulary: <unk>, <s>, </s> then the 256 byte-fallback tokens. Every string
# can be tokenized (via bytes) and every token has text, which is all a tokenizer needs here.
_N_SPECIAL_TOKENS = 3
_MIN_VOCAB = _N_SPECIAL_TOKENS + 256

# gemma3 marks layers as local (sliding window) where il % 6 < 5, like the real checkpoints.
GEMMA3_SWA_PERIOD = 6


@dataclass(frozen=True, kw_only=True)
class TinyModelConfig:
    """The hyper-parameters of a generated model (also what the reference forward pass needs)."""

    arch: str
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    vocab: int
    dtype: str
    seed: int
    context_length: int
    rope_freq_base: float
    rms_eps: float
    sliding_window: int
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    embedding_scale: float = 0.0
    residual_scale: float = 0.0
    attention_scale: float = 0.0
    logit_scale: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def _token_list(vocab: int) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    extra = vocab - len(tokens)
    # Word pieces after the bytes give the vocabulary readable entries; SentencePiece marks a
    # leading space with U+2581.
    tokens += [f"\u2581w{i}" for i in range(extra)]
    types += [gguf.TokenType.NORMAL] * extra
    scores = [0.0] * _MIN_VOCAB + [-float(i) for i in range(extra)]
    return tokens, scores, [int(t) for t in types]


def _encode_tensor(
    array: npt.NDArray[np.float32], dtype: str
) -> tuple[npt.NDArray[np.generic], gguf.GGMLQuantizationType | None]:
    # 1-D tensors (norms, biases) stay F32: llama.cpp converters never quantize them and several
    # ggml ops require F32 there.
    if array.ndim == 1 or dtype == "f32":
        return np.ascontiguousarray(array, dtype=np.float32), None
    if dtype == "f16":
        return np.ascontiguousarray(array, dtype=np.float16), None
    if dtype == "q8_0":
        quantized = gguf.quants.quantize(array.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        return quantized, gguf.GGMLQuantizationType.Q8_0
    raise ValueError(f"unsupported tiny model dtype {dtype!r} (choose f32, f16 or q8_0)")


def _file_type(dtype: str) -> int:
    return {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[dtype]


def write_tiny_model(
    path: str | os.PathLike[str],
    *,
    arch: str = "llama",
    n_layers: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    vocab: int = 260,
    dtype: str = "f32",
    seed: int = 0,
    context_length: int = 512,
    sliding_window: int = 8,
    tie_embeddings: bool = False,
    n_expert: int = 0,
    n_expert_used: int = 0,
    n_ff_exp: int = 0,
) -> TinyModelConfig:
    """Write a deterministic random model to ``path`` and return its configuration.

    ``vocab`` must be at least 259 (three special tokens plus 256 byte tokens). ``sliding_window``
    only applies to gemma3/gemma2. ``tie_embeddings`` omits ``output.weight`` so the lm-head reuses
    ``token_embd.weight``, as many small checkpoints do.
    """
    if arch not in SUPPORTED_TINY_ARCHITECTURES:
        raise ValueError(f"tiny model architecture {arch!r} not in {SUPPORTED_TINY_ARCHITECTURES}")
    if vocab < _MIN_VOCAB:
        raise ValueError(
            f"vocab must be at least {_MIN_VOCAB} (specials + byte tokens), got {vocab}"
        )
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")
    head_dim = n_embd // n_head
    if arch in MOE_TINY_ARCHITECTURES and n_expert == 0:
        n_expert, n_expert_used = 4, 2
    if n_expert and not 0 < n_expert_used <= n_expert:
        raise ValueError("n_expert_used must lie in [1, n_expert]")
    if n_expert and arch not in MOE_TINY_ARCHITECTURES | {"llama"}:
        raise ValueError(f"{arch} has no experts in this generator")
    # llama's (and granitemoe's) experts are n_ff wide; the qwen MoE families have their own
    # expert length.
    if n_expert and arch in _FF_WIDE_EXPERT_ARCHITECTURES:
        n_ff_exp = n_ff
    n_ff_exp = n_ff_exp or (n_ff // 2 if n_expert else 0)
    if dtype == "q8_0" and (n_embd % 32 or n_ff % 32 or (n_head * head_dim) % 32):
        raise ValueError("q8_0 needs n_embd, n_ff and n_head*head_dim divisible by 32")

    config = TinyModelConfig(
        arch=arch,
        n_layers=n_layers,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        vocab=vocab,
        dtype=dtype,
        seed=seed,
        context_length=context_length,
        rope_freq_base=10000.0,
        rms_eps=1e-5 if arch not in _GEMMA_ARCHITECTURES else 1e-6,
        sliding_window=sliding_window if arch in _GEMMA_ARCHITECTURES else 0,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_exp=n_ff_exp,
        n_ff_shexp=n_ff // 2 if arch == "qwen2moe" else 0,
        # granite's multipliers; the embedding one is what a non-head shard must not reapply.
        embedding_scale=12.0 if arch in _GRANITE_ARCHITECTURES else 0.0,
        residual_scale=0.22 if arch in _GRANITE_ARCHITECTURES else 0.0,
        attention_scale=0.0078125 if arch in _GRANITE_ARCHITECTURES else 0.0,
        logit_scale=8.0 if arch in _GRANITE_ARCHITECTURES else 0.0,
    )
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    _add_hyperparameters(writer, config)
    _add_tokenizer(writer, config)
    _add_tensors(_RandomTensors(writer, dtype, np.random.default_rng(seed)), config, tie_embeddings)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config


def _add_hyperparameters(writer: gguf.GGUFWriter, config: TinyModelConfig) -> None:
    """The model's name, file type and every ``<arch>.*`` key its family's loader reads."""
    arch = config.arch
    head_dim = config.head_dim
    writer.add_name(f"tiny-{arch}-{config.dtype}-seed{config.seed}")
    writer.add_file_type(_file_type(config.dtype))
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.n_ff)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.n_head_kv)
    writer.add_layer_norm_rms_eps(config.rms_eps)
    writer.add_rope_freq_base(config.rope_freq_base)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(config.vocab)
    if config.n_expert:
        writer.add_expert_count(config.n_expert)
        writer.add_expert_used_count(config.n_expert_used)
        if arch not in _FF_WIDE_EXPERT_ARCHITECTURES:
            writer.add_expert_feed_forward_length(config.n_ff_exp)
    if config.n_ff_shexp:
        writer.add_expert_shared_feed_forward_length(config.n_ff_shexp)
    if arch in _GRANITE_ARCHITECTURES:
        writer.add_float32(f"{arch}.embedding_scale", config.embedding_scale)
        writer.add_float32(f"{arch}.residual_scale", config.residual_scale)
        writer.add_float32(f"{arch}.attention.scale", config.attention_scale)
        writer.add_float32(f"{arch}.logit_scale", config.logit_scale)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
        writer.add_array(
            f"{arch}.attention.sliding_window_pattern",
            [il % GEMMA3_SWA_PERIOD < GEMMA3_SWA_PERIOD - 1 for il in range(config.n_layers)],
        )
        writer.add_float32(f"{arch}.rope.freq_base_swa", config.rope_freq_base)
    if arch == "gemma2":
        writer.add_sliding_window(config.sliding_window)
        writer.add_float32(f"{arch}.attn_logit_softcapping", 50.0)
        writer.add_float32(f"{arch}.final_logit_softcapping", 30.0)


def _add_tokenizer(writer: gguf.GGUFWriter, config: TinyModelConfig) -> None:
    """A SentencePiece-style vocabulary of ``config.vocab`` tokens and its special ids."""
    tokens, scores, token_types = _token_list(config.vocab)
    if config.arch == "phi3":
        # llama.cpp looks this token up by name in any model whose name says phi3.
        tokens[-1] = "<|endoftext|>"
        token_types[-1] = int(gguf.TokenType.CONTROL)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


class _RandomTensors:
    """Random weights drawn from one generator, in the order they are added (the order is what
    makes a model reproducible byte for byte), encoded in the model's dtype."""

    def __init__(self, writer: gguf.GGUFWriter, dtype: str, rng: np.random.Generator) -> None:
        self.writer = writer
        self.dtype = dtype
        self.rng = rng

    def add(self, name: str, array: npt.NDArray[np.float32]) -> None:
        data, raw_dtype = _encode_tensor(array, self.dtype)
        self.writer.add_tensor(name, data, raw_dtype=raw_dtype)

    def matrix(self, rows: int, cols: int) -> npt.NDArray[np.float32]:
        # 1/sqrt(fan_in) keeps each projection roughly variance-preserving.
        values: npt.NDArray[np.float64] = self.rng.standard_normal((rows, cols)) / np.sqrt(cols)
        return values.astype(np.float32)

    def norm(self, n: int) -> npt.NDArray[np.float32]:
        return (1.0 + 0.1 * self.rng.standard_normal(n)).astype(np.float32)

    def bias(self, n: int) -> npt.NDArray[np.float32]:
        return (0.1 * self.rng.standard_normal(n)).astype(np.float32)

    def experts(self, n_expert: int, rows: int, cols: int) -> npt.NDArray[np.float32]:
        # numpy (n_expert, rows, cols) is ggml {cols, rows, n_expert}.
        return np.stack([self.matrix(rows, cols) for _ in range(n_expert)])


def _add_tensors(tensors: _RandomTensors, config: TinyModelConfig, tie_embeddings: bool) -> None:
    """Every tensor of the model: the token embedding, each block's, the output norm and, unless
    the lm-head is tied to the embedding, the output projection."""
    arch = config.arch
    tensors.add(
        "token_embd.weight",
        tensors.rng.standard_normal((config.vocab, config.n_embd)).astype(np.float32),
    )
    for il in range(config.n_layers):
        _add_attention(tensors, config, f"blk.{il}")
        _add_feed_forward(tensors, config, f"blk.{il}")
    tensors.add("output_norm.weight", tensors.norm(config.n_embd))
    # gemma2's loader always ties the lm-head to the token embedding; olmo2's and qwen2moe's
    # always want their own.
    if (not tie_embeddings and arch != "gemma2") or arch in ("olmo2", "qwen2moe"):
        tensors.add("output.weight", tensors.matrix(config.vocab, config.n_embd))


def _add_attention(tensors: _RandomTensors, config: TinyModelConfig, prefix: str) -> None:
    """One block's attention: its norm, projections, biases and q/k norms as the family has
    them."""
    arch, n_embd, head_dim = config.arch, config.n_embd, config.head_dim
    add, matrix, norm, bias = tensors.add, tensors.matrix, tensors.norm, tensors.bias
    q_dim = config.n_head * head_dim
    kv_dim = config.n_head_kv * head_dim
    if arch != "olmo2":
        add(f"{prefix}.attn_norm.weight", norm(n_embd))
    if arch == "phi3":
        add(f"{prefix}.attn_qkv.weight", matrix(q_dim + 2 * kv_dim, n_embd))
    else:
        add(f"{prefix}.attn_q.weight", matrix(q_dim, n_embd))
        add(f"{prefix}.attn_k.weight", matrix(kv_dim, n_embd))
        add(f"{prefix}.attn_v.weight", matrix(kv_dim, n_embd))
    if arch in _QKV_BIAS_ARCHITECTURES:
        add(f"{prefix}.attn_q.bias", bias(q_dim))
        add(f"{prefix}.attn_k.bias", bias(kv_dim))
        add(f"{prefix}.attn_v.bias", bias(kv_dim))
    if arch in _QK_NORM_ARCHITECTURES:
        add(f"{prefix}.attn_q_norm.weight", norm(head_dim))
        add(f"{prefix}.attn_k_norm.weight", norm(head_dim))
    if arch == "olmo2":
        # olmo2 normalises q and k over all heads at once.
        add(f"{prefix}.attn_q_norm.weight", norm(q_dim))
        add(f"{prefix}.attn_k_norm.weight", norm(kv_dim))
    add(f"{prefix}.attn_output.weight", matrix(n_embd, q_dim))
    if arch in _GEMMA_ARCHITECTURES or arch == "olmo2":
        add(f"{prefix}.post_attention_norm.weight", norm(n_embd))


def _add_feed_forward(tensors: _RandomTensors, config: TinyModelConfig, prefix: str) -> None:
    """One block's feed-forward: its norm and the dense, fused or mixture-of-experts
    projections of the family."""
    arch, n_embd, n_ff = config.arch, config.n_embd, config.n_ff
    add, matrix, norm, bias = tensors.add, tensors.matrix, tensors.norm, tensors.bias
    n_expert, n_ff_exp, n_ff_shexp = config.n_expert, config.n_ff_exp, config.n_ff_shexp
    if arch != "olmo2":
        add(f"{prefix}.ffn_norm.weight", norm(n_embd))
    if n_expert:
        add(f"{prefix}.ffn_gate_inp.weight", matrix(n_expert, n_embd))
        add(f"{prefix}.ffn_gate_exps.weight", tensors.experts(n_expert, n_ff_exp, n_embd))
        add(f"{prefix}.ffn_down_exps.weight", tensors.experts(n_expert, n_embd, n_ff_exp))
        add(f"{prefix}.ffn_up_exps.weight", tensors.experts(n_expert, n_ff_exp, n_embd))
        if n_ff_shexp:
            add(f"{prefix}.ffn_gate_inp_shexp.weight", bias(n_embd))
            add(f"{prefix}.ffn_gate_shexp.weight", matrix(n_ff_shexp, n_embd))
            add(f"{prefix}.ffn_up_shexp.weight", matrix(n_ff_shexp, n_embd))
            add(f"{prefix}.ffn_down_shexp.weight", matrix(n_embd, n_ff_shexp))
    elif arch == "phi3":
        # phi3 fuses gate and up into one 2 * n_ff wide projection.
        add(f"{prefix}.ffn_up.weight", matrix(2 * n_ff, n_embd))
        add(f"{prefix}.ffn_down.weight", matrix(n_embd, n_ff))
    else:
        add(f"{prefix}.ffn_gate.weight", matrix(n_ff, n_embd))
        add(f"{prefix}.ffn_up.weight", matrix(n_ff, n_embd))
        add(f"{prefix}.ffn_down.weight", matrix(n_embd, n_ff))
    if arch in _GEMMA_ARCHITECTURES or arch == "olmo2":
        add(f"{prefix}.post_ffw_norm.weight", norm(n_embd))
