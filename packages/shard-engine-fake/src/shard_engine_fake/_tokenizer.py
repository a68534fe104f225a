"""The fake model's byte-level tokenizer: enough for ``shard-engine run`` to print text.

Token ``b`` (``0 <= b < 256``) is the UTF-8 byte ``b``; the model needs a vocabulary of at least
256 to have a tokenizer. Ids from 256 up (which the model can generate but text never produces)
print as one printable ASCII character each, so any generated sequence renders.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

__all__ = ["BYTE_VOCAB_SIZE", "detokenize", "tokenize"]

BYTE_VOCAB_SIZE: Final = 256
_PRINTABLE_FIRST: Final = 0x20
_PRINTABLE_COUNT: Final = 0x7F - 0x20


def tokenize(text: str) -> list[int]:
    """The UTF-8 bytes of ``text`` as token ids."""
    return list(text.encode("utf-8"))


def detokenize(token_ids: Sequence[int]) -> str:
    """Text of ``token_ids``: byte ids decode as UTF-8 (invalid sequences become U+FFFD), higher
    ids as one printable ASCII character each."""
    data = bytearray()
    for token in token_ids:
        if 0 <= token < BYTE_VOCAB_SIZE:
            data.append(token)
        else:
            data.append(_PRINTABLE_FIRST + token % _PRINTABLE_COUNT)
    return data.decode("utf-8", errors="replace")
