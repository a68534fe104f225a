"""Fuzzing the wire codec as a hostile peer would: mutations of valid messages of every type,
nesting-depth bombs and huge containers. Every outcome is either a typed ShardEngineError or a
complete message that passes the edge checks and round-trips; never another exception, never
unbounded memory.

Bounded to seconds by default; ``SHARD_ENGINE_FUZZ_EXAMPLES=N`` scales every loop (``nox -s
fuzz`` runs a deep pass).
"""

from __future__ import annotations

import os
import random
import tracemalloc
from collections.abc import Callable
from typing import Final

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard_engine_api import (
    CONTRACT_VERSION,
    BoundaryBundle,
    BoundaryResult,
    CancelRequest,
    CancelResult,
    Capabilities,
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    Determinism,
    ErrorInfo,
    ExportSessionRequest,
    Features,
    Health,
    ImportSessionRequest,
    ImportSessionResult,
    InvalidRequest,
    Limits,
    LoadConfig,
    LogitsResult,
    Metrics,
    PrefillRequest,
    ReleaseRequest,
    ReleaseResult,
    ResourceExhausted,
    SessionRef,
    SessionSnapshot,
    ShardEngineError,
    ShardSpec,
    Timings,
    TokenInput,
)
from shard_engine_api._codec import MAX_OPTIONS_BYTES, MAX_STRUCTURE_BYTES
from shard_engine_api._typecheck import check_request
from shard_engine_api.wire import (
    Codec,
    WireMessage,
    decode_bundle,
    decode_message,
    decode_reply,
    decode_request,
    encode,
    encode_error,
    payload_checksum,
)

EXAMPLES: Final = int(os.environ.get("SHARD_ENGINE_FUZZ_EXAMPLES", "0")) or None
"""The deep mode's example count (None: the bounded default run)."""
MUTATIONS_PER_MESSAGE: Final = EXAMPLES or 150
FUZZ = settings(
    derandomize=EXAMPLES is None,
    deadline=None,
    database=None,
    max_examples=EXAMPLES or 150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

SESSION = SessionRef(session_id="s", epoch=3)
SPEC = ShardSpec(model="m", n_layers=4, start=0, end=2)


def _bundle(rows: int = 2, dtype: str = "f32") -> BoundaryBundle:
    values = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) / 7
    return BoundaryBundle.from_array(
        values,
        session=SESSION,
        first_pos=1,
        layer=2,
        model_fingerprint="fp",
        dtype=dtype,  # type: ignore[arg-type]
    )


def _logits() -> LogitsResult:
    return LogitsResult.from_array(
        np.linspace(-1, 1, 10, dtype=np.float32).reshape(1, 10),
        request_id="r",
        session=SESSION,
        first_pos=2,
        evidence="fixture",
        timings=Timings(queue_ms=0.5, compute_ms=1.0, total_ms=1.5),
    )


def _capabilities() -> Capabilities:
    return Capabilities(
        engine="e",
        engine_version="1",
        contract_version=CONTRACT_VERSION,
        evidence="fixture",
        shard=SPEC,
        role="head",
        model_fingerprint="fp",
        hidden_size=4,
        vocab_size=10,
        boundary_dtypes=("f32", "f16"),
        limits=Limits(max_sessions=2, max_context=64, max_batch_tokens=8, kv_budget_tokens=128),
        features=Features(),
        determinism=Determinism(deterministic=True, split_exact=True),
        boundary_dtype="f32",
    )


def _snapshot() -> SessionSnapshot:
    # One chunk: a state shorter than SNAPSHOT_CHUNK_BYTES is never cut (only the last chunk
    # may be shorter than that).
    chunks = (bytes(range(256)) * 3 + b"tail",)
    return SessionSnapshot(
        engine="e",
        engine_version="1",
        shard=SPEC,
        model_fingerprint="fp",
        settings_fingerprint="sf",
        session=SESSION,
        length=5,
        boundary_dtype="f32",
        state_bytes=sum(map(len, chunks)),
        chunks=chunks,
        checksum=payload_checksum(b"".join(chunks)),
    )


def valid_messages() -> list[WireMessage]:
    """At least one valid message of every top-level wire type (and each input kind)."""
    tokens = TokenInput(token_ids=(1, 2, 3))
    bundle = _bundle()
    boundary_result = BoundaryResult(
        request_id="r", session=SESSION, first_pos=1, n_tokens=2, evidence="fixture", bundle=bundle
    )
    decode = DecodeRequest(
        request_id="d", session=SESSION, pos=4, inputs=TokenInput(token_ids=(9,))
    )
    return [
        LoadConfig(shard=SPEC, options={"seed": 3, "nested": {"a": [1, 2.5, None, "x"]}}),
        PrefillRequest(request_id="p", session=SESSION, start_pos=0, inputs=tokens, logits="all"),
        PrefillRequest(request_id="p", session=SESSION, start_pos=1, inputs=bundle),
        decode,
        DecodeRequest(request_id="d", session=SESSION, pos=1, inputs=_bundle(1, "f16")),
        DecodeBatchRequest(
            request_id="b", items=(decode, msgspec.structs.replace(decode, request_id="e"))
        ),
        CancelRequest(request_id="p"),
        CancelRequest(session_id="s"),
        ReleaseRequest(session=SESSION),
        _capabilities(),
        boundary_result,
        _logits(),
        DecodeBatchResult(
            request_id="b",
            items=(_logits(), ErrorInfo(code="cache_miss", message="m", retryable=True)),
        ),
        CancelResult(cancelled=True, n_requests=2),
        ReleaseResult(released=False, detail="unknown"),
        Health(state="ready", sessions=1),
        Metrics(requests=3, errors={"cache_miss": 1}),
        ErrorInfo(code="stale_epoch", message="old", retryable=False, details={"epoch": 2}),
        bundle,
        ExportSessionRequest(request_id="x", session=SESSION),
        _snapshot(),
        ImportSessionRequest(request_id="i", snapshot=_snapshot()),
        ImportSessionRequest(request_id="i", snapshot=_snapshot(), epoch=9),
        ImportSessionResult(request_id="i", session=SESSION, length=5, replaced=True, evicted=1),
    ]


MESSAGES: Final = valid_messages()
ENCODED: Final = [encode(message) for message in MESSAGES]
OUTCOMES: dict[str, int] = {}


def assert_typed_outcome(buf: bytes) -> None:
    """Every decoder either raises a ShardEngineError or returns a complete message that passes
    the edge check of its type and re-encodes to something that decodes to the same bytes."""
    for decoder in (decode_message, decode_request, decode_reply, decode_bundle):
        try:
            message = decoder(buf)
        except ShardEngineError as error:
            OUTCOMES[error.code] = OUTCOMES.get(error.code, 0) + 1
            continue
        OUTCOMES["decoded"] = OUTCOMES.get("decoded", 0) + 1
        check_request(message, type(message))
        # Compared as bytes: a decoded option may be NaN, which equals nothing.
        again = decode_message(encode(message))
        assert encode(again) == encode(message)


def test_every_message_type_is_covered() -> None:
    covered = {type(message) for message in MESSAGES}
    assert covered >= set(WireMessage.__args__)
    for buf in ENCODED:
        assert_typed_outcome(buf)


# ----------------------------------------------------------------------------- mutations

_INTERESTING: Final = [
    b"\xc0", b"\xc2", b"\xc3", b"\x00", b"\xff", b"\x7f", b"\x80", b"\x90", b"\xa0",
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",  # uint64 max
    b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",  # int64 min
    b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",  # float64 NaN
    b"\xdd\xff\xff\xff\xff",  # array32 claiming 4G items
    b"\xdf\xff\xff\xff\xff",  # map32 claiming 4G entries
    b"\xc6\xff\xff\xff\xff",  # bin32 claiming 4 GiB
    b"\xdb\xff\xff\xff\xff",  # str32 claiming 4 GiB
    b"\x91" * 2000 + b"\x00",  # nested arrays
    b"\x81\xa1k" * 2000 + b"\x00",  # nested maps
]  # fmt: skip


def mutate(buf: bytes, rng: random.Random) -> bytes:
    """One random structural mutation of ``buf``."""
    data = bytearray(buf)
    kind = rng.randrange(7)
    at = rng.randrange(len(data) + 1)
    if kind == 0 and data:  # flip a bit
        index = min(at, len(data) - 1)
        data[index] ^= 1 << rng.randrange(8)
    elif kind == 1:  # truncate
        del data[at:]
    elif kind == 2:  # insert an interesting token
        data[at:at] = rng.choice(_INTERESTING)
    elif kind == 3 and data:  # overwrite with an interesting token
        token = rng.choice(_INTERESTING)
        data[at : at + len(token)] = token
    elif kind == 4 and data:  # duplicate a range
        end = min(len(data), at + rng.randrange(1, 64))
        data[at:at] = data[at:end]
    elif kind == 5 and data:  # delete a range
        del data[at : at + rng.randrange(1, 16)]
    elif data:  # set a random byte
        data[min(at, len(data) - 1)] = rng.randrange(256)
    return bytes(data)


@pytest.mark.parametrize("index", range(len(MESSAGES)), ids=[type(m).__name__ for m in MESSAGES])
def test_random_mutations_end_typed(index: int) -> None:
    rng = random.Random(index)
    buf = ENCODED[index]
    for _ in range(MUTATIONS_PER_MESSAGE):
        mutated = buf
        for _ in range(rng.randrange(1, 4)):
            mutated = mutate(mutated, rng)
        assert_typed_outcome(mutated)


@FUZZ
@given(index=st.integers(0, len(MESSAGES) - 1), data=st.data())
def test_hypothesis_mutations_end_typed(index: int, data: st.DataObject) -> None:
    buf = bytearray(ENCODED[index])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(buf)))
        choice = data.draw(st.integers(0, 2))
        if choice == 0 and buf:
            buf[min(at, len(buf) - 1)] = data.draw(st.integers(0, 255))
        elif choice == 1:
            buf[at:at] = data.draw(st.sampled_from(_INTERESTING) | st.binary(max_size=12))
        else:
            del buf[at : at + data.draw(st.integers(1, 8))]
    assert_typed_outcome(bytes(buf))


@FUZZ
@given(st.binary(max_size=256))
def test_arbitrary_bytes_end_typed(buf: bytes) -> None:
    assert_typed_outcome(buf)


# ----------------------------------------------------------------------------- bombs


def _raw(message: WireMessage) -> dict[str, object]:
    decoded: dict[str, object] = msgspec.msgpack.decode(encode(message))
    return decoded


def _nested(depth: int, leaf: object = 0) -> object:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def _deep_bytes(depth: int, opener: bytes = b"\x91") -> bytes:
    return opener * depth + b"\x00"


@pytest.mark.parametrize("depth", [100, 2_000, 100_000])
@pytest.mark.parametrize("index", range(len(MESSAGES)), ids=[type(m).__name__ for m in MESSAGES])
def test_depth_bomb_in_an_unknown_field_is_invalid_request(index: int, depth: int) -> None:
    # The bomb rides in a field no decoder knows, which msgspec skips (recursively).
    mapping = _raw(MESSAGES[index])
    mapping["zz"] = msgspec.Raw(_deep_bytes(depth))
    bomb = msgspec.msgpack.encode(mapping)
    for decoder in (decode_message, decode_request, decode_reply, decode_bundle):
        try:
            decoder(bomb)
        except ShardEngineError:
            continue
        except RecursionError:  # pragma: no cover - the failure this test exists for
            pytest.fail("RecursionError escaped")


@pytest.mark.parametrize("opener", [b"\x91", b"\x81\xa1k", b"\xdc\x00\x01"])
def test_depth_bomb_as_a_whole_message_is_invalid_request(opener: bytes) -> None:
    for decoder in (decode_message, decode_request, decode_reply, decode_bundle):
        with pytest.raises(InvalidRequest):
            decoder(_deep_bytes(50_000, opener))


@pytest.mark.parametrize(
    "options",
    [
        {"deep": _nested(40)},  # deeper than MAX_OPTION_DEPTH
        msgspec.Raw(b"\x81\xa4deep" + _deep_bytes(5_000)),  # beyond the recursion limit
        {"many": [0] * 5_000},  # more values than MAX_OPTION_ITEMS
        {"wide": [[] for _ in range(4_000)], "more": [{} for _ in range(4_000)]},
    ],
    ids=["depth 40", "depth 5000", "5000 values", "8000 containers"],
)
def test_options_beyond_their_bounds_are_refused(options: object) -> None:
    mapping = _raw(LoadConfig(shard=SPEC))
    mapping["options"] = options
    # (Nested past the recursion limit, the skip over the raw options is what refuses it.)
    with pytest.raises(InvalidRequest, match=r"LoadConfig\.options|nested too deeply"):
        decode_request(msgspec.msgpack.encode(mapping))


def test_a_mebibyte_of_options_never_becomes_many_objects() -> None:
    # 1 MiB of empty maps once decoded into ~69 MiB of dicts. A whole message above
    # MAX_STRUCTURE_BYTES is refused from its size; below it, the options' own byte limit.
    mapping = _raw(LoadConfig(shard=SPEC))
    mapping["options"] = {"x": [{}] * (MAX_STRUCTURE_BYTES - 1024)}
    buf = msgspec.msgpack.encode(mapping)
    assert MAX_OPTIONS_BYTES < len(buf) <= MAX_STRUCTURE_BYTES
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequest, match="exceed the limit"):
            decode_request(buf)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(buf)
    # Just under the byte limit the count bound refuses it, still with little memory.
    mapping["options"] = {"x": [{}] * (MAX_OPTIONS_BYTES - 64)}
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequest, match="more than"):
            decode_request(msgspec.msgpack.encode(mapping))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024


def test_huge_token_list_is_refused_by_its_length() -> None:
    prefill = _raw(MESSAGES[1])
    inputs = prefill["inputs"]
    assert isinstance(inputs, dict)
    inputs["token_ids"] = [1] * ((1 << 20) + 1)
    with pytest.raises(InvalidRequest, match="length <="):
        decode_request(msgspec.msgpack.encode(prefill))


def test_huge_batch_is_refused_by_its_length() -> None:
    batch = _raw(MESSAGES[5])
    items = batch["items"]
    assert isinstance(items, list)
    batch["items"] = items[:1] * ((1 << 16) + 1)
    with pytest.raises(InvalidRequest, match="length <="):
        decode_request(msgspec.msgpack.encode(batch))


@pytest.mark.parametrize("decoder", [decode_message, decode_request, decode_reply, decode_bundle])
def test_a_refused_batch_is_not_rebuilt_while_its_error_is_worded(
    decoder: Callable[[bytes], object],
) -> None:
    """A batch of a million empty maps is refused from its length header, and the look for a
    foreign contract version (on every refused message) stops there too: it used to build one
    object per byte (a 10 MB message took 889 MB)."""
    batch = _raw(MESSAGES[5])
    head = msgspec.msgpack.encode({key: value for key, value in batch.items() if key != "items"})
    count = 1 << 20
    bomb = (
        bytes((head[0] + 1,))
        + head[1:]
        + msgspec.msgpack.encode("items")
        + b"\xdd"
        + count.to_bytes(4, "big")
        + b"\x80" * count
    )
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequest):
            decoder(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


@pytest.mark.parametrize("header", [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff"])
def test_length_header_claiming_billions_costs_nothing(header: bytes) -> None:
    # A short message whose container header promises 4G items is refused without building
    # (or allocating room for) any of them.
    prefill = _raw(MESSAGES[1])
    inputs = prefill["inputs"]
    assert isinstance(inputs, dict)
    inputs["token_ids"] = [7]
    buf = msgspec.msgpack.encode(prefill)
    marker = msgspec.msgpack.encode("token_ids") + b"\x91\x07"
    assert marker in buf
    bomb = buf.replace(marker, msgspec.msgpack.encode("token_ids") + header + b"\x07")
    tracemalloc.start()
    try:
        assert_typed_outcome(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def _bulky(tag: str) -> bytes:
    """A message of ``tag`` carrying ~2 MiB of structure (short distinct map keys)."""
    fields: dict[str, object] = {"type": tag}
    entries = {format(index, "x"): 1 for index in range(300_000)}
    fields["errors" if tag == "metrics" else "details"] = entries
    if tag == "error":
        fields.update(code="cache_miss", message="m", retryable=True)
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize("tag", ["metrics", "error"])
def test_a_bulky_message_without_a_payload_is_refused_before_it_is_built(tag: str) -> None:
    """Metrics or an error of 2 MiB is ResourceExhausted from its size and tag: decoded, its
    map would have been ~15 times that in Python objects."""
    buf = _bulky(tag)
    assert len(buf) > MAX_STRUCTURE_BYTES
    for decoder in (decode_message, decode_reply):
        tracemalloc.start()
        try:
            with pytest.raises(ResourceExhausted) as caught:
                decoder(buf)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert caught.value.details["limit"] == MAX_STRUCTURE_BYTES
        assert peak < 1 << 20


def test_a_large_message_with_a_payload_still_decodes() -> None:
    """The structure limit is for payload-less types only: a 2 MiB bundle decodes."""
    large = BoundaryBundle.from_array(
        np.ones((512, 1024), dtype=np.float32),
        session=SESSION,
        first_pos=0,
        layer=2,
        model_fingerprint="fp",
    )
    buf = encode(large)
    assert len(buf) > MAX_STRUCTURE_BYTES
    decoded = decode_message(buf)
    assert isinstance(decoded, BoundaryBundle)
    assert bytes(decoded.payload) == bytes(large.payload)


def test_message_above_the_size_limit_is_refused_before_decoding() -> None:
    codec = Codec(max_payload_bytes=1024)
    buf = encode(_bundle(1)) + bytes(codec.max_message_bytes)
    with pytest.raises(ResourceExhausted) as caught:
        codec.decode_message(buf)
    assert caught.value.details["resource"] == "message_bytes"


# ----------------------------------------------------------------------------- encoding


@pytest.mark.parametrize(
    "details",
    [{"big": 2**64}, {"small": -(2**63) - 1}, {"object": object()}, {"list": [1, 2]}],
    ids=["2**64", "below int64", "object", "list"],
)
def test_encode_error_never_raises(details: dict[str, object]) -> None:
    error = InvalidRequest("bad", details=details)  # type: ignore[arg-type]
    info = msgspec.msgpack.decode(encode_error(error), type=ErrorInfo)
    assert info.code == "invalid_request"
    assert set(info.details) == set(details)


def test_outcome_counts_are_recorded() -> None:
    # A summary for the deep run's log: how many mutated messages ended how.
    print(f"fuzz outcomes: {dict(sorted(OUTCOMES.items()))}")
    assert OUTCOMES
