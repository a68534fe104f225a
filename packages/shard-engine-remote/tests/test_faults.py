"""A worker survives its engine: children killed, aborted, stopped, terminated and replaced;
servers that die mid-call; RPC deadlines that become engine cancels."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
import typing
from pathlib import Path

import grpc
import pytest
from conftest import (
    Background,
    RemoteFactory,
    ServeFactory,
    config,
    decode,
    delay,
    prefill,
    ref,
    wait_until,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

import shard_engine_api as api
from shard_engine_remote import SERVICE_NAME, OutcomeUnknown, RemoteEngine, RemoteUnavailable
from shard_engine_remote._wire import CALL_METHOD, decode_reply, encode_request


def _in_flight(engine: api.ShardEngine) -> bool:
    return engine.health().in_flight >= 1


def _child_pid(engine: RemoteEngine) -> int:
    pid = engine.child_pid
    assert pid is not None
    return pid


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped: kill() returns before the signal takes
    effect, and a process still running would answer the next call."""

    def stopped() -> bool:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")

    os.kill(pid, signal.SIGSTOP)
    wait_until(stopped)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGABRT])
def test_child_killed_mid_decode_is_engine_crashed(
    remote: RemoteFactory, sig: int, transport: str
) -> None:
    """kill -9 (or an abort) of the child while a decode runs: the decode, every later call
    raise EngineCrashed naming the signal; health says failed; this process lives on."""
    engine = remote(config(spawn="fake", transport=transport, faults=delay("decode", 5000)))
    prefill(engine)
    pid = _child_pid(engine)
    pending = Background(lambda: decode(engine, 3))
    wait_until(lambda: _in_flight(engine))
    os.kill(pid, sig)
    name = signal.Signals(sig).name
    with pytest.raises(api.EngineCrashed, match=name) as caught:
        pending.result()
    assert caught.value.details["signal"] == name
    assert caught.value.details["pid"] == pid
    with pytest.raises(api.EngineCrashed, match=name):
        prefill(engine, session="other")
    with pytest.raises(api.EngineCrashed):
        engine.release(api.ReleaseRequest(session=api.SessionRef(session_id="s", epoch=1)))
    health = engine.health()
    assert health.state == "failed"
    assert name in health.detail
    with pytest.raises(api.EngineCrashed):
        engine.cancel(api.CancelRequest(request_id="x"))
    with pytest.raises(api.EngineCrashed):
        engine.capabilities()
    engine.metrics()  # never raises


def test_child_exit_code_is_reported(remote: RemoteFactory, transport: str) -> None:
    """A child that exits on its own (an injected os._exit) is EngineCrashed with its code."""
    plan = {"rules": [{"action": {"kind": "crash", "exit_code": 7}, "operations": ["decode"]}]}
    engine = remote(config(spawn="fake", transport=transport, faults=plan))
    prefill(engine)
    with pytest.raises(api.EngineCrashed, match="exited with code 7") as caught:
        decode(engine, 3)
    assert caught.value.details["exit_code"] == 7


def test_engine_abort_is_engine_crashed(remote: RemoteFactory, transport: str) -> None:
    """An engine that calls abort() mid-prefill (what a failed GGML_ASSERT does): the child
    dies of SIGABRT, this process sees EngineCrashed naming it."""
    plan = {"rules": [{"action": {"kind": "crash", "abort": True}, "operations": ["prefill"]}]}
    engine = remote(config(spawn="fake", transport=transport, faults=plan))
    with pytest.raises(api.EngineCrashed, match="SIGABRT") as caught:
        prefill(engine)
    assert caught.value.details["signal"] == "SIGABRT"
    assert engine.health().state == "failed"


def test_stopped_child_meets_client_deadlines(remote: RemoteFactory, transport: str) -> None:
    """A SIGSTOP'd child answers nothing: a decode fails at its deadline as OutcomeUnknown
    (it may have run), health and metrics answer at theirs, and after SIGCONT the session
    carries on from wherever the decode left it."""
    engine = remote(config(spawn="fake", transport=transport, timeout_s=0.5, control_timeout_s=0.5))
    prefill(engine)
    pid = _child_pid(engine)
    _stop(pid)
    try:
        started = time.monotonic()
        with pytest.raises(OutcomeUnknown) as caught:
            decode(engine, 3)
        assert time.monotonic() - started < 5.0
        assert caught.value.retryable
        assert caught.value.details["reason"] == "deadline_exceeded"
        health = engine.health()
        assert health.state == "failed"
        assert "unreachable" in health.detail
        engine.metrics()
        assert engine.cancel(api.CancelRequest(request_id="d")).cancelled is False
        assert engine.capabilities().shard.end == 6, "capabilities are cached at load"
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: engine.health().state == "ready")
    try:
        outcome: object = decode(engine, 3, request_id="again")
    except api.CacheMiss as miss:
        outcome = miss.committed_length
    # The timed-out decode either ran (position 3 is committed) or not (it runs now).
    assert isinstance(outcome, api.LogitsResult) or outcome == 4
    assert engine.health().state == "ready"


def test_restart_policy_replaces_a_dead_child(remote: RemoteFactory, transport: str) -> None:
    """With restart on-crash the call in flight still fails (EngineCrashed), the next request
    runs on a fresh child, where the old sessions are unknown (CacheMiss: replay), and health
    is degraded because the dead child's release fences are gone."""
    engine = remote(config(spawn="fake", transport=transport, restart="on-crash", max_restarts=1))
    prefill(engine)
    first = _child_pid(engine)
    os.kill(first, signal.SIGKILL)
    with pytest.raises(api.EngineCrashed, match="SIGKILL"):
        decode(engine, 3)
    assert engine.health().state == "degraded"
    with pytest.raises(api.CacheMiss) as caught:
        decode(engine, 3)
    assert caught.value.committed_length == 0
    second = _child_pid(engine)
    assert second != first
    assert engine.restarts == 1
    prefill(engine)
    decode(engine, 3)
    health = engine.health()
    assert health.state == "degraded"
    assert "fences" in health.detail
    os.kill(second, signal.SIGKILL)
    with pytest.raises(api.EngineCrashed):
        decode(engine, 4)
    with pytest.raises(api.EngineCrashed):
        decode(engine, 4)
    assert engine.health().state == "failed", "max_restarts=1 is used up"


def test_sigterm_drains_in_flight_calls(remote: RemoteFactory, transport: str) -> None:
    """SIGTERM to a serving child: the prefill in flight completes, then the child ends by
    that signal (after draining, it lets SIGTERM end it) and later calls raise EngineCrashed
    naming it."""
    engine = remote(config(spawn="fake", transport=transport, faults=delay("prefill", 800)))
    pending = Background(lambda: prefill(engine))
    wait_until(lambda: _in_flight(engine))
    os.kill(_child_pid(engine), signal.SIGTERM)
    result = pending.result()
    assert isinstance(result, api.LogitsResult)
    wait_until(lambda: engine.health().state == "failed")
    with pytest.raises(api.EngineCrashed, match="killed by SIGTERM"):
        prefill(engine, session="later")


def test_failed_start_is_typed(remote: RemoteFactory, transport: str) -> None:
    """A child that cannot serve the named engine, or whose engine refuses the config, fails
    load with the typed error; nothing is left running."""
    with pytest.raises(api.UnknownEngine, match="no-such-engine"):
        remote(config(spawn="no-such-engine", transport=transport))
    with pytest.raises(api.InvalidRequest, match="unknown fake engine options"):
        remote(config(spawn="fake", transport=transport, not_an_option=1))
    # An interpreter that exits at once (here: `false`, which ignores its arguments).
    with pytest.raises(api.EngineCrashed, match="exited with code 1"):
        remote(config(spawn="fake", transport=transport, python="false"))


def test_client_deadline_cancels_engine_work(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """A client whose deadline passes mid-prefill: the server cancels the engine's work (it
    rolls back), the client sees OutcomeUnknown, and the session is as before."""
    server = serve(config(faults=delay("prefill", 3000)), transport=transport)
    assert server.address is not None
    engine = remote(config(target=server.address, transport=transport, timeout_s=0.3))
    with pytest.raises(OutcomeUnknown, match="may or may not"):
        prefill(engine)
    wait_until(lambda: server.engine.metrics().cancelled == 1)
    assert server.counters.snapshot()["transport_cancels"] == 1
    assert server.engine.health().sessions == 0, "the cancelled prefill was rolled back"


@pytest.mark.parametrize("operation", ["decode", "decode_batch"])
def test_client_deadline_cancels_a_running_decode(
    serve: ServeFactory, remote: RemoteFactory, transport: str, operation: str
) -> None:
    """A client whose deadline passes mid-decode (single or batched): the server cancels the
    engine's step, the client sees OutcomeUnknown, and the session decodes at the same
    position again."""
    server = serve(config(faults=delay(operation, 3000, limit=1)), transport=transport)
    assert server.address is not None
    engine = remote(config(target=server.address, transport=transport, timeout_s=0.3))
    prefill(engine)
    step = api.DecodeRequest(
        request_id="d", session=ref(), pos=3, inputs=api.TokenInput(token_ids=(1,))
    )
    batch = api.DecodeBatchRequest(request_id="b", items=(step,))
    run = (
        (lambda: engine.decode(step))
        if operation == "decode"
        else lambda: engine.decode_batch(batch)
    )
    started = time.monotonic()
    with pytest.raises(OutcomeUnknown, match="may or may not"):
        run()
    assert time.monotonic() - started < 2.0, "the deadline did not end the call"
    wait_until(lambda: server.engine.metrics().cancelled == 1)
    assert server.engine.health().in_flight == 0
    assert decode(engine, 3).first_pos == 3, "the cancelled step committed"


def test_calls_made_during_a_decode_are_answered_at_once(
    remote: RemoteFactory, transport: str
) -> None:
    """While one thread's decode runs (held 3 s in the engine), other threads' health, metrics,
    server stats and cancel are answered without waiting for it."""
    engine = remote(config(spawn="fake", transport=transport, faults=delay("decode", 3000)))
    prefill(engine, session="slow")
    pending = Background(lambda: decode(engine, 3, session="slow", request_id="slow"))
    wait_until(lambda: engine.health().in_flight > 0)
    started = time.monotonic()
    assert engine.metrics().requests >= 1
    assert engine.server_stats().in_flight >= 2
    assert engine.cancel(api.CancelRequest(request_id="slow")).cancelled
    assert time.monotonic() - started < 1.0, "calls waited for the running decode"
    with pytest.raises(api.Cancelled):
        pending.result()


def test_cancel_travels_to_the_served_engine(remote: RemoteFactory, transport: str) -> None:
    """cancel() from another thread stops a remote prefill: the caller gets Cancelled."""
    engine = remote(config(in_process="fake", transport=transport, faults=delay("prefill", 3000)))
    pending = Background(lambda: prefill(engine, request_id="slow"))
    wait_until(lambda: _in_flight(engine))
    assert engine.cancel(api.CancelRequest(request_id="slow")).cancelled
    with pytest.raises(api.Cancelled):
        pending.result()
    assert engine.health().sessions == 0


def test_server_killed_mid_decode(tmp_path: Path, remote: RemoteFactory, transport: str) -> None:
    """kill -9 of a `shard-engine serve` process while a decode is in flight: the decode is
    OutcomeUnknown (never a success), later calls are RemoteUnavailable (nothing ran)."""
    listen = f"unix:{tmp_path}/engine.sock"
    plan = (
        '{"rules": [{"action": {"kind": "delay", "milliseconds": 5000}, "operations": ["decode"]}]}'
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shard_engine_api.cli",
            "serve",
            "--engine",
            "fake",
            "--layers",
            "0:6",
            "--listen",
            listen,
            "--option",
            f"faults={plan}",
            "--transport",
            transport,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert "serving" in process.stdout.readline()
        engine = remote(config(target=listen, transport=transport, control_timeout_s=1.0))
        prefill(engine)
        pending = Background(lambda: decode(engine, 3))
        wait_until(lambda: _in_flight(engine))
        process.kill()
        with pytest.raises(OutcomeUnknown) as caught:
            pending.result()
        assert caught.value.details["reason"] == "connection_lost"
        with pytest.raises(RemoteUnavailable):
            decode(engine, 3)
        assert engine.health().state == "failed"
    finally:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


def test_every_call_in_flight_sees_the_crash(remote: RemoteFactory, transport: str) -> None:
    """Several calls in flight when the child dies: each one raises EngineCrashed."""
    engine = remote(config(spawn="fake", transport=transport, faults=delay("decode", 5000)))
    for session in ("a", "b", "c"):
        prefill(engine, session=session)
    pending = [
        Background(functools.partial(decode, engine, 3, session=session, request_id=session))
        for session in ("a", "b", "c")
    ]
    wait_until(lambda: _in_flight(engine))
    time.sleep(0.2)  # let every call reach the child
    os.kill(_child_pid(engine), signal.SIGKILL)
    for call in pending:
        with pytest.raises(api.EngineCrashed, match="SIGKILL"):
            call.result()


def test_engine_errors_keep_class_code_and_retryable(remote: RemoteFactory, transport: str) -> None:
    """Errors raised by the served engine arrive as the same class with the same code,
    retryable flag and details."""
    engine = remote(config(in_process="fake", transport=transport))
    prefill(engine)
    with pytest.raises(api.CacheMiss) as miss:
        decode(engine, 7)
    assert (miss.value.code, miss.value.retryable) == ("cache_miss", True)
    assert miss.value.committed_length == 3
    with pytest.raises(api.StaleEpoch) as stale:
        engine.prefill(
            api.PrefillRequest(
                request_id="old",
                session=api.SessionRef(session_id="s", epoch=0),
                start_pos=0,
                inputs=api.TokenInput(token_ids=(1,)),
            )
        )
    assert not stale.value.retryable
    with pytest.raises(api.InvalidRequest):
        engine.cancel(api.CancelRequest())
    assert engine.metrics().errors == {"cache_miss": 1, "stale_epoch": 1}


def test_busy_server_refuses_compute_beyond_its_queue(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """With every compute slot taken and no queue (``max_queued=0``), another prefill gets a
    retryable ResourceExhausted with ``retry_after_s`` at once (the remote engine set not to
    wait it out), while health, metrics and cancel still answer. (test_queue.py: calls
    within the bound wait instead.)"""
    server = serve(
        config(faults=delay("prefill", 1500)), max_workers=5, max_queued=0, transport=transport
    )
    assert server.address is not None
    engine = remote(config(target=server.address, transport=transport, retry_busy=False))
    pending = Background(lambda: prefill(engine, session="a", request_id="slow"))
    wait_until(lambda: _in_flight(engine))
    with pytest.raises(api.ResourceExhausted) as busy:
        prefill(engine, session="b")
    assert busy.value.retryable
    assert busy.value.details["resource"] == "server_queue"
    assert isinstance(busy.value.details["retry_after_s"], float)
    assert busy.value.details["retry_after_s"] > 0
    assert engine.health().in_flight == 1
    assert engine.cancel(api.CancelRequest(request_id="slow")).cancelled
    with pytest.raises(api.Cancelled):
        pending.result()
    assert server.counters.snapshot()["busy"] == 1
    prefill(engine, session="b", request_id="after")


def test_standard_health_follows_the_engine(serve: ServeFactory, remote: RemoteFactory) -> None:
    """grpc.health.v1 says SERVING while the engine serves and NOT_SERVING once it failed (an
    engine-level crash: the server process itself lives on and says so)."""
    plan = {"rules": [{"action": {"kind": "crash"}, "operations": ["decode"]}]}
    server = serve(config(faults=plan))
    assert server.address is not None
    engine = remote(config(target=server.address))
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def status() -> int:
            answer = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
            return int(answer.status)

        assert status() == health_pb2.HealthCheckResponse.SERVING
        prefill(engine)
        with pytest.raises(api.EngineCrashed, match="injected crash"):
            decode(engine, 3)
        assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
    assert engine.health().state == "failed"


def test_a_call_failing_after_a_restart_still_names_its_childs_death(
    remote: RemoteFactory, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode in flight when its child is killed, whose failure is handled only after
    another thread already replaced that child (forced here), is still EngineCrashed naming
    the signal: never OutcomeUnknown, which would send the worker to retry against a fresh
    child that knows nothing of the session."""
    engine = remote(
        config(
            spawn="fake",
            transport=transport,
            restart="on-crash",
            faults=delay("decode", 10_000, session_id="slow"),
        )
    )
    prefill(engine, session="slow")
    pid = engine.child_pid
    assert pid is not None
    handle = engine._transport_failure
    others: list[object] = []
    replacing = threading.Event()

    def after_a_restart(*args: typing.Any) -> api.ShardEngineError:
        if not replacing.is_set():
            replacing.set()
            # Another thread meets the crash and the next call replaces the child, both before
            # this failure is looked at.
            others.append(Background(lambda: _health_then_prefill(engine)).result())
        return handle(*args)

    monkeypatch.setattr(engine, "_transport_failure", after_a_restart)
    pending = Background(lambda: decode(engine, 3, session="slow"))
    wait_until(lambda: engine.server_stats().in_flight >= 2)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(api.EngineCrashed, match="SIGKILL"):
        pending.result()
    assert others == ["restarted"]
    assert engine.restarts == 1


def _health_then_prefill(engine: RemoteEngine) -> str:
    wait_until(lambda: engine.health().state == "degraded")
    prefill(engine, session="fresh")
    return "restarted"


def test_a_long_call_survives_the_clients_keepalive_pings(serve: ServeFactory) -> None:
    """A client pings while it waits for a reply (every 20 s by default: it must notice a
    server that vanished). gRPC's default server policy takes more than one ping per 5
    minutes without data for abuse and drops the connection after two, which ended any
    call computing longer than about a minute with UNAVAILABLE (OutcomeUnknown). Here a
    client pinging every 1.2 s (dropped after 6 s before) waits out an 8 s prefill and gets
    its result."""
    server = serve(config(faults=delay("prefill", 8000)))
    assert server.address is not None
    options = [
        ("grpc.keepalive_time_ms", 1200),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    request = api.PrefillRequest(
        request_id="long", session=ref(), start_pos=0, inputs=api.TokenInput(token_ids=(1, 2))
    )
    with grpc.insecure_channel(server.address, options=options) as channel:
        call: grpc.UnaryUnaryMultiCallable[bytes, object]
        call = channel.unary_unary(CALL_METHOD, response_deserializer=decode_reply)
        reply = call(encode_request(request), timeout=60)
    assert isinstance(reply, api.LogitsResult)
