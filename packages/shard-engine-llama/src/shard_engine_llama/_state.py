"""The byte layout of one llama.cpp sequence's KV state, checked in Python before llama.cpp
reads it.

``llama_state_seq_get_data`` writes (llama-context.cpp ``state_seq_write_data``, then
llama-kv-cache.cpp ``state_write`` once per KV cache: one for most families, two for
sliding-window ones, the full-attention cache first)::

    u32 io_magic (0xaf143cd8)   i32 seq_id
    per cache:  u32 n_stream, then per stream: u32 cell_count and, when it is not 0,
                cell_count x (i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id)
                u32 v_trans, u32 n_layer
                n_layer x (i32 k_type, u64 k_row_bytes, cell_count x k_row_bytes)
                n_layer x (i32 v_type, u64 v_row_bytes, cell_count x v_row_bytes)         v_trans 0
                n_layer x (i32 v_type, u32 v_elem_bytes, u32 n_embd_v, n_embd_v x
                           cell_count x v_elem_bytes)                                    v_trans 1

A sliding-window cache writes only the cells still inside the window of the sequence's last
position. ``n_stream`` is the context's ``n_seq_max`` (one KV stream per sequence), so the blob
of one engine does not load into an engine with another session count as it is.

What travels between engines is the *portable* form: one stream per cache, sequence id 0
everywhere. :func:`portable` makes it from a local blob and :func:`localize` turns it back into
a blob for a given context and sequence. Both go through :func:`parse`, which checks every field
llama.cpp would trust: ``llama_state_seq_set_data`` returns 0 (restoring nothing) for most
inconsistencies, but sizes a buffer from ``cell_count`` before it reads a cell (a huge count
exhausts memory) and asserts, aborting the process, that the positions it placed are the ones
it read. So the checks here are: the magic, one sequence per cell, cell counts within the
context, positions ``0..length-1`` for the full cache and a contiguous tail ending at
``length - 1`` for a windowed one, tensor types, and a total size equal to what the fields
describe (nothing missing, nothing trailing).

A state from elsewhere is also held to this context's geometry (:class:`Geometry`): no more
layers than the shard has, and rows no wider than its widest K or V row, each a whole number
of elements. Without that, a few hundred bytes that declare a zero-byte element for 2**32
channels, or one wide cell at the end of a window, would make :func:`localize` build (and
pad) gigabytes before llama.cpp refused them. And its values must be finite and within
float16's range (:data:`MAX_KV_MAGNITUDE`): llama.cpp keeps a released cell's K and V and
still reads them for every later sequence in that stream, masking them by adding -inf to
their scores and multiplying their V by 0, so a NaN, an infinity or a K large enough to
overflow a score would turn every later session in the slot into NaN.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import numpy as np

__all__ = [
    "IO_MAGIC",
    "MAX_KV_MAGNITUDE",
    "CacheSection",
    "Geometry",
    "SequenceState",
    "StateFormatError",
    "localize",
    "max_portable_bytes",
    "parse",
    "portable",
]

IO_MAGIC: Final = 0xAF143CD8
_MAX_LAYERS: Final = 512  # LLAMA_MAX_LAYERS
# ggml types a KV cache of this engine can hold (kv_type f32 / f16), and their element sizes.
_KV_GGML_TYPES: Final = frozenset({0, 1})
_ELEMENT_BYTES: Final = {0: 4, 1: 2}
_ELEMENT_DTYPES: Final[dict[int, np.dtype[np.floating]]] = {
    0: np.dtype("<f4"),
    1: np.dtype("<f2"),
}
MAX_KV_MAGNITUDE: Final = 65504.0
"""The largest |value| an imported K or V element may have: float16's largest finite value,
what a ``kv_type=f16`` cache can hold at all. It keeps every attention score finite."""
_U32 = struct.Struct("<I")
_HEADER = struct.Struct("<Ii")
_CELL = struct.Struct("<iIi")
_K_LAYER = struct.Struct("<iQ")
_V_TRANS_LAYER = struct.Struct("<iII")


class StateFormatError(ValueError):
    """The bytes are not a sequence state this engine would have written."""


@dataclass(frozen=True, slots=True)
class Geometry:
    """What a state for this context may declare: at most ``max_layers`` layers per cache
    (the blocks of the shard file) and at most ``max_row_bytes`` bytes in one cell's K or V
    of one layer (an upper bound of the shard's widest: see
    ``_gguf.hyperparameters.kv_row_bound``)."""

    max_layers: int
    max_row_bytes: int


@dataclass(frozen=True, slots=True)
class CacheSection:
    """One KV cache's part of a sequence state: positions ``first .. first+cells-1`` and the
    byte range ``[data_start, data_end)`` of its ``v_trans``/layer fields and tensors."""

    first_position: int
    cell_count: int
    v_trans: bool
    n_layers: int
    data_start: int
    data_end: int
    order: tuple[int, ...] | None = None
    """The cells in position order, when the blob lists them otherwise (see :func:`parse`'s
    ``any_order``): ``order[k]`` is the cell holding position ``first_position + k``."""


@dataclass(frozen=True, slots=True)
class SequenceState:
    """A parsed state: its length (positions held by the full cache) and its caches."""

    length: int
    sections: tuple[CacheSection, ...]

    def window_floor(self, n_swa: int) -> int:
        """The lowest position a truncation may go back to and still find every cell a
        windowed cache needs (0 when every cache holds the whole sequence)."""
        first = max(section.first_position for section in self.sections)
        if first == 0:
            return 0
        return first + n_swa - 1


class _Reader:
    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.offset = 0

    def take(self, layout: struct.Struct, what: str) -> tuple[int, ...]:
        end = self.offset + layout.size
        if end > len(self.data):
            raise StateFormatError(f"state ends inside {what} at byte {self.offset}")
        values = layout.unpack_from(self.data, self.offset)
        self.offset = end
        return tuple(int(value) for value in values)

    def block(self, n_bytes: int, what: str) -> memoryview:
        start = self.offset
        self.skip(n_bytes, what)
        return self.data[start : self.offset]

    def skip(self, n_bytes: int, what: str) -> None:
        if n_bytes > len(self.data) - self.offset:
            raise StateFormatError(
                f"{what} needs {n_bytes} bytes at byte {self.offset}, "
                f"{len(self.data) - self.offset} remain"
            )
        self.offset += n_bytes


def _cache_data(
    reader: _Reader,
    cells: int,
    where: str,
    kv_ggml_type: int | None,
    expected_v_trans: int | None,
    geometry: Geometry | None,
    check_values: bool,
) -> tuple[bool, int]:
    """Walk the v_trans flag, layer count and per-layer tensors of one cache."""
    types = _KV_GGML_TYPES if kv_ggml_type is None else frozenset({kv_ggml_type})
    v_trans, n_layers = reader.take(struct.Struct("<II"), f"{where} layer header")
    if v_trans not in (0, 1):
        raise StateFormatError(f"{where}: v_trans is {v_trans}, not 0 or 1")
    if expected_v_trans is not None and v_trans != expected_v_trans:
        raise StateFormatError(
            f"{where}: V is {'' if v_trans else 'not '}transposed, this context's is "
            f"{'' if expected_v_trans else 'not'} (flash attention differs)"
        )
    # A cache may hold cells and no layer: a shard of only full-attention layers still has
    # its (empty) sliding-window cache.
    max_layers = _MAX_LAYERS if geometry is None else min(_MAX_LAYERS, geometry.max_layers)
    if n_layers > max_layers:
        raise StateFormatError(f"{where}: {n_layers} layers exceed this shard's {max_layers}")

    def row_width(ggml_type: int, row: int, what: str) -> None:
        if ggml_type not in types:
            raise StateFormatError(f"{where}: {what} has ggml type {ggml_type}")
        if row <= 0 or row % _ELEMENT_BYTES[ggml_type]:
            raise StateFormatError(
                f"{where}: {what} rows of {row} bytes are not a positive whole number of "
                f"{_ELEMENT_BYTES[ggml_type]}-byte elements"
            )
        if geometry is not None and row > geometry.max_row_bytes:
            raise StateFormatError(
                f"{where}: {what} rows of {row} bytes exceed this shard's widest, "
                f"{geometry.max_row_bytes}"
            )

    def values(ggml_type: int, n_bytes: int, what: str) -> None:
        block = reader.block(n_bytes, f"{where}: {what}")
        if check_values:
            _check_values(block, ggml_type, f"{where}: {what}")

    for layer in range(n_layers):
        k_type, row = reader.take(_K_LAYER, f"{where} K header of layer {layer}")
        row_width(k_type, row, f"K of layer {layer}")
        values(k_type, row * cells, f"K of layer {layer}")
    for layer in range(n_layers):
        if v_trans:
            v_type, element, n_embd = reader.take(
                _V_TRANS_LAYER, f"{where} V header of layer {layer}"
            )
            if v_type in _ELEMENT_BYTES and element != _ELEMENT_BYTES[v_type]:
                raise StateFormatError(
                    f"{where}: V of layer {layer} declares {element}-byte elements of ggml "
                    f"type {v_type}"
                )
            row_width(v_type, element * n_embd, f"V of layer {layer}")
            values(v_type, element * n_embd * cells, f"V of layer {layer}")
        else:
            v_type, row = reader.take(_K_LAYER, f"{where} V header of layer {layer}")
            row_width(v_type, row, f"V of layer {layer}")
            values(v_type, row * cells, f"V of layer {layer}")
    return bool(v_trans), n_layers


def _check_values(block: memoryview, ggml_type: int, what: str) -> None:
    """Refuse elements that are not finite or exceed :data:`MAX_KV_MAGNITUDE`."""
    elements = np.frombuffer(block, dtype=_ELEMENT_DTYPES[ggml_type])
    # NaN fails the comparison too; float16 holds nothing finite beyond the bound.
    sound = np.isfinite(elements) if ggml_type == 1 else np.abs(elements) <= MAX_KV_MAGNITUDE
    if not sound.all():
        index = int(np.flatnonzero(~sound)[0])
        raise StateFormatError(
            f"{what}: element {index} is {float(elements[index])!r}; K and V values must be "
            f"finite and within +-{MAX_KV_MAGNITUDE:g}"
        )


def parse(
    blob: bytes | bytearray | memoryview,
    *,
    n_stream: int,
    seq_id: int,
    n_sections: int,
    max_cells: int,
    kv_ggml_type: int | None = None,
    v_trans: int | None = None,
    geometry: Geometry | None = None,
    check_values: bool = False,
    any_order: bool = False,
) -> SequenceState:
    """Check ``blob`` field by field and return where its parts are.

    ``n_stream``, ``seq_id``: what the header and cells must say (1 and 0 for the portable
    form). ``n_sections``: how many KV caches the context has. ``max_cells``: the cells one
    sequence may hold. ``kv_ggml_type``, ``v_trans``: the context's KV tensor type and V
    layout, when given. ``geometry``: the layer count and row widths the context allows.
    ``check_values``: refuse K and V elements that are not finite or exceed
    :data:`MAX_KV_MAGNITUDE` (a state from elsewhere). ``any_order``: the cells may list
    their positions in any order (a blob this context wrote: llama.cpp writes a sequence's
    cells in cell order, and after a rollback freed cells below others it places later
    positions in them), recorded in each section's ``order``; else they must be in position
    order (the portable form). Raises StateFormatError for anything else.
    """
    data = memoryview(blob).cast("B")
    reader = _Reader(data)
    magic, header_seq = reader.take(_HEADER, "the header")
    if magic != IO_MAGIC:
        raise StateFormatError(f"state magic is {magic:#010x}, not {IO_MAGIC:#010x}")
    if header_seq != seq_id:
        raise StateFormatError(f"state is of sequence {header_seq}, expected {seq_id}")
    sections: list[CacheSection] = []
    for index in range(n_sections):
        where = f"cache {index}"
        (streams,) = reader.take(_U32, f"{where} stream count")
        if streams != n_stream:
            raise StateFormatError(f"{where}: {streams} streams, expected {n_stream}")
        section: CacheSection | None = None
        for stream in range(streams):
            (cells,) = reader.take(_U32, f"{where} cell count of stream {stream}")
            if cells == 0:
                continue
            if section is not None:
                raise StateFormatError(f"{where}: cells in more than one stream")
            if cells > max_cells:
                raise StateFormatError(
                    f"{where}: {cells} cells exceed the {max_cells} a sequence may hold"
                )
            records = reader.block(cells * _CELL.size, f"{where} cell records")
            table = np.frombuffer(records, dtype="<i4").reshape(cells, 3)
            foreign = np.flatnonzero((table[:, 1] != 1) | (table[:, 2] != seq_id))
            if foreign.size:
                cell = int(foreign[0])
                raise StateFormatError(
                    f"{where}: cell {cell} belongs to {int(table[cell, 1])} sequence(s) "
                    f"(id {int(table[cell, 2])}), expected only sequence {seq_id}"
                )
            positions = table[:, 0]
            order: tuple[int, ...] | None = None
            if any_order and np.any(positions[1:] < positions[:-1]):
                permutation = np.argsort(positions, kind="stable")
                positions = positions[permutation]
                order = tuple(int(cell) for cell in permutation)
            first = int(positions[0])
            misplaced = np.flatnonzero(positions != first + np.arange(cells, dtype=np.int64))
            if first < 0 or misplaced.size:
                cell = int(misplaced[0]) if misplaced.size else 0
                if order is not None:
                    raise StateFormatError(
                        f"{where}: the cells hold positions {first}.. with a gap or a repeat "
                        f"at the {cell}th in order ({int(positions[cell])})"
                    )
                raise StateFormatError(
                    f"{where}: cell {cell} is at position {int(table[cell, 0])}; positions "
                    "must be contiguous and increasing from 0 or a window start"
                )
            start = reader.offset
            flag, n_layers = _cache_data(
                reader, cells, where, kv_ggml_type, v_trans, geometry, check_values
            )
            section = CacheSection(first, cells, flag, n_layers, start, reader.offset, order)
        sections.append(section or CacheSection(0, 0, False, 0, reader.offset, reader.offset))
    if reader.offset != len(data):
        raise StateFormatError(
            f"{len(data) - reader.offset} bytes follow the last cache ({reader.offset} bytes)"
        )
    if not sections:
        return SequenceState(0, ())
    length = sections[0].cell_count
    if sections[0].first_position != 0:
        raise StateFormatError("the full cache does not start at position 0")
    for index, section in enumerate(sections[1:], start=1):
        if section.cell_count == 0 and length == 0:
            continue
        if section.first_position + section.cell_count != length:
            raise StateFormatError(
                f"cache {index} holds positions {section.first_position}.."
                f"{section.first_position + section.cell_count - 1}, not a window ending at "
                f"{length - 1}"
            )
    return SequenceState(length, tuple(sections))


def _section_data(
    data: memoryview,
    section: CacheSection,
    cell_rows: Callable[[memoryview, int], list[bytes | memoryview]],
) -> list[bytes | memoryview]:
    """The layer fields and tensors of ``section`` (the cell count itself is written by the
    caller), each block of per-cell rows (a layer's K rows, its V rows, or for a transposed V
    one channel's element of every cell) replaced by ``cell_rows(block, row width)``."""
    cells = section.cell_count
    parts: list[bytes | memoryview] = [data[section.data_start : section.data_start + 8]]
    offset = section.data_start + 8

    def rows(width: int) -> None:
        nonlocal offset
        parts.extend(cell_rows(data[offset : offset + width * cells], width))
        offset += width * cells

    for _ in range(section.n_layers):
        _, row = _K_LAYER.unpack_from(data, offset)
        parts.append(data[offset : offset + _K_LAYER.size])
        offset += _K_LAYER.size
        rows(row)
    for _ in range(section.n_layers):
        if section.v_trans:
            # One row per V channel, each holding every cell's element of that channel.
            _, element, n_embd = _V_TRANS_LAYER.unpack_from(data, offset)
            parts.append(data[offset : offset + _V_TRANS_LAYER.size])
            offset += _V_TRANS_LAYER.size
            for _ in range(n_embd):
                rows(element)
        else:
            _, row = _K_LAYER.unpack_from(data, offset)
            parts.append(data[offset : offset + _K_LAYER.size])
            offset += _K_LAYER.size
            rows(row)
    return parts


def _padded_data(data: memoryview, section: CacheSection, pad: int) -> list[bytes | memoryview]:
    """The layer fields and tensors of ``section`` with ``pad`` zero cells in front of its
    first cell, its cells in position order (each K row, each V row and, for a transposed V,
    each channel's element of a cell moves with its cell; see :class:`CacheSection`)."""
    order = section.order
    if order is not None:
        if pad:
            raise StateFormatError("cells out of position order cannot be padded")
        cell_order = np.asarray(order, dtype=np.intp)

        def ordered(block: memoryview, width: int) -> list[bytes | memoryview]:
            rows = np.frombuffer(block, dtype=np.uint8).reshape(len(order), width)
            return [rows[cell_order].tobytes()]

        return _section_data(data, section, ordered)
    if pad == 0:
        return [data[section.data_start : section.data_end]]
    return _section_data(data, section, lambda block, width: [bytes(pad * width), block])


def _rebuild(
    blob: bytes | bytearray | memoryview,
    state: SequenceState,
    *,
    n_stream: int,
    stream: int,
    seq_id: int,
    pad_windows: bool,
    prefix: bytes = b"",
) -> bytes:
    """The same caches with one filled stream at index ``stream`` of ``n_stream``.

    ``pad_windows``: give a windowed cache zero-valued cells for the positions before its
    window, so that every cache holds positions ``0..length-1`` in cells ``0..length-1``,
    as the exporting context did (llama.cpp reduces attention over cells in cell order:
    the same values in other cells round differently). The padding is never attended: those
    positions are outside the window of every later position (see ``window_floor``).
    """
    data = memoryview(blob).cast("B")
    parts: list[bytes | memoryview] = [prefix, _HEADER.pack(IO_MAGIC, seq_id)]
    for section in state.sections:
        parts.append(_U32.pack(n_stream))
        if section.cell_count == 0:
            parts.append(bytes(4 * n_stream))
            continue
        pad = section.first_position if pad_windows else 0
        first = section.first_position - pad
        cells = section.cell_count + pad
        parts.append(bytes(4 * stream))
        parts.append(_U32.pack(cells))
        table = np.empty((cells, 3), dtype="<i4")
        table[:, 0] = np.arange(first, first + cells)
        table[:, 1] = 1
        table[:, 2] = seq_id
        parts.append(table.tobytes())
        parts += _padded_data(data, section, pad)
        parts.append(bytes(4 * (n_stream - stream - 1)))
    return b"".join(parts)


def max_portable_bytes(geometry: Geometry, length: int, n_sections: int) -> int:
    """An upper bound of the portable form's size for ``length`` positions: ``n_sections``
    caches of at most ``length`` cells, which share the model's layers between them (a
    sliding-window model keeps its local and global layers in separate caches), each cell's K
    and V of a layer at most ``geometry.max_row_bytes`` (every field of the layout above
    counted at its widest)."""
    cells = max(0, length)
    per_layer = 2 * (16 + cells * geometry.max_row_bytes)  # K and V: type, row size, rows
    per_section = 8 + cells * 12 + 8  # stream and cell counts, cells, v_trans and n_layer
    return 8 + max(1, n_sections) * per_section + geometry.max_layers * per_layer


def portable(
    blob: bytes | bytearray | memoryview,
    *,
    n_stream: int,
    seq_id: int,
    n_sections: int,
    max_cells: int,
    kv_ggml_type: int | None = None,
    v_trans: int | None = None,
    geometry: Geometry | None = None,
    prefix: bytes = b"",
) -> tuple[bytes, SequenceState]:
    """The portable form (one stream, sequence 0) of a blob this context wrote for
    ``seq_id``, after ``prefix``, and what it holds. Its cells are in position order whatever
    cells llama.cpp keeps them in: a session's snapshot does not depend on how rollbacks left
    its cells (an export of cells out of position order failed, and failed the engine)."""
    state = parse(
        blob,
        n_stream=n_stream,
        seq_id=seq_id,
        n_sections=n_sections,
        max_cells=max_cells,
        kv_ggml_type=kv_ggml_type,
        v_trans=v_trans,
        geometry=geometry,
        any_order=True,
    )
    portable_blob = _rebuild(
        blob, state, n_stream=1, stream=0, seq_id=0, pad_windows=False, prefix=prefix
    )
    return portable_blob, state


def localize(
    blob: bytes | bytearray | memoryview,
    *,
    n_stream: int,
    seq_id: int,
    n_sections: int,
    max_cells: int,
    kv_ggml_type: int | None = None,
    v_trans: int | None = None,
    geometry: Geometry | None = None,
    check_values: bool = False,
) -> tuple[bytes, SequenceState]:
    """A blob for sequence ``seq_id`` of a context with ``n_stream`` streams, from a portable
    one (checked with :func:`parse` first), and what it holds."""
    if not 0 <= seq_id < n_stream:
        raise StateFormatError(f"sequence {seq_id} outside [0, {n_stream})")
    state = parse(
        blob,
        n_stream=1,
        seq_id=0,
        n_sections=n_sections,
        max_cells=max_cells,
        kv_ggml_type=kv_ggml_type,
        v_trans=v_trans,
        geometry=geometry,
        check_values=check_values,
    )
    rebuilt = _rebuild(
        blob, state, n_stream=n_stream, stream=seq_id, seq_id=seq_id, pad_windows=True
    )
    return rebuilt, state
