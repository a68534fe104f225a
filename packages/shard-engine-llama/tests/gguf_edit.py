"""Rewriting GGUF files for tests: metadata replaced or dropped, tensors re-shaped, re-typed,
dropped or added. Tensor data of a changed tensor is zeros (the tests are about headers)."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from shard_engine_llama._gguf import GGUFHeader, MetadataValue, read_gguf_header


@dataclass(frozen=True)
class TensorEdit:
    """A tensor of the rewritten file; ``data`` None means zeros of the right size."""

    name: str
    shape: tuple[int, ...]
    ggml_type: gguf.GGMLQuantizationType
    data: bytes | None = None


def n_bytes(shape: Sequence[int], ggml_type: gguf.GGMLQuantizationType) -> int:
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    return math.prod(shape) // block_size * type_size


def tensors_of(header: GGUFHeader) -> list[TensorEdit]:
    raw = header.path.read_bytes()
    return [
        TensorEdit(
            record.name,
            record.shape,
            record.ggml_type,
            raw[record.offset : record.offset + record.n_bytes],
        )
        for record in header.tensors.values()
    ]


def write_gguf(
    destination: Path,
    architecture: str,
    metadata: Mapping[str, MetadataValue],
    tensors: Sequence[TensorEdit],
) -> Path:
    writer = gguf.GGUFWriter(destination, architecture, use_temp_file=False)
    try:
        for key, entry in metadata.items():
            if key == "general.architecture":
                continue
            writer.add_key_value(key, entry.value, entry.value_type, entry.element_type)
        for tensor in tensors:
            size = n_bytes(tensor.shape, tensor.ggml_type)
            data = (
                tensor.data if tensor.data is not None and len(tensor.data) == size else bytes(size)
            )
            block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.ggml_type]
            byte_shape = (*reversed(tensor.shape[1:]), tensor.shape[0] // block_size * type_size)
            array = np.frombuffer(data, dtype=np.uint8).reshape(byte_shape)
            writer.add_tensor(tensor.name, array, raw_dtype=tensor.ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        # A value the writer refuses halfway must not leave the file open.
        writer.close()
    return destination


def rewrite(
    source: Path,
    destination: Path,
    *,
    metadata: Mapping[str, MetadataValue | None] | None = None,
    tensors: Mapping[str, TensorEdit | None] | None = None,
) -> Path:
    """Copy ``source`` with keys replaced (None: dropped) and tensors replaced (None: dropped);
    keys and tensors not in the source are appended."""
    header = read_gguf_header(source)
    entries: dict[str, MetadataValue] = dict(header.metadata)
    for key, value in (metadata or {}).items():
        if value is None:
            entries.pop(key, None)
        else:
            entries[key] = value
    edits = dict(tensors or {})
    result: list[TensorEdit] = []
    for tensor in tensors_of(header):
        if tensor.name in edits:
            replacement = edits.pop(tensor.name)
            if replacement is not None:
                result.append(replacement)
        else:
            result.append(tensor)
    result += [edit for edit in edits.values() if edit is not None]
    architecture = entries["general.architecture"].value
    assert isinstance(architecture, str)
    return write_gguf(destination, architecture, entries, result)


def reseal(
    source: Path,
    destination: Path,
    metadata: Mapping[str, MetadataValue | None],
) -> Path:
    """Rewrite a shard with keys replaced and seal it with its new content digest, as anyone
    editing a shard can (the digest is no signature)."""
    from shard_engine_llama._gguf.integrity import CONTENT_KEY, PLACEHOLDER, seal_shard

    edits = {CONTENT_KEY: MetadataValue(PLACEHOLDER, gguf.GGUFValueType.STRING), **metadata}
    rewrite(source, destination, metadata=edits)
    seal_shard(destination)
    return destination


def u32(value: int) -> MetadataValue:
    return MetadataValue(value, gguf.GGUFValueType.UINT32)


def f32(value: float) -> MetadataValue:
    return MetadataValue(value, gguf.GGUFValueType.FLOAT32)


def array(values: Sequence[object], element_type: gguf.GGUFValueType) -> MetadataValue:
    return MetadataValue(list(values), gguf.GGUFValueType.ARRAY, element_type)  # type: ignore[arg-type]


def tensor_offset_position(raw: bytes | bytearray, name: str) -> int:
    """Where in a GGUF file's bytes the 8-byte data offset of tensor ``name``'s info lies."""
    needle = struct.pack("<Q", len(name)) + name.encode()
    position = raw.index(needle) + len(needle)
    n_dims = int(struct.unpack_from("<I", raw, position)[0])
    return position + 4 + 8 * n_dims + 4


def swap_tensor_offsets(path: Path, first: str, second: str) -> Path:
    """Exchange two tensors' data offsets in place (both stay inside the file)."""
    raw = bytearray(path.read_bytes())
    a, b = tensor_offset_position(raw, first), tensor_offset_position(raw, second)
    raw[a : a + 8], raw[b : b + 8] = raw[b : b + 8], raw[a : a + 8]
    path.write_bytes(bytes(raw))
    return path
