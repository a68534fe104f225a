"""The wire codec: every documented decode failure is a typed error, payloads are zero-copy."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from shard_engine_api import (
    CONTRACT_VERSION,
    BoundaryBundle,
    BoundaryDtype,
    BoundaryResult,
    CancelRequest,
    CancelResult,
    Capabilities,
    ChecksumMismatch,
    ContractVersionMismatch,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    Determinism,
    Features,
    Health,
    InvalidRequest,
    Limits,
    LoadConfig,
    LogitsResult,
    Metrics,
    NotReady,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    ResourceExhausted,
    SessionRef,
    ShardMismatch,
    ShardSpec,
    TokenInput,
    _bundle_checks,
    _codec,
)
from shard_engine_api._codec import all_finite
from shard_engine_api.wire import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    Codec,
    decode_bundle,
    decode_error,
    decode_message,
    decode_reply,
    decode_request,
    encode,
    encode_bundle,
    encode_error,
    encode_into,
    payload_checksum,
)

SESSION = SessionRef(session_id="sess", epoch=3)
SPEC = ShardSpec(model="tiny", n_layers=4, start=0, end=2)


def make_bundle(
    n_tokens: int = 3,
    hidden: int = 8,
    dtype: BoundaryDtype = "f32",
    *,
    layer: int = 2,
    seed: int = 0,
) -> BoundaryBundle:
    values = np.random.default_rng(seed).standard_normal((n_tokens, hidden))
    return BoundaryBundle.from_array(
        values, session=SESSION, first_pos=4, layer=layer, model_fingerprint="fp", dtype=dtype
    )


def raw(message: msgspec.Struct) -> dict[str, Any]:
    """The message as a plain msgpack map, to craft damaged variants."""
    decoded = msgspec.msgpack.decode(encode(message))  # type: ignore[arg-type]
    assert isinstance(decoded, dict)
    return decoded


def rebuilt(mapping: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode(mapping)


def capabilities() -> Capabilities:
    return Capabilities(
        engine="e",
        engine_version="1",
        contract_version=CONTRACT_VERSION,
        evidence="fixture",
        shard=SPEC,
        role="head",
        model_fingerprint="fp",
        hidden_size=8,
        vocab_size=16,
        boundary_dtypes=("f32", "f16"),
        limits=Limits(max_sessions=1, max_context=8, max_batch_tokens=8, kv_budget_tokens=8),
        features=Features(),
        determinism=Determinism(deterministic=True, split_exact=True),
    )


def logits_result(values: np.ndarray | None = None) -> LogitsResult:
    data = np.arange(6, dtype=np.float32).reshape(1, 6) if values is None else values
    return LogitsResult.from_array(
        data, request_id="r", session=SESSION, first_pos=4, evidence="real"
    )


# ----------------------------------------------------------------------------- round trips


def every_message() -> list[msgspec.Struct]:
    bundle = make_bundle()
    boundary_result = BoundaryResult(
        request_id="r", session=SESSION, first_pos=4, n_tokens=3, evidence="fixture", bundle=bundle
    )
    return [
        LoadConfig(shard=SPEC, options={"gpu": False, "path": "/m.gguf", "n": [1, 2]}),
        PrefillRequest(
            request_id="r", session=SESSION, start_pos=0, inputs=TokenInput(token_ids=(1, 2))
        ),
        PrefillRequest(request_id="r", session=SESSION, start_pos=4, inputs=bundle, logits="all"),
        DecodeRequest(request_id="d", session=SESSION, pos=7, inputs=make_bundle(1)),
        DecodeBatchRequest(
            request_id="b",
            items=(
                DecodeRequest(
                    request_id="d", session=SESSION, pos=7, inputs=TokenInput(token_ids=(5,))
                ),
            ),
        ),
        CancelRequest(request_id="r"),
        CancelRequest(session_id="sess"),
        ReleaseRequest(session=SESSION),
        capabilities(),
        boundary_result,
        logits_result(),
        DecodeBatchResult(
            request_id="b", items=(boundary_result, NotReady("x").to_info(), logits_result())
        ),
        CancelResult(cancelled=True, n_requests=2),
        ReleaseResult(released=False, detail="unknown"),
        Health(state="ready", sessions=2),
        Metrics(requests=3, errors={"cache_miss": 1}),
        NotReady("loading").to_info(),
        bundle,
    ]


@pytest.mark.parametrize("message", every_message(), ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: Any) -> None:
    assert decode_message(encode(message)) == message


def _large_messages() -> list[msgspec.Struct]:
    """Messages whose payload the codec aligns (64 KiB and more), in every position."""
    bundle = make_bundle(64, 512, seed=1)
    return [
        bundle,
        make_bundle(300, 128, "f16", seed=2),
        PrefillRequest(request_id="p", session=SESSION, start_pos=0, inputs=bundle),
        DecodeRequest(request_id="d", session=SESSION, pos=7, inputs=make_bundle(40, 1024)),
        BoundaryResult(
            request_id="r",
            session=SESSION,
            first_pos=4,
            n_tokens=64,
            evidence="real",
            bundle=bundle,
        ),
        logits_result(np.random.default_rng(3).standard_normal((1, 65536)).astype(np.float32)),
        DecodeBatchResult(request_id="b", items=(logits_result(), logits_result())),
    ]


@pytest.mark.parametrize(
    "message", every_message() + _large_messages(), ids=lambda m: type(m).__name__
)
def test_encode_into_writes_the_bytes_encode_returns(message: Any) -> None:
    """Into a buffer with room to spare: the same bytes as encode(), the rest untouched; into
    one byte too few: None and nothing written."""
    expected = encode(message)
    out = bytearray(b"\xaa" * (len(expected) + 100))
    assert encode_into(message, memoryview(out)) == len(expected)
    assert bytes(out[: len(expected)]) == expected
    assert out[len(expected) :] == b"\xaa" * 100
    assert decode_message(memoryview(out)[: len(expected)]) == message
    short = bytearray(b"\xbb" * (len(expected) - 1))
    assert encode_into(message, memoryview(short)) is None
    assert short == b"\xbb" * (len(expected) - 1)


def test_encode_into_refuses_what_encode_refuses_and_unwritable_buffers() -> None:
    out = memoryview(bytearray(1 << 16))
    with pytest.raises(InvalidRequest, match="not a wire message"):
        encode_into(object(), out)  # type: ignore[arg-type]
    for bad in (memoryview(bytes(1 << 16)), memoryview(bytearray(64)).cast("B", (8, 8))):
        with pytest.raises(InvalidRequest, match="writable 1-dimensional byte buffer"):
            encode_into(make_bundle(), bad)
    floats = memoryview(np.zeros(1024, dtype=np.float32).data)
    with pytest.raises(InvalidRequest, match="writable 1-dimensional byte buffer"):
        encode_into(make_bundle(), floats)


def test_requests_and_replies_have_their_own_decoders() -> None:
    for message in every_message():
        buf = encode(message)  # type: ignore[arg-type]
        if isinstance(message, _codec.WireRequest):
            assert decode_request(buf) == message
            with pytest.raises(InvalidRequest):
                decode_reply(buf)
        elif isinstance(message, _codec.WireReply):
            assert decode_reply(buf) == message
            with pytest.raises(InvalidRequest):
                decode_request(buf)


def test_unencodable_options_are_refused_when_built() -> None:
    with pytest.raises(InvalidRequest, match=r"LoadConfig\.options: option values must be JSON"):
        LoadConfig(shard=SPEC, options={"bad": object()})


@pytest.mark.parametrize(
    "bad",
    [
        {"start_pos": 2**64},
        {"start_pos": -(2**63) - 1},
        {"inputs": TokenInput(token_ids=(object(),))},  # type: ignore[arg-type]
    ],
    ids=["int above 64 bits", "int below 64 bits", "not encodable"],
)
def test_encode_refuses_unencodable_values(bad: dict[str, Any]) -> None:
    # Structs without construction checks hold anything; encoding still ends typed.
    fields: dict[str, Any] = {
        "request_id": "p",
        "session": SessionRef(session_id="s", epoch=1),
        "start_pos": 0,
        "inputs": TokenInput(token_ids=(1,)),
    }
    request = PrefillRequest(**(fields | bad))
    with pytest.raises(InvalidRequest, match="cannot encode"):
        encode(request)


def test_error_reply_raises_typed_error() -> None:
    with pytest.raises(NotReady, match="loading"):
        decode_reply(encode_error(NotReady("loading")))


# ----------------------------------------------------------------------------- zero copy


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("container", [bytes, bytearray, memoryview])
def test_bundle_payload_is_a_view_into_the_input(dtype: BoundaryDtype, container: type) -> None:
    bundle = make_bundle(16, 64, dtype)
    buf = container(encode_bundle(bundle))
    decoded = decode_bundle(buf)
    array = decoded.array()
    assert np.shares_memory(array, np.frombuffer(buf, dtype=np.uint8))
    np.testing.assert_array_equal(array, bundle.array())
    assert decoded == bundle


def test_view_base_is_the_input_buffer() -> None:
    buf = encode_bundle(make_bundle(4, 4096, "f16"))
    decoded = decode_bundle(buf)
    assert decoded.payload.obj is buf
    assert decoded.payload.readonly


def test_nested_payloads_are_views_too() -> None:
    result = logits_result()
    buf = encode(result)
    decoded = decode_reply(buf)
    assert isinstance(decoded, LogitsResult)
    assert decoded.payload.obj is buf


# ----------------------------------------------------------------------------- bytes damage


@pytest.mark.parametrize("buf", [b"", b"\x00", b"\xc1", b"\xff" * 40, b"not msgpack at all"])
def test_garbage_is_invalid_request(buf: bytes) -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode_bundle(buf)
    assert type(caught.value) is InvalidRequest
    with pytest.raises(InvalidRequest):
        decode_message(buf)


def test_truncated_bundle_is_invalid_request() -> None:
    buf = encode_bundle(make_bundle())
    for cut in (1, 10, len(buf) // 2, len(buf) - 1):
        with pytest.raises(InvalidRequest) as caught:
            decode_bundle(buf[:cut])
        assert type(caught.value) is InvalidRequest


def test_trailing_bytes_are_invalid_request() -> None:
    with pytest.raises(InvalidRequest):
        decode_bundle(encode_bundle(make_bundle()) + b"\x00")


def test_unknown_tag_is_invalid_request() -> None:
    mapping = raw(make_bundle())
    mapping["type"] = "boundary_v9"
    with pytest.raises(InvalidRequest, match="boundary_v9") as caught:
        decode_bundle(rebuilt(mapping))
    assert type(caught.value) is InvalidRequest
    with pytest.raises(InvalidRequest):
        decode_message(rebuilt(mapping))


def test_other_message_where_a_bundle_is_expected_is_invalid_request() -> None:
    with pytest.raises(InvalidRequest):
        decode_bundle(encode(CancelRequest(request_id="r")))


# ----------------------------------------------------------------------------- contract version


def test_wrong_contract_version_is_reported() -> None:
    mapping = raw(make_bundle())
    mapping["contract_version"] = CONTRACT_VERSION + 1
    with pytest.raises(ContractVersionMismatch) as caught:
        decode_bundle(rebuilt(mapping))
    assert caught.value.details["contract_version"] == CONTRACT_VERSION + 1


def test_newer_version_with_unknown_shape_still_reports_the_version() -> None:
    mapping = raw(make_bundle())
    mapping["contract_version"] = CONTRACT_VERSION + 1
    del mapping["checksum"]
    mapping["dtype"] = "fp8"
    mapping["n_tokens"] = "many"
    mapping["new_field"] = {"x": 1}
    with pytest.raises(ContractVersionMismatch):
        decode_bundle(rebuilt(mapping))
    with pytest.raises(ContractVersionMismatch):
        decode_message(rebuilt(mapping))


def test_version_of_nested_bundle_is_reported() -> None:
    request = PrefillRequest(request_id="r", session=SESSION, start_pos=4, inputs=make_bundle())
    mapping = raw(request)
    mapping["inputs"]["contract_version"] = 7
    mapping["inputs"]["payload"] = 12
    with pytest.raises(ContractVersionMismatch):
        decode_request(rebuilt(mapping))
    result = BoundaryResult(
        request_id="r", session=SESSION, first_pos=4, n_tokens=3, evidence="real",
        bundle=make_bundle(),
    )  # fmt: skip
    mapping = raw(DecodeBatchResult(request_id="b", items=(result,)))
    mapping["items"][0]["bundle"]["contract_version"] = 0
    with pytest.raises(ContractVersionMismatch):
        decode_reply(rebuilt(mapping))


def test_capabilities_of_another_version_are_refused() -> None:
    mapping = raw(capabilities())
    mapping["contract_version"] = CONTRACT_VERSION + 1
    with pytest.raises(ContractVersionMismatch):
        decode_reply(rebuilt(mapping))
    mapping["limits"] = "unknown shape"
    with pytest.raises(ContractVersionMismatch):
        decode_reply(rebuilt(mapping))


def test_version_one_with_a_broken_shape_is_plain_invalid_request() -> None:
    mapping = raw(make_bundle())
    del mapping["checksum"]
    with pytest.raises(InvalidRequest, match="checksum") as caught:
        decode_bundle(rebuilt(mapping))
    assert type(caught.value) is InvalidRequest


# ----------------------------------------------------------------------------- header values


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("n_tokens", 4, "header promises"),
        ("hidden_size", 7, "header promises"),
        ("dtype", "f16", "header promises"),
        ("n_tokens", 0, "out of range"),
        ("n_tokens", -3, "Expected `int` >= 0"),
        ("hidden_size", 0, "out of range"),
        ("first_pos", -1, "Expected `int` >= 0"),
        ("n_tokens", 2**40, "header promises"),
        ("hidden_size", 2**62, "header promises"),
        ("n_tokens", 2**64 - 1, "Expected `int` <= 9223372036854775807"),
        ("first_pos", -(2**63), "Expected `int` >= 0"),
        ("dtype", "f8", "f8"),
        ("dtype", "bf16", "header promises"),
        ("dtype", 4, "Expected `str`"),
        ("payload", "text", "Expected `bytes`"),
    ],
)
def test_bad_header_values_are_invalid_request(field: str, value: object, match: str) -> None:
    mapping = raw(make_bundle())
    mapping[field] = value
    with pytest.raises(InvalidRequest, match=match) as caught:
        decode_bundle(rebuilt(mapping))
    assert type(caught.value) is InvalidRequest


def test_layer_zero_is_a_shard_mismatch() -> None:
    # No shard boundary is layer 0 (a bundle enters the producer's end): the same violation
    # as a bundle for another layer, on every path.
    mapping = raw(make_bundle())
    mapping["layer"] = 0
    with pytest.raises(ShardMismatch, match="layer 0"):
        decode_bundle(rebuilt(mapping))


def test_bad_session_in_bundle_is_invalid_request() -> None:
    mapping = raw(make_bundle())
    mapping["session"]["epoch"] = -1
    with pytest.raises(InvalidRequest, match="epoch"):
        decode_bundle(rebuilt(mapping))


# ----------------------------------------------------------------------------- payload checks


def test_checksum_field_mismatch() -> None:
    mapping = raw(make_bundle())
    mapping["checksum"] ^= 1
    with pytest.raises(ChecksumMismatch) as caught:
        decode_bundle(rebuilt(mapping))
    assert caught.value.retryable


@pytest.mark.parametrize(("n_tokens", "dtype"), [(3, "f32"), (600, "f16"), (300, "f32")])
def test_flipped_payload_byte_is_checksum_mismatch(n_tokens: int, dtype: BoundaryDtype) -> None:
    bundle = make_bundle(n_tokens, 64, dtype)
    buf = bytearray(encode_bundle(bundle))
    offset = bytes(buf).index(bytes(bundle.payload))
    buf[offset + len(bundle.payload) // 2] ^= 0x10
    with pytest.raises(ChecksumMismatch):
        decode_bundle(bytes(buf))


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("n_tokens", [2, 300])
def test_non_finite_hidden_states(dtype: BoundaryDtype, bad: float, n_tokens: int) -> None:
    values = np.ones((n_tokens, 64))
    values[-1, -1] = bad
    bundle = BoundaryBundle.from_array(
        values, session=SESSION, first_pos=0, layer=1, model_fingerprint="fp", dtype=dtype
    )
    buf = encode_bundle(bundle)
    with pytest.raises(InvalidRequest, match="NaN or Inf") as caught:
        decode_bundle(buf)
    assert type(caught.value) is InvalidRequest
    decoded = decode_bundle(buf, nonfinite="allow")
    assert not np.isfinite(decoded.array()[-1, -1])
    assert Codec(nonfinite="allow").decode_bundle(buf) == bundle


def test_f16_overflow_from_f32_is_caught() -> None:
    # hidden states above the f16 range become infinities when sent as f16 (see gemma3 notes)
    with np.errstate(over="ignore"):
        bundle = BoundaryBundle.from_array(
            np.full((1, 8), 8.3e4), session=SESSION, first_pos=0, layer=1,
            model_fingerprint="fp", dtype="f16",
        )  # fmt: skip
    with pytest.raises(InvalidRequest, match="NaN or Inf"):
        decode_bundle(encode_bundle(bundle))


def test_payload_over_the_limit_is_refused_before_hashing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    buf = encode_bundle(make_bundle(4, 64))

    def forbidden(*arguments: object) -> int:
        raise AssertionError("hashed an oversized payload")

    monkeypatch.setattr(_bundle_checks, "verify_payload", forbidden)
    with pytest.raises(ResourceExhausted) as caught:
        decode_bundle(buf, max_payload_bytes=1023)
    assert not caught.value.retryable
    assert caught.value.details == {
        "resource": "payload_bytes",
        "payload_bytes": 1024,
        "limit": 1023,
        "violation": "payload_limit",
    }


def test_payload_at_the_limit_is_accepted() -> None:
    bundle = make_bundle(4, 64)
    assert decode_bundle(encode_bundle(bundle), max_payload_bytes=1024) == bundle
    assert DEFAULT_MAX_PAYLOAD_BYTES == 256 * 1024 * 1024


def test_logits_payload_is_verified() -> None:
    result = logits_result()
    mapping = raw(result)
    mapping["checksum"] ^= 0xFF
    with pytest.raises(ChecksumMismatch):
        decode_reply(rebuilt(mapping))
    mapping = raw(result)
    mapping["vocab_size"] = 5
    with pytest.raises(InvalidRequest, match="header promises"):
        decode_reply(rebuilt(mapping))
    nan_logits = logits_result(np.array([[0.0, np.nan]], dtype=np.float32))
    with pytest.raises(InvalidRequest, match="NaN or Inf"):
        decode_reply(encode(nan_logits))
    assert decode_reply(encode(nan_logits), nonfinite="allow") == nan_logits
    with pytest.raises(ResourceExhausted):
        decode_reply(encode(result), max_payload_bytes=8)


def test_damaged_bundle_inside_a_request_or_result_is_caught() -> None:
    bundle = make_bundle()
    damaged = msgspec.structs.replace(bundle, checksum=bundle.checksum ^ 1)
    request = DecodeBatchRequest(
        request_id="b",
        items=(DecodeRequest(request_id="d", session=SESSION, pos=4, inputs=damaged),),
    )
    with pytest.raises(ChecksumMismatch):
        decode_request(encode(request))
    result = BoundaryResult(
        request_id="r", session=SESSION, first_pos=4, n_tokens=3, evidence="real", bundle=damaged
    )
    with pytest.raises(ChecksumMismatch):
        decode_message(encode(DecodeBatchResult(request_id="b", items=(result,))))


# ----------------------------------------------------------------------------- expectations


def test_expected_fingerprint_and_layer() -> None:
    buf = encode_bundle(make_bundle(layer=2))
    assert decode_bundle(buf, expected_fingerprint="fp", expected_layer=2).layer == 2
    with pytest.raises(ShardMismatch, match="model"):
        decode_bundle(buf, expected_fingerprint="other")
    with pytest.raises(ShardMismatch, match="layer"):
        decode_bundle(buf, expected_layer=3)


def test_codec_applies_expectations_to_nested_bundles() -> None:
    codec = Codec(expected_fingerprint="fp", expected_layer=1)
    request = PrefillRequest(
        request_id="r", session=SESSION, start_pos=4, inputs=make_bundle(layer=2)
    )
    with pytest.raises(ShardMismatch):
        codec.decode_request(encode(request))


def test_codec_policy_validation_and_repr() -> None:
    with pytest.raises(InvalidRequest):
        Codec(max_payload_bytes=0)
    with pytest.raises(InvalidRequest):
        Codec(nonfinite="maybe")  # type: ignore[arg-type]
    assert "nonfinite='allow'" in repr(Codec(nonfinite="allow"))


def test_codec_methods_match_the_functions() -> None:
    codec = Codec()
    bundle = make_bundle()
    assert codec.encode_bundle(bundle) == encode_bundle(bundle) == encode(bundle)
    assert codec.decode_bundle(encode_bundle(bundle)) == bundle
    assert codec.decode_message(encode(bundle)) == bundle
    assert codec.decode_error(codec.encode_error(NotReady("x"))).code == "not_ready"


def test_verify_bundle_checks_in_memory_bundles() -> None:
    bundle = make_bundle()
    Codec().verify_bundle(bundle)
    with pytest.raises(ChecksumMismatch):
        Codec().verify_bundle(msgspec.structs.replace(bundle, checksum=0))
    assert payload_checksum(bundle.payload) == bundle.checksum


# ----------------------------------------------------------------------------- finiteness helper


@pytest.mark.parametrize("dtype", ["<f2", "<f4"])
@pytest.mark.parametrize("size", [1, 4096, 4097, (1 << 19) + 3, (1 << 20) + 1])
def test_all_finite_finds_a_single_bad_value_anywhere(dtype: str, size: int) -> None:
    values = np.zeros(size, dtype=dtype)
    assert all_finite(values)
    for index in {0, size // 2, size - 1}:
        for bad in (np.nan, np.inf, -np.inf):
            values[index] = bad
            assert not all_finite(values)
            values[index] = 0
    values[:] = -np.finfo(dtype).max
    assert all_finite(values)


@pytest.mark.parametrize("fingerprint", ["f", "fp-0123456789", "x" * 40])
def test_large_payloads_land_aligned_and_the_padding_is_ignored(fingerprint: str) -> None:
    bundle = BoundaryBundle.from_array(
        np.ones((300, 64)), session=SESSION, first_pos=0, layer=1, model_fingerprint=fingerprint
    )
    request = PrefillRequest(request_id="r", session=SESSION, start_pos=0, inputs=bundle)
    for message in (bundle, request):
        buf = encode(message)
        decoded = decode_message(buf)
        assert decoded == message
        assert bytes(buf).index(bytes(bundle.payload)) % 16 == 0
        assert "_pad" in msgspec.msgpack.decode(buf)
        carried = decoded.inputs if isinstance(decoded, PrefillRequest) else decoded
        assert isinstance(carried, BoundaryBundle)
        assert carried.payload.obj is buf


_NOT_BUFFERS: list[object] = [
    "\x81\xa4type\xa6health",
    None,
    5,
    [0x81],
    memoryview(b"\x81\xa4type\xa6health" * 2)[::2],
]


@pytest.mark.parametrize("buf", _NOT_BUFFERS, ids=lambda value: type(value).__name__)
@pytest.mark.parametrize(
    "decoder",
    [
        decode_message,
        decode_request,
        decode_reply,
        decode_bundle,
        decode_error,
        Codec().decode_bundle,
    ],
)
def test_decoding_what_is_not_a_contiguous_buffer_is_invalid_request(
    decoder: Any, buf: object
) -> None:
    """A str, None or a strided view used to fail with TypeError or BufferError."""
    with pytest.raises(InvalidRequest):
        decoder(buf)


def test_a_released_buffer_is_invalid_request() -> None:
    view = memoryview(bytearray(encode(Health(state="ready"))))
    view.release()
    with pytest.raises(InvalidRequest):
        decode_message(view)


@pytest.mark.parametrize(
    "value", ["text", None, 5, SessionRef(session_id="s", epoch=1), TokenInput(token_ids=(1,))]
)
def test_encoding_what_is_not_a_wire_message_is_invalid_request(value: object) -> None:
    """``encode(5)`` used to return bytes that no decoder accepts (and nested types such as
    TokenInput do not travel alone)."""
    with pytest.raises(InvalidRequest):
        encode(value)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        encode_bundle(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["boom", None, RuntimeError("boom")])
def test_encode_error_of_what_is_not_a_shard_engine_error_is_invalid_request(value: object) -> None:
    with pytest.raises(InvalidRequest):
        encode_error(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "policy",
    [
        {"expected_fingerprint": 5},
        {"expected_layer": "2"},
        {"expected_layer": -1},
        {"expected_layer": True},
        {"expected_hidden_size": 0},
        {"expected_hidden_size": 8.0},
    ],
)
def test_a_codec_policy_of_the_wrong_type_is_refused(policy: dict[str, Any]) -> None:
    """An expectation of the wrong type would refuse every bundle as ShardMismatch."""
    with pytest.raises(InvalidRequest):
        Codec(**policy)
