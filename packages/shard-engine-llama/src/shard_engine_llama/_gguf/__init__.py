"""GGUF files without llama.cpp: a strict reader, validation, shard planning, shard writing, and
cached file digests. One module per concern:

- ``reader``: header parsing, every bound checked against the file;
- ``validation``: the checks that keep a file llama.cpp would abort on away from it;
- ``hyperparameters``: what llama.cpp's loader derives from a family's metadata;
- ``family_checks``: the family-aware checks ``validation`` runs (metadata, tensors);
- ``tokenizer_checks``: the vocabulary checks ``validation`` runs;
- ``planning``: shardability (the allow-list and its rules) and layer-range plans;
- ``families``: what each supported family needs, written once;
- ``writer``: shard metadata and tensors, streamed into new files, plus the manifest;
- ``integrity``: the sha256 every shard file carries of its own bytes, checked before use;
- ``store``: file digests cached per file identity.
"""

from shard_engine_llama._gguf.planning import (
    ALLOWED_ARCHITECTURES,
    GGUFModelInfo,
    ShardingRefusedError,
    inspect_gguf,
    model_info,
    parts_by_bytes,
)
from shard_engine_llama._gguf.reader import (
    GGUFHeader,
    GGUFValidationError,
    MetadataValue,
    TensorRecord,
    read_gguf_header,
)
from shard_engine_llama._gguf.validation import validate_gguf, validate_header
from shard_engine_llama._gguf.writer import (
    Manifest,
    ShardFile,
    SplitProgress,
    shard_file_name,
    split_model,
)

__all__ = [
    "ALLOWED_ARCHITECTURES",
    "GGUFHeader",
    "GGUFModelInfo",
    "GGUFValidationError",
    "Manifest",
    "MetadataValue",
    "ShardFile",
    "ShardingRefusedError",
    "SplitProgress",
    "TensorRecord",
    "inspect_gguf",
    "model_info",
    "parts_by_bytes",
    "read_gguf_header",
    "shard_file_name",
    "split_model",
    "validate_gguf",
    "validate_header",
]
