"""Names for code that moves contract objects between processes or machines: the msgpack codec,
its limits, the payload checksum and the error wire form. ``shard_engine_api`` itself holds the
objects; this namespace holds how they travel."""

from shard_engine_api._checksum import CHECKSUM_ALGORITHM, chunks_checksum, payload_checksum
from shard_engine_api._codec import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    Codec,
    NonFinitePolicy,
    WireMessage,
    WireReply,
    WireRequest,
    decode_bundle,
    decode_error,
    decode_message,
    decode_reply,
    decode_request,
    encode,
    encode_bundle,
    encode_error,
    encode_into,
)
from shard_engine_api._errors import ErrorInfo, error_from_info

__all__ = [
    "CHECKSUM_ALGORITHM",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "Codec",
    "ErrorInfo",
    "NonFinitePolicy",
    "WireMessage",
    "WireReply",
    "WireRequest",
    "chunks_checksum",
    "decode_bundle",
    "decode_error",
    "decode_message",
    "decode_reply",
    "decode_request",
    "encode",
    "encode_bundle",
    "encode_error",
    "encode_into",
    "error_from_info",
    "payload_checksum",
]
