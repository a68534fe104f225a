"""A worker-style scenario: a 3-shard pipeline serving concurrent sessions from threads while
faults are injected; sessions the faults do not touch must produce exactly the fault-free
outputs, and the touched ones recover by the contract's own means (truncate and replay)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest
from conftest import EngineFactory, session

import shard_engine_api as api
from shard_engine_fake import Delay, FakeEngine, FaultPlan, FaultRule, Malformed
from shard_engine_fake.pipeline import Generation, generate, step

RANGES = [(0, 2), (2, 4), (4, 6)]
N_SESSIONS = 6
N_TOKENS = 8


def prompt_of(index: int) -> list[int]:
    return [(index * 37 + offset * 11) % 512 for offset in range(3 + index)]


def serve(engines: Sequence[api.ShardEngine], ref: api.SessionRef, prompt: list[int]) -> Generation:
    """Greedy generation as a worker does it: a step whose output fails validation is replayed
    as a prefill at the same position on every shard (which truncates the bad step away)."""
    sid = ref.session_id
    result = step(engines, ref, 0, prompt, request_id=f"{sid}/prefill")
    logits = [np.array(result.array()[-1])]
    tokens: list[int] = []
    pos = len(prompt)
    for index in range(N_TOKENS):
        token = int(np.argmax(logits[-1]))
        tokens.append(token)
        request_id = f"{sid}/{index}"
        try:
            result = step(engines, ref, pos, [token], request_id=request_id, decode=True)
        except api.MalformedOutput:
            result = step(engines, ref, pos, [token], request_id=f"{request_id}/replay")
        logits.append(np.array(result.array()[-1]))
        pos += 1
    return Generation(tokens=tuple(tokens), logits=tuple(logits))


def test_concurrent_sessions_through_a_faulty_pipeline(make_engine: EngineFactory) -> None:
    reference = [make_engine(start, end) for start, end in RANGES]
    expected = {
        f"s{index}": generate(reference, session(f"s{index}"), prompt_of(index), N_TOKENS)
        for index in range(N_SESSIONS)
    }
    plan = FaultPlan(
        rules=(
            FaultRule(action=Delay(milliseconds=2), session_id="s1", roles=("middle",), every=2),
            FaultRule(
                action=Malformed(defect="nan"),
                operations=("decode",),
                session_id="s2",
                roles=("tail",),
                nth=3,
            ),
            FaultRule(
                action=Malformed(defect="bad_checksum"),
                operations=("decode",),
                session_id="s3",
                roles=("head",),
                every=4,
            ),
        )
    )
    wrapped: list[api.ValidatingEngine] = []

    def wrap(inner: FakeEngine) -> api.ValidatingEngine:
        wrapped.append(api.ValidatingEngine(inner))
        return wrapped[-1]

    inners = [
        make_engine(start, end, options={"faults": plan}, wrapper=wrap) for start, end in RANGES
    ]
    results: dict[str, Generation] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(N_SESSIONS)

    def worker(index: int) -> None:
        barrier.wait()
        try:
            results[f"s{index}"] = serve(wrapped, session(f"s{index}"), prompt_of(index))
        except BaseException as error:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(N_SESSIONS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    for sid, want in expected.items():
        got = results[sid]
        assert got.tokens == want.tokens, sid
        assert all(
            a.tobytes() == b.tobytes() for a, b in zip(got.logits, want.logits, strict=True)
        ), sid
    fired = {(event.kind, event.operation) for inner in inners for event in inner.fault_events()}
    assert fired == {("delay", "decode"), ("malformed", "decode")}
    assert sum(inner.metrics().errors.get("malformed_output", 0) for inner in inners) == 0
    assert [inner.health().state for inner in inners] == ["ready"] * 3
    tail_events = inners[2].fault_events()
    assert [(event.request_id, event.match) for event in tail_events] == [("s2/2/2", 3)]


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_sessions_on_a_pipeline_match_a_full_shard(make_engine: EngineFactory, dtype: str) -> None:
    full = make_engine(boundary_dtype=dtype)
    shards = [make_engine(start, end, boundary_dtype=dtype) for start, end in RANGES]
    for index in range(3):
        ref = session(f"s{index}")
        one = generate([full], ref, prompt_of(index), 4, request_prefix=f"f{index}")
        split = generate(shards, ref, prompt_of(index), 4, request_prefix=f"p{index}")
        assert one.tokens == split.tokens
