"""Pipeline.generate_many on the fake engine: many sessions with their own prompts, lengths,
samplings and stop tokens give exactly the tokens and text of each run alone (in process and
over the wire), an injected fault ends only its session, and no session outlives the run."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import pytest

from shard_engine_api import (
    GenerationRequest,
    LoadConfig,
    Pipeline,
    Sampling,
    SessionRef,
    ShardEngine,
    ShardSpec,
    ValidatingEngine,
    load_tokenizer,
    split_layers,
)
from shard_engine_api.engine import Tokenizer
from shard_engine_fake import (
    FAULTS_ENV_VAR,
    Crash,
    Defect,
    FakeEngine,
    FaultPlan,
    FaultRule,
    Malformed,
)

N_LAYERS = 6


@pytest.fixture(autouse=True)
def _no_ambient_fault_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULTS_ENV_VAR, raising=False)


@pytest.fixture
def tokenizer() -> Tokenizer:
    found = load_tokenizer("fake", "fake")
    assert found is not None
    return found


def _engines(
    parts: int, *, faults: dict[int, FaultPlan] | None = None, validate: bool = False
) -> list[ShardEngine]:
    engines: list[ShardEngine] = []
    for index, (start, end) in enumerate(split_layers(N_LAYERS, parts)):
        plan = (faults or {}).get(index)
        config = LoadConfig(
            shard=ShardSpec(model="fake", n_layers=N_LAYERS, start=start, end=end),
            max_sessions=16,
            options={} if plan is None else {"faults": plan},
        )
        engine: ShardEngine = FakeEngine()
        if validate:
            engine = ValidatingEngine(engine)
        engine.load(config)
        engines.append(engine)
    return engines


@pytest.fixture
def pipeline() -> Iterator[Pipeline]:
    with Pipeline(_engines(3), wire=True) as built:
        yield built


def _requests(tokenizer: Tokenizer) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            prompt_ids=tuple(tokenizer.encode(f"The quick brown fox #{index}" * (1 + index % 3))),
            max_new_tokens=3 + (index * 5) % 11,
            sampling=Sampling() if index % 2 else Sampling(temperature=0.8, top_p=0.9, seed=index),
            stop_tokens=tuple(range(index % 5, 256, 5)) if index % 3 == 2 else (),
            session=SessionRef(session_id=f"session-{index}", epoch=1),
        )
        for index in range(10)
    ]


def _sessions(engines: Sequence[ShardEngine]) -> list[int]:
    return [engine.health().sessions for engine in engines]


def _alone(
    pipeline: Pipeline, request: GenerationRequest, tokenizer: Tokenizer
) -> tuple[tuple[int, ...], tuple[bytes, ...], str | None]:
    alone = pipeline.generate(
        request.prompt_ids,
        request.max_new_tokens,
        sampling=request.sampling,
        stop_tokens=request.stop_tokens,
        tokenizer=tokenizer,
    )
    return alone.token_ids, alone.step_logits, alone.text


@pytest.mark.parametrize("wire", [False, True])
def test_each_session_equals_its_run_alone(tokenizer: Tokenizer, wire: bool) -> None:
    requests = _requests(tokenizer)
    with Pipeline(_engines(3), wire=wire) as pipeline:
        many = pipeline.generate_many(requests, 0, tokenizer=tokenizer)
        assert _sessions(pipeline.engines) == [0, 0, 0]
        for request, entry in zip(requests, many.sessions, strict=True):
            assert entry.error is None
            result = entry.result
            assert (result.token_ids, result.step_logits, result.text) == _alone(
                pipeline, request, tokenizer
            )
    assert {entry.result.finish_reason for entry in many.sessions} == {"stop", "length"}
    assert (many.wire_bytes > 0) == wire
    assert all(stage.max_batch > 1 for stage in many.stages)


@pytest.mark.parametrize(
    ("shard", "defect", "code", "error_shard"),
    [
        (2, "nan", "malformed_output", None),  # the tail's row cannot be sampled
        (0, "bad_checksum", "checksum_mismatch", 1),  # the next shard refuses the bundle
    ],
)
def test_an_injected_fault_ends_only_its_session(
    tokenizer: Tokenizer, shard: int, defect: Defect, code: str, error_shard: int | None
) -> None:
    """The fault plan corrupts one session's results in batched decodes on one shard: that
    session ends with the error, the nine others are exactly what they are alone."""
    requests = _requests(tokenizer)
    victim = requests[4].session
    assert victim is not None
    plan = FaultPlan(
        rules=(
            FaultRule(
                action=Malformed(defect=defect),
                operations=("decode_batch",),
                session_id=victim.session_id,
            ),
        )
    )
    with Pipeline(_engines(3, faults={shard: plan}), wire=True) as pipeline:
        many = pipeline.generate_many(requests, 0, tokenizer=tokenizer)
        assert _sessions(pipeline.engines) == [0, 0, 0]
    assert [entry.index for entry in many.failed()] == [4]
    failed = many.sessions[4]
    assert failed.error is not None
    assert failed.error.code == code
    assert failed.error_shard == error_shard
    with Pipeline(_engines(3), wire=True) as clean:
        for index, (request, entry) in enumerate(zip(requests, many.sessions, strict=True)):
            if index != 4:
                result = entry.result
                assert (result.token_ids, result.step_logits, result.text) == _alone(
                    clean, request, tokenizer
                )


def test_a_validated_pipeline_turns_a_malformed_item_into_that_sessions_error(
    tokenizer: Tokenizer,
) -> None:
    requests = _requests(tokenizer)
    plan = FaultPlan(
        rules=(
            FaultRule(
                action=Malformed(defect="wrong_positions"),
                operations=("decode_batch",),
                session_id="session-7",
            ),
        )
    )
    with Pipeline(_engines(3, faults={1: plan}, validate=True)) as pipeline:
        many = pipeline.generate_many(requests, 0, tokenizer=tokenizer)
        assert _sessions(pipeline.engines) == [0, 0, 0]
    assert [entry.index for entry in many.failed()] == [7]
    assert many.sessions[7].error_shard == 1


def test_a_crashed_shard_fails_every_session_and_the_others_release_them(
    tokenizer: Tokenizer,
) -> None:
    plan = FaultPlan(rules=(FaultRule(action=Crash(), operations=("decode_batch",), nth=2),))
    engines = _engines(3, faults={1: plan})
    with Pipeline(engines) as pipeline:
        many = pipeline.generate_many(_requests(tokenizer), 0, tokenizer=tokenizer)
        assert {entry.error.code for entry in many.failed() if entry.error} == {"engine_crashed"}
        assert len(many.failed()) == len(many.sessions)
        assert [engine.health().sessions for engine in (engines[0], engines[2])] == [0, 0]


def test_the_async_counterpart_on_the_fake(pipeline: Pipeline, tokenizer: Tokenizer) -> None:
    requests = _requests(tokenizer)
    many = asyncio.run(pipeline.agenerate_many(requests, 0, tokenizer=tokenizer))
    for request, entry in zip(requests, many.sessions, strict=True):
        result = entry.result
        assert (result.token_ids, result.step_logits, result.text) == _alone(
            pipeline, request, tokenizer
        )
    assert _sessions(pipeline.engines) == [0, 0, 0]
