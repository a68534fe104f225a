"""Many sessions through one pipeline at once (Pipeline.generate_many and agenerate_many): each
session gets exactly what it gets alone, a failing session ends alone, every session is
released on every exit, and decodes that meet at a shard are one decode_batch."""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from conformance_engines import ReferenceEngine, reference_fixture

from shard_engine_api import (
    DecodeBatchRequest,
    DecodeBatchResult,
    DecodeRequest,
    ErrorInfo,
    GeneratedToken,
    GenerationRequest,
    InvalidRequest,
    ManyGenerationResult,
    Pipeline,
    ReleaseRequest,
    ResourceExhausted,
    Sampling,
    SessionRef,
    ShardEngine,
    ShardResult,
    StaleEpoch,
    load_pipeline,
    split_layers,
)
from shard_engine_api._stages import SessionsRun
from shard_engine_api.engine import ModelFixture

# Prompts of the toy model's vocabulary (32 ids), of different lengths, with different lengths
# to generate, samplings and stop tokens: every session differs from every other.
REQUESTS = tuple(
    GenerationRequest(
        prompt_ids=tuple((index * 7 + offset) % 32 for offset in range(1 + index % 4)),
        max_new_tokens=2 + (index * 3) % 7,
        sampling=Sampling(temperature=0.0)
        if index % 3 == 0
        else Sampling(temperature=0.9, top_k=8, seed=index),
        stop_tokens=tuple(range(index % 3, 32, 3)) if index % 4 == 1 else (),
    )
    for index in range(9)
)


@pytest.fixture
def fixture(tmp_path: Path) -> ModelFixture:
    return reference_fixture(tmp_path)


def _pipeline(
    fixture: ModelFixture, parts: int, *, wire: bool = False, max_batch_tokens: int = 512
) -> Pipeline:
    return load_pipeline(
        ReferenceEngine,
        fixture,
        split_layers(fixture.n_layers, parts),
        wire=wire,
        max_sessions=16,
        max_batch_tokens=max_batch_tokens,
    )


@pytest.fixture
def pipeline(fixture: ModelFixture) -> Iterator[Pipeline]:
    with _pipeline(fixture, 3) as built:
        yield built


def _sessions(engines: Sequence[ShardEngine]) -> list[int]:
    return [engine.health().sessions for engine in engines]


def _alone(pipeline: Pipeline, request: GenerationRequest, *, keep_logits: bool = True) -> object:
    if keep_logits:
        return pipeline.generate(
            request.prompt_ids,
            request.max_new_tokens,
            sampling=request.sampling,
            stop_tokens=request.stop_tokens,
        )
    with pipeline.stream(
        request.prompt_ids,
        max_new_tokens=request.max_new_tokens,
        sampling=request.sampling,
        stop_tokens=request.stop_tokens,
    ) as stream:
        return tuple(token.token_id for token in stream)


def _assert_each_equals_alone(pipeline: Pipeline, many: ManyGenerationResult) -> None:
    assert [entry.index for entry in many.sessions] == list(range(len(REQUESTS)))
    for request, entry in zip(REQUESTS, many.sessions, strict=True):
        assert entry.error is None
        alone = pipeline.generate(
            request.prompt_ids,
            request.max_new_tokens,
            sampling=request.sampling,
            stop_tokens=request.stop_tokens,
        )
        assert entry.result.token_ids == alone.token_ids
        assert entry.result.step_logits == alone.step_logits  # bit for bit
        assert entry.result.finish_reason == alone.finish_reason
        assert entry.result.prompt_ids == request.prompt_ids


@pytest.mark.parametrize("wire", [False, True])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_each_session_gets_what_it_gets_alone(
    fixture: ModelFixture, parts: int, wire: bool
) -> None:
    with _pipeline(fixture, parts, wire=wire) as pipeline:
        many = pipeline.generate_many(REQUESTS, 0)
        _assert_each_equals_alone(pipeline, many)
        assert _sessions(pipeline.engines) == [0] * parts
    assert many.generated_tokens == sum(len(entry.result.token_ids) for entry in many.sessions)
    assert {entry.result.finish_reason for entry in many.sessions} == {"stop", "length"}
    assert (many.wire_bytes > 0) == (wire and parts > 1)
    assert many.wire_bytes == sum(entry.result.wire_bytes for entry in many.sessions)
    # The decodes of a group met at each shard as one batch.
    assert all(stage.max_batch > 1 for stage in many.stages)
    assert [stage.items for stage in many.stages] == [many.stages[0].items] * parts


@pytest.mark.parametrize(("max_in_flight", "groups"), [(1, None), (2, None), (4, 1), (9, 9)])
def test_bounded_sessions_in_flight_and_groups(
    pipeline: Pipeline, max_in_flight: int, groups: int | None
) -> None:
    """At most ``max_in_flight`` sessions hold state at once (the others start as sessions
    end), in ``groups`` batches: the tokens are the same whatever the shape."""
    seen: list[int] = []

    def count(index: int, token: GeneratedToken) -> None:
        seen.append(max(_sessions(pipeline.engines)))

    many = pipeline.generate_many(
        REQUESTS, 0, max_in_flight=max_in_flight, groups=groups, on_token=count
    )
    _assert_each_equals_alone(pipeline, many)
    assert max(seen) <= max_in_flight
    assert max(stage.max_batch for stage in many.stages) <= max_in_flight
    if groups == 1:
        assert many.stages[0].max_batch == max_in_flight
    assert _sessions(pipeline.engines) == [0, 0, 0]


def test_plain_prompts_take_the_calls_settings(pipeline: Pipeline) -> None:
    prompts = [(1, 2), (3,), (4, 5, 6)]
    sampling = Sampling(temperature=0.7, seed=3)
    many = pipeline.generate_many(prompts, 5, sampling=sampling, stop_tokens=[9])
    for prompt, entry in zip(prompts, many.sessions, strict=True):
        alone = pipeline.generate(prompt, 5, sampling=sampling, stop_tokens=[9])
        assert entry.result.token_ids == alone.token_ids
        assert entry.result.step_logits == alone.step_logits


def test_without_logits_each_session_gets_what_its_stream_gets(pipeline: Pipeline) -> None:
    many = pipeline.generate_many(REQUESTS, 0, keep_logits=False)
    for request, entry in zip(REQUESTS, many.sessions, strict=True):
        assert entry.result.token_ids == _alone(pipeline, request, keep_logits=False)
        assert entry.result.step_logits == ()


def test_tokens_arrive_in_order_with_positions_and_latencies(pipeline: Pipeline) -> None:
    arrived: dict[int, list[GeneratedToken]] = {}

    def collect(index: int, token: GeneratedToken) -> None:
        arrived.setdefault(index, []).append(token)

    many = pipeline.generate_many(REQUESTS, 0, on_token=collect)
    for request, entry in zip(REQUESTS, many.sessions, strict=True):
        tokens = arrived.get(entry.index, [])
        assert tuple(token.token_id for token in tokens) == entry.result.token_ids
        assert [token.position for token in tokens] == [
            len(request.prompt_ids) + offset for offset in range(len(tokens))
        ]
        assert len(entry.token_ms) == max(0, len(tokens) - 1)
        assert all(latency >= 0 for latency in entry.token_ms)
        assert entry.first_token_ms >= 0
        assert entry.queued_ms >= 0
        assert len(entry.result.shard_timings) == 3
    assert len(many.token_ms()) == sum(len(entry.token_ms) for entry in many.sessions)
    assert many.wall_ms > 0
    assert many.tokens_per_s > 0
    assert all(stage.busy_ms > 0 and stage.calls > 0 for stage in many.stages)


def test_a_shards_batch_limit_is_respected(fixture: ModelFixture) -> None:
    with _pipeline(fixture, 2, max_batch_tokens=4) as pipeline:
        many = pipeline.generate_many(REQUESTS, 0, groups=1)
        _assert_each_equals_alone(pipeline, many)
    assert [stage.max_batch for stage in many.stages] == [4, 4]


def test_explicit_sessions_are_used_and_released(pipeline: Pipeline) -> None:
    requests = [
        GenerationRequest(
            prompt_ids=(1, 2), max_new_tokens=3, session=SessionRef(session_id=name, epoch=4)
        )
        for name in ("a", "b")
    ]
    many = pipeline.generate_many(requests, 0)
    assert [entry.session.session_id for entry in many.sessions] == ["a", "b"]
    assert _sessions(pipeline.engines) == [0, 0, 0]
    with pytest.raises(StaleEpoch):  # released at epoch 4: fenced
        pipeline.prefill(SessionRef(session_id="a", epoch=4), 0, (1,))


class _RefusesVictim(ReferenceEngine):
    """Refuses every decode of session "victim" as a full KV budget would, alone or in a
    batch (where it is that item's error; the other items run)."""

    def decode(self, request: DecodeRequest) -> ShardResult:
        if request.session.session_id == "victim":
            raise ResourceExhausted("no room for the victim", details={"resource": "kv"})
        return super().decode(request)

    def decode_batch(self, request: DecodeBatchRequest) -> DecodeBatchResult:
        others = tuple(item for item in request.items if item.session.session_id != "victim")
        if len(others) == len(request.items):
            return super().decode_batch(request)
        refused = ResourceExhausted("no room for the victim", details={"resource": "kv"})
        done = (
            list(
                super()
                .decode_batch(DecodeBatchRequest(request_id=request.request_id, items=others))
                .items
            )
            if others
            else []
        )
        items: list[ShardResult | ErrorInfo] = []
        for item in request.items:
            items.append(refused.to_info() if item.session.session_id == "victim" else done.pop(0))
        return DecodeBatchResult(request_id=request.request_id, items=tuple(items))


@pytest.mark.parametrize("wire", [False, True])
def test_a_failing_session_ends_alone(fixture: ModelFixture, wire: bool) -> None:
    """The middle shard refuses one session's decodes: that session ends with the error
    (naming the shard) after its first token, every other session gets what it gets alone,
    and every session is released on every shard."""
    engines: list[ShardEngine] = []

    def factory() -> ShardEngine:
        engines.append(_RefusesVictim() if len(engines) == 1 else ReferenceEngine())
        return engines[-1]

    victim = GenerationRequest(
        prompt_ids=(3, 4), max_new_tokens=6, session=SessionRef(session_id="victim", epoch=1)
    )
    requests = [*REQUESTS[:4], victim, *REQUESTS[4:]]
    ranges = split_layers(fixture.n_layers, 3)
    with load_pipeline(factory, fixture, ranges, wire=wire, max_sessions=16) as pipeline:
        many = pipeline.generate_many(requests, 0)
        assert _sessions(pipeline.engines) == [0, 0, 0]
    failed = many.sessions[4]
    assert many.failed() == (failed,)
    assert failed.error is not None
    assert failed.error.code == "resource_exhausted"
    assert failed.error_shard == 1
    assert len(failed.result.token_ids) == 1  # the prefill's token, then the refused decode
    with pytest.raises(ResourceExhausted, match="victim"):
        failed.raise_error()
    with _pipeline(fixture, 3) as reference:
        others = [entry for entry in many.sessions if entry.index != 4]
        for request, entry in zip(REQUESTS, others, strict=True):
            alone = reference.generate(
                request.prompt_ids,
                request.max_new_tokens,
                sampling=request.sampling,
                stop_tokens=request.stop_tokens,
            )
            assert entry.error is None
            assert entry.result.token_ids == alone.token_ids
            assert entry.result.step_logits == alone.step_logits


def test_a_session_fenced_by_another_worker_ends_alone(pipeline: Pipeline) -> None:
    """Another caller releases one session on the middle shard while the run goes on: its next
    step there is StaleEpoch, its own error; the others are untouched."""
    victim = SessionRef(session_id="fenced", epoch=1)

    def fence(index: int, token: GeneratedToken) -> None:
        if index == 0 and token.position == 2:
            pipeline.engines[1].release(ReleaseRequest(session=victim))

    requests = [
        GenerationRequest(prompt_ids=(1, 2), max_new_tokens=8, session=victim),
        *REQUESTS,
    ]
    many = pipeline.generate_many(requests, 0, on_token=fence)
    fenced = many.sessions[0]
    assert fenced.error is not None
    assert fenced.error.code == "stale_epoch"
    assert fenced.error_shard == 1
    assert [entry.index for entry in many.failed()] == [0]
    assert _sessions(pipeline.engines) == [0, 0, 0]


class _Boom(Exception):
    pass


def test_a_callback_that_raises_ends_the_run_and_releases_every_session(
    pipeline: Pipeline,
) -> None:
    def explode(index: int, token: GeneratedToken) -> None:
        if index == 2:
            raise _Boom

    with pytest.raises(_Boom):
        pipeline.generate_many(REQUESTS, 0, on_token=explode)
    assert _sessions(pipeline.engines) == [0, 0, 0]
    # The pipeline is as good as before.
    _assert_each_equals_alone(pipeline, pipeline.generate_many(REQUESTS, 0))


def _one_group_run(
    pipeline: Pipeline,
    requests: Sequence[GenerationRequest],
    on_token: Callable[[int, GeneratedToken], None] | None,
) -> SessionsRun:
    """A greedy run of ``requests`` with default groups, keeping logits, not yet started."""
    return SessionsRun(
        pipeline,
        requests,
        0,
        sampling=Sampling(),
        stop_tokens=(),
        tokenizer=None,
        max_in_flight=None,
        groups=None,
        keep_logits=True,
        on_token=on_token,
    )


def _signal_state(tmp_path: Path) -> str:
    """What decides whether a SIGINT sent to the main thread becomes a KeyboardInterrupt
    there: the Python handler, the main thread's blocked, pending and ignored signals (Linux),
    and where every thread is."""
    lines = [f"SIGINT handler: {signal.getsignal(signal.SIGINT)!r}"]
    status = Path(f"/proc/self/task/{threading.main_thread().native_id}/status")
    if status.exists():
        lines += [
            f"main thread {line}"
            for line in status.read_text().splitlines()
            if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
        ]
    dump = tmp_path / "threads.txt"
    with dump.open("w") as out:
        faulthandler.dump_traceback(out, all_threads=True)
    return "\n".join([*lines, dump.read_text()])


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX signals")
def test_ctrl_c_stops_the_run_and_releases_every_session(
    pipeline: Pipeline, tmp_path: Path
) -> None:
    """A real SIGINT while the caller waits: the calls in flight are cancelled, every session
    is released on every shard, then KeyboardInterrupt reaches the caller. The test sets
    Python's own SIGINT handler and unblocks the signal in the main thread for its duration
    (what a terminal's Ctrl-C meets in a program), whatever the test runner left there; if
    the interrupt has not reached the run within 20 s it fails with the signal state."""
    run: SessionsRun | None = None
    unseen: list[str] = []

    def interrupt(index: int, token: GeneratedToken) -> None:
        if index == 0 and token.position == 1:
            # To the main thread itself: a signal another thread took would not wake its wait.
            main = threading.main_thread().ident
            assert main is not None
            signal.pthread_kill(main, signal.SIGINT)
            # Hold the tail until the caller has seen it, so the run cannot end first.
            deadline = time.monotonic() + 20
            while run is not None and not run._stopping:
                if time.monotonic() > deadline:
                    unseen.append(_signal_state(tmp_path))
                    return
                time.sleep(0.001)

    requests = [GenerationRequest(prompt_ids=(1,), max_new_tokens=200), *REQUESTS]
    run = _one_group_run(pipeline, requests, interrupt)
    assert threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        with pytest.raises(KeyboardInterrupt):
            run.run()
    except BaseException:
        if unseen:
            pytest.fail(f"the SIGINT never reached the run:\n{unseen[0]}")
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, handler)
    assert _sessions(pipeline.engines) == [0, 0, 0]


@pytest.mark.parametrize("started", [0, 1, 2, 3])
def test_an_interrupt_while_the_stages_start_leaves_nothing_behind(
    pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, started: int
) -> None:
    """A KeyboardInterrupt that reaches the caller while the stage threads are being started
    (once ``started`` of the 3 are running): no engine was touched before every stage had
    started, so the run raises at once, holds no session on any shard, and every stage it
    started ends."""
    real_start = threading.Thread.start
    stages: list[threading.Thread] = []

    def start(thread: threading.Thread) -> None:
        if not thread.name.startswith("shard-engine-stage-"):
            real_start(thread)
            return
        if len(stages) == started:
            raise KeyboardInterrupt
        stages.append(thread)
        real_start(thread)
        if len(stages) == started == 3:
            raise KeyboardInterrupt  # as the last start returns

    monkeypatch.setattr(threading.Thread, "start", start)
    run = _one_group_run(pipeline, REQUESTS, None)
    with pytest.raises(KeyboardInterrupt):
        run.run()
    monkeypatch.undo()
    for stage in stages:
        stage.join(timeout=60)
        assert not stage.is_alive()
    assert _sessions(pipeline.engines) == [0, 0, 0]
    assert [engine.metrics().requests for engine in pipeline.engines] == [0, 0, 0]
    # The pipeline serves the next run as before.
    assert not pipeline.generate_many(REQUESTS[:2], 0).failed()


def test_async_counterpart_gives_the_same_sessions(pipeline: Pipeline) -> None:
    many = asyncio.run(pipeline.agenerate_many(REQUESTS, 0))
    _assert_each_equals_alone(pipeline, many)
    assert _sessions(pipeline.engines) == [0, 0, 0]


def test_cancelling_the_async_task_releases_every_session(pipeline: Pipeline) -> None:
    async def main() -> None:
        task: asyncio.Task[ManyGenerationResult] | None = None
        loop = asyncio.get_running_loop()

        def cancel(index: int, token: GeneratedToken) -> None:
            if index == 0 and token.position == 1 and task is not None:
                loop.call_soon_threadsafe(task.cancel)

        requests = [GenerationRequest(prompt_ids=(1,), max_new_tokens=200), *REQUESTS]
        task = asyncio.ensure_future(pipeline.agenerate_many(requests, 0, on_token=cancel))
        with pytest.raises(asyncio.CancelledError):
            await task
        # Ended only after every session was released.
        assert _sessions(pipeline.engines) == [0, 0, 0]

    asyncio.run(main())


def test_no_prompts_is_an_empty_run(pipeline: Pipeline) -> None:
    many = pipeline.generate_many([], 4)
    assert many.sessions == ()
    assert many.generated_tokens == 0
    assert many.tokens_per_s == 0.0
    assert len(many.stages) == 3


def test_zero_new_tokens_prefills_only(pipeline: Pipeline) -> None:
    many = pipeline.generate_many([(1, 2), (3,)], 0)
    for entry, prompt in zip(many.sessions, [(1, 2), (3,)], strict=True):
        assert entry.result.token_ids == ()
        assert entry.result.step_logits == pipeline.generate(prompt, 0).step_logits


@pytest.mark.parametrize(
    ("prompts", "options"),
    [
        ("abc", {}),
        ([(1, 2), ()], {}),
        ([(1, 2), "ab"], {}),
        ([(1, 2)], {"max_in_flight": 0}),
        ([(1, 2)], {"groups": True}),
        ([(1, 2)], {"keep_logits": "yes"}),
        ([(1, 2)], {"on_token": 5}),
        ([(1, 2)], {"stop_tokens": [1.5]}),
        ([(1, 2)], {"sampling": "greedy"}),
        (
            [
                GenerationRequest(
                    prompt_ids=(1,),
                    max_new_tokens=2,
                    session=SessionRef(session_id="same", epoch=1),
                ),
                GenerationRequest(
                    prompt_ids=(2,),
                    max_new_tokens=2,
                    session=SessionRef(session_id="same", epoch=1),
                ),
            ],
            {},
        ),
        ([GenerationRequest(prompt_ids=(1,), max_new_tokens=-1)], {}),
        ([(1,) * 5000], {}),
    ],
)
def test_bad_runs_are_refused_before_any_work(
    pipeline: Pipeline, prompts: object, options: dict[str, object]
) -> None:
    before = [engine.metrics() for engine in pipeline.engines]
    with pytest.raises(InvalidRequest):
        pipeline.generate_many(prompts, 4, **options)  # type: ignore[arg-type]
    assert [engine.metrics() for engine in pipeline.engines] == before
