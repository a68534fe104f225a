"""Where a model file comes from, as far as the suite can tell by opening it itself.

Certification is earned: a ``real-model`` report needs a model file that the suite hashed and
that the project's own tiny-model generator did not write. This module reads the metadata of a
GGUF file (header and key/value pairs only, no tensors; no dependency beyond the standard
library) and recognises the generator's files and the shards split from them: the generator
names its models ``tiny-<arch>-<dtype>-seed<N>`` (``general.name``), the shard writer appends
`` layers [start, end) of n``, and a ``shard_engine.generated_by`` key, when present, says so
outright.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import BinaryIO, Final

__all__ = ["GENERATED_MARKER_KEY", "generated_by_project", "gguf_metadata"]

GENERATED_MARKER_KEY: Final = "shard_engine.generated_by"
_GENERATED_NAME: Final = re.compile(
    r"^tiny-[A-Za-z0-9_]+-[A-Za-z0-9_]+-seed\d+( layers \[\d+, \d+\) of \d+)?$"
)
_MAGIC: Final = b"GGUF"
_SCALARS: Final[dict[int, str]] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING: Final = 8
_ARRAY: Final = 9
_MAX_KEYS: Final = 1 << 20


class _Truncated(Exception):
    pass


def _read(handle: BinaryIO, size: int) -> bytes:
    data = handle.read(size)
    if len(data) != size:
        raise _Truncated
    return data


def _string(handle: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", _read(handle, 8))
    return _read(handle, length).decode("utf-8", errors="replace")


def _value(handle: BinaryIO, kind: int) -> object:
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, _read(handle, struct.calcsize(fmt)))[0]
    if kind == _STRING:
        return _string(handle)
    if kind == _ARRAY:
        item_kind, count = struct.unpack("<IQ", _read(handle, 12))
        if item_kind in _SCALARS:
            handle.seek(struct.calcsize(_SCALARS[item_kind]) * count, 1)
            return None
        for _ in range(count):
            _value(handle, item_kind)
        return None
    raise _Truncated


def gguf_metadata(path: Path) -> dict[str, object] | None:
    """The scalar and string metadata of a GGUF file (arrays are skipped), or None when the
    file is not GGUF or its header cannot be read."""
    try:
        with path.open("rb") as handle:
            if handle.read(4) != _MAGIC:
                return None
            (version,) = struct.unpack("<I", _read(handle, 4))
            if version == 1:
                _tensors, n_keys = struct.unpack("<II", _read(handle, 8))
            else:
                _tensors, n_keys = struct.unpack("<QQ", _read(handle, 16))
            metadata: dict[str, object] = {}
            for _ in range(min(n_keys, _MAX_KEYS)):
                key = _string(handle)
                (kind,) = struct.unpack("<I", _read(handle, 4))
                value = _value(handle, kind)
                if value is not None:
                    metadata[key] = value
            return metadata
    except (OSError, _Truncated, struct.error):
        return None


def generated_by_project(path: Path) -> bool:
    """Whether ``path`` (a file, or any GGUF file in a directory) was written by the project's
    tiny-model generator or split from such a file."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        metadata = gguf_metadata(file)
        if metadata is None:
            continue
        if GENERATED_MARKER_KEY in metadata:
            return True
        name = metadata.get("general.name")
        if isinstance(name, str) and _GENERATED_NAME.match(name):
            return True
    return False
