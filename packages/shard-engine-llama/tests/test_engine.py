"""The llama engine through the ShardEngine contract: split == unsplit bit for bit, rollback,
cancellation, batched decode, untrusted files, shard files as models."""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_edit import TensorEdit, array, f32, rewrite, tensor_offset_position, u32

from shard_engine_api import (
    BoundaryResult,
    CacheMiss,
    Cancelled,
    CancelRequest,
    DecodeBatchRequest,
    DecodeRequest,
    InvalidRequest,
    LoadConfig,
    LogitsResult,
    Pipeline,
    PrefillRequest,
    ResourceExhausted,
    SessionRef,
    ShardEngineError,
    ShardMismatch,
    ShardSpec,
    TokenInput,
    UnsupportedFeature,
    split_layers,
)
from shard_engine_api.engine import TEST_OPTIONS_ENV
from shard_engine_api.wire import payload_checksum
from shard_engine_llama import LlamaEngine, _abi
from shard_engine_llama._fixtures import TINY_MODEL_LAYERS, tiny_model_path
from shard_engine_llama._gguf import MetadataValue, read_gguf_header, split_model
from shard_engine_llama._gguf import store as store_module
from shard_engine_llama._tiny_model import write_tiny_model

PROMPT = (5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11)


def _load(model: Path, start: int, end: int, n_layers: int, **fields: object) -> LlamaEngine:
    engine = LlamaEngine()
    options = {"n_ubatch": 4, "model_store": str(model.parent / "store")}
    extra = fields.pop("options", None)
    if isinstance(extra, dict):
        options.update(extra)
    config: dict[str, object] = {
        "shard": ShardSpec(model=str(model), n_layers=n_layers, start=start, end=end),
        "max_sessions": 4,
        "max_context": 256,
        "options": options,
    }
    config.update(fields)
    engine.load(LoadConfig(**config))  # type: ignore[arg-type]
    return engine


def _pipeline(model: Path, parts: int, n_layers: int = TINY_MODEL_LAYERS) -> list[LlamaEngine]:
    return [_load(model, s, e, n_layers) for s, e in split_layers(n_layers, parts)]


def _close(engines: Sequence[LlamaEngine]) -> None:
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("parts", [2, 3])
def test_split_pipeline_equals_full_shard_bitwise(tiny_model: Path, parts: int) -> None:
    """Greedy generation through head -> (middle) -> tail equals one full shard bit for bit,
    with two sessions interleaved step by step."""
    full = _pipeline(tiny_model, 1)
    split = _pipeline(tiny_model, parts)
    try:
        reference = Pipeline(full).generate(PROMPT, 6)
        result = Pipeline(split).generate(PROMPT, 6)
        assert result.token_ids == reference.token_ids
        assert result.step_logits == reference.step_logits
        caps = [engine.capabilities() for engine in split]
        assert caps[0].role == "head"
        assert caps[-1].role == "tail"
        assert all(c.evidence == "real" for c in caps)
        assert len({c.model_fingerprint for c in caps}) == 1
    finally:
        _close(full + split)


def test_uneven_split_with_f16_weights(tmp_path: Path) -> None:
    model = tmp_path / "f16.gguf"
    write_tiny_model(model, n_layers=5, dtype="f16", seed=3)
    full = [_load(model, 0, 5, 5)]
    split = [_load(model, 0, 1, 5), _load(model, 1, 4, 5), _load(model, 4, 5, 5)]
    try:
        assert Pipeline(split).generate(PROMPT, 4).step_logits == (
            Pipeline(full).generate(PROMPT, 4).step_logits
        )
    finally:
        _close(full + split)


def _prefill(
    engine: LlamaEngine, session: SessionRef, tokens: Sequence[int], start: int = 0
) -> np.ndarray:
    result = engine.prefill(
        PrefillRequest(
            request_id=f"p{start}-{len(tokens)}",
            session=session,
            start_pos=start,
            inputs=TokenInput(token_ids=tuple(tokens)),
        )
    )
    assert isinstance(result, LogitsResult)
    return result.array()


def _decode(engine: LlamaEngine, session: SessionRef, pos: int, token: int) -> np.ndarray:
    result = engine.decode(
        DecodeRequest(
            request_id=f"d{pos}", session=session, pos=pos, inputs=TokenInput(token_ids=(token,))
        )
    )
    assert isinstance(result, LogitsResult)
    return result.array()


def test_logits_hashed_while_copied_out_carry_their_own_checksum(tiny_model: Path) -> None:
    """A tail hashes each logits row as it copies it out of llama.cpp's buffer: every result
    (decode, batched decode, a prefill's last row) carries exactly its payload's checksum, its
    payload is the engine's private read-only row, and an all-rows prefill is hashed whole."""
    engine = _load(tiny_model, 0, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS)
    try:
        sessions = [SessionRef(session_id=f"h{i}", epoch=1) for i in range(3)]
        results: list[LogitsResult] = []
        for i, session in enumerate(sessions):
            last = engine.prefill(
                PrefillRequest(
                    request_id=f"p{i}",
                    session=session,
                    start_pos=0,
                    inputs=TokenInput(token_ids=(3, 4 + i)),
                    logits="all" if i == 2 else "last",
                )
            )
            assert isinstance(last, LogitsResult)
            results.append(last)
        step = engine.decode(
            DecodeRequest(
                request_id="d", session=sessions[0], pos=2, inputs=TokenInput(token_ids=(5,))
            )
        )
        assert isinstance(step, LogitsResult)
        results.append(step)
        items = tuple(
            DecodeRequest(
                request_id=f"b{i}",
                session=session,
                pos=3 if i == 0 else 2,
                inputs=TokenInput(token_ids=(6,)),
            )
            for i, session in enumerate(sessions)
        )
        batch = engine.decode_batch(DecodeBatchRequest(request_id="b", items=items))
        for item in batch.items:
            assert isinstance(item, LogitsResult)
            results.append(item)
        assert results[2].n_rows == 2
        for result in results:
            assert result.checksum == payload_checksum(result.payload)
            assert np.isfinite(result.array()).all()
            with pytest.raises(ValueError, match="read-only"):
                result.array()[0, 0] = 1.0
        assert engine._digests == {}
    finally:
        engine.close()


def test_truncate_failure_restores_the_sequence_exactly(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A truncating prefill that fails after the cache was cut restores the snapshot: the next
    decode at the old committed length equals a run that never truncated."""
    engine = _load(tiny_model, 0, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS)
    reference = _load(tiny_model, 0, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS)
    session = SessionRef(session_id="s", epoch=1)
    try:
        _prefill(engine, session, PROMPT)
        _prefill(reference, session, PROMPT)
        runtime = engine._runtime
        assert runtime is not None
        original = runtime.run

        def failing_run(*args: object, **kwargs: object) -> np.ndarray:
            raise _abi.AbortedError("injected")

        monkeypatch.setattr(runtime, "run", failing_run)
        with pytest.raises(Cancelled):
            _prefill(engine, session, (1, 2), start=4)
        monkeypatch.setattr(runtime, "run", original)
        assert engine.health().kv_used_tokens == len(PROMPT)
        assert np.array_equal(
            _decode(engine, session, len(PROMPT), 33), _decode(reference, session, len(PROMPT), 33)
        )
        truncated = _prefill(engine, session, (1, 2), start=4)
        fresh = _prefill(reference, SessionRef(session_id="fresh", epoch=1), (*PROMPT[:4], 1, 2))
        declared = engine.capabilities().determinism.tolerance_for("logits")
        np.testing.assert_allclose(
            truncated, fresh, rtol=0, atol=declared.bound(float(np.abs(fresh).max()))
        )
    finally:
        _close([engine, reference])


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 layers of n_embd 256: a prefill of LONG_PROMPT in 8-token ubatches is still inside
    llama_decode when another thread cancels or closes."""
    model = tmp_path_factory.mktemp("wide") / "wide.gguf"
    write_tiny_model(model, n_layers=8, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, seed=5)
    return model


LONG_PROMPT = tuple((index * 7) % 250 + 3 for index in range(512))


def _load_wide(model: Path, **fields: object) -> LlamaEngine:
    """The whole wide model, with room for LONG_PROMPT and 8-token ubatches."""
    wide: dict[str, object] = {
        "max_batch_tokens": 512,
        "max_context": 1024,
        "options": {"n_ubatch": 8},
    }
    return _load(model, 0, 8, 8, **(wide | fields))


def _interrupted_prefill(
    engine: LlamaEngine,
    session: SessionRef,
    tokens: Sequence[int],
    interrupt: Callable[[], object],
    start: int = 0,
) -> ShardEngineError:
    """Prefill in another thread and ``interrupt`` it once it runs; the contract error the
    prefill ended with (a prefill that finished first fails the test)."""
    outcome: list[ShardEngineError | None] = []
    started = threading.Event()

    def work() -> None:
        started.set()
        try:
            _prefill(engine, session, tokens, start)
            outcome.append(None)
        except ShardEngineError as error:
            outcome.append(error)

    thread = threading.Thread(target=work)
    thread.start()
    started.wait(5)
    time.sleep(0.02)
    interrupt()
    thread.join(10)
    assert outcome, "the prefill thread did not finish"
    assert outcome[0] is not None, "prefill finished before the interruption"
    return outcome[0]


def test_cancelled_new_session_evicts_nothing_when_every_slot_is_taken(wide_model: Path) -> None:
    """With every slot in use and LRU eviction, a new session's prefill that is cancelled
    mid-forward leaves the idle victim cached (the engine keeps one spare llama.cpp sequence,
    so the eviction happens only at commit); a later successful prefill does evict it."""
    engine = _load_wide(wide_model, max_sessions=1, eviction="lru")
    clean = _load_wide(wide_model, max_sessions=1, eviction="lru")
    idle = SessionRef(session_id="idle", epoch=1)
    newcomer = SessionRef(session_id="new", epoch=1)
    try:
        _prefill(engine, idle, LONG_PROMPT[:4])
        error = _interrupted_prefill(
            engine, newcomer, LONG_PROMPT, lambda: engine.cancel(CancelRequest(session_id="new"))
        )
        assert isinstance(error, Cancelled)
        assert engine.health().sessions == 1
        assert engine.health().kv_used_tokens == 4
        assert engine.metrics().evictions == 0
        _prefill(clean, idle, LONG_PROMPT[:4])
        assert np.array_equal(_decode(engine, idle, 4, 9), _decode(clean, idle, 4, 9))
        _prefill(engine, newcomer, LONG_PROMPT[:3])
        assert engine.metrics().evictions == 1
    finally:
        _close([engine, clean])


def test_cancel_mid_prefill_from_another_thread_rolls_back(wide_model: Path) -> None:
    """A cancel from another thread stops llama_decode at its next node; the session keeps its
    committed length and a replay equals a clean run."""
    engine = _load_wide(wide_model)
    clean = _load_wide(wide_model)
    session = SessionRef(session_id="long", epoch=1)
    try:
        _prefill(engine, session, LONG_PROMPT[:4])
        error = _interrupted_prefill(
            engine,
            session,
            LONG_PROMPT[4:],
            lambda: engine.cancel(CancelRequest(session_id="long")),
            start=4,
        )
        assert isinstance(error, Cancelled)
        assert engine.health().kv_used_tokens == 4
        _prefill(clean, session, LONG_PROMPT[:4])
        assert np.array_equal(_decode(engine, session, 4, 9), _decode(clean, session, 4, 9))
    finally:
        _close([engine, clean])


def test_slow_forward_lets_a_cancel_land_on_the_tiny_model(tiny_model: Path) -> None:
    """``slow_forward_us`` (the conformance fixture's cancellation option) stretches a tiny
    model's prefill past a cancel from another thread, which still stops llama.cpp through its
    abort callback: Cancelled, nothing committed. Out-of-range values are refused."""
    options = {"n_ubatch": 16, "slow_forward_us": 200}
    engine = _load(tiny_model, 0, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS, options=options)
    session = SessionRef(session_id="slow", epoch=1)
    try:
        assert engine._runtime is not None
        assert not engine._runtime.native_callbacks
        error = _interrupted_prefill(
            engine, session, [3] * 64, lambda: engine.cancel(CancelRequest(session_id="slow"))
        )
        assert isinstance(error, Cancelled)
        assert engine.health().kv_used_tokens == 0
    finally:
        engine.close()
    for bad in (-1, 100_001):
        with pytest.raises(InvalidRequest, match="slow_forward_us"):
            _load(
                tiny_model,
                0,
                TINY_MODEL_LAYERS,
                TINY_MODEL_LAYERS,
                options={"slow_forward_us": bad},
            )


@pytest.mark.parametrize(
    ("name", "value", "default"),
    [("inject_crash", True, False), ("inject_abort", True, False), ("slow_forward_us", 200, 0)],
)
@pytest.mark.parametrize("setting", [None, "0", "yes"])
def test_test_options_need_the_process_owners_consent(
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    value: object,
    default: object,
    setting: str | None,
) -> None:
    """A LoadConfig can come from whoever asks a worker to load a shard: the options that crash,
    abort or slow an engine are refused unless the process runs with the variable set to 1
    (nothing runs, the process lives), and their defaults are always accepted."""
    if setting is None:
        monkeypatch.delenv(TEST_OPTIONS_ENV)
    else:
        monkeypatch.setenv(TEST_OPTIONS_ENV, setting)
    engine = LlamaEngine()
    with pytest.raises(InvalidRequest, match=f"{name} is a test-only option") as caught:
        engine.load(
            LoadConfig(
                shard=ShardSpec(model=str(tiny_model), n_layers=TINY_MODEL_LAYERS, start=0, end=2),
                options={"model_store": str(tiny_model.parent / "store"), name: value},
            )
        )
    assert caught.value.details["field"] == f"options.{name}"
    assert TEST_OPTIONS_ENV in caught.value.message
    engine.close()
    loaded = _load(tiny_model, 0, 2, TINY_MODEL_LAYERS, options={name: default})
    try:
        assert loaded.health().state == "ready"
    finally:
        loaded.close()


def test_close_mid_prefill_stops_llama_cpp(wide_model: Path) -> None:
    """close() while another thread's prefill is inside llama_decode sets the abort flag: the
    prefill ends with a contract error and close() returns, the engine closed."""
    engine = _load_wide(wide_model)
    session = SessionRef(session_id="long", epoch=1)
    _interrupted_prefill(engine, session, LONG_PROMPT, engine.close)
    assert engine.health().state == "closed"


def test_a_stale_cancel_does_not_abort_the_next_forward(tiny_model: Path) -> None:
    """The abort flag belongs to the running request only: cancelling a finished or an unknown
    request leaves later forwards alone (bitwise like a clean engine; a cancel that stopped a
    forward is followed by a clean replay in the test above)."""
    engine = _load(tiny_model, 0, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS)
    clean = _load(tiny_model, 0, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS)
    session = SessionRef(session_id="s", epoch=1)
    try:
        for target in (engine, clean):
            _prefill(target, session, PROMPT)
        result = engine.cancel(CancelRequest(session_id="s"))
        assert not result.cancelled
        result = engine.cancel(CancelRequest(request_id="no-such-request"))
        assert not result.cancelled
        assert np.array_equal(
            _decode(engine, session, len(PROMPT), 9), _decode(clean, session, len(PROMPT), 9)
        )
    finally:
        _close([engine, clean])


def test_batched_decode_across_sessions(tiny_model: Path) -> None:
    """One llama_decode for three sessions: rows come back in item order, split == unsplit
    bitwise, and each row equals its single decode within the declared tolerance."""
    sessions = [SessionRef(session_id=f"b{i}", epoch=1) for i in range(3)]
    full = _load(tiny_model, 0, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS)
    single = _load(tiny_model, 0, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS)
    head = _load(tiny_model, 0, 3, TINY_MODEL_LAYERS)
    tail = _load(tiny_model, 3, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS)
    try:
        for index, session in enumerate(sessions):
            prompt = PROMPT[: 3 + index]
            _prefill(full, session, prompt)
            _prefill(single, session, prompt)
            bundle = head.prefill(
                PrefillRequest(
                    request_id="h",
                    session=session,
                    start_pos=0,
                    inputs=TokenInput(token_ids=prompt),
                )
            )
            assert isinstance(bundle, BoundaryResult)
            tail.prefill(
                PrefillRequest(request_id="t", session=session, start_pos=0, inputs=bundle.bundle)
            )
        order = [2, 0, 1]
        items = tuple(
            DecodeRequest(
                request_id=f"i{i}",
                session=sessions[i],
                pos=3 + i,
                inputs=TokenInput(token_ids=(40 + i,)),
            )
            for i in order
        )
        unsplit = full.decode_batch(DecodeBatchRequest(request_id="batch", items=items))
        head_out = head.decode_batch(DecodeBatchRequest(request_id="hb", items=items))
        tail_items = []
        for item, result in zip(items, head_out.items, strict=True):
            assert isinstance(result, BoundaryResult)
            tail_items.append(
                DecodeRequest(
                    request_id=item.request_id,
                    session=item.session,
                    pos=item.pos,
                    inputs=result.bundle,
                )
            )
        split = tail.decode_batch(DecodeBatchRequest(request_id="tb", items=tuple(tail_items)))
        declared = full.capabilities().determinism.tolerance_for("logits")
        for index, unsplit_item, split_item in zip(order, unsplit.items, split.items, strict=True):
            assert isinstance(unsplit_item, LogitsResult)
            assert isinstance(split_item, LogitsResult)
            assert unsplit_item.session == sessions[index]
            assert np.array_equal(unsplit_item.array(), split_item.array())
            alone = _decode(single, sessions[index], 3 + index, 40 + index)
            np.testing.assert_allclose(
                unsplit_item.array(), alone, rtol=0, atol=declared.bound(float(np.abs(alone).max()))
            )
    finally:
        _close([full, single, head, tail])


def test_kv_cells_exhausted_is_resource_exhausted(tiny_model: Path) -> None:
    engine = _load(tiny_model, 0, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS, max_context=256)
    session = SessionRef(session_id="big", epoch=1)
    try:
        limit = engine.capabilities().limits.max_context
        _prefill(engine, session, [3] * 200)
        with pytest.raises(ResourceExhausted):
            _prefill(engine, session, [3] * (limit - 199), start=200)
        with pytest.raises(CacheMiss):
            _decode(engine, session, 150, 3)
        assert engine.health().kv_used_tokens == 200
    finally:
        engine.close()


def test_bad_files_and_unsupported_architectures(tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    write_tiny_model(truncated, n_layers=2)
    truncated.write_bytes(truncated.read_bytes()[:1000])
    with pytest.raises(InvalidRequest):
        _load(truncated, 0, 2, 2)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(InvalidRequest):
        _load(garbage, 0, 2, 2)
    with pytest.raises(InvalidRequest):
        _load(tmp_path / "missing.gguf", 0, 2, 2)
    gemma2 = tmp_path / "gemma2.gguf"
    write_tiny_model(gemma2, arch="gemma2", n_layers=2)
    with pytest.raises(UnsupportedFeature) as refused:
        _load(gemma2, 0, 1, 2)
    assert refused.value.details["rule"] == "embedding-input-scaled"


@pytest.mark.parametrize("role", [(0, 2), (0, 1), (1, 2)])
def test_negative_epsilon_is_refused_before_llama_cpp_sees_it(
    tmp_path: Path, role: tuple[int, int]
) -> None:
    """Such a file used to load "ready" and abort the process on the first prefill
    (GGML_ASSERT(eps >= 0.0f)); now loading any shard of it is an InvalidRequest naming the
    field, and the process lives on."""
    source = tmp_path / "good.gguf"
    write_tiny_model(source, n_layers=2)
    broken = rewrite(
        source,
        tmp_path / "negative-eps.gguf",
        metadata={"llama.attention.layer_norm_rms_epsilon": f32(-1e-5)},
    )
    with pytest.raises(InvalidRequest) as refused:
        _load(broken, role[0], role[1], 2)
    assert refused.value.details == {
        "rule": "hparam-positive-finite",
        "field": "llama.attention.layer_norm_rms_epsilon",
    }


def test_keys_llama_cpp_never_reads_change_nothing(tiny_model: Path, tmp_path: Path) -> None:
    """A file with keys llama.cpp never reads for its family (an older conversion's
    ``tensor_data_layout``, another architecture's key) loads and gives bitwise the logits of
    the file without them."""
    extended = rewrite(
        tiny_model,
        tmp_path / "extended.gguf",
        metadata={
            "llama.tensor_data_layout": MetadataValue(
                "Meta AI original pth", gguf.GGUFValueType.STRING
            ),
            "llama.expert_gating_func": u32(7),
        },
    )
    logits = []
    for model in (tiny_model, extended):
        engine = _load(model, 0, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS)
        try:
            logits.append(
                _prefill(engine, SessionRef(session_id="s", epoch=1), [1, 2, 3, 4]).tobytes()
            )
        finally:
            engine.close()
    assert logits[0] == logits[1]


def test_prebuilt_shard_file_as_model(tiny_model: Path, tmp_path: Path) -> None:
    """A worker that downloads only its shard file loads it directly; the range must match."""
    manifest = split_model(tiny_model, [(0, 2), (2, TINY_MODEL_LAYERS)], tmp_path / "shards")
    head = _load(manifest.shard_path(0), 0, 2, TINY_MODEL_LAYERS)
    try:
        assert head.capabilities().model_fingerprint == manifest.source_sha256
    finally:
        head.close()
    with pytest.raises(ShardMismatch):
        _load(manifest.shard_path(0), 0, 3, TINY_MODEL_LAYERS)
    with pytest.raises(InvalidRequest):
        _load(tiny_model, 0, 2, TINY_MODEL_LAYERS + 1)


def _flip_tensor_byte(path: Path) -> None:
    """Alter one byte of tensor data (not the header), as a damaged download or a tamperer
    would: the file still parses and validates."""
    header = read_gguf_header(path)
    record = max(header.tensors.values(), key=lambda r: r.n_bytes)
    with path.open("r+b") as handle:
        handle.seek(record.offset + record.n_bytes // 2)
        value = handle.read(1)
        handle.seek(record.offset + record.n_bytes // 2)
        handle.write(bytes([value[0] ^ 0x40]))


def test_a_tampered_shard_file_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    """Altered after split, a shard used to load and report the source's fingerprint while
    computing something else; now its bytes are checked against the digest it carries."""
    manifest = split_model(tiny_model, [(0, 2), (2, TINY_MODEL_LAYERS)], tmp_path / "shards")
    tail = manifest.shard_path(1)
    _flip_tensor_byte(tail)
    with pytest.raises(InvalidRequest) as refused:
        _load(tail, 2, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS)
    assert refused.value.details["rule"] == "shard-integrity"


def test_a_tampered_shard_in_the_store_is_rewritten(tiny_model: Path, tmp_path: Path) -> None:
    """The engine's own shard file is verified before reuse; a damaged one is written again
    and the pipeline still equals the unsplit model."""
    store = tmp_path / "store"
    options = {"model_store": str(store)}
    full = _load(tiny_model, 0, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS, options=options)
    head = _load(tiny_model, 0, 3, TINY_MODEL_LAYERS, options=options)
    assert head.shard_path is not None
    head.close()
    _flip_tensor_byte(head.shard_path)
    head = _load(tiny_model, 0, 3, TINY_MODEL_LAYERS, options=options)
    tail = _load(tiny_model, 3, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS, options=options)
    try:
        expected = Pipeline([full]).generate(PROMPT, 3)
        actual = Pipeline([head, tail]).generate(PROMPT, 3)
        assert expected.step_logits == actual.step_logits
    finally:
        _close([full, head, tail])


def _shard_regions(path: Path) -> dict[str, int]:
    """One byte offset in each region of a shard that parses as before when altered: the
    padding after the tensor infos, the padding after a tensor, and every tensor's data."""
    header = read_gguf_header(path)
    records = sorted(header.tensors.values(), key=lambda record: record.offset)
    infos_end = tensor_offset_position(path.read_bytes(), records[-1].name) + 8
    regions: dict[str, int] = {}
    if infos_end < header.data_start:
        regions["padding after the tensor infos"] = infos_end
    for record, following in itertools.pairwise(records):
        if following.offset > record.offset + record.n_bytes:
            regions[f"padding after {record.name}"] = record.offset + record.n_bytes
    for record in records:
        regions[f"data of {record.name}"] = record.offset + record.n_bytes // 2
    return regions


def test_a_shard_altered_anywhere_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    manifest = split_model(tiny_model, [(0, 2), (2, TINY_MODEL_LAYERS)], tmp_path / "shards")
    original = manifest.shard_path(1).read_bytes()
    regions = _shard_regions(manifest.shard_path(1))
    assert len(regions) > len(read_gguf_header(manifest.shard_path(1)).tensors)
    for region, position in regions.items():
        altered = bytearray(original)
        altered[position] ^= 0x01
        manifest.shard_path(1).write_bytes(bytes(altered))
        with pytest.raises(InvalidRequest) as refused:
            _load(manifest.shard_path(1), 2, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS)
        assert refused.value.details["rule"] == "shard-integrity", region


@pytest.mark.parametrize("private_copy", [True, False])
def test_a_symlink_swapped_during_the_load_cannot_slip_another_file_in(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, private_copy: bool
) -> None:
    """The name is pointed at another file after the checks and back once llama.cpp has opened
    it: the identity checks see the verified file both times, so only loading the file that was
    verified (pinned by descriptor, or its private copy) keeps the other one out."""
    manifest = split_model(tiny_model, [(0, 2), (2, TINY_MODEL_LAYERS)], tmp_path / "shards")
    good = manifest.shard_path(1)
    other = tmp_path / "other.gguf"
    other.write_bytes(good.read_bytes())
    _flip_tensor_byte(other)
    link = tmp_path / "tail.gguf"
    link.symlink_to(good)
    real_runtime = _abi.ShardRuntime
    opened: list[tuple[int, bytes]] = []

    def swapping(path: Path, **options: object) -> _abi.ShardRuntime:
        link.unlink()
        link.symlink_to(other)
        try:
            loaded = Path(options.get("load_from") or path)  # type: ignore[arg-type]
            opened.append((loaded.stat().st_ino, loaded.read_bytes()))
            return real_runtime(path, **options)  # type: ignore[arg-type]
        finally:
            link.unlink()
            link.symlink_to(good)

    monkeypatch.setattr(_abi, "ShardRuntime", swapping)
    engine = _load(
        link, 2, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS, options={"private_copy": private_copy}
    )
    try:
        assert len(opened) == 1
        inode, content = opened[0]
        assert content == good.read_bytes()
        assert (inode == good.stat().st_ino) is not private_copy
        assert engine.shard_path == link
    finally:
        engine.close()


def test_verification_is_cached_per_file_identity(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker does not re-hash an unchanged file on every load; a changed one is re-hashed."""
    monkeypatch.setattr(store_module, "RACY_SECONDS", 0.0)
    manifest = split_model(tiny_model, [(0, 2), (2, TINY_MODEL_LAYERS)], tmp_path / "shards")
    cache = store_module.hash_cache()
    _load(manifest.shard_path(1), 2, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS).close()
    computed = cache.computed
    _load(manifest.shard_path(1), 2, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS).close()
    assert cache.computed == computed, "an unchanged shard was hashed again"
    _flip_tensor_byte(manifest.shard_path(1))
    with pytest.raises(InvalidRequest):
        _load(manifest.shard_path(1), 2, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS)
    assert cache.computed == computed + 1


def test_more_sessions_than_batch_rows_loads(tiny_model: Path) -> None:
    """llama.cpp reserves an output row per sequence and asserted (aborting the process) when
    max_sessions exceeded max_batch_tokens; every role now loads and runs such a config."""
    for start, end in ((0, TINY_MODEL_LAYERS), (0, 2), (2, TINY_MODEL_LAYERS)):
        engine = _load(
            tiny_model, start, end, TINY_MODEL_LAYERS, max_batch_tokens=4, max_sessions=8
        )
        engine.close()


def test_unknown_options_are_named_with_the_valid_ones(tiny_model: Path) -> None:
    """An option the engine does not know (n_gpu_layers of another runtime) is refused naming
    it and listing the options there are, test-only ones aside."""
    with pytest.raises(InvalidRequest) as raised:
        _load(tiny_model, 0, 2, TINY_MODEL_LAYERS, options={"n_gpu_layers": 10})
    message = raised.value.message
    assert "unknown llama engine options ['n_gpu_layers']" in message
    for known in ("n_ubatch", "kv_type", "model_store", "tolerance"):
        assert known in message
    assert "inject_crash" not in message


def test_a_shard_file_has_no_tokenizer_and_says_so(tiny_model: Path, tmp_path: Path) -> None:
    """Shards carry tokenizer "none"; the plugin answers None instead of a tokenizer that could
    not encode anything, and the full model still tokenizes. A shard file given where a model
    is described (run's and serve's --model) is ShardMismatch naming its range, before any
    missing tokenizer is reported."""
    from shard_engine_api.engine import engine_description

    manifest = split_model(tiny_model, [(0, 2), (2, TINY_MODEL_LAYERS)], tmp_path / "shards")
    describe = engine_description("llama")
    assert describe.tokenizer is not None
    assert describe.tokenizer(str(manifest.shard_path(0))) is None
    full = describe.tokenizer(str(tiny_model))
    assert full is not None
    assert full.encode("hi")
    assert describe.describe_model is not None
    with pytest.raises(ShardMismatch, match=r"is a shard file \(layers \[2, 6\) of a 6-layer"):
        describe.describe_model(str(manifest.shard_path(1)))
    assert describe.describe_model(str(tiny_model)).has_tokenizer


@pytest.mark.parametrize(
    "options",
    [
        {"tolerance": float("nan")},
        {"tolerance": float("inf")},
        {"tolerance": -1.0},
        {"n_ubatch": 0},
        {"n_ubatch": True},
        {"kv_type": "F32"},
        {"slow_forward_us": -1},
        {"unknown_option": 1},
    ],
    ids=repr,
)
def test_bad_options_are_refused_before_anything_loads(
    tiny_model: Path, options: dict[str, object]
) -> None:
    with pytest.raises(InvalidRequest):
        _load(tiny_model, 0, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS, options=options)


def test_an_unwritable_model_store_is_named_as_such(tiny_model: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "store-is-a-file"
    blocker.write_text("")
    with pytest.raises(InvalidRequest, match="cannot write the shard into the model store"):
        _load(tiny_model, 0, 2, TINY_MODEL_LAYERS, options={"model_store": str(blocker)})


@pytest.mark.parametrize("store", ["a-file", "/proc", "/dev/null"])
def test_the_tiny_model_cannot_be_written_into_an_unwritable_store(
    tmp_path: Path, store: str
) -> None:
    # The plugin's model fixture (`shard-engine run --engine llama`, the conformance suite)
    # generates its model there: a store that is a file or a pseudo-filesystem is named.
    target = tmp_path / store if store == "a-file" else Path(store)
    if store == "a-file":
        target.write_text("")
    with pytest.raises(
        InvalidRequest, match="cannot write the generated tiny model into"
    ) as raised:
        tiny_model_path(target)
    assert raised.value.details["path"] == str(target)
    assert not list(tmp_path.glob("*.partial"))


def _rope_factors(path: Path, names: Sequence[str], seed: int = 5) -> dict[str, TensorEdit | None]:
    from shard_engine_llama._gguf.families import FAMILIES
    from shard_engine_llama._gguf.hyperparameters import hyperparameters

    header = read_gguf_header(path)
    size = hyperparameters(header, FAMILIES[header.architecture]).n_rot // 2
    rng = np.random.default_rng(seed)
    return {
        name: TensorEdit(
            name,
            (size,),
            gguf.GGMLQuantizationType.F32,
            rng.uniform(0.5, 2.0, size).astype("<f4").tobytes(),
        )
        for name in names
    }


@pytest.mark.parametrize("arch", ["llama", "granite"])
@pytest.mark.parametrize(
    ("scaling", "names"),
    [
        ("longrope", ("rope_factors_long.weight", "rope_factors_short.weight")),
        (None, ("rope_freqs.weight",)),
    ],
)
def test_rope_factors_of_the_scaling_type_load_and_split_exactly(
    tmp_path: Path, arch: str, scaling: str | None, names: tuple[str, ...]
) -> None:
    """The rope factor set the loader asks for with the file's scaling type is accepted, loads
    (llama.cpp refused the other set, test_validation.py) and its shards compute the full
    model's logits bit for bit."""
    source = tmp_path / "source.gguf"
    write_tiny_model(source, arch=arch, n_layers=4)
    metadata: dict[str, MetadataValue | None] = {}
    if scaling is not None:
        metadata[f"{arch}.rope.scaling.type"] = MetadataValue(scaling, gguf.GGUFValueType.STRING)
    model = rewrite(
        source,
        tmp_path / "rope.gguf",
        metadata=metadata,
        tensors=_rope_factors(source, names),
    )
    full = [_load(model, 0, 4, 4)]
    split = _pipeline(model, 2, 4)
    try:
        expected = Pipeline(full).generate(PROMPT, 3)
        assert np.isfinite(expected.logits()).all()
        assert Pipeline(split).generate(PROMPT, 3).step_logits == expected.step_logits
    finally:
        _close(full + split)


def _refusal_cases(tmp_path: Path) -> dict[str, tuple[Path, dict[str, str]]]:
    from shard_engine_llama._gguf.validation import _BYTE_LEVEL

    llama = tmp_path / "llama.gguf"
    write_tiny_model(llama, n_layers=2)
    gemma3 = tmp_path / "gemma3.gguf"
    write_tiny_model(gemma3, arch="gemma3", n_layers=2)
    string, u16 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT16
    tokens = [_BYTE_LEVEL[byte] for byte in range(256)] + ["He", "<s>", "</s>", "<unk>"]
    edits: dict[str, tuple[Path, dict[str, MetadataValue | None], dict[str, TensorEdit | None]]] = {
        "whitespace-pre-tokenizer": (
            llama,
            {
                "tokenizer.ggml.model": MetadataValue("gpt2", string),
                "tokenizer.ggml.pre": MetadataValue("whitespace", string),
                "tokenizer.ggml.tokens": array(tokens, string),
                "tokenizer.ggml.scores": None,
                "tokenizer.ggml.token_type": array([1] * len(tokens), gguf.GGUFValueType.INT32),
                "tokenizer.ggml.merges": array(["H e"], string),
                "tokenizer.ggml.unknown_token_id": None,
            },
            {},
        ),
        "split-count-2": (
            llama,
            {"split.count": MetadataValue(2, u16), "split.no": MetadataValue(0, u16)},
            {},
        ),
        "split-count-u32": (llama, {"split.count": u32(1)}, {}),
        "empty-key": (llama, {"": MetadataValue("x", string)}, {}),
        "rope-freqs-with-longrope": (
            llama,
            {"llama.rope.scaling.type": MetadataValue("longrope", string)},
            _rope_factors(llama, ("rope_freqs.weight",)),
        ),
        "rope-factors-without-longrope": (
            llama,
            {},
            _rope_factors(llama, ("rope_factors_long.weight", "rope_factors_short.weight")),
        ),
        "gemma3-final-softcap-1e-40": (
            gemma3,
            {"gemma3.final_logit_softcapping": f32(1e-40)},
            {},
        ),
    }
    details = {
        "whitespace-pre-tokenizer": {"rule": "tokenizer-pre", "field": "tokenizer.ggml.pre"},
        "split-count-2": {"rule": "gguf-split", "field": "split.count"},
        "split-count-u32": {"rule": "metadata-type", "field": "split.count"},
        "empty-key": {"rule": "gguf-empty-key"},
        "rope-freqs-with-longrope": {"rule": "tensor-unexpected", "field": "rope_freqs.weight"},
        "rope-factors-without-longrope": {
            "rule": "tensor-unexpected",
            "field": "rope_factors_long.weight",
        },
        "gemma3-final-softcap-1e-40": {
            "rule": "hparam-divisor",
            "field": "gemma3.final_logit_softcapping",
        },
    }
    return {
        name: (
            rewrite(source, tmp_path / f"{name}.gguf", metadata=metadata, tensors=tensors),
            details[name],
        )
        for name, (source, metadata, tensors) in edits.items()
    }


def test_files_llama_cpp_refuses_or_aborts_on_are_typed_refusals_on_load(tmp_path: Path) -> None:
    """Each of these passed the validator: llama.cpp then refused it with a generic "could not
    load" (split keys, an empty key, the other rope factor set), aborted encoding two spaces
    (the whitespace pre-tokenizer) or returned NaN for every row (a denormal final softcap).
    Loading a full model or a head shard is now an InvalidRequest naming rule and field."""
    for name, (path, details) in _refusal_cases(tmp_path).items():
        for start, end in ((0, 2), (0, 1)):
            with pytest.raises(InvalidRequest) as refused:
                _load(path, start, end, 2)
            assert refused.value.details == details, (name, start, end)


def _forge_hash_cache(store: Path, kind: str, path: Path, digest: str) -> None:
    """A persistent hash-cache entry for ``path``'s current identity, as a damaged or forged
    ``verified-sha256.json`` would hold it."""
    identity = store_module.file_identity(path)
    store.mkdir(parents=True, exist_ok=True)
    entry = {"identity": identity.as_json(), "sha256": digest}
    (store / store_module.HASH_CACHE_NAME).write_text(json.dumps({kind: {identity.path: entry}}))


def _persisted(store: Path, kind: str, path: Path) -> object:
    document = json.loads((store / store_module.HASH_CACHE_NAME).read_text())
    return document[kind][str(path.resolve())]["sha256"]


@pytest.mark.parametrize("digest", ["not-hex", "A" * 64, "0" * 63, 12345, None])
def test_a_cached_digest_that_is_no_sha256_is_ignored(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digest: object
) -> None:
    """A full model's fingerprint came from the persistent hash cache as it was: "not-hex" in
    verified-sha256.json became the reported model fingerprint. Now only 64 lowercase hex
    digits are taken from it; anything else costs a re-hash (and is replaced)."""
    monkeypatch.setattr(store_module, "RACY_SECONDS", 0.0)
    model = tmp_path / "model.gguf"
    model.write_bytes(tiny_model.read_bytes())
    real = hashlib.sha256(model.read_bytes()).hexdigest()
    store = tmp_path / "store"
    _forge_hash_cache(store, "file", model, digest)  # type: ignore[arg-type]
    store_module.hash_cache().forget()
    engine = _load(model, 0, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS)
    try:
        assert engine.capabilities().model_fingerprint == real
    finally:
        engine.close()
    assert _persisted(store, "file", model) == real


def test_a_cached_digest_cannot_place_a_shard_outside_the_store(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source digest names the store directory a shard is written to: a cached digest
    "/../../../../esc000..." wrote the engine's shard outside the store."""
    monkeypatch.setattr(store_module, "RACY_SECONDS", 0.0)
    model = tmp_path / "model.gguf"
    model.write_bytes(tiny_model.read_bytes())
    real = hashlib.sha256(model.read_bytes()).hexdigest()
    store = tmp_path / "deep" / "er" / "store"
    _forge_hash_cache(store, "file", model, "/../../../../esc" + "0" * 48)
    store_module.hash_cache().forget()
    engine = _load(model, 0, 2, TINY_MODEL_LAYERS, options={"model_store": str(store)})
    try:
        assert engine.shard_path is not None
        assert engine.shard_path.resolve().is_relative_to(store.resolve())
        assert f"model-{real[:16]}" in engine.shard_path.parts
    finally:
        engine.close()
    written = {path for path in tmp_path.rglob("*.gguf") if path != model}
    assert written
    assert all(path.is_relative_to(store) for path in written), written


def test_a_damaged_cache_entry_for_a_good_shard_costs_one_re_hash(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrong cached content digest for a good shard refused every load of it, for good
    (shard-integrity), although the cache only saves work. Now a cached digest that disagrees
    with the recorded one is dropped and the shard hashed once more; the corrected entry
    serves the next load. A digest this process computed itself is not re-hashed."""
    monkeypatch.setattr(store_module, "RACY_SECONDS", 0.0)
    manifest = split_model(tiny_model, [(0, 2), (2, TINY_MODEL_LAYERS)], tmp_path / "shards")
    tail = manifest.shard_path(1)
    recorded = read_gguf_header(tail).metadata["shard.content_sha256"].value
    store = tail.parent / "store"  # _load's model store
    _forge_hash_cache(store, "shard-content", tail, "f" * 64)
    cache = store_module.hash_cache()
    cache.forget()
    computed = cache.computed
    for _ in range(2):
        cache.forget()  # a restarted worker: only the persistent cache is left
        _load(tail, 2, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS).close()
    assert cache.computed == computed + 1
    assert _persisted(store, "shard-content", tail) == recorded

    tampered = tmp_path / "tampered.gguf"
    tampered.write_bytes(tail.read_bytes())
    _flip_tensor_byte(tampered)
    for _ in range(2):
        with pytest.raises(InvalidRequest) as refused:
            _load(tampered, 2, TINY_MODEL_LAYERS, TINY_MODEL_LAYERS)
        assert refused.value.details["rule"] == "shard-integrity"
    assert cache.computed == computed + 2, "a digest computed here was hashed again"
