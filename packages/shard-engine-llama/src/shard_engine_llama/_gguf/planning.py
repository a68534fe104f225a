"""Planning: whether a model can be sharded exactly, and which layer ranges to cut it into."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from shard_engine_llama._gguf.families import FAMILIES, GEMMA3_27B_LAYER_COUNT
from shard_engine_llama._gguf.reader import GGUFHeader, layer_index
from shard_engine_llama._gguf.validation import unspellable_bytes, validate_gguf

__all__ = [
    "ALLOWED_ARCHITECTURES",
    "GGUFModelInfo",
    "ShardingRefusedError",
    "check_partial_ranges",
    "check_ranges",
    "inspect_gguf",
    "model_info",
    "parts_by_bytes",
    "role_of",
]

# Every family of families.py that is not refused: each is proven split == unsplit bit for bit
# by tests/test_families.py on its generated tiny model.
ALLOWED_ARCHITECTURES: tuple[str, ...] = tuple(
    sorted(name for name, family in FAMILIES.items() if family.refusal is None)
)

# Families without a layout in families.py that scale the embedding input inside the graph
# whether it came from token ids or from ``batch.embd`` (so a non-head shard would rescale the
# hidden states it receives), named so the refusal says why.
_EMBEDDING_SCALED_ARCHITECTURES = frozenset(
    {"gemma", "granitehybrid", "minicpm", "minicpm3", "plamo"}
)


class ShardingRefusedError(ValueError):
    """A model (or a requested layer range of it) cannot be sharded exactly; ``rule`` names why."""

    def __init__(self, rule: str) -> None:
        super().__init__(rule)
        self.rule = rule


@dataclass(frozen=True)
class GGUFModelInfo:
    """What a GGUF model is and whether it can be sharded (``refusal`` names the rule if not)."""

    path: Path
    architecture: str
    n_layers: int
    n_embd: int
    vocab_size: int
    layer_bytes: tuple[int, ...]
    non_layer_bytes: int
    file_size: int
    shardable: bool
    refusal: str | None
    is_shard: bool
    # The per-shard rules (families.py) that make this family's shards exact, by name.
    rules: tuple[str, ...] = ()
    # Bytes of UTF-8 text the vocabulary has no token for: the tokenizer refuses text with one
    # (filled by inspect_gguf only: a load or a split has no use for it).
    unspellable: bytes = b""

    @property
    def total_layer_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def total_bytes(self) -> int:
        return self.file_size


def _shardability(header: GGUFHeader) -> str | None:
    arch = header.architecture
    if header.is_shard:
        return (
            "already-a-shard: this file is a shard written by split_model; split the original model"
        )
    family = FAMILIES.get(arch)
    if family is not None and family.refusal is not None:
        return family.refusal
    if arch in _EMBEDDING_SCALED_ARCHITECTURES:
        return (
            f"embedding-input-scaled: {arch} scales the embedding input inside the graph even for "
            "hidden-state (embd) batches, so a non-head shard would rescale the boundary"
        )
    if arch not in ALLOWED_ARCHITECTURES:
        return (
            f"architecture-not-allowed: {arch!r} is not in the shard allow-list "
            f"{list(ALLOWED_ARCHITECTURES)} (its graph has not been proven exact when split)"
        )
    if header.get_int(f"{arch}.block_count") < 2:
        return "too-few-layers: a model needs at least 2 layers to be split"
    if arch == "gemma3" and header.get_int("gemma3.block_count") == GEMMA3_27B_LAYER_COUNT:
        return (
            "gemma3-layer-count-attention-scale: gemma3 with 62 layers uses the 27B "
            "attention scale, "
            "which llama.cpp chooses from the layer count, so its shards would use the wrong scale"
        )
    return None


def model_info(header: GGUFHeader) -> GGUFModelInfo:
    """Describe an already validated header (what :func:`inspect_gguf` returns)."""
    arch = header.architecture
    n_layers = header.get_int(f"{arch}.block_count")
    layer_bytes = [0] * n_layers
    non_layer_bytes = 0
    for record in header.tensors.values():
        index = layer_index(record.name)
        if index is None:
            non_layer_bytes += record.n_bytes
        else:
            layer_bytes[index] += record.n_bytes
    refusal = _shardability(header)
    return GGUFModelInfo(
        path=header.path,
        architecture=arch,
        n_layers=n_layers,
        n_embd=header.get_int(f"{arch}.embedding_length"),
        vocab_size=header.tensors["token_embd.weight"].shape[1],
        layer_bytes=tuple(layer_bytes),
        non_layer_bytes=non_layer_bytes,
        file_size=header.file_size,
        shardable=refusal is None,
        refusal=refusal,
        is_shard=header.is_shard,
        rules=_rules(header) if refusal is None else (),
    )


def _rules(header: GGUFHeader) -> tuple[str, ...]:
    family = FAMILIES.get(header.architecture)
    return tuple(rule.name for rule in family.rules) if family is not None else ()


def inspect_gguf(path: str | os.PathLike[str]) -> GGUFModelInfo:
    """Validate ``path`` and describe it (size per layer, shardability and the refusing rule,
    and the bytes its vocabulary cannot spell)."""
    header = validate_gguf(path)
    return replace(model_info(header), unspellable=unspellable_bytes(header))


def parts_by_bytes(info: GGUFModelInfo, n_parts: int) -> list[tuple[int, int]]:
    """Split the layers into ``n_parts`` contiguous ranges minimising the largest range's bytes.

    Only layer bytes are balanced: the embedding lookup on the head is cheap to compute, and the
    lm-head on the tail is the same for every split, so neither is worth moving layers for.
    """
    weights = info.layer_bytes
    n = len(weights)
    if not 1 <= n_parts <= n:
        raise ValueError(f"cannot split {n} layers into {n_parts} parts")
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)

    def cuts_for(limit: int) -> list[int] | None:
        # Greedy: take as many layers as fit under the limit, leaving one per remaining part.
        cuts: list[int] = []
        start = 0
        for part in range(n_parts):
            remaining_parts = n_parts - part - 1
            end = start + 1
            if prefix[end] - prefix[start] > limit:
                return None
            while end < n - remaining_parts and prefix[end + 1] - prefix[start] <= limit:
                end += 1
            if part == n_parts - 1 and end != n:
                return None
            cuts.append(end)
            start = end
        return cuts

    low, high = max(weights), prefix[-1]
    while low < high:
        middle = (low + high) // 2
        if cuts_for(middle) is None:
            low = middle + 1
        else:
            high = middle
    cuts = cuts_for(low)
    assert cuts is not None
    starts = [0, *cuts[:-1]]
    return list(zip(starts, cuts, strict=True))


def check_ranges(ranges: Sequence[tuple[int, int]], n_layers: int) -> None:
    if not ranges:
        raise ValueError("no layer ranges given")
    expected_start = 0
    for start, end in ranges:
        if start != expected_start or end <= start:
            raise ValueError(
                f"ranges {list(ranges)} must be contiguous, non-empty and start at 0 "
                f"(problem at {start}, {end})"
            )
        expected_start = end
    if expected_start != n_layers:
        raise ValueError(
            f"ranges {list(ranges)} end at {expected_start}, the model has {n_layers} layers"
        )


def check_partial_ranges(ranges: Sequence[tuple[int, int]], n_layers: int) -> None:
    if not ranges:
        raise ValueError("no layer ranges given")
    previous_end = 0
    for start, end in ranges:
        if not previous_end <= start < end <= n_layers:
            raise ValueError(
                f"ranges {list(ranges)} must be ordered, non-overlapping, non-empty and within "
                f"[0, {n_layers}) (problem at {start}, {end})"
            )
        previous_end = end


def role_of(start: int, end: int, n_layers: int) -> str:
    """head, middle, tail or full, as the contract derives it from a range."""
    if start == 0:
        return "full" if end == n_layers else "head"
    return "tail" if end == n_layers else "middle"
