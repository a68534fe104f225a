"""The contract types: role derivation, field validation, bundle/array views and wire tags."""

from __future__ import annotations

import inspect

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shard_engine_api
from shard_engine_api import (
    AuxState,
    BoundaryBundle,
    BoundaryDtype,
    BoundaryResult,
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    ErrorInfo,
    ExportSessionRequest,
    Health,
    ImportSessionRequest,
    ImportSessionResult,
    InvalidRequest,
    LoadConfig,
    LogitsResult,
    Metrics,
    MtpState,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    SessionRef,
    SessionSnapshot,
    ShardSpec,
    TokenInput,
    _types,
)
from shard_engine_api.wire import decode_message

# The wire identity of every tagged type. Changing a value here breaks every deployed peer:
# tags are never renamed and never reused (add a new type with a new tag instead).
PINNED_TAGS: dict[type[msgspec.Struct], str] = {
    MtpState: "mtp",
    AuxState: "aux",
    TokenInput: "tokens",
    BoundaryBundle: "boundary",
    PrefillRequest: "prefill",
    DecodeRequest: "decode",
    DecodeBatchRequest: "decode_batch",
    CancelRequest: "cancel",
    CancelResult: "cancel_result",
    ReleaseRequest: "release",
    ReleaseResult: "release_result",
    BoundaryResult: "boundary_result",
    LogitsResult: "logits_result",
    DecodeBatchResult: "decode_batch_result",
    Capabilities: "capabilities",
    LoadConfig: "load",
    Health: "health",
    Metrics: "metrics",
    ErrorInfo: "error",
    ExportSessionRequest: "export_session",
    SessionSnapshot: "session_snapshot",
    ImportSessionRequest: "import_session",
    ImportSessionResult: "import_session_result",
}


def _public_structs() -> list[type[msgspec.Struct]]:
    return [
        value
        for value in vars(shard_engine_api).values()
        if inspect.isclass(value) and issubclass(value, msgspec.Struct)
    ]


SESSION = SessionRef(session_id="s", epoch=0)


# ----------------------------------------------------------------------------- tags


@pytest.mark.parametrize(("cls", "tag"), PINNED_TAGS.items(), ids=str)
def test_tag_is_the_pinned_explicit_string(cls: type[msgspec.Struct], tag: str) -> None:
    config = cls.__struct_config__
    assert config.tag == tag
    assert config.tag_field == "type"
    assert tag != cls.__name__


def test_every_tagged_public_struct_is_pinned() -> None:
    tagged = {cls for cls in _public_structs() if cls.__struct_config__.tag is not None}
    assert tagged == set(PINNED_TAGS)


def test_tags_are_unique() -> None:
    assert len(set(PINNED_TAGS.values())) == len(PINNED_TAGS)


def test_tag_appears_on_the_wire() -> None:
    encoded = msgspec.msgpack.decode(msgspec.msgpack.encode(CancelRequest(request_id="r")))
    assert encoded["type"] == "cancel"


@pytest.mark.parametrize("cls", _public_structs(), ids=lambda c: c.__name__)
def test_every_struct_is_frozen_and_keyword_only(cls: type[msgspec.Struct]) -> None:
    assert cls.__struct_config__.frozen
    parameters = inspect.signature(cls).parameters.values()
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters)


# ----------------------------------------------------------------------------- ShardSpec


@pytest.mark.parametrize(
    ("start", "end", "role", "takes_tokens", "emits_logits"),
    [
        (0, 4, "full", True, True),
        (0, 2, "head", True, False),
        (1, 3, "middle", False, False),
        (2, 4, "tail", False, True),
        (0, 1, "head", True, False),
        (3, 4, "tail", False, True),
    ],
)
def test_role_is_derived_from_the_layer_range(
    start: int, end: int, role: str, takes_tokens: bool, emits_logits: bool
) -> None:
    spec = ShardSpec(model="m", n_layers=4, start=start, end=end)
    assert spec.role == role
    assert spec.takes_tokens is takes_tokens
    assert spec.emits_logits is emits_logits
    assert spec.n_shard_layers == end - start


def test_single_layer_model_is_full() -> None:
    assert ShardSpec(model="m", n_layers=1, start=0, end=1).role == "full"


@settings(derandomize=True, database=None, max_examples=60)
@given(st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1))))
def test_role_matches_definition_for_every_range(n_and_start: tuple[int, int]) -> None:
    n_layers, start = n_and_start
    for end in range(start + 1, n_layers + 1):
        spec = ShardSpec(model="m", n_layers=n_layers, start=start, end=end)
        expected = {
            (True, True): "full",
            (True, False): "head",
            (False, True): "tail",
            (False, False): "middle",
        }[(start == 0, end == n_layers)]
        assert spec.role == expected


@pytest.mark.parametrize(
    ("n_layers", "start", "end"),
    [(0, 0, 0), (4, 2, 2), (4, 3, 2), (4, -1, 2), (4, 0, 5), (-3, 0, 1)],
)
def test_invalid_ranges_are_refused(n_layers: int, start: int, end: int) -> None:
    with pytest.raises(InvalidRequest):
        ShardSpec(model="m", n_layers=n_layers, start=start, end=end)


def test_invalid_range_on_the_wire_is_invalid_request() -> None:
    spec = ShardSpec(model="m", n_layers=4, start=0, end=2)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(LoadConfig(shard=spec)))
    raw["shard"]["end"] = 9
    with pytest.raises(InvalidRequest, match="layer range"):
        decode_message(msgspec.msgpack.encode(raw))


# ----------------------------------------------------------------------------- other fields


@pytest.mark.parametrize(("session_id", "epoch"), [("", 0), ("x" * 257, 0), ("s", -1)])
def test_invalid_session_refs_are_refused(session_id: str, epoch: int) -> None:
    with pytest.raises(InvalidRequest):
        SessionRef(session_id=session_id, epoch=epoch)


@pytest.mark.parametrize(
    "field", ["max_sessions", "max_context", "max_batch_tokens", "kv_budget_tokens"]
)
def test_load_config_limits_must_be_positive(field: str) -> None:
    spec = ShardSpec(model="m", n_layers=2, start=0, end=2)
    with pytest.raises(InvalidRequest, match=field):
        msgspec.structs.replace(LoadConfig(shard=spec), **{field: 0})


def test_load_config_threads_must_not_be_negative() -> None:
    with pytest.raises(InvalidRequest, match="n_threads"):
        LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=2), n_threads=-1)


# ----------------------------------------------------------------------------- payload views


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_bundle_from_array_round_trips_and_copies(dtype: BoundaryDtype) -> None:
    hidden = np.arange(12, dtype=np.float32).reshape(3, 4)
    bundle = BoundaryBundle.from_array(
        hidden, session=SESSION, first_pos=5, layer=2, model_fingerprint="fp", dtype=dtype
    )
    assert (bundle.n_tokens, bundle.hidden_size, bundle.dtype) == (3, 4, dtype)
    assert bundle.expected_payload_bytes == 12 * (4 if dtype == "f32" else 2)
    view = bundle.array()
    np.testing.assert_array_equal(view, hidden)
    assert not view.flags.writeable
    assert not np.shares_memory(view, hidden)
    hidden[0, 0] = 99.0
    assert bundle.array()[0, 0] == 0.0


def test_bundle_from_array_refuses_non_2d() -> None:
    with pytest.raises(InvalidRequest, match="2-D"):
        BoundaryBundle.from_array(
            np.zeros(4, dtype=np.float32), session=SESSION, first_pos=0, layer=1,
            model_fingerprint="fp",
        )  # fmt: skip


def test_bundle_array_refuses_length_mismatch() -> None:
    bundle = BoundaryBundle.from_array(
        np.zeros((2, 4), dtype=np.float32), session=SESSION, first_pos=0, layer=1,
        model_fingerprint="fp",
    )  # fmt: skip
    broken = msgspec.structs.replace(bundle, n_tokens=3)
    with pytest.raises(InvalidRequest, match="header promises"):
        broken.array()


def test_logits_from_array_round_trips() -> None:
    logits = np.linspace(-1, 1, 10, dtype=np.float64).reshape(2, 5)
    result = LogitsResult.from_array(
        logits, request_id="r", session=SESSION, first_pos=3, evidence="fixture"
    )
    assert (result.n_rows, result.vocab_size) == (2, 5)
    np.testing.assert_allclose(result.array(), logits, rtol=1e-6)
    with pytest.raises(InvalidRequest):
        msgspec.structs.replace(result, vocab_size=4).array()


def test_numpy_dtypes_are_little_endian() -> None:
    assert _types.numpy_dtype("f32") == np.dtype("<f4")
    assert _types.numpy_dtype("f16") == np.dtype("<f2")
