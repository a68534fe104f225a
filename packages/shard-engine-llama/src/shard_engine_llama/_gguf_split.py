"""GGUF validation, inspection and layer-range shard building.

llama.cpp has no API to run a window of layers, so a shard is a rewritten GGUF file that contains
only its layers (renumbered from 0) and is loaded as an ordinary model. The rules that make a shard
compute exactly what the same layers compute inside the full model live here:

* ``token_embd.weight`` and ``output_norm.weight`` are required by the loader in every shard;
  ``output.weight`` only matters on the tail. Middle shards carry no vocabulary (tokenizer "none",
  one token, a 1 x n_embd zero embedding).
* llama.cpp keeps only the output rows inside the *last* layer of a graph. A non-tail shard asks
  for no outputs and appends one exact-identity block (zero weights, unit norms), so the residual
  stream after its last real layer (``l_out-<last real>``) still holds every row.
* Per-layer metadata arrays are sliced to the shard; layer-index rules (gemma3 sliding-window
  pattern) are written out explicitly for the full model and then sliced.
* Only architectures whose graph is known to be shard-safe are allowed; everything else is refused
  naming the rule.

Nothing here imports llama.cpp: a GGUF file is parsed by a small strict reader (bounds-checked,
so a truncated or corrupt file is refused before it could reach llama.cpp's loader) and written
with ``gguf.GGUFWriter``, tensor bytes streamed from the source file in chunks.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

__all__ = [
    "ALLOWED_ARCHITECTURES",
    "GGUFHeader",
    "GGUFValidationError",
    "Manifest",
    "MetadataValue",
    "ModelInfo",
    "ModelStoreError",
    "ShardFile",
    "ShardingRefusedError",
    "SplitProgress",
    "TensorRecord",
    "inspect_gguf",
    "parts_by_bytes",
    "read_gguf_header",
    "resolve_model_store",
    "shard_file_name",
    "split_model",
    "validate_gguf",
]

ALLOWED_ARCHITECTURES: tuple[str, ...] = ("gemma3", "llama", "qwen2", "qwen3")

# These scale the embedding input inside the graph whether it came from token ids or from
# ``batch.embd``, so a non-head shard would rescale the hidden states it receives.
_EMBEDDING_SCALED_ARCHITECTURES = frozenset(
    {"gemma", "gemma2", "granite", "granitemoe", "granitehybrid", "minicpm", "minicpm3", "plamo"}
)

# gemma3 picks the 27B attention-scale rule from the layer count.
_GEMMA3_27B_LAYER_COUNT = 62
_GEMMA3_DEFAULT_SWA_PERIOD = 6

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
SHARD_KEY_PREFIX = "shard."
MODEL_STORE_ENV = "SHARD_ENGINE_MODEL_STORE"

_COPY_CHUNK_BYTES = 16 * 1024 * 1024
_GGUF_MAGIC = b"GGUF"
_SUPPORTED_GGUF_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32


class GGUFValidationError(ValueError):
    """A file is not a well-formed GGUF model this package can hand to llama.cpp."""


class ShardingRefusedError(ValueError):
    """A model (or a requested layer range of it) cannot be sharded exactly; ``rule`` names why."""

    def __init__(self, rule: str) -> None:
        super().__init__(rule)
        self.rule = rule


class ModelStoreError(ValueError):
    """The model store directory is not acceptable (e.g. under /home)."""


MetadataScalar = int | float | bool | str
MetadataContent = MetadataScalar | list[MetadataScalar]


@dataclass(frozen=True)
class MetadataValue:
    """One GGUF key's value with its GGUF type (and element type for arrays)."""

    value: MetadataContent
    value_type: gguf.GGUFValueType
    element_type: gguf.GGUFValueType | None = None


@dataclass(frozen=True)
class TensorRecord:
    """One tensor's info; ``shape`` is in ggml order (ne[0] first), ``offset`` absolute."""

    name: str
    shape: tuple[int, ...]
    ggml_type: gguf.GGMLQuantizationType
    offset: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """Everything in a GGUF file except the tensor data."""

    path: Path
    version: int
    alignment: int
    file_size: int
    metadata: dict[str, MetadataValue]
    tensors: dict[str, TensorRecord]

    @property
    def architecture(self) -> str:
        return self.get_str("general.architecture")

    def get_str(self, key: str) -> str:
        value = self.metadata[key].value
        if not isinstance(value, str):
            raise GGUFValidationError(f"{self.path}: metadata {key!r} is not a string")
        return value

    def get_int(self, key: str) -> int:
        entry = self.metadata.get(key)
        if entry is None:
            raise GGUFValidationError(f"{self.path}: required metadata key {key!r} is missing")
        value = entry.value
        if isinstance(value, list):
            # Per-layer arrays (e.g. head counts of hybrid models); the first layer is what the
            # uniform-size checks need.
            value = value[0] if value else 0
        if isinstance(value, bool) or not isinstance(value, int):
            raise GGUFValidationError(f"{self.path}: metadata {key!r} is not an integer")
        return value


@dataclass(frozen=True)
class ModelInfo:
    """What a GGUF model is and whether it can be sharded (``refusal`` names the rule if not)."""

    path: Path
    architecture: str
    n_layers: int
    n_embd: int
    vocab_size: int
    layer_bytes: tuple[int, ...]
    non_layer_bytes: int
    file_size: int
    shardable: bool
    refusal: str | None
    is_shard: bool

    @property
    def total_layer_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def total_bytes(self) -> int:
        return self.file_size


@dataclass(frozen=True)
class SplitProgress:
    """Reported while splitting: bytes of the current stage done out of its total."""

    stage: str
    shard_index: int
    n_shards: int
    bytes_done: int
    bytes_total: int


@dataclass(frozen=True)
class ShardFile:
    """One shard in a manifest."""

    start: int
    end: int
    file: str
    sha256: str
    size: int
    role: str
    has_identity_block: bool


@dataclass(frozen=True)
class Manifest:
    """The result of a split: source fingerprint and one entry per shard, in layer order."""

    source_path: str
    source_sha256: str
    source_size: int
    architecture: str
    n_layers: int
    n_embd: int
    vocab_size: int
    shards: tuple[ShardFile, ...]
    directory: Path = field(compare=False)
    reused: tuple[bool, ...] = field(compare=False, default=())

    def shard_path(self, index: int) -> Path:
        return self.directory / self.shards[index].file

    def to_json(self) -> str:
        document = {
            "format": MANIFEST_FORMAT,
            "source": {
                "path": self.source_path,
                "sha256": self.source_sha256,
                "size": self.source_size,
            },
            "architecture": self.architecture,
            "n_layers": self.n_layers,
            "n_embd": self.n_embd,
            "vocab_size": self.vocab_size,
            "shards": [
                {
                    "start": s.start,
                    "end": s.end,
                    "file": s.file,
                    "sha256": s.sha256,
                    "size": s.size,
                    "role": s.role,
                    "has_identity_block": s.has_identity_block,
                }
                for s in self.shards
            ],
        }
        return json.dumps(document, indent=2, sort_keys=True) + "\n"


ProgressCallback = Callable[[SplitProgress], None]


# --------------------------------------------------------------------------------------------
# Strict GGUF header reader
# --------------------------------------------------------------------------------------------

_SCALAR_FORMATS: dict[int, str] = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES: dict[int, str] = {
    gguf.GGUFValueType.UINT8: "<u1",
    gguf.GGUFValueType.INT8: "<i1",
    gguf.GGUFValueType.UINT16: "<u2",
    gguf.GGUFValueType.INT16: "<i2",
    gguf.GGUFValueType.UINT32: "<u4",
    gguf.GGUFValueType.INT32: "<i4",
    gguf.GGUFValueType.FLOAT32: "<f4",
    gguf.GGUFValueType.BOOL: "<u1",
    gguf.GGUFValueType.UINT64: "<u8",
    gguf.GGUFValueType.INT64: "<i8",
    gguf.GGUFValueType.FLOAT64: "<f8",
}


class _Cursor:
    """Bounds-checked little-endian reads from a buffer; every overrun is a validation error."""

    def __init__(self, buffer: mmap.mmap | bytes, path: Path) -> None:
        self.buffer = buffer
        self.position = 0
        self.path = path

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.position + n > len(self.buffer):
            raise GGUFValidationError(
                f"{self.path}: file ends inside {what} (needs {n} bytes at offset {self.position}, "
                f"file has {len(self.buffer)}); the file is truncated or corrupt"
            )
        data = self.buffer[self.position : self.position + n]
        self.position += n
        return bytes(data)

    def scalar(self, fmt: str, what: str) -> int | float | bool:
        value: int | float | bool = struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar("<I", what))

    def u64(self, what: str) -> int:
        return int(self.scalar("<Q", what))

    def string(self, what: str) -> str:
        length = self.u64(what)
        raw = self.take(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise GGUFValidationError(f"{self.path}: {what} is not valid UTF-8") from error

    def value_type(self, what: str) -> gguf.GGUFValueType:
        raw = self.u32(what)
        try:
            return gguf.GGUFValueType(raw)
        except ValueError as error:
            raise GGUFValidationError(
                f"{self.path}: unknown metadata value type {raw} in {what}"
            ) from error

    def metadata_value(self, key: str) -> MetadataValue:
        value_type = self.value_type(f"type of {key!r}")
        if value_type == gguf.GGUFValueType.STRING:
            return MetadataValue(self.string(f"value of {key!r}"), value_type)
        if value_type != gguf.GGUFValueType.ARRAY:
            return MetadataValue(
                self.scalar(_SCALAR_FORMATS[value_type], f"value of {key!r}"), value_type
            )
        element_type = self.value_type(f"element type of {key!r}")
        count = self.u64(f"length of {key!r}")
        if count > len(self.buffer):
            raise GGUFValidationError(f"{self.path}: array {key!r} claims {count} elements")
        if element_type == gguf.GGUFValueType.ARRAY:
            raise GGUFValidationError(f"{self.path}: nested arrays ({key!r}) are not supported")
        if element_type == gguf.GGUFValueType.STRING:
            strings: list[MetadataScalar] = [
                self.string(f"element of {key!r}") for _ in range(count)
            ]
            return MetadataValue(strings, value_type, element_type)
        dtype = np.dtype(_NUMPY_DTYPES[element_type])
        raw = self.take(count * dtype.itemsize, f"array {key!r}")
        items: list[MetadataScalar] = np.frombuffer(raw, dtype=dtype).tolist()
        if element_type == gguf.GGUFValueType.BOOL:
            items = [bool(item) for item in items]
        return MetadataValue(items, value_type, element_type)


def _tensor_n_bytes(
    path: Path, name: str, shape: tuple[int, ...], ggml_type: gguf.GGMLQuantizationType
) -> int:
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    if not shape or shape[0] % block_size:
        raise GGUFValidationError(
            f"{path}: tensor {name!r} has ne[0]={shape[0] if shape else None}, "
            "not a multiple of the "
            f"{ggml_type.name} block size {block_size}"
        )
    return math.prod(shape) // block_size * type_size


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor infos, checking every bound against the file.

    Raises GGUFValidationError for anything that is not a structurally sound GGUF file: bad magic,
    unsupported version, truncation anywhere, unknown types, tensor data outside the file.
    """
    file_path = Path(path)
    try:
        file_size = file_path.stat().st_size
        with open(file_path, "rb") as handle:
            if file_size < 24:
                raise GGUFValidationError(
                    f"{file_path}: {file_size} bytes is too small to be a GGUF file"
                )
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
                return _parse_header(buffer, file_path, file_size)
    except OSError as error:
        raise GGUFValidationError(f"{file_path}: cannot read file: {error}") from error


def _parse_header(buffer: mmap.mmap, path: Path, file_size: int) -> GGUFHeader:
    cursor = _Cursor(buffer, path)
    magic = cursor.take(4, "magic")
    if magic != _GGUF_MAGIC:
        raise GGUFValidationError(f"{path}: bad magic {magic!r}, not a GGUF file")
    version = cursor.u32("version")
    if version not in _SUPPORTED_GGUF_VERSIONS:
        raise GGUFValidationError(f"{path}: unsupported GGUF version {version}")
    n_tensors = cursor.u64("tensor count")
    n_kv = cursor.u64("metadata count")
    # Each entry needs at least a few bytes, which bounds absurd counts from corrupt headers
    # before any allocation is attempted.
    if n_tensors > file_size // 8 or n_kv > file_size // 8:
        raise GGUFValidationError(
            f"{path}: header claims {n_tensors} tensors and {n_kv} keys; corrupt"
        )
    metadata: dict[str, MetadataValue] = {}
    for _ in range(n_kv):
        key = cursor.string("metadata key")
        if key in metadata:
            raise GGUFValidationError(f"{path}: duplicate metadata key {key!r}")
        metadata[key] = cursor.metadata_value(key)
    alignment = _DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        raw_alignment = metadata["general.alignment"].value
        if (
            not isinstance(raw_alignment, int)
            or raw_alignment <= 0
            or raw_alignment & (raw_alignment - 1)
        ):
            raise GGUFValidationError(
                f"{path}: general.alignment {raw_alignment!r} is not a power of two"
            )
        alignment = raw_alignment
    infos: list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]] = []
    for _ in range(n_tensors):
        name = cursor.string("tensor name")
        n_dims = cursor.u32(f"dimension count of {name!r}")
        if not 1 <= n_dims <= 4:
            raise GGUFValidationError(f"{path}: tensor {name!r} has {n_dims} dimensions")
        shape = tuple(cursor.u64(f"shape of {name!r}") for _ in range(n_dims))
        raw_type = cursor.u32(f"type of {name!r}")
        try:
            ggml_type = gguf.GGMLQuantizationType(raw_type)
        except ValueError as error:
            raise GGUFValidationError(
                f"{path}: tensor {name!r} has unknown ggml type {raw_type}"
            ) from error
        if ggml_type not in gguf.GGML_QUANT_SIZES:
            raise GGUFValidationError(
                f"{path}: tensor {name!r} has unsupported ggml type {ggml_type.name}"
            )
        relative_offset = cursor.u64(f"offset of {name!r}")
        infos.append((name, shape, ggml_type, relative_offset))
    data_start = -(-cursor.position // alignment) * alignment
    tensors: dict[str, TensorRecord] = {}
    for name, shape, ggml_type, relative_offset in infos:
        if name in tensors:
            raise GGUFValidationError(f"{path}: duplicate tensor {name!r}")
        if relative_offset % alignment:
            raise GGUFValidationError(
                f"{path}: tensor {name!r} offset {relative_offset} is not aligned"
            )
        n_bytes = _tensor_n_bytes(path, name, shape, ggml_type)
        offset = data_start + relative_offset
        if offset + n_bytes > file_size:
            raise GGUFValidationError(
                f"{path}: tensor {name!r} data [{offset}, {offset + n_bytes}) lies beyond "
                "the end of the "
                f"file ({file_size} bytes); the file is truncated"
            )
        tensors[name] = TensorRecord(name, shape, ggml_type, offset, n_bytes)
    return GGUFHeader(path, version, alignment, file_size, metadata, tensors)


# --------------------------------------------------------------------------------------------
# Validation and inspection
# --------------------------------------------------------------------------------------------


def _layer_index(tensor_name: str) -> int | None:
    if not tensor_name.startswith("blk."):
        return None
    index = tensor_name.split(".", 2)[1]
    return int(index) if index.isdigit() else None


def _check_model_structure(header: GGUFHeader) -> None:
    path = header.path
    if "general.architecture" not in header.metadata:
        raise GGUFValidationError(f"{path}: metadata key 'general.architecture' is missing")
    arch = header.architecture
    n_layers = header.get_int(f"{arch}.block_count")
    n_embd = header.get_int(f"{arch}.embedding_length")
    if n_layers <= 0 or n_embd <= 0:
        raise GGUFValidationError(
            f"{path}: block_count={n_layers}, embedding_length={n_embd} must be positive"
        )
    for required in ("token_embd.weight", "output_norm.weight"):
        if required not in header.tensors:
            raise GGUFValidationError(f"{path}: required tensor {required!r} is missing")
    embedding = header.tensors["token_embd.weight"]
    if len(embedding.shape) != 2 or embedding.shape[0] != n_embd:
        raise GGUFValidationError(
            f"{path}: token_embd.weight has shape {list(embedding.shape)}, "
            f"expected [{n_embd}, vocab]"
        )
    if header.tensors["output_norm.weight"].shape != (n_embd,):
        raise GGUFValidationError(f"{path}: output_norm.weight does not have {n_embd} elements")
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if (
        tokens is not None
        and isinstance(tokens.value, list)
        and len(tokens.value) != embedding.shape[1]
    ):
        raise GGUFValidationError(
            f"{path}: tokenizer has {len(tokens.value)} tokens but token_embd.weight has "
            f"{embedding.shape[1]} rows"
        )
    output = header.tensors.get("output.weight")
    if output is not None and (
        output.shape[0] != n_embd or output.shape[1:] != embedding.shape[1:]
    ):
        raise GGUFValidationError(
            f"{path}: output.weight shape {list(output.shape)} is inconsistent"
        )
    present = {index for name in header.tensors if (index := _layer_index(name)) is not None}
    missing = sorted(set(range(n_layers)) - present)
    extra = sorted(present - set(range(n_layers)))
    if missing:
        raise GGUFValidationError(
            f"{path}: block_count is {n_layers} but blocks {missing[:8]} have no tensors"
        )
    if extra:
        raise GGUFValidationError(
            f"{path}: block_count is {n_layers} but tensors exist for blocks {extra[:8]}"
        )
    for il in range(n_layers):
        norm = header.tensors.get(f"blk.{il}.attn_norm.weight")
        if norm is None:
            raise GGUFValidationError(f"{path}: tensor 'blk.{il}.attn_norm.weight' is missing")
        if norm.shape != (n_embd,):
            raise GGUFValidationError(
                f"{path}: blk.{il}.attn_norm.weight does not have {n_embd} elements"
            )


_MAX_TOKEN_TYPE = 6  # llama_token_type: UNDEFINED=0 .. BYTE=6


def _check_vocabulary(header: GGUFHeader) -> None:
    """Vocabulary defects llama.cpp does not report but aborts the process on (e.g. duplicate
    token strings fail GGML_ASSERT(id_to_token.size() == token_to_id.size()))."""
    path = header.path
    entry = header.metadata.get("tokenizer.ggml.tokens")
    if entry is None:
        return
    tokens = entry.value
    if not isinstance(tokens, list) or not all(isinstance(token, str) for token in tokens):
        raise GGUFValidationError(f"{path}: tokenizer.ggml.tokens is not an array of strings")
    if len(set(tokens)) != len(tokens):
        raise GGUFValidationError(f"{path}: tokenizer.ggml.tokens holds duplicate token strings")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        parallel = header.metadata.get(key)
        if parallel is not None and (
            not isinstance(parallel.value, list) or len(parallel.value) != len(tokens)
        ):
            raise GGUFValidationError(f"{path}: {key} does not have one entry per token")
    token_types = header.metadata.get("tokenizer.ggml.token_type")
    if token_types is not None and isinstance(token_types.value, list):
        for value in token_types.value:
            if not isinstance(value, int) or not 0 <= value <= _MAX_TOKEN_TYPE:
                raise GGUFValidationError(f"{path}: tokenizer.ggml.token_type holds {value!r}")


def validate_gguf(path: str | os.PathLike[str]) -> GGUFHeader:
    """Check that ``path`` is a structurally sound GGUF model; return its parsed header.

    Raises GGUFValidationError (a ValueError) with a message naming the first problem found.
    """
    header = read_gguf_header(path)
    _check_model_structure(header)
    _check_vocabulary(header)
    return header


def _shardability(header: GGUFHeader) -> str | None:
    arch = header.architecture
    if any(key.startswith(SHARD_KEY_PREFIX) for key in header.metadata):
        return (
            "already-a-shard: this file is a shard written by split_model; split the original model"
        )
    if arch in _EMBEDDING_SCALED_ARCHITECTURES:
        return (
            f"embedding-input-scaled: {arch} scales the embedding input inside the graph even for "
            "hidden-state (embd) batches, so a non-head shard would rescale the boundary"
        )
    if arch not in ALLOWED_ARCHITECTURES:
        return (
            f"architecture-not-allowed: {arch!r} is not in the shard allow-list "
            f"{list(ALLOWED_ARCHITECTURES)} (its graph has not been proven exact when split)"
        )
    if header.get_int(f"{arch}.block_count") < 2:
        return "too-few-layers: a model needs at least 2 layers to be split"
    if arch == "gemma3" and header.get_int("gemma3.block_count") == _GEMMA3_27B_LAYER_COUNT:
        return (
            "gemma3-layer-count-attention-scale: gemma3 with 62 layers uses the 27B "
            "attention scale, "
            "which llama.cpp chooses from the layer count, so its shards would use the wrong scale"
        )
    return None


def model_info(header: GGUFHeader) -> ModelInfo:
    """Describe an already validated header (what :func:`inspect_gguf` returns)."""
    arch = header.architecture
    n_layers = header.get_int(f"{arch}.block_count")
    layer_bytes = [0] * n_layers
    non_layer_bytes = 0
    for record in header.tensors.values():
        index = _layer_index(record.name)
        if index is None:
            non_layer_bytes += record.n_bytes
        else:
            layer_bytes[index] += record.n_bytes
    refusal = _shardability(header)
    return ModelInfo(
        path=header.path,
        architecture=arch,
        n_layers=n_layers,
        n_embd=header.get_int(f"{arch}.embedding_length"),
        vocab_size=header.tensors["token_embd.weight"].shape[1],
        layer_bytes=tuple(layer_bytes),
        non_layer_bytes=non_layer_bytes,
        file_size=header.file_size,
        shardable=refusal is None,
        refusal=refusal,
        is_shard=any(key.startswith(SHARD_KEY_PREFIX) for key in header.metadata),
    )


def inspect_gguf(path: str | os.PathLike[str]) -> ModelInfo:
    """Validate ``path`` and describe it (size per layer, shardability and the refusing rule)."""
    return model_info(validate_gguf(path))


# --------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------


def parts_by_bytes(info: ModelInfo, n_parts: int) -> list[tuple[int, int]]:
    """Split the layers into ``n_parts`` contiguous ranges minimising the largest range's bytes.

    Only layer bytes are balanced: the embedding lookup on the head is cheap to compute, and the
    lm-head on the tail is the same for every split, so neither is worth moving layers for.
    """
    weights = info.layer_bytes
    n = len(weights)
    if not 1 <= n_parts <= n:
        raise ValueError(f"cannot split {n} layers into {n_parts} parts")
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)

    def cuts_for(limit: int) -> list[int] | None:
        # Greedy: take as many layers as fit under the limit, leaving one per remaining part.
        cuts: list[int] = []
        start = 0
        for part in range(n_parts):
            remaining_parts = n_parts - part - 1
            end = start + 1
            if prefix[end] - prefix[start] > limit:
                return None
            while end < n - remaining_parts and prefix[end + 1] - prefix[start] <= limit:
                end += 1
            if part == n_parts - 1 and end != n:
                return None
            cuts.append(end)
            start = end
        return cuts

    low, high = max(weights), prefix[-1]
    while low < high:
        middle = (low + high) // 2
        if cuts_for(middle) is None:
            low = middle + 1
        else:
            high = middle
    cuts = cuts_for(low)
    assert cuts is not None
    starts = [0, *cuts[:-1]]
    return list(zip(starts, cuts, strict=True))


def _check_ranges(ranges: Sequence[tuple[int, int]], n_layers: int) -> None:
    if not ranges:
        raise ValueError("no layer ranges given")
    expected_start = 0
    for start, end in ranges:
        if start != expected_start or end <= start:
            raise ValueError(
                f"ranges {list(ranges)} must be contiguous, non-empty and start at 0 "
                f"(problem at {start}, {end})"
            )
        expected_start = end
    if expected_start != n_layers:
        raise ValueError(
            f"ranges {list(ranges)} end at {expected_start}, the model has {n_layers} layers"
        )


def _check_partial_ranges(ranges: Sequence[tuple[int, int]], n_layers: int) -> None:
    if not ranges:
        raise ValueError("no layer ranges given")
    previous_end = 0
    for start, end in ranges:
        if not previous_end <= start < end <= n_layers:
            raise ValueError(
                f"ranges {list(ranges)} must be ordered, non-overlapping, non-empty and within "
                f"[0, {n_layers}) (problem at {start}, {end})"
            )
        previous_end = end


# --------------------------------------------------------------------------------------------
# Writing shards
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorPlan:
    """A tensor of a shard: copied from the source, or synthesised (zeros / ones)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: gguf.GGMLQuantizationType
    n_bytes: int
    source: TensorRecord | None = None
    fill: str = "zeros"


def _role(start: int, end: int, n_layers: int) -> str:
    if start == 0:
        return "full" if end == n_layers else "head"
    return "tail" if end == n_layers else "middle"


def _gemma3_full_swa_pattern(header: GGUFHeader, n_layers: int) -> list[bool]:
    key = "gemma3.attention.sliding_window_pattern"
    entry = header.metadata.get(key)
    if entry is not None and isinstance(entry.value, list):
        return [bool(item) for item in entry.value[:n_layers]]
    period = _GEMMA3_DEFAULT_SWA_PERIOD
    if entry is not None and isinstance(entry.value, int):
        period = entry.value
    # Mirrors llama_hparams::set_swa_pattern(n_pattern, dense_first=false).
    return [period == 0 or il % period < period - 1 for il in range(n_layers)]


def _shard_metadata(
    header: GGUFHeader,
    start: int,
    end: int,
    source_sha256: str,
    with_identity_block: bool,
) -> dict[str, MetadataValue]:
    arch = header.architecture
    n_layers = header.get_int(f"{arch}.block_count")
    role = _role(start, end, n_layers)
    n_blocks = end - start + (1 if with_identity_block else 0)
    u32 = gguf.GGUFValueType.UINT32
    result: dict[str, MetadataValue] = {}
    for key, entry in header.metadata.items():
        if key == "general.architecture":
            continue
        if role == "middle" and key.startswith("tokenizer."):
            continue
        value = entry
        if (
            key.startswith(f"{arch}.")
            and isinstance(entry.value, list)
            and len(entry.value) == n_layers
        ):
            # Per-layer hyper-parameters (head counts, ff sizes, window patterns): slice, and give
            # the identity block the last real layer's value so its tensor shapes match.
            sliced = list(entry.value[start:end])
            if with_identity_block:
                sliced.append(entry.value[end - 1])
            value = MetadataValue(sliced, entry.value_type, entry.element_type)
        result[key] = value
    result[f"{arch}.block_count"] = MetadataValue(n_blocks, u32)
    if role == "middle":
        result["tokenizer.ggml.model"] = MetadataValue("none", gguf.GGUFValueType.STRING)
        result[f"{arch}.vocab_size"] = MetadataValue(1, u32)
    if arch == "gemma3":
        full_pattern = _gemma3_full_swa_pattern(header, n_layers)
        pattern = full_pattern[start:end]
        if with_identity_block:
            # llama.cpp asserts a sliding-window model has a local layer; the identity block
            # never runs attention that matters, so it can always be the local one.
            pattern.append(True)
        result["gemma3.attention.sliding_window_pattern"] = MetadataValue(
            [bool(item) for item in pattern], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL
        )
        if not any(pattern):
            result["gemma3.attention.sliding_window"] = MetadataValue(0, u32)
        if (n_layers == _GEMMA3_27B_LAYER_COUNT) != (n_blocks == _GEMMA3_27B_LAYER_COUNT):
            raise ShardingRefusedError(
                f"gemma3-layer-count-attention-scale: a gemma3 shard with {n_blocks} blocks of a "
                f"{n_layers}-layer model would switch llama.cpp's layer-count-based attention scale"
            )
    result["general.name"] = MetadataValue(
        f"{_metadata_name(header)} layers [{start}, {end}) of {n_layers}", gguf.GGUFValueType.STRING
    )
    result["shard.start"] = MetadataValue(start, u32)
    result["shard.end"] = MetadataValue(end, u32)
    result["shard.n_layers_total"] = MetadataValue(n_layers, u32)
    result["shard.role"] = MetadataValue(role, gguf.GGUFValueType.STRING)
    result["shard.has_identity_block"] = MetadataValue(with_identity_block, gguf.GGUFValueType.BOOL)
    result["shard.source_sha256"] = MetadataValue(source_sha256, gguf.GGUFValueType.STRING)
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and isinstance(tokens.value, list):
        # Middle shards drop the vocabulary; the model's vocabulary size is still its contract.
        result["shard.source_vocab_size"] = MetadataValue(len(tokens.value), u32)
    return result


def _metadata_name(header: GGUFHeader) -> str:
    entry = header.metadata.get("general.name")
    return entry.value if entry is not None and isinstance(entry.value, str) else header.path.stem


def _shard_tensors(
    header: GGUFHeader, start: int, end: int, with_identity_block: bool
) -> list[_TensorPlan]:
    arch = header.architecture
    n_layers = header.get_int(f"{arch}.block_count")
    n_embd = header.get_int(f"{arch}.embedding_length")
    role = _role(start, end, n_layers)
    has_output = "output.weight" in header.tensors
    plans: list[_TensorPlan] = []
    for record in header.tensors.values():
        index = _layer_index(record.name)
        if index is not None:
            continue
        if record.name == "output.weight" and role not in ("tail", "full"):
            continue
        if record.name == "token_embd.weight":
            if role == "middle":
                # The loader insists on a token embedding; one zero row of the vocabulary-less
                # middle shard costs nothing.
                plans.append(
                    _TensorPlan(record.name, (n_embd, 1), gguf.GGMLQuantizationType.F32, n_embd * 4)
                )
                continue
            if role == "tail" and has_output:
                # The tail never looks tokens up (its input is hidden states) but needs the
                # vocabulary-sized shape; zero bytes are written as a sparse hole.
                plans.append(
                    _TensorPlan(record.name, record.shape, record.ggml_type, record.n_bytes)
                )
                continue
        plans.append(
            _TensorPlan(record.name, record.shape, record.ggml_type, record.n_bytes, source=record)
        )
    for il in range(start, end):
        prefix = f"blk.{il}."
        for record in header.tensors.values():
            if record.name.startswith(prefix):
                new_name = f"blk.{il - start}.{record.name[len(prefix) :]}"
                plans.append(
                    _TensorPlan(
                        new_name, record.shape, record.ggml_type, record.n_bytes, source=record
                    )
                )
    if with_identity_block:
        prefix = f"blk.{end - 1}."
        for record in header.tensors.values():
            if not record.name.startswith(prefix):
                continue
            suffix = record.name[len(prefix) :]
            new_name = f"blk.{end - start}.{suffix}"
            if "norm" in suffix:
                # Unit norms: with zero projections the block adds exactly 0 to the residual.
                plans.append(
                    _TensorPlan(
                        new_name,
                        record.shape,
                        gguf.GGMLQuantizationType.F32,
                        math.prod(record.shape) * 4,
                        fill="ones",
                    )
                )
            else:
                # All-zero bytes decode to 0 in every ggml type (zero scales, zero quants).
                plans.append(_TensorPlan(new_name, record.shape, record.ggml_type, record.n_bytes))
    return plans


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_COPY_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _write_shard(
    header: GGUFHeader,
    metadata: dict[str, MetadataValue],
    tensors: list[_TensorPlan],
    destination: Path,
    report: Callable[[int], None],
) -> None:
    partial = destination.with_name(destination.name + ".partial")
    writer = gguf.GGUFWriter(partial, header.architecture, use_temp_file=False)
    writer.data_alignment = header.alignment
    for key, entry in metadata.items():
        writer.add_key_value(key, entry.value, entry.value_type, entry.element_type)
    for plan in tensors:
        # ggml order -> numpy order; raw_dtype with a non-uint8 numpy dtype keeps the shape as is.
        writer.add_tensor_info(
            plan.name,
            tuple(reversed(plan.shape)),
            np.dtype(np.float32),
            plan.n_bytes,
            raw_dtype=plan.ggml_type,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    output = writer.fout[0]
    writer.write_padding(output, output.tell())
    done = 0
    with open(header.path, "rb") as source:
        for plan in tensors:
            if plan.source is not None:
                source.seek(plan.source.offset)
                remaining = plan.n_bytes
                while remaining:
                    chunk = source.read(min(remaining, _COPY_CHUNK_BYTES))
                    if not chunk:
                        raise GGUFValidationError(f"{header.path}: file shrank while being split")
                    output.write(chunk)
                    remaining -= len(chunk)
            elif plan.fill == "ones":
                output.write(np.ones(math.prod(plan.shape), dtype="<f4").tobytes())
            else:
                output.seek(plan.n_bytes, os.SEEK_CUR)
            writer.write_padding(output, plan.n_bytes)
            done += plan.n_bytes
            report(done)
    # A trailing hole from seek() only becomes part of the file once the size is set.
    output.truncate()
    output.flush()
    os.fsync(output.fileno())
    writer.close()
    os.replace(partial, destination)


def shard_file_name(source: Path, start: int, end: int, n_layers: int) -> str:
    return f"{source.stem}.layers-{start:03d}-{end:03d}-of-{n_layers:03d}.gguf"


def _load_manifest(path: Path) -> dict[str, object] | None:
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None


def _reusable_shards(
    document: dict[str, object] | None, source_sha256: str
) -> dict[tuple[int, int], dict[str, object]]:
    if document is None or document.get("format") != MANIFEST_FORMAT:
        return {}
    source = document.get("source")
    if not isinstance(source, dict) or source.get("sha256") != source_sha256:
        return {}
    shards = document.get("shards")
    if not isinstance(shards, list):
        return {}
    result: dict[tuple[int, int], dict[str, object]] = {}
    for entry in shards:
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("start"), int)
            and isinstance(entry.get("end"), int)
        ):
            result[(int(entry["start"]), int(entry["end"]))] = entry
    return result


def split_model(
    source: str | os.PathLike[str],
    ranges: Sequence[tuple[int, int]],
    out_dir: str | os.PathLike[str],
    progress: ProgressCallback | None = None,
    *,
    partial: bool = False,
) -> Manifest:
    """Write one GGUF per layer range into ``out_dir`` plus ``manifest.json``; return the manifest.

    The ranges must cover every layer contiguously unless ``partial`` (an engine building only
    its own shard): then they need only be ordered, non-empty and within the model. Shards
    already present whose sha256 matches the previous manifest for the same source are reused,
    not rewritten. Raises GGUFValidationError for a bad source, ShardingRefusedError when the
    architecture or a range is not shard-safe, ValueError for malformed ranges.
    """
    source_path = Path(source).resolve()
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    # Parsed once per split: on a 262k-token vocabulary this is the expensive part.
    header = validate_gguf(source_path)
    info = model_info(header)
    if info.refusal is not None:
        raise ShardingRefusedError(info.refusal)
    if partial:
        _check_partial_ranges(ranges, info.n_layers)
    else:
        _check_ranges(ranges, info.n_layers)
    n_shards = len(ranges)

    def notify(stage: str, index: int, done: int, total: int) -> None:
        if progress is not None:
            progress(SplitProgress(stage, index, n_shards, done, total))

    notify("fingerprint", -1, 0, header.file_size)
    source_sha256 = _file_sha256(source_path)
    notify("fingerprint", -1, header.file_size, header.file_size)
    previous = _reusable_shards(_load_manifest(directory / MANIFEST_NAME), source_sha256)

    shard_files: list[ShardFile] = []
    reused: list[bool] = []
    for index, (start, end) in enumerate(ranges):
        role = _role(start, end, info.n_layers)
        with_identity_block = role in ("head", "middle")
        name = shard_file_name(source_path, start, end, info.n_layers)
        destination = directory / name
        metadata = _shard_metadata(header, start, end, source_sha256, with_identity_block)
        earlier = previous.get((start, end))
        if earlier is not None and earlier.get("file") == name and destination.is_file():
            existing_sha256 = _file_sha256(destination)
            if existing_sha256 == earlier.get("sha256"):
                size = destination.stat().st_size
                shard_files.append(
                    ShardFile(start, end, name, existing_sha256, size, role, with_identity_block)
                )
                reused.append(True)
                notify("reused", index, size, size)
                continue
        tensors = _shard_tensors(header, start, end, with_identity_block)
        total = sum(plan.n_bytes for plan in tensors)

        def report(done: int, index: int = index, total: int = total) -> None:
            notify("write", index, done, total)

        _write_shard(header, metadata, tensors, destination, report)
        shard_files.append(
            ShardFile(
                start,
                end,
                name,
                _file_sha256(destination),
                destination.stat().st_size,
                role,
                with_identity_block,
            )
        )
        reused.append(False)

    manifest = Manifest(
        source_path=str(source_path),
        source_sha256=source_sha256,
        source_size=header.file_size,
        architecture=info.architecture,
        n_layers=info.n_layers,
        n_embd=info.n_embd,
        vocab_size=info.vocab_size,
        shards=tuple(shard_files),
        directory=directory,
        reused=tuple(reused),
    )
    staging = directory / (MANIFEST_NAME + ".partial")
    staging.write_text(manifest.to_json())
    os.replace(staging, directory / MANIFEST_NAME)
    return manifest


# --------------------------------------------------------------------------------------------
# Model store
# --------------------------------------------------------------------------------------------


def resolve_model_store(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The directory shards and downloaded models live in.

    ``explicit`` wins, then ``$SHARD_ENGINE_MODEL_STORE``, then ``~/.cache/shard-engine``. Paths
    under /home are refused: model files are large and home directories are often small, synced
    or backed up, so the store must be chosen deliberately.
    """
    raw = explicit if explicit is not None else os.environ.get(MODEL_STORE_ENV)
    candidate = Path(raw).expanduser() if raw else Path("~/.cache/shard-engine").expanduser()
    resolved = candidate.resolve()
    if resolved == Path("/home") or Path("/home") in resolved.parents:
        source = (
            "argument"
            if explicit is not None
            else (MODEL_STORE_ENV if raw else "default (~/.cache)")
        )
        raise ModelStoreError(
            f"model store {resolved} (from {source}) is under /home; choose another directory with "
            f"{MODEL_STORE_ENV} or an explicit path"
        )
    return resolved
