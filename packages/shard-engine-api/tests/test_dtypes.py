"""Boundary dtypes: bf16 conversions (exhaustively, against an independent float64 rounding),
the bit-level finiteness test over every 16-bit pattern, the overflow thresholds, and bf16
bundles end to end (zero-copy through the codec, converted for compute, refused when their
conversion would overflow)."""

from __future__ import annotations

import typing

import numpy as np
import numpy.typing as npt
import pytest
from test_core import HistoryEngine

from shard_engine_api import (
    BoundaryBundle,
    BoundaryDtype,
    LoadConfig,
    PrefillRequest,
    ResourceExhausted,
    SessionRef,
    ShardSpec,
    TokenInput,
)
from shard_engine_api._dtypes import (
    BOUNDARY_DTYPES,
    ITEMSIZE,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
    overflow_threshold,
    payload_finite,
    payload_rows,
    python_payload_finite,
)
from shard_engine_api._results import check_range
from shard_engine_api.engine import CancelToken, ForwardItem, ModelInfo, OutputMode
from shard_engine_api.wire import decode_bundle, encode_bundle

SESSION = SessionRef(session_id="s", epoch=1)
# The bound implementation (the C extension's where it is built) and the numpy fallback.
FINITE_TESTS = pytest.mark.parametrize(
    "payload_finite",
    [payload_finite, python_payload_finite],
    ids=["bound", "python"],
)
ALL_16 = np.arange(1 << 16, dtype=np.uint16)


def _is_nan_bits16(bits: npt.NDArray[np.uint16], exponent: int) -> npt.NDArray[np.bool_]:
    mantissa = ~exponent & 0x7FFF
    nan: npt.NDArray[np.bool_] = ((bits & exponent) == exponent) & ((bits & mantissa) != 0)
    return nan


def _nearest_bf16(value: float) -> float:
    """Round-to-nearest-even to 8 significant bits and bf16's exponent range, in float64
    arithmetic (exact for every f32 input): the reference the bit operations must match."""
    if value == 0.0 or not np.isfinite(value):
        return value
    exponent = max(int(np.floor(np.log2(abs(value)))), -126)
    step = 2.0 ** (exponent - 7)
    quotient = value / step
    low = np.floor(quotient)
    if quotient - low > 0.5 or (quotient - low == 0.5 and low % 2 == 1):
        low += 1
    rounded = float(low * step)
    largest = float(np.array([0x7F7F0000], dtype="<u4").view("<f4")[0])
    return float(np.copysign(np.inf, value)) if abs(rounded) > largest else rounded


def test_the_contract_dtypes_are_the_literal() -> None:
    assert frozenset(typing.get_args(BoundaryDtype)) == BOUNDARY_DTYPES
    assert set(ITEMSIZE) == BOUNDARY_DTYPES
    assert ITEMSIZE == {"f32": 4, "f16": 2, "bf16": 2}


def test_every_bf16_value_widens_exactly_and_narrows_back() -> None:
    widened = bf16_bits_to_f32(ALL_16)
    assert widened.dtype == np.float32
    # Exact: the bits are the top half of the f32.
    assert np.array_equal(widened.view(np.uint32) >> 16, ALL_16.astype(np.uint32))
    assert not (widened.view(np.uint32) & 0xFFFF).any()
    nan = _is_nan_bits16(ALL_16, 0x7F80)
    narrowed = f32_to_bf16_bits(widened)
    assert np.array_equal(narrowed[~nan], ALL_16[~nan])
    # A NaN stays a NaN of the same sign (quieted), never an infinity.
    assert _is_nan_bits16(narrowed[nan], 0x7F80).all()
    assert np.array_equal(narrowed[nan] >> 15, ALL_16[nan] >> 15)


def test_rounding_is_to_nearest_even_at_every_tie() -> None:
    """For each finite bf16 value b: the f32 halfway to the next value rounds to the even one
    of the two, one f32 ulp below it rounds down, one above rounds up."""
    finite = ALL_16[(ALL_16 & 0x7F80) != 0x7F80].astype(np.uint32)
    finite = finite[(finite & 0x7FFF) != 0x7F7F]  # the largest: its upper neighbour is inf
    halfway = (finite << 16) | 0x8000
    for offset, expected in (
        (0, np.where(finite & 1, finite + 1, finite)),
        (-1, finite),
        (1, finite + 1),
    ):
        values = (halfway.astype(np.int64) + offset).astype(np.uint32).view(np.float32)
        assert np.array_equal(f32_to_bf16_bits(values), expected.astype(np.uint16)), offset


def test_rounding_matches_an_independent_float64_reference() -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    values = values[np.isfinite(values)]
    got = bf16_bits_to_f32(f32_to_bf16_bits(values))
    want = np.array([_nearest_bf16(float(value)) for value in values], dtype=np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_conversion_keeps_shape_and_takes_other_numeric_dtypes() -> None:
    values = np.arange(12, dtype=np.float64).reshape(3, 4) - 5.5
    bits = f32_to_bf16_bits(values)  # type: ignore[arg-type]
    assert bits.shape == (3, 4)
    assert np.array_equal(bf16_bits_to_f32(bits), values.astype(np.float32))
    assert f32_to_bf16_bits(np.zeros((0,), dtype=np.float32)).size == 0


@FINITE_TESTS
@pytest.mark.parametrize(("dtype", "exponent"), [("f16", 0x7C00), ("bf16", 0x7F80)])
def test_finiteness_of_every_16_bit_pattern(
    dtype: BoundaryDtype, exponent: int, payload_finite: typing.Callable[..., bool]
) -> None:
    """Every finite pattern together passes; every non-finite pattern (each infinity and NaN
    of either sign) fails on its own among finite values, at the start, middle and end."""
    finite = (ALL_16 & exponent) != exponent
    assert payload_finite(ALL_16[finite].tobytes(), dtype)
    assert payload_finite(ALL_16[finite][::-1].tobytes(), dtype)
    background = ALL_16[finite][:: 1 << 7]
    for bits in ALL_16[~finite].tolist():
        for at in (0, background.size // 2, background.size - 1):
            payload = background.copy()
            payload[at] = bits
            assert not payload_finite(payload.tobytes(), dtype), (hex(bits), at)


@FINITE_TESTS
@pytest.mark.parametrize("size", [33, 20_000])  # a decode row's path and the large one
def test_finiteness_of_f32_edge_patterns(
    size: int, payload_finite: typing.Callable[..., bool]
) -> None:
    patterns = {
        0x00000000: True,
        0x80000000: True,
        0x7F7FFFFF: True,
        0xFF7FFFFF: True,
        0x00000001: True,
        0x7F800000: False,
        0xFF800000: False,
        0x7F800001: False,
        0x7FC00000: False,
        0xFFFFFFFF: False,
        0xFFC00000: False,
    }
    for bits, ok in patterns.items():
        for at in (0, size // 2, size - 1):
            payload = np.full(size, 0x3F800000, dtype=np.uint32)
            payload[at] = bits
            assert payload_finite(payload.tobytes(), "f32") is ok, (hex(bits), at)
        payload = np.full(size, 0xBF800000, dtype=np.uint32)
        payload[17] = bits
        assert payload_finite(payload.tobytes(), "f32") is ok, hex(bits)
    assert payload_finite(b"", "f32")


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_overflow_thresholds(dtype: BoundaryDtype) -> None:
    limit = np.float32(overflow_threshold(dtype))
    below = np.nextafter(limit, np.float32(0))
    if dtype == "f16":
        with np.errstate(over="ignore"):
            assert np.isinf(np.float16(limit))
        assert np.isfinite(np.float16(below))
    else:
        assert np.isinf(bf16_bits_to_f32(f32_to_bf16_bits(np.array([limit])))).all()
        assert np.isfinite(bf16_bits_to_f32(f32_to_bf16_bits(np.array([below])))).all()
    check_range(np.array([[below, -below]], dtype=np.float32), dtype)
    for bad in (limit, -limit):
        with pytest.raises(ResourceExhausted) as refused:
            check_range(np.array([[1.0, bad]], dtype=np.float32), dtype)
        assert refused.value.details["dtype"] == dtype
        assert dtype in refused.value.message
        assert not refused.value.retryable
    # NaN and infinities already present are not an overflow of the conversion.
    check_range(np.array([[np.nan, np.inf, -np.inf, 1.0]], dtype=np.float32), dtype)
    with pytest.raises(ResourceExhausted):
        check_range(np.array([[np.nan, limit]], dtype=np.float32), dtype)


def test_a_bf16_bundle_is_zero_copy_on_the_wire_and_exact_for_compute() -> None:
    values = np.random.default_rng(1).standard_normal((16, 128)).astype(np.float32) * 1e5
    bundle = BoundaryBundle.from_array(
        values, session=SESSION, first_pos=0, layer=1, model_fingerprint="fp", dtype="bf16"
    )
    assert bundle.dtype == "bf16"
    assert len(bundle.payload) == values.size * 2 == bundle.expected_payload_bytes
    expected = bf16_bits_to_f32(f32_to_bf16_bits(values))
    assert np.array_equal(bundle.array(), expected)
    message = encode_bundle(bundle)
    decoded = decode_bundle(message)
    assert decoded.payload.obj is message  # a view into the message: no copy on decode
    assert np.array_equal(
        payload_rows(decoded.payload, "bf16", 16, 128).view(np.uint32),
        expected.view(np.uint32),
    )
    # Far beyond f16's range, well inside bf16's.
    assert float(np.abs(decoded.array()).max()) > 65504


class _Scaled(HistoryEngine):
    """Hidden states multiplied by ``scale`` (to push them past a dtype's range)."""

    scale = np.float32(1.0)

    def _open(self, config: LoadConfig) -> ModelInfo:
        info = super()._open(config)
        return ModelInfo(
            **{
                **{name: getattr(info, name) for name in info.__struct_fields__},
                "boundary_dtypes": ("f32", "f16", "bf16"),
            }
        )

    def _forward(
        self, item: ForwardItem, output: OutputMode, token: CancelToken
    ) -> npt.NDArray[np.float32]:
        return super()._forward(item, output, token) * self.scale


@pytest.mark.parametrize(
    ("dtype", "scale", "refused"),
    [
        ("f16", 1e5, True),
        ("bf16", 1e5, False),
        ("bf16", 3.4e38, True),
        ("f32", 3.4e38, False),
    ],
)
def test_the_core_refuses_a_conversion_that_would_overflow(
    dtype: BoundaryDtype, scale: float, refused: bool
) -> None:
    """A shard whose states do not fit its boundary dtype fails the request with a typed error
    naming the dtype, and the session keeps its committed length (nothing is sent)."""
    head = _Scaled()
    head.scale = np.float32(scale)
    head.load(
        LoadConfig(shard=ShardSpec(model="m", n_layers=2, start=0, end=1), boundary_dtype=dtype)
    )
    request = PrefillRequest(
        request_id="h", session=SESSION, start_pos=0, inputs=TokenInput(token_ids=(1,))
    )
    if not refused:
        result = head.prefill(request)
        assert result.bundle.dtype == dtype  # type: ignore[union-attr]
        assert np.isfinite(result.bundle.array()).all()  # type: ignore[union-attr]
        return
    with pytest.raises(ResourceExhausted) as caught:
        head.prefill(request)
    assert caught.value.details["resource"] == "boundary_dtype_range"
    assert caught.value.details["dtype"] == dtype
    assert head.health().kv_used_tokens == 0
