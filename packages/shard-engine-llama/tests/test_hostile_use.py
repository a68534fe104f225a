"""Requests a hostile or confused caller can send a running llama engine: each is refused with
a typed error and changes no session (decode afterwards is bitwise a clean engine's), and
threads calling every operation at once end in typed errors, no deadlock, and a KV cache that
agrees with the session ledger."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import msgspec
import numpy as np
import pytest

from shard_engine_api import (
    BoundaryBundle,
    CancelRequest,
    DecodeBatchRequest,
    DecodeRequest,
    ErrorInfo,
    ExportSessionRequest,
    ImportSessionRequest,
    LoadConfig,
    NotReady,
    PrefillRequest,
    ReleaseRequest,
    SessionRef,
    SessionSnapshot,
    ShardEngineError,
    ShardInput,
    ShardResult,
    ShardSpec,
    TokenInput,
)
from shard_engine_api.wire import payload_checksum
from shard_engine_llama import LlamaEngine
from shard_engine_llama._tiny_model import write_tiny_model

N_LAYERS: Final = 6
VOCAB: Final = 260
MAX_CONTEXT: Final = 16
# (family, generator arguments, shard range): a dense full model, a middle and an MoE tail.
SHARDS: Final[dict[str, tuple[dict[str, object], int, int]]] = {
    "llama-full": ({"arch": "llama"}, 0, 6),
    "llama-middle": ({"arch": "llama"}, 2, 4),
    "qwen3moe-tail": ({"arch": "qwen3moe"}, 3, 6),
    "gemma3-full": ({"arch": "gemma3", "sliding_window": 8}, 0, 6),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("hostile-models")
    paths: dict[str, Path] = {}
    for name, (arguments, _, _) in SHARDS.items():
        family = str(arguments["arch"])
        if family not in paths:
            paths[family] = directory / f"{family}.gguf"
            write_tiny_model(paths[family], n_layers=N_LAYERS, seed=3, **arguments)  # type: ignore[arg-type]
        paths[name] = paths[family]
    return paths


def _load(model: Path, start: int, end: int, **options: object) -> LlamaEngine:
    engine = LlamaEngine()
    engine.load(
        LoadConfig(
            shard=ShardSpec(model=str(model), n_layers=N_LAYERS, start=start, end=end),
            max_sessions=3,
            max_context=MAX_CONTEXT,
            max_batch_tokens=32,
            options={"n_ubatch": 4, "model_store": str(model.parent / "store"), **options},
        )
    )
    return engine


def _session(name: str, epoch: int = 1) -> SessionRef:
    return SessionRef(session_id=name, epoch=epoch)


def _bundle(
    engine: LlamaEngine, session: SessionRef, first_pos: int, rows: np.ndarray, **fields: object
) -> BoundaryBundle:
    """A bundle as a peer may send it: the header fields it likes, a matching checksum unless
    it gives one."""
    caps = engine.capabilities()
    payload = np.ascontiguousarray(rows).tobytes()
    values: dict[str, object] = {
        "session": session,
        "first_pos": first_pos,
        "n_tokens": rows.shape[0],
        "hidden_size": rows.shape[1],
        "dtype": "f32",
        "layer": caps.shard.start,
        "model_fingerprint": caps.model_fingerprint,
        "payload": payload,
    }
    values.update(fields)
    checksum = payload_checksum(values["payload"])  # type: ignore[arg-type]
    return BoundaryBundle(**{"checksum": checksum, **values})  # type: ignore[arg-type]


def _inputs(engine: LlamaEngine, session: SessionRef, start: int, n: int) -> ShardInput:
    caps = engine.capabilities()
    if caps.role in ("head", "full"):
        return TokenInput(token_ids=tuple((start + index) * 13 % 250 for index in range(n)))
    rows = np.random.default_rng(start).standard_normal((n, caps.hidden_size)).astype(np.float32)
    return _bundle(engine, session, start, rows)


def _prefill(engine: LlamaEngine, session: SessionRef, n: int, start: int = 0) -> ShardResult:
    return engine.prefill(
        PrefillRequest(
            request_id=f"p-{session.session_id}-{start}-{n}",
            session=session,
            start_pos=start,
            inputs=_inputs(engine, session, start, n),
        )
    )


def _decode_request(engine: LlamaEngine, session: SessionRef, pos: int, tag: str) -> DecodeRequest:
    return DecodeRequest(
        request_id=f"d-{tag}-{session.session_id}-{pos}",
        session=session,
        pos=pos,
        inputs=_inputs(engine, session, pos, 1),
    )


def _output(result: ShardResult) -> bytes:
    payload = result.bundle.payload if hasattr(result, "bundle") else result.payload
    return bytes(payload)


def _refusals(engine: LlamaEngine) -> list[tuple[str, Callable[[], object]]]:
    """Requests that must each be refused, on an engine holding a (5 positions) and b (3)."""
    a, b = _session("a"), _session("b")
    caps = engine.capabilities()
    hidden = caps.hidden_size
    takes_tokens = caps.role in ("head", "full")

    def prefill(session: SessionRef, start: int, inputs: ShardInput) -> Callable[[], object]:
        return lambda: engine.prefill(
            PrefillRequest(
                request_id=f"bad-{session.session_id}-{start}",
                session=session,
                start_pos=start,
                inputs=inputs,
            )
        )

    def decode(session: SessionRef, pos: int) -> Callable[[], object]:
        return lambda: engine.decode(_decode_request(engine, session, pos, "bad"))

    cases: list[tuple[str, Callable[[], object]]] = [
        ("append one past the context", lambda: _prefill(engine, a, MAX_CONTEXT - 4, 5)),
        ("decode past the end", decode(a, 7)),
        ("decode behind the end", decode(b, 1)),
        ("prefill leaving a gap", lambda: _prefill(engine, a, 2, 7)),
        ("decode an unknown session", decode(_session("unknown"), 0)),
        ("decode a stale epoch", decode(_session("a", 0), 5)),
        (
            "a third and fourth session",
            lambda: (_prefill(engine, _session("c"), 2), _prefill(engine, _session("d"), 2)),
        ),
        (
            "cancel naming both",
            lambda: engine.cancel(CancelRequest(request_id="x", session_id="a")),
        ),
        (
            "export an unknown session",
            lambda: engine.export_session(
                ExportSessionRequest(request_id="e", session=_session("unknown"))
            ),
        ),
        (
            "an empty batch",
            lambda: engine.decode_batch(DecodeBatchRequest(request_id="b", items=())),
        ),
    ]
    if takes_tokens:
        cases += [
            ("no tokens", prefill(a, 5, TokenInput(token_ids=()))),
            ("a token past the vocabulary", prefill(a, 5, TokenInput(token_ids=(1, VOCAB)))),
            ("a truncation with a bad token", prefill(a, 2, TokenInput(token_ids=(1, 2, VOCAB)))),
            (
                "hidden states into a head",
                prefill(a, 5, _bundle(engine, a, 5, np.ones((1, 64), np.float32))),
            ),
        ]
    else:
        ones = np.ones((2, hidden), np.float32)
        cases += [
            ("tokens into a middle", prefill(a, 5, TokenInput(token_ids=(1,)))),
            (
                "wrong hidden size",
                prefill(a, 5, _bundle(engine, a, 5, np.ones((2, hidden // 2), np.float32))),
            ),
            (
                "NaN rows",
                prefill(a, 5, _bundle(engine, a, 5, np.full((2, hidden), np.nan, np.float32))),
            ),
            (
                "Inf rows",
                prefill(a, 5, _bundle(engine, a, 5, np.full((2, hidden), np.inf, np.float32))),
            ),
            (
                "a truncation with NaN rows",
                prefill(a, 2, _bundle(engine, a, 2, np.full((2, hidden), np.nan, np.float32))),
            ),
            ("more rows than the header", prefill(a, 5, _bundle(engine, a, 5, ones, n_tokens=1))),
            ("fewer rows than the header", prefill(a, 5, _bundle(engine, a, 5, ones, n_tokens=3))),
            (
                "another layer",
                prefill(a, 5, _bundle(engine, a, 5, ones, layer=caps.shard.start + 1)),
            ),
            (
                "another model",
                prefill(a, 5, _bundle(engine, a, 5, ones, model_fingerprint="0" * 64)),
            ),
            ("another position", prefill(a, 5, _bundle(engine, a, 6, ones))),
            ("another session's bundle", prefill(a, 5, _bundle(engine, b, 5, ones))),
            ("a bad checksum", prefill(a, 5, _bundle(engine, a, 5, ones, checksum=1))),
        ]
    return cases


@pytest.mark.parametrize("shard", sorted(SHARDS))
def test_refused_requests_change_no_session(models: dict[str, Path], shard: str) -> None:
    _, start, end = SHARDS[shard]
    engine, clean = _load(models[shard], start, end), _load(models[shard], start, end)
    a, b = _session("a"), _session("b")
    try:
        for each in (engine, clean):
            _prefill(each, a, 5)
            _prefill(each, b, 3)
        refused = []
        for name, request in _refusals(engine):
            with pytest.raises(ShardEngineError):
                request()
            refused.append(name)
            # A failed third session may have left "c": release it, the slots are a and b's.
            engine.release(ReleaseRequest(session=_session("c")))
        # A batch of nothing but bad items: a duplicate pair at a wrong position, an unknown
        # session and a released one; every item fails on its own.
        engine.release(ReleaseRequest(session=_session("c")))
        batch = engine.decode_batch(
            DecodeBatchRequest(
                request_id="bad-batch",
                items=(
                    _decode_request(engine, a, 6, "x"),
                    _decode_request(engine, a, 6, "y"),
                    _decode_request(engine, _session("unknown"), 0, "z"),
                    _decode_request(engine, _session("c"), 2, "w"),
                ),
            )
        )
        assert all(isinstance(item, ErrorInfo) for item in batch.items), batch.items
        assert engine.health().state == "ready"
        for session, pos in ((a, 5), (b, 3)):
            got = engine.decode(_decode_request(engine, session, pos, "after"))
            want = clean.decode(_decode_request(clean, session, pos, "after"))
            assert _output(got) == _output(want), f"session {session.session_id} changed"
        assert len(refused) >= 14
    finally:
        engine.close()
        clean.close()


def _storm(engine: LlamaEngine, seed: int, seconds: float, untyped: list[str]) -> None:
    rng = random.Random(seed)
    snapshots: list[SessionSnapshot] = []
    deadline = time.monotonic() + seconds
    step = 0
    while time.monotonic() < deadline:
        step += 1
        name = f"s{rng.randrange(5)}"
        request_id = f"{seed}-{step}"
        try:
            ledger = engine._ledger.sessions.get(name)
            session = _session(name, ledger.epoch if ledger else 1)
            length = ledger.length if ledger else 0
            operation = rng.choice(
                ("prefill", "decode", "decode", "batch", "cancel", "release", "export", "import")
            )
            if operation == "prefill":
                _prefill(engine, session, rng.randint(1, 4), 0)
            elif operation == "decode":
                engine.decode(_decode_request(engine, session, length, request_id))
            elif operation == "batch":
                items = tuple(
                    _decode_request(engine, _session(f"s{index}"), rng.randrange(6), request_id)
                    for index in rng.sample(range(5), 3)
                )
                engine.decode_batch(DecodeBatchRequest(request_id=request_id, items=items))
            elif operation == "cancel":
                engine.cancel(CancelRequest(request_id=f"{rng.randrange(4)}-{step - 1}"))
            elif operation == "release":
                engine.release(ReleaseRequest(session=session))
            elif operation == "export":
                snapshots.append(
                    engine.export_session(
                        ExportSessionRequest(request_id=request_id, session=session)
                    )
                )
            elif snapshots:
                snapshot = msgspec.structs.replace(rng.choice(snapshots), session=session)
                engine.import_session(
                    ImportSessionRequest(
                        request_id=request_id, snapshot=snapshot, epoch=session.epoch + 1
                    )
                )
        except ShardEngineError:
            pass
        except Exception as error:  # noqa: BLE001 - anything untyped is the finding
            untyped.append(f"{type(error).__name__}: {error}")


def test_every_operation_from_several_threads_ends_typed_and_consistent(
    models: dict[str, Path],
) -> None:
    """Four threads prefill, decode, batch, cancel, release, export and import on one engine
    (forwards slowed so that cancels land inside llama.cpp), then close() arrives while they
    still run: every thread ends in time, nothing but contract errors, and before the close
    the KV cache holds exactly the positions the ledger says for every session."""
    engine = _load(models["llama-middle"], 2, 4, slow_forward_us=200)
    untyped: list[str] = []
    threads = [
        threading.Thread(target=_storm, args=(engine, seed, 1.5, untyped)) for seed in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a thread is stuck"
    assert not untyped, untyped[:5]
    runtime = engine._runtime
    assert runtime is not None
    for name, entry in engine._ledger.sessions.items():
        assert runtime.seq_pos_max(entry.slot) + 1 == entry.length, name
    # close() while the storm runs again.
    threads = [
        threading.Thread(target=_storm, args=(engine, seed, 1.0, untyped)) for seed in range(4, 7)
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    engine.close()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a thread is stuck after close"
    assert not untyped, untyped[:5]
    with pytest.raises(NotReady):
        _prefill(engine, _session("late"), 1)
    assert engine.health().state == "closed"
