"""A strict GGUF header reader: metadata and tensor infos, every bound checked against the file.

Nothing here imports llama.cpp. A truncated or corrupt file is refused with
:class:`GGUFValidationError` before it could reach llama.cpp's loader, which trusts its input.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

__all__ = [
    "SHARD_KEY_PREFIX",
    "GGUFHeader",
    "GGUFValidationError",
    "MetadataValue",
    "TensorRecord",
    "layer_index",
    "read_gguf_header",
]

SHARD_KEY_PREFIX = "shard."
_GGUF_MAGIC = b"GGUF"
_SUPPORTED_GGUF_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# 16x the largest vocabulary of a released model (262,144 tokens).
MAX_ARRAY_ELEMENTS = 1 << 22
# All arrays together: a vocabulary's tokens, scores, types and merges are well below it. Each
# element becomes a Python object of about 32 bytes (per 1 to 4 bytes of file), so without a
# total a file of many long arrays took ten times its size in memory (48 MB of FLOAT32 arrays:
# 480 MB) and a large one the process.
MAX_TOTAL_ARRAY_ELEMENTS = 1 << 23
# Released models carry tens of metadata keys and at most a few thousand tensors (512 layers of
# about 20, or per-expert tensors of older MoE conversions).
MAX_METADATA_KEYS = 1 << 16
MAX_TENSORS = 1 << 16
# ggml's GGML_MAX_NAME: gguf.cpp refuses a tensor name of this many bytes or more.
GGML_MAX_NAME = 64


class GGUFValidationError(ValueError):
    """A file is not a well-formed GGUF model this package can hand to llama.cpp.

    ``rule`` names the check that failed (stable, for ``inspect`` and error details) and
    ``field`` the metadata key or tensor name it concerns, when there is one.
    """

    def __init__(self, message: str, *, rule: str = "malformed-gguf", field: str | None = None):
        super().__init__(message)
        self.rule = rule
        self.field = field


MetadataScalar = int | float | bool | str
MetadataContent = MetadataScalar | list[MetadataScalar]


@dataclass(frozen=True)
class MetadataValue:
    """One GGUF key's value with its GGUF type (and element type for arrays).

    ``offset`` is where a string value's bytes start in the file it was read from (-1 when not
    read from a file); the shard content hash is patched there.
    """

    value: MetadataContent
    value_type: gguf.GGUFValueType
    element_type: gguf.GGUFValueType | None = None
    offset: int = field(default=-1, compare=False)


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
    data_start: int = 0

    @property
    def architecture(self) -> str:
        return self.get_str("general.architecture")

    @property
    def is_shard(self) -> bool:
        return any(key.startswith(SHARD_KEY_PREFIX) for key in self.metadata)

    def get_str(self, key: str) -> str:
        entry = self.metadata.get(key)
        if entry is None:
            raise GGUFValidationError(
                f"{self.path}: required metadata key {key!r} is missing",
                rule="metadata-missing",
                field=key,
            )
        if not isinstance(entry.value, str):
            raise GGUFValidationError(
                f"{self.path}: metadata {key!r} is not a string", rule="metadata-type", field=key
            )
        return entry.value

    def get_int(self, key: str) -> int:
        entry = self.metadata.get(key)
        if entry is None:
            raise GGUFValidationError(
                f"{self.path}: required metadata key {key!r} is missing",
                rule="metadata-missing",
                field=key,
            )
        value = entry.value
        if isinstance(value, list):
            # Per-layer arrays (e.g. head counts of hybrid models); the first layer is what the
            # uniform-size checks need.
            value = value[0] if value else 0
        if isinstance(value, bool) or not isinstance(value, int):
            raise GGUFValidationError(
                f"{self.path}: metadata {key!r} is not an integer", rule="metadata-type", field=key
            )
        return value


@contextlib.contextmanager
def _concerning(name: str) -> Iterator[None]:
    """Errors raised while reading one key's value or one tensor's info name it as their
    ``field`` (the engine's ``InvalidRequest.details`` carry it), unless they name one already."""
    try:
        yield
    except GGUFValidationError as error:
        if error.field is None:
            error.field = name
        raise


def layer_index(tensor_name: str) -> int | None:
    """The block a tensor belongs to (``blk.<i>.``), None for tensors outside the blocks."""
    if not tensor_name.startswith("blk."):
        return None
    index = tensor_name.split(".", 2)[1]
    return int(index) if index.isdigit() else None


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
        self.array_elements = 0

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
            # The string's bytes follow its 8-byte length.
            offset = self.position + 8
            return MetadataValue(self.string(f"value of {key!r}"), value_type, offset=offset)
        if value_type != gguf.GGUFValueType.ARRAY:
            return MetadataValue(
                self.scalar(_SCALAR_FORMATS[value_type], f"value of {key!r}"), value_type
            )
        element_type = self.value_type(f"element type of {key!r}")
        count = self.u64(f"length of {key!r}")
        if count > len(self.buffer):
            raise GGUFValidationError(
                f"{self.path}: array {key!r} claims {count} elements", field=key
            )
        if count > MAX_ARRAY_ELEMENTS:
            # Each element becomes a Python object many times its size in the file: a long
            # array in a large file would take the process's memory before anything fails.
            raise GGUFValidationError(
                f"{self.path}: array {key!r} has {count} elements, more than the "
                f"{MAX_ARRAY_ELEMENTS} any model needs (its largest are vocabularies)",
                rule="metadata-array-length",
                field=key,
            )
        self.array_elements += count
        if self.array_elements > MAX_TOTAL_ARRAY_ELEMENTS:
            raise GGUFValidationError(
                f"{self.path}: array {key!r} brings the metadata arrays to "
                f"{self.array_elements} elements, more than the {MAX_TOTAL_ARRAY_ELEMENTS} any "
                "model needs",
                rule="metadata-array-length",
                field=key,
            )
        if element_type == gguf.GGUFValueType.ARRAY:
            raise GGUFValidationError(
                f"{self.path}: nested arrays ({key!r}) are not supported", field=key
            )
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


def _tensor_info(
    cursor: _Cursor, path: Path, name: str
) -> tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]:
    """One tensor info after its name: dimensions, shape, type and data offset."""
    if len(name.encode()) >= GGML_MAX_NAME:
        # gguf.cpp: "tensor name N is too long", and the file is refused.
        raise GGUFValidationError(
            f"{path}: tensor name {name[:GGML_MAX_NAME]!r}... is {len(name.encode())} bytes, "
            f"llama.cpp takes at most {GGML_MAX_NAME - 1}",
            field=name,
        )
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
    return name, shape, ggml_type, cursor.u64(f"offset of {name!r}")


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor infos, checking every bound against the file.

    Raises GGUFValidationError for anything that is not a structurally sound GGUF file: bad magic,
    unsupported version, truncation anywhere, unknown types, tensor data outside the file.
    """
    file_path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer; only a regular
        # file is read, and its size comes from the descriptor that is read.
        descriptor = os.open(file_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(descriptor, "rb") as handle:
            status = os.fstat(handle.fileno())
            if not stat.S_ISREG(status.st_mode):
                raise GGUFValidationError(
                    f"{file_path}: not a regular file", rule="file-not-regular"
                )
            file_size = status.st_size
            if file_size < 24:
                raise GGUFValidationError(
                    f"{file_path}: {file_size} bytes is too small to be a GGUF file"
                )
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
                return _parse_header(buffer, file_path, file_size)
    except OSError as error:
        raise GGUFValidationError(
            f"{file_path}: cannot read file: {error.strerror or error}", rule="file-unreadable"
        ) from error


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
    for count, limit, counted in (
        (n_kv, MAX_METADATA_KEYS, "metadata count"),
        (n_tensors, MAX_TENSORS, "tensor count"),
    ):
        if count > limit:
            # Each parsed key or tensor costs about ten times its bytes in Python objects
            # (a million one-byte keys, 20 MB of file: 217 MB).
            raise GGUFValidationError(
                f"{path}: {count} entries in its {counted}, more than the {limit} any model has",
                rule="gguf-header-counts",
                field=counted,
            )
    metadata: dict[str, MetadataValue] = {}
    for index in range(n_kv):
        key = cursor.string("metadata key")
        if not key:
            # gguf.cpp: "key N is empty", and the file is refused. There is no name to give as
            # the field; the rule and the index say which entry it is.
            raise GGUFValidationError(
                f"{path}: metadata key {index} is empty (llama.cpp refuses the file)",
                rule="gguf-empty-key",
            )
        if key in metadata:
            raise GGUFValidationError(f"{path}: duplicate metadata key {key!r}", field=key)
        with _concerning(key):
            metadata[key] = cursor.metadata_value(key)
    alignment = _DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        entry = metadata["general.alignment"]
        raw_alignment = entry.value
        if (
            entry.value_type != gguf.GGUFValueType.UINT32
            or not isinstance(raw_alignment, int)
            or raw_alignment < _DEFAULT_ALIGNMENT
            or raw_alignment & (raw_alignment - 1)
        ):
            # gguf.cpp reads a UINT32 power of two; ggml's CPU backend then asserts that every
            # mapped tensor lies 32-byte aligned (GGML_ASSERT "buffer pointer must be aligned"),
            # which a smaller alignment does not guarantee.
            raise GGUFValidationError(
                f"{path}: general.alignment {raw_alignment!r} ({entry.value_type.name}) is not "
                f"a UINT32 power of two of at least {_DEFAULT_ALIGNMENT}",
                rule="gguf-alignment",
                field="general.alignment",
            )
        alignment = raw_alignment
    infos: list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]] = []
    for _ in range(n_tensors):
        name = cursor.string("tensor name")
        with _concerning(name):
            infos.append(_tensor_info(cursor, path, name))
    data_start = -(-cursor.position // alignment) * alignment
    tensors: dict[str, TensorRecord] = {}
    # gguf.cpp requires the tensors' data in table order, each at the previous one's end padded
    # to the alignment ("tensor has offset X, expected Y"): no gaps, overlaps or reordering.
    expected_offset = 0
    for name, shape, ggml_type, relative_offset in infos:
        if name in tensors:
            raise GGUFValidationError(f"{path}: duplicate tensor {name!r}", field=name)
        with _concerning(name):
            n_bytes = _tensor_n_bytes(path, name, shape, ggml_type)
        if relative_offset != expected_offset:
            raise GGUFValidationError(
                f"{path}: tensor {name!r} has data offset {relative_offset}, but the tensors "
                f"before it end at {expected_offset} (llama.cpp refuses the file)",
                rule="tensor-offset",
                field=name,
            )
        expected_offset += -(-n_bytes // alignment) * alignment
        offset = data_start + relative_offset
        if offset + n_bytes > file_size:
            raise GGUFValidationError(
                f"{path}: tensor {name!r} data [{offset}, {offset + n_bytes}) lies beyond "
                "the end of the "
                f"file ({file_size} bytes); the file is truncated",
                field=name,
            )
        tensors[name] = TensorRecord(name, shape, ggml_type, offset, n_bytes)
    return GGUFHeader(path, version, alignment, file_size, metadata, tensors, data_start)
