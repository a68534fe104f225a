"""Fault injection: plan validation and loading, triggers, and every action's observable
effects (errors, health, metrics, events)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import msgspec
import numpy as np
import pytest
from conftest import EngineFactory, decode, decode_request, logits_of, prefill, session

import shard_engine_api as api
from shard_engine_api.engine import TEST_OPTIONS_ENV, health_problem, metrics_problem
from shard_engine_api.wire import payload_checksum
from shard_engine_fake import (
    FAULTS_ENV_VAR,
    Crash,
    Defect,
    Delay,
    FakeEngine,
    FaultPlan,
    FaultRule,
    Malformed,
    MemoryPressure,
    MemoryRelief,
    load_fault_plan,
)
from shard_engine_fake._faults import MAX_PLAN_FILE_BYTES

EXAMPLE_PLAN = {
    "seed": 7,
    "rules": [
        {"action": {"kind": "delay", "milliseconds": 5}, "operations": ["decode"], "every": 3},
        {
            "action": {"kind": "malformed", "defect": "nan"},
            "operations": ["prefill"],
            "session_id": "victim",
            "nth": 1,
        },
        {"action": {"kind": "memory_pressure", "kv_budget_tokens": 64}, "probability": 0.1},
        {"action": {"kind": "crash", "detail": "boom"}, "roles": ["tail"], "nth": 100},
    ],
}


def plan_of(*rules: FaultRule, seed: int = 0) -> dict[str, object]:
    return {"faults": FaultPlan(seed=seed, rules=rules)}


def test_example_plan_round_trips() -> None:
    plan = load_fault_plan(EXAMPLE_PLAN)
    assert plan == load_fault_plan(json.dumps(EXAMPLE_PLAN))
    assert msgspec.to_builtins(plan)["rules"][0]["action"] == {"kind": "delay", "milliseconds": 5.0}
    assert isinstance(plan.rules[1].action, Malformed)


@pytest.mark.parametrize(
    "faults",
    [
        {"rules": [{"action": {"kind": "explode"}}]},
        {"rules": [{"action": {"kind": "delay", "milliseconds": -1}}]},
        {"rules": [{"action": {"kind": "delay", "milliseconds": 1}, "nth": 0}]},
        {"rules": [{"action": {"kind": "delay", "milliseconds": 1}, "every": 0}]},
        {"rules": [{"action": {"kind": "delay", "milliseconds": 1}, "probability": 1.5}]},
        {"rules": [{"action": {"kind": "delay", "milliseconds": 1}, "operations": ["load"]}]},
        {"rules": [{"action": {"kind": "delay", "milliseconds": 1}, "sometimes": True}]},
        {"rules": [{"action": {"kind": "malformed", "defect": "nan"}, "operations": ["release"]}]},
        {"rules": [{"action": {"kind": "malformed", "defect": "sideways"}}]},
        {"rules": [{"action": {"kind": "memory_pressure", "kv_budget_tokens": -5}}]},
        {"rules": [{"action": {"kind": "crash", "exit_code": 300}}]},
        {"rules": [{"action": {"kind": "delay", "milliseconds": 1e300}}]},
        {"rules": [{"action": {"kind": "delay", "milliseconds": float("inf")}}]},
        {"rules": [{"action": {"kind": "delay", "milliseconds": float("nan")}}]},
        {"seed": "seven"},
        "{not json",
        42,
    ],
)
def test_invalid_fault_plan_is_refused_at_load(faults: object) -> None:
    engine = FakeEngine()
    config = api.LoadConfig(
        shard=api.ShardSpec(model="fake", n_layers=6, start=0, end=6), options={"faults": faults}
    )
    with pytest.raises(api.InvalidRequest):
        engine.load(config)
    assert engine.health().state == "unloaded"


def _past_its_checks(struct: object, **fields: object) -> None:
    """Set fields of a built Struct as C code can, past ``__post_init__``."""
    for name, value in fields.items():
        type(struct).__dict__[name].__set__(struct, value)


@pytest.mark.parametrize(
    ("field", "value"),
    [("milliseconds", 1e300), ("milliseconds", -1.0), ("nth", -1), ("nth", object())],
)
def test_a_plan_object_is_checked_again_at_load(field: str, value: object) -> None:
    """A FaultPlan handed over as an object gets the checks of its JSON form: a delay of
    1e300 ms set past the constructor used to load and then fail the engine at its first
    request."""
    delay = Delay(milliseconds=1.0)
    rule = FaultRule(action=delay)
    _past_its_checks(delay if field == "milliseconds" else rule, **{field: value})
    engine = FakeEngine()
    config = api.LoadConfig(
        shard=api.ShardSpec(model="fake", n_layers=6, start=0, end=6),
        options={"faults": FaultPlan(rules=(rule,))},
    )
    with pytest.raises(api.InvalidRequest, match="fault plan"):
        engine.load(config)
    assert engine.health().state == "unloaded"
    plan = FaultPlan(seed=3, rules=(FaultRule(action=Delay(milliseconds=2.0), every=2),))
    assert load_fault_plan(plan) == plan


def test_longest_delay_is_accepted() -> None:
    plan = load_fault_plan({"rules": [{"action": {"kind": "delay", "milliseconds": 86_400_000}}]})
    assert plan.rules[0].action == Delay(milliseconds=86_400_000.0)


@pytest.mark.parametrize(
    "action",
    [{"kind": "crash", "exit_code": 0}, {"kind": "crash", "abort": True}],
    ids=["exit_code", "abort"],
)
def test_process_ending_faults_in_options_need_the_owners_consent(
    action: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whoever sends a LoadConfig (a worker's caller, a served engine's client) must not be
    able to end the process; a crash that fails only the engine stays allowed."""
    monkeypatch.delenv(TEST_OPTIONS_ENV, raising=False)
    config = api.LoadConfig(
        shard=api.ShardSpec(model="fake", n_layers=6, start=0, end=6),
        options={"faults": {"rules": [{"action": {"kind": "crash"}}, {"action": action}]}},
    )
    engine = FakeEngine()
    with pytest.raises(api.InvalidRequest, match=TEST_OPTIONS_ENV) as caught:
        engine.load(config)
    assert "fault rule 1" in caught.value.message
    assert engine.health().state == "unloaded"
    monkeypatch.setenv(TEST_OPTIONS_ENV, "1")
    engine.load(config)
    engine.close()
    monkeypatch.delenv(TEST_OPTIONS_ENV)
    only_crash = msgspec.structs.replace(
        config, options={"faults": {"rules": [{"action": {"kind": "crash"}}]}}
    )
    FakeEngine().load(only_crash)


def test_plan_from_environment_file(
    make_engine: EngineFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps(EXAMPLE_PLAN))
    monkeypatch.setenv(FAULTS_ENV_VAR, str(path))
    assert make_engine().fault_plan == load_fault_plan(EXAMPLE_PLAN)
    assert make_engine(options={"faults": {}}).fault_plan == FaultPlan()
    monkeypatch.setenv(FAULTS_ENV_VAR, str(tmp_path / "missing.json"))
    with pytest.raises(api.InvalidRequest, match=FAULTS_ENV_VAR):
        make_engine()
    path.write_text("[1, 2")
    monkeypatch.setenv(FAULTS_ENV_VAR, str(path))
    with pytest.raises(api.InvalidRequest):
        make_engine()


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "huge"])
def test_a_plan_file_that_is_no_plan_file_is_refused_at_once(
    make_engine: EngineFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A FIFO without a writer (which would block the load forever), /dev/zero (read until
    memory runs out), a directory or an oversized file: InvalidRequest, the engine unloaded."""
    path = tmp_path / "faults.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path = Path("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_text(json.dumps(EXAMPLE_PLAN) + " " * MAX_PLAN_FILE_BYTES)  # valid JSON
    monkeypatch.setenv(FAULTS_ENV_VAR, str(path))
    started = time.monotonic()
    with pytest.raises(api.InvalidRequest, match=FAULTS_ENV_VAR):
        make_engine()
    assert time.monotonic() - started < 5


def test_nth_every_limit_session_and_role_triggers(make_engine: EngineFactory) -> None:
    delay = Delay(milliseconds=0)
    options = plan_of(
        FaultRule(action=delay, operations=("decode",), nth=2),
        FaultRule(action=delay, operations=("decode",), every=3, limit=2),
        FaultRule(action=delay, session_id="b"),
        FaultRule(action=delay, roles=("head",)),
    )
    engine = make_engine(options=options)
    prefill(engine, session("a"), 0, [1], request_id="pa")
    prefill(engine, session("b"), 0, [1], request_id="pb")
    for pos in range(1, 11):
        decode(engine, session("a"), pos, 1, request_id=f"d{pos}")
    events = [(event.rule, event.request_id, event.match) for event in engine.fault_events()]
    assert events == [(2, "pb", 1), (0, "d2", 2), (1, "d3", 3), (1, "d6", 6)]
    assert {event.kind for event in engine.fault_events()} == {"delay"}


def test_probability_is_seeded_and_repeatable(make_engine: EngineFactory) -> None:
    def fired(seed: int) -> list[int]:
        engine = make_engine(
            options=plan_of(FaultRule(action=Delay(milliseconds=0), probability=0.3), seed=seed)
        )
        prefill(engine, session(), 0, [1])
        for pos in range(1, 60):
            decode(engine, session(), pos, 1, request_id=f"d{pos}")
        return [event.match for event in engine.fault_events()]

    first = fired(11)
    assert first == fired(11)
    assert first != fired(12)
    assert 5 < len(first) < 35


def test_delay_holds_the_operation(make_engine: EngineFactory) -> None:
    engine = make_engine(
        options=plan_of(
            FaultRule(action=Delay(milliseconds=60), operations=("decode",)),
            FaultRule(action=Delay(milliseconds=40), operations=("release",)),
        )
    )
    prefill(engine, session(), 0, [1])
    started = time.perf_counter()
    result = decode(engine, session(), 1, 2)
    assert time.perf_counter() - started >= 0.06
    assert result.timings.compute_ms >= 60
    started = time.perf_counter()
    assert engine.release(api.ReleaseRequest(session=session())).released
    assert time.perf_counter() - started >= 0.04


def test_memory_pressure_rejects_new_work(make_engine: EngineFactory) -> None:
    engine = make_engine(
        kv_budget_tokens=100,
        options=plan_of(
            FaultRule(action=MemoryPressure(kv_budget_tokens=4), session_id="big", nth=1),
            FaultRule(action=MemoryRelief(), session_id="later"),
        ),
    )
    prefill(engine, session("small"), 0, [1, 2, 3])
    with pytest.raises(api.ResourceExhausted) as caught:
        prefill(engine, session("big"), 0, [1, 2])
    assert caught.value.details["resource"] == "kv"
    health = engine.health()
    assert health.state == "degraded"
    assert "memory pressure" in health.detail
    assert health.kv_budget_tokens == 4
    assert health.kv_used_tokens == 3
    decode(engine, session("small"), 3, 4)
    with pytest.raises(api.ResourceExhausted):
        decode(engine, session("small"), 4, 4)
    assert engine.metrics().errors == {"resource_exhausted": 2}
    prefill(engine, session("later"), 0, [1, 2])
    assert engine.health().state == "ready"
    assert engine.health().kv_budget_tokens == 100
    decode(engine, session("small"), 4, 4)


def test_memory_pressure_never_raises_the_budget_above_the_configured_one(
    make_engine: EngineFactory,
) -> None:
    """A plan asking for more than the configured budget leaves the advertised one: health
    never reports a budget or usage the capabilities do not allow (a ValidatingEngine would
    call that MalformedOutput)."""
    engine = make_engine(
        kv_budget_tokens=8,
        options=plan_of(FaultRule(action=MemoryPressure(kv_budget_tokens=1000), nth=1)),
    )
    prefill(engine, session("a"), 0, [1, 2, 3, 4, 5, 6, 7, 8])
    health = engine.health()
    assert (health.kv_budget_tokens, health.kv_used_tokens) == (8, 8)
    with pytest.raises(api.ResourceExhausted):
        prefill(engine, session("b"), 0, [1])
    limits = engine.capabilities().limits
    assert health_problem(engine.health(), limits) is None
    assert metrics_problem(engine.metrics(), limits) is None


def test_memory_pressure_with_lru_eviction(make_engine: EngineFactory) -> None:
    engine = make_engine(
        eviction="lru",
        options=plan_of(FaultRule(action=MemoryPressure(kv_budget_tokens=6), session_id="new")),
    )
    for name in ("oldest", "middle", "newest"):
        prefill(engine, session(name), 0, [1, 2, 3], request_id=name)
    decode(engine, session("oldest"), 3, 1)
    prefill(engine, session("new"), 0, [5, 5])
    with pytest.raises(api.CacheMiss) as caught:
        decode(engine, session("middle"), 3, 1)
    assert (caught.value.reason, caught.value.committed_length) == ("evicted", 0)
    with pytest.raises(api.CacheMiss):
        decode(engine, session("newest"), 3, 1)
    # The budget is full (4 + 2): one more position for "oldest" evicts the idle "new".
    decode(engine, session("oldest"), 4, 1)
    metrics = engine.metrics()
    assert metrics.evictions == 3
    assert metrics.sessions_active == 1
    assert metrics.kv_used_tokens == 5
    assert engine.health().state == "degraded"
    assert engine.capabilities().features.eviction


def test_crash_fails_the_engine(make_engine: EngineFactory) -> None:
    engine = make_engine(
        options=plan_of(
            FaultRule(action=Crash(detail="injected boom"), operations=("decode",), nth=2)
        )
    )
    prefill(engine, session(), 0, [1])
    decode(engine, session(), 1, 1)
    with pytest.raises(api.EngineCrashed, match="injected boom"):
        decode(engine, session(), 2, 1)
    health = engine.health()
    assert health.state == "failed"
    assert health.detail == "injected boom"
    for attempt in range(3):
        with pytest.raises(api.EngineCrashed):
            prefill(engine, session("other"), 0, [1], request_id=f"p{attempt}")
    # The first failure stays the reported cause however many calls are refused after it.
    assert engine.health().detail == "injected boom"
    with pytest.raises(api.EngineCrashed):
        engine.release(api.ReleaseRequest(session=session()))
    batch = api.DecodeBatchRequest(request_id="b", items=(decode_request(session(), 2, 1),))
    with pytest.raises(api.EngineCrashed):
        engine.decode_batch(batch)
    # Every refusal a caller saw: decode, three prefills, release and the batch.
    assert engine.metrics().errors["engine_crashed"] == 6


def test_crash_with_exit_code_ends_the_process(tmp_path: Path) -> None:
    plan = {"rules": [{"action": {"kind": "crash", "exit_code": 17}, "operations": ["decode"]}]}
    path = tmp_path / "faults.json"
    path.write_text(json.dumps(plan))
    code = (
        "import shard_engine_api as api\n"
        "from shard_engine_fake import FakeEngine\n"
        "e = FakeEngine()\n"
        "e.load(api.LoadConfig(shard=api.ShardSpec(model='fake', n_layers=6, start=0, end=6)))\n"
        "ref = api.SessionRef(session_id='s', epoch=1)\n"
        "e.prefill(api.PrefillRequest(request_id='p', session=ref, start_pos=0,"
        " inputs=api.TokenInput(token_ids=(1,))))\n"
        "print('prefilled', flush=True)\n"
        "e.decode(api.DecodeRequest(request_id='d', session=ref, pos=1,"
        " inputs=api.TokenInput(token_ids=(1,))))\n"
        "print('survived', flush=True)\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={FAULTS_ENV_VAR: str(path), "PATH": ""},
        timeout=60,
        check=False,
    )
    assert completed.returncode == 17, completed.stderr
    assert completed.stdout.split() == ["prefilled"]


ALL_DEFECTS: tuple[Defect, ...] = get_args(Defect)


@pytest.mark.parametrize("defect", ALL_DEFECTS)
@pytest.mark.parametrize("shard", [(0, 6), (0, 3)], ids=["logits", "bundle"])
@pytest.mark.parametrize("operation", ["prefill", "decode"])
def test_every_defect_is_caught_by_the_validation_wrapper(
    make_engine: EngineFactory, defect: Defect, shard: tuple[int, int], operation: str
) -> None:
    rule = FaultRule(action=Malformed(defect=defect), operations=("decode",), nth=1)
    if operation == "prefill":
        rule = FaultRule(action=Malformed(defect=defect), operations=("prefill",), nth=2)
    wrappers: list[api.ValidatingEngine] = []

    def wrap(inner: FakeEngine) -> api.ValidatingEngine:
        wrappers.append(api.ValidatingEngine(inner))
        return wrappers[-1]

    inner = make_engine(*shard, options=plan_of(rule), wrapper=wrap)
    engine = wrappers[0]
    prefill(engine, session(), 0, [1, 2, 3], request_id="clean")
    bad: Callable[[], api.ShardResult] = (
        (lambda: prefill(engine, session(), 3, [4, 5], request_id="bad"))
        if operation == "prefill"
        else (lambda: decode(engine, session(), 3, 4, request_id="bad"))
    )
    with pytest.raises(api.MalformedOutput):
        bad()
    # The defect was in the output only: the session advanced, and the next call is clean.
    assert inner.health().kv_used_tokens == (5 if operation == "prefill" else 4)
    decode(engine, session(), inner.health().kv_used_tokens, 1, request_id="after")


@pytest.mark.parametrize("defect", ALL_DEFECTS)
def test_each_defect_changes_exactly_what_it_names(
    make_engine: EngineFactory, defect: Defect
) -> None:
    clean_engine = make_engine(0, 3)
    faulty = make_engine(0, 3, options=plan_of(FaultRule(action=Malformed(defect=defect))))
    clean = prefill(clean_engine, session(), 0, [1, 2, 3])
    bad = prefill(faulty, session(), 0, [1, 2, 3])
    assert isinstance(clean, api.BoundaryResult)
    assert isinstance(bad, api.BoundaryResult)
    changed = {
        name
        for name in ("first_pos", "n_tokens", "evidence")
        if getattr(clean, name) != getattr(bad, name)
    }
    changed |= {
        f"bundle.{name}"
        for name in ("first_pos", "hidden_size", "dtype", "checksum", "payload")
        if getattr(clean.bundle, name) != getattr(bad.bundle, name)
    }
    expected = {
        "nan": {"bundle.payload", "bundle.checksum"},
        "wrong_shape": {"bundle.hidden_size", "bundle.payload", "bundle.checksum"},
        "wrong_dtype": {"bundle.dtype", "bundle.payload", "bundle.checksum"},
        "truncated": {"bundle.payload", "bundle.checksum"},
        "bad_checksum": {"bundle.checksum"},
        "wrong_positions": {"first_pos", "bundle.first_pos"},
        "wrong_evidence": {"evidence"},
    }
    assert changed == expected[defect]
    if defect == "nan":
        assert np.isnan(bad.bundle.array()).any()


def test_malformed_batch_items_of_one_session_only(make_engine: EngineFactory) -> None:
    inner = make_engine(
        options=plan_of(FaultRule(action=Malformed(defect="nan"), session_id="victim"))
    )
    for name in ("victim", "bystander"):
        prefill(inner, session(name), 0, [1, 2], request_id=name)

    def batch(pos: int) -> api.DecodeBatchRequest:
        return api.DecodeBatchRequest(
            request_id=f"batch{pos}",
            items=(
                decode_request(session("victim"), pos, 3, request_id="v"),
                decode_request(session("bystander"), pos, 3, request_id="b"),
            ),
        )

    victim, bystander = inner.decode_batch(batch(2)).items
    assert np.isnan(logits_of(victim).array()).any()  # type: ignore[arg-type]
    assert np.isfinite(logits_of(bystander).array()).all()  # type: ignore[arg-type]
    # Under the wrapper the bad item fails alone: the bystander's result committed and stands.
    victim, bystander = api.ValidatingEngine(inner).decode_batch(batch(3)).items
    assert isinstance(victim, api.ErrorInfo)
    assert victim.code == "malformed_output"
    assert victim.details == {"check": "finite", "item": 0}
    assert np.isfinite(logits_of(bystander).array()).all()  # type: ignore[arg-type]


def test_faults_apply_through_the_worker_visible_counters(make_engine: EngineFactory) -> None:
    engine = make_engine(
        options=plan_of(FaultRule(action=Malformed(defect="bad_checksum"), operations=("decode",)))
    )
    prefill(engine, session(), 0, [1])
    result = logits_of(decode(engine, session(), 1, 1))
    assert result.checksum != payload_checksum(result.payload)
    assert engine.metrics().decode_tokens == 1
    assert [event.kind for event in engine.fault_events()] == ["malformed"]
