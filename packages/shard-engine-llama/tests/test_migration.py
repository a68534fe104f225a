"""Moving a live session between llama engines through its llama.cpp sequence state: the
continuation equals the unmoved run bit for bit for head, middle, tail and full shards of a
dense, a mixture-of-experts and a sliding-window family; malformed, truncated and foreign
states are refused with a typed error, the slot left empty and the engine serving."""

from __future__ import annotations

import ctypes
import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

import msgspec
import numpy as np
import pytest
from migration_support import (
    export_snapshot,
    forged,
    import_snapshot,
    move_session,
    over_the_wire,
)

from shard_engine_api import (
    BoundaryResult,
    CacheMiss,
    Cancelled,
    InvalidRequest,
    LoadConfig,
    LogitsResult,
    Pipeline,
    PrefillRequest,
    ReleaseRequest,
    ResourceExhausted,
    SessionRef,
    ShardInput,
    ShardMismatch,
    ShardSpec,
    TokenInput,
)
from shard_engine_llama import LlamaEngine, _abi, _state
from shard_engine_llama._tiny_model import write_tiny_model

N_LAYERS: Final = 6
SPLITS: Final = {"full": [(0, 6)], "3-way": [(0, 2), (2, 4), (4, 6)]}
# (family, generator arguments); gemma3's window of 8 is shorter than the prompts.
FAMILIES: Final = {
    "llama": {"arch": "llama"},
    "qwen3moe": {"arch": "qwen3moe"},
    "gemma3": {"arch": "gemma3", "sliding_window": 8},
}
PROMPT: Final = tuple((index * 37 + 5) % 250 for index in range(21))
OTHER: Final = tuple((index * 11 + 3) % 250 for index in range(13))
DECODED: Final = (33, 7, 201, 12)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("migration-models")
    paths: dict[str, Path] = {}
    for name, arguments in FAMILIES.items():
        paths[name] = directory / f"{name}.gguf"
        write_tiny_model(paths[name], n_layers=N_LAYERS, seed=5, **arguments)  # type: ignore[arg-type]
    return paths


def _load(
    model: Path,
    start: int,
    end: int,
    *,
    max_context: int = 256,
    kv_budget_tokens: int = 16384,
    **options: str | bool,
) -> LlamaEngine:
    engine = LlamaEngine()
    engine.load(
        LoadConfig(
            shard=ShardSpec(model=str(model), n_layers=N_LAYERS, start=start, end=end),
            max_sessions=4,
            max_context=max_context,
            kv_budget_tokens=kv_budget_tokens,
            options={"n_ubatch": 4, "model_store": str(model.parent / "store"), **options},
        )
    )
    return engine


def _pipeline(model: Path, split: str) -> list[LlamaEngine]:
    return [_load(model, start, end) for start, end in SPLITS[split]]


def _close(engines: Sequence[LlamaEngine]) -> None:
    for engine in engines:
        engine.close()


def _slot(engine: LlamaEngine, session: SessionRef) -> int:
    return engine._ledger.sessions[session.session_id].slot


def _positions(engine: LlamaEngine, slot: int) -> int:
    runtime = engine._runtime
    assert runtime is not None
    return runtime.seq_pos_max(slot) + 1


def _continue(pipeline: Pipeline, session: SessionRef, start: int) -> Iterator[np.ndarray]:
    for offset, token in enumerate(DECODED):
        yield pipeline.decode(session, start + offset, token).array()


def _reversed_rows(data: memoryview, section: _state.CacheSection) -> list[bytes]:
    """The layer fields and tensors of ``section`` (see ``_state``'s layout) with every cell's
    K row, V row or transposed V elements moved to the mirrored cell."""
    cells = section.cell_count
    parts: list[bytes] = []
    offset = section.data_start
    parts.append(bytes(data[offset : offset + 8]))  # v_trans, n_layer
    offset += 8

    def mirrored(width: int) -> bytes:
        block = np.frombuffer(data, np.uint8, width * cells, offset).reshape(cells, width)
        return block[::-1].tobytes()

    for kind in ("k", "v"):
        for _ in range(section.n_layers):
            if kind == "v" and section.v_trans:
                _, element, n_embd = struct.unpack_from("<iII", data, offset)
                parts.append(bytes(data[offset : offset + 12]))
                offset += 12
                for _ in range(n_embd):
                    parts.append(mirrored(element))
                    offset += element * cells
            else:
                _, row = struct.unpack_from("<iQ", data, offset)
                parts.append(bytes(data[offset : offset + 12]))
                offset += 12
                parts.append(mirrored(row))
                offset += row * cells
    assert offset == section.data_end
    return parts


def _scramble_cells(engine: LlamaEngine, slot: int) -> list[int]:
    """Rewrite ``slot``'s cache with its cells in reverse position order (the same positions,
    K and V), as llama.cpp may keep them after rollbacks freed cells below others; returns
    the positions in cell order that llama.cpp then writes for the slot."""
    import llama_cpp  # the engine loaded it

    runtime = engine._runtime
    assert runtime is not None
    n_stream = runtime.settings.n_seq_max
    with runtime._lock:
        context = runtime._require_open()
        raw = bytes(runtime._raw_state(context, slot))
        state = _state.parse(raw, n_stream=n_stream, seq_id=slot, **runtime._state_limits())
        data = memoryview(raw)
        parts: list[bytes | memoryview] = [raw[:8]]
        for section in state.sections:
            parts.append(struct.pack("<I", n_stream))
            if section.cell_count == 0:
                parts.append(bytes(4 * n_stream))
                continue
            cells = section.cell_count
            table = np.frombuffer(
                raw, dtype="<i4", count=3 * cells, offset=section.data_start - 12 * cells
            ).reshape(cells, 3)
            parts += [bytes(4 * slot), struct.pack("<I", cells), table[::-1].tobytes()]
            parts += _reversed_rows(data, section)
            parts.append(bytes(4 * (n_stream - slot - 1)))
        blob = b"".join(parts)
        assert len(blob) == len(raw)
        llama_cpp.llama_memory_seq_rm(runtime._memory, slot, -1, -1)
        buffer = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        assert llama_cpp.llama_state_seq_set_data(context, buffer, len(blob), slot) == len(blob)
        written = bytes(runtime._raw_state(context, slot))
    (cells,) = struct.unpack_from("<I", written, 12 + 4 * slot)
    start = 16 + 4 * slot
    return [int(pos) for pos in np.frombuffer(written, "<i4", 3 * cells, start)[::3]]


@pytest.mark.parametrize("family", FAMILIES)
def test_cells_out_of_position_order_export_as_the_session_in_order(
    models: dict[str, Path], family: str
) -> None:
    """llama.cpp keeps a sequence's positions in whatever cells it finds free (after a
    rollback freed cells below others, later positions land below earlier ones) and writes
    its state in cell order. A session so kept exports the same snapshot as the same session
    in order, and the engine keeps serving: the export refused such a state as one it did not
    know and failed the engine (seen with 16 threads and random cancels on a spawned child)."""
    engine = _load(models[family], 0, N_LAYERS)
    try:
        engine.prefill(
            PrefillRequest(
                request_id="p", session=S, start_pos=0, inputs=TokenInput(token_ids=PROMPT)
            )
        )
        before = export_snapshot(engine, S)
        positions = _scramble_cells(engine, _slot(engine, S))
        assert positions != sorted(positions)
        after = export_snapshot(engine, S)
        assert (after.chunks, after.checksum, after.length) == (
            before.chunks,
            before.checksum,
            before.length,
        )
        assert engine.health().state == "ready"
    finally:
        engine.close()


S: Final = SessionRef(session_id="moving", epoch=3)
T: Final = SessionRef(session_id="second", epoch=1)
PREVIOUS: Final = SessionRef(session_id="previous", epoch=1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("split", "moved"),
    [("full", 0), ("3-way", 0), ("3-way", 1), ("3-way", 2)],
    ids=["full", "head", "middle", "tail"],
)
def test_moved_shard_continues_bit_for_bit(
    models: dict[str, Path], family: str, split: str, moved: int
) -> None:
    """One shard of a pipeline is replaced, mid-session, by a fresh engine that imported its
    two sessions into slots that held another session before; single and batched decode
    steps then equal the pipeline that never moved, bit for bit."""
    model = models[family]
    unmoved = _pipeline(model, split)
    source = _pipeline(model, split)
    target = _load(model, *SPLITS[split][moved])
    try:
        reference = Pipeline(unmoved)
        moving = Pipeline(source)
        for pipeline in (reference, moving):
            pipeline.prefill(S, 0, PROMPT)
            pipeline.prefill(T, 0, OTHER)
        # The target's slots held other sessions' positions before the import.
        used = _warm(
            [*source[:moved], target],
            [(PREVIOUS, OTHER), (SessionRef(session_id="p2", epoch=1), PROMPT[:5])],
        )
        assert {
            move_session(source[moved], target, S),
            move_session(source[moved], target, T),
        } == used
        moved_pipeline = Pipeline([*source[:moved], target, *source[moved + 1 :]])
        for expected, actual in zip(
            _continue(reference, S, len(PROMPT)),
            _continue(moved_pipeline, S, len(PROMPT)),
            strict=True,
        ):
            assert np.std(expected) > 0.05, "degenerate logits make equality meaningless"
            np.testing.assert_array_equal(actual, expected)
        positions = (len(PROMPT) + len(DECODED), len(OTHER))
        expected_rows = reference.decode_batch([S, T], positions, [9, 10])
        actual_rows = moved_pipeline.decode_batch([S, T], positions, [9, 10])
        for expected_row, actual_row in zip(expected_rows, actual_rows, strict=True):
            np.testing.assert_array_equal(actual_row.array(), expected_row.array())
    finally:
        _close([*unmoved, *source, target])


def _warm(
    engines: Sequence[LlamaEngine], sessions: Sequence[tuple[SessionRef, Sequence[int]]]
) -> set[int]:
    """Prefill sessions through ``engines`` (head first, each fed by the one before), then
    release them everywhere; returns the last engine's slots, which held their positions."""
    slots = set()
    for session, tokens in sessions:
        inputs: ShardInput = TokenInput(token_ids=tuple(tokens))
        for index, engine in enumerate(engines):
            result = engine.prefill(
                PrefillRequest(
                    request_id=f"warm-{session.session_id}-{index}",
                    session=session,
                    start_pos=0,
                    inputs=inputs,
                )
            )
            if isinstance(result, BoundaryResult):
                inputs = result.bundle
        slot = _slot(engines[-1], session)
        assert _positions(engines[-1], slot) == len(tokens)
        slots.add(slot)
    for session, _ in sessions:
        for engine in engines:
            engine.release(ReleaseRequest(session=session))
    return slots


def _full(
    model: Path, *, max_context: int = 256, kv_budget_tokens: int = 16384, **options: str | bool
) -> LlamaEngine:
    return _load(
        model, 0, N_LAYERS, max_context=max_context, kv_budget_tokens=kv_budget_tokens, **options
    )


def _empty(engine: LlamaEngine, session: SessionRef) -> bool:
    """No slot of ``engine`` holds a position of a session the ledger does not know, and
    ``session`` is not known."""
    known = {entry.slot for entry in engine._ledger.sessions.values()}
    slots = range(engine.capabilities().limits.max_sessions + 1)
    return session.session_id not in engine._ledger.sessions and all(
        _positions(engine, slot) == 0 for slot in slots if slot not in known
    )


def _prefill_tokens(engine: LlamaEngine, session: SessionRef, tokens: Sequence[int]) -> None:
    engine.prefill(
        PrefillRequest(
            request_id=f"p-{session.session_id}",
            session=session,
            start_pos=0,
            inputs=TokenInput(token_ids=tuple(tokens)),
        )
    )


def _warm_keep(
    engine: LlamaEngine, session: SessionRef, tokens: Sequence[int], start: int
) -> np.ndarray:
    """The logits of a prefill of ``tokens`` at ``start`` on a full shard."""
    result = engine.prefill(
        PrefillRequest(
            request_id=f"p-{session.session_id}-{start}",
            session=session,
            start_pos=start,
            inputs=TokenInput(token_ids=tuple(tokens)),
        )
    )
    assert isinstance(result, LogitsResult)
    return result.array()


@pytest.mark.parametrize("length", [1, 256], ids=["length-1", "length-max"])
def test_export_at_length_one_and_at_the_context_limit(
    models: dict[str, Path], length: int
) -> None:
    """A 1-position session and one filling the whole per-sequence context move and go on
    exactly: decode (length 1) or a 1-token truncating prefill at the last position (full
    context); a second export of the imported session is byte-identical to the first."""
    model = models["gemma3"]
    source, reference, target = (_full(model) for _ in range(3))
    try:
        tokens = [(index * 7 + 1) % 250 for index in range(length)]
        for engine in (source, reference):
            _prefill_tokens(engine, S, tokens)
        assert source.capabilities().limits.max_context == 256
        snapshot = export_snapshot(source, S)
        assert snapshot.length == length
        slot = import_snapshot(target, over_the_wire(snapshot, target))
        assert _positions(target, slot) == length
        assert export_snapshot(target, S).chunks == snapshot.chunks
        if length < 256:
            np.testing.assert_array_equal(
                _warm_keep(target, S, [3], length), _warm_keep(reference, S, [3], length)
            )
        else:
            np.testing.assert_array_equal(
                _warm_keep(target, S, [3], length - 1), _warm_keep(reference, S, [3], length - 1)
            )
    finally:
        _close([source, reference, target])


def test_a_state_longer_than_the_context_is_refused_before_llama_cpp(
    models: dict[str, Path],
) -> None:
    """A session longer than the target's context: its snapshot (from an engine with a
    longer context) is ShardMismatch; with the header forged to the target's and the true
    length, the core refuses the length; with a forged 1-position header around the long
    state, the state check refuses its cell count before llama.cpp sizes anything from it.
    Each time the slot stays empty and the engine serves on."""
    model = models["llama"]
    source = _full(model, max_context=512)
    target = _full(model)
    try:
        _prefill_tokens(source, S, [(index * 3) % 250 for index in range(300)])
        _prefill_tokens(target, T, OTHER[:1])
        snapshot = export_snapshot(source, S)
        template = msgspec.structs.replace(export_snapshot(target, T), session=S)
        with pytest.raises(ShardMismatch):
            import_snapshot(target, snapshot)
        # A peer that forged this engine's identity prefix and header.
        state = target._state_identity + b"".join(snapshot.chunks)[len(source._state_identity) :]
        with pytest.raises(ResourceExhausted):
            import_snapshot(target, forged(template, state, snapshot.length))
        with pytest.raises(InvalidRequest, match="exceed the 256"):
            import_snapshot(target, forged(template, state))
        assert _empty(target, S)
        _prefill_tokens(target, S, OTHER)
    finally:
        _close([source, target])


def test_an_import_beyond_the_kv_budget_is_resource_exhausted(models: dict[str, Path]) -> None:
    """An engine whose KV budget cannot hold the session refuses the import
    (ResourceExhausted) and keeps serving; nothing of the session is installed."""
    model = models["llama"]
    source, target = _full(model), _full(model, kv_budget_tokens=16)
    try:
        _prefill_tokens(source, S, PROMPT)
        with pytest.raises(ResourceExhausted):
            move_session(source, target, S)
        assert _empty(target, S)
        _prefill_tokens(target, T, OTHER)
    finally:
        _close([source, target])


def _foreign_engines(models: dict[str, Path]) -> Iterator[tuple[str, LlamaEngine]]:
    yield "another family (two KV caches)", _full(models["gemma3"])
    yield "another model", _full(models["qwen3moe"])
    yield "another shard range", _load(models["llama"], 0, 2)
    yield "f16 KV cache", _full(models["llama"], kv_type="f16")
    yield "flash attention", _full(models["llama"], flash_attn=True)


def test_states_of_other_models_ranges_and_settings_are_refused(
    models: dict[str, Path],
) -> None:
    """A llama full-shard snapshot imported into engines of another family, model, range, KV
    type or attention kernel is ShardMismatch from the core's fingerprints. Forged into each
    engine's own header (a lying peer), the state is still refused before llama.cpp reads it
    (InvalidRequest: its identity prefix; a same-shaped model's KV would otherwise load).
    The slot stays empty and each engine serves on."""
    source = _full(models["llama"])
    engines: list[LlamaEngine] = [source]
    try:
        _prefill_tokens(source, S, PROMPT)
        snapshot = export_snapshot(source, S)
        state = b"".join(snapshot.chunks)
        for what, target in _foreign_engines(models):
            engines.append(target)
            with pytest.raises(ShardMismatch):
                import_snapshot(target, snapshot)
            _prefill_tokens(target, T, OTHER[:1])
            template = msgspec.structs.replace(export_snapshot(target, T), session=S)
            with pytest.raises(InvalidRequest, match="identity"):
                import_snapshot(target, forged(template, state, snapshot.length))
            assert _empty(target, S), what
            _prefill_tokens(target, S, OTHER)
    finally:
        _close(engines)


def _cell_count_offsets(state: bytes) -> list[int]:
    """Offsets of each cache's cell count in a portable state."""
    offsets = []
    offset = 8
    parsed = _state.parse(state, n_stream=1, seq_id=0, n_sections=2, max_cells=1 << 20)
    for section in parsed.sections:
        offsets.append(offset + 4)
        offset = section.data_end
    return offsets


def test_corrupted_and_truncated_states_are_invalid_requests(models: dict[str, Path]) -> None:
    """Every truncation point of the header and cell records, a missing or extra tail byte,
    a changed identity prefix, a wrong magic, a huge cell count, a cell of two sequences,
    out-of-order positions, a wrong layer count and V layout: InvalidRequest, slot empty,
    engine serving."""
    model = models["gemma3"]
    source, target = _full(model), _full(model)
    try:
        _prefill_tokens(source, S, PROMPT)
        template = export_snapshot(source, S)
        exported, length = b"".join(template.chunks), template.length
        identity = target._state_identity
        assert exported.startswith(identity)
        state = exported[len(identity) :]
        first_cells = _cell_count_offsets(state)[0]
        cells_end = first_cells + 4 + 12 * length

        def patched(offset: int, value: bytes) -> bytes:
            return state[:offset] + value + state[offset + len(value) :]

        bad = {
            "empty": b"",
            "magic": patched(0, b"\0\0\0\0"),
            "sequence id": patched(4, struct.pack("<i", 1)),
            "stream count": patched(8, struct.pack("<I", 2)),
            "huge cell count": patched(first_cells, struct.pack("<I", 0xFFFFFFFF)),
            "cell count one more": patched(first_cells, struct.pack("<I", length + 1)),
            "two sequences in a cell": patched(first_cells + 8, struct.pack("<I", 2)),
            "negative position": patched(first_cells + 4, struct.pack("<i", -1)),
            "repeated position": patched(first_cells + 16, struct.pack("<i", 0)),
            "v_trans 2": patched(cells_end, struct.pack("<I", 2)),
            "layer count": patched(cells_end + 4, struct.pack("<I", 7)),
            "missing last byte": state[:-1],
            "extra byte": state + b"\0",
        }
        bad |= {f"cut at {cut}": state[:cut] for cut in range(0, cells_end + 40, 7)}
        for what, corrupted in bad.items():
            with pytest.raises(InvalidRequest, match="session state refused"):
                import_snapshot(target, forged(template, identity + corrupted))
            assert _empty(target, S), what
        for cut in (0, 1, len(identity) - 1):
            changed = exported[:cut] + b"x" + exported[cut + 1 :]
            with pytest.raises(InvalidRequest, match="identity"):
                import_snapshot(target, forged(template, changed))
        with pytest.raises(InvalidRequest, match="positions"):
            import_snapshot(target, forged(template, exported, length + 1))
        assert _empty(target, S)
        slot = import_snapshot(target, forged(template, exported))
        assert _positions(target, slot) == length
    finally:
        _close([source, target])


def _cells(first: int, count: int) -> bytes:
    return b"".join(struct.pack("<iIi", first + index, 1, 0) for index in range(count))


def _window(first: int, k_rows: Sequence[tuple[int, int, bytes]], v: tuple[int, int, int]) -> bytes:
    """A one-cell, V-transposed cache section at position ``first``: K (type, row bytes,
    data) per layer, then one V header (type, element bytes, channels) with no data."""
    body = struct.pack("<II", 1, 1) + _cells(first, 1) + struct.pack("<II", 1, len(k_rows))
    body += b"".join(struct.pack("<iQ", kind, row) + data for kind, row, data in k_rows)
    return body + struct.pack("<iII", *v)


def test_states_declaring_more_than_the_shard_holds_are_refused_before_any_work(
    models: dict[str, Path],
) -> None:
    """A state whose windowed cache declares rows wider than any of this shard's, rows of
    zero bytes, zero-byte V elements for 2**32 - 1 channels, or rows that are not whole
    elements: refused by the field check, before it is padded into a local state (which
    made a few hundred bytes cost gigabytes and minutes), the slot empty and another
    session's continuation unchanged."""
    model = models["gemma3"]
    source, target, reference = _full(model), _full(model), _full(model)
    try:
        _prefill_tokens(source, S, PROMPT)
        for engine in (target, reference):
            _prefill_tokens(engine, T, OTHER)
        template = export_snapshot(source, S)
        identity = target._state_identity
        state = b"".join(template.chunks)[len(identity) :]
        parsed = _state.parse(state, n_stream=1, seq_id=0, n_sections=2, max_cells=1 << 20)
        full = state[8 : parsed.sections[0].data_end]
        last = len(PROMPT) - 1
        header = struct.pack("<Ii", _state.IO_MAGIC, 0)
        wide = 1 << 21
        crafted = {
            "zero-byte elements": _window(last, [(0, 0, b"")], (0, 0, 0xFFFFFFFF)),
            "wide V channels": _window(last, [(0, 4, bytes(4))], (0, 4, 1 << 30)),
            "wide K rows": _window(last, [(0, wide, bytes(wide))], (0, 4, 1)),
            "part of an element": _window(last, [(0, 6, bytes(6))], (0, 4, 1)),
            "V element of another size": _window(last, [(0, 4, bytes(4))], (0, 2, 2)),
        }
        for what, window in crafted.items():
            with pytest.raises(InvalidRequest, match="session state refused") as refused:
                import_snapshot(target, forged(template, identity + header + full + window))
            assert "cache 1" in str(refused.value), what
            assert _empty(target, S), what
        expected = _warm_keep(reference, T, [5], len(OTHER))
        np.testing.assert_array_equal(_warm_keep(target, T, [5], len(OTHER)), expected)
    finally:
        _close([source, target, reference])


def _first_values(state: bytes, section: _state.CacheSection) -> tuple[int, int, np.dtype]:
    """Offsets of the first K and the first V element of ``section``, and their dtype."""
    offset = section.data_start + 8
    first_k = offset + 12
    kind = 0
    for _ in range(section.n_layers):
        kind, row = struct.unpack_from("<iQ", state, offset)
        offset += 12 + row * section.cell_count
    return first_k, offset + 12, np.dtype("<f4" if kind == 0 else "<f2")


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_states_with_values_that_would_poison_their_slot_are_refused(
    models: dict[str, Path], kv_type: str
) -> None:
    """llama.cpp keeps a released cell's K and V and reads them, masked, for every later
    sequence of its stream (score + -inf, V * 0): a NaN or infinity, or a K large enough to
    overflow a score, would turn every later session of the slot into NaN. Such a state is
    refused before llama.cpp reads it, also behind a header that lies about its length; the
    slot's next sessions compute what a clean engine computes. A state at the bound loads."""
    model = models["gemma3"]
    source, target, clean = (_full(model, kv_type=kv_type) for _ in range(3))
    try:
        _prefill_tokens(source, S, PROMPT)
        template = export_snapshot(source, S)
        identity = target._state_identity
        state = b"".join(template.chunks)[len(identity) :]
        parsed = _state.parse(state, n_stream=1, seq_id=0, n_sections=2, max_cells=1 << 20)
        first_k, first_v, dtype = _first_values(state, parsed.sections[0])
        poisons = [np.nan, np.inf, -np.inf] + ([3e38, -1e5] if kv_type == "f32" else [])

        def patched(offset: int, value: float) -> bytes:
            encoded = np.array([value], dtype=dtype).tobytes()
            return state[:offset] + encoded + state[offset + len(encoded) :]

        cases = [
            (f"{where} {value}", patched(offset, value), template.length)
            for value in poisons
            for where, offset in (("K", first_k), ("V", first_v))
        ]
        cases.append(("K nan, length lie", patched(first_k, np.nan), template.length - 1))
        for what, poisoned, length in cases:
            with pytest.raises(InvalidRequest, match="session state refused") as refused:
                import_snapshot(target, forged(template, identity + poisoned, length))
            assert "finite" in str(refused.value) or "positions" in str(refused.value), what
            assert _empty(target, S), what
        for index in range(3):
            fresh = SessionRef(session_id=f"fresh-{index}", epoch=1)
            np.testing.assert_array_equal(
                _warm_keep(target, fresh, OTHER, 0), _warm_keep(clean, fresh, OTHER, 0)
            )
            for engine in (target, clean):
                engine.release(ReleaseRequest(session=fresh))
        bound = patched(first_k, _state.MAX_KV_MAGNITUDE)
        slot = import_snapshot(target, forged(template, identity + bound))
        assert _positions(target, slot) == template.length
    finally:
        _close([source, target, clean])


def test_truncation_below_an_imported_window_is_a_cache_miss(models: dict[str, Path]) -> None:
    """gemma3's windowed layers export only the window of the last position, so an imported
    session cannot be truncated to a position whose window reaches before it: CacheMiss
    (reason "window", nothing changed). Truncating to the last position or re-prefilling
    from 0 equals the unmoved engine bit for bit."""
    model = models["gemma3"]
    source, reference, target = (_full(model) for _ in range(3))
    try:
        for engine in (source, reference):
            _prefill_tokens(engine, S, PROMPT)
        move_session(source, target, S)
        with pytest.raises(CacheMiss) as caught:
            _warm_keep(target, S, [3], 5)
        assert caught.value.reason == "window"
        assert target._ledger.sessions[S.session_id].length == len(PROMPT)
        last = len(PROMPT) - 1
        np.testing.assert_array_equal(
            _warm_keep(target, S, [3, 4], last), _warm_keep(reference, S, [3, 4], last)
        )
        np.testing.assert_array_equal(
            _warm_keep(target, S, PROMPT[:9], 0), _warm_keep(reference, S, PROMPT[:9], 0)
        )
        np.testing.assert_array_equal(
            _warm_keep(target, S, [7], 4), _warm_keep(reference, S, [7], 4)
        )
    finally:
        _close([source, reference, target])


def test_mutated_states_never_take_the_process_down(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """Mutated states (flipped bytes, boundary values in 32-bit fields, truncations,
    extensions, another length's state, states of other settings or ranges behind this
    engine's identity prefix) of a dense, an MoE and a sliding-window model, full
    and middle shards, imported in a child process: it exits normally, every refusal is
    InvalidRequest, and the engines serve on (state_fuzz.py; SHARD_ENGINE_FUZZ_EXAMPLES sets
    the cases per shard). Fix: a check in _state.parse for the field that got through."""
    cases = int(os.environ.get("SHARD_ENGINE_FUZZ_EXAMPLES", "40"))
    for path in models.values():
        (tmp_path / path.name).symlink_to(path)
    completed = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).parent / "state_fuzz.py"),
            str(tmp_path),
            str(cases),
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    counts = json.loads(completed.stdout.splitlines()[-1])
    assert counts["cases"] == cases * len(models) * 2
    assert counts["accepted"] + counts["refused"] == counts["cases"]
    assert counts["refused"] == counts.get("refused_invalid_request", 0)
    assert counts["refused"] > counts["cases"] // 2


def test_a_failed_truncation_of_a_windowed_session_restores_it_exactly(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollback of a truncating prefill goes through the same state as a move: on gemma3
    past its window, a truncation that fails after the cache was cut leaves decode equal to
    the engine that never truncated, bit for bit, and a later truncation further back than
    the restored window is CacheMiss "window" instead of attending cells that are gone."""
    model = models["gemma3"]
    engine, reference = _full(model), _full(model)
    try:
        for each in (engine, reference):
            _prefill_tokens(each, S, PROMPT)
        runtime = engine._runtime
        assert runtime is not None
        original = runtime.run

        def failing_run(*args: object, **kwargs: object) -> np.ndarray:
            raise _abi.AbortedError("injected")

        monkeypatch.setattr(runtime, "run", failing_run)
        with pytest.raises(Cancelled):
            _warm_keep(engine, S, [1, 2], 15)
        monkeypatch.setattr(runtime, "run", original)
        length = len(PROMPT)
        np.testing.assert_array_equal(
            _warm_keep(engine, S, [9], length), _warm_keep(reference, S, [9], length)
        )
        with pytest.raises(CacheMiss, match="window"):
            _warm_keep(engine, S, [3], 5)
        np.testing.assert_array_equal(
            _warm_keep(engine, S, [4], length), _warm_keep(reference, S, [4], length)
        )
    finally:
        _close([engine, reference])


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_flash_attention_and_f16_kv_states_move_exactly(
    models: dict[str, Path], kv_type: str
) -> None:
    """With flash attention llama.cpp stores V untransposed (another state layout, and
    another window padding); with an f16 KV cache the rows are half the size. gemma3 past
    its window moves and decodes on bit for bit in both."""
    model = models["gemma3"]
    source, reference, target = (_full(model, flash_attn=True, kv_type=kv_type) for _ in range(3))
    try:
        for engine in (source, reference):
            _prefill_tokens(engine, S, PROMPT)
        move_session(source, target, S)
        for offset, token in enumerate(DECODED):
            position = len(PROMPT) + offset
            np.testing.assert_array_equal(
                _warm_keep(target, S, [token], position),
                _warm_keep(reference, S, [token], position),
            )
    finally:
        _close([source, reference, target])
