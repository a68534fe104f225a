"""Chat prompts for a GGUF model: the template its file stores (``tokenizer.chat_template``),
applied by llama.cpp's ``llama_chat_apply_template``.

llama.cpp runs no Jinja: it recognises the common template families (chatml, llama 2 and 3,
gemma, phi3, mistral and more) by markers in the template text and writes their format itself.
A model without a template, or with one llama.cpp does not recognise, is UnsupportedFeature,
never a guess. The templated text is tokenized with its turn markers as the model's special
tokens, and the model's end-of-generation tokens (llama.cpp's ``llama_vocab_is_eog``: EOS,
end of turn, ``<|im_end|>`` and its kin) end the assistant's turn.

Like ``_abi``, this module calls llama-cpp-python's bindings directly (the same pinned
release): it extends the vocabulary :class:`~shard_engine_llama._abi.Vocabulary` loaded, so
llama.cpp was imported, pinned and configured before any of its functions run here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shard_engine_api import ChatMessage, InvalidRequest, UnsupportedFeature
from shard_engine_llama.plugin import _VocabularyTokenizer

if TYPE_CHECKING:
    from shard_engine_llama._abi import Vocabulary

__all__ = ["ChatVocabularyTokenizer"]

TEMPLATE_KEY = "tokenizer.chat_template"
"""The GGUF metadata key of a model's chat template (what llama.cpp reads)."""


class ChatVocabularyTokenizer(_VocabularyTokenizer):
    """A GGUF model's tokenizer that also writes chat prompts in the model's own template (a
    :class:`shard_engine_api.ChatTokenizer`)."""

    def __init__(
        self,
        vocabulary: Vocabulary,
        max_text_bytes: int,
        unspellable: bytes = b"",
        *,
        model_name: str,
    ) -> None:
        super().__init__(vocabulary, max_text_bytes, unspellable)
        import llama_cpp

        # The vocabulary's own llama.cpp handles: the model (vocabulary only) and its vocab.
        self._model = vocabulary._model
        self._vocab = vocabulary._vocab
        self._name = model_name  # the vocabulary may have been loaded through a descriptor
        template = llama_cpp.llama_model_chat_template(self._model, None)
        self._template: bytes | None = bytes(template) if template else None
        self._end_of_turn: tuple[int, ...] | None = None

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> str:
        """``messages`` in the model's template with the assistant's turn opened. Raises
        UnsupportedFeature without a template llama.cpp applies, InvalidRequest for messages
        that are not ChatMessages of text (or hold a byte this vocabulary cannot spell)."""
        import llama_cpp

        template = self._require_template()
        encoded = [self._encoded(message) for message in _checked(messages)]
        chat = (llama_cpp.llama_chat_message * len(encoded))()
        for slot, (role, content) in zip(chat, encoded, strict=True):
            slot.role, slot.content = role, content
        size = 2 * sum(len(role) + len(content) for role, content in encoded) + 256
        for _ in range(2):
            buffer = ctypes.create_string_buffer(size)
            written = int(
                llama_cpp.llama_chat_apply_template(
                    template, chat, len(encoded), True, buffer, size
                )
            )
            if written < 0:
                raise UnsupportedFeature(
                    f"{self._name}: llama.cpp does not recognise this model's chat template "
                    f"({TEMPLATE_KEY}); it applies only the template families it knows",
                    details={"model": self._name},
                )
            if written <= size:
                return buffer.raw[:written].decode("utf-8", errors="replace")
            size = written
        raise UnsupportedFeature(f"{self._name}: llama.cpp's chat template output kept growing")

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The token ids of :meth:`apply_chat_template`, turn markers as special tokens."""
        text = self.apply_chat_template(messages)
        encoded = text.encode("utf-8")
        if len(encoded) > self.max_text_bytes:
            raise self._too_long(len(encoded), "bytes")
        tokens = _tokenize_special(self._vocab, encoded)
        # The model's BOS, added by llama.cpp where the model asks for one, once: a template
        # that writes BOS itself would otherwise start with two.
        import llama_cpp

        bos = int(llama_cpp.llama_vocab_bos(self._vocab))
        if len(tokens) > 1 and tokens[0] == tokens[1] == bos:
            del tokens[0]
        return tokens

    def end_of_turn_tokens(self) -> tuple[int, ...]:
        """Every token llama.cpp says ends a generation (EOS, end of turn, ...)."""
        self._require_template()
        if self._end_of_turn is None:
            import llama_cpp

            self._end_of_turn = tuple(
                token
                for token in range(self._vocabulary.n_vocab)
                if llama_cpp.llama_vocab_is_eog(self._vocab, token)
            )
        return self._end_of_turn

    def _require_template(self) -> bytes:
        if self._template is None:
            raise UnsupportedFeature(
                f"{self._name} has no chat template (no {TEMPLATE_KEY} in its GGUF metadata)",
                details={"model": self._name},
            )
        return self._template

    def _encoded(self, message: ChatMessage) -> tuple[bytes, bytes]:
        role, content = _utf8(message.role, "role"), _utf8(message.content, "content")
        found = set(content) & set(self.unspellable)
        if found:
            raise InvalidRequest(
                f"a chat message holds byte(s) this model's vocabulary has no token for "
                f"({bytes(sorted(found)).hex()}); llama.cpp would drop them",
                details={"unspellable_bytes": bytes(sorted(found)).hex()},
            )
        return role, content


def _checked(messages: object) -> list[ChatMessage]:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequest("a chat prompt needs a non-empty sequence of ChatMessage")
    checked: list[ChatMessage] = []
    for message in messages:
        if not isinstance(message, ChatMessage):
            raise InvalidRequest(f"a chat message must be a ChatMessage, got {message!r}")
        checked.append(message)
    return checked


def _utf8(text: object, field: str) -> bytes:
    if type(text) is not str:
        raise InvalidRequest(f"a chat message's {field} must be a str, got {text!r}")
    if "\x00" in text:
        # llama.cpp reads each field as a C string: it would end at the NUL.
        raise InvalidRequest(f"a chat message's {field} holds a NUL character")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequest(
            f"a chat message's {field} is not valid UTF-8 (a lone surrogate at character "
            f"{error.start})"
        ) from None


def _tokenize_special(vocab: object, encoded: bytes) -> list[int]:
    """llama_tokenize with special tokens parsed (a template's markers are control tokens),
    retried once with the capacity it asks for."""
    import llama_cpp

    capacity = len(encoded) + 8
    for _ in range(2):
        tokens = (llama_cpp.llama_token * capacity)()
        count = int(
            llama_cpp.llama_tokenize(vocab, encoded, len(encoded), tokens, capacity, True, True)
        )
        if count >= 0:
            return [int(tokens[i]) for i in range(count)]
        capacity = -count
    raise InvalidRequest(f"llama.cpp could not tokenize a chat prompt of {len(encoded)} bytes")
