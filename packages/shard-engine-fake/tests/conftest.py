"""Shared helpers of the fake engine's tests: engine factories and request builders."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

import shard_engine_api as api
from shard_engine_fake import DEFAULT_MODEL, FAULTS_ENV_VAR, FakeEngine

EngineFactory = Callable[..., FakeEngine]


@pytest.fixture(autouse=True)
def _no_ambient_fault_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    # A plan file named in the developer's environment must not leak into the tests.
    monkeypatch.delenv(FAULTS_ENV_VAR, raising=False)


@pytest.fixture
def make_engine() -> Iterator[EngineFactory]:
    """Build and load fake engines; every one is closed after the test."""
    engines: list[FakeEngine] = []

    def factory(
        start: int = 0,
        end: int | None = None,
        *,
        model: str = DEFAULT_MODEL,
        n_layers: int = 6,
        wrapper: Callable[[FakeEngine], api.ShardEngine] | None = None,
        **fields: object,
    ) -> FakeEngine:
        engine = FakeEngine()
        engines.append(engine)
        shard = api.ShardSpec(
            model=model, n_layers=n_layers, start=start, end=n_layers if end is None else end
        )
        values: dict[str, object] = {"shard": shard}
        values.update(fields)
        config = api.LoadConfig(**values)  # type: ignore[arg-type]
        # A wrapper (the validation wrapper) must see the load to know the configured dtype.
        (engine if wrapper is None else wrapper(engine)).load(config)
        return engine

    yield factory
    for engine in engines:
        engine.close()


def session(session_id: str = "s", epoch: int = 1) -> api.SessionRef:
    return api.SessionRef(session_id=session_id, epoch=epoch)


def prefill(
    engine: api.ShardEngine,
    ref: api.SessionRef,
    start_pos: int,
    inputs: Sequence[int] | api.BoundaryBundle,
    *,
    request_id: str = "prefill",
    logits: api.LogitsMode = "last",
) -> api.ShardResult:
    shard_input: api.ShardInput = (
        inputs
        if isinstance(inputs, api.BoundaryBundle)
        else api.TokenInput(token_ids=tuple(inputs))
    )
    return engine.prefill(
        api.PrefillRequest(
            request_id=request_id,
            session=ref,
            start_pos=start_pos,
            inputs=shard_input,
            logits=logits,
        )
    )


def decode_request(
    ref: api.SessionRef,
    pos: int,
    inputs: int | api.BoundaryBundle,
    *,
    request_id: str = "decode",
) -> api.DecodeRequest:
    shard_input: api.ShardInput = (
        inputs if isinstance(inputs, api.BoundaryBundle) else api.TokenInput(token_ids=(inputs,))
    )
    return api.DecodeRequest(request_id=request_id, session=ref, pos=pos, inputs=shard_input)


def decode(
    engine: api.ShardEngine,
    ref: api.SessionRef,
    pos: int,
    inputs: int | api.BoundaryBundle,
    *,
    request_id: str = "decode",
) -> api.ShardResult:
    return engine.decode(decode_request(ref, pos, inputs, request_id=request_id))


def logits_of(result: api.ShardResult) -> api.LogitsResult:
    assert isinstance(result, api.LogitsResult), result
    return result


def bundle_of(result: api.ShardResult) -> api.BoundaryBundle:
    assert isinstance(result, api.BoundaryResult), result
    return result.bundle
