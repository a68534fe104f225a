"""Validation: is a parsed GGUF header a model llama.cpp can load without aborting?

llama.cpp trusts its input: some defects make it refuse the file, others abort the whole process
(``GGML_ASSERT``). Every check here runs before llama.cpp opens a file and raises
:class:`GGUFValidationError` naming the rule and the field.
"""

from __future__ import annotations

import os
import re

import gguf

from shard_engine_llama._gguf.families import (
    EMBEDDING_SCALE_HEAD_ONLY,
    FAMILIES,
    GEMMA3_27B_LAYER_COUNT,
    GEMMA3_ATTENTION_SCALE,
    NO_ROPE_STEP_PADDING,
    SWA_PATTERN_EXPLICIT,
)
from shard_engine_llama._gguf.family_checks import check_family
from shard_engine_llama._gguf.hyperparameters import LLAMA_MAX_LAYERS, uses_sliding_window
from shard_engine_llama._gguf.integrity import CONTENT_KEY
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
        raise GGUFValidationError(
            f"{path}: metadata key 'general.architecture' is missing",
            rule="metadata-missing",
            field="general.architecture",
        )
    arch = header.architecture
    n_layers = header.get_int(f"{arch}.block_count")
    n_embd = header.get_int(f"{arch}.embedding_length")
    if not 0 < n_layers <= LLAMA_MAX_LAYERS or n_embd <= 0:
        # Bounded before anything is sized by it (llama.cpp asserts the same bound).
        raise GGUFValidationError(
            f"{path}: block_count={n_layers}, embedding_length={n_embd} must be positive "
            f"(and block_count at most {LLAMA_MAX_LAYERS})",
            rule="hparam-block-count" if n_embd > 0 else "hparam-embedding-length",
            field=f"{arch}.block_count" if n_embd > 0 else f"{arch}.embedding_length",
        )
    for required in ("token_embd.weight", "output_norm.weight"):
        if required not in header.tensors:
            raise GGUFValidationError(
                f"{path}: required tensor {required!r} is missing",
                rule="tensor-missing",
                field=required,
            )
    embedding = header.tensors["token_embd.weight"]
    if len(embedding.shape) != 2 or embedding.shape[0] != n_embd:
        raise GGUFValidationError(
            f"{path}: token_embd.weight has shape {list(embedding.shape)}, "
            f"expected [{n_embd}, vocab]",
            rule="tensor-shape",
            field="token_embd.weight",
        )
    if header.tensors["output_norm.weight"].shape != (n_embd,):
        raise GGUFValidationError(
            f"{path}: output_norm.weight does not have {n_embd} elements",
            rule="tensor-shape",
            field="output_norm.weight",
        )
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if (
        tokens is not None
        and isinstance(tokens.value, list)
        and len(tokens.value) != embedding.shape[1]
    ):
        raise GGUFValidationError(
            f"{path}: tokenizer has {len(tokens.value)} tokens but token_embd.weight has "
            f"{embedding.shape[1]} rows",
            rule="vocabulary-size",
            field="tokenizer.ggml.tokens",
        )
    output = header.tensors.get("output.weight")
    if output is not None and (
        output.shape[0] != n_embd or output.shape[1:] != embedding.shape[1:]
    ):
        raise GGUFValidationError(
            f"{path}: output.weight shape {list(output.shape)} is inconsistent",
            rule="tensor-shape",
            field="output.weight",
        )
    present = {index for name in header.tensors if (index := layer_index(name)) is not None}
    missing = sorted(set(range(n_layers)) - present)
    extra = sorted(present - set(range(n_layers)))
    if missing:
        raise GGUFValidationError(
            f"{path}: block_count is {n_layers} but blocks {missing[:8]} have no tensors",
            rule="tensor-missing",
            field=f"blk.{missing[0]}",
        )
    if extra:
        raise GGUFValidationError(
            f"{path}: block_count is {n_layers} but tensors exist for blocks {extra[:8]}",
            rule="tensor-unexpected",
            field=f"blk.{extra[0]}",
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


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_MAX_TOKEN_TYPE = 6  # llama_token_type: UNDEFINED=0 .. BYTE=6
_BYTE_TOKEN_TYPE = 6
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Bytes that occur in UTF-8 (0xC0, 0xC1 and 0xF5..0xFF never do).
_UTF8_BYTES = tuple(byte for byte in range(256) if byte not in (0xC0, 0xC1) and byte < 0xF5)


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (llama.cpp's unicode_byte_to_utf8)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    alphabet = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in alphabet:
            alphabet[byte] = chr(256 + shifted)
            shifted += 1
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


def _check_vocabulary(header: GGUFHeader) -> None:
    """Vocabulary defects llama.cpp does not report but aborts the process on (e.g. duplicate
    token strings fail GGML_ASSERT(id_to_token.size() == token_to_id.size()))."""
    path = header.path
    entry = header.metadata.get("tokenizer.ggml.tokens")
    if entry is None:
        return
    tokens = entry.value
    if not isinstance(tokens, list) or not all(isinstance(token, str) for token in tokens):
        raise GGUFValidationError(
            f"{path}: tokenizer.ggml.tokens is not an array of strings",
            rule="metadata-type",
            field="tokenizer.ggml.tokens",
        )
    # llama-vocab.cpp renames an empty token to "[EMPTY_<id>]" before indexing the strings, so
    # the duplicate check is on those names.
    names = [token or f"[EMPTY_{index}]" for index, token in enumerate(tokens)]
    if len(set(names)) != len(names):
        raise GGUFValidationError(
            f"{path}: tokenizer.ggml.tokens holds duplicate token strings",
            rule="vocabulary-duplicate-tokens",
            field="tokenizer.ggml.tokens",
        )
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        parallel = header.metadata.get(key)
        if parallel is not None and (
            not isinstance(parallel.value, list) or len(parallel.value) != len(tokens)
        ):
            raise GGUFValidationError(
                f"{path}: {key} does not have one entry per token",
                rule="vocabulary-arrays",
                field=key,
            )
    token_types = header.metadata.get("tokenizer.ggml.token_type")
    if token_types is not None and isinstance(token_types.value, list):
        for index, value in enumerate(token_types.value):
            if not isinstance(value, int) or not 0 <= value <= _MAX_TOKEN_TYPE:
                raise GGUFValidationError(
                    f"{path}: tokenizer.ggml.token_type holds {value!r}",
                    rule="vocabulary-token-type",
                    field="tokenizer.ggml.token_type",
                )
            if value == _BYTE_TOKEN_TYPE and not _BYTE_TOKEN.fullmatch(str(tokens[index])):
                # token_to_byte reads the byte from the text's characters 3..4 (substr throws
                # on a shorter one while llama.cpp builds its piece cache).
                raise GGUFValidationError(
                    f"{path}: token {index} ({tokens[index]!r}) is typed BYTE but is not of the "
                    "form <0xHH>",
                    rule="vocabulary-byte-token",
                    field="tokenizer.ggml.tokens",
                )


def unspellable_bytes(header: GGUFHeader) -> bytes:
    """The bytes of UTF-8 text this file's vocabulary has no token for, in ascending order
    (empty when it can spell every byte, or has no vocabulary llama.cpp tokenizes with).

    Text reaches llama_tokenize as UTF-8, whose bytes a vocabulary must be able to spell.
    SentencePiece ("llama") falls back to "<0xHH>" (then the byte itself) looked up with .at():
    a byte with neither throws out of llama_tokenize and terminates the process. Byte-level BPE
    ("gpt2") starts from one token per byte's printable stand-in and drops, without a word, any
    piece it has no token for ("Hello" became no tokens at all)."""
    entry = header.metadata.get("tokenizer.ggml.tokens")
    if entry is None or not isinstance(entry.value, list):
        return b""
    present = {token or f"[EMPTY_{index}]" for index, token in enumerate(entry.value)}
    model = header.metadata.get("tokenizer.ggml.model")
    kind = model.value if model is not None else None
    if kind == "llama":
        return bytes(
            byte
            for byte in _UTF8_BYTES
            if f"<0x{byte:02X}>" not in present and not (byte < 128 and chr(byte) in present)
        )
    if kind == "gpt2":
        return bytes(byte for byte in _UTF8_BYTES if _BYTE_LEVEL[byte] not in present)
    return b""


def _check_byte_tokens(header: GGUFHeader) -> None:
    """A SentencePiece vocabulary can spell every byte of UTF-8 text (after the family's
    tokenizer checks, which name a more specific rule first): llama.cpp aborts tokenizing text
    with a byte it cannot spell. A byte-level BPE vocabulary that cannot spell some bytes is
    accepted (SmolLM2's has no token for eight control bytes): llama.cpp would silently drop
    them, so the model's tokenizer refuses text containing one (see :func:`unspellable_bytes`)."""
    model = header.metadata.get("tokenizer.ggml.model")
    if model is None or model.value != "llama":
        return
    missing = unspellable_bytes(header)
    if missing:
        raise GGUFValidationError(
            f"{header.path}: the llama vocabulary has no token for {len(missing)} byte(s) of "
            f"UTF-8 text ({describe_bytes(missing)}); llama.cpp aborts tokenizing text that "
            "needs one",
            rule="vocabulary-byte-tokens",
            field="tokenizer.ggml.tokens",
        )


def describe_bytes(values: bytes, limit: int = 8) -> str:
    """``0x04, 0x06, ... (+3 more)``: bytes named for a message."""
    named = ", ".join(f"0x{byte:02X}" for byte in values[:limit])
    return named + (f" (+{len(values) - limit} more)" if len(values) > limit else "")


# gguf-split's keys, with the types llama_model_loader reads them as (GGUFMeta's get_key throws
# on any other type: "key split.count has wrong type u32 but expected type u16").
_SPLIT_KEYS: dict[str, gguf.GGUFValueType] = {
    "split.no": gguf.GGUFValueType.UINT16,
    "split.count": gguf.GGUFValueType.UINT16,
    "split.tensors.count": gguf.GGUFValueType.INT32,
}


def _check_split_keys(header: GGUFHeader) -> None:
    """A file of a gguf-split set is not a model on its own: with ``split.count`` above 1
    llama.cpp's loader opens the other parts by name (``<prefix>-0000N-of-0000M.gguf`` next to
    it), which this package neither validates nor pins, and refuses the file without them."""
    for key, expected in _SPLIT_KEYS.items():
        entry = header.metadata.get(key)
        if entry is not None and entry.value_type != expected:
            raise GGUFValidationError(
                f"{header.path}: {key}: has GGUF type {entry.value_type.name}, llama.cpp reads "
                f"it as {expected.name}",
                rule="metadata-type",
                field=key,
            )
    count = header.metadata.get("split.count")
    if count is not None and isinstance(count.value, int) and count.value > 1:
        raise GGUFValidationError(
            f"{header.path}: split.count: {count.value}: the file is one part of a gguf-split "
            "model, whose other parts llama.cpp would open by name; merge the parts "
            "(llama-gguf-split --merge) and load the merged file",
            rule="gguf-split",
            field="split.count",
        )


def validate_header(header: GGUFHeader) -> GGUFHeader:
    """Check an already parsed header (see :func:`validate_gguf`); return it."""
    _check_model_structure(header)
    _check_split_keys(header)
    _check_vocabulary(header)
    family = FAMILIES.get(header.architecture)
    if family is not None:
        check_family(header, family)
    _check_byte_tokens(header)
    if header.is_shard:
        _check_shard_keys(header)
    return header


_SHARD_KEYS: dict[str, gguf.GGUFValueType] = {
    "shard.start": gguf.GGUFValueType.UINT32,
    "shard.end": gguf.GGUFValueType.UINT32,
    "shard.n_layers_total": gguf.GGUFValueType.UINT32,
    "shard.role": gguf.GGUFValueType.STRING,
    "shard.has_identity_block": gguf.GGUFValueType.BOOL,
    "shard.source_sha256": gguf.GGUFValueType.STRING,
}


def _check_shard_keys(header: GGUFHeader) -> None:
    """The shard.* keys decide which graph tensor a runtime captures: they must describe the
    file's own blocks, or a shard would return the wrong layer (or none)."""
    path = header.path

    def fail(field: str, message: str) -> GGUFValidationError:
        return GGUFValidationError(f"{path}: {field}: {message}", rule="shard-keys", field=field)

    for key, expected in _SHARD_KEYS.items():
        entry = header.metadata.get(key)
        if entry is None or entry.value_type != expected:
            raise fail(key, f"missing or not of type {expected.name}")
    start = header.get_int("shard.start")
    end = header.get_int("shard.end")
    total = header.get_int("shard.n_layers_total")
    if not 0 <= start < end <= total <= LLAMA_MAX_LAYERS:
        raise fail("shard.end", f"range [{start}, {end}) of {total} layers is not a layer range")
    expected_role = (
        ("full" if end == total else "head")
        if start == 0
        else ("tail" if end == total else "middle")
    )
    if header.get_str("shard.role") != expected_role:
        raise fail("shard.role", f"[{start}, {end}) of {total} is a {expected_role} range")
    identity = bool(header.metadata["shard.has_identity_block"].value)
    if identity != (expected_role in ("head", "middle")):
        raise fail("shard.has_identity_block", f"wrong for a {expected_role} shard")
    for key in ("shard.source_sha256", CONTENT_KEY):
        entry = header.metadata.get(key)
        if entry is not None and not (
            isinstance(entry.value, str) and _SHA256_HEX.fullmatch(entry.value)
        ):
            # The source digest is the fingerprint the shard reports as the model's.
            raise fail(key, f"{entry.value!r} is not a sha256 hex digest")
    vocab_entry = header.metadata.get("shard.source_vocab_size")
    if vocab_entry is not None:
        vocab = vocab_entry.value
        if vocab_entry.value_type != gguf.GGUFValueType.UINT32 or not (
            isinstance(vocab, int) and vocab > 0
        ):
            raise fail("shard.source_vocab_size", f"{vocab!r} is not a positive UINT32")
        embedding = header.tensors.get("token_embd.weight")
        rows = embedding.shape[1] if embedding is not None and len(embedding.shape) == 2 else 0
        if expected_role != "middle" and vocab != rows:
            # A head embeds, a tail scores, the whole vocabulary: the size reported is theirs.
            raise fail(
                "shard.source_vocab_size",
                f"{vocab} differs from the {rows} vocabulary rows of this {expected_role} shard",
            )
    padding_entry = header.metadata.get("shard.leading_identity_blocks")
    padding = padding_entry.value if padding_entry is not None else 0
    if isinstance(padding, bool) or not isinstance(padding, int) or not 0 <= padding < 8:
        raise fail("shard.leading_identity_blocks", f"{padding!r} is not a small count")
    blocks = header.get_int(f"{header.architecture}.block_count")
    if blocks != padding + end - start + (1 if identity else 0):
        raise fail(
            f"{header.architecture}.block_count",
            f"{blocks} blocks do not hold {padding} leading identity block(s), layers "
            f"[{start}, {end}) and {'an' if identity else 'no'} identity block",
        )
    _check_shard_rules(header, start, end, total, padding, expected_role)


def _check_shard_rules(
    header: GGUFHeader, start: int, end: int, total: int, padding: int, role: str
) -> None:
    """A shard computes its layers as the full model does only if its file carries the rewrites
    its family's shard rules make (see families.py). split writes them; a shard re-sealed
    without one (or of a family that cannot be split) would load and compute other numbers."""
    arch = header.architecture
    family = FAMILIES.get(arch)
    if family is None or role == "full":
        return

    def fail(rule: str, field: str, message: str) -> GGUFValidationError:
        return GGUFValidationError(
            f"{header.path}: {field}: {message} (shard rule {rule})", rule=rule, field=field
        )

    if family.refusal is not None and role != "head":
        raise fail(
            family.refusal.split(":", 1)[0],
            "general.architecture",
            f"a {role} shard of {arch} cannot compute its layers exactly",
        )
    step = family.no_rope_step
    if padding != (start % step if step else 0):
        raise fail(
            NO_ROPE_STEP_PADDING.name,
            "shard.leading_identity_blocks",
            f"{padding} leading identity block(s) in front of layer {start}; "
            + (
                f"{arch} needs {start % step} to keep every layer's index modulo {step}"
                if step
                else f"{arch} has no layer-index rule that needs any"
            ),
        )
    if EMBEDDING_SCALE_HEAD_ONLY in family.rules and role in ("middle", "tail"):
        key = f"{arch}.embedding_scale"
        entry = header.metadata.get(key)
        if entry is None or entry.value != 0:
            raise fail(
                EMBEDDING_SCALE_HEAD_ONLY.name,
                key,
                f"is {entry.value if entry is not None else 'absent'!r}; a {role} shard needs 0, "
                "or llama.cpp multiplies the hidden states it receives",
            )
    if SWA_PATTERN_EXPLICIT in family.rules and uses_sliding_window(header):
        key = f"{arch}.attention.sliding_window_pattern"
        entry = header.metadata.get(key)
        if entry is None or entry.value_type != gguf.GGUFValueType.ARRAY:
            raise fail(
                SWA_PATTERN_EXPLICIT.name,
                key,
                "a shard needs the model's per-layer pattern as an array; without it llama.cpp "
                "applies the default period to the shard's renumbered layers",
            )
    if GEMMA3_ATTENTION_SCALE in family.rules:
        blocks = header.get_int(f"{arch}.block_count")
        if (total == GEMMA3_27B_LAYER_COUNT) != (blocks == GEMMA3_27B_LAYER_COUNT):
            raise fail(
                GEMMA3_ATTENTION_SCALE.name,
                f"{arch}.block_count",
                f"{blocks} blocks of a {total}-layer model: llama.cpp picks the attention scale "
                "from the block count, so the shard would use another one than the model",
            )


def validate_gguf(path: str | os.PathLike[str]) -> GGUFHeader:
    """Check that ``path`` is a structurally sound GGUF model; return its parsed header.

    Raises GGUFValidationError (a ValueError) with a message naming the first problem found.
    """
    return validate_header(read_gguf_header(path))
