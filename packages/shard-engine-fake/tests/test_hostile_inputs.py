"""Inputs a caller can break while the engine holds them, through the public entry points
(``load_engine``, the validation wrapper, the asyncio adapter): a bundle payload in a buffer
the caller can still write, and a buffer released before the call. The engine computes on the
bytes it verified, or refuses the request as InvalidRequest and changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import numpy.typing as npt
import pytest

import shard_engine_api as api
from shard_engine_api.engine import CancelToken, ForwardItem, OutputMode
from shard_engine_fake import DEFAULT_MODEL, FakeEngine, resolve_model

SESSION = api.SessionRef(session_id="s", epoch=1)
Front = Callable[[FakeEngine], Callable[[api.PrefillRequest], api.ShardResult]]


def _direct(engine: FakeEngine) -> Callable[[api.PrefillRequest], api.ShardResult]:
    return engine.prefill


def _validated(engine: FakeEngine) -> Callable[[api.PrefillRequest], api.ShardResult]:
    return api.ValidatingEngine(engine).prefill


def _awaited(engine: FakeEngine) -> Callable[[api.PrefillRequest], api.ShardResult]:
    adapter = api.AsyncShardEngine(engine)

    def call(request: api.PrefillRequest) -> api.ShardResult:
        return asyncio.run(adapter.prefill(request))

    return call


FRONTS = [
    pytest.param(front, id=front.__name__.strip("_")) for front in (_direct, _validated, _awaited)
]


@pytest.fixture
def loaded() -> Iterator[Callable[[int, int], FakeEngine]]:
    engines: list[api.ShardEngine] = []

    def load(start: int, end: int) -> FakeEngine:
        shard = api.ShardSpec(model=DEFAULT_MODEL, n_layers=6, start=start, end=end)
        engine = api.load_engine("fake", api.LoadConfig(shard=shard))
        engines.append(engine)
        assert isinstance(engine, FakeEngine)
        return engine

    yield load
    for engine in engines:
        engine.close()


def _head_bundle(load: Callable[[int, int], FakeEngine]) -> api.BoundaryBundle:
    result = load(0, 3).prefill(
        api.PrefillRequest(
            request_id="h", session=SESSION, start_pos=0, inputs=api.TokenInput(token_ids=(1, 2))
        )
    )
    assert isinstance(result, api.BoundaryResult)
    return result.bundle


def _prefill(bundle: api.BoundaryBundle) -> api.PrefillRequest:
    return api.PrefillRequest(request_id="t", session=SESSION, start_pos=0, inputs=bundle)


@pytest.mark.parametrize("front", FRONTS)
def test_a_payload_written_during_the_call_is_not_computed_on(
    loaded: Callable[[int, int], FakeEngine], front: Front, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bundle whose payload is a bytearray the caller changes while the engine runs (here
    at the backend's first step, as another thread could): the logits are those of the bytes
    the checksum vouched for, not of the changed ones."""
    sound = _head_bundle(loaded)
    expected = loaded(3, 6).prefill(_prefill(sound))
    assert isinstance(expected, api.LogitsResult)
    writable = bytearray(sound.payload)
    racing = msgspec.structs.replace(sound, payload=memoryview(writable))
    forward = FakeEngine._forward

    def overwritten_first(
        self: FakeEngine, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        writable[:8] = np.array([7, -7], dtype=np.float32).tobytes()
        return forward(self, item, output, token)

    monkeypatch.setattr(FakeEngine, "_forward", overwritten_first)
    result = front(loaded(3, 6))(_prefill(racing))
    assert isinstance(result, api.LogitsResult)
    assert bytes(writable[:8]) != bytes(sound.payload[:8])  # the change did happen
    assert bytes(result.payload) == bytes(expected.payload)
    assert result.checksum == expected.checksum


@pytest.mark.parametrize("front", FRONTS)
def test_a_released_payload_is_invalid_and_changes_nothing(
    loaded: Callable[[int, int], FakeEngine], front: Front
) -> None:
    sound = _head_bundle(loaded)
    tail = loaded(3, 6)
    view = memoryview(bytearray(sound.payload))
    view.release()
    before = (tail.health(), tail.metrics().requests)
    with pytest.raises(api.InvalidRequest) as caught:
        front(tail)(_prefill(msgspec.structs.replace(sound, payload=view)))
    assert type(caught.value) is api.InvalidRequest
    assert caught.value.details["field"] == "PrefillRequest.inputs.payload"
    assert (tail.health(), tail.metrics().requests) == before
    assert tail.metrics().sessions_active == 0
    # The engine still serves the sound bundle.
    assert isinstance(front(tail)(_prefill(sound)), api.LogitsResult)


@pytest.mark.parametrize(
    "options",
    [{"hidden_size": 0}, {"vocab_size": 1 << 21}, {"seed": -1}],
    ids=["hidden 0", "vocab too large", "negative seed"],
)
def test_resolving_an_out_of_range_model_is_invalid_request(options: dict[str, int]) -> None:
    """The public resolver raises the contract's error, not msgspec's ValidationError."""
    shard = api.ShardSpec(model="fake", n_layers=6, start=0, end=6)
    with pytest.raises(api.InvalidRequest, match="must lie in"):
        resolve_model(shard, options)
