"""A float64 numpy forward pass: an oracle for the llama engine that does not depend on llama.cpp.

It implements the llama-graph family exactly as llama.cpp's graphs do (RMSNorm, RoPE in the
architecture's mode, grouped-query causal attention, SwiGLU), so with F32 weights, F32 KV cache
and flash attention off, llama.cpp agrees with it to ~1e-6. It is meant for tiny models: it holds
every weight in memory as float64.

RoPE mode matters: llama uses the "normal" mode (rotating adjacent pairs, the GGUF converter
permutes Q/K to match) and qwen2/qwen3 use NeoX mode (rotating the two halves of each head).

qwen3moe replaces the feed-forward with experts as llama.cpp's ``build_moe_ffn`` does for it
(src/llama-graph.cpp, called from src/models/qwen3moe.cpp): softmax over the router logits of
all experts, the ``expert_used_count`` most probable ones, their probabilities renormalised to
sum to 1, and the weighted sum of their SwiGLU outputs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import gguf
import numpy as np
import numpy.typing as npt

__all__ = ["REFERENCE_ARCHITECTURES", "ReferenceModel"]

REFERENCE_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3moe")
_NEOX_ROPE = frozenset({"qwen2", "qwen3", "qwen3moe"})

Float64Array = npt.NDArray[np.float64]


@dataclass(frozen=True)
class _Layer:
    attn_norm: Float64Array
    wq: Float64Array
    wk: Float64Array
    wv: Float64Array
    wo: Float64Array
    bq: Float64Array | None
    bk: Float64Array | None
    bv: Float64Array | None
    q_norm: Float64Array | None
    k_norm: Float64Array | None
    ffn_norm: Float64Array
    w_gate: Float64Array | None
    w_up: Float64Array | None
    w_down: Float64Array | None
    # Experts: router (n_expert, n_embd); gate/up (n_expert, n_ff_exp, n_embd); down
    # (n_expert, n_embd, n_ff_exp).
    router: Float64Array | None = None
    gate_exps: Float64Array | None = None
    up_exps: Float64Array | None = None
    down_exps: Float64Array | None = None


def _rms_norm(x: Float64Array, weight: Float64Array, eps: float) -> Float64Array:
    result: Float64Array = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight
    return result


def _swiglu(
    h: Float64Array, w_gate: Float64Array, w_up: Float64Array, w_down: Float64Array
) -> Float64Array:
    gate = h @ w_gate.T
    result: Float64Array = ((gate / (1.0 + np.exp(-gate))) * (h @ w_up.T)) @ w_down.T
    return result


class ReferenceModel:
    """A whole GGUF model (llama/qwen2/qwen3 graph) evaluated in float64."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        reader = gguf.GGUFReader(os.fspath(path))
        self.architecture = str(reader.fields["general.architecture"].contents())
        if self.architecture not in REFERENCE_ARCHITECTURES:
            raise ValueError(
                f"reference forward pass supports {REFERENCE_ARCHITECTURES}, "
                f"not {self.architecture!r}"
            )
        arch = self.architecture

        def number(key: str, default: float | None = None) -> float:
            field = reader.fields.get(f"{arch}.{key}")
            if field is None:
                if default is None:
                    raise ValueError(f"metadata {arch}.{key} missing")
                return default
            return float(field.contents())

        self.n_layers = int(number("block_count"))
        self.n_embd = int(number("embedding_length"))
        self.n_head = int(number("attention.head_count"))
        self.n_head_kv = int(number("attention.head_count_kv", float(self.n_head)))
        self.head_dim = int(number("attention.key_length", float(self.n_embd // self.n_head)))
        self.rms_eps = number("attention.layer_norm_rms_epsilon")
        self.rope_base = number("rope.freq_base", 10000.0)
        self.n_expert_used = int(number("expert_used_count", 0.0))
        tensors = {tensor.name: tensor for tensor in reader.tensors}

        def weight(name: str) -> Float64Array:
            tensor = tensors[name]
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            array: Float64Array = np.asarray(values, dtype=np.float64).reshape(
                tuple(int(d) for d in reversed(tensor.shape))
            )
            return array

        def optional(name: str) -> Float64Array | None:
            return weight(name) if name in tensors else None

        self.token_embd = weight("token_embd.weight")
        self.output_norm = weight("output_norm.weight")
        output = optional("output.weight")
        self.output = output if output is not None else self.token_embd
        self.layers: list[_Layer] = []
        for il in range(self.n_layers):
            p = f"blk.{il}."
            self.layers.append(
                _Layer(
                    attn_norm=weight(p + "attn_norm.weight"),
                    wq=weight(p + "attn_q.weight"),
                    wk=weight(p + "attn_k.weight"),
                    wv=weight(p + "attn_v.weight"),
                    wo=weight(p + "attn_output.weight"),
                    bq=optional(p + "attn_q.bias"),
                    bk=optional(p + "attn_k.bias"),
                    bv=optional(p + "attn_v.bias"),
                    q_norm=optional(p + "attn_q_norm.weight"),
                    k_norm=optional(p + "attn_k_norm.weight"),
                    ffn_norm=weight(p + "ffn_norm.weight"),
                    w_gate=optional(p + "ffn_gate.weight"),
                    w_up=optional(p + "ffn_up.weight"),
                    w_down=optional(p + "ffn_down.weight"),
                    router=optional(p + "ffn_gate_inp.weight"),
                    gate_exps=optional(p + "ffn_gate_exps.weight"),
                    up_exps=optional(p + "ffn_up_exps.weight"),
                    down_exps=optional(p + "ffn_down_exps.weight"),
                )
            )

    def _rope(self, x: Float64Array, positions: npt.NDArray[np.int64]) -> Float64Array:
        # x: (n_tokens, n_heads, head_dim)
        half = self.head_dim // 2
        inverse_frequency = self.rope_base ** (
            -np.arange(half, dtype=np.float64) * 2.0 / self.head_dim
        )
        angles = positions[:, None].astype(np.float64) * inverse_frequency[None, :]
        cos = np.cos(angles)[:, None, :]
        sin = np.sin(angles)[:, None, :]
        if self.architecture in _NEOX_ROPE:
            first, second = x[..., :half], x[..., half:]
        else:
            first, second = x[..., 0::2], x[..., 1::2]
        rotated_first = first * cos - second * sin
        rotated_second = first * sin + second * cos
        out = np.empty_like(x)
        if self.architecture in _NEOX_ROPE:
            out[..., :half], out[..., half:] = rotated_first, rotated_second
        else:
            out[..., 0::2], out[..., 1::2] = rotated_first, rotated_second
        return out

    def hidden_states(self, tokens: Sequence[int], n_layers: int | None = None) -> Float64Array:
        """Residual stream after ``n_layers`` layers (all by default) for a fresh sequence."""
        x: Float64Array = self.token_embd[np.asarray(tokens, dtype=np.int64)]
        positions = np.arange(len(tokens), dtype=np.int64)
        n = len(tokens)
        group = self.n_head // self.n_head_kv
        causal = np.triu(np.ones((n, n), dtype=bool), k=1)
        for layer in self.layers[: self.n_layers if n_layers is None else n_layers]:
            h = _rms_norm(x, layer.attn_norm, self.rms_eps)
            q = h @ layer.wq.T
            k = h @ layer.wk.T
            v = h @ layer.wv.T
            if layer.bq is not None and layer.bk is not None and layer.bv is not None:
                q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
            q = q.reshape(n, self.n_head, self.head_dim)
            k = k.reshape(n, self.n_head_kv, self.head_dim)
            v = v.reshape(n, self.n_head_kv, self.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = _rms_norm(q, layer.q_norm, self.rms_eps)
                k = _rms_norm(k, layer.k_norm, self.rms_eps)
            q = self._rope(q, positions)
            k = self._rope(k, positions)
            k = np.repeat(k, group, axis=1)
            v = np.repeat(v, group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(self.head_dim)
            scores = np.where(causal[None, :, :], -np.inf, scores)
            scores -= scores.max(axis=-1, keepdims=True)
            probabilities = np.exp(scores)
            probabilities /= probabilities.sum(axis=-1, keepdims=True)
            attention = np.einsum("hqk,khd->qhd", probabilities, v).reshape(
                n, self.n_head * self.head_dim
            )
            x = x + attention @ layer.wo.T
            h = _rms_norm(x, layer.ffn_norm, self.rms_eps)
            x = x + self._feed_forward(layer, h)
        return x

    def _feed_forward(self, layer: _Layer, h: Float64Array) -> Float64Array:
        if layer.router is None:
            assert layer.w_gate is not None
            assert layer.w_up is not None
            assert layer.w_down is not None
            return _swiglu(h, layer.w_gate, layer.w_up, layer.w_down)
        assert layer.gate_exps is not None
        assert layer.up_exps is not None
        assert layer.down_exps is not None
        logits = h @ layer.router.T  # (n_tokens, n_expert)
        probabilities = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probabilities /= probabilities.sum(axis=-1, keepdims=True)
        out = np.zeros_like(h)
        for row in range(h.shape[0]):
            chosen = np.argsort(-probabilities[row], kind="stable")[: self.n_expert_used]
            weights = probabilities[row, chosen] / probabilities[row, chosen].sum()
            for expert, weight in zip(chosen, weights, strict=True):
                out[row] += (
                    weight
                    * _swiglu(
                        h[row : row + 1],
                        layer.gate_exps[expert],
                        layer.up_exps[expert],
                        layer.down_exps[expert],
                    )[0]
                )
        return out

    def logits(self, tokens: Sequence[int]) -> Float64Array:
        """Logits (n_tokens, n_vocab) for every position of a fresh sequence."""
        x = _rms_norm(self.hidden_states(tokens), self.output_norm, self.rms_eps)
        result: Float64Array = x @ self.output.T
        return result
