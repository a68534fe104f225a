"""Names for code that moves contract objects between processes or machines: the msgpack codec,
its limits (string lengths, snapshot chunks, boundary dtypes, the field types a wire message
declares), how a payload is stored (its numpy dtype) and checksummed (and whether the C
extension does it), how a snapshot's state is cut into chunks, a snapshot's integrity check
and the error wire form.
``shard_engine_api`` itself holds the objects; this namespace holds how they travel."""

from shard_engine_api._checksum import (
    CHECKSUM_ALGORITHM,
    NATIVE_ENV,
    NATIVE_VECTOR,
    chunks_checksum,
    payload_checksum,
)
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
from shard_engine_api._dtypes import BOUNDARY_DTYPES
from shard_engine_api._errors import ErrorInfo, clamp_text, error_from_info
from shard_engine_api._snapshot import check_snapshot_integrity, split_chunks
from shard_engine_api._types import (
    MAX_DETAIL_CHARS,
    MAX_ID_CHARS,
    MAX_SNAPSHOT_CHUNKS,
    SNAPSHOT_CHUNK_BYTES,
    Count,
    Milliseconds,
    numpy_dtype,
)

__all__ = [
    "BOUNDARY_DTYPES",
    "CHECKSUM_ALGORITHM",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_DETAIL_CHARS",
    "MAX_ID_CHARS",
    "MAX_SNAPSHOT_CHUNKS",
    "NATIVE_ENV",
    "NATIVE_VECTOR",
    "SNAPSHOT_CHUNK_BYTES",
    "Codec",
    "Count",
    "ErrorInfo",
    "Milliseconds",
    "NonFinitePolicy",
    "WireMessage",
    "WireReply",
    "WireRequest",
    "check_snapshot_integrity",
    "chunks_checksum",
    "clamp_text",
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
    "numpy_dtype",
    "payload_checksum",
    "split_chunks",
]
