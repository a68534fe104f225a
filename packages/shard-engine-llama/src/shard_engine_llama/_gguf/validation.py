"""Validation: is a parsed GGUF header a model llama.cpp can load without aborting?

llama.cpp trusts its input: some defects make it refuse the file, others abort the whole process
(``GGML_ASSERT``). Every check here runs before llama.cpp opens a file and raises
:class:`GGUFValidationError` naming the rule and the field.
"""

from __future__ import annotations

import os

from shard_engine_llama._gguf.families import FAMILIES
from shard_engine_llama._gguf.layout import check_family
from shard_engine_llama._gguf.reader import (
    GGUFHeader,
    GGUFValidationError,
    layer_index,
    read_gguf_header,
)

__all__ = ["validate_gguf", "validate_header"]


def _check_model_structure(header: GGUFHeader) -> None:
    path = header.path
    if "general.architecture" not in header.metadata:
        raise GGUFValidationError(f"{path}: metadata key 'general.architecture' is missing")
    arch = header.architecture
    n_layers = header.get_int(f"{arch}.block_count")
    n_embd = header.get_int(f"{arch}.embedding_length")
    if n_layers <= 0 or n_embd <= 0:
        raise GGUFValidationError(
            f"{path}: block_count={n_layers}, embedding_length={n_embd} must be positive"
        )
    for required in ("token_embd.weight", "output_norm.weight"):
        if required not in header.tensors:
            raise GGUFValidationError(f"{path}: required tensor {required!r} is missing")
    embedding = header.tensors["token_embd.weight"]
    if len(embedding.shape) != 2 or embedding.shape[0] != n_embd:
        raise GGUFValidationError(
            f"{path}: token_embd.weight has shape {list(embedding.shape)}, "
            f"expected [{n_embd}, vocab]"
        )
    if header.tensors["output_norm.weight"].shape != (n_embd,):
        raise GGUFValidationError(f"{path}: output_norm.weight does not have {n_embd} elements")
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if (
        tokens is not None
        and isinstance(tokens.value, list)
        and len(tokens.value) != embedding.shape[1]
    ):
        raise GGUFValidationError(
            f"{path}: tokenizer has {len(tokens.value)} tokens but token_embd.weight has "
            f"{embedding.shape[1]} rows"
        )
    output = header.tensors.get("output.weight")
    if output is not None and (
        output.shape[0] != n_embd or output.shape[1:] != embedding.shape[1:]
    ):
        raise GGUFValidationError(
            f"{path}: output.weight shape {list(output.shape)} is inconsistent"
        )
    present = {index for name in header.tensors if (index := layer_index(name)) is not None}
    missing = sorted(set(range(n_layers)) - present)
    extra = sorted(present - set(range(n_layers)))
    if missing:
        raise GGUFValidationError(
            f"{path}: block_count is {n_layers} but blocks {missing[:8]} have no tensors"
        )
    if extra:
        raise GGUFValidationError(
            f"{path}: block_count is {n_layers} but tensors exist for blocks {extra[:8]}"
        )
    if arch not in FAMILIES:
        # Without a known layout, a first norm per block is the least a decoder needs.
        for il in range(n_layers):
            name = f"blk.{il}.attn_norm.weight"
            norm = header.tensors.get(name)
            if norm is None:
                raise GGUFValidationError(
                    f"{path}: tensor {name!r} is missing", rule="tensor-missing", field=name
                )
            if norm.shape != (n_embd,):
                raise GGUFValidationError(
                    f"{path}: {name} does not have {n_embd} elements",
                    rule="tensor-shape",
                    field=name,
                )


_MAX_TOKEN_TYPE = 6  # llama_token_type: UNDEFINED=0 .. BYTE=6


def _check_vocabulary(header: GGUFHeader) -> None:
    """Vocabulary defects llama.cpp does not report but aborts the process on (e.g. duplicate
    token strings fail GGML_ASSERT(id_to_token.size() == token_to_id.size()))."""
    path = header.path
    entry = header.metadata.get("tokenizer.ggml.tokens")
    if entry is None:
        return
    tokens = entry.value
    if not isinstance(tokens, list) or not all(isinstance(token, str) for token in tokens):
        raise GGUFValidationError(f"{path}: tokenizer.ggml.tokens is not an array of strings")
    if len(set(tokens)) != len(tokens):
        raise GGUFValidationError(f"{path}: tokenizer.ggml.tokens holds duplicate token strings")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        parallel = header.metadata.get(key)
        if parallel is not None and (
            not isinstance(parallel.value, list) or len(parallel.value) != len(tokens)
        ):
            raise GGUFValidationError(f"{path}: {key} does not have one entry per token")
    token_types = header.metadata.get("tokenizer.ggml.token_type")
    if token_types is not None and isinstance(token_types.value, list):
        for value in token_types.value:
            if not isinstance(value, int) or not 0 <= value <= _MAX_TOKEN_TYPE:
                raise GGUFValidationError(f"{path}: tokenizer.ggml.token_type holds {value!r}")


def validate_header(header: GGUFHeader) -> GGUFHeader:
    """Check an already parsed header (see :func:`validate_gguf`); return it."""
    _check_model_structure(header)
    _check_vocabulary(header)
    family = FAMILIES.get(header.architecture)
    if family is not None:
        check_family(header, family)
    return header


def validate_gguf(path: str | os.PathLike[str]) -> GGUFHeader:
    """Check that ``path`` is a structurally sound GGUF model; return its parsed header.

    Raises GGUFValidationError (a ValueError) with a message naming the first problem found.
    """
    return validate_header(read_gguf_header(path))
