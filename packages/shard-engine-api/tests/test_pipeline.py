"""The pipeline driver and the generate/stream API: split pipelines equal one shard, sampling is
seeded and reproducible, stop tokens and max_new_tokens end a stream, and the session is
released on every exit path."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from conformance_engines import ReferenceEngine, reference_fixture

from shard_engine_api import (
    GREEDY,
    BoundaryResult,
    CacheMiss,
    DecodeRequest,
    InvalidRequest,
    LogitsResult,
    MalformedOutput,
    Pipeline,
    ResourceExhausted,
    Sampler,
    Sampling,
    SessionRef,
    ShardEngine,
    ShardResult,
    TokenInput,
    load_pipeline,
    split_layers,
)
from shard_engine_api.engine import ModelFixture


@pytest.fixture
def fixture(tmp_path: Path) -> ModelFixture:
    return reference_fixture(tmp_path)


def _pipeline(fixture: ModelFixture, parts: int) -> Pipeline:
    return load_pipeline(
        ReferenceEngine, fixture, split_layers(fixture.n_layers, parts), max_sessions=4
    )


@pytest.fixture
def pipeline(fixture: ModelFixture) -> Iterator[Pipeline]:
    with _pipeline(fixture, 2) as built:
        yield built


def _sessions(engines: Sequence[ShardEngine]) -> list[int]:
    return [engine.health().sessions for engine in engines]


def test_split_generation_equals_one_shard(fixture: ModelFixture) -> None:
    with _pipeline(fixture, 1) as full, _pipeline(fixture, 3) as split:
        one = full.generate((1, 2, 3), 5)
        three = split.generate((1, 2, 3), 5)
    assert one.token_ids == three.token_ids
    assert one.step_logits == three.step_logits
    assert len(one.step_logits) == 6
    assert three.shard_timings[0].shard.endswith("(head)")


def test_stream_yields_tokens_and_positions(pipeline: Pipeline) -> None:
    expected = pipeline.generate((4, 5), 4).token_ids
    with pipeline.stream((4, 5), max_new_tokens=4) as stream:
        tokens = list(stream)
    assert tuple(token.token_id for token in tokens) == expected
    assert [token.position for token in tokens] == [2, 3, 4, 5]
    assert all(token.text is None for token in tokens)
    assert stream.finish_reason == "length"
    assert _sessions(pipeline.engines) == [0, 0]


def test_stop_tokens_end_the_stream_without_yielding_the_stop(pipeline: Pipeline) -> None:
    tokens = pipeline.generate((4, 5), 6).token_ids
    stop = tokens[2]
    first = tokens.index(stop)
    with pipeline.stream((4, 5), max_new_tokens=6, stop_tokens=[stop]) as stream:
        got = [token.token_id for token in stream]
    assert got == list(tokens[:first])
    assert stream.finish_reason == "stop"


def test_session_is_released_on_early_break(pipeline: Pipeline) -> None:
    with pipeline.stream((4, 5), max_new_tokens=10) as stream:
        for _ in stream:
            assert _sessions(pipeline.engines) == [1, 1]
            break
    assert _sessions(pipeline.engines) == [0, 0]


def test_session_is_released_when_the_stream_is_closed_or_dropped(pipeline: Pipeline) -> None:
    stream = pipeline.stream((4, 5), max_new_tokens=10)
    next(stream)
    stream.close()
    assert _sessions(pipeline.engines) == [0, 0]
    stream.close()  # idempotent
    for _ in pipeline.stream((4, 5), max_new_tokens=10):
        break
    # The stream was a temporary: dropping it closed its generator.
    assert _sessions(pipeline.engines) == [0, 0]


def test_session_is_released_when_a_step_raises(
    pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Failing(RuntimeError):
        pass

    tail = pipeline.engines[-1]
    original = tail.decode
    calls: list[DecodeRequest] = []

    def decode(request: DecodeRequest) -> BoundaryResult | LogitsResult:
        calls.append(request)
        if len(calls) == 2:
            raise Failing("backend died")
        return original(request)

    monkeypatch.setattr(tail, "decode", decode)
    with pytest.raises(Failing), pipeline.stream((4, 5), max_new_tokens=5) as stream:
        for _ in stream:
            pass
    assert _sessions(pipeline.engines) == [0, 0]


def test_a_stream_that_never_started_touches_nothing(pipeline: Pipeline) -> None:
    stream = pipeline.stream((4, 5), max_new_tokens=3)
    stream.close()
    assert all(engine.metrics().requests == 0 for engine in pipeline.engines)


def test_sampling_is_seeded_and_reproducible(pipeline: Pipeline) -> None:
    sampling = Sampling(temperature=1.5, top_k=10, top_p=0.9, seed=11)
    first = pipeline.generate((4, 5), 8, sampling=sampling).token_ids
    again = pipeline.generate((4, 5), 8, sampling=sampling).token_ids
    other = pipeline.generate((4, 5), 8, sampling=Sampling(temperature=1.5, seed=12)).token_ids
    greedy = pipeline.generate((4, 5), 8).token_ids
    assert first == again
    assert len({first, other, greedy}) > 1


def test_sampler_cuts() -> None:
    row = np.array([0.0, 5.0, 4.0, 5.0, -1.0], dtype=np.float32)
    assert Sampler(GREEDY)(row) == 1  # lowest id on ties
    top_two = Sampler(Sampling(temperature=1.0, top_k=2, seed=3))
    assert {top_two(row) for _ in range(200)} == {1, 3}
    nucleus = Sampler(Sampling(temperature=1.0, top_p=0.01, seed=3))
    assert {nucleus(row) for _ in range(50)} == {1}
    with pytest.raises(MalformedOutput):
        Sampler(Sampling(temperature=1.0))(np.array([np.nan, 1.0]))


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-45])
def test_a_tiny_temperature_samples_the_top_logits(temperature: float) -> None:
    """A subnormal or tiny temperature is the greedy limit (ties drawn between), not an
    overflow to inf whose inf - inf made every weight NaN (RuntimeWarning, arbitrary draws)."""
    row = np.array([0.0, 5.0, 4.0, 5.0, -3e38], dtype=np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        drawn = {Sampler(Sampling(temperature=temperature, seed=seed))(row) for seed in range(40)}
    assert drawn == {1, 3}


@pytest.mark.parametrize("stop", ["x", None, 1.7, True, -1, 2**31, np.int64(3)])
def test_stop_tokens_that_are_not_token_ids_are_invalid(pipeline: Pipeline, stop: object) -> None:
    stops = (stop,)
    with pytest.raises(InvalidRequest, match="stop tokens"):
        pipeline.stream((4, 5), max_new_tokens=2, stop_tokens=stops)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="stop tokens"):
        pipeline.generate((4, 5), 2, stop_tokens=stops)  # type: ignore[arg-type]
    assert all(engine.metrics().requests == 0 for engine in pipeline.engines)


def test_generation_settings_of_the_wrong_type_are_invalid(pipeline: Pipeline) -> None:
    with pytest.raises(InvalidRequest, match="sampling must be a Sampling"):
        pipeline.stream((4, 5), max_new_tokens=2, sampling={"temperature": 1.0})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match=r"PrefillRequest\.inputs\.token_ids"):
        list(pipeline.stream(np.array([4, 5]), max_new_tokens=2))  # type: ignore[arg-type]
    assert all(engine.health().sessions == 0 for engine in pipeline.engines)


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"seed": -1},
    ],
)
def test_bad_sampling_settings_are_invalid(settings: dict[str, float]) -> None:
    with pytest.raises(InvalidRequest):
        Sampling(**settings)  # type: ignore[arg-type]


def test_bad_generation_requests_are_invalid(pipeline: Pipeline) -> None:
    with pytest.raises(InvalidRequest, match="no tokens"):
        pipeline.stream((), max_new_tokens=3)
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        pipeline.generate((1,), -3)
    room = pipeline.max_context
    with pytest.raises(InvalidRequest, match=f"hold at most {room} per session"):
        pipeline.generate((1, 2), room - 1)
    # A stream does not decode its last token, so one more fits.
    pipeline.stream((1, 2), max_new_tokens=room - 1).close()
    with pytest.raises(InvalidRequest, match="positions"):
        pipeline.stream((1, 2), max_new_tokens=room)


class _Letters:
    """A toy tokenizer: id i is the letter chr(97 + i % 26); 25 is a two-byte character
    emitted as two ids so text must wait for its second half."""

    def encode(self, text: str) -> list[int]:
        return [ord(character) - 97 for character in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(97 + token % 26) for token in token_ids)


def test_text_pieces_add_up_to_the_text(pipeline: Pipeline) -> None:
    with pipeline.stream((4, 5), max_new_tokens=5, tokenizer=_Letters()) as stream:
        pieces = [token.text for token in stream]
    assert "".join(piece or "" for piece in pieces) == stream.text
    assert stream.text == _Letters().decode(stream.token_ids)


class _FailingTokenizer:
    """A plugin tokenizer whose decode raises (as a broken one would, mid-generation)."""

    def encode(self, text: str) -> list[int]:
        return [1]

    def decode(self, token_ids: Sequence[int]) -> str:
        raise RuntimeError("vocabulary file vanished")


class _BytesTokenizer:
    """A plugin tokenizer whose decode returns bytes instead of text."""

    def encode(self, text: str) -> list[int]:
        return [1]

    def decode(self, token_ids: Sequence[int]) -> str:
        return b"ab"  # type: ignore[return-value]


@pytest.mark.parametrize("tokenizer", [_FailingTokenizer(), _BytesTokenizer()])
def test_a_broken_tokenizer_is_malformed_output_and_releases_the_session(
    pipeline: Pipeline, tokenizer: object
) -> None:
    for generation in (
        lambda: list(pipeline.stream((4, 5), max_new_tokens=3, tokenizer=tokenizer)),  # type: ignore[arg-type]
        lambda: pipeline.generate((4, 5), 3, tokenizer=tokenizer),  # type: ignore[arg-type]
    ):
        with pytest.raises(MalformedOutput, match="tokenizer"):
            generation()
        assert _sessions(pipeline.engines) == [0, 0]


@pytest.mark.parametrize(
    "prompt",
    ["ab", b"\x04\x05", bytearray(b"\x04"), memoryview(b"\x04"), {4: 5}, {4, 5}, iter([4, 5]), 4],
)
def test_prompts_that_are_not_sequences_of_ids_are_invalid(
    pipeline: Pipeline, prompt: object
) -> None:
    # bytes iterate as byte values and a mapping as its keys: valid ids the caller never meant.
    with pytest.raises(InvalidRequest, match="sequence of token ids"):
        pipeline.stream(prompt, max_new_tokens=2)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="sequence of token ids"):
        pipeline.generate(prompt, 2)  # type: ignore[arg-type]
    assert all(engine.metrics().requests == 0 for engine in pipeline.engines)


@pytest.mark.parametrize("stops", [None, 3, "12", b"\x01"])
def test_stop_tokens_that_are_not_a_collection_are_invalid(
    pipeline: Pipeline, stops: object
) -> None:
    with pytest.raises(InvalidRequest, match="stop tokens"):
        pipeline.stream((4, 5), max_new_tokens=2, stop_tokens=stops)  # type: ignore[arg-type]
    assert all(engine.metrics().requests == 0 for engine in pipeline.engines)


def test_a_session_or_tokenizer_of_the_wrong_type_is_invalid(pipeline: Pipeline) -> None:
    with pytest.raises(InvalidRequest, match="session must be a SessionRef"):
        pipeline.stream((4, 5), max_new_tokens=2, session="chat-1")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="session must be a SessionRef"):
        pipeline.generate((4, 5), 2, session=("chat-1", 1))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="decode"):
        pipeline.stream((4, 5), max_new_tokens=2, tokenizer=object())  # type: ignore[arg-type]
    assert all(engine.metrics().requests == 0 for engine in pipeline.engines)


def test_a_batch_needs_one_position_and_token_per_session(pipeline: Pipeline) -> None:
    sessions = [SessionRef(session_id=f"s{i}", epoch=1) for i in range(2)]
    with pytest.raises(InvalidRequest, match="one position and one token per session"):
        pipeline.decode_batch(sessions, [0], [1, 2])
    with pytest.raises(InvalidRequest, match="one position and one token per session"):
        pipeline.decode_batch(sessions, [0, 0], [1, 2, 3])
    assert all(engine.metrics().requests == 0 for engine in pipeline.engines)


@pytest.mark.parametrize("stages", [[1, 2], ["engine"], "engines", None])
def test_a_pipeline_of_things_that_are_not_engines_is_invalid(stages: object) -> None:
    with pytest.raises(InvalidRequest, match=r"ShardEngine|sequence of engines"):
        Pipeline(stages)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n_layers", "n_parts"), [(6.0, 2), (6, 2.0), (True, 1), (6, True), ("6", 2), (None, 1)]
)
def test_split_layers_takes_integers_only(n_layers: object, n_parts: object) -> None:
    with pytest.raises(InvalidRequest, match="must be an integer"):
        split_layers(n_layers, n_parts)  # type: ignore[arg-type]


def test_pipelines_must_cover_every_layer_contiguously(fixture: ModelFixture) -> None:
    with _pipeline(fixture, 2) as split:
        with pytest.raises(InvalidRequest, match="start at layer 0"):
            Pipeline(split.engines[1:])
        with pytest.raises(InvalidRequest, match="at least one engine"):
            Pipeline([])
    with pytest.raises(InvalidRequest, match="choose 1 to 4"):
        split_layers(4, 5)


def test_a_failed_load_closes_what_was_loaded(fixture: ModelFixture) -> None:
    made: list[ReferenceEngine] = []

    def factory() -> ShardEngine:
        engine = ReferenceEngine()
        made.append(engine)
        return engine

    with pytest.raises(InvalidRequest):
        load_pipeline(factory, fixture, [(0, 2), (2, 9)])
    assert made
    assert all(engine.health().state == "closed" for engine in made)


def test_explicit_session(pipeline: Pipeline) -> None:
    session = SessionRef(session_id="mine", epoch=3)
    result = pipeline.generate((4, 5), 2, session=session)
    assert len(result.token_ids) == 2
    assert _sessions(pipeline.engines) == [0, 0]


@pytest.mark.parametrize("wire", [False, True])
def test_decode_is_the_step_without_its_timings(fixture: ModelFixture, wire: bool) -> None:
    """``decode`` is ``step(..., decode=True)`` minus the timings: the same logits, the same
    per-shard request ids, every shard's result observed, bundles crossing the wire."""
    seen: dict[str, list[tuple[str, int]]] = {}
    runs: dict[str, LogitsResult] = {}
    for kind in ("decode", "step"):
        log: list[tuple[str, int]] = []
        seen[kind] = log

        def observe(result: ShardResult, log: list[tuple[str, int]] = log) -> None:
            log.append((result.request_id, result.first_pos))

        engines = load_pipeline(
            ReferenceEngine, fixture, split_layers(fixture.n_layers, 3), max_sessions=4
        ).engines
        with Pipeline(
            engines,
            wire=wire,
            observe=observe,
            request_prefix="p",
        ) as pipeline:
            session = SessionRef(session_id="s", epoch=1)
            pipeline.prefill(session, 0, [4, 5, 6])
            log.clear()
            if kind == "decode":
                runs[kind] = pipeline.decode(session, 3, 7)
            else:
                runs[kind] = pipeline.step(session, 3, (7,), decode=True).logits
            assert (pipeline.wire_bytes > 0) is wire
    assert seen["decode"] == seen["step"] == [("p-2/0", 3), ("p-2/1", 3), ("p-2/2", 3)]
    assert runs["decode"].payload == runs["step"].payload
    assert runs["decode"].request_id == runs["step"].request_id == "p-2/2"


def test_decode_refuses_a_result_of_the_wrong_kind(
    pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    head, tail = pipeline.engines
    session = SessionRef(session_id="s", epoch=1)
    pipeline.prefill(session, 0, [4, 5])
    logits = pipeline.decode(session, 2, 7)
    real_head_decode = head.decode
    monkeypatch.setattr(head, "decode", lambda request: logits)
    with pytest.raises(MalformedOutput, match="shard 0 of 2 returned a LogitsResult"):
        pipeline.decode(session, 3, 7)
    monkeypatch.setattr(head, "decode", real_head_decode)
    bundle = head.decode(
        DecodeRequest(request_id="h", session=session, pos=3, inputs=TokenInput(token_ids=(7,)))
    )
    monkeypatch.setattr(tail, "decode", lambda request: bundle)
    with pytest.raises(MalformedOutput, match="shard 1 of 2 returned a BoundaryResult"):
        pipeline.decode(session, 4, 7)


def test_a_sampler_takes_sampling_settings_and_rows_of_numbers() -> None:
    for settings in ({"temperature": 1.0}, None, 0.5):
        with pytest.raises(InvalidRequest, match="sampling must be a Sampling"):
            Sampler(settings)  # type: ignore[arg-type]
    for sampler in (Sampler(), Sampler(Sampling(temperature=0.7, top_k=2))):
        for row in ("abc", [object()], [[1.0], [2.0, 3.0]], None, [], [[1.0, 2.0]]):
            with pytest.raises(MalformedOutput, match="cannot sample"):
                sampler(row)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_greedy_reads_float_rows_as_they_are_and_still_refuses_what_is_not_finite(
    dtype: type[np.floating],
) -> None:
    """Greedy picks from a float row without widening it (a float64 copy of a 262,144-entry
    row tripled the time of the pick): the same token as from the widened row, lowest id on ties,
    and MalformedOutput for NaN or an infinity wherever it stands."""
    greedy = Sampler()
    rng = np.random.default_rng(5)
    for size in (1, 2, 7, 4096):
        for _ in range(20):
            row = rng.standard_normal(size).astype(dtype)
            assert greedy(row) == greedy(row.astype(np.float64).tolist())
    ties = np.array([0.5, 2.0, 2.0, -1.0], dtype=dtype)
    assert greedy(ties) == 1
    assert greedy(np.array([-0.0, 0.0], dtype=dtype)) == 0
    for bad in (np.nan, np.inf, -np.inf):
        for where in (0, 3, 9):
            row = np.zeros(10, dtype=dtype)
            row[where] = bad
            with pytest.raises(MalformedOutput, match="not all finite"):
                greedy(row)
    for shape in ((0,), (2, 3), ()):
        with pytest.raises(MalformedOutput, match="cannot sample"):
            greedy(np.zeros(shape, dtype=dtype))
    # Other dtypes still take the widening path.
    assert greedy(np.array([1, 5, 5, 2], dtype=np.int64)) == 1


class _RefusesOneDecode(ReferenceEngine):
    """Refuses its next decode once (as a full KV budget would): nothing changes here."""

    refuse = False

    def decode(self, request: DecodeRequest) -> ShardResult:
        if self.refuse:
            self.refuse = False
            raise ResourceExhausted("refused once", details={"resource": "kv"})
        return super().decode(request)


def test_a_decode_that_fails_at_a_later_shard_is_resumed_as_a_prefill(
    fixture: ModelFixture,
) -> None:
    """The documented recovery: the head committed the step, the tail did not; a decode at
    the same position is CacheMiss on the head, a prefill there realigns every shard and
    gives the logits an unbroken run gives."""
    session = SessionRef(session_id="s", epoch=1)
    with _pipeline(fixture, 1) as whole:
        whole.prefill(session, 0, (1, 2, 3))
        expected = whole.decode(session, 3, 4).array()
    engines: list[_RefusesOneDecode] = []

    def factory() -> _RefusesOneDecode:
        engines.append(_RefusesOneDecode())
        return engines[-1]

    with load_pipeline(factory, fixture, split_layers(fixture.n_layers, 2)) as split:
        split.prefill(session, 0, (1, 2, 3))
        engines[1].refuse = True
        with pytest.raises(ResourceExhausted):
            split.decode(session, 3, 4)
        assert [e.health().kv_used_tokens for e in engines] == [4, 3]  # not atomic
        with pytest.raises(CacheMiss):
            split.decode(session, 3, 4)
        resumed = split.prefill(session, 3, (4,))
        assert [e.health().kv_used_tokens for e in engines] == [4, 4]
    np.testing.assert_array_equal(resumed.array(), expected)


@pytest.mark.parametrize(
    "options",
    [
        {"observe": 5},
        {"wire": "yes"},
        {"request_prefix": 5},
        {"request_prefix": ""},
        {"request_prefix": "x" * 300},
    ],
)
def test_pipeline_options_of_the_wrong_type_are_refused_before_any_step(
    fixture: ModelFixture, options: dict[str, object]
) -> None:
    """A non-callable observer failed with TypeError after the first shard had committed the
    step; an over-long prefix failed every step."""
    with _pipeline(fixture, 2) as built:
        with pytest.raises(InvalidRequest):
            Pipeline(built.engines, **options)  # type: ignore[arg-type]
        assert _sessions(built.engines) == [0, 0]
