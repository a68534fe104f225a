"""A model's tokenizer through llama.cpp: :class:`Vocabulary` loads only the vocabulary of a
file (``vocab_only``: no weights), and :func:`tokenize` / :func:`token_piece` are the two calls
it shares with :class:`~shard_engine_llama._abi.ShardRuntime`.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from shard_engine_llama._llama_library import (
    InvalidInputError,
    ModelLoadError,
    ensure_backend,
    llama_cpp,
)

__all__ = ["Vocabulary", "token_piece", "tokenize"]


class Vocabulary:
    """A model's tokenizer alone (llama.cpp ``vocab_only``: no weights are loaded)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        ensure_backend()
        self.path = Path(path)
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        params.n_gpu_layers = 0
        model = llama_cpp.llama_model_load_from_file(os.fsencode(self.path), params)
        if not model:
            raise ModelLoadError(f"llama.cpp could not load the vocabulary of {self.path}")
        self._model: int | None = int(model)
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        kind = int(llama_cpp.llama_vocab_type(self._vocab))
        # Shard files carry tokenizer "none": nameless tokens that nothing can encode into.
        self.has_tokenizer = kind != llama_cpp.LLAMA_VOCAB_TYPE_NONE
        # Byte-level BPE: every byte of encoded text comes back, in order, from the pieces of
        # its tokens, unless llama.cpp dropped a piece it had no token for.
        self.byte_level = kind == llama_cpp.LLAMA_VOCAB_TYPE_BPE
        self._piece_lengths: npt.NDArray[np.int64] | None = None

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of ``text`` (with the model's BOS when ``add_special``)."""
        return tokenize(self._vocab, text, add_special)

    def piece_lengths(self) -> npt.NDArray[np.int64]:
        """How many bytes of text each token stands for (0 for control tokens); computed on
        first use, a llama_token_to_piece per token."""
        if self._piece_lengths is None:
            self._piece_lengths = np.fromiter(
                (
                    len(token_piece(self._vocab, token, special=False))
                    for token in range(self.n_vocab)
                ),
                dtype=np.int64,
                count=self.n_vocab,
            )
        return self._piece_lengths

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (invalid UTF-8 replaced)."""
        pieces: list[bytes] = []
        for token in token_ids:
            if not 0 <= token < self.n_vocab:
                raise InvalidInputError(f"token {token} outside the vocabulary of {self.n_vocab}")
            pieces.append(token_piece(self._vocab, token, special=False))
        return b"".join(pieces).decode("utf-8", errors="replace")

    def close(self) -> None:
        """Free the vocabulary; safe to call more than once."""
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:  # noqa: SIM105 - contextlib may be gone at interpreter shutdown
            self.close()
        except Exception:  # noqa: BLE001
            pass


def tokenize(vocab: object, text: str, add_special: bool) -> list[int]:
    """llama_tokenize, retried once with the capacity it asks for."""
    encoded = text.encode("utf-8")
    capacity = len(encoded) + 8
    for _ in range(2):
        tokens = (llama_cpp.llama_token * capacity)()
        count = int(
            llama_cpp.llama_tokenize(
                vocab, encoded, len(encoded), tokens, capacity, add_special, False
            )
        )
        if count >= 0:
            return [int(tokens[i]) for i in range(count)]
        capacity = -count
    raise InvalidInputError(f"llama_tokenize could not tokenize {len(encoded)} bytes")


def token_piece(vocab: object, token: int, *, special: bool) -> bytes:
    """llama_token_to_piece, retried once with the size it asks for."""
    size = 64
    for _ in range(2):
        buffer = ctypes.create_string_buffer(size)
        length = int(llama_cpp.llama_token_to_piece(vocab, token, buffer, size, 0, special))
        if length >= 0:
            return buffer.raw[:length]
        size = -length
    raise InvalidInputError(f"llama_token_to_piece failed for token {token}")
