"""What the core copies of a boundary bundle it is given: only a payload its caller can still
write. Bundles the library made (an engine's results handed on in process, the codec's decoded
bundles) are read where they are."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import msgspec
import pytest
from conformance_engines import ReferenceEngine, reference_fixture

from shard_engine_api import (
    BoundaryBundle,
    BoundaryDtype,
    BoundaryResult,
    DecodeRequest,
    LoadConfig,
    PrefillRequest,
    SessionRef,
    ShardSpec,
    TokenInput,
    _inputs,
)
from shard_engine_api.engine import ModelInfo
from shard_engine_api.wire import decode_bundle, encode_bundle

SESSION: Final = SessionRef(session_id="s", epoch=1)


class AllDtypes(ReferenceEngine):
    """The reference engine with every boundary dtype."""

    def _open(self, config: LoadConfig) -> ModelInfo:
        info = super()._open(config)
        return msgspec.structs.replace(info, boundary_dtypes=("f32", "f16", "bf16"))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_bundles_the_library_made_are_not_copied(
    dtype: BoundaryDtype, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    copies: list[BoundaryBundle] = []
    copy = _inputs._private_copy

    def counting(bundle: BoundaryBundle) -> BoundaryBundle:
        copies.append(bundle)
        return copy(bundle)

    monkeypatch.setattr(_inputs, "_private_copy", counting)
    fixture = reference_fixture(tmp_path)

    def shard(start: int, end: int) -> AllDtypes:
        engine = AllDtypes()
        spec = ShardSpec(model=fixture.model, n_layers=fixture.n_layers, start=start, end=end)
        engine.load(LoadConfig(shard=spec, boundary_dtype=dtype))
        return engine

    head, tail = shard(0, 1), shard(1, fixture.n_layers)
    first = head.prefill(
        PrefillRequest(
            request_id="h", session=SESSION, start_pos=0, inputs=TokenInput(token_ids=(1,))
        )
    )
    assert isinstance(first, BoundaryResult)
    tail.prefill(PrefillRequest(request_id="t", session=SESSION, start_pos=0, inputs=first.bundle))
    step = head.decode(
        DecodeRequest(request_id="d", session=SESSION, pos=1, inputs=TokenInput(token_ids=(2,)))
    )
    assert isinstance(step, BoundaryResult)
    for sent in (step.bundle, decode_bundle(encode_bundle(step.bundle))):
        tail.decode(DecodeRequest(request_id="t", session=SESSION, pos=1, inputs=sent))
        tail.prefill(
            PrefillRequest(request_id="r", session=SESSION, start_pos=0, inputs=first.bundle)
        )
    assert copies == []
    # A payload its caller can still write is copied before it is checked.
    writable = msgspec.structs.replace(
        first.bundle, payload=memoryview(bytearray(first.bundle.payload))
    )
    tail.prefill(PrefillRequest(request_id="w", session=SESSION, start_pos=0, inputs=writable))
    assert [bytes(bundle.payload) for bundle in copies] == [bytes(first.bundle.payload)]
    for engine in (head, tail):
        engine.close()
