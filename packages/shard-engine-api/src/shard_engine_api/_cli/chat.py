"""``run --chat``: the prompt as one user message in the model's own chat template, the
assistant's turn opened, the generation ending at the model's end-of-turn tokens. The template
is the tokenizer's to apply (:class:`~shard_engine_api.ChatTokenizer`); an engine whose
tokenizer applies none is refused before any shard is loaded."""

from __future__ import annotations

from collections.abc import Callable

from shard_engine_api._errors import UnsupportedFeature
from shard_engine_api._hookspecs import ChatMessage, ChatTokenizer, Tokenizer

__all__ = ["chat_tokenizer", "user_turn"]


def chat_tokenizer(engine: str, found: Tokenizer | None) -> ChatTokenizer:
    """The tokenizer as a ChatTokenizer, else UnsupportedFeature naming why."""
    if isinstance(found, ChatTokenizer):
        return found
    why = (
        f"engine {engine!r} has no tokenizer for this model"
        if found is None
        else f"the tokenizer of engine {engine!r} applies no chat template"
    )
    raise UnsupportedFeature(
        f"argument --chat: {why}; run without --chat (chat models: a GGUF with a "
        "tokenizer.chat_template, on the llama engine)",
        details={"engine": engine},
    )


def user_turn(tokenizer: ChatTokenizer) -> Callable[[str], list[int]]:
    """Prompt text to token ids: one user message, the assistant's turn opened."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode_chat([ChatMessage(role="user", content=text)])

    return encode
