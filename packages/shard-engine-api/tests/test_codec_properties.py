"""Property tests of the wire codec: round trips of every message, and damage of any kind
ends as a typed InvalidRequest (or subclass), never as another exception or a partial object."""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shard_engine_api import (
    CONTRACT_VERSION,
    BoundaryBundle,
    BoundaryResult,
    CacheMiss,
    CancelRequest,
    CancelResult,
    Capabilities,
    ChecksumMismatch,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    Determinism,
    ErrorInfo,
    Features,
    Health,
    InvalidRequest,
    Limits,
    LoadConfig,
    LogitsResult,
    Metrics,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    SessionRef,
    ShardSpec,
    StaleEpoch,
    Timings,
    TokenInput,
)
from shard_engine_api.wire import WireMessage, decode_bundle, decode_message, encode, encode_bundle

PROPERTIES = settings(derandomize=True, deadline=None, database=None, max_examples=60)

INT64 = st.integers(-(2**63), 2**63 - 1)
COUNT = st.integers(0, 2**31)
NAME = st.text(min_size=1, max_size=12)
FINITE = st.floats(allow_nan=False, allow_infinity=False)
DURATION = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)
"""Milliseconds: finite and >= 0 (the decoders refuse anything else)."""

sessions = st.builds(SessionRef, session_id=NAME, epoch=st.integers(0, 2**63 - 1))
timings = st.builds(Timings, queue_ms=DURATION, compute_ms=DURATION, total_ms=DURATION)


@st.composite
def shard_specs(draw: st.DrawFn) -> ShardSpec:
    n_layers = draw(st.integers(1, 200))
    start = draw(st.integers(0, n_layers - 1))
    end = draw(st.integers(start + 1, n_layers))
    return ShardSpec(model=draw(NAME), n_layers=n_layers, start=start, end=end)


@st.composite
def hidden_arrays(draw: st.DrawFn) -> tuple[np.ndarray, str]:
    dtype = draw(st.sampled_from(["f32", "f16"]))
    width: Literal[16, 32] = 16 if dtype == "f16" else 32
    shape = (draw(st.integers(1, 12)), draw(st.integers(1, 48)))
    elements = st.floats(width=width, allow_nan=False, allow_infinity=False)
    values = draw(hnp.arrays("<f2" if dtype == "f16" else "<f4", shape, elements=elements))
    return values, dtype


@st.composite
def bundles(draw: st.DrawFn, n_tokens: int | None = None) -> BoundaryBundle:
    values, dtype = draw(hidden_arrays())
    if n_tokens is not None:
        values = values[:1]
    return BoundaryBundle.from_array(
        values,
        session=draw(sessions),
        first_pos=draw(COUNT),
        layer=draw(st.integers(1, 10_000)),
        model_fingerprint=draw(st.text(min_size=1, max_size=40)),
        dtype=dtype,  # type: ignore[arg-type]
    )


@st.composite
def logits_results(draw: st.DrawFn) -> LogitsResult:
    shape = (draw(st.integers(1, 4)), draw(st.integers(1, 64)))
    values = draw(hnp.arrays("<f4", shape, elements=st.floats(width=32, allow_nan=False)))
    values = np.nan_to_num(values, posinf=1e30, neginf=-1e30)
    return LogitsResult.from_array(
        values,
        request_id=draw(NAME),
        session=draw(sessions),
        first_pos=draw(COUNT),
        evidence=draw(st.sampled_from(["fixture", "real"])),
        timings=draw(timings),
    )


inputs = st.one_of(
    st.builds(TokenInput, token_ids=st.lists(COUNT, min_size=1, max_size=20).map(tuple)),
    bundles(),
)
decode_requests = st.builds(
    DecodeRequest,
    request_id=NAME,
    session=sessions,
    pos=COUNT,
    inputs=st.one_of(st.builds(TokenInput, token_ids=st.tuples(COUNT)), bundles(n_tokens=1)),
)
details = st.dictionaries(
    NAME, st.one_of(st.none(), st.booleans(), INT64, FINITE, st.text(max_size=10)), max_size=4
)
error_infos = st.builds(
    ErrorInfo, code=NAME, message=st.text(max_size=30), retryable=st.booleans(), details=details
)
boundary_results = st.builds(
    lambda request_id, bundle, evidence, t: BoundaryResult(
        request_id=request_id,
        session=bundle.session,
        first_pos=bundle.first_pos,
        n_tokens=bundle.n_tokens,
        evidence=evidence,
        bundle=bundle,
        timings=t,
    ),
    NAME,
    bundles(),
    st.sampled_from(["fixture", "real"]),
    timings,
)
option_values = st.recursive(
    st.one_of(st.none(), st.booleans(), INT64, FINITE, st.text(max_size=8)),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(NAME, children, max_size=3),
    max_leaves=6,
)
positive = st.integers(1, 2**31)


@st.composite
def capabilities(draw: st.DrawFn) -> Capabilities:
    shard = draw(shard_specs())
    return Capabilities(
        engine=draw(NAME),
        engine_version=draw(NAME),
        contract_version=CONTRACT_VERSION,
        evidence=draw(st.sampled_from(["fixture", "real"])),
        shard=shard,
        role=shard.role,
        model_fingerprint=draw(NAME),
        hidden_size=draw(positive),
        vocab_size=draw(positive),
        boundary_dtypes=draw(st.sampled_from([("f32",), ("f16",), ("f32", "f16")])),
        limits=Limits(
            max_sessions=draw(positive),
            max_context=draw(positive),
            max_batch_tokens=draw(positive),
            kv_budget_tokens=draw(positive),
        ),
        features=Features(cancel=draw(st.booleans()), cancel_latency_ms=draw(DURATION)),
        determinism=Determinism(
            deterministic=draw(st.booleans()),
            split_exact=draw(st.booleans()),
            tolerance=draw(FINITE),
        ),
    )


messages: st.SearchStrategy[Any] = st.one_of(
    st.builds(
        LoadConfig,
        shard=shard_specs(),
        boundary_dtype=st.sampled_from(["f32", "f16"]),
        max_sessions=st.integers(1, 2**31 - 1),
        eviction=st.sampled_from(["reject", "lru"]),
        n_threads=st.integers(0, 64),
        options=st.dictionaries(NAME, option_values, max_size=3),
    ),
    st.builds(
        PrefillRequest,
        request_id=NAME,
        session=sessions,
        start_pos=COUNT,
        inputs=inputs,
        logits=st.sampled_from(["last", "all"]),
    ),
    decode_requests,
    st.builds(
        DecodeBatchRequest,
        request_id=NAME,
        items=st.lists(decode_requests, max_size=3).map(tuple),
    ),
    st.one_of(st.builds(CancelRequest, request_id=NAME), st.builds(CancelRequest, session_id=NAME)),
    st.builds(CancelResult, cancelled=st.booleans(), n_requests=COUNT),
    st.builds(ReleaseRequest, session=sessions),
    st.builds(ReleaseResult, released=st.booleans(), detail=st.text(max_size=20)),
    capabilities(),
    boundary_results,
    logits_results(),
    st.builds(
        DecodeBatchResult,
        request_id=NAME,
        items=st.lists(st.one_of(boundary_results, logits_results(), error_infos), max_size=3).map(
            tuple
        ),
    ),
    st.builds(
        Health,
        state=st.sampled_from(["loading", "ready", "degraded", "failed", "closed"]),
        detail=st.text(max_size=20),
        sessions=COUNT,
        kv_used_tokens=COUNT,
    ),
    st.builds(
        Metrics,
        requests=COUNT,
        decode_tokens=COUNT,
        compute_ms=DURATION,
        errors=st.dictionaries(NAME, COUNT, max_size=3),
    ),
    error_infos,
    bundles(),
)


@PROPERTIES
@given(messages)
def test_every_message_round_trips(message: WireMessage) -> None:
    assert decode_message(encode(message)) == message


@PROPERTIES
@given(bundles())
def test_bundle_round_trip_is_zero_copy_and_exact(bundle: BoundaryBundle) -> None:
    buf = encode_bundle(bundle)
    decoded = decode_bundle(buf, expected_fingerprint=bundle.model_fingerprint)
    assert decoded == bundle
    array = decoded.array()
    assert array.shape == (bundle.n_tokens, bundle.hidden_size)
    assert np.array_equal(array, bundle.array())
    assert np.shares_memory(array, np.frombuffer(buf, dtype=np.uint8))


@PROPERTIES
@given(bundles(), st.data())
def test_any_truncation_is_invalid_request(bundle: BoundaryBundle, data: st.DataObject) -> None:
    buf = encode_bundle(bundle)
    cut = data.draw(st.integers(0, len(buf) - 1))
    with pytest.raises(InvalidRequest) as caught:
        decode_bundle(buf[:cut])
    assert type(caught.value) is InvalidRequest


@PROPERTIES
@given(bundles(), st.data())
def test_payload_byte_flip_is_checksum_mismatch(
    bundle: BoundaryBundle, data: st.DataObject
) -> None:
    buf = bytearray(encode_bundle(bundle))
    start = bytes(buf).rindex(bytes(bundle.payload))
    index = start + data.draw(st.integers(0, len(bundle.payload) - 1))
    buf[index] ^= data.draw(st.integers(1, 255))
    with pytest.raises(ChecksumMismatch):
        decode_bundle(bytes(buf))


@PROPERTIES
@given(bundles(), st.data())
def test_any_byte_flip_never_escapes_the_taxonomy(
    bundle: BoundaryBundle, data: st.DataObject
) -> None:
    buf = bytearray(encode_bundle(bundle))
    buf[data.draw(st.integers(0, len(buf) - 1))] ^= data.draw(st.integers(1, 255))
    try:
        decoded = decode_bundle(bytes(buf))
    except InvalidRequest:
        return
    # A flip in a header string (session id, fingerprint) can decode; the payload cannot change.
    assert decoded.payload == bundle.payload


@PROPERTIES
@given(st.binary(max_size=300))
def test_random_garbage_is_invalid_request(garbage: bytes) -> None:
    with pytest.raises(InvalidRequest):
        decode_message(garbage)
    with pytest.raises(InvalidRequest):
        decode_bundle(garbage)


TAGS = [
    "boundary",
    "prefill",
    "decode",
    "decode_batch",
    "cancel",
    "cancel_result",
    "release",
    "release_result",
    "boundary_result",
    "logits_result",
    "decode_batch_result",
    "capabilities",
    "load",
    "health",
    "metrics",
    "error",
    "tokens",
    "nope",
]
msgpack_values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), INT64, st.floats(), st.text(max_size=6), st.binary(max_size=16)
    ),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                ["type", "session", "session_id", "epoch", "n_tokens", "payload", "items", "inputs"]
            )
            | st.text(max_size=6),
            children,
            max_size=5,
        )
    ),
    max_leaves=12,
)


@PROPERTIES
@given(st.sampled_from(TAGS), st.dictionaries(st.text(max_size=12), msgpack_values, max_size=8))
def test_well_formed_msgpack_of_the_wrong_shape_is_invalid_request(
    tag: str, fields: dict[str, Any]
) -> None:
    buf = msgspec.msgpack.encode({**fields, "type": tag})
    # Either it happens to be a valid message, or the refusal is typed; nothing else escapes.
    with contextlib.suppress(InvalidRequest):
        decode_message(buf)


@PROPERTIES
@given(bundles(), st.data())
def test_non_finite_values_follow_the_policy(bundle: BoundaryBundle, data: st.DataObject) -> None:
    values = bundle.array().copy()
    flat = values.reshape(-1)
    flat[data.draw(st.integers(0, flat.size - 1))] = data.draw(
        st.sampled_from([np.nan, np.inf, -np.inf])
    )
    damaged = BoundaryBundle.from_array(
        values,
        session=bundle.session,
        first_pos=bundle.first_pos,
        layer=bundle.layer,
        model_fingerprint=bundle.model_fingerprint,
        dtype=bundle.dtype,
    )
    buf = encode_bundle(damaged)
    with pytest.raises(InvalidRequest, match="NaN or Inf") as caught:
        decode_bundle(buf)
    assert type(caught.value) is InvalidRequest
    assert decode_bundle(buf, nonfinite="allow") == damaged


@PROPERTIES
@given(st.integers(0, 2**62), st.sampled_from(["gap", "evicted", "position_mismatch"]), details)
def test_cache_miss_wire_round_trip(committed: int, reason: str, extra: dict[str, Any]) -> None:
    error = CacheMiss("miss", committed_length=committed, reason=reason, details=extra)
    decoded = decode_message(encode(error.to_info()))
    assert isinstance(decoded, ErrorInfo)
    assert decoded.details["committed_length"] == committed
    assert decoded.details["reason"] == reason
    assert decoded == error.to_info()
    assert StaleEpoch("x").to_info() != decoded
