"""The deterministic fake model: exact integer arithmetic on lane-packed Python integers.

Why integers: floating-point results depend on summation order, BLAS threading and SIMD code
paths, so a float model cannot promise bitwise-identical logits across machines. Integer
arithmetic is exact, so any order, any split and any machine gives the same bits.

Why packed lanes: a hidden state of ``hidden_size`` values is one Python integer holding one
value per 16-bit lane (lane ``i`` = bits ``16i..16i+15``). A layer is seventeen big-integer
operations whatever the hidden size, several times cheaper than the same number of numpy calls on
small arrays (``benchmarks/fake_bench.py`` measures the decode rate through the API, and
``benchmarks/decode_profile.py`` where its instructions go).

Every lane value lies in ``[0, 2048)``; on the wire it is read as an 11-bit two's-complement
integer, in ``[-1024, 1024)``, which both f32 and f16 represent exactly. Boundaries therefore
carry hidden states losslessly in either dtype, and a pipeline of shards reproduces one full shard
bit for bit. Lanes have 16 bits so that a product of a lane value and a multiplier below 32 never
carries into the next lane, and so that a state's bytes are little-endian uint16 lanes that numpy
reads without a copy (one gather through a 2048-entry table then gives the signed f32 values).

One layer ``l`` on the row at position ``p`` (``h`` the layer input, ``cum[p - 1]`` the cached
state of the layer at the previous position, 0 at position 0)::

    r      = rotate_lanes(h, shift_l); r ^= (r >> 5) & LOW6     mixes dimensions and bit ranges
    key    = ((r ^ key_mask_l) * key_mult_l) mod 2048
    cum[p] = (3 * cum[p - 1] + key) mod 2048                  the cache entry of position p
    h'     = ((h ^ value_mask_l) + cum[p] * value_mult_l) mod 2048

``cum`` is an order-sensitive causal mix of every cached key of the session at this layer, so a
lost, stale or mixed-up cache changes every later output. The tail maps a final state to logits
with a sparse signed projection whose terms are exact in f32 (the sum of ``LOGIT_TERMS`` products
of an integer below 1024 and ``w / 64`` with ``|w| <= 8`` needs 16 significant bits), each sum
starting from +0.0: a zero logit is +0.0, never -0.0. Exactness makes the summation order
irrelevant, so a small tail computes the same bits as one dense matrix-vector product.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

from shard_engine_api import InvalidRequest, OptionValue, ShardSpec

__all__ = [
    "DEFAULT_MODEL",
    "MODEL_SCHEME",
    "FakeModel",
    "FakeModelSpec",
    "parse_model_reference",
    "resolve_model",
]

MODEL_SCHEME: Final = "fake"
MODEL_ALGORITHM: Final = "fake-v1"
"""Part of the fingerprint: bump it whenever the arithmetic changes, so old bundles are refused."""

LANE_BITS: Final = 16
VALUE_BITS: Final = 11
SIGN_BIT: Final = VALUE_BITS - 1
LOGIT_TERMS: Final = 4
LOGIT_SCALE: Final = 1.0 / 64.0
LOGIT_BOUND: Final = 512.0
"""No logit's magnitude exceeds this: LOGIT_TERMS products of a value in [-1024, 1024) and a
weight w / 64 with |w| <= 8."""
MAX_HIDDEN_SIZE: Final = 16384
MAX_VOCAB_SIZE: Final = 1 << 20
MAX_LAYERS: Final = 4096

DEFAULT_SEED: Final = 0
DEFAULT_HIDDEN_SIZE: Final = 64
DEFAULT_VOCAB_SIZE: Final = 512
DEFAULT_LAYERS: Final = 6

_KEYS: Final = {
    "seed": "seed",
    "hidden": "hidden_size",
    "vocab": "vocab_size",
    "layers": "n_layers",
}
_OPTION_KEYS: Final = ("seed", "hidden_size", "vocab_size")


class FakeModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The parameters that fully determine a fake model."""

    seed: int = DEFAULT_SEED
    hidden_size: int = DEFAULT_HIDDEN_SIZE
    vocab_size: int = DEFAULT_VOCAB_SIZE
    n_layers: int = DEFAULT_LAYERS

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 1 << 63:
            raise InvalidRequest(f"fake model seed must lie in [0, 2**63), got {self.seed}")
        if not 1 <= self.hidden_size <= MAX_HIDDEN_SIZE:
            raise InvalidRequest(
                f"fake model hidden size must lie in [1, {MAX_HIDDEN_SIZE}], got {self.hidden_size}"
            )
        if not 1 <= self.vocab_size <= MAX_VOCAB_SIZE:
            raise InvalidRequest(
                f"fake model vocab size must lie in [1, {MAX_VOCAB_SIZE}], got {self.vocab_size}"
            )
        if not 1 <= self.n_layers <= MAX_LAYERS:
            raise InvalidRequest(
                f"fake model layer count must lie in [1, {MAX_LAYERS}], got {self.n_layers}"
            )

    @property
    def reference(self) -> str:
        """The canonical model reference, e.g. ``fake:seed=0,hidden=64,vocab=512,layers=6``."""
        return (
            f"{MODEL_SCHEME}:seed={self.seed},hidden={self.hidden_size},"
            f"vocab={self.vocab_size},layers={self.n_layers}"
        )

    @property
    def fingerprint(self) -> str:
        """Identifies the model (algorithm version and parameters) in boundary bundles."""
        digest = hashlib.sha256(f"{MODEL_ALGORITHM}|{self.reference}".encode()).hexdigest()
        return f"{MODEL_ALGORITHM}:{digest[:16]}"


DEFAULT_MODEL: Final = FakeModelSpec().reference
"""The built-in model: seed 0, hidden size 64, vocab size 512, 6 layers."""


def parse_model_reference(reference: str) -> dict[str, int]:
    """The parameters a model reference sets, keyed by FakeModelSpec field name.

    Format: ``fake`` or ``fake:key=value,...`` with keys ``seed``, ``hidden``, ``vocab`` and
    ``layers`` (decimal integers, each at most once, any order). Raises InvalidRequest.
    """
    scheme, _, rest = reference.partition(":")
    if scheme != MODEL_SCHEME:
        raise InvalidRequest(
            f"fake model reference must start with {MODEL_SCHEME!r}, got {reference!r} "
            f"(example: {DEFAULT_MODEL!r})"
        )
    values: dict[str, int] = {}
    if not rest:
        return values
    for part in rest.split(","):
        key, sep, text = part.partition("=")
        field = _KEYS.get(key.strip())
        if not sep or field is None:
            raise InvalidRequest(
                f"fake model reference {reference!r}: {part!r} is not one of "
                f"{', '.join(f'{k}=<int>' for k in _KEYS)}"
            )
        if field in values:
            raise InvalidRequest(f"fake model reference {reference!r} sets {key!r} twice")
        try:
            values[field] = int(text.strip(), 10)
        except ValueError:
            raise InvalidRequest(
                f"fake model reference {reference!r}: {key} must be an integer"
            ) from None
    return values


def resolve_model(shard: ShardSpec, options: Mapping[str, OptionValue]) -> FakeModelSpec:
    """The model a shard runs: the reference's parameters, completed by the options ``seed``,
    ``hidden_size``, ``vocab_size`` and by ``shard.n_layers``; any disagreement, or a value
    out of range, is InvalidRequest."""
    values = parse_model_reference(shard.model)
    for name in _OPTION_KEYS:
        if name not in options:
            continue
        option = options[name]
        if not isinstance(option, int) or isinstance(option, bool):
            raise InvalidRequest(f"option {name!r} must be an integer, got {option!r}")
        if name in values and values[name] != option:
            raise InvalidRequest(
                f"option {name}={option} contradicts the model reference {shard.model!r}"
            )
        values[name] = option
    layers = values.setdefault("n_layers", shard.n_layers)
    if layers != shard.n_layers:
        raise InvalidRequest(
            f"model {shard.model!r} has {layers} layers but the shard spec says {shard.n_layers}"
        )
    try:
        return msgspec.convert(values, FakeModelSpec)
    except msgspec.ValidationError as error:  # FakeModelSpec's own checks, wrapped by msgspec
        raise InvalidRequest(str(error)) from None


def _lanes_to_int(lanes: npt.NDArray[np.integer]) -> int:
    return int.from_bytes(np.ascontiguousarray(lanes, dtype="<u2").tobytes(), "little")


def _repeat_lane(value: int, hidden_size: int) -> int:
    return int.from_bytes(value.to_bytes(2, "little") * hidden_size, "little")


def _generator(seed: int, kind: int, index: int = 0) -> np.random.Generator:
    # PCG64 seeded through SeedSequence is specified bit for bit, so every platform derives the
    # same weights; separate streams per kind/layer keep a shard from generating other layers.
    return np.random.Generator(np.random.PCG64([seed, kind, index]))


_LANES: Final = np.dtype("<u2")
_INT32: Final = np.dtype(np.int32)
_INT16: Final = np.dtype("<i2")
# The bounds pack clips to, as 0-d f32 arrays: a Python int operand costs a ufunc call about
# two thirds more (its dtype is resolved on every call).
_PACK_LOW: Final = np.array(-(1 << 30), np.float32)
_PACK_HIGH: Final = np.array(1 << 30, np.float32)

_Layer = tuple[int, int, int, int, int, int, int]
"""shift, shift_back, low_lanes, key_mask, key_mult, value_mask, value_mult (a tuple: the hot
loop unpacks it in one step, several times faster than attribute access). ``low_lanes`` masks
the lanes the rotation moves up (the others wrap around to the bottom)."""
DENSE_PROJECTION_LIMIT: Final = 1 << 16
"""A tail whose (hidden_size + 1) x vocab_size projection has at most this many entries also
keeps it as a dense matrix: one matrix-vector product per decode row is about half the cost of
the gather, multiply and sum of the sparse form. The limit keeps the matrix within a core's
cache and the product below the size at which BLAS libraries split it across threads."""


RunRow = Callable[[int, Sequence[list[int]]], int]
"""``run_row(state, caches)``: run one packed row through every layer of a shard, appending its
cache entry to each layer's cache (which must hold exactly the positions before this row), and
return the shard's output state."""

# Lanes hold values below 2048 and products of them and multipliers below 32, so without a
# mask in between (key_mult + 3) * 2047 must stay below 2**16 (see _compiled_run_row).
_LANE_LIMIT: Final = 1 << LANE_BITS
_LANE_MAX: Final = (1 << VALUE_BITS) - 1


def _compiled_run_row(layers: Sequence[_Layer], value_mask: int, low6: int) -> RunRow:
    """A :data:`RunRow` for ``layers`` with the loop unrolled and every constant inlined (the
    way ``dataclasses`` writes ``__init__``): per layer, exactly the operations of the module
    docstring, about a tenth fewer instructions than a loop over the layer tuples. Where
    ``key_mult`` is at most 29 the key needs no mask of its own: ``3 * cum + key`` still fits
    every lane, and the mask after the sum gives the same value mod 2048. Only integers are
    formatted into the source."""
    constants: dict[str, object] = {"M": value_mask, "L6": low6}
    lines = ["def run_row(state, caches):"]
    lines.append("    " + "".join(f"c{index}, " for index in range(len(layers))) + "= caches")
    for index, (
        shift,
        shift_back,
        low_lanes,
        key_mask,
        key_mult,
        layer_mask,
        layer_mult,
    ) in enumerate(layers):
        constants.update({f"LOW{index}": low_lanes, f"K{index}": key_mask, f"V{index}": layer_mask})
        key = f"(r ^ K{index}) * {int(key_mult)}"
        if (key_mult + 3) * _LANE_MAX >= _LANE_LIMIT:
            key = f"({key} & M)"
        cache = f"c{index}"
        lines += [
            # Masking before the shift keeps every intermediate within the row's width: one
            # operation more than carrying the rotated-out bits along, but each is cheaper.
            f"    r = ((state & LOW{index}) << {int(shift)}) | (state >> {int(shift_back)})",
            "    r ^= (r >> 5) & L6",
            f"    m = (({cache}[-1] * 3 if {cache} else 0) + {key}) & M",
            f"    {cache}.append(m)",
            f"    state = ((state ^ V{index}) + m * {int(layer_mult)}) & M",
        ]
    lines.append("    return state")
    exec(compile("\n".join(lines), f"<fake run_row, {len(layers)} layers>", "exec"), constants)
    run_row = constants["run_row"]
    assert callable(run_row)
    return run_row


class FakeModel:
    """The weights of layers ``[start, end)`` of a fake model and its forward arithmetic.

    ``run_row`` (a :data:`RunRow`) runs one row through the shard's layers. Not thread-safe:
    single rows go through one preallocated lane buffer (the engine runs every forward under
    its compute lock)."""

    __slots__ = (
        "_embedding",
        "_lane_values",
        "_layers",
        "_logit_index",
        "_logit_weight",
        "_low6",
        "_projection",
        "_row_bytes_in",
        "_row_hidden",
        "_row_lanes",
        "_value_mask",
        "end",
        "hidden_size",
        "row_bytes",
        "run_row",
        "spec",
        "start",
    )

    def __init__(self, spec: FakeModelSpec, start: int, end: int) -> None:
        if not 0 <= start < end <= spec.n_layers:
            raise InvalidRequest(f"layer range [{start}, {end}) is outside the model")
        self.spec = spec
        self.start = start
        self.end = end
        hidden = spec.hidden_size
        self.hidden_size = hidden
        self.row_bytes = hidden * (LANE_BITS // 8)
        self._value_mask = _repeat_lane((1 << VALUE_BITS) - 1, hidden)
        self._low6 = _repeat_lane(0x3F, hidden)
        # Lane value (11 bits, as stored) -> its signed value as f32: one gather turns a packed
        # state's lanes into wire values, cheaper than sign-extending the big integer and
        # converting int16 to f32 (two numpy calls).
        lane_values = np.arange(1 << VALUE_BITS, dtype=np.int32)
        lane_values[1 << SIGN_BIT :] -= 1 << VALUE_BITS
        self._lane_values: npt.NDArray[np.float32] = lane_values.astype(np.float32)
        width = hidden * LANE_BITS
        limit = 1 << VALUE_BITS
        self._embedding: list[int] = []
        if start == 0:
            table = _generator(spec.seed, 0).integers(0, limit, (spec.vocab_size, hidden))
            self._embedding = [_lanes_to_int(row) for row in table]
        layers: list[_Layer] = []
        for layer in range(start, end):
            rng = _generator(spec.seed, 1, layer)
            rotation = int(rng.integers(1, hidden)) if hidden > 1 else 0
            key_mask = _lanes_to_int(rng.integers(0, limit, hidden))
            key_mult = 2 * int(rng.integers(1, 16)) + 1
            value_mask = _lanes_to_int(rng.integers(0, limit, hidden))
            value_mult = 2 * int(rng.integers(1, 16)) + 1
            layers.append(
                (
                    rotation * LANE_BITS,
                    width - rotation * LANE_BITS,
                    (1 << (width - rotation * LANE_BITS)) - 1,
                    key_mask,
                    key_mult,
                    value_mask,
                    value_mult,
                )
            )
        self._layers = tuple(layers)
        self.run_row: RunRow = _compiled_run_row(self._layers, self._value_mask, self._low6)
        self._projection: npt.NDArray[np.float32] | None = None
        self._logit_index: npt.NDArray[np.intp] = np.zeros((LOGIT_TERMS, 0), dtype=np.intp)
        self._logit_weight: npt.NDArray[np.float32] = np.zeros((LOGIT_TERMS, 0), np.float32)
        if end == spec.n_layers:
            rng = _generator(spec.seed, 2)
            self._logit_index = rng.integers(0, hidden, (LOGIT_TERMS, spec.vocab_size)).astype(
                np.intp
            )
            weights = rng.integers(-8, 9, (LOGIT_TERMS, spec.vocab_size))
            self._logit_weight = (weights * LOGIT_SCALE).astype(np.float32)
            if (hidden + 1) * spec.vocab_size <= DENSE_PROJECTION_LIMIT:
                # Row i holds the weights every logit gives lane i (repeated lanes summed,
                # exactly); the last row, all +0.0, is the constant lane's (see logits).
                projection = np.zeros((hidden + 1, spec.vocab_size), np.float32)
                columns = np.arange(spec.vocab_size)
                for term in range(LOGIT_TERMS):
                    np.add.at(
                        projection, (self._logit_index[term], columns), self._logit_weight[term]
                    )
                self._projection = projection
        # One row's lanes are copied into this buffer (no array per call); its last lane is
        # the constant 1 the dense projection multiplies by +0.0.
        self._row_lanes: npt.NDArray[np.uint16] = np.zeros((1, hidden + 1), _LANES)
        self._row_lanes[0, hidden] = 1
        self._row_bytes_in = self._row_lanes.data.cast("B")[: self.row_bytes]
        self._row_hidden = self._row_lanes[:, :hidden]

    # The methods below are the hot path of every forward; they trade a little readability
    # for fewer Python-level operations.

    def embed(self, token_ids: npt.NDArray[np.int32]) -> list[int]:
        """The packed layer-0 states of ``token_ids`` (head shards only)."""
        table = self._embedding
        tokens = token_ids.tolist()
        if len(tokens) == 1:
            return [table[tokens[0]]]
        return [table[token] for token in tokens]

    def _raw_lanes(self, states: Sequence[int]) -> npt.NDArray[np.uint16]:
        size = self.row_bytes
        if len(states) == 1:
            data = states[0].to_bytes(size, "little")
        else:
            data = b"".join([state.to_bytes(size, "little") for state in states])
        return np.frombuffer(data, dtype=_LANES)

    def unpack(self, states: Sequence[int]) -> npt.NDArray[np.float32]:
        """Packed states as wire hidden states: ``(n, hidden_size)`` f32 in ``[-1024, 1024)``,
        a new array that owns its memory."""
        if len(states) == 1:
            self._row_bytes_in[:] = states[0].to_bytes(self.row_bytes, "little")
            return self._lane_values.take(self._row_hidden)
        values = self._lane_values.take(self._raw_lanes(states))
        return values.reshape(len(states), self.hidden_size)

    def unpack_each(self, states: Sequence[int]) -> list[npt.NDArray[np.float32]]:
        """:meth:`unpack` of each state as its own ``(1, hidden_size)`` array (one that owns
        its memory: a decode batch's results)."""
        rows = self.unpack(states)
        return [rows[index : index + 1].copy() for index in range(len(states))]

    def pack(self, hidden: npt.NDArray[np.float32]) -> list[int]:
        """Wire hidden states back to packed states. Exact for anything ``unpack`` produced;
        any other finite input maps deterministically (rounded, wrapped into range)."""
        # np.clip's Python-level wrapper costs twice the two ufuncs it amounts to (same NaN and
        # infinity behaviour). Narrowing int32 -> int16 keeps the low 16 bits (two's
        # complement), so each lane's low 11 bits are those of the rounded value; the
        # big-integer mask then drops the rest (one integer operation per row, not a numpy pass).
        values = np.maximum(hidden, _PACK_LOW)
        np.minimum(values, _PACK_HIGH, out=values)
        np.rint(values, out=values)
        data = values.astype(_INT32).astype(_INT16).tobytes()
        size = self.row_bytes
        mask = self._value_mask
        if len(data) == size:
            return [int.from_bytes(data, "little") & mask]
        return [
            int.from_bytes(data[offset : offset + size], "little") & mask
            for offset in range(0, len(data), size)
        ]

    def logits_each(self, states: Sequence[int]) -> list[npt.NDArray[np.float32]]:
        """:meth:`logits` of each state as its own ``(1, vocab_size)`` array (one that owns
        its memory: a decode batch's results). With a dense projection, one product per row
        costs less than the sparse form over all rows plus a copy per row."""
        if self._projection is not None:
            logits = self.logits
            return [logits((state,)) for state in states]
        rows = self.logits(states)
        return [rows[index : index + 1].copy() for index in range(len(states))]

    def logits(self, states: Sequence[int]) -> npt.NDArray[np.float32]:
        """``(n, vocab_size)`` f32 logits of final states (tail shards only), a new array that
        owns its memory. Every product and partial sum is exact in f32, so no summation order
        can change a value; every sum includes a +0.0 term, so a zero logit is +0.0 (never
        -0.0, whatever the order) and both forms below give the same bits."""
        if len(states) == 1:
            # The decode path: the lanes go through the row buffer and the lane table.
            self._row_bytes_in[:] = states[0].to_bytes(self.row_bytes, "little")
            values = self._lane_values.take(self._row_lanes)
            projection = self._projection
            if projection is not None:
                # The constant lane (1.0) times its +0.0 row is the +0.0 term.
                dense: npt.NDArray[np.float32] = values.dot(projection)
                return dense
            # The logit indices are all in range, so the gather skips bounds checks
            # (mode="wrap" never wraps here, it only takes numpy's unchecked loop).
            terms = values.take(self._logit_index, mode="wrap")
            terms *= self._logit_weight
            single: npt.NDArray[np.float32] = np.add.reduce(
                terms, axis=0, keepdims=True, initial=0.0
            )
            return single
        # Several rows: the sparse form (a matrix product over rows could use BLAS threads).
        lanes = self._lane_values.take(self._raw_lanes(states))
        rows = lanes.reshape(len(states), self.hidden_size)[:, self._logit_index]
        rows *= self._logit_weight
        many: npt.NDArray[np.float32] = np.sum(rows, axis=1, initial=0.0)
        return many
