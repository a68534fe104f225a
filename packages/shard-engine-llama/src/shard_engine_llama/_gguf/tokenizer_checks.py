"""Tokenizer checks: the vocabulary llama-vocab.cpp would load, refused where it would throw or
abort.

* ``metadata-type`` of the ``tokenizer.ggml.*`` keys and arrays (``TOKENIZER_KEYS``,
  ``TOKENIZER_ARRAYS``; ``family_checks`` checks them with every other key);
* ``tokenizer-model`` / ``tokenizer-merges`` / ``tokenizer-pre``: only the tokenizer models this
  package has exercised, BPE merges present, a pre-tokenizer llama.cpp knows and does not
  abort on;
* ``vocabulary-size`` / ``vocabulary-token-id`` / ``vocabulary-named-tokens``: a vocabulary to
  embed and score, special token ids inside it, and the tokens llama.cpp looks up by name.
"""

from __future__ import annotations

import gguf

from shard_engine_llama._gguf.families import Hyperparameters
from shard_engine_llama._gguf.hyperparameters import fail
from shard_engine_llama._gguf.reader import GGUFHeader

__all__ = ["TOKENIZER_ARRAYS", "TOKENIZER_KEYS", "check_tokenizer"]

_U32 = gguf.GGUFValueType.UINT32
_F32 = gguf.GGUFValueType.FLOAT32
_BOOL = gguf.GGUFValueType.BOOL
_STR = gguf.GGUFValueType.STRING
_I32 = gguf.GGUFValueType.INT32

TOKENIZER_KEYS: dict[str, gguf.GGUFValueType] = {
    "tokenizer.ggml.model": _STR,
    "tokenizer.ggml.pre": _STR,
    "tokenizer.ggml.bos_token_id": _U32,
    "tokenizer.ggml.eos_token_id": _U32,
    "tokenizer.ggml.unknown_token_id": _U32,
    "tokenizer.ggml.padding_token_id": _U32,
    "tokenizer.ggml.seperator_token_id": _U32,
    "tokenizer.ggml.eot_token_id": _U32,
    "tokenizer.ggml.eom_token_id": _U32,
    "tokenizer.ggml.cls_token_id": _U32,
    "tokenizer.ggml.mask_token_id": _U32,
    "tokenizer.ggml.prefix_token_id": _U32,
    "tokenizer.ggml.suffix_token_id": _U32,
    "tokenizer.ggml.middle_token_id": _U32,
    "tokenizer.ggml.fim_pre_token_id": _U32,
    "tokenizer.ggml.fim_suf_token_id": _U32,
    "tokenizer.ggml.fim_mid_token_id": _U32,
    "tokenizer.ggml.fim_pad_token_id": _U32,
    "tokenizer.ggml.fim_rep_token_id": _U32,
    "tokenizer.ggml.fim_sep_token_id": _U32,
    "tokenizer.ggml.token_type_count": _U32,
    "tokenizer.ggml.add_bos_token": _BOOL,
    "tokenizer.ggml.add_eos_token": _BOOL,
    "tokenizer.ggml.add_sep_token": _BOOL,
    "tokenizer.ggml.add_space_prefix": _BOOL,
    "tokenizer.ggml.remove_extra_whitespaces": _BOOL,
    "tokenizer.ggml.normalizer.lowercase": _BOOL,
    "tokenizer.ggml.normalizer.strip_accents": _BOOL,
}
# Arrays llama-vocab.cpp reads, with the element types it takes (any other throws "invalid gguf
# type"); the lengths are checked against the token list in validation.py.
TOKENIZER_ARRAYS: dict[str, tuple[gguf.GGUFValueType, ...]] = {
    "tokenizer.ggml.tokens": (_STR,),
    "tokenizer.ggml.scores": (_F32, _I32),
    "tokenizer.ggml.token_type": (_I32,),
    "tokenizer.ggml.merges": (_STR,),
    "tokenizer.ggml.suppress_tokens": (_I32,),
    "tokenizer.ggml.precompiled_charsmap": (gguf.GGUFValueType.INT8, gguf.GGUFValueType.UINT8),
}
# The pre-tokenizer names llama-vocab.cpp knows for a BPE (gpt2) vocabulary; any other throws
# "unknown pre-tokenizer type" (llama.cpp of llama-cpp-python 0.3.36). Those in
# _REFUSED_BPE_PRE_TOKENIZERS are known but refused.
_BPE_PRE_TOKENIZERS = frozenset(
    [
        "default",
        "kimi-k2",
        "minicpm5",
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
        "deepseek-llm",
        "deepseek-coder",
        "deepseek-v3",
        "spark2_5",
        "youtu",
        "falcon",
        "mpt",
        "starcoder",
        "gpt-2",
        "phi-2",
        "jina-es",
        "jina-de",
        "gigachat",
        "jina-v2-es",
        "jina-v2-de",
        "a.x-4.0",
        "mellum",
        "modern-bert",
        "jais-2",
        "gemma4",
        "granite-embed-multi-311m",
        "sarvam-moe",
        "jina-v1-en",
        "jina-v2-code",
        "roberta-bpe",
        "whitespace",
        "refact",
        "command-r",
        "qwen2",
        "deepseek-r1-qwen",
        "kormo",
        "f2llmv2",
        "qwen35",
        "stablelm2",
        "olmo",
        "dbrx",
        "smaug-bpe",
        "poro-chat",
        "chatglm-bpe",
        "glm4",
        "glm5",
        "viking",
        "jais",
        "tekken",
        "smollm",
        "codeshell",
        "bloom",
        "gpt3-finnish",
        "exaone",
        "exaone4",
        "exaone-moe",
        "chameleon",
        "minerva-7b",
        "megrez",
        "gpt-4o",
        "llama4",
        "kanana2",
        "talkie",
        "granite-embed-multi-97m",
        "tiny_aya",
        "cohere2moe",
        "superbpe",
        "trillion",
        "granite-docling",
        "bailingmoe",
        "bailingmoe2",
        "llada-moe",
        "seed-coder",
        "hunyuan",
        "hunyuan-dense",
        "hy_v4",
        "joyai-llm",
        "ufakzeka",
        "grok-2",
        "afmoe",
        "laguna",
        "minimax-m2",
        "solar-open",
        "mellum2",
    ]
)
# BPE merging looks pairs up in llama_vocab::find_bpe_rank, which asserts that neither half holds
# a space (GGML_ASSERT: aborts the process). Every other pre-tokenizer above hands it pieces
# without one: the GPT-2 byte encoding turns a space into "Ġ", and the pre-tokenizers that skip
# that encoding (gemma4, granite-embed-multi-311m, sarvam-moe) escape spaces to U+2581 first.
# "whitespace" does neither: it splits on \S+ without byte encoding, the runs of whitespace
# between the matches become pieces too, and two spaces in a row are a piece whose first merge
# aborts (probed: 91 pre-tokenizers x 49 texts, only this one aborted).
_REFUSED_BPE_PRE_TOKENIZERS: dict[str, str] = {
    "whitespace": (
        "leaves raw spaces in the pieces BPE merges (no byte encoding, no space escaping); "
        "llama.cpp aborts the process encoding any text with two whitespace characters in a "
        "row (GGML_ASSERT in find_bpe_rank)"
    ),
}
# Tokenizers whose loading this package has exercised; others are refused rather than guessed.
_TOKENIZER_MODELS = ("llama", "gpt2", "none")


def _check_tokenizer(header: GGUFHeader, h: Hyperparameters) -> None:
    """The tokenizer model, a BPE vocabulary's merges and pre-tokenizer, the vocabulary's size
    and the special token ids inside it."""
    model = header.metadata.get("tokenizer.ggml.model")
    if model is None:
        raise fail(header, "metadata-missing", "tokenizer.ggml.model", "required key is missing")
    if model.value not in _TOKENIZER_MODELS:
        raise fail(
            header,
            "tokenizer-model",
            "tokenizer.ggml.model",
            f"{model.value!r} is not one of {list(_TOKENIZER_MODELS)}",
        )
    if model.value == "gpt2":
        _check_bpe(header)
    if h.n_vocab < 1:
        # llama.cpp loads it: a head then refuses every token, and a tail returns logits with
        # no column to sample from.
        raise fail(
            header,
            "vocabulary-size",
            f"{header.architecture}.vocab_size"
            if model.value == "none"
            else "tokenizer.ggml.tokens",
            "the vocabulary is empty (a model needs a token to embed and to score)",
        )
    if model.value == "llama" and h.n_vocab < 3:
        raise fail(
            header,
            "vocabulary-size",
            "tokenizer.ggml.tokens",
            "a SentencePiece vocabulary needs at least <unk>, <s> and </s>",
        )
    for key in TOKENIZER_KEYS:
        if not key.endswith("_token_id"):
            continue
        entry = header.metadata.get(key)
        if entry is not None and isinstance(entry.value, int) and entry.value >= max(h.n_vocab, 1):
            if model.value == "none":
                continue
            raise fail(
                header,
                "vocabulary-token-id",
                key,
                f"{entry.value} outside the vocabulary of {h.n_vocab}",
            )


def _check_bpe(header: GGUFHeader) -> None:
    """A BPE (gpt2) vocabulary has merge strings and a pre-tokenizer llama.cpp knows and does
    not abort on."""
    merges = header.metadata.get("tokenizer.ggml.merges")
    if merges is None or merges.element_type != _STR:
        raise fail(
            header,
            "tokenizer-merges",
            "tokenizer.ggml.merges",
            "a BPE (gpt2) vocabulary needs an array of merge strings",
        )
    pre = header.metadata.get("tokenizer.ggml.pre")
    if pre is not None and isinstance(pre.value, str):
        refused = _REFUSED_BPE_PRE_TOKENIZERS.get(pre.value)
        if refused is not None:
            raise fail(header, "tokenizer-pre", "tokenizer.ggml.pre", f"{pre.value!r} {refused}")
    if pre is not None and pre.value not in _BPE_PRE_TOKENIZERS and pre.value != "":
        raise fail(
            header,
            "tokenizer-pre",
            "tokenizer.ggml.pre",
            f"{pre.value!r} is not a pre-tokenizer llama.cpp knows (it refuses the file)",
        )


# llama-vocab.cpp sets token attributes by general.name and looks these tokens up with .at(),
# which throws when one is missing.
_NAMED_VOCABULARY_TOKENS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("phi-3", "phi3"), ("</s>", "<unk>", "<s>", "<|endoftext|>")),
)


def _check_named_vocabulary(header: GGUFHeader) -> None:
    name = header.metadata.get("general.name")
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if name is None or not isinstance(name.value, str) or tokens is None:
        return
    lowered = name.value.lower()
    present = set(tokens.value) if isinstance(tokens.value, list) else set()
    for markers, needed in _NAMED_VOCABULARY_TOKENS:
        if any(marker in lowered for marker in markers):
            missing = [token for token in needed if token not in present]
            if missing:
                raise fail(
                    header,
                    "vocabulary-named-tokens",
                    "general.name",
                    f"a model named like {markers[0]!r} must have the tokens {missing} "
                    "(llama.cpp looks them up by name and refuses the file)",
                )


def check_tokenizer(header: GGUFHeader, h: Hyperparameters) -> None:
    """Run every tokenizer check on ``header`` (whose derived hyper-parameters are ``h``)."""
    _check_tokenizer(header, h)
    _check_named_vocabulary(header)
