"""The fake model's byte-level tokenizer: enough for ``shard-engine run`` to print text.

Token ``b`` (``0 <= b < 256``) is the UTF-8 byte ``b``; the model needs a vocabulary of at least
256 to have a tokenizer. Ids from 256 up (which the model can generate but text never produces)
print as one printable ASCII character each, so any generated sequence renders.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from shard_engine_api import InvalidRequest

__all__ = ["BYTE_VOCAB_SIZE", "detokenize", "tokenize"]

BYTE_VOCAB_SIZE: Final = 256
_PRINTABLE_FIRST: Final = 0x20
_PRINTABLE_COUNT: Final = 0x7F - 0x20
_TOKEN_ID_MAX: Final = 2**31 - 1


def tokenize(text: str) -> list[int]:
    """The UTF-8 bytes of ``text`` as token ids. InvalidRequest for anything but a str, and for
    a str that is not valid UTF-8 (lone surrogates)."""
    if type(text) is not str:
        raise InvalidRequest(f"text to encode must be a str, got {type(text).__name__}")
    try:
        return list(text.encode("utf-8"))
    except UnicodeEncodeError as error:
        raise InvalidRequest(
            f"text to encode is not valid UTF-8 (a lone surrogate at character {error.start})"
        ) from None


def detokenize(token_ids: Sequence[int]) -> str:
    """Text of ``token_ids``: byte ids decode as UTF-8 (invalid sequences become U+FFFD), higher
    ids as one printable ASCII character each. InvalidRequest for an id that is not a token id
    (exactly int, in [0, 2**31))."""
    data = bytearray()
    for token in token_ids:
        if type(token) is not int or not 0 <= token <= _TOKEN_ID_MAX:
            raise InvalidRequest(f"token {token!r} is not a token id (int in [0, 2**31))")
        if token < BYTE_VOCAB_SIZE:
            data.append(token)
        else:
            data.append(_PRINTABLE_FIRST + token % _PRINTABLE_COUNT)
    return data.decode("utf-8", errors="replace")
