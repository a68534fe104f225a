"""The ``llama`` engine plugin: the one registration hook and the callables its description
names. llama.cpp itself is imported only when an engine or a tokenizer is really needed."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

import msgspec
import numpy as np

from shard_engine_api import (
    InvalidRequest,
    OptionValue,
    ShardEngine,
    ShardMismatch,
    UnsupportedFeature,
)
from shard_engine_api.engine import (
    EngineDescription,
    ModelFixture,
    Tokenizer,
    hookimpl,
    model_store,
)
from shard_engine_llama import _commands
from shard_engine_llama._fixtures import TINY_MODEL_LAYERS, tiny_model_path

if TYPE_CHECKING:
    from shard_engine_llama._abi import Vocabulary

ENGINE_NAME = "llama"

MODEL_ENV = "SHARD_ENGINE_LLAMA_MODEL"
"""A GGUF path that replaces the generated tiny model (e.g. for certification on a real model)."""


def _new_engine() -> ShardEngine:
    from shard_engine_llama._engine import LlamaEngine

    return LlamaEngine()


def _model_fixture(workdir: Path) -> ModelFixture:
    real_model = os.environ.get(MODEL_ENV)
    if real_model:
        described = _describe_model(real_model)
        return msgspec.structs.replace(
            described,
            options={"n_ubatch": 16},
            crash_options=_CRASH_OPTIONS,
            splits=_uneven_splits(described.n_layers),
        )
    # The store check: the tiny model is written there, and never under /home.
    path = tiny_model_path(model_store(workdir))
    return ModelFixture(
        model=str(path),
        n_layers=TINY_MODEL_LAYERS,
        options={"n_ubatch": 16},
        description=f"generated tiny llama GGUF ({TINY_MODEL_LAYERS} layers, n_embd 64, F32)",
        has_tokenizer=True,
        synthetic=True,
        crash_options=_CRASH_OPTIONS,
        cancel_options=_CANCEL_OPTIONS,
        splits=_uneven_splits(TINY_MODEL_LAYERS),
    )


_CANCEL_OPTIONS: dict[str, OptionValue] = {"n_ubatch": 16, "slow_forward_us": 200}
"""The conformance suite's cancellation tests: a forward of the tiny model takes a few
milliseconds, over before a cancel from another thread lands; sleeping before every graph
node's abort check stretches it (4 micro-batches of 16 rows: about 0.14 s for 64 tokens) while
the cancel still goes through llama.cpp's own abort callback."""

_CRASH_OPTIONS: dict[str, OptionValue] = {"inject_crash": True}
"""The conformance suite's crash test: the next forward fails as a backend crash would."""


def _uneven_splits(n_layers: int) -> tuple[tuple[int, ...], ...]:
    """Pipelines with one-layer heads, middles and tails (when the model is deep enough)."""
    if n_layers < 3:
        return ()
    return ((0, 1, n_layers), (0, n_layers - 1, n_layers), (0, 1, n_layers - 1, n_layers))


def _describe_model(model: str) -> ModelFixture:
    from shard_engine_llama._gguf import GGUFValidationError, model_info, validate_gguf

    path = Path(model)
    if not path.is_file():
        raise InvalidRequest(f"model file {path} does not exist")
    try:
        header = validate_gguf(path)
    except GGUFValidationError as error:
        raise InvalidRequest(str(error)) from error
    info = model_info(header)
    if info.is_shard:
        # The commands split the model they are given; a shard file holds one range only (and
        # no tokenizer): said first, before anything it lacks is missed.
        start, end, total = (
            int(header.get_int(f"shard.{key}")) for key in ("start", "end", "n_layers_total")
        )
        raise ShardMismatch(
            f"{path.name} is a shard file (layers [{start}, {end}) of a {total}-layer model, "
            "written by split); give the full model as --model: the engine splits it itself",
            details={"path": str(path), "start": start, "end": end, "n_layers": total},
        )
    if not info.shardable:
        raise UnsupportedFeature(f"{path.name} cannot be sharded: {info.refusal}")
    return ModelFixture(
        model=str(path.resolve()),
        n_layers=info.n_layers,
        description=f"{path.name} ({info.architecture}, {info.n_layers} layers)",
        has_tokenizer=True,
        synthetic=False,
    )


ENCODE_BYTES_PER_TOKEN: Final = 4
"""How many UTF-8 bytes of text the model tokenizer's ``encode`` takes per position of the
model's context (English averages about four bytes a token): see :func:`max_encode_bytes`."""
MIN_ENCODE_CONTEXT: Final = 8192
"""The context assumed for a model that declares a shorter one (or none)."""


def max_encode_bytes(context_length: int) -> int:
    """The longest text (UTF-8 bytes) the tokenizer of a model trained on ``context_length``
    positions encodes: ``ENCODE_BYTES_PER_TOKEN`` bytes per position of that context (at least
    MIN_ENCODE_CONTEXT), e.g. 128 KiB for gemma3's 32768. A prompt longer than that would not fit
    an engine's context anyway, and llama.cpp's tokenizer costs time in the square of the
    tokens it falls back to single bytes for (1 MB of text: minutes), so longer text is refused
    before it reaches llama.cpp."""
    return max(context_length, MIN_ENCODE_CONTEXT) * ENCODE_BYTES_PER_TOKEN


class _VocabularyTokenizer:
    """A GGUF model's own tokenizer, through llama.cpp (vocabulary only, no weights). Text
    longer than ``max_text_bytes`` is InvalidRequest (see :func:`max_encode_bytes`), and so is
    text with a byte the vocabulary has no token for (``unspellable``), which llama.cpp would
    drop without a word."""

    def __init__(
        self, vocabulary: Vocabulary, max_text_bytes: int, unspellable: bytes = b""
    ) -> None:
        self._vocabulary = vocabulary
        self.max_text_bytes = max_text_bytes
        self.unspellable = unspellable

    def encode(self, text: str) -> list[int]:
        if type(text) is not str:
            raise InvalidRequest(f"text to encode must be a str, got {type(text).__name__}")
        # Every character is at least one byte: an over-long text is refused before it is even
        # encoded.
        if len(text) > self.max_text_bytes:
            raise self._too_long(len(text), "characters")
        try:
            encoded = text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise InvalidRequest(
                f"text to encode is not valid UTF-8 (a lone surrogate at character {error.start})"
            ) from None
        if len(encoded) > self.max_text_bytes:
            raise self._too_long(len(encoded), "bytes")
        if self.unspellable and len(encoded.translate(None, self.unspellable)) != len(encoded):
            from shard_engine_llama._gguf.validation import describe_bytes

            found = bytes(sorted(set(encoded) & set(self.unspellable)))
            at = min(encoded.index(byte) for byte in found)
            raise InvalidRequest(
                f"text to encode holds byte(s) this model's vocabulary has no token for "
                f"({describe_bytes(found)}, first at byte {at}); llama.cpp would drop them",
                details={"unspellable_bytes": found.hex(), "offset": at},
            )
        tokens = self._vocabulary.tokenize(text)
        if self._vocabulary.byte_level:
            # Byte-level BPE also drops a merged piece that is not a token (a file whose merges
            # make strings its vocabulary lacks): whatever the cause, the tokens must spell
            # every byte of the text.
            lengths = self._vocabulary.piece_lengths()
            spelled = int(lengths[np.asarray(tokens, dtype=np.intp)].sum())
            if spelled != len(encoded):
                raise InvalidRequest(
                    f"this model's tokenizer spells {spelled} of the text's {len(encoded)} bytes "
                    "(llama.cpp dropped pieces its vocabulary has no token for); refused rather "
                    "than encoded short",
                    details={"text_bytes": len(encoded), "spelled_bytes": spelled},
                )
        return tokens

    def _too_long(self, size: int, unit: str) -> InvalidRequest:
        return InvalidRequest(
            f"text to encode is {size} {unit} long; this model's tokenizer takes at most "
            f"{self.max_text_bytes} bytes ({ENCODE_BYTES_PER_TOKEN} per position of its context)",
            details={"text_size": size, "unit": unit, "limit_bytes": self.max_text_bytes},
        )

    def decode(self, token_ids: Sequence[int]) -> str:
        ids = list(token_ids)
        n_vocab = self._vocabulary.n_vocab
        for token in ids:
            # Exactly int (llama.cpp would read a float or a numpy scalar's bits as an id).
            if type(token) is not int or not 0 <= token < n_vocab:
                raise InvalidRequest(
                    f"token {token!r} is not an id of this vocabulary (int in [0, {n_vocab}))"
                )
        return self._vocabulary.detokenize(ids)


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str) -> Tokenizer | None:
    """The tokenizer of the GGUF file ``model``, after the file passed the same validation as
    an engine load: llama.cpp's vocabulary loader aborts the process on some malformed
    vocabularies (duplicate tokens, for one), and a tokenizer is loaded by worker code
    directly. The file is opened once and validated and loaded through that descriptor."""
    # Imported here: llama_cpp loads only when a tokenizer is really needed.
    from shard_engine_llama._abi import ModelLoadError, Vocabulary
    from shard_engine_llama._gguf import GGUFValidationError
    from shard_engine_llama._gguf.validation import unspellable_bytes
    from shard_engine_llama._shard_files import PinnedFiles

    if type(model) is not str or not model or "\x00" in model:
        raise InvalidRequest(f"model must be a GGUF path, got {model!r}")
    pins = PinnedFiles()
    try:
        pinned, header = pins.open_validated(Path(model))
        try:
            context_length = header.get_int(f"{header.architecture}.context_length")
        except GGUFValidationError:
            context_length = 0
        vocabulary = Vocabulary(pinned)
    except GGUFValidationError as error:
        raise pins.refusal(error) from error
    except ModelLoadError as error:
        raise InvalidRequest(pins.named(str(error))) from error
    except OSError as error:
        raise InvalidRequest(f"cannot read model {model!r}: {pins.named(str(error))}") from error
    finally:
        # llama.cpp holds its own descriptor by now.
        pins.close()
    if not vocabulary.has_tokenizer:
        return None
    # Validation refused a SentencePiece vocabulary that cannot spell every byte: only a
    # byte-level one can have bytes to refuse.
    unspellable = unspellable_bytes(header) if vocabulary.byte_level else b""
    # With the model's chat template, when it has one (shard_engine_api.ChatTokenizer).
    from shard_engine_llama._chat import ChatVocabularyTokenizer

    return ChatVocabularyTokenizer(
        vocabulary, max_encode_bytes(context_length), unspellable, model_name=Path(model).name
    )


@hookimpl
def shard_engine_register() -> EngineDescription:
    return EngineDescription(
        name=ENGINE_NAME,
        factory=_new_engine,
        evidence="real",
        summary="llama.cpp (llama-cpp-python, CPU) running GGUF layer ranges bit-exactly",
        model_fixture=_model_fixture,
        describe_model=_describe_model,
        tokenizer=_tokenizer,
        add_cli_commands=_commands.add_commands,
    )
