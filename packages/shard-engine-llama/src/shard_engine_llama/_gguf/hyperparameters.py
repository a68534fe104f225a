"""What llama.cpp derives from a model's metadata, read the way its loader reads it.

``hyperparameters`` mirrors ``load_hparams`` for a family (see ``families.py``): per-layer
counts, head sizes, expert counts and the vocabulary size, with the key types checked as they
are read. ``swa_pattern`` and ``uses_sliding_window`` say which layers are sliding-window ones;
``largest_count`` and ``kv_row_bound`` bound what one KV cell of the file can hold. The checks
that refuse a file live in ``family_checks.py`` and ``tokenizer_checks.py``.
"""

from __future__ import annotations

from shard_engine_llama._gguf.families import FAMILIES, Family, Hyperparameters
from shard_engine_llama._gguf.reader import GGUFHeader, GGUFValidationError

__all__ = [
    "LLAMA_MAX_LAYERS",
    "fail",
    "hyperparameters",
    "kv_row_bound",
    "largest_count",
    "optional_int",
    "swa_pattern",
    "uses_sliding_window",
]

LLAMA_MAX_LAYERS = 512


def fail(header: GGUFHeader, rule: str, field: str, message: str) -> GGUFValidationError:
    """The validation error naming ``field`` of ``header`` and the ``rule`` it breaks."""
    return GGUFValidationError(f"{header.path}: {field}: {message}", rule=rule, field=field)


def _per_layer(
    header: GGUFHeader, key: str, n_layer: int, default: int | None, uniform: bool
) -> list[int]:
    entry = header.metadata.get(key)
    if entry is None:
        if default is None:
            raise fail(header, "metadata-missing", key, "required key is missing")
        return [default] * n_layer
    if isinstance(entry.value, list):
        values = entry.value
        if len(values) != n_layer:
            raise fail(
                header,
                "hparam-per-layer-length",
                key,
                f"has {len(values)} entries for {n_layer} layers",
            )
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise fail(header, "metadata-type", key, "per-layer array is not integer")
        ints = [int(v) for v in values]
        if uniform and len(set(ints)) > 1:
            raise fail(
                header,
                "hparam-per-layer-uniform",
                key,
                f"varies per layer ({sorted(set(ints))}); this family's loader uses layer 0's "
                "value for every layer",
            )
        return ints
    value = entry.value
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(header, "metadata-type", key, "is not an integer")
    return [value] * n_layer


def optional_int(header: GGUFHeader, key: str, default: int) -> int:
    entry = header.metadata.get(key)
    if entry is None:
        return default
    if isinstance(entry.value, bool) or not isinstance(entry.value, int):
        raise fail(header, "metadata-type", key, "is not an integer")
    return entry.value


def _vocabulary_size(header: GGUFHeader, arch: str) -> int:
    model = header.metadata.get("tokenizer.ggml.model")
    if model is not None and model.value in ("none", "no_vocab"):
        # llama-vocab.cpp: a vocabulary-less model ignores any token list and gets
        # <arch>.vocab_size dummy tokens.
        return optional_int(header, f"{arch}.vocab_size", 0)
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and isinstance(tokens.value, list):
        return len(tokens.value)
    raise fail(header, "vocabulary-missing", "tokenizer.ggml.tokens", "the model has no token list")


def hyperparameters(header: GGUFHeader, family: Family) -> Hyperparameters:
    """What llama.cpp's ``load_hparams`` derives for this family (see families.py)."""
    arch = family.name
    n_layer = header.get_int(f"{arch}.block_count")
    if not 0 < n_layer <= LLAMA_MAX_LAYERS:
        raise fail(
            header,
            "hparam-block-count",
            f"{arch}.block_count",
            f"{n_layer} outside [1, {LLAMA_MAX_LAYERS}] (GGML_ASSERT in load_hparams)",
        )
    n_embd = header.get_int(f"{arch}.embedding_length")
    uniform = family.uniform_arrays
    heads = _per_layer(header, f"{arch}.attention.head_count", n_layer, 0, uniform)
    heads_kv = _per_layer(header, f"{arch}.attention.head_count_kv", n_layer, heads[0], uniform)
    ffs = _per_layer(header, f"{arch}.feed_forward_length", n_layer, 0, uniform)
    n_head = heads[0]
    head_k = optional_int(
        header, f"{arch}.attention.key_length", n_embd // n_head if n_head > 0 else 0
    )
    head_v = optional_int(
        header, f"{arch}.attention.value_length", n_embd // n_head if n_head > 0 else 0
    )
    n_expert = optional_int(header, f"{arch}.expert_count", 0)
    used = _per_layer(header, f"{arch}.expert_used_count", n_layer, 0, uniform)
    ff_exp = _per_layer(header, f"{arch}.expert_feed_forward_length", n_layer, 0, uniform)
    scaling = header.metadata.get(f"{arch}.rope.scaling.type")
    return Hyperparameters(
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=_vocabulary_size(header, arch),
        n_head=n_head,
        n_head_kv=heads_kv[0],
        n_embd_head_k=head_k,
        n_embd_head_v=head_v,
        n_rot=optional_int(header, f"{arch}.rope.dimension_count", head_k),
        n_ff=ffs[0],
        n_expert=n_expert,
        n_expert_used=used[0],
        n_ff_exp=ff_exp[0],
        n_ff_shexp=optional_int(header, f"{arch}.expert_shared_feed_forward_length", 0),
        n_layer_dense_lead=optional_int(header, f"{arch}.leading_dense_block_count", 0),
        rope_scaling_type=scaling.value
        if scaling is not None and isinstance(scaling.value, str)
        else "linear",
    )


def swa_pattern(header: GGUFHeader, n_layers: int, default_period: int) -> list[bool]:
    """Which of the first ``n_layers`` layers are sliding-window ones, as llama.cpp's
    ``load_swa_pattern`` reads them: an explicit per-layer array, or a period (the key's or the
    family's default)."""
    key = f"{header.architecture}.attention.sliding_window_pattern"
    entry = header.metadata.get(key)
    if entry is not None and isinstance(entry.value, list):
        return [bool(item) for item in entry.value[:n_layers]]
    period = default_period
    if entry is not None and isinstance(entry.value, int):
        period = entry.value
    # Mirrors llama_hparams::set_swa_pattern(n_pattern, dense_first=false).
    return [period == 0 or il % period < period - 1 for il in range(n_layers)]


def uses_sliding_window(header: GGUFHeader) -> bool:
    """Whether llama.cpp builds this model with sliding-window layers (a family with a pattern
    and a positive window; gemma2 always)."""
    family = FAMILIES.get(header.architecture)
    if family is None or not family.swa_period:
        return False
    window = header.metadata.get(f"{header.architecture}.attention.sliding_window")
    if window is None:
        return family.swa_always
    return isinstance(window.value, int) and not isinstance(window.value, bool) and window.value > 0


def largest_count(header: GGUFHeader, key: str, default: int) -> int:
    """The largest value of a per-layer (or scalar) count; ``default`` when absent."""
    entry = header.metadata.get(key)
    if entry is None:
        return default
    values = entry.value if isinstance(entry.value, list) else [entry.value]
    return max([int(v) for v in values if isinstance(v, int)] or [default])


def kv_row_bound(header: GGUFHeader) -> int:
    """An upper bound of the elements in one cell's K or V of any layer of this file: its most
    KV heads times its largest head size (``key_length``, ``value_length``, their sliding-
    window forms, or the embedding width over the head count), and at least the embedding
    width. A sequence state that declares wider rows is not of this file."""
    h = hyperparameters(header, FAMILIES[header.architecture])
    prefix = f"{header.architecture}.attention."
    heads_kv = largest_count(header, prefix + "head_count_kv", h.n_head_kv)
    head = max(
        h.n_embd_head_k,
        h.n_embd_head_v,
        *(largest_count(header, prefix + key, 0) for key in ("key_length_swa", "value_length_swa")),
    )
    return max(h.n_embd, heads_kv * head)
