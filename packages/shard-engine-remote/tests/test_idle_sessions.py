"""Sessions cannot be orphaned for ever (issue 28): a served session no call touched for
``session_idle_s`` is released with its fence, so clients that died cannot hold every slot of
a ``reject`` engine; sessions in use, or touched since, stay. ``serve`` exposes the policy."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RemoteFactory, ServeFactory, config, decode, prefill, ref, wait_until

import shard_engine_api as api
from shard_engine_remote import EngineServer
from shard_engine_remote._idle import IdleSessions

_IDLE_S = 1000.0
"""Long enough that the background pass never runs during a test: each test moves the clock."""


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _idle(server: EngineServer) -> tuple[IdleSessions, _Clock]:
    idle = server._idle
    assert idle is not None
    clock = _Clock()
    idle._clock = clock
    return idle, clock


def test_dead_clients_sessions_are_released_with_a_fence(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """Four clients fill every slot and vanish: new sessions are refused (health says
    ``degraded``, for lack of room) until the sessions are idle for ``session_idle_s``; then
    they are released at their epoch (a late client gets StaleEpoch, not a fresh session),
    health is ``ready`` again and new sessions are admitted."""
    server = serve(
        api.LoadConfig(shard=config().shard, max_sessions=4),
        transport=transport,
        session_idle_s=_IDLE_S,
    )
    idle, clock = _idle(server)
    dead = [remote(config(target=server.address, transport=transport)) for _ in range(4)]
    for index, engine in enumerate(dead):
        prefill(engine, session=f"dead-{index}")
        engine.close()  # killed: nobody releases its session
    newcomer = remote(config(target=server.address, transport=transport))
    with pytest.raises(api.ResourceExhausted):
        prefill(newcomer, session="new")
    full = newcomer.health()
    assert full.state == "degraded", full  # a full shard, not a ready one refusing everybody
    assert "lack of room" in full.detail
    clock.now = _IDLE_S - 1
    assert idle.expire() == []
    clock.now = _IDLE_S + 1
    released = idle.expire()
    assert newcomer.health().state == "ready"
    assert sorted(session.session_id for session in released) == [f"dead-{n}" for n in range(4)]
    assert server.engine.health().sessions == 0
    prefill(newcomer, session="new")
    assert decode(newcomer, 3, session="new").first_pos == 3
    with pytest.raises(api.StaleEpoch):
        prefill(newcomer, session="dead-0")  # its epoch is fenced
    newcomer.engine_name  # noqa: B018 - the newcomer still works
    assert idle.expired == 4


def test_sessions_in_use_or_touched_since_stay(serve: ServeFactory, remote: RemoteFactory) -> None:
    """Only sessions untouched for the whole period go: one decoded since stays, one with a
    call running stays, a newer epoch is the one released, and a session the client released
    itself is no longer tracked."""
    server = serve(session_idle_s=_IDLE_S)
    idle, clock = _idle(server)
    client = remote(config(target=server.address))
    prefill(client, session="old")
    prefill(client, session="busy")
    prefill(client, session="newer")
    client.prefill(
        api.PrefillRequest(
            request_id="again",
            session=ref("newer", 7),
            start_pos=0,
            inputs=api.TokenInput(token_ids=(4, 5)),
        )
    )
    prefill(client, session="mine")
    client.release(api.ReleaseRequest(session=ref("mine")))
    clock.now = 600.0
    decode(client, 3, session="busy")
    clock.now = _IDLE_S + 1
    idle._begin([ref("old")])  # a call on "old" is running now
    assert idle.expire() == [ref("newer", 7)]
    idle._end([ref("old")], ())
    assert len(idle) == 2  # "old" (just served) and "busy"
    clock.now = 2 * _IDLE_S + 700
    assert sorted(s.session_id for s in idle.expire()) == ["busy", "old"]
    assert len(idle) == 0


def test_in_process_servers_have_no_idle_expiry(serve: ServeFactory) -> None:
    """Off unless asked for: an EngineServer built without ``session_idle_s`` keeps sessions
    until released (the engine's own policy)."""
    assert serve()._idle is None
    with pytest.raises(api.InvalidRequest):
        serve(session_idle_s=0.0)


def test_serve_exposes_the_session_policy(tmp_path: Path, remote: RemoteFactory) -> None:
    """``serve --max-sessions --max-context --kv-budget-tokens --eviction --session-idle-s``
    reach the engine: its capabilities say so, LRU evicts instead of refusing, and an idle
    session is released by the server on its own (waited for, never timed)."""
    listen = f"unix:{tmp_path}/engine.sock"
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "shard_engine_api.cli", "serve", "--engine", "fake"),
            *("--layers", "0:3", "--listen", listen, "--max-sessions", "2"),
            *("--max-context", "64", "--kv-budget-tokens", "100", "--eviction", "lru"),
            *("--session-idle-s", "0.2", "--max-import-bytes", str(64 << 20)),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert "serving" in process.stdout.readline()
        engine = remote(config(0, 3, target=listen))
        limits = engine.capabilities().limits
        assert (limits.max_sessions, limits.max_context, limits.kv_budget_tokens) == (2, 64, 100)
        for name in ("a", "b", "c"):  # a third session evicts the LRU one instead of refusing
            prefill(engine, session=name)
        wait_until(lambda: engine.health().sessions == 0, timeout=60)
        with pytest.raises(api.StaleEpoch):
            decode(engine, 3, session="c")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()
