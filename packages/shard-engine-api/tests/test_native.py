"""The optional C extension (shard_engine_api._native) against its fallback: the same xxh3-64
digests as the xxhash package on payloads of many sizes and alignments (one-shot and the
block-by-block streaming pass), the same finiteness answers as the numpy bit tests (every
16-bit pattern, f32 edge patterns, at every position a vector loop or a block boundary can
split), the same verification status (a corrupted payload is a checksum mismatch even when it
also holds a NaN), and the same typed errors from the codec with the extension disabled."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

from shard_engine_api import BoundaryDtype
from shard_engine_api._bundle_checks import (
    CHECKSUM_MISMATCH,
    NONFINITE,
    SOUND,
    python_verify_payload,
    verify_payload,
)
from shard_engine_api._checksum import NATIVE, NATIVE_ENV, NATIVE_MODULE, payload_checksum
from shard_engine_api._dtypes import (
    FINITE_KINDS,
    ITEMSIZE,
    checksum_and_finite,
    copy_checksum_and_finite,
    python_checksum_and_finite,
    python_copy_checksum_and_finite,
    python_payload_finite,
)

native = pytest.mark.skipif(NATIVE_MODULE is None, reason="the C extension is not in use")

BLOCK = 16 * 1024  # _native.c's BLOCK_BYTES
SIZES = sorted(
    {
        *range(0, 260),
        *(n + d for n in (512, 1024, 4096, BLOCK, 2 * BLOCK, 1 << 20) for d in (-3, 0, 5)),
    }
)
ALIGNED_SIZES = [0, 2, 4, 64, 126, 128, 130, 256, 8192, BLOCK - 4, BLOCK, BLOCK + 4, 3 * BLOCK + 8]


@pytest.fixture(autouse=True, params=["avx2", "sse2", "portable"])
def scan_loops(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """Every test runs with each set of the extension's loops this CPU has (the AVX2 one-pass
    hash-and-test, the SSE2 and the portable block loops), so a machine without AVX2 runs no
    untested code; without the extension, once."""
    if NATIVE_MODULE is None:
        if request.param != "portable":
            pytest.skip("the C extension is not in use")
        yield None
        return
    try:
        previous = NATIVE_MODULE._select_scan(request.param)
    except ValueError:
        pytest.skip(f"no {request.param} loops on this CPU")
    try:
        yield request.param
    finally:
        NATIVE_MODULE._select_scan(previous)


def random_bytes(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_the_extension_is_built() -> None:
    """The project's install builds the optional extension (nox and CI install from the tree
    with a C compiler); without it every received bundle pays numpy's per-call costs."""
    if os.environ.get(NATIVE_ENV) == "0":
        pytest.skip(f"{NATIVE_ENV}=0 selects the fallback")
    assert NATIVE, (
        "shard_engine_api._native was not built: reinstall the api package with a C compiler"
    )


@native
def test_checksums_equal_the_xxhash_package_at_every_size_and_alignment() -> None:
    """checksum(), and verify() and checksum_and_finite() for every finiteness kind (each a
    different one-pass loop: blocks, or the AVX2 stripes that hash and test together)."""
    assert NATIVE_MODULE is not None
    # Finite in every dtype: every byte 0x3c (f16 1.0-ish, bf16/f32 ~0.01).
    buffer = b"\x3c" * (max(SIZES) + 16)
    noise = random_bytes(max(SIZES) + 16, 1)
    for size in SIZES:
        for offset in (0, 1, 3, 7, 8):
            view = memoryview(noise)[offset : offset + size]
            want = xxhash.xxh3_64_intdigest(view)
            assert NATIVE_MODULE.checksum(view) == want, (size, offset)
            assert NATIVE_MODULE.verify(view, want, 0) == SOUND, (size, offset)
            assert NATIVE_MODULE.verify(view, want ^ 1, 0) == CHECKSUM_MISMATCH, (size, offset)
            finite = memoryview(buffer)[offset : offset + size]
            want = xxhash.xxh3_64_intdigest(finite)
            for kind, itemsize in ((1, 2), (2, 2), (3, 4)):
                if size % itemsize:
                    continue
                assert NATIVE_MODULE.verify(finite, want, kind) == SOUND, (size, offset, kind)
                assert NATIVE_MODULE.verify(finite, want ^ 1, kind) == CHECKSUM_MISMATCH
                assert NATIVE_MODULE.checksum_and_finite(finite, kind) == (want, True)


@native
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_a_nonfinite_value_is_found_at_every_position(dtype: BoundaryDtype) -> None:
    """In payloads just past the one-shot sizes (every position is in some stripe: full
    blocks, the partial block, the overlapping last stripe) and at a block boundary."""
    assert NATIVE_MODULE is not None
    kind = FINITE_KINDS[dtype]
    itemsize = ITEMSIZE[dtype]
    storage = "<u4" if dtype == "f32" else "<u2"
    bad = nonfinite_patterns(dtype)
    for size in (244, 256, 300, 1024, 1028, 1088, 2100):
        values = np.full(size // itemsize, 0x3C003C00 if dtype == "f32" else 0x3C00, dtype=storage)
        for at in range(values.size):
            values[at] = bad[at % len(bad)]
            digest, finite = NATIVE_MODULE.checksum_and_finite(values, kind)
            assert digest == xxhash.xxh3_64_intdigest(values.data), (size, at)
            assert not finite, (size, at)
            assert NATIVE_MODULE.verify(values.data, digest, kind) == NONFINITE, (size, at)
            values[at] = values[at - 1] if at else values[1]


@native
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_verify_hashes_every_block_whatever_the_finiteness_kind(dtype: BoundaryDtype) -> None:
    assert NATIVE_MODULE is not None
    kind = FINITE_KINDS[dtype]
    finite = np.full(3 * BLOCK + 64, 0x3C00 if dtype == "f16" else 0x3F80, dtype="<u2")
    for size in ALIGNED_SIZES:
        if size % ITEMSIZE[dtype]:
            continue
        payload = finite[: size // 2].tobytes()
        digest = xxhash.xxh3_64_intdigest(payload)
        assert NATIVE_MODULE.verify(payload, digest, kind) == SOUND, size
        assert NATIVE_MODULE.verify(payload, digest + 1, kind) == CHECKSUM_MISMATCH, size


def nonfinite_patterns(dtype: BoundaryDtype) -> list[int]:
    if dtype == "f32":
        return [0x7F800000, 0xFF800000, 0x7F800001, 0x7FC00000, 0xFFFFFFFF, 0xFFC00000, 0x7FFFFFFF]
    exponent = 0x7C00 if dtype == "f16" else 0x7F80
    every = np.arange(1 << 16, dtype=np.uint32)
    return [int(bits) for bits in every[(every & exponent) == exponent]]


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_finiteness_agrees_with_numpy_at_every_position_a_loop_can_split(
    dtype: BoundaryDtype,
) -> None:
    """A non-finite value at each position around vector-loop widths (16, 32, 64, 128 bytes)
    and block boundaries, in payloads that start at every alignment, is found by the bound
    implementation and by verify_payload exactly as numpy finds it."""
    kind = FINITE_KINDS[dtype]
    itemsize = ITEMSIZE[dtype]
    storage = "<u4" if dtype == "f32" else "<u2"
    one = 0x3F800000 if dtype == "f32" else 0x3C00 if dtype == "f16" else 0x3F80
    n_items = (2 * BLOCK + 200) // itemsize
    byte_positions = {0, 2, 14, 16, 30, 32, 62, 64, 126, 128, 130, BLOCK - 4, BLOCK, 2 * BLOCK}
    positions = sorted({p // itemsize for p in byte_positions} | {n_items - 1, n_items - 2})
    patterns = nonfinite_patterns(dtype)
    rng = np.random.default_rng(2)
    for offset in (0, 1, 2, 3):
        raw = bytearray(n_items * itemsize + offset)
        values = np.frombuffer(memoryview(raw)[offset:], dtype=storage)
        values[:] = one
        view = memoryview(raw)[offset:]
        checksum = xxhash.xxh3_64_intdigest(view)
        assert python_payload_finite(view, dtype)
        assert verify_payload(view, checksum, kind) == SOUND
        for at in positions:
            values[at] = patterns[int(rng.integers(len(patterns)))]
            checksum = xxhash.xxh3_64_intdigest(view)
            assert not python_payload_finite(view, dtype), (offset, at)
            assert verify_payload(view, checksum, kind) == NONFINITE, (offset, at)
            assert verify_payload(view, checksum ^ 1, kind) == CHECKSUM_MISMATCH, (offset, at)
            assert python_verify_payload(view, checksum, kind) == NONFINITE
            values[at] = one


@native
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_every_16_bit_pattern_alone_agrees_with_numpy(dtype: BoundaryDtype) -> None:
    assert NATIVE_MODULE is not None
    kind = FINITE_KINDS[dtype]
    for bits in range(1 << 16):
        payload = bits.to_bytes(2, "little")
        assert NATIVE_MODULE.finite(payload, kind) is python_payload_finite(payload, dtype), bits


@native
def test_random_f32_bits_agree_with_numpy() -> None:
    """Random words, with the low half of each f32 free to hold any pattern (the low lane's
    test never matches) and some exponents forced to all ones."""
    assert NATIVE_MODULE is not None
    rng = np.random.default_rng(3)
    for trial in range(300):
        size = int(rng.integers(1, 3000))
        words = rng.integers(0, 2**32, size, dtype=np.uint64).astype("<u4")
        words &= ~np.uint32(0x7F800000)  # all finite...
        if trial % 2:
            at = int(rng.integers(size))
            words[at] |= np.uint32(0x7F800000)  # ...but one
        assert NATIVE_MODULE.finite(words, 3) is python_payload_finite(words, "f32"), trial
    # The largest finite exponent above every low-half pattern: all finite.
    every_low_half = np.arange(1 << 16, dtype="<u4") | np.uint32(0x7F7F0000)
    assert NATIVE_MODULE.finite(every_low_half, 3)


@pytest.mark.parametrize("checksum", [-1, 2**64, 2**64 + 5, True, 1.0, "x"])
def test_any_checksum_value_is_compared_as_python_compares_it(checksum: object) -> None:
    payload = b"\x01\x00"
    for verify in (verify_payload, python_verify_payload):
        assert verify(payload, checksum, 1) == CHECKSUM_MISMATCH  # type: ignore[arg-type]


class WideChecksum(int):
    """An int subclass: compared as Python compares it, not converted."""


def test_an_int_subclass_checksum_is_compared_by_value() -> None:
    payload = b"\x01\x00"
    digest = WideChecksum(xxhash.xxh3_64_intdigest(payload))
    for verify in (verify_payload, python_verify_payload):
        assert verify(payload, digest, 1) == SOUND
        assert verify(payload, WideChecksum(digest + 1), 1) == CHECKSUM_MISMATCH


def test_a_partial_value_is_a_value_error_in_both() -> None:
    for verify in (verify_payload, python_verify_payload):
        with pytest.raises(ValueError, match="multiple of element size"):
            verify(b"\x00\x00\x00", xxhash.xxh3_64_intdigest(b"\x00\x00\x00"), 1)
        with pytest.raises(ValueError, match="multiple of element size"):
            verify(b"\x00\x00", xxhash.xxh3_64_intdigest(b"\x00\x00"), 3)


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_checksum_and_finite_agrees_with_its_fallback(dtype: BoundaryDtype) -> None:
    rng = np.random.default_rng(4)
    storage = "<u4" if dtype == "f32" else "<u2"
    bad = nonfinite_patterns(dtype)
    for size in (1, 7, 64, 4096, BLOCK, 3 * BLOCK + 5, 300_000):
        values = np.full(size, 0x3F800000 if dtype == "f32" else 0x3F80, dtype=storage)
        for poisoned in (False, True):
            if poisoned:
                values[int(rng.integers(size))] = bad[int(rng.integers(len(bad)))]
            want = (xxhash.xxh3_64_intdigest(values.data), not poisoned)
            assert checksum_and_finite(values, dtype) == want, (size, poisoned)
            assert python_checksum_and_finite(values, dtype) == want, (size, poisoned)
            payload = memoryview(values.tobytes())
            assert checksum_and_finite(payload, dtype) == want, (size, poisoned)


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_copy_checksum_and_finite_copies_and_agrees_with_checksum_and_finite(
    dtype: BoundaryDtype,
) -> None:
    """copy_checksum_and_finite (native and fallback) leaves an exact copy and returns what
    checksum_and_finite says of it, at every size class (one-shot, stripes, blocks, the last
    overlapping stripe), at odd alignments of both ends, poisoned or not."""
    itemsize = ITEMSIZE[dtype]
    bad = nonfinite_patterns(dtype)
    storage = "<u4" if dtype == "f32" else "<u2"
    rng = np.random.default_rng(9)
    for size in (0, 1, 3, 60, 61, 64, 120, 121, 4096, BLOCK + 1, 3 * BLOCK + 5, 262_144):
        values = np.full(size, 0x3F800000 if dtype == "f32" else 0x3F80, dtype=storage)
        values[::3] = rng.integers(0, 0x3F00, values[::3].size, dtype=storage)
        for poisoned in (False, True):
            if poisoned and size:
                values[int(rng.integers(size))] = bad[int(rng.integers(len(bad)))]
            source = values.tobytes()
            want = checksum_and_finite(source, dtype)
            assert want == python_checksum_and_finite(source, dtype)
            for copy in (copy_checksum_and_finite, python_copy_checksum_and_finite):
                for offset in (0, 1, 6):
                    space = bytearray(len(source) + offset + 3)
                    destination = memoryview(space)[offset : offset + len(source)]
                    shifted = memoryview(b"\xff" * offset + source)[offset:]
                    assert copy(destination, shifted, dtype) == want, (size, poisoned, offset)
                    assert bytes(destination) == source, (size, offset)
                    assert not any(space[:offset])
                    assert not any(space[offset + len(source) :])
    assert itemsize


@pytest.mark.parametrize("copy", [copy_checksum_and_finite, python_copy_checksum_and_finite])
def test_copy_checksum_and_finite_refuses_what_it_cannot_copy(copy: object) -> None:
    """A destination of another length, a read-only destination (BufferError natively, as
    the buffer protocol says; TypeError from memoryview), a partial value: errors, and nothing
    is written."""
    assert callable(copy)
    destination = bytearray(8)
    with pytest.raises(ValueError, match="destination has 8 bytes"):
        copy(destination, b"\x01" * 12, "f32")
    with pytest.raises(ValueError, match="multiple of element size"):
        copy(bytearray(6), b"\x01" * 6, "f32")
    with pytest.raises((TypeError, BufferError)):
        copy(b"\x00" * 8, b"\x01" * 8, "f32")
    assert destination == bytearray(8)


@native
def test_copy_checksum_and_finite_refuses_overlapping_regions() -> None:
    assert NATIVE_MODULE is not None
    space = bytearray(range(64)) * 4
    view = memoryview(space)
    with pytest.raises(ValueError, match="overlap"):
        NATIVE_MODULE.copy_checksum_and_finite(view[8:72], view[0:64], 3)
    assert space == bytearray(range(64)) * 4


def test_the_bound_checksum_is_xxh3_64() -> None:
    for size in (0, 1, 100, 5000, 70_000):
        payload = random_bytes(size, size)
        assert payload_checksum(payload) == xxhash.xxh3_64_intdigest(payload)


FALLBACK_SCRIPT = textwrap.dedent(
    """
    import msgspec, numpy as np
    from shard_engine_api import BoundaryBundle, SessionRef, ChecksumMismatch, InvalidRequest
    from shard_engine_api._checksum import NATIVE
    from shard_engine_api.wire import decode_bundle, encode_bundle, payload_checksum

    assert not NATIVE
    session = SessionRef(session_id="s", epoch=1)
    for dtype in ("f16", "bf16", "f32"):
        for rows in (1, 40):
            values = np.ones((rows, 1024), dtype=np.float32)
            bundle = BoundaryBundle.from_array(
                values, session=session, first_pos=0, layer=1, model_fingerprint="m", dtype=dtype
            )
            assert decode_bundle(encode_bundle(bundle)).checksum == bundle.checksum
            raw = bytearray(bytes(bundle.payload))
            raw[-1] = 0xFF  # the top byte of the last value: NaN in every dtype
            raw[-2] = 0xFF
            nan = msgspec.structs.replace(
                bundle, payload=memoryview(bytes(raw)), checksum=payload_checksum(raw)
            )
            try:
                decode_bundle(encode_bundle(nan))
            except InvalidRequest as error:
                assert type(error) is InvalidRequest and "NaN" in error.message, error
            else:
                raise AssertionError("NaN accepted")
            corrupt = msgspec.structs.replace(nan, checksum=bundle.checksum)
            try:
                decode_bundle(encode_bundle(corrupt))
            except ChecksumMismatch:
                pass
            else:
                raise AssertionError("corruption accepted")
    print("fallback ok")
    """
)


def test_the_fallback_gives_the_same_typed_errors() -> None:
    """With the extension disabled (as on a machine without a C compiler) the codec accepts
    sound bundles and refuses NaN (InvalidRequest) and corrupted ones (ChecksumMismatch, even
    when the corrupted payload also holds a NaN)."""
    completed = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT],
        env={**os.environ, NATIVE_ENV: "0"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert "fallback ok" in completed.stdout
