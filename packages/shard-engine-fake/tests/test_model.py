"""The deterministic model: golden digests, split invariance, decode consistency, truncation,
batch invariance and session isolation."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest
from conftest import (
    EngineFactory,
    bundle_of,
    decode,
    decode_request,
    logits_of,
    prefill,
    session,
)

import shard_engine_api as api
from shard_engine_fake import DEFAULT_MODEL, FakeEngine, FakeModelSpec, parse_model_reference
from shard_engine_fake._model import DENSE_PROJECTION_LIMIT, FakeModel
from shard_engine_fake.pipeline import generate, step

PROMPT = tuple(range(1, 9))
GOLDEN_PREFILL_ALL = "1df755c603fca688ba23f23df8e92bdee7c7f572535a8719a81359f8b1347524"
GOLDEN_GENERATION = "1c65fe955da63937df31cffe9b22f8b510ac5c80e6624e1385008fe2d8dcc745"
GOLDEN_TOKENS = (0, 498, 147, 389)
WIDE_MODEL = "fake:seed=7,hidden=1024,vocab=300,layers=3"
GOLDEN_WIDE_GENERATION = "c8b646f9c2e000038ee038a6fc6ae0f1c78b7d887ec9bed04600e3088afcb11b"
GOLDEN_WIDE_TOKENS = (115, 143, 136, 134)

SPLITS = [
    pytest.param([(0, 3), (3, 6)], id="2-way"),
    pytest.param([(0, 2), (2, 4), (4, 6)], id="3-way"),
    pytest.param([(0, 1), (1, 5), (5, 6)], id="uneven"),
    pytest.param([(0, 5), (5, 6)], id="uneven-2-way"),
    pytest.param([(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)], id="6-way"),
]


def digest(arrays: Sequence[npt.NDArray[np.float32]]) -> str:
    return hashlib.sha256(b"".join(array.tobytes() for array in arrays)).hexdigest()


def pipeline(
    make_engine: EngineFactory, ranges: Sequence[tuple[int, int]], **fields: object
) -> list[FakeEngine]:
    return [make_engine(start, end, **fields) for start, end in ranges]


def test_golden_prefill_digest(make_engine: EngineFactory) -> None:
    """Pins the model's arithmetic: any change to the logits of the built-in model shows here."""
    result = logits_of(prefill(make_engine(), session(), 0, PROMPT, logits="all"))
    assert result.n_rows == len(PROMPT)
    assert hashlib.sha256(bytes(result.payload)).hexdigest() == GOLDEN_PREFILL_ALL


@pytest.mark.parametrize(
    ("model", "n_layers", "tokens", "expected"),
    [
        (DEFAULT_MODEL, 6, GOLDEN_TOKENS, GOLDEN_GENERATION),
        (WIDE_MODEL, 3, GOLDEN_WIDE_TOKENS, GOLDEN_WIDE_GENERATION),
    ],
)
def test_golden_generation_digest(
    make_engine: EngineFactory, model: str, n_layers: int, tokens: tuple[int, ...], expected: str
) -> None:
    engine = make_engine(model=model, n_layers=n_layers)
    generation = generate([engine], session(), PROMPT, 4)
    assert generation.tokens == tokens
    assert digest(generation.logits) == expected


def test_golden_digest_in_a_fresh_process() -> None:
    """Nothing process-dependent (hash seeds, import order) enters the weights."""
    code = (
        "import hashlib, shard_engine_api as api\n"
        "from shard_engine_fake import FakeEngine, DEFAULT_MODEL\n"
        "e = FakeEngine()\n"
        "e.load(api.LoadConfig(shard=api.ShardSpec(model=DEFAULT_MODEL, n_layers=6, start=0,"
        " end=6)))\n"
        "r = e.prefill(api.PrefillRequest(request_id='r', session=api.SessionRef(session_id='g',"
        " epoch=1), start_pos=0, inputs=api.TokenInput(token_ids=tuple(range(1, 9))),"
        " logits='all'))\n"
        "print(hashlib.sha256(bytes(r.payload)).hexdigest())\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    )
    assert output.stdout.strip() == GOLDEN_PREFILL_ALL


@pytest.mark.parametrize("ranges", SPLITS)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_split_invariance_prefill_and_decode(
    make_engine: EngineFactory, ranges: list[tuple[int, int]], dtype: str
) -> None:
    """A pipeline gives bitwise the logits of one full shard, for f32 and f16 boundaries."""
    full = generate([make_engine(boundary_dtype=dtype)], session(), PROMPT, 5)
    split = generate(pipeline(make_engine, ranges, boundary_dtype=dtype), session(), PROMPT, 5)
    assert split.tokens == full.tokens
    assert digest(split.logits) == digest(full.logits)


@pytest.mark.parametrize("ranges", SPLITS)
def test_split_invariance_chunked_prefill_and_truncate(
    make_engine: EngineFactory, ranges: list[tuple[int, int]]
) -> None:
    full = make_engine()
    shards = pipeline(make_engine, ranges)
    ref = session()
    prompt = list(range(20, 45))
    # Chunks of 7, 11 and 7 tokens, then a truncation back to 10 and a replay of other tokens.
    for engines in ([full], shards):
        step(engines, ref, 0, prompt[:7], request_id="c0")
        step(engines, ref, 7, prompt[7:18], request_id="c1")
        step(engines, ref, 18, prompt[18:], request_id="c2")
    chunked_full = logits_of(prefill(full, ref, 25, [3], request_id="tail", logits="all"))
    chunked_split = step(shards, ref, 25, [3], request_id="tail")
    assert bytes(chunked_split.payload) == bytes(chunked_full.payload)
    replay = [9, 8, 7, 6]
    truncated_full = step([full], ref, 10, replay, request_id="t")
    truncated_split = step(shards, ref, 10, replay, request_id="t")
    assert bytes(truncated_split.payload) == bytes(truncated_full.payload)


def test_decode_after_prefill_equals_longer_prefill(make_engine: EngineFactory) -> None:
    engine = make_engine()
    one_shot = logits_of(prefill(engine, session("a"), 0, [*PROMPT, 77, 78], logits="all"))
    prefill(engine, session("b"), 0, PROMPT)
    first = logits_of(decode(engine, session("b"), len(PROMPT), 77))
    second = logits_of(decode(engine, session("b"), len(PROMPT) + 1, 78))
    rows = one_shot.array()
    assert first.array().tobytes() == rows[-2:-1].tobytes()
    assert second.array().tobytes() == rows[-1:].tobytes()
    assert second.first_pos == len(PROMPT) + 1


def test_truncate_and_replay_equals_fresh_run(make_engine: EngineFactory) -> None:
    engine = make_engine()
    ref = session()
    prefill(engine, ref, 0, [*PROMPT, 50, 51, 52])
    decode(engine, ref, 11, 53)
    replayed = logits_of(prefill(engine, ref, 5, [60, 61, 62], logits="all"))
    fresh = logits_of(prefill(engine, session("fresh"), 0, [*PROMPT[:5], 60, 61, 62], logits="all"))
    assert replayed.array().tobytes() == fresh.array()[5:].tobytes()
    assert engine.health().kv_used_tokens == 16


def test_prefill_all_rows_equal_last_rows(make_engine: EngineFactory) -> None:
    engine = make_engine()
    rows = logits_of(prefill(engine, session("a"), 0, PROMPT, logits="all"))
    last = logits_of(prefill(engine, session("b"), 0, PROMPT))
    assert last.n_rows == 1
    assert last.first_pos == len(PROMPT) - 1
    assert last.array().tobytes() == rows.array()[-1:].tobytes()


@pytest.mark.parametrize("ranges", [[(0, 6)], [(0, 2), (2, 4), (4, 6)]])
def test_batched_decode_equals_single_decode(
    make_engine: EngineFactory, ranges: list[tuple[int, int]]
) -> None:
    single = pipeline(make_engine, ranges)
    batched = pipeline(make_engine, ranges)
    refs = [session(f"s{index}") for index in range(5)]
    for index, ref in enumerate(refs):
        prompt = [index + 1] * (index + 2)
        step(single, ref, 0, prompt, request_id=f"p{index}")
        step(batched, ref, 0, prompt, request_id=f"p{index}")
    expected = [
        logits_of(step(single, ref, index + 2, [100 + index], request_id="d", decode=True))
        for index, ref in enumerate(refs)
    ]
    inputs: list[int | api.BoundaryBundle] = [100 + index for index in range(len(refs))]
    result: api.DecodeBatchResult | None = None
    for engine in batched:
        request = api.DecodeBatchRequest(
            request_id="batch",
            items=tuple(
                decode_request(ref, index + 2, inputs[index], request_id=f"b{index}")
                for index, ref in enumerate(refs)
            ),
        )
        result = engine.decode_batch(request)
        outcomes = result.items
        if engine is not batched[-1]:
            inputs = [bundle_of(outcome) for outcome in outcomes]  # type: ignore[arg-type]
    assert result is not None
    for outcome, want in zip(result.items, expected, strict=True):
        got = logits_of(outcome)  # type: ignore[arg-type]
        assert got.array().tobytes() == want.array().tobytes()
        assert got.request_id.startswith("b")


def test_interleaving_sessions_does_not_change_outputs(make_engine: EngineFactory) -> None:
    alone = generate([make_engine()], session("a"), PROMPT, 6)
    engine = make_engine()
    refs = [session(name) for name in "abc"]
    prompts = {"a": PROMPT, "b": (4, 4, 4), "c": (9, 1)}
    last: dict[str, npt.NDArray[np.float32]] = {}
    positions: dict[str, int] = {}
    for ref in refs:
        result = logits_of(prefill(engine, ref, 0, prompts[ref.session_id], request_id="p"))
        last[ref.session_id] = result.array()[-1]
        positions[ref.session_id] = len(prompts[ref.session_id])
    tokens: list[int] = []
    for _ in range(6):
        for ref in reversed(refs):
            sid = ref.session_id
            token = int(np.argmax(last[sid]))
            if sid == "a":
                tokens.append(token)
            last[sid] = logits_of(decode(engine, ref, positions[sid], token)).array()[-1]
            positions[sid] += 1
    assert tuple(tokens) == alone.tokens


def test_stale_or_lost_cache_changes_the_output(make_engine: EngineFactory) -> None:
    """The layers really read the cache: the same token after a different history differs."""
    engine = make_engine()
    prefill(engine, session("a"), 0, [1, 2, 3])
    prefill(engine, session("b"), 0, [1, 2, 4])
    after_a = logits_of(decode(engine, session("a"), 3, 9)).array()
    after_b = logits_of(decode(engine, session("b"), 3, 9)).array()
    assert after_a.tobytes() != after_b.tobytes()


def test_middle_shard_boundaries_carry_fixture_metadata(make_engine: EngineFactory) -> None:
    head, middle = make_engine(0, 2), make_engine(2, 4)
    first = prefill(head, session(), 0, PROMPT)
    assert isinstance(first, api.BoundaryResult)
    bundle = first.bundle
    assert (bundle.layer, bundle.n_tokens, bundle.hidden_size, bundle.dtype) == (2, 8, 64, "f32")
    assert bundle.model_fingerprint == head.capabilities().model_fingerprint
    hidden = bundle.array()
    assert np.array_equal(hidden, np.rint(hidden))
    assert float(np.min(hidden)) >= -1024
    assert float(np.max(hidden)) < 1024
    second = prefill(middle, session(), 0, bundle)
    assert isinstance(second, api.BoundaryResult)
    assert second.evidence == "fixture"
    assert second.bundle.layer == 4


def test_capabilities(make_engine: EngineFactory) -> None:
    caps = make_engine(1, 3).capabilities()
    assert caps.engine == "fake"
    assert caps.evidence == "fixture"
    assert caps.role == "middle"
    assert (caps.hidden_size, caps.vocab_size) == (64, 512)
    assert caps.boundary_dtypes == ("f32", "f16", "bf16")
    assert caps.determinism == api.Determinism(
        deterministic=True, split_exact=True, batch_invariant=True
    )
    assert caps.features.batched_decode
    assert caps.features.cancel
    assert caps.features.truncate
    assert not caps.reserved.mtp.enabled
    assert not caps.reserved.aux.enabled


def test_model_reference_and_options(make_engine: EngineFactory) -> None:
    assert parse_model_reference("fake") == {}
    assert parse_model_reference("fake:hidden=8, seed=3") == {"hidden_size": 8, "seed": 3}
    engine = make_engine(model="fake:vocab=300", n_layers=2, options={"seed": 5, "hidden_size": 16})
    assert engine.model_spec == FakeModelSpec(seed=5, hidden_size=16, vocab_size=300, n_layers=2)
    assert engine.model_spec.reference == "fake:seed=5,hidden=16,vocab=300,layers=2"
    other = make_engine(model="fake:seed=6,vocab=300", n_layers=2, options={"hidden_size": 16})
    assert other.capabilities().model_fingerprint != engine.capabilities().model_fingerprint


@pytest.mark.parametrize(
    ("model", "n_layers", "options"),
    [
        ("llama:seed=1", 6, {}),
        ("fake:seed=x", 6, {}),
        ("fake:depth=3", 6, {}),
        ("fake:seed=1,seed=2", 6, {}),
        ("fake:layers=4", 6, {}),
        ("fake:hidden=0", 6, {}),
        ("fake:vocab=0", 6, {}),
        ("fake:seed=-1", 6, {}),
        ("fake:seed=1", 6, {"seed": 2}),
        ("fake", 6, {"hidden_size": "64"}),
        ("fake", 6, {"temperature": 1}),
    ],
)
def test_invalid_model_is_refused_at_load(
    model: str, n_layers: int, options: dict[str, object]
) -> None:
    engine = FakeEngine()
    config = api.LoadConfig(
        shard=api.ShardSpec(model=model, n_layers=n_layers, start=0, end=n_layers),
        options=options,
    )
    with pytest.raises(api.InvalidRequest):
        engine.load(config)
    engine.close()


def test_non_integral_hidden_input_is_deterministic(make_engine: EngineFactory) -> None:
    """Bundles from elsewhere (not a fake head) still give one deterministic answer."""
    tail = make_engine(3, 6)
    caps = tail.capabilities()
    hidden = np.linspace(-5000.0, 5000.0, 2 * caps.hidden_size, dtype=np.float32).reshape(2, -1)
    bundle = api.BoundaryBundle.from_array(
        hidden + 0.25,
        session=session(),
        first_pos=0,
        layer=3,
        model_fingerprint=caps.model_fingerprint,
    )
    first = logits_of(prefill(tail, session(), 0, bundle)).array().tobytes()
    again = logits_of(prefill(tail, session("x"), 0, _rebind(bundle, session("x")))).array()
    assert first == again.tobytes()


def _rebind(bundle: api.BoundaryBundle, ref: api.SessionRef) -> api.BoundaryBundle:
    return api.BoundaryBundle.from_array(
        bundle.array(),
        session=ref,
        first_pos=bundle.first_pos,
        layer=bundle.layer,
        model_fingerprint=bundle.model_fingerprint,
        dtype=bundle.dtype,
    )


class _LaneFormulas:
    """The per-lane formulas of ``_model``'s docstring with plain numpy arrays (no packed
    integers): an independent statement of the arithmetic the packed code must reproduce."""

    LIMIT = 2048

    def __init__(self, spec: FakeModelSpec) -> None:
        hidden, limit = spec.hidden_size, self.LIMIT

        def generator(kind: int, index: int = 0) -> np.random.Generator:
            return np.random.Generator(np.random.PCG64([spec.seed, kind, index]))

        self.embedding = generator(0).integers(0, limit, (spec.vocab_size, hidden))
        self.layers = []
        for layer in range(spec.n_layers):
            rng = generator(1, layer)
            rotation = int(rng.integers(1, hidden)) if hidden > 1 else 0
            key_mask = rng.integers(0, limit, hidden)
            key_mult = 2 * int(rng.integers(1, 16)) + 1
            value_mask = rng.integers(0, limit, hidden)
            value_mult = 2 * int(rng.integers(1, 16)) + 1
            self.layers.append((rotation, key_mask, key_mult, value_mask, value_mult))
        rng = generator(2)
        self.index = rng.integers(0, hidden, (4, spec.vocab_size))
        self.weight = (rng.integers(-8, 9, (4, spec.vocab_size)) / 64.0).astype(np.float32)

    def logits(self, lanes: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        signed = np.where(lanes >= self.LIMIT // 2, lanes - self.LIMIT, lanes).astype(np.float32)
        terms = signed[self.index] * self.weight
        # The sum starts from +0.0, so a zero logit is +0.0 even when every term is -0.0.
        zero = np.zeros(terms.shape[1], np.float32)
        result: npt.NDArray[np.float32] = (((zero + terms[0]) + terms[1]) + terms[2]) + terms[3]
        return result

    def run(self, tokens: Sequence[int]) -> npt.NDArray[np.float32]:
        """The logits of every row of a prompt."""
        limit = self.LIMIT
        cum = [np.zeros(self.embedding.shape[1], np.int64) for _ in self.layers]
        rows = []
        for token in tokens:
            state = self.embedding[token].astype(np.int64)
            for layer, (rotation, key_mask, key_mult, value_mask, value_mult) in enumerate(
                self.layers
            ):
                rotated = np.roll(state, rotation)  # lane i takes lane i - rotation
                rotated ^= (rotated >> 5) & 0x3F
                key = ((rotated ^ key_mask) * key_mult) % limit
                cum[layer] = (3 * cum[layer] + key) % limit
                state = ((state ^ value_mask) + cum[layer] * value_mult) % limit
            rows.append(self.logits(state))
        return np.stack(rows)


LANE_MODELS = [
    DEFAULT_MODEL,  # a dense tail projection (see DENSE_PROJECTION_LIMIT)
    "fake:seed=11,hidden=5,vocab=300,layers=3",  # a key_mult of 31 (the key needs its mask)
    WIDE_MODEL,  # a sparse one, and a key_mult of 31 too
]


@pytest.mark.parametrize("model", LANE_MODELS)
def test_packed_arithmetic_equals_the_lane_formulas(make_engine: EngineFactory, model: str) -> None:
    """The packed implementation (prefill rows and a decode batch) computes bitwise what the
    module docstring's per-lane formulas say."""
    spec = FakeModelSpec(**parse_model_reference(model))
    tokens = [(7 * position + 3) % spec.vocab_size for position in range(12)]
    expected = _LaneFormulas(spec).run(tokens)
    engine = make_engine(model=model, n_layers=spec.n_layers)
    got = logits_of(prefill(engine, session(), 0, tokens, logits="all")).array()
    assert got.tobytes() == expected.tobytes()
    refs = [session(f"b{index}") for index in range(3)]
    for ref in refs:
        prefill(engine, ref, 0, tokens[:-1], request_id=f"p{ref.session_id}")
    batch = engine.decode_batch(
        api.DecodeBatchRequest(
            request_id="batch",
            items=tuple(
                decode_request(ref, len(tokens) - 1, tokens[-1], request_id=f"d{index}")
                for index, ref in enumerate(refs)
            ),
        )
    )
    for outcome in batch.items:
        assert logits_of(outcome).array().tobytes() == expected[-1:].tobytes()  # type: ignore[arg-type]


@pytest.mark.parametrize("model", LANE_MODELS)
def test_logits_equal_the_lane_formulas_signed_zeros_included(model: str) -> None:
    """The tail projection of arbitrary final states, one by one and as a batch, including
    all-zero lanes (products of 0 and a negative weight are -0.0; every zero logit is +0.0)."""
    spec = FakeModelSpec(**parse_model_reference(model))
    formulas = _LaneFormulas(spec)
    fake = FakeModel(spec, 0, spec.n_layers)
    dense = (spec.hidden_size + 1) * spec.vocab_size <= DENSE_PROJECTION_LIMIT
    assert dense == (model != WIDE_MODEL)
    rng = np.random.default_rng(5)
    lanes = rng.integers(0, 2048, (6, spec.hidden_size))
    lanes[0] = 0
    lanes[1, ::2] = 0
    states = [int.from_bytes(row.astype("<u2").tobytes(), "little") for row in lanes]
    expected = np.stack([formulas.logits(row) for row in lanes])
    assert (expected == 0).any()
    assert not np.signbit(expected[expected == 0]).any()
    for state, want in zip(states, expected, strict=True):
        assert fake.logits([state]).tobytes() == want.tobytes()
    assert fake.logits(states).tobytes() == expected.tobytes()
