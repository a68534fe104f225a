"""``LlamaEngine.max_state_bytes(length)`` bounds every exported state of that length: a
server refuses, from an import stream's header alone, a state larger than the shard could hold
(issue 28). Checked against real exports: never below them, never far above."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import numpy as np
import pytest

from shard_engine_api import (
    BoundaryBundle,
    ExportSessionRequest,
    LoadConfig,
    PrefillRequest,
    SessionRef,
    ShardSpec,
    TokenInput,
)
from shard_engine_api.wire import payload_checksum
from shard_engine_llama import LlamaEngine
from shard_engine_llama._tiny_model import write_tiny_model

N_LAYERS: Final = 6
FAMILIES: Final = {
    "llama": {"arch": "llama"},
    "gemma3": {"arch": "gemma3", "sliding_window": 8},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("state-bound-models")
    paths: dict[str, Path] = {}
    for name, arguments in FAMILIES.items():
        paths[name] = directory / f"{name}.gguf"
        write_tiny_model(paths[name], n_layers=N_LAYERS, seed=5, **arguments)  # type: ignore[arg-type]
    return paths


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("start", "end"), [(0, 6), (2, 4)], ids=["full", "middle"])
@pytest.mark.parametrize(
    "options", [{}, {"kv_type": "f16", "flash_attn": True}], ids=["f32", "f16-flash"]
)
def test_exported_states_stay_within_the_bound(
    models: dict[str, Path], family: str, start: int, end: int, options: dict[str, object]
) -> None:
    model = models[family]
    engine = LlamaEngine()
    engine.load(
        LoadConfig(
            shard=ShardSpec(model=str(model), n_layers=N_LAYERS, start=start, end=end),
            max_sessions=4,
            max_context=64,
            options={"n_ubatch": 8, "model_store": str(model.parent / "store"), **options},
        )
    )
    try:
        hidden = engine.capabilities().hidden_size
        for length in (1, 7, 40):
            session = SessionRef(session_id=f"s{length}", epoch=1)
            inputs: TokenInput | BoundaryBundle = (
                TokenInput(token_ids=tuple(range(1, length + 1)))
                if start == 0
                else _bundle(engine, session, length, hidden)
            )
            engine.prefill(
                PrefillRequest(request_id=f"p{length}", session=session, start_pos=0, inputs=inputs)
            )
            snapshot = engine.export_session(
                ExportSessionRequest(request_id=f"e{length}", session=session)
            )
            bound = engine.max_state_bytes(length)
            assert snapshot.state_bytes <= bound, (length, snapshot.state_bytes, bound)
            if family != "gemma3":
                # Tight enough to matter: within twice the real size plus the fixed fields. (A
                # sliding-window cache keeps only its window, which the bound does not count.)
                assert bound <= 2 * snapshot.state_bytes + 4096, (
                    length,
                    snapshot.state_bytes,
                    bound,
                )
        assert engine.max_state_bytes(2) < engine.max_state_bytes(64)
    finally:
        engine.close()


def _bundle(engine: LlamaEngine, session: SessionRef, length: int, hidden: int) -> BoundaryBundle:
    caps = engine.capabilities()
    rows = np.random.default_rng(length).standard_normal((length, hidden)).astype(np.float32)
    payload = rows.tobytes()
    return BoundaryBundle(
        session=session,
        first_pos=0,
        n_tokens=length,
        hidden_size=hidden,
        dtype="f32",
        layer=caps.shard.start,
        model_fingerprint=caps.model_fingerprint,
        payload=memoryview(payload),
        checksum=payload_checksum(payload),
    )
