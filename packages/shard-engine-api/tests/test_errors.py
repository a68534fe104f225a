"""The error taxonomy and its wire form: every class survives encode -> decode intact."""

from __future__ import annotations

import msgspec
import pytest

from shard_engine_api import (
    CacheMiss,
    Cancelled,
    ChecksumMismatch,
    ContractVersionMismatch,
    DecodeBatchResult,
    EngineCrashed,
    ErrorInfo,
    InvalidRequest,
    MalformedOutput,
    NotReady,
    OutcomeUnknown,
    ResourceExhausted,
    SessionRef,
    ShardEngineError,
    ShardMismatch,
    StaleEpoch,
    Unauthenticated,
    UnsupportedFeature,
    WrongRole,
    _errors,
)
from shard_engine_api.wire import (
    decode_error,
    decode_message,
    decode_reply,
    encode,
    encode_error,
    error_from_info,
)

# (class, wire code, retryable by default, direct parent). Codes are the wire identity: pinned.
TAXONOMY: list[tuple[type[ShardEngineError], str, bool, type[Exception]]] = [
    (ShardEngineError, "shard_engine_error", False, Exception),
    (InvalidRequest, "invalid_request", False, ShardEngineError),
    (WrongRole, "wrong_role", False, InvalidRequest),
    (ShardMismatch, "shard_mismatch", False, InvalidRequest),
    (ContractVersionMismatch, "contract_version_mismatch", False, InvalidRequest),
    (ChecksumMismatch, "checksum_mismatch", True, InvalidRequest),
    (UnsupportedFeature, "unsupported_feature", False, ShardEngineError),
    (NotReady, "not_ready", True, ShardEngineError),
    (CacheMiss, "cache_miss", True, ShardEngineError),
    (StaleEpoch, "stale_epoch", False, ShardEngineError),
    (ResourceExhausted, "resource_exhausted", True, ShardEngineError),
    (Cancelled, "cancelled", True, ShardEngineError),
    (MalformedOutput, "malformed_output", True, ShardEngineError),
    (EngineCrashed, "engine_crashed", False, ShardEngineError),
    (OutcomeUnknown, "outcome_unknown", True, ShardEngineError),
    (Unauthenticated, "unauthenticated", False, ShardEngineError),
]
CLASSES = [row[0] for row in TAXONOMY]


def _make(cls: type[ShardEngineError], **kwargs: object) -> ShardEngineError:
    if cls is CacheMiss:
        return CacheMiss("miss", committed_length=7, reason="position_mismatch", **kwargs)  # type: ignore[arg-type]
    return cls("boom", **kwargs)  # type: ignore[arg-type]


def test_taxonomy_covers_every_error_class() -> None:
    exported = {
        value
        for value in vars(_errors).values()
        if isinstance(value, type) and issubclass(value, ShardEngineError)
    }
    assert exported == set(CLASSES)


@pytest.mark.parametrize(("cls", "code", "retryable", "parent"), TAXONOMY)
def test_code_retryable_and_parent_are_pinned(
    cls: type[ShardEngineError], code: str, retryable: bool, parent: type[Exception]
) -> None:
    assert cls.code == code
    assert cls.default_retryable is retryable
    assert cls.__bases__[0] is parent
    assert _make(cls).retryable is retryable


def test_codes_are_unique() -> None:
    assert len({cls.code for cls in CLASSES}) == len(CLASSES)


def test_invalid_request_is_a_value_error() -> None:
    assert issubclass(InvalidRequest, ValueError)
    assert issubclass(ChecksumMismatch, ValueError)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("retryable", [None, True, False])
def test_error_wire_round_trip(cls: type[ShardEngineError], retryable: bool | None) -> None:
    details: dict[str, str | int | float | bool | None] = {
        "resource": "kv",
        "used": 3,
        "ratio": 0.5,
        "flag": True,
        "none": None,
    }
    error = _make(cls, retryable=retryable, details=details)
    back = decode_error(encode_error(error))
    assert type(back) is cls
    assert back.code == error.code
    assert back.message == error.message
    if cls in (ResourceExhausted, NotReady, ShardEngineError) or issubclass(cls, NotReady):
        assert back.retryable is error.retryable
    else:  # the contract fixes it: a peer's other claim is not believed
        assert back.retryable is cls.default_retryable
    assert back.details == error.details
    for key, value in details.items():
        assert back.details[key] == value


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_decode_reply_raises_the_carried_error(cls: type[ShardEngineError]) -> None:
    error = _make(cls)
    with pytest.raises(cls) as caught:
        decode_reply(encode_error(error))
    assert type(caught.value) is cls
    assert caught.value.to_info() == error.to_info()


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_peer_cannot_flip_a_retryable_the_contract_fixes(cls: type[ShardEngineError]) -> None:
    """A StaleEpoch or InvalidRequest claimed retryable would keep a worker's retry loop going
    forever; a Cancelled or CacheMiss claimed final would make it give up. Only the classes whose
    retryable the contract leaves to the engine keep the wire's."""
    info = msgspec.structs.replace(_make(cls).to_info(), retryable=not cls.default_retryable)
    back = decode_error(encode(info))
    if cls in (ResourceExhausted, NotReady, ShardEngineError):
        assert back.retryable is not cls.default_retryable
    else:
        assert back.retryable is cls.default_retryable


def test_error_info_is_a_wire_message() -> None:
    info = _make(StaleEpoch).to_info()
    assert decode_message(encode(info)) == info


def test_cache_miss_keeps_committed_length_and_reason() -> None:
    error = CacheMiss("evicted", committed_length=42, reason="evicted", details={"x": 1})
    back = decode_error(encode_error(error))
    assert isinstance(back, CacheMiss)
    assert back.committed_length == 42
    assert back.reason == "evicted"
    assert back.details == {"x": 1, "committed_length": 42, "reason": "evicted"}
    assert back.retryable


def test_cache_miss_with_damaged_details_still_rebuilds() -> None:
    info = ErrorInfo(code="cache_miss", message="m", retryable=True, details={"reason": 3})
    back = error_from_info(info)
    assert isinstance(back, CacheMiss)
    assert (back.committed_length, back.reason) == (0, "unknown")


@pytest.mark.parametrize("length", [-1, -(2**63), True, 2.5, "7", None])
def test_cache_miss_with_a_length_that_is_no_position_rebuilds_with_zero(length: object) -> None:
    details: dict[str, object] = {"committed_length": length, "reason": "evicted"}
    info = msgspec.convert({"code": "cache_miss", "message": "m", "retryable": True}, ErrorInfo)
    # Bytes a peer could send: the details map as decoded, whatever the length's type.
    raw = msgspec.msgpack.decode(encode(info))
    raw["details"] = details
    back = decode_error(msgspec.msgpack.encode(raw))
    assert isinstance(back, CacheMiss)
    assert type(back.committed_length) is int
    assert back.committed_length == 0
    assert back.details["committed_length"] == 0


def test_unknown_code_becomes_the_root_class_and_keeps_the_code() -> None:
    info = ErrorInfo(code="from_the_future", message="m", retryable=True)
    back = decode_error(encode(info))
    assert type(back) is ShardEngineError
    assert back.details["unknown_code"] == "from_the_future"
    assert back.retryable


def test_batch_result_carries_errors_as_items() -> None:
    error = CacheMiss("m", committed_length=3, reason="gap").to_info()
    batch = DecodeBatchResult(request_id="b", items=(error,))
    decoded = decode_message(encode(batch))
    assert isinstance(decoded, DecodeBatchResult)
    item = decoded.items[0]
    assert isinstance(item, ErrorInfo)
    rebuilt = error_from_info(item)
    assert isinstance(rebuilt, CacheMiss)
    assert rebuilt.committed_length == 3


@pytest.mark.parametrize(
    "garbage", [b"", b"\xc1", msgspec.msgpack.encode(SessionRef(session_id="s", epoch=1))]
)
def test_decode_error_refuses_non_errors(garbage: bytes) -> None:
    with pytest.raises(InvalidRequest):
        decode_error(garbage)


def test_error_info_wire_shape_is_stable() -> None:
    raw = msgspec.msgpack.decode(encode_error(NotReady("loading")))
    assert raw == {
        "type": "error",
        "code": "not_ready",
        "message": "loading",
        "retryable": True,
        "details": {},
    }


# ----------------------------------------------------------------------------- wire bounds


def _peer_error(**fields: object) -> bytes:
    return msgspec.msgpack.encode(
        {"type": "error", "code": "x", "message": "m", "retryable": False, **fields}
    )


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"message": "m" * (_errors.MAX_ERROR_MESSAGE_CHARS + 1)}, id="message"),
        pytest.param({"code": "c" * (_errors.MAX_ERROR_CODE_CHARS + 1)}, id="code"),
        pytest.param({"details": {"d": "v" * (_errors.MAX_ERROR_DETAIL_CHARS + 1)}}, id="detail"),
        pytest.param({"details": {"k" * (_errors.MAX_ERROR_CODE_CHARS + 1): 1}}, id="name"),
        pytest.param(
            {"details": {f"d{i}": i for i in range(_errors.MAX_ERROR_DETAILS + 1)}}, id="details"
        ),
    ],
)
def test_a_peers_error_beyond_the_wire_bounds_does_not_decode(fields: dict[str, object]) -> None:
    """An error a peer sends is bounded field by field (not only by the message size): a
    longer message, code, detail name or string detail, or more details, is InvalidRequest,
    never an error object of that size handed on to callers and logs."""
    with pytest.raises(InvalidRequest):
        decode_error(_peer_error(**fields))
    with pytest.raises(InvalidRequest):
        decode_reply(_peer_error(**fields))


def test_errors_at_the_wire_bounds_round_trip_unchanged() -> None:
    details: dict[str, _errors.ErrorDetail] = {
        f"d{i}": "v" * _errors.MAX_ERROR_DETAIL_CHARS for i in range(2)
    }
    details.update({f"n{i}": i for i in range(_errors.MAX_ERROR_DETAILS - 2)})
    error = EngineCrashed("m" * _errors.MAX_ERROR_MESSAGE_CHARS, details=details)
    back = decode_error(encode_error(error))
    assert back.message == error.message
    assert back.details == error.details


def test_a_long_local_error_is_cut_to_the_wire_bounds() -> None:
    """This process's own error may be of any size; its wire form is cut to the bounds (saying
    so), so a peer can always decode it."""
    details: dict[str, _errors.ErrorDetail] = {"tail": "t" * 100_000, "k" * 1000: 1}
    details.update({f"n{i}": i for i in range(100)})
    error = InvalidRequest("m" * 100_000, details=details)
    info = error.to_info()
    assert len(info.message) == _errors.MAX_ERROR_MESSAGE_CHARS
    assert info.message.endswith("more characters cut]")
    assert len(info.details) == _errors.MAX_ERROR_DETAILS
    assert len(str(info.details["tail"])) == _errors.MAX_ERROR_DETAIL_CHARS
    assert all(len(name) <= _errors.MAX_ERROR_CODE_CHARS for name in info.details)
    back = decode_error(encode_error(error))
    assert isinstance(back, InvalidRequest)
    assert back.message == info.message
