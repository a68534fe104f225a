"""The payload checksum (xxh3-64): the corruption classes the replaced "gsum64-crc32" missed
are all detected, old-version bundles are refused as such, and the full 64-bit value travels.

The blind spots are generated against a reference copy of the old algorithm kept here, so each
test first proves that its corruptions are the ones the old checksum could not see (the cases
have teeth) and then that the contract's checksum sees every one of them."""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from shard_engine_api import (
    CONTRACT_VERSION,
    BoundaryBundle,
    ChecksumMismatch,
    ContractVersionMismatch,
    InvalidRequest,
    LogitsResult,
    SessionRef,
)
from shard_engine_api._checksum import CHECKSUM_ALGORITHM, CHECKSUM_MAX
from shard_engine_api._typecheck import check_fields
from shard_engine_api.wire import (
    Codec,
    chunks_checksum,
    decode_bundle,
    decode_reply,
    encode,
    encode_bundle,
    payload_checksum,
)

SESSION = SessionRef(session_id="s", epoch=1)
MIB = 1 << 20
GROUP_BYTES = 4096


def gsum64_crc32(payload: bytes | bytearray) -> int:
    """The contract-version-1 checksum, for reference only: 4 KiB groups summed as uint64
    words (wrapping), CRC-32 over the sums, the tail and the length."""
    view = memoryview(payload)
    grouped = len(view) - len(view) % GROUP_BYTES
    if len(view) < 64 * 1024:
        crc = zlib.crc32(view)
    else:
        words = np.frombuffer(view[:grouped], dtype="<u8").reshape(-1, GROUP_BYTES // 8)
        sums = words.sum(axis=1, dtype=np.uint64).astype("<u8")
        crc = zlib.crc32(sums.tobytes())
        crc = zlib.crc32(view[grouped:], crc)
    return zlib.crc32(len(view).to_bytes(8, "little"), crc)


def random_payload(size: int, seed: int) -> bytearray:
    return bytearray(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())


def plus_minus_in_one_group(payload: bytearray, trials: int, seed: int) -> Iterator[bytearray]:
    """Two words of one 4 KiB group changed by +d and -d (the group sum is unchanged). Each
    corruption is made in place, yielded, and undone before the next."""
    rng = np.random.default_rng(seed)
    words = np.frombuffer(payload, dtype="<u8")
    per_group = GROUP_BYTES // 8
    for _ in range(trials):
        group = int(rng.integers(0, words.size // per_group))
        first, second = (group * per_group + rng.choice(per_group, size=2, replace=False)).tolist()
        delta = np.uint64(int(rng.integers(1, 2**63)))
        saved = words[first], words[second]
        with np.errstate(over="ignore"):
            words[first] += delta
            words[second] -= delta
        yield payload
        words[first], words[second] = saved


def two_sign_flips(
    payload: bytearray, trials: int, seed: int, itemsize: int
) -> Iterator[bytearray]:
    """The sign bits of two values flipped, in place (undone after each yield). For 64-bit
    words in one group the group sum is unchanged (2 * 2**63 wraps to 0); for f32 and f16
    values anywhere in the payload."""
    rng = np.random.default_rng(seed)
    n_items = len(payload) // itemsize
    for _ in range(trials):
        if itemsize == 8:
            per_group = GROUP_BYTES // 8
            group = int(rng.integers(0, n_items // per_group))
            picks = group * per_group + rng.choice(per_group, size=2, replace=False)
        else:
            picks = rng.choice(n_items, size=2, replace=False)
        offsets = [int(item) * itemsize + itemsize - 1 for item in picks]
        for offset in offsets:
            payload[offset] ^= 0x80
        yield payload
        for offset in offsets:
            payload[offset] ^= 0x80


def test_the_algorithm_is_xxh3_64_of_the_bytes() -> None:
    import xxhash

    payload = random_payload(100_000, seed=1)
    assert CHECKSUM_ALGORITHM == "xxh3-64"
    assert payload_checksum(payload) == xxhash.xxh3_64_intdigest(bytes(payload))
    assert payload_checksum(memoryview(payload)) == payload_checksum(bytes(payload))
    assert payload_checksum(b"") == xxhash.xxh3_64_intdigest(b"")
    assert 0 <= payload_checksum(payload) <= CHECKSUM_MAX


@pytest.mark.parametrize("sizes", [(), (0,), (1,), (5, 0, 17), (4096, 4096, 3), (1, 1, 1, 1)])
def test_chunks_checksum_is_the_checksum_of_the_concatenation(sizes: tuple[int, ...]) -> None:
    rng = np.random.default_rng(len(sizes))
    chunks = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in sizes]
    assert chunks_checksum(chunks) == payload_checksum(b"".join(chunks))
    assert chunks_checksum(memoryview(chunk) for chunk in chunks) == chunks_checksum(chunks)


def test_plus_and_minus_d_in_one_group_are_detected() -> None:
    payload = random_payload(256 * 1024, seed=2)
    original = payload_checksum(payload)
    old = gsum64_crc32(payload)
    for case in plus_minus_in_one_group(payload, trials=1620, seed=3):
        assert gsum64_crc32(case) == old, "not a blind spot of the old checksum"
        assert payload_checksum(case) != original
    assert payload_checksum(payload) == original  # every corruption was undone


@pytest.mark.parametrize("itemsize", [8, 4, 2])
def test_two_sign_bit_flips_are_detected(itemsize: int) -> None:
    payload = random_payload(256 * 1024, seed=4)
    original = payload_checksum(payload)
    old = gsum64_crc32(payload)
    for case in two_sign_flips(payload, trials=1620, seed=5, itemsize=itemsize):
        if itemsize == 8:
            assert gsum64_crc32(case) == old, "not a blind spot of the old checksum"
        assert payload_checksum(case) != original
    assert payload_checksum(payload) == original


def test_random_two_bit_errors_are_detected() -> None:
    """20,000 trials of two random bit flips in a 1 MiB payload (the old checksum let about
    one in 30,000 through; a 64-bit hash is expected to miss none in 2**63)."""
    payload = random_payload(MIB, seed=6)
    original = payload_checksum(payload)
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 8 * MIB, size=(20_000, 2))
    missed = 0
    for first, second in bits.tolist():
        if first == second:
            continue
        for bit in (first, second):
            payload[bit >> 3] ^= 1 << (bit & 7)
        missed += payload_checksum(payload) == original
        for bit in (first, second):
            payload[bit >> 3] ^= 1 << (bit & 7)
    assert missed == 0
    assert payload_checksum(payload) == original  # every flip was undone


def test_truncation_and_extension_are_detected() -> None:
    payload = random_payload(MIB + 13, seed=8)
    original = payload_checksum(payload)
    rng = np.random.default_rng(9)
    cuts = {1, 2, 7, 8, 4096, len(payload) - 1, *rng.integers(1, len(payload), 300).tolist()}
    for cut in cuts:
        assert payload_checksum(payload[:-cut]) != original
        assert payload_checksum(payload[cut:]) != original
    for extra in (b"\x00", b"\x00" * 8, b"\x00" * 4096, bytes(payload[:5])):
        assert payload_checksum(payload + extra) != original
    # All-zero payloads of different lengths (nothing but the length tells them apart).
    zeros = {payload_checksum(bytes(size)) for size in range(0, 9000, 7)}
    assert len(zeros) == len(range(0, 9000, 7))


def _bundle(values: np.ndarray, dtype: str = "f16") -> BoundaryBundle:
    return BoundaryBundle.from_array(
        values,
        session=SESSION,
        first_pos=0,
        layer=1,
        model_fingerprint="fp",
        dtype=dtype,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_a_corrupted_payload_on_the_wire_is_checksum_mismatch(dtype: str) -> None:
    values = np.random.default_rng(10).standard_normal((64, 1024))
    message = bytearray(encode_bundle(_bundle(values, dtype)))
    payload = bytes(_bundle(values, dtype).payload)
    at = bytes(message).index(payload)
    cases = itertools.chain(
        plus_minus_in_one_group(bytearray(payload), trials=20, seed=11),
        two_sign_flips(bytearray(payload), trials=20, seed=12, itemsize=8),
    )
    for case in cases:
        message[at : at + len(payload)] = case
        with pytest.raises(ChecksumMismatch):
            decode_bundle(bytes(message), nonfinite="allow")


def test_a_version_1_bundle_is_refused_as_a_version_mismatch() -> None:
    """A bundle of contract version 1 carries a gsum64-crc32 checksum: refused as a version
    mismatch before its checksum is looked at (never reported as corruption, never accepted)."""
    bundle = _bundle(np.ones((4, 16)))
    old = msgspec.structs.replace(
        bundle, contract_version=1, checksum=gsum64_crc32(bytearray(bundle.payload))
    )
    assert CONTRACT_VERSION == 2
    with pytest.raises(ContractVersionMismatch) as caught:
        decode_bundle(encode_bundle(old))
    assert caught.value.details["contract_version"] == 1
    # Even when its old checksum happens to equal the new one's value, it is refused.
    same = msgspec.structs.replace(bundle, contract_version=1)
    with pytest.raises(ContractVersionMismatch):
        decode_bundle(encode_bundle(same))


def _high_checksum_payload() -> np.ndarray:
    """Values whose payload checksum needs all 64 bits (above INT64_MAX)."""
    for seed in range(100):
        values = np.random.default_rng(seed).standard_normal((2, 8)).astype(np.float32)
        if payload_checksum(values.tobytes()) > 2**63 - 1:
            return values
    raise AssertionError("no checksum above INT64_MAX in 100 tries")


def test_checksums_above_int64_max_travel_and_verify() -> None:
    values = _high_checksum_payload()
    bundle = _bundle(values, "f32")
    assert bundle.checksum > 2**63 - 1
    decoded = decode_bundle(encode_bundle(bundle))
    assert decoded.checksum == bundle.checksum
    logits = LogitsResult.from_array(
        values, request_id="r", session=SESSION, first_pos=0, evidence="fixture"
    )
    assert logits.checksum > 2**63 - 1
    reply = decode_reply(encode(logits))
    assert isinstance(reply, LogitsResult)
    assert reply.checksum == logits.checksum
    check_fields(msgspec.structs.replace(bundle, checksum=CHECKSUM_MAX))


@pytest.mark.parametrize("checksum", [-1, -(2**63), CHECKSUM_MAX + 1, 2**70])
def test_checksums_outside_uint64_are_refused(checksum: int) -> None:
    bundle = _bundle(np.ones((1, 4)), "f32")
    with pytest.raises(InvalidRequest, match="checksum"):
        check_fields(msgspec.structs.replace(bundle, checksum=checksum))
    if checksum < 0:
        # msgpack carries a negative int64: the decoder refuses it.
        mapping = msgspec.msgpack.decode(encode_bundle(bundle))
        mapping["checksum"] = checksum
        with pytest.raises(InvalidRequest, match="checksum"):
            decode_bundle(msgspec.msgpack.encode(mapping))
    else:
        # Beyond what msgpack can carry: refused when encoding.
        with pytest.raises(InvalidRequest):
            Codec.encode(msgspec.structs.replace(bundle, checksum=checksum))
