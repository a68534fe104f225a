"""Served engines queue compute calls instead of refusing them: a bounded queue, fair per
client; beyond its bound a retryable ResourceExhausted with ``retry_after_s``, which a remote
engine waits out and retries; a refused call never ran. No assertion here is on a duration:
every test waits for states (queue depths, counters), never for time to pass."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import cast

import msgspec
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
    sessions_at_once,
    wait_until,
)

import shard_engine_api as api
from shard_engine_api import wire
from shard_engine_remote import EngineServer, RemoteEngine, RemoteUnavailable
from shard_engine_remote._admission import Admission, Ticket
from shard_engine_remote._link import LinkFailure

BLOCK_MS = 60_000
"""A prefill of session "block" takes this long unless cancelled: it holds a compute slot
until the test cancels it."""


def _blocking(**options: object) -> api.LoadConfig:
    return config(faults=delay("prefill", BLOCK_MS, session_id="block"), **options)


def _block(engine: api.ShardEngine, server: EngineServer) -> Background:
    """Take the server's one compute slot with a prefill that runs until cancelled."""
    blocker = Background(lambda: prefill(engine, session="block", request_id="block"))
    wait_until(lambda: server.engine.health().in_flight == 1)
    return blocker


def _prefilling(engine: api.ShardEngine, session: str) -> Background:
    return Background(lambda: prefill(engine, session=session))


def _flood(engine: api.ShardEngine, server: EngineServer) -> tuple[Background, list[Background]]:
    """While a prefill holds the engine (the blocker, returned), 20 more prefills of
    ``engine``, once the 12 compute slots let 11 of them into the engine and 9 wait in the
    server's queue."""
    blocker = _block(engine, server)
    flood = [_prefilling(engine, f"f{n}") for n in range(20)]
    wait_until(lambda: server.engine.health().queued == 11, timeout=120)
    _wait_queued(server, 9)
    return blocker, flood


def _wait_queued(server: EngineServer, depth: int) -> None:
    wait_until(lambda: server.stats().queued == depth)


def _unblock(engine: api.ShardEngine, blocker: Background) -> None:
    assert engine.cancel(api.CancelRequest(request_id="block")).cancelled
    with pytest.raises(api.Cancelled):
        blocker.result()


# ----------------------------------------------------------------- many clients


def test_64_clients_are_queued_never_refused(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """Sixty-four clients (a connection each), each making one call at a time (a prefill and
    ten decodes of its own session), all at once against a server of an engine of 64 sessions
    (64 compute slots, 204 places in the queue): every call is answered, none is refused (the
    remote engines do not retry, so a refusal would surface), and every call the engine saw
    is one a client made."""
    load = msgspec.structs.replace(config(faults=delay("decode", 1)), max_sessions=64)
    server = serve(load, transport=transport)
    assert server.address is not None
    engines = [
        remote(config(target=server.address, transport=transport, retry_busy=False))
        for _ in range(64)
    ]
    sessions_at_once(engines, 10)
    stats = server.stats()
    assert (stats.busy, stats.queue_evicted, stats.queued, stats.computing) == (0, 0, 0, 0)
    assert (server.compute_slots, stats.max_queued) == (64, 256 - (64 - 12))
    metrics = server.engine.metrics()
    assert (metrics.prefill_requests, metrics.decode_requests) == (64, 640)


# ----------------------------------------------------------------- as many slots as sessions


@pytest.mark.parametrize("sessions", [16, 40])
def test_every_session_decoding_at_once_reaches_the_engine_as_one_forward(
    serve: ServeFactory, remote: RemoteFactory, transport: str, sessions: int
) -> None:
    """A server started without ``max_workers`` gives its engine as many compute calls at once
    as the engine has sessions: a decode of every other session, sent while a prefill holds
    the engine, all reach its scheduler and run as one forward when the prefill ends. With
    the 12 slots of 16 threads alone they split (11 in the engine, the rest in the server's
    queue), and callers in lockstep stayed split: forwards of 12 and of 4 in turn."""
    load = msgspec.structs.replace(_blocking(), max_sessions=sessions)
    server = serve(load, transport=transport)
    assert server.address is not None
    assert server.compute_slots == sessions
    assert server.stats().max_queued == 256 - (sessions - 12)
    engine = remote(config(target=server.address, transport=transport, retry_busy=False))
    others = [f"s{n}" for n in range(sessions - 1)]
    for session in others:
        prefill(engine, session=session)
    blocker = _block(engine, server)
    decoders = [
        Background(functools.partial(decode, engine, 3, session=session, request_id=session))
        for session in others
    ]
    wait_until(lambda: server.engine.health().queued == len(others), timeout=120)
    stats = server.stats()
    assert (stats.queued, stats.computing) == (0, sessions)
    _unblock(engine, blocker)
    for decoder in decoders:
        assert isinstance(decoder.result(), api.LogitsResult)
    metrics = server.engine.metrics()
    assert (metrics.coalesced_forwards, metrics.coalesced_max) == (1, len(others))


@pytest.mark.parametrize("where", ["in_process", "spawn"])
def test_a_grpc_server_loaded_by_its_first_call_takes_every_sessions_decode_at_once(
    remote: RemoteFactory, where: str
) -> None:
    """A gRPC server whose engine its client loads (a spawned child, an in-process server)
    learns the engine's sessions only after it started: its connections take as many streams
    as its slots may ever widen to, so one worker's 39 sessions all decode at once and run as
    one forward. They took 32 (twice its threads): the rest were refused by gRPC
    (REFUSED_STREAM), sent again, and never all reached the engine together."""
    load = msgspec.structs.replace(
        config(
            **{where: "fake"},
            transport="grpc",
            faults=delay("prefill", BLOCK_MS, session_id="block"),
        ),
        max_sessions=40,
    )
    engine = remote(load)
    assert isinstance(engine, RemoteEngine)
    others = [f"s{n}" for n in range(39)]
    for session in others:
        prefill(engine, session=session)
    blocker = Background(lambda: prefill(engine, session="block", request_id="block"))
    wait_until(lambda: engine.health().in_flight == 1, timeout=120)
    decoders = [
        Background(functools.partial(decode, engine, 3, session=session, request_id=session))
        for session in others
    ]
    wait_until(lambda: engine.health().queued == len(others), timeout=120)
    _unblock(engine, blocker)
    for decoder in decoders:
        assert isinstance(decoder.result(), api.LogitsResult)
    metrics = engine.metrics()
    assert (metrics.coalesced_forwards, metrics.coalesced_max) == (1, len(others))


def test_prefills_still_get_twelve_slots_and_wait_fairly_beyond(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """The slots an engine of 40 sessions gains are for single decodes only: a client's 20
    prefills, sent while a prefill holds the engine, reach the engine 11 at a time (12 slots)
    and the rest wait in the server's queue, where another client's prefill is next in turn,
    not behind the flood in the engine's own queue."""
    load = msgspec.structs.replace(_blocking(), max_sessions=40)
    server = serve(load, transport=transport)
    assert server.address is not None
    assert server.compute_slots == 40
    flooding = remote(config(target=server.address, transport=transport, retry_busy=False))
    other = remote(config(target=server.address, transport=transport, retry_busy=False))
    blocker, flood = _flood(flooding, server)
    assert server.stats().computing == 12
    late = _prefilling(other, "other")
    _wait_queued(server, 10)
    assert server.engine.health().queued == 11  # the queue holds it, fairly
    _unblock(flooding, blocker)
    for call in [*flood, late]:
        assert isinstance(call.result(), api.LogitsResult)
    assert server.engine.metrics().prefill_requests == 1 + 20 + 1


def test_an_engine_of_many_sessions_keeps_half_the_queue_for_its_other_calls(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """An engine of 400 sessions gets 128 decode slots, not the queue's every place: the queue
    keeps 128 of its 256, so a client's 20 prefills sent while a prefill holds the engine
    reach it 11 at a time and the rest wait in the queue. With every place taken for decode
    slots, they were refused as soon as the 12 slots were busy."""
    load = msgspec.structs.replace(_blocking(), max_sessions=400)
    server = serve(load, transport=transport)
    assert server.address is not None
    assert (server.compute_slots, server.stats().max_queued) == (12 + 128, 128)
    engine = remote(config(target=server.address, transport=transport, retry_busy=False))
    blocker, flood = _flood(engine, server)
    assert server.stats().busy == 0
    _unblock(engine, blocker)
    for call in flood:
        assert isinstance(call.result(), api.LogitsResult)
    assert server.engine.metrics().prefill_requests == 1 + 20


def test_given_max_workers_the_slots_stay_as_given(serve: ServeFactory) -> None:
    """``max_workers`` given: ``max_workers - 4`` compute slots whatever the engine's sessions,
    and the queue keeps all its places."""
    load = msgspec.structs.replace(config(), max_sessions=64)
    server = serve(load, max_workers=8)
    assert (server.compute_slots, server.stats().max_queued) == (4, 256)
    assert serve(load, max_workers=8, max_queued=3).stats().max_queued == 3


def test_a_spawned_childs_server_widens_its_slots_when_its_engine_loads(
    remote: RemoteFactory,
) -> None:
    """A spawned child's engine loads through the child's first call; its server then gives
    it as many compute calls at once as it has sessions (20: 8 more than 12, taken from the
    queue's 256 places)."""
    load = msgspec.structs.replace(config(spawn="fake"), max_sessions=20)
    engine = remote(load)
    assert isinstance(engine, RemoteEngine)
    assert engine.server_stats().max_queued == 256 - 8


def test_admission_widens_with_decode_slots_taken_from_its_queue_places() -> None:
    """``widen``: decode slots, each one place fewer in the queue (never below half its
    places), never fewer than before. A decode takes one when the slots are full and calls
    queue; a prefill never does; a freed decode slot goes to the next client in turn whose
    oldest waiting call is a decode, never past a client's own earlier call."""
    admission = Admission(1, 6)
    held = admission.enter("a")
    assert held is not None
    early = [admission.enter("a"), admission.enter("b", decode=True)]
    tickets = cast(list[Ticket], early)
    assert [ticket.state for ticket in tickets] == ["queued", "queued"]
    assert admission.widen(3) == 3  # two decode slots: "b"'s decode takes one at once
    assert (admission.slots, admission.decode_slots, admission.max_queued) == (1, 2, 4)
    assert [ticket.state for ticket in tickets] == ["queued", "granted"]
    assert admission.wait(tickets[1]) == "granted"
    decode = admission.enter("c", decode=True)  # a decode slot is free: in, past the queue
    prefill = admission.enter("c")  # no slot for it: it queues
    assert decode is not None
    assert prefill is not None
    assert (decode.state, prefill.state) == ("granted", "queued")
    assert admission.widen(2) == 3  # never fewer
    waiting = [admission.enter("a", decode=True), admission.enter("d", decode=True)]
    assert all(ticket is not None and ticket.state == "queued" for ticket in waiting)
    late = cast(list[Ticket], waiting)
    # "a"'s decode waits behind "a"'s own earlier call: the freed decode slot goes to "d".
    admission.done(decode)
    assert [ticket.state for ticket in late] == ["queued", "granted"]
    stats = admission.stats()
    assert (stats["queued"], stats["computing"]) == (3, 3)
    assert admission.widen(100) == 3 + 1  # at most down to half the queue's places
    assert (admission.decode_slots, admission.max_queued, admission.queue_floor) == (3, 3, 3)
    # New decode slots go to decodes at their client's turn only: "a" still heads with a
    # prefill, so its decode keeps waiting; "c"'s prefill never takes one.
    assert [t.state for t in (tickets[0], prefill, late[0])] == ["queued", "queued", "queued"]
    admission.done(held)  # the slot: "a"'s prefill (first in turn)
    assert tickets[0].state == "granted"
    admission.done(late[1])  # a decode slot: now "a"'s decode heads its queue
    assert late[0].state == "granted"
    for ticket in (tickets[0], tickets[1], late[0]):
        admission.done(ticket)
    assert prefill.state == "granted"
    admission.done(prefill)
    assert admission.wait_idle(0.0)


# ----------------------------------------------------------------- the bound


def test_beyond_the_bound_a_call_is_refused_retryably_and_never_runs(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """One compute slot (taken) and a queue of one (taken): a third client's prefill is
    refused at once with a retryable ResourceExhausted carrying ``retry_after_s`` > 0, and
    the engine never saw it; the queued call runs once the slot is free."""
    server = serve(_blocking(), transport=transport, max_workers=5, max_queued=1)
    assert server.address is not None
    owner = remote(config(target=server.address, transport=transport))
    waiter = remote(config(target=server.address, transport=transport))
    refused = remote(config(target=server.address, transport=transport, retry_busy=False))
    blocker = _block(owner, server)
    queued = Background(lambda: prefill(waiter, session="q"))
    wait_until(lambda: server.stats().queued == 1)
    before = server.engine.metrics()
    with pytest.raises(api.ResourceExhausted) as refusal:
        prefill(refused, session="r")
    error = refusal.value
    assert error.retryable
    assert error.details["resource"] == "server_queue"
    retry_after = error.details["retry_after_s"]
    assert isinstance(retry_after, float)
    assert retry_after > 0
    after = server.engine.metrics()
    assert (after.requests, after.prefill_requests) == (before.requests, before.prefill_requests)
    assert server.engine.health().in_flight == 1
    stats = server.stats()
    assert (stats.busy, stats.queued, stats.computing) == (1, 1, 1)
    _unblock(owner, blocker)
    assert cast(api.ShardResult, queued.result()).request_id == "prefill-q"
    stats = server.stats()
    assert (stats.queued, stats.queued_calls) == (0, 1)
    assert server.engine.metrics().prefill_requests == before.prefill_requests + 1


def test_a_full_queue_makes_room_for_a_client_with_fewer_calls_waiting(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """A queue of three, all of them one client's: another client's call takes the place of
    the flooding client's newest (refused: retryable, ``retry_after_s``, never ran), so one
    client's many calls cannot push out another client's."""
    server = serve(_blocking(), transport=transport, max_workers=5, max_queued=3)
    assert server.address is not None
    owner = remote(config(target=server.address, transport=transport))
    flood = remote(config(target=server.address, transport=transport, retry_busy=False))
    other = remote(config(target=server.address, transport=transport, retry_busy=False))
    blocker = _block(owner, server)
    floods = []
    for n in range(3):
        floods.append(_prefilling(flood, f"f{n}"))
        _wait_queued(server, n + 1)
    mine = Background(lambda: prefill(other, session="mine"))
    wait_until(lambda: server.stats().queue_evicted == 1)
    assert server.stats().queued == 3
    _unblock(owner, blocker)
    assert cast(api.ShardResult, mine.result()).request_id == "prefill-mine"
    outcomes: list[object] = []
    for call in floods:
        try:
            outcomes.append(call.result())
        except api.ResourceExhausted as error:
            outcomes.append(error)
    refusals = [outcome for outcome in outcomes if isinstance(outcome, api.ResourceExhausted)]
    assert len(refusals) == 1
    assert refusals[0].retryable
    assert cast(float, refusals[0].details["retry_after_s"]) > 0
    metrics = server.engine.metrics()
    assert metrics.prefill_requests == 1 + 2 + 1, "the blocker, two of the flood's, mine"
    assert server.stats().busy == 1


# ----------------------------------------------------------------- fairness


class _Recording:
    """A served engine that records, in order, the session of every compute call it starts."""

    def __init__(self, engine: api.ShardEngine) -> None:
        self._engine = engine
        self.started: list[str] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)

    def _record(self, session: str) -> None:
        with self._lock:
            self.started.append(session)

    def prefill(self, request: api.PrefillRequest) -> api.ShardResult:
        self._record(request.session.session_id)
        return self._engine.prefill(request)

    def decode(self, request: api.DecodeRequest) -> api.ShardResult:
        self._record(request.session.session_id)
        return self._engine.decode(request)


class _RecordingServer(EngineServer):
    def __init__(self, engine: api.ShardEngine, **options: object) -> None:
        super().__init__(cast(api.ShardEngine, _Recording(engine)), **options)  # type: ignore[arg-type]


def test_a_freed_slot_goes_to_each_waiting_client_in_turn(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """Eight prefills of one client queued before two of another's: as the one slot frees,
    the engine starts them alternating between the clients (then the rest of the flood), not
    in arrival order, which would have put the second client behind all eight."""
    server = serve(_blocking(), transport=transport, max_workers=5, server_type=_RecordingServer)
    assert server.address is not None
    recording = cast(_Recording, server.engine)
    owner = remote(config(target=server.address, transport=transport))
    flood = remote(config(target=server.address, transport=transport))
    other = remote(config(target=server.address, transport=transport))
    blocker = _block(owner, server)
    calls = [_prefilling(flood, f"f{n}") for n in range(8)]
    _wait_queued(server, 8)
    for n in range(2):
        calls.append(_prefilling(other, f"o{n}"))
        _wait_queued(server, 9 + n)
    _unblock(owner, blocker)
    for call in calls:
        call.result()
    started = recording.started[1:]  # after the blocker
    assert [session[0] for session in started] == list("fofo" + "f" * 6)
    stats = server.stats()
    assert (stats.queued_calls, stats.busy) == (10, 0)


def test_a_flooding_client_does_not_starve_another(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """One client decoding in a tight loop from eight threads (four compute slots, so they
    queue; well under gRPC's sixteen streams a connection) while another makes twenty calls
    one at a time: the other's calls all complete while the flood goes on, none refused."""
    server = serve(config(faults=delay("decode", 2)), transport=transport, max_workers=8)
    assert server.address is not None
    flood = remote(config(target=server.address, transport=transport, retry_busy=False))
    other = remote(config(target=server.address, transport=transport, retry_busy=False))
    stop = threading.Event()
    flooded = [0] * 8
    failures: list[BaseException] = []

    def flooding(n: int) -> None:
        try:
            prefill(flood, session=f"f{n}", request_id=f"p{n}")
            position = 3
            while not stop.is_set() and position < 1500:
                decode(flood, position, session=f"f{n}", request_id=f"d{n}")
                flooded[n] += 1
                position += 1
        except BaseException as error:  # noqa: BLE001 - reported below
            failures.append(error)

    threads = [threading.Thread(target=flooding, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: server.stats().queued_calls >= 20, timeout=60)
        prefill(other, session="other")
        for position in range(3, 22):
            decode(other, position, session="other")
        assert not stop.is_set()
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert failures == []
    assert server.stats().busy == 0
    assert sum(flooded) > 0


# ----------------------------------------------------------------- the client retries


def test_the_remote_engine_retries_a_refused_call_until_it_runs(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """No queue (``max_queued=0``) and the one slot taken: a prefill is refused, waits
    ``retry_after_s`` and is sent again, as often as it takes within its deadline; once the
    slot is free it runs, once (the refused attempts never reached the engine)."""
    server = serve(_blocking(), transport=transport, max_workers=5, max_queued=0)
    assert server.address is not None
    owner = remote(config(target=server.address, transport=transport))
    patient = remote(config(target=server.address, transport=transport, timeout_s=120))
    blocker = _block(owner, server)
    call = Background(lambda: prefill(patient, session="p"))
    wait_until(lambda: server.stats().busy >= 2)
    assert patient.busy_retries >= 1
    assert server.engine.metrics().prefill_requests == 1, "only the blocker ran"
    _unblock(owner, blocker)
    assert cast(api.ShardResult, call.result()).request_id == "prefill-p"
    assert server.engine.metrics().prefill_requests == 2
    assert patient.busy_retries == server.stats().busy


def test_snapshot_streams_wait_for_their_slots_and_beyond_their_queue_are_retried(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """A server of 5 threads and 4 queue places has one compute slot, one stream slot and one
    place for a stream waiting for it. While a prefill holds the compute slot, an export
    waits for it in the compute queue (it was refused: under concurrent decodes most exports
    were), a second export waits for the stream slot (it was refused, with the compute
    queue's estimate: 64 threads exporting sent their exports again 11,404 times for 256),
    and a third, beyond the streams' queue, is refused (ResourceExhausted with
    ``retry_after_s``: nothing ran), which the remote engine sends again until it gets in,
    within its deadline; ``retry_busy=False`` raises the refusal at once. An import waits
    the same way."""
    server = serve(_blocking(), transport=transport, max_workers=5, max_queued=4)
    assert server.address is not None
    owner = remote(config(target=server.address, transport=transport))
    first = remote(config(target=server.address, transport=transport))
    second = remote(config(target=server.address, transport=transport))
    patient = remote(config(target=server.address, transport=transport, timeout_s=120))
    impatient = remote(config(target=server.address, transport=transport, retry_busy=False))
    prefill(owner, session="x")
    snapshot = owner.export_session(api.ExportSessionRequest(request_id="e0", session=ref("x")))

    def export(engine: api.ShardEngine, request_id: str) -> Background:
        request = api.ExportSessionRequest(request_id=request_id, session=ref("x"))
        return Background(lambda: engine.export_session(request))

    blocker = _block(owner, server)
    waiting = export(first, "e1")
    _wait_queued(server, 1)
    queued = export(second, "e2")
    wait_until(lambda: server.stats().streams_queued == 1)
    assert server.stats().busy == 0
    with pytest.raises(api.ResourceExhausted) as refused:
        impatient.export_session(api.ExportSessionRequest(request_id="e3", session=ref("x")))
    assert refused.value.details["resource"] == "server_threads"
    assert isinstance(refused.value.details["retry_after_s"], float)
    retried = export(patient, "e4")
    wait_until(lambda: server.stats().busy >= 3, timeout=120)
    assert patient.busy_retries >= 1
    _unblock(owner, blocker)
    for call in (waiting, queued, retried):
        exported = call.result()
        assert isinstance(exported, api.SessionSnapshot)
        assert exported.chunks == snapshot.chunks
    assert server.stats().streams_queued == 0

    blocker = _block(owner, server)
    moved = msgspec.structs.replace(snapshot, session=ref("y"))
    imported = Background(
        lambda: patient.import_session(api.ImportSessionRequest(request_id="i", snapshot=moved))
    )
    _wait_queued(server, 1)
    assert server.engine.health().sessions == 1  # "x" alone: nothing imported yet
    _unblock(owner, blocker)
    assert isinstance(imported.result(), api.ImportSessionResult)
    assert server.engine.health().sessions == 2
    assert server.stats().queued == 0


def _refusal(retry_after: float) -> api.ErrorInfo:
    return api.ResourceExhausted(
        "full", details={"resource": "server_queue", "retry_after_s": retry_after}
    ).to_info()


def _scripted(
    monkeypatch: pytest.MonkeyPatch, engine: RemoteEngine, replies: list[object]
) -> list[float | None]:
    """Make ``engine``'s link answer compute calls with ``replies`` in turn (then the real
    server); returns the timeout each scripted attempt was given."""
    timeouts: list[float | None] = []
    roundtrip = engine._roundtrip

    def scripted(link: object, message: object, timeout: float | None, mutating: bool) -> object:
        if isinstance(message, api.PrefillRequest) and replies:
            timeouts.append(timeout)
            reply = replies.pop(0)
            if isinstance(reply, api.ErrorInfo):
                raise wire.error_from_info(reply)
            return reply
        return roundtrip(link, message, timeout, mutating)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "_roundtrip", cast(Callable[..., object], scripted))
    return timeouts


def test_the_retry_stays_within_the_callers_deadline(
    serve: ServeFactory, remote: RemoteFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal whose ``retry_after_s`` does not fit in what is left of the call's deadline
    is raised at once, not waited out; one that fits is waited out and the call sent again
    with what is left of the deadline; refusals that do not say when to come back (a rate
    limit, a transport's) or that are not retryable are raised as they are."""
    server = serve(config())
    assert server.address is not None
    engine = remote(config(target=server.address, timeout_s=30))
    timeouts = _scripted(monkeypatch, engine, [_refusal(1000.0)])
    with pytest.raises(api.ResourceExhausted) as refused:
        prefill(engine)
    assert refused.value.details["retry_after_s"] == 1000.0
    assert engine.busy_retries == 0
    assert timeouts == [pytest.approx(30, abs=5)]

    timeouts = _scripted(monkeypatch, engine, [_refusal(0.001), _refusal(0.002)])
    assert prefill(engine, session="t").request_id == "prefill-t"
    assert engine.busy_retries == 2
    assert len(timeouts) == 2  # then the real server answered
    assert all(timeout is not None and 0 < timeout <= 30 for timeout in timeouts)

    for refusal in (
        api.ResourceExhausted("limit", details={"resource": "rate_limit", "retry_after_s": 0.001}),
        api.ResourceExhausted("transport", details={"resource": "server_calls"}),
        api.ResourceExhausted("size", retryable=False, details={"resource": "server_queue"}),
        api.NotReady("draining", details={"reason": "draining"}),
    ):
        _scripted(monkeypatch, engine, [refusal.to_info()])
        with pytest.raises(type(refusal)):
            prefill(engine, session="u")
    assert engine.busy_retries == 2


def test_closing_the_engine_ends_a_refused_calls_wait_as_not_ready(
    serve: ServeFactory, remote: RemoteFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call waiting out a refusal's ``retry_after_s`` when its remote engine is closed ends
    at once with NotReady (the engine was closed, nothing ran), not with the refusal: the
    server was not what stopped it."""
    server = serve(config())
    assert server.address is not None
    engine = remote(config(target=server.address, timeout_s=120))
    timeouts = _scripted(monkeypatch, engine, [_refusal(60.0)])
    call = Background(lambda: prefill(engine))
    wait_until(lambda: len(timeouts) == 1)
    engine.close()
    with pytest.raises(api.NotReady) as closed:
        call.result()
    assert "closed" in closed.value.message
    assert isinstance(closed.value.__cause__, api.ResourceExhausted)
    assert server.engine.metrics().prefill_requests == 0


def test_an_export_whose_stream_cannot_open_is_the_contracts_error(
    serve: ServeFactory, remote: RemoteFactory, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link failing as an export's stream opens (closed or lost meanwhile, as while the
    engine closes) is the contract's error for it: RemoteUnavailable, nothing exported. It
    escaped as the link's own exception, which the result checks reported as MalformedOutput
    (an export during close(), about 1 run in 5 with 8 threads exporting)."""
    server = serve(config(), transport=transport)
    assert server.address is not None
    engine = remote(config(target=server.address, transport=transport))
    assert isinstance(engine, RemoteEngine)
    prefill(engine)
    link = engine._link
    assert link is not None

    def lost(message: bytes, timeout: float | None) -> object:
        raise LinkFailure("connection_lost", "lost while sending", sent=False, status="UNAVAILABLE")

    monkeypatch.setattr(link, "export", lost)
    with pytest.raises(RemoteUnavailable):
        engine.export_session(api.ExportSessionRequest(request_id="e", session=ref("s")))


# ----------------------------------------------------------------- cancel, drain, stats


def test_a_queued_call_is_cancelled_at_once_and_never_runs(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """A call waiting in the queue hears its client's cancel at once (Cancelled, never run),
    as does one whose deadline passes while it waits; health, metrics, capabilities and the
    server's stats answer while calls wait."""
    server = serve(_blocking(), transport=transport, max_workers=5)
    assert server.address is not None
    owner = remote(config(target=server.address, transport=transport))
    waiter = remote(config(target=server.address, transport=transport))
    blocker = _block(owner, server)
    queued = Background(lambda: prefill(waiter, session="q", request_id="q"))
    wait_until(lambda: server.stats().queued == 1)
    assert waiter.health().state == "ready"
    assert waiter.metrics().prefill_requests == 1, "the blocker (the queued call did not run)"
    assert waiter.capabilities().engine == "remote"
    assert waiter.server_stats().queued == 1
    result = waiter.cancel(api.CancelRequest(request_id="q"))
    assert (result.cancelled, result.n_requests) == (True, 1)
    with pytest.raises(api.Cancelled, match="'q'") as cancelled:
        queued.result()
    assert cancelled.value.details["ran"] is False
    assert server.stats().queued == 0
    _unblock(owner, blocker)
    assert server.engine.metrics().prefill_requests == 1, "the queued call never ran"


def test_a_draining_server_refuses_new_and_still_queued_calls_naming_the_drain(
    serve: ServeFactory, remote: RemoteFactory
) -> None:
    """While a gRPC server drains, a call that was waiting for a compute slot when the
    drain's grace nearly ended, and a new call, are refused with a retryable NotReady naming
    the drain (nothing ran); the call that was running is cancelled at the grace's end."""
    server = serve(_blocking(), max_workers=5)
    assert server.address is not None
    owner = remote(config(target=server.address))
    waiter = remote(config(target=server.address))
    late = remote(config(target=server.address))
    blocker = _block(owner, server)
    queued = Background(lambda: prefill(waiter, session="q"))
    wait_until(lambda: server.stats().queued == 1)
    stopping = Background(lambda: server.stop(grace=5.0))
    wait_until(lambda: server._compute_slots.draining)
    with pytest.raises(api.NotReady) as refused:
        prefill(late, session="late")
    assert refused.value.retryable
    assert refused.value.details["reason"] == "draining"
    with pytest.raises(api.NotReady) as drained:
        queued.result()
    assert drained.value.details["reason"] == "draining"
    stopping.result()
    with pytest.raises((api.Cancelled, api.OutcomeUnknown)):
        blocker.result()
    assert server.stats().drain_refused == 2
    assert server.engine.metrics().prefill_requests == 1


# ----------------------------------------------------------------- the queue itself


def _granted(tickets: list[Ticket]) -> list[str]:
    return [ticket.client for ticket in tickets if ticket.state == "granted"]


def test_admission_grants_in_turn_across_clients_and_in_order_within_one() -> None:
    """The queue alone: a freed slot goes to the client next in turn, each client's calls in
    their arrival order; a full queue takes the newest call of the client with the most
    waiting (two more than the newcomer's) and otherwise refuses; a withdrawn call leaves."""
    admission = Admission(1, 6)
    first = admission.enter("a")
    assert first is not None
    assert first.state == "granted"
    queued = [admission.enter(client) for client in ("a", "a", "a", "a", "b", "c")]
    assert all(ticket is not None and ticket.state == "queued" for ticket in queued)
    tickets = cast(list[Ticket], queued)
    assert admission.stats()["queued"] == 6
    # Full: "d" takes the place of "a"'s newest (a holds 4 >= 0 + 2).
    newcomer = admission.enter("d")
    assert newcomer is not None
    assert tickets[3].state == "evicted"
    assert admission.wait(tickets[3]) == "evicted"
    # Full again: "a" holds the most already, so its next call is refused.
    assert admission.enter("a") is None
    assert admission.withdraw(tickets[5], "cancelled")
    assert admission.wait(tickets[5]) == "cancelled"
    order: list[str] = []
    admission.done(first)
    waiting = [tickets[0], tickets[1], tickets[2], tickets[4], newcomer]
    while any(ticket.state == "queued" for ticket in waiting):
        granted = [ticket for ticket in waiting if ticket.state == "granted"]
        assert len(granted) == 1
        assert admission.wait(granted[0]) == "granted"
        order.append(granted[0].client)
        waiting.remove(granted[0])
        admission.done(granted[0])
    assert waiting[0].state == "granted"
    order.append(waiting[0].client)
    assert order == ["a", "b", "d", "a", "a"]
    assert tickets[0] is not tickets[1]
    stats = admission.stats()
    assert (stats["queued"], stats["queued_calls"], stats["queue_evicted"]) == (0, 5, 1)
    assert admission.retry_after_s() > 0


def test_admission_drain_refuses_waiting_and_new_calls() -> None:
    admission = Admission(1, 4)
    held = admission.enter("a")
    waiting = admission.enter("b")
    assert held is not None
    assert waiting is not None
    admission.close()
    assert admission.enter("c") is None
    assert waiting.state == "queued"
    assert admission.drain() == 1
    assert admission.wait(waiting) == "draining"
    admission.done(held)
    assert admission.wait_idle(0.0)
    assert _granted([held]) == ["a"]


def test_a_granted_call_whose_rpc_ended_gives_its_slot_on() -> None:
    """A call granted a slot whose RPC ended before it ran does not run: its wait answers
    "ended" and the slot goes to the next waiting call."""
    admission = Admission(1, 4)
    held = admission.enter("a")
    assert held is not None
    assert not admission.withdraw(held, "ended")
    other = admission.enter("b")
    assert other is not None
    assert other.state == "queued"
    assert admission.wait(held) == "ended"
    assert admission.wait(other) == "granted"


def test_serve_takes_max_queued() -> None:
    from shard_engine_api.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--engine", "fake", "--layers", "0:6", "--max-queued", "8"]
    )
    assert args.max_queued == 8
    defaults = build_parser().parse_args(["serve", "--engine", "fake", "--layers", "0:6"])
    assert defaults.max_queued == 256
    assert defaults.workers is None  # 16 threads, compute slots following --max-sessions


def test_many_exports_at_once_wait_for_their_stream_slot_never_refused(
    serve: ServeFactory, remote: RemoteFactory, transport: str
) -> None:
    """16 clients exporting at once from a server of one stream slot (exports taking 20 ms):
    the 15 beyond it wait in the streams' queue, each export runs once, none is refused (the
    refusals, retried, cost the engine's threads the CPU the engine needs)."""
    slow_exports = config(faults=delay("export_session", 20))
    server = serve(slow_exports, transport=transport, max_workers=5, max_queued=64)
    assert server.address is not None
    clients = [remote(config(target=server.address, transport=transport)) for _ in range(16)]
    for index, client in enumerate(clients):
        prefill(client, session=f"s{index}")
    gate = threading.Barrier(len(clients))

    def export(index: int) -> api.SessionSnapshot:
        gate.wait(30)
        request = api.ExportSessionRequest(request_id=f"e{index}", session=ref(f"s{index}"))
        return clients[index].export_session(request)

    exports = [Background(functools.partial(export, index)) for index in range(len(clients))]
    for index, call in enumerate(exports):
        snapshot = call.result(timeout=120)
        assert isinstance(snapshot, api.SessionSnapshot)
        assert snapshot.session == ref(f"s{index}")
    assert server.stats().busy == 0
    assert sum(client.busy_retries for client in clients) == 0
    assert server.engine.metrics().requests == 32  # 16 prefills, 16 exports: each once
