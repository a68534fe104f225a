"""The fake model's byte tokenizer, as worker code gets it (``load_tokenizer("fake", ...)``):
text round-trips, and what is not text or not a token id is InvalidRequest."""

from __future__ import annotations

import pytest

from shard_engine_api import InvalidRequest, load_tokenizer


def test_text_round_trips() -> None:
    tokenizer = load_tokenizer("fake", "fake")
    assert tokenizer is not None
    for text in ("hello", "héllo wörld", "日本語", "emoji \U0001f600", ""):
        assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("text", [b"hello", None, 5, ["a"], "ab\udcffcd", "\ud800"])
def test_what_is_not_utf8_text_is_invalid(text: object) -> None:
    tokenizer = load_tokenizer("fake", "fake")
    assert tokenizer is not None
    with pytest.raises(InvalidRequest, match="text to encode"):
        tokenizer.encode(text)  # type: ignore[arg-type]


@pytest.mark.parametrize("token", [-1, 2**31, 2**70, 1.0, True, "a", None])
def test_ids_that_are_not_token_ids_are_invalid(token: object) -> None:
    tokenizer = load_tokenizer("fake", "fake")
    assert tokenizer is not None
    with pytest.raises(InvalidRequest, match="is not a token id"):
        tokenizer.decode([104, token])  # type: ignore[list-item]


def test_ids_past_the_bytes_render_as_one_character_each() -> None:
    tokenizer = load_tokenizer("fake", "fake")
    assert tokenizer is not None
    assert len(tokenizer.decode([256, 300, 2**31 - 1])) == 3


@pytest.mark.parametrize("model", ["fake:layers=x", "fake:bogus=1", "fake:hidden=0", "/m.gguf"])
def test_a_reference_that_names_no_fake_model_is_invalid(model: str) -> None:
    """A typo in the model reference used to answer "this model has no tokenizer" (None), so
    worker code went on without one; loading the same reference is InvalidRequest."""
    with pytest.raises(InvalidRequest):
        load_tokenizer("fake", model)


def test_a_small_vocabulary_has_no_tokenizer() -> None:
    assert load_tokenizer("fake", "fake:vocab=100") is None
